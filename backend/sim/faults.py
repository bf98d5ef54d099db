"""The twin's fault table: what can go wrong with the dock, when it fires, what the host sees.

Pure data and small classes, no I/O; the :class:`~chestnut.backend.sim.twin.Twin` owns one
:class:`FaultTable` and asks it at each *site* (a point where a fault of that kind can happen) whether
a fault fires there. Faults come from the dock's failure layers (``docs/health.md``) and public field
reports (transient I/O errors on working docks, openpilot#38519; a bridge wedged until power-cycled,
tinygrad#18137).

Activation (one :class:`FaultSpec` each, combinable):

- ``repeat=False`` (``--once``): fires at most once, then it is spent;
- ``repeat=True`` (``--repeat``): fires at every opportunity;
- ``repeat=None`` (neither given): once, except for the state-like kinds ``usb2``, ``slow_gpu`` and
  ``lock_held``, which last until cleared;
- ``probability`` (``--probability P``): each opportunity fires with probability P (seeded RNG);
- ``for_s`` (``--for SECONDS``): the fault exists for that long after injection, then expires;
- ``phase`` (``--phase loading|serving|recovering|idle``): opportunities count only in that phase;
- ``after`` (``--after N``): the first N opportunities are let through (N at most :data:`MAX_AFTER`);
- ``on`` (``--on``; transfer kinds only): which transfers are opportunities: ``any``, ``control``,
  ``control_in``, ``control_out``, ``bulk``, ``bulk_in``, ``bulk_out``, ``async``, or a vendor request
  number such as ``0xE4``.

The twin infers the phase from what it executes (:data:`PHASE_TRANSITIONS`): an ``OP_LOAD`` means
loading, a completed ``OP_RUN`` means serving, any fault firing (and any unplug, power-cycle or
re-enumeration) means recovering until the next completed run. A client may also set it.

Latching kinds (``disconnect``, ``wedged``, ``gpu_hang``, ``ltssm_down``, ``ltssm_stuck``, ``stall``)
leave a state behind when they fire; that state lasts until its recovery action
(:data:`KINDS` ``recovery``), not until the fault is cleared -- like hardware.

Fault events: the table records every ``armed`` (added), ``fired``, ``cleared`` (removed by a
client) and ``expired`` (spent or past ``for_s``) as a :class:`FaultEvent` in a bounded queue
(:data:`FaultTable.EVENTS`); the daemon drains it and publishes each as a ``twinFault`` message
(``msgs/chestnut.capnp``), so a one-shot fault that fires and is spent within a second is on the
record, which the 1 Hz ``twinState`` snapshot would miss.
"""

from __future__ import annotations

import json
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

from chestnut.msgs.paths import shown_cut


class Phase(StrEnum):
    """What the host is doing with the dock, as the twin infers it."""

    IDLE = "idle"              # nothing loaded since the twin started
    LOADING = "loading"        # an OP_LOAD was seen, no run completed since
    SERVING = "serving"        # a run completed since the last load
    RECOVERING = "recovering"  # a fault fired (or the dock was replugged/reset) and no run completed since


class PhaseEvent(StrEnum):
    LOAD = "load"
    RUN_OK = "run_ok"
    FAULT = "fault"


PHASE_TRANSITIONS: dict[tuple[Phase, PhaseEvent], Phase] = {
    (Phase.IDLE, PhaseEvent.LOAD): Phase.LOADING,
    (Phase.LOADING, PhaseEvent.LOAD): Phase.LOADING,
    (Phase.SERVING, PhaseEvent.LOAD): Phase.LOADING,
    (Phase.RECOVERING, PhaseEvent.LOAD): Phase.RECOVERING,
    (Phase.IDLE, PhaseEvent.RUN_OK): Phase.SERVING,
    (Phase.LOADING, PhaseEvent.RUN_OK): Phase.SERVING,
    (Phase.SERVING, PhaseEvent.RUN_OK): Phase.SERVING,
    (Phase.RECOVERING, PhaseEvent.RUN_OK): Phase.SERVING,
    (Phase.IDLE, PhaseEvent.FAULT): Phase.RECOVERING,
    (Phase.LOADING, PhaseEvent.FAULT): Phase.RECOVERING,
    (Phase.SERVING, PhaseEvent.FAULT): Phase.RECOVERING,
    (Phase.RECOVERING, PhaseEvent.FAULT): Phase.RECOVERING,
}


class Site(StrEnum):
    """Where a fault kind gets its opportunities."""

    TRANSFER = "transfer"  # a USB transfer (control or bulk) reaching the device
    LINK = "link"          # an LTSSM read, a 0xF3 power-on, or a TLP crossing the link
    TLP = "tlp"            # a non-posted TLP (config / single memory read) or a streaming read
    PACKET = "packet"      # the GPU engine starting a command packet
    COPYIN = "copyin"      # the engine waiting for a copy-in chunk's sentinel
    FENCE = "fence"        # the engine writing a fence (copy-in fence or queue fence)
    RUN = "run"            # the engine writing a program's outputs
    RECEIPT = "receipt"    # the host's first read of the fence / completion page after the fence moved
    STATE = "state"        # no opportunity: active while it exists (e.g. the lock file)


@dataclass(frozen=True)
class KindInfo:
    site: Site
    default_on: str   # default ``on`` filter (transfer kinds)
    latching: bool
    symptom: str
    recovery: str
    default_repeat: bool = False  # state-like kinds last until cleared unless --once is given
    recovers: bool = True         # firing moves the phase to "recovering" (the host will have to recover)


KINDS: dict[str, KindInfo] = {
    "disconnect": KindInfo(Site.TRANSFER, "any", True,
                           "the dock vanishes: that transfer and every later one fails LIBUSB_ERROR_NO_DEVICE "
                           "(pyusb errno 19); enumeration finds nothing",
                           "chestnut twin plug (comes back at a new address)"),
    "reenumerate": KindInfo(Site.TRANSFER, "any", False,
                            "the dock re-enumerates at a new address: open handles fail LIBUSB_ERROR_NO_DEVICE; "
                            "a process's cached device list still names the old address",
                            "a fresh process enumerates and opens the new address"),
    "usb2": KindInfo(Site.TRANSFER, "any", False,
                     "link speed 480 Mbps while the fault exists; vendor control reads over 64 bytes time out; "
                     "bulk OUT completes in full but only the first nbytes (default 32768) of each reach the device",
                     "clear the fault", default_repeat=True, recovers=False),
    "short": KindInfo(Site.TRANSFER, "bulk", False,
                      "the transfer moves fewer bytes than asked (nbytes, default half): a short bulk IN, "
                      "or a bulk OUT reporting fewer bytes written", "none: the next transfer is whole"),
    "timeout": KindInfo(Site.TRANSFER, "any", False,
                        "the device NAKs until the transfer's timeout: LIBUSB_ERROR_TIMEOUT (pyusb USBTimeoutError)",
                        "none: the next transfer goes through"),
    "async_error": KindInfo(Site.TRANSFER, "async", False,
                            "the async transfer completes with LIBUSB_TRANSFER_ERROR (status=1); tinygrad's USB3 "
                            "latches it and every later bulk_wait raises 'async bulk OUT failed: status=1'",
                            "a fresh process (the latch is never cleared)"),
    "stall": KindInfo(Site.TRANSFER, "bulk", True,
                      "the endpoint halts: LIBUSB_ERROR_PIPE (pyusb errno 32) on it until cleared",
                      "CLEAR_FEATURE(ENDPOINT_HALT) or SET_CONFIGURATION (a fresh USB3 open does this)"),
    "ltssm_down": KindInfo(Site.LINK, "any", True,
                           "the PCIe link drops: LTSSM reads 0x00; TLPs get no completion (ret_status != 0, "
                           "tinygrad: 'TLP error after retries'); streaming reads time out",
                           "0xF3 power on (retrains; a repeating fault keeps it down)"),
    "ltssm_stuck": KindInfo(Site.LINK, "any", True,
                            "the link trains into 0x4C and sticks there; TLPs get no completion",
                            "0xF3 power on (retrains; a repeating fault sticks again)"),
    "bad_tlp": KindInfo(Site.TLP, "any", False,
                        "the TLP completes with status UR or CA (status param, default ca); a streaming read "
                        "returns all-ones", "none: the next TLP completes normally"),
    "fence_stall": KindInfo(Site.FENCE, "any", False,
                            "the GPU does the work (copies, clears the sentinel) but its fence writes are skipped from "
                            "then on: the transfers succeed, the fence never moves",
                            "GPU reset: 0xF3 off then on (a fresh driver's init), power-cycle or a brown-out"),
    "lost_receipt": KindInfo(Site.RECEIPT, "any", False,
                             "the fence moved, but the host's next XDATA read of the fence or completion page "
                             "never returns: LIBUSB_ERROR_TIMEOUT", "none: the following read returns"),
    "sentinel_stuck": KindInfo(Site.COPYIN, "any", False,
                               "the GPU never sees the copy-in sentinel: it stays in SRAM, the engine keeps "
                               "waiting, the fence never moves", "queue reset doorbell or GPU reset"),
    "gpu_hang": KindInfo(Site.PACKET, "any", True,
                         "the engine stops: no packet completes, fences stop", "GPU reset: 0xF3 off then on, "
                         "chestnut twin power-cycle, or a brown-out"),
    "slow_gpu": KindInfo(Site.PACKET, "any", False,
                         "each unit of work starts delay_ms (default 500) late: a COPY_LINEAR on the SDMA queue, "
                         "a packet on the program engine", "clear the fault",
                         default_repeat=True, recovers=False),
    "nan_output": KindInfo(Site.RUN, "any", False, "a run's float outputs are all NaN", "none"),
    "stale_output": KindInfo(Site.RUN, "any", False,
                             "a run's outputs are the previous run's outputs of that program", "none"),
    "zero_output": KindInfo(Site.RUN, "any", False, "a run's outputs are all zeros", "none"),
    "wedged": KindInfo(Site.TRANSFER, "any", True,
                       "the bridge firmware wedges: every vendor request and bulk transfer NAKs until its timeout "
                       "(standard requests still answer, so the dock still enumerates and opens)",
                       "chestnut twin power-cycle"),
    "brownout": KindInfo(Site.TRANSFER, "any", False,
                         "the dock loses power: gone (LIBUSB_ERROR_NO_DEVICE), VRAM, SRAM, XDATA and loaded "
                         "programs lost; back after off_s (default 2) at a new address, PCIe powered off",
                         "automatic after off_s"),
    "lock_held": KindInfo(Site.STATE, "any", False,
                          "another process (the twin daemon) holds tinygrad's exclusive flock on "
                          "<tempdir>/am_usb:<bus>-<address>.lock: tinygrad fails 'Failed to acquire lock file'",
                          "clear the fault (or --for expiry)", default_repeat=True, recovers=False),
}

TRANSFER_TARGETS = ("any", "control", "control_in", "control_out", "bulk", "bulk_in", "bulk_out", "async")
TLP_STATUSES = ("ur", "ca")


@dataclass(frozen=True)
class TransferSite:
    """One USB transfer as a fault opportunity: ``direction`` "in"/"out", ``type`` "control"/"bulk"."""

    direction: str
    type: str
    request: int | None = None  # bRequest of a control transfer
    is_async: bool = False
    vendor: bool = True         # a vendor request or a bulk transfer (the firmware's job)


def describe_site(kind: str, site: TransferSite | None, opportunity: int) -> str:
    """What a firing hit, for the record: ``"bulk out"``, ``"control in 0xe4 async"``, ``"packet #12"``."""
    if site is None:
        return f"{KINDS[kind].site.value} #{opportunity}"
    parts = [site.type, site.direction]
    if site.request is not None:
        parts.append(f"{site.request:#04x}")
    if site.is_async:
        parts.append("async")
    return " ".join(parts) + f" #{opportunity}"


@dataclass(frozen=True)
class FaultEvent:
    """One fault event: ``action`` armed | fired | cleared | expired, at ``t_s`` on the twin's clock (s)."""

    fault_id: int
    kind: str
    action: str
    t_s: float
    params: str          # the FaultSpec's non-default parameters as JSON (sorted keys), "{}" for none
    site: str = ""       # fired: what it hit (describe_site)
    fired: int = 0
    opportunities: int = 0


def target_matches(on: str, site: TransferSite) -> bool:
    """Whether the ``on`` filter (see module doc) selects this transfer."""
    if on == "any":
        return True
    if on == "async":
        return site.is_async
    if on in ("control", "bulk"):
        return site.type == on
    if on in ("control_in", "control_out", "bulk_in", "bulk_out"):
        return f"{site.type}_{site.direction}" == on
    return site.type == "control" and site.request == int(on, 0)


MAX_AFTER = 2**32 - 2
"""Upper bound of ``after`` (``--after N``), opportunities: the fault fires at opportunity ``after + 1``, and a fault's
opportunities are published as ``twinFault.opportunities``, a UInt32 (``msgs/chestnut.capnp``), which cannot carry
a count past 4294967295 (pycapnp refuses it: "Value out-of-range"). A larger ``after`` (``after=1e23``) is a typo:
the fault could never fire in a run the log can describe."""
PARAMETER_LIMITS: dict[str, tuple[float | int, str]] = {
    "for_s": (7 * 24 * 3600.0, "s (a week: the longest chestnut launch run, msgs/argtypes.py MAX_RUN_SECONDS)"),
    "delay_ms": (60_000.0, "ms (20x the 3000 ms wait timeout: any longer is a hang, gpu_hang)"),
    "off_s": (3600.0, "s (longer off is an unplug: chestnut twin unplug)"),
    "nbytes": (1 << 30, "bytes (1 GiB, more than any transfer the node makes)"),
    "after": (MAX_AFTER, "opportunities (it fires at opportunity after + 1, and twinFault.opportunities is a UInt32: "
                         "msgs/chestnut.capnp)"),
}
"""Upper bounds of the numeric fault parameters: a fault is a test of the node, and a value past these is a
typo (``--for 1e300``, ``--delay-ms 1e12``, ``--after 1e23``) that would leave the twin in a state no run outlives,
or a fault that never fires."""


def _shown(x: float, whole: bool) -> str:
    """A parameter or its bound in a refusal: a count (``whole``: ``after``, ``nbytes``; a launch plan gives it as a
    float) as a whole number up to 16 digits (``:g`` rounded 4294967295 to 4.29497e+09, which reads as within a
    bound of 4294967294), else and any other as ``:g`` (``1e+23``)."""
    return str(int(x)) if whole and abs(x) < 1e16 else f"{x:g}"
PARAMETER_KINDS = {"delay_ms": ("slow_gpu",), "off_s": ("brownout",), "status": ("bad_tlp",),
                   "nbytes": ("short", "usb2")}
"""The kinds each kind-specific parameter applies to (the twin reads it only there: ``backend/sim/engine.py``,
``sdma.py``, ``twin.py``); given, other than its default, to another kind it is refused, not ignored."""
_FLAGS = {"for_s": "for_s (--for)", "delay_ms": "delay_ms (--delay-ms)", "off_s": "off_s (--off-s)",
          "nbytes": "nbytes (--nbytes)", "status": "status (--status)", "after": "after (--after)",
          "probability": "probability (--probability)"}  # a launch plan's name, twin fault's flag


@dataclass(frozen=True)
class FaultSpec:
    """One fault to inject. Raises ``ValueError`` from :meth:`validate` for an unknown kind or bad parameter."""

    kind: str
    repeat: bool | None = None   # None: the kind's default (KindInfo.default_repeat)
    probability: float = 1.0
    for_s: float | None = None
    phase: str | None = None
    after: int = 0
    on: str | None = None
    status: str = "ca"           # bad_tlp: "ur" (Unsupported Request) or "ca" (Completer Abort)
    delay_ms: float = 500.0      # slow_gpu: added latency per packet
    off_s: float = 2.0           # brownout: how long the dock stays gone
    nbytes: int | None = None    # short: bytes moved (default half); usb2: bytes of a bulk OUT kept (default 32768)
    seed: int | None = None      # probability RNG seed

    def validate(self) -> FaultSpec:
        """This spec, checked: raises ``ValueError`` (one line naming the parameter and how to fix it) for an
        unknown kind, a parameter of the wrong type (``delay_ms=abc``) or one out of range."""
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {', '.join(KINDS)}")
        for name, (integral, optional, what) in _NUMBER_FIELDS.items():
            value = getattr(self, name)
            if value is None and optional:
                continue
            is_number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if not is_number or (integral and not float(value).is_integer()):
                raise ValueError(f"{_FLAGS.get(name, name)} = {value!r} is not {what}; give e.g. "
                                 f"{name}={_SPEC_EXAMPLES[name]}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability {self.probability} is not in [0, 1]")
        if self.for_s is not None and not self.for_s > 0:
            raise ValueError(f"--for {self.for_s}: give a positive number of seconds")
        if self.phase is not None and self.phase not in {p.value for p in Phase}:
            raise ValueError(f"phase {self.phase!r}; known: {', '.join(p.value for p in Phase)}")
        if self.after < 0:
            raise ValueError(f"after {self.after}: give a count >= 0")
        if self.on is not None:
            if KINDS[self.kind].site is not Site.TRANSFER and self.on != "any":
                raise ValueError(f"--on applies to transfer faults, not {self.kind}")
            if self.on not in TRANSFER_TARGETS:
                try:
                    req = int(self.on, 0)
                except ValueError:
                    raise ValueError(f"--on {shown_cut(self.on)}; use one of {', '.join(TRANSFER_TARGETS)} or a "
                                     "request number like 0xE4") from None
                if not 0 <= req <= 0xFF:
                    raise ValueError(f"--on {shown_cut(self.on)}: a request number is one byte")
        if self.status not in TLP_STATUSES:
            raise ValueError(f"status {self.status!r}; use ur or ca")
        for name in ("delay_ms", "off_s"):
            if (value := getattr(self, name)) < 0:
                raise ValueError(f"{_FLAGS[name]} = {value:g}: give a value >= 0")
        if self.nbytes is not None and self.nbytes < 0:
            raise ValueError(f"{_FLAGS['nbytes']} = {self.nbytes:g}: give a byte count >= 0")
        for name, (limit, unit) in PARAMETER_LIMITS.items():
            if (value := getattr(self, name)) is not None and value > limit:
                whole = _NUMBER_FIELDS[name][0]  # a count: said whole, as given
                raise ValueError(f"{_FLAGS[name]} = {_shown(value, whole)}: at most {_shown(limit, whole)} {unit}")
        for name, kinds in PARAMETER_KINDS.items():
            if getattr(self, name) != _SPEC_DEFAULTS[name] and self.kind not in kinds:
                raise ValueError(f"{_FLAGS[name]} applies to {' and '.join(kinds)}, not {self.kind}")
        return self

    @property
    def repeats(self) -> bool:
        return KINDS[self.kind].default_repeat if self.repeat is None else self.repeat

    @property
    def target(self) -> str:
        return self.on if self.on is not None else KINDS[self.kind].default_on

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def non_defaults(self) -> dict[str, Any]:
        """The parameters given beyond the kind: the fields that differ from their defaults."""
        return {k: v for k, v in asdict(self).items() if k != "kind" and v != _SPEC_DEFAULTS[k]}

    def describe(self) -> str:
        """The fault for a log line: its kind, then each parameter given beyond the kind as ``key=value``
        (``"slow_gpu delay_ms=400 for_s=10"``, ``"gpu_hang"`` for the kind's defaults), not the dataclass's repr."""
        def shown(v: Any) -> str:
            if isinstance(v, bool):
                return "yes" if v else "no"
            return f"{v:g}" if isinstance(v, float) else str(v)
        return " ".join([self.kind, *(f"{k}={shown(v)}" for k, v in self.non_defaults().items())])

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FaultSpec:
        names = set(cls.__dataclass_fields__)
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown fault fields {sorted(unknown)}")
        try:
            return cls(**d).validate()
        except TypeError as e:
            raise ValueError(str(e)) from None


_SPEC_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(FaultSpec)}

# FaultSpec's numeric parameters: name -> (integral, may be None, what it is)
_NUMBER_FIELDS: dict[str, tuple[bool, bool, str]] = {
    "probability": (False, False, "a probability (a number in [0, 1])"),
    "for_s": (False, True, "a duration in seconds"),
    "after": (True, False, "a count"),
    "delay_ms": (False, False, "a delay in milliseconds"),
    "off_s": (False, False, "a duration in seconds"),
    "nbytes": (True, True, "a byte count"),
    "seed": (True, True, "an integer seed"),
}
_SPEC_EXAMPLES = {"probability": 0.5, "for_s": 10, "after": 3, "delay_ms": 400, "off_s": 2, "nbytes": 4096, "seed": 1}


def spent_on_expiry(kind: str, params: str, fired: int) -> bool:
    """Whether an ``expired`` event of a fault of ``kind`` (``params``: its :class:`FaultEvent` ``params``, the JSON of
    the parameters given) that has ``fired`` times is the fault used up by firing -- it fired and does not repeat,
    so it was spent as it fired (:meth:`Fault.expired`) -- not one whose ``for_s`` ended. False for parameters that
    do not read as a fault's."""
    if fired < 1:
        return False
    try:
        given = json.loads(params or "{}")
        return not FaultSpec.from_json({**given, "kind": kind}).repeats
    except (ValueError, TypeError):
        return False


@dataclass
class Fault:
    """An injected fault and its counters. ``fired`` counts firings, ``opportunities`` the sites it saw."""

    id: int
    spec: FaultSpec
    created_s: float
    opportunities: int = 0
    fired: int = 0
    last_fired_s: float | None = None
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def expired(self, now_s: float) -> bool:
        if self.spec.for_s is not None and now_s - self.created_s >= self.spec.for_s:
            return True
        return not self.spec.repeats and self.fired >= 1

    def armed(self, now_s: float, phase: Phase) -> bool:
        return not self.expired(now_s) and (self.spec.phase is None or self.spec.phase == phase.value)

    def to_json(self, now_s: float) -> dict[str, Any]:
        return {"id": self.id, **self.spec.to_json(), "opportunities": self.opportunities, "fired": self.fired,
                "age_s": round(now_s - self.created_s, 3), "expired": self.expired(now_s),
                "symptom": KINDS[self.spec.kind].symptom, "recovery": KINDS[self.spec.kind].recovery}


class FaultTable:
    """The injected faults, in injection order. Not thread-safe: the Twin guards it with its lock."""

    HISTORY = 64  # expired faults kept for ``status``
    EVENTS = 1024  # fault events kept until drained; older ones are dropped (and counted) when nobody drains

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._history: list[Fault] = []
        self._next_id = 1
        self._events: deque[FaultEvent] = deque(maxlen=self.EVENTS)
        self.events_dropped = 0

    def _event(self, f: Fault, action: str, now_s: float, site: str = "") -> None:
        if len(self._events) == self._events.maxlen:
            self.events_dropped += 1
        params = json.dumps(f.spec.non_defaults(), sort_keys=True)
        self._events.append(FaultEvent(f.id, f.spec.kind, action, now_s, params, site, f.fired, f.opportunities))

    def drain_events(self) -> list[FaultEvent]:
        """The fault events since the last drain, oldest first."""
        out = list(self._events)
        self._events.clear()
        return out

    def add(self, spec: FaultSpec, now_s: float) -> Fault:
        spec.validate()
        fault = Fault(self._next_id, spec, now_s, rng=random.Random(spec.seed))
        self._next_id += 1
        self._faults.append(fault)
        self._event(fault, "armed", now_s)
        return fault

    def clear(self, fault_id: int | None = None, now_s: float | None = None) -> list[Fault]:
        """Remove one fault (by id) or all; returns the removed ones. ``now_s`` stamps the ``cleared``
        events (default: each fault's last firing or injection time)."""
        removed = [f for f in self._faults if fault_id is None or f.id == fault_id]
        self._faults = [f for f in self._faults if f not in removed]
        self._remember(removed)
        for f in removed:
            t = now_s if now_s is not None else (f.last_fired_s if f.last_fired_s is not None else f.created_s)
            self._event(f, "cleared", t)
        return removed

    def _remember(self, faults: list[Fault]) -> None:
        self._history = (self._history + faults)[-self.HISTORY:]

    def prune(self, now_s: float) -> list[Fault]:
        """Drop expired faults; returns them."""
        gone = [f for f in self._faults if f.expired(now_s)]
        if gone:
            self._faults = [f for f in self._faults if f not in gone]
            self._remember(gone)
            for f in gone:
                self._event(f, "expired", now_s)
        return gone

    def has(self, kind: str) -> bool:
        return any(f.spec.kind == kind for f in self._faults)

    def active(self, kind: str, now_s: float, phase: Phase) -> Fault | None:
        """The first armed fault of ``kind`` without consuming an opportunity (state-like faults)."""
        return next((f for f in self._faults if f.spec.kind == kind and f.armed(now_s, phase)), None)

    def check(self, kind: str, now_s: float, phase: Phase, site: TransferSite | None = None) -> Fault | None:
        """One opportunity for faults of ``kind``: the fault that fires, or None."""
        if not self._faults:
            return None
        for f in self._faults:
            if f.spec.kind != kind or not f.armed(now_s, phase):
                continue
            if site is not None and not target_matches(f.spec.target, site):
                continue
            f.opportunities += 1
            if f.opportunities <= f.spec.after:
                continue
            if f.spec.probability < 1.0 and f.rng.random() >= f.spec.probability:
                continue
            f.fired += 1
            f.last_fired_s = now_s
            self._event(f, "fired", now_s, describe_site(kind, site, f.opportunities))
            return f
        return None

    def entries(self, now_s: float) -> list[dict[str, Any]]:
        return [f.to_json(now_s) for f in self._faults]

    def history(self, now_s: float) -> list[dict[str, Any]]:
        return [f.to_json(now_s) for f in self._history]


def collapse_fired(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The twin's fault events (``twinFault``, as ``chestnut launch``'s summary keeps them,
    ``launch/summary.py``) with a repeating fault's fires after its first folded into that first one, whose ``site``
    then reads ``packet #1; fired N times, the last at t=T s``. A repeating fault fires on every packet it hits (a
    30 s ``slow_gpu``: 3000 fires), which as one row each buried the summary's other tables. The events given are
    not changed."""
    out: list[dict[str, Any]] = []
    first: dict[str, tuple[dict[str, Any], list[float]]] = {}  # fault -> (its first fire, [count, last t])
    for e in events:
        if e["action"] != "fired":
            out.append(e)
        elif (seen := first.get(e["fault"])) is None:
            first[e["fault"]] = (row := dict(e), [1, e["t_s"]])
            out.append(row)
        else:
            seen[1][0] += 1
            seen[1][1] = e["t_s"]
    for row, (count, last) in first.values():
        if count > 1:
            row["site"] = f"{row['site'] or 'a packet'}; fired {count:g} times, the last at t={last:.1f} s"
    return out
