"""The double-buffered copy protocol and the GPU command queue, over the bridge, with bounded waits.

``docs/protocol.md`` ("The copy path") and :mod:`chestnut.backend.protocol` define the protocol:

Host -> VRAM (:meth:`CopyProtocol.copy_in`)
    The payload is cut into chunks of at most ``CHUNK_PAYLOAD`` (0x40000-512) bytes. Chunk ``seq`` goes
    to SRAM half ``seq & 1`` (0xF2 slot ``half * 16``) as one wire image: the payload padded to 512
    bytes, then the 512-byte sentinel block (u32 LE: nbytes, zlib.crc32 of the payload, seq, zeros,
    and ``SENTINEL_MAGIC | seq`` in the last dword). The host first queues one ``OP_COPYIN`` packet per
    chunk (one ring write, one doorbell); then for each chunk it waits for the previous transfer and
    the previous chunk's fence, writes the staging sentinel, arms 0xF2 and sends one bulk OUT. The GPU
    waits for the sentinel, checks the block, copies the payload to VRAM, clears the block and writes
    ``seq + 1`` to the copy-in fence (XDATA 0xA800).

VRAM -> host (:meth:`CopyProtocol.copy_out`)
    Chunks of at most ``SRAM_HALF`` bytes alternate between the halves. The ``OP_COPYOUT`` packets
    are written to the ring in one go; per chunk the host rings the doorbell for that packet ("go"),
    waits for its queue fence (completion page ``CPL_QUEUE_FENCE``) with status OK, arms a 0xF2 read
    of the half and reads it with one bulk IN. The next chunk's doorbell rings before the current
    chunk is read, so the GPU fills one half while the host reads the other.

Why only one chunk's completion is outstanding when the host checks it: the engine keeps executing
after a failed packet, and the completion page holds only the last packet's status; a CRC failure of
chunk ``k`` would be overwritten by chunk ``k+1`` completing. Waiting for chunk ``k``'s fence before
sending chunk ``k+1`` (the source document's "waits for the previous transfer and fence") keeps every
failure visible.

Every wait is bounded by ``wait_timeout_ms`` (default 3000, openpilot's ``HCQDEV_WAIT_TIMEOUT_MS``):
an expired wait raises :class:`GpuLayerError` naming the chunk, the fence value expected and the value
seen; a status other than ``STATUS_OK`` raises at once with its meaning (:data:`STATUS_ERRORS`). The
polls are XDATA reads whose own timeout never exceeds what is left of the wait; a poll read that
times out (the receipt of a fence that may have moved was lost: the twin's ``lost_receipt`` fault) raises
:class:`UsbLayerError` ``transfer_timeout``.

Ring writes are streaming memory writes (0xF0 mode 1 + one bulk OUT) into BAR0 at
``RING_VRAM_OFFSET``; the doorbell is one posted 32-bit write to BAR2. So a copy of ``N`` chunks makes
exactly ``N`` data bulk transfers, plus one command bulk transfer for the ring.
"""

from __future__ import annotations

import struct
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from chestnut.backend import progress
from chestnut.backend import protocol as P
from chestnut.backend.bridge import Bridge, ceildiv, round_up
from chestnut.backend.errors import ChestnutError, GpuLayerError, ModelError, PcieLayerError, UsbLayerError

# status word -> (error class, reason, meaning); STATUS_OK is absent
STATUS_ERRORS: dict[int, tuple[type[ChestnutError], str, str]] = {
    P.STATUS_BAD_PACKET: (GpuLayerError, "bad_packet", "the engine rejected the packet (bad opcode, length or "
                                                       "argument)"),
    P.STATUS_CRC: (UsbLayerError, "corrupt_transfer", "the sentinel block does not match the payload: the bulk "
                                                      "transfer was truncated or corrupted on the way"),
    P.STATUS_NO_PROGRAM: (GpuLayerError, "no_program", "no program is loaded under that id"),
    P.STATUS_COMPILE_FAILED: (ModelError, "compile_failed", "the GPU could not compile the model"),
    P.STATUS_RUN_FAILED: (GpuLayerError, "run_failed", "the program failed while running"),
    P.STATUS_OUT_OF_RANGE: (GpuLayerError, "out_of_range", "a VRAM address or size is out of range"),
}
PACKET_DWORDS, OP_NAMES = P.PACKET_DWORDS, P.OP_NAMES
POLL_BACKOFF_S = (0.0, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3)  # sleep between polls, growing
MIN_POLL_READ_MS = 20  # a poll read near the deadline still gets this long


def u32_ge(a: int, b: int) -> bool:
    """``a >= b`` for u32 counters that wrap (serial-number arithmetic)."""
    return ((a - b) & 0xFFFFFFFF) < 0x80000000


def diagnose_link(bridge: Bridge, err: GpuLayerError) -> ChestnutError:
    """An expired wait, attributed: if the PCIe link is not at L0 (LTSSM 0x78) the PCIe layer is the reason.

    One LTSSM read (at most 100 ms); if it fails, the original GPU-layer error stands.
    """
    try:
        ltssm = bridge.ltssm(min(bridge.ctrl_timeout_ms, 100))
    except ChestnutError:
        return err
    if ltssm == P.LTSSM_L0:
        return err
    reason = "ltssm_stuck" if ltssm == P.LTSSM_STUCK else "link_down"
    out = PcieLayerError(reason, f"PCIe link not up (LTSSM=0x{ltssm:02X}): {err.detail}")
    out.__cause__ = err
    return out


def status_error(status: int, what: str) -> ChestnutError:
    """The typed error for a completion ``status`` other than STATUS_OK, naming ``what`` failed."""
    cls, reason, meaning = STATUS_ERRORS.get(status, (GpuLayerError, "bad_status", "an unknown status word"))
    return cls(reason, f"{what}: status {status} ({meaning})")


@dataclass(frozen=True)
class Packet:
    """One command packet: ``op`` and its argument dwords (the queue adds dword0 and the seq)."""

    op: int
    args: tuple[int, ...]

    def encode(self, seq: int) -> bytes:
        ndw = 2 + len(self.args)
        if PACKET_DWORDS.get(self.op) != ndw:
            raise ValueError(f"{OP_NAMES.get(self.op, self.op)} takes {PACKET_DWORDS.get(self.op, 2) - 2} "
                             f"arguments, got {len(self.args)}")
        return struct.pack(f"<{ndw}I", self.op | (ndw << 16), seq & 0xFFFFFFFF,
                           *(a & 0xFFFFFFFF for a in self.args))


def lo_hi(v: int) -> tuple[int, int]:
    return v & 0xFFFFFFFF, v >> 32


@dataclass
class Completion:
    """The completion page as one read sees it."""

    fence: int
    status: int
    signal: int
    rptr: int
    ticks: int = 0  # the engine's work ticks (``CPL_PROGRESS``)


class Deadline:
    """A wait's wall-clock bound (monotonic seconds) and the backoff between its polls."""

    def __init__(self, timeout_ms: int, clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
        self.timeout_ms = timeout_ms
        self.clock, self._sleep = clock, sleep
        self.start = clock()
        self.end = self.start + timeout_ms / 1e3
        self.polls = 0

    def remaining_ms(self) -> float:
        return (self.end - self.clock()) * 1e3

    def elapsed_ms(self) -> float:
        return (self.clock() - self.start) * 1e3

    def expired(self) -> bool:
        return self.clock() >= self.end

    def read_timeout_ms(self, ctrl_timeout_ms: int) -> int:
        """A poll read's timeout: at most ``ctrl_timeout_ms`` and at most what is left (floor MIN_POLL_READ_MS)."""
        return int(max(MIN_POLL_READ_MS, min(ctrl_timeout_ms, self.remaining_ms())))

    def pause(self) -> None:
        self._sleep(POLL_BACKOFF_S[min(self.polls, len(POLL_BACKOFF_S) - 1)])
        self.polls += 1


class CommandQueue:
    """The GPU's command ring: packet encoding, ring writes, doorbell, bounded completion waits.

    :meth:`attach` must run first (a fresh host process): it resets the queue (posted write to BAR2
    + ``DOORBELL_QUEUE_RESET``: packets a previous process left are abandoned) and continues the write
    pointer from ``CPL_RPTR`` and the packet seq from ``CPL_QUEUE_FENCE``. The ring is
    ``RING_BYTES`` at VRAM ``RING_VRAM_OFFSET``; the host never has more than ``RING_BYTES`` of
    packets outstanding (a submission waits, bounded, for the engine to consume enough).
    """

    def __init__(self, bridge: Bridge, wait_timeout_ms: int = P.WAIT_TIMEOUT_MS,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.bridge = bridge
        self.wait_timeout_ms = wait_timeout_ms
        self.clock, self.sleep = clock, sleep
        self.wptr = 0        # bytes written to the ring since GPU reset (u32)
        self.doorbell_ptr = 0
        self.rptr = 0        # the engine's read pointer, as last read
        self.first_seq = 1   # the first packet seq this host wrote
        self.seq = 0         # seq of the last packet written
        self.attached = False

    @property
    def ring_base(self) -> int:
        return self.bridge.bar(0)[0] + P.RING_VRAM_OFFSET

    @property
    def doorbell_addr(self) -> int:
        return self.bridge.bar(2)[0] + P.DOORBELL_BAR_OFFSET

    def read_completion(self, timeout_ms: int | None = None) -> Completion:
        """One 20-byte read of the completion page (XDATA 0xB800): fence, status, signal, read pointer, ticks."""
        raw = self.bridge.control_read(P.REQ_XDATA_READ, 20, value=P.XDATA_CPL_PAGE + P.CPL_QUEUE_FENCE,
                                       timeout_ms=timeout_ms)
        fence, status, signal, rptr, ticks = struct.unpack("<IIIII", raw)
        return Completion(fence, status, signal, rptr, ticks)

    def attach(self) -> Completion:
        """Reset the queue and take over its pointers (see the class doc). Returns the completion page seen."""
        self.bridge.mem_write32(self.bridge.bar(2)[0] + P.DOORBELL_QUEUE_RESET, 1)
        cpl = self.read_completion()
        self.wptr = self.doorbell_ptr = self.rptr = cpl.rptr
        self.seq = cpl.fence
        self.first_seq = (cpl.fence + 1) & 0xFFFFFFFF
        self.attached = True
        return cpl

    def detach(self) -> None:
        """Forget the queue state (after a failure the ring may hold packets that will never complete)."""
        self.attached = False

    def write(self, packets: Sequence[Packet], wait_timeout_ms: int | None = None) -> list[tuple[int, int]]:
        """Write ``packets`` to the ring (one streaming write, split at the ring's end) without ringing.

        Returns (seq, write pointer after the packet) per packet. Raises ValueError if the packets do
        not fit in the ring, GpuLayerError if the engine does not free the room within the wait timeout.
        """
        if not self.attached:
            raise GpuLayerError("queue_detached", "the command queue is not attached (call attach() first)")
        blob = bytearray()
        out: list[tuple[int, int]] = []
        seq, ptr = self.seq, self.wptr
        for pkt in packets:
            seq = (seq + 1) & 0xFFFFFFFF
            raw = pkt.encode(seq)
            blob += raw
            ptr = (ptr + len(raw)) & 0xFFFFFFFF
            out.append((seq, ptr))
        if len(blob) > P.RING_BYTES:
            raise ValueError(f"{len(blob)} bytes of packets do not fit the {P.RING_BYTES}-byte ring")
        self._wait_room(len(blob), wait_timeout_ms)
        off = self.wptr % P.RING_BYTES
        first = min(len(blob), P.RING_BYTES - off)
        self.bridge.mem_write(self.ring_base + off, bytes(blob[:first]))
        if first < len(blob):
            self.bridge.mem_write(self.ring_base, bytes(blob[first:]))
        self.seq, self.wptr = seq, ptr
        return out

    def _wait_room(self, nbytes: int, wait_timeout_ms: int | None) -> None:
        """Wait (bounded) until the engine's read pointer leaves ``nbytes`` free in the ring."""
        if ((self.wptr - self.rptr) & 0xFFFFFFFF) + nbytes <= P.RING_BYTES:
            return
        dl = Deadline(self.wait_timeout_ms if wait_timeout_ms is None else wait_timeout_ms, self.clock, self.sleep)
        while True:
            self.rptr = self.read_completion(dl.read_timeout_ms(self.bridge.ctrl_timeout_ms)).rptr
            if ((self.wptr - self.rptr) & 0xFFFFFFFF) + nbytes <= P.RING_BYTES:
                return
            if dl.expired():
                raise diagnose_link(self.bridge, GpuLayerError(
                    "wait_timeout", f"ring full: read pointer {self.rptr:#x} did not advance to free {nbytes} bytes "
                                    f"behind write pointer {self.wptr:#x} within {dl.timeout_ms} ms"))
            dl.pause()

    def ring(self, ptr: int | None = None) -> None:
        """Post the write pointer ``ptr`` (default: everything written) to the doorbell."""
        ptr = self.wptr if ptr is None else ptr
        self.bridge.mem_write32(self.doorbell_addr, ptr)
        self.doorbell_ptr = ptr

    def submit(self, packets: Sequence[Packet]) -> list[int]:
        """Write and ring ``packets``; returns their seqs."""
        placed = self.write(packets)
        self.ring()
        return [s for s, _ in placed]

    def ours(self, fence: int, upto: int) -> bool:
        """Whether ``fence`` names a packet this host wrote since :meth:`attach`, at or before ``upto``."""
        return u32_ge(fence, self.first_seq) and u32_ge(upto, fence)

    def wait(self, seq: int, what: str, wait_timeout_ms: int | None = None) -> Completion:
        """Wait (bounded) until the queue fence reaches ``seq`` with status OK.

        Raises the status's typed error at once when the completion page shows a failed packet of
        this host at or before ``seq``; GpuLayerError ``wait_timeout`` naming ``what``, the fence
        expected and the fence seen when the wait expires; UsbLayerError ``transfer_timeout`` when a
        poll read times out (a lost receipt).
        """
        dl = Deadline(self.wait_timeout_ms if wait_timeout_ms is None else wait_timeout_ms, self.clock, self.sleep)
        ticks: int | None = None
        while True:
            cpl = poll_completion(self, dl, what)
            if ticks is not None and cpl.ticks != ticks:
                progress.note()  # the engine works on the packet (a compile): the wait makes progress
            ticks = cpl.ticks
            self.rptr = cpl.rptr
            if cpl.status != P.STATUS_OK and self.ours(cpl.fence, seq):
                raise status_error(cpl.status, f"{what} (packet seq {cpl.fence})")
            if u32_ge(cpl.fence, seq):
                return cpl
            if dl.expired():
                raise diagnose_link(self.bridge, GpuLayerError(
                    "wait_timeout", f"{what}: queue fence expected {seq}, saw {cpl.fence} (status {cpl.status}) "
                                    f"after {dl.elapsed_ms():.0f} ms (wait timeout {dl.timeout_ms} ms)"))
            dl.pause()


def _lost_receipt(e: UsbLayerError, what: str, where: str, t_ms: int) -> UsbLayerError:
    return UsbLayerError("transfer_timeout", f"{what}: the read of {where} timed out after {t_ms} ms: the "
                                             f"receipt was lost, the GPU may have completed ({e.detail})")


def poll_completion(queue: CommandQueue, dl: Deadline, what: str) -> Completion:
    """One completion-page read inside a bounded wait; a timed-out read is a lost receipt (USB layer)."""
    t = dl.read_timeout_ms(queue.bridge.ctrl_timeout_ms)
    try:
        return queue.read_completion(t)
    except UsbLayerError as e:
        if e.reason == "transfer_timeout":
            raise _lost_receipt(e, what, "the completion page (XDATA 0xB800)", t) from e
        raise


class CopyProtocol:
    """Copies between host memory and VRAM through the bridge SRAM (see the module doc).

    ``wait_timeout_ms`` bounds every wait; ``bridge.ctrl_timeout_ms`` bounds each poll read.
    Counters for benchmarks: ``chunks_in``, ``chunks_out``, ``data_bulk_out``, ``data_bulk_in``.
    """

    def __init__(self, bridge: Bridge, queue: CommandQueue, wait_timeout_ms: int = P.WAIT_TIMEOUT_MS,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.bridge, self.queue = bridge, queue
        self.wait_timeout_ms = wait_timeout_ms
        self.clock, self.sleep = clock, sleep
        self.chunk_seq = 0   # next copy-in chunk seq
        self._stage = [bytearray(P.SRAM_HALF), bytearray(P.SRAM_HALF)]
        self.chunks_in = self.chunks_out = 0
        self.data_bulk_out = self.data_bulk_in = 0
        self.attached = False

    # ------------------------------------------------------------------ set-up
    def attach(self) -> None:
        """Start copying on this dock: zero both SRAM halves (no stale sentinel can match a new chunk) and
        continue the chunk seq from the copy-in fence. The queue must be attached."""
        zeros = bytes(P.SRAM_HALF)
        for half in (0, 1):
            self.bridge.sram_arm_write(half * P.SLOTS_PER_HALF, P.SRAM_HALF)
            self.bridge.bulk_out(zeros)
        self.chunk_seq = self.bridge.xdata_u32(P.XDATA_COPYIN_FENCE)
        self.attached = True

    # ------------------------------------------------------------------ host -> VRAM
    @staticmethod
    def chunks_for(nbytes: int, chunk: int) -> list[tuple[int, int]]:
        """(offset, nbytes) of each chunk of a ``nbytes`` copy in ``chunk``-byte pieces."""
        return [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]

    def _stage_chunk(self, half: int, payload: memoryview, seq: int) -> int:
        """Build chunk ``seq``'s wire image in staging buffer ``half``; returns its wire size."""
        buf = self._stage[half]
        n = len(payload)
        padded = round_up(n, P.SECTOR)
        buf[:n] = payload
        buf[n:padded] = bytes(padded - n)
        block = bytearray(P.SENTINEL_BLOCK)
        struct.pack_into("<III", block, 0, n, zlib.crc32(payload), seq & 0xFFFFFFFF)
        struct.pack_into("<I", block, 4 * P.SENTINEL_MAGIC_DW, P.sentinel_value(seq))
        buf[padded:padded + P.SENTINEL_BLOCK] = block
        return padded + P.SENTINEL_BLOCK

    def copy_in(self, dst: int, data: bytes | bytearray | memoryview) -> int:
        """Copy ``data`` to VRAM offset ``dst``; returns the number of chunks (= data bulk transfers).

        Raises GpuLayerError (a chunk not drained within the wait timeout; a failed packet),
        UsbLayerError (transfer errors, a CRC-rejected chunk, a timed-out fence read) or PcieLayerError.
        """
        if not self.attached:
            raise GpuLayerError("copy_detached", "the copy protocol is not attached (call attach() first)")
        src = memoryview(data).cast("B")
        if not len(src):
            return 0
        pieces = self.chunks_for(len(src), P.CHUNK_PAYLOAD)
        count, base = len(pieces), self.chunk_seq
        pkt_seqs = self.queue.submit([Packet(P.OP_COPYIN, ((base + i) & 1, n, *lo_hi(dst + off),
                                                           (base + i) & 0xFFFFFFFF))
                                      for i, (off, n) in enumerate(pieces)])
        wire = self._stage_chunk(base & 1, src[pieces[0][0]:pieces[0][0] + pieces[0][1]], base)
        for i in range(count):
            seq = (base + i) & 0xFFFFFFFF
            half = seq & 1
            self.bridge.sram_arm_write(half * P.SLOTS_PER_HALF, wire)
            self.bridge.bulk_out(memoryview(self._stage[half])[:wire])
            self.data_bulk_out += 1
            if i + 1 < count:  # stage the next chunk (host memory only) while the GPU drains this one
                noff, nn = pieces[i + 1]
                wire = self._stage_chunk((seq + 1) & 1, src[noff:noff + nn], (seq + 1) & 0xFFFFFFFF)
            self._wait_drained(seq, i, count, pkt_seqs[i])
        self.chunk_seq = (base + count) & 0xFFFFFFFF
        fence = self.bridge.xdata_u32(P.XDATA_COPYIN_FENCE)
        if fence != self.chunk_seq:
            raise GpuLayerError("fence_mismatch", f"copy-in of {count} chunk(s): copy-in fence reads {fence}, "
                                                  f"expected {self.chunk_seq} after every chunk completed")
        self.chunks_in += count
        return count

    def _wait_drained(self, seq: int, index: int, count: int, pkt_seq: int) -> None:
        """Wait (bounded) until chunk ``seq``'s packet completed OK (its copy-in fence then reads ``seq + 1``).

        The next chunk is not sent before this returns, so the next packet cannot complete and the
        completion page's status is this packet's own: a failure cannot be hidden by a later chunk.
        """
        what = f"copy-in chunk {index + 1}/{count} (seq {seq})"
        dl = Deadline(self.wait_timeout_ms, self.clock, self.sleep)
        while True:
            cpl = poll_completion(self.queue, dl, what)
            self.queue.rptr = cpl.rptr
            if cpl.status != P.STATUS_OK and self.queue.ours(cpl.fence, pkt_seq):
                raise status_error(cpl.status, f"{what}, packet seq {cpl.fence}")
            if u32_ge(cpl.fence, pkt_seq):
                return
            if dl.expired():
                want = (seq + 1) & 0xFFFFFFFF
                seen = self._poll_u32(P.XDATA_COPYIN_FENCE, Deadline(MIN_POLL_READ_MS * 5, self.clock, self.sleep),
                                      what)
                raise diagnose_link(self.bridge, GpuLayerError(
                    "fence_stall", f"{what}: copy-in fence (XDATA 0xA800) expected {want}, saw {seen}; queue fence "
                                   f"expected {pkt_seq}, saw {cpl.fence} (status {cpl.status}) after "
                                   f"{dl.elapsed_ms():.0f} ms (wait timeout {dl.timeout_ms} ms): the GPU did not "
                                   f"drain the chunk"))
            dl.pause()

    def _poll_u32(self, addr: int, dl: Deadline, what: str) -> int:
        t = dl.read_timeout_ms(self.bridge.ctrl_timeout_ms)
        try:
            return int.from_bytes(self.bridge.control_read(P.REQ_XDATA_READ, 4, value=addr, timeout_ms=t), "little")
        except UsbLayerError as e:
            if e.reason == "transfer_timeout":
                raise _lost_receipt(e, what, f"the copy-in fence (XDATA {addr:#06x})", t) from e
            raise

    # ------------------------------------------------------------------ VRAM -> host
    def copy_out(self, src: int, nbytes: int, out: bytearray | memoryview | None = None) -> bytes | memoryview:
        """Copy ``nbytes`` from VRAM offset ``src``; returns the bytes (or ``out`` filled).

        Raises like :meth:`copy_in`; a queue fence that does not reach the chunk's packet within the
        wait timeout raises GpuLayerError ``wait_timeout`` naming the chunk.
        """
        if not self.attached:
            raise GpuLayerError("copy_detached", "the copy protocol is not attached (call attach() first)")
        result = memoryview(out).cast("B") if out is not None else memoryview(bytearray(nbytes))
        if len(result) < nbytes:
            raise ValueError(f"output buffer of {len(result)} bytes is smaller than {nbytes}")
        if nbytes == 0:
            return bytes(result) if out is None else result
        pieces = self.chunks_for(nbytes, P.SRAM_HALF)
        placed = self.queue.write([Packet(P.OP_COPYOUT, (i & 1, n, *lo_hi(src + off)))
                                   for i, (off, n) in enumerate(pieces)])
        self.queue.ring(placed[0][1])
        for i, (off, n) in enumerate(pieces):
            what = f"copy-out chunk {i + 1}/{len(pieces)}"
            self.queue.wait(placed[i][0], what, self.wait_timeout_ms)
            if i + 1 < len(pieces):  # "go" for the next chunk: the GPU fills the other half meanwhile
                self.queue.ring(placed[i + 1][1])
            wire = round_up(n, P.SECTOR)
            self.bridge.sram_arm_read((i & 1) * P.SLOTS_PER_HALF, wire)
            if wire == n:
                self.bridge.bulk_in_into(result[off:off + n])
            else:  # the last chunk's 512-byte padding does not fit the caller's buffer
                result[off:off + n] = self.bridge.bulk_in(wire)[:n]
            self.data_bulk_in += 1
        self.chunks_out += len(pieces)
        return bytes(result[:nbytes]) if out is None else result

    # ------------------------------------------------------------------ accounting
    @staticmethod
    def copy_in_wire_bytes(nbytes: int) -> int:
        """Bulk bytes a copy-in of ``nbytes`` puts on the wire: per chunk, the 512-padded payload + sentinel block."""
        return sum(round_up(n, P.SECTOR) + P.SENTINEL_BLOCK
                   for _, n in CopyProtocol.chunks_for(nbytes, P.CHUNK_PAYLOAD))

    @staticmethod
    def chunk_count(nbytes: int, copy_in: bool = True) -> int:
        return ceildiv(nbytes, P.CHUNK_PAYLOAD if copy_in else P.SRAM_HALF)
