"""The node's per-frame decisions (``node/policy.py``) as pure code: every branch, exact values.

No process, socket or clock: times are plain integers (ns), outputs small numpy arrays checked by the
real output checks (``node/validity.py``).
"""

from __future__ import annotations

import itertools
import os
from collections import deque

import numpy as np
import pytest

from chestnut.backend.errors import Layer
from chestnut.backend.model import TensorSpec
from chestnut.node.policy import (
    BUSY_WAIT_MAX_S,
    UNAVAILABLE,
    Answer,
    Candidate,
    FrameClock,
    HostExcuse,
    HostFigures,
    HostThresholds,
    Pairing,
    PrimaryView,
    StartFailure,
    Submission,
    Submit,
    active_as_published,
    active_for_output,
    agreement_reference,
    busy_wait_window,
    choose_answer,
    count_miss,
    decide_submission,
    dock_outpaced,
    drains_on_fail_over,
    fallback_must_run,
    frame_age_s,
    frame_clock,
    host_excuse,
    host_starved,
    is_primary_fault,
    late_result_reason,
    mark_deadline_miss,
    miss_run_blame,
    no_result_reason,
    pair_response,
    primary_serves,
    shadow_vote,
    slow_link_while,
    start_failure,
    start_timed_out,
    timed_out_start_failure,
    with_frame_clock,
)
from chestnut.node.supervisor import Event, Source
from chestnut.node.validity import StaleDetector, ValidityReport, check_outputs, contracts_from_specs
from chestnut.node.watchdog import ActionKind, RequestKind, Watchdog, WatchdogConfig

MS = 1_000_000
NOW = 10_000 * MS          # the node's clock when the frame arrives
WAIT_MS = 3000.0           # the dock's wait timeout
DEADLINE_MS = 150.0
CONTRACTS = contracts_from_specs([TensorSpec("prob", (2,), "float32")], {"prob": (0.0, 1.0)})
GOOD = {"prob": np.array([0.25, 0.75], np.float32)}
CLOSE = {"prob": np.array([0.2501, 0.75], np.float32)}      # within the 1e-3 tolerance of GOOD
FAR = {"prob": np.array([0.5, 0.75], np.float32)}           # disagrees with GOOD
NAN = {"prob": np.array([np.nan, np.nan], np.float32)}
OUT_OF_RANGE = {"prob": np.array([0.5, 1.5], np.float32)}


def checked(outputs: dict[str, np.ndarray], reference: dict[str, np.ndarray] | None = None) -> ValidityReport:
    return check_outputs(outputs, CONTRACTS, reference=reference)


# ---------------------------------------------------------------- the frame's clock
def test_a_frame_stamped_by_this_clock_counts_its_deadline_from_the_stamp() -> None:
    assert frame_clock(7, NOW - 20 * MS, NOW, WAIT_MS) == FrameClock(NOW - 20 * MS, "")
    assert frame_clock(7, NOW, NOW, WAIT_MS) == FrameClock(NOW, "")                          # just taken
    assert frame_clock(7, NOW - 3000 * MS, NOW, WAIT_MS) == FrameClock(NOW - 3000 * MS, "")  # the edge: kept


def test_a_frame_older_than_the_wait_timeout_counts_from_receipt_with_its_age_kept() -> None:
    clock = frame_clock(7, NOW - 3000 * MS - 1, NOW, WAIT_MS)
    assert clock == FrameClock(NOW, "") and clock.age_known
    assert frame_age_s(clock, NOW - 3000 * MS - 1, NOW + 5 * MS) == pytest.approx(3.005 + 1e-9)


def test_a_frame_without_timestamp_has_no_age() -> None:
    clock = frame_clock(7, 0, NOW, WAIT_MS)
    assert clock == FrameClock(NOW, "cameraFrame 7: timestampEof is 0 (not set): the frame's age is unknown")
    assert not clock.age_known
    assert frame_age_s(clock, 0, NOW + 5 * MS) == 0.0  # not the machine's uptime


def test_a_frame_from_the_future_has_no_age() -> None:
    clock = frame_clock(9, NOW + 2_500_000, NOW, WAIT_MS)
    assert clock == FrameClock(NOW, "cameraFrame 9: timestampEof is 2.5 ms ahead of this host's CLOCK_MONOTONIC: "
                                    "the frame's age is unknown")
    assert frame_age_s(clock, NOW + 2_500_000, NOW + 5 * MS) == 0.0  # not clamped into a plausible 2.5 ms


def test_frame_age_is_publish_time_minus_the_stamp() -> None:
    clock = frame_clock(1, NOW - 20 * MS, NOW, WAIT_MS)
    assert frame_age_s(clock, NOW - 20 * MS, NOW + 5 * MS) == pytest.approx(0.025)


def test_an_unknown_age_makes_the_answer_invalid_with_its_reason_first() -> None:
    unknown = FrameClock(NOW, "cameraFrame 3: timestampEof is 0 (not set): the frame's age is unknown")
    served = Answer(Source.PRIMARY, GOOD, 0.01, True, "")
    assert with_frame_clock(served, unknown) == Answer(Source.PRIMARY, GOOD, 0.01, False, unknown.age_problem)
    fb = Answer(Source.FALLBACK, GOOD, 0.02, True, "degraded")
    assert with_frame_clock(fb, unknown) == Answer(Source.FALLBACK, GOOD, 0.02, False,
                                                   f"{unknown.age_problem}; degraded")
    assert with_frame_clock(fb, FrameClock(NOW)) is fb


# ---------------------------------------------------------------- submission
READY = PrimaryView(runs_primary=True, worker_ready=True, draining=False, can_submit=True)


@pytest.mark.parametrize(("runs", "ready", "draining"),
                         [c for c in itertools.product([True, False], repeat=3) if c != (True, True, False)])
def test_a_primary_that_does_not_run_is_skipped_whatever_else_holds(runs: bool, ready: bool, draining: bool) -> None:
    for can_submit, waited_ms in itertools.product([True, False], [0, 500]):
        view = PrimaryView(runs, ready, draining, can_submit, 3)
        assert decide_submission(view, NOW - waited_ms * MS, NOW, DEADLINE_MS) == Submission(Submit.SKIP, UNAVAILABLE)


def test_a_ready_primary_gets_the_frame_inside_its_deadline() -> None:
    assert decide_submission(READY, NOW - 149 * MS, NOW, DEADLINE_MS) == Submission(Submit.SUBMIT, "")


def test_a_frame_past_its_deadline_before_submission_is_a_miss() -> None:
    assert decide_submission(READY, NOW - 150 * MS, NOW, DEADLINE_MS) == Submission(
        Submit.MISS, "frame waited 150 ms before the node could take it (deadline 150 ms): the primary does not "
                     "keep up")


def test_a_primary_with_every_slot_in_flight_misses_the_frame() -> None:
    busy = PrimaryView(True, True, False, can_submit=False, oldest_in_flight=415)
    assert decide_submission(busy, NOW, NOW, DEADLINE_MS) == Submission(
        Submit.MISS, "primary busy: every slot still holds an unanswered request (oldest frame 415)")
    no_seq = PrimaryView(True, True, False, can_submit=False)
    assert decide_submission(no_seq, NOW, NOW, DEADLINE_MS) == Submission(Submit.MISS, "primary busy")
    # the deadline is checked first: a frame both late and blocked says it waited
    assert decide_submission(busy, NOW - 200 * MS, NOW, DEADLINE_MS).why.startswith("frame waited 200 ms")


@pytest.mark.parametrize(("hot", "serves", "submitted", "runs"), [
    (True, True, True, True), (True, True, False, True), (True, False, True, True), (True, False, False, True),
    (False, True, True, False), (False, True, False, True), (False, False, True, True), (False, False, False, True),
])
def test_the_fallback_runs_unless_a_warm_standby_primary_serves_and_got_the_frame(
        hot: bool, serves: bool, submitted: bool, runs: bool) -> None:
    assert fallback_must_run(hot, serves, submitted) is runs


# ---------------------------------------------------------------- the primary's response
@pytest.mark.parametrize(("seq", "failed", "in_time", "want"), [
    (5, False, True, Pairing.ANSWER),
    (5, False, False, Pairing.LATE),
    (5, True, True, Pairing.FAILED),
    (5, True, False, Pairing.FAILED),   # a failure is a failure, late or not
    (4, False, True, Pairing.EARLIER),
    (4, False, False, Pairing.EARLIER),
    (4, True, True, Pairing.EARLIER),
    (4, True, False, Pairing.EARLIER),
])
def test_a_response_pairs_with_its_own_frame_only(seq: int, failed: bool, in_time: bool, want: Pairing) -> None:
    assert pair_response(seq, 5, failed, in_time) is want


def test_reasons_of_a_missing_or_late_result() -> None:
    assert no_result_reason(150.0) == "no primary result within the deadline (150 ms after the frame)"
    assert late_result_reason(171.26, 150.0) == "primary result after 171.3 ms, past the deadline (150 ms)"


# ---------------------------------------------------------------- the worker declared failed
def test_a_run_of_misses_fails_the_worker_over_at_the_limit_and_after() -> None:
    run, verdicts = 0, []
    for i in range(4):
        v = count_miss(run, 3, True, 150.0, f"miss {i}")
        verdicts.append((v.run, v.fail_over))
        run = v.run
    assert verdicts == [(1, False), (2, False), (3, True), (4, True)]
    assert count_miss(2, 3, True, 150.0, "primary busy").reason == (
        "3 consecutive frames without a primary result within the deadline (150 ms); last: primary busy")


def test_misses_while_the_primary_does_not_run_are_counted_but_fail_nothing() -> None:
    v = count_miss(7, 3, False, 150.0, "x")
    assert (v.run, v.fail_over, v.reason) == (8, False, "")


def test_a_miss_run_of_one_fails_over_at_once() -> None:
    assert count_miss(0, 1, True, 100.0, "late").fail_over


@pytest.mark.parametrize(("alive", "ready", "in_flight", "outstanding"), list(itertools.product(
    [True, False], [True, False], [0, 2], [0, 1])))
def test_only_a_live_ready_worker_with_supervised_requests_in_flight_drains(
        alive: bool, ready: bool, in_flight: int, outstanding: int) -> None:
    want = alive and ready and in_flight == 2 and outstanding == 1
    assert drains_on_fail_over(alive, ready, in_flight, outstanding) is want


@pytest.mark.parametrize(("step", "model_error", "want"), [
    ("usb_ids", False, StartFailure.DOCK_ABSENT),
    ("usb_ids", True, StartFailure.DOCK_ABSENT),          # no dock: nothing was loaded
    ("ltssm", False, StartFailure.QUALIFY_FAILED),
    ("link_speed", False, StartFailure.QUALIFY_FAILED),
    ("ltssm", True, StartFailure.LOAD_FAILED),            # a ModelError is a load failure wherever it came
    ("model_loaded", False, StartFailure.LOAD_FAILED),
    ("warmup", False, StartFailure.LOAD_FAILED),
    (None, False, StartFailure.QUALIFY_FAILED),           # died before any step reported
    (None, True, StartFailure.LOAD_FAILED),
])
def test_a_failed_start_is_the_failure_of_its_first_failed_step(step: str | None, model_error: bool,
                                                                want: StartFailure) -> None:
    assert start_failure(step, model_error) is want


@pytest.mark.parametrize(("step", "reason", "want"), [
    ("usb_ids", "lock_held", StartFailure.LOAD_FAILED),      # the dock is there; another process has it
    ("usb_ids", "lock_unusable", StartFailure.LOAD_FAILED),  # the dock is there; its lock file is unusable
    ("model_loaded", "lock_held", StartFailure.LOAD_FAILED),  # the data path's, as before lock_first
    ("usb_ids", "no_dock", StartFailure.DOCK_ABSENT),
    ("usb_ids", "bad_product", StartFailure.DOCK_ABSENT),
    ("ltssm", "ltssm_stuck", StartFailure.QUALIFY_FAILED),
])
def test_the_docks_lock_refused_is_a_failed_load_never_a_missing_dock(step: str, reason: str,
                                                                       want: StartFailure) -> None:
    assert start_failure(step, False, reason) is want


def test_start_failures_are_supervisor_events() -> None:
    assert [Event(k.value) for k in StartFailure] == [Event.DOCK_ABSENT, Event.QUALIFY_FAILED, Event.LOAD_FAILED]


def test_a_start_times_out_after_its_budget_and_counts_against_its_step() -> None:
    assert not start_timed_out(100.0, 160.0, 60.0)
    assert start_timed_out(100.0, 160.001, 60.0)
    assert timed_out_start_failure(loading=True) is StartFailure.LOAD_FAILED
    assert timed_out_start_failure(loading=False) is StartFailure.QUALIFY_FAILED


@pytest.mark.parametrize(("ev_error", "layer_error", "wants"), list(itertools.product([True, False], repeat=3)))
def test_a_primary_fault_is_an_error_that_leaves_its_layer_at_error_while_a_worker_is_wanted(
        ev_error: bool, layer_error: bool, wants: bool) -> None:
    assert is_primary_fault(ev_error, layer_error, wants) is (ev_error and layer_error and wants)


# ---------------------------------------------------------------- agreement reference and shadow votes
def test_only_a_valid_fallback_output_is_an_agreement_reference() -> None:
    assert agreement_reference(Candidate(GOOD, checked(GOOD))) is GOOD
    assert agreement_reference(Candidate(NAN, checked(NAN))) is None
    assert agreement_reference(Candidate(OUT_OF_RANGE, checked(OUT_OF_RANGE))) is None
    assert agreement_reference(Candidate(None, None, 0.0, "fallback failed: RuntimeError: x")) is None
    assert agreement_reference(Candidate(GOOD, None)) is None  # unchecked outputs are no reference
    assert agreement_reference(None) is None


def test_a_shadow_frame_votes_only_when_the_agreement_was_checked() -> None:
    assert shadow_vote(checked(CLOSE, reference=GOOD)) is True
    assert shadow_vote(checked(FAR, reference=GOOD)) is False
    assert shadow_vote(checked(NAN, reference=GOOD)) is False
    assert shadow_vote(checked(NAN)) is False          # a failed check needs no reference to count
    assert shadow_vote(checked(GOOD)) is None          # no reference: no agreement, no vote
    assert shadow_vote(None) is None


# ---------------------------------------------------------------- who answers
P_GOOD = Candidate(GOOD, checked(GOOD, reference=CLOSE), 0.004)
P_FAR = Candidate(FAR, checked(FAR, reference=GOOD), 0.004)
P_NAN = Candidate(NAN, checked(NAN), 0.004)
F_GOOD = Candidate(CLOSE, checked(CLOSE), 0.007)
F_NAN = Candidate(NAN, checked(NAN), 0.007)
F_FAILED = Candidate(None, None, 0.001, "fallback failed: RuntimeError: engine gone")
NAN_REASON = "prob: 2 non-finite value(s) (2 NaN, 0 inf), first at (0,)"
SUP = "deadline_miss_run (gpu): 3 consecutive frames"


def test_a_serving_primary_with_a_valid_output_answers() -> None:
    for fb in (F_GOOD, F_NAN, F_FAILED, None):
        assert choose_answer(Source.PRIMARY, "active", P_GOOD, fb, "") == Answer(Source.PRIMARY, GOOD, 0.004, True, "")
    assert primary_serves(Source.PRIMARY, P_GOOD)


def test_a_valid_primary_output_does_not_answer_while_the_supervisor_serves_the_fallback() -> None:
    assert not primary_serves(Source.FALLBACK, P_GOOD)
    assert choose_answer(Source.FALLBACK, "shadowing: 3 of 10", P_GOOD, F_GOOD, "") == Answer(
        Source.FALLBACK, CLOSE, 0.007, True, "shadowing: 3 of 10")


def test_an_invalid_primary_output_is_answered_by_a_valid_fallback() -> None:
    assert not primary_serves(Source.PRIMARY, P_NAN)
    assert choose_answer(Source.PRIMARY, "active", P_NAN, F_GOOD, "") == Answer(
        Source.FALLBACK, CLOSE, 0.007, True, f"primary output invalid: {NAN_REASON}")
    assert choose_answer(Source.PRIMARY, "active", P_FAR, F_GOOD, "") == Answer(
        Source.FALLBACK, CLOSE, 0.007, True, "primary output invalid: prob: 1 value(s) differ from the fallback "
                                             "beyond tol 0.001 (max abs diff 0.25, first at (0,))")


def test_a_primary_without_output_is_answered_by_the_fallback_with_why() -> None:
    why = "no primary result within the deadline (150 ms after the frame)"
    assert choose_answer(Source.PRIMARY, "active", None, F_GOOD, why) == Answer(Source.FALLBACK, CLOSE, 0.007, True,
                                                                                 why)


def test_no_valid_output_from_any_source_is_published_as_not_valid_with_each_reason() -> None:
    assert choose_answer(Source.FALLBACK, SUP, None, F_NAN, UNAVAILABLE) == Answer(
        Source.FALLBACK, None, 0.007, False, f"fallback output invalid: {NAN_REASON}; {SUP}")
    assert choose_answer(Source.PRIMARY, "active", P_NAN, F_NAN, "") == Answer(
        Source.FALLBACK, None, 0.007, False, f"fallback output invalid: {NAN_REASON}; primary output invalid: "
                                             f"{NAN_REASON}")
    assert choose_answer(Source.PRIMARY, "active", None, F_FAILED, "primary failed: gpu fence_stall") == Answer(
        Source.FALLBACK, None, 0.001, False, "fallback failed: RuntimeError: engine gone; primary failed: gpu "
                                             "fence_stall")
    out_of_range = Candidate(OUT_OF_RANGE, checked(OUT_OF_RANGE), 0.007)
    assert choose_answer(Source.FALLBACK, SUP, None, out_of_range, "") == Answer(
        Source.FALLBACK, None, 0.007, False, "fallback output invalid: prob: 1 value(s) outside [0, 1] (min 1.5, "
                                             f"max 1.5), first at (1,); {SUP}")
    assert choose_answer(Source.FALLBACK, SUP, None, None, UNAVAILABLE) == Answer(
        Source.NONE, None, 0.0, False, f"no source ran; {SUP}")


def test_a_stale_fallback_output_is_not_valid() -> None:
    stale = StaleDetector()
    first = check_outputs(GOOD, CONTRACTS, inputs={"x": np.zeros(4, np.float32)}, stale=stale)
    again = check_outputs(GOOD, CONTRACTS, inputs={"x": np.ones(4, np.float32)}, stale=stale)
    assert first.ok and not again.ok
    got = choose_answer(Source.FALLBACK, SUP, None, Candidate(GOOD, again, 0.007), UNAVAILABLE)
    assert got == Answer(Source.FALLBACK, None, 0.007, False, "fallback output invalid: output identical to the "
                         f"previous frame's while the input changed (1 in a row); {SUP}")


# ---------------------------------------------------------------- ChestnutActive
def test_chestnut_active_rises_only_once_a_published_health_says_every_layer_ok() -> None:
    assert active_as_published(True, "all layers OK", True) == (True, "all layers OK")
    assert active_as_published(True, "all layers OK", False) == (
        False, "all layers OK again, not yet said by chestnutHealth (at most one health period)")
    assert active_as_published(False, "usb WARN: 480 Mbps", True) == (False, "usb WARN: 480 Mbps")
    assert active_as_published(False, "usb WARN: 480 Mbps", False) == (False, "usb WARN: 480 Mbps")


MISS = "frame 133: no primary result 41.8 ms after the request (deadline 41.5 ms)"


def test_inactivity_from_single_deadline_misses_is_marked_so_a_consumer_can_tell_it_from_a_failing_dock() -> None:
    marked = f"deadline miss: gpu WARN: {MISS}"
    assert mark_deadline_miss(False, f"gpu WARN: {MISS}", True, [MISS], 133, "all layers OK") == marked
    # the frames after it, the primary's again, while the WARN holds; then every layer OK, not yet published
    assert mark_deadline_miss(False, f"gpu WARN: {MISS}", True, [MISS], None, marked) == marked
    waiting = "all layers OK again, not yet said by chestnutHealth (at most one health period)"
    assert mark_deadline_miss(False, waiting, True, [MISS], None, marked) == f"deadline miss: {waiting}"
    # the fallback answered the missed frame with every layer OK (its WARN not applied yet)
    assert mark_deadline_miss(False, "fallback serving, not the primary", True, [], 133, "all layers OK") == (
        "deadline miss: the fallback answered frame 133")


def test_a_failover_another_layer_or_another_gpu_warn_is_not_a_deadline_miss() -> None:
    assert mark_deadline_miss(True, "all layers OK", True, [MISS], None, "") == "all layers OK"
    assert mark_deadline_miss(False, f"gpu WARN: {MISS}", False, [MISS], 133, "") == f"gpu WARN: {MISS}"
    error = "gpu ERROR: 3 consecutive frames without a primary result within the deadline (41.5 ms)"
    assert mark_deadline_miss(False, error, True, [MISS], 135, "deadline miss: x") == error
    assert mark_deadline_miss(False, "gpu WARN: slow", True, [MISS], None, "") == "gpu WARN: slow"
    assert mark_deadline_miss(False, "usb WARN: 480 Mbps", True, [MISS], 133, "") == "usb WARN: 480 Mbps"
    waiting = "all layers OK again, not yet said by chestnutHealth (at most one health period)"
    assert mark_deadline_miss(False, waiting, True, [MISS], None, "usb WARN: 480 Mbps") == waiting
    assert mark_deadline_miss(False, "fallback serving, not the primary", True, [MISS], None, "") == (
        "fallback serving, not the primary")
    host = "host late: the fallback answered frame 7 (loop woke 38 ms late)"
    assert mark_deadline_miss(False, host, True, [MISS], 7, "") == host


def test_the_wait_for_chestnut_health_after_a_host_late_frame_stays_the_hosts() -> None:
    """A launch beside CPU hogs: a host-late frame, then the primary's next frame with every layer OK but not
    yet published; the control daemon read the bare wait as ``chestnutInactive`` and soft-disabled at once."""
    host = "host late: the fallback answered frame 1240 (the twin waited 44 ms for a CPU, cpu pressure 66 %)"
    waiting = "all layers OK again, not yet said by chestnutHealth (at most one health period)"
    assert mark_deadline_miss(False, waiting, True, [], None, host) == f"host late: {waiting}"
    assert mark_deadline_miss(False, waiting, True, [], None, f"host late: {waiting}") == f"host late: {waiting}"
    assert mark_deadline_miss(False, waiting, False, [], None, host) == waiting  # the fallback serves: no longer


def test_chestnut_active_needs_the_health_rule_and_a_valid_output() -> None:
    assert active_for_output(True, "all layers OK", True, "") == (True, "all layers OK")
    assert active_for_output(True, "all layers OK", False, "cameraFrame 3: timestampEof is 0") == (
        False, "output not valid: cameraFrame 3: timestampEof is 0")
    assert active_for_output(False, "gpu ERROR: fence stuck", False, "x") == (False, "gpu ERROR: fence stuck")
    assert active_for_output(False, "fallback serving, not the primary", True, "") == (
        False, "fallback serving, not the primary")


def test_a_dock_slower_than_the_camera_is_not_excused_by_a_late_host():
    """The median of the dock's own time per frame, less the share of it the twin's GPU waited for a CPU, against
    1.5 x the median frame period: 90 ms a frame on a 50 ms camera queues every frame behind the last whatever
    the host does."""
    five = [50.0] * 5
    assert dock_outpaced([90.0, 95.0, 92.0, 91.0, 93.0], five) == (
        "the dock's own time per frame (92 ms, median of its last 5) is over the frame period (50 ms): frames queue "
        "behind it whatever the host does")
    assert dock_outpaced([30.0] * 5, five) == ""  # keeps up: a late host may be the cause
    # on the twin, 400 ms of the last second waiting for a CPU is 40 % of each frame's dock time
    assert dock_outpaced([150.0] * 5, five, twin_wait_ms=400.0).startswith("the dock's own time per frame (90 ms")
    assert dock_outpaced([100.0] * 5, five, twin_wait_ms=400.0) == ""  # 60 ms of its own: not 1.5 x the period
    # a 90 ms GPU beside two CPU hogs (its GPU waited 40 ms a second): 86 ms of its own, the dock's
    assert dock_outpaced([90.0] * 5, five, twin_wait_ms=40.0).startswith("the dock's own time per frame (86 ms")
    # the full-size NV12 stack loading the host itself: 81 ms a frame, 443 ms a second waiting, no fault
    assert dock_outpaced([81.0] * 5, five, twin_wait_ms=443.0) == ""
    # beside a second full-size stack, its GPU waiting 448 ms a second: 120 ms a frame is 66 ms of its own, the
    # host's (one period's share of the wait, 22 ms, left 98 ms, over 75: the gpu failed over on host load)
    assert dock_outpaced([120.0] * 9, [50.0] * 20, twin_wait_ms=448.0) == ""
    assert dock_outpaced([160.0] * 5, five, twin_wait_ms=2000.0) == ""  # a wait over the window: all of it
    assert dock_outpaced([90.0] * 4, five) == ""  # too few results to say
    assert dock_outpaced([90.0] * 5, [50.0] * 4) == ""  # too few frames to say
    assert dock_outpaced([75.0] * 5, five) == ""  # exactly 1.5 x the period


def test_a_host_that_starved_the_node_itself_excuses_a_miss_whatever_the_docks_pace():
    """host_excuse: a late host's excuse stands unless the dock is slower than the camera; a node whose own
    realtime loop or worker timer woke 20 ms late or more was starved, and the miss is the host's even then."""
    slow, periods = [160.0] * 9, [50.0] * 20  # 160 ms a frame on a 50 ms camera: outpaced, however late the host
    outpaced = ("the dock's own time per frame (88 ms, median of its last 9) is over the frame period (50 ms): "
                "frames queue behind it whatever the host does")
    twin_only = HostFigures(loop_late_ms=4.0, worker_late_ms=6.0, cpu_pressure_pct=92.0, twin_wait_ms=448.0)
    assert host_excuse(twin_only, slow, periods) == HostExcuse("", outpaced)
    starved = HostFigures(loop_late_ms=31.0, worker_late_ms=6.0, cpu_pressure_pct=92.0, twin_wait_ms=448.0)
    assert host_starved(starved) == "loop woke 31 ms late"
    assert host_excuse(starved, slow, periods) == HostExcuse(
        "host late: loop woke 31 ms late, the twin waited 448 ms for a CPU, cpu pressure 92 %")
    timer = HostFigures(worker_late_ms=20.0)
    assert host_starved(timer) == "worker's timer woke 20 ms late"
    assert host_excuse(timer, slow, periods) == HostExcuse("host late: worker's timer woke 20 ms late")
    # below the threshold the node was not starved; the CPU pressure alone never says it was (PSI is system-wide)
    assert host_starved(HostFigures(loop_late_ms=19.9, worker_late_ms=19.9, cpu_pressure_pct=100.0)) == ""
    assert host_excuse(HostFigures(dock_ms=14.0, elapsed_ms=180.0), slow, periods) == HostExcuse(
        "", "the dock's own time per frame (160 ms, median of its last 9) is over the frame period (50 ms): frames "
            "queue behind it whatever the host does")
    # an on-time host excuses nothing, a dock that keeps up never overrules
    assert host_excuse(HostFigures(cpu_pressure_pct=100.0), slow, periods) == HostExcuse()
    assert host_excuse(twin_only, [40.0] * 9, periods) == HostExcuse(
        "host late: the twin waited 448 ms for a CPU, cpu pressure 92 %")
    assert host_excuse(timer, slow, periods, HostThresholds(late_ms=30.0)) == HostExcuse()  # the configured bound


def test_a_hung_gpu_on_a_starved_host_still_fails_over_at_the_wait_timeout_plus_margin():
    """Every miss of a hung GPU on a starved host is the host's (host_excuse), yet the watchdog's hang check
    kills the worker on the gpu layer at the wait timeout + margin (3000 + 250 ms), the served rule with it."""
    wd = Watchdog(WatchdogConfig())
    excuse = host_excuse(HostFigures(loop_late_ms=31.0), [160.0] * 9, [50.0] * 20)
    assert excuse.host == "host late: loop woke 31 ms late"
    wd.worker_started(0)
    actions, t = [], 0
    for i in range(80):  # a frame every 50 ms (deadline 45 ms), none ever answered
        now = i * 50 * MS
        assert wd.request(i, now, RequestKind.FRAME, 45.0) == []
        wd.heartbeat(now)  # its heartbeat thread still beats
        t = now + 46 * MS
        actions = [a for a in wd.check(t, excuse.host) if a.kind is not ActionKind.ANSWER_FROM_FALLBACK]
        if actions:
            break
    assert t == 3_296 * MS  # the first check past 3250 ms after frame 0
    assert [(a.kind, a.entity, a.layer, a.reason) for a in actions] == [
        (ActionKind.KILL_WORKER, "hang", Layer.GPU,
         "worker hung: request 0 (frame) unanswered after 3296.0 ms (wait timeout + margin 3250.0 ms)")]
    assert wd.host_misses == 66 and wd.misses == 66  # every miss before it was the host's


def test_a_miss_run_on_a_usb2_link_whose_copies_dominate_is_the_usb_layers():
    """Below SuperSpeed (5000 Mbps) a run of misses is the link's when the copies are over half the dock's own
    time per frame, or when no result came back since the last one in time; compute over half stays the gpu's."""
    why = "3 consecutive frames without a primary result within the deadline (38.2 ms); last: primary busy"
    usb2 = [(24.0, 7.0, 11.0), (26.0, 7.5, 12.0), (25.0, 7.1, 11.5)]  # copy-in, compute, copy-out (ms)
    assert miss_run_blame(why, 0, 480, usb2) == (Layer.USB, why + (
        "; on a 480 Mbps, USB 2 link, below SuperSpeed (5000 Mbps), the copies took 36.5 of the dock's 43.6 ms a "
        "frame (copy-in 25.0, compute 7.1, copy-out 11.5 ms; median of 3 result(s) since the last one in time)"))
    assert miss_run_blame(why, 0, 480, ()) == (Layer.USB, why + (
        "; on a 480 Mbps, USB 2 link, below SuperSpeed (5000 Mbps), with no result since the last one in time "
        "(copies ~10x slower, bulk writes may truncate)"))
    assert miss_run_blame(why, 0, 12, ())[1].endswith("; on a 12 Mbps, USB 1 link, below SuperSpeed (5000 Mbps), "
                                                      "with no result since the last one in time (copies ~10x "
                                                      "slower, bulk writes may truncate)")
    # a slow GPU on the same link: compute over half the dock's time
    assert miss_run_blame(why, 0, 480, [(10.0, 90.0, 5.0)]) == (Layer.GPU, why)
    assert miss_run_blame(why, 0, 480, [(10.0, 20.0, 10.0)]) == (Layer.GPU, why)  # exactly half: not over it
    # SuperSpeed, or a speed not known: the gpu's, whatever the copies
    assert miss_run_blame(why, 0, 5000, usb2) == (Layer.GPU, why)
    assert miss_run_blame(why, 0, None, usb2) == (Layer.GPU, why)
    # failed transfers come first: the transport was retrying
    assert miss_run_blame(why, 4, 480, usb2) == (Layer.USB, why + "; the link failed 4 transfer attempt(s) meanwhile")


def test_a_starts_wait_is_blamed_on_the_link_as_it_was_while_it_waited():
    """A stall while loading (or a start that timed out) is the usb layer's when the link was below SuperSpeed while
    the wait went on: the reading in force when it began and every one since, at its slowest -- not only the last
    one. A reload that stalled in a twin's usb2 fault (a bulk write truncated at 480 Mbps, the GPU waiting for the
    rest) was blamed on the gpu: the fault ended and the node's next look read 5000 Mbps before the stall was found."""
    s = 1_000 * MS
    began = 10 * s
    usb2_then_back = [(8 * s, 480), (9 * s, 480), (11 * s, 5000), (12 * s, 5000)]  # the repro's looks
    assert slow_link_while(usb2_then_back, began) == ("480 Mbps, USB 2 link while it waited (5000 Mbps at the last "
                                                      "reading)")
    assert slow_link_while([(9 * s, 5000), (11 * s, 480)], began) == "480 Mbps, USB 2 link"  # fell while it waited
    assert slow_link_while([(began, 480)], began) == "480 Mbps, USB 2 link"  # a reading at the start is in force
    assert slow_link_while([(11 * s, 12), (12 * s, 480)], began) == ("12 Mbps, USB 1 link while it waited (480 Mbps "
                                                                     "at the last reading)")
    # SuperSpeed while it waited: the gpu's (a GPU hang during the load), whatever the link was before
    assert slow_link_while([(8 * s, 5000), (11 * s, 5000)], began) is None
    assert slow_link_while([(7 * s, 480), (9 * s, 5000), (11 * s, 5000)], began) is None
    assert slow_link_while([], began) is None  # no reading: not known to be slow


def test_the_busy_wait_for_a_result_starts_just_before_the_fastest_recent_round_trip_and_is_bounded():
    eight = [0.0041, 0.0035, 0.0050, 0.0038, 0.0036, 0.0049, 0.0044, 0.0037]
    assert busy_wait_window(0.0005, eight[:7]) == (0.0, 0.0)  # fewer than 8 round trips: no busy wait
    sleep, spin = busy_wait_window(0.0005, eight)
    assert sleep == pytest.approx(0.0035 - 0.0003 - 0.0005) and spin == BUSY_WAIT_MAX_S == 0.001
    sleep, spin = busy_wait_window(0.0036, eight)  # past its start already: what is left of the window
    assert sleep == 0.0 and spin == pytest.approx(0.001 - 0.0004)
    assert busy_wait_window(0.010, eight) == (0.0, 0.0)  # past the whole window: sleep in poll at once


def test_the_warm_up_takes_its_lead_from_the_sleep_and_the_window_ends_where_it_did():
    from chestnut.node.policy import WARM_LEAD_S, warm_window

    assert WARM_LEAD_S == 0.0002
    sleep, spin = warm_window(0.0027, 0.001)
    assert sleep == pytest.approx(0.0025) and spin == pytest.approx(0.0012)
    sleep, spin = warm_window(0.0001, 0.001)  # less sleep than the lead: all of it
    assert sleep == 0.0 and spin == pytest.approx(0.0011)
    assert warm_window(0.0, 0.0006) == (0.0, 0.0006)  # past the window's start: nothing to take
    assert warm_window(0.0, 0.0) == (0.0, 0.0)  # no busy wait (fewer than 8 round trips, past it): no warm-up
    assert warm_window(0.003, 0.0) == (0.003, 0.0)


def test_the_pre_frame_wake_is_one_median_frame_period_after_the_last_receipt_less_the_lead():
    from chestnut.node.policy import PREWAKE_LEAD_S, PREWAKE_PERIODS, prewake_at

    assert PREWAKE_LEAD_S == 0.001 and PREWAKE_PERIODS == 5
    t = 7_000_000_000
    assert prewake_at(t, [50.0] * 4) == 0  # fewer than 5 periods known (a camera just started): no pre-frame wake
    assert prewake_at(t, [50.0] * 5) == t + 50_000_000 - 1_000_000
    # the median of the last five: one late frame (the 80 ms) and an older period (the 10 ms) move nothing
    assert prewake_at(t, [10.0, 49.0, 50.0, 80.0, 50.5, 49.5]) == t + 50_000_000 - 1_000_000
    assert prewake_at(t, [33.3] * 5, lead_s=0.002) == t + 33_300_000 - 2_000_000
    assert prewake_at(t, [2.0] * 5) == 0  # a period not over twice the lead: no idle time to wake in
    assert prewake_at(t, [2.5] * 5) == t + 2_500_000 - 1_000_000
    assert prewake_at(t, deque([50.0] * 20, maxlen=20)) == t + 49_000_000  # the node's own deque of periods


def test_a_frame_gets_its_own_wake_unless_one_went_out_within_three_leads():
    from chestnut.node.policy import needs_wake

    now = 5_000_000_000
    assert needs_wake(0, now) is True  # no WAKE sent yet
    assert needs_wake(now - 1_000_000, now) is False  # its pre-frame WAKE, a lead (1 ms) before: on time
    assert needs_wake(now - 2_999_999, now) is False  # sent a millisecond early (the poll's unit), frame a bit late
    assert needs_wake(now - 3_000_000, now) is True  # the frame came well after it was due: a WAKE of its own
    assert needs_wake(now - 5_000_000, now, lead_s=0.002) is False


def test_a_busy_wait_for_the_worker_needs_two_cpus_the_node_and_its_worker_can_share():
    from chestnut.node.realtime import cpus_apart

    assert cpus_apart((1,)) is False  # both pinned to one CPU: the node would hold its worker off
    assert cpus_apart((0, 1)) is True
    assert cpus_apart((1, 1)) is False
    assert cpus_apart(()) is (len(os.sched_getaffinity(0)) >= 2)  # any CPU: this process's own set
