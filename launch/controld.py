"""``chestnut control``: the reference control daemon, the node's contract partner.

It consumes ``modelOutput``, ``chestnutActive`` and ``chestnutHealth`` through ``SubMaster`` and
decides like openpilot's control daemon (``selfdrive/controls/controlsd.py``; the checks are cereal's
``messaging/__init__.py`` ``SubMaster``):

- It may engage only while every check passes: the three services are alive, freq_ok and valid,
  ``chestnutActive.active`` is true (every health layer OK and the primary serving), and frames are
  not dropping. "The dock is enumerated" is never permission: only ``active`` is.
- While engaged, any failed condition starts a **soft disable**: control is exited after
  ``SOFT_DISABLE_S`` (3 s, openpilot's soft-disable time) unless every condition clears first.
  Conditions: ``commIssue`` (a check failed; followed in ``events`` by one ``commIssue:<service>.<check>``
  per failed check, e.g. ``commIssue:chestnutHealth.freq_ok``), ``modelLagging`` (frame drops above 1 %),
  ``chestnutInactive`` (``active`` went false), ``modelSourceChanged`` (the serving model is not the
  one that was serving at engagement), ``hostLate`` (``active`` went false because the node answered a frame
  from the fallback after a deadline miss it blamed on its host, ``docs/health.md`` "The host": the dock did
  not fail and the serving model did not change), ``deadlineMissed`` (``active`` went false because the primary
  missed single frames' deadlines and the fallback answered them, its reason ``deadline miss: ...``: the node has
  not failed the primary over, ``node/policy.py`` ``mark_deadline_miss``; a run of misses that proves the dock
  slow or hung fails it over, and that is ``chestnutInactive`` at once). ``hostLate`` and ``deadlineMissed``
  alone start the soft disable only once they have lasted ``LATE_FRAME_GRACE_S`` (as openpilot tolerates a few
  dropped model frames before ``modelLagging``); the 3 s count from their first step all the same.
- ``controlState.softDisableRemaining`` is the time left (s) before control is exited, counted from the first
  failing step; control.log says the same quantity in the same words (``msgs/services.py`` ``soft_disable_left``):
  ``soft disable: 2.50 s left of 3.0 s (counted from the first failing step, 0.50 s ago): hostLate`` when it
  starts, ``soft disable: 0.00 s left of 3.0 s: disengaged, 3.00 s after the first failing step`` when
  control is exited, ``soft disable cleared: 1.20 s left of 3.0 s`` when every condition cleared first.
- ``allowSourceSwitch`` tells the node when it may swap the model source: only while not engaged.
- ``--frame-rate HZ``: the rate the stack's camera sends frames at (``chestnut launch --rate``, which passes it on,
  ``launch/supervisord.conf``). The services the node sends once a frame (:data:`FRAME_SERVICES`) are judged
  alive and freq_ok against it, not the 20 Hz of ``msgs/services.py``; ``chestnutHealth`` keeps its own 5 Hz
  (the node's timer, whatever the frame rate).

:class:`ControlLogic` is the pure decision (clock passed in); :func:`run` is the process loop.
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from chestnut.launch.frames import MAX_RATE_HZ as MAX_FRAME_RATE_HZ
from chestnut.launch.frames import launch_rate_hz
from chestnut.launch.signals import StopFlag
from chestnut.msgs.argtypes import MIN_FRAME_RATE_HZ, checked_float
from chestnut.msgs.messaging import PubMaster, SubMaster, new_message
from chestnut.msgs.services import SOFT_DISABLE_S, get_service, soft_disable_left
from chestnut.msgs.submaster import SubMasterChecks
from chestnut.node.policy import DEADLINE_MISS, HOST_LATE
from chestnut.node.realtime import CONTROL_PRIORITY, IdleCollector, add_priority_argument, apply_priority

log = logging.getLogger("chestnut.control")

FRAME_DROP_MAX_PERC = 1.0  # openpilot controlsd: model lagging above 1 % dropped frames
LATE_FRAME_GRACE_S = 0.5
"""How long ``hostLate`` and ``deadlineMissed`` alone may last before they start a soft disable (s, our choice):
10 frames at 20 Hz, well inside the 3 s soft-disable time (which counts from their first step): a host late for
longer is overloaded, and a primary that keeps missing is failed over by the node before that (3 misses in a row
or 4 of 20 frames), so the driver is told either way."""
LATE_FRAME_EVENTS = frozenset({"hostLate", "deadlineMissed"})
ENGAGE_STABLE_S = 1.0  # auto-engage after all checks passed continuously this long
SERVICES = ("modelOutput", "chestnutActive", "chestnutHealth")
FRAME_SERVICES = ("modelOutput", "chestnutActive")
"""The services the node sends once a camera frame (``node/main.py``): their nominal rate is the frame rate."""
STEP_ON = "chestnutActive"
"""The service whose message wakes the daemon's step (its SubMaster's ``poll``; else each step waits its period): the
node sends a frame's ``modelOutput``, then yields its CPU, then the frame's ``chestnutActive`` (``node/main.py``), and
a ``chestnutActive`` alone when ``active`` drops between frames. Woken by any message, a step judged the checks
between a frame's two: ``chestnutActive.freq_ok`` a message behind ``modelOutput``'s, a WARNING ``checks failed:
chestnutActive.freq_ok ...`` and ``checks pass again`` in the same millisecond as a stall's gap left the windows,
and ``controlState`` at ~40 Hz for its 20. A frame's messages are judged together now; a real drop still fails."""
DEFAULT_FRAME_RATE_HZ = get_service("cameraFrame").frequency_hz  # --frame-rate default: the registry's 20 Hz
NS = 1_000_000_000
MAX_RATE_HZ = 1000.0  # --rate: the loop's period is whole milliseconds, at least 1
MIN_RATE_HZ = 1.0
"""``--rate`` lower bound, Hz: a step a second, so a step's verdict is at most a second old and a stop signal, checked
between steps, ends the daemon within a second; at 1e-300 Hz the step's wait overflowed ``zmq_poll``'s timeout."""


@dataclass(frozen=True)
class ControlInputs:
    """One step's evidence: the SubMaster verdicts and the newest messages' fields."""

    checks_ok: bool  # alive, freq_ok and valid for SERVICES
    active: bool  # chestnutActive.active
    source: str  # chestnutActive.source ("primary", "fallback", "none")
    frame_drop_perc: float  # modelOutput.frameDropPerc, %
    failed_checks: tuple[str, ...] = ()  # "<service>.<check>" for each failed check (failed_checks())
    active_reason: str = ""  # chestnutActive.reason


def failed_checks(sm: SubMasterChecks, services: tuple[str, ...] = SERVICES) -> tuple[str, ...]:
    """The SubMaster checks that fail right now, as ``"<service>.<check>"`` (check: alive, freq_ok, valid),
    in ``services`` order. A service that is not alive is reported as ``alive`` only (it cannot be freq_ok)."""
    out: list[str] = []
    for s in services:
        if not sm.alive[s]:
            out.append(f"{s}.alive")
            continue
        if not sm.freq_ok[s]:
            out.append(f"{s}.freq_ok")
        if not sm.valid[s]:
            out.append(f"{s}.valid")
    return tuple(out)


def describe_check(sm: SubMasterChecks, check: str, now_ns: int) -> str:
    """One failed check with its evidence, for the log: the age of the newest message (alive), the short and
    long window rates and which bound they break (freq_ok: too slow over either window, too fast over both,
    ``msgs/submaster.py``), or the flag (valid)."""
    service, _, what = check.partition(".")
    if what == "alive":
        if not sm.seen[service]:
            return f"{check} (never received)"
        return f"{check} (newest {(now_ns - sm.recv_time_ns[service]) / 1e6:.0f} ms ago)"
    if what == "freq_ok" and service in sm.freq_tracker:
        tr = sm.freq_tracker[service]
        if (n := len(tr.recv_times_ns) - 1) < tr.short_intervals:
            return f"{check} ({max(n, 0)} of {tr.short_intervals} intervals received)"
        short, long_ = (f"{r:.2f}" if r is not None else "-" for r in tr.rates_hz())
        why = "too slow: " if tr.too_slow() else "too fast: " if tr.too_fast() else ""
        return (
            f"{check} ({why}{short} Hz over {tr.short_intervals}, {long_} Hz over {tr.long_intervals} "
            f"intervals; allowed {tr.min_hz:g}..{tr.max_hz:g} Hz)"
        )
    return f"{check} (valid=False)"


@dataclass
class ControlState:
    engaged: bool = False
    soft_disabling: bool = False
    soft_disable_remaining_s: float = 0.0
    events: list[str] = field(default_factory=list)
    can_engage: bool = False
    allow_source_switch: bool = True


class ControlLogic:
    """The reference control decision. ``auto_engage``: engage by itself after ``ENGAGE_STABLE_S`` of
    passing checks (a stand-in for the driver's engage button)."""

    def __init__(self, auto_engage: bool = True) -> None:
        self.auto_engage = auto_engage
        self.engaged = False
        self.engaged_source: str | None = None
        self.soft_disable_start_ns: int | None = None
        self.failing_since_ns: int | None = None  # first step of the current run of failing steps while engaged
        self.ok_since_ns: int | None = None
        self.engage_requested = False

    def conditions(self, x: ControlInputs) -> list[str]:
        """The failing conditions (event names) for these inputs, in a fixed order."""
        events = []
        if not x.checks_ok:
            events.append("commIssue")
            events.extend(f"commIssue:{c}" for c in x.failed_checks)
        if x.frame_drop_perc > FRAME_DROP_MAX_PERC:
            events.append("modelLagging")
        host = not x.active and x.active_reason.startswith(HOST_LATE)
        missed = not x.active and x.active_reason.startswith(DEADLINE_MISS)
        if not x.active:
            events.append("hostLate" if host else "deadlineMissed" if missed else "chestnutInactive")
        if (self.engaged and self.engaged_source is not None and x.source != self.engaged_source
                and not host and not missed):
            events.append("modelSourceChanged")
        return events

    def request_engage(self) -> None:
        """The driver's button: engage at the next step that allows it."""
        self.engage_requested = True

    def step(self, now_ns: int, x: ControlInputs) -> ControlState:
        events = self.conditions(x)
        can_engage = not events and not self.engaged
        if events:
            self.ok_since_ns = None
        elif self.ok_since_ns is None:
            self.ok_since_ns = now_ns
        out_events = list(events)
        if self.engaged:
            if events:
                if self.failing_since_ns is None:
                    self.failing_since_ns = now_ns
                failing_s = (now_ns - self.failing_since_ns) / NS
                graced = LATE_FRAME_EVENTS.issuperset(events) and failing_s < LATE_FRAME_GRACE_S
                if self.soft_disable_start_ns is None and not graced:
                    self.soft_disable_start_ns = self.failing_since_ns  # the 3 s count from the first failing step
                    since = f" (counted from the first failing step, {failing_s:.2f} s ago)" if failing_s > 0 else ""
                    log.warning("soft disable: %s%s: %s", soft_disable_left(max(0.0, SOFT_DISABLE_S - failing_s)),
                                since, ", ".join(events))
                if failing_s >= SOFT_DISABLE_S:
                    self.engaged, self.engaged_source, self.soft_disable_start_ns = False, None, None
                    self.failing_since_ns = None
                    out_events.append("disengaged")
                    log.warning("soft disable: %s: disengaged, %.2f s after the first failing step",
                                soft_disable_left(0.0), failing_s)
            else:
                if self.soft_disable_start_ns is not None:
                    left = max(0.0, SOFT_DISABLE_S - (now_ns - self.soft_disable_start_ns) / NS)
                    self.soft_disable_start_ns = None
                    out_events.append("softDisableCleared")
                    log.info("soft disable cleared: %s", soft_disable_left(left))
                self.failing_since_ns = None
        else:
            stable = self.ok_since_ns is not None and (now_ns - self.ok_since_ns) / NS >= ENGAGE_STABLE_S
            if can_engage and (self.engage_requested or (self.auto_engage and stable)):
                self.engaged, self.engaged_source, self.engage_requested = True, x.source, False
                out_events.append("engaged")
                log.info("engaged on the %s model", x.source)
        start = self.soft_disable_start_ns
        soft = self.engaged and start is not None
        remaining = max(0.0, SOFT_DISABLE_S - (now_ns - start) / NS) if self.engaged and start is not None else 0.0
        return ControlState(
            engaged=self.engaged,
            soft_disabling=soft,
            soft_disable_remaining_s=remaining,
            events=out_events,
            can_engage=not events,
            allow_source_switch=not self.engaged,
        )


STARTUP_GRACE_S = 30.0
"""How long the control daemon waits for a starting stack before its failing checks are WARNINGs (s, our
choice): the node answers from its warm fallback a few seconds after it starts (the main job: first output
3.6 s after the launch), so 30 s without every check passing is a stack that did not come up."""


def checks_line(failed: tuple[str, ...], last_failed: tuple[str, ...], passed_once: bool,
                describe: Callable[[str], str], waited_s: float = 0.0,
                last_waited_s: float = 0.0) -> tuple[int, str] | None:
    """The log line (level, text) for this step's failing checks (``failed``, after ``last_failed``), or None when
    nothing changed: every change of the failing set with its evidence (``describe``), and the first pass. Until
    every check has passed once (``passed_once``) the stack is starting -- its services not yet heard is no
    failure -- so those lines are INFO (``waiting for the stack, ...``) for :data:`STARTUP_GRACE_S` after the
    daemon started (``waited_s``; ``last_waited_s``: at the previous step); then one WARNING that the stack has
    not come up, and every failing check after it, or after the first pass, is a WARNING."""
    grace_ends = not passed_once and last_waited_s < STARTUP_GRACE_S <= waited_s
    if failed and (failed != last_failed or grace_ends):
        what = "; ".join(describe(c) for c in failed)
        if grace_ends:
            return logging.WARNING, f"checks failed: the stack has not come up in {STARTUP_GRACE_S:g} s: {what}"
        if passed_once or waited_s >= STARTUP_GRACE_S:
            return logging.WARNING, f"checks failed: {what}"
        return logging.INFO, f"waiting for the stack, checks not passing yet: {what}"
    if not failed and not passed_once:
        return logging.INFO, "checks pass"
    if last_failed and not failed:
        return logging.INFO, "checks pass again"
    return None


def frame_frequencies(frame_rate_hz: float) -> dict[str, float]:
    """The nominal rates (Hz) of :data:`FRAME_SERVICES` when the camera sends ``frame_rate_hz`` frames a second."""
    return dict.fromkeys(FRAME_SERVICES, frame_rate_hz)


def control_submaster(prefix: str | None = None, frame_rate_hz: float = DEFAULT_FRAME_RATE_HZ) -> SubMaster:
    """The daemon's SubMaster: :data:`SERVICES` (:data:`FRAME_SERVICES` at ``frame_rate_hz``), its steps woken by
    :data:`STEP_ON`."""
    return SubMaster(list(SERVICES), poll=STEP_ON, prefix=prefix, frequency_hz=frame_frequencies(frame_rate_hz))


def fill_control_state(st: ControlState) -> object:
    msg = new_message("controlState")
    cs = msg.controlState
    cs.engaged, cs.softDisabling = st.engaged, st.soft_disabling
    cs.softDisableRemaining = st.soft_disable_remaining_s
    cs.canEngage, cs.allowSourceSwitch = st.can_engage, st.allow_source_switch
    ev = cs.init("events", len(st.events))
    for i, e in enumerate(st.events):
        ev[i] = e
    return msg


def control_rate(text: str) -> float:
    """``--rate``: the controlState rate, Hz, a number in [:data:`MIN_RATE_HZ`, :data:`MAX_RATE_HZ`] (the loop waits
    whole milliseconds, so a faster rate could not be kept); raises ``argparse.ArgumentTypeError`` (one line) for
    anything else, nan and inf included."""
    return checked_float(text, lambda rate: MIN_RATE_HZ <= rate <= MAX_RATE_HZ,
                         f"give a controlState rate in [{MIN_RATE_HZ:g}, {MAX_RATE_HZ:g}] Hz (default 20, the "
                         "service's rate)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-auto-engage", action="store_true", help="never engage by itself")
    p.add_argument(
        "--rate", type=control_rate, default=20.0,
        help=f"controlState rate, Hz (default 20, {MIN_RATE_HZ:g} to {MAX_RATE_HZ:g})",
    )
    p.add_argument(
        "--frame-rate", type=launch_rate_hz, default=DEFAULT_FRAME_RATE_HZ,
        help=f"the stack's camera rate, Hz, the rate {' and '.join(FRAME_SERVICES)} are judged at (default "
        f"{DEFAULT_FRAME_RATE_HZ:g}, {MIN_FRAME_RATE_HZ:g} to {MAX_FRAME_RATE_HZ:g}; chestnut launch passes its "
        "--rate)",
    )
    add_priority_argument(p, CONTROL_PRIORITY, "control daemon")


def run(args: argparse.Namespace) -> int:
    flag = StopFlag()
    logic = ControlLogic(auto_engage=not args.no_auto_engage)
    period_ms = max(1, int(1000 / args.rate))
    # Python's cycle collections after a step is sent, never in one; the full one on entry, before the priority
    with control_submaster(frame_rate_hz=args.frame_rate) as sm, PubMaster(["controlState"]) as pm, \
            IdleCollector() as collector:
        # its sockets are open (a runtime directory it must not use was refused by then, the refusal alone): now
        # its realtime priority, for every thread, zmq's I/O thread included
        apply_priority(getattr(args, "rt_priority", 0), "control", log)
        was_engaged = False
        last_failed: tuple[str, ...] = ()
        passed_once = False  # until every check has passed once, the stack is starting: nothing has failed yet
        started_ns, last_waited_s = sm.mono_time_ns(), 0.0
        while not flag.stop:
            sm.update(period_ms)
            now = sm.mono_time_ns()
            failed = failed_checks(sm)
            waited_s = (now - started_ns) / 1e9
            if line := checks_line(failed, last_failed, passed_once, functools.partial(describe_check, sm, now_ns=now),
                                   waited_s, last_waited_s):
                log.log(*line)
            passed_once, last_waited_s = passed_once or not failed, waited_s
            last_failed = failed
            x = ControlInputs(
                checks_ok=not failed,
                active=bool(sm["chestnutActive"].active),
                source=str(sm["chestnutActive"].source),
                frame_drop_perc=float(sm["modelOutput"].frameDropPerc),
                failed_checks=failed,
                active_reason=str(sm["chestnutActive"].reason),
            )
            st = logic.step(now, x)
            if st.engaged != was_engaged:
                log.info("controlState: engaged=%s events=%s", st.engaged, st.events)
                was_engaged = st.engaged
            pm.send("controlState", fill_control_state(st))
            collector.collect_due()
    return 0
