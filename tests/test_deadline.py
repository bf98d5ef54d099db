"""The adaptive frame deadline (node/deadline.py) as a pure function, the watchdog judging each frame by the
deadline in force when it was requested, and check's deadline_or_fallback by the deadline a frame carries."""

from __future__ import annotations

import math
import re

import pytest

from chestnut.backend.errors import ConfigError
from chestnut.node.config import NodeConfig, validate
from chestnut.node.deadline import (
    DEADLINE_CEILING_MS,
    DEADLINE_FLOOR_MS,
    Deadline,
    DeadlineRule,
    adaptive_deadline,
    nearest_rank,
)
from chestnut.node.watchdog import NS_PER_MS, ActionKind, Watchdog

RULE = DeadlineRule()


def run(latencies: list[float], host_late: list[bool] | None = None) -> list[float]:
    """The deadline after each latency, as the node updates it frame by frame."""
    out: list[float] = []
    prev: Deadline | None = None
    window: list[float] = []
    for i, lat in enumerate(latencies):
        window.append(lat)
        prev = adaptive_deadline(window, RULE, previous=prev, host_late=bool(host_late and host_late[i]))
        out.append(prev.ms)
    return out


def test_defaults_are_the_documented_ones() -> None:
    assert (RULE.ceiling_ms, RULE.floor_ms, RULE.window, RULE.min_frames, RULE.quantile, RULE.margin,
            RULE.host_late_ms) == (150.0, 25.0, 100, 20, 0.99, 1.5, 20.0)
    assert (DEADLINE_CEILING_MS, DEADLINE_FLOOR_MS) == (150.0, 25.0)


def test_ceiling_until_enough_frames() -> None:
    d = adaptive_deadline([10.0] * 19, RULE)
    assert (d.ms, d.basis) == (150.0, "warming")
    d = adaptive_deadline([10.0] * 20, RULE)
    assert (d.ms, d.basis, d.quantile_ms) == (30.0, "host", 10.0)  # 10 + the 20 ms host allowance


def test_steady_latency_gives_a_steady_deadline() -> None:
    out = run([24.0] * 200)
    assert out[:19] == [150.0] * 19
    assert set(out[19:]) == {44.0}  # max(24 x 1.5 = 36, 24 + 20 = 44)


def test_margin_term_for_a_slow_primary() -> None:
    d = adaptive_deadline([60.0] * 100, RULE)
    assert (d.ms, d.basis) == (90.0, "margin")  # 60 x 1.5 = 90 > 60 + 20


def test_quantile_is_the_second_slowest_of_100() -> None:
    lats = [10.0] * 98 + [50.0, 70.0]
    assert nearest_rank(lats, 0.99) == 50.0
    assert adaptive_deadline(lats, RULE).ms == 75.0  # one outlier does not set it, the second does: 50 x 1.5
    with pytest.raises(ValueError, match="no values"):
        nearest_rank([], 0.99)


def test_rising_latency_raises_the_deadline_within_two_frames() -> None:
    out = run([20.0] * 100 + [60.0] * 5)
    assert out[99] == 40.0
    assert out[100] == 40.0      # one slow frame: still the second slowest's 20 ms
    assert out[101] == 90.0      # two: 60 x 1.5
    assert out[104] == 90.0


def test_falling_latency_lowers_it_once_the_slow_frames_leave_the_window() -> None:
    out = run([60.0] * 100 + [20.0] * 100)
    assert out[99] == 90.0
    assert out[197] == 90.0      # two 60 ms frames still among the last 100: the second slowest is 60
    assert out[198] == 40.0      # one left: an outlier, not the second slowest
    assert out[199] == 40.0


def test_floor_for_a_fast_primary() -> None:
    rule = DeadlineRule(host_late_ms=0.0)
    d = adaptive_deadline([2.0] * 50, rule)
    assert (d.ms, d.basis) == (25.0, "floor")
    assert adaptive_deadline([2.0] * 50, RULE).ms == 25.0  # 2 + 20 = 22 < the floor


def test_ceiling_for_a_primary_slower_than_it() -> None:
    d = adaptive_deadline([120.0] * 50, RULE)
    assert (d.ms, d.basis) == (150.0, "ceiling")
    assert adaptive_deadline([400.0] * 50, RULE).ms == 150.0


def test_host_late_frames_never_shrink_it() -> None:
    # 100 slow frames set 90 ms; then fast frames while the host is late: held, not falling
    lats = [60.0] * 100 + [20.0] * 100
    late = [False] * 100 + [True] * 100
    out = run(lats, late)
    assert out[-1] == 90.0
    held = Deadline(90.0, "margin", 60.0)
    assert adaptive_deadline(lats, RULE, previous=held, host_late=True).basis == "held"
    # ... and it falls at once once the host is on time again
    assert adaptive_deadline(lats, RULE, previous=held, host_late=False).ms == 40.0


def test_a_late_host_does_not_hold_the_warming_ceiling() -> None:
    warming = adaptive_deadline([20.0] * 19, RULE)
    assert warming.basis == "warming"
    d = adaptive_deadline([20.0] * 20, RULE, previous=warming, host_late=True)
    assert (d.ms, d.basis) == (40.0, "host")


def test_host_late_frames_raise_it_like_any_latency() -> None:
    out = run([20.0] * 100 + [70.0, 70.0], [False] * 100 + [True, True])
    assert out[-1] == 105.0  # a late host's latencies count: 70 x 1.5


def test_never_below_what_the_host_may_be_late_by() -> None:
    # the allowance is the lateness from which a miss is the host's (timing.host_late_ms): below it the host's
    # jitter is absorbed, above it host_late takes the miss as the host's
    d = adaptive_deadline([20.0] * 100, DeadlineRule(host_late_ms=22.0))
    assert (d.ms, d.basis) == (42.0, "host")
    # past the frame-period target the target holds (a miss whose dock stages fit is the host's: host_late)
    d = adaptive_deadline([20.0] * 100, DeadlineRule(host_late_ms=35.0))
    assert (d.ms, d.basis) == (45.0, "period")
    d = adaptive_deadline([20.0] * 100, DeadlineRule(host_late_ms=35.0, period_ms=100.0))
    assert (d.ms, d.basis) == (55.0, "host")


def test_frame_period_target_for_a_primary_that_fits_it() -> None:
    assert RULE.target_ms == 45.0  # 50 ms frame less 5 ms for the fallback's answer
    for q in (26.0, 30.0, 35.0, 39.0):  # the terms ask 46 .. 59 ms; q x 1.15 <= 45
        d = adaptive_deadline([q] * 100, RULE)
        assert (d.ms, d.basis, d.quantile_ms) == (45.0, "period", q)
    d = adaptive_deadline([39.2] * 100, RULE)  # 39.2 x 1.15 = 45.08: no room under the target, full margin
    assert (d.ms, d.basis) == (pytest.approx(59.2), "host")  # max(39.2 x 1.5, 39.2 + 20)
    assert adaptive_deadline([25.0] * 100, RULE).basis == "host"  # 25 + 20 = 45: the terms fit the target


def test_frame_period_target_as_the_latency_rises_and_falls() -> None:
    out = run([24.0] * 100 + [32.0] * 100 + [60.0] * 100 + [24.0] * 100)
    assert out[99] == 44.0       # 24 + 20
    assert out[101] == 45.0      # two 32 ms frames: 52 asked, held to the target
    assert out[201] == 90.0      # two 60 ms frames: 60 x 1.15 > 45, the full margin
    assert out[399] == 44.0


def test_a_ceiling_below_the_target_still_wins() -> None:
    d = adaptive_deadline([30.0] * 100, DeadlineRule(ceiling_ms=40.0))
    assert (d.ms, d.basis) == (40.0, "ceiling")


def test_fixed_when_not_adaptive() -> None:
    d = adaptive_deadline([10.0] * 100, DeadlineRule(adaptive=False))
    assert (d.ms, d.basis, math.isnan(d.quantile_ms)) == (150.0, "fixed", True)


@pytest.mark.parametrize("kwargs, match", [
    ({"floor_ms": 200.0}, "floor"),
    ({"floor_ms": 0.0}, "floor"),
    ({"min_frames": 200}, "min_frames"),
    ({"quantile": 0.0}, "quantile"),
    ({"margin": 0.5}, "margin"),
    ({"answer_ms": 50.0}, "answer"),
    ({"period_margin": 0.9}, "period margin"),
])
def test_rule_refuses_values_that_cannot_make_a_deadline(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DeadlineRule(**kwargs)  # type: ignore[arg-type]


def test_describe_names_the_term() -> None:
    assert adaptive_deadline([24.0] * 100, RULE).describe() == "deadline 44.0 ms (p99 24.0 ms + host allowance)"
    assert (adaptive_deadline([30.0] * 100, RULE).describe()
            == "deadline 45.0 ms (frame period less the fallback's answer; p99 30.0 ms)")


# ---------------------------------------------------------------- the watchdog judges each frame by its own deadline
def test_watchdog_misses_at_the_deadline_in_force() -> None:
    wd = Watchdog()
    wd.worker_started(0)
    wd.request(1, 0, deadline_ms=40.0)
    assert wd.next_check_ns() == 40 * NS_PER_MS + 1
    assert wd.check(39 * NS_PER_MS) == []
    actions = wd.check(41 * NS_PER_MS)
    assert [(a.kind, a.entity, a.seq) for a in actions] == [(ActionKind.ANSWER_FROM_FALLBACK, "deadline", 1)]
    assert actions[0].reason == "frame 1: no primary result 41.0 ms after the request (deadline 40.0 ms)"


def test_one_late_frame_is_a_miss_not_a_failover() -> None:
    wd = Watchdog()
    wd.worker_started(0)
    wd.request(1, 0, deadline_ms=40.0)
    v = wd.response(1, 45 * NS_PER_MS)
    assert not v.use_result
    assert [a.kind for a in v.actions] == [ActionKind.ANSWER_FROM_FALLBACK]
    wd.request(2, 50 * NS_PER_MS, deadline_ms=40.0)
    assert wd.response(2, 70 * NS_PER_MS).use_result
    assert wd.misses == 1 and wd.deadline.status.value == "failed"


def test_a_run_of_misses_against_the_adaptive_deadline_fails_over() -> None:
    wd = Watchdog()
    wd.worker_started(0)
    kinds = []
    for i in range(3):
        wd.request(i + 1, i * 50 * NS_PER_MS, deadline_ms=40.0)
        kinds += [a.kind for a in wd.response(i + 1, (i * 50 + 45) * NS_PER_MS).actions]
    assert kinds[-1] is ActionKind.FAIL_OVER
    assert kinds.count(ActionKind.FAIL_OVER) == 1


def test_a_frame_keeps_the_deadline_it_was_requested_with() -> None:
    wd = Watchdog()
    wd.worker_started(0)
    wd.request(1, 0, deadline_ms=100.0)
    wd.request(2, 10 * NS_PER_MS, deadline_ms=30.0)
    actions = wd.check(45 * NS_PER_MS)
    assert [a.seq for a in actions if a.kind is ActionKind.ANSWER_FROM_FALLBACK] == [2]


def test_watchdog_refuses_a_deadline_over_its_ceiling() -> None:
    wd = Watchdog()
    with pytest.raises(ValueError, match=r"frame deadline 200.0 ms outside \(0.0, 150.0\] ms"):
        wd.request(1, 0, deadline_ms=200.0)


# ---------------------------------------------------------------- check judges a frame by the deadline it carries
def test_contract_uses_the_published_deadline() -> None:
    from chestnut.node.offline.contracts import CheckParams, frame_deadline_ms
    from chestnut.node.offline.timeline import OutputRec

    def out(deadline_s: float) -> OutputRec:
        return OutputRec(0, 1, "primary", "m", 0.01, 0.04, 0.0, False, False, False, 0.0, "", deadline_s=deadline_s)

    p = CheckParams()
    assert frame_deadline_ms(out(0.04), p) == (40.0, "deadline in force")
    assert frame_deadline_ms(out(0.0), p) == (150.0, "deadline")     # an older log: the configured one
    assert frame_deadline_ms(out(0.5), p) == (150.0, "deadline in force")  # never above the configured one


# ---------------------------------------------------------------- one slow frame is one miss, not a run
def test_queued_behind_a_head_within_the_ceiling() -> None:
    from chestnut.node.watchdog import queued_behind

    assert queued_behind(5, 4, 101.0, 150.0) == "queued behind frame 4 (outstanding 101 ms, within the 150 ms ceiling)"
    assert queued_behind(5, 5, 101.0, 150.0) == ""   # its own request is the head: it counts
    assert queued_behind(5, None, None, 150.0) == ""  # nothing ahead of it
    assert queued_behind(5, 4, 151.0, 150.0) == ""   # the head is late by modeld's own deadline: it counts


def test_one_slow_frame_makes_the_frame_behind_it_miss_without_counting() -> None:
    wd = Watchdog()
    wd.worker_started(0)
    wd.request(1, 0, deadline_ms=40.0)
    wd.request(2, 50 * NS_PER_MS, deadline_ms=40.0)
    first = wd.check(41 * NS_PER_MS)   # frame 1 (the head) misses: counted
    second = wd.check(91 * NS_PER_MS)  # frame 2 misses behind frame 1, 91 ms old: answered, not counted
    assert [a.seq for a in first + second] == [1, 2]
    assert second[0].reason.endswith("queued behind frame 1 (outstanding 91 ms, within the 150 ms ceiling)")
    assert (wd.misses, wd.queued_misses) == (2, 1)
    assert wd.response(1, 110 * NS_PER_MS).elapsed_ns == 110 * NS_PER_MS
    wd.response(2, 130 * NS_PER_MS)
    wd.request(3, 150 * NS_PER_MS, deadline_ms=40.0)
    assert wd.response(3, 170 * NS_PER_MS).use_result
    assert wd.deadline.status.value != "expired"


def test_a_hung_head_makes_the_frames_behind_it_count_past_the_ceiling() -> None:
    wd = Watchdog()
    wd.worker_started(0)
    kinds: list[ActionKind] = []
    for i in range(4):
        wd.request(i + 1, i * 50 * NS_PER_MS, deadline_ms=40.0)
        kinds += [a.kind for a in wd.check((i * 50 + 41) * NS_PER_MS)]
    # frame 1 counts; 2 and 3 are behind a head within 150 ms; 4 (head 191 ms old) counts
    assert wd.queued_misses == 2
    assert ActionKind.FAIL_OVER not in kinds
    wd.request(5, 200 * NS_PER_MS, deadline_ms=40.0)
    kinds += [a.kind for a in wd.check(241 * NS_PER_MS)]
    wd.request(6, 250 * NS_PER_MS, deadline_ms=40.0)
    kinds += [a.kind for a in wd.check(291 * NS_PER_MS)]
    assert kinds.count(ActionKind.FAIL_OVER) == 1  # frames 1, 4 and 5: three counted misses in a row, once


def test_count_miss_leaves_a_queued_miss_uncounted() -> None:
    from chestnut.node.policy import count_miss

    v = count_miss(2, 3, True, 40.0, "primary busy", queued="queued behind frame 4 (...)")
    assert (v.run, v.fail_over) == (2, False)
    v = count_miss(2, 3, True, 40.0, "primary busy")
    assert (v.run, v.fail_over) == (3, True)


def test_the_head_that_could_start_only_after_a_slower_one_is_queued_on_its_own_time() -> None:
    from chestnut.node.watchdog import queued_behind

    # started 70 ms after its frame, 15 ms of its own: within its 40 ms deadline and the 150 ms ceiling
    assert queued_behind(5, 5, 85.0, 150.0, own_ms=15.0, deadline_ms=40.0) == (
        "queued: started 70 ms after its frame, behind a slower one; its own 15 ms within the 40 ms deadline, 85 ms "
        "within the 150 ms ceiling")
    assert queued_behind(5, 5, 85.0, 150.0, own_ms=45.0, deadline_ms=40.0) == ""   # its own time is over: counts
    assert queued_behind(5, 5, 155.0, 150.0, own_ms=15.0, deadline_ms=40.0) == ""  # past the ceiling: counts
    assert queued_behind(5, 5, 85.0, 150.0, own_ms=85.0, deadline_ms=90.0) == ""   # it never waited: counts


def test_one_slow_frame_does_not_make_the_frames_queued_behind_it_a_run_of_misses() -> None:
    """A primary back from a recovery at a 40 ms deadline, 20 Hz: frame 1 takes 120 ms, every frame after it
    its usual 15 ms. Frames 2 and 3 could start only at 120 and 135 ms: they miss their deadlines as heads, but
    on their own time they were on time -- one miss (frame 1), not three and a failover."""
    wd = Watchdog()
    wd.worker_started(0)
    acts: list = []
    for i in (1, 2, 3):
        acts += wd.request(i, (i - 1) * 50 * NS_PER_MS, deadline_ms=40.0)
    acts += wd.check(41 * NS_PER_MS)                  # frame 1 misses: counted
    acts += wd.check(91 * NS_PER_MS)                  # frame 2 behind frame 1 (91 ms old): not counted
    acts += wd.response(1, 120 * NS_PER_MS).actions   # late: already answered from the fallback
    acts += wd.response(2, 135 * NS_PER_MS).actions   # 135 ms after its frame, 15 ms of its own
    acts += wd.check(141 * NS_PER_MS)                 # frame 3 misses as the head: 6 ms of its own
    acts += wd.response(3, 150 * NS_PER_MS).actions
    acts += wd.request(4, 150 * NS_PER_MS, deadline_ms=40.0)
    assert wd.response(4, 165 * NS_PER_MS).use_result
    assert ActionKind.FAIL_OVER not in [a.kind for a in acts]
    assert (wd.misses, wd.queued_misses) == (3, 2)
    queued = [a.reason for a in acts if a.seq == 3 and a.kind is ActionKind.ANSWER_FROM_FALLBACK]
    assert queued == ["frame 3: no primary result 41.0 ms after the request (deadline 40.0 ms); queued: started 35 "
                      "ms after its frame, behind a slower one; its own 6 ms within the 40 ms deadline, 41 ms within "
                      "the 150 ms ceiling"]


def test_a_dock_slower_than_its_deadline_on_its_own_time_still_fails_over() -> None:
    """Every frame 60 ms of its own at a 40 ms deadline: each head misses on its own time too -- three in a row."""
    wd = Watchdog()
    wd.worker_started(0)
    acts: list = []
    t = 0
    for i in range(1, 5):
        acts += wd.request(i, (i - 1) * 50 * NS_PER_MS, deadline_ms=40.0)
    for i in range(1, 5):
        t = max(t, (i - 1) * 50) + 60
        acts += wd.check((t - 1) * NS_PER_MS)
        acts += wd.response(i, t * NS_PER_MS).actions
    assert [a.kind for a in acts].count(ActionKind.FAIL_OVER) == 1


@pytest.mark.parametrize("period", [5.0, 0.0, -50.0, math.inf, math.nan])
def test_config_refuses_a_frame_period_no_answer_fits(period: float) -> None:
    cfg = NodeConfig()
    assert cfg.timing.frame_period_ms == 50.0
    cfg.timing.frame_period_ms = period
    with pytest.raises(ConfigError, match=re.escape(f"timing.frame_period_ms = {period}; want a finite period over "
                                                    "the 5 ms the fallback's answer needs")):
        validate(cfg)
    cfg.timing.frame_period_ms = 100.0
    assert validate(cfg).timing.frame_period_ms == 100.0
