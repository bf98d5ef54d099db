"""The warp (``backend/warp.py``): its spec, its two implementations (numpy for the fallback and the twin's
GPU, tinygrad for the real dock's JIT) and the warped program on the twin, where the full frame crosses
the copy path every frame (``docs/warp.md``)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from twinfixtures import twin_fixtures

from chestnut.backend.errors import ModelError
from chestnut.backend.interface import ModelSpec
from chestnut.backend.ladder import LadderConfig
from chestnut.backend.model import OnnxModel, ensure_cpu_device
from chestnut.backend.twin_runner import TwinRunner
from chestnut.backend.warp import (
    BT601_LIMITED,
    IMPLEMENTATIONS_ATOL,
    WarpSpec,
    WarpSpecError,
    filter_matrix,
    split_program,
    warp_numpy,
    warp_program,
    warp_tensor,
)
from chestnut.launch.assets import traffic_video_path
from chestnut.launch.camerad import iter_frames, synthetic_frames
from chestnut.node.preprocess import preprocess

pytestmark = pytest.mark.timeout(120)
PREFIX = f"t{os.getpid()}-warp"
NV12_FULL = (1208, 1928)  # openpilot's road camera: 1812 x 1928 bytes of NV12 = 3,493,536


def test_the_filter_rows_sum_to_one_and_average_every_source_pixel_on_a_downscale():
    w = filter_matrix(1928, 256)
    assert w.shape == (256, 1928) and w.dtype == np.float32
    assert np.abs(w.sum(axis=1) - 1).max() < 1e-6
    assert (w.sum(axis=0) > 0).all()  # no source column is skipped (a 2-tap bilinear would skip 3 in 4)
    assert np.array_equal(filter_matrix(4, 4), np.eye(4, dtype=np.float32))  # same size: the identity


@pytest.mark.parametrize("yuv", [(16, 128, 128), (235, 128, 128), (126, 90, 200), (81, 240, 16)])
def test_a_flat_nv12_frame_gets_the_bt601_limited_range_colour(yuv):
    y, u, v = yuv
    frame = np.empty((96, 64), np.uint8)
    frame[:64], frame[64:, 0::2], frame[64:, 1::2] = y, u, v
    got = warp_numpy(WarpSpec("nv12", 64, 64, 16, 32, "unit"), frame)[0] * 255
    c, d, e = BT601_LIMITED["y"] * (y - 16), u - 128, v - 128
    want = np.clip(
        [
            c + BT601_LIMITED["b_u"] * d,
            c + BT601_LIMITED["g_u"] * d + BT601_LIMITED["g_v"] * e,
            c + BT601_LIMITED["r_v"] * e,
        ],
        0,
        255,
    )
    assert np.abs(got - np.asarray(want)[:, None, None]).max() < 1e-3
    if yuv[0] in (16, 235):  # black and white exactly (Rec. 601 limited range)
        assert np.abs(got - (0 if y == 16 else 255)).max() < 1e-3


def _frames() -> list[tuple[str, np.ndarray]]:
    video = traffic_video_path()
    nv12 = iter_frames(video, None, None, loop=False, pixel_format="nv12")
    bgr = iter_frames(video, None, None, loop=False)
    synth = synthetic_frames(*NV12_FULL, "nv12")
    return [("nv12", next(nv12)), ("bgr888", next(bgr)), ("nv12", next(synth)), ("nv12", next(synth))]


def test_the_tinygrad_warp_is_the_numpy_warp_on_real_and_synthetic_frames():
    """The traffic video (704x576, NV12 and BGR) and camerad's synthetic 1928x1208 NV12 frames: the two
    implementations agree within IMPLEMENTATIONS_ATOL (1e-5 of the normalised input; measured: 8.9e-7)."""
    ensure_cpu_device()
    from tinygrad import Tensor

    for encoding, frame in _frames():
        h = frame.shape[0] * 2 // 3 if encoding == "nv12" else frame.shape[0]
        spec = WarpSpec(encoding, h, frame.shape[1], 128, 256, "ppocr")
        want = warp_numpy(spec, frame)
        got = warp_tensor(spec, Tensor(frame)).numpy()
        assert got.shape == want.shape == (1, 3, 128, 256) and got.dtype == np.float32
        assert np.abs(got - want).max() <= IMPLEMENTATIONS_ATOL, (encoding, frame.shape)
        assert want.min() >= -1 and want.max() <= 1
        if encoding == "bgr888":  # the same pixels as RGB: the same input
            rgb = WarpSpec("rgb888", h, frame.shape[1], 128, 256, "ppocr")
            assert np.array_equal(warp_numpy(rgb, np.ascontiguousarray(frame[..., ::-1])), want)


def test_warp_preprocess_is_the_numpy_warp_for_any_frame_size():
    frame = next(synthetic_frames(*NV12_FULL, "nv12"))
    x = preprocess("warp:ppocr", frame[:, :, None], "x", (1, 3, 128, 256), "nv12")["x"]
    assert np.array_equal(x, warp_numpy(WarpSpec("nv12", *NV12_FULL, 128, 256, "ppocr"), frame))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: WarpSpec.parse("nv12:1927x1208", "ppocr", 128, 256),
            "an nv12 source is 1927x1208 (WxH): 4:2:0 chroma needs an even width and height",
        ),
        (
            lambda: WarpSpec.parse("yuyv:1928x1208", "ppocr", 128, 256),
            "warp source encoding 'yuyv' is unknown; use one of nv12, bgr888, rgb888",
        ),
        (
            lambda: WarpSpec.parse("nv12 1928x1208", "ppocr", 128, 256),
            "frame 'nv12 1928x1208': write it as <encoding>:<W>x<H>, e.g. nv12:1928x1208",
        ),
        (
            lambda: WarpSpec.parse("nv12:1928x1208", "imagenet", 128, 256),
            "warp normalisation 'imagenet' is unknown; use one of ppocr, unit",
        ),
        (lambda: WarpSpec.parse("bgr888:9000x1208", "unit", 128, 256), "warp source width 9000: want 1..8192 pixels"),
        (lambda: WarpSpec("nv12", 1208, 1928, 0, 256, "unit"), "warp target height 0: want 1..4096 pixels"),
        (lambda: WarpSpec.from_json({"encoding": "nv12", "src_h": 2}), "warp spec without 'src_w'"),
        (
            lambda: split_program(b"CHNTWARP\xff\xff\x00\x00"),
            "a warped program's spec is 65535 bytes (1..4096, inside the image)",
        ),
    ],
)
def test_a_bad_warp_spec_is_one_line(build, message):
    with pytest.raises(WarpSpecError) as e:
        build()
    assert str(e.value) == message


def test_a_program_image_carries_its_warp_and_the_onnx_bytes_unchanged():
    spec = WarpSpec("nv12", *NV12_FULL, 32, 64, "unit")
    assert split_program(warp_program(spec, b"\x08\x08onnx")) == (spec, b"\x08\x08onnx")
    assert split_program(b"\x08\x08onnx") == (None, b"\x08\x08onnx")


# ------------------------------------------------------------------ the warped program on the twin
daemon, dock = twin_fixtures(PREFIX)


def new_runner() -> TwinRunner:
    cfg = LadderConfig(stability_window_s=0.05, wait_timeout_ms=3000)
    return TwinRunner(PREFIX, wait_timeout_ms=3000, config=cfg)  # tinygrad 0.14's own copy path


def test_the_twin_warps_the_full_frame_that_crossed_the_copy_path(dock, tiny_onnx):
    spec = WarpSpec("nv12", *NV12_FULL, 32, 64, "unit")
    cpu = OnnxModel(tiny_onnx, name="tiny")
    frames = synthetic_frames(*NV12_FULL, "nv12")
    with new_runner() as r:
        ins, outs = r.load(ModelSpec(tiny_onnx, "tiny", {"x": (1, 3, 32, 64)}, warp=spec))
        assert [(s.name, s.shape, s.dtype) for s in ins] == [("x", (1812, 1928), "uint8")]
        assert [(s.name, s.shape, s.dtype) for s in r.model_inputs] == [("x", (1, 3, 32, 64), "float32")]
        assert r.signature["warp"] == spec.to_json() and r.signature["sha256"] == cpu.sha256
        for _ in range(2):
            frame = next(frames)
            got = r.run({"x": frame})
            assert r.copy_in_bytes == 1812 * 1928 == 3_493_536  # the full frame, every frame
            last = dock.status()["gpu"]["last_run"]
            assert last == {"program": 1, "input_bytes": 3_493_536, "warp": "nv12:1928x1208"}
            # the twin's GPU runs tinygrad's CPU kernels on the numpy warp: bit-exact with the host
            assert np.array_equal(got["prob"], cpu.run({"x": warp_numpy(spec, frame)})["prob"])
        x = np.random.default_rng(0).standard_normal((1, 3, 32, 64)).astype(np.float32)
        assert np.array_equal(r.run({"x": x})["prob"], cpu.run({"x": x})["prob"])  # the model alone (warm-up)
        assert r.copy_in_bytes == x.nbytes and dock.status()["gpu"]["last_run"]["program"] == 2
        with pytest.raises(ModelError, match=r"input 'x': got uint8\[1208, 1928\], want uint8\[1812, 1928\]"):
            r.run({"x": np.zeros(NV12_FULL, np.uint8)})


def test_a_warp_that_does_not_make_the_models_input_fails_to_load_in_one_line(dock, tiny_onnx):
    with new_runner() as r, pytest.raises(ModelError) as e:
        r.load(ModelSpec(tiny_onnx, "tiny", warp=WarpSpec("bgr888", 576, 704, 64, 64, "unit")))
    assert e.value.detail.endswith(
        "WarpSpecError: the warp makes float32[1, 3, 64, 64]; the model's inputs are x float32[1, 3, 32, 64]"
    ), e.value.detail


# ------------------------------------------------------------------ the warp inside the real runner's JIT
def test_the_real_runners_jit_warps_then_runs_the_model_in_one_graph(tiny_onnx, tmp_path):
    """``load_or_build_jit`` with a warp, on the host CPU (the same code path as the dock's ``AMD``): the
    captured JIT takes the raw NV12 frame and gives the model's output on its warp, cached under its own key."""
    ensure_cpu_device()
    from chestnut.backend.jitcache import JitCache
    from chestnut.backend.real_runner import dock_cache_key, load_or_build_jit

    spec = WarpSpec("nv12", 576, 704, 32, 64, "unit")
    onnx = tiny_onnx.read_bytes()
    frame_in = (spec.frame_spec("x"),)
    cache = JitCache(tmp_path / "cache")
    dj = load_or_build_jit(onnx, "tiny", frame_in, "CPU", "host", cache, warp=spec)
    assert dj.built and dj.outputs[0].shape == (1, 1, 16, 32)
    assert dj.key != dock_cache_key(onnx, frame_in, "CPU", "host")  # the program image's key, not the model's
    cpu = OnnxModel(tiny_onnx, name="tiny")
    frame = next(iter_frames(traffic_video_path(), None, None, loop=False, pixel_format="nv12"))
    want = cpu.run({"x": warp_numpy(spec, frame)})["prob"]
    np.testing.assert_allclose(dj.call({"x": frame})["prob"], want, rtol=0, atol=1e-5)
    again = load_or_build_jit(onnx, "tiny", frame_in, "CPU", "host", cache, warp=spec)
    assert not again.built  # from the compile cache, verified
    np.testing.assert_allclose(again.call({"x": frame})["prob"], want, rtol=0, atol=1e-5)


def test_a_warp_the_model_cannot_take_is_one_model_error():
    from chestnut.backend.model import TensorSpec
    from chestnut.backend.real_runner import warped_input

    spec = WarpSpec("nv12", *NV12_FULL, 128, 256, "ppocr")
    assert warped_input(spec, (TensorSpec("x", (1, 3, 128, 256), "float32"),)) == TensorSpec("x", (1812, 1928), "uint8")
    with pytest.raises(ModelError) as e:
        warped_input(spec, (TensorSpec("x", (1, 3, 32, 64), "float32"),))
    assert (e.value.reason, e.value.detail) == (
        "bad_warp",
        "the warp makes float32[1, 3, 128, 256]; the model's inputs are x float32[1, 3, 32, 64]",
    )


# ------------------------------------------------------------------ the node's side: model.frame and bad frames
def test_model_frame_is_checked_when_the_config_is_loaded(tmp_path):
    from chestnut.backend.errors import ConfigError
    from chestnut.node.config import load_config

    def load(frame: str, preprocess: str = "warp:ppocr") -> str:
        path = tmp_path / "node.toml"
        path.write_text(f'[model]\npreprocess = "{preprocess}"\nframe = "{frame}"\n')
        with pytest.raises(ConfigError) as e:
            load_config(path)
        return e.value.detail

    assert load("nv12:1927x1208") == (
        "model.frame = 'nv12:1927x1208': an nv12 source is 1927x1208 (WxH): 4:2:0 chroma needs an even width and height"
    )
    assert load("gray8:640x480") == (
        "model.frame = 'gray8:640x480': warp source encoding 'gray8' is unknown; use one of nv12, bgr888, rgb888"
    )
    assert (
        load("nv12:1928x1208", "ppocr")
        == "model.frame = 'nv12:1928x1208' needs model.preprocess = warp:<name>, not 'ppocr'"
    )
    path = tmp_path / "node.toml"
    path.write_text('[model]\npreprocess = "warp:ppocr"\nframe = "nv12:1928x1208"\n')
    assert load_config(path).model.frame == "nv12:1928x1208"


def test_a_frame_of_another_format_than_model_frame_is_one_line():
    from chestnut.node.main import primary_inputs
    from chestnut.node.preprocess import primary_warp

    spec = primary_warp("nv12:1928x1208", "warp:ppocr", (1, 3, 128, 256))
    assert spec == WarpSpec("nv12", *NV12_FULL, 128, 256, "ppocr")
    assert primary_warp("", "warp:ppocr", (1, 3, 128, 256)) is None  # no model.frame: the CPU warps for both
    with pytest.raises(ValueError) as e:
        spec.check_frame(np.zeros((576, 704, 3), np.uint8), "bgr888")
    assert str(e.value) == (
        "frame is bgr888 uint8[576, 704, 3], the warp on the primary takes nv12:1928x1208 (uint8[1812, 1928]): "
        "set model.frame to the camera's format"
    )
    full = spec.check_frame(np.zeros((1812, 1928, 1), np.uint8), "nv12")  # a CameraFrame's trailing axis of 1
    assert full.shape == (1812, 1928)
    warped = {"x": np.zeros((1, 3, 128, 256), np.float32)}
    assert primary_inputs((spec.frame_spec("x"),), warped, full)["x"] is full  # a primary that warps
    model_in = (spec.output_spec("x"),)
    assert primary_inputs(model_in, warped, full) is warped  # a runner that does not warp gets the CPU's input
    assert primary_inputs((spec.frame_spec("x"),), warped, None) is warped


def test_the_tinygrad_warp_keeps_a_model_within_the_agreement_tolerance(tmp_path):
    """Hot standby on a dock: the primary's outputs on its GPU warp against the fallback's on the CPU warp, by
    the node's agreement rule (|a - b| <= max(tol, tol * max(|a|, |b|)), ``timing.agreement_tol`` 1e-3). The
    tiny model's margin here; the PP-OCRv4 detector's, measured: 1/580 of the tolerance (docs/warp.md)."""
    ensure_cpu_device()
    from tinygrad import Tensor
    from tinymodel import make_tiny_onnx

    from chestnut.node.config import TimingConfig

    tol = TimingConfig().agreement_tol
    model = OnnxModel(make_tiny_onnx(tmp_path / "tiny128.onnx", 128, 256), name="tiny128")
    for encoding, frame in _frames()[:3]:
        h = frame.shape[0] * 2 // 3 if encoding == "nv12" else frame.shape[0]
        spec = WarpSpec(encoding, h, frame.shape[1], 128, 256, "ppocr")
        a = model.run({"x": warp_tensor(spec, Tensor(frame)).numpy()})["prob"]
        b = model.run({"x": warp_numpy(spec, frame)})["prob"]
        assert (np.abs(a - b) <= 0.01 * np.maximum(tol, tol * np.maximum(np.abs(a), np.abs(b)))).all()
