"""The unit of offline work, one segment file, and how a worker runs it (:func:`run_unit`).

Shared by the executors (:mod:`~chestnut.node.offline.executor`: ``local``;
:mod:`~chestnut.node.offline.ray_executor`: ``ray``), which change where a unit runs, never what it
computes (``docs/offline.md``).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from chestnut.node.offline.replay import SegmentResult, SegmentTask, replay_segment
from chestnut.node.offline.timeline import FileExtract, extract_file

EXECUTORS = ("local", "ray")
KIND_REPLAY = "replay"
KIND_EXTRACT = "extract"
MAX_ATTEMPTS = 3  # tries of one unit whose worker died under it, before it is reported as failed
MAX_SHIP_BYTES = 2 << 30
"""Largest segment shipped through the object store (bytes; ``--ship-logs``): the segment file and the
video files beside it together, 2 GiB (a minute of raw 704x576 frames is about 1.4 GB, of FFV1 video
0.2 GB: ``README.md``). A larger one is refused with its size; read it from a shared path instead."""

Shipped = dict[str, bytes]
"""A segment as shipped: file name -> bytes, the segment file first, then the segment directory's video
files (``msgs/video.py``: ``fcamera.mkv``, ``fcamera-<n>.mkv``), which a video-logged segment's frames
are decoded from."""
RAY_INSTALL_HINT = (
    "--executor ray needs Ray, which is not installed: pip install 'chestnut[cluster]' "
    "(or run bash launch/setup.sh, which installs it)"
)


class ExecutorError(RuntimeError):
    """An executor cannot start: Ray missing, no cluster at the address, a segment too large to ship."""


@dataclass(frozen=True)
class Unit:
    """One segment file of one log. ``log`` is the route (``<route>--<n>`` directories), ``index`` the
    segment's place in it (0-based), ``task`` the replay task (``kind`` replay only)."""

    kind: str
    log: str
    index: int
    path: str
    task: SegmentTask | None = None
    next_path: str | None = None  # the file the unit also reads (replay: answers that crossed over)

    @property
    def key(self) -> tuple[str, int]:
        return (self.log, self.index)


@dataclass
class Outcome:
    """A finished unit: ``result`` (a :class:`SegmentResult` or :class:`FileExtract`) or ``error``;
    ``worker`` is ``pid@host``; ``attempts`` > 1 when a worker died under it; ``queued_s`` / ``done_s``:
    when it was handed out and when its result arrived (s since the run started)."""

    unit: Unit
    result: SegmentResult | FileExtract | None
    error: str = ""
    worker: str = ""
    attempts: int = 1
    queued_s: float = 0.0
    done_s: float = 0.0
    run_s: float = 0.0  # wall time of the unit itself, in the worker


def worker_id() -> str:
    return f"{os.getpid()}@{socket.gethostname()}"


# ---------------------------------------------------------------- the unit itself (pure apart from reading)


def relocate_extract(x: FileExtract, path: str) -> FileExtract:
    """``x`` as if read from ``path`` (a shipped copy was read from a private temporary file)."""
    return replace(
        x,
        path=path,
        damage=[replace(d, path=path) for d in x.damage],
        unstamped=[replace(u, path=path) for u in x.unstamped],
    )


def _relocate_result(r: SegmentResult, path: str) -> SegmentResult:
    return replace(
        r, path=path, damage=[replace(d, path=path) for d in r.damage], extract=relocate_extract(r.extract, path)
    )


def run_unit(
    unit: Unit, data: Shipped | bytes | None = None, next_data: Shipped | bytes | None = None
) -> SegmentResult | FileExtract:
    """Run one unit in this process. ``data`` / ``next_data``: ``unit.path`` / ``unit.next_path`` when
    shipped (:func:`read_shipped`, or the segment file's bytes alone), written to a private temporary
    directory, read from there, and the paths in the result put back to the unit's own, so a shipped
    unit's result equals a read one's.

    Never raises for bad log content (damage is a result); raises
    :class:`~chestnut.backend.errors.ModelError` when a model cannot be loaded."""
    if data is None:
        return _run_at(unit, unit.path, unit.next_path)
    tmp = tempfile.mkdtemp(prefix="chestnut-unit-")  # mode 0700: nobody else reads the log
    try:
        here = _stage(Path(tmp) / "this", unit.path, data)
        nxt = (
            _stage(Path(tmp) / "next", unit.next_path, next_data) if unit.next_path and next_data is not None else None
        )
        result = _run_at(unit, here, nxt)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(result, SegmentResult):
        return _relocate_result(result, unit.path)
    return relocate_extract(result, unit.path)


def _stage(folder: Path, original: str | None, data: Shipped | bytes) -> str:
    folder.mkdir(mode=0o700)
    name = Path(str(original)).name  # the suffix decides the format
    files = {name: data} if isinstance(data, bytes) else data
    if name not in files:
        raise ValueError(f"shipped {original}: the segment file {name} is not among {sorted(files)}")
    for fname, raw in files.items():
        if Path(fname).name != fname or fname in ("", ".", ".."):
            raise ValueError(f"shipped {original}: {fname!r} is not a plain file name")
        fd = os.open(folder / fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
    return str(folder / name)


def _run_at(unit: Unit, path: str, next_path: str | None) -> SegmentResult | FileExtract:
    if unit.kind == KIND_EXTRACT:
        return extract_file(path)
    if unit.kind != KIND_REPLAY or unit.task is None:
        raise ValueError(f"unit kind must be {KIND_REPLAY!r} (with a task) or {KIND_EXTRACT!r}, got {unit.kind!r}")
    return replay_segment(replace(unit.task, path=path, next_path=next_path))


def shipped_files(path: str) -> list[Path]:
    """What ``--ship-logs`` ships for the segment file ``path``: the file, then the video files of its
    directory in order, up to the first absent or not regular one (``msgs/video.py`` ``segment_videos``)."""
    from chestnut.msgs.video import segment_videos

    return [Path(path), *segment_videos(Path(path), strict=False)]


def read_shipped(path: str) -> Shipped:
    """A segment's files for ``--ship-logs`` (:func:`shipped_files`), read with their total bounded by
    :data:`MAX_SHIP_BYTES`; raises :class:`ExecutorError` for a larger segment."""
    files = shipped_files(path)
    size = sum(os.stat(f).st_size for f in files)
    if size > MAX_SHIP_BYTES:
        raise ExecutorError(
            f"{path}: {size} bytes with its {len(files) - 1} video file(s) is over the {MAX_SHIP_BYTES} bytes "
            "shipped per segment (--ship-logs): put the logs on a path every worker reads and drop --ship-logs"
        )
    out: Shipped = {}
    left = MAX_SHIP_BYTES
    for f in files:
        with open(f, "rb") as fh:
            out[f.name] = raw = fh.read(left + 1)
        left -= len(raw)
        if left < 0:  # grew while read
            raise ExecutorError(f"{f}: grew over the {MAX_SHIP_BYTES} bytes shipped per segment while read")
    return out
