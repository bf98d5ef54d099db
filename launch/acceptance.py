"""``chestnut acceptance``: the test a dock owner runs, and attaches to a bug report.

    chestnut acceptance --real --out DIR     # a real dock: asks you to unplug and replug it
    chestnut acceptance --twin --out DIR     # the twin: the same steps, unattended, faults injected

Steps, in order; each has its figures and a verdict (pass / fail / not run), and a failed step does not
stop the ones after it unless they need what it made (those are "not run", naming the step that failed):

=================  ==========================================================================================
``ladder``         the qualification ladder with the model's rungs (``backend/ladder.py``), in a fresh
                   process that owns the dock; figures: each rung's duration (ms)
``copy_<bytes>``   copy-in and copy-out of ``<bytes>`` random bytes and back (as tinygrad's own USB copy
                   benchmark does, several sizes); figures: MB/s each way, the round trip exact; a rate
                   below ``--min-copy-mbps`` fails
``fingerprint``    one run on the fingerprint's fixed input against the fingerprint recorded on the host
                   CPU (``backend/fingerprint.py``); figures: bit-exact, largest difference of a mean
``frames``         ``--frames`` camera frames through the node (``chestnut run``); figures: answered,
                   served by the primary, latency p50/p99 (ms, frame publish to ``modelOutput``), the
                   frames the fallback answered with their reasons; passes with every frame answered, no
                   failover, and at most 5 % single deadline misses beside the host-late ones
``unplug``         the dock unplugged (twin: injected; real: the person is asked to); figures: the
                   detection time (ms, unplug to ``chestnutActive`` false) against ``--detect-bound-ms``
``replug``         the dock plugged back; figures: the recovery time (s, replug to the primary serving
                   again) against ``--recover-bound-s``
=================  ==========================================================================================

``report.json`` and ``report.html`` in ``--out`` carry every figure, the versions and identity of the
host and the dock (``backend/probe.py`` ``runner_identity``) and the verdicts. Exit status 0: every
step passed; 1: a step failed (named on the last line); 2: the kit could not run.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chestnut.backend import protocol as P
from chestnut.launch.acceptance_bus import FRAME_HZ, FrameBus, inactive_since, percentile_ms, serving_primary
from chestnut.launch.acceptance_dock import run_dock_process
from chestnut.msgs.argtypes import checked_float, checked_int, path_arg, positive_ms, positive_seconds
from chestnut.msgs.outdir import OutputDirError, open_private, private_dir, write_private

DEFAULT_SIZES = (64 << 10, 1 << 20, 4 << 20)  # bytes per copy
ACTIVE_TIMEOUT_S = 300.0  # the node's derived start-up budget (node/config.py) plus its fallback's warm-up
MAX_MISSED_SHARE = 0.05  # frames step: the share a dock may answer late (single deadline misses, from the fallback)
DETECT_BOUND_MS = P.WAIT_TIMEOUT_MS * 1.1 + 2000.0  # the wait timeout + 10 %, plus a scheduling allowance
RECOVER_BOUND_S = 120.0  # back-off, a fresh worker's ladder (warm compile cache) and shadow frames
HUMAN_TIMEOUT_S = 300.0  # how long the kit waits for a person to unplug or replug the dock
ENV_DROP = ("DEV", "GMMU", "HCQDEV_WAIT_TIMEOUT_MS")  # the dock's process sets its own (backend/real_runner.py)


@dataclass
class StepRecord:
    """One step of the kit: its verdict, its figures (name -> number, bool or text) and a one-line detail.
    ``ran`` False: the kit did not reach the step (verdict "not run", ``detail`` says why)."""

    name: str
    passed: bool
    figures: dict[str, Any] = field(default_factory=dict)
    detail: str = ""
    ran: bool = True

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "fail" if self.ran else "not run"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "verdict": self.verdict,
            "figures": self.figures,
            "detail": self.detail,
        }


# ------------------------------------------------------------------ the kit
class Kit:
    """The kit's run: see the module docstring. ``say`` gets the person's instructions and progress."""

    def __init__(self, args: argparse.Namespace, say: Callable[[str], None] = print) -> None:
        from chestnut.node import config as node_config

        self.args, self.say = args, say
        self.twin = not args.real
        self.prefix = args.prefix or f"acc{os.getpid()}"
        default = node_config.DEFAULT_CONFIG if node_config.DEFAULT_CONFIG.is_file() else None
        self.cfg = node_config.load_config(args.config if args.config is not None else default)
        if args.model is not None:
            self.cfg.model.path = args.model
        self.cfg.dock.kind = "twin" if self.twin else "real"
        node_config.validate(self.cfg)  # the node's own checks for this dock (its start-up budget among them)
        from chestnut.node.contract import read_fingerprint

        # the fingerprint recorded beside the model, read as the node reads it (bounded; a FIFO never opened): None
        # when there is none (recorded afresh by the fingerprint step), ConfigError for a file that is not one
        self.recorded_fp = read_fingerprint(self.cfg.fingerprint_path)
        self.steps: list[StepRecord] = []
        self.identity: dict[str, str] = {}
        self.node_identity: dict[str, str] = {}  # as the node's nodeState carries it
        self.init_identity: dict[str, str] = {}  # as its initData (every log's header) carries it
        self.env = {k: v for k, v in os.environ.items() if k not in ENV_DROP}
        self.env["CHESTNUT_PREFIX"] = self.prefix
        from chestnut.msgs.paths import runtime_base

        # a runtime directory there before the run (a --prefix the person gave) may hold their own files
        self.runtime_existed = os.path.lexists(runtime_base() / f"chestnut-{os.getuid()}" / self.prefix)
        self.daemon: Any = None
        self.client: Any = None

    def add(self, step: StepRecord) -> StepRecord:
        self.steps.append(step)
        self.say(f"[{step.verdict.upper()}] {step.name:<14} {step.detail}")
        return step

    def planned_steps(self) -> list[str]:
        """Every step this run would take, in order (the module doc's table; one ``copy_<bytes>`` per size)."""
        return ["ladder", *(f"copy_{n}" for n in self.args.sizes), "fingerprint", "frames", "unplug", "replug"]

    def add_not_run(self) -> None:
        """A "not run" record for each planned step the kit did not reach, naming the first failed step."""
        seen = {s.name for s in self.steps}
        failed = next((s.name for s in self.steps if s.ran and not s.passed), None)
        why = f"not run: the {failed} step failed" if failed else "not run: the kit stopped before it"
        for name in self.planned_steps():
            if name not in seen:
                self.add(StepRecord(name, False, {}, why, ran=False))

    def run(self) -> int:
        """Every step, then the reports; 0 accepted, 1 not. A Ctrl-C or SIGTERM stops the steps, and the reports
        are still written, with the steps not reached marked not run: 130 / 143 (128 + the signal)."""
        out: Path = self.args.out
        private_dir(out)  # checked in run(); a new directory is born 0700
        stopped_by: list[int] = []

        def on_signal(signum: int, _frame: object) -> None:
            stopped_by.append(signum)
            raise KeyboardInterrupt

        handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._steps()
        except KeyboardInterrupt:
            if not stopped_by:
                stopped_by.append(signal.SIGINT)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return self._conclude(out, stopped_by[0] if stopped_by else None)

    def _steps(self) -> None:
        try:
            if self.twin:
                from chestnut.backend.sim.client import TwinDaemon

                # the program engine that keeps the camera's 20 Hz on a small host, as ``chestnut launch`` uses
                self.daemon = TwinDaemon(self.prefix, ["--engine", self.args.twin_engine]).start()
                self.client = self.daemon.client()
            fp = self.fingerprint()
            ok = self.dock_steps(fp)
            if ok:
                self.node_steps()
        finally:
            if self.client is not None:
                self.client.close_connection()
            if self.daemon is not None:
                self.daemon.stop()
                self.remove_runtime()
            self.add_not_run()

    def remove_runtime(self) -> None:
        """The twin's runtime directory once it stopped: removed whole when this run made it, else
        (``launch/rundir.py`` ``remove_runtime_dir``) only if everything in it is a stack's leftover -- a prefix
        the person gave keeps their own files, and a line says why the directory stays."""
        from chestnut.launch.rundir import remove_runtime_dir
        from chestnut.msgs.paths import runtime_dir

        if not self.runtime_existed:
            shutil.rmtree(runtime_dir(self.prefix), ignore_errors=True)
        elif (kept := remove_runtime_dir(self.prefix)) is not None:
            self.say(kept)

    def _conclude(self, out: Path, stopped_by: int | None) -> int:
        write_reports(out, self.report())
        failed = [s.name for s in self.steps if s.ran and not s.passed]
        not_run = [s.name for s in self.steps if not s.ran]
        self.say(f"report: {out / 'report.json'}, {out / 'report.html'}")
        if stopped_by is not None:
            self.say(f"NOT accepted: stopped by {signal.Signals(stopped_by).name} before "
                     f"{', '.join(not_run) or 'the end'}")
            return 128 + stopped_by
        if not failed and not not_run:
            self.say("accepted: every step passed")
        else:
            self.say(
                "NOT accepted: "
                + "; ".join(
                    x
                    for x in (
                        f"failed step(s) {', '.join(failed)}" if failed else "",
                        f"not run: {', '.join(not_run)}" if not_run else "",
                    )
                    if x
                )
            )
        return 0 if not failed and not not_run else 1

    def report(self) -> dict[str, Any]:
        from chestnut.node.main import _versions

        return {
            "target": "twin" if self.twin else "real",
            "model": str(self.cfg.model.path),
            "versions": _versions(),
            "identity": self.identity,
            "node_identity": self.node_identity,
            "init_identity": self.init_identity,
            "node_config": self.cfg.to_json(),
            "passed": all(s.passed for s in self.steps) and bool(self.steps),
            "failed_steps": [s.name for s in self.steps if s.ran and not s.passed],
            "not_run_steps": [s.name for s in self.steps if not s.ran],
            "steps": [s.to_json() for s in self.steps],
        }

    def fingerprint(self) -> dict[str, Any]:
        """The recorded fingerprint read when the kit was made (``recorded_fp``), else one recorded now on the host
        CPU in a child process (``backend/probe.py`` ``_record_fingerprint_subprocess``)."""
        if self.recorded_fp is not None:
            return self.recorded_fp
        from chestnut.backend.interface import ModelSpec
        from chestnut.backend.probe import _record_fingerprint_subprocess

        m = self.cfg.model
        return _record_fingerprint_subprocess(ModelSpec(m.path, m.name, {m.input: tuple(m.shape)}))

    def dock_steps(self, fp: dict[str, Any]) -> bool:
        m = self.cfg.model
        params = {
            "twin": self.twin,
            "prefix": self.prefix,
            "wait_timeout_ms": int(self.cfg.dock.wait_timeout_ms),
            "model": str(m.path),
            "name": m.name,
            "shapes": {m.input: list(m.shape)},
            "fingerprint": fp,
            "sizes": list(self.args.sizes),
        }
        self.say(f"ladder, copies and fingerprint against {'the twin' if self.twin else 'the dock'}")
        try:
            res = run_dock_process(params, self.env)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
            self.add(StepRecord("ladder", False, {"error": str(e)}, str(e)))
            return False
        self.identity = res.get("identity", {})
        rungs = res.get("ladder", [])
        failed = next((r for r in rungs if r["result"] == "fail"), None)
        figures = {f"{r['name']}_ms": round(r["duration_s"] * 1e3, 3) for r in rungs if r["result"] != "skipped"}
        self.add(
            StepRecord(
                "ladder",
                failed is None and bool(rungs),
                figures,
                f"{len(rungs)} rungs passed"
                if failed is None
                else f"{failed['name']} failed: {failed['detail']} ({failed['advice']})",
            )
        )
        for c in res.get("copies", []):
            if "error" in c:
                self.add(StepRecord(f"copy_{c['bytes']}", False, c, c["error"]))
                continue
            slow = min(c["copy_in_mbps"], c["copy_out_mbps"]) < self.args.min_copy_mbps
            ok = c["round_trip_exact"] and not slow
            self.add(
                StepRecord(
                    f"copy_{c['bytes']}",
                    ok,
                    c,
                    f"in {c['copy_in_mbps']:.1f} MB/s, out {c['copy_out_mbps']:.1f} MB/s"
                    + ("" if c["round_trip_exact"] else ", round trip NOT exact")
                    + (f", below {self.args.min_copy_mbps:g} MB/s" if slow else ""),
                )
            )
        f = res.get("fingerprint")
        if f is None:
            self.add(StepRecord("fingerprint", False, {}, "not run: the ladder step failed", ran=False))
        else:
            self.add(
                StepRecord(
                    "fingerprint",
                    bool(f["ok"]),
                    {"bit_exact": f["exact"], "max_mean_diff": f["max_mean_diff"], "seed": f["seed"]},
                    f["detail"],
                )
            )
        return failed is None and f is not None

    def node_steps(self) -> None:
        cfg_path = self.args.out / "node.toml"
        cfg = self.cfg.to_json()
        if not self.cfg.model.ranges_given:  # the defaults' ranges: for a primary that has their outputs only
            cfg["model"].pop("ranges", None)
        write_node_toml(cfg_path, cfg)
        log_path = self.args.out / "node.log"
        h, w = int(self.cfg.model.shape[2]), int(self.cfg.model.shape[3])
        bus = FrameBus(self.prefix, h, w)
        bus.start()
        with open_private(log_path, "ab") as logf:
            node = subprocess.Popen(
                [sys.executable, "-m", "chestnut.launch.cli", "run", "--config", str(cfg_path)],
                env=self.env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        try:
            self.frames_step(bus)
            if self.steps[-1].passed:
                self.fault_steps(bus)
        finally:
            bus.stop_evt.set()
            bus.join(10)
            node.terminate()
            try:
                node.wait(15)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait(5)

    def frames_step(self, bus: FrameBus) -> None:
        t0 = time.monotonic_ns()
        self.say(f"starting the node; {self.args.frames} frames once the primary serves")
        active_at = bus.wait_for(serving_primary(t0), ACTIVE_TIMEOUT_S)
        if active_at is None:
            self.add(
                StepRecord(
                    "frames",
                    False,
                    {"time_to_active_s": -1.0},
                    f"the primary did not serve within {ACTIVE_TIMEOUT_S:g} s (see node.log)",
                )
            )
            return
        with bus.lock:
            first = max(bus.seen.sent) + 1
            host_before = bus.seen.host_late_misses[-1][1] if bus.seen.host_late_misses else 0
        done = bus.wait_for(
            lambda s: (
                len({o[1] for o in s.outputs if o[1] >= first}) >= self.args.frames
                and max(s.sent) >= first + self.args.frames - 1
            ),
            self.args.frames / FRAME_HZ * 3 + 10,
        )
        with bus.lock:
            ids = range(first, first + self.args.frames)
            outs = {o[1]: o for o in bus.seen.outputs if o[1] in ids}
            lat = [o[0] - bus.seen.sent[i] for i, o in outs.items() if i in bus.seen.sent]
            # the frames the node answered from the fallback because its host was late (not the dock's)
            host_late = (bus.seen.host_late_misses[-1][1] if bus.seen.host_late_misses else 0) - host_before
        primary = sum(1 for o in outs.values() if o[2] == "primary")
        with bus.lock:  # the primary must not have failed over during the step
            failed_over = any(t >= active_at and st == "degraded" for t, st in bus.seen.states)
        others = sorted((i, o[3]) for i, o in outs.items() if o[2] != "primary")
        figures = {
            "frames": self.args.frames,
            "answered": len(outs),
            "by_primary": primary,
            "host_late": host_late,
            "time_to_active_s": round((active_at - t0) / 1e9, 3),
            "latency_p50_ms": percentile_ms(lat, 50),
            "latency_p99_ms": percentile_ms(lat, 99),
        }
        with bus.lock:
            self.node_identity = dict(bus.seen.identity)
            self.init_identity = dict(bus.seen.init_identity)
        # every frame answered, the primary serving throughout (no failover), and each frame by the primary but for
        # at most MAX_MISSED_SHARE of single deadline misses (the adaptive deadline answers a slow frame from the
        # fallback: one late frame is a miss, not a fault) and the misses the node blamed on a late host
        missed_ok = len(others) - host_late <= MAX_MISSED_SHARE * self.args.frames
        ok = bool(done) and len(outs) == self.args.frames and not failed_over and missed_ok
        figures["failed_over"] = failed_over
        figures["fallback_frames"] = [{"frame": i, "reason": why} for i, why in others[:20]]
        first_other = f"; first by the fallback: frame {others[0][0]}: {others[0][1]}" if others else ""
        self.add(
            StepRecord(
                "frames",
                ok,
                figures,
                f"{len(outs)}/{self.args.frames} answered, {primary} by the "
                f"primary{f' ({host_late} late host)' if host_late else ''}, p50 {figures['latency_p50_ms']} ms"
                f"{'; the primary failed over' if failed_over else ''}{first_other}",
            )
        )

    def _wait_usb(self, present: bool) -> int | None:
        """(real dock) The monotonic ns when the dock is seen (dis)appear on USB, polled through pyusb."""
        from chestnut.backend.ladder import UsbDock

        dock, deadline = UsbDock(), time.monotonic() + HUMAN_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                seen = bool(dock.find_all())
            except Exception:  # libusb hiccups while a device goes away count as not seen
                seen = False
            if seen == present:
                return time.monotonic_ns()
            time.sleep(0.01)
        return None

    def fault_steps(self, bus: FrameBus) -> None:
        if self.twin:
            t_unplug = time.monotonic_ns()
            self.client.unplug()
        else:
            self.say("UNPLUG the dock's USB cable now")
            t_unplug = self._wait_usb(present=False) or 0
        detected = bus.wait_for(inactive_since(t_unplug), self.args.detect_bound_ms / 1e3 + 5.0) if t_unplug else None
        detect_ms = round((detected - t_unplug) / 1e6, 3) if detected else -1.0
        ok = detected is not None and detect_ms <= self.args.detect_bound_ms
        self.add(
            StepRecord(
                "unplug",
                ok,
                {"detect_ms": detect_ms, "bound_ms": self.args.detect_bound_ms},
                f"detected in {detect_ms:.0f} ms (bound {self.args.detect_bound_ms:g} ms)"
                if detected
                else "the node did not notice the unplugged dock",
            )
        )
        time.sleep(1.0)  # the dock stays away for a second, as a person's replug would
        if self.twin:
            t_plug = time.monotonic_ns()
            self.client.plug()
        else:
            self.say("PLUG the dock back in now")
            t_plug = self._wait_usb(present=True) or 0
        back = bus.wait_for(serving_primary(t_plug), self.args.recover_bound_s) if t_plug else None
        recover_s = round((back - t_plug) / 1e9, 3) if back else -1.0
        self.add(
            StepRecord(
                "replug",
                back is not None,
                {"recover_s": recover_s, "bound_s": self.args.recover_bound_s},
                f"the primary served again {recover_s:.1f} s after the replug"
                if back
                else f"the primary did not serve again within {self.args.recover_bound_s:g} s",
            )
        )


REPORT_FILES = ("report.json", "report.html", "node.log", "node.toml")  # what --out receives


def write_node_toml(path: Path, cfg: dict[str, Any]) -> None:
    """``cfg`` (``NodeConfig.to_json``) as a node TOML file (None values left out: they keep the defaults)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    lines: list[str] = []
    for section, values in cfg.items():
        lines.append(f"[{section}]")
        tables = {k: v for k, v in values.items() if isinstance(v, dict)}
        lines += [f"{k} = {value(v)}" for k, v in values.items() if v is not None and k not in tables]
        for k, sub in tables.items():
            lines.append(f"[{section}.{k}]")
            lines += [f"{json.dumps(kk)} = {value(vv)}" for kk, vv in sub.items()]
        lines.append("")
    write_private(path, "\n".join(lines))


def write_reports(out: Path, report: dict[str, Any]) -> None:
    """``report.json`` and ``report.html`` (every figure, the versions, a verdict per step) into ``out``.

    Both are 0600 and written by temp + rename through ``msgs/outdir.py``, which refuses a symlink in
    their place (:class:`~chestnut.msgs.outdir.OutputDirError`)."""
    write_private(out / "report.json", json.dumps(report, indent=1))
    esc = html.escape
    rows = "".join(
        f"<tr class={s['verdict'].replace(' ', '_')}><td>{esc(s['name'])}</td><td>{s['verdict'].upper()}</td><td>"
        + "<br>".join(f"{esc(k)} = {esc(str(v))}" for k, v in s["figures"].items())
        + f"</td><td>{esc(s['detail'])}</td></tr>"
        for s in report["steps"]
    )
    kv = "".join(
        f"<tr><td>{esc(k)}</td><td>{esc(str(v))}</td></tr>"
        for k, v in {**report["versions"], **report["identity"]}.items()
    )
    verdict = "ACCEPTED" if report["passed"] else "NOT ACCEPTED: " + ", ".join(report["failed_steps"])
    write_private(
        out / "report.html",
        "<!doctype html><meta charset=utf-8><title>chestnut acceptance</title>"
        "<style>td{padding:2px 8px;vertical-align:top}.pass td:nth-child(2){color:green}"
        ".fail td:nth-child(2){color:red}</style>"
        f"<h1>chestnut acceptance ({esc(report['target'])}): {esc(verdict)}</h1>"
        f"<p>model {esc(report['model'])}</p>"
        f"<table><tr><th>step</th><th>verdict</th><th>figures</th><th>detail</th></tr>{rows}</table>"
        f"<h2>versions and identity</h2><table>{kv}</table>\n",
    )


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want bytes per copy, comma-separated") from None
    if not sizes or min(sizes) <= 0 or max(sizes) > 64 << 20:
        raise argparse.ArgumentTypeError(f"{text!r}: each size in 1 .. {64 << 20} bytes")
    return sizes


MAX_FRAMES = 72_000  # --frames: an hour of the kit's FRAME_HZ (20 Hz); 1e17 frames ran until killed


def _frames(text: str) -> int:
    """``--frames``: how many camera frames go through the node, an integer in [1, :data:`MAX_FRAMES`]; raises
    ``argparse.ArgumentTypeError`` (one line) otherwise."""
    return checked_int(text, lambda n: 0 < n <= MAX_FRAMES, f"give a number of frames > 0 and <= {MAX_FRAMES}")


def _min_copy_mbps(text: str) -> float:
    """``--min-copy-mbps``: the slowest acceptable copy, MB/s, finite and > 0 (NaN would fail no copy)."""
    return checked_float(text, lambda mbps: 0 < mbps < math.inf, "give a copy rate in MB/s > 0")


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--twin", action="store_true", help="the twin, unattended, with injected faults")
    target.add_argument("--real", action="store_true", help="a real dock; you are asked to unplug and replug it")
    p.add_argument("--out", type=path_arg, required=True, help="directory for report.json, report.html, node.log")
    p.add_argument("--config", type=path_arg, help="the node's TOML (default: launch/node.toml)")
    p.add_argument("--model", type=path_arg, help="primary model (default: the config's)")
    p.add_argument("--prefix", help="twin runtime prefix (default: a fresh one)")
    p.add_argument(
        "--twin-engine",
        choices=("onnxruntime", "tinygrad"),
        default="onnxruntime",
        help="how the twin's GPU executes programs (default onnxruntime, as chestnut launch: 20 Hz on 2 cores)",
    )
    p.add_argument("--frames", type=_frames, default=100,
                   help=f"frames through the node (1 to {MAX_FRAMES}, default 100)")
    p.add_argument("--sizes", type=_sizes, default=list(DEFAULT_SIZES), help="bytes per copy, comma-separated")
    p.add_argument("--min-copy-mbps", type=_min_copy_mbps, default=1.0,
                   help="slowest acceptable copy, MB/s (> 0, default 1)")
    p.add_argument("--detect-bound-ms", type=positive_ms, default=DETECT_BOUND_MS,
                   help=f"unplug detection bound, ms (> 0, default {DETECT_BOUND_MS:g})")
    p.add_argument("--recover-bound-s", type=positive_seconds, default=RECOVER_BOUND_S,
                   help=f"replug recovery bound, s (> 0, default {RECOVER_BOUND_S:g})")


def run(args: argparse.Namespace) -> int:
    from chestnut.backend.errors import ConfigError

    try:
        kit = Kit(args)
    except ConfigError as e:
        print(f"chestnut acceptance: {e}", file=sys.stderr)
        return 2
    if not kit.cfg.model.path.is_file():
        print(
            f"chestnut acceptance: model {kit.cfg.model.path} does not exist; prepare it with `chestnut model prepare`",
            file=sys.stderr,
        )
        return 2
    try:  # before any step: a refused --out costs nothing
        private_dir(args.out, REPORT_FILES)
    except OutputDirError as e:
        print(f"chestnut acceptance: --out {e}", file=sys.stderr)
        return 2
    return kit.run()

