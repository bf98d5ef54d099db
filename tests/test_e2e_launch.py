"""The main job end to end: the real PP-OCRv4 detector and real traffic frames through the whole launched
stack (twin, logger, control daemon, node, camera under supervisord), with a GPU hang injected mid-run.

Needs the prepared model (``chestnut model prepare``, part of ``launch/setup.sh``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from chestnut.launch.assets import default_model_path
from chestnut.launch.supervise import stack_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not default_model_path().is_file():
        pytest.fail("the real model is not prepared: run `bash launch/setup.sh` (chestnut model prepare)")
    tmp = tmp_path_factory.mktemp("launch")
    env = dict(os.environ, CHESTNUT_PREFIX=f"e2e{os.getpid()}")
    out = tmp / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "chestnut.launch.cli", "launch", "--seconds", "28", "--no-live",
         "--runs-dir", str(tmp / "runs"), "--fault", "gpu_hang@5+4", "--fault-from", "active", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=380)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text()), tmp


def test_every_frame_gets_exactly_one_output(run):
    proc, s, _ = run
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert s["missing_outputs"] == []
    assert s["outputs"] == s["frames_in"] > 400
    assert s["log_damage"] == []
    assert 18.0 <= s["frame_rate_hz"] <= 22.0


def test_hang_fails_over_then_returns_to_the_primary(run):
    _, s, _ = run
    states = [st for _, st, _ in s["transitions"]]
    assert states[:2] == ["qualifying", "active"]
    i = states.index("degraded")
    assert "active" in states[i:]  # back on the primary after the fault cleared
    assert "recovering" in states[i:states.index("active", i)]
    assert s["by_source"]["fallback"] > 0 and s["by_source"]["primary"] > s["by_source"]["fallback"]


def test_control_daemon_soft_disables_and_reengages(run):
    _, s, _ = run
    events = [what for _, what in s["control"]]
    assert events[0] == "engaged"
    assert any(e.startswith("disengaged") and "modelSourceChanged" in e for e in events)
    assert events[-1] == "engaged"


def test_stack_stopped_cleanly(run):
    # every program (and the node's worker) carries the stack's prefix in its environment; a path in the
    # command line only the logger and supervisord carry
    assert stack_pids(f"e2e{os.getpid()}") == []


def test_supervisord_logs_nothing_critical(run):
    """An alarm must mean the dock failed: supervisord's CRIT lines ("running as root" where the stack runs as
    root by choice, "running without any HTTP authentication" on a socket only its user reaches) are not said."""
    _, _, tmp = run
    (run_dir,) = (tmp / "runs").iterdir()
    log = (run_dir / "supervisord.log").read_text()
    assert [ln for ln in log.splitlines() if " CRIT " in ln] == []
    assert "supervisord started with pid" in log


def test_the_report_and_summary_show_the_injected_gpu_hang(run):
    _, s, tmp = run
    events = [(e["fault"].split("#")[0], e["action"]) for e in s["fault_events"]]
    assert ("gpu_hang", "armed") in events and ("gpu_hang", "fired") in events
    assert [(f["action"], f["fault"]) for f in s["fault_schedule"]] == [("inject", "gpu_hang"), ("clear", "gpu_hang")]
    inject, clear = s["fault_schedule"]
    assert abs(clear["t_s"] - inject["t_s"] - 4.0) < 1.0  # gpu_hang@5+4, on the one clock
    (run_dir,) = (tmp / "runs").iterdir()
    page = (run_dir / "report" / "index.html").read_text()
    assert "fault gpu_hang#1 fired" in page and "launch: inject gpu_hang" in page and "hit packet #" in page
    # the fault from inject to clear, its clear time named (report.py fault_intervals)
    assert f"<td>{clear['t_s']:.3f}</td><td>cleared by launch" in page
