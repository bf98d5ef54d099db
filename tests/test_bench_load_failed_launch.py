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


def test_a_runs_dir_that_does_not_exist_yet_is_created_private(tmp_path):
    """``--runs-dir DIR`` failed the first launch when DIR did not exist yet ("--json: .../summary-quiet.json:
    folder DIR does not exist"): the bench creates it, 0700 with its missing parents, as the launch does."""
    import stat

    runs = tmp_path / "new" / "runs"
    assert bench_load.runs_folder(runs) == runs
    assert [stat.S_IMODE(p.stat().st_mode) for p in (runs, runs.parent)] == [0o700, 0o700]
    assert bench_load.runs_folder(runs) == runs  # an existing one of its own is taken as it is


def test_a_runs_dir_the_launch_would_refuse_is_refused_in_one_line(tmp_path):
    from chestnut.msgs.outdir import OutputDirError

    planted = tmp_path / "file"
    planted.write_text("")
    with pytest.raises(OutputDirError) as info:
        bench_load.runs_folder(planted)
    assert str(info.value) == f"{planted} is not a directory; give another directory"
