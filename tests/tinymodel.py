"""A small, deterministic ONNX model for tests where the model is not the point.

Shape contract like the real default: input ``x`` float32 [1,3,H,W] -> output ``prob`` float32
[1,1,H/2,W/2] in [0, 1] (conv stride 2, relu, conv, sigmoid). Weights come from a fixed seed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def make_tiny_onnx(path: Path, height: int = 32, width: int = 64, seed: int = 0) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((8, 3, 3, 3)) * 0.2).astype(np.float32)
    w2 = (rng.standard_normal((1, 8, 3, 3)) * 0.2).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["h"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Conv", ["r", "w2"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c"], ["prob"]),
    ]
    graph = helper.make_graph(
        nodes, "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, height, width])],
        [helper.make_tensor_value_info("prob", TensorProto.FLOAT, [1, 1, height // 2, width // 2])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def tiny_node_config(folder: Path, engine: str = "onnxruntime") -> Path:
    """A node config for a launched stack where the model is not the point: the tiny model at the shipped
    config's input (1x3x128x256, PP-OCR preprocessing), its fallback onnxruntime in hot standby, the twin as the
    dock (``engine`` is the fallback's). Writes ``folder/tiny128.onnx`` and ``folder/node.toml``; returns the
    config's path."""
    model = make_tiny_onnx(folder / "tiny128.onnx", height=128, width=256)
    conf = folder / "node.toml"
    conf.write_text(f'[model]\npath = "{model}"\nname = "tiny"\ninput = "x"\nshape = [1, 3, 128, 256]\n'
                    'preprocess = "ppocr"\n[model.ranges]\nprob = [0.0, 1.0]\n'
                    f'[fallback]\nengine = "{engine}"\nstandby = "hot"\n[dock]\nkind = "twin"\n')
    return conf
