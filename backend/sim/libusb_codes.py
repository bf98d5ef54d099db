"""libusb's error codes, names and messages, as the twin's client faces report them.

Sources: libusb 1.0 ``libusb.h`` (``enum libusb_error``, ``enum libusb_transfer_status``) and
``libusb/strerror.c`` (the English messages ``libusb_strerror`` returns, which tinygrad 0.14's
``checked()`` puts after the colon: ``"bulk OUT 0x02 failed: Operation timed out"``).

:class:`UsbError` is what the twin raises for a failed USB transfer; each face turns it into what
its real counterpart raises (tinygrad: ``RuntimeError``; pyusb: ``usb.core.USBError``).
"""

from __future__ import annotations

import errno

# enum libusb_error
LIBUSB_SUCCESS = 0
LIBUSB_ERROR_IO = -1
LIBUSB_ERROR_INVALID_PARAM = -2
LIBUSB_ERROR_ACCESS = -3
LIBUSB_ERROR_NO_DEVICE = -4
LIBUSB_ERROR_NOT_FOUND = -5
LIBUSB_ERROR_BUSY = -6
LIBUSB_ERROR_TIMEOUT = -7
LIBUSB_ERROR_OVERFLOW = -8
LIBUSB_ERROR_PIPE = -9
LIBUSB_ERROR_INTERRUPTED = -10
LIBUSB_ERROR_NO_MEM = -11
LIBUSB_ERROR_NOT_SUPPORTED = -12
LIBUSB_ERROR_OTHER = -99

ERROR_NAMES: dict[int, str] = {
    LIBUSB_SUCCESS: "LIBUSB_SUCCESS", LIBUSB_ERROR_IO: "LIBUSB_ERROR_IO",
    LIBUSB_ERROR_INVALID_PARAM: "LIBUSB_ERROR_INVALID_PARAM", LIBUSB_ERROR_ACCESS: "LIBUSB_ERROR_ACCESS",
    LIBUSB_ERROR_NO_DEVICE: "LIBUSB_ERROR_NO_DEVICE", LIBUSB_ERROR_NOT_FOUND: "LIBUSB_ERROR_NOT_FOUND",
    LIBUSB_ERROR_BUSY: "LIBUSB_ERROR_BUSY", LIBUSB_ERROR_TIMEOUT: "LIBUSB_ERROR_TIMEOUT",
    LIBUSB_ERROR_OVERFLOW: "LIBUSB_ERROR_OVERFLOW", LIBUSB_ERROR_PIPE: "LIBUSB_ERROR_PIPE",
    LIBUSB_ERROR_INTERRUPTED: "LIBUSB_ERROR_INTERRUPTED", LIBUSB_ERROR_NO_MEM: "LIBUSB_ERROR_NO_MEM",
    LIBUSB_ERROR_NOT_SUPPORTED: "LIBUSB_ERROR_NOT_SUPPORTED", LIBUSB_ERROR_OTHER: "LIBUSB_ERROR_OTHER",
}

# libusb_strerror(), English locale (libusb/strerror.c)
STRERROR: dict[int, str] = {
    LIBUSB_SUCCESS: "Success",
    LIBUSB_ERROR_IO: "Input/Output Error",
    LIBUSB_ERROR_INVALID_PARAM: "Invalid parameter",
    LIBUSB_ERROR_ACCESS: "Access denied (insufficient permissions)",
    LIBUSB_ERROR_NO_DEVICE: "No such device (it may have been disconnected)",
    LIBUSB_ERROR_NOT_FOUND: "Entity not found",
    LIBUSB_ERROR_BUSY: "Resource busy",
    LIBUSB_ERROR_TIMEOUT: "Operation timed out",
    LIBUSB_ERROR_OVERFLOW: "Overflow",
    LIBUSB_ERROR_PIPE: "Pipe error",
    LIBUSB_ERROR_INTERRUPTED: "System call interrupted (perhaps due to signal)",
    LIBUSB_ERROR_NO_MEM: "Insufficient memory",
    LIBUSB_ERROR_NOT_SUPPORTED: "Operation not supported or unimplemented on this platform",
    LIBUSB_ERROR_OTHER: "Other error",
}

# errno values pyusb's libusb1 backend attaches to USBError (usb/backend/libusb1.py _libusb_errno)
ERRNO: dict[int, int | None] = {
    LIBUSB_ERROR_IO: errno.EIO, LIBUSB_ERROR_INVALID_PARAM: errno.EINVAL, LIBUSB_ERROR_ACCESS: errno.EACCES,
    LIBUSB_ERROR_NO_DEVICE: errno.ENODEV, LIBUSB_ERROR_NOT_FOUND: errno.ENOENT, LIBUSB_ERROR_BUSY: errno.EBUSY,
    LIBUSB_ERROR_TIMEOUT: errno.ETIMEDOUT, LIBUSB_ERROR_OVERFLOW: errno.EOVERFLOW, LIBUSB_ERROR_PIPE: errno.EPIPE,
    LIBUSB_ERROR_INTERRUPTED: errno.EINTR, LIBUSB_ERROR_NO_MEM: errno.ENOMEM, LIBUSB_ERROR_NOT_SUPPORTED: errno.ENOSYS,
    LIBUSB_ERROR_OTHER: None,
}

# enum libusb_transfer_status (what an async transfer's callback sees; tinygrad latches it in _async_err)
LIBUSB_TRANSFER_COMPLETED = 0
LIBUSB_TRANSFER_ERROR = 1
LIBUSB_TRANSFER_TIMED_OUT = 2
LIBUSB_TRANSFER_CANCELLED = 3
LIBUSB_TRANSFER_STALL = 4
LIBUSB_TRANSFER_NO_DEVICE = 5
LIBUSB_TRANSFER_OVERFLOW = 6

TRANSFER_STATUS: dict[int, int] = {
    LIBUSB_ERROR_TIMEOUT: LIBUSB_TRANSFER_TIMED_OUT, LIBUSB_ERROR_PIPE: LIBUSB_TRANSFER_STALL,
    LIBUSB_ERROR_NO_DEVICE: LIBUSB_TRANSFER_NO_DEVICE, LIBUSB_ERROR_OVERFLOW: LIBUSB_TRANSFER_OVERFLOW,
}
"""libusb error code of a synchronous transfer -> status the same failure gives an async transfer (else ERROR)."""


def strerror(code: int) -> str:
    """``libusb_strerror(code)``: unknown codes give "Other error", as libusb does."""
    return STRERROR.get(code, STRERROR[LIBUSB_ERROR_OTHER])


def error_name(code: int) -> str:
    return ERROR_NAMES.get(code, ERROR_NAMES[LIBUSB_ERROR_OTHER])


class UsbError(Exception):
    """A failed USB operation, as libusb reports it.

    ``code`` is a negative ``LIBUSB_ERROR_*``; ``transferred`` the bytes moved before the failure;
    ``detail`` says what the twin saw (e.g. "endpoint 0x02 halted"). ``str()`` is libusb's message.
    """

    def __init__(self, code: int, detail: str = "", transferred: int = 0) -> None:
        super().__init__(strerror(code))
        self.code = code
        self.detail = detail
        self.transferred = transferred

    @property
    def name(self) -> str:
        return error_name(self.code)

    @property
    def strerror(self) -> str:
        return strerror(self.code)

    @property
    def transfer_status(self) -> int:
        """The ``libusb_transfer_status`` an async transfer failing this way completes with."""
        return TRANSFER_STATUS.get(self.code, LIBUSB_TRANSFER_ERROR)

    def __repr__(self) -> str:
        return f"UsbError({self.name}, {self.detail!r}, transferred={self.transferred})"
