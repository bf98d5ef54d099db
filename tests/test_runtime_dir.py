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
def base(tmp_path, monkeypatch):
    """A fresh ``$XDG_RUNTIME_DIR`` (0700, ours); afterwards a clean one, so the suite's teardown works."""
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(d))
    yield d
    clean = tmp_path / "clean"
    clean.mkdir(mode=0o700, exist_ok=True)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(clean))


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


def test_systemd_runtime_directory_comes_first(base, tmp_path, monkeypatch):
    svc = tmp_path / "svc"
    svc.mkdir(mode=0o700)
    monkeypatch.setenv("RUNTIME_DIRECTORY", f"{svc}:{tmp_path / 'second'}")
    assert runtime_dir("a") == svc / f"chestnut-{UID}" / "a"
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "missing"))
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


@pytest.mark.skipif(UID != 0, reason="making a directory of another user needs root")
def test_a_base_of_another_user_is_refused(base):
    os.chown(base, 65534, 65534)
    with pytest.raises(RuntimeDirError) as info:
        runtime_dir("a")
    assert str(info.value) == (
        f"runtime directory {base} belongs to uid 65534, not to uid {UID} or root; "
        "point RUNTIME_DIRECTORY / XDG_RUNTIME_DIR at a directory of yours"
    )
    assert list(base.iterdir()) == []
