"""The wire format between the node and its primary worker: packets on the socket pair and their JSON payloads.

The command socket is an ``AF_UNIX`` ``SOCK_SEQPACKET`` pair (a bidirectional pipe that keeps message
boundaries and can carry a descriptor, ``unix(7)``). Every message is one packet of at most
:data:`PACKET_MAX_BYTES`: a 24-byte little-endian header ``<BBHIqq`` (kind, status, slot, payload
length, seq, value) and an optional payload: UTF-8 JSON (specs, errors, probe data), except a successful
RESULT's, which is empty or its three stage times as a fixed 24-byte record (:func:`result_payload`: the
one payload on the per-frame path, where a JSON encode and decode cost ~80 us at 20 Hz against ~15 us for a
``struct`` pack and unpack, each measured after a 50 ms idle as between frames). This replaces openpilot
modeld's one-byte pipe protocol between modeld and its worker with a typed one.

Errors cross as the typed classes of :mod:`chestnut.backend.errors` (:func:`error_to_json`,
:func:`error_from_json`); anything else a runner raises becomes :class:`WorkerError`.
Pure code: nothing here touches a socket or a process.
"""

from __future__ import annotations

import struct
import traceback
from collections.abc import Mapping
from enum import IntEnum
from pathlib import Path
from typing import Any

from chestnut.backend import errors as backend_errors
from chestnut.backend.errors import ChestnutError
from chestnut.backend.interface import DockObservation, LadderReport, LadderStep, ModelSpec, StepResult
from chestnut.backend.stages import StageTimes
from chestnut.backend.warp import WarpSpec

PACKET_MAX_BYTES = 65536  # one SEQPACKET message; payloads are small JSON (our bound)
DETAIL_MAX_CHARS = 8000   # error details and tracebacks are cut to this (our bound)
HEARTBEAT_PERIOD_S = 0.05  # the worker's heartbeat into the control block (node/shm.py), 20 per second

_HEADER = struct.Struct("<BBHIqq")  # kind, status, slot, payload length, seq, value
HEADER_BYTES = _HEADER.size  # 24

STATUS_OK, STATUS_ERROR = 0, 1


class Msg(IntEnum):
    """Message kinds on the command socket."""

    # node -> worker
    START = 1      # payload: {"runner": RunnerSpec, "model": ModelSpec, "ladder": LadderConfig}
    BUFFERS = 2    # payload: SlotLayout; carries the slot segment's descriptor (SCM_RIGHTS)
    RUN = 3        # seq, slot: inputs are in the slot
    PROBE = 4
    STOP = 5
    WAKE = 6       # a RUN is likely soon: the worker wakes for it (takes it and waits again, node/worker.py)
    # worker -> node
    READY = 16         # payload: {"inputs", "outputs", "ladder", "kind"}: ladder passed, model loaded
    START_FAILED = 17  # payload: {"error", "ladder"}; the worker exits next
    BUFFERS_OK = 18    # slots mapped: the worker takes RUN commands from now on
    RESULT = 19        # seq, slot, value = runner time in ns; status 1: payload is the error (JSON); status 0:
                       # payload empty or <3d copy_in, compute, copy_out in s (result_payload)
    PROBE_RESULT = 20  # payload: {"observation"} or {"error"}


_MSG_OF = {int(m): m for m in Msg}  # a kind's member in one lookup (Msg(kind) runs the enum's Python __call__);
                                    # an unknown kind still raises Msg's own ValueError


def pack(kind: Msg, seq: int = 0, *, slot: int = 0, status: int = STATUS_OK, value: int = 0,
         payload: bytes = b"") -> bytes:
    """One wire message: the 24-byte header followed by ``payload``.

    Raises ``struct.error`` for a field outside its width (slot: uint16, seq and value: int64)."""
    return _HEADER.pack(int(kind), status, slot, len(payload), seq, value) + payload


def unpack(packet: bytes) -> tuple[Msg, int, int, int, int, bytes]:
    """``(kind, status, slot, seq, value, payload)``; raises ``ValueError`` on a malformed packet
    (shorter than the header, a length field that disagrees with the packet, an unknown kind)."""
    if len(packet) < HEADER_BYTES:
        raise ValueError(f"packet of {len(packet)} bytes is shorter than the {HEADER_BYTES}-byte header")
    kind, status, slot, length, seq, value = _HEADER.unpack_from(packet)
    if length != len(packet) - HEADER_BYTES:
        raise ValueError(f"header says {length} payload bytes, packet carries {len(packet) - HEADER_BYTES}")
    msg = _MSG_OF.get(kind)
    return msg if msg is not None else Msg(kind), status, slot, seq, value, packet[HEADER_BYTES:]


# ---------------------------------------------------------------- errors
class WorkerError(ChestnutError):
    """The primary worker failed outside the dock's typed errors.

    Reasons: ``"worker_exited"`` (the process died or was killed; ``detail`` says how),
    ``"spawn_failed"``, ``"protocol"`` (a message that breaks the protocol: the worker is killed),
    ``"runner_exception"`` (the runner raised something that is not a :class:`ChestnutError`;
    ``detail`` is ``"<Type>: <message>"``), ``"not_ready"``, ``"busy"`` (every slot in flight),
    ``"bad_seq"`` (sequence numbers must increase). ``layer`` is None: which health layer a dead
    worker counts against is the supervisor's decision.
    """

    layer = None


def typed_error(e: BaseException) -> ChestnutError:
    """``e`` as a :class:`ChestnutError`: unchanged if it is one; else classified by its message
    (:func:`chestnut.backend.classify.classify`: tinygrad 0.14 and libusb raise untyped
    ``RuntimeError``/``usb.core.USBError``); else :class:`WorkerError` ``"runner_exception"`` with
    ``"<Type>: <message>"``.
    """
    if isinstance(e, ChestnutError):
        return e
    from chestnut.backend.classify import UNCLASSIFIED, classify

    err = classify(e, default=WorkerError)
    if err.reason == UNCLASSIFIED:
        err = WorkerError("runner_exception", f"{type(e).__name__}: {e}")
        err.__cause__ = e
    return err


def error_to_json(e: BaseException) -> dict[str, Any]:
    """The wire form of an exception (see :func:`typed_error`): class names (most derived first),
    layer, reason, detail, and the original traceback, each cut to :data:`DETAIL_MAX_CHARS`."""
    err = typed_error(e)
    classes = [c.__name__ for c in type(err).__mro__ if issubclass(c, ChestnutError)]
    reason, detail, layer = err.reason, err.detail, err.layer
    tb = "".join(traceback.format_exception(e))
    return {"classes": classes, "layer": layer.value if layer is not None else None, "reason": reason,
            "detail": detail[:DETAIL_MAX_CHARS], "traceback": tb[-DETAIL_MAX_CHARS:]}


def error_from_json(d: Mapping[str, Any]) -> ChestnutError:
    """Rebuild a typed error: the first of ``d["classes"]`` known here (backend.errors or WorkerError).

    A runner's own subclass (say ``FenceStall(GpuLayerError)``) arrives as its nearest known base.
    The worker's traceback text is kept in ``.worker_traceback``.
    """
    known: dict[str, type[ChestnutError]] = {"WorkerError": WorkerError}
    for name in dir(backend_errors):
        obj = getattr(backend_errors, name)
        if isinstance(obj, type) and issubclass(obj, ChestnutError):
            known[name] = obj
    cls = next((known[c] for c in d.get("classes", []) if c in known), WorkerError)
    err = cls(str(d.get("reason", "unknown")), str(d.get("detail", "")))
    err.worker_traceback = str(d.get("traceback", ""))  # type: ignore[attr-defined]
    return err


# ---------------------------------------------------------------- payloads
_STAGES = struct.Struct("<3d")  # copy_in, compute, copy_out (s)
STAGES_BYTES = _STAGES.size  # 24


def result_payload(stages: StageTimes | None) -> bytes:
    """A successful RESULT's payload: empty without stage times, else :data:`STAGES_BYTES` bytes, ``copy_in``,
    ``compute``, ``copy_out`` (s, :class:`~chestnut.backend.stages.StageTimes`) as little-endian float64."""
    return b"" if stages is None else _STAGES.pack(stages.copy_in, stages.compute, stages.copy_out)


def stages_from_payload(payload: bytes) -> StageTimes | None:
    """The inverse of :func:`result_payload`: None for an empty payload. Raises ``ValueError`` for a payload of
    another length or with a negative or non-finite time (a protocol error: the node kills the worker)."""
    if not payload:
        return None
    if len(payload) != STAGES_BYTES:
        raise ValueError(f"RESULT payload of {len(payload)} bytes, not {STAGES_BYTES} (three stage times)")
    return StageTimes(*_STAGES.unpack(payload))


def model_spec_to_json(m: ModelSpec) -> dict[str, Any]:
    return {"path": str(m.path), "name": m.name, "input_shapes": {k: list(v) for k, v in m.input_shapes.items()},
            "fingerprint": m.fingerprint, "warp": None if m.warp is None else m.warp.to_json()}


def model_spec_from_json(d: Mapping[str, Any]) -> ModelSpec:
    return ModelSpec(Path(d["path"]), str(d["name"]),
                     {k: tuple(int(x) for x in v) for k, v in d.get("input_shapes", {}).items()},
                     d.get("fingerprint"), None if d.get("warp") is None else WarpSpec.from_json(d["warp"]))


def ladder_to_json(report: LadderReport | None) -> list[dict[str, Any]] | None:
    if report is None:
        return None
    return [{"name": s.name, "layer": s.layer.value, "result": s.result.value, "duration_s": s.duration_s,
             "detail": s.detail, "advice": s.advice, "reason": s.reason} for s in report.steps]


def ladder_from_json(steps: list[dict[str, Any]] | None) -> LadderReport | None:
    if steps is None:
        return None
    return LadderReport([LadderStep(s["name"], backend_errors.Layer(s["layer"]), StepResult(s["result"]),
                                    float(s["duration_s"]), s["detail"], s["advice"], s.get("reason", ""))
                         for s in steps])


def observation_from_json(d: Mapping[str, Any]) -> DockObservation:
    def pair(v: Any) -> tuple[int, int] | None:
        return (int(v[0]), int(v[1])) if v is not None else None
    return DockObservation(bool(d["present"]), pair(d.get("vid_pid")), pair(d.get("bus_address")),
                           d.get("speed_mbps"), d.get("link_errors"), d.get("ltssm"), d.get("fence"),
                           dict(d.get("extra", {})))
