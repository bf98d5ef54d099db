"""The CPU warp (``node/preprocess.py`` ``warp``, ``warp:<name>``): a full-resolution frame, BGR or
NV12, to the model's input; the same input the camera's own resize gives, within a stated tolerance."""

from __future__ import annotations

import numpy as np
import pytest

from chestnut.launch.assets import traffic_video_path
from chestnut.launch.camerad import iter_frames
from chestnut.node.preprocess import preprocess, warp

SHAPE = (1, 3, 128, 256)


def _bt601_bgr(y: int, u: int, v: int) -> list[int]:
    """ITU-R BT.601 limited-range Y'CbCr -> B, G, R (8 bit)."""
    c, d, e = 1.164 * (y - 16), u - 128, v - 128
    return [round(min(255, max(0, x))) for x in (c + 2.017 * d, c - 0.392 * d - 0.813 * e, c + 1.596 * e)]


@pytest.mark.parametrize("yuv", [(126, 90, 200), (16, 128, 128), (235, 128, 128), (81, 90, 240)])
def test_an_nv12_colour_converts_with_bt601_limited_range(yuv):
    y, u, v = yuv
    planes = np.empty((96, 64), np.uint8)
    planes[:64], planes[64:, 0::2], planes[64:, 1::2] = y, u, v
    out = warp(planes[:, :, None], "nv12", 32, 32)
    assert out.shape == (32, 32, 3) and out.dtype == np.uint8
    inner = out[4:-4, 4:-4].astype(int)  # swscale's edge pixels see the chroma filter's border: not the matrix
    assert (np.abs(inner - _bt601_bgr(y, u, v)) <= 2).all()  # swscale's fixed-point coefficients: white is G 253


def test_full_resolution_frames_warp_to_the_input_the_camera_resize_gives():
    """704x576 traffic frames: NV12 -> 128x256 BGR is exactly the camera's own decode-and-resize (both
    are swscale from the same 4:2:0 samples); BGR at 704x576 -> 128x256 is within 5 levels, mean < 1
    (one more rounding to 8 bits before the resize; measured over all 350 frames: max 5, mean 0.80).
    ``warp:ppocr`` is the GPU program's filter in float (``backend/warp.py``), not swscale's fixed point:
    within 3.6 levels of 255 of the camera's resize, mean 1.3 (all 350 frames: max 3.55, mean 1.25)."""
    video = traffic_video_path()
    frames = zip(
        iter_frames(video, 128, 256, loop=False),
        iter_frames(video, None, None, loop=False),
        iter_frames(video, None, None, loop=False, pixel_format="nv12"),
        strict=True,
    )
    for k, (small, full, nv12) in enumerate(frames):
        if k == 5:
            break
        assert full.shape == (576, 704, 3) and nv12.shape == (864, 704)
        assert (warp(nv12[:, :, None], "nv12", 128, 256) == small).all()
        diff = np.abs(warp(full, "bgr888", 128, 256).astype(int) - small)
        assert diff.max() <= 5 and diff.mean() < 1.0
        x = preprocess("warp:ppocr", nv12[:, :, None], "x", SHAPE, "nv12")["x"]
        assert x.shape == SHAPE and x.dtype == np.float32
        levels = np.abs(x - preprocess("ppocr", small, "x", SHAPE)["x"]) * 127.5  # ppocr: 2/255 per level
        assert levels.max() <= 3.6 and levels.mean() <= 1.3


def test_without_warp_a_full_frame_is_refused_in_one_line():
    planes = np.zeros((1812, 1928, 1), np.uint8)
    with pytest.raises(ValueError) as e:
        preprocess("ppocr", planes, "x", SHAPE, "nv12")
    assert str(e.value) == "a nv12 frame needs the warp to the model's input: preprocess warp:ppocr"
    with pytest.raises(ValueError) as e:
        preprocess("ppocr", np.zeros((576, 704, 3), np.uint8), "x", SHAPE)
    assert (
        str(e.value)
        == "frame is 704x576 (WxH), the model wants 256x128 (WxH, from its input shape N,C,H,W [1, 3, 128, 256])"
    )
    with pytest.raises(KeyError) as e:
        preprocess("warp:nope", planes, "x", SHAPE, "nv12")
    assert e.value.args[0] == "unknown preprocessing 'warp:nope'; known: ppocr, unit, warp:ppocr, warp:unit"
    with pytest.raises(ValueError) as e:
        warp(np.zeros((1811, 1928, 1), np.uint8), "nv12", 128, 256)
    assert str(e.value) == "an nv12 frame is uint8 [H * 3/2, W] with H, W even; got uint8[1811, 1928, 1]"
    with pytest.raises(ValueError, match=r"^cannot warp a gray8 frame \(bgr888, rgb888 or nv12\)$"):
        warp(np.zeros((4, 4, 1), np.uint8), "gray8", 2, 2)
