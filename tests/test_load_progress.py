"""Progress-based supervision of the worker's long commands (docs/health.md "Progress during load").

The rule as pure logic (``node/worker_handle.py`` ``stalled_ns``, the control block's progress words), and with
real processes -- the twin daemon, ``chestnut run`` as a child process with the tiny model, its worker a
grandchild -- the two outcomes: a GPU hang while the model loads (tinygrad 0.14's copy-in drain would wait
10 s) is ended by the node at the wait timeout + margin, and a load that is slow but keeps progressing (a
slow GPU: every packet 1.5 s late) is let finish and serves.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from nodeharness import Bus, NodeProcess, Records, record_fingerprint, write_node_config

from chestnut.backend import progress
from chestnut.backend.errors import Layer
from chestnut.backend.interface import DockObservation
from chestnut.backend.progress import ProgressUSB3
from chestnut.backend.sim.client import TwinClient, TwinDaemon
from chestnut.msgs.paths import runtime_dir
from chestnut.node import shm
from chestnut.node.config import load_config
from chestnut.node.docklook import Look
from chestnut.node.health import Level
from chestnut.node.main import LOOK_LINK, Node
from chestnut.node.shm import IO_GAP_NS, ControlBlock, WorkerState
from chestnut.node.watchdog import WatchdogConfig
from chestnut.node.worker_handle import WorkerProgress, stalled_ns

MS = 1_000_000
STALL_MS = WatchdogConfig().stall_timeout_ms  # 3000 ms wait timeout + 100 ms


# ---------------------------------------------------------------- the rule
def test_stall_limit_is_the_wait_timeout_plus_its_margin() -> None:
    assert STALL_MS == 3100.0
    assert STALL_MS < WatchdogConfig().hang_timeout_ms  # the worker is gone by the frame hang's 3250 ms


def test_waiting_on_the_dock_without_progress_is_a_stall() -> None:
    # inside a transfer, last progress 3200 ms ago
    assert stalled_ns(10_000 * MS, 6_800 * MS, 9_999 * MS, 1) == 3_200 * MS
    # between polls (the last transfer 1 ms ago): still waiting
    assert stalled_ns(10_000 * MS, 6_800 * MS, 9_999 * MS, 0) == 3_200 * MS


def test_host_work_between_transfers_is_not_a_wait() -> None:
    # no transfer for longer than the gap (a compile on the CPU): not waiting, however old the progress
    assert stalled_ns(10_000 * MS, 1_000 * MS, 10_000 * MS - IO_GAP_NS - 1, 0) == 0
    # never talked to the dock, or reported nothing yet
    assert stalled_ns(10_000 * MS, 1_000 * MS, 0, 0) == 0
    assert stalled_ns(10_000 * MS, 0, 9_999 * MS, 1) == 0


def test_control_block_progress_and_a_new_stretch_of_dock_io(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [5_000 * MS]
    monkeypatch.setattr(shm.time, "monotonic_ns", lambda: now[0])
    ctl = ControlBlock.create()
    try:
        ctl.progress(4096)
        s = ctl.snapshot()
        assert (s.progress, s.progress_ns) == (4096, 5_000 * MS)
        now[0] = 9_000 * MS  # 4 s of host work, then a transfer: a new wait starts its clock here
        ctl.dock_io(True)
        s = ctl.snapshot()
        assert (s.progress_ns, s.io_ns, s.io_depth) == (9_000 * MS, 9_000 * MS, 1)
        now[0] = 9_100 * MS
        ctl.dock_io(False)
        now[0] = 9_200 * MS  # a poll 100 ms later belongs to the same wait: its clock does not restart
        ctl.dock_io(True)
        ctl.dock_io(False)
        s = ctl.snapshot()
        assert (s.progress, s.progress_ns, s.io_ns, s.io_depth) == (4096, 9_000 * MS, 9_200 * MS, 0)
    finally:
        ctl.segment.close()


class _FakeUSB3:
    """Stands in for tinygrad's USB3 only to count what the wrapper reports (the wrapper's contract)."""

    def __init__(self) -> None:
        self.tags = 0
        self._async_err = 2

    def control_read(self, request: int, length: int, *args: object) -> bytes:
        return bytes(length)

    def bulk_write(self, payload: bytes, timeout: int) -> int:
        return len(payload)

    def bulk_write_async(self, payload: bytes, timeout: int) -> int:
        self.tags += 1
        return self.tags

    def bulk_wait(self, tag: int) -> None:
        return None


class _Sink:
    def __init__(self) -> None:
        self.moved: list[int] = []
        self.io: list[bool] = []

    def progress(self, amount: int = 1) -> None:
        self.moved.append(amount)

    def dock_io(self, begin: bool) -> None:
        self.io.append(begin)


def test_progress_usb3_reports_bulk_bytes_as_progress_and_polls_as_io_only() -> None:
    sink = _Sink()
    progress.set_sink(sink)
    try:
        usb = ProgressUSB3(_FakeUSB3())
        usb.control_read(0xE4, 8, 0xA800, 0, 1000)  # a fence poll: I/O, no progress
        assert (sink.moved, sink.io) == ([], [True, False])
        usb.bulk_write(bytes(512), 1000)
        tag = usb.bulk_write_async(bytes(1024), 1000)
        assert sink.moved == [512]       # an async bulk OUT counts once it completed ...
        usb.bulk_wait(tag)
        assert sink.moved == [512, 1024]  # ... when it is waited
        usb._async_err = 0               # written through to the wrapped USB3 (the retry wrapper clears its latch)
        assert usb.usb._async_err == 0
    finally:
        progress.set_sink(None)


# ---------------------------------------------------------------- the stall's blame, in the node
class _Looker:
    """Stands in for the node's :class:`~chestnut.node.docklook.DockLooker`: hands out the looks a test sets."""

    def __init__(self) -> None:
        self.looks: dict[str, Look] = {}

    def ask(self, purpose: str) -> None:
        pass

    def take(self, purpose: str) -> Look | None:
        return self.looks.pop(purpose, None)

    def close(self) -> None:
        pass


class _StalledWorker:
    """A worker loading the model, stalled (no progress while waiting on the dock) for ``stalled_s``."""

    pid, alive, spawned_at_s = 4242, True, None

    def __init__(self, stalled_s: float) -> None:
        self.stalled_s = stalled_s

    def progress(self) -> WorkerProgress:
        return WorkerProgress(0.0, WorkerState.LOADING, None, None, 0, 0, 0, stalled_s=self.stalled_s)

    def kill(self) -> None:
        self.alive = False

    def stop(self, timeout_s: float) -> None:
        pass


def _stall_after_looks(tmp_path: Path, tiny_onnx: Path, looks_mbps: list[tuple[float, int]]) -> tuple[Layer, str]:
    """A node (no dock: in this process) whose own looks read the link at ``looks_mbps`` ((s before now, Mbps)) while
    its worker loads, then finds the worker stalled for 3.2 s: the stall's layer and reason in the health."""
    node = Node(load_config(write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none")))
    node.looker.close()
    node.looker = _Looker()  # type: ignore[assignment]
    node.worker = w = _StalledWorker(0.0)  # type: ignore[assignment]
    now = time.monotonic_ns()
    for ago_s, mbps in looks_mbps:
        node.looker.looks[LOOK_LINK] = Look(True, "add1:0001", DockObservation(True, (0xADD1, 1), (1, 2), mbps))
        node._take_looks(now - int(ago_s * 1e9))
    w.stalled_s = 3.2
    assert node._stalled(w)  # type: ignore[arg-type]
    assert node.worker is None and not w.alive
    st = [node.health.status(layer) for layer in (Layer.USB, Layer.GPU)]
    failed = [x for x in st if x.level is Level.ERROR]
    assert len(failed) == 1, st
    return failed[0].layer, failed[0].reason


def test_a_load_stalled_on_a_usb2_link_is_the_usbs_after_the_link_reads_superspeed_again(
        tmp_path: Path, tiny_onnx: Path) -> None:
    """The repro (a launch with usb2@18+6): the reload's bulk write truncated at 480 Mbps and its wait stalled; the
    fault ended and the node's next two looks read 5000 Mbps before the stall was found. It was ``load_failed
    (gpu)``: the blame read only the last look. The link as it was while the wait went on is the usb layer's."""
    layer, reason = _stall_after_looks(tmp_path, tiny_onnx, [(4.0, 480), (3.0, 480), (1.5, 5000), (0.5, 5000)])
    assert layer is Layer.USB, reason
    assert reason.startswith("primary worker 4242 made no progress for 3200 ms while loading: waiting on the dock "
                             "longer than the wait timeout + margin (3000 + 100 ms) on a 480 Mbps, USB 2 link while "
                             "it waited (5000 Mbps at the last reading)"), reason


def test_a_load_stalled_on_a_superspeed_link_stays_the_gpus(tmp_path: Path, tiny_onnx: Path) -> None:
    """A GPU hang during the load: SuperSpeed while the wait went on, whatever the link read before."""
    layer, reason = _stall_after_looks(tmp_path, tiny_onnx, [(9.0, 480), (4.0, 5000), (2.0, 5000), (0.5, 5000)])
    assert layer is Layer.GPU, reason
    assert "Mbps" not in reason


# ---------------------------------------------------------------- with real processes
NODE_TIMING = {"backoff_initial_s": 0.2, "backoff_max_s": 0.5, "flap_max_failovers": 1000, "shadow_frames": 5,
               "start_timeout_s": 90.0}


@dataclass
class Stack:
    twin: TwinDaemon
    client: TwinClient
    node: NodeProcess
    bus: Bus


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_onnx: Path):
    prefix = f"t{os.getpid()}-loadprog"
    tmp = tmp_path_factory.mktemp("loadprog")
    fp = record_fingerprint(tiny_onnx, tmp / "tiny.fingerprint.json")
    cfg = write_node_config(tmp / "node.toml", tiny_onnx, fingerprint=fp, timing=NODE_TIMING)
    twin = TwinDaemon(prefix).start()
    client = twin.client()
    bus = Bus(prefix)
    bus.start()
    node = NodeProcess(cfg, prefix, tmp / "node.log").start()
    try:
        yield Stack(twin, client, node, bus)
    finally:
        bus.close()
        node.kill()
        client.close_connection()
        twin.stop()
        shutil.rmtree(runtime_dir(prefix), ignore_errors=True)


def _serving(r: Records) -> bool:
    return (len(r.outputs) >= 3 and all(o.source == "primary" for o in r.outputs[-3:]) and bool(r.states)
            and r.states[-1].state == "active")


def reload_under(st: Stack, kind: str, **params: object) -> int:
    """With the primary serving: kill its worker (the node starts another, which loads the model) and, once
    the new worker is spawned (before it qualifies and loads; the old one's packets are done by then), arm
    ``kind`` for the twin's loading phase only, so it acts on the new worker's load. Returns the old pid."""
    rec = st.bus.wait_for(lambda r: r if _serving(r) else None, 120.0, "the primary serving")
    old = rec.states[-1].worker_pid
    os.kill(old, signal.SIGKILL)
    st.bus.wait_for(lambda r: r if r.states and r.states[-1].worker_pid not in (0, old) else None, 30.0,
                    "a new worker spawned")
    st.client.set_phase("loading")
    st.client.fault(kind, phase="loading", **params)
    return old


STALL_LINE = re.compile(r"primary worker (\d+) made no progress for (\d+) ms while loading")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_gpu_hang_during_load_is_ended_at_the_wait_timeout(stack: Stack) -> None:
    st = stack
    old = reload_under(st, "gpu_hang")
    try:
        rec = st.bus.wait_for(lambda r: r if any(s.state == "degraded" and "made no progress" in s.reason
                                                 for s in r.states) else None, 60.0, "the stalled load ended")
        st.bus.wait_for(lambda r: r if _serving(r) and r.states[-1].worker_pid != old else None, 120.0,
                        "the primary serving again")
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- node log ---\n{st.node.log_tail()}") from None
    log = st.node.log_tail(200_000)
    ended = [s for s in rec.states if s.state == "degraded" and "made no progress" in s.reason]
    assert ended[0].reason.startswith("load_failed (gpu): primary worker "), ended[0].reason
    m = STALL_LINE.search(log)
    assert m is not None, log[-4000:]
    # ended once stalled over STALL_MS; the line shows it to the whole ms, so 3100.4 ms reads 3100
    assert STALL_MS <= int(m.group(2)) < WatchdogConfig().hang_timeout_ms, m.group(0)
    assert "GPU failed to drain" not in log  # tinygrad's 10 s drain wait never ended it: the node did
    assert int(m.group(1)) not in {p.pid for p in st.node.descendants()}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_slow_progressing_load_is_not_ended(stack: Stack) -> None:
    st = stack
    old = reload_under(st, "slow_gpu", delay_ms=1500)
    try:
        rec = st.bus.wait_for(lambda r: r if _serving(r) and r.states[-1].worker_pid != old else None, 180.0,
                              "the primary serving after a slow load")
    finally:
        st.client.clear()
    log = st.node.log_tail(200_000)
    new = rec.states[-1].worker_pid
    loaded = re.search(rf"worker {new} qualified and loaded: .*model_loaded (\d+) ms", log)
    assert loaded is not None, log[-4000:]
    assert int(loaded.group(1)) > STALL_MS  # the load took longer than one stall allows, in waits shorter than it
    assert f"primary worker {new} made no progress" not in log
