"""A copy-path usb WARN (slow copies, a slow fence) clears ``ChestnutActive`` only when it speaks against the link:
copies slow for two probes (``SLOW_COPY_SETTLE_S``) while the host was on time (no lateness within
``SLOW_COPY_HOST_LOOKBACK_S``); before that it is advisory, shown with why (``node/policy.py``
``slow_copy_excuse``, ``node/main.py`` ``Node._excuse_slow_copies``). A busy host once made copies run at 0.18 of the
link's first rate and the node called it a marginal link: ChestnutActive fell and the control daemon soft-disabled
with no fault, the host's own health reading "host late" a tenth of a second later."""

from __future__ import annotations

from pathlib import Path

import pytest
from nodeharness import write_node_config

from chestnut.backend.errors import Layer
from chestnut.backend.interface import DockObservation
from chestnut.backend.real_runner import COPY_STATS_KEY
from chestnut.backend.stages import StageTimes
from chestnut.node.config import load_config
from chestnut.node.health import (
    Evidence,
    HealthMonitor,
    Level,
    StageBudget,
    chestnut_active,
    evidence_from_observation,
)
from chestnut.node.main import Node
from chestnut.node.policy import (
    SLOW_COPY_EXCUSE_MAX_S,
    SLOW_COPY_HOST_LOOKBACK_S,
    SLOW_COPY_SETTLE_S,
    run_risk_excuse,
    slow_copy_excuse,
)
from chestnut.node.supervisor import Source

pytestmark = [pytest.mark.timeout(60)]
S = 1_000_000_000
SLOW = {"copies": 40, "rated": 1, "fences": 20, "fence_max_ms": 9.0, "wait_timeout_ms": 3000.0,
        "slowest": {"direction": "in", "bytes": 524288, "mbps": 16.2, "baseline_mbps": 92.7, "ratio": 0.175}}
STEADY = {**SLOW, "slowest": {**SLOW["slowest"], "mbps": 90.0, "ratio": 0.97}}
WARN_REASON = ("copy-in of up to 524288 bytes at 16.2 MB/s, 0.17 of the 92.7 MB/s this link gave it at first "
               "(a marginal link slows before it fails)")


def test_the_rule() -> None:
    assert SLOW_COPY_SETTLE_S == 2.0 and SLOW_COPY_HOST_LOOKBACK_S == 3.0
    assert slow_copy_excuse(0.0, None, "") == "slow for 0.0 s of the 2 s that make a marginal link"
    assert slow_copy_excuse(1.99, None, "") == "slow for 2.0 s of the 2 s that make a marginal link"
    assert slow_copy_excuse(2.0, None, "") == ""
    assert slow_copy_excuse(5.0, 3.1, "host late: loop woke 38 ms late") == ""
    assert slow_copy_excuse(5.0, 3.0, "host late: loop woke 38 ms late") == (
        "host late: loop woke 38 ms late 3.0 s ago: slow copies are the host's, not the link's")
    assert slow_copy_excuse(0.5, 0.0, "host late: x").startswith("host late: x 0.0 s ago")
    assert SLOW_COPY_EXCUSE_MAX_S == 10.0  # a host late every few seconds hides a slow link no longer than this
    assert slow_copy_excuse(9.9, 0.0, "host late: x").startswith("host late: x 0.0 s ago")
    assert slow_copy_excuse(10.0, 0.0, "host late: x") == ""


def _copy_evidence(node: Node, stats: dict, now: int) -> Evidence:
    obs = DockObservation(True, (0xADD1, 1), (3, 7), 5000, None, 0x78, extra={COPY_STATS_KEY: stats})
    out = node._excuse_slow_copies(evidence_from_observation(obs), now)
    (ev,) = [e for e in out if e.source == "copy_path"]
    return ev


def _active(ev: Evidence, now: int) -> bool:
    mon = HealthMonitor()
    for layer in (Layer.USB, Layer.PCIE, Layer.GPU, Layer.OUTPUT):
        mon.apply([Evidence(layer, Level.OK, "ok")], now)
    mon.apply([ev], now)
    return chestnut_active(mon, Source.PRIMARY)[0]


def test_slow_copies_on_an_on_time_host_clear_active_after_two_probes(tmp_path: Path, tiny_onnx: Path) -> None:
    node = Node(load_config(write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none")))
    t0 = 100 * S
    first = _copy_evidence(node, SLOW, t0)
    assert (first.level, first.advisory) == (Level.WARN, True)
    assert first.reason == WARN_REASON + "; advisory: slow for 0.0 s of the 2 s that make a marginal link"
    assert _active(first, t0)
    second = _copy_evidence(node, SLOW, t0 + S)
    assert second.advisory and second.reason.endswith("slow for 1.0 s of the 2 s that make a marginal link")
    third = _copy_evidence(node, SLOW, t0 + 2 * S)
    assert (third.level, third.advisory, third.reason) == (Level.WARN, False, WARN_REASON)
    assert not _active(third, t0 + 2 * S)
    ok = _copy_evidence(node, STEADY, t0 + 3 * S)  # the copies recover: the next slow streak starts anew
    assert ok.level is Level.OK and node.slow_copy_since_ns is None
    assert _copy_evidence(node, SLOW, t0 + 4 * S).advisory


def test_slow_copies_while_the_host_was_late_are_the_hosts(tmp_path: Path, tiny_onnx: Path) -> None:
    node = Node(load_config(write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none")))
    t0 = 100 * S
    _copy_evidence(node, SLOW, t0)
    node.host_late_at_ns, node.host_late_reason = t0 + S, "host late: the twin waited 63 ms for a CPU"
    ev = _copy_evidence(node, SLOW, t0 + 3 * S)  # slow for 3 s, the host late 2 s ago
    assert ev.advisory and ev.reason == (WARN_REASON + "; advisory: host late: the twin waited 63 ms for a CPU "
                                         "2.0 s ago: slow copies are the host's, not the link's")
    assert _active(ev, t0 + 3 * S)
    later = _copy_evidence(node, SLOW, t0 + S + int(3.5 * S))  # the host on time for 3.5 s, the copies still slow
    assert (later.advisory, later.reason) == (False, WARN_REASON)
    assert not _active(later, t0 + S + int(3.5 * S))
    node.host_late_at_ns = t0 + 10 * S  # late again, a tenth of a second before a probe 10 s into the slow copies
    ten = _copy_evidence(node, SLOW, t0 + 10 * S + S // 10)
    assert (ten.advisory, ten.reason) == (False, WARN_REASON)  # slow for 10 s: the link's, however late the host


def test_the_node_records_when_it_last_found_the_host_late(tmp_path: Path, tiny_onnx: Path) -> None:
    node = Node(load_config(write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none")))
    now = 100 * S
    assert node._host_late(now) == "" and node.host_late_at_ns is None
    node.host.loop_woke(now - 40_000_000, now)  # the loop woke 40 ms late
    why = node._host_late(now)
    assert why.startswith("host late: loop woke 40 ms late")
    assert (node.host_late_at_ns, node.host_late_reason) == (now, why)


def test_a_run_at_risk_while_the_host_was_late_is_the_hosts_for_at_most_10_s() -> None:
    assert run_risk_excuse(0.0, None, "host late: x") == ""  # an on-time host: the dock's at once
    assert run_risk_excuse(0.0, 3.1, "host late: x") == ""
    assert run_risk_excuse(9.9, 3.0, "host late: the twin waited 482 ms for a CPU") == (
        "host late: the twin waited 482 ms for a CPU 3.0 s ago: the slow runs are the host's, not the dock's")
    assert run_risk_excuse(10.0, 0.0, "host late: x") == ""


def _risk_evidence(node: Node, budget: StageBudget, now: int, run_s: float) -> list[Evidence]:
    """The node's excused stage-budget evidence after five frames at 20 Hz ending at ``now`` (each run ``run_s``)."""
    for i in range(4, -1, -1):
        out = node._excuse_run_risk(budget.observe(StageTimes(0.002, 0.028, 0.002), now - i * S // 20, run_s),
                                    now - i * S // 20)
    return out


def test_the_node_excuses_a_run_at_risk_only_while_the_host_was_late(tmp_path: Path, tiny_onnx: Path) -> None:
    """The stage budget's "deadline at risk" (median run over the 50 ms frame) on a host that held off the twin:
    advisory, ChestnutActive stays up; the same on an on-time host, or 10 s into the risk, drops it."""
    node = Node(load_config(write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none")))
    budget, t0 = StageBudget(), 100 * S
    assert [node._excuse_run_risk(budget.observe(StageTimes(0.002, 0.028, 0.002), t0, 0.052), t0)
            for _ in range(4)] == [[]] * 4  # the budget is not judging yet
    assert node.run_risk_since_ns is None
    node.host_late_at_ns, node.host_late_reason = t0, "host late: the twin waited 482 ms for a CPU"
    usb, gpu = _risk_evidence(node, budget, t0 + S // 5, 0.052)
    assert (gpu.level, gpu.tag, gpu.advisory) == (Level.WARN, "deadline_at_risk", True)
    assert gpu.reason.endswith("; advisory: host late: the twin waited 482 ms for a CPU 0.2 s ago: the slow runs "
                               "are the host's, not the dock's")
    assert (usb.level, usb.advisory) == (Level.OK, False)
    assert _active(gpu, t0 + S // 5)
    late = _risk_evidence(node, budget, t0 + int(3.5 * S), 0.052)[1]  # the host on time for 3.5 s since
    assert (late.tag, late.advisory) == ("deadline_at_risk", False) and "advisory" not in late.reason
    assert not _active(late, t0 + int(3.5 * S))
    node.host_late_at_ns = t0 + 10 * S
    ten = _risk_evidence(node, budget, t0 + 10 * S + S // 5, 0.052)[1]  # at risk for 10 s: the dock's all the same
    assert (ten.tag, ten.advisory) == ("deadline_at_risk", False)
    ok = _risk_evidence(node, budget, t0 + 11 * S, 0.010)  # the runs are fast again: the streak ends
    assert all(ev.tag != "deadline_at_risk" for ev in ok) and node.run_risk_since_ns is None
