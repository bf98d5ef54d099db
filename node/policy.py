"""The node's per-frame decisions as pure functions over plain data: no clock, socket or process here.

``node.main`` gathers the facts (the supervisor's state, the worker's slots, the clock, each
source's outputs and their checks) and performs what these functions decide. One frame:

=====================  ==================================================================================
decision               rule
=====================  ==================================================================================
frame clock            :func:`frame_clock`: the deadline counts from the frame's ``timestampEof``
                       (CLOCK_MONOTONIC, the node's clock) when it is comparable; a stamp of 0 or one in
                       the future makes the frame's age unknown, and its output is not valid
submission             :func:`decide_submission`: the primary gets the frame only while it runs (active or
                       shadowing), its worker is ready and not draining, the frame is still inside its
                       deadline and a slot is free; the last two are *misses*
fallback runs          :func:`fallback_must_run`: in hot standby always; else whenever the primary does
                       not serve or did not get the frame
primary's response     :func:`pair_response`: the frame's own result, its failure, a late one (the
                       watchdog's verdict) or an earlier frame's, to be taken in and waited past
worker declared failed :func:`count_miss`: ``miss_run`` consecutive frames without a primary result in
                       time fail the gpu layer over (openpilot modeld gives the big model 150 ms a frame);
                       a miss while the host itself was late (:func:`host_late`) is the host's, not
                       counted, unless the dock is slower than the camera while the node itself was not
                       starved (:func:`host_excuse`); a run while the link failed transfers, or on a link
                       below SuperSpeed with the copies over half the dock's time, is the usb layer's
                       (:func:`miss_run_blame`), and so is a start's wait that outlasted its bound on a
                       link below SuperSpeed while it waited (:func:`slow_link_while`);
                       :func:`is_primary_fault`: an ERROR that leaves its layer at ERROR; a start that
                       fails (:func:`start_failure`) or takes too long (:func:`start_timed_out`); on a
                       failover a worker with requests in flight drains (:func:`drains_on_fail_over`)
agreement reference    :func:`agreement_reference`: the fallback's output, only when it passed its own
                       checks; without one a shadow frame casts no vote (:func:`shadow_vote`)
who answers            :func:`choose_answer`: the primary when the supervisor says it serves and its output
                       passed every check; else the fallback when its output passed every check; else no
                       valid output (``valid=False``) with the reason of each source
ChestnutActive         :func:`active_for_output`: the health rule (every layer OK and the primary serves),
                       and false for a frame whose output is not valid; :func:`mark_deadline_miss` marks a
                       reason that is only single deadline misses, not a failover
=====================  ==================================================================================

The output checks (:mod:`chestnut.node.validity`: present, shape, dtype, finite, range, stale) apply
to every source; agreement only to the primary, against a valid fallback output.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from chestnut.backend.classify import link_speed_text
from chestnut.backend.errors import Layer
from chestnut.node.health import SUPERSPEED_MBPS
from chestnut.node.supervisor import Source
from chestnut.node.validity import ValidityReport

NS_PER_MS = 1_000_000


# ---------------------------------------------------------------- the frame's clock
@dataclass(frozen=True)
class FrameClock:
    """When frame's deadline counts from (``base_ns``, CLOCK_MONOTONIC) and whether its age is known.

    ``age_problem`` is empty when ``timestampEof`` is a time of this host's clock not after the
    frame's receipt; else the one-line reason its age is unknown (the output is then not valid)."""

    base_ns: int
    age_problem: str = ""

    @property
    def age_known(self) -> bool:
        return not self.age_problem


def frame_clock(frame_id: int, eof_ns: int, now_ns: int, wait_timeout_ms: float) -> FrameClock:
    """The clock of frame ``frame_id`` with ``timestampEof`` = ``eof_ns``, received at ``now_ns`` (ns).

    - ``eof_ns`` in ``[now - wait timeout, now]``: the deadline counts from it (time spent queued
      before the node could take the frame counts against the primary);
    - older than the wait timeout: the deadline counts from receipt (a frame that old is answered,
      not dropped; its age is still the truth and is published);
    - ``eof_ns == 0`` (never set) or after ``now_ns`` (not this host's CLOCK_MONOTONIC; the schema
      defines it as one): the deadline counts from receipt and the age is unknown.
    """
    if eof_ns == 0:
        return FrameClock(now_ns, f"cameraFrame {frame_id}: timestampEof is 0 (not set): the frame's age is unknown")
    if eof_ns > now_ns:
        ahead_ms = (eof_ns - now_ns) / NS_PER_MS
        return FrameClock(now_ns, f"cameraFrame {frame_id}: timestampEof is {ahead_ms:.1f} ms ahead of this host's "
                                  "CLOCK_MONOTONIC: the frame's age is unknown")
    if now_ns - eof_ns > int(wait_timeout_ms * NS_PER_MS):
        return FrameClock(now_ns)
    return FrameClock(eof_ns)


def frame_age_s(clock: FrameClock, eof_ns: int, publish_ns: int) -> float:
    """``modelOutput.frameAge`` in seconds: publish time minus ``timestampEof``; 0 when the age is unknown
    (the output then says why in ``reason`` and is not valid)."""
    if not clock.age_known:
        return 0.0
    return max(0.0, (publish_ns - eof_ns) / 1e9)


# ---------------------------------------------------------------- the primary's request
class Submit(StrEnum):
    SUBMIT = "submit"  # hand the frame to the worker
    MISS = "miss"      # the primary should answer but cannot in time: a deadline miss
    SKIP = "skip"      # the primary does not run for this frame (not serving nor shadowing, no ready worker)


@dataclass(frozen=True)
class PrimaryView:
    """What the node knows of the primary when a frame arrives.

    ``runs_primary``: the supervisor runs it (active or shadowing); ``worker_ready``: a worker exists,
    is alive and has loaded the model; ``draining``: it failed over and only finishes what is in
    flight; ``can_submit``: a slot is free; ``oldest_in_flight``: the oldest unanswered request."""

    runs_primary: bool
    worker_ready: bool
    draining: bool
    can_submit: bool
    oldest_in_flight: int | None = None


@dataclass(frozen=True)
class Submission:
    verdict: Submit
    why: str = ""  # for MISS and SKIP: why the primary does not answer this frame


UNAVAILABLE = "primary unavailable"
_SKIP_UNAVAILABLE = Submission(Submit.SKIP, UNAVAILABLE)  # immutable: the two common verdicts are made once
_SUBMIT = Submission(Submit.SUBMIT)


def decide_submission(view: PrimaryView, base_ns: int, now_ns: int, deadline_ms: float) -> Submission:
    """Whether frame (deadline counting from ``base_ns``) goes to the primary at ``now_ns``; see the table."""
    if not (view.runs_primary and view.worker_ready and not view.draining):
        return _SKIP_UNAVAILABLE
    waited_ms = (now_ns - base_ns) / NS_PER_MS
    if waited_ms >= deadline_ms:
        return Submission(Submit.MISS, f"frame waited {waited_ms:.0f} ms before the node could take it (deadline "
                                       f"{round(deadline_ms, 1):g} ms): the primary does not keep up")
    if not view.can_submit:
        busy = ("primary busy: every slot still holds an unanswered request (oldest frame "
                f"{view.oldest_in_flight})" if view.oldest_in_flight is not None else "primary busy")
        return Submission(Submit.MISS, busy)
    return _SUBMIT


def fallback_must_run(hot_standby: bool, primary_serves: bool, submitted: bool) -> bool:
    """Run the fallback before waiting for the primary: in hot standby (its output is the agreement
    reference), when the fallback serves, or when the primary did not get the frame."""
    return hot_standby or not primary_serves or not submitted


class Pairing(StrEnum):
    ANSWER = "answer"    # the frame's own result, in time: use it
    FAILED = "failed"    # the frame's own request failed (typed error): no primary output for it
    LATE = "late"        # the frame's own result, after the deadline: discarded, a miss
    EARLIER = "earlier"  # a result (or failure) of an earlier frame: take it in, keep waiting


def pair_response(seq: int, frame_seq: int, failed: bool, in_time: bool) -> Pairing:
    """What a response ``seq`` is to the frame being answered (request ``frame_seq``); ``failed``: it
    carries an error; ``in_time``: the watchdog's verdict lets its result be used."""
    if seq != frame_seq:
        return Pairing.EARLIER
    if failed:
        return Pairing.FAILED
    return Pairing.ANSWER if in_time else Pairing.LATE


BUSY_WAIT_LEAD_S = 0.0003
"""How long before the earliest of the worker's recent round trips the node stops sleeping for the result and
looks for it without sleeping (s): the round trips of one model on one dock differ from frame to frame by
about this much at their fastest (the tiny model on the host-CPU runner: 3.4 ms to 5 ms, most within 0.3 ms
of the fastest few, ``tests/bench/bench_node.py``)."""

BUSY_WAIT_MAX_S = 0.001
"""The longest busy wait for one result (s): 2 % of one CPU at 20 Hz at most (with :func:`warm_window`'s lead
and its warm-up, up to 1.2 ms and one pass of the result's path: 2.4 % plus that pass); a result that has not
come by then is slept for (``poll``) as any other."""

BUSY_WAIT_SAMPLES = 8
"""The round trips the window is judged from: the last this many successful ones of the current worker."""


def busy_wait_window(since_submit_s: float, roundtrips_s: Sequence[float]) -> tuple[float, float]:
    """(sleep, then busy-wait) in seconds for the result of a request submitted ``since_submit_s`` ago, from the
    worker's recent successful round trips (``roundtrips_s``, submit to receipt): the busy wait starts
    :data:`BUSY_WAIT_LEAD_S` before the earliest of the last :data:`BUSY_WAIT_SAMPLES` and lasts at most
    :data:`BUSY_WAIT_MAX_S`, whatever of it is left; (0, 0) until there are that many (a new worker, a new model).

    Why: woken by the result, the node pays a process wake-up that on a virtual machine's idle CPU is tens of us
    (the worker-hop floor, ``tests/bench/bench_node.py``); looking without sleeping, it pays none. The
    interpreter's own caches stay as cold (what the node last touched a frame ago)."""
    if len(roundtrips_s) < BUSY_WAIT_SAMPLES:
        return 0.0, 0.0
    start = min(roundtrips_s) - BUSY_WAIT_LEAD_S - since_submit_s
    return max(0.0, start), max(0.0, BUSY_WAIT_MAX_S + min(0.0, start))


WARM_LEAD_S = 0.0002
"""How much of the sleep before the busy wait goes to warming the result's path instead (s): the node runs its
output checks and the answer's template once on the last checked output, then busy-waits the rest. Longer than
that warm-up takes on cold caches (the tiny model's: 50-150 us, ``tests/bench/bench_timeline.py``), so it is
done before the result comes (docs/architecture.md, "The result's path warmed before the result")."""

WARM_MAX_BYTES = 256 * 1024
"""The largest output (bytes, all tensors together) whose path is warmed: a larger one's checks cost more than
cold caches add to them (their reductions stream the tensors), so it would only double them."""


def warm_window(sleep_s: float, spin_s: float) -> tuple[float, float]:
    """:func:`busy_wait_window`'s (sleep, busy-wait) with the warm-up between them: the sleep shortened by
    :data:`WARM_LEAD_S` (at most all of it), the busy wait lengthened as much, so the window ends where it did.
    (0, 0) stays (0, 0): no busy wait, no warm-up."""
    if not spin_s:
        return sleep_s, spin_s
    lead = min(sleep_s, WARM_LEAD_S)
    return sleep_s - lead, spin_s + lead


PREWAKE_LEAD_S = 0.001
"""How long before the next frame is due (s) the node wakes and sends its worker a WAKE (:func:`prewake_at`),
so that neither the WAKE's send nor the two processes' wake-ups from idle fall between the frame's receipt and
its RUN. The receipt of a frame on an idle host varies from frame to frame by a tenth to a fifth of this at
20 Hz (the pub/sub floor's p50 to p90, ``tests/bench/bench_node.py``); the WAKE goes out up to a millisecond
earlier still (the poll's timeout has whole milliseconds), and a frame later than three times this after it
(a loaded host, a camera that paused) gets one of its own (:func:`needs_wake`)."""

PREWAKE_PERIODS = 5
"""The frame periods (the camera's start-of-frame spacing per frame id) the next frame's time is judged from:
their median, so one late or dropped frame moves no pre-frame wake."""


def prewake_at(receipt_ns: int, periods_ms: Sequence[float], lead_s: float = PREWAKE_LEAD_S) -> int:
    """When (CLOCK_MONOTONIC ns) to wake before the frame after the one received at ``receipt_ns``: one frame
    period later (the median of the last :data:`PREWAKE_PERIODS` of ``periods_ms``, the camera's own spacing
    in ms), less ``lead_s``; 0 (no pre-frame wake) until that many periods are known, or where the period is
    not over twice the lead (a camera that fast leaves no idle time to wake in)."""
    if len(periods_ms) < PREWAKE_PERIODS:
        return 0
    recent = sorted(list(periods_ms)[-PREWAKE_PERIODS:])
    period_ns = round(recent[PREWAKE_PERIODS // 2] * 1e6)
    lead_ns = round(lead_s * 1e9)
    return receipt_ns + period_ns - lead_ns if period_ns > 2 * lead_ns else 0


def needs_wake(woken_ns: int, now_ns: int, lead_s: float = PREWAKE_LEAD_S) -> bool:
    """Whether a frame received at ``now_ns`` needs its own WAKE for the worker: the last one went out at
    ``woken_ns`` (0: never), at least three times ``lead_s`` ago (not this frame's pre-frame WAKE, which goes out
    between one and two leads before the frame is due, or the frame came that much later than it was due)."""
    return now_ns - woken_ns >= round(3 * lead_s * 1e9)


def no_result_reason(deadline_ms: float) -> str:
    return f"no primary result within the deadline ({round(deadline_ms, 1):g} ms after the frame)"


def late_result_reason(elapsed_ms: float, deadline_ms: float) -> str:
    return f"primary result after {elapsed_ms:.1f} ms, past the deadline ({round(deadline_ms, 1):g} ms)"


# ---------------------------------------------------------------- a host that is late itself
HOST_LATE_MS = 20.0
"""A wake-up this much later than asked (ms) is a late host: 0.4 of the 50 ms frame period, over ten times
what an idle host's timers overshoot by (the kernel's default timer slack is 50 us, a 2-core host running
the stack alone wakes within ~2 ms) and still well inside the 150 ms deadline it would have to explain."""
HOST_CPU_PRESSURE_PCT = 40.0
"""``/proc/pressure/cpu`` ``some avg10`` (%: the share of the last 10 s in which a runnable task waited for
a CPU, Linux PSI, ``Documentation/accounting/psi.rst``) from which a late host's reason also names the
machine's pressure: the stack alone on a 2-core host reads 10-15 %, the same host beside two CPU-bound
processes 60-100 %. Context only: PSI is system-wide, it says that *some* task waited, not that the node or
its worker did (both run at a realtime priority, ``node/realtime.py``, above the CPU-bound load that
raises it), so on its own it never makes a miss the host's."""
HOST_WINDOW_MS = 1000.0
"""How far back (ms) a late wake-up still explains a miss: 20 frames at 20 Hz, the watchdog's alive window."""


@dataclass(frozen=True)
class HostFigures:
    """How late the host itself was around one deadline miss, in ms and %. ``loop_late_ms``: the node's main
    loop, its worst wake-up after the time it asked for within the window; ``worker_late_ms``: the worker's
    heartbeat timer, likewise; ``cpu_pressure_pct``: PSI ``some avg10``, None where ``/proc/pressure/cpu``
    is absent (Linux < 4.20, or PSI off); ``dock_ms``: the dock's own time for the frame (its copy-in,
    compute and copy-out, from a late result's stage times), None when no result came; ``elapsed_ms``: the
    request to that result; ``twin_wait_ms``: on the twin only, its worst wait for a host CPU within the
    window: its GPU's (compute process's) threads, one still waiting included, and its sampler's own lateness
    (``backend/sim/hostwait.py``: the twin's GPU is host threads, a real dock's is not; 0 on a real dock);
    ``outside_ms``: the most a result lost outside the dock within the window (from when the worker could start
    its request to its receipt, less its dock stages): the frames queued behind a result the host delayed were
    delayed by the host too."""

    loop_late_ms: float = 0.0
    worker_late_ms: float = 0.0
    cpu_pressure_pct: float | None = None
    dock_ms: float | None = None
    elapsed_ms: float | None = None
    twin_wait_ms: float = 0.0
    outside_ms: float = 0.0

    @property
    def peak_late_ms(self) -> float:
        """The host's worst lateness of the window (ms): the node's loop, the worker's timer, the twin's wait,
        the time a result lost outside the dock."""
        return max(self.loop_late_ms, self.worker_late_ms, self.twin_wait_ms, self.outside_ms)


@dataclass(frozen=True)
class HostThresholds:
    """When the host counts as late (:func:`host_late`): ms of wake-up lateness, % of CPU pressure named in
    the reason, and the deadline (ms) a late result's dock time is held against."""

    late_ms: float = HOST_LATE_MS
    cpu_pressure_pct: float = HOST_CPU_PRESSURE_PCT
    deadline_ms: float = 150.0


def host_late(f: HostFigures, th: HostThresholds | None = None) -> str:
    """Why the host itself was late around a deadline miss, or "" when it was on time (the miss is then the
    dock's). Late when either holds: the node's loop or the worker's timer woke at least ``late_ms`` later
    than asked; a result came past the deadline although the dock's own stages fit inside it (the time was
    lost outside the dock: in scheduling the node and the worker); on the twin, its GPU or its own sampler waited at
    least ``late_ms`` for a host CPU (the twin is host work, so that wait is the host's, not the dock's); a
    result within the window lost at least ``late_ms`` outside the dock (the frames queued behind it waited on
    the host as well). Only
    the stack's own figures decide: a miss with no result, on an on-time node, worker and twin, is the dock's
    whatever else the machine runs, so a hung GPU fails over in ``timing.miss_run`` frames beside any load
    (a hung twin computes nothing and waits for no CPU). The CPU pressure, when at least
    ``cpu_pressure_pct``, is named as context in a late host's reason, e.g.
    ``host late: loop woke 38 ms late, cpu pressure 64 %``."""
    th = th or HostThresholds()
    starved = host_starved(f, th)
    why = [starved] if starved else []
    if f.dock_ms is not None and f.elapsed_ms is not None and f.dock_ms <= th.deadline_ms < f.elapsed_ms:
        why.append(f"the dock took {f.dock_ms:.0f} ms of the {f.elapsed_ms:.0f} ms")
    if f.twin_wait_ms >= th.late_ms:
        why.append(f"the twin waited {f.twin_wait_ms:.0f} ms for a CPU")
    if f.outside_ms >= th.late_ms and not (f.dock_ms is not None and f.elapsed_ms is not None):
        why.append(f"a result lost {f.outside_ms:.0f} ms outside the dock")
    if not why:
        return ""
    if f.cpu_pressure_pct is not None and f.cpu_pressure_pct >= th.cpu_pressure_pct:
        why.append(f"cpu pressure {f.cpu_pressure_pct:.0f} %")
    return HOST_LATE + ", ".join(why)


OUTPACED_RATIO = 1.5
"""How much slower than the camera the dock's own time must be for :func:`dock_outpaced` (our choice, measured
on this 2-core host): on the twin the whole dock is host work and the GPU thread's CPU wait is only part of what
a busy host costs it (its bridge threads, the copies), so the full-size NV12 stack at dock-like timing, loading
the host itself, read 1.18x the 50 ms frame with no fault (81 ms a frame less 22 ms, the period's share of its
443 ms a second of waiting; 0.9x with that wait's share of the frame itself, as now); a GPU at 90 ms a frame
reads 1.8x."""


def dock_outpaced(dock_ms: Sequence[float], period_ms: Sequence[float], twin_wait_ms: float = 0.0,
                  min_samples: int = 5, ratio: float = OUTPACED_RATIO) -> str:
    """Why the dock itself cannot keep up with the camera, or "": the median of its own time per frame over its
    last results (``dock_ms``: the stage times a runner reports, copy-in + compute + copy-out, ms), less the
    twin GPU's wait for a CPU that falls on it, is over the median frame period (``period_ms``: the camera's
    start-of-frame spacing, ms) times ``ratio`` (:data:`OUTPACED_RATIO`). The wait: ``twin_wait_ms`` of the last
    second (:class:`HostFigures`; on the twin the GPU is host work) is that share of the frame's dock time, at
    least -- a dock that queues every frame is busy all the time, so its GPU thread waited at least that share
    of each frame (0 on a real dock). Then every frame queues behind the one before it whatever the host does --
    the backlog grows by the difference each frame -- so a deadline miss is the dock's even while the host is
    late as well (:func:`host_late`), unless the host starved the node itself (:func:`host_excuse`). Needs
    ``min_samples`` of each; "" otherwise."""
    if len(dock_ms) < min_samples or len(period_ms) < min_samples:
        return ""
    period = float(np.median(period_ms))
    own = float(np.median(dock_ms)) * (1.0 - min(max(twin_wait_ms, 0.0), HOST_WINDOW_MS) / HOST_WINDOW_MS)
    if period <= 0 or own <= period * ratio:
        return ""
    return (f"the dock's own time per frame ({own:.0f} ms, median of its last {len(dock_ms)}) is over the frame "
            f"period ({period:.0f} ms): frames queue behind it whatever the host does")


def host_starved(f: HostFigures, th: HostThresholds | None = None) -> str:
    """Why the host starved the node itself around a miss, or "": the node's loop or the worker's timer -- both
    realtime threads where the host grants it (``node/realtime.py``, SCHED_FIFO 54 and 53, above any CPU-bound
    load) -- woke at least
    ``late_ms`` (:data:`HOST_LATE_MS`, 20 ms, 0.4 of the frame period) later than asked within the window. Then
    the host held off even the stack's highest-priority work, and the dock's stage times, which the worker
    measures on the host (a copy is host work: libusb's submissions and completions; on the twin all of the
    dock is), hold host time the node cannot tell from the dock's own, so :func:`dock_outpaced` cannot overrule
    the host's excuse (:func:`host_excuse`). Only the node's own wake-ups decide, not the CPU pressure: PSI is
    system-wide, and reads 60-100 % beside two CPU-bound processes that never delay a realtime thread, where a
    90 ms GPU must still count against the dock."""
    th = th or HostThresholds()
    why = []
    if f.loop_late_ms >= th.late_ms:
        why.append(f"loop woke {f.loop_late_ms:.0f} ms late")
    if f.worker_late_ms >= th.late_ms:
        why.append(f"worker's timer woke {f.worker_late_ms:.0f} ms late")
    return ", ".join(why)


@dataclass(frozen=True)
class HostExcuse:
    """:func:`host_excuse`'s verdict: ``host``, the host-late reason that makes a miss the host's ("" when the
    miss is the dock's); ``overruled``, the :func:`dock_outpaced` reason that took a late host's excuse away
    ("" when none did)."""

    host: str = ""
    overruled: str = ""


def host_excuse(f: HostFigures, dock_ms: Sequence[float], period_ms: Sequence[float],
                th: HostThresholds | None = None) -> HostExcuse:
    """Whether a deadline miss is the host's: :func:`host_late`'s reason, unless the dock is slower than the
    camera on its own time (:func:`dock_outpaced`, over ``dock_ms`` and ``period_ms``) -- a late host does not
    excuse that -- while the host did not starve the node itself (:func:`host_starved`: its loop or its worker's
    timer woke at least ``late_ms`` late). Starved, the miss is the host's whatever the dock's measured pace: the
    node publishes it as host late and counts no miss run against a dock layer. That never lets a hung GPU serve:
    the watchdog's hang check and served rule (``node/watchdog.py``: a worker with frames in hand that answers
    none within its deadline for the wait timeout + margin, 3000 + 250 ms) fail the gpu layer whatever the
    host's figures say."""
    th = th or HostThresholds()
    late = host_late(f, th)
    if not late or host_starved(f, th):
        return HostExcuse(late)
    slow = dock_outpaced(dock_ms, period_ms, f.twin_wait_ms)
    return HostExcuse("", slow) if slow else HostExcuse(late)


SLOW_COPY_SETTLE_S = 2.0
"""How long the copy path must stay slow (``slow_copy`` / ``slow_fence``, ``node/health.py``
``evidence_from_copy_timing``) before its usb WARN clears ``ChestnutActive`` (s): two of the node's 1 Hz probes
(our choice). Until then the WARN is advisory: a host starved for a moment slows the copies it drives before its
own lateness shows in the node's figures (the twin's GPU wait is known only when the wait ends), and one probe's
medians are no marginal link. A link that fails outright raises errors and misses, which fail over at once."""
SLOW_COPY_HOST_LOOKBACK_S = 3.0
"""A copy-path usb WARN stays advisory while the host was late within this many seconds (s): the copies a probe
rates are the last 16 of a size class (``backend/real_runner.py`` ``COPY_WINDOW``, 0.8 s at 20 Hz), and a probe's
evidence holds 2.5 s (``PROBE_FRESH_MS``), so copies slowed by a late host have left the medians by then."""
SLOW_COPY_EXCUSE_MAX_S = 10.0
"""The longest a late host excuses slow copies (s, our choice): a host starved by other work stalls for seconds
(two CPU hogs and a second stack at realtime priority slowed the twin's copies for ~6 s), a marginal link stays
slow. Past this the copy-path WARN speaks against the link however often the host is late: on a loaded host
some figure is late every few seconds (the twin's GPU waiting 20-27 ms for a CPU), which hid a link slowed to
0.20 of its first rate for a whole 30 s fault."""


def slow_copy_excuse(slow_for_s: float, host_late_ago_s: float | None, host_reason: str) -> str:
    """Why a copy-path usb WARN (slow copies or a slow fence) is only advisory now, or "" when it speaks against
    the link: the host was late ``host_late_ago_s`` s ago (None: not since the node started; ``host_reason``,
    :func:`host_late`'s words) within :data:`SLOW_COPY_HOST_LOOKBACK_S`, or the copies have been slow only
    ``slow_for_s`` s, under :data:`SLOW_COPY_SETTLE_S`. Never once they have been slow for
    :data:`SLOW_COPY_EXCUSE_MAX_S`."""
    if slow_for_s >= SLOW_COPY_EXCUSE_MAX_S:
        return ""
    if late := _host_was_late(host_late_ago_s, host_reason):
        return f"{late}: slow copies are the host's, not the link's"
    if slow_for_s < SLOW_COPY_SETTLE_S:
        return f"slow for {slow_for_s:.1f} s of the {SLOW_COPY_SETTLE_S:g} s that make a marginal link"
    return ""


def run_risk_excuse(at_risk_for_s: float, host_late_ago_s: float | None, host_reason: str) -> str:
    """Why the stage budget's "deadline at risk" WARN (``node/health.py`` ``StageBudget``: the primary's median run
    over the frame period, or its second slowest over the deadline less a period) is only advisory now, or "" when
    it speaks against the dock: the host was late within :data:`SLOW_COPY_HOST_LOOKBACK_S` (:func:`slow_copy_excuse`'s
    rule and words), and the runs have been at risk for less than :data:`SLOW_COPY_EXCUSE_MAX_S`. The run times are
    measured on the host (the worker's copies and fence polls; on the twin the GPU itself is host threads), so a
    host that held off the twin's GPU for hundreds of ms put the runs at risk with nothing wrong on the dock -- two
    stacks at realtime priorities on 2 cores read "gpu WARN: deadline at risk" for 1-2 s after such a stall. The
    frames the host does make late are still answered by the fallback and clear ``ChestnutActive`` as host late;
    a dock that stays slow speaks after 10 s, and its deadline misses fail it over as ever."""
    if at_risk_for_s >= SLOW_COPY_EXCUSE_MAX_S:
        return ""
    late = _host_was_late(host_late_ago_s, host_reason)
    return f"{late}: the slow runs are the host's, not the dock's" if late else ""


def _host_was_late(host_late_ago_s: float | None, host_reason: str) -> str:
    if host_late_ago_s is not None and host_late_ago_s <= SLOW_COPY_HOST_LOOKBACK_S:
        return f"{host_reason} {host_late_ago_s:.1f} s ago"
    return ""


HIGHSPEED_MBPS = 480  # USB 2 High Speed (backend/protocol.py HIGHSPEED_MBPS); below it USB 1
COPY_SHARE_BLAMES_LINK = 0.5
"""The share of the dock's own time per frame above which its copies (copy-in + copy-out), on a link below
SuperSpeed, make a run of misses the link's (:func:`miss_run_blame`): over half, so the copies, not the GPU's
compute, are the larger part of what made the frames late (our choice). A link that falls from SuperSpeed to USB 2
slows only the copies, about tenfold, so they pass half at once: the 128x256 model on the twin at dock-like timing
(5600 Mbps) spends 7.3 of its 14.4 ms a frame copying (p50: copy-in 2.5, compute 7.1, copy-out 4.8 ms), and
openpilot's ~22 ms frame copy (openpilot#38862) is already near half its 50 ms frame at SuperSpeed."""


def miss_run_blame(reason: str, transfer_errors: int, link_mbps: int | None = None,
                   stages_ms: Sequence[tuple[float, float, float]] = ()) -> tuple[Layer, str]:
    """The layer a run of deadline misses fails over, and the reason.

    - ``transfer_errors`` > 0 (the link failed that many transfer attempts since the primary's last result in
      time): the usb layer's, with the count -- the frames were late because the transport was retrying (each
      retry waits out its timeout, ``backend/retry.py``), and a new worker or a replug, not a GPU reset, is the
      remedy. A hung GPU's fence polls still complete, so they add no errors.
    - ``link_mbps`` (the dock's link speed at the last probe or enumeration, Mbps) below USB 3 SuperSpeed,
      5000 Mbps (:data:`~chestnut.node.health.SUPERSPEED_MBPS`, ``backend/protocol.py``'s: the USB 3.2
      specification's SuperSpeed, Gen 1, signalling rate, below which openpilot's hardware daemon calls the link
      slow; docs/protocol.md): the usb layer's when the copies dominate -- ``stages_ms``, the
      stage times (copy-in, compute, copy-out, ms) of the results that came since the primary's last result in
      time, whose medians of copy-in + copy-out are over :data:`COPY_SHARE_BLAMES_LINK` of the dock's own time --
      or when no result since then timed its stages (a request that never came back: on such a link large reads
      time out and bulk writes truncate, the project's rule for a wait that outlasts its timeout there,
      ``backend/classify.py`` ``blame_slow_link``). A slow link is remedied by a SuperSpeed port or cable, not a
      GPU reset. Compute over half the time on the same link stays the gpu's: a slow GPU is slow on any link.
    - otherwise the gpu layer's, ``reason`` unchanged."""
    if transfer_errors > 0:
        return Layer.USB, f"{reason}; the link failed {transfer_errors} transfer attempt(s) meanwhile"
    if link_mbps is None or link_mbps >= SUPERSPEED_MBPS:
        return Layer.GPU, reason
    speed = f"{link_mbps} Mbps, USB {2 if link_mbps >= HIGHSPEED_MBPS else 1}"  # as backend/classify.py names it
    if not stages_ms:
        return Layer.USB, (f"{reason}; on a {speed} link, below SuperSpeed ({SUPERSPEED_MBPS} Mbps), with no "
                           "result since the last one in time (copies ~10x slower, bulk writes may truncate)")
    copy_in, compute, copy_out = (float(np.median([s[i] for s in stages_ms])) for i in range(3))
    copies, own = copy_in + copy_out, copy_in + compute + copy_out
    if own <= 0 or copies <= COPY_SHARE_BLAMES_LINK * own:
        return Layer.GPU, reason
    return Layer.USB, (f"{reason}; on a {speed} link, below SuperSpeed ({SUPERSPEED_MBPS} Mbps), the copies took "
                       f"{copies:.1f} of the dock's {own:.1f} ms a frame (copy-in {copy_in:.1f}, compute "
                       f"{compute:.1f}, copy-out {copy_out:.1f} ms; median of {len(stages_ms)} result(s) since the "
                       "last one in time)")


def slow_link_while(readings: Sequence[tuple[int, int]], began_ns: int) -> str | None:
    """The link below SuperSpeed while a start's wait on the dock went on, for the blame of a wait that outlasted
    its bound (``node/main.py``: a stall while qualifying or loading, ``_stalled``; a start that timed out,
    ``_start_timed_out``): ``"480 Mbps, USB 2 link"``, or None (SuperSpeed throughout, or no reading: the gpu's).

    ``readings``: the link's speed readings, (ns, Mbps) oldest first (the worker's probes and the node's own
    looks, CLOCK_MONOTONIC); ``began_ns``: when the wait began. The link while it waited is the reading in force
    when it began (the last at or before ``began_ns``) and every one since, at its slowest: a bulk write a USB 2
    link truncated leaves the GPU waiting for data that never arrives, also once the link reads SuperSpeed again
    (a reload that stalled in a twin's ``usb2`` fault was blamed on the gpu: the fault ended and the node's next
    look read 5000 Mbps before the stall was found). When the latest reading is faster the text says so:
    ``"480 Mbps, USB 2 link while it waited (5000 Mbps at the last reading)"``. Readings before the one in force
    at the wait's start are not its link."""
    seen = [mbps for t, mbps in readings if t <= began_ns][-1:] + [mbps for t, mbps in readings if t > began_ns]
    speed = link_speed_text(min(seen)) if seen else None
    if speed is None or seen[-1] == min(seen):
        return f"{speed} link" if speed is not None else None
    return f"{speed} link while it waited ({seen[-1]} Mbps at the last reading)"


@dataclass(frozen=True)
class MissVerdict:
    """After one missed frame: the consecutive-miss count, whether (and why) the worker is failed over, and
    ``host``: why the miss was the host's (empty when it was the dock's; such a miss is not counted)."""

    run: int
    fail_over: bool
    reason: str = ""
    host: str = ""


def count_miss(run: int, miss_run: int, runs_primary: bool, deadline_ms: float, why: str,
               host: str = "", queued: str = "") -> MissVerdict:
    """One more frame the primary did not answer in time (``run`` misses before it, ``why`` this one).

    ``miss_run`` consecutive misses fail the gpu layer over while the primary runs; every further miss
    says so again (the supervisor ignores a repeat). A primary result in time resets the count to 0.
    ``host``: :func:`host_late`'s reason for this miss; a miss while the host was late is the host's: the
    count stays as it was (neither counted nor reset), so it never fails the gpu layer over nor feeds the
    supervisor's flap guard. ``queued``: why the frame only queued behind an earlier, slower one still within
    the ceiling (``node/watchdog.py`` ``queued_behind``); such a miss is not counted either."""
    if host:
        return MissVerdict(run, False, "", host)
    if queued:
        return MissVerdict(run, False)
    run += 1
    if run >= miss_run and runs_primary:
        return MissVerdict(run, True, f"{run} consecutive frames without a primary result within the deadline "
                                      f"({round(deadline_ms, 1):g} ms); last: {why}")
    return MissVerdict(run, False)


# ---------------------------------------------------------------- a worker that fails to start, or fails over
def drains_on_fail_over(alive: bool, ready: bool, in_flight: int, watchdog_outstanding: int) -> bool:
    """On a failover (BACK_OFF), whether the worker drains -- takes no new request, finishes what it has, and
    is killed when it answers or at the wait timeout + margin -- instead of being killed now: only a live,
    ready worker with requests in flight that the watchdog still supervises. Its answer (a typed error
    naming the failing layer, e.g. tinygrad's own wait timeout) is a better diagnosis than a kill."""
    return alive and ready and in_flight > 0 and watchdog_outstanding > 0


class StartFailure(StrEnum):
    """The supervisor event a failed worker start is (``node/supervisor.py`` ``Event`` values)."""

    DOCK_ABSENT = "dock_absent"      # no dock enumerated: look again later
    QUALIFY_FAILED = "qualify_failed"
    LOAD_FAILED = "load_failed"      # the dock qualified, the model did not load or warm up


MODEL_STEPS = ("model_loaded", "warmup")  # the ladder's model rungs (backend/ladder.py model_steps)
LOCK_REASONS = ("lock_held", "lock_unusable")
"""The dock's lock refused (``backend/docklock.py``): another process holds it, or its file cannot be used. The
worker takes it in ``usb_ids`` (the runners' ``lock_first``), where it once came with the data path in the model's
load: a failed load either way, never a missing dock."""


def start_failure(failed_step: str | None, model_error: bool, reason: str | None = None) -> StartFailure:
    """Which failure a worker start is, from the ladder's first failed step (None when the start failed
    before any step reported), whether the error is a :class:`~chestnut.backend.errors.ModelError` and the
    error's reason. A LOAD_FAILED means the dock steps passed, or the dock's lock was refused (below): the caller
    reports QUALIFIED first (the worker climbs the dock rungs and loads in one go).

    The dock's lock refused (:data:`LOCK_REASONS`, at ``usb_ids`` where the worker takes it) is LOAD_FAILED,
    wherever it came: the dock is there, another process has it (or its lock file is unusable), and the node
    backs off and says ``load_failed (usb): lock_held: ...`` as when the lock came with the data path. Any other
    ``usb_ids`` failure is DOCK_ABSENT."""
    if reason in LOCK_REASONS:
        return StartFailure.LOAD_FAILED
    if failed_step == "usb_ids":
        return StartFailure.DOCK_ABSENT
    if failed_step in MODEL_STEPS or model_error:
        return StartFailure.LOAD_FAILED
    return StartFailure.QUALIFY_FAILED


def start_timed_out(spawned_s: float, now_s: float, start_timeout_s: float) -> bool:
    """A worker not qualified and loaded ``start_timeout_s`` after its spawn is hung (a wait without a
    timeout of its own, or a lost message): killed. Times in seconds of one monotonic clock."""
    return now_s - spawned_s > start_timeout_s


def timed_out_start_failure(loading: bool) -> StartFailure:
    """A start that timed out counts against the step it was in: the model load (the dock had qualified)
    or the qualification."""
    return StartFailure.LOAD_FAILED if loading else StartFailure.QUALIFY_FAILED


def is_primary_fault(evidence_error: bool, layer_error: bool, wants_worker: bool) -> bool:
    """Evidence is a primary fault (the supervisor fails the worker over) when it is an ERROR, its layer is
    at ERROR after it -- also when it was ERROR already, a layer still recovering from the last fault --
    and the supervisor wants a worker running."""
    return wants_worker and evidence_error and layer_error


# ---------------------------------------------------------------- whose output is published
@dataclass(frozen=True)
class Candidate:
    """One source's answer to one frame: its outputs (None when it gave none), their checks (None when
    not checked), its run time (s) and, when it gave none, why (``error``)."""

    outputs: Mapping[str, np.ndarray] | None
    report: ValidityReport | None
    exec_s: float = 0.0
    error: str = ""

    @property
    def valid(self) -> bool:
        """Outputs that passed every check they were given."""
        return self.outputs is not None and self.report is not None and self.report.ok


def agreement_reference(fallback: Candidate | None) -> Mapping[str, np.ndarray] | None:
    """The fallback's outputs as the primary's agreement reference, only when they passed their own checks
    (an invalid reference would fail a valid primary, or agree with a broken one)."""
    return fallback.outputs if fallback is not None and fallback.valid else None


def shadow_vote(report: ValidityReport | None) -> bool | None:
    """A shadow frame's vote: True when the primary passed every check *including* agreement, False on a
    failed check, None (no vote) when the agreement could not be checked (no valid fallback output)."""
    if report is None:
        return None
    if not report.ok:
        return False
    return True if report.agreement_checked else None


def primary_serves(serving: Source, primary: Candidate | None) -> bool:
    """The primary answers this frame: the supervisor says it serves and its output passed every check."""
    return serving is Source.PRIMARY and primary is not None and primary.valid


@dataclass(frozen=True)
class Answer:
    """What is published for one frame: ``modelOutput.source``, its tensors (None: none), the serving
    model's run time (s), ``valid`` and ``reason`` (empty when the primary serves as it should)."""

    source: Source
    outputs: Mapping[str, np.ndarray] | None
    exec_s: float
    valid: bool
    reason: str


def choose_answer(serving: Source, serving_reason: str, primary: Candidate | None, fallback: Candidate | None,
                  primary_why: str) -> Answer:
    """Who answers the frame (see the module table).

    ``serving``/``serving_reason``: the supervisor's source and why; ``primary``: the primary's
    candidate (None: it gave no output, ``primary_why`` says why); ``fallback``: the fallback's (None:
    it did not run). Reasons, first match: the primary serves -> ""; the supervisor serves another
    source -> its reason; the primary's output failed a check -> ``"primary output invalid: ..."``;
    else ``primary_why``. A fallback that gives no valid output puts its own reason first.
    """
    if primary_serves(serving, primary):
        assert primary is not None
        return Answer(Source.PRIMARY, primary.outputs, primary.exec_s, True, "")
    if serving is not Source.PRIMARY:
        reason = serving_reason
    elif primary is not None and primary.report is not None and not primary.report.ok:
        reason = f"primary output invalid: {primary.report.reason}"
    else:
        reason = primary_why
    if fallback is None:
        return Answer(Source.NONE, None, 0.0, False, f"no source ran; {reason}")
    if fallback.outputs is None:
        return Answer(Source.FALLBACK, None, fallback.exec_s, False, f"{fallback.error}; {reason}")
    if fallback.report is not None and not fallback.report.ok:
        return Answer(Source.FALLBACK, None, fallback.exec_s, False,
                      f"fallback output invalid: {fallback.report.reason}; {reason}")
    return Answer(Source.FALLBACK, fallback.outputs, fallback.exec_s, True, reason)


def with_frame_clock(answer: Answer, clock: FrameClock) -> Answer:
    """The answer of a frame whose age is unknown is not valid; its reason comes first."""
    if clock.age_known:
        return answer
    reason = f"{clock.age_problem}; {answer.reason}" if answer.reason else clock.age_problem
    return Answer(answer.source, answer.outputs, answer.exec_s, False, reason)


INPUT_NOT_VALID = "input not valid: the camera published this frame with Event.valid false"
"""The reason an answer is published not valid when its frame's message was not: cereal's convention that a
message made from others is valid only when its inputs are (openpilot ``selfdrive/controls/lib/
longitudinal_planner.py`` ``LongitudinalPlanner.publish``: ``plan_send.valid = sm.all_checks(...)``, whose
``valid`` check is each input message's ``Event.valid``)."""


def with_input_validity(answer: Answer, valid: bool) -> Answer:
    """The answer of a frame whose message was not valid (``Event.valid`` false) is not valid; its reason comes
    first (:data:`INPUT_NOT_VALID`)."""
    if valid:
        return answer
    reason = f"{INPUT_NOT_VALID}; {answer.reason}" if answer.reason else INPUT_NOT_VALID
    return Answer(answer.source, answer.outputs, answer.exec_s, False, reason)


def active_for_output(health_active: bool, health_reason: str, valid: bool, reason: str) -> tuple[bool, str]:
    """``ChestnutActive`` after one frame: the health rule's verdict (every layer OK and the primary serves,
    :func:`chestnut.node.health.chestnut_active`), and false with the output's reason when the published
    output is not valid."""
    if not health_active:
        return False, health_reason
    if not valid:
        return False, f"output not valid: {reason}"
    return True, health_reason


HEALTH_NOT_YET_PUBLISHED = "all layers OK again, not yet said by chestnutHealth (at most one health period)"

DEADLINE_MISS = "deadline miss: "
"""How a ``ChestnutActive`` reason starts while what clears ``active`` is single deadline misses the node has
not failed the primary over for (:func:`mark_deadline_miss`)."""

HOST_LATE = "host late: "
"""How a host-lateness reason starts (:func:`host_late`), and so a ``ChestnutActive`` reason while the fallback
answers frames the primary missed because the host, not the dock, was late (docs/health.md "The host")."""


def mark_deadline_miss(active: bool, reason: str, serving_primary: bool, miss_warns: Collection[str],
                       missed_frame: int | None, previous_reason: str) -> str:
    """The ``ChestnutActive`` reason, prefixed :data:`DEADLINE_MISS` when ``active`` is false only because the
    primary missed single frames' deadlines while the node still serves it (``serving_primary``: no failover):
    the gpu layer's WARN is one of the deadline misses in ``miss_warns`` (the reasons of the last
    ``deadline_miss`` WARNs the node applied, ``node/health.py`` ``evidence_from_watchdog``); or the fallback
    answered ``missed_frame`` after its miss with every layer OK; or, right after such a reason
    (``previous_reason``), every layer is OK again but no ``chestnutHealth`` has said so yet
    (:data:`HEALTH_NOT_YET_PUBLISHED`). That wait right after a :data:`HOST_LATE` reason keeps its prefix the same
    way: the episode it ends was the host's, and a consumer that read it as a new, unexplained inactivity
    (``chestnutInactive``) would soft-disable at once where the host-late episode's grace applies. One miss
    is no proof that the dock failed: ``timing.miss_run`` (3)
    consecutive misses, or more than 20 % of the last 20 frames, fail the gpu layer over, and the reason is then
    the gpu ERROR's (docs/health.md "ChestnutActive"). A consumer can so tell a late frame, which the fallback
    answered, from a failing dock; ``launch/controld.py`` names it ``deadlineMissed``. Any other reason is
    returned as it is."""
    if active or not serving_primary or reason.startswith(DEADLINE_MISS):
        return reason
    if reason.startswith("gpu WARN: ") and reason.removeprefix("gpu WARN: ") in miss_warns:
        return DEADLINE_MISS + reason
    if missed_frame is not None and reason == f"{Source.FALLBACK.value} serving, not the primary":
        return f"{DEADLINE_MISS}the fallback answered frame {missed_frame}"
    if reason == HEALTH_NOT_YET_PUBLISHED:
        for prefix in (DEADLINE_MISS, HOST_LATE):
            if previous_reason.startswith(prefix):
                return prefix + reason
    return reason


def active_as_published(active: bool, reason: str, published_all_ok: bool) -> tuple[bool, str]:
    """``ChestnutActive`` never says more than the node's last ``chestnutHealth``: true only while the last
    health message published showed every layer OK (``published_all_ok``). A layer back to OK between two
    health messages (5 Hz) leaves ``active`` false until the next one says so, so no consumer -- nor
    ``chestnut check``'s ``active_only_when_healthy``, which judges each true ``active`` by the levels the
    health messages published -- sees ``active`` true beside a health message that says otherwise. Falling
    is never delayed."""
    if active and not published_all_ok:
        return False, HEALTH_NOT_YET_PUBLISHED
    return active, reason
