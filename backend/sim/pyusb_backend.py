"""A pyusb backend that makes ``usb.core.find()`` see the twin.

    import usb.core
    from chestnut.backend.sim.pyusb_backend import twin_backend
    dev = usb.core.find(idVendor=0xADD1, idProduct=0x0001, backend=twin_backend())
    dev.product                     # "custom ASM2464PD Chestnut" (GET_DESCRIPTOR string)
    dev.ctrl_transfer(0xC0, 0xE4, 0xB450, 0, 1, timeout=100)   # the LTSSM byte

Errors are the ones pyusb's libusb1 backend raises for the same libusb codes (strings and errno from
``usb.backend.libusb1``): ``USBError`` errno 19 (ENODEV) when the dock is gone or re-enumerated, errno
32 (EPIPE) on a stall, ``USBTimeoutError`` (errno 110) on a timeout, errno 16 (EBUSY) when another
process claimed the interface.

The device list: ``twin_backend()`` is one backend per process and prefix, and with ``cached=True``
(the default) it enumerates once and returns that list forever -- the same per-process caching as
tinygrad 0.14's ``USB3.list_devices`` (``functools.cache``), so a process keeps seeing the address it
first saw. ``cached=False`` enumerates afresh on each ``find()``, as pyusb with libusb does (what a
health monitor wants).
"""

from __future__ import annotations

import array
import functools
import struct
from types import SimpleNamespace
from typing import Any

import usb.backend
import usb.backend.libusb1 as _l1
from usb.core import USBError, USBTimeoutError

from chestnut.backend.sim import descriptors as D
from chestnut.backend.sim.client import TwinClient, TwinNotRunning
from chestnut.backend.sim.libusb_codes import (
    LIBUSB_ERROR_NO_DEVICE,
    LIBUSB_ERROR_NOT_FOUND,
    LIBUSB_ERROR_NOT_SUPPORTED,
    LIBUSB_ERROR_TIMEOUT,
    UsbError,
)
from chestnut.backend.sim.twin import DeviceInfo, Twin
from chestnut.msgs.paths import current_prefix


def to_pyusb_error(e: UsbError) -> Exception:
    """The exception pyusb's libusb1 backend raises for this libusb code (``_check``)."""
    text = _l1._str_error_map.get(e.code, _l1._str_error_map[_l1.LIBUSB_ERROR_OTHER])
    if e.code == LIBUSB_ERROR_NOT_SUPPORTED:
        return NotImplementedError(text)
    cls = USBTimeoutError if e.code == LIBUSB_ERROR_TIMEOUT else USBError
    return cls(text, e.code, _l1._libusb_errno.get(e.code))


class _Device:
    """pyusb's device identification object: one enumeration entry."""

    def __init__(self, info: DeviceInfo) -> None:
        self.info = info
        self.bus, self.address = info.bus, info.address


class _Handle:
    def __init__(self, dev: _Device, handle: int) -> None:
        self.dev = dev
        self.handle = handle


def _fields(names: tuple[str, ...], fmt: str, raw: bytes, **extra: Any) -> SimpleNamespace:
    ns = SimpleNamespace(**dict(zip(names, struct.unpack_from(fmt, raw), strict=True)), **extra)
    ns.extra_descriptors = []
    return ns


def _parse_config(raw: bytes) -> SimpleNamespace:
    """A configuration descriptor's bytes -> namespaces (config -> interfaces[n][alt] -> endpoints)."""
    cfg = _fields(("bLength", "bDescriptorType", "wTotalLength", "bNumInterfaces", "bConfigurationValue",
                   "iConfiguration", "bmAttributes", "bMaxPower"), "<BBHBBBBB", raw)
    cfg.interfaces = {}
    pos, intf = raw[0], None
    while pos + 2 <= len(raw):
        length, dtype = raw[pos], raw[pos + 1]
        if length < 2:
            break
        if dtype == D.DT_INTERFACE:
            intf = _fields(("bLength", "bDescriptorType", "bInterfaceNumber", "bAlternateSetting", "bNumEndpoints",
                            "bInterfaceClass", "bInterfaceSubClass", "bInterfaceProtocol", "iInterface"),
                           "<BBBBBBBBB", raw[pos:pos + 9], endpoints=[])
            cfg.interfaces.setdefault(intf.bInterfaceNumber, []).append(intf)
        elif dtype == D.DT_ENDPOINT and intf is not None:
            intf.endpoints.append(_fields(("bLength", "bDescriptorType", "bEndpointAddress", "bmAttributes",
                                           "wMaxPacketSize", "bInterval"), "<BBBBHB", raw[pos:pos + 7],
                                          bRefresh=0, bSynchAddress=0))
        pos += length
    return cfg


class TwinBackend(usb.backend.IBackend):
    """pyusb backend over one twin connection (the daemon of ``prefix``, or an in-process ``twin``)."""

    def __init__(self, prefix: str | None = None, *, twin: Twin | None = None, cached: bool = True) -> None:
        super().__init__()
        self.prefix = current_prefix() if prefix is None else prefix
        self.twin = twin
        self.cached = cached
        self._client: TwinClient | None = None
        self._list: list[_Device] | None = None

    def _connect(self) -> TwinClient:
        if self._client is None:
            try:
                self._client = TwinClient(twin=self.twin) if self.twin is not None else TwinClient(self.prefix)
            except TwinNotRunning:
                raise to_pyusb_error(UsbError(LIBUSB_ERROR_NO_DEVICE, "no twin daemon")) from None
        return self._client

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except UsbError as e:
            raise to_pyusb_error(e) from None

    # ------------------------------------------------------------------ enumeration and descriptors
    def enumerate_devices(self) -> list[_Device]:
        if self.cached and self._list is not None:
            return self._list
        try:
            infos = self._connect().enumerate()
        except (USBError, TwinNotRunning):
            # no daemon, or it went away: no dock; connect again next time. A daemon that was only late keeps
            # the connection (its open handles with it): TwinClient drops the late reply itself.
            if self._client is not None and not self._client.connected:
                self._client = None
            infos = []
        self._list = [_Device(i) for i in infos]
        return self._list

    def get_device_descriptor(self, dev: _Device) -> SimpleNamespace:
        speed = D.LIBUSB_SPEED_SUPER if D.superspeed(dev.info.speed_mbps) else D.LIBUSB_SPEED_HIGH
        return _fields(("bLength", "bDescriptorType", "bcdUSB", "bDeviceClass", "bDeviceSubClass", "bDeviceProtocol",
                        "bMaxPacketSize0", "idVendor", "idProduct", "bcdDevice", "iManufacturer", "iProduct",
                        "iSerialNumber", "bNumConfigurations"), "<BBHBBBBHHHBBBB", dev.info.device_descriptor,
                       bus=dev.bus, address=dev.address, speed=speed, port_number=1, port_numbers=(1,))

    def get_configuration_descriptor(self, dev: _Device, config: int) -> SimpleNamespace:
        if config != 0:
            raise to_pyusb_error(UsbError(LIBUSB_ERROR_NOT_FOUND, f"no configuration index {config}"))
        return _parse_config(dev.info.config_descriptor)

    def get_interface_descriptor(self, dev: _Device, intf: int, alt: int, config: int) -> SimpleNamespace:
        cfg = self.get_configuration_descriptor(dev, config)
        if intf >= cfg.bNumInterfaces:
            raise IndexError(f"Invalid interface index {intf}")
        alts = cfg.interfaces.get(intf, [])
        if alt >= len(alts):
            raise IndexError(f"Invalid alternate setting index {alt}")
        return alts[alt]

    def get_endpoint_descriptor(self, dev: _Device, ep: int, intf: int, alt: int, config: int) -> SimpleNamespace:
        i = self.get_interface_descriptor(dev, intf, alt, config)
        if ep >= len(i.endpoints):
            raise IndexError(f"Invalid endpoint index {ep}")
        return i.endpoints[ep]

    # ------------------------------------------------------------------ handles
    def open_device(self, dev: _Device) -> _Handle:
        client = self._connect()
        return _Handle(dev, self._call(client.open, dev.bus, dev.address))

    def close_device(self, dev_handle: _Handle) -> None:
        if self._client is not None:
            self._client.close(dev_handle.handle)

    def set_configuration(self, dev_handle: _Handle, config_value: int) -> None:
        self._call(self._connect().set_configuration, dev_handle.handle, config_value)

    def get_configuration(self, dev_handle: _Handle) -> int:
        data = self._call(self._connect().ctrl_transfer, dev_handle.handle, 0x80, 0x08, 0, 0, 1, 1000)
        return int(data[0])

    def set_interface_altsetting(self, dev_handle: _Handle, intf: int, altsetting: int) -> None:
        self._call(self._connect().ctrl_transfer, dev_handle.handle, 0x01, 0x0B, altsetting, intf, b"", 1000)

    def claim_interface(self, dev_handle: _Handle, intf: int) -> None:
        self._call(self._connect().claim_interface, dev_handle.handle, intf)

    def release_interface(self, dev_handle: _Handle, intf: int) -> None:
        self._call(self._connect().release_interface, dev_handle.handle, intf)

    def clear_halt(self, dev_handle: _Handle, ep: int) -> None:
        self._call(self._connect().clear_halt, dev_handle.handle, ep)

    def reset_device(self, dev_handle: _Handle) -> None:
        """A port reset: the device comes back configured (halts cleared), at the same address."""
        self._call(self._connect().set_configuration, dev_handle.handle, 1)

    def is_kernel_driver_active(self, dev_handle: _Handle, intf: int) -> bool:
        return False

    def detach_kernel_driver(self, dev_handle: _Handle, intf: int) -> None:
        raise to_pyusb_error(UsbError(LIBUSB_ERROR_NOT_FOUND, "no kernel driver is bound"))

    def attach_kernel_driver(self, dev_handle: _Handle, intf: int) -> None:
        raise to_pyusb_error(UsbError(LIBUSB_ERROR_NOT_FOUND, "the dock has no kernel driver"))

    # ------------------------------------------------------------------ transfers
    def bulk_write(self, dev_handle: _Handle, ep: int, intf: int, data: array.array, timeout: int) -> int:
        return int(self._call(self._connect().bulk_write, dev_handle.handle, ep, memoryview(data).cast("B"), timeout))

    def bulk_read(self, dev_handle: _Handle, ep: int, intf: int, buff: array.array, timeout: int) -> int:
        return int(self._call(self._connect().bulk_read_into, dev_handle.handle, ep, memoryview(buff).cast("B"),
                              timeout))

    def ctrl_transfer(self, dev_handle: _Handle, bmRequestType: int, bRequest: int, wValue: int, wIndex: int,  # noqa: N803
                      data: array.array, timeout: int) -> int:
        mv = memoryview(data).cast("B")
        client = self._connect()
        if bmRequestType & 0x80:
            got = self._call(client.ctrl_transfer, dev_handle.handle, bmRequestType, bRequest, wValue, wIndex, len(mv),
                             timeout)
            mv[:len(got)] = got
            return len(got)
        return int(self._call(client.ctrl_transfer, dev_handle.handle, bmRequestType, bRequest, wValue, wIndex,
                              bytes(mv), timeout))


def twin_backend(prefix: str | None = None, cached: bool = True) -> TwinBackend:
    """This process's backend for the twin of ``prefix`` (default ``$CHESTNUT_PREFIX``); see the module doc."""
    return _backend(current_prefix() if prefix is None else prefix, cached)


@functools.cache
def _backend(prefix: str, cached: bool) -> TwinBackend:
    return TwinBackend(prefix, cached=cached)
