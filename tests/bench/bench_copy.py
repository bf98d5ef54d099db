"""tinygrad 0.14's own copy path on the twin: MB/s against the transport's raw bulk rate, same run, same daemon.

Run: ``.venv/bin/python tests/bench/bench_copy.py [--sizes-mb 1.048576 4.194304 16.777216 3.2 7.5] [--reps 5]
[--link-mbps 5600 --latency-us 125] [--protocol tinygrad|chestnut]``

The twin runs with the **dock-like timing model by default**: each USB transfer takes ``latency-us`` plus its
bytes at ``link-mbps``. Link 5600 Mbps = the asm2464 firmware README's ~700 MB/s for the 0xF2 SRAM DMA on
10 Gbps USB 3 (tinygrad's reported copy-in speeds on docks, 119-323 MB/s, tinygrad#10259 / #17628 / #17663,
sit below it); latency 125 us = one USB 3 bus interval (the service interval of USB 3.x, 125 us), the least
a request/response pair costs on the bus. ``--link-mbps 0`` switches the model off (raw twin speed).

Measured per size, medians of ``--reps``:

- raw OUT / raw IN: the same bytes with the least the bridge needs, with tinygrad's own ``USB3`` /
  controller calls: per 256 KiB window one 0xF2 arm + one bulk OUT, all async, waited once at the end (the
  transport's best); per 512 KiB one ``scsi_read_arm`` + ``scsi_read`` (tinygrad has no async bulk IN); no
  sentinel, no queue, no waits;
- copy-in / copy-out: ``--protocol tinygrad`` (default) -- ``AMDAllocator._copyin`` / ``_copyout`` through
  :class:`~chestnut.backend.tinygrad_harness.TinygradDock` (SDMA ring, sentinels, fence reads, signal waits);
  ``--protocol chestnut`` -- the bounded :class:`~chestnut.backend.copy.CopyProtocol`.

The 3.2 MB and 7.5 MB sizes are openpilot's full camera frame on a comma four / comma 3X, sent to the USB GPU
every frame (openpilot#38862: ~22 ms of the 50 ms budget on a comma 3X). Then ``efficiency at >= 1 MiB: in X
out Y``: copy MB/s over raw MB/s, the lowest over the sizes >= 1 MiB.

Last, the node's transport against tinygrad's bare one (``--protocol tinygrad`` only): the full 1928x1208 NV12
frame (3,493,536 bytes, ``docs/warp.md``) copied in by the same ``AMDAllocator._copyin`` of the same dock
object, its controller's ``usb`` switched between the bare ``TwinUSB3`` and the node's
:class:`~chestnut.backend.retry.RetryingUSB3` over it (as ``backend/twin_runner.py`` builds it) on alternate
repetitions, so both see the same twin, ring and load. The last line is ``supervised/bare copy-in at 3.5 MB:
R``: the median over ``--frame-reps`` (default 41) adjacent pairs of supervised time / bare time (a pair sees the
same moment of a loaded machine; pairs run in turn bare-first and supervised-first, so neither always follows
the other; the medians of each are printed above it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchprefix import own_prefix

from chestnut.backend import protocol as P
from chestnut.backend.sim.client import TwinDaemon

MIB = 1 << 20
LINK_MBPS = 5600.0   # asm2464 firmware README: 0xF2 SRAM DMA ~700 MB/s on 10 Gbps USB 3
LATENCY_US = 125.0   # one USB 3 bus interval
FRAME_BYTES = 1928 * 1208 * 3 // 2  # the full 1928x1208 NV12 frame (docs/warp.md): 3,493,536 bytes


def timed(reps: int, fn: Callable[..., Any], *args: Any) -> float:
    """Median seconds of ``fn(*args)`` over ``reps`` calls."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def raw_out(ctrl: Any, data: memoryview) -> None:
    """Per 256 KiB window one 0xF2 arm and one bulk OUT, all submitted async (tinygrad's ``USB3`` calls), waited
    at the end: the most the transport carries."""
    usb, tags = ctrl.usb, []
    for i, off in enumerate(range(0, len(data), P.SRAM_HALF)):
        n = min(P.SRAM_HALF, len(data) - off)
        wire = -(-n // P.SECTOR) * P.SECTOR
        tags.append(usb.control_write_async(P.REQ_SRAM, wire // P.SECTOR,
                                            (i & 1) * P.SLOTS_PER_HALF | -(-wire // P.SRAM_SLOT) << 8))
        tags.append(usb.bulk_write_async(data[off:off + wire] if wire == n else bytes(data[off:off + n]) +
                                         bytes(wire - n)))
    for tag in tags:
        usb.bulk_wait(tag)


def raw_in(ctrl: Any, nbytes: int) -> None:
    for off in range(0, nbytes, P.SRAM_SIZE):
        n = min(P.SRAM_SIZE, nbytes - off)
        ctrl.scsi_read_arm(n)
        ctrl.scsi_read(n)


class ChestnutCopy:
    """The bounded protocol behind the same two calls as TinygradDock."""

    def __init__(self, usb: Any) -> None:
        from chestnut.backend.bridge import Bridge
        from chestnut.backend.copy import CommandQueue, CopyProtocol

        self.bridge = Bridge(usb)
        self.bridge.ensure_link()
        self.bridge.setup_bars()
        queue = CommandQueue(self.bridge)
        queue.attach()
        self.copy = CopyProtocol(self.bridge, queue)
        self.copy.attach()

    def copy_in(self, dst: int, data: memoryview) -> None:
        self.copy.copy_in(dst, data)

    def copy_out(self, src: int, nbytes: int) -> bytes:
        return bytes(self.copy.copy_out(src, nbytes))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1.048576, 4.194304, 16.777216, 3.2, 7.5],
                    help="copy sizes in MB (10^6 bytes); default 1, 4, 16 MiB and openpilot's 3.2 / 7.5 MB frames")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--link-mbps", type=float, default=LINK_MBPS, help="twin timing model: link (0 = off)")
    ap.add_argument("--latency-us", type=float, default=LATENCY_US, help="twin timing model: per-transfer latency")
    ap.add_argument("--protocol", choices=("tinygrad", "chestnut"), default="tinygrad")
    ap.add_argument("--frame-reps", type=int, default=41, help="repetitions of each transport for the last line")
    args = ap.parse_args()
    # the twin's prefix: $CHESTNUT_PREFIX as given, else one of its own whose runtime directory goes at the end
    with own_prefix(f"bench-copy-{os.getpid()}", env=True):
        return measure(args)


def measure(args: argparse.Namespace) -> int:
    """The bench itself, with ``args`` from :func:`main`, against a twin served on ``$CHESTNUT_PREFIX``; prints the
    table and the last lines."""
    os.environ.setdefault("DEV", "CPU")
    serve = ["--training-delay-ms", "1"]
    if args.link_mbps:
        serve += ["--link-mbps", str(args.link_mbps), "--latency-us", str(args.latency_us)]
    from chestnut.backend.retry import RetryingUSB3
    from chestnut.backend.sim.usb3 import TwinUSB3
    from chestnut.backend.tinygrad_harness import TinygradDock

    effs: list[tuple[float, float]] = []
    with TwinDaemon(args=serve):
        (dev, _), = TwinUSB3.list_devices(*P.USB_IDS[0])
        usb = TwinUSB3(dev)
        dock: Any = TinygradDock(usb) if args.protocol == "tinygrad" else ChestnutCopy(usb)
        ctrl = dock.ctrl if args.protocol == "tinygrad" else TinygradDock(usb, dock.bridge.bars).ctrl
        dst = P.VRAM_HEAP_OFFSET
        model = f"link {args.link_mbps:g} Mbps, latency {args.latency_us:g} us" if args.link_mbps else "off"
        print(f"protocol {args.protocol}; twin timing model: {model}")
        print(f"{'size':>10} | {'raw OUT':>8} {'copy-in':>8} {'eff':>5} {'ms':>7} | {'raw IN':>8} {'copy-out':>8} "
              f"{'eff':>5} {'ms':>7}")
        for mb in args.sizes_mb:
            size = int(mb * 1e6)
            data = memoryview(os.urandom(size))
            dock.copy_in(dst, data)  # warm-up, and what copy-out reads back
            assert dock.copy_out(dst, size) == data.tobytes(), "copy-out does not match copy-in"
            t_raw_out = timed(args.reps, raw_out, ctrl, data)
            t_raw_in = timed(args.reps, raw_in, ctrl, size)
            t_in = timed(args.reps, dock.copy_in, dst, data)
            t_out = timed(args.reps, dock.copy_out, dst, size)
            mbs = [size / t / 1e6 for t in (t_raw_out, t_in, t_raw_in, t_out)]
            e_in, e_out = mbs[1] / mbs[0], mbs[3] / mbs[2]
            if size >= MIB:
                effs.append((e_in, e_out))
            print(f"{size / 1e6:>8.3f}MB | {mbs[0]:>8.0f} {mbs[1]:>8.0f} {e_in:>5.2f} {t_in * 1e3:>7.2f} | "
                  f"{mbs[2]:>8.0f} {mbs[3]:>8.0f} {e_out:>5.2f} {t_out * 1e3:>7.2f}")
        ratio = None
        if args.protocol == "tinygrad":
            bars = dock.bars
            node_usb = RetryingUSB3(usb, value_regions=[bars[i] for i in (0, 2) if i in bars])
            frame = memoryview(os.urandom(FRAME_BYTES))
            times: dict[str, list[float]] = {"bare": [], "supervised": []}
            for j in range(args.frame_reps + 1):  # pairs in turn bare-first and supervised-first; pair 0 warms up
                for which in (("bare", "supervised") if j % 2 else ("supervised", "bare")):
                    dock.ctrl.usb = usb if which == "bare" else node_usb
                    t0 = time.perf_counter()
                    dock.copy_in(dst, frame)
                    if j:
                        times[which].append(time.perf_counter() - t0)
            dock.ctrl.usb = node_usb
            assert dock.copy_out(dst, FRAME_BYTES) == frame.tobytes(), "the supervised copy-in is not byte-exact"
            assert node_usb.log.errors == 0, node_usb.stats()
            bare, sup = (statistics.median(times[k]) for k in ("bare", "supervised"))
            ratio = statistics.median(s / b for b, s in zip(times["bare"], times["supervised"], strict=True))
            print(f"full frame {FRAME_BYTES} bytes, medians of {args.frame_reps}: bare tinygrad {bare * 1e3:.2f} ms, "
                  f"supervised (RetryingUSB3) {sup * 1e3:.2f} ms")
        usb.close()
    print("MB/s are medians (10^6 bytes/s); eff = copy / raw on the same transport in the same run; ms = one copy")
    print(f"efficiency at >= 1 MiB: in {min(e for e, _ in effs):.2f} out {min(e for _, e in effs):.2f}")
    if ratio is not None:
        print(f"supervised/bare copy-in at 3.5 MB: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
