"""The node's one output contract comes from the primary model file and its configuration (``node/contract.py``):

- a fallback of another output shape, or with other output names, is refused when it loads, in one line that
  names the difference, and the node refuses to start (``EXIT_NO_FALLBACK``); with ``fallback.required =
  false`` it serves from the primary alone, and the primary is never rejected because of the fallback;
- a ``[model.ranges]`` key naming an output the primary does not have is refused (``EXIT_CONFIG``);
- a model file that fails its known-answer check (its recorded fingerprint) is refused for both roles.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from nodeharness import Bus, NodeProcess, exit_of, record_fingerprint, write_node_config

from chestnut.backend.errors import ConfigError
from chestnut.fallback.standby import FallbackModel
from chestnut.node.config import load_config
from chestnut.node.contract import ContractError, declare_contract, fallback_refusal
from chestnut.node.main import EXIT_CONFIG, EXIT_NO_FALLBACK

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def make_model(path: Path, out_name: str = "prob", stride: int = 2, bias: float = 0.0) -> Path:
    """x float32[1,3,32,64] -> ``out_name`` float32[1,1,32/stride,64/stride] in [0, 1] (conv, sigmoid); ``bias``
    is added before the sigmoid (a model that computes other numbers)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = (np.random.default_rng(1).standard_normal((1, 3, 3, 3)) * 0.2).astype(np.float32)
    b = np.array([bias], np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[stride, stride]),
         helper.make_node("Sigmoid", ["c"], [out_name])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 64])],
        [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, [1, 1, 32 // stride, 64 // stride])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_the_contract_is_the_primary_files_whatever_the_fallback(tmp_path: Path) -> None:
    primary = make_model(tmp_path / "primary.onnx")
    small = make_model(tmp_path / "small.onnx", stride=4)
    alone = load_config(write_node_config(tmp_path / "a.toml", primary, dock="none"))
    with_small = load_config(write_node_config(tmp_path / "b.toml", primary, dock="none", fallback_model=small))
    a, b = declare_contract(alone, None), declare_contract(with_small, None)
    assert a == b and a.fingerprint == b.fingerprint
    assert a.describe() == "x float32[1, 3, 32, 64] -> prob float32[1, 1, 16, 32]"
    assert [(c.name, c.value_range) for c in a.outputs] == [("prob", (0.0, 1.0))]


def test_a_fallback_of_another_shape_or_other_names_is_refused_in_one_line(tmp_path: Path) -> None:
    primary = make_model(tmp_path / "primary.onnx")
    contract = declare_contract(load_config(write_node_config(tmp_path / "a.toml", primary, dock="none")), None)
    small = make_model(tmp_path / "small.onnx", stride=4)
    named = make_model(tmp_path / "named.onnx", out_name="score")
    shapes = {"x": (1, 3, 32, 64)}
    assert fallback_refusal(contract, FallbackModel(small, input_shapes=shapes), small) == (
        f"fallback model {small} refused: output 'prob' has shape [1, 1, 8, 16], the contract's is [1, 1, 16, 32] "
        f"(the contract is declared by the primary model {primary}: x float32[1, 3, 32, 64] -> prob "
        "float32[1, 1, 16, 32])")
    assert fallback_refusal(contract, FallbackModel(named, input_shapes=shapes), named) == (
        f"fallback model {named} refused: outputs ['score'] != the contract's ['prob'] (the contract is declared "
        f"by the primary model {primary}: x float32[1, 3, 32, 64] -> prob float32[1, 1, 16, 32])")
    assert fallback_refusal(contract, FallbackModel(primary, input_shapes=shapes), primary) is None


@pytest.mark.parametrize("kind", ["shape", "names"])
def test_the_node_refuses_to_start_with_a_mismatched_fallback(tmp_path: Path, kind: str) -> None:
    primary = make_model(tmp_path / "primary.onnx")
    fallback = (make_model(tmp_path / "small.onnx", stride=4) if kind == "shape"
                else make_model(tmp_path / "named.onnx", out_name="score"))
    rc, log = exit_of(write_node_config(tmp_path / "node.toml", primary, dock="none", fallback_model=fallback),
                      tmp_path / "node.log")
    assert rc == EXIT_NO_FALLBACK == 3, log
    refused = [x for x in log.splitlines() if " ERROR " in x and "refused" in x]
    assert len(refused) == 1, log
    want = ("output 'prob' has shape [1, 1, 8, 16], the contract's is [1, 1, 16, 32]" if kind == "shape"
            else "outputs ['score'] != the contract's ['prob']")
    assert f" ERROR chestnut.node: fallback model {fallback} refused: {want} (the contract" in refused[0]
    assert "Traceback" not in log


def test_the_primary_is_never_rejected_because_of_the_fallback(tmp_path: Path) -> None:
    primary = make_model(tmp_path / "primary.onnx")
    small = make_model(tmp_path / "small.onnx", stride=4)
    cfg = write_node_config(tmp_path / "node.toml", primary, dock="cpu", fallback_model=small,
                            fallback_extra={"required": False})
    prefix = os.environ["CHESTNUT_PREFIX"]
    bus = Bus(prefix, record_tensors=True)
    bus.start()
    node = NodeProcess(cfg, prefix, tmp_path / "node.log").start()
    try:
        rec = bus.wait_for(lambda r: r if sum(o.source == "primary" for o in r.outputs) >= 20 else None, 90.0,
                           "20 primary outputs")
        log = node.log_tail()
    finally:
        bus.close()
        node.kill()
    primary_outs = [o for o in rec.outputs if o.source == "primary"]
    assert all(o.valid and o.reason == "" for o in primary_outs), log
    assert all(o.tensors is not None and o.tensors["prob"].shape == (1, 1, 16, 32) for o in primary_outs)
    assert not any("declared" in o.reason or "contract" in o.reason for o in rec.outputs), log
    # before the primary served, no model answered: each such frame is not valid and says why
    assert all(not o.valid for o in rec.outputs if o.source != "primary")
    assert "running without a fallback (fallback.required = false)" in log


def test_a_range_for_an_output_the_primary_does_not_have_is_refused(tmp_path: Path) -> None:
    primary = make_model(tmp_path / "primary.onnx")
    cfg = write_node_config(tmp_path / "node.toml", primary, dock="none", ranges={"text_prob": (0.0, 1.0)})
    with pytest.raises(ConfigError) as e:
        declare_contract(load_config(cfg), None)
    assert e.value.detail == (f"model.ranges.text_prob: the primary model {primary} has no output 'text_prob' "
                              "(its outputs: prob)")
    rc, log = exit_of(cfg, tmp_path / "node.log")
    assert rc == EXIT_CONFIG == 2, log
    assert "unusable configuration: config: model.ranges.text_prob: the primary model" in log


def test_a_model_that_fails_its_known_answer_is_refused_for_both_roles(tmp_path: Path) -> None:
    good = make_model(tmp_path / "good.onnx")
    fp = record_fingerprint(good, tmp_path / "good.fingerprint.json")
    damaged = make_model(tmp_path / "damaged.onnx", bias=40.0)  # in range (prob ~ 1 everywhere), wrong numbers
    cfg = write_node_config(tmp_path / "node.toml", damaged, dock="none", fingerprint=fp)
    with pytest.raises(ContractError) as e:
        declare_contract(load_config(cfg), __import__("json").loads(fp.read_text()))
    assert e.value.detail.startswith(f"the model file {damaged} does not match its recorded fingerprint on the host "
                                     "CPU: prob: ")
    assert e.value.detail.endswith("refused as primary and as fallback")
    rc, log = exit_of(cfg, tmp_path / "node.log")
    assert rc == EXIT_NO_FALLBACK, log
    assert "no output contract: the model file" in log and "fallback model" not in log
    # a separate fallback file that fails the fingerprint recorded beside it is refused too
    contract = declare_contract(load_config(write_node_config(tmp_path / "g.toml", good, dock="none")), None)
    (tmp_path / "damaged.fingerprint.json").write_text(fp.read_text())
    fb = FallbackModel(damaged, input_shapes={"x": (1, 3, 32, 64)})
    line = fallback_refusal(contract, fb, damaged)
    assert line is not None and line.startswith(f"fallback model {damaged} refused: it does not match its recorded")


def test_launch_with_a_fallback_of_another_shape_exits_before_the_stack_starts(tmp_path: Path) -> None:
    import subprocess
    import sys

    primary = make_model(tmp_path / "primary.onnx")
    small = make_model(tmp_path / "small.onnx", stride=4)
    cfg = write_node_config(tmp_path / "node.toml", primary, fallback_model=small)
    r = subprocess.run([str(Path(sys.executable).with_name("chestnut")), "launch", "--seconds", "3", "--no-live",
                        "--runs-dir", str(tmp_path / "runs"), "--node-config", str(cfg)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].endswith(
        f" ERROR chestnut.launch: --node-config: fallback model {small} refused: output 'prob' has shape "
        f"[1, 1, 8, 16], the contract's is [1, 1, 16, 32] (the contract is declared by the primary model {primary}: "
        "x float32[1, 3, 32, 64] -> prob float32[1, 1, 16, 32])"), lines[0]
    assert not (tmp_path / "runs").exists()


def test_a_persistent_hot_standby_disagreement_is_shown(tmp_path: Path) -> None:
    primary = make_model(tmp_path / "primary.onnx")
    other = make_model(tmp_path / "other.onnx", bias=2.0)  # of the contract, but other numbers
    cfg = write_node_config(tmp_path / "node.toml", primary, dock="cpu", fallback_model=other)
    prefix = os.environ["CHESTNUT_PREFIX"]
    bus = Bus(prefix)
    bus.start()
    node = NodeProcess(cfg, prefix, tmp_path / "node.log").start()
    try:
        bus.wait_for(lambda r: any(o.agreement_checked for o in r.outputs), 90.0, "a compared frame")
        bus.wait_for(lambda r: "disagrees with the fallback" in node.log_tail(), 60.0, "the disagreement's line")
        log = node.log_tail()
    finally:
        bus.close()
        node.kill()
    line = next(x for x in log.splitlines() if "disagrees with the fallback" in x)
    assert " WARNING chestnut.node: hot standby: the primary disagrees with the fallback for 3 frames in a row " \
           "(prob: 512 value(s) differ from the fallback beyond tol 0.001 " in line, line
    assert "both pass their own checks" in line and "(3 disagreeing frames so far)" in line


def test_the_shipped_configs_ranges_are_defaults_and_a_written_one_is_enforced(tmp_path: Path) -> None:
    from chestnut.node.config import DEFAULT_CONFIG

    primary = make_model(tmp_path / "primary.onnx")
    shipped = load_config(DEFAULT_CONFIG)
    assert shipped.model.ranges == {"text_prob": (0.0, 1.0)} and not shipped.model.ranges_given
    shipped.model.path = primary  # chestnut run --model primary.onnx: the PP-OCRv4 range does not apply to it
    with pytest.raises(ContractError, match=r"cannot be run at model.shape \[1, 3, 128, 256\]: InvalidArgument: "):
        declare_contract(shipped, None)  # one line for a shape the graph does not take, not onnxruntime's traceback
    shipped.model.shape = (1, 3, 32, 64)
    assert [(c.name, c.value_range) for c in declare_contract(shipped, None).outputs] == [("prob", None)]
    written = load_config(write_node_config(tmp_path / "node.toml", primary, dock="none"))
    assert written.model.ranges_given and "ranges_given" not in written.to_json()["model"]


def test_a_missing_primary_file_is_named_as_missing_not_as_unrunnable(tmp_path: Path) -> None:
    from chestnut.node.config import DEFAULT_CONFIG

    cfg = load_config(DEFAULT_CONFIG)
    cfg.model.path = tmp_path / "absent.onnx"
    with pytest.raises(ContractError) as info:
        declare_contract(cfg, None)
    assert info.value.detail == (f"the primary model declares the output contract, and its model file "
                                 f"{tmp_path / 'absent.onnx'} does not exist")
