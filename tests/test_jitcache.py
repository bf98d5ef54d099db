import json

import numpy as np

from chestnut.backend.jitcache import JitCache
from chestnut.backend.model import OnnxModel, TensorSpec


def _x():
    return {"x": np.random.default_rng(3).random((1, 3, 32, 64), dtype=np.float32)}


def test_cache_miss_builds_then_hit_loads_and_reproduces(tiny_onnx, tmp_path):
    cache = JitCache(tmp_path)
    lines: list[str] = []
    built = OnnxModel(tiny_onnx, jit_cache=cache, progress=lines.append)
    assert built.cache_hit is False
    assert [ln.split(":")[1].split("(")[0].strip() for ln in lines] == [
        "parsing the ONNX graph", "first run", "capturing the JIT", "compiled and cached"]
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


def test_foreign_entry_is_rebuilt(tiny_onnx, tmp_path):
    cache = JitCache(tmp_path)
    OnnxModel(tiny_onnx, jit_cache=cache)
    meta_path = next(tmp_path.glob("*.json"))
    meta = json.loads(meta_path.read_text())
    meta["key"]["machine"]["cpu"] = "another-machine"
    meta_path.write_text(json.dumps(meta))
    assert OnnxModel(tiny_onnx, jit_cache=cache).cache_hit is False


def test_entry_that_reproduces_another_output_is_rebuilt(tiny_onnx, tmp_path):
    cache = JitCache(tmp_path)
    OnnxModel(tiny_onnx, jit_cache=cache)
    meta_path = next(tmp_path.glob("*.json"))
    meta = json.loads(meta_path.read_text())
    meta["verify_digest"] = "0" * 64
    meta_path.write_text(json.dumps(meta))
    assert OnnxModel(tiny_onnx, jit_cache=cache).cache_hit is False
