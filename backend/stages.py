"""One frame's stage times on the primary: copy-in, compute, copy-out (s, float).

A runner that times its stages sets :attr:`StageClock.last` during ``run()`` (the twin runner and the
real runner do, ``backend/twin_runner.py`` / ``backend/real_runner.py`` ``run``); the worker sends it
back with the frame's result (``node/wire.py``), the node publishes it in ``modelOutput``
(``copyInTime``, ``computeTime``, ``copyOutTime``) and rates it against the frame's budget
(``node/health.py`` ``StageBudget``, ``docs/health.md``). Pure code.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

STAGES = ("copy_in", "compute", "copy_out")
"""The stages in the order a frame goes through them; the field names of :class:`StageTimes`."""

STAGE_NAMES = {"copy_in": "copy-in", "compute": "compute", "copy_out": "copy-out"}
"""How a stage is named in reasons, tables and plots."""


@dataclass(frozen=True)
class StageTimes:
    """One frame's stage times, s (non-negative, finite floats).

    ``copy_in``: the frame's inputs from host memory into VRAM; ``compute``: program launch to its
    fence; ``copy_out``: the outputs from VRAM back to host memory. What each includes is the runner's
    to say (its ``run`` docstring). Raises ``ValueError`` for a negative or non-finite time."""

    copy_in: float = 0.0
    compute: float = 0.0
    copy_out: float = 0.0

    def __post_init__(self) -> None:
        for name in STAGES:
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"stage time {name}={v!r}: must be a finite number of seconds >= 0")

    def as_list(self) -> list[float]:
        """``[copy_in, compute, copy_out]`` (s)."""
        return [float(getattr(self, s)) for s in STAGES]

    @property
    def total(self) -> float:
        return self.copy_in + self.compute + self.copy_out


class StageClock:
    """Accumulates one ``run()``'s stage times with ``time.perf_counter`` (a stage may be timed in parts:
    one copy per input or output). :meth:`begin` at the start of a run, :meth:`add` per part,
    :meth:`end` at its end sets :attr:`last`; a run that raises leaves :attr:`last` None."""

    def __init__(self) -> None:
        self.last: StageTimes | None = None
        self._acc = dict.fromkeys(STAGES, 0.0)

    def begin(self) -> None:
        self.last = None
        self._acc = dict.fromkeys(STAGES, 0.0)

    def add(self, stage: str, seconds: float) -> None:
        self._acc[stage] += max(0.0, seconds)

    def end(self) -> StageTimes:
        self.last = StageTimes(**self._acc)
        return self.last

    @staticmethod
    def now() -> float:
        return time.perf_counter()
