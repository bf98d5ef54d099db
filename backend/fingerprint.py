"""The warm-up fingerprint: a model's output on a fixed input, recorded on the host CPU.

The last rung of the qualification ladder runs the loaded model once on a fixed input and compares
the result with this record. The format (JSON-ready, kept in :attr:`ModelSpec.fingerprint`)::

    {
      "version": 1,
      "model_sha256": "<sha256 of the ONNX bytes>",
      "seed": 20260401,                       # numpy default_rng seed of the fixed input
      "inputs":  {"x": {"shape": [1,3,32,64], "dtype": "float32"}},
      "outputs": {"prob": {"shape": [1,1,16,32], "dtype": "float32",
                           "sha256": "<sha256 of the raw little-endian bytes>",
                           "mean": 0.49, "std": 0.03, "min": 0.41, "max": 0.58, "nonfinite": 0,
                           "first": [0.5, 0.47, ...]}},    # the first FIRST_VALUES elements, flattened
      "rtol": 1e-3, "atol": 1e-4
    }

The fixed input: per input in signature order, float dtypes draw ``standard_normal`` and integer
dtypes ``integers(0, 100)`` from one ``numpy.random.default_rng(seed)``.

A result matches when, per output, the shape and dtype are equal and either the bytes hash equal,
or the number of non-finite values is equal and mean, std, min, max and each of the first values
agree within ``|a-b| <= max(atol, rtol*max(|a|,|b|))`` (openpilot's process-replay tolerance). The
twin runs the same tinygrad CPU kernels as the recording, so it matches by hash; a real GPU matches
within tolerance.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from chestnut.backend.errors import ModelError
from chestnut.backend.model import TensorSpec

FINGERPRINT_VERSION = 1
DEFAULT_SEED = 20260401
FIRST_VALUES = 8
DEFAULT_RTOL = 1e-3
DEFAULT_ATOL = 1e-4
FINGERPRINT_MAX_BYTES = 1 << 20
"""The most bytes a fingerprint file may hold (1 MiB; our bound, not a format's): one is a few KB (per output
:func:`summarize`'s statistics and :data:`FIRST_VALUES` values), so a bigger file is not a fingerprint and is refused
before a byte of it is read (:func:`read_fingerprint_file`)."""


def fixed_inputs(specs: tuple[TensorSpec, ...] | list[TensorSpec], seed: int = DEFAULT_SEED) -> dict[str, np.ndarray]:
    """The fingerprint's input: name -> array of the spec's shape and dtype, drawn from ``default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for s in specs:
        dt = np.dtype(s.dtype)
        if dt.kind == "f":
            out[s.name] = rng.standard_normal(s.shape).astype(dt)
        elif dt.kind in "iu":
            out[s.name] = rng.integers(0, 100, s.shape).astype(dt)
        elif dt.kind == "b":
            out[s.name] = rng.integers(0, 2, s.shape).astype(dt)
        else:
            raise ModelError("bad_input", f"no fixed input for dtype {s.dtype} of {s.name!r}")
    return out


def summarize(a: np.ndarray) -> dict[str, Any]:
    """Shape, dtype, sha256 of the bytes, finite-value statistics and the first values of one output."""
    a = np.ascontiguousarray(a)
    flat = a.reshape(-1)
    finite = flat[np.isfinite(flat)] if flat.dtype.kind == "f" else flat
    f64 = finite.astype(np.float64)
    stat = (lambda fn: float(fn(f64))) if f64.size else (lambda fn: 0.0)
    return {
        "shape": list(a.shape),
        "dtype": a.dtype.name,
        "sha256": hashlib.sha256(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()).hexdigest(),
        "mean": stat(np.mean), "std": stat(np.std), "min": stat(np.min), "max": stat(np.max),
        "nonfinite": int(flat.size - finite.size),
        "first": [float(v) for v in flat[:FIRST_VALUES].astype(np.float64)],
    }


def make_fingerprint(model_sha256: str, inputs: tuple[TensorSpec, ...] | list[TensorSpec],
                     outputs: dict[str, np.ndarray], seed: int = DEFAULT_SEED,
                     rtol: float = DEFAULT_RTOL, atol: float = DEFAULT_ATOL) -> dict[str, Any]:
    """Build the fingerprint record from outputs computed on :func:`fixed_inputs` ``(inputs, seed)``."""
    return {
        "version": FINGERPRINT_VERSION,
        "model_sha256": model_sha256,
        "seed": seed,
        "inputs": {s.name: {"shape": list(s.shape), "dtype": s.dtype} for s in inputs},
        "outputs": {k: summarize(v) for k, v in sorted(outputs.items())},
        "rtol": rtol,
        "atol": atol,
    }


def record_fingerprint(model: Any, seed: int = DEFAULT_SEED, rtol: float = DEFAULT_RTOL,
                       atol: float = DEFAULT_ATOL) -> dict[str, Any]:
    """Record ``model``'s fingerprint on the host CPU.

    ``model`` is a :class:`chestnut.backend.interface.ModelSpec` (loaded here with the CPU
    :class:`chestnut.backend.model.OnnxModel`, so this process must be a ``DEV=CPU`` one) or an
    ``OnnxModel`` already built. Raises ModelError for an unusable model.
    """
    from chestnut.backend.model import OnnxModel

    if not isinstance(model, OnnxModel):
        model = OnnxModel(model.path, name=model.name, input_shapes=model.input_shapes or None)
    outputs = model.run(fixed_inputs(model.inputs, seed))
    return make_fingerprint(model.sha256, model.inputs, outputs, seed, rtol, atol)


class FingerprintFileError(ValueError):
    """A fingerprint file that cannot be used (:func:`read_fingerprint_file`). ``reason`` is a tag: ``missing``
    (nothing at the path), ``unreadable``, ``not_regular``, ``too_big``, ``not_json`` or ``not_object``;
    ``problem`` is one phrase that follows the file's name, e.g. ``"is 4294967296 bytes, over the 1048576 a
    fingerprint may hold"``; ``str()`` is ``"<path> <problem>"``."""

    def __init__(self, path: str | os.PathLike[str], reason: str, problem: str) -> None:
        super().__init__(f"{os.fspath(path)} {problem}")
        self.path, self.reason, self.problem = os.fspath(path), reason, problem


def read_fingerprint_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The fingerprint recorded in the file ``path`` (a JSON object, as :func:`make_fingerprint` makes it), read
    with a bound: the one reader of the node (``node/contract.py`` ``read_fingerprint``, ``check_fallback``) and
    of ``chestnut model prepare`` (``launch/assets.py`` ``prepared_damage``).

    ``path`` must be a regular file of at most :data:`FINGERPRINT_MAX_BYTES` bytes: a symlink is never followed
    and a FIFO or device never opened (``msgs/video.py`` ``open_regular``), and a bigger file is refused on its
    ``fstat`` size before anything is read (a sparse 4 GiB file costs no read at all). Raises
    :class:`FingerprintFileError`, one line; its ``reason`` and ``problem``: ``missing`` / ``unreadable``
    ``"cannot be read (<strerror>)"``, ``not_regular`` ``"is a symlink, not a regular file"`` (a FIFO, a
    directory, ...), ``too_big`` ``"is N bytes, over the 1048576 a fingerprint may hold"``, ``not_json`` ``"does
    not read as JSON"``, ``not_object`` ``"is not a JSON object"``. What the object says is not checked here
    (:func:`compare` checks it against a model's outputs)."""
    from chestnut.msgs.video import NotRegularFileError, open_regular

    try:
        fd = open_regular(path)
    except NotRegularFileError as e:
        raise FingerprintFileError(path, "not_regular", f"is {e.kind}, not a regular file") from None
    except OSError as e:
        reason = "missing" if isinstance(e, FileNotFoundError) else "unreadable"
        raise FingerprintFileError(path, reason, f"cannot be read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        try:
            size = os.fstat(f.fileno()).st_size
            data = b"" if size > FINGERPRINT_MAX_BYTES else f.read(FINGERPRINT_MAX_BYTES + 1)
        except OSError as e:  # EIO
            raise FingerprintFileError(path, "unreadable", f"cannot be read ({e.strerror or e})") from None
    size = max(size, len(data))  # a file that grew after its fstat is judged on what was read
    if size > FINGERPRINT_MAX_BYTES:
        raise FingerprintFileError(path, "too_big",
                                   f"is {size} bytes, over the {FINGERPRINT_MAX_BYTES} a fingerprint may hold")
    try:
        fp = json.loads(data)
    except ValueError:  # a UnicodeDecodeError too
        raise FingerprintFileError(path, "not_json", "does not read as JSON") from None
    if not isinstance(fp, dict):
        raise FingerprintFileError(path, "not_object", "is not a JSON object")
    return fp


@dataclass(frozen=True)
class FingerprintCheck:
    """The outcome of :func:`compare`: ``ok``, ``exact`` (all bytes equal) and a one-line ``detail``."""

    ok: bool
    exact: bool
    detail: str


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= max(atol, rtol * max(abs(a), abs(b)))


def compare(fingerprint: dict[str, Any], outputs: dict[str, np.ndarray]) -> FingerprintCheck:
    """Compare ``outputs`` (from :func:`fixed_inputs` with the record's seed) with ``fingerprint``."""
    if fingerprint.get("version") != FINGERPRINT_VERSION:
        return FingerprintCheck(False, False, f"fingerprint version {fingerprint.get('version')!r} is not "
                                              f"{FINGERPRINT_VERSION}")
    want: dict[str, dict[str, Any]] = fingerprint["outputs"]
    if set(want) != set(outputs):
        return FingerprintCheck(False, False, f"outputs {sorted(outputs)} != recorded {sorted(want)}")
    rtol, atol = float(fingerprint.get("rtol", DEFAULT_RTOL)), float(fingerprint.get("atol", DEFAULT_ATOL))
    exact, worst = True, ""
    for name in sorted(want):
        rec, got = want[name], summarize(outputs[name])
        if got["shape"] != rec["shape"] or got["dtype"] != rec["dtype"]:
            return FingerprintCheck(False, False, f"{name}: got {got['dtype']}{got['shape']}, "
                                                  f"recorded {rec['dtype']}{rec['shape']}")
        if got["sha256"] == rec["sha256"]:
            continue
        exact = False
        if got["nonfinite"] != rec["nonfinite"]:
            return FingerprintCheck(False, False, f"{name}: {got['nonfinite']} non-finite values, "
                                                  f"recorded {rec['nonfinite']}")
        for key in ("mean", "std", "min", "max"):
            if not _close(got[key], rec[key], rtol, atol):
                return FingerprintCheck(False, False, f"{name}: {key} {got[key]:.6g} != recorded {rec[key]:.6g} "
                                                      f"(rtol {rtol:g}, atol {atol:g})")
        for i, (g, r) in enumerate(zip(got["first"], rec["first"], strict=False)):
            if not _close(g, r, rtol, atol):
                return FingerprintCheck(False, False, f"{name}[{i}]: {g:.6g} != recorded {r:.6g} "
                                                      f"(rtol {rtol:g}, atol {atol:g})")
        worst = f"{name} within tolerance (mean {got['mean']:.6g} vs {rec['mean']:.6g})"
    if exact:
        return FingerprintCheck(True, True, f"{len(want)} output(s) bit-exact")
    return FingerprintCheck(True, False, worst)
