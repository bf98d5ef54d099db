"""ZeroMQ pub/sub of Cap'n Proto ``Event``s: the stack's messaging API (cereal's vocabulary).

- :func:`endpoint` -- where a service lives: ``ipc://<runtime_dir(prefix)>/<service>`` by default,
  ``tcp://127.0.0.1:<port>`` (loopback only) when asked.
- :func:`new_message` / :func:`log_from_bytes` -- build and decode ``Event``s; decoding is bounded
  (:data:`~chestnut.msgs.schema.TRAVERSAL_LIMIT_WORDS`) and validates every pointer up front, so a
  malformed message fails here with :class:`MalformedMessageError` and never later in a consumer.
- :func:`pub_sock` / :func:`sub_sock` -- thin wrappers over pyzmq PUB/SUB sockets sharing one
  ``zmq.Context`` per process. The publisher binds, subscribers connect (cereal's topology). One
  publisher per service and prefix: ZeroMQ's ``ipc://`` bind unlinks and replaces a live socket file
  (libzmq 4.3 ``ipc_listener_t::set_local_address``), so before binding :func:`pub_sock` takes an
  exclusive non-blocking ``flock`` on ``<runtime_dir(prefix)>/<service>.pub.lock`` (0600, holder's pid
  inside), held while the socket is open; a second publisher gets :class:`PublisherBusyError`.
- :func:`recv_one`, :func:`recv_one_or_none`, :func:`drain_sock` -- receive decoded events; malformed
  ones are counted per reason on the socket (:attr:`SubSocket.malformed`), logged once per reason and
  dropped.
- Bounded input: every subscriber sets ``ZMQ_MAXMSGSIZE`` to its service's ``max_bytes``
  (``msgs/services.py``), so ZeroMQ refuses a bigger message in its decoder, before buffering it.
  libzmq 4.3 (``session_base_t::engine_error``) treats that as a protocol error and drops the
  connection *without* reconnecting; a :class:`SubSocket` therefore watches its own connection
  (a ZeroMQ socket monitor, ``ZMQ_EVENT_DISCONNECTED``) and connects again itself
  (:meth:`SubSocket.heal`, run by every receive function here), counting each such loss in
  :attr:`SubSocket.disconnects`. ZeroMQ's event is the same for both causes; whether a publisher still
  listens at the socket's path tells them apart (:func:`loss_cause`): a connection lost while the publisher
  still runs is the message ZeroMQ dropped, one WARNING line naming the service and its bound -- the first at
  once, then at most one every :data:`DROP_LINE_INTERVAL_S` with the count since (a flood cannot fill the log);
  a publisher gone by then is INFO, once, naming the bound too (it may have sent a message over it just before:
  :func:`loss_line`). Give :func:`sub_sock` the loop's ``poller`` so that a lost connection wakes the loop even
  when no message arrives.
- Subscribers refuse planted socket paths as publishers do: a :class:`SubSocket` never connects through a
  symlink, nor to a regular file, a directory or another user's socket at its ``ipc://`` path
  (:class:`SocketPathError`, :meth:`SubSocket.connect`); a path with nothing there yet is waited for.
- :class:`PubMaster` and :class:`SubMaster` -- the aggregates. SubMaster's checks (alive / freq_ok /
  valid) are the pure :class:`~chestnut.msgs.submaster.SubMasterChecks`; this module adds sockets.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import socket
import stat
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import capnp
import zmq
from zmq.utils.monitor import parse_monitor_message

from chestnut.msgs.paths import (
    PREFIX_ENV,
    PROC_LOCKS,
    PrefixError,
    RuntimeDirError,
    SocketPathError,
    bind_private_socket,
    check_socket_path,
    current_prefix,
    flock_holders,
    runtime_dir,
)
from chestnut.msgs.schema import MAX_MESSAGE_BYTES, TRAVERSAL_LIMIT_WORDS, log
from chestnut.msgs.services import SERVICE_LIST, UnknownServiceError, get_service
from chestnut.msgs.submaster import SubMasterChecks

__all__ = [
    "READER_TRAVERSAL_LIMIT_WORDS",
    "REREADS",
    "REASON_FRAMING",
    "REASON_OVERSIZE",
    "REASON_POINTER",
    "REASON_UNKNOWN_MEMBER",
    "REASON_WRONG_SERVICE",
    "TCP_BASE_PORT_ENV",
    "MalformedMessageError",
    "PubMaster",
    "PubSocket",
    "PubLockError",
    "PublisherBusyError",
    "SocketPathError",
    "SubMaster",
    "SubSocket",
    "UnknownServiceError",
    "check_publishable",
    "check_reader_max_bytes",
    "context",
    "drain_sock",
    "drain_sock_raw",
    "endpoint",
    "log_from_bytes",
    "new_message",
    "pub_sock",
    "publisher_pid",
    "recv_one",
    "recv_one_or_none",
    "sub_sock",
    "take_pub_lock",
]

_log = logging.getLogger(__name__)

TCP_BASE_PORT_ENV = "CHESTNUT_TCP_BASE_PORT"
"""When set, every service uses TCP on loopback at ``base + <index of the service in SERVICE_LIST>``."""

# Malformed-message reasons (the keys of SubSocket.malformed / SubMaster.malformed[service]).
REASON_OVERSIZE = "oversize"  # longer than the service's max_bytes (or schema.MAX_MESSAGE_BYTES)
REASON_FRAMING = "framing"  # not a Cap'n Proto message: length, segment table, truncated segments
REASON_POINTER = "pointer"  # a pointer out of bounds, or the traversal limit exceeded
REASON_UNKNOWN_MEMBER = "unknown member"  # a union discriminant or enum value this schema does not name
REASON_WRONG_SERVICE = "wrong service"  # a well-formed Event whose union member is not the socket's service


READER_TRAVERSAL_LIMIT_WORDS = 16 * TRAVERSAL_LIMIT_WORDS
"""Traversal budget (64-bit words) of a reader returned by :func:`log_from_bytes`. The message was
already traversed in full once under ``TRAVERSAL_LIMIT_WORDS``, so this bounds only re-reads: every
read of a ``Data``/``Text``/list field counts its size again, and a reader over budget raises
``capnp.KjException`` on the next read. 16 whole-message re-reads of the largest accepted message
(~86 reads of a 1920x1080x3 frame's ``data``, ~5400 of a 128x256x3 one); copy big fields once rather
than re-reading them. A message whose check can count at most :data:`REREADS` whole-message reads' worth
of words less than ``TRAVERSAL_LIMIT_WORDS`` (:func:`check_reader_max_bytes`) is returned on its check's reader
instead, whose budget left is at least :data:`REREADS` whole-message re-reads."""

REREADS = 16
"""Whole-message re-reads that every reader :func:`log_from_bytes` returns allows at least."""


class MalformedMessageError(ValueError):
    """Bytes that are not a well-formed ``Event`` of this schema.

    ``reason`` is one of the ``REASON_*`` constants of this module; the message says what failed.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"malformed Event ({reason}): {detail}")
        self.reason = reason


# ---------------------------------------------------------------- endpoints


def endpoint(service: str, prefix: str | None = None, tcp_port: int | None = None) -> str:
    """The ZeroMQ address of ``service``.

    ``ipc://<runtime_dir(prefix)>/<service>`` (the private 0700 directory of ``msgs.paths``; ``prefix``
    defaults to ``$CHESTNUT_PREFIX``) unless TCP is asked for: an explicit ``tcp_port``, or
    ``$CHESTNUT_TCP_BASE_PORT`` (port = base + the service's index in ``SERVICE_LIST``). TCP is bound
    to 127.0.0.1 only, and the prefix does not apply to it (parallel stacks use different base ports).

    Raises :class:`UnknownServiceError` for a service not in the registry, ``ValueError`` for a bad
    port or prefix.
    """
    get_service(service)
    if tcp_port is None and (base := os.environ.get(TCP_BASE_PORT_ENV)):
        try:
            tcp_port = int(base) + list(SERVICE_LIST).index(service)
        except ValueError:
            raise ValueError(f"{TCP_BASE_PORT_ENV}={base!r} is not a port number") from None
    if tcp_port is not None:
        if not 1 <= tcp_port <= 65535:
            raise ValueError(f"TCP port {tcp_port} for {service!r} is outside 1..65535")
        return f"tcp://127.0.0.1:{tcp_port}"
    return f"ipc://{runtime_dir(prefix)}/{service}"


# ---------------------------------------------------------------- messages


def new_message(service: str | None = None, valid: bool = True, size: int | None = None) -> Any:
    """A new ``Event`` builder stamped with ``logMonoTime = time.monotonic_ns()`` (ns, CLOCK_MONOTONIC).

    ``service`` initialises that union member (``size`` = element count when the member is a list).
    Raises :class:`UnknownServiceError` for a name that is not a registered service.
    """
    msg = log.Event.new_message()
    msg.logMonoTime = time.monotonic_ns()
    msg.valid = valid
    if service is not None:
        get_service(service)
        if size is None:
            msg.init(service)
        else:
            msg.init(service, size)
    return msg


# Field kinds that can be malformed: pointers (out of bounds, over the traversal limit) and enums
# (a value this schema does not name). Other scalars cannot: reads outside a struct's data section
# return the default.
_CHECKED_KINDS = frozenset({"text", "data", "struct", "list", "anyPointer", "interface", "enum"})


_Check = Callable[[Any, bool], None]
"""One field's check: ``check(struct_reader, by_view)`` reads the field (resolving its pointer, or its enum)."""


class _StructPlan:
    """What to check in a struct: one check per checked non-union field and, per union member, the member's.

    Each check is a closure made once per schema field (:func:`_field_check`): it reads its field with
    pycapnp's ``_get_by_field`` (a third of the cost of ``getattr`` by name) and does its kind's check, with
    no dispatch on the kind per message -- a decode costs the capnp calls and little else.
    """

    __slots__ = ("checks", "union", "display_name")

    def __init__(self) -> None:
        self.checks: list[_Check] = []
        self.union: dict[str, list[_Check]] | None = None
        self.display_name = ""


_plans: dict[int, _StructPlan] = {}


def _struct_plan(schema: Any) -> _StructPlan:
    """The (memoised, recursion-safe) check plan of a ``_StructSchema``."""
    node_id = schema.node.id
    plan = _plans.get(node_id)
    if plan is None:
        plan = _plans[node_id] = _StructPlan()
        plan.display_name = schema.node.displayName
        fields = schema.fields
        plan.checks = [c for name in schema.non_union_fields for c in _field_checks(fields[name])]
        if schema.union_fields:
            plan.union = {name: _field_checks(fields[name]) for name in schema.union_fields}
    return plan


def _field_checks(field: Any) -> list[_Check]:
    """The check of ``field`` (a ``_StructSchema`` field), or none for a scalar that cannot be malformed."""
    kind = "struct" if field.proto.which() == "group" else field.proto.slot.type.which()
    if kind not in _CHECKED_KINDS:
        return []
    if kind == "data":
        return [_data_check(field, field.proto.name)]
    if kind == "struct":  # the field's read and its struct's walk in one call (as the enum's below)
        plan = _struct_plan(field.schema)
        if field.proto.which() == "group":  # inline in its parent: no pointer of its own, always walked
            def check_group(reader: Any, by_view: bool) -> None:
                _walk_struct(reader._get_by_field(field), plan, by_view)
            return [check_group]
        if not plan.checks and plan.union is None:  # scalars only: resolving the pointer is the whole check
            def check_flat(reader: Any, by_view: bool) -> None:
                reader._get_by_field(field)
            return [check_flat]

        def check_struct(reader: Any, by_view: bool) -> None:
            # an unset struct (a null pointer: the schema's defaults) has nothing to check: _has_by_field looks at
            # the pointer alone, where a read and a walk of the defaults cost three to four pycapnp calls
            if reader._has_by_field(field):
                _walk_struct(reader._get_by_field(field), plan, by_view)
        return [check_struct]
    if kind == "enum":
        count = len(field.schema.enumerants)

        def check_enum(reader: Any, by_view: bool) -> None:
            raw = reader._get_by_field(field).raw
            if raw >= count:
                raise _UnknownEnumerant(f"enum value {raw} (this schema names {count})")
        return [check_enum]
    if kind == "list":
        return [_field_check(field, _value_check(kind, _list_checks(field.schema,
                                                                     field.proto.slot.type.list.elementType)))]

    def read(reader: Any, by_view: bool) -> None:  # text, anyPointer, interface: resolving the pointer is the check
        reader._get_by_field(field)
    return [read]


def _field_check(field: Any, check_value: _Check) -> _Check:
    def check(reader: Any, by_view: bool) -> None:
        check_value(reader._get_by_field(field), by_view)
    return check


def _data_check(field: Any, name: str) -> _Check:
    def check(reader: Any, by_view: bool) -> None:
        if by_view:
            _check_data(reader, name)
        else:
            reader._get_by_field(field)  # a copy of at most the (small) message: cheaper than the view's upkeep
    return check


def _value_check(kind: str, sub: Any) -> _Check:
    """The check of one value (a field's or a list element's) of ``kind``: "struct" (``sub`` its plan), "enum"
    (``sub`` its enumerant count), "list" (``sub`` its ``(element kind, element sub)``) or "leaf"."""
    if kind == "struct":
        def check_struct(value: Any, by_view: bool) -> None:
            _walk_struct(value, sub, by_view)
        return check_struct
    if kind == "enum":
        def check_enum(value: Any, by_view: bool) -> None:
            if value.raw >= sub:
                raise _UnknownEnumerant(f"enum value {value.raw} (this schema names {sub})")
        return check_enum
    if kind == "list":
        elem_kind, elem_sub = sub
        if elem_kind == "leaf":
            def check_leaves(value: Any, by_view: bool) -> None:
                for _ in value:  # text/data elements are pointers; scalar elements cost one pass
                    pass
            return check_leaves
        check_elem = _value_check(elem_kind, elem_sub)

        def check_list(value: Any, by_view: bool) -> None:
            for item in value:
                check_elem(item, by_view)
        return check_list
    raise AssertionError(f"no value check for kind {kind!r}")


def _list_checks(list_schema: Any, elem_type: Any) -> tuple[str, Any]:
    """(element kind, element sub) of a ``_ListSchema`` whose element ``Type`` proto is ``elem_type``."""
    kind = elem_type.which()
    if kind == "struct":
        return kind, _struct_plan(list_schema.elementType)
    if kind == "enum":
        return kind, len(list_schema.elementType.enumerants)
    if kind == "list":
        return kind, _list_checks(list_schema.elementType, elem_type.list.elementType)
    return "leaf", None


class _UnknownEnumerant(Exception):
    pass


def _walk_struct(reader: Any, plan: _StructPlan, by_view: bool) -> str | None:
    """Resolve every pointer and enum reachable from ``reader``; returns its union member's name (if any).

    In Python, not one C++ call: pycapnp 2.2.4's ``total_size`` (capnp's own traversal of every pointer) aborts
    the whole process on a message over the traversal limit (the kj exception meets a ``noexcept`` frame and
    ``std::terminate`` runs), and it would check neither enums nor union discriminants.

    ``by_view``: read ``Data`` fields through a view (:func:`_check_data`: no copy, for a message of
    :data:`ZERO_COPY_MIN_BYTES` or more) rather than copying them (cheaper below: no ``ctypes`` call).

    Raises ``KjException`` on a bad pointer, :class:`_UnknownEnumerant` on a union discriminant or
    enum value the schema does not name.
    """
    for check in plan.checks:
        check(reader, by_view)
    if plan.union is not None:
        try:
            member = reader._which_str()  # which() less its Python wrapper: a fifth of the cost
        except capnp.KjException:
            raise _UnknownEnumerant(f"{plan.display_name}: union discriminant not in this schema") from None
        for check in plan.union[member]:
            check(reader, by_view)
        return member
    return None


def _data_view_leak() -> int | None:
    """References to its struct reader that one pycapnp ``get_data_as_view`` call leaks (None: unusable).

    pycapnp 2.2.4 (``capnp/lib/capnp.pyx`` ``_DynamicStructReader.get_data_as_view``) fills a ``Py_buffer``
    with ``PyBuffer_FillInfo(&buf, self, ...)``, which takes a reference to the reader, then wraps it with
    ``PyMemoryView_FromBuffer``, which (CPython ``Objects/memoryobject.c``) clears ``buf.obj`` and so never
    gives that reference back: each call keeps the reader, its message and the message's buffer alive
    forever (a logger leaked ~130 MB/min of 20 Hz frames). For an absent ``Data`` (a null pointer, data
    NULL) ``PyMemoryView_FromBuffer`` raises ``ValueError`` after the reference was taken. Measured once
    here on probe messages (non-empty, empty, absent), so a pycapnp that fixes it (0) is handled too;
    anything else falls back to reading (copying) the bytes."""
    leaks = set()
    for data in (bytes(8), b"", None):
        msg = log.Event.new_message()
        cf = msg.init("cameraFrame")
        if data is not None:
            cf.data = data
        try:
            cf = _reader(msg.to_bytes(), None).cameraFrame
            before = sys.getrefcount(cf)
            try:
                view = cf.get_data_as_view("data")
                if data is None or bytes(view) != data:
                    return None
                del view
            except ValueError:
                if data is not None:
                    return None
            leaks.add(sys.getrefcount(cf) - before)
        except Exception:  # an API that changed
            return None
    return leaks.pop() if len(leaks) == 1 and leaks <= {0, 1} else None


def _check_data_by_view(reader: Any, name: str) -> None:
    """Follow (and so bounds-check) a ``Data`` pointer without copying its bytes: a view, dropped at once.
    Raises ``capnp.KjException`` for a bad pointer (no reference taken then). The reference pycapnp took and never
    gives back (see :func:`_data_view_leak`) is given back later, off the event's path (:func:`_give_back_views`)."""
    try:
        reader.get_data_as_view(name)
    except ValueError:  # an absent Data (null pointer): well-formed, and the reference was taken all the same
        pass
    if _DATA_VIEW_LEAK:
        _viewed.append(reader)


_viewed: list[Any] = []
"""Struct readers that hold one reference pycapnp's ``get_data_as_view`` took (:func:`_data_view_leak`) and that
:func:`_give_back_views` has not given back yet: those of the last decode at most, as every decode gives back the
ones before it first."""


def _give_back_views() -> None:
    """Give back the references pycapnp's data views took (:data:`_viewed`); a reader, its message and the message's
    buffer are freed once their holders are gone.

    Run at the start of each decode and by the receive functions once a socket's queue is empty (the ``zmq.Again``
    that ends a drain), so the call into C (``ctypes``, ~0.3 us hot but 10-15 us on the cold caches of one frame
    every 4 ms, measured with a paced loop) is off the path of the event it follows: a frame's decode spends it
    after the event was handed over, or before the next frame's when one follows at once. Thread-safe: each
    reference is popped, and so given back, once."""
    while _viewed:
        try:
            reader = _viewed.pop()
        except IndexError:  # another thread gave back the last one meanwhile
            return
        _py_decref(reader)


def _check_data_by_copy(reader: Any, name: str) -> None:
    getattr(reader, name)  # a copy


def log_from_bytes(data: bytes | bytearray | memoryview) -> Any:
    """Decode one ``Event`` (a ``_DynamicStructReader``) from its unpacked Cap'n Proto bytes.

    Every pointer and enum of the message is resolved once here, under the bounded traversal limit
    ``schema.TRAVERSAL_LIMIT_WORDS`` (64-bit words), so a returned reader never raises later on a
    malformed field. The returned reader allows at least :data:`REREADS` whole-message re-reads: a fresh
    one with the (bounded) budget :data:`READER_TRAVERSAL_LIMIT_WORDS`, or, for a message of a member without
    lists no longer than :func:`check_reader_max_bytes` of its pointers, the check's own. Zero-copy: it
    keeps ``data`` alive (``bytes`` or a received ``zmq.Frame`` as given, anything else copied once into
    ``bytes``), and the check reads ``Data`` fields without copying them.

    Raises :class:`MalformedMessageError` with ``reason``: ``oversize`` (more than
    ``schema.MAX_MESSAGE_BYTES`` bytes), ``framing`` (length not a multiple of 8, bad segment table,
    truncated), ``pointer`` (out-of-bounds pointer or traversal limit exceeded), ``unknown member``
    (union discriminant unknown to this schema, e.g. from a newer writer).
    """
    return _decode_event(data)[0]


def _decode_event(data: bytes | bytearray | memoryview | zmq.Frame) -> tuple[Any, str]:
    """:func:`log_from_bytes` that also returns the event's union member name.

    ``data`` that is not ``bytes`` is read in place when it is 8-byte aligned (a received ``zmq.Frame``:
    the readers pin its buffer), else copied once into ``bytes``."""
    if _viewed:
        _give_back_views()
    if len(data) > MAX_MESSAGE_BYTES:
        raise MalformedMessageError(REASON_OVERSIZE, f"{len(data)} bytes > limit {MAX_MESSAGE_BYTES}")
    buf: bytes | zmq.Frame = data if type(data) is bytes or isinstance(data, zmq.Frame) else bytes(data)
    try:
        check = _reader(buf, TRAVERSAL_LIMIT_WORDS)
    except (ValueError, capnp.KjException) as e:
        if not isinstance(buf, zmq.Frame) or "unaligned" not in str(e):
            raise MalformedMessageError(REASON_FRAMING, _first_line(e)) from None
        return _decode_event(buf.bytes)  # a frame ZeroMQ placed off the 8-byte grid capnp requires
    try:
        member = _walk_struct(check, _EVENT_PLAN, len(buf) >= ZERO_COPY_MIN_BYTES)
    except _UnknownEnumerant as e:
        raise MalformedMessageError(REASON_UNKNOWN_MEMBER, str(e)) from None
    except (capnp.KjException, ValueError) as e:
        raise MalformedMessageError(REASON_POINTER, _first_line(e)) from None
    if member is None:  # Event always has a union
        member = ""
    if len(buf) <= _CHECK_READER_MAX_BYTES.get(member, -1):
        return check, member
    return _reader(buf, READER_TRAVERSAL_LIMIT_WORDS), member


def _pointer_bound(schema: Any, member: str | None = None, open_structs: frozenset[int] = frozenset()) -> int | None:
    """The most pointers a check of one struct of ``schema`` (a ``_StructSchema``) follows, the struct's own
    included: 1 + its non-union pointer fields' bounds + its union member's (``member``; None: the largest).
    ``None`` when the schema does not bound it: a list field (its element count is the message's) or a struct
    that contains itself."""
    node_id = schema.node.id
    if node_id in open_structs:
        return None
    inner = open_structs | {node_id}
    fields = schema.fields

    def field_bound(name: str) -> int | None:
        field = fields[name]
        if field.proto.which() == "group":  # inline in its parent: no pointer of its own
            sub = _pointer_bound(field.schema, None, inner)
            return None if sub is None else sub - 1
        kind = field.proto.slot.type.which()
        if kind == "list":
            return None
        if kind == "struct":
            return _pointer_bound(field.schema, None, inner)
        return 1 if kind in ("text", "data", "anyPointer", "interface") else 0

    bounds = [field_bound(name) for name in schema.non_union_fields]
    union = [field_bound(member)] if member is not None else [field_bound(name) for name in schema.union_fields]
    if None in bounds or None in union:
        return None
    return 1 + sum(b for b in bounds if b is not None) + max((b for b in union if b is not None), default=0)


_MEMBER_POINTERS = {member: _pointer_bound(log.Event.schema, member) for member in log.Event.schema.union_fields}
"""Per ``Event`` union member: the most pointers its check follows (None: unbounded by the schema)."""

# What one pointer the check follows can count against the traversal limit, beyond the message's own words
# (capnp ``WireHelpers``: a far pointer's landing pad; a struct, list or blob is counted by its words, all inside
# the message's segments; zero-sized list elements, counted a word each, come only with lists, never bounded)
_POINTER_EXTRA_WORDS = 2


def check_reader_max_bytes(pointers: int | None) -> int:
    """The longest message (bytes) whose check, following at most ``pointers`` pointers, leaves its reader
    (budget ``TRAVERSAL_LIMIT_WORDS``) :data:`REREADS` whole-message re-reads: ``pointers`` times the most
    words one can count (the message's words + :data:`_POINTER_EXTRA_WORDS`), ``REREADS + 1`` times, fit the
    limit. -1 for ``None`` (unbounded: a list field)."""
    if pointers is None:
        return -1
    return (TRAVERSAL_LIMIT_WORDS // (pointers * (REREADS + 1)) - _POINTER_EXTRA_WORDS) * 8 + 7


_CHECK_READER_MAX_BYTES = {member: check_reader_max_bytes(n) for member, n in _MEMBER_POINTERS.items()}
"""Per ``Event`` union member: up to this many bytes :func:`log_from_bytes` returns the check's own reader,
and makes no second one (a sixth of a small message's decode)."""


def _flat_reader_class() -> Any:
    """pycapnp's message reader over one contiguous buffer (``capnp/lib/capnp.pyx``
    ``_FlatArrayMessageReader``, internal to the module), taken from a reader ``from_bytes`` made.

    Made directly, it skips ``from_bytes``'s context manager (half the cost of a decode) and, unlike it,
    keeps a non-``bytes`` buffer (a ``zmq.Frame``) pinned until the reader is gone: ``from_bytes``
    releases the buffer when its ``with`` block ends, while the reader may still be read."""
    with log.Event.from_bytes(log.Event.new_message().to_bytes()) as probe:
        return type(probe._parent)


_FLAT_READER = _flat_reader_class()
_SERIALISED = (bytes, bytearray, memoryview)  # what PubMaster.send takes as bytes (a tuple: no union built a call)
_EVENT_SCHEMA = log.Event.schema


def _reader(buf: bytes | zmq.Frame, limit: int | None) -> Any:
    """An ``Event`` reader over ``buf`` with a traversal budget of ``limit`` 64-bit words; it keeps ``buf``
    alive. Raises ``ValueError`` (length not a multiple of 8) or ``capnp.KjException`` (framing)."""
    return _FLAT_READER(buf, limit).get_root(_EVENT_SCHEMA)


_EVENT_PLAN = _struct_plan(log.Event.schema)
_py_decref = ctypes.pythonapi.Py_DecRef
_py_decref.argtypes, _py_decref.restype = [ctypes.py_object], None
_DATA_VIEW_LEAK = _data_view_leak()
_check_data = _check_data_by_copy if _DATA_VIEW_LEAK is None else _check_data_by_view


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


# ---------------------------------------------------------------- sockets


def context() -> zmq.Context:
    """The process's shared ZeroMQ context (a new one after ``fork``; pyzmq's ``Context.instance``)."""
    return zmq.Context.instance()


REFUSED_PATH_RECHECK_S = 1.0
"""How often :meth:`SubSocket.heal` looks again at a socket path it refused (s): the 1 Hz of a node's state."""
DROP_LINE_INTERVAL_S = 60.0
"""At most one WARNING line per subscriber this often (s) for messages ZeroMQ dropped over the bound
(:meth:`SubSocket.heal`): the first at once, each later one with the count since the line before. Our choice: the
logger's status interval (``msgs/logger.py`` ``STATUS_INTERVAL_S``); a flood of 20 Hz oversized frames is then one
line a minute, not 20 a second."""


class SubSocket(zmq.Socket):
    """A SUB socket bound to one service; counts malformed messages per reason and heals lost connections.

    Attributes: ``service`` (str), ``malformed`` (``Counter`` reason -> count), ``max_bytes`` (the
    service's bound, bytes, set as ``ZMQ_MAXMSGSIZE``), ``zero_copy`` (messages of
    :data:`ZERO_COPY_MIN_BYTES` or more are decoded in place: the service's bound allows them), ``addr``
    (the endpoint), ``conn_monitor`` (the
    ``ZMQ_EVENT_DISCONNECTED`` monitor, a PAIR socket), ``disconnects`` (connections lost and made
    again: a message over ``max_bytes`` refused by ZeroMQ, or a publisher that went away), ``dropped_over_bound``
    (the losses among them that were a message refused while its publisher ran, or over TCP a cause unknown:
    :func:`loss_cause`).
    """

    service: str = ""
    malformed: Counter[str] | None = None
    max_bytes: int = 0
    zero_copy: bool = False
    addr: str = ""
    conn_monitor: zmq.Socket | None = None
    disconnects: int = 0
    losses_logged: frozenset[str] = frozenset()  # the causes of a lost connection logged so far (heal)
    dropped_over_bound: int = 0  # losses that were a dropped message (LOSS_REFUSED / LOSS_UNKNOWN): heal
    drops_unsaid: int = 0  # of those, not yet in a line (heal: one line per DROP_LINE_INTERVAL_S at most)
    drop_said_ns: int | None = None  # when the last such line was said (monotonic ns)
    drop_cause: tuple[str, int | None] | None = None  # the last drop's cause and publisher pid (heal)
    path_refused_ns: int | None = None  # heal: when the endpoint's path was last refused (left disconnected)
    _poller: zmq.Poller | None = None

    def heal(self) -> bool:
        """Connect again after each lost connection the monitor reports (never blocks); True if it did.

        libzmq reconnects by itself after a publisher went away, but not after a protocol error such as
        a message over ``ZMQ_MAXMSGSIZE``: disconnecting and connecting the endpoint again covers both.
        Call it once the queue is drained: disconnecting drops what the old connection still holds.
        A path that now holds something that is not a socket of ours (:meth:`connect`) is refused as at the
        start, but a running program keeps running on its other inputs: one WARNING line, the endpoint left
        disconnected and the path checked again at most every :data:`REFUSED_PATH_RECHECK_S` on later calls
        (connected once it is clean, one INFO line).

        Each loss is said as :func:`loss_cause` finds it (:func:`loss_line`): a publisher gone, INFO, once; a
        message dropped over the bound (or over TCP, either), WARNING, the first at once and then at most one line
        every :data:`DROP_LINE_INTERVAL_S` with the count since the last line, said by the first call after the
        interval whether or not another drop came (``dropped_over_bound`` counts them all). Never raises for a
        cause it cannot read: the line names what is known.
        """
        if self.path_refused_ns is not None:
            if time.monotonic_ns() - self.path_refused_ns < int(REFUSED_PATH_RECHECK_S * 1e9):
                return False
            return self._connect_checked()
        if self.drops_unsaid and self.drop_cause is not None:  # a burst's tail: said once its interval is over,
            self._say_drops(*self.drop_cause)  # with no drop after it as with one
        if self.conn_monitor is None or not int(self.conn_monitor.get(zmq.EVENTS)) & zmq.POLLIN:
            return False
        lost = 0
        while True:
            try:
                frames = self.conn_monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED:
                lost += 1
        if not lost:
            return False
        self.disconnects += lost
        cause, holder = loss_cause(self.addr)
        with contextlib.suppress(zmq.ZMQError):
            self.disconnect(self.addr)
        if cause != LOSS_PUBLISHER_GONE:
            self.dropped_over_bound += lost
            self.drops_unsaid += lost
            self.drop_cause = (cause, holder)
        if not self._connect_checked():  # said by _connect_checked; the drops are said with the next line
            return False
        if cause == LOSS_PUBLISHER_GONE:
            if cause not in self.losses_logged:  # once; the rest are only counted in ``disconnects``
                self.losses_logged = self.losses_logged | {cause}
                _log.info("%s", loss_line(self.service, cause, self.max_bytes))
        else:
            self._say_drops(cause, holder)
        return True

    def _say_drops(self, cause: str, holder: int | None) -> None:
        """Say the messages dropped over the bound (``drops_unsaid``): at once for the first, then at most one
        line every :data:`DROP_LINE_INTERVAL_S` with every drop since the last line."""
        now = time.monotonic_ns()
        if self.drop_said_ns is not None and now - self.drop_said_ns < int(DROP_LINE_INTERVAL_S * 1e9):
            return
        first = self.drop_said_ns is None
        self.losses_logged = self.losses_logged | {cause}
        _log.warning("%s", loss_line(self.service, cause, self.max_bytes, holder=holder, dropped=self.drops_unsaid,
                                     first=first))
        self.drop_said_ns, self.drops_unsaid = now, 0

    def _connect_checked(self) -> bool:
        """:meth:`connect` to ``addr`` again from :meth:`heal`; False (logged once per refusal) when the path is
        refused."""
        try:
            self.connect(self.addr)
        except SocketPathError as e:
            if self.path_refused_ns is None:
                _log.warning("%s: connection lost, and socket path %s now holds %s: refused, nothing replaced; not "
                             "subscribed until it is removed (looked at every %g s)", self.service, e.path, e.what,
                             REFUSED_PATH_RECHECK_S)
            self.path_refused_ns = time.monotonic_ns()
            return False
        if self.path_refused_ns is not None:
            _log.info("%s: socket path %s no longer refused; subscribed again", self.service,
                      self.addr.removeprefix("ipc://"))
            self.path_refused_ns = None
        return True

    def connect(self, addr: str) -> Any:  # type: ignore[override]
        """Connect to ``addr``; an ``ipc://`` path that holds anything but nothing or a socket of ours (a symlink,
        never followed; a regular file, a directory, another user's socket) is refused first with
        :class:`SocketPathError` and nothing is connected -- the publishers' rule (``msgs/paths.py``
        :func:`~chestnut.msgs.paths.check_socket_path`). Nothing there yet: connected as ever, and libzmq joins the
        publisher once it binds. Checked at each connect made here (:func:`sub_sock`, :meth:`heal`); libzmq's own
        reconnects in between resolve the path without asking."""
        if addr.startswith("ipc://"):
            check_socket_path(addr.removeprefix("ipc://"))
        return super().connect(addr)

    def close(self, linger: int | None = None) -> None:
        if self.conn_monitor is not None:
            if self._poller is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self._poller.unregister(self.conn_monitor)
            with contextlib.suppress(zmq.ZMQError):
                self.disable_monitor()
            self.conn_monitor.close(linger=0)
            self.conn_monitor = None
        super().close(linger)

    def count_malformed(self, err: MalformedMessageError) -> None:
        """Count ``err`` under its reason; the first of each reason is logged (WARNING)."""
        assert self.malformed is not None
        self.malformed[err.reason] += 1
        if self.malformed[err.reason] == 1:
            _log.warning("%s: dropped a malformed message: %s (further ones are only counted)", self.service, err)


LOSS_PUBLISHER_GONE = "publisher gone"
LOSS_REFUSED = "refused"
LOSS_UNKNOWN = "unknown"


def size_text(n: int) -> str:
    """``n`` bytes as a person reads a bound: ``16 MiB``, ``64 KiB``, else ``1000 bytes``."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def loss_line(service: str, cause: str, max_bytes: int, *, holder: int | None = None, dropped: int = 1,
              first: bool = True) -> str:
    """The one line a subscriber of ``service`` logs for a lost connection of ``cause`` (:func:`loss_cause`).

    ZeroMQ's event does not say why (see :func:`loss_cause`). A connection lost while the publisher still listens
    (:data:`LOSS_REFUSED`) is a message over the service's bound (``max_bytes``, ``ZMQ_MAXMSGSIZE``) that ZeroMQ
    dropped: said as a drop, with the bound and the publisher's pid where its lock names one (``holder``). Its size
    is not known here and the line says so: libzmq refuses the message at its length header (``v2_decoder_t::
    size_ready``, ``EMSGSIZE``), before a byte of it is buffered, and reports only the lost connection. ``dropped``
    (messages) and ``first`` word the later, rate-limited lines (:data:`DROP_LINE_INTERVAL_S`). A publisher gone
    (a stack's stop, a restart) is said first and calmly, with the bound after it (a message over it just before
    the stop leaves the same traces); over TCP (:data:`LOSS_UNKNOWN`) the line names both causes it may have been.
    """
    bound = f"the service's {size_text(max_bytes)} bound"
    if cause == LOSS_PUBLISHER_GONE:
        return (f"{service}: its publisher stopped or restarted; waiting for its next message (one over {bound} sent "
                "just before the stop would have been dropped with the connection: ZeroMQ's maxmsgsize)")
    later = (f"further drops: at most one line every {DROP_LINE_INTERVAL_S:g} s, with their count" if first
             else f"at most one line every {DROP_LINE_INTERVAL_S:g} s")
    what = (("a message" if dropped == 1 else f"{dropped} messages") if first
            else f"{dropped} message(s) since the last such line")
    if cause == LOSS_REFUSED:
        who = "its publisher" + (f" (pid {holder})" if holder is not None else "")
        return (f"{service}: dropped {what} over {bound}: ZeroMQ's maxmsgsize refuses one at its length header, "
                f"unread, so its size is not known here, and drops the connection while {who} still runs; connected "
                f"again ({later})")
    times = "" if first else f" {dropped} time(s) since the last such line"
    return (f"{service}: lost the connection to its publisher{times}: it went away or sent a message over {bound} "
            f"(ZeroMQ's maxmsgsize drops the connection; over TCP the two cannot be told apart); connected again "
            f"({later})")


def loss_cause(addr: str, proc_locks: str | None = None) -> tuple[str, int | None]:
    """Why a subscriber of ``addr`` lost its connection: whether a publisher still listens at the socket's path.

    libzmq 4.3 reports both a publisher that went away and a message over ``ZMQ_MAXMSGSIZE`` as
    ``ZMQ_EVENT_DISCONNECTED`` (``stream_engine_base_t::error`` emits no other event for a protocol error
    after the handshake; ``ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL`` covers the handshake only), so the event
    alone cannot tell them apart. The socket's path can, for ``ipc://``: :meth:`PubSocket.close` unlinks the
    socket file before it closes the socket, and a killed publisher's file stays with no listener behind it (the
    kernel closed it with the process). So a connect to the path (a plain Unix socket, closed at once: the
    publisher's libzmq sees a peer that left during its greeting and goes on) tells: nothing there, or refused
    (``ECONNREFUSED``), is :data:`LOSS_PUBLISHER_GONE`; accepted (or its backlog full, ``EAGAIN``) is a
    publisher that still runs, so the connection was dropped for a message over the bound:
    :data:`LOSS_REFUSED`, with the pid of the publisher lock's holder where one holds it (None for a publisher
    that took no lock: one of ours holds it while it runs, ``take_pub_lock``; any other ZeroMQ PUB bound there
    does not). A path the probe may not use (``EACCES``) falls back on the lock: no live holder is gone. TCP:
    :data:`LOSS_UNKNOWN`. Returns ``(cause, pid)``.

    Before, a live socket file without a live lock holder read as a publisher gone, so a message over the bound
    from a publisher that took no lock (a script's own ZeroMQ socket) was said as "its publisher stopped or
    restarted" and its drop nowhere.

    The path is read when the loss is handled, not when it happened: a publisher that sent a message over the
    bound and then stopped (or was killed) before that reads as gone, which :func:`loss_line` words as such; one
    that went away and was back before it reads as running. A socket monitor that also reported
    ``ZMQ_EVENT_CONNECT_RETRIED`` (libzmq reconnects after a publisher went away, not after a protocol error)
    would tell them apart, but it fires every ``RECONNECT_IVL_MS`` while a publisher is away, and libzmq blocks
    its I/O thread once an unread monitor's queue is full."""
    if not addr.startswith("ipc://"):
        return LOSS_UNKNOWN, None
    path = addr.removeprefix("ipc://")
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return LOSS_PUBLISHER_GONE, None
    except OSError:
        return LOSS_PUBLISHER_GONE, None
    holder = _flock_holder(path + PUB_LOCK_SUFFIX, PROC_LOCKS if proc_locks is None else proc_locks)
    listening = _listening(path)
    if listening is None:  # the probe could not tell: the lock does
        return (LOSS_PUBLISHER_GONE, None) if holder is None else (LOSS_REFUSED, holder)
    return (LOSS_REFUSED, holder) if listening else (LOSS_PUBLISHER_GONE, None)


def _listening(path: str) -> bool | None:
    """Whether something accepts connections on the Unix socket at ``path``: a non-blocking connect, closed at
    once. True: accepted, or its backlog is full (``EAGAIN``); False: nothing there or refused (a socket file its
    process left behind); None: the connect was not allowed (``EACCES``, ...), so it cannot tell."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        probe.connect(path)
    except BlockingIOError:
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return None
    finally:
        probe.close()
    return True


PUB_LOCK_SUFFIX = ".pub.lock"
"""``<runtime_dir(prefix)>/<service><PUB_LOCK_SUFFIX>``: the lock file of a service's publisher."""
PUB_LOCK_MODE = 0o600
_PID_READ_BYTES = 32  # a pid and a newline; the rest of a (tampered) lock file is never read


class PublisherBusyError(RuntimeError):
    """Another open file (a live process) holds the publisher lock of ``service`` on ``prefix``.

    ``str()`` is one line: which service, prefix and lock file, the holder's pid (``holder``, None when
    it has not written it yet) and how to go on. Attributes: ``service``, ``prefix``, ``path``, ``holder``.
    """

    def __init__(self, service: str, prefix: str, path: str, holder: int | None) -> None:
        who = f"pid {holder}" if holder is not None else "another process"
        stop = f"stop it (kill {holder})" if holder is not None else "stop it"
        super().__init__(
            f"{service} is already published on prefix {prefix!r} by {who} (lock {path}); "
            f"{stop}, or choose another prefix with {PREFIX_ENV}=NAME"
        )
        self.service = service
        self.prefix = prefix
        self.path = path
        self.holder = holder


START_REFUSALS: tuple[type[Exception], ...] = (RuntimeDirError, PrefixError, PublisherBusyError)
"""What refuses a program's start in one line, exit 2, said by its caller (``launch/cli.py`` ``main``, ``node/main.py``
``main``): a subverted runtime directory or socket path, a malformed ``CHESTNUT_PREFIX``, a service another live
process already publishes."""


class PubLockError(RuntimeDirError):
    """The publisher lock file is not one of ours: a symlink, not a regular file, another user's, or
    reachable by group/other. ``str()`` is one line: which file, what is wrong, how to fix. A
    :class:`~chestnut.msgs.paths.RuntimeDirError`, so the programs refuse it as they refuse a subverted
    runtime directory (one line, exit 2). ``path`` is the lock file."""

    def __init__(self, path: str, problem: str) -> None:
        PermissionError.__init__(
            self, f"publisher lock file {path} {problem}: not ours, refused; remove it (rm {path}) and start again"
        )
        self.path = Path(path)


def _check_lock_file(path: str, st: os.stat_result) -> None:
    """Refuse (:class:`PubLockError`) a lock file that is not a regular file of ours, mode 0600 or stricter."""
    if not stat.S_ISREG(st.st_mode):
        raise PubLockError(path, "is not a regular file")
    if st.st_uid != os.geteuid():
        raise PubLockError(path, f"belongs to uid {st.st_uid}, not to uid {os.geteuid()}")
    if st.st_mode & 0o077:
        raise PubLockError(path, f"is reachable by group/other (mode {stat.S_IMODE(st.st_mode):04o})")


def _lock_holder(fd: int) -> int | None:
    """The pid written in a publisher lock file (bounded read), or None when absent or garbled."""
    try:
        text = os.pread(fd, _PID_READ_BYTES, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def take_pub_lock(service: str, prefix: str | None = None) -> int:
    """Take the publisher lock of ``service`` on ``prefix`` (see the module docstring); returns its fd.

    The file is opened with ``O_NOFOLLOW | O_CLOEXEC`` in the private runtime directory and locked with
    ``flock(LOCK_EX | LOCK_NB)`` (an exec'd child does not inherit it; the lock goes with the last
    close of the fd, so a killed holder frees it). Raises :class:`PublisherBusyError` when held,
    :class:`PubLockError` when the file is not ours (a symlink, a FIFO, a directory, another user's, or
    reachable by group/other: never followed, opened for blocking or written), ``ValueError`` /
    :class:`~chestnut.msgs.paths.RuntimeDirError` from :func:`runtime_dir`.
    """
    prefix = current_prefix() if prefix is None else prefix
    path = f"{runtime_dir(prefix)}/{service}{PUB_LOCK_SUFFIX}"
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO must not block
    try:
        fd = os.open(path, flags, PUB_LOCK_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PubLockError(path, "is a symlink") from None
        if e.errno in (errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP):
            raise PubLockError(path, "is not a regular file") from None
        raise
    try:
        _check_lock_file(path, os.fstat(fd))
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(fd)
        os.close(fd)
        raise PublisherBusyError(service, prefix, path, holder) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def check_publishable(service: str, prefix: str | None = None) -> None:
    """Refuse now what would stop :func:`pub_sock` from publishing ``service`` on ``prefix``, binding nothing:
    the publisher lock is taken and at once released, and the socket's path checked (``ipc://`` only; a TCP
    endpoint has neither). For a program that starts publishers later, in children, to say up front in one
    line what a child would only log. Raises :class:`PubLockError`, :class:`PublisherBusyError`,
    :class:`SocketPathError`, :class:`~chestnut.msgs.paths.RuntimeDirError`."""
    addr = endpoint(service, prefix)
    if addr.startswith("ipc://"):
        fd = take_pub_lock(service, prefix)
        try:
            check_socket_path(addr.removeprefix("ipc://"))
        finally:
            os.close(fd)


def publisher_pid(service: str, prefix: str | None = None, proc_locks: str = PROC_LOCKS) -> int | None:
    """The pid of the live process publishing ``service`` on ``prefix`` (``ipc://`` only), else None.

    Read-only: the lock file is never created or locked here (a probe that took the lock, even for an
    instant, could refuse a publisher starting at that moment). A publisher is live when ``/proc/locks``
    lists a ``FLOCK`` on the lock file's inode; its pid is that entry's. Raises what :func:`runtime_dir` does.
    """
    return _flock_holder(f"{runtime_dir(prefix)}/{service}{PUB_LOCK_SUFFIX}", proc_locks)


def _flock_holder(path: str, proc_locks: str) -> int | None:
    """The pid of the live process holding a ``flock`` on ``path`` (``msgs/paths.py`` ``flock_holders``), else None."""
    holders = flock_holders(path, proc_locks)
    return holders[0] if holders else None


class PubSocket(zmq.Socket):
    """A PUB socket that holds its service's publisher lock (``pub_lock_fd``, -1 for TCP) until closed.

    ``ipc_file``: the ``ipc://`` socket file this socket bound and ``ipc_file_id`` its ``(st_dev,
    st_ino)`` right after the bind. :meth:`close` unlinks that file while the lock is still held (no
    other publisher can have bound the path meanwhile) and only if it is still the same inode, so a
    clean exit leaves no socket file behind; then it closes the socket and releases the lock."""

    pub_lock_fd: int = -1
    ipc_file: str | None = None
    ipc_file_id: tuple[int, int] | None = None

    def close(self, linger: int | None = None) -> None:
        if self.ipc_file is not None and self.ipc_file_id is not None and self.pub_lock_fd >= 0:
            with contextlib.suppress(OSError):
                st = os.lstat(self.ipc_file)
                if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self.ipc_file_id:
                    os.unlink(self.ipc_file)
            self.ipc_file = self.ipc_file_id = None
        super().close(linger)
        if self.pub_lock_fd >= 0:
            os.close(self.pub_lock_fd)
            self.pub_lock_fd = -1


def pub_sock(service: str, prefix: str | None = None, tcp_port: int | None = None) -> PubSocket:
    """A PUB socket bound to :func:`endpoint` of ``service``, holding the service's publisher lock.

    Raises :class:`UnknownServiceError`, :class:`PublisherBusyError` when another live publisher of
    ``service`` on ``prefix`` holds the lock (``ipc://`` only: a TCP port in use fails the bind itself),
    :class:`SocketPathError` when a file, directory, symlink or another user's socket lies at the socket's path
    (never replaced: :func:`~chestnut.msgs.paths.check_socket_path`).
    """
    addr = endpoint(service, prefix, tcp_port)
    lock_fd = take_pub_lock(service, prefix) if addr.startswith("ipc://") else -1
    try:
        sock = context().socket(zmq.PUB, socket_class=PubSocket)
    except BaseException:
        if lock_fd >= 0:
            os.close(lock_fd)
        raise
    sock.pub_lock_fd = lock_fd
    try:
        if lock_fd >= 0:  # the lock is ours: nobody else binds here now
            check_socket_path(addr.removeprefix("ipc://"))
        sock.setsockopt(zmq.LINGER, 0)
        if addr.startswith("ipc://"):  # the socket file 0600 whatever the umask (msgs/paths.py bind_private_socket)
            bind_private_socket(addr.removeprefix("ipc://"), lambda: sock.bind(addr))
        else:
            sock.bind(addr)
        if lock_fd >= 0:
            st = os.lstat(addr.removeprefix("ipc://"))
            sock.ipc_file, sock.ipc_file_id = addr.removeprefix("ipc://"), (st.st_dev, st.st_ino)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


RECONNECT_IVL_MS = 10
"""How often a SUB socket tries to reach a publisher that is not there (ZMQ_RECONNECT_IVL, ms); local ipc
connects cost microseconds, so 10 ms costs nothing while a publisher restarts."""


def sub_sock(
    service: str,
    poller: zmq.Poller | None = None,
    conflate: bool = False,
    timeout_ms: int | None = None,
    prefix: str | None = None,
    tcp_port: int | None = None,
    rcvhwm: int | None = None,
) -> SubSocket:
    """A SUB socket connected to :func:`endpoint` of ``service``, subscribed to everything.

    ``ZMQ_MAXMSGSIZE`` is the service's ``max_bytes``; ``conflate`` keeps only the newest message
    (ZMQ_CONFLATE); ``timeout_ms`` bounds a blocking :func:`recv_one` (None = block forever);
    ``rcvhwm`` sets ZMQ_RCVHWM (messages); ``poller`` registers the socket and its connection
    monitor for ``POLLIN`` (drain the socket when the poll returns: that also heals it).
    Raises :class:`UnknownServiceError`, and :class:`SocketPathError` when a file, directory, symlink or another
    user's socket lies at the ``ipc://`` socket's path (never connected through: :meth:`SubSocket.connect`);
    nothing at the path is no error (the publisher is waited for).
    """
    addr = endpoint(service, prefix, tcp_port)
    sock = context().socket(zmq.SUB, socket_class=SubSocket)
    try:
        _set_up_sub(sock, service, addr, conflate, timeout_ms, rcvhwm)
    except BaseException:
        sock.close(linger=0)
        raise
    if poller is not None:
        poller.register(sock, zmq.POLLIN)
        poller.register(sock.conn_monitor, zmq.POLLIN)
        sock._poller = poller
    return sock


def _set_up_sub(sock: SubSocket, service: str, addr: str, conflate: bool, timeout_ms: int | None,
                rcvhwm: int | None) -> None:
    """:func:`sub_sock`'s options, connection monitor and connect for ``sock``."""
    sock.service = service
    sock.malformed = Counter()
    sock.max_bytes = get_service(service).max_bytes
    sock.zero_copy = sock.max_bytes >= ZERO_COPY_MIN_BYTES
    sock.addr = addr
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, sock.max_bytes)
    # rejoin a restarted publisher within RECONNECT_IVL_MS, not libzmq's default 100 ms: a publisher's
    # messages before a subscriber has joined are dropped (ZeroMQ's "slow joiner"), and a restarted node's
    # first chestnutActive=false must reach the consumers that still hold its predecessor's last true
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    if conflate:
        sock.setsockopt(zmq.CONFLATE, 1)
    if timeout_ms is not None:
        sock.setsockopt(zmq.RCVTIMEO, int(timeout_ms))
    if rcvhwm is not None:
        sock.setsockopt(zmq.RCVHWM, int(rcvhwm))
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.conn_monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(addr)


ZERO_COPY_MIN_BYTES = 65536
"""Messages this big or bigger are received without a copy (``recv(copy=False)``: the decoded event reads
the ZeroMQ frame in place) on a socket whose service's ``max_bytes`` allows them; smaller ones are copied
into ``bytes``, which costs less than a ``zmq.Frame`` below it. pyzmq's own send-side
``zmq.COPY_THRESHOLD`` (65536) is the same trade; measured with ``tests/bench/bench_pubsub.py``."""


def _recv(sock: SubSocket) -> bytes | zmq.Frame:
    """One queued message (``zmq.NOBLOCK``; raises ``zmq.Again`` when none is)."""
    if not sock.zero_copy:
        return sock.recv(zmq.NOBLOCK)
    frame = sock.recv(zmq.NOBLOCK, copy=False)
    return frame if len(frame) >= ZERO_COPY_MIN_BYTES else frame.bytes


def _decode(sock: SubSocket, data: bytes | zmq.Frame) -> Any | None:
    """The event in ``data``, or None (counted on ``sock``) when malformed or of another service."""
    try:
        if len(data) > sock.max_bytes > 0:  # inproc and sockets made elsewhere skip ZMQ_MAXMSGSIZE
            raise MalformedMessageError(REASON_OVERSIZE, f"{len(data)} bytes > {sock.service}'s bound {sock.max_bytes}")
        event, member = _decode_event(data)
        if member != sock.service:
            raise MalformedMessageError(REASON_WRONG_SERVICE, f"got {member!r} on {sock.service!r}")
    except MalformedMessageError as err:
        sock.count_malformed(err)
        return None
    return event


def _wait(sock: SubSocket, deadline_ns: int | None) -> bool:
    """Wait until ``sock`` has a message or ``deadline_ns`` (ns, monotonic; None = forever) passed; heals
    the socket when its connection is lost meanwhile. True when a message is queued."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if sock.conn_monitor is not None:
        poller.register(sock.conn_monitor, zmq.POLLIN)
    while True:
        left_ms = None if deadline_ns is None else (deadline_ns - time.monotonic_ns()) / 1e6
        if left_ms is not None and left_ms <= 0:
            return False
        ready = dict(poller.poll(None if left_ms is None else max(1, int(left_ms))))
        if sock in ready:
            return True
        if sock.conn_monitor is not None and sock.conn_monitor in ready:
            sock.heal()


def _deadline_ns(sock: zmq.Socket) -> int | None:
    timeout_ms = int(sock.getsockopt(zmq.RCVTIMEO))
    return None if timeout_ms < 0 else time.monotonic_ns() + timeout_ms * 1_000_000


def recv_one(sock: SubSocket) -> Any | None:
    """Block for the next well-formed event (bounded by the socket's ``timeout_ms``); None on timeout.

    Waits on the socket and its connection monitor together, so a lost connection is healed while waiting.
    """
    deadline_ns = _deadline_ns(sock)
    while True:
        try:
            data = _recv(sock)
        except zmq.Again:
            if _viewed:  # the queue is empty: the last event's views are given back after it
                _give_back_views()
            sock.heal()
            if not _wait(sock, deadline_ns):
                return None
            continue
        event = _decode(sock, data)
        if event is not None:
            return event


def recv_one_or_none(sock: SubSocket) -> Any | None:
    """The next well-formed event if one is queued, else None (never blocks; heals a lost connection)."""
    while True:
        try:
            data = _recv(sock)
        except zmq.Again:
            if _viewed:  # the queue is empty: the last event's views are given back after it
                _give_back_views()
            sock.heal()
            return None
        event = _decode(sock, data)
        if event is not None:
            return event


def drain_sock_raw(sock: zmq.Socket, wait_for_one: bool = False) -> list[bytes]:
    """Every queued message as raw bytes, undecoded (for loggers). ``wait_for_one`` blocks for the first
    (bounded by the socket's ``timeout_ms``).

    A :class:`SubSocket` is healed (:meth:`SubSocket.heal`) once its queue is empty."""
    out: list[bytes] = []
    if wait_for_one:
        if isinstance(sock, SubSocket):
            if not _wait(sock, _deadline_ns(sock)):
                return out
        else:
            try:
                out.append(sock.recv())
            except zmq.Again:
                return out
    while True:
        try:
            out.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            if isinstance(sock, SubSocket):
                sock.heal()
            return out


def drain_sock(sock: SubSocket, wait_for_one: bool = False) -> list[Any]:
    """Every queued well-formed event, oldest first; malformed ones are counted and dropped."""
    if wait_for_one and not _wait(sock, _deadline_ns(sock)):
        return []
    return list(iter_events(sock))


def iter_events(sock: SubSocket) -> Iterator[Any]:
    """:func:`drain_sock` one event at a time: each queued well-formed event is received and checked only when
    the caller asks for it (malformed ones are counted and dropped), and the socket is healed once the queue is
    empty. A caller that answers each event before asking for the next keeps the empty queue's receive
    (``zmq.Again``, an exception) and the heal's look at the connection monitor off its answer's path: on cold
    caches, once a frame at 20 Hz, the two cost about as much as the event's own receive and decode
    (``tests/bench/bench_node.py``). Events arriving meanwhile are taken too, still oldest first."""
    while True:
        try:
            data = _recv(sock)
        except zmq.Again:
            if _viewed:  # the queue is empty: the last event's views are given back after it
                _give_back_views()
            sock.heal()
            return
        event = _decode(sock, data)
        if event is not None:
            yield event


# ---------------------------------------------------------------- aggregates


class PubMaster:
    """One PUB socket per service. ``send(service, msg)`` takes an ``Event`` builder or its bytes.

    Raises :class:`UnknownServiceError` for an unregistered service (here and in :meth:`send`), and
    :class:`PublisherBusyError` when another live process already publishes one of ``services`` on
    ``prefix`` (the sockets opened so far are closed again).
    """

    def __init__(self, services: Iterable[str], prefix: str | None = None) -> None:
        self.sock: dict[str, PubSocket] = {}
        try:
            for service in services:
                self.sock[service] = pub_sock(service, prefix)
        except BaseException:
            self.close()
            raise

    def send(self, service: str, msg: Any) -> None:
        """Publish ``msg`` (an ``Event`` builder, or already serialised bytes) on ``service``.

        A builder whose union member is not ``service`` raises ``ValueError`` (subscribers would
        drop it as ``wrong service``).
        """
        sock = self.sock.get(service)
        if sock is None:
            get_service(service)
            raise ValueError(f"PubMaster has no socket for {service!r}; it publishes {sorted(self.sock)}")
        if not isinstance(msg, _SERIALISED):
            member = msg._which_str()
            if member != service:
                raise ValueError(f"an Event carrying {member!r} sent on {service!r}")
            msg = msg.to_bytes()
        sock.send(msg)

    def close(self) -> None:
        for sock in self.sock.values():
            sock.close(linger=0)
        self.sock.clear()

    def __enter__(self) -> PubMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SubMaster(SubMasterChecks):
    """Subscribes to ``services`` and keeps openpilot's alive / freq_ok / valid per service.

    ``update(timeout_ms)`` waits up to ``timeout_ms`` for a message (on the ``poll`` services only when
    given, else on any), then drains every socket and re-evaluates the checks at the clock's time.
    All state (``updated``, ``recv_time_ns``, ``recv_frame``, ``alive``, ``freq_ok``, ``valid``,
    ``malformed``, ``sm[service]``, ``all_checks()`` ...) is that of
    :class:`~chestnut.msgs.submaster.SubMasterChecks`, and so are ``frequency_hz`` (rates that replace the
    registry's) and its ``ValueError``. ``mono_time_ns`` is the clock (ns).
    Raises :class:`UnknownServiceError` for an unregistered service and :class:`SocketPathError` for a socket
    path that holds something not a socket of ours (:func:`sub_sock`); the sockets made so far are closed.
    """

    def __init__(
        self,
        services: Iterable[str],
        poll: str | Iterable[str] | None = None,
        ignore_alive: Iterable[str] = (),
        ignore_valid: Iterable[str] = (),
        ignore_avg_freq: Iterable[str] = (),
        prefix: str | None = None,
        mono_time_ns: Callable[[], int] = time.monotonic_ns,
        frequency_hz: Mapping[str, float] | None = None,
    ) -> None:
        super().__init__(services, ignore_alive, ignore_valid, ignore_avg_freq, frequency_hz)
        self.mono_time_ns = mono_time_ns
        polled = [poll] if isinstance(poll, str) else list(poll or ())
        for s in polled:
            if s not in self.services:
                get_service(s)
                raise ValueError(f"poll service {s!r} is not among the subscribed services {self.services}")
        self.poll = polled
        self.poller = zmq.Poller()
        self.sock: dict[str, SubSocket] = {}
        try:
            for s in self.services:
                sock = self.sock[s] = sub_sock(s, self.poller if not polled or s in polled else None, prefix=prefix)
                assert sock.malformed is not None
                self.malformed[s] = sock.malformed  # counted by the socket as messages are drained
        except BaseException:
            self.close()
            raise

    def update(self, timeout_ms: int = 100) -> None:
        """Wait up to ``timeout_ms`` (ms) for new messages, drain all sockets, re-evaluate the checks."""
        if timeout_ms > 0:
            self.poller.poll(timeout_ms)
        events = []
        for sock in self.sock.values():
            events.extend(drain_sock(sock))
        self.update_msgs(self.mono_time_ns(), events)

    def close(self) -> None:
        for sock in self.sock.values():
            sock.close(linger=0)
        self.sock.clear()

    def __enter__(self) -> SubMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
