"""Per-layer health of the dock and ``ChestnutActive``.

Four layers, ``usb`` -> ``pcie`` -> ``gpu`` -> ``output``; a good lower layer never implies a good
upper one. Each layer has a :class:`LayerStatus`: a level (OK / WARN / ERROR / STALE, ROS 2
``diagnostic_msgs/DiagnosticStatus``), a reason, counters, the time its level last changed and the
time of its last evidence.

Evidence (:class:`Evidence`) comes from the backend's typed errors, the qualification ladder, the
watchdog, the worker's successful runs, dock probes and the output checks; the ``evidence_from_*``
functions turn each into plain data. :class:`HealthMonitor` applies it with debouncing and
hysteresis (the AUTOSAR watchdog manager's pattern):

- a *hard* bad observation (a typed error, a failed ladder step, a hung worker, a non-finite
  output ...) makes the layer ERROR at once;
- a *soft* bad observation (an LTSSM read from a probe, a stale or disagreeing output) makes it
  ERROR only after ``fail_after`` consecutive ones (openpilot's hardware daemon declares PCIe
  failed after two consecutive bad LTSSM reads); before that the level is unchanged and the
  ``bad_run`` counter shows the suspicion;
- WARN evidence (usable with a known hazard: a USB 2 link, one late frame) applies at once;
- improving from ERROR takes ``recover_after`` consecutive good (OK or WARN) observations (and, with
  ``hold_until_reported``, a report that carried the ERROR);
- evidence that only rates a frame other evidence already observed (the stage budget's,
  :attr:`Evidence.counted` False) updates its source's condition and its tag's counter but no run:
  it neither debounces nor recovers a layer;
- outside ERROR the layer's level is the **worst of its current evidence**, one condition per
  evidence *source* (:attr:`Evidence.source`: the per-frame stream ``""`` -- runs, the watchdog,
  typed errors --, the dock ``"probe"``, the ``"transfers"`` counters, the ``"copy_path"`` timing, the
  ``"stage_budget"`` (:class:`StageBudget`), the ``"ladder"``), each current for its own freshness
  (:attr:`Evidence.fresh_ms`; default ``stale_after_ms``). A condition that still holds keeps its
  level: a USB 2 link reported by every probe keeps the layer WARN however many frames complete in
  between (ROS ``diagnostic_aggregator``: a group is as bad as its worst child). One source's WARN
  clears after ``recover_after`` consecutive OKs *from that source*, or when that source stops being
  current;
- no current evidence from any source turns an OK or WARN layer STALE (a layer with no evidence
  yet starts STALE). An ERROR layer stays ERROR: positive evidence of a fault does not expire
  by silence, only good observations clear it.

Levels keep the schema's wire values (ok=0, warn=1, error=2, stale=3) but are *ranked*
OK < WARN < STALE < ERROR (:data:`SEVERITY`, :func:`worst`): an ERROR is evidence of a fault,
STALE only the absence of evidence. ``max()`` over raw levels would rank STALE worst; use
:func:`worst`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

from chestnut.backend.classify import diagnose, link_speed_text
from chestnut.backend.errors import LAYER_ERRORS, ChestnutError, Layer
from chestnut.backend.interface import DockObservation, LadderReport, LadderStep, StepResult
from chestnut.backend.real_runner import COPY_STATS_KEY
from chestnut.backend.retry import STATS_KEY
from chestnut.backend.stages import STAGE_NAMES, STAGES, StageTimes
from chestnut.node.supervisor import Source
from chestnut.node.validity import ValidityReport
from chestnut.node.watchdog import FRAME_DEADLINE_MS, ActionKind, WatchdogAction

NS_PER_MS = 1_000_000

LAYERS: tuple[Layer, ...] = (Layer.USB, Layer.PCIE, Layer.GPU, Layer.OUTPUT)
"""The layers, bottom up; the order of ``ChestnutHealth.layers`` and of ``chestnut_active``'s search."""

LTSSM_L0 = 0x78  # tinygrad 0.14 CustomASM24Controller: LTSSM byte at XDATA 0xB450 reads 0x78 with the link up
LTSSM_STUCK = 0x4C  # a link that trains into 0x4C and sticks there: a known firmware failure
SUPERSPEED_MBPS = 5000  # openpilot's hardware daemon: slower than 5000 Mbps is a slow USB link
PROBE_FRESH_MS = 2500.0  # a dock probe's evidence holds for 2.5 periods of the node's 1 Hz probe (one lost probe)
LADDER_FRESH_MS = 3000.0  # the ladder's evidence holds until the first probes of the new worker take over
# copies at under a quarter of the rate this link first gave them: a marginal link (retries and re-sent
# transfers, or a USB 2 fallback ~10x slower, backend/ladder.py USB2_HAZARDS), not a busy host's 2x
MARGINAL_COPY_RATIO = 0.25
FENCE_MARGIN_RATIO = 0.5  # a frame's fence taking over half the wait timeout: one slow step from a failure
FIELD_TRANSIENT_ERRORS_PER_H = 815.0
"""The most bulk / 0xE4 I/O errors per hour seen on docks that work (openpilot#38519): transient
transfer errors up to this rate are counted (usb OK), above it the usb layer is WARN with the rate."""


class Level(IntEnum):
    """ROS 2 diagnostic levels; the values are the schema's ``Level`` wire values. Rank with :func:`worst`."""

    OK = 0
    WARN = 1
    ERROR = 2
    STALE = 3

    @property
    def severity(self) -> int:
        return SEVERITY[self]


SEVERITY: dict[Level, int] = {Level.OK: 0, Level.WARN: 1, Level.STALE: 2, Level.ERROR: 3}
"""Ranking for aggregation: OK < WARN < STALE < ERROR."""


def worst(levels: Iterable[Level]) -> Level:
    """The most severe level by :data:`SEVERITY` (ERROR over STALE); OK for no levels."""
    return max(levels, key=SEVERITY.__getitem__, default=Level.OK)


@dataclass(frozen=True)
class Evidence:
    """One observation of one layer. ``level`` is OK, WARN or ERROR (STALE is never observed, only
    inferred). ``hard`` ERRORs apply at once; soft ones are debounced. ``tag`` names the counter a
    bad observation bumps (e.g. ``"disconnect"``, ``"deadline_miss"``)."""

    layer: Layer
    level: Level
    reason: str
    hard: bool = False
    tag: str = ""
    source: str = ""              # the condition this evidence speaks for (module doc); "" = the per-frame stream
    fresh_ms: float | None = None  # how long it stays current; None: the layer's ``stale_after_ms``
    counters: tuple[tuple[str, int], ...] = ()  # absolute counter values it reports (set, not added)
    counted: bool = True  # False: a rating of a frame other evidence already observed (module doc)
    advisory: bool = False  # a WARN that informs: shown, but the layer still counts as OK for ChestnutActive

    def __post_init__(self) -> None:
        if self.level is Level.STALE:
            raise ValueError("STALE is inferred from missing evidence, never observed")
        if self.fresh_ms is not None and not self.fresh_ms > 0:
            raise ValueError("fresh_ms must be > 0")
        if not self.counted and self.level is Level.ERROR:
            raise ValueError("an ERROR is always counted")
        if self.advisory and self.level is not Level.WARN:
            raise ValueError("only a WARN is advisory")


@dataclass
class Condition:
    """What one evidence source last said about a layer (OK or WARN), and until when it holds (ns)."""

    level: Level
    reason: str
    at_ns: int
    fresh_ns: int
    ok_run: int = 0  # consecutive OKs from this source while it holds a WARN
    advisory: bool = False  # a WARN that informs (Evidence.advisory)

    def current(self, now_ns: int) -> bool:
        return now_ns - self.at_ns <= self.fresh_ns


@dataclass(frozen=True)
class DebounceConfig:
    """Debouncing of one layer: ``fail_after`` consecutive soft bad observations make it ERROR,
    ``recover_after`` consecutive good ones clear a fault, ``stale_after_ms`` without evidence make it STALE."""

    fail_after: int = 1
    recover_after: int = 3
    stale_after_ms: float = 1000.0

    def __post_init__(self) -> None:
        if self.fail_after < 1 or self.recover_after < 1 or self.stale_after_ms <= 0:
            raise ValueError("fail_after and recover_after must be >= 1 and stale_after_ms > 0")


DEFAULT_DEBOUNCE: dict[Layer, DebounceConfig] = {
    Layer.USB: DebounceConfig(fail_after=2),
    Layer.PCIE: DebounceConfig(fail_after=2),  # openpilot: PCIe failed after two consecutive bad LTSSM reads
    Layer.GPU: DebounceConfig(fail_after=1),
    Layer.OUTPUT: DebounceConfig(fail_after=3),  # stale / disagreeing outputs: a run of 3 frames
}
"""Per-layer defaults. ``recover_after=3`` (0.15 s of good frames at 20 Hz) and ``stale_after_ms=1000``
(20 frames at 20 Hz) are our choices: both well inside the 20 shadow frames a return needs."""


@dataclass(frozen=True)
class LayerStatus:
    """A snapshot of one layer (``LayerHealth`` in the schema). Times in ns, CLOCK_MONOTONIC; 0 = never."""

    layer: Layer
    level: Level
    reason: str
    counters: Mapping[str, int] = field(default_factory=dict)
    last_change_ns: int = 0
    last_evidence_ns: int = 0
    advisory: bool = False  # WARN only for advisory conditions: the layer counts as OK (:func:`layer_usable`)


@dataclass(frozen=True)
class LayerChange:
    """A layer's level changed (returned by :meth:`HealthMonitor.apply` / :meth:`HealthMonitor.refresh`)."""

    layer: Layer
    old: Level
    new: Level
    reason: str
    at_ns: int


class LayerMonitor:
    """One layer's debounced level (see the module docstring for the rules)."""

    def __init__(self, layer: Layer, config: DebounceConfig | None = None, hold_until_reported: bool = False) -> None:
        self.layer = layer
        self.config = config or DEFAULT_DEBOUNCE[layer]
        self.hold_until_reported = hold_until_reported
        self.error_reported = True  # the current ERROR (if any) has been carried by a report
        self._stale_ns = int(self.config.stale_after_ms * NS_PER_MS)
        self.debounced = Level.OK  # the level the evidence supports (OK / WARN / ERROR)
        self.level = Level.STALE  # what is published: debounced, or STALE without fresh evidence
        self.reason = "no evidence yet"
        self.advisory = False  # the published WARN is advisory only (every current WARN condition informs)
        self._debounced_reason = ""  # while ERROR: the fault and its recovery progress
        self.fault_reason = ""
        self.last_change_ns = 0
        self.last_evidence_ns: int | None = None
        self.bad_run = 0  # consecutive bad observations
        self.ok_run = 0  # consecutive OK observations
        self.usable_run = 0  # consecutive OK-or-WARN observations
        self.conditions: dict[str, Condition] = {}  # evidence source -> its current condition
        self.counters: dict[str, int] = {"observations": 0, "bad": 0, "faults": 0, "recoveries": 0, "stale": 0}

    def observe(self, ev: Evidence, now_ns: int) -> LayerChange | None:
        """Apply one observation at ``now_ns``; returns the change of the published level, if any."""
        if ev.layer is not self.layer:
            raise ValueError(f"evidence for {ev.layer.value} given to the {self.layer.value} layer")
        c = self.config
        self.counters["observations"] += 1
        self.counters.update(ev.counters)
        self.last_evidence_ns = now_ns
        if not ev.counted:  # it only rates a frame already observed: its source's condition, not the runs
            if ev.level is Level.WARN and ev.tag:
                self.counters[ev.tag] = self.counters.get(ev.tag, 0) + 1
            self._condition(ev, now_ns)
            return self.refresh(now_ns)
        if ev.level is Level.ERROR:
            self.counters["bad"] += 1
            if ev.tag:
                self.counters[ev.tag] = self.counters.get(ev.tag, 0) + 1
            self.bad_run += 1
            self.ok_run = self.usable_run = 0
            if ev.hard or self.bad_run >= c.fail_after:
                if self.debounced is not Level.ERROR:
                    self.counters["faults"] += 1
                    self.error_reported = not self.hold_until_reported
                self.debounced, self.fault_reason = Level.ERROR, ev.reason
                self._debounced_reason = ev.reason
        else:
            self.bad_run = 0
            self.usable_run += 1
            self.ok_run = self.ok_run + 1 if ev.level is Level.OK else 0
            if ev.level is Level.WARN and ev.tag:
                self.counters[ev.tag] = self.counters.get(ev.tag, 0) + 1
            self._condition(ev, now_ns)
            if self.debounced is Level.ERROR:
                self._try_recover()
        return self.refresh(now_ns)

    def _try_recover(self) -> None:
        """Leave ERROR after ``recover_after`` consecutive usable observations -- once a report has carried
        the ERROR, when the layer holds unreported errors."""
        c = self.config
        if self.usable_run >= c.recover_after and self.error_reported:
            self.counters["recoveries"] += 1
            self.debounced = Level.OK  # from here on: the worst current condition
        elif self.usable_run >= c.recover_after:
            self._debounced_reason = f"{self.fault_reason} (recovered: {self.usable_run} good; shown until reported)"
        else:
            self._debounced_reason = f"{self.fault_reason} (recovering: {self.usable_run}/{c.recover_after} good)"

    def reported(self, now_ns: int) -> LayerChange | None:
        """A report (``chestnutHealth``) has carried this layer's status: a held ERROR whose recovery is
        already earned clears now. Returns the change of the published level, if any."""
        self.error_reported = True
        if self.debounced is Level.ERROR and self.usable_run >= self.config.recover_after:
            self._try_recover()  # only a held recovery changes: a current fault keeps its reason as it is
        return self.refresh(now_ns)

    def _condition(self, ev: Evidence, now_ns: int) -> None:
        """Update the condition of ``ev``'s source with one OK or WARN observation."""
        fresh_ns = int(ev.fresh_ms * NS_PER_MS) if ev.fresh_ms is not None else self._stale_ns
        cond = self.conditions.get(ev.source)
        if ev.level is Level.WARN or cond is None or cond.level is not Level.WARN or not cond.current(now_ns):
            self.conditions[ev.source] = Condition(ev.level, ev.reason, now_ns, fresh_ns, advisory=ev.advisory)
            return
        cond.ok_run += 1  # an OK from a source that holds a WARN: the WARN clears with hysteresis
        cond.at_ns, cond.fresh_ns = now_ns, fresh_ns
        if cond.ok_run >= self.config.recover_after:
            self.conditions[ev.source] = Condition(Level.OK, ev.reason, now_ns, fresh_ns)

    def current(self, now_ns: int) -> Condition | None:
        """The worst current condition, a WARN that does not inform ranked above an advisory one (the first
        source to report it wins a tie), or None if none is current."""
        best: Condition | None = None
        for cond in self.conditions.values():
            if cond.current(now_ns) and (best is None or (cond.level.severity, not cond.advisory)
                                         > (best.level.severity, not best.advisory)):
                best = cond
        return best

    def refresh(self, now_ns: int) -> LayerChange | None:
        """Re-evaluate the level at ``now_ns``: ERROR while faulted, else the worst current condition, else STALE."""
        if self.debounced is Level.ERROR:
            return self._publish(Level.ERROR, self._debounced_reason, now_ns)
        if self.last_evidence_ns is None:
            return self._publish(Level.STALE, "no evidence yet", now_ns)
        cond = self.current(now_ns)
        if cond is None and not self.conditions:
            return self._publish(Level.STALE, "no good evidence yet", now_ns)
        if cond is None:  # the last to expire says how old the evidence is
            last = max(self.conditions.values(), key=lambda c: c.at_ns + c.fresh_ns)
            return self._publish(Level.STALE, f"no evidence for {(now_ns - last.at_ns) / NS_PER_MS:.0f} ms "
                                 f"(window {last.fresh_ns / NS_PER_MS:.0f} ms)", now_ns)
        return self._publish(cond.level, cond.reason, now_ns, advisory=cond.advisory)

    def _publish(self, level: Level, reason: str, now_ns: int, advisory: bool = False) -> LayerChange | None:
        """Set the published level; ``last_change_ns`` moves when the level or its advisory flag changes (a
        WARN that turns advisory or back changes ``ChestnutActive``); a change is returned for the level's."""
        old, old_advisory = self.level, self.advisory
        self.level, self.reason, self.advisory = level, reason, advisory
        if level is old:
            if advisory != old_advisory:
                self.last_change_ns = now_ns
            return None
        if level is Level.STALE:
            self.counters["stale"] += 1
        self.last_change_ns = now_ns
        return LayerChange(self.layer, old, level, reason, now_ns)

    def status(self) -> LayerStatus:
        counters = dict(self.counters, bad_run=self.bad_run, good_run=self.usable_run)
        return LayerStatus(self.layer, self.level, self.reason, counters, self.last_change_ns,
                           self.last_evidence_ns or 0, self.advisory)


class HealthMonitor:
    """The four layers. ``apply`` evidence as it arrives and ``refresh`` periodically (staleness).

    ``hold_until_reported``: a layer that turns ERROR stays ERROR, its recovery earned or not, until
    :meth:`reported` says a report carried it -- so a fault that clears within one report period (a link
    retrained in 21 ms, three good frames in 150 ms, all between two 5 Hz ``chestnutHealth`` messages) is
    still published, and a log reconstructs the layer's level at every instant from the reports alone.
    """

    def __init__(self, configs: Mapping[Layer, DebounceConfig] | None = None,
                 hold_until_reported: bool = False) -> None:
        cfg = {**DEFAULT_DEBOUNCE, **(configs or {})}
        self.layers: dict[Layer, LayerMonitor] = {
            la: LayerMonitor(la, cfg[la], hold_until_reported) for la in LAYERS}

    def apply(self, evidence: Iterable[Evidence], now_ns: int) -> list[LayerChange]:
        """Apply observations in order, then refresh every layer's staleness at ``now_ns``.
        Returns the published level changes, in order (a layer may appear more than once)."""
        changes = [ch for ev in evidence if (ch := self.layers[ev.layer].observe(ev, now_ns)) is not None]
        return changes + self.refresh(now_ns)

    def refresh(self, now_ns: int) -> list[LayerChange]:
        return [ch for m in self.layers.values() if (ch := m.refresh(now_ns)) is not None]

    def reported(self, now_ns: int) -> list[LayerChange]:
        """Every layer's status has just been published: held ERRORs whose recovery is earned clear."""
        return [ch for m in self.layers.values() if (ch := m.reported(now_ns)) is not None]

    def status(self, layer: Layer) -> LayerStatus:
        return self.layers[layer].status()

    def statuses(self) -> tuple[LayerStatus, ...]:
        """One status per layer, in :data:`LAYERS` order."""
        return tuple(self.layers[la].status() for la in LAYERS)

    @property
    def overall(self) -> Level:
        return worst(m.level for m in self.layers.values())

    def first_not_ok(self) -> LayerStatus | None:
        """The lowest layer that is not OK (the root-most cause), or None."""
        return next((s for s in self.statuses() if s.level is not Level.OK), None)


def layer_usable(s: LayerStatus) -> bool:
    """Whether ``s`` lets ``ChestnutActive`` be true: OK, or a WARN that is advisory only (every current WARN
    condition informs: a stage over its share of the frame while the frame deadline is not at risk,
    :class:`StageBudget`)."""
    return s.level is Level.OK or (s.level is Level.WARN and s.advisory)


def chestnut_active(health: HealthMonitor | Iterable[LayerStatus], serving_source: Source) -> tuple[bool, str]:
    """``ChestnutActive``: true only when all four layers are OK (an advisory WARN counts as OK,
    :func:`layer_usable`) **and** the primary serves.

    Returns ``(active, reason)``; the reason is the most severe layer that is not usable (ERROR over STALE over
    WARN, :data:`SEVERITY`; the lowest layer of those) with its level and reason -- a pcie ERROR, not the usb
    layer gone STALE while the worker it speaks through is down -- else the serving source when it is not the
    primary, else ``"all layers OK"``, followed by each advisory WARN (``"all layers OK; advisory: gpu WARN:
    slow but alive: ..."``). A missing layer counts as not OK.
    """
    statuses = health.statuses() if isinstance(health, HealthMonitor) else tuple(health)
    by_layer = {s.layer: s for s in statuses}
    for la in LAYERS:
        if la not in by_layer:
            return False, f"{la.value}: no status"
    unusable = [by_layer[la] for la in LAYERS if not layer_usable(by_layer[la])]
    if unusable:
        s = max(unusable, key=lambda u: SEVERITY[u.level])  # the first of the most severe: the lowest layer
        return False, f"{s.layer.value} {s.level.name}: {s.reason}"
    if serving_source is not Source.PRIMARY:
        return False, f"{serving_source.value} serving, not the primary"
    notes = [f"{la.value} WARN: {by_layer[la].reason}" for la in LAYERS if by_layer[la].advisory]
    return True, "all layers OK" + (f"; advisory: {'; '.join(notes)}" if notes else "")


class ActiveFlag:
    """The published ``ChestnutActive`` with ``since`` = when ``active`` last changed (ns).

    ``update`` returns True when ``active`` or the source changed, i.e. when the node must publish
    at once rather than wait for the next frame.
    """

    def __init__(self, now_ns: int) -> None:
        self.active = False
        self.source = Source.NONE
        self.reason = "node starting"
        self.since_ns = now_ns

    def update(self, active: bool, reason: str, source: Source, now_ns: int) -> bool:
        changed = active != self.active or source is not self.source
        if active != self.active:
            self.since_ns = now_ns
        self.active, self.reason, self.source = active, reason, source
        return changed


# ---------------------------------------------------------------- evidence from each source


def evidence_from_error(err: ChestnutError) -> Evidence | None:
    """A typed backend error is hard evidence against its layer (the worker must be replaced anyway:
    tinygrad 0.14's errors are sticky: ``USB3._async_err`` is never cleared). Model and config errors carry
    no layer: None."""
    if err.layer is None:
        return None
    reason = f"{err.reason}: {err.detail}" if err.detail else err.reason
    return Evidence(err.layer, Level.ERROR, reason, hard=True, tag=err.reason)


_STEP_LEVEL = {StepResult.PASS: Level.OK, StepResult.WARN: Level.WARN, StepResult.FAIL: Level.ERROR}


_ERROR_LAYERS = {cls.__name__: la for la, cls in LAYER_ERRORS.items()}


def step_layer(step: LadderStep) -> Layer:
    """The layer a failed step speaks against: a known failure signature's
    (:func:`chestnut.backend.classify.diagnose`: a wedged bridge found by the usb layer's ``link_stability``
    is the pcie layer's), else its typed error's (a USB timeout during the model load is a USB fault, not a
    GPU one), read from the error or from the class name that leads the step's detail (``backend/ladder.py``
    ``run_steps``); otherwise the step's own layer."""
    if step.result is StepResult.FAIL:
        sig = diagnose(step.reason, step.detail)
        if sig is not None and sig.error.layer is not None:
            return sig.error.layer
        err_layer = getattr(step.error, "layer", None)
        if isinstance(err_layer, Layer):
            return err_layer
        head = step.detail.split(" ", 1)[0]
        if head in _ERROR_LAYERS:
            return _ERROR_LAYERS[head]
    return step.layer


def evidence_from_ladder(report: LadderReport) -> list[Evidence]:
    """One observation per layer the ladder reached: the worst of that layer's steps, with the first
    such step as the reason (``"<step>: <detail>"``). A failed step is hard and counts against its
    error's layer (:func:`step_layer`), renamed by a known failure signature
    (:func:`chestnut.backend.classify.diagnose`, e.g. a wedged bridge) with that signature's advice.
    Skipped steps give no evidence. Source ``"ladder"``, current for :data:`LADDER_FRESH_MS`.
    Layers in :data:`LAYERS` order."""
    out = []
    for la in LAYERS:
        steps = [s for s in report.steps if step_layer(s) is la and s.result in _STEP_LEVEL]
        if not steps:
            continue
        level = worst(_STEP_LEVEL[s.result] for s in steps)
        step = next(s for s in steps if _STEP_LEVEL[s.result] is level)
        detail, advice = step.detail, step.advice
        if level is Level.ERROR and (sig := diagnose(step.reason, step.detail)) is not None:
            detail, advice = f"{sig.reason}: {step.detail}", sig.advice
        reason = f"{step.name}: {detail}" if detail else step.name
        if level is Level.ERROR and advice:
            reason += f" ({advice})"
        tag = step.name if level is not Level.OK else ""
        out.append(Evidence(la, level, reason, hard=level is Level.ERROR, tag=tag, source="ladder",
                            fresh_ms=LADDER_FRESH_MS))
    return out


def evidence_from_watchdog(action: WatchdogAction) -> Evidence | None:
    """Watchdog actions as evidence: one deadline miss is a gpu WARN (the result came, late; the 3000 ms
    wait timeout was kept); a miss run, a hung or silent worker is a hard gpu ERROR; a logical fault a
    hard output ERROR. A discarded late result is no new evidence (its miss was counted)."""
    if action.kind is ActionKind.DISCARD_LATE:
        return None
    if action.kind is ActionKind.ANSWER_FROM_FALLBACK:
        if action.entity != "deadline":
            return None  # worker gone/replaced, or a request out of sequence: its cause is reported on its own
        return Evidence(Layer.GPU, Level.WARN, action.reason, tag="deadline_miss")
    layer = action.layer or Layer.GPU
    tag = {"deadline": "deadline_miss_run", "hang": "hang", "alive": "heartbeat_lost"}.get(action.entity, "logical")
    return Evidence(layer, Level.ERROR, action.reason, hard=True, tag=tag)


def evidence_from_run(elapsed_ms: float) -> list[Evidence]:
    """A primary inference that returned (before the watchdog ruled on it): its USB transfers
    completed, its TLPs got good completions and its fences advanced within the wait timeout."""
    return [
        Evidence(Layer.USB, Level.OK, "transfers complete"),
        Evidence(Layer.PCIE, Level.OK, "TLP completions good"),
        Evidence(Layer.GPU, Level.OK, f"fences advanced; run took {elapsed_ms:.1f} ms"),
    ]


def evidence_from_validity(report: ValidityReport) -> Evidence:
    """The output checks of one frame of the primary: OK, or ERROR (hard or soft per the failing check)."""
    f = report.first_failure
    if f is None:
        return Evidence(Layer.OUTPUT, Level.OK, "output valid")
    return Evidence(Layer.OUTPUT, Level.ERROR, f.reason, hard=f.hard, tag=f.check.value)


def evidence_from_transfers(stats: Mapping[str, Any], fresh_ms: float = PROBE_FRESH_MS) -> Evidence:
    """The usb layer's transient transfer errors (:meth:`chestnut.backend.retry.RetryingUSB3.stats`).

    Errors in the last ``window_s`` at a rate above :data:`FIELD_TRANSIENT_ERRORS_PER_H` make the
    layer WARN with the rate; fewer are OK (a working dock has them). Either way the totals are the
    layer's ``transient_errors`` / ``transient_retried`` / ``transient_not_retried`` counters. The
    retry wrapper itself fails the dock over when its policy says the link is bad. Source
    ``"transfers"``, current for ``fresh_ms``."""
    n = int(stats.get("errors_in_window", 0))
    window_s = float(stats.get("window_s", 60.0)) or 60.0
    per_h = n * 3600.0 / window_s
    counters = (("transient_errors", int(stats.get("errors", 0))),
                ("transient_retried", int(stats.get("retried_ok", 0))),
                ("transient_not_retried", int(stats.get("not_retried", 0))))
    what = f"{n} transient transfer errors in the last {window_s:g} s ({per_h:.0f}/h"
    if per_h > FIELD_TRANSIENT_ERRORS_PER_H:
        last = f"; last: {stats['last_error']}" if stats.get("last_error") else ""
        return Evidence(Layer.USB, Level.WARN, f"{what}, above the {FIELD_TRANSIENT_ERRORS_PER_H:g}/h of working docks "
                        f"(openpilot#38519); {int(stats.get('retried_ok', 0))} retried in all{last}",
                        tag="transient_error_rate", source="transfers", fresh_ms=fresh_ms, counters=counters)
    return Evidence(Layer.USB, Level.OK, f"{what}, within the {FIELD_TRANSIENT_ERRORS_PER_H:g}/h of working docks)",
                    source="transfers", fresh_ms=fresh_ms, counters=counters)


def evidence_from_copy_timing(stats: Mapping[str, Any], fresh_ms: float = PROBE_FRESH_MS) -> Evidence:
    """The usb layer's end-to-end link evidence: the copy path's own timing
    (:class:`chestnut.backend.real_runner.CopyTimer` stats; openpilot#38483: one register is not enough).

    WARN (``slow_copy``) when a size class's recent copies run (median) at under :data:`MARGINAL_COPY_RATIO`
    of the rate this link gave them at first; WARN (``slow_fence``) when a recent frame's fence took over
    :data:`FENCE_MARGIN_RATIO` of the wait timeout; else OK with the slowest rate. The worse of the two
    speaks. Source ``"copy_path"``, current for ``fresh_ms``; counters ``copies`` and ``fences``."""
    counters = (("copies", int(stats.get("copies", 0))), ("fences", int(stats.get("fences", 0))))
    slow = stats.get("slowest") if isinstance(stats.get("slowest"), Mapping) else None
    fence_ms, wait_ms = stats.get("fence_max_ms"), float(stats.get("wait_timeout_ms") or 0.0)

    def ev(level: Level, reason: str, tag: str = "") -> Evidence:
        return Evidence(Layer.USB, level, reason, tag=tag, source="copy_path", fresh_ms=fresh_ms, counters=counters)

    if slow is not None and float(slow["ratio"]) < MARGINAL_COPY_RATIO:
        return ev(Level.WARN, f"copy-{slow['direction']} of up to {slow['bytes']} bytes at {float(slow['mbps']):.1f} "
                  f"MB/s, {float(slow['ratio']):.2f} of the {float(slow['baseline_mbps']):.1f} MB/s this link gave it "
                  "at first (a marginal link slows before it fails)", "slow_copy")
    if fence_ms is not None and wait_ms > 0 and float(fence_ms) > FENCE_MARGIN_RATIO * wait_ms:
        return ev(Level.WARN, f"a frame's fence took {float(fence_ms):.0f} ms of the {wait_ms:.0f} ms wait timeout",
                  "slow_fence")
    what = (f"copies at >= {float(slow['ratio']):.2f} of this link's first rate" if slow is not None
            else "no copy rated yet")
    fence = f", fences within {float(fence_ms):.0f} ms" if fence_ms is not None else ""
    return ev(Level.OK, what + fence)


FRAME_PERIOD_S = 0.05
"""The frame period the stage budget shares out, s: openpilot's model rate, ``DT_MDL`` = 0.05 s in
``common/realtime.py`` (``msgs/services.py``: ``modelOutput`` at 20 Hz)."""

STAGE_SHARES: Mapping[str, float] = {"copy_in": 0.4, "compute": 0.3, "copy_out": 0.3}
"""Each stage's share of :data:`FRAME_PERIOD_S`. The node runs one frame at a time, so the three stages
share one frame period and the shares add up to 1. copy-in 0.4 (20 ms): openpilot#38862's dock spent
~22 ms of the 50 ms frame on the USB copy alone and showed "Driving Model Lagging", so that copy is over
budget here; copy-out 0.3 (15 ms): tinygrad 0.14's copy-out costs round trips more than bytes (about
eight in turn per 512 KiB, ``AMDAllocator._copyout``; ``README.md`` "Known limits"), so even a small
output needs more than its size's share; compute 0.3 (15 ms): the rest of the frame."""

STAGE_LAYERS: Mapping[str, Layer] = {"copy_in": Layer.USB, "compute": Layer.GPU, "copy_out": Layer.USB}
"""The layer that owns each stage: the copies cross the USB link, the compute is the GPU's."""

STAGE_WINDOW = 20  # frames the budget speaks for: 1 s at 20 Hz, the layers' stale_after_ms
STAGE_MIN_FRAMES = 5  # fewer recent frames than this are not judged (one slow frame is not a slow stage)
STAGE_MAX_AGE_S = 2.0  # frames older than this leave the window (a primary that served again after a gap)
STAGE_SOURCE = "stage_budget"  # the Evidence.source of the stage budget's conditions
RISK_RANK = 2
"""The frame deadline is judged on the window's ``RISK_RANK``-th slowest run of the primary: the second
slowest, about its p95 over 20 frames. One slow frame in a second is a busy host's noise (it was answered);
two are a dock that gets near its deadline."""


@dataclass(frozen=True)
class StageVerdict:
    """One stage over the window: ``p50_s`` (median, s), ``budget_s``, ``frames`` judged, ``over``."""

    stage: str
    p50_s: float
    budget_s: float
    frames: int

    @property
    def over(self) -> bool:
        return self.p50_s > self.budget_s

    def describe(self, frame_period_s: float) -> str:
        """E.g. ``"copy-in p50 31.2 ms > 20 ms budget of 50 ms frame"`` (``<=`` when within it)."""
        op = ">" if self.over else "<="
        return (f"{STAGE_NAMES[self.stage]} p50 {self.p50_s * 1e3:.1f} ms {op} {self.budget_s * 1e3:g} ms budget "
                f"of {frame_period_s * 1e3:g} ms frame")


@dataclass(frozen=True)
class RiskVerdict:
    """The frame deadline over the window: the primary's run time, median ``p50_s`` and the
    :data:`RISK_RANK`-th slowest ``slow_s``, against the frame period ``frame_period_s`` and the bound
    ``bound_s`` on a run that one more frame's delay would push past the deadline ``deadline_s``, s."""

    p50_s: float
    slow_s: float
    frame_period_s: float
    deadline_s: float

    @property
    def bound_s(self) -> float:
        """The longest run ``r`` that one more frame's delay does not push past the deadline ``D``: the next frame
        waits ``r - P`` behind it (``P`` the frame period; none when ``r <= P``), counted as at most one period
        (the median run keeps up with the camera, or :attr:`at_risk` says so already), so
        ``r + min(max(r - P, 0), P) <= D``: ``D - P`` when ``D >= 3P`` (150 - 50 = 100 ms at openpilot's
        20 Hz), ``(D + P) / 2`` when ``P < D < 3P`` (125 ms for a 10 Hz camera), ``D`` when ``D <= P``."""
        d, p = self.deadline_s, self.frame_period_s
        return max(min(d, (d + p) / 2), d - p)  # the three cases in one (continuous where they meet)

    def _bound_terms(self) -> str:
        """How :attr:`bound_s` is made, for :meth:`describe`."""
        d, p = self.deadline_s, self.frame_period_s
        dt, pt = f"{d * 1e3:g} ms deadline", f"{p * 1e3:g} ms frame"
        if d - p >= min(d, (d + p) / 2) - 1e-12:
            return f"{dt} - {pt}"
        return f"({dt} + {pt}) / 2" if (d + p) / 2 < d else dt

    @property
    def at_risk(self) -> bool:
        """The deadline is at risk: the median run is longer than the frame period (one frame at a time, the
        node falls behind its camera and the queue grows until frames miss), or the second slowest run is past
        :attr:`bound_s` (one more frame's delay and it misses)."""
        return self.p50_s > self.frame_period_s or self.slow_s > self.bound_s

    def describe(self) -> str:
        """E.g. ``"run p50 20.0 ms <= 50 ms frame, 2nd slowest 24.0 ms <= 100 ms (150 ms deadline - 50 ms
        frame)"``; the bound as :attr:`bound_s` makes it (``((150 ms deadline + 100 ms frame) / 2)`` at 10 Hz)."""
        op50 = ">" if self.p50_s > self.frame_period_s else "<="
        op_slow = ">" if self.slow_s > self.bound_s else "<="
        return (f"run p50 {self.p50_s * 1e3:.1f} ms {op50} {self.frame_period_s * 1e3:g} ms frame, 2nd slowest "
                f"{self.slow_s * 1e3:.1f} ms {op_slow} {self.bound_s * 1e3:g} ms ({self._bound_terms()})")


class StageBudget:
    """The per-stage time budget of the primary: *slow but alive*, told apart from a frame deadline at risk.

    :meth:`observe` takes one frame's :class:`~chestnut.backend.stages.StageTimes` (s) and the primary's
    run time of that frame (s, ``modelOutput.executionTime``) and returns the evidence for the layers that
    own the stages (:data:`STAGE_LAYERS`): per stage, the median of the last ``window`` frames (at most
    ``max_age_s`` old, at least ``min_frames`` of them) against its share of the frame (:data:`STAGE_SHARES`
    of ``frame_period_s``). Medians, not one sample: one slow frame on a busy host is not a slow stage.

    A stage over its share is shown, it does not disengage: its layer is WARN with a reason naming the
    stage, its median and its budget (tags ``slow_copy_in``, ``slow_compute``, ``slow_copy_out``), and the
    WARN is *advisory* (:attr:`Evidence.advisory`: ``ChestnutActive`` still rises) while the frame deadline
    is not at risk. *At risk* (:class:`RiskVerdict`) is judged on the primary's run times over the same
    window: the median run over the frame period (50 ms: the node runs one frame at a time and falls behind
    its camera), or the second slowest run of the window (:data:`RISK_RANK`) over the deadline less one frame
    period (150 - 50 = 100 ms: one more frame's delay and it misses; :attr:`RiskVerdict.bound_s` for a camera
    slower than a third of the deadline). Then the WARN is not advisory and
    ``ChestnutActive`` drops (tag ``deadline_at_risk``); a deadline at risk with no stage over its share is
    the gpu layer's, as a deadline miss is (the time is outside the timed stages). Within budget and not at
    risk the source says OK. The conditions' source is :data:`STAGE_SOURCE`, so a WARN holds while the
    window says so and clears with the layer's hysteresis once the median is back under (module doc); advisory and not
    advisory follow the window at once. The evidence is not *counted* (:attr:`Evidence.counted`): it rates
    frames the completed runs already observed, so a frame is still one observation towards a layer's
    recovery from ERROR. It never fails the primary over: deadline misses and errors do that. Pure: no
    clock of its own. ``frame_period_s``: the camera's (``timing.frame_period_ms``). Raises ``ValueError`` for a
    share outside (0, 1], a period, deadline or window that is not positive.
    """

    def __init__(self, frame_period_s: float = FRAME_PERIOD_S, shares: Mapping[str, float] | None = None,
                 window: int = STAGE_WINDOW, min_frames: int = STAGE_MIN_FRAMES,
                 max_age_s: float = STAGE_MAX_AGE_S, deadline_s: float = FRAME_DEADLINE_MS / 1e3) -> None:
        shares = dict(STAGE_SHARES if shares is None else shares)
        if set(shares) != set(STAGES) or not all(0 < v <= 1 for v in shares.values()):
            raise ValueError(f"stage shares must give each of {', '.join(STAGES)} a share in (0, 1]: {shares}")
        if not frame_period_s > 0 or window < 1 or not 1 <= min_frames <= window or not max_age_s > 0:
            raise ValueError("frame_period_s and max_age_s must be > 0, 1 <= min_frames <= window")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s ({deadline_s}) must be > 0")
        self.frame_period_s, self.shares, self.deadline_s = frame_period_s, shares, deadline_s
        self.window, self.min_frames, self.max_age_ns = window, min_frames, int(max_age_s * 1e9)
        self.samples: list[tuple[int, StageTimes, float]] = []  # (ns, stages s, run s)

    def budget_s(self, stage: str) -> float:
        """``stage``'s budget, s: its share of the frame period."""
        return self.shares[stage] * self.frame_period_s

    def _recent(self, now_ns: int) -> list[tuple[int, StageTimes, float]]:
        recent = [x for x in self.samples if now_ns - x[0] <= self.max_age_ns]
        return recent if len(recent) >= self.min_frames else []

    def verdicts(self, now_ns: int) -> list[StageVerdict]:
        """Each stage over the current window, in :data:`STAGES` order; [] with too few recent frames."""
        recent = [st for _, st, _ in self._recent(now_ns)]
        return [StageVerdict(s, float(np.median([getattr(st, s) for st in recent])), self.budget_s(s), len(recent))
                for s in STAGES] if recent else []

    def risk(self, now_ns: int) -> RiskVerdict | None:
        """The frame deadline over the current window (:class:`RiskVerdict`); None with too few recent frames."""
        runs = [r for _, _, r in self._recent(now_ns)]
        if not runs:
            return None
        slow = sorted(runs)[-min(RISK_RANK, len(runs))]
        return RiskVerdict(float(np.median(runs)), float(slow), self.frame_period_s, self.deadline_s)

    def pending(self) -> str:
        """Why the budget has not judged yet (it has seen fewer than ``min_frames`` timed frames), else "".

        Until then the budget says nothing (no OK, no WARN): its layers' levels come from their other
        evidence only, and ``ChestnutActive`` stays false while a primary that times its stages serves
        (docs/health.md): a dock is not trusted before the budget has seen enough of it to call it slow.
        Counted over the window whatever the frames' age, so a camera slower than ``min_frames`` per
        ``max_age_s`` (2.5 Hz) is gated for its first frames only."""
        if len(self.samples) >= self.min_frames:
            return ""
        return f"stage budget not judged yet ({len(self.samples)} of {self.min_frames} timed primary frames)"

    def observe(self, stages: StageTimes, now_ns: int, run_s: float | None = None) -> list[Evidence]:
        """Add one frame's stage times and the primary's run time of it (``run_s``, s; None: the stages' sum)
        at ``now_ns`` (CLOCK_MONOTONIC ns); the evidence per owning layer (usb, then gpu), none while the
        window holds fewer than ``min_frames`` recent frames."""
        run = stages.total if run_s is None else run_s
        self.samples = [*self.samples[-(self.window - 1):], (now_ns, stages, run)]
        verdicts, risk = self.verdicts(now_ns), self.risk(now_ns)
        if risk is None:
            return []
        at_risk = risk.at_risk
        any_over = any(v.over for v in verdicts)
        out = []
        for layer in (Layer.USB, Layer.GPU):
            mine = [v for v in verdicts if STAGE_LAYERS[v.stage] is layer]
            over = [v for v in mine if v.over]
            shown = over or mine
            text = "; ".join(v.describe(self.frame_period_s) for v in shown)
            frames = f" (median of the last {mine[0].frames} frames)"
            if at_risk and (over or (layer is Layer.GPU and not any_over)):
                what = f"slow but alive: {text}" if over else f"no stage over its share: {text}"
                out.append(Evidence(layer, Level.WARN, f"deadline at risk: {risk.describe()}; {what}{frames}",
                                    tag="deadline_at_risk", source=STAGE_SOURCE, counted=False))
            elif over:
                out.append(Evidence(layer, Level.WARN, f"slow but alive: {text}{frames}; deadline not at risk: "
                                    f"{risk.describe()}", tag=f"slow_{over[0].stage}", source=STAGE_SOURCE,
                                    counted=False, advisory=True))
            else:
                out.append(Evidence(layer, Level.OK, f"within budget: {text}{frames}", source=STAGE_SOURCE,
                                    counted=False))
        return out

    def reset(self) -> None:
        self.samples = []


def evidence_from_observation(obs: DockObservation, fresh_ms: float = PROBE_FRESH_MS) -> list[Evidence]:
    """A dock probe (:meth:`PrimaryRunner.probe` or a cheap enumeration). USB: absent -> hard ERROR;
    slower than SuperSpeed -> WARN; the transient-error counters in ``extra`` ->
    :func:`evidence_from_transfers`; the copy path's timing -> :func:`evidence_from_copy_timing`. PCIe:
    LTSSM other than 0x78 -> soft ERROR (debounced, as
    openpilot's hardware daemon does). Fields that were not read give no evidence. Source ``"probe"``,
    current for ``fresh_ms`` (a link speed holds until the next probes say otherwise)."""
    if not obs.present:
        return [Evidence(Layer.USB, Level.ERROR, "no Chestnut dock enumerated", hard=True, tag="absent")]
    out = []
    where = f" at bus {obs.bus_address[0]} address {obs.bus_address[1]}" if obs.bus_address else ""
    ids = f"{obs.vid_pid[0]:04x}:{obs.vid_pid[1]:04x}" if obs.vid_pid else "dock"

    def probe(layer: Layer, level: Level, reason: str, tag: str = "") -> Evidence:
        return Evidence(layer, level, reason, tag=tag, source="probe", fresh_ms=fresh_ms)

    if obs.speed_mbps is not None and obs.speed_mbps < SUPERSPEED_MBPS:
        out.append(probe(Layer.USB, Level.WARN, f"{ids}{where} at {link_speed_text(obs.speed_mbps)}, not SuperSpeed "
                         "(large reads time out, bulk writes truncate, copies ~10x slower)", "slow_link"))
    else:
        speed = f" at {obs.speed_mbps} Mbps" if obs.speed_mbps is not None else ""
        out.append(probe(Layer.USB, Level.OK, f"{ids}{where}{speed}"))
    stats = obs.extra.get(STATS_KEY)
    if isinstance(stats, Mapping):
        out.append(evidence_from_transfers(stats, fresh_ms))
    timing = obs.extra.get(COPY_STATS_KEY)
    if isinstance(timing, Mapping):
        out.append(evidence_from_copy_timing(timing, fresh_ms))
    if obs.ltssm is not None:
        if obs.ltssm == LTSSM_L0:
            out.append(probe(Layer.PCIE, Level.OK, "LTSSM=0x78 (link up)"))
        else:
            known = " (stuck in 0x4C: known firmware failure)" if obs.ltssm == LTSSM_STUCK else ""
            out.append(probe(Layer.PCIE, Level.ERROR, f"LTSSM=0x{obs.ltssm:02x}, not 0x78{known}", "ltssm"))
    return out


# ---------------------------------------------------------------- messages


def fill_health(builder: Any, health: HealthMonitor) -> None:
    """Fill a ``ChestnutHealth`` builder (``msgs.schema.log``): one ``LayerHealth`` per layer in
    :data:`LAYERS` order (``advisory``: its WARN informs, :func:`layer_usable`), and ``overall`` =
    :func:`worst` of the layers."""
    statuses = health.statuses()
    layers = builder.init("layers", len(statuses))
    for entry, s in zip(layers, statuses, strict=True):
        entry.layer = s.layer.value
        entry.level = s.level.name.lower()
        entry.reason = s.reason
        counters = entry.init("counters", len(s.counters))
        for c, (name, value) in zip(counters, s.counters.items(), strict=True):
            c.name = name
            c.value = value
        entry.lastChange = s.last_change_ns
        entry.lastEvidence = s.last_evidence_ns
        entry.advisory = s.advisory
    builder.overall = worst(s.level for s in statuses).name.lower()


def fill_active(builder: Any, flag: ActiveFlag) -> None:
    """Fill a ``ChestnutActive`` builder from an :class:`ActiveFlag`."""
    builder.active = flag.active
    builder.source = flag.source.value
    builder.reason = flag.reason
    builder.since = flag.since_ns
