"""A twin daemon that accepts and never answers cannot block its callers (``backend/sim/client.py``):
every round trip is bounded, the node's look for the dock included; a missed reply is a timeout that
leaves the connection and its handles working (the late reply is dropped), never a gone device."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from chestnut.backend.sim import wire as W
from chestnut.backend.sim.client import TwinClient, TwinNotRunning, socket_path
from chestnut.backend.sim.libusb_codes import LIBUSB_ERROR_NO_DEVICE, LIBUSB_ERROR_TIMEOUT, UsbError

pytestmark = [pytest.mark.timeout(30)]


@pytest.fixture
def mute_daemon() -> Iterator[list[bytes]]:
    """A real Unix socket at the twin's path that accepts every connection, reads, and never answers.
    Yields what it has read so far (one entry per recv)."""
    path = socket_path()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    got: list[bytes] = []
    conns: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                for c in conns:
                    try:
                        data = c.recv(1 << 16, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        continue
                    if data:
                        got.append(data)
                continue
            conns.append(conn)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield got
    finally:
        stop.set()
        t.join(5)
        for c in conns:
            c.close()
        srv.close()
        path.unlink(missing_ok=True)


def test_an_admin_call_to_a_daemon_that_never_answers_is_bounded_and_keeps_the_connection(mute_daemon):
    client = TwinClient(reply_timeout_s=0.2)
    with pytest.raises(TwinNotRunning) as info:
        client.status()
    assert str(info.value) == (f"the twin daemon at {socket_path()} did not answer within 0.2 s (hung, or already "
                               "serving the most clients it takes at once: its log says which)")
    assert client.connected and client.owed_replies == 1  # a missed reply is owed, not a gone daemon
    with pytest.raises(TwinNotRunning, match="did not answer within 0.2 s"):  # still silent: bounded again
        client.enumerate()
    with pytest.raises(UsbError) as usb:
        client.open(2, 5)
    assert usb.value.code == LIBUSB_ERROR_TIMEOUT  # a hung daemon is a timeout, never NO_DEVICE
    assert client.connected and client.owed_replies == 3
    assert mute_daemon  # the request did reach the daemon
    client.close_connection()
    with pytest.raises(UsbError) as closed:
        client.open(2, 5)
    assert closed.value.code == LIBUSB_ERROR_NO_DEVICE


def test_a_usb_transfer_waits_its_own_timeout_plus_the_margin_then_times_out(mute_daemon):
    client = TwinClient(reply_timeout_s=0.1)
    with pytest.raises(UsbError) as info:
        client.ctrl_transfer(1, 0xC0, 0xE4, 0xB450, 0, 1, timeout_ms=200)
    assert info.value.code == LIBUSB_ERROR_TIMEOUT
    assert info.value.detail == (f"the twin daemon at {socket_path()} did not answer within 0.3 s (hung, or "
                                 "already serving the most clients it takes at once: its log says which)")


class LateDaemon:
    """A stub daemon at the twin's socket that answers each request in order, but only the requests the
    test has released (:meth:`release`): a daemon whose reply comes after the client gave up on it.
    Each reply's value is the request's ``value`` field + 1000, its body the request's ``length`` bytes
    of ``0xAB`` (what a control IN of that length reads)."""

    def __init__(self) -> None:
        self.path = socket_path()
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(str(self.path))
        self.srv.listen(1)
        self.released = threading.Semaphore(0)
        self.requests: list[tuple[int, ...]] = []
        self.answered = 0
        self.hung_up = False
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.released.release()

    def serve(self) -> None:
        conn, _ = self.srv.accept()
        with conn:
            while True:
                hdr = b""
                while len(hdr) < W.REQ.size:
                    chunk = conn.recv(W.REQ.size - len(hdr))
                    if not chunk:
                        return
                    hdr += chunk
                req = W.REQ.unpack(hdr)
                plen, length = req[0], req[8]
                while plen:
                    plen -= len(conn.recv(plen))
                self.requests.append(req)
                if not self.released.acquire(timeout=20) or self.hung_up:
                    return
                self.answered += 1  # counted before the send: a client that has the reply sees the count
                conn.sendall(W.RSP.pack(length, W.ST_OK, req[5] + 1000) + b"\xab" * length)

    def hang_up(self) -> None:
        """Close the connection without answering what is pending (the daemon exits)."""
        self.hung_up = True
        self.release()
        self.thread.join(5)

    def close(self) -> None:
        self.release(100)
        self.srv.close()
        self.thread.join(5)
        self.path.unlink(missing_ok=True)


@pytest.fixture
def late_daemon() -> Iterator[LateDaemon]:
    d = LateDaemon()
    try:
        yield d
    finally:
        d.close()


def test_a_timed_out_request_leaves_the_connection_and_its_handle_working(late_daemon):
    client = TwinClient(reply_timeout_s=0.1)
    late_daemon.release()
    handle = client.open(2, 5)  # answered at once: value = 0 + 1000
    assert handle == 1000
    with pytest.raises(UsbError) as info:  # not released: the client gives up on it
        client.ctrl_transfer(handle, 0xC0, 0xE4, 0xB450, 0, 4, timeout_ms=50)
    assert info.value.code == LIBUSB_ERROR_TIMEOUT
    assert client.connected and client.owed_replies == 1
    late_daemon.release(2)  # the late reply, then the next request's
    got = client.ctrl_transfer(handle, 0xC0, 0xE4, 0xB451, 0, 3, timeout_ms=1000)
    assert got == b"\xab" * 3  # the next request's own reply (3 bytes), not the late one (4)
    assert [(r[5], r[7]) for r in late_daemon.requests[1:]] == [(0xB450, handle), (0xB451, handle)]  # wValue, handle
    assert client.owed_replies == 0 and late_daemon.answered == 3
    client.close_connection()


def test_late_replies_of_several_timed_out_requests_are_all_dropped(late_daemon):
    client = TwinClient(reply_timeout_s=0.05)
    for addr in (0xB450, 0xB451):
        with pytest.raises(UsbError) as info:
            client.ctrl_transfer(7, 0xC0, 0xE4, addr, 0, 8, timeout_ms=10)
        assert info.value.code == LIBUSB_ERROR_TIMEOUT
    assert client.owed_replies == 2
    late_daemon.release(3)
    assert client.ctrl_transfer(7, 0xC0, 0xE4, 0xB452, 0, 2, timeout_ms=1000) == b"\xab\xab"
    assert client.owed_replies == 0
    client.close_connection()


def test_a_daemon_that_exits_after_a_timeout_is_still_no_device(late_daemon):
    client = TwinClient(reply_timeout_s=0.05)
    with pytest.raises(UsbError) as info:
        client.ctrl_transfer(7, 0xC0, 0xE4, 0xB450, 0, 1, timeout_ms=10)
    assert info.value.code == LIBUSB_ERROR_TIMEOUT
    late_daemon.hang_up()  # the daemon answers nothing more and goes away
    with pytest.raises(UsbError) as gone:
        client.ctrl_transfer(7, 0xC0, 0xE4, 0xB450, 0, 1, timeout_ms=5000)
    assert gone.value.code == LIBUSB_ERROR_NO_DEVICE
    assert not client.connected


def test_the_nodes_look_for_the_dock_returns_on_a_daemon_that_never_answers(mute_daemon):
    from chestnut.node.docklook import look_for_dock

    assert look_for_dock("twin", None) == (False, "no Chestnut dock enumerated")  # returns: not blocked
    assert mute_daemon  # it did ask the daemon


def test_the_reply_bound_must_be_positive():
    with pytest.raises(ValueError, match="reply_timeout_s must be > 0, got 0"):
        TwinClient(reply_timeout_s=0)
