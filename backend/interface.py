"""The one interface the node's primary worker drives, for a real dock and for the twin.

A :class:`PrimaryRunner` lives inside the worker process that owns the dock. Its life:
``qualify()`` (the ladder up to the architecture check) -> ``load(model)`` -> ``run(inputs)`` many
times -> ``close()``. ``probe()`` may be called between runs. Every method raises only the typed
errors of :mod:`chestnut.backend.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from chestnut.backend.errors import Layer
from chestnut.backend.model import TensorSpec
from chestnut.backend.warp import WarpSpec


class StepResult(StrEnum):
    PASS = "pass"
    WARN = "warn"   # usable, with a known hazard (e.g. USB 2 link speed)
    FAIL = "fail"
    SKIPPED = "skipped"  # not reached: an earlier step failed


@dataclass
class LadderStep:
    """One rung of the qualification ladder (``docs/architecture.md``, "Qualification, failover and return")."""

    name: str               # "usb_ids", "link_speed", "link_stability", "ltssm", "gpu_arch", "model_loaded", "warmup"
    layer: Layer            # the health layer this step gives evidence for
    result: StepResult = StepResult.SKIPPED
    duration_s: float = 0.0
    detail: str = ""        # what was seen (e.g. "LTSSM=0x78 after power-on, 12 ms")
    advice: str = ""        # on failure: what to do about it
    reason: str = ""        # on failure: the typed error's reason tag (e.g. "no_dock", "ltssm_stuck")
    error: Any = field(default=None, repr=False, compare=False)  # on failure: the typed ChestnutError

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "layer": self.layer.value, "result": self.result.value,
                "duration_s": round(self.duration_s, 6), "detail": self.detail, "advice": self.advice,
                "reason": self.reason}


@dataclass
class LadderReport:
    steps: list[LadderStep] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(s.result in (StepResult.PASS, StepResult.WARN) for s in self.steps)

    @property
    def first_failure(self) -> LadderStep | None:
        return next((s for s in self.steps if s.result is StepResult.FAIL), None)

    def step(self, name: str) -> LadderStep | None:
        return next((s for s in self.steps if s.name == name), None)

    def to_json(self) -> list[dict[str, Any]]:
        return [s.to_json() for s in self.steps]


@dataclass(frozen=True)
class ModelSpec:
    """What to load: an ONNX file, a display name, fixed input shapes, the recorded warm-up fingerprint, and
    ``warp``: when set, the program on the dock warps the full camera frame to the model's input itself
    (``backend/warp.py``, ``docs/warp.md``): the runner's input is then the raw frame (uint8
    ``warp.frame_shape``, named as the model's one input), and ``run()`` also takes the model's own input
    (the warm-up's fingerprint is recorded on it)."""

    path: Path
    name: str
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    fingerprint: dict[str, Any] | None = None  # see chestnut.backend.fingerprint for the format
    warp: WarpSpec | None = None


@dataclass
class DockObservation:
    """Raw per-layer evidence read by :meth:`PrimaryRunner.probe` (cheap: a few control transfers)."""

    present: bool
    vid_pid: tuple[int, int] | None = None
    bus_address: tuple[int, int] | None = None
    speed_mbps: int | None = None
    link_errors: int | None = None
    ltssm: int | None = None
    fence: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class PrimaryRunner(Protocol):
    kind: str  # "twin" or "real"

    def qualify(self) -> LadderReport:
        """Run the ladder's dock steps (USB IDs -> link speed -> stability -> LTSSM -> GPU arch)."""
        ...

    def load(self, model: ModelSpec) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        """Load the model onto the dock; returns (input specs, output specs). Raises ModelError or a layer error."""
        ...

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One inference: name -> array in, name -> array out. Raises a layer error on any failure."""
        ...

    def probe(self) -> DockObservation:
        ...

    def close(self) -> None:
        ...
