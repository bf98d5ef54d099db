"""tinygrad 0.14's ``USB3`` class, re-done over the twin: same method names, same errors.

``TwinUSB3`` can be handed to tinygrad's own ``CustomASM24Controller(usb)`` unmodified. Mirrored from
``tinygrad/runtime/support/usb.py`` (0.14):

- ``list_devices(vendor, dev)`` is cached per process (tinygrad: ``@functools.cache``): the first call
  enumerates, later calls return the same list even after an unplug or a re-enumeration. Only a new
  process (or :func:`forget_device_lists`, which tinygrad does not have) sees the new address; a handle
  opened on the old address fails with ``LIBUSB_ERROR_NO_DEVICE``.
- ``__init__`` opens the device, reads the product string (``libusb_get_string_descriptor_ascii``:
  string 0 for the LANGID, then ``iProduct``), asserts it starts with "custom" or "AS2462", sets
  configuration 1 (which clears endpoint halts), claims interface 0 (BUSY if another process holds it)
  and selects alternate setting 0.
- Failures raise ``RuntimeError`` with tinygrad's ``checked()`` text: ``"<call>: <libusb_strerror>"``,
  e.g. ``"libusb_control_transfer: Operation timed out"``, ``"bulk OUT 0x02 failed: No such device (it
  may have been disconnected)"``, ``"bulk IN 0x81 failed: Pipe error"``; a short bulk OUT raises
  ``AssertionError("bulk OUT short write: n/m bytes")``, a short control transfer a bare
  ``AssertionError``, as tinygrad's asserts do.
- Async transfers (``bulk_write_async``, ``control_write_async``, ``control_read_async``) reach the twin
  in submission order when submitted (their effect on the dock happens then); a failure is latched in
  ``_async_err`` as a ``libusb_transfer_status`` (or -1 for a short transfer) and never cleared, so
  every later ``bulk_wait`` raises ``"async bulk OUT failed: status=N"``. A submit on a device already
  gone raises ``"async submit failed: No such device ..."``.
- With the twin's timing model on, async transfers are timed here, as libusb overlaps them: a transfer
  completes one latency after its bytes crossed the link; bulk payloads cross the link one at a time (a
  control transfer's few bytes slip in between); each pipe (EP0 control, EP2 bulk) completes its transfers
  in order. ``bulk_wait(tag)`` returns when that transfer would have completed. (Synchronous transfers are
  timed by the twin.)

``send_batch`` (tinygrad's mass-storage path for flashing) is not provided: the twin has no SCSI target.
"""

from __future__ import annotations

import functools
import itertools
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from chestnut.backend import protocol as P
from chestnut.backend.docklock import dock_lock_path, open_dock_lock, try_flock
from chestnut.backend.sim.client import TwinClient, TwinNotRunning
from chestnut.backend.sim.libusb_codes import LIBUSB_ERROR_NO_DEVICE, UsbError
from chestnut.backend.sim.twin import Twin
from chestnut.msgs.paths import current_prefix

CTRL_BUFFER_BYTES = 0x1000
BULK_BUFFER_BYTES = 4 << 20


@dataclass(frozen=True)
class TwinDevice:
    """An entry of the cached device list: where the dock was when this process enumerated."""

    prefix: str
    bus: int
    address: int
    device_descriptor: bytes
    twin: Twin | None = field(default=None, compare=False, hash=False)  # in-process twin, else the daemon

    @property
    def pcibus(self) -> str:
        """tinygrad's name for it: ``usb:<bus>-<address>``."""
        return f"usb:{self.bus}-{self.address}"

    def client(self) -> TwinClient:
        return TwinClient.in_process(self.twin) if self.twin is not None else TwinClient(self.prefix)


@functools.cache
def _device_list(prefix: str, vendor: int, product: int, twin: Twin | None) -> tuple[TwinDevice, ...]:
    try:
        with (TwinClient.in_process(twin) if twin is not None else TwinClient(prefix)) as c:
            found = c.enumerate()
    except TwinNotRunning:
        found = []
    return tuple(TwinDevice(prefix, d.bus, d.address, d.device_descriptor, twin)
                 for d in found if (d.vid, d.pid) == (vendor, product))


def forget_device_lists() -> None:
    """Drop this process's cached device lists (tinygrad 0.14 has no such thing; for tools and tests)."""
    _device_list.cache_clear()


def acquire_dock_lock(bus: int, address: int) -> int:
    """Take tinygrad's exclusive, non-blocking lock for the dock at ``bus``/``address`` and return its fd
    (held until the fd is closed or the process exits), as ``System.flock_acquire`` does; the file is
    opened the project's one way (:func:`~chestnut.backend.docklock.open_dock_lock`: no symlink, no chmod).

    Raises ``RuntimeError("Failed to acquire lock file am_usb:<bus>-<addr>.lock. ...")`` if another
    process holds it, ``UsbLayerError`` ``lock_unusable`` for a file that cannot be used.
    """
    path = dock_lock_path(bus, address)
    name = path.name
    fd = open_dock_lock(path)
    if not try_flock(fd):
        os.close(fd)
        raise RuntimeError(f"Failed to acquire lock file {name}. `sudo lsof {path}` may help identify the process "
                           "holding the lock.") from None
    return fd


def _fail(what: str, e: UsbError) -> RuntimeError:
    return RuntimeError(f"{what}: {e.strerror}")


class TwinUSB3:
    """tinygrad 0.14 ``USB3`` over the twin. ``dev`` comes from :meth:`list_devices`; ``client`` overrides the
    connection (default: a new connection to the device's daemon, or its in-process twin)."""

    @classmethod
    def list_devices(cls, vendor: int, dev: int, prefix: str | None = None,
                     twin: Twin | None = None) -> list[tuple[TwinDevice, str]]:
        """``[(device, "usb:<bus>-<addr>")]`` for VID ``vendor``/PID ``dev``; cached per process like tinygrad's."""
        return [(d, d.pcibus) for d in _device_list(prefix or current_prefix(), vendor, dev, twin)]

    def __init__(self, dev: TwinDevice, client: TwinClient | None = None) -> None:
        self._tags = itertools.count(1)
        self._ctrl_buf = bytearray(CTRL_BUFFER_BYTES)
        self._ctrl_mv = memoryview(self._ctrl_buf)
        self._bulk_buf = bytearray(BULK_BUFFER_BYTES)
        self._bulk_mv = memoryview(self._bulk_buf)
        self._async_seq, self._async_err = itertools.count(1), 0
        self._async_pending: dict[int, float] = {}   # tag -> when the transfer completes (monotonic s)
        self._pipe_free = {"control": 0.0, "bulk": 0.0}
        self._link_free = 0.0
        self._timing: dict[str, float] | None = None
        self._gone = False
        self.dev = dev
        try:
            self.client = client if client is not None else dev.client()
        except TwinNotRunning:
            raise _fail("libusb_open", UsbError(LIBUSB_ERROR_NO_DEVICE)) from None
        try:
            self.handle = self.client.open(dev.bus, dev.address)
        except UsbError as e:
            raise _fail("libusb_open", e) from None
        i_product = dev.device_descriptor[15]
        try:
            langids = self.client.ctrl_transfer(self.handle, 0x80, 0x06, 0x0300, 0, 255)
            assert isinstance(langids, bytes)
            langid = struct.unpack_from("<H", langids, 2)[0] if len(langids) >= 4 else 0
            raw = self.client.ctrl_transfer(self.handle, 0x80, 0x06, 0x0300 | i_product, langid, 255)
        except UsbError as e:
            raise _fail("libusb_get_string_descriptor_ascii", e) from None
        assert isinstance(raw, bytes)
        text = raw[2:raw[0] if raw else 0].decode("utf-16-le", errors="replace")
        self.product = "".join(ch if ord(ch) < 0x80 else "?" for ch in text)
        assert self.product.startswith("custom") or self.product.startswith("AS2462")
        for what, call in (("libusb_set_configuration", lambda: self.client.set_configuration(self.handle, 1)),
                           ("libusb_claim_interface", lambda: self.client.claim_interface(self.handle, 0)),
                           ("libusb_set_interface_alt_setting",
                            lambda: self.client.ctrl_transfer(self.handle, 0x01, 0x0B, 0, 0, b""))):
            try:
                call()
            except UsbError as e:
                raise _fail(what, e) from None
        try:
            timing = self.client.status().get("timing")
        except Exception:  # a twin without the field: async transfers complete at once
            timing = None
        self._timing = timing if isinstance(timing, dict) else None

    def close(self) -> None:
        """Close the handle and the connection (tinygrad never does; its process exit does)."""
        self.client.close(self.handle)
        self.client.close_connection()

    # ------------------------------------------------------------------ synchronous transfers
    def control_write(self, request: int, value: int = 0, index: int = 0, data: bytes = b"",
                      timeout: int = 1000) -> None:
        assert len(data) <= len(self._ctrl_mv)
        try:
            n = self.client.ctrl_transfer(self.handle, P.REQTYPE_VENDOR_OUT, request, value, index, bytes(data),
                                          timeout)
        except UsbError as e:
            raise _fail("libusb_control_transfer", e) from None
        assert n == len(data)

    def control_read(self, request: int, length: int, value: int = 0, index: int = 0,
                     timeout: int = 1000) -> memoryview:
        assert length <= len(self._ctrl_mv)
        try:
            data = self.client.ctrl_transfer(self.handle, P.REQTYPE_VENDOR_IN, request, value, index, length, timeout)
        except UsbError as e:
            raise _fail("libusb_control_transfer", e) from None
        assert isinstance(data, bytes) and len(data) == length
        self._ctrl_mv[:length] = data
        return self._ctrl_mv[:length]

    def bulk_write(self, payload: bytes | bytearray | memoryview, timeout: int = 1000) -> None:
        try:
            n = self.client.bulk_write(self.handle, P.EP_BULK_OUT, payload, timeout)
        except UsbError as e:
            raise _fail(f"bulk OUT {P.EP_BULK_OUT:#04x} failed", e) from None
        assert n == len(payload), f"bulk OUT short write: {n}/{len(payload)} bytes"

    def bulk_read(self, length: int, timeout: int = 1000) -> memoryview:
        if length > len(self._bulk_mv):
            self._bulk_buf = bytearray(length)
            self._bulk_mv = memoryview(self._bulk_buf)
        try:
            n = self.client.bulk_read_into(self.handle, P.EP_BULK_IN, self._bulk_mv[:length], timeout)
        except UsbError as e:
            raise _fail(f"bulk IN {P.EP_BULK_IN:#04x} failed", e) from None
        return self._bulk_mv[:n]

    # ------------------------------------------------------------------ async transfers
    def _complete_at(self, pipe: str, nbytes: int, start: float) -> float:
        """When an async transfer of ``nbytes`` on ``pipe`` submitted at ``start`` completes (timing model)."""
        if self._timing is None:
            return 0.0
        mbps, latency_s = self._timing["link_mbps"], self._timing["latency_us"] * 1e-6
        bytes_s = nbytes * 8 / (mbps * 1e6) if mbps else 0.0
        begin = start
        if pipe == "bulk":  # bulk payloads share the link; a control transfer's few bytes slip in between
            begin = max(start, self._link_free)
            self._link_free = begin + bytes_s
        done = max(begin + bytes_s + latency_s, self._pipe_free[pipe])  # a pipe completes in order
        self._pipe_free[pipe] = done
        return done

    def _submit(self, expected: int, run: Any, pipe: str = "control") -> int:
        """Run one async transfer now; latch its failure like tinygrad's ``_on_bulk_done``."""
        if self._gone:
            raise _fail("async submit failed", UsbError(LIBUSB_ERROR_NO_DEVICE))
        tag = next(self._async_seq)
        start = time.monotonic()
        try:
            actual = run()
        except UsbError as e:
            if e.code == LIBUSB_ERROR_NO_DEVICE:
                self._gone = True
            self._async_err = e.transfer_status
            return tag
        self._async_pending[tag] = self._complete_at(pipe, expected, start)
        if actual != expected:
            self._async_err = -1
        return tag

    def bulk_write_async(self, payload: bytes | bytearray | memoryview, timeout: int = 10000) -> int:
        """Queue a bulk OUT; it completes by ``bulk_wait(tag)``."""
        mv = memoryview(payload).cast("B")
        return self._submit(len(mv), lambda: self.client.bulk_write(self.handle, P.EP_BULK_OUT, mv, timeout,
                                                                    is_async=True), pipe="bulk")

    def control_write_async(self, request: int, value: int = 0, index: int = 0, data: bytes = b"",
                            timeout: int = 1000) -> int:
        """Queue a vendor control OUT; completes by ``bulk_wait(tag)``."""
        return self._submit(len(data), lambda: self.client.ctrl_transfer(
            self.handle, P.REQTYPE_VENDOR_OUT, request, value, index, bytes(data), timeout, is_async=True))

    def control_read_async(self, request: int, length: int, value: int = 0, index: int = 0,
                           timeout: int = 1000) -> tuple[int, memoryview]:
        """Queue a vendor control IN; the data is in the returned buffer by ``bulk_wait(tag)``."""
        buf = bytearray(struct.pack("<BBHHH", P.REQTYPE_VENDOR_IN, request, value, index, length)) + bytearray(length)
        out = memoryview(buf)[8:]

        def run() -> int:
            data = self.client.ctrl_transfer(self.handle, P.REQTYPE_VENDOR_IN, request, value, index, length,
                                             timeout, is_async=True)
            assert isinstance(data, bytes)
            out[:len(data)] = data
            return len(data)

        return self._submit(length, run), out

    def bulk_wait(self, tag: int) -> None:
        """Wait for the tagged transfer; raises if any async transfer of this object ever failed."""
        left = self._async_pending.pop(tag, 0.0) - time.monotonic()
        if left > 0:
            time.sleep(left)
        if self._async_err:
            raise RuntimeError(f"async bulk OUT failed: status={self._async_err}")
