"""``chestnut check LOG... [--report DIR] [--executor local|ray]``: the command line of
:mod:`~chestnut.node.offline.contracts` over one log or a fleet (:mod:`~chestnut.node.offline.fleet`).

One log: the bounds used, one row per contract with its violation count, and every violation with its
time (s since the log's first message) and frame id. Many logs: the fleet table, worst log first, and
the worst segments; then the inputs' anomalies (repeated or skipped camera ids, absurd timestamps, a log
that begins mid-episode), which are the inputs' faults, not the node's. Exit status: 0 when every contract
held (whatever the anomalies), 1 when any was violated or a segment failed, 2 when the check cannot start
(no log file, a path the OS cannot look up, only ``.mcap`` files of JSON channels (``chestnut record``'s Foxglove
view: one line naming it and the rlog.zst to give), an unknown contract name, no Ray), 130 after Ctrl-C (what
finished is printed), 141 when the reader of its output went away (``| head``: quietly, ``launch/cli.py``). A log file
found in a folder that is not a regular file (a FIFO ...) is skipped, one WARNING line each (:func:`skip_once`).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from chestnut.msgs.argtypes import checked_float, path_arg
from chestnut.msgs.outdir import OutputDirError
from chestnut.node.config import MAX_MS, deadline_refusal
from chestnut.node.offline.contracts import CONTRACTS, CheckParams, CheckResult, frame_deadline_ms
from chestnut.node.offline.executor import ExecutorError
from chestnut.node.offline.fleet import (
    check_fleet,
    check_rows,
    check_segment_rows,
    print_fleet,
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
from chestnut.node.offline.report import write_report
from chestnut.node.offline.timeline import SLACK_MS, OutputRec

log = logging.getLogger("chestnut.check")


def bound_ms(text: str) -> float:
    """``--deadline-ms``, ``--wait-timeout-ms``: a time bound in milliseconds, > 0 and at most
    :data:`~chestnut.node.config.MAX_MS` (a minute), the range the node's own configuration allows for both;
    raises ``argparse.ArgumentTypeError`` (one line) otherwise, NaN and inf included."""
    return checked_float(text, lambda ms: 0 < ms <= MAX_MS,
                         f"give a time in milliseconds, > 0 and <= {MAX_MS:g} (a minute)")


class BoundAction(argparse.Action):
    """``--deadline-ms``, ``--wait-timeout-ms`` (ms, each already in range: :func:`bound_ms`): the value stored,
    then, once both are given, the node's own rule for the pair (``node/config.py`` :func:`deadline_refusal`:
    ``0 < deadline < wait timeout``, what its configuration refuses) checked as they are parsed. A pair that breaks
    it is the parser's one line, exit 2 (``chestnut check: error: --deadline-ms = 5000.0; want 0 < it <
    --wait-timeout-ms (3000.0) (chestnut check --help)``), before any log is read. One flag alone is judged with
    the log's own configured other bound, as before."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        deadline, wait = getattr(namespace, "deadline_ms", None), getattr(namespace, "wait_timeout_ms", None)
        if deadline is not None and wait is not None:
            refusal = deadline_refusal(deadline, wait, "--deadline-ms", "--wait-timeout-ms")
            if refusal is not None:
                parser.error(refusal)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="+", type=path_arg, metavar="LOG",
                   help="log files or directories (rlog.zst / rlog.mcap)")
    p.add_argument("--report", type=path_arg, metavar="DIR", help="write plots and an HTML report to DIR")
    p.add_argument(
        "--contract",
        action="append",
        metavar="NAME",
        help=f"check only this contract (repeatable); known: {', '.join(CONTRACTS)}",
    )
    p.add_argument(
        "--deadline-ms",
        type=bound_ms,
        action=BoundAction,
        help=f"per-frame deadline, ms, > 0 and <= {MAX_MS:g}, below --wait-timeout-ms when both are given "
        "(default: the log's config, else 150)",
    )
    p.add_argument(
        "--slack-ms",
        type=slack_ms,
        help=f"publishing slack on every bound, ms, >= 0 and <= {MAX_MS:g} (default {SLACK_MS:g})",
    )
    p.add_argument(
        "--wait-timeout-ms",
        type=bound_ms,
        action=BoundAction,
        help=f"device wait timeout, ms, > 0 and <= {MAX_MS:g} (default: the log's config, else 3000)",
    )
    add_executor_arguments(p)


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
            table.add_row(
                f"{tl.seconds(v.t_ns):.3f}", "-" if v.frame_id is None else str(v.frame_id), v.contract, v.message
            )
        console.print(table)
    print_anomalies(result, console)
    print_restarts(result, console)


def print_restarts(result: CheckResult, console: Any) -> None:
    """Every node, worker and twin restart in the log (:mod:`~chestnut.node.offline.restarts`): its time,
    cause and the frames it cost; accounts, not violations."""
    from rich.table import Table

    from chestnut.node.offline.restarts import restarts

    found = restarts(result.timeline)
    if not found:
        return
    tl = result.timeline
    table = Table(title="restarts", show_edge=False)
    for col, just in (("t (s)", "right"), ("what", "left"), ("cause", "left"), ("frames without the primary", "right"),
                      ("back (s)", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in found:
        table.add_row(f"{tl.seconds(r.t_ns):.3f}", r.what, r.cause, str(r.frames),
                      "-" if r.back_ns is None else f"{tl.seconds(r.back_ns):.3f}")
    console.print(table)


def print_anomalies(result: CheckResult, console: Any) -> None:
    """The inputs' anomalies (:func:`~chestnut.node.offline.contracts.input_anomalies`): listed, never a
    violation."""
    from rich.table import Table

    if not result.anomalies:
        return
    tl = result.timeline
    table = Table(title="input anomalies (not the node's faults)", show_edge=False)
    for col, just in (("t (s)", "right"), ("frame", "right"), ("kind", "left"), ("what", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for a in result.anomalies:
        table.add_row(f"{tl.seconds(a.t_ns):.3f}", "-" if a.frame_id is None else str(a.frame_id), a.kind, a.message)
    console.print(table)


def deadline_words(outputs: Sequence[OutputRec], p: CheckParams) -> str:
    """The deadline ``deadline_or_fallback`` judged the primary's outputs by, for the check's header: each frame's own
    (``modelOutput.deadline``, the adaptive deadline in force, at most ``p.deadline_ms``: ``contracts.py``
    ``frame_deadline_ms``), said with its value at the end and its range, and the ceiling; ``p.deadline_ms`` alone
    for a log whose primary outputs carry none (an older log). It said ``deadline 150 ms`` -- the ceiling -- for a
    node that ran at 45 ms."""
    own = [ms for o in outputs if o.source == "primary" for ms, which in [frame_deadline_ms(o, p)]
           if which == "deadline in force"]
    if not own:
        return f"deadline {p.deadline_ms:g} ms"
    return (f"deadline per frame {own[-1]:.1f} ms at the end ({min(own):.1f} .. {max(own):.1f} ms; adaptive, "
            f"ceiling {p.deadline_ms:g} ms)")


def run(args: argparse.Namespace) -> int:
    console = stdout_console()  # a closed pipe: exit 141, quietly (launch/cli.py main)
    executor = open_executor(args, "chestnut check")
    if executor is None:
        return EXIT_REFUSED
    skipped = skip_once(log)
    try:
        files = readable_logs(args.logs, skipped, "chestnut check", "check")  # JSON-only MCAP left out
        if files is None:
            return EXIT_REFUSED
        with progress(console, len(files)) as step:
            fleet = check_fleet(
                files,
                executor,
                only=args.contract,
                on_outcome=step,
                on_skip=skipped,
                deadline_ms=args.deadline_ms,
                slack_ms=args.slack_ms,
                wait_timeout_ms=args.wait_timeout_ms,
            )
    except (FileNotFoundError, KeyError, ValueError, ExecutorError) as e:
        log.error("%s", e.args[0] if isinstance(e, KeyError) and e.args else e)
        return 2
    finally:
        executor.close()
    run_ = fleet.run
    if len(fleet.logs) == 1 and not run_.failed and not run_.interrupted:
        result = next(iter(fleet.logs.values()))  # one log: its own detail, as ever
        tl = result.timeline
        p = result.params
        if tl.wall_start():  # one clock with the launch summary and the report
            console.print(f"times: s since the log's first message, {tl.wall_start()}")
        console.print(
            f"{len(tl.files)} file(s), {tl.seconds(tl.end_ns):.1f} s, {len(tl.frames)} frames, "
            f"{len(tl.outputs)} outputs; {deadline_words(tl.outputs, p)}, slack {p.slack_ms:g} ms, "
            f"wait timeout {p.wait_timeout_ms:g} + {p.hang_margin_ms:g} ms (configuration: "
            f"{result.config_origin})"
        )
        print_violations(result, console)
        if args.executor != "local":
            console.print(run_line(run_))
        if args.report is not None:
            try:
                index = write_report(args.report, tl, violations=result.violations, title="chestnut check")
            except OutputDirError as e:
                return refuse("chestnut check", f"--report {e}")
            console.print(f"report: {index}")
    else:
        rows = check_rows(fleet)
        total_row = totals(rows, [r.timeline for r in fleet.logs.values()])
        segs = check_segment_rows(fleet)
        print_fleet(rows, total_row, segs, run_, console, "chestnut check")
        for r in fleet.logs.values():
            for dmg in r.timeline.damage:
                console.print(f"[red]log damage: {dmg.path}: byte {dmg.offset}: {dmg.reason}[/red]")
        if args.report is not None:
            worst = [(row.log, k) for row in rows for k in fleet.logs if short_name(k) == row.log and row.problems]
            per_log = [(name, _writer(fleet.logs[k])) for name, k in worst]
            try:
                index = write_fleet_report(args.report, "chestnut check (fleet)", rows, total_row, segs, run_, per_log)
            except OutputDirError as e:
                return refuse("chestnut check", f"--report {e}")
            console.print(f"report: {index}")
    n = sum(len(r.violations) for r in fleet.logs.values())
    anomalies = sum(len(r.anomalies) for r in fleet.logs.values())
    console.print(
        f"[{'red' if n or run_.failed else 'green'}]{n} violation(s)"
        + (f", {len(run_.failed)} failed segment(s)" if run_.failed else "")
        + "[/]"
        + (f"; {anomalies} input anomal{'y' if anomalies == 1 else 'ies'} (not the node's faults)" if anomalies else "")
    )
    if run_.interrupted:
        console.print(f"[yellow]interrupted: {len(run_.outcomes)} of {run_.units} segment(s) finished[/yellow]")
        return EXIT_INTERRUPTED
    return 1 if n or run_.failed else 0


def _writer(result: CheckResult) -> Callable[[Path], Path]:
    return lambda d: write_report(d, result.timeline, violations=result.violations, title=f"chestnut check: {d.name}")
