"""Resident memory of ``chestnut record`` while it logs 20 Hz 128x256x3 camera frames.

Run: ``.venv/bin/python tests/bench/bench_logger.py [--minutes 1 10] [--format both] [--keep DIR]``

A real ``chestnut record`` process (default flags: both formats, 60 s segments) subscribes; this
process publishes ``cameraFrame`` at ``--fps`` (default 20 Hz, openpilot's camera rate) with
128x256x3 bgr888 pixels: a smooth gradient that moves every frame plus 3 bits of noise, so zstd
finds about as much to compress as in a real road image. At each checkpoint (minutes since the
first frame) the logger's RSS (psutil) and CPU time are sampled. Buffers are bounded (ZeroMQ's
receive HWM, one zstd block and one 1 MiB MCAP chunk per file), so RSS at the last checkpoint must
stay within a few MB of the first (the baseline of this run). After SIGTERM the logs are read back
(``LogReader``) and the frames counted against the frames sent.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from benchprefix import own_prefix

from chestnut.msgs.logfile import LogReader
from chestnut.msgs.messaging import PubMaster, new_message

FRAME_SHAPE = (128, 256, 3)  # H, W, C (bgr888)
MB = 1024 * 1024


def frame_pixels(frame_id: int, rng: np.random.Generator, base: np.ndarray) -> bytes:
    """A moving gradient with 3 bits of noise, uint8 (H, W, 3) C order."""
    img = np.roll(base, frame_id % FRAME_SHAPE[1], axis=1)
    return (img ^ rng.integers(0, 8, size=FRAME_SHAPE, dtype=np.uint8)).tobytes()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, nargs="+", default=[1.0, 10.0], help="checkpoints, minutes")
    ap.add_argument("--fps", type=float, default=20.0, help="frames per second (default 20)")
    ap.add_argument("--format", default="both", choices=("both", "zst", "mcap"))
    ap.add_argument("--segment-seconds", type=float, default=60.0)
    ap.add_argument("--keep", type=Path, default=None, help="write the logs here and keep them")
    args = ap.parse_args()
    with own_prefix(f"bench-logger-{os.getpid()}") as prefix:  # its runtime directory goes at the end
        os.environ["CHESTNUT_PREFIX"] = prefix  # the logger's and this process's publisher
        return run(args, sorted(args.minutes))


def run(args: argparse.Namespace, checkpoints: list[float]) -> int:
    """The bench itself, with ``args`` from :func:`main`, checkpoints in minutes ascending; prints the figures."""
    log_dir = args.keep or Path(tempfile.mkdtemp(prefix="bench-logger-"))
    cmd = [sys.executable, "-m", "chestnut.launch.cli", "record", "--log-dir", str(log_dir), "--format",
           args.format, "--segment-seconds", str(args.segment_seconds), "--services", "cameraFrame"]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    try:
        logger = psutil.Process(proc.pid)
        deadline = time.monotonic() + 30
        while not list(log_dir.glob("*--0/rlog.*")):
            if proc.poll() is not None or time.monotonic() > deadline:
                print("chestnut record did not start", file=sys.stderr)
                return 1
            time.sleep(0.05)
        rss_idle = logger.memory_info().rss
        print(f"logger pid {proc.pid}, logs in {log_dir}; RSS before the first frame: {rss_idle / MB:.1f} MB")
        print(f"publishing {FRAME_SHAPE[1]}x{FRAME_SHAPE[0]}x3 frames at {args.fps:g} Hz; checkpoints "
              f"{', '.join(f'{m:g}' for m in checkpoints)} min")
        rng = np.random.default_rng(0)
        ramp = np.linspace(0, 255, FRAME_SHAPE[1], dtype=np.float32)
        base = np.broadcast_to(ramp[None, :, None], FRAME_SHAPE).astype(np.uint8)
        rows = []
        with PubMaster(["cameraFrame"]) as pm:
            time.sleep(0.5)  # the logger connects to the fresh endpoint
            period_s = 1.0 / args.fps
            t0 = time.monotonic()
            cpu0 = sum(logger.cpu_times()[:2])
            sent = 0
            for minute in checkpoints:
                end = t0 + 60.0 * minute
                while (now := time.monotonic()) < end:
                    msg = new_message("cameraFrame")
                    f = msg.cameraFrame
                    f.frameId = sent
                    f.timestampSof = f.timestampEof = msg.logMonoTime
                    f.height, f.width = FRAME_SHAPE[:2]
                    f.encoding = "bgr888"
                    f.data = frame_pixels(sent, rng, base)
                    pm.send("cameraFrame", msg)
                    sent += 1
                    time.sleep(max(0.0, t0 + sent * period_s - time.monotonic()))
                rss = logger.memory_info().rss
                cpu_pct = 100.0 * (sum(logger.cpu_times()[:2]) - cpu0) / (now - t0)
                size = sum(p.stat().st_size for p in log_dir.rglob("rlog.*"))
                rows.append((minute, rss, cpu_pct, sent, size))
                print(f"  {minute:6.2f} min: RSS {rss / MB:7.1f} MB, logger CPU {cpu_pct:5.1f} % of a core, "
                      f"{sent} frames sent, {size / MB:8.1f} MB on disk", flush=True)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=10)
        first, last = rows[0], rows[-1]
        print(f"RSS at {last[0]:g} min minus RSS at {first[0]:g} min: {(last[1] - first[1]) / MB:+.1f} MB "
              f"(ratio {last[1] / first[1]:.3f}); exit code after SIGTERM: {code}")
        reader = LogReader(log_dir, fmt="zst" if args.format in ("both", "zst") else "mcap")
        logged = sum(1 for _, s, _ in reader.iter_raw() if s == "cameraFrame")
        print(f"read back: {logged} of {sent} frames, {len(reader.files)} segments, damage: {reader.damage or 'none'}")
        return 0 if code == 0 else 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if args.keep is None:
            shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
