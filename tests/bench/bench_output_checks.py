"""Benchmark: what the output checks cost per frame and source (``node/validity.py`` ``check_outputs``).

Every source's output is checked (present, shape, dtype, finite, range, stale); the primary's also
against the fallback's (agreement). Rows: the tiny test model's output (float32 [1,1,16,32]) and the
PP-OCRv4 detector's at 128x256 (float32 [1,1,128,256]), each with and without the agreement check.

Run: ``.venv/bin/python tests/bench/bench_output_checks.py [--calls 2000]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from chestnut.backend.model import TensorSpec
from chestnut.node.validity import StaleDetector, check_outputs, contracts_from_specs

SHAPES = {"tiny [1,1,16,32]": (1, 1, 16, 32), "PP-OCRv4 det [1,1,128,256]": (1, 1, 128, 256)}
WARM_CALLS = 200


def time_checks(shape: tuple[int, ...], calls: int, agreement: bool) -> list[float]:
    """Seconds per ``check_outputs`` call over distinct outputs and inputs (the stale check compares each)."""
    contracts = contracts_from_specs([TensorSpec("prob", shape, "float32")], {"prob": (0.0, 1.0)})
    rng = np.random.default_rng(0)
    outs = [{"prob": rng.random(shape, dtype=np.float32)} for _ in range(50)]
    refs = [{"prob": o["prob"] + np.float32(1e-5)} for o in outs]
    ins = [{"x": rng.random((1, 3, 32, 64), dtype=np.float32)} for _ in range(50)]  # the tiny model's input
    stale = StaleDetector()
    took = []
    for i in range(calls + WARM_CALLS):
        t0 = time.perf_counter()
        report = check_outputs(outs[i % 50], contracts, inputs=ins[i % 50], stale=stale,
                               reference=refs[i % 50] if agreement else None)
        took.append(time.perf_counter() - t0)
        assert report.ok, report.reason
    return took[WARM_CALLS:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    for name, shape in SHAPES.items():
        for agreement in (False, True):
            ms = sorted(t * 1e3 for t in time_checks(shape, args.calls, agreement))
            what = "with agreement (primary)" if agreement else "own checks (every source)"
            print(f"  {name:<28} {what:<27} n={len(ms)}  p50 {ms[len(ms) // 2]:.3f}  "
                  f"p99 {ms[int(len(ms) * 0.99)]:.3f} ms")


if __name__ == "__main__":
    main()
