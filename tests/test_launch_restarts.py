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
