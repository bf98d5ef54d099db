"""Fleet replay throughput: ``local`` and ``ray`` executors with 1 and 2 workers on the same fleet.

A source log is generated with real outputs (``tests/drivelog.py`` ``build_frames_log``: frames at
20 Hz, alternating 20-frame blocks served by the primary on tinygrad and the fallback on onnxruntime),
cut into segments and copied under new route ids (``chestnut fleet make``'s
:func:`~chestnut.node.offline.fleet.make_fleet`). The same fleet is then replayed by:

- ``local 1 in``: this process (the CLI's default; its models are already warm from generating the log);
  ``local 1`` / ``local 2``: a spawn-context pool of 1 or 2 fresh processes;
- ``ray 1`` / ``ray 2``: 1 or 2 actors on a private Ray cluster on this machine (2 CPUs, 100 MB object
  store), started before the runs (cluster start is printed apart); ``ray 2 ship``: the same with the
  segments shipped through the object store (``--ship-logs``).

Per run, timed from creating the executor (Ray's actors start then, while the driver resolves the
logs' plans): wall time to the last result, segments/s and frames/s over it; the time to the first
result (worker start, model load and compile, first segment); steady-state segments/s between the first and the last
result; and the scheduling overhead per segment: the round trip from handing a segment out to having
its result, minus the segment's own run time in the worker (mean and p50). The results of all runs must
be identical (checked: :meth:`FleetReplay.digest`).

Usage: ``.venv/bin/python tests/bench/bench_fleet.py [--copies 8] [--segments 4] [--frames 160]
[--height 128 --width 256] [--model PATH|ppocr] [--only local,ray]`` (default model: the tiny test
model at the given shape; ``ppocr``: the prepared PP-OCRv4 detector with the compile cache).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drivelog import FRAME_PERIOD_NS, build_frames_log, write_drive  # noqa: E402
from tinymodel import make_tiny_onnx  # noqa: E402

from chestnut.node.offline.executor import LocalExecutor  # noqa: E402
from chestnut.node.offline.fleet import FleetReplay, make_fleet, replay_fleet  # noqa: E402

OBJECT_STORE = 100 * 1024 * 1024


def timed(make: Callable[[], Any], fleet: Path, cache: bool) -> tuple[FleetReplay, float]:
    """(the fleet replayed on a new executor, s from creating the executor to the run's start): Ray's
    actors start when the executor is created, while the driver resolves the logs' plans."""
    t0 = time.perf_counter()
    ex = make()
    try:
        r = replay_fleet(fleet, ex, jit_cache=cache)
    finally:
        ex.close()
    return r, (time.perf_counter() - t0) - r.run.wall_s


def show(label: str, timed_run: tuple[FleetReplay, float]) -> None:
    r, before = timed_run
    run = r.run
    outs = sorted(run.outcomes, key=lambda o: o.done_s)
    frames = sum(1 for res in r.logs.values() for f in res.frames if f.replayed_with)
    first = before + outs[0].done_s if outs else float("nan")
    steady = (len(outs) - 1) / (outs[-1].done_s - outs[0].done_s) if len(outs) > 1 else float("nan")
    over = [max(o.done_s - o.queued_s - o.run_s, 0.0) * 1e3 for o in outs]
    wall = before + run.wall_s  # from creating the executor to the last result
    print(
        f"{label:<11} wall {wall:6.2f} s  {len(outs) / wall:6.2f} segments/s  "
        f"{frames / wall:7.1f} frames/s  first result {first:5.2f} s  steady {steady:6.2f} segments/s  "
        f"overhead/segment mean {statistics.fmean(over):6.2f} ms p50 {statistics.median(over):6.2f} ms  "
        f"mismatches {sum(len(x.mismatches) for x in r.logs.values())}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=8, help="copies of the source log in the fleet")
    ap.add_argument("--segments", type=int, default=4, help="segments per log")
    ap.add_argument("--frames", type=int, default=160, help="frames per log")
    ap.add_argument("--height", type=int, default=128)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--model", help="ONNX model with input x [1,3,H,W], or 'ppocr' (chestnut model prepare)")
    ap.add_argument("--only", default="local,ray", help="executors to run (comma-separated)")
    args = ap.parse_args()
    cache = args.model is not None
    if args.model == "ppocr":
        from chestnut.launch.assets import default_model_path

        args.model = default_model_path()
    elif args.model is not None:
        args.model = Path(args.model)
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        model = args.model or make_tiny_onnx(tmpd / "tiny.onnx", args.height, args.width)
        t0 = time.perf_counter()
        items = build_frames_log(model, args.frames, args.height, args.width, jit_cache=cache)
        seconds = (args.frames + 1) * FRAME_PERIOD_NS / 1e9
        write_drive(items, tmpd / "src", segment_seconds=seconds / args.segments)
        dirs = make_fleet(tmpd / "src", args.copies, tmpd / "fleet")
        size = sum(f.stat().st_size for f in (tmpd / "fleet").rglob("rlog.*"))
        print(
            f"fleet: {args.copies} logs x {len(dirs) // args.copies} segments = {len(dirs)} segments, "
            f"{args.copies * args.frames} frames {args.height}x{args.width}, {size / 1e6:.1f} MB, model "
            f"{model.name}; generated in {time.perf_counter() - t0:.1f} s"
        )
        fleet = tmpd / "fleet"
        timed_runs: dict[str, tuple[FleetReplay, float]] = {}
        if "local" in only:
            local: list[tuple[str, Callable[[], Any]]] = [
                ("local 1 in", lambda: LocalExecutor(1)),
                ("local 1", lambda: LocalExecutor(1, pool=True)),
                ("local 2", lambda: LocalExecutor(2)),
            ]
            for label, make in local:
                timed_runs[label] = timed(make, fleet, cache)
                show(label, timed_runs[label])
        if "ray" in only:
            import ray

            from chestnut.node.offline.ray_executor import RayExecutor

            t1 = time.perf_counter()
            ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's session files: ours, 0700
            ray.init(
                _temp_dir=ray_tmp,
                num_cpus=2,
                object_store_memory=OBJECT_STORE,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
            print(f"ray cluster (2 CPUs) started in {time.perf_counter() - t1:.2f} s")
            try:
                remote: list[tuple[str, Callable[[], Any]]] = [
                    ("ray 1", lambda: RayExecutor(workers=1)),
                    ("ray 2", lambda: RayExecutor(workers=2)),
                    ("ray 2 ship", lambda: RayExecutor(workers=2, ship_logs=True)),
                ]
                for label, make in remote:
                    timed_runs[label] = timed(make, fleet, cache)
                    show(label, timed_runs[label])
            finally:
                ray.shutdown()
                shutil.rmtree(ray_tmp, ignore_errors=True)
        runs = {k: r for k, (r, _before) in timed_runs.items()}
        for n in (1, 2):
            a, b = timed_runs.get(f"local {n}"), timed_runs.get(f"ray {n}")
            if a and b:
                print(
                    f"{n} worker(s): ray / local, from creating the executor to the last result: "
                    f"{(b[0].run.wall_s + b[1]) / (a[0].run.wall_s + a[1]):.2f}"
                )
        same = len({r.digest() for r in runs.values()}) == 1
        print(f"results identical across runs: {same}")
        return 0 if same and all(r.ok for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
