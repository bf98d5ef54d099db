"""The twin's GPU engine: executes chestnut's command packets from the ring in VRAM.

The format is defined in ``backend/protocol.py`` ("GPU command packets"); in short:

- The host writes packets into the ring at VRAM ``RING_VRAM_OFFSET`` (``RING_BYTES`` long) with
  streaming memory-write TLPs through BAR0, then posts the new write pointer -- bytes written since the
  GPU came out of reset, u32, wrapping; ring offset = pointer % ``RING_BYTES`` -- to the doorbell
  (BAR2 + ``DOORBELL_BAR_OFFSET``). A posted write of any value to BAR2 + ``DOORBELL_QUEUE_RESET``
  abandons the packet being executed and every packet not yet started (read pointer := write pointer).
- Packet: dword0 = opcode | ndwords << 16 (ndwords counts the whole packet), dword1 = seq, then the
  opcode's arguments (u32 LE; 64-bit VRAM offsets as lo, hi). Lengths: NOP 2, COPYIN 7, COPYOUT 6,
  LOAD 8, RUN 5, SIGNAL 3 dwords. A wrong ndwords or an unknown opcode completes with
  ``STATUS_BAD_PACKET`` (a packet running past the write pointer also drops the rest of the ring).
- After each packet the engine writes, in this order, the status (completion page + ``CPL_STATUS``),
  its read pointer (``CPL_RPTR``) and the packet's seq (``CPL_QUEUE_FENCE``). The completion page is
  GPU address 0x822000 = XDATA 0xB800, read by the host with 0xE4.
- ``OP_COPYIN half, nbytes, dst_lo, dst_hi, chunk_seq``: wait (no time limit, as a GPU wait packet)
  for the sentinel ``SENTINEL_MAGIC | seq`` in the last dword of the sentinel block, which sits at
  ``half*SRAM_HALF + round_up(nbytes, 512)``; check the block (nbytes, zlib.crc32 of the payload, seq);
  copy the payload to VRAM ``dst``; clear the 512-byte block; write ``chunk_seq + 1`` to the copy-in
  fence (GPU 0x820800 = XDATA 0xA800). A bad block gives ``STATUS_CRC``: the block is cleared, the
  payload not copied, the copy-in fence not moved.
- ``OP_COPYOUT half, nbytes, src_lo, src_hi``: copy VRAM to the start of that SRAM half
  (``nbytes <= SRAM_HALF``); the host then arms a 0xF2 read of that half and bulk-reads it.
- ``OP_LOAD program_id, onnx_lo, onnx_hi, onnx_nbytes, sig_lo, sig_hi``: compile the ONNX model held
  in VRAM with :class:`chestnut.backend.model.OnnxModel` (tinygrad on the host CPU, cached by
  sha256, warmed so its JIT is captured) and write its signature at ``sig``: u32 length, then UTF-8
  JSON ``{"sha256", "inputs": [{name, shape, dtype}], "outputs": [...]}``; on ``STATUS_COMPILE_FAILED``
  the JSON is ``{"error": message}``. A **warped program** (``docs/warp.md``) is the ONNX bytes behind a
  header (``backend/warp.py`` ``warp_program``): ``WARP_MAGIC`` (8 bytes), u32 length, a UTF-8 JSON
  :class:`~chestnut.backend.warp.WarpSpec`. It takes the raw frame (uint8, the spec's frame shape) in
  place of the model's one float32 [1, 3, h, w] input, warps it on the GPU (here ``backend/warp.py``
  ``warp_numpy``) and runs the model; its signature also holds ``"warp"`` (the spec) and
  ``"model_inputs"`` (the model's own), ``sha256`` is the ONNX bytes'. A bad header or spec, or a model
  whose input the warp does not make, is ``STATUS_COMPILE_FAILED``.
- ``OP_RUN program_id, table_lo, table_hi``: the table is u32 n_in, u32 n_out, then per tensor
  u64 VRAM offset, u64 nbytes, inputs then outputs in signature order; each nbytes must equal the
  tensor's size. ``status()["last_run"]`` says how many input bytes the last RUN read from VRAM and
  which warp it ran.
- ``OP_SIGNAL value``: write ``value`` to completion page + ``CPL_SIGNAL``.

Faults acting here (:mod:`.faults`): ``gpu_hang`` and ``slow_gpu`` at each packet start,
``sentinel_stuck`` at each COPYIN, ``fence_stall`` at each packet's completion writes, ``nan_output``,
``stale_output`` and ``zero_output`` at each RUN's outputs.

Threading: one engine thread per twin, started by the first doorbell. It takes the twin's lock to
touch state and releases it while waiting; a GPU reset (PCIe power off, power-cycle, brown-out) or a
queue reset while it works makes it drop what it was doing (noticed within :data:`COMPUTE_POLL_S` while a
LOAD or RUN computes; the compute's late result is dropped).

Where programs compute: LOAD's compile and RUN's model run (and a warped program's ``warp_numpy``) happen in
the process's compute child (:mod:`.compute`), never in the process that answers USB: a compile or run
holding that process's GIL would keep the bridge from answering control transfers, as a real dock's bridge
does while its GPU is busy. The engine thread sends the program's bytes or the RUN's input tensors and
waits, GIL released. A program's compiled model lives in the child (its compile cache, :func:`.compute.compile_program`,
shared by every twin of the process); a RUN the child cannot find (a new child after one died, or an LRU
eviction) is compiled again from the bytes the engine kept. If the child dies while a LOAD or RUN waits on
it, that packet completes with ``STATUS_RUN_FAILED`` (a GPU-side failure, not the model's) and the next one
starts a new child. ``status()["compute"]`` shows the child (pid, requests waiting, starts, RUN priority).
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from chestnut.backend import protocol as P
from chestnut.backend.model import TensorSpec
from chestnut.backend.sim import compute as C
from chestnut.backend.sim.faults import PhaseEvent
from chestnut.backend.sim.memory import SparseMemory
from chestnut.backend.warp import WarpSpec, WarpSpecError, split_program

log = logging.getLogger(__name__)

PACKET_DWORDS, OP_NAMES = P.PACKET_DWORDS, P.OP_NAMES
MAX_ONNX_BYTES = 1 << 30
MAX_TENSORS = 256
WAIT_POLL_S = 0.5
STOP_JOIN_S = 1.0
COMPUTE_POLL_S = 0.05  # s between the engine's looks for a reset while the compute child works

def sentinel_block(payload: bytes | memoryview, seq: int) -> bytes:
    """The 512-byte sentinel block that must follow ``payload`` (chunk ``seq``) in its SRAM half."""
    block = bytearray(P.SENTINEL_BLOCK)
    struct.pack_into("<III", block, 0, len(payload), zlib.crc32(payload), seq)
    struct.pack_into("<I", block, 4 * P.SENTINEL_MAGIC_DW, P.sentinel_value(seq))
    return bytes(block)


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class EngineHost(Protocol):
    """What a GPU engine needs from the dock that holds it (the twin): its lock and condition, clock, fault
    opportunities, phase events, memories and the GPU's accesses to system memory. A narrow interface, so the
    engines do not depend on the twin's class."""

    lock: Any  # threading.RLock
    cv: threading.Condition
    clock: Callable[[], float]
    xdata: bytearray
    sram: bytearray
    vram: SparseMemory

    @property
    def program_engine(self) -> str: ...

    @property
    def compute_priority(self) -> int: ...

    def fire(self, kind: str) -> Any: ...

    def phase_event(self, event: PhaseEvent) -> None: ...

    def gpu_system_write(self, gpu_addr: int, data: bytes) -> bool: ...

    def gpu_system_read(self, gpu_addr: int, n: int) -> bytes | None: ...


def warped_signature(spec: WarpSpec, signature: dict[str, Any]) -> dict[str, Any]:
    """The signature of the model behind ``spec``: the raw frame in place of the model's one input.
    Raises WarpSpecError when the model's inputs are not the one float32 tensor the warp makes."""
    ins = signature["inputs"]
    want = {"shape": list(spec.output_shape), "dtype": "float32"}
    if len(ins) != 1 or {k: ins[0][k] for k in want} != want:
        got = ", ".join(f"{d['name']} {d['dtype']}{d['shape']}" for d in ins)
        raise WarpSpecError(f"the warp makes float32{want['shape']}; the model's inputs are {got}")
    return {**signature, "inputs": [spec.frame_spec(ins[0]["name"]).to_json()], "model_inputs": ins,
            "warp": spec.to_json()}


@dataclass
class Program:
    """A loaded program: its compiled model lives in the compute child under ``key`` (sha256, engine)."""

    key: tuple[str, str]
    onnx: bytes  # to compile it again in a new compute child
    signature: dict[str, Any]
    model_inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    last_outputs: list[bytes] | None = None
    warp: WarpSpec | None = None

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        """What the program reads from VRAM: the model's inputs, or the raw frame of a warped program."""
        if self.warp is None:
            return self.model_inputs
        return (self.warp.frame_spec(self.model_inputs[0].name),)


class _ComputeFailed(Exception):
    """The compute child reported an error (``args[0]``: ``"Type: message"``)."""


class _Aborted(Exception):
    """The GPU or the queue was reset while a packet ran."""


@dataclass
class _Done:
    status: int
    fences: list[tuple[int, int]] = field(default_factory=list)  # (GPU system address, u32) written before the cpl


class Engine:
    """The GPU's command processor. Lock-held methods are called by the :class:`Twin` with its lock."""

    def __init__(self, twin: EngineHost) -> None:
        self.twin = twin
        self.rptr = 0
        self.wptr = 0
        self.gpu_epoch = 0
        self.queue_epoch = 0
        self.hung = False
        self.programs: dict[int, Program] = {}
        self.executed = 0
        self.ticks = 0  # work ticks written to CPL_PROGRESS while a packet executes in the compute child
        self.current: str | None = None
        self.last_run: dict[str, Any] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._child: C.ComputeChild | None = None

    # ------------------------------------------------------------------ called with the twin's lock held
    def doorbell_write(self, offset: int, value: int) -> None:
        if offset == P.DOORBELL_BAR_OFFSET:
            self.wptr = value & 0xFFFFFFFF
            if self._thread is None and not self._stop:
                self._thread = threading.Thread(target=self._loop, name="twin-gpu-engine", daemon=True)
                self._thread.start()
            self.twin.cv.notify_all()
        elif offset == P.DOORBELL_QUEUE_RESET:
            self.queue_epoch += 1
            self.rptr = self.wptr
            self.current = None
            self._write_u32(P.CPL_PAGE_GPU_ADDR + P.CPL_RPTR, self.rptr)
            self.twin.cv.notify_all()
            log.info("queue reset: read pointer %#x", self.rptr)

    def reset(self) -> None:
        """GPU reset: the queue, the hang and the loaded programs are gone."""
        self.gpu_epoch += 1
        self.rptr = self.wptr = 0
        self.hung = False
        self.programs.clear()
        self.current = None
        self.twin.cv.notify_all()

    def status(self) -> dict[str, Any]:
        child = self._child
        return {"compute": None if child is None else child.status(),
                "rptr": self.rptr, "wptr": self.wptr, "hung": self.hung, "executing": self.current,
                "executed": self.executed, "last_run": dict(self.last_run),
                "programs": {str(k): v.signature.get("sha256", "")[:16] for k, v in self.programs.items()},
                "queue_fence": self._read_cpl(P.CPL_QUEUE_FENCE), "status": self._read_cpl(P.CPL_STATUS)}

    def _read_cpl(self, off: int) -> int:
        x = P.XDATA_CPL_PAGE + off
        return int.from_bytes(self.twin.xdata[x:x + 4], "little")

    def _write_u32(self, gpu_addr: int, value: int) -> None:
        self.twin.gpu_system_write(gpu_addr, struct.pack("<I", value & 0xFFFFFFFF))

    # ------------------------------------------------------------------ life
    def stop(self) -> None:
        with self.twin.lock:
            self._stop = True
            self.twin.cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=STOP_JOIN_S)  # it notices the stop within COMPUTE_POLL_S of a wait
        with self.twin.lock:
            child, self._child = self._child, None
        if child is not None:
            C.release(child)  # the last twin of the process ends the compute child

    def _epochs(self) -> tuple[int, int]:
        return self.gpu_epoch, self.queue_epoch

    def _check(self, epochs: tuple[int, int]) -> None:
        """Lock held: raise _Aborted if the GPU or the queue was reset since ``epochs``."""
        if self._stop or self._epochs() != epochs:
            raise _Aborted

    def _sleep(self, seconds: float, epochs: tuple[int, int]) -> None:
        tw = self.twin
        deadline = tw.clock() + seconds
        with tw.lock:
            while (left := deadline - tw.clock()) > 0:
                self._check(epochs)
                tw.cv.wait(min(left, WAIT_POLL_S))
            self._check(epochs)

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        tw = self.twin
        while True:
            with tw.lock:
                while not self._stop and (self.hung or self.rptr == self.wptr):
                    tw.cv.wait(WAIT_POLL_S)
                if self._stop:
                    return
                epochs = self._epochs()
                start = self.rptr
                fetched = self._fetch(start)
            if fetched is None:
                continue
            op, seq, args, nbytes = fetched
            try:
                done = self._execute(op, seq, args, epochs)
            except _Aborted:
                log.info("packet seq %d (%s) abandoned: reset", seq, OP_NAMES.get(op, op))
                continue
            except Exception:  # an engine bug must not kill the twin
                log.exception("packet seq %d (%s) failed inside the twin", seq, OP_NAMES.get(op, op))
                done = _Done(P.STATUS_BAD_PACKET)
            with tw.lock:
                if self._epochs() != epochs or self._stop:
                    continue
                self.rptr = (start + nbytes) & 0xFFFFFFFF
                self._complete(seq, done)

    def _ring_read(self, ptr: int, nbytes: int) -> bytes:
        off = P.RING_VRAM_OFFSET + ptr % P.RING_BYTES
        first = min(nbytes, P.RING_VRAM_OFFSET + P.RING_BYTES - off)
        data = self.twin.vram.read(off, first)
        if first < nbytes:
            data += self.twin.vram.read(P.RING_VRAM_OFFSET, nbytes - first)
        return data

    def _fetch(self, start: int) -> tuple[int, int, tuple[int, ...], int] | None:
        """Lock held: decode the packet at ``start``; a malformed one is completed here (returns None)."""
        pending = (self.wptr - start) & 0xFFFFFFFF
        if pending < 8 or pending % 4:
            self._drop_ring(0, f"{pending} pending bytes")
            return None
        dw0, seq = struct.unpack("<II", self._ring_read(start, 8))
        op, ndw = dw0 & 0xFFFF, dw0 >> 16
        if ndw < 2 or ndw * 4 > pending:
            self._drop_ring(seq, f"ndwords {ndw} with {pending} bytes pending")
            return None
        if PACKET_DWORDS.get(op) != ndw:
            log.warning("bad packet seq %d: opcode %#x with %d dwords", seq, op, ndw)
            self.rptr = (start + ndw * 4) & 0xFFFFFFFF
            self._complete(seq, _Done(P.STATUS_BAD_PACKET))
            return None
        args = struct.unpack(f"<{ndw - 2}I", self._ring_read(start + 8, (ndw - 2) * 4))
        return op, seq, args, ndw * 4

    def _drop_ring(self, seq: int, why: str) -> None:
        log.warning("bad packet (%s): dropping the ring up to the write pointer", why)
        self.rptr = self.wptr
        self._complete(seq, _Done(P.STATUS_BAD_PACKET))

    def _complete(self, seq: int, done: _Done) -> None:
        """Lock held: the packet's fence writes, then status, read pointer and queue fence."""
        self.executed += 1
        self.current = None
        if self.twin.fire("fence_stall"):
            log.info("fence_stall: completion writes of seq %d skipped", seq)
            return
        for addr, value in done.fences:
            self._write_u32(addr, value)
        self._write_u32(P.CPL_PAGE_GPU_ADDR + P.CPL_STATUS, done.status)
        self._write_u32(P.CPL_PAGE_GPU_ADDR + P.CPL_RPTR, self.rptr)
        self._write_u32(P.CPL_PAGE_GPU_ADDR + P.CPL_QUEUE_FENCE, seq)

    # ------------------------------------------------------------------ packets
    def _execute(self, op: int, seq: int, args: tuple[int, ...], epochs: tuple[int, int]) -> _Done:
        tw = self.twin
        with tw.lock:
            self._check(epochs)
            self.current = f"{OP_NAMES[op]} seq {seq}"
            if tw.fire("gpu_hang"):
                log.info("gpu_hang: the engine stops at seq %d", seq)
                self.hung = True
            while self.hung:
                self._check(epochs)
                tw.cv.wait(WAIT_POLL_S)
            slow = tw.fire("slow_gpu")
        if slow is not None:
            self._sleep(slow.spec.delay_ms / 1000, epochs)
        if op == P.OP_NOP:
            return _Done(P.STATUS_OK)
        if op == P.OP_SIGNAL:
            return _Done(P.STATUS_OK, [(P.CPL_PAGE_GPU_ADDR + P.CPL_SIGNAL, args[0])])
        if op == P.OP_COPYIN:
            return self._copyin(*args, epochs=epochs)
        if op == P.OP_COPYOUT:
            return self._copyout(*args, epochs=epochs)
        if op == P.OP_LOAD:
            return self._load(*args, epochs=epochs)
        return self._run(*args, epochs=epochs)

    def _copyin(self, half: int, nbytes: int, dst_lo: int, dst_hi: int, chunk_seq: int, *,
                epochs: tuple[int, int]) -> _Done:
        tw = self.twin
        if half not in (0, 1) or not 0 < nbytes <= P.CHUNK_PAYLOAD:
            return _Done(P.STATUS_BAD_PACKET)
        base = half * P.SRAM_HALF
        block = base + round_up(nbytes, P.SECTOR)
        magic_at = block + 4 * P.SENTINEL_MAGIC_DW
        want = P.sentinel_value(chunk_seq)
        with tw.lock:
            stuck = tw.fire("sentinel_stuck") is not None
            while stuck or struct.unpack_from("<I", tw.sram, magic_at)[0] != want:
                self._check(epochs)
                tw.cv.wait(WAIT_POLL_S)
            got_n, crc, got_seq = struct.unpack_from("<III", tw.sram, block)
            payload = bytes(tw.sram[base:base + nbytes])
            tw.sram[block:block + P.SENTINEL_BLOCK] = bytes(P.SENTINEL_BLOCK)
            tw.cv.notify_all()
            if (got_n, got_seq) != (nbytes, chunk_seq) or crc != zlib.crc32(payload):
                log.warning("COPYIN chunk %d: bad sentinel block (nbytes %d/%d, seq %d, crc %#x)", chunk_seq,
                            got_n, nbytes, got_seq, crc)
                return _Done(P.STATUS_CRC)
            dst = dst_lo | dst_hi << 32
            if dst + nbytes > tw.vram.size:
                return _Done(P.STATUS_OUT_OF_RANGE)
            tw.vram.write(dst, payload)
        return _Done(P.STATUS_OK, [(P.SYS_PAGE_GPU_ADDR + (P.XDATA_COPYIN_FENCE - P.XDATA_SYS_PAGE),
                                    chunk_seq + 1)])

    def _copyout(self, half: int, nbytes: int, src_lo: int, src_hi: int, *, epochs: tuple[int, int]) -> _Done:
        tw = self.twin
        if half not in (0, 1) or not 0 < nbytes <= P.SRAM_HALF:
            return _Done(P.STATUS_BAD_PACKET)
        src = src_lo | src_hi << 32
        with tw.lock:
            self._check(epochs)
            if src + nbytes > tw.vram.size:
                return _Done(P.STATUS_OUT_OF_RANGE)
            base = half * P.SRAM_HALF
            tw.vram.readinto(src, memoryview(tw.sram)[base:base + nbytes])
        return _Done(P.STATUS_OK)

    def _write_signature(self, sig: int, doc: dict[str, Any]) -> bool:
        raw = json.dumps(doc).encode()
        if sig + 4 + len(raw) > self.twin.vram.size:
            return False
        self.twin.vram.write(sig, struct.pack("<I", len(raw)) + raw)
        return True

    # ------------------------------------------------------------------ the compute child
    def _compute(self, msg: tuple[Any, ...], epochs: tuple[int, int]) -> tuple[Any, ...]:
        """Send ``msg`` to the compute child and wait for its reply (``("ok", rid, ...)`` or ``("missing", rid)``).
        Raises _Aborted on a reset or stop meanwhile (the request is cancelled, a late result dropped),
        _ComputeFailed for the child's error and :class:`~.compute.ComputeDied` if it died."""
        tw = self.twin
        with tw.lock:
            self._check(epochs)
            if self._child is None:
                self._child = C.acquire(tw.compute_priority)
            child = self._child
        rid, fut = child.submit(msg)
        while True:
            try:
                reply = fut.result(timeout=COMPUTE_POLL_S)
                break
            except FutureTimeout:
                pass
            with tw.lock:
                aborted = self._stop or self._epochs() != epochs
                if not aborted:  # still working on the packet: a work tick the host's wait sees as progress
                    self.ticks = (self.ticks + 1) & 0xFFFFFFFF
                    at = P.XDATA_CPL_PAGE + P.CPL_PROGRESS  # straight into XDATA: a tick is no fence (no receipt)
                    tw.xdata[at:at + 4] = struct.pack("<I", self.ticks)
            if aborted:
                child.cancel(rid)
                raise _Aborted
        if reply[0] == "error":
            raise _ComputeFailed(reply[2])
        return reply

    def _load(self, program_id: int, onnx_lo: int, onnx_hi: int, onnx_nbytes: int, sig_lo: int, sig_hi: int, *,
              epochs: tuple[int, int]) -> _Done:
        tw = self.twin
        src, sig = onnx_lo | onnx_hi << 32, sig_lo | sig_hi << 32
        with tw.lock:
            self._check(epochs)
            tw.phase_event(PhaseEvent.LOAD)
            if not 0 < onnx_nbytes <= MAX_ONNX_BYTES or src + onnx_nbytes > tw.vram.size:
                return _Done(P.STATUS_OUT_OF_RANGE)
            image = tw.vram.read(src, onnx_nbytes)
            engine = tw.program_engine
        try:
            warp, onnx_bytes = split_program(image)
            model_sig = self._compute(("load", onnx_bytes, engine), epochs)[2]
            signature = model_sig if warp is None else warped_signature(warp, model_sig)
        except (WarpSpecError, _ComputeFailed) as e:  # a bad header, ModelError, tinygrad failing on an odd graph
            error = str(e) if isinstance(e, _ComputeFailed) else f"{type(e).__name__}: {e}"
            log.warning("LOAD program %d failed: %s", program_id, error)
            with tw.lock:
                self._check(epochs)
                self._write_signature(sig, {"error": error})
            return _Done(P.STATUS_COMPILE_FAILED)
        except C.ComputeDied as e:
            log.warning("LOAD program %d failed: %s", program_id, e)
            with tw.lock:
                self._check(epochs)
                self._write_signature(sig, {"error": f"ComputeDied: {e}"})
            return _Done(P.STATUS_RUN_FAILED)
        with tw.lock:
            self._check(epochs)
            if not self._write_signature(sig, signature):
                return _Done(P.STATUS_OUT_OF_RANGE)
            self.programs[program_id] = Program(
                (signature["sha256"], engine), onnx_bytes, signature,
                tuple(TensorSpec.from_json(d) for d in model_sig["inputs"]),
                tuple(TensorSpec.from_json(d) for d in model_sig["outputs"]), warp=warp)
        log.info("LOAD program %d: %s", program_id, signature["sha256"][:16])
        return _Done(P.STATUS_OK)

    def _run(self, program_id: int, table_lo: int, table_hi: int, *, epochs: tuple[int, int]) -> _Done:
        tw = self.twin
        table = table_lo | table_hi << 32
        with tw.lock:
            self._check(epochs)
            prog = self.programs.get(program_id)
            if prog is None:
                return _Done(P.STATUS_NO_PROGRAM)
            specs_in, specs_out = prog.inputs, prog.outputs
            if table + 8 > tw.vram.size:
                return _Done(P.STATUS_OUT_OF_RANGE)
            n_in, n_out = struct.unpack("<II", tw.vram.read(table, 8))
            if (n_in, n_out) != (len(specs_in), len(specs_out)) or n_in + n_out > MAX_TENSORS:
                return _Done(P.STATUS_BAD_PACKET)
            entries = struct.unpack(f"<{2 * (n_in + n_out)}Q", tw.vram.read(table + 8, 16 * (n_in + n_out)))
            places = list(zip(entries[0::2], entries[1::2], strict=True))
            for (off, nb), spec in zip(places, (*specs_in, *specs_out), strict=True):
                if nb != spec.nbytes:
                    return _Done(P.STATUS_BAD_PACKET)
                if off + nb > tw.vram.size:
                    return _Done(P.STATUS_OUT_OF_RANGE)
            inputs = [(s.name, s.dtype, tuple(s.shape), tw.vram.read(off, nb))
                      for (off, nb), s in zip(places[:n_in], specs_in, strict=True)]
            self.last_run = {"program": program_id, "input_bytes": sum(nb for _, nb in places[:n_in]),
                             "warp": None if prog.warp is None else prog.warp.frame}
        try:
            reply = self._compute(("run", prog.key, prog.warp, inputs), epochs)
            if reply[0] == "missing":  # a new compute child, or its LRU dropped the model: compile it again
                log.info("RUN program %d: compiling it again in the compute process", program_id)
                self._compute(("load", prog.onnx, prog.key[1]), epochs)
                reply = self._compute(("run", prog.key, prog.warp, inputs), epochs)
            if reply[0] != "ok":
                raise _ComputeFailed(f"the compute process does not hold program {prog.key[0][:16]}")
            outputs = list(reply[2])
        except (_ComputeFailed, C.ComputeDied) as e:
            log.warning("RUN program %d failed: %s", program_id, e)
            return _Done(P.STATUS_RUN_FAILED)
        with tw.lock:
            self._check(epochs)
            outputs, faulted = self._output_faults(prog, outputs)
            for (off, _), data in zip(places[n_in:], outputs, strict=True):
                tw.vram.write(off, data)
            prog.last_outputs = outputs
            if not faulted:
                tw.phase_event(PhaseEvent.RUN_OK)
        return _Done(P.STATUS_OK)

    def _output_faults(self, prog: Program, outputs: list[bytes]) -> tuple[list[bytes], bool]:
        """Lock held: the outputs as the output faults leave them, and whether one fired."""
        tw = self.twin
        specs = prog.outputs
        if tw.fire("nan_output"):
            return [np.full(s.shape, np.nan, s.dtype).tobytes() if np.dtype(s.dtype).kind == "f" else o
                    for s, o in zip(specs, outputs, strict=True)], True
        if tw.fire("stale_output"):
            stale = prog.last_outputs if prog.last_outputs is not None else [bytes(len(o)) for o in outputs]
            return stale, True
        if tw.fire("zero_output"):
            return [bytes(len(o)) for o in outputs], True
        return outputs, False
