"""The primary's adaptive frame deadline: a pure function of its own recent latencies and the host's lateness.

The fixed 150 ms of openpilot's modeld (``timing.deadline_ms``) is the *ceiling*: with the fallback in hot
standby its answer is ready a few ms after the frame arrives, so waiting 150 ms for a primary that answers
every frame in ~25 ms turns a hung frame into three frame periods of silence. The deadline in force follows
the primary's measured latency instead (docs/health.md "Adaptive deadline"):

    need     = max(q * margin, q + host_late_ms)
    need     = target           if need > target and q * period_margin <= target   (the frame period)
    deadline = min(ceiling, max(floor, need))

where ``q`` is the ``quantile`` (nearest rank) of the last ``window`` primary latencies (ms from the frame's
``timestampEof`` to the primary's result reaching the node: what the deadline itself measures, queueing
included; late results count too). Until ``min_frames`` latencies are known the deadline is the ceiling.

The frame period: ``target`` = ``period_ms`` - ``answer_ms`` (50 - 5 = 45 ms) is the latest deadline at which
the fallback's answer still comes within one frame period of the frame. When the margin and host terms ask
for more but the primary's ``q`` fits under the target with ``period_margin`` (x 1.15) to spare, the target
is the deadline: a frame the primary has not answered by then is answered by the fallback inside the frame
period, while the primary keeps its 2nd slowest of 100 frames plus 15 % (a frame slower than that is one
miss answered by the fallback, never a failover on its own). A primary that cannot fit the frame period with
that headroom keeps the full margin (it cannot answer in one period anyway, and its stage budget says so).

The host: ``host_late_ms`` (``timing.host_late_ms``, 20 ms) is the lateness from which
:func:`chestnut.node.policy.host_late` takes a miss as the host's (not counted against the dock). The
allowance covers the host's jitter below it, so a frame the dock answers within ``q`` is never missed
because the host was a little late; a host later than that makes the miss its own. While the host is late
the deadline does not fall below the one in force: a late host's frames are never judged against a deadline
it shrank.
Under the frame-period target the headroom ``target - q`` can be less than the allowance; a miss
whose dock stages fit the deadline is then still the host's (``host_late``: the time was lost outside the
dock), so the host's jitter counts against the dock only where a runner reports no stage times.

Nothing here reads a clock: the node passes the window and the host's figures and keeps the result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from chestnut.node.policy import HOST_LATE_MS

DEADLINE_CEILING_MS = 150.0
"""openpilot modeld: the big model's 0.15 s per-frame deadline (``timing.deadline_ms``); never exceeded."""
DEADLINE_FLOOR_MS = 25.0
"""Our choice: half the 50 ms frame period (20 Hz, modeld's model rate). Below it a deadline would be set by
the node's own loop granularity (the main loop's poll is in whole ms, an idle 2-core host wakes within ~2 ms)
rather than by the dock; at the floor the fallback still answers within one frame period."""
DEADLINE_WINDOW = 100
"""Latencies the rule looks at: the last 100 primary results, 5 s at 20 Hz. A slow stretch of a few frames
stays in it for 5 s, so the deadline falls back only after 5 s of faster frames."""
DEADLINE_MIN_FRAMES = 20
"""Latencies needed before the deadline adapts: 1 s at 20 Hz (the health layers' staleness window,
``node/health.py``); before that, and after every worker start, the ceiling."""
DEADLINE_QUANTILE = 0.99
"""The latency the deadline must cover: over 100 frames the second slowest (nearest rank), so one outlier
in 5 s does not set it, two do (``node/health.py`` ``RISK_RANK`` = 2, the same idea over 20 frames)."""
DEADLINE_MARGIN = 1.5
"""Multiplier on that latency: a slow primary (p99 60 ms) gets 90 ms, not 80 ms."""
DEADLINE_PERIOD_MS = 50.0
"""The frame period the deadline aims inside: openpilot's model rate, ``DT_MDL`` = 0.05 s in
``common/realtime.py`` (``node/health.py`` ``FRAME_PERIOD_S``)."""
DEADLINE_ANSWER_MS = 5.0
"""Time the fallback's answer needs after the deadline, ms: measured on this 2-core host, the first fallback
frame of a deadline-decided fault comes 1-2 ms after the deadline in force (``tests/bench/bench_node.py --only
faults``); 5 ms leaves room for a busy host."""
DEADLINE_PERIOD_MARGIN = 1.15
"""The headroom the primary keeps under the frame-period target: its 2nd slowest of 100 frames plus 15 %.
Our choice, not a measured figure: a stretch slower by more than 15 % than the worst but one of the last 5 s
is a deadline miss the fallback answers, and only a run or a rate of them fails over (docs/health.md)."""


@dataclass(frozen=True)
class DeadlineRule:
    """The rule's parameters (ms, frames, a quantile in (0, 1], a margin >= 1). Raises ``ValueError`` for
    values that cannot make a deadline (a floor above the ceiling, a window below ``min_frames``)."""

    ceiling_ms: float = DEADLINE_CEILING_MS
    floor_ms: float = DEADLINE_FLOOR_MS
    window: int = DEADLINE_WINDOW
    min_frames: int = DEADLINE_MIN_FRAMES
    quantile: float = DEADLINE_QUANTILE
    margin: float = DEADLINE_MARGIN
    host_late_ms: float = HOST_LATE_MS
    adaptive: bool = True
    period_ms: float = DEADLINE_PERIOD_MS
    answer_ms: float = DEADLINE_ANSWER_MS
    period_margin: float = DEADLINE_PERIOD_MARGIN

    @property
    def target_ms(self) -> float:
        """The latest deadline whose fallback answer still lands inside the frame period, ms."""
        return self.period_ms - self.answer_ms

    def __post_init__(self) -> None:
        if not 0 < self.floor_ms <= self.ceiling_ms < math.inf:
            raise ValueError(f"deadline floor {self.floor_ms} ms and ceiling {self.ceiling_ms} ms: want "
                             "0 < floor <= ceiling")
        if not 1 <= self.min_frames <= self.window:
            raise ValueError(f"deadline min_frames {self.min_frames}, window {self.window}: want 1 <= min_frames "
                             "<= window")
        if not 0 < self.quantile <= 1 or not self.margin >= 1 or not self.host_late_ms >= 0:
            raise ValueError(f"deadline quantile {self.quantile}, margin {self.margin}, host_late_ms "
                             f"{self.host_late_ms}: want 0 < quantile <= 1, margin >= 1, host_late_ms >= 0")
        if not 0 <= self.answer_ms < self.period_ms < math.inf or not self.period_margin >= 1:
            raise ValueError(f"deadline period {self.period_ms} ms, answer {self.answer_ms} ms, period margin "
                             f"{self.period_margin}: want 0 <= answer < period, period margin >= 1")


@dataclass(frozen=True)
class Deadline:
    """The deadline in force (ms) and why: ``basis`` names the term that set it (``ceiling``, ``floor``,
    ``margin``, ``host``, ``period``, ``held``, ``warming``, ``fixed``); ``quantile_ms`` the latency it covers
    (NaN while warming or fixed)."""

    ms: float
    basis: str
    quantile_ms: float = math.nan

    def describe(self) -> str:
        """One line, e.g. ``deadline 36.0 ms (p99 16.0 ms + host allowance 20 ms)``."""
        q = f"p99 {self.quantile_ms:.1f} ms" if not math.isnan(self.quantile_ms) else ""
        why = {"ceiling": f"ceiling; {q}", "floor": f"floor; {q}", "margin": f"{q} x margin",
               "host": f"{q} + host allowance", "period": f"frame period less the fallback's answer; {q}",
               "held": "held while the host is late",
               "warming": "ceiling until enough primary frames", "fixed": "fixed"}.get(self.basis, self.basis)
        return f"deadline {self.ms:.1f} ms ({why})"


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by nearest rank (the ceil(q * n)-th smallest). Raises ``ValueError``
    for an empty sequence."""
    if not values:
        raise ValueError("nearest_rank of no values")
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


def adaptive_deadline(latencies_ms: Sequence[float], rule: DeadlineRule, *, previous: Deadline | None = None,
                      host_late: bool = False) -> Deadline:
    """The primary's deadline (ms) for the next frame (module docstring).

    ``latencies_ms``: the primary's recent latencies, oldest first (only the last ``rule.window`` count);
    ``previous``: the deadline in force until now (None: none yet); ``host_late``: the host is late now
    (the deadline then does not fall below an adapted ``previous``; the ceiling of a warming one is not held)."""
    if not rule.adaptive:
        return Deadline(rule.ceiling_ms, "fixed")
    recent = list(latencies_ms)[-rule.window:]
    if len(recent) < rule.min_frames:
        return Deadline(rule.ceiling_ms, "warming")
    q = nearest_rank(recent, rule.quantile)
    by_margin = q * rule.margin
    by_host = q + rule.host_late_ms
    need, basis = (by_margin, "margin") if by_margin >= by_host else (by_host, "host")
    target = rule.target_ms
    if need > target and q * rule.period_margin <= target:
        need, basis = target, "period"
    if need <= rule.floor_ms:
        need, basis = rule.floor_ms, "floor"
    if need >= rule.ceiling_ms:
        need, basis = rule.ceiling_ms, "ceiling"
    if host_late and previous is not None and previous.basis not in ("warming", "fixed") and previous.ms > need:
        return Deadline(min(previous.ms, rule.ceiling_ms), "held", q)
    return Deadline(need, basis, q)
