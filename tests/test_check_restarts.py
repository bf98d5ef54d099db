"""``chestnut check`` accounts for every restart (``node/offline/restarts.py``): a node killed and restarted,
and a primary worker restarted after a failover, each with its time, cause and the frames it cost."""

from __future__ import annotations

from pathlib import Path

import pytest
from drivelog import (
    FAULT_FRAME,
    MS,
    RETURN_FRAME,
    _edit,
    build_drive,
    output_time,
    restart_node,
    write_drive,
)

from chestnut.launch.cli import main
from chestnut.node.offline.contracts import check_log
from chestnut.node.offline.restarts import Restart, restarts

BASE_NS = 10_000 * 1_000_000_000


@pytest.fixture(scope="module")
def drive(tiny_onnx: Path) -> list:
    return build_drive(tiny_onnx, base_ns=BASE_NS)


def test_a_killed_node_is_one_restart_with_the_frames_it_cost(tiny_onnx, drive, tmp_path, capsys):
    logs = tmp_path / "logs"
    write_drive(restart_node(tiny_onnx, drive, 25), logs)
    tl = check_log(logs).timeline
    t_kill = output_time(drive, 25) + 1 * MS
    t_start = t_kill + 1_503 * MS
    assert restarts(tl) == [Restart(
        t_kill, "node", f"killed or crashed: it published no stopping (the log holds no exit status or signal); the "
                        f"new process started at {tl.seconds(t_start):.3f} s", 30, output_time(drive, 56))]
    capsys.readouterr()
    assert main(["check", str(logs)]) == 0
    out = capsys.readouterr().out
    assert "restarts" in out and "killed or crashed" in out


def test_a_worker_restart_after_a_failover_names_its_cause(drive, tmp_path):
    failover = next(t for t, s, _ in drive if s == "nodeState" and t > output_time(drive, FAULT_FRAME)
                    and t < output_time(drive, FAULT_FRAME + 1))
    later = [t for t, s, _ in drive if s == "nodeState" and t > failover + 10 * MS]

    def bump(ev) -> None:
        ev.nodeState.restarts = 1

    logs = tmp_path / "logs"
    write_drive(_edit(drive, lambda t, s, e: s == "nodeState" and t in later, bump, expect=len(later)), logs)
    tl = check_log(logs).timeline
    found = restarts(tl)
    assert found == [Restart(failover, "worker", "primary_fault: worker died (exit -9)",
                             RETURN_FRAME - FAULT_FRAME, output_time(drive, RETURN_FRAME))]
    assert found[0].line(tl) == (f"worker restart at {tl.seconds(failover):.3f} s: primary_fault: worker died "
                                 f"(exit -9); 80 frame(s) answered by the fallback; back at "
                                 f"{tl.seconds(output_time(drive, 140)):.3f} s")


def test_the_report_names_the_restart_and_the_anomalies(tiny_onnx, drive, tmp_path):
    from drivelog import repeat_then_skip

    from chestnut.node.offline.report import write_report

    logs = tmp_path / "logs"
    write_drive(repeat_then_skip(restart_node(tiny_onnx, drive, 25), 100, 111), logs)
    r = check_log(logs)
    index = write_report(tmp_path / "report", r.timeline, violations=r.violations)
    page = index.read_text()
    assert "<h2>restarts (1)</h2>" in page
    assert "killed or crashed: it published no stopping (the log holds no exit status or signal)" in page
    assert "<h2>input anomalies (2; not the node's faults)</h2>" in page
    assert "cameraFrame frame id 100 after 100 (repeated; the node drops it)" in page
