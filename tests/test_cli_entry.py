"""``chestnut``'s entry (the console script, ``launch/entry.py`` ``main``, and ``launch/cli.py`` ``main``): a Ctrl-C
before a command installed its own handling and a reader that went away end the program as a Unix tool does -- one
line or none, the shell's status -- never a traceback."""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from chestnut.launch import cli

REPO = Path(__file__).resolve().parent.parent


def test_a_ctrl_c_while_the_command_imports_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(argv):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_main", interrupted)
    assert cli.main(["run"]) == 130
    assert capsys.readouterr().err == "chestnut: interrupted (Ctrl-C)\n"


def test_a_sigterm_handled_as_a_ctrl_c_is_named_as_the_sigterm_it_was(monkeypatch):
    """``chestnut replay`` stopped by SIGTERM said "INTERRUPTED (Ctrl-C)": the ``KeyboardInterrupt`` that
    ``as_ctrl_c`` raises, at once or held by a process pool's deferral, now names the signal; a Ctrl-C's stays bare."""
    from chestnut.node.offline.fleet import _execute, run_line
    from chestnut.node.offline.replay import DeferredInterrupt, stop_name

    monkeypatch.setattr(cli, "_TERMINATED", [])  # this process's own exit status stays as it was
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt) as at_once:
        cli.as_ctrl_c(signal.SIGTERM, None)
    assert (at_once.value.args, stop_name(at_once.value)) == (("SIGTERM",), "SIGTERM")
    for signum, named in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")):
        with DeferredInterrupt() as held:
            if signum == signal.SIGTERM:
                cli.as_ctrl_c(signum, None)  # held until the loop asks: returns
            else:
                signal.getsignal(signal.SIGINT)(signum, None)  # a Ctrl-C
            with pytest.raises(KeyboardInterrupt) as later:
                held.check()
        assert stop_name(later.value) == named
    assert cli._TERMINATED == [signal.SIGTERM, signal.SIGTERM]
    assert stop_name(KeyboardInterrupt()) == "Ctrl-C"

    class Stopped:  # an executor a SIGTERM stops before any unit finished
        name, workers = "local", 1

        def run(self, units, done):  # type: ignore[no-untyped-def]
            raise KeyboardInterrupt("SIGTERM")
            yield

    run = _execute(Stopped(), [], None)  # type: ignore[arg-type]
    assert (run.interrupted, run.stopped_by) == (True, "SIGTERM")
    assert run_line(run).endswith("; INTERRUPTED (SIGTERM): only the segments that finished are counted")


def test_output_to_a_reader_that_went_away_ends_quietly_with_141():
    """``chestnut twin kinds | head -1`` was a BrokenPipeError traceback and exit 1."""
    proc = subprocess.Popen([sys.executable, "-m", "chestnut.launch.cli", "twin", "kinds"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line: the first write fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert err == ""


def test_help_to_a_reader_that_went_away_ends_quietly_with_141():
    """``chestnut launch --help`` whose reader is gone: argparse dropped the EPIPE and it exited 0."""
    proc = subprocess.Popen([sys.executable, "-m", "chestnut.launch.cli", "launch", "--help"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert (proc.wait(timeout=60), err) == (141, "")


def test_the_console_script_is_launch_entry_main():
    """pyproject.toml names it and the environment's installed ``chestnut`` is that one (launch/setup.sh installs
    again when pyproject.toml is newer than its stamp)."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert declared == {"chestnut": "chestnut.launch.entry:main"}
    assert [ep.value for ep in entry_points(group="console_scripts", name="chestnut")] == ["chestnut.launch.entry:main"]


def test_importing_the_entry_loads_nothing_but_it():
    """The console script imports its entry's module before anything of it runs (``from MODULE import main``): a
    Ctrl-C during that import is Python's traceback, so the module imports nothing the interpreter has not loaded."""
    code = ("import sys; before = set(sys.modules); import chestnut.launch.entry; "
            "print(' '.join(sorted(set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["chestnut", "chestnut.launch", "chestnut.launch.entry"]


# Started by Python before the console script runs (the ``site`` module imports ``sitecustomize`` from sys.path,
# here from PYTHONPATH: https://docs.python.org/3/library/site.html#module-sitecustomize). An audit hook
# (https://docs.python.org/3/library/sys.html#sys.addaudithook; the "import" event is raised before a module not yet
# loaded is looked for; an ``import`` statement raises it, ``importlib.import_module`` does not) tells the test,
# through an inherited pipe, that the import of the module it names begins, then waits there: the test's SIGINT
# interrupts the wait, and Python's handler raises KeyboardInterrupt out of that import, as a Ctrl-C then would.
SITECUSTOMIZE = """
import os, signal, sys, time

# the test's SIGINT is a terminal's Ctrl-C: a child started with SIGINT ignored (a suite run as a background job
# of a non-interactive shell passes SIG_IGN down, and Python then installs no handler) is given Python's own
signal.signal(signal.SIGINT, signal.default_int_handler)
_target = os.environ.pop("CHESTNUT_TEST_SIGINT_AT")
_fd = int(os.environ.pop("CHESTNUT_TEST_READY_FD"))


def _hook(event, args):
    global _fd
    if event == "import" and args[0] == _target and _fd >= 0:
        fd, _fd = _fd, -1
        os.write(fd, b"!")
        os.close(fd)
        time.sleep(120)


sys.addaudithook(_hook)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", ["chestnut.launch.cli", "logging", "zmq"])
def test_a_ctrl_c_while_the_console_script_imports_is_one_line_and_130(tmp_path: Path, target: str):
    """``chestnut run`` with a real SIGINT from this process while the installed console script imports
    ``target``: the CLI module itself (the entry's first step), the heaviest of the CLI's own imports, one of the
    run command's module's (``node/main.py``; the CLI's ``main`` covered those already). Before the entry's ``try``
    covered the CLI's import, the first two were a KeyboardInterrupt traceback and a death by SIGINT. The child
    says when it is there: no delay is guessed."""
    script = Path(sys.executable).parent / "chestnut"
    assert script.is_file(), f"{script}: the console script is not installed (bash launch/setup.sh)"
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    ready_r, ready_w = os.pipe()
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "CHESTNUT_TEST_SIGINT_AT": target,
           "CHESTNUT_TEST_READY_FD": str(ready_w), "CHESTNUT_PREFIX": f"entry{os.getpid()}"}
    try:
        proc = subprocess.Popen([str(script), "run", "--config", str(tmp_path / "never-read.toml")], env=env,
                                pass_fds=(ready_w,), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finally:
        os.close(ready_w)
    try:
        with os.fdopen(ready_r, "rb") as ready:
            assert select.select([ready], [], [], 240)[0], f"the import of {target} did not begin within 240 s"
            assert ready.read(1) == b"!", f"the child ended before it imported {target}"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert (proc.returncode, err.decode(), out) == (130, "chestnut: interrupted (Ctrl-C)\n", b"")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", [["model", "paths"], ["twin", "kinds"], ["--help"], ["launch", "--help"],
                                     ["model", "prepare", "--help"], ["twin", "serve", "--help"]])
def test_a_standard_output_that_takes_no_more_is_one_line_and_exit_1(command: list[str]) -> None:
    """``> /dev/full`` (a full disk alike) was a 16-line OSError traceback; an error of another file is not this.
    ``--help`` exited 0 with nothing said (argparse drops an error writing its messages)."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "chestnut.launch.cli", *command], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (1, "chestnut: cannot write to standard output: No space left on device\n")


# every path option and positional of every command but ``fleet make`` (its own check): (argv, the option named)
EMPTY_PATHS = [
    (["check", ""], "LOG"),
    (["check", "x.zst", "--report", ""], "--report"),
    (["replay", ""], "LOG"),
    (["replay", "x.zst", "--model", ""], "--model"),
    (["replay", "x.zst", "--fallback-model", ""], "--fallback-model"),
    (["replay", "x.zst", "--report", ""], "--report"),
    (["export", "", "--mcap", "x.mcap"], "LOG"),
    (["export", "x.zst", "--mcap", ""], "--mcap"),
    (["record", "--log-dir", ""], "--log-dir"),
    (["probe", "--twin", "--model", ""], "--model"),
    (["probe", "--twin", "--fingerprint", ""], "--fingerprint"),
    (["probe", "--twin", "--record-fingerprint", ""], "--record-fingerprint"),
    (["probe", "--fill-firmware", ""], "--fill-firmware"),
    (["model", "prepare", "--onnx", ""], "--onnx"),
    (["model", "prepare", "--out", ""], "--out"),
    (["camera", "--source", ""], "--source"),
    (["launch", "--runs-dir", ""], "--runs-dir"),
    (["launch", "--node-config", ""], "--node-config"),
    (["launch", "--json", ""], "--json"),
    (["acceptance", "--twin", "--out", ""], "--out"),
    (["acceptance", "--twin", "--out", "x", "--config", ""], "--config"),
    (["acceptance", "--twin", "--out", "x", "--model", ""], "--model"),
    (["run", "--config", ""], "--config"),
    (["run", "--model", ""], "--model"),
    (["run", "--fallback-model", ""], "--fallback-model"),
]


def _words(value: object) -> str | None:
    """A test id: the command line, an empty word as ''."""
    return " ".join(a or "''" for a in value) if isinstance(value, list) else None


@pytest.mark.parametrize(("argv", "option"), EMPTY_PATHS, ids=_words)
def test_an_empty_path_is_refused_in_one_line_naming_the_option(argv: list[str], option: str, capsys) -> None:
    """``Path('')`` is the current directory: ``chestnut check ''`` checked all of it, ``acceptance --out ''`` wrote
    its reports into it, ``run --model ''`` was a ValueError traceback (``msgs/argtypes.py`` ``path_arg``)."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    command = " ".join(argv[:2] if argv[0] == "model" else argv[:1])
    assert (info.value.code, capsys.readouterr()) == (2, ("", (
        f"chestnut {command}: error: argument {option}: an empty path is not a path; give a file or folder "
        f"(chestnut {command} --help)\n")))


def _path_typed(parser: argparse.ArgumentParser) -> list[str]:
    """The options and positionals of ``parser`` and its subcommands' parsers read as a bare ``Path``."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found += _path_typed(sub)
        elif action.type is Path:
            found.append(f"{parser.prog} {'/'.join(action.option_strings) or action.metavar or action.dest}")
    return found


@pytest.mark.parametrize("command", sorted(set(cli.COMMANDS) - {"fleet"}))
def test_no_command_reads_a_path_without_refusing_an_empty_one(command: str, monkeypatch) -> None:
    """Every path of every command (``fleet make`` has its own check) is ``path_arg``'s, so a path option added
    later refuses ``''`` too: the list of those that do not is empty."""
    monkeypatch.setattr(sys, "argv", ["chestnut", command])
    parser = cli.build_parser()
    assert _path_typed(parser) == []
