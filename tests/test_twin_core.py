"""The twin's core, in-process: USB, XDATA/LTSSM, TLPs and PCIe config, SRAM, sparse VRAM, malformed
requests, and the fault table's activation rules. No processes, no sockets."""

from __future__ import annotations

import random
import struct
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chestnut.backend import protocol as P
from chestnut.backend.sim import descriptors as D
from chestnut.backend.sim.faults import PHASE_TRANSITIONS, FaultSpec, FaultTable, Phase, PhaseEvent, TransferSite
from chestnut.backend.sim.libusb_codes import (
    LIBUSB_ERROR_BUSY,
    LIBUSB_ERROR_INVALID_PARAM,
    LIBUSB_ERROR_NO_DEVICE,
    LIBUSB_ERROR_NOT_FOUND,
    LIBUSB_ERROR_PIPE,
    LIBUSB_ERROR_TIMEOUT,
    UsbError,
)
from chestnut.backend.sim.memory import SparseMemory
from chestnut.backend.sim.twin import LTSSM_TRAINING, RET_NO_COMPLETION, Twin, TwinConfig

OUT, IN = P.REQTYPE_VENDOR_OUT, P.REQTYPE_VENDOR_IN


@pytest.fixture
def twin():
    t = Twin(TwinConfig(training_delay_s=0.005))
    yield t
    t.close()


@pytest.fixture
def h(twin):
    d = twin.enumerate()[0]
    return twin.open(d.bus, d.address)


def ltssm(twin, h):
    return twin.ctrl_transfer(h, IN, P.REQ_XDATA_READ, P.XDATA_LTSSM, 0, 1)[0]


def tlp(twin, h, fmt, addr, value=0, byte_en=0xF, mode=0):
    twin.ctrl_transfer(h, OUT, P.REQ_TLP, fmt | byte_en << 8, mode, struct.pack("<III", addr & 0xFFFFFFFF, addr >> 32,
                                                                                   value))


def cpl(twin, h):
    b = twin.ctrl_transfer(h, IN, P.REQ_TLP, 0, 0, 8)
    return struct.unpack_from("<I", b)[0], (b[4] >> 5) & 7, b[7]


def cfg(twin, h, bus, off, value=None):
    fmt = (0x44 if value is not None else 0x04) | int(bus > 0)
    tlp(twin, h, fmt, bus << 24 | off, value or 0)
    return cpl(twin, h)


def setup_bars(twin, h):
    """The steps of tinygrad 0.14 pci_setup_usb_bars, written out (values as tinygrad writes them)."""
    for bus in range(4):
        cfg(twin, h, bus, 0x18, 0 | (bus + 1) << 8 | 4 << 16)
        cfg(twin, h, bus, 0x20, 0x1000 | 0xFFFF << 16)
        cfg(twin, h, bus, 0x24, 0x0000 | 0xFFFF << 16)
        cfg(twin, h, bus, 0x28, 8)
        cfg(twin, h, bus, 0x2C, 0xFFFFFFFF)
        cfg(twin, h, bus, 0x04, 0x7)
    cfg(twin, h, 4, 0x108, (cfg(twin, h, 4, 0x108)[0] & ~0x1F00) | 14 << 8)
    cfg(twin, h, 4, 0x10, 0)
    cfg(twin, h, 4, 0x14, 8)
    cfg(twin, h, 4, 0x18, 0)
    cfg(twin, h, 4, 0x1C, 12)
    cfg(twin, h, 4, 0x24, 0x10000000)
    cfg(twin, h, 4, 0x04, 0x7)


def power_on(twin, h):
    twin.ctrl_transfer(h, OUT, P.REQ_PCIE_POWER, 1, 0, b"", 10000)


# ---------------------------------------------------------------------- USB
def test_enumeration_shows_the_dock_with_its_ids_speed_and_descriptors(twin):
    (d,) = twin.enumerate()
    assert (d.bus, d.address, d.vid, d.pid, d.speed_mbps) == (2, 5, 0xADD1, 0x0001, 5000)
    assert struct.unpack_from("<HHH", d.device_descriptor, 8) == (0xADD1, 0x0001, 0x0100)
    assert struct.unpack_from("<H", d.device_descriptor, 2)[0] == 0x0320
    assert d.config_descriptor[5] == P.USB_CONFIGURATION
    eps = [d.config_descriptor[i + 2] for i in range(len(d.config_descriptor) - 1)
           if d.config_descriptor[i:i + 2] == bytes([7, D.DT_ENDPOINT])]
    assert eps == [P.EP_BULK_IN, P.EP_BULK_OUT]


def test_product_string_starts_with_custom(twin, h):
    raw = twin.ctrl_transfer(h, 0x80, 0x06, 0x0302, 0x0409, 255)
    assert raw[2:raw[0]].decode("utf-16-le") == "custom ASM2464PD Chestnut"
    assert twin.ctrl_transfer(h, 0x80, 0x06, 0x0300, 0, 255) == bytes([4, 3, 0x09, 0x04])


def test_interface_claim_is_exclusive_and_released_on_close(twin, h):
    d = twin.enumerate()[0]
    other = twin.open(d.bus, d.address)
    twin.claim_interface(h, 0)
    with pytest.raises(UsbError) as e:
        twin.claim_interface(other, 0)
    assert e.value.code == LIBUSB_ERROR_BUSY
    with pytest.raises(UsbError) as e:
        twin.bulk_read(other, P.EP_BULK_IN, 512, 10)
    assert e.value.code == LIBUSB_ERROR_BUSY
    twin.close_handle(h)
    twin.claim_interface(other, 0)


def test_unplug_plug_gives_a_new_address_and_old_handles_see_no_device(twin, h):
    twin.unplug()
    assert twin.enumerate() == []
    with pytest.raises(UsbError) as e:
        ltssm(twin, h)
    assert e.value.code == LIBUSB_ERROR_NO_DEVICE
    info = twin.plug()
    assert (info.bus, info.address, info.generation) == (2, 6, 3)
    with pytest.raises(UsbError) as e:
        ltssm(twin, h)
    assert e.value.code == LIBUSB_ERROR_NO_DEVICE
    with pytest.raises(UsbError) as e:
        twin.open(2, 5)
    assert e.value.code == LIBUSB_ERROR_NO_DEVICE
    assert ltssm(twin, twin.open(2, 6)) == P.LTSSM_DETECT


def test_unknown_endpoint_is_not_found(twin, h):
    with pytest.raises(UsbError) as e:
        twin.bulk_write(h, 0x03, b"x" * 512)
    assert e.value.code == LIBUSB_ERROR_NOT_FOUND


def test_bulk_in_with_nothing_armed_naks_until_the_timeout(twin, h):
    t0 = time.monotonic()
    with pytest.raises(UsbError) as e:
        twin.bulk_read(h, P.EP_BULK_IN, 512, 100)
    assert e.value.code == LIBUSB_ERROR_TIMEOUT
    assert time.monotonic() - t0 >= 0.095


# ---------------------------------------------------------------------- XDATA and the PCIe link
def test_ltssm_is_unpowered_then_trains_to_l0_after_power_on():
    twin = Twin(TwinConfig(training_delay_s=0.3))
    try:
        d = twin.enumerate()[0]
        h = twin.open(d.bus, d.address)
        assert ltssm(twin, h) == P.LTSSM_DETECT
        t = threading.Thread(target=power_on, args=(twin, h))
        t0 = time.monotonic()
        t.start()
        time.sleep(0.1)
        assert ltssm(twin, h) == LTSSM_TRAINING
        t.join()
        assert time.monotonic() - t0 >= 0.29  # 0xF3 completes when training is over
        assert ltssm(twin, h) == P.LTSSM_L0
        twin.ctrl_transfer(h, OUT, P.REQ_PCIE_POWER, 0, 0, b"")
        assert ltssm(twin, h) == P.LTSSM_DETECT
    finally:
        twin.close()


def test_xdata_writes_read_back_and_ltssm_is_read_only(twin, h):
    for i, b in enumerate(b"\x11\x22\x33"):
        twin.ctrl_transfer(h, OUT, P.REQ_XDATA_WRITE, P.XDATA_COPYIN_FENCE + i, b, b"")
    twin.ctrl_transfer(h, OUT, P.REQ_XDATA_WRITE, P.XDATA_LTSSM, 0x78, b"")
    assert twin.ctrl_transfer(h, IN, P.REQ_XDATA_READ, P.XDATA_COPYIN_FENCE, 0, 4) == b"\x11\x22\x33\x00"
    assert ltssm(twin, h) == P.LTSSM_DETECT


def test_tlps_without_a_link_get_no_completion(twin, h):
    assert cfg(twin, h, 0, 0) == (0, P.CPL_SUCCESS, RET_NO_COMPLETION)


# ---------------------------------------------------------------------- PCIe config and BARs
def test_config_space_routing_bar_sizing_and_rebar(twin, h):
    power_on(twin, h)
    assert cfg(twin, h, 0, 0) == (0x24641B21, P.CPL_SUCCESS, 0)
    assert cfg(twin, h, 4, 0)[1] == P.CPL_UR  # bridges not programmed yet
    setup_bars(twin, h)
    assert cfg(twin, h, 4, 0) == (P.GPU_DEVICE_ID << 16 | P.AMD_VENDOR_ID, P.CPL_SUCCESS, 0)
    assert cfg(twin, h, 4, 0x100)[0] & 0xFFFF == 0x15  # Resizable BAR capability
    assert cfg(twin, h, 4, 0x10)[0] == 0x0000000C and cfg(twin, h, 4, 0x14)[0] == 8
    cfg(twin, h, 4, 0x10, 0xFFFFFFFF)
    cfg(twin, h, 4, 0x14, 0xFFFFFFFF)
    assert (cfg(twin, h, 4, 0x10)[0], cfg(twin, h, 4, 0x14)[0]) == (0xC, 0xFFFFFFFC)  # 16 GiB after ReBAR
    cfg(twin, h, 4, 0x24, 0xFFFFFFFF)
    assert cfg(twin, h, 4, 0x24)[0] == 0xFFF80000  # BAR5: 512 KiB, 32-bit
    assert cfg(twin, h, 4, 0x20)[0] & 1 == 1       # BAR4 is I/O
    assert cfg(twin, h, 5, 0)[1] == P.CPL_UR       # no bus 5
    assert cfg(twin, h, 4, 1 << 19)[1] == P.CPL_UR  # no device 1 on bus 4


def test_memory_tlps_reach_vram_mmio_and_the_doorbell(twin, h):
    power_on(twin, h)
    setup_bars(twin, h)
    vram, mmio = 32 << 30, 0x10000000
    tlp(twin, h, 0x60, vram + 0x3F000_0000 + 0x100, 0xAABBCCDD)  # 15.75 GiB into BAR0
    tlp(twin, h, 0x20, vram + 0x3F000_0000 + 0x100)
    assert cpl(twin, h) == (0xAABBCCDD, P.CPL_SUCCESS, 0)
    assert twin.vram.pages_used == 1
    tlp(twin, h, 0x60, mmio + 0x40, 0x0000BEEF, byte_en=0x3)
    tlp(twin, h, 0x20, mmio + 0x40)
    assert cpl(twin, h)[0] == 0xBEEF
    tlp(twin, h, 0x20, 0x1000)
    assert cpl(twin, h) == (0xFFFFFFFF, P.CPL_UR, 0)
    # streaming write + read through BAR0
    data = bytes(range(256)) * 64
    tlp(twin, h, 0x60, vram + 0x4000, len(data) // 4, mode=1)
    assert twin.bulk_write(h, P.EP_BULK_OUT, data) == len(data)
    tlp(twin, h, 0x20, vram + 0x4000, len(data) // 4, mode=2)
    assert twin.bulk_read(h, P.EP_BULK_IN, len(data)) == data


# ---------------------------------------------------------------------- SRAM
def test_sram_round_trip_through_f2_in_both_halves(twin, h):
    for slot in (0, P.SLOTS_PER_HALF):
        data = random.Random(slot).randbytes(0x9000)
        sectors = -(-len(data) // 512)
        twin.ctrl_transfer(h, OUT, P.REQ_SRAM, sectors, slot | (-(-sectors * 512 // 0x4000)) << 8, b"")
        padded = data + bytes(sectors * 512 - len(data))
        assert twin.bulk_write(h, P.EP_BULK_OUT, padded) == len(padded)
        twin.ctrl_transfer(h, OUT, P.REQ_SRAM, sectors | 0x8000, slot | (-(-sectors * 512 // 0x4000)) << 8, b"")
        assert twin.bulk_read(h, P.EP_BULK_IN, len(padded))[:len(data)] == data
        assert bytes(twin.sram[slot * 0x4000:slot * 0x4000 + len(data)]) == data
    # XDATA 0xF000.. is a window on the SRAM
    assert twin.ctrl_transfer(h, IN, P.REQ_XDATA_READ, 0xF000, 0, 16) == bytes(twin.sram[:16])


# ---------------------------------------------------------------------- malformed requests stall
MALFORMED = [
    ("unknown vendor IN", IN, 0x99, 0, 0, 4),
    ("unknown vendor OUT", OUT, 0x99, 0, 0, b""),
    ("0xE4 as OUT", OUT, P.REQ_XDATA_READ, 0, 0, b""),
    ("0xE5 as IN", IN, P.REQ_XDATA_WRITE, 0, 0, 1),
    ("0xE4 zero length", IN, P.REQ_XDATA_READ, 0, 0, 0),
    ("0xE4 256 bytes", IN, P.REQ_XDATA_READ, 0, 0, 256),
    ("0xE4 past 64 KiB", IN, P.REQ_XDATA_READ, 0xFFFF, 0, 2),
    ("0xE5 value over a byte", OUT, P.REQ_XDATA_WRITE, 0xA000, 0x100, b""),
    ("0xE5 with data", OUT, P.REQ_XDATA_WRITE, 0xA000, 1, b"x"),
    ("0xF0 11 bytes", OUT, P.REQ_TLP, 0x0F04, 0, b"\x00" * 11),
    ("0xF0 mode 3", OUT, P.REQ_TLP, 0x0F04, 3, b"\x00" * 12),
    ("0xF0 unaligned", OUT, P.REQ_TLP, 0x0F04, 0, struct.pack("<III", 2, 0, 0)),
    ("0xF0 byte enable > 4 bits", OUT, P.REQ_TLP, 0xFF04, 0, b"\x00" * 12),
    ("0xF0 stream read fmt", OUT, P.REQ_TLP, 0x0F20, 1, struct.pack("<III", 0, 0, 1)),
    ("0xF0 stream zero dwords", OUT, P.REQ_TLP, 0x0F60, 1, struct.pack("<III", 0, 0, 0)),
    ("0xF0 IN 7 bytes", IN, P.REQ_TLP, 0, 0, 7),
    ("0xF2 zero sectors", OUT, P.REQ_SRAM, 0, 1 << 8, b""),
    ("0xF2 wrong slot count", OUT, P.REQ_SRAM, 64, 3 << 8, b""),
    ("0xF2 past the SRAM", OUT, P.REQ_SRAM, 64, 31 | 2 << 8, b""),
    ("0xF3 value 2", OUT, P.REQ_PCIE_POWER, 2, 0, b""),
    ("class request", 0x21, 0x00, 0, 0, b""),
    ("vendor to an interface", 0x41, P.REQ_XDATA_WRITE, 0xA000, 1, b""),
    ("unknown descriptor", 0x80, 0x06, 0x0700, 0, 18),
    ("string 9", 0x80, 0x06, 0x0309, 0x0409, 255),
    ("SET_CONFIGURATION 2", 0x00, 0x09, 2, 0, b""),
]


@pytest.mark.parametrize("name,bm,req,value,index,data", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_requests_stall_and_the_twin_keeps_working(twin, h, name, bm, req, value, index, data):
    with pytest.raises(UsbError) as e:
        twin.ctrl_transfer(h, bm, req, value, index, data, 100)
    assert e.value.code == LIBUSB_ERROR_PIPE
    assert ltssm(twin, h) == P.LTSSM_DETECT


def test_bulk_out_nobody_armed_stalls_and_halts_until_cleared(twin, h):
    with pytest.raises(UsbError) as e:
        twin.bulk_write(h, P.EP_BULK_OUT, b"x" * 512)
    assert e.value.code == LIBUSB_ERROR_PIPE
    twin.ctrl_transfer(h, OUT, P.REQ_SRAM, 1, 1 << 8, b"")
    with pytest.raises(UsbError) as e:
        twin.bulk_write(h, P.EP_BULK_OUT, b"x" * 512)
    assert e.value.code == LIBUSB_ERROR_PIPE and "halted" in e.value.detail
    assert twin.ctrl_transfer(h, 0x82, 0x00, 0, P.EP_BULK_OUT, 2) == b"\x01\x00"  # GET_STATUS: halted
    twin.clear_halt(h, P.EP_BULK_OUT)
    twin.ctrl_transfer(h, OUT, P.REQ_SRAM, 1, 1 << 8, b"")
    assert twin.bulk_write(h, P.EP_BULK_OUT, b"y" * 512) == 512


def test_bulk_out_overrunning_the_armed_stream_stalls(twin, h):
    twin.ctrl_transfer(h, OUT, P.REQ_SRAM, 1, 1 << 8, b"")
    with pytest.raises(UsbError) as e:
        twin.bulk_write(h, P.EP_BULK_OUT, b"x" * 1024)
    assert e.value.code == LIBUSB_ERROR_PIPE
    assert twin.sram[:1024] == bytes(1024)  # nothing of the overrunning transfer was applied
    twin.ctrl_transfer(h, 0x00, 0x09, 1, 0, b"")  # SET_CONFIGURATION clears the halt


def test_host_side_argument_errors_are_invalid_param(twin, h):
    with pytest.raises(UsbError) as e:
        twin.ctrl_transfer(h, IN, P.REQ_XDATA_READ, 0x10000, 0, 1)
    assert e.value.code == LIBUSB_ERROR_INVALID_PARAM
    with pytest.raises(UsbError) as e:
        twin.ctrl_transfer(12345, IN, P.REQ_XDATA_READ, 0, 0, 1)
    assert e.value.code == LIBUSB_ERROR_INVALID_PARAM


@pytest.fixture(scope="module")
def fuzz_twin():
    t = Twin(TwinConfig(training_delay_s=0.0))
    yield t
    t.close()


@settings(max_examples=300, deadline=None)
@given(bm=st.sampled_from([0x40, 0xC0, 0x00, 0x80, 0x21, 0xA1, 0x02, 0x82]), req=st.integers(0, 255),
       value=st.integers(0, 0xFFFF), index=st.integers(0, 0xFFFF), n=st.integers(0, 300))
def test_no_control_transfer_crashes_the_twin(fuzz_twin, bm, req, value, index, n):
    twin = fuzz_twin
    d = twin.enumerate()
    if not d:
        twin.plug()
        d = twin.enumerate()
    h = twin.open(d[0].bus, d[0].address)
    try:
        if req == P.REQ_PCIE_POWER and bm == OUT:
            value &= 0  # keep the fuzz fast: power-on trains the link
        data = n if bm & 0x80 else bytes(n % 13)
        try:
            twin.ctrl_transfer(h, bm, req, value, index, data, 20)
        except UsbError as e:
            assert e.code in (LIBUSB_ERROR_PIPE, LIBUSB_ERROR_TIMEOUT, LIBUSB_ERROR_INVALID_PARAM)
    finally:
        twin.close_handle(h)
    assert twin.enumerate()[0].vid == 0xADD1


# ---------------------------------------------------------------------- sparse memory
def test_sparse_vram_costs_only_written_pages():
    m = SparseMemory(16 << 30)
    m.write((16 << 30) - 8, b"12345678")
    m.write(0x10000 - 2, b"abcd")  # straddles two pages
    m.write(0x500000, bytes(4096))  # zeros into a fresh page allocate nothing
    assert m.pages_used == 3
    assert m.read((16 << 30) - 8, 8) == b"12345678"
    assert m.read(0x10000 - 4, 8) == b"\x00\x00abcd\x00\x00"
    assert m.read(0x800000, 4) == bytes(4)
    with pytest.raises(IndexError):
        m.read((16 << 30) - 4, 8)


# ---------------------------------------------------------------------- the fault table
def test_once_fires_once_repeat_fires_always():
    t = FaultTable()
    once, rep = t.add(FaultSpec("timeout"), 0.0), t.add(FaultSpec("stall", repeat=True), 0.0)
    assert [t.check("timeout", 1.0, Phase.IDLE) is once for _ in range(3)] == [True, False, False]
    assert all(t.check("stall", 1.0, Phase.IDLE) is rep for _ in range(5))
    assert (once.fired, rep.fired) == (1, 5)


def test_state_like_kinds_repeat_by_default():
    assert FaultSpec("usb2").repeats and FaultSpec("slow_gpu").repeats and FaultSpec("lock_held").repeats
    assert not FaultSpec("timeout").repeats and not FaultSpec("usb2", repeat=False).repeats


def test_after_lets_the_first_opportunities_through():
    t = FaultTable()
    f = t.add(FaultSpec("timeout", after=2), 0.0)
    assert [t.check("timeout", 0.0, Phase.IDLE) is f for _ in range(4)] == [False, False, True, False]


def test_probability_is_seeded_and_reproducible():
    t = FaultTable()
    t.add(FaultSpec("short", repeat=True, probability=0.3, seed=7), 0.0)
    fired = [t.check("short", 0.0, Phase.IDLE) is not None for _ in range(200)]
    rng = random.Random(7)
    assert fired == [rng.random() < 0.3 for _ in range(200)]


def test_window_expires():
    t = FaultTable()
    t.add(FaultSpec("timeout", repeat=True, for_s=1.0), 10.0)
    assert t.check("timeout", 10.5, Phase.IDLE) is not None
    assert t.check("timeout", 11.0, Phase.IDLE) is None
    assert t.prune(11.0)[0].spec.kind == "timeout" and not t.has("timeout")


def test_phase_binds_a_fault_to_a_phase():
    t = FaultTable()
    t.add(FaultSpec("nan_output", phase="serving"), 0.0)
    assert t.check("nan_output", 0.0, Phase.LOADING) is None
    assert t.check("nan_output", 0.0, Phase.SERVING) is not None


def test_on_filters_transfers():
    t = FaultTable()
    t.add(FaultSpec("timeout", repeat=True, on="0xE4"), 0.0)
    e4, f0 = TransferSite("in", "control", 0xE4), TransferSite("in", "control", 0xF0)
    assert t.check("timeout", 0, Phase.IDLE, f0) is None
    assert t.check("timeout", 0, Phase.IDLE, e4) is not None
    t.clear()
    t.add(FaultSpec("async_error", repeat=True), 0.0)  # default: async transfers only
    assert t.check("async_error", 0, Phase.IDLE, TransferSite("out", "bulk")) is None
    assert t.check("async_error", 0, Phase.IDLE, TransferSite("out", "bulk", is_async=True)) is not None


@pytest.mark.parametrize("spec", [FaultSpec("nope"), FaultSpec("timeout", probability=1.5),
                                  FaultSpec("timeout", for_s=0), FaultSpec("timeout", phase="driving"),
                                  FaultSpec("timeout", on="bulk_sideways"), FaultSpec("gpu_hang", on="bulk"),
                                  FaultSpec("bad_tlp", status="xx"), FaultSpec("timeout", after=-1)])
def test_bad_fault_specs_are_rejected(spec):
    with pytest.raises(ValueError):
        spec.validate()


def test_phase_transition_table_is_complete_and_matches_the_rules():
    assert set(PHASE_TRANSITIONS) == {(p, e) for p in Phase for e in PhaseEvent}
    assert all(PHASE_TRANSITIONS[(p, PhaseEvent.FAULT)] is Phase.RECOVERING for p in Phase)
    assert all(PHASE_TRANSITIONS[(p, PhaseEvent.RUN_OK)] is Phase.SERVING for p in Phase)
    assert PHASE_TRANSITIONS[(Phase.RECOVERING, PhaseEvent.LOAD)] is Phase.RECOVERING
    assert PHASE_TRANSITIONS[(Phase.SERVING, PhaseEvent.LOAD)] is Phase.LOADING


def test_can_work_is_false_while_a_fault_state_stops_the_dock():
    """What ``hostwait.py`` asks the twin at each sample: a host that holds off a twin able to work is late; a hung
    GPU, a wedged bridge or a failed link waits for nothing, so a late host beside it must not excuse its misses."""
    t = Twin(TwinConfig(training_delay_s=0.0))
    t.close()  # the engines' threads stopped: the fields below are the test's alone
    assert not t.can_work()  # PCIe off until the host powers it (the ladder's pcie rung)
    t.pcie_power, t._link = True, "l0"
    assert t.can_work()
    for attr, value in (("present", False), ("wedged", True), ("pcie_power", False), ("_link", "down"),
                        ("_link", "stuck")):
        before = getattr(t, attr)
        setattr(t, attr, value)
        assert not t.can_work(), (attr, value)
        setattr(t, attr, before)
    for engine, attr, value in ((t.engine, "hung", True), (t.sdma, "hung", True), (t.sdma, "stalled", "bad packet"),
                                (t.sdma, "fence_stalled", True)):
        before = getattr(engine, attr)
        setattr(engine, attr, value)
        assert not t.can_work(), (attr, value)
        setattr(engine, attr, before)
    assert t.can_work()


def test_a_faults_injection_and_firing_are_logged_as_one_readable_line_each(twin, caplog):
    """The log once read ``fault 1 gpu_hang fired (None)`` and ``injected: FaultSpec(kind='timeout', ...)``: a
    fault is said as its kind and the parameters given, a firing names its transfer only where it has one."""
    caplog.set_level("INFO", logger="chestnut.backend.sim.twin")
    twin.inject(FaultSpec("gpu_hang"))
    twin.inject(FaultSpec("timeout", for_s=2.0, on="bulk_in", repeat=True))
    with twin.lock:
        twin.fire("gpu_hang")
        twin.fire("timeout", TransferSite("in", "bulk"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fault ")]
    assert lines == ["fault 1 injected: gpu_hang",
                     "fault 2 injected: timeout repeat=yes for_s=2 on=bulk_in",
                     "fault 1 gpu_hang fired",
                     "fault 2 timeout fired on bulk in #1"]
