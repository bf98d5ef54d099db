"""The launch's ``clock:`` line names the stack's first message only once the log holds one (``launch/summary.py``
``StackClock.wall_start``): a Ctrl-C 2 s into a launch logged the launch's own time as the first message's
(``23:34:06``) while the summary, from the log, named the logger's first message that came later (``23:34:08``)
and said the run was cut short before it."""

import time

from chestnut.launch import summary
from chestnut.launch.summary import StackClock
from chestnut.msgs.logfile import LogReader, RouteWriter
from chestnut.msgs.messaging import new_message

LAUNCH_WALL_NS = 1_796_600_046_000_000_000  # 2026-12-06 23:34:06 UTC


def test_before_the_first_message_the_clock_says_there_is_none_yet(tmp_path, monkeypatch):
    monkeypatch.setattr(summary.time, "time_ns", lambda: LAUNCH_WALL_NS)
    clock = StackClock(tmp_path / "logs", 5_000_000_000)
    assert clock.wall_start() == "none yet (launched 2026-12-06 23:34:06 UTC)"
    assert clock.seconds(7_000_000_000) == 2.0  # the launch stands in for the zero meanwhile


def test_once_the_log_has_its_first_message_the_clock_names_it(tmp_path, monkeypatch):
    monkeypatch.setattr(summary.time, "time_ns", lambda: LAUNCH_WALL_NS)
    clock = StackClock(tmp_path / "logs", 5_000_000_000)
    assert clock.wall_start().startswith("none yet")
    with RouteWriter(tmp_path / "logs", formats=("zst",)) as w:
        m = new_message("nodeState")
        m.logMonoTime = time.monotonic_ns()
        w.write("nodeState", m.logMonoTime, m.to_bytes())
    (t0, service, header), *_ = list(LogReader(tmp_path / "logs"))
    assert service == "initData"
    wall = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(header.initData.wallTimeNanos / 1e9))
    assert clock.wall_start() == wall
    assert clock.seconds(t0 + 1_500_000_000) == 1.5
    summarized = summary.summarize(tmp_path / "logs", 5_000_000_000)
    assert summarized["wall_start"] == wall and summarized["t_zero_ns"] == t0  # the summary's clock: the same
