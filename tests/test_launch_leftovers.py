"""What ``chestnut launch`` leaves and what it refuses about the dock's lock file: the prefix's runtime directory
goes when the stack stops, when only the stack's leftovers are in it (``launch/rundir.py``
``remove_runtime_dir``), and the dock's lock file stays (``backend/docklock.py``: unlinking a ``flock`` file
races); an unusable lock file at the twin's lock path is refused before anything starts (exit 2), and a run whose
node never took the dock for it fails in one line (exit 1)."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from chestnut.backend.docklock import dock_lock_path
from chestnut.backend.sim.cli import default_bus_address
from chestnut.launch.rundir import remove_runtime_dir
from chestnut.msgs.paths import current_prefix, runtime_base, runtime_dir

CHESTNUT = str(Path(sys.executable).with_name("chestnut"))


def _leftovers(d: Path) -> None:
    """What a stopped stack leaves: publisher lock files, a stale socket of a killed program, the twin's figure."""
    for name in ("cameraFrame.pub.lock", "nodeState.pub.lock"):
        (d / name).write_text("123\n")
        (d / name).chmod(0o600)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(d / "twin.sock"))
    s.close()
    (d / "twin-hostwait").write_bytes(bytes(24))


def test_the_runtime_directory_with_only_the_stacks_leftovers_is_removed():
    d = runtime_dir()
    _leftovers(d)
    assert remove_runtime_dir(current_prefix()) is None
    assert not os.path.lexists(d) and d.parent.is_dir()  # chestnut-<uid> is every prefix's: it stays
    assert remove_runtime_dir(current_prefix()) is None  # nothing there: nothing to say


@pytest.mark.parametrize(("name", "kind"), [("notes.txt", "file"), ("twin.sock", "file"), ("extra", "dir"),
                                            ("twin.log", "file")])
def test_a_foreign_entry_keeps_the_runtime_directory_untouched(name, kind):
    d = runtime_dir()
    _leftovers(d)
    (d / name).unlink(missing_ok=True)
    if kind == "dir":
        (d / name).mkdir()
    else:
        (d / name).write_text("important\n")
    before = sorted(os.listdir(d))
    assert remove_runtime_dir(current_prefix()) == (
        f"runtime directory {d} kept: {name} in it is not the stack's (another program's file on this prefix, "
        "say a `chestnut twin serve` of its own, or planted); remove it once nothing uses it")
    assert sorted(os.listdir(d)) == before


def test_a_held_publisher_lock_keeps_the_runtime_directory_untouched():
    d = runtime_dir()
    _leftovers(d)
    fd = os.open(d / "nodeState.pub.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a publisher that outlived the stop
        before = sorted(os.listdir(d))
        assert remove_runtime_dir(current_prefix()) == (
            f"runtime directory {d} kept: a live process holds nodeState.pub.lock")
        assert sorted(os.listdir(d)) == before
    finally:
        os.close(fd)


def _lock_path() -> Path:
    return dock_lock_path(*default_bus_address(current_prefix()))  # the tests' own temp dir (conftest.py)


@pytest.fixture
def no_lock_file() -> None:
    """The test's lock path starts empty: tinygrad never removes a lock file, and an earlier test of this worker
    whose prefix hashes to the same bus and address (``default_bus_address``, 1 in 20,000) may have left one,
    unheld (``leakguard.py`` fails a test that leaves one held)."""
    path = _lock_path()
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    elif os.path.lexists(path):
        path.unlink()


@pytest.mark.parametrize(("plant", "line"), [
    ("dir", "is a directory, not a regular file; remove it (sudo rm -r {p}) once no process uses the dock"),
    ("file", "belongs to uid {uid} with mode 0666 (writable by group/other: refused, another user could hold it); "
             "remove it (sudo rm {p}) once no process uses the dock"),
])
def test_launch_refuses_an_unusable_dock_lock_file_before_anything_starts(plant, line, tmp_path, capsys,
                                                                           no_lock_file):
    """It started, the node's every start of the primary was refused the lock, ChestnutActive was never true, and
    launch said 'contracts: no violation', exit 0."""
    from chestnut.launch.cli import main

    path = _lock_path()
    if plant == "dir":
        path.mkdir()
    else:
        path.write_text("")
        path.chmod(0o666)
    runs = tmp_path / "runs"
    try:
        assert main(["launch", "--seconds", "5", "--no-live", "--runs-dir", str(runs)]) == 2
        assert capsys.readouterr().err == (
            f"chestnut launch: the dock's lock file {path} {line.format(p=path, uid=os.getuid())} "
            "(the node could never take the dock: nothing started)\n")
        assert not runs.exists() and path.is_dir() == (plant == "dir")
        assert not os.path.lexists(runtime_base() / f"chestnut-{os.getuid()}" / current_prefix())  # checked first
    finally:
        path.rmdir() if plant == "dir" else path.unlink()


def test_a_missing_dock_lock_file_is_not_made_by_the_check(no_lock_file):
    from chestnut.launch.supervise import check_stack_sockets

    check_stack_sockets(current_prefix(), {})
    assert not os.path.lexists(_lock_path())
    _lock_path().mkdir()
    try:
        check_stack_sockets(current_prefix(), {"dock": {"kind": "cpu"}})  # a node without the twin takes no lock
    finally:
        _lock_path().rmdir()


REFUSED = ("load_failed (usb): lock_unusable: the dock's lock file /tmp/am_usb:16-31.lock is a directory, not a "
           "regular file; remove it (sudo rm -r /tmp/am_usb:16-31.lock) once no process uses the dock; retry in 2 s")


def test_a_run_whose_node_never_took_the_dock_fails_in_one_line(caplog):
    from chestnut.launch.stack import verdict
    from chestnut.launch.supervise import dock_never_taken

    summary = {"outputs": 169, "contracts": {"one_output_per_frame": 0}, "first_active_s": None,
               "transitions": [[0.6, "qualifying", "fallback_ready: fallback onnxruntime warm"],
                               [1.4, "degraded", REFUSED.replace("2 s", "1 s")],
                               [2.4, "recovering", "dock_found (usb): add1:0001 at bus 16 address 31"],
                               [3.3, "degraded", REFUSED]],
               "restarts": [{"cause": REFUSED}], "programs_not_started": {}, "outputs_lost": False}
    line = ("the node never took the dock (ChestnutActive was never true): lock_unusable: the dock's lock file "
            "/tmp/am_usb:16-31.lock is a directory, not a regular file; remove it (sudo rm -r "
            "/tmp/am_usb:16-31.lock) once no process uses the dock")
    assert dock_never_taken(summary) == line
    launch = SimpleNamespace(args=SimpleNamespace(json=None, seconds=8.0), died=False, failed_start=False,
                             faults_missed=False, flag=SimpleNamespace(signum=None))
    caplog.clear()
    assert verdict(launch, summary) == 1  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [line]
    served = {**summary, "first_active_s": 4.1}  # it took the dock once: a restart, not a start never made
    assert dock_never_taken(served) is None and verdict(launch, served) == 0  # type: ignore[arg-type]
    fallback_only = {**summary, "transitions": summary["transitions"][:1], "restarts": []}
    assert dock_never_taken(fallback_only) is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_clean_launch_removes_its_runtime_directory_and_keeps_the_dock_lock_file(tmp_path):
    """After a clean launch its <tempdir>/chestnut-<uid>/<prefix> stayed, with a lock file of every service."""
    d = runtime_dir()
    r = subprocess.run([CHESTNUT, "launch", "--seconds", "3", "--no-live", "--runs-dir", str(tmp_path / "runs")],
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not os.path.lexists(d), sorted(os.listdir(d))
    assert _lock_path().is_file()  # the flock idiom's file: kept on purpose (backend/docklock.py)
