"""A node whose dock another process holds: ``chestnut run`` (its worker with ``lock_first``, ``node/runner_loader.py``
``dock_runner_spec``) takes the dock's lock at the ladder's ``usb_ids``, before any rung touches the dock, so a
dock whose lock another process holds (``chestnut probe``, a second node) is refused there and never reset; the
node says so as it did when the lock came with the data path (``load_failed (usb): lock_held: ...``, back-off,
the fallback serving) and takes the dock once the holder is gone. An unusable lock file (a directory planted at its
path) is the same failed load, ``lock_unusable``.

Real processes: the twin daemon, ``chestnut run`` as a child (its worker a grandchild), the holder a child
(``DockLock.acquire`` as ``tests/test_backend_probe.py`` makes it), a camera and recorder in this process
(``nodeharness.Bus``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from nodeharness import Bus, NodeProcess, record_fingerprint, write_node_config
from twinfixtures import hold_dock_lock, let_go

from chestnut.backend.docklock import dock_lock_path, lock_holders
from chestnut.backend.sim.client import running_twin
from chestnut.msgs.paths import runtime_dir
from chestnut.node.runner_loader import RunnerSpec, dock_runner_spec, resolve_runner

NODE_TIMING = {"shadow_frames": 5, "backoff_initial_s": 0.2, "backoff_max_s": 0.5, "start_timeout_s": 20.0}
TRANSITION = re.compile(r" chestnut\.node: (\w+ -> \w+ on \w+: .*)$")


def twin_resets(twin) -> int:
    """The twin's GPU resets so far: its log's ``PCIe power off: GPU reset`` lines (``backend/sim/twin.py``)."""
    return twin.daemon.log_path.read_text().count("PCIe power off: GPU reset")


def transitions(node: NodeProcess) -> list[str]:
    """The node's supervisor transitions, in order, from its log (``node/main.py`` ``_log_transition``)."""
    text = node.log_path.read_text(errors="replace")
    return [m.group(1) for line in text.splitlines() if (m := TRANSITION.search(line))]


def wait_log(node: NodeProcess, pred, timeout_s: float, what: str):
    """Poll the node's transitions until ``pred(transitions)`` is truthy; AssertionError with the log's tail on
    timeout, or as soon as the node exits."""
    deadline = time.monotonic() + timeout_s
    while not (got := pred(transitions(node))):
        assert node.proc is not None
        if node.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen (node exit code {node.proc.poll()})\n--- node log ---\n"
                                 f"{node.log_tail()}")
        time.sleep(0.05)
    return got


def worker_pids(node: NodeProcess) -> list[int]:
    """The node's primary workers alive now (``python -m chestnut.node.worker``)."""
    pids = []
    for p in node.descendants():
        try:
            if "chestnut.node.worker" in p.cmdline():
                pids.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return sorted(pids)


def probe_twin() -> None:
    """``chestnut probe --twin``: the link up and the BARs assigned, as under a node that served before."""
    env = {k: v for k, v in os.environ.items() if k not in ("DEV", "GMMU", "HCQDEV_WAIT_TIMEOUT_MS")}
    out = subprocess.run([sys.executable, "-m", "chestnut.launch.cli", "probe", "--twin"], env=env,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_nodes_twin_and_real_workers_take_the_docks_lock_first() -> None:
    """The worker's runner spec: ``lock_first`` for the twin and the real dock, whatever ``[dock] options`` say; the
    wait timeout and (the twin) the prefix unless the options name them; other runners' options as written."""
    assert dock_runner_spec("twin", {}, 3000, "p1") == RunnerSpec(
        "twin", {"wait_timeout_ms": 3000, "lock_first": True, "prefix": "p1"})
    assert dock_runner_spec("real", {"lock_first": False, "wait_timeout_ms": 1000}, 3000, "p1") == RunnerSpec(
        "real", {"lock_first": True, "wait_timeout_ms": 1000})
    assert dock_runner_spec("twin", {"prefix": "p2"}, 2500, None) == RunnerSpec(
        "twin", {"prefix": "p2", "wait_timeout_ms": 2500, "lock_first": True})
    assert dock_runner_spec("cpu", {"threads": 1}, 3000, "p1") == RunnerSpec("cpu", {"threads": 1})
    runner = resolve_runner(dock_runner_spec("twin", {}, 3000, "p1"))  # what the worker builds from it
    try:
        assert (runner.lock_first, runner.prefix, runner.wait_timeout_ms) == (True, "p1", 3000)
    finally:
        runner.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("holder_kind", ["process", "directory"])
def test_a_node_starting_beside_a_held_dock_lock_never_resets_the_dock_and_takes_it_once_free(
        holder_kind: str, tmp_path: Path, tiny_onnx: Path) -> None:
    prefix = os.environ["CHESTNUT_PREFIX"]
    fp = record_fingerprint(tiny_onnx, tmp_path / "tiny.fingerprint.json")
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, fingerprint=fp, timing=NODE_TIMING)
    holder: subprocess.Popen[str] | None = None
    with running_twin(prefix) as twin:
        probe_twin()
        st = twin.status()
        assert twin_resets(twin) == 0 and (st["bridge"]["pcie_power"], st["bridge"]["ltssm"]) == (True, 0x78)
        bus_no, address = st["usb"]["bus"], st["usb"]["address"]
        path = dock_lock_path(bus_no, address)
        if holder_kind == "process":
            holder, code = hold_dock_lock(bus_no, address)
            words = (f"lock_held: the dock usb:{bus_no}-{address} is in use by pid {holder.pid} ({sys.executable} -c "
                     f"{code}): it holds the dock's lock file {path}")
        else:
            path.unlink()  # the probe's, unheld (lock files stay: backend/docklock.py)
            path.mkdir()
            words = (f"lock_unusable: the dock's lock file {path} is a directory, not a regular file; remove it "
                     f"(sudo rm -r {path}) once no process uses the dock")
        bus = Bus(prefix)
        bus.start()
        node = NodeProcess(cfg, prefix, tmp_path / "node.log").start()
        try:
            # two starts refused: the first one, and the one after the back-off and a look that found the dock
            seen = wait_log(node, lambda ts: ts if sum("on load_failed" in t for t in ts) >= 2 else None, 90.0,
                            "two refused starts")
            states = bus.snapshot().states
            resets_refused = twin_resets(twin)
            refused_status = twin.status()
            assert lock_holders(path) == ([holder.pid] if holder is not None else [])
            # the holder goes: the next start takes the dock, resets its GPU (a free dock's first rung after
            # usb_ids that touches it) and serves
            if holder is not None:
                let_go(holder)
            else:
                path.rmdir()
            try:
                rec = bus.wait_for(lambda r: r if r.states and r.states[-1].state == "active" else None, 90.0,
                                   "the primary serving")
            except AssertionError as e:
                raise AssertionError(f"{e}\n--- node log ---\n{node.log_tail()}") from None
            workers = worker_pids(node)
            held_by = lock_holders(path)
            resets_served = twin_resets(twin)
            code_, _ = node.stop()
        finally:
            bus.close()
            node.kill()
            if holder is not None and holder.poll() is None:
                holder.kill()
                holder.wait(timeout=10)
            if path.is_dir():
                path.rmdir()
            shutil.rmtree(runtime_dir(prefix), ignore_errors=True)
    assert resets_refused == 0  # no rung past usb_ids ran: no 0xF3 power-off while another process had the dock
    assert (refused_status["bridge"], refused_status["pcie"]) == (st["bridge"], st["pcie"])
    refused = f"load_failed (usb): {words}"
    where = f"dock_found (usb): add1:0001 at bus {bus_no} address {address}"
    assert seen[:7] == [
        "starting -> qualifying on fallback_ready: fallback_ready: fallback onnxruntime warm",
        "qualifying -> loading on qualified: qualified: qualification ladder passed up to the model load",
        f"loading -> degraded on load_failed: {refused}; retry in 0.2 s",
        "degraded -> looking on retry_due: retry_due: back-off over; looking for the dock",
        f"looking -> requalifying on dock_found: {where}",
        "requalifying -> reloading on qualified: qualified: qualification ladder passed up to the model load",
        f"reloading -> degraded on load_failed: {refused}; retry in 0.4 s",
    ]
    # nodeState says it too (``degraded`` is also LOOKING's, the back-off's end: its reason is the look's)
    published = {re.sub(r"; retry in [\d.]+ s$", "", s.reason) for s in states if s.state == "degraded"}
    assert published - {"retry_due: back-off over; looking for the dock"} == {refused}
    assert rec.states[-1].state == "active" and resets_served == 1  # the free dock: reset by the start that took it
    assert len(workers) == 1 and held_by == workers  # the serving worker holds the dock's lock
    assert code_ == 0 and lock_holders(path) == []
