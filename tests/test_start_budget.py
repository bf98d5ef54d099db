"""The node's start-up budget is one number with the ladder's step bounds and the compile cache's state."""

from __future__ import annotations

import hashlib
import json
from importlib.metadata import version
from pathlib import Path

import pytest

from chestnut.backend.errors import ConfigError
from chestnut.backend.ladder import LadderConfig
from chestnut.node.config import NodeConfig, ladder_bounds_s, load_config, start_budget_s, validate

# backend/ladder.py with LadderConfig's defaults: usb_ids 2 + 4 x 0.1, link_speed 1, link_stability
# 0.5 + 2 x 0.1 + 1, ltssm PCIE_POWER_TIMEOUT_MS 10 s + training 1 s + 4 x 0.1, gpu_arch 30, load 120, warm-up 60
COLD = {
    "usb_ids": 2.4,
    "link_speed": 1.0,
    "link_stability": 1.7,
    "ltssm": 11.4,
    "gpu_arch": 30.0,
    "model_loaded": 120.0,
    "warmup": 60.0,
}


def test_the_budget_is_the_sum_of_the_rungs_bounds_cold_and_warm() -> None:
    assert {k: round(v, 3) for k, v in ladder_bounds_s(LadderConfig(), warm=False).items()} == COLD
    assert start_budget_s(LadderConfig(), warm=False) == 231.5  # 226.5 + 5 s start margin
    assert ladder_bounds_s(LadderConfig(), warm=True)["model_loaded"] == 15.0
    assert start_budget_s(LadderConfig(), warm=True) == 126.5


def test_unset_budget_is_derived_and_never_below_a_bound() -> None:
    cfg = load_config(None)
    assert cfg.timing.start_timeout_s == 231.5
    assert cfg.timing.start_timeout_s > max(COLD.values())


def _real(tmp_path: Path, start_timeout_s: float) -> NodeConfig:
    model = tmp_path / "m.onnx"
    model.write_bytes(b"not really onnx, only hashed")
    cfg = NodeConfig()
    cfg.dock.kind = "real"
    cfg.model.path = model
    cfg.timing.start_timeout_s = start_timeout_s
    return cfg


def test_a_real_dock_refuses_a_budget_shorter_than_the_ladder_with_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CHESTNUT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as e:
        validate(_real(tmp_path, 60.0))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(
        "config: timing.start_timeout_s = 60 s is shorter than the ladder's bounds with a cold "
        "compile cache (231.5 s: usb_ids 2.4, link_speed 1, link_stability 1.7, ltssm 11.4, "
        "gpu_arch 30, model_loaded 120, warmup 60, + 5 s start): set it to at least 231.5"
    )
    assert "`chestnut model prepare --for-dock`) needs 126.5 s" in msg
    assert validate(_real(tmp_path, 231.5)).timing.start_timeout_s == 231.5


def test_a_warm_compile_cache_for_the_dock_shortens_the_derived_budget(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CHESTNUT_CACHE", str(tmp_path / "cache"))
    cfg = _real(tmp_path, 0.0)
    jit = tmp_path / "cache" / "jit"
    jit.mkdir(parents=True)
    key = {
        "model_sha256": hashlib.sha256(cfg.model.path.read_bytes()).hexdigest(),
        "device": "AMD:gfx1100",
        "tinygrad_version": version("tinygrad"),
    }
    (jit / "0123.json").write_text(json.dumps({"key": {**key, "tinygrad_version": "0.13.0"}}))
    assert validate(_real(tmp_path, 0.0)).timing.start_timeout_s == 231.5  # another tinygrad: cold
    (jit / "4567.json").write_text(json.dumps({"key": key}))
    assert validate(cfg).timing.start_timeout_s == 126.5
    assert validate(_real(tmp_path, 126.5)).timing.start_timeout_s == 126.5


def test_the_twin_keeps_a_short_set_budget() -> None:
    cfg = NodeConfig()
    cfg.timing.start_timeout_s = 20.0
    assert validate(cfg).timing.start_timeout_s == 20.0
