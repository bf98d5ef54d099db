"""Benchmark: the node serving through a link that loses transfers (the twin's ``timeout`` fault).

For each probability (``--probabilities``, default one transfer in a thousand and one in ten) and
seed: a fresh node (``chestnut run`` as a child process, the tiny test model, hot standby, the node's
default back-off and flap limits) against one twin (``chestnut twin serve``); once the primary
serves, ``chestnut twin fault timeout --repeat --probability P --seed S`` for ``--seconds``. Printed
per run: frames answered, the share the primary served, failovers (``nodeState`` entering
``degraded``) with the first one's reason, output source changes (primary <-> fallback between
consecutive outputs), the timed-out transfers (the twin's count), the usb layer's
last reason and the worst publish -> output latency.

Real docks see 0-815 transfer errors per hour (openpilot#38519); the aim at one in a thousand:
at most one switch and at least 95 % primary frames; at one in ten: a failover on the usb layer.

Run: ``.venv/bin/python tests/bench/bench_link_faults.py [--seconds 60] [--probabilities 0.001,0.1]
[--seeds 13,7]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchprefix import own_prefix  # noqa: E402
from nodeharness import Bus, NodeProcess, Records, record_fingerprint, write_node_config  # noqa: E402
from tinymodel import make_tiny_onnx  # noqa: E402

from chestnut.backend.sim.client import TwinDaemon  # noqa: E402


def serving(rec: Records) -> bool:
    return (len(rec.outputs) >= 3 and all(o.source == "primary" for o in rec.outputs[-3:]) and bool(rec.states)
            and rec.states[-1].state == "active")


def one_run(cfg: Path, tmp: Path, prefix: str, probability: float, seed: int, seconds: float) -> str:
    with contextlib.ExitStack() as stack:  # on any way out: the node killed, the bus closed, the twin stopped
        twin = TwinDaemon(prefix).start()
        stack.callback(twin.stop)
        client = twin.client()
        stack.callback(client.close_connection)
        bus = Bus(prefix)
        bus.start()
        stack.callback(bus.close)
        node = NodeProcess(cfg, prefix, tmp / f"node-{probability}-{seed}.log").start()
        stack.callback(node.kill)
        bus.wait_for(lambda r: serving(r), 90.0, "the primary serving")
        t0 = time.monotonic_ns()
        client.fault("timeout", repeat=True, probability=probability, seed=seed)
        time.sleep(seconds)
        fired = sum(f["fired"] for f in client.status()["faults"] if f["kind"] == "timeout")
        client.clear()
        rec = bus.snapshot()
    outs = [o for o in rec.outputs if o.mono_ns >= t0]
    primary = sum(o.source == "primary" for o in outs)
    states = [s for s in rec.states if s.mono_ns >= t0]
    switches = [s for prev, s in zip([None, *states], states, strict=False)  # entries: nodeState repeats at 1 Hz
                if s.state == "degraded" and (prev is None or prev.state != "degraded")]
    flips = sum(a.source != b.source for a, b in zip(outs, outs[1:], strict=False))
    late_ms = max(((o.recv_ns - rec.sent[o.frame_id]) / 1e6 for o in outs if o.frame_id in rec.sent), default=0.0)
    usb = next((h.layers["usb"] for h in reversed(rec.health) if h.mono_ns >= t0), ("-", "-"))
    first = f"; first: {switches[0].reason[:140]}" if switches else ""
    return (f"P={probability:g} seed={seed}: {len(outs)} frames, primary {primary} "
            f"({100 * primary / max(1, len(outs)):.1f} %), {len(switches)} failovers{first}; {flips} output source "
            f"changes; "
            f"{fired} transfers timed out; worst latency {late_ms:.0f} ms; usb {usb[0]}: {usb[1][:160]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long the fault lasts per run")
    p.add_argument("--probabilities", default="0.001,0.1", help="comma-separated per-transfer probabilities")
    p.add_argument("--seeds", default="13,7", help="comma-separated fault seeds")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-link-"))
    try:
        model = make_tiny_onnx(tmp / "tiny.onnx")
        fp = record_fingerprint(model, tmp / "tiny.fingerprint.json")
        cfg = write_node_config(tmp / "node.toml", model, fingerprint=fp)
        for prob in (float(x) for x in args.probabilities.split(",")):
            for seed in (int(x) for x in args.seeds.split(",")):
                # each run on a prefix of its own, whose runtime directory goes once its programs have stopped
                with own_prefix(f"bench{os.getpid()}-link") as prefix:
                    line = one_run(cfg, tmp, prefix, prob, seed, args.seconds)
                print(line, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
