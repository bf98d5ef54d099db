"""A launch refused before anything starts leaves its prefix's runtime directory as it found it
(``launch/rundir.py`` ``refusal_undone``): its checks take and release every publisher lock
(``msgs/messaging.py`` ``check_publishable``), and a refusal after them (a symlink at ``--runs-dir`` or at the
run's name) removed none of the 9 lock files, nor the directory they made."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from planted import plant_run_names

from chestnut.launch.rundir import refusal_undone
from chestnut.msgs.messaging import check_publishable

CHESTNUT = str(Path(sys.executable).with_name("chestnut"))


def _launch(prefix: str, runs: Path) -> subprocess.CompletedProcess[str]:
    """``chestnut launch`` on ``prefix`` in the test's ``$XDG_RUNTIME_DIR`` (``run_base``)."""
    return subprocess.run(
        [CHESTNUT, "launch", "--seconds", "3", "--no-live", "--runs-dir", str(runs)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, CHESTNUT_PREFIX=prefix),
    )


def test_a_symlinked_runs_dir_refused_leaves_no_runtime_dir(tmp_path, run_base):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "rsl").symlink_to(tmp_path / "real")
    r = _launch("refusedrt", tmp_path / "rsl")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.splitlines()[0].endswith(f"ERROR chestnut.launch: --runs-dir: {tmp_path / 'rsl'} is a symlink; "
                                             "give the real directory or a new path")
    assert os.listdir(run_base / f"chestnut-{os.getuid()}") == []  # the shared chestnut-<uid> stays
    assert os.listdir(tmp_path / "real") == []


def test_a_symlink_at_the_runs_name_refused_keeps_a_runtime_dir_that_was_there_as_it_was(tmp_path, run_base):
    runs, victim = tmp_path / "runs", tmp_path / "victim"
    plant_run_names(runs, victim)
    old = run_base / f"chestnut-{os.getuid()}" / "keptrt"
    old.parent.mkdir(mode=0o700)
    old.mkdir(mode=0o700)
    (old / "nodeState.pub.lock").write_text("1\n")  # a lock of a stack before: not this launch's to remove
    (old / "nodeState.pub.lock").chmod(0o600)
    inode = (old / "nodeState.pub.lock").stat().st_ino
    r = _launch("keptrt", runs)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "is a symlink (never followed); remove it" in r.stderr.splitlines()[0], r.stderr
    assert sorted(os.listdir(old)) == ["nodeState.pub.lock"]
    assert (old / "nodeState.pub.lock").stat().st_ino == inode  # the same file (its holder's pid rewritten)
    assert os.listdir(victim) == []


@pytest.mark.parametrize("refusal", ["exit", "raise"])
def test_refusal_undone_removes_only_the_locks_it_made(run_base, monkeypatch, refusal):
    monkeypatch.setenv("CHESTNUT_PREFIX", "undone")
    path = run_base / f"chestnut-{os.getuid()}" / "undone"

    def checks() -> int:
        check_publishable("modelOutput")
        check_publishable("nodeState")
        assert sorted(os.listdir(path)) == ["modelOutput.pub.lock", "nodeState.pub.lock"]
        if refusal == "raise":
            raise KeyboardInterrupt
        return 2

    if refusal == "raise":
        with pytest.raises(KeyboardInterrupt):
            refusal_undone(checks)
    else:
        assert refusal_undone(checks) == 2
    assert not os.path.lexists(path)
    path.mkdir(mode=0o700)
    (path / "nodeState.pub.lock").write_text("7\n")
    (path / "nodeState.pub.lock").chmod(0o600)
    assert refusal_undone(lambda: ("prefix", path)) == ("prefix", path)  # not refused: untouched
    assert refusal_undone(checks if refusal == "exit" else lambda: 2) == 2
    assert sorted(os.listdir(path)) == ["nodeState.pub.lock"]
