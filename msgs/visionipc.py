"""Camera frames through shared memory: a ring of frame buffers mapped once, only metadata on the bus.

In the spirit of openpilot's VisionIPC (``msgq/visionipc``: the camera owns the buffers, a unix
socket hands their file descriptors to each subscriber once, the bus carries only which buffer holds
which frame), written for this stack's rules:

- **The ring** (:class:`FrameRing`, the camera's side) is one ``memfd`` of :data:`RING_SLOTS` slots.
  Each slot is a :data:`SLOT_HEADER_BYTES` header (a native-endian uint64 *seqlock word* at offset
  0, the frame's byte count, uint64, at offset 8; camera and subscribers share one host) followed by the
  pixels, the slot padded to whole pages. The
  memfd is sealed against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``), so a
  mapping can never be cut short under a reader (no ``SIGBUS``); it has no path, so it is gone once
  the camera and every subscriber closed it -- also when the camera is killed.
- **The hand-over** is a unix stream socket ``<runtime_dir>/cameraFrame.vipc`` inside the private
  0700 runtime directory (``msgs/paths.py``). The camera accepts only peers of its own uid
  (``SO_PEERCRED``), sends one JSON line (:data:`HELLO_MAX_BYTES` at most) with two descriptors
  (``SCM_RIGHTS``): the memfd and the read end of a pipe made for this subscriber alone, its *notice
  pipe* (``pipe2(O_DIRECT | O_NONBLOCK | O_CLOEXEC)``: packet mode, one write one record; the camera
  keeps the write end), and keeps the connection open. A subscriber sees the camera's end as the
  pipe's EOF (the camera closed it, or died) and unmaps. A subscriber accepts only a camera of its
  own uid, only a sealed, unlinked memfd of its own uid with the announced size and no group/other
  permission (:func:`buffer_problem`) and only a pipe of its own uid with none either
  (:func:`notice_pipe_problem`); every other descriptor is refused in one line
  (:class:`FrameBufferError`).
- **A frame** goes out as a ``cameraFrame`` with empty ``data`` and ``buffer`` set (session, slot
  index, sequence number, size; ``msgs/chestnut.capnp`` ``FrameBuffer``) on the bus, for the logger and
  every other consumer. First, each ring subscriber gets a *notice* in its notice pipe
  (:meth:`FrameRing.notify`): the same metadata as one fixed :data:`NOTICE_BYTES`-byte record
  (:class:`RingFrame`, the smallest message that names the frame; one ``struct`` unpack, no Cap'n
  Proto to build or to walk). A subscriber that reads notices (:meth:`FrameReader.notices`, given a poller)
  has its frames one pipe hop after the camera wrote them: the bus's ZeroMQ path crosses an I/O thread on
  each side (four wake-ups, not one), and its message must be built, sent, decoded and checked first
  (``tests/bench/bench_frames.py`` measures both). A pipe, not the hand-over socket (``SOCK_SEQPACKET``,
  which carried notices up to hello version 3): a 56-byte record's write, wake-up and read cost less
  through a pipe than through a unix socket (no socket buffer to allocate, no credentials to pass; from
  the write to the woken reader's read, p50 of 150 records 30 ms apart, a ``zmq.Poller`` waiting, the ways
  alternating, 2-vCPU test VM: 110 us the socket, 89 us the pipe). The subscriber takes each frame once, by
  whichever way it comes first (:meth:`FrameReader.first_sight`). A subscriber that never reads notices
  (the logger) loses nothing: once its pipe is full (16 records, ``pipe(7)``) the camera's non-blocking
  writes to it fail and are only counted (``FrameRing.unread``).
- **Seqlock**: writing frame ``seq`` into a slot sets its word to ``2*seq - 1`` (odd: being written),
  copies the pixels, then sets ``2*seq``. A reader checks the word is ``2*seq`` before it takes the
  view and again after it is done with it (:meth:`FrameSubscriber.verify`); any other value means the
  camera lapped the ring and the pixels read may be torn: :class:`FrameOverwrittenError`, never torn
  data. The word is an aligned 8-byte store on x86-64 and AArch64 (single-copy atomic on both); the
  pixel copy and the word stores are separate stores through memoryviews of the mapping, in program
  order, which x86-64's total store order keeps ordered for another core.
- **Cold frames**: at 20 Hz both processes sleep 50 ms between frames, and the first Python after a sleep
  runs on cold caches, so each call on the per-frame path costs microseconds, not the nanoseconds it costs
  warm. The per-frame path therefore makes few calls: the camera's write is three word stores and one
  ``memcpy`` through memoryviews (98 KB, p50 of 50 frames each after a 50 ms sleep, the two ways alternating
  in one process on a 2-vCPU VM, three runs: 85-100 us with numpy's calls for the same stores and copy,
  53-59 us this way), a reader's seqlock check is one
  memoryview load, a frame's shaped view of its slot is made once per slot and geometry, a notice's
  geometry is checked once and then looked up, its record is read in place, and the poll's "notices only"
  test makes no generator (13.7 -> 4.9 us, p50 of 100 frames in the reader, ``tests/bench/bench_frames.py``'s
  set-up, three runs alternating). The camera packs a notice straight from its figures
  (:meth:`FrameRing.announce`, no object made, one uncontended lock taken), a reader fills
  its :class:`RingFrame` field by field, and :meth:`FrameReader.first_sight` and :meth:`FrameReader.view`
  test a notice's slot word in place; ``tests/bench/bench_frames.py`` (98 KB and 3.5 MB only, 20 s each in
  10 rounds, the two versions alternating, twice): ring/raw p50 at 98 KB 1.86 and 1.94 before, 1.56 and 1.80
  after; at 3.5 MB 1.24 and 1.36 before, 1.25 and 1.31 after.

Small frames may still travel inline (``data`` filled, ``buffer`` unset); :class:`FrameReader`
reads either kind, so the node, the logger (:func:`inline_event`), replay and ``chestnut dump``
accept both.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import logging
import mmap
import os
import re
import secrets
import select
import socket
import stat
import struct
import threading
from collections import Counter, deque
from typing import Any

import numpy as np

from chestnut.msgs.fdpass import recv_fds
from chestnut.msgs.frames import frame_shape, frame_view
from chestnut.msgs.messaging import REASON_FRAMING, REASON_UNKNOWN_MEMBER, MalformedMessageError
from chestnut.msgs.paths import SocketPathError, bind_private_socket, check_socket_path, owned_problem, runtime_dir
from chestnut.msgs.schema import log as schema
from chestnut.msgs.services import FRAME_MAX_BYTES

__all__ = [
    "HELLO_MAX_BYTES",
    "NOTICE_BYTES",
    "INLINE_MAX_BYTES",
    "RING_SLOTS",
    "SLOT_HEADER_BYTES",
    "SOCKET_NAME",
    "STREAMING_COPY_BYTES",
    "STREAMING_COPY_TUNABLE",
    "FrameBufferError",
    "FrameOverwrittenError",
    "FrameReader",
    "FrameRing",
    "FrameSubscriber",
    "RingFrame",
    "buffer_problem",
    "inline_event",
    "notice_pipe_problem",
    "socket_path",
    "streaming_copy_tunables",
]

_log = logging.getLogger(__name__)

RING_SLOTS = 4
"""Slots in a camera's ring (our choice): a reader may be up to 3 frames (150 ms at 20 Hz) behind the
newest frame before its slot is reused; one frame late is the node's normal worst case."""
MAX_RING_SLOTS = 16  # a subscriber refuses a ring announcing more slots than this
UNPROVEN_KEYS = 4 * MAX_RING_SLOTS  # bus frames answered unproven that FrameReader.first_sight keeps
SLOT_HEADER_BYTES = 64  # seqlock word (uint64 at 0), frame bytes (uint64 at 8), the rest reserved; one cache line
HELLO_MAX_BYTES = 4096  # the camera's JSON line; a subscriber reads no more
HELLO_VERSION = 4  # 2: SOCK_SEQPACKET, notices follow the hello; 3: a notice is a RingFrame record;
# 4: notices on a packet-mode pipe handed over with the ring
SOCKET_NAME = "cameraFrame.vipc"  # the hand-over socket, in the private runtime directory
INLINE_MAX_BYTES = 256 << 10
"""Frames up to this many bytes of pixels go inline by default (``chestnut camera --transport
auto``); bigger ones through the ring. Our choice from ``tests/bench/bench_frames.py``: the 98 KB
128x256 frame costs about the same either way, a 1.2 MB one already pays several copies inline."""
STREAMING_COPY_BYTES = 1 << 20
"""A camera copies a frame of at least this many bytes into its ring with non-temporal (streaming) stores:
glibc's ``memcpy`` switches to them above its ``x86_non_temporal_threshold`` tunable, which the process
that writes the ring is started with (:func:`streaming_copy_tunables`; ``chestnut launch`` does it for its
camera). Why: each frame lands in the ring's next slot, whose cache lines the camera last wrote
:data:`RING_SLOTS` frames ago, so ordinary stores must first read every line they overwrite (a
read-for-ownership); streaming stores skip that read. glibc's own default threshold is 3/4 of the
last-level cache it detects (``sysdeps/x86/dl-cacheinfo.h`` ``dl_init_cacheinfo``, since glibc commit
d3c57027, 2.33), so on a host that reports a large L3 (the 2-vCPU test VM: 480 MiB) it never applies.
Measured there (``tests/bench/bench_frames.py``), a 3.5 MB frame's ring latency p50: 0.51-0.54 ms with
ordinary stores, 0.35-0.37 ms with streaming ones (``docs/architecture.md`` "Streaming stores for big
frames"). 1 MiB: a 98 KB or 256 KB frame stays in cache for the subscriber that reads it
next; a copy that is read back at once (an inline frame's message) is slower with streaming stores, so
a camera sending big frames inline is started without it."""
STREAMING_COPY_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"  # glibc manual, "Hardware Capability Tunables"
CONNECT_TIMEOUT_S = 1.0  # a subscriber waits this long for the camera's hello
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_MEMFD_NAME = "chestnut-frames"
_TUNABLE_ITEM = re.compile(r"[A-Za-z0-9._-]+=[A-Za-z0-9._-]+")


def streaming_copy_tunables(current: str | None, streaming: bool = True) -> str:
    """The ``GLIBC_TUNABLES`` value to start a ring-writing process with: ``current`` (the environment's
    value, None or "" when unset) with :data:`STREAMING_COPY_TUNABLE` set to :data:`STREAMING_COPY_BYTES`
    appended, or ``current`` unchanged when it already sets that tunable (the user's choice wins) or
    ``streaming`` is false. glibc
    reads the variable once, at program start, and ignores a tunable it does not know (on a CPU other than
    x86-64 this one does nothing). A ``current`` that is not a list of ``name=value`` items of letters, digits,
    ``.``, ``_`` and ``-`` is dropped (it is written into a supervisord configuration, where a quote or ``%``
    would change its meaning)."""
    items = [t for t in (current or "").split(":") if t]
    if not all(_TUNABLE_ITEM.fullmatch(t) for t in items):  # not glibc's name=value syntax: not passed on
        items = []
    if not streaming or any(t.split("=", 1)[0] == STREAMING_COPY_TUNABLE for t in items):
        return ":".join(items)
    return ":".join([*items, f"{STREAMING_COPY_TUNABLE}={STREAMING_COPY_BYTES:#x}"])


class FrameBufferError(PermissionError):
    """A ring a subscriber must not use (wrong owner, unsealed, wrong size, a malformed hello) or cannot
    reach (no camera serving). ``str()`` is one line: what, where, how to fix."""


class FrameOverwrittenError(ValueError):
    """The slot no longer holds the frame asked for: the camera lapped the ring (the reader fell behind)
    or the frame is from a ring this subscriber cannot map. Its pixels were not used."""


def socket_path(prefix: str | None = None) -> str:
    """``<runtime_dir(prefix)>/cameraFrame.vipc``; raises ``FrameBufferError`` when it does not fit a
    unix socket address (107 bytes) and the runtime directory's own errors (``msgs/paths.py``)."""
    path = f"{runtime_dir(prefix)}/{SOCKET_NAME}"
    if len(os.fsencode(path)) > 107:
        raise FrameBufferError(
            f"frame socket {path} is longer than a unix socket path may be (107 bytes); "
            "set XDG_RUNTIME_DIR to a shorter directory"
        )
    return path


def slot_stride(frame_bytes: int) -> int:
    """Bytes of one slot: header plus ``frame_bytes``, rounded up to whole pages."""
    page = mmap.PAGESIZE
    return (SLOT_HEADER_BYTES + frame_bytes + page - 1) // page * page


def buffer_problem(st: os.stat_result, seals: int, uid: int, size: int) -> str | None:
    """Why a received descriptor with status ``st`` and seals ``seals`` cannot be a ring of ``size`` bytes
    for ``uid`` (None when it can): it must be a regular file of ours with no group/other permission,
    unlinked (a memfd has no name in any directory), exactly ``size`` bytes, sealed against resizing."""
    if (problem := owned_problem(st, uid, stat.S_ISREG, "is not a memory file")) is not None:
        return problem
    if st.st_nlink != 0:
        return "is a file with a name (a ring is an unlinked memfd)"
    if st.st_size != size:
        return f"holds {st.st_size} bytes, the camera announced {size}"
    if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
        return "is not sealed against resizing (F_SEAL_SHRINK | F_SEAL_GROW)"
    return None


def _bytes_of(pixels: np.ndarray | bytes | memoryview) -> memoryview:
    """``pixels``' bytes, C order, as a 1-D memoryview of format ``B`` (a copy only when not C-contiguous)."""
    src = pixels.data if isinstance(pixels, np.ndarray) else memoryview(pixels)
    return src.cast("B") if src.c_contiguous else np.ascontiguousarray(pixels).data.cast("B")


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


# ---------------------------------------------------------------- the notice


_NOTICE = struct.Struct("<QQQQIIIIIB3x")
NOTICE_BYTES = _NOTICE.size
"""Bytes of one notice record (56): little-endian ``session`` u64, ``seq`` u64, ``timestampSof`` u64,
``timestampEof`` u64, ``frameId`` u32, ``index`` u32, ``size`` u32, ``width`` u32, ``height`` u32,
``encoding`` u8 (the ``CameraFrame.PixelEncoding`` ordinal), 3 bytes of padding; the fields and widths of
``msgs/chestnut.capnp`` ``CameraFrame`` and ``FrameBuffer``."""
ENCODINGS: tuple[str, ...] = tuple(
    name for name, _ in sorted(schema.CameraFrame.PixelEncoding.schema.enumerants.items(), key=lambda kv: kv[1])
)
"""``CameraFrame.PixelEncoding`` names by ordinal (``msgs/chestnut.capnp``)."""
REASON_OTHER_RING = "other ring"  # a well-formed notice of a ring that is not the one mapped


_ORDINALS = {name: i for i, name in enumerate(ENCODINGS)}
_new_object = object.__new__
_GEOMETRIES: dict[tuple[int, int, str, int], tuple[int, int, int]] = {}  # checked (w, h, encoding, size) -> shape
MAX_GEOMETRIES = 64  # geometries remembered as checked; others are checked every time


def _geometry(frame_id: int, width: int, height: int, encoding: str, size: int) -> tuple[int, int, int]:
    """``frame_shape`` of a ring frame whose ``size`` must be that shape's bytes; a geometry checked once is a
    dict lookup after (a camera sends one; "Cold frames"). Raises ``ValueError`` for an unknown ``encoding``, an
    odd-sized ``nv12`` frame or a ``size`` that does not match."""
    key = (width, height, encoding, size)
    shape = _GEOMETRIES.get(key)
    if shape is not None:
        return shape
    if encoding not in _ORDINALS:
        raise ValueError(f"pixel encoding {encoding!r} is none of {list(ENCODINGS)}")
    shape = frame_shape(height, width, encoding)
    if size != shape[0] * shape[1] * shape[2]:
        raise ValueError(f"frame {frame_id}: {size} bytes in the ring for {encoding} {width}x{height}")
    if len(_GEOMETRIES) < MAX_GEOMETRIES:
        _GEOMETRIES[key] = shape
    return shape


class RingFrame:
    """A ring frame as its notice names it: what a ``cameraFrame`` reader of it gives, as plain Python values.

    ``frameId``; ``timestampSof`` / ``timestampEof`` (ns, CLOCK_MONOTONIC); ``width`` / ``height`` (px);
    ``encoding`` (a ``CameraFrame.PixelEncoding`` name, str); its ``FrameBuffer``: ``session``, ``index``,
    ``seq``, ``size`` (bytes of pixels), which :attr:`buffer` gives as this object itself. ``shape`` is
    ``msgs/frames.py`` ``frame_shape`` of it. Made by the camera (keyword arguments) and by
    :meth:`unpack`, which checks what a record can get wrong; the node takes either a ``CameraFrame`` reader
    or one of these (:class:`FrameReader` reads both).
    """

    __slots__ = ("frameId", "timestampSof", "timestampEof", "width", "height", "encoding", "session", "index",
                 "seq", "size", "shape")

    def __init__(self, *, frame_id: int, sof_ns: int, eof_ns: int, width: int, height: int, encoding: str,
                 session: int, index: int, seq: int, size: int) -> None:
        """Raises ``ValueError`` for an unknown ``encoding`` or a ``size`` that is not ``frame_shape``'s bytes."""
        self.shape = _geometry(frame_id, width, height, encoding, size)
        self.frameId, self.timestampSof, self.timestampEof = frame_id, sof_ns, eof_ns
        self.width, self.height, self.encoding = width, height, encoding
        self.session, self.index, self.seq, self.size = session, index, seq, size

    @property
    def buffer(self) -> RingFrame:
        """The ``FrameBuffer`` figures (``session``, ``index``, ``seq``, ``size``), as a reader's ``buffer`` gives."""
        return self

    def pack(self) -> bytes:
        """The :data:`NOTICE_BYTES`-byte record. Raises ``struct.error`` for a field outside its width."""
        return _NOTICE.pack(self.session, self.seq, self.timestampSof, self.timestampEof, self.frameId, self.index,
                            self.size, self.width, self.height, _ORDINALS[self.encoding])

    @classmethod
    def unpack(cls, data: bytes) -> RingFrame:
        """A record from the camera's connection. Raises :class:`MalformedMessageError` (reason ``framing``: not
        :data:`NOTICE_BYTES` long, or a size that does not match its geometry; ``unknown member``: an encoding
        ordinal the schema does not name)."""
        if len(data) != NOTICE_BYTES:
            raise MalformedMessageError(REASON_FRAMING, f"a notice of {len(data)} bytes, not {NOTICE_BYTES}")
        session, seq, sof, eof, frame_id, index, size, width, height, enc = _NOTICE.unpack(data)
        if enc >= len(ENCODINGS):
            raise MalformedMessageError(REASON_UNKNOWN_MEMBER, f"a notice with pixel encoding {enc}")
        encoding = ENCODINGS[enc]
        # made field by field, not through __init__'s keywords: a notice is read once a frame on cold caches
        # (the module's "Cold frames": 10-15 -> 6-9 us, p50 of 150 calls 20 ms apart, the two ways alternating)
        self = _new_object(cls)
        shape = _GEOMETRIES.get((width, height, encoding, size))
        if shape is None:
            try:
                shape = _geometry(frame_id, width, height, encoding, size)
            except ValueError as e:
                raise MalformedMessageError(REASON_FRAMING, f"a notice naming {e}") from None
        self.shape = shape
        self.frameId, self.timestampSof, self.timestampEof = frame_id, sof, eof
        self.width, self.height, self.encoding = width, height, encoding
        self.session, self.index, self.seq, self.size = session, index, seq, size
        return self

    def __repr__(self) -> str:
        return (f"RingFrame(frame {self.frameId}, {self.encoding} {self.width}x{self.height}, "
                f"session {self.session:x}, slot {self.index}, seq {self.seq})")


# ---------------------------------------------------------------- the camera's side


class FrameRing:
    """The camera's ring: :data:`RING_SLOTS` slots of up to ``frame_bytes`` bytes each, served on
    :func:`socket_path` until :meth:`close`.

    ``allowed_uid`` is the only peer uid served (default: ours). Raises :class:`FrameBufferError` when
    another live camera serves this prefix, ``ValueError`` for a size outside 1..``FRAME_MAX_BYTES``.
    """

    def __init__(
        self, frame_bytes: int, slots: int = RING_SLOTS, prefix: str | None = None, allowed_uid: int | None = None
    ) -> None:
        if not 0 < frame_bytes <= FRAME_MAX_BYTES:
            raise ValueError(f"frame of {frame_bytes} bytes: a ring slot holds 1..{FRAME_MAX_BYTES} bytes")
        if not 2 <= slots <= MAX_RING_SLOTS:
            raise ValueError(f"a ring has 2..{MAX_RING_SLOTS} slots, not {slots}")
        self.frame_bytes, self.slots = frame_bytes, slots
        self.stride = slot_stride(frame_bytes)
        self.size = self.stride * slots
        self.session = secrets.randbits(63) | 1  # never 0: 0 is an unset FrameBuffer
        self.allowed_uid = os.getuid() if allowed_uid is None else allowed_uid
        self.seq = 0
        self.refused = 0  # connections refused (another uid)
        self.path = socket_path(prefix)
        self._clients: list[socket.socket] = []
        # clients handed the ring, each with the write end of its notice pipe: they get notices
        self._notified: list[tuple[io.FileIO, socket.socket]] = []
        self._pipes: dict[socket.socket, io.FileIO] = {}  # each client's notice pipe, until it is dropped
        self.unread = 0  # notices not sent because a subscriber's socket buffer was full (it reads none, or lags)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.fd = os.memfd_create(_MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(self.fd, 0o600)  # a memfd is born 0777; /proc/<pid>/fd/ would be its only path
            os.ftruncate(self.fd, self.size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            self.map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            # the slots' header words and bytes as memoryviews: a write is three word stores and one memcpy, with
            # none of numpy's dispatch (module doc, "Cold frames")
            self._words = memoryview(self.map).cast("Q")
            self._word_step = self.stride // 8  # slot i's seqlock word is _words[i * _word_step]
            self._bytes = memoryview(self.map)
            self._listener = self._bind()
        except BaseException:
            os.close(self.fd)
            raise
        self._thread = threading.Thread(target=self._serve, name="frame-ring", daemon=True)
        self._thread.start()

    def _bind(self) -> socket.socket:
        """Bind the hand-over socket; a stale one (its camera gone) is replaced, a live one refused."""
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(self.path)
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
                raise FrameBufferError(f"frame socket {self.path} exists and is not a socket of ours; remove it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                probe.connect(self.path)
                raise FrameBufferError(
                    f"frame socket {self.path}: another camera serves this prefix; stop it "
                    "or choose another CHESTNUT_PREFIX"
                )
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(self.path)  # its camera died without removing it
            except OSError as e:
                if e.errno != errno.EPROTOTYPE:
                    raise
                raise FrameBufferError(
                    f"frame socket {self.path} is a socket of another kind (not SOCK_SEQPACKET); remove it"
                ) from None
            finally:
                probe.close()
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        bind_private_socket(self.path, lambda: lst.bind(self.path))  # 0600, never reachable by another user
        lst.listen(16)
        lst.settimeout(0.1)
        return lst

    def _serve(self) -> None:
        hello = (
            json.dumps(
                {
                    "version": HELLO_VERSION,
                    "session": self.session,
                    "slots": self.slots,
                    "stride": self.stride,
                    "frame_bytes": self.frame_bytes,
                    "size": self.size,
                }
            ).encode()
            + b"\n"
        )
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            uid = _peer_uid(conn)
            if uid != self.allowed_uid:
                self.refused += 1
                _log.warning("frame ring: refused a subscriber of uid %d (serving uid %d only)", uid, self.allowed_uid)
                conn.close()
                continue
            try:  # packet mode: one write is one record; non-blocking: a full pipe is EAGAIN, never a wait
                read_end, write_end = os.pipe2(os.O_CLOEXEC | os.O_DIRECT | os.O_NONBLOCK)
            except OSError:
                _log.warning("frame ring: no pipe for a subscriber's notices", exc_info=True)
                conn.close()
                continue
            try:
                pipe = open(write_end, "wb", buffering=0)  # noqa: SIM115 -- closed when its subscriber is dropped
            except OSError:
                os.close(write_end)
                os.close(read_end)
                conn.close()
                continue
            with self._lock:  # counted before the hand-over: a subscriber that holds the ring is always counted
                if self._closed.is_set():
                    conn.close()
                    pipe.close()
                    os.close(read_end)
                    return
                self._clients.append(conn)
                self._pipes[conn] = pipe
            try:
                socket.send_fds(conn, [hello], [self.fd, read_end])
            except OSError:
                with self._lock:
                    self._drop(conn)
                continue
            finally:
                os.close(read_end)  # the subscriber holds it now (or never will)
            conn.setblocking(False)
            with self._lock:  # notices only to a subscriber that was handed the ring
                if conn in self._clients:  # not dropped (or closed with the ring) meanwhile
                    self._notified.append((pipe, conn))

    def write(self, pixels: np.ndarray | bytes | memoryview) -> tuple[int, int]:
        """Copy one frame's bytes (any shape and item type, C order) into the next slot under the seqlock;
        returns ``(index, seq)``. Raises ``ValueError`` for a frame bigger than the slots (the slot untouched);
        what numpy raises for an array without a buffer of its bytes (an object array) leaves the slot marked
        as being written, so no reader takes it."""
        # a 1-D array goes to the copy as it is: the copy checks it holds bytes (format "B") and gets no view
        # made first (the module's "Cold frames": 57 -> 49 us, p50 of 100 writes of 98 KB 30 ms apart, the two
        # ways alternating)
        src = pixels if type(pixels) is np.ndarray and pixels.ndim == 1 else _bytes_of(pixels)
        n = src.nbytes
        if n > self.frame_bytes:
            raise ValueError(f"frame of {n} bytes does not fit the ring's {self.frame_bytes}-byte slots")
        self.seq = seq = self.seq + 1
        index = (seq - 1) % self.slots
        start = index * self.stride + SLOT_HEADER_BYTES
        words, word = self._words, index * self._word_step
        words[word] = 2 * seq - 1  # odd: being written
        words[word + 1] = n
        try:
            self._bytes[start:start + n] = src  # type: ignore[assignment]  # numpy's stubs: ndarray is no Buffer
        except ValueError:  # a 1-D array of items other than bytes: its bytes
            self._bytes[start:start + n] = _bytes_of(pixels)
        words[word] = 2 * seq  # even: holds frame seq
        return index, seq

    def notify(self, frame: RingFrame) -> int:
        """Send ``frame``'s notice (:data:`NOTICE_BYTES`) to every subscriber holding the ring, without
        blocking, then yield the CPU once when any took it; returns how many took it. A subscriber whose notice
        pipe is full (``pipe(7)``: 16 unread records) misses it (counted in ``unread``); one that closed its end
        is dropped. Raises ``ValueError`` for a frame of another ring."""
        if frame.session != self.session:
            raise ValueError(f"a notice for session {frame.session:x} on the ring of session {self.session:x}")
        return self._send(frame.pack())

    def announce(self, frame_id: int, sof_ns: int, eof_ns: int, width: int, height: int, encoding: str, index: int,
                 seq: int, size: int) -> int:
        """:meth:`notify` of the frame that :meth:`write` put in slot ``index`` as frame ``seq`` (``size`` bytes),
        the notice packed straight from these figures (ints; ``encoding`` a ``CameraFrame.PixelEncoding`` name):
        the camera's per-frame call, with no :class:`RingFrame` made (the module's "Cold frames": 11 -> 6 us, p50
        of 150 calls 20 ms apart, the two ways alternating). Raises ``ValueError`` for an unknown ``encoding`` or
        a ``size`` that is not that geometry's bytes, ``struct.error`` for a figure outside its field's width."""
        if (width, height, encoding, size) not in _GEOMETRIES:
            _geometry(frame_id, width, height, encoding, size)
        return self._send(_NOTICE.pack(self.session, seq, sof_ns, eof_ns, frame_id, index, size, width, height,
                                       _ORDINALS[encoding]))

    def _send(self, record: bytes) -> int:
        """Write ``record`` to every notice pipe, holding ``_lock``; returns how many took it. The lock keeps each
        pipe open while it is written: FileIO's ``write`` reads the descriptor's number and then leaves the GIL for
        the system call, so a pipe closed by another thread in between (:meth:`close`, a drop in
        :attr:`subscribers` or in the hand-over thread) would leave the write to whatever file was opened next
        under that number. Every close of a notice pipe is made under the same lock, and a closed ring has none
        left to write. One acquire per notice, uncontended but while a subscriber is handed the ring or dropped,
        taken with ``acquire``/``release``, not ``with``: the cheaper of the two on the cold per-frame path (the
        module's "Cold frames"; ``_send`` with one subscriber, p50 of 400 calls 20 ms apart, the ways alternating
        in blocks of 25, three runs, 2-vCPU test VM: 3-4.5 us more than with no lock, ``with`` 6-15 us more)."""
        sent = 0
        lock = self._lock
        lock.acquire()
        try:
            for pipe, conn in self._notified:  # _drop rebuilds the list: this loop goes on over the old one
                try:
                    if pipe.write(record) is None:  # FileIO's answer to EAGAIN: the pipe is full
                        self.unread += 1
                    else:
                        sent += 1
                except (OSError, ValueError):  # EPIPE: the subscriber went away
                    self._drop(conn)
        finally:
            lock.release()
        if sent:  # a woken subscriber may be queued on this CPU: let it run before the bus message is built
            os.sched_yield()  # (docs/architecture.md, "Hand-overs on the per-frame path")
        return sent

    def _drop(self, conn: socket.socket) -> None:
        """Forget and close a subscriber's connection and notice pipe; the caller holds ``_lock``, so no notice is
        being written to the pipe (:meth:`_send`)."""
        self._notified = [(p, c) for p, c in self._notified if c is not conn]
        with contextlib.suppress(ValueError):
            self._clients.remove(conn)
        pipe = self._pipes.pop(conn, None)
        if pipe is not None:
            pipe.close()
        conn.close()

    def fill(self, cf: Any, index: int, seq: int, nbytes: int) -> None:
        """Point a ``cameraFrame`` builder at slot ``index`` holding frame ``seq`` (``data`` stays empty)."""
        b = cf.init("buffer")
        b.session, b.index, b.seq, b.size = self.session, index, seq, nbytes

    @property
    def subscribers(self) -> int:
        """Subscribers connected now (those that closed their end are dropped here); never blocks."""
        with self._lock:
            readable = select.select(self._clients, [], [], 0)[0] if self._clients else []
            for conn in readable:
                try:
                    if conn.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK):
                        continue
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                self._drop(conn)
            return len(self._clients)

    def close(self) -> None:
        """Stop serving, remove the socket, end every subscriber's connection, release the memfd."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._listener.close()
        self._thread.join(1.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with self._lock:
            for c in self._clients:
                c.close()
            for p in self._pipes.values():
                p.close()
            self._clients.clear()
            self._pipes.clear()
            self._notified = []
        self._words.release()
        self._bytes.release()
        with contextlib.suppress(BufferError):
            self.map.close()
        os.close(self.fd)

    def __enter__(self) -> FrameRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- a subscriber's side


class _Mapping:
    """One ring mapped read-only: the hello's figures, the mapping, the connection to the camera and the read
    end of its notice pipe (``notice_fd``, owned from here on)."""

    def __init__(self, conn: socket.socket, hello: dict[str, int], fd: int, notice_fd: int) -> None:
        self.conn = conn
        self.fd = notice_fd  # what the poller watches, and how zmq.Poller names it in a poll's result
        self.session = hello["session"]
        self.slots, self.stride, self.frame_bytes = hello["slots"], hello["stride"], hello["frame_bytes"]
        self.map = mmap.mmap(fd, hello["size"], mmap.MAP_SHARED, mmap.PROT_READ)
        # the seqlock words as a memoryview: each check is one load, with none of numpy's dispatch
        self.words = memoryview(self.map).cast("Q")
        self.word_step = self.stride // 8  # slot i's word is words[i * word_step]
        # each slot's pixels, made once: a frame's view is a slice of one
        self.pixels = [
            np.frombuffer(self.map, np.uint8, count=self.frame_bytes, offset=i * self.stride + SLOT_HEADER_BYTES)
            for i in range(self.slots)
        ]
        # the last view handed out per slot, by (size, shape): a camera sends one geometry, so a frame's view is
        # a lookup, not two numpy calls
        self.views: list[tuple[int, tuple[int, ...], np.ndarray] | None] = [None] * self.slots
        # FileIO: a read of the empty pipe answers None, not a BlockingIOError; a closed one raises ValueError.
        # Made last: until it is, the descriptor is the caller's to close (one owner, never closed twice)
        self.notices = open(notice_fd, "rb", buffering=0)  # noqa: SIM115 -- closed with the mapping

    def word(self, index: int) -> int:
        """Slot ``index``'s seqlock word (``2*seq``: holds frame ``seq``; odd: being written)."""
        return self.words[index * self.word_step]  # type: ignore[no-any-return]

    def view(self, index: int, size: int, shape: tuple[int, ...]) -> np.ndarray:
        """Slot ``index``'s first ``size`` bytes as a read-only uint8 array of ``shape`` (its product is
        ``size``), made and kept in :attr:`views` (:meth:`FrameSubscriber.view_slot` looks there first)."""
        view = self.pixels[index][:size].reshape(shape)
        self.views[index] = (size, shape, view)
        return view

    def close(self) -> None:
        self.conn.close()
        self.notices.close()
        self.words.release()
        del self.pixels, self.views
        try:
            self.map.close()
        except BufferError:  # a view of it is still alive; the mapping goes when that view does
            pass


def _frame_of(word: int) -> int:
    """The frame a slot's seqlock word names: the one it holds (``2*seq``) or is being written (``2*seq - 1``)."""
    return (word + 1) // 2


def notice_pipe_problem(st: os.stat_result, uid: int) -> str | None:
    """Why a received descriptor with status ``st`` cannot be the read end of a camera's notice pipe for ``uid``
    (None when it can): a pipe of ours with no group/other permission (a pipe's inode is born 0600, its
    creator's). Packet mode (``O_DIRECT``, ``pipe(7)``) is a flag of the camera's write end only, so it cannot be
    checked here; a pipe without it could run two notices together, which the reader's checks of every record
    (its length, fields, ring and slot word) drop as malformed."""
    return owned_problem(st, uid, stat.S_ISFIFO, "is not a pipe")


def _read_hello(conn: socket.socket, uid: int, path: str) -> tuple[dict[str, int], int, int]:
    """The hello's figures, the ring's memfd and the read end of the notice pipe, each checked; the descriptors
    are the caller's to close. Raises :class:`FrameBufferError` (one line).

    The hello's ``version`` is checked before anything it governs (:data:`HELLO_VERSION`; how many descriptors
    come with it is one such thing: a version 3 camera sends its ring alone), so a camera of another version is
    named as that, "camera hello version 3, want 4", not as a count of descriptors."""
    # close-on-exec: a child of the subscriber never holds the pipe's read end (the camera would never see it gone);
    # msgs/fdpass.py: the stdlib's recv_fds drops the flag
    msg, fds, flags = recv_fds(conn, HELLO_MAX_BYTES, 2, socket.MSG_CMSG_CLOEXEC)
    try:
        if not msg and not fds:
            raise FrameBufferError(
                f"frame socket {path}: the camera closed the connection without handing over its ring "
                f"(it serves only its own uid; this subscriber is uid {os.getuid()})"
            )
        malformed = FrameBufferError(f"frame socket {path}: malformed hello ({len(msg)} bytes); restart the camera")
        try:
            hello = json.loads(msg.decode())
            version = hello["version"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise malformed from None
        if type(version) is not int or version != HELLO_VERSION:
            raise FrameBufferError(
                f"frame socket {path}: camera hello version {version!r}, want {HELLO_VERSION}: the camera and this "
                "subscriber run different chestnut versions; restart both from one install"
            )
        if flags & socket.MSG_CTRUNC:  # more than two: the kernel dropped the rest; a hello carries two
            raise FrameBufferError(
                f"frame socket {path}: the camera sent more than 2 descriptors (its ring and a notice pipe); "
                "refused; restart the camera"
            )
        if len(fds) != 2:
            raise FrameBufferError(
                f"frame socket {path}: the camera sent {len(fds)} descriptor{'' if len(fds) == 1 else 's'}, not 2 "
                "(its ring and a notice pipe); restart the camera"
            )
        try:
            keys = ("session", "slots", "stride", "frame_bytes", "size")
            vals = {k: hello[k] for k in keys}
            if not all(isinstance(v, int) and v > 0 for v in vals.values()):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise malformed from None
        slots, stride, frame_bytes = vals["slots"], vals["stride"], vals["frame_bytes"]
        if not (
            2 <= slots <= MAX_RING_SLOTS
            and frame_bytes <= FRAME_MAX_BYTES
            and stride == slot_stride(frame_bytes)
            and vals["size"] == slots * stride
        ):
            raise FrameBufferError(f"frame socket {path}: ring layout out of bounds ({vals}); restart the camera")
        fd = fds[0]
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:  # EINVAL: a file that cannot be sealed (not a memfd)
            seals = 0
        problem = buffer_problem(os.fstat(fd), seals, uid, vals["size"])
        if problem is not None:
            raise FrameBufferError(
                f"frame buffer from {path} {problem}: refused; only a camera of uid {uid} may serve frames here"
            )
        problem = notice_pipe_problem(os.fstat(fds[1]), uid)
        if problem is not None:
            raise FrameBufferError(
                f"notice pipe from {path} {problem}: refused; only a camera of uid {uid} may serve frames here"
            )
        os.set_blocking(fds[1], False)  # notices and the camera's end are read without waiting
        return vals, fd, fds[1]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _read_record(ring: _Mapping) -> bytes | None:
    """One record of ``ring``'s notice pipe, read with room for one byte more than a notice; None when none is
    queued, b"" at the camera's end (EOF, or the pipe unusable)."""
    try:
        return ring.notices.read(NOTICE_BYTES + 1)  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return b""


class FrameSubscriber:
    """Maps the camera's ring once per camera session and reads frames from it without copying.

    ``uid`` is the only camera uid accepted (default: ours). ``poller`` (a ``zmq.Poller``): the mapped
    ring's notice pipe is registered there for ``POLLIN`` while mapped, and the camera's notices are kept
    for :meth:`take_notices`; without one they are read and dropped. Counters: ``overwritten`` (frames the
    camera lapped before or while they were read), ``maps`` (rings mapped so far), ``bad_notices``
    (records over :data:`NOTICE_BYTES`, dropped).
    """

    def __init__(self, prefix: str | None = None, uid: int | None = None, poller: Any = None) -> None:
        self.prefix = prefix
        self.uid = os.getuid() if uid is None else uid
        self.ring: _Mapping | None = None
        self.poller = poller
        self.overwritten = 0
        self.maps = 0
        self.bad_notices = 0
        self._pending: list[bytes] = []
        self._eof = False

    def _map(self, ring: _Mapping) -> None:
        self.ring, self._eof = ring, False
        if self.poller is not None:
            self.poller.register(ring.fd, 1)  # zmq.POLLIN

    def _unmap(self) -> None:
        ring, self.ring = self.ring, None
        self._pending.clear()
        if ring is not None:
            if self.poller is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self.poller.unregister(ring.fd)
            ring.close()

    def _pump(self, most: int | None = None) -> None:
        """Read the records queued in the mapped ring's notice pipe, every one or at most ``most`` (never blocks):
        notices are kept (with a poller) or dropped, the camera's end of the pipe (EOF) is remembered."""
        ring = self.ring
        left = -1 if most is None else most
        while ring is not None and not self._eof and left != 0:
            left -= 1
            # one byte more than a notice: a longer record shows as such (packet mode: the rest is discarded)
            data = _read_record(ring)
            if data is None:  # none queued
                return
            self._pump_one(data)

    def _pump_one(self, data: bytes) -> None:
        """One record read from the notice pipe: b"" is the camera's end (remembered), one over
        :data:`NOTICE_BYTES` is counted and dropped, a notice is kept (with a poller) or dropped."""
        if not data:
            self._eof = True
        elif len(data) > NOTICE_BYTES:
            self.bad_notices += 1
            if self.bad_notices == 1:
                _log.warning("frame ring: dropped a notice over %d bytes (further ones are only counted)",
                             NOTICE_BYTES)
        elif self.poller is not None:
            self._pending.append(data)

    def take_notices(self) -> list[bytes]:
        """The notices (:class:`RingFrame` records, unchecked) read since the last call, oldest first: those a
        :meth:`camera_gone` read meanwhile and at most one more. One per call because the pipe stays
        readable while more are queued, so the poller that woke the caller wakes it again at once; reading
        on to the empty queue would end each call with one more system call, answered ``EAGAIN`` (through the
        socket that carried notices before, a ``BlockingIOError`` that cost 9 us of a 98 KB frame's 0.1 ms,
        p50, 2-vCPU test VM)."""
        ring = self.ring
        if not self._pending and ring is not None and not self._eof and self.poller is not None:
            try:  # the common case, one notice, read here: the per-frame path makes few calls ("Cold frames")
                data = ring.notices.read(NOTICE_BYTES + 1)
            except (OSError, ValueError):  # as _read_record
                data = b""
            if data is None:
                return []
            if data and len(data) <= NOTICE_BYTES:
                return [data]
            self._pump_one(data)  # the camera's end or an oversized record
        else:
            self._pump(most=1)
        out, self._pending = self._pending, []
        return out

    def _connect(self) -> _Mapping:
        """Connect to the camera's hand-over socket and take its ring. Raises :class:`FrameBufferError` (one line)
        when no camera of ours serves it, and before connecting when the path holds anything but a socket of ours
        (a symlink, never followed; a regular file, a directory, another user's socket: ``msgs/paths.py``
        ``check_socket_path``, the line it gives)."""
        path = socket_path(self.prefix)
        try:
            check_socket_path(path)
        except SocketPathError as e:
            raise FrameBufferError(str(e)) from None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.settimeout(CONNECT_TIMEOUT_S)
            try:
                conn.connect(path)
                peer = _peer_uid(conn)
                if peer != self.uid:
                    raise FrameBufferError(f"frame socket {path} is served by uid {peer}, not uid {self.uid}: refused")
                hello, fd, notice_fd = _read_hello(conn, self.uid, path)
            except (FileNotFoundError, ConnectionRefusedError):
                raise FrameBufferError(f"frame socket {path}: no camera serves it; start chestnut camera") from None
            except (TimeoutError, ConnectionResetError):
                raise FrameBufferError(
                    f"frame socket {path}: the camera did not answer within {CONNECT_TIMEOUT_S} s; restart it"
                ) from None
            except FrameBufferError:
                raise
            except OSError as e:  # EPROTOTYPE: a socket of another kind at the path
                raise FrameBufferError(f"frame socket {path}: not a camera's frame socket ({e.strerror})") from None
            try:
                ring = _Mapping(conn, hello, fd, notice_fd)
            except BaseException:
                os.close(notice_fd)
                raise
            finally:
                os.close(fd)  # the mapping keeps the memory (and mmap its own descriptor until unmapped)
        except BaseException:
            conn.close()
            raise
        self.maps += 1
        return ring

    def camera_gone(self) -> bool:
        """True (and the ring unmapped) when the camera ended the mapped ring's notice pipe (EOF); never blocks."""
        if self.ring is None:
            return False
        self._pump()
        if not self._eof:
            return False
        self._unmap()
        return True

    def _ring_for(self, session: int) -> _Mapping:
        ring = self.ring
        if ring is not None and ring.session == session:
            return ring
        if ring is not None:  # a new camera session: the old ring is done with
            self._unmap()
        ring = self._connect()
        self._map(ring)
        if ring.session != session:
            raise FrameOverwrittenError(
                f"frame from camera session {session:x}, the camera now serves "
                f"{ring.session:x}: a frame of a previous camera"
            )
        return ring

    def view(self, buf: Any) -> np.ndarray:
        """A read-only uint8 view of the frame a ``FrameBuffer`` reader names (``size`` bytes, 1-D).

        Raises :class:`FrameOverwrittenError` when the slot no longer holds it (or the size does not fit
        the ring) and :class:`FrameBufferError` when no usable camera serves the ring. Check it with
        :meth:`verify` once done with the view."""
        return self.view_slot(buf.session, buf.index, buf.seq, buf.size)

    def view_slot(self, session: int, index: int, seq: int, size: int,
                  shape: tuple[int, ...] | None = None) -> np.ndarray:
        """:meth:`view` of the frame given by its ``FrameBuffer`` figures (ints), shaped ``shape`` (whose
        product is ``size``; default 1-D)."""
        ring = self.ring
        if ring is None or ring.session != session:
            ring = self._ring_for(session)
        if index >= ring.slots or size > ring.frame_bytes:
            raise FrameOverwrittenError(
                f"frame seq {seq}: slot {index} / {size} bytes outside the ring "
                f"({ring.slots} slots of {ring.frame_bytes} bytes)"
            )
        if ring.words[index * ring.word_step] != 2 * seq:  # _check's test in place: one load on the common path
            self._check(ring, index, seq)
        shape = shape or (size,)
        cached = ring.views[index]
        if cached is not None and cached[0] == size and cached[1] == shape:
            return cached[2]
        return ring.view(index, size, shape)

    def _check(self, ring: _Mapping, index: int, seq: int) -> None:
        word = ring.word(index)
        if word != 2 * seq:
            self.overwritten += 1
            state = "being written" if word & 1 else "done"
            held = _frame_of(word)
            if held < seq:
                raise FrameOverwrittenError(
                    f"frame seq {seq}: slot {index} holds the older frame {held} ({state}): frame {seq} "
                    "was never written there (a message or notice ahead of the camera's writes)"
                )
            raise FrameOverwrittenError(
                f"frame seq {seq}: slot {index} was overwritten (now frame {held}, {state}); the reader "
                f"fell more than {ring.slots - 1} frames behind the camera"
            )

    def verify(self, buf: Any) -> None:
        """After the read: raises :class:`FrameOverwrittenError` when the camera reused the slot meanwhile
        (what was read may be torn and must be dropped)."""
        ring = self.ring
        if ring is None or ring.session != int(buf.session):
            raise FrameOverwrittenError(f"frame seq {int(buf.seq)}: its ring was unmapped during the read")
        self._check(ring, int(buf.index), int(buf.seq))

    def close(self) -> None:
        self._unmap()


class FrameReader:
    """Reads a ``cameraFrame`` of either kind: inline (``data``) or in the camera's ring (``buffer``), given as
    a ``CameraFrame`` reader or as the :class:`RingFrame` of the camera's notice.

    ``view(cf)`` -> uint8 array of ``msgs/frames.py`` ``frame_shape`` ([H, W, 3]; [H, W, 1] for ``gray8``;
    [H * 3/2, W, 1] for ``nv12``), read-only: a ring frame's view into shared memory, an inline one's over the
    bytes of its ``data`` (``msgs/frames.py`` ``frame_view``; no copy of the pixels past pycapnp's own). Call
    ``verify(cf)`` once done with the view: a ring frame that was overwritten meanwhile raises
    :class:`FrameOverwrittenError` (a ``ValueError``). The ring is connected to on the first ring frame.

    With a ``poller`` (``zmq.Poller``) the camera's notices of the mapped ring wake it: :meth:`notices`
    returns them as :class:`RingFrame` objects (each record checked: its length, its encoding, its size
    against its geometry, its ring), and :meth:`first_sight` takes each ring frame once whether its notice
    or its bus message comes first. ``bad_notices`` counts notices dropped as malformed or oversize.
    """

    def __init__(self, prefix: str | None = None, poller: Any = None) -> None:
        self.shm = FrameSubscriber(prefix, poller=poller)
        self._seen: tuple[int, int] = (0, 0)  # (session, seq) of the newest ring frame shown to exist and taken
        # (session, seq, index) of bus frames answered while their slot did not hold them (lapped, or never real)
        self._unproven: deque[tuple[int, int, int]] = deque(maxlen=UNPROVEN_KEYS)
        self.bad_notice_reasons: Counter[str] = Counter()

    @property
    def bad_notices(self) -> int:
        return self.shm.bad_notices + sum(self.bad_notice_reasons.values())

    def only_notices(self, woke: Any) -> bool:
        """Whether a poll's result ``woke`` (``zmq.Poller.poll``'s pairs as a dict) names the mapped ring's
        notice pipe and nothing else: woken by notices (or the camera's end) alone, so the other sockets polled
        (the bus) have nothing to read. ``zmq.Poller`` names the pipe by its descriptor."""
        ring = self.shm.ring
        if ring is None or self.shm.poller is None or len(woke) != 1:
            return False
        return ring.fd in woke

    def notices(self) -> list[RingFrame]:
        """The frames the camera announced in the mapped ring's notice pipe, read since the last call, oldest
        first: at most one more than a :meth:`camera_gone` read meanwhile (:meth:`FrameSubscriber.take_notices`;
        the poller wakes the caller again at once while more are queued); none without a poller or a mapped ring.
        A malformed notice, or one of another ring, is counted in ``bad_notice_reasons`` (logged once per
        reason) and dropped."""
        out: list[RingFrame] = []
        records = self.shm.take_notices()
        if not records:
            return out
        ring = self.shm.ring
        session = None if ring is None else ring.session
        for data in records:
            try:
                frame = RingFrame.unpack(data)
                if frame.session != session:
                    raise MalformedMessageError(REASON_OTHER_RING, f"a notice of camera session {frame.session:x}")
            except MalformedMessageError as e:
                self.bad_notice_reasons[e.reason] += 1
                if self.bad_notice_reasons[e.reason] == 1:
                    _log.warning("frame ring: dropped a notice: %s (further ones are only counted)", e)
                continue
            out.append(frame)
        return out

    def first_sight(self, cf: Any) -> bool:
        """False for a ring frame already taken (its notice and its bus message carry the same frame:
        the same session, seq and slot), True otherwise (inline frames always).

        A seq is recorded as taken only once the frame is shown to exist: its slot in the mapped ring holds it
        (the seqlock word is ``2*seq``, here or in :meth:`view`), or it came as the camera's own notice (its
        connection is the camera's, ``SO_PEERCRED``-checked). A bus message is anyone's: one naming a seq its
        slot never held (say ``2**64-1``) is answered once (as a bad frame) and recorded only as that one key,
        so it cannot silence the session's later frames. Seq only grows within a session (the module's
        "Seqlock"). The notice of a bus frame answered while its slot no longer held it (lapped) is skipped."""
        notice = isinstance(cf, RingFrame)
        if notice:
            session, seq, index = cf.session, cf.seq, cf.index
            seen = self._seen
            if session == seen[0] and seq <= seen[1]:
                return False
            ring = self.shm.ring  # the common case, a notice of a frame its slot holds, in place ("Cold frames")
            if ring is not None and ring.session == session and 0 <= index < ring.slots and (
                    ring.words[index * ring.word_step] == 2 * seq):
                self._seen = (session, seq)  # newer than seen, or of a new session: as _taken
                return True
        elif cf._has("buffer"):
            buf = cf.buffer
            session, seq, index = int(buf.session), int(buf.seq), int(buf.index)
        else:
            return True
        if session == self._seen[0] and seq <= self._seen[1]:
            return False
        if self._in_slot(session, index, seq):
            self._taken(session, seq)
            return True
        if notice:
            if self._ahead_of_ring(session, seq):  # never written: answered once as a bad frame, taken as nothing
                return True
            self._taken(session, seq)
            return (session, seq, index) not in self._unproven
        self._unproven.append((session, seq, index))
        return True

    def _in_slot(self, session: int, index: int, seq: int) -> bool:
        """Whether the mapped ring is ``session``'s and its slot ``index`` holds frame ``seq`` now (seqlock word
        ``2*seq``: written, not being rewritten)."""
        ring = self.shm.ring
        return ring is not None and ring.session == session and 0 <= index < ring.slots and (
            ring.word(index) == 2 * seq)

    def _ahead_of_ring(self, session: int, seq: int) -> bool:
        """Whether ``seq`` is newer than every frame the mapped ring of ``session`` holds or is writing: a notice
        no camera write ever matched (a camera's bug; its own connection is the only one that sends notices).
        Recorded as taken it would have silenced every later frame of the session, which all have lower seqs. A
        real notice is sent after its write, so its seq is in a slot unless newer frames lapped it."""
        ring = self.shm.ring
        if ring is None or ring.session != session:
            return False
        return seq > max(_frame_of(ring.word(i)) for i in range(ring.slots))

    def _taken(self, session: int, seq: int) -> None:
        if session != self._seen[0] or seq > self._seen[1]:
            self._seen = (session, seq)

    @staticmethod
    def in_ring(cf: Any) -> bool:
        return isinstance(cf, RingFrame) or (bool(cf._has("buffer")) and len(cf.data) == 0)

    def view(self, cf: Any) -> np.ndarray:
        if isinstance(cf, RingFrame):  # checked when its notice was read
            return self.shm.view_slot(cf.session, cf.index, cf.seq, cf.size, cf.shape)
        if not self.in_ring(cf):
            return frame_view(cf)
        h, w, c = frame_shape(cf.height, cf.width, cf.encoding)
        buf = cf.buffer
        size = buf.size
        if size != h * w * c:
            raise ValueError(f"cameraFrame {cf.frameId}: {size} bytes in the ring for {h}x{w}x{c}")
        view = self.shm.view_slot(buf.session, buf.index, buf.seq, size, (h, w, c))
        self._taken(int(buf.session), int(buf.seq))  # its slot held it (view_slot checked the seqlock word)
        return view

    def verify(self, cf: Any) -> None:
        if isinstance(cf, RingFrame):
            self.shm.verify(cf)
        elif self.in_ring(cf):
            self.shm.verify(cf.buffer)

    def camera_gone(self) -> bool:
        """True (and the ring unmapped) when the camera of the mapped ring has ended its notice pipe: it
        stopped or died (:meth:`FrameSubscriber.camera_gone`); never blocks. The next ring frame maps the
        ring of the camera that serves then."""
        return self.shm.camera_gone()

    @property
    def session(self) -> int | None:
        """The mapped ring's camera session (``FrameBuffer.session``), None while none is mapped."""
        ring = self.shm.ring
        return None if ring is None else ring.session

    def read(self, cf: Any) -> np.ndarray:
        """A verified copy of the frame's pixels, uint8 [H, W, C]."""
        out = self.view(cf).copy()
        self.verify(cf)
        return out

    def close(self) -> None:
        self.shm.close()


def inline_event(event: Any, reader: FrameReader) -> bytes:
    """The bytes of ``event`` with a ring frame's pixels copied into ``data`` (``buffer`` kept, so the log
    says the frame travelled through the ring); other events unchanged. For the logger: a log must hold
    the pixels, the ring outlives no camera. ``logMonoTime`` is kept. Raises what
    :meth:`FrameReader.read` raises."""
    if event.which() != "cameraFrame" or not reader.in_ring(event.cameraFrame):
        return bytes(event.as_builder().to_bytes())
    pixels = reader.read(event.cameraFrame)
    msg = event.as_builder()
    msg.cameraFrame.data = pixels.tobytes()
    return bytes(msg.to_bytes())
