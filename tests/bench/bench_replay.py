"""Replay throughput: frames per second per worker, and the speed-up of 2 workers over 1.

A multi-segment log is generated with real outputs (``tests/drivelog.py``: frames at 20 Hz, served
in alternating 20-frame blocks by the primary on tinygrad and the fallback on onnxruntime), then
replayed three ways on the same log in the same run:

- in-process (``--workers 1``: no process pool, the CLI's default);
- a spawn-context pool of 1 worker (the baseline for the speed-up);
- a pool of 2 workers.

Per-worker throughput is frames / (worker wall time - model load time) summed per process; the
speed-up is wall(pool 1) / wall(pool 2); "cores busy" is the worker's CPU time over its wall time
(tinygrad's CPU device runs kernels on a thread of its own). Each process loads (compiles) its models once; that cost is
printed apart. The results of all three runs must be identical (checked). On a 2-core machine shared
with other work, the speed-up is bounded by the idle cores.

Usage: ``.venv/bin/python tests/bench/bench_replay.py [--frames 400] [--segments 4] [--height 128 --width 256]
[--model PATH|ppocr]`` (default model: the tiny test model at the given shape; ``ppocr``: the prepared
PP-OCRv4 detector, 128x256, with the compile cache).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drivelog import FRAME_PERIOD_NS, build_frames_log, write_drive  # noqa: E402
from tinymodel import make_tiny_onnx  # noqa: E402

from chestnut.node.offline.replay import ReplayResult, replay  # noqa: E402


def per_worker(r: ReplayResult) -> list[tuple[int, int, float, float, float]]:
    """(pid, frames, busy s, load s, CPU cores used) per worker process."""
    acc: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for s in r.segments:
        a = acc[s.pid]
        a[0] += sum(1 for f in s.frames if f.replayed_with)
        a[1] += s.wall_s - s.load_s
        a[2] += s.load_s
        a[3] += s.cpu_s
        a[4] += s.wall_s
    return [(pid, int(a[0]), a[1], a[2], a[3] / a[4] if a[4] else 0.0) for pid, a in sorted(acc.items())]


def show(label: str, r: ReplayResult) -> None:
    n = sum(1 for f in r.frames if f.replayed_with)
    print(f"{label:<14} wall {r.wall_s:7.2f} s  {n / r.wall_s:8.1f} frames/s overall  "
          f"mismatches {len(r.mismatches)}")
    for pid, frames, busy, load, cores in per_worker(r):
        rate = frames / busy if busy > 0 else float("nan")
        print(f"{'':<14} worker {pid}: {frames} frames, {rate:8.1f} frames/s (model load {load:.2f} s, "
              f"{cores:.2f} cores busy)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=400)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--height", type=int, default=128)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--model", help="ONNX model with input x [1,3,H,W], or 'ppocr' for the prepared PP-OCRv4 "
                    "detector (chestnut model prepare); default: the tiny test model")
    args = ap.parse_args()
    cache = args.model is not None  # a real model compiles for tens of seconds: use the compile cache
    if args.model == "ppocr":
        from chestnut.launch.assets import default_model_path

        args.model = default_model_path()
    elif args.model is not None:
        args.model = Path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        model = args.model or make_tiny_onnx(tmpd / "tiny.onnx", args.height, args.width)
        t0 = time.perf_counter()
        items = build_frames_log(model, args.frames, args.height, args.width, jit_cache=cache)
        seconds = (args.frames + 1) * FRAME_PERIOD_NS / 1e9
        segs = write_drive(items, tmpd / "logs", segment_seconds=seconds / args.segments)
        print(f"log: {args.frames} frames {args.height}x{args.width}, {len(segs)} segments, model {model.name}, "
              f"generated in {time.perf_counter() - t0:.1f} s")
        runs = {
            "in-process": replay(tmpd / "logs", jit_cache=cache, workers=1, pool=False),
            "pool, 1": replay(tmpd / "logs", jit_cache=cache, workers=1, pool=True),
            "pool, 2": replay(tmpd / "logs", jit_cache=cache, workers=2, pool=True),
        }
        for label, r in runs.items():
            show(label, r)
        digests = {r.digest() for r in runs.values()}
        speedup = runs["pool, 1"].wall_s / runs["pool, 2"].wall_s
        print(f"speed-up, 2 workers over 1: {speedup:.2f}x (wall clock, model loads included); "
              f"results identical: {len(digests) == 1}")
        return 0 if len(digests) == 1 and all(r.ok for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
