"""A stop is not a failure: ``chestnut run`` stopped by SIGTERM -- to the node alone, or to its whole process
group as ``timeout``, a terminal or systemd's control-group kill sends it, which reaches the primary worker
too -- logs no ``worker_died`` failover and leaves no leaked multiprocessing semaphore behind; it exits 0."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from nodeharness import Bus, NodeProcess, record_fingerprint, write_node_config

from chestnut.backend.sim.client import TwinDaemon
from chestnut.msgs.paths import runtime_dir

pytestmark = [pytest.mark.timeout(180)]


class GroupNode(NodeProcess):
    """The node as the leader of its own process group (its worker a member)."""

    def start(self) -> GroupNode:
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "chestnut.launch.cli", "run", "--config", str(self.config)],
                env=self.env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self


@pytest.mark.slow
@pytest.mark.parametrize("to_group", [True, False], ids=["process_group", "node_only"])
def test_sigterm_stops_the_node_without_a_failover(tmp_path: Path, tiny_onnx: Path, to_group: bool) -> None:
    prefix = f"t{os.getpid()}-sigterm-{int(to_group)}"
    fp = record_fingerprint(tiny_onnx, tmp_path / "tiny.fingerprint.json")
    cfg = write_node_config(
        tmp_path / "node.toml", tiny_onnx, fingerprint=fp, timing={"shadow_frames": 5, "start_timeout_s": 60.0}
    )
    twin = TwinDaemon(prefix).start()
    bus = Bus(prefix)
    bus.start()
    node = GroupNode(cfg, prefix, tmp_path / "node.log", env={"CACHELEVEL": "0"}).start()
    try:
        bus.wait_for(
            lambda r: (
                bool(r.states) and r.states[-1].state == "active" and any(o.source == "primary" for o in r.outputs)
            ),
            120.0,
            "the primary serving",
        )
        assert node.proc is not None
        family = node.descendants()  # the worker, its tinygrad compile pool and multiprocessing resource tracker
        assert family
        if to_group:
            os.killpg(node.pid, signal.SIGTERM)
        else:
            node.proc.send_signal(signal.SIGTERM)
        rc = node.proc.wait(15)
        _, alive = psutil.wait_procs(family, timeout=15)  # the resource tracker's last words are in the log then
        assert alive == []
    finally:
        bus.close()
        node.kill()
        twin.stop()
        shutil.rmtree(runtime_dir(prefix), ignore_errors=True)
    log = node.log_tail(200_000)
    assert rc == 0, log
    assert "worker_died" not in log and "-> degraded" not in log, log
    assert "leaked semaphore" not in log, log
    assert "active -> stopping on stop: stop: stop requested" in log, log
    if not to_group:  # the stop's line reads as one (it was ``worker stopped: StopReport(how='asked', ...)``)
        assert re.search(r"INFO chestnut\.node: worker pid \d+ stopped: exited when asked \(exit code 0\) in "
                         r"\d+(?: ms|\.\d s)\n", log), log


CHILD = """
import multiprocessing, sys, time
if sys.argv[1] == "1":
    from chestnut.node.worker import release_on_sigterm
    release_on_sigterm()
lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, registered with the resource tracker
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("handler", [True, False], ids=["worker_handler", "default_sigterm"])
def test_a_sigterm_worker_leaves_no_leaked_semaphore(handler: bool) -> None:
    """The worker's SIGTERM handler releases multiprocessing's semaphores (tinygrad's compile pool holds some)
    and still dies of SIGTERM; without it (the default action) the tracker reports the leak. stderr is read to
    its end: the resource tracker, which inherited it, has exited."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(int(handler))], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM
    assert ("There appear to be 1 leaked semaphore objects" in err) is not handler, err
