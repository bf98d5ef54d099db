"""pyusb finds the twin and sees it fail the way a real device fails (errno 19, 32, 16, timeouts)."""

from __future__ import annotations

import errno

import pytest
import usb.core
import usb.util

from chestnut.backend import protocol as P
from chestnut.backend.sim.client import running_twin
from chestnut.backend.sim.pyusb_backend import TwinBackend, twin_backend

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def twin():
    with running_twin(args=["--training-delay-ms", "2"]) as client:
        yield client


def find(backend=None):
    return usb.core.find(idVendor=0xADD1, idProduct=0x0001, backend=backend or TwinBackend())


def test_find_reads_descriptors_and_strings(twin):
    d = twin.enumerate()[0]
    dev = find()
    assert (dev.bus, dev.address, dev.speed) == (d.bus, d.address, usb.util.SPEED_SUPER)
    assert (dev.bcdUSB, dev.bDeviceClass, dev.bNumConfigurations) == (0x0320, 0, 1)
    assert dev.product == "custom ASM2464PD Chestnut" and dev.manufacturer == "ASMedia"
    cfg = dev.get_active_configuration()
    intf = cfg[(0, 0)]
    assert (cfg.bConfigurationValue, intf.bInterfaceClass) == (1, 0xFF)
    assert [e.bEndpointAddress for e in intf] == [P.EP_BULK_IN, P.EP_BULK_OUT]
    assert [e.wMaxPacketSize for e in intf] == [1024, 1024]
    assert usb.core.find(idVendor=0x1234, backend=TwinBackend()) is None


def test_vendor_requests_and_bulk_endpoints_work(twin):
    dev = find()
    dev.set_configuration()
    assert list(dev.ctrl_transfer(0xC0, P.REQ_XDATA_READ, P.XDATA_LTSSM, 0, 1, timeout=100)) == [P.LTSSM_DETECT]
    dev.ctrl_transfer(0x40, P.REQ_SRAM, 8, 1 << 8, None)
    assert dev.write(P.EP_BULK_OUT, bytes(range(256)) * 16) == 4096
    dev.ctrl_transfer(0x40, P.REQ_SRAM, 8 | 0x8000, 1 << 8, None)
    assert bytes(dev.read(P.EP_BULK_IN, 4096, timeout=100)) == bytes(range(256)) * 16


def test_disconnect_is_errno_19(twin):
    dev = find()
    dev.set_configuration()
    twin.unplug()
    with pytest.raises(usb.core.USBError) as e:
        dev.ctrl_transfer(0xC0, P.REQ_XDATA_READ, P.XDATA_LTSSM, 0, 1, timeout=100)
    assert e.value.errno == errno.ENODEV == 19
    assert str(e.value) == "[Errno 19] No such device (it may have been disconnected)"
    assert find() is None


def test_timeout_is_usb_timeout_error(twin):
    dev = find()
    with pytest.raises(usb.core.USBTimeoutError) as e:
        dev.read(P.EP_BULK_IN, 512, timeout=50)  # nothing armed: the device NAKs
    assert e.value.errno == errno.ETIMEDOUT
    twin.fault("timeout", on="0xE4")
    with pytest.raises(usb.core.USBTimeoutError):
        dev.ctrl_transfer(0xC0, P.REQ_XDATA_READ, P.XDATA_LTSSM, 0, 1, timeout=50)


def test_stall_is_errno_32_and_lasts_until_clear_halt(twin):
    dev = find()
    twin.fault("stall", on="bulk_out")
    dev.ctrl_transfer(0x40, P.REQ_SRAM, 1, 1 << 8, None)
    for _ in range(2):
        with pytest.raises(usb.core.USBError) as e:
            dev.write(P.EP_BULK_OUT, bytes(512))
        assert e.value.errno == errno.EPIPE == 32
    dev.clear_halt(P.EP_BULK_OUT)
    assert dev.write(P.EP_BULK_OUT, bytes(512)) == 512
    with pytest.raises(usb.core.USBError) as e:
        dev.ctrl_transfer(0xC0, 0x77, 0, 0, 4)  # an unknown vendor request: protocol stall
    assert e.value.errno == errno.EPIPE


def test_a_claimed_interface_is_busy_for_another_process(twin):
    mine, theirs = find(), find()  # two backends = two connections = two host processes
    mine.set_configuration()
    usb.util.claim_interface(mine, 0)
    with pytest.raises(usb.core.USBError) as e:
        theirs.read(P.EP_BULK_IN, 512, timeout=50)
    assert e.value.errno == errno.EBUSY
    usb.util.dispose_resources(mine)
    with pytest.raises(usb.core.USBTimeoutError):
        theirs.read(P.EP_BULK_IN, 512, timeout=50)


def test_the_process_device_list_is_cached_like_tinygrads(twin):
    first = twin.enumerate()[0]
    cached = twin_backend()
    assert find(cached).address == first.address
    twin.fault("reenumerate")
    with pytest.raises(usb.core.USBError):
        find(cached).ctrl_transfer(0xC0, P.REQ_XDATA_READ, P.XDATA_LTSSM, 0, 1)  # fires the re-enumeration
    stale = find(cached)
    assert stale.address == first.address  # this process still sees the old address
    with pytest.raises(usb.core.USBError) as e:
        stale.ctrl_transfer(0xC0, P.REQ_XDATA_READ, P.XDATA_LTSSM, 0, 1)
    assert e.value.errno == errno.ENODEV
    fresh = find(twin_backend(cached=False))
    assert fresh.address == first.address + 1
    assert list(fresh.ctrl_transfer(0xC0, P.REQ_XDATA_READ, P.XDATA_LTSSM, 0, 1)) == [P.LTSSM_DETECT]


def test_usb2_fallback_shows_in_the_descriptors(twin):
    twin.fault("usb2")
    dev = find()
    assert (dev.speed, dev.bcdUSB, dev.bMaxPacketSize0) == (usb.util.SPEED_HIGH, 0x0210, 64)
    assert [e.wMaxPacketSize for e in dev.get_active_configuration()[(0, 0)]] == [512, 512]
