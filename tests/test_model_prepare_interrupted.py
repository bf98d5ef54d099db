"""An interrupted ``chestnut model prepare`` leaves nothing half-made at its ``--out``: a Ctrl-C 10 s into
``model prepare --shape 1,3,64,128 --out m/s64.onnx`` (exit 130) left ``s64.onnx`` without its ``.json`` or
``.fingerprint.json``, and a node pointed at it ran it unchecked ("unchecked: no fingerprint recorded"). The model
was written before it was compiled and checked. Now nothing is written until every check passed; then the model
and its side files go to 0600 temporaries beside ``--out`` and are renamed into place together, the model last
(``launch/assets.py`` ``prepare_model``, ``msgs/outdir.py`` ``write_private_files``); a failure or an
interruption removes the temporaries."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tinymodel import make_tiny_onnx

from chestnut.launch.assets import prepare_model
from chestnut.msgs.outdir import OutputDirError, write_private_files

SHAPE = (1, 3, 32, 64)


def _interrupt(*_args: object, **_kwargs: object) -> None:
    raise KeyboardInterrupt


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CHESTNUT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m").mkdir(0o700)
    return tmp_path / "m"


def test_a_ctrl_c_while_the_model_is_checked_leaves_nothing_at_out(
        models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupted after the compile, while its fingerprint is recorded: the old code had written ``s64.onnx``."""
    monkeypatch.setattr("chestnut.backend.fingerprint.record_fingerprint", _interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare_model(make_tiny_onnx(tmp_path / "tiny.onnx"), models / "s64.onnx", SHAPE, None)
    assert _files(models) == {}


def test_a_ctrl_c_while_the_files_are_written_removes_the_temporaries(
        models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupted with every temporary written and none renamed yet: none of them is left."""
    monkeypatch.setattr("chestnut.msgs.outdir.os.replace", _interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare_model(make_tiny_onnx(tmp_path / "tiny.onnx"), models / "s64.onnx", SHAPE, None)
    assert _files(models) == {}


def test_an_interrupted_prepare_again_keeps_the_complete_prepared_model(
        models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model prepared again (``--force``, another source) over a prepared one, interrupted: the model, metadata
    and fingerprint stay as they were, a set that belongs together."""
    prepare_model(make_tiny_onnx(tmp_path / "tiny.onnx"), models / "s64.onnx", SHAPE, None)
    before = _files(models)
    assert sorted(before) == ["s64.fingerprint.json", "s64.json", "s64.onnx"]
    monkeypatch.setattr("chestnut.backend.fingerprint.record_fingerprint", _interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare_model(make_tiny_onnx(tmp_path / "other.onnx", seed=1), models / "s64.onnx", SHAPE, None)
    assert _files(models) == before


def test_files_written_together_are_renamed_in_order_only_once_all_are_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "f"
    assert write_private_files([(folder / "a.json", "{}"), (folder / "b.onnx", b"\x01")]) == [
        folder / "a.json", folder / "b.onnx"]
    assert _files(folder) == {"a.json": b"{}", "b.onnx": b"\x01"}
    assert {os.stat(p).st_mode & 0o777 for p in folder.iterdir()} == {0o600}
    # a write that fails (the second file's data is no bytes): the first temporary is removed, nothing replaced
    with pytest.raises(TypeError):
        write_private_files([(folder / "a.json", "[]"), (folder / "b.onnx", 3)])  # type: ignore[list-item]
    assert _files(folder) == {"a.json": b"{}", "b.onnx": b"\x01"}
    (folder / "c.onnx").symlink_to(folder / "b.onnx")  # a target that is a symlink: refused before anything
    with pytest.raises(OutputDirError) as e:
        write_private_files([(folder / "a.json", "[]"), (folder / "c.onnx", b"\x02")])
    link = folder / "c.onnx"
    assert str(e.value) == f"{link} is a symlink; remove it (rm {link}) or give another directory"
    assert _files(folder) == {"a.json": b"{}", "b.onnx": b"\x01", "c.onnx": b"\x01"}
    with pytest.raises(ValueError, match="not all in one folder"):
        write_private_files([(folder / "a.json", "[]"), (tmp_path / "d.json", "[]")])
