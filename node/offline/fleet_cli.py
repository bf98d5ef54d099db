"""``chestnut fleet make --from LOG --copies N OUT``, and the executor options of ``replay`` and ``check``.

``fleet make`` writes a synthetic fleet (:func:`~chestnut.node.offline.fleet.make_fleet`): every log
under ``--from`` copied ``N`` times under new route ids. Exit status 0, or 2 with one line when it
cannot (no log, ``OUT`` already holds one of the routes, a bad count).

The executor options (:func:`add_executor_arguments`): ``--executor local|ray``, ``--workers N``
(local: processes, default 1; ray: actors, default one per CPU of the cluster), ``--ray-address
ADDRESS|auto`` and ``--ship-logs`` (``docs/offline.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from chestnut.node.offline.executor import EXECUTORS, Executor, Outcome, make_executor
from chestnut.node.offline.fleet import MAX_COPIES, make_fleet

log = logging.getLogger("chestnut.fleet")

EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention for a run stopped by Ctrl-C


def add_executor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="local",
        help="where segments run: local (this machine's processes, default) or ray (a Ray cluster; "
        "pip install 'chestnut[cluster]')",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="local: processes (default 1); ray: actors (default: one per CPU of the cluster)",
    )
    p.add_argument(
        "--ray-address",
        metavar="ADDRESS|auto",
        default=None,
        help="the Ray cluster to join (auto: the one started on this machine with ray start; default: "
        "a private one-machine cluster)",
    )
    p.add_argument(
        "--ship-logs",
        action="store_true",
        help="ray: send every segment's bytes through Ray's object store (default: workers read the "
        "log's path, which every node must see)",
    )


def executor_from_args(args: argparse.Namespace) -> Executor:
    """Raises :class:`~chestnut.node.offline.executor.ExecutorError` / ``ValueError`` (one line each)."""
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    return make_executor(args.executor, workers=args.workers, ray_address=args.ray_address, ship_logs=args.ship_logs)


@contextlib.contextmanager
def progress(console: Any, total: int | None = None) -> Iterator[Callable[[Outcome], None]]:
    """An ``on_outcome`` callback drawing a bar of ``total`` segments on stderr when the console is a terminal."""
    if not console.is_terminal:  # a file or a pipe: one debug line per segment (chestnut -vv)
        count = [0]

        def line(o: Outcome) -> None:
            count[0] += 1
            log.debug("segment %d/%s done: %s%s", count[0], total, o.unit.path, f" ({o.error})" if o.error else "")

        yield line
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("segments"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("segments", total=total)

        def step(_o: Outcome) -> None:
            bar.advance(task)

        yield step


def open_executor(args: argparse.Namespace, command: str, out: logging.Logger) -> Executor | None:
    """The executor ``args`` ask for, after checking ``--report DIR`` before any work (a refused DIR costs
    nothing): None after one error line on ``out`` naming ``command`` (the caller exits 2)."""
    from chestnut.msgs.outdir import OutputDirError, private_dir
    from chestnut.node.offline.executor import ExecutorError

    try:
        executor = executor_from_args(args)
    except (ExecutorError, ValueError) as e:
        out.error("%s: %s", command, e)
        return None
    if getattr(args, "report", None) is not None:
        try:
            private_dir(args.report, ("index.html",))
        except OutputDirError as e:
            executor.close()
            out.error("%s: --report %s", command, e)
            return None
    return executor


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)
    make = sub.add_parser("make", help="copy a log N times under new route ids (a synthetic fleet)")
    make.add_argument(
        "--from", dest="source", type=Path, required=True, metavar="LOG", help="log files or directories to copy"
    )
    make.add_argument("--copies", type=int, required=True, metavar="N", help=f"copies of each log (1..{MAX_COPIES})")
    make.add_argument("out", type=Path, metavar="OUT", help="directory for the fleet (routes never overwritten)")


def run(args: argparse.Namespace) -> int:
    from chestnut.msgs.outdir import OutputDirError

    try:
        dirs = make_fleet(args.source, args.copies, args.out)
    except OutputDirError as e:
        log.error("chestnut fleet make: OUT %s", e)
        return 2
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        log.error("chestnut fleet make: %s", e)
        return 2
    routes = {d.name.rpartition("--")[0] for d in dirs}
    print(f"{len(routes)} route(s), {len(dirs)} segment(s) in {args.out}")
    return 0
