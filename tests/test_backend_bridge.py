"""The host-side bridge controller against the twin daemon: XDATA, TLPs, SRAM, link training, BARs, GPU id.

The BAR set-up is checked against tinygrad 0.14's own ``System.pci_setup_usb_bars`` run over its own
``CustomASM24Controller`` on the same twin: both must assign the same BARs.
"""

from __future__ import annotations

import os
import time

import pytest

from chestnut.backend import protocol as P
from chestnut.backend.bridge import Bridge, TlpCompletion, arch_for
from chestnut.backend.errors import GpuLayerError, PcieLayerError, UsbLayerError
from chestnut.backend.model import ensure_cpu_device
from chestnut.backend.sim.client import running_twin
from chestnut.backend.sim.usb3 import TwinUSB3, forget_device_lists

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def twin():
    with running_twin() as client:
        yield client
    forget_device_lists()


def open_bridge(**kw) -> Bridge:
    (dev, _), = TwinUSB3.list_devices(*P.USB_IDS[0])
    return Bridge(TwinUSB3(dev), **kw)


def test_ltssm_power_on_and_bounded_training_wait(twin):
    b = open_bridge()
    assert b.ltssm() == P.LTSSM_DETECT  # the custom firmware boots with PCIe off
    t = b.ensure_link(train_timeout_ms=1000)
    assert (t.ltssm, t.powered_on) == (P.LTSSM_L0, True)
    again = b.ensure_link()
    assert (again.ltssm, again.powered_on, again.polls) == (P.LTSSM_L0, False, 1)


@pytest.mark.parametrize(("kind", "reason", "value"), [("ltssm_down", "link_down", "0x00"),
                                                        ("ltssm_stuck", "ltssm_stuck", "0x4C")])
def test_link_that_never_trains_fails_at_the_pcie_layer_within_the_bound(twin, kind, reason, value):
    twin.fault(kind, repeat=True)
    b = open_bridge()
    t0 = time.monotonic()
    with pytest.raises(PcieLayerError) as info:
        b.ensure_link(train_timeout_ms=200, poll_interval_ms=5)
    elapsed = time.monotonic() - t0
    assert info.value.reason == reason
    assert f"LTSSM={value}" in info.value.detail
    assert 0.2 <= elapsed < 0.2 + 0.5  # the bounded wait, plus the 0xF3 request and one read


def test_bars_match_tinygrads_own_setup(twin):
    ensure_cpu_device()
    from tinygrad.runtime.support.system import System
    from tinygrad.runtime.support.usb import CustomASM24Controller

    (dev, _), = TwinUSB3.list_devices(*P.USB_IDS[0])
    usb = TwinUSB3(dev)
    tinygrad_bars = System.pci_setup_usb_bars(CustomASM24Controller(usb), gpu_bus=P.GPU_BUS,
                                              mem_base=P.USB_MEM_BASE, pref_mem_base=P.USB_PREF_MEM_BASE)
    usb.close()
    twin.power_cycle()  # a fresh GPU (config space reset), at a new address
    forget_device_lists()
    b = open_bridge()
    b.ensure_link()
    ours = b.setup_bars()
    assert ours == tinygrad_bars
    assert ours[0] == (P.USB_PREF_MEM_BASE, P.BAR0_VRAM_BYTES)  # BAR0 resized to its largest size
    assert b.bar(2)[1] == P.BAR2_DOORBELL_BYTES
    ident = b.check_gpu()
    assert (ident.vendor_id, ident.device_id, ident.arch) == (P.AMD_VENDOR_ID, P.GPU_DEVICE_ID, P.GPU_ARCH)
    with pytest.raises(GpuLayerError) as info:
        b.bar(3)
    assert info.value.reason == "bar_missing"


def test_config_read_of_bus_4_before_the_bridges_are_set_up_is_unsupported_request(twin):
    b = open_bridge()
    b.ensure_link()
    with pytest.raises(PcieLayerError) as info:
        b.cfg_read(0, bus=P.GPU_BUS)
    assert info.value.reason == "tlp_unsupported_request"


@pytest.mark.parametrize(("status", "reason"), [("ur", "tlp_unsupported_request"), ("ca", "tlp_completer_abort")])
def test_bad_tlp_completion_status_is_a_pcie_error(twin, status, reason):
    b = open_bridge()
    b.ensure_link()
    b.setup_bars()
    twin.fault("bad_tlp", status=status)
    with pytest.raises(PcieLayerError) as info:
        b.gpu_identity()
    assert info.value.reason == reason
    assert b.gpu_identity().vendor_id == P.AMD_VENDOR_ID  # one-shot: the next TLP completes


def test_tlp_without_completion_is_retried_ten_times_then_fails(twin):
    sleeps = []
    b = open_bridge(sleep=sleeps.append)
    b.ensure_link()
    b.setup_bars()
    twin.fault("ltssm_down")  # the link drops at the next link opportunity: no completions come back
    with pytest.raises(PcieLayerError) as info:
        b.cfg_read(0)
    assert info.value.reason == "tlp_retries_exhausted"
    assert sleeps == [0.001] * P.TLP_RETRIES


def test_xdata_sram_and_streaming_memory_round_trips(twin):
    b = open_bridge()
    b.ensure_link()
    b.setup_bars()
    blob = bytes(range(256)) * 2 + b"\x5a" * 88  # 600 bytes: three 0xE4 reads (255 + 255 + 90)
    b.xdata_write(P.XDATA_SYS_PAGE + 0x100, blob[:40])
    before = b.control_transfers
    assert b.xdata_read(P.XDATA_SYS_PAGE + 0x100, 40) == blob[:40]
    assert b.control_transfers - before == 1
    before = b.control_transfers
    b.xdata_read(P.XDATA_SYS_PAGE, 600)
    assert b.control_transfers - before == 3

    data = os.urandom(3 * P.SRAM_SLOT)
    b.sram_arm_write(P.SLOTS_PER_HALF, len(data))
    b.bulk_out(data)
    b.sram_arm_read(P.SLOTS_PER_HALF, len(data))
    assert b.bulk_in(len(data)) == data

    vram = b.bar(0)[0] + P.VRAM_HEAP_OFFSET
    payload = os.urandom(4096)
    b.mem_write(vram, payload)
    assert b.mem_read(vram, len(payload)) == payload
    b.mem_write32(vram + 8, 0xDEADBEEF)
    assert b.mem_read32(vram + 8) == 0xDEADBEEF


def test_transport_failures_are_typed_usb_errors(twin):
    b = open_bridge(ctrl_timeout_ms=50)
    b.ensure_link()
    twin.fault("timeout", on="0xE4")
    t0 = time.monotonic()
    with pytest.raises(UsbLayerError) as info:
        b.ltssm()
    assert info.value.reason == "transfer_timeout"
    assert time.monotonic() - t0 < 0.05 + 0.1
    twin.fault("stall", on="bulk_out")
    b.sram_arm_write(0, P.SECTOR)
    with pytest.raises(UsbLayerError) as info:
        b.bulk_out(bytes(P.SECTOR))
    assert info.value.reason == "stall"
    twin.fault("short", on="control_in", nbytes=2)
    with pytest.raises(UsbLayerError) as info:
        b.xdata_read(P.XDATA_SYS_PAGE, 8)
    assert info.value.reason == "short_transfer"
    twin.fault("disconnect")
    with pytest.raises(UsbLayerError) as info:
        b.ltssm()
    assert info.value.reason == "disconnect"


def test_completion_decoding_and_arch_table():
    raw = (0x12345678).to_bytes(4, "little") + bytes([0b100 << 5, 0, 0, 3])
    assert TlpCompletion.decode(raw) == TlpCompletion(0x12345678, P.CPL_CA, 3)
    with pytest.raises(UsbLayerError):
        TlpCompletion.decode(raw[:7])
    assert arch_for(P.AMD_VENDOR_ID, 0x7550) == "gfx1201"
    assert arch_for(P.AMD_VENDOR_ID, 0x73BF) == "gfx1030"
    assert arch_for(0x10DE, 0x2684) is None
