"""The contracts across a real restart: the launched stack with its node killed (SIGKILL) once mid-run.

supervisord restarts the node (``autorestart=unexpected``); the camera and the control daemon run on.
The run must pass: the frames sent while no node ran are owed nothing, and the dead node's last
``ChestnutActive`` true went stale as the control daemon saw (``docs/contracts.md`` "Restarts"). The model is
not the point here: the tiny one at the shipped config's input (``tests/tinymodel.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tinymodel import tiny_node_config

from chestnut.launch.supervise import stack_pids
from chestnut.node.offline.contracts import CONTRACTS, check_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def node_pid(prefix: str) -> int | None:
    """The pid of the stack's ``chestnut run`` (not its worker, not the other programs)."""
    for pid in stack_pids(prefix):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"chestnut.launch.cli" in args and args[args.index(b"chestnut.launch.cli") + 1:][:1] == [b"run"]:
            return pid
    return None


def wait_for(what, timeout_s: float):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if (value := what()) is not None:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    prefix = f"kill{os.getpid()}"
    out = tmp / "summary.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "chestnut.launch.cli", "launch", "--seconds", "16", "--no-live",
         "--runs-dir", str(tmp / "runs"), "--json", str(out), "--node-config", str(tiny_node_config(tmp))],
        env=dict(os.environ, CHESTNUT_PREFIX=prefix), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        node_log = wait_for(lambda: next((p for p in (tmp / "runs").glob("*/node.log")), None), 120)
        wait_for(lambda: True if "-> active" in node_log.read_text(errors="replace") else None, 120)
        control_log = node_log.parent / "control.log"  # serving on the primary, the control daemon engaged
        wait_for(lambda: True if control_log.is_file() and "engaged on the primary model" in
                 control_log.read_text(errors="replace") else None, 120)
        victim = wait_for(lambda: node_pid(prefix), 10)
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert out.is_file(), stdout[-3000:] + stderr[-3000:]
    return proc.returncode, json.loads(out.read_text()), node_log.parent, stderr


def test_a_node_killed_once_does_not_fail_the_run(run):
    rc, s, _, stderr = run
    assert s["contracts"] == dict.fromkeys(CONTRACTS, 0)
    assert rc == 0, stderr[-2000:]


def test_the_run_had_a_restart_and_frames_no_node_answered(run):
    _, s, run_dir, _ = run
    states = [st for _, st, _ in s["transitions"]]
    assert states.count("qualifying") == 2  # the first node's start and its successor's
    assert s["missing_outputs"]  # frames sent while no node ran: owed nothing, but there
    r = check_log([run_dir / "logs"])
    tl = r.timeline
    assert len(tl.sessions) == 2
    # every unanswered frame is the restart's: logged while no node ran, or in flight when the node died
    dead = tl.sessions[0].end_ns
    restart = {f.frame_id for f in tl.frames
               if tl.session_at(f.t_ns) is None or dead - r.params.answer_bound_ns < f.t_ns <= dead}
    assert set(s["missing_outputs"]) <= restart


def test_the_summary_names_the_node_restart_with_its_signal_and_the_frames_it_cost(run):
    _, s, run_dir, _ = run
    node = [r for r in s["restarts"] if r["what"] == "node"]
    assert len(node) == 1, s["restarts"]
    restart = node[0]
    assert restart["cause"] == "terminated by SIGKILL"
    assert restart["frames_lost"] == len(s["missing_outputs"])  # every frame no node answered is the restart's
    assert 0 < restart["t_s"] < restart["back_s"] < s["stop_s"]
    r = check_log([run_dir / "logs"])
    assert abs(r.timeline.seconds(r.timeline.sessions[0].end_ns) - restart["t_s"]) < 2.0  # the node's last word
