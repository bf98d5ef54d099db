"""The twin's libusb face: real libusb-1.0 (and tinygrad's own ``USB3`` over it) talks to the twin through an
emulated usbdevfs device node.

The socket face (:mod:`.usb3`, :mod:`.pyusb_backend`) replaces libusb; this face keeps it. Under umockdev
(``umockdev-wrapper`` preloads ``libumockdev-preload.so.0``, which redirects ``/sys`` and ``/dev`` into a
testbed folder), a :class:`LibusbFace` builds a testbed holding the twin's dock as a USB device
(``/sys/bus/usb/devices/<bus>-1`` with ``busnum``, ``devnum``, ``speed``, ``idVendor``, ``idProduct``,
``bConfigurationValue`` and the binary ``descriptors`` file libusb reads instead of asking the device) and
a device node ``/dev/bus/usb/BBB/DDD`` whose ioctls reach ``UsbdevfsHandler`` (a
``UMockdev.IoctlBase`` attached with ``Testbed.attach_ioctl``). The handler answers the usbdevfs ioctls
libusb 1.0.26 sends (``libusb/os/linux_usbfs.c``; numbers and structs from the kernel's
``include/uapi/linux/usbdevice_fs.h``) by making the same requests of the twin daemon its socket face
makes, through :class:`~.client.TwinClient` (one connection and one handle per client that opened the node):

- ``GET_CAPABILITIES``: ``ZERO_PACKET | NO_PACKET_SIZE_LIM | BULK_SCATTER_GATHER``, so libusb sends each
  transfer as one URB; ``GETDRIVER``: ``ENODATA`` (no kernel driver bound: tinygrad's detach is skipped);
  ``GET_SPEED``: the kernel's ``enum usb_device_speed`` (SUPER 5, HIGH 3);
- ``SETCONFIGURATION``, ``CLAIMINTERFACE``, ``RELEASEINTERFACE``, ``SETINTERFACE``, ``CLEAR_HALT``,
  ``RESET``: the twin's set-configuration, claim, release, SET_INTERFACE control request, clear-halt;
- ``SUBMITURB`` (control URBs carry their 8-byte setup packet first; bulk IN ``0x81``, bulk OUT ``0x02``):
  the transfer runs on the twin while the submit ioctl lasts -- a client's memory is reachable only
  inside one of its ioctls -- and its status and ``actual_length`` are written into the URB, which the
  next ``REAPURBNDELAY``/``REAPURB`` hands back (``EAGAIN`` while none is due; umockdev's node always
  polls ready, so libusb busy-polls the reap);
- ``DISCARDURB``: a URB the twin timed out is held, not reaped, until libusb's own timer discards it;
  it is then reaped with ``-ENOENT``, which libusb reports as ``LIBUSB_TRANSFER_TIMED_OUT`` /
  ``LIBUSB_ERROR_TIMEOUT`` ("Operation timed out"). A URB already due answers ``EINVAL``, as the kernel.

Errors as the kernel reports them (``drivers/usb/core/devio.c``): a gone dock fails the ioctl with
``ENODEV`` (libusb: ``LIBUSB_ERROR_NO_DEVICE``); a stall completes the URB with ``-EPIPE``
(``LIBUSB_ERROR_PIPE``), an I/O error with ``-EPROTO`` (``LIBUSB_ERROR_IO``), an overflow with
``-EOVERFLOW``; a short transfer completes with status 0 and a smaller ``actual_length``.

Limits: a URB does not carry libusb's timeout, so the twin is asked with :data:`TWIN_TIMEOUT_MS` (a
transfer the twin NAKs blocks its submit that long; a shorter libusb timeout still ends it as a timeout,
once the submit returns); libusb's asynchronous transfers reach the twin as
ordinary ones (the twin's ``async_error`` fault site never sees them); the testbed holds the devices
enumerated when it was built (:meth:`LibusbFace.refresh` adds a re-plugged dock's new address).
Each forwarded ioctl costs ~0.1-0.2 ms (umockdev's socket round trip, its preload's ``usleep(0)``),
three per transfer (submit, reap, a failed reap) -- see ``docs/protocol.md`` for the measured costs.

Use (re-executes itself under ``umockdev-wrapper`` when the preload is missing; a twin daemon must be
serving ``$CHESTNUT_PREFIX`` or ``--prefix``)::

    chestnut twin libusb probe --real          # any chestnut command line
    python -m chestnut.backend.sim.libusb_face [--prefix P] [--stats] (-m MODULE | -c CODE | SCRIPT) [ARGS...]
    python -m chestnut.backend.sim.libusb_face --check        # "ok", or why umockdev cannot run here

The testbed must exist before the process's first libusb call: tinygrad caches its libusb context
(``USB3.ctx``, ``functools.cache``) and the device list it enumerates with it. Inside the testbed
``/dev`` and ``/sys`` are the testbed's, and umockdev's preload aborts a process that opens ``/dev/..``
(capnp's kj does, once, when it first builds its disk filesystem): :func:`main` loads the project's
capnp schema before it builds the testbed.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import errno
import functools
import os
import runpy
import shutil
import struct
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from chestnut.backend.sim.client import TwinClient
from chestnut.backend.sim.libusb_codes import (
    LIBUSB_ERROR_BUSY,
    LIBUSB_ERROR_INVALID_PARAM,
    LIBUSB_ERROR_IO,
    LIBUSB_ERROR_NO_DEVICE,
    LIBUSB_ERROR_NOT_FOUND,
    LIBUSB_ERROR_OVERFLOW,
    LIBUSB_ERROR_PIPE,
    LIBUSB_ERROR_TIMEOUT,
    UsbError,
)
from chestnut.backend.sim.twin import DeviceInfo
from chestnut.msgs.paths import current_prefix

PRELOAD = "libumockdev-preload.so.0"
WRAPPER = "umockdev-wrapper"
SYSTEM_DIST_PACKAGES = "/usr/lib/python3/dist-packages"   # Debian's python3-gi (gi, and UMockdev's typelib)
TWIN_TIMEOUT_MS = 1000
"""Timeout (ms) the face gives the twin for a URB's transfer: a URB carries no timeout (libusb keeps it),
so a transfer the twin NAKs ends after this, and libusb's own timer then discards the held URB."""


# ---------------------------------------------------------------------- usbdevfs (include/uapi/linux/usbdevice_fs.h)
def _ioc(direction: int, nr: int, size: int) -> int:
    """Linux ``_IOC(dir, 'U', nr, size)`` (``include/uapi/asm-generic/ioctl.h``: nr 8 bits, type 8, size 14,
    dir 2; ``_IOC_WRITE`` 1, ``_IOC_READ`` 2)."""
    return (direction << 30) | (size << 16) | (ord("U") << 8) | nr


_IO, _IOW, _IOR = 0, 1, 2
URB_SIZE = 56             # struct usbdevfs_urb on 64-bit (iso_frame_desc[] empty)
USBDEVFS_SETINTERFACE = _ioc(_IOR, 4, 8)           # struct usbdevfs_setinterface {u32 interface, altsetting}
USBDEVFS_SETCONFIGURATION = _ioc(_IOR, 5, 4)
USBDEVFS_GETDRIVER = _ioc(_IOW, 8, 4 + 256)        # struct usbdevfs_getdriver
USBDEVFS_SUBMITURB = _ioc(_IOR, 10, URB_SIZE)
USBDEVFS_DISCARDURB = _ioc(_IO, 11, 0)
USBDEVFS_REAPURB = _ioc(_IOW, 12, 8)
USBDEVFS_REAPURBNDELAY = _ioc(_IOW, 13, 8)
USBDEVFS_CLAIMINTERFACE = _ioc(_IOR, 15, 4)
USBDEVFS_RELEASEINTERFACE = _ioc(_IOR, 16, 4)
USBDEVFS_RESET = _ioc(_IO, 20, 0)
USBDEVFS_CLEAR_HALT = _ioc(_IOR, 21, 4)
USBDEVFS_GET_CAPABILITIES = _ioc(_IOR, 26, 4)
USBDEVFS_GET_SPEED = _ioc(_IO, 31, 0)
IOCTL_NAMES = {v: k for k, v in globals().items() if k.startswith("USBDEVFS_")}

USBDEVFS_CAP_ZERO_PACKET, USBDEVFS_CAP_NO_PACKET_SIZE_LIM, USBDEVFS_CAP_BULK_SCATTER_GATHER = 0x01, 0x04, 0x08
CAPABILITIES = USBDEVFS_CAP_ZERO_PACKET | USBDEVFS_CAP_NO_PACKET_SIZE_LIM | USBDEVFS_CAP_BULK_SCATTER_GATHER
USBDEVFS_URB_TYPE_CONTROL, USBDEVFS_URB_TYPE_BULK = 2, 3
USB_SPEED_HIGH, USB_SPEED_SUPER = 3, 5   # include/uapi/linux/usb/ch9.h enum usb_device_speed
MAX_URB_BYTES = 64 << 20                 # longest URB buffer the face reads from a client (bounded read)


# a twin UsbError -> (the ioctl's errno, or the URB's negative completion status)
_SUBMIT_ERRNO = {LIBUSB_ERROR_NO_DEVICE: errno.ENODEV, LIBUSB_ERROR_INVALID_PARAM: errno.EINVAL,
                 LIBUSB_ERROR_NOT_FOUND: errno.ENOENT, LIBUSB_ERROR_BUSY: errno.EBUSY}
_URB_STATUS = {LIBUSB_ERROR_PIPE: -errno.EPIPE, LIBUSB_ERROR_IO: -errno.EPROTO, LIBUSB_ERROR_OVERFLOW: -errno.EOVERFLOW}


def unavailable() -> str | None:
    """Why the libusb face cannot run here (one line), or None when it can: it needs ``umockdev-wrapper``,
    umockdev's preload library, libusb-1.0 and PyGObject with the ``UMockdev`` 1.0 typelib (Debian:
    ``apt-get install umockdev libumockdev0 gir1.2-umockdev-1.0 python3-gi libusb-1.0-0``)."""
    if shutil.which(WRAPPER) is None:
        return f"{WRAPPER} is not installed (apt-get install umockdev)"
    if ctypes.util.find_library("usb-1.0") is None:
        return "libusb-1.0 is not installed (apt-get install libusb-1.0-0)"
    try:
        _umockdev()
    except ImportError as e:
        return f"PyGObject with umockdev's typelib is not importable by {sys.executable}: {e}"
    return None


def _umockdev() -> tuple[Any, Any]:
    """``(UMockdev, GLib)`` from PyGObject. The venv may lack ``gi``; Debian's python3-gi (built for the
    system python, same minor version) is then appended to ``sys.path``, after everything else.
    Raises ImportError."""
    try:
        import gi
    except ImportError:
        if not os.path.isdir(os.path.join(SYSTEM_DIST_PACKAGES, "gi")):
            raise ImportError("no module gi (apt-get install python3-gi)") from None
        sys.path.append(SYSTEM_DIST_PACKAGES)
        import gi
    try:
        gi.require_version("UMockdev", "1.0")
    except ValueError as e:
        raise ImportError(f"{e} (apt-get install gir1.2-umockdev-1.0)") from None
    from gi.repository import GLib, UMockdev
    return UMockdev, GLib


def preloaded() -> bool:
    """True when umockdev's preload library is in this process (``$LD_PRELOAD`` names it)."""
    return PRELOAD.split(".so")[0] in os.environ.get("LD_PRELOAD", "")


# ---------------------------------------------------------------------- URB bookkeeping
@dataclass
class _Urb:
    addr: int          # the URB's address in the client
    status: int        # completion status written into it (0, -EPIPE, -ENOENT ...)
    actual: int


@dataclass
class _ClientState:
    """One client of the device node (one open file of one process): its twin connection and handle."""

    twin: TwinClient
    handle: int
    due: deque[_Urb] = field(default_factory=deque)        # completed, to be reaped in order
    held: dict[int, _Urb] = field(default_factory=dict)    # timed out by the twin, until libusb discards them


@dataclass
class FaceStats:
    """Counts since the face was built: ioctls forwarded (by name), URBs completed, bytes moved."""

    ioctls: dict[str, int] = field(default_factory=dict)
    urbs: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


def _pointer(arg: Any) -> int:
    """The ioctl's argument as a client address (a ``void *``)."""
    return int(struct.unpack_from("<Q", bytes(arg.retrieve()).ljust(8, b"\0"))[0])


def _fetch(arg: Any, size: int) -> bytes:
    """The ``size`` bytes the ioctl's argument points to, read from the client."""
    return bytes(arg.resolve(0, size).retrieve())


@functools.cache
def _handler_class(UMockdev: Any) -> type:
    """``UsbdevfsHandler``, the ``UMockdev.IoctlBase`` subclass (made once, when PyGObject is importable:
    a GType is registered once per process)."""

    class UsbdevfsHandler(UMockdev.IoctlBase):  # type: ignore[misc,valid-type]
        """Answers one device node's usbdevfs ioctls (see the module docstring), in umockdev's worker thread."""

        def __init__(self, face: LibusbFace, devnode: str, info: DeviceInfo) -> None:
            super().__init__()
            self.face, self.devnode, self.info = face, devnode, info
            self.clients: dict[int, _ClientState] = {}   # hash(client): a wrapper's id() changes per call
            self.lock = threading.Lock()

        def do_handle_ioctl(self, client: Any) -> bool:
            request = client.get_request() & 0xFFFFFFFF
            with self.lock:
                name = IOCTL_NAMES.get(request, f"{request:#x}")
                stats = self.face.stats
                stats.ioctls[name] = stats.ioctls.get(name, 0) + 1
                try:
                    result, err = self._ioctl(client, request)
                except UsbError as e:
                    result, err = -1, _SUBMIT_ERRNO.get(e.code, errno.EIO)
                    if e.code == LIBUSB_ERROR_NO_DEVICE:
                        self.face.gone(self.devnode)
                except Exception as e:  # never let an exception reach GLib: the client would hang
                    self.face.log(f"libusb face: {name} failed: {type(e).__name__}: {e}")
                    result, err = -1, errno.EIO
            client.complete(result, err)
            return True

        def do_client_vanished(self, client: Any) -> None:
            with self.lock:
                st = self.clients.pop(hash(client), None)
            if st is not None:
                st.twin.close(st.handle)
                st.twin.close_connection()

        def close_all(self) -> None:
            with self.lock:
                states, self.clients = list(self.clients.values()), {}
            for st in states:
                st.twin.close(st.handle)
                st.twin.close_connection()

        def _state(self, client: Any) -> _ClientState:
            key = hash(client)
            st = self.clients.get(key)
            if st is None:
                twin = self.face.connect()
                try:
                    handle = twin.open(self.info.bus, self.info.address)
                except BaseException:
                    twin.close_connection()
                    raise
                st = self.clients[key] = _ClientState(twin, handle)
            return st

        def _ioctl(self, client: Any, request: int) -> tuple[int, int]:
            # the argument is the ioctl's third parameter itself (8 bytes); what it points to is fetched
            # from the client with resolve(0, size), which also rewrites it to point to the local copy
            arg = client.get_arg()
            if request == USBDEVFS_GET_CAPABILITIES:
                arg.resolve(0, 4).update(0, struct.pack("<I", CAPABILITIES))
                return 0, 0
            if request == USBDEVFS_GETDRIVER:
                return -1, errno.ENODATA
            if request == USBDEVFS_GET_SPEED:
                return (USB_SPEED_SUPER if self.info.speed_mbps >= 5000 else USB_SPEED_HIGH), 0
            st = self._state(client)
            if request == USBDEVFS_SUBMITURB:
                return self._submit(st, arg)
            if request in (USBDEVFS_REAPURBNDELAY, USBDEVFS_REAPURB):
                if not st.due:
                    return -1, errno.EAGAIN
                urb = st.due.popleft()
                arg.resolve(0, 8).update(0, struct.pack("<Q", urb.addr))
                return 0, 0
            if request == USBDEVFS_DISCARDURB:
                addr = _pointer(arg)
                if addr not in st.held:
                    return -1, errno.EINVAL
                urb = st.held.pop(addr)
                st.due.append(urb)
                return 0, 0
            if request == USBDEVFS_SETCONFIGURATION:
                (config,) = struct.unpack("<i", _fetch(arg, 4))
                st.twin.set_configuration(st.handle, config)
                return 0, 0
            if request in (USBDEVFS_CLAIMINTERFACE, USBDEVFS_RELEASEINTERFACE):
                (intf,) = struct.unpack("<I", _fetch(arg, 4))
                call = st.twin.claim_interface if request == USBDEVFS_CLAIMINTERFACE else st.twin.release_interface
                call(st.handle, intf)
                return 0, 0
            if request == USBDEVFS_SETINTERFACE:
                intf, alt = struct.unpack("<II", _fetch(arg, 8))
                st.twin.ctrl_transfer(st.handle, 0x01, 0x0B, alt, intf, b"", TWIN_TIMEOUT_MS)
                return 0, 0
            if request == USBDEVFS_CLEAR_HALT:
                (ep,) = struct.unpack("<I", _fetch(arg, 4))
                st.twin.clear_halt(st.handle, ep & 0xFF)
                return 0, 0
            if request == USBDEVFS_RESET:
                return 0, 0
            self.face.log(f"libusb face: unsupported ioctl {request:#x}: errno.ENOTTY")
            return -1, errno.ENOTTY

        def _submit(self, st: _ClientState, ptr: Any) -> tuple[int, int]:
            urb_addr = _pointer(ptr)            # read before resolve(): it rewrites the pointer
            arg = ptr.resolve(0, URB_SIZE)
            raw = bytes(arg.retrieve())
            utype, endpoint = raw[0], raw[1]
            (length,) = struct.unpack_from("<i", raw, 24)
            if not 0 <= length <= MAX_URB_BYTES:
                return -1, errno.EINVAL
            buf = arg.resolve(16, length) if length else None
            status, actual, data_in = 0, 0, b""
            stats = self.face.stats
            try:
                if utype == USBDEVFS_URB_TYPE_CONTROL:
                    if length < 8 or buf is None:
                        return -1, errno.EINVAL
                    setup = bytes(buf.retrieve())
                    rtype, req, value, index, wlen = struct.unpack_from("<BBHHH", setup)
                    if 8 + wlen > length:
                        return -1, errno.EINVAL
                    if rtype & 0x80:
                        got = st.twin.ctrl_transfer(st.handle, rtype, req, value, index, wlen, TWIN_TIMEOUT_MS)
                        assert isinstance(got, bytes)
                        data_in, actual = b"\0" * 8 + got, len(got)
                    else:
                        n = st.twin.ctrl_transfer(st.handle, rtype, req, value, index, setup[8:8 + wlen],
                                                  TWIN_TIMEOUT_MS)
                        assert isinstance(n, int)
                        actual = n
                        stats.bytes_out += n
                elif utype == USBDEVFS_URB_TYPE_BULK:
                    if endpoint & 0x80:
                        got = st.twin.bulk_read(st.handle, endpoint, length, TWIN_TIMEOUT_MS)
                        data_in, actual = got, len(got)
                    else:
                        payload = bytes(buf.retrieve()) if buf is not None else b""
                        actual = st.twin.bulk_write(st.handle, endpoint, payload, TWIN_TIMEOUT_MS)
                        stats.bytes_out += actual
                else:
                    return -1, errno.EINVAL
            except UsbError as e:
                if e.code == LIBUSB_ERROR_TIMEOUT:   # hold it: libusb's timer discards it, then it reaps -errno.ENOENT
                    urb = _Urb(urb_addr, -errno.ENOENT, max(0, e.transferred or 0))
                    st.held[urb_addr] = urb
                    arg.update(4, struct.pack("<i", urb.status))
                    arg.update(28, struct.pack("<i", urb.actual))
                    return 0, 0
                if e.code not in _URB_STATUS:
                    raise                              # NO_DEVICE & co.: the submit itself fails
                status, actual = _URB_STATUS[e.code], max(0, e.transferred or 0)
            if data_in and buf is not None:
                buf.update(0, data_in[:length])
                stats.bytes_in += len(data_in) - (8 if utype == USBDEVFS_URB_TYPE_CONTROL else 0)
            arg.update(4, struct.pack("<i", status))
            arg.update(28, struct.pack("<i", actual))
            st.due.append(_Urb(urb_addr, status, actual))
            stats.urbs += 1
            return 0, 0

    return UsbdevfsHandler


class LibusbFace:
    """A umockdev testbed showing the twin daemon of ``prefix`` (default ``$CHESTNUT_PREFIX``) to libusb.

    Build it before the process's first libusb call, in a process run under ``umockdev-wrapper``; it lasts
    until :meth:`close`. Raises RuntimeError with one line when umockdev cannot run (:func:`unavailable`)
    or no twin daemon answers."""

    def __init__(self, prefix: str | None = None, *, quiet: bool = False) -> None:
        why = unavailable()
        if why is not None:
            raise RuntimeError(f"the libusb face cannot run: {why}")
        if not preloaded():
            raise RuntimeError(f"the libusb face needs {PRELOAD} preloaded: run the process under {WRAPPER}")
        UMockdev, _ = _umockdev()
        self.prefix = current_prefix() if prefix is None else prefix
        self.quiet = quiet
        self.stats = FaceStats()
        self._handler_cls = _handler_class(UMockdev)
        self._handlers: dict[str, Any] = {}
        self.testbed = UMockdev.Testbed.new()
        try:
            self.refresh()
        except BaseException:
            self.close()
            raise

    def log(self, line: str) -> None:
        if not self.quiet:
            print(line, file=sys.stderr, flush=True)

    def gone(self, devnode: str) -> None:
        """The twin said its dock is gone: remove the node, as the kernel does at a disconnect, so a later
        ``libusb_open`` fails ``LIBUSB_ERROR_NO_DEVICE``. Open clients keep their file (and get ENODEV)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root + devnode)

    def connect(self) -> TwinClient:
        """A new connection to the twin daemon (raises :class:`~.client.TwinNotRunning`)."""
        return TwinClient(self.prefix)

    @property
    def root(self) -> str:
        """The testbed's folder (``$UMOCKDEV_DIR``, under ``$TMPDIR``)."""
        return str(self.testbed.get_root_dir())

    def refresh(self) -> list[str]:
        """Add every dock the twin enumerates now and the testbed lacks; returns the new device nodes.
        Raises RuntimeError when no twin daemon answers."""
        try:
            with self.connect() as c:
                found = c.enumerate()
        except (OSError, ValueError) as e:   # TwinNotRunning, a bad prefix or runtime folder
            raise RuntimeError(f"the libusb face found no twin: {e}") from None
        added = []
        for info in found:
            devnode = f"/dev/bus/usb/{info.bus:03d}/{info.address:03d}"
            if devnode in self._handlers:
                continue
            name = f"{info.bus}-{len(self._handlers) + 1}"
            # sysfs text attributes end in a newline, as the kernel's do; "dev" (usb_device major 189, minor
            # (bus - 1) * 128 + address - 1: drivers/usb/core/usb.c) makes umockdev create the node
            attrs = [a for k, v in (("busnum", info.bus), ("devnum", info.address), ("speed", info.speed_mbps),
                                    ("idVendor", f"{info.vid:04x}"), ("idProduct", f"{info.pid:04x}"),
                                    ("bConfigurationValue", 1),
                                    ("dev", f"189:{(info.bus - 1) * 128 + info.address - 1}"))
                     for a in (k, f"{v}\n")]
            props = ["DEVNAME", devnode[len("/dev/"):],   # relative to /dev, as in the kernel's uevent
                      "DEVTYPE", "usb_device", "BUSNUM", f"{info.bus:03d}",
                     "DEVNUM", f"{info.address:03d}", "PRODUCT", f"{info.vid:x}/{info.pid:x}/100"]
            syspath = self.testbed.add_device("usb", name, None, attrs, props)
            if syspath is None:
                raise RuntimeError(f"umockdev could not add the USB device {name}")
            self.testbed.set_attribute_binary(syspath, "descriptors",
                                              list(info.device_descriptor + info.config_descriptor))
            # add_device records the node's major:minor but creates no file (only add_from_string's "N:" lines
            # do); a USB node is a plain file there, its ioctls go to the attached handler
            node = self.root + devnode
            os.makedirs(os.path.dirname(node), mode=0o700, exist_ok=True)
            os.close(os.open(node, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            handler = self._handler_cls(self, devnode, info)
            if not self.testbed.attach_ioctl(devnode, handler):
                raise RuntimeError(f"umockdev could not attach an ioctl handler to {devnode}")
            self._handlers[devnode] = handler
            added.append(devnode)
        return added

    def close(self) -> None:
        """Detach the handlers, close their twin handles and remove the testbed (its folder goes)."""
        for devnode, handler in list(self._handlers.items()):
            with contextlib.suppress(Exception):
                self.testbed.detach_ioctl(devnode)
            handler.close_all()
        self._handlers.clear()
        self.testbed = None

    def __enter__(self) -> LibusbFace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- entry point
ACTIVE: LibusbFace | None = None
"""The face :func:`main` built for the code it runs (for its :attr:`~LibusbFace.stats`)."""
USAGE = ("usage: python -m chestnut.backend.sim.libusb_face [--prefix P] [--stats] (-m MODULE | -c CODE | SCRIPT) "
         "[ARGS...] | --check")


def _set_active(face: LibusbFace | None) -> None:
    """Set :data:`ACTIVE` here and in the importable module (``python -m`` runs this file as ``__main__``)."""
    global ACTIVE
    ACTIVE = face
    if __name__ != "chestnut.backend.sim.libusb_face":
        import chestnut.backend.sim.libusb_face as importable
        importable.ACTIVE = face


def main(argv: list[str] | None = None) -> int:
    """Run a Python module or script in this process over the libusb face (re-executing under
    ``umockdev-wrapper`` first when the preload is missing). Returns its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    prefix, show_stats = None, False
    while args and args[0] in ("--prefix", "--stats"):
        if args[0] == "--stats":
            show_stats = True
            args.pop(0)
            continue
        if len(args) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        prefix = args[1]
        del args[:2]
    if args == ["--check"]:
        why = unavailable()
        print(why or "ok")
        return 0 if why is None else 3
    if not args or (args[0] in ("-m", "-c") and len(args) < 2) or (args[0].startswith("-")
                                                                   and args[0] not in ("-m", "-c")):
        print(USAGE, file=sys.stderr)
        return 2
    why = unavailable()
    if why is not None:
        print(f"libusb face: {why}", file=sys.stderr)
        return 3
    if not preloaded():
        wrapper = shutil.which(WRAPPER)
        assert wrapper is not None
        os.execv(wrapper, [wrapper, sys.executable, "-m", "chestnut.backend.sim.libusb_face",
                           *(["--prefix", prefix] if prefix is not None else []),
                           *(["--stats"] if show_stats else []), *args])
    # capnp's kj opens "/dev/.." once, when it builds its disk filesystem (kj/filesystem-disk-unix.c++), and
    # umockdev's preload aborts the process on that path inside a testbed: load the project's schema first
    import chestnut.msgs.schema  # noqa: F401
    try:
        face = LibusbFace(prefix)
        _set_active(face)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 3
    rc: int = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<libusb face -c>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        if show_stats:
            print(f"libusb face: {face.stats}", file=sys.stderr)
        face.close()
        _set_active(None)
    return rc


if __name__ == "__main__":
    sys.exit(main())
