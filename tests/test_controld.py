"""The reference control daemon's decisions, with a fake clock (ns); its --rate refused up front."""

import logging

import pytest

from chestnut.launch.controld import ControlInputs, ControlLogic
from chestnut.msgs.messaging import new_message

S = 1_000_000_000
OK = ControlInputs(checks_ok=True, active=True, source="primary", frame_drop_perc=0.0)


def run_until(logic, t0, t1, x, dt=S // 20):
    st = None
    t = t0
    while t <= t1:
        st = logic.step(t, x)
        t += dt
    return st


def test_engages_only_after_a_second_of_passing_checks():
    c = ControlLogic()
    assert c.step(0, OK).engaged is False
    st = c.step(S - 1, OK)
    assert (st.engaged, st.can_engage, st.events) == (False, True, [])
    st = c.step(S, OK)
    assert (st.engaged, st.events, st.allow_source_switch) == (True, ["engaged"], False)


def test_never_engages_while_inactive_even_if_checks_pass():
    c = ControlLogic()
    x = ControlInputs(checks_ok=True, active=False, source="fallback", frame_drop_perc=0.0)
    st = run_until(c, 0, 5 * S, x)
    assert (st.engaged, st.can_engage, st.events) == (False, False, ["chestnutInactive"])


def test_source_change_soft_disables_then_exits_control_after_3_s():
    c = ControlLogic()
    run_until(c, 0, S, OK)
    x = ControlInputs(checks_ok=True, active=False, source="fallback", frame_drop_perc=0.0)
    st = c.step(2 * S, x)
    assert (st.engaged, st.soft_disabling, st.soft_disable_remaining_s) == (True, True, 3.0)
    assert st.events == ["chestnutInactive", "modelSourceChanged"]
    st = c.step(2 * S + 2 * S, x)
    assert (st.engaged, st.soft_disabling) == (True, True) and abs(st.soft_disable_remaining_s - 1.0) < 1e-9
    st = c.step(5 * S, x)
    assert (st.engaged, st.soft_disabling, st.events[-1], st.allow_source_switch) == (False, False, "disengaged", True)


def test_frame_drops_above_one_percent_soft_disable_and_clear():
    c = ControlLogic()
    run_until(c, 0, S, OK)
    lag = ControlInputs(checks_ok=True, active=True, source="primary", frame_drop_perc=1.5)
    st = c.step(2 * S, lag)
    assert (st.soft_disabling, st.events) == (True, ["modelLagging"])
    st = c.step(3 * S, OK)
    assert (st.engaged, st.soft_disabling, st.events) == (True, False, ["softDisableCleared"])


def test_exactly_one_percent_is_not_lagging():
    c = ControlLogic()
    x = ControlInputs(checks_ok=True, active=True, source="primary", frame_drop_perc=1.0)
    assert c.conditions(x) == []


def test_failed_checks_are_a_comm_issue_and_block_engagement():
    c = ControlLogic(auto_engage=False)
    c.request_engage()
    bad = ControlInputs(checks_ok=False, active=True, source="primary", frame_drop_perc=0.0)
    st = c.step(0, bad)
    assert (st.engaged, st.events) == (False, ["commIssue"])
    st = c.step(1, OK)  # the button press waits for a step that allows it
    assert (st.engaged, st.events) == (True, ["engaged"])


HOST = ControlInputs(checks_ok=True, active=False, source="fallback", frame_drop_perc=0.0,
                     active_reason="host late: the fallback answered frame 7 (loop woke 38 ms late)")


def test_a_host_late_frame_is_named_and_soft_disables_only_when_it_lasts():
    """The node answered a frame from the fallback because its host was late: ``hostLate``, not
    ``chestnutInactive`` / ``modelSourceChanged``, and no soft disable unless it lasts 0.5 s; the 3 s still
    count from its first step."""
    c = ControlLogic()
    run_until(c, 0, S, OK)
    st = c.step(2 * S, HOST)
    assert (st.engaged, st.soft_disabling, st.events, st.can_engage) == (True, False, ["hostLate"], False)
    st = c.step(2 * S + S // 20, OK)  # one frame: nothing to clear, nothing to tell the driver
    assert (st.engaged, st.soft_disabling, st.events) == (True, False, [])
    st = run_until(c, 3 * S, 3 * S + S // 2 - 1, HOST)
    assert (st.engaged, st.soft_disabling) == (True, False)
    st = c.step(3 * S + S // 2, HOST)  # 0.5 s: an overloaded host, said as such
    assert (st.engaged, st.soft_disabling, st.events) == (True, True, ["hostLate"])
    assert abs(st.soft_disable_remaining_s - 2.5) < 1e-9
    st = c.step(6 * S, HOST)
    assert (st.engaged, st.events[-1]) == (False, "disengaged")


def test_a_host_late_frame_beside_another_failure_soft_disables_at_once():
    c = ControlLogic()
    run_until(c, 0, S, OK)
    both = ControlInputs(checks_ok=False, active=False, source="fallback", frame_drop_perc=0.0,
                         failed_checks=("chestnutHealth.freq_ok",), active_reason=HOST.active_reason)
    st = c.step(2 * S, both)
    assert (st.soft_disabling, st.events) == (True, ["commIssue", "commIssue:chestnutHealth.freq_ok", "hostLate"])


MISSED = ControlInputs(checks_ok=True, active=False, source="fallback", frame_drop_perc=0.0,
                       active_reason="deadline miss: gpu WARN: frame 133: no primary result 41.8 ms after the request "
                                     "(deadline 41.5 ms)")
MISSED_AFTER = ControlInputs(checks_ok=True, active=False, source="primary", frame_drop_perc=0.0,
                             active_reason=MISSED.active_reason)
FAILED_OVER = ControlInputs(checks_ok=True, active=False, source="fallback", frame_drop_perc=0.0,
                            active_reason="gpu ERROR: 3 consecutive frames without a primary result within the "
                                          "deadline (41.5 ms)")


def test_one_missed_frame_the_fallback_answered_is_named_and_soft_disables_nothing():
    """A fault-free launch soft-disabled control for 0.13 s: one frame missed its 41.5 ms deadline by 0.3 ms,
    the fallback answered it, and the gpu WARN held ``active`` false two frames more. That is
    ``deadlineMissed``, not ``chestnutInactive`` / ``modelSourceChanged``, and no soft disable unless it lasts
    0.5 s (the node fails a primary that keeps missing over long before); the 3 s count from its first step."""
    c = ControlLogic()
    run_until(c, 0, S, OK)
    st = c.step(2 * S, MISSED)
    assert (st.engaged, st.soft_disabling, st.events, st.can_engage) == (True, False, ["deadlineMissed"], False)
    st = c.step(2 * S + S // 20, MISSED_AFTER)  # the primary answers again; the WARN still holds
    assert (st.engaged, st.soft_disabling, st.events) == (True, False, ["deadlineMissed"])
    st = c.step(2 * S + 3 * S // 20, OK)
    assert (st.engaged, st.soft_disabling, st.events) == (True, False, [])
    st = run_until(c, 3 * S, 3 * S + S // 2 - 1, MISSED)
    assert (st.engaged, st.soft_disabling) == (True, False)
    st = c.step(3 * S + S // 2, MISSED)  # 0.5 s of misses the node did not fail over: said to the driver
    assert (st.engaged, st.soft_disabling, st.events) == (True, True, ["deadlineMissed"])
    assert abs(st.soft_disable_remaining_s - 2.5) < 1e-9


def test_a_failover_after_missed_frames_soft_disables_at_once_counting_from_the_first_miss():
    c = ControlLogic()
    run_until(c, 0, S, OK)
    st = c.step(2 * S, MISSED)
    assert st.soft_disabling is False
    st = c.step(2 * S + S // 10, FAILED_OVER)  # the node's miss run failed the gpu over: the dock failed
    assert (st.soft_disabling, st.events) == (True, ["chestnutInactive", "modelSourceChanged"])
    assert abs(st.soft_disable_remaining_s - 2.9) < 1e-9
    st = c.step(2 * S + S // 5, MISSED)  # the mix still counts: the soft disable, once started, runs on
    assert (st.soft_disabling, st.events) == (True, ["deadlineMissed"])


def test_a_missed_frame_and_a_late_host_together_are_still_graced():
    c = ControlLogic()
    run_until(c, 0, S, OK)
    st = c.step(2 * S, MISSED)
    st = c.step(2 * S + S // 20, HOST)
    assert (st.soft_disabling, st.events) == (False, ["hostLate"])


@pytest.mark.parametrize("rate", ["0", "-20", "nan", "inf", "1001", "fast", "1e-300", "0.99"])
def test_a_control_rate_that_cannot_be_kept_is_refused_in_one_line(rate, capsys):
    """``chestnut control --rate 0`` was a ZeroDivisionError traceback, ``--rate 1e-300`` an OverflowError in
    zmq_poll."""
    from chestnut.launch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["control", "--rate", rate])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"chestnut control: error: argument --rate: {rate!r}: give a controlState rate in [1, 1000] Hz "
        "(default 20, the service's rate) (chestnut control --help)\n"
    )


def test_control_rates_in_range_are_taken():
    from chestnut.launch.controld import MAX_RATE_HZ, MIN_RATE_HZ, control_rate

    assert (MIN_RATE_HZ, MAX_RATE_HZ) == (1.0, 1000.0)
    assert [control_rate(t) for t in ("1", "20", "1000")] == [1.0, 20.0, 1000.0]


def test_what_is_published_and_what_is_logged_say_the_same_time_left(caplog):
    """controlState said 2.50 s (left) while control.log said 'control exited after 3.0 s of soft disable': a
    user could not reconcile them. Both now give the time left of the 3 s, counted from the first failing step."""
    from chestnut.msgs.services import soft_disable_left

    c = ControlLogic()
    run_until(c, 0, S, OK)
    caplog.set_level("INFO", logger="chestnut.control")
    caplog.clear()
    run_until(c, 2 * S, 2 * S + S // 2 - 1, HOST)  # graced: no soft disable yet
    st = c.step(2 * S + S // 2, HOST)
    assert (st.soft_disabling, st.soft_disable_remaining_s) == (True, 2.5)
    assert soft_disable_left(st.soft_disable_remaining_s) == "2.50 s left of 3.0 s"
    st = c.step(5 * S, HOST)
    assert (st.engaged, st.soft_disable_remaining_s) == (False, 0.0)
    assert [r.getMessage() for r in caplog.records] == [
        "soft disable: 2.50 s left of 3.0 s (counted from the first failing step, 0.50 s ago): hostLate",
        "soft disable: 0.00 s left of 3.0 s: disengaged, 3.00 s after the first failing step",
    ]
    caplog.clear()
    run_until(c, 6 * S, 7 * S, OK)  # engaged again
    lag = ControlInputs(checks_ok=True, active=True, source="primary", frame_drop_perc=1.5)
    st = c.step(8 * S, lag)
    assert st.soft_disable_remaining_s == 3.0
    st = c.step(9 * S, lag)
    assert st.soft_disable_remaining_s == 2.0
    st = c.step(9 * S + S // 4, OK)
    assert st.events == ["softDisableCleared"]
    assert [r.getMessage() for r in caplog.records if "soft disable" in r.getMessage()] == [
        "soft disable: 3.00 s left of 3.0 s: modelLagging",
        "soft disable cleared: 1.75 s left of 3.0 s",
    ]


def test_a_starting_stack_is_waited_for_at_info_and_a_failure_after_the_first_pass_is_a_warning():
    """Every start logged five or six WARNING ``checks failed: modelOutput.alive (never received) ...`` lines before
    the node's first output: services not heard yet while the stack starts are no failure."""
    from chestnut.launch.controld import checks_line

    def describe(c: str) -> str:
        return f"{c} (never received)"

    assert checks_line(("modelOutput.alive",), (), False, describe) == (
        logging.INFO, "waiting for the stack, checks not passing yet: modelOutput.alive (never received)")
    assert checks_line(("modelOutput.alive",), ("modelOutput.alive",), False, describe) is None  # no change
    assert checks_line((), ("modelOutput.alive",), False, describe) == (logging.INFO, "checks pass")
    assert checks_line((), (), True, describe) is None
    assert checks_line(("chestnutActive.freq_ok",), (), True, describe) == (
        logging.WARNING, "checks failed: chestnutActive.freq_ok (never received)")
    assert checks_line((), ("chestnutActive.freq_ok",), True, describe) == (logging.INFO, "checks pass again")
    # a stack that never comes up: one WARNING as the grace ends, every change after it a WARNING
    assert checks_line(("modelOutput.alive",), ("modelOutput.alive",), False, describe, 30.0, 29.95) == (
        logging.WARNING, "checks failed: the stack has not come up in 30 s: modelOutput.alive (never received)")
    assert checks_line(("modelOutput.alive",), ("modelOutput.alive",), False, describe, 30.05, 30.0) is None
    assert checks_line(("chestnutActive.alive",), ("modelOutput.alive",), False, describe, 31.0, 30.95) == (
        logging.WARNING, "checks failed: chestnutActive.alive (never received)")
    assert checks_line(("modelOutput.alive",), (), False, describe, 29.9, 29.85)[0] == logging.INFO


def _frame(pm, frame_id: int, parts: tuple[str, ...] = ("modelOutput", "chestnutActive")) -> None:
    """The node's messages of frame ``frame_id``, in the node's order: its ``modelOutput``, then its
    ``chestnutActive`` (``node/main.py``), each naming the frame."""
    for service in parts:
        msg = new_message(service)
        if service == "modelOutput":
            msg.modelOutput.frameId = frame_id
        else:
            msg.chestnutActive.reason = f"frame {frame_id}"
        pm.send(service, msg)


def test_a_step_judges_a_frames_messages_together_woken_by_its_chestnut_active():
    """Woken by any message, the daemon judged the checks between a frame's modelOutput and its chestnutActive: a
    stall's gap left modelOutput's window a message before chestnutActive's, and control.log said ``checks failed:
    chestnutActive.freq_ok ...`` and ``checks pass again`` in the same millisecond (and controlState went out at
    ~40 Hz). Real sockets; every wait is on a message."""
    from chestnut.launch.controld import SERVICES, STEP_ON, control_submaster
    from chestnut.msgs.messaging import PubMaster

    assert STEP_ON == "chestnutActive"
    with control_submaster() as sm, PubMaster(list(SERVICES)) as pm:
        frame = 0
        while sm["modelOutput"].frameId != frame or sm["chestnutActive"].reason != f"frame {frame}":
            frame += 1  # until both subscriptions have joined and every earlier frame is in (ZeroMQ keeps the order)
            assert frame < 2000, "the subscriptions never joined"
            _frame(pm, frame)
            sm.update(20)
        frame += 1
        _frame(pm, frame, ("modelOutput",))
        assert sm.sock["modelOutput"].poll(5000)  # the frame's modelOutput is in ...
        assert sm.poller.poll(0) == []  # ... and wakes no step on its own
        _frame(pm, frame, ("chestnutActive",))
        sm.update(5000)
        assert (sm.updated["modelOutput"], sm.updated["chestnutActive"]) == (True, True)
        assert (sm["modelOutput"].frameId, sm["chestnutActive"].reason) == (frame, f"frame {frame}")
