"""``chestnut launch``'s summary of a run, from its recorded log: the figures (:func:`summarize`), their
printing (:func:`print_summary`; the main table's rows come from :func:`summary_rows`), the summary as
JSON (:func:`write_summary_json`), the contract check and its report (:func:`check_contracts`), and the
run's one clock (:class:`StackClock`).

One clock: every time in the summary is in seconds since the log's first message (``t=``); the first output's
and first ``ChestnutActive``'s also say, in words, how long after the stack was started they came."""

from __future__ import annotations

import json
import logging
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from chestnut.launch.signals import SIGNAL_NAMES

log = logging.getLogger("chestnut.launch")

NS = 1_000_000_000


def summarize(log_dir: Path, t_launch_ns: int) -> dict[str, Any]:
    """Read the run's log and compute the summary figures.

    One clock: every time (``t_s``, transitions, control, soft disables, fault events) is in seconds since
    the log's first message (``t_zero_ns``, its wall-clock time ``wall_start``), as ``chestnut check``
    and the report count, ``first_output_t_s`` and ``first_active_t_s`` included; only ``first_output_s`` and
    ``first_active_s``, the same two moments since the stack was started (before its first message), count from
    ``t_launch_ns``.

    ``fault_events``: each ``twinFault`` (``msgs/chestnut.capnp``) as ``{"t_s", "fault": "<kind>#<id>", "action"
    (armed | fired | spent | cleared | expired, as the fault table says), "site", "params", "fired" (times fired
    so far), "spent"}``: a fault used up by firing (a one-shot, most kinds' default: ``spent_on_expiry``) ends
    ``spent`` (``spent`` true, false for every other event), a ``for_s`` that ended unfired ``expired``. The
    launch adds ``fault_schedule`` (``launch/faultplan.py`` ``FaultRunner.schedule_rows``): :func:`fault_rows`."""
    from chestnut.backend.sim.faults import spent_on_expiry
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
    drop_perc: list[float] = []  # modelOutput.frameDropPerc, %, in log order
    deadlines: list[float] = []  # modelOutput.deadline, ms, of frames the primary was asked (docs/health.md)
    t_last = 0
    for t, service, ev in reader if reader is not None else ():
        if not t_zero:
            t_zero = t
        t_last = max(t_last, t)
        if service == "initData" and not wall_start_ns:
            wall_start_ns = int(ev.initData.wallTimeNanos) - (t - t_zero)
        if service == "twinFault":
            tf = ev.twinFault
            spent = str(tf.action) == "expired" and spent_on_expiry(tf.kind, tf.params, int(tf.fired))
            fault_events.append(
                {
                    "t_s": round((t - t_zero) / NS, 3),
                    "fault": f"{tf.kind}#{tf.id}",
                    "action": "spent" if spent else str(tf.action),
                    "site": tf.site,
                    "params": tf.params,
                    "fired": int(tf.fired),
                    "spent": spent,
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
            drop_perc.append(float(mo.frameDropPerc))
            if mo.deadline > 0:  # the primary's deadline in force for this frame; 0: not asked, or an older log
                deadlines.append(float(mo.deadline) * 1e3)
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
    # (with no output at all, every frame is: nothing answered them)
    if outs:
        last_out = max(outs)
        missing = [f for f in missing if f < last_out]
    ex = np.array([outs[f][1] for f in answered]) * 1e3 if answered else np.zeros(1)
    age = np.array([outs[f][2] for f in answered]) * 1e3 if answered else np.zeros(1)
    span_s = (max(cams.values()) - min(cams.values())) / NS if len(cams) > 1 else 0.0
    return {
        "t_zero_ns": t_zero,
        "log_end_s": (t_last - t_zero) / NS if t_last else None,  # the log's last message
        "wall_start": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(wall_start_ns / NS)) if wall_start_ns else "",
        "wall_start_ns": wall_start_ns,  # Unix ns of the log's first message (0: no initData)
        "fault_events": fault_events,
        "frames_in": len(cams),
        "outputs": len(outs),
        "missing_outputs": [f"{s}:{i}" if s else i for s, i in missing],
        "outputs_without_frame": sum(1 for f in outs if f not in cams),  # the log lost their frames: no miss
        "by_source": dict(by_source),
        "frame_rate_hz": (len(cams) - 1) / span_s if span_s else 0.0,
        # the node's measure (node/framedrop.py, openpilot modeld's filtered one): at the end, and its largest
        "frame_drop_perc": round(drop_perc[-1], 2) if drop_perc else None,
        "frame_drop_perc_max": round(max(drop_perc), 2) if drop_perc else None,
        "exec_ms_p50": float(np.percentile(ex, 50)),
        "exec_ms_p99": float(np.percentile(ex, 99)),
        "frame_age_ms_p50": float(np.percentile(age, 50)),
        "frame_age_ms_p99": float(np.percentile(age, 99)),
        "stages_ms": stage_percentiles(primary_stages),
        # the primary's adaptive deadline: in force at the end, and its range over the run (ms)
        "deadline_ms": round(deadlines[-1], 1) if deadlines else None,
        "deadline_ms_range": [round(min(deadlines), 1), round(max(deadlines), 1)] if deadlines else None,
        "first_output_s": (first_out_ns - t_launch_ns) / NS if first_out_ns else None,  # since the stack was started
        "first_active_s": (first_active_ns - t_launch_ns) / NS if first_active_ns else None,
        "first_output_t_s": round((first_out_ns - t_zero) / NS, 3) if first_out_ns else None,  # on the stack's clock
        "first_active_t_s": round((first_active_ns - t_zero) / NS, 3) if first_active_ns else None,
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


def _spent_text(kind: str) -> str:
    """A spent fault's detail: a one-shot fires once; a latching kind's state stays until its recovery
    (``backend/sim/faults.py`` ``KINDS``), however long the launch's DURATION."""
    from chestnut.backend.sim.faults import KINDS

    info = KINDS.get(kind)
    left = f"; the state it latched stays until {info.recovery}" if info is not None and info.latching else ""
    return f"a one-shot: fired once and fires no more{left}"


def _expired_text(event: dict[str, Any]) -> str:
    try:
        for_s = json.loads(event["params"] or "{}").get("for_s")
    except (ValueError, AttributeError):
        for_s = None
    return f"its --for {for_s:g} s ended" if isinstance(for_s, int | float) else ""


def _clear_text(step: dict[str, Any], ends: dict[int, tuple[float, str]]) -> str:
    """A launch clear's detail: what the twin removed (``removed``), and when a fault gone already went
    (``ends``: fault id -> (t s, "spent" | "expired")), then the recovery done (``detail``)."""
    then = step.get("detail", "")
    removed = step.get("removed")
    if removed is None:  # a summary from before the launch recorded it
        return then
    if removed:
        what = "removed from the twin"
    else:
        end = ends.get(step["id"]) if step.get("id") is not None else None
        gone = f" ({step['fault']}#{step['id']} {end[1]} at {end[0]:.1f} s)" if end is not None else ""
        what = f"nothing left in the twin to remove{gone}"
    return f"{what}; {then}" if then else what


def fault_rows(s: dict[str, Any]) -> list[tuple[float, str, str, str]]:
    """The summary's fault table, in time order: (t s, fault, event, detail) for each step of the launch's schedule
    (``s["fault_schedule"]``) and each twin fault event (``s["fault_events"]``; a repeating fault's fires: one row),
    named ``<kind>#<id>`` as the twin names it. A one-shot's end reads ``spent`` (spent as it fires, the launch's
    clear finds nothing left), one at the end of ``for_s`` ``expired``; the launch's rows first at a tie."""
    from chestnut.backend.sim.faults import collapse_fired

    events = collapse_fired(s.get("fault_events", []))
    ends: dict[int, tuple[float, str]] = {}
    for e in events:
        if e["action"] in ("spent", "expired", "cleared"):
            fid = int(str(e["fault"]).rpartition("#")[2])
            ends.setdefault(fid, (e["t_s"], e["action"]))
    rows: list[tuple[float, str, str, str]] = []
    for f in s.get("fault_schedule", []):
        name = f"{f['fault']}#{f['id']}" if f.get("id") is not None else f["fault"]
        detail = _clear_text(f, ends) if f["action"] == "clear" else f.get("detail", "")
        rows.append((f["t_s"], name, f"{f['action']} (launch)", detail))
    for e in events:
        kind = str(e["fault"]).rpartition("#")[0]
        if e["action"] == "fired":
            what, detail = "fired", f"hit {e['site']}" if e["site"] else ""
        elif e["action"] == "spent":
            what, detail = "spent", _spent_text(kind)
        elif e["action"] == "expired":
            what, detail = "expired", _expired_text(e)
        else:
            what, detail = e["action"], _params_text(e)
        rows.append((e["t_s"], e["fault"], f"{what} (twin)", detail))
    return sorted(rows, key=lambda r: r[0])


def _drop_text(s: dict[str, Any]) -> str:
    if s.get("frame_drop_perc") is None:
        return "no modelOutput"
    return f"{s['frame_drop_perc']:.1f} / {s['frame_drop_perc_max']:.1f} %  (modelOutput.frameDropPerc)"


def soft_disable_lines(s: dict[str, Any]) -> list[str]:
    """The soft-disable tally: one line with the number of episodes, then one per cause (its conditions as
    :func:`episode_cause` names them), most frequent first; none without an episode."""
    tally = s.get("soft_disables") or {}
    if not tally:
        return []
    n = sum(tally.values())
    lines = [f"control soft-disable episodes: {n}"]
    for cause, k in sorted(tally.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"  {k} x {cause or 'cause not recorded'}")
    return lines


def summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary's main table as (label, value) rows, in print order; a new figure is one more row here."""
    fo, fa, n = s["first_output_s"], s["first_active_s"], s["outputs_without_frame"]
    gaps = f"{len(s['missing_outputs'])}" + (f"; {n} for frames not in the log" if n else "")
    return [
        ("frames in / outputs out", f"{s['frames_in']} / {s['outputs']}  (missing: {gaps})"),
        ("outputs by source", ", ".join(f"{k} {v}" for k, v in sorted(s["by_source"].items()))),
        ("camera rate", f"{s['frame_rate_hz']:.1f} Hz"),
        ("frame drop at the end / max", _drop_text(s)),
        ("execution time p50 / p99", f"{s['exec_ms_p50']:.1f} / {s['exec_ms_p99']:.1f} ms"),
        ("frame age p50 / p99", f"{s['frame_age_ms_p50']:.1f} / {s['frame_age_ms_p99']:.1f} ms"),
        *stage_rows(s),
        ("primary deadline (range)", _deadline_text(s)),
        ("first modelOutput", _first_text(s.get("first_output_t_s"), fo)),
        ("first ChestnutActive true", _first_text(s.get("first_active_t_s"), fa)),
    ]


def _first_text(t_s: float | None, since_start_s: float | None) -> str:
    """A first moment on the stack's clock (``t=``, as every table here) and, in words, since the stack started."""
    after = f"{since_start_s:.1f} s after the stack was started" if since_start_s is not None else "never"
    return after if t_s is None or since_start_s is None else f"t={t_s:.1f} s  ({after})"


def stop_figures(s: dict[str, Any], t_launch_ns: int, t_stop_ns: int, flag: Any, seconds: float) -> dict[str, Any]:
    """The summary's figures about the run's end: ``stop_s`` (when the stop began) and ``cut_short``, None unless
    a stop signal (``flag``: :class:`~chestnut.launch.signals.StopFlag`) cut a timed run (``seconds`` > 0) short,
    the runs that exit 130 or 143: then ``signal`` (its name), ``t_s`` (when it came), ``run_s`` (s of the
    planned ``--seconds`` run, counted from the first output; None when no output came first), ``planned_s`` and
    ``in_stop`` (it came only once the stop had begun: the run had ended; it still sets the exit status).
    Times are s since the stack's first message (``t_s`` < 0: the signal came before it); ``s``: ``summarize``'s."""
    t_zero = s.get("t_zero_ns") or t_launch_ns
    signum = getattr(flag, "signum", None)
    cut = None
    if signum is not None and seconds > 0:
        t_ns = getattr(flag, "t_ns", None) or t_stop_ns
        first = s.get("first_output_s")
        ran = None if first is None or t_ns < t_launch_ns + first * NS else (t_ns - t_launch_ns) / NS - first
        cut = {"signal": signal.Signals(signum).name, "t_s": round((t_ns - t_zero) / NS, 3),
               "run_s": None if ran is None else round(ran, 3), "planned_s": seconds, "in_stop": t_ns > t_stop_ns}
    return {"stop_s": (t_stop_ns - t_zero) / NS, "cut_short": cut}


def cut_short_line(c: dict[str, Any]) -> str:
    """The line for a run a stop signal cut short (:func:`stop_figures`): before the first message (t = 0), said so."""
    sig = signal.Signals[c["signal"]]
    name = SIGNAL_NAMES.get(sig, sig.name)
    early = c["t_s"] < 0
    when = "before the stack's first message" if early else f"at t={c['t_s'] + 0.0:.1f} s"  # + 0.0: never "-0.0"
    if c.get("in_stop"):
        return f"{name} {when}, while the stack stopped after the run had ended (exit {128 + sig})"
    if c["run_s"] is None:
        into = f"{'' if early else 'before the first output, '}so none of the planned {c['planned_s']:g} s ran" + (
            " (all the log holds came while the stack stopped)" if early else "")
    elif c["run_s"] < c["planned_s"]:
        into = f"{c['run_s']:.1f} s into the planned {c['planned_s']:g} s"
    else:  # past --seconds: the run went on until its fault plan was carried out
        into = f"{c['run_s']:.1f} s after the first output, past the planned {c['planned_s']:g} s, before its " \
               "fault plan was carried out"
    return f"run cut short by {name} {when}, {into} (exit {128 + sig})"


def _deadline_text(s: dict[str, Any]) -> str:
    """The primary's deadline in force at the end of the run, then its range over it (docs/health.md "Adaptive
    deadline"); "primary never asked" when no output carried one."""
    if s.get("deadline_ms") is None:
        return "primary never asked"
    lo, hi = s["deadline_ms_range"]
    return f"{s['deadline_ms']:.1f} ms  ({lo:.1f} .. {hi:.1f} ms)"


def print_summary(s: dict[str, Any], run_dir: Path) -> None:
    """Print the summary ``s`` (:func:`summarize` plus what ``chestnut launch`` adds) of the run in ``run_dir``:
    the main table (:func:`summary_rows`), then the faults, state transitions, processes, control lines,
    log damage, a stop signal that cut the run short (:func:`cut_short_line`) and the contracts' verdict."""
    from rich.table import Table

    from chestnut.node.offline.fleet_cli import stdout_console
    con = stdout_console()  # a reader gone (`| head`): exit 141, as every chestnut command, not rich's silent 1
    t = Table(title=f"chestnut launch: {run_dir}", show_header=False)
    for label, value in summary_rows(s):
        t.add_row(label, value)
    con.print(t)
    if s.get("wall_start"):
        con.print(f"times: s since the stack's first message, {s['wall_start']}")
    if s.get("fault_schedule") or s.get("fault_events"):
        ft = Table(title="faults (schedule and the twin's fault events)")
        for c in ("t (s)", "fault", "event", "detail"):
            ft.add_column(c)
        for when, fault, what, detail in fault_rows(s):
            ft.add_row(f"{when:.1f}", fault, what, detail)
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
    for line in soft_disable_lines(s):
        con.print(line)
    from chestnut.launch.restarts import restart_lines

    for line in restart_lines(s.get("restarts", [])):  # each program or worker restarted: when, why, what it cost
        con.print(line, style="yellow", markup=False, highlight=False, soft_wrap=True)
    if line := log_coverage_line(s):  # the log ended long before the stack: the figures are of its part only
        con.print(line, style="red", markup=False, highlight=False, soft_wrap=True)
    for d in s["log_damage"]:
        con.print(f"[red]log damage:[/red] {d}")
    for line in s.get("programs_not_started", {}).values():  # one line each, never wrapped, no markup read in it
        con.print(line, style="red", markup=False, highlight=False, soft_wrap=True)
    if s.get("cut_short"):  # a stop signal ended a timed run early: the figures are of part of it
        con.print(cut_short_line(s["cut_short"]), style="yellow", markup=False, highlight=False, soft_wrap=True)
    bad = {k: v for k, v in s.get("contracts", {}).items() if v}
    if s["frames_in"] == 0:
        con.print("[red]no frames were recorded: nothing to check[/red]")
    else:
        con.print(
            f"contracts: {len(s.get('contracts', {}))} checked, "
            + (f"[red]violated: {bad}[/red]" if bad else "[green]no violation[/green]")
            + f"; report: {s.get('report') or '-'}"
        )
    for line in s.get("outputs_lost", []):  # a run file a write failed for (a full disk): the run is not clean
        con.print(f"not written: {line}", style="red", markup=False, highlight=False, soft_wrap=True)


LOG_GAP_S = 2.0  # s the log may end before the stop (our choice: the recorder flushes each second, stops last)


def log_coverage_line(s: dict[str, Any]) -> str:
    """``the log ends at t=2.4 s, 19.1 s before the stack stopped (t=21.5 s): ...`` when the log's last message
    came more than :data:`LOG_GAP_S` before the stop (a full disk, a recorder down); "" otherwise."""
    end, stop = s.get("log_end_s"), s.get("stop_s")
    if end is None or stop is None or stop - end <= LOG_GAP_S:
        return ""
    why = f"; record: {s['recorder_words']}" if s.get("recorder_words") else ""
    return (f"the log ends at t={end:.1f} s, {stop - end:.1f} s before the stack stopped (t={stop:.1f} s): the "
            f"figures above are of the logged part only{why}")


def control_lines(s: dict[str, Any]) -> list[str]:
    """The summary's ``control`` lines in time order: each engage / disengage (``s["control"]``) and each
    soft-disable episode (``s["soft_disable_episodes"]``; ``s["stop_s"]`` marks those during the stop), or that
    control never engaged. Times: s since the log's first message; an engage and an episode at once keep that order."""
    rows: list[tuple[float, int, str]] = [(when, 0, what) for when, what in s["control"]]
    for e in s.get("soft_disable_episodes", []):
        dur = f"for {e['duration_s']:.2f} s" if e["duration_s"] is not None else "until the end"
        at_stop = " (during the stop)" if s.get("stop_s") is not None and e["t_s"] >= s["stop_s"] else ""
        then = ", then disengaged" if e["disengaged"] else ""
        rows.append((e["t_s"], 1, f"soft disable {dur}{then}{at_stop}: {e['cause'] or '?'}"))
    never = [] if s["control"] else ["control never engaged during the run (control.log says what it waited for)"]
    return never + [f"control {when:6.1f} s  {what}" for when, _, what in sorted(rows, key=lambda r: (r[0], r[1]))]


def json_target_problem(path: Path) -> str | None:
    """Why the summary cannot be written to ``path`` (checked before the run, so a run is never lost to a
    typo), or None: its folder must exist (it is not created) and be one of ours that no one else can write to,
    not a symlink (a world-writable folder such as ``/tmp`` would let another user swap the file), and ``path``
    must not be a symlink or a folder: ``msgs/outdir.py`` ``file_target_problem``, the rule of every file named
    on a command line."""
    from chestnut.msgs.outdir import file_target_problem

    return file_target_problem(path)


def write_summary_json(path: Path, summary: dict[str, Any]) -> str | None:
    """Write the run's summary to ``path`` as JSON, mode 0600 (it names the dock and the run dir), by a
    temporary file beside it and a rename through the folder's descriptor (``msgs/outdir.py``
    ``write_private``), so an existing file's mode is not kept and neither a symlink at ``path`` nor a folder
    swapped for one since the check is followed. Returns the problem in one line
    (:func:`json_target_problem`, or the write's), or None."""
    from chestnut.msgs.outdir import OutputDirError, write_private

    if (problem := json_target_problem(path)) is not None:
        return problem
    try:
        write_private(path, json.dumps(summary, indent=1))
    except OutputDirError as e:
        return str(e)
    return None


def write_run_file(path: Path, text: str) -> list[str]:
    """Write one of the run's own files (``faults.json``) by temp file and rename (``msgs/outdir.py``
    ``write_private``). Returns the lines of what could not be written (the start of the summary's
    ``outputs_lost``: the run is not clean): a write that fails (a full disk) is one ERROR line naming the
    file, and what follows is still written."""
    from chestnut.msgs.outdir import write_private

    try:
        write_private(path, text)
    except OSError as e:  # OutputDirError (one line) for a write that fails
        log.error("%s", e)
        return [str(e)]
    return []


def check_contracts(
    run_dir: Path,
    fault_schedule: list[dict[str, Any]] | None = None,
    wall_start: str | None = None,
    list_violations: bool = True,
    lost: list[str] | None = None,
) -> tuple[dict[str, int], str]:
    """``chestnut check`` over the run's log, with its report in ``<run dir>/report`` (with the fault
    schedule, times in s since the log's first message, and a link to the logs). ``list_violations``
    False (a stack that never came up, whose start was already named): the violations go to the report
    only, not one line each. A report that cannot be written (a full disk) is one ERROR line naming the file,
    also added to ``lost`` (the summary's ``outputs_lost``); the counts are still returned, with no report ("")."""
    from chestnut.node.offline.contracts import check_log
    from chestnut.node.offline.report import write_report

    try:
        res = check_log([run_dir / "logs"])
    except FileNotFoundError as e:
        log.error("no log to check: %s", e)
        return {}, ""
    for v in res.violations[:20] if list_violations else []:
        log.error("contract %s violated at frame %s: %s", v.contract, v.frame_id, v.message)
    try:
        page = write_report(run_dir / "report", res.timeline, violations=res.violations,
                            title=f"chestnut {run_dir.name}", fault_schedule=fault_schedule, logs=run_dir / "logs",
                            wall_start=wall_start)
    except OSError as e:  # OutputDirError (one line) for a write that fails
        log.error("report: %s", e)
        (lost if lost is not None else []).append(f"report: {e}")
        return res.counts(), ""
    return res.counts(), str(page)


class StackClock:
    """The run's one clock: seconds since the stack's first message, the first message of its log (the
    logger's ``initData`` of segment 0, flushed when the segment opens). Until the log has one, the
    launch time stands in."""

    def __init__(self, log_dir: Path, t_launch_ns: int) -> None:
        self.log_dir, self.t_zero_ns, self.wall_ns, self.found = log_dir, t_launch_ns, time.time_ns(), False

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
        """The first message's wall-clock time; ``none yet (launched <time>)`` while the log holds none."""
        self._find()
        wall = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.wall_ns / NS))
        return wall if self.found else f"none yet (launched {wall})"
