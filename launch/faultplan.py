"""``chestnut launch``'s fault plans: ``--fault KIND@START[+DURATION][,key=value]`` parsed and checked against
the twin's fault table (:class:`FaultPlan`), and carried out on the running twin (:class:`FaultRunner`):
each fault injected at its START (s after the node's first output) and cleared after its DURATION, with
the recovery a person would perform (:data:`RECOVERY_ACTIONS`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from chestnut.msgs.argtypes import MAX_RUN_SECONDS

if TYPE_CHECKING:
    from chestnut.launch.summary import StackClock

log = logging.getLogger("chestnut.launch")

_TEXT_PARAMS = frozenset({"on", "status", "phase"})  # backend/sim/faults.py FaultSpec's text fields


def _param_value(key: str, text: str) -> Any:
    """A ``--fault`` ``key=value``'s value: text for FaultSpec's text fields, else a number when it is one
    (``FaultSpec.validate`` names a value that is not)."""
    if key in _TEXT_PARAMS:
        return text
    try:
        return float(text)
    except ValueError:
        return text


@dataclasses.dataclass
class FaultPlan:
    kind: str
    start_s: float
    duration_s: float | None
    params: dict[str, Any]

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """``KIND@START[+DURATION][,key=value...]``, e.g. ``gpu_hang@20+10`` or ``slow_gpu@5+10,delay_ms=400``.

        The kind and the parameters are checked against the twin's fault table here, at parse time."""
        from chestnut.backend.sim.faults import FaultSpec

        head, *kvs = text.split(",")
        try:
            kind, when = head.split("@", 1)
            start, _, dur = when.partition("+")
            params: dict[str, Any] = {}
            for kv in kvs:
                k, _, v = kv.partition("=")
                params[k.strip()] = _param_value(k.strip(), v.strip())
            plan = cls(kind.strip(), float(start), float(dur) if dur else None, params)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: want KIND@START[+DURATION][,key=value]") from e
        # each at most a week (MAX_RUN_SECONDS, the longest --seconds): a run goes on until its plan is carried
        # out, so `gpu_hang@5+1e12` was a run that never ended ("cleared at 1000000000007.7 s")
        if not (0 <= plan.start_s <= MAX_RUN_SECONDS) or (  # also nan (every comparison false) and inf
                plan.duration_s is not None and not (0 < plan.duration_s <= MAX_RUN_SECONDS)):
            raise argparse.ArgumentTypeError(f"{text!r}: START must be a number >= 0 and DURATION a number > 0 "
                                             f"(seconds; not nan or inf), each at most {MAX_RUN_SECONDS:g} (a week, "
                                             "the longest --seconds)")
        unknown = sorted(set(params) - set(FaultSpec.__dataclass_fields__) - {"kind"})
        if unknown:
            raise argparse.ArgumentTypeError(
                f"{text!r}: unknown parameter(s) {unknown}; known: "
                f"{', '.join(f for f in FaultSpec.__dataclass_fields__ if f != 'kind')}"
            )
        try:
            FaultSpec(plan.kind, **params).validate()
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from e
        return plan


# At the end of a fault's DURATION the fault is cleared and, for faults that leave a state behind like
# hardware does (backend/sim/faults.py KINDS "recovery"), the recovery a person would perform is done.
RECOVERY_ACTIONS: dict[str, str] = {"disconnect": "plug", "brownout": "plug", "wedged": "power_cycle"}


@dataclasses.dataclass(frozen=True)
class ScheduleStep:
    """One step the launch carried out: at ``t_ns`` (CLOCK_MONOTONIC), ``action`` ``inject`` or ``clear`` of a
    fault of ``kind``, the twin's id of it (``fault_id``; None when the twin named none), ``detail`` (an inject:
    its parameters as JSON; a clear: the recovery done after it, ``then plug``) and, for a clear, how many
    faults the twin ``removed``: 0 when the fault was gone already -- a one-shot is spent as it fires, a
    ``for_s`` fault expires -- which is no failure: its DURATION was the launch's, not the twin's."""

    t_ns: int
    action: str
    kind: str
    detail: str
    fault_id: int | None = None
    removed: int | None = None


class FaultRunner:
    """Carries out ``plans`` on the twin of ``prefix`` as the run's time passes: :meth:`step` with the seconds
    since the node's first output injects the faults whose START has come and clears those whose DURATION
    is over. :attr:`schedule` records what was done (:class:`ScheduleStep`). A fault the twin refuses, or one a
    restarted twin no longer has, is named in one log line and the run goes on."""

    def __init__(self, prefix: str, plans: list[FaultPlan], clock: StackClock) -> None:
        self.prefix = prefix
        self.pending = sorted(plans, key=lambda f: f.start_s)
        # when the whole plan is carried out, s after the plans' zero: the last START or START + DURATION
        self.plan_end_s = max((f.start_s + (f.duration_s or 0.0) for f in plans), default=0.0)
        self.injected: list[tuple[FaultPlan, int | None]] = []
        self.schedule: list[ScheduleStep] = []
        self.clock = clock

    @property
    def carried_out(self) -> bool:
        """Every planned fault injected, and cleared where it has a DURATION (or refused by the twin)."""
        return not self.pending and not any(f.duration_s is not None for f, _ in self.injected)


    def log_plan(self, t0_s: float) -> None:
        """One log line per planned fault, at its times on the run's clock (``t0_s``: the plans' zero on it)."""
        for f in self.pending:
            log.info(
                "fault schedule: %s%s at %.1f s%s",
                f.kind,
                f" {f.params}" if f.params else "",
                t0_s + f.start_s,
                f", cleared at {t0_s + f.start_s + f.duration_s:.1f} s" if f.duration_s is not None else "",
            )

    def step(self, elapsed_s: float) -> None:
        """Inject and clear what is due ``elapsed_s`` (s) after the node's first output."""
        from chestnut.backend.sim.client import TwinClient

        while self.pending and elapsed_s >= self.pending[0].start_s:
            f = self.pending.pop(0)
            try:
                with TwinClient(self.prefix) as tc:
                    info = tc.fault(f.kind, **f.params)
                fid = info.get("id") if isinstance(info, dict) else None
                self.injected.append((f, fid))
                now = time.monotonic_ns()
                self.schedule.append(ScheduleStep(now, "inject", f.kind, json.dumps(f.params) if f.params else "", fid))
                log.info("t=%.1f s: injected %s%s", self.clock.seconds(now), _named(f.kind, fid),
                         f" {f.params}" if f.params else "")
            except Exception as e:  # the twin refuses a bad fault: say so, keep running
                log.error("could not inject %s: %s", f.kind, e)
        for f, fid in list(self.injected):
            if f.duration_s is not None and elapsed_s >= f.start_s + f.duration_s:
                action = RECOVERY_ACTIONS.get(f.kind)
                self.injected.remove((f, fid))
                try:
                    with TwinClient(self.prefix) as tc:
                        removed = int(tc.clear(fid))
                        if action == "plug" and not tc.status()["usb"]["present"]:
                            tc.plug()
                        elif action == "power_cycle":
                            tc.power_cycle(0)
                except Exception as e:  # a twin that restarted lost its faults: say so, keep running
                    log.error("t=%.1f s: could not clear %s: %s", self.clock.seconds(time.monotonic_ns()), f.kind, e)
                    continue
                now = time.monotonic_ns()
                self.schedule.append(ScheduleStep(now, "clear", f.kind, f"then {action}" if action else "", fid,
                                                  removed))
                log.info(
                    "t=%.1f s: cleared %s%s%s", self.clock.seconds(now), _named(f.kind, fid),
                    "" if removed else ": the twin had nothing left to remove (spent as it fired, or expired)",
                    f" and did {action}" if action else "",
                )

    def schedule_rows(self, t_zero_ns: int) -> list[dict[str, Any]]:
        """:attr:`schedule` on the log's clock, as the summary's ``fault_schedule`` and ``faults.json`` carry it:
        ``{"t_s", "action", "fault", "detail", "id"}`` and, for a clear, ``"removed"`` (:class:`ScheduleStep`);
        ``t_s`` in s since ``t_zero_ns`` (CLOCK_MONOTONIC ns of the log's first message), ``fault`` the kind,
        ``id`` the twin's id of it (the ``#N`` of its ``twinFault`` events; null when the twin named none)."""
        rows: list[dict[str, Any]] = []
        for st in self.schedule:
            row = {"t_s": round((st.t_ns - t_zero_ns) / NS, 3), "action": st.action, "fault": st.kind,
                   "detail": st.detail, "id": st.fault_id}
            if st.action == "clear":
                row["removed"] = st.removed
            rows.append(row)
        return rows


FAULTS_FILE_KEYS = ("fault_schedule", "fault_events")


def faults_file_text(summary: dict[str, Any]) -> str:
    """The run directory's ``faults.json``: the summary's ``fault_schedule`` (:meth:`FaultRunner.schedule_rows`)
    and ``fault_events`` (the twin's, ``launch/summary.py`` ``summarize``), as ``--json`` carries them."""
    return json.dumps({key: summary.get(key, []) for key in FAULTS_FILE_KEYS}, indent=1)


def _named(kind: str, fault_id: int | None) -> str:
    """A fault as the twin's events name it, ``gpu_hang#1`` (the kind alone without an id)."""
    return kind if fault_id is None else f"{kind}#{fault_id}"


NS = 1_000_000_000
