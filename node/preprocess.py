"""Frame preprocessing: a camera frame (uint8 [H, W, 3] BGR) to a model's input tensor.

A small registry keyed by name, so that the node and offline replay preprocess identically (the
name is recorded in the log's ``initData.config``).

- ``ppocr``: PaddleOCR's detector normalisation, ``(img/255 - 0.5)/0.5``, BGR, NCHW float32
  (rapidocr-onnxruntime 1.4.4 ``config.yaml``: mean = std = 0.5, scale 1/255).
- ``unit``: ``img/255``, BGR, NCHW float32.
- ``warp:<name>`` (e.g. ``warp:ppocr``): the frame, of any size, ``bgr888``, ``rgb888`` or ``nv12``,
  is warped to the model's input and normalised as ``<name>`` by ``backend/warp.py`` ``warp_numpy``:
  the same filter and matrix the primary's GPU program runs when the node gives it the full frame
  (``model.frame``; ``docs/warp.md``), so the fallback, the primary and replay see one model input.
  Without ``warp:`` a frame must already be the model's size and BGR: it is never resized silently.

:func:`warp` is FFmpeg's swscale through PyAV, the resize ``chestnut camera`` applies to its source: the
reference the warp is measured against (within 3.6 levels of 255 on the traffic video, ``docs/warp.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np

from chestnut.backend.errors import ConfigError
from chestnut.backend.warp import WarpSpec, WarpSpecError, warp_numpy


def _ppocr(img: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    x = _unit(img, out)
    x -= np.float32(0.5)  # in place, in numpy's order of the expression ((img/255 - 0.5)/0.5): the same floats
    x /= np.float32(0.5)
    return x


def _unit(img: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``img`` uint8 [H, W, 3] -> float32 [1, 3, H, W] ``img/255``, in one pass: each pixel converted to float32
    and multiplied by float32(1/255) (the same float as ``img.astype(np.float32) * np.float32(1/255)``), written
    through the transpose into ``out`` (float32 C-contiguous [1, 3, H, W]) or a new array."""
    if out is None:
        out = np.empty((1, img.shape[2], img.shape[0], img.shape[1]), np.float32)
    np.multiply(img.transpose(2, 0, 1)[None], np.float32(1 / 255.0), out=out, dtype=np.float32, casting="unsafe")
    return out


PREPROCESSORS: dict[str, Callable[[np.ndarray, np.ndarray | None], np.ndarray]] = {"ppocr": _ppocr, "unit": _unit}
WARP_PREFIX = "warp:"  # "warp:<name>": warp any frame to the model's input, then <name>


def warp(img: np.ndarray, encoding: str, height: int, width: int) -> np.ndarray:
    """A frame -> uint8 [height, width, 3] BGR: resized and, for ``nv12``, colour-converted on the CPU.

    ``img`` is the frame as ``msgs/frames.py`` ``frame_to_array`` reads it: uint8 [H, W, 3] for
    ``bgr888`` / ``rgb888``, [H * 3/2, W, 1] (or [H * 3/2, W]) for ``nv12``. It runs FFmpeg's swscale through PyAV
    (``VideoFrame.from_ndarray(...).to_ndarray(format="bgr24", width=, height=)``): its default
    bilinear scaler, and for an ``nv12`` frame, which carries no colour metadata, swscale's default
    BT.601 limited-range matrix -- the conversion ``chestnut camera`` applies to its source
    (``launch/camerad.py`` ``iter_frames``). Raises ``ValueError`` for another encoding or shape.
    """
    import av

    planes = img[:, :, 0] if img.ndim == 3 and encoding == "nv12" and img.shape[2] == 1 else img
    if encoding == "nv12":
        if planes.ndim != 2 or planes.shape[0] % 3 or planes.shape[1] % 2:
            raise ValueError(f"an nv12 frame is uint8 [H * 3/2, W] with H, W even; got {img.dtype}{list(img.shape)}")
        fmt = "nv12"
    elif encoding in ("bgr888", "rgb888"):
        if planes.ndim != 3 or planes.shape[2] != 3:
            raise ValueError(f"a {encoding} frame is uint8 [H, W, 3]; got {img.dtype}{list(img.shape)}")
        fmt = "bgr24" if encoding == "bgr888" else "rgb24"
    else:
        raise ValueError(f"cannot warp a {encoding} frame (bgr888, rgb888 or nv12)")
    if planes.dtype != np.uint8:
        raise ValueError(f"a frame is uint8, not {planes.dtype}")
    frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(planes), format=fmt)
    return np.asarray(frame.to_ndarray(format="bgr24", width=width, height=height))


@lru_cache(maxsize=8)
def warp_spec(encoding: str, src_h: int, src_w: int, dst_h: int, dst_w: int, norm: str) -> WarpSpec:
    """The :class:`WarpSpec` of one frame format (cached: its filter matrices are built once)."""
    return WarpSpec(encoding, src_h, src_w, dst_h, dst_w, norm)


def frame_geometry(img: np.ndarray, encoding: str) -> tuple[int, int]:
    """A frame's pixel height and width from its array (``nv12``: [H * 3/2, W(, 1)]). Raises ValueError."""
    if encoding == "nv12":
        if img.ndim not in (2, 3) or (img.ndim == 3 and img.shape[2] != 1) or img.shape[0] % 3 or img.shape[1] % 2:
            raise ValueError(f"an nv12 frame is uint8 [H * 3/2, W] with H, W even; got {img.dtype}{list(img.shape)}")
        return img.shape[0] * 2 // 3, img.shape[1]
    if encoding in ("bgr888", "rgb888"):
        if img.ndim != 3 or img.shape[2] != 3:
            raise ValueError(f"a {encoding} frame is uint8 [H, W, 3]; got {img.dtype}{list(img.shape)}")
        return img.shape[0], img.shape[1]
    raise ValueError(f"cannot warp a {encoding} frame (bgr888, rgb888 or nv12)")


def warp_input(norm: str, img: np.ndarray, input_shape: tuple[int, ...], encoding: str) -> np.ndarray:
    """A frame of any size -> float32 [1, 3, H, W] for ``input_shape`` (N, C, H, W), by ``backend/warp.py``.
    Raises ValueError for a frame that cannot be warped (one line)."""
    if img.dtype != np.uint8:
        raise ValueError(f"a frame is uint8, not {img.dtype}")
    h, w = frame_geometry(img, encoding)
    try:
        spec = warp_spec(encoding, h, w, int(input_shape[2]), int(input_shape[3]), norm)
    except WarpSpecError as e:
        raise ValueError(str(e)) from None
    return warp_numpy(spec, spec.check_frame(img, encoding))


def preprocess(
    name: str, img: np.ndarray, input_name: str, input_shape: tuple[int, ...], encoding: str = "bgr888",
    out: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """A frame (uint8 [H, W, 3] BGR; with ``warp:``, any :func:`warp` takes) -> ``{input_name: float32
    [1, 3, H, W]}`` for ``input_shape`` (N, C, H, W). ``encoding`` is the frame's ``CameraFrame``
    pixel encoding. ``out``: where to write the tensor when it is float32, C-contiguous, writable and of
    ``input_shape`` (the node passes the primary worker's next input slot, ``WorkerHandle.next_inputs``, so the
    request needs no copy); the result is then ``out`` itself. Any other ``out``, or a ``warp:`` preprocess,
    leaves it alone and makes a new array.

    Raises ``KeyError`` for an unknown preprocessor and ``ValueError`` when the frame does not match
    ``input_shape`` without ``warp:`` — a wrong-sized frame is rejected, never resized silently.
    """
    base = name[len(WARP_PREFIX) :] if name.startswith(WARP_PREFIX) else name
    if base not in PREPROCESSORS:
        known = sorted(PREPROCESSORS) + [WARP_PREFIX + k for k in sorted(PREPROCESSORS)]
        raise KeyError(f"unknown preprocessing {name!r}; known: {', '.join(known)}")
    if base != name:
        return {input_name: warp_input(base, img, input_shape, encoding)}
    if encoding != "bgr888":
        raise ValueError(f"a {encoding} frame needs the warp to the model's input: preprocess {WARP_PREFIX}{name}")
    if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"frame must be uint8 [H, W, 3]; got {img.dtype}{list(img.shape)}")
    want = (int(input_shape[2]), int(input_shape[3]))
    if img.shape[:2] != want:
        raise ValueError(
            f"frame is {img.shape[1]}x{img.shape[0]} (WxH), the model wants {want[1]}x{want[0]} "
            f"(WxH, from its input shape N,C,H,W {[int(d) for d in input_shape]})"
        )
    if out is not None and not (out.dtype == np.float32 and out.shape == (1, 3, *want) and out.flags.c_contiguous
                                and out.flags.writeable):
        out = None
    return {input_name: PREPROCESSORS[base](img, out)}


def primary_warp(frame: str, preprocess_name: str, shape: tuple[int, ...]) -> WarpSpec | None:
    """The warp the primary's program runs (``model.frame`` with a ``warp:<name>`` preprocess), or None.
    Raises ConfigError naming ``model.frame`` for a spec that cannot run."""
    if not frame:
        return None
    if not preprocess_name.startswith(WARP_PREFIX):
        raise ConfigError(
            "config", f"model.frame = {frame!r} needs model.preprocess = {WARP_PREFIX}<name>, not {preprocess_name!r}"
        )
    try:
        return WarpSpec.parse(frame, preprocess_name[len(WARP_PREFIX) :], int(shape[2]), int(shape[3]))
    except WarpSpecError as e:
        raise ConfigError("config", f"model.frame = {frame!r}: {e}") from None
