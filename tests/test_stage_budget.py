"""The per-stage time budget: copy-in, compute and copy-out per frame, published in ``modelOutput`` and
rated against their shares of the 50 ms frame (``node/health.py`` ``StageBudget``, ``docs/health.md``).

Contract: the worker carries a runner's stage times back exactly; the node publishes the primary's,
and the fallback's run time as compute with no copies; a stage whose median over the last frames is
over its budget makes the layer that owns it WARN with a reason naming the stage, its median and its
budget ("slow but alive"), one slow frame does not, and back under budget the layer is OK again after
the layer's hysteresis. The WARN informs (advisory: ``ChestnutActive`` stays true) while the frame
deadline is not at risk, and clears ``ChestnutActive`` when it is: the median run over the 50 ms frame, or
the window's second slowest run over the 150 ms deadline less one 50 ms frame (100 ms); it never fails the
primary over. With real processes: a twin whose GPU starts every unit of work 25 ms late (``slow_gpu``,
three units: a run over the 50 ms frame) turns usb WARN naming copy-in and gpu WARN naming compute, the
deadline at risk, while the primary still answers every frame in time, and both OK after the fault is
cleared.

The runner the worker loads from this file (``KnownStagesRunner``) reports stage times it is given;
nothing here asserts a duration, only levels, reasons and the values that were reported.
"""

from __future__ import annotations

import os
import select
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chestnut.backend.errors import Layer
from chestnut.backend.interface import DockObservation, LadderReport, ModelSpec
from chestnut.backend.ladder import LadderConfig
from chestnut.backend.model import TensorSpec
from chestnut.backend.stages import StageClock, StageTimes
from chestnut.node.health import (
    FRAME_PERIOD_S,
    STAGE_SHARES,
    STAGE_SOURCE,
    Evidence,
    HealthMonitor,
    Level,
    StageBudget,
    chestnut_active,
    evidence_from_run,
)
from chestnut.node.main import FrameResult, published_stages
from chestnut.node.policy import Answer
from chestnut.node.runner_loader import RunnerSpec
from chestnut.node.supervisor import Source
from chestnut.node.wire import result_payload, stages_from_payload
from chestnut.node.worker_handle import WorkerHandle

HERE = Path(__file__).resolve()
MS = 1_000_000  # ns
FAST = StageTimes(0.0012, 0.0030, 0.0004)
SLOW_IN = StageTimes(0.0312, 0.0030, 0.0004)
SLOW_GPU_MS = 25.0  # twin slow_gpu: each unit of work starts this late (a copy-in chunk, OP_RUN, a copy-out piece)


def feed(budget: StageBudget, health: HealthMonitor, stages: StageTimes, n: int, t_ns: int,
         run_s: float | None = None) -> int:
    """``n`` frames 50 ms apart from ``t_ns``, each a completed run (``run_s``, s; None: the stages' sum) plus
    the budget's evidence; the next time."""
    for _ in range(n):
        ok = Evidence(Layer.OUTPUT, Level.OK, "output valid")
        run = stages.total if run_s is None else run_s
        health.apply([*evidence_from_run(run * 1e3), ok, *budget.observe(stages, t_ns, run_s)], t_ns)
        t_ns += 50 * MS
    return t_ns


# ---------------------------------------------------------------- the budget, pure
def test_the_budgets_are_shares_of_the_50_ms_frame_that_add_up_to_it() -> None:
    b = StageBudget()
    assert FRAME_PERIOD_S == 0.05 and sum(STAGE_SHARES.values()) == pytest.approx(1.0)
    assert [round(b.budget_s(s) * 1e3, 6) for s in ("copy_in", "compute", "copy_out")] == [20.0, 15.0, 15.0]
    with pytest.raises(ValueError, match="stage shares"):
        StageBudget(shares={"copy_in": 0.5, "compute": 0.5})
    with pytest.raises(ValueError, match="min_frames"):
        StageBudget(window=4, min_frames=5)


def test_a_slow_copy_in_is_a_usb_warn_naming_the_stage_its_median_and_its_budget() -> None:
    b = StageBudget()
    assert [b.observe(SLOW_IN, i * 50 * MS) for i in range(4)] == [[], [], [], []]  # fewer than 5 frames: no verdict
    usb, gpu = b.observe(SLOW_IN, 4 * 50 * MS)
    assert usb == Evidence(
        Layer.USB,
        Level.WARN,
        "slow but alive: copy-in p50 31.2 ms > 20 ms budget of 50 ms frame (median of the last 5 frames); deadline "
        "not at risk: run p50 34.6 ms <= 50 ms frame, 2nd slowest 34.6 ms <= 100 ms (150 ms deadline - 50 ms frame)",
        tag="slow_copy_in",
        source=STAGE_SOURCE,
        counted=False,
        advisory=True,
    )
    assert gpu == Evidence(
        Layer.GPU,
        Level.OK,
        "within budget: compute p50 3.0 ms <= 15 ms budget of 50 ms frame (median of the last 5 frames)",
        source=STAGE_SOURCE,
        counted=False,
    )


def test_a_slow_compute_is_a_gpu_warn_and_both_copies_over_are_named_together() -> None:
    """82 ms a frame (25 + 40.5 + 16.5): longer than the 50 ms frame, so the deadline is at risk as well."""
    b = StageBudget()
    for i in range(5):
        ev = b.observe(StageTimes(0.025, 0.0405, 0.0165), i * 50 * MS)
    usb, gpu = ev
    risk = ("deadline at risk: run p50 82.0 ms > 50 ms frame, 2nd slowest 82.0 ms <= 100 ms (150 ms deadline - 50 ms "
            "frame)")
    assert (usb.level, usb.tag, usb.advisory, usb.reason) == (
        Level.WARN,
        "deadline_at_risk",
        False,
        f"{risk}; slow but alive: copy-in p50 25.0 ms > 20 ms budget of 50 ms frame; copy-out p50 "
        "16.5 ms > 15 ms budget of 50 ms frame (median of the last 5 frames)",
    )
    assert (gpu.layer, gpu.level, gpu.tag, gpu.advisory, gpu.reason) == (
        Layer.GPU,
        Level.WARN,
        "deadline_at_risk",
        False,
        f"{risk}; slow but alive: compute p50 40.5 ms > 15 ms budget of 50 ms frame (median of the last 5 frames)",
    )


def test_one_slow_frame_is_not_a_slow_stage() -> None:
    b = StageBudget()
    for i in range(19):
        b.observe(FAST, i * 50 * MS)
    usb, gpu = b.observe(StageTimes(0.5, 0.5, 0.5), 19 * 50 * MS)
    assert (usb.level, gpu.level) == (Level.OK, Level.OK)
    assert usb.reason == (
        "within budget: copy-in p50 1.2 ms <= 20 ms budget of 50 ms frame; copy-out p50 0.4 ms "
        "<= 15 ms budget of 50 ms frame (median of the last 20 frames)"
    )


def test_frames_older_than_the_window_age_are_not_judged() -> None:
    b = StageBudget()
    for i in range(10):
        b.observe(SLOW_IN, i * 50 * MS)
    # the primary served again after a 5 s gap: the old slow frames are gone, one new frame is no verdict
    assert b.observe(FAST, 5_000 * MS + 9 * 50 * MS) == []


def test_the_usb_layer_is_warn_while_frames_complete_and_ok_again_after_the_window_clears() -> None:
    h, b = HealthMonitor(), StageBudget()
    t = feed(b, h, FAST, 20, 0)
    assert h.status(Layer.USB).level is Level.OK and chestnut_active(h, Source.PRIMARY) == (True, "all layers OK")
    t = feed(b, h, SLOW_IN, 10, t)  # 10 of 20 slow: the median is still under budget
    assert h.status(Layer.USB).level is Level.OK
    t = feed(b, h, SLOW_IN, 1, t)  # 11 of 20: over
    usb = h.status(Layer.USB)
    assert (usb.level, usb.advisory, usb.reason) == (
        Level.WARN,
        True,
        "slow but alive: copy-in p50 31.2 ms > 20 ms budget of 50 ms frame (median of the last 20 frames); deadline "
        "not at risk: run p50 34.6 ms <= 50 ms frame, 2nd slowest 34.6 ms <= 100 ms (150 ms deadline - 50 ms frame)",
    )
    assert usb.counters["slow_copy_in"] == 1 and usb.counters["faults"] == 0
    assert h.status(Layer.GPU).level is Level.OK
    # the WARN informs: ChestnutActive stays true and says why it is shown; it is no fault either
    assert chestnut_active(h, Source.PRIMARY) == (True, f"all layers OK; advisory: usb WARN: {usb.reason}")
    t = feed(b, h, SLOW_IN, 9, t)  # every frame slow: still WARN, the completed runs do not mask it
    assert h.status(Layer.USB).level is Level.WARN
    t = feed(b, h, FAST, 9, t)  # 9 fast of 20: the median is still a slow frame's
    assert h.status(Layer.USB).level is Level.WARN
    t = feed(b, h, FAST, 2, t)  # 10 and 11 fast: the median is under budget, but the WARN holds (hysteresis)
    assert h.status(Layer.USB).level is Level.WARN
    t = feed(b, h, FAST, 1, t)  # the 3rd OK from the budget in a row (recover_after): OK
    usb = h.status(Layer.USB)
    assert (usb.level, usb.reason) == (Level.OK, "transfers complete")
    assert chestnut_active(h, Source.PRIMARY) == (True, "all layers OK")
    assert usb.counters["slow_copy_in"] == 1 + 9 + 9


def test_the_budgets_rating_of_a_frame_is_no_extra_observation_towards_recovery() -> None:
    """A frame is one good observation however many sources rate it: a gpu ERROR still takes
    ``recover_after`` (3) completed frames to clear, not 2 with the budget's OK beside each run's."""
    h, b = HealthMonitor(), StageBudget()
    t = feed(b, h, FAST, 10, 0)
    h.apply([Evidence(Layer.GPU, Level.ERROR, "3 consecutive deadline misses", hard=True, tag="deadline_miss_run")], t)
    t = feed(b, h, FAST, 2, t + 50 * MS)
    gpu = h.status(Layer.GPU)
    assert (gpu.level, gpu.reason) == (Level.ERROR, "3 consecutive deadline misses (recovering: 2/3 good)")
    feed(b, h, FAST, 1, t)
    assert h.status(Layer.GPU).level is Level.OK
    with pytest.raises(ValueError, match="always counted"):
        Evidence(Layer.GPU, Level.ERROR, "x", counted=False)


def test_the_budget_warn_expires_when_the_primary_stops_answering() -> None:
    """While the fallback serves there is no stage evidence: the condition stops being current (1 s)."""
    h, b = HealthMonitor(), StageBudget()
    t = feed(b, h, SLOW_IN, 20, 0)
    assert h.status(Layer.USB).level is Level.WARN
    h.apply([Evidence(Layer.USB, Level.OK, "dock enumerated", source="probe", fresh_ms=2500.0)], t + 1_100 * MS)
    assert h.status(Layer.USB).level is Level.OK


# ---------------------------------------------------------------- slow but alive, or the deadline at risk
SLOW_COMPUTE = StageTimes(0.0012, 0.0165, 0.0004)  # the case: compute 16.5 ms of a 15 ms share
RISK = "2nd slowest {slow} ms {op} 100 ms (150 ms deadline - 50 ms frame)"
GPU_SLOW = "slow but alive: compute p50 16.5 ms > 15 ms budget of 50 ms frame (median of the last 20 frames)"


def test_chestnut_active_stays_true_while_a_stage_is_over_its_share_and_drops_when_the_deadline_is_at_risk() -> None:
    h, b = HealthMonitor(), StageBudget()
    t = feed(b, h, SLOW_COMPUTE, 20, 0, run_s=0.020)
    gpu = h.status(Layer.GPU)
    advisory = f"{GPU_SLOW}; deadline not at risk: run p50 20.0 ms <= 50 ms frame, " + RISK.format(slow="20.0", op="<=")
    assert (gpu.level, gpu.advisory, gpu.reason) == (Level.WARN, True, advisory)
    assert gpu.counters["slow_compute"] == 16  # the 5th to the 20th frame
    assert chestnut_active(h, Source.PRIMARY) == (True, f"all layers OK; advisory: gpu WARN: {advisory}")
    t = feed(b, h, SLOW_COMPUTE, 1, t, run_s=0.120)  # one frame within a frame of its deadline: a busy host's noise
    assert chestnut_active(h, Source.PRIMARY)[0] is True
    changed = h.status(Layer.GPU).last_change_ns
    t = feed(b, h, SLOW_COMPUTE, 1, t, run_s=0.120)  # two in the window: the deadline is at risk
    gpu = h.status(Layer.GPU)
    at_risk = (f"deadline at risk: run p50 20.0 ms <= 50 ms frame, {RISK.format(slow='120.0', op='>')}; "
               + GPU_SLOW)
    assert (gpu.level, gpu.advisory, gpu.reason, gpu.counters["deadline_at_risk"]) == (Level.WARN, False, at_risk, 1)
    assert gpu.last_change_ns == t - 50 * MS > changed  # the level stayed WARN; its advisory flag changed
    assert chestnut_active(h, Source.PRIMARY) == (False, f"gpu WARN: {at_risk}")
    assert gpu.counters["faults"] == 0  # no failover: the primary keeps serving
    t = feed(b, h, SLOW_COMPUTE, 18, t, run_s=0.020)  # both slow frames still among the last 20
    assert chestnut_active(h, Source.PRIMARY)[0] is False
    feed(b, h, SLOW_COMPUTE, 1, t, run_s=0.020)  # the first has left the window: advisory again, at once
    assert chestnut_active(h, Source.PRIMARY) == (True, f"all layers OK; advisory: gpu WARN: {advisory}")


def test_a_run_longer_than_the_frame_is_at_risk_and_blamed_on_the_gpu_when_no_stage_is_over() -> None:
    """A median run over the 50 ms frame: one frame at a time, the node falls behind its camera. Its stages are
    within their shares, so the time is outside them: the gpu layer's, as a deadline miss is."""
    b = StageBudget()
    for i in range(5):
        ev = b.observe(FAST, i * 50 * MS, run_s=0.060)
    usb, gpu = ev
    assert (usb.level, usb.advisory) == (Level.OK, False)
    assert gpu == Evidence(
        Layer.GPU,
        Level.WARN,
        "deadline at risk: run p50 60.0 ms > 50 ms frame, 2nd slowest 60.0 ms <= 100 ms (150 ms deadline - 50 ms "
        "frame); no stage over its share: compute p50 3.0 ms <= 15 ms budget of 50 ms frame (median of the last 5 "
        "frames)",
        tag="deadline_at_risk",
        source=STAGE_SOURCE,
        counted=False,
    )
    risk = b.risk(4 * 50 * MS)
    assert risk is not None
    assert (risk.p50_s, risk.slow_s, risk.bound_s, risk.at_risk) == (0.060, 0.060, pytest.approx(0.1, abs=1e-12), True)
    assert b.risk(10_000 * MS) is None  # too old to rate
    with pytest.raises(ValueError, match="deadline_s"):
        StageBudget(deadline_s=0.0)
    with pytest.raises(ValueError, match="only a WARN"):
        Evidence(Layer.GPU, Level.OK, "x", advisory=True)


def test_a_configured_deadline_moves_the_bound() -> None:
    """``timing.deadline_ms`` 300: two runs of 200 and 220 ms among 40 ms ones are within 250 ms; at 150, not."""
    verdicts = []
    for deadline_s in (0.3, 0.15):
        b = StageBudget(deadline_s=deadline_s)
        for i, run_s in enumerate((0.040, 0.200, 0.040, 0.220, 0.040)):
            ev = b.observe(SLOW_COMPUTE, i * 50 * MS, run_s=run_s)
        risk = b.risk(4 * 50 * MS)
        assert risk is not None
        verdicts.append((ev[1].tag, ev[1].advisory, risk.describe()))
    assert verdicts == [
        ("slow_compute", True, "run p50 40.0 ms <= 50 ms frame, 2nd slowest 200.0 ms <= 250 ms (300 ms deadline - "
         "50 ms frame)"),
        ("deadline_at_risk", False, "run p50 40.0 ms <= 50 ms frame, 2nd slowest 200.0 ms > 100 ms (150 ms deadline - "
         "50 ms frame)"),
    ]


@pytest.mark.parametrize(("period_s", "runs_s", "want"), [
    # 10 Hz: the full-size twin's runs (55-83 ms) never hold the next frame back: not at risk
    (0.1, (0.055, 0.083, 0.060, 0.062, 0.058),
     ("slow_compute", True, "run p50 60.0 ms <= 100 ms frame, 2nd slowest 62.0 ms <= 125 ms ((150 ms deadline + 100 "
      "ms frame) / 2)")),
    # 10 Hz: two runs of 130 ms hold their next frames back 30 ms each: 160 ms, past the deadline
    (0.1, (0.060, 0.130, 0.060, 0.130, 0.060),
     ("deadline_at_risk", False, "run p50 60.0 ms <= 100 ms frame, 2nd slowest 130.0 ms > 125 ms ((150 ms deadline + "
      "100 ms frame) / 2)")),
    # 5 Hz: no frame waits behind a run within the deadline
    (0.2, (0.060, 0.140, 0.060, 0.145, 0.060),
     ("slow_compute", True, "run p50 60.0 ms <= 200 ms frame, 2nd slowest 140.0 ms <= 150 ms (150 ms deadline)")),
    # 20 Hz, openpilot's: the deadline less one frame, as ever
    (0.05, (0.040, 0.101, 0.040, 0.102, 0.040),
     ("deadline_at_risk", False, "run p50 40.0 ms <= 50 ms frame, 2nd slowest 101.0 ms > 100 ms (150 ms deadline - "
      "50 ms frame)")),
], ids=["10Hz-fits", "10Hz-at-risk", "5Hz-fits", "20Hz-at-risk"])
def test_the_bound_follows_the_cameras_frame_period(period_s: float, runs_s: tuple[float, ...],
                                                      want: tuple[str, bool, str]) -> None:
    """``timing.frame_period_ms`` (``chestnut launch --rate``): a run ``r`` holds the next frame back ``r - P``
    (at most one period), and ``r`` plus that must stay within the deadline (:attr:`RiskVerdict.bound_s`)."""
    b = StageBudget(period_s)
    slow = StageTimes(0.0012, 0.6 * period_s, 0.0004)  # compute over its 30 % share: advisory unless at risk
    for i, run_s in enumerate(runs_s):
        ev = b.observe(slow, i * 50 * MS, run_s=run_s)
    risk = b.risk(4 * 50 * MS)
    assert risk is not None
    assert (ev[1].tag, ev[1].advisory, risk.describe()) == want


def test_an_advisory_warn_is_published_and_active_beside_it_keeps_the_contract(tmp_path: Path) -> None:
    """``LayerHealth.advisory`` crosses the wire; ``chestnut check``'s ``active_only_when_healthy`` accepts a
    true ``chestnutActive`` beside an advisory WARN and reports it beside a WARN that is not advisory."""
    from drivelog import write_drive

    from chestnut.msgs.messaging import new_message
    from chestnut.node.health import fill_health
    from chestnut.node.offline.contracts import CheckParams, check_timeline
    from chestnut.node.offline.timeline import read_timeline

    def log(advisory: bool, d: Path) -> list[str]:
        h, b = HealthMonitor(), StageBudget()
        t = feed(b, h, SLOW_COMPUTE, 20, 0, run_s=0.020 if advisory else 0.060)
        base = 5_000_000 * MS
        hm = new_message("chestnutHealth")
        hm.logMonoTime = base + t
        fill_health(hm.chestnutHealth, h)
        gpu = hm.chestnutHealth.layers[2]
        assert (str(gpu.layer), str(gpu.level), gpu.advisory) == ("gpu", "warn", advisory)
        am = new_message("chestnutActive")
        am.logMonoTime = base + t + 10 * MS
        am.chestnutActive.active, am.chestnutActive.source, am.chestnutActive.reason = True, "primary", "all layers OK"
        write_drive([(base + t, "chestnutHealth", hm.to_bytes()),
                     (base + t + 10 * MS, "chestnutActive", am.to_bytes())], d)
        tl = read_timeline(d)
        assert tl.healths[0].layer("gpu").usable is advisory
        return [v.message for v in check_timeline(tl, CheckParams(), only=["active_only_when_healthy"])]

    assert log(True, tmp_path / "advisory") == []
    (v,) = log(False, tmp_path / "at_risk")
    assert v.startswith("chestnutActive true while gpu is WARN (deadline at risk: run p50 60.0 ms > 50 ms frame"), v


# ---------------------------------------------------------------- the wire and what is published
def test_stage_times_cross_the_wire_exactly_and_a_bad_payload_is_a_protocol_error() -> None:
    st = StageTimes(0.0312, 0.0041, 0.0007)
    assert stages_from_payload(result_payload(st)) == st
    assert result_payload(None) == b"" and stages_from_payload(b"") is None
    assert len(result_payload(st)) == 24
    for bad in (
        struct.pack("<2d", 0.1, 0.2),  # too short
        struct.pack("<3d", 0.1, 0.2, 0.3) + b"\0",  # too long
        struct.pack("<3d", 0.1, -0.2, 0.3),  # a negative time
        struct.pack("<3d", 0.1, float("nan"), 0.3),
        struct.pack("<3d", 0.1, 0.2, float("inf")),
        b'{"stages": [0.1, 0.2, 0.3]}',  # the JSON form of an older worker
    ):
        with pytest.raises(ValueError):
            stages_from_payload(bad)


def test_the_primary_publishes_its_stages_and_the_fallback_its_run_time_as_compute() -> None:
    st = StageTimes(0.0312, 0.0041, 0.0007)
    primary = FrameResult(Answer(Source.PRIMARY, {}, 0.036, True, ""), stages=st)
    assert published_stages(primary) == st
    fallback = FrameResult(Answer(Source.FALLBACK, {}, 0.0031, True, "fallback serving"), stages=None)
    assert published_stages(fallback) == StageTimes(0.0, 0.0031, 0.0)
    untimed = FrameResult(Answer(Source.PRIMARY, {}, 0.002, True, ""))  # a runner that does not time its stages
    assert published_stages(untimed) == StageTimes(0.0, 0.002, 0.0)
    assert published_stages(FrameResult(Answer(Source.NONE, None, 0.0, False, "bad frame"))) == StageTimes()


def test_the_stage_clock_sums_the_parts_of_a_stage_and_forgets_a_failed_run() -> None:
    c = StageClock()
    c.begin()
    c.add("copy_in", 0.25)
    c.add("copy_in", 0.5)
    c.add("compute", 0.125)
    assert c.end() == StageTimes(0.75, 0.125, 0.0) == c.last
    c.begin()
    c.add("copy_in", 0.25)  # the run raised before end(): nothing to report
    assert c.last is None


# ---------------------------------------------------------------- through the worker process
X_SPEC = TensorSpec("x", (2,), "float32")
Y_SPEC = TensorSpec("y", (2,), "float32")


class KnownStagesRunner:
    """x float32[2] -> y = x; the stage times it reports are x[0], x[1] and 0.0007 s (it takes none of
    them); x[0] = -1 raises."""

    kind = "known-stages"

    def __init__(self) -> None:
        self.stages = StageClock()

    def qualify(self) -> LadderReport:
        return LadderReport([])

    def load(self, model: ModelSpec) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        return (X_SPEC,), (Y_SPEC,)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        self.stages.begin()
        if float(x[0]) == -1.0:
            raise ValueError("no stages for this one")
        self.stages.add("copy_in", float(x[0]))
        self.stages.add("compute", float(x[1]))
        self.stages.add("copy_out", 0.0007)
        self.stages.end()
        return {"y": x.copy()}

    def probe(self) -> DockObservation:
        return DockObservation(True, (0xADD1, 0x0001), (4, 7), 5000, 0, 0x78)

    def close(self) -> None:
        pass


def test_the_worker_carries_the_runners_stage_times_back_exactly() -> None:
    h = WorkerHandle()
    h.start(
        RunnerSpec(f"{HERE}:KnownStagesRunner"),
        ModelSpec(Path("known.onnx"), "known"),
        LadderConfig(require_fingerprint=False),
    )
    try:
        deadline = time.monotonic() + 60
        while not h.poll_ready():
            assert h.start_error is None, h.start_error
            assert time.monotonic() < deadline, "worker not ready in time"
            select.select([h], [], [], 0.1)
        got = []
        for seq, x in enumerate(([0.0312, 0.0041], [0.25, 1.5], [-1.0, 0.0]), start=1):
            h.submit(seq, {"x": np.array(x, np.float32)})
            r = h.poll_result(timeout_s=30)
            assert r is not None and r.seq == seq
            got.append((r.ok, r.stages))
    finally:
        h.stop()
    f32 = [float(np.float32(v)) for v in (0.0312, 0.0041)]
    assert got == [(True, StageTimes(f32[0], f32[1], 0.0007)), (True, StageTimes(0.25, 1.5, 0.0007)), (False, None)]


# ---------------------------------------------------------------- the runners' own timing
def test_the_real_runners_stages_are_the_spans_its_copy_timer_rates(tiny_onnx: Path, tmp_path: Path) -> None:
    """``DockJit.call`` as the real runner calls it, on the host CPU: the stage clock and the copy timer time
    the same spans (tinygrad's copy-in, the JIT's launch to ``synchronize``, the copy-out)."""
    from chestnut.backend.jitcache import JitCache
    from chestnut.backend.model import ensure_cpu_device

    ensure_cpu_device()
    from chestnut.backend.real_runner import CopyTimer, load_or_build_jit

    dj = load_or_build_jit(
        tiny_onnx.read_bytes(),
        "tiny",
        (TensorSpec("x", (1, 3, 32, 64), "float32"),),
        "CPU",
        "gfx1100",
        JitCache(tmp_path / "jit"),
    )
    timer, clock = CopyTimer(), StageClock()
    dj.call({"x": np.zeros((1, 3, 32, 64), np.float32)}, timer, clock)
    st = clock.last
    assert st is not None
    assert timer.fences == [st.compute * 1e3]
    assert timer.recent[("in", 32768)] == [pytest.approx(24576 / st.copy_in / 1e6, rel=1e-9)]
    assert st.copy_out > 0  # the 2048-byte output is not rated (under 4096 bytes), but it is timed


def test_the_twin_runner_puts_each_late_unit_of_work_in_its_own_stage(tiny_onnx: Path) -> None:
    """``slow_gpu`` starts each unit of work late: the input's one copy-in chunk, ``OP_RUN`` and the output's
    one copy-out piece; each stage holds at least that delay (a lower bound: load only adds to it)."""
    from chestnut.backend.errors import ModelError
    from chestnut.backend.sim.client import running_twin
    from chestnut.backend.sim.usb3 import forget_device_lists
    from chestnut.backend.twin_runner import TwinRunner

    prefix = os.environ["CHESTNUT_PREFIX"]
    with running_twin(prefix) as client:
        r = TwinRunner(prefix, config=LadderConfig(stability_window_s=0.05))
        try:
            r.load(ModelSpec(tiny_onnx, "tiny"))
            x = {"x": np.zeros((1, 3, 32, 64), np.float32)}
            r.run(x)
            assert r.stages.last is not None
            client.fault("slow_gpu", delay_ms=SLOW_GPU_MS)
            r.run(x)
            late = r.stages.last
            client.clear()
            assert late is not None
            assert min(late.copy_in, late.compute, late.copy_out) >= SLOW_GPU_MS / 1e3, late
            with pytest.raises(ModelError):
                r.run({"x": np.zeros((1, 3, 8, 8), np.float32)})
            assert r.stages.last is None  # a run that raised reports no stages
        finally:
            r.close()
    forget_device_lists()


# ---------------------------------------------------------------- the node on the twin


class Taps:
    """The node's modelOutput and chestnutHealth, with stage times and counters (the test's own subscribers)."""

    def __init__(self, prefix: str) -> None:
        import zmq

        from chestnut.msgs.messaging import sub_sock

        self.poller = zmq.Poller()
        self.socks = {s: sub_sock(s, self.poller, prefix=prefix) for s in ("modelOutput", "chestnutHealth")}
        self.outputs: list[dict[str, Any]] = []
        self.health: list[dict[str, tuple[str, str, dict[str, int]]]] = []

    def pump(self) -> None:
        from chestnut.msgs.messaging import drain_sock

        self.poller.poll(50)
        for ev in drain_sock(self.socks["modelOutput"]):
            m = ev.modelOutput
            self.outputs.append(
                {
                    "frame": int(m.frameId),
                    "source": str(m.source),
                    "missed": bool(m.deadlineMissed),
                    "stages": (m.copyInTime, m.computeTime, m.copyOutTime),
                    "exec": m.executionTime,
                }
            )
        for ev in drain_sock(self.socks["chestnutHealth"]):
            self.health.append(
                {
                    str(la.layer): (str(la.level), str(la.reason), {c.name: int(c.value) for c in la.counters})
                    for la in ev.chestnutHealth.layers
                }
            )

    def wait(self, pred: Any, timeout_s: float, what: str, log: Any) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            self.pump()
            got = pred(self)
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{log()}")

    def close(self) -> None:
        for s in self.socks.values():
            s.close(linger=0)


def _levels(t: Taps) -> tuple[str, str] | None:
    if not t.health:
        return None
    last = t.health[-1]
    return last["usb"][0], last["gpu"][0]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_slow_dock_is_usb_and_gpu_warn_naming_the_stages_while_the_primary_answers_in_time(tmp_path: Path) -> None:
    sys.path.insert(0, str(HERE.parent))
    from nodeharness import Bus, NodeProcess, tiny_8x16_twin_config

    from chestnut.backend.sim.client import TwinDaemon
    from chestnut.msgs.paths import runtime_dir

    # an 8x16 model: its 1.5 KB input and 128 B output are below the copy timer's rated size (4096 bytes),
    # so the usb layer's reason is the stage budget's alone
    cfg = tiny_8x16_twin_config(tmp_path)
    prefix = os.environ["CHESTNUT_PREFIX"]
    twin = TwinDaemon(prefix).start()
    client = twin.client()
    bus = Bus(prefix, height=8, width=16, rate_hz=8.0)  # 125 ms apart: three 25 ms late units fit between
    bus.start()
    node = NodeProcess(cfg, prefix, tmp_path / "node.log").start()
    taps = Taps(prefix)
    try:
        taps.wait(
            lambda t: _levels(t) == ("ok", "ok") and len(t.outputs) > 5 and t.outputs[-1]["source"] == "primary",
            90,
            "the primary serving with usb and gpu OK",
            node.log_tail,
        )
        client.fault("slow_gpu", delay_ms=SLOW_GPU_MS)
        n_before = len(taps.outputs)
        taps.wait(lambda t: _levels(t) == ("warn", "warn"), 60, "usb and gpu WARN", node.log_tail)
        usb_level, usb_reason, usb_counters = taps.health[-1]["usb"]
        gpu_level, gpu_reason, gpu_counters = taps.health[-1]["gpu"]
        # three units 25 ms late: a run over the 50 ms frame, so the deadline is at risk, and the stages are named
        assert usb_reason.startswith("deadline at risk: run p50 ") and "; slow but alive: copy-in p50 " in usb_reason
        assert " ms > 20 ms budget of 50 ms frame" in usb_reason, usb_reason
        assert gpu_reason.startswith("deadline at risk: run p50 ") and "; slow but alive: compute p50 " in gpu_reason
        assert " ms > 15 ms budget of 50 ms frame" in gpu_reason, gpu_reason
        assert usb_counters["deadline_at_risk"] >= 1 and gpu_counters["deadline_at_risk"] >= 1
        assert usb_counters["faults"] == 0 and gpu_counters["faults"] == 0
        during = taps.outputs[n_before:]
        # slow but alive: every frame still answered by the primary, none past its deadline
        assert during and {(o["source"], o["missed"]) for o in during} == {("primary", False)}, during[-3:]
        # a late-starting unit of work is at least that late: the published stages carry it
        assert all(o["stages"][0] >= SLOW_GPU_MS / 1e3 for o in during[-3:]), during[-3:]
        client.clear()
        taps.wait(lambda t: _levels(t) == ("ok", "ok"), 60, "usb and gpu OK after the fault", node.log_tail)
        assert taps.health[-1]["usb"][1] != usb_reason
        assert "primary_fault" not in node.log_tail(200_000)
    finally:
        taps.close()
        bus.close()
        node.kill()
        client.close_connection()
        twin.stop()
        shutil.rmtree(runtime_dir(prefix), ignore_errors=True)
