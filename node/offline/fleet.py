"""Offline validation over a fleet: many logs (routes), one unit of work per segment, on any executor.

A *log* is a route: the files of the ``<route>--<n>`` segment directories of one route (a file outside a
segment directory is a log of its own). :func:`replay_fleet` and :func:`check_fleet` cut every log into
its segments, run them on an :class:`~chestnut.node.offline.executor.Executor`, and put each log back
together in segment order, so that a log's result is exactly what ``replay`` / ``check_log`` give for
that log alone (:meth:`FleetReplay.digest`, :meth:`FleetCheck.digest` cover results only, no timings).

- replay: each log's plan is resolved once in the driver from the node configuration in its first
  segment (:func:`~chestnut.node.offline.replay.find_node_config`); segments replay on the workers.
- check: the workers read segments into :class:`~chestnut.node.offline.timeline.FileExtract` records;
  the driver merges each log's extracts into its timeline and runs the contracts (cheap: records, no
  pixels), since contracts such as ``worker_answers`` span segment boundaries.

The fleet table (:func:`log_rows`) gives per log: segments, frames, replay mismatches or contract
violations, damaged files, failovers by cause (``nodeState`` entering ``degraded``; the cause is its
reason up to the first ``:``, as ``node/supervisor.py`` writes it) and latency percentiles
(``modelOutput.executionTime`` and ``frameAge``). Logs and segments are listed worst first.
:func:`make_fleet` builds a synthetic fleet by copying a log under new route ids.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import html
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from chestnut.msgs.logfile import LOG_NAMES, find_log_files, first_item, json_only_fix, parse_segment_dir
from chestnut.msgs.outdir import OutputDirError, private_dir, write_private
from chestnut.msgs.video import open_regular, segment_videos
from chestnut.node.offline.contracts import CONTRACTS, CheckParams, CheckResult, check_timeline
from chestnut.node.offline.executor import KIND_EXTRACT, KIND_REPLAY, Executor, Outcome, Unit, units_of
from chestnut.node.offline.replay import (
    ReplayPlan,
    ReplayResult,
    SegmentResult,
    SegmentTask,
    damage_line,
    find_node_config,
    plan_tasks,
    resolve_plan,
    stop_name,
)
from chestnut.node.offline.timeline import (
    DamageRec,
    FileExtract,
    Timeline,
    damage_count,
    damaged_files,
    default_node_config,
)

MAX_COPIES = 100_000  # chestnut fleet make --copies bound (route ids carry 5 digits at most)
REPORT_LOGS = 5  # logs given their own full report (plots) under --report, worst first
COPY_NAME = LOG_NAMES[0]  # "rlog": the log name find_log_files looks for in a folder (check, replay: its default)


# ---------------------------------------------------------------- logs of a fleet


def route_of(path: Path | str) -> str:
    """The log a file belongs to: its segment directory's route (``<route>--<n>``) with the directory
    above it (two fleets may hold the same route id), else the file's own path."""
    p = Path(path)
    seg = parse_segment_dir(p.parent.name)
    return str(p.parent.parent / seg[0]) if seg else str(p)


def group_logs(paths: Iterable[Path | str] | Path | str, *,
               on_skip: Callable[[Path, str], None] | None = None) -> list[tuple[str, list[Path]]]:
    """``[(log, its files in segment order)]`` for the log files under ``paths``, logs sorted by name.
    Raises ``FileNotFoundError`` when there is none (:func:`~chestnut.msgs.logfile.find_log_files`, which
    ``on_skip`` is passed to: with it, a log file found in a walk that is not a regular file is left out and
    named to it, else refused)."""
    groups: dict[str, list[Path]] = {}
    for f in find_log_files(paths, on_skip=on_skip):
        groups.setdefault(route_of(f), []).append(f)
    return sorted(groups.items())


def short_name(log: str) -> str:
    """A log's name for tables: the route id (the last path part)."""
    return Path(log).name


# ---------------------------------------------------------------- running


@dataclass
class FleetRun:
    """What the executor did: every outcome in finishing order, the units it was given, the wall time."""

    executor: str
    workers: int
    units: int
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    interrupted: bool = False
    stopped_by: str = "Ctrl-C"  # what interrupted it: Ctrl-C, or the signal handled as one (SIGTERM): stop_name

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error]

    @property
    def retried(self) -> list[Outcome]:
        """Units that ran again because the worker holding them died."""
        return [o for o in self.outcomes if o.attempts > 1]

    @property
    def first_result_s(self) -> float | None:
        return min((o.done_s for o in self.outcomes), default=None)


def _execute(executor: Executor, units: list[Unit], on_outcome: Callable[[Outcome], None] | None) -> FleetRun:
    run = FleetRun(getattr(executor, "describe", lambda: executor.name)(), executor.workers, len(units))
    t0 = time.perf_counter()

    def record(out: Outcome) -> None:  # before the caller's callback: a Ctrl-C there keeps this outcome
        run.outcomes.append(out)
        if on_outcome is not None:
            on_outcome(out)

    try:
        for _out in executor.run(units, record):
            pass
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the executor cancelled what was in flight; keep what finished
        run.interrupted, run.stopped_by = True, stop_name(e)
    run.wall_s = time.perf_counter() - t0
    return run


@dataclass
class FleetReplay:
    """``logs``: log -> its :class:`ReplayResult` (the segments that finished, in order)."""

    logs: dict[str, ReplayResult]
    run: FleetRun

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.logs.values()) and not self.run.failed and not self.run.interrupted

    def digest(self) -> str:
        """sha256 over every log's :meth:`ReplayResult.digest`, by log name: equal for any executor."""
        body = {short_name(k): r.digest() for k, r in self.logs.items()}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def replay_fleet(
    paths: Iterable[Path | str] | Path | str,
    executor: Executor,
    *,
    on_outcome: Callable[[Outcome], None] | None = None,
    on_skip: Callable[[Path, str], None] | None = None,
    **plan_args: Any,
) -> FleetReplay:
    """Replay every log under ``paths`` on ``executor``; ``plan_args`` as for
    :func:`~chestnut.node.offline.replay.resolve_plan` (``model``, ``source``, ``tol`` ...); ``on_skip`` as for
    :func:`group_logs` (a log file found in a walk that is not a regular file is left out, never opened).
    Raises ``FileNotFoundError`` (no log), :class:`~chestnut.node.offline.replay.ReplayError` (no model)."""
    plans: dict[str, ReplayPlan] = {}
    logs: list[tuple[str, list[SegmentTask]]] = []
    for log_name, files in group_logs(paths, on_skip=on_skip):
        config, origin = find_node_config(files), "the log's node initData"
        if not config:
            config, origin = default_node_config()
            origin = f"{origin} (the log carries no node configuration)"
        key = json.dumps([config, origin], sort_keys=True, default=str)
        if key not in plans:  # one model fingerprint per distinct configuration, not per log
            plans[key] = resolve_plan(config, config_origin=origin, **plan_args)
        logs.append((log_name, plan_tasks(files, plans[key])))
    run = _execute(executor, units_of(KIND_REPLAY, logs), on_outcome)
    by_log: dict[str, list[SegmentResult]] = {}
    for o in run.outcomes:
        if isinstance(o.result, SegmentResult):
            by_log.setdefault(o.unit.log, []).append(o.result)
    out: dict[str, ReplayResult] = {}
    for log_name, tasks in logs:
        segs = sorted(by_log.get(log_name, []), key=lambda s: s.index)
        if segs:
            out[log_name] = ReplayResult(tasks[0].plan, segs, executor.workers, run.wall_s)
    return FleetReplay(out, run)


@dataclass
class FleetCheck:
    """``logs``: log -> its :class:`CheckResult` (logs whose every segment was read)."""

    logs: dict[str, CheckResult]
    run: FleetRun
    spans: dict[str, list[tuple[int | None, int | None]]] = field(default_factory=dict)  # per segment: first, last ns

    @property
    def ok(self) -> bool:
        return (
            all(not r.violations for r in self.logs.values())
            and not self.run.failed
            and not self.run.interrupted
            and not any(r.timeline.damage for r in self.logs.values())
        )

    def digest(self) -> str:
        """sha256 over every log's violations, damage and records, by log name: equal for any executor."""
        body = {
            short_name(k): {
                "violations": [asdict(v) for v in r.violations],
                "damage": [asdict(d) for d in r.timeline.damage],
                "records": [asdict(e) for e in r.timeline.events],
            }
            for k, r in self.logs.items()
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def check_fleet(
    paths: Iterable[Path | str] | Path | str,
    executor: Executor,
    *,
    only: Iterable[str] | None = None,
    on_outcome: Callable[[Outcome], None] | None = None,
    on_skip: Callable[[Path, str], None] | None = None,
    **overrides: Any,
) -> FleetCheck:
    """Check every log under ``paths``: segments read on ``executor``, contracts per log here, with
    the bounds of each log's own configuration and ``overrides`` (``deadline_ms``, ``slack_ms``,
    ``wait_timeout_ms``) on top, as :func:`~chestnut.node.offline.contracts.check_log`. ``on_skip``
    (:func:`group_logs`): a log file found in a walk that is not a regular file (a FIFO: never opened) is
    named to it and left out, the rest checked; without it such a file is refused. Raises
    ``FileNotFoundError`` (no log) and ``KeyError`` (unknown contract) before any unit runs."""
    only = list(only) if only is not None else None
    unknown = [n for n in only or () if n not in CONTRACTS]
    if unknown:  # before any unit runs (check_timeline says the same, after them)
        raise KeyError(f"unknown contract {unknown[0]!r}; known: {', '.join(CONTRACTS)}")
    groups = group_logs(paths, on_skip=on_skip)
    tasks = [
        (log_name, [SegmentTask(i, str(f), None, _NO_PLAN) for i, f in enumerate(files)]) for log_name, files in groups
    ]
    run = _execute(executor, units_of(KIND_EXTRACT, tasks), on_outcome)
    extracts: dict[str, dict[int, FileExtract]] = {}
    for o in run.outcomes:
        if isinstance(o.result, FileExtract):
            extracts.setdefault(o.unit.log, {})[o.unit.index] = o.result
    out: dict[str, CheckResult] = {}
    spans: dict[str, list[tuple[int | None, int | None]]] = {}
    for log_name, files in groups:
        got = extracts.get(log_name, {})
        if len(got) != len(files):  # a segment failed or was cancelled: no verdict on a partial log
            continue
        tl = Timeline.from_extracts([got[i] for i in range(len(files))])
        config, origin = tl.node_config(), "the log's node initData"
        if not config:
            config, origin = default_node_config()
            origin += " (the log carries no node configuration)"
        params = CheckParams.from_config(config, **overrides)
        out[log_name] = CheckResult(tl, params, check_timeline(tl, params, only), origin)
        spans[log_name] = [(got[i].first_ns, got[i].last_ns) for i in range(len(files))]
    return FleetCheck(out, run, spans)


_NO_PLAN = ReplayPlan("ppocr", None, None)  # extract units carry no plan; SegmentTask wants one


# ---------------------------------------------------------------- the fleet table (pure)


def failovers(tl: Timeline) -> dict[str, int]:
    """Entries into ``degraded`` by cause (the reason up to its first ``:``)."""
    out: dict[str, int] = {}
    prev = ""
    for s in tl.node_states:
        if s.state == "degraded" and prev != "degraded":
            cause = s.reason.split(":", 1)[0].strip() or "unknown"
            out[cause] = out.get(cause, 0) + 1
        prev = s.state
    return out


@dataclass(frozen=True)
class LogRow:
    """One log of the fleet table. Latencies in ms (None: no output)."""

    log: str
    segments: int
    frames: int
    mismatches: int
    violations: int
    damage: int
    failovers: dict[str, int]
    exec_ms: tuple[float, float] | None  # p50, p99
    age_ms: tuple[float, float] | None
    model_mismatches: int = 0
    damaged_files: int = 0  # the distinct files of the ``damage`` records

    @property
    def problems(self) -> int:
        return self.mismatches + self.violations + self.damage + self.model_mismatches


def _p(vals: Sequence[float]) -> tuple[float, float] | None:
    return (float(np.percentile(vals, 50)), float(np.percentile(vals, 99))) if vals else None


def log_row(
    log: str,
    tl: Timeline,
    segments: int,
    *,
    mismatches: int = 0,
    violations: int = 0,
    model_mismatches: int = 0,
    damage: Sequence[DamageRec] | None = None,
) -> LogRow:
    """``damage``: the log's damage records, when more than the timeline's (replay's: with its damaged videos);
    else the timeline's own."""
    damage = tl.damage if damage is None else damage
    return LogRow(
        short_name(log),
        segments,
        len(tl.frames),
        mismatches,
        violations,
        len(damage),
        failovers(tl),
        _p([o.execution_time_s * 1e3 for o in tl.outputs]),
        _p([o.frame_age_s * 1e3 for o in tl.outputs]),
        model_mismatches,
        damaged_files(damage),
    )


def replay_rows(fleet: FleetReplay) -> list[LogRow]:
    """The fleet table of a replay, worst log first (most problems, then name)."""
    rows = [
        log_row(
            k,
            r.timeline(),
            len(r.segments),
            mismatches=len(r.mismatches),
            model_mismatches=len(r.model_mismatches),
            damage=r.damage,  # the log files' damage and the damaged videos
        )
        for k, r in fleet.logs.items()
    ]
    return sorted(rows, key=lambda r: (-r.problems, r.log))


def check_rows(fleet: FleetCheck) -> list[LogRow]:
    rows = [log_row(k, r.timeline, len(r.timeline.files), violations=len(r.violations)) for k, r in fleet.logs.items()]
    return sorted(rows, key=lambda r: (-r.problems, r.log))


def totals(rows: Sequence[LogRow], tls: Sequence[Timeline]) -> LogRow:
    """One row over the whole fleet (latency percentiles over every output, not averaged per log)."""
    causes: dict[str, int] = {}
    for r in rows:
        for c, n in r.failovers.items():
            causes[c] = causes.get(c, 0) + n
    outs = [o for tl in tls for o in tl.outputs]
    return LogRow(
        f"all {len(rows)} log(s)",
        sum(r.segments for r in rows),
        sum(r.frames for r in rows),
        sum(r.mismatches for r in rows),
        sum(r.violations for r in rows),
        sum(r.damage for r in rows),
        dict(sorted(causes.items())),
        _p([o.execution_time_s * 1e3 for o in outs]),
        _p([o.frame_age_s * 1e3 for o in outs]),
        sum(r.model_mismatches for r in rows),
        sum(r.damaged_files for r in rows),
    )


@dataclass(frozen=True)
class SegmentRow:
    """One segment with problems: ``first`` says the first of them."""

    log: str
    index: int
    path: str
    problems: int
    first: str


def replay_segment_rows(fleet: FleetReplay) -> list[SegmentRow]:
    rows = []
    for k, r in fleet.logs.items():
        for s in r.segments:
            bad = [f for f in s.frames if not f.ok]
            n = len(bad) + len(s.damage)
            if n:
                first = (
                    damage_line(s.damage[0]).removeprefix(f"{s.damage[0].path}: ")
                    if s.damage
                    else f"frame {bad[0].frame_id}: {bad[0].kind}: {bad[0].detail}"
                )
                rows.append(SegmentRow(short_name(k), s.index, s.path, n, first))
    return sorted(rows, key=lambda r: (-r.problems, r.log, r.index))


def _segment_of(spans: Sequence[tuple[int | None, int | None]], t_ns: int) -> int:
    """The segment whose (first, last) logMonoTime span holds ``t_ns``, else the last one begun before it."""
    for i, (a, b) in enumerate(spans):
        if a is not None and b is not None and a <= t_ns <= b:
            return i
    return max((i for i, (a, _b) in enumerate(spans) if a is not None and a <= t_ns), default=0)


def check_segment_rows(fleet: FleetCheck) -> list[SegmentRow]:
    """Segments with violations (placed by time in the segment that logged them) or damage."""
    rows = []
    for k, r in fleet.logs.items():
        tl = r.timeline
        per: dict[int, list[str]] = {}
        for d in tl.damage:
            per.setdefault(tl.files.index(d.path) if d.path in tl.files else 0, []).append(
                f"byte {d.offset}: {d.reason}"
            )
        for v in r.violations:
            per.setdefault(_segment_of(fleet.spans.get(k, []), v.t_ns), []).append(f"{v.contract}: {v.message}")
        for i, what in per.items():
            rows.append(SegmentRow(short_name(k), i, tl.files[i] if i < len(tl.files) else "", len(what), what[0]))
    return sorted(rows, key=lambda r: (-r.problems, r.log, r.index))


# ---------------------------------------------------------------- printing


def _ms(p: tuple[float, float] | None) -> str:
    return "-" if p is None else f"{p[0]:.1f}/{p[1]:.1f}"


def _causes(c: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


TABLE_HEADERS = (
    "log",
    "segments",
    "frames",
    "mismatches",
    "violations",
    "damaged",
    "failovers by cause",
    "exec p50 / p99 ms",
    "frame age p50 / p99 ms",
)


TERMINAL_HEADERS = ("log", "segs", "frames", "mism", "viol", "dmg", "failovers", "exec ms p50/p99", "age ms p50/p99")


def row_cells(r: LogRow) -> tuple[str, ...]:
    mm = str(r.mismatches) + (f" (+{r.model_mismatches} model id)" if r.model_mismatches else "")
    return (
        r.log,
        str(r.segments),
        str(r.frames),
        mm,
        str(r.violations),
        str(r.damaged_files) + (f" ({r.damage} records)" if r.damage > r.damaged_files else ""),
        _causes(r.failovers),
        _ms(r.exec_ms),
        _ms(r.age_ms),
    )


def run_line(run: FleetRun) -> str:
    """One line on the executor's work: segments and frames per second, retries, failures."""
    n = len([o for o in run.outcomes if not o.error])
    frames = sum(
        len(o.result.frames)
        if isinstance(o.result, SegmentResult)
        else sum(1 for r in o.result.records if r.service == "cameraFrame")
        if isinstance(o.result, FileExtract)
        else 0
        for o in run.outcomes
    )
    rate = n / run.wall_s if run.wall_s > 0 else 0.0
    fps = frames / run.wall_s if run.wall_s > 0 else 0.0
    first = run.first_result_s
    parts = [
        f"{run.executor}: {n} of {run.units} segment(s), {frames} frames in {run.wall_s:.2f} s "
        f"({rate:.2f} segments/s, {fps:.1f} frames/s; first result after "
        f"{'-' if first is None else f'{first:.2f} s'})"
    ]
    if run.retried:
        parts.append(f"{len(run.retried)} segment(s) run again after their worker died")
    if run.failed:
        parts.append(f"{len(run.failed)} segment(s) failed")
    if run.interrupted:
        parts.append(f"INTERRUPTED ({run.stopped_by}): only the segments that finished are counted")
    return "; ".join(parts)


def print_fleet(
    rows: list[LogRow], total: LogRow, segs: list[SegmentRow], run: FleetRun, console: Any, title: str, top: int = 20
) -> None:
    from rich.table import Table

    t = Table(
        title=f"{title}: {len(rows)} log(s), worst first" + (f" (top {top})" if len(rows) > top else ""),
        show_edge=False,
    )
    if not console.is_terminal:  # a file or a pipe: the table's own width, not 80 columns
        console.width = max(console.width, 160)
    longest = max((len(r.log) for r in [*rows[:top], total]), default=3)
    for h, short in zip(TABLE_HEADERS, TERMINAL_HEADERS, strict=True):
        if h == "log":
            t.add_column(short, no_wrap=True, min_width=longest)
        elif h == "failovers by cause":
            t.add_column(short, ratio=1)
        else:
            t.add_column(short, justify="right", no_wrap=True)
    for r in rows[:top]:
        cells = row_cells(r)
        t.add_row(*[f"[red]{c}[/red]" if r.problems else c for c in cells])
    t.add_row(*[f"[bold]{c}[/bold]" for c in row_cells(total)])
    console.print(t)
    if segs:
        s = Table(
            title=f"segments with problems, worst first (top {min(top, len(segs))} of {len(segs)})", show_edge=False
        )
        for h in ("log", "segment", "problems", "first"):
            s.add_column(h)
        for sr in segs[:top]:
            s.add_row(sr.log, str(sr.index), str(sr.problems), sr.first)
        console.print(s)
    for o in run.failed:
        console.print(f"[red]failed: {o.unit.path}: {o.error}[/red]")
    console.print(run_line(run))


def write_fleet_report(
    out_dir: Path | str,
    title: str,
    rows: list[LogRow],
    total: LogRow,
    segs: list[SegmentRow],
    run: FleetRun,
    per_log: Sequence[tuple[str, Callable[[Path], Path]]] = (),
) -> Path:
    """``index.html`` with the verdict, the fleet table and the worst segments, and each log of
    ``per_log`` (``(name, writer)``, at most :data:`REPORT_LOGS`) given its own report under ``logs/``.
    The directory and files follow ``msgs/outdir.py`` (0700 / 0600, no symlink followed); raises
    :class:`~chestnut.msgs.outdir.OutputDirError` (one line) for an unfit ``out_dir``."""
    from chestnut.node.offline.report import _CSS, _table

    out = private_dir(out_dir, ("index.html",))
    links: dict[str, str] = {}
    for name, writer in list(per_log)[:REPORT_LOGS]:
        index = writer(out / "logs" / name)
        links[name] = str(index.relative_to(out))
    bad = total.problems > 0 or bool(run.failed) or run.interrupted
    verdict = (
        f"<p class='verdict {'fail' if bad else 'ok'}'>{'FAIL' if bad else 'PASS'}: {total.mismatches} "
        f"replay mismatch(es), {total.violations} contract violation(s), "
        f"{damage_count(total.damaged_files, total.damage)}, "
        f"{len(run.failed)} failed segment(s){', interrupted' if run.interrupted else ''}</p>"
    )
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>",
        verdict,
        f"<p>{html.escape(run_line(run))}</p>",
        "<h2>fleet (worst log first)</h2>",
        _table(
            TABLE_HEADERS,
            [row_cells(r) for r in [*rows, total]],
            ["bad" if r.problems else "good" for r in rows] + [""],
        ),
    ]
    if links:
        parts.append(
            "<h2>logs with their own report</h2><ul>"
            + "".join(f"<li><a href='{html.escape(href)}'>{html.escape(name)}</a></li>" for name, href in links.items())
            + "</ul>"
        )
    parts.append(f"<h2>segments with problems ({len(segs)})</h2>")
    parts.append(
        _table(
            ("log", "segment", "file", "problems", "first"),
            [(s.log, s.index, s.path, s.problems, s.first) for s in segs],
            ["bad"] * len(segs),
        )
        if segs
        else "<p>none</p>"
    )
    if run.failed:
        parts += [
            "<h2>failed segments</h2>",
            _table(
                ("file", "error", "attempts"),
                [(o.unit.path, o.error, o.attempts) for o in run.failed],
                ["bad"] * len(run.failed),
            ),
        ]
    parts.append("</body></html>")
    return write_private(out / "index.html", "\n".join(parts))


# ---------------------------------------------------------------- a synthetic fleet


def check_copies(copies: int) -> int:
    """``copies`` itself when :func:`make_fleet` can make that many copies of a log, 1..:data:`MAX_COPIES`
    (also ``chestnut fleet make --copies``, ``node/offline/fleet_cli.py``); raises ``ValueError`` ``"copies
    must be in 1..100000, got N"`` otherwise."""
    if not 1 <= copies <= MAX_COPIES:
        raise ValueError(f"copies must be in 1..{MAX_COPIES}, got {copies}")
    return copies


READABLE_FIX = "give a log that chestnut check reads (rlog.zst / rlog.mcap) or a folder of them"


class NotALogError(ValueError):
    """``fleet make --from`` gives no log that ``chestnut check`` reads (:func:`make_fleet`); ``str()`` is one line:
    the path, why and what to give."""


def unreadable(path: Path | str) -> tuple[str, str] | None:
    """None when the log file at ``path`` gives a message to the reader ``chestnut check`` reads it with
    (``msgs/logfile.py`` ``SegmentFileReader``, read up to its first message by ``first_item``, as
    ``holds_only_json`` reads; damage before or after that message is the log's, which check reports as it reads the
    copy), or is read whole without damage and holds no message at all (a clean, empty log: a writer closed before
    its first message; check reads it as 0 frames, and its copies the same). Else ``(why, what to give)``: the
    reader's first damage (``"byte 0: empty file"``, ``"byte 0: zstd: ..."``, ``"byte 0: not an MCAP file (bad
    magic)"``), ``"JSON channels only"`` (a Foxglove view; what to give: ``msgs/logfile.py`` ``json_only_fix``, the
    rlog.zst beside it only when there is one) or ``"only messages of a newer schema"``. Raises
    ``ValueError`` for a file whose suffix is neither ``.zst`` nor ``.mcap`` (``"PATH: not a log file (expected a
    .zst or .mcap suffix)"``, as check says it)."""
    item, reader = first_item(path, warn_json_only=False)
    if item is not None:
        return None
    if reader.json_messages:
        return "JSON channels only", json_only_fix(path)
    if reader.damage:
        return f"byte {reader.damage[0].offset}: {reader.damage[0].reason}", READABLE_FIX
    if reader.unknown_members:
        return "only messages of a newer schema", READABLE_FIX
    return None  # a clean log of no message: check reads it (0 frames), so it is copied as any other


def _refuse_unreadable(source: Path, files: Sequence[Path]) -> None:
    """Raise :class:`NotALogError` unless one of ``files`` (the log files under ``source``) gives a message or is a
    clean log of none (:func:`unreadable`; read in order, up to the first that is)."""
    refused: list[tuple[Path, str, str]] = []
    for f in files:
        try:
            found = unreadable(f)
        except ValueError as e:  # a file named by --from that is neither .zst nor .mcap
            raise NotALogError(f"{e}; {READABLE_FIX}") from None
        if found is None:
            return
        refused.append((f, *found))
    f, why, fix = refused[0]
    if list(files) == [source]:  # --from names the file itself
        raise NotALogError(f"{f}: not a readable log ({why}); {fix}")
    more = f"; {len(refused) - 1} more log file(s) without a message" if len(refused) > 1 else ""
    raise NotALogError(f"{source}: no readable log in it ({f}: {why}{more}); {fix}")


def make_fleet(source: Path | str, copies: int, out: Path | str, *,
               on_skip: Callable[[Path, str], None] | None = None) -> list[Path]:
    """Copy every log under ``source`` ``copies`` times into ``out`` as new routes
    ``<route>-<k:05d>`` (k from 1), segment directories ``<route>-<k>--<n>`` with the files byte for
    byte, each log file named as ``chestnut check`` and ``replay`` find it in a folder: ``rlog.zst`` / ``rlog.mcap``
    (:data:`COPY_NAME` and the file's own format suffix, whatever its name was). A log file outside a segment
    directory (``odd/copy_rlog.zst``) is a route of its own named after the file without its format suffix
    (``copy_rlog-00001--0/rlog.zst``). Each segment file goes with the video files beside it
    (:func:`~chestnut.msgs.video.segment_videos`: a video-logged segment replays from its copy) (new directories
    0700, files 0600, no symlink followed). Returns the segment directories written.

    Before anything is written, ``source`` is read up to its first message (:func:`unreadable`: the reader
    ``chestnut check`` reads with): a log file that gives none and is not a clean log of zero messages (0 bytes, not
    zstd or MCAP, damaged from its first byte, JSON channels only), or a folder none of whose log files gives one
    or is clean, raises :class:`NotALogError` (a ``ValueError``, one line naming the file and why). A clean log of
    zero messages (its writer closed before the first) is copied as any other: check reads it, and its copies, as
    0 frames. Past that, every log file is copied byte for byte, damaged ones too: ``chestnut check`` of a copy
    reports what it reports of the source.

    ``on_skip`` (:func:`group_logs`, as ``check_fleet`` and ``replay_fleet`` take it): a log file found in a folder
    that is not a regular file (a FIFO, socket, device or symlink: never opened, a FIFO would block the copy for good)
    is left out and named to it, the rest copied; without it such a file is refused. A path ``source`` names itself,
    and a video file, are refused either way (``NotRegularFileError``).

    Raises ``FileNotFoundError`` (no log under ``source``; a video or log
    file that is not a regular file, ``msgs/video.py`` ``NotRegularFileError``), ``FileExistsError`` (a
    route already in ``out``: nothing is overwritten), ``ValueError`` (``copies`` not in
    1..:data:`MAX_COPIES`; :class:`NotALogError`, also for a log file named by ``source`` that is neither
    ``.zst`` nor ``.mcap``; two logs under ``source`` whose copies would share their route ids: the same route id in
    two folders, or two ``rlog.zst`` outside segment folders), :class:`~chestnut.msgs.outdir.OutputDirError`
    (``out`` unfit: ``msgs/outdir.py`` ``private_dir``; nothing is written; or a full disk, ENOSPC / EDQUOT / EFBIG
    from write(2)). A copy that stops on any error removes the folders and files it made."""
    check_copies(copies)
    groups = group_logs(source, on_skip=on_skip)
    _refuse_unreadable(Path(source), [f for _, files in groups for f in files])
    out = Path(out)
    plan: list[tuple[Path, Path, bool]] = []  # (from, to, follow a symlink: a log file named by hand may be one)
    bases: dict[str, str] = {}  # route id of the copies -> the log they copy
    for log_name, files in groups:
        base = Path(log_name).name
        if parse_segment_dir(files[0].parent.name) is None:  # a file of its own: its name less the format suffix
            base = Path(base).stem
        if (other := bases.setdefault(base, log_name)) != log_name:
            raise ValueError(f"{other} and {log_name} would both be copied as route {base}-00001 ...: copy them "
                             "one at a time, into different OUT folders")
        with_videos = [(f, segment_videos(f)) for f in files]
        for k in range(1, copies + 1):
            for n, (f, videos) in enumerate(with_videos):
                seg = parse_segment_dir(f.parent.name)
                dest = out / f"{base}-{k:05d}--{seg[1] if seg else n}"
                plan += [(f, dest / f"{COPY_NAME}{f.suffix}", True), *((v, dest / v.name, False) for v in videos)]
    dirs = sorted({d.parent for _, d, _ in plan})
    out_made = not os.path.lexists(out)
    private_dir(out)  # made 0700, or refused: a symlink, not a directory, another user's, group/other-writable
    taken = [d for d in dirs if os.path.lexists(d)]
    if taken:
        raise FileExistsError(f"{taken[0]} already exists: give an empty OUT directory")
    made: list[Path] = [out] if out_made else []  # removed again, newest first, when the copy stops
    try:
        for d in dirs:
            d.mkdir(mode=0o700)
            made.append(d)
        for src, dest, follow in plan:
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            made.append(dest)
            with os.fdopen(fd, "wb") as w, os.fdopen(open_regular(src, follow=follow), "rb") as r:
                while chunk := r.read(1 << 20):
                    w.write(chunk)
    except BaseException as e:
        for p in reversed(made):
            with contextlib.suppress(OSError):
                p.rmdir() if p in dirs or p == out else p.unlink()
        # write(2): the disk or the user's quota is full, or a file reached the process's RLIMIT_FSIZE (`ulimit -f`)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise OutputDirError(out, f"cannot be written ({e.strerror})", "free space or give another directory") \
                from None
        raise
    return dirs


__all__ = [
    "FleetCheck",
    "FleetReplay",
    "FleetRun",
    "LogRow",
    "NotALogError",
    "SegmentRow",
    "check_fleet",
    "check_rows",
    "check_segment_rows",
    "failovers",
    "group_logs",
    "log_row",
    "make_fleet",
    "print_fleet",
    "replay_fleet",
    "replay_rows",
    "replay_segment_rows",
    "route_of",
    "totals",
    "write_fleet_report",
]
