"""Every fault kind, observed through a client face with the symptom it promises (faults.KINDS), and the
GPU engine running the command-packet format of protocol.py on the tiny ONNX model.

One daemon serves the whole module (the engine's compile cache lives in it); each test starts from a
power-cycled dock with no faults, PCIe up and BARs assigned.
"""

from __future__ import annotations

import json
import os
import random
import struct
import time
import zlib

import numpy as np
import pytest

from chestnut.backend import protocol as P
from chestnut.backend.sim.client import TwinClient, TwinDaemon
from chestnut.backend.sim.engine import sentinel_block
from chestnut.backend.sim.libusb_codes import (
    LIBUSB_ERROR_IO,
    LIBUSB_ERROR_NO_DEVICE,
    LIBUSB_ERROR_PIPE,
    LIBUSB_ERROR_TIMEOUT,
    UsbError,
)
from chestnut.backend.sim.twin import RET_NO_COMPLETION
from chestnut.backend.sim.usb3 import TwinUSB3, acquire_dock_lock, forget_device_lists

IN, OUT = P.REQTYPE_VENDOR_IN, P.REQTYPE_VENDOR_OUT
VRAM_BAR = 32 << 30
DOORBELL_BAR = 48 << 30
PREFIX = f"twinfaults-{os.getpid()}"
pytestmark = pytest.mark.timeout(120)


class Host:
    """A small host for the dock protocol over raw vendor requests (what the backend's runner does for real)."""

    def __init__(self, client: TwinClient) -> None:
        self.c = client
        d = client.enumerate()[0]
        self.bus, self.address = d.bus, d.address
        self.h = client.open(d.bus, d.address)
        self.wptr = 0

    def xread(self, addr: int, n: int, timeout_ms: int = 1000) -> bytes:
        return self.c.ctrl_transfer(self.h, IN, P.REQ_XDATA_READ, addr, 0, n, timeout_ms)

    def u32(self, addr: int, timeout_ms: int = 1000) -> int:
        return struct.unpack("<I", self.xread(addr, 4, timeout_ms))[0]

    def power(self, on: bool) -> None:
        self.c.ctrl_transfer(self.h, OUT, P.REQ_PCIE_POWER, int(on), 0, b"", 10000)

    def tlp(self, fmt: int, addr: int, value: int = 0, mode: int = 0, byte_en: int = 0xF) -> None:
        self.c.ctrl_transfer(self.h, OUT, P.REQ_TLP, fmt | byte_en << 8, mode,
                             struct.pack("<III", addr & 0xFFFFFFFF, addr >> 32, value), 5000)

    def cpl(self) -> tuple[int, int, int]:
        b = self.c.ctrl_transfer(self.h, IN, P.REQ_TLP, 0, 0, 8, 5000)
        return struct.unpack_from("<I", b)[0], (b[4] >> 5) & 7, b[7]

    def cfg(self, bus: int, off: int, value: int | None = None) -> tuple[int, int, int]:
        self.tlp((0x44 if value is not None else 0x04) | int(bus > 0), bus << 24 | off, value or 0)
        return self.cpl()

    def bring_up(self) -> None:
        """LTSSM power-up, then the BAR set-up of tinygrad 0.14 pci_setup_usb_bars (VRAM at 32 GiB, 16 GiB)."""
        self.power(True)
        for bus in range(4):
            for off, v in ((0x18, (bus + 1) << 8 | 4 << 16), (0x20, 0x1000 | 0xFFFF << 16), (0x24, 0xFFFF << 16),
                           (0x28, 8), (0x2C, 0xFFFFFFFF), (0x04, 7)):
                self.cfg(bus, off, v)
        self.cfg(4, 0x108, (self.cfg(4, 0x108)[0] & ~0x1F00) | 14 << 8)
        for off, v in ((0x10, 0), (0x14, 8), (0x18, 0), (0x1C, 12), (0x24, 0x10000000), (0x04, 7)):
            self.cfg(4, off, v)

    def mem_write(self, off: int, data: bytes) -> None:
        data += bytes(-len(data) % 4)
        self.tlp(P.TLP_MEM_WRITE64, VRAM_BAR + off, len(data) // 4, mode=P.TLP_MODE_STREAM_WRITE)
        assert self.c.bulk_write(self.h, P.EP_BULK_OUT, data, 5000) == len(data)

    def mem_read(self, off: int, n: int) -> bytes:
        self.tlp(P.TLP_MEM_READ64, VRAM_BAR + off, -(-n // 4), mode=P.TLP_MODE_STREAM_READ)
        return self.c.bulk_read(self.h, P.EP_BULK_IN, -(-n // 4) * 4, 5000)[:n]

    def sram_write(self, data: bytes, slot: int = 0) -> None:
        data += bytes(-len(data) % 512)
        self.c.ctrl_transfer(self.h, OUT, P.REQ_SRAM, len(data) // 512, slot | (-(-len(data) // P.SRAM_SLOT)) << 8,
                             b"")
        assert self.c.bulk_write(self.h, P.EP_BULK_OUT, data, 5000) == len(data)

    def sram_read(self, n: int, slot: int = 0) -> bytes:
        n512 = -(-n // 512) * 512
        self.c.ctrl_transfer(self.h, OUT, P.REQ_SRAM, n512 // 512 | 0x8000, slot | (-(-n512 // P.SRAM_SLOT)) << 8,
                             b"")
        return self.c.bulk_read(self.h, P.EP_BULK_IN, n512, 5000)[:n]

    # ---- packets
    @staticmethod
    def packet(op: int, seq: int, *args: int) -> bytes:
        return struct.pack(f"<II{len(args)}I", op | (2 + len(args)) << 16, seq, *args)

    def submit(self, *packets: bytes) -> None:
        raw = b"".join(packets)
        self.mem_write(P.RING_VRAM_OFFSET + self.wptr % P.RING_BYTES, raw)
        self.wptr += len(raw)
        self.tlp(P.TLP_MEM_WRITE64, DOORBELL_BAR + P.DOORBELL_BAR_OFFSET, self.wptr)

    def queue_reset(self) -> None:
        self.tlp(P.TLP_MEM_WRITE64, DOORBELL_BAR + P.DOORBELL_QUEUE_RESET, 1)

    def completion(self, timeout_ms: int = 1000) -> dict[str, int]:
        block = self.xread(P.XDATA_CPL_PAGE + P.CPL_QUEUE_FENCE, 16, timeout_ms)
        fence, status, signal, rptr = struct.unpack("<IIII", block)
        return {"fence": fence, "status": status, "signal": signal, "rptr": rptr}

    def wait(self, seq: int, timeout_s: float = 60.0) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        while (c := self.completion())["fence"] != seq:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fence {c['fence']} never reached {seq}")
            time.sleep(0.005)
        return c

    def copyin_chunk(self, half: int, payload: bytes, seq: int) -> None:
        """Stage a chunk and its sentinel block in an SRAM half (protocol.py layout)."""
        padded = payload + bytes(-len(payload) % 512)
        self.sram_write(padded + sentinel_block(payload, seq), slot=half * P.SLOTS_PER_HALF)

    def load(self, onnx: bytes, seq: int, program_id: int = 1, at: int = P.VRAM_HEAP_OFFSET) -> dict:
        sig = at + (-(-len(onnx) // 4096) * 4096)
        self.mem_write(at, onnx)
        self.submit(self.packet(P.OP_LOAD, seq, program_id, at, 0, len(onnx), sig, 0))
        c = self.wait(seq)
        n = struct.unpack("<I", self.mem_read(sig, 4))[0]
        return {"status": c["status"], "signature": json.loads(self.mem_read(sig + 4, n))}

    def run(self, x: np.ndarray, seq: int, program_id: int = 1, base: int = 0x1000000) -> tuple[int, np.ndarray]:
        out_n = 1 * 1 * 16 * 32 * 4
        self.mem_write(base, x.tobytes())
        table = struct.pack("<IIQQQQ", 1, 1, base, x.nbytes, base + 0x10000, out_n)
        self.mem_write(base + 0x20000, table)
        self.submit(self.packet(P.OP_RUN, seq, program_id, base + 0x20000, 0))
        status = self.wait(seq)["status"]
        return status, np.frombuffer(self.mem_read(base + 0x10000, out_n), np.float32).reshape(1, 1, 16, 32)


@pytest.fixture(scope="module")
def daemon():
    with TwinDaemon(PREFIX, ["--training-delay-ms", "2"]) as d:
        yield d


@pytest.fixture
def client(daemon):
    with daemon.client() as c:
        c.clear()
        c.power_cycle()
        c.set_phase("idle")
        yield c
        c.clear()


@pytest.fixture
def host(client):
    h = Host(client)
    h.bring_up()
    return h


@pytest.fixture
def usb3(client):
    forget_device_lists()
    (dev, _), = TwinUSB3.list_devices(0xADD1, 0x0001, prefix=PREFIX)
    u = TwinUSB3(dev)
    yield u
    u.close()


def raises(code: int, fn, *args, **kw) -> UsbError:
    with pytest.raises(UsbError) as e:
        fn(*args, **kw)
    assert e.value.code == code, repr(e.value)
    return e.value


def onnx_reference(path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


# ====================================================================== the engine
def test_copyin_drains_a_chunk_clears_the_sentinel_and_bumps_the_fence(host):
    payload = random.Random(1).randbytes(P.CHUNK_PAYLOAD)
    host.submit(host.packet(P.OP_COPYIN, 1, 0, len(payload), 0x400000, 0, 0))  # the GPU waits for the sentinel
    time.sleep(0.1)
    assert host.completion()["fence"] == 0
    host.copyin_chunk(0, payload, 0)
    assert host.wait(1)["status"] == P.STATUS_OK
    assert host.u32(P.XDATA_COPYIN_FENCE) == 1
    assert host.mem_read(0x400000, len(payload)) == payload
    assert host.sram_read(P.SRAM_HALF)[-P.SENTINEL_BLOCK:] == bytes(P.SENTINEL_BLOCK)
    small = b"tail of the copy"  # a short last chunk in the other half
    host.copyin_chunk(1, small, 1)
    host.submit(host.packet(P.OP_COPYIN, 2, 1, len(small), 0x400000 + len(payload), 0, 1))
    assert host.wait(2)["status"] == P.STATUS_OK and host.u32(P.XDATA_COPYIN_FENCE) == 2
    assert host.mem_read(0x400000 + len(payload), len(small)) == small


def test_a_corrupt_chunk_is_refused_with_status_crc(host):
    payload = b"\x42" * 4096
    block = bytearray(sentinel_block(payload, 0))
    struct.pack_into("<I", block, 4, zlib.crc32(payload) ^ 1)
    host.sram_write(payload + bytes(block))
    host.submit(host.packet(P.OP_COPYIN, 1, 0, len(payload), 0x400000, 0, 0))
    assert host.wait(1)["status"] == P.STATUS_CRC
    assert host.u32(P.XDATA_COPYIN_FENCE) == 0 and host.mem_read(0x400000, 16) == bytes(16)


def test_copyout_signal_and_bad_packets(host):
    host.mem_write(0x500000, bytes(range(256)) * 8)
    host.submit(host.packet(P.OP_COPYOUT, 1, 1, 2048, 0x500000, 0),
                struct.pack("<II", 0x77 | 2 << 16, 2),              # unknown opcode
                host.packet(P.OP_SIGNAL, 3, 0xFEED),
                host.packet(P.OP_RUN, 4, 9, 0, 0))                  # no program 9
    c = host.wait(4)
    assert (c["status"], c["signal"], c["rptr"]) == (P.STATUS_NO_PROGRAM, 0xFEED, host.wptr)
    assert host.sram_read(2048, slot=P.SLOTS_PER_HALF) == bytes(range(256)) * 8


@pytest.mark.slow
def test_load_and_run_the_tiny_model_like_onnxruntime(host, tiny_onnx):
    onnx = tiny_onnx.read_bytes()
    loaded = host.load(onnx, 1)
    assert loaded["status"] == P.STATUS_OK
    sig = loaded["signature"]
    assert sig["inputs"] == [{"name": "x", "shape": [1, 3, 32, 64], "dtype": "float32"}]
    assert sig["outputs"] == [{"name": "prob", "shape": [1, 1, 16, 32], "dtype": "float32"}]
    assert sig["sha256"] == __import__("hashlib").sha256(onnx).hexdigest()
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 64)).astype(np.float32)
    status, y = host.run(x, 2)
    assert status == P.STATUS_OK
    np.testing.assert_allclose(y, onnx_reference(tiny_onnx, x), rtol=1e-4, atol=1e-5)
    assert host.c.status()["phase"] == "serving"
    garbage = host.load(b"not an onnx model", 3, program_id=2)
    assert garbage["status"] == P.STATUS_COMPILE_FAILED and "error" in garbage["signature"]


# ====================================================================== USB faults
def test_disconnect(client, usb3):
    client.fault("disconnect")
    with pytest.raises(RuntimeError, match=r"^libusb_control_transfer: No such device \(it may have been"):
        usb3.control_read(P.REQ_XDATA_READ, 1, value=P.XDATA_LTSSM)
    assert client.enumerate() == []
    raises(LIBUSB_ERROR_NO_DEVICE, client.open, usb3.dev.bus, usb3.dev.address)
    assert client.plug().address == usb3.dev.address + 1


def test_reenumerate(client, usb3):
    client.fault("reenumerate")
    with pytest.raises(RuntimeError, match="No such device"):
        usb3.control_write(P.REQ_XDATA_WRITE, P.XDATA_SYS_PAGE, 1)
    (d,) = client.enumerate()
    assert (d.address, d.generation) == (usb3.dev.address + 1, client.status()["usb"]["generation"])
    assert [n for _, n in TwinUSB3.list_devices(0xADD1, 0x0001, prefix=PREFIX)] == [usb3.dev.pcibus]  # cached


def test_usb2_fallback(host):
    host.c.fault("usb2")
    assert host.c.enumerate()[0].speed_mbps == P.HIGHSPEED_MBPS
    assert len(host.xread(P.XDATA_SYS_PAGE, 64)) == 64
    t0 = time.monotonic()
    raises(LIBUSB_ERROR_TIMEOUT, host.xread, P.XDATA_SYS_PAGE, 65, 100)
    assert time.monotonic() - t0 >= 0.095
    data = random.Random(2).randbytes(65536)
    host.sram_write(data)  # reports all 65536 bytes written...
    host.c.clear()
    got = host.sram_read(65536)
    assert got[:32768] == data[:32768] and got[32768:] == bytes(32768)  # ...but only 32 KiB arrived


def test_short_transfer(host):
    errors = host.c.status()["usb"]["link_errors"]  # a counter, like the host port's: it only grows
    host.sram_write(bytes(range(256)) * 4)
    host.c.fault("short", on="bulk_in")
    host.c.ctrl_transfer(host.h, OUT, P.REQ_SRAM, 2 | 0x8000, 1 << 8, b"")
    assert host.c.bulk_read(host.h, P.EP_BULK_IN, 1024) == bytes(range(256)) * 2
    host.c.fault("short", on="bulk_out", nbytes=100)
    host.c.ctrl_transfer(host.h, OUT, P.REQ_SRAM, 1, 1 << 8, b"")
    assert host.c.bulk_write(host.h, P.EP_BULK_OUT, bytes(512)) == 100
    assert host.c.status()["usb"]["link_errors"] == errors + 2


def test_transfer_timeout(client, usb3):
    client.fault("timeout")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="^libusb_control_transfer: Operation timed out$"):
        usb3.control_read(P.REQ_XDATA_READ, 1, value=P.XDATA_LTSSM, timeout=200)
    assert 0.19 <= time.monotonic() - t0 < 2.0
    assert usb3.control_read(P.REQ_XDATA_READ, 1, value=P.XDATA_LTSSM)[0] == P.LTSSM_DETECT


def test_latched_async_error(client, usb3):
    errors = client.status()["usb"]["link_errors"]
    usb3.control_write(P.REQ_SRAM, 2, 1 << 8)
    client.fault("async_error")
    tag = usb3.bulk_write_async(bytes(512))
    with pytest.raises(RuntimeError, match=r"^async bulk OUT failed: status=1$"):
        usb3.bulk_wait(tag)
    good = usb3.bulk_write_async(bytes(512))  # this one goes through, the latch stays
    with pytest.raises(RuntimeError, match=r"^async bulk OUT failed: status=1$"):
        usb3.bulk_wait(good)
    assert client.status()["usb"]["link_errors"] == errors + 1


def test_endpoint_stall(client, usb3):
    client.fault("stall", on="bulk_out")
    usb3.control_write(P.REQ_SRAM, 1, 1 << 8)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"^bulk OUT 0x02 failed: Pipe error$"):
            usb3.bulk_write(bytes(512))
    assert client.status()["usb"]["halted"] == [P.EP_BULK_OUT]
    usb3.close()
    again = TwinUSB3(usb3.dev)  # a fresh open sets the configuration, which clears the halt
    again.control_write(P.REQ_SRAM, 1, 1 << 8)
    again.bulk_write(bytes(512))
    again.close()


def test_wedged_bridge(client, usb3):
    client.fault("wedged")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="Operation timed out"):
            usb3.control_read(P.REQ_XDATA_READ, 1, value=P.XDATA_LTSSM, timeout=50)
    assert client.status()["bridge"]["wedged"]
    client.power_cycle()
    assert not client.status()["bridge"]["wedged"]


def test_brownout(host):
    host.mem_write(0x600000, b"precious")
    host.c.fault("brownout", off_s=0.4)
    raises(LIBUSB_ERROR_NO_DEVICE, host.xread, P.XDATA_LTSSM, 1)
    assert host.c.enumerate() == []
    time.sleep(0.6)
    back = Host(host.c)
    assert back.address == host.address + 1
    assert back.xread(P.XDATA_LTSSM, 1) == bytes([P.LTSSM_DETECT])
    back.bring_up()
    assert back.mem_read(0x600000, 8) == bytes(8)  # VRAM lost


def test_lock_held_by_another_process(client, usb3):
    client.fault("lock_held", for_s=0.5)
    with pytest.raises(RuntimeError, match=rf"^Failed to acquire lock file am_usb:{usb3.dev.bus}-{usb3.dev.address}\."):
        acquire_dock_lock(usb3.dev.bus, usb3.dev.address)
    time.sleep(0.8)  # the window ends; the daemon lets go
    os.close(acquire_dock_lock(usb3.dev.bus, usb3.dev.address))


# ====================================================================== PCIe faults
def test_ltssm_down(host):
    host.c.fault("ltssm_down")
    assert host.xread(P.XDATA_LTSSM, 1) == bytes([P.LTSSM_DETECT])
    assert host.cfg(4, 0) == (0, P.CPL_SUCCESS, RET_NO_COMPLETION)
    host.power(True)  # retrains
    assert host.xread(P.XDATA_LTSSM, 1) == bytes([P.LTSSM_L0])


def test_ltssm_stuck(host):
    host.c.fault("ltssm_stuck", repeat=True)
    host.power(False)
    host.power(True)
    assert host.xread(P.XDATA_LTSSM, 1) == bytes([P.LTSSM_STUCK])
    assert host.cfg(0, 0)[2] == RET_NO_COMPLETION
    host.c.clear()
    host.power(True)
    assert host.xread(P.XDATA_LTSSM, 1) == bytes([P.LTSSM_L0])


@pytest.mark.parametrize("status,code", [("ur", P.CPL_UR), ("ca", P.CPL_CA)])
def test_bad_tlp_completion(host, status, code):
    host.c.fault("bad_tlp", status=status)
    assert host.cfg(4, 0) == (0xFFFFFFFF, code, 0)
    assert host.cfg(4, 0) == (P.GPU_DEVICE_ID << 16 | P.AMD_VENDOR_ID, P.CPL_SUCCESS, 0)
    host.c.fault("bad_tlp")
    assert host.mem_read(0, 8) == b"\xff" * 8  # a streaming read of failed completions reads all-ones


# ====================================================================== GPU faults
def test_fence_stall(host):
    host.c.fault("fence_stall")
    payload = b"\x5a" * 1000
    host.copyin_chunk(0, payload, 0)
    host.submit(host.packet(P.OP_COPYIN, 1, 0, len(payload), 0x400000, 0, 0))
    time.sleep(0.3)
    assert host.mem_read(0x400000, len(payload)) == payload          # the work was done
    assert host.sram_read(1536)[1024:] == bytes(512)                  # the sentinel was cleared
    assert host.u32(P.XDATA_COPYIN_FENCE) == 0 and host.completion()["fence"] == 0  # the fences never moved
    assert host.c.status()["gpu"]["executing"] is None


def test_lost_receipt(host):
    host.c.fault("lost_receipt")
    host.submit(host.packet(P.OP_NOP, 1))
    time.sleep(0.2)
    assert host.c.status()["gpu"]["queue_fence"] == 1  # the fence moved...
    t0 = time.monotonic()
    raises(LIBUSB_ERROR_TIMEOUT, host.completion, 200)  # ...the host's read of it never returns
    assert time.monotonic() - t0 >= 0.19
    assert host.completion()["fence"] == 1


def test_sentinel_never_cleared(host):
    host.c.fault("sentinel_stuck")
    payload = b"\x33" * 512
    host.copyin_chunk(0, payload, 0)
    host.submit(host.packet(P.OP_COPYIN, 1, 0, len(payload), 0x400000, 0, 0))
    time.sleep(0.3)
    assert host.sram_read(1024)[1020:] == struct.pack("<I", P.sentinel_value(0))  # still there
    assert host.u32(P.XDATA_COPYIN_FENCE) == 0 and host.completion()["fence"] == 0
    assert host.c.status()["gpu"]["executing"] == "COPYIN seq 1"
    host.queue_reset()
    assert host.completion()["rptr"] == host.wptr
    host.submit(host.packet(P.OP_NOP, 2))
    assert host.wait(2)["status"] == P.STATUS_OK


def test_gpu_hang(host):
    host.c.fault("gpu_hang")
    host.submit(host.packet(P.OP_NOP, 1), host.packet(P.OP_NOP, 2))
    time.sleep(0.3)
    assert host.completion()["fence"] == 0 and host.c.status()["gpu"]["hung"]
    host.power(False)  # a GPU reset ends the hang
    host.bring_up()
    assert not host.c.status()["gpu"]["hung"]
    host.wptr = 0
    host.submit(host.packet(P.OP_NOP, 3))
    assert host.wait(3)["status"] == P.STATUS_OK


def test_slow_gpu(host):
    host.c.fault("slow_gpu", delay_ms=300)
    t0 = time.monotonic()
    host.submit(host.packet(P.OP_NOP, 1))
    host.wait(1)
    assert time.monotonic() - t0 >= 0.3


@pytest.mark.slow
def test_nan_stale_and_zero_outputs(host, tiny_onnx):
    assert host.load(tiny_onnx.read_bytes(), 1)["status"] == P.STATUS_OK
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((1, 3, 32, 64)).astype(np.float32) for _ in range(5)]
    host.c.fault("nan_output", phase="serving")  # the first run is not in the serving phase yet
    status, y0 = host.run(xs[0], 2)
    assert status == P.STATUS_OK and np.isfinite(y0).all()
    _, y1 = host.run(xs[1], 3)
    assert np.isnan(y1).all()
    _, y2 = host.run(xs[2], 4)
    host.c.fault("stale_output")
    _, y3 = host.run(xs[3], 5)
    np.testing.assert_array_equal(y3, y2)
    host.c.fault("zero_output")
    _, y4 = host.run(xs[4], 6)
    assert not y4.any()
    np.testing.assert_allclose(y2, onnx_reference(tiny_onnx, xs[2]), rtol=1e-4, atol=1e-5)


# ====================================================================== activation over the daemon
def test_probability_and_window_over_the_daemon(host):
    host.c.fault("timeout", repeat=True, probability=0.4, seed=11, on="0xE4")
    got = []
    for _ in range(30):
        try:
            host.xread(P.XDATA_LTSSM, 1, timeout_ms=2)
            got.append(False)
        except UsbError:
            got.append(True)
    rng = random.Random(11)
    assert got == [rng.random() < 0.4 for _ in range(30)]
    host.c.clear()
    host.c.fault("async_error", on="control_in", repeat=True, for_s=0.3)
    raises(LIBUSB_ERROR_IO, host.xread, P.XDATA_LTSSM, 1)
    time.sleep(0.35)
    assert host.xread(P.XDATA_LTSSM, 1) == bytes([P.LTSSM_L0])
    assert host.c.status()["faults"] == []


def test_malformed_request_under_faults_still_stalls(host):
    host.c.fault("slow_gpu")
    raises(LIBUSB_ERROR_PIPE, host.c.ctrl_transfer, host.h, IN, 0x42, 0, 0, 4)
