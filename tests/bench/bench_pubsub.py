"""Pub/sub latency across processes: chestnut messaging vs raw pyzmq with the same payload size.

Run: ``.venv/bin/python tests/bench/bench_pubsub.py [--small N] [--frames N]``

Two processes: this one publishes, a spawned child subscribes. Each round sends one chestnut
message and one raw pyzmq message of the same byte length, alternating, paced (1 ms / 4 ms) so that
nothing queues and both see the same machine load. Latency (us) = receive-side
``time.monotonic_ns()`` once the message is usable minus the send-side stamp taken just before the
send call (CLOCK_MONOTONIC is shared by processes); the payload is ready before the stamp on both
sides, as with "the same payload bytes":

- chestnut: ``logMonoTime`` stamped on a built ``Event`` -> ``PubMaster.send`` (service check,
  ``to_bytes``, send) -> ``recv_one_or_none`` (``log_from_bytes``: bounded read, validation of every
  pointer and enum, service check).
- raw: stamp 8 bytes into a preallocated buffer -> ``socket.send`` -> ``socket.recv`` + unpack.

The time to build the chestnut message (``new_message`` + filling it) is printed apart (p50).
Payloads: a small ``chestnutActive`` message, and a ``cameraFrame`` of 128x256x3 bytes (bgr888).
Prints p50/p99 for both and the ratio chestnut / raw; the last line is
``chestnut/raw p50: small X, frame Y`` (aims: X <= 1.05, Y <= 1.10).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import struct
import sys
import time

import numpy as np
import zmq
from benchprefix import own_prefix

from chestnut.msgs.messaging import PubMaster, new_message, recv_one_or_none, sub_sock
from chestnut.msgs.paths import runtime_dir

FRAME_SHAPE = (128, 256, 3)  # H, W, C (bgr888)
READY_TIMEOUT_S = 10.0
STAMP = struct.Struct("<Q")


def _small_msg() -> object:
    msg = new_message("chestnutActive")
    a = msg.chestnutActive
    a.active = True
    a.source = "primary"
    a.reason = "all layers OK"
    a.since = msg.logMonoTime
    return msg


def _frame_msg(frame_id: int, pixels: bytes) -> object:
    msg = new_message("cameraFrame")
    f = msg.cameraFrame
    f.frameId = frame_id
    f.timestampSof = f.timestampEof = msg.logMonoTime
    f.height, f.width = FRAME_SHAPE[:2]
    f.encoding = "bgr888"
    f.data = pixels
    return msg


def _subscriber(service: str, prefix: str, raw_addr: str, n: int, ready, conn) -> None:  # type: ignore[no-untyped-def]
    """Child: receive ``n`` messages on each socket, send back (ours_us, raw_us) latency lists."""
    ours = sub_sock(service, prefix=prefix)
    raw = zmq.Context.instance().socket(zmq.SUB)
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(raw_addr)
    poller = zmq.Poller()
    poller.register(ours, zmq.POLLIN)
    poller.register(raw, zmq.POLLIN)
    got_ours = got_raw = False
    while not (got_ours and got_raw):  # warm-up until both connections carry messages
        poller.poll(100)
        got_ours |= recv_one_or_none(ours) is not None
        try:
            raw.recv(zmq.NOBLOCK)
            got_raw = True
        except zmq.Again:
            pass
    ready.set()
    while recv_one_or_none(ours) is not None:
        pass
    lat_ours: list[float] = []
    lat_raw: list[float] = []
    while len(lat_ours) < n or len(lat_raw) < n:
        if not poller.poll(2000):
            break
        while (event := recv_one_or_none(ours)) is not None:
            lat_ours.append((time.monotonic_ns() - event.logMonoTime) / 1e3)
        while True:
            try:
                data = raw.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            lat_raw.append((time.monotonic_ns() - STAMP.unpack_from(data)[0]) / 1e3)
    conn.send((lat_ours[:n], lat_raw[:n], sum(ours.malformed.values())))
    ours.close()
    raw.close()


def run_case(kind: str, n: int, pace_s: float, prefix: str) -> dict[str, float]:
    """Measure ``n`` alternating rounds of ``kind`` ("small" or "frame") on ``prefix``; returns the figures (us)."""
    service = "chestnutActive" if kind == "small" else "cameraFrame"
    raw_addr = f"ipc://{runtime_dir(prefix)}/raw-{kind}"
    pixels = np.random.default_rng(0).integers(0, 256, FRAME_SHAPE, dtype=np.uint8).tobytes()

    def build(i: int) -> bytes:
        return (_small_msg() if kind == "small" else _frame_msg(i, pixels)).to_bytes()  # type: ignore[attr-defined]

    size = len(build(0))
    raw_buf = bytearray(np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes())
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_subscriber, args=(service, prefix, raw_addr, n, ready, child_conn), daemon=True)
    pm = PubMaster([service], prefix=prefix)
    raw = zmq.Context.instance().socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind(raw_addr)
    child.start()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        i = 0
        while not ready.is_set():
            if time.monotonic() > deadline:
                raise RuntimeError("subscriber did not connect")
            pm.send(service, build(i))
            STAMP.pack_into(raw_buf, 0, time.monotonic_ns())
            raw.send(raw_buf)
            time.sleep(0.01)
        time.sleep(0.05)
        build_us: list[float] = []
        for i in range(n):
            t0 = time.perf_counter_ns()
            msg = _small_msg() if kind == "small" else _frame_msg(i, pixels)
            build_us.append((time.perf_counter_ns() - t0) / 1e3)
            msg.logMonoTime = time.monotonic_ns()  # type: ignore[attr-defined]
            pm.send(service, msg)
            time.sleep(pace_s)
            STAMP.pack_into(raw_buf, 0, time.monotonic_ns())
            raw.send(raw_buf)
            time.sleep(pace_s)
        if not parent_conn.poll(10.0):
            raise RuntimeError("subscriber sent no results")
        lat_ours, lat_raw, malformed = parent_conn.recv()
    finally:
        child.join(5.0)
        if child.is_alive():
            child.terminate()
            child.join(2.0)
        pm.close()
        raw.close()
    if len(lat_ours) < n or len(lat_raw) < n or malformed:
        raise RuntimeError(f"lost messages: {len(lat_ours)}/{n} ours, {len(lat_raw)}/{n} raw, {malformed} malformed")
    o, r = np.percentile(lat_ours, [50, 99]), np.percentile(lat_raw, [50, 99])
    return {
        "bytes": size, "ours_p50": o[0], "ours_p99": o[1], "raw_p50": r[0], "raw_p99": r[1],
        "build_p50": float(np.percentile(build_us, 50)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=2000, help="rounds with the small message")
    parser.add_argument("--frames", type=int, default=1000, help="rounds with the 128x256x3 frame")
    args = parser.parse_args(argv)
    print(f"pub/sub latency across processes, ipc://, {os.cpu_count()} CPUs, pyzmq {zmq.__version__}")
    print(
        f"{'payload':<26} {'bytes':>7} {'chestnut p50/p99 us':>20} {'raw pyzmq p50/p99 us':>21} "
        f"{'ratio p50/p99':>14} {'build p50 us':>13}"
    )
    ratio: dict[str, float] = {}
    with own_prefix(f"bench-{os.getpid()}") as prefix:  # its runtime directory goes at the end (benchprefix.py)
        for kind, n, pace_s, label in (
            ("small", args.small, 0.001, "small (chestnutActive)"),
            ("frame", args.frames, 0.004, "frame 128x256x3"),
        ):
            f = run_case(kind, n, pace_s, prefix)
            ratio[kind] = f["ours_p50"] / f["raw_p50"]
            print(
                f"{label:<26} {f['bytes']:>7} {f['ours_p50']:>9.1f} /{f['ours_p99']:>8.1f} "
                f"{f['raw_p50']:>10.1f} /{f['raw_p99']:>8.1f} "
                f"{f['ours_p50'] / f['raw_p50']:>7.2f}x /{f['ours_p99'] / f['raw_p99']:>5.2f}x "
                f"{f['build_p50']:>13.1f}",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(f"chestnut/raw p50: small {ratio['small']:.2f}, frame {ratio['frame']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
