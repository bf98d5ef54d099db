"""Progress of the worker's long commands (qualification, model load, probes), reported as it happens.

A load may legitimately take long (a cold compile, weights streaming for seconds), but no single *wait on
the dock* inside it may take longer than the wait timeout (tinygrad 0.14's ``HCQDEV_WAIT_TIMEOUT_MS``,
openpilot's 3000 ms). tinygrad's own copy-in drain waits 10 s (``runtime/ops_amd.py``
``AMDAllocator._copyin`` ``wait_drain``), so the node cannot rely on the worker's waits to end; it watches
the worker's progress instead (docs/health.md "Progress during load"). Two kinds of report, both into a
:class:`ProgressSink` the worker installs (its shared control block, ``node/shm.py``):

- **progress**: the dock moved on -- bytes crossed a bulk endpoint (a copy-in chunk reached the bridge's SRAM,
  a copy-out window came back), the GPU engine ticked while it executes a long packet (the twin's compile,
  ``backend/protocol.py`` ``CPL_PROGRESS``), a ladder step started or ended;
- **dock I/O**: the worker is talking to the dock (a transfer begins or ends). Polling reads of a hung GPU's
  fence are dock I/O without progress: that is what a stalled wait looks like. Host work between transfers
  (a compile on the CPU) is neither, and is not a wait.

Without a sink (outside a worker) every call is a no-op. Nothing here sleeps or raises.
"""

from __future__ import annotations

from typing import Any, Protocol


class ProgressSink(Protocol):
    def progress(self, amount: int = 1) -> None: ...

    def dock_io(self, begin: bool) -> None: ...


_sink: ProgressSink | None = None


def set_sink(sink: ProgressSink | None) -> None:
    """Install (or with None remove) where progress goes: the worker's control block."""
    global _sink
    _sink = sink


def note(amount: int = 1) -> None:
    """The dock made progress (``amount``: bytes moved, or 1 for a step or a tick)."""
    if _sink is not None:
        _sink.progress(max(1, int(amount)))


class ProgressUSB3:
    """A tinygrad ``USB3`` (or the twin's ``TwinUSB3``) whose transfers are reported: each one's begin and end
    as dock I/O, and the bytes of every bulk transfer that completed (synchronous, or an async bulk OUT when
    it is waited) as progress. Control transfers are I/O only: a hung GPU is polled with them. Every other
    attribute is the wrapped object's, read and written."""

    def __init__(self, usb: Any) -> None:
        self.usb = usb
        self._bulk: dict[int, int] = {}  # async bulk OUT tag -> bytes, until waited

    def __getattr__(self, name: str) -> Any:
        return getattr(self.usb, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("usb", "_bulk"):
            object.__setattr__(self, name, value)
        else:  # e.g. the retry wrapper clearing tinygrad's latched ``_async_err``
            setattr(self.usb, name, value)

    def _io(self, fn: Any, *args: Any) -> Any:
        sink = _sink
        if sink is None:
            return fn(*args)
        sink.dock_io(True)
        try:
            return fn(*args)
        finally:
            sink.dock_io(False)

    def control_write(self, *args: Any) -> Any:
        return self._io(self.usb.control_write, *args)

    def control_read(self, *args: Any) -> Any:
        return self._io(self.usb.control_read, *args)

    def control_write_async(self, *args: Any) -> Any:
        return self._io(self.usb.control_write_async, *args)

    def control_read_async(self, *args: Any) -> Any:
        return self._io(self.usb.control_read_async, *args)

    def bulk_write(self, payload: Any, *args: Any) -> Any:
        out = self._io(self.usb.bulk_write, payload, *args)
        note(len(memoryview(payload).cast("B")))
        return out

    def bulk_read(self, length: int, *args: Any) -> Any:
        out = self._io(self.usb.bulk_read, length, *args)
        note(length)
        return out

    def bulk_write_async(self, payload: Any, *args: Any) -> Any:
        tag = self._io(self.usb.bulk_write_async, payload, *args)
        self._bulk[tag] = len(memoryview(payload).cast("B"))
        return tag

    def bulk_wait(self, tag: Any, *args: Any) -> Any:
        out = self._io(self.usb.bulk_wait, tag, *args)
        n = self._bulk.pop(tag, 0)
        if n:
            note(n)
        return out
