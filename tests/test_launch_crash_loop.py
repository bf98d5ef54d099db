"""A node that exits at every start stops ``chestnut launch``'s wait for the first modelOutput (as it stops the
nodeState wait), and launch names the node's last error line (``launch/supervise.py`` ``wait_for``,
``node_exits``, ``last_error_line``)."""

from pathlib import Path

from chestnut.launch import supervise

SUPERVISORD_LOG = """\
2026-12-01 12:26:04,101 INFO spawned: 'node' with pid 100
2026-12-01 12:26:06,102 INFO success: node entered RUNNING state, process has stayed up for > than 2 seconds (startsecs)
2026-12-01 12:26:09,500 WARN exited: node (exit status 3; not expected)
2026-12-01 12:26:10,501 INFO spawned: 'node' with pid 101
2026-12-01 12:26:12,502 INFO success: node entered RUNNING state, process has stayed up for > than 2 seconds (startsecs)
2026-12-01 12:26:15,900 WARN exited: node (exit status 3; not expected)
2026-12-01 12:26:15,901 INFO exited: camera (exit status 0; expected)
"""

NODE_LOG = """\
2026-12-01 12:26:08,000 INFO chestnut.node: fallback model loaded
2026-12-01 12:26:09,400 ERROR chestnut.node: fallback run failed: bad input x index: 2 Got: 127 Expected: 128
2026-12-01 12:26:09,401 WARNING chestnut.node: starting -> stopping on fallback_failed: no usable fallback
2026-12-01 12:26:09,450 INFO chestnut.node: stopped
"""


def test_node_exits_counts_unexpected_exits_of_the_node_only():
    assert supervise.node_exits(SUPERVISORD_LOG) == 2
    assert supervise.node_exits("") == 0
    assert supervise.node_exits("2026-12-01 12:26:09,500 INFO exited: node (exit status 0; expected)\n") == 0


def test_the_last_error_line_names_the_cause():
    assert supervise.last_error_line(NODE_LOG) == (
        "ERROR chestnut.node: fallback run failed: bad input x index: 2 Got: 127 Expected: 128"
    )
    no_error = "\n".join(ln for ln in NODE_LOG.splitlines() if " ERROR " not in ln)
    assert supervise.last_error_line(no_error) == (
        "WARNING chestnut.node: starting -> stopping on fallback_failed: no usable fallback"
    )
    assert supervise.last_error_line("") == "(node.log is empty)"
    assert supervise.last_words(NODE_LOG) == (
        "its last error: ERROR chestnut.node: fallback run failed: bad input x index: 2 Got: 127 Expected: 128"
    )
    assert supervise.last_words(no_error) == (
        "its log ends: WARNING chestnut.node: starting -> stopping on fallback_failed: no usable fallback"
    )
    record = "2026-12-04 11:43:01,002 INFO chestnut.record: stopped by signal 15\n"
    assert supervise.last_words(record) == "its log ends: INFO chestnut.record: stopped by signal 15"


def test_read_tail_is_bounded(tmp_path):
    f = tmp_path / "x.log"
    f.write_bytes(b"a" * 100 + b"tail\n")
    assert supervise.read_tail(f, 5) == "tail\n"
    assert supervise.read_tail(tmp_path / "missing.log") == ""


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.5  # every look at the clock is half a second later: the wait runs on this clock alone
        return self.t


class _View:
    """A stack view whose first modelOutput would come 40 s (of the fake clock) in."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.sm = self
        self.seen = {"modelOutput": False}

    def update(self, _ms: int) -> None:
        self.seen["modelOutput"] = self.clock.t >= 40.0


def test_the_first_output_wait_stops_when_the_node_exits_at_every_start(tmp_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(supervise.time, "monotonic", clock)
    monkeypatch.setattr(supervise, "program_state", lambda conf, name: "STARTING")  # between two of its starts
    conf = tmp_path / "supervisord.conf"
    (tmp_path / "supervisord.log").write_text(SUPERVISORD_LOG)
    assert supervise.wait_for(_View(clock), "modelOutput", 60.0, conf) is False
    assert clock.t < 40.0  # it gave up on the crash loop, not on the output or the deadline


def test_one_exit_does_not_stop_the_wait(tmp_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(supervise.time, "monotonic", clock)
    monkeypatch.setattr(supervise, "program_state", lambda conf, name: "RUNNING")
    one = "".join(SUPERVISORD_LOG.splitlines(keepends=True)[:4])
    Path(tmp_path / "supervisord.log").write_text(one)
    assert supervise.wait_for(_View(clock), "modelOutput", 60.0, tmp_path / "supervisord.conf") is True
