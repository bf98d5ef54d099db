"""``chestnut launch``'s exit status (``launch/stack.py`` ``exit_code``): with ``--seconds 0`` Ctrl-C is the
normal end of the run (0 clean, 1 not); 128 + the signal only for a Ctrl-C (130) or SIGTERM (143) that cut a
timed run short."""

import signal

import pytest

from chestnut.launch.stack import exit_code


@pytest.mark.parametrize(
    ("ok", "seconds", "signum", "want"),
    [
        (True, 0.0, signal.SIGINT, 0),  # until stopped, clean: the normal end
        (False, 0.0, signal.SIGINT, 1),  # until stopped, a violation or a failed start
        (True, 0.0, signal.SIGTERM, 0),  # until stopped, by a process manager
        (True, 60.0, signal.SIGINT, 130),  # a timed run cut short by Ctrl-C
        (False, 60.0, signal.SIGINT, 130),
        (True, 60.0, signal.SIGTERM, 143),  # ... or by SIGTERM
        (True, 60.0, None, 0),  # a timed run that ran out
        (False, 60.0, None, 1),
        (True, 0.0, None, 0),  # until stopped, ended by the stack dying
        (False, 0.0, None, 1),
    ],
)
def test_exit_code(ok, seconds, signum, want):
    assert exit_code(ok, seconds, signum) == want


# a launch whose twin met a directory planted at twin.sock at every start: supervisord gave up on it, the
# fallback served every frame, and launch exited 0 ("contracts: no violation"); its Foxglove server was still
# failing to start when the run ended
SUPERVISORD_LOG = """\
2026-12-04 05:30:48,477 INFO spawned: 'twin' with pid 1100
2026-12-04 05:30:48,478 INFO spawned: 'record' with pid 1101
2026-12-04 05:30:48,479 INFO spawned: 'node' with pid 1102
2026-12-04 05:30:48,482 INFO spawned: 'control' with pid 1103
2026-12-04 05:30:48,900 WARN exited: twin (exit status 2; not expected)
2026-12-04 05:30:49,586 INFO success: record entered RUNNING state, {stayed}1 seconds (startsecs)
2026-12-04 05:30:49,586 INFO success: control entered RUNNING state, {stayed}1 seconds (startsecs)
2026-12-04 05:30:49,901 INFO spawned: 'twin' with pid 1110
2026-12-04 05:30:50,300 WARN exited: twin (exit status 2; not expected)
2026-12-04 05:30:50,508 INFO success: node entered RUNNING state, {stayed}2 seconds (startsecs)
2026-12-04 05:30:52,301 INFO spawned: 'twin' with pid 1120
2026-12-04 05:30:52,700 WARN exited: twin (exit status 2; not expected)
2026-12-04 05:30:55,701 INFO spawned: 'twin' with pid 1130
2026-12-04 05:30:56,100 WARN exited: twin (exit status 2; not expected)
2026-12-04 05:30:56,101 INFO gave up: twin entered FATAL state, too many start retries too quickly
2026-12-04 05:30:56,815 INFO spawned: 'camera' with pid 1129
2026-12-04 05:30:58,057 INFO success: camera entered RUNNING state, {stayed}1 seconds (startsecs)
2026-12-04 05:30:58,100 INFO spawned: 'foxglove' with pid 1140
2026-12-04 05:30:58,500 WARN exited: foxglove (exit status 1; not expected)
2026-12-04 05:31:07,189 INFO waiting for control to stop
2026-12-04 05:31:07,232 INFO stopped: control (exit status 0)
""".format(stayed="process has stayed up for > than ")  # supervisor 4's words, kept apart for the line length
TWIN_LOG = """\
2026-12-04 05:30:56,050 ERROR chestnut.backend.sim.daemon: socket path /run/chestnut-0/p/twin.sock holds a \
directory, not a socket: refused, nothing replaced; remove it and start again
"""
ASKED = ["twin", "record", "node", "control", "camera", "foxglove"]


def test_programs_that_never_ran_are_read_from_supervisords_log(tmp_path):
    from chestnut.launch.supervise import programs_not_started

    (tmp_path / "supervisord.log").write_text(SUPERVISORD_LOG)
    assert programs_not_started(tmp_path / "supervisord.log", ASKED) == {
        "twin": "supervisord gave up on it (FATAL) after 4 exit(s) at start, the last with exit status 2",
        "foxglove": "it never stayed up past its start (1 exit(s) at start, the last with exit status 1)",
    }
    assert programs_not_started(tmp_path / "supervisord.log", ["record", "node", "control", "camera"]) == {}
    assert programs_not_started(tmp_path / "missing.log", ASKED) == {}


def test_a_program_that_never_ran_is_one_summary_line_and_fails_the_run(tmp_path, capsys):
    from types import SimpleNamespace

    from drivelog import write_drive

    from chestnut.launch.stack import verdict
    from chestnut.launch.summary import print_summary, summarize
    from chestnut.launch.supervise import not_started_lines
    from chestnut.msgs.messaging import new_message

    (tmp_path / "supervisord.log").write_text(SUPERVISORD_LOG)
    (tmp_path / "twin.log").write_text(TWIN_LOG)
    lines = not_started_lines(tmp_path, ASKED)
    twin_line = (
        "program twin did not run: supervisord gave up on it (FATAL) after 4 exit(s) at start, the last with exit "
        "status 2; its last error: ERROR chestnut.backend.sim.daemon: socket path /run/chestnut-0/p/twin.sock holds "
        f"a directory, not a socket: refused, nothing replaced; remove it and start again; see {tmp_path}/twin.log"
    )
    assert lines == {
        "twin": twin_line,
        "foxglove": "program foxglove did not run: it never stayed up past its start (1 exit(s) at start, the last "
                    f"with exit status 1); see {tmp_path}/foxglove.log",
    }
    m = new_message("modelOutput")
    m.logMonoTime = 10**9
    write_drive([(10**9, "modelOutput", m.to_bytes())], tmp_path / "logs")
    summary = summarize(tmp_path / "logs", 0)
    summary.update(programs_not_started=lines, contracts={"one_output_per_frame": 0})
    print_summary(summary, tmp_path)
    assert twin_line in capsys.readouterr().out.splitlines()  # one line, unwrapped
    launch = SimpleNamespace(args=SimpleNamespace(json=None, seconds=5.0), died=False, failed_start=False,
                             faults_missed=False, flag=SimpleNamespace(signum=None))
    assert summary["outputs"] == 1 and verdict(launch, summary) == 1  # type: ignore[arg-type]
    assert verdict(launch, {**summary, "programs_not_started": {}}) == 0  # type: ignore[arg-type]


def _cut_summary(tmp_path, signum, t_signal_ns, seconds=60.0, output=True, t_stop_ns=12 * 10**9):
    """A run's summary: its first message at 1 s, its first output at 3 s (launched at 0); its stop begun at
    ``t_stop_ns``, ``signum`` came at ``t_signal_ns`` (CLOCK_MONOTONIC ns)."""
    from types import SimpleNamespace

    from drivelog import write_drive

    from chestnut.launch.summary import stop_figures, summarize
    from chestnut.msgs.messaging import new_message

    def at(t_ns, service):
        m = new_message(service)
        m.logMonoTime = t_ns
        return t_ns, service, m.to_bytes()

    write_drive([at(10**9, "nodeState"), *([at(3 * 10**9, "modelOutput")] if output else [])], tmp_path / "logs")
    summary = summarize(tmp_path / "logs", 0)
    summary.update(stop_figures(summary, 0, t_stop_ns, SimpleNamespace(signum=signum, t_ns=t_signal_ns), seconds))
    summary["contracts"] = {"one_output_per_frame": 0}
    return summary


@pytest.mark.parametrize(
    ("signum", "t_signal_s", "seconds", "output", "want"),
    [
        (signal.SIGINT, 11.5, 60.0, True,
         "run cut short by SIGINT (Ctrl-C) at t=10.5 s, 8.5 s into the planned 60 s (exit 130)"),
        (signal.SIGTERM, 2.0, 60.0, False,
         "run cut short by SIGTERM at t=1.0 s, before the first output, so none of the planned 60 s ran (exit 143)"),
        (signal.SIGTERM, 11.0, 5.0, True,  # a run that went on past --seconds 5 to carry out its fault plan
         "run cut short by SIGTERM at t=10.0 s, 8.0 s after the first output, past the planned 5 s, before its "
         "fault plan was carried out (exit 143)"),
        (signal.SIGINT, 12.5, 60.0, True,  # after the stop began at 12 s
         "SIGINT (Ctrl-C) at t=11.5 s, while the stack stopped after the run had ended (exit 130)"),
    ],
)
def test_a_run_cut_short_says_so_in_one_summary_line_and_in_the_json(tmp_path, capsys, signum, t_signal_s, seconds,
                                                                       output, want):
    import json

    from chestnut.launch.summary import cut_short_line, print_summary, write_summary_json

    summary = _cut_summary(tmp_path, signum, int(t_signal_s * 10**9), seconds, output)
    assert cut_short_line(summary["cut_short"]) == want
    print_summary(summary, tmp_path)
    assert want in capsys.readouterr().out.splitlines()  # one line, unwrapped
    assert write_summary_json(tmp_path / "s.json", summary) is None
    got = json.loads((tmp_path / "s.json").read_text())["cut_short"]
    assert got == summary["cut_short"] and got["signal"] == signal.Signals(signum).name
    assert got["planned_s"] == seconds and summary["stop_s"] == pytest.approx(11.0, abs=0.01)


@pytest.mark.parametrize(("signum", "seconds"), [(signal.SIGINT, 0.0), (None, 60.0)])
def test_a_run_that_ended_normally_has_no_cut_short_line(tmp_path, capsys, signum, seconds):
    from chestnut.launch.summary import print_summary

    summary = _cut_summary(tmp_path, signum, 11_500_000_000 if signum else None, seconds)
    assert summary["cut_short"] is None
    print_summary(summary, tmp_path)
    assert "cut short" not in capsys.readouterr().out


def test_the_stop_flag_keeps_when_the_first_stop_signal_came():
    import os
    import time

    from chestnut.launch.signals import StopFlag

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        flag = StopFlag()
        before = time.monotonic_ns()
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs before kill returns (a signal to this thread)
        first = flag.t_ns
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.stop and flag.signum == signal.SIGTERM
        assert first is not None and before <= first <= time.monotonic_ns() and flag.t_ns == first
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_the_summary_to_a_reader_that_went_away_raises_broken_pipe_for_exit_141(tmp_path, monkeypatch):
    """rich's own Console ended the process with SystemExit(1), nothing said; launch/cli.py main turns a
    BrokenPipeError into 141, as for every chestnut command (`chestnut launch ... | head -1`)."""
    import os
    import sys

    from chestnut.launch.summary import print_summary

    summary = _cut_summary(tmp_path, None, None, 60.0)
    r, w = os.pipe()
    os.close(r)
    out = os.fdopen(w, "w")
    monkeypatch.setattr(sys, "stdout", out)
    try:
        with pytest.raises(BrokenPipeError):
            print_summary(summary, tmp_path)
    finally:
        monkeypatch.undo()
        try:
            out.close()
        except BrokenPipeError:
            pass
