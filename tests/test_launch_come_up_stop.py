"""A stop signal while ``chestnut launch`` brings the stack up ends the wait at once: the camera is not started
after it, and the start-up is not called failed (``launch/stack.py`` ``come_up``, ``launch/supervise.py``
``wait_for``)."""

import argparse
from pathlib import Path
from typing import Any

from chestnut.launch import stack, supervise


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Flag:
    def __init__(self) -> None:
        self.stop = False
        self.signum: int | None = None


class _View:
    """A stack view on a fake clock (each update is 0.1 s): the node's first nodeState comes at ``state_at`` s,
    its first modelOutput at ``output_at`` s after the camera starts; the stop signal comes at ``stop_at`` s."""

    def __init__(self, clock: _Clock, flag: _Flag, stop_at: float, state_at: float, output_at: float) -> None:
        self.clock, self.flag, self.stop_at = clock, flag, stop_at
        self.state_at, self.output_at = state_at, output_at
        self.camera_t: float | None = None
        self.sm = self
        self.seen = {"nodeState": False, "modelOutput": False}

    def update(self, ms: int) -> None:
        self.clock.t = round(self.clock.t + ms / 1000, 3)
        if self.clock.t >= self.stop_at:
            self.flag.stop = True
        self.seen["nodeState"] = self.clock.t >= self.state_at
        self.seen["modelOutput"] = self.camera_t is not None and self.clock.t >= self.camera_t + self.output_at


class _Proc:
    def poll(self) -> None:
        return None


def _launch(tmp_path: Path, monkeypatch: Any, stop_at: float, state_at: float, output_at: float) -> tuple[Any, list]:
    clock, flag = _Clock(), _Flag()
    view = _View(clock, flag, stop_at, state_at, output_at)
    monkeypatch.setattr(supervise.time, "monotonic", clock)
    monkeypatch.setattr(supervise, "program_state", lambda conf, name: "RUNNING")
    calls: list = []

    def supervisorctl(conf: Path, *args: str, timeout_s: float = 30.0) -> int:
        calls.append((args, clock.t))
        view.camera_t = clock.t
        return 0

    monkeypatch.setattr(stack, "supervisorctl", supervisorctl)
    launch = argparse.Namespace(run_dir=tmp_path, conf=tmp_path / "supervisord.conf", flag=flag, view=view,
                                proc=_Proc(), failed_start=False, died=False,
                                asked=["twin", "record", "node", "control"])
    return launch, calls


def test_a_stop_before_the_first_node_state_ends_the_wait_and_starts_no_camera(tmp_path, monkeypatch, caplog):
    caplog.set_level("INFO")
    launch, calls = _launch(tmp_path, monkeypatch, stop_at=1.0, state_at=3.0, output_at=1.0)
    assert stack.come_up(launch) is False
    assert launch.view.clock.t == 1.0  # not the 120 s deadline, not the nodeState at 3 s
    assert calls == []
    assert launch.asked == ["twin", "record", "node", "control"]
    assert (launch.failed_start, launch.died) == (False, False)
    assert "a stop signal came while the node came up: the camera is not started" in caplog.messages
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_stop_with_the_first_node_state_starts_no_camera(tmp_path, monkeypatch):
    launch, calls = _launch(tmp_path, monkeypatch, stop_at=2.0, state_at=2.0, output_at=1.0)
    assert stack.come_up(launch) is False
    assert (launch.view.clock.t, calls, launch.failed_start) == (2.0, [], False)


def test_a_stop_before_the_first_output_ends_that_wait(tmp_path, monkeypatch, caplog):
    launch, calls = _launch(tmp_path, monkeypatch, stop_at=2.5, state_at=2.0, output_at=30.0)
    assert stack.come_up(launch) is False
    assert calls == [(("start", "camera"), 2.0)]
    assert launch.view.clock.t == 2.5  # not the 60 s deadline, not the output at 32 s
    assert (launch.failed_start, launch.died, launch.flag.stop) == (False, False, True)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_without_a_stop_the_stack_comes_up(tmp_path, monkeypatch):
    launch, calls = _launch(tmp_path, monkeypatch, stop_at=1e9, state_at=2.0, output_at=1.5)
    assert stack.come_up(launch) is True
    assert (calls, launch.view.clock.t, launch.flag.stop) == ([(("start", "camera"), 2.0)], 3.5, False)
