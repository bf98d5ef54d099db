"""``chestnut export LOG --mcap OUT``: convert an existing log into an MCAP file Foxglove opens.

Reads every message of ``LOG`` (files or directories of ``rlog.zst`` / ``rlog.mcap`` segments, in
time order across segments, :class:`~chestnut.msgs.logfile.LogReader`) and writes one ``.mcap``
whose channels are JSON with JSON Schemas generated from ``msgs/chestnut.capnp`` (frames as
``foxglove.RawImage``; :mod:`chestnut.msgs.jsonschema`); ``--with-capnp`` keeps the Cap'n Proto
channels as well (exact replay from the one file). A damaged input is exported up to the damage,
and each damage is named on one line. ``OUT`` must not exist (it is never overwritten); it is created
0600 (``msgs/outdir.py``, a missing directory 0700) and removed again when no message could be
exported or the export stops on an error, so a failed export leaves nothing behind to block a rerun.
Every bad path is one line: which path, what is wrong, how to fix it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from chestnut.msgs.logfile import FlushPolicy, LogReader, McapSegmentWriter
from chestnut.msgs.outdir import OutputDirError

_log = logging.getLogger("chestnut.export")


class NothingToExportError(ValueError):
    """Not one message of the input could be read (``out`` is removed again)."""


def export_mcap(logs: list[Path], out: Path, with_capnp: bool = False) -> tuple[int, list[str]]:
    """Write ``out`` from ``logs``; returns (messages written, damage lines).

    Raises ``FileNotFoundError`` when no log is found, :class:`~chestnut.msgs.outdir.OutputExistsError`
    (a ``FileExistsError``) if ``out`` exists, :class:`~chestnut.msgs.outdir.OutputDirError` for an
    unfit output path and :class:`NothingToExportError` when no message could be read; in the last
    case, and on any error after ``out`` was created, ``out`` is removed."""
    reader = LogReader(logs)
    encodings = ("capnproto", "json") if with_capnp else ("json",)
    writer = McapSegmentWriter(out, FlushPolicy(every_messages=1000, interval_s=60.0), encodings=encodings)
    done = False
    try:
        for log_mono_time, service, data in reader.iter_raw():
            writer.write(service, log_mono_time, data)
        writer.close()
        if writer.messages == 0:
            damage = "; ".join(str(d) for d in reader.damage) or "the log holds no message"
            raise NothingToExportError(
                f"nothing exported from {' '.join(map(str, logs))} ({damage}); {out} not written: "
                "give a log that chestnut record wrote"
            )
        done = True
    finally:
        if not done:
            writer.close()
            out.unlink(missing_ok=True)  # created exclusively by this call: ours to remove
    return writer.messages, [str(d) for d in reader.damage]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", type=Path, metavar="LOG", help="log files or directories")
    parser.add_argument("--mcap", type=Path, required=True, metavar="OUT", help="the .mcap file to write (new)")
    parser.add_argument("--with-capnp", action="store_true", help="keep the Cap'n Proto channels too")


def run(args: argparse.Namespace) -> int:
    """0 after a complete export, 1 if the input was damaged (exported up to the damage), 2 for a bad
    path or an input with no readable message (nothing is left behind)."""
    try:
        n, damage = export_mcap(args.logs, args.mcap, args.with_capnp)
    except OutputDirError as e:  # the output path: already one line
        _log.error("--mcap %s", e)
        return 2
    except NothingToExportError as e:
        _log.error("%s", e)
        return 2
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:  # the input
        what = e if e.filename is None else f"{e.filename}: {(e.strerror or str(e)).lower()}"
        _log.error("LOG %s; give log files or directories (rlog.zst / rlog.mcap)", what)
        return 2
    for line in damage:
        _log.warning("damaged input: %s", line)
    _log.info("wrote %d messages to %s", n, args.mcap)
    return 1 if damage else 0
