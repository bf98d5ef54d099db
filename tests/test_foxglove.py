"""``chestnut foxglove`` without a stack: real sockets in, a real Foxglove WebSocket client out."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import foxglove
import pytest
import websockets

from chestnut.launch.foxglove import Bridge
from chestnut.msgs.messaging import PubMaster, new_message

SUBPROTOCOLS = ["foxglove.websocket.v1", "foxglove.sdk.v1"]
T = TypeVar("T")


def _node_state(state: str, reason: str):
    ns = new_message("nodeState")
    ns.nodeState.state, ns.nodeState.reason = state, reason
    return ns


def _fired():
    tf = new_message("twinFault")
    tf.twinFault.kind, tf.twinFault.id, tf.twinFault.action, tf.twinFault.site = "gpu_hang", 1, "fired", "packet #3"
    return tf


async def _read_log(port: int, want: int) -> list[dict]:
    async with websockets.connect(f"ws://127.0.0.1:{port}", subprotocols=SUBPROTOCOLS) as ws:
        channels: dict[str, dict] = {}
        lines: list[dict] = []
        while len(lines) < want:
            frame = await asyncio.wait_for(ws.recv(), 10)
            if isinstance(frame, str):
                msg = json.loads(frame)
                if msg["op"] == "advertise":
                    channels.update({c["topic"]: c for c in msg["channels"]})
                    await ws.send(
                        json.dumps(
                            {
                                "op": "subscribe",
                                "subscriptions": [{"id": 1, "channelId": channels["/chestnut/log"]["id"]}],
                            }
                        )
                    )
                continue
            assert struct.unpack_from("<BI", frame) == (1, 1)
            lines.append(json.loads(frame[13:]))
    return lines


def test_state_changes_and_fault_events_reach_a_client_as_foxglove_logs_once_each():
    prefix = f"fox{os.getpid()}"
    bridge = Bridge(prefix=prefix, services=["nodeState", "twinFault"])
    server = foxglove.start_server(name="chestnut", port=0, context=bridge.context)
    stop = threading.Event()

    def publish() -> None:
        with PubMaster(["nodeState", "twinFault"], prefix=prefix) as pm:
            while not bridge.channels["/chestnut/log"].has_sinks() and not stop.is_set():
                stop.wait(0.02)  # the client subscribes first: a state change is logged once, when it happens
            # until ZeroMQ has connected both: a nodeState on the twinFault socket is counted, never logged
            while not (bridge.forwarded["nodeState"] and bridge.malformed["twinFault"]) and not stop.is_set():
                pm.send("nodeState", _node_state("active", "consumer_allows_switch"))
                pm.sock["twinFault"].send(_node_state("active", "").to_bytes())
                bridge.step(20)
            for _ in range(3):
                pm.send("nodeState", _node_state("degraded", "deadline_miss_run (gpu)"))
                bridge.step(20)
            pm.send("twinFault", _fired())
            while not stop.is_set():
                bridge.step(20)

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    try:
        lines = asyncio.run(_read_log(server.port, 3))
    finally:
        stop.set()
        t.join(5)
        server.stop()
        bridge.close()
    msgs = [(ln["level"], ln["name"], ln["message"]) for ln in lines]
    # the first state seen, the change to degraded (a warning), the firing (an error): each once
    assert msgs[0][1:] == ("node", "node active: consumer_allows_switch")
    assert msgs[1] == (3, "node", "node degraded: deadline_miss_run (gpu)")
    assert msgs[2][:2] == (4, "twin") and msgs[2][2].startswith("fault gpu_hang#1 fired at packet #3")


@pytest.mark.parametrize("port, code, says", [(70000, 2, "give a TCP port in 0..65535"), (None, 1, "already in use")])
def test_a_bad_or_busy_port_is_one_line_and_no_traceback(port, code, says):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        p = port if port is not None else s.getsockname()[1]
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "chestnut.launch.cli",
                "foxglove",
                "--port",
                str(p),
                "--prefix",
                f"foxport{os.getpid()}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == code and says in r.stderr and "Traceback" not in r.stderr


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chestnut.launch.cli", "foxglove", *args, "--prefix",
                           f"foxport{os.getpid()}"], capture_output=True, text=True, timeout=60)


def test_a_host_that_is_not_this_machines_blames_host_in_one_line_exit_2():
    """It said 'choose another --port' (the SDK's 'Cannot assign requested address' for any bind failure)."""
    r = _serve("--host", "192.0.2.1", "--port", "8765")  # TEST-NET-1 (RFC 5737): no machine's address
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.splitlines()
    assert line.endswith(" ERROR chestnut.foxglove: --host 192.0.2.1: no interface of this machine has that "
                         "address (Cannot assign requested address); give an address of this machine, or leave "
                         "--host out for 127.0.0.1")
    r = _serve("--host", "no-such-host.invalid", "--port", "8765")  # RFC 2606: never resolves
    assert r.returncode == 2 and r.stderr.splitlines()[-1].endswith(
        " ERROR chestnut.foxglove: --host no-such-host.invalid: cannot be resolved (Name or service not "
        "known); give an address of this machine, or leave --host out for 127.0.0.1"), r.stderr


def test_a_busy_port_blames_the_port_in_one_line_exit_1():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _serve("--port", str(port))
    assert r.returncode == 1, r.stderr
    (line,) = r.stderr.splitlines()
    assert line.endswith(f" ERROR chestnut.foxglove: port {port} on 127.0.0.1 is already in use (Address "
                         "already in use); choose another --port (0: any free one)")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_a_loopback_host_gets_no_warning(host):
    from chestnut.launch.foxglove import exposure_warning

    assert exposure_warning(host, 8765) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "dock.example"])
def test_a_host_that_is_not_loopback_is_warned_about_in_one_line(host):
    from chestnut.launch.foxglove import exposure_warning

    assert exposure_warning(host, 8765) == (
        f"--host {host} is not loopback: every camera frame and the node's outputs go, without authentication, "
        "to anyone who can reach this machine on port 8765; leave --host out to serve on 127.0.0.1 only"
    )


def _stderr_until(proc: subprocess.Popen, found: Callable[[str], T | None]) -> T:
    """Read ``proc``'s stderr line by line until ``found`` returns something for a line; that."""
    assert proc.stderr is not None
    while True:
        line = proc.stderr.readline()
        assert line, "the server ended first"
        if (got := found(line)) is not None:
            return got


def _warning_before_serving(line: str) -> str | None:
    assert " serving " not in line, "served without a warning first"
    return line if " WARNING " in line else None


def _served_port(line: str) -> int | None:
    m = re.search(r" serving \d+ topics at ws://127\.0\.0\.1:(\d+) ", line)
    return int(m.group(1)) if m else None


@pytest.mark.timeout(90)
def test_serving_on_every_interface_warns_with_the_bound_port():
    proc = subprocess.Popen(
        [sys.executable, "-m", "chestnut.launch.cli", "foxglove", "--host", "0.0.0.0", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        warned = _stderr_until(proc, _warning_before_serving)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    m = re.search(r"WARNING chestnut\.foxglove: --host 0\.0\.0\.0 is not loopback: .* on port (\d+); leave", warned)
    assert m is not None and int(m.group(1)) > 0, warned  # the port bound, not the 0 asked for
    assert proc.returncode == 0


async def _send_garbage(port: int, count: int) -> list[str]:
    """Send ``count`` malformed text messages on one connection; the server's status replies, one per message."""
    replies = []
    async with websockets.connect(f"ws://127.0.0.1:{port}", subprotocols=SUBPROTOCOLS) as ws:
        for i in range(count):
            await ws.send(f"garbage {i}")
        while len(replies) < count:
            frame = await asyncio.wait_for(ws.recv(), 10)
            if isinstance(frame, str) and json.loads(frame)["op"] == "status":
                replies.append(json.loads(frame)["message"])
    return replies


def test_a_clients_malformed_messages_are_one_warning_per_host_then_only_counted():
    proc = subprocess.Popen([sys.executable, "-m", "chestnut.launch.cli", "foxglove", "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        port = _stderr_until(proc, _served_port)
        assert len(asyncio.run(_send_garbage(port, 3))) == 3  # the server answered each: it has seen them all
        assert len(asyncio.run(_send_garbage(port, 2))) == 2  # a second connection from the same host
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    invalid = [line for line in err.splitlines() if "Invalid message" in line]
    assert len(invalid) == 1, invalid
    assert re.search(r" WARNING foxglove\.websocket\.connected_client: Invalid message from 127\.0\.0\.1:\d+: expected "
                     r"value at line 1 column 1; further invalid messages from 127\.0\.0\.1 are only counted$",
                     invalid[0]), invalid[0]
    assert err.rstrip().splitlines()[-1].endswith("; invalid client messages not logged: 4"), err
    assert proc.returncode == 0
