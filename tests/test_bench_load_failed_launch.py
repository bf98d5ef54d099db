"""``tests/bench/bench_load.py`` says in one line why its launch left no summary: the launch's own error line
(``no_summary_line``). ``--runs-dir /nonexistent/x`` printed ``launch exit 2 after 4 s`` and the stderr's tail below
it, the cause three lines further down under ``no summary:``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent / "bench"
sys.path.insert(0, str(BENCH))

import bench_load  # noqa: E402

pytestmark = [pytest.mark.timeout(120)]


def test_a_launch_refused_before_it_started_is_named_by_its_own_error_line(run_base):
    """The launch itself runs (and refuses the folder before anything starts); no hogs."""
    runs = Path("/nonexistent/x")
    summary, code, err = bench_load.run_launch(1.0, runs, None)
    assert (summary, code) == (None, 2)
    assert bench_load.no_summary_line("no fault", code, 1.2, "0.50 / 0.40 / 0.30", err) == (
        "no fault: launch exit 2 after 1 s, no summary; load average 0.50 / 0.40 / 0.30; ERROR chestnut.launch: "
        "--json: /nonexistent/x/summary-quiet.json: folder /nonexistent/x does not exist; create it or give another "
        "path")


def test_an_argument_refusal_and_a_silent_launch_are_one_line_too():
    refusal = "chestnut launch: error: argument --seconds: 'x': give a number (chestnut launch --help)\n"
    assert bench_load.no_summary_line("fault gpu_hang@20+10", 2, 0.4, "1.00 / 1.00 / 1.00", refusal) == (
        "fault gpu_hang@20+10: launch exit 2 after 0 s, no summary; load average 1.00 / 1.00 / 1.00; chestnut launch: "
        "error: argument --seconds: 'x': give a number (chestnut launch --help)")
    assert bench_load.no_summary_line("no fault", 1, 61.0, "unknown", "\n") == (
        "no fault: launch exit 1 after 61 s, no summary; load average unknown; (nothing on its stderr)")
