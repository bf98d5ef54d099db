"""``chestnut replay LOG... [--report DIR] [--executor local|ray]``: the command line of
:mod:`~chestnut.node.offline.replay` over one log or a fleet (:mod:`~chestnut.node.offline.fleet`).

One log: the models' identities, the frames per outcome, the largest difference per tensor and the
frames that differ most. Many logs: the fleet table, worst log first, and the worst segments. Exit
status: 0 when every frame matched (a ``transport_loss`` or ``not_replayable`` frame is counted, not a
mismatch), 1 on a mismatch, a model id mismatch, a damaged file or a segment
that failed, 2 when replay cannot start (no log, a path the OS cannot look up, only ``.mcap`` files of JSON
channels (``chestnut record``'s Foxglove view: one line naming it and the rlog.zst to give), no usable model, no
Ray), 130 after Ctrl-C (what finished is printed), 141 when the reader of its output went away (``| head``:
quietly, ``launch/cli.py``).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chestnut.msgs.argtypes import checked_float, checked_int, path_arg
from chestnut.msgs.outdir import OutputDirError
from chestnut.node.config import MAX_AGREEMENT_TOL, MAX_MS
from chestnut.node.offline.executor import ExecutorError
from chestnut.node.offline.fleet import (
    print_fleet,
    replay_fleet,
    replay_rows,
    replay_segment_rows,
    run_line,
    short_name,
    totals,
    write_fleet_report,
)
from chestnut.node.offline.fleet_cli import (
    EXIT_INTERRUPTED,
    EXIT_REFUSED,
    add_executor_arguments,
    open_executor,
    progress,
    readable_logs,
    refuse,
    skip_once,
    slack_ms,
    stdout_console,
)
from chestnut.node.offline.replay import (
    DEFAULT_TOL,
    ENGINES,
    EXCUSED,
    KIND_NOT_REPLAYABLE,
    KIND_OK,
    KIND_TRANSPORT_LOSS,
    SOURCES,
    ReplayError,
    ReplayResult,
    damage_line,
)
from chestnut.node.offline.report import write_report
from chestnut.node.offline.timeline import SLACK_MS, damage_count, damaged_files

log = logging.getLogger("chestnut.replay")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="+", type=path_arg, metavar="LOG",
                   help="log files or directories (rlog.zst / rlog.mcap)")
    p.add_argument("--model", type=path_arg, help="primary model (default: the path in the log's config)")
    p.add_argument("--fallback-model", type=path_arg, help="fallback model (default: the log's config)")
    p.add_argument(
        "--source",
        choices=SOURCES,
        default="logged",
        help="replay each frame with the source that served it (logged) or force one",
    )
    p.add_argument(
        "--primary-engine",
        choices=("auto", *ENGINES),
        default="auto",
        help="engine for primary-served frames: auto (default: the engine the log's twinState names, "
        "else tinygrad), tinygrad (the twin's tinygrad engine and the cpu dock run the same kernels) or "
        "onnxruntime (a twin run with --engine onnxruntime)",
    )
    p.add_argument(
        "--tol",
        type=tolerance,
        default=DEFAULT_TOL,
        help=f"values a, b match when |a-b| <= max(tol, tol*max(|a|,|b|)); > 0 and <= {MAX_AGREEMENT_TOL:g} "
        f"(default {DEFAULT_TOL:g})",
    )
    p.add_argument("--report", type=path_arg, metavar="DIR", help="write plots and an HTML report to DIR")
    p.add_argument(
        "--slack-ms",
        type=slack_ms,
        default=SLACK_MS,
        help=f"slack on the answer deadline for frames in flight at the log's end, ms, >= 0 and <= {MAX_MS:g} "
        f"(default {SLACK_MS:g})",
    )
    p.add_argument("--no-jit-cache", action="store_true", help="compile the tinygrad model afresh in every process")
    p.add_argument("--top", type=top_count, default=10,
                   help="frames (or, for a folder, logs) listed with the largest differences, >= 0 (default 10)")
    add_executor_arguments(p)


def top_count(text: str) -> int:
    """``--top``: how many rows to list, an int >= 0 (0: none); raises ``argparse.ArgumentTypeError`` (one line)
    otherwise (``msgs/argtypes.py`` ``checked_int``)."""
    return checked_int(text, lambda n: n >= 0, "give a number of rows >= 0 (0: none)")


def tolerance(text: str) -> float:
    """``--tol``: the comparison's tolerance, ``|a-b| <= max(tol, tol*max(|a|,|b|))``
    (:func:`~chestnut.node.validity.compare_tensors`, the node's agreement rule), > 0 (replay's own rule) and at
    most :data:`~chestnut.node.config.MAX_AGREEMENT_TOL` (1: it already takes any two values of one sign as
    equal, so a larger one checks nothing); raises ``argparse.ArgumentTypeError`` (one line) otherwise, NaN
    and inf included."""
    return checked_float(text, lambda tol: 0 < tol <= MAX_AGREEMENT_TOL,
                         f"give a tolerance, > 0 and <= {MAX_AGREEMENT_TOL:g}")


def print_result(result: ReplayResult, console: Any, top: int = 10) -> None:
    from rich.table import Table

    plan = result.plan
    console.print(f"configuration: {plan.config_origin}")
    for m in result.model_ids:
        console.print(("[red]" if not m.same_bytes else "") + m.describe() + ("[/red]" if not m.same_bytes else ""))
    frames = result.frames
    counts: dict[str, int] = {}
    for f in frames:
        counts[f.kind] = counts.get(f.kind, 0) + 1
    summary = Table(
        title=f"replay (tol {plan.tol:g}, source {plan.source}, preprocess {plan.preprocess})", show_edge=False
    )
    summary.add_column("outcome")
    summary.add_column("frames", justify="right")
    for kind in sorted(counts, key=lambda k: (k not in EXCUSED, k)):
        style = "green" if kind == KIND_OK else ("yellow" if kind in EXCUSED else "red")
        summary.add_row(f"[{style}]{kind}[/{style}]", str(counts[kind]))
    console.print(summary)
    maxima = result.tensor_maxima()
    if maxima:
        t = Table(title="largest difference per tensor", show_edge=False)
        for col in ("tensor", "max abs diff", "frame"):
            t.add_column(col)
        for name, (d, fid) in sorted(maxima.items()):
            t.add_row(name, f"{d:.6g}", str(fid))
        console.print(t)
    worst = sorted(
        (f for f in frames if f.max_abs_diff > 0 or not f.ok), key=lambda f: (f.ok, -f.max_abs_diff, f.frame_id)
    )
    if worst and top > 0:
        t = Table(title=f"frames with the largest differences (top {top})", show_edge=False)
        for col in ("frame", "logged", "replayed", "outcome", "max abs diff", "detail"):
            t.add_column(col)
        for f in worst[:top]:
            t.add_row(
                str(f.frame_id), f.logged_source, f.replayed_with, f.kind, f"{f.max_abs_diff:.6g}", f.detail or "-"
            )
        console.print(t)
    for dmg in result.damage:
        console.print(f"[red]log damage: {damage_line(dmg)}[/red]")
    infer = sum(s.infer_s for s in result.segments)
    n = sum(1 for f in frames if f.replayed_with)
    rate = n / result.wall_s if result.wall_s > 0 else 0.0
    console.print(
        f"{len(result.segments)} segment(s), {n} frames replayed in {result.wall_s:.2f} s "
        f"({rate:.1f} frames/s with {result.workers} worker(s); inference {infer:.2f} s)"
    )


def run(args: argparse.Namespace) -> int:
    from chestnut.backend.errors import ChestnutError

    console = stdout_console()  # a closed pipe: exit 141, quietly (launch/cli.py main)
    executor = open_executor(args, "chestnut replay")
    if executor is None:
        return EXIT_REFUSED
    skipped = skip_once(log)
    try:
        files = readable_logs(args.logs, skipped, "chestnut replay", "replay")  # JSON-only MCAP left out
        if files is None:
            return EXIT_REFUSED
        with progress(console, len(files)) as step:
            fleet = replay_fleet(
                files,
                executor,
                on_outcome=step,
                on_skip=skipped,
                model=args.model,
                fallback_model=args.fallback_model,
                source=args.source,
                tol=args.tol,
                slack_ms=args.slack_ms,
                jit_cache=not args.no_jit_cache,
                primary_engine=args.primary_engine,
            )
    except (FileNotFoundError, ReplayError, ValueError, ChestnutError, ExecutorError) as e:
        log.error("%s", e)  # ChestnutError: a model that won't load
        return 2
    finally:
        executor.close()
    run_ = fleet.run
    if len(fleet.logs) == 1 and run_.units == len(next(iter(fleet.logs.values())).segments):
        result = next(iter(fleet.logs.values()))  # one whole log: the log's own detail, as ever
        print_result(result, console, args.top)
        if args.executor != "local":
            console.print(run_line(run_))
        if args.report is not None:
            try:
                index = write_report(args.report, result.timeline(), replay=result, title="chestnut replay")
            except OutputDirError as e:
                return refuse("chestnut replay", f"--report {e}")
            console.print(f"report: {index}")
    else:
        rows = replay_rows(fleet)
        total_row = totals(rows, [r.timeline() for r in fleet.logs.values()])
        segs = replay_segment_rows(fleet)
        print_fleet(rows, total_row, segs, run_, console, "chestnut replay", args.top)
        for r in fleet.logs.values():
            for m in r.model_mismatches:
                console.print(f"[red]{m.describe()}[/red]")
            for dmg in r.damage:
                console.print(f"[red]log damage: {damage_line(dmg)}[/red]")
        if args.report is not None:
            worst = [(row.log, k) for row in rows for k in fleet.logs if short_name(k) == row.log and row.problems]
            per_log = [(name, _writer(fleet.logs[k])) for name, k in worst]
            try:
                index = write_fleet_report(args.report, "chestnut replay (fleet)", rows, total_row, segs, run_, per_log)
            except OutputDirError as e:
                return refuse("chestnut replay", f"--report {e}")
            console.print(f"report: {index}")
    mism = sum(len(r.mismatches) for r in fleet.logs.values())
    model_mm = sum(len(r.model_mismatches) for r in fleet.logs.values())
    damage = [d for r in fleet.logs.values() for d in r.damage]
    bad = mism + model_mm + len(damage) + len(run_.failed)
    kinds = [f.kind for r in fleet.logs.values() for f in r.not_replayed]
    console.print(
        f"[{'red' if bad else 'green'}]{mism} mismatch(es), {model_mm} model id mismatch(es), "
        f"{damage_count(damaged_files(damage), len(damage))}"
        + (f", {len(run_.failed)} failed segment(s)" if run_.failed else "")
        + f"; {kinds.count(KIND_NOT_REPLAYABLE)} not replayable, {kinds.count(KIND_TRANSPORT_LOSS)} transport loss"
        + "[/]"
    )
    if run_.interrupted:
        console.print(f"[yellow]interrupted: {len(run_.outcomes)} of {run_.units} segment(s) finished[/yellow]")
        return EXIT_INTERRUPTED
    return 1 if bad else 0


def _writer(result: ReplayResult) -> Callable[[Path], Path]:
    return lambda d: write_report(d, result.timeline(), replay=result, title=f"chestnut replay: {d.name}")
