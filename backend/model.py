"""ONNX models on the host CPU: tinygrad in a captured ``TinyJit`` (:class:`OnnxModel`) or onnxruntime
(:class:`OrtModel`), with the tensor specs (:class:`TensorSpec`) every runner's contract is written in.

Used by the twin's GPU engine (which "executes" the dock's programs on the host CPU), the runners'
fingerprints and, one layer up, the fallback (the node's standby model, ``fallback/standby.py``).

tinygrad must be imported with ``DEV=CPU`` in this process: evaluating ``Device.DEFAULT`` with ``DEV``
unset opens each available device in turn (tinygrad 0.14 ``device.py`` ``_Device._select_device``) and
could take a dock's lock, so :func:`ensure_cpu_device` sets it before the first import and refuses to
run in a process whose tinygrad was already imported for another device.

JIT (tinygrad 0.14 ``TinyJit``): the first call runs eagerly, the second captures, the third on
replays; input shapes and dtypes must never change afterwards, which :meth:`OnnxModel.run` enforces.
"""

from __future__ import annotations

import abc
import hashlib
import logging
import os
import stat
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from chestnut.backend.errors import ConfigError, ModelError
from chestnut.backend.jitcache import CacheKey, JitCache, damaged_tinygrad_cache, private_tinygrad_cache
from chestnut.msgs.paths import base_problem, lookup_folders, trusted_owners

log = logging.getLogger("chestnut.model")


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and numpy dtype name (e.g. ``"float32"``) of one model input or output."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(str(d["name"]), tuple(int(s) for s in d["shape"]), str(d["dtype"]))


MAX_MODEL_BYTES = 2 << 30
"""The largest model file read (bytes): protobuf's own limit for one serialized ONNX model (2 GiB)."""


def untrusted_file(path: Path, st: os.stat_result, what: str) -> str | None:
    """Why the file ``path`` must not be trusted, as one line with the fix; None when it may. ``st`` is the file's
    own status (``os.fstat`` of the descriptor it is read from); its folders are stat'ed here, so ``OSError`` may
    be raised. ``what`` names the file in the line (``"model"``: "model file ...").

    A file read from outside that decides what the node computes (a model, the node's configuration) is
    refused -- like the runner code the worker loads (``node/runner_loader.py`` ``trust_refusal``) -- when
    another user could change it: the file or its folder owned by another user than this one or root, or
    writable by group or other (a folder with the sticky bit, like ``/tmp``, protects its files from other
    users). The same rule (``msgs/paths.py`` ``base_problem``) holds for every folder the file is reached through
    (``lookup_folders``: those along ``path`` as given -- a symlink's own folder and the folders above it -- and
    along each symlink's target): whoever can write one could swap the symlink or a folder below it."""
    uid = os.getuid()
    target = path.resolve()
    folder = target.parent
    # ``st`` is the target's: a path reached through a symlink is named with the file it leads to
    linked = target != Path(os.path.abspath(path))
    file_shown = f"{path} -> {target}" if linked else path
    for kind, where, shown, s_ in (("file", target if linked else path, file_shown, st),
                                   ("folder", folder, folder, os.stat(folder))):
        if s_.st_uid not in (uid, 0):
            return (f"{what} {kind} {shown} is owned by uid {s_.st_uid}, not by {trusted_owners(uid)}: another user "
                    f"could change what the node computes (copy it to a folder you own)")
        sticky_dir = kind == "folder" and s_.st_mode & stat.S_ISVTX
        if s_.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_dir:
            return (f"{what} {kind} {shown} is writable by group or other (mode {stat.S_IMODE(s_.st_mode):04o}): "
                    f"another user could change what the node computes (chmod go-w {where})")
    for where in lookup_folders(path):
        fst = os.stat(where)
        if (problem := base_problem(fst, uid)) is not None:
            chmod = f"chmod go-w {where}, or " if fst.st_uid in (uid, 0) else ""
            return (f"{what} file {path} is reached through {where}, which {problem}: another user could change "
                    f"what the node computes ({chmod}give a path that does not pass through it)")
    return None


def read_model_file(path: Path, what: str = "model") -> bytes:
    """The bytes of the ONNX file ``path`` (``what`` names it in errors: "model", "fallback model"), read
    from one descriptor of a regular file (a FIFO or device is never opened: ``msgs/video.py``
    ``open_regular``), at most :data:`MAX_MODEL_BYTES`.

    A model decides what the node publishes, so it is refused when another user could change it
    (:func:`untrusted_file`). Raises :class:`ModelError` ``missing_model`` (absent, a folder, unreadable, too
    large) or ``untrusted_model``, one line each with the fix."""
    from chestnut.msgs.video import NotRegularFileError, open_regular

    try:
        fd = open_regular(path, follow=True)
    except NotRegularFileError as e:
        if path.is_dir():
            raise ModelError("missing_model", f"{what} file {path} is a folder: give the .onnx file in it") from None
        raise ModelError("missing_model", f"{what} file {path}: {e}") from None
    except FileNotFoundError:
        raise ModelError("missing_model", f"{what} file {path} does not exist") from None
    except OSError as e:
        raise ModelError("missing_model", f"{what} file {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        try:
            refusal = untrusted_file(path, st, what)
        except OSError as e:  # a folder on the way changed since the open
            raise ModelError("missing_model", f"{what} file {path}: {e.strerror or e}") from None
        if refusal is not None:
            raise ModelError("untrusted_model", refusal)
        if st.st_size > MAX_MODEL_BYTES:
            raise ModelError("missing_model", f"{what} file {path} is {st.st_size} bytes, over the "
                             f"{MAX_MODEL_BYTES} an ONNX model can be")
        return f.read(MAX_MODEL_BYTES)


def ensure_cpu_device() -> None:
    """Make tinygrad in this process use the host CPU.

    Sets ``DEV=CPU`` before tinygrad's first import and keeps tinygrad's disk cache private
    (:func:`~chestnut.backend.jitcache.private_tinygrad_cache`). Raises :class:`ConfigError` if tinygrad was
    already imported with ``DEV`` naming another device (its ``getenv`` is cached at import).
    """
    private_tinygrad_cache()
    _cpu_device()


def _cpu_device() -> None:
    """``DEV=CPU`` before tinygrad's first import; raises :class:`ConfigError` if tinygrad was already imported
    with ``DEV`` naming another device."""
    if "tinygrad" not in sys.modules:
        os.environ["DEV"] = "CPU"
        return
    dev = os.environ.get("DEV", "")
    if dev.split(":")[0] != "CPU":
        raise ConfigError("device", f"tinygrad was already imported in this process with DEV={dev!r}; need DEV=CPU")


def host_cache_key(model_sha256: str, inputs: tuple[TensorSpec, ...]) -> CacheKey:
    """The compile cache's key of a captured JIT, on the host CPU, of the model whose bytes hash to ``model_sha256``
    with ``inputs``: the entry :class:`OnnxModel` loads and stores (device tinygrad's ``Device.DEFAULT``, the
    installed tinygrad's version). Imports tinygrad with ``DEV=CPU`` as :func:`ensure_cpu_device` does, and compiles
    nothing (tinygrad's disk cache is not opened). Raises :class:`ConfigError` if tinygrad was already imported in
    this process for another device."""
    from importlib.metadata import version

    _cpu_device()
    from tinygrad import Device

    specs = tuple((s.name, s.shape, s.dtype) for s in inputs)
    return CacheKey(model_sha256, specs, Device.DEFAULT, version("tinygrad"))


def model_label(name: str, path: Path | None = None, what: str = "model") -> str:
    """How a refusal names a model: ``"<what> file <path>"`` for bytes read from a file (the file the user gave,
    with ``--model`` or a configuration's path, not the name it runs under, which may be the configuration's
    ``[model] name`` of another file), else ``name`` (bytes of no known file: a program image, a test's)."""
    return name if path is None else f"{what} file {path}"


def model_id(name: str, onnx_bytes: bytes) -> str:
    """The identity written into ``modelOutput.modelId``: ``"<name>@<first 16 hex of sha256>"``."""
    return f"{name}@{hashlib.sha256(onnx_bytes).hexdigest()[:16]}"


def _graph_inputs(onnx_bytes: bytes, name: str, shapes: dict[str, tuple[int, ...]]) -> tuple[TensorSpec, ...]:
    """Input specs read with the ``onnx`` package (initializers excluded); raises ModelError naming the model
    ``name`` (:func:`model_label`: the file it was read from, where there is one): ``unknown_input`` for a shape
    given under a name the model has no input of (its inputs named: a shape it cannot apply is never dropped),
    ``bad_input_shape`` for an input left without a fixed shape, ``bad_model`` for bytes that are no ONNX model
    (an empty file included: protobuf reads it as a model without a graph)."""
    import onnx
    from onnx import helper

    try:
        proto = onnx.load_from_string(onnx_bytes)
    except Exception as e:  # protobuf raises DecodeError and friends
        raise ModelError("bad_model", f"{name} is not a readable ONNX model: {e}") from e
    if not proto.HasField("graph"):  # protobuf parses an empty file (or any bytes of no field) as an empty model
        raise ModelError("bad_model", f"{name} is not an ONNX model: it has no graph ({len(onnx_bytes)} bytes)")
    graph = proto.graph
    inits = {i.name for i in graph.initializer}
    names = [i.name for i in graph.input if i.name not in inits]
    if unknown := sorted(k for k in shapes if k not in names):
        raise ModelError("unknown_input", f"{name} has no input {', '.join(map(repr, unknown))} (its inputs: "
                                          f"{', '.join(map(repr, names))})")
    specs = []
    for inp in graph.input:
        if inp.name in inits:
            continue
        dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in inp.type.tensor_type.shape.dim)
        shape = tuple(shapes[inp.name]) if inp.name in shapes else dims
        if not all(isinstance(d, int) and d > 0 for d in shape):
            raise ModelError(
                "bad_input_shape", f"input {inp.name!r} of {name} has shape {list(dims)}; give a fixed shape"
            )
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type)).name
        specs.append(TensorSpec(inp.name, tuple(int(d) for d in shape), dtype))
    return tuple(specs)


def check_inputs(specs: tuple[TensorSpec, ...], inputs: dict[str, np.ndarray]) -> None:
    """Raise :class:`ModelError` unless ``inputs`` has exactly ``specs``' names, shapes and dtypes."""
    if set(inputs) != {s.name for s in specs}:
        raise ModelError("bad_input", f"inputs {sorted(inputs)} != model inputs {[s.name for s in specs]}")
    for s in specs:
        a = inputs[s.name]
        if tuple(a.shape) != s.shape or a.dtype != np.dtype(s.dtype):
            raise ModelError(
                "bad_input", f"input {s.name!r}: got {a.dtype}{list(a.shape)}, want {s.dtype}{list(s.shape)}"
            )


def verification_inputs(specs: tuple[TensorSpec, ...]) -> dict[str, np.ndarray]:
    """A fixed, seeded input per spec (floats ~ N(0,1), integers in [0, 100)): the compile cache's check input."""
    rng = np.random.default_rng(20261130)
    out = {}
    for s in specs:
        dt = np.dtype(s.dtype)
        out[s.name] = (
            rng.standard_normal(s.shape).astype(dt) if dt.kind == "f" else rng.integers(0, 100, s.shape).astype(dt)
        )
    return out


def outputs_digest(outputs: dict[str, np.ndarray]) -> str:
    """sha256 over the outputs' names, shapes, dtypes and bytes, in name order."""
    h = hashlib.sha256()
    for k in sorted(outputs):
        a = np.ascontiguousarray(outputs[k])
        h.update(f"{k}|{a.shape}|{a.dtype}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _source(source: str | Path | bytes, name: str | None, origin: Path | None,
            what: str) -> tuple[bytes, str, Path | None]:
    """(bytes, name, file) of a host model's ``source``: a path is read (:func:`read_model_file`, ``what`` naming
    it) and named by its stem unless ``name`` is given; bytes come from ``origin`` (None: no known file)."""
    if isinstance(source, bytes):
        return source, name or (origin.stem if origin is not None else "model"), origin
    path = Path(source)
    return read_model_file(path, what), name or path.stem, path


class _HostModel(abc.ABC):
    """What both host models share: input checks, zero inputs, warm-up and the signature. A subclass sets
    ``sha256`` and ``inputs`` and provides :attr:`outputs` and :meth:`run`."""

    sha256: str
    inputs: tuple[TensorSpec, ...]

    @property
    @abc.abstractmethod
    def outputs(self) -> tuple[TensorSpec, ...]: ...

    @abc.abstractmethod
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def check_inputs(self, inputs: dict[str, np.ndarray]) -> None:
        """Raise :class:`ModelError` unless ``inputs`` has exactly the model's names, shapes and dtypes."""
        check_inputs(self.inputs, inputs)

    def zero_inputs(self) -> dict[str, np.ndarray]:
        return {s.name: np.zeros(s.shape, s.dtype) for s in self.inputs}

    def warm(self, calls: int = 3) -> None:
        """Run ``calls`` times on zeros (a tinygrad model's JIT is captured on the 2nd call)."""
        for _ in range(calls):
            self.run(self.zero_inputs())

    def signature(self) -> dict[str, Any]:
        """``{"sha256", "inputs": [...], "outputs": [...]}`` as JSON-ready data."""
        return {
            "sha256": self.sha256,
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
        }


class OnnxModel(_HostModel):
    """An ONNX model on the host CPU (tinygrad, ``DEV=CPU``) with fixed input shapes, captured in a TinyJit.

    ``source`` is a path or the model's bytes (read from the file ``origin``, when they were). ``input_shapes``
    fixes symbolic dimensions (name -> shape). With ``jit_cache`` (a :class:`~chestnut.backend.jitcache.JitCache`)
    the captured JIT is loaded from / stored to the compile cache, and the model is ready (captured and
    verified) when the constructor returns; ``progress`` receives one line per build phase.
    Raises :class:`ModelError` for a missing file, an unreadable graph, a non-fixed input shape, or a
    graph tinygrad cannot parse or run, each naming the file (:func:`model_label`, ``what`` its role).
    tinygrad's disk cache found damaged while the graph is parsed or compiled is no fault of the model: it is moved
    aside (``backend/jitcache.py`` ``damaged_tinygrad_cache``, one WARNING line) and the model built again once, from
    the parse; met by a later first :meth:`run`, it is :class:`ModelError` ``cache_damaged`` with that line.
    """

    def __init__(
        self,
        source: str | Path | bytes,
        name: str | None = None,
        input_shapes: dict[str, tuple[int, ...]] | None = None,
        jit_cache: JitCache | None = None,
        progress: Callable[[str], None] | None = None,
        origin: Path | None = None,
        what: str = "model",
    ) -> None:
        ensure_cpu_device()
        self.onnx_bytes, self.name, self.path = _source(source, name, origin, what)
        self.label = model_label(self.name, self.path, what)
        self.sha256 = hashlib.sha256(self.onnx_bytes).hexdigest()
        self.model_id = model_id(self.name, self.onnx_bytes)
        self.inputs: tuple[TensorSpec, ...] = _graph_inputs(self.onnx_bytes, self.label, input_shapes or {})
        self._outputs: tuple[TensorSpec, ...] | None = None
        self._lock = threading.Lock()
        self.cache_hit = False
        from tinygrad import Tensor

        self._Tensor = Tensor
        self._runner: Any = None
        self._jit: Any = None
        say = progress or (lambda _msg: None)
        if jit_cache is None:
            self._afresh_if_cache_damaged(self._build_runner)
            return
        key = host_cache_key(self.sha256, self.inputs)
        if (hit := jit_cache.load(key)) is not None:
            self._jit, meta = hit
            self._outputs = tuple(TensorSpec.from_json(o) for o in meta["outputs"])
            say(f"{self.name}: compile cache hit ({key.digest[:12]}), verifying")
            if self._verify_digest() == meta["verify_digest"]:
                self.cache_hit = True
                return
            log.warning("compile cache entry %s reproduced a different output; rebuilding", key.digest[:12])
            self._outputs = None
        self._afresh_if_cache_damaged(lambda: self._compile(say))
        digest = self._verify_digest()
        stored = jit_cache.store(
            key,
            self._jit,
            {"outputs": [o.to_json() for o in self.outputs], "verify_digest": digest, "model_name": self.name},
        )
        say(f"{self.name}: compiled and cached ({key.digest[:12]})" if stored is not None else
            f"{self.name}: compiled, not cached (the compile cache was refused: above)")

    def _compile(self, say: Callable[[str], None]) -> None:
        """Parse the graph, run it once (every kernel compiles) and once more (the JIT captures)."""
        self._outputs = None
        say(f"{self.name}: parsing the ONNX graph")
        self._build_runner()
        say(f"{self.name}: first run (compiles every kernel; tens of seconds for a real model)")
        self.run(self.zero_inputs())
        say(f"{self.name}: capturing the JIT")
        self.run(self.zero_inputs())

    @staticmethod
    def _afresh_if_cache_damaged(build: Callable[[], None]) -> None:
        """``build()``, and once more after a ``cache_damaged`` ModelError (tinygrad's disk cache is fresh then)."""
        try:
            build()
        except ModelError as e:
            if e.reason != "cache_damaged":
                raise
            log.warning("%s", e.detail)
            build()

    def _build_runner(self) -> None:
        from tinygrad import Tensor, TinyJit, dtypes
        from tinygrad.nn.onnx import OnnxRunner

        try:
            self._runner = OnnxRunner(Tensor(self.onnx_bytes, dtype=dtypes.uint8))
        except Exception as e:  # tinygrad raises plain exceptions for graphs it cannot parse
            if (damaged := damaged_tinygrad_cache(e)) is not None:
                raise ModelError("cache_damaged", damaged) from e
            raise ModelError("bad_model", f"tinygrad could not parse {self.label}: {type(e).__name__}: {e}") from e
        self._jit = TinyJit(self._forward)

    def _verify_digest(self) -> str:
        return outputs_digest(self.run(verification_inputs(self.inputs)))

    def _forward(self, **inputs: Any) -> dict[str, Any]:
        return {k: v.realize() for k, v in self._runner(inputs).items()}

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        """Output specs; known after the first :meth:`run` (or :meth:`warm`)."""
        if self._outputs is None:
            self.warm()
        assert self._outputs is not None
        return self._outputs

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once. ``inputs``: name -> array of the declared shape and dtype. Returns name -> a fresh array.
        The first run is where tinygrad meets each node of the graph (``OnnxRunner.__call__``: an operator it does
        not implement is a ``NotImplementedError`` there): what it raises then is a ModelError naming the file, or
        ``cache_damaged`` when it was tinygrad's disk cache that failed (then moved aside: the next build is fresh)."""
        self.check_inputs(inputs)
        with self._lock:
            try:
                out = self._jit(**{k: self._Tensor(np.ascontiguousarray(v)) for k, v in inputs.items()})
                result = {k: v.numpy().copy() for k, v in out.items()}
            except Exception as e:  # tinygrad's own: NotImplementedError, AssertionError, ValueError, ...
                if self._outputs is not None:
                    raise
                if (damaged := damaged_tinygrad_cache(e)) is not None:
                    raise ModelError("cache_damaged", damaged) from e
                raise ModelError("bad_model", f"tinygrad could not run {self.label}: {type(e).__name__}: "
                                              f"{' '.join(str(e).split())}") from e
        if self._outputs is None:
            self._outputs = tuple(TensorSpec(k, tuple(v.shape), v.dtype.name) for k, v in result.items())
        return result



class OrtModel(_HostModel):
    """An ONNX model on the host CPU through onnxruntime's ``CPUExecutionProvider``, with fixed input shapes.

    ``source`` is a path or the model's bytes (read from the file ``origin``, when they were); ``input_shapes``
    fixes symbolic dimensions (name -> shape). ``threads`` bounds onnxruntime's intra-op threads (default 1: a
    host-side model must not starve the processes around it). The session is run once on zeros in the
    constructor, so ``outputs`` is known when it returns. Raises :class:`ModelError` for a missing file, an
    unreadable graph, a non-fixed input shape, or a graph onnxruntime cannot load, each naming the file
    (:func:`model_label`, ``what`` its role).
    """

    def __init__(
        self,
        source: str | Path | bytes,
        name: str | None = None,
        input_shapes: dict[str, tuple[int, ...]] | None = None,
        threads: int = 1,
        origin: Path | None = None,
        what: str = "model",
    ) -> None:
        self.onnx_bytes, self.name, self.path = _source(source, name, origin, what)
        self.label = model_label(self.name, self.path, what)
        self.sha256 = hashlib.sha256(self.onnx_bytes).hexdigest()
        self.model_id = model_id(self.name, self.onnx_bytes)
        self.inputs: tuple[TensorSpec, ...] = _graph_inputs(self.onnx_bytes, self.label, input_shapes or {})
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        try:
            self._sess = ort.InferenceSession(self.onnx_bytes, sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph classes
            raise ModelError("bad_model", f"onnxruntime could not load {self.label}: {e}") from e
        self._out_names = [o.name for o in self._sess.get_outputs()]
        first = self._run({s.name: np.zeros(s.shape, s.dtype) for s in self.inputs})
        self._outputs = tuple(TensorSpec(k, tuple(v.shape), v.dtype.name) for k, v in first.items())

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self._outputs

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self._out_names, self._sess.run(self._out_names, inputs), strict=True))

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once. ``inputs``: name -> array of the declared shape and dtype. Returns name -> a fresh array."""
        self.check_inputs(inputs)
        return self._run(inputs)

