"""The copy protocol and command queue against the twin daemon: format, accounting, bounded waits, faults.

Bounds (issue 4): a fence stall, a lost receipt or an uncleared sentinel surfaces within the wait
timeout + 10 % (asserted with a 100 ms margin for a loaded machine); a status other than OK at once.
"""

from __future__ import annotations

import os
import struct
import time
import zlib

import pytest

from chestnut.backend import protocol as P
from chestnut.backend.bridge import Bridge
from chestnut.backend.copy import CommandQueue, CopyProtocol, u32_ge
from chestnut.backend.errors import GpuLayerError, PcieLayerError, UsbLayerError
from chestnut.backend.sim.client import running_twin
from chestnut.backend.sim.usb3 import TwinUSB3, forget_device_lists

pytestmark = pytest.mark.timeout(60)
WAIT_MS = 300
MARGIN_S = 0.1


@pytest.fixture
def twin():
    with running_twin() as client:
        yield client
    forget_device_lists()


def open_copy(wait_timeout_ms: int = WAIT_MS, bars: dict[int, tuple[int, int]] | None = None) -> CopyProtocol:
    """A fresh host: the link trained and the BARs assigned (unless ``bars`` says where they already are)."""
    (dev, _), = TwinUSB3.list_devices(*P.USB_IDS[0])
    bridge = Bridge(TwinUSB3(dev), bulk_timeout_ms=wait_timeout_ms)
    if bars is None:
        bridge.ensure_link()
        bridge.setup_bars()
    else:
        bridge.bars = dict(bars)
    queue = CommandQueue(bridge, wait_timeout_ms)
    queue.attach()
    copy = CopyProtocol(bridge, queue, wait_timeout_ms)
    copy.attach()
    return copy


def assert_within_wait(elapsed_s: float, wait_ms: int = WAIT_MS) -> None:
    assert wait_ms / 1e3 <= elapsed_s <= wait_ms / 1e3 * 1.1 + MARGIN_S, elapsed_s


@pytest.mark.parametrize("nbytes", [1, 511, 512, P.CHUNK_PAYLOAD, P.CHUNK_PAYLOAD + 1, (1 << 20) + 3])
def test_round_trip_and_one_bulk_transfer_per_chunk(twin, nbytes):
    c = open_copy()
    b = c.bridge
    data = os.urandom(nbytes)
    chunks_in = -(-nbytes // P.CHUNK_PAYLOAD)
    out0, bytes0 = b.bulk_out_transfers, b.bulk_out_bytes
    assert c.copy_in(P.VRAM_HEAP_OFFSET + 4, data) == chunks_in
    assert c.data_bulk_out == chunks_in
    assert b.bulk_out_transfers - out0 == chunks_in + 1  # + the one streaming ring write of the OP_COPYIN packets
    ring_bytes = 28 * chunks_in  # OP_COPYIN is 7 dwords
    assert b.bulk_out_bytes - bytes0 == CopyProtocol.copy_in_wire_bytes(nbytes) + ring_bytes
    in0 = b.bulk_in_transfers
    assert c.copy_out(P.VRAM_HEAP_OFFSET + 4, nbytes) == data
    assert b.bulk_in_transfers - in0 == c.data_bulk_in == -(-nbytes // P.SRAM_HALF)
    assert b.xdata_u32(P.XDATA_COPYIN_FENCE) == c.chunk_seq


def test_wire_image_is_padded_payload_then_sentinel_block(twin):
    c = open_copy()
    twin.fault("sentinel_stuck")  # the GPU never consumes the chunk: it stays in SRAM half 0 as sent
    payload = os.urandom(1000)
    seq = c.chunk_seq
    with pytest.raises(GpuLayerError):
        c.copy_in(P.VRAM_HEAP_OFFSET, payload)
    c.bridge.sram_arm_read(0, 2048)
    sram = c.bridge.bulk_in(2048)
    assert sram[:1000] == payload and sram[1000:1024] == bytes(24)
    block = sram[1024:1536]
    assert struct.unpack_from("<III", block) == (1000, zlib.crc32(payload), seq)
    assert block[12:508] == bytes(496)
    assert struct.unpack_from("<I", block, 508)[0] == P.SENTINEL_MAGIC | seq
    assert sram[1536:2048] == bytes(512)  # nothing beyond the 1536-byte wire image


def test_fence_stall_raises_within_the_wait_timeout_naming_chunk_and_fences(twin):
    c = open_copy()
    c.copy_in(P.VRAM_HEAP_OFFSET, os.urandom(1000))
    twin.fault("fence_stall", after=1)  # the second chunk's completion writes are skipped
    t0 = time.monotonic()
    with pytest.raises(GpuLayerError) as info:
        c.copy_in(P.VRAM_HEAP_OFFSET, os.urandom(P.CHUNK_PAYLOAD * 3))
    assert_within_wait(time.monotonic() - t0)
    e = info.value
    assert e.reason == "fence_stall"
    seq = c.chunk_seq + 1
    assert f"copy-in chunk 2/3 (seq {seq})" in e.detail
    assert f"expected {seq + 1}, saw {seq}" in e.detail


@pytest.mark.parametrize("kind", ["sentinel_stuck", "gpu_hang"])
def test_gpu_that_never_drains_raises_within_the_wait_timeout(twin, kind):
    c = open_copy()
    twin.fault(kind)
    t0 = time.monotonic()
    with pytest.raises(GpuLayerError) as info:
        c.copy_in(P.VRAM_HEAP_OFFSET, os.urandom(4096))
    assert_within_wait(time.monotonic() - t0)
    assert info.value.reason == "fence_stall"
    assert "copy-in chunk 1/1" in info.value.detail


def test_lost_receipt_is_a_usb_timeout_within_the_wait_timeout(twin):
    c = open_copy()
    twin.fault("lost_receipt")
    t0 = time.monotonic()
    with pytest.raises(UsbLayerError) as info:
        c.copy_in(P.VRAM_HEAP_OFFSET, os.urandom(4096))
    elapsed = time.monotonic() - t0
    assert elapsed <= WAIT_MS / 1e3 * 1.1 + MARGIN_S
    assert info.value.reason == "transfer_timeout"
    assert "receipt was lost" in info.value.detail
    assert u32_ge(c.bridge.xdata_u32(P.XDATA_COPYIN_FENCE), c.chunk_seq + 1)  # the GPU did drain the chunk


def test_bad_sentinel_block_status_raises_at_once_with_its_meaning(twin, monkeypatch):
    c = open_copy(wait_timeout_ms=3000)
    real = c._stage_chunk

    def corrupt(half, payload, seq):  # a payload that no longer matches the block's CRC
        wire = real(half, payload, seq)
        c._stage[half][0] ^= 0xFF
        return wire

    monkeypatch.setattr(c, "_stage_chunk", corrupt)
    t0 = time.monotonic()
    with pytest.raises(UsbLayerError) as info:
        c.copy_in(P.VRAM_HEAP_OFFSET, os.urandom(4096))
    assert time.monotonic() - t0 < 1.0  # at once, not at the 3000 ms wait timeout
    assert info.value.reason == "corrupt_transfer"
    assert "status 2" in info.value.detail and "copy-in chunk 1/1" in info.value.detail


def test_copy_out_out_of_range_status_raises_at_once(twin):
    c = open_copy(wait_timeout_ms=3000)
    t0 = time.monotonic()
    with pytest.raises(GpuLayerError) as info:
        c.copy_out(P.BAR0_VRAM_BYTES - 16, 4096)
    assert time.monotonic() - t0 < 1.0
    assert info.value.reason == "out_of_range"
    assert "copy-out chunk 1/1" in info.value.detail


def test_copy_out_fence_stall_raises_within_the_wait_timeout(twin):
    c = open_copy()
    c.copy_in(P.VRAM_HEAP_OFFSET, os.urandom(4096))
    twin.fault("fence_stall")
    t0 = time.monotonic()
    with pytest.raises(GpuLayerError) as info:
        c.copy_out(P.VRAM_HEAP_OFFSET, 3 * P.SRAM_HALF)
    assert_within_wait(time.monotonic() - t0)
    assert info.value.reason == "wait_timeout"
    assert "copy-out chunk 1/3" in info.value.detail


def test_link_drop_during_a_copy_is_a_pcie_error_within_the_wait_timeout(twin):
    c = open_copy()
    twin.fault("ltssm_down")  # at the next TLP: the ring write and the doorbell are lost
    t0 = time.monotonic()
    with pytest.raises(PcieLayerError) as info:
        c.copy_in(P.VRAM_HEAP_OFFSET, os.urandom(4096))
    assert_within_wait(time.monotonic() - t0)
    assert info.value.reason == "link_down"
    assert "LTSSM=0x00" in info.value.detail and "copy-in chunk 1/1" in info.value.detail


def test_a_fresh_host_continues_the_ring_and_the_chunk_seq(twin):
    first = open_copy()
    first.copy_in(P.VRAM_HEAP_OFFSET, b"x" * 5000)
    wptr, seq, chunk_seq = first.queue.wptr, first.queue.seq, first.chunk_seq
    first.bridge.usb.close()
    second = open_copy(bars=first.bridge.bars)
    assert (second.queue.wptr, second.queue.seq, second.chunk_seq) == (wptr, seq, chunk_seq)
    data = os.urandom(P.CHUNK_PAYLOAD + 10)
    second.copy_in(P.VRAM_HEAP_OFFSET, data)
    assert second.copy_out(P.VRAM_HEAP_OFFSET, len(data)) == data


def test_fence_stall_at_the_default_3000_ms_wait_timeout(twin):
    c = open_copy(wait_timeout_ms=P.WAIT_TIMEOUT_MS)
    twin.fault("fence_stall")
    t0 = time.monotonic()
    with pytest.raises(GpuLayerError) as info:
        c.copy_in(P.VRAM_HEAP_OFFSET, os.urandom(4096))
    assert_within_wait(time.monotonic() - t0, P.WAIT_TIMEOUT_MS)
    assert "wait timeout 3000 ms" in info.value.detail
