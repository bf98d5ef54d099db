"""A camera that dies under the node (real processes): the node notices its ring's camera is gone, unmaps the
ring at once (its shared memory is freed), says so in one line, and maps the next camera's ring with that
camera's first frame; every frame of the new camera is answered, nothing is a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from nodeharness import NodeProcess, write_node_config

from chestnut.launch.camerad import ring_frame, synthetic_frames
from chestnut.msgs.messaging import drain_sock, sub_sock
from chestnut.msgs.visionipc import FrameReader, FrameRing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

RING_MAPPING = "/memfd:chestnut-frames"  # how a ring's memfd shows in /proc/<pid>/maps (msgs/visionipc.py)


def ring_mappings(pid: int) -> int:
    """How many distinct camera rings process ``pid`` maps now (its /proc/<pid>/maps lines by inode)."""
    with open(f"/proc/{pid}/maps") as f:
        return len({line.split()[4] for line in f if RING_MAPPING in line})


class Outputs:
    """The node's ``modelOutput`` and ``nodeState`` as (frame id, valid, reason) and state names, and the
    camera's ``cameraFrame`` as (frame id, ring session), in order of arrival."""

    def __init__(self, prefix: str) -> None:
        self.poller = zmq.Poller()
        services = ("modelOutput", "nodeState", "cameraFrame")
        self.socks = {s: sub_sock(s, self.poller, prefix=prefix) for s in services}
        self.outputs: list[tuple[int, bool, str]] = []
        self.states: list[str] = []
        self.frames: list[tuple[int, int]] = []

    def wait_for(self, pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            got = pred()
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            self.poller.poll(50)
            for ev in drain_sock(self.socks["modelOutput"]):
                self.outputs.append((int(ev.modelOutput.frameId), bool(ev.valid), str(ev.modelOutput.reason)))
            for ev in drain_sock(self.socks["nodeState"]):
                self.states.append(str(ev.nodeState.state))
            for ev in drain_sock(self.socks["cameraFrame"]):
                self.frames.append((int(ev.cameraFrame.frameId), int(ev.cameraFrame.buffer.session)))

    def close(self) -> None:
        for s in self.socks.values():
            s.close(linger=0)


def camera(prefix: str, log_path: Path) -> subprocess.Popen[bytes]:
    """``chestnut camera``: the 64x32 test pattern through the shared-memory ring, 20 Hz."""
    with open(log_path, "ab") as logf:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "chestnut.launch.cli",
                "camera",
                "--synthetic",
                "--width",
                "64",
                "--height",
                "32",
                "--transport",
                "shm",
            ],
            env={**os.environ, "CHESTNUT_PREFIX": prefix},
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def test_a_killed_camera_is_unmapped_and_the_next_one_is_served(tmp_path: Path, tiny_onnx: Path):
    prefix = os.environ["CHESTNUT_PREFIX"]
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none", standby="warm", preprocess="unit")
    bus = Outputs(prefix)
    node = NodeProcess(cfg, prefix, tmp_path / "node.log").start()
    cams: list[subprocess.Popen[bytes]] = []
    try:
        bus.wait_for(lambda: any(s != "starting" for s in bus.states), 60.0, f"the node\n{node.log_tail()}")
        cams.append(first := camera(prefix, tmp_path / "camera1.log"))
        # more than CAMERA_RESTART_MIN_STEP (msgs/frames.py) frames: the second camera's ids from 0 are a new stream
        bus.wait_for(lambda: sum(v for _, v, _ in bus.outputs) >= 30, 60.0, f"30 outputs\n{node.log_tail()}")
        assert ring_mappings(node.pid) == 1
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        # nothing is published now: the node notices the camera's end of the hand-over socket by itself
        bus.wait_for(lambda: ring_mappings(node.pid) == 0, 30.0, f"the ring unmapped\n{node.log_tail()}")
        n_before = len(bus.outputs)
        cams.append(second := camera(prefix, tmp_path / "camera2.log"))
        # the second camera counts frames from 0 again: its ids run below the first one's
        bus.wait_for(
            lambda: sum(v for _, v, _ in bus.outputs[n_before:]) >= 10,
            60.0,
            f"10 outputs of the second camera\n{node.log_tail()}",
        )
        assert ring_mappings(node.pid) == 1
        second.send_signal(signal.SIGTERM)
        assert second.wait(10) == 0
        bus.wait_for(lambda: ring_mappings(node.pid) == 0, 30.0, "the second ring unmapped after its camera stopped")
        log = node.log_tail(200_000)
    finally:
        for c in cams:
            if c.poll() is None:
                c.kill()
                c.wait(5)
        bus.close()
        node.kill()
    gone = [line for line in log.splitlines() if "camera gone:" in line]
    assert len(gone) == 2, log
    assert gone[0].endswith(
        "its frames are no longer read, the next camera's ring is mapped with its first frame (1 so far)"
    ), log
    assert (
        sum("frame ring of camera session" in line and " mapped (bgr888, 64x32)" in line for line in log.splitlines())
        == 2
    ), log
    assert "Traceback" not in log
    # the second camera's stream: the outputs after the one decrease of ids (its ids count from 0 again);
    # every frame it sent from the first one the node took (the first may go before the node's socket joins
    # it) to the last one answered has exactly one output, in order
    ids = [f for f, _, _ in bus.outputs]
    restart = next(i for i in range(len(ids) - 1, 0, -1) if ids[i] < ids[i - 1])
    second_ids = ids[restart:]
    second_session = bus.frames[-1][1]
    assert len({session for _, session in bus.frames}) == 2
    sent = [f for f, session in bus.frames if session == second_session]
    lo = max(second_ids[0], sent[0])  # this test's own subscriber may join the second camera later than the node
    assert [f for f in second_ids if f >= lo] == [f for f in sent if lo <= f <= second_ids[-1]], (second_ids, sent)
    assert second_ids[0] < 20 and len(second_ids) >= 10
    # a frame of the first camera still queued when its ring went is answered invalid, never from a stale ring
    assert all(v or "bad frame" in why for _, v, why in bus.outputs), bus.outputs


def test_the_reader_names_its_ring_and_says_when_the_camera_is_gone():
    source = synthetic_frames(32, 64, "nv12")
    ring = FrameRing(64 * 48)
    reader = FrameReader()
    try:
        planes = next(source)
        msg = ring_frame(ring, 0, planes, time.monotonic_ns(), "synthetic", "nv12")
        cf = msg.cameraFrame  # type: ignore[attr-defined]
        assert reader.session is None
        np.testing.assert_array_equal(reader.read(cf)[:, :, 0], planes)
        assert reader.session == ring.session
        assert not reader.camera_gone()
        ring.close()
        deadline = time.monotonic() + 10.0
        while not reader.camera_gone():
            assert time.monotonic() < deadline, "the camera's end was not seen"
            time.sleep(0.01)
        assert reader.session is None
        assert not reader.camera_gone()  # said once
    finally:
        ring.close()
        reader.close()
