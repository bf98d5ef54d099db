"""The private runtime directory (``msgs/paths.py``): refuse what another user could have planted or
could change, never chmod what we did not create, and say so in one line from every CLI program."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from chestnut.msgs import paths
from chestnut.msgs.paths import RuntimeDirError, runtime_dir

UID = os.getuid()
CHESTNUT = str(Path(sys.executable).with_name("chestnut"))


@pytest.fixture
def base(run_base):
    """A fresh, short ``$XDG_RUNTIME_DIR`` (0700, ours), removed afterwards (``tests/conftest.py`` ``run_base``)."""
    return run_base


def test_a_new_runtime_dir_is_0700_even_under_a_permissive_umask(base):
    old = os.umask(0)
    try:
        d = runtime_dir("a")
    finally:
        os.umask(old)
    assert d == base / f"chestnut-{UID}" / "a"
    assert stat.S_IMODE(d.stat().st_mode) == stat.S_IMODE(d.parent.stat().st_mode) == 0o700
    assert runtime_dir("a") == d  # a second call accepts what the first created


def test_a_symlinked_prefix_dir_is_refused_and_its_target_is_left_as_it_was(base, tmp_path):
    target = tmp_path / "x"
    target.mkdir()
    target.chmod(0o777)
    (base / f"chestnut-{UID}").mkdir(mode=0o700)
    link = base / f"chestnut-{UID}" / "a"
    link.symlink_to(target)
    with pytest.raises(RuntimeDirError) as info:
        runtime_dir("a")
    assert str(info.value) == f"runtime directory {link} is a symlink; remove it (rm {link}) and start again"
    assert info.value.path == link
    assert stat.S_IMODE(target.stat().st_mode) == 0o777 and list(target.iterdir()) == []


def test_a_symlinked_user_dir_is_refused(base, tmp_path):
    target = tmp_path / "y"
    target.mkdir(mode=0o700)
    (base / f"chestnut-{UID}").symlink_to(target)
    with pytest.raises(RuntimeDirError, match=r"chestnut-\d+ is a symlink; remove it"):
        runtime_dir("a")
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("mode", [0o777, 0o750, 0o701, 0o704], ids=lambda m: f"{m:04o}")
def test_a_dir_we_own_that_group_or_other_can_reach_is_refused_not_chmodded(base, mode):
    d = base / f"chestnut-{UID}" / "a"
    d.mkdir(parents=True)
    d.parent.chmod(0o700)
    d.chmod(mode)
    (d / "planted").write_text("")
    with pytest.raises(RuntimeDirError) as info:
        runtime_dir("a")
    assert str(info.value) == (
        f"runtime directory {d} is reachable by group/other (mode {mode:04o}, must be 0700); it is not ours to "
        f"repair: remove it (rm -r {d}) and start again, or choose another CHESTNUT_PREFIX"
    )
    assert stat.S_IMODE(d.stat().st_mode) == mode and (d / "planted").exists()


def test_a_reachable_user_dir_is_refused_without_suggesting_another_prefix(base):
    d = base / f"chestnut-{UID}"
    d.mkdir()
    d.chmod(0o777)  # shared by every prefix: another CHESTNUT_PREFIX would meet it again
    with pytest.raises(RuntimeDirError) as info:
        runtime_dir("a")
    assert str(info.value) == (
        f"runtime directory {d} is reachable by group/other (mode 0777, must be 0700); it is not ours to "
        f"repair: remove it (rm -r {d}) and start again"
    )
    assert stat.S_IMODE(d.stat().st_mode) == 0o777


def test_a_file_in_place_of_the_dir_is_refused(base):
    (base / f"chestnut-{UID}").write_text("")
    with pytest.raises(RuntimeDirError, match=r"chestnut-\d+ is not a directory; remove it"):
        runtime_dir("a")


@pytest.mark.skipif(UID != 0, reason="making a directory of another user needs root")
def test_a_dir_of_another_user_is_refused(base):
    d = base / f"chestnut-{UID}"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(RuntimeDirError, match=rf"{d} belongs to uid 65534, not to uid {UID}; it is not ours"):
        runtime_dir("a")
    assert list(d.iterdir()) == []


def test_a_base_others_can_write_is_refused_unless_sticky(base):
    base.chmod(0o777)
    with pytest.raises(RuntimeDirError, match=r"writable by group/other without the sticky bit \(mode 0777\)"):
        runtime_dir("a")
    assert list(base.iterdir()) == []
    base.chmod(0o1777)  # /tmp's rule: others cannot rename or remove what we own in it
    assert runtime_dir("a") == base / f"chestnut-{UID}" / "a"


def _sub_of_a_0777_folder(base: Path) -> tuple[Path, Path]:
    """``base/ww`` (mode 0777, no sticky bit) and the private ``base/ww/sub`` in it."""
    shared = base / "ww"
    shared.mkdir(mode=0o700)
    sub = shared / "sub"
    sub.mkdir(mode=0o700)
    shared.chmod(0o777)
    return shared, sub


def _under_0777_line(given: Path, shared: Path) -> str:
    return (
        f"runtime directory {given} is under {shared}, which is writable by group/other without the sticky bit "
        "(mode 0777); point RUNTIME_DIRECTORY / XDG_RUNTIME_DIR at a directory whose folders only you (or root) "
        "can change"
    )


def test_a_base_under_a_folder_others_can_write_is_refused_unless_sticky(base, monkeypatch):
    """``XDG_RUNTIME_DIR=<a chmod 777 folder>/sub`` was accepted: only the base itself was checked, and another
    user could rename ``sub`` away and put a directory of theirs in its place."""
    shared, sub = _sub_of_a_0777_folder(base)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(sub))
    with pytest.raises(RuntimeDirError) as info:
        runtime_dir("a")
    assert str(info.value) == _under_0777_line(sub, shared)
    assert info.value.path == sub and list(sub.iterdir()) == []
    shared.chmod(0o1777)  # /tmp's rule: others cannot rename or remove what we own in it
    assert runtime_dir("a") == sub / f"chestnut-{UID}" / "a"


def test_a_base_reached_through_a_symlink_is_judged_by_the_folders_above_its_target(base, monkeypatch):
    shared, sub = _sub_of_a_0777_folder(base)
    link = base / "link"
    link.symlink_to(sub)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(link))
    with pytest.raises(RuntimeDirError) as info:
        runtime_dir("a")
    assert str(info.value) == _under_0777_line(link, shared)


@pytest.mark.skipif(UID != 0, reason="making a directory of another user needs root")
def test_a_base_under_a_folder_of_another_user_is_refused(base, monkeypatch):
    theirs = base / "theirs"
    theirs.mkdir(mode=0o755)
    sub = theirs / "sub"
    sub.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)  # its owner may rename what is in it, whatever its mode
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(sub))
    with pytest.raises(RuntimeDirError) as info:
        runtime_dir("a")
    assert str(info.value) == (
        f"runtime directory {sub} is under {theirs}, which belongs to uid 65534, not to root; "
        "point RUNTIME_DIRECTORY / XDG_RUNTIME_DIR at a directory whose folders only you (or root) can change"
    )
    assert list(sub.iterdir()) == []


def test_the_usual_bases_and_the_folders_above_them_pass():
    """``/tmp`` (1777 under a root-owned ``/``) and ``/run/user/<uid>``'s folders (root's, 0755) keep the rule."""
    assert paths.changeable_folder(Path("/tmp"), UID) is None
    assert paths.changeable_folder(Path("/run/user"), UID) is None  # a missing one ends the walk: None too


def test_systemd_runtime_directory_comes_first(base, tmp_path, monkeypatch):
    svc = base / "svc"
    svc.mkdir(mode=0o700)
    monkeypatch.setenv("RUNTIME_DIRECTORY", f"{svc}:{tmp_path / 'second'}")
    assert runtime_dir("a") == svc / f"chestnut-{UID}" / "a"
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(base / "missing"))
    with pytest.raises(RuntimeDirError, match="missing cannot be opened"):
        runtime_dir("a")
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    assert paths.runtime_base() == base


def test_every_cli_program_refuses_a_subverted_dir_in_one_line_and_exit_2(base, tmp_path):
    target = tmp_path / "x"
    target.mkdir()
    (base / f"chestnut-{UID}").mkdir(mode=0o700)
    link = base / f"chestnut-{UID}" / "p"
    link.symlink_to(target)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(base), "CHESTNUT_PREFIX": "p"}
    r = subprocess.run(
        [CHESTNUT, "dump", "cameraFrame", "--count", "1"], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"chestnut dump: runtime directory {link} is a symlink; remove it (rm {link}) and start again"
    ]
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("program", [["camera", "--synthetic", "--frames", "1", "--start-delay", "0"], ["control"],
                                     ["run", "--dock", "none"], ["run", "--dock", "cpu"]])
def test_a_program_at_a_realtime_priority_refuses_a_planted_runtime_dir_in_its_one_line(base, program):
    """The camera, the control daemon and the node said their realtime scheduling (an INFO or, refused, a WARNING
    line) before the refusal (the node a stopping line too): the camera and the control daemon ask for it only once
    their sockets are open, the node once its runtime directory passed its checks."""
    (base / f"chestnut-{UID}").mkdir(mode=0o700)
    d = base / f"chestnut-{UID}" / "p"
    d.write_text("important\n")
    env = {**os.environ, "XDG_RUNTIME_DIR": str(base), "CHESTNUT_PREFIX": "p"}
    env.pop("RUNTIME_DIRECTORY", None)
    r = subprocess.run([CHESTNUT, *program], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"chestnut {program[0]}: runtime directory {d} is not a directory; remove it (rm -r {d}) and start again, or "
        "choose another CHESTNUT_PREFIX"
    ]
    assert d.read_text() == "important\n"


@pytest.mark.skipif(UID != 0, reason="making a directory of another user needs root")
def test_a_base_of_another_user_is_refused(base):
    os.chown(base, 65534, 65534)
    with pytest.raises(RuntimeDirError) as info:
        runtime_dir("a")
    assert str(info.value) == (
        f"runtime directory {base} belongs to uid 65534, not to root; "
        "point RUNTIME_DIRECTORY / XDG_RUNTIME_DIR at a directory of yours"
    )
    assert list(base.iterdir()) == []


def _base_for(root: Path, prefix: str, socket_path_bytes: int) -> Path:
    """A base (0700, ours) under which ``<base>/chestnut-<uid>/<prefix>/cameraFrame.vipc`` is that many bytes."""
    rest = len(f"/chestnut-{UID}/{prefix}/cameraFrame.vipc")
    d = root / ("b" * (socket_path_bytes - rest - len(str(root)) - 1))
    d.mkdir(mode=0o700)
    return d


def test_the_longest_socket_name_is_the_frame_rings_and_every_socket_is_counted():
    from chestnut.backend.sim import wire
    from chestnut.launch import supervise
    from chestnut.msgs import visionipc

    assert {visionipc.SOCKET_NAME, wire.SOCKET_NAME, *supervise.STACK_SOCKETS} <= set(paths.STACK_SOCKET_NAMES)
    assert paths.LONGEST_SOCKET_NAME == "cameraFrame.vipc"
    # the longest base /run/user/<uid> and its user dir leave room for a prefix of PREFIX_MAX characters
    assert len(f"/run/user/{2**32 - 1}/chestnut-{2**32 - 1}/{'p' * 48}/cameraFrame.vipc") == 106 <= paths.SUN_PATH_MAX


def test_a_runtime_dir_whose_sockets_fit_exactly_is_used(base, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(_base_for(base, "p", 107)))
    d = runtime_dir("p")
    assert len(str(d / "cameraFrame.vipc")) == 107 and d.is_dir()


def test_a_runtime_dir_too_long_for_its_sockets_is_refused_before_anything_is_made(base, monkeypatch):
    prefix = "q" * 20
    long_base = _base_for(base, prefix, 108)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(long_base))
    d = long_base / f"chestnut-{UID}" / prefix
    with pytest.raises(RuntimeDirError) as info:
        runtime_dir(prefix)
    assert str(info.value) == (
        f"runtime directory {d} is too long for the stack's sockets: {d}/cameraFrame.vipc is 108 bytes, over the "
        "107 a Unix socket path holds (sun_path is 108 bytes with its NUL: unix(7)); use a CHESTNUT_PREFIX of at "
        "most 19 characters, or point RUNTIME_DIRECTORY / XDG_RUNTIME_DIR at a shorter directory"
    )
    assert list(long_base.iterdir()) == []


@pytest.mark.parametrize("program", [["dump", "cameraFrame", "--count", "1"], ["twin", "serve"], ["camera"]])
def test_every_cli_program_refuses_a_runtime_dir_too_long_for_its_sockets_in_one_line(base, program):
    """A legal prefix under a long ``$XDG_RUNTIME_DIR`` gave tracebacks (``ipc path ... is longer than 107
    characters``), ``AF_UNIX path too long`` without the path, or (``dump``) a wait forever."""
    long_base = _base_for(base, "p" * 48, 140)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(long_base), "CHESTNUT_PREFIX": "p" * 48}
    env.pop("RUNTIME_DIRECTORY", None)
    r = subprocess.run([CHESTNUT, *program], env=env, capture_output=True, text=True, timeout=60)
    d = long_base / f"chestnut-{UID}" / ("p" * 48)
    assert r.returncode == 2
    assert [line for line in r.stderr.splitlines() if " INFO " not in line] == [
        f"chestnut {program[0]}: runtime directory {d} is too long for the stack's sockets: {d}/cameraFrame.vipc is "
        "140 bytes, over the 107 a Unix socket path holds (sun_path is 108 bytes with its NUL: unix(7)); use a "
        "CHESTNUT_PREFIX of at most 15 characters, or point RUNTIME_DIRECTORY / XDG_RUNTIME_DIR at a shorter "
        "directory"
    ]
    assert list(long_base.iterdir()) == []


def test_flock_holders_names_the_holder_of_that_inode_only_and_reads_proc_locks_bounded(tmp_path):
    import fcntl

    held, other = tmp_path / "held.lock", tmp_path / "other.lock"
    held.touch()
    other.touch()
    with open(held, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        assert paths.flock_holders(held) == [os.getpid()]
        assert paths.flock_holders(other) == []
    assert paths.flock_holders(held) == []
    assert paths.flock_holders(tmp_path / "missing.lock") == []
    # a /proc/locks of more than the bound: a holder listed past it is not read
    st = os.lstat(other)
    line = f"1: FLOCK  ADVISORY  WRITE 4321 {os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} 0 EOF\n"
    table = tmp_path / "locks"
    table.write_text(line)
    assert paths.flock_holders(other, table) == [4321]
    table.write_text("x" * paths.PROC_LOCKS_MAX_BYTES + "\n" + line)
    assert paths.flock_holders(other, table) == []
