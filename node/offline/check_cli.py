"""``chestnut check LOG [--report DIR]``: the command line of :mod:`~chestnut.node.offline.contracts`.

Prints the bounds used, one row per contract with its violation count, and every violation with its
time (s since the log's first message) and frame id. Exit status: 0 when every contract held, 1 when
any was violated, 2 when the log cannot be read (no log file, an unknown contract name).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from chestnut.node.offline.contracts import CONTRACTS, CheckResult, check_log
from chestnut.node.offline.report import write_report
from chestnut.node.offline.timeline import SLACK_MS

log = logging.getLogger("chestnut.check")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="+", type=Path, metavar="LOG", help="log files or directories (rlog.zst / rlog.mcap)")
    p.add_argument("--report", type=Path, metavar="DIR", help="write plots and an HTML report to DIR")
    p.add_argument("--contract", action="append", metavar="NAME",
                   help=f"check only this contract (repeatable); known: {', '.join(CONTRACTS)}")
    p.add_argument("--deadline-ms", type=float, help="per-frame deadline (default: the log's config, else 150)")
    p.add_argument("--slack-ms", type=float, help=f"publishing slack on every bound (default {SLACK_MS:g})")
    p.add_argument("--wait-timeout-ms", type=float, help="device wait timeout (default: the log's config, else 3000)")


def print_violations(result: CheckResult, console: Any) -> None:
    from rich.table import Table

    tl = result.timeline
    summary = Table(title="contracts", show_edge=False)
    summary.add_column("contract")
    summary.add_column("violations", justify="right")
    for name, n in result.counts().items():
        summary.add_row(name, f"[red]{n}[/red]" if n else "[green]0[/green]")
    console.print(summary)
    if result.violations:
        table = Table(title="violations", show_edge=False)
        for col, just in (("t (s)", "right"), ("frame", "right"), ("contract", "left"), ("what", "left")):
            table.add_column(col, justify=just)  # type: ignore[arg-type]
        for v in result.violations:
            table.add_row(f"{tl.seconds(v.t_ns):.3f}", "-" if v.frame_id is None else str(v.frame_id), v.contract,
                          v.message)
        console.print(table)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=False)
    try:
        result = check_log(args.logs, only=args.contract, deadline_ms=args.deadline_ms, slack_ms=args.slack_ms,
                           wait_timeout_ms=args.wait_timeout_ms)
    except (FileNotFoundError, KeyError, ValueError) as e:
        log.error("%s", e)
        return 2
    tl = result.timeline
    p = result.params
    console.print(f"{len(tl.files)} file(s), {tl.seconds(tl.end_ns):.1f} s, {len(tl.frames)} frames, "
                  f"{len(tl.outputs)} outputs; deadline {p.deadline_ms:g} ms, slack {p.slack_ms:g} ms, "
                  f"wait timeout {p.wait_timeout_ms:g} + {p.hang_margin_ms:g} ms (configuration: "
                  f"{result.config_origin})")
    print_violations(result, console)
    if args.report is not None:
        index = write_report(args.report, tl, violations=result.violations, title="chestnut check")
        console.print(f"report: {index}")
    n = len(result.violations)
    console.print(f"[{'red' if n else 'green'}]{n} violation(s)[/]")
    return 1 if n else 0
