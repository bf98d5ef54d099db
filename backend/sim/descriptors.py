"""USB descriptors of the Chestnut dock as the twin presents them (USB 3.2 spec chapter 9 layouts).

IDs, configuration, interface and endpoints from tinygrad 0.14 (``runtime/support/usb.py`` ``USB3.__init__``,
``runtime/ops_amd.py`` ``USBIface.__init__``; ``docs/protocol.md``): VID:PID
``0xADD1:0x0001``, configuration 1, interface 0 (vendor class), bulk OUT ``0x02``, bulk IN ``0x81``.
SuperSpeed: bcdUSB 3.20, EP0 512 bytes (bMaxPacketSize0 = 9), bulk 1024 bytes with companion
descriptors; after a USB 2 fallback: bcdUSB 2.10, EP0 64 bytes, bulk 512 bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from chestnut.backend import protocol as P

DT_DEVICE, DT_CONFIG, DT_STRING, DT_INTERFACE, DT_ENDPOINT, DT_BOS = 1, 2, 3, 4, 5, 0x0F
DT_DEVICE_CAPABILITY, DT_SS_ENDPOINT_COMPANION = 0x10, 0x30
LANGID_EN_US = 0x0409
I_MANUFACTURER, I_PRODUCT, I_SERIAL = 1, 2, 3
BCD_DEVICE = 0x0100
# libusb_speed values pyusb reports as Device.speed
LIBUSB_SPEED_HIGH, LIBUSB_SPEED_SUPER = 3, 4


@dataclass(frozen=True)
class Identity:
    """What the dock says about itself: IDs and strings. The product must start with "custom" (tinygrad asserts it)."""

    vid: int = P.USB_IDS[0][0]
    pid: int = P.USB_IDS[0][1]
    manufacturer: str = "ASMedia"
    product: str = "custom ASM2464PD Chestnut"
    serial: str = "CHESTNUT0001"


def superspeed(speed_mbps: int) -> bool:
    return speed_mbps >= P.SUPERSPEED_MBPS


def device_descriptor(ident: Identity, speed_mbps: int) -> bytes:
    ss = superspeed(speed_mbps)
    return struct.pack("<BBHBBBBHHHBBBB", 18, DT_DEVICE, 0x0320 if ss else 0x0210, 0, 0, 0, 9 if ss else 64,
                       ident.vid, ident.pid, BCD_DEVICE, I_MANUFACTURER, I_PRODUCT, I_SERIAL, 1)


def config_descriptor(speed_mbps: int) -> bytes:
    ss = superspeed(speed_mbps)
    mps = 1024 if ss else 512
    body = struct.pack("<BBBBBBBBB", 9, DT_INTERFACE, P.USB_INTERFACE, 0, 2, 0xFF, 0x00, 0x00, 0)
    for ep in (P.EP_BULK_IN, P.EP_BULK_OUT):
        body += struct.pack("<BBBBHB", 7, DT_ENDPOINT, ep, 0x02, mps, 0)
        if ss:
            body += struct.pack("<BBBBH", 6, DT_SS_ENDPOINT_COMPANION, 15, 0, 0)  # bMaxBurst 16 packets
    total = 9 + len(body)
    # bmAttributes 0xC0: self-powered (the dock has its own supply); bMaxPower in 8 mA (SS) / 2 mA units
    return struct.pack("<BBHBBBBB", 9, DT_CONFIG, total, 1, P.USB_CONFIGURATION, 0, 0xC0, 0) + body


def bos_descriptor() -> bytes:
    ss_cap = struct.pack("<BBBBHBBH", 10, DT_DEVICE_CAPABILITY, 0x03, 0x00, 0x000E, 0x01, 0x0A, 0x07FF)
    return struct.pack("<BBHB", 5, DT_BOS, 5 + len(ss_cap), 1) + ss_cap


def string_descriptor(ident: Identity, index: int) -> bytes | None:
    """String descriptor ``index`` (0 = the LANGID list); None if the dock has no such string."""
    if index == 0:
        return struct.pack("<BBH", 4, DT_STRING, LANGID_EN_US)
    text = {I_MANUFACTURER: ident.manufacturer, I_PRODUCT: ident.product, I_SERIAL: ident.serial}.get(index)
    if text is None:
        return None
    raw = text.encode("utf-16-le")
    return struct.pack("<BB", 2 + len(raw), DT_STRING) + raw
