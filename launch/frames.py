"""``chestnut launch``'s frame options: what the camera (``launch/camerad.py``) and the twin are told about the
frames (:class:`FrameOptions`, from the arguments and the node TOML: :func:`frame_options`), the checks that
refuse a node configuration before anything starts (:func:`model_input_problem`), and this run's own node
configuration when the frames need the warp (:func:`write_frame_node_config`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from chestnut.msgs.argtypes import (
    MAX_DOCK_LATENCY_US,
    MAX_LINK_MBPS,
    MIN_FRAME_RATE_HZ,
    MIN_LINK_MBPS,
    checked_float,
    dock_latency_us,
    link_mbps,
)

MAX_RATE_HZ = 100.0
"""``chestnut launch --rate`` upper bound, Hz (``chestnut control --frame-rate`` takes the same range): five times
openpilot's 20 Hz model rate (``msgs/services.py``), a 10 ms frame period. The stack's figures (deadlines,
freq_ok, missing outputs) are about the node, not about a camera that cannot keep its own grid: far above it the
camera only skips ticks (``launch/camerad.py`` ``ticks_to_skip``) and every contract fails by construction. The
lower bound is the camera's own (``msgs/argtypes.py`` ``MIN_FRAME_RATE_HZ``, 1 Hz)."""
RATE_WANT = f"give a camera rate in [{MIN_FRAME_RATE_HZ:g}, {MAX_RATE_HZ:g}] Hz (default 20, openpilot's model rate)"


def launch_rate_hz(text: str) -> float:
    """``--rate``: Hz in [``MIN_FRAME_RATE_HZ``, :data:`MAX_RATE_HZ`]; raises ``argparse.ArgumentTypeError``."""
    return checked_float(text, lambda hz: MIN_FRAME_RATE_HZ <= hz <= MAX_RATE_HZ, RATE_WANT)


FRAME_SIZES = ("model", "native")
"""``--frames``: ``model`` -- the camera resizes to the model's input (``[model] shape`` H, W);
``native`` -- the source's own size (``launch/camerad.py`` ``--native``), warped to the model's input by the
primary's program or the node (``--warp``; ``node/preprocess.py`` ``warp:``, ``primary_warp``)."""
DOCK_LINK_MBPS = 5600.0
"""``--dock-timing`` link rate, Mbps: the asm2464 firmware's ~700 MB/s ``0xF2`` SRAM DMA
(``docs/protocol.md``, the twin's timing model; ``tests/bench/bench_copy.py`` measures with it)."""
DOCK_LATENCY_US = 125.0
"""``--dock-timing`` per-transfer latency, us: one USB 3 bus interval (``docs/protocol.md``)."""


def add_dock_timing_arguments(p: argparse.ArgumentParser) -> None:
    """``chestnut launch``'s ``--dock-timing``, ``--link-mbps`` and ``--latency-us``; the two numbers take the
    types ``chestnut twin serve`` takes (``msgs/argtypes.py`` ``link_mbps``, ``dock_latency_us``: one line, exit
    2, for a number out of their bounds)."""
    p.add_argument(
        "--dock-timing", action="store_true",
        help=f"the twin's dock-like timing model: each USB transfer takes --latency-us plus its bytes at "
        f"--link-mbps (defaults {DOCK_LINK_MBPS:g} Mbps, {DOCK_LATENCY_US:g} us: docs/protocol.md)",
    )
    p.add_argument("--link-mbps", type=link_mbps, help=f"with --dock-timing: link rate, Mbps (default "
                   f"{DOCK_LINK_MBPS:g}, {MIN_LINK_MBPS:g} to {MAX_LINK_MBPS:g})")
    p.add_argument("--latency-us", type=dock_latency_us, help=f"with --dock-timing: per-transfer latency, us (default "
                   f"{DOCK_LATENCY_US:g}, at most {MAX_DOCK_LATENCY_US:g})")


@dataclasses.dataclass(frozen=True)
class FrameOptions:
    """What ``chestnut launch`` tells the camera (``launch/camerad.py``) and the twin about the frames.

    ``model_hw``: the model input's (H, W) in px, from the node configuration's ``[model] shape``;
    ``preprocess``: its ``[model] preprocess``; ``model_frame``: its ``[model] frame`` (``""``: none);
    ``dock_kind``: its ``[dock] kind``. ``link_mbps`` (Mbps) and ``latency_us`` (us) None: the
    ``--dock-timing`` defaults (:data:`DOCK_LINK_MBPS`, :data:`DOCK_LATENCY_US`); their bounds are checked as
    argparse reads them, by the types ``chestnut twin serve`` takes too (``msgs/argtypes.py``). ``native_hw``: the
    source's own (H, W) in px for ``--frames native`` without ``--synthetic`` (``launch/camerad.py``
    ``source_size``). ``warp_on``: ``primary`` -- the primary's program takes the full frame and warps it
    (``[model] frame``, ``node/preprocess.py`` ``primary_warp``), so the full frame crosses the copy path
    every frame; ``node`` -- the node warps and the primary takes the model's input."""

    frames: str = "model"
    synthetic: bool = False
    pixel_format: str = "bgr24"
    transport: str = "auto"
    dock_timing: bool = False
    link_mbps: float | None = None
    latency_us: float | None = None
    model_hw: tuple[int, int] = (128, 256)
    preprocess: str = "ppocr"
    dock_kind: str = "twin"
    warp_on: str = "primary"
    native_hw: tuple[int, int] | None = None
    model_frame: str = ""
    warp_given: bool = False
    rate_hz: float = 20.0              # --rate: the camera's
    node_frame_period_ms: float = 50.0  # the node TOML's [timing] frame_period_ms (node/config.py's default)

    def problem(self) -> str | None:
        """The one line that refuses these options together, or None when they can run."""
        if self.warp_given and not self.warp:
            return (
                f"--warp {self.warp_on} refused: the camera's frames are already the model's input (--frames model, "
                "--pixel-format bgr24), so nothing is warped; add --frames native or --pixel-format nv12 for frames "
                "that need the warp, or leave --warp out"
            )
        if not self.dock_timing and (self.link_mbps is not None or self.latency_us is not None):
            given = "--link-mbps" if self.link_mbps is not None else "--latency-us"
            return f"{given} sets the twin's dock-like timing model: add --dock-timing (or leave {given} out)"
        if self.dock_timing and self.dock_kind != "twin":
            return (
                f"--dock-timing is the twin's timing model, and the node configuration's dock.kind is "
                f'{self.dock_kind!r}: leave --dock-timing out or use a configuration with dock.kind = "twin"'
            )
        if self.warp and self.model_frame and self.model_frame != self.frame_format():
            return (
                f"the node configuration's model.frame = {self.model_frame!r} is not the camera's frames "
                f"({self.frame_format()}): leave model.frame out (chestnut launch sets it) or change --frames / "
                "--pixel-format"
            )
        h, w = self.model_hw
        if self.frames == "model" and self.pixel_format == "nv12" and (h % 2 or w % 2):
            return (
                f"--pixel-format nv12 --frames model: an nv12 frame has an even width and height, the model's "
                f"input is {w}x{h} (WxH); use --frames native or --pixel-format bgr24"
            )
        return None

    @property
    def warp(self) -> bool:
        """The node must warp the frames to the model's input: they are not the model's size or not BGR."""
        return self.frames == "native" or self.pixel_format != "bgr24"

    @property
    def frame_hw(self) -> tuple[int, int]:
        """The camera's frame (H, W) in px: the model's input, the synthetic frame's or the source's own."""
        if self.frames == "model":
            return self.model_hw
        if self.synthetic:  # the camera's own size for it: one constant (launch/camerad.py SYNTHETIC_NATIVE_HW)
            from chestnut.launch.camerad import SYNTHETIC_NATIVE_HW

            return SYNTHETIC_NATIVE_HW
        if self.native_hw is None:
            raise ValueError("--frames native: the source's size is not known")
        return self.native_hw

    def frame_format(self) -> str:
        """The camera's frames as ``[model] frame`` names them: ``<encoding>:<W>x<H>`` (``backend/warp.py``
        ``WarpSpec.parse``), e.g. ``nv12:1928x1208``."""
        h, w = self.frame_hw
        return f"{'nv12' if self.pixel_format == 'nv12' else 'bgr888'}:{w}x{h}"

    def camera_args(self) -> list[str]:
        """``chestnut camera``'s arguments beyond ``--rate``."""
        if self.frames == "native" and self.synthetic:  # the size the node's [model] frame names, said explicitly
            h, w = self.frame_hw
            args = ["--synthetic", "--height", str(h), "--width", str(w)]
        elif self.frames == "native":
            args = ["--native"]
        else:
            size = ["--height", str(self.model_hw[0]), "--width", str(self.model_hw[1])]
            args = ["--synthetic", *size] if self.synthetic else size
        return [*args, "--pixel-format", self.pixel_format, "--transport", self.transport]

    def twin_args(self) -> list[str]:
        """``chestnut twin serve``'s timing-model arguments (none without ``--dock-timing``)."""
        if not self.dock_timing:
            return []
        mbps = DOCK_LINK_MBPS if self.link_mbps is None else self.link_mbps
        lat = DOCK_LATENCY_US if self.latency_us is None else self.latency_us
        return ["--link-mbps", f"{mbps:g}", "--latency-us", f"{lat:g}"]

    def node_preprocess(self) -> str:
        """The node's ``[model] preprocess`` for these frames: ``warp:<name>`` when they need the warp."""
        if self.warp and not self.preprocess.startswith("warp:"):
            return "warp:" + self.preprocess
        return self.preprocess

    def node_model_frame(self) -> str:
        """The node's ``[model] frame``: the camera's frame format when the primary warps, else as given."""
        return self.frame_format() if self.warp and self.warp_on == "primary" else self.model_frame

    @property
    def node_config_changes(self) -> dict[str, str]:
        """The ``[model]`` keys this run's node configuration changes (empty: the given one runs as it is)."""
        want = {"preprocess": self.node_preprocess(), "frame": self.node_model_frame()}
        have = {"preprocess": self.preprocess, "frame": self.model_frame}
        return {k: v for k, v in want.items() if v != have[k]}

    @property
    def node_timing_changes(self) -> dict[str, float]:
        """The ``[timing]`` keys this run's node configuration changes: ``frame_period_ms``, the camera's period at
        ``--rate`` (the node shares it out among the primary's stages and bounds its runs by it: ``node/health.py``
        ``StageBudget``; the adaptive deadline aims inside it: ``node/deadline.py``), when the TOML's differs."""
        period_ms = 1000.0 / self.rate_hz
        return {} if abs(period_ms - self.node_frame_period_ms) < 1e-9 else {"frame_period_ms": period_ms}


def read_node_toml(path: Path | None) -> dict[str, Any]:
    """The node TOML ``chestnut launch`` gives the node (``path``, else ``launch/node.toml`` when present) as a
    table; raises :class:`~chestnut.backend.errors.ConfigError` (one line) for one that cannot be read: read as
    the node reads it (``node/config.py`` ``read_config_text``: a regular file of bounded size, UTF-8)."""
    import tomllib

    from chestnut.backend.errors import ConfigError
    from chestnut.node.config import DEFAULT_CONFIG, read_config_text

    src = path if path is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    if src is None:
        return {}
    try:
        return tomllib.loads(read_config_text(src))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("config", f"{src} is not valid TOML: {e}") from None


def frame_options(args: argparse.Namespace, node_toml: dict[str, Any]) -> FrameOptions:
    """:class:`FrameOptions` from ``chestnut launch``'s arguments and the node TOML's table (missing keys:
    ``node/config.py``'s defaults)."""
    from chestnut.node.config import DockConfig, ModelConfig, TimingConfig

    model = node_toml.get("model", {}) if isinstance(node_toml.get("model"), dict) else {}
    dock = node_toml.get("dock", {}) if isinstance(node_toml.get("dock"), dict) else {}
    timing = node_toml.get("timing", {}) if isinstance(node_toml.get("timing"), dict) else {}
    period = timing.get("frame_period_ms", TimingConfig().frame_period_ms)
    shape = model.get("shape", ModelConfig().shape)
    try:
        hw = (int(shape[2]), int(shape[3]))
    except (TypeError, ValueError, IndexError):
        default = ModelConfig().shape
        hw = (int(default[2]), int(default[3]))  # the node names a malformed shape itself
    native_hw = None
    if args.frames == "native" and not args.synthetic:
        from chestnut.launch.assets import traffic_video_path
        from chestnut.launch.camerad import source_size

        native_hw = source_size(traffic_video_path(), args.pixel_format)
    return FrameOptions(
        frames=args.frames,
        synthetic=args.synthetic,
        pixel_format=args.pixel_format,
        transport=args.transport,
        dock_timing=args.dock_timing,
        link_mbps=args.link_mbps,
        latency_us=args.latency_us,
        model_hw=(int(hw[0]), int(hw[1])),
        preprocess=str(model.get("preprocess", ModelConfig().preprocess)),
        dock_kind=str(dock.get("kind", DockConfig().kind)),
        warp_on=args.warp or "primary",
        native_hw=native_hw,
        model_frame=str(model.get("frame", "")),
        warp_given=args.warp is not None,
        rate_hz=float(args.rate),
        # a malformed period is the node's to name: kept, so that the run's own config leaves it as given
        node_frame_period_ms=float(period) if isinstance(period, int | float) and not isinstance(period, bool)
        else 1000.0 / float(args.rate),
    )


MODEL_FILE_MAX_BYTES = 2 << 30  # protobuf's own bound on one message (an ONNX file without external data)


@dataclasses.dataclass(frozen=True)
class ModelFileCheck:
    """What :func:`check_model_file` found: ``problem``, the one line that refuses the file (None: the node could
    read it), and ``model``, the parsed ``onnx.ModelProto`` when there is no problem (None otherwise), for the
    checks that follow to read instead of parsing the file again (:func:`model_input_problem`)."""

    problem: str | None
    model: Any = None


def check_model_file(path: Path, what: str = "model", fix: str = "") -> ModelFileCheck:
    """The model file at ``path`` read and parsed once, before anything starts: what ``backend/model.py``
    ``read_model_file`` refuses (missing, a folder, too large, one another user could change: its ``ModelError``
    line), and a file that is not a well-formed ONNX model -- truncated or damaged -- which the node would only
    find at its start, exiting at every one of supervisord's restarts: the ``onnx`` package's parse and
    ``onnx.checker.check_model`` (the ONNX spec's structural rules: a graph, its opset imports, nodes whose inputs
    are defined) say what is wrong, in its first line. ``what`` names the file ("model", "fallback model");
    ``fix`` is the advice for a damaged one (default: replace it). Each refusal names ``path``, the file given."""
    from chestnut.backend.errors import ModelError
    from chestnut.backend.model import read_model_file

    try:
        data = read_model_file(path, what)
    except ModelError as e:
        return ModelFileCheck(e.detail or str(e))
    import onnx

    try:
        model = onnx.load_from_string(data)
        onnx.checker.check_model(model)
    except Exception as e:  # protobuf's DecodeError, onnx's ValidationError: the file is not a usable model
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        return ModelFileCheck(f"{what} file {path} is damaged: not a well-formed ONNX model ({reason}); "
                              f"{fix or 'replace it with an intact copy, or name another file'}")
    return ModelFileCheck(None, model)


def model_file_problem(path: Path, what: str = "model", fix: str = "") -> str | None:
    """The one line that refuses the model file at ``path`` before anything starts, or None when the node could
    read it (:func:`check_model_file`)."""
    return check_model_file(path, what, fix).problem


def model_input_problem(path: Path, input_name: str, shape: tuple[int, ...], model: Any = None) -> str | None:
    """The one line that refuses ``[model] shape`` (N, C, H, W) for the model file at ``path`` when its input
    ``input_name`` has other fixed dimensions (the node would fail at every start), else None. A dynamic
    dimension takes any size; a file that is missing or cannot be read is the node's to name. ``model``: the
    file's ``onnx.ModelProto`` already parsed (:func:`check_model_file`), else it is read here with the ``onnx``
    package (``backend/model.py`` reads the inputs the same way)."""
    if model is None:
        try:
            if os.stat(path).st_size > MODEL_FILE_MAX_BYTES:
                return None
            import onnx

            model = onnx.load(str(path), load_external_data=False)
        except Exception:  # missing, unreadable, not ONNX: the node's own load says which
            return None
    for inp in model.graph.input:
        if inp.name != input_name:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in inp.type.tensor_type.shape.dim]
        if len(dims) != len(shape) or any(d is not None and d != s for d, s in zip(dims, shape, strict=False)):
            have = [d if d is not None else "?" for d in dims]
            return (
                f"model.shape = {list(shape)} does not fit the input {input_name!r} of {path} ({have}): give its "
                "shape, or prepare the model for this one (chestnut model prepare --onnx M --shape N,C,H,W)"
            )
        return None
    return None


def write_frame_node_config(run_dir: Path, node_toml: dict[str, Any], opts: FrameOptions) -> Path:
    """The node configuration of this run when the frames need the warp or another frame period: ``node_toml``
    with the ``[model]`` keys of :attr:`FrameOptions.node_config_changes` (``preprocess``, ``frame``) and the
    ``[timing]`` keys of :attr:`FrameOptions.node_timing_changes` (``frame_period_ms``), written 0600 to
    ``<run dir>/node.toml`` and checked by loading it (``node/config.py`` ``load_config``; raises its
    ``ConfigError``)."""
    from chestnut.launch.acceptance import write_node_toml
    from chestnut.node.config import load_config

    data = {k: dict(v) for k, v in node_toml.items() if isinstance(v, dict)}
    data.setdefault("model", {}).update(opts.node_config_changes)
    if opts.node_timing_changes:
        data.setdefault("timing", {}).update(opts.node_timing_changes)
    path = run_dir / "node.toml"
    write_node_toml(path, data)
    load_config(path)
    return path
