"""A per-frame failure that repeats its cause every frame is one ERROR line, then counted (``node/main.py``
``Node._run_fallback`` and ``Node._submit_failed``, ``LogEvery``: once a ``BAD_FRAME_LOG_PERIOD_S`` for the same
cause, at once for another): a fallback run that raises, a frame the primary worker would not take. They were an
ERROR line each, every frame (40 a second at 20 Hz with two of them). The serving primary's output rejected by its
checks (``Node._primary_rejected``) is a WARNING the same way: it had no line at all. The node runs in this process
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
from chestnut.node.policy import Answer
from chestnut.node.supervisor import Source
from chestnut.node.validity import Check, CheckResult, ValidityReport

pytestmark = [pytest.mark.timeout(60)]


class RaisingFallback:
    """A fallback whose every run raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise self.error


def node_errors(caplog: pytest.LogCaptureFixture, level: int = logging.ERROR) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "chestnut.node" and r.levelno >= level]


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


def test_a_burst_of_rejected_primary_outputs_is_one_warning_line(
        tmp_path: Path, tiny_onnx: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A launch with ``--fault zero_output@20``: frame 419's primary output disagreed with the fallback, the fallback
    answered it and ChestnutActive dropped, with no node.log line. Now one WARNING at once, then counted (the
    values in the reason change every frame; the cause is the failing checks), and at once for another cause."""
    caplog.set_level(logging.INFO, logger="chestnut.node")
    node = make_node(tmp_path, tiny_onnx)

    def differ(n: int) -> ValidityReport:
        return ValidityReport((CheckResult(Check.FINITE, "prob", True, "ok"), CheckResult(
            Check.AGREEMENT, "prob", False, f"prob: {n} value(s) differ from the fallback", 1.0)))

    fallback = Answer(Source.FALLBACK, {}, 0.008, True, "primary output invalid: ...")
    for frame in range(419, 439):
        node._primary_rejected(frame, differ(frame), fallback)
    nan = ValidityReport((CheckResult(Check.FINITE, "prob", False, "prob: 512 non-finite value(s)"),))
    node._primary_rejected(439, nan, Answer(Source.FALLBACK, None, 0.008, False, "fallback output invalid: ..."))
    assert node.primary_invalid == 21
    assert node_errors(caplog, logging.WARNING) == [
        "primary output invalid on frame 419: prob: 419 value(s) differ from the fallback; the fallback answered it "
        "(1 such frames so far)",
        "primary output invalid on frame 439: prob: 512 non-finite value(s); no source gave a valid output for it "
        "(21 such frames so far)",
    ]
