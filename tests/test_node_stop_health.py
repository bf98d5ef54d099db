"""A shutdown publishes health until it ends: ``chestnut run`` stopped by SIGTERM while its worker is slow to
stop (here: suspended, so it answers neither STOP nor SIGTERM until the node's SIGKILL, 2.5 s of openpilot's
stop sequence) says ``nodeState`` stopping and ``chestnutActive`` false at once, and keeps publishing
``chestnutHealth`` and ``nodeState`` through the wait, ending with a health message; so ``chestnut check``'s
``health_not_silent`` holds at a normal shutdown (``node/main.py`` ``Node.close``, ``docs/contracts.md``)."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import psutil
import pytest
from nodeharness import Bus, NodeProcess, write_node_config

from chestnut.msgs.paths import runtime_dir
from chestnut.node.offline.contracts import CheckParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_health_is_published_until_the_end_of_a_shutdown_with_a_worker_slow_to_stop(
    tmp_path: Path, tiny_onnx: Path
) -> None:
    prefix = f"t{os.getpid()}-stop-health"
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="cpu", timing={"start_timeout_s": 60.0})
    bus = Bus(prefix)
    bus.start()
    node = NodeProcess(cfg, prefix, tmp_path / "node.log").start()
    worker: psutil.Process | None = None
    try:
        pid = bus.wait_for(lambda r: next((s.worker_pid for s in r.states if s.worker_pid), 0), 120.0, "a worker")
        bus.wait_for(lambda r: len(r.health) >= 2, 60.0, "health published")
        worker = psutil.Process(pid)
        worker.suspend()  # a worker busy elsewhere (e.g. mid-qualification): it does not answer STOP
        rc, _ = node.stop(signal.SIGTERM, timeout_s=30.0)
        rec = bus.wait_for(  # the node's last messages may still be in flight when it has exited
            lambda r: r if r.states and r.states[-1].state == "stopping" else None, 10.0, "nodeState stopping"
        )
    finally:
        bus.close()
        node.kill()
        if worker is not None and worker.is_running():
            worker.kill()
        shutil.rmtree(runtime_dir(prefix), ignore_errors=True)
    log = node.log_tail(200_000)
    assert rc == 0, log
    assert "did not stop within" in log, log  # the worker really was slow to stop: the node escalated
    stopping = next(s for s in rec.states if s.state == "stopping")
    # announced at once (before the 2 s wait for the worker), then health through that wait to the end
    health = [h.mono_ns for h in rec.health]
    during = [t for t in health if t > stopping.mono_ns]
    assert len(during) >= 2, (len(during), log[-3000:])
    last_node = max([s.mono_ns for s in rec.states] + [a.mono_ns for a in rec.active] + health)
    assert rec.active and rec.active[-1].active is False
    assert not any(a.active for a in rec.active if a.mono_ns >= stopping.mono_ns)
    # health_not_silent's bound (10 periods of 5 Hz), from the first health to the node's last message
    limit = CheckParams().health_silence_ns
    gaps = [b - a for a, b in zip(health, [*health[1:], last_node], strict=True)]
    assert max(gaps) <= limit, (max(gaps) / 1e9, log[-3000:])
