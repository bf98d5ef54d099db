"""The twin's program engine computes in a child process (``backend/sim/compute.py``), so the dock's bridge
answers USB while the GPU loads or runs a program, as separate hardware does.

A LOAD is held in progress deterministically with the compute child's test hook: while the file named by
``$CHESTNUT_TWIN_HOLD_LOAD`` exists, the child holds the LOAD (keeping its own GIL, as a compile does).
No timing assertions: every wait is for a condition.
"""

from __future__ import annotations

import os
import signal
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from test_twin_faults import Host, onnx_reference

from chestnut.backend import protocol as P
from chestnut.backend.sim import compute as C
from chestnut.backend.sim.client import TwinClient, TwinDaemon
from chestnut.backend.sim.twin import Twin, TwinConfig

pytestmark = [pytest.mark.timeout(120)]


def wait_for(cond, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.01)
    return got


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts: it runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def submit_load(h: Host, onnx: bytes, seq: int, program_id: int = 1, at: int = P.VRAM_HEAP_OFFSET) -> int:
    """Write the program and post its LOAD without waiting; returns the signature's VRAM offset."""
    sig = at + (-(-len(onnx) // 4096) * 4096)
    h.mem_write(at, onnx)
    h.submit(h.packet(P.OP_LOAD, seq, program_id, at, 0, len(onnx), sig, 0))
    return sig


def signature_error(h: Host, sig: int) -> str:
    import json

    n = struct.unpack("<I", h.mem_read(sig, 4))[0]
    return json.loads(h.mem_read(sig + 4, n))["error"]


@pytest.fixture
def hold(tmp_path, monkeypatch) -> Path:
    """The hold file, present: every LOAD of a compute child started from now on waits while it exists."""
    path = tmp_path / "hold-load"
    path.touch()
    monkeypatch.setenv(C.HOLD_ENV, str(path))
    return path


@pytest.fixture
def local():
    """An in-process twin with PCIe up, and a Host on it; closed at the end (which ends the compute child)."""
    twin = Twin(TwinConfig(training_delay_s=0.0))
    h = Host(TwinClient.in_process(twin))
    h.bring_up()
    try:
        yield twin, h
    finally:
        twin.close()


def test_the_bridge_answers_control_transfers_while_the_engine_loads_a_program(hold, tiny_onnx):
    onnx = tiny_onnx.read_bytes()
    with TwinDaemon(args=["--training-delay-ms", "2"]) as daemon, daemon.client() as client:
        h = Host(client)
        h.bring_up()
        submit_load(h, onnx, 1)
        wait_for(lambda: client.status()["gpu"]["executing"] == "LOAD seq 1", "the LOAD executing")
        compute = wait_for(lambda: (c := client.status()["gpu"]["compute"]) and c["pid"] and c["pending"] and c,
                           "the compute child working on it")
        assert compute["pid"] != daemon.pid  # the program engine computes in a process of its own
        for _ in range(50):  # the bridge's registers and the PCIe side answer, each within its own timeout
            assert h.xread(P.XDATA_LTSSM, 1, timeout_ms=1000) == bytes([P.LTSSM_L0])
            assert h.completion()["fence"] != 1
            assert h.cfg(4, 0x00)[1:] == (0, 0)  # a config read of the GPU completes
        assert client.status()["gpu"]["executing"] == "LOAD seq 1"  # and the load was in progress throughout
        hold.unlink()
        assert h.wait(1)["status"] == P.STATUS_OK
        x = np.random.default_rng(3).standard_normal((1, 3, 32, 64)).astype(np.float32)
        status, y = h.run(x, 2)
        assert status == P.STATUS_OK
        np.testing.assert_allclose(y, onnx_reference(tiny_onnx, x), rtol=1e-4, atol=1e-5)
        assert client.status()["gpu"]["last_run"]["input_bytes"] == x.nbytes
    wait_for(lambda: gone(compute["pid"]), "the compute child gone with its daemon")


def test_the_compute_child_is_gone_after_the_twin_closes(local, tiny_onnx):
    twin, h = local
    assert h.load(tiny_onnx.read_bytes(), 1)["status"] == P.STATUS_OK
    pid = twin.status()["gpu"]["compute"]["pid"]
    assert pid and pid != os.getpid() and not gone(pid) and C.running_pids() == (pid,)
    twin.close()
    assert gone(pid) and C.running_pids() == ()  # close() waits for it


def test_a_queue_reset_abandons_a_load_in_progress_and_the_engine_goes_on(local, hold, tiny_onnx):
    twin, h = local
    submit_load(h, tiny_onnx.read_bytes(), 1)
    wait_for(lambda: (twin.status()["gpu"]["compute"] or {}).get("pending"), "the LOAD in the compute child")
    h.queue_reset()
    h.submit(h.packet(P.OP_SIGNAL, 2, 0x5151))  # the engine is free while the child still holds the old LOAD
    assert h.wait(2)["signal"] == 0x5151
    assert twin.status()["gpu"]["programs"] == {}
    hold.unlink()
    loaded = h.load(tiny_onnx.read_bytes(), 3)  # the abandoned LOAD's late result was dropped, not this one's
    assert loaded["status"] == P.STATUS_OK and twin.status()["gpu"]["programs"] == {"1": loaded["signature"][
        "sha256"][:16]}


def test_a_compute_child_that_dies_fails_the_packet_and_the_next_one_starts_a_new_child(local, hold, tiny_onnx):
    twin, h = local
    onnx = tiny_onnx.read_bytes()
    sig = submit_load(h, onnx, 1)
    pid = wait_for(lambda: (c := twin.status()["gpu"]["compute"]) and c["pending"] and c["pid"], "the held LOAD")
    os.kill(pid, signal.SIGKILL)
    assert h.wait(1)["status"] == P.STATUS_RUN_FAILED  # a GPU-side failure, not the model's
    assert signature_error(h, sig).startswith("ComputeDied: ")
    hold.unlink()
    assert h.load(onnx, 2)["status"] == P.STATUS_OK
    compute = twin.status()["gpu"]["compute"]
    assert compute["starts"] == 2 and compute["pid"] != pid


def test_a_run_after_the_child_was_replaced_compiles_the_program_again(local, tiny_onnx):
    twin, h = local
    assert h.load(tiny_onnx.read_bytes(), 1)["status"] == P.STATUS_OK
    x = np.random.default_rng(4).standard_normal((1, 3, 32, 64)).astype(np.float32)
    status, first = h.run(x, 2)
    assert status == P.STATUS_OK
    pid = twin.status()["gpu"]["compute"]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: twin.status()["gpu"]["compute"]["pid"] is None, "the dead child noticed")
    status, again = h.run(x, 3)  # a new child, which never compiled it: the engine loads it there again
    assert status == P.STATUS_OK
    assert again.tobytes() == first.tobytes()  # bit-exact
    assert twin.status()["gpu"]["compute"]["starts"] == 2


def test_a_compile_failure_is_reported_with_the_error():
    twin = Twin(TwinConfig(training_delay_s=0.0))
    try:
        h = Host(TwinClient.in_process(twin))
        h.bring_up()
        garbage = h.load(b"not an onnx model", 1)
        assert garbage["status"] == P.STATUS_COMPILE_FAILED
        assert garbage["signature"]["error"].startswith("ModelError: ")
    finally:
        twin.close()


def test_priorities_stay_below_the_nodes():
    assert C.check_priority(0, "x") == 0 and C.check_priority(C.MAX_PRIORITY, "x") == C.MAX_PRIORITY
    with pytest.raises(ValueError, match="below the node's realtime priority"):
        C.check_priority(54, "compute priority")
    assert C.DEFAULT_PRIORITY < C.DEFAULT_BRIDGE_PRIORITY <= C.MAX_PRIORITY < 50
