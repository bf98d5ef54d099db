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
    shift_frame_eof,
    swap_output_ids,
    trailing_frames,
    write_drive,
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
    # waiting since frame 60's EOF (t60 - 1 ms); the first message later than 3250 ms after it is
    # frame 125's cameraFrame (65 * 50 = 3250 ms after t60, 3251 ms after the EOF)
    assert found(r) == [("worker_answers", 60)]
    assert r.violations[0].t_ns == frame_time(125)
    assert r.violations[0].message == ("no primary answer for 3251 ms since frame 60 while nodeState was active "
                                       "(bound 3250 ms)")


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
    are matched frame by frame, and the one decrease of ids (camera, then outputs) is not a violation."""
    first = build_drive(tiny_onnx, base_ns=BASE_NS, n=40)
    second = build_drive(tiny_onnx, base_ns=max(t for t, *_ in first) + 1_000_000_000, n=40)
    r = check_log(write([*first, *second], tmp_path), only=["one_output_per_frame", "frame_ids_increase"])
    assert found(r) == []
    swapped = check_log(write(swap_output_ids([*first, *second], 30, 31), tmp_path / "swapped"),
                        only=["frame_ids_increase"])
    assert found(swapped) == [("frame_ids_increase", 30)]
