"""A run whose folder fills up: each run file that cannot be written (``faults.json``, the report) is one ERROR
line naming it, the summary is still printed with a ``not written:`` line each, and the run is not clean
(``launch/summary.py`` ``write_run_file``, ``check_contracts``; ``launch/stack.py`` ``verdict``)."""

from types import SimpleNamespace

from drivelog import write_drive

from chestnut.launch.stack import verdict
from chestnut.launch.summary import check_contracts, print_summary, summarize, write_run_file
from chestnut.msgs.messaging import new_message
from chestnut.msgs.outdir import OutputDirError


def _full(path, data):  # type: ignore[no-untyped-def]
    """``msgs/outdir.py`` ``write_private`` on a full disk: its one-line error."""
    raise OutputDirError(path, "cannot be written (No space left on device)", "free space or give another directory")


def test_a_full_disk_is_one_line_per_run_file_and_the_run_is_not_clean(tmp_path, monkeypatch, capsys, caplog):
    import chestnut.msgs.outdir
    import chestnut.node.offline.report

    m = new_message("modelOutput")
    m.logMonoTime = 10**9
    write_drive([(10**9, "modelOutput", m.to_bytes())], tmp_path / "logs")
    monkeypatch.setattr(chestnut.msgs.outdir, "write_private", _full)
    monkeypatch.setattr(chestnut.node.offline.report, "write_private", _full)
    lost = write_run_file(tmp_path / "faults.json", "[]")
    faults_line = f"{tmp_path}/faults.json cannot be written (No space left on device); free space or give another " \
                  "directory"
    assert lost == [faults_line]
    counts, page = check_contracts(tmp_path, [], None, list_violations=False, lost=lost)
    report_line = f"report: {tmp_path}/report/timeline.png cannot be written (No space left on device); free space " \
                  "or give another directory"
    assert (page, lost) == ("", [faults_line, report_line])
    assert {k: v for k, v in counts.items() if v} == {"health_not_silent": 1}  # the log has no chestnutHealth
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [faults_line, report_line]
    summary = summarize(tmp_path / "logs", 0)
    summary.update(contracts={"one_output_per_frame": 0}, report=page, outputs_lost=lost)
    print_summary(summary, tmp_path)
    out = capsys.readouterr().out.splitlines()
    assert [ln for ln in out if ln.startswith("not written: ")] == [f"not written: {faults_line}",
                                                                    f"not written: {report_line}"]
    launch = SimpleNamespace(args=SimpleNamespace(json=None, seconds=5.0), died=False, failed_start=False,
                             faults_missed=False, flag=SimpleNamespace(signum=None))
    assert verdict(launch, summary) == 1  # type: ignore[arg-type]
    assert verdict(launch, {**summary, "outputs_lost": []}) == 0  # type: ignore[arg-type]


def test_a_run_file_that_can_be_written_is(tmp_path):
    assert write_run_file(tmp_path / "faults.json", "[]") == []
    assert (tmp_path / "faults.json").read_text() == "[]"
