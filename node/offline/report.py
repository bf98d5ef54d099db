"""``--report DIR``: plots and one self-contained HTML page for a checked or replayed log.

Written by :func:`write_report` (matplotlib, Agg backend, no display needed):

- ``timeline.png``: one shared time axis (s since the log's first message), top to bottom: per-frame
  latency (``executionTime`` and ``frameAge``, ms, coloured by the serving source, with the configured
  deadline and the deadline in force per frame);
  the serving source, ``ChestnutActive`` and the control daemon's engagement; each health layer's level
  (OK / WARN / STALE / ERROR, ROS 2 colours); the node's state with its transitions, the twin's faults
  (a bar from inject to clear -- ``chestnut launch``'s schedule, else the ``twinFault`` events from armed to
  cleared or expired -- with a tick at arming, a star at every firing and a bold tick at the clear) and
  the violations and log damage as markers; frame drops (``frameDropPerc``) and deadline misses.
- ``agreement.png``: primary-vs-fallback ``maxAbsDiff`` where both ran (hot standby, shadow frames),
  against the node's agreement tolerance; after a replay, each frame's replayed-vs-logged difference.
  A log axis cannot draw an exact 0: identical frames are counted on the panel and in the caption
  (:func:`describe_diffs`), never drawn as a made-up small value.
- ``latency.png``: the latency distributions per source; below them the primary's copy-in, compute and
  copy-out per frame (``copyInTime``, ``computeTime``, ``copyOutTime``, ms) with each stage's budget
  (``node/health.py`` ``StageBudget``) and openpilot#38862's ~22 ms copy; the page's "stage times"
  table gives their p50 / p99 / max per source.
- ``index.html``: the clock (t = 0 is the log's first message, its wall-clock time once) and a link to
  the logs, a summary table, the images (embedded as base64 PNG, so the page is one file), "what
  happened" (every node state change with its reason, ChestnutActive change, soft-disable episode
  with the events seen during it, and fault event with what it hit), each fault from inject to clear
  with its clear time (:func:`fault_intervals`), every node, worker and twin restart with its cause and
  the frames it cost, the inputs' anomalies (not the node's faults), the fault schedule ``chestnut launch`` ran, the
  violations and, after a replay, the model identities and the mismatches. A panel with nothing to draw
  (the agreement plot when every frame was identical, or none was compared) is a sentence instead.

``DIR`` and every file in it go through ``msgs/outdir.py``: a new ``DIR`` is made 0700, an existing
one must be ours and not group/other-writable, files are 0600 and written by temp + rename, and a
``DIR`` that is a symlink or holds a symlink in place of one of the files is refused
(:class:`~chestnut.msgs.outdir.OutputDirError`, one line) before anything is written.
"""

from __future__ import annotations

import base64
import html
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from chestnut.msgs.outdir import private_dir, write_private
from chestnut.node.offline.contracts import CONTRACTS
from chestnut.node.offline.timeline import (
    LAYER_NAMES,
    OutputRec,
    Timeline,
    Violation,
    damage_count,
    damaged_files,
)

if TYPE_CHECKING:
    from chestnut.node.offline.replay import ReplayResult

LEVEL_COLORS = {"ok": "#2ca02c", "warn": "#f2b701", "stale": "#9e9e9e", "error": "#d62728"}
SOURCE_COLORS = {"primary": "#1f77b4", "fallback": "#ff7f0e", "none": "#9e9e9e"}
STATE_COLORS = {"starting": "#c7c7c7", "qualifying": "#aec7e8", "loading": "#9edae5", "active": "#2ca02c",
                "degraded": "#ff7f0e", "recovering": "#9467bd", "stopping": "#7f7f7f"}
DPI = 110
LATENCY_FLOOR_MS = 0.1  # latencies plotted on a log axis; smaller ones (e.g. 0 for a bad frame) sit here
LEGEND_ROWS = 6  # entries of a one-column legend; more go in two columns
MAX_LABELLED_FAULTS = 12  # violations named on the timeline; more would overlap (the table lists them all)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _spans(times: Sequence[float], values: Sequence[str], end: float) -> dict[str, list[tuple[float, float]]]:
    """(start, width) spans per value of a step signal that holds each value until the next sample."""
    out: dict[str, list[tuple[float, float]]] = {}
    i, n = 0, len(times)
    while i < n:
        j = i
        while j + 1 < n and values[j + 1] == values[i]:  # one span per run of equal samples
            j += 1
        t0, t1 = times[i], times[j + 1] if j + 1 < n else end
        if t1 > t0:
            out.setdefault(values[i], []).append((t0, t1 - t0))
        i = j + 1
    return out


def _band(ax: Any, row: float, spans: dict[str, list[tuple[float, float]]], colors: dict[str, str]) -> None:
    for value, segs in spans.items():
        ax.broken_barh(segs, (row - 0.4, 0.8), facecolors=colors.get(value, "#444444"), linewidth=0)


def _legend(ax: Any, handles: Any = None, labels: Any = None) -> None:
    """A legend right of the panel, clear of its data and of its title (``fig.tight_layout`` leaves room for
    it inside the figure); two columns when it has more than :data:`LEGEND_ROWS` entries."""
    args = () if handles is None else (handles, labels)
    n = len(labels) if labels is not None else len(ax.get_legend_handles_labels()[1])
    ax.legend(*args, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, ncol=1 if n <= LEGEND_ROWS else 2,
              frameon=False, borderaxespad=0.0, handletextpad=0.4, columnspacing=1.0)


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this log", transform=ax.transAxes, ha="center", va="center", color="#777777")


def _save_png(fig: Any, path: Path) -> None:
    """``fig`` as a PNG at ``path`` through ``msgs/outdir.py`` (0600, temp + rename, no symlink followed)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    write_private(path, buf.getvalue())


def plot_timeline(tl: Timeline, violations: Sequence[Violation], path: Path,
                  fault_schedule: Sequence[dict[str, Any]] | None = None) -> None:
    """The five-panel timeline (see the module docstring); ``fault_schedule``: ``chestnut launch``'s steps, so
    each fault is drawn from its injection to its clear."""
    plt = _plt()
    sec = tl.seconds
    end = max(sec(tl.end_ns), 1e-3)
    fig, axes = plt.subplots(5, 1, figsize=(12, 11), sharex=True,
                             gridspec_kw={"height_ratios": [3, 1.4, 1.8, 1.4, 1.6]})
    ax_lat, ax_src, ax_health, ax_state, ax_drop = axes

    # latency
    deadline_ms = float(tl.node_config().get("timing", {}).get("deadline_ms", 150.0)) if tl.node_config() else 150.0
    if tl.outputs:
        for src, color in SOURCE_COLORS.items():
            outs = [o for o in tl.outputs if o.source == src]
            if not outs:
                continue
            t = [sec(o.t_ns) for o in outs]
            ax_lat.scatter(t, [max(o.frame_age_s * 1e3, LATENCY_FLOOR_MS) for o in outs], s=9, color=color,
                           label=f"frameAge ({src})")
            ax_lat.scatter(t, [max(o.execution_time_s * 1e3, LATENCY_FLOOR_MS) for o in outs], s=9, color=color,
                           marker="x", alpha=0.6, label=f"executionTime ({src})")
        asked = [o for o in tl.outputs if o.deadline_s > 0]  # the primary's deadline in force, per frame
        ceiling = "deadline ceiling" if asked else "deadline"  # with a deadline per frame, this line is its ceiling
        ax_lat.axhline(deadline_ms, color="#d62728", linestyle="--", linewidth=1, label=f"{ceiling} {deadline_ms:g} ms")
        if asked:
            ax_lat.step([sec(o.t_ns) for o in asked], [o.deadline_s * 1e3 for o in asked], where="post",
                        color="#d62728", linewidth=1, alpha=0.7, label="deadline in force (modelOutput.deadline)")
        _legend(ax_lat)
        ax_lat.set_yscale("log")
        lows = [max(v * 1e3, LATENCY_FLOOR_MS) for o in tl.outputs for v in (o.frame_age_s, o.execution_time_s)]
        ax_lat.set_ylim(bottom=max(LATENCY_FLOOR_MS * 0.8, 0.5 * min(lows, default=LATENCY_FLOOR_MS)))
    else:
        _no_data(ax_lat, "modelOutput")
    ax_lat.set_ylabel("latency (ms)")
    ax_lat.set_title("per-frame latency by serving source", loc="left", fontsize=10)
    ax_lat.grid(True, alpha=0.3)

    # serving source, ChestnutActive, control
    rows = []
    if tl.outputs:
        _band(ax_src, 2, _spans([sec(o.t_ns) for o in tl.outputs], [o.source for o in tl.outputs], end), SOURCE_COLORS)
    rows.append("source")
    if tl.actives:
        _band(ax_src, 1, _spans([sec(a.t_ns) for a in tl.actives], ["on" if a.active else "off" for a in tl.actives],
                                end), {"on": "#2ca02c", "off": "#e0e0e0"})
    rows.append("ChestnutActive")
    if tl.controls:
        _band(ax_src, 0, _spans([sec(c.t_ns) for c in tl.controls],
                                ["soft" if c.engaged and c.soft_disabling else ("on" if c.engaged else "off")
                                 for c in tl.controls], end), {"on": "#2ca02c", "soft": "#f2b701", "off": "#e0e0e0"})
    rows.append("control engaged")
    ax_src.set_yticks([2, 1, 0], rows)
    ax_src.set_ylim(-0.6, 2.6)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (SOURCE_COLORS["primary"], SOURCE_COLORS["fallback"],
                                                               "#2ca02c", "#f2b701")]
    _legend(ax_src, handles, ["primary", "fallback", "active / engaged", "soft-disabling"])
    ax_src.set_title("serving source, ChestnutActive, control daemon", loc="left", fontsize=10)

    # health layers
    if tl.healths:
        times = [sec(h.t_ns) for h in tl.healths]
        for row, layer in enumerate(reversed(LAYER_NAMES)):
            levels = [(rec.level if (rec := h.layer(layer)) is not None else "stale") for h in tl.healths]
            _band(ax_health, row, _spans(times, levels, end), LEVEL_COLORS)
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in LEVEL_COLORS.values()]
        _legend(ax_health, handles, [k.upper() for k in LEVEL_COLORS])
    else:
        _no_data(ax_health, "chestnutHealth")
    ax_health.set_yticks(range(len(LAYER_NAMES)), list(reversed(LAYER_NAMES)))
    ax_health.set_ylim(-0.6, len(LAYER_NAMES) - 0.4)
    ax_health.set_title("health layers", loc="left", fontsize=10)

    # node state, transitions, faults
    if tl.node_states:
        times = [sec(s.t_ns) for s in tl.node_states]
        _band(ax_state, 1, _spans(times, [s.state for s in tl.node_states], end), STATE_COLORS)
        for state, segs in _spans(times, [s.state for s in tl.node_states], end).items():
            for t0, width in segs:
                if width > 0.05 * end:  # name the spans wide enough to hold their name
                    ax_state.text(t0 + width / 2, 1, state, ha="center", va="center", fontsize=8, color="white",
                                  fontweight="bold")
        prev = None
        for s in tl.node_states:
            if prev is not None and s.state != prev:
                ax_state.axvline(sec(s.t_ns), color="#555555", linewidth=0.6, alpha=0.6)
            prev = s.state
    for v in violations:
        ax_state.plot([sec(v.t_ns)], [0], marker="v", color="#d62728", markersize=7)
        if len(violations) <= MAX_LABELLED_FAULTS:
            ax_state.annotate(f"{v.contract}\nframe {v.frame_id}", (sec(v.t_ns), -0.2), fontsize=6, ha="center",
                              va="top", color="#d62728")
    for d in tl.damage:
        ax_state.plot([sec(d.t_ns if d.t_ns is not None else tl.start_ns)], [0], marker="X", color="black",
                      markersize=8)
    if tl.faults or fault_schedule:
        _fault_lane(ax_state, tl, end, fault_schedule)
    else:  # an older log without twinFault events: the twin's 1 Hz twinState snapshots
        _fault_bars_from_snapshots(ax_state, tl)
    ax_state.set_yticks([1, 0], ["node state", "faults"])
    ax_state.set_ylim(-0.9, 1.6)
    handles = [plt.Line2D([], [], marker="v", color="#d62728", linestyle=""),
               plt.Line2D([], [], marker="X", color="black", linestyle=""),
               plt.Line2D([], [], marker="*", color=FAULT_FIRED_COLOR, linestyle=""),
               plt.Rectangle((0, 0), 1, 1, color=FAULT_COLOR, alpha=0.45),
               plt.Line2D([], [], marker="|", color="black", markersize=10, markeredgewidth=2, linestyle="")]
    handles += [plt.Rectangle((0, 0), 1, 1, color=c) for c in STATE_COLORS.values()]
    fired = sum(f.action == "fired" for f in tl.faults)
    _legend(ax_state, handles, [f"violation ({len(violations)})", f"log damage ({len(tl.damage)})",
                                f"fault fired ({fired})", "fault: inject to clear", "fault cleared",
                                *STATE_COLORS])
    ax_state.set_title("node state, faults", loc="left", fontsize=10)

    # frame drops and deadline misses
    if tl.outputs:
        ax_drop.plot([sec(o.t_ns) for o in tl.outputs], [o.frame_drop_perc for o in tl.outputs], color="#1f77b4",
                     linewidth=1, label="frameDropPerc")
        misses = [o for o in tl.outputs if o.deadline_missed]
        if misses:
            ax_drop.scatter([sec(o.t_ns) for o in misses], [o.frame_drop_perc for o in misses], color="#d62728",
                            marker="|", s=80, label=f"deadline missed ({len(misses)})")
        missing = [v for v in violations if v.contract == "one_output_per_frame"]
        if missing:
            ax_drop.scatter([sec(v.t_ns) for v in missing], [0] * len(missing), color="black", marker="x", s=30,
                            label=f"frame without one output ({len(missing)})")
        ax_drop.axhline(1.0, color="#d62728", linestyle=":", linewidth=1, label="1 % (control soft-disables)")
        _legend(ax_drop)
        ax_drop.set_ylim(bottom=-0.1, top=max(2.0, max(o.frame_drop_perc for o in tl.outputs) * 1.2))
    else:
        _no_data(ax_drop, "modelOutput")
    ax_drop.set_ylabel("frames dropped (%)")
    ax_drop.set_title("frame drops and deadline misses", loc="left", fontsize=10)
    ax_drop.set_xlabel("time since the log's first message (s)")
    ax_drop.set_xlim(0, end)
    ax_drop.grid(True, alpha=0.3)
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


FAULT_COLOR = "#9467bd"
FAULT_FIRED_COLOR = "#d62728"
FAULT_END_ACTIONS = ("cleared", "expired")


def fault_spans(tl: Timeline) -> list[tuple[str, float, float | None, list[float]]]:
    """Each injected fault from the ``twinFault`` events: (``kind#id``, armed s, cleared/expired s or
    None while it lasted to the end, firing times s), in arming order."""
    spans: dict[int, list[Any]] = {}
    for f in tl.faults:
        span = spans.setdefault(f.fault_id, [f"{f.kind}#{f.fault_id}", tl.seconds(f.t_ns), None, []])
        if f.action == "fired":
            span[3].append(tl.seconds(f.t_ns))
        elif f.action in FAULT_END_ACTIONS and span[2] is None:
            span[2] = tl.seconds(f.t_ns)
    return [tuple(v) for v in spans.values()]  # type: ignore[misc]


@dataclass
class FaultInterval:
    """One fault from its start to its end, with its events: ``start_s`` -- launch injected it (the
    schedule's ``inject``) or, without a schedule, the twin armed it; ``end_s`` -- launch cleared it (the
    schedule's ``clear``) or the twin's ``cleared`` / ``expired``, None while it lasted to the end of the log;
    ``end_how`` names that end; ``events``: the twin's ``twinFault`` events of it, (t s, action). Times are
    s since the log's first message."""

    name: str
    start_s: float
    end_s: float | None
    end_how: str
    events: list[tuple[float, str]] = field(default_factory=list)


SCHEDULE_MATCH_S = 2.0  # a twin fault armed this close to a launch injection of its kind is that injection


def fault_intervals(tl: Timeline, fault_schedule: Sequence[dict[str, Any]] | None = None) -> list[FaultInterval]:
    """Each fault from inject to clear (see :class:`FaultInterval`), in start order: the launch's schedule
    steps paired with the twin's events of the same kind (the nearest arming within
    :data:`SCHEDULE_MATCH_S`), and twin faults no schedule step names on their own."""
    twin: dict[int, FaultInterval] = {}
    for f in tl.faults:
        t = tl.seconds(f.t_ns)
        iv = twin.setdefault(f.fault_id, FaultInterval(f"{f.kind}#{f.fault_id}", t, None, ""))
        iv.events.append((t, f.action))
        if f.action in FAULT_END_ACTIONS and iv.end_s is None:
            iv.end_s, iv.end_how = t, f"{f.action} (twin)"
    free = list(twin.values())
    out: list[FaultInterval] = []
    steps = sorted(fault_schedule or (), key=lambda st: float(st["t_s"]))
    clears = [st for st in steps if st["action"] == "clear"]
    for st in steps:
        if st["action"] != "inject":
            continue
        kind, t_in = str(st["fault"]), float(st["t_s"])
        near = [iv for iv in free if iv.name.split("#")[0] == kind and abs(iv.start_s - t_in) <= SCHEDULE_MATCH_S]
        match = min(near, key=lambda iv: abs(iv.start_s - t_in), default=None)
        clear = next((c for c in clears if c["fault"] == kind and float(c["t_s"]) >= t_in), None)
        iv = FaultInterval(kind, t_in, None, "")
        if match is not None:
            free.remove(match)
            iv.name, iv.events = match.name, match.events
            iv.start_s = min(t_in, match.start_s)
            iv.end_s, iv.end_how = match.end_s, match.end_how
        if clear is not None:
            clears.remove(clear)
            detail = f", {clear['detail']}" if clear.get("detail") else ""
            iv.end_s, iv.end_how = float(clear["t_s"]), f"cleared by launch{detail}"
        out.append(iv)
    return sorted(out + free, key=lambda iv: iv.start_s)


def _fault_lane(ax: Any, tl: Timeline, end: float, fault_schedule: Sequence[dict[str, Any]] | None = None) -> None:
    """A bar per fault from inject to clear (:func:`fault_intervals`; to the end of the log while it lasted),
    a tick where the twin armed it, a star at every firing, a cross where the twin cleared or expired it, and
    a bold tick at its clear, named by its kind and its clear time: a one-shot fault that fires and is spent
    within a second still gets its star (``twinFault``, sent when it happens)."""
    for iv in fault_intervals(tl, fault_schedule):
        stop = end if iv.end_s is None else iv.end_s
        ax.barh(0, max(stop - iv.start_s, 0.004 * end), left=iv.start_s, height=0.35, color=FAULT_COLOR, alpha=0.45)
        fired = [t for t, a in iv.events if a == "fired"]
        marks = (("armed", "|", "#4b2c6f", 9), ("cleared", "x", "#4b2c6f", 6), ("expired", "x", "#4b2c6f", 6))
        for action, marker, color, size in marks:
            ts = [t for t, a in iv.events if a == action]
            if ts:
                ax.plot(ts, [0] * len(ts), marker=marker, color=color, markersize=size, linestyle="")
        if fired:
            ax.plot(fired, [0] * len(fired), marker="*", color=FAULT_FIRED_COLOR, markersize=10, linestyle="")
        if iv.end_s is not None:
            ax.plot([iv.end_s], [0], marker="|", color="black", markersize=14, markeredgewidth=2, linestyle="")
        until = "to the end" if iv.end_s is None else f"until {iv.end_s:.1f} s"
        never = "" if fired or not iv.events else ", never fired"
        ax.text(iv.start_s, 0.22, f"{iv.name.split('#')[0]} {until}{never}", fontsize=7, color="#4b2c6f",
                va="bottom")


def fault_table_rows(intervals: Sequence[FaultInterval]) -> list[tuple[str, str, str, str, str]]:
    """The report's fault table: (fault, injected s, firing times s, cleared s, how it ended) per fault; a
    fault that lasted to the end of the log says so."""
    rows = []
    for iv in intervals:
        fired = [t for t, a in iv.events if a == "fired"]
        fired_text = ", ".join(f"{t:.3f}" for t in fired[:5]) + (f" (+{len(fired) - 5} more)" if len(fired) > 5 else "")
        end = "-" if iv.end_s is None else f"{iv.end_s:.3f}"
        rows.append((iv.name, f"{iv.start_s:.3f}", fired_text or "never", end, iv.end_how or "lasted to the end"))
    return rows


def _fault_bars_from_snapshots(ax: Any, tl: Timeline) -> None:
    """The twin's live faults as bars from its 1 Hz ``twinState`` (logs written before ``twinFault``)."""
    sec = tl.seconds
    live: dict[str, float] = {}
    for i, tw in enumerate(tl.twins):
        t_s = sec(tw.t_ns)
        nxt = sec(tl.twins[i + 1].t_ns) if i + 1 < len(tl.twins) else t_s
        names = {f.split(":")[0] for f in tw.faults} | ({"unplugged"} if not tw.present else set())
        for name in names:
            live.setdefault(name, t_s)
        for name in [n for n in live if n not in names]:
            t0 = live.pop(name)
            ax.barh(0, t_s - t0, left=t0, height=0.35, color=FAULT_COLOR, alpha=0.7)
            ax.text(t0, 0.25, name.split("#")[0], fontsize=7, color="#4b2c6f", va="bottom")
        if i + 1 == len(tl.twins):
            for name, t0 in live.items():
                ax.barh(0, max(nxt - t0, 0.5), left=t0, height=0.35, color=FAULT_COLOR, alpha=0.7)
                ax.text(t0, 0.25, name.split("#")[0], fontsize=7, color="#4b2c6f", va="bottom")


def soft_disable_episodes(tl: Timeline) -> list[tuple[float, float | None, str]]:
    """Each soft-disable episode of the control daemon: (start s, end s or None, the events seen during it)."""
    out: list[tuple[float, float | None, str]] = []
    start: float | None = None
    seen: list[str] = []
    for c in tl.controls:
        if c.soft_disabling and start is None:
            start, seen = tl.seconds(c.t_ns), []
        if start is not None:
            seen += [e for e in c.events if e not in seen]
            if not c.soft_disabling:
                out.append((start, tl.seconds(c.t_ns), ", ".join(seen)))
                start = None
    if start is not None:
        out.append((start, None, ", ".join(seen)))
    return out


FAULT_ACTION_WORDS = {"armed": "injected", "fired": "fired", "cleared": "cleared", "expired": "expired"}


def _fault_words(f: Any) -> str:
    """The ``twinFault`` action (``msgs/chestnut.capnp``) in words, as the launch summary's fault table has them
    (``launch/summary.py`` ``fault_rows``): an ``expired`` of a fault used up by firing is ``spent`` (a one-shot:
    ``backend/sim/faults.py`` ``spent_on_expiry``), any other ``expired`` is one whose ``--for`` duration ended."""
    from chestnut.backend.sim.faults import spent_on_expiry

    if f.action == "expired":
        if spent_on_expiry(f.kind, f.params, int(f.fired)):
            return "spent (a one-shot: fired once and fires no more)"
        return "expired (its --for duration ended)"
    return FAULT_ACTION_WORDS.get(f.action, f.action)


def story_rows(tl: Timeline, fault_schedule: Sequence[dict[str, Any]] | None = None) -> list[tuple[str, str, str, str]]:
    """What happened, in time order: (t s, what, kind, why) for every node state change with its reason,
    every ChestnutActive change, every soft-disable episode, every fault event of the twin (with what a
    firing hit) and every step of the launch's fault schedule."""
    rows: list[tuple[float, str, str, str]] = []
    prev = None
    for st in tl.node_states:
        if st.state != prev:
            rows.append((tl.seconds(st.t_ns), f"node {st.state}", "state", st.reason))
            prev = st.state
    active = None
    for a in tl.actives:
        if a.active != active:
            rows.append((tl.seconds(a.t_ns), f"ChestnutActive {str(a.active).lower()}", "active", a.reason))
            active = a.active
    for t0, t1, events in soft_disable_episodes(tl):
        dur = "to the end of the log" if t1 is None else f"{t1 - t0:.2f} s"
        rows.append((t0, f"soft disable ({dur})", "control", events))
    for f in tl.faults:
        if f.action == "fired":
            detail = f"hit {f.site}" if f.site else ""
        elif f.action == "armed":
            detail = "parameters: " + (f.params if f.params not in ("", "{}") else "the kind's defaults")
        else:
            detail = ""
        what = f"fault {f.kind}#{f.fault_id} {_fault_words(f)}"
        rows.append((tl.seconds(f.t_ns), what, "fault", detail))
    for step in fault_schedule or ():
        rows.append((float(step["t_s"]), f"launch: {step['action']} {step['fault']}", "schedule",
                     str(step.get("detail", ""))))
    rows.sort(key=lambda r: r[0])
    return [(f"{t:.3f}", what, kind, why) for t, what, kind, why in rows]


def describe_diffs(what: str, diffs: Sequence[float]) -> str:
    """One line on a set of per-frame largest absolute differences: how many frames, how many exactly 0
    (identical: a log axis cannot draw them, so the plots leave them out and say so), the largest."""
    n = len(diffs)
    if not n:
        return f"{what}: no frame compared"
    zeros = sum(1 for d in diffs if d == 0.0)
    if zeros == n:
        return f"{what}: all {n} frames identical (difference exactly 0)"
    largest = f"largest difference {max(diffs):.3g}"
    if zeros:
        return f"{what}: {zeros} of {n} frames identical (difference exactly 0, not drawn on the log axis); {largest}"
    return f"{what}: {n} frames, none identical; {largest}"


def _diff_panel(ax: Any, what: str, diffs: Sequence[float]) -> bool:
    """Say on the panel how many frames were identical; True when some difference is left to draw."""
    zeros = sum(1 for d in diffs if d == 0.0)
    if diffs and zeros == len(diffs):
        ax.text(0.5, 0.5, f"all {len(diffs)} frames identical: {what} is exactly 0 on every frame",
                transform=ax.transAxes, ha="center", va="center", color="#2ca02c")
        ax.set_yticks([])  # nothing is drawn: no scale to read
        return False
    if zeros:
        ax.text(0.01, 0.96, f"{zeros} of {len(diffs)} frames identical (exactly 0, not drawn)", transform=ax.transAxes,
                ha="left", va="top", fontsize=8, color="#2ca02c")
    return True


def _agreement_diffs(tl: Timeline, replay: ReplayResult | None) -> list[tuple[str, list[float]]]:
    panels = [("primary / fallback", [o.max_abs_diff for o in tl.outputs if o.agreement_checked])]
    if replay is not None:
        panels.append(("replayed / logged", [f.max_abs_diff for f in replay.frames if f.tensors]))
    return panels


def agreement_has_plot(tl: Timeline, replay: ReplayResult | None = None) -> bool:
    """Whether :func:`plot_agreement` has a point to draw: some compared frame with a difference above 0."""
    return any(d > 0 for _, diffs in _agreement_diffs(tl, replay) for d in diffs)


def agreement_caption(tl: Timeline, replay: ReplayResult | None = None) -> str:
    """The agreement panels in words (:func:`describe_diffs` for each), what the page shows when there is
    nothing to plot."""
    return "; ".join(describe_diffs(what, diffs) for what, diffs in _agreement_diffs(tl, replay))


def plot_agreement(tl: Timeline, path: Path, replay: ReplayResult | None = None) -> str:
    """Primary/fallback agreement where both ran; and replayed-vs-logged differences after a replay.
    Differences of exactly 0 are counted on the panel, never drawn as a made-up small value. Returns the
    figure's caption (:func:`describe_diffs` for each panel)."""
    plt = _plt()
    sec = tl.seconds
    panels = 2 if replay is not None else 1
    fig, axes = plt.subplots(panels, 1, figsize=(12, 3.2 * panels), sharex=True, squeeze=False)
    ax = axes[0][0]
    checked = [o for o in tl.outputs if o.agreement_checked]
    tol = float(tl.node_config().get("timing", {}).get("agreement_tol", 1e-3)) if tl.node_config() else 1e-3
    captions = [describe_diffs("primary / fallback", [o.max_abs_diff for o in checked])]
    if checked and _diff_panel(ax, "|primary - fallback|", [o.max_abs_diff for o in checked]):
        for agrees, color, label in ((True, "#2ca02c", "agrees"), (False, "#d62728", "disagrees")):
            pts = [o for o in checked if o.primary_agrees == agrees and o.max_abs_diff > 0]
            if pts:
                ax.scatter([sec(o.t_ns) for o in pts], [o.max_abs_diff for o in pts], s=9, color=color,
                           label=f"{label} ({len(pts)})")
        ax.axhline(tol, color="#d62728", linestyle="--", linewidth=1, label=f"agreement tol {tol:g}")
        ax.set_yscale("log")
        _legend(ax)
    elif not checked:
        _no_data(ax, "frame where both models ran")
    ax.set_ylabel("max |primary - fallback|")
    ax.set_title("primary / fallback agreement (hot standby and shadow frames)", loc="left", fontsize=10)
    ax.grid(True, alpha=0.3)
    if replay is not None:
        ax = axes[1][0]
        frames = [f for f in replay.frames if f.tensors]
        captions.append(describe_diffs("replayed / logged", [f.max_abs_diff for f in frames]))
        if not frames:
            _no_data(ax, "replayed frame")
        elif _diff_panel(ax, "|replayed - logged|", [f.max_abs_diff for f in frames]):
            for src, color in SOURCE_COLORS.items():
                replayed = [f for f in frames if f.replayed_with == src and f.max_abs_diff > 0]
                if replayed:
                    ax.scatter([sec(f.t_ns) for f in replayed], [f.max_abs_diff for f in replayed], s=9,
                               color=color, label=f"replayed with {src} ({len(replayed)})")
            bad = [f for f in replay.mismatches if f.tensors and f.max_abs_diff > 0]
            if bad:
                ax.scatter([sec(f.t_ns) for f in bad], [f.max_abs_diff for f in bad], s=40,
                           facecolors="none", edgecolors="#d62728", label=f"mismatch ({len(bad)})")
            ax.axhline(replay.plan.tol, color="#d62728", linestyle="--", linewidth=1,
                       label=f"tol {replay.plan.tol:g}")
            ax.set_yscale("log")
            _legend(ax)
        ax.set_ylabel("max |replayed - logged|")
        ax.set_title("replay: largest difference per frame", loc="left", fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[-1][0].set_xlabel("time since the log's first message (s)")
    axes[-1][0].set_xlim(0, max(sec(tl.end_ns), 1e-3))
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)
    return "; ".join(captions)


def plot_latency(tl: Timeline, path: Path) -> None:
    """Histograms of frameAge and executionTime per source (ms); below them the primary's stage times per
    frame (:func:`plot_stages`)."""
    plt = _plt()
    fig = plt.figure(figsize=(12, 6.6))
    grid = fig.add_gridspec(2, 2)
    axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])]
    for ax, attr, label in ((axes[0], "frame_age_s", "frameAge (ms)"), (axes[1], "execution_time_s",
                                                                         "executionTime (ms)")):
        any_data = False
        for src, color in SOURCE_COLORS.items():
            vals = [getattr(o, attr) * 1e3 for o in tl.outputs if o.source == src]
            if vals:
                any_data = True
                ax.hist(vals, bins=40, color=color, alpha=0.6, label=f"{src} ({len(vals)})")
        if any_data:
            ax.legend(fontsize=7)
        else:
            _no_data(ax, "modelOutput")
        ax.set_xlabel(label)
        ax.set_ylabel("frames")
        ax.set_title(f"{label.split()[0]} by serving source", loc="left", fontsize=10)
        ax.grid(True, alpha=0.3)
    plot_stages(tl, fig.add_subplot(grid[1, :]))
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


# ---------------------------------------------------------------- stage times
STAGE_LABELS = ("copy-in", "compute", "copy-out")  # modelOutput.copyInTime, computeTime, copyOutTime
STAGE_COLORS = ("#1f77b4", "#2ca02c", "#9467bd")
OPENPILOT_COPY_MS = 22.0  # openpilot#38862: a comma 3X's USB copy of one frame, of its 50 ms frame


def _stage_budgets_ms() -> tuple[float, float, float]:
    from chestnut.node.health import FRAME_PERIOD_S, STAGE_SHARES

    ms = FRAME_PERIOD_S * 1e3
    return STAGE_SHARES["copy_in"] * ms, STAGE_SHARES["compute"] * ms, STAGE_SHARES["copy_out"] * ms


def _timed(tl: Timeline, source: str) -> list[Any]:
    """``source``'s outputs that carry stage times (a log from before them has zeros)."""
    return [o for o in tl.outputs if o.source == source and any(o.stages_s)]


def stage_rows(tl: Timeline) -> list[tuple[str, str, int, str, str, str, str, str]]:
    """Per serving source and stage: frames, p50 / p99 / max (ms), the stage's budget (``node/health.py``
    ``STAGE_SHARES`` of the 50 ms frame) and, for the primary's copy-in, openpilot#38862's figure. The
    fallback runs in the node's memory: its copies are 0 and only its compute is listed. [] without
    stage times in the log."""
    budgets = _stage_budgets_ms()
    rows = []
    for src in ("primary", "fallback"):
        outs = _timed(tl, src)
        for i, label in enumerate(STAGE_LABELS):
            if not outs or (src == "fallback" and i != 1):
                continue
            v = [o.stages_s[i] * 1e3 for o in outs]
            note = f"openpilot#38862: ~{OPENPILOT_COPY_MS:g} ms a frame" if (src, i) == ("primary", 0) else ""
            rows.append((src, label, len(v), _pct(v, 50), _pct(v, 99), f"{max(v):.1f}", f"{budgets[i]:g}", note))
    return rows


def plot_stages(tl: Timeline, ax: Any) -> None:
    """On ``ax``: the primary's stage times per frame over time (ms), each with its budget as a dashed line
    and openpilot#38862's copy as a dotted one."""
    outs = _timed(tl, "primary")
    if outs:
        t = [tl.seconds(o.t_ns) for o in outs]
        for i, (label, color, budget) in enumerate(zip(STAGE_LABELS, STAGE_COLORS, _stage_budgets_ms(), strict=True)):
            ax.plot(t, [o.stages_s[i] * 1e3 for o in outs], ".", ms=3, color=color, label=label)
            ax.axhline(budget, color=color, ls="--", lw=0.8, label=f"{label} budget {budget:g} ms")
        ax.axhline(OPENPILOT_COPY_MS, color="#d62728", ls=":", lw=0.8, label="openpilot#38862 copy")
        _legend(ax)
    else:
        _no_data(ax, "stage times (copyInTime / computeTime / copyOutTime)")
    ax.set_xlabel("t (s)")
    ax.set_ylabel("ms")
    ax.set_title("primary: copy-in, compute, copy-out per frame", loc="left", fontsize=10)
    ax.grid(True, alpha=0.3)


# ---------------------------------------------------------------- summary and HTML


def _pct(vals: Sequence[float], q: float) -> str:
    return f"{float(np.percentile(vals, q)):.1f}" if vals else "-"


def deadline_in_force(outputs: Sequence[OutputRec]) -> str:
    """The primary's deadline in force at the end of the log and its range over it (``modelOutput.deadline``,
    docs/health.md "Adaptive deadline"), e.g. ``41.0 ms (39.5 .. 150.0 ms)``; "" when no output carries one."""
    ms = [o.deadline_s * 1e3 for o in outputs if o.deadline_s > 0]
    if not ms:
        return ""
    return f"{ms[-1]:.1f} ms ({min(ms):.1f} .. {max(ms):.1f} ms)"



def summary_rows(tl: Timeline, violations: Sequence[Violation] | None,
                 replay: ReplayResult | None = None) -> list[tuple[str, str]]:
    """(label, value) rows of the summary table."""
    rows = [("log files", str(len(tl.files))), ("duration", f"{tl.seconds(tl.end_ns):.2f} s"),
            ("camera frames", str(len(tl.frames))), ("model outputs", str(len(tl.outputs)))]
    for src in ("primary", "fallback"):
        outs = [o for o in tl.outputs if o.source == src]
        if outs:
            age = [o.frame_age_s * 1e3 for o in outs]
            ex = [o.execution_time_s * 1e3 for o in outs]
            rows.append((f"served by {src}", f"{len(outs)} ({100 * len(outs) / len(tl.outputs):.1f} %); frameAge "
                         f"p50/p95/p99 {_pct(age, 50)}/{_pct(age, 95)}/{_pct(age, 99)} ms; executionTime "
                         f"p50/p99 {_pct(ex, 50)}/{_pct(ex, 99)} ms"))
    rows.append(("deadline misses", str(sum(o.deadline_missed for o in tl.outputs))))
    if deadline_text := deadline_in_force(tl.outputs):
        rows.append(("deadline in force at the end (range)", deadline_text))
    if tl.outputs:
        rows.append(("frame drops (max)", f"{max(o.frame_drop_perc for o in tl.outputs):.2f} %"))
    if tl.actives:
        on = _spans([a.t_ns for a in tl.actives], ["on" if a.active else "off" for a in tl.actives], tl.end_ns)
        on_ns = sum(w for _, w in on.get("on", []))
        total = max(tl.end_ns - tl.actives[0].t_ns, 1)
        rows.append(("ChestnutActive true", f"{100 * on_ns / total:.1f} % of the time"))
    transitions = [(a.state, b.state) for a, b in zip(tl.node_states, tl.node_states[1:], strict=False)
                   if a.state != b.state]
    rows.append(("node state transitions", str(len(transitions))))
    if tl.node_states:
        rows.append(("worker restarts", str(max(s.restarts for s in tl.node_states))))
    rows.append(("log damage", str(len(tl.damage))))
    if violations is not None:
        rows.append(("contract violations", str(len(violations))))
    if replay is not None:
        n = sum(1 for f in replay.frames if f.replayed_with)
        rows.append(("frames replayed", f"{n} ({', '.join(f'{k} {v}' for k, v in sorted(replay.replayed().items()))})"))
        rows.append(("replay mismatches", str(len(replay.mismatches))))
        rows.append(("model id mismatches", str(len(replay.model_mismatches))))
    return rows


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"><figcaption>' \
           f"{html.escape(alt)}</figcaption></figure>"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], classes: Sequence[str] | None = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _clock_line(wall_start: str | None, logs: Path | None, out: Path) -> str:
    start = f" ({html.escape(wall_start)})" if wall_start else ""
    text = f"<p>Times are seconds since the log's first message{start}.</p>"
    if logs is not None:
        try:
            href = os.path.relpath(logs, out)
        except ValueError:
            href = str(logs)
        text += f"<p>Logs: <a href='{html.escape(href)}/'>{html.escape(str(logs))}</a></p>"
    return text


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1340px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } tr.bad td { background: #fde8e8; } tr.good td { background: #eaf6ea; }
tr.sched td { background: #efe8f7; }
figure { margin: 1em 0; } img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #666; } .verdict { font-size: 1.1em; font-weight: 600; }
.ok { color: #2ca02c; } .fail { color: #d62728; }
"""


def restart_and_anomaly_html(tl: Timeline) -> list[str]:
    """The page's restarts (every node, worker and twin restart: time, cause, frames it cost;
    :mod:`~chestnut.node.offline.restarts`) and the inputs' anomalies (:func:`~chestnut.node.offline.contracts.
    input_anomalies`: not the node's faults)."""
    from chestnut.node.offline.contracts import CheckParams, input_anomalies
    from chestnut.node.offline.restarts import restarts

    found = restarts(tl)
    parts = [f"<h2>restarts ({len(found)})</h2>",
             _table(("t (s)", "what", "cause", "frames without the primary", "back (s)"),
                    [(f"{tl.seconds(r.t_ns):.3f}", r.what, r.cause, r.frames,
                      "-" if r.back_ns is None else f"{tl.seconds(r.back_ns):.3f}") for r in found],
                    ["bad"] * len(found)) if found else "<p>no node, worker or twin restart in this log</p>"]
    anomalies = input_anomalies(tl, CheckParams.from_config(tl.node_config()))
    if anomalies:
        parts += [f"<h2>input anomalies ({len(anomalies)}; not the node's faults)</h2>",
                  _table(("t (s)", "frame", "kind", "what"),
                         [(f"{tl.seconds(a.t_ns):.3f}", "-" if a.frame_id is None else a.frame_id, a.kind, a.message)
                          for a in anomalies])]
    return parts


def write_report(out_dir: Path | str, timeline: Timeline, *, violations: Sequence[Violation] | None = None,
                 replay: ReplayResult | None = None, title: str = "chestnut",
                 fault_schedule: Sequence[dict[str, Any]] | None = None, logs: Path | None = None,
                 wall_start: str | None = None) -> Path:
    """Write the PNGs and ``index.html`` into ``out_dir`` (created 0700); returns the HTML page's path.

    Raises :class:`~chestnut.msgs.outdir.OutputDirError` (one line) for an unfit ``out_dir`` or target.

    ``fault_schedule``: what ``chestnut launch`` did (dicts with ``t_s`` on the log's clock, ``action``,
    ``fault``, ``detail``); ``logs``: the log directory, linked from the page; ``wall_start``: the
    wall-clock time of the log's first message, printed once (every time on the page counts from it)."""
    out = private_dir(out_dir, ("timeline.png", "agreement.png", "latency.png", "index.html"))
    tl = timeline
    vs = list(violations or [])
    plot_timeline(tl, vs, out / "timeline.png", fault_schedule)
    agreement = plot_agreement(tl, out / "agreement.png", replay)  # the file set stays the same either way
    if agreement_has_plot(tl, replay):
        agreement_html = _img(out / "agreement.png", agreement)
    else:  # nothing to draw: the page says it in a sentence (an empty set of axes would say nothing more)
        agreement_html = f"<h2>agreement</h2><p>{html.escape(agreement)}</p>"
    plot_latency(tl, out / "latency.png")
    bad = bool(vs) or (replay is not None and not replay.ok)
    damage = tl.damage if replay is None else replay.damage  # a replay's: the log files' and its damaged videos
    verdict = ("<p class='verdict fail'>FAIL: " if bad else "<p class='verdict ok'>PASS: ") + html.escape(
        ", ".join(p for p in (
            f"{len(vs)} contract violation(s)" if violations is not None else "",
            f"{len(replay.mismatches)} replay mismatch(es), {len(replay.model_mismatches)} model id mismatch(es)"
            if replay is not None else "",
            damage_count(damaged_files(damage), len(damage))) if p)) + "</p>"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>", verdict,
             _clock_line(wall_start or tl.wall_start(), logs, out), "<h2>summary</h2>",
             _table(("", "value"), summary_rows(tl, violations, replay))]
    if violations is not None:
        counts = dict.fromkeys(CONTRACTS, 0)
        for v in vs:
            counts[v.contract] = counts.get(v.contract, 0) + 1
        parts += ["<h2>contracts</h2>", _table(("contract", "holds when", "violations"),
                                               [(n, CONTRACTS[n].description if n in CONTRACTS else "", c)
                                                for n, c in counts.items()],
                                               ["bad" if c else "good" for c in counts.values()])]
    parts += ["<h2>timeline</h2>", _img(out / "timeline.png", "latency and source; ChestnutActive and control; "
                                        "health layers; node state and faults; frame drops"),
              ]
    story = story_rows(tl, fault_schedule)
    parts.append(f"<h2>what happened ({len(story)})</h2>")
    parts.append(_table(("t (s)", "what", "kind", "why / detail"), story,
                        ["bad" if k in ("fault", "control") else ("sched" if k == "schedule" else "")
                         for _, _, k, _ in story])
                 if story else "<p>no state change, soft disable or fault event in this log</p>")
    parts += restart_and_anomaly_html(tl)
    intervals = fault_intervals(tl, fault_schedule)
    if intervals:
        parts.append(f"<h2>faults ({len(intervals)})</h2>")
        parts.append(_table(("fault", "injected (s)", "fired (s)", "cleared (s)", "how it ended"),
                            fault_table_rows(intervals), ["bad"] * len(intervals)))
    if fault_schedule is not None:
        parts.append(f"<h2>fault schedule ({len(fault_schedule)})</h2>")
        parts.append(_table(("t (s)", "action", "fault", "detail"),
                            [(f"{f['t_s']:.3f}", f["action"], f["fault"], f.get("detail", "")) for f in fault_schedule])
                     if fault_schedule else "<p>no fault was scheduled</p>")
    parts += [agreement_html,
              _img(out / "latency.png", "latency distributions; the primary's copy-in, compute and copy-out per "
                   "frame with their budgets")]
    stages = stage_rows(tl)
    parts.append("<h2>stage times</h2>")
    parts.append(_table(("source", "stage", "frames", "p50 (ms)", "p99 (ms)", "max (ms)", "budget (ms)",
                         "for comparison"), stages) if stages
                 else "<p>no stage times in this log (no primary output, or a log from before them)</p>")
    if violations is not None:
        parts.append(f"<h2>violations ({len(vs)})</h2>")
        parts.append(_table(("t (s)", "frame", "contract", "what"),
                            [(f"{tl.seconds(v.t_ns):.3f}", "-" if v.frame_id is None else v.frame_id, v.contract,
                              v.message) for v in vs], ["bad"] * len(vs)) if vs else "<p>none</p>")
    if tl.damage:
        parts += ["<h2>log damage</h2>", _table(("file", "byte offset", "reason", "last good t (s)", "last frame"),
                                                [(d.path, d.offset, d.reason, f"{tl.seconds(d.t_ns):.3f}",
                                                  "-" if d.frame_id is None else d.frame_id) for d in tl.damage],
                                                ["bad"] * len(tl.damage))]
    if replay is not None:
        parts += ["<h2>replay: models</h2>",
                  _table(("source", "log's model id", "replay's model id", "frames", "same model"),
                         [(m.source, m.logged_id, m.replay_id, m.frames, "yes" if m.same_bytes else "NO")
                          for m in replay.model_ids], ["good" if m.same_bytes else "bad" for m in replay.model_ids])]
        parts += ["<h2>replay: largest difference per tensor</h2>",
                  _table(("tensor", "max abs diff", "frame"), [(k, f"{d:.6g}", fid) for k, (d, fid)
                                                               in sorted(replay.tensor_maxima().items())])]
        mm = replay.mismatches
        parts.append(f"<h2>replay: mismatches ({len(mm)})</h2>")
        parts.append(_table(("t (s)", "frame", "logged", "replayed with", "outcome", "max abs diff", "detail"),
                            [(f"{tl.seconds(f.t_ns):.3f}", f.frame_id, f.logged_source, f.replayed_with, f.kind,
                              f"{f.max_abs_diff:.6g}", f.detail) for f in mm], ["bad"] * len(mm))
                     if mm else "<p>none</p>")
    parts.append("</body></html>")
    return write_private(out / "index.html", "\n".join(parts))
