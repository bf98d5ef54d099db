"""A subscriber never connects through a path planted at one of our sockets (``msgs/messaging.py``
``SubSocket.connect``, the publishers' rule of ``msgs/paths.py`` ``check_socket_path``): a symlink (not followed,
even to a live publisher of ours), a regular file, a directory or another user's socket at a service's ``ipc://``
path is refused in one line, and kept. ``chestnut dump`` says that line and exits 2 as for an unknown service;
``SubMaster`` raises it; a connection made again after a loss (``SubSocket.heal``) is refused the same way, logged
once, and made once the path is clean (a running program runs on meanwhile); the
camera's frame socket is refused by a ring reader (``msgs/visionipc.py`` ``FrameSubscriber``). A service with
nothing at its path yet is still waited for (``tests/test_one_publisher.py``)."""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

import planted
import pytest

from chestnut.msgs.messaging import (
    PubMaster,
    SocketPathError,
    SubMaster,
    drain_sock,
    new_message,
    pub_sock,
    recv_one_or_none,
    sub_sock,
)
from chestnut.msgs.paths import RuntimeDirError, runtime_dir
from chestnut.msgs.visionipc import FrameBufferError, FrameRing, FrameSubscriber
from chestnut.msgs.visionipc import socket_path as frame_socket_path

pytestmark = [pytest.mark.timeout(30)]  # a subscriber that followed the plant would wait on it for ever

PLANTS = [("file", "a regular file"), ("dir", "a directory"), ("symlink", "a symlink")]
WAIT_S = 10.0


def refusal(path: Path | str, what: str) -> str:
    return f"socket path {path} holds {what}: refused, nothing replaced; remove it and start again"


def kept(path: Path, plant: str, victim: Path) -> bool:
    """What was planted at ``path`` is still there as it was, and the symlink's target untouched."""
    same = path.read_text() == "important\n" if plant == "file" else (
        path.is_dir() if plant == "dir" else os.readlink(path) == str(victim))
    return same and victim.read_text() == "precious\n"


@pytest.fixture
def other_prefix():
    """A second runtime prefix of ours (another stack), removed afterwards."""
    prefix = f"t{os.getpid()}-other"
    yield prefix
    shutil.rmtree(runtime_dir(prefix), ignore_errors=True)


@pytest.mark.parametrize(("plant", "what"), PLANTS)
def test_a_subscriber_refuses_a_path_planted_at_its_socket_and_keeps_it(plant, what, tmp_path):
    path, victim = runtime_dir() / "controlState", tmp_path / "victim"
    planted.plant(path, plant, victim)
    with pytest.raises(SocketPathError) as e:
        sub_sock("controlState")
    assert str(e.value) == refusal(path, f"{what}, not a socket")
    assert isinstance(e.value, RuntimeDirError) and e.value.path == path
    assert kept(path, plant, victim)


def test_a_symlink_to_a_live_publisher_of_ours_is_not_followed(other_prefix):
    """Another stack of ours publishes controlState; a symlink to its socket at our path would have fed its
    messages to our subscriber."""
    path = runtime_dir() / "controlState"
    with PubMaster(["controlState"], prefix=other_prefix):
        target = runtime_dir(other_prefix) / "controlState"
        path.symlink_to(target)
        with pytest.raises(SocketPathError) as e:
            sub_sock("controlState")
        assert str(e.value) == refusal(path, "a symlink, not a socket")
        with pytest.raises(SocketPathError) as e:
            SubMaster(["chestnutActive", "controlState"])
        assert str(e.value) == refusal(path, "a symlink, not a socket")
        assert os.readlink(path) == str(target)


def test_another_users_socket_at_the_path_is_refused():
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    path = runtime_dir() / "controlState"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path))
        os.chown(path, 65534, 65534)
        with pytest.raises(SocketPathError) as e:
            sub_sock("controlState")
    finally:
        s.close()
    assert str(e.value) == refusal(path, "a socket of uid 65534, not one of ours (uid 0)")
    assert os.lstat(path).st_uid == 65534


def test_our_own_publishers_socket_is_connected_to():
    with PubMaster(["controlState"]) as pm:
        sub = sub_sock("controlState")
        try:
            deadline = time.monotonic() + WAIT_S
            got = None
            while got is None and time.monotonic() < deadline:  # until the slow joiner has joined
                msg = new_message("controlState")
                msg.controlState.engaged = True
                pm.send("controlState", msg)
                got = recv_one_or_none(sub) if sub.poll(20) else None
        finally:
            sub.close()
    assert got is not None and got.controlState.engaged is True


@pytest.mark.parametrize(("plant", "what"), PLANTS)
def test_chestnut_dump_refuses_a_planted_socket_path_in_one_line_exit_2(plant, what, tmp_path, capsys):
    from chestnut.launch.cli import main

    path, victim = runtime_dir() / "chestnutHealth", tmp_path / "victim"
    planted.plant(path, plant, victim)
    assert main(["dump", "controlState", "chestnutHealth", "-n", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"chestnut dump: {refusal(path, f'{what}, not a socket')}\n"
    assert captured.out == ""
    assert kept(path, plant, victim)


def test_a_connection_made_again_after_a_loss_refuses_a_path_planted_meanwhile_and_joins_once_it_is_clean(
        tmp_path, caplog, monkeypatch):
    import chestnut.msgs.messaging as messaging

    monkeypatch.setattr(messaging, "REFUSED_PATH_RECHECK_S", 0.0)  # every drain looks again
    path, victim = runtime_dir() / "controlState", tmp_path / "victim"
    pub = pub_sock("controlState")
    sub = sub_sock("controlState")
    try:
        deadline = time.monotonic() + WAIT_S
        while not sub.poll(20) and time.monotonic() < deadline:  # until the connection carries a message
            pub.send(new_message("controlState").to_bytes())
        assert len(drain_sock(sub)) >= 1
        pub.close()  # the publisher goes: its socket file with it, the subscriber's connection is lost
        assert sub.conn_monitor is not None and sub.conn_monitor.poll(int(WAIT_S * 1000))
        planted.plant(path, "symlink", victim)
        caplog.set_level("INFO", logger="chestnut.msgs")
        assert drain_sock(sub) == []  # heals the lost connection: refused, a running program runs on
        assert drain_sock(sub) == []  # refused again, not logged again
        assert sub.disconnects == 1
        assert sub.path_refused_ns is not None
        refused = [r.getMessage() for r in caplog.records if "controlState" in r.getMessage()]
        assert refused == [f"controlState: connection lost, and socket path {path} now holds a symlink, not a socket: "
                           "refused, nothing replaced; not subscribed until it is removed (looked at every 0 s)"]
        assert kept(path, "symlink", victim)
        path.unlink()  # the plant removed: the next drain connects, and a publisher there is heard
        caplog.clear()
        assert drain_sock(sub) == []
        assert sub.path_refused_ns is None
        assert [r.getMessage() for r in caplog.records] == [
            f"controlState: socket path {path} no longer refused; subscribed again"]
        pub = pub_sock("controlState")
        deadline = time.monotonic() + WAIT_S
        while not sub.poll(20) and time.monotonic() < deadline:
            pub.send(new_message("controlState").to_bytes())
        assert len(drain_sock(sub)) >= 1
    finally:
        sub.close()
        pub.close()


@pytest.mark.parametrize(("plant", "what"), PLANTS)
def test_a_ring_reader_refuses_a_path_planted_at_the_frame_socket(plant, what, tmp_path):
    path, victim = Path(frame_socket_path()), tmp_path / "victim"
    planted.plant(path, plant, victim)
    with pytest.raises(FrameBufferError) as e:
        FrameSubscriber().view_slot(5, 0, 1, 1)
    assert str(e.value) == refusal(path, f"{what}, not a socket")
    assert kept(path, plant, victim)


def test_a_ring_reader_does_not_follow_a_symlink_to_a_live_camera_of_ours(other_prefix):
    with FrameRing(64, prefix=other_prefix) as ring:
        path = Path(frame_socket_path())
        path.symlink_to(ring.path)
        with pytest.raises(FrameBufferError) as e:
            FrameSubscriber().view_slot(ring.session, 0, 1, 1)
        assert str(e.value) == refusal(path, "a symlink, not a socket")
        assert ring.subscribers == 0
