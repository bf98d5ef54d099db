"""tinygrad 0.14's own USB copy path, SDMA queue and signal waits, unmodified, against the twin daemon.

The functions under test are imported from ``tinygrad.runtime.ops_amd`` (``AMDAllocator._copyin`` /
``_copyout``, ``AMDCopyQueue``, ``AMDQueueDesc.signal_doorbell``, ``AMDDevice.synchronize``) and
``tinygrad.runtime.support`` (``hcq.HCQSignal.wait``, ``usb.CustomASM24Controller``); the harness
(``backend/tinygrad_harness.py``) only builds the objects the AM driver's initialisation would. tinygrad runs
in a child process with ``HCQDEV_WAIT_TIMEOUT_MS=3000`` set before its import (its ``getenv`` is cached) and
``DEV=CPU`` (never probe devices), so nothing leaks into this test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from chestnut.backend import protocol as P
from chestnut.backend.sim.client import running_twin

pytestmark = pytest.mark.slow

CHUNK = P.COPYIN_CHUNK
OUT_CHUNK = P.COPYOUT_CHUNK

PRELUDE = """
import json, os, sys, time, hashlib
from tinygrad.runtime.ops_amd import AMDAllocator, AMDCopyQueue, AMDQueueDesc, AMDDevice
from tinygrad.runtime.support.hcq import HCQSignal
from tinygrad.runtime.support.usb import CustomASM24Controller
from chestnut.backend import protocol as P
from chestnut.backend.sim.client import TwinClient
from chestnut.backend.sim.usb3 import TwinUSB3
from chestnut.backend.tinygrad_harness import TinygradDock, CopyRefused
client = TwinClient()
usb = TwinUSB3(TwinUSB3.list_devices(0xADD1, 0x0001)[0][0])
dock = TinygradDock(usb)
out = {}
def pattern(n, salt=0):
    return (hashlib.sha256(str(salt).encode()).digest() * (n // 32 + 1))[:n]
def err(fn):
    t = time.monotonic()
    try:
        fn()
    except BaseException as e:
        return {"error": f"{type(e).__name__}: {e}", "s": round(time.monotonic() - t, 2)}
    return {"error": None, "s": round(time.monotonic() - t, 2)}
def sdma():
    return client.status()["gpu"]["sdma"]
def node_transport():
    # the transport the node puts under tinygrad (backend/twin_runner.py): RetryingUSB3 over the same TwinUSB3,
    # VRAM and doorbells as its value regions; tinygrad's controller calls it from now on
    from chestnut.backend.retry import RetryingUSB3
    t = RetryingUSB3(usb, value_regions=[dock.bars[i] for i in (0, 2)])
    dock.ctrl.usb = t
    return t
def fired(kind):
    st = client.status()
    return sum(f["fired"] for f in st["faults"] + st["fault_history"] if f["kind"] == kind)
"""


def run_tinygrad(body: str, timeout: float = 120) -> dict:
    env = {**os.environ, "DEV": "CPU", "HCQDEV_WAIT_TIMEOUT_MS": "3000"}
    for k in ("PROFILE", "AMD_DISABLE_SDMA", "HCQ2"):
        env.pop(k, None)
    script = PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture
def twin():
    with running_twin(args=["--training-delay-ms", "2"]) as c:
        yield c


ROUND_TRIP = """
out["unmodified"] = [dock.allocator._copyin.__func__ is AMDAllocator._copyin,
                     dock.allocator._copyout.__func__ is AMDAllocator._copyout,
                     type(dock.dev.hw_copy_queue_t()) is AMDCopyQueue,
                     type(dock.dev.sdma_queues[0]) is AMDQueueDesc,
                     type(dock.dev.timeline_signal).wait is HCQSignal.wait,
                     type(dock.ctrl) is CustomASM24Controller,
                     AMDAllocator._copyin.__module__, HCQSignal.wait.__module__]
before = sdma()["executed"]
dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(3 * P.COPYIN_CHUNK + 5))
out["packets_3_chunks"] = sdma()["executed"] - before            # wait + 4 x (poll, copy, write) + signal
out["fence_after_4_chunks"] = dock.drain_fence()
bar0 = dock.bars[0][0]
out["bar_view_matches"] = bytes(dock.ctrl.pcie_mem_read(bar0 + P.VRAM_HEAP_OFFSET, 4096)) == pattern(4096)
dock.ctrl.pcie_mem_write(bar0 + P.VRAM_HEAP_OFFSET + 0x100000, pattern(8192, 7))
before = sdma()["executed"]
out["bar_write_copied_out"] = dock.copy_out(P.VRAM_HEAP_OFFSET + 0x100000, 8192) == pattern(8192, 7)
out["packets_copy_out_1_piece"] = sdma()["executed"] - before   # wait, copy, write cq_buf, signal
results = {}
for i, n in enumerate(SIZES):
    data = pattern(n, i)
    dock.copy_in(P.VRAM_HEAP_OFFSET + 4 * i, data)
    results[n] = dock.copy_out(P.VRAM_HEAP_OFFSET + 4 * i, n) == data
out["exact"] = {str(k): v for k, v in results.items()}
out["sdma"] = sdma()
out["timeline"] = [dock.dev.timeline_value, dock.dev.timeline_signal.value]
"""

SIZES = sorted({1, 2, 3, 4, 5, 511, 512, 513, 4095, 4097, 100_003, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1,
                2 * CHUNK, 2 * CHUNK + 1, OUT_CHUNK - 1, OUT_CHUNK, OUT_CHUNK + 1, 2 * OUT_CHUNK + 3,
                (1 << 20) + 17, 3_200_000, 7_500_001})


@pytest.mark.timeout(300)
def test_tinygrads_copy_path_round_trips_byte_exact_through_the_twin(twin):
    out = run_tinygrad(f"SIZES = {SIZES!r}\n" + ROUND_TRIP)
    assert out["unmodified"] == [True] * 6 + ["tinygrad.runtime.ops_amd", "tinygrad.runtime.support.hcq"]
    assert out["packets_3_chunks"] == 1 + 4 * 3 + 1
    assert out["fence_after_4_chunks"] == 4
    assert out["bar_view_matches"] and out["bar_write_copied_out"]
    assert out["packets_copy_out_1_piece"] == 4
    assert out["exact"] == {str(n): True for n in SIZES}
    assert out["sdma"]["error_count"] == 0 and out["sdma"]["stalled"] is None
    assert out["sdma"]["rptr"] == out["sdma"]["wptr"]
    # one timeline value per submission: 1 copy-in + 1 copy-out piece, then per size one copy-in and its pieces
    pieces = sum(-(-n // OUT_CHUNK) for n in SIZES)
    assert out["timeline"] == [1 + 2 + len(SIZES) + pieces, len(SIZES) + pieces + 2]


@pytest.mark.timeout(300)
def test_64_mib_round_trip(twin):
    out = run_tinygrad("""
data = os.urandom(64 << 20)
dock.copy_in(P.VRAM_HEAP_OFFSET, data)
out["fence"] = dock.drain_fence()
out["exact"] = dock.copy_out(P.VRAM_HEAP_OFFSET, len(data)) == data
""", timeout=280)
    assert out == {"fence": -(-(64 << 20) // CHUNK), "exact": True}


@pytest.mark.timeout(120)
def test_a_gpu_stalled_past_the_10_s_drain_then_a_same_process_retry_silently_returns_zeros(twin):
    """tinygrad's hard-coded 10 s drain, and the finding the node is built around. The GPU stalls 12 s on the
    first packet; the drain gives up mid-stream (before ``_usb_seq`` advances) while the ring still holds
    that copy's packets. When the GPU resumes, the stale ring drains chunks 0-1 and waits for chunk 2's
    sentinel; a retry of the same size in the same process reuses the sequence numbers, feeds the stale ring,
    "succeeds" at once -- and its own destination stays zero. The harness refuses the retry instead."""
    out = run_tinygrad("""
n = 4 * P.COPYIN_CHUNK
client.fault("slow_gpu", delay_ms=12000, repeat=False)
out["first"] = err(lambda: dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(n)))
out["seq"] = dock.allocator._usb_seq
end = time.monotonic() + 10
while dock.drain_fence() < 2 and time.monotonic() < end:  # the GPU resumes and drains the chunks it has
    time.sleep(0.05)
out["fence"] = dock.drain_fence()
out["guarded_retry"] = err(lambda: dock.copy_in(P.VRAM_HEAP_OFFSET + (16 << 20), pattern(n, 1)))
# tinygrad's own function, called again in the same process (what a naive retry does):
src = memoryview(bytearray(pattern(n, 1)))
out["raw_retry"] = err(lambda: dock.allocator._copyin(dock.buffer(P.VRAM_HEAP_OFFSET + (16 << 20), n), src))
bar0 = dock.bars[0][0]
got = bytes(dock.ctrl.pcie_mem_read(bar0 + P.VRAM_HEAP_OFFSET + (16 << 20), n))
out["destination_zero"] = got == bytes(n)
old = bytes(dock.ctrl.pcie_mem_read(bar0 + P.VRAM_HEAP_OFFSET + 2 * P.COPYIN_CHUNK, 4096))
out["old_buffer_got_the_retry"] = old == pattern(n, 1)[2 * P.COPYIN_CHUNK:][:4096]
""")
    assert out["first"]["error"] == "RuntimeError: GPU failed to drain USB copyin chunk 0 (10s, hung GPU?)"
    assert out["first"]["s"] >= 10.0
    assert (out["seq"], out["fence"]) == (0, 2)  # the sequence did not advance; the stale ring drained 2 chunks
    assert out["guarded_retry"]["error"].startswith("CopyRefused: copy-in refused: a copy already failed")
    assert out["raw_retry"]["error"] is None  # it "succeeds" ...
    assert out["destination_zero"]  # ... its destination was never written ...
    assert out["old_buffer_got_the_retry"]  # ... the stale ring put the retry's chunks into the failed copy's buffer


@pytest.mark.timeout(120)
def test_fence_stall_on_copy_out_is_tinygrads_3000_ms_signal_timeout_then_sticky(twin):
    out = run_tinygrad("""
dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(4096))
client.fault("fence_stall", repeat=True)
out["first"] = err(lambda: dock.copy_out(P.VRAM_HEAP_OFFSET, 4096))   # signal dropped; the data still came
dock.failed = None  # look at tinygrad's own behaviour past the harness's guard
out["second"] = err(lambda: dock.copy_out(P.VRAM_HEAP_OFFSET, 4096))  # synchronize: HCQSignal.wait
out["error_state"] = repr(dock.dev.error_state)
client.clear()
dock.failed = None
out["third"] = err(dock.dev.synchronize)                              # sticky
""")
    assert out["first"]["error"] is None
    assert out["second"]["error"] == "RuntimeError: Device hang detected"
    assert out["second"]["s"] >= 3.0
    assert out["error_state"] == "RuntimeError('Wait timeout: 3000 ms! (the signal is not set to 2, but 1)')"
    assert out["third"] == {"error": "RuntimeError: Wait timeout: 3000 ms! (the signal is not set to 2, but 1)",
                            "s": 0.0}


@pytest.mark.timeout(120)
def test_lost_fence_receipt_latches_tinygrads_async_error_for_the_process(twin):
    out = run_tinygrad("""
dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(4096))
client.fault("lost_receipt")
out["first"] = err(lambda: dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(2 * P.COPYIN_CHUNK)))
out["async_err"] = usb._async_err
out["later_wait"] = err(lambda: usb.bulk_wait(usb.control_write_async(0xE5, 0xA000, 0)))
""")
    assert out["first"]["error"] == "RuntimeError: async bulk OUT failed: status=2"  # LIBUSB_TRANSFER_TIMED_OUT
    assert out["async_err"] == 2
    assert out["later_wait"]["error"] == "RuntimeError: async bulk OUT failed: status=2"  # never cleared


@pytest.mark.timeout(120)
def test_short_bulk_out_is_an_async_error(twin):
    """The first copy-in of a process clears the SRAM windows with a synchronous bulk OUT (tinygrad's assert);
    the chunks' transfers are async (a latched -1)."""
    out = run_tinygrad("""
client.fault("short", on="bulk_out")
out["first"] = err(lambda: dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(10000)))
client.clear()
dock = TinygradDock(usb)
dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(10))
client.fault("short", on="bulk_out", after=3)  # past the ring, write pointer and doorbell writes
out["later"] = err(lambda: dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(10000)))
""")
    assert out["first"]["error"] == "AssertionError: bulk OUT short write: 131072/262144 bytes"
    assert out["later"]["error"] == "RuntimeError: async bulk OUT failed: status=-1"


@pytest.mark.timeout(240)
def test_sentinel_never_seen_truncated_usb2_out_sdma_hang_and_fence_stall_each_end_in_the_10_s_drain(twin):
    out = run_tinygrad("""
def fresh():
    global dock
    usb.control_write(0xF3, value=0)   # GPU reset (the node's fresh worker does it when it re-qualifies)
    dock = TinygradDock(usb)
for i, (kind, params) in enumerate((("sentinel_stuck", {}), ("usb2", {"nbytes": 4096, "repeat": True}),
                                    ("gpu_hang", {}), ("fence_stall", {"repeat": True}))):
    fresh()
    client.fault(kind, **params)
    # a size of its own: SRAM keeps the last sentinel across GPU resets, and usb2 truncates the windows' clearing
    out[kind] = err(lambda: dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(100000 + 1024 * i)))
    out[kind + "_sdma"] = {k: sdma()[k] for k in ("hung", "polling")}
    client.clear()
""", timeout=230)
    for kind in ("sentinel_stuck", "usb2", "gpu_hang", "fence_stall"):
        assert out[kind]["error"] == "RuntimeError: GPU failed to drain USB copyin chunk 0 (10s, hung GPU?)", kind
        assert out[kind]["s"] >= 10.0
    assert out["sentinel_stuck_sdma"]["polling"].startswith(f"{P.SRAM_GPU_VA + 100352 - 4:#x} func 3 ")
    assert out["usb2_sdma"]["polling"].startswith(f"{P.SRAM_GPU_VA + 101376 - 4:#x} func 3 ")
    assert out["gpu_hang_sdma"] == {"hung": True, "polling": None}
    assert out["fence_stall_sdma"] == {"hung": False, "polling": None}  # the work was done, the fence never moved


@pytest.mark.timeout(120)
def test_a_bridge_wedged_mid_stream_times_out_an_async_arm_and_stays_wedged(twin):
    out = run_tinygrad("""
dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(10))  # the process's one-time window clear
# past the ring, write pointer and doorbell writes (3 x TLP header + bulk) and two chunks (arm, fence read, bulk)
client.fault("wedged", after=12)
out["first"] = err(lambda: dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(8 * P.COPYIN_CHUNK)))
out["next_read"] = err(lambda: dock.ctrl.read(P.XDATA_LTSSM, 1))
out["wedged"] = client.status()["bridge"]["wedged"]
""")
    assert out["first"]["error"] == "RuntimeError: async bulk OUT failed: status=2"  # the arm's 1000 ms timeout
    assert out["first"]["s"] >= 1.0
    assert out["next_read"]["error"] == "RuntimeError: libusb_control_transfer: Operation timed out"
    assert out["wedged"] is True


# ---------------------------------------------------------------- the same faults through the node's transport
# The tests above are tinygrad alone (the reference); these run the same tinygrad code over RetryingUSB3, the
# transport the node's twin runner builds (backend/retry.py).


@pytest.mark.timeout(120)
def test_a_400_ms_slow_gpu_on_copy_out_completes_bare_and_through_the_nodes_transport(twin):
    out = run_tinygrad("""
data = pattern(4096)
dock.copy_in(P.VRAM_HEAP_OFFSET, data)
got = {}
client.fault("slow_gpu", delay_ms=400.0, repeat=False)  # the copy-out's COPY_LINEAR starts 400 ms late
out["bare"] = err(lambda: got.update(bare=dock.copy_out(P.VRAM_HEAP_OFFSET, 4096)))
t = node_transport()
client.fault("slow_gpu", delay_ms=400.0, repeat=False)
out["node"] = err(lambda: got.update(node=dock.copy_out(P.VRAM_HEAP_OFFSET, 4096)))
out["exact"] = [got.get("bare") == data, got.get("node") == data]
out["stats"] = {k: t.stats()[k] for k in ("errors", "retried_ok", "not_retried")}
out["fired"] = fired("slow_gpu")
""")
    assert out["bare"]["error"] is None and out["node"]["error"] is None, out
    assert out["bare"]["s"] >= 0.4 and out["node"]["s"] >= 0.4
    assert out["exact"] == [True, True]
    assert out["stats"] == {"errors": 0, "retried_ok": 0, "not_retried": 0}  # slow is not a lost transfer
    assert out["fired"] == 2


@pytest.mark.timeout(120)
def test_async_error_latches_for_good_in_bare_tinygrad(twin):
    """The reference: LIBUSB_TRANSFER_ERROR on one async transfer of a copy-in, latched and never cleared."""
    out = run_tinygrad("""
dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(10))  # the process's one-time window clear
client.fault("async_error")
out["first"] = err(lambda: dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(4 * P.COPYIN_CHUNK)))
out["later_wait"] = err(lambda: usb.bulk_wait(usb.control_write_async(0xE5, 0xA000, 0)))
out["fired"] = fired("async_error")
""")
    assert out["first"]["error"] == "RuntimeError: async bulk OUT failed: status=1"
    assert out["later_wait"]["error"] == "RuntimeError: async bulk OUT failed: status=1"
    assert out["fired"] == 1


@pytest.mark.timeout(120)
def test_async_error_fires_on_the_nodes_transport_is_retried_once_and_judged_when_it_repeats(twin):
    """Through RetryingUSB3 tinygrad's async transfers stay async, so ``async_error`` fires on them: one is
    submitted again with the transfers not yet waited and the copy is byte-exact; a link failing every async
    transfer is ``unstable_link`` (the usb layer: the node fails over), after three submissions."""
    out = run_tinygrad("""
t = node_transport()
dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(10))
data = pattern(4 * P.COPYIN_CHUNK, 3)
client.fault("async_error")
out["once"] = err(lambda: dock.copy_in(P.VRAM_HEAP_OFFSET, data))
out["exact"] = dock.copy_out(P.VRAM_HEAP_OFFSET, len(data)) == data
out["stats"] = {k: t.stats()[k] for k in ("errors", "retried_ok", "not_retried")}
out["latch"] = usb._async_err
client.fault("async_error", repeat=True)
out["repeat"] = err(lambda: dock.copy_in(P.VRAM_HEAP_OFFSET, data))
out["fired"] = fired("async_error")
""")
    assert out["once"]["error"] is None and out["exact"], out
    assert out["stats"] == {"errors": 1, "retried_ok": 1, "not_retried": 0}
    assert out["latch"] == 0
    assert out["repeat"]["error"].startswith("UsbLayerError: unstable_link: 3 consecutive transfer attempts failed "
                                             "(bound 3); last: async control OUT 0xF2: RuntimeError: async bulk OUT "
                                             "failed: status=1"), out["repeat"]
    # once, then on chunk 0's arm and fence read (both in flight when the arm's wait failed), three times each
    assert out["fired"] == 1 + 2 * 3


@pytest.mark.timeout(120)
def test_lost_receipts_short_and_timed_out_async_transfers_are_retried_by_the_nodes_transport(twin):
    """The faults that end a bare tinygrad copy with a latched async error (above: ``lost_receipt``, ``short``)
    or a timeout, one at a time, each while a copy-in streams: retried below tinygrad, the copy byte-exact."""
    out = run_tinygrad("""
t = node_transport()
dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(10))
res = {}
for i, (kind, params) in enumerate((("lost_receipt", {}), ("short", {"on": "bulk_out", "after": 3}),
                                    ("timeout", {"on": "0xF2", "after": 1}), ("timeout", {"on": "bulk_out",
                                                                                          "after": 4}))):
    data = pattern(4 * P.COPYIN_CHUNK, 10 + i)
    client.fault(kind, **params)
    e = err(lambda: dock.copy_in(P.VRAM_HEAP_OFFSET, data))
    res[f"{kind}-{i}"] = [e["error"], dock.copy_out(P.VRAM_HEAP_OFFSET, len(data)) == data]
    client.clear()
out["res"] = res
out["stats"] = {k: t.stats()[k] for k in ("errors", "retried_ok", "not_retried")}
""")
    assert out["res"] == {k: [None, True] for k in ("lost_receipt-0", "short-1", "timeout-2", "timeout-3")}, out
    assert out["stats"] == {"errors": 4, "retried_ok": 4, "not_retried": 0}


@pytest.mark.timeout(120)
def test_the_dma_windows_are_where_tinygrads_allocator_puts_them(twin):
    """The harness's copy_bufs, sys_buf and cq_buf and its VRAM buffers sit at the GPU addresses tinygrad 0.14's
    own ``AMMemoryManager.alloc_vaddr`` hands out with ``GMMU=0`` -- the VRAM identity mapping first, then
    ``USBIface._dma_region``'s windows in its order -- computed here on a fresh copy of tinygrad's allocator."""
    out = run_tinygrad("""
from tinygrad.runtime.support.am.amdev import AMMemoryManager
from tinygrad.runtime.support.memory import TLSFAllocator
g = AMMemoryManager.va_allocator
fresh = TLSFAllocator(g.size, base=g.base)
def alloc_vaddr(size, align=0x1000):  # MemoryManager.alloc_vaddr's rule, on the fresh allocator
    return fresh.alloc(size, max(1 << (size.bit_length() - 1), align))
out["tinygrad"] = [alloc_vaddr(P.BAR0_VRAM_BYTES, P.BAR0_VRAM_BYTES), alloc_vaddr(0x80000), alloc_vaddr(0x1000),
                   alloc_vaddr(0x1000)]
iface = dock.dev.iface
out["harness"] = [dock.buffer(0, 16).va_addr, iface.copy_bufs[0].va_addr, iface.sys_buf.va_addr, iface.cq_buf.va_addr]
out["sizes"] = [iface.copy_bufs[0].size, iface.sys_buf.size, iface.cq_buf.size]
data = pattern(3 * P.COPYIN_CHUNK)
dock.copy_in(P.VRAM_HEAP_OFFSET, data)
out["exact"] = dock.copy_out(P.VRAM_HEAP_OFFSET, len(data)) == data
out["sdma_errors"] = sdma()["error_count"]
""")
    assert out["harness"] == out["tinygrad"] == [0x2000_0000_0000, 0x2004_0000_0000, 0x2004_0008_0000,
                                                 0x2004_0008_1000]
    assert out["sizes"] == [0x80000, 0x1000, 0x1000]
    assert out["exact"] and out["sdma_errors"] == 0


@pytest.mark.timeout(120)
def test_a_hung_gpu_on_copy_out_is_the_gpus_at_the_wait_timeout_through_the_nodes_transport(twin):
    """The armed SRAM read is also the wait for the GPU: through the node's transport it gets the device wait
    timeout (3000 ms, not tinygrad's 10 s ``scsi_read`` and not a short per-try bound), then the bridge's own
    register answers, so the GPU is named, never the link."""
    out = run_tinygrad("""
t = node_transport()
dock.copy_in(P.VRAM_HEAP_OFFSET, pattern(4096))
client.fault("gpu_hang")
out["copy_out"] = err(lambda: dock.copy_out(P.VRAM_HEAP_OFFSET, 4096))
out["link_errors"] = t.stats()["errors"]
""")
    assert out["copy_out"]["error"].startswith("GpuLayerError: copy_out_not_done: bulk IN 0x81 timed out while the "
                                               "bridge answers (LTSSM 0x78): the GPU never wrote the window"), out
    assert 3.0 <= out["copy_out"]["s"] < 10.0
    assert out["link_errors"] == 0  # the timeout was the GPU's: nothing held against the link
