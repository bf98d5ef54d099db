"""Load: the launched stack (``chestnut launch``, the main job's default config: the twin, the real model, 20 Hz)
beside two CPU-bound processes, counting the alarms nobody should see.

    .venv/bin/python tests/bench/bench_load.py [--minutes 10] [--fault KIND@START+DUR] [--runs-dir DIR]

The bench starts two hogs (``python -c "while True: pass"``, one per core of a 2-core host) before the launch
and kills them when it ends, whatever happens (``finally``). Without ``--fault`` it counts, from the launch's
``--json`` summary: failovers (node state transitions into ``degraded``, each with its reason and layer),
control soft-disable episodes, frames answered out of frames in, and the primary's share of the outputs.
Aim (issue 19): no failover, no soft-disable, every frame answered, the primary on >= 95 % of them.
Its last line is exactly::

    false alarms in M min beside 2 CPU hogs: failovers F, soft-disables S, frames answered A/B, primary P%

With ``--fault KIND@START+DUR`` (``chestnut launch --fault``'s syntax, START counted from the node's first
output) the no-fault run is repeated with that one fault, and the failovers it caused are reported with
their layers (aim: exactly 1, on the fault's layer) before the line above.

Not part of the test suite: it runs for minutes and needs the prepared model (``bash launch/setup.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchprefix import own_prefix

from chestnut.launch.faultplan import FaultPlan
from chestnut.launch.supervise import last_error_line
from chestnut.msgs.outdir import OutputDirError, private_dir

HOGS = 2
HOG_CODE = "while True: pass"
LAYER_IN_REASON = re.compile(r"^\w+ \((usb|pcie|gpu|output)\)")


def start_hogs(n: int = HOGS) -> list[subprocess.Popen[bytes]]:
    """``n`` CPU-bound children of this process (each one busy Python loop)."""
    return [subprocess.Popen([sys.executable, "-c", HOG_CODE], stdin=subprocess.DEVNULL) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen[bytes]]) -> None:
    """Kill and reap every hog (by its own pid)."""
    for h in hogs:
        if h.poll() is None:
            h.kill()
    for h in hogs:
        try:
            h.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def failovers(summary: dict) -> list[tuple[float, str, str]]:
    """The node's failovers in a launch summary: every transition into ``degraded`` as (t s, layer, reason);
    the layer is the one the reason names (``deadline_miss_run (gpu): ...``), "" when it names none."""
    out = []
    for t_s, state, reason in summary.get("transitions", []):
        if state == "degraded":
            m = LAYER_IN_REASON.match(reason)
            out.append((float(t_s), m.group(1) if m else "", reason))
    return out


def run_launch(seconds: float, runs: Path, fault: str | None) -> tuple[dict | None, int, str]:
    """One ``chestnut launch`` of ``seconds`` on a prefix of its own; (its --json summary or None, exit code,
    the tail of its stderr)."""
    summary_path = runs / f"summary-{'fault' if fault else 'quiet'}.json"
    cmd = [sys.executable, "-m", "chestnut.launch.cli", "launch", "--seconds", f"{seconds:g}", "--no-live",
           "--runs-dir", str(runs), "--json", str(summary_path)]
    if fault:
        cmd += ["--fault", fault]
    with own_prefix(f"load{os.getpid()}{'f' if fault else 'q'}") as prefix:  # its runtime directory goes after
        proc = subprocess.run(cmd, env=dict(os.environ, CHESTNUT_PREFIX=prefix), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    return summary, proc.returncode, proc.stderr[-3000:]


def no_summary_line(what: str, code: int, seconds: float, load: str, err: str) -> str:
    """The one line for a launch that left no summary: its exit, how long it ran, the load, and its own last error
    line from its stderr (``launch/supervise.py`` ``last_error_line``: the last ERROR / CRITICAL line without its
    timestamp, else the last line, an argument refusal say). It said ``launch exit 2`` and dumped the stderr's tail
    below, the cause three lines further down."""
    said = last_error_line(err) if err.strip() else "(nothing on its stderr)"
    return f"{what}: launch exit {code} after {seconds:.0f} s, no summary; load average {load}; {said}"


def runs_folder(runs_dir: Path | None) -> Path:
    """The folder the launches' run directories and ``--json`` summaries go to: ``runs_dir`` created 0700 with any
    missing parents as the launch creates its ``--runs-dir`` (``msgs/outdir.py`` ``private_dir``), or a fresh temp
    dir for None. A missing ``--runs-dir`` failed the first launch ("--json: ...: folder DIR does not exist").
    Raises :class:`~chestnut.msgs.outdir.OutputDirError` (one line) for a folder the launch would refuse."""
    return Path(tempfile.mkdtemp(prefix="chestnut-load-")) if runs_dir is None else private_dir(runs_dir)


def load_avg() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long each run lasts (default 10)")
    ap.add_argument("--fault", help="also a run with this one fault, KIND@START+DURATION (s)")
    ap.add_argument("--runs-dir", type=Path, default=None, help="where the run directories go (default: a temp dir)")
    args = ap.parse_args()
    if args.fault:
        FaultPlan.parse(args.fault)  # refused here, not minutes into the run
    try:
        runs = runs_folder(args.runs_dir)
    except OutputDirError as e:
        print(f"bench_load: --runs-dir: {e}", file=sys.stderr)
        return 2
    seconds = args.minutes * 60
    results: dict[str, dict | None] = {}
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        hogs = start_hogs()
        print(f"load: {args.minutes:g} min beside {len(hogs)} CPU hogs (pids {', '.join(str(h.pid) for h in hogs)}); "
              f"run dir {runs}", flush=True)
        for fault in [None] + ([args.fault] if args.fault else []):
            t0 = time.monotonic()
            summary, code, err = run_launch(seconds, runs, fault)
            what = f"fault {fault}" if fault else "no fault"
            if summary is None:
                print(no_summary_line(what, code, time.monotonic() - t0, load_avg(), err), flush=True)
            else:
                print(f"{what}: launch exit {code} after {time.monotonic() - t0:.0f} s; load average {load_avg()}",
                      flush=True)
            results[fault or ""] = summary
    finally:
        stop_hogs(hogs)
    if args.fault:
        s = results.get(args.fault)
        if s is not None:
            fo = failovers(s)
            layers = ", ".join(f"{layer or '?'} at {t:.1f} s" for t, layer, _ in fo) or "none"
            print(f"fault {args.fault}: failovers {len(fo)} ({layers}); aim exactly 1 on the fault's layer")
            for t, _, reason in fo:
                print(f"  {t:.1f} s {reason}")
    quiet = results.get("")
    if quiet is None:
        print(f"false alarms in {args.minutes:g} min beside {HOGS} CPU hogs: no summary (the launch failed)")
        return 1
    fo = failovers(quiet)
    for t, _, reason in fo:
        print(f"  failover at {t:.1f} s: {reason}")
    for ep in quiet.get("soft_disable_episodes", []):
        print(f"  soft-disable at {ep['t_s']:.1f} s: {ep['cause']}")
    soft = len(quiet.get("soft_disable_episodes", []))
    frames_in = int(quiet["frames_in"])
    answered = frames_in - len(quiet.get("missing_outputs", []))
    outputs = max(1, int(quiet["outputs"]))
    primary = 100.0 * quiet.get("by_source", {}).get("primary", 0) / outputs
    print(f"false alarms in {args.minutes:g} min beside {HOGS} CPU hogs: failovers {len(fo)}, soft-disables {soft}, "
          f"frames answered {answered}/{frames_in}, primary {primary:.0f}%")
    return 0 if not fo and not soft and answered == frames_in and primary >= 95 else 1


if __name__ == "__main__":
    sys.exit(main())
