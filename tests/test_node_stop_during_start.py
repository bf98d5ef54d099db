"""A SIGINT/SIGTERM during ``chestnut run``'s start-up is a stop: exit code ``EXIT_OK`` (0, as after start-up,
``node/main.py`` ``run``), ``signal N: stopping`` and ``stopped during start-up`` at INFO, no ERROR and no advice to
prepare the model again. The node runs in this process; the signal is raised where a stand-in finds it:

- while the contract's model file is loaded (``node/contract.py`` ``declare_contract``, whose ``except Exception``
  must not take the stop for a model that cannot be run);
- while the configuration is read, before the node exists (the handlers are in place from ``run``'s start);
- inside an import (an extension module's init turned the stop into "ImportError: initialization failed", read as
  a model that cannot be run, exit 3, in ~2 % of stops that reached the handler): the stop waits for the import to
  end (``node/main.py`` ``_stop_deferred``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nodeharness import write_node_config

import chestnut.backend.model as backend_model
from chestnut.node import config as node_config
from chestnut.node import main as node_main

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture(autouse=True)
def _restore_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def args_for(cfg: Path) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    node_main.add_arguments(p)
    return p.parse_args(["--config", str(cfg), "--rt-policy", "other"])


def node_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "chestnut.node"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_contract_model_loads_is_a_stop(
        tmp_path: Path, tiny_onnx: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        sig: int) -> None:
    caplog.set_level(logging.INFO, logger="chestnut.node")
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none")
    real = backend_model.OrtModel
    loads: list[Path] = []

    def signalled_load(path: Path, *a: Any, **kw: Any) -> Any:
        loads.append(Path(path))
        signal.raise_signal(sig)  # the handler runs here, inside declare_contract's try
        return real(path, *a, **kw)

    monkeypatch.setattr(backend_model, "OrtModel", signalled_load)
    assert node_main.run(args_for(cfg)) == node_main.EXIT_OK == 0
    assert loads == [tiny_onnx]
    assert node_lines(caplog) == [
        ("INFO", "node scheduling: no realtime policy asked for ([realtime] policy = other)"),
        ("INFO", f"signal {sig}: stopping"),
        ("INFO", "stopped during start-up"),
        ("INFO", "starting -> stopping on stop: stop: stop requested"),
    ]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_signal_while_the_configuration_is_read_is_a_stop(
        tmp_path: Path, tiny_onnx: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, logger="chestnut.node")
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none")
    real = node_config.from_args

    def signalled_read(args: argparse.Namespace) -> Any:
        signal.raise_signal(signal.SIGTERM)
        return real(args)

    monkeypatch.setattr(node_config, "from_args", signalled_read)
    assert node_main.run(args_for(cfg)) == node_main.EXIT_OK == 0
    assert node_lines(caplog) == [("INFO", "signal 15: stopping"), ("INFO", "stopped during start-up")]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("where", ["contract", "config"])
def test_a_signal_inside_an_import_is_a_stop_once_the_import_has_ended(
        tmp_path: Path, tiny_onnx: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        where: str) -> None:
    caplog.set_level(logging.INFO, logger="chestnut.node")
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none")
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / f"signalling_{where}.py").write_text(  # the handler runs inside this module's import
        "import signal\nsignal.raise_signal(signal.SIGTERM)\nfor _ in range(50000):\n    pass\nDONE = True\n")
    monkeypatch.syspath_prepend(str(mods))
    done: list[bool] = []
    target, name = (backend_model, "OrtModel") if where == "contract" else (node_config, "from_args")
    real = getattr(target, name)

    def importing(*a: Any, **kw: Any) -> Any:
        done.append(importlib.import_module(f"signalling_{where}").DONE)
        return real(*a, **kw)

    monkeypatch.setattr(target, name, importing)
    assert node_main.run(args_for(cfg)) == node_main.EXIT_OK == 0
    assert done == [True]  # the import ran to its end, the stop came after it
    lines = node_lines(caplog)
    assert ("INFO", "stopped during start-up") in lines and lines.count(("INFO", "signal 15: stopping")) == 1, lines
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
