"""``chestnut check`` separates the inputs' anomalies from the node's faults (``node/offline/contracts.py``
``input_anomalies``): camera frames stamped absurdly (``logMonoTime`` 0, 10^6 s ahead, 2^64-1; EOF 0),
repeated and skipped camera ids, and a log that begins mid-episode (the control daemon already
soft-disabling) are listed as anomalies, with no violation and exit status 0.

The drive (``tests/drivelog.py``) is built by really running the tiny model, then doctored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from drivelog import MS, build_drive, frame_time_of, remove, repeat_then_skip, write_drive

from chestnut.launch.cli import main
from chestnut.msgs.schema import log
from chestnut.node.offline.contracts import CONTRACTS, check_log

BASE_NS = 10_000 * 1_000_000_000
U64_MAX = (1 << 64) - 1


@pytest.fixture(scope="module")
def drive(tiny_onnx: Path) -> list:
    return build_drive(tiny_onnx, base_ns=BASE_NS)


def restamp(items: list, frame_id: int, log_mono: int | None = None, eof: int | None = None) -> list:
    """The ``cameraFrame`` of ``frame_id`` stamped ``log_mono`` (its ``logMonoTime``) and/or ``eof``
    (``timestampEof``), written where it arrived (the logger's order)."""
    t = frame_time_of(items, frame_id)
    out = []
    for it in items:
        if it[0] == t and it[1] == "cameraFrame":
            with log.Event.from_bytes(it[2]) as reader:
                b: Any = reader.as_builder()
            if log_mono is not None:
                b.logMonoTime = log_mono
            if eof is not None:
                b.cameraFrame.timestampEof = eof
            it = (t, it[1], b.to_bytes())
        out.append(it)
    return out


def kinds(r) -> list[tuple[str, int | None]]:
    return [(a.kind, a.frame_id) for a in r.anomalies]


def test_absurd_timestamps_are_the_cameras_anomalies_not_violations(drive, tmp_path):
    items = restamp(drive, 30, log_mono=0)
    items = restamp(items, 40, log_mono=frame_time_of(drive, 40) + 1_000_000 * 1_000_000_000)  # 10^6 s ahead
    items = restamp(items, 50, log_mono=U64_MAX)
    items = restamp(items, 70, eof=0)
    items = restamp(items, 80, eof=frame_time_of(drive, 80) + 1_000_000 * 1_000_000_000)
    logs = tmp_path / "logs"
    write_drive(items, logs)
    r = check_log(logs)
    assert r.counts() == dict.fromkeys(CONTRACTS, 0), [v.message for v in r.violations]
    assert kinds(r) == [("timestamp", 30), ("timestamp", 40), ("timestamp", 50), ("timestamp", 70),
                        ("timestamp", 80)]
    seg = logs / "2026-01-01--00-00-00--0" / "rlog.zst"
    msgs = [a.message for a in r.anomalies]
    assert msgs[0] == f"{seg}: cameraFrame 30 has logMonoTime 0 (never stamped); checked at the time of the message " \
                      "before it"
    assert msgs[1] == (f"{seg}: cameraFrame 40 has logMonoTime {frame_time_of(drive, 40) + 10**15}, +1000000 s off "
                       "the log's clock around it; checked at the time of the message before it")
    assert msgs[2].startswith(f"{seg}: cameraFrame 50 has logMonoTime {U64_MAX}, +")
    assert msgs[3] == "cameraFrame 70: timestampEof is 0 (not set): its age is unknown (the node answers it not valid)"
    assert msgs[4] == ("cameraFrame 80: timestampEof is 1000000000.0 ms after its logMonoTime: its age is unknown "
                       "(the node answers it not valid)")
    # every frame sits where the logger wrote it: the log ends with its last message, frame 40 between 39 and 41
    assert r.timeline.end_ns == max(t for t, *_ in drive)
    ids = [f.frame_id for f in r.timeline.frames]
    assert ids == sorted(ids) and len(ids) == 180
    assert main(["check", str(logs)]) == 0


def test_repeated_and_skipped_ids_are_listed_and_exit_zero(drive, tmp_path, capsys):
    logs = tmp_path / "logs"
    write_drive(repeat_then_skip(drive, 100, 111), logs)
    r = check_log(logs)
    assert r.violations == []
    assert [(a.kind, a.frame_id, a.message) for a in r.anomalies] == [
        ("frame_id", 100, "cameraFrame frame id 100 after 100 (repeated; the node drops it)"),
        ("frame_id", 111, "cameraFrame frame id 111 after 100: 10 id(s) skipped (frames the camera never sent)")]
    capsys.readouterr()
    assert main(["check", str(logs)]) == 0
    out = capsys.readouterr().out
    assert "input anomalies (not the node's faults)" in out
    assert "0 violation(s); 2 input anomalies (not the node's faults)" in out


def test_a_log_that_begins_mid_episode_has_an_unknown_initial_state(drive, tmp_path):
    """The logger restarted while the control daemon soft-disables (engaged since frame 20, chestnutActive false
    since the failover at frame 60): the new log begins at frame 70. Its first engaged controlState is no
    engagement's start, and its soft disable (which ends at frame 120, 3 s after the failover) is timed from
    the first evidence the log holds."""
    start = frame_time_of(drive, 70)
    logs = tmp_path / "logs"
    write_drive(remove(drive, lambda t, s, e: t < start), logs)
    r = check_log(logs)
    assert r.timeline.controls[0].engaged and r.timeline.controls[0].soft_disabling
    assert r.counts() == dict.fromkeys(CONTRACTS, 0), [v.message for v in r.violations]
    assert [(a.kind, a.message) for a in r.anomalies] == [
        ("initial_state", "the log begins with the control daemon soft-disabling: the state before it is unknown "
                          "(its engagement is not judged as a start)")]
    assert r.anomalies[0].t_ns == start + 7 * MS
    assert main(["check", str(logs)]) == 0


def test_a_node_that_stamps_its_own_output_absurdly_is_still_a_violation(drive, tmp_path):
    """The node's own messages carry its clock: an absurd ``logMonoTime`` on a ``modelOutput`` is log_intact's."""
    t = frame_time_of(drive, 90) + 4 * MS
    out = []
    for it in drive:
        if it[0] == t and it[1] == "modelOutput":
            with log.Event.from_bytes(it[2]) as reader:
                b: Any = reader.as_builder()
            b.logMonoTime = U64_MAX
            it = (t, it[1], b.to_bytes())
        out.append(it)
    logs = tmp_path / "logs"
    write_drive(out, logs)
    r = check_log(logs)
    assert [(v.contract, v.frame_id) for v in r.violations] == [("log_intact", 90)]
    assert r.violations[0].t_ns == frame_time_of(drive, 90)  # where the logger wrote it: after frame 90


def _checked_summary(items, tmp_path, capsys) -> tuple[list[str], list[str]]:
    """``chestnut check`` (exit 0) of ``items`` written as a log: its summary lines and all its output's lines."""
    logs = tmp_path / "logs"
    write_drive(items, logs)
    capsys.readouterr()
    assert main(["check", str(logs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    return [line for line in lines if line.startswith("4 file(s), 9.0 s, 180 frames, 180 outputs; ")], lines


def test_into_a_pipe_a_line_of_the_report_is_one_line_however_long(drive, tmp_path, capsys):
    """Not a terminal (capsys, like ``| grep``): rich's 80-column fold is off, so the one summary line stays one."""
    summary, lines = _checked_summary(drive, tmp_path, capsys)
    assert len(summary) == 1 and len(summary[0]) > 80, lines[:4]
    assert summary[0].endswith("wait timeout 3000 + 250 ms (configuration: the log's node initData)"), summary


def test_the_header_says_the_per_frame_deadline_the_check_judged_by_not_only_the_ceiling(drive, tmp_path, capsys):
    """``deadline_or_fallback`` judges each primary output by its frame's published deadline (adaptive, at most
    ``timing.deadline_ms``): the header said ``deadline 150 ms`` -- the ceiling -- for a node that ran at 45 ms."""
    out, n = [], 0
    for it in drive:
        if it[1] == "modelOutput":
            with log.Event.from_bytes(it[2]) as reader:
                b: Any = reader.as_builder()
            if b.modelOutput.source == "primary":
                b.modelOutput.deadline = max(0.045, 0.150 - 0.005 * n)  # 150 ms down to 45 ms
                n += 1
                it = (it[0], it[1], b.to_bytes())
        out.append(it)
    assert n > 21
    summary, lines = _checked_summary(out, tmp_path, capsys)
    assert summary == ["4 file(s), 9.0 s, 180 frames, 180 outputs; deadline per frame 45.0 ms at the end (45.0 .. "
                       "150.0 ms; adaptive, ceiling 150 ms), slack 100 ms, wait timeout 3000 + 250 ms (configuration: "
                       "the log's node initData)"], lines[:4]
