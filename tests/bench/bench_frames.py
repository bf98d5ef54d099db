"""Camera frames across processes at 20 Hz: the shared-memory ring vs inline frames vs a raw baseline.

Run: ``.venv/bin/python tests/bench/bench_frames.py [--seconds S] [--rounds R]``

Two processes: this one is the camera, a forked child the subscriber. For each frame size -- 98 KB
(128x256 BGR, today's default), 1.2 MB (704x576 BGR, the traffic video's native size) and 3.5 MB
(1928x1208 NV12, openpilot's road camera; carried as 1812 rows of 1928 one-byte samples, the Y plane
then the interleaved UV plane) -- three transports run one after the other, each for ``--seconds`` at
20 Hz (openpilot's model rate) in all, split into ``--rounds`` turns (shm, inline, raw, shm, inline, raw, ...) so
that a transport and its baseline meet the machine's pace alike: a busy minute no longer falls on one of them
only. Each transport's figures pool its frames of every round:

- **shm**: ``msgs/visionipc.py``: the camera copies the pixels into its ring (``FrameRing.write``,
  seqlock), sends the frame's 56-byte notice into each subscriber's notice pipe (``FrameRing.announce``,
  a ``RingFrame`` record), then a metadata-only ``cameraFrame`` on the bus; the subscriber, polling both
  as the node does, takes whichever comes first (``FrameReader.notices``: one checked record, or
  ``drain_sock``: bounded, validated; ``first_sight`` skips the other) and takes a read-only view of the
  slot after the seqlock check (``FrameReader.view``). The second seqlock check (``verify``) follows the
  stamp.
- **inline**: today's path: ``fill_frame``-style message with the pixels in ``data`` -> ``PubMaster.send``
  -> ``drain_sock`` -> ``frame_to_array`` (the node's read).
- **raw**: the floor of any shared-memory transport: one memcpy of the same bytes into shared memory
  (an anonymous ``MAP_SHARED`` mapping inherited by the child) and an 8-byte wake-up through a pipe;
  the child's view of the mapping is usable once the wake-up is read. A frame the child reads after the
  next one overwrote the region (it woke a frame late, on a busy host) is counted as overwritten, not timed.

The bench runs (re-executing itself once if need be) with the ``GLIBC_TUNABLES`` that ``chestnut launch``
starts its camera with (``msgs/visionipc.py`` ``streaming_copy_tunables``: frames of 1 MiB and more are
copied with streaming stores), every path alike; a value already set in the environment is kept.

Latency (ms) = the subscriber's ``time.monotonic_ns()`` once the frame is usable minus the camera's
stamp taken when it starts publishing the frame (before the copy into the ring / building the
message / the memcpy); CLOCK_MONOTONIC is shared by the processes. CPU is ``getrusage`` (user +
system, every thread, the zmq I/O threads included) of camera and subscriber over the measured
frames, as % of one core; it includes each process's idle loop. The last two lines are
``shm/raw p50 at 98 KB: R`` and ``shm/raw p50 at 3.5 MB: R`` (aims: <= 2 and <= 1.3; shm <= 5 % of a core
at 20 Hz).
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import resource
import select
import struct
import sys
import time
from typing import Any

import numpy as np
import zmq
from benchprefix import own_prefix

from chestnut.msgs.frames import frame_to_array
from chestnut.msgs.messaging import PubMaster, drain_sock, new_message, sub_sock
from chestnut.msgs.visionipc import FrameReader, FrameRing, streaming_copy_tunables

RATE_HZ = 20.0  # openpilot's model rate (common/realtime.py DT_MDL = 0.05 s)
SIZES = (  # label, rows, columns, bytes per sample, encoding
    ("98 KB", 128, 256, 3, "bgr888"),
    ("1.2 MB", 576, 704, 3, "bgr888"),
    ("3.5 MB", 1812, 1928, 1, "gray8"),  # 1928x1208 NV12: 1208 Y rows + 604 UV rows
)
PATHS = ("shm", "inline", "raw")
WARM_ID = 1 << 30  # frame ids of warm-up frames (connection set-up, first mapping): not measured
READY_TIMEOUT_S = 10.0
WAKE = struct.Struct("<QQ")  # raw path: stamp (ns), frame id
MAX_BYTES = max(r * c * b for _, r, c, b, _ in SIZES)


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _frame_msg(frame_id: int, rows: int, cols: int, encoding: str, stamp: int, data: bytes | None) -> Any:
    msg = new_message("cameraFrame")
    msg.logMonoTime = stamp
    cf = msg.cameraFrame
    cf.frameId = frame_id
    cf.timestampSof = cf.timestampEof = stamp
    cf.height, cf.width = rows, cols
    cf.encoding = encoding
    cf.sourceName = "bench"
    if data is not None:
        cf.data = data
    return msg


# ---------------------------------------------------------------- the subscriber (child)


def _child(cmds: Any, ready: Any, raw_map: mmap.mmap, wake_r: int, prefix: str) -> None:
    raw_view = np.frombuffer(raw_map, np.uint8)
    while True:
        cmd = cmds.recv()
        if cmd is None:
            return
        path, n, nbytes = cmd
        lat: list[float] = []
        overwritten = 0
        cpu0 = 0.0
        if path == "raw":
            ready.set()
            while len(lat) + overwritten < n:
                if not select.select([wake_r], [], [], 5.0)[0]:
                    break
                stamp, fid = WAKE.unpack(os.read(wake_r, WAKE.size))
                frame = raw_view[:nbytes]  # usable: the bytes are in place
                now = time.monotonic_ns()
                if fid >= WARM_ID:
                    continue
                if not lat and not overwritten:
                    cpu0 = _cpu_s()
                if frame[0] != fid & 0xFF:  # woken a frame late (a busy host): the one region holds the next one
                    overwritten += 1
                    continue
                lat.append((now - stamp) / 1e6)
        else:
            sock = sub_sock("cameraFrame", prefix=prefix)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            reader = FrameReader(prefix, poller=poller)  # the node's intake: notices on the ring's socket, and the bus
            while len(lat) < n:
                woke = dict(poller.poll(5000))
                if not woke:
                    break
                # as the node: the bus is not asked when a notice alone woke the poll
                bus = [] if reader.only_notices(woke) else drain_sock(sock)
                for cf in [ev.cameraFrame for ev in bus] + reader.notices():
                    if not reader.first_sight(cf):
                        continue
                    img = reader.view(cf) if path == "shm" else frame_to_array(cf)
                    now = time.monotonic_ns()
                    try:
                        reader.verify(cf)
                    except ValueError:
                        overwritten += 1
                    fid = int(cf.frameId)
                    if fid >= WARM_ID:
                        ready.set()
                        continue
                    if not lat:
                        cpu0 = _cpu_s()
                    lat.append((now - int(cf.timestampSof)) / 1e6)  # the camera's stamp
                    assert img.reshape(-1)[0] == fid & 0xFF
                    del img
            reader.close()
            sock.close(linger=0)
        cmds.send((lat, _cpu_s() - cpu0, overwritten))


# ---------------------------------------------------------------- the camera (this process)


def run_case(
    path: str,
    size: tuple[str, int, int, int, str],
    n: int,
    cmds: Any,
    ready: Any,
    raw_map: mmap.mmap,
    wake_w: int,
    prefix: str,
) -> dict[str, float]:
    """Publish ``n`` frames of ``size`` at 20 Hz on ``path``; returns the latencies (ms, ``lat``), the frames
    overwritten before they were read and the CPU seconds of camera and subscriber (:func:`figures` sums rounds)."""
    _label, rows, cols, bps, encoding = size
    nbytes = rows * cols * bps
    rng = np.random.default_rng(0)
    pixels = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(2)]
    raw_view = np.frombuffer(raw_map, np.uint8)
    ready.clear()
    ring = FrameRing(nbytes, prefix=prefix) if path == "shm" else None
    pm = PubMaster(["cameraFrame"], prefix=prefix) if path != "raw" else None
    cmds.send((path, n, nbytes))

    def publish(fid: int) -> None:
        src = pixels[fid % 2]
        src[0] = fid & 0xFF  # the subscriber checks the first byte: the frame it reads is this one
        stamp = time.monotonic_ns()
        if path == "raw":
            raw_view[:nbytes] = src
            os.write(wake_w, WAKE.pack(stamp, fid))
            return
        assert pm is not None
        if ring is not None:  # as chestnut camera: the pixels, the notice, then the metadata on the bus
            index, seq = ring.write(src)
            ring.announce(fid, stamp, stamp, cols, rows, encoding, index, seq, nbytes)
            msg = _frame_msg(fid, rows, cols, encoding, stamp, None)
            ring.fill(msg.cameraFrame, index, seq, nbytes)
        else:
            msg = _frame_msg(fid, rows, cols, encoding, stamp, src.tobytes())
        pm.send("cameraFrame", msg)

    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        k = 0
        while not ready.is_set():  # the SUB connection is up (a PUB drops what it sends before)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{path}: the subscriber did not connect")
            if path != "raw":
                publish(WARM_ID + k)
                k += 1
            time.sleep(0.05)
        time.sleep(0.2)
        period = 1.0 / RATE_HZ
        t0 = time.monotonic()
        cpu0 = _cpu_s()
        for i in range(n):
            wait = t0 + i * period - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            publish(i)
        cpu_pub = _cpu_s() - cpu0
        if not cmds.poll(10.0):
            raise RuntimeError(f"{path}: the subscriber sent no results")
        lat, cpu_sub, overwritten = cmds.recv()
    finally:
        if pm is not None:
            pm.close()
        if ring is not None:
            ring.close()
    if len(lat) + (overwritten if path == "raw" else 0) < n:
        raise RuntimeError(f"{path}: {len(lat)} of {n} frames arrived")
    return {"lat": lat, "overwritten": overwritten, "cpu_pub_s": cpu_pub, "cpu_sub_s": cpu_sub,
            "window_s": (n - 1) / RATE_HZ}


def figures(rounds: list[dict[str, Any]], path: str) -> dict[str, float]:
    """One transport's rounds pooled: p50/p99 latency (ms) over every frame, CPU as % of a core over the rounds'
    measured windows, frames overwritten."""
    lat = [x for r in rounds for x in r["lat"]]
    if not lat:
        raise RuntimeError(f"{path}: every frame was overwritten before it was read (a busy host)")
    window = sum(r["window_s"] for r in rounds)
    p50, p99 = np.percentile(lat, [50, 99])
    return {
        "p50": float(p50),
        "p99": float(p99),
        "cpu_pub": 100 * sum(r["cpu_pub_s"] for r in rounds) / window,
        "cpu_sub": 100 * sum(r["cpu_sub_s"] for r in rounds) / window,
        "overwritten": sum(r["overwritten"] for r in rounds),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="s per transport and size at 20 Hz (default 5)")
    parser.add_argument("--rounds", type=int, default=5, help="turns the seconds are split into (default 5)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: want 1 or more")
    tunables = streaming_copy_tunables(os.environ.get("GLIBC_TUNABLES"))
    if argv is None and os.environ.get("GLIBC_TUNABLES") != tunables:  # glibc reads it at start only
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], dict(os.environ, GLIBC_TUNABLES=tunables))
    n = max(2, int(args.seconds * RATE_HZ / args.rounds))
    with own_prefix(f"bench-frames-{os.getpid()}") as prefix:  # its runtime directory goes at the end (benchprefix.py)
        return measure(n, prefix, args.rounds)


def measure(n: int, prefix: str, rounds: int = 1) -> int:
    """Every frame size through every path, ``rounds`` turns of ``n`` frames each at :data:`RATE_HZ`, on ``prefix``;
    prints the table and the ratios."""
    raw_map = mmap.mmap(-1, MAX_BYTES, mmap.MAP_SHARED)
    wake_r, wake_w = os.pipe()
    ctx = mp.get_context("fork")  # before any zmq context or thread exists in this process
    cmds, child_cmds = ctx.Pipe()
    ready = ctx.Event()
    child = ctx.Process(target=_child, args=(child_cmds, ready, raw_map, wake_r, prefix), daemon=True)
    child.start()
    print(
        f"camera frames across processes at {RATE_HZ:.0f} Hz, {rounds} rounds of {n} frames each, "
        f"{os.cpu_count()} CPUs, pyzmq {zmq.__version__}, GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')}"
    )
    print(
        f"{'frame':<8} {'path':<7} {'p50 ms':>8} {'p99 ms':>8} {'CPU % camera':>13} {'CPU % sub':>10} "
        f"{'CPU % total':>12}"
    )
    p50: dict[tuple[str, str], float] = {}
    try:
        for size in SIZES:
            done: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
            for _ in range(rounds):
                for path in PATHS:
                    done[path].append(run_case(path, size, n, cmds, ready, raw_map, wake_w, prefix))
            for path in PATHS:
                f = figures(done[path], path)
                p50[(size[0], path)] = f["p50"]
                note = f"  ({f['overwritten']} overwritten)" if f["overwritten"] else ""
                print(
                    f"{size[0]:<8} {path:<7} {f['p50']:>8.3f} {f['p99']:>8.3f} {f['cpu_pub']:>13.1f} "
                    f"{f['cpu_sub']:>10.1f} {f['cpu_pub'] + f['cpu_sub']:>12.1f}{note}",
                    flush=True,
                )
    finally:
        cmds.send(None)
        child.join(5.0)
        if child.is_alive():
            child.terminate()
    for label, _r, _c, _b, _e in SIZES:
        print(
            f"{label}: shm/raw p50 {p50[(label, 'shm')] / p50[(label, 'raw')]:.2f}, "
            f"inline/raw p50 {p50[(label, 'inline')] / p50[(label, 'raw')]:.2f}"
        )
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(f"shm/raw p50 at 98 KB: {p50[('98 KB', 'shm')] / p50[('98 KB', 'raw')]:.2f}")
    print(f"shm/raw p50 at 3.5 MB: {p50[('3.5 MB', 'shm')] / p50[('3.5 MB', 'raw')]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
