"""The dock's wire protocol: constants shared by the host side and the twin.

Sources: tinygrad 0.14 ``runtime/support/usb.py`` (``USB3``, ``CustomASM24Controller``) and
``runtime/support/system.py`` (``pci_setup_usb_bars``) for the USB IDs, vendor requests, XDATA
addresses and BAR set-up; ``docs/protocol.md`` ("The copy path") for the bounded copy protocol's
SRAM halves, sentinel block and slots. The GPU command-packet format at the end is chestnut's own: the
real dock runs AMD PM4/SDMA packets through tinygrad, the twin runs the packets defined here.
"""

from __future__ import annotations

# ------------------------------------------------------------------ USB (docs/protocol.md, "USB")
USB_IDS: tuple[tuple[int, int], ...] = ((0xADD1, 0x0001), (0x3801, 0x0001))  # (VID, PID)
PRODUCT_PREFIXES: tuple[str, ...] = ("custom", "AS2462")  # the product string must start with one
USB_CONFIGURATION = 1
USB_INTERFACE = 0
EP_BULK_OUT = 0x02
EP_BULK_IN = 0x81
SUPERSPEED_MBPS = 5000  # below this the link is "slow USB" (openpilot hardwared)
HIGHSPEED_MBPS = 480    # USB 2 fallback

# bmRequestType for vendor requests to the device
REQTYPE_VENDOR_OUT = 0x40
REQTYPE_VENDOR_IN = 0xC0

# ------------------------------------------------------------------ bridge vendor requests
REQ_XDATA_READ = 0xE4    # IN: wValue = XDATA address, wLength <= 255
REQ_XDATA_WRITE = 0xE5   # OUT: wValue = XDATA address, wIndex = the byte
REQ_TLP = 0xF0           # OUT: issue a TLP (data = <III addr lo, addr hi, value|dword count>); IN: 8-byte completion
REQ_SRAM = 0xF2          # OUT: SRAM engine; wValue = 512-byte sectors (|0x8000 arms a read), wIndex = slot | nslots<<8
REQ_PCIE_POWER = 0xF3    # OUT: wValue 1 = on, 0 = off
XDATA_READ_MAX = 0xFF    # bytes per 0xE4 read
TLP_MODE_SINGLE, TLP_MODE_STREAM_WRITE, TLP_MODE_STREAM_READ = 0, 1, 2
SRAM_READ_FLAG = 0x8000

# TLP fmt/type bytes as tinygrad uses them
TLP_CFG_READ0, TLP_CFG_READ1, TLP_CFG_WRITE0, TLP_CFG_WRITE1 = 0x04, 0x05, 0x44, 0x45
TLP_MEM_READ32, TLP_MEM_WRITE32 = 0x00, 0x40
TLP_MEM_READ64, TLP_MEM_WRITE64 = 0x20, 0x60
# completion status, (byte 4 >> 5) & 7 of the 0xF0 IN completion (PCIe base spec)
CPL_SUCCESS, CPL_UR, CPL_CRS, CPL_CA = 0b000, 0b001, 0b010, 0b100
TLP_RETRIES = 10          # tinygrad 0.14 retries a bad return status 10 times, 1 ms apart

# ------------------------------------------------------------------ XDATA map
XDATA_SIZE = 0x10000
XDATA_LTSSM = 0xB450      # PCIe LTSSM state byte
LTSSM_L0 = 0x78           # link up
LTSSM_DETECT = 0x00       # unpowered / detect
LTSSM_STUCK = 0x4C        # a known firmware failure: trains into 0x4C and sticks
XDATA_SYS_PAGE = 0xA000   # 4 KiB, GPU-visible at SYS_PAGE_GPU_ADDR
SYS_PAGE_GPU_ADDR = 0x820000
XDATA_COPYIN_FENCE = 0xA800  # copy-in progress fence (u32 LE): GPU writes seq+1 after draining chunk seq
XDATA_CPL_PAGE = 0xB800   # completion page, GPU-visible at CPL_PAGE_GPU_ADDR
CPL_PAGE_GPU_ADDR = 0x822000
XDATA_SRAM_WINDOW = 0xF000
SRAM_GPU_ADDR = 0x200000  # the bridge SRAM as the GPU sees it
GPU_BUS = 4               # the GPU sits on PCIe bus 4 behind four type-1 bridges

# ------------------------------------------------------------------ copy protocol (docs/protocol.md)
SRAM_SIZE = 0x80000       # 512 KiB
SRAM_HALF = 0x40000       # two halves of 256 KiB
SRAM_SLOT = 0x4000        # 16 KiB slots; 0xF2 wIndex counts in slots
SECTOR = 512              # 0xF2 wValue counts 512-byte sectors
SENTINEL_BLOCK = 512      # each chunk ends with a 512-byte sentinel block
CHUNK_PAYLOAD = SRAM_HALF - SENTINEL_BLOCK  # 0x40000-512 payload bytes per chunk
SENTINEL_MAGIC = 0x51000000  # last dword of the sentinel block = SENTINEL_MAGIC | (seq & 0xFFFFFF)
SLOTS_PER_HALF = SRAM_HALF // SRAM_SLOT

# ------------------------------------------------------------------ timing
WAIT_TIMEOUT_MS = 3000    # openpilot modeld's HCQDEV_WAIT_TIMEOUT_MS for the dock
USB_CTRL_TIMEOUT_MS = 1000
TLP_TIMEOUT_MS = 5000
PCIE_POWER_TIMEOUT_MS = 10000

# ------------------------------------------------------------------ the GPU (twin's identity)
AMD_VENDOR_ID = 0x1002
# Navi 48 (Radeon RX 9070 XT), RDNA4, gfx1201 -- the kind of card the dock carries.
GPU_DEVICE_ID = 0x7550
GPU_ARCH = "gfx1201"
SUPPORTED_ARCHS: tuple[str, ...] = ("gfx1100", "gfx1101", "gfx1102", "gfx1200", "gfx1201")
# (device id -> arch) the host uses to name the architecture from config space
DEVICE_ARCHS: dict[int, str] = {0x744C: "gfx1100", 0x7480: "gfx1102", 0x7550: "gfx1201", 0x7590: "gfx1200",
                                0x73BF: "gfx1030", 0x73DF: "gfx1031"}  # the last two: RDNA2, not supported

# ------------------------------------------------------------------ BARs of the GPU (bus 4)
# AMD's layout: BAR0 = VRAM (64-bit, prefetchable, resizable), BAR2 = doorbells (64-bit,
# prefetchable), BAR5 = MMIO registers (32-bit). tinygrad's pci_setup_usb_bars assigns them from
# mem_base=0x10000000 (non-prefetchable) and pref_mem_base=32 GiB (prefetchable).
BAR0_VRAM_BYTES = 16 << 30        # after the Resizable BAR capability is applied
BAR0_VRAM_BYTES_DEFAULT = 256 << 20
BAR2_DOORBELL_BYTES = 2 << 20
BAR5_MMIO_BYTES = 512 << 10
USB_MEM_BASE = 0x10000000
USB_PREF_MEM_BASE = 32 << 30

# ------------------------------------------------------------------ GPU command packets (chestnut's own)
# The host writes packets into a ring in VRAM (BAR0 + RING_VRAM_OFFSET) with streaming memory-write
# TLPs, then writes the new write pointer (bytes written since power-on, u32, wraps) to the
# doorbell (BAR2 + 0) with one posted 32-bit write. The engine executes packets in order. After each
# packet it writes that packet's seq to the queue fence (completion page + CPL_QUEUE_FENCE) and its
# status to completion page + CPL_STATUS. A host waits on those with a bounded poll.
#
# Packet: dword0 = opcode | (ndwords << 16) (ndwords counts the whole packet), dword1 = seq, then
# the opcode's argument dwords (all u32, little-endian; 64-bit VRAM offsets as lo, hi).
RING_VRAM_OFFSET = 0x0
RING_BYTES = 0x100000             # 1 MiB ring; VRAM below VRAM_HEAP_OFFSET is reserved
VRAM_HEAP_OFFSET = 0x400000       # first VRAM byte the host may allocate for buffers (below: the two rings, pointers)
DOORBELL_BAR_OFFSET = 0x0
DOORBELL_QUEUE_RESET = 0x8        # BAR2 offset: a posted write of any value abandons the packet being executed and
#                                   every packet not yet started (read pointer := write pointer); CPL_RPTR is updated
# The completion block sits 0x100 into the completion page: tinygrad's copy-out writes a u32 0 to cq_buf+12
# (the page's first 16 bytes are the bridge's NVMe-style completion entry), which must not clobber it.
CPL_QUEUE_FENCE = 0x100           # u32: seq of the last completed packet
CPL_STATUS = 0x104                # u32: status of that packet (STATUS_*)
CPL_SIGNAL = 0x108                # u32: value written by OP_SIGNAL
CPL_RPTR = 0x10C                  # u32: the engine's read pointer (bytes consumed since GPU reset), written before
#                                   CPL_QUEUE_FENCE; a fresh host process continues its write pointer from here
CPL_PROGRESS = 0x110              # u32: the engine's work ticks: +1 every 50 ms while a long packet (OP_LOAD's
#                                   compile, OP_RUN) executes; a hung engine does not tick (backend/progress.py)

OP_NOP = 0x00
OP_COPYIN = 0x01   # half, payload_nbytes, dst_lo, dst_hi, chunk_seq: wait for the sentinel of chunk_seq in that
#                    SRAM half, check the block's CRC, copy the payload to VRAM, clear the sentinel, write
#                    chunk_seq+1 to the copy-in fence (XDATA 0xA800)
OP_COPYOUT = 0x02  # half, nbytes (<= SRAM_HALF), src_lo, src_hi: copy VRAM to the start of that SRAM half
OP_LOAD = 0x03     # program_id, onnx_lo, onnx_hi, onnx_nbytes, sig_lo, sig_hi: compile the ONNX model held in
#                    VRAM (tinygrad on the host CPU, cached by sha256); write its signature at sig: u32 length
#                    then UTF-8 JSON {"sha256", "inputs": [{name, shape, dtype}], "outputs": [...]}
#                    (on STATUS_COMPILE_FAILED the JSON is {"error": message})
OP_RUN = 0x04      # program_id, table_lo, table_hi: table = u32 n_in, u32 n_out, then per tensor u64 vram
#                    offset, u64 nbytes, inputs then outputs in signature order
OP_SIGNAL = 0x05   # value: write value to completion page + CPL_SIGNAL

PACKET_DWORDS: dict[int, int] = {OP_NOP: 2, OP_COPYIN: 7, OP_COPYOUT: 6, OP_LOAD: 8, OP_RUN: 5, OP_SIGNAL: 3}
OP_NAMES: dict[int, str] = {OP_NOP: "NOP", OP_COPYIN: "COPYIN", OP_COPYOUT: "COPYOUT", OP_LOAD: "LOAD", OP_RUN: "RUN",
                            OP_SIGNAL: "SIGNAL"}

STATUS_OK = 0
STATUS_BAD_PACKET = 1
STATUS_CRC = 2           # the sentinel block's CRC does not match the payload (truncated / corrupt transfer)
STATUS_NO_PROGRAM = 3
STATUS_COMPILE_FAILED = 4
STATUS_RUN_FAILED = 5
STATUS_OUT_OF_RANGE = 6

# Packet lengths in dwords (dword0's ndwords must match): NOP 2, COPYIN 7, COPYOUT 6, LOAD 8, RUN 5, SIGNAL 3.
# After each packet the engine writes CPL_STATUS, then CPL_RPTR, then CPL_QUEUE_FENCE (the host polls the fence
# last-written). A COPYIN with a bad sentinel block completes with STATUS_CRC: the block is cleared, the payload is
# not copied and the copy-in fence does not move. Reference implementation: chestnut.backend.sim.engine.

# The sentinel block (SENTINEL_BLOCK bytes) follows the 512-padded payload of a chunk in its SRAM half
# (for a full chunk: the last 512 bytes of the half). Layout, u32 LE: [0] payload nbytes, [1] crc32 of
# the payload (zlib.crc32), [2] chunk seq, zeros..., [127] SENTINEL_MAGIC | (seq & 0xFFFFFF).
SENTINEL_NBYTES_DW, SENTINEL_CRC_DW, SENTINEL_SEQ_DW, SENTINEL_MAGIC_DW = 0, 1, 2, 127


def sentinel_value(seq: int) -> int:
    """The sentinel dword for chunk ``seq``: ``0x51000000 | (seq & 0xFFFFFF)`` (tinygrad 0.14 usb.py)."""
    return SENTINEL_MAGIC | (seq & 0xFFFFFF)


# ------------------------------------------------------------------ the SDMA queue, as tinygrad 0.14 drives it
# tinygrad 0.14 ``runtime/ops_amd.py``: ``AMDAllocator._copyin`` / ``_copyout`` build SDMA packets with
# ``AMDCopyQueue`` (encodings from ``runtime/autogen/am/sdma_6_0_0.py``), put them in a ring with
# ``AMDCopyQueue._submit`` and post the write pointer with ``AMDQueueDesc.signal_doorbell``; the pointers are
# byte counts that only grow (ring offset = pointer % ring size). On a dock the AM driver creates the queue
# at initialisation (``AMDDevice.sdma_queue``: a 1 MiB ring for USB); on the twin the harness
# (``backend/tinygrad_harness.py``) stands in for that initialisation and both sides use this layout:
SDMA_RING_VRAM_OFFSET = 0x200000  # 1 MiB SDMA ring in VRAM
SDMA_RING_BYTES = 1 << 20         # tinygrad 0.14 ``AMDDevice.sdma_queue``: (1 << 20) if is_usb()
SDMA_RPTR_VRAM_OFFSET = 0x300000  # u64: the engine's read pointer, written back after every packet
SDMA_WPTR_VRAM_OFFSET = 0x300008  # u64: ``AMDQueueDesc.write_ptr`` (the host writes put_value here, then rings)
SIGNAL_VRAM_OFFSET = 0x301000     # 16 bytes per signal (u64 value, u64 timestamp): the timeline signal first
SDMA_DOORBELL_BAR_OFFSET = 0x10   # BAR2: u64 doorbell of SDMA queue 0 (the compute ring's doorbell is at 0x0)
SDMA_MAX_COPY_BYTES = 64 << 20    # the twin skips (and latches an error for) a COPY_LINEAR larger than this
# GPU virtual addresses as tinygrad 0.14 lays them out with GMMU=0, all from ``AMMemoryManager.alloc_vaddr``
# (``runtime/support/memory.py``; the allocator's base 0x2000_0000_0000, ``runtime/support/am/amdev.py``): VRAM
# identity-mapped first (``MemoryManager.identity_va``: the VRAM size, aligned to it; a buffer is at
# ``identity_va + paddr``), then ``USBIface._dma_region``'s three system windows in its order (``ops_amd.py``:
# copy_bufs 0x80000, sys_buf 0x1000, cq_buf 0x1000, each aligned to its size), mapped (SYS aspace) to their bus
# addresses SRAM_GPU_ADDR, SYS_PAGE_GPU_ADDR, CPL_PAGE_GPU_ADDR. ``backend/tinygrad_harness.py`` allocates them
# with tinygrad's allocator and checks they are these.
VRAM_VA_BASE = 0x2000_0000_0000
SRAM_GPU_VA = VRAM_VA_BASE + BAR0_VRAM_BYTES   # 0x2004_0000_0000
SYS_PAGE_GPU_VA = SRAM_GPU_VA + SRAM_SIZE      # 0x2004_0008_0000
CPL_PAGE_GPU_VA = SYS_PAGE_GPU_VA + 0x1000     # 0x2004_0008_1000
SYS_WINDOWS: tuple[tuple[int, int, int, int], ...] = (  # (GPU VA, bus address, XDATA address of the host's view, size)
    (SRAM_GPU_VA, SRAM_GPU_ADDR, XDATA_SRAM_WINDOW, SRAM_SIZE),
    (SYS_PAGE_GPU_VA, SYS_PAGE_GPU_ADDR, XDATA_SYS_PAGE, 0x1000),
    (CPL_PAGE_GPU_VA, CPL_PAGE_GPU_ADDR, XDATA_CPL_PAGE, 0x1000),
)
COPYIN_CHUNK = 0x40000 - 4        # tinygrad 0.14 ``_copyin``: payload per chunk (a 256 KiB window minus the sentinel)
COPYOUT_CHUNK = SRAM_SIZE         # tinygrad 0.14 ``_copyout``: one copy per ``copy_bufs[0].size`` (512 KiB)
DRAIN_TIMEOUT_S = 10.0            # tinygrad 0.14 ``_copyin.wait_drain``: hard-coded, ignores HCQDEV_WAIT_TIMEOUT_MS
