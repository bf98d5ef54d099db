"""``chestnut check``: each contract holds on a correct drive and each doctoring is reported exactly.

The drive (``tests/drivelog.py``) is built by really running the tiny model as primary (tinygrad) and
fallback (onnxruntime), written by ``RouteWriter`` into 3 s segments, then doctored.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from drivelog import (
    FRAME_PERIOD_NS,
    MS,
    _edit,
    build_drive,
    drop_output,
    forge_active,
    output_time,
    remove,
    repeat_then_skip,
    restart_node,
    shift_frame_eof,
    swap_output_ids,
    trailing_frames,
    write_drive,
    zero_log_time,
)

from chestnut.launch.cli import main
from chestnut.msgs.logfile import SegmentFileReader
from chestnut.node.offline.contracts import CONTRACTS, CheckParams, check_log

BASE_NS = 10_000 * 1_000_000_000


def frame_time(i: int) -> int:
    return BASE_NS + (i + 1) * FRAME_PERIOD_NS


@pytest.fixture(scope="module")
def drive(tiny_onnx: Path) -> list:
    return build_drive(tiny_onnx, base_ns=BASE_NS)


def write(items: list, tmp_path: Path, **kw) -> Path:
    write_drive(items, tmp_path / "logs", **kw)
    return tmp_path / "logs"


def found(result) -> list[tuple[str, int | None]]:
    return [(v.contract, v.frame_id) for v in result.violations]


def test_correct_drive_keeps_every_contract(drive, tmp_path):
    logs = write(drive, tmp_path)
    r = check_log(logs)
    assert len(r.timeline.files) == 4
    assert (len(r.timeline.frames), len(r.timeline.outputs)) == (180, 180)
    assert r.counts() == dict.fromkeys(CONTRACTS, 0)
    assert r.params == CheckParams()  # deadline 150 ms etc. read from the node's logged config
    assert main(["check", str(logs)]) == 0


def test_mcap_log_reads_the_same(drive, tmp_path):
    r = check_log(write(drive, tmp_path, formats=("mcap",)))
    assert len(r.timeline.frames) == 180 and r.violations == []


def test_dropped_output_is_one_frame_without_output(drive, tmp_path):
    r = check_log(write(drop_output(drive, 30), tmp_path))
    assert found(r) == [("one_output_per_frame", 30)]
    v = r.violations[0]
    assert v.t_ns == frame_time(30) and v.message == "frame 30 has no modelOutput"


def test_duplicate_output_is_reported(drive, tmp_path):
    t = output_time(drive, 45)
    copy = _edit([it for it in drive if it[0] == t and it[1] == "modelOutput"], lambda *_: True,
                 lambda ev: setattr(ev, "logMonoTime", t + 2 * MS))
    items = sorted([*drive, *copy], key=lambda it: it[0])
    r = check_log(write(items, tmp_path))
    # a second answer repeats the frame id, so the modelOutput ids stop increasing as well
    assert found(r) == [("one_output_per_frame", 45), ("frame_ids_increase", 45)]
    assert r.violations[0].message.startswith("frame 45 answered 2 times")


def test_forged_chestnut_active_while_the_fallback_serves(drive, tmp_path):
    r = check_log(write(forge_active(drive, 100), tmp_path))
    assert found(r) == [("active_only_when_healthy", 100)]
    msg = r.violations[0].message
    assert "its source is fallback" in msg and "gpu is ERROR (worker died (exit -9))" in msg


def test_forged_active_with_primary_source_while_gpu_error(drive, tmp_path):
    t = output_time(drive, 90) + 1 * MS

    def forge(ev):
        ev.chestnutActive.active = True
        ev.chestnutActive.source = "primary"

    r = check_log(write(_edit(drive, lambda tt, s, e: s == "chestnutActive" and tt == t, forge), tmp_path))
    assert found(r) == [("active_only_when_healthy", 90)]
    assert r.violations[0].message == "chestnutActive true while gpu is ERROR (worker died (exit -9))"


def test_swapped_frame_ids(drive, tmp_path):
    r = check_log(write(swap_output_ids(drive, 30, 31), tmp_path))
    assert found(r) == [("frame_ids_increase", 30)]
    assert r.violations[0].message == "modelOutput frame id 30 after 31"


def test_truncated_segment_is_reported_with_its_offset_and_the_rest_is_checked(drive, tmp_path):
    logs = write(drop_output(drive, 150), tmp_path)
    seg1 = logs / "2026-01-01--00-00-00--1" / "rlog.zst"
    data = seg1.read_bytes()
    seg1.write_bytes(data[: len(data) // 2])
    reader = SegmentFileReader(seg1)  # read on its own: where the damage is
    items = list(reader)
    assert len(reader.damage) == 1
    damage = reader.damage[0]
    last_frame = max(e.cameraFrame.frameId for _, s, _, e in items if s == "cameraFrame")
    r = check_log(logs)
    assert found(r) == [("log_intact", last_frame), ("one_output_per_frame", 150)]
    assert r.violations[0].message == f"{seg1}: byte {damage.offset}: {damage.reason}"
    assert main(["check", str(logs)]) == 1


def test_late_primary_output(drive, tmp_path):
    r = check_log(write(shift_frame_eof(drive, 30, 400 * MS), tmp_path))
    assert found(r) == [("deadline_or_fallback", 30)]
    assert r.violations[0].message == ("primary output 405.0 ms after the frame's EOF "
                                       "(deadline 150 ms + slack 100 ms)")


def test_switch_without_a_reason(drive, tmp_path):
    t60, t61 = frame_time(60), frame_time(61)
    items = remove(drive, lambda t, s, e: s == "nodeState" and t60 <= t < t61)
    items = _edit(items, lambda t, s, e: s == "chestnutActive" and t60 <= t < t61,
                  lambda ev: setattr(ev.chestnutActive, "reason", ""))
    r = check_log(write(items, tmp_path))
    assert found(r) == [("switch_has_reason", 60)]
    assert r.violations[0].message == ("source switched primary -> fallback at frame 60 with no reason in "
                                       "chestnutActive or nodeState")


def test_a_switch_announced_after_the_next_camera_frame_has_its_reason(drive, tmp_path):
    """A lagging node's announcement of the switch at frame 60 is logged after camera frame 61 (another
    publisher: the logger orders them by arrival) but before the node's next output: announced."""
    t60, t61 = frame_time(60), frame_time(61)
    moved = {"chestnutActive": t61 + 1 * MS, "nodeState": t61 + 2 * MS}
    items = _edit(drive, lambda t, s, e: s in moved and t60 <= t < t61,
                  lambda ev: setattr(ev, "logMonoTime", moved[ev.which()]), expect=3)
    assert [s for t, s, _ in items if t61 <= t < t61 + 5 * MS] == [
        "cameraFrame", "chestnutActive", "nodeState", "nodeState", "modelOutput"]
    assert found(check_log(write(items, tmp_path))) == []
    # and moved past the next output, it is no announcement of this switch
    later = _edit(drive, lambda t, s, e: s in moved and t60 <= t < t61,
                  lambda ev: setattr(ev, "logMonoTime", moved[ev.which()] + 4 * MS), expect=3)
    assert ("switch_has_reason", 60) in found(check_log(write(later, tmp_path / "later")))


def test_control_engaged_past_the_soft_disable(drive, tmp_path):
    items = _edit(drive, lambda t, s, e: s == "controlState" and frame_time(120) <= t < frame_time(131),
                  lambda ev: setattr(ev.controlState, "engaged", True), expect=11)
    r = check_log(write(items, tmp_path))
    # chestnutActive went false at frame 60 + 5 ms; control messages come 7 ms after each frame:
    # the first one later than 3 s + 100 ms slack is frame 122's (62 * 50 + 2 = 3102 ms)
    assert found(r) == [("control_disengages", 122)]
    assert r.violations[0].message == "still engaged 3.10 s after chestnutActive went false (soft disable 3 s)"


def test_control_engaging_while_inactive(drive, tmp_path):
    # control exited at frame 120; engaging again at frame 130 (chestnutActive still false) is one fault,
    # reported once for the whole engagement (frames 130-135)
    items = _edit(drive, lambda t, s, e: s == "controlState" and frame_time(130) <= t < frame_time(136),
                  lambda ev: setattr(ev.controlState, "engaged", True), expect=6)
    r = check_log(write(items, tmp_path))
    assert found(r) == [("control_disengages", 130)]
    assert r.violations[0].message == "engaged while chestnutActive was false (fallback serving, not the primary)"


def test_control_engaging_as_chestnut_active_falls_is_not_judged_on_a_message_still_on_its_way(drive, tmp_path):
    """A fault-free launch on a busy host failed ``control_disengages``: the daemon engaged 2 ms after a
    ``chestnutActive`` false (host late) was published, on the true one before it. A message published within the
    slack (100 ms) before the engage may not have reached the daemon yet; one published earlier has."""
    t160 = frame_time(160)  # control re-engages with frame 160's controlState (+7 ms), after 1 s of true
    reason = "host late: the fallback answered frame 160 (loop woke 36 ms late)"

    def falls(ev):
        ev.chestnutActive.active, ev.chestnutActive.reason = False, reason

    items = _edit(drive, lambda t, s, e: s == "chestnutActive" and t160 <= t < t160 + 6 * MS, falls, expect=1)
    assert found(check_log(write(items, tmp_path))) == []
    # false since frame 157 (+5 ms, 152 ms before the engage): the daemon had it, so the engage broke the rule
    earlier = _edit(drive, lambda t, s, e: s == "chestnutActive" and frame_time(157) <= t < t160 + 6 * MS, falls,
                    expect=4)
    r = check_log(write(earlier, tmp_path / "earlier"))
    assert found(r) == [("control_disengages", 160)]
    assert r.violations[0].message == f"engaged while chestnutActive was false ({reason})"


def test_health_silent_too_long(drive, tmp_path):
    items = remove(drive, lambda t, s, e: s == "chestnutHealth" and frame_time(84) <= t < frame_time(129))
    r = check_log(write(items, tmp_path))
    # health at frame 80 (+8 ms), next at frame 132: silent 2.6 s > 10 / 5 Hz
    assert found(r) == [("health_not_silent", 120)]
    assert r.violations[0].t_ns == frame_time(80) + 8 * MS + 2_000_000_000
    assert r.violations[0].message == "chestnutHealth silent for 2.60 s until the next one (allowed 2 s)"


def test_worker_silent_while_active(drive, tmp_path):
    items = _edit(drive, lambda t, s, e: s == "nodeState" and frame_time(60) <= t < frame_time(140)
                  and e.nodeState.state != "active", lambda ev: setattr(ev.nodeState, "state", "active"), expect=6)
    r = check_log(write(items, tmp_path))
    # waiting since frame 60's EOF (t60 - 1 ms); the first message later than 3350 ms after it is
    # frame 127's cameraFrame (67 * 50 = 3350 ms after t60, 3351 ms after the EOF)
    assert found(r) == [("worker_answers", 60)]
    assert r.violations[0].t_ns == frame_time(127)
    assert r.violations[0].message == ("no primary answer for 3351 ms since frame 60 while nodeState was active "
                                       "(bound 3350 ms)")


def test_log_end_excuses_frames_in_flight(drive, tmp_path):
    last_out = output_time(drive, 179)
    items = [it for it in drive if it[0] < last_out]  # the log stops between frame 179 and its output
    assert check_log(write(items, tmp_path)).violations == []


def test_cli_report_and_exit_codes(drive, tmp_path):
    logs = write(forge_active(drive, 100), tmp_path)
    assert main(["check", str(logs), "--report", str(tmp_path / "report")]) == 1
    page = (tmp_path / "report" / "index.html").read_text()
    assert page.count('src="data:image/png;base64,') == 3
    assert "active_only_when_healthy" in page and "FAIL: 1 contract violation(s)" in page
    for png in ("timeline.png", "agreement.png", "latency.png"):
        assert (tmp_path / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["check", str(tmp_path / "nothing-here")]) == 2


def test_frames_after_the_node_stopped_are_not_its_to_answer(drive, tmp_path):
    assert check_log(write(trailing_frames(drive, stopping=True), tmp_path / "a")).violations == []
    # without a stop, frames 180-184 went unanswered; 185-189 are within deadline + slack of the log's end
    r = check_log(write(trailing_frames(drive, stopping=False), tmp_path / "b"))
    assert found(r) == [("one_output_per_frame", i) for i in range(180, 185)]


def test_a_restarted_camera_starts_a_new_stream(tiny_onnx, tmp_path):
    """The camera restarts and counts frame ids from the start again; the node follows it: both streams
    are matched frame by frame (also for the deadline: each output from its own stream's frame), and the
    one decrease of ids (camera, then outputs) is not a violation."""
    first = build_drive(tiny_onnx, base_ns=BASE_NS, n=40)
    second = build_drive(tiny_onnx, base_ns=max(t for t, *_ in first) + 1_000_000_000, n=40)
    r = check_log(write([*first, *second], tmp_path),
                  only=["one_output_per_frame", "frame_ids_increase", "deadline_or_fallback"])
    assert found(r) == []  # the new stream's outputs are timed from its own frames, not the old stream's ids
    swapped = check_log(write(swap_output_ids([*first, *second], 30, 31), tmp_path / "swapped"),
                        only=["frame_ids_increase"])
    assert found(swapped) == [("frame_ids_increase", 30)]


# ---------------------------------------------------------------- gaps, duplicates and restarts


def test_a_repeated_frame_then_a_skip_is_one_camera_fault(drive, tmp_path):
    """The camera sends frame 50 twice, then skips to 61; the node answers 50 once and drops the copy.
    Every distinct frame has its one output: the one violation is the camera's repeated id (the check
    used to take the repeat for a camera restart: 234 one_output_per_frame violations, none else)."""
    logs = write(repeat_then_skip(drive, 50, 61), tmp_path)
    r = check_log(logs)
    assert [f.frame_id for f in r.timeline.frames[49:53]] == [49, 50, 50, 61]
    assert found(r) == []  # the camera's faults are input anomalies, not the node's violations
    assert [(a.t_ns, a.kind, a.frame_id, a.message) for a in r.anomalies] == [
        (frame_time(51), "frame_id", 50, "cameraFrame frame id 50 after 50 (repeated; the node drops it)"),
        (r.timeline.frames[52].t_ns, "frame_id", 61,
         "cameraFrame frame id 61 after 50: 10 id(s) skipped (frames the camera never sent)")]
    assert main(["check", str(logs)]) == 0


def test_a_repeated_frame_answered_twice_is_a_duplicate_output(drive, tmp_path):
    items = repeat_then_skip(drive, 50, 61)
    t = output_time(items, 50)
    copy = _edit([it for it in items if it[0] == t and it[1] == "modelOutput"], lambda *_: True,
                 lambda ev: setattr(ev, "logMonoTime", frame_time(51) + 4 * MS))
    r = check_log(write(sorted([*items, *copy], key=lambda it: it[0]), tmp_path))
    assert found(r) == [("one_output_per_frame", 50), ("frame_ids_increase", 50)]
    assert [v.message for v in r.violations] == [
        "frame 50 answered 2 times (sources primary, primary)",
        "modelOutput frame id 50 after 50",
    ]
    assert [a.message for a in r.anomalies][0] == "cameraFrame frame id 50 after 50 (repeated; the node drops it)"


@pytest.mark.parametrize("fmt", ["zst", "mcap"])
def test_a_frame_stamped_zero_is_checked_where_it_was_logged(drive, tmp_path, fmt):
    """``logMonoTime`` 0 on frame 50: the camera's clock, an input anomaly (no violation); the frame keeps its
    place in the file (after frame 49's controlState, 7 ms after frame 49), so its output matches and the log
    is 9.007 s long (the check used to sort it first: 303 one_output_per_frame violations)."""
    logs = write(zero_log_time(drive, 50), tmp_path, formats=(fmt,))
    r = check_log(logs)
    seg = logs / "2026-01-01--00-00-00--0" / f"rlog.{fmt}"
    assert found(r) == []
    assert [(a.kind, a.frame_id, a.message) for a in r.anomalies] == [
        ("timestamp", 50, f"{seg}: cameraFrame 50 has logMonoTime 0 (never stamped); checked at the time of the "
                          "message before it")]
    assert r.timeline.frames[50].frame_id == 50 and r.timeline.frames[50].t_ns == frame_time(49) + 7 * MS
    assert (r.timeline.start_ns, r.timeline.end_ns) == (BASE_NS, frame_time(179) + 7 * MS)


def test_a_node_killed_and_restarted_owes_nothing_while_none_ran(tiny_onnx, drive, tmp_path):
    """Killed after frame 25 (its last chestnutActive true), restarted 0.5 s later, fallback warm 1 s after
    that: frames 26-55 were logged while no node ran and are owed nothing; the dead node's last true went
    stale as the control daemon saw; the new node's first health (every layer STALE) says nothing of the
    dead node's time. Two node sessions, no violation (the check used to report 30 frames without an
    output and the dead node's last chestnutActive as true while every layer was STALE)."""
    r = check_log(write(restart_node(tiny_onnx, drive, 25), tmp_path))
    t_kill = output_time(drive, 25) + 1 * MS
    t_start = t_kill + 1_503 * MS
    assert [(s.start_ns, s.end_ns, s.stopping_ns) for s in r.timeline.sessions] == [
        (BASE_NS + 1 * MS, t_kill, None), (t_start, frame_time(179) + 5 * MS, None)]
    assert {o.frame_id for o in r.timeline.outputs} == set(range(26)) | set(range(56, 180))
    assert r.violations == []


def test_a_restarted_node_must_not_leave_a_live_true_behind(tiny_onnx, drive, tmp_path):
    """Restarted within the alive window (0.1 s + 0.3 s warm-up after its last true) and publishing no
    chestnutActive for its first frames: a consumer still believes the dead node's true while the fallback
    serves frames 32-35; from frame 36 on (more than 0.5 s after that true) it has gone stale."""
    items = restart_node(tiny_onnx, drive, 25, restart_s=0.1, warm_s=0.2)
    t_kill = output_time(drive, 25) + 1 * MS
    items = remove(items, lambda t, s, e: s == "chestnutActive" and t_kill < t < t_kill + 1_000 * MS)
    r = check_log(write(items, tmp_path))
    assert found(r) == [("active_only_when_healthy", i) for i in (32, 33, 34, 35)]
    assert r.violations[0].message == "frame 32 served by the fallback while chestnutActive stayed true"


def test_a_control_daemon_that_ignores_a_stale_active(tiny_onnx, drive, tmp_path):
    """The node is killed and restarted but the control daemon stays engaged with every check passing: it
    is reported once, soft-disable + slack after the dead node's last chestnutActive went stale
    (0.5 s after it), at frame 97's controlState (t_kill + 500 ms + 3102 ms)."""
    r = check_log(write(restart_node(tiny_onnx, drive, 25, control_follows=False), tmp_path))
    assert found(r) == [("control_disengages", 97)]
    assert r.violations[0].message == "still engaged 3.10 s after chestnutActive went stale (soft disable 3 s)"


def test_a_node_killed_and_not_restarted_fails_loudly(tiny_onnx, drive, tmp_path):
    """No successor: nothing in the log says the node is gone (a hung node looks the same), so it owes
    every frame until the log ends: frames 26-174 (175-179 are still within deadline + slack of the end),
    its health silence to the log's end, and one wait for the primary while its last nodeState said
    active."""
    r = check_log(write(restart_node(tiny_onnx, drive, 25, restarted=False), tmp_path))
    assert len(r.timeline.sessions) == 1
    counts = {k: v for k, v in r.counts().items() if v}
    assert counts == {"one_output_per_frame": 149, "health_not_silent": 1, "worker_answers": 1}
    missing = [v.frame_id for v in r.violations if v.contract == "one_output_per_frame"]
    assert missing == list(range(26, 175))
    silent_s = (frame_time(179) + 7 * MS - (frame_time(24) + 8 * MS)) / 1e9
    assert [v.message for v in r.violations if v.contract == "health_not_silent"] == [
        f"chestnutHealth silent for {silent_s:.2f} s until the log ends (allowed 2 s)"]


def test_a_false_active_logged_after_the_next_camera_frame_still_answers_a_fallback_frame(drive, tmp_path):
    """The logger orders different publishers by arrival: the node's false ``chestnutActive`` after fallback
    frame 60 (the first, after a true) logged behind camera frame 61 (but before the node's next output)
    still tells the consumer the truth; logged behind the node's next output it does not (frame 60 is then
    reported)."""
    t = output_time(drive, 60) + 1 * MS
    behind_frame = _edit(drive, lambda tt, s, e: s == "chestnutActive" and tt == t,
                         lambda b: setattr(b, "logMonoTime", frame_time(61) + 2 * MS))
    assert check_log(write(behind_frame, tmp_path / "a")).violations == []
    behind_output = _edit(drive, lambda tt, s, e: s == "chestnutActive" and tt == t,
                          lambda b: setattr(b, "logMonoTime", output_time(drive, 61) + 2 * MS))
    assert found(check_log(write(behind_output, tmp_path / "b"))) == [("active_only_when_healthy", 60)]


@pytest.mark.parametrize(
    ("option", "value", "why"),
    [
        ("--deadline-ms", "-5", "give a time in milliseconds, > 0 and <= 60000 (a minute)"),
        ("--deadline-ms", "0", "give a time in milliseconds, > 0 and <= 60000 (a minute)"),
        ("--deadline-ms", "nan", "give a time in milliseconds, > 0 and <= 60000 (a minute)"),
        ("--wait-timeout-ms", "inf", "give a time in milliseconds, > 0 and <= 60000 (a minute)"),
        ("--slack-ms", "-1", "give a slack in milliseconds, >= 0 and <= 60000 (a minute)"),
        ("--slack-ms", "nan", "give a slack in milliseconds, >= 0 and <= 60000 (a minute)"),
    ],
)
def test_a_bound_that_is_not_a_finite_positive_time_is_refused_in_one_line(option, value, why, capsys, tmp_path):
    """``--deadline-ms -5`` was accepted; ``--deadline-ms nan`` failed "cannot convert float NaN to integer"."""
    with pytest.raises(SystemExit) as info:
        main(["check", str(tmp_path), option, value])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"chestnut check: error: argument {option}: {value!r}: {why} (chestnut check --help)\n"
    )
