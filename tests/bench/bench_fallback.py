"""Fallback engines side by side: onnxruntime vs tinygrad (CPU, captured JIT) on the same model and frame.

Usage: .venv/bin/python tests/bench/bench_fallback.py [--model PATH] [--runs 50] [--threads 1]
Prints p50/p99 per engine and the ratio tinygrad/onnxruntime measured in the same run.
Default model: the prepared PP-OCRv4 detector (`chestnut model prepare`), input 1x3x128x256.
"""

import argparse
import time

import numpy as np

from chestnut.backend.jitcache import JitCache
from chestnut.fallback.standby import Engine, FallbackModel
from chestnut.launch.assets import bgr_to_input, default_model_path, read_image_bgr, road_image_path


def bench(model: FallbackModel, x: dict, runs: int) -> np.ndarray:
    model.warm()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        model.run(x)
        times.append(time.perf_counter() - t0)
    return np.array(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    x = {"x": bgr_to_input(read_image_bgr(road_image_path(), 128, 256))}
    res = {}
    for eng in Engine:
        t0 = time.perf_counter()
        m = FallbackModel(a.model, eng, threads=a.threads, jit_cache=JitCache())
        ready = time.perf_counter() - t0
        ms = bench(m, x, a.runs)
        res[eng] = ms
        print(f"{eng.value:12s} ready in {ready:6.2f} s   p50 {np.percentile(ms, 50):7.2f} ms   "
              f"p99 {np.percentile(ms, 99):7.2f} ms")
    r = np.percentile(res[Engine.TINYGRAD], 50) / np.percentile(res[Engine.ONNXRUNTIME], 50)
    print(f"tinygrad / onnxruntime p50 ratio: {r:.1f}x")


if __name__ == "__main__":
    main()
