"""The twin runner's primary path on tinygrad 0.14's own copy protocol (the default): weights, inputs and
outputs move through ``AMDAllocator._copyin`` / ``_copyout`` and the twin's SDMA queue; the model runs on the
twin's program engine; after a copy failure the runner refuses every later call without touching the dock
(tinygrad would return zeros on a same-process retry)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from twinfixtures import twin_fixtures

from chestnut.backend import protocol as P
from chestnut.backend.errors import UsbLayerError
from chestnut.backend.interface import ModelSpec
from chestnut.backend.ladder import LadderConfig
from chestnut.backend.model import OnnxModel
from chestnut.backend.twin_runner import TwinRunner

pytestmark = pytest.mark.timeout(120)
PREFIX = f"t{os.getpid()}-twinrunner-tg"


daemon, dock = twin_fixtures(PREFIX)


@pytest.fixture
def runner(dock, tiny_onnx):
    r = TwinRunner(PREFIX, config=LadderConfig(stability_window_s=0.05))
    r.load(ModelSpec(tiny_onnx, "tiny"))
    yield r
    r.close()


def frame(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((1, 3, 32, 64)).astype(np.float32)}


def test_weights_inputs_and_outputs_cross_on_tinygrads_copy_path(runner, dock, tiny_onnx):
    cpu = OnnxModel(tiny_onnx, name="tiny")
    assert runner.copy_protocol == "tinygrad" and runner.copy is None
    loaded = (runner.tinygrad.copies_in, runner.tinygrad.copies_out)
    gpu_before = dock.status()["gpu"]
    for seed in range(3):
        assert np.array_equal(runner.run(frame(seed))["prob"], cpu.run(frame(seed))["prob"])
    gpu = dock.status()["gpu"]
    # load: the ONNX bytes and the tensor table in, the signature's length and JSON out
    assert loaded == (2, 2)
    assert (runner.tinygrad.copies_in, runner.tinygrad.copies_out) == (2 + 3, 2 + 3)
    # per run: one input copy-in (1 chunk: wait, poll, copy, write, signal) and one output copy-out piece
    # (wait, copy, cq_buf write, signal) on the SDMA queue; only OP_RUN on the program engine's ring
    assert gpu["sdma"]["executed"] - gpu_before["sdma"]["executed"] == 3 * (5 + 4)
    assert gpu["executed"] - gpu_before["executed"] == 3
    assert gpu["sdma"]["error_count"] == 0
    assert runner.probe().fence == 2 + 3  # tinygrad's drain fence (XDATA 0xA800): one chunk per copy-in


def test_a_short_bulk_out_is_sent_again_and_the_frame_served(runner, dock, tiny_onnx):
    """A short bulk OUT of the input's first chunk -- async, as tinygrad's ``_copyin`` sends it, so tinygrad's
    ``USB3`` latches it (``"async bulk OUT failed: status=-1"``) -- through the transport the node's worker uses
    (``RetryingUSB3`` over the twin's ``USB3`` face): re-armed, sent whole again, the frame's output the
    CPU's, the error counted as retried."""
    cpu = OnnxModel(tiny_onnx, name="tiny")
    before = runner.usb.stats()
    dock.fault("short", on="bulk_out", after=3)  # the input's first chunk, past the ring and doorbell writes
    assert np.array_equal(runner.run(frame(0))["prob"], cpu.run(frame(0))["prob"])
    assert sum(f["fired"] for f in dock.status()["fault_history"] + dock.status()["faults"]) == 1
    after = runner.usb.stats()
    assert (after["errors"] - before["errors"], after["retried_ok"] - before["retried_ok"]) == (1, 1)
    assert after["last_error"].startswith("async bulk OUT 0x02: short_transfer: RuntimeError: async bulk OUT "
                                          "failed: status=-1"), after["last_error"]
    assert np.array_equal(runner.run(frame(1))["prob"], cpu.run(frame(1))["prob"])  # and the next one


def test_after_a_copy_failure_the_runner_refuses_without_touching_the_dock(runner, dock):
    dock.fault("stall", on="bulk_out", after=3)  # the input's first chunk, past the ring and doorbell writes
    with pytest.raises(UsbLayerError) as first:
        runner.run(frame(0))
    assert first.value.reason == "stall"  # a halted endpoint is not transient: never retried
    dock.clear()
    # the failed copy's ring is on the engine: let it reach the chunk's sentinel poll (the chunk never came), so
    # what it executes below is what a second run would add, not the rest of the first
    end = time.monotonic() + 10
    while dock.status()["gpu"]["sdma"]["polling"] is None and time.monotonic() < end:
        time.sleep(0.01)
    before = dock.status()["gpu"]
    with pytest.raises(UsbLayerError) as again:
        runner.run(frame(0))
    assert "failed earlier in this runner; qualify it again from a fresh process" in str(again.value)
    after = dock.status()["gpu"]
    assert (after["sdma"]["executed"], after["sdma"]["wptr"], after["executed"]) == (
        before["sdma"]["executed"], before["sdma"]["wptr"], before["executed"])


def test_the_sdma_layout_leaves_the_programs_ring_and_the_heap_apart():
    assert P.RING_VRAM_OFFSET + P.RING_BYTES <= P.SDMA_RING_VRAM_OFFSET
    assert P.SDMA_RING_VRAM_OFFSET + P.SDMA_RING_BYTES <= P.SDMA_RPTR_VRAM_OFFSET < P.SIGNAL_VRAM_OFFSET
    assert P.SIGNAL_VRAM_OFFSET + 16 <= P.VRAM_HEAP_OFFSET
    assert P.CPL_QUEUE_FENCE >= 16  # tinygrad's copy-out writes cq_buf+12: the completion block sits past it


def test_a_link_that_went_down_between_frames_is_a_pcie_error_not_a_10_s_drain(runner, dock):
    """tinygrad's posted ring writes vanish into a dead link and its drain spins 10 s with no word for the cause;
    the runner's LTSSM read before the frame's copies names the PCIe layer at once."""
    from chestnut.backend.errors import PcieLayerError

    dock.fault("ltssm_down")
    with pytest.raises(PcieLayerError) as info:
        runner.run(frame(0))
    assert info.value.reason == "link_down"
    assert "PCIe link not up (LTSSM=0x" in str(info.value) and "before the frame's copies" in str(info.value)
    assert dock.status()["gpu"]["sdma"]["wptr"] == runner.tinygrad.dev.sdma_queues[0].put_value  # nothing rung
