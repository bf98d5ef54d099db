"""``chestnut replay LOG [--report DIR]``: the command line of :mod:`~chestnut.node.offline.replay`.

Prints the models' identities, the frames per outcome, the largest difference per tensor and the
frames that differ most. Exit status: 0 when every frame matched, 1 on a mismatch, a model id
mismatch or a damaged file, 2 when replay cannot start (no log, no usable model).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from chestnut.node.offline.replay import (
    DEFAULT_TOL,
    ENGINES,
    EXCUSED,
    KIND_OK,
    SOURCES,
    ReplayError,
    ReplayResult,
    replay,
)
from chestnut.node.offline.report import write_report
from chestnut.node.offline.timeline import SLACK_MS

log = logging.getLogger("chestnut.replay")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="+", type=Path, metavar="LOG", help="log files or directories (rlog.zst / rlog.mcap)")
    p.add_argument("--model", type=Path, help="primary model (default: the path in the log's config)")
    p.add_argument("--fallback-model", type=Path, help="fallback model (default: the log's config)")
    p.add_argument("--source", choices=SOURCES, default="logged",
                   help="replay each frame with the source that served it (logged) or force one")
    p.add_argument("--primary-engine", choices=("auto", *ENGINES), default="auto",
                   help="engine for primary-served frames: auto (default: the engine the log's twinState names, "
                   "else tinygrad), tinygrad (the twin's tinygrad engine and the cpu dock run the same kernels) or "
                   "onnxruntime (a twin run with --engine onnxruntime)")
    p.add_argument("--tol", type=float, default=DEFAULT_TOL, help=f"tolerance (default {DEFAULT_TOL:g})")
    p.add_argument("--workers", type=int, default=1, help="processes replaying segments in parallel (default 1)")
    p.add_argument("--report", type=Path, metavar="DIR", help="write plots and an HTML report to DIR")
    p.add_argument("--slack-ms", type=float, default=SLACK_MS, help="slack on the answer deadline for frames "
                   f"in flight at the log's end (default {SLACK_MS:g})")
    p.add_argument("--no-jit-cache", action="store_true", help="compile the tinygrad model afresh in every process")
    p.add_argument("--top", type=int, default=10, help="frames listed with the largest differences (default 10)")


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
    summary = Table(title=f"replay (tol {plan.tol:g}, source {plan.source}, preprocess {plan.preprocess})",
                    show_edge=False)
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
    worst = sorted((f for f in frames if f.max_abs_diff > 0 or not f.ok), key=lambda f: (f.ok, -f.max_abs_diff,
                                                                                          f.frame_id))
    if worst and top > 0:
        t = Table(title=f"frames with the largest differences (top {top})", show_edge=False)
        for col in ("frame", "logged", "replayed", "outcome", "max abs diff", "detail"):
            t.add_column(col)
        for f in worst[:top]:
            t.add_row(str(f.frame_id), f.logged_source, f.replayed_with, f.kind, f"{f.max_abs_diff:.6g}",
                      f.detail or "-")
        console.print(t)
    for dmg in result.damage:
        console.print(f"[red]log damage: {dmg.path}: byte {dmg.offset}: {dmg.reason}[/red]")
    infer = sum(s.infer_s for s in result.segments)
    n = sum(1 for f in frames if f.replayed_with)
    rate = n / result.wall_s if result.wall_s > 0 else 0.0
    console.print(f"{len(result.segments)} segment(s), {n} frames replayed in {result.wall_s:.2f} s "
                  f"({rate:.1f} frames/s with {result.workers} worker(s); inference {infer:.2f} s)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from chestnut.backend.errors import ChestnutError

    console = Console()
    try:
        result = replay(args.logs, workers=args.workers, progress=console.is_terminal, model=args.model,
                        fallback_model=args.fallback_model, source=args.source, tol=args.tol, slack_ms=args.slack_ms,
                        jit_cache=not args.no_jit_cache, primary_engine=args.primary_engine)
    except (FileNotFoundError, ReplayError, ValueError, ChestnutError) as e:  # ChestnutError: a model that won't load
        log.error("%s", e)
        return 2
    print_result(result, console, args.top)
    if args.report is not None:
        index = write_report(args.report, result.timeline(), replay=result, title="chestnut replay")
        console.print(f"report: {index}")
    bad = len(result.mismatches) + len(result.model_mismatches) + len(result.damage)
    console.print(f"[{'red' if bad else 'green'}]{len(result.mismatches)} mismatch(es), "
                  f"{len(result.model_mismatches)} model id mismatch(es), {len(result.damage)} damaged file(s)[/]")
    return 1 if bad else 0


