"""Bounded inputs at the node: a frame over ``cameraFrame``'s bound (``msgs/services.py``) is refused by
ZeroMQ before the node buffers it, and the node goes on serving the frames after it."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from nodeharness import Bus, NodeProcess, write_node_config

from chestnut.msgs.frames import fill_frame
from chestnut.msgs.paths import runtime_dir

pytestmark = [pytest.mark.timeout(120)]

H, W = 32, 64


def test_a_4096x4096_frame_is_refused_by_zeromq_and_the_node_keeps_serving(tmp_path: Path, tiny_onnx: Path) -> None:
    big: dict[str, int] = {}

    def frames(fid: int):  # type: ignore[no-untyped-def]
        if fid == big.get("id"):
            now = time.monotonic_ns()
            return fill_frame(fid, np.zeros((4096, 4096, 3), np.uint8), now, now, "big")  # 50 MB
        return np.random.default_rng(fid).integers(0, 256, (H, W, 3), dtype=np.uint8)

    prefix = os.environ["CHESTNUT_PREFIX"]
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none")
    bus = Bus(prefix, frame_fn=frames)
    bus.start()
    node = NodeProcess(cfg, prefix, tmp_path / "node.log").start()
    try:
        bus.wait_for(lambda r: r.outputs, 60.0, f"the first output\n{node.log_tail()}")
        big["id"] = bus.next_frame_id + 2
        last = big["id"] + 20
        rec = bus.wait_for(
            lambda r: r if any(o.frame_id >= last for o in r.outputs) else None,
            60.0,
            f"outputs after the big frame\n{node.log_tail()}",
        )
        log = node.log_tail(20000)
    finally:
        bus.close()
        node.kill()
        shutil.rmtree(runtime_dir(prefix), ignore_errors=True)
    answered = {o.frame_id: o for o in rec.outputs}
    assert big["id"] not in answered  # never received, so never answered
    after = [answered[f] for f in range(big["id"] + 1, last + 1) if f in answered]
    assert len(after) >= 15, log  # at most a few frames lost while the connection is made again
    assert all(o.valid and o.source == "fallback" for o in after)
    # the publisher still runs: the lost connection is named as the refused message (msgs/messaging.py loss_line)
    assert ("cameraFrame: a message over the service's 16 MiB bound was refused (the connection is dropped by "
            "ZeroMQ's maxmsgsize); connected again (further ones are only counted)") in log
    assert "oversize" not in log  # refused by ZeroMQ, not received and then dropped
