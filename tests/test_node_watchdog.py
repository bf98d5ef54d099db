"""The watchdog as pure logic with a fake clock: deadline, hang, alive and logical supervision."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chestnut.backend.errors import Layer
from chestnut.node.framedrop import FrameDropFilter
from chestnut.node.watchdog import (
    STATUS_TRANSITIONS,
    ActionKind,
    Entity,
    RequestKind,
    Result,
    Status,
    Verdict,
    Watchdog,
    WatchdogAction,
    WatchdogConfig,
)

MS = 1_000_000
NO_ALIVE = WatchdogConfig(alive_enabled=False)


def kinds(actions):
    return [a.kind for a in actions]


# ---------------------------------------------------------------- the status table


def test_status_table_covers_every_pair():
    assert set(STATUS_TRANSITIONS) == {(s, r) for s in Status for r in Result}


EXPECTED_STATUS = {
    (Status.OK, Result.PASS): Status.OK, (Status.OK, Result.RECOVERED): Status.OK,
    (Status.OK, Result.FAIL): Status.FAILED, (Status.OK, Result.FAIL_LIMIT): Status.EXPIRED,
    (Status.OK, Result.FATAL): Status.EXPIRED,
    (Status.FAILED, Result.PASS): Status.FAILED, (Status.FAILED, Result.RECOVERED): Status.OK,
    (Status.FAILED, Result.FAIL): Status.FAILED, (Status.FAILED, Result.FAIL_LIMIT): Status.EXPIRED,
    (Status.FAILED, Result.FATAL): Status.EXPIRED,
    **{(Status.EXPIRED, r): Status.EXPIRED for r in Result},
}


@pytest.mark.parametrize(("start", "result"), sorted(EXPECTED_STATUS, key=str))
def test_every_status_transition(start, result):
    e = Entity("x")
    e.status = start
    assert e.apply(result) == (start, EXPECTED_STATUS[(start, result)])
    assert STATUS_TRANSITIONS[(start, result)] is EXPECTED_STATUS[(start, result)]


# ---------------------------------------------------------------- deadline


def test_config_defaults_are_the_documented_contracts():
    c = WatchdogConfig()
    assert (c.frame_deadline_ms, c.wait_timeout_ms, c.hang_margin_ms, c.hang_timeout_ms, c.command_timeout_ms) == (
        150.0, 3000.0, 250.0, 3250.0, 60000.0)
    assert c.hang_timeout_ms <= 1.1 * c.wait_timeout_ms  # a hung worker is killed within the wait timeout + 10 %
    with pytest.raises(ValueError, match="frame_deadline_min_ms"):
        WatchdogConfig(frame_deadline_min_ms=200)


def test_a_result_at_the_deadline_is_used_one_ns_later_it_is_not():
    wd = Watchdog(NO_ALIVE)
    wd.request(1, 0)
    assert wd.response(1, 150 * MS) == Verdict(True, 150 * MS)
    wd.request(2, 1000 * MS)
    v = wd.response(2, 1150 * MS + 1)
    assert v == Verdict(False, 150 * MS + 1, (WatchdogAction(
        ActionKind.ANSWER_FROM_FALLBACK, "deadline", "frame 2: primary result after 150.0 ms (deadline 150.0 ms)",
        1150 * MS + 1, 2),))
    assert wd.misses == 1 and wd.deadline.status is Status.FAILED


def test_a_result_faster_than_the_minimum_is_not_used():
    wd = Watchdog(WatchdogConfig(alive_enabled=False, frame_deadline_min_ms=2))
    wd.request(1, 0)
    v = wd.response(1, 1 * MS)
    assert not v.use_result and v.actions[0].reason == "frame 1: primary result after 1.0 ms (minimum 2.0 ms)"


def test_check_answers_a_late_frame_from_the_fallback_once_and_the_late_result_is_discarded():
    wd = Watchdog(NO_ALIVE)
    wd.request(7, 10 * MS)
    assert wd.next_check_ns() == 160 * MS + 1
    assert wd.check(160 * MS) == []
    assert wd.check(160 * MS + 1) == [WatchdogAction(
        ActionKind.ANSWER_FROM_FALLBACK, "deadline",
        "frame 7: no primary result 150.0 ms after the request (deadline 150.0 ms)", 160 * MS + 1, 7)]
    assert wd.check(200 * MS) == []  # answered once
    assert wd.next_check_ns() == 3260 * MS + 1  # now only the hang deadline is pending
    v = wd.response(7, 300 * MS)
    assert v == Verdict(False, 290 * MS, (WatchdogAction(
        ActionKind.DISCARD_LATE, "deadline", "frame 7: primary result after 290.0 ms, already answered from the "
        "fallback", 300 * MS, 7),))
    assert wd.misses == 1 and wd.next_check_ns() is None


def test_a_hung_worker_is_killed_after_the_wait_timeout_plus_margin_once():
    wd = Watchdog(NO_ALIVE)
    wd.request(1, 0)
    wd.check(151 * MS)
    assert wd.check(3250 * MS) == []
    assert wd.check(3250 * MS + 1) == [WatchdogAction(
        ActionKind.KILL_WORKER, "hang",
        "worker hung: request 1 (frame) unanswered after 3250.0 ms (wait timeout + margin 3250.0 ms)",
        3250 * MS + 1, 1, Layer.GPU)]
    assert wd.statuses()["hang"] is Status.EXPIRED and wd.expired
    wd.request(2, 3300 * MS)
    assert kinds(wd.check(7000 * MS)) == [ActionKind.ANSWER_FROM_FALLBACK]  # no second kill
    assert wd.kills == 1
    assert wd.worker_stopped(7001 * MS) == []  # both frames were already answered


def test_hang_detection_time_with_a_periodic_check():
    wd = Watchdog(NO_ALIVE)
    wd.request(1, 0)
    t = 0
    while not any(a.kind is ActionKind.KILL_WORKER for a in wd.check(t)):
        t += 20 * MS  # the node checks at least every 20 ms
    assert 3250 * MS < t <= 3270 * MS


def test_commands_have_the_command_timeout_and_no_frame_deadline():
    wd = Watchdog(NO_ALIVE)
    wd.request(1, 0, RequestKind.COMMAND)
    assert wd.next_check_ns() == 60_000 * MS + 1
    assert wd.check(59_999 * MS) == []
    (kill,) = wd.check(60_000 * MS + 1)
    assert kill.reason == "worker hung: request 1 (command) unanswered after 60000.0 ms (command timeout 60000.0 ms)"
    assert wd.worker_stopped(60_001 * MS) == []  # a command has no frame to answer


def test_a_command_answered_in_time_is_used():
    wd = Watchdog(NO_ALIVE)
    wd.request(1, 0, RequestKind.COMMAND)
    assert wd.response(1, 30_000 * MS) == Verdict(True, 30_000 * MS)


def test_three_consecutive_misses_fail_the_gpu_layer_over():
    wd = Watchdog(NO_ALIVE)
    statuses = []
    for seq in range(3):
        wd.request(seq, seq * 1000 * MS)
        actions = wd.check(seq * 1000 * MS + 151 * MS)
        statuses.append(wd.deadline.status)
    assert statuses == [Status.FAILED, Status.FAILED, Status.EXPIRED]
    assert actions[-1] == WatchdogAction(ActionKind.FAIL_OVER, "deadline",
                                         "3 consecutive deadline misses (deadline 150.0 ms)", 2151 * MS, None,
                                         Layer.GPU)


def test_too_many_misses_in_the_window_fail_over_too():
    wd = Watchdog(NO_ALIVE)  # window 20 frames, more than 20 % missed fails over
    fail_over_at = None
    for seq in range(20):
        t = seq * 100 * MS
        wd.request(seq, t)
        late = seq % 2 == 0  # every other frame: never 3 in a row
        v = wd.response(seq, t + (160 if late else 10) * MS)
        if any(a.kind is ActionKind.FAIL_OVER for a in v.actions):
            fail_over_at = seq
            assert v.actions[-1].reason == "5 of the last 9 frames missed the deadline (deadline 150.0 ms)"
            break
    assert fail_over_at == 8


def test_the_deadline_entity_recovers_after_three_on_time_frames():
    wd = Watchdog(NO_ALIVE)
    wd.request(0, 0)
    wd.response(0, 200 * MS)
    assert wd.deadline.status is Status.FAILED
    for seq in (1, 2):
        wd.request(seq, seq * 1000 * MS)
        wd.response(seq, seq * 1000 * MS + 10 * MS)
        assert wd.deadline.status is Status.FAILED
    wd.request(3, 3000 * MS)
    wd.response(3, 3010 * MS)
    assert wd.deadline.status is Status.OK


# ---------------------------------------------------------------- worker lifecycle


def test_a_dead_worker_s_unanswered_frames_are_answered_from_the_fallback_at_once():
    wd = Watchdog(NO_ALIVE)
    wd.request(1, 0)
    wd.request(2, 50 * MS)
    wd.check(151 * MS)  # frame 1 answered by the deadline
    assert wd.worker_stopped(160 * MS) == [WatchdogAction(
        ActionKind.ANSWER_FROM_FALLBACK, "worker", "worker gone with frame 2 unanswered", 160 * MS, 2)]
    assert wd.outstanding == () and wd.next_check_ns() is None


def test_a_new_worker_starts_with_every_entity_ok():
    wd = Watchdog(NO_ALIVE)
    wd.request(1, 0)
    wd.check(4000 * MS)
    assert wd.expired
    assert wd.worker_started(4001 * MS) == []  # frame 1 was answered by its deadline
    assert set(wd.statuses().values()) == {Status.OK} and not wd.expired
    wd.request(2, 4100 * MS)  # sequence numbers keep increasing across workers
    assert wd.response(2, 4110 * MS).use_result


def test_results_from_a_worker_being_replaced_are_not_used():
    wd = Watchdog(NO_ALIVE)
    wd.request(1, 0)
    wd.request(2, 3200 * MS)
    wd.check(3250 * MS + 1)  # frame 1 hung: kill; frame 2 still within its deadline
    wd.response(1, 3260 * MS)
    v = wd.response(2, 3261 * MS)
    assert v == Verdict(False, 61 * MS, (WatchdogAction(
        ActionKind.ANSWER_FROM_FALLBACK, "worker", "frame 2: result from a worker being replaced (hang expired)",
        3261 * MS, 2),))


# ---------------------------------------------------------------- logical


def test_a_response_out_of_order_is_a_logical_fault_that_expires_at_once():
    wd = Watchdog(NO_ALIVE)
    wd.request(1, 0)
    wd.request(2, 1 * MS)
    v = wd.response(2, 5 * MS)
    assert v == Verdict(False, -1, (WatchdogAction(
        ActionKind.KILL_WORKER, "logical", "logical supervision: response seq 2 out of order (expected 1)", 5 * MS,
        None, Layer.OUTPUT),))
    assert wd.statuses()["logical"] is Status.EXPIRED
    assert wd.response(3, 6 * MS) == Verdict(False, -1)  # already expired: no second kill
    assert [a.seq for a in wd.worker_stopped(7 * MS)] == [1, 2]


def test_a_response_without_a_request_is_a_logical_fault():
    wd = Watchdog(NO_ALIVE)
    (kill,) = wd.response(9, 0).actions
    assert kill.reason == "logical supervision: response seq 9 with no request outstanding"


def test_a_request_out_of_sequence_is_a_logical_fault_and_its_frame_goes_to_the_fallback():
    wd = Watchdog(NO_ALIVE)
    wd.request(5, 0)
    wd.response(5, 1 * MS)
    assert wd.request(5, 2 * MS) == [
        WatchdogAction(ActionKind.KILL_WORKER, "logical",
                       "logical supervision: request seq 5 not after previous request seq 5", 2 * MS, None,
                       Layer.OUTPUT),
        WatchdogAction(ActionKind.ANSWER_FROM_FALLBACK, "logical", "frame 5: request out of sequence", 2 * MS, 5)]


# ---------------------------------------------------------------- alive


def beat(wd, start_ns, n, window_ns=1000 * MS):
    for i in range(n):
        wd.heartbeat(start_ns + i * window_ns // max(n, 1))


def test_alive_windows_within_margins_pass():
    wd = Watchdog()  # expect 20 -10/+20 beats per 1000 ms window: 10..40 pass
    wd.worker_started(0)
    assert wd.next_check_ns() == 1000 * MS
    beat(wd, 0, 10)
    beat(wd, 1000 * MS, 40)
    wd.heartbeat(2500 * MS, 25)  # a batch: the growth of the worker's shared beat counter
    assert wd.check(3000 * MS) == [] and wd.alive.status is Status.OK
    with pytest.raises(ValueError, match="heartbeat count must be >= 0"):
        wd.heartbeat(3001 * MS, -1)


def test_alive_fails_debounced_and_expires_after_the_tolerance():
    wd = Watchdog()  # 2 failed windows tolerated, the 3rd expires
    wd.worker_started(0)
    beat(wd, 0, 9)  # too few
    assert wd.check(1000 * MS) == [] and wd.alive.status is Status.FAILED
    beat(wd, 1000 * MS, 41)  # too many (a beat at 2000 ms would belong to the next window)
    assert wd.check(2000 * MS) == [] and wd.alive.status is Status.FAILED
    assert wd.check(3000 * MS - 1) == []
    assert wd.check(3000 * MS) == [WatchdogAction(
        ActionKind.KILL_WORKER, "alive", "heartbeat lost: 3 window(s) in a row outside 10..40 beats per 1000.0 ms "
        "(last: 0)", 3000 * MS, None, Layer.GPU)]
    assert wd.alive.status is Status.EXPIRED
    assert wd.check(10_000 * MS) == []  # expired once, killed once


def test_alive_recovers_with_hysteresis():
    wd = Watchdog()
    wd.worker_started(0)
    wd.check(1000 * MS)  # empty window: FAILED
    beat(wd, 1000 * MS, 20)
    wd.check(2000 * MS)
    assert wd.alive.status is Status.FAILED  # 1 good window of the 2 needed
    beat(wd, 2000 * MS, 20)
    wd.check(3000 * MS)
    assert wd.alive.status is Status.OK


def test_a_clock_jump_expires_alive_once_without_walking_every_window():
    wd = Watchdog()
    wd.worker_started(0)
    actions = wd.check(10**9 * 1000 * MS)  # ~31 years later
    assert kinds(actions) == [ActionKind.KILL_WORKER]
    assert wd.next_check_ns() == 10**9 * 1000 * MS + 1000 * MS  # windows realigned past now


def test_no_alive_supervision_without_a_worker():
    wd = Watchdog()
    assert wd.heartbeat(5 * MS) == [] and wd.check(10_000 * MS) == []
    wd.worker_started(0)
    wd.worker_stopped(1 * MS)
    assert wd.check(10_000 * MS) == [] and wd.next_check_ns() is None


# ---------------------------------------------------------------- properties


ops = st.lists(st.tuples(st.sampled_from(["request", "respond", "respond_wrong", "check", "stop", "start"]),
                         st.integers(0, 400)), max_size=60)


@settings(max_examples=300)
@given(ops)
def test_every_frame_gets_exactly_one_answer(script):
    """Whatever the worker does, each frame is answered once: by its primary result or by the fallback."""
    wd = Watchdog(NO_ALIVE)
    now, seq = 0, 0
    answers: dict[int, int] = {}
    outstanding: list[int] = []

    def record(actions):
        for a in actions:
            if a.kind is ActionKind.ANSWER_FROM_FALLBACK:
                answers[a.seq] = answers.get(a.seq, 0) + 1

    wd.worker_started(0)
    for op, dt_ms in script:
        now += dt_ms * MS
        if op == "request":
            seq += 1
            answers[seq] = 0
            outstanding.append(seq)
            record(wd.request(seq, now))
        elif op == "respond" and outstanding:
            s = outstanding.pop(0)
            v = wd.response(s, now)
            answers[s] += int(v.use_result)
            record(v.actions)
        elif op == "respond_wrong":
            record(wd.response(seq + 1000, now).actions)
        elif op == "check":
            record(wd.check(now))
        elif op == "stop":
            record(wd.worker_stopped(now))
            outstanding.clear()
        elif op == "start":
            record(wd.worker_started(now))
            outstanding.clear()
    record(wd.worker_stopped(now))
    assert all(n == 1 for n in answers.values()), answers


@settings(max_examples=300)
@given(ops)
def test_in_time_says_whether_a_response_is_used_and_such_a_response_has_no_action(script):
    """Watchdog.in_time (the node answers with a result first and records its response after the output) is
    response().use_result, for every state the worker can drive the watchdog into; a response it calls in time
    returns no action."""
    wd = Watchdog(WatchdogConfig(alive_enabled=False, frame_deadline_min_ms=2))
    now, seq = 0, 0
    outstanding: list[int] = []
    wd.worker_started(0)
    for op, dt_ms in script:
        now += dt_ms * MS
        if op == "request":
            seq += 1
            outstanding.append(seq)
            wd.request(seq, now)
        elif op in ("respond", "respond_wrong") and (outstanding or op == "respond_wrong"):
            s = outstanding.pop(0) if op == "respond" else seq + 1000
            said = wd.in_time(s, now)
            assert wd.in_time(s, now) is said  # it records nothing
            v = wd.response(s, now)
            assert said is v.use_result and (v.actions == () or not said), (op, s, v)
        elif op == "check":
            wd.check(now)
        elif op in ("stop", "start"):
            (wd.worker_stopped if op == "stop" else wd.worker_started)(now)
            outstanding.clear()


def test_in_time_at_the_bounds():
    wd = Watchdog(WatchdogConfig(alive_enabled=False, frame_deadline_min_ms=2))
    wd.request(1, 0)
    assert [wd.in_time(1, t) for t in (2 * MS - 1, 2 * MS, 150 * MS, 150 * MS + 1)] == [False, True, True, False]
    assert not wd.in_time(2, 10 * MS)  # no such request
    wd.request(2, 1 * MS)
    assert not wd.in_time(2, 10 * MS)  # not the oldest outstanding
    assert wd.response(1, 10 * MS).use_result and wd.in_time(2, 10 * MS)


# ---------------------------------------------------------------- frame drops (openpilot modeld's measure)

ALPHA = 0.05 / (10.0 + 0.05)  # FirstOrderFilter(0., 10., 1/20): alpha = dt / (rc + dt)


def warm(f: FrameDropFilter, first_id: int = 0) -> int:
    """Feed the 10 warm-up frames (consecutive ids from first_id); returns the last id."""
    for i in range(10):
        assert f.update(first_id + i) == 0.0
    return first_id + 9


def test_frame_drop_warm_up_hides_the_start_up_gap():
    f = FrameDropFilter()
    assert f.alpha == ALPHA
    assert f.update(5000) == 0.0 and f.last_dropped == 4999  # the first id minus 0, not counted
    for fid in range(5001, 5010):
        assert f.update(fid) == 0.0
    assert f.run_count == 10 and f.x == 0.0


def test_frame_drop_after_a_gap_of_three():
    f = FrameDropFilter()
    last = warm(f)
    # x = alpha * 3 = 3/201; ratio = x / (1 + x) = 3/204 = 1/68
    assert f.update(last + 4) == pytest.approx(100 / 68, rel=1e-12)
    assert f.last_dropped == 3
    perc = f.update(last + 5)  # no gap: decays by (1 - alpha)
    x = (1 - ALPHA) * 3 * ALPHA
    assert perc == pytest.approx(100 * x / (1 + x), rel=1e-12)


def test_frame_drop_repeats_and_resets_count_nothing():
    f = FrameDropFilter()
    last = warm(f, 100)
    assert f.update(last) == 0.0 and f.last_dropped == 0  # the same frame again
    assert f.update(3) == 0.0 and f.last_dropped == 0  # ids went backwards: a camera restart
    assert f.update(4) == 0.0
    assert f.update(2**32 + 7) > 0 and f.last_dropped == 2**32 + 2  # a huge jump ...
    assert f.x == pytest.approx(ALPHA * 10, rel=1e-12)  # ... counts as 10 (openpilot's clamp)


def test_frame_drop_converges_to_the_dropped_fraction():
    f = FrameDropFilter()
    fid = warm(f)
    for _ in range(2000):  # every other frame dropped: 1 drop per received frame
        fid += 2
        f.update(fid)
    x = 1 - (1 - ALPHA) ** 2000
    assert f.x == pytest.approx(x, rel=1e-9) and f.perc == pytest.approx(100 * x / (1 + x), rel=1e-9)
    assert f.perc == pytest.approx(50.0, abs=1e-2)


def test_frame_drop_reset_and_bad_input():
    f = FrameDropFilter()
    fid = warm(f)
    f.update(fid + 5)
    f.reset()
    assert (f.x, f.run_count, f.last_frame_id, f.perc) == (0.0, 0, 0, 0.0)
    assert f.update(77) == 0.0  # warm-up again
    with pytest.raises(ValueError, match="frame id must be >= 0"):
        f.update(-1)
    with pytest.raises(ValueError, match="dt_s and rc_s must be > 0"):
        FrameDropFilter(dt_s=0)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200))
def test_frame_drop_percentage_is_always_in_range(ids):
    f = FrameDropFilter()
    for fid in ids:
        assert 0.0 <= f.update(fid) < 100 * 10 / 11 + 1e-9  # at most 10 drops per frame: x <= 10


# ---------------------------------------------------------------- served: no frame waits past the wait timeout


HOST = "host late: the twin waited 150 ms for a CPU"


def late_primary(wd, until_ns, late_ms=160, on_time=()):
    """A 20 Hz camera whose primary answers every frame ``late_ms`` after its request (``on_time``: seqs
    answered after 120 ms, in order and on time), the host late throughout; the node checks every 10 ms.
    Returns the FAIL_OVERs."""
    fail_overs, answers, t, seq = [], {}, 0, 0
    while t <= until_ns and not fail_overs:
        if t == seq * 50 * MS:
            wd.request(seq, t, deadline_ms=150.0)
            answers[seq] = t + (120 if seq in on_time else late_ms) * MS
            seq += 1
        for s in [s for s, due in answers.items() if due == t]:
            fail_overs += [a for a in wd.response(s, t, HOST).actions if a.kind is ActionKind.FAIL_OVER]
            del answers[s]
        fail_overs += [a for a in wd.check(t, HOST) if a.kind is ActionKind.FAIL_OVER]
        t += 10 * MS
    return fail_overs


def test_a_primary_answering_every_frame_late_fails_over_after_the_wait_timeout_whatever_the_host():
    wd = Watchdog(NO_ALIVE)
    assert late_primary(wd, 3260 * MS) == [WatchdogAction(
        ActionKind.FAIL_OVER, "deadline",
        "no frame answered by the primary within its deadline for 3260.0 ms since frame 0 (wait timeout + margin "
        "3250.0 ms), 63 of its misses while the host was late", 3260 * MS, None, Layer.GPU)]
    assert wd.statuses()["deadline"] is Status.EXPIRED and wd.statuses()["hang"] is Status.OK
    assert (wd.kills, wd.host_misses) == (0, 63)
    assert [a for a in wd.check(9000 * MS, HOST) if a.kind is ActionKind.FAIL_OVER] == []  # once


def test_one_on_time_frame_restarts_the_wait_and_a_new_worker_starts_it_afresh():
    wd = Watchdog(NO_ALIVE)
    assert late_primary(wd, 4400 * MS, on_time={20}) == [WatchdogAction(  # frame 20 (1000 ms) on time
        ActionKind.FAIL_OVER, "deadline",
        "no frame answered by the primary within its deadline for 3260.0 ms since frame 21 (wait timeout + margin "
        "3250.0 ms), 63 of its misses while the host was late", 4310 * MS, None, Layer.GPU)]
    wd = Watchdog(NO_ALIVE)
    wd.request(0, 0)
    wd.worker_started(100 * MS)
    assert wd.check(3400 * MS) == []  # the frame of the replaced worker was abandoned


def test_a_camera_pause_after_a_late_frame_is_no_failover():
    wd = Watchdog(NO_ALIVE)
    wd.request(0, 0)
    wd.check(151 * MS, HOST)
    assert wd.response(0, 160 * MS).use_result is False
    assert wd.next_check_ns() is None  # the worker has nothing in hand
    wd.request(1, 5000 * MS)  # the camera paused 5 s: the wait starts with frame 1
    assert wd.check(5100 * MS) == [] and wd.next_check_ns() == 5150 * MS + 1
