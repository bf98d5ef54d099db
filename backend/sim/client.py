"""Talking to the twin: :class:`TwinClient` (over the daemon's socket, or in-process) and the daemon's life.

A ``TwinClient`` is one connection, i.e. one "host process's view" of the dock. Its USB methods
mirror libusb (handles, timeouts in ms) and raise :class:`~.libusb_codes.UsbError`; its admin methods
(faults, status, plug/unplug/power-cycle) raise ``ValueError`` for bad arguments. If the daemon dies,
USB methods fail with ``LIBUSB_ERROR_NO_DEVICE`` (to a host, a vanished twin is an unplugged dock)
and admin methods with :class:`TwinNotRunning`.

Every round trip is bounded, so a daemon that accepts a connection and never answers cannot block a
caller (the node's main loop looks for the dock through this client): a request without a USB timeout
(admin, enumerate, open, claim ...) waits at most ``reply_timeout_s`` (default
:data:`REPLY_TIMEOUT_S`), a USB transfer its own ``timeout_ms`` plus that margin (``timeout_ms == 0``
means no timeout, as in libusb). A request whose reply does not come in time raises
``LIBUSB_ERROR_TIMEOUT`` (USB) or :class:`TwinNotRunning` (admin) naming the bound, and nothing else
changes: the connection and its handles stay (closing it would make the daemon close the handles and
every later call fail, which to a host is an unplug), and the late reply is owed. The next request is
sent, then the owed replies (or what is left of a partly read one) are read and discarded before its
own, all within the next request's own bound; a daemon still silent then times that request out too.
Only the socket's end (the daemon exited, or the dock's process went away) is ``LIBUSB_ERROR_NO_DEVICE``
/ :class:`TwinNotRunning` "went away". One exception: a request that could not even be *sent* in time
(a daemon that stopped reading) leaves the stream mid-frame, so it times out "took no request" and closes
the connection; later calls then fail as for a gone daemon.

In tests::

    with running_twin() as twin:            # spawns `chestnut twin serve` for $CHESTNUT_PREFIX
        dev = twin.enumerate()[0]
        h = twin.open(dev.bus, dev.address)
        twin.fault("timeout", on="0xE4")
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chestnut.backend.sim import wire as W
from chestnut.backend.sim.faults import FaultSpec
from chestnut.backend.sim.libusb_codes import (
    LIBUSB_ERROR_INVALID_PARAM,
    LIBUSB_ERROR_NO_DEVICE,
    LIBUSB_ERROR_TIMEOUT,
    UsbError,
)
from chestnut.backend.sim.twin import DeviceInfo, Twin
from chestnut.msgs.outdir import open_private
from chestnut.msgs.paths import SocketPathError, check_socket_path, current_prefix, runtime_dir

REPLY_TIMEOUT_S = 1.0
"""Longest wait (s) for the daemon's reply to a request without a USB timeout, and the margin added to a
transfer's own timeout. The daemon answers those in tens of microseconds (``tests/bench/bench_twin.py``:
control round trip p50 18-72 us), so a second only passes when it hangs."""


_HUNG_OR_FULL = "hung, or already serving the most clients it takes at once: its log says which"
"""What a daemon that does not answer in time may be: hung, or full (``backend/sim/daemon.py``
``MAX_CONNECTIONS``: a new client waits, its request unread, until one closes)."""


class TwinNotRunning(ConnectionError):
    """No twin daemon answers at the socket (or it went away)."""


class TwinBusy(TwinNotRunning):
    """A twin daemon listens at the socket but takes no new client within the connect timeout: it serves its most
    clients at once (``backend/sim/daemon.py`` ``MAX_CONNECTIONS``) and its backlog of waiting ones is full too
    (a Unix socket's ``connect`` then fails with ``EAGAIN``, unix(7)). ``str()`` says so in one line."""


CONNECT_RETRY_S = 0.05
"""While a daemon's backlog is full, a client tries to connect again this often (s) until its connect timeout."""


class TwinSocketRefused(TwinNotRunning):
    """Something other than a socket of ours lies at the twin's socket path (a directory, a regular file, a
    symlink, another user's socket: ``msgs/paths.py`` ``check_socket_path``), so no daemon of ours can answer
    there and nothing is connected through it. ``str()`` is the one line of
    :class:`~chestnut.msgs.paths.SocketPathError`; ``path`` is the socket path. ``chestnut twin`` exits 2 on it."""

    def __init__(self, path: Path, line: str) -> None:
        super().__init__(line)
        self.path = path


def socket_path(prefix: str | None = None) -> Path:
    """``<runtime_dir(prefix)>/twin.sock``."""
    return runtime_dir(prefix) / W.SOCKET_NAME


def _connect(path: Path, timeout_s: float) -> socket.socket:
    """A stream connection to the daemon at ``path``, waiting at most ``timeout_s`` (s) in all. A full backlog
    (``EAGAIN``) is tried again every :data:`CONNECT_RETRY_S` until then, and is :class:`TwinBusy` after it; any
    other failure (no socket, nobody listening) is :class:`TwinNotRunning` at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            s.connect(str(path))
            return s
        except BlockingIOError:  # EAGAIN: the daemon listens, its backlog is full
            s.close()
            if time.monotonic() + CONNECT_RETRY_S > deadline:
                raise TwinBusy(f"the twin daemon at {path} is full: it serves its most clients at once and as many "
                               f"more wait to be taken; none left in {timeout_s:g} s (try again once one closes)"
                               ) from None
            time.sleep(CONNECT_RETRY_S)
        except OSError as e:
            s.close()
            raise TwinNotRunning(
                f"no twin daemon at {path} ({e.strerror or e}); start one with `chestnut twin serve`") from None


def daemon_missing(prefix: str | None = None) -> tuple[int, str] | None:
    """``(1, line)`` when no twin daemon of ``prefix`` (default ``$CHESTNUT_PREFIX``) answers, the line saying how to
    start one, or one that listens takes no new client (:class:`TwinBusy`, its line); ``(2, line)`` when its socket
    path holds something not a socket of ours (:class:`TwinSocketRefused`, refused as ``chestnut twin`` refuses it);
    None when one answers. For the tools and the node, whose enumeration of a twin that is not running only finds no
    dock, which reads as a dock's cable and power."""
    from chestnut.msgs.paths import DEFAULT_PREFIX

    prefix = current_prefix() if prefix is None else prefix
    try:
        with TwinClient(prefix):
            pass
    except (TwinSocketRefused, TwinBusy) as e:
        return (2 if isinstance(e, TwinSocketRefused) else 1), str(e)
    except TwinNotRunning:
        serve = "chestnut twin serve" if prefix == DEFAULT_PREFIX else f"chestnut twin --prefix {prefix} serve"
        return 1, (f"the twin daemon is not running on prefix {prefix!r}: start it with `{serve}` (or run a whole "
                   "stack with `chestnut launch`)")
    return None


class TwinClient:
    """A connection to the twin. ``prefix`` picks the daemon (default ``$CHESTNUT_PREFIX``); ``twin`` instead
    binds the client to an in-process :class:`Twin` (same methods, no socket). Thread-safe: requests on
    one connection are serialised. Raises :class:`TwinNotRunning` if no daemon answers, its
    :class:`TwinSocketRefused` when the socket path holds something not a socket of ours (never connected to)."""

    daemon: TwinDaemon | None = None  # set by running_twin()

    def __init__(
        self,
        prefix: str | None = None,
        *,
        twin: Twin | None = None,
        connect_timeout_s: float = 2.0,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
    ) -> None:
        if not reply_timeout_s > 0:
            raise ValueError(f"reply_timeout_s must be > 0, got {reply_timeout_s}")
        self._twin = twin
        self.reply_timeout_s = reply_timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._hdr = bytearray(W.RSP.size)
        self._hdr_got = 0       # bytes of the next reply's header already in _hdr (a read cut short by a timeout)
        self._owed = 0          # replies of timed-out requests whose header is still to be read
        self._skip_body = 0     # bytes of a discarded reply's body still to be read
        self._dead = False
        self.prefix = current_prefix() if prefix is None else prefix
        self.path = socket_path(self.prefix) if twin is None else None
        if twin is None:
            assert self.path is not None
            try:  # never connect through a planted symlink, nor to another user's socket
                check_socket_path(self.path)
            except SocketPathError as e:
                raise TwinSocketRefused(self.path, str(e)) from None
            self._sock = _connect(self.path, connect_timeout_s)

    @classmethod
    def in_process(cls, twin: Twin) -> TwinClient:
        return cls(twin=twin)

    @property
    def local(self) -> bool:
        return self._twin is not None

    @property
    def connected(self) -> bool:
        """False once the connection is closed or the daemon went away (a timed-out request keeps it)."""
        return self._twin is not None or (self._sock is not None and not self._dead)

    @property
    def owed_replies(self) -> int:
        """Late replies of timed-out requests not yet read and discarded (a partly read one counts)."""
        return self._owed + int(self._skip_body > 0)

    # ------------------------------------------------------------------ connection
    def close_connection(self) -> None:
        """Close the connection; the daemon closes every handle it opened (releasing claims)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._dead = True

    def __enter__(self) -> TwinClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_connection()

    def _gone(self) -> None:
        self._dead = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _request(
        self,
        op: int,
        *,
        b0: int = 0,
        b1: int = 0,
        value: int = 0,
        index: int = 0,
        handle: int = 0,
        length: int = 0,
        timeout_ms: int = 0,
        flags: int = 0,
        payload: bytes | bytearray | memoryview = b"",
        into: memoryview | None = None,
        admin: bool = False,
    ) -> tuple[int, bytes | int]:
        """One round trip. Returns (value, payload) -- or (value, nbytes) when ``into`` receives the payload.

        Bounded: ``reply_timeout_s``, plus ``timeout_ms`` for a USB transfer (``timeout_ms == 0`` on a
        USB op: unbounded, as libusb's 0). Late replies of earlier timed-out requests are read and dropped
        first, within the same bound (see the module docstring)."""
        usb_op = op in (W.OP_CTRL, W.OP_BULK_OUT, W.OP_BULK_IN)
        bound_s: float | None = self.reply_timeout_s + (timeout_ms / 1000 if usb_op else 0.0)
        if usb_op and timeout_ms == 0:
            bound_s = None
        deadline = None if bound_s is None else time.monotonic() + bound_s
        with self._lock:
            s = self._sock
            if s is None or self._dead:
                if admin:
                    raise TwinNotRunning(f"the connection to {self.path} is closed")
                raise UsbError(LIBUSB_ERROR_NO_DEVICE, "the twin daemon is gone")
            hdr = W.REQ.pack(len(payload), op, flags, b0, b1, value, index, handle, length, timeout_ms)
            try:
                s.settimeout(_left(deadline))
                if len(payload):
                    self._send_gather(s, hdr, payload)
                else:
                    s.sendall(hdr)
            except TimeoutError:  # the request is on the wire in part: the stream cannot be resumed
                self._gone()
                raise _failure(admin, LIBUSB_ERROR_TIMEOUT, f"the twin daemon at {self.path} took no request within "
                               f"{bound_s:g} s ({_HUNG_OR_FULL}); connection closed") from None
            except OSError:
                self._gone()
                raise self._went_away(admin) from None
            self._owed += 1  # this request's reply, until its header is read
            body = bytearray()
            try:
                self._drain_owed(s, deadline)
                n, status, rvalue = self._read_header(s, deadline)
                if n > W.MAX_PAYLOAD:  # a bounded read: never allocate what a broken daemon announces
                    raise ConnectionResetError(f"the twin daemon announced a {n}-byte reply")
                self._skip_body = n  # until it is read: a timeout in the body leaves the rest to discard
                if status == W.ST_OK and into is not None and n <= len(into):
                    self._recv_body(s, into[:n], deadline)
                    return rvalue, n
                body = bytearray(n)
                self._recv_body(s, memoryview(body), deadline)
            except TimeoutError:
                raise _failure(admin, LIBUSB_ERROR_TIMEOUT,
                               f"the twin daemon at {self.path} did not answer within {bound_s:g} s "
                               f"({_HUNG_OR_FULL})") from None
            except OSError:
                self._gone()
                raise self._went_away(admin) from None
        if status == W.ST_OK:
            return rvalue, bytes(body)
        detail = body.decode(errors="replace")
        if status == W.ST_BAD_ARGUMENT:
            raise ValueError(detail)
        if status == W.ST_BAD_FRAME:
            raise RuntimeError(f"the twin rejected the request frame: {detail}")
        raise UsbError(status, detail, transferred=rvalue)

    def _read_header(self, s: socket.socket, deadline: float | None) -> tuple[int, int, int]:
        """Lock held: the next reply's header (resuming a read a timeout cut short); one owed reply fewer.
        Raises TimeoutError (progress kept) or ConnectionResetError at EOF."""
        mv = memoryview(self._hdr)
        while self._hdr_got < len(mv):
            s.settimeout(_left(deadline))
            k = s.recv_into(mv[self._hdr_got:])
            if k == 0:
                raise ConnectionResetError("twin daemon closed the connection")
            self._hdr_got += k
        self._hdr_got = 0
        self._owed -= 1
        return W.RSP.unpack(self._hdr)

    def _recv_body(self, s: socket.socket, mv: memoryview, deadline: float | None) -> None:
        """Lock held: the ``len(mv)`` bytes of the body whose length is in ``_skip_body``; a timeout leaves
        the rest in ``_skip_body`` to discard."""
        got = 0
        while got < len(mv):
            s.settimeout(_left(deadline))
            k = s.recv_into(mv[got:])
            if k == 0:
                raise ConnectionResetError("twin daemon closed the connection")
            got += k
            self._skip_body -= k
        self._skip_body = 0

    def _drain_owed(self, s: socket.socket, deadline: float | None) -> None:
        """Lock held: read and drop every late reply still owed before this request's own (the last one)."""
        scratch = bytearray(min(W.MAX_PAYLOAD, 1 << 16))
        mv = memoryview(scratch)
        while True:
            while self._skip_body > 0:
                s.settimeout(_left(deadline))
                k = s.recv_into(mv[:min(len(mv), self._skip_body)])
                if k == 0:
                    raise ConnectionResetError("twin daemon closed the connection")
                self._skip_body -= k
            if self._owed <= 1:
                return
            n, _, _ = self._read_header(s, deadline)
            if n > W.MAX_PAYLOAD:
                raise ConnectionResetError(f"the twin daemon announced a {n}-byte reply")
            self._skip_body = n

    def _went_away(self, admin: bool) -> Exception:
        """The error for a daemon whose socket closed: TwinNotRunning (admin) or NO_DEVICE (USB)."""
        if admin:
            return TwinNotRunning(f"the twin daemon at {self.path} went away")
        return UsbError(LIBUSB_ERROR_NO_DEVICE, "the twin daemon went away")

    @staticmethod
    def _send_gather(s: socket.socket, hdr: bytes, payload: bytes | bytearray | memoryview) -> None:
        """Header and payload in one sendmsg (no copy of the payload); finish what a partial send left."""
        sent = s.sendmsg([hdr, payload])
        if sent < len(hdr):
            s.sendall(hdr[sent:])
            s.sendall(payload)
        elif sent < len(hdr) + len(payload):
            s.sendall(memoryview(payload)[sent - len(hdr) :])

    # ------------------------------------------------------------------ USB host view
    def ping(self) -> None:
        if self._twin is None:
            self._request(W.OP_PING, admin=True)

    def enumerate(self) -> list[DeviceInfo]:
        """What a fresh libusb device list sees now (never cached)."""
        if self._twin is not None:
            return self._twin.enumerate()
        _, body = self._request(W.OP_ENUMERATE, admin=True)
        assert isinstance(body, bytes)
        return [DeviceInfo.from_json(d) for d in json.loads(body)]

    def open(self, bus: int, address: int) -> int:
        """Open the device at ``bus``/``address``; returns a handle. Raises UsbError(NO_DEVICE)."""
        if self._twin is not None:
            return self._twin.open(bus, address)
        if not (0 <= bus <= 0xFF and 0 <= address <= 0xFF):
            raise UsbError(LIBUSB_ERROR_NO_DEVICE, f"no device at {bus}-{address}")
        return self._request(W.OP_OPEN, b0=bus, b1=address)[0]

    def close(self, handle: int) -> None:
        """Close a device handle (releases its claims). Never raises for a gone device."""
        if self._twin is not None:
            self._twin.close_handle(handle)
            return
        with contextlib.suppress(UsbError):
            self._request(W.OP_CLOSE, handle=handle)

    def claim_interface(self, handle: int, intf: int) -> None:
        if self._twin is not None:
            return self._twin.claim_interface(handle, intf)
        self._request(W.OP_CLAIM, handle=handle, index=intf)

    def release_interface(self, handle: int, intf: int) -> None:
        if self._twin is not None:
            return self._twin.release_interface(handle, intf)
        self._request(W.OP_RELEASE, handle=handle, index=intf)

    def clear_halt(self, handle: int, endpoint: int) -> None:
        if self._twin is not None:
            return self._twin.clear_halt(handle, endpoint)
        self._request(W.OP_CLEAR_HALT, handle=handle, b0=endpoint)

    def set_configuration(self, handle: int, configuration: int) -> None:
        self.ctrl_transfer(handle, 0x00, 0x09, configuration, 0, b"", 1000)

    def ctrl_transfer(
        self,
        handle: int,
        bm_request_type: int,
        b_request: int,
        w_value: int = 0,
        w_index: int = 0,
        data_or_length: bytes | bytearray | memoryview | int = 0,
        timeout_ms: int = 1000,
        *,
        is_async: bool = False,
    ) -> bytes | int:
        """A control transfer: IN returns the bytes read (``data_or_length`` = wLength), OUT the bytes written."""
        if self._twin is not None:
            return self._twin.ctrl_transfer(
                handle, bm_request_type, b_request, w_value, w_index, data_or_length, timeout_ms, is_async=is_async
            )
        is_in = bool(bm_request_type & 0x80)
        if is_in != isinstance(data_or_length, int) or not (
            0 <= bm_request_type <= 0xFF
            and 0 <= b_request <= 0xFF
            and 0 <= w_value <= 0xFFFF
            and 0 <= w_index <= 0xFFFF
        ):
            raise UsbError(LIBUSB_ERROR_INVALID_PARAM, "bad control transfer arguments")
        value, body = self._request(
            W.OP_CTRL,
            b0=bm_request_type,
            b1=b_request,
            value=w_value,
            index=w_index,
            handle=handle,
            length=data_or_length if isinstance(data_or_length, int) else 0,
            timeout_ms=max(0, timeout_ms),
            flags=W.FLAG_ASYNC if is_async else 0,
            payload=b"" if isinstance(data_or_length, int) else data_or_length,
        )
        return body if is_in else value

    def bulk_write(
        self,
        handle: int,
        endpoint: int,
        data: bytes | bytearray | memoryview,
        timeout_ms: int = 1000,
        *,
        is_async: bool = False,
    ) -> int:
        """Bulk OUT; returns the bytes the device accepted."""
        if self._twin is not None:
            return self._twin.bulk_write(handle, endpoint, data, timeout_ms, is_async=is_async)
        mv = memoryview(data).cast("B")
        return self._request(
            W.OP_BULK_OUT,
            b0=endpoint,
            handle=handle,
            timeout_ms=max(0, timeout_ms),
            flags=W.FLAG_ASYNC if is_async else 0,
            payload=mv,
        )[0]

    def bulk_read(
        self, handle: int, endpoint: int, length: int, timeout_ms: int = 1000, *, is_async: bool = False
    ) -> bytes:
        """Bulk IN of up to ``length`` bytes."""
        if self._twin is not None:
            return self._twin.bulk_read(handle, endpoint, length, timeout_ms, is_async=is_async)
        body = self._request(
            W.OP_BULK_IN,
            b0=endpoint,
            handle=handle,
            length=length,
            timeout_ms=max(0, timeout_ms),
            flags=W.FLAG_ASYNC if is_async else 0,
        )[1]
        assert isinstance(body, bytes)
        return body

    def bulk_read_into(
        self, handle: int, endpoint: int, out: memoryview, timeout_ms: int = 1000, *, is_async: bool = False
    ) -> int:
        """Bulk IN straight into ``out`` (a writable byte buffer); returns the bytes read."""
        out = memoryview(out).cast("B")
        if self._twin is not None:
            data = self._twin.bulk_read(handle, endpoint, len(out), timeout_ms, is_async=is_async)
            out[: len(data)] = data
            return len(data)
        n = self._request(
            W.OP_BULK_IN,
            b0=endpoint,
            handle=handle,
            length=len(out),
            timeout_ms=max(0, timeout_ms),
            flags=W.FLAG_ASYNC if is_async else 0,
            into=out,
        )[1]
        assert isinstance(n, int)
        return n

    # ------------------------------------------------------------------ admin: faults, status, power
    def _admin(self, cmd: str, **args: Any) -> Any:
        if self._twin is not None:
            return _admin_local(self._twin, cmd, args)
        _, body = self._request(W.OP_ADMIN, payload=json.dumps({"cmd": cmd, **args}).encode(), admin=True)
        assert isinstance(body, bytes)
        return json.loads(body) if body else None

    def fault(self, kind: str, **params: Any) -> dict[str, Any]:
        """Inject a fault: ``kind`` and :class:`~.faults.FaultSpec` fields (``repeat``, ``probability``,
        ``for_s``, ``phase``, ``after``, ``on``, ``status``, ``delay_ms``, ``off_s``, ``nbytes``, ``seed``).
        Returns its status entry (with ``id``). Raises ValueError for a bad spec."""
        return self.inject(FaultSpec(kind, **params))

    def inject(self, spec: FaultSpec) -> dict[str, Any]:
        return dict(self._admin("fault", spec=spec.validate().to_json()))

    def clear(self, fault_id: int | None = None) -> int:
        """Remove one fault or all; returns how many. Latched states (wedge, hang, halt) stay."""
        return int(self._admin("clear", id=fault_id))

    def status(self) -> dict[str, Any]:
        return dict(self._admin("status"))

    def plug(self) -> DeviceInfo | None:
        d = self._admin("plug")
        return DeviceInfo.from_json(d) if d else None

    def unplug(self) -> None:
        self._admin("unplug")

    def power_cycle(self, off_s: float = 0.0) -> None:
        self._admin("power_cycle", off_s=off_s)

    def set_phase(self, phase: str) -> None:
        self._admin("set_phase", phase=phase)


def _failure(admin: bool, code: int, what: str) -> Exception:
    """``what`` as the error of an admin request (:class:`TwinNotRunning`) or of a USB one (``UsbError(code)``)."""
    return TwinNotRunning(what) if admin else UsbError(code, what)


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (monotonic) for ``socket.settimeout``; None = no deadline. Raises
    TimeoutError once it has passed (``settimeout(0)`` would make the socket non-blocking instead)."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _admin_local(twin: Twin, cmd: str, args: dict[str, Any]) -> Any:
    """Execute an admin command on a Twin; shared by the in-process client and the daemon."""
    if cmd == "fault":
        return twin.inject(FaultSpec.from_json(dict(args["spec"])))
    if cmd == "clear":
        fid = args.get("id")
        return twin.clear(None if fid is None else int(fid))
    if cmd == "status":
        return twin.status()
    if cmd == "plug":
        info = twin.plug()
        return None if info is None else info.to_json()
    if cmd == "unplug":
        twin.unplug()
        return None
    if cmd == "power_cycle":
        off_s = float(args.get("off_s", 0.0))
        if not 0 <= off_s <= 3600:
            raise ValueError(f"off_s {off_s} is not in [0, 3600]")
        twin.power_cycle(off_s)
        return None
    if cmd == "set_phase":
        twin.set_phase(str(args.get("phase")))
        return None
    raise ValueError(f"unknown admin command {cmd!r}")


# ---------------------------------------------------------------------- the daemon's life
class TwinDaemon:
    """A ``chestnut twin serve`` child process for ``prefix`` (default ``$CHESTNUT_PREFIX``).

    ``args`` are extra ``serve`` options (e.g. ``["--training-delay-ms", "5"]``). Its log goes to
    ``<runtime_dir>/twin.log``, appended to, created 0600 (``msgs/outdir.py`` ``open_private``: a symlink or a
    non-regular file there raises :class:`~chestnut.msgs.outdir.OutputDirError`). :meth:`start` waits until the
    socket answers (raises RuntimeError if the process dies or ``timeout_s`` passes); :meth:`stop` sends SIGTERM,
    waits, then kills.
    """

    def __init__(self, prefix: str | None = None, args: list[str] | tuple[str, ...] = (), timeout_s: float = 20.0):
        self.prefix = current_prefix() if prefix is None else prefix
        self.args = list(args)
        self.timeout_s = timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.socket_path = socket_path(self.prefix)
        self.log_path = runtime_dir(self.prefix) / W.LOG_NAME

    def start(self) -> TwinDaemon:
        env = {**os.environ, "CHESTNUT_PREFIX": self.prefix}
        with open_private(self.log_path, "ab") as logf:  # 0600 when created, never through a symlink
            self.process = subprocess.Popen(
                [sys.executable, "-m", "chestnut.launch.cli", "twin", "serve", *self.args],
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the twin daemon exited with {self.process.returncode}; log:\n{self.log_tail()}")
            try:
                with TwinClient(self.prefix, connect_timeout_s=0.5) as c:
                    c.ping()
                return self
            except (TwinNotRunning, RuntimeError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the twin daemon did not answer within {self.timeout_s} s; log:\n{self.log_tail()}")
            time.sleep(0.02)

    def log_tail(self, nbytes: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")
        except OSError:
            return ""

    def client(self) -> TwinClient:
        return TwinClient(self.prefix)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGTERM, wait ``timeout_s``, then SIGKILL. Returns the exit code."""
        p = self.process
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return p.returncode

    def __enter__(self) -> TwinDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_twin(prefix: str | None = None, args: list[str] | tuple[str, ...] = ()) -> Iterator[TwinClient]:
    """Spawn ``chestnut twin serve`` for ``prefix``, wait for its socket, yield a connected client; on exit
    close the client and stop the daemon (SIGTERM, then SIGKILL after 5 s). ``client.daemon`` is the
    :class:`TwinDaemon`."""
    with TwinDaemon(prefix, args) as daemon, daemon.client() as client:
        client.daemon = daemon
        yield client
