"""``chestnut launch``: the whole stack under supervisord, for a bounded time or until Ctrl-C.

Programs: the twin of the dock, the logger, the node, the camera source (started once the node
publishes) and the reference control daemon. supervisord (the PyPI ``supervisor`` package) runs
them with restart policies and per-program logs; the configuration is rendered from
``launch/supervisord.conf`` into the run directory ``runs/<UTC time>/``, which also holds the logs
(``logs/``: rlog + MCAP segments) and every program's output.

The stop order (:data:`STOP_ORDER`, :func:`stop_stack`) lets the log hold everything the node
answered: the control daemon leaves first (a consumer that is gone sees no node going silent, so a
stop is never a ``commIssue``), then the camera, then -- once the node has answered the camera's last
frame -- the node, then the logger, after a drain period, and the twin last. supervisord's own
priorities give the same order when it stops the stack by itself (``chestnut launch`` killed).
Every program carries ``CHESTNUT_PREFIX`` and this launch's ``CHESTNUT_LAUNCH_ID`` in its
environment, so whatever survives the stop (supervisord killed, a program that ignores SIGTERM) is
found by those and killed (:func:`kill_stack`); launch is the tree's child subreaper, so it also reaps
them.

While the stack runs, a live status (``chestnut top``'s view) is shown, and faults given with
``--fault KIND@START[+DURATION]`` are injected into the twin at those times (seconds after the node
first answers a frame) and cleared after their duration. At the end the stack is stopped cleanly
and a summary is printed from the recorded log: frames in and out, outputs per source, latencies,
time to the first output and to ``ChestnutActive``, state transitions and faults.

Exit status (:func:`exit_code`): 0 when the run and its contracts are clean, 1 when not, 2 for arguments
refused before anything starts, 130 for a Ctrl-C that cut a timed run (``--seconds N``) short. With
``--seconds 0`` Ctrl-C is the normal end of the run, so it exits 0 or 1 like a timed run that ran out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from chestnut.msgs.outdir import OutputDirError, new_private_dir, private_dir, write_private

log = logging.getLogger("chestnut.launch")

TEMPLATE = Path(__file__).with_name("supervisord.conf")
PROGRAMS = ("twin", "record", "node", "camera", "control")
# consumer first, then the source, the node, the logger, the dock: see the module docstring
STOP_ORDER = ("control", "camera", "node", "record", "twin")
LAUNCH_ID_ENV = "CHESTNUT_LAUNCH_ID"  # set in every program of one launch (with CHESTNUT_PREFIX)
LAST_ANSWER_WAIT_S = 2.0  # after the camera stopped: longest wait for the node's answer to its last frame
LOGGER_DRAIN_S = 0.5  # after the node stopped: the logger's time to take in its last messages (POLL_MS x 5)
ENVIRON_MAX_BYTES = 1 << 20  # bound on one /proc/<pid>/environ read (Linux caps argv + envp near ARG_MAX)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h: orphans of our tree are re-parented to us, not to init
SAMPLE_SETTLE_S = 10.0  # resource figures "at start" are taken this long after the first output
NS = 1_000_000_000


_TEXT_PARAMS = frozenset({"on", "status", "phase"})  # backend/sim/faults.py FaultSpec's text fields


def _param_value(key: str, text: str) -> Any:
    """A ``--fault`` ``key=value``'s value: text for FaultSpec's text fields, else a number when it is one
    (``FaultSpec.validate`` names a value that is not)."""
    if key in _TEXT_PARAMS:
        return text
    try:
        return float(text)
    except ValueError:
        return text


@dataclasses.dataclass
class FaultPlan:
    kind: str
    start_s: float
    duration_s: float | None
    params: dict[str, Any]

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """``KIND@START[+DURATION][,key=value...]``, e.g. ``gpu_hang@20+10`` or ``slow_gpu@5+10,delay_ms=400``.

        The kind and the parameters are checked against the twin's fault table here, at parse time."""
        from chestnut.backend.sim.faults import FaultSpec

        head, *kvs = text.split(",")
        try:
            kind, when = head.split("@", 1)
            start, _, dur = when.partition("+")
            params: dict[str, Any] = {}
            for kv in kvs:
                k, _, v = kv.partition("=")
                params[k.strip()] = _param_value(k.strip(), v.strip())
            plan = cls(kind.strip(), float(start), float(dur) if dur else None, params)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: want KIND@START[+DURATION][,key=value]") from e
        if plan.start_s < 0 or (plan.duration_s is not None and plan.duration_s <= 0):
            raise argparse.ArgumentTypeError(f"{text!r}: START must be >= 0 and DURATION > 0")
        unknown = sorted(set(params) - set(FaultSpec.__dataclass_fields__) - {"kind"})
        if unknown:
            raise argparse.ArgumentTypeError(
                f"{text!r}: unknown parameter(s) {unknown}; known: "
                f"{', '.join(f for f in FaultSpec.__dataclass_fields__ if f != 'kind')}"
            )
        try:
            FaultSpec(plan.kind, **params).validate()
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from e
        return plan


# At the end of a fault's DURATION the fault is cleared and, for faults that leave a state behind like
# hardware does (backend/sim/faults.py KINDS "recovery"), the recovery a person would perform is done.
RECOVERY_ACTIONS: dict[str, str] = {"disconnect": "plug", "brownout": "plug", "wedged": "power_cycle"}


RUN_UMASK = 0o077  # supervisord and every program: logs (camera frames), reports and the pidfile are 0600


def make_run_dir(runs_dir: Path, now: time.struct_time | None = None) -> Path:
    """Create a fresh ``<runs_dir>/<YYYY-mm-dd--HH-MM-SS UTC>/logs`` 0700 (``msgs/outdir.py``
    ``new_private_dir``); returns the run dir. A run never shares a directory: a name already taken by a
    directory of ours (a launch in the same second) gets a ``-2``, ``-3`` ... suffix.

    The logs hold camera frames and the dock's identity, so no other user may read them. Raises
    :class:`~chestnut.msgs.outdir.OutputDirError` (one line) before anything is written for a ``runs_dir``
    that is a symlink, not ours or group/other-writable, and for a symlink or a foreign entry at the run's
    name (never followed)."""
    runs = private_dir(runs_dir).resolve()  # runs_dir itself is no symlink: resolve only names its folders
    run_dir = new_private_dir(runs, time.strftime("%Y-%m-%d--%H-%M-%S", now or time.gmtime()))
    private_dir(run_dir / "logs")
    return run_dir


def render_config(
    run_dir: Path,
    prefix: str,
    rate_hz: float,
    node_args: list[str],
    twin_args: list[str],
    log_format: str = "both",
    foxglove_port: int = 8765,
    camera_args: list[str] | None = None,
) -> Path:
    """Write ``supervisord.conf`` for this run; returns its path. ``camera_args``: ``chestnut camera``'s
    arguments beyond ``--rate`` (:meth:`FrameOptions.camera_args`; none: the camera's defaults)."""
    from chestnut.msgs.paths import runtime_dir

    py = sys.executable
    # supervisord's control socket lives in the stack's private runtime dir: a unix socket path must stay
    # under 108 bytes, which a deep run directory would exceed
    text = TEMPLATE.read_text().format(
        run_dir=run_dir,
        sock_dir=runtime_dir(prefix),
        python=py,
        prefix=prefix,
        rate=rate_hz,
        node_args=" ".join(node_args),
        twin_args=" ".join(twin_args),
        camera_args=" ".join(camera_args or []),
        log_dir=run_dir / "logs",
        log_format=log_format,
        foxglove_port=int(foxglove_port),
        path=os.environ.get("PATH", ""),
    )
    conf = run_dir / "supervisord.conf"
    write_private(conf, text)
    return conf


def summarize(log_dir: Path, t_launch_ns: int) -> dict[str, Any]:
    """Read the run's log and compute the summary figures.

    One clock: every time (``t_s``, transitions, control, soft disables, fault events) is in seconds since
    the log's first message (``t_zero_ns``, its wall-clock time ``wall_start``), as ``chestnut check``
    and the report count; only the two "launch ->" durations count from ``t_launch_ns``."""
    from chestnut.msgs.logfile import LogReader

    try:
        reader = LogReader([log_dir])
    except FileNotFoundError:
        reader = None
    # frames are keyed by (stream, frameId): a restarted camera counts ids from 0 again, a new stream
    cams: dict[tuple[int, int], int] = {}
    outs: dict[tuple[int, int], tuple[str, float, float, int]] = {}
    cam_stream = out_stream = 0
    last_cam_id = last_out_id = -1
    by_source: Counter[str] = Counter()
    transitions: list[tuple[float, str, str]] = []
    first_out_ns = first_active_ns = 0
    last_state = None
    engaged_events: list[tuple[float, str]] = []
    last_engaged = False
    last_soft = False
    episodes: list[list[Any]] = []  # [t_start_s, t_ns, events seen, (t_end_s)]
    episode: list[Any] = []
    t_zero = 0
    wall_start_ns = 0
    fault_events: list[dict[str, Any]] = []
    primary_stages: list[tuple[float, float, float]] = []  # s, per primary-served output that carries them
    for t, service, ev in reader if reader is not None else ():
        if not t_zero:
            t_zero = t
        if service == "initData" and not wall_start_ns:
            wall_start_ns = int(ev.initData.wallTimeNanos) - (t - t_zero)
        if service == "twinFault":
            tf = ev.twinFault
            fault_events.append(
                {
                    "t_s": round((t - t_zero) / NS, 3),
                    "fault": f"{tf.kind}#{tf.id}",
                    "action": str(tf.action),
                    "site": tf.site,
                    "params": tf.params,
                }
            )
        if service == "cameraFrame":
            fid = ev.cameraFrame.frameId
            cam_stream += fid <= last_cam_id
            last_cam_id = fid
            cams[(cam_stream, fid)] = t
        elif service == "modelOutput":
            mo = ev.modelOutput
            out_stream += mo.frameId <= last_out_id
            last_out_id = mo.frameId
            outs[(out_stream, mo.frameId)] = (str(mo.source), mo.executionTime, mo.frameAge, t)
            by_source[str(mo.source)] += 1
            stages = (mo.copyInTime, mo.computeTime, mo.copyOutTime)
            if str(mo.source) == "primary" and any(stages):  # a log from before the stage times has zeros
                primary_stages.append(stages)
            first_out_ns = first_out_ns or t
        elif service == "chestnutActive":
            if ev.chestnutActive.active and not first_active_ns:
                first_active_ns = t
        elif service == "nodeState":
            st = str(ev.nodeState.state)
            if st != last_state:
                transitions.append(((t - t_zero) / NS, st, ev.nodeState.reason))
                last_state = st
        elif service == "controlState":
            soft = bool(ev.controlState.softDisabling)
            events = list(ev.controlState.events)
            if soft and not last_soft:
                episode = [(t - t_zero) / NS, t, events]
                episodes.append(episode)
            elif soft or (last_soft and "disengaged" in events):
                episode[2].extend(e for e in events if e not in episode[2])
            if last_soft and not soft:
                episode.append((t - t_zero) / NS)
            last_soft = soft
            eng = bool(ev.controlState.engaged)
            if eng != last_engaged:
                engaged_events.append(((t - t_zero) / NS, "engaged" if eng else "disengaged: " + episode_cause(events)))
                last_engaged = eng
    soft_episodes = [
        {
            "t_s": round(e[0], 3),
            "duration_s": round(e[3] - e[0], 3) if len(e) > 3 else None,
            "cause": episode_cause(e[2]),
            "disengaged": "disengaged" in e[2],
        }
        for e in episodes
    ]
    soft_disables = Counter(e["cause"] for e in soft_episodes)
    answered = [f for f in cams if f in outs]
    missing = sorted(f for f in cams if f not in outs)
    # frames still in flight when the camera stopped are not missing: only those before the last answered one
    last_out = max(outs, default=(-1, -1))
    missing = [f for f in missing if f < last_out]
    ex = np.array([outs[f][1] for f in answered]) * 1e3 if answered else np.zeros(1)
    age = np.array([outs[f][2] for f in answered]) * 1e3 if answered else np.zeros(1)
    span_s = (max(cams.values()) - min(cams.values())) / NS if len(cams) > 1 else 0.0
    return {
        "t_zero_ns": t_zero,
        "wall_start": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(wall_start_ns / NS)) if wall_start_ns else "",
        "fault_events": fault_events,
        "frames_in": len(cams),
        "outputs": len(outs),
        "missing_outputs": [f"{s}:{i}" if s else i for s, i in missing],
        "by_source": dict(by_source),
        "frame_rate_hz": (len(cams) - 1) / span_s if span_s else 0.0,
        "exec_ms_p50": float(np.percentile(ex, 50)),
        "exec_ms_p99": float(np.percentile(ex, 99)),
        "frame_age_ms_p50": float(np.percentile(age, 50)),
        "frame_age_ms_p99": float(np.percentile(age, 99)),
        "stages_ms": stage_percentiles(primary_stages),
        "first_output_s": (first_out_ns - t_launch_ns) / NS if first_out_ns else None,
        "first_active_s": (first_active_ns - t_launch_ns) / NS if first_active_ns else None,
        "transitions": transitions,
        "control": engaged_events,
        "soft_disables": dict(soft_disables),
        "soft_disable_episodes": soft_episodes,
        "log_damage": [str(d) for d in reader.damage] if reader is not None else [],
    }


def stage_percentiles(stages: list[tuple[float, float, float]]) -> dict[str, list[float]] | None:
    """The primary's stage times (``modelOutput.copyInTime`` / ``computeTime`` / ``copyOutTime``, s) as
    ``{"copy_in": [p50, p99], "compute": [...], "copy_out": [...]}`` in ms, rounded to 0.01 ms; None
    when no primary output carries them (the fallback served throughout, or a log from before them)."""
    if not stages:
        return None
    a = np.array(stages, dtype=np.float64) * 1e3
    return {
        name: [round(float(np.percentile(a[:, i], 50)), 2), round(float(np.percentile(a[:, i], 99)), 2)]
        for i, name in enumerate(("copy_in", "compute", "copy_out"))
    }


OPENPILOT_COPY_MS = 22.0
"""openpilot#38862: the USB copy of one camera frame took ~22 ms of the 50 ms frame on a comma 3X."""


def stage_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary's rows for the primary's stage times (p50 / p99, ms), copy-in beside openpilot#38862's
    figure; one row saying they are absent when the log has none."""
    st = s.get("stages_ms")
    if not st:
        return [("primary stage times", "none in this log")]
    return [
        (
            "primary copy-in p50 / p99",
            f"{st['copy_in'][0]:.1f} / {st['copy_in'][1]:.1f} ms  (openpilot#38862: ~{OPENPILOT_COPY_MS:g} ms)",
        ),
        ("primary compute p50 / p99", f"{st['compute'][0]:.1f} / {st['compute'][1]:.1f} ms"),
        ("primary copy-out p50 / p99", f"{st['copy_out'][0]:.1f} / {st['copy_out'][1]:.1f} ms"),
    ]


NOT_CAUSES = {"disengaged", "engaged", "softDisableCleared"}


def episode_cause(events: list[str]) -> str:
    """A soft-disable episode's cause from the ``controlState.events`` seen during it: the conditions in
    order of appearance, each ``commIssue`` with the checks that failed, e.g.
    ``commIssue (chestnutHealth.freq_ok), chestnutInactive``."""
    conds: dict[str, list[str]] = {}
    for e in events:
        if e in NOT_CAUSES:
            continue
        head, sep, check = e.partition(":")
        checks = conds.setdefault(head, [])
        if sep and check not in checks:
            checks.append(check)
    return ", ".join(f"{c} ({', '.join(ch)})" if ch else c for c, ch in conds.items())


def _params_text(event: dict[str, Any]) -> str:
    if event["action"] != "armed":
        return ""
    return event["params"] if event["params"] not in ("", "{}") else "the kind's defaults"


def print_summary(s: dict[str, Any], run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"chestnut launch: {run_dir}", show_header=False)
    t.add_row("frames in / outputs out", f"{s['frames_in']} / {s['outputs']}  (missing: {len(s['missing_outputs'])})")
    t.add_row("outputs by source", ", ".join(f"{k} {v}" for k, v in sorted(s["by_source"].items())))
    t.add_row("camera rate", f"{s['frame_rate_hz']:.1f} Hz")
    t.add_row("execution time p50 / p99", f"{s['exec_ms_p50']:.1f} / {s['exec_ms_p99']:.1f} ms")
    t.add_row("frame age p50 / p99", f"{s['frame_age_ms_p50']:.1f} / {s['frame_age_ms_p99']:.1f} ms")
    for label, value in stage_rows(s):
        t.add_row(label, value)
    fo, fa = s["first_output_s"], s["first_active_s"]
    t.add_row("launch -> first modelOutput", f"{fo:.1f} s" if fo is not None else "never")
    t.add_row("launch -> ChestnutActive", f"{fa:.1f} s" if fa is not None else "never")
    con.print(t)
    if s.get("wall_start"):
        con.print(f"times: s since the stack's first message, {s['wall_start']}")
    if s.get("fault_schedule") or s.get("fault_events"):
        ft = Table(title="faults (schedule and the twin's fault events)")
        for c in ("t (s)", "fault", "event", "detail"):
            ft.add_column(c)
        rows = [(f["t_s"], "launch", f["fault"], f["action"], f.get("detail", "")) for f in s.get("fault_schedule", [])]
        rows += [
            (e["t_s"], "twin", e["fault"], e["action"], f"hit {e['site']}" if e["site"] else _params_text(e))
            for e in s.get("fault_events", [])
        ]
        for when, who, fault, what, detail in sorted(rows, key=lambda r: r[0]):
            ft.add_row(f"{when:.1f}", fault, f"{what} ({who})", detail)
        con.print(ft)
    if s["transitions"]:
        tr = Table(title="node state transitions")
        for c in ("t (s)", "state", "reason"):
            tr.add_column(c)
        for when, st, why in s["transitions"]:
            tr.add_row(f"{when:.1f}", st, why)
        con.print(tr)
    if s.get("processes"):
        pt = Table(title="processes (CPU: % of one core over the run; RSS: peak; start -> end)")
        for c in ("program", "CPU %", "RSS MB", "RSS MB start -> end", "fds start -> end"):
            pt.add_column(c)
        for name, v in s["processes"].items():
            ends = ("-", "-")
            if "rss_start_mb" in v and "rss_end_mb" in v:
                ends = (f"{v['rss_start_mb']:.1f} -> {v['rss_end_mb']:.1f}", f"{v['fds_start']} -> {v['fds_end']}")
            pt.add_row(name, f"{v['cpu_percent']:.0f}", f"{v['rss_peak_mb']:.0f}", *ends)
        con.print(pt)
    for line in control_lines(s):
        con.print(line)
    if s.get("soft_disables"):
        con.print(
            "control soft-disable episodes: "
            + ", ".join(f"{n} x {why or '?'}" for why, n in s["soft_disables"].items())
        )
    for d in s["log_damage"]:
        con.print(f"[red]log damage:[/red] {d}")
    bad = {k: v for k, v in s.get("contracts", {}).items() if v}
    if s["frames_in"] == 0:
        con.print("[red]no frames were recorded: nothing to check[/red]")
    else:
        con.print(
            f"contracts: {len(s.get('contracts', {}))} checked, "
            + (f"[red]violated: {bad}[/red]" if bad else "[green]no violation[/green]")
            + f"; report: {s.get('report', '-')}"
        )


MAX_RATE_HZ = 100.0
"""``--rate`` upper bound, Hz: five times openpilot's 20 Hz model rate (``msgs/services.py``), a 10 ms
frame period. The stack's figures (deadlines, freq_ok, missing outputs) are about the node, not about
a camera that cannot keep its own grid: far above it the camera only skips ticks (``launch/camerad.py``
``ticks_to_skip``) and every contract fails by construction."""


def argument_problem(
    seconds: float, rate: float, faults: list[FaultPlan], frames: FrameOptions | None = None
) -> str | None:
    """The one line that refuses ``chestnut launch``'s ``--seconds`` (s), ``--rate`` (Hz) and ``--fault``
    plans together, or None when they can run: a fault whose START is at or after the end of a bounded
    run (``seconds > 0``) would never be injected. ``frames``: the camera and twin options
    (:meth:`FrameOptions.problem`)."""
    if frames is not None and (problem := frames.problem()) is not None:
        return problem
    if not (0 <= seconds < math.inf):  # also nan (every comparison false) and inf
        return f"--seconds {seconds:g}: give 0 (until Ctrl-C) or a positive number of seconds"
    if not 0 < rate <= MAX_RATE_HZ:
        return f"--rate {rate:g}: give a camera rate in (0, {MAX_RATE_HZ:g}] Hz (default 20, openpilot's model rate)"
    for f in faults:
        if seconds > 0 and f.start_s >= seconds:
            return (
                f"--fault {f.kind}@{f.start_s:g} starts at or after the end of the run (--seconds {seconds:g}): "
                f"give a START below {seconds:g} or a longer --seconds"
            )
    return None


FRAME_SIZES = ("model", "native")
"""``--frames``: ``model`` -- the camera resizes to the model's input (``[model] shape`` H, W);
``native`` -- the source's own size (``launch/camerad.py`` ``--native``), warped to the model's input by the
primary's program or the node (``--warp``; ``node/preprocess.py`` ``warp:``, ``primary_warp``)."""
SYNTHETIC_NATIVE_HW = (1208, 1928)
"""``--synthetic --frames native``: openpilot's road camera frame, 1928x1208 (H, W; ``launch/camerad.py``
``--synthetic``), 3.5 MB a frame in nv12."""
DOCK_LINK_MBPS = 5600.0
"""``--dock-timing`` link rate, Mbps: the asm2464 firmware's ~700 MB/s ``0xF2`` SRAM DMA
(``docs/protocol.md``, the twin's timing model; ``tests/bench/bench_copy.py`` measures with it)."""
DOCK_LATENCY_US = 125.0
"""``--dock-timing`` per-transfer latency, us: one USB 3 bus interval (``docs/protocol.md``)."""


@dataclasses.dataclass(frozen=True)
class FrameOptions:
    """What ``chestnut launch`` tells the camera (``launch/camerad.py``) and the twin about the frames.

    ``model_hw``: the model input's (H, W) in px, from the node configuration's ``[model] shape``;
    ``preprocess``: its ``[model] preprocess``; ``model_frame``: its ``[model] frame`` (``""``: none);
    ``dock_kind``: its ``[dock] kind``. ``link_mbps`` (Mbps) and ``latency_us`` (us) None: the
    ``--dock-timing`` defaults (:data:`DOCK_LINK_MBPS`, :data:`DOCK_LATENCY_US`). ``native_hw``: the
    source's own (H, W) in px for ``--frames native`` without ``--synthetic`` (``launch/camerad.py``
    ``source_size``). ``warp_on``: ``primary`` -- the primary's program takes the full frame and warps it
    (``[model] frame``, ``node/preprocess.py`` ``primary_warp``), so the full frame crosses the copy path
    every frame; ``node`` -- the node warps and the primary takes the model's input."""

    frames: str = "model"
    synthetic: bool = False
    pixel_format: str = "bgr24"
    transport: str = "auto"
    dock_timing: bool = False
    link_mbps: float | None = None
    latency_us: float | None = None
    model_hw: tuple[int, int] = (128, 256)
    preprocess: str = "ppocr"
    dock_kind: str = "twin"
    warp_on: str = "primary"
    native_hw: tuple[int, int] | None = None
    model_frame: str = ""
    warp_given: bool = False

    def problem(self) -> str | None:
        """The one line that refuses these options together, or None when they can run."""
        if self.warp_given and not self.warp:
            return (
                f"--warp {self.warp_on} chooses where frames that are not the model's input are warped, and these "
                "are (--frames model, --pixel-format bgr24): add --frames native or --pixel-format nv12, or leave "
                "--warp out"
            )
        if not self.dock_timing and (self.link_mbps is not None or self.latency_us is not None):
            given = "--link-mbps" if self.link_mbps is not None else "--latency-us"
            return f"{given} sets the twin's dock-like timing model: add --dock-timing (or leave {given} out)"
        if self.link_mbps is not None and not self.link_mbps > 0:
            return f"--link-mbps {self.link_mbps:g}: give a link rate > 0 Mbps (default {DOCK_LINK_MBPS:g})"
        if self.latency_us is not None and not self.latency_us >= 0:
            return f"--latency-us {self.latency_us:g}: give a latency >= 0 us (default {DOCK_LATENCY_US:g})"
        if self.dock_timing and self.dock_kind != "twin":
            return (
                f"--dock-timing is the twin's timing model, and the node configuration's dock.kind is "
                f'{self.dock_kind!r}: leave --dock-timing out or use a configuration with dock.kind = "twin"'
            )
        if self.warp and self.model_frame and self.model_frame != self.frame_format():
            return (
                f"the node configuration's model.frame = {self.model_frame!r} is not the camera's frames "
                f"({self.frame_format()}): leave model.frame out (chestnut launch sets it) or change --frames / "
                "--pixel-format"
            )
        h, w = self.model_hw
        if self.frames == "model" and self.pixel_format == "nv12" and (h % 2 or w % 2):
            return (
                f"--pixel-format nv12 --frames model: an nv12 frame has an even width and height, the model's "
                f"input is {w}x{h} (WxH); use --frames native or --pixel-format bgr24"
            )
        return None

    @property
    def warp(self) -> bool:
        """The node must warp the frames to the model's input: they are not the model's size or not BGR."""
        return self.frames == "native" or self.pixel_format != "bgr24"

    @property
    def frame_hw(self) -> tuple[int, int]:
        """The camera's frame (H, W) in px: the model's input, the synthetic frame's or the source's own."""
        if self.frames == "model":
            return self.model_hw
        if self.synthetic:
            return SYNTHETIC_NATIVE_HW
        if self.native_hw is None:
            raise ValueError("--frames native: the source's size is not known")
        return self.native_hw

    def frame_format(self) -> str:
        """The camera's frames as ``[model] frame`` names them: ``<encoding>:<W>x<H>`` (``backend/warp.py``
        ``WarpSpec.parse``), e.g. ``nv12:1928x1208``."""
        h, w = self.frame_hw
        return f"{'nv12' if self.pixel_format == 'nv12' else 'bgr888'}:{w}x{h}"

    def camera_args(self) -> list[str]:
        """``chestnut camera``'s arguments beyond ``--rate``."""
        if self.frames == "native":
            size = ["--height", str(SYNTHETIC_NATIVE_HW[0]), "--width", str(SYNTHETIC_NATIVE_HW[1])]
            args = ["--synthetic", *size] if self.synthetic else ["--native"]
        else:
            size = ["--height", str(self.model_hw[0]), "--width", str(self.model_hw[1])]
            args = ["--synthetic", *size] if self.synthetic else size
        return [*args, "--pixel-format", self.pixel_format, "--transport", self.transport]

    def twin_args(self) -> list[str]:
        """``chestnut twin serve``'s timing-model arguments (none without ``--dock-timing``)."""
        if not self.dock_timing:
            return []
        mbps = DOCK_LINK_MBPS if self.link_mbps is None else self.link_mbps
        lat = DOCK_LATENCY_US if self.latency_us is None else self.latency_us
        return ["--link-mbps", f"{mbps:g}", "--latency-us", f"{lat:g}"]

    def node_preprocess(self) -> str:
        """The node's ``[model] preprocess`` for these frames: ``warp:<name>`` when they need the warp."""
        if self.warp and not self.preprocess.startswith("warp:"):
            return "warp:" + self.preprocess
        return self.preprocess

    def node_model_frame(self) -> str:
        """The node's ``[model] frame``: the camera's frame format when the primary warps, else as given."""
        return self.frame_format() if self.warp and self.warp_on == "primary" else self.model_frame

    @property
    def node_config_changes(self) -> dict[str, str]:
        """The ``[model]`` keys this run's node configuration changes (empty: the given one runs as it is)."""
        want = {"preprocess": self.node_preprocess(), "frame": self.node_model_frame()}
        have = {"preprocess": self.preprocess, "frame": self.model_frame}
        return {k: v for k, v in want.items() if v != have[k]}


def read_node_toml(path: Path | None) -> dict[str, Any]:
    """The node TOML ``chestnut launch`` gives the node (``path``, else ``launch/node.toml`` when present) as a
    table; raises :class:`~chestnut.backend.errors.ConfigError` (one line) for one that cannot be read."""
    import tomllib

    from chestnut.backend.errors import ConfigError
    from chestnut.node.config import DEFAULT_CONFIG

    src = path if path is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    if src is None:
        return {}
    try:
        with open(src, "rb") as f:
            return tomllib.loads(f.read(NODE_TOML_MAX_BYTES).decode())
    except OSError as e:
        raise ConfigError("config", f"cannot read {src}: {e}") from e
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("config", f"{src} is not valid TOML: {e}") from e


NODE_TOML_MAX_BYTES = 1 << 20  # bound on reading a node TOML (ours is under 2 KiB)


def frame_options(args: argparse.Namespace, node_toml: dict[str, Any]) -> FrameOptions:
    """:class:`FrameOptions` from ``chestnut launch``'s arguments and the node TOML's table (missing keys:
    ``node/config.py``'s defaults)."""
    from chestnut.node.config import DockConfig, ModelConfig

    model = node_toml.get("model", {}) if isinstance(node_toml.get("model"), dict) else {}
    dock = node_toml.get("dock", {}) if isinstance(node_toml.get("dock"), dict) else {}
    shape = model.get("shape", ModelConfig().shape)
    try:
        hw = (int(shape[2]), int(shape[3]))
    except (TypeError, ValueError, IndexError):
        default = ModelConfig().shape
        hw = (int(default[2]), int(default[3]))  # the node names a malformed shape itself
    native_hw = None
    if args.frames == "native" and not args.synthetic:
        from chestnut.launch.assets import traffic_video_path
        from chestnut.launch.camerad import source_size

        native_hw = source_size(traffic_video_path(), args.pixel_format)
    return FrameOptions(
        frames=args.frames,
        synthetic=args.synthetic,
        pixel_format=args.pixel_format,
        transport=args.transport,
        dock_timing=args.dock_timing,
        link_mbps=args.link_mbps,
        latency_us=args.latency_us,
        model_hw=(int(hw[0]), int(hw[1])),
        preprocess=str(model.get("preprocess", ModelConfig().preprocess)),
        dock_kind=str(dock.get("kind", DockConfig().kind)),
        warp_on=args.warp or "primary",
        native_hw=native_hw,
        model_frame=str(model.get("frame", "")),
        warp_given=args.warp is not None,
    )


MODEL_FILE_MAX_BYTES = 2 << 30  # protobuf's own bound on one message (an ONNX file without external data)


def model_input_problem(path: Path, input_name: str, shape: tuple[int, ...]) -> str | None:
    """The one line that refuses ``[model] shape`` (N, C, H, W) for the model file at ``path`` when its input
    ``input_name`` has other fixed dimensions (the node would fail at every start), else None. A dynamic
    dimension takes any size; a file that is missing or cannot be read is the node's to name. Read with the
    ``onnx`` package (``backend/model.py`` reads the inputs the same way)."""
    try:
        if os.stat(path).st_size > MODEL_FILE_MAX_BYTES:
            return None
        import onnx

        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception:  # missing, unreadable, not ONNX: the node's own load says which
        return None
    for inp in graph.input:
        if inp.name != input_name:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in inp.type.tensor_type.shape.dim]
        if len(dims) != len(shape) or any(d is not None and d != s for d, s in zip(dims, shape, strict=False)):
            have = [d if d is not None else "?" for d in dims]
            return (
                f"model.shape = {list(shape)} does not fit the input {input_name!r} of {path} ({have}): give its "
                "shape, or prepare the model for this one (chestnut model prepare --onnx M --shape N,C,H,W)"
            )
        return None
    return None


def write_frame_node_config(run_dir: Path, node_toml: dict[str, Any], opts: FrameOptions) -> Path:
    """The node configuration of this run when the frames need the warp: ``node_toml`` with the ``[model]``
    keys of :attr:`FrameOptions.node_config_changes` (``preprocess``, ``frame``), written 0600 to
    ``<run dir>/node.toml`` and checked by loading it (``node/config.py`` ``load_config``; raises its
    ``ConfigError``)."""
    from chestnut.launch.acceptance import write_node_toml
    from chestnut.node.config import load_config

    data = {k: dict(v) for k, v in node_toml.items() if isinstance(v, dict)}
    data.setdefault("model", {}).update(opts.node_config_changes)
    path = run_dir / "node.toml"
    write_node_toml(path, data)
    load_config(path)
    return path


def control_lines(s: dict[str, Any]) -> list[str]:
    """The summary's ``control`` lines in time order: each engage / disengage (``s["control"]``) and each
    soft-disable episode (``s["soft_disable_episodes"]``; ``s["stop_s"]`` marks those during the stop).
    Times are s since the log's first message; an engage and an episode at the same time keep that order."""
    rows: list[tuple[float, int, str]] = [(when, 0, what) for when, what in s["control"]]
    for e in s.get("soft_disable_episodes", []):
        dur = f"for {e['duration_s']:.2f} s" if e["duration_s"] is not None else "until the end"
        at_stop = " (during the stop)" if s.get("stop_s") is not None and e["t_s"] >= s["stop_s"] else ""
        then = ", then disengaged" if e["disengaged"] else ""
        rows.append((e["t_s"], 1, f"soft disable {dur}{then}{at_stop}: {e['cause'] or '?'}"))
    return [f"control {when:6.1f} s  {what}" for when, _, what in sorted(rows, key=lambda r: (r[0], r[1]))]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="run this long after the first output (0 = until Ctrl-C, which then ends the run normally: exit 0 "
        "when it and its contracts are clean, 1 when not; a Ctrl-C that cuts a timed run short exits 130)",
    )
    p.add_argument("--rate", type=float, default=20.0, help=f"camera rate, Hz (default 20, at most {MAX_RATE_HZ:g})")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where run directories go (default ./runs)")
    p.add_argument(
        "--fault",
        type=FaultPlan.parse,
        action="append",
        default=[],
        help="inject KIND@START[+DURATION][,key=value]: START s after the node's first output; after "
        "DURATION s the fault is cleared (a pulled cable is plugged back, a wedged bridge power-cycled); "
        "kinds: `chestnut twin kinds`; repeatable",
    )
    p.add_argument(
        "--twin-engine",
        choices=("onnxruntime", "tinygrad"),
        default="onnxruntime",
        help="how the twin's GPU executes programs (default onnxruntime: real time on 2 cores)",
    )
    p.add_argument("--node-config", type=Path, help="node TOML (default: launch/node.toml)")
    p.add_argument(
        "--frames",
        choices=FRAME_SIZES,
        default="model",
        help="model (default): the camera resizes to the model's input; native: the source's own size (the "
        "traffic video's 704x576, --synthetic's 1928x1208), warped to the model's input (--warp)",
    )
    p.add_argument(
        "--synthetic", action="store_true", help="the camera's moving test pattern instead of the traffic video"
    )
    p.add_argument(
        "--pixel-format",
        choices=("bgr24", "nv12"),
        default="bgr24",
        help="the camera's frames: bgr24 (default) or nv12 (YUV 4:2:0, openpilot's cameras; the node warps them)",
    )
    p.add_argument(
        "--transport",
        choices=("auto", "shm", "inline"),
        default="auto",
        help="how frames reach the node: shm (the camera's shared-memory ring, only metadata on the bus), inline "
        "(pixels in the message); auto (default): shm for frames over 256 KiB (every native frame), else inline",
    )
    p.add_argument(
        "--warp",
        choices=("primary", "node"),
        default=None,
        help="where frames that are not the model's input are warped to it: primary (default; its program takes "
        "the full frame, which crosses the copy path every frame: [model] frame) or node (the node's CPU warp; "
        "the primary takes the model's input); the fallback always warps on the CPU; only with --frames native "
        "or --pixel-format nv12",
    )
    p.add_argument(
        "--dock-timing",
        action="store_true",
        help=f"the twin's dock-like timing model: each USB transfer takes --latency-us plus its bytes at "
        f"--link-mbps (defaults {DOCK_LINK_MBPS:g} Mbps, {DOCK_LATENCY_US:g} us: docs/protocol.md)",
    )
    p.add_argument("--link-mbps", type=float, help=f"with --dock-timing: link rate, Mbps (default {DOCK_LINK_MBPS:g})")
    p.add_argument(
        "--latency-us", type=float, help=f"with --dock-timing: per-transfer latency, us (default {DOCK_LATENCY_US:g})"
    )
    p.add_argument("--no-live", action="store_true", help="no live status view")
    p.add_argument(
        "--log-format",
        choices=("both", "zst", "mcap"),
        default="both",
        help="log segment format(s): both (default, ~300 MB/min at 20 Hz), zst (openpilot rlog) or mcap",
    )
    p.add_argument("--json", type=Path, help="also write the summary as JSON here")
    p.add_argument(
        "--foxglove",
        type=int,
        nargs="?",
        const=8765,
        default=None,
        metavar="PORT",
        help="also serve the stack to Foxglove on ws://127.0.0.1:PORT (default port 8765; chestnut foxglove)",
    )


def _wait_for(view: Any, service: str, deadline_s: float, conf: Path | None = None) -> bool:
    """Wait until ``service`` is seen; with ``conf``, give up early once supervisord has given up on the node
    or the node exits at every start (:func:`node_exits`, from ``supervisord.log`` beside ``conf``)."""
    t_end = time.monotonic() + deadline_s
    next_status = time.monotonic() + 2.0
    while time.monotonic() < t_end:
        view.update(100)
        if view.sm.seen[service]:
            return True
        if conf is not None and time.monotonic() >= next_status:
            next_status = time.monotonic() + 2.0
            if program_state(conf, "node") in ("FATAL", "EXITED", "BACKOFF"):
                return False
            if node_exits(read_tail(conf.parent / "supervisord.log")) >= CRASH_LOOP_EXITS:
                return False
    return False


CRASH_LOOP_EXITS = 2
"""A node that has exited unexpectedly this often before it answered a frame exits at every start (its
configuration or model cannot run): ``chestnut launch`` stops waiting and names the cause."""
LOG_TAIL_BYTES = 64 * 1024  # bound on reading the end of a program's log


def read_tail(path: Path, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last ``max_bytes`` of ``path`` as text ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - max_bytes))
            return f.read(max_bytes).decode(errors="replace")
    except OSError:
        return ""


def node_exits(supervisord_log: str) -> int:
    """How often the node exited unexpectedly, from supervisord's log (its ``exited: node (exit status N; not
    expected)`` lines, supervisor's ``process.py`` wording)."""
    return sum(1 for line in supervisord_log.splitlines() if "exited: node (" in line and "not expected" in line)


def last_error_line(node_log: str) -> str:
    """The node log's last ERROR / CRITICAL line (else its last state change to ``stopping``, else its last
    line), without the timestamp: what made the node exit."""
    lines = [ln.strip() for ln in node_log.splitlines() if ln.strip()]
    for marks in ((" ERROR ", " CRITICAL "), (" -> stopping",)):
        for ln in reversed(lines):
            if any(m in ln for m in marks):
                return ln.split(" ", 2)[2] if ln[:4].isdigit() and ln.count(" ") >= 2 else ln
    return lines[-1] if lines else "(node.log is empty)"


def program_state(conf: Path, name: str) -> str:
    """supervisord's state of one program (RUNNING, STARTING, BACKOFF, FATAL, EXITED ...), or "UNKNOWN"."""
    exe = str(Path(sys.executable).parent / "supervisorctl")
    try:
        out = subprocess.run([exe, "-c", str(conf), "status", name], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "UNKNOWN"
    parts = out.split()
    return parts[1] if len(parts) > 1 else "UNKNOWN"


def running_stack(prefix: str) -> str | None:
    """What of a stack already answers on ``prefix`` (the twin's or supervisord's socket), else None."""
    import socket as _socket

    from chestnut.msgs.paths import runtime_dir

    for name in ("supervisor.sock", "twin.sock"):
        path = runtime_dir(prefix) / name
        if not path.exists():
            continue
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            s.connect(str(path))
            return f"{path} answers"
        except OSError:
            continue
        finally:
            s.close()
    return None


def _die_with_parent() -> None:
    """In supervisord's child: PR_SET_PDEATHSIG(SIGTERM), so a killed ``chestnut launch`` stops its stack."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def supervisorctl(conf: Path, *args: str, timeout_s: float = 30.0) -> int:
    """Run ``supervisorctl -c conf ARGS``; returns its exit code (-1 when it could not run or timed out)."""
    exe = str(Path(sys.executable).parent / "supervisorctl")
    try:
        return subprocess.run(
            [exe, "-c", str(conf), *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=timeout_s
        ).returncode
    except (OSError, subprocess.SubprocessError):
        return -1


def _become_subreaper() -> bool:
    """``prctl(PR_SET_CHILD_SUBREAPER)``: the stack's orphans (a killed supervisord's programs) become our
    children, so :func:`kill_stack` can reap them. False where the kernel refuses."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def environ_matches(environ: bytes, want: dict[str, str]) -> bool:
    """True when the NUL-separated ``KEY=VALUE`` block ``environ`` (``/proc/<pid>/environ``) holds every
    ``want`` pair exactly."""
    found = {}
    for entry in environ.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep:
            found[key] = value
    return all(found.get(k.encode()) == v.encode() for k, v in want.items())


def stack_pids(prefix: str, launch_id: str | None = None, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Pids of this user's processes whose environment has ``CHESTNUT_PREFIX=prefix`` (and, given,
    ``CHESTNUT_LAUNCH_ID=launch_id``), read from ``/proc/<pid>/environ`` (at most
    :data:`ENVIRON_MAX_BYTES` each). Other users' processes, zombies and processes gone meanwhile are
    skipped; ``exclude`` and this process never count."""
    want = {"CHESTNUT_PREFIX": prefix, **({LAUNCH_ID_ENV: launch_id} if launch_id is not None else {})}
    uid, me = os.getuid(), os.getpid()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in exclude or int(entry.name) == me:
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            fd = os.open(f"/proc/{entry.name}/environ", os.O_RDONLY | os.O_NOFOLLOW)
            try:
                data = os.read(fd, ENVIRON_MAX_BYTES)
            finally:
                os.close(fd)
        except OSError:  # gone, or not ours to read
            continue
        if data and environ_matches(data, want):
            out.append(int(entry.name))
    return sorted(out)


def kill_stack(prefix: str, launch_id: str, term_wait_s: float = 3.0, kill_wait_s: float = 5.0) -> list[int]:
    """End every process of this launch (:func:`stack_pids`): SIGTERM, then after ``term_wait_s`` (s) SIGKILL
    for what is left, until none is left or ``kill_wait_s`` more passed; reaps those that are our children
    (we are the subreaper). Returns the pids found (empty after a clean stop)."""
    found: list[int] = []
    t_kill = time.monotonic() + term_wait_s
    t_end = t_kill + kill_wait_s
    sig = signal.SIGTERM
    while True:
        _reap(found)
        pids = stack_pids(prefix, launch_id)
        now = time.monotonic()
        if not pids or now >= t_end:
            return found
        if sig == signal.SIGTERM and now >= t_kill:
            sig = signal.SIGKILL
        for pid in pids:
            if pid not in found:
                found.append(pid)
            elif sig == signal.SIGTERM:
                continue  # asked once already
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        time.sleep(0.05)


def _reap(pids: list[int]) -> None:
    """Collect those of ``pids`` that are our exited children (orphans re-parented to us), without blocking;
    other children of this process are left to their owners."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def stop_stack(conf: Path, view: Any) -> list[str]:
    """Stop the programs one at a time in :data:`STOP_ORDER` through supervisorctl, waiting between the
    camera and the node for the node's answer to the camera's last frame (at most
    :data:`LAST_ANSWER_WAIT_S`), and between the node and the logger :data:`LOGGER_DRAIN_S`. ``view``:
    a :class:`~chestnut.launch.top.StackView` that still subscribes. Returns notes on what did not go
    as planned (empty when all went well)."""
    notes: list[str] = []
    for name in STOP_ORDER:
        rc = supervisorctl(conf, "stop", name)
        if rc != 0:
            notes.append(f"supervisorctl stop {name}: exit {rc}")
        if name == "camera":
            if not wait_last_answer(view, LAST_ANSWER_WAIT_S):
                notes.append(f"the node did not answer the camera's last frame within {LAST_ANSWER_WAIT_S:g} s")
        elif name == "node":
            time.sleep(LOGGER_DRAIN_S)
    return notes


def wait_last_answer(view: Any, timeout_s: float) -> bool:
    """After the camera stopped: wait until ``view`` saw a ``modelOutput`` for the newest ``cameraFrame`` it
    saw (or a later one). True at once when no frame was ever seen."""
    t_end = time.monotonic() + timeout_s
    view.update(0)
    sm = view.sm
    while True:
        if not sm.seen["cameraFrame"]:
            return True
        if sm.seen["modelOutput"] and int(sm["modelOutput"].frameId) >= int(sm["cameraFrame"].frameId):
            return True
        if time.monotonic() >= t_end:
            return False
        view.update(50)


def run(args: argparse.Namespace) -> int:
    from rich.live import Live

    from chestnut.backend.errors import ChestnutError, ConfigError
    from chestnut.backend.sim.client import TwinClient
    from chestnut.launch.assets import default_model_path
    from chestnut.launch.signals import StopFlag
    from chestnut.launch.top import StackView
    from chestnut.msgs.paths import current_prefix

    try:
        node_toml = read_node_toml(args.node_config)
    except ConfigError as e:
        log.error("--node-config: %s", e.detail or e)
        return 2
    try:
        frames = frame_options(args, node_toml)
    except (ChestnutError, FileNotFoundError, ValueError) as e:  # the camera's source cannot be read
        log.error("--frames native: %s", e)
        return 2
    if (problem := argument_problem(args.seconds, args.rate, args.fault, frames)) is not None:
        log.error("%s", problem)
        return 2
    if args.node_config is not None:  # the node's own config check, before anything starts (or it is rewritten)
        from chestnut.node.config import load_config

        try:
            node_cfg = load_config(args.node_config)
        except ConfigError as e:
            log.error("--node-config: %s", e.detail or e)
            return 2
        model = node_cfg.model
        if (problem := model_input_problem(model.path, model.input, model.shape)) is not None:
            log.error("--node-config: %s", problem)
            return 2
    if args.json and (problem := json_target_problem(args.json)) is not None:
        log.error("--json: %s", problem)
        return 2
    if shutil.which("supervisord", path=str(Path(sys.executable).parent)) is None:
        log.error("supervisord not found next to %s; run `bash launch/setup.sh`", sys.executable)
        return 2
    if args.node_config is None and not default_model_path().is_file():
        log.error("the default model is not prepared: run `chestnut model prepare` (part of launch/setup.sh)")
        return 2
    prefix = current_prefix()
    if (other := running_stack(prefix)) is not None:
        log.error(
            "a stack is already running on prefix %r (%s); stop it first, or choose another prefix with "
            "CHESTNUT_PREFIX=NAME",
            prefix,
            other,
        )
        return 2
    try:
        run_dir = make_run_dir(args.runs_dir)
    except OutputDirError as e:
        log.error("--runs-dir: %s", e)
        return 2
    node_args = ["--config", str(args.node_config.resolve())] if args.node_config else []
    if frames.node_config_changes:  # the frames need the warp: this run's own node config
        try:
            node_conf = write_frame_node_config(run_dir, node_toml, frames)
        except ConfigError as e:
            log.error("--node-config: %s", e.detail or e)
            return 2
        node_args = ["--config", str(node_conf)]
        log.info(
            "node: %s for %s %s frames (%s)",
            ", ".join(f"model.{k} = {v!r}" for k, v in frames.node_config_changes.items()),
            frames.frames,
            frames.frame_format(),
            node_conf,
        )
    conf = render_config(
        run_dir,
        prefix,
        args.rate,
        node_args,
        ["--engine", args.twin_engine, *frames.twin_args()],
        args.log_format,
        foxglove_port=args.foxglove if args.foxglove is not None else 8765,
        camera_args=frames.camera_args(),
    )
    supervisord = str(Path(sys.executable).parent / "supervisord")
    launch_id = f"{os.getpid()}-{run_dir.name}"
    _become_subreaper()
    t_launch = time.monotonic_ns()
    proc = subprocess.Popen(
        [supervisord, "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent,
        umask=RUN_UMASK,  # supervisord runs in the foreground (nodaemon), so its own umask setting never applies
        env=dict(os.environ, CHESTNUT_PREFIX=prefix, **{LAUNCH_ID_ENV: launch_id}),
    )
    log.info("stack launched under supervisord pid %d (run dir %s)", proc.pid, run_dir)
    flag = StopFlag()
    view = StackView()
    sampler = ProcessSampler(proc.pid)
    next_sample = 0.0
    injected: list[tuple[FaultPlan, int | None]] = []
    # what was done to the twin: (CLOCK_MONOTONIC ns, action, fault, detail); put on the log's clock at the end
    schedule: list[tuple[int, str, str, str]] = []
    clock = StackClock(run_dir / "logs", t_launch)
    died = False  # supervisord ended by itself (killed): the run failed whatever the log says
    failed_start = False  # the stack never came up: the run failed whatever the log says
    try:
        if not _wait_for(view, "nodeState", 120.0, conf):
            tail = read_tail(run_dir / "node.log", 1500)
            log.error("the node did not come up; last lines of %s:\n%s", run_dir / "node.log", tail)
            flag.stop = failed_start = True
        elif (cam_rc := supervisorctl(conf, "start", "camera")) != 0:
            log.error("supervisorctl start camera: exit %d; see %s", cam_rc, run_dir / "camera.log")
            flag.stop = failed_start = True
        elif not _wait_for(view, "modelOutput", 60.0, conf):
            if (exits := node_exits(read_tail(run_dir / "supervisord.log"))) >= CRASH_LOOP_EXITS:
                log.error(
                    "the node exits at every start (%d exits before its first output; %s); its last error: %s",
                    exits,
                    run_dir / "supervisord.log",
                    last_error_line(read_tail(run_dir / "node.log")),
                )
            else:
                log.error("no modelOutput within 60 s of starting the camera; see %s", run_dir)
            flag.stop = failed_start = True
        if failed_start and (code := proc.poll()) is not None:
            died = True
            log.error("supervisord exited (code %s) while the stack started; see %s", code, run_dir / "supervisord.log")
        if args.foxglove is not None and not flag.stop:  # before t0: starting it takes a second
            if supervisorctl(conf, "start", "foxglove") == 0:
                log.info("Foxglove: ws://127.0.0.1:%d (layout launch/foxglove-layout.json)", args.foxglove)
            else:
                log.error("the Foxglove server did not start; see %s", run_dir / "foxglove.log")
        t0 = time.monotonic()
        sampler.start_mark = t0 + SAMPLE_SETTLE_S
        pending = sorted(args.fault, key=lambda f: f.start_s)
        log.info("clock: times are s since the stack's first message, %s", clock.wall_start())
        t0_clock = clock.seconds(int(t0 * NS))
        for f in pending:
            log.info(
                "fault schedule: %s%s at %.1f s%s",
                f.kind,
                f" {f.params}" if f.params else "",
                t0_clock + f.start_s,
                f", cleared at {t0_clock + f.start_s + f.duration_s:.1f} s" if f.duration_s is not None else "",
            )
        with Live(view.render(), refresh_per_second=4, transient=False) if not args.no_live else _Null() as live:
            next_draw = 0.0
            while not flag.stop and (args.seconds <= 0 or time.monotonic() - t0 < args.seconds) and proc.poll() is None:
                view.update(50)
                el = time.monotonic() - t0
                while pending and el >= pending[0].start_s:
                    f = pending.pop(0)
                    try:
                        with TwinClient(prefix) as tc:
                            info = tc.fault(f.kind, **f.params)
                        injected.append((f, info.get("id") if isinstance(info, dict) else None))
                        now = time.monotonic_ns()
                        schedule.append((now, "inject", f.kind, json.dumps(f.params) if f.params else ""))
                        log.info(
                            "t=%.1f s: injected %s%s", clock.seconds(now), f.kind, f" {f.params}" if f.params else ""
                        )
                    except Exception as e:  # the twin refuses a bad fault: say so, keep running
                        log.error("could not inject %s: %s", f.kind, e)
                for f, fid in list(injected):
                    if f.duration_s is not None and el >= f.start_s + f.duration_s:
                        action = RECOVERY_ACTIONS.get(f.kind)
                        injected.remove((f, fid))
                        try:
                            with TwinClient(prefix) as tc:
                                tc.clear(fid)
                                if action == "plug" and not tc.status()["usb"]["present"]:
                                    tc.plug()
                                elif action == "power_cycle":
                                    tc.power_cycle(0)
                        except Exception as e:  # a twin that restarted lost its faults: say so, keep running
                            log.error("t=%.1f s: could not clear %s: %s", clock.seconds(time.monotonic_ns()), f.kind, e)
                            continue
                        now = time.monotonic_ns()
                        schedule.append((now, "clear", f.kind, f"then {action}" if action else ""))
                        log.info(
                            "t=%.1f s: cleared %s%s", clock.seconds(now), f.kind, f" and did {action}" if action else ""
                        )
                if time.monotonic() >= next_sample:
                    sampler.sample()
                    next_sample = time.monotonic() + 1.0
                if time.monotonic() >= next_draw:
                    live.update(view.render())
                    next_draw = time.monotonic() + 0.25
        end_live_line(live)
        if (code := proc.poll()) is not None and not flag.stop:
            died = True
            log.error(
                "supervisord exited (code %s) before the end of the run; see %s", code, run_dir / "supervisord.log"
            )
    finally:
        t_stop = time.monotonic_ns()
        log.info("stopping the stack")
        if proc.poll() is None:
            for note in stop_stack(conf, view):
                log.warning("stop: %s", note)
        view.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if killed := kill_stack(prefix, launch_id):
            log.warning("killed %d process(es) of the stack left after supervisord: %s", len(killed), killed)
    summary = summarize(run_dir / "logs", t_launch)
    t_zero = summary["t_zero_ns"] or t_launch
    summary["stop_s"] = (t_stop - t_zero) / NS
    summary["fault_schedule"] = [
        {"t_s": round((t_ns - t_zero) / NS, 3), "action": action, "fault": fault, "detail": detail}
        for t_ns, action, fault, detail in schedule
    ]
    write_private(run_dir / "faults.json", json.dumps(summary["fault_schedule"], indent=1))
    summary["processes"] = sampler.report()
    summary["contracts"], summary["report"] = check_contracts(
        run_dir, summary["fault_schedule"], summary.get("wall_start") or None, list_violations=not failed_start
    )
    print_summary(summary, run_dir)
    json_lost = False  # the summary asked for could not be written: the run's caller cannot read its verdict
    if args.json and (problem := write_summary_json(args.json, summary)) is not None:
        log.error("--json: %s", problem)
        json_lost = True
    # which frames were owed an output is the contract check's call (one_output_per_frame): a node restarted
    # under supervision owes nothing for the frames sent while none ran, which missing_outputs still lists
    ok = summary["outputs"] > 0 and bool(summary["contracts"]) and not any(summary["contracts"].values())
    ok = ok and not died and not failed_start and not json_lost
    return exit_code(ok, args.seconds, flag.signum == signal.SIGINT)


def exit_code(ok: bool, seconds: float, interrupted: bool) -> int:
    """``chestnut launch``'s exit status: ``ok`` -- the run and its contracts were clean; ``seconds`` -- the
    ``--seconds`` asked (0: until Ctrl-C); ``interrupted`` -- it ended on Ctrl-C (SIGINT). 130 (128 + SIGINT,
    the shell's convention) only for a timed run cut short; with ``seconds == 0`` Ctrl-C is the normal end."""
    if interrupted and seconds > 0:
        return 130
    return 0 if ok else 1


def json_target_problem(path: Path) -> str | None:
    """Why the summary cannot be written to ``path`` (checked before the run, so a run is never lost to a
    typo), or None: its folder must exist and ``path`` must not be a symlink or a folder."""
    if not path.parent.is_dir():
        return f"{path}: folder {path.parent} does not exist; create it or give another path"
    if path.is_symlink():
        return f"{path} is a symlink: remove it (rm {path}) or give another path"
    if path.exists() and not path.is_file():
        return f"{path} exists and is not a regular file; give another path"
    return None


def write_summary_json(path: Path, summary: dict[str, Any]) -> str | None:
    """Write the run's summary to ``path`` as JSON, mode 0600 (it names the dock and the run dir), by a
    temporary file beside it and a rename, so an existing file's mode is not kept and a symlink is never
    followed. Returns the problem in one line, or None."""
    if (problem := json_target_problem(path)) is not None:
        return problem
    import tempfile

    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # O_EXCL, 0600
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(summary, indent=1))
        os.replace(tmp, path)  # a planted symlink at path is replaced, never followed; an old file's mode goes
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return f"{path}: cannot be written ({e.strerror})"
    return None


def check_contracts(
    run_dir: Path,
    fault_schedule: list[dict[str, Any]] | None = None,
    wall_start: str | None = None,
    list_violations: bool = True,
) -> tuple[dict[str, int], str]:
    """``chestnut check`` over the run's log, with its report in ``<run dir>/report`` (with the fault
    schedule, times in s since the log's first message, and a link to the logs). ``list_violations``
    False (a stack that never came up, whose start was already named): the violations go to the report
    only, not one line each."""
    from chestnut.node.offline.contracts import check_log
    from chestnut.node.offline.report import write_report

    try:
        res = check_log([run_dir / "logs"])
    except FileNotFoundError as e:
        log.error("no log to check: %s", e)
        return {}, ""
    for v in res.violations[:20] if list_violations else []:
        log.error("contract %s violated at frame %s: %s", v.contract, v.frame_id, v.message)
    page = write_report(
        run_dir / "report",
        res.timeline,
        violations=res.violations,
        title=f"chestnut {run_dir.name}",
        fault_schedule=fault_schedule,
        logs=run_dir / "logs",
        wall_start=wall_start,
    )
    return res.counts(), str(page)


def end_live_line(live: Any) -> None:
    """End the live view's last frame with a newline: off a terminal, rich's ``Live`` leaves its final frame
    without one, and the next output would continue that line."""
    console = getattr(live, "console", None)
    if console is not None and not console.is_terminal:
        console.line()


class StackClock:
    """The run's one clock: seconds since the stack's first message, the first message of its log (the
    logger's ``initData`` of segment 0, flushed when the segment opens). Until the log has one, the
    launch time stands in."""

    def __init__(self, log_dir: Path, t_launch_ns: int) -> None:
        self.log_dir = log_dir
        self.t_zero_ns = t_launch_ns
        self.wall_ns = time.time_ns()
        self.found = False

    def _find(self) -> None:
        if self.found:
            return
        from chestnut.msgs.logfile import SegmentFileReader, find_log_files

        try:
            first = find_log_files(self.log_dir)[0]
            item = next(iter(SegmentFileReader(first)), None)
        except (FileNotFoundError, ValueError, OSError):
            return
        if item is not None and item[1] == "initData":
            self.t_zero_ns, self.wall_ns, self.found = item[0], int(item[3].initData.wallTimeNanos), True

    def seconds(self, t_ns: int) -> float:
        """``t_ns`` (CLOCK_MONOTONIC) on the run's clock."""
        self._find()
        return (t_ns - self.t_zero_ns) / NS

    def wall_start(self) -> str:
        self._find()
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.wall_ns / NS))


class ProcessSampler:
    """CPU (% of one core, averaged over the run), resident memory (MB: peak, and at start and end) and open
    file descriptors (at start and end) of each stack program, and how many processes it had.

    Programs are supervisord's children, named by their ``chestnut`` subcommand; a program's own
    children (the node's worker) are counted under ``<name>/child``. "Start" is the first sample at or
    after :attr:`start_mark` (a ``time.monotonic()`` time; default: the first sample), "end" the last."""

    NAMES = {"twin": "twin", "record": "record", "control": "control", "run": "node", "camera": "camera"}

    def __init__(self, supervisord_pid: int) -> None:
        import psutil

        self.psutil = psutil
        self.root = psutil.Process(supervisord_pid)
        self.cpu_start: dict[int, tuple[str, float, float]] = {}
        self.cpu_last: dict[int, float] = {}
        self.rss_peak_mb: dict[str, float] = {}
        self.seconds: dict[str, float] = {}
        self.start_mark = 0.0
        # label -> (rss MB, open fds, processes), summed over the label's processes in one sample
        self.first: dict[str, tuple[float, int, int]] = {}
        self.last: dict[str, tuple[float, int, int]] = {}

    def _name(self, proc: Any) -> str | None:
        try:
            cmd = proc.cmdline()
        except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
            return None
        if "chestnut.launch.cli" in cmd:
            i = cmd.index("chestnut.launch.cli")
            return self.NAMES.get(cmd[i + 1]) if i + 1 < len(cmd) else None
        return None

    def sample(self) -> None:
        try:
            kids = self.root.children()
        except self.psutil.NoSuchProcess:
            return
        now = time.monotonic()
        agg: dict[str, tuple[float, int, int]] = {}
        for k in kids:
            name = self._name(k)
            if name is None:
                continue
            try:
                tree = [(k, name)] + [(c, f"{name}/child") for c in k.children(recursive=True)]
            except self.psutil.NoSuchProcess:
                continue
            for p, label in tree:
                try:
                    t = p.cpu_times()
                    cpu = t.user + t.system
                    rss = p.memory_info().rss / 1e6
                    fds = p.num_fds()
                except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
                    continue
                if p.pid not in self.cpu_start:
                    self.cpu_start[p.pid] = (label, now, cpu)
                self.cpu_last[p.pid] = cpu
                self.seconds[str(p.pid)] = now
                self.rss_peak_mb[label] = max(self.rss_peak_mb.get(label, 0.0), rss)
                r0, f0, n0 = agg.get(label, (0.0, 0, 0))
                agg[label] = (r0 + rss, f0 + fds, n0 + 1)
        if now >= self.start_mark:
            for label, v in agg.items():
                self.first.setdefault(label, v)
        self.last = agg if agg else self.last

    def report(self) -> dict[str, dict[str, float]]:
        cpu: dict[str, float] = {}
        span: dict[str, float] = {}
        for pid, (label, t0, c0) in self.cpu_start.items():
            cpu[label] = cpu.get(label, 0.0) + self.cpu_last[pid] - c0
            span[label] = max(span.get(label, 0.0), self.seconds[str(pid)] - t0)
        out: dict[str, dict[str, float]] = {}
        for label in sorted(cpu):
            row = {
                "cpu_percent": 100 * cpu[label] / span[label] if span.get(label) else 0.0,
                "rss_peak_mb": self.rss_peak_mb[label],
            }
            for when, table in (("start", self.first), ("end", self.last)):
                if label in table:
                    rss, fds, n = table[label]
                    row |= {f"rss_{when}_mb": rss, f"fds_{when}": fds, f"processes_{when}": n}
            out[label] = row
        return out


class _Null:
    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, *_a: object) -> None:
        return None
