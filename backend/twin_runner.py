"""The primary runner on the Chestnut twin: the dock's protocol end to end, with the model on the twin's GPU.

:class:`TwinRunner` talks to a twin daemon (``chestnut twin serve``) the way a host talks to a dock:

- ``qualify()``: the ladder's dock rungs through the twin's **pyusb face** (``usb.core.find`` with the
  twin's backend; control transfers only, no interface claimed) and :class:`~chestnut.backend.bridge.Bridge`:
  IDs and product string, link speed, link stability (the twin's link-error counter plus failed probe
  reads), LTSSM (GPU reset, power-on, bounded training wait), BARs and the GPU's vendor/architecture.
- the data path: tinygrad's lock file for the dock (:class:`~chestnut.backend.real_runner.DockLock`: with
  ``lock_first`` the one ``usb_ids`` took, else taken here with back-off), then the twin's **tinygrad-style
  USB3 face** (which claims the interface) from this
  process's cached device list -- like tinygrad, a process does not see a re-enumerated dock -- with
  the command queue (:mod:`chestnut.backend.copy`, for the programs) and the copy path attached.
- the copy path (``copy_protocol``): ``"tinygrad"`` (default) is **tinygrad 0.14's own**
  ``AMDAllocator._copyin`` / ``_copyout`` over the twin's SDMA queue, called through
  :class:`~chestnut.backend.tinygrad_harness.TinygradDock` (4-byte sentinels, two chunks in flight, its 10 s
  drain, ``HCQSignal.wait`` with ``HCQDEV_WAIT_TIMEOUT_MS`` = ``wait_timeout_ms``); ``"chestnut"`` is the
  bounded protocol of :class:`~chestnut.backend.copy.CopyProtocol` (512-byte sentinel blocks, every wait
  bounded by ``wait_timeout_ms``). tinygrad's drain ignores the wait timeout: a worker stuck in it is the
  node's watchdog's to kill (3000 ms + margin).
- ``load()``: the real ONNX bytes are copied into VRAM chunk by chunk, ``OP_LOAD`` compiles them on
  the twin's GPU (bounded by ``load_timeout_ms``: compiling is slow), the signature is read back and
  checked against the file's sha256, the input/output buffers and the ``OP_RUN`` tensor table are
  placed in VRAM. With ``ModelSpec.warp`` the program image is the ONNX bytes behind the warp's header
  (``backend/sim/engine.py`` ``warp_program``): program 1 takes the raw frame and warps it on the GPU
  (``docs/warp.md``), program 2 is the same ONNX bytes alone (the model's own input, for the warm-up's
  fingerprint); the signature must name the warp asked for.
- ``run()``: inputs copied in, ``OP_RUN``, outputs copied out; every wait bounded by ``wait_timeout_ms``.
  ``copy_in_bytes`` is what the last run copied in (with a warp: the full frame, e.g. 3,493,536 bytes for
  1928x1208 NV12).

Errors are typed (:mod:`chestnut.backend.errors`; tinygrad's messages through
:func:`~chestnut.backend.classify.classify`). A dock-layer error (USB, PCIe, GPU) is sticky, as tinygrad's
error state and latched async errors are: later calls raise it again, **without touching the dock**, until a
fresh runner (in the node: a fresh worker process) qualifies the dock again -- a copy retried in the same
process after a failure returns zeros with tinygrad 0.14 (``backend/tinygrad_harness.py``). Model errors (bad
inputs) are not sticky.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from chestnut.backend import protocol as P
from chestnut.backend.bridge import Bridge, round_up
from chestnut.backend.classify import blame_slow_link, classify
from chestnut.backend.copy import CommandQueue, CopyProtocol, Packet, lo_hi
from chestnut.backend.errors import ChestnutError, GpuLayerError, ModelError, PcieLayerError, UsbLayerError
from chestnut.backend.interface import DockObservation, LadderReport, LadderStep, ModelSpec
from chestnut.backend.ladder import DockQualifier, LadderConfig, UsbDock
from chestnut.backend.model import TensorSpec, model_label
from chestnut.backend.progress import ProgressUSB3
from chestnut.backend.real_runner import (
    COPY_STATS_KEY,
    CopyTimer,
    DockLock,
    check_inputs,
    dock_lock_path,
    inputs_match,
)
from chestnut.backend.retry import STATS_KEY, RetryingUSB3, RetryPolicy
from chestnut.backend.stages import StageClock
from chestnut.backend.warp import warp_program
from chestnut.msgs.paths import current_prefix

SIGNATURE_MAX_BYTES = 1 << 20  # VRAM reserved for OP_LOAD's signature (u32 length + JSON)
COPY_PROTOCOLS = ("tinygrad", "chestnut")
LINK_CHECK_TIMEOUT_MS = 100  # the per-frame LTSSM read (openpilot's hardwared reads it with 100 ms timeouts)
VRAM_ALIGN = 0x1000
PROGRAM_ID = 1
MODEL_PROGRAM_ID = 2  # with a warp: the model alone, on its own input (the warm-up's fingerprint)


class VramHeap:
    """A bump allocator over VRAM offsets ``[start, end)``, ``VRAM_ALIGN``-aligned. Raises GpuLayerError when full."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end, self.next = start, end, start

    def alloc(self, nbytes: int) -> int:
        off = self.next
        if off + nbytes > self.end:
            raise GpuLayerError(
                "vram_full", f"{nbytes} bytes do not fit in VRAM [{self.start:#x}, {self.end:#x}) at {off:#x}"
            )
        self.next = round_up(off + max(nbytes, 1), VRAM_ALIGN)
        return off

    def reset(self) -> None:
        self.next = self.start


class TwinDock(UsbDock):
    """:class:`~chestnut.backend.ladder.UsbDock` over the twin daemon of ``prefix``: a dock not found says whether
    the twin daemon runs (``backend/sim/client.py`` ``daemon_missing``), as the node's own looks at it do
    (``node/docklook.py``). The node's first ``dock_absent``, from its worker's ``usb_ids``, read as a dock's cable
    and power where its later ones, from its looks, said to start the twin."""

    def __init__(self, backend: Any, prefix: str, ctrl_timeout_ms: int = P.USB_CTRL_TIMEOUT_MS,
                 link_errors: Callable[[Any], int | None] | None = None) -> None:
        super().__init__(backend, ctrl_timeout_ms, link_errors=link_errors)
        self.prefix = prefix

    def find(self) -> Any:
        try:
            return super().find()
        except UsbLayerError as e:
            if e.reason != "no_dock":
                raise
            from chestnut.backend.sim.client import daemon_missing

            if (missing := daemon_missing(self.prefix)) is None:
                raise
            raise UsbLayerError("no_dock", f"{e.detail}: {missing[1]}") from e


class TwinRunner:
    """:class:`~chestnut.backend.interface.PrimaryRunner` over the twin daemon of ``prefix``.

    ``wait_timeout_ms`` bounds every wait of the copy protocol and the queue (default 3000);
    ``load_timeout_ms`` bounds ``OP_LOAD`` (compiling); ``ctrl_timeout_ms`` bounds each control
    transfer of the data path, TLP requests included (tinygrad: 1000 ms, 5000 ms for 0xF0; here
    one bound, below the wait timeout); ``config`` holds the ladder's bounds. ``lock_first``: the ladder's
    ``usb_ids`` takes the dock's lock (one try; :class:`~chestnut.backend.ladder.DockQualifier` ``lock``) and
    the runner holds it from then on, the data path and any re-qualification in this process included (the
    node's worker, ``chestnut probe``, ``chestnut acceptance``: a dock another process holds is refused at
    ``usb_ids`` and never reset); otherwise the lock is taken when the data path opens, with back-off, after
    the LTSSM rung's GPU reset.
    """

    kind = "twin"

    def __init__(
        self,
        prefix: str | None = None,
        *,
        wait_timeout_ms: int = P.WAIT_TIMEOUT_MS,
        load_timeout_ms: int = 120_000,
        ctrl_timeout_ms: int = P.USB_CTRL_TIMEOUT_MS,
        lock_timeout_s: float = 2.0,
        reset_gpu: bool = True,
        config: LadderConfig | None = None,
        copy_protocol: str = "tinygrad",
        lock_first: bool = False,
    ) -> None:
        from chestnut.backend.sim.client import TwinClient, TwinNotRunning
        from chestnut.backend.sim.pyusb_backend import twin_backend

        if copy_protocol not in COPY_PROTOCOLS:
            raise ValueError(f"copy_protocol {copy_protocol!r}: use one of {COPY_PROTOCOLS}")
        self.copy_protocol = copy_protocol
        self.prefix = current_prefix() if prefix is None else prefix
        self.wait_timeout_ms = wait_timeout_ms
        self.load_timeout_ms = load_timeout_ms
        self.ctrl_timeout_ms = ctrl_timeout_ms
        self.lock_timeout_s = lock_timeout_s
        self.reset_gpu = reset_gpu
        self.lock_first = lock_first
        self.config = config or LadderConfig(wait_timeout_ms=wait_timeout_ms)
        self._TwinClient, self._TwinNotRunning = TwinClient, TwinNotRunning
        self.dock = TwinDock(
            twin_backend(self.prefix, cached=False), self.prefix, self.config.ctrl_timeout_ms,
            link_errors=self._link_errors,
        )
        self.qualifier: DockQualifier | None = None
        self.usb: Any = None
        self.bridge: Bridge | None = None
        self.queue: CommandQueue | None = None
        self.copy: CopyProtocol | None = None
        self.tinygrad: Any = None  # TinygradDock when copy_protocol == "tinygrad"
        self._lock: DockLock | None = None
        self._where: tuple[int, int] | None = None
        self._bars: dict[int, tuple[int, int]] = {}
        self._inputs: tuple[TensorSpec, ...] = ()
        self._outputs: tuple[TensorSpec, ...] = ()
        self._buffers: dict[str, tuple[int, int]] = {}
        self._table = 0
        self.model_inputs: tuple[TensorSpec, ...] = ()  # the model's own inputs (= the inputs without a warp)
        self._model_buffers: dict[str, tuple[int, int]] = {}
        self._model_table = 0  # program 2's tensor table (0: no warp)
        self.copy_in_bytes = 0  # bytes the last run copied in
        self._heap_next = P.VRAM_HEAP_OFFSET  # first VRAM byte past the loaded model's buffers
        self._loaded = False
        self._failed: ChestnutError | None = None
        self.signature: dict[str, Any] = {}
        self.copy_timer = CopyTimer(wait_timeout_ms)  # the copy path's own timing, for the usb layer's health
        self.stages = StageClock()  # the last run's copy-in / compute / copy-out (s), for the stage budget

    # ------------------------------------------------------------------ evidence from the twin
    def _link_errors(self, dev: Any) -> int | None:
        try:
            with self._TwinClient(self.prefix) as c:
                infos = c.enumerate()
        except self._TwinNotRunning:
            return None
        return next((d.link_errors for d in infos if (d.bus, d.address) == (dev.bus, dev.address)), None)

    # ------------------------------------------------------------------ qualification
    def qualify(self, on_step: Callable[[LadderStep], None] | None = None) -> LadderReport:
        """The dock rungs (IDs, speed, stability, LTSSM with GPU reset, BARs + architecture); with
        ``lock_first``, ``usb_ids`` takes the dock's lock first."""
        self.qualifier = DockQualifier(self.dock, self.config, reset_gpu=self.reset_gpu, lock=self.lock_first)
        if self.lock_first:  # one held already is kept: a second open of the file would not get it
            self.qualifier.dock_lock = self._lock
        report = self.qualifier.run(on_step=on_step)
        if self.lock_first:
            self._lock = self.qualifier.dock_lock
        if report.passed:
            q = self.qualifier
            self._where = (q.dev.bus, q.dev.address)
            self._bars = dict(q.bars)
        return report

    def _ensure_qualified(self) -> None:
        if self._where is not None:
            return
        report = self.qualify()
        failure = report.first_failure
        if failure is not None:
            raise (
                failure.error
                if isinstance(failure.error, ChestnutError)
                else GpuLayerError("not_qualified", f"{failure.name}: {failure.detail}")
            )

    # ------------------------------------------------------------------ the data path
    def _open_data_path(self) -> None:
        """Lock, open the twin's USB3 face at the qualified address, attach the queue and the copy protocol."""
        if self.queue is not None:
            return
        from chestnut.backend.sim.usb3 import TwinUSB3

        assert self._where is not None
        bus, address = self._where
        if self._lock is None or self._lock.fd is None:  # lock_first: usb_ids took it already
            self._lock = DockLock(dock_lock_path(bus, address)).acquire(self.lock_timeout_s)
        listed = [d for vid, pid in P.USB_IDS for d, _ in TwinUSB3.list_devices(vid, pid, prefix=self.prefix)]
        dev = next((d for d in listed if (d.bus, d.address) == (bus, address)), None)
        if dev is None:
            seen = ", ".join(f"{d.bus}-{d.address}" for d in listed) or "nothing"
            raise UsbLayerError(
                "stale_device_list",
                f"the dock is at {bus}-{address} but this process's cached device "
                f"list shows {seen} (it re-enumerated); start a fresh process",
            )
        # transfers that are safe to repeat are retried within the frame deadline (backend/retry.py); VRAM (BAR0)
        # and the doorbells (BAR2) hold values, so writes there are among them
        # under it, every transfer is reported to the worker's progress supervision (backend/progress.py)
        self.usb = RetryingUSB3(ProgressUSB3(TwinUSB3(dev)), retry=RetryPolicy(gpu_wait_ms=self.wait_timeout_ms),
                                value_regions=[self._bars[i] for i in (0, 2) if i in self._bars])
        bridge = Bridge(
            self.usb,
            ctrl_timeout_ms=self.ctrl_timeout_ms,
            bulk_timeout_ms=self.wait_timeout_ms,
            tlp_timeout_ms=self.ctrl_timeout_ms,
        )
        bridge.bars = dict(self._bars)
        queue = CommandQueue(bridge, self.wait_timeout_ms)
        queue.attach()
        if self.copy_protocol == "tinygrad":
            from chestnut.backend.tinygrad_harness import TinygradDock

            self.tinygrad = TinygradDock(self.usb, self._bars, wait_timeout_ms=self.wait_timeout_ms)
        else:
            copy = CopyProtocol(bridge, queue, self.wait_timeout_ms)
            copy.attach()
            self.copy = copy
        self.bridge, self.queue = bridge, queue

    def _check_link(self) -> None:
        """tinygrad's copy path has no word for a dead link (its posted ring writes vanish and the drain spins
        10 s): one LTSSM read (XDATA 0xB450) before a frame's copies names the PCIe layer instead. Raises
        PcieLayerError ``link_down`` / ``ltssm_stuck``."""
        assert self.bridge is not None
        ltssm = self.bridge.ltssm(LINK_CHECK_TIMEOUT_MS)
        if ltssm != P.LTSSM_L0:
            raise PcieLayerError(
                "ltssm_stuck" if ltssm == P.LTSSM_STUCK else "link_down",
                f"PCIe link not up (LTSSM=0x{ltssm:02X}) before the frame's copies",
            )

    def scratch_offset(self, nbytes: int) -> int:
        """A VRAM offset where ``nbytes`` may be copied in and out without touching anything the runner uses:
        the first free byte past the loaded model's buffers (``VRAM_HEAP_OFFSET`` before a load), below the
        end of BAR0. The reserved VRAM below ``VRAM_HEAP_OFFSET`` holds the program ring, the SDMA ring
        (``SDMA_RING_VRAM_OFFSET``), its pointers and the timeline signal (``backend/protocol.py``): a copy
        there overwrites the packets tinygrad's ``_copyin`` queued for its own chunks. Opens the data path;
        raises GpuLayerError ``vram_full`` when ``nbytes`` does not fit."""
        self._open_data_path()
        return VramHeap(self._heap_next, self._bars.get(0, (0, P.BAR0_VRAM_BYTES_DEFAULT))[1]).alloc(nbytes)

    @staticmethod
    def _check_vram_range(what: str, off: int, nbytes: int) -> None:
        """Refuse a copy into or out of the reserved VRAM (rings, pointers, signals; ``backend/protocol.py``
        ``VRAM_HEAP_OFFSET``). Raises ValueError naming the range."""
        if off < P.VRAM_HEAP_OFFSET:
            raise ValueError(
                f"{what} of {nbytes} bytes at VRAM {off:#x}: VRAM below {P.VRAM_HEAP_OFFSET:#x} holds "
                f"the rings and signals; use TwinRunner.scratch_offset(nbytes)"
            )

    def _copy_in(self, dst: int, data: bytes | memoryview) -> None:
        self._check_vram_range("copy-in", dst, len(memoryview(data).cast("B")))
        t0 = time.perf_counter()
        if self.tinygrad is not None:
            self.tinygrad.copy_in(dst, data)
        else:
            assert self.copy is not None
            self.copy.copy_in(dst, data)
        self.copy_timer.copy("in", len(memoryview(data).cast("B")), time.perf_counter() - t0)

    def _copy_out(self, src: int, nbytes: int) -> bytes | memoryview:
        self._check_vram_range("copy-out", src, nbytes)
        t0 = time.perf_counter()
        if self.tinygrad is not None:
            out: bytes | memoryview = self.tinygrad.copy_out(src, nbytes)
        else:
            assert self.copy is not None
            out = self.copy.copy_out(src, nbytes)
        self.copy_timer.copy("out", nbytes, time.perf_counter() - t0)
        return out

    def _guard(self, fn: Any) -> Any:
        """Run ``fn()``; a dock-layer error becomes sticky, anything untyped is classified first."""
        if self._failed is not None:
            raise type(self._failed)(
                self._failed.reason,
                f"the dock failed earlier in this runner; qualify it again "
                f"from a fresh process ({self._failed.detail})",
            )
        try:
            return fn()
        except ChestnutError as e:
            err = blame_slow_link(e, self._speed_mbps())
            if err.layer is not None:
                self._failed = err
            if err is e:
                raise
            raise err from e
        except Exception as e:
            err = blame_slow_link(classify(e), self._speed_mbps())
            if err.layer is not None:
                self._failed = err
            raise err from e

    def _speed_mbps(self) -> int | None:
        """The link speed (Mbps) the qualifier found, or None before it enumerated the dock: on a link below
        SuperSpeed a GPU timeout is the usb layer's (:func:`chestnut.backend.classify.blame_slow_link`)."""
        dev = self.qualifier.dev if self.qualifier is not None else None
        return self.dock.speed_mbps(dev) if dev is not None else None

    # ------------------------------------------------------------------ model
    def load(self, model: ModelSpec) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        """Upload ``model``'s ONNX bytes through the copy protocol, compile it on the twin (``OP_LOAD``) and
        place its buffers. Returns (input specs, output specs). Raises ModelError or a layer error."""
        path = Path(model.path)
        if not path.is_file():
            raise ModelError("missing_model", f"model file {path} does not exist")
        onnx_bytes = path.read_bytes()
        image = onnx_bytes if model.warp is None else warp_program(model.warp, onnx_bytes)
        label = model_label(model.name, path)  # what a refusal names: the file, not the name it runs under

        def do() -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
            self._ensure_qualified()
            self._open_data_path()
            assert self.queue is not None
            heap = VramHeap(P.VRAM_HEAP_OFFSET, self._bars.get(0, (0, P.BAR0_VRAM_BYTES_DEFAULT))[1])
            image_off = heap.alloc(len(image))
            sig_off = heap.alloc(SIGNATURE_MAX_BYTES)
            self._copy_in(image_off, image)
            sha = hashlib.sha256(onnx_bytes).hexdigest()
            sig = self._load_program(label, PROGRAM_ID, image_off, len(image), sig_off)
            if sig.get("sha256") != sha:
                raise GpuLayerError("signature_mismatch", f"the GPU compiled {sig.get('sha256')!r}, the file is {sha}")
            want_warp = None if model.warp is None else model.warp.to_json()
            if sig.get("warp") != want_warp:
                raise GpuLayerError(
                    "signature_mismatch", f"the GPU's program warps {sig.get('warp')!r}, not {want_warp!r}"
                )
            self.signature = sig
            ins = tuple(TensorSpec.from_json(d) for d in sig["inputs"])
            outs = tuple(TensorSpec.from_json(d) for d in sig["outputs"])
            model_ins = tuple(TensorSpec.from_json(d) for d in sig.get("model_inputs", sig["inputs"]))
            for s in model_ins:
                want = model.input_shapes.get(s.name)
                if want is not None and tuple(want) != s.shape:
                    raise ModelError(
                        "bad_input_shape",
                        f"{label}: input {s.name!r} is {list(s.shape)} on the "
                        f"dock, the model spec asks for {list(want)}",
                    )
            self._buffers = {s.name: (heap.alloc(s.nbytes), s.nbytes) for s in (*ins, *outs)}
            self._table = self._place_table(heap, [self._buffers[s.name] for s in (*ins, *outs)], len(ins), len(outs))
            self._model_buffers, self._model_table = {}, 0
            if model.warp is not None:  # program 2: the ONNX bytes inside the image, no second copy
                onnx_off = image_off + len(image) - len(onnx_bytes)
                sig2 = self._load_program(label, MODEL_PROGRAM_ID, onnx_off, len(onnx_bytes), sig_off)
                if sig2.get("sha256") != sha or "warp" in sig2:
                    raise GpuLayerError("signature_mismatch", f"the GPU's model program is {sig2.get('sha256')!r}")
                self._model_buffers = {s.name: (heap.alloc(s.nbytes), s.nbytes) for s in model_ins}
                places = [self._model_buffers[s.name] for s in model_ins] + [self._buffers[s.name] for s in outs]
                self._model_table = self._place_table(heap, places, len(model_ins), len(outs))
            self._heap_next = heap.next
            self._inputs, self._outputs, self.model_inputs, self._loaded = ins, outs, model_ins, True
            return ins, outs

        return self._guard(do)

    def _load_program(self, name: str, program_id: int, off: int, nbytes: int, sig_off: int) -> dict[str, Any]:
        """``OP_LOAD`` of the program image at VRAM ``off``; its signature. ModelError when it does not compile."""
        assert self.queue is not None
        (seq,) = self.queue.submit([Packet(P.OP_LOAD, (program_id, *lo_hi(off), nbytes, *lo_hi(sig_off)))])
        try:
            self.queue.wait(seq, f"OP_LOAD of {name}", self.load_timeout_ms)
        except ModelError as e:
            raise ModelError(e.reason, f"{e.detail}: {self._read_signature(sig_off).get('error', '')}") from e
        return self._read_signature(sig_off)

    def _place_table(self, heap: VramHeap, places: list[tuple[int, int]], n_in: int, n_out: int) -> int:
        """``OP_RUN``'s tensor table (u32 n_in, n_out; u64 offset, nbytes per tensor) copied into VRAM; its offset."""
        table = struct.pack("<II", n_in, n_out) + b"".join(struct.pack("<QQ", *p) for p in places)
        off = heap.alloc(len(table))
        self._copy_in(off, table)
        return off

    def _read_signature(self, sig_off: int) -> dict[str, Any]:
        n = struct.unpack("<I", self._copy_out(sig_off, 4))[0]
        if not 0 < n <= SIGNATURE_MAX_BYTES - 4:
            raise GpuLayerError("bad_signature", f"signature length {n} at VRAM {sig_off:#x}")
        try:
            doc = json.loads(bytes(self._copy_out(sig_off + 4, n)))
        except ValueError as e:
            raise GpuLayerError("bad_signature", f"the signature is not JSON: {e}") from e
        return doc if isinstance(doc, dict) else {}

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One inference: inputs copied in, ``OP_RUN``, outputs copied out. ModelError for bad inputs.

        Sets ``stages.last`` (:class:`~chestnut.backend.stages.StageTimes`, s) for a run that returns:
        ``copy_in`` is every input's copy (tinygrad 0.14 ``AMDAllocator._copyin`` with its SDMA drain, or
        :class:`~chestnut.backend.copy.CopyProtocol`), not the LTSSM read before them; ``compute`` is
        ``OP_RUN``'s submission (ring write and doorbell) to its fence (the queue's completion wait);
        ``copy_out`` every output's copy (``AMDAllocator._copyout``) and its copy into a host array."""
        self.stages.begin()
        if not self._loaded:
            raise ModelError("not_loaded", "no model is loaded")
        specs, buffers, program, table = self._inputs, self._buffers, PROGRAM_ID, self._table
        if self._model_table and inputs_match(self.model_inputs, inputs):  # a warped program's model, unwarped
            specs, buffers, program, table = self.model_inputs, self._model_buffers, MODEL_PROGRAM_ID, self._model_table
        check_inputs(specs, inputs)
        clock = self.stages.now

        def do() -> dict[str, np.ndarray]:
            assert self.queue is not None
            if self.tinygrad is not None:
                self._check_link()
            t0 = clock()
            self.copy_in_bytes = 0
            for s in specs:
                self._copy_in(buffers[s.name][0], np.ascontiguousarray(inputs[s.name]).data)
                self.copy_in_bytes += s.nbytes
            t1 = clock()
            self.stages.add("copy_in", t1 - t0)
            (seq,) = self.queue.submit([Packet(P.OP_RUN, (program, *lo_hi(table)))])
            t2 = clock()
            self.queue.wait(seq, "OP_RUN")
            t3 = clock()
            self.copy_timer.fence(t3 - t2)
            self.stages.add("compute", t3 - t1)
            out = {}
            for s in self._outputs:
                off, nbytes = self._buffers[s.name]
                out[s.name] = np.frombuffer(self._copy_out(off, nbytes), dtype=s.dtype).reshape(s.shape).copy()
            self.stages.add("copy_out", clock() - t3)
            return out

        out = self._guard(do)
        self.stages.end()
        return out

    # ------------------------------------------------------------------ health
    def probe(self) -> DockObservation:
        """Cheap per-layer evidence through the pyusb face (fresh enumeration): presence, IDs, address,
        speed, link errors, LTSSM and the copy-in fence. Never raises: failures land in ``extra``."""
        obs = self.dock.observe(read_fence=True)
        if self._failed is not None:
            obs.extra["failed"] = str(self._failed)
        if isinstance(self.usb, RetryingUSB3):
            obs.extra[STATS_KEY] = self.usb.stats()
        obs.extra[COPY_STATS_KEY] = self.copy_timer.stats()
        return obs

    def close(self) -> None:
        """Close the USB3 face (releases the interface) and the lock. Idempotent; never raises."""
        if self.usb is not None:
            try:
                self.usb.close()
            except Exception:  # the dock may be gone; closing must not fail
                pass
            self.usb = None
        self.bridge = self.queue = self.copy = self.tinygrad = None
        if self.qualifier is not None:
            self.qualifier.release()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self._loaded = False

    def __enter__(self) -> TwinRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
