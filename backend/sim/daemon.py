"""``chestnut twin serve``: the process that *is* the dock for every client.

It owns one :class:`~.twin.Twin` -- so the dock's state (a wedge, a hang, a new address, loaded
programs) outlives any client, like hardware -- and serves clients over the Unix socket
``<runtime_dir()>/twin.sock`` with the framing of :mod:`.wire`: a thread per connection, at most
:data:`MAX_CONNECTIONS` at once, bulk payloads raw after a small header into a receive buffer kept for the
connection's next request. A payload is read as it arrives: the buffer grows, fourfold, only when the bytes received
have filled it, so a header that declares a length (up to ``wire.MAX_PAYLOAD``) costs nothing until its bytes come
(:meth:`_Connection.recv_payload`). At that path only nothing or a socket of ours
may lie -- a stale one, its daemon gone, is replaced -- as at the publishers' (``msgs/paths.py``
``check_socket_path``): a directory, regular file, symlink or another user's socket there is refused in one line,
exit 2, and kept.

A client that goes away is cleaned up: its open handles are closed (releasing interface claims); a
bulk OUT whose payload did not arrive in full is discarded, never applied in part; a request begun and not
finished within :data:`PARTIAL_MESSAGE_S` closes its connection, so a stalled client cannot keep its place among
:data:`MAX_CONNECTIONS` (idle between requests, a connection stays open); a wait (NAK,
timing model) of a client that closed its socket is abandoned. Nothing a client sends can stop the
daemon: a malformed frame closes that connection, a malformed USB request gets a STALL, a bug inside a
request is logged and answered with ``LIBUSB_ERROR_OTHER``. SIGTERM/SIGINT stop it within a second.

The daemon stands for hardware beside the host: its threads (which answer USB) run at ``SCHED_RR``
``TwinConfig.bridge_priority`` (default ``compute.DEFAULT_BRIDGE_PRIORITY``, 20; ``--priority``), so ordinary
host load does not delay the bridge's answers, and the program engine's compile and run happen in a child
process (:mod:`.compute`, RUN at ``--compute-priority``, default 10), so a busy GPU does not either. Both stay
below the node's realtime priority (openpilot's modeld: 54), and the daemon's own work per request is
bounded (a transfer's copy), so a realtime daemon cannot hold a core. Where the system refuses realtime
scheduling, one INFO line and it serves at the normal policy. What the host's other realtime work still
costs the twin's GPU (the compute child's run-queue waits) is published beside the socket for the node
(:mod:`.hostwait`),
so that a late answer the host caused is not read as the dock's fault.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chestnut.backend.sim import wire as W
from chestnut.backend.sim.client import _admin_local
from chestnut.backend.sim.compute import check_priority, running_pids, set_realtime
from chestnut.backend.sim.hostwait import FILE_NAME as HOSTWAIT_FILE
from chestnut.backend.sim.hostwait import WaitPublisher
from chestnut.backend.sim.libusb_codes import LIBUSB_ERROR_INVALID_PARAM, LIBUSB_ERROR_OTHER, UsbError
from chestnut.backend.sim.twin import Twin, TwinConfig
from chestnut.msgs.paths import RuntimeDirError, bind_private_socket, check_socket_path, runtime_dir

log = logging.getLogger(__name__)

ACCEPT_POLL_S = 0.2
PR_SET_TIMERSLACK = 29  # linux/prctl.h
INITIAL_BUFFER = 64 << 10
"""Bytes of a connection's receive buffer before a payload needs more: a control transfer, an admin request."""
MAX_CONNECTIONS = 64
"""Clients served at once: a host's stack holds a few (node, worker, control daemon, ``chestnut twin`` commands, the
libusb face's clients). At the bound the daemon accepts no more (one WARNING line) until one closes: a new client
waits in the socket's backlog, as deep (:meth:`TwinServer.bind`), its requests bounded by its own timeouts."""
PARTIAL_MESSAGE_S = 10.0
"""Longest time, s, from a request's first byte to its last (its header and payload, :mod:`.wire`); a request
still incomplete then closes its connection, freeing its place among :data:`MAX_CONNECTIONS`, in one WARNING line.
Between requests a connection may stay idle without bound: clients hold theirs open between transfers. The only
client, ``client.py`` ``TwinClient._request``, writes a request whole (one ``sendmsg``) and closes its connection
itself when the send outlasts its own bound (``REPLY_TIMEOUT_S`` plus the transfer's timeout), so its bytes follow
as fast as the daemon reads them: the longest request, ``wire.MAX_PAYLOAD`` (64 MiB), takes ~0.5 s at the socket
face's bulk OUT rate (about 140-150 MB/s, README "Measured", ``tests/bench/bench_libusb_face.py``). 10 s is 20x that,
and the longest single bound tinygrad 0.14 itself puts on the dock (the 10 s copy-in drain, ``backend/protocol.py``
``DRAIN_TIMEOUT_S``; the PCIe power control transfer's 10 s, ``docs/protocol.md`` "Time limits"): a request not
complete by then comes from a stopped process or one that is not a client of ours. What tinygrad's code sends to
the dock is not this: it reaches the daemon through that client, whole requests, whatever their USB timeouts."""


class StopOnSignal:
    """SIGINT/SIGTERM handler of ``twin serve``: calls ``stop`` on the first signal, logged once at INFO; a signal
    while already stopping (a terminal or ``timeout`` signals the process and its group) only at DEBUG, as
    ``node/main.py`` ``Node.request_stop`` does."""

    def __init__(self, stop: Callable[[], None]) -> None:
        self.stop = stop
        self.stopping = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.stopping:
            log.debug("signal %d: already stopping", signum)
            return
        self.stopping = True
        log.info("signal %d: stopping", signum)
        self.stop()

class PartialMessageTimeout(Exception):
    """A request whose bytes did not all come within :data:`PARTIAL_MESSAGE_S` of its first one."""


def _recv_by(sock: socket.socket, mv: memoryview, deadline: float) -> bool:
    """Fill ``mv`` from the blocking ``sock`` by ``deadline`` (``time.monotonic``); False if the peer closed before
    it was full; raises :class:`PartialMessageTimeout` when the deadline passes first. Bytes already queued are
    taken without a wait (``MSG_DONTWAIT``); only an empty queue polls, for what is left of the bound."""
    got = 0
    poller: select.poll | None = None
    while got < len(mv):
        try:
            k = sock.recv_into(mv[got:], 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PartialMessageTimeout from None
            if poller is None:
                poller = select.poll()
                poller.register(sock, select.POLLIN)
            poller.poll(math.ceil(left * 1000))  # readable, closed or timed out: the recv above tells which
            continue
        if k == 0:
            return False
        got += k
    return True


class TwinAlreadyServing(RuntimeError):
    """Another twin daemon answers on this prefix's socket; ``pid``: its process (0 when the kernel did not
    say). ``chestnut twin serve`` exits 2 with this line, as for any refused start."""

    def __init__(self, path: Path, pid: int) -> None:
        self.path, self.pid = path, pid
        who = f"pid {pid}" if pid else "another process"
        super().__init__(
            f"a twin daemon ({who}) is already serving at {path}: stop it first, or serve another prefix with "
            "CHESTNUT_PREFIX=NAME"
        )


def _peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of a connected unix socket (``SO_PEERCRED``: for a client, the
    server that called ``listen``, socket(7)); 0 when it cannot be read."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return 0
    return int(struct.unpack("3i", creds)[0])


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the client has closed its end (used to abandon its waits)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True


class _Connection:
    """One client: its socket, its handles, its buffers."""

    def __init__(self, twin: Twin, sock: socket.socket, number: int) -> None:
        self.twin = twin
        self.sock = sock
        self.number = number
        self.handles: set[int] = set()
        self.hdr = bytearray(W.REQ.size)
        self.buf = bytearray(INITIAL_BUFFER)

    def cancelled(self) -> bool:
        return _peer_closed(self.sock)

    def serve(self) -> None:
        hmv = memoryview(self.hdr)
        try:
            while True:
                k = self.sock.recv_into(hmv)  # between requests: no bound, clients keep connections open
                if k == 0:
                    return
                deadline = time.monotonic() + PARTIAL_MESSAGE_S  # the request's first byte came: the rest within
                if not _recv_by(self.sock, hmv[k:], deadline):
                    return
                plen, op, flags, b0, b1, value, index, handle, length, timeout_ms = W.REQ.unpack(self.hdr)
                if plen > W.MAX_PAYLOAD or op not in W.OPS or length > W.MAX_PAYLOAD:
                    self._reply(W.ST_BAD_FRAME, 0, f"bad frame: op {op}, payload {plen}, length {length}".encode())
                    log.warning("client %d: bad frame (op %d, payload %d); closing", self.number, op, plen)
                    return
                payload = self.recv_payload(plen, deadline)
                if payload is None:
                    log.info("client %d went away mid-request (op %d); request discarded", self.number, op)
                    return
                status, rvalue, out = self._execute(op, flags, b0, b1, value, index, handle, length, timeout_ms,
                                                    payload)
                self._reply(status, rvalue, out)
        except PartialMessageTimeout:
            log.warning("client %d: a request still incomplete %g s after its first byte; closing (request "
                        "discarded, its place freed)", self.number, PARTIAL_MESSAGE_S)
        except OSError as e:
            log.info("client %d: %s", self.number, e)
        finally:
            for h in self.handles:
                self.twin.close_handle(h)
            self.sock.close()

    def recv_payload(self, plen: int, deadline: float) -> memoryview | None:
        """The request's ``plen`` payload bytes (``plen`` <= ``wire.MAX_PAYLOAD``), a view of :attr:`buf`; None if
        the client closed first; :class:`PartialMessageTimeout` if they are not all in by ``deadline``
        (``time.monotonic``). Read as they arrive: when the bytes received fill the buffer it grows to four times
        its size (at most ``plen``), so the buffer is never larger than :data:`INITIAL_BUFFER` or four times what was
        received, whichever is more, whatever a header declares; it is kept for the connection's next request.
        Fourfold rather than twofold: a first big payload on a connection costs fewer zero-filled buffers and
        copies (64 KiB to 64 MiB in 5 steps, not 10)."""
        got = 0
        while True:
            end = min(plen, len(self.buf))
            if not _recv_by(self.sock, memoryview(self.buf)[got:end], deadline):
                return None
            got = end
            if got == plen:
                return memoryview(self.buf)[:plen]
            grown = bytearray(min(plen, 4 * len(self.buf)))  # a new one: a view of the old may still be held
            grown[:got] = memoryview(self.buf)[:got]
            self.buf = grown

    def _reply(self, status: int, value: int, out: bytes | memoryview) -> None:
        hdr = W.RSP.pack(len(out), status, value & 0xFFFFFFFF)
        if not len(out):
            self.sock.sendall(hdr)
            return
        sent = self.sock.sendmsg([hdr, out])
        if sent < len(hdr):
            self.sock.sendall(hdr[sent:])
            self.sock.sendall(out)
        elif sent < len(hdr) + len(out):
            self.sock.sendall(memoryview(out)[sent - len(hdr):])

    def _own(self, handle: int) -> int:
        if handle not in self.handles:
            raise UsbError(LIBUSB_ERROR_INVALID_PARAM, f"handle {handle} was not opened on this connection")
        return handle

    def _execute(self, op: int, flags: int, b0: int, b1: int, value: int, index: int, handle: int, length: int,
                 timeout_ms: int, payload: memoryview) -> tuple[int, int, bytes]:
        try:
            return W.ST_OK, *self._dispatch(op, flags, b0, b1, value, index, handle, length, timeout_ms, payload)
        except UsbError as e:
            return e.code, e.transferred, e.detail.encode()
        except ValueError as e:
            return W.ST_BAD_ARGUMENT, 0, str(e).encode()
        except Exception as e:  # a twin bug must never take the daemon down
            log.exception("client %d: op %d failed inside the twin", self.number, op)
            return LIBUSB_ERROR_OTHER, 0, f"{type(e).__name__}: {e}".encode()

    def _dispatch(self, op: int, flags: int, b0: int, b1: int, value: int, index: int, handle: int, length: int,
                  timeout_ms: int, payload: memoryview) -> tuple[int, bytes]:
        tw, is_async = self.twin, bool(flags & W.FLAG_ASYNC)
        if op == W.OP_CTRL:
            result = tw.ctrl_transfer(self._own(handle), b0, b1, value, index,
                                      length if b0 & 0x80 else bytes(payload), timeout_ms,
                                      is_async=is_async, cancel=self.cancelled)
            return (0, result) if isinstance(result, bytes) else (result, b"")
        if op == W.OP_BULK_OUT:
            return tw.bulk_write(self._own(handle), b0, payload, timeout_ms, is_async=is_async,
                                 cancel=self.cancelled), b""
        if op == W.OP_BULK_IN:
            return 0, tw.bulk_read(self._own(handle), b0, length, timeout_ms, is_async=is_async,
                                   cancel=self.cancelled)
        if op == W.OP_PING:
            return 0, b""
        if op == W.OP_ENUMERATE:
            return 0, json.dumps([d.to_json() for d in tw.enumerate()]).encode()
        if op == W.OP_OPEN:
            h = tw.open(b0, b1)
            self.handles.add(h)
            return h, b""
        if op == W.OP_CLOSE:
            tw.close_handle(self._own(handle))
            self.handles.discard(handle)
            return 0, b""
        if op == W.OP_CLAIM:
            tw.claim_interface(self._own(handle), index)
            return 0, b""
        if op == W.OP_RELEASE:
            tw.release_interface(self._own(handle), index)
            return 0, b""
        if op == W.OP_CLEAR_HALT:
            tw.clear_halt(self._own(handle), b0)
            return 0, b""
        assert op == W.OP_ADMIN
        try:
            req: Any = json.loads(bytes(payload))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"admin request is not JSON: {e}") from None
        if not isinstance(req, dict) or not isinstance(req.get("cmd"), str):
            raise ValueError("admin request must be a JSON object with a 'cmd'")
        cmd = req.pop("cmd")
        try:
            result = _admin_local(tw, cmd, req)
        except (KeyError, TypeError) as e:
            raise ValueError(f"admin {cmd}: bad arguments ({e})") from None
        return 0, b"" if result is None else json.dumps(result).encode()


class TwinServer:
    """Serves one Twin on a Unix socket at ``path`` until :meth:`stop`."""

    def __init__(self, twin: Twin, path: Path) -> None:
        self.twin = twin
        self.path = path
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._count = 0
        self.connections: set[_Connection] = set()
        """The connections being served (at most :data:`MAX_CONNECTIONS`)."""
        self._freed = threading.Condition()  # guards connections; notified when one ends

    def bind(self) -> None:
        """Bind the socket. Only nothing or a socket of ours may lie at the path (the publishers' rule,
        :func:`~chestnut.msgs.paths.check_socket_path`): a stale one, its daemon gone, is replaced. Raises
        :class:`~chestnut.msgs.paths.SocketPathError` for anything else there (a directory, a regular file, a
        symlink, another user's socket: kept, never followed), :class:`TwinAlreadyServing` (naming its pid) if
        another daemon already answers there, ``OSError`` from the bind itself."""
        check_socket_path(self.path)
        if os.path.lexists(self.path):  # a socket of ours: a live daemon's, or a stale one
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.path))
                raise TwinAlreadyServing(self.path, _peer_pid(probe))
            except (ConnectionRefusedError, FileNotFoundError):
                self.path.unlink(missing_ok=True)  # stale socket of a daemon that died
            finally:
                probe.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bind_private_socket(self.path, lambda: s.bind(str(self.path)))  # 0600, never reachable by another user
        s.listen(MAX_CONNECTIONS)
        s.settimeout(ACCEPT_POLL_S)
        self._listener = s

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopped(self) -> threading.Event:
        """Set once :meth:`stop` was called."""
        return self._stop

    def serve_forever(self) -> None:
        assert self._listener is not None, "bind() first"
        try:
            while not self._stop.is_set():
                with self._freed:
                    if len(self.connections) >= MAX_CONNECTIONS:
                        self._freed.wait(ACCEPT_POLL_S)
                        continue
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError as e:
                    if self._stop.is_set():
                        break
                    log.warning("accept: %s", e)
                    continue
                conn.settimeout(None)
                self._count += 1
                c = _Connection(self.twin, conn, self._count)
                with self._freed:
                    self.connections.add(c)
                    if len(self.connections) == MAX_CONNECTIONS:
                        log.warning("%d clients connected, the most served at once: a new client waits until one "
                                    "closes", MAX_CONNECTIONS)
                threading.Thread(target=self._serve, args=(c,), name=f"twin-client-{self._count}",
                                 daemon=True).start()
        finally:
            self._listener.close()
            self.path.unlink(missing_ok=True)

    def _serve(self, c: _Connection) -> None:
        """Serve ``c`` until it ends, then free its place among :attr:`connections`."""
        try:
            c.serve()
        finally:
            with self._freed:
                self.connections.discard(c)
                self._freed.notify()


def _tight_timer_slack() -> None:
    """Ask Linux for 1 ns timer slack (default 50 us) so the timing model's short sleeps end on time."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(1), 0, 0, 0)
    except (OSError, AttributeError) as e:
        log.debug("timer slack unchanged: %s", e)


TWIN_STATE_PERIOD_S = 1.0  # twinState is a 1 Hz service (msgs/services.py)
FAULT_EVENT_POLL_S = 0.02  # s between drains of the fault-event queue: a twinFault is sent within 20 ms
PUBLISHER_JOIN_S = 2.0  # s serve() waits at exit for the twinState thread to send its last events and close


def _send_twin_state(pm: Any, twin: Twin) -> None:
    from chestnut.msgs.messaging import new_message

    st = twin.status()
    msg = new_message("twinState")
    ts = msg.twinState
    usb = st["usb"]
    ts.present = bool(usb["present"])
    ts.bus, ts.address = int(usb["bus"]) & 0xFF, int(usb["address"]) & 0xFF
    ts.speedMbps = int(usb["speed_mbps"])
    ts.ltssm = int(st["bridge"]["ltssm"]) & 0xFF
    faults = ts.init("faults", len(st["faults"]))
    for i, f in enumerate(st["faults"]):
        faults[i] = f"{f['kind']}#{f['id']}:{f['fired']}"
    ts.programEngine = twin.config.program_engine
    ts.wedged = bool(st["bridge"]["wedged"])
    ts.phase = str(st["phase"])
    pm.send("twinState", msg)


def _send_fault_events(pm: Any, twin: Twin) -> int:
    """Publish the twin's fault events since the last call as ``twinFault`` messages; returns how many."""
    from chestnut.msgs.messaging import new_message

    with twin.lock:
        events = twin.faults.drain_events()
    for ev in events:
        msg = new_message("twinFault")
        tf = msg.twinFault
        tf.id = ev.fault_id
        tf.kind = ev.kind
        tf.action = ev.action
        tf.params = ev.params
        tf.site = ev.site
        tf.fired = min(ev.fired, 2**32 - 1)
        tf.opportunities = min(ev.opportunities, 2**32 - 1)  # a UInt32: a count past it is shown at the top
        tf.monoTime = max(0, int(ev.t_s * 1e9))  # the twin's clock is time.monotonic (Twin's default)
        pm.send("twinFault", msg)
    return len(events)


def publish_twin_state(twin: Twin, pm: Any, server: TwinServer) -> None:
    """Publish ``twinState`` at 1 Hz (presence, address, speed, LTSSM, active faults, engine, phase)
    and every fault event as ``twinFault`` within :data:`FAULT_EVENT_POLL_S` of it happening.

    The twin's side of the log: replay and reports see which faults were live, when each one was
    armed, fired (and what it hit) and cleared, and how the twin ran programs. Runs in a daemon
    thread until the server stops, on ``pm`` (a ``PubMaster`` of both services, which it closes at the end)."""
    with pm:
        next_state = time.monotonic() + TWIN_STATE_PERIOD_S
        while not server.stopped.wait(FAULT_EVENT_POLL_S):
            _send_fault_events(pm, twin)
            if time.monotonic() >= next_state:
                next_state += TWIN_STATE_PERIOD_S
                _send_twin_state(pm, twin)
        _send_fault_events(pm, twin)


def serve(config: TwinConfig, prefix: str | None = None) -> int:
    """Run the daemon in this process until SIGTERM/SIGINT. Returns the exit code: 0 after a stop, 2 for a start
    refused in one logged line (another daemon serves the prefix, something not a socket of ours lies at
    ``twin.sock``, a publisher lock or socket path of ``twinState`` / ``twinFault`` is not ours or is held), 1
    when the socket cannot be bound otherwise."""
    path = runtime_dir(prefix) / W.SOCKET_NAME
    if config.link_mbps is not None or config.latency_us:
        _tight_timer_slack()
    # before any thread starts: the connection, engine and publisher threads inherit the policy
    refused = set_realtime(check_priority(config.bridge_priority, "bridge priority"))
    twin = Twin(config)
    server = TwinServer(twin, path)
    try:
        server.bind()
    except (TwinAlreadyServing, RuntimeDirError) as e:  # a second instance on the prefix, or a path planted where
        log.error("%s", e)  # the socket goes (SocketPathError): refused like any start, exit 2, in that one line
        twin.close()
        return 2
    except (RuntimeError, OSError) as e:
        log.error("%s", e)
        twin.close()
        return 1
    on_signal = StopOnSignal(server.stop)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    from chestnut.msgs.messaging import PubMaster

    try:  # the publishers' sockets and locks before serving: a lock another process holds or planted refuses it
        pm = PubMaster(["twinState", "twinFault"], prefix=prefix)
    except (RuntimeError, OSError) as e:
        log.error("%s", e)
        server.stop()
        server.serve_forever()  # stopped already: it only closes the socket and removes its file
        twin.close()
        return 2
    # said once the start can no longer be refused (the socket bound, the publishers' locks and sockets taken): a
    # refusal stays one line
    if refused:
        log.info("bridge: %s", refused)
    elif config.bridge_priority:
        log.info("bridge: threads at SCHED_RR priority %d", config.bridge_priority)
    publisher = threading.Thread(target=publish_twin_state, args=(twin, pm, server), name="twinState",
                                 daemon=True)
    publisher.start()
    # how long the twin's GPU (the compute child) waited for a host CPU: the node tells host load from a dock fault
    waits = WaitPublisher(path.parent / HOSTWAIT_FILE, running_pids, twin.can_work)
    waits.start()
    d = twin.enumerate()[0]
    log.info("twin serving at %s: %04x:%04x at %d-%d, %d Mbps, pid %d", path, d.vid, d.pid, d.bus, d.address,
             d.speed_mbps, os.getpid())
    try:
        server.serve_forever()
    finally:
        # the publisher's last drain and its sockets' close (which unlinks their ipc files) before exit
        publisher.join(PUBLISHER_JOIN_S)
        waits.stop()
        twin.close()
    log.info("twin stopped")
    return 0
