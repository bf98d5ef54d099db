"""The qualification ladder: the evidence, step by step, that the dock may serve the primary model.

``docs/architecture.md``, "Qualification, failover and return" (no single "present" bit says the dock can serve).
The rungs, in order, each with the health layer it speaks for:

=================  ======  ==========================================================================
``usb_ids``        usb     a device with a Chestnut VID/PID (0xADD1:0x0001, 0x3801:0x0001) is
                           enumerated and its product string starts with ``custom`` / ``AS2462``
``link_speed``     usb     SuperSpeed (>= 5000 Mbps); USB 2 is a WARN with its known hazards
``link_stability`` usb     link errors over a short window <= 5 per second (openpilot hardwared)
``ltssm``          pcie    LTSSM 0x78, after a 0xF3 power-on and a bounded wait for training if needed
``gpu_arch``       gpu     the BARs assigned by tinygrad's own ``System.pci_setup_usb_bars`` and checked
                           (:func:`tinygrad_bar_setup`); an AMD GPU (vendor 0x1002) of a supported
                           architecture on bus 4
``model_loaded``   gpu     the model is loaded on the dock
``warmup``         output  one inference on the fingerprint's fixed input matches the recorded
                           fingerprint (:mod:`chestnut.backend.fingerprint`)
=================  ======  ==========================================================================

Every step is timed and has a bound (``bound_s``): its waits are bounded by construction (transfer
timeouts, the training wait, the stability window) and a step that still overruns its bound fails.
The ladder stops at the first failure: later steps are reported ``skipped``. A failure carries the
reason (the typed error's ``reason: detail``) and advice (what a person should do about it).

The USB steps use pyusb (``usb.core.find`` with an optional ``backend=``, so the twin's pyusb face
works too) and never claim the interface: another process may own the dock, and the bridge's vendor
requests are device-recipient control transfers that need no claim. A qualifier built with ``lock=True``
(the runners' ``lock_first``: the node's worker, ``chestnut probe``, ``chestnut acceptance``) takes the dock's
lock (``backend/docklock.py``) in ``usb_ids``, as soon as the dock's bus and address are known and before any
rung sends the bridge a vendor request: a dock another process holds (a serving node, a probe) fails
``usb_ids`` with ``lock_held``, naming the holder, and is never reset (no 0xF3 power-off or power-on).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import usb.core
import usb.util

from chestnut.backend import progress
from chestnut.backend import protocol as P
from chestnut.backend.bridge import PCI_BAR_MEM_TYPE_64, PCI_BASE_ADDRESS_0, Bridge, LinkTraining
from chestnut.backend.classify import advice_for, blame_slow_link, classify, link_speed_text
from chestnut.backend.docklock import DockLock, describe_holders, dock_lock_path
from chestnut.backend.errors import (
    ChestnutError,
    GpuLayerError,
    Layer,
    ModelError,
    OutputLayerError,
    PcieLayerError,
    UsbLayerError,
)
from chestnut.backend.fingerprint import compare, fixed_inputs
from chestnut.backend.interface import DockObservation, LadderReport, LadderStep, ModelSpec, StepResult
from chestnut.backend.jitcache import private_tinygrad_cache
from chestnut.backend.retry import TRANSIENT_REASONS, RetryingUSB3, RetryPolicy

STEPS: tuple[tuple[str, Layer], ...] = (
    ("usb_ids", Layer.USB), ("link_speed", Layer.USB), ("link_stability", Layer.USB), ("ltssm", Layer.PCIE),
    ("gpu_arch", Layer.GPU), ("model_loaded", Layer.GPU), ("warmup", Layer.OUTPUT),
)
DOCK_STEPS = tuple(name for name, _ in STEPS[:5])
MODEL_STEPS = tuple(name for name, _ in STEPS[5:])
LAYER_OF = dict(STEPS)

# libusb_speed (LIBUSB_SPEED_LOW..SUPER_PLUS, as pyusb's Device.speed reports it) -> Mbps
SPEED_MBPS: dict[int, int] = {1: 1, 2: 12, 3: P.HIGHSPEED_MBPS, 4: P.SUPERSPEED_MBPS, 5: 10000}
USB2_HAZARDS = ("USB 2 link (480 Mbps): the bridge's vendor control reads over 64 bytes time out and bulk OUT "
                "transfers can be silently truncated (a corrupt copy-in); copies are ~10x slower")
MAX_LINK_ERRORS_PER_S = 5.0  # openpilot hardwared: <= 5 link errors/s over its window is stable
STABILITY_OVERRUN_S = 0.5  # s past link_stability's window in which its planned probe reads may still start

STEP_ADVICE: dict[str, str] = {
    "usb_ids": "plug the dock in and power it; `lsusb -d add1:0001` should list it",
    "link_speed": "use a SuperSpeed (USB 3) port and cable",
    "link_stability": "reseat or replace the USB cable; avoid hubs; check the dock's power supply",
    "ltssm": "power-cycle the dock; a link that sticks at 0x4C needs the bridge firmware reflashed",
    "gpu_arch": "the dock must carry a supported AMD GPU (" + ", ".join(P.SUPPORTED_ARCHS) + ")",
    "model_loaded": "check the model file and that the GPU firmware cache is filled",
    "warmup": "the dock computes wrong numbers: do not serve from it; re-record the fingerprint only if the "
              "model changed",
}


@dataclass(frozen=True)
class LadderConfig:
    """Bounds and thresholds of the ladder.

    ``ctrl_timeout_ms``: every vendor control transfer of the ladder (100 ms, as openpilot's hardware
    daemon reads the LTSSM); ``stability_window_s``: the link-error sampling window (openpilot: 2 s;
    shorter here so the ladder stays quick); ``train_timeout_ms``: the wait for link training after
    power-on; ``wait_timeout_ms``: the device wait timeout the runners use; ``require_fingerprint``:
    a model without a recorded fingerprint fails the warm-up step instead of passing with a WARN.
    """

    ctrl_timeout_ms: int = 100
    stability_window_s: float = 0.5
    stability_poll_s: float = 0.02
    max_link_errors_per_s: float = MAX_LINK_ERRORS_PER_S
    train_timeout_ms: int = 1000
    wait_timeout_ms: int = P.WAIT_TIMEOUT_MS
    require_fingerprint: bool = True
    load_bound_s: float = 120.0
    warmup_bound_s: float = 60.0


@dataclass(frozen=True)
class Outcome:
    """What a passing step saw: PASS or WARN and a one-line detail (plus advice for a WARN)."""

    result: StepResult
    detail: str
    advice: str = ""


@dataclass(frozen=True)
class Step:
    """One rung to run: ``run()`` returns an :class:`Outcome` or raises (typed or not)."""

    name: str
    bound_s: float
    run: Callable[[], Outcome]

    @property
    def layer(self) -> Layer:
        return LAYER_OF[self.name]


def reported_speed_mbps(report: LadderReport) -> int | None:
    """The link speed (Mbps) a ``link_speed`` step of ``report`` warned of (its detail starts with it), or None
    when it passed, was not run or named no speed."""
    step = next((s for s in report.steps if s.name == "link_speed" and s.result is StepResult.WARN), None)
    head = step.detail.split(" ", 1)[0] if step is not None else ""
    return int(head) if head.isdigit() else None


def run_steps(steps: Sequence[Step], report: LadderReport | None = None,
              clock: Callable[[], float] = time.monotonic,
              on_step: Callable[[LadderStep], None] | None = None) -> LadderReport:
    """Run ``steps`` in order into ``report`` (new if None), stopping at the first failure.

    Every step gets a :class:`LadderStep` entry; those not reached stay ``skipped``. A raised
    exception is classified (:func:`chestnut.backend.classify.classify`, the step's layer by default; a
    GPU timeout on a link the ``link_speed`` step found below SuperSpeed is the usb layer's,
    :func:`chestnut.backend.classify.blame_slow_link`) and reported as ``FAIL`` with ``"reason: detail"``
    and advice. A step that took longer than its ``bound_s`` fails even if it returned. ``on_step`` sees
    each entry as soon as it is decided. Each step's start and end is progress (``backend/progress.py``).
    """
    from chestnut.backend.errors import LAYER_ERRORS

    report = report if report is not None else LadderReport()
    failed_already = report.first_failure is not None
    entries = []
    for step in steps:
        entry = LadderStep(step.name, step.layer)
        report.steps.append(entry)
        entries.append((step, entry))
    for step, entry in entries:
        if failed_already:
            break
        t0 = clock()
        progress.note()
        try:
            out = step.run()
            entry.result, entry.detail, entry.advice = out.result, out.detail, out.advice
        except Exception as e:  # every failure becomes a typed error and a FAIL entry
            err = blame_slow_link(classify(e, default=LAYER_ERRORS[step.layer]), reported_speed_mbps(report))
            entry.result = StepResult.FAIL
            entry.detail = f"{type(err).__name__} {err}"
            entry.advice = advice_for(err) or STEP_ADVICE[step.name]
            entry.reason, entry.error = err.reason, err
        entry.duration_s = clock() - t0
        progress.note()
        if entry.result is not StepResult.FAIL and entry.duration_s > step.bound_s:
            entry.result = StepResult.FAIL
            entry.detail = f"took {entry.duration_s:.3f} s, over its bound of {step.bound_s:.3f} s ({entry.detail})"
            entry.advice, entry.reason = STEP_ADVICE[step.name], "over_bound"
        failed_already = entry.result is StepResult.FAIL
        if on_step is not None:
            on_step(entry)
    return report


# ------------------------------------------------------------------ pyusb: the dock without claiming it
class PyusbTransport:
    """tinygrad ``USB3``-style transport over a pyusb device: vendor control transfers, and bulk on 0x02/0x81.

    Control transfers to the device need no interface claim; bulk transfers make pyusb claim
    interface 0 (only use them in the process that owns the dock). pyusb errors propagate as
    ``usb.core.USBError`` (classified by :class:`~chestnut.backend.bridge.Bridge`).
    """

    def __init__(self, dev: Any) -> None:
        self.dev = dev

    def control_write(self, request: int, value: int = 0, index: int = 0, data: bytes = b"",
                      timeout: int = 1000) -> int:
        n = self.dev.ctrl_transfer(P.REQTYPE_VENDOR_OUT, request, value, index, bytes(data), timeout)
        if n != len(data):
            raise UsbLayerError("short_transfer", f"control OUT 0x{request:02X}: wrote {n} of {len(data)} bytes")
        return int(n)

    def control_read(self, request: int, length: int, value: int = 0, index: int = 0, timeout: int = 1000) -> bytes:
        return bytes(self.dev.ctrl_transfer(P.REQTYPE_VENDOR_IN, request, value, index, length, timeout))

    def bulk_write(self, payload: bytes | memoryview, timeout: int = 1000) -> int:
        n = self.dev.write(P.EP_BULK_OUT, payload, timeout)
        if n != len(payload):
            raise UsbLayerError("short_transfer", f"bulk OUT 0x02: wrote {n} of {len(payload)} bytes")
        return int(n)

    def bulk_read(self, length: int, timeout: int = 1000) -> bytes:
        return bytes(self.dev.read(P.EP_BULK_IN, length, timeout))


def release_device(dev: Any) -> None:
    """Close pyusb's handle on ``dev`` (``usb.util.dispose_resources``); a vanished device is no error."""
    try:
        usb.util.dispose_resources(dev)
    except Exception:  # the device may be gone already; there is nothing left to release
        pass


class UsbDock:
    """The dock as pyusb enumerates it.

    ``backend`` is passed to ``usb.core.find`` (None = libusb); ``link_errors(dev)`` returns the
    dock's USB link-error counter when the platform exposes one (the twin does), else None.
    """

    def __init__(self, backend: Any = None, ctrl_timeout_ms: int = 100,
                 link_errors: Callable[[Any], int | None] | None = None) -> None:
        self.backend = backend
        self.ctrl_timeout_ms = ctrl_timeout_ms
        self._link_errors = link_errors

    def link_errors(self, dev: Any) -> int | None:
        """The link-error counter of ``dev`` or None; a failure to read it counts as unknown."""
        if self._link_errors is None:
            return None
        try:
            return self._link_errors(dev)
        except Exception:  # the counter is optional evidence: unknown, not a failure
            return None

    def find_all(self) -> list[Any]:
        """Every enumerated device with a Chestnut VID/PID. Raises ConfigError(no_libusb) or a USB error."""
        try:
            found: list[Any] = []
            for vid, pid in P.USB_IDS:
                found += list(usb.core.find(find_all=True, idVendor=vid, idProduct=pid, backend=self.backend))
            return found
        except ChestnutError:
            raise
        except Exception as e:
            raise classify(e, default=UsbLayerError) from e

    def find(self) -> Any:
        """The first dock, or UsbLayerError ``no_dock`` ("no Chestnut dock found")."""
        docks = self.find_all()
        if not docks:
            ids = ", ".join(f"0x{v:04X}:0x{p:04X}" for v, p in P.USB_IDS)
            raise UsbLayerError("no_dock", f"no Chestnut dock found (no USB device {ids} enumerated)")
        return docks[0]

    def product(self, dev: Any, attempts: int = 3) -> str:
        """The product string (standard GET_DESCRIPTOR requests, each bounded by ``ctrl_timeout_ms``: reads, so
        repeated, up to ``attempts`` tries, on a transient error -- the ``TRANSIENT_REASONS`` of
        :mod:`chestnut.backend.retry`, and pyusb 1.3's ``"The device has no langid"``, which is what
        ``usb.util.get_string`` raises when its read of string descriptor 0 failed). Raises a typed USB error."""
        dev.default_timeout = self.ctrl_timeout_ms
        for i in range(attempts):
            if i and getattr(dev, "_langids", None) == ():
                dev._langids = None  # pyusb 1.3 ``Device.langids`` keeps () after a failed read: read it again
            try:
                return str(usb.util.get_string(dev, dev.iProduct) or "")
            except Exception as e:
                err = classify(e, default=UsbLayerError)
                if err.reason not in (*TRANSIENT_REASONS, "no_product_string") or i + 1 >= attempts:
                    raise err from e
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def speed_mbps(dev: Any) -> int | None:
        return SPEED_MBPS.get(int(dev.speed)) if dev.speed is not None else None

    def bridge(self, dev: Any, retried: bool = True, **kw: Any) -> Bridge:
        """A :class:`Bridge` over control transfers to ``dev`` (``ctrl_timeout_ms`` per transfer). ``retried``:
        through :class:`~chestnut.backend.retry.RetryingUSB3` -- each idempotent transfer up to 3 tries of
        ``ctrl_timeout_ms``, by the same table as the data path -- so that the transient errors of a working dock
        (0-815 per hour, openpilot#38519) do not fail a rung; the link's evidence (``link_stability``'s probe
        reads, :meth:`observe`) is read without it, each failure counted."""
        transport: Any = PyusbTransport(dev)
        if retried:
            transport = RetryingUSB3(transport, retry=RetryPolicy(attempt_timeout_ms=self.ctrl_timeout_ms))
        return Bridge(transport, ctrl_timeout_ms=self.ctrl_timeout_ms, **kw)

    def observe(self, read_fence: bool = False) -> DockObservation:
        """A runner's ``probe()``: a fresh enumeration, then presence, IDs, bus/address, speed, link errors,
        the LTSSM byte and (``read_fence``) the copy-in fence, without claiming the interface. Never
        raises: a failure to enumerate or to read the bridge lands in ``extra["error"]``."""
        try:
            docks = self.find_all()
        except ChestnutError as e:
            return DockObservation(False, extra={"error": str(e)})
        if not docks:
            return DockObservation(False)
        d = docks[0]
        obs = DockObservation(True, (d.idVendor, d.idProduct), (d.bus, d.address), self.speed_mbps(d),
                              self.link_errors(d))
        try:
            bridge = self.bridge(d, retried=False)
            obs.ltssm = bridge.ltssm()
            if read_fence:
                obs.fence = bridge.xdata_u32(P.XDATA_COPYIN_FENCE)
        except ChestnutError as e:
            obs.extra["error"] = str(e)
        finally:
            release_device(d)
        return obs


# ------------------------------------------------------------------ the dock's rungs
class DockQualifier:
    """Builds and runs the dock rungs against a :class:`UsbDock`.

    ``gpu_step`` implements ``gpu_arch`` for the runner (the twin sets up the BARs and reads config
    space through the bridge; the real runner opens tinygrad's device, which does that itself);
    None uses :meth:`gpu_arch_via_bridge`. ``reset_gpu``: if the link is already up, switch PCIe
    power off first (0xF3 0) so the GPU starts from reset, as a fresh driver initialisation does;
    the link then has to train again within the bounded wait. ``lock``: ``usb_ids`` takes the dock's lock
    (:class:`~chestnut.backend.docklock.DockLock`, one try, no wait) right after it found the dock's bus and
    address; one another process holds fails the rung as UsbLayerError ``lock_held``, ``"the dock usb:<bus>-
    <address> is in use by pid <pid> (<command>): it holds the dock's lock file <path>"``
    (:func:`~chestnut.backend.docklock.describe_holders`), before any vendor request. The lock taken stays
    in ``dock_lock`` until :meth:`release_lock` or :meth:`release`. After :meth:`run`, ``dev``,
    ``bridge``, ``training``, ``bars`` and ``gpu`` hold what was found.
    """

    def __init__(self, dock: UsbDock, config: LadderConfig | None = None,
                 gpu_step: Callable[[DockQualifier], Outcome] | None = None, reset_gpu: bool = False,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 lock: bool = False) -> None:
        self.dock = dock
        self.reset_gpu = reset_gpu
        self.lock = lock
        self.dock_lock: DockLock | None = None
        self.config = config or LadderConfig(ctrl_timeout_ms=dock.ctrl_timeout_ms)
        self._gpu_step = gpu_step
        self.clock, self.sleep = clock, sleep
        self.dev: Any = None
        self._bridge: Bridge | None = None
        self.training: LinkTraining | None = None
        self.gpu: Any = None
        self.bars: dict[int, tuple[int, int]] = {}

    @property
    def bridge(self) -> Bridge:
        if self._bridge is None:
            self._bridge = self.dock.bridge(self.dev)
        return self._bridge

    def steps(self) -> list[Step]:
        c = self.config
        ctrl_s = c.ctrl_timeout_ms / 1e3
        return [
            Step("usb_ids", 2.0 + 4 * ctrl_s, self.usb_ids),
            Step("link_speed", 1.0, self.link_speed),
            Step("link_stability", c.stability_window_s + 2 * ctrl_s + 1.0, self.link_stability),
            Step("ltssm", P.PCIE_POWER_TIMEOUT_MS / 1e3 + c.train_timeout_ms / 1e3 + 4 * ctrl_s, self.ltssm),
            Step("gpu_arch", 30.0, self.gpu_arch),
        ]

    def run(self, report: LadderReport | None = None,
            on_step: Callable[[LadderStep], None] | None = None) -> LadderReport:
        return run_steps(self.steps(), report, self.clock, on_step)

    def release(self) -> None:
        """Close pyusb's handle on the dock (never claimed) and give back the dock's lock if it took it; the
        qualifier's findings stay readable."""
        if self.dev is not None:
            release_device(self.dev)
        self._bridge = None
        self.release_lock()

    def release_lock(self) -> None:
        """Give back the dock's lock taken by ``usb_ids`` (``lock=True``), if held."""
        if self.dock_lock is not None:
            self.dock_lock.release()
            self.dock_lock = None

    def take_lock(self) -> str:
        """The dock's lock for ``dev`` (kept if already held for its bus and address); its path. Raises
        UsbLayerError ``lock_held`` naming the holder, or ``lock_unusable`` (:func:`~chestnut.backend.docklock.
        open_dock_lock`)."""
        path = dock_lock_path(self.dev.bus, self.dev.address)
        if self.dock_lock is not None and self.dock_lock.fd is not None and self.dock_lock.path == path:
            return str(path)
        self.release_lock()
        lock = DockLock(path)
        if not lock.try_acquire():
            raise UsbLayerError("lock_held", f"the dock usb:{self.dev.bus}-{self.dev.address} is in use by "
                                             f"{describe_holders(path)}: it holds the dock's lock file {path}")
        self.dock_lock = lock
        return str(path)

    def usb_ids(self) -> Outcome:
        self.dev = self.dock.find()
        self._bridge = None
        locked = f", lock {self.take_lock()} taken" if self.lock else ""
        product = self.dock.product(self.dev)
        where = f"0x{self.dev.idVendor:04X}:0x{self.dev.idProduct:04X} at bus {self.dev.bus} address {self.dev.address}"
        if not product.startswith(P.PRODUCT_PREFIXES):
            raise UsbLayerError("bad_product", f"{where}: product string {product!r} does not start with "
                                               f"{' or '.join(map(repr, P.PRODUCT_PREFIXES))}")
        return Outcome(StepResult.PASS, f"{where}, product {product!r}{locked}")

    def link_speed(self) -> Outcome:
        mbps = self.dock.speed_mbps(self.dev)
        if mbps is None:
            return Outcome(StepResult.WARN, "link speed unknown", "use a SuperSpeed port; " + USB2_HAZARDS)
        if mbps >= P.SUPERSPEED_MBPS:
            return Outcome(StepResult.PASS, f"SuperSpeed, {mbps} Mbps")
        return Outcome(StepResult.WARN, f"{link_speed_text(mbps)}, below SuperSpeed ({P.SUPERSPEED_MBPS} Mbps)",
                       USB2_HAZARDS + "; move the dock to a USB 3 port")

    def link_stability(self) -> Outcome:
        """Count link errors over the window: the device's counter delta plus failed probe reads.

        Probe reads are LTSSM reads (one control transfer each, ``ctrl_timeout_ms``), one every
        ``stability_poll_s``: ``stability_window_s / stability_poll_s + 1`` of them (26 with the
        defaults), a sample whose size does not depend on how long each read takes. A read that times
        out or fails counts as an error; losing the device fails the step at once. The rate is
        ``counter delta / elapsed s + failed reads / stability_window_s``: a read that times out spends
        up to ``ctrl_timeout_ms`` of the window without sampling the link again, so a rate of failed
        reads over the elapsed time would fall as the reads got slower (or the host later), and a link
        losing half its reads could pass; over the nominal window it is a property of the sample.

        The sampling ends early once the failed reads alone exceed the allowance
        (``max_link_errors_per_s * stability_window_s``) and some read was answered: the link is
        unstable whatever the rest would show. While no read has been answered it goes on, as the
        ``n/n probe reads failed`` of a wedged bridge (:mod:`chestnut.backend.classify`) should rest on
        the whole sample. No read starts once :data:`STABILITY_OVERRUN_S` past the window has passed
        (a bridge that answers nothing, or a host too late for the planned reads): the last read still
        ends inside the step's bound (``stability_window_s + 2 * ctrl_timeout_ms + 1 s``).
        """
        c = self.config
        planned = int(c.stability_window_s / c.stability_poll_s + 1e-9) + 1
        allowance = c.max_link_errors_per_s * c.stability_window_s
        before = self.dock.link_errors(self.dev)
        reads = failed = 0
        last_err: ChestnutError | None = None
        probe = self.dock.bridge(self.dev, retried=False)  # every failed read counts: no retries here
        t0 = self.clock()
        while True:
            reads += 1
            try:
                probe.ltssm()
            except ChestnutError as e:
                if e.reason in ("disconnect", "no_dock", "not_found"):
                    raise
                failed += 1
                last_err = e
            if reads >= planned or self.clock() - t0 >= c.stability_window_s + STABILITY_OVERRUN_S:
                break
            if failed > allowance and failed < reads:
                break
            self.sleep(c.stability_poll_s)
        elapsed = max(self.clock() - t0, 1e-6)
        after = self.dock.link_errors(self.dev)
        counted = (after - before) if before is not None and after is not None else 0
        rate = counted / elapsed + failed / c.stability_window_s
        src = f"counter +{counted}, " if before is not None else "no counter, "
        detail = f"{rate:.1f} errors/s over {elapsed:.2f} s ({src}{failed}/{reads} probe reads failed)"
        if rate > c.max_link_errors_per_s:
            why = f"; last: {last_err}" if last_err is not None else ""
            raise UsbLayerError("unstable_link", f"{detail}, above {c.max_link_errors_per_s:g}/s{why}")
        return Outcome(StepResult.PASS, detail)

    def ltssm(self) -> Outcome:
        first = self.bridge.ltssm()
        reset = ""
        if self.reset_gpu and first == P.LTSSM_L0:
            self.bridge.set_pcie_power(False)
            reset = "GPU reset (0xF3 off), "
        self.training = self.bridge.ensure_link(self.config.train_timeout_ms)
        t = self.training
        how = f"after 0xF3 power-on, {t.elapsed_ms:.0f} ms, {t.polls} reads" if t.powered_on else "already up"
        return Outcome(StepResult.PASS, f"LTSSM=0x{t.ltssm:02X} (L0) {reset}{how}; first read 0x{first:02X}")

    def gpu_arch(self) -> Outcome:
        return self._gpu_step(self) if self._gpu_step is not None else self.gpu_arch_via_bridge()

    def gpu_arch_via_bridge(self) -> Outcome:
        """Assign the BARs with tinygrad's own ``System.pci_setup_usb_bars`` (:func:`tinygrad_bar_setup`) and
        check the GPU's vendor/device id."""
        self.bars = tinygrad_bar_setup(self.bridge)
        self.gpu = self.bridge.check_gpu()
        vram = self.bars.get(0, (0, 0))[1]
        return Outcome(StepResult.PASS, f"AMD {self.gpu.describe()}, BAR0 {vram >> 20} MiB")


# ------------------------------------------------------------------ tinygrad's BAR set-up, checked
class _BoundedControl:
    """tinygrad 0.14 ``USB3``'s control transfers over ``usb``, each bounded by ``ctrl_timeout_ms``: tinygrad's
    ``CustomASM24Controller`` asks 5000 ms for a TLP and 1000 ms for an XDATA read; inside a ladder rung
    every transfer has the rung's own bound (``LadderConfig.ctrl_timeout_ms``)."""

    def __init__(self, usb: Any, ctrl_timeout_ms: int) -> None:
        self.usb, self.ctrl_timeout_ms = usb, ctrl_timeout_ms

    def control_write(self, request: int, value: int = 0, index: int = 0, data: bytes = b"",
                      timeout: int = 1000) -> Any:
        return self.usb.control_write(request, value, index, data, min(timeout, self.ctrl_timeout_ms))

    def control_read(self, request: int, length: int, value: int = 0, index: int = 0, timeout: int = 1000) -> Any:
        return self.usb.control_read(request, length, value, index, min(timeout, self.ctrl_timeout_ms))


def check_bars(bridge: Any, bars: dict[int, tuple[int, int]], gpu_bus: int = P.GPU_BUS,
               mem_base: int = P.USB_MEM_BASE, pref_mem_base: int = P.USB_PREF_MEM_BASE) -> None:
    """Our checks after tinygrad's ``pci_setup_usb_bars``, which trusts what it read: BAR0 (VRAM) and BAR2 (the
    doorbells) are assigned (``AMDev`` and ``AMDQueueDesc`` use both); each size is a power of two of at least
    4 KiB (PCI BAR sizing) at an address aligned to ``min(size, 2 MiB)`` inside its window (non-prefetchable
    from ``mem_base`` below 4 GiB, prefetchable from ``pref_mem_base``); and each BAR register, read back
    through ``bridge`` (anything with :meth:`Bridge.cfg_read`'s signature), holds the address assigned.
    Raises :class:`GpuLayerError` ``bar_missing`` / ``bad_bar`` or :class:`PcieLayerError`
    ``bar_not_programmed``, naming the BAR."""
    for i in (0, 2):
        if i not in bars:
            raise GpuLayerError("bar_missing", f"BAR{i} was not assigned by pci_setup_usb_bars (got {sorted(bars)})")
    for i, (addr, size) in sorted(bars.items()):
        lo, hi = (pref_mem_base, 1 << 64) if addr >= pref_mem_base else (mem_base, 1 << 32)
        if size < 0x1000 or size & (size - 1) or addr % min(size, 2 << 20) or not lo <= addr < addr + size <= hi:
            raise GpuLayerError("bad_bar", f"BAR{i} at {addr:#x}, {size:#x} bytes: not a power-of-two size at an "
                                           f"aligned address in [{lo:#x}, {hi:#x})")
        reg = PCI_BASE_ADDRESS_0 + 4 * i
        low = bridge.cfg_read(reg, bus=gpu_bus)
        got = low & ~0xF
        if low & PCI_BAR_MEM_TYPE_64:
            got |= bridge.cfg_read(reg + 4, bus=gpu_bus) << 32
        if got != addr:
            raise PcieLayerError("bar_not_programmed", f"BAR{i} reads {got:#x} after pci_setup_usb_bars "
                                                       f"assigned {addr:#x}")


def tinygrad_bar_setup(bridge: Bridge, gpu_bus: int = P.GPU_BUS, mem_base: int = P.USB_MEM_BASE,
                       pref_mem_base: int = P.USB_PREF_MEM_BASE) -> dict[int, tuple[int, int]]:
    """tinygrad 0.14's own ``System.pci_setup_usb_bars`` (``runtime/support/system.py``), unmodified, on its own
    ``CustomASM24Controller`` (``runtime/support/usb.py``, its ``__init__`` included: the LTSSM read) over the
    bridge's transport, each control transfer bounded by ``bridge.ctrl_timeout_ms``; tinygrad's errors are
    classified (:func:`~chestnut.backend.classify.classify`), and :func:`check_bars` checks what it assigned.
    In a process whose tinygrad is not imported yet, ``DEV`` defaults to ``CPU`` (never probe devices) and
    tinygrad's disk cache is private (``backend/jitcache.py``). Returns BAR -> (bus address, size in bytes),
    also kept in ``bridge.bars``."""
    import os
    import sys

    if "tinygrad" not in sys.modules:
        os.environ.setdefault("DEV", "CPU")
    private_tinygrad_cache()
    from tinygrad.runtime.support.system import System
    from tinygrad.runtime.support.usb import CustomASM24Controller

    try:
        ctrl = CustomASM24Controller(_BoundedControl(bridge.usb, bridge.ctrl_timeout_ms))  # type: ignore[arg-type]
        bars = dict(System.pci_setup_usb_bars(ctrl, gpu_bus=gpu_bus, mem_base=mem_base, pref_mem_base=pref_mem_base))
    except ChestnutError:
        raise
    except Exception as e:
        raise classify(e, default=UsbLayerError) from e
    check_bars(bridge, bars, gpu_bus, mem_base, pref_mem_base)
    bridge.bars = bars
    return bars


# ------------------------------------------------------------------ the model's rungs
def model_steps(runner: Any, spec: ModelSpec, config: LadderConfig | None = None) -> list[Step]:
    """``model_loaded`` (``runner.load(spec)``) and ``warmup`` (one run on the fingerprint's fixed input)."""
    c = config or LadderConfig()
    state: dict[str, Any] = {}

    def loaded() -> Outcome:
        ins, outs = runner.load(spec)
        state["inputs"], state["outputs"] = ins, outs
        desc = ", ".join(f"{s.name} {s.dtype}{list(s.shape)}" for s in ins)
        odesc = ", ".join(f"{s.name} {s.dtype}{list(s.shape)}" for s in outs)
        return Outcome(StepResult.PASS, f"{spec.name}: {desc} -> {odesc}")

    def warmup() -> Outcome:
        fp = spec.fingerprint
        if fp is None:
            if c.require_fingerprint:
                raise ModelError("no_fingerprint", f"{spec.name} has no recorded fingerprint")
            fp_seed = None
        else:
            fp_seed = int(fp["seed"])
        from chestnut.backend.fingerprint import DEFAULT_SEED

        # a runner whose program warps the frame (ModelSpec.warp) also runs the model on its own input, which
        # is what the fingerprint was recorded on
        specs = getattr(runner, "model_inputs", None) or state["inputs"]
        inputs = fixed_inputs(specs, fp_seed if fp_seed is not None else DEFAULT_SEED)
        outputs = runner.run(inputs)
        for name, a in outputs.items():
            if isinstance(a, np.ndarray) and a.dtype.kind == "f" and not np.isfinite(a).all():
                raise OutputLayerError("nonfinite", f"{name}: {int((~np.isfinite(a)).sum())} non-finite values")
        if fp is None:
            return Outcome(StepResult.WARN, "ran, but no fingerprint is recorded: output validity unverified",
                           "record one with `chestnut probe --record-fingerprint FILE --model MODEL`")
        check = compare(fp, outputs)
        if not check.ok:
            raise OutputLayerError("fingerprint_mismatch", check.detail)
        return Outcome(StepResult.PASS, check.detail)

    return [Step("model_loaded", c.load_bound_s, loaded), Step("warmup", c.warmup_bound_s, warmup)]


def full_ladder(runner: Any, spec: ModelSpec | None, config: LadderConfig | None = None,
                on_step: Callable[[LadderStep], None] | None = None) -> LadderReport:
    """``runner.qualify()`` then, if ``spec`` is given, the model rungs; stops at the first failure.

    ``on_step`` sees each rung as it is decided (the dock rungs after ``qualify()`` returns, unless the
    runner's ``qualify`` accepts ``on_step`` itself).
    """
    streamed = "on_step" in inspect.signature(runner.qualify).parameters
    try:
        report = runner.qualify(on_step=on_step) if streamed else runner.qualify()
    except ChestnutError as e:
        report, streamed = LadderReport(), False
        report.steps.append(LadderStep("usb_ids", Layer.USB, StepResult.FAIL, 0.0, f"{type(e).__name__} {e}",
                                       advice_for(e) or STEP_ADVICE["usb_ids"], e.reason, e))
    if not streamed and on_step is not None:
        for entry in report.steps:
            on_step(entry)
    if spec is not None:
        run_steps(model_steps(runner, spec, config), report, on_step=on_step)
    return report
