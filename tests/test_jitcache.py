import hashlib
import json
import os
import pickle
import stat
from pathlib import Path

import numpy as np
import pytest

from chestnut.backend import jitcache
from chestnut.backend.jitcache import KEY_NAME, MAX_META_BYTES, CacheKey, JitCache, meta_mac
from chestnut.backend.model import OnnxModel, TensorSpec


def _x():
    return {"x": np.random.default_rng(3).random((1, 3, 32, 64), dtype=np.float32)}


def test_cache_miss_builds_then_hit_loads_and_reproduces(tiny_onnx, tmp_path):
    cache = JitCache(tmp_path)
    lines: list[str] = []
    built = OnnxModel(tiny_onnx, jit_cache=cache, progress=lines.append)
    assert built.cache_hit is False
    assert [ln.split(":")[1].split("(")[0].strip() for ln in lines] == [
        "parsing the ONNX graph",
        "first run",
        "capturing the JIT",
        "compiled and cached",
    ]
    assert len(list(tmp_path.glob("*.pkl"))) == 1 and len(list(tmp_path.glob("*.json"))) == 1
    loaded = OnnxModel(tiny_onnx, jit_cache=cache)
    assert loaded.cache_hit is True
    assert loaded.outputs == (TensorSpec("prob", (1, 1, 16, 32), "float32"),)
    np.testing.assert_array_equal(loaded.run(_x())["prob"], built.run(_x())["prob"])


def test_corrupt_entry_is_rebuilt(tiny_onnx, tmp_path):
    cache = JitCache(tmp_path)
    OnnxModel(tiny_onnx, jit_cache=cache)
    pkl = next(tmp_path.glob("*.pkl"))
    pkl.write_bytes(pkl.read_bytes()[:-10] + b"0123456789")
    again = OnnxModel(tiny_onnx, jit_cache=cache)
    assert again.cache_hit is False
    assert OnnxModel(tiny_onnx, jit_cache=cache).cache_hit is True  # the rebuild was stored


def test_foreign_entry_is_rebuilt(tiny_onnx, tmp_path, caplog):
    cache = JitCache(tmp_path)
    OnnxModel(tiny_onnx, jit_cache=cache)
    meta_path = next(tmp_path.glob("*.json"))
    meta = json.loads(meta_path.read_text())
    meta["key"]["machine"]["cpu"] = "another-machine"
    _resign(tmp_path, meta_path, meta)  # a genuine entry of ours, built on another machine
    assert OnnxModel(tiny_onnx, jit_cache=cache).cache_hit is False
    assert "was built for another key; rebuilding" in caplog.text


def test_entry_that_reproduces_another_output_is_rebuilt(tiny_onnx, tmp_path, caplog):
    cache = JitCache(tmp_path)
    OnnxModel(tiny_onnx, jit_cache=cache)
    meta_path = next(tmp_path.glob("*.json"))
    meta = json.loads(meta_path.read_text())
    meta["verify_digest"] = "0" * 64
    _resign(tmp_path, meta_path, meta)
    assert OnnxModel(tiny_onnx, jit_cache=cache).cache_hit is False
    assert "reproduced a different output; rebuilding" in caplog.text


# ---------------------------------------------------------------- nothing is unpickled that we did not write

KEY = CacheKey("0" * 64, (("x", (1, 3, 32, 64), "float32"),), "CPU", "0.14.0")


class Plant:
    """A pickle that creates ``marker`` when it is loaded (what an attacker would plant)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _plant_unsigned(root: Path, marker: Path, mac_key: bytes | None = None) -> None:
    """An attacker's entry: a pickle and metadata with its true sha256 (and an HMAC under ``mac_key``)."""
    root.mkdir(mode=0o700, exist_ok=True)
    blob = pickle.dumps(Plant(marker))
    meta = {"key": KEY.fields(), "pickle_sha256": hashlib.sha256(blob).hexdigest()}
    if mac_key is not None:
        meta["hmac"] = meta_mac(mac_key, meta)
    (root / f"{KEY.digest}.pkl").write_bytes(blob)
    (root / f"{KEY.digest}.json").write_text(json.dumps(meta))


def _resign(root: Path, meta_path: Path, meta: dict) -> None:
    meta["hmac"] = meta_mac((root / KEY_NAME).read_bytes(), meta)
    meta_path.write_text(json.dumps(meta))


def test_a_new_entry_is_0600_in_a_0700_dir_with_a_0600_key_whatever_the_umask(tmp_path):
    root = tmp_path / "jit"
    old = os.umask(0)
    try:
        assert JitCache(root).store(KEY, [1, 2, 3], {"x": 1}) == root / f"{KEY.digest}.pkl"
    finally:
        os.umask(old)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in root.iterdir()} == {
        f"{KEY.digest}.pkl": 0o600,
        f"{KEY.digest}.json": 0o600,
        KEY_NAME: 0o600,
    }
    assert JitCache(root).load(KEY) == ([1, 2, 3], {**json.loads((root / f"{KEY.digest}.json").read_text())})


def test_a_planted_pickle_with_its_true_sha256_never_runs(tmp_path, caplog):
    root, marker = tmp_path / "jit", tmp_path / "pwned"
    JitCache(root).store(KEY, "ours", {})  # the cache exists with its key; the attacker replaces the entry
    _plant_unsigned(root, marker)
    assert JitCache(root).load(KEY) is None
    assert not marker.exists()
    assert (
        f"compile cache entry {KEY.digest}.pkl refused: {root / KEY.digest}.json does not carry this cache's "
        "HMAC (tampered or foreign); rebuilding" in caplog.text
    )


def test_a_planted_pickle_signed_with_another_key_never_runs(tmp_path):
    root, marker = tmp_path / "jit", tmp_path / "pwned"
    JitCache(root).store(KEY, "ours", {})
    _plant_unsigned(root, marker, mac_key=b"k" * 32)
    assert JitCache(root).load(KEY) is None and not marker.exists()


def test_a_planted_entry_without_a_key_file_never_runs(tmp_path):
    root, marker = tmp_path / "jit", tmp_path / "pwned"
    _plant_unsigned(root, marker)
    assert JitCache(root).load(KEY) is None and not marker.exists()


@pytest.mark.parametrize(
    ("what", "mode", "why"),
    [
        ("pkl", 0o666, "is writable by group/other (mode 0666)"),
        ("pkl", 0o620, "is writable by group/other (mode 0620)"),
        ("json", 0o602, "is writable by group/other (mode 0602)"),
        ("key", 0o640, "compile cache key {root}/hmac.key is readable or writable by group/other (mode 0640); "
                       "the compile cache is off"),
        ("dir", 0o777, "cache directory {root} is writable by group/other (mode 0777)"),
        ("dir", 0o770, "cache directory {root} is writable by group/other (mode 0770)"),
        ("parent", 0o777, "is writable by group/other without the sticky bit (mode 0777)"),
    ],
    ids=["pkl-0666", "pkl-0620", "json-0602", "key-0640", "dir-0777", "dir-0770", "parent-0777"],
)
def test_an_entry_group_or_other_could_have_written_never_runs(tmp_path, caplog, what, mode, why):
    root, marker = tmp_path / "parent" / "jit", tmp_path / "pwned"
    root.parent.mkdir(mode=0o755)
    JitCache(root).store(KEY, Plant(marker), {})  # correctly signed: only the modes say it may be foreign
    target = {
        "pkl": root / f"{KEY.digest}.pkl",
        "json": root / f"{KEY.digest}.json",
        "key": root / KEY_NAME,
        "dir": root,
        "parent": root.parent,
    }[what]
    target.chmod(mode)
    assert JitCache(root).load(KEY) is None
    assert not marker.exists()
    assert why.format(root=root) in caplog.text and ("rebuilding" in caplog.text or what == "key")


@pytest.mark.parametrize("what", ["pkl", "json", "key"])
def test_a_symlinked_cache_file_never_runs(tmp_path, caplog, what):
    root, marker, away = tmp_path / "jit", tmp_path / "pwned", tmp_path / "away"
    away.mkdir(mode=0o700)
    JitCache(root).store(KEY, Plant(marker), {})
    name = {"pkl": f"{KEY.digest}.pkl", "json": f"{KEY.digest}.json", "key": KEY_NAME}[what]
    (root / name).rename(away / name)
    (root / name).symlink_to(away / name)
    assert JitCache(root).load(KEY) is None
    assert not marker.exists()
    assert f"{root / name} is a symlink; {'the compile cache is off' if what == 'key' else 'rebuilding'}" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_an_entry_of_another_user_never_runs(tmp_path, caplog):
    root, marker = tmp_path / "jit", tmp_path / "pwned"
    JitCache(root).store(KEY, Plant(marker), {})
    os.chown(root / f"{KEY.digest}.pkl", 65534, 65534)
    assert JitCache(root).load(KEY) is None and not marker.exists()
    assert f"{KEY.digest}.pkl belongs to uid 65534, not to uid 0" in caplog.text


def test_an_oversized_metadata_file_is_refused_unread(tmp_path, caplog):
    root = tmp_path / "jit"
    JitCache(root).store(KEY, "ours", {})
    (root / f"{KEY.digest}.json").write_bytes(b" " * (MAX_META_BYTES + 1))
    assert JitCache(root).load(KEY) is None
    assert f"holds {MAX_META_BYTES + 1} bytes, more than the limit of {MAX_META_BYTES}" in caplog.text


def test_a_refused_directory_gets_nothing_written(tmp_path):
    root = tmp_path / "jit"
    root.mkdir()
    root.chmod(0o777)
    assert JitCache(root).store(KEY, "ours", {}) is None
    assert list(root.iterdir()) == []


def test_a_model_compiled_under_a_refused_cache_says_it_is_not_cached(tiny_onnx, tmp_path):
    root = tmp_path / "jit"
    root.mkdir()
    root.chmod(0o777)
    lines: list[str] = []
    OnnxModel(tiny_onnx, jit_cache=JitCache(root), progress=lines.append)
    assert lines[-1] == "tiny: compiled, not cached (the compile cache was refused: above)"
    assert list(root.iterdir()) == []


def test_a_refused_entry_is_rebuilt_and_replaced_by_a_private_one(tiny_onnx, tmp_path, caplog):
    cache = JitCache(tmp_path)
    OnnxModel(tiny_onnx, jit_cache=cache)
    pkl = next(tmp_path.glob("*.pkl"))
    pkl.chmod(0o666)
    assert OnnxModel(tiny_onnx, jit_cache=cache).cache_hit is False
    assert f"{pkl} is writable by group/other (mode 0666); rebuilding" in caplog.text
    assert stat.S_IMODE(pkl.stat().st_mode) == 0o600
    assert OnnxModel(tiny_onnx, jit_cache=cache).cache_hit is True


# ---------------------------------------------------------------- refusal: load's checks, nothing unpickled


def _flip_pickle(root: Path) -> str:
    pkl = root / f"{KEY.digest}.pkl"
    blob = bytearray(pkl.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    pkl.write_bytes(bytes(blob))
    good = json.loads((root / f"{KEY.digest}.json").read_text())["pickle_sha256"]
    return (f"{pkl} does not match its metadata: its sha256 is {hashlib.sha256(blob).hexdigest()[:16]}, "
            f"{KEY.digest}.json recorded {good[:16]}")


def _retarget(root: Path) -> str:
    meta_path = root / f"{KEY.digest}.json"
    meta = json.loads(meta_path.read_text())
    meta["key"]["device"] = "AMD:gfx1100"
    _resign(root, meta_path, meta)  # genuine, signed by this cache, found under another key's name
    return f"{meta_path} was built for another key"


def _unsign(root: Path) -> str:
    meta_path = root / f"{KEY.digest}.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "pickle_sha256": "0" * 64}))
    return f"{meta_path} does not carry this cache's HMAC (tampered or foreign)"


def _remove(name: str, why: str):
    def damage(root: Path) -> str:
        (root / name.format(d=KEY.digest)).unlink()
        return f"{root / name.format(d=KEY.digest)} {why}"

    return damage


def _chmod(name: str, mode: int, why: str):
    def damage(root: Path) -> str:
        path = root / name.format(d=KEY.digest) if name else root
        path.chmod(mode)
        return why.format(path=path)

    return damage


def _garble(root: Path) -> str:
    (root / f"{KEY.digest}.json").write_text('{"key": ')
    return f"{root / KEY.digest}.json is not JSON"


@pytest.mark.parametrize(
    "damage",
    [
        _flip_pickle,
        _unsign,
        _retarget,
        _garble,
        _remove("{d}.pkl", f"is missing (its metadata {KEY.digest}.json is there)"),
        _remove(KEY_NAME, "is missing, so no entry can be verified"),
        _chmod("{d}.pkl", 0o666, "{path} is writable by group/other (mode 0666)"),
        _chmod(KEY_NAME, 0o640, "compile cache key {path} is readable or writable by group/other (mode 0640); the "
               "compile cache is off (models are compiled, not cached; its entries are kept) until you run chmod 600 "
               "{path}, or remove it if another user may have read or written it (a new key is made, and every "
               "compiled entry is compiled again)"),
        _chmod("", 0o777, "the cache directory {path} is writable by group/other (mode 0777)"),
    ],
    ids=["flipped-byte", "unsigned", "another-key", "not-json", "no-pickle", "no-key", "pkl-0666", "key-0640",
         "dir-0777"],
)
def test_refusal_names_the_file_and_what_is_wrong_as_load_refuses_it(tmp_path, damage):
    root, marker = tmp_path / "jit", tmp_path / "pwned"
    JitCache(root).store(KEY, Plant(marker), {})
    why = damage(root)
    assert JitCache(root).refusal(KEY) == why
    assert JitCache(root).load(KEY) is None and not marker.exists()


def test_refusal_of_an_intact_entry_is_none_and_unpickles_nothing(tmp_path):
    root, marker = tmp_path / "jit", tmp_path / "pwned"
    assert JitCache(root).refusal(KEY) is None  # no cache directory
    JitCache(root).store(KEY, "another entry", {})
    other = CacheKey("1" * 64, KEY.inputs, KEY.device, KEY.tinygrad_version)
    assert JitCache(root).refusal(other) is None  # no entry for this key
    JitCache(root).store(other, Plant(marker), {})
    assert JitCache(root).refusal(other) is None and not marker.exists()


def test_discard_removes_the_entry_and_keeps_the_rest(tmp_path):
    root = tmp_path / "jit"
    other = CacheKey("1" * 64, KEY.inputs, KEY.device, KEY.tinygrad_version)
    JitCache(root).store(KEY, "ours", {})
    JitCache(root).store(other, "kept", {})
    JitCache(root).discard(KEY)
    assert sorted(p.name for p in root.iterdir()) == sorted([f"{other.digest}.pkl", f"{other.digest}.json", KEY_NAME])
    JitCache(root).discard(KEY)  # gone already: nothing to do
    assert JitCache(root).load(KEY) is None and JitCache(root).load(other)[0] == "kept"


def test_the_folders_made_for_a_new_cache_are_private(tmp_path):
    """``CHESTNUT_CACHE`` naming a path whose folders do not exist yet: each one made is 0700, not the default 0755."""
    root = tmp_path / "a" / "b" / "cache"
    old = os.umask(0o022)
    try:
        fd = JitCache(root)._open_root(create=True)
    finally:
        os.umask(old)
    os.close(fd)
    assert [stat.S_IMODE((tmp_path / p).stat().st_mode) for p in ("a", "a/b", "a/b/cache")] == [0o700] * 3


def test_a_cache_under_a_folder_others_can_write_is_refused_before_anything_is_made_in_it(tmp_path, monkeypatch):
    """``CHESTNUT_CACHE`` a 0777 folder: ``chestnut model prepare`` refused the compile cache and tinygrad's, but made
    ``jit/`` and ``tinygrad/`` in it first."""
    from chestnut.backend.jitcache import CacheRefused, default_cache_dir, private_tinygrad_cache, tinygrad_cache_dir

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("CHESTNUT_CACHE", str(shared))
    why = f"{shared} (above the cache directory) is writable by group/other without the sticky bit (mode 0777)"
    with pytest.raises(CacheRefused) as e:
        JitCache()._open_root(create=True)
    assert str(e.value) == why
    assert JitCache().store(KEY, "ours", {}) is None
    environ: dict[str, str] = {}
    assert private_tinygrad_cache(environ=environ) is None
    assert environ == {"CACHELEVEL": "0"}
    assert (default_cache_dir(), tinygrad_cache_dir()) == (shared / "jit", shared / "tinygrad")
    assert list(shared.iterdir()) == []


# ---------------------------------------------------------------- a bad key is the key's problem, not an entry's


@pytest.fixture
def fresh_process(monkeypatch):
    """What this process said of a bad key forgotten (as in the next process); returns a function that forgets again."""
    monkeypatch.setattr(jitcache, "_said", set(), raising=False)
    return lambda: monkeypatch.setattr(jitcache, "_said", set(), raising=False)


OFF = "the compile cache is off (models are compiled, not cached; its entries are kept) until you"
REMOVE = "remove {key}: a new key is made, and every compiled entry is compiled again"


def _key_mode(root: Path) -> str:
    (root / KEY_NAME).chmod(0o644)
    key = root / KEY_NAME
    return (f"compile cache key {key} is readable or writable by group/other (mode 0644); {OFF} run chmod 600 {key}, "
            "or remove it if another user may have read or written it (a new key is made, and every compiled entry "
            "is compiled again)")


def _key_symlink(root: Path) -> str:
    key = root / KEY_NAME
    key.rename(root.parent / "away.key")
    key.symlink_to(root.parent / "away.key")
    return f"compile cache key {key} is a symlink; {OFF} {REMOVE.format(key=key)}"


def _key_folder(root: Path) -> str:
    key = root / KEY_NAME
    key.unlink()
    key.mkdir(mode=0o700)
    return f"compile cache key {key} is not a regular file; {OFF} {REMOVE.format(key=key)}"


def _key_owner(root: Path) -> str:
    key = root / KEY_NAME
    os.chown(key, 65534, 65534)
    return f"compile cache key {key} belongs to uid 65534, not to uid 0; {OFF} {REMOVE.format(key=key)}"


@pytest.mark.parametrize(
    "damage",
    [
        _key_mode,
        _key_symlink,
        _key_folder,
        pytest.param(_key_owner, marks=pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")),
    ],
    ids=["mode-0644", "symlink", "folder", "owner"],
)
def test_a_bad_key_is_named_with_its_fix_its_entries_kept_untrusted_and_it_is_never_used_or_replaced(
    tmp_path, caplog, fresh_process, damage
):
    """It was "compile cache entry ... refused (...hmac.key is readable ...)": the valid entry was deleted, the
    store refused, and the next run said nothing."""
    root, marker = tmp_path / "jit", tmp_path / "pwned"
    JitCache(root).store(KEY, Plant(marker), {})
    entry = {p.name: p.read_bytes() for p in root.glob(f"{KEY.digest}.*")}
    line = damage(root)
    assert JitCache(root).refusal(KEY) == line
    assert str(JitCache(root).key_problem()) == line and JitCache(root).key_problem().damaged is False
    assert JitCache(root).load(KEY) is None
    assert JitCache(root).store(KEY, "new", {}) is None  # not used, not replaced
    assert JitCache(root).load(KEY) is None
    assert [r.getMessage() for r in caplog.records] == [line]  # once in this process
    fresh_process()
    assert JitCache(root).load(KEY) is None
    assert [r.getMessage() for r in caplog.records] == [line, line]  # and again by the next
    assert {p.name: p.read_bytes() for p in root.glob(f"{KEY.digest}.*")} == entry and not marker.exists()


@pytest.mark.parametrize("size", [0, 31, 33, 4096])
def test_a_damaged_key_of_ours_is_replaced_when_a_model_is_next_cached(tmp_path, caplog, fresh_process, size):
    root, marker = tmp_path / "jit", tmp_path / "pwned"
    other = CacheKey("1" * 64, KEY.inputs, KEY.device, KEY.tinygrad_version)
    JitCache(root).store(other, Plant(marker), {})
    kept = {p.name: p.read_bytes() for p in root.glob(f"{other.digest}.*")}
    key = root / KEY_NAME
    key.write_bytes(b"k" * size)
    line = (f"compile cache key {key} holds {size} bytes, not 32 (damaged); a new key replaces it when a model is "
            "next cached, and every compiled entry is compiled again")
    assert JitCache(root).refusal(other) == line and JitCache(root).key_problem().damaged is True
    assert JitCache(root).load(other) is None
    assert {p.name: p.read_bytes() for p in root.glob(f"{other.digest}.*")} == kept  # not removed for the key
    assert JitCache(root).store(KEY, "ours", {}) == root / f"{KEY.digest}.pkl"
    assert [r.getMessage() for r in caplog.records] == [line]  # the load and the store: one line
    assert len(key.read_bytes()) == 32 and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert JitCache(root).key_problem() is None and JitCache(root).load(KEY)[0] == "ours"
    assert JitCache(root).refusal(other) == (  # signed with the old key: never trusted, compiled again
        f"{root / other.digest}.json does not carry this cache's HMAC (tampered or foreign)")
    assert JitCache(root).load(other) is None and not marker.exists()
    assert sorted(p.name for p in root.iterdir()) == sorted([*kept, f"{KEY.digest}.pkl", f"{KEY.digest}.json",
                                                            KEY_NAME])  # no temporary file left


def test_a_new_key_is_made_whole_and_a_second_maker_keeps_the_first(tmp_path):
    root = tmp_path / "jit"
    fd = JitCache(root)._open_root(create=True)
    try:
        first = JitCache(root)._key(fd, create=True)
        assert JitCache(root)._key(fd, create=True) == first == (root / KEY_NAME).read_bytes()
    finally:
        os.close(fd)
    assert len(first) == 32 and [p.name for p in root.iterdir()] == [KEY_NAME]
