"""A twin daemon that accepts and never answers cannot block its callers (``backend/sim/client.py``):
every round trip is bounded, the node's look for the dock included."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

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


def test_an_admin_call_to_a_daemon_that_never_answers_is_bounded_and_closes_the_connection(mute_daemon):
    client = TwinClient(reply_timeout_s=0.2)
    with pytest.raises(TwinNotRunning) as info:
        client.status()
    assert str(info.value) == (
        f"the twin daemon at {socket_path()} did not answer within 0.2 s (hung?); connection closed"
    )
    with pytest.raises(TwinNotRunning, match="is closed"):  # the stream is mid-frame: never reused
        client.enumerate()
    with pytest.raises(UsbError) as usb:
        client.open(2, 5)
    assert usb.value.code == LIBUSB_ERROR_NO_DEVICE
    assert mute_daemon  # the request did reach the daemon


def test_a_usb_transfer_waits_its_own_timeout_plus_the_margin_then_times_out(mute_daemon):
    client = TwinClient(reply_timeout_s=0.1)
    with pytest.raises(UsbError) as info:
        client.ctrl_transfer(1, 0xC0, 0xE4, 0xB450, 0, 1, timeout_ms=200)
    assert info.value.code == LIBUSB_ERROR_TIMEOUT
    assert (
        info.value.detail
        == f"the twin daemon at {socket_path()} did not answer within 0.3 s (hung?); connection closed"
    )


def test_the_nodes_look_for_the_dock_returns_on_a_daemon_that_never_answers(mute_daemon):
    from chestnut.node.main import look_for_dock

    assert look_for_dock("twin", None) == (False, "no Chestnut dock enumerated")  # returns: not blocked
    assert mute_daemon  # it did ask the daemon


def test_the_reply_bound_must_be_positive():
    with pytest.raises(ValueError, match="reply_timeout_s must be > 0, got 0"):
        TwinClient(reply_timeout_s=0)
