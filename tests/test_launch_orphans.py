"""No orphans: whatever ends ``chestnut launch``'s supervisord or launch itself, no process of the stack
(found by ``CHESTNUT_PREFIX`` in its environment, the way launch finds them) outlives the launch.

Each test launches the whole stack (twin, logger, node, camera, control) on the fallback-only node
configuration, waits for its first ``modelOutput``, kills one process with SIGKILL and waits for the rest
to go.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chestnut.launch.supervise import stack_pids
from chestnut.msgs.messaging import SubMaster
from chestnut.msgs.paths import current_prefix, runtime_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def launch(tmp_path: Path, prefix: str) -> tuple[subprocess.Popen, Path]:
    """``chestnut launch`` until stopped; returns it and the supervisord pid file once the node answers."""
    runs = tmp_path / "runs"
    with SubMaster(["modelOutput"], prefix=prefix) as sm:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "chestnut.launch.cli",
                "launch",
                "--seconds",
                "0",
                "--no-live",
                "--runs-dir",
                str(runs),
            ],
            env=dict(os.environ, CHESTNUT_PREFIX=prefix),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        t_end = time.monotonic() + 150
        while not sm.seen["modelOutput"] and proc.poll() is None and time.monotonic() < t_end:
            sm.update(200)
    if not sm.seen["modelOutput"]:
        proc.kill()
        pytest.fail(f"the stack never answered a frame: {proc.communicate(timeout=60)[1][-2000:]}")
    (pidfile,) = runs.glob("*/supervisord.pid")
    return proc, pidfile


def wait_gone(prefix: str, timeout_s: float) -> list[int]:
    t_end = time.monotonic() + timeout_s
    while (left := stack_pids(prefix)) and time.monotonic() < t_end:
        time.sleep(0.2)
    return left


def leftovers(prefix: str) -> list[str]:
    out = []
    for pid in stack_pids(prefix):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{pid}: {cmd[:200]}")
        except OSError:
            pass
    return out


@pytest.fixture
def prefix():
    # a prefix of this test's own: no process another test left on the session's prefix can meet this stack
    p = f"{current_prefix()}-orphans{time.monotonic_ns() % 1_000_000}"[:64]
    yield p
    for pid in stack_pids(p):  # whatever the test found left over goes, so it cannot disturb later tests
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(runtime_dir(p), ignore_errors=True)


def test_killed_supervisord_leaves_no_program_behind(tmp_path, prefix):
    proc, pidfile = launch(tmp_path, prefix)
    supervisord = int(pidfile.read_text())
    assert len(stack_pids(prefix)) >= 7  # supervisord, 5 programs, the node's worker
    os.kill(supervisord, signal.SIGKILL)  # its programs live in their own process groups: none gets a signal
    rc = proc.wait(timeout=60)
    assert rc == 1, proc.stderr.read()[-3000:] if proc.stderr else rc  # ended early: no verdict to trust
    assert wait_gone(prefix, 10.0) == [], leftovers(prefix)


def test_killed_launch_leaves_no_program_behind(tmp_path, prefix):
    proc, _ = launch(tmp_path, prefix)
    proc.kill()  # supervisord's parent-death signal (SIGTERM) makes it stop every program in its stop order
    proc.wait(timeout=10)
    assert wait_gone(prefix, 45.0) == [], leftovers(prefix)
