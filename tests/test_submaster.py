"""SubMaster's alive / freq_ok / valid rules, checked with a fake clock and exact values (no sockets)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chestnut.msgs.messaging import new_message
from chestnut.msgs.services import UnknownServiceError
from chestnut.msgs.submaster import FrequencyTracker, SubMasterChecks

MS = 1_000_000  # ns
CAM = "cameraFrame"  # 20 Hz: alive timeout 500 ms, short window 20 intervals, long window 100
HEALTH = "chestnutHealth"  # 5 Hz
INIT = "initData"  # on demand


def event(service: str = CAM, valid: bool = True, frame_id: int = 0):
    msg = new_message(service, valid=valid)
    if service == CAM:
        msg.cameraFrame.frameId = frame_id
    return msg.as_reader()


def feed(sm: SubMasterChecks, times_ns: list[int], service: str = CAM, valid: bool = True) -> list[tuple]:
    """One message per update at each time; returns (alive, freq_ok, valid) after each."""
    out = []
    for t in times_ns:
        sm.update_msgs(t, [event(service, valid)])
        out.append((sm.alive[service], sm.freq_ok[service], sm.valid[service]))
    return out


def periodic(start_ns: int, period_ns: int, count: int) -> list[int]:
    return [start_ns + i * period_ns for i in range(count)]


def test_a_service_never_received_is_not_alive_not_freq_ok_not_valid():
    sm = SubMasterChecks([CAM, INIT])
    sm.update_msgs(10**12, [])
    assert (sm.alive[CAM], sm.freq_ok[CAM], sm.valid[CAM]) == (False, False, False)
    assert sm.seen[CAM] is False and sm.recv_time_ns[CAM] == 0 and sm.recv_frame[CAM] == 0
    assert sm[CAM].frameId == 0 and sm[CAM].width == 0  # default-valued member before any message
    assert sm.all_checks() is False


def test_on_demand_service_is_always_alive_and_freq_ok_but_valid_only_from_a_message():
    sm = SubMasterChecks([INIT])
    sm.update_msgs(0, [])
    assert (sm.alive[INIT], sm.freq_ok[INIT], sm.valid[INIT]) == (True, True, False)
    sm.update_msgs(1, [event(INIT)])
    assert sm.all_checks() is True
    sm.update_msgs(10**15, [])  # hours later: still alive (no rate to keep)
    assert (sm.alive[INIT], sm.freq_ok[INIT], sm.valid[INIT]) == (True, True, True)


def test_alive_means_newest_message_younger_than_ten_periods():
    sm = SubMasterChecks([CAM, HEALTH])
    sm.update_msgs(1000 * MS, [event(CAM), event(HEALTH)])
    sm.update_msgs(1000 * MS + 500 * MS - 1, [])
    assert sm.alive == {CAM: True, HEALTH: True}
    sm.update_msgs(1000 * MS + 500 * MS, [])  # 10 / 20 Hz = 0.5 s: no longer alive
    assert sm.alive == {CAM: False, HEALTH: True}
    sm.update_msgs(1000 * MS + 2000 * MS - 1, [])  # 10 / 5 Hz = 2 s
    assert sm.alive[HEALTH] is True
    sm.update_msgs(1000 * MS + 2000 * MS, [])
    assert sm.alive[HEALTH] is False


def test_freq_ok_needs_a_full_short_window():
    sm = SubMasterChecks([CAM])
    states = feed(sm, periodic(0, 50 * MS, 22))
    assert [s[1] for s in states] == [False] * 20 + [True, True]  # 21 receipts = 20 intervals = 1 s
    assert all(s[0] and s[2] for s in states)


@pytest.mark.parametrize(
    "period_ns, ok",
    [
        (62_500_000, True),  # exactly 16 Hz = 0.8 * 20: inclusive
        (62_500_001, False),
        (41_666_667, True),  # 23.99999981 Hz
        (41_666_666, False),  # 24.0000004 Hz > 1.2 * 20
        (50 * MS, True),
    ],
)
def test_freq_ok_bounds_are_0_8_and_1_2_times_the_nominal_rate_inclusive(period_ns, ok):
    sm = SubMasterChecks([CAM])
    assert feed(sm, periodic(0, period_ns, 101))[-1] == (True, ok, True)


def test_a_slow_down_fails_freq_ok_within_the_short_window_and_recovery_needs_the_long_window():
    sm = SubMasterChecks([CAM])
    t = periodic(0, 50 * MS, 101)  # 5 s at 20 Hz: both windows full
    assert feed(sm, t)[-1] == (True, True, True)
    # 10 Hz: with m slow intervals in the 20-interval short window, rate = 20 / (1 + 0.05 m) s
    slow = periodic(t[-1] + 100 * MS, 100 * MS, 10)
    freq_ok = [s[1] for s in feed(sm, slow)]
    assert freq_ok == [True] * 5 + [False] * 5  # m = 5 gives exactly 16 Hz; m = 6 is below
    assert sm.alive[CAM] is True  # 100 ms gaps are well inside the 500 ms alive window
    # back to 20 Hz: the short window has m <= 5 slow intervals again after 15 fast ones; the long
    # window (100 intervals, 10 slow: 100 / 5.5 s = 18.2 Hz) never failed
    fast = periodic(slow[-1] + 50 * MS, 50 * MS, 30)
    freq_ok = [s[1] for s in feed(sm, fast)]
    assert freq_ok == [False] * 14 + [True] * 16


def test_a_long_window_slow_down_holds_freq_ok_false_after_the_short_window_recovers():
    sm = SubMasterChecks([CAM])
    t = periodic(0, 50 * MS, 101)
    feed(sm, t)
    # 5 Hz for 10 intervals: long window = 90 fast + 10 slow = 4.5 + 2.0 s -> 15.4 Hz
    slow = periodic(t[-1] + 200 * MS, 200 * MS, 10)
    assert feed(sm, slow)[-1] == (True, False, True)
    # at 20 Hz again the short window recovers after 20 fast intervals, but the long window
    # has k slow intervals: 100 / ((100 - k) * 0.05 + 0.2 k) >= 16  <=>  k <= 8: after 92 fast
    fast = periodic(slow[-1] + 50 * MS, 50 * MS, 95)
    states = feed(sm, fast)
    assert sm.freq_tracker[CAM].rates_hz()[0] == pytest.approx(20.0)
    first_ok = [s[1] for s in states].index(True)
    assert first_ok + 1 == 92 and all(s[1] for s in states[first_ok:])


def test_valid_follows_the_newest_message():
    sm = SubMasterChecks([CAM])
    times = periodic(0, 50 * MS, 21)
    feed(sm, times)
    assert sm.all_checks() is True
    sm.update_msgs(times[-1] + 50 * MS, [event(valid=False)])
    assert (sm.alive[CAM], sm.freq_ok[CAM], sm.valid[CAM]) == (True, True, False)
    assert sm.all_checks() is False
    sm.update_msgs(times[-1] + 100 * MS, [event(valid=False), event(valid=True, frame_id=7)])
    assert sm.valid[CAM] is True and sm[CAM].frameId == 7 and sm.recv_count[CAM] == 24
    sm.update_msgs(times[-1] + 150 * MS, [event(valid=True), event(valid=False)])
    assert sm.valid[CAM] is False


def test_a_stopped_publisher_is_not_alive_nor_freq_ok_and_the_gap_fails_freq_ok_after_restart():
    sm = SubMasterChecks([CAM])
    t = periodic(0, 50 * MS, 101)
    feed(sm, t)
    sm.update_msgs(t[-1] + 499 * MS, [])
    assert (sm.alive[CAM], sm.freq_ok[CAM]) == (True, True)
    sm.update_msgs(t[-1] + 500 * MS, [])
    assert (sm.alive[CAM], sm.freq_ok[CAM], sm.valid[CAM]) == (False, False, True)
    assert sm.updated[CAM] is False
    # restart 2 s later at 20 Hz: alive at once; the 2 s interval keeps the long window at
    # 100 / (99 * 0.05 + 2) = 14.4 Hz < 16 Hz until 100 fast intervals have pushed it out
    restart = periodic(t[-1] + 2000 * MS, 50 * MS, 120)
    states = feed(sm, restart)
    assert all(s[0] for s in states)
    first_ok = [s[1] for s in states].index(True)
    assert first_ok == 100  # the 2 s interval is out of the long window after 100 fast ones
    assert all(s[1] for s in states[first_ok:])


def test_messages_drained_together_share_a_receive_time_and_the_window_averages_it_out():
    sm = SubMasterChecks([CAM])
    for i in range(60):  # a 10 Hz update loop draining two 20 Hz messages each time
        sm.update_msgs(i * 100 * MS, [event(), event()])
    assert sm.freq_tracker[CAM].rates_hz() == (20.0, 20.0)  # 20 intervals / 1 s, 100 / 5 s
    assert sm.freq_ok[CAM] is True and sm.recv_count[CAM] == 120


def test_ignore_lists_leave_the_per_service_checks_but_skip_them_in_the_aggregates():
    sm = SubMasterChecks([CAM, HEALTH], ignore_alive=[HEALTH], ignore_avg_freq=[HEALTH], ignore_valid=[CAM])
    feed(sm, periodic(0, 50 * MS, 21), CAM, valid=False)
    assert (sm.alive[HEALTH], sm.freq_ok[HEALTH], sm.valid[HEALTH]) == (False, False, False)
    assert (sm.all_alive(), sm.all_freq_ok(), sm.all_valid()) == (True, True, False)
    sm.update_msgs(21 * 50 * MS, [event(CAM, valid=False), event(HEALTH)])
    assert sm.all_checks() is True
    assert sm.all_checks([HEALTH]) is True and sm.all_alive([CAM]) is True


def test_unknown_services_are_clear_errors():
    with pytest.raises(UnknownServiceError, match="unknown service 'modelV2'"):
        SubMasterChecks([CAM, "modelV2"])
    with pytest.raises(UnknownServiceError, match="unknown service 'carState'"):
        SubMasterChecks([CAM], ignore_alive=["carState"])
    sm = SubMasterChecks([CAM])
    with pytest.raises(ValueError, match="'nodeState' given to a SubMaster of \\['cameraFrame'\\]"):
        sm.update_msgs(0, [event("nodeState")])
    with pytest.raises(ValueError, match="'nodeState' is not among the subscribed services"):
        sm.all_checks(["nodeState"])
    with pytest.raises(UnknownServiceError):
        sm.all_valid(["modelV2"])


def test_a_rate_given_per_service_replaces_the_registrys():
    """``chestnut launch --rate 10``: cameraFrame at 10 Hz is alive for 1 s and freq_ok over 10 and 50 intervals,
    where the registry's 20 Hz would fail it (10 Hz is below 0.8 x 20); the services not named keep theirs."""
    sm = SubMasterChecks([CAM, HEALTH], frequency_hz={CAM: 10.0})
    assert sm.frequency_hz == {CAM: 10.0, HEALTH: 5.0}
    tr = sm.freq_tracker[CAM]
    assert (tr.short_intervals, tr.long_intervals, tr.min_hz, tr.max_hz) == (10, 50, 8.0, 12.0)
    assert feed(sm, periodic(0, 100 * MS, 51))[-1] == (True, True, True)
    assert feed(SubMasterChecks([CAM]), periodic(0, 100 * MS, 51))[-1] == (True, False, True)
    sm.update_msgs(5000 * MS + 1000 * MS - 1, [])  # 10 / 10 Hz = 1 s
    assert sm.alive[CAM] is True
    sm.update_msgs(5000 * MS + 1000 * MS, [])
    assert sm.alive[CAM] is False


@pytest.mark.parametrize("rates, match", [
    ({"nodeState": 1.0}, "a rate for 'nodeState', which is not among the subscribed services"),
    ({CAM: 0.0}, "cameraFrame: a nominal rate must be a finite number > 0"),
    ({CAM: float("nan")}, "cameraFrame: a nominal rate must be a finite number > 0"),
    ({CAM: float("inf")}, "cameraFrame: a nominal rate must be a finite number > 0"),
    ({INIT: 5.0}, "initData: a nominal rate must be a finite number > 0 for a service that has one "
                  "\\(registry: 0 Hz\\)"),
])
def test_a_rate_it_cannot_take_is_a_clear_error(rates, match):
    with pytest.raises(ValueError, match=match):
        SubMasterChecks([CAM, INIT], frequency_hz=rates)
    with pytest.raises(UnknownServiceError, match="unknown service 'modelV2'"):
        SubMasterChecks([CAM], frequency_hz={"modelV2": 20.0})


def test_frequency_tracker_rates_and_window_sizes():
    tr = FrequencyTracker(20.0)
    assert (tr.short_intervals, tr.long_intervals, tr.min_hz, tr.max_hz) == (20, 100, 16.0, 24.0)
    assert tr.rates_hz() == (None, None)
    tr.record(0)
    tr.record(0)
    assert tr.rates_hz() == (float("inf"), float("inf"))
    one_hz = FrequencyTracker(1.0)
    assert (one_hz.short_intervals, one_hz.long_intervals) == (2, 5)
    with pytest.raises(ValueError, match="frequency_hz must be > 0"):
        FrequencyTracker(0.0)


@settings(max_examples=200, deadline=None)
@given(period_ns=st.integers(min_value=30 * MS, max_value=80 * MS), count=st.integers(min_value=1, max_value=130))
def test_constant_rate_is_freq_ok_exactly_when_within_bounds_and_the_short_window_is_full(period_ns, count):
    sm = SubMasterChecks([CAM])
    alive, freq_ok, valid = feed(sm, periodic(0, period_ns, count))[-1]
    within = 16 * period_ns <= 10**9 <= 24 * period_ns  # 16 Hz <= 1 / period <= 24 Hz
    assert (alive, valid) == (True, True)
    assert freq_ok == (within and count >= 21)


@settings(max_examples=200, deadline=None)
@given(gaps_ms=st.lists(st.integers(min_value=0, max_value=700), min_size=1, max_size=60), check_ms=st.integers(0, 700))
def test_alive_is_exactly_the_age_of_the_newest_receipt(gaps_ms, check_ms):
    sm = SubMasterChecks([CAM])
    t = 0
    for gap in gaps_ms:
        t += gap * MS
        sm.update_msgs(t, [event()])
    sm.update_msgs(t + check_ms * MS, [])
    assert sm.alive[CAM] is (check_ms < 500)
    assert sm.freq_ok[CAM] is (check_ms < 500 and sm.freq_tracker[CAM].ok())


def test_a_catch_up_burst_after_a_half_second_pause_stays_freq_ok():
    """A host stall held a 20 Hz service back 0.5 s and the 10 queued messages came in one burst: the short
    window that starts after the gap saw 36.4 Hz (above 1.2 x 20 Hz) while the long window still held the gap
    (20 Hz), so freq_ok failed and the control daemon soft-disabled. Too fast needs both windows now."""
    sm = SubMasterChecks([CAM])
    t = periodic(0, 50 * MS, 101)  # 5 s at 20 Hz: both windows full
    states = feed(sm, t)
    for k in range(1, 50):  # the pause, seen by a 10 ms update loop: nothing arrives for 0.5 s
        sm.update_msgs(t[-1] + k * 10 * MS, [])
        states.append((sm.alive[CAM], sm.freq_ok[CAM], sm.valid[CAM]))
    burst_at = t[-1] + 500 * MS
    sm.update_msgs(burst_at, [event() for _ in range(10)])  # published at +50 .. +500 ms, drained together
    states.append((sm.alive[CAM], sm.freq_ok[CAM], sm.valid[CAM]))
    short_rates, long_rates = [], []
    for now in periodic(burst_at + 50 * MS, 50 * MS, 120):  # 20 Hz again, for 6 s: the gap leaves both windows
        states.append(feed(sm, [now])[0])
        short_hz, long_hz = sm.freq_tracker[CAM].rates_hz()
        short_rates.append(short_hz)
        long_rates.append(long_hz)
    assert states[20:] == [(True, True, True)] * (len(states) - 20)
    # the burst is visible: 20 intervals over 0.55 s once the gap has left the short window (the 11th receipt
    # after the burst), while the long window still spans the gap at 100 intervals / 5 s
    assert max(short_rates) == short_rates[10] == 20 * 10**9 / (550 * MS)
    assert long_rates[10] == 20.0
    # once the gap left the long window the burst is 100 intervals over 4.55 s (22.0 Hz), the short window 20 Hz
    assert max(long_rates) == 100 * 10**9 / (4550 * MS) and short_rates[-1] == 20.0


def test_a_steady_30_hz_publisher_of_a_20_hz_service_is_too_fast():
    sm = SubMasterChecks([CAM])
    states = feed(sm, periodic(0, 33_333_334, 101))
    assert states[-1] == (True, False, True)
    assert [s[1] for s in states] == [False] * 101  # from the first full short window on
    tr = sm.freq_tracker[CAM]
    assert (tr.too_fast(), tr.too_slow()) == (True, False)


def test_a_switch_from_20_to_30_hz_fails_once_the_long_window_is_above_24_hz_and_recovers_at_once():
    sm = SubMasterChecks([CAM])
    t = periodic(0, 50 * MS, 101)
    feed(sm, t)
    # m intervals at 30 Hz in the long window: 100 / ((100 - m) * 0.05 + m / 30) s > 24 Hz  <=>  m > 50
    fast = periodic(t[-1] + 33_333_334, 33_333_334, 60)
    freq_ok = [s[1] for s in feed(sm, fast)]
    assert freq_ok == [True] * 50 + [False] * 10
    # back to 20 Hz: with m 20 Hz intervals the short window is 20 / (m * 0.05 + (20 - m) / 30) s, within
    # 24 Hz from m = 10 on (quick to recover: too fast needs both windows)
    slow = periodic(fast[-1] + 50 * MS, 50 * MS, 12)
    assert [s[1] for s in feed(sm, slow)] == [False] * 9 + [True] * 3


def test_a_steady_12_hz_publisher_of_a_20_hz_service_is_too_slow():
    sm = SubMasterChecks([CAM])
    states = feed(sm, periodic(0, 83_333_333, 101))
    assert states[-1] == (True, False, True) and not any(s[1] for s in states)
    tr = sm.freq_tracker[CAM]
    assert (tr.too_fast(), tr.too_slow()) == (False, True)
