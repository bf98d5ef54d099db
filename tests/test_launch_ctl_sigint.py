"""A terminal's Ctrl-C is SIGINT to the whole foreground process group: ``chestnut launch`` takes it as its stop
signal (``launch/signals.py`` ``StopFlag``), and the ``supervisorctl`` it runs meanwhile, in a session of its own
(``launch/supervise.py`` ``supervisorctl``), finishes the start or stop it was asked. Killed by that SIGINT, it
read as ``exit -2``: an ERROR for a camera start the Ctrl-C cut short, a WARNING for a node that stopped with
status 0, and the stop order cut (the next program stopped at once)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

FAKE_CTL = """#!/bin/sh
# a supervisorctl stand-in: logs its request; a camera start and a node stop take a while (startsecs, a stop)
shift 2
echo "$*" >> {log}
case "$*" in
  "start camera"|"stop node") : > {busy}."$2"; exec sleep 1.5 ;;
esac
"""

CHILD = """
import json, sys
sys.executable = {python!r}
from pathlib import Path
from chestnut.launch import supervise
from chestnut.launch.signals import StopFlag

class View:
    def __init__(self):
        self.sm = self
        self.seen = {{"cameraFrame": False, "modelOutput": False}}
    def update(self, ms):
        pass

flag = StopFlag()
conf = Path({conf!r})
started = supervise.supervisorctl(conf, "start", "camera")
print(json.dumps({{"start": started, "signum": flag.signum, "notes": supervise.stop_stack(conf, View())}}))
"""


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    t_end = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < t_end, f"{path} never came"
        time.sleep(0.01)


def test_a_ctrl_c_to_the_process_group_fails_no_start_or_stop(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ctl_log, busy = tmp_path / "ctl.log", tmp_path / "busy"
    ctl = bin_dir / "supervisorctl"
    ctl.write_text(FAKE_CTL.format(log=ctl_log, busy=busy))
    ctl.chmod(0o700)
    code = CHILD.format(python=str(bin_dir / "python"), conf=str(tmp_path / "supervisord.conf"))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(Path(f"{busy}.camera"))  # the camera's start under way: a Ctrl-C
        os.killpg(child.pid, signal.SIGINT)
        _wait_for(Path(f"{busy}.node"))  # the node's stop under way: a second Ctrl-C
        os.killpg(child.pid, signal.SIGINT)
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0
    assert json.loads(out) == {"start": 0, "signum": signal.SIGINT, "notes": []}
    assert ctl_log.read_text().splitlines() == [
        "start camera", "stop control", "stop camera", "stop node", "stop record", "stop twin"
    ]
