"""The twin's SDMA engine on its own: tinygrad's packet encodings execute exactly, and nothing a host writes
(garbage rings, malformed packets, doorbells past the ring, unmapped addresses) raises inside the twin: the
queue stalls or skips the packet and the error is latched and readable in the twin's status."""

from __future__ import annotations

import struct
import time

import pytest

from chestnut.backend import protocol as P
from chestnut.backend.sim.sdma import sdma_module
from chestnut.backend.sim.twin import Twin

S = sdma_module()
VRAM = P.VRAM_VA_BASE
HEAP = P.VRAM_HEAP_OFFSET


def lo_hi(v: int) -> tuple[int, int]:
    return v & 0xFFFFFFFF, v >> 32


def copy(dst: int, src: int, n: int) -> list[int]:
    return [S.SDMA_OP_COPY | S.SDMA_PKT_COPY_LINEAR_HEADER_SUB_OP(S.SDMA_SUBOP_COPY_LINEAR),
            S.SDMA_PKT_COPY_LINEAR_COUNT_COUNT(n - 1), 0, *lo_hi(src), *lo_hi(dst)]


def write(dst: int, *vals: int) -> list[int]:
    return [S.SDMA_OP_WRITE, *lo_hi(dst), len(vals) - 1, *vals]


def fence(dst: int, value: int) -> list[int]:
    return [S.SDMA_OP_FENCE | S.SDMA_PKT_FENCE_HEADER_MTYPE(3), *lo_hi(dst), value]


def poll(addr: int, ref: int, func: int = 3, retries: int = 0xFFF) -> list[int]:
    header = S.SDMA_OP_POLL_REGMEM | S.SDMA_PKT_POLL_REGMEM_HEADER_FUNC(func)
    header |= S.SDMA_PKT_POLL_REGMEM_HEADER_MEM_POLL(1)
    return [header, *lo_hi(addr), ref, 0xFFFFFFFF,
            S.SDMA_PKT_POLL_REGMEM_DW5_INTERVAL(4) | S.SDMA_PKT_POLL_REGMEM_DW5_RETRY_COUNT(retries)]


class Queue:
    """The host side, as ``AMDCopyQueue._submit`` and ``AMDQueueDesc.signal_doorbell`` do it: ring, put value,
    doorbell."""

    def __init__(self, twin: Twin) -> None:
        self.tw, self.put = twin, 0

    def submit(self, dwords: list[int], ring: bool = True) -> int:
        raw = struct.pack(f"<{len(dwords)}I", *dwords)
        with self.tw.lock:
            self.tw.vram.write(P.SDMA_RING_VRAM_OFFSET + self.put % P.SDMA_RING_BYTES, raw)
        self.put += len(raw)
        if ring:
            self.doorbell(self.put)
        return self.put

    def doorbell(self, value: int) -> None:
        with self.tw.lock:
            self.tw.sdma.doorbell_write(P.SDMA_DOORBELL_BAR_OFFSET, value & 0xFFFFFFFF)
            self.tw.sdma.doorbell_write(P.SDMA_DOORBELL_BAR_OFFSET + 4, value >> 32)

    def settle(self, rptr: int | None = None) -> dict:
        """Wait (at most 5 s) until the engine reached ``rptr`` (default: the put value), stalled or hung."""
        want = self.put if rptr is None else rptr
        end = time.monotonic() + 5
        while time.monotonic() < end:
            st = self.tw.status()["gpu"]["sdma"]
            if st["rptr"] == want or st["stalled"] or st["hung"]:
                return st
            time.sleep(0.005)
        return self.tw.status()["gpu"]["sdma"]


@pytest.fixture
def twin():
    tw = Twin()
    yield tw
    tw.close()


def u32(tw: Twin, off: int) -> int:
    return struct.unpack("<I", tw.vram.read(off, 4))[0]


def test_tinygrads_packets_execute_exactly(twin):
    q = Queue(twin)
    twin.vram.write(HEAP, bytes(range(256)) * 4)
    nop_run = [S.SDMA_OP_NOP | S.SDMA_PKT_NOP_HEADER_COUNT(2), 0xDEAD, 0xBEEF, 0, 0]  # a 3-dword NOP, two 1-dword
    q.submit(nop_run + copy(VRAM + HEAP + 0x1000, VRAM + HEAP + 3, 1000) + write(VRAM + HEAP + 0x2000, 7)
             + write(VRAM + HEAP + 0x2008, 0x11223344, 0x55667788) + fence(P.SYS_PAGE_GPU_VA + 0x800, 9)
             + [S.SDMA_OP_TRAP, 0] + [S.SDMA_OP_TIMESTAMP
                                      | S.SDMA_PKT_TIMESTAMP_GET_HEADER_SUB_OP(S.SDMA_SUBOP_TIMESTAMP_GET_GLOBAL),
                                      *lo_hi(VRAM + HEAP + 0x3000)]
             + copy(P.SRAM_GPU_VA + 0x100, VRAM + HEAP, 16))
    st = q.settle()
    assert (st["rptr"], st["executed"], st["traps"], st["error_count"]) == (q.put, 10, 1, 0)
    assert twin.vram.read(HEAP + 0x1000, 1000) == (bytes(range(256)) * 4)[3:1003]
    assert u32(twin, HEAP + 0x2000) == 7
    assert twin.vram.read(HEAP + 0x2008, 8) == struct.pack("<II", 0x11223344, 0x55667788)
    assert twin.xdata[P.XDATA_COPYIN_FENCE:P.XDATA_COPYIN_FENCE + 4] == struct.pack("<I", 9)
    assert struct.unpack("<Q", twin.vram.read(HEAP + 0x3000, 8))[0] > 0
    assert twin.sram[0x100:0x110] == bytes(range(16))
    assert struct.unpack("<Q", twin.vram.read(P.SDMA_RPTR_VRAM_OFFSET, 8))[0] == q.put  # read pointer written back


def test_a_poll_waits_without_blocking_the_twin_and_resumes_when_memory_matches(twin):
    q = Queue(twin)
    q.submit(poll(P.SRAM_GPU_VA + 0x3FFFC, 0x51000005) + write(VRAM + HEAP, 1))
    time.sleep(0.05)
    st = twin.status()["gpu"]["sdma"]  # the twin answers while its engine polls
    assert st["polling"] == f"{P.SRAM_GPU_VA + 0x3FFFC:#x} func 3 ref 0x51000005 mask 0xffffffff"
    assert st["rptr"] == 0 and u32(twin, HEAP) == 0
    with twin.lock:
        twin.sram[0x3FFFC:0x40000] = struct.pack("<I", 0x51000005)
        twin.cv.notify_all()
    st = q.settle()
    assert (st["rptr"], st["polling"], st["error_count"]) == (q.put, None, 0)
    assert u32(twin, HEAP) == 1


def test_a_poll_with_a_retry_limit_gives_up_latches_and_goes_on(twin):
    q = Queue(twin)
    q.submit(poll(VRAM + HEAP, 5, func=5, retries=3) + write(VRAM + HEAP + 4, 2))
    st = q.settle()
    assert st["rptr"] == q.put and u32(twin, HEAP + 4) == 2
    assert st["errors"] == ["POLL_REGMEM at 0x0 skipped: poll of 0x200000400000 gave up after 3 retries (value 0x0, "
                            "want func 5 0x5)"]


def test_garbage_in_the_ring_stalls_the_queue_with_a_readable_error_until_a_gpu_reset(twin):
    q = Queue(twin)
    q.submit([0x000000FF, 1, 2, 3])
    st = q.settle()
    assert st["rptr"] == 0 and st["stalled"] == "unknown SDMA packet header 0x000000ff (op 255, sub-op 0)"
    assert st["errors"] == ["queue stalled at 0x0: unknown SDMA packet header 0x000000ff (op 255, sub-op 0)"]
    q.submit(write(VRAM + HEAP, 3))  # more work behind the stall does not run
    time.sleep(0.05)
    assert u32(twin, HEAP) == 0 and twin.status()["gpu"]["sdma"]["rptr"] == 0
    with twin.lock:
        twin.sdma.reset()  # what a GPU reset (PCIe power off/on, power-cycle) does to the engine
    q.put = 0
    q.submit(write(VRAM + HEAP, 4))
    st = q.settle()
    assert (st["rptr"], st["stalled"], st["errors"]) == (q.put, None, [])
    assert u32(twin, HEAP) == 4


def test_a_packet_past_the_write_pointer_stalls(twin):
    q = Queue(twin)
    dw = copy(VRAM + HEAP, VRAM + HEAP + 64, 4)
    q.submit(dw[:4], ring=False)
    q.doorbell(16)
    st = q.settle()
    assert st["stalled"] == "COPY_LINEAR packet of 7 dwords runs past the write pointer (4 dwords rung)"


def test_unmapped_and_oversized_copies_are_skipped_and_the_queue_goes_on(twin):
    q = Queue(twin)
    q.submit(copy(VRAM + HEAP, 0x1234_0000, 16) + copy(VRAM + HEAP, VRAM + HEAP + 4096, P.SDMA_MAX_COPY_BYTES + 1)
             + write(0x9000_0000, 1) + write(VRAM + HEAP + 8, 5))
    st = q.settle()
    assert st["rptr"] == q.put and u32(twin, HEAP + 8) == 5
    assert st["errors"] == [
        "COPY_LINEAR at 0x0 skipped: GPU address 0x12340000 (16 bytes) is not mapped",
        f"COPY_LINEAR at 0x1c skipped: copy of {P.SDMA_MAX_COPY_BYTES + 1} bytes is larger than "
        f"{P.SDMA_MAX_COPY_BYTES}",
        "WRITE at 0x38 skipped: GPU address 0x90000000 (4 bytes) is not mapped"]


def test_doorbells_past_the_ring_or_backwards_are_ignored(twin):
    q = Queue(twin)
    q.submit(write(VRAM + HEAP, 1))
    q.settle()
    q.doorbell(q.put + P.SDMA_RING_BYTES + 4)
    q.doorbell(4)
    q.doorbell(q.put + 2)
    st = twin.status()["gpu"]["sdma"]
    assert (st["rptr"], st["wptr"]) == (q.put, q.put)
    assert [e.split(":")[0] for e in st["errors"]] == [f"doorbell {q.put + P.SDMA_RING_BYTES + 4:#x} ignored",
                                                      "doorbell 0x4 ignored", f"doorbell {q.put + 2:#x} ignored"]


def test_the_daemon_survives_a_garbage_ring_written_over_usb():
    """The same through the daemon: garbage written into the ring with TLPs (tinygrad's own controller and BAR
    set-up) and rung; the daemon keeps answering and shows the stall."""
    from tinygrad.runtime.support.system import System
    from tinygrad.runtime.support.usb import CustomASM24Controller

    from chestnut.backend.sim.client import running_twin
    from chestnut.backend.sim.usb3 import TwinUSB3, forget_device_lists

    with running_twin(args=["--training-delay-ms", "2"]) as c:
        forget_device_lists()
        usb = TwinUSB3(TwinUSB3.list_devices(0xADD1, 0x0001)[0][0])
        ctrl = CustomASM24Controller(usb)
        bars = System.pci_setup_usb_bars(ctrl, gpu_bus=4, mem_base=P.USB_MEM_BASE, pref_mem_base=P.USB_PREF_MEM_BASE)
        ctrl.pcie_mem_write(bars[0][0] + P.SDMA_RING_VRAM_OFFSET, bytes(range(7, 7 + 64)))
        ctrl.pcie_mem_write(bars[2][0] + P.SDMA_DOORBELL_BAR_OFFSET, struct.pack("<Q", 64))
        ctrl.pcie_mem_write(bars[2][0] + P.SDMA_DOORBELL_BAR_OFFSET, struct.pack("<Q", 1 << 40))
        end = time.monotonic() + 5
        while not (sdma := c.status()["gpu"]["sdma"])["stalled"] and time.monotonic() < end:
            time.sleep(0.01)
        usb.close()
    assert sdma["stalled"] == "unknown SDMA packet header 0x0a090807 (op 7, sub-op 8)"
    assert sdma["rptr"] == 0 and sdma["wptr"] == 64
    assert sdma["error_count"] == 2  # the stall, and the doorbell 1 TiB past the ring


def test_a_fence_stall_that_fired_once_keeps_the_fence_still_until_a_gpu_reset(twin):
    """One firing drops that write and every later fence write (a single drop would be healed by the next
    chunk's ``seq + 1``, so the fence would not stall); the copies still run; a GPU reset ends it."""
    from chestnut.backend.sim.faults import FaultSpec

    q = Queue(twin)
    twin.vram.write(HEAP, b"\xab" * 64)
    twin.inject(FaultSpec("fence_stall"))  # one-shot: fires on the first write, then the fault is spent
    q.submit(write(VRAM + HEAP + 0x100, 1) + fence(P.SYS_PAGE_GPU_VA + 0x800, 2)
             + copy(VRAM + HEAP + 0x200, VRAM + HEAP, 64) + write(VRAM + HEAP + 0x104, 3))
    st = q.settle()
    assert (st["rptr"], st["fence_stalled"], st["error_count"]) == (q.put, True, 0)
    assert (u32(twin, HEAP + 0x100), u32(twin, HEAP + 0x104)) == (0, 0)
    assert twin.xdata[P.XDATA_COPYIN_FENCE:P.XDATA_COPYIN_FENCE + 4] == bytes(4)
    assert twin.vram.read(HEAP + 0x200, 64) == b"\xab" * 64  # the work itself was done
    with twin.lock:
        twin._gpu_reset_locked()
    q.put = 0
    q.submit(write(VRAM + HEAP + 0x100, 5))
    st = q.settle()
    assert st["fence_stalled"] is False and u32(twin, HEAP + 0x100) == 5


def test_tinygrads_0xfff_poll_ends_at_its_retry_limit_and_latches(twin, monkeypatch):
    """A poll on a value that never matches, with tinygrad's retry count 0xFFF and interval 4
    (``AMDAllocator._copyin``), ends after 0xFFF x 4 interval units; the unit is shortened here so the test
    waits 0.41 s instead of 16.38 s."""
    from chestnut.backend.sim import sdma

    monkeypatch.setattr(sdma, "POLL_INTERVAL_UNIT_S", 0.000025)
    q = Queue(twin)
    q.submit(poll(VRAM + HEAP, 7) + write(VRAM + HEAP + 4, 9))
    st = q.settle()
    assert (st["rptr"], st["polling"], st["error_count"]) == (q.put, None, 1)
    assert u32(twin, HEAP + 4) == 9
    assert st["errors"] == ["POLL_REGMEM at 0x0 skipped: poll of 0x200000400000 gave up after 4095 retries (value 0x0, "
                            "want func 3 0x7)"]
