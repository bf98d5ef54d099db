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
    rc, lines = _run(logs, out, caplog)
    assert (rc, lines) == (2, [f"--mcap {out} cannot be written (No space left on device); free space or give "
                               "another directory"])
    assert list(out.parent.iterdir()) == []
    monkeypatch.setattr(logfile, "open_private", real_open)  # space again: the rerun is not refused
    rc, lines = _run(logs, out, caplog)
    assert (rc, lines) == (0, [f"wrote {written} messages to {out}"])
