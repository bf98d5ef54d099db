"""The dock's lock file (``backend/docklock.py``): tinygrad's path, opened without following a symlink,
never chmodded, and a file that cannot be used is the clear ``lock_unusable`` error."""

import os
import stat
import tempfile
from pathlib import Path

import pytest
from planted import plant

from chestnut.backend import docklock, real_runner
from chestnut.backend.docklock import DockLock, dock_lock_path, open_dock_lock
from chestnut.backend.errors import UsbLayerError
from chestnut.backend.sim import twin, usb3


def test_one_lock_path_for_the_real_runner_the_twin_and_its_usb3_face():
    assert real_runner.dock_lock_path is twin.dock_lock_path is usb3.dock_lock_path is dock_lock_path
    assert dock_lock_path(2, 5) == Path(tempfile.gettempdir()) / "am_usb:2-5.lock"


def test_a_planted_symlink_is_refused_and_its_target_is_left_as_it_was(tmp_path):
    target = tmp_path / "precious"
    target.write_text("mine")
    target.chmod(0o600)
    path = tmp_path / "am_usb:3-7.lock"
    path.symlink_to(target)
    with pytest.raises(UsbLayerError) as info:
        DockLock(path).acquire(timeout_s=1.0)
    assert info.value.reason == "lock_unusable"
    assert info.value.detail == (
        f"the dock's lock file {path} is a symlink (refused: it could point anywhere); "
        f"remove it (sudo rm {path}) once no process uses the dock"
    )
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and target.read_text() == "mine"


def test_a_dangling_symlink_is_refused_and_nothing_is_created_at_its_target(tmp_path):
    path = tmp_path / "am_usb:3-7.lock"
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UsbLayerError, match="is a symlink"):
        open_dock_lock(path)
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o000])
def test_a_new_lock_file_is_created_private_whatever_the_umask(tmp_path, umask):
    """Under a login shell's umask 022 it was 0644."""
    path = tmp_path / "am_usb:3-7.lock"
    old = os.umask(umask)
    try:
        lock = DockLock(path).acquire(timeout_s=1.0)
    finally:
        os.umask(old)
    lock.release()
    assert stat.S_IMODE(path.lstat().st_mode) == 0o600


def test_the_twins_usb3_face_creates_tinygrads_lock_file_private(tmp_path, monkeypatch):
    """``backend/sim/usb3.py`` takes tinygrad's lock at tinygrad's own name, created 0600."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = os.umask(0o022)
    try:
        fd = usb3.acquire_dock_lock(3, 7)
    finally:
        os.umask(old)
    try:
        assert [p.name for p in tmp_path.iterdir()] == ["am_usb:3-7.lock"]
        assert stat.S_IMODE((tmp_path / "am_usb:3-7.lock").lstat().st_mode) == 0o600
    finally:
        os.close(fd)


def test_an_existing_lock_file_is_opened_in_place_not_recreated_or_chmodded(tmp_path):
    path = tmp_path / "am_usb:3-7.lock"
    path.write_text("")
    path.chmod(0o640)
    inode = path.stat().st_ino
    DockLock(path).wait_free(timeout_s=1.0)
    assert path.stat().st_ino == inode and stat.S_IMODE(path.stat().st_mode) == 0o640


def test_a_fifo_in_its_place_is_refused_without_blocking(tmp_path):
    path = tmp_path / "am_usb:3-7.lock"
    os.mkfifo(path)
    with pytest.raises(UsbLayerError, match="is not a regular file"):
        open_dock_lock(path)


def _acquire_as_nobody(path: Path) -> tuple[str, str]:
    """(reason, detail) of DockLock(path).acquire in a forked child running as uid/gid 65534."""
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, try, report, exit without pytest's teardown
        try:
            os.close(rd)
            os.setgid(65534)
            os.setuid(65534)
            try:
                DockLock(path).acquire(1.0)
                out = "acquired\n"
            except UsbLayerError as e:
                out = f"{e.reason}\n{e.detail}"
            os.write(wr, out.encode())
        finally:
            os._exit(0)
    os.close(wr)
    with os.fdopen(rd) as f:
        text = f.read()
    os.waitpid(pid, 0)
    reason, _, detail = text.partition("\n")
    return reason, detail


def test_a_lock_file_this_user_cannot_open_read_write_is_lock_unusable(tmp_path):
    if os.getuid() != 0:
        path = tmp_path / "am_usb:3-7.lock"
        path.write_text("")
        path.chmod(0o444)
        with pytest.raises(UsbLayerError) as info:
            DockLock(path).acquire(timeout_s=1.0)
        reason, detail = info.value.reason, info.value.detail
    else:  # root opens anything: ask an unprivileged user, as tinygrad in another user's process would
        shared = Path(tempfile.mkdtemp(prefix="docklock-"))
        try:
            shared.chmod(0o755)
            path = shared / "am_usb:3-7.lock"
            path.write_text("")
            path.chmod(0o644)
            reason, detail = _acquire_as_nobody(path)
        finally:
            path.unlink()
            shared.rmdir()
    assert reason == "lock_unusable"
    assert detail == (
        f"the dock's lock file {path} cannot be opened read-write by this user (tinygrad could not "
        f"either); remove it (sudo rm {path}) once no process uses the dock"
    )


def test_the_backoff_table_is_the_one_the_real_runner_uses():
    assert real_runner.LOCK_BACKOFF_S is docklock.LOCK_BACKOFF_S


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's file needs root")


@needs_root
@pytest.mark.parametrize("mode", [0o666, 0o600])
def test_a_lock_file_planted_by_another_user_is_refused_naming_owner_and_mode(tmp_path, mode):
    """``touch /tmp/am_usb:78-12.lock; chown nobody ...; chmod 666 ...`` was accepted, and nobody's flock on it
    then failed every start ``lock_held``."""
    path = tmp_path / "am_usb:78-12.lock"
    plant(path, "file", tmp_path / "victim")
    os.chown(path, 65534, 65534)
    path.chmod(mode)
    with pytest.raises(UsbLayerError) as info:
        DockLock(path).acquire(timeout_s=1.0)
    assert info.value.reason == "lock_unusable"
    why = "not to root" + (", writable by group/other" if mode & 0o022 else "")
    assert info.value.detail == (
        f"the dock's lock file {path} belongs to uid 65534 with mode {mode:04o} ({why}: refused, another user "
        f"could hold it); remove it (sudo rm {path}) once no process uses the dock"
    )
    assert path.read_text() == "important\n" and stat.S_IMODE(path.stat().st_mode) == mode
    # for a user other than root, the owners it would take are that user and root
    assert docklock.lock_file_problem(path.stat(), 4242) == (
        f"belongs to uid 65534 with mode {mode:04o} (not to uid 4242 or root"
        + (", writable by group/other" if mode & 0o022 else "") + ": refused, another user could hold it)"
    )


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_a_lock_file_of_ours_that_others_may_write_is_refused_and_not_chmodded(tmp_path, mode):
    path = tmp_path / "am_usb:78-12.lock"
    path.write_text("")
    path.chmod(mode)
    with pytest.raises(UsbLayerError) as info:
        open_dock_lock(path)
    assert info.value.reason == "lock_unusable"
    assert info.value.detail == (
        f"the dock's lock file {path} belongs to uid {os.geteuid()} with mode {mode:04o} (writable by "
        f"group/other: refused, another user could hold it); remove it (sudo rm {path}) once no process uses the dock"
    )
    assert stat.S_IMODE(path.stat().st_mode) == mode



def test_a_holder_is_named_by_pid_and_command_in_one_bounded_line(tmp_path):
    import subprocess
    import sys

    from chestnut.backend.docklock import HOLDER_COMMAND_MAX_CHARS, describe_holders, holder_command

    path = tmp_path / "am_usb:3-7.lock"
    code = "import fcntl,os,sys;fcntl.flock(os.open(sys.argv[1],os.O_RDWR|os.O_CREAT),2);print(1,flush=True);input()"
    holder = subprocess.Popen([sys.executable, "-c", code, path.name, "a\nb", "x" * 300], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "1\n"
        # quoted as a shell takes them, cut after the last whole argument that fits
        shown = f"{sys.executable} -c '{code}' {path.name} 'a?b' ..."
        assert HOLDER_COMMAND_MAX_CHARS == 200 and len(shown) <= 200
        assert holder_command(holder.pid) == shown
        assert describe_holders(path) == f"pid {holder.pid} ({shown})"
    finally:
        holder.communicate("\n", timeout=10)
    assert describe_holders(path) == "another process"  # gone: /proc/locks names nobody
    # the node's worker: its --rt-cpus is empty (any CPU), said as '' (it read as a bare "--rt-cpus)")
    (tmp_path / "proc" / "6").mkdir(parents=True)
    (tmp_path / "proc" / "6" / "cmdline").write_bytes(b"python\0-m\0chestnut.node.worker\0--rt-cpus\0\0")
    assert holder_command(6, proc=tmp_path / "proc") == "python -m chestnut.node.worker --rt-cpus ''"
    (tmp_path / "proc" / "7").mkdir(parents=True)
    (tmp_path / "proc" / "7" / "cmdline").write_bytes(b"")  # a kernel thread's
    assert holder_command(7, proc=tmp_path / "proc") is None
    assert holder_command(8, proc=tmp_path / "proc") is None  # no such process


HAND_OVER = """
import json, os, sys, tempfile
tempfile.tempdir = sys.argv[1]
from tinygrad.runtime.support.system import System
from chestnut.backend.docklock import (DockLock, dock_lock_path, held_dock_lock, keep_umask_around_tinygrads_lock,
                                       lock_holders, open_dock_lock, try_flock)

def another_open_file_takes_it():  # flock(2): another open file description, of this or any process
    fd = open_dock_lock(path)
    try:
        return try_flock(fd)
    finally:
        os.close(fd)

out = {}
path = dock_lock_path(9, 9)
lock = DockLock(path).acquire(1.0)
out["registered"] = held_dock_lock(path) is lock
keep_umask_around_tinygrads_lock()
before = os.umask(0o027)
fd = System.flock_acquire("am_usb:9-9.lock")  # what tinygrad's USBPCIDevice calls before it opens USB
out["umask"] = f"{os.umask(before):04o}"
out["dup"] = fd != lock.fd and os.fstat(fd).st_ino == os.fstat(lock.fd).st_ino and System.lock_fd == fd
out["free_with_both"] = another_open_file_takes_it()
lock.release()
out["registered_after_release"] = held_dock_lock(path) is not None
out["free_with_tinygrads"] = another_open_file_takes_it()
out["holders"] = lock_holders(path) == [os.getpid()]
os.close(fd)
out["free_at_last"] = another_open_file_takes_it()
print(json.dumps(out))
"""


def test_a_lock_this_process_holds_is_handed_to_tinygrad_never_let_go(tmp_path):
    """The real runner with ``lock_first`` holds the lock ``usb_ids`` took while tinygrad opens the dock: tinygrad's
    ``flock_acquire`` gets a dup of it (the same flock, which tinygrad keeps), where it once had to be released for
    tinygrad to take it again -- a moment in which another process could take the dock."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("DEV", "GMMU", "HCQDEV_WAIT_TIMEOUT_MS")}
    p = subprocess.run([sys.executable, "-c", HAND_OVER, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {
        "registered": True, "umask": "0027", "dup": True, "free_with_both": False, "registered_after_release": False,
        "free_with_tinygrads": False, "holders": True, "free_at_last": True}
