"""End-to-end link evidence: the copy path's own timing and fence waits make a marginal link WARN on usb."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from chestnut.backend.errors import Layer
from chestnut.backend.interface import DockObservation
from chestnut.backend.real_runner import BASELINE_COPIES, COPY_STATS_KEY, COPY_WINDOW, CopyTimer
from chestnut.node.health import (
    HealthMonitor,
    Level,
    evidence_from_copy_timing,
    evidence_from_observation,
    evidence_from_run,
)

MIB = 1 << 20
MS = 1_000_000


def _marginal() -> CopyTimer:
    """1 MiB copy-ins at 262.144 MB/s for the baseline, then a window whose median is an eighth of that
    (with one fast outlier); small copies counted, not rated; a few 900 kB copy-outs (no full window)."""
    t = CopyTimer(wait_timeout_ms=3000)
    for _ in range(BASELINE_COPIES):
        t.copy("in", MIB, 0.004)  # 262.144 MB/s
    t.copy("in", 1000, 0.5)  # under MIN_TIMED_COPY_BYTES
    for _ in range(3):
        t.copy("out", 900_000, 0.004)
    for i in range(COPY_WINDOW):
        t.copy("in", MIB, 0.002 if i == 0 else 0.032)  # 32.768 MB/s, one at 524.288
    t.fence(0.010)
    return t


def test_copy_timer_rates_a_size_class_by_its_medians() -> None:
    s = _marginal().stats()
    assert s == {
        "copies": BASELINE_COPIES + 1 + 3 + COPY_WINDOW,
        "rated": 1,
        "fences": 1,
        "fence_max_ms": 10.0,
        "wait_timeout_ms": 3000.0,
        "slowest": {"direction": "in", "bytes": MIB, "mbps": 32.768, "baseline_mbps": 262.144, "ratio": 0.125},
    }
    assert CopyTimer().stats()["slowest"] is None


def test_one_slow_copy_on_a_busy_host_is_no_marginal_link() -> None:
    t = CopyTimer()
    for i in range(BASELINE_COPIES + COPY_WINDOW):
        t.copy("in", MIB, 0.1 if i == BASELINE_COPIES + 3 else 0.004)  # one copy 25x slower
    s = t.stats()
    assert s["slowest"]["ratio"] == 1.0
    assert evidence_from_copy_timing(s).level is Level.OK


def test_a_busy_host_halving_every_copy_is_no_marginal_link() -> None:
    t = CopyTimer()
    for i in range(BASELINE_COPIES + COPY_WINDOW):
        t.copy("in", MIB, 0.004 if i < BASELINE_COPIES else 0.008)
    s = t.stats()
    assert s["slowest"]["ratio"] == 0.5
    assert evidence_from_copy_timing(s).level is Level.OK


def test_a_link_at_an_eighth_of_its_rate_is_a_usb_warn() -> None:
    ev = evidence_from_copy_timing(_marginal().stats())
    assert (ev.layer, ev.level, ev.tag, ev.source) == (Layer.USB, Level.WARN, "slow_copy", "copy_path")
    assert ev.reason == (
        "copy-in of up to 1048576 bytes at 32.8 MB/s, 0.12 of the 262.1 MB/s this link gave it "
        "at first (a marginal link slows before it fails)"
    )
    assert ev.counters == (("copies", BASELINE_COPIES + 1 + 3 + COPY_WINDOW), ("fences", 1))


def test_a_fence_over_half_the_wait_timeout_is_a_usb_warn_and_a_steady_link_is_ok() -> None:
    t = CopyTimer(wait_timeout_ms=3000)
    for i in range(BASELINE_COPIES + COPY_WINDOW):
        t.copy("in", MIB, 0.004 if i < BASELINE_COPIES else 0.005)
    ok = evidence_from_copy_timing(t.stats())
    assert (ok.level, ok.reason) == (Level.OK, "copies at >= 0.80 of this link's first rate")
    t.fence(1.6)
    ev = evidence_from_copy_timing(t.stats())
    assert (ev.level, ev.tag) == (Level.WARN, "slow_fence")
    assert ev.reason == "a frame's fence took 1600 ms of the 3000 ms wait timeout"


def test_the_usb_layer_stays_warn_while_frames_complete_on_a_marginal_link() -> None:
    obs = DockObservation(True, (0xADD1, 1), (3, 7), 5000, None, 0x78, extra={COPY_STATS_KEY: _marginal().stats()})
    mon = HealthMonitor()
    now = 0
    for _ in range(20):  # probes every 1 s, frames at 20 Hz in between: the condition still holds
        now += 50 * MS
        mon.apply(evidence_from_observation(obs), now)
        for _ in range(19):
            now += 50 * MS
            mon.apply(evidence_from_run(10.0), now)
    st = mon.status(Layer.USB)
    assert st.level is Level.WARN
    assert st.reason.startswith("copy-in of up to 1048576 bytes at 32.8 MB/s")


def test_the_real_runners_code_path_times_copies_and_the_fence(tiny_onnx: Path, tmp_path: Path) -> None:
    """``DockJit.call`` as the real runner calls it, on the host CPU."""
    from chestnut.backend.jitcache import JitCache
    from chestnut.backend.model import TensorSpec, ensure_cpu_device

    ensure_cpu_device()
    from chestnut.backend.real_runner import load_or_build_jit

    dj = load_or_build_jit(
        tiny_onnx.read_bytes(),
        "tiny",
        (TensorSpec("x", (1, 3, 32, 64), "float32"),),
        "CPU",
        "gfx1100",
        JitCache(tmp_path / "jit"),
    )
    timer = CopyTimer()
    dj.call({"x": np.zeros((1, 3, 32, 64), np.float32)}, timer)
    s = timer.stats()
    assert (s["copies"], s["rated"], s["fences"]) == (2, 0, 1)  # no class has a baseline and a window yet
    assert timer.recent == {("in", 32768): timer.recent[("in", 32768)]}  # the 24576-byte input; 2048-byte output not
    assert len(timer.first[("in", 32768)]) == 1
    assert s["fence_max_ms"] is not None and s["fence_max_ms"] >= 0


pytestmark = pytest.mark.timeout(120)
