"""Log segments: writers and readers of the two on-disk formats.

**Layout** (openpilot's route / segment naming): ``<log_dir>/<route>--<n>/<name>.zst`` and
``<log_dir>/<route>--<n>/<name>.mcap``. ``route`` is the UTC start time ``YYYY-MM-DD--HH-MM-SS``
(``-2``, ``-3`` ... appended if that route already exists), ``n`` counts segments from 0, ``name`` is
``rlog`` (every logged message) or ``qlog`` (the light log: every ``decimation``-th message of a
service, :data:`chestnut.msgs.services.SERVICE_LIST`). The first message of every file is an
``initData`` header (package versions, hostname, schema sha256, wall time, segment length, config). Right
after it, a segment after the first repeats the most recent message of each :data:`CARRIED_SERVICES` service
written before it (the node's ``initData``: its configuration), byte for byte with its own ``logMonoTime``, and
the header's config lists them under :data:`CARRIED_KEY`, so a segment read alone has the run's configuration
(:class:`RouteWriter`).

**rlog** (``.zst``, openpilot's layout): one zstd frame holding the concatenation of ``Event``
messages, each in standard unpacked Cap'n Proto framing (segment table + segments, pycapnp
``to_bytes()``). Written by the ``zstandard`` library in streaming mode.

**MCAP** (``.mcap``, the ``mcap`` package): message and schema encoding ``capnproto`` (MCAP format
registry); one schema named ``chestnut.capnp:Event`` (the root struct's ``displayName``) whose data
is the binary ``CodeGeneratorRequest`` of ``msgs/chestnut.capnp``; one channel per service with
topic = service name; ``log_time = publish_time = logMonoTime + unix_offset_ns``: Unix time in ns
(``msgs/clock.py``; the offset is taken once per route and kept in every ``initData`` config and the MCAP
``chestnut`` metadata, so a reader gets the monotonic ``logMonoTime`` back from the event); zstd chunks.
With ``mcap_encodings`` containing ``"json"``, the file also (or only) carries the JSON channels Foxglove
decodes (``jsonschema`` schemas generated from the Cap'n Proto schema, :mod:`chestnut.msgs.jsonschema`);
readers here skip them. ``chestnut record`` writes JSON-only MCAP next to an rlog (README "Foxglove").

**Crash bound**: a writer flushes (zstd ``FLUSH_BLOCK`` / a finished MCAP chunk, then the file
object) once :data:`FLUSH_EVERY_MESSAGES` messages are pending or :data:`FLUSH_INTERVAL_S` seconds
have passed since the last flush, checked on every write and on every :meth:`RouteWriter.tick`. A
killed process therefore loses at most the messages of its last ``min(N messages, T s + the tick
period)`` (defaults: 100 messages, 1 s + 0.1 s for ``chestnut record``), plus the OS page cache on
power loss unless ``fsync`` is on. Closed segments are complete: the zstd frame is ended and the
MCAP summary and footer are written.

**Reading**: :class:`LogReader` yields ``(logMonoTime, service, event)`` in time order across
segments; a truncated or corrupt file yields everything before the damage and reports it as a
:class:`LogDamage` (file, byte offset, reason). Every message is validated by
:func:`chestnut.msgs.messaging.log_from_bytes` (bounded traversal limit).

**Schema data without a system ``capnp``**: :func:`code_generator_request` builds the request from
the schema nodes pycapnp's parser already holds, typed by the ``schema.capnp`` that ships inside the
pycapnp wheel, so a fresh machine needs nothing beyond ``pip install pycapnp``. Its nodes equal
those of ``capnp compile -o- chestnut.capnp`` (capnp 0.9.2) except for the source byte ranges
(``startByte``/``endByte``, filled here) and the optional ``sourceInfo`` (doc comments, omitted).
"""

from __future__ import annotations

import abc
import base64
import contextlib
import heapq
import importlib.metadata
import itertools
import json
import logging
import os
import platform
import socket
import stat
import struct
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import capnp
import zstandard as zstd
from mcap.exceptions import McapError
from mcap.records import Channel, Chunk, Message, Schema
from mcap.stream_reader import StreamReader, breakup_chunk
from mcap.well_known import MessageEncoding, SchemaEncoding
from mcap.writer import MCAP0_MAGIC, CompressionType
from mcap.writer import Writer as _McapWriter

from chestnut.msgs.clock import UNIX_OFFSET_KEY
from chestnut.msgs.clock import unix_offset_ns as unix_offset_ns_now
from chestnut.msgs.frames import frame_to_array
from chestnut.msgs.jsonschema import (
    TOPIC_IMAGE,
    TOPIC_VIDEO,
    DerivedState,
    all_topic_schemas,
    compressed_video,
    event_to_json,
    foxglove_messages,
)
from chestnut.msgs.messaging import REASON_UNKNOWN_MEMBER, MalformedMessageError, log_from_bytes, new_message
from chestnut.msgs.outdir import DIR_MODE, open_private, os_reason, private_dir
from chestnut.msgs.schema import MAX_MESSAGE_BYTES, SCHEMA_PATH, SCHEMA_SHA256, log
from chestnut.msgs.services import SERVICE_LIST
from chestnut.msgs.video import (
    FoxgloveVideoThread,
    NotRegularFileError,
    SegmentVideo,
    VideoOptions,
    file_kind,
    open_regular,
    pixels_crc32,
    preview,
    video_event,
)

__all__ = [
    "CARRIED_KEY",
    "CARRIED_SERVICES",
    "FLUSH_EVERY_MESSAGES",
    "FLUSH_INTERVAL_S",
    "FORMATS",
    "MCAP_ENCODINGS",
    "MCAP_SCHEMA_NAME",
    "SEGMENT_SECONDS",
    "FlushPolicy",
    "LogDamage",
    "LogPathError",
    "LogReader",
    "McapSegmentWriter",
    "RlogSegmentWriter",
    "RouteWriter",
    "SegmentFileReader",
    "carried_items",
    "code_generator_request",
    "find_log_files",
    "first_item",
    "framed_message_size",
    "holds_only_json",
    "init_data_event",
    "json_only_fix",
    "new_route_name",
    "package_versions",
    "parse_segment_dir",
]

SEGMENT_SECONDS = 60.0  # s, nominal segment length (openpilot's loggerd uses 60 s segments)
FLUSH_EVERY_MESSAGES = 100  # flush once this many messages are pending ...
FLUSH_INTERVAL_S = 1.0  # ... or this many seconds have passed since the last flush
ZSTD_LEVEL = 3  # zstd's own default level: ~2 MB/s of 20 Hz frames costs a few % of one core
MCAP_CHUNK_BYTES = 1024 * 1024  # uncompressed MCAP chunk size before it is closed (mcap's default)
FORMATS = ("zst", "mcap")  # file suffixes of the two formats
MCAP_ENCODINGS = ("capnproto", "json")  # MCAP message encodings of our channels (MCAP format registry)
LOG_NAMES = ("rlog", "qlog")  # full log, light (decimated) log
MCAP_SCHEMA_NAME = "chestnut.capnp:Event"  # MCAP registry: the root struct node's displayName
MCAP_LIBRARY = "chestnut"
SCHEMA_FILE_NAME = SCHEMA_PATH.name  # "chestnut.capnp", the displayName of the schema's file node

READ_CHUNK_BYTES = 32 * 1024  # compressed bytes read from the file per step
FEED_BYTES = 512
"""Compressed bytes given to the zstd decoder at once. zstd's output per input byte is unbounded in effect: an
RLE block's 3-byte header stands for up to 128 KiB (RFC 8878 3.1.1.2), so 32 KiB of planted input could come
back as 1 GiB in one call. 512 bytes bound one step's output to ~22 MiB, which the parser consumes (and the
damage limit ends a file of nonsense) before the next step."""
CAPNP_MAX_SEGMENTS = 512  # segment-table limit (libcapnp's readMessage refuses more)
MCAP_RECORD_LIMIT_BYTES = 2 * MAX_MESSAGE_BYTES + MCAP_CHUNK_BYTES  # one chunk: <= chunk size + one message
MAX_DAMAGE_PER_FILE = 100  # a file this damaged is abandoned after its 100th report
DEFAULT_REORDER_WINDOW_NS = 1_000_000_000  # ns of logMonoTime a file may be out of order by
CARRIED_SERVICES = ("initData",)
"""Services whose most recent message written to a route begins every later segment again (:class:`RouteWriter`),
as openpilot's loggerd writes its ``init_data`` at the start of every segment (``system/loggerd/logger.cc``
``LoggerState::next``: ``write(init_data.asBytes(), true)`` after opening each segment's rlog and qlog). Here the
configuration is the node's, published on the bus as ``initData`` (at its start and every 10 s: ``node/main.py``
``INIT_DATA_PERIOD_S``), so a segment whose span had none would otherwise be judged by ``chestnut check`` and
``replay`` against ``launch/node.toml``'s defaults. One publisher per service and prefix (the publisher lock,
``msgs/messaging.py`` ``take_pub_lock``), so the most recent per service is the most recent of its publisher."""
CARRIED_KEY = "carried"
"""The key of a segment header's config that lists the messages repeated after it: ``[[service, logMonoTime ns],
...]`` (absent when none is), so a reader tells a repeated copy from a message published in the segment."""

_log = logging.getLogger("chestnut.logs")

VERSIONED_PACKAGES = ("chestnut", "tinygrad", "pycapnp", "pyzmq", "zstandard", "mcap", "numpy")


# ---------------------------------------------------------------- schema data for MCAP


@cache
def _schema_capnp() -> Any:
    """pycapnp's bundled ``capnp/schema.capnp`` (the types of ``CodeGeneratorRequest``), own parser."""
    pkg_dir = Path(capnp.__file__).parent
    parser = capnp.SchemaParser()
    return parser.load(str(pkg_dir / "schema.capnp"), imports=[str(pkg_dir.parent)])


def _collect_nodes(parsed: Any, nodes: dict[int, Any]) -> None:
    """Add ``parsed``'s schema node, its nested declarations and its group nodes to ``nodes``."""
    node = parsed.node
    if node.id in nodes:
        return
    nodes[node.id] = node
    for nested in parsed.get_proto().nestedNodes:
        _collect_nodes(parsed.get_nested(nested.name), nodes)
    if node.which() == "struct":
        for field in parsed.as_struct().fields.values():
            if field.proto.which() == "group":
                _collect_nodes(field.schema, nodes)


def _referenced_ids(node: Any) -> Iterator[int]:
    """Type ids that the fields of a struct node refer to (struct, enum, interface; through lists)."""
    if node.which() != "struct":
        return
    for field in node.struct.fields:
        if field.which() != "slot":
            continue
        typ = field.slot.type
        while typ.which() == "list":
            typ = typ.list.elementType
        kind = typ.which()
        if kind in ("struct", "enum", "interface"):
            yield getattr(typ, kind).typeId


@cache
def code_generator_request() -> bytes:
    """The binary ``CodeGeneratorRequest`` of ``msgs/chestnut.capnp`` (unpacked Cap'n Proto bytes).

    What ``capnp compile -o- chestnut.capnp`` writes, built from pycapnp's parsed nodes: every node
    of the file (file, structs, enums, nested declarations, groups), ``requestedFiles`` = the schema
    file with its ``displayName``, ``capnpVersion`` = the libcapnp pycapnp is built on. Raises
    ``ValueError`` if the schema refers to a type outside its own file (imports are not bundled).
    """
    sc = _schema_capnp()
    nodes: dict[int, Any] = {}
    _collect_nodes(log.schema, nodes)
    for node in nodes.values():
        for type_id in _referenced_ids(node):
            if type_id not in nodes:
                raise ValueError(f"{node.displayName} refers to type id {type_id:#x} outside {SCHEMA_FILE_NAME}")
    file_node = log.schema.node
    if file_node.displayName != SCHEMA_FILE_NAME:
        raise ValueError(f"schema file node is named {file_node.displayName!r}, expected {SCHEMA_FILE_NAME!r}")
    req = sc.CodeGeneratorRequest.new_message()
    out = req.init("nodes", len(nodes))
    for i, node in enumerate(nodes.values()):
        # The parsed nodes are typed by pycapnp's compiled-in schema.capnp; a copy through bytes
        # re-types them as the loaded schema.capnp's Node so they can be set into the list.
        with sc.Node.from_bytes(node.as_builder().to_bytes()) as copy:
            out[i] = copy
    requested = req.init("requestedFiles", 1)[0]
    requested.id = file_node.id
    requested.filename = SCHEMA_FILE_NAME
    version = req.capnpVersion
    version.major = capnp.version.LIBCAPNP_VERSION_MAJOR
    version.minor = capnp.version.LIBCAPNP_VERSION_MINOR
    version.micro = capnp.version.LIBCAPNP_VERSION_MICRO
    return req.to_bytes()


# ---------------------------------------------------------------- the initData header


def package_versions() -> dict[str, str]:
    """Installed versions of the packages that shape a log: name -> version ("absent" if missing)."""
    return dict(_package_versions())


@cache
def _package_versions() -> tuple[tuple[str, str], ...]:
    versions = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    versions["libcapnp"] = (
        f"{capnp.version.LIBCAPNP_VERSION_MAJOR}.{capnp.version.LIBCAPNP_VERSION_MINOR}."
        f"{capnp.version.LIBCAPNP_VERSION_MICRO}"
    )
    versions["python"] = platform.python_version()
    return tuple(versions.items())


def init_data_event(segment_seconds: float, config: dict[str, Any] | None = None) -> bytes:
    """The serialized ``initData`` header of a log file (``Event`` bytes, logMonoTime = now in ns).

    ``config`` is stored as JSON (keys sorted); versions from :func:`package_versions`.
    """
    msg = new_message("initData")
    init = msg.initData
    versions = package_versions()
    kvs = init.init("versions", len(versions))
    for kv, (key, value) in zip(kvs, versions.items(), strict=True):
        kv.key = key
        kv.value = value
    init.config = json.dumps(config or {}, sort_keys=True)
    init.hostname = socket.gethostname()
    init.wallTimeNanos = time.time_ns()
    init.schemaHash = SCHEMA_SHA256
    init.segmentSeconds = float(segment_seconds)
    return msg.to_bytes()


def carried_items(init_data: Any) -> frozenset[tuple[str, int]]:
    """The messages a segment header says were repeated after it (:data:`CARRIED_KEY`): ``(service,
    logMonoTime ns)`` pairs, from an ``initData`` reader (``Event.initData``). Empty for any other ``initData``
    (the node's, a header from before this key, a config that is not JSON or lists something else)."""
    try:
        config = json.loads(init_data.config or "{}")
    except (ValueError, UnicodeDecodeError):
        return frozenset()
    listed = config.get(CARRIED_KEY) if isinstance(config, dict) else None
    if not isinstance(listed, list):
        return frozenset()
    return frozenset(
        (item[0], item[1]) for item in listed
        if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and type(item[1]) is int
    )


# ---------------------------------------------------------------- segment file writers


@dataclass(frozen=True)
class FlushPolicy:
    """When a segment writer flushes: ``every_messages`` pending messages or ``interval_s`` seconds.

    ``fsync`` also forces the data to the disk on every flush (survives power loss; costs latency).
    """

    every_messages: int = FLUSH_EVERY_MESSAGES
    interval_s: float = FLUSH_INTERVAL_S
    fsync: bool = False

    def __post_init__(self) -> None:
        if self.every_messages < 1 or not self.interval_s > 0:
            raise ValueError(f"flush policy needs every_messages >= 1 and interval_s > 0, got {self}")


class _SegmentFileWriter(abc.ABC):
    """One log file; the flush bookkeeping shared by both formats. ``clock`` is in seconds."""

    def __init__(self, path: Path, policy: FlushPolicy, clock: Callable[[], float]) -> None:
        self.path = Path(path)
        self.policy = policy
        self._clock = clock
        self._pending = 0
        self._last_flush_s = clock()
        self.messages = 0
        self.closed = False
        self._made: tuple[int, int] | None = None  # (device, inode) of the file this writer created

    def _created(self, fh: Any) -> None:
        """Remember ``fh``, the file this writer has just created, by its device and inode (:meth:`discard`)."""
        st = os.fstat(fh.fileno())
        self._made = (st.st_dev, st.st_ino)

    def discard(self) -> None:
        """Close the file unfinished and remove it, for a file that could not start (a full disk): only the file
        this writer created, never what has taken its path since (:func:`_remove_made`). Errors here are not
        raised: the failure being handled is the one to report."""
        self.closed = True
        with contextlib.suppress(Exception):  # the file's own error (ENOSPC) again, as it is closed
            self._abandon()
        _remove_made(self.path, self._made)

    def write(self, service: str, log_mono_time_ns: int, data: bytes, pixels: Any = None) -> None:
        """Append one serialized ``Event`` of ``service`` (its ``logMonoTime`` in ns); may flush.
        ``pixels``: a video-logged ``cameraFrame``'s (``msgs/video.py``), for a JSON MCAP's preview."""
        if self.closed:
            raise ValueError(f"{self.path} is closed")
        self._write(service, log_mono_time_ns, data, pixels)
        self.messages += 1
        self._pending += 1
        self.maybe_flush()

    def maybe_flush(self) -> bool:
        """Flush if the policy says so (pending messages or elapsed time); returns whether it did."""
        if self.closed or not self._pending:
            return False
        if self._pending >= self.policy.every_messages or self._clock() - self._last_flush_s >= self.policy.interval_s:
            self.flush()
            return True
        return False

    def flush(self) -> None:
        """Make everything written so far readable by a reader of the file (and durable if ``fsync``)."""
        self._flush()
        if self.policy.fsync:
            os.fsync(self._fileno())
        self._pending = 0
        self._last_flush_s = self._clock()

    def close(self) -> None:
        """Finish the file (zstd frame end / MCAP summary and footer) and close it. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._close()

    @abc.abstractmethod
    def _write(self, service: str, log_mono_time_ns: int, data: bytes, pixels: Any = None) -> None:
        """Append ``data`` to the format's stream."""

    @abc.abstractmethod
    def _flush(self) -> None:
        """Push everything appended so far to the file object and flush it."""

    @abc.abstractmethod
    def _close(self) -> None:
        """End the format's stream and close the file."""

    @abc.abstractmethod
    def _fileno(self) -> int:
        """The OS file descriptor (for fsync)."""

    @abc.abstractmethod
    def _abandon(self) -> None:
        """Close the file without ending the format's stream (:meth:`discard`)."""


def _remove_made(path: Path, made: tuple[int, int] | None) -> None:
    """Remove ``path`` if it is still what we made there, ``made`` its (device, inode): a file, or a folder when
    empty (whatever another put in it stays, with the folder). A symlink or anything else now at ``path`` is left
    alone, never followed; a failed removal is left too."""
    if made is None:
        return
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) != made:
            return
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(path)
        elif stat.S_ISREG(st.st_mode):
            os.unlink(path)
    except OSError:
        pass


class RlogSegmentWriter(_SegmentFileWriter):
    """``.zst``: a zstd frame of concatenated ``Event`` bytes (openpilot's rlog layout).

    The file is created exclusively, 0600 (``msgs/outdir.py`` ``open_private``: ``FileExistsError`` if
    present, ``OutputDirError`` for a symlink in its place). A flush ends a zstd block
    (``FLUSH_BLOCK``), so every message before it decompresses even if the frame is never ended.
    """

    def __init__(
        self,
        path: Path,
        policy: FlushPolicy = FlushPolicy(),
        clock: Callable[[], float] = time.monotonic,
        level: int = ZSTD_LEVEL,
    ) -> None:
        super().__init__(path, policy, clock)
        self._fh = open_private(self.path, "xb")  # 0600, never through a symlink; closed in _close
        try:
            self._created(self._fh)
            self._z = zstd.ZstdCompressor(level=level, write_checksum=True).stream_writer(self._fh, closefd=False)
        except BaseException:
            self.discard()
            raise

    def _write(self, service: str, log_mono_time_ns: int, data: bytes, pixels: Any = None) -> None:
        self._z.write(data)

    def _flush(self) -> None:
        self._z.flush(zstd.FLUSH_BLOCK)
        self._fh.flush()

    def _fileno(self) -> int:
        return self._fh.fileno()

    def _abandon(self) -> None:
        self._fh.close()

    def _close(self) -> None:
        try:
            self._z.close()  # ends the frame (content checksum included); the file stays open
            self._fh.flush()
            if self.policy.fsync:
                os.fsync(self._fh.fileno())
        finally:
            self._fh.close()


class McapSegmentWriter(_SegmentFileWriter):
    """``.mcap``: the ``mcap`` package's writer, one channel per service and encoding.

    ``encodings`` (:data:`MCAP_ENCODINGS`): ``"capnproto"`` channels (topic = service name, the
    published bytes, for exact replay) and/or ``"json"`` channels Foxglove decodes (JSON Schema
    generated from the Cap'n Proto schema: topic ``/<service>`` plus ``/camera/image`` as
    ``foxglove.RawImage``, ``/chestnut/levels`` and ``/chestnut/log``; :mod:`chestnut.msgs.jsonschema`).
    Channels are registered on a topic's first message. A ``cameraFrame`` logged as video
    (``msgs/video.py``) has a ``/camera/image`` preview (``msgs/video.py`` ``preview``, at most
    ``PREVIEW_MAX_BYTES``; ``chestnut export`` writes full frames); a ring frame the logger could not
    read has none, so Foxglove shows no empty image. A flush ends the open chunk. ``metadata``
    (str -> str) is written as an MCAP metadata record named ``chestnut``, with ``unix_offset_ns``: the
    ns added to every ``logMonoTime`` for the MCAP log and publish times (``msgs/clock.py``; None: taken
    now). With ``video`` and the JSON channels, the camera frames are also on ``/camera/video`` as
    ``foxglove.CompressedVideo`` (H.264 at the frame's own size, a keyframe every second: ``msgs/video.py``
    ``FoxgloveVideo``), what Foxglove plays at full size, encoded in a thread of its own; ``video_drop``: a frame
    that finds that thread's queue full is left out of the view (the logger, live) instead of waited for (an
    export). Raises ``ValueError`` for an unknown or empty ``encodings``.
    """

    def __init__(
        self,
        path: Path,
        policy: FlushPolicy = FlushPolicy(),
        clock: Callable[[], float] = time.monotonic,
        metadata: dict[str, str] | None = None,
        encodings: Iterable[str] = ("capnproto",),
        unix_offset_ns: int | None = None,
        video: bool = True,
        video_drop: bool = False,
    ) -> None:
        self.encodings = tuple(dict.fromkeys(encodings))
        self.unix_offset_ns = unix_offset_ns_now() if unix_offset_ns is None else int(unix_offset_ns)
        if not self.encodings or set(self.encodings) - set(MCAP_ENCODINGS):
            raise ValueError(f"MCAP encodings {self.encodings}: give one or both of {', '.join(MCAP_ENCODINGS)}")
        super().__init__(path, policy, clock)
        self._fh = open_private(self.path, "xb")  # 0600, never through a symlink; closed in _close
        self._video: FoxgloveVideoThread | None = None
        try:
            self._created(self._fh)
            self._start(metadata, video, video_drop)
        except BaseException:
            self.discard()
            raise

    def _start(self, metadata: dict[str, str] | None, video: bool, video_drop: bool) -> None:
        """The file's opening records: header, schema, metadata (a full disk can fail any of them)."""
        self._mcap = _McapWriter(self._fh, chunk_size=MCAP_CHUNK_BYTES, compression=CompressionType.ZSTD)
        self._mcap.start(profile="", library=f"{MCAP_LIBRARY} {package_versions()['chestnut']}")
        self._schema_id = 0
        if "capnproto" in self.encodings:
            self._schema_id = self._mcap.register_schema(
                name=MCAP_SCHEMA_NAME, encoding=SchemaEncoding.CapnProto, data=code_generator_request()
            )
        self._channels: dict[str, int] = {}
        self._json_channels: dict[str, int] = {}
        self._json_state = DerivedState()
        self.json_skipped = 0
        # the camera on /camera/video as H.264 at its own size (Foxglove's CompressedVideo), with the JSON view
        # (its own thread: the logger's loop does not wait for x264; ``video_drop``: a frame the thread has no
        # room for is left out of the view, never out of the record)
        self._video = FoxgloveVideoThread(drop=video_drop) if "json" in self.encodings and video else None
        self.video_skipped = 0
        self._sequence: Counter[int] = Counter()
        self._mcap.add_metadata(MCAP_LIBRARY, {**(metadata or {}), UNIX_OFFSET_KEY: str(self.unix_offset_ns)})

    def _add(self, channel_id: int, log_mono_time_ns: int, data: bytes) -> None:
        seq = self._sequence[channel_id]
        self._sequence[channel_id] = (seq + 1) & 0xFFFFFFFF
        t = log_mono_time_ns + self.unix_offset_ns
        self._mcap.add_message(channel_id=channel_id, log_time=t, publish_time=t, data=data, sequence=seq)

    def _json_channel(self, topic: str) -> int:
        channel_id = self._json_channels.get(topic)
        if channel_id is None:
            name, schema = all_topic_schemas()[topic]
            schema_id = self._mcap.register_schema(
                name=name, encoding=SchemaEncoding.JSONSchema, data=json.dumps(schema).encode()
            )
            channel_id = self._mcap.register_channel(
                topic=topic, message_encoding=MessageEncoding.JSON, schema_id=schema_id
            )
            self._json_channels[topic] = channel_id
        return channel_id

    def _write(self, service: str, log_mono_time_ns: int, data: bytes, pixels: Any = None) -> None:
        if "capnproto" in self.encodings:
            channel_id = self._channels.get(service)
            if channel_id is None:
                channel_id = self._mcap.register_channel(
                    topic=service, message_encoding=MessageEncoding.CapnProto, schema_id=self._schema_id
                )
                self._channels[service] = channel_id
            self._add(channel_id, log_mono_time_ns, data)
        if "json" in self.encodings:
            try:
                event = log_from_bytes(data)
                _, body = event_to_json(event)
            except (MalformedMessageError, KeyError, capnp.KjException):
                self.json_skipped += 1  # a member this schema does not know: kept in the capnproto channel only
                return
            for topic, message in foxglove_messages(service, body, self._json_state, self.unix_offset_ns):
                if topic == TOPIC_IMAGE and not message["data"]:
                    if pixels is None:
                        continue
                    w, h, enc, img = preview(pixels, body["width"], body["height"], body["encoding"])
                    step = w * (1 if enc == "mono8" else 3)
                    message = {
                        **message,
                        "width": w,
                        "height": h,
                        "encoding": enc,
                        "step": step,
                        "data": base64.b64encode(img).decode(),
                    }
                self._add(self._json_channel(topic), log_mono_time_ns, json.dumps(message).encode())
            if service == "cameraFrame" and self._video is not None:
                self._write_video(self._video, event.cameraFrame, body, pixels, log_mono_time_ns)

    def _write_video(
        self, video: FoxgloveVideoThread, cf: Any, body: dict[str, Any], pixels: Any, log_mono_time_ns: int
    ) -> None:
        """The frame to ``/camera/video`` (H.264, ``msgs/video.py`` ``FoxgloveVideoThread``): its ``pixels``, else
        its inline ``data``; a frame with neither (a ring frame the logger could not read) has none. Its message
        is written once encoded (:meth:`_add_video`), stamped with the frame's own times."""
        try:
            if pixels is None:
                if not len(cf.data):
                    return
                pixels = frame_to_array(cf)
        except ValueError:
            self.video_skipped += 1  # inline data that is not a frame of its size: the rlog has it as it came
            return
        meta = (log_mono_time_ns, {"timestampEof": body["timestampEof"]})
        video.submit(pixels, body["width"], body["height"], body["encoding"], log_mono_time_ns, meta)
        self._add_video(video.results())

    def _add_video(self, encoded: list[tuple[Any, bytes]]) -> None:
        for (log_mono_time_ns, stamp), unit in encoded:
            message = compressed_video(stamp, unit, self.unix_offset_ns)
            self._add(self._json_channel(TOPIC_VIDEO), log_mono_time_ns, json.dumps(message).encode())

    def _end_video(self) -> None:
        """The video thread's last frames written, its counts logged once."""
        video, self._video = self._video, None
        if video is None:
            return
        self._add_video(video.close())
        if video.refused or video.dropped:
            _log.warning(
                "%s: %d frame(s) not on %s: %d the encoder refused (%s), %d it had no room for (the logger ran "
                "behind); the rlog and the video file keep every frame",
                self.path,
                video.refused + video.dropped,
                TOPIC_VIDEO,
                video.refused,
                video.first_error or "-",
                video.dropped,
            )

    def _flush(self) -> None:
        if self._video is not None:
            self._add_video(self._video.results())
        self._mcap.flush()

    def _fileno(self) -> int:
        return self._fh.fileno()

    def _abandon(self) -> None:
        video, self._video = self._video, None
        try:
            if video is not None:
                video.close()
        finally:
            self._fh.close()

    def _close(self) -> None:
        try:
            self._end_video()
            self._mcap.finish()
            self._fh.flush()
            if self.policy.fsync:
                os.fsync(self._fh.fileno())
        finally:
            self._fh.close()


_WRITERS: dict[str, type[_SegmentFileWriter]] = {"zst": RlogSegmentWriter, "mcap": McapSegmentWriter}


# ---------------------------------------------------------------- routes and segments


def new_route_name(log_dir: Path, now_s: float | None = None) -> str:
    """A route name for a log starting now: UTC ``YYYY-MM-DD--HH-MM-SS``, suffixed ``-2``, ``-3`` ...
    if a route of that name already has segments in ``log_dir``."""
    base = time.strftime("%Y-%m-%d--%H-%M-%S", time.gmtime(time.time() if now_s is None else now_s))
    log_dir = Path(log_dir)
    for k in itertools.count(1):
        route = base if k == 1 else f"{base}-{k}"
        if not any(log_dir.glob(f"{route}--*")):
            return route
    raise AssertionError("unreachable")


def parse_segment_dir(name: str) -> tuple[str, int] | None:
    """``"<route>--<n>"`` -> ``(route, n)``; None if ``name`` is not a segment directory name."""
    route, sep, n = name.rpartition("--")
    if not sep or not route or not n.isdigit():
        return None
    return route, int(n)


class RouteWriter:
    """Writes one route: segments of ``segment_seconds`` under ``log_dir``, in the chosen formats.

    ``full`` writes ``rlog.*`` (every message); ``light`` writes ``qlog.*`` (every
    ``decimation``-th message of each service, none of a service whose decimation is None or that
    is not registered). Each file starts with the ``initData`` header. ``clock`` (s, monotonic)
    drives rotation and the flush policy; call :meth:`tick` at least every ``policy.interval_s``
    so that the time bounds hold when no message arrives. Raises ``ValueError`` for an unknown
    format, no format, no log kind or a non-positive segment length. ``mcap_encodings``: the
    channels of the ``.mcap`` files (:class:`McapSegmentWriter`). ``video``: how
    :meth:`write_frame` encodes camera frames into the segment's ``fcamera.mkv`` (``msgs/video.py``;
    None: frames are logged raw with :meth:`write`); the video is flushed with ``policy`` and closed with
    its segment. ``unix_offset_ns``: the route's one offset from CLOCK_MONOTONIC to Unix time (``msgs/clock.py``;
    None: taken now), kept in every segment's ``initData`` config and used for the MCAP times. ``mcap_video``:
    the JSON MCAP's ``/camera/video`` (:class:`McapSegmentWriter` ``video``; ``mcap_video_drop``: its
    ``video_drop``).

    ``carry`` (default :data:`CARRIED_SERVICES`): the most recent message of each of these services written with
    :meth:`write` (the greatest ``logMonoTime``; the bytes as given, up to the service's ``max_bytes``, so at most
    1 MiB per service is held for an ``initData``) is written again right after the header of every segment opened
    later, in every file of the segment that logs the service, and listed in that header's config under
    :data:`CARRIED_KEY`. It is not counted in :attr:`messages`.
    """

    def __init__(
        self,
        log_dir: Path | str,
        *,
        formats: Iterable[str] = FORMATS,
        full: bool = True,
        light: bool = False,
        segment_seconds: float = SEGMENT_SECONDS,
        policy: FlushPolicy = FlushPolicy(),
        config: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        route: str | None = None,
        mcap_encodings: Iterable[str] = ("capnproto",),
        video: VideoOptions | None = None,
        unix_offset_ns: int | None = None,
        mcap_video: bool = True,
        mcap_video_drop: bool = False,
        carry: Iterable[str] = CARRIED_SERVICES,
    ) -> None:
        self.formats = tuple(dict.fromkeys(formats))
        self.carry = frozenset(carry)
        self._carried: dict[str, tuple[int, bytes]] = {}  # service -> (logMonoTime ns, bytes): the next segments'
        self.mcap_video, self.mcap_video_drop = mcap_video, mcap_video_drop
        self.unix_offset_ns = unix_offset_ns_now() if unix_offset_ns is None else int(unix_offset_ns)
        self.mcap_encodings = tuple(dict.fromkeys(mcap_encodings))
        if not self.mcap_encodings or set(self.mcap_encodings) - set(MCAP_ENCODINGS):
            raise ValueError(
                f"mcap_encodings must be a non-empty subset of {MCAP_ENCODINGS}, got {list(mcap_encodings)}"
            )
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown or not self.formats:
            raise ValueError(f"formats must be a non-empty subset of {FORMATS}, got {list(formats)}")
        if not (full or light):
            raise ValueError("a route writes the full log, the light log, or both")
        if not segment_seconds > 0:
            raise ValueError(f"segment_seconds must be > 0, got {segment_seconds}")
        self.log_dir = private_dir(log_dir)  # 0700 when new (msgs/outdir.py): the logs hold camera frames
        self.names = tuple(n for n, on in zip(LOG_NAMES, (full, light), strict=True) if on)
        self.segment_seconds = float(segment_seconds)
        self.policy = policy
        self.config = dict(config or {})
        self._clock = clock
        self.route = route or new_route_name(self.log_dir)
        self.segment = -1
        self.messages = 0
        self._files: dict[tuple[str, str], _SegmentFileWriter] = {}
        self._light_seen: Counter[str] = Counter()
        self._segment_end_s = 0.0
        self.video = video
        self._video: SegmentVideo | None = None  # the open segment's video files, from its first frame
        self._closing_video: SegmentVideo | None = None  # the previous segment's, closed by its own thread
        self._open_segment(0)

    @property
    def segment_dir(self) -> Path:
        """The directory of the open segment, ``<log_dir>/<route>--<segment>``."""
        return self.log_dir / f"{self.route}--{self.segment}"

    def files(self) -> list[Path]:
        """Paths of the open segment's files."""
        return [w.path for w in self._files.values()]

    def _open_segment(self, n: int) -> None:
        """Open segment ``n``: its folder and files, each with its header written and flushed. A segment that
        cannot start (a full disk) is removed again, folder and files, as far as this writer made them
        (:meth:`_SegmentFileWriter.discard`, :func:`_remove_made`), and the error raised: a recorder that fails
        at its start and is restarted leaves no empty route folders; the last segment that opened stays the
        open one (a rollover is tried again on the next write or tick)."""
        seg_dir = self.log_dir / f"{self.route}--{n}"
        seg_dir.mkdir(mode=DIR_MODE, exist_ok=False)
        st = os.lstat(seg_dir)
        made = (st.st_dev, st.st_ino)
        started: list[_SegmentFileWriter] = []
        try:
            self._start_segment(seg_dir, n, started)
        except BaseException:
            self._files.clear()
            for writer in started:
                writer.discard()
            _remove_made(seg_dir, made)
            raise
        self.segment = n

    def _start_segment(self, seg_dir: Path, n: int, started: list[_SegmentFileWriter]) -> None:
        """:meth:`_open_segment`'s files in ``seg_dir``, each added to ``started`` once created."""
        config = {
            **self.config,
            "route": self.route,
            "segment": n,
            "formats": list(self.formats),
            "mcap_encodings": list(self.mcap_encodings),
            "logs": list(self.names),
            "flush_every_messages": self.policy.every_messages,
            "flush_interval_s": self.policy.interval_s,
            "frames": "raw" if self.video is None else f"video {self.video.codec}",
            UNIX_OFFSET_KEY: self.unix_offset_ns,
        }
        carried = sorted(self._carried.items())
        if carried:
            config[CARRIED_KEY] = [[service, t] for service, (t, _) in carried]
        header = init_data_event(self.segment_seconds, config)
        header_time = log_from_bytes(header).logMonoTime
        meta = {"route": self.route, "segment": str(n), "schema_sha256": SCHEMA_SHA256}
        for name in self.names:
            for fmt in self.formats:
                path = seg_dir / f"{name}.{fmt}"
                if fmt == "mcap":
                    writer: _SegmentFileWriter = McapSegmentWriter(
                        path,
                        self.policy,
                        self._clock,
                        metadata=meta,
                        encodings=self.mcap_encodings,
                        unix_offset_ns=self.unix_offset_ns,
                        video=self.mcap_video,
                        video_drop=self.mcap_video_drop,
                    )
                else:
                    writer = _WRITERS[fmt](path, self.policy, self._clock)
                started.append(writer)
                writer.write("initData", header_time, header)
                for service, (t, data) in carried:
                    if name == "rlog" or self._in_light_log(service):
                        writer.write(service, t, data)
                writer.flush()
                self._files[(name, fmt)] = writer
        self._segment_end_s = self._clock() + self.segment_seconds

    def _close_segment(self, wait: bool = True) -> None:
        """Close the open segment's files; its video in the background unless ``wait`` (a rollover: the
        previous segment's video is waited for instead, long finished by then)."""
        errors = []
        for video in (self._closing_video, self._video):
            if video is None:
                continue
            try:
                video.close(wait=wait or video is self._closing_video)
            except OSError as e:
                errors.append(e)
        self._closing_video = None if wait else self._video
        self._video = None
        for writer in self._files.values():
            try:
                writer.close()
            except OSError as e:  # one failing file must not keep the others open
                errors.append(e)
        self._files.clear()
        if errors:
            raise errors[0]

    def rotate_if_due(self) -> bool:
        """Close the open segment and open the next one if its time is up; returns whether it did."""
        if self._clock() < self._segment_end_s:
            return False
        self._close_segment(wait=False)
        self._open_segment(self.segment + 1)
        return True

    def write(self, service: str, log_mono_time_ns: int, data: bytes) -> None:
        """Log one serialized ``Event`` of ``service`` (after rotating if the segment is over)."""
        self.rotate_if_due()
        self._append(service, log_mono_time_ns, data)

    def _append(self, service: str, log_mono_time_ns: int, data: bytes, pixels: Any = None) -> None:
        """:meth:`write` into the open segment, whatever the time."""
        if service in self.carry:
            self._carry(service, log_mono_time_ns, data)
        self.messages += 1
        for name in self.names:
            if name == "qlog" and not self._keep_light(service):
                continue
            for fmt in self.formats:
                self._files[(name, fmt)].write(service, log_mono_time_ns, data, pixels)
        if "qlog" in self.names:
            self._light_seen[service] += 1

    def write_frame(self, log_mono_time_ns: int, event: Any, pixels: Any) -> int:
        """Log a ``cameraFrame`` Event reader with its ``pixels`` (uint8, ``msgs/frames.py``
        ``frame_shape``) as the next frame of the open segment's video and the metadata in the logs
        (``msgs/video.py`` ``video_event``), after rotating if the segment is over. Returns the frame's
        number in its video file. Raises ValueError when there is no ``video`` option or the codec cannot
        store the frame (nothing logged then: log it with :meth:`write`), OSError for a write error."""
        if self.video is None:
            raise ValueError("this route logs frames raw (no video option)")
        self.rotate_if_due()
        if self._video is None:
            p = self.policy
            self._video = SegmentVideo(
                self.segment_dir, self.video, p.every_messages, p.interval_s, p.fsync, self._clock
            )
        cf = event.cameraFrame
        file, index = self._video.add(int(cf.width), int(cf.height), str(cf.encoding), pixels, log_mono_time_ns)
        meta = video_event(event, file, index, self.video, pixels_crc32(pixels))
        self._append("cameraFrame", log_mono_time_ns, meta, pixels)  # the segment of the video frame
        return index

    def video_files(self) -> list[Path]:
        """The open segment's video files (none before its first frame)."""
        return [] if self._video is None else list(self._video.paths)

    def _carry(self, service: str, log_mono_time_ns: int, data: bytes) -> None:
        """Keep ``data`` as the message of ``service`` the next segments begin with, if it is the most recent
        (``logMonoTime``) and within the service's bound (``msgs/services.py`` ``max_bytes``: what a subscriber
        accepts, so the logger never holds more than the bus lets in)."""
        entry = SERVICE_LIST.get(service)
        if entry is None or len(data) > entry.max_bytes:
            return
        held = self._carried.get(service)
        if held is None or log_mono_time_ns >= held[0]:
            self._carried[service] = (int(log_mono_time_ns), bytes(data))

    def _in_light_log(self, service: str) -> bool:
        """Whether the light log keeps any message of ``service`` (a decimation; ``_keep_light`` picks which)."""
        entry = SERVICE_LIST.get(service)
        return entry is not None and entry.decimation is not None

    def _keep_light(self, service: str) -> bool:
        entry = SERVICE_LIST.get(service)
        if entry is None or entry.decimation is None:
            return False
        return self._light_seen[service] % entry.decimation == 0

    def tick(self) -> None:
        """Rotate if due and apply the time bound of the flush policy to every open file."""
        self.rotate_if_due()
        for writer in self._files.values():
            writer.maybe_flush()
        if self._video is not None:
            self._video.maybe_flush()

    def flush(self) -> None:
        """Flush every open file now."""
        for writer in self._files.values():
            writer.flush()

    def close(self) -> None:
        """Close the open segment's files cleanly (frame end, MCAP footer). Idempotent."""
        self._close_segment()

    def __enter__(self) -> RouteWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class LogDamage:
    """Where a log file stops being readable and why.

    ``offset`` (bytes): every message before it was yielded. For ``.mcap`` it is the file offset of
    the damaged record; for ``.zst`` it is the offset in the *decompressed* stream of ``Event``s
    (the start of the first message that could not be read), since zstd gives no compressed offset
    per message.
    """

    path: Path
    offset: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: byte {self.offset}: {self.reason}"


def framed_message_size(buf: bytes | bytearray | memoryview, pos: int = 0) -> int | None:
    """Total size in bytes of the unpacked Cap'n Proto message starting at ``buf[pos]``.

    Standard framing (Cap'n Proto encoding spec): u32 segment count - 1, u32 size in words of each
    segment, padding to 8 bytes, then the segments. Returns None when ``buf`` does not yet hold the
    whole segment table. Raises ``ValueError`` for more than :data:`CAPNP_MAX_SEGMENTS` segments or a
    message larger than ``schema.MAX_MESSAGE_BYTES``.
    """
    avail = len(buf) - pos
    if avail < 4:
        return None
    (n_segments,) = struct.unpack_from("<I", buf, pos)
    n_segments += 1
    if n_segments > CAPNP_MAX_SEGMENTS:
        raise ValueError(f"segment table claims {n_segments} segments (limit {CAPNP_MAX_SEGMENTS})")
    header = 4 + 4 * n_segments
    header += header % 8
    if avail < header:
        return None
    words = sum(struct.unpack_from(f"<{n_segments}I", buf, pos + 4))
    total = header + 8 * words
    if total > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {total} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
    return total


_MCAP_ERRORS = (McapError, ValueError, struct.error, zstd.ZstdError, UnicodeDecodeError, KeyError)


def _mcap_record_end(fh: Any, pos: int, size: int) -> int | None:
    """End offset of the MCAP record at ``pos`` (u8 opcode, u64 length, body); None if it extends
    past ``size`` (the file ends inside it)."""
    if pos + 9 > size:
        return None
    fh.seek(pos)
    (length,) = struct.unpack("<Q", fh.read(9)[1:])
    end = pos + 9 + length
    return end if end <= size else None


# (logMonoTime ns, service, serialized Event, decoded Event reader)
LogItem = tuple[int, str, bytes, Any]


class _ZstdFeed:
    """A zstd decoder across concatenated frames: ``feed(bytes) -> bytes`` (raises ``ZstdError``)."""

    def __init__(self) -> None:
        self._dobj = zstd.ZstdDecompressor().decompressobj()
        self.in_frame = False  # bytes of a frame whose end has not been seen were fed
        self.frames_ended = 0

    def feed(self, data: bytes) -> bytes:
        out = []
        while data:
            out.append(self._dobj.decompress(data))
            data = b""
            self.in_frame = not self._dobj.eof
            if self._dobj.eof:  # the frame ended; the rest of the input may start another one
                self.frames_ended += 1
                data = self._dobj.unused_data
                self._dobj = zstd.ZstdDecompressor().decompressobj()
        return b"".join(out)


class SegmentFileReader:
    """Reads one ``.zst`` or ``.mcap`` log file in file order; never raises on bad content.

    Iterating yields :data:`LogItem` tuples. Afterwards: ``damage`` (list of :class:`LogDamage`,
    also passed to ``on_damage`` as found), ``complete`` (the zstd frame was ended / the MCAP footer
    was read), ``unknown_members`` (messages of a union member this schema does not know, skipped:
    a newer writer's). Raises ``ValueError`` for a file whose suffix is neither ``.zst`` nor ``.mcap``.
    ``warn_json_only``: an ``.mcap`` of JSON channels only is one WARNING once read (:func:`warn_json_only`);
    False leaves saying it to the caller.
    """

    def __init__(self, path: Path | str, on_damage: Callable[[LogDamage], None] | None = None,
                 warn_json_only: bool = True) -> None:
        self.path = Path(path)
        self.warn_json_only = warn_json_only
        if self.path.suffix not in (".zst", ".mcap"):
            raise ValueError(f"{self.path}: not a log file (expected a .zst or .mcap suffix)")
        self.on_damage = on_damage
        self.damage: list[LogDamage] = []
        self.complete = False
        self.unknown_members = 0
        self.json_messages = 0  # messages on JSON channels (a Foxglove view), skipped
        self.items = 0  # messages yielded

    def _report(self, offset: int, reason: str) -> None:
        dmg = LogDamage(self.path, offset, reason)
        self.damage.append(dmg)
        if self.on_damage is not None:
            self.on_damage(dmg)

    def _decode(self, data: bytes, offset: int, topic: str | None = None) -> LogItem | None:
        """The item for ``data``, or None (reported as damage, or counted as an unknown member)."""
        try:
            event = log_from_bytes(data)
        except MalformedMessageError as e:
            if e.reason == REASON_UNKNOWN_MEMBER:
                self.unknown_members += 1
            else:
                self._report(offset, str(e))
            return None
        service = event.which()
        if topic is not None and service != topic:
            self._report(offset, f"a {service!r} message on channel {topic!r}")
            return None
        return event.logMonoTime, service, data, event

    def __iter__(self) -> Generator[LogItem, None, None]:
        try:
            if self.path.suffix == ".zst":
                for item in self._iter_rlog():
                    self.items += 1
                    yield item
            else:
                for item in self._iter_mcap():
                    self.items += 1
                    yield item
                if self.json_messages and not self.items and self.warn_json_only:
                    warn_json_only(self.path)
        except OSError as e:
            self._report(0, f"cannot read: {e}")

    def _too_damaged(self, offset: int) -> bool:
        """True (and reported) once a file has :data:`MAX_DAMAGE_PER_FILE` damage reports."""
        if len(self.damage) < MAX_DAMAGE_PER_FILE:
            return False
        self._report(offset, f"abandoned after {MAX_DAMAGE_PER_FILE} damage reports")
        return True

    def _iter_rlog(self) -> Iterator[LogItem]:
        buf = bytearray()  # decompressed bytes not yet parsed: at most one incomplete message
        base = 0  # decompressed offset of buf[0]
        pieces = self._zstd_pieces()
        while True:
            try:
                piece = next(pieces)
            except StopIteration as stop:
                failure = stop.value
                break
            buf += piece
            consumed = yield from self._parse(buf, base)
            if consumed is None:
                pieces.close()
                return
            del buf[:consumed]
            base += consumed
        if buf:
            why = f"; {failure}" if failure else ""
            self._report(base, f"truncated message: the stream ends {len(buf)} bytes into it{why}")
        elif failure is not None:
            self._report(base, failure)
        else:
            self.complete = True

    def _zstd_pieces(self) -> Generator[bytes, None, str | None]:
        """Decompressed pieces of the file, in order; returns None if every frame was ended, else
        why the stream stops. After a zstd error, the failing input is replayed byte by byte from a
        fresh decoder so that every block before the damage is still delivered."""
        with os.fdopen(open_regular(self.path, follow=True), "rb") as fh:
            dec = _ZstdFeed()
            offset = 0  # compressed offset of the next chunk
            while chunk := fh.read(READ_CHUNK_BYTES):
                view = memoryview(chunk)
                for at in range(0, len(chunk), FEED_BYTES):  # bounded output per step (see FEED_BYTES)
                    piece = view[at:at + FEED_BYTES]
                    try:
                        out = dec.feed(bytes(piece))
                    except zstd.ZstdError as e:
                        yield from self._zstd_salvage(fh, offset + at, len(piece))
                        return f"zstd: {e}"
                    if out:
                        yield out
                offset += len(chunk)
        if dec.in_frame:
            return "zstd frame not finished (the writer did not close the file)"
        if not dec.frames_ended:
            return "empty file"
        return None

    @staticmethod
    def _zstd_salvage(fh: Any, fail_offset: int, fail_len: int) -> Iterator[bytes]:
        """Output of the ``fail_len`` compressed bytes at ``fail_offset`` up to the first bad one."""
        fh.seek(0)
        dec = _ZstdFeed()
        while fh.tell() < fail_offset:
            dec.feed(fh.read(min(FEED_BYTES, fail_offset - fh.tell())))  # delivered already (bounded steps)
        for byte in fh.read(fail_len):
            try:
                out = dec.feed(bytes((byte,)))
            except zstd.ZstdError:
                return
            if out:
                yield out

    def _parse(self, buf: bytearray, base: int) -> Generator[LogItem, None, int | None]:
        """Yield the complete messages at the start of ``buf`` (decompressed offset ``base``).

        Returns the number of bytes consumed, or None when reading must stop (broken framing, or
        too much damage).
        """
        pos = 0
        while True:
            try:
                size = framed_message_size(buf, pos)
            except ValueError as e:
                self._report(base + pos, f"framing: {e}")
                return None
            if size is None or len(buf) - pos < size:
                return pos
            item = self._decode(bytes(buf[pos : pos + size]), base + pos)
            pos += size
            if item is not None:
                yield item
            elif self._too_damaged(base + pos):
                return None

    def _iter_mcap(self) -> Iterator[LogItem]:
        size = self.path.stat().st_size
        channels: dict[int, Channel] = {}
        schemas: dict[int, Schema] = {}
        bad_channels: set[int] = set()
        with os.fdopen(open_regular(self.path, follow=True), "rb") as fh:
            if size == 0:
                self._report(0, "empty file")
                return
            if fh.read(len(MCAP0_MAGIC)) != MCAP0_MAGIC:
                self._report(0, "not an MCAP file (bad magic)")
                return
            pos = fh.tell()  # file offset of the next record
            records = self._mcap_records(fh)
            while True:
                try:
                    record = next(records)
                except StopIteration:
                    self.complete = True
                    return
                except _MCAP_ERRORS as e:
                    end = _mcap_record_end(fh, pos, size)
                    if pos == size:
                        self._report(pos, "no footer: the file ends after its last complete record")
                        return
                    if end is None:
                        self._report(pos, "truncated record: the file ends inside it")
                        return
                    # the record's own length is intact: skip it and go on with the next one
                    self._report(pos, f"unreadable record: {type(e).__name__}: {e}")
                    if self._too_damaged(pos):
                        return
                    fh.seek(end)
                    pos = end
                    records = self._mcap_records(fh)
                    continue
                inner: list[Any] = [record]
                if isinstance(record, Chunk):
                    inner = self._chunk_records(record, pos)
                for rec in inner:
                    if isinstance(rec, Schema):
                        schemas[rec.id] = rec
                    elif isinstance(rec, Channel):
                        channels[rec.id] = rec
                    elif isinstance(rec, Message):
                        item = self._mcap_message(rec, pos, channels, schemas, bad_channels)
                        if item is not None:
                            yield item
                        elif self._too_damaged(pos):
                            return
                pos = fh.tell()

    @staticmethod
    def _mcap_records(fh: Any) -> Iterator[Any]:
        """MCAP records from the current position of ``fh`` (after the leading magic), chunks whole."""
        return StreamReader(
            fh, skip_magic=True, emit_chunks=True, validate_crcs=True, record_size_limit=MCAP_RECORD_LIMIT_BYTES
        ).records

    def _chunk_records(self, chunk: Chunk, pos: int) -> list[Any]:
        """The records inside ``chunk`` (CRC checked); [] and a damage report when it is bad."""
        if chunk.uncompressed_size > MCAP_RECORD_LIMIT_BYTES:
            self._report(pos, f"chunk claims {chunk.uncompressed_size} uncompressed bytes")
            return []
        try:
            return breakup_chunk(chunk, validate_crc=True)
        except _MCAP_ERRORS as e:
            self._report(pos, f"bad chunk: {type(e).__name__}: {e}")
            return []

    def _mcap_message(
        self, rec: Message, pos: int, channels: dict[int, Channel], schemas: dict[int, Schema], bad: set[int]
    ) -> LogItem | None:
        channel = channels.get(rec.channel_id)
        if channel is None:
            self._report(pos, f"message on unknown channel {rec.channel_id}")
            return None
        schema = schemas.get(channel.schema_id)
        if channel.message_encoding == MessageEncoding.JSON:
            self.json_messages += 1
            return None  # a Foxglove view of the log (msgs/jsonschema.py); the capnproto channels are the record
        if channel.message_encoding != MessageEncoding.CapnProto or schema is None or schema.name != MCAP_SCHEMA_NAME:
            if channel.id not in bad:
                bad.add(channel.id)
                self._report(pos, f"channel {channel.topic!r} is not {MCAP_SCHEMA_NAME} in capnproto encoding")
            return None
        return self._decode(rec.data, pos, topic=channel.topic)


_LOG_FILE_FIX = "give a log file (rlog.zst / rlog.mcap) or a folder of them"  # a LOG that is not a regular file


class LogPathError(FileNotFoundError):
    """A LOG path the OS cannot look up: too long (``ENAMETOOLONG``), a symlink loop (``ELOOP``), a path through
    a regular file (``ENOTDIR``), a folder we may not search (``EACCES``). No log there, so a
    ``FileNotFoundError``, which every offline command reports as one line and exit 2; ``str()`` is that line:
    the path, the OS's reason (``msgs/outdir.py`` :func:`~chestnut.msgs.outdir.os_reason`) and what to give."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"{os.fspath(path)}: {reason}; {_LOG_FILE_FIX}")
        self.reason = reason


def find_log_files(paths: Iterable[Path | str] | Path | str, name: str = "rlog", fmt: str = "auto", *,
                   on_skip: Callable[[Path, str], None] | None = None) -> list[Path]:
    """The log files named by ``paths``: files as given; directories searched recursively for
    ``<name>.zst`` / ``<name>.mcap``. A segment holding both formats contributes one file: ``fmt``
    ``"auto"`` prefers ``.zst`` (openpilot's format), ``"zst"`` or ``"mcap"`` take only that one.
    Sorted by (route, segment, path). Raises ``FileNotFoundError`` for a missing path or when
    nothing is found, ``msgs/video.py`` :class:`NotRegularFileError` (a ``FileNotFoundError``) for a
    path, or a log file found in a directory, that is a FIFO, socket, device or (found) symlink: such a
    file is never opened (a FIFO would block the reader for good), :class:`LogPathError` (a
    ``FileNotFoundError``) for a path the OS cannot look up (too long, a symlink loop, through a regular file),
    and ``ValueError`` for a bad ``name`` or ``fmt``.

    ``on_skip``: a log file found in a directory that is not a regular file (told from its ``lstat``, so never
    opened) is left out and passed to ``on_skip(path, kind)`` (``kind``: :func:`~chestnut.msgs.video.file_kind`'s
    words, "a FIFO") instead of raising; a path given by name is refused all the same.
    """
    if name not in LOG_NAMES:
        raise ValueError(f"log name must be one of {LOG_NAMES}, got {name!r}")
    if fmt not in ("auto", *FORMATS):
        raise ValueError(f"fmt must be 'auto' or one of {FORMATS}, got {fmt!r}")
    if isinstance(paths, str | Path):
        paths = [paths]
    prefs = FORMATS if fmt == "auto" else (fmt,)
    found: list[Path] = []
    for p in map(Path, paths):
        try:
            mode = p.stat().st_mode  # a path given by name may be a symlink: the caller's choice
        except FileNotFoundError:
            raise FileNotFoundError(f"{p}: no such file or directory") from None
        except OSError as e:  # ENAMETOOLONG, ELOOP (a symlink loop), ENOTDIR (through a regular file), EACCES
            raise LogPathError(p, os_reason(e)) from None
        if stat.S_ISREG(mode):
            found.append(p)
        elif stat.S_ISDIR(mode):
            by_dir: dict[Path, dict[str, Path]] = {}
            for suffix in prefs:
                for f in p.rglob(f"{name}.{suffix}"):
                    f_mode = f.lstat().st_mode  # found in a walk: only a regular file, never what it links to
                    if not stat.S_ISREG(f_mode):
                        if on_skip is None:
                            raise NotRegularFileError(f, file_kind(f_mode), _LOG_FILE_FIX)
                        on_skip(f, file_kind(f_mode))
                        continue
                    by_dir.setdefault(f.parent, {})[suffix] = f
            for options in by_dir.values():
                found.append(next(options[s] for s in prefs if s in options))
        else:
            raise NotRegularFileError(p, file_kind(mode), _LOG_FILE_FIX)
    if not found:
        raise FileNotFoundError(f"no {name}.{'/'.join(prefs)} under {', '.join(map(str, paths))}")

    def key(f: Path) -> tuple[str, int, str]:
        seg = parse_segment_dir(f.parent.name)
        return (seg[0], seg[1], str(f)) if seg else ("", -1, str(f))

    return sorted(dict.fromkeys(found), key=key)


def json_only_fix(path: Path | str) -> str:
    """What to give instead of the ``.mcap`` of JSON channels only at ``path`` (:func:`holds_only_json`), the end of
    every line that names one (:func:`warn_json_only`, ``chestnut check`` / ``replay``'s refusal, ``fleet make``'s):
    the ``.zst`` beside it when there is one (``chestnut record``'s default writes ``rlog.zst`` beside its view),
    else how ``chestnut record`` writes a log that can be read. It named the rlog.zst beside a ``--format mcap
    --mcap-encoding json`` log too, where there is none."""
    zst = Path(path).with_suffix(".zst")
    if zst.is_file():
        return f"give the {zst.name} written beside it (or a log recorded with --mcap-encoding both)"
    return (f"there is no {zst.name} beside it; chestnut record writes a log that check and replay read with "
            "--mcap-encoding capnproto or both, or in its default format (an rlog.zst beside the MCAP)")


def warn_json_only(path: Path) -> None:
    """The one WARNING for an ``.mcap`` of JSON channels only (:func:`holds_only_json`), on ``chestnut.logs``,
    ending in what to give instead (:func:`json_only_fix`)."""
    _log.warning("%s holds only JSON channels (a Foxglove view, msgs/jsonschema.py): %s", path, json_only_fix(path))


def holds_only_json(path: Path | str, warn: bool = True) -> bool:
    """True for an ``.mcap`` log file with messages on JSON channels only: the Foxglove view ``chestnut record``
    writes beside an rlog by default (``--mcap-encoding auto``), from which nothing can be replayed or checked
    (readers here skip JSON channels). Reads up to the file's first Cap'n Proto message (a ``capnproto`` or
    ``both`` file: its first chunk); a file of JSON only is read whole and, with ``warn``, its one WARNING said
    (:func:`warn_json_only`, "... holds only JSON channels ...: give the rlog.zst written beside it ..."). False for an
    ``.zst``, an empty or unreadable file (its damage is reported where it is read)."""
    p = Path(path)
    if p.suffix != ".mcap":
        return False
    item, reader = first_item(p, warn_json_only=warn)
    return item is None and reader.json_messages > 0


def first_item(path: Path | str, warn_json_only: bool = True) -> tuple[LogItem | None, SegmentFileReader]:
    """``(the first item of the log file at path, its reader)``, the :class:`SegmentFileReader` read up to that
    item and no further (``warn_json_only`` as there). None for a file that gives no item, read whole: the
    reader's ``damage``, ``json_messages`` and ``unknown_members`` then say why. Raises ``ValueError`` for a file
    whose suffix is neither ``.zst`` nor ``.mcap``."""
    reader = SegmentFileReader(path, warn_json_only=warn_json_only)
    items = iter(reader)
    try:
        return next(items, None), reader
    finally:
        items.close()


def _reorder(items: Iterable[LogItem], window_ns: int) -> Generator[LogItem, None, None]:
    """Items sorted by logMonoTime within a sliding window of ``window_ns`` (bounded memory)."""
    heap: list[tuple[int, int, LogItem]] = []
    seq = itertools.count()
    newest = None
    for item in items:
        heapq.heappush(heap, (item[0], next(seq), item))
        newest = item[0] if newest is None else max(newest, item[0])
        while heap and heap[0][0] <= newest - window_ns:
            yield heapq.heappop(heap)[2]
    while heap:
        yield heapq.heappop(heap)[2]


class LogReader:
    """Every message of a set of log files, in ``logMonoTime`` order across files and segments.

    ``paths`` are files or directories (see :func:`find_log_files` for ``name`` and ``fmt``).
    Iterating yields ``(logMonoTime ns, service, event)`` (an ``Event`` reader);
    :meth:`iter_raw` yields ``(logMonoTime, service, bytes)``. Files are merged by time, opened
    lazily (only files whose time range overlaps are open together). Within a file, order is
    restored within ``reorder_window_ns`` of logMonoTime; anything later than that is still yielded
    and counted in ``out_of_order``. Damaged files yield what precedes the damage; each damage goes
    to ``damage`` (list of :class:`LogDamage`) and to ``on_damage``. ``complete`` maps each file to
    whether it was cleanly closed; ``unknown_members`` counts skipped messages of unknown services.
    """

    def __init__(
        self,
        paths: Iterable[Path | str] | Path | str,
        *,
        name: str = "rlog",
        fmt: str = "auto",
        reorder_window_ns: int = DEFAULT_REORDER_WINDOW_NS,
        on_damage: Callable[[LogDamage], None] | None = None,
    ) -> None:
        self.files = find_log_files(paths, name, fmt)
        self.reorder_window_ns = int(reorder_window_ns)
        self.on_damage = on_damage
        self.damage: list[LogDamage] = []
        self.complete: dict[Path, bool] = {}
        self.unknown_members = 0
        self.out_of_order = 0

    def _report(self, dmg: LogDamage) -> None:
        self.damage.append(dmg)
        if self.on_damage is not None:
            self.on_damage(dmg)

    def _stream(self, path: Path) -> Iterator[LogItem]:
        reader = SegmentFileReader(path, on_damage=self._report)
        yield from _reorder(reader, self.reorder_window_ns)
        self.complete[path] = reader.complete
        self.unknown_members += reader.unknown_members

    def _first_time(self, path: Path) -> int | None:
        """logMonoTime of the file's first item; a file with none has its damage reported here."""
        reader = SegmentFileReader(path)
        inner = reader.__iter__()
        items = _reorder(inner, self.reorder_window_ns)
        try:
            first = next(items, None)
        finally:
            items.close()
            inner.close()
        if first is None:
            for dmg in reader.damage:
                self._report(dmg)
            self.complete[path] = reader.complete
            self.unknown_members += reader.unknown_members
            return None
        return first[0]

    def _merged(self) -> Iterator[LogItem]:
        for item, _ in self._merged_from():
            yield item

    def _merged_from(self) -> Iterator[tuple[LogItem, Path]]:
        starts = sorted((t, i, p) for i, p in enumerate(self.files) if (t := self._first_time(p)) is not None)
        pending = list(reversed(starts))
        heap: list[tuple[int, int, LogItem, Iterator[LogItem], Path]] = []
        seq = itertools.count()
        last = None

        def push(it: Iterator[LogItem], path: Path) -> None:
            item = next(it, None)
            if item is not None:
                heapq.heappush(heap, (item[0], next(seq), item, it, path))

        while heap or pending:
            while pending and (not heap or pending[-1][0] <= heap[0][0]):
                path = pending.pop()[2]
                push(self._stream(path), path)
            if not heap:
                continue
            t, _, item, it, path = heapq.heappop(heap)
            if last is not None and t < last:
                self.out_of_order += 1
            last = t if last is None else max(last, t)
            yield item, path
            push(it, path)

    def __iter__(self) -> Iterator[tuple[int, str, Any]]:
        for t, service, _, event in self._merged():
            yield t, service, event

    def iter_from(self) -> Iterator[tuple[int, str, bytes, Any, Path]]:
        """``(logMonoTime ns, service, serialized Event bytes, Event reader, the file it is from)`` in the
        same order as iteration: a video-logged frame's pixels are beside its file (``msgs/video.py``)."""
        for (t, service, data, event), path in self._merged_from():
            yield t, service, data, event, path

    def iter_raw(self) -> Iterator[tuple[int, str, bytes]]:
        """``(logMonoTime ns, service, serialized Event bytes)`` in the same order as iteration."""
        for t, service, data, _ in self._merged():
            yield t, service, data
