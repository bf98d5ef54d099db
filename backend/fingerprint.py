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
import math
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
