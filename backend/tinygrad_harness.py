"""tinygrad 0.14's own USB copy path over a dock, with the AM driver's initialisation stood in for.

On a dock, ``AMDDevice("USB")`` (tinygrad 0.14 ``runtime/ops_amd.py``) opens the bridge (``USBIface`` ->
``USBPCIDevice`` -> ``USB3`` + ``CustomASM24Controller``), boots the GPU with the AM driver (``AMDev``:
firmware, page tables, queues) and then moves bytes with ``AMDAllocator._copyin`` / ``_copyout`` over an SDMA
queue (``AMDCopyQueue``, ``AMDQueueDesc``) and waits with ``HCQSignal.wait``. The twin cannot boot AMD firmware,
so :class:`TinygradDock` stands in for **the initialisation only** -- the objects the AM driver would have
built -- and then calls tinygrad's functions unmodified:

- ``CustomASM24Controller(usb)`` (its real ``__init__``: LTSSM check, PCIe power-on) and, unless the caller
  already did it, ``System.pci_setup_usb_bars``;
- a ``USBPCIDevice`` and a ``USBIface`` made with ``object.__new__`` (their ``__init__`` would open libusb and
  boot ``AMDev``) holding the controller, the BARs, the SRAM window (``copy_bufs``), ``sys_buf`` and
  ``cq_buf`` exactly as ``USBIface._dma_region`` lays them out;
- an ``AMDDevice`` made the same way with ``sdma`` (tinygrad's ``autogen/am/sdma_6_0_0``), ``target``,
  ``hw_copy_queue_t``, ``sdma_queues={0: AMDQueueDesc}``, a timeline signal (an ``AMDSignal`` in VRAM),
  ``timeline_value=1``, ``error_state=None``; it is not registered in ``HCQCompiled.peer_groups``;
- the GPU virtual addresses the driver's page tables would hold with ``GMMU=0``, allocated with tinygrad's
  own ``AMMemoryManager.alloc_vaddr`` in tinygrad's order (:func:`dma_layout`): VRAM identity-mapped first
  (``identity_va``), then ``copy_bufs``, ``sys_buf`` and ``cq_buf`` as ``USBIface._dma_region`` allocates
  them. The layout is in :mod:`chestnut.backend.protocol` (``VRAM_VA_BASE``, ``SYS_WINDOWS``); the twin's SDMA
  engine (``backend/sim/sdma.py``) translates with the same table.

Environment (read by tinygrad's cached ``getenv``): :func:`configure_env` sets ``HCQDEV_WAIT_TIMEOUT_MS``
(openpilot's 3000 ms; if tinygrad cached another value in this process its ``getenv`` cache is cleared so the
wait reads the new one), keeps tinygrad's disk cache private (``backend/jitcache.py``), defaults ``DEV`` to
``CPU`` (never probe devices) and refuses ``DEV=MOCK*``,
``PROFILE``, ``AMD_DISABLE_SDMA`` and ``HCQ2`` (each changes the code path under test).

**After any copy failure the dock object refuses further copies** (:class:`CopyRefused`): tinygrad 0.14 keeps
the failed copy-in's ring and sequence numbers, so a same-process retry "succeeds" with the destination left
as zeros (the stale ring consumes the retry's chunks). Only a fresh process gives correct data again.
"""

from __future__ import annotations

import functools
import os
import struct
from typing import Any

from chestnut.backend import protocol as P
from chestnut.backend.jitcache import private_tinygrad_cache

REFUSED_ENV = ("PROFILE", "AMD_DISABLE_SDMA", "HCQ2")
GPU_TARGETS: dict[str, tuple[int, int, int]] = {"gfx1100": (11, 0, 0), "gfx1101": (11, 0, 1),
                                                "gfx1102": (11, 0, 2), "gfx1200": (12, 0, 0),
                                                "gfx1201": (12, 0, 1)}


class CopyRefused(RuntimeError):
    """A copy was asked of a dock object that already saw a copy fail (see the module doc)."""


def configure_env(wait_timeout_ms: int = P.WAIT_TIMEOUT_MS) -> None:
    """Set ``HCQDEV_WAIT_TIMEOUT_MS`` for tinygrad and check the variables that would change its code path.

    Raises ``RuntimeError`` if one of ``PROFILE``, ``AMD_DISABLE_SDMA``, ``HCQ2`` is set or ``DEV`` names a
    MOCK interface.
    """
    bad = [k for k in REFUSED_ENV if os.environ.get(k, "") not in ("", "0")]
    if os.environ.get("DEV", "").split("+")[0].upper().startswith("MOCK") or "MOCK" in os.environ.get("DEV", ""):
        bad.append("DEV=" + os.environ["DEV"])
    if bad:
        raise RuntimeError(f"tinygrad environment: unset {', '.join(bad)} (they change tinygrad's copy path)")
    private_tinygrad_cache()  # tinygrad's disk cache: a private directory, or off (backend/jitcache.py)
    os.environ.setdefault("DEV", "CPU")  # tinygrad's only device in this process is the host CPU
    os.environ["HCQDEV_WAIT_TIMEOUT_MS"] = str(wait_timeout_ms)
    from tinygrad.helpers import getenv

    if getenv("HCQDEV_WAIT_TIMEOUT_MS", 30000) != wait_timeout_ms:
        getenv.cache_clear()  # type: ignore[attr-defined]  # read earlier in this process: read it again
    seen = getenv("HCQDEV_WAIT_TIMEOUT_MS", 30000)
    if seen != wait_timeout_ms:
        raise RuntimeError(f"tinygrad reads HCQDEV_WAIT_TIMEOUT_MS={seen}, not {wait_timeout_ms}")


@functools.cache
def dma_layout() -> dict[str, int]:
    """The GPU virtual addresses of this process's dock, allocated once with tinygrad 0.14's own
    ``AMMemoryManager.alloc_vaddr`` (``runtime/support/memory.py``: the process-wide allocator of
    ``runtime/support/am/amdev.py``) in the order tinygrad allocates them with ``GMMU=0``: the VRAM identity
    mapping (``MemoryManager.identity_va``: ``alloc_vaddr(vram, vram)``, ``P.BAR0_VRAM_BYTES`` of VRAM), then
    ``USBIface.__init__``'s ``_dma_region`` calls (copy_bufs 0x80000, sys_buf 0x1000, cq_buf 0x1000).

    Returns {"vram", "copy_bufs", "sys_buf", "cq_buf"} -> GPU VA. Raises ``RuntimeError`` if tinygrad's
    allocator hands out other addresses than the twin's SDMA engine maps (``P.VRAM_VA_BASE``, ``P.SYS_WINDOWS``:
    something else in this process allocated GPU addresses first)."""
    from tinygrad.runtime.support.am.amdev import AMMemoryManager

    got = {"vram": AMMemoryManager.alloc_vaddr(P.BAR0_VRAM_BYTES, P.BAR0_VRAM_BYTES),
           "copy_bufs": AMMemoryManager.alloc_vaddr(size=P.SRAM_SIZE),
           "sys_buf": AMMemoryManager.alloc_vaddr(size=0x1000),
           "cq_buf": AMMemoryManager.alloc_vaddr(size=0x1000)}
    want = {"vram": P.VRAM_VA_BASE, "copy_bufs": P.SRAM_GPU_VA, "sys_buf": P.SYS_PAGE_GPU_VA,
            "cq_buf": P.CPL_PAGE_GPU_VA}
    if got != want:
        raise RuntimeError("tinygrad's GPU address allocator gave " + ", ".join(f"{k} {v:#x}" for k, v in got.items())
                           + "; the twin maps " + ", ".join(f"{k} {v:#x}" for k, v in want.items())
                           + " (run the dock in a fresh process)")
    return got


class TinygradDock:
    """tinygrad 0.14's ``AMDDevice`` / ``AMDAllocator`` for the dock behind ``usb`` (a tinygrad ``USB3`` or the
    twin's :class:`~chestnut.backend.sim.usb3.TwinUSB3`).

    ``bars``: BAR -> (bus address, size) if the caller already assigned them (else
    ``System.pci_setup_usb_bars`` runs); ``arch``: the GPU's architecture (sets ``AMDDevice.target``).
    Raises ``RuntimeError`` from tinygrad's controller (e.g. "PCIe link not up") and when the SDMA queue
    still holds another process's packets (reset the GPU first).
    """

    def __init__(self, usb: Any, bars: dict[int, tuple[int, int]] | None = None, *, arch: str = P.GPU_ARCH,
                 wait_timeout_ms: int = P.WAIT_TIMEOUT_MS) -> None:
        configure_env(wait_timeout_ms)
        from tinygrad.runtime.autogen.am import sdma_6_0_0
        from tinygrad.runtime.ops_amd import AMDAllocator, AMDCopyQueue, AMDDevice, AMDQueueDesc, AMDSignal, USBIface
        from tinygrad.runtime.support.hcq import HCQBuffer
        from tinygrad.runtime.support.system import System, USBPCIDevice
        from tinygrad.runtime.support.usb import CustomASM24Controller

        self._HCQBuffer = HCQBuffer
        ctrl = CustomASM24Controller(usb)
        if bars is None:
            bars = System.pci_setup_usb_bars(ctrl, gpu_bus=P.GPU_BUS, mem_base=P.USB_MEM_BASE,
                                             pref_mem_base=P.USB_PREF_MEM_BASE)
        pci = object.__new__(USBPCIDevice)
        pci.pcibus, pci.usb, pci._bar_info = "usb:twin", ctrl, dict(bars)
        pci.peer_group = "chestnut-harness"
        self.pci = pci
        iface = object.__new__(USBIface)
        dev = object.__new__(AMDDevice)
        iface.dev, iface.pci_dev, iface.vram_bar = dev, pci, 0

        def sys_region(xdata_addr: int, gpu_va: int, size: int) -> Any:
            return HCQBuffer(gpu_va, size, view=pci.dma_view(xdata_addr, size), owner=dev)

        layout = dma_layout()
        iface.copy_bufs = [sys_region(P.XDATA_SRAM_WINDOW, layout["copy_bufs"], P.SRAM_SIZE)]
        iface.sys_buf = sys_region(P.XDATA_SYS_PAGE, layout["sys_buf"], 0x1000)
        iface.cq_buf = sys_region(P.XDATA_CPL_PAGE, layout["cq_buf"], 0x1000)
        dev.iface, dev.sdma, dev.device = iface, sdma_6_0_0, "AMD"
        dev.target = GPU_TARGETS[arch]
        dev.arch = arch
        dev.error_state = None
        dev.hw_copy_queue_t = functools.partial(AMDCopyQueue, dev)
        rptr = int.from_bytes(pci.map_bar(0, off=P.SDMA_RPTR_VRAM_OFFSET, size=16, fmt="B")[:], "little")
        rptr, wptr = rptr & (2**64 - 1), rptr >> 64
        if wptr not in (0, rptr):
            raise RuntimeError(f"the SDMA queue holds packets of another process (read pointer {rptr:#x}, write "
                               f"pointer {wptr:#x}): reset the GPU first")
        queue = AMDQueueDesc(ring=pci.map_bar(0, off=P.SDMA_RING_VRAM_OFFSET, size=P.SDMA_RING_BYTES, fmt="I"),
                             read_ptr=pci.map_bar(0, off=P.SDMA_RPTR_VRAM_OFFSET, size=8, fmt="Q"),
                             write_ptr=pci.map_bar(0, off=P.SDMA_WPTR_VRAM_OFFSET, size=8, fmt="Q"),
                             doorbell=pci.map_bar(2, off=P.SDMA_DOORBELL_BAR_OFFSET, size=8, fmt="Q"), put_value=rptr)
        dev.sdma_queues = {0: queue}
        dev.timeline_value = 1
        self.dev = dev
        dev.timeline_signal = AMDSignal(self.buffer(P.SIGNAL_VRAM_OFFSET, 16), value=0, is_timeline=True)
        alloc = object.__new__(AMDAllocator)
        alloc.dev, alloc.b = dev, iface.copy_bufs
        dev.allocator = alloc
        self.ctrl, self.allocator = ctrl, alloc
        self.bars = dict(bars)
        self.failed: BaseException | None = None
        self.copies_in = self.copies_out = 0

    def buffer(self, vram_offset: int, nbytes: int) -> Any:
        """An ``HCQBuffer`` for ``nbytes`` of VRAM at ``vram_offset``: GPU VA ``VRAM_VA_BASE + offset``, its CPU
        view through BAR0 (tinygrad's ``USBPCIDevice.map_bar``)."""
        return self._HCQBuffer(P.VRAM_VA_BASE + vram_offset, nbytes, owner=self.dev,
                               view=self.pci.map_bar(0, off=vram_offset, size=nbytes, fmt="B"))

    def _guarded(self, what: str, fn: Any) -> Any:
        if self.failed is not None:
            raise CopyRefused(f"{what} refused: a copy already failed in this process ({self.failed}); tinygrad "
                              f"0.14 would return zeros on a retry -- use a fresh process")
        try:
            return fn()
        except BaseException as e:
            self.failed = e
            raise

    def copy_in(self, vram_offset: int, data: bytes | bytearray | memoryview) -> None:
        """``AMDAllocator._copyin`` of ``data`` to VRAM ``vram_offset`` (synchronous: returns once drained).

        Raises tinygrad's errors (``RuntimeError``: "GPU failed to drain USB copyin chunk N (10s, hung GPU?)",
        "async bulk OUT failed: status=N", "libusb_..."), ``AssertionError`` for a short transfer, and
        :class:`CopyRefused` after an earlier failure.
        """
        src = memoryview(data).cast("B")
        self._guarded("copy-in", lambda: self.allocator._copyin(self.buffer(vram_offset, max(len(src), 1)), src))
        self.copies_in += 1

    def copy_out(self, vram_offset: int, nbytes: int) -> bytes:
        """``AMDAllocator._copyout`` of ``nbytes`` from VRAM ``vram_offset``. Raises like :meth:`copy_in`, and
        ``RuntimeError("Wait timeout: N ms! ...")`` / "Device hang detected" from ``HCQSignal.wait`` /
        ``synchronize`` (sticky: ``AMDDevice.error_state``)."""
        out = memoryview(bytearray(nbytes))
        self._guarded("copy-out", lambda: self.allocator._copyout(out, self.buffer(vram_offset, max(nbytes, 1))))
        self.copies_out += 1
        return bytes(out)

    def synchronize(self) -> None:
        """``AMDDevice.synchronize``: wait (``HCQSignal.wait``) for the timeline signal to reach the last value."""
        self._guarded("synchronize", self.dev.synchronize)

    def drain_fence(self) -> int:
        """The copy-in drain fence (XDATA 0xA800, u64), read with the controller."""
        return int(struct.unpack("<Q", self.ctrl.read(P.XDATA_COPYIN_FENCE, 8))[0])
