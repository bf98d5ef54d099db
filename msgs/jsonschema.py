"""JSON Schema and JSON messages generated from ``msgs/chestnut.capnp``: what Foxglove decodes.

Foxglove (and its fork Lichtblick) decode ``json`` messages described by a ``jsonschema`` schema,
not Cap'n Proto (Foxglove's "message schemas" docs; openpilot converts cereal to JSON-schema MCAP
for the same reason, openpilot#31907). This module is the one generator: it walks the schema nodes
pycapnp parsed from ``msgs/chestnut.capnp`` (``capnp/schema.capnp`` ``Node`` / ``Field`` /
``Type``), so a field added to the schema appears in every JSON channel without code here.

Mapping (Cap'n Proto type -> JSON Schema -> JSON value):

- ``Bool`` -> ``boolean``; integers -> ``integer`` (``UInt64`` ns timestamps stay exact integers);
  ``Float32``/``Float64`` -> ``number``, a NaN or infinity becomes ``null`` (JSON has neither);
- ``Text`` -> ``string``; ``Data`` -> ``string`` with ``contentEncoding: base64``;
- an enum -> ``string`` with ``enum`` = its enumerant names (e.g. ``"ok"``, ``"primary"``);
- a struct -> ``object`` with one property per field; a union member is present only when it is
  the one set (pycapnp ``which()``), as ``to_dict`` writes it; ``List(T)`` -> ``array`` of ``T``.

Beside one topic per service (``/<service>``, the service's struct: ``/modelOutput`` carries a
``ModelOutput``), :func:`foxglove_messages` derives the topics Foxglove's panels read directly:

- ``/camera/image``: every ``cameraFrame`` as ``foxglove.RawImage`` (Foxglove's schema: timestamp,
  frame_id, width, height, encoding ``bgr8``/``rgb8``/``mono8``, step = width x channels, data);
- ``/chestnut/levels``: numbers the Plot panel draws: each layer's level and the overall level
  (0 ok, 1 warn, 2 error, 3 stale: the ``Level`` ordinals), ``active`` (0/1), ``source`` (the
  ``ModelSource`` ordinal), latencies in ms;
- ``/camera/video``: the camera frames as ``foxglove.CompressedVideo`` (H.264 at the frame's own size,
  :func:`compressed_video`; the encoding is the writer's, ``msgs/video.py`` ``FoxgloveVideo``);
- ``/chestnut/log``: ``foxglove.Log`` lines for node state changes, ChestnutActive changes,
  control events and every twin fault event (levels: Foxglove's ``LogLevel`` 1 debug .. 5 fatal).

Each message's log time and the derived topics' ``timestamp`` are Unix time (ns): the event's
``logMonoTime`` (ns, CLOCK_MONOTONIC) plus the writer's ``unix_offset_ns`` (``msgs/clock.py``); the
service topics keep ``logMonoTime`` itself as a field.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass
from functools import cache
from typing import Any

from chestnut.msgs.schema import log

__all__ = [
    "FOXGLOVE_COMPRESSED_VIDEO_SCHEMA",
    "FOXGLOVE_LOG_SCHEMA",
    "FOXGLOVE_RAW_IMAGE_SCHEMA",
    "LEVELS_SCHEMA",
    "DerivedState",
    "all_topic_schemas",
    "compressed_video",
    "event_to_json",
    "foxglove_messages",
    "service_schema",
    "service_topic",
    "struct_to_json",
]

_INTEGERS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_NO_DISCRIMINANT = 0xFFFF  # capnp/schema.capnp Field.noDiscriminant

TOPIC_IMAGE = "/camera/image"
TOPIC_VIDEO = "/camera/video"
TOPIC_LEVELS = "/chestnut/levels"
TOPIC_LOG = "/chestnut/log"

# Foxglove's LogLevel enum (foxglove.Log schema): 0 UNKNOWN, 1 DEBUG, 2 INFO, 3 WARNING, 4 ERROR, 5 FATAL
LOG_INFO, LOG_WARNING, LOG_ERROR = 2, 3, 4

# Foxglove RawImage encodings for our pixel encodings (CameraFrame.PixelEncoding) and bytes per pixel
# of a row's step (nv12: the Y row; Foxglove's RawImage documents nv12 as Y plane then interleaved UV)
_IMAGE_ENCODINGS = {"bgr888": ("bgr8", 3), "rgb888": ("rgb8", 3), "gray8": ("mono8", 1), "nv12": ("nv12", 1)}

_TIME_SCHEMA = {
    "type": "object",
    "title": "time",
    "properties": {"sec": {"type": "integer", "minimum": 0}, "nsec": {"type": "integer", "minimum": 0}},
}

FOXGLOVE_RAW_IMAGE_SCHEMA: dict[str, Any] = {
    "title": "foxglove.RawImage",
    "description": "A raw image (Foxglove's foxglove.RawImage message schema)",
    "type": "object",
    "properties": {
        "timestamp": _TIME_SCHEMA,
        "frame_id": {"type": "string"},
        "width": {"type": "integer", "minimum": 0},
        "height": {"type": "integer", "minimum": 0},
        "encoding": {"type": "string"},
        "step": {"type": "integer", "minimum": 0},
        "data": {"type": "string", "contentEncoding": "base64"},
    },
}

FOXGLOVE_COMPRESSED_VIDEO_SCHEMA: dict[str, Any] = {
    "title": "foxglove.CompressedVideo",
    "description": "A frame of compressed video (Foxglove's foxglove.CompressedVideo message schema)",
    "type": "object",
    "properties": {
        "timestamp": _TIME_SCHEMA,
        "frame_id": {"type": "string"},
        "data": {"type": "string", "contentEncoding": "base64"},
        "format": {"type": "string"},
    },
}

FOXGLOVE_LOG_SCHEMA: dict[str, Any] = {
    "title": "foxglove.Log",
    "description": "A log message (Foxglove's foxglove.Log message schema)",
    "type": "object",
    "properties": {
        "timestamp": _TIME_SCHEMA,
        "level": {
            "type": "integer",
            "oneOf": [
                {"title": t, "const": i}
                for i, t in enumerate(("UNKNOWN", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"))
            ],
        },
        "message": {"type": "string"},
        "name": {"type": "string"},
        "file": {"type": "string"},
        "line": {"type": "integer", "minimum": 0},
    },
}


def _layer_names() -> list[str]:
    return list(log.LayerHealth.Layer.schema.enumerants)


LEVELS_SCHEMA: dict[str, Any] = {
    "title": "chestnut.Levels",
    "description": "Health levels (0 ok, 1 warn, 2 error, 3 stale), active (0/1), source (0 none, 1 primary, "
    "2 fallback) and latencies in ms, as numbers for plots",
    "type": "object",
    "properties": {
        name: {"type": "number"}
        for name in (*_layer_names(), "overall", "active", "source", "executionTimeMs", "frameAgeMs")
    },
}


# ---------------------------------------------------------------- the schema walk


@cache
def _nodes() -> dict[int, Any]:
    """Every node of ``chestnut.capnp`` (structs, enums, nested declarations), by id."""
    nodes: dict[int, Any] = {}

    def collect(parsed: Any) -> None:
        node = parsed.node
        if node.id in nodes:
            return
        nodes[node.id] = node
        for nested in parsed.get_proto().nestedNodes:
            collect(parsed.get_nested(nested.name))

    collect(log.schema)
    return nodes


def _short_name(node: Any) -> str:
    """``chestnut.capnp:LayerHealth.Layer`` -> ``chestnut.LayerHealth.Layer``."""
    return "chestnut." + node.displayName.split(":", 1)[1]


def _type_schema(typ: Any) -> dict[str, Any]:
    kind = typ.which()
    if kind == "bool":
        return {"type": "boolean"}
    if kind in _INTEGERS:
        return {"type": "integer", **({"minimum": 0} if kind.startswith("uint") else {})}
    if kind in ("float32", "float64"):
        return {"type": ["number", "null"]}
    if kind == "text":
        return {"type": "string"}
    if kind == "data":
        return {"type": "string", "contentEncoding": "base64"}
    if kind == "enum":
        node = _nodes()[typ.enum.typeId]
        return {"type": "string", "title": _short_name(node), "enum": [e.name for e in node.enum.enumerants]}
    if kind == "list":
        return {"type": "array", "items": _type_schema(typ.list.elementType)}
    if kind == "struct":
        return _struct_schema(typ.struct.typeId)
    raise ValueError(f"chestnut.capnp uses a type the JSON generator does not map: {kind}")


def _struct_schema(type_id: int) -> dict[str, Any]:
    node = _nodes()[type_id]
    props: dict[str, Any] = {}
    for field in node.struct.fields:
        if field.which() != "slot":
            raise ValueError(f"{node.displayName}.{field.name}: groups are not mapped to JSON")
        props[field.name] = _type_schema(field.slot.type)
    return {"type": "object", "title": _short_name(node), "properties": props}


@cache
def _event_fields() -> dict[str, Any]:
    """Event union member name -> its field node."""
    return {f.name: f for f in log.Event.schema.node.struct.fields if f.discriminantValue != _NO_DISCRIMINANT}


def service_topic(service: str) -> str:
    """The Foxglove topic of a service: ``/<service>``."""
    return f"/{service}"


@cache
def _service_schema_text(service: str) -> str:
    field = _event_fields().get(service)
    if field is None:
        raise KeyError(f"{service!r} is not a member of chestnut.capnp's Event union")
    schema = _type_schema(field.slot.type)
    schema["description"] = f"chestnut {service}: the {schema['title']} of chestnut.capnp as JSON"
    schema["properties"] = {
        "logMonoTime": {"type": "integer", "minimum": 0, "description": "ns, CLOCK_MONOTONIC, publish time"},
        "valid": {"type": "boolean"},
        **schema["properties"],
    }
    return json.dumps(schema, sort_keys=True)


def service_schema(service: str) -> dict[str, Any]:
    """The JSON Schema of one service's topic (the member's struct plus ``logMonoTime`` and ``valid``).

    Raises ``KeyError`` for a name that is not an ``Event`` union member."""
    return json.loads(_service_schema_text(service))


def all_topic_schemas() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every JSON topic: topic -> (schema name, JSON Schema): one per ``Event`` member, then the derived ones."""
    topics: dict[str, tuple[str, dict[str, Any]]] = {}
    for name in _event_fields():
        schema = service_schema(name)
        topics[service_topic(name)] = (schema["title"], schema)
    topics[TOPIC_IMAGE] = ("foxglove.RawImage", FOXGLOVE_RAW_IMAGE_SCHEMA)
    topics[TOPIC_VIDEO] = ("foxglove.CompressedVideo", FOXGLOVE_COMPRESSED_VIDEO_SCHEMA)
    topics[TOPIC_LEVELS] = ("chestnut.Levels", LEVELS_SCHEMA)
    topics[TOPIC_LOG] = ("foxglove.Log", FOXGLOVE_LOG_SCHEMA)
    return topics


# ---------------------------------------------------------------- values


def _value(value: Any, typ: Any) -> Any:
    kind = typ.which()
    if kind == "bool":
        return bool(value)
    if kind in _INTEGERS:
        return int(value)
    if kind in ("float32", "float64"):
        v = float(value)
        return v if math.isfinite(v) else None
    if kind == "text":
        return str(value)
    if kind == "data":
        return base64.b64encode(bytes(value)).decode("ascii")
    if kind == "enum":
        return str(value)
    if kind == "list":
        elem = typ.list.elementType
        return [_value(v, elem) for v in value]
    if kind == "struct":
        return struct_to_json(value, typ.struct.typeId)
    raise ValueError(f"unmapped type {kind}")


def struct_to_json(reader: Any, type_id: int) -> dict[str, Any]:
    """A struct reader as a JSON-ready dict, typed by the schema node ``type_id`` (see module doc)."""
    node = _nodes()[type_id]
    out: dict[str, Any] = {}
    which = reader.which() if node.struct.discriminantCount else None
    for field in node.struct.fields:
        if field.discriminantValue != _NO_DISCRIMINANT and field.name != which:
            continue
        out[field.name] = _value(getattr(reader, field.name), field.slot.type)
    return out


def event_to_json(event: Any) -> tuple[str, dict[str, Any]]:
    """``(service, message)``: the set union member's struct as a dict, plus ``logMonoTime`` and ``valid``.

    ``event`` is an ``Event`` reader; raises ``capnp.KjException`` for a union member this schema
    does not know (as ``which()`` does)."""
    service = event.which()
    field = _event_fields()[service]
    body = _value(getattr(event, service), field.slot.type)
    return service, {"logMonoTime": int(event.logMonoTime), "valid": bool(event.valid), **body}


# ---------------------------------------------------------------- derived topics


def _stamp(ns: int) -> dict[str, int]:
    return {"sec": ns // 1_000_000_000, "nsec": ns % 1_000_000_000}


def compressed_video(body: dict[str, Any], data: bytes, unix_offset_ns: int = 0) -> dict[str, Any]:
    """The ``/camera/video`` message of a ``cameraFrame`` (``body``: :func:`event_to_json`'s dict) whose H.264
    access unit is ``data`` (Annex B, ``msgs/video.py`` ``FoxgloveVideo``); stamped like ``/camera/image``
    (``timestampEof`` plus ``unix_offset_ns``)."""
    return {
        "timestamp": _stamp(body["timestampEof"] + unix_offset_ns),
        "frame_id": "camera",
        "data": base64.b64encode(data).decode(),
        "format": "h264",
    }


def _log(ns: int, level: int, name: str, message: str) -> dict[str, Any]:
    return {"timestamp": _stamp(ns), "level": level, "message": message, "name": name, "file": "", "line": 0}


@dataclass
class DerivedState:
    """What the derived topics remember between messages (to log changes, not every message)."""

    node_state: str = ""
    active: bool | None = None
    control_events: tuple[str, ...] = ()
    engaged: bool | None = None
    source: int = 0


_SOURCE_ORDINAL = {name: i for i, name in enumerate(log.ModelSource.schema.enumerants)}
_LEVEL_ORDINAL = {name: i for i, name in enumerate(log.Level.schema.enumerants)}


def foxglove_messages(
    service: str, body: dict[str, Any], state: DerivedState, unix_offset_ns: int = 0
) -> list[tuple[str, dict[str, Any]]]:
    """The JSON messages of one event, ``[(topic, message), ...]``: its own topic first, then derived ones.

    ``body`` is :func:`event_to_json`'s dict. ``state`` is updated in place (state changes are
    logged once, when they happen). ``unix_offset_ns`` (``msgs/clock.py`` ``unix_offset_ns``) is added to
    the monotonic times of the derived topics' ``timestamp`` fields (0: they stay monotonic)."""
    ns = body["logMonoTime"] + unix_offset_ns
    out: list[tuple[str, dict[str, Any]]] = [(service_topic(service), body)]
    if service == "cameraFrame":
        enc, channels = _IMAGE_ENCODINGS.get(body["encoding"], ("bgr8", 3))
        out.append(
            (
                TOPIC_IMAGE,
                {
                    "timestamp": _stamp(body["timestampEof"] + unix_offset_ns),
                    "frame_id": "camera",
                    "width": body["width"],
                    "height": body["height"],
                    "encoding": enc,
                    "step": body["width"] * channels,
                    "data": body["data"],
                },
            )
        )
    elif service == "chestnutHealth":
        levels: dict[str, Any] = {layer["layer"]: _LEVEL_ORDINAL[layer["level"]] for layer in body["layers"]}
        levels["overall"] = _LEVEL_ORDINAL[body["overall"]]
        out.append((TOPIC_LEVELS, levels))
    elif service == "chestnutActive":
        state.source = _SOURCE_ORDINAL[body["source"]]
        out.append((TOPIC_LEVELS, {"active": int(body["active"]), "source": state.source}))
        if body["active"] != state.active:
            state.active = body["active"]
            out.append(
                (
                    TOPIC_LOG,
                    _log(
                        ns,
                        LOG_INFO if body["active"] else LOG_WARNING,
                        "chestnutActive",
                        f"ChestnutActive {str(body['active']).lower()}: {body['reason']}",
                    ),
                )
            )
    elif service == "modelOutput":
        exec_ms, age_ms = body["executionTime"], body["frameAge"]
        out.append(
            (
                TOPIC_LEVELS,
                {
                    "executionTimeMs": None if exec_ms is None else exec_ms * 1e3,
                    "frameAgeMs": None if age_ms is None else age_ms * 1e3,
                    "source": _SOURCE_ORDINAL[body["source"]],
                },
            )
        )
    elif service == "nodeState":
        if body["state"] != state.node_state:
            state.node_state = body["state"]
            level = LOG_WARNING if body["state"] in ("degraded", "recovering") else LOG_INFO
            out.append((TOPIC_LOG, _log(ns, level, "node", f"node {body['state']}: {body['reason']}")))
    elif service == "controlState":
        events = tuple(body["events"])
        if events != state.control_events or body["engaged"] != state.engaged:
            state.control_events, state.engaged = events, body["engaged"]
            what = "engaged" if body["engaged"] else "disengaged"
            extra = f"; events: {', '.join(events)}" if events else ""
            soft = f"; soft-disabling, {body['softDisableRemaining']:.1f} s left" if body["softDisabling"] else ""
            out.append(
                (TOPIC_LOG, _log(ns, LOG_WARNING if events else LOG_INFO, "control", f"control {what}{extra}{soft}"))
            )
    elif service == "twinFault":
        level = LOG_ERROR if body["action"] == "fired" else LOG_INFO
        site = f" at {body['site']}" if body["site"] else ""
        out.append(
            (
                TOPIC_LOG,
                _log(ns, level, "twin", f"fault {body['kind']}#{body['id']} {body['action']}{site} {body['params']}"),
            )
        )
    return out
