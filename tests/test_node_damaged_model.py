"""``chestnut run`` with a damaged model file: exit ``EXIT_NO_FALLBACK`` (3) with one line that names the file,
the parser's complaint and the fix (for a file of the user's: another file or an intact copy; ``chestnut model
prepare`` rebuilds only the prepared default model, ``node/main.py`` ``model_fix``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from nodeharness import exit_of, write_node_config

from chestnut.node.main import EXIT_CONFIG, EXIT_NO_FALLBACK


def test_a_damaged_model_exits_naming_the_file_and_the_fix(tmp_path: Path, tiny_onnx: Path) -> None:
    damaged = tmp_path / "damaged.onnx"
    damaged.write_bytes(tiny_onnx.read_bytes()[:100])  # a truncated copy, as a full disk or a killed download leaves
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none", fallback_model=damaged)
    rc, log = exit_of(cfg, tmp_path / "node.log", 30)
    assert rc == EXIT_NO_FALLBACK == 3, log
    line = next(x for x in log.splitlines() if "no usable fallback model" in x)
    assert line.endswith(
        f"no usable fallback model ({damaged}, onnxruntime): ModelError: bad_model: fallback model file {damaged} is "
        "not a readable ONNX model: Error parsing message with type 'onnx.ModelProto': Wire format was corrupt; "
        "name another file (--model / --fallback-model, or the config's [model] / [fallback] path), or replace "
        "this one"
    ), line
    assert "Traceback" not in log


def test_a_model_path_with_no_file_name_has_a_fingerprint_path() -> None:
    """``model.path`` ``/`` or ``.`` (a folder): ``Path.with_suffix`` raised ``ValueError`` ("has an empty name"),
    a traceback of ``chestnut run --model /``."""
    from chestnut.node.config import NodeConfig

    cfg = NodeConfig()
    got = []
    for path in ("/", ".", "models/det.onnx"):
        cfg.model.path = Path(path)
        got.append(str(cfg.fingerprint_path))
    assert got == ["/.fingerprint.json", "..fingerprint.json", "models/det.fingerprint.json"]


def test_a_model_path_with_no_file_name_is_a_folder_not_a_traceback(tmp_path: Path) -> None:
    """``chestnut run`` with ``model.path = "/"`` exits as for any folder: one ERROR line, exit 3 (the primary's
    file is the fallback's too)."""
    cfg = write_node_config(tmp_path / "node.toml", Path("/"), dock="none")
    rc, log = exit_of(cfg, tmp_path / "node.log", 30)
    assert rc == EXIT_NO_FALLBACK == 3, log
    errors = [x.split(" ERROR chestnut.node: ", 1)[-1] for x in log.splitlines() if " ERROR " in x]
    assert errors == [
        "no output contract: the primary model declares the output contract, and its model file / is a folder: give "
        "the .onnx file in it; name another file (--model / --fallback-model, or the config's [model] / [fallback] "
        "path), or replace this one"], log
    assert "Traceback" not in log


@pytest.mark.parametrize("primary", ["missing", "damaged"])
def test_an_unusable_primary_beside_a_usable_fallback_file_is_a_configuration_error(tmp_path: Path, tiny_onnx: Path,
                                                                                    primary: str) -> None:
    """Exit 3 says "no usable fallback"; with a fallback of its own file that is not so: the configuration names
    a primary the node cannot use, exit ``EXIT_CONFIG`` (2), one ERROR line naming the file."""
    model = tmp_path / f"{primary}.onnx"
    if primary == "damaged":
        model.write_bytes(tiny_onnx.read_bytes()[:100])
    cfg = write_node_config(tmp_path / "node.toml", model, dock="none", fallback_model=tiny_onnx)
    rc, log = exit_of(cfg, tmp_path / "node.log", 30)
    assert rc == EXIT_CONFIG == 2, log
    errors = [x for x in log.splitlines() if " ERROR " in x]
    assert len(errors) == 1 and "no output contract: " in errors[0] and str(model) in errors[0], errors
    assert "Traceback" not in log


def test_a_model_another_user_could_change_is_refused_in_one_line(tmp_path, tiny_onnx):
    """A model decides what the node publishes: a file or folder writable by group or other is refused (a
    sticky folder like /tmp protects its files); a folder is no model file."""
    import os
    import shutil

    from chestnut.backend.errors import ModelError
    from chestnut.backend.model import read_model_file

    folder = tmp_path / "models"
    folder.mkdir(mode=0o755)
    model = folder / "tiny.onnx"
    shutil.copy(tiny_onnx, model)
    model.chmod(0o644)
    assert read_model_file(model) == tiny_onnx.read_bytes()
    model.chmod(0o666)
    with pytest.raises(ModelError, match=r"^untrusted_model: model file .*tiny.onnx is writable by group or other "
                                         r"\(mode 0666\): another user could change what the node computes "
                                         r"\(chmod go-w .*tiny.onnx\)$"):
        read_model_file(model)
    model.chmod(0o644)
    folder.chmod(0o777)
    with pytest.raises(ModelError, match=r"^untrusted_model: fallback model folder .*models is writable"):
        read_model_file(model, "fallback model")
    folder.chmod(0o1777)  # sticky: like /tmp
    assert read_model_file(model) == tiny_onnx.read_bytes()
    folder.chmod(0o755)
    with pytest.raises(ModelError, match=r"^missing_model: model file .*models is a folder: give the .onnx file"):
        read_model_file(folder)
    assert os.getuid() == model.stat().st_uid


@pytest.mark.parametrize("where", ["the symlink's folder", "a folder above it", "the folder of a linked folder"])
def test_a_model_reached_through_a_folder_others_may_write_is_refused_in_one_line(tmp_path, tiny_onnx, where):
    """A model reached through a symlink in a 0777 folder (not sticky) was accepted: only the target's folder was
    checked, and whoever may write that folder could swap the symlink. Every folder the file is reached through
    (``msgs/paths.py`` ``lookup_folders``) is held to the rule of its own folder; the same path through private
    folders is accepted."""
    import shutil

    from chestnut.backend.errors import ModelError
    from chestnut.backend.model import read_model_file

    base = tmp_path.resolve()
    real = base / "real"
    real.mkdir(mode=0o700)
    shutil.copy(tiny_onnx, real / "tiny.onnx")
    shared = base / "shared"
    holder = shared if where == "the symlink's folder" else shared / "inner"
    holder.mkdir(parents=True)
    shared.chmod(0o777)
    holder.chmod(0o777 if holder == shared else 0o700)
    if where == "the folder of a linked folder":  # shared/inner -> real: the file itself is no symlink
        holder.rmdir()
        holder.symlink_to(real)
    else:
        (holder / "tiny.onnx").symlink_to(real / "tiny.onnx")
    link = holder / "tiny.onnx"
    with pytest.raises(ModelError) as e:
        read_model_file(link)
    assert str(e.value) == (
        f"untrusted_model: model file {link} is reached through {shared}, which is writable by group/other without "
        f"the sticky bit (mode 0777): another user could change what the node computes (chmod go-w {shared}, or "
        "give a path that does not pass through it)")
    shared.chmod(0o700)
    assert read_model_file(link) == tiny_onnx.read_bytes()  # a symlink in a private folder
    shared.chmod(0o1777)  # sticky, like /tmp: others cannot replace our symlink in it
    assert read_model_file(link) == tiny_onnx.read_bytes()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user takes root")
def test_a_model_reached_through_another_users_folder_is_refused_in_one_line(tmp_path, tiny_onnx):
    import shutil

    from chestnut.backend.errors import ModelError
    from chestnut.backend.model import read_model_file

    base = tmp_path.resolve()
    (base / "real").mkdir(mode=0o700)
    shutil.copy(tiny_onnx, base / "real" / "tiny.onnx")
    theirs = base / "theirs"
    theirs.mkdir(mode=0o755)
    link = theirs / "tiny.onnx"
    link.symlink_to(base / "real" / "tiny.onnx")
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ModelError) as e:
        read_model_file(link, "fallback model")
    assert str(e.value) == (
        f"untrusted_model: fallback model file {link} is reached through {theirs}, which belongs to uid 65534, not to "
        "root: another user could change what the node computes (give a path that does not pass through it)")
