"""The host side of the ASM2464 bridge: XDATA, TLPs, the SRAM engine, the PCIe link and the BARs.

:class:`Bridge` drives any transport with tinygrad 0.14 ``USB3``'s four methods (``control_read``,
``control_write``, ``bulk_read``, ``bulk_write``, same arguments and timeouts in ms): tinygrad's own
``USB3`` on a real dock, or the twin's adapter. The requests and addresses are those of tinygrad 0.14
``CustomASM24Controller`` (``runtime/support/usb.py``, ``docs/protocol.md``; constants in
:mod:`chestnut.backend.protocol`); unlike
tinygrad 0.14, the link-training wait after power-on is a bounded poll, and every failure is a typed
layer error (:mod:`chestnut.backend.errors`): whatever the transport raises is classified
(:func:`chestnut.backend.classify.classify`, USB layer by default), a bad completion is a PCIe error,
a GPU that is not a supported AMD part is a GPU error.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from chestnut.backend import protocol as P
from chestnut.backend.classify import classify
from chestnut.backend.errors import ChestnutError, GpuLayerError, PcieLayerError, UsbLayerError

T = TypeVar("T")


class Usb3Like(Protocol):
    """The transport: tinygrad 0.14 ``USB3``'s synchronous methods (timeouts in ms)."""

    def control_write(self, request: int, value: int = 0, index: int = 0, data: bytes = b"",
                      timeout: int = 1000) -> Any: ...

    def control_read(self, request: int, length: int, value: int = 0, index: int = 0,
                     timeout: int = 1000) -> Any: ...

    def bulk_write(self, payload: bytes | memoryview, timeout: int = 1000) -> Any: ...

    def bulk_read(self, length: int, timeout: int = 1000) -> Any: ...


# PCI configuration space (PCI Local Bus spec 3.0; the same offsets tinygrad 0.14 autogen/pci.py names).
PCI_VENDOR_ID, PCI_DEVICE_ID, PCI_COMMAND = 0x00, 0x02, 0x04
PCI_BASE_ADDRESS_0 = 0x10
PCI_PRIMARY_BUS = 0x18
PCI_MEMORY_BASE, PCI_MEMORY_LIMIT = 0x20, 0x22
PCI_PREF_MEMORY_BASE, PCI_PREF_MEMORY_LIMIT = 0x24, 0x26
PCI_PREF_BASE_UPPER32, PCI_PREF_LIMIT_UPPER32 = 0x28, 0x2C
PCI_COMMAND_IO, PCI_COMMAND_MEMORY, PCI_COMMAND_MASTER = 0x1, 0x2, 0x4
PCI_BAR_SPACE_IO = 0x1
PCI_BAR_MEM_TYPE_64 = 0x4
PCI_BAR_MEM_PREFETCH = 0x8
PCI_EXT_CAP_START = 0x100
PCI_EXT_CAP_ID_REBAR = 0x15
BAR_ALIGN = 2 << 20  # tinygrad 0.14 pci_setup_usb_bars rounds each BAR up to 2 MiB

CPL_STATUS_NAMES = {P.CPL_UR: "Unsupported Request", P.CPL_CA: "Completer Abort", P.CPL_CRS: "Config Retry"}
CPL_STATUS_REASONS = {P.CPL_UR: "tlp_unsupported_request", P.CPL_CA: "tlp_completer_abort",
                      P.CPL_CRS: "tlp_config_retry"}


@dataclass(frozen=True)
class TlpCompletion:
    """The 8-byte 0xF0 IN completion: dword data, completion status ``(b[4]>>5)&7``, return status ``b[7]``."""

    data: int
    cpl_status: int
    ret_status: int

    @classmethod
    def decode(cls, raw: bytes) -> TlpCompletion:
        if len(raw) != 8:
            raise UsbLayerError("short_transfer", f"TLP completion: got {len(raw)} of 8 bytes")
        return cls(struct.unpack_from("<I", raw)[0], (raw[4] >> 5) & 0x7, raw[7])


@dataclass(frozen=True)
class LinkTraining:
    """Result of :meth:`Bridge.ensure_link`: the LTSSM byte seen, whether power-on was needed, time taken."""

    ltssm: int
    powered_on: bool
    elapsed_ms: float
    polls: int


@dataclass(frozen=True)
class GpuIdentity:
    """PCI vendor/device of the GPU on bus 4 and the architecture named from the device id."""

    vendor_id: int
    device_id: int
    arch: str | None

    @property
    def is_amd(self) -> bool:
        return self.vendor_id == P.AMD_VENDOR_ID

    @property
    def supported(self) -> bool:
        return self.is_amd and self.arch in P.SUPPORTED_ARCHS

    def describe(self) -> str:
        return f"{self.vendor_id:04x}:{self.device_id:04x} arch={self.arch or 'unknown'}"


def arch_for(vendor_id: int, device_id: int) -> str | None:
    """Architecture (``"gfx1201"`` ...) for an AMD PCI device id (:data:`protocol.DEVICE_ARCHS`), else None."""
    return P.DEVICE_ARCHS.get(device_id) if vendor_id == P.AMD_VENDOR_ID else None


def ceildiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceildiv(a, b) * b


class Bridge:
    """Host-side controller of the dock's bridge over a :class:`Usb3Like` transport.

    ``ctrl_timeout_ms`` bounds every control transfer (tinygrad 0.14 ``USB3`` defaults to 1000 ms;
    openpilot's hardware daemon uses 100 ms for its LTSSM reads); ``bulk_timeout_ms`` bounds every bulk transfer.
    Counters: ``control_transfers``, ``bulk_out_transfers``, ``bulk_in_transfers``, ``bulk_out_bytes``,
    ``bulk_in_bytes`` (for the copy benchmark's wire accounting).
    """

    def __init__(self, usb: Usb3Like, *, ctrl_timeout_ms: int = P.USB_CTRL_TIMEOUT_MS,
                 bulk_timeout_ms: int = P.WAIT_TIMEOUT_MS, tlp_timeout_ms: int = P.TLP_TIMEOUT_MS,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.usb = usb
        self.ctrl_timeout_ms = ctrl_timeout_ms
        self.bulk_timeout_ms = bulk_timeout_ms
        self.tlp_timeout_ms = tlp_timeout_ms
        self._sleep = sleep
        self.bars: dict[int, tuple[int, int]] = {}
        self.control_transfers = 0
        self.bulk_out_transfers = self.bulk_in_transfers = 0
        self.bulk_out_bytes = self.bulk_in_bytes = 0
        self.control_out_bytes = self.control_in_bytes = 0

    # ------------------------------------------------------------------ transport, typed
    @staticmethod
    def _typed(fn: Callable[[], T]) -> T:
        try:
            return fn()
        except ChestnutError:
            raise
        except Exception as e:
            raise classify(e, default=UsbLayerError) from e

    def control_write(self, request: int, value: int = 0, index: int = 0, data: bytes = b"",
                      timeout_ms: int | None = None) -> None:
        """One vendor control OUT (bmRequestType 0x40). Raises a typed error (USB layer unless classified)."""
        t = self.ctrl_timeout_ms if timeout_ms is None else timeout_ms
        self.control_transfers += 1
        self.control_out_bytes += 8 + len(data)
        n = self._typed(lambda: self.usb.control_write(request, value, index, data, t))
        if isinstance(n, int) and not isinstance(n, bool) and n != len(data):
            raise UsbLayerError("short_transfer", f"control OUT 0x{request:02X}: wrote {n} of {len(data)} bytes")

    def control_read(self, request: int, length: int, value: int = 0, index: int = 0,
                     timeout_ms: int | None = None) -> bytes:
        """One vendor control IN (bmRequestType 0xC0) of exactly ``length`` bytes.

        A shorter answer raises UsbLayerError ``short_transfer``.
        """
        t = self.ctrl_timeout_ms if timeout_ms is None else timeout_ms
        self.control_transfers += 1
        raw = bytes(self._typed(lambda: self.usb.control_read(request, length, value, index, t)))
        self.control_in_bytes += 8 + len(raw)
        if len(raw) != length:
            raise UsbLayerError("short_transfer", f"control IN 0x{request:02X}: got {len(raw)} of {length} bytes")
        return raw

    def bulk_out(self, payload: bytes | memoryview, timeout_ms: int | None = None) -> None:
        """One bulk OUT on endpoint 0x02."""
        t = self.bulk_timeout_ms if timeout_ms is None else timeout_ms
        self.bulk_out_transfers += 1
        self.bulk_out_bytes += len(payload)
        n = self._typed(lambda: self.usb.bulk_write(payload, t))
        if isinstance(n, int) and not isinstance(n, bool) and n != len(payload):
            raise UsbLayerError("short_transfer", f"bulk OUT 0x02: wrote {n} of {len(payload)} bytes")

    def bulk_in(self, length: int, timeout_ms: int | None = None) -> bytes:
        """One bulk IN on endpoint 0x81 of exactly ``length`` bytes, else UsbLayerError(short_transfer)."""
        t = self.bulk_timeout_ms if timeout_ms is None else timeout_ms
        self.bulk_in_transfers += 1
        raw = bytes(self._typed(lambda: self.usb.bulk_read(length, t)))
        self.bulk_in_bytes += len(raw)
        if len(raw) != length:
            raise UsbLayerError("short_transfer", f"bulk IN 0x81: got {len(raw)} of {length} bytes")
        return raw

    def bulk_in_into(self, out: memoryview, timeout_ms: int | None = None) -> None:
        """One bulk IN on endpoint 0x81 of exactly ``len(out)`` bytes, written into ``out`` (one copy)."""
        t = self.bulk_timeout_ms if timeout_ms is None else timeout_ms
        self.bulk_in_transfers += 1
        raw = self._typed(lambda: self.usb.bulk_read(len(out), t))
        self.bulk_in_bytes += len(raw)
        if len(raw) != len(out):
            raise UsbLayerError("short_transfer", f"bulk IN 0x81: got {len(raw)} of {len(out)} bytes")
        out[:] = raw

    # ------------------------------------------------------------------ XDATA (0xE4 / 0xE5)
    def xdata_read(self, addr: int, length: int, timeout_ms: int | None = None) -> bytes:
        """Read ``length`` bytes of bridge XDATA at ``addr`` (0xE4, at most 255 bytes per request)."""
        out = bytearray()
        for off in range(0, length, P.XDATA_READ_MAX):
            n = min(P.XDATA_READ_MAX, length - off)
            out += self.control_read(P.REQ_XDATA_READ, n, value=addr + off, timeout_ms=timeout_ms)
        return bytes(out)

    def xdata_write(self, addr: int, data: bytes) -> None:
        """Write bridge XDATA one byte per 0xE5 request (wValue = address, wIndex = byte)."""
        for off, b in enumerate(data):
            self.control_write(P.REQ_XDATA_WRITE, value=addr + off, index=b)

    def xdata_u32(self, addr: int) -> int:
        """A little-endian u32 at XDATA ``addr`` (one 4-byte 0xE4)."""
        return int.from_bytes(self.xdata_read(addr, 4), "little")

    def xdata_u32s(self, addr: int, count: int) -> tuple[int, ...]:
        """``count`` consecutive little-endian u32s from XDATA ``addr`` in one read."""
        return struct.unpack(f"<{count}I", self.xdata_read(addr, 4 * count))

    # ------------------------------------------------------------------ PCIe link
    def ltssm(self, timeout_ms: int | None = None) -> int:
        """The PCIe LTSSM state byte at XDATA 0xB450 (0x78 = L0, link up)."""
        return self.xdata_read(P.XDATA_LTSSM, 1, timeout_ms)[0]

    def set_pcie_power(self, on: bool, timeout_ms: int = P.PCIE_POWER_TIMEOUT_MS) -> None:
        """0xF3 with wValue 1 (on) / 0 (off); tinygrad 0.14 allows it 10 s."""
        self.control_write(P.REQ_PCIE_POWER, value=int(on), timeout_ms=timeout_ms)

    def ensure_link(self, train_timeout_ms: int = 1000, poll_interval_ms: float = 5.0,
                    power_timeout_ms: int = P.PCIE_POWER_TIMEOUT_MS) -> LinkTraining:
        """Make the PCIe link reach L0 (LTSSM 0x78), with a bounded wait for training.

        Reads the LTSSM; if it is not 0x78, powers the link on (0xF3) and polls the LTSSM every
        ``poll_interval_ms`` until it reads 0x78 or ``train_timeout_ms`` has passed (tinygrad 0.14
        reads it only once after power-on). Raises :class:`PcieLayerError` ``ltssm_stuck`` if the
        last value was 0x4C (a known firmware failure), else ``link_down``, naming the last value and
        the time waited; USB errors on the way propagate typed.
        """
        t0 = time.monotonic()
        polls = 1
        ltssm = self.ltssm()
        if ltssm == P.LTSSM_L0:
            return LinkTraining(ltssm, False, (time.monotonic() - t0) * 1e3, polls)
        self.set_pcie_power(True, power_timeout_ms)
        deadline = time.monotonic() + train_timeout_ms / 1e3
        while True:
            ltssm = self.ltssm()
            polls += 1
            if ltssm == P.LTSSM_L0:
                return LinkTraining(ltssm, True, (time.monotonic() - t0) * 1e3, polls)
            if time.monotonic() >= deadline:
                break
            self._sleep(poll_interval_ms / 1e3)
        waited_ms = (time.monotonic() - t0) * 1e3
        reason = "ltssm_stuck" if ltssm == P.LTSSM_STUCK else "link_down"
        raise PcieLayerError(reason, f"PCIe link not up (LTSSM=0x{ltssm:02X}) {waited_ms:.0f} ms after power-on "
                                     f"({polls} reads, bound {train_timeout_ms} ms)")

    # ------------------------------------------------------------------ TLPs (0xF0)
    def _tlp_out(self, fmt_type: int, byte_en: int, address: int, value: int, mode: int = P.TLP_MODE_SINGLE) -> None:
        data = struct.pack("<III", address & 0xFFFFFFFF, address >> 32, value & 0xFFFFFFFF)
        self.control_write(P.REQ_TLP, fmt_type | (byte_en << 8), mode & 0x3, data, self.tlp_timeout_ms)

    def _tlp_in(self) -> TlpCompletion:
        return TlpCompletion.decode(self.control_read(P.REQ_TLP, 8, timeout_ms=self.tlp_timeout_ms))

    @staticmethod
    def _posted(fmt_type: int) -> bool:
        """Memory writes and messages get no completion (PCIe base spec; tinygrad's fast path)."""
        return (fmt_type & 0b11011111) == 0b01000000 or (fmt_type & 0b10111000) == 0b00110000

    def pcie_request(self, fmt_type: int, address: int, value: int | None = None, size: int = 4) -> int | None:
        """One TLP of ``size`` (1..4) bytes at ``address``; returns the value read, or None for a write.

        A bad return status is retried up to 10 times, 1 ms apart (tinygrad 0.14), then raises
        PcieLayerError ``tlp_retries_exhausted``; a completion status of Unsupported Request /
        Completer Abort / Config Retry / reserved raises the matching PcieLayerError at once.
        """
        if not 0 < size <= 4:
            raise ValueError(f"TLP size must be 1..4 bytes, got {size}")
        offset = address & 0x3
        byte_en = ((1 << size) - 1) << offset
        for attempt in range(P.TLP_RETRIES + 1):
            self._tlp_out(fmt_type, byte_en, address & ~0x3, (value << (8 * offset)) if value is not None else 0)
            if self._posted(fmt_type):
                return None
            cpl = self._tlp_in()
            if cpl.ret_status == 0:
                break
            if attempt < P.TLP_RETRIES:
                self._sleep(0.001)
        else:
            raise PcieLayerError("tlp_retries_exhausted", f"TLP error after retries: ret_status={cpl.ret_status}, "
                                                          f"fmt_type=0x{fmt_type:02x}, address={address:#x}")
        if cpl.cpl_status:
            name = CPL_STATUS_NAMES.get(cpl.cpl_status, f"Reserved (0b{cpl.cpl_status:03b})")
            raise PcieLayerError(CPL_STATUS_REASONS.get(cpl.cpl_status, "tlp_bad_completion"),
                                 f"TLP completion status: {name}: fmt_type=0x{fmt_type:02x}, address={address:#x}")
        return (cpl.data >> (8 * offset)) & ((1 << (8 * size)) - 1) if value is None else None

    def cfg_read(self, byte_addr: int, bus: int = P.GPU_BUS, dev: int = 0, fn: int = 0, size: int = 4) -> int:
        """Configuration read (type 0 on bus 0, type 1 beyond)."""
        out = self.pcie_request(self._cfg_fmt(False, bus), self._cfg_addr(byte_addr, bus, dev, fn), None, size)
        assert out is not None
        return out

    def cfg_write(self, byte_addr: int, value: int, bus: int = P.GPU_BUS, dev: int = 0, fn: int = 0,
                  size: int = 4) -> None:
        """Configuration write (non-posted: its completion is checked)."""
        self.pcie_request(self._cfg_fmt(True, bus), self._cfg_addr(byte_addr, bus, dev, fn), value, size)

    @staticmethod
    def _cfg_fmt(write: bool, bus: int) -> int:
        return (P.TLP_CFG_WRITE0 if write else P.TLP_CFG_READ0) | int(bus > 0)

    @staticmethod
    def _cfg_addr(byte_addr: int, bus: int, dev: int, fn: int) -> int:
        if byte_addr >> 12 or bus >> 8 or dev >> 5 or fn >> 3:
            raise ValueError(f"bad config address {bus}:{dev}.{fn}+{byte_addr:#x}")
        return (bus << 24) | (dev << 19) | (fn << 16) | (byte_addr & 0xFFF)

    def mem_read32(self, address: int) -> int:
        """A single 32-bit memory read TLP (64-bit address form)."""
        out = self.pcie_request(P.TLP_MEM_READ64, address, None, 4)
        assert out is not None
        return out

    def mem_write32(self, address: int, value: int) -> None:
        """A single posted 32-bit memory write TLP (no completion)."""
        self.pcie_request(P.TLP_MEM_WRITE64, address, value, 4)

    def mem_write(self, address: int, data: bytes) -> None:
        """Streaming memory write: 0xF0 mode 1 (dword count) then one bulk OUT of ``data`` (multiple of 4)."""
        if not data:
            return
        if len(data) % 4:
            raise ValueError(f"streaming memory write needs whole dwords, got {len(data)} bytes")
        self._tlp_out(P.TLP_MEM_WRITE64, 0x0F, address, len(data) // 4, P.TLP_MODE_STREAM_WRITE)
        self.bulk_out(data)

    def mem_read(self, address: int, nbytes: int) -> bytes:
        """Streaming memory read: 0xF0 mode 2 (dword count) then one bulk IN of ``nbytes`` (multiple of 4)."""
        if nbytes % 4:
            raise ValueError(f"streaming memory read needs whole dwords, got {nbytes} bytes")
        if nbytes == 0:
            return b""
        self._tlp_out(P.TLP_MEM_READ64, 0x0F, address, nbytes // 4, P.TLP_MODE_STREAM_READ)
        return self.bulk_in(nbytes)

    # ------------------------------------------------------------------ SRAM engine (0xF2)
    def sram_arm_write(self, slot: int, wire_nbytes: int) -> None:
        """Arm the SRAM engine to take the next bulk OUT of ``wire_nbytes`` (a multiple of 512) at ``slot``.

        wValue = 512-byte sectors, wIndex = slot | ceil(n / 0x4000) << 8 (16 KiB slots).
        """
        self._check_sram(slot, wire_nbytes)
        self.control_write(P.REQ_SRAM, value=wire_nbytes // P.SECTOR,
                           index=(slot & 0xFF) | (ceildiv(wire_nbytes, P.SRAM_SLOT) << 8))

    def sram_arm_read(self, slot: int, wire_nbytes: int) -> None:
        """Arm the SRAM engine to send ``wire_nbytes`` from ``slot`` on the next bulk IN (wValue | 0x8000)."""
        self._check_sram(slot, wire_nbytes)
        self.control_write(P.REQ_SRAM, value=(wire_nbytes // P.SECTOR) | P.SRAM_READ_FLAG,
                           index=(slot & 0xFF) | (ceildiv(wire_nbytes, P.SRAM_SLOT) << 8))

    @staticmethod
    def _check_sram(slot: int, wire_nbytes: int) -> None:
        if wire_nbytes <= 0 or wire_nbytes % P.SECTOR or slot * P.SRAM_SLOT + wire_nbytes > P.SRAM_SIZE:
            raise ValueError(f"bad SRAM transfer: slot {slot}, {wire_nbytes} bytes")

    # ------------------------------------------------------------------ BARs and the GPU
    def setup_bars(self, gpu_bus: int = P.GPU_BUS, mem_base: int = P.USB_MEM_BASE,
                   pref_mem_base: int = P.USB_PREF_MEM_BASE) -> dict[int, tuple[int, int]]:
        """Program the bridges on buses 0..gpu_bus-1 and size/assign the GPU's BARs.

        The same steps as tinygrad 0.14 ``System.pci_setup_usb_bars``: each type-1 bridge gets its
        bus numbers, memory windows and command bits; a Resizable BAR capability is set to its
        largest size; each memory BAR is sized (write all-ones, read back) and assigned from
        ``mem_base`` (non-prefetchable) or ``pref_mem_base`` (prefetchable), 2 MiB aligned.
        Returns BAR index -> (address, size in bytes) and keeps it in :attr:`bars`.
        """
        cmd = PCI_COMMAND_IO | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER
        for bus in range(gpu_bus):
            self.cfg_write(PCI_PRIMARY_BUS, ((bus + 1) << 8) | (gpu_bus << 16), bus=bus, size=4)
            self.cfg_write(PCI_MEMORY_BASE, (mem_base >> 16) & 0xFFFF, bus=bus, size=2)
            self.cfg_write(PCI_MEMORY_LIMIT, 0xFFFF, bus=bus, size=2)
            self.cfg_write(PCI_PREF_MEMORY_BASE, (pref_mem_base >> 16) & 0xFFFF, bus=bus, size=2)
            self.cfg_write(PCI_PREF_MEMORY_LIMIT, 0xFFFF, bus=bus, size=2)
            self.cfg_write(PCI_PREF_BASE_UPPER32, pref_mem_base >> 32, bus=bus, size=4)
            self.cfg_write(PCI_PREF_LIMIT_UPPER32, 0xFFFFFFFF, bus=bus, size=4)
            self.cfg_write(PCI_COMMAND, cmd, bus=bus, size=1)

        cap_ptr, seen = PCI_EXT_CAP_START, set()
        while cap_ptr and cap_ptr not in seen:
            seen.add(cap_ptr)
            hdr = self.cfg_read(cap_ptr, bus=gpu_bus)
            if hdr & 0xFFFF == PCI_EXT_CAP_ID_REBAR:
                cap = self.cfg_read(cap_ptr + 4, bus=gpu_bus)
                ctrl = self.cfg_read(cap_ptr + 8, bus=gpu_bus)
                self.cfg_write(cap_ptr + 8, (ctrl & ~0x1F00) | (((cap >> 4).bit_length() - 1) << 8), bus=gpu_bus)
            cap_ptr = (hdr >> 20) & 0xFFC

        next_addr = [mem_base, pref_mem_base]
        bars: dict[int, tuple[int, int]] = {}
        off = 0
        while off < 24:
            reg = PCI_BASE_ADDRESS_0 + off
            cfg = self.cfg_read(reg, bus=gpu_bus)
            is64 = bool(cfg & PCI_BAR_MEM_TYPE_64)
            if not cfg & PCI_BAR_SPACE_IO:
                pref = int(bool(cfg & PCI_BAR_MEM_PREFETCH))
                self.cfg_write(reg, 0xFFFFFFFF, bus=gpu_bus)
                lo = self.cfg_read(reg, bus=gpu_bus) & 0xFFFFFFF0
                hi = 0
                if is64:
                    self.cfg_write(reg + 4, 0xFFFFFFFF, bus=gpu_bus)
                    hi = self.cfg_read(reg + 4, bus=gpu_bus)
                mask = 0xFFFFFFFFFFFFFFFF if is64 else 0xFFFFFFFF
                size = ((~(((hi << 32) | lo) & ~0xF)) + 1) & mask
                self.cfg_write(reg, next_addr[pref] & 0xFFFFFFFF, bus=gpu_bus)
                if is64:
                    self.cfg_write(reg + 4, next_addr[pref] >> 32, bus=gpu_bus)
                bars[off // 4] = (next_addr[pref], size)
                next_addr[pref] += round_up(size, BAR_ALIGN)
            off += 8 if is64 else 4
        self.cfg_write(PCI_COMMAND, cmd, bus=gpu_bus, size=1)
        self.bars = bars
        return bars

    def bar(self, index: int) -> tuple[int, int]:
        """(address, size) of an assigned BAR; GpuLayerError(``bar_missing``) if it was not assigned."""
        if index not in self.bars:
            raise GpuLayerError("bar_missing", f"BAR{index} is not assigned (have {sorted(self.bars)})")
        return self.bars[index]

    def gpu_identity(self, gpu_bus: int = P.GPU_BUS) -> GpuIdentity:
        """Vendor and device id of the GPU (config dword 0) and the architecture they name."""
        dw0 = self.cfg_read(PCI_VENDOR_ID, bus=gpu_bus, size=4)
        vendor, device = dw0 & 0xFFFF, dw0 >> 16
        return GpuIdentity(vendor, device, arch_for(vendor, device))

    def check_gpu(self, gpu_bus: int = P.GPU_BUS) -> GpuIdentity:
        """:meth:`gpu_identity`, raising GpuLayerError ``not_amd`` or ``unsupported_arch`` unless supported."""
        ident = self.gpu_identity(gpu_bus)
        if ident.vendor_id in (0xFFFF, 0x0000):
            raise GpuLayerError("no_gpu", f"no GPU answers on bus {gpu_bus} (vendor id 0x{ident.vendor_id:04x})")
        if not ident.is_amd:
            raise GpuLayerError("not_amd", f"GPU vendor 0x{ident.vendor_id:04x} is not AMD (0x{P.AMD_VENDOR_ID:04x})")
        if not ident.supported:
            raise GpuLayerError("unsupported_arch",
                                f"GPU {ident.describe()} is not one of {', '.join(P.SUPPORTED_ARCHS)}")
        return ident
