"""The node (a real ``chestnut run`` child) on openpilot-sized frames from the shared-memory ring: every
1928x1208 NV12 frame read in place, warped on the CPU (``preprocess = "warp:unit"``) and answered with
the exact output of the model on that warped input."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nodeharness import Bus, NodeProcess, unanswered_frames, write_node_config

from chestnut.launch.camerad import ring_frame, synthetic_frames
from chestnut.msgs.paths import runtime_dir
from chestnut.msgs.visionipc import FrameRing
from chestnut.node.preprocess import preprocess

pytestmark = [pytest.mark.timeout(120)]

ROWS, COLS = 1208, 1928  # openpilot's road camera frame, NV12: 3.5 MB


def test_every_nv12_ring_frame_is_answered_with_the_model_on_its_warped_input(tmp_path: Path, tiny_onnx: Path):
    import onnxruntime as ort

    prefix = os.environ["CHESTNUT_PREFIX"]
    source = synthetic_frames(ROWS, COLS, "nv12")
    sent: dict[int, np.ndarray] = {}
    ring = FrameRing(ROWS * COLS * 3 // 2)

    def frame_fn(fid: int) -> Any:
        planes = next(source)
        sent[fid] = planes
        now = time.monotonic_ns()
        return ring_frame(ring, fid, planes, now, "synthetic", "nv12")

    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none", standby="warm", preprocess="warp:unit")
    bus = Bus(prefix, frame_fn=frame_fn, record_tensors=True)
    bus.publishing = False  # frames queued while the node starts would find their slots overwritten
    bus.start()
    node = NodeProcess(cfg, prefix, tmp_path / "node.log").start()
    try:
        bus.wait_for(lambda r: any(s.state != "starting" for s in r.states), 60.0, f"ready\n{node.log_tail()}")
        bus.publishing = True
        bus.wait_for(lambda r: sum(o.valid for o in r.outputs) >= 30, 90.0, f"30 outputs\n{node.log_tail()}")
        bus.publishing = False
        last = max(bus.snapshot().sent)
        rec = bus.wait_for(lambda r: r if any(o.frame_id == last for o in r.outputs) else None, 30.0, "the last")
        log = node.log_tail()
    finally:
        bus.close()
        node.kill()
        ring.close()
        shutil.rmtree(runtime_dir(prefix), ignore_errors=True)
    assert unanswered_frames(rec) == ([], []), log
    # a node that fell more than the ring's depth behind (a loaded machine) answers those frames invalid,
    # naming the overwritten slot; every other frame is the fallback's valid answer
    late = [o for o in rec.outputs if (o.source, o.valid) != ("fallback", True)]
    assert all((o.source, o.valid) == ("none", False) and "was overwritten" in o.reason for o in late), log
    sess = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])
    valid = [o for o in rec.outputs if o.valid]
    for o in valid[:3] + valid[-3:]:
        x = preprocess("warp:unit", sent[o.frame_id][:, :, None], "x", (1, 3, 32, 64), "nv12")
        assert o.tensors is not None
        np.testing.assert_array_equal(o.tensors["prob"], sess.run(["prob"], x)[0])
