"""The fallback model: the node's standby on the host CPU, with the primary's output contract.

Two engines serve the same ONNX file:

- ``onnxruntime`` (default): an order of magnitude faster than tinygrad's CPU backend on the PP-OCRv4
  detector at 1x3x128x256 (12-18x p50 on a 2-core machine, ``tests/bench/bench_fallback.py``); it needs no
  compile, so a warm standby is ready in well under a second.
- ``tinygrad``: tinygrad on ``DEV=CPU`` in a captured TinyJit (:class:`~chestnut.backend.model.OnnxModel`),
  for stacks that want one inference engine everywhere; it uses the compile cache.

Standby modes (``docs/architecture.md``): *warm* runs the fallback only when it must answer a frame;
*hot* runs it on every frame, so temporal context is never cold and its outputs can be compared
with the primary's. The mode is the node's decision; this class only runs the model.
"""

from __future__ import annotations

import time
from enum import StrEnum
from pathlib import Path

import numpy as np

from chestnut.backend.jitcache import JitCache
from chestnut.backend.model import OnnxModel, OrtModel, TensorSpec, check_inputs


class Standby(StrEnum):
    WARM = "warm"
    HOT = "hot"


class Engine(StrEnum):
    ONNXRUNTIME = "onnxruntime"
    TINYGRAD = "tinygrad"


class FallbackModel:
    """A model on the host CPU: ``run(inputs) -> outputs`` with name -> ndarray on both sides.

    ``path`` is the ONNX file or its bytes. ``engine`` picks the runner: :class:`~chestnut.backend.model.OrtModel`
    (onnxruntime) or :class:`~chestnut.backend.model.OnnxModel` (tinygrad ``DEV=CPU``, through ``jit_cache``).
    ``input_shapes`` fixes symbolic input dims. ``threads`` bounds onnxruntime's intra-op threads
    (default 1: the fallback must not starve the processes it stands in for). Raises ModelError for
    a missing or unreadable model (naming the file: ``backend/model.py`` ``model_label``) and for inputs of the
    wrong name, shape or dtype.
    """

    def __init__(
        self,
        path: Path | bytes,
        engine: Engine | str = Engine.ONNXRUNTIME,
        name: str | None = None,
        input_shapes: dict[str, tuple[int, ...]] | None = None,
        threads: int = 1,
        jit_cache: JitCache | None = None,
    ) -> None:
        self.engine = Engine(engine)
        self._model: OnnxModel | OrtModel  # each reads a path as "fallback model" (backend/model.py read_model_file)
        if self.engine is Engine.TINYGRAD:
            self._model = OnnxModel(path, name=name, input_shapes=input_shapes, jit_cache=jit_cache,
                                    what="fallback model")
        else:
            self._model = OrtModel(path, name=name, input_shapes=input_shapes, threads=threads, what="fallback model")
        self.name = self._model.name
        self.model_id = self._model.model_id
        self.sha256 = self._model.sha256
        self.nbytes = len(self._model.onnx_bytes)
        self.inputs: tuple[TensorSpec, ...] = self._model.inputs
        self.outputs: tuple[TensorSpec, ...] = self._model.outputs

    @classmethod
    def of(cls, model: OrtModel, name: str) -> FallbackModel:
        """The fallback served by ``model``, an onnxruntime session already loaded (the node's contract loads the
        primary's file once: ``node/contract.py``), named ``name`` (its ``model_id`` is ``name@<sha256 prefix>``)."""
        from chestnut.backend.model import model_id

        fb = cls.__new__(cls)
        fb.engine, fb._model = Engine.ONNXRUNTIME, model
        fb.name, fb.model_id, fb.sha256 = name, model_id(name, model.onnx_bytes), model.sha256
        fb.nbytes = len(model.onnx_bytes)
        fb.inputs, fb.outputs = model.inputs, model.outputs
        return fb

    def check_inputs(self, inputs: dict[str, np.ndarray]) -> None:
        """Raise ModelError unless ``inputs`` matches the model's input names, shapes and dtypes exactly."""
        check_inputs(self.inputs, inputs)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One inference; returns name -> a fresh array per output."""
        return self._model.run(inputs)

    def signature(self) -> dict[str, object]:
        """``{"sha256", "inputs": [...], "outputs": [...]}`` as JSON-ready data (as OnnxModel.signature)."""
        return self._model.signature()

    def warm(self, calls: int = 3) -> float:
        """Run ``calls`` times on zeros; returns the last call's duration in s."""
        dt = 0.0
        for _ in range(calls):
            t0 = time.perf_counter()
            self.run({s.name: np.zeros(s.shape, s.dtype) for s in self.inputs})
            dt = time.perf_counter() - t0
        return dt
