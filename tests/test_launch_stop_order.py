"""``chestnut launch``'s stop: the consumer leaves first, then the camera, the node once it answered the
camera's last frame, the logger after a drain, the twin last -- so the log holds an answer to every frame
the camera sent and the control daemon never sees the node go (no soft disable at the stop)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from tinymodel import tiny_node_config

from chestnut.launch.supervise import STOP_ORDER, stack_pids
from chestnut.msgs.logfile import LogReader

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stop")
    out = tmp / "summary.json"
    # a prefix of the module's own: a module fixture is set up before conftest's per-test prefix, so
    # current_prefix() here would be the user's (their own stack's, and every process that inherited it)
    prefix = f"t{os.getpid()}-stoporder"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "chestnut.launch.cli",
            "launch",
            "--seconds",
            "8",
            "--no-live",
            "--runs-dir",
            str(tmp / "runs"),
            "--json",
            str(out),
            "--node-config",  # the model is not the point: the tiny one at the shipped config's input
            str(tiny_node_config(tmp)),
        ],
        env=dict(os.environ, CHESTNUT_PREFIX=prefix),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert out.is_file(), proc.stderr[-3000:]
    (run_dir,) = (tmp / "runs").iterdir()
    return proc, json.loads(out.read_text()), run_dir, prefix


def test_programs_stop_in_order(stopped):
    _, _, run_dir, _ = stopped
    log = (run_dir / "supervisord.log").read_text()
    assert re.findall(r"stopped: (\w+) \(", log) == list(STOP_ORDER)


def test_the_cameras_last_frame_is_answered_in_the_log(stopped):
    proc, s, run_dir, _ = stopped
    assert proc.returncode == 0, proc.stderr[-2000:]
    frames, answered = [], set()
    for _, service, ev in LogReader([run_dir / "logs"]):
        if service == "cameraFrame":
            frames.append(ev.cameraFrame.frameId)
        elif service == "modelOutput":
            answered.add(ev.modelOutput.frameId)
    assert frames and frames[-1] in answered
    assert [f for f in frames if f not in answered] == []
    assert s["outputs"] == s["frames_in"] == len(frames)
    assert s["contracts"]["one_output_per_frame"] == 0


def test_no_soft_disable_at_the_stop(stopped):
    # the consumer is gone before the node goes silent (a failover mid-run on a loaded machine is another story)
    _, s, _, _ = stopped
    assert [e for e in s["soft_disable_episodes"] if e["t_s"] >= s["stop_s"]] == []


def test_nothing_left_running(stopped):
    assert stack_pids(stopped[3]) == []
