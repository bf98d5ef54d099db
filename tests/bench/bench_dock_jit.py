"""Benchmark: a start of the real runner's model load, cold (compile, capture, store) and warm (the compile cache).

Each start is a fresh process, as a worker (and every recovery) is, running
``backend/real_runner.py`` ``load_or_build_jit`` on the host CPU device (the dock runs the same function
with ``device="AMD"``), then one run. Rows: the load's wall time, the kernels compiled (the growth of
tinygrad 0.14's ``codegen/__init__.py`` ``to_program_cache``) and whether it was built or loaded.

Run: ``.venv/bin/python tests/bench/bench_dock_jit.py [--model M] [--warm 3]`` (default model: the
prepared PP-OCRv4 detector, ``chestnut model prepare``). The compile cache is a fresh temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from chestnut.backend.model import _graph_inputs, ensure_cpu_device
    ensure_cpu_device()
    from tinygrad import Device
    from tinygrad.codegen import to_program_cache
    Device["CPU"]
    from chestnut.backend.jitcache import JitCache
    from chestnut.backend.real_runner import load_or_build_jit
    import numpy as np
    data = Path(sys.argv[1]).read_bytes()
    inputs = _graph_inputs(data, "model", {})
    before = len(to_program_cache)
    t0 = time.perf_counter()
    dj = load_or_build_jit(data, "model", inputs, "CPU", "gfx1201", JitCache(Path(sys.argv[2])))
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    dj.call({s.name: np.zeros(s.shape, s.dtype) for s in inputs})
    print(json.dumps({"built": dj.built, "load_s": load_s, "compiled": len(to_program_cache) - before,
                      "run_ms": (time.perf_counter() - t0) * 1e3}))
""")


def start(model: Path, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DEV", "GMMU", "HCQDEV_WAIT_TIMEOUT_MS")}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(cache)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from chestnut.node.config import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=default_model_path())
    p.add_argument("--warm", type=int, default=3, help="warm starts after the cold one")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        cache = Path(d) / "jit"
        rows = [("cold", start(args.model, cache))] + [
            (f"warm {i + 1}", start(args.model, cache)) for i in range(args.warm)
        ]
    print(f"model {args.model} ({args.model.stat().st_size / 1e6:.1f} MB), device CPU, one process per start")
    print(f"{'start':<8} {'load s':>8} {'kernels compiled':>17} {'from cache':>11} {'first run ms':>13}")
    for name, r in rows:
        print(f"{name:<8} {r['load_s']:8.2f} {r['compiled']:17d} {str(not r['built']):>11} {r['run_ms']:13.1f}")


if __name__ == "__main__":
    main()
