"""Node-level contracts of ``chestnut run`` that need no twin: the node as a real child process, frames and
subscribers in this process (``nodeharness.Bus``).

- without a dock (``dock.kind = "none"``) every frame is answered by the fallback, with its exact output;
- a malformed frame gets exactly one invalid ``modelOutput`` with a precise reason, and serving goes on;
- no usable fallback: exit code ``EXIT_NO_FALLBACK`` (3) and a log line naming the file; a bad
  configuration: ``EXIT_CONFIG`` (2) naming the key;
- ``READY=1``, then ``WATCHDOG=1`` (at half of ``WATCHDOG_USEC``), then ``STOPPING=1`` reach ``$NOTIFY_SOCKET``;
- SIGINT and SIGTERM stop the node within the 5 s budget with its primary worker (``dock.kind = "cpu"``)
  stopped and no child process left.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from nodeharness import (
    Bus,
    NodeProcess,
    exit_of,
    record_fingerprint,
    running_node,
    unanswered_frames,
    write_node_config,
)

from chestnut.launch.camerad import fill_frame
from chestnut.node.main import EXIT_CONFIG, EXIT_NO_FALLBACK
from chestnut.node.preprocess import preprocess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

H, W = 32, 64


def frame(fid: int) -> np.ndarray:
    """The deterministic test frame ``fid``: uint8 noise [32, 64, 3]."""
    return np.random.default_rng(fid).integers(0, 256, (H, W, 3), dtype=np.uint8)


def running(tmp_path: Path, cfg: Path, frame_fn: Callable[[int], Any] = frame, env: dict[str, str] | None = None,
            record_tensors: bool = False) -> contextlib.AbstractContextManager[tuple[NodeProcess, Bus]]:
    """:func:`nodeharness.running_node` with this module's frames, logging to ``tmp_path/node.log``."""
    return running_node(cfg, tmp_path / "node.log", frame_fn, env=env, record_tensors=record_tensors)


def finish(bus: Bus, node: NodeProcess, n_frames: int) -> Any:
    """Wait for ``n_frames`` outputs, stop the camera, wait for the last sent frame's output."""
    bus.wait_for(lambda r: len(r.outputs) >= n_frames, 60.0, f"{n_frames} outputs\n{node.log_tail()}")
    bus.publishing = False
    last = max(bus.snapshot().sent)
    return bus.wait_for(lambda r: r if any(o.frame_id == last for o in r.outputs) else None, 10.0,
                        "the last frame's output")


def test_without_a_dock_every_frame_is_answered_by_the_fallback(tmp_path: Path, tiny_onnx: Path) -> None:
    import onnxruntime as ort

    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none", standby="warm")
    with running(tmp_path, cfg, record_tensors=True) as (node, bus):
        rec = finish(bus, node, 30)
        log = node.log_tail()
    assert unanswered_frames(rec) == ([], []), log
    ids = [o.frame_id for o in rec.outputs]
    assert all(a < b for a, b in zip(ids, ids[1:], strict=False))
    assert {(o.source, o.valid, o.deadline_missed) for o in rec.outputs} == {("fallback", True, False)}
    sess = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])
    for o in rec.outputs[:5] + rec.outputs[-5:]:
        want = sess.run(["prob"], preprocess("unit", frame(o.frame_id), "x", (1, 3, H, W)))[0]
        assert o.tensors is not None and set(o.tensors) == {"prob"}
        np.testing.assert_array_equal(o.tensors["prob"], want)
    assert rec.active and not any(a.active for a in rec.active)
    assert rec.active[-1].reason == "usb ERROR: dock disabled (dock.kind = none)"
    assert rec.states[-1].state == "degraded" and rec.states[-1].worker_pid == 0


def test_a_malformed_frame_gets_one_invalid_output_and_serving_goes_on(tmp_path: Path, tiny_onnx: Path) -> None:
    bad: dict[int, str] = {}  # frame id -> what is wrong with it; set once the node answers

    def frames(fid: int) -> Any:
        if bad.get(fid) == "size":                          # 48x32 instead of 64x32
            return frame(fid)[:, :48]
        if bad.get(fid) == "bytes":                         # says 32x64 BGR, carries 100 bytes
            now = time.monotonic_ns()
            msg = fill_frame(fid, frame(fid), now, now, "bad")
            msg.cameraFrame.data = bytes(100)
            return msg
        return frame(fid)

    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none")
    with running(tmp_path, cfg, frame_fn=frames) as (node, bus):
        bus.wait_for(lambda r: r.outputs, 60.0, "the first output")
        first = bus.next_frame_id + 2
        bad.update({first: "size", first + 3: "bytes"})
        last = first + 8
        rec = bus.wait_for(lambda r: r if any(o.frame_id >= last for o in r.outputs) else None, 30.0, "more frames")
        log = node.log_tail()
    by_id = {o.frame_id: o for o in rec.outputs}
    assert unanswered_frames(rec, last_id=last) == ([], []), log
    size, short = by_id[first], by_id[first + 3]
    assert (size.valid, size.source, size.reason) == (
        False, "none", "bad frame: frame is 48x32 (WxH), the model wants 64x32 (WxH, from its input shape N,C,H,W "
        "[1, 3, 32, 64])")
    assert (short.valid, short.source, short.reason) == (
        False, "none", f"bad frame: cameraFrame {first + 3}: 100 bytes for 32x64x3 (HxWxC)")
    good = [o for o in rec.outputs if o.frame_id not in bad and o.frame_id <= last]
    assert len(good) >= 7 and all(o.valid and o.source == "fallback" for o in good)
    assert f"WARNING chestnut.node: cameraFrame {first} unusable: frame is 48x32 (WxH), the model wants 64x32" in log
    assert " ERROR " not in log  # a bad camera frame is the camera's problem, answered; no alarm


def test_missing_fallback_model_exits_with_EXIT_NO_FALLBACK(tmp_path: Path, tiny_onnx: Path) -> None:
    missing = tmp_path / "nowhere.onnx"
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none", fallback_model=missing)
    rc, log = exit_of(cfg, tmp_path / "node.log", 30)
    assert rc == EXIT_NO_FALLBACK == 3, log
    assert (f"no usable fallback model ({missing}, onnxruntime): ModelError: missing_model: fallback model file "
            f"{missing} does not exist") in log


def test_unusable_config_exits_with_EXIT_CONFIG(tmp_path: Path, tiny_onnx: Path) -> None:
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none", timing={"deadline_msec": 100})
    rc, log = exit_of(cfg, tmp_path / "node.log", 30)
    assert rc == EXIT_CONFIG == 2
    assert "unknown key timing.deadline_msec" in log


def received(sock: socket.socket) -> tuple[float, str]:
    msg = sock.recv(256).decode()
    return time.monotonic(), msg


def test_sd_notify_ready_watchdog_stopping(tmp_path: Path, tiny_onnx: Path) -> None:
    addr = f"@chestnut-notify-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + addr[1:])
    sock.settimeout(20.0)
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none")
    got: list[tuple[float, str]] = []
    try:
        with running(tmp_path, cfg, env={"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "400000"}) as (node, bus):
            while sum(m == "WATCHDOG=1" for _, m in got) < 3:
                got.append(received(sock))
            prompt = len(got)  # read as they came; those sent during the wait below are read in one go later
            # it answers frames while it beats (waited for: on a busy host the first frames can take longer than
            # the three beats' 0.4 s to reach it; fails after 30 s)
            bus.wait_for(lambda r: r if r.outputs else None, 30.0, "a frame answered")
            rc, _ = node.stop(signal.SIGTERM)
            while got[-1][1] != "STOPPING=1":
                got.append(received(sock))
    finally:
        sock.close()
    msgs = [m for _, m in got]
    assert msgs[0] == "READY=1"
    assert msgs[1:4] == ["WATCHDOG=1"] * 3
    assert msgs[-1] == "STOPPING=1" and rc == 0
    assert set(msgs) == {"READY=1", "WATCHDOG=1", "STOPPING=1"}
    # WATCHDOG=1 at half of WATCHDOG_USEC (0.2 s), never faster
    beats = [t for t, m in got[:prompt] if m == "WATCHDOG=1"]
    assert all(b - a >= 0.15 for a, b in zip(beats, beats[1:], strict=False)), beats


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_within_5_s_with_the_worker_reaped(tmp_path: Path, tiny_onnx: Path, sig: int) -> None:
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="cpu")
    with running(tmp_path, cfg) as (node, bus):
        rec = bus.wait_for(lambda r: r if r.outputs and r.outputs[-1].source == "primary" else None, 60.0,
                           "the primary (host CPU worker) serving")
        tree = node.descendants()
        assert rec.states[-1].worker_pid in {p.pid for p in tree}
        rc, took_s = node.stop(sig)
        log = node.log_tail()
        # the node's last words were sent before it exited; the bus thread takes them in on its own time
        bus.wait_for(lambda r: r.states and r.states[-1].state == "stopping" and r.active
                     and r.active[-1].active is False, 10.0, "nodeState stopping and chestnutActive false, last")
    assert rc == 0 and took_s <= 5.0, (rc, took_s, log)
    _, alive = psutil.wait_procs(tree, timeout=0.5)
    assert alive == []
    assert "stopped by the node (asked)" in log


@pytest.mark.parametrize(("toml", "message"), [
    ("[to_json]\nx = 1\n", "unknown section [to_json]"),
    ("timing = 3\n", "is a section (a table of keys), not the value 3"),
    ("[timing]\nbackoff_initial_s = 5\nbackoff_max_s = 1\n", "timing.backoff_initial_s = 5.0, backoff_max_s = 1.0"),
    ("[timing]\nmiss_run = 0\n", "timing.miss_run = 0; want > 0"),
    ("[timing]\ndeadline_ms = 3000\n", "timing.deadline_ms = 3000.0; want 0 < it < dock.wait_timeout_ms (3000)"),
    ("[model.ranges]\nprob = [1.0, 0.0]\n",
     "model.ranges.prob = [1.0, 0.0]; want [low, high], two finite numbers with low <= high"),
    ("[dock]\nkind = \"usb\"\n", "dock.kind = 'usb'; use one of twin, real, cpu, none"),
])
def test_config_errors_name_the_key(tmp_path: Path, toml: str, message: str) -> None:
    from chestnut.backend.errors import ConfigError
    from chestnut.node.config import load_config

    path = tmp_path / "node.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value)


def test_config_timing_keys_reach_the_supervisor_and_watchdog(tmp_path: Path, tiny_onnx: Path) -> None:
    from chestnut.node.config import load_config
    from chestnut.node.main import Node

    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none", timing={
        "backoff_initial_s": 0.25, "backoff_max_s": 2.0, "flap_max_failovers": 7, "shadow_frames": 5,
        "hang_margin_ms": 100.0, "miss_run": 4})
    node = Node(load_config(cfg))
    sc, wc = node.sup.config, node.watchdog.config
    assert (sc.backoff_initial_s, sc.backoff_max_s, sc.flap_max_failovers, sc.shadow_frames) == (0.25, 2.0, 7, 5)
    assert (wc.hang_margin_ms, wc.miss_run, wc.wait_timeout_ms, wc.frame_deadline_ms) == (100.0, 4, 3000.0, 150.0)


def test_a_restarted_camera_is_followed_as_a_new_stream(tmp_path: Path, tiny_onnx: Path) -> None:
    """The camera restarts and counts from 0 again (with newer timestamps): the node is not blinded until the
    new ids pass the old ones; it follows the new stream at once and says so."""
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none")
    with running(tmp_path, cfg) as (node, bus):
        bus.wait_for(lambda r: len(r.outputs) >= 40, 60.0, "40 outputs")
        before = len(bus.snapshot().outputs)
        bus.next_frame_id = 0  # the camera process restarted
        rec = bus.wait_for(lambda r: r if any(o.frame_id >= 10 for o in r.outputs[before + 1:]) and
                           r.outputs[-1].frame_id < 40 else None, 30.0, "outputs of the new stream")
        log = node.log_tail()
    after = [o.frame_id for o in rec.outputs[before - 1:]]
    k = next(i for i in range(1, len(after)) if after[i] < after[i - 1])
    assert after[k] <= 1 and all(a < b for a, b in zip(after[k:], after[k + 1:], strict=False)), after
    assert "camera restarted: frame id" in log and "following the new stream (restart 1)" in log


def corrupted_model(path: Path, height: int = H, width: int = W) -> Path:
    """A model file that still parses but computes NaN: two convolutions and a sigmoid (no ReLU, which may
    turn NaN into 0), 1000 bytes of the first weights overwritten with 0xFF (a float32 NaN) mid-file."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    w1 = (rng.standard_normal((16, 3, 3, 3)) * 0.2).astype(np.float32)  # 1728 bytes
    w2 = (rng.standard_normal((1, 16, 3, 3)) * 0.2).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1"], ["h"], pads=[1, 1, 1, 1], strides=[2, 2]),
         helper.make_node("Conv", ["h", "w2"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Sigmoid", ["c"], ["prob"])],
        "nan", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, height, width])],
        [helper.make_tensor_value_info("prob", TensorProto.FLOAT, [1, 1, height // 2, width // 2])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    data = bytearray(model.SerializeToString())
    at = data.find(w1.tobytes()) + 300
    data[at:at + 1000] = b"\xff" * 1000
    path.write_bytes(bytes(data))
    onnx.checker.check_model(onnx.load(str(path)))  # it still parses
    return path


def test_a_model_that_computes_nan_is_never_published_as_valid(tmp_path: Path) -> None:
    """The primary is refused at its warm-up (non-finite outputs) and the fallback, the same file, computes NaN
    too: every frame is answered with ``valid=False``, the fallback's reason first, no tensors, and
    ``ChestnutActive`` stays false."""
    model = corrupted_model(tmp_path / "nan.onnx")
    cfg = write_node_config(tmp_path / "node.toml", model, dock="cpu")
    with running(tmp_path, cfg, record_tensors=True) as (node, bus):
        bus.wait_for(lambda r: any("nonfinite" in s.reason for s in r.states), 60.0,
                     f"the primary refused at its warm-up\n{node.log_tail()}")
        rec = finish(bus, node, len(bus.snapshot().outputs) + 10)
        log = node.log_tail()
    assert unanswered_frames(rec) == ([], []), log
    nan = "fallback output invalid: prob: 512 non-finite value(s) (512 NaN, 0 inf), first at (0, 0, 0, 0); "
    assert {(o.source, o.valid, o.deadline_missed) for o in rec.outputs} == {("fallback", False, False)}
    assert all(o.reason.startswith(nan) and len(o.reason) > len(nan) for o in rec.outputs), rec.outputs[-1].reason
    assert all(o.tensors == {} for o in rec.outputs)
    assert rec.active and not any(a.active for a in rec.active)
    assert "OutputLayerError" in log or "nonfinite" in log
    assert "fallback output invalid: prob: 512 non-finite value(s)" in log


def test_a_fallback_output_outside_its_declared_range_is_not_valid(tmp_path: Path, tiny_onnx: Path) -> None:
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none", ranges={"prob": (2.0, 3.0)})
    with running(tmp_path, cfg) as (node, bus):
        rec = finish(bus, node, 10)
    assert {(o.source, o.valid) for o in rec.outputs} == {("fallback", False)}
    want = (r"fallback output invalid: prob: 512 value\(s\) outside \[2, 3\] \(min 0\.\d+, max 0\.\d+\), first at "
            r"\(0, 0, 0, 0\); dock_absent \(usb\): dock disabled \(dock\.kind = none\); retry in \d+ s")
    assert all(re.fullmatch(want, o.reason) for o in rec.outputs), rec.outputs[-1].reason


def test_a_frame_whose_timestamp_gives_no_age_is_not_published_as_fact(tmp_path: Path, tiny_onnx: Path) -> None:
    """``timestampEof`` 0 (never set) or in the future: the primary still answers, but the output is not valid,
    says why, carries no made-up age, and ``ChestnutActive`` drops for it."""
    stamp: dict[int, int] = {}  # frame id -> timestampEof relative to now (ns); 0 stands for "0 absolute"

    def frames(fid: int) -> Any:
        now = time.monotonic_ns()
        if fid in stamp:
            return fill_frame(fid, frame(fid), now, 0 if stamp[fid] == 0 else now + stamp[fid], "bad-clock")
        return frame(fid)

    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="cpu")
    with running(tmp_path, cfg, frame_fn=frames) as (node, bus):
        bus.wait_for(lambda r: r if len(r.outputs) > 3 and all(o.source == "primary" for o in r.outputs[-3:])
                     and r.active and r.active[-1].active else None, 60.0, "the primary serving")
        first = bus.next_frame_id + 2
        stamp.update({first: 0, first + 3: 10 * 1_000_000_000})
        last = first + 8
        rec = bus.wait_for(lambda r: r if any(o.frame_id >= last for o in r.outputs) else None, 30.0, "more frames")
        log = node.log_tail()
    by_id = {o.frame_id: o for o in rec.outputs}
    unset, future = by_id[first], by_id[first + 3]
    no_age = f"cameraFrame {first}: timestampEof is 0 (not set): the frame's age is unknown"
    assert (unset.source, unset.valid, unset.reason, unset.frame_age_s) == ("primary", False, no_age, 0.0)
    assert (future.source, future.valid, future.frame_age_s) == ("primary", False, 0.0)
    assert re.fullmatch(rf"cameraFrame {first + 3}: timestampEof is 99\d\d\.\d ms ahead of this host's "
                        r"CLOCK_MONOTONIC: the frame's age is unknown", future.reason), future.reason
    good = [o for o in rec.outputs if first - 2 <= o.frame_id <= last and o.frame_id not in stamp]
    assert all(o.valid and o.source == "primary" and 0.0 < o.frame_age_s < 1.0 for o in good), good
    drops = [a for a in rec.active if not a.active and a.reason.startswith("output not valid: cameraFrame")]
    assert [a.reason for a in drops] == [f"output not valid: {no_age}", f"output not valid: {future.reason}"]
    assert rec.active[-1].active
    assert f"WARNING chestnut.node: {no_age}; its output is published as not valid (1 such frames so far)" in log



def test_a_fallback_that_computes_nan_neither_answers_nor_fails_a_healthy_primary_over(
        tmp_path: Path, tiny_onnx: Path) -> None:
    """Hot standby with a fallback model that computes NaN: it is no agreement reference, so the healthy primary
    is not failed over for disagreeing with it and serves valid outputs (no agreement checked); before the
    primary serves, no frame is published as valid."""
    fp = record_fingerprint(tiny_onnx, tmp_path / "tiny.fingerprint.json")  # without one, output is WARN
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="cpu", standby="hot", fingerprint=fp,
                            fallback_model=corrupted_model(tmp_path / "nan.onnx"))
    with running(tmp_path, cfg) as (node, bus):
        bus.wait_for(lambda r: r if len(r.outputs) > 3 and r.outputs[-1].source == "primary" else None, 60.0,
                     f"the primary serving\n{node.log_tail()}")
        rec = finish(bus, node, len(bus.snapshot().outputs) + 20)
        log = node.log_tail()
    first = next(i for i, o in enumerate(rec.outputs) if o.source == "primary")
    before, served = rec.outputs[:first], rec.outputs[first:]
    assert before and all(o.source == "fallback" and not o.valid and o.reason.startswith(
        "fallback output invalid: prob: 512 non-finite value(s)") for o in before), before[-1]
    assert len(served) >= 20
    assert {(o.source, o.valid, o.reason, o.agreement_checked) for o in served} == {("primary", True, "", False)}, log
    assert rec.active[-1].active and rec.active[-1].reason == "all layers OK"
    assert rec.states[-1].state == "active" and "primary_fault" not in log and "shadow_disagreed" not in log


def test_the_process_manager_entry_reads_its_config_from_the_environment(tmp_path: Path, tiny_onnx: Path) -> None:
    """``python -m chestnut.node.main`` (openpilot's ``PythonProcess`` runs a module's ``main()``) takes
    ``$CHESTNUT_CONFIG``: a config with an unknown key exits ``EXIT_CONFIG`` naming it, before any socket."""
    import subprocess
    import sys

    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none", timing={"deadline_msec": 100})
    proc = subprocess.run([sys.executable, "-m", "chestnut.node.main"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CHESTNUT_CONFIG": str(cfg)})
    assert proc.returncode == EXIT_CONFIG == 2, proc.stderr
    assert "ERROR chestnut.node: unusable configuration: config: unknown key timing.deadline_msec; known: " in (
        proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr
