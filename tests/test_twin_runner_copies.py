"""Large copies through the twin runner's own copy path, as the node uses it: tinygrad 0.14's
``AMDAllocator._copyin`` / ``_copyout`` behind :class:`~chestnut.backend.retry.RetryingUSB3`, its async
transfers in flight as tinygrad issues them. A 4 MiB copy is 17 chunks of the 256 KiB
SRAM windows and a 16 MiB copy 65, more than any frame's; the reserved VRAM below ``VRAM_HEAP_OFFSET`` (the
rings, their pointers, the timeline signal) must never be a copy's destination."""

from __future__ import annotations

import os

import numpy as np
import pytest
from twinfixtures import twin_fixtures

from chestnut.backend import protocol as P
from chestnut.backend.interface import ModelSpec
from chestnut.backend.ladder import LadderConfig
from chestnut.backend.model import OnnxModel
from chestnut.backend.retry import RetryingUSB3
from chestnut.backend.twin_runner import TwinRunner
from chestnut.launch.acceptance_dock import copy_once

pytestmark = pytest.mark.timeout(120)
PREFIX = f"t{os.getpid()}-twincopies"
MIB = 1 << 20


daemon, dock = twin_fixtures(PREFIX)


@pytest.fixture
def runner(dock):
    r = TwinRunner(PREFIX, config=LadderConfig(stability_window_s=0.05))
    assert r.qualify().passed
    yield r
    r.close()


def payload(nbytes: int) -> bytes:
    return np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def test_the_kits_copy_step_passes_on_a_fault_free_twin(runner, dock):
    """``chestnut acceptance --twin``'s copy step: 64 KiB, 1 MiB, 4 MiB and 16 MiB in and back, byte-exact."""
    got = [copy_once(runner, n, True) for n in (64 << 10, MIB, 4 * MIB, 16 * MIB)]
    assert [(c["bytes"], c.get("error"), c.get("round_trip_exact")) for c in got] == [
        (64 << 10, None, True),
        (MIB, None, True),
        (4 * MIB, None, True),
        (16 * MIB, None, True),
    ]
    assert dock.status()["gpu"]["sdma"]["error_count"] == 0


def test_4_and_16_mib_cross_byte_exact_several_times_in_one_worker(runner, dock, tiny_onnx):
    runner.load(ModelSpec(tiny_onnx, "tiny"))
    assert isinstance(runner.usb, RetryingUSB3)
    at = runner.scratch_offset(16 * MIB)
    assert at >= P.VRAM_HEAP_OFFSET and at % 0x1000 == 0
    seq_before = runner.tinygrad.allocator._usb_seq
    for n in (4 * MIB, 16 * MIB, 4 * MIB, 16 * MIB):
        data = payload(n)
        runner._copy_in(at, data)
        assert bytes(runner._copy_out(at, n)) == data
    # 256 KiB windows less the 4-byte sentinel: 17 chunks per 4 MiB, 65 per 16 MiB
    assert runner.tinygrad.allocator._usb_seq - seq_before == 2 * (17 + 65)
    assert runner.probe().fence == runner.tinygrad.allocator._usb_seq
    x = {"x": np.random.default_rng(7).standard_normal((1, 3, 32, 64)).astype(np.float32)}
    assert np.array_equal(runner.run(x)["prob"], OnnxModel(tiny_onnx, name="tiny").run(x)["prob"])
    assert dock.status()["gpu"]["sdma"]["error_count"] == 0
    assert runner.usb.log.errors == 0 and not runner.usb._pending  # every async transfer waited, none failed


def test_a_copy_into_the_reserved_vram_is_refused_before_the_dock(runner, dock):
    runner._open_data_path()
    before = dock.status()["gpu"]["sdma"]["executed"]
    with pytest.raises(ValueError) as e:
        runner._copy_in(0, payload(4 * MIB))
    assert str(e.value) == (
        "copy-in of 4194304 bytes at VRAM 0x0: VRAM below 0x400000 holds the rings and signals; "
        "use TwinRunner.scratch_offset(nbytes)"
    )
    with pytest.raises(ValueError, match=r"^copy-out of 16 bytes at VRAM 0x200000: "):
        runner._copy_out(P.SDMA_RING_VRAM_OFFSET, 16)
    assert dock.status()["gpu"]["sdma"]["executed"] == before
    assert runner._copy_in(runner.scratch_offset(4096), bytes(4096)) is None  # the runner still copies


def test_scratch_past_the_end_of_bar0_is_vram_full(runner):
    from chestnut.backend.errors import GpuLayerError

    runner._open_data_path()
    end = runner._bars[0][1]
    with pytest.raises(GpuLayerError) as e:
        runner.scratch_offset(end)
    assert e.value.reason == "vram_full"
