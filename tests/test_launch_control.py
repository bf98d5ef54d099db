"""The control daemon names the SubMaster check behind every ``commIssue`` (service and check: alive,
freq_ok, valid), and the launch summary lists every soft-disable episode with that cause. Fake clock (ns),
no sockets."""

from __future__ import annotations

from chestnut.launch.controld import ControlInputs, ControlLogic, describe_check, failed_checks
from chestnut.launch.summary import episode_cause
from chestnut.msgs.messaging import new_message
from chestnut.msgs.submaster import SubMasterChecks

MS = 1_000_000
S = 1000 * MS
SERVICES = ("modelOutput", "chestnutActive", "chestnutHealth")


def ev(service: str, valid: bool = True):
    return new_message(service, valid=valid).as_reader()


def healthy(seconds: float, health_gap_at_ms: int | None = None, gap_ms: int = 0) -> SubMasterChecks:
    """``seconds`` of a healthy stack at a 10 ms update tick: modelOutput and chestnutActive at 20 Hz,
    chestnutHealth at 5 Hz; the health message due at ``health_gap_at_ms`` comes ``gap_ms`` late."""
    sm = SubMasterChecks(SERVICES)
    for t_ms in range(0, int(seconds * 1000), 10):
        batch = []
        if t_ms % 50 == 0:
            batch += [ev("modelOutput"), ev("chestnutActive")]
        due = t_ms if health_gap_at_ms is None or t_ms < health_gap_at_ms else t_ms - gap_ms
        if due % 200 == 0 and (health_gap_at_ms is None or not health_gap_at_ms <= t_ms < health_gap_at_ms + gap_ms):
            batch.append(ev("chestnutHealth"))
        sm.update_msgs(t_ms * MS, batch)
    return sm


def test_a_healthy_stack_fails_no_check():
    sm = healthy(7.0)
    assert failed_checks(sm) == ()


def test_a_late_health_message_is_named_as_its_freq_check():
    # 5 Hz health: the short window is 5 intervals and must span at most 1.25 s; the message due at 6.0 s
    # arrives at 6.3 s: 5 intervals over 6.3 - 5.0 = 1.3 s (3.85 Hz), 25 over 6.3 - 1.0 = 5.3 s (4.72 Hz)
    sm = healthy(6.31, health_gap_at_ms=6000, gap_ms=300)
    assert failed_checks(sm) == ("chestnutHealth.freq_ok",)
    assert describe_check(sm, "chestnutHealth.freq_ok", 6300 * MS) == (
        "chestnutHealth.freq_ok (too slow: 3.85 Hz over 5, 4.72 Hz over 25 intervals; allowed 4..6 Hz)"
    )


def test_a_silent_service_is_named_as_not_alive_only():
    sm = healthy(6.0)
    sm.update_msgs(6000 * MS, [ev("chestnutHealth")])  # on time; modelOutput and chestnutActive go silent
    sm.update_msgs(6550 * MS, [])  # their newest came at 5.95 s: 600 ms ago, more than 10 periods (500 ms)
    assert failed_checks(sm) == ("modelOutput.alive", "chestnutActive.alive")
    assert describe_check(sm, "modelOutput.alive", 6550 * MS) == "modelOutput.alive (newest 600 ms ago)"


def test_an_invalid_message_is_named_as_its_valid_check():
    sm = healthy(6.0)
    sm.update_msgs(6000 * MS, [ev("modelOutput", valid=False)])
    assert failed_checks(sm) == ("modelOutput.valid",)


def test_a_service_never_received_reports_what_is_missing():
    sm = SubMasterChecks(SERVICES)
    sm.update_msgs(0, [ev("chestnutHealth")])
    assert failed_checks(sm) == ("modelOutput.alive", "chestnutActive.alive", "chestnutHealth.freq_ok")
    assert describe_check(sm, "modelOutput.alive", 0) == "modelOutput.alive (never received)"
    assert describe_check(sm, "chestnutHealth.freq_ok", 0) == "chestnutHealth.freq_ok (0 of 5 intervals received)"


def test_comm_issue_events_carry_the_failed_checks():
    c = ControlLogic()
    ok = ControlInputs(checks_ok=True, active=True, source="primary", frame_drop_perc=0.0)
    for t in range(0, S + 1, 50 * MS):
        c.step(t, ok)
    bad = ControlInputs(
        checks_ok=False, active=True, source="primary", frame_drop_perc=0.0, failed_checks=("chestnutHealth.freq_ok",)
    )
    st = c.step(2 * S, bad)
    assert (st.engaged, st.soft_disabling) == (True, True)
    assert st.events == ["commIssue", "commIssue:chestnutHealth.freq_ok"]


def test_episode_cause_names_each_condition_once_with_its_checks():
    seen = [
        "commIssue",
        "commIssue:chestnutHealth.freq_ok",
        "commIssue",
        "commIssue:modelOutput.alive",
        "chestnutInactive",
        "modelSourceChanged",
        "disengaged",
    ]
    assert episode_cause(seen) == (
        "commIssue (chestnutHealth.freq_ok, modelOutput.alive), chestnutInactive, modelSourceChanged"
    )
    assert episode_cause(["modelLagging", "softDisableCleared"]) == "modelLagging"


def control_log(tmp_path, steps: list[tuple[int, bool, bool, list[str]]]):
    """A log of ``controlState`` messages, one per ``(t_ms, engaged, softDisabling, events)``, at 20 Hz
    holding each step until the next one."""
    from drivelog import write_drive

    from chestnut.launch.controld import ControlState, fill_control_state

    base = 1000 * S
    items = []
    for (t_ms, engaged, soft, events), nxt in zip(steps, steps[1:] + [(steps[-1][0] + 50, 0, 0, [])], strict=True):
        for k, t in enumerate(range(t_ms, nxt[0], 50)):
            m = fill_control_state(
                ControlState(engaged=engaged, soft_disabling=soft, events=events if k == 0 or soft else [])
            )
            m.logMonoTime = base + t * MS
            items.append((base + t * MS, "controlState", m.to_bytes()))
    write_drive(items, tmp_path / "logs")
    return tmp_path / "logs", base


def test_the_summary_lists_every_soft_disable_episode_with_its_cause_and_duration(tmp_path):
    from chestnut.launch.summary import summarize

    log_dir, base = control_log(
        tmp_path,
        [
            (0, False, False, []),
            (1000, True, False, ["engaged"]),
            (2000, True, True, ["commIssue", "commIssue:chestnutHealth.freq_ok"]),
            (2200, True, False, ["softDisableCleared"]),
            (5000, True, True, ["chestnutInactive", "modelSourceChanged"]),
            (6000, True, True, ["chestnutInactive", "modelSourceChanged", "commIssue", "commIssue:modelOutput.alive"]),
            (8000, False, False, ["chestnutInactive", "disengaged"]),
            (9000, True, False, ["engaged"]),
            (9500, True, True, ["modelLagging"]),
        ],
    )
    s = summarize(log_dir, base)
    # one clock: s since the log's first message (its initData header, written 1 ms before the first step)
    assert s["t_zero_ns"] == base - MS
    assert s["soft_disable_episodes"] == [
        {"t_s": 2.001, "duration_s": 0.2, "cause": "commIssue (chestnutHealth.freq_ok)", "disengaged": False},
        {
            "t_s": 5.001,
            "duration_s": 3.0,
            "cause": "chestnutInactive, modelSourceChanged, commIssue (modelOutput.alive)",
            "disengaged": True,
        },
        {"t_s": 9.501, "duration_s": None, "cause": "modelLagging", "disengaged": False},  # open at the log's end
    ]
    assert s["soft_disables"] == {
        "commIssue (chestnutHealth.freq_ok)": 1,
        "chestnutInactive, modelSourceChanged, commIssue (modelOutput.alive)": 1,
        "modelLagging": 1,
    }


def test_the_summary_control_lines_are_in_time_order(tmp_path):
    from chestnut.launch.summary import control_lines, summarize

    log_dir, base = control_log(
        tmp_path,
        [
            (0, False, False, []),
            (1000, True, False, ["engaged"]),
            (2000, True, True, ["commIssue", "commIssue:chestnutHealth.freq_ok"]),
            (2200, True, False, ["softDisableCleared"]),
            (5000, True, True, ["chestnutInactive"]),
            (8000, False, False, ["chestnutInactive", "disengaged"]),
            (9000, True, False, ["engaged"]),
            (9500, True, True, ["modelLagging"]),
        ],
    )
    assert control_lines(summarize(log_dir, base)) == [
        "control    1.0 s  engaged",
        "control    2.0 s  soft disable for 0.20 s: commIssue (chestnutHealth.freq_ok)",
        "control    5.0 s  soft disable for 3.00 s, then disengaged: chestnutInactive",
        "control    8.0 s  disengaged: chestnutInactive",
        "control    9.0 s  engaged",
        "control    9.5 s  soft disable until the end: modelLagging",
    ]


def test_the_soft_disable_tally_is_one_line_per_cause_most_frequent_first():
    from chestnut.launch.summary import soft_disable_lines

    s = {"soft_disables": {"chestnutInactive, modelSourceChanged": 1, "chestnutInactive": 2, "": 1}}
    assert soft_disable_lines(s) == [
        "control soft-disable episodes: 4",
        "  2 x chestnutInactive",
        "  1 x cause not recorded",
        "  1 x chestnutInactive, modelSourceChanged",
    ]
    assert soft_disable_lines({"soft_disables": {}}) == []


def test_the_summary_has_the_frame_drop_percentage_and_the_wall_clock_start(tmp_path):
    import time

    from drivelog import write_drive

    from chestnut.launch.summary import summarize, summary_rows

    base = 10_000 * 10**9
    items = []
    for k, drop in enumerate((0.0, 5.0, 13.5, 12.25)):
        m = new_message("modelOutput")
        m.modelOutput.frameId = k
        m.modelOutput.frameDropPerc = drop
        m.logMonoTime = base + k * 50 * MS
        items.append((m.logMonoTime, "modelOutput", m.to_bytes()))
    write_drive(items, tmp_path / "logs")
    s = summarize(tmp_path / "logs", base)
    assert (s["frame_drop_perc"], s["frame_drop_perc_max"]) == (12.25, 13.5)
    assert dict(summary_rows(s))["frame drop at the end / max"] == "12.2 / 13.5 %  (modelOutput.frameDropPerc)"
    # the log's first message (its initData, 1 ms before the first item) in Unix time
    assert abs(s["wall_start_ns"] - time.time_ns()) < 60 * 10**9 and s["wall_start"].endswith(" UTC")


def test_the_summary_has_the_deadline_in_force_and_its_range(tmp_path):
    from drivelog import write_drive

    from chestnut.launch.summary import summarize, summary_rows

    base = 10_000 * 10**9
    items = []
    for k, deadline_s in enumerate((0.0, 0.150, 0.044, 0.0395, 0.041)):  # 0: a frame the primary was not asked
        m = new_message("modelOutput")
        m.modelOutput.frameId = k
        m.modelOutput.deadline = deadline_s
        m.logMonoTime = base + k * 50 * MS
        items.append((m.logMonoTime, "modelOutput", m.to_bytes()))
    write_drive(items, tmp_path / "logs")
    s = summarize(tmp_path / "logs", base)
    assert (s["deadline_ms"], s["deadline_ms_range"]) == (41.0, [39.5, 150.0])
    assert dict(summary_rows(s))["primary deadline (range)"] == "41.0 ms  (39.5 .. 150.0 ms)"
    s["deadline_ms"] = s["deadline_ms_range"] = None
    assert dict(summary_rows(s))["primary deadline (range)"] == "primary never asked"


def test_frames_no_node_ever_answered_are_all_missing(tmp_path):
    """A node that never started (a damaged model): 3 camera frames, no output -- 3 missing, not 0."""
    from drivelog import write_drive

    from chestnut.launch.summary import summarize, summary_rows

    base = 10_000 * 10**9
    items = []
    for k in range(3):
        m = new_message("cameraFrame")
        m.cameraFrame.frameId = k
        m.logMonoTime = base + k * 50 * MS
        items.append((m.logMonoTime, "cameraFrame", m.to_bytes()))
    write_drive(items, tmp_path / "logs")
    s = summarize(tmp_path / "logs", base)
    assert dict(summary_rows(s))["frames in / outputs out"] == "3 / 0  (missing: 3)"
    assert s["outputs_without_frame"] == 0


def test_outputs_whose_frame_the_log_lacks_are_counted_apart(tmp_path):
    """A logger that lost the camera's last frames: '47 / 63 (missing: 0)' read as if nothing was wrong."""
    from drivelog import write_drive

    from chestnut.launch.summary import summarize, summary_rows

    base = 10_000 * 10**9
    items = []
    for k in range(4):
        t = base + k * 50 * MS
        if k < 2:
            m = new_message("cameraFrame")
            m.cameraFrame.frameId = k
            m.logMonoTime = t
            items.append((t, "cameraFrame", m.to_bytes()))
        o = new_message("modelOutput")
        o.modelOutput.frameId = k
        o.logMonoTime = t + 20 * MS
        items.append((o.logMonoTime, "modelOutput", o.to_bytes()))
    write_drive(items, tmp_path / "logs")
    s = summarize(tmp_path / "logs", base)
    assert (s["frames_in"], s["outputs"], s["missing_outputs"], s["outputs_without_frame"]) == (2, 4, [], 2)
    assert dict(summary_rows(s))["frames in / outputs out"] == "2 / 4  (missing: 0; 2 for frames not in the log)"


def test_a_host_stall_and_its_catch_up_burst_neither_fail_a_check_nor_soft_disable():
    """A fresh user's launch soft-disabled after a host stall: everything due in a 0.5 s stall came in one burst
    at its end, the 20 Hz services' short window saw 36.4 Hz (above 24 Hz) and freq_ok failed. A catch-up is
    not a too-fast publisher (``msgs/submaster.py``): engaged all along, no event, no soft disable."""
    sm = SubMasterChecks(SERVICES)
    c = ControlLogic()
    stall_ms = (6000, 6500)  # nothing arrives after 6.0 s until 6.5 s; then every message due meanwhile
    states, failed_seen, burst_hz = [], set(), 0.0
    for t_ms in range(0, 13000, 10):  # a 10 ms update tick, 13 s: the stall leaves the long windows (5 s)
        due = list(range(t_ms - 9, t_ms + 1)) if not stall_ms[0] < t_ms < stall_ms[1] else []
        if t_ms == stall_ms[1]:
            due = list(range(stall_ms[0] + 1, stall_ms[1] + 1))
        batch = [ev("modelOutput") for d in due if d % 50 == 0] + [ev("chestnutActive") for d in due if d % 50 == 0]
        batch += [ev("chestnutHealth") for d in due if d % 200 == 0]
        sm.update_msgs(t_ms * MS, batch)
        failed = failed_checks(sm)
        x = ControlInputs(checks_ok=not failed, active=True, source="primary", frame_drop_perc=0.0,
                          failed_checks=failed)
        st = c.step(t_ms * MS, x)
        if t_ms >= 2200:  # engaged 1 s after the checks first passed (the health short window: 1 s)
            failed_seen.update(failed)
            states.append((st.engaged, st.soft_disabling, tuple(st.events)))
            burst_hz = max(burst_hz, sm.freq_tracker["modelOutput"].rates_hz()[0])
    assert sm.recv_count == {"modelOutput": 260, "chestnutActive": 260, "chestnutHealth": 65}  # none lost
    assert burst_hz == 20 * 10**9 / (550 * MS)  # the short window after the gap: 20 intervals over 0.55 s
    assert failed_seen == set()
    assert states == [(True, False, ())] * len(states)


def steady(service: str, period_ms: float, seconds: float) -> SubMasterChecks:
    sm = SubMasterChecks([service])
    for k in range(int(seconds * 1000 / period_ms)):
        sm.update_msgs(round(k * period_ms * MS), [ev(service)])
    return sm


def test_a_publisher_too_fast_or_too_slow_for_good_is_still_a_freq_check_named_with_its_side():
    fast = steady("modelOutput", 1000 / 30, 6.0)
    assert failed_checks(fast, ("modelOutput",)) == ("modelOutput.freq_ok",)
    assert describe_check(fast, "modelOutput.freq_ok", 0) == (
        "modelOutput.freq_ok (too fast: 30.00 Hz over 20, 30.00 Hz over 100 intervals; allowed 16..24 Hz)"
    )
    slow = steady("modelOutput", 1000 / 12, 9.0)
    assert failed_checks(slow, ("modelOutput",)) == ("modelOutput.freq_ok",)
    assert describe_check(slow, "modelOutput.freq_ok", 0) == (
        "modelOutput.freq_ok (too slow: 12.00 Hz over 20, 12.00 Hz over 100 intervals; allowed 16..24 Hz)"
    )


def test_the_first_output_and_active_are_on_the_stacks_clock_with_the_time_since_the_start_said_as_such(tmp_path):
    """The rows said ``launch -> first modelOutput 4.9 s`` and ``launch -> ChestnutActive 6.5 s``, counted from the
    stack's start, beside tables that count from its first message (``active`` at 4.0 s): each is said on the stack's
    clock, the time since the start named as that. ``--json`` keeps ``first_output_s`` / ``first_active_s`` (since
    the start) and adds ``first_output_t_s`` / ``first_active_t_s`` (the stack's clock)."""
    from drivelog import write_drive

    from chestnut.launch.summary import summarize, summary_rows

    base = 10_000 * 10**9
    started = base - 2_500 * MS  # the stack was started 2.5 s before its first message
    state = new_message("nodeState")  # the log's first message (after its initData, 1 ms before)
    state.logMonoTime = base
    items = [(base, "nodeState", state.to_bytes())]
    for k in range(3):
        m = new_message("modelOutput")
        m.modelOutput.frameId = k
        m.logMonoTime = base + 1_000 * MS + k * 50 * MS
        items.append((m.logMonoTime, "modelOutput", m.to_bytes()))
    a = new_message("chestnutActive")
    a.chestnutActive.active = True
    a.logMonoTime = base + 2_400 * MS
    items.append((a.logMonoTime, "chestnutActive", a.to_bytes()))
    write_drive(items, tmp_path / "logs")
    s = summarize(tmp_path / "logs", started)
    assert (s["first_output_t_s"], s["first_active_t_s"]) == (1.001, 2.401)  # since the initData
    assert (round(s["first_output_s"], 3), round(s["first_active_s"], 3)) == (3.5, 4.9)
    rows = dict(summary_rows(s))
    assert "launch -> first modelOutput" not in rows and "launch -> ChestnutActive" not in rows
    assert rows["first modelOutput"] == "t=1.0 s  (3.5 s after the stack was started)"
    assert rows["first ChestnutActive true"] == "t=2.4 s  (4.9 s after the stack was started)"
