"""``chestnut camera``: an inline frame over cameraFrame's bound is refused at start; auto sends it by the ring."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np

from chestnut.launch.camerad import inline_frame_error
from chestnut.msgs.messaging import recv_one, sub_sock
from chestnut.msgs.services import get_service

ROOT = Path(__file__).resolve().parents[1]
CHESTNUT = str(ROOT / ".venv/bin/chestnut")
# 4097 x 1365 x 3 = 16777215 bytes: the pixels fit cameraFrame's 16 MiB bound (and a ring slot), the message does not
W, H = 4097, 1365


def test_the_bound_counts_the_message_not_only_the_pixels():
    bound = get_service("cameraFrame").max_bytes
    assert W * H * 3 == bound - 1
    why = inline_frame_error(np.zeros((H, W, 3), np.uint8), "synthetic", "bgr888")
    assert why is not None
    assert why.startswith("--transport inline: a frame of 16777215 bytes makes a ")
    assert why.endswith(
        "-byte cameraFrame message, over the service's bound of 16777216 bytes (msgs/services.py), "
        "which every subscriber drops; use --transport shm (or auto)"
    )
    assert inline_frame_error(np.zeros((1208 * 3 // 2, 1928, 1), np.uint8), "synthetic", "nv12") is None


def test_inline_over_the_bound_is_one_line_and_exit_2():
    r = subprocess.run(
        [CHESTNUT, "camera", "--synthetic", "--width", str(W), "--height", str(H), "--transport", "inline"]
        + ["--frames", "1", "--start-delay", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert lines[0].endswith("which every subscriber drops; use --transport shm (or auto)")
    assert "sent" not in r.stderr


def test_auto_sends_that_frame_through_the_ring():
    sock = sub_sock("cameraFrame", timeout_ms=20000)
    cam = subprocess.Popen(
        [CHESTNUT, "camera", "--synthetic", "--width", str(W), "--height", str(H), "--frames", "1"]
        + ["--start-delay", "1"],
        cwd=ROOT,
    )
    try:
        ev = recv_one(sock)
        assert ev is not None, "no frame within 20 s"
        cf = ev.cameraFrame
        assert cf._has("buffer") and len(cf.data) == 0
        assert (cf.width, cf.height, cf.buffer.size) == (W, H, W * H * 3)
        assert cam.wait(30) == 0
    finally:
        cam.kill()
        sock.close(linger=0)


def test_frames_queued_for_a_slow_subscriber_reach_it_after_the_camera_stops():
    """``chestnut launch --transport inline --frames native``: the logger, behind the 7 MB frames, missed the
    last ones the node answered (a contract violation with no fault), since the camera's linger held only while
    its ZeroMQ context was terminated, and pyzmq does not terminate it at exit. A subscriber that takes a frame
    every 100 ms (ZeroMQ holds one for it) gets all six after the camera has sent them and exited."""
    sock = sub_sock("cameraFrame", timeout_ms=20000, rcvhwm=1)
    cam = subprocess.Popen(
        [CHESTNUT, "camera", "--synthetic", "--native", "--transport", "inline", "--frames", "6", "--start-delay", "1",
         "--rt-priority", "0"],
        cwd=ROOT,
    )
    ids = []
    try:
        for _ in range(6):
            ev = recv_one(sock)
            assert ev is not None, f"frames {ids}, then none within 20 s"
            assert len(ev.cameraFrame.data) == 1208 * 1928 * 3
            ids.append(ev.cameraFrame.frameId)
            time.sleep(0.1)  # the slow subscriber's pace
        assert cam.wait(timeout=30) == 0
    finally:
        cam.kill()
        cam.wait()
        sock.close(linger=0)
    assert len(ids) == 6 and ids == sorted(set(ids)), ids
