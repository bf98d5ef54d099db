"""``chestnut fleet make --from LOG --copies N OUT``, and the executor options of ``replay`` and ``check``.

``fleet make`` writes a synthetic fleet (:func:`~chestnut.node.offline.fleet.make_fleet`): every log
under ``--from`` copied ``N`` times under new route ids, each log file named ``rlog.zst`` / ``rlog.mcap`` as
``check`` and ``replay`` find it (``odd/copy_rlog.zst`` becomes ``copy_rlog-00001--0/rlog.zst``). Exit status 0,
or 2 with one line when it cannot (no log, or none that check reads: ``--from`` is read up to its first message
before anything is written, :class:`~chestnut.node.offline.fleet.NotALogError`; a clean log of zero messages is
copied, as check reads it, 0 frames; ``OUT`` already holds one of the routes or is unfit; a count outside
1..100000, and an empty ``--from`` or ``OUT`` (``''`` is no path, not ``.``), are refused by the parser,
:func:`copy_count`, :func:`_given_path`). A log file found in the ``--from`` folder that is not a regular file (a
FIFO ...) is skipped with one WARNING, as ``check`` and ``replay`` skip it (:func:`skip_once`), and the rest
copied.

The executor options (:func:`add_executor_arguments`): ``--executor local|ray``, ``--workers N``
(local: processes, default 1; ray: actors, default one per CPU of the cluster; >= 1 checked as it is parsed,
:func:`worker_count`, and, where the workers run on this machine, at most ``node/offline/replay.py``
``WORKERS_PER_CPU`` per CPU as the executor is made), ``--ray-address ADDRESS|auto`` and ``--ship-logs``
(``docs/offline.md``); and the
``--slack-ms`` both take (:func:`slack_ms`).

A bad argument is one line on stderr that names the program once: the parser's for a number
(``chestnut check: error: argument --workers: '0': give a number of workers >= 1 (chestnut check
--help)``, ``launch/cli.py`` ``OneLineParser``), :func:`refuse`'s for what only running finds
(``chestnut check: --ship-logs and --ray-address are for --executor ray (local workers read the
paths)``, an unreachable Ray cluster, an unfit ``--report`` DIR or ``OUT``); exit status 2 either way.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from chestnut.msgs.argtypes import checked_float
from chestnut.node.config import MAX_MS
from chestnut.node.offline.executor import EXECUTORS, Executor, Outcome, make_executor
from chestnut.node.offline.fleet import COPY_NAME, MAX_COPIES, check_copies, make_fleet
from chestnut.node.offline.replay import WORKERS_PER_CPU, check_workers, max_workers

log = logging.getLogger("chestnut.fleet")

EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention for a run stopped by Ctrl-C
EXIT_REFUSED = 2  # a bad argument, as argparse exits


def refuse(command: str, why: object) -> int:
    """Print ``command: why`` as one line on stderr and return :data:`EXIT_REFUSED`: an offline command's
    refusal of an argument that only running can find bad, the program named once (as ``chestnut probe`` and
    ``chestnut model prepare`` refuse; ``log.error`` would put its logger's ``ERROR chestnut.check:`` before
    ``chestnut check:``)."""
    print(f"{command}: {why}", file=sys.stderr)
    return EXIT_REFUSED


def stdout_console() -> Any:
    """The rich ``Console`` on stdout of ``chestnut check`` and ``chestnut replay``. A reader that went away
    (``chestnut check LOG | head -2``) ends the command as it ends every ``chestnut`` command: the
    ``BrokenPipeError`` goes up to ``launch/cli.py`` ``main``, which ends it quietly with ``EXIT_BROKEN_PIPE``
    (141, 128 + SIGPIPE, README). rich's own ``Console.on_broken_pipe`` exits 1 instead (``SystemExit(1)``),
    ``check``'s "a contract was violated" and ``replay``'s "a mismatch", with nothing said. Into a pipe or a file
    a line of text is not folded at rich's default 80 columns (``soft_wrap``: one line stays one line for
    ``grep``); a terminal's lines fold at its width, as before."""
    from rich.console import Console

    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True  # nothing more is drawn on the way out
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    return PipeConsole(soft_wrap=not sys.stdout.isatty())


def _count(text: str, check: Callable[[int], int], want: str) -> int:
    try:
        return check(int(text))
    except ValueError:  # no whole number, or one ``check`` refuses
        raise argparse.ArgumentTypeError(f"{text!r}: {want}") from None


def worker_count(text: str) -> int:
    """``--workers``: a whole number that :func:`~chestnut.node.offline.replay.check_workers` takes (>= 1);
    raises ``argparse.ArgumentTypeError`` ``"'text': give a number of workers >= 1"`` (one line) otherwise. Its
    upper bound, for workers that run on this machine (``WORKERS_PER_CPU`` per CPU: ``--executor local`` and a
    private Ray cluster, not a cluster at ``--ray-address``), depends on the executor, so it is checked as the
    executor is made (:func:`open_executor`: one line, exit 2)."""
    return _count(text, lambda n: check_workers(n, here=False), "give a number of workers >= 1")


def copy_count(text: str) -> int:
    """``fleet make --copies``: a whole number that :func:`~chestnut.node.offline.fleet.check_copies` takes
    (1..:data:`~chestnut.node.offline.fleet.MAX_COPIES`); raises ``argparse.ArgumentTypeError`` (one line)
    otherwise."""
    return _count(text, check_copies, f"give a number of copies in 1..{MAX_COPIES}")


def _given_path(give: str) -> Callable[[str], Path]:
    """The ``type=`` of a path of ``fleet make`` (``--from``, ``OUT``): ``Path(text)``, or for ``''`` an
    ``argparse.ArgumentTypeError``, the parser's one line naming the argument (``chestnut fleet make: error: argument
    --from: an empty path is not a path; give a log file or a folder of them (chestnut fleet make --help)``), exit 2.
    ``Path('')`` is ``Path('.')``: an empty value (an unset shell variable) copied the current folder, or wrote the
    fleet into it."""

    def path(text: str) -> Path:
        if text == "":
            raise argparse.ArgumentTypeError(f"an empty path is not a path; {give}")
        return Path(text)

    return path


def slack_ms(text: str) -> float:
    """``--slack-ms`` of ``check`` and ``replay``: the slack on every time bound in milliseconds, 0 to
    :data:`~chestnut.node.config.MAX_MS` (a minute, the node configuration's bound on every per-frame time: an
    answer later than that is of use to no one, and every bound stays a whole number of nanoseconds); raises
    ``argparse.ArgumentTypeError`` (one line) otherwise, NaN and inf included."""
    return checked_float(text, lambda ms: 0 <= ms <= MAX_MS,
                         f"give a slack in milliseconds, >= 0 and <= {MAX_MS:g} (a minute)")


def readable_logs(logs: list[Path], on_skip: Callable[[Path, str], None], command: str, verb: str) -> list[Path] | None:
    """The log files under ``logs`` (:func:`~chestnut.msgs.logfile.find_log_files`) that ``chestnut check`` /
    ``replay`` can read: every ``.mcap`` of JSON channels only (``chestnut record``'s default view beside its
    rlog, :func:`~chestnut.msgs.logfile.holds_only_json`) is left out, with its one WARNING when other files are
    read. None when no file is left, after one line alone (:func:`refuse`; the caller exits :data:`EXIT_REFUSED`,
    the status of a check or replay that cannot start): ``chestnut check: nothing to check in D/rlog.mcap (JSON
    channels only): give the rlog.zst written beside it (or a log recorded with --mcap-encoding both)``, or, with
    no rlog.zst beside it (``record --format mcap --mcap-encoding json``), how ``chestnut record`` writes a log
    that can be read (:func:`~chestnut.msgs.logfile.json_only_fix`). It was "0 frames ... 0 mismatch(es)", exit 0,
    and the WARNING twice. Raises what ``find_log_files`` raises."""
    from chestnut.msgs.logfile import find_log_files, holds_only_json, json_only_fix, warn_json_only

    files = find_log_files(logs, on_skip=on_skip)
    json_only = [f for f in files if holds_only_json(f, warn=False)]
    if len(json_only) < len(files):
        for f in json_only:
            warn_json_only(f)
        return [f for f in files if f not in json_only]
    named = str(json_only[0]) + (f" and {len(json_only) - 1} more" if len(json_only) > 1 else "")
    refuse(command, f"nothing to {verb} in {named} (JSON channels only): {json_only_fix(json_only[0])}")
    return None


def skip_once(logger: logging.Logger) -> Callable[[Path, str], None]:
    """The ``on_skip`` of :func:`~chestnut.msgs.logfile.find_log_files` for ``chestnut check`` and ``chestnut
    replay``: a log file found in a walk that is not a regular file (a FIFO, socket, device or symlink: never
    opened, a FIFO would block the command for good) is one WARNING line on ``logger``, at most once per path
    however often the tree is walked, and is left out; the rest of the logs are read as usual."""
    seen: set[Path] = set()

    def skip(path: Path, kind: str) -> None:
        if path not in seen:
            seen.add(path)
            logger.warning("%s: %s, not a regular file: skipped (never opened)", path, kind)

    return skip


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
        type=worker_count,
        default=None,
        help="local: processes (default 1); ray: actors (default: one per CPU of the cluster); >= 1, and at most "
        f"{WORKERS_PER_CPU} per CPU ({max_workers()} here) where they run on this machine (local, or ray without "
        "--ray-address): past one per CPU they only take turns, each holding its own memory",
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
    """The executor of :func:`add_executor_arguments`' options. Raises
    :class:`~chestnut.node.offline.executor.ExecutorError` / ``ValueError`` (one line each;
    :func:`~chestnut.node.offline.executor.make_executor`)."""
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


def open_executor(args: argparse.Namespace, command: str) -> Executor | None:
    """The executor ``args`` ask for, after checking ``--report DIR`` before any work (a refused DIR costs
    nothing): None after one line on stderr naming ``command`` once (:func:`refuse`; the caller exits
    :data:`EXIT_REFUSED`), never an exception."""
    from chestnut.msgs.outdir import OutputDirError, missing_folder, private_dir
    from chestnut.node.offline.executor import ExecutorError

    try:
        executor = executor_from_args(args)
    except (ExecutorError, ValueError) as e:
        refuse(command, e)
        return None
    if getattr(args, "report", None) is not None:
        problem = missing_folder(args.report)  # DIR is made, never the folders above it
        try:
            if problem is None:
                private_dir(args.report, ("index.html",))
        except OutputDirError as e:
            problem = str(e)
        if problem is not None:
            executor.close()
            refuse(command, f"--report {problem}")
            return None
    return executor


MAKE_DESCRIPTION = (
    "Copy every log under --from N times into OUT as new routes <route>-00001 ... (nothing overwritten), byte for "
    "byte, with the video files beside each segment's log file. Each copy is named as check and replay find it in a "
    f"folder, <route>-<k>--<segment>/{COPY_NAME}.zst (or {COPY_NAME}.mcap, after the file's format); a log file "
    "outside a segment folder is a route named after the file without its format suffix: odd/copy_rlog.zst makes "
    f"copy_rlog-00001--0/{COPY_NAME}.zst. Before anything is written, --from is read up to its first message: a log "
    "file that gives none (0 bytes, not zstd or MCAP, damaged from its first byte, JSON channels only), or a folder "
    "none of whose log files gives one, is refused; a clean log of zero messages is copied, as check reads it (0 "
    "frames), and damaged files past that are copied as they are (check reports of the copies what it reports of "
    "them). A log file in the --from folder that is not a regular file (a FIFO, socket, device, symlink) is skipped "
    "with one WARNING, never opened, as check and replay skip it; --from naming one, or such a video file, is "
    "refused."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)
    make = sub.add_parser(
        "make",
        help="copy a log N times under new route ids (a synthetic fleet)",
        description=MAKE_DESCRIPTION,
    )
    make.add_argument("--from", dest="source", type=_given_path("give a log file or a folder of them"), required=True,
                      metavar="LOG", help="a log file or a folder of logs to copy")
    make.add_argument(
        "--copies", type=copy_count, required=True, metavar="N", help=f"copies of each log (1..{MAX_COPIES})"
    )
    make.add_argument("out", type=_given_path("give the folder for the fleet"), metavar="OUT",
                      help="directory for the fleet (routes never overwritten)")


def _inside_source(out: Path, source: Path) -> str | None:
    """``"the same folder as"`` when ``out`` is ``source`` (a folder), ``"inside"`` when it lies under it, compared as
    resolved paths (symlinks followed); None otherwise (``source`` a file or missing included)."""
    try:
        out_r, src_r = out.resolve(), source.resolve()
        if not src_r.is_dir():
            return None
    except (OSError, RuntimeError):  # a symlink loop, a name too long: the copy's own checks say so
        return None
    if out_r == src_r:
        return "the same folder as"
    return "inside" if src_r in out_r.parents else None


def run(args: argparse.Namespace) -> int:
    from chestnut.msgs.outdir import OutputDirError, missing_folder, os_reason

    if (missing := missing_folder(args.out)) is not None:  # OUT is made, never the folders above it
        return refuse("chestnut fleet make", f"OUT {missing}")
    if (inside := _inside_source(args.out, args.source)) is not None:
        return refuse("chestnut fleet make", f"OUT {args.out} is {inside} --from {args.source}: the copies would "
                      "join the log they copy (a later replay of it would count them); give a folder outside it")
    try:
        dirs = make_fleet(args.source, args.copies, args.out, on_skip=skip_once(log))
    except OutputDirError as e:
        return refuse("chestnut fleet make", f"OUT {e}")
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        return refuse("chestnut fleet make", e)
    except OSError as e:  # a log or video file that cannot be read (EACCES, EIO): make_fleet removed what it made
        return refuse("chestnut fleet make", f"{e.filename or args.source}: {os_reason(e)}; nothing written")
    routes = {d.name.rpartition("--")[0] for d in dirs}
    print(f"{len(routes)} route(s), {len(dirs)} segment(s) in {args.out}")
    return 0
