"""``chestnut``: the one command-line entry point.

Subcommands are loaded lazily (importing tinygrad costs seconds): each row of :data:`COMMANDS`
names the module that implements it. A module provides ``add_arguments(parser)`` and
``run(args) -> int`` (the process exit code).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import signal
import sys
from types import FrameType
from typing import Any, NoReturn

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "dump": ("chestnut.msgs.dump", "print live messages of a service"),
    "demo": ("chestnut.msgs.demo", "live pub/sub demo: synthetic camera frames and SubMaster checks"),
    "record": ("chestnut.msgs.logger", "record every logged service to segment files"),
    "twin": ("chestnut.backend.sim.cli", "run the Chestnut twin daemon and inject faults"),
    "probe": ("chestnut.backend.probe", "run the qualification ladder against a dock or the twin"),
    "run": ("chestnut.node.main", "run the supervised inference node"),
    "model": ("chestnut.launch.assets", "prepare a model for the node (default: the pretrained PP-OCRv4 detector)"),
    "camera": ("chestnut.launch.camerad", "publish real frames as cameraFrame (default: a real traffic video)"),
    "control": ("chestnut.launch.controld", "the reference control daemon: engages only while every check passes"),
    "top": ("chestnut.launch.top", "live terminal view of the stack: state, ChestnutActive, health, rates"),
    "replay": ("chestnut.node.offline.replay_cli", "re-run the models over a log's frames, compare with the log"),
    "check": ("chestnut.node.offline.check_cli", "check the node's contracts over a whole log; report every violation"),
    "fleet": ("chestnut.node.offline.fleet_cli", "build a synthetic fleet of logs for replay and check (fleet make)"),
    "foxglove": ("chestnut.launch.foxglove", "serve the live stack to Foxglove (WebSocket, JSON schemas, images)"),
    "export": ("chestnut.msgs.export", "convert a log into an MCAP file Foxglove opens (export LOG --mcap OUT)"),
    "acceptance": ("chestnut.launch.acceptance", "the dock owner's kit: ladder, copy speed, frames, replug; reports"),
    "launch": ("chestnut.launch.stack", "the whole stack (twin, logger, control, node, camera) under supervisord"),
}


VISITORS = ("dump", "top", "probe", "foxglove")
"""Commands that only visit a stack's runtime directory (read its locks, connect to its sockets) and own nothing in
it; so does every ``twin`` command but ``serve`` and ``libusb``. What they create of it goes again when they end
(``msgs/paths.py`` :func:`~chestnut.msgs.paths.made_dirs_removed`): a ``chestnut dump`` of a prefix nobody runs
left an empty ``<prefix>/``."""


def visits_only(args: argparse.Namespace) -> bool:
    """``args`` are those of a command in :data:`VISITORS` or a twin client."""
    if args.command == "twin":
        return getattr(args, "twin_command", None) not in ("serve", "libusb")
    return args.command in VISITORS


class OneLineParser(argparse.ArgumentParser):
    """An argument error is one line and a pointer to ``--help`` (exit 2, as argparse), not the whole usage
    block: ``chestnut launch: error: argument --fault: 'x': want KIND@START[+DURATION][,key=value] (chestnut
    launch --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help)\n")

    def _print_message(self, message: str, file: Any = None) -> None:
        """As argparse's, except that a message for standard output (``--help``) is flushed and an error writing it
        is raised, for :func:`main` to say as any command's (one line, exit 1; a reader gone: 141): argparse drops
        it, and ``chestnut --help > /dev/full`` exited 0 with nothing said. What goes to another file (an error to
        standard error) is left to argparse."""
        if file is not sys.stdout:
            super()._print_message(message, file)
        elif message:
            file.write(message)
            file.flush()

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """As argparse's, and the first (innermost) parser left with words it does not know is named in the
        namespace with those words (``_refused_by``): a subcommand hands them up to ``chestnut``, whose own
        ``parse_args`` would refuse them under its own name (``chestnut --help``); :func:`parse` refuses them
        under the subcommand's (``chestnut record --help``)."""
        ns, extras = super().parse_known_args(args, namespace)
        if extras and not hasattr(ns, "_refused_by"):  # an inner parser finishes before its caller
            ns._refused_by = (self, list(extras))
        return ns, extras


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="chestnut", description="Supervised inference node for the Chestnut USB GPU dock."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (repeat for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=OneLineParser)
    chosen = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name == chosen:  # only the chosen command's module is imported
            importlib.import_module(module).add_arguments(p)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that words no parser knew are refused by the (sub)command that was
    given them, in its name and with its ``--help`` (``chestnut model prepare: error: unrecognized arguments:
    --bogus (chestnut model prepare --help)``), exit 2."""
    args, extras = parser.parse_known_args(argv)
    owner, words = vars(args).pop("_refused_by", (parser, extras))
    if extras:
        owner.error(f"unrecognized arguments: {' '.join(words)}")
    return args


EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's status for a program a Ctrl-C ended
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, the shell's status for a program whose reader went away (`| head`)
EXIT_TERMINATED = 143  # 128 + SIGTERM, the shell's status for a program a SIGTERM ended

_TERMINATED: list[int] = []  # a SIGTERM came (as_ctrl_c): the run's status is EXIT_TERMINATED


def as_ctrl_c(signum: int, frame: FrameType | None) -> None:
    """SIGTERM for a command that installs no handler of its own (``demo``, ``check``, ``replay``, ``fleet``,
    ``export``, ...): handled as its Ctrl-C is -- its own SIGINT handling runs (a process pool's deferred
    interrupt, or Python's ``KeyboardInterrupt``), so the children it started (a demo's publisher, a pool's
    workers) are stopped with it, not left running with their locks; the status is then
    :data:`EXIT_TERMINATED`. SIGTERM's default action killed the command alone and orphaned them.

    The handler is given the signal that came (``signum``, not SIGINT), and the ``KeyboardInterrupt`` raised for it
    carries the signal's name (``KeyboardInterrupt("SIGTERM")``; a Ctrl-C's has none), so what a command says of
    its stop is true: ``chestnut replay``'s "INTERRUPTED (SIGTERM)" (``node/offline/replay.py`` ``stop_name``) said
    "(Ctrl-C)" for a SIGTERM."""
    _TERMINATED.append(signum)
    handler = signal.getsignal(signal.SIGINT)
    try:
        if callable(handler):
            handler(signum, frame)
        else:  # SIGINT ignored (a background job of a non-interactive shell): a SIGTERM still stops the command
            raise KeyboardInterrupt
    except KeyboardInterrupt as e:
        if not e.args:  # Python's default_int_handler raises it bare
            e.args = (signal.Signals(signum).name,)
        raise


def main(argv: list[str] | None = None) -> int:
    """``chestnut COMMAND ...``: the command's exit status. A Ctrl-C that comes before the command installed its
    own handling (while it imports: its first ~0.3 s) is one line and :data:`EXIT_INTERRUPTED`, not a traceback;
    output to a reader that went away (``chestnut twin kinds | head -1``) ends the command quietly,
    :data:`EXIT_BROKEN_PIPE`, as for any Unix tool."""
    watch = _StdoutWatch(sys.stdout)
    sys.stdout = watch
    try:
        rc = _main(argv)
        return EXIT_TERMINATED if _TERMINATED and rc == EXIT_INTERRUPTED else rc
    except KeyboardInterrupt:
        if _TERMINATED:  # a SIGTERM, handled as a Ctrl-C (as_ctrl_c): the ordinary stop, no line
            return EXIT_TERMINATED
        print("chestnut: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    except OSError as e:
        if e is not watch.failed:  # another file's error: the command's own to say
            raise
        _stdout_to_devnull()
        print(f"chestnut: cannot write to standard output: {e.strerror}", file=sys.stderr)
        return 1
    finally:
        if sys.stdout is watch:
            sys.stdout = watch.stream


class _StdoutWatch:
    """Standard output, passed through, remembering the error a write or flush of it raised (``> /dev/full``, a
    full disk): :func:`main` says that one in one line, exit 1, instead of a traceback; an error of any other file
    is not this one."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.failed: OSError | None = None

    def write(self, text: str) -> int:
        try:
            return int(self.stream.write(text))
        except OSError as e:
            self.failed = e
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            self.failed = e
            raise

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer, ...: the stream's own
        return getattr(self.stream, name)


def _stdout_to_devnull() -> None:
    """Point standard output at /dev/null: Python would report the failed stream again when it flushes it at exit."""
    import os

    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    saved, sys.argv = sys.argv, [sys.argv[0], *argv]
    try:
        args = parse(build_parser(), argv)
    finally:
        sys.argv = saved
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2) if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from chestnut.msgs.messaging import START_REFUSALS
    from chestnut.msgs.paths import made_dirs_removed

    signal.signal(signal.SIGTERM, as_ctrl_c)  # a command with a handler of its own replaces this one

    try:
        with made_dirs_removed() if visits_only(args) else contextlib.nullcontext():
            return int(importlib.import_module(args._module).run(args) or 0)
    except START_REFUSALS as e:
        # a subverted runtime directory, a malformed CHESTNUT_PREFIX, a service another live process
        # already publishes: one line, no traceback, the program cannot go on
        print(f"chestnut {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
