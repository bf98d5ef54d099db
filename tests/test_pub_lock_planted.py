"""A publisher lock file that is not ours (``msgs/messaging.py`` ``take_pub_lock``) is refused in one line
naming the file and the fix, exit 2, as a subverted runtime directory is; its target is never touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import planted
import pytest

from chestnut.msgs.messaging import PubLockError, SocketPathError, pub_sock, take_pub_lock
from chestnut.msgs.paths import RuntimeDirError, runtime_dir

CHESTNUT = str(Path(sys.executable).with_name("chestnut"))


def _fix(lock: Path) -> str:
    return f": not ours, refused; remove it (rm {lock}) and start again"


def test_a_symlinked_lock_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    lock = runtime_dir() / "cameraFrame.pub.lock"
    lock.symlink_to(victim)
    with pytest.raises(PubLockError) as e:
        take_pub_lock("cameraFrame")
    assert str(e.value) == f"publisher lock file {lock} is a symlink{_fix(lock)}"
    assert isinstance(e.value, RuntimeDirError) and e.value.path == lock
    assert victim.read_text() == "precious\n" and victim.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize(
    ("plant", "problem"),
    [
        ("fifo", "is not a regular file"),
        ("dir", "is not a regular file"),
        ("0644", "is reachable by group/other (mode 0644)"),
    ],
)
def test_a_lock_that_is_not_a_private_file_of_ours_is_refused(plant, problem):
    lock = runtime_dir() / "modelOutput.pub.lock"
    if plant == "fifo":
        os.mkfifo(lock, 0o600)
    elif plant == "dir":
        lock.mkdir(0o700)
    else:
        lock.write_text("")
        lock.chmod(0o644)
    with pytest.raises(PubLockError) as e:
        take_pub_lock("modelOutput")
    assert str(e.value) == f"publisher lock file {lock} {problem}{_fix(lock)}"


def test_a_lock_of_another_uid_is_refused():
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    lock = runtime_dir() / "modelOutput.pub.lock"
    lock.write_text("")
    lock.chmod(0o600)
    os.chown(lock, 65534, 65534)
    with pytest.raises(PubLockError) as e:
        take_pub_lock("modelOutput")
    assert str(e.value) == f"publisher lock file {lock} belongs to uid 65534, not to uid 0{_fix(lock)}"


def test_our_own_lock_file_is_taken_again():
    fd = take_pub_lock("modelOutput")
    os.close(fd)
    fd = take_pub_lock("modelOutput")
    try:
        assert os.pread(fd, 32, 0) == f"{os.getpid()}\n".encode()
    finally:
        os.close(fd)


def test_the_camera_refuses_a_planted_lock_in_one_line_exit_2(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    lock = runtime_dir() / "cameraFrame.pub.lock"
    lock.symlink_to(victim)
    r = subprocess.run(
        [CHESTNUT, "camera", "--frames", "3", "--start-delay", "0", "--synthetic"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"chestnut camera: publisher lock file {lock} is a symlink{_fix(lock)}"]
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize(("plant", "what"), [("file", "a regular file"), ("dir", "a directory"),
                                             ("symlink", "a symlink")])
def test_a_file_planted_at_a_socket_path_is_refused_and_never_replaced(plant, what, tmp_path):
    """ZeroMQ's ipc bind unlinks whatever lies at the path: a planted file must be refused before it, and kept."""
    path = runtime_dir() / "cameraFrame"
    victim = tmp_path / "victim"
    planted.plant(path, plant, victim)
    with pytest.raises(SocketPathError) as e:
        pub_sock("cameraFrame")
    assert str(e.value) == (f"socket path {path} holds {what}, not a socket: refused, nothing replaced; remove it "
                            "and start again")
    assert isinstance(e.value, RuntimeDirError) and e.value.path == path
    assert os.path.lexists(path) and victim.read_text() == "precious\n"
    if plant == "file":
        assert path.read_text() == "important\n"
    os.close(take_pub_lock("cameraFrame"))  # the refusal gave the publisher lock back


def test_the_camera_refuses_a_file_planted_at_its_socket_path_in_one_line_exit_2():
    path = runtime_dir() / "cameraFrame"
    path.write_text("important\n")
    r = subprocess.run([CHESTNUT, "camera", "--frames", "3", "--start-delay", "0", "--synthetic"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [  # the refusal alone: no scheduling line before it
        f"chestnut camera: socket path {path} holds a regular file, not a socket: refused, nothing replaced; remove "
        "it and start again"]
    assert path.read_text() == "important\n"


def test_the_control_daemon_refuses_a_planted_lock_in_its_one_line_exit_2(tmp_path):
    """It said its SCHED_FIFO scheduling first (an INFO line, or a WARNING where refused)."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    lock = runtime_dir() / "controlState.pub.lock"
    lock.symlink_to(victim)
    r = subprocess.run([CHESTNUT, "control"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [f"chestnut control: publisher lock file {lock} is a symlink{_fix(lock)}"]
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize(("name", "plant", "what"), [("twinState", "dir", "a directory"),
                                                     ("twinFault.pub.lock", "symlink", None)])
def test_twin_serve_refuses_a_path_planted_at_its_publishers_in_its_one_line_exit_2(name, plant, what, tmp_path):
    """The twin's bridge said its scheduling (``bridge: threads at SCHED_RR priority 20``) before the refusal of
    its publishers' sockets and locks: it says it once they are taken."""
    victim = tmp_path / "victim"
    path = runtime_dir() / name
    planted.plant(path, plant, victim)
    r = subprocess.run([CHESTNUT, "twin", "serve"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    why = (f"publisher lock file {path} is a symlink{_fix(path)}" if what is None else
           f"socket path {path} holds {what}, not a socket: refused, nothing replaced; remove it and start again")
    assert [line.split(" ", 2)[2] for line in r.stderr.splitlines()] == [f"ERROR chestnut.backend.sim.daemon: {why}"]
    assert os.path.lexists(path) and victim.read_text() == "precious\n"


@pytest.mark.parametrize("plant", ["dir", "symlink"])
def test_the_demo_refuses_a_planted_lock_in_one_line_exit_2_before_its_publisher_starts(plant, tmp_path, capsys):
    """The demo's publishing child met it: a PubLockError traceback, exit 1."""
    from chestnut.launch.cli import main

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    lock = runtime_dir() / "cameraFrame.pub.lock"
    if plant == "dir":
        lock.mkdir(0o700)
    else:
        lock.symlink_to(victim)
    problem = "is not a regular file" if plant == "dir" else "is a symlink"
    assert main(["demo", "--seconds", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"chestnut demo: publisher lock file {lock} {problem}{_fix(lock)}\n"
    assert captured.out == ""  # no status line: nothing was started
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize(("service", "plant"), [("cameraFrame", "lock"), ("chestnutHealth", "lock"),
                                                ("controlState", "socket")])
def test_the_launch_refuses_a_planted_lock_or_socket_path_of_any_program_before_anything_starts(service, plant,
                                                                                                tmp_path, capsys):
    """The camera met it after the whole stack had started: one of ~50 lines said supervisorctl's exit 7, the
    lock file was named only in camera.log."""
    from chestnut.launch.cli import main

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    path = runtime_dir() / (f"{service}.pub.lock" if plant == "lock" else service)
    path.symlink_to(victim)
    runs = tmp_path / "runs"
    assert main(["launch", "--seconds", "5", "--no-live", "--runs-dir", str(runs)]) == 2
    err = capsys.readouterr().err
    assert err == (f"chestnut launch: publisher lock file {path} is a symlink{_fix(path)}\n" if plant == "lock" else
                   f"chestnut launch: socket path {path} holds a symlink, not a socket: refused, nothing replaced; "
                   "remove it and start again\n")
    assert not runs.exists() and victim.read_text() == "precious\n"


@pytest.mark.parametrize(("name", "plant", "what"), [("twin.sock", "dir", "a directory"),
                                                     ("twin.sock", "symlink", "a symlink"),
                                                     ("supervisor.sock", "file", "a regular file"),
                                                     ("cameraFrame.vipc", "file", "a regular file"),
                                                     ("cameraFrame.vipc", "dir", "a directory")])
def test_the_launch_refuses_a_path_planted_at_the_twins_or_supervisords_socket_before_anything_starts(
        name, plant, what, tmp_path, capsys):
    """A directory at twin.sock made the twin exit at every restart while the fallback served and launch said
    'contracts: no violation', exit 0; a file at the camera's frame ring hand-over (cameraFrame.vipc) stopped the
    camera after the stack had started (a shm transport), exit 1."""
    from chestnut.launch.cli import main

    victim = tmp_path / "victim"
    path = runtime_dir() / name
    planted.plant(path, plant, victim)
    runs = tmp_path / "runs"
    assert main(["launch", "--seconds", "5", "--no-live", "--runs-dir", str(runs)]) == 2
    assert capsys.readouterr().err == (f"chestnut launch: socket path {path} holds {what}, not a socket: refused, "
                                       "nothing replaced; remove it and start again\n")
    assert not runs.exists() and os.path.lexists(path) and victim.read_text() == "precious\n"
    if plant == "file":
        assert path.read_text() == "important\n"
