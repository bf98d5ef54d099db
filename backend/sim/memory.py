"""Sparse memory: a large address space that costs memory only for the pages written.

The twin's VRAM is 16 GiB (``protocol.BAR0_VRAM_BYTES``); a page of ``PAGE_BYTES`` is allocated on
its first write, reads of never-written pages return zeros.
"""

from __future__ import annotations

PAGE_BYTES = 64 << 10


class SparseMemory:
    """``size`` bytes of zero-initialised memory, stored as a dict of 64 KiB pages. Not thread-safe.

    Out-of-range accesses raise ``IndexError``.
    """

    def __init__(self, size: int, page_bytes: int = PAGE_BYTES) -> None:
        self.size = size
        self.page_bytes = page_bytes
        self._pages: dict[int, bytearray] = {}

    @property
    def pages_used(self) -> int:
        return len(self._pages)

    def clear(self) -> None:
        self._pages.clear()

    def _check(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise IndexError(f"[{offset:#x}, {offset + nbytes:#x}) is outside {self.size:#x} bytes")

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        mv = memoryview(data).cast("B")
        self._check(offset, len(mv))
        pos, pb = 0, self.page_bytes
        while pos < len(mv):
            page, off = divmod(offset + pos, pb)
            n = min(pb - off, len(mv) - pos)
            buf = self._pages.get(page)
            if buf is None:
                if not any(mv[pos:pos + n]):
                    pos += n
                    continue
                buf = self._pages[page] = bytearray(pb)
            buf[off:off + n] = mv[pos:pos + n]
            pos += n

    def read(self, offset: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        self.readinto(offset, memoryview(out))
        return bytes(out)

    def readinto(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` (a writable byte memoryview) from ``offset``."""
        self._check(offset, len(out))
        pos, pb = 0, self.page_bytes
        while pos < len(out):
            page, off = divmod(offset + pos, pb)
            n = min(pb - off, len(out) - pos)
            buf = self._pages.get(page)
            if buf is None:
                out[pos:pos + n] = bytes(n)
            else:
                out[pos:pos + n] = buf[off:off + n]
            pos += n
