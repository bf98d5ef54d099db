"""A subscriber's lost connection says what it was (``msgs/messaging.py`` ``loss_cause``): a publisher
that went away (an orderly stop, a kill) is INFO, once, naming the service's bound too (a publisher that sent
a message over it and then went away leaves the same traces); a message dropped by ZeroMQ while the publisher
still listens -- one of ours, or any ZeroMQ PUB bound at the path -- is the WARNING naming the drop and the
bound, at once for the first and then at most once a minute with the count since."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import zmq

from chestnut.msgs.messaging import (
    LOSS_PUBLISHER_GONE,
    LOSS_REFUSED,
    LOSS_UNKNOWN,
    drain_sock,
    endpoint,
    iter_events,
    loss_cause,
    loss_line,
    new_message,
    pub_sock,
    size_text,
    sub_sock,
)

pytestmark = [pytest.mark.timeout(60)]
GONE = ("nodeState: its publisher stopped or restarted; waiting for its next message (one over the service's 64 KiB "
        "bound sent just before the stop would have been dropped with the connection: ZeroMQ's maxmsgsize)")


def _hello(pub, sub) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # ZeroMQ drops messages until the subscription has arrived
        pub.send(new_message("nodeState").to_bytes())
        if sub.poll(20):
            drain_sock(sub)
            return
    raise AssertionError("subscriber never connected")


def _wait_for_loss(sub, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sub.disconnects == 0:
        assert time.monotonic() < deadline, "no lost connection reported"
        sub.conn_monitor.poll(50)
        drain_sock(sub)  # runs heal()


def test_an_orderly_stop_of_the_publisher_is_info_not_a_warning(caplog):
    caplog.set_level(logging.INFO, "chestnut.msgs.messaging")
    pub = pub_sock("nodeState")
    sub = sub_sock("nodeState")
    try:
        _hello(pub, sub)
        pub.close()
        _wait_for_loss(sub)
    finally:
        sub.close()
    got = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "chestnut.msgs.messaging"]
    assert got == [("INFO", GONE)]


_KILLED = textwrap.dedent(
    """
    import time
    from chestnut.msgs.messaging import new_message, pub_sock
    pub = pub_sock("nodeState")
    print("bound", flush=True)
    while True:
        pub.send(new_message("nodeState").to_bytes())
        time.sleep(0.01)
    """
)


def test_a_killed_publisher_is_info_too_and_a_restart_is_not_logged_again(caplog):
    caplog.set_level(logging.INFO, "chestnut.msgs.messaging")
    sub = sub_sock("nodeState")
    try:
        for round_ in (1, 2):
            p = subprocess.Popen([sys.executable, "-c", _KILLED], stdout=subprocess.PIPE, text=True)
            try:
                assert p.stdout is not None and p.stdout.readline() == "bound\n"
                deadline = time.monotonic() + 20
                while not sub.poll(50):
                    assert time.monotonic() < deadline, "no message from the publisher"
                drain_sock(sub)
                before = sub.disconnects
                p.send_signal(signal.SIGKILL)
                p.wait(10)
                deadline = time.monotonic() + 20
                while sub.disconnects == before:
                    assert time.monotonic() < deadline, "no lost connection reported"
                    sub.conn_monitor.poll(50)
                    drain_sock(sub)
            finally:
                p.kill()
                p.wait()
            assert sub.disconnects >= round_
    finally:
        sub.close()
    got = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "chestnut.msgs.messaging"]
    assert got == [("INFO", GONE)]


def test_the_cause_is_read_from_the_publishers_own_files():
    pub = pub_sock("nodeState")
    try:
        assert loss_cause(pub.ipc_file and f"ipc://{pub.ipc_file}") == (LOSS_REFUSED, os.getpid())
    finally:
        path = pub.ipc_file
        pub.close()
    assert loss_cause(f"ipc://{path}") == (LOSS_PUBLISHER_GONE, None)  # socket file unlinked, lock free
    assert loss_cause("tcp://127.0.0.1:5555") == (LOSS_UNKNOWN, None)


def test_a_publisher_that_listens_without_the_lock_is_running_and_a_dead_ones_socket_file_is_gone(tmp_path):
    """What decides is whether something listens at the path: a ZeroMQ PUB that took no lock still runs (it
    was read as gone, so its dropped message was said as a publisher restart); the socket file a killed
    publisher left behind accepts nothing."""
    s = zmq.Context.instance().socket(zmq.PUB)
    path = tmp_path / "nodeState"
    s.bind(f"ipc://{path}")
    try:
        (tmp_path / "nodeState.pub.lock").write_text("12345\n")  # written, never locked
        assert loss_cause(f"ipc://{path}") == (LOSS_REFUSED, None)
    finally:
        s.close(linger=0)
    stale = tmp_path / "cameraFrame"
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(stale))  # bound, never listened on, closed: the file stays, as a killed process leaves it
    left.close()
    assert stale.is_socket() and loss_cause(f"ipc://{stale}") == (LOSS_PUBLISHER_GONE, None)


def test_a_message_over_the_bound_from_a_publisher_gone_since_names_the_bound(caplog):
    """A 64 MiB message on cameraFrame (bound 16 MiB), its publisher closed before the subscriber looks: ZeroMQ's
    event and the publisher's files are those of a publisher that went away, so the line names both."""
    caplog.set_level(logging.INFO, "chestnut.msgs.messaging")
    pub = pub_sock("cameraFrame")
    sub = sub_sock("cameraFrame")
    try:
        while True:  # until the subscriber has joined: ZeroMQ drops messages before
            pub.send(new_message("cameraFrame").to_bytes())
            if sub.poll(20):
                break
        drain_sock(sub)
        pub.send(bytes(64 << 20))
        assert sub.conn_monitor.poll(20_000), "no lost connection reported"
        pub.close()
        _wait_for_loss(sub)
    finally:
        pub.close()
        sub.close()
    got = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "chestnut.msgs.messaging"]
    assert got == [("INFO", "cameraFrame: its publisher stopped or restarted; waiting for its next message (one over "
                            "the service's 16 MiB bound sent just before the stop would have been dropped with the "
                            "connection: ZeroMQ's maxmsgsize)")]


@pytest.mark.parametrize(("cause", "kw", "line"), [
    (LOSS_REFUSED, {"holder": 4242},
     "cameraFrame: dropped a message over the service's 16 MiB bound: ZeroMQ's maxmsgsize refuses one at its length "
     "header, unread, so its size is not known here, and drops the connection while its publisher (pid 4242) still "
     "runs; connected again (further drops: at most one line every 60 s, with their count)"),
    (LOSS_REFUSED, {"dropped": 7, "first": False},
     "cameraFrame: dropped 7 message(s) since the last such line over the service's 16 MiB bound: ZeroMQ's "
     "maxmsgsize refuses one at its length header, unread, so its size is not known here, and drops the connection "
     "while its publisher still runs; connected again (at most one line every 60 s)"),
    (LOSS_UNKNOWN, {},
     "cameraFrame: lost the connection to its publisher: it went away or sent a message over the service's 16 MiB "
     "bound (ZeroMQ's maxmsgsize drops the connection; over TCP the two cannot be told apart); connected again "
     "(further drops: at most one line every 60 s, with their count)"),
])
def test_each_cause_is_one_line_naming_the_bound(cause, kw, line):
    assert loss_line("cameraFrame", cause, 16 << 20, **kw) == line


_RAW_PUBLISHER = textwrap.dedent(
    """
    import sys, time
    import zmq
    from chestnut.msgs.messaging import new_message
    pub = zmq.Context.instance().socket(zmq.PUB)  # a script's own socket: no publisher lock taken
    pub.bind(sys.argv[1])
    print("bound", flush=True)
    for line in sys.stdin:  # one message per line asked for: "small" or "big" (17 MiB, over the 16 MiB bound)
        pub.send(new_message("cameraFrame").to_bytes() if line.strip() == "small" else bytes(17 << 20))
    """
)


def _oversize_lines(caplog) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records
            if r.name == "chestnut.msgs.messaging" and r.exc_info is None]


class _RawPublisher:
    """A script's own ZeroMQ PUB on cameraFrame (no lock), in another process, and a subscriber of ours."""

    def __init__(self) -> None:
        self.poller = zmq.Poller()
        self.sub = sub_sock("cameraFrame", self.poller)
        self.p = subprocess.Popen([sys.executable, "-c", _RAW_PUBLISHER, endpoint("cameraFrame")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.p.stdin is not None and self.p.stdout is not None
        assert self.p.stdout.readline() == "bound\n"
        self.wait_for(self.joined, "the subscriber never joined the publisher")

    def send(self, what: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(what + "\n")
        self.p.stdin.flush()

    def wait_for(self, cond, what: str) -> None:
        deadline = time.monotonic() + 20
        while not cond():
            assert time.monotonic() < deadline, what
            self.poller.poll(50)
            list(iter_events(self.sub))  # runs heal() once the queue is empty, as the node's loop does

    def joined(self) -> bool:  # ZeroMQ drops what a publisher sends before the subscription reached it
        self.send("small")
        return bool(self.sub.poll(50)) and bool(list(iter_events(self.sub)))

    def drop(self, k: int) -> None:
        """The ``k``-th oversized message, dropped, and the connection made again."""
        self.send("big")
        self.wait_for(lambda: self.sub.disconnects == k, f"oversized message {k} not dropped")
        self.wait_for(self.joined, "not connected again")

    def close(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()
        self.p.wait(10)
        self.sub.close()


FIRST_DROP = ("WARNING", "cameraFrame: dropped a message over the service's 16 MiB bound: ZeroMQ's maxmsgsize refuses "
              "one at its length header, unread, so its size is not known here, and drops the connection while its "
              "publisher still runs; connected again (further drops: at most one line every 60 s, with their "
              "count)")


def _later_drops(n: int) -> tuple[str, str]:
    return ("WARNING", f"cameraFrame: dropped {n} message(s) since the last such line over the service's 16 MiB "
                       "bound: ZeroMQ's maxmsgsize refuses one at its length header, unread, so its size is not known "
                       "here, and drops the connection while its publisher still runs; connected again (at most one "
                       "line every 60 s)")


def test_a_flood_over_the_bound_from_a_running_publisher_is_one_drop_line_a_minute_never_a_restart(caplog):
    """The user's trial: 17 MiB on cameraFrame from a publisher that keeps running (a script's own ZeroMQ
    socket, no lock) -- real sockets, another process. Each is dropped by ZeroMQ and said as a drop naming the
    bound; a flood is one line within the minute (the next line, with the count: the test below); never a restart."""
    caplog.set_level(logging.INFO, "chestnut.msgs.messaging")
    raw = _RawPublisher()
    try:
        for k in range(1, 4):  # three in a row, each once the connection is made again
            raw.drop(k)
    finally:
        raw.close()
    assert raw.sub.dropped_over_bound == 3 and raw.sub.drops_unsaid == 2
    assert _oversize_lines(caplog) == [FIRST_DROP]


def test_the_tail_of_a_burst_is_said_once_its_interval_has_passed_with_no_drop_after_it(caplog):
    caplog.set_level(logging.INFO, "chestnut.msgs.messaging")
    raw = _RawPublisher()
    try:
        for k in range(1, 4):
            raw.drop(k)
        assert raw.sub.drops_unsaid == 2 and _oversize_lines(caplog) == [FIRST_DROP]
        list(iter_events(raw.sub))
        assert raw.sub.drops_unsaid == 2  # within the interval: counted, not said
        assert raw.sub.drop_said_ns is not None
        raw.sub.drop_said_ns -= int(60e9)  # the minute has passed; no message over the bound since
        list(iter_events(raw.sub))  # the next receive says the burst's tail
    finally:
        raw.close()
    assert raw.sub.dropped_over_bound == 3 and raw.sub.drops_unsaid == 0
    assert _oversize_lines(caplog) == [FIRST_DROP, _later_drops(2)]


def test_a_bound_reads_in_the_unit_it_was_given_in():
    assert [size_text(n) for n in (16 << 20, 1 << 20, 64 << 10, 1000, 0)] == [
        "16 MiB", "1 MiB", "64 KiB", "1000 bytes", "0 bytes"]
