import numpy as np
import pytest

from chestnut.backend.errors import ModelError
from chestnut.backend.model import OnnxModel, TensorSpec


def test_cpu_model_matches_onnxruntime(tiny_onnx):
    import onnxruntime as ort
    m = OnnxModel(tiny_onnx)
    assert m.inputs == (TensorSpec("x", (1, 3, 32, 64), "float32"),)
    x = np.random.default_rng(1).random((1, 3, 32, 64), dtype=np.float32)
    ref = ort.InferenceSession(str(tiny_onnx)).run(None, {"x": x})[0]
    for _ in range(4):  # eager, capture, replay, replay
        out = m.run({"x": x})
        np.testing.assert_allclose(out["prob"], ref, rtol=0, atol=1e-6)
    assert m.outputs == (TensorSpec("prob", (1, 1, 16, 32), "float32"),)
    assert m.model_id == f"tiny@{m.sha256[:16]}"


def test_wrong_input_shape_is_a_model_error(tiny_onnx):
    m = OnnxModel(tiny_onnx)
    with pytest.raises(ModelError, match=r"input 'x': got float32\[1, 3, 32, 32\], want float32\[1, 3, 32, 64\]"):
        m.run({"x": np.zeros((1, 3, 32, 32), np.float32)})


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelError, match="missing_model: model file .*nope.onnx does not exist"):
        OnnxModel(tmp_path / "nope.onnx")
