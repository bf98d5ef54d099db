"""The twin's socket framing, shared by :mod:`.daemon` and :mod:`.client`.

A Unix stream socket at ``<runtime_dir()>/twin.sock``. One request at a time per connection.

Request: a 24-byte header :data:`REQ` ``<IBBBBHHIII`` = payload_len, op, flags, b0, b1, wValue,
wIndex, handle, length, timeout_ms, then ``payload_len`` raw bytes (control OUT data, bulk OUT data, or
JSON for :data:`OP_ADMIN`).

Response: a 12-byte header :data:`RSP` ``<IiI`` = payload_len, status, value, then the payload (IN
data, JSON, or an error detail in UTF-8). ``status`` 0 is success; a negative status is a libusb error
code (:mod:`.libusb_codes`); :data:`ST_BAD_ARGUMENT` is a rejected argument (``ValueError``);
:data:`ST_BAD_FRAME` means the server could not parse the request and closes the connection.

Per op (b0, b1, wValue, wIndex, length -> value / payload):

- ``OP_OPEN``: b0 = bus, b1 = address -> value = handle
- ``OP_CLOSE``, ``OP_CLAIM``/``OP_RELEASE`` (wIndex = interface), ``OP_CLEAR_HALT`` (b0 = endpoint)
- ``OP_CTRL``: b0 = bmRequestType, b1 = bRequest, wValue, wIndex, length = wLength of an IN transfer;
  payload = OUT data -> IN data, or value = bytes written
- ``OP_BULK_OUT``: b0 = endpoint, payload = data -> value = bytes accepted
- ``OP_BULK_IN``: b0 = endpoint, length -> data
- ``OP_ENUMERATE``, ``OP_ADMIN`` (JSON ``{"cmd": ...}``) -> JSON; ``OP_PING`` -> nothing
"""

from __future__ import annotations

import struct

REQ = struct.Struct("<IBBBBHHIII")
RSP = struct.Struct("<IiI")

OP_PING = 0
OP_ENUMERATE = 1
OP_OPEN = 2
OP_CLOSE = 3
OP_CLAIM = 4
OP_RELEASE = 5
OP_CTRL = 6
OP_BULK_OUT = 7
OP_BULK_IN = 8
OP_CLEAR_HALT = 9
OP_ADMIN = 10
OPS = range(OP_PING, OP_ADMIN + 1)

FLAG_ASYNC = 0x1

ST_OK = 0
ST_BAD_ARGUMENT = 1
ST_BAD_FRAME = 2

MAX_PAYLOAD = (64 << 20) + 4096
"""Longest payload (bytes) of one request or reply on the twin's socket, checked before it is read: the longest
transfer the twin carries, 64 MiB (``twin.py`` ``MAX_STREAM_BYTES``, the 0xF0 stream; ``backend/protocol.py``
``SDMA_MAX_COPY_BYTES``, one SDMA copy; ``libusb_face.py`` ``MAX_URB_BYTES``), plus one 4 KiB page for the fields
that travel with it. A chestnut bound on the twin's own socket, not a USB limit."""
SOCKET_NAME = "twin.sock"
LOG_NAME = "twin.log"
