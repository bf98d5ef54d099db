"""An output given on the command line whose folder does not exist is one line, exit 2, and nothing is made:
``chestnut export LOG --mcap /nonexist/c.mcap`` created ``/nonexist/`` (as root, at the filesystem's root) where
``chestnut model prepare --out`` and ``chestnut launch --json`` refuse a missing folder. Every command now
checks its outputs with the one rule (``msgs/outdir.py`` ``missing_folder``): an output (a file, or a directory
made for it) is created, never the folders above it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chestnut.msgs.outdir import missing_folder

CHESTNUT = "import sys; from chestnut.launch.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.fixture(scope="module")
def one_message_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from drivelog import write_one_message_log

    return write_one_message_log(tmp_path_factory.mktemp("one-message") / "logs")


@pytest.mark.parametrize(("args", "target", "prefix"), [
    (["export", "{log}", "--mcap", "{out}"], "c.mcap", "ERROR chestnut.export: --mcap "),
    (["check", "{log}", "--report", "{out}"], "report", "chestnut check: --report "),
    (["replay", "{log}", "--report", "{out}"], "report", "chestnut replay: --report "),
    (["fleet", "make", "--from", "{log}", "--copies", "2", "{out}"], "fleet", "chestnut fleet make: OUT "),
    (["record", "--log-dir", "{out}"], "logs", "ERROR chestnut.record: --log-dir "),
])
def test_an_output_whose_folder_is_missing_is_one_line_and_nothing_is_made(
        args: list[str], target: str, prefix: str, one_message_log: Path, tmp_path: Path) -> None:
    out = tmp_path / "nonexist" / "x" / target
    argv = [a.format(log=one_message_log, out=out) for a in args]
    env = {**os.environ, "CHESTNUT_PREFIX": f"ofm{os.getpid()}", "XDG_RUNTIME_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", CHESTNUT, *argv], capture_output=True, text=True, timeout=120,
                          env=env)
    lines = proc.stderr.splitlines()
    assert (proc.returncode, len(lines), proc.stdout) == (2, 1, ""), proc.stderr
    line = lines[0].split(" ", 2)[2] if prefix.startswith("ERROR") else lines[0]  # less a log line's time stamp
    assert line == f"{prefix}{out}: folder {out.parent} does not exist; create it or give another path"
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # not even the runtime directory


def test_missing_folder_names_the_folder_and_passes_any_existing_entry(tmp_path: Path) -> None:
    assert missing_folder(tmp_path / "a" / "b.mcap") == (
        f"{tmp_path / 'a' / 'b.mcap'}: folder {tmp_path / 'a'} does not exist; create it or give another path")
    assert missing_folder(tmp_path / "b.mcap") is None
    assert missing_folder("b.mcap") is None  # the working directory
    (tmp_path / "file").write_text("")
    assert missing_folder(tmp_path / "file" / "b.mcap") is None  # not a folder: private_dir says so
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    assert missing_folder(tmp_path / "dangling" / "b.mcap") is None  # a symlink: private_dir refuses it
