"""The primary worker process and its IPC, with real processes.

Contract: a round trip gives exactly what the model gives in-process; every result carries its
request's sequence number and results pair up in order; a dead, hung or failing worker is seen
by the node (typed errors, heartbeat age) and reaped; the stop sequence leaves no child within the
5 s budget; the worker dies with its parent; no shared memory outlives the handle.

The runners below are loaded by the worker from this file (``RunnerSpec("<this file>:Class")``);
what the scripted runner does is chosen by the input's first element, so failures are real
exceptions and real process states (SIGKILL, SIGSTOP), not switches in product code.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from chestnut.backend.errors import ConfigError, GpuLayerError, Layer, ModelError, OutputLayerError, PcieLayerError
from chestnut.backend.interface import DockObservation, LadderReport, LadderStep, ModelSpec, StepResult
from chestnut.backend.ladder import LadderConfig
from chestnut.backend.model import TensorSpec
from chestnut.node.runner_loader import RunnerSpec, resolve_runner, trust_refusal
from chestnut.node.shm import SlotLayout, WorkerState
from chestnut.node.wire import HEADER_BYTES, Msg, WorkerError, error_from_json, error_to_json, pack, unpack
from chestnut.node.worker_handle import StopReport, WorkerHandle

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve()
X_SPEC = TensorSpec("x", (4, 3), "float32")
Y_SPEC = TensorSpec("y", (3,), "float32")
CALLS_SPEC = TensorSpec("calls", (1,), "int64")
RAISE_TYPED, RAISE_PLAIN, SLEEP, BAD_OUTPUT, RAISE_TINYGRAD = -1.0, -2.0, -3.0, -4.0, -5.0  # x[0, 0] selects
NO_FINGERPRINT = LadderConfig(require_fingerprint=False)  # the scripted model has no recorded fingerprint


# ---------------------------------------------------------------- runners the worker loads from this file
class ScriptedRunner:
    """x float32[4,3] -> y = x.sum(0) float32[3], calls int64[1]; x[0,0] < 0 selects a failure."""

    kind = "scripted"

    def __init__(self, qualify_fail: bool = False, load_fail: bool = False, linger_s: float = 0.0) -> None:
        self.qualify_fail, self.load_fail, self.calls = qualify_fail, load_fail, 0
        if linger_s:  # the worker's exit lingers after its command socket has closed (tinygrad's teardown does)
            import atexit

            atexit.register(time.sleep, linger_s)

    def qualify(self) -> LadderReport:
        if self.qualify_fail:
            return LadderReport([LadderStep("usb_ids", Layer.USB, StepResult.PASS, 0.01, "ADD1:0001"),
                                 LadderStep("ltssm", Layer.PCIE, StepResult.FAIL, 0.2, "LTSSM=0x4c after power-on",
                                            "power-cycle the dock")])
        return LadderReport([LadderStep("usb_ids", Layer.USB, StepResult.PASS, 0.01, "ADD1:0001")])

    def load(self, model: ModelSpec) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        if self.load_fail:
            raise ModelError("bad_model", f"cannot parse {model.path}")
        return (X_SPEC,), (Y_SPEC, CALLS_SPEC)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls += 1
        x = inputs["x"]
        code = float(x[0, 0])
        if code == RAISE_TYPED:
            raise GpuLayerError("fence_stall", "fence at 0xA800 stuck at 7 for 3000 ms")
        if code == RAISE_PLAIN:
            raise ValueError("boom at frame")
        if code == RAISE_TINYGRAD:  # what tinygrad 0.14 hcq.py raises, untyped
            raise RuntimeError("Wait timeout: 3000 ms! (the signal is not set to 12, but 11)")
        if code == SLEEP:
            time.sleep(float(x[0, 1]))
        if code == BAD_OUTPUT:
            return {"y": np.zeros((4,), np.float32), "calls": np.array([self.calls])}
        return {"y": x.sum(0), "calls": np.array([self.calls], np.int64)}

    def probe(self) -> DockObservation:
        return DockObservation(True, (0xADD1, 0x0001), (4, 7), 5000, 0, 0x78, 12,
                               {"DEV": os.environ.get("DEV"), "CHESTNUT_TEST_ENV": os.environ.get("CHESTNUT_TEST_ENV")})

    def close(self) -> None:
        pass


def scripted(**options: object) -> RunnerSpec:
    return RunnerSpec(f"{HERE}:ScriptedRunner", dict(options))


MODEL = ModelSpec(Path("scripted.onnx"), "scripted")


def frame(value: float, code: float | None = None, arg: float = 0.0) -> dict[str, np.ndarray]:
    x = np.full(X_SPEC.shape, value, np.float32)
    if code is not None:
        x[0, 0], x[0, 1] = code, arg
    return {"x": x}


# ---------------------------------------------------------------- helpers
def wait_ready(h: WorkerHandle, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not h.poll_ready():
        assert time.monotonic() < deadline, "worker not ready in time"
        select.select([h], [], [], 0.1)


def children() -> list[psutil.Process]:
    """Live worker processes below this one (tinygrad's own compile pool in this process is not ours)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "chestnut.node.worker" in p.cmdline():
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def tree(h: WorkerHandle) -> list[psutil.Process]:
    """The worker and everything it started (e.g. tinygrad's compile pool)."""
    w = psutil.Process(h.pid)
    return [w, *w.children(recursive=True)]


def assert_gone(procs: list[psutil.Process], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        while True:
            try:
                if p.status() == psutil.STATUS_ZOMBIE and p.ppid() != os.getpid():
                    break  # orphaned and dead; its new parent reaps it
            except psutil.NoSuchProcess:
                break
            assert time.monotonic() < deadline, f"process {p.pid} {p.cmdline()} outlived the worker"
            time.sleep(0.01)


def memfds(pid: int | str = "self") -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if "chestnut-worker" in target:
            out.append(target)
    return out


@pytest.fixture(autouse=True)
def no_leftover_segments():
    before = memfds()
    yield
    assert memfds() == before, "a handle kept shared memory after its test"


def start_scripted(h: WorkerHandle, **options: object) -> WorkerHandle:
    h.start(scripted(**options), MODEL, NO_FINGERPRINT)
    return h


@pytest.fixture
def worker():
    h = start_scripted(WorkerHandle())
    wait_ready(h)
    yield h
    h.stop()
    assert children() == []


# ---------------------------------------------------------------- the wire format
def test_header_round_trip_and_malformed_packets():
    packet = pack(Msg.RESULT, 2**40 + 3, slot=1, status=1, value=123456, payload=b'{"a":1}')
    assert len(packet) == HEADER_BYTES + 7 == 31
    assert unpack(packet) == (Msg.RESULT, 1, 1, 2**40 + 3, 123456, b'{"a":1}')
    with pytest.raises(ValueError, match="shorter than the 24-byte header"):
        unpack(packet[:10])
    with pytest.raises(ValueError, match="header says 7 payload bytes, packet carries 6"):
        unpack(packet[:-1])


def test_errors_cross_by_class_name_with_layer_reason_and_detail():
    class FenceStall(GpuLayerError):
        pass

    wire = json.loads(json.dumps(error_to_json(FenceStall("fence_stall", "fence 7"))))
    assert wire["classes"][:2] == ["FenceStall", "GpuLayerError"] and wire["layer"] == "gpu"
    err = error_from_json(wire)
    assert type(err) is GpuLayerError and (err.reason, err.detail) == ("fence_stall", "fence 7")
    plain = error_from_json(error_to_json(KeyError("k")))
    assert type(plain) is WorkerError and (plain.reason, plain.detail) == ("runner_exception", "KeyError: 'k'")


def test_slot_layout_is_aligned_and_survives_json():
    layout = SlotLayout.build([TensorSpec("img", (128, 256, 3), "uint8")], [TensorSpec("y", (5,), "float32")], 2)
    assert [p.offset for p in layout.inputs + layout.outputs] == [0, 98304]
    assert layout.slot_bytes == 98368 and layout.tags_bytes == 64 and layout.total_bytes == 64 + 2 * 98368
    assert SlotLayout.from_json(json.loads(json.dumps(layout.to_json()))) == layout


# ---------------------------------------------------------------- round trips
@pytest.mark.timeout(120)
def test_cpu_round_trip_equals_running_the_model_directly(tiny_onnx):
    from chestnut.backend.fingerprint import record_fingerprint
    from chestnut.backend.model import OnnxModel

    direct = OnnxModel(tiny_onnx, name="tiny")
    direct.warm()
    with WorkerHandle() as h:
        h.start(RunnerSpec("cpu"), ModelSpec(tiny_onnx, "tiny", fingerprint=record_fingerprint(direct)))
        wait_ready(h)
        procs = tree(h)
        assert h.runner_kind == "cpu" and h.ladder is not None  # no dock steps; the model steps ran in the worker
        assert [(s.name, s.result) for s in h.ladder.steps] == [("model_loaded", StepResult.PASS),
                                                                  ("warmup", StepResult.PASS)]
        assert h.ladder.steps[1].detail == "1 output(s) bit-exact"
        assert h.inputs == (TensorSpec("x", (1, 3, 32, 64), "float32"),)
        assert h.outputs == (TensorSpec("prob", (1, 1, 16, 32), "float32"),)
        rng = np.random.default_rng(7)
        for seq in (5, 6, 9):
            x = rng.random((1, 3, 32, 64), dtype=np.float32)
            h.submit(seq, {"x": x})
            r = h.poll_result(timeout_s=60)
            assert r is not None and r.ok and r.seq == seq
            assert list(r.outputs) == ["prob"] and r.outputs["prob"].dtype == np.float32
            np.testing.assert_array_equal(r.outputs["prob"], direct.run({"x": x})["prob"])
            assert 0 < r.exec_time_s <= r.roundtrip_s
        h.submit(10, {"x": x})
        view = h.poll_result(timeout_s=10, copy=False)
        assert view is not None and not view.outputs["prob"].flags.writeable
        np.testing.assert_array_equal(view.outputs["prob"], direct.run({"x": x})["prob"])
        assert WorkerHandle().wake() is False  # a worker not started (not ready): nothing is sent, nothing raised
        assert h.wake() is True  # a RUN is coming: the worker wakes, then runs it as any other
        h.submit(11, {"x": x})  # looked for without sleeping (busy wait) for the whole wait
        r = h.poll_result(timeout_s=60, spin_s=60)
        assert r is not None and r.ok and r.seq == 11
        np.testing.assert_array_equal(r.outputs["prob"], direct.run({"x": x})["prob"])
        assert h.wake() is True  # no RUN follows: the worker waits again and still serves
        time.sleep(0.05)
        h.submit(12, {"x": x})
        r = h.poll_result(timeout_s=60)
        assert r is not None and r.ok and r.seq == 12
        assert h.wake() is True and h.wake() is True  # two before one RUN: each taken, the RUN runs once
        h.submit(13, {"x": x})
        r = h.poll_result(timeout_s=60)
        assert r is not None and r.ok and r.seq == 13
        t0 = time.monotonic()  # nothing in flight: a busy wait, then a sleep, then None at the timeout
        assert h.poll_result(timeout_s=0.05, spin_s=0.02) is None
        assert time.monotonic() - t0 >= 0.05
        assert h.progress().runs_done == 7  # requests only: the ladder's warm-up is not one
    assert_gone(procs)
    assert children() == []


@pytest.mark.timeout(120)
def test_a_warm_up_that_misses_the_fingerprint_fails_the_start_at_the_output_layer(tiny_onnx):
    from chestnut.backend.fingerprint import record_fingerprint

    good = record_fingerprint(ModelSpec(tiny_onnx, "tiny"))
    bad = {**good, "outputs": {"prob": {**good["outputs"]["prob"], "sha256": "0" * 64, "mean": 0.9}}}
    with WorkerHandle() as h:
        h.start(RunnerSpec("cpu"), ModelSpec(tiny_onnx, "tiny", fingerprint=bad))
        with pytest.raises(OutputLayerError, match=r"^fingerprint_mismatch: prob: mean 0\.\d+ != recorded 0\.9 "):
            wait_ready(h)
        assert h.ladder is not None and h.ladder.first_failure is not None
        assert (h.ladder.first_failure.name, h.ladder.first_failure.reason) == ("warmup", "fingerprint_mismatch")


@pytest.mark.timeout(120)
def test_twin_round_trip_climbs_the_whole_ladder_and_a_fence_stall_comes_back_typed(tiny_onnx):
    from chestnut.backend.fingerprint import record_fingerprint
    from chestnut.backend.model import OnnxModel
    from chestnut.backend.sim.client import running_twin

    direct = OnnxModel(tiny_onnx, name="tiny")
    model = ModelSpec(tiny_onnx, "tiny", fingerprint=record_fingerprint(direct))
    with running_twin(args=["--training-delay-ms", "2"]) as twin, WorkerHandle() as h:
        h.start(RunnerSpec("twin", {"wait_timeout_ms": 300}), model)  # the twin of this test's CHESTNUT_PREFIX
        wait_ready(h)
        assert h.runner_kind == "twin" and h.ladder is not None and h.ladder.passed
        assert [s.name for s in h.ladder.steps] == ["usb_ids", "link_speed", "link_stability", "ltssm", "gpu_arch",
                                                    "model_loaded", "warmup"]
        assert h.ladder.steps[-1].detail == "1 output(s) bit-exact"
        x = np.random.default_rng(3).random((1, 3, 32, 64), dtype=np.float32)
        h.submit(1, {"x": x})
        r = h.poll_result(timeout_s=60)
        assert r is not None and r.ok and r.seq == 1
        np.testing.assert_array_equal(r.outputs["prob"], direct.run({"x": x})["prob"])
        assert h.request_probe()
        deadline = time.monotonic() + 5
        while h.latest_probe is None and time.monotonic() < deadline:
            h.poll_result(timeout_s=0.1)
        assert h.latest_probe is not None and h.latest_probe.observation is not None
        assert (h.latest_probe.observation.present, h.latest_probe.observation.ltssm) == (True, 0x78)
        twin.fault("fence_stall")  # the GPU does the work, the fence never moves
        h.submit(2, {"x": x})
        stalled = h.poll_result(timeout_s=60)
        assert stalled is not None and stalled.seq == 2 and type(stalled.error) is GpuLayerError
        assert (stalled.error.reason, stalled.error.layer) == ("fence_stall", Layer.GPU) and h.alive
        procs = tree(h)
        assert h.stop().how == "asked"
    assert_gone(procs)


@pytest.mark.timeout(30)
def test_results_pair_up_with_their_sequence_numbers_and_a_late_result_stays_its_own(worker):
    worker.submit(10, frame(1.0, SLEEP, 0.25))         # frame 10 will be late
    assert worker.poll_result(timeout_s=0.05) is None  # the node's deadline passes; it answers elsewhere
    worker.submit(11, frame(2.0))                       # frame 11 goes into the other slot
    assert worker.in_flight == (10, 11) and not worker.can_submit
    with pytest.raises(WorkerError, match=r"busy: all 2 slots are in flight \(seqs \[10, 11\]\)"):
        worker.submit(12, frame(3.0))
    late, on_time = worker.poll_result(timeout_s=5), worker.poll_result(timeout_s=5)
    assert late is not None and on_time is not None
    assert late.seq == 10 and late.outputs["y"].tolist() == [SLEEP + 3.0, 0.25 + 3.0, 4.0]
    assert on_time.seq == 11 and on_time.outputs["y"].tolist() == [8.0, 8.0, 8.0]
    assert [late.outputs["calls"][0], on_time.outputs["calls"][0]] == [2, 3]  # call 1 was the ladder's warm-up
    assert worker.poll_result() is None and worker.in_flight == ()
    with pytest.raises(WorkerError, match="bad_seq: seq 11 is not larger than the previous 11"):
        worker.submit(11, frame(1.0))
    worker.submit(12, frame(1.0))
    r = worker.poll_result(timeout_s=5)
    assert r is not None and r.seq == 12 and r.outputs["y"].tolist() == [4.0, 4.0, 4.0]


def test_a_descriptor_on_any_command_but_buffers_is_closed_by_the_worker(worker):
    """Only BUFFERS hands the worker descriptors it keeps (the slots' memfds); one riding on a WAKE is closed
    at once. Seen from here: a pipe whose only other write end went to the worker reads EOF."""
    r, w = os.pipe()
    try:
        socket.send_fds(worker._sock, [pack(Msg.WAKE)], [w])  # the handle's own socket, as the node's WAKE goes
        os.close(w)
        w = -1
        ready, _, _ = select.select([r], [], [], 30)  # returns on EOF: the worker closed its copy
        assert ready == [r] and os.read(r, 1) == b""
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    worker.submit(1, frame(1.0))  # and it still serves
    got = worker.poll_result(timeout_s=5)
    assert got is not None and got.seq == 1 and got.outputs["y"].tolist() == [4.0, 4.0, 4.0]


def test_an_input_written_into_the_next_slot_is_sent_without_a_second_copy(worker, monkeypatch):
    slot = worker.next_inputs()
    assert slot is not None and set(slot) == {"x"}
    assert slot["x"].shape == X_SPEC.shape and slot["x"].dtype == np.float32 and slot["x"].flags.writeable
    slot["x"][...] = 2.0
    copies: list[tuple[int, ...]] = []  # shapes only: a view kept here would keep the segment mapped
    real_copyto = np.copyto
    monkeypatch.setattr(np, "copyto", lambda dst, *a, **k: (copies.append(dst.shape), real_copyto(dst, *a, **k)))
    checked: list[list[str]] = []
    real_check = worker.check_inputs
    monkeypatch.setattr(worker, "check_inputs", lambda inputs: (checked.append(sorted(inputs)), real_check(inputs)))
    worker.submit(1, {"x": slot["x"]})
    del slot
    assert copies == []  # the worker reads it where it was written
    assert checked == []  # the slot's own array is of its spec: nothing to check
    r = worker.poll_result(timeout_s=5)
    assert r is not None and r.seq == 1 and r.outputs["y"].tolist() == [8.0, 8.0, 8.0]  # as frame(2.0) gives
    worker.submit(2, frame(1.0))  # an array of the caller's own is checked and copied in, as before
    assert copies == [X_SPEC.shape]
    assert checked == [["x"]]
    worker.submit(3, frame(1.0))
    assert worker.next_inputs() is None  # both slots in flight: nothing to write into
    assert [worker.poll_result(timeout_s=5).seq, worker.poll_result(timeout_s=5).seq] == [2, 3]


@pytest.mark.timeout(30)
def test_a_runner_exception_comes_back_typed_with_its_message_and_the_worker_keeps_serving(worker):
    worker.submit(1, frame(0.0, RAISE_TYPED))
    worker.submit(2, frame(0.0, RAISE_PLAIN))
    typed, plain = worker.poll_result(timeout_s=5), worker.poll_result(timeout_s=5)
    assert typed is not None and typed.seq == 1 and typed.outputs == {}
    assert type(typed.error) is GpuLayerError and typed.error.layer is Layer.GPU
    assert str(typed.error) == "fence_stall: fence at 0xA800 stuck at 7 for 3000 ms"
    assert "in run" in typed.error.worker_traceback
    assert plain is not None and plain.seq == 2 and type(plain.error) is WorkerError
    assert str(plain.error) == "runner_exception: ValueError: boom at frame"
    worker.submit(3, frame(0.0, RAISE_TINYGRAD))  # untyped, but tinygrad's words: classified by message
    hcq = worker.poll_result(timeout_s=5)
    assert hcq is not None and type(hcq.error) is GpuLayerError and hcq.error.reason == "wait_timeout"
    assert hcq.error.detail == "RuntimeError: Wait timeout: 3000 ms! (the signal is not set to 12, but 11)"
    worker.submit(4, frame(0.0, BAD_OUTPUT))
    bad = worker.poll_result(timeout_s=5)
    assert bad is not None and type(bad.error) is OutputLayerError
    assert str(bad.error) == "bad_output: output 'y': got float32[4], declared float32[3]"
    worker.submit(5, frame(0.5))
    ok = worker.poll_result(timeout_s=5)
    assert ok is not None and ok.ok and ok.outputs["y"].tolist() == [2.0, 2.0, 2.0]
    p = worker.progress()
    assert (p.runs_started, p.runs_done, p.runs_failed, p.state, p.busy_seq) == (5, 1, 4, WorkerState.READY, None)


@pytest.mark.timeout(30)
def test_a_wrong_input_is_rejected_at_submit_with_a_precise_error_and_nothing_sent(worker):
    cases = [
        ({"x": np.zeros((4, 4), np.float32)}, r"bad_input: input 'x': got float32\[4, 4\], want float32\[4, 3\]"),
        ({"x": np.zeros((4, 3), np.float64)}, r"bad_input: input 'x': got float64\[4, 3\], want float32\[4, 3\]"),
        ({"x": [[0.0] * 3] * 4}, r"bad_input: input 'x': got list, want a numpy array"),
        ({"img": np.zeros((4, 3), np.float32)}, r"bad_input: inputs \['img'\] != model inputs \['x'\]"),
        ({**frame(1.0), "extra": np.zeros(1)}, r"bad_input: inputs \['extra', 'x'\] != model inputs \['x'\]"),
    ]
    for inputs, message in cases:
        with pytest.raises(ModelError, match=message):
            worker.submit(1, inputs)
    assert worker.in_flight == () and worker.progress().runs_started == 0
    worker.submit(1, {"x": np.asfortranarray(np.ones((4, 3), np.float32))})  # any strides
    r = worker.poll_result(timeout_s=5)
    assert r is not None and r.seq == 1 and r.outputs["y"].tolist() == [4.0, 4.0, 4.0]


@pytest.mark.timeout(30)
def test_probe_environment_and_dock_observation_cross(monkeypatch):
    monkeypatch.setenv("DEV", "CPU")  # the node's own tinygrad device never leaks into the worker
    with WorkerHandle() as h:
        h.start(RunnerSpec(f"{HERE}:ScriptedRunner", env={"CHESTNUT_TEST_ENV": "on"}), MODEL, NO_FINGERPRINT)
        assert not h.request_probe()  # not ready yet
        wait_ready(h)
        assert h.request_probe() and not h.request_probe()  # one pending at a time
        deadline = time.monotonic() + 5
        while h.latest_probe is None and time.monotonic() < deadline:
            h.poll_result(timeout_s=0.1)
        assert h.latest_probe is not None and h.latest_probe.error is None
        assert h.latest_probe.observation == DockObservation(
            True, (0xADD1, 0x0001), (4, 7), 5000, 0, 0x78, 12, {"DEV": None, "CHESTNUT_TEST_ENV": "on"})


# ---------------------------------------------------------------- start-up failures
@pytest.mark.timeout(30)
def test_start_failures_come_back_typed_with_the_ladder():
    with WorkerHandle() as h:
        start_scripted(h, qualify_fail=True)
        with pytest.raises(PcieLayerError, match=r"^ltssm: LTSSM=0x4c after power-on$"):
            wait_ready(h)
        assert h.ladder is not None and h.ladder.first_failure is not None
        assert [(s.name, s.result) for s in h.ladder.steps] == [("usb_ids", StepResult.PASS),
                                                                  ("ltssm", StepResult.FAIL)]
        assert h.ladder.first_failure.advice == "power-cycle the dock"
        with pytest.raises(WorkerError, match=r"^not_ready: the worker failed to start: ltssm: LTSSM=0x4c"):
            h.submit(1, frame(1.0))
    with WorkerHandle() as h:
        start_scripted(h, load_fail=True)
        with pytest.raises(ModelError, match=r"^bad_model: cannot parse scripted.onnx$"):
            wait_ready(h)
        assert h.stop().returncode == 3
    with WorkerHandle() as h:
        h.start(RunnerSpec(f"{HERE}:NoSuchRunner"), MODEL, NO_FINGERPRINT)
        with pytest.raises(ConfigError, match=r"unknown_runner: .*test_worker.py has no attribute 'NoSuchRunner'"):
            wait_ready(h)
    with WorkerHandle() as h:
        h.start(scripted(), MODEL)  # the default ladder requires a recorded fingerprint
        with pytest.raises(ModelError, match=r"^no_fingerprint: scripted has no recorded fingerprint$"):
            wait_ready(h)
        assert [(s.name, s.result) for s in h.ladder.steps] == [
            ("usb_ids", StepResult.PASS), ("model_loaded", StepResult.PASS), ("warmup", StepResult.FAIL)]
    with pytest.raises(ConfigError, match="unknown_runner: runner kind 'gpu'"):
        WorkerHandle().start(RunnerSpec("gpu"), MODEL)
    assert children() == []


# ---------------------------------------------------------------- loading runner code
_PLANTED_RUNNER = """
from pathlib import Path
Path(__file__).with_suffix(".ran").write_text("executed")
class Runner:
    pass
"""


def planted_runner(folder: Path, mode: int = 0o644) -> Path:
    """A runner file that leaves ``<name>.ran`` beside itself when it is executed."""
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / "planted_runner.py"
    path.write_text(_PLANTED_RUNNER)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666], ids=["group", "other", "both"])
def test_a_runner_file_writable_by_group_or_other_is_refused_and_never_runs(tmp_path: Path, mode: int) -> None:
    path = planted_runner(tmp_path / "runners", mode)
    with pytest.raises(ConfigError) as err:
        resolve_runner(RunnerSpec(f"{path}:Runner"))
    assert str(err.value) == (f"untrusted_runner: runner file {path} is writable by group or other (mode {mode:04o}): "
                              f"only code no one else can change is loaded (chmod go-w {path})")
    assert not path.with_suffix(".ran").exists()


def test_a_runner_file_owned_by_another_user_or_reached_by_a_link_is_refused(tmp_path: Path) -> None:
    path = planted_runner(tmp_path / "runners")
    link = tmp_path / "runners" / "link_runner.py"
    link.symlink_to(path)
    with pytest.raises(ConfigError) as err:
        resolve_runner(RunnerSpec(f"{link}:Runner"))
    assert str(err.value) == (f"untrusted_runner: runner file {link} is a symbolic link: "
                              "point the runner at the real file")
    if os.getuid() == 0:  # only root can give a file away
        os.chown(path, 65534, 65534)
        with pytest.raises(ConfigError) as err:
            resolve_runner(RunnerSpec(f"{path}:Runner"))
        assert str(err.value) == (f"untrusted_runner: runner file {path} is owned by uid 65534, not by uid 0 that "
                                  "runs the worker: only code its user owns is loaded (chown it, or copy it to a file "
                                  "you own)")
    assert not path.with_suffix(".ran").exists()
    os.chmod(tmp_path / "runners", 0o777)
    os.chown(path, os.getuid(), os.getgid())
    with pytest.raises(ConfigError, match=r"^untrusted_runner: runner folder .*runners is writable by group or other "
                                          r"\(mode 0777\)"):
        resolve_runner(RunnerSpec(f"{path}:Runner"))
    assert not path.with_suffix(".ran").exists()
    os.chmod(tmp_path / "runners", 0o700)
    assert type(resolve_runner(RunnerSpec(f"{path}:Runner"))).__name__ == "Runner"  # the same file, now ours
    assert path.with_suffix(".ran").read_text() == "executed"


@pytest.mark.timeout(30)
def test_the_worker_reports_an_untrusted_runner_in_one_line(tmp_path: Path) -> None:
    path = planted_runner(tmp_path / "runners", 0o666)
    with WorkerHandle() as h:
        h.start(RunnerSpec(f"{path}:Runner"), MODEL, NO_FINGERPRINT)
        with pytest.raises(ConfigError) as err:
            wait_ready(h)
        assert h.stop().returncode == 3
    assert "\n" not in str(err.value) and str(err.value).startswith(f"untrusted_runner: runner file {path} is writable")
    assert not path.with_suffix(".ran").exists()


@pytest.mark.parametrize(("mode", "owner", "want"), [
    (stat.S_IFREG | 0o644, 1000, None),
    (stat.S_IFREG | 0o600, 0, None),                        # root's own files are trusted
    (stat.S_IFREG | 0o755, 1000, None),
    (stat.S_IFREG | 0o620, 1000, "writable by group or other (mode 0620)"),
    (stat.S_IFREG | 0o602, 1000, "writable by group or other (mode 0602)"),
    (stat.S_IFREG | 0o644, 1001, "owned by uid 1001, not by uid 1000"),
    (stat.S_IFLNK | 0o777, 1000, "is a symbolic link"),
    (stat.S_IFDIR | 0o755, 1000, "is not a regular file"),
    (stat.S_IFIFO | 0o600, 1000, "is not a regular file"),
])
def test_trust_refusal_follows_the_ssh_rule(mode: int, owner: int, want: str | None) -> None:
    got = trust_refusal("/r/x.py", mode, owner, 1000)
    assert got == want if want is None else (got is not None and want in got)


def test_trust_refusal_for_the_folder_that_holds_the_code() -> None:
    assert trust_refusal("/r", stat.S_IFDIR | 0o755, 1000, 1000, folder=True) is None
    assert trust_refusal("/r", stat.S_IFDIR | 0o1777, 0, 1000, folder=True) == (
        "runner folder /r is writable by group or other (mode 1777): only code no one else can change is loaded "
        "(chmod go-w /r)")
    assert trust_refusal("/r", stat.S_IFREG | 0o644, 1000, 1000, folder=True) == "runner folder /r is not a folder"


def test_a_module_runner_is_checked_file_by_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "plantedpkg"
    pkg.mkdir(mode=0o700)
    (pkg / "__init__.py").write_text("")
    (pkg / "runner.py").write_text(_PLANTED_RUNNER)
    (pkg / "runner.py").chmod(0o666)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^untrusted_runner: runner file .*plantedpkg/runner.py is writable"):
        resolve_runner(RunnerSpec("plantedpkg.runner:Runner"))
    assert not (pkg / "runner.ran").exists() and "plantedpkg.runner" not in sys.modules
    (pkg / "runner.py").chmod(0o644)
    assert type(resolve_runner(RunnerSpec("plantedpkg.runner:Runner"))).__name__ == "Runner"
    assert (pkg / "runner.ran").read_text() == "executed"


# ---------------------------------------------------------------- death, hangs, stop
@pytest.mark.timeout(30)
def test_a_sigkilled_worker_is_detected_and_its_request_fails_typed(worker):
    pid = worker.pid
    os.kill(pid, signal.SIGSTOP)  # holds the request in flight
    worker.submit(7, frame(1.0))
    os.kill(pid, signal.SIGKILL)
    r = worker.poll_result(timeout_s=5)
    assert r is not None and r.seq == 7 and type(r.error) is WorkerError and r.error.reason == "worker_exited"
    assert f"worker pid {pid}" in r.error.detail and "with request 7 in flight" in r.error.detail
    assert worker.poll_result() is None and not worker.alive and not worker.ready
    deadline = time.monotonic() + 2
    while worker.returncode is None and time.monotonic() < deadline:  # reaped by the handle
        time.sleep(0.01)
    assert worker.returncode == -signal.SIGKILL
    with pytest.raises(WorkerError, match="worker_exited"):
        worker.submit(8, frame(1.0))
    assert worker.stop().how == "already_exited" and children() == []


@pytest.mark.timeout(30)
def test_a_stopped_worker_ages_its_heartbeat_and_kill_reaps_it(worker):
    assert worker.heartbeat_age_s() < 0.5 and worker.alive
    worker.submit(1, frame(1.0, SLEEP, 0.2))
    time.sleep(0.05)
    p = worker.progress()
    assert (p.state, p.busy_seq) == (WorkerState.RUNNING, 1) and p.busy_for_s is not None and p.busy_for_s > 0
    assert worker.heartbeat_age_s() < 0.5  # the heartbeat keeps beating during a long inference
    os.kill(worker.pid, signal.SIGSTOP)
    time.sleep(0.8)
    assert worker.heartbeat_age_s() >= 0.7 and worker.alive  # hung, not dead: only the heartbeat says so
    t0 = time.monotonic()
    assert worker.kill() is True
    assert time.monotonic() - t0 < 0.5
    assert worker.returncode == -signal.SIGKILL and not worker.alive and children() == []
    r = worker.poll_result()
    assert r is not None and r.seq == 1 and r.error is not None and r.error.reason == "worker_exited"
    assert "killed by the node" in r.error.detail


@pytest.mark.timeout(30)
def test_a_worker_that_exits_on_its_own_is_reaped_with_its_status_never_killed(caplog):
    """A worker that failed its start closes its socket, then exits: the node saw the EOF before it could reap it and
    logged ``worker pid N exited (exit status not yet known)``, then ``killing worker pid N`` for a worker on its way
    out. It is given time to exit, and its line says its real exit status, once."""
    caplog.set_level(logging.INFO, logger="chestnut.node.worker")
    with WorkerHandle() as h:
        start_scripted(h, load_fail=True, linger_s=0.3)
        with pytest.raises(ModelError):
            wait_ready(h)
        deadline = time.monotonic() + 10
        while h.alive:  # its socket's EOF, with the process still lingering
            assert time.monotonic() < deadline, "the worker's socket never closed"
            select.select([h], [], [], 0.1)
            with pytest.raises(ModelError):  # what takes the socket's messages in raises the start's error again
                h.poll_ready()
        assert h.kill(reap_timeout_s=4.0) is True and h.returncode == 3
        assert h.stop().how == "already_exited"
    lines = [r.getMessage() for r in caplog.records if r.name == "chestnut.node.worker" and "spawned" not in r.message]
    assert lines == [f"worker pid {h.pid} exited (exit code 3)"]


def test_a_stop_report_reads_as_one_line():
    assert StopReport("asked", 0, 0.1204).describe() == "exited when asked (exit code 0) in 120 ms"
    assert StopReport("killed", -signal.SIGKILL, 2.51).describe() == "ended by SIGKILL (killed by SIGKILL) in 2.5 s"
    assert StopReport("already_exited", 3, 0.0).describe() == "had exited on its own (exit code 3) in 0 ms"
    assert StopReport("not_started", None, 0.0).describe() == "was never started"


@pytest.mark.timeout(30)
def test_stop_asks_first_and_leaves_no_child():
    h = WorkerHandle()
    start_scripted(h)
    wait_ready(h)
    report = h.stop()
    assert (report.how, report.returncode) == ("asked", 0) and report.duration_s < 2.0
    assert children() == [] and h.fileno() == -1


@pytest.mark.timeout(30)
def test_stop_terminates_a_worker_busy_in_a_long_run():
    h = WorkerHandle()
    start_scripted(h)
    wait_ready(h)
    h.submit(1, frame(1.0, SLEEP, 30.0))
    report = h.stop(budget_s=2.0)  # ask 1.0 s, then SIGTERM
    assert (report.how, report.returncode) == ("terminated", -signal.SIGTERM)
    assert 1.0 <= report.duration_s < 2.0 and children() == []


@pytest.mark.timeout(30)
def test_stop_kills_a_hung_worker_inside_the_5_s_budget():
    h = WorkerHandle()
    start_scripted(h)
    wait_ready(h)
    os.kill(h.pid, signal.SIGSTOP)  # ignores STOP and SIGTERM until continued: only SIGKILL ends it
    report = h.stop()
    assert (report.how, report.returncode) == ("killed", -signal.SIGKILL)
    assert 2.5 <= report.duration_s < 4.0 and children() == []


@pytest.mark.timeout(30)
def test_a_dropped_handle_never_leaves_its_worker_behind():
    h = start_scripted(WorkerHandle())
    wait_ready(h)
    procs = tree(h)
    del h
    gc.collect()
    assert_gone(procs)
    assert children() == []


_INTERMEDIATE = """
import sys, time, select
from pathlib import Path
from chestnut.backend.interface import ModelSpec
from chestnut.backend.ladder import LadderConfig
from chestnut.node.runner_loader import RunnerSpec
from chestnut.node.worker_handle import StopReport, WorkerHandle
h = WorkerHandle()
h.start(RunnerSpec(sys.argv[1] + ":ScriptedRunner"), ModelSpec(Path("scripted.onnx"), "scripted"),
        LadderConfig(require_fingerprint=False))
while not h.poll_ready():
    select.select([h], [], [], 0.1)
print(h.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_the_worker_dies_with_its_parent():
    node = subprocess.Popen([sys.executable, "-c", _INTERMEDIATE, str(HERE)], stdout=subprocess.PIPE, text=True)
    try:
        assert node.stdout is not None
        worker_pid = int(node.stdout.readline())
        worker = psutil.Process(worker_pid)
        assert worker.ppid() == node.pid and worker.is_running()
        node.kill()  # SIGKILL: no finaliser, no stop(): only PR_SET_PDEATHSIG can end the worker
        node.wait(5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if worker.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)
        else:
            worker.kill()
            pytest.fail(f"worker {worker_pid} outlived its parent")
    finally:
        if node.poll() is None:
            node.kill()
            node.wait(5)


@pytest.mark.timeout(30)
def test_no_shared_memory_outlives_the_handle():
    dev_shm_before = {n for n in os.listdir("/dev/shm") if "chestnut" in n}
    assert memfds() == []
    with WorkerHandle() as h:
        start_scripted(h)
        wait_ready(h)
        h.submit(1, frame(1.0))
        result = h.poll_result(timeout_s=5, copy=False)  # a view into the slots, still held below
        assert result is not None and result.ok
        both = {"/memfd:chestnut-worker-ctl (deleted)", "/memfd:chestnut-worker-slots (deleted)"}
        assert set(memfds()) == set(memfds(h.pid)) == both  # anonymous: nothing in /dev/shm
        os.kill(h.pid, signal.SIGKILL)
        assert h.poll_result(timeout_s=5) is None and not h.alive
        h.stop()
    assert {n for n in os.listdir("/dev/shm") if "chestnut" in n} == dev_shm_before == set()
    with open("/proc/self/maps") as f:
        maps = f.read()
    assert "chestnut-worker-slots" in maps and "chestnut-worker-ctl" not in maps  # the view keeps its mapping ...
    assert result.outputs["y"].tolist() == [4.0, 4.0, 4.0]
    del result
    with open("/proc/self/maps") as maps:
        assert "chestnut-worker" not in maps.read()  # ... and the last view takes it along
    assert memfds() == []


def test_the_node_side_never_imports_tinygrad():
    code = "import sys, chestnut.node.worker_handle; print('tinygrad' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
