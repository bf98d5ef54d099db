"""``chestnut export LOG --mcap OUT``: convert an existing log into an MCAP file Foxglove opens.

Reads every message of ``LOG`` (files or directories of ``rlog.zst`` / ``rlog.mcap`` segments, in
time order across segments, :class:`~chestnut.msgs.logfile.LogReader`) and writes one ``.mcap``
whose channels are JSON with JSON Schemas generated from ``msgs/chestnut.capnp`` (frames as
``foxglove.RawImage``; :mod:`chestnut.msgs.jsonschema`); ``--with-capnp`` keeps the Cap'n Proto
channels as well (exact replay from the one file). A frame logged as video (``chestnut record --frames
video``, ``msgs/video.py``) is decoded from its segment's ``fcamera.mkv`` and exported with its pixels
inline (``data`` filled, ``video`` kept to say where they came from), so the exported file stands alone;
one whose video is missing or damaged is exported as metadata without an image, and each such video
file is named on one line like any damage (its first failing frame, and how many more failed). A
damaged input is exported up to the damage, and each damage is named on one line. ``OUT`` must not
exist (it is never overwritten) and its folder must (it is never created); it is created 0600 (``msgs/outdir.py``) and
removed again when no message could be exported or the export stops on an error (a full disk is one line
naming ``OUT``, exit 2), so a failed export leaves nothing behind to block a rerun.
Every bad path is one line: which path, what is wrong, how to fix it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chestnut.msgs.argtypes import path_arg
from chestnut.msgs.clock import logged_unix_offset_ns
from chestnut.msgs.logfile import FlushPolicy, LogPathError, LogReader, McapSegmentWriter, first_item
from chestnut.msgs.outdir import OutputDirError, missing_folder
from chestnut.msgs.video import LoggedFrames, NotRegularFileError, VideoFrameError

_log = logging.getLogger("chestnut.export")


def _offset(logs: list[Path]) -> int | None:
    """The Unix-time offset the log was written with (``msgs/clock.py``), from its first ``initData``; None
    (taken now) for a log without one.

    The first is the earliest segment header (each file's first message in file order, ``msgs/logfile.py``), not
    the earliest ``initData`` by time: a segment after the first repeats the node's most recent ``initData`` right
    after its header with the original's older ``logMonoTime`` (``CARRIED_SERVICES``), whose own wall time is the
    node's, not the route's offset. A log whose files do not start with a header: its first ``initData`` by time."""
    headers = []
    for path in LogReader(logs).files:
        item, _ = first_item(path, warn_json_only=False)
        if item is not None and item[1] == "initData":
            headers.append((item[0], item[3]))
    if headers:
        t, event = min(headers, key=lambda h: h[0])
        return logged_unix_offset_ns(t, event.initData)
    for t, service, event in LogReader(logs):
        if service == "initData":
            return logged_unix_offset_ns(t, event.initData)
    return None


class NothingToExportError(ValueError):
    """Not one message of the input could be read (``out`` is removed again)."""


def export_mcap(logs: list[Path], out: Path, with_capnp: bool = False) -> tuple[int, list[str]]:
    """Write ``out`` from ``logs``; returns (messages written, damage lines).

    Raises ``FileNotFoundError`` when no log is found, ``ValueError`` for a given file that is no log (neither
    ``.zst`` nor ``.mcap``; raised before ``out`` is created), :class:`~chestnut.msgs.outdir.OutputExistsError`
    (a ``FileExistsError``) if ``out`` exists, :class:`~chestnut.msgs.outdir.OutputDirError` for an
    unfit output path and :class:`NothingToExportError` when no message could be read; in the last
    case, and on any error after ``out`` was created, ``out`` is removed."""
    reader = LogReader(logs)
    encodings = ("capnproto", "json") if with_capnp else ("json",)
    writer = McapSegmentWriter(
        out, FlushPolicy(every_messages=1000, interval_s=60.0), encodings=encodings, unix_offset_ns=_offset(logs)
    )
    done = False
    frames: LoggedFrames | None = None
    video_damage: dict[Path, list[Any]] = {}  # video file -> [its first error, frames that failed]
    try:
        for log_mono_time, service, data, event, path in reader.iter_from():
            if service == "cameraFrame" and LoggedFrames.in_video(event.cameraFrame):
                if frames is None or frames.seg_dir != path.parent:
                    if frames is not None:
                        frames.close()
                    frames = LoggedFrames(path.parent)
                data = _decoded(event, frames, video_damage)
            _on_disk(out, writer.write, service, log_mono_time, data)
        _on_disk(out, writer.close)
        if writer.messages == 0:
            damage = "; ".join(str(d) for d in reader.damage) or "the log holds no message"
            raise NothingToExportError(
                f"nothing exported from {' '.join(map(str, logs))} ({damage}); {out} not written: "
                "give a log that chestnut record wrote"
            )
        done = True
    finally:
        if frames is not None:
            frames.close()
        if not done:
            with contextlib.suppress(OSError):  # the error that stopped the export is the one said
                writer.close()
            out.unlink(missing_ok=True)  # created exclusively by this call: ours to remove
    lines = [
        f"{e}{f'; {n - 1} more frame(s) of it without their pixels' if n > 1 else ''}" for e, n in video_damage.values()
    ]
    return writer.messages, [str(d) for d in reader.damage] + lines


def _on_disk(out: Path, call: Callable[..., None], *args: Any) -> None:
    """``call(*args)``, a write to ``out``; a write the disk refuses (full: ENOSPC, an I/O error) is raised as
    one line, :class:`~chestnut.msgs.outdir.OutputDirError` naming ``out`` (``msgs/outdir.py``
    ``write_private``'s words), and ``out`` is removed by :func:`export_mcap`."""
    try:
        call(*args)
    except OutputDirError:
        raise
    except OSError as e:
        raise OutputDirError(out, f"cannot be written ({e.strerror or e})", "free space or give another directory") \
            from None


def _decoded(event: Any, frames: LoggedFrames, damage: dict[Path, list[Any]]) -> bytes:
    """A video-logged ``cameraFrame``'s bytes with its decoded pixels in ``data``; as logged (and counted in
    ``damage`` under its video file) when they cannot be decoded."""
    try:
        pixels = frames.read(event.cameraFrame)
    except VideoFrameError as e:
        entry = damage.setdefault(Path(frames.seg_dir or ".") / str(event.cameraFrame.video.file), [e, 0])
        entry[1] += 1
        return bytes(event.as_builder().to_bytes())
    msg = event.as_builder()
    msg.cameraFrame.data = pixels.tobytes()
    return bytes(msg.to_bytes())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", type=path_arg, metavar="LOG", help="log files or directories")
    parser.add_argument("--mcap", type=path_arg, required=True, metavar="OUT", help="the .mcap file to write (new)")
    parser.add_argument("--with-capnp", action="store_true", help="keep the Cap'n Proto channels too")


def run(args: argparse.Namespace) -> int:
    """0 after a complete export, 1 if the input was damaged (exported up to the damage), 2 for a bad
    path or an input with no readable message (nothing is left behind)."""
    if (missing := missing_folder(args.mcap)) is not None:  # never made: an output's folder must exist
        _log.error("--mcap %s", missing)
        return 2
    try:
        n, damage = export_mcap(args.logs, args.mcap, args.with_capnp)
    except OutputDirError as e:  # the output path: already one line
        _log.error("--mcap %s", e)
        return 2
    except NothingToExportError as e:
        _log.error("%s", e)
        return 2
    except ValueError as e:  # the input: a file that is no log by its suffix (SegmentFileReader), as check says it
        _log.error("LOG %s; give log files or directories (rlog.zst / rlog.mcap)", e)
        return 2
    except (NotRegularFileError, LogPathError) as e:  # the input: a FIFO, a device, a path too long ... (its own fix)
        _log.error("LOG %s", e)
        return 2
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:  # the input
        what = e if e.filename is None else f"{e.filename}: {(e.strerror or str(e)).lower()}"
        _log.error("LOG %s; give log files or directories (rlog.zst / rlog.mcap)", what)
        return 2
    for line in damage:
        _log.warning("damaged input: %s", line)
    _log.info("wrote %d messages to %s", n, args.mcap)
    return 1 if damage else 0
