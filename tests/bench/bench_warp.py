"""The warp on the primary: what crosses the copy path per frame when the primary warps the full frame itself.

Run: ``.venv/bin/python tests/bench/bench_warp.py [--frame nv12:1928x1208] [--frames 40] [--link-mbps 5600
--latency-us 125] [--engine onnxruntime]``

A twin daemon with the dock-like timing model (``tests/bench/bench_copy.py``: 5600 Mbps, the asm2464
firmware README's ~700 MB/s SRAM DMA; 125 us, one USB 3 bus interval; ``--link-mbps 0`` switches it off)
and a :class:`~chestnut.backend.twin_runner.TwinRunner` on tinygrad 0.14's own copy path, loading a small
model (``tests/tinymodel.py``, input 1x3x128x256: the model is not the point) behind the warp of
``--frame`` (``docs/warp.md``). Each frame is one of ``launch/camerad.py``'s synthetic NV12 frames (or BGR
for a ``bgr888`` frame). Printed per frame, medians and p90 over ``--frames``: bytes copied in, copy-in /
compute (the GPU's warp and model) / copy-out times from the runner's own stage clock, and the same for the
pre-warped float input (what the primary was sent before: 1x3x128x256 float32); then the fallback's CPU warp
of the same frames (``warp_numpy``) next to swscale through PyAV (``node/preprocess.py`` ``warp``). The last
line is
``copy-in per frame at <frame>: B bytes, T ms (openpilot#38862: ~22 ms of the 50 ms budget)``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchprefix import own_prefix  # noqa: E402
from tinymodel import make_tiny_onnx  # noqa: E402

from chestnut.backend.interface import ModelSpec  # noqa: E402
from chestnut.backend.ladder import LadderConfig  # noqa: E402
from chestnut.backend.sim.client import TwinDaemon  # noqa: E402
from chestnut.backend.twin_runner import TwinRunner  # noqa: E402
from chestnut.backend.warp import WarpSpec, warp_numpy  # noqa: E402
from chestnut.launch.camerad import synthetic_frames  # noqa: E402
from chestnut.node.preprocess import warp as swscale_warp  # noqa: E402

LINK_MBPS, LATENCY_US = 5600.0, 125.0  # as tests/bench/bench_copy.py
OPENPILOT_COPY_MS = 22.0  # openpilot#38862: the full frame's copy to the USB GPU, of a 50 ms frame


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frame", default="nv12:1928x1208")
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--link-mbps", type=float, default=LINK_MBPS)
    ap.add_argument("--latency-us", type=float, default=LATENCY_US)
    ap.add_argument("--engine", default="onnxruntime", choices=("tinygrad", "onnxruntime"))
    args = ap.parse_args()
    spec = WarpSpec.parse(args.frame, "ppocr", 128, 256)
    serve = ["--engine", args.engine]
    if args.link_mbps:
        serve += ["--link-mbps", str(args.link_mbps), "--latency-us", str(args.latency_us)]
    model = f"link {args.link_mbps:g} Mbps, latency {args.latency_us:g} us" if args.link_mbps else "off"
    print(f"twin timing model: {model}; program engine {args.engine}; frame {spec.frame}")
    # the twin's prefix: $CHESTNUT_PREFIX as given, else one of its own whose runtime directory goes at the end
    with own_prefix(f"bench-warp-{os.getpid()}", env=True), tempfile.TemporaryDirectory() as tmp, \
            TwinDaemon(args=serve) as daemon:
        onnx = make_tiny_onnx(Path(tmp) / "tiny.onnx", 128, 256)
        frames = synthetic_frames(spec.src_h, spec.src_w, "nv12" if spec.encoding == "nv12" else "bgr888")
        cfg = LadderConfig(stability_window_s=0.05)
        rows = []
        for label, warp in (("full frame, warped on the GPU", spec), ("pre-warped float input", None)):
            with TwinRunner(daemon.prefix, config=cfg) as r:
                r.load(ModelSpec(onnx, "tiny", warp=warp))
                stats: dict[str, list[float]] = {"copy_in": [], "compute": [], "copy_out": []}
                nbytes = 0
                for _ in range(args.frames + 2):
                    raw = next(frames)
                    x = raw if warp is not None else warp_numpy(spec, raw)
                    r.run({"x": x})
                    st = r.stages.last
                    assert st is not None
                    nbytes = r.copy_in_bytes
                    for k in stats:
                        stats[k].append(getattr(st, k) * 1e3)
                for k in stats:
                    stats[k] = stats[k][2:]  # the first runs warm the twin's program
                rows.append((label, nbytes, stats))
        for label, nbytes, stats in rows:
            cells = ", ".join(f"{k} {statistics.median(v):.2f} / {pct(v, 90):.2f} ms" for k, v in stats.items())
            print(f"{label}: {nbytes} bytes in per frame; p50 / p90: {cells}")
        cpu: dict[str, list[float]] = {"warp_numpy": [], "swscale": []}
        enc = "nv12" if spec.encoding == "nv12" else "bgr888"
        for _ in range(args.frames + 2):
            raw = next(frames)
            t0 = time.perf_counter()
            warp_numpy(spec, raw)
            t1 = time.perf_counter()
            swscale_warp(raw, enc, spec.dst_h, spec.dst_w)
            cpu["warp_numpy"].append((t1 - t0) * 1e3)
            cpu["swscale"].append((time.perf_counter() - t1) * 1e3)
        cells = ", ".join(f"{k} {statistics.median(v[2:]):.2f} / {pct(v[2:], 90):.2f} ms" for k, v in cpu.items())
        print(f"the fallback's CPU warp per frame, p50 / p90: {cells}")
        label, nbytes, stats = rows[0]
        print(
            f"copy-in per frame at {spec.frame}: {nbytes} bytes, {statistics.median(stats['copy_in']):.1f} ms "
            f"(openpilot#38862: ~{OPENPILOT_COPY_MS:g} ms of the 50 ms budget)"
        )


if __name__ == "__main__":
    main()
