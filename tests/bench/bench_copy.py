"""The copy protocol on the twin: throughput against the transport's raw bulk rate, wire overhead, transfer counts.

Run: ``.venv/bin/python tests/bench/bench_copy.py [--sizes-mib 1 4 16] [--reps 5] [--link-mbps 5000 --latency-us 125]``

Everything is measured in the same run, over the same ``TwinUSB3`` + :class:`Bridge` objects, against
one ``chestnut twin serve`` daemon:

- raw: the same bytes moved with the least the bridge needs -- one 0xF2 arm + one 256 KiB bulk
  transfer per SRAM half, no sentinel, no packets, no waits (OUT: bulk write; IN: bulk read);
- copy-in / copy-out: :class:`CopyProtocol` (chunks, sentinel blocks, OP_COPYIN/OP_COPYOUT packets,
  doorbells, bounded fence waits, the copy-in fence check at the end).

Per size it prints the median MB/s of each, the protocol efficiency (copy / raw, aim >= 0.9 at
>= 1 MiB), the wire-byte overhead (bulk bytes, and bulk + control bytes incl. 8-byte setup packets,
over the payload; aim <= 1 % at >= 1 MiB), and the bulk transfers per logical copy: data transfers
(must equal the chunk count) and command transfers (the one streaming ring write per copy-in).
``--link-mbps``/``--latency-us`` switch on the twin's timing model (dock-like per-transfer latency).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from chestnut.backend import protocol as P
from chestnut.backend.bridge import Bridge
from chestnut.backend.copy import CommandQueue, CopyProtocol
from chestnut.backend.sim.client import TwinDaemon
from chestnut.backend.sim.usb3 import TwinUSB3

MIB = 1 << 20


def counters(b: Bridge) -> tuple[int, int, int, int, int, int]:
    return (b.bulk_out_transfers, b.bulk_in_transfers, b.bulk_out_bytes, b.bulk_in_bytes,
            b.control_out_bytes + b.control_in_bytes, b.control_transfers)


def raw_out(b: Bridge, data: memoryview) -> None:
    for off in range(0, len(data), P.SRAM_HALF):
        n = min(P.SRAM_HALF, len(data) - off)
        wire = -(-n // P.SECTOR) * P.SECTOR
        half = (off // P.SRAM_HALF) & 1
        b.sram_arm_write(half * P.SLOTS_PER_HALF, wire)
        b.bulk_out(data[off:off + wire])


def raw_in(b: Bridge, nbytes: int) -> None:
    for off in range(0, nbytes, P.SRAM_HALF):
        n = min(P.SRAM_HALF, nbytes - off)
        half = (off // P.SRAM_HALF) & 1
        b.sram_arm_read(half * P.SLOTS_PER_HALF, -(-n // P.SECTOR) * P.SECTOR)
        b.bulk_in(-(-n // P.SECTOR) * P.SECTOR)


def timed(reps: int, fn, *args) -> float:
    """Median seconds of ``fn(*args)`` over ``reps`` calls."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--link-mbps", type=float, help="twin timing model: link bandwidth")
    ap.add_argument("--latency-us", type=float, default=0.0, help="twin timing model: per-transfer latency")
    args = ap.parse_args()
    os.environ.setdefault("CHESTNUT_PREFIX", f"bench-copy-{os.getpid()}")
    serve = ["--training-delay-ms", "1"]
    if args.link_mbps is not None:
        serve += ["--link-mbps", str(args.link_mbps)]
    if args.latency_us:
        serve += ["--latency-us", str(args.latency_us)]

    with TwinDaemon(args=serve):
        (dev, _), = TwinUSB3.list_devices(*P.USB_IDS[0])
        bridge = Bridge(TwinUSB3(dev))
        bridge.ensure_link()
        bridge.setup_bars()
        queue = CommandQueue(bridge)
        queue.attach()
        copy = CopyProtocol(bridge, queue)
        copy.attach()
        dst = P.VRAM_HEAP_OFFSET
        print(f"{'size':>8} | {'raw OUT':>8} {'copy-in':>8} {'eff':>5} | {'raw IN':>8} {'copy-out':>8} {'eff':>5} | "
              f"{'in: bulk ovh':>12} {'all ovh':>8} {'chunks':>6} {'data bulk':>9} {'cmd bulk':>8} | "
              f"{'out: all ovh':>12} {'chunks':>6} {'data bulk':>9}")
        for mib in args.sizes_mib:
            size = int(mib * MIB)
            data = memoryview(os.urandom(size))
            copy.copy_in(dst, data)  # warm-up, and the data copy-out reads back
            assert copy.copy_out(dst, size) == data.tobytes()

            t_raw_out = timed(args.reps, raw_out, bridge, data)
            t_raw_in = timed(args.reps, raw_in, bridge, size)
            t_in = timed(args.reps, copy.copy_in, dst, data)
            t_out = timed(args.reps, copy.copy_out, dst, size)

            c0, d0 = counters(bridge), copy.data_bulk_out
            chunks_in = copy.copy_in(dst, data)
            c1, d1 = counters(bridge), copy.data_bulk_out
            in_bulk_bytes = c1[2] - c0[2]
            in_all = in_bulk_bytes + (c1[4] - c0[4])
            data_bulk_in_copy = d1 - d0
            cmd_bulk = (c1[0] - c0[0]) - data_bulk_in_copy
            e0, o0 = counters(bridge), copy.data_bulk_in
            copy.copy_out(dst, size)
            e1, o1 = counters(bridge), copy.data_bulk_in
            out_all = (e1[3] - e0[3]) + (e1[2] - e0[2]) + (e1[4] - e0[4])
            chunks_out = CopyProtocol.chunk_count(size, copy_in=False)
            assert data_bulk_in_copy == chunks_in and o1 - o0 == chunks_out, "one data bulk transfer per chunk"

            mbs = [size / t / 1e6 for t in (t_raw_out, t_in, t_raw_in, t_out)]
            print(f"{mib:>6g}Mi | {mbs[0]:>8.0f} {mbs[1]:>8.0f} {mbs[1] / mbs[0]:>5.2f} | {mbs[2]:>8.0f} "
                  f"{mbs[3]:>8.0f} {mbs[3] / mbs[2]:>5.2f} | {100 * (in_bulk_bytes / size - 1):>11.3f}% "
                  f"{100 * (in_all / size - 1):>7.3f}% {chunks_in:>6} {data_bulk_in_copy:>9} {cmd_bulk:>8} | "
                  f"{100 * (out_all / size - 1):>11.3f}% {chunks_out:>6} {o1 - o0:>9}")
        bridge.usb.close()
    print("MB/s are medians; eff = copy / raw on the same transport in the same run; ovh = wire bytes / payload - 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
