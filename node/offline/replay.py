"""``chestnut replay``: re-run the models over a log's camera frames and compare with its logged outputs.

In the manner of openpilot's process replay (``selfdrive/test/process_replay``): the same number of outputs, aligned by
frame id, float values equal within ``|a-b| <= max(tol, tol*max(|a|,|b|))``, NaN equal only to NaN
(:func:`chestnut.node.validity.compare_tensors`). Each logged ``modelOutput`` is re-run with the
source that served it (``--source logged``) or with one source forced for every frame:

- ``primary``: the primary model on the host CPU through tinygrad (:class:`~chestnut.backend.model.OnnxModel`,
  ``DEV=CPU``), the kernels the twin's GPU engine runs, so twin-served frames replay bit-exactly;
  frames a real dock served replay within the tolerance;
- ``fallback``: :class:`~chestnut.fallback.standby.FallbackModel` with the engine named in the log's
  configuration (onnxruntime by default), one intra-op thread like the node's.

Frames are preprocessed by :func:`chestnut.node.preprocess.preprocess` with the name the node logged,
so replay feeds the models exactly what the node fed them. A frame logged as video (``chestnut record
--frames video``, ``msgs/video.py``) is decoded from its segment's ``fcamera.mkv``: FFV1 gives the
camera's bytes back, so such a log replays with no mismatch; an h264 (lossy) log mismatches by design.
A frame whose pixels the log does not hold is ``not_replayable``, excused and counted apart, its detail
naming why: a video file missing, truncated, damaged or not a regular file (each such file is also one
damaged file, :class:`~chestnut.node.offline.timeline.DamageRec` at offset -1, reason "frame <n>: ..."), or
a ring frame the logger read after the camera reused its slot ("logged without pixels"). A frame the node
answered "none" because its ring slot was overwritten before the node read it (:data:`RING_LOSS_REASONS`)
is ``transport_loss``: the node handled it right, whatever pixels the logger kept. The rest replays.

**Units of work.** One segment file is one unit: :func:`replay_segment` takes a :class:`SegmentTask`
(the segment's path, the next segment's path, the resolved :class:`ReplayPlan`) and returns a
picklable :class:`SegmentResult`. Frames whose answer was logged in the next segment are looked up
there (at most :data:`LOOKAHEAD_S` of it is read). Units run in parallel on a spawn-context
``ProcessPoolExecutor`` (``--workers``); any engine that can call a function on a path could take them.

**Determinism.** Models run single-threaded, results are ordered by segment then log time, and
timings are kept apart from the results (:meth:`ReplayResult.digest` covers the results only): the
same log replayed twice, with any number of workers, gives identical results.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import queue
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from chestnut.msgs.logfile import LogReader, find_log_files
from chestnut.msgs.video import LoggedFrames, VideoFrameError, file_kind
from chestnut.node.offline.timeline import (
    NS_PER_MS,
    NS_PER_S,
    SLACK_MS,
    DamageRec,
    FileExtract,
    FileRecorder,
    Timeline,
    config_section,
    default_node_config,
)
from chestnut.node.validity import compare_tensors
from chestnut.node.watchdog import FRAME_DEADLINE_MS

log = logging.getLogger("chestnut.replay")

DEFAULT_TOL = 1e-4
"""Replay tolerance (openpilot process replay's form; our default). The twin's primary replays bit-exactly
and onnxruntime is deterministic single-threaded, so any real difference is far above 1e-4."""
LOOKAHEAD_S = 10.0  # s of the next segment read for answers to the frames at a segment's end
STALE_PENDING_S = 10.0  # s after which a frame still waiting for its output is declared unanswered
SOURCES = ("logged", "primary", "fallback")
ENGINES = ("tinygrad", "onnxruntime")
PROGRESS_EVERY_FRAMES = 8
CONFIG_HORIZON_S = 3.0  # s of log read past the node's config for twinState (1 Hz: msgs/services.py)


class ReplayError(RuntimeError):
    """Replay cannot start: no usable model, or a log without the configuration it needs."""


WORKERS_PER_CPU = 4
"""Bound of the offline workers that run on this machine (processes of :func:`replay` and
:class:`~chestnut.node.offline.executor.LocalExecutor`, actors of a private Ray cluster): this many per CPU this
process may run on (``node/config.py`` ``cpu_count``), :func:`max_workers`. Each is a process of its own (spawn: a
fresh interpreter, about 100 MiB once it has imported onnxruntime and tinygrad, more with the log's models loaded and
compiled) whose work is CPU-bound inference: past one per CPU they only take turns for the CPUs while each holds its
memory; four leave room for workers waiting on reading and decoding their segment's log and video. ``--workers
100000`` had no bound: a fleet of that many segments got that many processes. A cluster reached with
``--ray-address`` is bounded by its own CPUs instead (an actor for which none is free never starts: refused after
``ray_executor.py`` ``START_TIMEOUT_S``), and ``--executor ray`` without ``--workers`` takes one actor per CPU of
the cluster."""


def max_workers() -> int:
    """The most offline workers that run on this machine: :data:`WORKERS_PER_CPU` per CPU this process may run on
    (its affinity, else ``os.cpu_count()``: counted as ``node/config.py`` ``cpu_count`` counts them)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return WORKERS_PER_CPU * cpus


def check_workers(workers: int, here: bool = True) -> int:
    """``workers`` itself when it is a count of workers the offline executors can run: processes of
    :func:`replay` and :class:`~chestnut.node.offline.executor.LocalExecutor`, actors of
    :class:`~chestnut.node.offline.ray_executor.RayExecutor`, at least 1, and at most :func:`max_workers` when
    they run on this machine (``here``: every one but the actors of a Ray cluster reached at an address). The one
    rule for all of them and for ``--workers`` (``node/offline/fleet_cli.py`` ``worker_count``); raises
    ``ValueError`` ``"workers must be >= 1, got N"`` or ``"workers must be at most M on this machine (4 per CPU it
    may run on, C CPUs: more only take turns for them, each with its own memory), got N"`` otherwise."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if here and workers > (most := max_workers()):
        raise ValueError(f"workers must be at most {most} on this machine ({WORKERS_PER_CPU} per CPU it may run on, "
                         f"{most // WORKERS_PER_CPU} CPUs: more only take turns for them, each with its own memory), "
                         f"got {workers}")
    return workers


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ModelRef:
    """One model to replay with: ONNX file, engine, input name and NCHW shape, and its identity.

    ``sha16`` is the first 16 hex digits of the file's sha256 (the hash part of ``modelOutput.modelId``).
    """

    path: str
    name: str
    engine: str
    input_name: str
    input_shape: tuple[int, ...]
    sha16: str
    threads: int = 1

    @property
    def model_id(self) -> str:
        return f"{self.name}@{self.sha16}"


@dataclass(frozen=True)
class ReplayPlan:
    """Everything a unit of work needs besides its segment: picklable, resolved once in the parent."""

    preprocess: str
    primary: ModelRef | None
    fallback: ModelRef | None
    source: str = "logged"
    tol: float = DEFAULT_TOL
    # the configured deadline: the ceiling of the adaptive one (docs/health.md), so every frame's answer is due
    # by it + slack whatever deadline was in force for it (chestnut check judges each by its published one)
    deadline_ms: float = FRAME_DEADLINE_MS
    slack_ms: float = SLACK_MS
    jit_cache: bool = True
    config_origin: str = "the log"

    def model_for(self, logged_source: str) -> tuple[str, ModelRef | None]:
        """(source replayed with, its model) for a frame the log says ``logged_source`` served."""
        src = logged_source if self.source == "logged" else self.source
        return src, {"primary": self.primary, "fallback": self.fallback}.get(src)

    @property
    def answer_bound_ns(self) -> int:
        return int((self.deadline_ms + self.slack_ms) * NS_PER_MS)


def read_model(path: Path, role: str, flag: str) -> bytes:
    """The bytes of the ``role`` ("primary", "fallback") model file ``path``, given by ``flag`` (``--model``,
    ``--fallback-model``; named in the fix), read once.

    Its size is checked before anything is read: a file over
    :data:`~chestnut.backend.model.MAX_MODEL_BYTES` (bytes; protobuf's 2 GiB limit for one serialized ONNX model,
    the bound the node's model loader uses) is refused from its ``stat``, so a huge (or sparse) file costs no
    memory. The read itself is :func:`~chestnut.backend.model.read_model_file`'s, the loader the replay's
    workers use (a regular file, at most that many bytes, one no other user could change). Raises
    :class:`ReplayError`, one line naming the file and ``flag``, for a file that is absent, unreadable or too
    large, or that the loader refuses; a path that is there but is no model file says what it is (a directory, a
    character device, a FIFO ...), and nothing that is not a regular file is opened."""
    from chestnut.backend.errors import ModelError
    from chestnut.backend.model import MAX_MODEL_BYTES, read_model_file

    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ReplayError(f"{role} model {path} not found on this machine: give {flag} PATH") from None
    except OSError as e:
        raise ReplayError(f"{role} model {path}: {e.strerror or e}: give {flag} PATH") from None
    if stat.S_ISDIR(st.st_mode):
        raise ReplayError(f"{role} model {path} is a directory, not a model file: give {flag} PATH (the .onnx file)")
    if not stat.S_ISREG(st.st_mode):
        raise ReplayError(f"{role} model {path} is {file_kind(st.st_mode)}, not a regular file: give {flag} PATH")
    if st.st_size > MAX_MODEL_BYTES:
        raise ReplayError(f"{role} model {path} is {st.st_size} bytes, over the {MAX_MODEL_BYTES} bytes an ONNX "
                          f"model can be: give {flag} PATH")
    try:
        return read_model_file(path, f"{role} model")
    except ModelError as e:  # a file swapped meanwhile, or one another user could change: the loader's own line
        raise ReplayError(e.detail or str(e)) from None


def _sha16(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _graph_input(path: Path, data: bytes) -> tuple[str, tuple[int, ...]]:
    from chestnut.backend.model import _graph_inputs, model_label

    specs = _graph_inputs(data, model_label(path.stem, path), {})
    if len(specs) != 1:
        raise ReplayError(f"{path} has {len(specs)} inputs; replay feeds one image input (give the node's config)")
    return specs[0].name, specs[0].shape


def resolve_plan(
    node_config: dict[str, Any],
    *,
    model: Path | None = None,
    fallback_model: Path | None = None,
    source: str = "logged",
    tol: float = DEFAULT_TOL,
    slack_ms: float = SLACK_MS,
    jit_cache: bool = True,
    config_origin: str = "the log",
    primary_engine: str = "auto",
) -> ReplayPlan:
    """The plan from the node's logged configuration (``initData.config``, :class:`chestnut.node.config.NodeConfig`
    JSON: ``model.{path,name,input,shape,preprocess}``, ``fallback.{path,engine,threads}``,
    ``timing.deadline_ms``; a top-level ``preprocess`` overrides) with ``model`` / ``fallback_model``
    given on the command line taking precedence over the logged paths. A model file other than the
    configured one is fed by its own graph's input name and shape. ``primary_engine`` runs the primary:
    ``tinygrad`` (the kernels of a twin whose engine is tinygrad, and of the worker's ``cpu`` dock) or
    ``onnxruntime`` (a twin run with ``--engine onnxruntime``, ``chestnut launch``'s default), or
    ``auto``: the engine the log's ``twinState`` names, else ``tinygrad``.

    Raises :class:`ReplayError` when a needed model file is missing, too large or unusable (:func:`read_model`,
    checked before it is read) or the log names no model and none is given, ``ValueError`` for a bad ``source``
    or ``tol``.
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    mcfg, fcfg = config_section(node_config, "model"), config_section(node_config, "fallback")
    tcfg = config_section(node_config, "timing")
    preprocess = str(node_config.get("preprocess") or mcfg.get("preprocess") or "ppocr")
    primary_given = model or mcfg.get("path")
    if not primary_given:
        raise ReplayError("the log names no model (no node initData with a model section): give --model PATH")
    primary_path = Path(primary_given).expanduser()
    fb_given = fallback_model or fcfg.get("path")
    fallback_path = Path(fb_given).expanduser() if fb_given else primary_path
    engine = str(fcfg.get("engine") or "onnxruntime")
    if engine not in ENGINES:
        raise ReplayError(f"the log's fallback engine {engine!r} is not one of {ENGINES}")

    configured = Path(mcfg["path"]).expanduser() if mcfg.get("path") else None
    name = str(mcfg.get("name") or primary_path.stem) if primary_path == configured else primary_path.stem

    def ref(path: Path, role: str, eng: str, threads: int) -> ModelRef:
        data = read_model(path, role, "--model" if role == "primary" else "--fallback-model")
        if mcfg.get("input") and mcfg.get("shape") and path == configured:
            input_name, shape = str(mcfg["input"]), tuple(int(s) for s in mcfg["shape"])
        else:
            input_name, shape = _graph_input(path, data)
        nm = name if role == "primary" else f"{name}-fallback"  # the node's names (node/main.py)
        return ModelRef(str(path), nm, eng, input_name, shape, _sha16(data), threads)

    if primary_engine == "auto":  # how the logged primary ran: the twin's engine, else tinygrad's kernels
        logged = config_section(node_config, "twin").get("program_engine")
        primary_engine = str(logged) if logged in ENGINES else "tinygrad"
    if primary_engine not in ENGINES:
        raise ValueError(f"primary_engine must be one of {ENGINES}, got {primary_engine!r}")
    needs = {"primary", "fallback"} if source == "logged" else {source}
    primary = ref(primary_path, "primary", primary_engine, 1) if "primary" in needs else None
    fallback = ref(fallback_path, "fallback", engine, int(fcfg.get("threads") or 1)) if "fallback" in needs else None
    deadline = tcfg.get("deadline_ms")
    return ReplayPlan(
        preprocess,
        primary,
        fallback,
        source,
        float(tol),
        float(deadline) if isinstance(deadline, int | float) and deadline > 0 else FRAME_DEADLINE_MS,
        float(slack_ms),
        jit_cache,
        config_origin,
    )


def find_node_config(files: Iterable[Path]) -> dict[str, Any]:
    """The node's configuration as logged: the first ``initData`` whose config has a ``model`` section
    (the logger's own segment headers lack it), searched in the first log file only (the node publishes
    it when it starts, and the logger repeats its most recent one after the header of every later segment:
    ``msgs/logfile.py`` ``CARRIED_SERVICES``; a full scan would cost a second pass over every frame), and read
    no further than :data:`CONFIG_HORIZON_S` past that config, or past the file's start for a repeated copy (its
    ``logMonoTime`` is the original's, from an earlier segment). ``{}`` when absent.

    The twin's program engine (``twinState.programEngine``, 1 Hz) is added as
    ``config["twin"]["program_engine"]`` when the same file carries it: it decides how replay must run
    the primary to reproduce it bit for bit."""
    config: dict[str, Any] = {}
    engine = ""
    found_ns: int | None = None
    opened_ns: int | None = None  # the file's first message in file order: its header, when the segment opened
    for path in list(files)[:1]:
        for t, service, event in LogReader(path, reorder_window_ns=0):  # file order: the header comes first
            opened_ns = t if opened_ns is None else opened_ns
            if found_ns is not None and t - found_ns > CONFIG_HORIZON_S * NS_PER_S:
                break  # twinState is 1 Hz: none this long after the node's config means no twin engine logged
            if service == "twinState" and not engine:
                engine = str(event.twinState.programEngine)
            elif service == "initData" and not config:
                try:
                    found = json.loads(event.initData.config or "{}")
                except ValueError:
                    continue
                if isinstance(found, dict) and isinstance(found.get("model"), dict):
                    config, found_ns = found, max(t, opened_ns)
            if config and engine:
                break
    if config and engine:
        config = {**config, "twin": {"program_engine": engine}}
    return config


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class TensorDiff:
    """One output tensor of one frame, replayed against logged. ``first_mismatch`` is an index."""

    name: str
    ok: bool
    max_abs_diff: float
    n_mismatch: int
    size: int
    first_mismatch: tuple[int, ...] | None = None
    note: str = ""


# Frame outcome kinds. Excused ones (ok=True) are counted but never a mismatch.
KIND_OK = "ok"
KIND_VALUES = "values"  # a tensor differs beyond the tolerance
KIND_STRUCTURE = "structure"  # output names, shapes or dtypes differ
KIND_MISSING = "missing_output"  # a logged frame has no logged output
KIND_DUPLICATE = "duplicate_output"  # a second output for one frame
KIND_ORPHAN = "output_without_frame"  # an output for a frame that is not in the log
KIND_INPUT = "bad_input"  # the logged frame cannot be preprocessed / the model raised
KIND_NO_MODEL = "no_model"  # the output's source has no model to replay with (e.g. source none)
KIND_LATE = "late_output"  # an output more than STALE_PENDING_S after its frame
KIND_IN_FLIGHT = "in_flight"  # excused: still in flight when the log ended
KIND_LOST = "lost_to_damage"  # excused: its answer fell into unreadable log
KIND_NOT_SERVING = "node_not_serving"  # excused: before the node's first message, or after it said stopping
KIND_TRANSPORT_LOSS = "transport_loss"  # excused: answered none, the ring slot overwritten or the frame stale when read
KIND_NOT_REPLAYABLE = "not_replayable"  # excused: the log holds no pixels of the frame (see the detail)
EXCUSED = frozenset({KIND_OK, KIND_IN_FLIGHT, KIND_LOST, KIND_NOT_SERVING, KIND_TRANSPORT_LOSS, KIND_NOT_REPLAYABLE})
NOT_REPLAYED = frozenset({KIND_TRANSPORT_LOSS, KIND_NOT_REPLAYABLE})  # counted apart in the summary

RING_LOSS_REASONS = ("was overwritten (now frame", "its ring was unmapped during the read")
"""How the node's ``modelOutput.reason`` names a ring frame it could not read in time: the wording of
``msgs/visionipc.py`` ``FrameReader._check`` / ``FrameReader.verify`` (``FrameOverwrittenError``), which the
node logs as "bad frame: <error>" (``node/main.py``). The slot was reused by the camera, so the node's
"none" answer was right whatever pixels the logger, reading the ring on its own, kept."""
STALE_FRAME_PREFIX = "stale frame: read "
"""How the node's ``modelOutput.reason`` starts for a frame it read over ``timing.max_frame_age_ms`` after its
EOF and answered "none" without a model (``node/main.py`` ``stale_frame_reason``): the node was behind, its
answer was right whatever the frame holds, so replay counts it as a transport loss, not a mismatch."""
VIDEO_DAMAGE_OFFSET = -1  # DamageRec.offset of a damaged video file: no byte offset, the reason names the frame


def damage_line(d: DamageRec) -> str:
    """``path: byte <offset>: reason`` of a damaged log file; ``path: reason`` of a damaged video file."""
    return f"{d.path}: {d.reason}" if d.offset == VIDEO_DAMAGE_OFFSET else f"{d.path}: byte {d.offset}: {d.reason}"


def ring_loss(reason: str) -> bool:
    """Whether a node's "none" answer says its ring frame was overwritten before it was read (see
    :data:`RING_LOSS_REASONS`)."""
    return any(r in reason for r in RING_LOSS_REASONS)


def logged_without_pixels(cf: Any) -> bool:
    """A ring frame (``buffer`` set) that the logger logged with neither pixels nor video: it read the slot
    after the camera had reused it (``msgs/logger.py`` ``frames_unread``)."""
    return bool(cf._has("buffer")) and len(cf.data) == 0 and not LoggedFrames.in_video(cf)


@dataclass(frozen=True)
class FrameResult:
    """One frame (or one unmatched output). ``t_ns`` is the output's logMonoTime, else the frame's."""

    frame_id: int
    t_ns: int
    kind: str
    logged_source: str = ""
    replayed_with: str = ""
    detail: str = ""
    tensors: tuple[TensorDiff, ...] = ()

    @property
    def ok(self) -> bool:
        return self.kind in EXCUSED

    @property
    def max_abs_diff(self) -> float:
        return max((t.max_abs_diff for t in self.tensors), default=0.0)


@dataclass(frozen=True)
class ModelIdCheck:
    """The model replay ran against the model the log says produced the outputs, per (source, logged id)."""

    source: str
    logged_id: str
    replay_id: str
    frames: int
    first_frame: int

    @property
    def same_bytes(self) -> bool:
        """Equal sha256 prefixes: the same model file (names may differ)."""
        return self.logged_id.rpartition("@")[2] == self.replay_id.rpartition("@")[2]

    def describe(self) -> str:
        if self.same_bytes:
            note = "" if self.logged_id == self.replay_id else f" (name differs: replayed as {self.replay_id})"
            return f"{self.source}: log model {self.logged_id} = replay model{note}"
        return (
            f"{self.source}: MODEL DIFFERS: the log's outputs came from {self.logged_id} but replay runs "
            f"{self.replay_id} ({self.frames} frame(s) from frame {self.first_frame})"
        )


@dataclass
class SegmentResult:
    """A unit's result. ``frames`` by frame id; ``extract`` holds the segment's records (for reports);
    ``infer_s`` (model runs), ``load_s`` (model loads, compiles and warm-ups in this unit), ``wall_s`` and
    ``cpu_s`` (this process's CPU time, all threads) are timings (s), outside :meth:`ReplayResult.digest`."""

    index: int
    path: str
    frames: list[FrameResult]
    damage: list[DamageRec]
    model_ids: list[ModelIdCheck]
    skipped_head: int
    extract: FileExtract
    infer_s: float = 0.0
    load_s: float = 0.0
    wall_s: float = 0.0
    pid: int = 0
    cpu_s: float = 0.0  # CPU time of this process (all threads) during the unit


@dataclass
class ReplayResult:
    plan: ReplayPlan
    segments: list[SegmentResult]
    workers: int
    wall_s: float

    @property
    def frames(self) -> list[FrameResult]:
        return [f for s in self.segments for f in s.frames]

    @property
    def damage(self) -> list[DamageRec]:
        return [d for s in self.segments for d in s.damage]

    @property
    def mismatches(self) -> list[FrameResult]:
        return [f for f in self.frames if not f.ok]

    @property
    def not_replayed(self) -> list[FrameResult]:
        """Frames answered but not replayable (:data:`NOT_REPLAYED`): excused, counted apart."""
        return [f for f in self.frames if f.kind in NOT_REPLAYED]

    @property
    def model_ids(self) -> list[ModelIdCheck]:
        merged: dict[tuple[str, str, str], ModelIdCheck] = {}
        for s in self.segments:
            for m in s.model_ids:
                k = (m.source, m.logged_id, m.replay_id)
                old = merged.get(k)
                merged[k] = m if old is None else replace(old, frames=old.frames + m.frames)
        return [merged[k] for k in sorted(merged)]

    @property
    def model_mismatches(self) -> list[ModelIdCheck]:
        return [m for m in self.model_ids if not m.same_bytes]

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.model_mismatches and not self.damage

    def replayed(self) -> dict[str, int]:
        """Frames compared per source replayed with."""
        out: dict[str, int] = {}
        for f in self.frames:
            if f.replayed_with:
                out[f.replayed_with] = out.get(f.replayed_with, 0) + 1
        return out

    def tensor_maxima(self) -> dict[str, tuple[float, int]]:
        """Per tensor name: (largest abs difference over all frames, the frame where it occurred)."""
        out: dict[str, tuple[float, int]] = {}
        for f in self.frames:
            for t in f.tensors:
                if t.name not in out or t.max_abs_diff > out[t.name][0]:
                    out[t.name] = (t.max_abs_diff, f.frame_id)
        return out

    def timeline(self) -> Timeline:
        return Timeline.from_extracts([s.extract for s in self.segments])

    def digest(self) -> str:
        """sha256 over every result (frames, damage, model ids), timings excluded."""
        body = {
            "frames": [asdict(f) for f in self.frames],
            "damage": [asdict(d) for d in self.damage],
            "model_ids": [asdict(m) for m in self.model_ids],
            "skipped_head": [s.skipped_head for s in self.segments],
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


# ---------------------------------------------------------------- tensors and frames

_DTYPES = {"float32", "float16", "uint8", "int32", "int64", "float64", "int8", "uint16", "int16", "uint32", "bool"}


def tensor_to_array(t: Any) -> tuple[str, np.ndarray]:
    """A ``Tensor`` reader -> (name, array of its shape and dtype, little-endian). Raises ``ValueError``
    when the data length does not match the shape and dtype."""
    dtype = str(t.dtype)
    if dtype not in _DTYPES:
        raise ValueError(f"tensor {t.name!r}: unknown dtype {dtype}")
    dt = np.dtype(dtype).newbyteorder("<")
    shape = tuple(int(s) for s in t.shape)
    data = t.data
    want = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if len(data) != want:
        raise ValueError(f"tensor {t.name!r}: {len(data)} bytes for {dtype}{list(shape)} ({want} expected)")
    return t.name, np.frombuffer(data, dt).reshape(shape).astype(dt.newbyteorder("="), copy=True)


def compare_outputs(
    logged: dict[str, np.ndarray], replayed: dict[str, np.ndarray], tol: float
) -> tuple[str, str, tuple[TensorDiff, ...]]:
    """(kind, detail, per-tensor diffs) of one frame: names, then shapes and dtypes, then values."""
    missing, extra = sorted(set(logged) - set(replayed)), sorted(set(replayed) - set(logged))
    diffs: list[TensorDiff] = []
    problems: list[str] = []
    if missing or extra:
        problems.append(f"logged outputs {sorted(logged)} != replayed {sorted(replayed)}")
    kind = KIND_STRUCTURE if problems else KIND_OK
    for name in sorted(set(logged) & set(replayed)):
        a, b = logged[name], replayed[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            kind = KIND_STRUCTURE
            note = f"logged {a.dtype}{list(a.shape)} vs replayed {b.dtype}{list(b.shape)}"
            problems.append(f"{name}: {note}")
            diffs.append(TensorDiff(name, False, float("inf"), int(a.size), int(a.size), None, note))
            continue
        c = compare_tensors(a, b, tol)
        diffs.append(TensorDiff(name, c.ok, c.max_abs_diff, c.n_mismatch, int(a.size), c.first_mismatch))
        if not c.ok:
            if kind == KIND_OK:
                kind = KIND_VALUES
            problems.append(
                f"{name}: {c.n_mismatch}/{a.size} value(s) beyond tol {tol:g}, max abs diff "
                f"{c.max_abs_diff:.6g}, first at {c.first_mismatch}"
            )
    return kind, "; ".join(problems), tuple(diffs)


# ---------------------------------------------------------------- models (one set per process)

_MODELS: dict[tuple[ModelRef, bool], Any] = {}


def _model(ref: ModelRef, jit_cache: bool) -> Any:
    """The loaded model for ``ref`` in this process, loaded once (tinygrad compiles once per process;
    with ``jit_cache`` the captured JIT comes from :class:`~chestnut.backend.jitcache.JitCache`).
    ``tinygrad``: :class:`~chestnut.backend.model.OnnxModel`; ``onnxruntime``: :class:`FallbackModel`."""
    key = (ref, jit_cache)
    if key not in _MODELS:
        from chestnut.backend.jitcache import JitCache

        cache = JitCache() if jit_cache else None
        shapes = {ref.input_name: ref.input_shape}
        if ref.engine == "tinygrad":
            from chestnut.backend.model import OnnxModel

            model: Any = OnnxModel(Path(ref.path), name=ref.name, input_shapes=shapes, jit_cache=cache)
            if cache is None:
                model.warm()  # first call compiles, second captures the JIT: keep both out of the inference time
            _MODELS[key] = model
        else:
            from chestnut.fallback.standby import FallbackModel

            _MODELS[key] = FallbackModel(
                Path(ref.path), ref.engine, name=ref.name, input_shapes=shapes, threads=ref.threads
            )
    return _MODELS[key]


# ---------------------------------------------------------------- one unit of work


@dataclass(frozen=True)
class SegmentTask:
    """One segment file to replay; ``next_path`` is the following segment (answers that crossed over);
    ``has_previous``: the log holds the segment before it (else the node may not have started yet)."""

    index: int
    path: str
    next_path: str | None
    plan: ReplayPlan
    has_previous: bool = False


@dataclass
class _Pending:
    t_ns: int
    eof_ns: int
    image: np.ndarray | None
    error: str = ""
    not_served: str = ""  # why the node was not answering frames then ("" = it was)
    encoding: str = "bgr888"  # the frame's CameraFrame pixel encoding (node/preprocess.py warp)
    absent: str = ""  # why the log holds no pixels of the frame ("" = it does, or they are bad input)
    via_ring: bool = False  # the frame travelled through the camera's shared-memory ring (buffer set)


_NODE_SERVICES = frozenset({"modelOutput", "chestnutActive", "chestnutHealth", "nodeState"})


def _overlaps(gaps: list[tuple[int | None, int | None]], t0: int, t1: int) -> bool:
    """Whether [t0, t1] (ns) touches one of a file's unreadable windows (None = open-ended)."""
    return any((g0 is None or g0 <= t1) and (g1 is None or t0 <= g1) for g0, g1 in gaps)


class _SegmentReplayer:
    def __init__(self, task: SegmentTask, on_frame: Callable[[int], None] | None) -> None:
        self.task = task
        self.plan = task.plan
        self.on_frame = on_frame or (lambda _n: None)
        self.frames: list[FrameResult] = []
        self.ids: dict[tuple[str, str], list[int]] = {}  # (source, logged id) -> [frames, first frame]
        self.infer_s = 0.0
        self.load_s = 0.0
        self.done = 0

    def replay_output(self, fid: int, pending: _Pending, t_ns: int, mo: Any) -> None:
        """Re-run frame ``fid`` with the model for the logged output ``mo`` and record the comparison."""
        from chestnut.node.preprocess import preprocess

        logged_source = str(mo.source)
        base: dict[str, Any] = {"frame_id": fid, "t_ns": t_ns, "logged_source": logged_source}
        self.done += 1
        if self.done % PROGRESS_EVERY_FRAMES == 0:
            self.on_frame(PROGRESS_EVERY_FRAMES)
        late = str(mo.reason).startswith(STALE_FRAME_PREFIX)
        if logged_source == "none" and (late or (pending.via_ring and ring_loss(str(mo.reason)))):
            self.frames.append(
                FrameResult(**base, kind=KIND_TRANSPORT_LOSS, detail=f"the node could not read it in time: {mo.reason}")
            )
            return
        if pending.absent:
            self.frames.append(FrameResult(**base, kind=KIND_NOT_REPLAYABLE, detail=pending.absent))
            return
        if logged_source == "none":  # the node found the frame unusable: it must fail preprocessing here too
            self.frames.append(self._unusable(base, pending, mo))
            return
        src, ref = self.plan.model_for(logged_source)
        if ref is None:
            self.frames.append(
                FrameResult(**base, kind=KIND_NO_MODEL, detail=f"no model to replay a {logged_source!r} output with")
            )
            return
        entry = self.ids.setdefault((src, mo.modelId), [0, fid])
        entry[0] += 1
        base["replayed_with"] = src
        if pending.image is None:
            self.frames.append(FrameResult(**base, kind=KIND_INPUT, detail=pending.error))
            return
        try:
            logged = dict(tensor_to_array(t) for t in mo.outputs)
        except ValueError as e:
            self.frames.append(FrameResult(**base, kind=KIND_STRUCTURE, detail=f"logged output unreadable: {e}"))
            return
        try:
            inputs = preprocess(self.plan.preprocess, pending.image, ref.input_name, ref.input_shape, pending.encoding)
        except (KeyError, ValueError) as e:
            self.frames.append(FrameResult(**base, kind=KIND_INPUT, detail=f"{type(e).__name__}: {e}"))
            return
        t0 = time.perf_counter()
        model = _model(ref, self.plan.jit_cache)
        t1 = time.perf_counter()
        replayed = model.run(inputs)
        self.load_s += t1 - t0
        self.infer_s += time.perf_counter() - t1
        kind, detail, diffs = compare_outputs(logged, replayed, self.plan.tol)
        self.frames.append(FrameResult(**base, kind=kind, detail=detail, tensors=diffs))

    def _unusable(self, base: dict[str, Any], pending: _Pending, mo: Any) -> FrameResult:
        """A frame the node answered without a model (source none): OK when replay cannot use it either."""
        from chestnut.node.preprocess import preprocess

        ref = self.plan.primary or self.plan.fallback
        if pending.image is None:
            return FrameResult(**base, kind=KIND_OK, detail=f"unusable frame, as logged: {pending.error}")
        try:
            if ref is not None:
                preprocess(self.plan.preprocess, pending.image, ref.input_name, ref.input_shape, pending.encoding)
        except (KeyError, ValueError) as e:
            return FrameResult(**base, kind=KIND_OK, detail=f"unusable frame, as logged: {e}")
        return FrameResult(
            **base,
            kind=KIND_INPUT,
            detail=f"the node answered without a model ({mo.reason}) but the frame preprocesses",
        )

    def run(self) -> SegmentResult:
        t_start = time.perf_counter()
        cpu_start = time.process_time()
        task, plan = self.task, self.plan
        recorder = FileRecorder(task.path)
        pending: dict[int, _Pending] = {}  # frames waiting for their output, in log order
        expired: dict[int, _Pending] = {}  # frames that waited longer than STALE_PENDING_S (pixels dropped)
        answered: dict[int, int] = {}
        first_frame: int | None = None
        skipped_head = 0
        early: dict[int, tuple[int, Any]] = {}  # outputs logged before their frame: frame id -> (t, Event)
        stale_ns = int(STALE_PENDING_S * NS_PER_S)
        node_seen = task.has_previous  # the node has published (in this segment or, assumed, before it)
        stopping = False
        logged_frames = LoggedFrames(Path(task.path).parent)  # frames logged as video: beside the segment file
        video_damage: dict[str, DamageRec] = {}  # video file -> its first failure (one damaged file each)
        # file order (reorder window 0): a damage report then follows the last message read before it
        for t, service, ev in LogReader(task.path, on_damage=recorder.on_damage, reorder_window_ns=0):
            recorder.add(t, service, ev)
            if service in _NODE_SERVICES:
                node_seen = True
                if service == "nodeState":
                    stopping = str(ev.nodeState.state) == "stopping"
            if service == "cameraFrame":
                cf = ev.cameraFrame
                fid = int(cf.frameId)
                first_frame = fid if first_frame is None else first_frame
                p = self._read_frame(logged_frames, cf, t, video_damage)
                if not node_seen or stopping:
                    p.not_served = "the node had not started" if not node_seen else "the node was stopping"
                if fid in early:  # its output was logged before it (frame ids out of order)
                    t_out, ev_out = early.pop(fid)
                    answered[fid] = 1
                    self.replay_output(fid, p, t_out, ev_out.modelOutput)
                    continue
                pending[fid] = p
                while pending:  # bounded memory: a frame unanswered this long is not answered at all
                    old_id, old = next(iter(pending.items()))
                    if t - old.t_ns <= stale_ns:
                        break
                    del pending[old_id]
                    expired[old_id] = _Pending(old.t_ns, old.eof_ns, None, not_served=old.not_served)
            elif service == "modelOutput":
                mo = ev.modelOutput
                fid = int(mo.frameId)
                if fid in pending:
                    answered[fid] = 1
                    self.replay_output(fid, pending.pop(fid), t, mo)
                elif fid in answered:
                    answered[fid] += 1
                    self.frames.append(
                        FrameResult(
                            fid,
                            t,
                            KIND_DUPLICATE,
                            str(mo.source),
                            detail=(f"frame {fid} answered {answered[fid]} times"),
                        )
                    )
                elif fid in expired:
                    p = expired.pop(fid)
                    answered[fid] = 1
                    self.frames.append(
                        FrameResult(
                            fid,
                            t,
                            KIND_LATE,
                            str(mo.source),
                            detail=(f"frame {fid} answered {(t - p.t_ns) / NS_PER_S:.1f} s after it was logged"),
                        )
                    )
                elif first_frame is None or fid < first_frame:
                    skipped_head += 1  # the previous segment's frame (its unit replays it), or before the log
                else:
                    early[fid] = (t, ev)  # aligned by frame id: its frame may still come
        logged_frames.close()
        extract = recorder.finish()
        orphans = [
            FrameResult(
                fid,
                t,
                KIND_ORPHAN,
                str(ev.modelOutput.source),
                detail=f"modelOutput for frame {fid}, which is not in the log",
            )
            for fid, (t, ev) in early.items()
        ]
        end_ns = extract.last_ns or 0
        if pending and task.next_path is not None:
            self._look_ahead(pending, task.next_path)
        bound = plan.answer_bound_ns
        for fid, p in sorted({**expired, **pending}.items()):
            due = max(p.eof_ns, p.t_ns) + bound
            if p.not_served:
                self.frames.append(FrameResult(fid, p.t_ns, KIND_NOT_SERVING, detail=p.not_served))
            elif _overlaps(extract.gaps, p.t_ns, due):
                self.frames.append(FrameResult(fid, p.t_ns, KIND_LOST, detail="its answer fell into unreadable log"))
            elif task.next_path is None and due > end_ns:
                self.frames.append(FrameResult(fid, p.t_ns, KIND_IN_FLIGHT, detail="in flight at the end of the log"))
            else:
                self.frames.append(FrameResult(fid, p.t_ns, KIND_MISSING, detail=f"frame {fid} has no modelOutput"))
        self.frames.extend(o for o in orphans if not _overlaps(extract.gaps, o.t_ns - bound, o.t_ns))
        self.frames.sort(key=lambda f: (f.frame_id, f.t_ns, f.kind))
        ids = [
            ModelIdCheck(src, logged, self._replay_id(src), n, first)
            for (src, logged), (n, first) in sorted(self.ids.items())
        ]
        return SegmentResult(
            task.index,
            task.path,
            self.frames,
            [*extract.damage, *video_damage.values()],
            ids,
            skipped_head,
            extract,
            self.infer_s,
            self.load_s,
            time.perf_counter() - t_start,
            os.getpid(),
            time.process_time() - cpu_start,
        )

    @staticmethod
    def _read_frame(frames: LoggedFrames, cf: Any, t: int, damage: dict[str, DamageRec]) -> _Pending:
        """The frame's pixels as the node read them (with its encoding for a warp: ``node/preprocess.py``), or
        why not: a damaged, truncated or missing video (counted once per file in ``damage``) and a ring frame
        logged without pixels make it not replayable; any other unreadable frame is bad input."""
        eof, ring = int(cf.timestampEof), bool(cf._has("buffer"))
        try:
            return _Pending(t, eof, frames.read(cf), encoding=str(cf.encoding), via_ring=ring)
        except VideoFrameError as e:
            damage.setdefault(
                e.where, DamageRec(e.where, VIDEO_DAMAGE_OFFSET, f"frame {e.index}: {e.problem}", t, int(cf.frameId))
            )
            return _Pending(t, eof, None, str(e), absent=f"video damaged: {e}", via_ring=ring)
        except ValueError as e:
            absent = ""
            if logged_without_pixels(cf):
                absent = (
                    f"logged without pixels: cameraFrame {int(cf.frameId)} was overwritten in the camera's ring "
                    "before the logger read it (chestnut record's 'without pixels' count)"
                )
            return _Pending(t, eof, None, str(e), absent=absent, via_ring=ring)

    def _replay_id(self, src: str) -> str:
        ref = {"primary": self.plan.primary, "fallback": self.plan.fallback}[src]
        return ref.model_id if ref is not None else ""

    def _look_ahead(self, pending: dict[int, _Pending], next_path: str) -> None:
        """Answers to this segment's last frames, logged at the start of the next segment."""
        horizon = max(p.t_ns for p in pending.values()) + int(LOOKAHEAD_S * NS_PER_S)
        reader = iter(LogReader(next_path))
        try:
            for t, service, ev in reader:
                if t > horizon or not pending:
                    break
                if service == "modelOutput" and int(ev.modelOutput.frameId) in pending:
                    fid = int(ev.modelOutput.frameId)
                    self.replay_output(fid, pending.pop(fid), t, ev.modelOutput)
        finally:
            close = getattr(reader, "close", None)
            if close is not None:
                close()


def replay_segment(task: SegmentTask, on_frame: Callable[[int], None] | None = None) -> SegmentResult:
    """Replay one segment file: the unit of work. ``on_frame(n)`` is told every few frames done.

    Never raises for bad log content (damage and bad frames are results); raises
    :class:`~chestnut.backend.errors.ModelError` when a model cannot be loaded.
    """
    return _SegmentReplayer(task, on_frame).run()


# ---------------------------------------------------------------- many units

_progress_queue: Any = None


def _init_pool_worker(progress_queue: Any) -> None:
    global _progress_queue
    _progress_queue = progress_queue
    from chestnut.backend.model import ensure_cpu_device

    ensure_cpu_device()


def _pool_replay(task: SegmentTask) -> SegmentResult:
    q = _progress_queue

    def on_frame(n: int) -> None:
        if q is not None:
            q.put_nowait(n)

    result = replay_segment(task, on_frame)
    return result


def plan_tasks(files: list[Path], plan: ReplayPlan) -> list[SegmentTask]:
    """One task per file, each knowing the next file of the same route (answers that crossed over)."""
    from chestnut.msgs.logfile import parse_segment_dir

    def follows(a: Path, b: Path) -> bool:
        sa, sb = parse_segment_dir(a.parent.name), parse_segment_dir(b.parent.name)
        return sa is not None and sb is not None and sb == (sa[0], sa[1] + 1)

    tasks = []
    for i, f in enumerate(files):
        nxt = files[i + 1] if i + 1 < len(files) and follows(f, files[i + 1]) else None
        prev = i > 0 and follows(files[i - 1], f)
        tasks.append(SegmentTask(i, str(f), str(nxt) if nxt else None, plan, prev))
    return tasks


def replay(
    paths: Iterable[Path | str] | Path | str,
    plan: ReplayPlan | None = None,
    *,
    workers: int = 1,
    pool: bool | None = None,
    progress: bool = False,
    **plan_args: Any,
) -> ReplayResult:
    """Replay every segment under ``paths``.

    ``plan`` defaults to :func:`resolve_plan` over the node configuration found in the log with
    ``plan_args`` (``model``, ``fallback_model``, ``source``, ``tol``, ``slack_ms``, ``jit_cache``,
    ``primary_engine``).
    ``workers`` processes (spawn context) run the segments; ``pool`` (default: ``workers > 1``) False
    runs them in this process. ``progress`` shows a rich progress bar on stderr. Raises
    ``FileNotFoundError`` when there is no log, :class:`ReplayError` when no model can be found,
    ``ValueError`` when ``workers`` is below 1 (:func:`check_workers`).
    """
    check_workers(workers)
    files = find_log_files(paths)
    if plan is None:
        config, origin = find_node_config(files), "the log's node initData"
        if not config:
            config, origin = default_node_config()
            origin = f"{origin} (the log carries no node configuration)"
        plan = resolve_plan(config, config_origin=origin, **plan_args)
    tasks = plan_tasks(files, plan)
    use_pool = workers > 1 if pool is None else pool
    t0 = time.perf_counter()
    with _Progress(len(tasks), progress) as bar:
        if not use_pool:
            from chestnut.backend.model import ensure_cpu_device

            ensure_cpu_device()
            results = []
            for task in tasks:
                results.append(replay_segment(task, bar.frames))
                bar.segment_done()
        else:
            results = list(_run_pool(tasks, workers, bar))
    results.sort(key=lambda r: r.index)
    return ReplayResult(plan, results, workers if use_pool else 1, time.perf_counter() - t0)


INTERRUPT_POLL_S = 0.1  # a pool's driver looks for a held Ctrl-C this often while it waits for results


def stop_name(e: KeyboardInterrupt) -> str:
    """What a ``KeyboardInterrupt`` stands for, as a run's interrupted line says it: the signal its argument names
    (``launch/cli.py`` ``as_ctrl_c`` raises ``KeyboardInterrupt("SIGTERM")`` for a SIGTERM, and
    :class:`DeferredInterrupt` holds it as it came), else ``Ctrl-C`` (Python raises it bare for SIGINT)."""
    return e.args[0] if e.args and isinstance(e.args[0], str) and e.args[0].startswith("SIG") else "Ctrl-C"


def _interrupt(signum: int) -> KeyboardInterrupt:
    """The ``KeyboardInterrupt`` for ``signum``: bare for SIGINT (Python's own), else naming it (:func:`stop_name`)."""
    return KeyboardInterrupt() if signum == signal.SIGINT else KeyboardInterrupt(signal.Signals(signum).name)


class DeferredInterrupt:
    """Ctrl-C (SIGINT) while a process pool runs, held until the driver's loop asks for it (:meth:`check`
    raises ``KeyboardInterrupt``) instead of raised wherever the main thread is. Raised inside
    ``concurrent.futures``' own code, an asynchronous ``KeyboardInterrupt`` can cut a spawned worker's start
    short (the child then dies with a traceback on the shared stderr) or leave the executor unable to shut
    down. A second Ctrl-C raises at once (the user insists). Takes effect only in the main thread and only
    over Python's default SIGINT handler, whose ``KeyboardInterrupt`` it only moves in time; the handler is
    restored on exit. A SIGTERM handed to it as a Ctrl-C (``launch/cli.py`` ``as_ctrl_c``, with its own number)
    is held the same way, and its ``KeyboardInterrupt`` names it (:func:`stop_name`)."""

    def __init__(self) -> None:
        self.hit = False
        self.signum: int = signal.SIGINT  # the first stop signal held
        self._installed = False

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is threading.main_thread() and (
            signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def _on_sigint(self, signum: int, _frame: object) -> None:
        if self.hit:
            raise _interrupt(signum)
        self.hit, self.signum = True, signum

    def check(self) -> None:
        """Raises ``KeyboardInterrupt`` when a Ctrl-C (or a SIGTERM handled as one) came since :meth:`__enter__`."""
        if self.hit:
            raise _interrupt(self.signum)

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._installed = False


def _run_pool(tasks: list[SegmentTask], workers: int, bar: _Progress) -> Iterator[SegmentResult]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    futures: set[Future[SegmentResult]] = set()
    try:
        with DeferredInterrupt() as sigint, ProcessPoolExecutor(
            max_workers=min(workers, len(tasks)) or 1, mp_context=ctx, initializer=_init_pool_worker, initargs=(q,)
        ) as ex:
            try:
                futures = {ex.submit(_pool_replay, t) for t in tasks}
                while futures:
                    done, futures = wait(futures, timeout=INTERRUPT_POLL_S, return_when=FIRST_COMPLETED)
                    sigint.check()
                    _drain(q, bar)
                    for fut in done:
                        yield fut.result()
                        bar.segment_done()
                _drain(q, bar)
            except KeyboardInterrupt:  # what has not started is not started; the pool's exit waits for the rest
                for fut in futures:
                    fut.cancel()
                raise
    finally:
        q.close()
        q.join_thread()


def _drain(q: Any, bar: _Progress) -> None:
    while True:
        try:
            bar.frames(q.get_nowait())
        except queue.Empty:
            return


class _Progress:
    """A rich progress bar over segments with a frame counter (no-op when disabled)."""

    def __init__(self, segments: int, enabled: bool) -> None:
        self.enabled = enabled
        self.segments = segments
        self.count = 0
        self._p: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._p = Progress(
                TextColumn("replay"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("segments"),
                TextColumn("{task.fields[frames]} frames"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )
            self._p.start()
            self._task = self._p.add_task("replay", total=self.segments, frames=0)
        return self

    def frames(self, n: int) -> None:
        self.count += n
        if self._p is not None:
            self._p.update(self._task, frames=self.count)

    def segment_done(self) -> None:
        if self._p is not None:
            self._p.advance(self._task)

    def __exit__(self, *exc: object) -> None:
        if self._p is not None:
            self._p.stop()


__all__ = [
    "DEFAULT_TOL",
    "FrameResult",
    "ModelIdCheck",
    "ModelRef",
    "ReplayError",
    "ReplayPlan",
    "ReplayResult",
    "SegmentResult",
    "SegmentTask",
    "TensorDiff",
    "compare_outputs",
    "find_node_config",
    "plan_tasks",
    "read_model",
    "replay",
    "replay_segment",
    "resolve_plan",
    "tensor_to_array",
]
