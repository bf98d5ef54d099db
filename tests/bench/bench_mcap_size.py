"""Disk cost of each log file and MCAP channel encoding, per minute of the stack's traffic at 20 Hz.

Writes ``--seconds`` of real traffic-video frames (128x256 BGR, ``chestnut camera``'s default source)
with one modelOutput (a 1x1x128x256 float32 map, the PP-OCRv4 detector's output) per frame and
the small services at their registry rates, through :class:`chestnut.msgs.logfile.RouteWriter`, once
per variant: rlog.zst, MCAP with capnproto channels, MCAP with JSON channels, MCAP with both.
Prints MB per minute for each. Usage: ``.venv/bin/python tests/bench/bench_mcap_size.py --seconds 10``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from chestnut.launch.assets import traffic_video_path
from chestnut.launch.camerad import iter_frames
from chestnut.msgs.logfile import RouteWriter
from chestnut.msgs.messaging import log_from_bytes, new_message


def traffic(seconds: float) -> list[tuple[str, bytes]]:
    out = []
    frames = iter_frames(traffic_video_path(), 128, 256)
    t0 = time.monotonic_ns()
    for i in range(int(seconds * 20)):
        img = next(frames)
        m = new_message("cameraFrame")
        m.logMonoTime = t0 + i * 50_000_000
        f = m.cameraFrame
        f.frameId, f.width, f.height, f.data = i, 256, 128, img.tobytes()
        f.timestampEof = m.logMonoTime
        out.append(("cameraFrame", m.to_bytes()))
        o = new_message("modelOutput")
        o.logMonoTime = m.logMonoTime + 20_000_000
        o.modelOutput.frameId = i
        o.modelOutput.source = "primary"
        t = o.modelOutput.init("outputs", 1)[0]
        t.name, t.dtype = "text_prob", "float32"
        t.shape = [1, 1, 128, 256]
        prob = (img[:, :, 1].astype(np.float32) / 255.0).reshape(1, 1, 128, 256)
        t.data = prob.tobytes()
        o.modelOutput.executionTime, o.modelOutput.frameAge = 0.016, 0.02
        out.append(("modelOutput", o.to_bytes()))
        a = new_message("chestnutActive")
        a.logMonoTime = o.logMonoTime + 1
        a.chestnutActive.active = True
        a.chestnutActive.reason = "all layers OK"
        out.append(("chestnutActive", a.to_bytes()))
        c = new_message("controlState")
        c.logMonoTime = o.logMonoTime + 2
        c.controlState.engaged = True
        out.append(("controlState", c.to_bytes()))
        if i % 4 == 0:
            h = new_message("chestnutHealth")
            h.logMonoTime = o.logMonoTime + 3
            layers = h.chestnutHealth.init("layers", 4)
            for k, name in enumerate(("usb", "pcie", "gpu", "output")):
                layers[k].layer = name
            out.append(("chestnutHealth", h.to_bytes()))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args()
    msgs = traffic(args.seconds)
    variants = {
        "rlog.zst": (("zst",), ("capnproto",)),
        "mcap capnproto": (("mcap",), ("capnproto",)),
        "mcap json": (("mcap",), ("json",)),
        "mcap both": (("mcap",), ("capnproto", "json")),
    }
    for name, (formats, enc) in variants.items():
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            with RouteWriter(Path(d), formats=formats, mcap_encodings=enc) as w:
                for service, data in msgs:
                    w.write(service, log_from_bytes(data).logMonoTime, data)
            cpu = time.perf_counter() - t
            size = sum(f.stat().st_size for f in Path(d).rglob("rlog.*"))
        per_min = size / 1e6 * 60 / args.seconds
        print(f"{name:16s} {per_min:7.1f} MB/min  write {cpu / args.seconds * 100:5.1f} % of one core")


if __name__ == "__main__":
    main()
