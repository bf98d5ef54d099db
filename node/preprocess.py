"""Frame preprocessing: a camera frame (uint8 [H, W, 3] BGR) to a model's input tensor.

A small registry keyed by name, so that the node and offline replay preprocess identically (the
name is recorded in the log's ``initData.config``).

- ``ppocr``: PaddleOCR's detector normalisation, ``(img/255 - 0.5)/0.5``, BGR, NCHW float32
  (rapidocr-onnxruntime 1.4.4 ``config.yaml``: mean = std = 0.5, scale 1/255).
- ``unit``: ``img/255``, BGR, NCHW float32.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def _ppocr(img: np.ndarray) -> np.ndarray:
    x = img.astype(np.float32) * np.float32(1 / 255.0)
    x = (x - np.float32(0.5)) / np.float32(0.5)
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None])


def _unit(img: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray((img.astype(np.float32) * np.float32(1 / 255.0)).transpose(2, 0, 1)[None])


PREPROCESSORS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"ppocr": _ppocr, "unit": _unit}


def preprocess(name: str, img: np.ndarray, input_name: str, input_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """uint8 [H, W, 3] -> ``{input_name: float32 [1, 3, H, W]}``.

    Raises ``KeyError`` for an unknown preprocessor and ``ValueError`` when the frame does not match
    ``input_shape`` (N, C, H, W) — a wrong-sized frame is rejected, never resized silently.
    """
    if name not in PREPROCESSORS:
        raise KeyError(f"unknown preprocessing {name!r}; known: {', '.join(sorted(PREPROCESSORS))}")
    if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"frame must be uint8 [H, W, 3]; got {img.dtype}{list(img.shape)}")
    want = (int(input_shape[2]), int(input_shape[3]))
    if img.shape[:2] != want:
        raise ValueError(f"frame is {img.shape[1]}x{img.shape[0]}, the model wants {want[1]}x{want[0]}")
    return {input_name: PREPROCESSORS[name](img)}
