"""A Ctrl-C early in ``chestnut launch``: during its checks (``launch/stack.py`` ``prepare``) it is one line and exit
130, no traceback; while supervisord starts, it is the run's stop (``start`` installs the handlers first); the
programs the stop ended while they started are not called failed (``launch/supervise.py``
``programs_not_started``); and a stop before the stack's first message is said so, never as a time below zero
(``launch/summary.py`` ``cut_short_line``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from chestnut.launch import stack
from chestnut.launch.summary import cut_short_line, stop_figures
from chestnut.launch.supervise import not_started_lines, programs_not_started

ASKED = ["twin", "record", "node", "control"]
STAYED = "process has stayed up for > than "  # supervisor 4's words
# a launch stopped by Ctrl-C 0.5 s after it started supervisord: control, node and record were still within their
# startsecs when they were stopped; the summary said "program record did not run" (and node, control)
FIRST_SECOND = f"""\
2026-12-04 11:36:13,071 INFO supervisord started with pid 9541
2026-12-04 11:36:13,708 INFO spawned: 'twin' with pid 9545
2026-12-04 11:36:13,710 INFO spawned: 'record' with pid 9546
2026-12-04 11:36:13,711 INFO spawned: 'node' with pid 9547
2026-12-04 11:36:13,719 INFO spawned: 'control' with pid 9548
2026-12-04 11:36:13,728 INFO waiting for control to stop
2026-12-04 11:36:13,733 WARN stopped: control (terminated by SIGTERM)
2026-12-04 11:36:13,941 INFO waiting for node to stop
2026-12-04 11:36:13,943 WARN stopped: node (terminated by SIGTERM)
2026-12-04 11:36:14,556 INFO waiting for record to stop
2026-12-04 11:36:14,706 INFO success: twin entered RUNNING state, {STAYED}1 seconds (startsecs)
2026-12-04 11:36:14,719 INFO stopped: record (exit status 0)
2026-12-04 11:36:14,816 INFO waiting for twin to stop
2026-12-04 11:36:14,931 INFO stopped: twin (exit status 0)
2026-12-04 11:36:15,934 WARN received SIGTERM indicating exit request
"""
EXIT_REQUEST = "2026-12-04 11:36:15,934 WARN received SIGTERM indicating exit request\n"


def _log(tmp_path: Path, text: str) -> Path:
    (tmp_path / "supervisord.log").write_text(text)
    return tmp_path / "supervisord.log"


def test_programs_the_stop_ended_while_they_started_did_not_fail(tmp_path):
    assert programs_not_started(_log(tmp_path, FIRST_SECOND), ASKED) == {}
    assert not_started_lines(tmp_path, ASKED) == {}


def test_a_program_that_exited_at_start_before_the_stop_still_failed(tmp_path):
    lines = FIRST_SECOND.splitlines(keepends=True)
    exited = "2026-12-04 11:36:13,900 WARN exited: node (exit status 3; not expected)\n"
    respawned = "2026-12-04 11:36:13,901 INFO spawned: 'node' with pid 9550\n"
    log = _log(tmp_path, "".join(lines[:7] + [exited, respawned] + lines[7:]))
    assert programs_not_started(log, ASKED) == {
        "node": "it never stayed up past its start (1 exit(s) at start, the last with exit status 3)"}


def test_programs_the_stop_came_before_were_not_started_and_did_not_fail(tmp_path):
    started = "2026-12-04 11:36:13,071 INFO supervisord started with pid 9541\n"
    assert programs_not_started(_log(tmp_path, started + EXIT_REQUEST), ASKED) == {}
    # supervisord killed before it spawned them (no exit request): they never ran
    never = {name: "it never stayed up past its start (0 exit(s) at start)" for name in ASKED}
    assert programs_not_started(_log(tmp_path, started), ASKED) == never
    # a spawn error names no program: none of those never spawned is excused
    spawnerr = "2026-12-04 11:36:13,700 INFO spawnerr: can't find command '/nowhere/python'\n"
    assert programs_not_started(_log(tmp_path, started + spawnerr + EXIT_REQUEST), ASKED) == never


def _cut(t_signal_ns: int, t_stop_ns: int, first_message_ns: int | None, seconds: float = 10.0) -> dict[str, Any]:
    s = {"t_zero_ns": first_message_ns, "first_output_s": None}
    flag = SimpleNamespace(signum=signal.SIGINT, t_ns=t_signal_ns)
    return stop_figures(s, 0, t_stop_ns, flag, seconds)["cut_short"]


@pytest.mark.parametrize(
    ("t_signal_ns", "t_stop_ns", "first_ns", "t_s", "want"),
    [
        (500_000_000, 520_000_000, 1_100_000_000, -0.6,  # the logger's first message came after the Ctrl-C
         "run cut short by SIGINT (Ctrl-C) before the stack's first message, so none of the planned 10 s ran (all "
         "the log holds came while the stack stopped) (exit 130)"),
        (1_099_900_000, 1_200_000_000, 1_100_000_000, -0.0,  # 0.1 ms before it: rounds to zero, said as t=0.0
         "run cut short by SIGINT (Ctrl-C) at t=0.0 s, before the first output, so none of the planned 10 s ran "
         "(exit 130)"),
        (500_000_000, 520_000_000, None, 0.5,  # no message at all: the launch time stands in
         "run cut short by SIGINT (Ctrl-C) at t=0.5 s, before the first output, so none of the planned 10 s ran "
         "(exit 130)"),
        (600_000_000, 400_000_000, 1_100_000_000, -0.5,  # came once the stop had begun
         "SIGINT (Ctrl-C) before the stack's first message, while the stack stopped after the run had ended "
         "(exit 130)"),
    ],
)
def test_a_stop_before_the_first_message_is_said_so(t_signal_ns, t_stop_ns, first_ns, t_s, want):
    c = _cut(t_signal_ns, t_stop_ns, first_ns)
    assert (c["t_s"], c["run_s"]) == (t_s, None)
    assert cut_short_line(c) == want


def _args(tmp_path: Path) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    stack.add_arguments(p)
    return p.parse_args(["--seconds", "10", "--no-live", "--runs-dir", str(tmp_path / "runs")])


@pytest.fixture
def sigint_default():
    """SIGINT raises KeyboardInterrupt (Python's default; a test worker may have another), restored after."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def _stopped_while_checking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                            signum: signal.Signals, want: tuple[int, str]) -> None:
    """``chestnut launch`` sent ``signum`` while it reads node.toml: ``want`` (exit code, its one WARNING line),
    no traceback, the stack never started and no runs dir made."""
    name = signum.name

    def stop(path: Path | None) -> dict[str, Any]:
        os.kill(os.getpid(), signum)  # the handler runs before kill returns (a signal to this thread)
        raise AssertionError(f"the {name} did not stop the checks")

    def start(*_a: object) -> None:
        raise AssertionError(f"the stack was started after a {name}")

    monkeypatch.setattr(stack, "read_node_toml", stop)
    monkeypatch.setattr(stack, "start", start)
    caplog.set_level(logging.INFO)
    try:
        rc = stack.run(_args(tmp_path))
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped chestnut launch (a traceback)")
    assert (rc, [(r.levelname, r.getMessage()) for r in caplog.records]) == (want[0], [("WARNING", want[1])])
    assert not (tmp_path / "runs").exists()


def test_a_ctrl_c_while_the_launch_checks_is_one_line_and_exit_130(tmp_path, monkeypatch, caplog, sigint_default):
    _stopped_while_checking(tmp_path, monkeypatch, caplog, signal.SIGINT, (
        130, "stopped by SIGINT (Ctrl-C) before the stack started: nothing was started (exit 130)"))


def test_a_sigterm_while_the_launch_checks_is_named_and_exit_143(tmp_path, monkeypatch, caplog, sigint_default):
    """A SIGTERM then is handled as a Ctrl-C (``launch/cli.py`` ``as_ctrl_c``) and its ``KeyboardInterrupt`` names
    it: the line said "stopped by SIGINT (Ctrl-C) ... (exit 130)" while the process exited 143."""
    from chestnut.launch import cli

    monkeypatch.setattr(cli, "_TERMINATED", [])
    signal.signal(signal.SIGTERM, cli.as_ctrl_c)  # as chestnut's main installs it; restored by sigint_default
    _stopped_while_checking(tmp_path, monkeypatch, caplog, signal.SIGTERM, (
        143, "stopped by SIGTERM before the stack started: nothing was started (exit 143)"))


def test_a_ctrl_c_while_supervisord_starts_is_the_runs_stop(tmp_path, monkeypatch, sigint_default):
    from chestnut.launch import top

    def start_supervisord(conf: Path, prefix: str, launch_id: str) -> Any:
        os.kill(os.getpid(), signal.SIGINT)
        return SimpleNamespace(pid=os.getpid())

    monkeypatch.setattr(stack, "start_supervisord", start_supervisord)
    monkeypatch.setattr(top, "StackView", lambda: None)
    try:
        launch = stack.start(_args(tmp_path), "p", tmp_path, tmp_path / "supervisord.conf")
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped chestnut launch with supervisord started")
    assert (launch.flag.stop, launch.flag.signum) == (True, signal.SIGINT)
    assert launch.flag.t_ns is not None and launch.t_launch_ns <= launch.flag.t_ns


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_ctrl_c_in_the_launchs_first_second_blames_no_program(tmp_path):
    """The real stack, stopped by Ctrl-C as soon as supervisord is started: exit 130, the cut-short line, and no
    "did not run" line for the programs the stop ended within their startsecs."""
    runs, out = tmp_path / "runs", tmp_path / "s.json"
    env = dict(os.environ, CHESTNUT_PREFIX=f"early{os.getpid()}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "chestnut.launch.cli", "launch", "--seconds", "10", "--no-live", "--runs-dir",
         str(runs), "--json", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if "stack launched under supervisord" in line:
            proc.send_signal(signal.SIGINT)
    assert proc.wait() == 130, "\n".join(lines[-40:])
    assert not [ln for ln in lines if "did not run" in ln or "Traceback" in ln], "\n".join(lines[-40:])
    (run_dir,) = runs.iterdir()
    summary = json.loads(out.read_text())
    assert summary["programs_not_started"] == {}
    cut = summary["cut_short"]
    assert (cut["signal"], cut["run_s"], cut["planned_s"], cut["in_stop"]) == ("SIGINT", None, 10.0, False)
    if cut["t_s"] < 0:  # the logger's first message, the zero of the run's times, came after the Ctrl-C
        want = "run cut short by SIGINT (Ctrl-C) before the stack's first message, so none of the planned 10 s ran " \
               "(all the log holds came while the stack stopped) (exit 130)"
    else:  # the logger wrote nothing (the launch time is the zero) or wrote it first (a slow reader here)
        want = f"run cut short by SIGINT (Ctrl-C) at t={cut['t_s']:.1f} s, before the first output, so none of the " \
               "planned 10 s ran (exit 130)"
    assert want in lines
    log = (run_dir / "supervisord.log").read_text()  # what this test is about: a program stopped while it started
    assert [name for name in ASKED if f"stopped: {name} (" in log and f"success: {name} entered RUNNING" not in log]
