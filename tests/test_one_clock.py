"""One clock: the check, the report and the launch summary count seconds from the log's first message and
print its wall-clock time once."""

from __future__ import annotations

import subprocess
import sys
import time

from chestnut.msgs.logfile import LogReader, RouteWriter
from chestnut.msgs.messaging import new_message
from chestnut.node.offline.report import write_report
from chestnut.node.offline.timeline import read_timeline


def _log(tmp_path):
    with RouteWriter(tmp_path / "logs", formats=("zst",)) as w:
        m = new_message("nodeState")
        m.nodeState.state = "active"
        m.logMonoTime = time.monotonic_ns() + 2_000_000_000
        w.write("nodeState", m.logMonoTime, m.to_bytes())
    (t0, service, header), *_ = list(LogReader(tmp_path / "logs"))
    assert service == "initData"
    return tmp_path / "logs", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(header.initData.wallTimeNanos / 1e9))


def test_the_timeline_report_and_check_name_the_wall_clock_time_of_the_first_message(tmp_path):
    logs, wall = _log(tmp_path)
    tl = read_timeline(logs)
    assert tl.wall_start() == wall
    page = write_report(tmp_path / "report", tl).read_text()
    assert f"Times are seconds since the log's first message ({wall})" in page
    out = subprocess.run(
        [sys.executable, "-m", "chestnut.launch.cli", "check", str(logs)], capture_output=True, text=True, timeout=60
    )
    assert f"times: s since the log's first message, {wall}" in out.stdout
