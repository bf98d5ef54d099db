"""The stage times in the launch summary and the report: p50 / p99 per stage of the primary (the fallback's
compute), copy-in beside openpilot#38862's figure; a log from before the fields (zeros) says it has none.

The logs are written as the logger writes them (``msgs/logfile.py`` through ``tests/drivelog.py``), with
stage times chosen per frame, so every figure is known exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from drivelog import write_drive

from chestnut.launch.summary import print_summary, summarize
from chestnut.msgs.frames import fill_frame
from chestnut.msgs.messaging import new_message
from chestnut.node.offline.report import stage_rows, write_report
from chestnut.node.offline.timeline import read_timeline

BASE_NS = 5_000 * 1_000_000_000
MS = 1_000_000


def stage_log(tmp_path: Path, with_stages: bool = True) -> Path:
    """40 frames at 20 Hz: 0-29 served by the primary with copy-in (i+1) ms, compute 2 ms, copy-out 0.5 ms;
    30-39 by the fallback with compute 3 ms."""
    img = np.zeros((4, 8, 3), np.uint8)
    items = []
    for i in range(40):
        t = BASE_NS + i * 50 * MS
        cf = fill_frame(i, img, t - 2 * MS, t - MS, "test")
        cf.logMonoTime = t  # type: ignore[attr-defined]
        items.append((t, "cameraFrame", cf.to_bytes()))  # type: ignore[attr-defined]
        m = new_message("modelOutput")
        m.logMonoTime = t + 4 * MS
        mo = m.modelOutput
        mo.frameId = i
        primary = i < 30
        mo.source = "primary" if primary else "fallback"
        mo.executionTime = (i + 1 + 2.5) / 1e3 if primary else 0.003
        if with_stages:
            mo.copyInTime, mo.computeTime, mo.copyOutTime = (
                ((i + 1) / 1e3, 0.002, 0.0005) if primary else (0.0, 0.003, 0.0)
            )
        items.append((t + 4 * MS, "modelOutput", m.to_bytes()))
    write_drive(items, tmp_path / "logs")
    return tmp_path / "logs"


def test_the_summary_gives_p50_and_p99_per_stage_of_the_primary(tmp_path: Path, capsys) -> None:
    s = summarize(stage_log(tmp_path), BASE_NS)
    assert s["by_source"] == {"primary": 30, "fallback": 10}
    # copy-in 1..30 ms: p50 15.5, p99 29.71 (numpy's linear interpolation); float32 fields, rounded to 0.01 ms
    assert s["stages_ms"] == {"copy_in": [15.5, 29.71], "compute": [2.0, 2.0], "copy_out": [0.5, 0.5]}
    print_summary(s, tmp_path)
    out = " ".join(capsys.readouterr().out.split())
    assert "primary copy-in p50 / p99 │ 15.5 / 29.7 ms (openpilot#38862: ~22 ms)" in out, out
    assert "primary compute p50 / p99 │ 2.0 / 2.0 ms" in out and "primary copy-out p50 / p99 │ 0.5 / 0.5 ms" in out


def test_a_log_from_before_the_stage_times_says_it_has_none(tmp_path: Path, capsys) -> None:
    logs = stage_log(tmp_path, with_stages=False)
    s = summarize(logs, BASE_NS)
    assert s["stages_ms"] is None and s["outputs"] == 40
    print_summary(s, tmp_path)
    out = " ".join(capsys.readouterr().out.split())
    assert "primary stage times │ none in this log │" in out, out
    tl = read_timeline(logs)
    assert stage_rows(tl) == []
    page = write_report(tmp_path / "report", tl).read_text()
    assert "<p>no stage times in this log (no primary output, or a log from before them)</p>" in page


def test_the_report_tables_the_stage_times_with_their_budgets(tmp_path: Path) -> None:
    tl = read_timeline(stage_log(tmp_path))
    assert {o.stages_s for o in tl.outputs if o.source == "fallback"} == {(0.0, np.float32(0.003), 0.0)}
    assert stage_rows(tl) == [
        ("primary", "copy-in", 30, "15.5", "29.7", "30.0", "20", "openpilot#38862: ~22 ms a frame"),
        ("primary", "compute", 30, "2.0", "2.0", "2.0", "15", ""),
        ("primary", "copy-out", 30, "0.5", "0.5", "0.5", "15", ""),
        ("fallback", "compute", 10, "3.0", "3.0", "3.0", "15", ""),
    ]
    page = write_report(tmp_path / "report", tl).read_text()
    assert "<h2>stage times</h2>" in page
    assert (
        "<tr><td>primary</td><td>copy-in</td><td>30</td><td>15.5</td><td>29.7</td><td>30.0</td><td>20</td>"
        "<td>openpilot#38862: ~22 ms a frame</td></tr>"
    ) in page
    # timeline and latency drawn; no frame ran both models: the agreement panel is a sentence, not empty axes
    assert page.count('src="data:image/png;base64,') == 2
    assert "<h2>agreement</h2><p>primary / fallback: no frame compared</p>" in page
