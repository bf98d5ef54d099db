"""A publisher's ``ipc://`` socket file goes with it: closed in-process or on a program's clean SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from chestnut.msgs.messaging import pub_sock
from chestnut.msgs.paths import runtime_dir


def _sockets(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.is_socket())


def test_closed_publisher_unlinks_its_socket_file() -> None:
    d = runtime_dir()
    sock = pub_sock("modelOutput")
    assert _sockets(d) == ["modelOutput"]
    sock.close()
    assert _sockets(d) == []


def test_closed_publisher_leaves_a_replaced_file_alone() -> None:
    d = runtime_dir()
    sock = pub_sock("modelOutput")
    path = d / "modelOutput"
    path.unlink()
    import socket

    other = socket.socket(socket.AF_UNIX)
    other.bind(str(path))  # someone else's file at the path now: not ours to remove
    try:
        sock.close()
        assert _sockets(d) == ["modelOutput"]
    finally:
        other.close()


def _wait_for(pred, timeout_s: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_camera_sigterm_leaves_no_socket_file() -> None:
    d = runtime_dir()
    cmd = [sys.executable, "-m", "chestnut.launch.cli", "camera", "--synthetic", "--rate", "20", "--start-delay", "0"]
    proc = subprocess.Popen(cmd, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert _wait_for(lambda: "cameraFrame" in _sockets(d)), "camera never bound cameraFrame"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert _sockets(d) == []


def test_twin_sigterm_leaves_no_socket_file() -> None:
    from chestnut.backend.sim.client import TwinDaemon
    from chestnut.msgs.paths import current_prefix

    d = runtime_dir()
    daemon = TwinDaemon(current_prefix()).start()
    try:
        assert _wait_for(lambda: {"twinState", "twinFault"} <= set(_sockets(d))), _sockets(d)
    finally:
        rc = daemon.stop()
    assert rc == 0
    assert _sockets(d) == []
