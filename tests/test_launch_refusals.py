"""``chestnut launch`` refuses before anything starts, in one line and exit 2: a ``--seconds`` that is not a
number of seconds (nan, inf), a ``--warp`` for frames that need no warp, and a given node configuration the
node itself would refuse (``node/config.py`` ``load_config``), whatever ``--frames`` is."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from chestnut.launch.frames import FrameOptions
from chestnut.launch.stack import argument_problem

CHESTNUT = str(Path(sys.executable).with_name("chestnut"))


@pytest.mark.parametrize("seconds", [math.nan, math.inf, -math.inf])
def test_seconds_nan_and_inf_are_refused(seconds):
    assert argument_problem(seconds, 20.0, []) == (
        f"--seconds {seconds:g}: give 0 (until Ctrl-C) or a number of seconds up to 604800 (a week)"
    )
    assert argument_problem(0.0, 20.0, []) is None and argument_problem(5.0, 20.0, []) is None


@pytest.mark.parametrize("where", ["node", "primary"])
def test_warp_without_frames_that_need_it_is_refused(where):
    line = (
        f"--warp {where} refused: the camera's frames are already the model's input (--frames model, --pixel-format "
        "bgr24), so nothing is warped; add --frames native or --pixel-format nv12 for frames that need the warp, or "
        "leave --warp out"
    )
    assert FrameOptions(warp_on=where, warp_given=True).problem() == line
    assert FrameOptions(warp_on=where).problem() is None  # not given: the default, no word
    assert FrameOptions(warp_on=where, warp_given=True, pixel_format="nv12").problem() is None
    assert FrameOptions(warp_on=where, warp_given=True, frames="native", synthetic=True).problem() is None


def _launch(tmp_path, *extra):
    return subprocess.run(
        [CHESTNUT, "launch", "--seconds", "3", "--no-live", "--runs-dir", str(tmp_path / "runs"), *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_seconds_nan_stops_the_launch_before_anything_starts(tmp_path):
    r = _launch(tmp_path, "--seconds", "nan")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0] == (
        "chestnut launch: error: argument --seconds: 'nan': give 0 (until Ctrl-C) or a number of seconds up to "
        "604800 (a week) (chestnut launch --help)"
    )
    assert not (tmp_path / "runs").exists()


def test_warp_node_alone_stops_the_launch_before_anything_starts(tmp_path):
    r = _launch(tmp_path, "--warp", "node")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and " ERROR chestnut.launch: --warp node refused: the camera's frames are" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_an_odd_nv12_model_frame_is_refused_with_the_default_frames(tmp_path):
    odd = tmp_path / "odd.toml"
    odd.write_text('[model]\npreprocess = "warp:ppocr"\nframe = "nv12:1927x1207"\n')
    r = _launch(tmp_path, "--node-config", str(odd))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    assert " ERROR chestnut.launch: --node-config: model.frame = 'nv12:1927x1207': " in lines[0]
    assert "even width and height" in lines[0]
    assert not (tmp_path / "runs").exists()


def _model(path, dims):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph), str(path))
    return path


def test_a_model_shape_the_model_file_does_not_take_is_one_line(tmp_path):
    from chestnut.launch.frames import model_input_problem

    fixed = _model(tmp_path / "fixed.onnx", [1, 3, 128, 256])
    assert model_input_problem(fixed, "x", (1, 3, 128, 256)) is None
    assert model_input_problem(fixed, "x", (1, 3, 127, 255)) == (
        f"model.shape = [1, 3, 127, 255] does not fit the input 'x' of {fixed} ([1, 3, 128, 256]): give its "
        "shape, or prepare the model for this one (chestnut model prepare --onnx M --shape N,C,H,W)"
    )
    dynamic = _model(tmp_path / "dyn.onnx", [1, 3, "H", "W"])
    assert model_input_problem(dynamic, "x", (1, 3, 127, 255)) is None  # a dynamic dimension takes any size
    assert model_input_problem(dynamic, "x", (3, 127, 255)) is not None
    assert model_input_problem(tmp_path / "missing.onnx", "x", (1, 3, 1, 1)) is None  # the node names it


def test_launch_refuses_a_model_shape_the_model_file_does_not_take(tmp_path):
    model = _model(tmp_path / "fixed.onnx", [1, 3, 128, 256])
    odd = tmp_path / "odd.toml"
    odd.write_text(f'[model]\npath = "{model}"\nshape = [1, 3, 127, 255]\n')
    r = _launch(tmp_path, "--node-config", str(odd))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    assert (
        f" ERROR chestnut.launch: --node-config: model.shape = [1, 3, 127, 255] does not fit the input 'x' of {model}"
        in lines[0]
    )
    assert not (tmp_path / "runs").exists()


def test_a_model_path_the_node_cannot_read_stops_the_launch_before_anything_starts(tmp_path):
    """It used to start the stack and leave the node crash-looping on a file that is not there."""
    cfg = tmp_path / "missing.toml"
    cfg.write_text(f'[model]\npath = "{tmp_path / "nope.onnx"}"\n')
    r = _launch(tmp_path, "--node-config", str(cfg))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    nope = tmp_path / "nope.onnx"
    assert lines[0].endswith(f" ERROR chestnut.launch: --node-config: [model] path: model file {nope} does not exist")
    assert not (tmp_path / "runs").exists()


DAMAGED = "not a well-formed ONNX model (Error parsing message with type 'onnx.ModelProto': Wire format was corrupt)"


@pytest.mark.parametrize("section", ["model", "fallback"])
def test_a_damaged_model_file_in_the_node_config_stops_the_launch_before_anything_starts(section, tmp_path,
                                                                                         tiny_onnx):
    """A truncated [model] file started the stack; the node exited at every start with 'prepare it again with
    chestnut model prepare', which does not rebuild a file of the user's, and the run showed health_not_silent."""
    damaged = tmp_path / "damaged.onnx"
    damaged.write_bytes(tiny_onnx.read_bytes()[:100])  # a truncated copy, as a full disk or a killed download leaves
    cfg = tmp_path / "node.toml"
    model, fallback = (damaged, None) if section == "model" else (tiny_onnx, damaged)
    cfg.write_text(f'[model]\npath = "{model}"\nshape = [1, 3, 32, 64]\n'
                   + (f'[fallback]\npath = "{fallback}"\n' if fallback else ""))
    r = _launch(tmp_path, "--node-config", str(cfg))
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = r.stderr.splitlines()
    what = "model" if section == "model" else "fallback model"
    assert line.endswith(f" ERROR chestnut.launch: --node-config: [{section}] path: {what} file {damaged} is damaged: "
                         f"{DAMAGED}; replace it with an intact copy, or name another file"), line
    assert not (tmp_path / "runs").exists()


def test_a_model_file_is_checked_for_what_the_node_would_refuse(tmp_path, tiny_onnx):
    from chestnut.launch.frames import model_file_problem

    assert model_file_problem(tiny_onnx) is None
    data = tiny_onnx.read_bytes()
    cut = tmp_path / "cut.onnx"
    for n in range(1, len(data)):  # a truncation anywhere is caught
        cut.write_bytes(data[:n])
        assert model_file_problem(cut) is not None, n
    fix = "run `chestnut model prepare` again (it checks the file's sha256 and rebuilds a damaged one)"
    assert model_file_problem(cut, "the default model", fix) == (
        f"the default model file {cut} is damaged: {DAMAGED}; {fix}")
    assert model_file_problem(tmp_path / "none.onnx") == f"model file {tmp_path / 'none.onnx'} does not exist"
