"""An ONNX model run by tinygrad on the host CPU, captured in a ``TinyJit``.

Used by the fallback (the node's standby model) and by the twin's GPU engine (which "executes" the
dock's programs on the host CPU). tinygrad must be imported with ``DEV=CPU`` in this process:
evaluating ``Device.DEFAULT`` with ``DEV`` unset probes devices and could take a dock's lock
(FACTS.md §2), so :func:`ensure_cpu_device` sets it before the first import and refuses to run in a
process whose tinygrad was already imported for another device.

JIT (tinygrad 0.14 ``TinyJit``): the first call runs eagerly, the second captures, the third on
replays; input shapes and dtypes must never change afterwards, which :meth:`OnnxModel.run` enforces.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from chestnut.backend.errors import ConfigError, ModelError


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


def ensure_cpu_device() -> None:
    """Make tinygrad in this process use the host CPU.

    Sets ``DEV=CPU`` before tinygrad's first import. Raises :class:`ConfigError` if tinygrad was
    already imported with ``DEV`` naming another device (its ``getenv`` is cached at import).
    """
    if "tinygrad" not in sys.modules:
        os.environ["DEV"] = "CPU"
        return
    dev = os.environ.get("DEV", "")
    if dev.split(":")[0] != "CPU":
        raise ConfigError("device", f"tinygrad was already imported in this process with DEV={dev!r}; need DEV=CPU")


def model_id(name: str, onnx_bytes: bytes) -> str:
    """The identity written into ``modelOutput.modelId``: ``"<name>@<first 16 hex of sha256>"``."""
    return f"{name}@{hashlib.sha256(onnx_bytes).hexdigest()[:16]}"


class OnnxModel:
    """An ONNX model on the host CPU with fixed input shapes.

    ``source`` is a path or the model's bytes. ``input_shapes`` fixes symbolic dimensions
    (name -> shape); a graph input without a fixed shape and without an entry raises ModelError.
    Raises :class:`ModelError` for a missing file or a graph tinygrad cannot parse.
    """

    def __init__(self, source: str | Path | bytes, name: str | None = None,
                 input_shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        ensure_cpu_device()
        if isinstance(source, bytes):
            self.onnx_bytes = source
            self.name = name or "model"
        else:
            path = Path(source)
            if not path.is_file():
                raise ModelError("missing_model", f"model file {path} does not exist")
            self.onnx_bytes = path.read_bytes()
            self.name = name or path.stem
        self.sha256 = hashlib.sha256(self.onnx_bytes).hexdigest()
        self.model_id = model_id(self.name, self.onnx_bytes)
        from tinygrad import Tensor, TinyJit, dtypes
        from tinygrad.nn.onnx import OnnxRunner

        try:
            self._runner = OnnxRunner(Tensor(self.onnx_bytes, dtype=dtypes.uint8))
        except Exception as e:  # tinygrad raises plain exceptions for bad graphs
            raise ModelError("bad_model", f"tinygrad could not parse {self.name}: {type(e).__name__}: {e}") from e
        shapes = input_shapes or {}
        self.inputs: tuple[TensorSpec, ...] = tuple(
            self._input_spec(n, spec, shapes.get(n)) for n, spec in self._runner.graph_inputs.items()
        )
        self._Tensor = Tensor
        self._jit = TinyJit(self._forward)
        self._lock = threading.Lock()
        self._outputs: tuple[TensorSpec, ...] | None = None

    def _input_spec(self, name: str, spec: Any, override: tuple[int, ...] | None) -> TensorSpec:
        shape = tuple(override) if override is not None else tuple(spec.shape)
        if not all(isinstance(d, int) and d > 0 for d in shape):
            raise ModelError("bad_input_shape", f"input {name!r} has shape {spec.shape}; give a fixed shape")
        return TensorSpec(name, shape, np.dtype(spec.dtype.fmt or "f").name if hasattr(spec.dtype, "fmt") else "float32")

    def _forward(self, **inputs: Any) -> dict[str, Any]:
        return {k: v.realize() for k, v in self._runner(inputs).items()}

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        """Output specs; known after the first :meth:`run` (or :meth:`warm`)."""
        if self._outputs is None:
            self.warm()
        assert self._outputs is not None
        return self._outputs

    def check_inputs(self, inputs: dict[str, np.ndarray]) -> None:
        """Raise :class:`ModelError` unless ``inputs`` has exactly the model's names, shapes and dtypes."""
        if set(inputs) != {s.name for s in self.inputs}:
            raise ModelError("bad_input", f"inputs {sorted(inputs)} != model inputs {[s.name for s in self.inputs]}")
        for s in self.inputs:
            a = inputs[s.name]
            if tuple(a.shape) != s.shape or a.dtype != np.dtype(s.dtype):
                raise ModelError("bad_input", f"input {s.name!r}: got {a.dtype}{list(a.shape)}, want {s.dtype}{list(s.shape)}")

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once. ``inputs``: name -> array of the declared shape and dtype. Returns name -> a fresh array."""
        self.check_inputs(inputs)
        with self._lock:
            out = self._jit(**{k: self._Tensor(np.ascontiguousarray(v)) for k, v in inputs.items()})
            result = {k: v.numpy().copy() for k, v in out.items()}
        if self._outputs is None:
            self._outputs = tuple(TensorSpec(k, tuple(v.shape), v.dtype.name) for k, v in result.items())
        return result

    def zero_inputs(self) -> dict[str, np.ndarray]:
        return {s.name: np.zeros(s.shape, s.dtype) for s in self.inputs}

    def warm(self, calls: int = 3) -> None:
        """Run ``calls`` times on zeros so the JIT is captured (tinygrad captures on the 2nd call)."""
        for _ in range(calls):
            self.run(self.zero_inputs())

    def signature(self) -> dict[str, Any]:
        """``{"sha256", "inputs": [...], "outputs": [...]}`` as JSON-ready data."""
        return {"sha256": self.sha256, "inputs": [s.to_json() for s in self.inputs],
                "outputs": [s.to_json() for s in self.outputs]}
