"""Disk per minute and CPU of ``chestnut record`` logging camera frames raw and as video, at 20 Hz.

Run: ``.venv/bin/python tests/bench/bench_video_log.py [--seconds 10] [--cases default,traffic,nv12]
[--modes raw,ffv1,h264] [--keep DIR]``

For every case and mode a real ``chestnut record`` process (its default files: rlog.zst and a JSON
rlog.mcap per segment; ``--frames raw``, or ``--frames video`` with ``--video-codec ffv1`` (lossless)
or ``--video-codec h264 --crf 23`` (lossy)) subscribes to ``cameraFrame`` on a prefix of its own, and
this process publishes ``--seconds`` of frames at 20 Hz the way ``chestnut camera`` does
(``launch/camerad.py``: inline up to ``msgs/visionipc.py`` ``INLINE_MAX_BYTES``, through the
shared-memory ring above):

- ``default``: the real traffic video (``mvtb-data``) resized to 128x256 BGR, the stack's default frame;
- ``traffic``: the same video at its own 704x576, BGR (1.2 MB a frame);
- ``nv12``: ``synthetic_frames`` at 1928x1208 NV12, openpilot's road camera frame (3.5 MB).

Figures per run: frames logged of frames sent; MB per minute of logging (the segment directory's
files, scaled from the frames logged with their pixels to 1200 frames), split into the logs (rlog +
MCAP) and the video; the logger's CPU time (``/proc/<pid>/stat`` utime + stime) per frame logged with
its pixels, times 20 Hz, as % of one core (what logging every frame at 20 Hz costs, also when a loaded
machine starved the logger), next to its share of the wall time ("busy"); and, read back with
``msgs/video.py`` ``LoggedFrames``, how many logged frames differ from what was sent (0 for raw and
FFV1; every frame for h264, by design), the largest pixel difference, and how many were logged without
pixels (ring frames the camera overwrote before the logger read them: the logger fell behind).
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
from benchprefix import own_prefix

from chestnut.launch.assets import traffic_video_path
from chestnut.launch.camerad import iter_frames, ring_frame, synthetic_frames
from chestnut.msgs.frames import fill_frame
from chestnut.msgs.logfile import LogReader
from chestnut.msgs.messaging import PubMaster
from chestnut.msgs.video import LoggedFrames
from chestnut.msgs.visionipc import INLINE_MAX_BYTES, FrameRing

RATE_HZ = 20.0
MB = 1e6
CASES = {
    "default": "128x256 BGR, traffic video",
    "traffic": "704x576 BGR, traffic video",
    "nv12": "1928x1208 NV12, synthetic",
}
MODES = {
    "raw": ["--frames", "raw"],
    "ffv1": ["--frames", "video", "--video-codec", "ffv1"],
    "h264": ["--frames", "video", "--video-codec", "h264", "--crf", "23"],
}


def case_frames(case: str) -> tuple[list[np.ndarray], str]:
    """A cycle of frames for ``case`` (as ``iter_frames`` gives them) and their encoding."""
    if case == "nv12":
        g = synthetic_frames(1208, 1928, "nv12")
        return [next(g) for _ in range(64)], "nv12"  # the pattern repeats after 64 frames
    size = (128, 256) if case == "default" else (None, None)
    return list(iter_frames(traffic_video_path(), *size, loop=False)), "bgr888"


def cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (``proc(5)``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_one(case: str, mode: str, seconds: float, work: Path, prefix: str) -> dict[str, float]:
    frames, encoding = case_frames(case)
    log_dir = work / f"{case}-{mode}"
    env = {**os.environ, "CHESTNUT_PREFIX": prefix}
    os.environ["CHESTNUT_PREFIX"] = env["CHESTNUT_PREFIX"]
    err = open(work / f"{case}-{mode}.stderr", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "chestnut.launch.cli",
            "record",
            "--log-dir",
            str(log_dir),
            "--services",
            "cameraFrame",
            *MODES[mode],
        ],
        stdout=subprocess.DEVNULL,
        stderr=err,
        env=env,
    )
    err.close()
    ring = FrameRing(frames[0].nbytes) if frames[0].nbytes > INLINE_MAX_BYTES else None
    sent = 0
    try:
        with PubMaster(["cameraFrame"]) as pm:
            time.sleep(2.0)  # the logger is up and connected (a PUB drops until then)
            cpu0, t0 = cpu_s(proc.pid), time.monotonic()
            period = 1 / RATE_HZ
            while sent < seconds * RATE_HZ:
                img = frames[sent % len(frames)]
                if ring is None:
                    msg = fill_frame(sent, img, time.monotonic_ns(), time.monotonic_ns(), "bench", encoding)
                else:
                    msg = ring_frame(ring, sent, img, time.monotonic_ns(), "bench", encoding)
                pm.send("cameraFrame", msg)
                sent += 1
                time.sleep(max(0.0, t0 + sent * period - time.monotonic()))
            time.sleep(0.5)  # the last frames are read off the ring before the stop
            cpu = cpu_s(proc.pid) - cpu0
            wall = time.monotonic() - t0
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if ring is not None:
            ring.close()
    files = [p for p in log_dir.rglob("*") if p.is_file()]
    video_bytes = sum(p.stat().st_size for p in files if p.suffix == ".mkv")
    log_bytes = sum(p.stat().st_size for p in files if p.suffix != ".mkv")
    logged = differ = unread = 0
    max_diff = 0
    readers: dict[Path, LoggedFrames] = {}
    for _, service, _, ev, path in LogReader(log_dir).iter_from():
        if service != "cameraFrame":
            continue
        cf = ev.cameraFrame
        lf = readers.setdefault(path.parent, LoggedFrames(path.parent))
        logged += 1
        try:
            got = lf.read(cf).reshape(-1)
        except ValueError:  # a ring frame the camera overwrote before the logger read it: no pixels
            unread += 1
            continue
        want = frames[int(cf.frameId) % len(frames)].reshape(-1)
        if not np.array_equal(got, want):
            differ += 1
            max_diff = max(max_diff, int(np.abs(got.astype(np.int16) - want.astype(np.int16)).max()))
    for lf in readers.values():
        lf.close()
    kept = max(1, logged - unread)  # frames logged with their pixels
    per_min = 60 * RATE_HZ / kept  # bytes of the kept frames -> bytes of one minute (1200 frames)
    return {
        "sent": sent,
        "logged": logged,
        "logs_mb_min": log_bytes * per_min / MB,
        "video_mb_min": video_bytes * per_min / MB,
        "cpu_pct": 100 * cpu * RATE_HZ / kept,
        "busy_pct": 100 * cpu / wall,
        "differ": differ,
        "max_diff": max_diff,
        "unread": unread,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of frames per run (default 10)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--keep", type=Path, default=None, help="keep the logs under this directory")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-video-")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True, mode=0o700)
    print(f"chestnut record at {RATE_HZ:g} Hz, {args.seconds:g} s per run; MB = 10^6 bytes; per minute = 1200 frames")
    print(
        f"{'case':32} {'mode':5} {'logged':>9} {'logs MB/min':>12} {'video MB/min':>13} {'total':>8} "
        f"{'CPU %':>6} {'busy':>5} {'differ':>7} {'max |d|':>8} {'no pixels':>9}"
    )
    results = {}
    try:
        with own_prefix(f"bench-video-{os.getpid()}") as prefix:  # its runtime directory goes at the end
            for case in args.cases.split(","):
                for mode in args.modes.split(","):
                    r = run_one(case, mode, args.seconds, work, prefix)
                    results[(case, mode)] = r
                    total = r["logs_mb_min"] + r["video_mb_min"]
                    print(
                        f"{CASES[case]:32} {mode:5} {r['logged']:>4}/{r['sent']:<4} {r['logs_mb_min']:12.1f} "
                        f"{r['video_mb_min']:13.1f} {total:8.1f} {r['cpu_pct']:6.1f} {r['busy_pct']:5.1f} "
                        f"{r['differ']:>7} {r['max_diff']:>8} {r['unread']:>9}",
                        flush=True,
                    )
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    if ("default", "raw") in results and ("default", "ffv1") in results:
        raw, ffv1 = results[("default", "raw")], results[("default", "ffv1")]
        ratio = (raw["logs_mb_min"] + raw["video_mb_min"]) / (ffv1["logs_mb_min"] + ffv1["video_mb_min"])
        print(f"raw/ffv1 disk per minute at 128x256: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
