"""Per-layer health and ChestnutActive as pure code: debouncing, hysteresis, staleness, evidence, messages."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chestnut.backend.errors import ConfigError, GpuLayerError, Layer, ModelError, PcieLayerError, UsbLayerError
from chestnut.backend.interface import DockObservation, LadderReport, LadderStep, StepResult
from chestnut.msgs.schema import log
from chestnut.node.health import (
    LADDER_FRESH_MS,
    LAYERS,
    PROBE_FRESH_MS,
    ActiveFlag,
    DebounceConfig,
    Evidence,
    HealthMonitor,
    LayerChange,
    LayerMonitor,
    LayerStatus,
    Level,
    chestnut_active,
    evidence_from_error,
    evidence_from_ladder,
    evidence_from_observation,
    evidence_from_run,
    evidence_from_transfers,
    evidence_from_validity,
    evidence_from_watchdog,
    fill_active,
    fill_health,
    worst,
)
from chestnut.node.supervisor import Source
from chestnut.node.validity import Check, CheckResult, ValidityReport
from chestnut.node.watchdog import ActionKind, WatchdogAction

MS = 1_000_000
OK, WARN, ERROR, STALE = Level.OK, Level.WARN, Level.ERROR, Level.STALE


def ev(layer, level, reason="r", hard=False, tag=""):
    return Evidence(layer, level, reason, hard, tag)


def all_ok(mon: HealthMonitor, now_ns: int) -> None:
    mon.apply([ev(la, OK, "fine") for la in LAYERS], now_ns)


# ---------------------------------------------------------------- levels


def test_levels_are_the_schema_wire_values():
    assert {lv.name.lower(): int(lv) for lv in Level} == dict(log.Level.schema.enumerants)


def test_worst_ranks_error_above_stale():
    assert worst([OK, STALE, ERROR, WARN]) is ERROR
    assert worst([OK, STALE, WARN]) is STALE
    assert worst([OK, WARN]) is WARN
    assert worst([]) is OK
    assert max([ERROR, STALE]) is STALE  # the trap worst() exists for


@given(st.lists(st.sampled_from(list(Level)), min_size=1))
def test_worst_is_one_of_them_and_no_less_severe_than_any(levels):
    w = worst(levels)
    assert w in levels and all(w.severity >= lv.severity for lv in levels)


def test_stale_is_never_evidence():
    with pytest.raises(ValueError, match="STALE is inferred"):
        Evidence(Layer.USB, STALE, "x")


# ---------------------------------------------------------------- one layer


def test_a_layer_without_evidence_is_stale():
    m = LayerMonitor(Layer.GPU)
    assert (m.level, m.reason) == (STALE, "no evidence yet")
    assert m.refresh(5 * MS) is None


def test_first_good_evidence_makes_the_layer_ok_at_once():
    m = LayerMonitor(Layer.GPU)
    assert m.observe(ev(Layer.GPU, OK, "fence advanced"), 7 * MS) == LayerChange(Layer.GPU, STALE, OK, "fence advanced",
                                                                                  7 * MS)
    s = m.status()
    assert (s.level, s.reason, s.last_change_ns, s.last_evidence_ns) == (OK, "fence advanced", 7 * MS, 7 * MS)


def test_a_hard_error_expires_at_once():
    m = LayerMonitor(Layer.PCIE)  # fail_after=2 for soft evidence
    m.observe(ev(Layer.PCIE, OK), 0)
    ch = m.observe(ev(Layer.PCIE, ERROR, "pcie_link: PCIe link not up", hard=True, tag="pcie_link"), 3 * MS)
    assert ch == LayerChange(Layer.PCIE, OK, ERROR, "pcie_link: PCIe link not up", 3 * MS)
    s = m.status()
    assert s.counters == {"observations": 2, "bad": 1, "faults": 1, "recoveries": 0, "stale": 0, "pcie_link": 1,
                          "bad_run": 1, "good_run": 0}


def test_soft_errors_are_debounced_over_fail_after_consecutive_observations():
    m = LayerMonitor(Layer.PCIE)  # openpilot: PCIe failed after two consecutive bad LTSSM reads
    m.observe(ev(Layer.PCIE, OK, "LTSSM=0x78"), 0)
    assert m.observe(ev(Layer.PCIE, ERROR, "LTSSM=0x00", tag="ltssm"), 1 * MS) is None
    assert (m.level, m.reason, m.bad_run) == (OK, "LTSSM=0x78", 1)
    assert m.observe(ev(Layer.PCIE, OK, "LTSSM=0x78"), 2 * MS) is None  # the run is broken
    assert m.observe(ev(Layer.PCIE, ERROR, "LTSSM=0x00", tag="ltssm"), 3 * MS) is None
    ch = m.observe(ev(Layer.PCIE, ERROR, "LTSSM=0x4c", tag="ltssm"), 4 * MS)
    assert ch == LayerChange(Layer.PCIE, OK, ERROR, "LTSSM=0x4c", 4 * MS)
    assert m.counters["ltssm"] == 3 and m.counters["faults"] == 1


def test_recovery_takes_recover_after_consecutive_good_observations():
    m = LayerMonitor(Layer.GPU, DebounceConfig(recover_after=3))
    m.observe(ev(Layer.GPU, ERROR, "fence_stall", hard=True), 0)
    assert m.observe(ev(Layer.GPU, OK, "fence advanced"), 1 * MS) is None
    assert (m.level, m.reason) == (ERROR, "fence_stall (recovering: 1/3 good)")
    m.observe(ev(Layer.GPU, OK, "fence advanced"), 2 * MS)
    m.observe(ev(Layer.GPU, ERROR, "hang", hard=True), 3 * MS)  # a relapse restarts the count
    m.observe(ev(Layer.GPU, OK, "fence advanced"), 4 * MS)
    m.observe(ev(Layer.GPU, OK, "fence advanced"), 5 * MS)
    assert (m.level, m.reason) == (ERROR, "hang (recovering: 2/3 good)")
    assert m.observe(ev(Layer.GPU, OK, "fence advanced"), 6 * MS) == LayerChange(Layer.GPU, ERROR, OK,
                                                                                  "fence advanced", 6 * MS)
    assert (m.counters["faults"], m.counters["recoveries"]) == (1, 1)  # the relapse was inside one fault


def test_an_error_held_until_reported_is_published_once_even_when_it_clears_between_reports():
    mon = HealthMonitor(hold_until_reported=True)
    all_ok(mon, 0)
    mon.reported(0)
    mon.apply([ev(Layer.PCIE, ERROR, "LTSSM=0x00 (link down)", hard=True)], 10 * MS)
    for t in (20, 30, 40, 50):  # the recovery is earned between two reports
        mon.apply([ev(Layer.PCIE, OK, "LTSSM=0x78 (link up)")], t * MS)
    s = mon.status(Layer.PCIE)
    assert (s.level, s.reason, s.last_change_ns) == (
        ERROR, "LTSSM=0x00 (link down) (recovered: 4 good; shown until reported)", 10 * MS)
    assert mon.reported(200 * MS) == [LayerChange(Layer.PCIE, ERROR, OK, "LTSSM=0x78 (link up)", 200 * MS)]
    s = mon.status(Layer.PCIE)
    assert (s.level, s.last_change_ns, s.counters["faults"], s.counters["recoveries"]) == (OK, 200 * MS, 1, 1)
    # a report while still recovering does not shorten the recovery: recover_after good ones still clear it
    mon.apply([ev(Layer.GPU, ERROR, "fence_stall", hard=True)], 300 * MS)
    assert mon.reported(310 * MS) == []
    assert mon.status(Layer.GPU).reason == "fence_stall"  # a report of a current fault leaves its reason as it is
    mon.apply([ev(Layer.GPU, OK, "fence advanced")], 320 * MS)
    assert mon.status(Layer.GPU).level is ERROR
    mon.apply([ev(Layer.GPU, OK, "fence advanced")] * 2, 330 * MS)
    assert mon.status(Layer.GPU).level is OK


def test_without_the_hold_an_error_clears_without_a_report():
    mon = HealthMonitor()
    all_ok(mon, 0)
    mon.apply([ev(Layer.PCIE, ERROR, "down", hard=True)] + [ev(Layer.PCIE, OK, "up")] * 3, 10 * MS)
    assert mon.status(Layer.PCIE).level is OK


def test_recovery_through_warn_evidence_lands_on_warn():
    m = LayerMonitor(Layer.USB, DebounceConfig(recover_after=2))
    m.observe(ev(Layer.USB, ERROR, "disconnect", hard=True), 0)
    m.observe(ev(Layer.USB, WARN, "480 Mbps"), 1 * MS)
    assert m.observe(ev(Layer.USB, OK, "5000 Mbps"), 2 * MS).new is WARN  # 2 usable, only 1 OK in a row
    assert m.observe(ev(Layer.USB, OK, "5000 Mbps"), 3 * MS) == LayerChange(Layer.USB, WARN, OK, "5000 Mbps", 3 * MS)


def test_warn_applies_at_once_and_clears_with_hysteresis():
    m = LayerMonitor(Layer.USB, DebounceConfig(recover_after=2))
    m.observe(ev(Layer.USB, OK, "ok"), 0)
    assert m.observe(ev(Layer.USB, WARN, "480 Mbps", tag="slow_link"), 1 * MS).new is WARN
    assert m.observe(ev(Layer.USB, OK, "ok"), 2 * MS) is None
    assert m.observe(ev(Layer.USB, OK, "ok"), 3 * MS).new is OK
    assert m.counters["slow_link"] == 1


def test_a_layer_without_fresh_evidence_goes_stale_and_comes_back():
    m = LayerMonitor(Layer.GPU, DebounceConfig(stale_after_ms=1000))
    m.observe(ev(Layer.GPU, OK, "fence advanced"), 10 * MS)
    assert m.refresh(1010 * MS) is None  # exactly the window: still fresh
    ch = m.refresh(1010 * MS + 1)
    assert ch == LayerChange(Layer.GPU, OK, STALE, "no evidence for 1000 ms (window 1000 ms)", 1010 * MS + 1)
    assert m.status().last_change_ns == 1010 * MS + 1 and m.counters["stale"] == 1
    assert m.observe(ev(Layer.GPU, OK, "fence advanced"), 2000 * MS).new is OK


def test_an_error_does_not_expire_by_silence():
    m = LayerMonitor(Layer.GPU, DebounceConfig(stale_after_ms=1000))
    m.observe(ev(Layer.GPU, ERROR, "hang", hard=True), 0)
    assert m.refresh(3600 * 1000 * MS) is None
    assert (m.level, m.reason) == (ERROR, "hang")


def test_evidence_for_another_layer_is_refused():
    with pytest.raises(ValueError, match="evidence for usb given to the gpu layer"):
        LayerMonitor(Layer.GPU).observe(ev(Layer.USB, OK), 0)


# ---------------------------------------------------------------- the monitor and ChestnutActive


def test_monitor_starts_all_stale_and_inactive():
    mon = HealthMonitor()
    assert [s.level for s in mon.statuses()] == [STALE] * 4 and mon.overall is STALE
    assert chestnut_active(mon, Source.PRIMARY) == (False, "usb STALE: no evidence yet")


def test_chestnut_active_only_with_all_layers_ok_and_the_primary_serving():
    mon = HealthMonitor()
    all_ok(mon, 0)
    assert chestnut_active(mon, Source.PRIMARY) == (True, "all layers OK")
    assert chestnut_active(mon, Source.FALLBACK) == (False, "fallback serving, not the primary")
    assert chestnut_active(mon, Source.NONE) == (False, "none serving, not the primary")
    mon.apply([ev(Layer.OUTPUT, ERROR, "prob: 1 non-finite value(s) (1 NaN, 0 inf), first at (0, 0, 0, 0)",
                  hard=True)], 1 * MS)
    assert chestnut_active(mon, Source.PRIMARY) == (
        False, "output ERROR: prob: 1 non-finite value(s) (1 NaN, 0 inf), first at (0, 0, 0, 0)")
    mon.apply([ev(Layer.PCIE, WARN, "slow completions")], 2 * MS)
    # the most severe layer names the cause, not the lowest: the output ERROR stays the reason
    assert chestnut_active(mon, Source.PRIMARY) == (
        False, "output ERROR: prob: 1 non-finite value(s) (1 NaN, 0 inf), first at (0, 0, 0, 0)")
    assert mon.first_not_ok().layer is Layer.PCIE and mon.overall is ERROR


def test_chestnut_active_names_the_most_severe_layer_then_the_lowest():
    """A pcie ERROR stays the reason while the usb layer goes STALE behind the dead worker it speaks through."""
    def active(**levels: Level) -> tuple[bool, str]:
        return chestnut_active([LayerStatus(la, levels.get(la.value, OK), f"{la.value} why") for la in LAYERS],
                               Source.PRIMARY)

    assert active(usb=STALE, pcie=ERROR) == (False, "pcie ERROR: pcie why")
    assert active(usb=WARN, output=STALE) == (False, "output STALE: output why")
    assert active(usb=ERROR, gpu=ERROR) == (False, "usb ERROR: usb why")
    assert active(pcie=WARN, gpu=WARN) == (False, "pcie WARN: pcie why")


def test_chestnut_active_treats_a_missing_layer_as_not_ok():
    statuses = [LayerStatus(la, OK, "ok") for la in LAYERS if la is not Layer.GPU]
    assert chestnut_active(statuses, Source.PRIMARY) == (False, "gpu: no status")


@given(st.lists(st.sampled_from(list(Level)), min_size=4, max_size=4), st.sampled_from(list(Source)))
def test_chestnut_active_iff_all_ok_and_primary(levels, source):
    statuses = [LayerStatus(la, lv, "why") for la, lv in zip(LAYERS, levels, strict=True)]
    active, reason = chestnut_active(statuses, source)
    assert active == (all(lv is OK for lv in levels) and source is Source.PRIMARY)
    assert (reason == "all layers OK") == active


evidence_st = st.builds(
    Evidence, st.sampled_from(LAYERS), st.sampled_from([OK, WARN, ERROR]), st.sampled_from(["a", "b"]),
    st.booleans(), st.sampled_from(["", "t"]))


@settings(max_examples=200)
@given(st.lists(st.tuples(st.lists(evidence_st, max_size=4), st.integers(0, 1500)), max_size=40),
       st.sampled_from(list(Source)))
def test_monitor_invariants_over_random_evidence(steps, source):
    mon = HealthMonitor()
    now = 0
    history: dict[Layer, list[Evidence]] = {la: [] for la in LAYERS}
    for evidence, dt_ms in steps:
        now += dt_ms * MS
        for e in evidence:
            history[e.layer].append(e)
        mon.apply(evidence, now)
        active, _ = chestnut_active(mon, source)
        statuses = mon.statuses()
        assert not active or (source is Source.PRIMARY and all(s.level is OK for s in statuses))
        for s in statuses:
            seen = history[s.layer]
            if s.level is ERROR:  # only ever after bad evidence
                assert any(e.level is ERROR for e in seen)
            if seen and seen[-1].level is ERROR and seen[-1].hard:  # a hard error always shows at once
                assert s.level is ERROR
            if not seen:
                assert s.level is STALE
            assert s.last_change_ns <= now and s.last_evidence_ns <= now


# ---------------------------------------------------------------- evidence


def test_typed_errors_are_hard_evidence_against_their_layer():
    e = evidence_from_error(GpuLayerError("fence_stall", "Wait timeout: 3000 ms! (fence 7, expected 8)"))
    assert e == Evidence(Layer.GPU, ERROR, "fence_stall: Wait timeout: 3000 ms! (fence 7, expected 8)", True,
                         "fence_stall")
    assert evidence_from_error(UsbLayerError("disconnect")) == Evidence(Layer.USB, ERROR, "disconnect", True,
                                                                        "disconnect")
    assert evidence_from_error(PcieLayerError("tlp", "UR")).layer is Layer.PCIE
    assert evidence_from_error(ModelError("missing_model", "x.onnx")) is None
    assert evidence_from_error(ConfigError("firmware", "cache empty")) is None


def test_ladder_gives_one_observation_per_reached_layer():
    report = LadderReport([
        LadderStep("usb_ids", Layer.USB, StepResult.PASS, 0.01, "0xadd1:0x0001 custom"),
        LadderStep("link_speed", Layer.USB, StepResult.WARN, 0.0, "480 Mbps"),
        LadderStep("link_stability", Layer.USB, StepResult.PASS, 2.0, "0 errors/s"),
        LadderStep("ltssm", Layer.PCIE, StepResult.FAIL, 0.5, "LTSSM=0x4c after power-on", "power-cycle the dock"),
        LadderStep("gpu_arch", Layer.GPU, StepResult.SKIPPED),
    ])
    assert evidence_from_ladder(report) == [
        Evidence(Layer.USB, WARN, "link_speed: 480 Mbps", False, "link_speed", "ladder", LADDER_FRESH_MS),
        Evidence(Layer.PCIE, ERROR, "ltssm: LTSSM=0x4c after power-on (power-cycle the dock)", True, "ltssm",
                 "ladder", LADDER_FRESH_MS),
    ]
    passed = LadderReport([LadderStep("gpu_arch", Layer.GPU, StepResult.PASS, 0.1, "gfx1100")])
    assert evidence_from_ladder(passed) == [Evidence(Layer.GPU, OK, "gpu_arch: gfx1100", source="ladder",
                                                     fresh_ms=LADDER_FRESH_MS)]


def test_watchdog_actions_as_evidence():
    miss = WatchdogAction(ActionKind.ANSWER_FROM_FALLBACK, "deadline", "frame 3: late", 0, 3)
    assert evidence_from_watchdog(miss) == Evidence(Layer.GPU, WARN, "frame 3: late", False, "deadline_miss")
    gone = WatchdogAction(ActionKind.ANSWER_FROM_FALLBACK, "worker", "worker gone with frame 3 unanswered", 0, 3)
    assert evidence_from_watchdog(gone) is None
    assert evidence_from_watchdog(WatchdogAction(ActionKind.DISCARD_LATE, "deadline", "late", 0, 3)) is None
    hang = WatchdogAction(ActionKind.KILL_WORKER, "hang", "worker hung", 0, 3, Layer.GPU)
    assert evidence_from_watchdog(hang) == Evidence(Layer.GPU, ERROR, "worker hung", True, "hang")
    run = WatchdogAction(ActionKind.FAIL_OVER, "deadline", "3 consecutive", 0, None, Layer.GPU)
    assert evidence_from_watchdog(run) == Evidence(Layer.GPU, ERROR, "3 consecutive", True, "deadline_miss_run")
    alive = WatchdogAction(ActionKind.KILL_WORKER, "alive", "heartbeat lost", 0, None, Layer.GPU)
    assert evidence_from_watchdog(alive).tag == "heartbeat_lost"
    logical = WatchdogAction(ActionKind.KILL_WORKER, "logical", "out of order", 0, None, Layer.OUTPUT)
    assert evidence_from_watchdog(logical) == Evidence(Layer.OUTPUT, ERROR, "out of order", True, "logical")


def test_a_returned_run_is_good_evidence_for_the_three_dock_layers():
    assert evidence_from_run(12.345) == [
        Evidence(Layer.USB, OK, "transfers complete"),
        Evidence(Layer.PCIE, OK, "TLP completions good"),
        Evidence(Layer.GPU, OK, "fences advanced; run took 12.3 ms"),
    ]


def test_validity_as_evidence_keeps_the_checks_severity():
    good = ValidityReport((CheckResult(Check.FINITE, "prob", True, "ok"),))
    assert evidence_from_validity(good) == Evidence(Layer.OUTPUT, OK, "output valid")
    stale = ValidityReport((CheckResult(Check.STALE, "", False, "identical"),))
    assert evidence_from_validity(stale) == Evidence(Layer.OUTPUT, ERROR, "identical", False, "stale")
    nan = ValidityReport((CheckResult(Check.FINITE, "prob", False, "NaN"),))
    assert evidence_from_validity(nan) == Evidence(Layer.OUTPUT, ERROR, "NaN", True, "finite")


def test_dock_observations_as_evidence():
    assert evidence_from_observation(DockObservation(False)) == [
        Evidence(Layer.USB, ERROR, "no Chestnut dock enumerated", True, "absent")]
    slow = DockObservation(True, (0xADD1, 0x0001), (2, 7), 480, 0, 0x78)
    assert evidence_from_observation(slow) == [
        Evidence(Layer.USB, WARN, "add1:0001 at bus 2 address 7 at 480 Mbps, USB 2, not SuperSpeed "
                 "(large reads time out, bulk writes truncate, copies ~10x slower)", False, "slow_link", "probe",
                 PROBE_FRESH_MS),
        Evidence(Layer.PCIE, OK, "LTSSM=0x78 (link up)", source="probe", fresh_ms=PROBE_FRESH_MS),
    ]
    stuck = DockObservation(True, (0xADD1, 0x0001), (2, 7), 10000, 0, 0x4C)
    assert evidence_from_observation(stuck, fresh_ms=700) == [
        Evidence(Layer.USB, OK, "add1:0001 at bus 2 address 7 at 10000 Mbps", source="probe", fresh_ms=700),
        Evidence(Layer.PCIE, ERROR, "LTSSM=0x4c, not 0x78 (stuck in 0x4C: known firmware failure)", False, "ltssm",
                 "probe", 700),
    ]
    assert evidence_from_observation(DockObservation(True)) == [Evidence(Layer.USB, OK, "dock", source="probe",
                                                                         fresh_ms=PROBE_FRESH_MS)]


# ---------------------------------------------------------------- messages


def test_fill_health_round_trips_through_the_schema():
    mon = HealthMonitor()
    all_ok(mon, 5 * MS)
    mon.apply([ev(Layer.GPU, ERROR, "fence_stall: Wait timeout", hard=True, tag="fence_stall")], 9 * MS)
    msg = log.Event.new_message()
    fill_health(msg.init("chestnutHealth"), mon)
    with log.Event.from_bytes(msg.to_bytes()) as r:
        h = r.chestnutHealth
        assert [str(x.layer) for x in h.layers] == ["usb", "pcie", "gpu", "output"]
        assert [str(x.level) for x in h.layers] == ["ok", "ok", "error", "ok"]
        assert str(h.overall) == "error"
        gpu = h.layers[2]
        assert gpu.reason == "fence_stall: Wait timeout"
        assert (gpu.lastChange, gpu.lastEvidence) == (9 * MS, 9 * MS)
        assert {c.name: c.value for c in gpu.counters} == {
            "observations": 2, "bad": 1, "faults": 1, "recoveries": 0, "stale": 0, "fence_stall": 1,
            "bad_run": 1, "good_run": 0}
        assert (h.layers[0].lastChange, h.layers[0].reason) == (5 * MS, "fine")


def test_active_flag_tracks_since_and_says_when_to_publish_at_once():
    flag = ActiveFlag(0)
    assert flag.update(False, "usb STALE: no evidence yet", Source.NONE, 1 * MS) is False
    assert flag.update(False, "fallback serving, not the primary", Source.FALLBACK, 2 * MS) is True  # source changed
    assert flag.since_ns == 0
    assert flag.update(True, "all layers OK", Source.PRIMARY, 3 * MS) is True and flag.since_ns == 3 * MS
    assert flag.update(True, "all layers OK", Source.PRIMARY, 4 * MS) is False and flag.since_ns == 3 * MS
    assert flag.update(False, "gpu ERROR: hang", Source.PRIMARY, 5 * MS) is True and flag.since_ns == 5 * MS
    msg = log.Event.new_message()
    fill_active(msg.init("chestnutActive"), flag)
    with log.Event.from_bytes(msg.to_bytes()) as r:
        a = r.chestnutActive
        assert (a.active, str(a.source), a.reason, a.since) == (False, "primary", "gpu ERROR: hang", 5 * MS)


# ---------------------------------------------------------------- conditions per evidence source


def probe_ev(level, reason, tag=""):
    return Evidence(Layer.USB, level, reason, tag=tag, source="probe", fresh_ms=PROBE_FRESH_MS)


def test_a_condition_that_still_holds_keeps_its_level_however_many_frames_complete():
    """A USB 2 link: every 1 Hz probe says 480 Mbps, every 20 Hz frame says its transfers completed. The layer
    is WARN throughout (the worst current condition), not WARN/OK by turns (the latest sample)."""
    m = LayerMonitor(Layer.USB)
    levels = []
    for i in range(200):  # 10 s at 20 Hz
        now = i * 50 * MS
        if i % 20 == 0:
            m.observe(probe_ev(WARN, "480 Mbps, not SuperSpeed", "slow_link"), now)
        m.observe(ev(Layer.USB, OK, "transfers complete"), now)
        levels.append((m.level, m.reason))
    assert set(levels) == {(WARN, "480 Mbps, not SuperSpeed")}
    assert m.counters["slow_link"] == 10


def test_a_source_clears_its_own_warn_with_hysteresis_and_others_cannot():
    m = LayerMonitor(Layer.USB, DebounceConfig(recover_after=3))
    m.observe(probe_ev(WARN, "480 Mbps"), 0)
    for t in range(1, 10):
        m.observe(ev(Layer.USB, OK, "transfers complete"), t * MS)
    assert m.level is WARN
    m.observe(probe_ev(OK, "5000 Mbps"), 1000 * MS)
    assert (m.level, m.reason) == (WARN, "480 Mbps")
    m.observe(probe_ev(OK, "5000 Mbps"), 2000 * MS)
    assert m.observe(probe_ev(OK, "5000 Mbps"), 2100 * MS) == LayerChange(Layer.USB, WARN, OK, "5000 Mbps",
                                                                          2100 * MS)


def test_a_silent_source_stops_counting_after_its_own_freshness():
    m = LayerMonitor(Layer.USB, DebounceConfig(stale_after_ms=1000))
    m.observe(probe_ev(WARN, "480 Mbps"), 0)
    m.observe(ev(Layer.USB, OK, "transfers complete"), 2400 * MS)
    assert m.refresh(int(PROBE_FRESH_MS) * MS) is None and m.level is WARN
    assert m.refresh(int(PROBE_FRESH_MS) * MS + 1).new is OK
    ch = m.refresh(3400 * MS + 1)  # the frames' evidence is 1000 ms old too
    assert ch == LayerChange(Layer.USB, OK, STALE, "no evidence for 1000 ms (window 1000 ms)", 3400 * MS + 1)


def test_an_error_still_needs_good_observations_to_clear_and_then_shows_the_worst_condition():
    m = LayerMonitor(Layer.USB, DebounceConfig(recover_after=2))
    m.observe(probe_ev(WARN, "480 Mbps"), 0)
    m.observe(ev(Layer.USB, ERROR, "disconnect", hard=True), 1 * MS)
    m.observe(ev(Layer.USB, OK, "transfers complete"), 2 * MS)
    assert (m.level, m.reason) == (ERROR, "disconnect (recovering: 1/2 good)")
    assert m.observe(ev(Layer.USB, OK, "transfers complete"), 3 * MS).new is WARN  # the probe's WARN still holds


def test_a_usb2_link_never_lets_chestnut_active_flap():
    """The node's evidence on a USB 2 link for 20 s (issue: ChestnutActive changed 38 times and said 'all layers
    OK'): frames at 20 Hz with their run evidence, probes at 1 Hz. ChestnutActive never turns true."""
    mon, flag = HealthMonitor(), ActiveFlag(0)
    changes = 0
    slow = DockObservation(True, (0xADD1, 0x0001), (2, 7), 480, 0, 0x78)
    for i in range(400):
        now = i * 50 * MS
        evidence = evidence_from_run(12.0) + [ev(Layer.GPU, OK, "fences"), ev(Layer.OUTPUT, OK, "output valid")]
        if i % 20 == 0:
            evidence += evidence_from_observation(slow)
        mon.apply(evidence, now)
        active, reason = chestnut_active(mon, Source.PRIMARY)
        changes += flag.update(active, reason, Source.PRIMARY, now) and i > 0
        assert not active and reason.startswith("usb WARN: add1:0001 at bus 2 address 7 at 480 Mbps"), (i, reason)
    assert changes == 0


# ---------------------------------------------------------------- transient errors and the ladder's failures


def test_transient_errors_within_the_field_rate_are_counted_above_it_warn_with_the_rate():
    quiet = {"attempts": 9000, "errors": 40, "retried_ok": 40, "not_retried": 0, "window_s": 60.0,
             "errors_in_window": 13, "last_error": "control IN 0xE4: transfer_timeout"}
    assert evidence_from_transfers(quiet) == Evidence(
        Layer.USB, OK, "13 transient transfer errors in the last 60 s (780/h, within the 815/h of working docks)",
        source="transfers", fresh_ms=PROBE_FRESH_MS,
        counters=(("transient_errors", 40), ("transient_retried", 40), ("transient_not_retried", 0)))
    busy = dict(quiet, errors_in_window=14)
    e = evidence_from_transfers(busy, fresh_ms=900)
    assert (e.level, e.tag, e.source, e.fresh_ms) == (WARN, "transient_error_rate", "transfers", 900)
    assert e.reason == ("14 transient transfer errors in the last 60 s (840/h, above the 815/h of working docks "
                        "(openpilot#38519); 40 retried in all; last: control IN 0xE4: transfer_timeout")
    m = LayerMonitor(Layer.USB)
    m.observe(e, 0)
    assert (m.level, m.counters["transient_errors"], m.counters["transient_retried"]) == (WARN, 40, 40)


def test_a_probe_carries_the_transient_error_counters_into_the_usb_layer():
    obs = DockObservation(True, (0xADD1, 0x0001), (2, 7), 5000, 0, 0x78,
                          extra={"transient_errors": {"errors": 2, "retried_ok": 2, "not_retried": 0,
                                                      "window_s": 60.0, "errors_in_window": 2, "last_error": ""}})
    got = evidence_from_observation(obs)
    assert [(e.layer, e.level, e.source) for e in got] == [(Layer.USB, OK, "probe"), (Layer.USB, OK, "transfers"),
                                                           (Layer.PCIE, OK, "probe")]
    assert got[1].reason.startswith("2 transient transfer errors in the last 60 s (120/h")


WEDGED_LOAD = ("UsbLayerError no_answer: 3 consecutive transfer attempts timed out (bound 3); the device is still "
               "there: a vanished one fails LIBUSB_ERROR_NO_DEVICE; last: control IN 0xE4: RuntimeError: "
               "libusb_control_transfer: Operation timed out")


def test_a_usb_error_during_the_model_load_counts_against_usb_not_gpu():
    report = LadderReport([
        LadderStep("usb_ids", Layer.USB, StepResult.PASS, 0.01, "0xADD1:0x0001"),
        LadderStep("gpu_arch", Layer.GPU, StepResult.PASS, 0.1, "gfx1100"),
        LadderStep("model_loaded", Layer.GPU, StepResult.FAIL, 0.2, WEDGED_LOAD, "a transfer got no answer",
                   "no_answer"),
    ])
    assert [(e.layer, e.level) for e in evidence_from_ladder(report)] == [(Layer.USB, ERROR), (Layer.GPU, OK)]
    assert evidence_from_ladder(report)[0].reason == f"model_loaded: {WEDGED_LOAD} (a transfer got no answer)"


def test_every_probe_read_of_the_stability_window_timing_out_is_named_a_wedged_bridge():
    detail = ("UsbLayerError unstable_link: 8.6 errors/s over 0.58 s (counter +0, 5/5 probe reads failed), above 5/s; "
              "last: transfer_timeout: USBTimeoutError: [Errno 110] Operation timed out")
    report = LadderReport([
        LadderStep("usb_ids", Layer.USB, StepResult.PASS, 0.01, "0xADD1:0x0001 at bus 3 address 9"),
        LadderStep("link_stability", Layer.USB, StepResult.FAIL, 0.6, detail,
                   "reseat or replace the USB cable; avoid hubs; check the dock's power supply", "unstable_link"),
    ])
    usb, pcie = evidence_from_ladder(report)
    # the cable and the enumeration are fine (the product string answered); the bridge, the dock's PCIe end, is not
    assert (usb.layer, usb.level, usb.reason) == (Layer.USB, OK, "usb_ids: 0xADD1:0x0001 at bus 3 address 9")
    assert (pcie.layer, pcie.level, pcie.hard, pcie.tag, pcie.source) == (Layer.PCIE, ERROR, True, "link_stability",
                                                                          "ladder")
    assert pcie.reason == (f"link_stability: bridge_wedged: {detail} (power-cycle the dock (unplug its power, or "
                           "`chestnut twin power-cycle` on the twin): a wedged bridge answers nothing until then; "
                           "replugging the cable or another port does not help)")
    flaky = LadderStep("link_stability", Layer.USB, StepResult.FAIL, 0.6, detail.replace("5/5", "3/5"), "reseat",
                       "unstable_link")
    assert evidence_from_ladder(LadderReport([flaky]))[0].reason.startswith("link_stability: UsbLayerError unstable")


# ---------------------------------------------------------------- blame on the right layer


def test_a_bridge_wedged_while_loading_is_the_pcie_layers_error_with_its_remedy():
    """The retry wrapper's verdict on a load whose every transfer timed out while the bridge's own register did
    not answer either (backend/retry.py): the usb steps passed (the dock enumerated, its product string
    answered), the model load's failure counts against pcie, with the power-cycle remedy."""
    from chestnut.backend.classify import advice_for

    err = PcieLayerError("bridge_wedged", "3 consecutive transfer attempts timed out (bound 3); ...")
    report = LadderReport([
        LadderStep("usb_ids", Layer.USB, StepResult.PASS, 0.01, "0xADD1:0x0001 at bus 3 address 9"),
        LadderStep("link_speed", Layer.USB, StepResult.PASS, 0.0, "SuperSpeed, 5000 Mbps"),
        LadderStep("model_loaded", Layer.GPU, StepResult.FAIL, 0.3, f"PcieLayerError {err}", advice_for(err),
                   "bridge_wedged", err),
    ])
    usb, pcie = evidence_from_ladder(report)
    assert (usb.layer, usb.level) == (Layer.USB, OK)
    assert (pcie.layer, pcie.level, pcie.hard, pcie.tag) == (Layer.PCIE, ERROR, True, "model_loaded")
    assert pcie.reason == ("model_loaded: PcieLayerError bridge_wedged: 3 consecutive transfer attempts timed out "
                           "(bound 3); ... (power-cycle the dock (unplug its power, or `chestnut twin power-cycle` on "
                           "the twin): a wedged bridge answers nothing until then; replugging the cable or another "
                           "port does not help)")
    ev = evidence_from_error(err)
    assert ev is not None and (ev.layer, ev.level, ev.hard, ev.tag) == (Layer.PCIE, ERROR, True, "bridge_wedged")


def test_a_usb2_link_is_the_usb_layers_warn_from_the_first_step_with_its_speed():
    report = LadderReport([
        LadderStep("usb_ids", Layer.USB, StepResult.PASS, 0.01, "0xADD1:0x0001 at bus 3 address 9"),
        LadderStep("link_speed", Layer.USB, StepResult.WARN, 0.0, "480 Mbps, USB 2, below SuperSpeed (5000 Mbps)"),
    ])
    (usb,) = evidence_from_ladder(report)
    assert (usb.layer, usb.level, usb.reason, usb.tag) == (
        Layer.USB, WARN, "link_speed: 480 Mbps, USB 2, below SuperSpeed (5000 Mbps)", "link_speed")
    m = LayerMonitor(Layer.USB)
    m.observe(usb, 0)
    probe = evidence_from_observation(DockObservation(True, (0xADD1, 0x0001), (3, 9), 480))
    assert (m.level, m.reason) == (WARN, "link_speed: 480 Mbps, USB 2, below SuperSpeed (5000 Mbps)")
    # the node's own enumerations while the worker loads (one a second) take over before the ladder's evidence
    # expires: WARN all along, never STALE
    for t_ms in range(1000, 13000, 1000):
        m.observe(probe[0], t_ms * MS)
        m.refresh(t_ms * MS + 500 * MS)
        assert m.level is WARN and "480 Mbps, USB 2" in m.reason, (t_ms, m.level, m.reason)
    assert m.reason == ("add1:0001 at bus 3 address 9 at 480 Mbps, USB 2, not SuperSpeed (large reads time out, bulk "
                        "writes truncate, copies ~10x slower)")


def test_a_fence_stall_on_a_usb2_link_is_blamed_on_usb_not_gpu():
    """A 12 s load on a USB 2 link whose copy-in drain gave up: the slow (or truncating) link, not the GPU."""
    from chestnut.backend.classify import blame_slow_link
    from chestnut.backend.ladder import Outcome, Step, run_steps

    drain = "GPU failed to drain USB copyin chunk 3 (10s, hung GPU?)"

    def load() -> Outcome:
        raise RuntimeError(drain)

    report = LadderReport([
        LadderStep("link_speed", Layer.USB, StepResult.WARN, 0.0, "480 Mbps, USB 2, below SuperSpeed (5000 Mbps)"),
    ])
    run_steps([Step("model_loaded", 120.0, load)], report)
    step = report.step("model_loaded")
    assert (step.reason, type(step.error).__name__, step.error.layer) == ("slow_link", "UsbLayerError", Layer.USB)
    assert step.detail == (f"UsbLayerError slow_link: fence_stall on a 480 Mbps, USB 2 link (copies ~10x slower than "
                           f"SuperSpeed, bulk OUT transfers may be truncated): RuntimeError: {drain}")
    usb = evidence_from_ladder(report)[0]
    assert (usb.layer, usb.level, usb.tag) == (Layer.USB, ERROR, "model_loaded")
    assert not any(e.layer is Layer.GPU for e in evidence_from_ladder(report))
    # the same failure on a SuperSpeed link is the GPU's
    fast = GpuLayerError("fence_stall", drain)
    assert blame_slow_link(fast, 5000) is fast and blame_slow_link(fast, None) is fast
    assert blame_slow_link(GpuLayerError("unsupported_arch", "gfx803"), 480).layer is Layer.GPU
