"""A disk that fills up while ``chestnut export`` writes its ``.mcap``: one line naming the output, exit 2, and
no partial file left behind to block a rerun (``msgs/export.py`` ``export_mcap``, ``_on_disk``)."""

import argparse
import errno
import logging
from pathlib import Path
from typing import Any

import pytest

from chestnut.msgs import export, logfile
from chestnut.msgs.messaging import new_message


class _FullFile:
    """A file on a disk with ``room`` bytes left: the write past it writes what fits and fails with ENOSPC, as
    write(2) on a full file system does."""

    def __init__(self, fh: Any, room: int) -> None:
        self._fh, self.room = fh, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            self._fh.write(bytes(data[: self.room]))
            self._fh.flush()
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return int(self._fh.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)


def _log(tmp_path: Path, n: int) -> tuple[Path, int]:
    from drivelog import write_drive

    items = []
    for i in range(n):
        m = new_message("modelOutput")
        m.logMonoTime = 10**9 + i * 10**7
        m.modelOutput.frameId = i
        items.append((m.logMonoTime, "modelOutput", m.to_bytes()))
    segments = write_drive(items, tmp_path / "logs")
    return tmp_path / "logs", n + len(segments)  # each segment starts with the log's initData


def _run(logs: Path, out: Path, caplog: pytest.LogCaptureFixture) -> tuple[int, list[str]]:
    p = argparse.ArgumentParser()
    export.add_arguments(p)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="chestnut.export"):
        rc = export.run(p.parse_args([str(logs), "--mcap", str(out)]))
    return rc, [r.getMessage() for r in caplog.records if r.name == "chestnut.export"]


@pytest.mark.parametrize(("messages", "room"), [(20, 3000), (5000, 60_000)])  # full at the close, or at a chunk
def test_an_export_onto_a_full_disk_is_one_line_and_leaves_no_file(tmp_path, monkeypatch, caplog, messages, room):
    logs, written = _log(tmp_path, messages)
    real_open = logfile.open_private
    monkeypatch.setattr(logfile, "open_private", lambda path, mode="ab": _FullFile(real_open(path, mode), room))
    out = tmp_path / "out" / "x.mcap"
    out.parent.mkdir(0o700)  # an export's folder is never made (msgs/outdir.py missing_folder)
    rc, lines = _run(logs, out, caplog)
    assert (rc, lines) == (2, [f"--mcap {out} cannot be written (No space left on device); free space or give "
                               "another directory"])
    assert list(out.parent.iterdir()) == []
    monkeypatch.setattr(logfile, "open_private", real_open)  # space again: the rerun is not refused
    rc, lines = _run(logs, out, caplog)
    assert (rc, lines) == (0, [f"wrote {written} messages to {out}"])


class _OsOnAFullDisk:
    """``os`` for ``node/offline/fleet.py`` with ``room`` bytes left on the disk, shared by every file opened
    for writing."""

    def __init__(self, room: int) -> None:
        self.room = room

    def fdopen(self, fd: int, mode: str) -> Any:
        import os

        f = os.fdopen(fd, mode)
        return _Disk(self, f) if "w" in mode else f

    def __getattr__(self, name: str) -> Any:
        import os

        return getattr(os, name)


class _Disk(_FullFile):
    def __init__(self, disk: _OsOnAFullDisk, fh: Any) -> None:
        super().__init__(fh, disk.room)
        self.disk = disk

    def write(self, data: bytes) -> int:
        self.room = self.disk.room
        try:
            return super().write(data)
        finally:
            self.disk.room = self.room

    def __enter__(self) -> "_Disk":
        return self

    def __exit__(self, *exc: object) -> None:
        self._fh.close()


@pytest.mark.parametrize("out_there", [False, True])
def test_fleet_make_onto_a_full_disk_is_one_line_and_removes_what_it_made(
    tmp_path, monkeypatch, caplog, capsys, out_there
):
    from chestnut.node.offline import fleet, fleet_cli

    logs, _ = _log(tmp_path, 1000)  # 4 segments
    size = sum(f.stat().st_size for f in logs.rglob("rlog.zst"))
    out = tmp_path / "fleet"
    if out_there:
        out.mkdir(mode=0o700)
    monkeypatch.setattr(fleet, "os", _OsOnAFullDisk(room=size + size // 2))  # full in the second of 3 copies
    p = argparse.ArgumentParser()
    fleet_cli.add_arguments(p)
    args = p.parse_args(["make", "--from", str(logs), "--copies", "3", str(out)])
    with caplog.at_level(logging.INFO):
        rc = fleet_cli.run(args)
    assert (rc, capsys.readouterr().err, [r.getMessage() for r in caplog.records]) == (2, (
        f"chestnut fleet make: OUT {out} cannot be written (No space left on device); free space or give another "
        "directory\n"), [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet", "logs"] if out_there else ["logs"]
    if out_there:
        assert list(out.iterdir()) == []


def test_fleet_make_past_the_file_size_limit_is_one_line_and_removes_what_it_made(tmp_path):
    """``ulimit -f``: write(2) fails with EFBIG (Python ignores SIGXFSZ). It was a traceback, exit 1."""
    import resource
    import subprocess
    import sys

    logs, _ = _log(tmp_path, 1000)
    limit = max(f.stat().st_size for f in logs.rglob("rlog.zst")) // 2  # the first copy of the biggest file stops
    out = tmp_path / "fleet"
    proc = subprocess.run(
        [sys.executable, "-m", "chestnut.launch.cli", "fleet", "make", "--from", str(logs), "--copies", "2", str(out)],
        capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    assert (proc.returncode, proc.stderr) == (2, (
        f"chestnut fleet make: OUT {out} cannot be written (File too large); free space or give another directory\n"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
