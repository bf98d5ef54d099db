"""Every Unix socket the stack binds is 0600 whatever the umask (``msgs/paths.py`` ``bind_private_socket``).

Under a login shell's umask 022, ``chestnut twin serve``'s and ``chestnut run``'s ZeroMQ ``ipc://`` sockets were
``srwxr-xr-x`` (only ``chestnut launch``, which runs its programs under umask 077, made them ``srwx------``)."""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from chestnut.msgs.paths import runtime_dir


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def socket_modes(d: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.lstat().st_mode) for p in sorted(d.iterdir()) if p.is_socket()}


def umask_now() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def test_a_publishers_socket_is_0600_under_umask_022(umask_022):
    from chestnut.msgs.messaging import pub_sock

    pub = pub_sock("modelOutput")
    try:
        assert socket_modes(runtime_dir()) == {"modelOutput": 0o600}
        assert umask_now() == 0o022  # set back after the bind
    finally:
        pub.close()


def test_the_frame_rings_socket_is_0600_under_umask_022(umask_022):
    from chestnut.msgs.visionipc import FrameRing

    with FrameRing(64, slots=2):
        assert socket_modes(runtime_dir()) == {"cameraFrame.vipc": 0o600}
    assert umask_now() == 0o022


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_chestnut_twin_serve_binds_every_socket_0600_under_umask_022(umask_022):
    """The user's trial: ``twinFault`` and ``twinState`` (its publishers) were ``srwxr-xr-x``."""
    from chestnut.backend.sim.client import running_twin

    with running_twin():  # the daemon inherits the umask 022
        assert socket_modes(runtime_dir()) == {"twin.sock": 0o600, "twinFault": 0o600, "twinState": 0o600}


def test_binds_in_many_threads_at_once_leave_the_umask_as_it_was(umask_022, tmp_path):
    """``os.umask`` is process-wide: the windows are serialized, so none sets back another's narrowed mask."""
    from chestnut.msgs.paths import bind_private_socket

    socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(16)]
    paths = [str(tmp_path / f"s{i}") for i in range(16)]
    threads = [threading.Thread(target=bind_private_socket, args=(p, lambda s=s, p=p: s.bind(p)))
               for s, p in zip(socks, paths, strict=True)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert socket_modes(tmp_path) == {f"s{i}": 0o600 for i in range(16)}
        assert umask_now() == 0o022
    finally:
        for s in socks:
            s.close()
