import numpy as np
import pytest

from chestnut.backend.errors import ModelError
from chestnut.backend.model import TensorSpec
from chestnut.fallback.standby import Engine, FallbackModel


@pytest.mark.parametrize("engine", list(Engine))
def test_engines_serve_the_same_contract(tiny_onnx, engine):
    m = FallbackModel(tiny_onnx, engine)
    assert m.inputs == (TensorSpec("x", (1, 3, 32, 64), "float32"),)
    assert m.outputs == (TensorSpec("prob", (1, 1, 16, 32), "float32"),)
    x = {"x": np.random.default_rng(5).random((1, 3, 32, 64), dtype=np.float32)}
    ref = FallbackModel(tiny_onnx, Engine.ONNXRUNTIME).run(x)["prob"]
    np.testing.assert_allclose(m.run(x)["prob"], ref, rtol=0, atol=1e-6)


def test_missing_fallback_model(tmp_path):
    with pytest.raises(ModelError, match=r"missing_model: fallback model file .*/gone.onnx does not exist"):
        FallbackModel(tmp_path / "gone.onnx")


def test_not_an_onnx_file(tmp_path):
    """The refusal names the file given, not the name the model runs under (``ppocr_det-fallback``)."""
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00garbage" * 10)
    for engine in Engine:
        with pytest.raises(ModelError) as e:
            FallbackModel(bad, engine, name="ppocr_det-fallback")
        assert str(e.value) == (f"bad_model: fallback model file {bad} is not a readable ONNX model: Error parsing "
                                "message with type 'onnx.ModelProto': Wire format was corrupt"), engine


def test_wrong_dtype_rejected(tiny_onnx):
    m = FallbackModel(tiny_onnx)
    with pytest.raises(ModelError, match=r"input 'x': got uint8\[1, 3, 32, 64\], want float32\[1, 3, 32, 64\]"):
        m.run({"x": np.zeros((1, 3, 32, 64), np.uint8)})
