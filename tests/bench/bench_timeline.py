"""Benchmark: where one frame's time goes, step by step, across the camera, the node and its primary worker.

A node (``chestnut run`` as a child process, started as ``bench_node.py`` starts its rows: the tiny test model,
``dock.kind = "cpu"``, warm standby: the primary in a host-CPU worker) answers ``--frames`` frames at 20 Hz from a
bus in this process (``tests/nodeharness.py``). The node and its worker carry time stamps (CLOCK_MONOTONIC, one
list append each, no profiler): an interpreter start-up hook (``sitecustomize``, written into this run's temporary
directory and put on the node's ``PYTHONPATH`` only; the worker inherits it) wraps a few functions at their entry
or exit:

- node: the main loop's poll returning with something ready; each command sent to the worker (WAKE or RUN,
  by the packet's kind byte, ``node/wire.py``); each worker message taken in (``WorkerHandle._dispatch``);
  ``Node._publish_output`` starting; ``PubMaster.send`` of a ``modelOutput`` returning;
- worker: each command received (``msgs/fdpass.py`` ``recv_fds`` returning); the runner's ``run`` starting
  and returning (``node/cpu_runner.py`` ``HostCpuRunner.run``: the figure's execution time); its RESULT sent.

With the bus's own send and receipt of each frame, every frame answered by the primary gives the steps below
(us, p50 and p90 over the frames); the WAKE's line says how long before the camera's send the worker was woken
(negative: after it, on the frame's receipt). Everything but the model run is what the node's own cost and the
two floors of ``tests/bench/bench_node.py --only overhead`` add up to. The stamps cost about a microsecond
each. Last line: ``timeline p50 (us): receipt -> RUN A, worker B, result -> out C`` (the node's wake-up to its
RUN; the worker's receive to its RESULT less the model run; the node's taking in the RESULT to its
``modelOutput`` sent).

Run: ``.venv/bin/python tests/bench/bench_timeline.py [--frames 400]``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_node import Setup, start, stop  # noqa: E402

from chestnut.node.wire import Msg  # noqa: E402

# The start-up hook, written as sitecustomize.py into a directory on the node's PYTHONPATH. It acts only with
# CHESTNUT_TIMELINE_OUT set, in the node (``chestnut.launch.cli``) and in its worker (``chestnut.node.worker``).
HOOK = '''
import os, sys
if os.environ.get("CHESTNUT_TIMELINE_OUT"):
    import atexit, json, time
    ns, events = time.monotonic_ns, []
    add = events.append

    def dump():
        path = os.path.join(os.environ["CHESTNUT_TIMELINE_OUT"], f"{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(events, f)

    def at_entry(owner, name, label_of):
        f = getattr(owner, name)
        def w(*a, **k):
            label = label_of(a)
            if label:
                add((label, ns()))
            return f(*a, **k)
        setattr(owner, name, w)

    def at_exit(owner, name, label, keep=lambda r: True):
        f = getattr(owner, name)
        def w(*a, **k):
            r = f(*a, **k)
            if keep(r):
                add((label, ns()))
            return r
        setattr(owner, name, w)

    argv = " ".join(getattr(sys, "orig_argv", sys.argv))
    if "chestnut.launch.cli" in argv:
        import zmq
        import chestnut.msgs.messaging as messaging
        import chestnut.node.main as main
        import chestnut.node.worker_handle as handle
        atexit.register(dump)
        at_exit(zmq.Poller, "poll", "node wakes", keep=bool)
        at_entry(handle.WorkerHandle, "_send", lambda a: {@WAKE@: "WAKE sent", @RUN@: "RUN sent"}.get(a[1][0]))
        at_entry(handle.WorkerHandle, "_dispatch", lambda a: "node takes the RESULT")
        at_entry(main.Node, "_publish_output", lambda a: "publish starts")
        send = messaging.PubMaster.send
        def sent(self, service, msg, *a, **k):
            r = send(self, service, msg, *a, **k)
            if service == "modelOutput":
                add(("modelOutput sent", ns()))
            return r
        messaging.PubMaster.send = sent
    elif "chestnut.node.worker" in argv:
        import socket
        import chestnut.node.cpu_runner as cpu_runner
        import chestnut.node.worker as worker
        atexit.register(dump)
        at_exit(worker, "recv_fds", "worker has it")
        at_entry(cpu_runner.HostCpuRunner, "run", lambda a: "model run starts")
        at_exit(cpu_runner.HostCpuRunner, "run", "model run ends")
        at_entry(socket.socket, "sendall", lambda a: "RESULT sent")
'''.replace("@WAKE@", str(int(Msg.WAKE))).replace("@RUN@", str(int(Msg.RUN)))

# (label, from stamp, to stamp): the steps printed, in the frame's order
STEPS = (
    ("camera sends -> node wakes", "camera sends", "node wakes"),
    ("node wakes -> RUN sent", "node wakes", "RUN sent"),
    ("RUN sent -> worker has it", "RUN sent", "worker has it"),
    ("worker has it -> model run starts", "worker has it", "model run starts"),
    ("model run", "model run starts", "model run ends"),
    ("model run ends -> RESULT sent", "model run ends", "RESULT sent"),
    ("RESULT sent -> node takes it", "RESULT sent", "node takes the RESULT"),
    ("node takes it -> publish starts", "node takes the RESULT", "publish starts"),
    ("publish starts -> modelOutput sent", "publish starts", "modelOutput sent"),
    ("modelOutput sent -> received", "modelOutput sent", "received"),
)


def frame_stamps(events: list[tuple[str, int]], sent_ns: int, recv_ns: int) -> dict[str, int]:
    """Each stamp's first time within one frame (from the camera's send of it to the receipt of its output);
    the worker's receive, the model run and the RESULT: the first after the RUN (a WAKE is received too)."""
    times = [t for _, t in events]
    first: dict[str, int] = {"camera sends": sent_ns, "received": recv_ns}
    for label, t in events[bisect.bisect_left(times, sent_ns):bisect.bisect_right(times, recv_ns)]:
        if label in ("worker has it", "model run starts", "model run ends", "RESULT sent") and t < first.get(
                "RUN sent", recv_ns):
            continue
        first.setdefault(label, t)
    return first


def wake_lead_us(events: list[tuple[str, int]], sent_ns: int) -> float | None:
    """How long (us) before the camera's send the last WAKE before this frame's RUN went out (None: none within
    a frame period either side)."""
    wakes = [t for label, t in events if label == "WAKE sent" and sent_ns - 50_000_000 < t < sent_ns + 50_000_000]
    runs = [t for label, t in events if label == "RUN sent" and sent_ns <= t < sent_ns + 50_000_000]
    if not runs:
        return None
    before = [t for t in wakes if t < runs[0]]
    return (sent_ns - before[-1]) / 1e3 if before else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=400, help="frames answered by the primary to time")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-timeline-") as d:
        tmp = Path(d)
        hook, out = tmp / "hook", tmp / "stamps"
        hook.mkdir()
        out.mkdir()
        (hook / "sitecustomize.py").write_text(HOOK)
        setup = Setup(argparse.Namespace(model=None, height=32, width=64, preprocess="unit"), tmp)
        prefix = setup.prefix("timeline")
        pythonpath = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH", "")]))
        node, bus = start(setup, setup.config("cpu", "warm"), prefix,
                          env={"PYTHONPATH": pythonpath, "CHESTNUT_TIMELINE_OUT": str(out)})
        try:
            bus.wait_for(lambda r: len(r.outputs) >= 40 and all(o.source == "primary" for o in r.outputs[-10:]),
                         90.0, "the primary serving")
            skip = len(bus.snapshot().outputs)
            rec = bus.wait_for(lambda r: r if len(r.outputs) >= skip + args.frames else None,
                               args.frames / 20 * 3 + 30, f"{args.frames} frames")
        finally:
            stop(node, bus)
        events = sorted((tuple(e) for f in out.glob("*.json") for e in json.loads(f.read_text())),
                        key=lambda e: e[1])
    steps: dict[str, list[float]] = {label: [] for label, _, _ in STEPS}
    leads: list[float] = []
    for o in rec.outputs[skip:skip + args.frames]:
        if o.source != "primary":
            continue
        stamps = frame_stamps(events, rec.sent[o.frame_id], o.recv_ns)
        for label, a, b in STEPS:
            if a in stamps and b in stamps and stamps[b] >= stamps[a]:
                steps[label].append((stamps[b] - stamps[a]) / 1e3)
        if (lead := wake_lead_us(events, rec.sent[o.frame_id])) is not None:
            leads.append(lead)
    print(f"bench_timeline: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; tiny model, cpu dock, "
          f"warm standby, 20 Hz; us per frame over the frames the primary answered")
    print(f"  {'step':<38} {'n':>5} {'p50':>8} {'p90':>8}")
    for label, xs in steps.items():
        if xs:
            print(f"  {label:<38} {len(xs):5d} {np.percentile(xs, 50):8.1f} {np.percentile(xs, 90):8.1f}")
    if leads:
        print(f"  {'WAKE sent before the camera sends':<38} {len(leads):5d} {np.percentile(leads, 50):8.1f} "
              f"{np.percentile(leads, 90):8.1f}")

    def p50(label: str) -> float:
        return float(np.percentile(steps[label], 50)) if steps[label] else float("nan")

    worker = p50("worker has it -> model run starts") + p50("model run ends -> RESULT sent")
    after = p50("node takes it -> publish starts") + p50("publish starts -> modelOutput sent")
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(f"timeline p50 (us): receipt -> RUN {p50('node wakes -> RUN sent'):.0f}, worker {worker:.0f}, "
          f"result -> out {after:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
