"""Loading of the one Cap'n Proto schema, ``msgs/chestnut.capnp``.

``log`` is the loaded schema module: ``log.Event``, ``log.ModelSource``, ``log.Level`` ...
Traversal limits for reads are in :data:`TRAVERSAL_LIMIT_WORDS` (never unbounded; openpilot's
``NO_TRAVERSAL_LIMIT`` is the denial-of-service hole we do not copy).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import capnp

SCHEMA_PATH = Path(__file__).with_name("chestnut.capnp")

capnp.remove_import_hook()
log = capnp.load(str(SCHEMA_PATH))

# 64-bit words a reader may traverse in one message. A 1920x1080x3 frame is ~777k words; the
# default here allows 32 MiB per message, twice the largest frame we publish.
TRAVERSAL_LIMIT_WORDS = 4 * 1024 * 1024
# Largest message a subscriber accepts, bytes (bigger ones are counted and dropped).
MAX_MESSAGE_BYTES = TRAVERSAL_LIMIT_WORDS * 8

SCHEMA_SHA256 = hashlib.sha256(SCHEMA_PATH.read_bytes()).hexdigest()
