"""Receiving descriptors over a Unix socket (``SCM_RIGHTS``, ``unix(7)``) with the receive flags honoured.

CPython's ``socket.recv_fds`` ignores its ``flags`` argument: it calls ``recvmsg`` without them (3.11 here, still
in 3.13: python/cpython issues #107898 and #128881), so ``MSG_DONTWAIT`` blocks and ``MSG_CMSG_CLOEXEC`` leaves
the received descriptors inheritable by a later ``exec``. :func:`recv_fds` passes them.
"""

from __future__ import annotations

import array
import os
import socket

_INT_BYTES = array.array("i").itemsize


def recv_fds(sock: socket.socket, bufsize: int, maxfds: int, flags: int = 0) -> tuple[bytes, list[int], int]:
    """One message of at most ``bufsize`` bytes and the descriptors it carries, at most ``maxfds`` (more are
    dropped by the kernel, which sets ``MSG_CTRUNC`` in the returned flags): ``(data, fds, msg_flags)``.
    ``flags``: ``recvmsg`` flags, e.g. ``MSG_DONTWAIT`` (raises ``BlockingIOError`` when none is queued) and
    ``MSG_CMSG_CLOEXEC`` (the descriptors close on ``exec``). Raises ``OSError`` as ``recvmsg`` does."""
    # CMSG_LEN, not CMSG_SPACE: the space rounds up to 8 bytes, room for one more descriptor than asked for
    data, ancdata, msg_flags, _addr = sock.recvmsg(bufsize, socket.CMSG_LEN(maxfds * _INT_BYTES), flags)
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % _INT_BYTES])
    for extra in fds[maxfds:]:  # none by the buffer's size; never left open if a kernel gave more
        os.close(extra)
    return data, list(fds[:maxfds]), msg_flags
