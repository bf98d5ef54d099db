"""The Chestnut twin: the dock's state at the USB boundary, as one thread-safe object.

A :class:`Twin` is what a host sees through libusb when a Chestnut dock is plugged in (``docs/protocol.md``,
tinygrad 0.14 ``usb.py`` / ``system.py``), plus the knobs to break it (:mod:`.faults`):

USB
    Presence, bus number and device address (a re-enumeration gives a new address; a handle opened
    on an older enumeration gets ``LIBUSB_ERROR_NO_DEVICE``), speed (5000 Mbps, 480 after a USB 2
    fallback), descriptors (:mod:`.descriptors`), a link-error counter, one claimable interface,
    bulk OUT ``0x02`` and bulk IN ``0x81`` (halts persist until CLEAR_FEATURE or SET_CONFIGURATION).
    Standard requests (GET_DESCRIPTOR, GET/SET_CONFIGURATION, SET_INTERFACE, GET_STATUS,
    CLEAR/SET_FEATURE) are answered by the USB core; vendor requests by the bridge firmware.

Bridge (vendor requests, bmRequestType 0x40 out / 0xC0 in, exactly as ``CustomASM24Controller``)
    ``0xE4`` IN: read ``wLength`` (1..255) bytes of XDATA at ``wValue``.
    ``0xE5`` OUT: write the byte ``wIndex`` (<= 0xFF) to XDATA ``wValue``; no data stage.
    ``0xF3`` OUT: PCIe power, ``wValue`` 1 on / 0 off. Power-on trains the link, taking
    ``training_delay_s``; the request completes when training is over. LTSSM (XDATA ``0xB450``)
    reads 0x00 unpowered, :data:`LTSSM_TRAINING` while training, 0x78 (L0) once up. Power-off
    resets the GPU (VRAM, config space, engine).
    ``0xF0`` OUT: a TLP; ``wValue = fmt_type | byte_enable << 8``, ``wIndex`` = mode, 12 data bytes
    ``<III`` (address low, address high, value or dword count). Mode 0 issues one TLP; non-posted
    ones (config read/write, memory read) latch an 8-byte completion for ``0xF0`` IN: ``<I`` data,
    byte 4 = completion status << 5 (``CPL_*``), byte 7 = return status (0 ok,
    :data:`RET_NO_COMPLETION` when no completion came back: link not up, or nothing issued).
    Mode 1: the next bulk OUT transfers (``count*4`` bytes in total) are written from the address;
    mode 2: the next bulk IN transfers read ``count*4`` bytes from the address.
    ``0xF2`` OUT: the SRAM engine. ``wValue`` = 512-byte sectors, ``wIndex = slot | nslots << 8``
    (16 KiB slots, ``nslots == ceil(sectors*512 / 0x4000)``); the next bulk OUT transfers fill SRAM from
    ``slot*0x4000``. With ``wValue | 0x8000`` the next bulk IN transfers read it instead.
    XDATA: 64 KiB. The system page (0xA000, 4 KiB, copy-in fence at 0xA800) and the completion page
    (0xB800, 4 KiB) are what the GPU sees at 0x820000 / 0x822000; XDATA 0xF000.. is a window on SRAM,
    which the GPU sees at 0x200000 (512 KiB, two 256 KiB halves).

PCIe and GPU
    :mod:`.pcie` (bridges on buses 0-3, the GPU on bus 4, BARs, Resizable BAR, routing) and
    :mod:`.engine` (sparse VRAM behind BAR0, the doorbell in BAR2, the command-packet engine).

Malformed requests -- unknown requests, wrong direction, bad lengths, out-of-range addresses or
slots, a bulk OUT nobody armed -- get a STALL (``LIBUSB_ERROR_PIPE``; a bulk endpoint stays halted),
never an exception inside the twin. A bulk IN nobody armed NAKs until its timeout, as hardware does.

Thread safety: every method may be called from any thread; state changes happen under one lock
(:attr:`lock`), waits (training, NAKs, the timing model) happen outside it. ``cancel`` callables let a
daemon abandon the wait of a client that went away.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chestnut.backend import protocol as P
from chestnut.backend.docklock import dock_lock_path, open_dock_lock, try_flock
from chestnut.backend.errors import UsbLayerError
from chestnut.backend.sim import descriptors as D
from chestnut.backend.sim.compute import DEFAULT_BRIDGE_PRIORITY
from chestnut.backend.sim.compute import DEFAULT_PRIORITY as DEFAULT_COMPUTE_PRIORITY
from chestnut.backend.sim.engine import Engine
from chestnut.backend.sim.faults import (
    KINDS,
    PHASE_TRANSITIONS,
    FaultSpec,
    FaultTable,
    Phase,
    PhaseEvent,
    TransferSite,
    describe_site,
)
from chestnut.backend.sim.libusb_codes import (
    LIBUSB_ERROR_BUSY,
    LIBUSB_ERROR_INTERRUPTED,
    LIBUSB_ERROR_INVALID_PARAM,
    LIBUSB_ERROR_IO,
    LIBUSB_ERROR_NO_DEVICE,
    LIBUSB_ERROR_NOT_FOUND,
    LIBUSB_ERROR_PIPE,
    LIBUSB_ERROR_TIMEOUT,
    UsbError,
)
from chestnut.backend.sim.memory import SparseMemory
from chestnut.backend.sim.pcie import Fabric
from chestnut.backend.sim.sdma import SdmaEngine

log = logging.getLogger(__name__)

LTSSM_TRAINING = 0x10          # the twin's value while the link trains (between 0x00 and 0x78)
RET_NO_COMPLETION = 0x01       # 0xF0 IN byte 7: the bridge got no completion (tinygrad retries on != 0)
USB2_CONTROL_READ_MAX = 64     # vendor control reads above this time out on a USB 2 link (the fault's symptom)
USB2_BULK_OUT_KEEP = 32768     # bytes of a bulk OUT that reach the device on a USB 2 link (default)
MAX_STREAM_BYTES = 64 << 20    # largest 0xF0 streaming transfer the twin accepts
NAK_POLL_S = 0.05              # how often a NAK wait looks for cancellation / device loss
SHORT_SLEEP_S = 0.005          # timing-model waits shorter than this use time.sleep
STANDARD, VENDOR = 0, 2
XDATA_SYS_END = P.XDATA_SYS_PAGE + 0x1000
XDATA_CPL_END = P.XDATA_CPL_PAGE + 0x1000
RECEIPT_RANGES = ((P.XDATA_COPYIN_FENCE, P.XDATA_COPYIN_FENCE + 4), (P.XDATA_CPL_PAGE, XDATA_CPL_END))


@dataclass
class TwinConfig:
    """How the twin is built. ``bus``/``first_address`` name the first enumeration; ``training_delay_s``
    is how long PCIe link training takes after ``0xF3`` power-on; ``link_mbps``/``latency_us`` switch on
    the timing model (each transfer takes ``latency_us + bytes*8/link_mbps`` microseconds);
    ``program_engine`` is how the GPU engine executes loaded programs (``compute.compile_program``);
    ``compute_priority`` is the ``SCHED_RR`` priority of a RUN in the engine's compute process (0: normal
    scheduling; below the node's realtime priority, :mod:`.compute`); ``bridge_priority`` that of the daemon's
    threads, which answer USB (``chestnut twin serve`` only; :mod:`.daemon`)."""

    bus: int = 2
    first_address: int = 5
    training_delay_s: float = 0.02
    link_mbps: float | None = None
    latency_us: float = 0.0
    identity: D.Identity = field(default_factory=D.Identity)
    program_engine: str = "tinygrad"  # how the GPU engine executes programs: tinygrad | onnxruntime
    compute_priority: int = DEFAULT_COMPUTE_PRIORITY
    bridge_priority: int = DEFAULT_BRIDGE_PRIORITY


@dataclass(frozen=True)
class DeviceInfo:
    """One entry of a fresh device list: what ``libusb_get_device_list`` + descriptors would show."""

    bus: int
    address: int
    generation: int
    vid: int
    pid: int
    speed_mbps: int
    link_errors: int
    device_descriptor: bytes
    config_descriptor: bytes

    def to_json(self) -> dict[str, Any]:
        return {"bus": self.bus, "address": self.address, "generation": self.generation, "vid": self.vid,
                "pid": self.pid, "speed_mbps": self.speed_mbps, "link_errors": self.link_errors,
                "device_descriptor": self.device_descriptor.hex(), "config_descriptor": self.config_descriptor.hex()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DeviceInfo:
        return cls(int(d["bus"]), int(d["address"]), int(d["generation"]), int(d["vid"]), int(d["pid"]),
                   int(d["speed_mbps"]), int(d["link_errors"]), bytes.fromhex(d["device_descriptor"]),
                   bytes.fromhex(d["config_descriptor"]))


@dataclass
class _Handle:
    id: int
    generation: int
    claimed: set[int] = field(default_factory=set)


@dataclass
class _Stream:
    """An armed bulk stream: ``kind`` "sram" (0xF2) or "mem" (0xF0 mode 1/2), ``total`` bytes from ``base``."""

    kind: str
    base: int
    total: int
    pos: int = 0

    @property
    def remaining(self) -> int:
        return self.total - self.pos


@dataclass
class _Gate:
    """What the USB-level faults decided for one transfer."""

    nak: bool = False
    short_to: int | None = None
    keep: int | None = None     # usb2: bytes of a bulk OUT that reach the device


class Twin:
    """The dock. See the module docstring for the protocol; :class:`UsbError` is raised for failed transfers."""

    def __init__(self, config: TwinConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or TwinConfig()
        self.clock = clock
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self.faults = FaultTable()
        self.phase = Phase.IDLE
        self.ident = self.config.identity
        # USB
        self.present = True
        self.bus = self.config.bus
        self.address = self.config.first_address
        self.generation = 1
        self.link_errors = 0
        self.configuration = P.USB_CONFIGURATION
        self.halted: set[int] = set()
        self._handles: dict[int, _Handle] = {}
        self._next_handle = 1
        self._claimed_by: dict[int, int] = {}   # interface -> handle id
        self._replug_timer: threading.Timer | None = None
        # bridge
        self.xdata = bytearray(P.XDATA_SIZE)
        self.sram = bytearray(P.SRAM_SIZE)
        self.pcie_power = False
        self._link = "off"            # off | l0 | stuck | down
        self._train_end_s = 0.0
        self._cpl: tuple[int, int, int] | None = None
        self._out: _Stream | None = None
        self._in: _Stream | None = None
        self.wedged = False
        self._fence_moved = False
        # PCIe + GPU
        self.fabric = Fabric()
        self.vram = SparseMemory(P.BAR0_VRAM_BYTES)
        self.doorbells: dict[int, int] = {}
        self.mmio: dict[int, int] = {}
        self.engine = Engine(self)
        self.sdma = SdmaEngine(self)
        self._cq_writes = 0           # GPU writes to the completion page (cq_buf) since power-on
        self._cq_writes_at_arm = 0    # ... when the current SRAM read was armed
        # the lock-file fault
        self._lock_fd: int | None = None
        self._lock_path: str | None = None
        self._closed = False
        self._housekeeper = threading.Thread(target=self._housekeeping, name="twin-housekeeping", daemon=True)
        self._housekeeper.start()

    # ------------------------------------------------------------------ life
    def can_work(self) -> bool:
        """Whether no fault state stops the dock from working: present, the bridge not wedged, PCIe powered with its
        link not failed, and neither engine hung (``gpu_hang``), stalled by an error or dropping its fences
        (``fence_stall``). Read without the lock (a sample for ``hostwait.py``: a host that holds off a twin able to
        work is late; a hung GPU or a dead link waits for nothing, so a late host must not excuse their misses)."""
        e, d = self.engine, self.sdma
        return (self.present and not self.wedged and self.pcie_power and self._link == "l0" and not e.hung
                and not d.hung and d.stalled is None and not d.fence_stalled)

    def close(self) -> None:
        """Stop the engine and housekeeping threads and release the lock file. Idempotent."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            if self._replug_timer is not None:
                self._replug_timer.cancel()
            self._release_lock_file()
            self.cv.notify_all()
        self.engine.stop()
        self.sdma.stop()
        self._housekeeper.join(timeout=1)

    def _housekeeping(self) -> None:
        while True:
            with self.lock:
                if self._closed:
                    return
                self.faults.prune(self.clock())
                self._sync_lock_file()
                self.cv.wait(0.1)

    def now(self) -> float:
        return self.clock()

    @property
    def program_engine(self) -> str:
        """How the GPU engine executes loaded programs (``TwinConfig.program_engine``)."""
        return self.config.program_engine

    @property
    def compute_priority(self) -> int:
        """``SCHED_RR`` priority of a RUN in the compute process (``TwinConfig.compute_priority``)."""
        return self.config.compute_priority

    # ------------------------------------------------------------------ phase + faults
    def phase_event(self, event: PhaseEvent) -> None:
        """Advance the inferred phase (:data:`.faults.PHASE_TRANSITIONS`). Caller holds the lock."""
        new = PHASE_TRANSITIONS[(self.phase, event)]
        if new is not self.phase:
            log.info("phase %s -> %s (%s)", self.phase.value, new.value, event.value)
            self.phase = new

    def fire(self, kind: str, site: TransferSite | None = None) -> Any:
        """One opportunity for faults of ``kind``; returns the fault that fires (and marks the phase). Lock held."""
        f = self.faults.check(kind, self.clock(), self.phase, site)
        if f is not None:
            hit = "" if site is None else f" on {describe_site(kind, site, f.opportunities)}"
            log.info("fault %d %s fired%s", f.id, kind, hit)
            if KINDS[kind].recovers:
                self.phase_event(PhaseEvent.FAULT)
        return f

    def inject(self, spec: FaultSpec) -> dict[str, Any]:
        """Add a fault; returns its status entry. Raises ``ValueError`` for a bad spec."""
        with self.lock:
            f = self.faults.add(spec.validate(), self.clock())
            log.info("fault %d injected: %s", f.id, f.spec.describe())
            self._sync_lock_file()
            self.cv.notify_all()
            return f.to_json(self.clock())

    def clear(self, fault_id: int | None = None) -> int:
        """Remove one fault or all; returns how many were removed. Latched states stay (see faults.py)."""
        with self.lock:
            n = len(self.faults.clear(fault_id, self.clock()))
            self._sync_lock_file()
            self.cv.notify_all()
            return n

    def set_phase(self, phase: str) -> None:
        """Override the inferred phase (e.g. a harness that knows it is recovering). Raises ValueError."""
        with self.lock:
            self.phase = Phase(phase)

    def _usb2(self) -> Any:
        return self.faults.active("usb2", self.clock(), self.phase)

    @property
    def speed_mbps(self) -> int:
        with self.lock:
            return P.HIGHSPEED_MBPS if self._usb2() is not None else P.SUPERSPEED_MBPS

    # ------------------------------------------------------------------ the lock-file fault
    def _sync_lock_file(self) -> None:
        want = self.faults.active("lock_held", self.clock(), self.phase) is not None and not self._closed
        path = str(dock_lock_path(self.bus, self.address)) if want else None
        if path == self._lock_path:
            return
        self._release_lock_file()
        if path is None:
            return
        try:  # the project's one way to open the lock file (backend/docklock.py)
            fd = open_dock_lock(path)
        except UsbLayerError as e:
            log.warning("lock_held: %s", e.detail)
            return
        if not try_flock(fd):
            log.warning("lock_held: %s is already locked by another process", path)
            os.close(fd)
            return
        self._lock_fd, self._lock_path = fd, path
        log.info("lock_held: holding %s", path)

    def _release_lock_file(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        self._lock_fd, self._lock_path = None, None

    # ------------------------------------------------------------------ enumeration and power events
    def _info(self) -> DeviceInfo:
        speed = P.HIGHSPEED_MBPS if self._usb2() is not None else P.SUPERSPEED_MBPS
        return DeviceInfo(self.bus, self.address, self.generation, self.ident.vid, self.ident.pid, speed,
                          self.link_errors, D.device_descriptor(self.ident, speed), D.config_descriptor(speed))

    def enumerate(self) -> list[DeviceInfo]:
        """What a fresh libusb device list sees now: the dock if present, else nothing."""
        with self.lock:
            return [self._info()] if self.present else []

    def _next_address(self) -> int:
        return self.address % 127 + 1 if self.address < 127 else 2

    def _bus_reset_locked(self) -> None:
        """USB bus reset (new enumeration): endpoint halts and claims go, configuration 1 is set again."""
        self.halted.clear()
        self._claimed_by.clear()
        self.configuration = P.USB_CONFIGURATION

    def _enumerate_locked(self, reason: str) -> None:
        if self._replug_timer is not None:
            self._replug_timer.cancel()
            self._replug_timer = None
        self.address = self._next_address()
        self.generation += 1
        self.present = True
        self._bus_reset_locked()
        self.phase_event(PhaseEvent.FAULT)
        self._sync_lock_file()
        self.cv.notify_all()
        log.info("enumerated at %d-%d (generation %d): %s", self.bus, self.address, self.generation, reason)

    def _unplug_locked(self, reason: str) -> None:
        if self.present:
            self.present = False
            self.generation += 1   # every open handle is now stale
            self.phase_event(PhaseEvent.FAULT)
            self._sync_lock_file()
            self.cv.notify_all()
            log.info("unplugged: %s", reason)

    def _power_reset_locked(self) -> None:
        """The dock lost power: the bridge firmware restarts (PCIe off, XDATA/SRAM cleared), the GPU resets."""
        self.xdata[:] = bytes(P.XDATA_SIZE)
        self.sram[:] = bytes(P.SRAM_SIZE)
        self._cpl, self._out, self._in = None, None, None
        self.wedged = False
        self._fence_moved = False
        self.pcie_power, self._link = False, "off"
        self._gpu_reset_locked()

    def _gpu_reset_locked(self) -> None:
        self.fabric = Fabric()
        self.vram.clear()
        self.doorbells.clear()
        self.mmio.clear()
        self.engine.reset()
        self.sdma.reset()
        self.cv.notify_all()

    def _schedule_replug(self, off_s: float, reason: str) -> None:
        def replug() -> None:
            with self.lock:
                self._replug_timer = None
                if not self.present and not self._closed:
                    self._enumerate_locked(reason)

        if self._replug_timer is not None:
            self._replug_timer.cancel()
        if off_s <= 0:
            self._enumerate_locked(reason)
            return
        self._replug_timer = threading.Timer(off_s, replug)
        self._replug_timer.daemon = True
        self._replug_timer.start()

    def plug(self) -> DeviceInfo | None:
        """Plug the dock in (no-op if present): it enumerates at a new address. Returns its entry."""
        with self.lock:
            if not self.present:
                self._enumerate_locked("plug")
            return self._info()

    def unplug(self) -> None:
        """Pull the cable: gone for everyone; open handles get NO_DEVICE. The self-powered dock keeps its state."""
        with self.lock:
            if self._replug_timer is not None:
                self._replug_timer.cancel()
                self._replug_timer = None
            self._unplug_locked("unplug")

    def power_cycle(self, off_s: float = 0.0) -> None:
        """Switch the dock off and on: gone, every state reset (wedge, VRAM, programs), back after ``off_s``
        at a new address with PCIe powered off."""
        with self.lock:
            self._unplug_locked("power-cycle")
            self._power_reset_locked()
            self._schedule_replug(off_s, "power-cycle")

    def _brownout_locked(self, off_s: float) -> None:
        self._unplug_locked("brown-out")
        self._power_reset_locked()
        self._schedule_replug(off_s, "back from brown-out")

    # ------------------------------------------------------------------ handles
    def open(self, bus: int, address: int) -> int:
        """Open the device at ``bus``/``address``; returns a handle id. Raises UsbError(NO_DEVICE)."""
        with self.lock:
            if not self.present or (bus, address) != (self.bus, self.address):
                raise UsbError(LIBUSB_ERROR_NO_DEVICE, f"no device at {bus}-{address}")
            h = _Handle(self._next_handle, self.generation)
            self._next_handle += 1
            self._handles[h.id] = h
            return h.id

    def close_handle(self, handle: int) -> None:
        """Close a handle, releasing its interface claims. Unknown handles are ignored."""
        with self.lock:
            h = self._handles.pop(handle, None)
            if h is not None:
                for intf in h.claimed:
                    if self._claimed_by.get(intf) == h.id:
                        del self._claimed_by[intf]

    def _handle(self, handle: int) -> _Handle:
        h = self._handles.get(handle)
        if h is None:
            raise UsbError(LIBUSB_ERROR_INVALID_PARAM, f"handle {handle} is not open")
        if not self.present or h.generation != self.generation:
            raise UsbError(LIBUSB_ERROR_NO_DEVICE, "the device was disconnected or re-enumerated")
        return h

    def _alive(self, h: _Handle) -> bool:
        return self.present and h.generation == self.generation and not self._closed

    def claim_interface(self, handle: int, intf: int) -> None:
        """Claim interface ``intf`` (0 only). Raises BUSY if another handle holds it, NOT_FOUND for others."""
        with self.lock:
            h = self._handle(handle)
            if intf != P.USB_INTERFACE:
                raise UsbError(LIBUSB_ERROR_NOT_FOUND, f"no interface {intf}")
            owner = self._claimed_by.get(intf)
            if owner is not None and owner != h.id:
                raise UsbError(LIBUSB_ERROR_BUSY, f"interface {intf} is claimed by another handle")
            self._claimed_by[intf] = h.id
            h.claimed.add(intf)

    def release_interface(self, handle: int, intf: int) -> None:
        with self.lock:
            h = self._handle(handle)
            if self._claimed_by.get(intf) != h.id:
                raise UsbError(LIBUSB_ERROR_NOT_FOUND, f"interface {intf} is not claimed by this handle")
            del self._claimed_by[intf]
            h.claimed.discard(intf)

    def clear_halt(self, handle: int, endpoint: int) -> None:
        """CLEAR_FEATURE(ENDPOINT_HALT) on ``endpoint``."""
        self.ctrl_transfer(handle, 0x02, 0x01, 0, endpoint, b"", 1000)

    # ------------------------------------------------------------------ waits
    def _wait(self, h: _Handle, duration_s: float, cancel: Callable[[], bool] | None) -> None:
        """Sleep ``duration_s`` (inf = forever) outside the lock; raises NO_DEVICE if the device goes away
        meanwhile and INTERRUPTED if ``cancel()`` turns true."""
        deadline = self.clock() + duration_s
        with self.lock:
            while True:
                if not self._alive(h):
                    raise UsbError(LIBUSB_ERROR_NO_DEVICE, "the device went away during the transfer")
                if cancel is not None and cancel():
                    raise UsbError(LIBUSB_ERROR_INTERRUPTED, "the client went away")
                left = deadline - self.clock()
                if left <= 0:
                    return
                self.cv.wait(min(left, NAK_POLL_S))

    def _nak(self, h: _Handle, timeout_ms: int, cancel: Callable[[], bool] | None, why: str) -> UsbError:
        """The device NAKs: wait for the transfer's timeout (0 = libusb's 'forever'), then time out."""
        self._wait(h, timeout_ms / 1000 if timeout_ms > 0 else float("inf"), cancel)
        return UsbError(LIBUSB_ERROR_TIMEOUT, why)

    def _link_time_s(self, nbytes: int) -> float:
        mbps = self.config.link_mbps
        if mbps is None and not self.config.latency_us:
            return 0.0
        if mbps is not None and self._usb2() is not None:
            mbps = min(mbps, P.HIGHSPEED_MBPS)
        return self.config.latency_us * 1e-6 + (nbytes * 8 / (mbps * 1e6) if mbps else 0.0)

    def timing(self) -> dict[str, float] | None:
        """The timing model as a host sees it now (``link_mbps``, ``latency_us``), None when it is off."""
        mbps = self.config.link_mbps
        if mbps is None and not self.config.latency_us:
            return None
        if mbps is not None and self._usb2() is not None:
            mbps = min(mbps, P.HIGHSPEED_MBPS)
        return {"link_mbps": mbps or 0.0, "latency_us": self.config.latency_us}

    def _finish(self, h: _Handle, nbytes: int, timeout_ms: int, cancel: Callable[[], bool] | None,
                extra_s: float = 0.0, start_s: float | None = None, is_async: bool = False) -> None:
        """Apply the timing model (and any device-side delay) to a completed transfer that began at ``start_s``:
        it returns ``link time + extra_s`` after its start, not after the twin's own processing. An async
        transfer gets only ``extra_s`` here: its link time is the host's to schedule, since async transfers on
        different pipes overlap (:class:`~chestnut.backend.sim.usb3.TwinUSB3` does it with :meth:`timing`)."""
        duration = (0.0 if is_async else self._link_time_s(nbytes)) + extra_s
        if duration <= 0:
            return
        if timeout_ms > 0 and duration > timeout_ms / 1000:
            self._wait(h, timeout_ms / 1000, cancel)
            raise UsbError(LIBUSB_ERROR_TIMEOUT, "the transfer took longer than its timeout")
        left = duration - (self.clock() - start_s if start_s is not None else 0.0)
        if left <= 0:
            return
        if left < SHORT_SLEEP_S:
            time.sleep(left)  # link-time scale: a plain sleep is more precise than a condition wait
            if not self._alive(h):
                raise UsbError(LIBUSB_ERROR_NO_DEVICE, "the device went away during the transfer")
            return
        self._wait(h, left, cancel)

    # ------------------------------------------------------------------ USB-level faults
    def _gate(self, h: _Handle, site: TransferSite, nbytes: int) -> _Gate:
        """Decide the USB-level faults for one transfer. Lock held. Raises for faults that end it at once."""
        self.faults.prune(self.clock())
        gate = _Gate()
        if self.fire("disconnect", site):
            self._unplug_locked("disconnect fault")
            raise UsbError(LIBUSB_ERROR_NO_DEVICE, "disconnect fault")
        if self.fire("reenumerate", site):
            self._enumerate_locked("reenumerate fault")
            raise UsbError(LIBUSB_ERROR_NO_DEVICE, "re-enumerated at a new address")
        f = self.fire("brownout", site)
        if f:
            self._brownout_locked(f.spec.off_s)
            raise UsbError(LIBUSB_ERROR_NO_DEVICE, "brown-out")
        if site.vendor:
            if not self.wedged and self.fire("wedged", site):
                self.wedged = True
                log.info("bridge wedged")
            if self.wedged:
                gate.nak = True
                return gate
        if self.fire("timeout", site):
            gate.nak = True
            return gate
        if self.fire("stall", site):
            if site.type == "bulk":
                self.halted.add(P.EP_BULK_IN if site.direction == "in" else P.EP_BULK_OUT)
            raise UsbError(LIBUSB_ERROR_PIPE, "stall fault")
        if self.fire("async_error", site):
            self.link_errors += 1
            raise UsbError(LIBUSB_ERROR_IO, "transfer error (async_error fault)")
        usb2 = self._usb2()
        if usb2 is not None and site.vendor:
            if site.type == "control" and site.direction == "in" and nbytes > USB2_CONTROL_READ_MAX:
                self.fire("usb2", site)
                gate.nak = True
                return gate
            if site.type == "bulk" and site.direction == "out":
                f = self.fire("usb2", site)
                if f is not None:
                    gate.keep = f.spec.nbytes if f.spec.nbytes is not None else USB2_BULK_OUT_KEEP
        f = self.fire("short", site)
        if f is not None:
            self.link_errors += 1
            gate.short_to = min(nbytes, f.spec.nbytes if f.spec.nbytes is not None else nbytes // 2)
        return gate

    # ------------------------------------------------------------------ control transfers
    def ctrl_transfer(self, handle: int, bm_request_type: int, b_request: int, w_value: int, w_index: int,
                      data_or_length: bytes | bytearray | memoryview | int, timeout_ms: int = 1000, *,
                      is_async: bool = False, cancel: Callable[[], bool] | None = None) -> bytes | int:
        """One control transfer. IN (``bm_request_type & 0x80``): ``data_or_length`` is wLength, returns the
        bytes read. OUT: ``data_or_length`` is the data stage, returns the bytes written.

        Raises :class:`UsbError`: PIPE (stall: unknown or malformed request), TIMEOUT, NO_DEVICE,
        INVALID_PARAM (a field out of range on the host side).
        """
        is_in = bool(bm_request_type & 0x80)
        if is_in:
            if not isinstance(data_or_length, int):
                raise UsbError(LIBUSB_ERROR_INVALID_PARAM, "an IN transfer takes a length")
            length, data = data_or_length, b""
        else:
            if isinstance(data_or_length, int):
                raise UsbError(LIBUSB_ERROR_INVALID_PARAM, "an OUT transfer takes data")
            data = bytes(data_or_length)
            length = len(data)
        if not (0 <= bm_request_type <= 0xFF and 0 <= b_request <= 0xFF and 0 <= w_value <= 0xFFFF
                and 0 <= w_index <= 0xFFFF and 0 <= length <= 0xFFFF):
            raise UsbError(LIBUSB_ERROR_INVALID_PARAM, "setup packet field out of range")
        rtype = (bm_request_type >> 5) & 3
        site = TransferSite("in" if is_in else "out", "control", b_request, is_async, vendor=rtype == VENDOR)
        start_s = self.clock()
        with self.lock:
            h = self._handle(handle)
            gate = self._gate(h, site, length)
        if gate.nak:
            raise self._nak(h, timeout_ms, cancel, "the device NAKed the control transfer")
        extra_s = 0.0
        lost = False
        with self.lock:
            h = self._handle(handle)
            if rtype == STANDARD:
                result: bytes | int = self._standard(h, bm_request_type, b_request, w_value, w_index, data, length)
            elif rtype == VENDOR and bm_request_type & 0x1F == 0:
                if is_in:
                    try:
                        result = self._vendor_in(h, b_request, w_value, w_index, length)
                    except _LostReceipt:
                        result, lost = b"", True
                else:
                    result, extra_s = self._vendor_out(b_request, w_value, w_index, data)
                    if b_request == P.REQ_PCIE_POWER and extra_s > 0 and start_s is not None:
                        # the request completes when training is over, however late it was processed
                        extra_s = max(extra_s, self._train_end_s - start_s)
            else:
                raise UsbError(LIBUSB_ERROR_PIPE, f"bmRequestType {bm_request_type:#04x} not supported")
            if isinstance(result, bytes | bytearray) and gate.short_to is not None:
                result = bytes(result[:gate.short_to])
            elif isinstance(result, int) and gate.short_to is not None:
                result = gate.short_to
        if lost:
            raise self._nak(h, timeout_ms, cancel, "lost receipt: the completion never reached the host")
        self._finish(h, length, timeout_ms, cancel, extra_s, start_s, is_async=is_async)
        return result

    def _standard(self, h: _Handle, bm: int, req: int, value: int, index: int, data: bytes, length: int) -> bytes | int:
        recipient = bm & 0x1F
        if bm == 0x80 and req == 0x06:  # GET_DESCRIPTOR
            dtype, didx = value >> 8, value & 0xFF
            speed = P.HIGHSPEED_MBPS if self._usb2() is not None else P.SUPERSPEED_MBPS
            desc: bytes | None
            if dtype == D.DT_DEVICE:
                desc = D.device_descriptor(self.ident, speed)
            elif dtype == D.DT_CONFIG and didx == 0:
                desc = D.config_descriptor(speed)
            elif dtype == D.DT_STRING:
                desc = D.string_descriptor(self.ident, didx)
            elif dtype == D.DT_BOS and D.superspeed(speed):
                desc = D.bos_descriptor()
            else:
                desc = None
            if desc is None:
                raise UsbError(LIBUSB_ERROR_PIPE, f"no descriptor {value:#06x}")
            return desc[:length]
        if bm & 0x80 and req == 0x00:  # GET_STATUS
            if recipient == 2:
                return struct.pack("<H", int(index in self.halted))[:length]
            return struct.pack("<H", 1 if recipient == 0 else 0)[:length]  # self-powered
        if bm == 0x80 and req == 0x08:  # GET_CONFIGURATION
            return bytes([self.configuration])[:length]
        if bm == 0x00 and req == 0x09 and not data:  # SET_CONFIGURATION
            if value not in (0, P.USB_CONFIGURATION):
                raise UsbError(LIBUSB_ERROR_PIPE, f"no configuration {value}")
            self.configuration = value
            self.halted.clear()
            return 0
        if bm == 0x81 and req == 0x0A:  # GET_INTERFACE
            return b"\x00"[:length]
        if bm == 0x01 and req == 0x0B and not data:  # SET_INTERFACE
            if (value, index) != (0, P.USB_INTERFACE):
                raise UsbError(LIBUSB_ERROR_PIPE, f"no alternate setting {value} of interface {index}")
            return 0
        if bm == 0x02 and req in (0x01, 0x03) and value == 0 and not data:  # CLEAR/SET_FEATURE(ENDPOINT_HALT)
            if index not in (P.EP_BULK_IN, P.EP_BULK_OUT):
                raise UsbError(LIBUSB_ERROR_PIPE, f"no endpoint {index:#04x}")
            if req == 0x01:
                self.halted.discard(index)
            else:
                self.halted.add(index)
            return 0
        raise UsbError(LIBUSB_ERROR_PIPE, f"standard request {bm:#04x}/{req:#04x} not supported")

    # ------------------------------------------------------------------ vendor requests
    def _vendor_in(self, h: _Handle, req: int, value: int, index: int, length: int) -> bytes:
        if req == P.REQ_XDATA_READ:
            if not 1 <= length <= P.XDATA_READ_MAX or value + length > P.XDATA_SIZE:
                raise UsbError(LIBUSB_ERROR_PIPE, f"0xE4 read of {length} bytes at {value:#06x}")
            if self._fence_moved and any(value < hi and lo < value + length for lo, hi in RECEIPT_RANGES):
                self._fence_moved = False
                if self.fire("lost_receipt"):
                    raise _LostReceipt
            if value <= P.XDATA_LTSSM < value + length:
                self._link_opportunity()
            return self._xdata_read(value, length)
        if req == P.REQ_TLP:
            if length != 8:
                raise UsbError(LIBUSB_ERROR_PIPE, f"0xF0 IN of {length} bytes (the completion is 8)")
            cpl, self._cpl = self._cpl, None
            data, status, ret = cpl if cpl is not None else (0, 0, RET_NO_COMPLETION)
            return struct.pack("<IBBBB", data & 0xFFFFFFFF, (status & 7) << 5, 0, 0, ret)
        raise UsbError(LIBUSB_ERROR_PIPE, f"vendor IN request {req:#04x} not supported")

    def _vendor_out(self, req: int, value: int, index: int, data: bytes) -> tuple[int, float]:
        """Returns (bytes written, seconds the request takes on the device)."""
        if req == P.REQ_XDATA_WRITE:
            if data or index > 0xFF:
                raise UsbError(LIBUSB_ERROR_PIPE, f"0xE5 with {len(data)} data bytes, value byte {index:#x}")
            self._xdata_write(value, index)
            return 0, 0.0
        if req == P.REQ_PCIE_POWER:
            if data or value not in (0, 1):
                raise UsbError(LIBUSB_ERROR_PIPE, f"0xF3 wValue {value}")
            return 0, self._pcie_power(bool(value))
        if req == P.REQ_TLP:
            if len(data) != 12:
                raise UsbError(LIBUSB_ERROR_PIPE, f"0xF0 OUT with {len(data)} data bytes (12 expected)")
            self._tlp(value & 0xFF, value >> 8, index, *struct.unpack("<III", data))
            return len(data), 0.0
        if req == P.REQ_SRAM:
            if data:
                raise UsbError(LIBUSB_ERROR_PIPE, "0xF2 takes no data stage")
            self._sram_arm(value, index)
            return 0, 0.0
        raise UsbError(LIBUSB_ERROR_PIPE, f"vendor OUT request {req:#04x} not supported")

    # ------------------------------------------------------------------ XDATA
    def ltssm(self) -> int:
        """The LTSSM byte as XDATA 0xB450 reads now."""
        with self.lock:
            if not self.pcie_power:
                return P.LTSSM_DETECT
            if self.clock() < self._train_end_s:
                return LTSSM_TRAINING
            return {"l0": P.LTSSM_L0, "stuck": P.LTSSM_STUCK, "down": P.LTSSM_DETECT}.get(self._link, P.LTSSM_DETECT)

    def link_up(self) -> bool:
        return self.ltssm() == P.LTSSM_L0

    def _xdata_read(self, addr: int, n: int) -> bytes:
        out = bytearray(self.xdata[addr:addr + n])
        if addr <= P.XDATA_LTSSM < addr + n:
            out[P.XDATA_LTSSM - addr] = self.ltssm()
        if addr + n > P.XDATA_SRAM_WINDOW:
            lo = max(addr, P.XDATA_SRAM_WINDOW)
            out[lo - addr:] = self.sram[lo - P.XDATA_SRAM_WINDOW:addr + n - P.XDATA_SRAM_WINDOW]
        return bytes(out)

    def _xdata_write(self, addr: int, byte: int) -> None:
        if addr == P.XDATA_LTSSM:
            return  # read-only
        if addr >= P.XDATA_SRAM_WINDOW:
            self.sram[addr - P.XDATA_SRAM_WINDOW] = byte
            self.cv.notify_all()
            return
        self.xdata[addr] = byte

    # ------------------------------------------------------------------ PCIe link
    def _pcie_power(self, on: bool) -> float:
        """0xF3. Returns how long the request takes (link training)."""
        if not on:
            if self.pcie_power:
                log.info("PCIe power off: GPU reset")
            self.pcie_power, self._link = False, "off"
            self._train_end_s = 0.0
            self._gpu_reset_locked()
            return 0.0
        if self.pcie_power and self._link == "l0" and self.clock() >= self._train_end_s:
            self._link_opportunity()
            return 0.0
        if not self.pcie_power:
            self._gpu_reset_locked()  # the GPU comes out of reset with power
        self.pcie_power = True
        outcome = "l0"
        if self.fire("ltssm_down"):
            outcome = "down"
        elif self.fire("ltssm_stuck"):
            outcome = "stuck"
        self._link = outcome
        delay = self.config.training_delay_s
        self._train_end_s = self.clock() + delay
        log.info("PCIe power on: link trains to %s in %.3f s", outcome, delay)
        return delay

    def _link_opportunity(self) -> None:
        """An LTSSM read or TLP while the link is up: the link faults may take it down."""
        if self._link != "l0" or not self.pcie_power:
            return
        if self.fire("ltssm_down"):
            self._link = "down"
        elif self.fire("ltssm_stuck"):
            self._link = "stuck"

    def _tlp_link_ok(self) -> bool:
        self._link_opportunity()
        return self.pcie_power and self._link == "l0" and self.clock() >= self._train_end_s

    # ------------------------------------------------------------------ TLPs
    def _tlp(self, fmt_type: int, byte_en: int, mode: int, addr_lo: int, addr_hi: int, value: int) -> None:
        """0xF0 OUT. Raises UsbError(PIPE) for a malformed request."""
        address = addr_lo | (addr_hi << 32)
        posted_write = (fmt_type & 0b11011111) == 0b01000000
        message = (fmt_type & 0b10111000) == 0b00110000
        if mode in (P.TLP_MODE_STREAM_WRITE, P.TLP_MODE_STREAM_READ):
            want = (P.TLP_MEM_WRITE32, P.TLP_MEM_WRITE64) if mode == P.TLP_MODE_STREAM_WRITE else \
                (P.TLP_MEM_READ32, P.TLP_MEM_READ64)
            nbytes = value * 4
            if fmt_type not in want or address & 3 or not 0 < nbytes <= MAX_STREAM_BYTES:
                raise UsbError(LIBUSB_ERROR_PIPE, f"0xF0 mode {mode}: fmt_type {fmt_type:#04x}, {value} dwords "
                                                  f"at {address:#x}")
            stream = _Stream("mem", address, nbytes)
            if mode == P.TLP_MODE_STREAM_WRITE:
                self._out = stream
            else:
                self._in = stream
            return
        if mode != P.TLP_MODE_SINGLE or byte_en & ~0xF or address & 3:
            raise UsbError(LIBUSB_ERROR_PIPE, f"0xF0 mode {mode}, byte enable {byte_en:#x}, address {address:#x}")
        if message:
            return
        if fmt_type in (P.TLP_MEM_WRITE32, P.TLP_MEM_WRITE64):
            if self._tlp_link_ok():
                self._mem_write_dword(address, value, byte_en)
            return
        if posted_write:
            return
        self._cpl = self._nonposted(fmt_type, address, value, byte_en)

    def _nonposted(self, fmt_type: int, address: int, value: int, byte_en: int) -> tuple[int, int, int]:
        """Execute a non-posted TLP: (data, completion status, return status)."""
        if not self._tlp_link_ok():
            return 0, P.CPL_SUCCESS, RET_NO_COMPLETION
        f = self.fire("bad_tlp")
        if f is not None:
            return 0xFFFFFFFF, P.CPL_UR if f.spec.status == "ur" else P.CPL_CA, 0
        if fmt_type in (P.TLP_CFG_READ0, P.TLP_CFG_READ1, P.TLP_CFG_WRITE0, P.TLP_CFG_WRITE1):
            bus, dev, fn, reg = address >> 24 & 0xFF, address >> 19 & 0x1F, address >> 16 & 0x7, address & 0xFFC
            target = self.fabric.cfg_target(bool(fmt_type & 1), bus, dev, fn)
            if target is None:
                return 0xFFFFFFFF, P.CPL_UR, 0
            if fmt_type & 0x40:
                target.write32(reg, value, byte_en)
                return 0, P.CPL_SUCCESS, 0
            return target.read32(reg), P.CPL_SUCCESS, 0
        if fmt_type in (P.TLP_MEM_READ32, P.TLP_MEM_READ64):
            hit = self.fabric.mem_target(address, 4)
            if hit is None:
                return 0xFFFFFFFF, P.CPL_UR, 0
            return int.from_bytes(self._bar_read(hit[0], hit[1], 4), "little"), P.CPL_SUCCESS, 0
        return 0xFFFFFFFF, P.CPL_UR, 0  # I/O and other requests are not modelled

    def _mem_write_dword(self, address: int, value: int, byte_en: int) -> None:
        hit = self.fabric.mem_target(address, 4)
        if hit is None:
            return  # a posted write nobody claims is dropped (UR is not reported for posted requests)
        bar, off = hit
        if byte_en == 0xF:
            self._bar_write(bar, off, struct.pack("<I", value & 0xFFFFFFFF))
            return
        old = bytearray(self._bar_read(bar, off, 4))
        new = struct.pack("<I", value & 0xFFFFFFFF)
        for i in range(4):
            if byte_en & (1 << i):
                old[i] = new[i]
        self._bar_write(bar, off, bytes(old))

    def _bar_read(self, bar: int, off: int, n: int) -> bytes:
        if bar == 0:
            return self.vram.read(off, n)
        regs = self.doorbells if bar == 2 else self.mmio
        out = bytearray(n)
        for i in range(0, n, 4):
            out[i:i + 4] = struct.pack("<I", regs.get(off + i, 0))[:n - i]
        return bytes(out)

    def _bar_write(self, bar: int, off: int, data: bytes | memoryview) -> None:
        if bar == 0:
            self.vram.write(off, data)
            if self.sdma.polling is not None:
                self.cv.notify_all()
            return
        mv = memoryview(data).cast("B")
        regs = self.doorbells if bar == 2 else self.mmio
        for i in range(0, len(mv) - 3, 4):
            v = int.from_bytes(mv[i:i + 4], "little")
            regs[off + i] = v
            if bar == 2 and P.SDMA_DOORBELL_BAR_OFFSET <= off + i < P.SDMA_DOORBELL_BAR_OFFSET + 8:
                self.sdma.doorbell_write(off + i, v)
            elif bar == 2:
                self.engine.doorbell_write(off + i, v)

    # ------------------------------------------------------------------ SRAM engine
    def _sram_arm(self, value: int, index: int) -> None:
        read = bool(value & P.SRAM_READ_FLAG)
        sectors = value & ~P.SRAM_READ_FLAG
        slot, nslots = index & 0xFF, index >> 8
        nbytes = sectors * P.SECTOR
        start = slot * P.SRAM_SLOT
        if sectors == 0 or nslots != -(-nbytes // P.SRAM_SLOT) or start + nbytes > P.SRAM_SIZE:
            raise UsbError(LIBUSB_ERROR_PIPE, f"0xF2 wValue {value:#06x} wIndex {index:#06x}")
        stream = _Stream("sram", start, nbytes)
        if read:
            self._cq_writes_at_arm = self._cq_writes
            self._in = stream
        else:
            self._out = stream

    # ------------------------------------------------------------------ bulk transfers
    def _bulk_checks(self, h: _Handle, endpoint: int, want: int) -> None:
        if endpoint != want:
            raise UsbError(LIBUSB_ERROR_NOT_FOUND, f"no endpoint {endpoint:#04x} for this direction")
        owner = self._claimed_by.get(P.USB_INTERFACE)
        if owner is not None and owner != h.id:
            raise UsbError(LIBUSB_ERROR_BUSY, "interface 0 is claimed by another handle")
        if endpoint in self.halted:
            raise UsbError(LIBUSB_ERROR_PIPE, f"endpoint {endpoint:#04x} is halted")

    def bulk_write(self, handle: int, endpoint: int, data: bytes | bytearray | memoryview, timeout_ms: int = 1000,
                   *, is_async: bool = False, cancel: Callable[[], bool] | None = None) -> int:
        """Bulk OUT to ``endpoint`` (0x02); returns the bytes the device accepted.

        The data goes to the stream armed by 0xF2 (SRAM) or 0xF0 mode 1 (PCIe memory). Raises UsbError:
        PIPE when nothing is armed or the data overruns the stream (the endpoint then stays halted),
        TIMEOUT, NO_DEVICE, BUSY, NOT_FOUND.
        """
        mv = memoryview(data).cast("B")
        site = TransferSite("out", "bulk", None, is_async)
        start_s = self.clock()
        with self.lock:
            h = self._handle(handle)
            self._bulk_checks(h, endpoint, P.EP_BULK_OUT)
            gate = self._gate(h, site, len(mv))
        if gate.nak:
            raise self._nak(h, timeout_ms, cancel, "the device NAKed the bulk OUT")
        with self.lock:
            h = self._handle(handle)
            n = len(mv) if gate.short_to is None else gate.short_to
            stream = self._out
            if stream is None or n > stream.remaining:
                self._out = None
                self.halted.add(P.EP_BULK_OUT)
                what = "nothing armed" if stream is None else f"{n} bytes overrun the {stream.remaining} armed"
                raise UsbError(LIBUSB_ERROR_PIPE, f"bulk OUT: {what}")
            keep = n if gate.keep is None else min(n, gate.keep)
            self._stream_write(stream, mv[:keep])  # usb2: the rest of this transfer never reaches the device
            stream.pos += n
            if stream.remaining == 0:
                self._out = None
            result = n
        self._finish(h, n, timeout_ms, cancel, start_s=start_s, is_async=is_async)
        return result

    def _stream_write(self, stream: _Stream, mv: memoryview) -> None:
        if not len(mv):
            return
        if stream.kind == "sram":
            start = stream.base + stream.pos
            self.sram[start:start + len(mv)] = mv
            self.cv.notify_all()
            return
        if not self._tlp_link_ok():
            return  # posted writes into a dead link are lost
        address = stream.base + stream.pos
        hit = self.fabric.mem_target(address, len(mv))
        if hit is None:
            return
        self._bar_write(hit[0], hit[1], mv)

    def bulk_read(self, handle: int, endpoint: int, length: int, timeout_ms: int = 1000, *,
                  is_async: bool = False, cancel: Callable[[], bool] | None = None) -> bytes:
        """Bulk IN from ``endpoint`` (0x81): up to ``length`` bytes of the stream armed by 0xF2 read or 0xF0
        mode 2. Nothing armed: NAK until the timeout. Raises UsbError (TIMEOUT, NO_DEVICE, PIPE, BUSY)."""
        if length < 0:
            raise UsbError(LIBUSB_ERROR_INVALID_PARAM, "negative length")
        site = TransferSite("in", "bulk", None, is_async)
        start_s = self.clock()
        with self.lock:
            h = self._handle(handle)
            self._bulk_checks(h, endpoint, P.EP_BULK_IN)
            gate = self._gate(h, site, length)
            stream = self._in
            if not gate.nak and stream is not None and stream.kind == "mem" and not self._tlp_link_ok():
                gate.nak = True  # no completions come back over a dead link
            if stream is None:
                gate.nak = True
        if gate.nak:
            raise self._nak(h, timeout_ms, cancel, "the device NAKed the bulk IN")
        self._wait_sram_data(h, timeout_ms, cancel)
        with self.lock:
            h = self._handle(handle)
            stream = self._in
            if stream is None:
                raise self._nak(h, timeout_ms, cancel, "the armed stream went away")
            n = min(length, stream.remaining)
            if gate.short_to is not None:
                n = min(n, gate.short_to)
            out = self._stream_read(stream, n)
            stream.pos += n
            if stream.remaining == 0:
                self._in = None
        self._finish(h, n, timeout_ms, cancel, start_s=start_s, is_async=is_async)
        return out

    def _sram_data_pending(self) -> bool:
        """Lock held: an armed SRAM read whose data the GPU is still producing. The bridge answers it after the
        GPU's write to the completion page (cq_buf) -- tinygrad 0.14 ``_copyout`` queues that write after the
        copy into SRAM and reads the window without waiting for its signal -- or at once when the SDMA queue
        has nothing outstanding (the data is already there)."""
        s = self._in
        return (s is not None and s.kind == "sram" and s.pos == 0 and self._cq_writes_at_arm == self._cq_writes
                and self.sdma.busy())

    def _wait_sram_data(self, h: _Handle, timeout_ms: int, cancel: Callable[[], bool] | None) -> None:
        """NAK (wait) while :meth:`_sram_data_pending`, up to the transfer's timeout (then LIBUSB_ERROR_TIMEOUT)."""
        deadline = self.clock() + (timeout_ms / 1000 if timeout_ms > 0 else float("inf"))
        with self.lock:
            while self._sram_data_pending():
                if not self._alive(h):
                    raise UsbError(LIBUSB_ERROR_NO_DEVICE, "the device went away during the transfer")
                if cancel is not None and cancel():
                    raise UsbError(LIBUSB_ERROR_INTERRUPTED, "the client went away")
                left = deadline - self.clock()
                if left <= 0:
                    raise UsbError(LIBUSB_ERROR_TIMEOUT, "the device NAKed the bulk IN: the GPU never wrote the "
                                                         "completion for the armed SRAM read")
                self.cv.wait(min(left, NAK_POLL_S))

    def _stream_read(self, stream: _Stream, n: int) -> bytes:
        start = stream.base + stream.pos
        if stream.kind == "sram":
            return bytes(self.sram[start:start + n])
        hit = self.fabric.mem_target(start, n)
        f = self.fire("bad_tlp") if hit is not None else None
        if hit is None or f is not None:
            return b"\xff" * n  # UR / CA completions read as all-ones
        return self._bar_read(hit[0], hit[1], n)

    # ------------------------------------------------------------------ the GPU's view (used by the engine)
    def gpu_system_write(self, gpu_addr: int, data: bytes) -> bool:
        """A GPU write to system memory: the sys page, completion page or SRAM. Lock held. False if unmapped."""
        n = len(data)
        for base, xaddr, size in ((P.SYS_PAGE_GPU_ADDR, P.XDATA_SYS_PAGE, 0x1000),
                                  (P.CPL_PAGE_GPU_ADDR, P.XDATA_CPL_PAGE, 0x1000)):
            if base <= gpu_addr and gpu_addr + n <= base + size:
                off = xaddr + gpu_addr - base
                self.xdata[off:off + n] = data
                if base == P.CPL_PAGE_GPU_ADDR:
                    self._cq_writes += 1
                    self.cv.notify_all()
                if any(off < hi and lo < off + n for lo, hi in RECEIPT_RANGES):
                    self._fence_moved = True
                return True
        if P.SRAM_GPU_ADDR <= gpu_addr and gpu_addr + n <= P.SRAM_GPU_ADDR + P.SRAM_SIZE:
            off = gpu_addr - P.SRAM_GPU_ADDR
            self.sram[off:off + n] = data
            return True
        log.warning("GPU write to unmapped system address %#x (%d bytes) dropped", gpu_addr, n)
        return False

    def gpu_system_read(self, gpu_addr: int, n: int) -> bytes | None:
        """A GPU read of system memory (sys page, completion page or SRAM). Lock held. None if unmapped."""
        for base, xaddr, size in ((P.SYS_PAGE_GPU_ADDR, P.XDATA_SYS_PAGE, 0x1000),
                                  (P.CPL_PAGE_GPU_ADDR, P.XDATA_CPL_PAGE, 0x1000)):
            if base <= gpu_addr and gpu_addr + n <= base + size:
                off = xaddr + gpu_addr - base
                return bytes(self.xdata[off:off + n])
        if P.SRAM_GPU_ADDR <= gpu_addr and gpu_addr + n <= P.SRAM_GPU_ADDR + P.SRAM_SIZE:
            off = gpu_addr - P.SRAM_GPU_ADDR
            return bytes(self.sram[off:off + n])
        return None

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """Everything a person debugging the dock wants to see, as JSON-ready data."""
        with self.lock:
            now = self.clock()
            self.faults.prune(now)
            return {
                "usb": {"present": self.present, "bus": self.bus, "address": self.address,
                        "generation": self.generation, "vid_pid": [self.ident.vid, self.ident.pid],
                        "product": self.ident.product,
                        "speed_mbps": P.HIGHSPEED_MBPS if self._usb2() is not None else P.SUPERSPEED_MBPS,
                        "link_errors": self.link_errors, "configuration": self.configuration,
                        "halted": sorted(self.halted), "open_handles": len(self._handles),
                        "claimed": {str(k): v for k, v in self._claimed_by.items()}},
                "bridge": {"wedged": self.wedged, "pcie_power": self.pcie_power, "ltssm": self.ltssm(),
                           "copyin_fence": int.from_bytes(self.xdata[P.XDATA_COPYIN_FENCE:P.XDATA_COPYIN_FENCE + 4],
                                                          "little"),
                           "out_stream": None if self._out is None else vars(self._out),
                           "in_stream": None if self._in is None else vars(self._in)},
                "pcie": {"bars": {str(i): [b.address, b.size] for i, b in self.fabric.gpu.bars.items()},
                         "vendor_device": [self.fabric.gpu.read32(0) & 0xFFFF, self.fabric.gpu.read32(0) >> 16]},
                "gpu": {**self.engine.status(), "sdma": self.sdma.status()},
                "vram_pages": self.vram.pages_used,
                "phase": self.phase.value,
                "timing": self.timing(),
                "lock_file": self._lock_path,
                "faults": self.faults.entries(now),
                "fault_history": self.faults.history(now),
                "kinds": sorted(KINDS),
            }


class _LostReceipt(Exception):
    """Raised inside the twin when the lost_receipt fault swallows the host's completion read."""
