"""The twin's transport: control-transfer round trip and 256 KiB bulk throughput, against a raw baseline.

Run: ``.venv/bin/python tests/bench/bench_twin.py [--n N] [--link-mbps 5000 --latency-us 125]``

Three measurements in the same run, on the same machine load:

- baseline: a bare Unix-socket request/response between two processes with the same header sizes
  (24-byte request, 12-byte response; bulk: 256 KiB payload one way) -- the floor any daemon pays;
- in-process: the same requests straight on a :class:`Twin` (no socket) -- the twin's own cost;
- daemon: :class:`TwinClient` -> ``chestnut twin serve`` (one 0xE4 1-byte XDATA read per control round
  trip; 0xF2 + bulk OUT / bulk IN of 256 KiB for throughput).

Prints p50/p99 (us) and MB/s, and the ratios daemon / baseline. Aims: <= 100 us p50 control round trip,
>= 200 MB/s bulk. With ``--link-mbps``/``--latency-us`` the daemon runs the timing model, and the
printout shows the resulting, dock-like latencies instead (the aims do not apply then).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from multiprocessing import Process

from benchprefix import own_prefix

from chestnut.backend import protocol as P
from chestnut.backend.sim import wire as W
from chestnut.backend.sim.client import TwinDaemon
from chestnut.backend.sim.twin import Twin

BULK = 256 << 10
SECTORS = BULK // 512
NSLOTS = BULK // P.SRAM_SLOT


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _echo_server(path: str) -> None:
    """Baseline peer: read a 24-byte header (+ payload), answer a 12-byte header (+ payload if asked)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    conn, _ = srv.accept()
    hdr, buf = bytearray(W.REQ.size), bytearray(BULK)
    hmv, bmv = memoryview(hdr), memoryview(buf)
    out = bytes(BULK)
    while True:
        got = 0
        while got < len(hmv):
            try:
                k = conn.recv_into(hmv[got:])
            except OSError:
                return
            if not k:
                return
            got += k
        plen, op, *_rest, length, _t = W.REQ.unpack(hdr)
        got = 0
        while got < plen:
            got += conn.recv_into(bmv[got:plen])
        if length:
            conn.sendmsg([W.RSP.pack(length, 0, 0), out[:length]])
        else:
            conn.sendall(W.RSP.pack(0, 0, 0))


def _recv_exact(s: socket.socket, mv: memoryview) -> None:
    got = 0
    while got < len(mv):
        got += s.recv_into(mv[got:])


def baseline(n: int, nbulk: int) -> dict[str, float]:
    path = os.path.join(tempfile.mkdtemp(), "echo.sock")
    p = Process(target=_echo_server, args=(path,), daemon=True)
    p.start()
    while not os.path.exists(path):
        time.sleep(0.01)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    rsp = memoryview(bytearray(W.RSP.size + BULK))
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        s.sendall(W.REQ.pack(0, W.OP_CTRL, 0, 0xC0, 0xE4, 0xB450, 0, 1, 1, 1000))
        _recv_exact(s, rsp[:W.RSP.size + 1])  # header + the one XDATA byte
        lat.append(time.perf_counter() - t0)
    payload = bytes(BULK)
    t0 = time.perf_counter()
    for _ in range(nbulk):
        s.sendmsg([W.REQ.pack(BULK, W.OP_BULK_OUT, 0, 2, 0, 0, 0, 1, 0, 1000), payload])
        _recv_exact(s, rsp[:W.RSP.size])
    out_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(nbulk):
        s.sendall(W.REQ.pack(0, W.OP_BULK_IN, 0, 0x81, 0, 0, 0, 1, BULK, 1000))
        _recv_exact(s, rsp[:W.RSP.size + BULK])
    in_s = time.perf_counter() - t0
    s.close()
    p.join(2)
    return {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "out": nbulk * BULK / out_s, "in": nbulk * BULK / in_s}


def measure(client, h, n: int, nbulk: int) -> dict[str, float]:
    """``client`` is a TwinClient or a Twin (same method names for these calls)."""
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.ctrl_transfer(h, 0xC0, P.REQ_XDATA_READ, P.XDATA_LTSSM, 0, 1, 1000)
        lat.append(time.perf_counter() - t0)
    payload = bytes(BULK)
    t0 = time.perf_counter()
    for _ in range(nbulk):
        client.ctrl_transfer(h, 0x40, P.REQ_SRAM, SECTORS, NSLOTS << 8, b"", 1000)
        client.bulk_write(h, P.EP_BULK_OUT, payload, 1000)
    out_s = time.perf_counter() - t0
    buf = memoryview(bytearray(BULK))
    t0 = time.perf_counter()
    for _ in range(nbulk):
        client.ctrl_transfer(h, 0x40, P.REQ_SRAM, SECTORS | 0x8000, NSLOTS << 8, b"", 1000)
        if hasattr(client, "bulk_read_into"):
            client.bulk_read_into(h, P.EP_BULK_IN, buf, 1000)
        else:
            client.bulk_read(h, P.EP_BULK_IN, BULK, 1000)
    in_s = time.perf_counter() - t0
    return {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "out": nbulk * BULK / out_s, "in": nbulk * BULK / in_s,
            "mean": statistics.fmean(lat)}


def show(name: str, r: dict[str, float]) -> None:
    print(f"{name:<11} control p50 {r['p50'] * 1e6:8.1f} us  p99 {r['p99'] * 1e6:8.1f} us   "
          f"bulk OUT {r['out'] / 1e6:7.0f} MB/s  bulk IN {r['in'] / 1e6:7.0f} MB/s  (256 KiB)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000, help="control round trips")
    ap.add_argument("--bulk", type=int, default=200, help="256 KiB transfers each way")
    ap.add_argument("--link-mbps", type=float, help="daemon timing model: link bandwidth")
    ap.add_argument("--latency-us", type=float, default=0.0, help="daemon timing model: per-transfer latency")
    args = ap.parse_args()
    # the daemon's prefix: $CHESTNUT_PREFIX as given, else one of its own whose runtime directory goes at the end
    with own_prefix(f"bench-twin-{os.getpid()}", env=True):
        return run(args)


def run(args: argparse.Namespace) -> int:
    """The bench itself, with ``args`` from :func:`main`, the daemon served on ``$CHESTNUT_PREFIX``; prints the
    figures."""
    timing = args.link_mbps is not None or args.latency_us > 0

    base = baseline(args.n, args.bulk)
    twin = Twin()
    dev = twin.enumerate()[0]
    local = measure(twin, twin.open(dev.bus, dev.address), args.n, args.bulk)
    twin.close()
    serve_args = ["--training-delay-ms", "1"]
    if args.link_mbps is not None:
        serve_args += ["--link-mbps", str(args.link_mbps)]
    if args.latency_us:
        serve_args += ["--latency-us", str(args.latency_us)]
    with TwinDaemon(args=serve_args) as daemon, daemon.client() as c:
        d = c.enumerate()[0]
        h = c.open(d.bus, d.address)
        measure(c, h, 200, 5)  # warm-up
        remote = measure(c, h, args.n, args.bulk)

    show("baseline", base)
    show("in-process", local)
    show("daemon", remote)
    print(f"ratio daemon/baseline: control p50 {remote['p50'] / base['p50']:.2f}x, bulk OUT "
          f"{remote['out'] / base['out']:.2f}x, bulk IN {remote['in'] / base['in']:.2f}x")
    if timing:
        lat_s = args.latency_us * 1e-6
        wire_s = BULK * 8 / (args.link_mbps * 1e6) if args.link_mbps else 0.0
        want_ctrl = lat_s + (8 / (args.link_mbps * 1e6) if args.link_mbps else 0.0)
        want_bulk = BULK / (2 * lat_s + wire_s)  # each 256 KiB transfer also pays its 0xF2 arm's latency
        print(f"timing model {args.link_mbps or 'inf'} Mbps + {args.latency_us} us: control p50 "
              f"{remote['p50'] * 1e6:.0f} us (model {want_ctrl * 1e6:.0f}), bulk "
              f"{min(remote['out'], remote['in']) / 1e6:.0f} MB/s (model {want_bulk / 1e6:.0f})")
        return 0
    ok = remote["p50"] <= 100e-6 and min(remote["out"], remote["in"]) >= 200e6
    print(f"aims (<= 100 us p50, >= 200 MB/s): {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
