"""The twin daemon: state outlives clients, like hardware; nothing a client does can break it.

Every test runs its own `chestnut twin serve` under the test's private prefix.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import planted
import pytest

from chestnut.backend import protocol as P
from chestnut.backend.sim import wire as W
from chestnut.backend.sim.client import TwinClient, TwinDaemon, TwinNotRunning, running_twin, socket_path
from chestnut.backend.sim.libusb_codes import (
    LIBUSB_ERROR_INVALID_PARAM,
    LIBUSB_ERROR_NO_DEVICE,
    LIBUSB_ERROR_PIPE,
    LIBUSB_ERROR_TIMEOUT,
    UsbError,
)

IN, OUT = P.REQTYPE_VENDOR_IN, P.REQTYPE_VENDOR_OUT
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def twin():
    with running_twin(args=["--training-delay-ms", "2"]) as client:
        yield client


def opened(client: TwinClient) -> int:
    d = client.enumerate()[0]
    return client.open(d.bus, d.address)


def child(script: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env=dict(os.environ), text=True, **popen)


def cli(*args: str, prefix: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ) if prefix is None else {**os.environ, "CHESTNUT_PREFIX": prefix}
    return subprocess.run([sys.executable, "-m", "chestnut.launch.cli", "twin", *args], env=env, capture_output=True,
                          text=True, timeout=30)


def eventually(fn, timeout_s=5.0):
    """Poll ``fn`` until it returns true (the daemon notices a dead client asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while not fn():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def sram_arm_write(client, h, nbytes, slot=0):
    sectors = nbytes // 512
    client.ctrl_transfer(h, OUT, P.REQ_SRAM, sectors, slot | (-(-nbytes // P.SRAM_SLOT)) << 8, b"")


def sram_read(client, h, nbytes, slot=0):
    sectors = nbytes // 512
    client.ctrl_transfer(h, OUT, P.REQ_SRAM, sectors | 0x8000, slot | (-(-nbytes // P.SRAM_SLOT)) << 8, b"")
    return client.bulk_read(h, P.EP_BULK_IN, nbytes)


# ---------------------------------------------------------------------- state outlives clients
def test_a_second_client_sees_what_the_first_wrote(twin):
    h = opened(twin)
    twin.ctrl_transfer(h, OUT, P.REQ_XDATA_WRITE, 0xA123, 0x5A, b"")
    with TwinClient() as other:
        assert other.enumerate() == twin.enumerate()
        assert other.ctrl_transfer(opened(other), IN, P.REQ_XDATA_READ, 0xA123, 0, 1) == b"\x5a"


def test_state_written_by_a_client_process_outlives_it(twin):
    p = child("""
        from chestnut.backend.sim.client import TwinClient
        c = TwinClient()
        d = c.enumerate()[0]
        h = c.open(d.bus, d.address)
        c.claim_interface(h, 0)
        c.ctrl_transfer(h, 0x40, 0xF2, 128, 16 | 4 << 8, b"")
        c.bulk_write(h, 0x02, bytes(range(256)) * 256)
        c.ctrl_transfer(h, 0x40, 0xE5, 0xA800, 7, b"")
    """)
    assert p.wait(30) == 0
    h = opened(twin)
    assert sram_read(twin, h, 65536, slot=16) == bytes(range(256)) * 256
    assert twin.ctrl_transfer(h, IN, P.REQ_XDATA_READ, 0xA800, 0, 1) == b"\x07"
    st = twin.status()["usb"]
    assert (st["open_handles"], st["claimed"]) == (1, {})  # the child's handle and claim went with it
    twin.claim_interface(h, 0)


def test_a_client_killed_mid_bulk_transfer_leaves_the_twin_consistent(twin):
    p = child("""
        import sys, time
        from chestnut.backend.sim import wire as W
        from chestnut.backend.sim.client import TwinClient
        c = TwinClient()
        d = c.enumerate()[0]
        h = c.open(d.bus, d.address)
        c.claim_interface(h, 0)
        c.ctrl_transfer(h, 0x40, 0xF2, 512, 0 | 16 << 8, b"")
        # a 256 KiB bulk OUT of which only 100 KiB ever leave the host
        c._sock.sendall(W.REQ.pack(1 << 18, W.OP_BULK_OUT, 0, 0x02, 0, 0, 0, h, 0, 1000) + b"\\xee" * 100000)
        print("sent", flush=True)
        time.sleep(60)
    """, stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == "sent"
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    eventually(lambda: twin.status()["usb"]["open_handles"] == 0)
    st = twin.status()
    assert st["usb"]["claimed"] == {}
    assert st["bridge"]["out_stream"] == {"kind": "sram", "base": 0, "total": 1 << 18, "pos": 0}  # still armed
    h = opened(twin)
    twin.claim_interface(h, 0)
    assert sram_read(twin, h, 1 << 18) == bytes(1 << 18)  # nothing of the partial transfer was applied
    sram_arm_write(twin, h, 1 << 18)
    assert twin.bulk_write(h, P.EP_BULK_OUT, b"\x11" * (1 << 18)) == 1 << 18
    assert sram_read(twin, h, 1 << 18) == b"\x11" * (1 << 18)


def test_a_client_killed_while_the_device_naks_is_cleaned_up(twin):
    p = child("""
        from chestnut.backend.sim.client import TwinClient
        c = TwinClient()
        d = c.enumerate()[0]
        h = c.open(d.bus, d.address)
        c.claim_interface(h, 0)
        print("waiting", flush=True)
        c.bulk_read(h, 0x81, 512, 0)   # nothing armed, no timeout: NAKs forever
    """, stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == "waiting"
    time.sleep(0.1)
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    eventually(lambda: twin.status()["usb"]["open_handles"] == 0)
    assert twin.status()["usb"]["claimed"] == {}
    h = opened(twin)
    twin.claim_interface(h, 0)


def test_a_wedged_bridge_stays_wedged_for_new_clients_until_power_cycled(twin):
    h = opened(twin)
    twin.fault("wedged")
    with pytest.raises(UsbError) as e:
        twin.ctrl_transfer(h, IN, P.REQ_XDATA_READ, P.XDATA_LTSSM, 0, 1, 100)
    assert e.value.code == LIBUSB_ERROR_TIMEOUT
    twin.clear()  # the fault is gone, the wedge is not
    p = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from chestnut.backend.sim.usb3 import TwinUSB3
        (dev, name), = TwinUSB3.list_devices(0xADD1, 0x0001)
        usb = TwinUSB3(dev)            # standard requests still answer: it opens, the product string reads
        print(usb.product)
        try:
            usb.control_read(0xE4, 1, value=0xB450, timeout=100)
        except RuntimeError as e:
            print(e)
    """)], env=dict(os.environ), capture_output=True, text=True, timeout=30)
    assert p.stdout.splitlines() == ["custom ASM2464PD Chestnut", "libusb_control_transfer: Operation timed out"]
    old = twin.enumerate()[0]
    twin.power_cycle()
    new = twin.enumerate()[0]
    assert new.address == old.address + 1 and not twin.status()["bridge"]["wedged"]
    assert twin.ctrl_transfer(opened(twin), IN, P.REQ_XDATA_READ, P.XDATA_LTSSM, 0, 1, 100) == bytes([P.LTSSM_DETECT])


REENUM_CHILD = """
    import sys
    from chestnut.backend.sim.usb3 import TwinUSB3
    (dev, name), = TwinUSB3.list_devices(0xADD1, 0x0001)
    usb = TwinUSB3(dev)
    usb.control_read(0xE4, 1, value=0xB450)
    print(name, flush=True)
    sys.stdin.readline()
    for step in (lambda: usb.control_read(0xE4, 1, value=0xB450), lambda: TwinUSB3(dev)):
        try:
            step()
            print("ok")
        except RuntimeError as e:
            print(e)
    print(*[n for _, n in TwinUSB3.list_devices(0xADD1, 0x0001)], flush=True)
"""


def test_a_reenumerated_dock_is_seen_only_by_a_fresh_process(twin):
    first = twin.enumerate()[0]
    p = child(REENUM_CHILD, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == f"usb:{first.bus}-{first.address}"
    twin.fault("reenumerate")
    p.stdin.write("go\n")
    p.stdin.flush()
    out = p.communicate(timeout=30)[0].splitlines()
    assert out == ["libusb_control_transfer: No such device (it may have been disconnected)",
                   "libusb_open: No such device (it may have been disconnected)",
                   f"usb:{first.bus}-{first.address}"]  # its cached list still names the old address
    fresh = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from chestnut.backend.sim.usb3 import TwinUSB3
        (dev, name), = TwinUSB3.list_devices(0xADD1, 0x0001)
        print(name, hex(TwinUSB3(dev).control_read(0xE4, 1, value=0xB450)[0]))
    """)], env=dict(os.environ), capture_output=True, text=True, timeout=30)
    assert fresh.stdout.strip() == f"usb:{first.bus}-{first.address + 1} 0x0"


# ---------------------------------------------------------------------- robustness
def raw_exchange(path, data: bytes) -> bytes:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(path))
    s.sendall(data)
    chunks = []
    while True:
        try:
            b = s.recv(65536)
        except (TimeoutError, ConnectionResetError):  # the daemon closed with our garbage unread
            break
        if not b:
            break
        chunks.append(b)
    s.close()
    return b"".join(chunks)


def test_malformed_frames_close_only_that_connection(twin):
    path = socket_path()
    bad_op = raw_exchange(path, W.REQ.pack(0, 99, 0, 0, 0, 0, 0, 0, 0, 0))
    n, status, _ = W.RSP.unpack(bad_op[:W.RSP.size])
    assert status == W.ST_BAD_FRAME and b"op 99" in bad_op[W.RSP.size:]
    huge = raw_exchange(path, W.REQ.pack(W.MAX_PAYLOAD + 1, W.OP_BULK_OUT, 0, 2, 0, 0, 0, 1, 0, 0))
    assert W.RSP.unpack(huge[:W.RSP.size])[1] == W.ST_BAD_FRAME
    assert raw_exchange(path, b"\x01\x02\x03") == b""  # a truncated header: the connection just ends
    http = raw_exchange(path, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
    assert http == b"" or W.RSP.unpack(http[:W.RSP.size])[1] == W.ST_BAD_FRAME
    twin.ping()
    h = opened(twin)
    assert twin.ctrl_transfer(h, IN, P.REQ_XDATA_READ, P.XDATA_LTSSM, 0, 1) == b"\x00"


@pytest.fixture
def server():
    """The daemon's server in this process, its connections visible, on the test's socket; stopped at the end."""
    from chestnut.backend.sim.daemon import TwinServer
    from chestnut.backend.sim.twin import Twin, TwinConfig

    twin = Twin(TwinConfig(training_delay_s=0.002))
    srv = TwinServer(twin, socket_path())
    srv.bind()
    accept = threading.Thread(target=srv.serve_forever, name="twin-accept")
    accept.start()
    try:
        yield srv
    finally:
        srv.stop()
        accept.join(10)
        twin.close()
    eventually(lambda: not srv.connections)  # every client thread ended with its client


def connected(path, first: bytes = b"") -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    s.sendall(first)
    return s


def daemon_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "chestnut.backend.sim.daemon"]


def test_a_declared_payload_is_read_as_it_arrives_and_the_daemon_serves_on(server, caplog):
    """40 connections that each sent a header declaring a big payload and nothing more made the daemon allocate each
    payload at once (2.5 GB RSS): its buffer now grows with the bytes received, 64 KiB to start, fourfold."""
    from chestnut.backend.sim.daemon import INITIAL_BUFFER

    caplog.set_level("INFO", logger="chestnut.backend.sim.daemon")
    assert INITIAL_BUFFER == 65536
    over = raw_exchange(server.path, W.REQ.pack(0xFFFFFFFF, W.OP_BULK_OUT, 0, 2, 0, 0, 0, 1, 0, 0))
    detail = b"bad frame: op 7, payload 4294967295, length 0"
    assert over == W.RSP.pack(len(detail), W.ST_BAD_FRAME, 0) + detail  # over wire.MAX_PAYLOAD: refused, closed
    assert daemon_lines(caplog) == ["client 1: bad frame (op 7, payload 4294967295); closing"]
    declared = W.REQ.pack(W.MAX_PAYLOAD, W.OP_BULK_OUT, 0, 2, 0, 0, 0, 1, 0, 0)
    socks = []
    try:
        for _ in range(40):
            socks.append(connected(server.path, declared + bytes(INITIAL_BUFFER + 1)))
        eventually(lambda: sorted(len(c.buf) for c in server.connections) == [4 * INITIAL_BUFFER] * 40)
        with TwinClient() as other:  # served beside them, a payload 4x the first buffer intact
            h = opened(other)
            other.claim_interface(h, 0)
            sram_arm_write(other, h, 1 << 18)
            data = bytes(range(256)) * 1024
            assert other.bulk_write(h, P.EP_BULK_OUT, data) == 1 << 18
            assert sram_read(other, h, 1 << 18) == data
    finally:
        for s in socks:
            s.close()
    eventually(lambda: not server.connections)
    assert sorted(daemon_lines(caplog)[1:]) == sorted(
        f"client {n} went away mid-request (op 7); request discarded" for n in range(2, 42))


def test_at_most_64_clients_are_served_and_the_next_waits_for_a_place(server, caplog):
    from chestnut.backend.sim.daemon import MAX_CONNECTIONS

    caplog.set_level("INFO", logger="chestnut.backend.sim.daemon")
    assert MAX_CONNECTIONS == 64
    socks = [connected(server.path) for _ in range(64)]
    try:
        eventually(lambda: len(server.connections) == 64)
        full = "64 clients connected, the most served at once: a new client waits until one closes"
        assert daemon_lines(caplog) == [full]
        with TwinClient(reply_timeout_s=0.3) as waiting:  # in the socket's backlog: connected, not served
            with pytest.raises(TwinNotRunning, match=r"did not answer within 0.3 s"):
                waiting.ping()
            socks.pop().close()
            waiting.ping()  # accepted once a place is free
            assert len(server.connections) == 64
            assert daemon_lines(caplog) == [full, full]
    finally:
        for s in socks:
            s.close()


def test_a_request_left_incomplete_closes_its_connection_and_an_idle_one_stays_open(server, caplog, monkeypatch):
    """A client that stopped in the middle of a request's header kept its thread and its place among the 64
    forever; now a request has PARTIAL_MESSAGE_S from its first byte to its last, and a connection idle between
    requests (what every client does between transfers) stays open."""
    from chestnut.backend.sim import daemon

    caplog.set_level("INFO", logger="chestnut.backend.sim.daemon")
    assert daemon.PARTIAL_MESSAGE_S == 10.0
    monkeypatch.setattr(daemon, "PARTIAL_MESSAGE_S", 0.3)
    ping = W.REQ.pack(0, W.OP_PING, 0, 0, 0, 0, 0, 0, 0, 0)
    idle = connected(server.path)  # client 1: connected, nothing sent
    t0 = time.monotonic()
    in_header = connected(server.path, ping[:3])  # client 2: 3 of the header's 24 bytes
    in_payload = connected(server.path, W.REQ.pack(100, W.OP_BULK_OUT, 0, 2, 0, 0, 0, 1, 0, 0) + bytes(10))  # 3
    try:
        for s in (in_header, in_payload):
            s.settimeout(5)
            assert s.recv(64) == b""  # closed by the daemon, no reply
            assert time.monotonic() - t0 >= 0.3
        eventually(lambda: len(server.connections) == 1)  # their places are free
        time.sleep(0.4)  # idle longer than the bound, between requests: still served
        idle.sendall(ping)
        idle.settimeout(5)
        assert idle.recv(64) == W.RSP.pack(0, W.ST_OK, 0)
        with TwinClient() as client:  # a client's pauses between requests are not requests left incomplete
            client.ping()
            time.sleep(0.4)
            client.ping()
    finally:
        for s in (idle, in_header, in_payload):
            s.close()
    eventually(lambda: not server.connections)
    line = ("client {}: a request still incomplete 0.3 s after its first byte; closing (request discarded, its "
            "place freed)")
    assert sorted(daemon_lines(caplog)) == [line.format(2), line.format(3)]


def test_bad_admin_requests_and_foreign_handles_are_rejected(twin):
    with pytest.raises(ValueError, match="unknown fault kind"):
        twin.fault("meteor_strike")
    with pytest.raises(ValueError, match="unknown admin command"):
        twin._admin("format_disk")
    with pytest.raises(ValueError, match="not JSON"):
        twin._request(W.OP_ADMIN, payload=b"\xff{", admin=True)
    h = opened(twin)
    with TwinClient() as other, pytest.raises(UsbError) as e:
        other.ctrl_transfer(h, IN, P.REQ_XDATA_READ, 0, 0, 1)
    assert e.value.code == LIBUSB_ERROR_INVALID_PARAM


def test_random_requests_never_crash_the_daemon(twin):
    rng = random.Random(1234)
    h = opened(twin)
    codes = set()
    for _ in range(400):
        bm = rng.choice([0x40, 0xC0, 0x00, 0x80, 0x21, 0xC1])
        req = rng.choice([0xE4, 0xE5, 0xF0, 0xF2, 0xF3, 0x06, 0x09, rng.randrange(256)])
        if req == 0xF3:
            continue
        data = rng.randrange(300) if bm & 0x80 else rng.randbytes(rng.choice([0, 1, 12, 13, 64]))
        try:
            twin.ctrl_transfer(h, bm, req, rng.randrange(0x10000), rng.randrange(0x10000), data, 20)
        except UsbError as e:
            codes.add(e.code)
        for fn in (lambda: twin.bulk_write(h, 0x02, rng.randbytes(rng.choice([0, 4, 512])), 20),
                   lambda: twin.bulk_read(h, 0x81, rng.choice([4, 512]), 5)):
            if rng.random() < 0.1:
                try:
                    fn()
                except UsbError as e:
                    codes.add(e.code)
        if rng.random() < 0.05:
            twin.set_configuration(h, 1)
    assert codes <= {LIBUSB_ERROR_PIPE, LIBUSB_ERROR_TIMEOUT, LIBUSB_ERROR_INVALID_PARAM}
    twin.ping()
    assert twin.enumerate()[0].vid == 0xADD1


def test_daemon_death_looks_like_an_unplug_to_its_clients():
    with TwinDaemon(args=["--training-delay-ms", "2"]) as daemon, daemon.client() as c:
        h = opened(c)
        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait(10)
        with pytest.raises(UsbError) as e:
            c.ctrl_transfer(h, IN, P.REQ_XDATA_READ, P.XDATA_LTSSM, 0, 1)
        assert e.value.code == LIBUSB_ERROR_NO_DEVICE
        with pytest.raises(TwinNotRunning):
            c.status()
    # a stale socket file does not stop the next daemon
    with running_twin() as again:
        again.ping()


def test_sigterm_stops_the_daemon_and_a_second_daemon_refuses_the_socket():
    daemon = TwinDaemon().start()
    second = subprocess.run([sys.executable, "-m", "chestnut.launch.cli", "twin", "serve"], env=dict(os.environ),
                            capture_output=True, text=True, timeout=30)
    # refused like any start (exit 2), naming the running one's pid
    assert second.returncode == 2, second.stderr
    assert f"a twin daemon (pid {daemon.process.pid}) is already serving at {socket_path()}" in second.stderr
    assert len(second.stderr.splitlines()) == 1, second.stderr  # the refusal alone (no scheduling line before it)
    t0 = time.monotonic()
    assert daemon.stop() == 0
    assert time.monotonic() - t0 < 5.0  # the process manager's stop budget
    assert not socket_path().exists()


# ---------------------------------------------------------------------- the command line
def test_a_bad_fault_value_is_named_before_any_daemon_is_asked():
    prefix = f"nodaemon{os.getpid()}"  # no twin serves here
    bad = cli("fault", "timeout", "--probability", "2", prefix=prefix)
    assert (bad.returncode, bad.stderr) == (2, "chestnut twin fault: rejected: probability 2.0 is not in [0, 1]\n")
    nan = cli("fault", "gpu_hang", "--for", "nan", prefix=prefix)
    assert (nan.returncode, nan.stderr) == (2, "chestnut twin fault: rejected: for_s (--for) = nan is not a duration "
                                               "in seconds; give e.g. for_s=10\n")
    good = cli("fault", "gpu_hang", prefix=prefix)  # a good one: the missing daemon is what is said
    assert good.returncode == 1 and good.stderr.startswith("no twin daemon at ")


def test_cli_injects_lists_and_clears_faults_and_moves_the_dock(twin):
    r = cli("fault", "timeout", "--repeat", "--on", "0xE4", "--phase", "serving")
    assert r.returncode == 0 and r.stdout.startswith("fault 1: timeout -- the device NAKs")
    st = json.loads(cli("status", "--json").stdout)
    (f,) = st["faults"]
    assert (f["kind"], f["repeat"], f["on"], f["phase"], f["fired"]) == ("timeout", True, "0xE4", "serving", 0)
    assert "fault 1: timeout (repeat phase=serving on=0xE4) fired 0/0" in cli("status").stdout
    assert cli("clear").stdout.strip() == "cleared 1 fault(s)"
    nothing = cli("clear", "999")
    assert (nothing.returncode, nothing.stderr.strip()) == (2, "chestnut twin clear: no fault 999 (`chestnut twin "
                                                                "status` lists them)")
    assert cli("fault", "meteor").returncode == 2
    bad = cli("fault", "timeout", "--probability", "2")
    assert (bad.returncode, bad.stderr) == (2, "chestnut twin fault: rejected: probability 2.0 is not in [0, 1]\n")
    never = cli("fault", "gpu_hang", "--after", str(10**23))  # taken: a fault that could never fire
    assert (never.returncode, never.stdout, never.stderr) == (2, "", (
        "chestnut twin fault: rejected: after (--after) = 1e+23: at most 4294967294 opportunities "
        "(it fires at opportunity after + 1, and twinFault.opportunities is a UInt32: msgs/chestnut.capnp)\n"))
    off = cli("power-cycle", "--off-s", "-1")  # each refusal names its command
    assert (off.returncode, off.stderr) == (2, "chestnut twin power-cycle: rejected: off_s -1.0 is not in [0, 3600]\n")
    old = twin.enumerate()[0]
    assert cli("unplug").stdout.strip() == "unplugged" and twin.enumerate() == []
    none = cli("devices")
    assert (none.returncode, none.stdout, none.stderr) == (
        0, "", "chestnut twin devices: no device enumerates (the dock is unplugged: `chestnut twin plug`)\n")
    assert cli("plug").stdout.strip() == f"plugged in at {old.bus}-{old.address + 1}"
    # plugging in a dock that is there says so, and names a disconnect still to come: plugging does not remove it
    armed = cli("fault", "disconnect")
    assert armed.returncode == 0 and armed.stdout.startswith("fault 2: disconnect")
    assert cli("plug").stdout.splitlines() == [
        f"already plugged in at {old.bus}-{old.address + 1}",
        "note: disconnect fault 2 is armed and still to fire (fired 0 times); `chestnut twin clear 2` removes it",
    ]
    assert cli("clear", "2").returncode == 0
    # off long enough that a busy machine cannot delay this process past it; back on by itself after it
    assert cli("power-cycle", "--off-s", "3").returncode == 0
    assert twin.enumerate() == []
    deadline = time.monotonic() + 60
    while not twin.enumerate():
        assert time.monotonic() < deadline, "the dock did not come back after its power-cycle"
        time.sleep(0.05)
    assert cli("devices").stdout.strip() == f"Bus {old.bus:03d} Device {old.address + 2:03d}: ID add1:0001 5000 Mbps"
    assert "lost_receipt" in cli("kinds").stdout


def test_cli_without_a_daemon_says_so():
    r = cli("status", prefix="nobody-serves-here")
    assert r.returncode == 1 and "no twin daemon at" in r.stderr and "chestnut twin serve" in r.stderr


def test_a_planted_publisher_lock_refuses_the_start_in_one_line_and_leaves_no_socket():
    from chestnut.msgs.paths import runtime_dir

    d = runtime_dir()
    d.mkdir(parents=True, exist_ok=True)
    (d / "twinState.pub.lock").symlink_to("/nonexistent-target")
    r = cli("serve")
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "twinState.pub.lock is a symlink: not ours, refused" in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not (d / "twin.sock").exists()


LATENCY_WANT = "give a latency in microseconds >= 0 and <= 100000 (a thirtieth of the 3000 ms device wait timeout)"
LINK_WANT = "give a link rate in Mbps >= 12 (USB 1.1 Full Speed) and <= 40000 (USB4)"
PRIORITY_WANT = ("give a SCHED_RR priority >= 0 (0: normal scheduling) and <= 49 (below the node's realtime "
                 "priority)")


@pytest.mark.parametrize(("args", "line"), [
    (["--link-mbps", "-5"], f"argument --link-mbps: '-5': {LINK_WANT}"),
    (["--link-mbps", "0"], f"argument --link-mbps: '0': {LINK_WANT}"),
    (["--link-mbps", "11.9"], f"argument --link-mbps: '11.9': {LINK_WANT}"),  # was taken: below USB 1.1's 12 Mbps
    (["--link-mbps", "1e-300"], f"argument --link-mbps: '1e-300': {LINK_WANT}"),  # was taken: a chunk in ~1e292 s
    (["--link-mbps", "40001"], f"argument --link-mbps: '40001': {LINK_WANT}"),
    (["--link-mbps", "inf"], f"argument --link-mbps: 'inf': {LINK_WANT}"),
    (["--latency-us", "nan"], f"argument --latency-us: 'nan': {LATENCY_WANT}"),
    (["--training-delay-ms", "inf"], "argument --training-delay-ms: 'inf': give a time in milliseconds >= 0"),
    (["--latency-us", "abc"], f"argument --latency-us: 'abc': {LATENCY_WANT}"),
    (["--latency-us", "1e12"], f"argument --latency-us: '1e12': {LATENCY_WANT}"),  # was taken: chestnut launch's bound
    (["--latency-us", "-1"], f"argument --latency-us: '-1': {LATENCY_WANT}"),
    # these were a bare line without the program's name ("--priority and --compute-priority must be in 0..49 ...")
    (["--priority", "60"], f"argument --priority: '60': {PRIORITY_WANT}"),
    (["--priority", "-1"], f"argument --priority: '-1': {PRIORITY_WANT}"),
    (["--compute-priority", "50"], f"argument --compute-priority: '50': {PRIORITY_WANT}"),
    (["--bus", "999"], "argument --bus: '999': give a USB bus number >= 1 and <= 255"),
    (["--bus", "0"], "argument --bus: '0': give a USB bus number >= 1 and <= 255"),
    (["--address", "128"], "argument --address: '128': give a USB device address >= 1 and <= 127"),
])
def test_serve_refuses_a_timing_model_priority_or_usb_number_it_could_not_keep_in_one_line(args, line):
    r = subprocess.run([sys.executable, "-m", "chestnut.launch.cli", "twin", "serve", *args], env=dict(os.environ),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"chestnut twin serve: error: {line} (chestnut twin serve --help)"]
    assert not socket_path().exists()


# ---------------------------------------------------------------------- what lies at the socket path
@pytest.mark.parametrize(("plant", "what"), [("dir", "a directory"), ("file", "a regular file"),
                                             ("symlink", "a symlink")])
def test_a_path_planted_at_the_twin_socket_is_refused_in_one_line_exit_2_and_kept(plant, what, tmp_path):
    """A directory made the twin exit 1 at every supervisord restart, a regular file was deleted by the bind, a
    symlink gave 'Address already in use'; the publishers' rule now holds here (msgs/paths.py check_socket_path)."""
    path = socket_path()
    victim = tmp_path / "victim"
    planted.plant(path, plant, victim)
    line = f"socket path {path} holds {what}, not a socket: refused, nothing replaced; remove it and start again"
    r = cli("serve")
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and errors[0].endswith(f" ERROR chestnut.backend.sim.daemon: {line}"), r.stderr
    assert "Traceback" not in r.stderr
    status = cli("status")  # a client never connects through it either
    assert (status.returncode, status.stderr) == (2, line + "\n")
    assert os.path.lexists(path) and victim.read_text() == "precious\n"
    if plant == "dir":
        assert path.is_dir() and not path.is_symlink()
    elif plant == "file":
        assert path.read_text() == "important\n"
    else:
        assert os.readlink(path) == str(victim)


def test_another_users_socket_at_the_twin_socket_path_is_refused_and_kept():
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    path = socket_path()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
    os.chown(path, 65534, 65534)
    r = cli("serve")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith(
        f" ERROR chestnut.backend.sim.daemon: socket path {path} holds a socket of uid 65534, not one of ours (uid 0): "
        "refused, nothing replaced; remove it and start again")
    assert path.lstat().st_uid == 65534


def test_the_twin_log_is_created_private():
    import stat

    from chestnut.msgs.paths import runtime_dir

    log = runtime_dir() / W.LOG_NAME
    assert not log.exists()
    old = os.umask(0o022)  # what a login shell gives: the log was 0644
    try:
        daemon = TwinDaemon(args=["--training-delay-ms", "2"]).start()
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
    finally:
        assert daemon.stop() == 0


def test_a_fault_count_past_uint32_is_published_at_its_top_not_a_crash_of_the_publisher():
    """twinFault.fired / opportunities are UInt32 (msgs/chestnut.capnp): a fault that has seen more sites than that in
    a very long run is published with the count saturated at 2**32 - 1, where pycapnp would raise out of range."""
    from chestnut.backend.sim.daemon import _send_fault_events
    from chestnut.backend.sim.faults import FaultEvent
    from chestnut.msgs.messaging import log_from_bytes

    class Faults:
        def drain_events(self):
            return [FaultEvent(7, "stall", "fired", 12.5, "{}", "bulk out", fired=2**33, opportunities=2**40),
                    FaultEvent(8, "stall", "fired", 13.0, "{}", "bulk in", fired=3, opportunities=2**32 - 1)]

    class Twin:
        lock = threading.Lock()
        faults = Faults()

    class Pm:
        sent: list[bytes] = []

        def send(self, service, msg):
            assert service == "twinFault"
            self.sent.append(msg.to_bytes())

    pm = Pm()
    assert _send_fault_events(pm, Twin()) == 2
    got = [log_from_bytes(b).twinFault for b in pm.sent]
    assert [(f.id, f.fired, f.opportunities, f.monoTime) for f in got] == [
        (7, 2**32 - 1, 2**32 - 1, 12_500_000_000), (8, 3, 2**32 - 1, 13_000_000_000)]


def test_a_daemon_whose_backlog_is_full_is_called_full_not_absent_and_a_freed_place_is_taken():
    """A listener that takes no client (as the daemon at MAX_CONNECTIONS) with its backlog full: connect fails with
    EAGAIN. The client tries again within its connect timeout and says the daemon is full, not that none runs; once
    a place frees, the next client connects."""
    from chestnut.backend.sim.client import TwinBusy, daemon_missing

    path = socket_path()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(0)
    waiting = []
    try:
        while True:  # fill the backlog (Linux keeps backlog + 1)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(str(path))
            except BlockingIOError:
                s.close()
                break
            waiting.append(s)
        assert 1 <= len(waiting) <= 2
        t0 = time.monotonic()
        with pytest.raises(TwinBusy) as info:
            TwinClient(connect_timeout_s=0.3)
        assert 0.25 <= time.monotonic() - t0 < 5.0
        assert str(info.value) == (
            f"the twin daemon at {path} is full: it serves its most clients at once and as many more wait to be "
            "taken; none left in 0.3 s (try again once one closes)")
        assert daemon_missing() == (1, str(info.value).replace("0.3 s", "2 s"))  # its default connect timeout
        conn, _ = listener.accept()  # a place frees: the next client is taken
        conn.close()
        with TwinClient(connect_timeout_s=2.0) as client:
            assert not client.local
    finally:
        for s in waiting:
            s.close()
        listener.close()
        path.unlink(missing_ok=True)
