"""Shared memory between the node and its primary worker: segments, the control block, tensor slots.

Segments are anonymous memory files (Linux ``memfd_create``; elsewhere a temp file unlinked at
once): they have no name in ``/dev/shm`` or anywhere else, so nothing can leak there whatever dies
(the worker, the node, or both under SIGKILL). The kernel frees a segment when the last process
holding its descriptor or a mapping of it goes away. The node creates every segment and hands the
descriptor to the worker (inherited at spawn, or sent over the command socket with ``SCM_RIGHTS``).

Two kinds of segment:

- the **control block** (:class:`ControlBlock`): a few int64 words the worker writes and the node
  reads without any system call: the heartbeat (``CLOCK_MONOTONIC`` in ns, system-wide on Linux so
  both processes read the same clock), the worker's state and progress counters;
- the **tensor slots** (:class:`SlotBuffers`): ``slots`` copies of (all inputs, all outputs), each
  slot tagged with the sequence number of the request whose input it holds (``in_seq``) and of
  the result its outputs hold (``out_seq``), so a late result of frame n can never be read as
  frame n+1.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from chestnut.backend.model import TensorSpec

ALIGN_BYTES = 64  # every tensor starts on a cache line


def _align(n: int, to: int = ALIGN_BYTES) -> int:
    return (n + to - 1) // to * to


class SharedSegment:
    """One anonymous shared-memory file mapped read-write into this process.

    ``buf`` is a uint8 numpy array over the whole mapping; views cut from it stay valid while they
    are referenced, even after :meth:`close` (the mapping is released when the last view dies).
    """

    def __init__(self, fd: int, size: int) -> None:
        if size <= 0:
            raise ValueError(f"segment size must be > 0 bytes, got {size}")
        self.fd = fd
        self.size = size
        self._mm: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf: np.ndarray = np.frombuffer(self._mm, dtype=np.uint8)
        self._close_fd = weakref.finalize(self, os.close, fd)  # also when dropped without close()

    @classmethod
    def create(cls, name: str, size: int) -> SharedSegment:
        """A new zero-filled segment of ``size`` bytes; ``name`` only labels it in ``/proc/<pid>/fd``.

        The descriptor is close-on-exec; pass it to a child with ``subprocess.Popen(pass_fds=...)``
        or ``socket.send_fds``. Pages are touched once here so the first frame pays no page faults.
        """
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
        else:  # POSIX without memfd: an unlinked temp file in the system temp dir
            fd, path = tempfile.mkstemp(prefix=f"{name}-")
            os.unlink(path)
        try:
            os.ftruncate(fd, size)
            seg = cls(fd, size)
        except BaseException:
            os.close(fd)
            raise
        seg.buf[:] = 0
        return seg

    @classmethod
    def attach(cls, fd: int) -> SharedSegment:
        """Map a segment received from the other side; its size is the file's size."""
        return cls(fd, os.fstat(fd).st_size)

    def close(self) -> None:
        """Close the descriptor and unmap unless views handed out are still alive (then they keep it)."""
        self._close_fd()
        self.fd = -1
        if self._mm is not None:
            self.buf = np.empty(0, np.uint8)
            try:
                self._mm.close()
            except BufferError:  # a caller still holds a view; the mapping goes with the last one
                pass
            self._mm = None


class WorkerState(IntEnum):
    """The worker's state as written in the control block."""

    SPAWNED = 0
    QUALIFYING = 1
    LOADING = 2
    READY = 3      # idle, waiting for a command
    RUNNING = 4    # inside ``runner.run``
    PROBING = 5    # inside ``runner.probe``
    STOPPING = 6
    FAILED = 7     # start-up failed; the worker is exiting


class _Field(IntEnum):
    MAGIC = 0
    PID = 1
    HEARTBEAT_NS = 2   # CLOCK_MONOTONIC ns of the last beat
    BEATS = 3
    STATE = 4
    BUSY_SEQ = 5       # seq of the request being run, -1 when idle
    BUSY_SINCE_NS = 6  # CLOCK_MONOTONIC ns when that run started
    RUNS_STARTED = 7
    RUNS_DONE = 8
    RUNS_FAILED = 9
    LATE_PEAK_NS = 10  # the heartbeat timer's worst lateness over its last second, ns
    TRANSFER_ERRORS = 11  # the runner's failed transfer attempts so far (retried or not), when it counts them
    PROGRESS = 12      # progress reports of the current long command (bytes moved, steps, engine ticks)
    PROGRESS_NS = 13   # CLOCK_MONOTONIC ns of the last progress, or of the start of the current dock I/O
    IO_NS = 14         # CLOCK_MONOTONIC ns of the last dock transfer's begin or end
    IO_DEPTH = 15      # transfers in progress (> 0: inside one)


_PROGRESS, _PROGRESS_NS, _IO_NS, _IO_DEPTH = (int(f) for f in (_Field.PROGRESS, _Field.PROGRESS_NS, _Field.IO_NS,
                                                                 _Field.IO_DEPTH))
CONTROL_MAGIC = 0x43484E5457524B31  # "CHNTWRK1": layout version of the control block
CONTROL_BYTES = 128


@dataclass(frozen=True)
class ControlSnapshot:
    """One consistent read of the control block (times in CLOCK_MONOTONIC ns)."""

    pid: int
    heartbeat_ns: int
    beats: int
    state: WorkerState
    busy_seq: int
    busy_since_ns: int
    runs_started: int
    runs_done: int
    runs_failed: int
    late_peak_ns: int = 0
    transfer_errors: int = 0
    progress: int = 0
    progress_ns: int = 0
    io_ns: int = 0
    io_depth: int = 0


IO_GAP_NS = 500_000_000
"""Dock I/O after this long without any (ns) starts a new stretch, a new wait: its progress clock starts
then. Our choice: ten times the longest pause between a bounded wait's polls (``backend/copy.py``
``Deadline``), far below the wait timeout; host work between transfers (a compile) is not a wait."""


class ControlBlock:
    """The worker's heartbeat, state and progress counters: int64 words in a shared segment.

    Only the worker writes; each word is an aligned 8-byte store, and the reader retries until two
    consecutive reads agree, so a snapshot is never torn.
    """

    def __init__(self, segment: SharedSegment) -> None:
        if segment.size < CONTROL_BYTES:
            raise ValueError(f"control segment is {segment.size} bytes, need {CONTROL_BYTES}")
        self.segment = segment
        self._w = segment.buf[:CONTROL_BYTES].view(np.int64)
        # the same words as Python ints: the writes of every transfer, cheaply
        self._q = memoryview(segment.buf[:CONTROL_BYTES].data).cast("q")

    @classmethod
    def create(cls) -> ControlBlock:
        block = cls(SharedSegment.create("chestnut-worker-ctl", CONTROL_BYTES))
        block._w[_Field.MAGIC] = CONTROL_MAGIC
        block._w[_Field.BUSY_SEQ] = -1
        return block

    @classmethod
    def attach(cls, fd: int) -> ControlBlock:
        block = cls(SharedSegment.attach(fd))
        if int(block._w[_Field.MAGIC]) != CONTROL_MAGIC:
            raise ValueError(f"control block magic {int(block._w[_Field.MAGIC]):#x} != {CONTROL_MAGIC:#x}")
        return block

    # ---- writer side (the worker)
    def beat(self) -> None:
        self._w[_Field.HEARTBEAT_NS] = time.monotonic_ns()
        self._w[_Field.BEATS] += 1

    def set_late_peak(self, late_ns: int) -> None:
        """The heartbeat timer's worst lateness of its last second (ns): how much later than asked its
        sleeps ended (``node/hostload.py``)."""
        self._w[_Field.LATE_PEAK_NS] = max(0, int(late_ns))

    def set_transfer_errors(self, n: int) -> None:
        """The runner's failed transfer attempts so far (``backend/retry.py`` ``RetryingUSB3.stats()["errors"]``)."""
        self._w[_Field.TRANSFER_ERRORS] = max(0, int(n))

    def set_pid(self, pid: int) -> None:
        self._w[_Field.PID] = pid

    def set_state(self, state: WorkerState) -> None:
        """The worker's state; a new state is also progress (a command started or ended)."""
        self._w[_Field.STATE] = int(state)
        self._w[_Field.PROGRESS_NS] = time.monotonic_ns()

    def progress(self, amount: int = 1) -> None:
        """The dock made progress (``backend/progress.py``): the count grows by ``amount``, its clock is now."""
        q = self._q
        q[_PROGRESS] += amount
        q[_PROGRESS_NS] = time.monotonic_ns()

    def dock_io(self, begin: bool) -> None:
        """A dock transfer begins (``begin``) or ends. The first after :data:`IO_GAP_NS` without any starts a
        new wait: its progress clock starts at it."""
        q, now = self._q, time.monotonic_ns()
        if begin:
            if q[_IO_DEPTH] <= 0 and now - q[_IO_NS] > IO_GAP_NS:
                q[_PROGRESS_NS] = now
            q[_IO_DEPTH] += 1
        elif q[_IO_DEPTH] > 0:
            q[_IO_DEPTH] -= 1
        q[_IO_NS] = now

    def run_started(self, seq: int) -> None:
        self._w[_Field.BUSY_SINCE_NS] = time.monotonic_ns()
        self._w[_Field.BUSY_SEQ] = seq
        self._w[_Field.RUNS_STARTED] += 1
        self._w[_Field.STATE] = int(WorkerState.RUNNING)

    def run_finished(self, ok: bool) -> None:
        self._w[_Field.RUNS_DONE if ok else _Field.RUNS_FAILED] += 1
        self._w[_Field.BUSY_SEQ] = -1
        self._w[_Field.STATE] = int(WorkerState.READY)

    # ---- reader side (the node)
    def heartbeat_ns(self) -> int:
        a = int(self._w[_Field.HEARTBEAT_NS])
        for _ in range(8):
            b = int(self._w[_Field.HEARTBEAT_NS])
            if a == b:
                break
            a = b
        return a

    def snapshot(self) -> ControlSnapshot:
        q = self._q
        a = q.tolist()
        for _ in range(8):
            b = q.tolist()
            if a == b:
                break
            a = b
        state = a[_Field.STATE]
        return ControlSnapshot(
            pid=a[_Field.PID], heartbeat_ns=a[_Field.HEARTBEAT_NS], beats=a[_Field.BEATS],
            state=WorkerState(state) if state in WorkerState._value2member_map_ else WorkerState.FAILED,
            busy_seq=a[_Field.BUSY_SEQ], busy_since_ns=a[_Field.BUSY_SINCE_NS],
            runs_started=a[_Field.RUNS_STARTED], runs_done=a[_Field.RUNS_DONE],
            runs_failed=a[_Field.RUNS_FAILED], late_peak_ns=a[_Field.LATE_PEAK_NS],
            transfer_errors=a[_Field.TRANSFER_ERRORS], progress=a[_Field.PROGRESS],
            progress_ns=a[_Field.PROGRESS_NS], io_ns=a[_Field.IO_NS], io_depth=a[_Field.IO_DEPTH],
        )

    def late_peak_ns(self) -> int:
        """:meth:`set_late_peak`'s word alone (one aligned 8-byte load: never torn)."""
        return int(self._q[_Field.LATE_PEAK_NS])

    def transfer_errors(self) -> int:
        """:meth:`set_transfer_errors`'s word alone (one aligned 8-byte load: never torn)."""
        return int(self._q[_Field.TRANSFER_ERRORS])


@dataclass(frozen=True)
class TensorPlace:
    """Where one tensor lives inside a slot: byte offset from the slot's start, and its spec."""

    spec: TensorSpec
    offset: int


@dataclass(frozen=True)
class SlotLayout:
    """The tensor-slot segment: a tag table, then ``slots`` equal slots of inputs then outputs.

    Tag table: for slot ``i``, int64 ``in_seq`` at byte ``16*i`` and ``out_seq`` at ``16*i+8``
    (``-1`` = empty). Tensors are 64-byte aligned, C-contiguous, in spec order.
    """

    slots: int
    inputs: tuple[TensorPlace, ...]
    outputs: tuple[TensorPlace, ...]
    slot_bytes: int
    tags_bytes: int

    @classmethod
    def build(cls, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], slots: int) -> SlotLayout:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        offset = 0
        places: list[list[TensorPlace]] = [[], []]
        for group, specs in enumerate((inputs, outputs)):
            for s in specs:
                places[group].append(TensorPlace(s, offset))
                offset = _align(offset + s.nbytes)
        return cls(slots, tuple(places[0]), tuple(places[1]), max(_align(offset), ALIGN_BYTES),
                   _align(16 * slots))

    @property
    def total_bytes(self) -> int:
        return self.tags_bytes + self.slots * self.slot_bytes

    def to_json(self) -> dict[str, Any]:
        def places(ps: tuple[TensorPlace, ...]) -> list[dict[str, Any]]:
            return [{**p.spec.to_json(), "offset": p.offset} for p in ps]
        return {"slots": self.slots, "slot_bytes": self.slot_bytes, "tags_bytes": self.tags_bytes,
                "inputs": places(self.inputs), "outputs": places(self.outputs)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SlotLayout:
        def places(ps: list[dict[str, Any]]) -> tuple[TensorPlace, ...]:
            return tuple(TensorPlace(TensorSpec.from_json(p), int(p["offset"])) for p in ps)
        return cls(int(d["slots"]), places(d["inputs"]), places(d["outputs"]), int(d["slot_bytes"]),
                   int(d["tags_bytes"]))


class SlotBuffers:
    """numpy views of every tensor of every slot, cut once from a segment laid out by :class:`SlotLayout`.

    ``writer`` says which side may write what: ``"node"`` writes inputs (outputs are read-only
    views), ``"worker"`` writes outputs (inputs are read-only views).
    """

    def __init__(self, segment: SharedSegment, layout: SlotLayout, writer: str) -> None:
        if segment.size < layout.total_bytes:
            raise ValueError(f"slot segment is {segment.size} bytes, layout needs {layout.total_bytes}")
        if writer not in ("node", "worker"):
            raise ValueError(f"writer must be 'node' or 'worker', got {writer!r}")
        self.segment = segment
        self.layout = layout
        self._tags = segment.buf[:layout.tags_bytes].view(np.int64)
        self.inputs: list[dict[str, np.ndarray]] = []
        self.outputs: list[dict[str, np.ndarray]] = []
        for i in range(layout.slots):
            base = layout.tags_bytes + i * layout.slot_bytes
            ins = {p.spec.name: self._view(base, p, writable=writer == "node") for p in layout.inputs}
            outs = {p.spec.name: self._view(base, p, writable=writer == "worker") for p in layout.outputs}
            self.inputs.append(ins)
            self.outputs.append(outs)
        if writer == "node":
            self._tags[:] = -1

    def _view(self, base: int, place: TensorPlace, writable: bool) -> np.ndarray:
        s = place.spec
        start = base + place.offset
        v = self.segment.buf[start:start + s.nbytes].view(np.dtype(s.dtype)).reshape(s.shape)
        v.flags.writeable = writable
        return v

    def in_seq(self, slot: int) -> int:
        return int(self._tags[2 * slot])

    def set_in_seq(self, slot: int, seq: int) -> None:
        self._tags[2 * slot] = seq

    def out_seq(self, slot: int) -> int:
        return int(self._tags[2 * slot + 1])

    def set_out_seq(self, slot: int, seq: int) -> None:
        self._tags[2 * slot + 1] = seq

    def release(self) -> None:
        """Drop this object's views so the segment can be unmapped."""
        self.inputs = []
        self.outputs = []
        self._tags = np.empty(0, np.int64)
