"""A ``[model] input`` the primary model has no input of is refused at start, in one line naming the inputs it
has (``backend/model.py`` ``_graph_inputs``'s ``unknown_input``, ``node/contract.py`` ``declare_contract``): by
``chestnut run`` (``EXIT_CONFIG``, 2) and by ``chestnut launch --node-config`` before anything starts (exit 2).
It used to be accepted, its ``shape`` dropped, and every frame then failed twice at ERROR (40 lines a second).
A wrong ``shape`` given with it is refused for the name, not dropped."""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from nodeharness import write_node_config

from chestnut.backend.errors import ConfigError
from chestnut.node import main as node_main
from chestnut.node.config import load_config
from chestnut.node.contract import declare_contract, start_problem

pytestmark = [pytest.mark.timeout(120)]


def config_with_input(tmp_path: Path, tiny_onnx: Path, name: str, shape: tuple[int, ...] = (1, 3, 32, 64)) -> Path:
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none", shape=shape)
    cfg.write_text(cfg.read_text().replace('input = "x"', f"input = {name!r}".replace("'", '"')))
    return cfg


def refusal(model: Path, name: str) -> str:
    return f"model.input = {name!r}: model file {model} has no input {name!r} (its inputs: 'x'); name one of its inputs"


@pytest.fixture
def _restore_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.mark.parametrize("shape", [(1, 3, 32, 64), (1, 3, 64, 128)], ids=["its_shape", "another_shape"])
def test_the_contract_refuses_an_input_name_the_model_has_not(tmp_path: Path, tiny_onnx: Path,
                                                             shape: tuple[int, ...]) -> None:
    cfg = load_config(config_with_input(tmp_path, tiny_onnx, "y", shape))
    with pytest.raises(ConfigError) as e:
        declare_contract(cfg, None)
    assert e.value.reason == "config"
    assert e.value.detail == refusal(tiny_onnx, "y")
    assert start_problem(cfg) == refusal(tiny_onnx, "y")
    ok = load_config(config_with_input(tmp_path, tiny_onnx, "x"))
    assert start_problem(ok) is None


@pytest.mark.usefixtures("_restore_handlers")
def test_run_exits_EXIT_CONFIG_in_one_line(tmp_path: Path, tiny_onnx: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="chestnut.node")
    p = argparse.ArgumentParser()
    node_main.add_arguments(p)
    args = p.parse_args(["--config", str(config_with_input(tmp_path, tiny_onnx, "y")), "--rt-policy", "other"])
    assert node_main.run(args) == node_main.EXIT_CONFIG == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert errors == [f"unusable configuration: config: {refusal(tiny_onnx, 'y')}"]


def test_launch_refuses_it_before_anything_starts(tmp_path: Path, tiny_onnx: Path) -> None:
    cfg = config_with_input(tmp_path, tiny_onnx, "y", (1, 3, 64, 128))
    r = subprocess.run([str(Path(sys.executable).with_name("chestnut")), "launch", "--seconds", "3", "--no-live",
                        "--runs-dir", str(tmp_path / "runs"), "--node-config", str(cfg)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    (line,) = r.stderr.splitlines()
    assert line.endswith(f" ERROR chestnut.launch: --node-config: {refusal(tiny_onnx, 'y')}"), line
    assert not (tmp_path / "runs").exists()
