"""``chestnut run`` with a damaged model file: exit ``EXIT_NO_FALLBACK`` (3) with one line that names the file,
the parser's complaint and the fix (``chestnut model prepare``)."""

from __future__ import annotations

import os
from pathlib import Path

from nodeharness import NodeProcess, write_node_config

from chestnut.node.main import EXIT_NO_FALLBACK


def test_a_damaged_model_exits_naming_chestnut_model_prepare(tmp_path: Path, tiny_onnx: Path) -> None:
    damaged = tmp_path / "damaged.onnx"
    damaged.write_bytes(tiny_onnx.read_bytes()[:100])  # a truncated copy, as a full disk or a killed download leaves
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none", fallback_model=damaged)
    node = NodeProcess(cfg, os.environ["CHESTNUT_PREFIX"], tmp_path / "node.log").start()
    try:
        assert node.proc is not None
        rc = node.proc.wait(30)
    finally:
        node.kill()
    log = node.log_tail()
    assert rc == EXIT_NO_FALLBACK == 3, log
    line = next(x for x in log.splitlines() if "no usable fallback model" in x)
    assert line.endswith(
        "; prepare it again with `chestnut model prepare` (it checks the file's sha256 and rebuilds a damaged one), "
        "or name another file in the config's [model] / [fallback]"
    ), line
    assert f"no usable fallback model ({damaged}, onnxruntime): " in line
    assert "Traceback" not in log
