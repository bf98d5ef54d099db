"""The node's supervisor: which model serves, when to (re)try the dock, and why, as a transition table.

Pure logic: the caller passes ``now_ns`` (``time.monotonic_ns()``), feeds events, and performs the
:class:`Action` of each :class:`Transition` it gets back. Every transition carries its reason, for
the log and for ``nodeState``.

States. ``nodeState.state`` has seven values (``msgs/chestnut.capnp``, ``NodeState.State``); the
table uses a few finer states so that it needs no guards, each published as one of the seven:

==================  ===========  ==========================================================
state               published    meaning
==================  ===========  ==========================================================
STARTING            starting     warming the fallback; no frame answered yet
QUALIFYING          qualifying   first attempt: worker spawned, qualification ladder running
LOADING             loading      first attempt: loading the primary model on the dock
ACTIVE              active       the primary serves (the only state where it does)
DEGRADED            degraded     the fallback serves; waiting out the back-off
LOOKING             degraded     back-off over: a cheap look for the dock (no claim)
REQUALIFYING        recovering   dock found: a new worker runs the ladder
RELOADING           recovering   requalified: loading the primary model
SHADOWING           recovering   primary runs beside the fallback; K agreements needed
AWAITING_SWITCH     recovering   ready to serve; waiting for the consumer to allow a switch
STOPPING            stopping     stop sequence; terminal
==================  ===========  ==========================================================

Policies (``docs/architecture.md``, "Qualification, failover and return"):

- the primary serves only in ACTIVE; the fallback serves in every other state but STARTING/STOPPING;
- every switch to the primary passes AWAITING_SWITCH: it happens only while the consumer allows
  (no ``controlState`` seen, not engaged, or ``allowSourceSwitch``); the first activation after start
  relies on the ladder's warm-up fingerprint, every return additionally needs ``shadow_frames``
  (default 20 = 1 s at 20 Hz) consecutive shadow frames in which the primary agreed with the fallback;
- a dock absent at start is not an error: DEGRADED, then LOOKING after each back-off;
- back-off between attempts: 1 s doubling to 30 s; reset when the primary had served for
  ``stable_after_s`` (60 s) before its fault; ``flap_max_failovers`` (3) failovers out of ACTIVE
  within ``flap_window_s`` (600 s) raise the back-off to ``flap_backoff_s`` (300 s) until a stable
  period resets it. Delays never decrease between resets.

Events that the table does not list for the current state are ignored and counted in
:attr:`Supervisor.ignored` (e.g. the death notice of a worker the node has just killed). Three
events are derived by the supervisor from its own counters and carry a precondition
(:data:`PRECONDITIONS`); fed from outside while it does not hold, they are ignored and counted too,
so no input sequence can skip the shadow run, the consumer's consent or the back-off.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from chestnut.backend.errors import Layer

NS_PER_S = 1_000_000_000


class Source(StrEnum):
    """Which model produces outputs; values match ``ModelSource`` in the schema."""

    NONE = "none"
    PRIMARY = "primary"
    FALLBACK = "fallback"


class State(StrEnum):
    STARTING = "starting"
    QUALIFYING = "qualifying"
    LOADING = "loading"
    ACTIVE = "active"
    DEGRADED = "degraded"
    LOOKING = "looking"
    REQUALIFYING = "requalifying"
    RELOADING = "reloading"
    SHADOWING = "shadowing"
    AWAITING_SWITCH = "awaiting_switch"
    STOPPING = "stopping"

    @property
    def published(self) -> str:
        """The ``NodeState.State`` enumerant this state is published as."""
        return PUBLISHED[self]


PUBLISHED: dict[State, str] = {
    State.STARTING: "starting",
    State.QUALIFYING: "qualifying",
    State.LOADING: "loading",
    State.ACTIVE: "active",
    State.DEGRADED: "degraded",
    State.LOOKING: "degraded",
    State.REQUALIFYING: "recovering",
    State.RELOADING: "recovering",
    State.SHADOWING: "recovering",
    State.AWAITING_SWITCH: "recovering",
    State.STOPPING: "stopping",
}


class Event(StrEnum):
    FALLBACK_READY = "fallback_ready"  # the fallback is compiled and warm
    FALLBACK_FAILED = "fallback_failed"  # no usable fallback: the node cannot serve at all
    DOCK_FOUND = "dock_found"  # a cheap look (LOOK_FOR_DOCK) found a dock
    DOCK_ABSENT = "dock_absent"  # no dock (a look, or the ladder's first step)
    QUALIFIED = "qualified"  # the ladder's dock steps passed
    QUALIFY_FAILED = "qualify_failed"  # a ladder step failed (the reason names it)
    LOADED = "loaded"  # model loaded and warm-up fingerprint matched
    LOAD_FAILED = "load_failed"
    PRIMARY_FAULT = "primary_fault"  # a health layer reached ERROR, or a typed error from the worker
    WORKER_DIED = "worker_died"  # the worker process exited or was killed
    DEADLINE_MISS_RUN = "deadline_miss_run"  # the watchdog's FAIL_OVER
    RETRY_DUE = "retry_due"  # the back-off expired (raised by Supervisor.tick)
    SHADOW_AGREED = "shadow_agreed"  # K consecutive agreeing shadow frames (raised by Supervisor.shadow)
    SHADOW_DISAGREED = "shadow_disagreed"  # a shadow frame failed its output checks
    CONSUMER_ALLOWS_SWITCH = "consumer_allows_switch"  # raised by Supervisor.consumer / entry to AWAITING_SWITCH
    STOP = "stop"  # SIGINT / SIGTERM


class Action(StrEnum):
    NONE = "none"
    SPAWN_WORKER = "spawn_worker"  # spawn a primary worker and have it run the ladder
    LOAD_PRIMARY = "load_primary"  # ask the worker to load the primary model
    START_SHADOW = "start_shadow"  # run the primary on every frame beside the fallback; feed shadow()
    SERVE_PRIMARY = "serve_primary"  # the primary answers frames from now on
    BACK_OFF = "back_off"  # the fallback serves; stop the worker if one runs; retry at retry_at_ns
    LOOK_FOR_DOCK = "look_for_dock"  # enumerate the dock without claiming it; feed DOCK_FOUND / DOCK_ABSENT
    STOP = "stop"  # run the stop sequence, exit 0
    ABORT = "abort"  # run the stop sequence, exit non-zero: no usable fallback


S, E, A = State, Event, Action


def _table() -> dict[tuple[State, Event], tuple[State, Action]]:
    t: dict[tuple[State, Event], tuple[State, Action]] = {
        (S.STARTING, E.FALLBACK_READY): (S.QUALIFYING, A.SPAWN_WORKER),
        (S.QUALIFYING, E.QUALIFIED): (S.LOADING, A.LOAD_PRIMARY),
        (S.LOADING, E.LOADED): (S.AWAITING_SWITCH, A.START_SHADOW),
        (S.DEGRADED, E.RETRY_DUE): (S.LOOKING, A.LOOK_FOR_DOCK),
        (S.LOOKING, E.DOCK_FOUND): (S.REQUALIFYING, A.SPAWN_WORKER),
        (S.LOOKING, E.DOCK_ABSENT): (S.DEGRADED, A.BACK_OFF),
        (S.REQUALIFYING, E.QUALIFIED): (S.RELOADING, A.LOAD_PRIMARY),
        (S.RELOADING, E.LOADED): (S.SHADOWING, A.START_SHADOW),
        (S.SHADOWING, E.SHADOW_AGREED): (S.AWAITING_SWITCH, A.NONE),
        (S.AWAITING_SWITCH, E.CONSUMER_ALLOWS_SWITCH): (S.ACTIVE, A.SERVE_PRIMARY),
    }
    # Failures: back to the fallback, back off. Which events are failures depends on what runs.
    failures = {
        S.QUALIFYING: (E.DOCK_ABSENT, E.QUALIFY_FAILED, E.PRIMARY_FAULT, E.WORKER_DIED),
        S.REQUALIFYING: (E.DOCK_ABSENT, E.QUALIFY_FAILED, E.PRIMARY_FAULT, E.WORKER_DIED),
        S.LOADING: (E.LOAD_FAILED, E.PRIMARY_FAULT, E.WORKER_DIED),
        S.RELOADING: (E.LOAD_FAILED, E.PRIMARY_FAULT, E.WORKER_DIED),
        S.ACTIVE: (E.PRIMARY_FAULT, E.WORKER_DIED, E.DEADLINE_MISS_RUN),
        S.SHADOWING: (E.SHADOW_DISAGREED, E.PRIMARY_FAULT, E.WORKER_DIED, E.DEADLINE_MISS_RUN),
        S.AWAITING_SWITCH: (E.SHADOW_DISAGREED, E.PRIMARY_FAULT, E.WORKER_DIED, E.DEADLINE_MISS_RUN),
    }
    for state, events in failures.items():
        for event in events:
            t[(state, event)] = (S.DEGRADED, A.BACK_OFF)
    for state in State:
        if state is not S.STOPPING:
            t[(state, E.STOP)] = (S.STOPPING, A.STOP)
            t[(state, E.FALLBACK_FAILED)] = (S.STOPPING, A.ABORT)
    return t


TRANSITIONS: dict[tuple[State, Event], tuple[State, Action]] = _table()
"""``(state, event) -> (next state, action)``; every pair not listed is ignored (see module docstring)."""

PRECONDITIONS: dict[Event, str] = {
    E.SHADOW_AGREED: "shadow_run >= shadow_frames",
    E.CONSUMER_ALLOWS_SWITCH: "switch_allowed",
    E.RETRY_DUE: "now_ns >= retry_at_ns",
}
"""Events the supervisor derives itself, with the condition under which :meth:`Supervisor.handle` takes them."""

SERVING: dict[State, Source] = {
    s: (Source.PRIMARY if s is S.ACTIVE else Source.NONE if s in (S.STARTING, S.STOPPING) else Source.FALLBACK)
    for s in State
}
"""Which model answers frames in each state."""

RUNS_PRIMARY: frozenset[State] = frozenset({S.ACTIVE, S.SHADOWING, S.AWAITING_SWITCH})
"""States in which the primary runs on frames (serving in ACTIVE, in shadow otherwise)."""

WORKER_STATES: frozenset[State] = frozenset(
    {S.QUALIFYING, S.LOADING, S.ACTIVE, S.REQUALIFYING, S.RELOADING, S.SHADOWING, S.AWAITING_SWITCH})
"""States in which a primary worker should be running; in the others it should be stopped."""


@dataclass(frozen=True)
class Transition:
    """One taken transition, with its reason (for logs and ``nodeState.reason``)."""

    at_ns: int
    from_state: State
    event: Event
    to_state: State
    action: Action
    reason: str
    layer: Layer | None = None  # the health layer at fault, when there is one
    retry_at_ns: int | None = None  # BACK_OFF only: when RETRY_DUE fires
    backoff_s: float | None = None  # BACK_OFF only: the delay chosen


@dataclass(frozen=True)
class SupervisorConfig:
    """Recovery policy. Times in seconds."""

    shadow_frames: int = 20  # consecutive agreeing shadow frames before a return (1 s at 20 Hz)
    backoff_initial_s: float = 1.0
    backoff_factor: float = 2.0
    backoff_max_s: float = 30.0
    stable_after_s: float = 60.0  # dwell in ACTIVE after which a fault resets the back-off
    flap_window_s: float = 600.0
    flap_max_failovers: int = 3  # this many failovers out of ACTIVE within the window -> flap back-off
    flap_backoff_s: float = 300.0

    def __post_init__(self) -> None:
        if self.shadow_frames < 1 or self.flap_max_failovers < 1:
            raise ValueError("shadow_frames and flap_max_failovers must be >= 1")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s or self.backoff_factor < 1:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s and backoff_factor >= 1")


class Backoff:
    """Exponential back-off with a flap floor: ``min(initial * factor**attempts, max)``, raised to
    ``flap_backoff_s`` once flapping; both cleared only by :meth:`reset`. Successive delays never decrease
    between resets."""

    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.reset()

    def reset(self) -> None:
        self.attempts = 0
        self.flapping = False

    def next_delay_s(self) -> float:
        c = self.config
        delay = min(c.backoff_initial_s * c.backoff_factor ** min(self.attempts, 64), c.backoff_max_s)
        self.attempts += 1
        return max(delay, c.flap_backoff_s) if self.flapping else delay


class Supervisor:
    """The node's state machine (see the module docstring and :data:`TRANSITIONS`).

    Inputs: :meth:`handle` (an event), :meth:`tick` (timers), :meth:`shadow` (one shadow frame's
    verdict), :meth:`consumer` (``controlState``). Each returns the transitions taken, in order
    (entering AWAITING_SWITCH while the consumer allows chains a second transition to ACTIVE).
    ``on_transition`` (optional) is called with every transition, e.g. to log it.
    """

    def __init__(self, now_ns: int, config: SupervisorConfig | None = None,
                 on_transition: Callable[[Transition], Any] | None = None) -> None:
        self.config = config or SupervisorConfig()
        self.on_transition = on_transition
        self.state = State.STARTING
        self.since_ns = now_ns
        self.reason = "node starting: warming the fallback"
        self.backoff = Backoff(self.config)
        self.retry_at_ns: int | None = None
        self.shadow_run = 0  # consecutive agreeing shadow frames in SHADOWING / AWAITING_SWITCH
        self.consumer_engaged = False
        self.switch_allowed = True  # no controlState seen: nobody to disturb
        self.failovers: deque[int] = deque()  # times of failovers out of ACTIVE within the flap window
        self.spawns = 0
        self.ignored: Counter[tuple[State, Event]] = Counter()
        self.history: deque[Transition] = deque(maxlen=64)

    # ---------------------------------------------------------------- what the caller asks

    @property
    def serving(self) -> Source:
        return SERVING[self.state]

    @property
    def runs_primary(self) -> bool:
        return self.state in RUNS_PRIMARY

    @property
    def wants_worker(self) -> bool:
        return self.state in WORKER_STATES

    @property
    def restarts(self) -> int:
        """Worker spawns after the first (``nodeState.restarts``)."""
        return max(0, self.spawns - 1)

    # ---------------------------------------------------------------- inputs

    def handle(self, event: Event, now_ns: int, reason: str = "", layer: Layer | None = None) -> list[Transition]:
        """Dispatch one event through the table. ``reason`` says why (e.g. the failing ladder step);
        ``layer`` names the health layer at fault. Unlisted (state, event) pairs, and derived events whose
        :data:`PRECONDITIONS` do not hold, are ignored and counted in :attr:`ignored`."""
        rule = TRANSITIONS.get((self.state, event))
        if rule is None or not self._precondition_met(event, now_ns):
            self.ignored[(self.state, event)] += 1
            return []
        to_state, action = rule
        from_state = self.state
        text = f"{event.value}" + (f" ({layer.value})" if layer is not None else "") + (f": {reason}" if reason else "")
        retry_at: int | None = None
        delay_s: float | None = None
        if action is Action.BACK_OFF:
            delay_s = self._back_off_delay_s(from_state, now_ns)
            retry_at = now_ns + int(delay_s * NS_PER_S)
            text += f"; retry in {delay_s:g} s"
        if action is Action.SPAWN_WORKER:
            self.spawns += 1
        self.retry_at_ns = retry_at
        if to_state in (S.SHADOWING, S.AWAITING_SWITCH) and from_state not in (S.SHADOWING, S.AWAITING_SWITCH):
            self.shadow_run = 0
        self.state, self.since_ns, self.reason = to_state, now_ns, text
        t = Transition(now_ns, from_state, event, to_state, action, text, layer, retry_at, delay_s)
        self.history.append(t)
        if self.on_transition is not None:
            self.on_transition(t)
        out = [t]
        if to_state is S.AWAITING_SWITCH and self.switch_allowed:
            out += self.handle(E.CONSUMER_ALLOWS_SWITCH, now_ns, self._allow_text())
        return out

    def tick(self, now_ns: int) -> list[Transition]:
        """Fire due timers: RETRY_DUE once the back-off has run out."""
        if self.state is S.DEGRADED and self.retry_at_ns is not None and now_ns >= self.retry_at_ns:
            return self.handle(E.RETRY_DUE, now_ns, "back-off over; looking for the dock")
        return []

    def shadow(self, agreed: bool, now_ns: int, reason: str = "") -> list[Transition]:
        """One shadow frame's verdict: ``agreed`` = the primary's output passed every output check,
        agreement with the fallback included. The ``shadow_frames``-th consecutive agreement in
        SHADOWING raises SHADOW_AGREED; any disagreement raises SHADOW_DISAGREED (ignored in ACTIVE,
        where the output layer's health debounces disagreements instead)."""
        if not agreed:
            return self.handle(E.SHADOW_DISAGREED, now_ns, reason or "primary disagreed with the fallback")
        if self.state not in (S.SHADOWING, S.AWAITING_SWITCH):
            return []
        self.shadow_run += 1
        if self.state is S.SHADOWING and self.shadow_run >= self.config.shadow_frames:
            return self.handle(E.SHADOW_AGREED, now_ns,
                               f"primary agreed with the fallback on {self.shadow_run} consecutive shadow frames")
        return []

    def consumer(self, engaged: bool, allow_switch: bool, now_ns: int) -> list[Transition]:
        """The consumer's latest ``controlState`` (``engaged``, ``allowSourceSwitch``). A switch to the
        primary is allowed while the consumer is not engaged or allows it. Feed ``engaged=False`` when
        no control daemon is alive (nobody is controlling)."""
        self.consumer_engaged = engaged
        self.switch_allowed = (not engaged) or allow_switch
        if self.switch_allowed and self.state is S.AWAITING_SWITCH:
            return self.handle(E.CONSUMER_ALLOWS_SWITCH, now_ns, self._allow_text())
        return []

    # ---------------------------------------------------------------- policy

    def _precondition_met(self, event: Event, now_ns: int) -> bool:
        if event is E.SHADOW_AGREED:
            return self.shadow_run >= self.config.shadow_frames
        if event is E.CONSUMER_ALLOWS_SWITCH:
            return self.switch_allowed
        if event is E.RETRY_DUE:
            return self.retry_at_ns is not None and now_ns >= self.retry_at_ns
        return True

    def _allow_text(self) -> str:
        return "consumer allows the switch" if self.consumer_engaged else "consumer not engaged"

    def _back_off_delay_s(self, from_state: State, now_ns: int) -> float:
        c = self.config
        if from_state is S.ACTIVE:
            if now_ns - self.since_ns >= c.stable_after_s * NS_PER_S:
                self.backoff.reset()
                self.failovers.clear()
            self.failovers.append(now_ns)
            while self.failovers and now_ns - self.failovers[0] > c.flap_window_s * NS_PER_S:
                self.failovers.popleft()
            if len(self.failovers) >= c.flap_max_failovers:
                self.backoff.flapping = True
        return self.backoff.next_delay_s()


def fill_node_state(builder: Any, sup: Supervisor) -> None:
    """Fill the supervisor's fields of a ``NodeState`` builder (``msgs.schema.log``): state, reason,
    since (ns), restarts. The caller fills workerPid, versions, standby, dock and frame counters."""
    builder.state = sup.state.published
    builder.reason = sup.reason
    builder.since = sup.since_ns
    builder.restarts = sup.restarts
