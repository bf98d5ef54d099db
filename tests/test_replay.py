"""``chestnut replay``: logged outputs re-run with the source that served them, compared like process replay.

The drive (``tests/drivelog.py``): 180 frames, 100 served by the primary (tinygrad), 80 by the
fallback (onnxruntime), in four 3 s segments; every output tensor really computed by the tiny model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from drivelog import (
    FRAME_PERIOD_NS,
    HEIGHT,
    WIDTH,
    _edit,
    build_drive,
    drop_output,
    swap_output_ids,
    tamper_tensor,
    trailing_frames,
    write_drive,
)
from tinymodel import make_tiny_onnx

from chestnut.launch.cli import main
from chestnut.msgs.logfile import SegmentFileReader
from chestnut.node.offline.replay import (
    KIND_IN_FLIGHT,
    KIND_LOST,
    KIND_MISSING,
    KIND_NOT_SERVING,
    KIND_OK,
    KIND_VALUES,
    ReplayError,
    SegmentTask,
    plan_tasks,
    replay,
    replay_segment,
    resolve_plan,
)

BASE_NS = 10_000 * 1_000_000_000
OUT_SHAPE = (1, 1, HEIGHT // 2, WIDTH // 2)


@pytest.fixture(scope="module")
def drive(tiny_onnx: Path) -> list:
    return build_drive(tiny_onnx, base_ns=BASE_NS)


@pytest.fixture(scope="module")
def clean_log(drive, tmp_path_factory) -> Path:
    logs = tmp_path_factory.mktemp("clean") / "logs"
    write_drive(drive, logs)
    return logs


def write(items: list, tmp_path: Path) -> Path:
    write_drive(items, tmp_path / "logs")
    return tmp_path / "logs"


def mismatches(result) -> list[tuple[int, str]]:
    return [(f.frame_id, f.kind) for f in result.mismatches]


def test_clean_log_replays_with_zero_mismatches(clean_log):
    r = replay(clean_log, jit_cache=False)
    assert r.ok and r.mismatches == [] and r.damage == []
    assert r.replayed() == {"primary": 100, "fallback": 80}
    assert [f.frame_id for f in r.frames] == list(range(180))
    assert {f.kind for f in r.frames} == {KIND_OK}
    assert r.tensor_maxima() == {"prob": (0.0, 0)}  # bit-exact: same kernels, same onnxruntime
    assert [(m.source, m.frames, m.same_bytes) for m in r.model_ids] == [("fallback", 80, True), ("primary", 100, True)]
    assert r.plan.config_origin == "the log's node initData"
    assert (r.plan.primary.engine, r.plan.fallback.engine, r.plan.preprocess) == ("tinygrad", "onnxruntime", "ppocr")


@pytest.mark.parametrize("frame_id,source", [(40, "primary"), (100, "fallback")])
def test_tampered_tensor_is_one_value_mismatch(drive, tmp_path, frame_id, source):
    r = replay(write(tamper_tensor(drive, frame_id, 7, 0.01), tmp_path), jit_cache=False)
    assert mismatches(r) == [(frame_id, KIND_VALUES)]
    f = r.mismatches[0]
    assert (f.logged_source, f.replayed_with) == (source, source)
    (t,) = f.tensors
    assert (t.name, t.n_mismatch, t.size, t.first_mismatch) == ("prob", 1, int(np.prod(OUT_SHAPE)), (0, 0, 0, 7))
    assert t.max_abs_diff == pytest.approx(0.01, abs=1e-6)
    assert r.tensor_maxima()["prob"][1] == frame_id
    assert not r.ok


def test_dropped_output_is_a_missing_output(drive, tmp_path):
    r = replay(write(drop_output(drive, 30), tmp_path), jit_cache=False)
    assert mismatches(r) == [(30, KIND_MISSING)]
    assert r.replayed() == {"primary": 99, "fallback": 80}


def test_swapped_frame_ids_mismatch_both_frames(drive, tmp_path):
    r = replay(write(swap_output_ids(drive, 30, 31), tmp_path), jit_cache=False)
    assert mismatches(r) == [(30, KIND_VALUES), (31, KIND_VALUES)]


def test_truncated_segment_is_reported_and_the_rest_replayed(drive, tmp_path):
    logs = write(tamper_tensor(drive, 150, 3, 0.5), tmp_path)
    seg1 = logs / "2026-01-01--00-00-00--1" / "rlog.zst"
    data = seg1.read_bytes()
    seg1.write_bytes(data[: len(data) // 2])
    reader = SegmentFileReader(seg1)
    survived = list(reader)
    frames_read = [e.cameraFrame.frameId for _, s, _, e in survived if s == "cameraFrame"]
    answered = {e.modelOutput.frameId for _, s, _, e in survived if s == "modelOutput"}
    r = replay(logs, jit_cache=False)
    assert [(d.path, d.offset, d.reason) for d in r.damage] == [(str(seg1), reader.damage[0].offset,
                                                                  reader.damage[0].reason)]
    assert mismatches(r) == [(150, KIND_VALUES)]  # the segments after the damage were still replayed
    # the frames cut off with the file are not in the log; one read whose answer was cut off is excused
    unread = set(range(frames_read[-1] + 1, 119))
    assert unread and [f.frame_id for f in r.frames] == [i for i in range(180) if i not in unread]
    assert [f.frame_id for f in r.frames if f.kind == KIND_LOST] == [i for i in frames_read if i not in answered]
    assert not r.ok


def test_log_end_excuses_frames_in_flight(drive, tmp_path):
    t_out = next(t for t, s, _ in drive if s == "modelOutput" and t > BASE_NS + 180 * FRAME_PERIOD_NS)
    r = replay(write([it for it in drive if it[0] < t_out], tmp_path), jit_cache=False)
    assert r.ok and [(f.frame_id, f.kind) for f in r.frames if f.kind != KIND_OK] == [(179, KIND_IN_FLIGHT)]


def test_frames_after_the_node_stopped_are_excused(drive, tmp_path):
    r = replay(write(trailing_frames(drive, stopping=True), tmp_path), jit_cache=False)
    assert r.ok and [(f.frame_id, f.kind) for f in r.frames if f.kind != KIND_OK] == [
        (i, KIND_NOT_SERVING) for i in range(180, 190)]


def test_other_model_is_named_as_a_model_id_mismatch(clean_log, tmp_path, capsys):
    other = make_tiny_onnx(tmp_path / "other.onnx", seed=1)
    r = replay(clean_log, model=other, jit_cache=False)
    assert {(m.source, m.same_bytes) for m in r.model_ids} == {("primary", False), ("fallback", False)}
    assert len(r.mismatches) == 180 and {f.kind for f in r.mismatches} == {KIND_VALUES}
    assert main(["replay", str(clean_log), "--model", str(other), "--no-jit-cache", "--top", "2"]) == 1
    out = capsys.readouterr().out
    assert "MODEL DIFFERS: the log's outputs came from tiny@" in out and "replay runs other@" in out


def test_forced_source_replays_every_frame_with_it(clean_log):
    r = replay(clean_log, source="fallback", jit_cache=False)
    assert r.ok and r.replayed() == {"fallback": 180}
    assert r.plan.primary is None
    # the primary's tinygrad outputs agree with onnxruntime far inside 1e-4
    assert 0.0 < r.tensor_maxima()["prob"][0] < 1e-6


def test_unit_of_work_is_self_contained(clean_log, tiny_onnx):
    # a plan without the log's config: input name and shape from the model's own graph
    plan = resolve_plan({}, model=tiny_onnx, jit_cache=False)
    assert (plan.primary.input_name, plan.primary.input_shape) == ("x", (1, 3, HEIGHT, WIDTH))
    tasks = plan_tasks(sorted(clean_log.rglob("rlog.zst")), plan)
    assert [t.next_path is not None for t in tasks] == [True, True, True, False]
    one = replay_segment(SegmentTask(1, tasks[1].path, tasks[1].next_path, plan))
    assert [f.frame_id for f in one.frames] == list(range(59, 119))
    assert all(f.ok for f in one.frames) and one.damage == []


def test_missing_model_is_a_clear_error(drive, tmp_path):
    def move(ev):
        ev.initData.config = ev.initData.config.replace('"path": "', '"path": "/nonexistent')

    items = _edit(drive, lambda t, s, e: s == "initData", move)
    with pytest.raises(ReplayError, match="primary model /nonexistent.* not found on this machine: give --model"):
        replay(write(items, tmp_path), jit_cache=False)
    assert main(["replay", str(tmp_path / "logs"), "--no-jit-cache"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_replay_is_deterministic_and_independent_of_workers(clean_log, drive, tmp_path):
    one = replay(clean_log, jit_cache=False)
    again = replay(clean_log, jit_cache=False)
    two = replay(clean_log, jit_cache=False, workers=2)
    assert one.frames == again.frames == two.frames
    assert one.digest() == again.digest() == two.digest()
    assert two.workers == 2 and len({s.pid for s in two.segments}) >= 1
    doctored = write(tamper_tensor(drive, 100, 7, 0.01), tmp_path)
    assert replay(doctored, jit_cache=False, workers=2).digest() == replay(doctored, jit_cache=False).digest()


def test_cli_report(clean_log, tmp_path):
    assert main(["replay", str(clean_log), "--no-jit-cache", "--report", str(tmp_path / "report")]) == 0
    page = (tmp_path / "report" / "index.html").read_text()
    assert page.count('src="data:image/png;base64,') == 3
    assert "PASS: 0 replay mismatch(es), 0 model id mismatch(es), 0 damaged file(s)" in page
    assert "frames replayed" in page and "fallback 80, primary 100" in page


def test_report_says_identical_replays_instead_of_drawing_them(clean_log, tmp_path):
    """Every frame replays bit-exactly (tinygrad primary, deterministic onnxruntime fallback): the agreement
    figure says so in its caption instead of plotting 180 points at a stand-in value."""
    assert main(["replay", str(clean_log), "--no-jit-cache", "--report", str(tmp_path / "report")]) == 0
    page = (tmp_path / "report" / "index.html").read_text()
    assert "replayed / logged: all 180 frames identical (difference exactly 0)" in page


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launched_stack_log_with_a_fault_replays_and_checks_clean(tmp_path):
    """The whole stack (twin with the tinygrad engine, logger, control, node, camera) under supervisord,
    a fence stall injected and cleared: its log has zero replay mismatches and zero contract violations."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile

    from chestnut.node.offline.contracts import CONTRACTS, check_log

    model = make_tiny_onnx(tmp_path / "tiny128.onnx", height=128, width=256)
    conf = tmp_path / "node.toml"
    conf.write_text(f'[model]\npath = "{model}"\nname = "tiny"\ninput = "x"\nshape = [1, 3, 128, 256]\n'
                    'preprocess = "ppocr"\n[model.ranges]\nprob = [0.0, 1.0]\n'
                    '[fallback]\nengine = "onnxruntime"\nstandby = "hot"\n[dock]\nkind = "twin"\n')
    # a short run directory: supervisord's control socket lives there (AF_UNIX paths stop at 108 bytes)
    runs = Path(tempfile.mkdtemp(prefix="chestnut-runs-", dir="/tmp"))
    cmd = [sys.executable, "-m", "chestnut.launch.cli", "launch", "--seconds", "16", "--no-live", "--runs-dir",
           str(runs), "--node-config", str(conf), "--twin-engine", "tinygrad", "--fault", "fence_stall@2+3",
           "--fault-from", "active"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:
        assert proc.returncode == 0, out
        (run_dir,) = list(runs.iterdir())
        shutil.copytree(run_dir / "logs", tmp_path / "logs")
    finally:
        shutil.rmtree(runs, ignore_errors=True)
    logs = tmp_path / "logs"
    checked = check_log(logs)
    assert checked.counts() == dict.fromkeys(CONTRACTS, 0), checked.violations
    assert {o.source for o in checked.timeline.outputs} == {"primary", "fallback"}
    assert any(s.state == "degraded" for s in checked.timeline.node_states), out  # failed over, then came back
    r = replay(logs, model=model, jit_cache=False)
    assert r.ok, (r.mismatches[:5], r.model_mismatches, r.damage)
    assert set(r.replayed()) == {"primary", "fallback"}
    assert r.tensor_maxima()["prob"][0] == 0.0  # the twin's tinygrad engine: bit-exact


@pytest.mark.parametrize("top", ["-5", "x", "2.5"])
def test_a_top_count_below_0_or_not_a_whole_number_is_refused_in_one_line(top, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["replay", str(tmp_path), "--top", top])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"chestnut replay: error: argument --top: {top!r}: give a number of rows >= 0 (0: none) "
        "(chestnut replay --help)\n")


def test_a_top_count_of_0_lists_no_rows():
    from chestnut.node.offline.replay_cli import top_count

    assert [top_count(t) for t in ("0", "3")] == [0, 3]
