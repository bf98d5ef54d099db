"""Link faults judged honestly, end to end: the twin daemon, ``chestnut run`` as a child process with the tiny
ONNX model, and a camera + control daemon + recorder in this process (``nodeharness.Bus``).

- transient transfer errors are retried inside the frame deadline and counted, not failed over: at one
  transfer in 800 (the field's 0-815 errors per hour, openpilot#38519, scaled up so that seconds show
  dozens of them) the node keeps the primary; at one in ten it fails over on the usb layer at once;
- ``async_error`` fires on the node's own async transfers; on every one of them the node fails over on the
  usb layer;
- a USB 2 link keeps the usb layer WARN and ``ChestnutActive`` false while it lasts, without flapping;
- a bridge wedged while the model loads is named a wedged bridge on the pcie layer with the remedy that works
  (power-cycle the dock), never the cable, the port or a lost receipt.

The 60 s figures at one transfer in a thousand come from ``tests/bench/bench_link_faults.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from nodeharness import (
    Bus,
    NodeProcess,
    NodeStateRec,
    Records,
    record_fingerprint,
    unanswered_frames,
    write_node_config,
)

from chestnut.backend.sim.client import TwinClient, TwinDaemon
from chestnut.msgs.paths import runtime_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

DEADLINE_MS = 150.0           # the per-frame deadline (the node's default)
LATENCY_ALLOWANCE_MS = 600.0  # frame publish -> output beyond the deadline: fallback run + scheduling
NODE_TIMING = {"shadow_frames": 10, "backoff_initial_s": 0.2, "backoff_max_s": 0.5, "flap_max_failovers": 1000,
               "start_timeout_s": 20.0}
POWER_CYCLE_BRIDGE = ("power-cycle the dock (unplug its power, or `chestnut twin power-cycle` on the twin): a wedged "
                      "bridge answers nothing until then; replugging the cable or another port does not help")
WRONG_REMEDIES = ("SuperSpeed", "reseat or replace the USB cable", "receipt was lost")


@dataclass
class Stack:
    prefix: str
    twin: TwinDaemon
    client: TwinClient
    node: NodeProcess
    bus: Bus


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_onnx: Path):
    prefix = f"t{os.getpid()}-linkfaults"
    tmp = tmp_path_factory.mktemp("linkfaults")
    fp = record_fingerprint(tiny_onnx, tmp / "tiny.fingerprint.json")
    cfg = write_node_config(tmp / "node.toml", tiny_onnx, fingerprint=fp, timing=NODE_TIMING)
    twin = TwinDaemon(prefix).start()
    client = twin.client()
    bus = Bus(prefix)
    bus.start()
    node = NodeProcess(cfg, prefix, tmp / "node.log").start()
    try:
        yield Stack(prefix, twin, client, node, bus)
    finally:
        bus.close()
        node.kill()
        client.close_connection()
        twin.stop()
        shutil.rmtree(runtime_dir(prefix), ignore_errors=True)


def serving_primary(st: Stack, timeout_s: float = 60.0) -> Records:
    """Wait until the last outputs come from the primary and the node is active. (ChestnutActive is not waited
    for: on a loaded machine other usb evidence, such as the copy path's rate, may hold a WARN of its own.)"""
    def ok(r: Records) -> Records | None:
        good = (len(r.outputs) >= 3 and all(o.source == "primary" for o in r.outputs[-3:]) and bool(r.states)
                and r.states[-1].state == "active")
        return r if good else None
    try:
        return st.bus.wait_for(ok, timeout_s, "the primary serving")
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- node log ---\n{st.node.log_tail()}") from None


def fresh_worker(st: Stack) -> None:
    """Replace the worker (its transfer counters start from zero) and wait for the primary to serve again."""
    pid = st.bus.snapshot().states[-1].worker_pid
    os.kill(pid, signal.SIGKILL)
    st.bus.wait_for(lambda r: any(s.worker_pid not in (0, pid) for s in r.states), 30.0, "a fresh worker")
    serving_primary(st)


def since(rec: Records, t0: int) -> Records:
    return Records([o for o in rec.outputs if o.mono_ns >= t0], [a for a in rec.active if a.mono_ns >= t0],
                   [h for h in rec.health if h.mono_ns >= t0], [s for s in rec.states if s.mono_ns >= t0], rec.sent)


def failovers(rec: Records) -> list[NodeStateRec]:
    """The node states that enter ``degraded`` (nodeState repeats the current state at 1 Hz: only entries count)."""
    return [s for prev, s in zip([None, *rec.states], rec.states, strict=False)
            if s.state == "degraded" and (prev is None or prev.state != "degraded")]


def reasons(rec: Records) -> list[str]:
    """Every reason the node published: node states, ChestnutActive, each health layer."""
    return ([s.reason for s in rec.states] + [a.reason for a in rec.active]
            + [reason for h in rec.health for _, reason in h.layers.values()])


def fired(st: Stack, kind: str) -> int:
    status = st.client.status()
    return sum(f["fired"] for f in status["faults"] + status["fault_history"] if f["kind"] == kind)


def test_transient_errors_are_retried_and_counted_without_a_failover(stack: Stack) -> None:
    serving_primary(stack)
    t0 = time.monotonic_ns()
    stack.client.fault("timeout", repeat=True, probability=1 / 800, seed=13)
    try:
        # ~1100 transfers/s at 20 Hz (tinygrad's copy-in streams its chunks one arm and fence read each): ~1.4
        # errors/s, 18 of them in ~13 s (later if the machine is slow). The link's bound is 5/s over 2 s
        # (openpilot hardwared): at 1 in 300, 3.6/s, a 2 s window over it came once in a few runs -- the rule
        # working, not a false alarm; at 1 in 800 one in thousands of runs.
        stack.bus.wait_for(lambda _r: fired(stack, "timeout") >= 18, 90.0, "18 timed-out transfers")
    finally:
        stack.client.clear()
    rec = since(stack.bus.snapshot(), t0)
    log = stack.node.log_tail()
    switches = failovers(rec)
    assert len(switches) <= 1, ([s.reason for s in switches], log)
    # the primary answers all but 5 % of the frames, and every frame beyond those is a miss the node blamed on
    # a late host (chestnutHealth.host.lateMisses: on a busy machine the host, not the link, loses frames)
    host = rec.health[-1].host_late_misses - min(h.host_late_misses for h in rec.health)
    fallback = sum(o.source != "primary" for o in rec.outputs)
    assert fallback <= 0.05 * len(rec.outputs) + host, (fallback, host, len(rec.outputs), fired(stack, "timeout"), log)
    assert unanswered_frames(rec)[1] == []
    # more than 14 in the last 60 s: above the 815/h of working docks, so the usb layer warns, with the rate
    warn = stack.bus.wait_for(lambda r: next((h for h in r.health if h.mono_ns >= t0 and h.layers["usb"][0] == "warn"
                                              and "transient transfer errors" in h.layers["usb"][1]), None), 5.0,
                              "the usb layer warning of transient errors")
    assert "above the 815/h of working docks (openpilot#38519)" in warn.layers["usb"][1], warn
    # the next ChestnutActive after the warning (one per answered frame) is false: not all layers OK
    after = stack.bus.wait_for(lambda r: [a for a in r.active if a.mono_ns >= warn.mono_ns] or None, 5.0,
                               "a ChestnutActive after the usb warning")
    assert not any(a.active for a in after), after
    fresh_worker(stack)  # its counters start from zero: the next tests start with a quiet usb layer


def test_a_link_losing_one_transfer_in_ten_fails_over_on_the_usb_layer_at_once(stack: Stack) -> None:
    serving_primary(stack)
    t0 = time.monotonic_ns()
    stack.client.fault("timeout", repeat=True, probability=0.1, seed=7)
    try:
        failover = stack.bus.wait_for(lambda r: next((s for s in r.states if s.mono_ns >= t0
                                                      and s.state == "degraded"), None), 15.0, "the failover")
        rec = since(stack.bus.wait_for(lambda r: r if any(o.mono_ns > failover.mono_ns for o in r.outputs) else None,
                                       5.0, "an output after the failover"), t0)
    finally:
        stack.client.clear()
    log = stack.node.log_tail()
    # on the usb layer: the link's own rules, or the frame deadline first with the link's failures named
    # (node/policy.py miss_run_blame), whichever decides first at the primary's deadline in force
    assert failover.reason.startswith(("primary_fault (usb): unstable_link: ", "primary_fault (usb): no_answer: ")) or (
        failover.reason.startswith("deadline_miss_run (usb): ") and "the link failed" in failover.reason), (
        failover.reason, log)
    # every frame up to the failover was answered by its deadline (+ allowance), the failing ones by the fallback
    late = [(o.frame_id, (o.recv_ns - rec.sent[o.frame_id]) / 1e6) for o in rec.outputs
            if o.mono_ns <= failover.mono_ns + 200_000_000]
    assert late and max(ms for _, ms in late) <= DEADLINE_MS + LATENCY_ALLOWANCE_MS, (late, log)
    assert all(o.valid for o in rec.outputs)
    serving_primary(stack)


def test_async_errors_fire_on_the_nodes_path_and_a_link_failing_every_one_fails_over_on_the_usb_layer(
        stack: Stack) -> None:
    """tinygrad's copy-in sends its SRAM arms, fence reads and chunks asynchronously, and the node's transport
    keeps them so (backend/retry.py): ``async_error`` (LIBUSB_TRANSFER_ERROR on an async transfer) fires on the
    node's own copies. One at a time they are retried; on every async transfer the link is unstable and the node
    fails over, every frame still answered."""
    serving_primary(stack)
    t0 = time.monotonic_ns()
    before = fired(stack, "async_error")
    stack.client.fault("async_error", repeat=True)
    try:
        failover = stack.bus.wait_for(lambda r: next((s for s in r.states if s.mono_ns >= t0
                                                      and s.state == "degraded"), None), 15.0, "the failover")
        rec = since(stack.bus.wait_for(lambda r: r if any(o.mono_ns > failover.mono_ns for o in r.outputs) else None,
                                       5.0, "an output after the failover"), t0)
        n = fired(stack, "async_error") - before
    finally:
        stack.client.clear()
    log = stack.node.log_tail()
    assert failover.reason.startswith("primary_fault (usb): unstable_link: 3 consecutive transfer attempts failed "
                                      "(bound 3); last: async "), (failover.reason, log)
    assert n >= 3, n
    assert unanswered_frames(rec)[1] == [], log
    assert all(o.valid for o in rec.outputs)
    serving_primary(stack)


def test_a_usb2_link_keeps_the_usb_layer_warn_without_flapping(stack: Stack) -> None:
    serving_primary(stack)
    t0 = time.monotonic_ns()
    stack.client.fault("usb2", nbytes=1 << 20)  # bulk OUT kept whole: the primary still serves
    try:
        first = stack.bus.wait_for(lambda r: next((h for h in r.health if h.mono_ns >= t0
                                                   and h.layers["usb"][0] == "warn"), None), 10.0, "usb WARN")

        def settled(r: Records) -> Records | None:
            """Five probes and a hundred frames on the USB 2 link, the last three answered by the primary."""
            rec = since(r, first.mono_ns)
            good = (len(rec.health) >= 5 and len(rec.outputs) >= 100
                    and all(o.source == "primary" for o in rec.outputs[-3:]))
            return rec if good else None

        rec = stack.bus.wait_for(settled, 90.0, "five probes and a hundred frames, the primary serving")
    finally:
        stack.client.clear()
    log = stack.node.log_tail()
    levels = [h.layers["usb"] for h in rec.health]
    assert {lv for lv, _ in levels} == {"warn"}, levels
    assert all("480 Mbps, USB 2" in reason for _, reason in levels), levels
    assert rec.active and not any(a.active for a in rec.active), [a.reason for a in rec.active if a.active]
    assert all(a.reason.startswith("usb WARN: ") and "480 Mbps" in a.reason for a in rec.active), \
        sorted({a.reason for a in rec.active if not a.reason.startswith("usb WARN: ") or "480 Mbps" not in a.reason})
    # The link's WARN never fails the primary over: the only failover allowed is a run of deadline misses, which
    # on the twin under host load is partly the host's by construction (README: the twin's "GPU" computes on the
    # host's CPU, and the test's camera shares it) -- the usb layer's when the copies were most of the dock's time
    # on this link (node/policy.py miss_run_blame), else the gpu's; no share of primary frames is asserted, as it
    # measures the machine's load, not the node.
    assert all(s.reason.startswith("deadline_miss_run (gpu): ") or (
        s.reason.startswith("deadline_miss_run (usb): ") and "on a 480 Mbps, USB 2 link" in s.reason)
        for s in failovers(rec)), \
        ([s.reason for s in failovers(rec)], log)
    assert unanswered_frames(rec)[1] == [], log
    t_clear = time.monotonic_ns()
    stack.bus.wait_for(lambda r: any(h.mono_ns > t_clear and "480 Mbps" not in h.layers["usb"][1] for h in r.health),
                       30.0, "SuperSpeed again: three probes clear the WARN")


def test_a_bridge_wedged_while_loading_is_named_with_the_remedy_that_works(stack: Stack) -> None:
    serving_primary(stack)
    # an earlier test's condition (a USB 2 link's WARN) holds until its source's next probes: start after it
    t_start = time.monotonic_ns()
    stack.bus.wait_for(lambda r: any(h.mono_ns > t_start and not any(w in h.layers["usb"][1] for w in WRONG_REMEDIES)
                                     and "480 Mbps" not in h.layers["usb"][1] for h in r.health), 30.0,
                       "a usb layer no longer speaking of an earlier fault")
    t0 = time.monotonic_ns()
    stack.client.fault("wedged", phase="loading")
    pid = stack.bus.snapshot().states[-1].worker_pid
    os.kill(pid, signal.SIGKILL)  # a fresh worker loads the model: the bridge wedges under it
    try:
        wedged = stack.bus.wait_for(lambda r: next((s for s in r.states if s.mono_ns >= t0
                                                    and "bridge_wedged" in s.reason), None), 30.0,
                                    "a node state naming the wedged bridge")
        time.sleep(1.0)
        rec = since(stack.bus.snapshot(), t0)
    finally:
        stack.client.clear()
        stack.client.power_cycle(0)
    log = stack.node.log_tail()
    # the load's transfers find it (the retry wrapper reads the bridge's own register) or the next ladder's
    # stability window does: either way the bridge's, the pcie layer's, not the cable's
    assert wedged.state == "degraded" and wedged.reason.startswith(
        ("load_failed (pcie): bridge_wedged: ", "qualify_failed (pcie): bridge_wedged: ")), (wedged.reason, log)
    named = [a.reason for a in rec.active if "bridge_wedged" in a.reason]
    assert named and all(r.startswith(("pcie ERROR: model_loaded: PcieLayerError bridge_wedged: ",
                                       "pcie ERROR: link_stability: PcieLayerError bridge_wedged: "))
                         and r.endswith(f"({POWER_CYCLE_BRIDGE})") for r in named), (named, log)
    wrong = [r for r in reasons(rec) if any(w in r for w in WRONG_REMEDIES)]
    assert wrong == [], wrong
    assert not any("UsbLayerError" in h.layers["gpu"][1] for h in rec.health), "a USB fault named on the gpu layer"
    assert not any("bridge_wedged" in h.layers["usb"][1] for h in rec.health), "the bridge's fault named on usb"
    serving_primary(stack)  # power-cycled: the dock serves again


def test_a_frozen_dock_never_silences_the_nodes_health(stack: Stack) -> None:
    """The twin daemon stopped (SIGSTOP) for a while, as a dock whose bridge and GPU stop answering anything
    (or a host that stopped the process): the node fails over and keeps looking for the dock, and its
    ``chestnutHealth`` keeps coming -- never silent for 10 periods (2 s at 5 Hz, ``chestnut check``'s
    ``health_not_silent``): the node's own looks at the dock (a request to the frozen daemon, unanswered for
    the client's 1 s each) run off its loop (``node/docklook.py``). Once it runs again the primary serves."""
    serving_primary(stack)
    t0 = time.monotonic_ns()
    pid = stack.twin.process.pid  # type: ignore[union-attr]
    os.kill(pid, signal.SIGSTOP)
    try:
        failover = stack.bus.wait_for(lambda r: next((s for s in r.states if s.mono_ns >= t0
                                                      and s.state == "degraded"), None), 20.0, "the failover")
        # frozen for 4 s more than it took to fail over: the node looks for the dock (1 s per unanswered look)
        stack.bus.wait_for(lambda r: any(h.mono_ns >= failover.mono_ns + 4 * 10**9 for h in r.health), 30.0,
                           "4 s of health after the failover")
    finally:
        os.kill(pid, signal.SIGCONT)
    t_cont = time.monotonic_ns()
    serving_primary(stack)
    health = [h.mono_ns for h in stack.bus.snapshot().health if t0 <= h.mono_ns <= t_cont]
    gaps = [(b - a) / 1e9 for a, b in zip(health, health[1:], strict=False)]
    assert len(health) >= 20 and max(gaps) < 2.0, (max(gaps), len(health), stack.node.log_tail())
