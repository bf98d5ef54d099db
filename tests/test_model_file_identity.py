"""A model file given by path is named by that path in every refusal, and identified at start.

- a refusal names the file the user gave (``--model``, a configuration's path), not the name the model runs
  under (``[model] name``, ``ppocr_det-fallback``): ``backend/model.py`` ``model_label``;
- the advice after a refused file of the user's is theirs to act on (another file, an intact copy), not
  ``chestnut model prepare``, which rebuilds only the prepared default (``node/main.py`` ``model_fix``);
- every model file the node runs is logged once at start with its size and sha256 and what its known-answer
  check found -- "unchecked" where no fingerprint is recorded, so a file with a flipped weight that still parses
  is at least identified -- and carried in ``initData`` / ``nodeState`` ``identity`` (``node/contract.py``
  ``file_identity``);
- ``chestnut launch --node-config`` parses the model file once for its two checks of it
  (``launch/frames.py`` ``check_model_file``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from nodeharness import write_node_config
from tinymodel import make_tiny_onnx

from chestnut.backend.errors import ModelError
from chestnut.backend.model import OnnxModel, OrtModel
from chestnut.node.config import default_model_path, load_config
from chestnut.node.main import MODEL_FIX, OWN_MODEL_FIX, Node, model_fix

pytestmark = [pytest.mark.timeout(120)]

CORRUPT = "Error parsing message with type 'onnx.ModelProto': Wire format was corrupt"
OWN_FIX = ("name another file (--model / --fallback-model, or the config's [model] / [fallback] path), or replace "
           "this one")


def garbage(path: Path) -> Path:
    path.write_bytes(b"\x00garbage" * 10)
    return path


def flipped_copy(src: Path, dst: Path) -> Path:
    """``src`` with one byte of its first weight flipped: still a well-formed ONNX model, other numbers."""
    import onnx

    data = bytearray(src.read_bytes())
    weights = onnx.load(str(src)).graph.initializer[0].raw_data
    at = bytes(data).find(weights)
    assert at > 0
    data[at + 101] ^= 0x40
    dst.write_bytes(bytes(data))
    onnx.checker.check_model(onnx.load(str(dst)))
    return dst


def dynamic_model(path: Path, input_name: str) -> Path:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [1, 3, "H", "W"])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 3, "H", "W"])
    graph = helper.make_graph([helper.make_node("Identity", [input_name], ["z"])], "g", [x], [z])
    onnx.save(helper.make_model(graph), str(path))
    return path


def det_model(path: Path) -> Path:
    """A model onnxruntime runs and tinygrad 0.14 does not: ``Det`` is not among ``tinygrad/nn/onnx.py``'s ops."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 3])
    graph = helper.make_graph([helper.make_node("Det", ["x"], ["z"])], "g", [x], [z])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


# ---------------------------------------------------------------- refusals name the file


def test_a_host_model_refusal_names_the_file_not_the_name_it_runs_under(tmp_path: Path) -> None:
    bad = garbage(tmp_path / "bad.onnx")
    with pytest.raises(ModelError) as e:
        OrtModel(bad, name="ppocr_det")
    assert str(e.value) == f"bad_model: model file {bad} is not a readable ONNX model: {CORRUPT}"
    with pytest.raises(ModelError) as e:
        OnnxModel(bad.read_bytes(), name="ppocr_det", origin=bad, what="fallback model")
    assert str(e.value) == f"bad_model: fallback model file {bad} is not a readable ONNX model: {CORRUPT}"
    with pytest.raises(ModelError) as e:  # bytes of no known file: the name is all there is
        OrtModel(bad.read_bytes(), name="program-0123")
    assert str(e.value) == f"bad_model: program-0123 is not a readable ONNX model: {CORRUPT}"


def test_an_empty_model_file_is_no_onnx_model_not_a_model_without_inputs(tmp_path: Path) -> None:
    """Protobuf reads 0 bytes as a model without a graph: the node said 'has no input 'x' (its inputs: )'."""
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(ModelError) as e:
        OrtModel(empty, name="ppocr_det", input_shapes={"x": (1, 3, 8, 8)})
    assert str(e.value) == f"bad_model: model file {empty} is not an ONNX model: it has no graph (0 bytes)"


def test_a_shape_given_under_a_name_the_model_has_no_input_of_is_refused_naming_its_inputs(tmp_path: Path) -> None:
    dyn = dynamic_model(tmp_path / "dyn.onnx", "y")
    with pytest.raises(ModelError) as e:
        OrtModel(dyn, name="ppocr_det", input_shapes={"x": (1, 3, 8, 8)})
    assert str(e.value) == f"unknown_input: model file {dyn} has no input 'x' (its inputs: 'y')"
    with pytest.raises(ModelError) as e:
        OrtModel(dyn)
    assert str(e.value) == (f"bad_input_shape: input 'y' of model file {dyn} has shape [1, 3, 'H', 'W']; give a "
                            "fixed shape")


def test_an_operator_tinygrad_cannot_run_is_a_model_error_naming_the_file(tmp_path: Path) -> None:
    """It was tinygrad's own NotImplementedError out of the first run, a traceback in ``chestnut model prepare``."""
    det = det_model(tmp_path / "det.onnx")
    model = OnnxModel(det, name="ppocr_det")
    with pytest.raises(ModelError) as e:
        model.warm()
    assert str(e.value) == (f"bad_model: tinygrad could not run model file {det}: NotImplementedError: "
                            "op='Det' is not supported")


def test_the_fix_for_a_refused_file_is_prepare_only_for_the_prepared_default(tmp_path: Path) -> None:
    assert model_fix(default_model_path()) == MODEL_FIX
    assert MODEL_FIX.startswith("prepare it again with `chestnut model prepare`")
    assert model_fix(tmp_path / "mine.onnx") == OWN_MODEL_FIX == OWN_FIX


def test_chestnut_run_with_a_garbage_model_names_the_file_given(tmp_path: Path) -> None:
    """``chestnut run --model garbage.onnx`` said "ppocr_det is not a readable ONNX model" (the config's name)
    and advised ``chestnut model prepare``, which does not rebuild a file of the user's."""
    bad = garbage(tmp_path / "garbage.onnx")
    proc = subprocess.run([sys.executable, "-m", "chestnut.launch.cli", "run", "--dock", "none", "--rt-priority", "0",
                           "--model", str(bad)], capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert proc.returncode == 3, proc.stderr
    errors = [ln.split(" ", 2)[2] for ln in proc.stderr.splitlines() if " ERROR " in ln]
    assert errors == [
        "ERROR chestnut.node: no output contract: the primary model declares the output contract and cannot be run "
        f"at model.shape [1, 3, 128, 256]: model file {bad} is not a readable ONNX model: {CORRUPT}; {OWN_FIX}"
    ]
    # the stop names its cause, not "stop requested" (nodeState's reason says the same)
    stops = [ln.split(" ", 4)[4] for ln in proc.stderr.splitlines() if "-> stopping on stop" in ln]
    assert stops == [
        "starting -> stopping on stop: stop: no output contract: the primary model declares the output contract and "
        f"cannot be run at model.shape [1, 3, 128, 256]: model file {bad} is not a readable ONNX model: {CORRUPT}"
    ]
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- chestnut launch parses the file once


def test_launch_hands_the_parsed_model_to_its_shape_check(tmp_path: Path, tiny_onnx: Path) -> None:
    from chestnut.launch.frames import check_model_file, model_file_problem, model_input_problem

    checked = check_model_file(tiny_onnx)
    assert checked.problem is None
    assert [i.name for i in checked.model.graph.input] == ["x"]
    gone = tmp_path / "gone.onnx"  # the shape check reads the parsed model, not the path (there is none)
    assert model_input_problem(gone, "x", (1, 3, 64, 64), checked.model) == (
        f"model.shape = [1, 3, 64, 64] does not fit the input 'x' of {gone} ([1, 3, 32, 64]): give its shape, or "
        "prepare the model for this one (chestnut model prepare --onnx M --shape N,C,H,W)")
    assert model_input_problem(gone, "x", (1, 3, 64, 64)) is None  # read from the path: the node names it
    bad = garbage(tmp_path / "bad.onnx")
    refused = check_model_file(bad, "fallback model")
    assert (refused.problem, refused.model) == (
        f"fallback model file {bad} is damaged: not a well-formed ONNX model ({CORRUPT}); replace it with an intact "
        "copy, or name another file", None)
    assert model_file_problem(bad, "fallback model") == refused.problem


# ---------------------------------------------------------------- identity of the files the node runs


class Sent:
    """A PubMaster stand-in: what the node sends, by service."""

    def __init__(self) -> None:
        self.msgs: dict[str, list[Any]] = {}

    def send(self, service: str, msg: Any) -> None:
        self.msgs.setdefault(service, []).append(msg.as_reader() if hasattr(msg, "as_reader") else msg)

    def close(self) -> None:
        pass


def started(cfg: Path) -> tuple[Node, Sent]:
    """A node of ``cfg`` (no dock) with its contract declared and its fallback warm, sending into a :class:`Sent`."""
    node = Node(load_config(cfg))
    sent = Sent()
    node.pm = sent  # type: ignore[assignment]
    assert node.declare_contract() is None
    assert node.warm_fallback()
    return node, sent


def file_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "chestnut.node" and " file " in r.getMessage()
            and "sha256" in r.getMessage()]


def identity(msg: Any, what: str) -> dict[str, str]:
    return {kv.key: kv.value for kv in getattr(msg, what).identity}


def test_a_model_file_with_no_fingerprint_is_logged_once_with_its_sha256_and_named_in_the_identity(
        tmp_path: Path, tiny_onnx: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A ``--model`` file with a flipped weight ran without a word: only the prepared default has a fingerprint.
    Its bytes are now named at start (unchecked), in the log and in initData / nodeState."""
    caplog.set_level(logging.INFO, logger="chestnut.node")
    flipped = flipped_copy(tiny_onnx, tmp_path / "flipped.onnx")
    sha = hashlib.sha256(flipped.read_bytes()).hexdigest()
    assert sha != hashlib.sha256(tiny_onnx.read_bytes()).hexdigest()
    size = flipped.stat().st_size
    node, sent = started(write_node_config(tmp_path / "node.toml", flipped, dock="none"))
    try:
        assert file_lines(caplog) == [
            f"model file {flipped}: {size} bytes, sha256 {sha}; unchecked: no fingerprint recorded (none at "
            f"{tmp_path / 'flipped.fingerprint.json'}): its weights are not checked, only identified by this sha256"
        ]
        want = {"model_file": str(flipped), "model_sha256": sha, "model_bytes": str(size),
                "model_check": "unchecked: no fingerprint recorded"}
        node._publish_housekeeping(time.monotonic_ns())
        (init,), (state,) = sent.msgs["initData"], sent.msgs["nodeState"]
        for got in (identity(init, "initData"), identity(state, "nodeState")):
            assert {k: v for k, v in got.items() if k.startswith("model_") or k.startswith("fallback_")} == want
        contract = json.loads(init.initData.config)["contract"]
        assert (contract["model_sha256"], contract["known_answer"]) == (sha, "unchecked: no fingerprint recorded")
    finally:
        node.close()


def test_a_fallback_file_of_its_own_is_identified_beside_a_checked_primary(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from chestnut.backend.fingerprint import fixed_inputs, make_fingerprint

    caplog.set_level(logging.INFO, logger="chestnut.node")
    primary = make_tiny_onnx(tmp_path / "primary.onnx")
    fallback = make_tiny_onnx(tmp_path / "fallback.onnx", seed=1)  # same contract, other weights
    ort = OrtModel(primary)
    fp = make_fingerprint(ort.sha256, ort.inputs, ort.run(fixed_inputs(ort.inputs)))
    (tmp_path / "primary.fingerprint.json").write_text(json.dumps(fp))
    p_sha, f_sha = (hashlib.sha256(p.read_bytes()).hexdigest() for p in (primary, fallback))
    p_size, f_size = primary.stat().st_size, fallback.stat().st_size
    cfg = write_node_config(tmp_path / "node.toml", primary, dock="none", fallback_model=fallback)
    node, sent = started(cfg)
    try:
        assert file_lines(caplog) == [
            f"model file {primary}: {p_size} bytes, sha256 {p_sha}; matches its recorded fingerprint: 1 output(s) "
            "bit-exact",
            f"fallback model file {fallback}: {f_size} bytes, sha256 {f_sha}; unchecked: no fingerprint recorded "
            f"(none at {tmp_path / 'fallback.fingerprint.json'}): its weights are not checked, only identified by "
            "this sha256",
        ]
        node._publish_housekeeping(time.monotonic_ns())
        got = identity(sent.msgs["initData"][-1], "initData")
        assert {k: v for k, v in got.items() if k.startswith("model_") or k.startswith("fallback_")} == {
            "model_file": str(primary), "model_sha256": p_sha, "model_bytes": str(p_size),
            "model_check": "matches its recorded fingerprint: 1 output(s) bit-exact",
            "fallback_file": str(fallback), "fallback_sha256": f_sha, "fallback_bytes": str(f_size),
            "fallback_check": "unchecked: no fingerprint recorded",
        }
    finally:
        node.close()
