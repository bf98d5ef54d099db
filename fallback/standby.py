"""The fallback model: the node's standby on the host CPU, with the primary's output contract.

Two engines serve the same ONNX file:

- ``onnxruntime`` (default): an order of magnitude faster than tinygrad's CPU backend on the PP-OCRv4
  detector at 1x3x128x256 (12-18x p50 on a 2-core machine, ``tests/bench/bench_fallback.py``); it needs no
  compile, so a warm standby is ready in well under a second.
- ``tinygrad``: tinygrad on ``DEV=CPU`` in a captured TinyJit (:class:`~chestnut.fallback.model.OnnxModel`),
  for stacks that want one inference engine everywhere; it uses the compile cache.

Standby modes (DESIGN.md "fallback"): *warm* runs the fallback only when it must answer a frame;
*hot* runs it on every frame, so temporal context is never cold and its outputs can be compared
with the primary's. The mode is the node's decision; this class only runs the model.
"""

from __future__ import annotations

import hashlib
import time
from enum import StrEnum
from pathlib import Path

import numpy as np

from chestnut.backend.errors import ModelError
from chestnut.fallback.jitcache import JitCache
from chestnut.fallback.model import OnnxModel, TensorSpec, _graph_inputs, check_inputs, model_id


class Standby(StrEnum):
    WARM = "warm"
    HOT = "hot"


class Engine(StrEnum):
    ONNXRUNTIME = "onnxruntime"
    TINYGRAD = "tinygrad"


class FallbackModel:
    """A model on the host CPU: ``run(inputs) -> outputs`` with name -> ndarray on both sides.

    ``path`` is the ONNX file or its bytes. ``input_shapes`` fixes symbolic input dims. ``threads``
    bounds onnxruntime's intra-op threads
    (default 1: the fallback must not starve the processes it stands in for). Raises ModelError for
    a missing or unreadable model and for inputs of the wrong name, shape or dtype.
    """

    def __init__(self, path: Path | bytes, engine: Engine | str = Engine.ONNXRUNTIME, name: str | None = None,
                 input_shapes: dict[str, tuple[int, ...]] | None = None, threads: int = 1,
                 jit_cache: JitCache | None = None) -> None:
        self.engine = Engine(engine)
        if isinstance(path, bytes):
            data, self.name = path, name or "model"
        else:
            path = Path(path)
            if not path.is_file():
                raise ModelError("missing_model", f"fallback model file {path} does not exist")
            data = path.read_bytes()
            self.name = name or path.stem
        self.model_id = model_id(self.name, data)
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.inputs: tuple[TensorSpec, ...] = _graph_inputs(data, self.name, input_shapes or {})
        self._tg: OnnxModel | None = None
        if self.engine is Engine.TINYGRAD:
            self._tg = OnnxModel(data, name=self.name, input_shapes=input_shapes, jit_cache=jit_cache)
            self.outputs = self._tg.outputs
            return
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        try:
            self._sess = ort.InferenceSession(data, sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph classes
            raise ModelError("bad_model", f"onnxruntime could not load {self.name}: {e}") from e
        self._out_names = [o.name for o in self._sess.get_outputs()]
        first = self._run_ort({s.name: np.zeros(s.shape, s.dtype) for s in self.inputs})
        self.outputs = tuple(TensorSpec(k, tuple(v.shape), v.dtype.name) for k, v in first.items())

    def _run_ort(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self._out_names, self._sess.run(self._out_names, inputs), strict=True))

    def check_inputs(self, inputs: dict[str, np.ndarray]) -> None:
        """Raise ModelError unless ``inputs`` matches the model's input names, shapes and dtypes exactly."""
        check_inputs(self.inputs, inputs)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One inference; returns name -> a fresh array per output."""
        self.check_inputs(inputs)
        if self._tg is not None:
            return self._tg.run(inputs)
        return self._run_ort(inputs)

    def signature(self) -> dict[str, object]:
        """``{"sha256", "inputs": [...], "outputs": [...]}`` as JSON-ready data (as OnnxModel.signature)."""
        return {"sha256": self.sha256, "inputs": [s.to_json() for s in self.inputs],
                "outputs": [s.to_json() for s in self.outputs]}

    def warm(self, calls: int = 3) -> float:
        """Run ``calls`` times on zeros; returns the last call's duration in s."""
        dt = 0.0
        for _ in range(calls):
            t0 = time.perf_counter()
            self.run({s.name: np.zeros(s.shape, s.dtype) for s in self.inputs})
            dt = time.perf_counter() - t0
        return dt
