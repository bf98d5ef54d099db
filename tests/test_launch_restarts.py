"""``chestnut launch``'s restart accounting (``launch/restarts.py``): supervisord's ``exited:`` lines give each
restart its cause (exit status or signal), the log gives its time on the run's clock and the frames it cost."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from drivelog import MS, build_drive, output_time, restart_node, write_drive

from chestnut.launch.restarts import Exit, restart_line, run_restarts, supervisor_exits

BASE_NS = 10_000 * 1_000_000_000
WALL0 = 1_796_000_000 * 1_000_000_000  # the Unix ns of the log's first message


def stamp(wall_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall_ns // 10**9)) + f",{wall_ns // 10**6 % 1000:03d}"


def test_supervisord_exits_are_read_with_their_cause():
    text = "\n".join([
        f"{stamp(WALL0)} INFO spawned: 'node' with pid 10",
        f"{stamp(WALL0 + 5 * 10**9)} WARN exited: node (terminated by SIGKILL; not expected)",
        f"{stamp(WALL0 + 5 * 10**9 + 4 * 10**6)} INFO spawned: 'node' with pid 11",
        f"{stamp(WALL0 + 9 * 10**9)} WARN exited: twin (exit status 1; not expected)",
        f"{stamp(WALL0 + 20 * 10**9)} INFO exited: node (exit status 0; expected)",
    ])
    assert supervisor_exits(text) == [
        Exit(WALL0 + 5 * 10**9, "node", "terminated by SIGKILL", True),
        Exit(WALL0 + 9 * 10**9, "twin", "exit status 1", False),  # never spawned again: no restart
        Exit(WALL0 + 20 * 10**9, "node", "exit status 0", False),
    ]


@pytest.fixture(scope="module")
def drive(tiny_onnx: Path) -> list:
    return build_drive(tiny_onnx, base_ns=BASE_NS)


def test_a_node_sigkill_is_one_restart_with_its_signal_and_the_frames_it_cost(tiny_onnx, drive, tmp_path):
    run_dir = tmp_path / "run"
    write_drive(restart_node(tiny_onnx, drive, 25), run_dir / "logs")
    t_kill = output_time(drive, 25) + 1 * MS
    exit_wall = WALL0 + (t_kill - BASE_NS) + 3 * MS  # supervisord sees the death 3 ms after the last message
    (run_dir / "supervisord.log").write_text(
        f"{stamp(exit_wall)} WARN exited: node (terminated by SIGKILL; not expected)\n"
        f"{stamp(exit_wall + 4 * MS)} INFO spawned: 'node' with pid 4243\n")
    found = run_restarts(run_dir, WALL0)
    want_t = round((exit_wall // 10**6 * 10**6 - WALL0) / 1e9, 3)
    back = round((output_time(drive, 56) - BASE_NS) / 1e9, 3)
    assert found == [{"t_s": want_t, "what": "node", "cause": "terminated by SIGKILL", "frames_lost": 30,
                      "back_s": back}]
    assert restart_line(found[0]) == (f"restart {want_t:.1f} s: node (terminated by SIGKILL), 30 frame(s) unanswered, "
                                      f"serving again at {back:.1f} s")


def test_a_recorder_crash_loop_on_a_full_disk_is_one_line_with_the_cause_its_log_gives(tmp_path):
    """A launch onto a full disk printed seven ``restart ...: record (exit status 1), frames unknown`` lines:
    one line now, with the recorder's own last error, what it cost (log messages, not frames) and how often."""
    from chestnut.launch.restarts import restart_lines

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = []
    for k, t in enumerate((5.0, 6.8, 8.6)):
        wall = WALL0 + int(t * 10**9)
        lines += [f"{stamp(wall)} WARN exited: record (exit status 1; not expected)",
                  f"{stamp(wall + 4 * MS)} INFO spawned: 'record' with pid {100 + k}"]
    wall = WALL0 + 12 * 10**9
    lines += [f"{stamp(wall)} WARN exited: camera (terminated by SIGKILL; not expected)",
              f"{stamp(wall + 4 * MS)} INFO spawned: 'camera' with pid 200"]
    (run_dir / "supervisord.log").write_text("\n".join(lines) + "\n")
    (run_dir / "record.log").write_text(
        "2026-12-04 15:24:48,000 INFO chestnut.record: recording\n"
        "2026-12-04 15:24:57,376 ERROR chestnut.record: cannot write the log: [Errno 28] No space left on device\n")
    found = run_restarts(run_dir, WALL0)
    cause = ("exit status 1; its last error: ERROR chestnut.record: cannot write the log: [Errno 28] No space left "
             "on device")
    assert [(r["what"], r["cause"]) for r in found] == [("record", cause)] * 3 + [("camera", "terminated by SIGKILL")]
    assert restart_lines(found) == [
        f"restart 5.0 s: record ({cause}), messages sent meanwhile not logged; 2 more the same way, the last at 8.6 s",
        "restart 12.0 s: camera (terminated by SIGKILL), frames unknown",
    ]


def test_the_summary_says_when_the_log_ends_long_before_the_stack_stopped():
    from chestnut.launch.summary import log_coverage_line

    words = "its last error: ERROR chestnut.record: cannot write the log: [Errno 28] No space left on device"
    assert log_coverage_line({"log_end_s": 4.88, "stop_s": 22.7, "recorder_words": words}) == (
        "the log ends at t=4.9 s, 17.8 s before the stack stopped (t=22.7 s): the figures above are of the logged "
        f"part only; record: {words}")
    assert log_coverage_line({"log_end_s": 21.0, "stop_s": 22.7, "recorder_words": words}) == ""  # within 2 s
    assert log_coverage_line({"log_end_s": 4.88, "stop_s": 22.7, "recorder_words": ""}) == (
        "the log ends at t=4.9 s, 17.8 s before the stack stopped (t=22.7 s): the figures above are of the logged "
        "part only")
    assert log_coverage_line({"log_end_s": None, "stop_s": 22.7}) == ""
