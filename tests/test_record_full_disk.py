"""A recorder that cannot start its route (a full disk: ENOSPC while its first files are written) removes the
segment folder and files it made, and only those, and says so in its one line: supervisord's restarts of
``chestnut record`` (it dies within ``startsecs``) leave no empty route folders (``msgs/logfile.py``
``RouteWriter._open_segment``, ``_SegmentFileWriter.discard``)."""

import argparse
import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest

from chestnut.msgs import logfile, logger
from chestnut.msgs.messaging import new_message

ENOSPC_LINE = "cannot write the log: [Errno 28] No space left on device"


class _Disk:
    """A disk with ``room`` bytes left for every file ``msgs/logfile.py`` opens: the write past it writes what
    fits and fails with ENOSPC, as write(2) on a full file system does (tests/test_full_disk_outputs.py's
    ``_FullFile``, shared by the files); ``on_full(path)`` runs once, before that first ENOSPC."""

    def __init__(self, room: int, on_full: Callable[[Path], None] | None = None) -> None:
        self.room, self.on_full = room, on_full
        self.opened: list[Path] = []
        self._real_open = logfile.open_private

    def open_private(self, path: Path, mode: Literal["ab", "xb"] = "ab") -> Any:
        self.opened.append(Path(path))
        return _File(self, Path(path), self._real_open(path, mode))


class _File:
    def __init__(self, disk: _Disk, path: Path, fh: Any) -> None:
        self._disk, self._path, self._fh = disk, path, fh

    def write(self, data: bytes) -> int:
        if len(data) > self._disk.room:
            self._fh.write(bytes(data[: self._disk.room]))
            self._fh.flush()
            self._disk.room = 0
            if self._disk.on_full is not None:
                on_full, self._disk.on_full = self._disk.on_full, None
                on_full(self._path)
            raise OSError(errno.ENOSPC, "No space left on device")
        self._disk.room -= len(data)
        return int(self._fh.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)


def _full(monkeypatch: pytest.MonkeyPatch, room: int, on_full: Callable[[Path], None] | None = None) -> _Disk:
    disk = _Disk(room, on_full)
    monkeypatch.setattr(logfile, "open_private", disk.open_private)
    return disk


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _record(log_dir: Path, caplog: pytest.LogCaptureFixture, *extra: str) -> tuple[int, list[str]]:
    p = argparse.ArgumentParser()
    logger.add_arguments(p)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="chestnut.record"):
        rc = logger.run(p.parse_args(["--log-dir", str(log_dir), *extra]))
    return rc, [r.getMessage() for r in caplog.records if r.name == "chestnut.record"]


@pytest.mark.parametrize(
    ("formats", "full", "light", "room", "files"),
    [
        (("zst", "mcap"), True, False, 0, ["rlog.zst"]),  # full at the first file's header
        (("zst", "mcap"), True, False, 1000, ["rlog.zst", "rlog.mcap"]),  # the zst started (~500 B), the mcap not
        (("mcap",), True, True, 8000, ["rlog.mcap", "qlog.mcap"]),  # the rlog started (~5 kB), the qlog not
    ],
)
def test_a_route_that_cannot_start_leaves_no_folder(tmp_path, monkeypatch, formats, full, light, room, files):
    disk = _full(monkeypatch, room)
    with pytest.raises(OSError) as e:
        logfile.RouteWriter(tmp_path, formats=formats, full=full, light=light, route="r")
    assert e.value.errno == errno.ENOSPC
    assert disk.opened == [tmp_path / "r--0" / f for f in files]
    assert _tree(tmp_path) == []


def test_five_restarts_of_a_recorder_on_a_full_disk_leave_no_route_folder(tmp_path, monkeypatch, caplog):
    _full(monkeypatch, 0)
    logs = tmp_path / "logs"
    for _ in range(5):  # supervisord's start retries
        assert _record(logs, caplog) == (1, [ENOSPC_LINE])
    assert _tree(tmp_path) == ["logs"]  # the --log-dir it was given, created 0700, stays


def test_what_another_put_in_the_segment_folder_stays_with_the_folder(tmp_path, monkeypatch):
    def plant(path: Path) -> None:
        (path.parent / "notes.txt").write_text("not the recorder's")

    _full(monkeypatch, 0, plant)
    with pytest.raises(OSError):
        logfile.RouteWriter(tmp_path, formats=("zst",), route="r")
    assert _tree(tmp_path) == ["r--0", "r--0/notes.txt"]
    assert (tmp_path / "r--0" / "notes.txt").read_text() == "not the recorder's"


def test_a_symlink_put_in_place_of_its_file_is_neither_followed_nor_removed(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    log_dir = tmp_path / "logs"

    def swap(path: Path) -> None:  # the recorder's file moved away, a symlink left at its name
        os.rename(path, tmp_path / "moved.zst")
        os.symlink(victim, path)

    _full(monkeypatch, 0, swap)
    with pytest.raises(OSError):
        logfile.RouteWriter(log_dir, formats=("zst",), route="r")
    assert _tree(log_dir) == ["r--0", "r--0/rlog.zst"]
    assert os.readlink(log_dir / "r--0" / "rlog.zst") == str(victim)
    assert victim.read_text() == "keep" and (tmp_path / "moved.zst").exists()


def test_a_rollover_that_cannot_start_removes_its_folder_and_is_tried_again(tmp_path, monkeypatch):
    clock = [0.0]
    w = logfile.RouteWriter(tmp_path, formats=("zst",), segment_seconds=1.0, clock=lambda: clock[0], route="r")
    m = new_message("modelOutput")
    m.logMonoTime = t_ns = time.monotonic_ns() + 10**9  # after the headers, stamped now
    data = m.to_bytes()
    w.write("modelOutput", t_ns, data)
    disk = _full(monkeypatch, 0)
    clock[0] = 1.0
    with pytest.raises(OSError):
        w.write("modelOutput", t_ns, data)
    assert (w.segment, _tree(tmp_path)) == (0, ["r--0", "r--0/rlog.zst"])
    disk.room = 1 << 20  # space again: the next write opens segment 1
    w.write("modelOutput", t_ns, data)
    w.close()
    assert (w.segment, _tree(tmp_path)) == (1, ["r--0", "r--0/rlog.zst", "r--1", "r--1/rlog.zst"])
    assert [s for _, s, _ in logfile.LogReader([tmp_path / "r--1"])] == ["initData", "modelOutput"]
