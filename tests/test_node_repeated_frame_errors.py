"""A per-frame failure that repeats its cause every frame is one ERROR line, then counted (``node/main.py``
``Node._run_fallback`` and ``Node._submit_failed``, ``LogEvery``: once a ``BAD_FRAME_LOG_PERIOD_S`` for the same
cause, at once for another): a fallback run that raises, a frame the primary worker would not take. They were an
ERROR line each, every frame (40 a second at 20 Hz with two of them). The node runs in this process
(``dock.kind = "none"``), the fallback a stand-in that raises."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from nodeharness import write_node_config

from chestnut.backend.errors import ModelError, UsbLayerError
from chestnut.node.config import load_config
from chestnut.node.main import Node

pytestmark = [pytest.mark.timeout(60)]


class RaisingFallback:
    """A fallback whose every run raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise self.error


def node_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "chestnut.node" and r.levelno >= logging.ERROR]


def make_node(tmp_path: Path, tiny_onnx: Path) -> Node:
    return Node(load_config(write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none")))


def test_a_fallback_failing_every_frame_for_one_cause_is_one_error_line(
        tmp_path: Path, tiny_onnx: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="chestnut.node")
    node = make_node(tmp_path, tiny_onnx)
    inputs = {"x": np.zeros((1, 3, 32, 64), np.float32)}
    bad = ModelError("bad_input", "inputs ['y'] != model inputs ['x']")
    node.fallback = RaisingFallback(bad)  # type: ignore[assignment]
    whys = [node._run_fallback(inputs).error for _ in range(40)]
    assert set(whys) == {"fallback failed: ModelError: bad_input: inputs ['y'] != model inputs ['x']"}
    assert node.fallback_failures == 40
    node.fallback = RaisingFallback(ModelError("bad_output", "no output 'prob'"))  # type: ignore[assignment]
    node._run_fallback(inputs)
    node._run_fallback(inputs)
    assert node_errors(caplog) == [
        "fallback run failed: ModelError: bad_input: inputs ['y'] != model inputs ['x'] (1 such frames so far)",
        "fallback run failed: ModelError: bad_output: no output 'prob' (41 such frames so far)",
    ]


def test_a_submit_failing_every_frame_for_one_cause_is_one_error_line(
        tmp_path: Path, tiny_onnx: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="chestnut.node")
    node = make_node(tmp_path, tiny_onnx)
    bad = ModelError("bad_input", "inputs ['y'] != model inputs ['x']")
    whys = [node._submit_failed(seq, bad) for seq in range(1, 41)]
    assert set(whys) == {"submit to the primary failed: bad_input: inputs ['y'] != model inputs ['x']"}
    assert node._submit_failed(41, UsbLayerError("disconnect", "the dock went away")) == (
        "submit to the primary failed: disconnect: the dock went away")
    assert node.submit_failures == 41
    assert node_errors(caplog) == [
        "submit of frame 1 failed: bad_input: inputs ['y'] != model inputs ['x'] (1 such frames so far)",
        "submit of frame 41 failed: disconnect: the dock went away (41 such frames so far)",
    ]
