"""The primary model on the host CPU: a :class:`~chestnut.backend.interface.PrimaryRunner` without a dock.

Used where there is no dock (``dock.kind = "cpu"``) and to exercise the worker's IPC with a real
model. It runs inside the worker process like any other runner.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from chestnut.backend.errors import ModelError
from chestnut.backend.interface import DockObservation, LadderReport, ModelSpec
from chestnut.backend.model import TensorSpec


class HostCpuRunner:
    """The primary model on the host CPU (:class:`~chestnut.backend.model.OnnxModel`, tinygrad ``DEV=CPU``).

    No dock: ``qualify()`` has no steps and passes, ``probe()`` reports ``present=False``. ``load``
    warms the JIT (``warm_calls`` runs on zeros: tinygrad 0.14 ``engine/jit.py`` ``TinyJit.__call__``
    captures on the 2nd call) so the first request pays no compile. (The worker checks the warm-up
    fingerprint for every runner.) ``run`` raises :class:`ModelError` ``"not_loaded"`` before ``load``.
    """

    kind = "cpu"

    def __init__(self, warm_calls: int = 3, use_jit_cache: bool = True) -> None:
        self.warm_calls = warm_calls
        self.use_jit_cache = use_jit_cache
        self._model: Any = None

    def qualify(self) -> LadderReport:
        return LadderReport([])

    def load(self, model: ModelSpec) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        from chestnut.backend.jitcache import JitCache
        from chestnut.backend.model import OnnxModel

        self._model = OnnxModel(model.path, name=model.name, input_shapes=dict(model.input_shapes) or None,
                                jit_cache=JitCache() if self.use_jit_cache else None)
        self._model.warm(self.warm_calls)
        return self._model.inputs, self._model.outputs

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._model is None:
            raise ModelError("not_loaded", "run() before load()")
        out: dict[str, np.ndarray] = self._model.run(inputs)
        return out

    def probe(self) -> DockObservation:
        return DockObservation(present=False, extra={"runner": "cpu"})

    def close(self) -> None:
        self._model = None
