"""The PCIe side of the twin: four type-1 bridges in a chain and the AMD GPU on bus 4.

Pure state, no I/O, not thread-safe (the Twin guards it). Models what tinygrad 0.14's
``System.pci_setup_usb_bars`` touches (PCI Local Bus / PCIe base spec layouts):

- Config space, 4 KiB per function, with per-byte write masks. Bridges (bus 0..3, dev 0 fn 0):
  header type 1, class 0x060400; primary/secondary/subordinate bus numbers, memory and prefetchable
  windows, command register. The GPU (behind the last bridge): vendor ``AMD_VENDOR_ID``, device
  ``GPU_DEVICE_ID`` (``protocol.py``), class 0x030000, BAR0 VRAM (64-bit prefetchable, resizable),
  BAR2 doorbells (64-bit prefetchable), BAR4 I/O (256 B), BAR5 MMIO (32-bit), and a Resizable BAR
  extended capability (ID 0x15) at 0x100 whose control register sets BAR0's size.
- Routing as PCIe does it: a type-1 configuration request to bus N walks the chain; each bridge
  forwards it only when ``secondary < N <= subordinate`` and turns it into type 0 when
  ``N == secondary``. Until software programs the bus numbers only bus 0 answers.
- Memory decode: a memory TLP reaches the GPU only if every bridge has memory space enabled and
  the address lies in one of its windows, the GPU has memory space enabled, and the whole access
  lies inside one BAR. Anything else completes with Unsupported Request.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from chestnut.backend import protocol as P

CONFIG_BYTES = 0x1000
ASMEDIA_VENDOR_ID = 0x1B21   # the bridge chip's vendor (ASMedia); the bridges' device id is the part number
BRIDGE_DEVICE_ID = 0x2464
GPU_CLASS = 0x030000          # display controller, VGA compatible
GPU_REVISION = 0xC0

PCI_COMMAND = 0x04
PCI_COMMAND_MEMORY = 0x2
PCI_BASE_ADDRESS_0 = 0x10
PCI_PRIMARY_BUS = 0x18
PCI_MEMORY_BASE, PCI_MEMORY_LIMIT = 0x20, 0x22
PCI_PREF_MEMORY_BASE, PCI_PREF_MEMORY_LIMIT = 0x24, 0x26
PCI_PREF_BASE_UPPER32, PCI_PREF_LIMIT_UPPER32 = 0x28, 0x2C
REBAR_CAP_OFFSET = 0x100
PCI_EXT_CAP_ID_REBAR = 0x15
REBAR_SIZES_MIB_LOG2 = range(8, 15)   # 256 MiB .. 16 GiB, 2^n MiB
REBAR_DEFAULT_LOG2 = 8                # 256 MiB at reset (BAR0_VRAM_BYTES_DEFAULT)

BAR_MEM_64 = 0x4
BAR_MEM_PREFETCH = 0x8
BAR_IO = 0x1


def _pack_u32(buf: bytearray, off: int, value: int) -> None:
    struct.pack_into("<I", buf, off, value & 0xFFFFFFFF)


def _apply(old: int, value: int, byte_en: int, wmask: int) -> int:
    """Merge a config write: bytes enabled in ``byte_en`` and writable in ``wmask`` take ``value``."""
    out = old
    for i in range(4):
        if byte_en & (1 << i):
            m = (wmask >> (8 * i)) & 0xFF
            out = (out & ~(m << (8 * i))) | (value & (m << (8 * i)))
    return out & 0xFFFFFFFF


class Function:
    """One PCIe function's configuration space with per-byte write masks."""

    def __init__(self, vendor: int, device: int, class_code: int, revision: int, header_type: int) -> None:
        self.cfg = bytearray(CONFIG_BYTES)
        self.wmask = bytearray(CONFIG_BYTES)
        struct.pack_into("<HH", self.cfg, 0, vendor, device)
        _pack_u32(self.cfg, 0x08, (class_code << 8) | revision)
        self.cfg[0x0E] = header_type
        self.wmask[PCI_COMMAND:PCI_COMMAND + 2] = b"\x07\x05"  # IO, memory, bus master, SERR, INTx disable
        self.wmask[0x0C:0x0E] = b"\xff\xff"                     # cache line size, latency timer
        self.wmask[0x3C] = 0xFF                                 # interrupt line

    def read32(self, off: int) -> int:
        return int(struct.unpack_from("<I", self.cfg, off)[0])

    def write32(self, off: int, value: int, byte_en: int) -> None:
        wmask = int(struct.unpack_from("<I", self.wmask, off)[0])
        _pack_u32(self.cfg, off, _apply(self.read32(off), value, byte_en, wmask))

    @property
    def memory_enabled(self) -> bool:
        return bool(self.cfg[PCI_COMMAND] & PCI_COMMAND_MEMORY)


class Bridge(Function):
    """A type-1 (PCI-to-PCI) bridge header."""

    def __init__(self) -> None:
        super().__init__(ASMEDIA_VENDOR_ID, BRIDGE_DEVICE_ID, 0x060400, 0x01, 0x01)
        self.wmask[0x18:0x1C] = b"\xff\xff\xff\xff"              # primary, secondary, subordinate, sec latency
        self.wmask[0x1C:0x1E] = b"\xf0\xf0"                      # I/O base / limit
        self.wmask[0x20:0x28] = b"\xf0\xff\xf0\xff\xf0\xff\xf0\xff"  # memory + prefetchable base / limit
        self.wmask[0x28:0x30] = b"\xff" * 8                      # prefetchable upper 32 bits
        self.wmask[0x3E:0x40] = b"\xff\x0f"                      # bridge control
        # windows disabled at reset (base > limit); prefetchable window is 64-bit capable (low nibble 1)
        struct.pack_into("<HHHH", self.cfg, PCI_MEMORY_BASE, 0xFFF0, 0x0000, 0xFFF1, 0x0001)

    @property
    def secondary(self) -> int:
        return self.cfg[0x19]

    @property
    def subordinate(self) -> int:
        return self.cfg[0x1A]

    def forwards(self, address: int, nbytes: int) -> bool:
        """Whether a memory access [address, address+nbytes) falls in this bridge's windows."""
        if not self.memory_enabled:
            return False
        mb, ml = struct.unpack_from("<HH", self.cfg, PCI_MEMORY_BASE)
        base, limit = (mb & 0xFFF0) << 16, ((ml & 0xFFF0) << 16) | 0xFFFFF
        if base <= address and address + nbytes - 1 <= limit:
            return True
        pb, pl = struct.unpack_from("<HH", self.cfg, PCI_PREF_MEMORY_BASE)
        pbu, plu = struct.unpack_from("<II", self.cfg, PCI_PREF_BASE_UPPER32)
        pbase = ((pb & 0xFFF0) << 16) | (pbu << 32)
        plimit = ((pl & 0xFFF0) << 16) | 0xFFFFF | (plu << 32)
        return pbase <= address and address + nbytes - 1 <= plimit


@dataclass
class Bar:
    index: int
    flags: int
    size: int
    register: int = 0   # the address bits as last written (before masking with the size)

    @property
    def is64(self) -> bool:
        return bool(self.flags & BAR_MEM_64) and not self.flags & BAR_IO

    @property
    def is_io(self) -> bool:
        return bool(self.flags & BAR_IO)

    @property
    def address(self) -> int:
        mask = ~(self.size - 1) & (0xFFFFFFFFFFFFFFFF if self.is64 else 0xFFFFFFFF)
        return self.register & mask & ~0xF


class Gpu(Function):
    """The AMD GPU's function 0: BARs and the Resizable BAR capability over a plain config space."""

    def __init__(self) -> None:
        super().__init__(P.AMD_VENDOR_ID, P.GPU_DEVICE_ID, GPU_CLASS, GPU_REVISION, 0x00)
        self.cfg[0x3D] = 0x01  # INTA
        self.bars: dict[int, Bar] = {
            0: Bar(0, BAR_MEM_64 | BAR_MEM_PREFETCH, P.BAR0_VRAM_BYTES_DEFAULT),
            2: Bar(2, BAR_MEM_64 | BAR_MEM_PREFETCH, P.BAR2_DOORBELL_BYTES),
            4: Bar(4, BAR_IO, 0x100),
            5: Bar(5, 0x0, P.BAR5_MMIO_BYTES),
        }
        cap = sum(1 << (n + 4) for n in REBAR_SIZES_MIB_LOG2)
        _pack_u32(self.cfg, REBAR_CAP_OFFSET, PCI_EXT_CAP_ID_REBAR | (1 << 16))  # ID, version 1, next 0
        _pack_u32(self.cfg, REBAR_CAP_OFFSET + 4, cap)
        _pack_u32(self.cfg, REBAR_CAP_OFFSET + 8, (1 << 5) | (REBAR_DEFAULT_LOG2 << 8))  # BAR 0, 1 resizable BAR
        self.wmask[REBAR_CAP_OFFSET + 9] = 0x3F  # BAR size field, bits 8..13

    def _bar_at(self, off: int) -> tuple[Bar, bool] | None:
        """The BAR whose register is at ``off`` and whether ``off`` is its upper half."""
        if not PCI_BASE_ADDRESS_0 <= off < PCI_BASE_ADDRESS_0 + 24:
            return None
        idx = (off - PCI_BASE_ADDRESS_0) // 4
        if idx in self.bars:
            return self.bars[idx], False
        lower = self.bars.get(idx - 1)
        if lower is not None and lower.is64:
            return lower, True
        return None

    def read32(self, off: int) -> int:
        hit = self._bar_at(off)
        if hit is None:
            return super().read32(off)
        bar, upper = hit
        mask = ~(bar.size - 1) & (0xFFFFFFFFFFFFFFFF if bar.is64 else 0xFFFFFFFF)
        value = bar.register & mask
        if upper:
            return (value >> 32) & 0xFFFFFFFF
        return (value & 0xFFFFFFF0 & ~(0x3 if bar.is_io else 0)) | bar.flags

    def write32(self, off: int, value: int, byte_en: int) -> None:
        hit = self._bar_at(off)
        if hit is None:
            super().write32(off, value, byte_en)
            if off == REBAR_CAP_OFFSET + 8:
                size_log2 = (self.read32(off) >> 8) & 0x3F
                if size_log2 in REBAR_SIZES_MIB_LOG2:
                    self.bars[0].size = 1 << (size_log2 + 20)
            return
        bar, upper = hit
        shift = 32 if upper else 0
        old = (bar.register >> shift) & 0xFFFFFFFF
        new = _apply(old, value, byte_en, 0xFFFFFFFF)
        bar.register = (bar.register & ~(0xFFFFFFFF << shift)) | (new << shift)

    def decode(self, address: int, nbytes: int) -> tuple[int, int] | None:
        """(BAR index, offset) of a memory access fully inside one memory BAR, else None."""
        if not self.memory_enabled:
            return None
        for bar in self.bars.values():
            if bar.is_io:
                continue
            base = bar.address
            if base and base <= address and address + nbytes <= base + bar.size:
                return bar.index, address - base
        return None


class Fabric:
    """The chain root -> bridge 0..3 -> GPU, as configuration and memory requests see it."""

    def __init__(self) -> None:
        self.bridges = [Bridge() for _ in range(P.GPU_BUS)]
        self.gpu = Gpu()

    def _chain(self) -> list[Function]:
        return [*self.bridges, self.gpu]

    def cfg_target(self, type1: bool, bus: int, dev: int, fn: int) -> Function | None:
        """The function a configuration request reaches, or None (Unsupported Request)."""
        if dev != 0 or fn != 0:
            return None
        chain = self._chain()
        if not type1:
            return chain[0] if bus == 0 else None
        if bus == 0:
            return None
        for i, bridge in enumerate(self.bridges):
            if bus == bridge.secondary:
                return chain[i + 1]
            if not bridge.secondary < bus <= bridge.subordinate:
                return None
        return None

    def mem_target(self, address: int, nbytes: int) -> tuple[int, int] | None:
        """(GPU BAR index, offset) a memory request reaches through the bridges, or None (UR)."""
        if nbytes <= 0 or not all(b.forwards(address, nbytes) for b in self.bridges):
            return None
        return self.gpu.decode(address, nbytes)
