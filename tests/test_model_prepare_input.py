"""``chestnut model prepare`` refuses a bad ``--onnx`` or ``--shape`` in one line on stderr, exit 2, and
writes nothing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHESTNUT = str(Path(sys.executable).with_name("chestnut"))


def prepare(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    (tmp_path / "out").mkdir(mode=0o700, exist_ok=True)  # an --out's folder must exist (it is never created)
    return subprocess.run(
        [CHESTNUT, "model", "prepare", "--out", str(tmp_path / "out" / "m.onnx"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_onnx_file_that_is_garbage_is_one_line(tmp_path):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\xff\xfe not a protobuf \x00" * 64)
    r = prepare(tmp_path, "--onnx", str(garbage))
    assert r.returncode == 2
    assert (r.stdout, r.stderr) == ("", (  # the refusal alone: "preparing ..." came first
        f"chestnut model prepare: bad_model: {garbage} does not parse as an ONNX model (Error parsing message with "
        "type 'onnx.ModelProto': Wire format was corrupt)\n"))
    assert not (tmp_path / "out" / "m.onnx").exists()


def test_a_missing_onnx_file_is_one_line(tmp_path):
    missing = tmp_path / "nope.onnx"
    r = prepare(tmp_path, "--onnx", str(missing))
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"chestnut model prepare: --onnx {missing}: no such file; give the path of an ONNX model "
        "(or leave --onnx out for the default PP-OCRv4 detector)"
    ]


@pytest.mark.parametrize("shape", ["1,x,3", "1,3,128", "1,3,0,256", "1,3,-128,256"])
def test_a_shape_that_is_not_four_positive_integers_is_one_line(tmp_path, shape):
    r = prepare(tmp_path, "--shape", shape)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"chestnut model prepare: --shape {shape!r}: give the input shape N,C,H,W as 4 positive integers, "
        "e.g. 1,3,128,256"
    ]


@pytest.mark.parametrize(
    ("words", "prog"),
    [
        (["model", "prepare", "--bogus", "x"], "chestnut model prepare"),
        (["model", "paths", "--bogus"], "chestnut model paths"),
    ],
)
def test_an_unknown_flag_is_refused_under_the_subcommands_own_name(words, prog, capsys):
    """``chestnut model prepare --bogus`` pointed at ``chestnut --help``, not at the subcommand's usage."""
    from chestnut.launch.cli import main

    with pytest.raises(SystemExit) as info:
        main(words)
    assert info.value.code == 2
    unknown = " ".join(words[2:])
    assert capsys.readouterr().err == f"{prog}: error: unrecognized arguments: {unknown} ({prog} --help)\n"


def test_parse_shape():
    from chestnut.launch.assets import parse_shape

    assert parse_shape("1, 3, 64, 128") == (1, 3, 64, 128)
    with pytest.raises(ValueError, match=r"^--shape '1,x,3': give"):
        parse_shape("1,x,3")


def test_a_shape_against_a_dim_the_model_fixes_is_refused_before_compiling(tmp_path):
    """PP-OCRv4's input is [N, 3, H, W] with N, H, W free: 4 channels is refused at once, nothing written."""
    from chestnut.launch.assets import ppocr_det_path

    r = prepare(tmp_path, "--shape", "1,4,128,256")
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == (
        f"chestnut model prepare: bad_input_shape: input 'x' of {ppocr_det_path()} is ['p2o.DynamicDimension.0', 3, "
        "'p2o.DynamicDimension.1', 'p2o.DynamicDimension.2']: dim 1 is 3 in the model, shape given [1, 4, 128, 256] "
        "asks 4")
    assert not (tmp_path / "out" / "m.onnx").exists()
    assert not (tmp_path / "cache" / "chestnut" / "jit").exists()  # nothing compiled


def prepare_in_process(tmp_path: Path, monkeypatch, capsys, *args: str) -> tuple[int, list[str], list[str]]:
    """``chestnut model prepare --out tmp/out/m.onnx ARGS`` in this process: (exit code, stdout lines, stderr
    lines)."""
    from chestnut.launch.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "out").mkdir(mode=0o700, exist_ok=True)
    rc = main(["model", "prepare", "--out", str(tmp_path / "out" / "m.onnx"), *args])
    said = capsys.readouterr()
    return rc, said.out.splitlines(), said.err.splitlines()


def test_an_empty_onnx_file_is_one_line_as_garbage_is(tmp_path, monkeypatch, capsys):
    """An empty file parses as an empty ModelProto (no graph): bad_model in one line, not an IndexError, and
    alone: ``preparing ...`` was said on standard output first."""
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    rc, said, err = prepare_in_process(tmp_path, monkeypatch, capsys, "--onnx", str(empty))
    assert (rc, said, err) == (2, [], [
        f"chestnut model prepare: bad_model: {empty} is not an ONNX model with a graph "
        "(an empty file parses as an empty ModelProto)"
    ])
    assert not (tmp_path / "out" / "m.onnx").exists()


def test_an_onnx_model_without_graph_inputs_is_one_line(tmp_path, monkeypatch, capsys):
    import onnx
    from onnx import TensorProto, helper

    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    const = helper.make_node("Constant", [], ["y"], value=helper.make_tensor("c", TensorProto.FLOAT, [1], [1.0]))
    no_inputs = tmp_path / "no_inputs.onnx"
    onnx.save(helper.make_model(helper.make_graph([const], "g", [], [out])), str(no_inputs))
    rc, said, err = prepare_in_process(tmp_path, monkeypatch, capsys, "--onnx", str(no_inputs))
    assert (rc, said, err) == (2, [], [
        f"chestnut model prepare: bad_model: {no_inputs} has no graph inputs; the node feeds a model one input "
        "[N,C,H,W]"
    ])
    assert not (tmp_path / "out" / "m.onnx").exists()


def test_repair_and_fix_shape_refuses_an_empty_model_as_a_model_error():
    import onnx

    from chestnut.backend.errors import ModelError
    from chestnut.launch.assets import repair_and_fix_shape

    with pytest.raises(ModelError, match=r"^bad_model: the model is not an ONNX model with a graph \("):
        repair_and_fix_shape(onnx.ModelProto(), (1, 3, 128, 256))


def test_an_onnx_path_that_is_a_directory_says_so(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "models"
    folder.mkdir()
    rc, said, err = prepare_in_process(tmp_path, monkeypatch, capsys, "--onnx", str(folder))
    assert (rc, said, err) == (2, [], [
        f"chestnut model prepare: --onnx {folder}: is a directory; give the path of an ONNX model "
        "(or leave --onnx out for the default PP-OCRv4 detector)"
    ])


def test_an_onnx_path_that_is_a_fifo_says_so_and_is_never_opened(tmp_path, monkeypatch, capsys):
    """It said 'no such file'; opening it would wait for a writer, forever for a planted one."""
    from chestnut.backend.errors import ModelError
    from chestnut.launch.assets import prepare_model

    fifo = tmp_path / "model.onnx"
    os.mkfifo(fifo)
    rc, said, err = prepare_in_process(tmp_path, monkeypatch, capsys, "--onnx", str(fifo))
    assert (rc, said, err) == (2, [], [
        f"chestnut model prepare: --onnx {fifo}: is a FIFO, not a regular file; give the path of an ONNX model "
        "(or leave --onnx out for the default PP-OCRv4 detector)"
    ])
    with pytest.raises(ModelError) as e:  # the library call, as the command's check: never opened
        prepare_model(fifo, tmp_path / "out" / "m.onnx", (1, 3, 32, 64), None)
    assert str(e.value) == f"missing_model: model file {fifo}: is a FIFO, not a regular file"
    assert not (tmp_path / "out" / "m.onnx").exists()


def test_an_input_of_another_rank_names_the_file_given(tmp_path, monkeypatch, capsys):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8, 8])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 8, 8])
    rank3 = tmp_path / "rank3.onnx"
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["z"])], "g", [x], [z])),
              str(rank3))
    rc, said, err = prepare_in_process(tmp_path, monkeypatch, capsys, "--onnx", str(rank3))
    assert (rc, said, err) == (2, [], [
        f"chestnut model prepare: bad_input_shape: input 'x' of {rank3} has rank 3, shape given [1, 3, 128, 256]"
    ])
    assert not (tmp_path / "out" / "m.onnx").exists()


def test_an_operator_tinygrad_cannot_run_is_one_line_naming_the_file_given(tmp_path, monkeypatch, capsys):
    """``Det`` (onnxruntime has it, tinygrad 0.14's ONNX runner does not) came out of the first tinygrad run as a
    NotImplementedError traceback."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 3])
    det = tmp_path / "det.onnx"
    graph = helper.make_graph([helper.make_node("Det", ["x"], ["z"])], "g", [x], [z])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(det))
    rc, _, err = prepare_in_process(tmp_path, monkeypatch, capsys, "--onnx", str(det), "--shape", "1,3,4,4")
    out = tmp_path / "out" / "m.onnx"
    assert (rc, err) == (2, [
        f"chestnut model prepare: bad_model: tinygrad could not run model file {out}: NotImplementedError: "
        f"op='Det' is not supported (prepared from {det})"
    ])
    assert not out.with_suffix(".json").exists()  # never taken as ready


def test_an_onnx_file_over_the_2_gib_bound_is_refused_from_its_size_unread(tmp_path, monkeypatch, capsys):
    """A 5 GB (sparse) --onnx was read whole, 5 GB of memory for 20 s, before protobuf refused it."""
    big = tmp_path / "big.onnx"
    with open(big, "wb") as f:
        f.truncate(5 << 30)
    rc, said, err = prepare_in_process(tmp_path, monkeypatch, capsys, "--onnx", str(big))
    assert (rc, said, err) == (2, [], [
        f"chestnut model prepare: --onnx {big}: is 5368709120 bytes, over the 2147483648 an ONNX model can be; give "
        "the path of an ONNX model (or leave --onnx out for the default PP-OCRv4 detector)"
    ])


def test_a_shape_the_model_refuses_is_refused_before_the_check_frame_is_read(tmp_path, monkeypatch, capsys):
    """``--shape 1,3,32,99999999`` against a model whose input is [1, 3, 32, 64] was a traceback: the sample image
    was resized to it first (``read_image_bgr``: PyAV's ``ArgumentError``), while ``1,3,32,70000`` got the
    bad_input_shape line. Both now get that line, exit 2, and the image is never read."""
    from tinymodel import make_tiny_onnx

    from chestnut.launch import assets

    reads: list[tuple[int, int]] = []
    real_read = assets.read_image_bgr
    monkeypatch.setattr(assets, "read_image_bgr", lambda p, h, w: reads.append((h, w)) or real_read(p, h, w))
    tiny = make_tiny_onnx(tmp_path / "tiny.onnx")
    for width in ("99999999", "70000"):
        rc, said, err = prepare_in_process(tmp_path, monkeypatch, capsys, "--onnx", str(tiny), "--shape",
                                           f"1,3,32,{width}")
        assert (rc, said, err) == (2, [], [
            f"chestnut model prepare: bad_input_shape: input 'x' of {tiny} is [1, 3, 32, 64]: dim 3 is 64 in the "
            f"model, shape given [1, 3, 32, {width}] asks {width}"
        ])
    assert reads == []
    assert not (tmp_path / "out" / "m.onnx").exists()


def test_a_shape_over_the_nodes_element_bound_is_refused_before_the_check_frame_is_read(tmp_path, monkeypatch,
                                                                                         capsys):
    """PP-OCRv4's H and W are free, so ``1,3,128,99999999`` passed the model's dims and went on to a traceback in
    the sample read; it is over the elements the node takes (``node/config.py`` MAX_INPUT_ELEMENTS): one line."""
    from chestnut.launch import assets

    monkeypatch.setattr(assets, "read_image_bgr", lambda *a: pytest.fail("the sample image was read"))
    rc, said, err = prepare_in_process(tmp_path, monkeypatch, capsys, "--shape", "1,3,128,99999999")
    assert (rc, said, err) == (2, [], [
        "chestnut model prepare: bad_input_shape: shape given [1, 3, 128, 99999999] is 38399999616 elements, over "
        "the 16777216 a model input may have (64 MiB of float32, node/config.py MAX_INPUT_ELEMENTS); give a "
        "smaller --shape"
    ])


def test_a_sample_read_that_fails_is_one_warning_line_and_a_random_input(monkeypatch, caplog):
    """Only a missing wheel (ModelError) was caught; any other failure of the read (PyAV's errors) was a
    traceback."""
    import logging

    from chestnut.launch import assets

    def broken(*a: object) -> None:
        raise ValueError("[Errno 22] Invalid argument\nsecond line")

    monkeypatch.setattr(assets, "read_image_bgr", broken)
    with caplog.at_level(logging.WARNING, logger="chestnut.assets"):
        assert assets.sample_frame(128, 256) is None
    assert [r.getMessage() for r in caplog.records] == [
        "no real frame for the agreement check ([Errno 22] Invalid argument); using a fixed random input"
    ]


def test_paths_says_where_the_model_goes_and_that_it_is_not_prepared_yet(tmp_path):
    env = {**os.environ, "CHESTNUT_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([CHESTNUT, "model", "paths"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    where = tmp_path / "cache" / "models" / "ppocr_det_128x256.onnx"
    assert r.stdout.splitlines()[0] == f"model: {where} (not prepared: `chestnut model prepare` makes it)"
