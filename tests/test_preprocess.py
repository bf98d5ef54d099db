"""The frame -> model input preprocessors (``node/preprocess.py``): their floats, and the input written in place."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from chestnut.node.preprocess import preprocess

H, W = 4, 6
SHAPE = (1, 3, H, W)


def _reference(name: str, img: np.ndarray) -> np.ndarray:
    """The preprocessors' definitions as numpy expressions (the module docstring's formulas), NCHW float32."""
    x = img.astype(np.float32) * np.float32(1 / 255.0)
    if name == "ppocr":
        x = (x - np.float32(0.5)) / np.float32(0.5)
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None])


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["unit", "ppocr"]), img=arrays(np.uint8, (H, W, 3)), in_place=st.booleans())
def test_same_floats_as_the_formula_new_array_or_in_place(name: str, img: np.ndarray, in_place: bool) -> None:
    out = np.full(SHAPE, np.nan, np.float32) if in_place else None
    x = preprocess(name, img, "x", SHAPE, out=out)["x"]
    want = _reference(name, img)
    assert x.dtype == np.float32 and x.shape == SHAPE and x.flags.c_contiguous
    assert x.tobytes() == want.tobytes()  # bit for bit
    if in_place:
        assert x is out


@pytest.mark.parametrize("bad", [
    np.zeros((1, 3, H, W + 1), np.float32),          # another shape
    np.zeros(SHAPE, np.float64),                     # another dtype
    np.zeros((1, 3, W, H), np.float32).transpose(0, 1, 3, 2),  # not C-contiguous
    np.zeros(SHAPE, np.float32),                     # read-only (below)
])
def test_an_out_that_does_not_fit_is_left_alone(bad: np.ndarray) -> None:
    if bad.dtype == np.float32 and bad.shape == SHAPE and bad.flags.c_contiguous:
        bad.flags.writeable = False
    before = bad.copy()
    img = np.full((H, W, 3), 255, np.uint8)
    x = preprocess("unit", img, "x", SHAPE, out=bad)["x"]
    assert x is not bad
    assert x.tolist() == np.ones(SHAPE, np.float32).tolist()
    assert bad.tobytes() == before.tobytes()


def test_a_warp_preprocess_makes_its_own_array() -> None:
    out = np.zeros(SHAPE, np.float32)
    img = np.zeros((2 * H, 2 * W, 3), np.uint8)
    x = preprocess("warp:unit", img, "x", SHAPE, out=out)["x"]
    assert x is not out and x.shape == SHAPE
    assert not out.any()
