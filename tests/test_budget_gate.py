"""The stage budget says nothing before it has judged (fewer than ``min_frames`` timed frames), and
``ChestnutActive`` does not rise on a primary that times its stages until it has (``node/health.py``
``StageBudget.pending``, docs/health.md)."""

from __future__ import annotations

import os
import shutil

import pytest

from chestnut.backend.errors import Layer
from chestnut.backend.stages import StageTimes
from chestnut.node.health import HealthMonitor, Level, StageBudget

SLOW_IN = StageTimes(0.0312, 0.0030, 0.0004)  # copy-in over its 20 ms budget
MS = 1_000_000


def test_before_it_has_judged_the_budget_says_nothing_and_names_what_it_waits_for():
    b, h = StageBudget(), HealthMonitor()
    for k in range(4):
        assert b.pending() == f"stage budget not judged yet ({k} of 5 timed primary frames)"
        assert b.observe(SLOW_IN, (1 + k) * 50 * MS) == []  # no OK, no WARN
    assert h.status(Layer.USB).level is Level.STALE  # the level comes from other evidence only: none here
    assert b.pending() == "stage budget not judged yet (4 of 5 timed primary frames)"
    ev = b.observe(SLOW_IN, 250 * MS)
    assert b.pending() == ""
    assert [(e.layer, e.level) for e in ev] == [(Layer.USB, Level.WARN), (Layer.GPU, Level.OK)]


def test_an_old_window_stays_judged():
    b = StageBudget()
    for k in range(5):
        b.observe(SLOW_IN, k * MS)
    assert b.pending() == ""
    assert b.verdicts(10_000 * MS) == []  # too old to rate ...
    assert b.pending() == ""  # ... but the gate is for a primary's first frames only


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_chestnut_active_rises_only_after_the_budget_has_judged(tmp_path):
    from nodeharness import Bus, NodeProcess, tiny_8x16_twin_config

    from chestnut.backend.sim.client import TwinDaemon
    from chestnut.msgs.paths import runtime_dir

    cfg = tiny_8x16_twin_config(tmp_path)
    prefix = os.environ["CHESTNUT_PREFIX"]
    twin = TwinDaemon(prefix).start()
    bus = Bus(prefix, height=8, width=16, rate_hz=10.0)
    bus.start()
    node = NodeProcess(cfg, prefix, tmp_path / "node.log").start()
    try:
        rec = bus.wait_for(lambda r: r if any(a.active for a in r.active) else None, 120.0, "ChestnutActive true")
        log = node.log_tail()
    finally:
        bus.close()
        node.kill()
        twin.stop()
        shutil.rmtree(runtime_dir(prefix), ignore_errors=True)
    first = next(a for a in rec.active if a.active)
    primary = [o for o in rec.outputs if o.source == "primary" and o.mono_ns <= first.mono_ns]
    assert len(primary) >= 5, (primary, log[-2000:])
    gated = [a.reason for a in rec.active if not a.active and a.reason.startswith("stage budget not judged yet")]
    assert gated and gated[0] in {f"stage budget not judged yet ({k} of 5 timed primary frames)" for k in (1, 2, 3, 4)}
