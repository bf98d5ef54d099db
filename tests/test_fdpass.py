"""``msgs/fdpass.py`` ``recv_fds``: the receive flags the stdlib's drops (python/cpython #107898) are honoured."""

from __future__ import annotations

import os
import socket

import pytest

from chestnut.msgs.fdpass import recv_fds


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield a, b
    a.close()
    b.close()


@pytest.mark.timeout(10)  # the stdlib's recv_fds would block here for good
def test_dontwait_on_an_empty_socket_raises_instead_of_blocking(pair):
    _a, b = pair
    with pytest.raises(BlockingIOError):
        recv_fds(b, 1024, 1, socket.MSG_DONTWAIT)


def test_data_and_descriptors_arrive_and_cloexec_makes_them_close_on_exec(pair, tmp_path):
    a, b = pair
    (tmp_path / "f").write_bytes(b"x")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        socket.send_fds(a, [b"hello"], [fd])
        data, fds, flags = recv_fds(b, 1024, 1, socket.MSG_CMSG_CLOEXEC)
        assert (data, len(fds), flags & socket.MSG_CTRUNC) == (b"hello", 1, 0)
        assert os.get_inheritable(fds[0]) is False and os.read(fds[0], 1) == b"x"
        os.close(fds[0])
        socket.send_fds(a, [b"again"], [fd])
        data, fds, _flags = recv_fds(b, 1024, 1)  # no flag: the kernel makes it inheritable
        assert data == b"again" and os.get_inheritable(fds[0]) is True
        os.close(fds[0])
    finally:
        os.close(fd)


def test_more_descriptors_than_asked_for_are_dropped_and_said_in_the_flags(pair, tmp_path):
    a, b = pair
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        socket.send_fds(a, [b"two"], [fd, fd])
        data, fds, flags = recv_fds(b, 1024, 1, socket.MSG_CMSG_CLOEXEC)
        assert (data, len(fds)) == (b"two", 1) and flags & socket.MSG_CTRUNC
        os.close(fds[0])
        a.send(b"none")
        assert recv_fds(b, 1024, 1) == (b"none", [], 0)
    finally:
        os.close(fd)
