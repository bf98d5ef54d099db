"""Soak: the launched stack (``chestnut launch``: twin, logger, node, camera, control) at 20 Hz for N minutes
with a random schedule of faults drawn from every fault kind the twin knows, then the figures that show
whether it holds up over time.

    .venv/bin/python tests/bench/bench_soak.py [--minutes 60] [--seed S] [--rate 20] [--json FILE]

The schedule (seeded; the seed and every fault are printed first, so a run can be repeated exactly): the
run is cut into slots of ``--slot-s`` seconds after a fault-free ``--settle-s``; each slot gets one fault,
the kinds taken in a shuffled order so that every kind comes once before any comes twice, starting at a
random point in the first third of its slot and lasting 2 s to half the slot. By default the slots are as
long as lets every kind come at least once (10 to 60 s: 60 min -> 59 faults, 10 min -> 21). ``chestnut launch`` clears
each fault after its duration and does the recovery a person would (plug a pulled cable back, power-cycle
a wedged bridge). Three failovers within 10 minutes park the node on the fallback for 5 minutes
(``node/supervisor.py``), so a dense schedule shows many fallback outputs by design.

Reported: frames in / out / missing, outputs per source, soft-disable episodes, contract violations, and
per program the resident memory and open file descriptors at the start (10 s after the first output) and
at the end, with its process count (the node's worker is ``node/child``), and any process of the stack
left after the launch exited. Aims (issue "Beyond the list"): 0 missing, 0 violations, RSS growth < 10 MB,
no fd or process growth.

Not part of the test suite: it runs for minutes and needs the prepared model (``bash launch/setup.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchprefix import own_prefix

from chestnut.backend.sim.faults import KINDS
from chestnut.launch.faultplan import FaultPlan
from chestnut.launch.supervise import stack_pids

RSS_GROWTH_AIM_MB = 10.0
FAULT_MIN_S = 2.0
SLOT_MIN_S = 10.0  # s: the shortest slot still lets the node fail over and recover
SLOT_MAX_S = 60.0


def fault_schedule(seed: int, run_s: float, settle_s: float, slot_s: float) -> list[str]:
    """``--fault`` arguments (``KIND@START+DURATION``, seconds after the first output) for a run of ``run_s``
    seconds: one fault per ``slot_s`` slot after ``settle_s``, kinds cycling through shuffled rounds of every
    kind in :data:`~chestnut.backend.sim.faults.KINDS`. Every entry parses with ``FaultPlan.parse``."""
    rng = random.Random(seed)
    out: list[str] = []
    kinds: list[str] = []
    t = settle_s
    while t + slot_s <= run_s:
        if not kinds:
            kinds = sorted(KINDS)
            rng.shuffle(kinds)
        kind = kinds.pop()
        start = t + rng.uniform(0.0, slot_s / 3)
        duration = rng.uniform(FAULT_MIN_S, max(FAULT_MIN_S, slot_s / 2))
        out.append(f"{kind}@{start:.1f}+{duration:.1f}")
        t += slot_s
    for f in out:
        FaultPlan.parse(f)  # refused here, not minutes into the run
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="how long the stack runs (default 60)")
    ap.add_argument("--seed", type=int, default=None, help="fault schedule seed (default: drawn and printed)")
    ap.add_argument("--rate", type=float, default=20.0, help="camera rate, Hz (default 20)")
    ap.add_argument("--settle-s", type=float, default=20.0, help="fault-free time after the first output")
    ap.add_argument(
        "--slot-s",
        type=float,
        default=None,
        help="one fault per slot of this many seconds (default: every kind at least once, slots of "
        f"{SLOT_MIN_S:g} to {SLOT_MAX_S:g} s)",
    )
    ap.add_argument("--runs-dir", type=Path, default=None, help="where the run directory goes (default: a temp dir)")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    run_s = args.minutes * 60
    slot_s = args.slot_s or min(SLOT_MAX_S, max(SLOT_MIN_S, (run_s - args.settle_s) / len(KINDS)))
    faults = fault_schedule(seed, run_s, args.settle_s, slot_s)
    print(
        f"soak: {args.minutes:g} min at {args.rate:g} Hz, seed {seed}, {len(faults)} faults in {slot_s:.1f} s slots "
        f"({len({f.split('@')[0] for f in faults})} of {len(KINDS)} kinds):"
    )
    for f in faults:
        print(f"  {f}")
    runs = args.runs_dir or Path(tempfile.mkdtemp(prefix="chestnut-soak-"))
    prefix = f"soak{os.getpid()}"
    summary_path = runs / "soak-summary.json"
    cmd = [
        sys.executable,
        "-m",
        "chestnut.launch.cli",
        "launch",
        "--seconds",
        f"{run_s:g}",
        "--rate",
        f"{args.rate:g}",
        "--no-live",
        "--runs-dir",
        str(runs),
        "--log-format",
        "zst",
        "--json",
        str(summary_path),
    ]
    for f in faults:
        cmd += ["--fault", f]
    t0 = time.monotonic()
    with own_prefix(prefix):  # its runtime directory goes once the stack is checked for what it left running
        proc = subprocess.run(cmd, env=dict(os.environ, CHESTNUT_PREFIX=prefix), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        wall_s = time.monotonic() - t0
        left = stack_pids(prefix)
    if not summary_path.is_file():
        print(f"launch exited {proc.returncode} without a summary:\n{proc.stderr[-3000:]}")
        return 1
    s = json.loads(summary_path.read_text())
    procs = s.get("processes", {})
    growth = {name: v["rss_end_mb"] - v["rss_start_mb"] for name, v in procs.items() if "rss_end_mb" in v}
    fd_growth = {name: v["fds_end"] - v["fds_start"] for name, v in procs.items() if "fds_end" in v}
    proc_growth = {name: v["processes_end"] - v["processes_start"] for name, v in procs.items() if "processes_end" in v}
    violations = {k: v for k, v in s.get("contracts", {}).items() if v}
    figures = {
        "seed": seed,
        "minutes": args.minutes,
        "rate_hz": args.rate,
        "faults": faults,
        "wall_s": round(wall_s, 1),
        "launch_exit": proc.returncode,
        "frames_in": s["frames_in"],
        "outputs": s["outputs"],
        "missing": len(s["missing_outputs"]),
        "by_source": s["by_source"],
        "frame_rate_hz": s["frame_rate_hz"],
        "soft_disable_episodes": len(s.get("soft_disable_episodes", [])),
        "contract_violations": violations,
        "processes": procs,
        "rss_growth_mb": growth,
        "fd_growth": fd_growth,
        "process_growth": proc_growth,
        "left_after_exit": left,
        "log_damage": s["log_damage"],
        "run_dir": str(runs),
    }
    print(f"\nlaunch exit {proc.returncode} after {wall_s:.0f} s; run dir {runs}")
    print(
        f"frames in / out / missing: {s['frames_in']} / {s['outputs']} / {len(s['missing_outputs'])}  "
        f"(camera {s['frame_rate_hz']:.2f} Hz)"
    )
    print("outputs by source: " + ", ".join(f"{k} {v}" for k, v in sorted(s["by_source"].items())))
    print(f"soft-disable episodes: {figures['soft_disable_episodes']}; contract violations: {violations or 'none'}")
    print(
        f"{'program':12s} {'RSS MB start':>12s} {'end':>7s} {'growth':>7s} {'fds start':>9s} {'end':>4s} "
        f"{'procs start':>11s} {'end':>4s}"
    )
    for name, v in procs.items():
        if "rss_end_mb" not in v:
            print(f"{name:12s} (not running at the start or the end)")
            continue
        print(
            f"{name:12s} {v['rss_start_mb']:12.1f} {v['rss_end_mb']:7.1f} {growth[name]:+7.1f} {v['fds_start']:9d} "
            f"{v['fds_end']:4d} {v['processes_start']:11d} {v['processes_end']:4d}"
        )
    print(f"stack processes left after the launch exited: {left or 'none'}")
    ok = (
        not figures["missing"]
        and not violations
        and not left
        and all(g < RSS_GROWTH_AIM_MB for g in growth.values())
        and all(g <= 0 for g in fd_growth.values())
        and all(g <= 0 for g in proc_growth.values())
    )
    print(
        "aims (0 missing, 0 violations, RSS growth < 10 MB, no fd or process growth, nothing left): "
        + ("met" if ok else "NOT met")
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
