"""How ``chestnut launch`` finds and ends its programs: by ``CHESTNUT_PREFIX`` and ``CHESTNUT_LAUNCH_ID`` in
their environment (real processes), and the stop order that lets the log hold every answer."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from chestnut.launch.supervise import (
    LAUNCH_ID_ENV,
    PROGRAMS,
    STOP_ORDER,
    environ_matches,
    kill_stack,
    stack_pids,
    wait_last_answer,
)
from chestnut.msgs.messaging import new_message
from chestnut.msgs.submaster import SubMasterChecks

# ignores SIGTERM, like a program stuck in a call that never returns to its signal check
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"


def spawn(env: dict[str, str], code: str = STUBBORN) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, **env), stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "up\n"  # its environment is in place
    return p


def test_environ_matches_whole_values_only():
    env = b"PATH=/bin\0CHESTNUT_PREFIX=stack1\0CHESTNUT_LAUNCH_ID=42-run\0EMPTY=\0"
    assert environ_matches(env, {"CHESTNUT_PREFIX": "stack1"})
    assert environ_matches(env, {"CHESTNUT_PREFIX": "stack1", LAUNCH_ID_ENV: "42-run"})
    assert not environ_matches(env, {"CHESTNUT_PREFIX": "stack"})  # a prefix of the value is another stack
    assert not environ_matches(env, {LAUNCH_ID_ENV: "42"})
    assert environ_matches(env, {"EMPTY": ""}) and not environ_matches(env, {"MISSING": ""})


def test_stack_pids_finds_this_launch_only_and_kill_stack_ends_a_process_that_ignores_sigterm():
    tag = f"stop{os.getpid()}"
    ours = spawn({"CHESTNUT_PREFIX": tag, LAUNCH_ID_ENV: "A"})
    other_launch = spawn({"CHESTNUT_PREFIX": tag, LAUNCH_ID_ENV: "B"})
    other_prefix = spawn({"CHESTNUT_PREFIX": tag + "x", LAUNCH_ID_ENV: "A"})
    try:
        assert stack_pids(tag, "A") == [ours.pid]
        assert stack_pids(tag) == sorted([ours.pid, other_launch.pid])
        assert kill_stack(tag, "A", term_wait_s=0.3, kill_wait_s=5.0) == [ours.pid]
        assert stack_pids(tag, "A") == []  # SIGTERM was ignored: SIGKILL after term_wait_s (and reaped)
        assert not os.path.exists(f"/proc/{ours.pid}")
        assert other_launch.poll() is None and other_prefix.poll() is None  # not ours: untouched
    finally:
        for p in (ours, other_launch, other_prefix):
            p.kill()
            p.wait()


def test_kill_stack_asks_with_sigterm_first():
    tag = f"term{os.getpid()}"
    polite = spawn(
        {"CHESTNUT_PREFIX": tag, LAUNCH_ID_ENV: "A"},
        # the handler writes with os.write: the signal can come while print('up') is still inside stdout's
        # buffered writer (the parent has read the line already): a print there raises "reentrant call", and an
        # exit through the interpreter's shutdown could flush that half-done buffer again
        "import os, signal, time\n"
        "def bye(*_): os.write(1, b'SIGTERM\\n'); os._exit(0)\n"
        "signal.signal(signal.SIGTERM, bye); print('up', flush=True); time.sleep(60)",
    )
    try:
        # a generous bound (kill_stack returns once the process is gone): on a busy machine the handler can wait
        # seconds for a CPU, and SIGKILL after the bound would leave nothing printed
        assert kill_stack(tag, "A", term_wait_s=30.0) == [polite.pid]
        assert polite.stdout is not None and polite.stdout.read() == "SIGTERM\n"
    finally:
        polite.kill()
        polite.wait()


def test_stop_order_consumer_first_then_camera_node_logger_twin():
    assert STOP_ORDER == ("control", "camera", "node", "record", "twin")
    assert sorted(STOP_ORDER) == sorted(PROGRAMS)


class ScriptedView:
    """A StackView stand-in: each update() delivers the next scripted batch of events."""

    def __init__(self, batches: list[list]) -> None:
        self.sm = SubMasterChecks(["cameraFrame", "modelOutput"])
        self.batches = batches
        self.t = 0

    def update(self, _timeout_ms: int = 0) -> None:
        self.t += 1
        self.sm.update_msgs(self.t, self.batches.pop(0) if self.batches else [])


def frame(fid: int):
    m = new_message("cameraFrame")
    m.cameraFrame.frameId = fid
    return m.as_reader()


def output(fid: int):
    m = new_message("modelOutput")
    m.modelOutput.frameId = fid
    return m.as_reader()


def test_wait_last_answer_waits_for_the_answer_to_the_newest_frame():
    view = ScriptedView([[frame(40), output(39)], [], [output(40)]])
    assert wait_last_answer(view, timeout_s=5.0) is True
    assert view.t == 3  # returned on the update that brought the answer to frame 40


def test_wait_last_answer_gives_up_after_its_timeout():
    view = ScriptedView([[frame(40), output(39)]])
    t0 = time.monotonic()
    assert wait_last_answer(view, timeout_s=0.2) is False
    assert time.monotonic() - t0 >= 0.2


def test_wait_last_answer_without_frames_returns_at_once():
    assert wait_last_answer(ScriptedView([]), timeout_s=5.0) is True


def test_the_stop_logs_no_line_for_the_publishers_it_takes_away(caplog, tmp_path):
    """Every stop printed ``INFO chestnut.msgs.messaging: controlState: its publisher went away (stopped or
    restarted), or sent a message over the service's 64 KiB bound ...`` for each of the view's services: the stop
    itself takes them away. A message over a bound (a WARNING) still shows, and the level is the caller's after."""
    import logging

    from chestnut.launch.supervise import shut_down

    messaging = logging.getLogger("chestnut.msgs.messaging")

    class View:
        def close(self) -> None:  # where the view's subscribers see their publishers go
            messaging.info("controlState: its publisher went away (stopped or restarted)")
            messaging.warning("cameraFrame: a message over the service's 16 MiB bound was refused")

    caplog.set_level(logging.INFO)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    before = messaging.level
    shut_down(proc, tmp_path / "supervisord.conf", View(), f"stop-quiet-{os.getpid()}", f"{os.getpid()}-quiet")
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == messaging.name] == [
        ("WARNING", "cameraFrame: a message over the service's 16 MiB bound was refused")]
    assert messaging.level == before
