"""``chestnut model prepare`` says "model ready" only for a prepared file that is what its metadata recorded
(sha256, and it parses as ONNX) whose entry in the compile cache is intact or absent; a damaged file or a
refused entry is prepared again, said in one line."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from chestnut.backend.errors import ModelError
from chestnut.launch import assets

SHAPE = (1, 3, 32, 64)


@pytest.fixture
def prepared(tmp_path: Path, tiny_onnx: Path, monkeypatch) -> tuple[Path, argparse.Namespace, list[Path]]:
    """``tiny.onnx`` as if prepared into ``tmp_path/m/tiny.onnx`` (its metadata and fingerprint beside it), with a
    compile cache of its own (``$CHESTNUT_CACHE``, empty); ``prepare_model`` replaced by one that copies the source
    again and records each call."""
    monkeypatch.setenv("CHESTNUT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "m" / "tiny.onnx"
    out.parent.mkdir()
    shutil.copyfile(tiny_onnx, out)
    sha = hashlib.sha256(out.read_bytes()).hexdigest()
    meta = {"source": str(tiny_onnx), "sha256": sha, "input_shape": list(SHAPE), "max_abs_diff_vs_onnxruntime": 0.0}
    out.with_suffix(".json").write_text(json.dumps(meta))
    fingerprint = {"version": 1, "model_sha256": sha, "seed": 0,
                   "inputs": {"x": {"shape": list(SHAPE), "dtype": "float32"}},
                   "outputs": {"y": {"shape": [1, 1, 32, 64], "mean": 0.25, "std": 0.125}}, "rtol": 0.01, "atol": 0.001}
    out.with_suffix(".fingerprint.json").write_text(json.dumps(fingerprint))
    calls: list[Path] = []

    def prepare_model(src: Path, dst: Path, shape: tuple[int, ...], frame: object, started: Any = None) -> dict:
        started()  # the source passed its checks
        calls.append(dst)
        shutil.copyfile(src, dst)
        return {**meta, "resize_roi_repaired": 0, "first_call_s": 0.5}

    def no_frame(*a: object) -> None:
        raise ModelError("missing_asset", "no frames here")

    monkeypatch.setattr(assets, "prepare_model", prepare_model)
    monkeypatch.setattr(assets, "read_image_bgr", no_frame)
    args = argparse.Namespace(action="prepare", onnx=tiny_onnx, shape="1,3,32,64", out=out, force=False, for_dock=False)
    return out, args, calls


def test_an_intact_prepared_model_is_ready_without_preparing(prepared, capsys):
    out, args, calls = prepared
    assert assets.run(args) == 0
    sha = hashlib.sha256(out.read_bytes()).hexdigest()
    assert capsys.readouterr().out == f"model ready: {out} (sha256 {sha[:16]}, max |tinygrad-onnxruntime| 0.00e+00)\n"
    assert calls == []


def test_a_ready_models_difference_is_rounded_as_when_it_was_prepared(prepared, capsys):
    """The up-to-date line printed the recorded float whole (``4.38690185546875e-05``); the line after
    preparing rounds it (``4.39e-05``)."""
    out, args, calls = prepared
    meta_path = out.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "max_abs_diff_vs_onnxruntime": 4.38690185546875e-05}))
    assert assets.run(args) == 0
    sha = hashlib.sha256(out.read_bytes()).hexdigest()
    assert capsys.readouterr().out == f"model ready: {out} (sha256 {sha[:16]}, max |tinygrad-onnxruntime| 4.39e-05)\n"
    assert calls == []


def test_a_truncated_prepared_model_is_named_and_prepared_again(prepared, capsys):
    out, args, calls = prepared
    good = hashlib.sha256(out.read_bytes()).hexdigest()
    with open(out, "r+b") as f:
        f.truncate(100)
    bad = hashlib.sha256(out.read_bytes()).hexdigest()
    assert assets.run(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"prepared model {out} is damaged (its sha256 is {bad[:16]}, the metadata recorded "
        f"{good[:16]}); preparing it again"
    )
    assert lines[-1].startswith(f"model ready: {out} (sha256 {good[:16]}, ")
    assert calls == [out] and hashlib.sha256(out.read_bytes()).hexdigest() == good


def test_a_prepared_model_that_does_not_parse_is_prepared_again(prepared, capsys):
    out, args, calls = prepared
    out.write_bytes(b"\xff" * 64)  # and the metadata made to agree with it: only the parse can tell
    meta_path = out.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "sha256": hashlib.sha256(out.read_bytes()).hexdigest()}))
    assert assets.run(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"prepared model {out} is damaged (it does not parse as ONNX (DecodeError)); preparing it again"
    assert calls == [out]


def test_damaged_metadata_is_prepared_again(prepared, capsys):
    out, args, calls = prepared
    out.with_suffix(".json").write_text('{"sha256": ')
    assert assets.run(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert (
        first == f"prepared model {out} is damaged (its metadata tiny.json does not read as JSON); preparing it again"
    )
    assert calls == [out]


def test_an_out_that_is_a_folder_is_refused_in_one_line_before_preparing(prepared, capsys, tmp_path):
    """It was a traceback ending ``OutputDirError: ... is not a regular file``."""
    _, args, calls = prepared
    folder = tmp_path / "a-folder"
    folder.mkdir()
    args.out = folder
    assert assets.run(args) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"chestnut model prepare: --out {folder} is a directory, not a regular file; give another path\n")
    assert captured.out == "" and calls == []


@pytest.mark.parametrize("out", ["/", "."])
def test_an_out_with_no_file_name_is_refused_as_a_folder(prepared, capsys, out):
    """``--out /`` and ``--out .`` were a ValueError traceback ("has an empty name", ``Path.with_suffix``)."""
    _, args, calls = prepared
    args.out = Path(out)
    assert assets.run(args) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == (
        "", f"chestnut model prepare: --out {out} is a directory, not a regular file; give another path\n")
    assert calls == []


def test_an_out_whose_folder_does_not_exist_is_refused_and_the_folder_not_made(prepared, capsys, tmp_path):
    """It silently made the missing folder (and its parents)."""
    _, args, calls = prepared
    args.out = tmp_path / "missing" / "deeper" / "x.onnx"
    assert assets.run(args) == 2
    assert capsys.readouterr().err == (
        f"chestnut model prepare: --out {args.out}: folder {args.out.parent} does not exist; create it or give "
        "another path\n"
    )
    assert calls == [] and not (tmp_path / "missing").exists()


def test_an_out_whose_metadata_target_is_a_folder_or_that_is_the_metadata_is_refused(prepared, capsys, tmp_path):
    _, args, calls = prepared
    (tmp_path / "m2").mkdir()
    (tmp_path / "m2" / "x.json").mkdir()
    args.out = tmp_path / "m2" / "x.onnx"
    assert assets.run(args) == 2
    assert capsys.readouterr().err == (
        f"chestnut model prepare: --out {args.out}: {tmp_path / 'm2' / 'x.json'} is a directory, not a "
        "regular file; give another path\n"
    )
    args.out = tmp_path / "m2" / "y.json"
    assert assets.run(args) == 2
    assert capsys.readouterr().err == (
        f"chestnut model prepare: --out {args.out}: the metadata goes to {args.out}; give a path ending in .onnx\n"
    )
    assert calls == []


@pytest.fixture
def default_out(prepared, tmp_path, monkeypatch) -> tuple[Path, argparse.Namespace, list[Path]]:
    """``prepared`` without ``--out``: the prepared model goes to ``<cache>/models/tiny.onnx``, whose
    metadata and fingerprint are there, intact."""
    out, args, calls = prepared
    monkeypatch.setenv("CHESTNUT_CACHE", str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True, mode=0o700)
    for name in ("tiny.json", "tiny.fingerprint.json"):
        shutil.copyfile(out.with_name(name), models / name)
    args.out = None
    return models / "tiny.onnx", args, calls


def test_a_symlink_at_the_default_prepared_path_is_refused_not_followed_and_kept(default_out, capsys, tmp_path):
    """A symlink there to an intact prepared model was followed: "model ready", and the node loaded it."""
    target, args, calls = default_out
    target.symlink_to(tmp_path / "m" / "tiny.onnx")
    assert assets.run(args) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"chestnut model prepare: {target} is a symlink; refused, never followed or replaced: remove it or give "
        "--out PATH\n"
    )
    assert captured.out == "" and calls == []
    assert target.is_symlink() and os.readlink(target) == str(tmp_path / "m" / "tiny.onnx")


def test_a_fifo_at_the_default_prepared_path_is_refused_and_kept(default_out, capsys):
    target, args, calls = default_out
    os.mkfifo(target)
    assert assets.run(args) == 2
    assert capsys.readouterr().err == (
        f"chestnut model prepare: {target} is a FIFO, not a regular file; refused, never followed or replaced: "
        "remove it or give --out PATH\n"
    )
    assert calls == [] and stat.S_ISFIFO(os.lstat(target).st_mode)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user takes root")
@pytest.mark.parametrize("name", ["tiny.onnx", "tiny.json"])
def test_a_file_of_another_user_at_the_default_prepared_path_is_refused_and_kept(name, default_out, capsys, tmp_path):
    target, args, calls = default_out
    shutil.copyfile(tmp_path / "m" / "tiny.onnx", target)
    os.chown(target.with_name(name), 4242, -1)
    assert assets.run(args) == 2
    assert capsys.readouterr().err == (
        f"chestnut model prepare: {target.with_name(name)} is owned by uid 4242, not by uid 0; refused, never "
        "followed or replaced: remove it or give --out PATH\n"
    )
    assert calls == [] and os.lstat(target.with_name(name)).st_uid == 4242


def test_a_symlink_at_a_given_out_is_refused_not_followed_and_kept(prepared, capsys, tmp_path):
    out, args, calls = prepared
    args.out = tmp_path / "m" / "link.onnx"
    args.out.symlink_to(out)
    shutil.copyfile(out.with_suffix(".json"), args.out.with_suffix(".json"))
    shutil.copyfile(out.with_suffix(".fingerprint.json"), args.out.with_suffix(".fingerprint.json"))
    assert assets.run(args) == 2
    assert capsys.readouterr().err == f"chestnut model prepare: --out {args.out} is a symlink; give another path\n"
    assert calls == [] and args.out.is_symlink()


# ---------------------------------------------------------------- the prepared model's entry in the compile cache


@pytest.fixture(scope="module")
def compiled_jit(tiny_onnx, tmp_path_factory) -> Path:
    """A compile cache directory holding the captured JIT of ``tiny.onnx``, compiled once for the module."""
    from chestnut.backend.jitcache import JitCache
    from chestnut.backend.model import OnnxModel

    root = tmp_path_factory.mktemp("compiled") / "jit"
    assert OnnxModel(tiny_onnx, jit_cache=JitCache(root)).cache_hit is False
    return root


@pytest.fixture
def cached(prepared, compiled_jit, tmp_path) -> tuple[Path, argparse.Namespace, list[Path], Path, Path]:
    """``prepared`` with its entry in its compile cache (``$CHESTNUT_CACHE/jit``), intact: (prepared path, args,
    prepare_model's calls, the entry's pickle, the entry's metadata)."""
    out, args, calls = prepared
    root = tmp_path / "cache" / "jit"
    shutil.copytree(compiled_jit, root)  # 0700, its files 0600, as compiled
    (pkl,) = root.glob("*.pkl")
    return out, args, calls, pkl, pkl.with_suffix(".json")


def test_an_intact_compile_cache_entry_is_ready_without_preparing(cached, capsys, compiled_jit):
    out, args, calls, pkl, meta = cached
    assert assets.run(args) == 0
    sha = hashlib.sha256(out.read_bytes()).hexdigest()
    assert capsys.readouterr() == (
        f"model ready: {out} (sha256 {sha[:16]}, max |tinygrad-onnxruntime| 0.00e+00)\n", ""
    )
    assert calls == []
    assert pkl.read_bytes() == (compiled_jit / pkl.name).read_bytes()
    assert meta.read_bytes() == (compiled_jit / meta.name).read_bytes()


def test_a_flipped_byte_in_the_cached_jit_is_named_and_prepared_again(cached, capsys, tiny_onnx):
    """It said "model ready"; the node found the damage at its next start (the HMAC-checked load refused it)."""
    out, args, calls, pkl, meta = cached
    blob = bytearray(pkl.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    pkl.write_bytes(bytes(blob))
    bad = hashlib.sha256(blob).hexdigest()
    good = json.loads(meta.read_text())["pickle_sha256"]
    assert assets.run(args) == 0
    sha = hashlib.sha256(out.read_bytes()).hexdigest()
    assert capsys.readouterr() == (
        f"compile cache entry of {out} refused ({pkl} does not match its metadata: its sha256 is {bad[:16]}, "
        f"{meta.name} recorded {good[:16]}); preparing it again\n"
        f"preparing {tiny_onnx} -> {out} (input [1, 3, 32, 64]); the first tinygrad run compiles, this takes a while\n"
        f"model ready: {out} (sha256 {sha[:16]}, 0 Resize nodes repaired, max |tinygrad-onnxruntime| 0.00e+00, "
        "first call 0.5 s)\n",
        "",
    )
    assert calls == [out]
    assert not meta.exists() and not pkl.exists()  # discarded: the rebuild stores a fresh entry, unrefused


class Plant:
    """A pickle that creates ``marker`` when it is loaded (what an attacker would plant)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_planted_pickle_is_named_as_tampered_and_never_unpickled(cached, capsys, tmp_path):
    """A pickle replaced along with the sha256 its metadata records: the metadata's HMAC no longer checks."""
    out, args, calls, pkl, meta = cached
    marker = tmp_path / "pwned"
    blob = pickle.dumps(Plant(marker))
    pkl.write_bytes(blob)
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "pickle_sha256": hashlib.sha256(blob).hexdigest()}))
    assert assets.run(args) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"compile cache entry of {out} refused ({meta} does not carry this cache's HMAC (tampered or foreign)); "
        "preparing it again"
    )
    assert calls == [out] and not marker.exists()


def test_the_check_unpickles_not_even_an_authenticated_entry(cached, capsys, tmp_path):
    """An entry this cache signed is intact without being loaded: the check hashes the pickle, never runs it."""
    from chestnut.backend.jitcache import JitCache
    from chestnut.backend.model import _graph_inputs, host_cache_key

    out, args, calls, pkl, meta = cached
    marker = tmp_path / "pwned"
    data = out.read_bytes()
    key = host_cache_key(hashlib.sha256(data).hexdigest(), _graph_inputs(data, "tiny", {}))
    assert JitCache(pkl.parent).store(key, Plant(marker), {}) == pkl  # the same entry, signed by this cache
    assert assets.run(args) == 0
    assert capsys.readouterr().out.startswith(f"model ready: {out} (sha256 ")
    assert calls == [] and not marker.exists()


def test_a_key_others_could_read_is_named_with_its_fix_on_every_prepare_and_the_entry_kept(
    cached, capsys, caplog, compiled_jit, monkeypatch
):
    """It was "compile cache entry ... refused (.../hmac.key is readable ...); preparing it again": the valid entry
    deleted, the compile not cached, "model ready" said as if it were, and the next prepare silent."""
    from chestnut.backend import jitcache

    out, args, calls, pkl, meta = cached
    key = pkl.parent / "hmac.key"
    key.chmod(0o644)
    sha = hashlib.sha256(out.read_bytes()).hexdigest()
    expected = (
        f"compile cache key {key} is readable or writable by group/other (mode 0644); the compile cache is off "
        f"(models are compiled, not cached; its entries are kept) until you run chmod 600 {key}, or remove it if "
        "another user may have read or written it (a new key is made, and every compiled entry is compiled again)\n"
        f"model ready: {out} (sha256 {sha[:16]}, max |tinygrad-onnxruntime| 0.00e+00); not cached (the compile "
        "cache's key is refused: above)\n",
        "",
    )
    for _ in range(2):  # each prepare is a process of its own: the second says it again
        monkeypatch.setattr(jitcache, "_said", set())
        assert assets.run(args) == 0
        assert capsys.readouterr() == expected
    assert calls == [] and caplog.records == []
    assert pkl.read_bytes() == (compiled_jit / pkl.name).read_bytes()
    assert meta.read_bytes() == (compiled_jit / meta.name).read_bytes()
    assert stat.S_IMODE(key.stat().st_mode) == 0o644  # neither fixed nor replaced behind the user's back


def test_a_prepare_that_compiles_under_a_refused_key_says_not_cached(prepared, capsys, caplog, monkeypatch, tmp_path):
    from chestnut.backend import jitcache

    out, args, calls = prepared
    monkeypatch.setattr(jitcache, "_said", set())
    key = tmp_path / "cache" / "jit" / "hmac.key"
    key.parent.mkdir(parents=True, mode=0o700)
    key.write_bytes(b"k" * 32)
    key.chmod(0o640)
    args.force = True
    assert assets.run(args) == 0
    sha = hashlib.sha256(out.read_bytes()).hexdigest()
    assert capsys.readouterr().out.splitlines() == [  # the compile (not run here) logs the key's line first
        f"preparing {args.onnx} -> {out} (input [1, 3, 32, 64]); the first tinygrad run compiles, this takes a while",
        f"compile cache key {key} is readable or writable by group/other (mode 0640); the compile cache is off "
        f"(models are compiled, not cached; its entries are kept) until you run chmod 600 {key}, or remove it if "
        "another user may have read or written it (a new key is made, and every compiled entry is compiled again)",
        f"model ready: {out} (sha256 {sha[:16]}, 0 Resize nodes repaired, max |tinygrad-onnxruntime| 0.00e+00, "
        "first call 0.5 s); not cached (the compile cache's key is refused: above)",
    ]
    assert calls == [out]


def test_an_emptied_key_is_replaced_as_the_model_is_prepared_again_and_the_next_prepare_is_ready(
    cached, capsys, caplog, monkeypatch, tiny_onnx
):
    """``: > hmac.key``: the key is ours and damaged, so the project replaces it; the entry is recompiled under the
    new key (never trusted under the old one) and the next prepare finds it intact."""
    from chestnut.backend import jitcache
    from chestnut.backend.model import OnnxModel

    out, args, calls, pkl, meta = cached
    monkeypatch.setattr(jitcache, "_said", set())
    key = pkl.parent / "hmac.key"
    key.write_bytes(b"")
    first = {"source": str(tiny_onnx), "sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
             "input_shape": list(SHAPE), "max_abs_diff_vs_onnxruntime": 0.0, "resize_roi_repaired": 0,
             "first_call_s": 0.5}

    def prepare_model(src: Path, dst: Path, shape: tuple[int, ...], frame: object, started: Any = None) -> dict:
        started()
        calls.append(dst)
        model = OnnxModel(dst.read_bytes(), name=dst.stem, origin=dst, jit_cache=jitcache.JitCache())
        assert model.cache_hit is False
        return first

    monkeypatch.setattr(assets, "prepare_model", prepare_model)
    assert assets.run(args) == 0
    sha = first["sha256"]
    assert capsys.readouterr() == (
        f"compile cache key {key} holds 0 bytes, not 32 (damaged); a new key replaces it when a model is next cached, "
        "and every compiled entry is compiled again\n"
        f"preparing {tiny_onnx} -> {out} (input [1, 3, 32, 64]); the first tinygrad run compiles, this takes a while\n"
        f"model ready: {out} (sha256 {sha[:16]}, 0 Resize nodes repaired, max |tinygrad-onnxruntime| 0.00e+00, "
        "first call 0.5 s)\n",
        "",
    )
    assert calls == [out] and [r for r in caplog.records if "hmac.key" in r.getMessage()] == []  # said once
    assert len(key.read_bytes()) == 32 and stat.S_IMODE(key.stat().st_mode) == 0o600
    monkeypatch.setattr(jitcache, "_said", set())
    assert assets.run(args) == 0
    assert capsys.readouterr() == (f"model ready: {out} (sha256 {sha[:16]}, max |tinygrad-onnxruntime| 0.00e+00)\n", "")
    assert calls == [out]


CHESTNUT = str(Path(sys.executable).with_name("chestnut"))


@pytest.mark.slow
def test_model_prepare_rebuilds_a_damaged_cached_jit_that_the_next_run_finds_intact(tmp_path, tiny_onnx):
    """The real command, compiling: prepared, a byte of its cached JIT flipped, prepared again with one line saying
    why (the load does not refuse the entry a second time), then ready."""
    env = {**os.environ, "CHESTNUT_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "out" / "m.onnx"
    out.parent.mkdir(mode=0o700)
    cmd = [CHESTNUT, "model", "prepare", "--onnx", str(tiny_onnx), "--shape", "1,3,32,64", "--out", str(out)]

    def prepare() -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)

    first = prepare()
    assert first.returncode == 0, first.stderr
    (pkl,) = (tmp_path / "cache" / "jit").glob("*.pkl")
    blob = bytearray(pkl.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    pkl.write_bytes(bytes(blob))
    good = json.loads(pkl.with_suffix(".json").read_text())["pickle_sha256"]

    second = prepare()
    assert second.returncode == 0, second.stderr
    lines = second.stdout.splitlines()
    assert lines[0] == (
        f"compile cache entry of {out} refused ({pkl} does not match its metadata: its sha256 is "
        f"{hashlib.sha256(blob).hexdigest()[:16]}, {pkl.stem}.json recorded {good[:16]}); preparing it again"
    )
    assert lines[1].startswith(f"preparing {tiny_onnx} -> {out} ")
    assert f"  m: compiled and cached ({pkl.stem[:12]})" in lines  # the same entry, rebuilt
    assert "compile cache" not in second.stderr  # said once, on stdout
    meta = json.loads(out.with_suffix(".json").read_text())

    third = prepare()
    assert (third.returncode, third.stdout) == (
        0,
        f"model ready: {out} (sha256 {meta['sha256'][:16]}, max |tinygrad-onnxruntime| "
        f"{meta['max_abs_diff_vs_onnxruntime']:.2e})\n",
    )


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda b: b[:200] + bytes([b[200] ^ 0xFF]) + b[201:], "does not read as JSON"),  # a flipped byte
        (lambda b: b"[]", "is not the one recorded for this model"),
        (lambda b: json.dumps({**json.loads(b), "model_sha256": "0" * 64}).encode(),
         "is not the one recorded for this model"),
    ],
)
def test_a_damaged_fingerprint_is_prepared_again(prepared, capsys, damage, why):
    """It said "model ready", and the node then refused to start: ``fingerprint: ... is unreadable``."""
    out, args, calls = prepared
    fp = out.with_suffix(".fingerprint.json")
    fp.write_bytes(damage(fp.read_bytes()))
    assert assets.run(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"prepared model {out} is damaged (its fingerprint tiny.fingerprint.json {why}); preparing it again"
    assert calls == [out]


def test_a_prepared_model_writable_by_others_is_prepared_again_0600(prepared, capsys):
    """'model ready' was said of a 0666 prepared model, which the node then refused to load (untrusted_model)."""
    out, args, calls = prepared
    out.chmod(0o666)
    assert assets.run(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (f"prepared model {out} is damaged (it is writable by group or other (mode 0666), which the node "
                     "refuses); preparing it again")
    assert calls == [out]
