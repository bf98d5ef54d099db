"""The warp: a full camera frame to a model's input, as one declarative spec with two implementations.

A :class:`WarpSpec` names the source (pixel encoding ``nv12`` / ``bgr888`` / ``rgb888``, height x width),
the target (the model's input height x width) and the normalisation (``ppocr`` / ``unit``, as
``node/preprocess.py``). Its math, the same in both implementations:

1. **Resize** each plane separably with a triangle (bilinear) filter whose support widens with the
   downscale factor, so a 1928 -> 256 column resize averages every source pixel instead of sampling
   two of them: output sample ``i`` sits at source coordinate ``(i + 0.5) * S / D - 0.5`` (pixel
   centres), tap ``k`` weighs ``max(0, 1 - |k - c| / max(S / D, 1))``, a tap outside the plane reads
   the edge pixel. This is the filter of FFmpeg's ``SWS_BILINEAR``
   for downscaling (``libswscale/utils.c`` ``initFilter``), in float. An ``nv12`` frame's chroma plane
   (H/2 x W/2, U and V interleaved) is resized to the target size with its own filter: chroma sited
   at the centre of its 2x2 luma block.
2. **Colour**: ``nv12`` -> BGR with ITU-R BT.601 limited range (Kr = 0.299, Kb = 0.114, Y' in
   [16, 235] scaled by 255/219, Cb/Cr in [16, 240] by 255/224), clipped to [0, 255] -- the matrix
   FFmpeg's swscale uses for a frame without colour metadata (``launch/camerad.py`` decodes with it).
   Resizing before converting is exact: both steps are linear, only the clip is not.
3. **Normalise**: ``(x / 255 - mean) / std``, ``ppocr`` mean = std = 0.5 (rapidocr-onnxruntime 1.4.4
   ``config.yaml``), ``unit`` mean 0, std 1; NCHW float32 [1, 3, h, w], channels B, G, R.

:func:`warp_numpy` is the CPU implementation (the fallback's, and the twin GPU's: the twin runs the
model's compute on the host CPU, ``README.md``); :func:`warp_tensor` is the tinygrad one the real
runner prepends to the model inside the same JIT, so on a dock it runs on the AMD GPU. They agree to
float32 rounding: :data:`IMPLEMENTATIONS_ATOL` (``docs/warp.md``).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from chestnut.backend.model import TensorSpec

ENCODINGS = ("nv12", "bgr888", "rgb888")
NORMALISATIONS: dict[str, tuple[float, float]] = {"ppocr": (0.5, 0.5), "unit": (0.0, 1.0)}  # (mean, std) of x/255
MAX_SOURCE_SIDE = 8192  # a bound on what a spec from outside may ask for (8K UHD is 7680 wide)
MAX_TARGET_SIDE = 4096
# the warp's two implementations agree within this, in normalised units (|numpy - tinygrad|, both float32;
# measured once on the traffic video and camerad's synthetic NV12 frames: docs/warp.md, tests/test_warp.py)
IMPLEMENTATIONS_ATOL = 1e-5
# Y'CbCr -> R'G'B' for BT.601 limited range (ITU-R BT.601-7 section 2.5.3: Kr 0.299, Kb 0.114)
_KR, _KB = 0.299, 0.114
_KG = 1.0 - _KR - _KB
_YS, _CS = 255.0 / 219.0, 255.0 / 224.0
BT601_LIMITED = {
    "y": _YS,
    "r_v": _CS * 2 * (1 - _KR),
    "g_u": -_CS * 2 * (1 - _KB) * _KB / _KG,
    "g_v": -_CS * 2 * (1 - _KR) * _KR / _KG,
    "b_u": _CS * 2 * (1 - _KB),
}
WARP_MAGIC = b"CHNTWARP"  # a warped program image's header; no ONNX protobuf starts with it (0x43: a group field)
MAX_WARP_HEADER = 4096  # bytes of the warp spec's JSON in a program image
_FRAME_RE = re.compile(r"^([a-z0-9]+):(\d+)x(\d+)$")


class WarpSpecError(ValueError):
    """A warp spec that cannot run: the message is one line naming the field and the fix."""


@dataclass(frozen=True)
class WarpSpec:
    """Source ``encoding`` and ``src_h`` x ``src_w`` pixels -> float32 [1, 3, ``dst_h``, ``dst_w``] (``norm``).

    Build with :meth:`parse` (from config) or :meth:`from_json` (from the wire); both validate and
    raise :class:`WarpSpecError` with one line."""

    encoding: str
    src_h: int
    src_w: int
    dst_h: int
    dst_w: int
    norm: str

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`WarpSpecError` unless the encoding, sizes and normalisation can run."""
        if self.encoding not in ENCODINGS:
            raise WarpSpecError(f"warp source encoding {self.encoding!r} is unknown; use one of {', '.join(ENCODINGS)}")
        if self.norm not in NORMALISATIONS:
            raise WarpSpecError(f"warp normalisation {self.norm!r} is unknown; use one of {', '.join(NORMALISATIONS)}")
        sides = {"source width": self.src_w, "source height": self.src_h}
        for what, v in sides.items():
            if not isinstance(v, int) or not 0 < v <= MAX_SOURCE_SIDE:
                raise WarpSpecError(f"warp {what} {v!r}: want 1..{MAX_SOURCE_SIDE} pixels")
        for what, v in {"target width": self.dst_w, "target height": self.dst_h}.items():
            if not isinstance(v, int) or not 0 < v <= MAX_TARGET_SIDE:
                raise WarpSpecError(f"warp {what} {v!r}: want 1..{MAX_TARGET_SIDE} pixels")
        if self.encoding == "nv12" and (self.src_w % 2 or self.src_h % 2):
            raise WarpSpecError(
                f"an nv12 source is {self.src_w}x{self.src_h} (WxH): 4:2:0 chroma needs an even width and height"
            )

    @classmethod
    def parse(cls, frame: str, norm: str, dst_h: int, dst_w: int) -> WarpSpec:
        """``frame`` as ``"<encoding>:<W>x<H>"`` (e.g. ``"nv12:1928x1208"``, the node's ``model.frame``)."""
        m = _FRAME_RE.match(frame.strip())
        if m is None:
            raise WarpSpecError(f"frame {frame!r}: write it as <encoding>:<W>x<H>, e.g. nv12:1928x1208")
        return cls(m.group(1), int(m.group(3)), int(m.group(2)), int(dst_h), int(dst_w), norm)

    def to_json(self) -> dict[str, Any]:
        return {
            "encoding": self.encoding,
            "src_h": self.src_h,
            "src_w": self.src_w,
            "dst_h": self.dst_h,
            "dst_w": self.dst_w,
            "norm": self.norm,
        }

    @classmethod
    def from_json(cls, d: Any) -> WarpSpec:
        """Raises :class:`WarpSpecError` for a missing or mistyped field."""
        if not isinstance(d, dict):
            raise WarpSpecError(f"a warp spec is a JSON object, not {type(d).__name__}")
        try:
            ints = {k: d[k] for k in ("src_h", "src_w", "dst_h", "dst_w")}
            enc, norm = d["encoding"], d["norm"]
        except KeyError as e:
            raise WarpSpecError(f"warp spec without {e.args[0]!r}") from None
        if not all(type(v) is int for v in ints.values()) or not isinstance(enc, str) or not isinstance(norm, str):
            raise WarpSpecError(f"warp spec {d!r}: sizes are integers, encoding and norm strings")
        return cls(enc, ints["src_h"], ints["src_w"], ints["dst_h"], ints["dst_w"], norm)

    @property
    def frame(self) -> str:
        return f"{self.encoding}:{self.src_w}x{self.src_h}"

    @property
    def frame_shape(self) -> tuple[int, ...]:
        """The raw frame as the primary takes it: uint8 [H * 3/2, W] (``nv12``) or [H, W, 3]."""
        if self.encoding == "nv12":
            return (self.src_h * 3 // 2, self.src_w)
        return (self.src_h, self.src_w, 3)

    @property
    def output_shape(self) -> tuple[int, int, int, int]:
        return (1, 3, self.dst_h, self.dst_w)

    def frame_spec(self, name: str) -> TensorSpec:
        return TensorSpec(name, self.frame_shape, "uint8")

    def output_spec(self, name: str) -> TensorSpec:
        return TensorSpec(name, self.output_shape, "float32")

    def check_frame(self, img: np.ndarray, encoding: str) -> np.ndarray:
        """``img`` (a ``CameraFrame`` as ``msgs/frames.py`` reads it; an nv12 one may carry a trailing axis
        of 1) as :attr:`frame_shape`, without a copy. Raises ValueError naming both formats."""
        a = img[:, :, 0] if self.encoding == "nv12" and img.ndim == 3 and img.shape[2] == 1 else img
        if encoding != self.encoding or a.dtype != np.uint8 or tuple(a.shape) != self.frame_shape:
            raise ValueError(
                f"frame is {encoding} {a.dtype}{list(a.shape)}, the warp on the primary takes {self.frame} "
                f"(uint8{list(self.frame_shape)}): set model.frame to the camera's format"
            )
        return a

    # ------------------------------------------------------------------ the filter (constants of the spec)
    @cached_property
    def weights(self) -> dict[str, np.ndarray]:
        """The resize matrices, float32 [target, source]: ``y``/``x`` for luma (or RGB), ``cy``/``cx`` for chroma."""
        w = {"y": filter_matrix(self.src_h, self.dst_h), "x": filter_matrix(self.src_w, self.dst_w)}
        if self.encoding == "nv12":
            w["cy"] = filter_matrix(self.src_h // 2, self.dst_h)
            w["cx"] = filter_matrix(self.src_w // 2, self.dst_w)
        return w

    @cached_property
    def bands(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """:attr:`weights` as taps (:func:`band`), for the CPU implementation."""
        return {k: band(v) for k, v in self.weights.items()}


def band(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A filter matrix [dst, src] as its taps: (source indices int [dst, T], weights float32 [dst, T]), T the
    widest row's support; the same sums as the matrix product, without its zeros."""
    nz = w != 0
    lo = nz.argmax(axis=1)
    hi = w.shape[1] - nz[:, ::-1].argmax(axis=1)
    taps = int((hi - lo).max())
    idx = np.minimum(lo, w.shape[1] - taps)[:, None] + np.arange(taps)
    return idx, np.take_along_axis(w, idx, axis=1)


def filter_matrix(src: int, dst: int) -> np.ndarray:
    """The triangle filter of the module docstring as a dense float32 [dst, src] matrix whose rows sum to 1."""
    scale = src / dst
    support = max(scale, 1.0)
    centre = (np.arange(dst, dtype=np.float64) + 0.5) * scale - 0.5
    pad = int(np.ceil(support)) + 1
    taps = np.arange(-pad, src + pad, dtype=np.float64)
    w = np.clip(1.0 - np.abs(taps[None, :] - centre[:, None]) / support, 0.0, None)
    out = np.zeros((dst, src), np.float64)
    np.add.at(out.T, np.clip(taps.astype(int), 0, src - 1), w.T)  # a tap past the edge reads the edge pixel
    return (out / out.sum(axis=1, keepdims=True)).astype(np.float32)


def _bgr_from_yuv(y: Any, u: Any, v: Any) -> tuple[Any, Any, Any]:
    """B, G, R from resized Y', Cb, Cr planes (numpy arrays or tinygrad Tensors; not yet clipped)."""
    c = BT601_LIMITED
    yy, d, e = (y - 16.0) * c["y"], u - 128.0, v - 128.0
    return yy + d * c["b_u"], yy + d * c["g_u"] + e * c["g_v"], yy + e * c["r_v"]


def warp_numpy(spec: WarpSpec, frame: np.ndarray) -> np.ndarray:
    """The warp on the CPU: uint8 ``spec.frame_shape`` -> float32 [1, 3, dst_h, dst_w]. Raises ValueError for
    another shape or dtype."""
    if frame.dtype != np.uint8 or tuple(frame.shape) != spec.frame_shape:
        raise ValueError(
            f"the warp of {spec.frame} takes uint8{list(spec.frame_shape)}, got {frame.dtype}{list(frame.shape)}"
        )
    w = spec.bands

    def resize(plane: np.ndarray, by: tuple[np.ndarray, np.ndarray], bx: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """[H, W(, C)] -> [h, w(, C)]: each output row / column from its filter's taps only."""
        rows = np.einsum("ht,htw...->hw...", by[1], plane[by[0]].astype(np.float32), optimize=True)
        return np.einsum("wt,hwt...->hw...", bx[1], rows[:, bx[0]], optimize=True)

    if spec.encoding == "nv12":
        h = spec.src_h
        y = resize(frame[:h], w["y"], w["x"])
        uv = resize(frame[h:].reshape(h // 2, spec.src_w // 2, 2), w["cy"], w["cx"])
        bgr = np.stack(_bgr_from_yuv(y, uv[..., 0], uv[..., 1]))
        bgr = np.clip(bgr, 0.0, 255.0)
    else:
        rgb = resize(frame, w["y"], w["x"])  # [h, w, 3]
        bgr = np.moveaxis(rgb if spec.encoding == "bgr888" else rgb[..., ::-1], 2, 0)
    mean, std = NORMALISATIONS[spec.norm]
    out = (bgr.astype(np.float32) * np.float32(1 / 255.0) - np.float32(mean)) / np.float32(std)
    return np.ascontiguousarray(out[None], dtype=np.float32)


def warp_tensor(spec: WarpSpec, frame: Any) -> Any:
    """The warp in tinygrad: a uint8 ``Tensor`` of ``spec.frame_shape`` -> float32 ``Tensor`` [1, 3, dst_h, dst_w].

    Pure Tensor ops (two matmuls per plane with the spec's constant filter matrices, the BT.601 matrix,
    the normalisation), so inside a ``TinyJit`` it runs on the frame's device with the model."""
    from tinygrad import Tensor, dtypes

    dev = frame.device
    w = {k: Tensor(v, device=dev) for k, v in spec.weights.items()}
    x = frame.cast(dtypes.float32)
    if spec.encoding == "nv12":
        h = spec.src_h
        y = w["y"] @ x[:h] @ w["x"].T
        uv = x[h:].reshape(h // 2, spec.src_w // 2, 2)
        u = w["cy"] @ uv[:, :, 0] @ w["cx"].T
        v = w["cy"] @ uv[:, :, 1] @ w["cx"].T
        bgr = Tensor.stack(*_bgr_from_yuv(y, u, v)).clip(0.0, 255.0)
    else:
        chans = [w["y"] @ x[:, :, c] @ w["x"].T for c in range(3)]
        bgr = Tensor.stack(*(chans if spec.encoding == "bgr888" else chans[::-1]))
    mean, std = NORMALISATIONS[spec.norm]
    return ((bgr * (1 / 255.0) - mean) / std).reshape(spec.output_shape).cast(dtypes.float32)


# ------------------------------------------------------------------ the program image
def warp_program(spec: WarpSpec, onnx_bytes: bytes) -> bytes:
    """The program image of ``onnx_bytes`` behind the warp ``spec`` (the OP_LOAD format above)."""
    doc = json.dumps(spec.to_json()).encode()
    return WARP_MAGIC + struct.pack("<I", len(doc)) + doc + onnx_bytes


def split_program(image: bytes) -> tuple[WarpSpec | None, bytes]:
    """A program image -> (its warp spec or None, the ONNX bytes). Raises WarpSpecError for a bad header."""
    if not image.startswith(WARP_MAGIC):
        return None, image
    head = len(WARP_MAGIC) + 4
    if len(image) < head:
        raise WarpSpecError("a warped program ends inside its header")
    (n,) = struct.unpack_from("<I", image, len(WARP_MAGIC))
    if not 0 < n <= MAX_WARP_HEADER or head + n > len(image):
        raise WarpSpecError(f"a warped program's spec is {n} bytes (1..{MAX_WARP_HEADER}, inside the image)")
    try:
        doc = json.loads(image[head : head + n])
    except ValueError as e:
        raise WarpSpecError(f"a warped program's spec is not JSON: {e}") from None
    return WarpSpec.from_json(doc), image[head + n :]
