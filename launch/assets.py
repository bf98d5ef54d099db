"""Real inputs, offline: the pretrained model and the real frames the main job uses.

- Model: PaddleOCR's pretrained PP-OCRv4 text detector, ``ch_PP-OCRv4_det_infer.onnx``, shipped
  inside the PyPI wheel ``rapidocr-onnxruntime==1.4.4`` (installed with ``--no-deps`` by
  ``launch/setup.sh``). Input ``x`` float32 [N,3,H,W] (H, W multiples of 32, BGR,
  ``(img/255 - 0.5)/0.5``), output float32 [N,1,H,W], a text probability in [0, 1]
  (the wheel's ``rapidocr_onnxruntime/config.yaml``, ``Det``: mean and std 0.5).
- Frames: ``images/traffic_sequence.mp4`` (350 real city-traffic frames, 704x576) and
  ``images/road.png`` from the PyPI wheel ``mvtb-data==1.6.1``, decoded with PyAV.

``chestnut model prepare`` turns any ONNX file into a *prepared* model the node can serve:
symbolic input dimensions fixed to the configured shape, tinygrad 0.14's ``Resize``-roi problem
repaired, checked (ONNX checker; agreement with onnxruntime within 1e-4 on a real frame), and a
metadata file written beside it; building it fills the compile cache (``backend/jitcache.py``). Run again
without ``--force``, it says ``model ready`` without preparing when the prepared file is what its metadata
recorded and the compile cache's entry of it is intact or absent (checked short of unpickling, nothing
compiled); a damaged file or a refused entry is named in one line and the model prepared again. A bad key of
the compile cache (``backend/jitcache.py`` ``KeyProblem``) is named in one line with its fix and no entry is
discarded for it: a damaged key of ours is replaced as the model is prepared again; any other leaves the model
ready but ``not cached``, said on the ``model ready`` line.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from chestnut.backend.errors import ModelError
from chestnut.msgs.argtypes import path_arg
from chestnut.msgs.outdir import OutputDirError, missing_folder, private_dir, write_private_files
from chestnut.node.config import MAX_INPUT_ELEMENTS, cache_dir, default_model_path

log = logging.getLogger("chestnut.assets")

PPOCR_WHEEL = "rapidocr-onnxruntime==1.4.4"
PPOCR_DET_FILE = "models/ch_PP-OCRv4_det_infer.onnx"
FRAMES_WHEEL = "mvtb-data==1.6.1"
DEFAULT_SHAPE: tuple[int, int, int, int] = (1, 3, 128, 256)  # N, C, H, W: openpilot's 128x256 model input
AGREEMENT_TOL = 1e-4  # max |tinygrad - onnxruntime| accepted on a real frame (measured: about 2e-5)
# tinygrad 0.14 rejects the empty `roi` of Resize; in `asymmetric` mode roi is never read, so any
# well-formed value works. This one is the identity box for a 4-D tensor (ONNX Resize spec).
IDENTITY_ROI = np.array([0, 0, 0, 0, 1, 1, 1, 1], dtype=np.float32)


def _package_dir(module: str, wheel: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModelError("missing_asset", f"the PyPI package {wheel} is not installed; run `bash launch/setup.sh`")
    return Path(spec.origin).resolve().parent  # one name for a file whatever link (a linked .venv) led to it


def ppocr_det_path() -> Path:
    """Path of the original PP-OCRv4 detector inside the installed ``rapidocr_onnxruntime`` package."""
    p = _package_dir("rapidocr_onnxruntime", PPOCR_WHEEL) / PPOCR_DET_FILE
    if not p.is_file():
        raise ModelError("missing_asset", f"{p} is missing from {PPOCR_WHEEL}")
    return p


def traffic_video_path() -> Path:
    """Path of the real traffic video (350 frames, 704x576) in the ``mvtb-data`` wheel."""
    return _package_dir("mvtbdata", FRAMES_WHEEL) / "images" / "traffic_sequence.mp4"


def road_image_path() -> Path:
    """Path of the real road image (driver's seat view) in the ``mvtb-data`` wheel."""
    return _package_dir("mvtbdata", FRAMES_WHEEL) / "images" / "road.png"


def read_image_bgr(path: Path, height: int, width: int) -> np.ndarray:
    """Decode an image (any format FFmpeg reads) into uint8 [height, width, 3] BGR."""
    import av

    with av.open(str(path)) as container:
        frame = next(container.decode(video=0))
        return frame.to_ndarray(format="bgr24", width=width, height=height)


def bgr_to_input(img: np.ndarray) -> np.ndarray:
    """uint8 [H,W,3] BGR -> float32 [1,3,H,W] normalised as PP-OCR expects (``node.preprocess`` ``ppocr``)."""
    from chestnut.node.preprocess import PREPROCESSORS

    return PREPROCESSORS["ppocr"](img, None)


def graph_problem(model: Any) -> str | None:
    """Why the parsed ModelProto ``model`` cannot be prepared before its shapes are looked at, or None: it must
    have a graph (an empty file parses as a ModelProto with none) with at least one input. Never raises."""
    if not model.HasField("graph"):
        return "is not an ONNX model with a graph (an empty file parses as an empty ModelProto)"
    if not model.graph.input:
        return "has no graph inputs; the node feeds a model one input [N,C,H,W]"
    return None


def repair_and_fix_shape(model: Any, input_shape: tuple[int, ...], source: str = "the model") -> tuple[Any, int]:
    """Fix the first graph input's dims to ``input_shape`` and give every ``Resize`` an explicit roi.

    Returns (model, number of Resize nodes repaired). Raises ModelError ``bad_model`` if the model has no graph
    input (e.g. an empty file, which parses as an empty ModelProto), ``bad_input_shape`` if the rank differs or a
    dim the model fixes (a ``dim_value``, e.g. the 3 colour channels) is given another value -- before anything
    is compiled. ``source`` names the model in them (``chestnut model prepare``: the file given).
    """
    from onnx import numpy_helper

    if (problem := graph_problem(model)) is not None:
        raise ModelError("bad_model", f"{source} {problem}")
    inp = model.graph.input[0]
    dims = inp.type.tensor_type.shape.dim
    if len(dims) != len(input_shape):
        raise ModelError("bad_input_shape", f"input {inp.name!r} of {source} has rank {len(dims)}, shape given "
                                            f"{list(input_shape)}")
    fixed = [(i, d.dim_value, v) for i, (d, v) in enumerate(zip(dims, input_shape, strict=True))
             if not d.HasField("dim_param") and d.dim_value > 0 and d.dim_value != v]
    if fixed:
        i, have, want = fixed[0]
        model_dims = [d.dim_param or d.dim_value for d in dims]
        raise ModelError("bad_input_shape", f"input {inp.name!r} of {source} is {model_dims}: dim {i} is {have} in "
                                            f"the model, shape given {list(input_shape)} asks {want}")
    for d, v in zip(dims, input_shape, strict=True):
        d.ClearField("dim_param")
        d.dim_value = int(v)
    # outputs: drop symbolic dims so shape inference recomputes them
    for out in model.graph.output:
        for d in out.type.tensor_type.shape.dim:
            if d.HasField("dim_param"):
                d.ClearField("dim_param")
    constants = {n.output[0]: n for n in model.graph.node if n.op_type == "Constant"}
    repaired = 0
    for node in model.graph.node:
        if node.op_type != "Resize" or len(node.input) < 2 or not node.input[1]:
            continue
        roi = constants.get(node.input[1])
        if roi is None:
            continue
        value = next((a for a in roi.attribute if a.name == "value"), None)
        if value is not None and numpy_helper.to_array(value.t).size == 0:
            value.t.CopyFrom(numpy_helper.from_array(IDENTITY_ROI, value.t.name))
            repaired += 1
    return model, repaired


def rename_value(model: Any, old: str, new: str) -> None:
    """Rename a value (node outputs, node inputs, graph outputs) throughout the graph."""
    for node in model.graph.node:
        for seq in (node.input, node.output):
            for i, name in enumerate(seq):
                if name == old:
                    seq[i] = new
    for v in (*model.graph.output, *model.graph.value_info):
        if v.name == old:
            v.name = new


def expose_logits(model: Any, prob_name: str = "text_prob", logits_name: str = "text_logits") -> str | None:
    """Add the input of a final ``Sigmoid`` as a second graph output; name them ``prob_name``/``logits_name``.

    Returns the logits output's name, or None if the graph does not end in a Sigmoid.

    A text-probability map of a frame without text is ~0 everywhere (sigmoid saturation), which makes
    agreement and zero/stale checks weak; the pre-sigmoid logits carry the same decision with full
    dynamic range. The computation is unchanged: only an output is added.
    """
    import onnx

    outputs = {o.name for o in model.graph.output}
    for node in model.graph.node:
        if node.op_type == "Sigmoid" and node.output[0] in outputs and node.input[0] not in outputs:
            inferred = onnx.shape_inference.infer_shapes(model)
            info = next((v for v in inferred.graph.value_info if v.name == node.input[0]), None)
            if info is None:
                return None
            out = model.graph.output.add()
            out.CopyFrom(info)
            sig_in, sig_out = str(node.input[0]), str(node.output[0])
            rename_value(model, sig_out, prob_name)
            rename_value(model, sig_in, logits_name)
            return logits_name
    return None


def source_problem(src: Path) -> str | None:
    """Why ``src`` cannot be the ONNX file to prepare, from its ``stat`` alone (a symlink is followed: a link to
    a model is a model), or None: ``"no such file"``, ``"is a directory"``, or ``"is a FIFO, not a regular file"``
    (a socket, a device: ``msgs/video.py`` ``file_kind``), never opened -- opening a FIFO waits for a writer,
    forever for a planted one (``open(2)``) -- or a size over ``backend/model.py`` ``MAX_MODEL_BYTES`` (2 GiB,
    protobuf's limit for one serialized model), refused unread: a 5 GB file was read whole, 5 GB of memory,
    before protobuf said so."""
    import os
    import stat

    from chestnut.backend.model import MAX_MODEL_BYTES
    from chestnut.msgs.video import file_kind

    try:
        st = os.stat(src)
    except FileNotFoundError:
        return "no such file"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        return "is a directory"
    if not stat.S_ISREG(mode):
        return f"is {file_kind(mode)}, not a regular file"
    if st.st_size > MAX_MODEL_BYTES:
        return f"is {st.st_size} bytes, over the {MAX_MODEL_BYTES} an ONNX model can be"
    return None


def sample_frame(height: int, width: int) -> np.ndarray | None:
    """The real road image (:func:`road_image_path`) as a uint8 [height, width, 3] BGR check frame, or None when it
    cannot be had -- the wheel missing, or a size FFmpeg's scaler refuses (``av.error.ArgumentError``) --, said in
    one warning line: the agreement check then runs on a fixed random input. Called only once the shape passed the
    model's own dims (:func:`prepare_model`)."""
    try:
        return read_image_bgr(road_image_path(), height, width)
    except Exception as e:  # ModelError (no wheel), PyAV's errors, OSError: the check frame is optional
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        log.warning("no real frame for the agreement check (%s); using a fixed random input", reason)
        return None


def prepare_model(src: Path, out: Path, input_shape: tuple[int, ...],
                  check_frame: np.ndarray | Callable[[], np.ndarray | None] | None,
                  started: Callable[[], object] | None = None) -> dict[str, Any]:
    """Prepare ``src`` into ``out`` (+ ``out.with_suffix('.json')`` metadata); returns the metadata.

    ``check_frame``: a uint8 [H,W,3] BGR real frame for the onnxruntime agreement check (PP-OCR
    normalisation), a function that gives one (or None), called only once ``input_shape`` passed the model's own
    dims and the element bound -- a shape the model refuses was resized to first, a traceback in FFmpeg's scaler
    for ``1,3,128,99999999`` -- or None to check on a fixed random input. ``started``, when given, is called once
    ``src`` has passed every check of its own (a regular file, an ONNX model with a graph input, the shape, the ONNX
    checker), before the check frame is read and the model compiled: ``chestnut model prepare`` says ``preparing
    ...`` there, so an empty or damaged file is refused in its one line alone. Raises ModelError on any failed check:
    ``missing_model`` when ``src`` is no regular file (:func:`source_problem`), ``bad_model`` when its bytes are
    not an ONNX model with a graph input (garbage, an empty file) or a check fails, ``bad_input_shape`` (see
    :func:`repair_and_fix_shape`); OutputDirError when ``out`` cannot be written. Nothing is written beside ``out``
    until every check passed: then the model, its metadata and its fingerprint go to temporary names and are renamed
    into place together (``msgs/outdir.py`` ``write_private_files``), so a failure or a Ctrl-C leaves ``out`` as it was.
    """
    import onnx

    if (what := source_problem(src)) is not None:
        raise ModelError("missing_model", f"model file {src}: {what}")
    try:
        model = onnx.load(str(src))
    except Exception as e:  # protobuf's DecodeError, onnx's own errors: the bytes are not a ModelProto
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError("bad_model", f"{src} does not parse as an ONNX model ({first})") from None
    if (problem := graph_problem(model)) is not None:
        raise ModelError("bad_model", f"{src} {problem}")
    model, repaired = repair_and_fix_shape(model, input_shape, str(src))
    if math.prod(input_shape) > MAX_INPUT_ELEMENTS:  # the node refuses it when its configuration loads
        raise ModelError("bad_input_shape", f"shape given {list(input_shape)} is {math.prod(input_shape)} elements, "
                                            f"over the {MAX_INPUT_ELEMENTS} a model input may have (64 MiB of "
                                            "float32, node/config.py MAX_INPUT_ELEMENTS); give a smaller --shape")
    logits = expose_logits(model)
    try:
        onnx.checker.check_model(model)
        model = onnx.shape_inference.infer_shapes(model)
    except Exception as e:  # onnx raises its own ValidationError and friends
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelError("bad_model", f"ONNX checker rejected {src} once prepared: {first}") from None
    data = model.SerializeToString()  # nothing is written to out's folder until every check passed (below)
    if started is not None:
        started()
    if callable(check_frame):
        check_frame = check_frame()

    x = (
        bgr_to_input(check_frame)
        if check_frame is not None
        else np.random.default_rng(0).standard_normal(input_shape).astype(np.float32)
    )
    meta: dict[str, Any] = {
        "source": str(src),
        "sha256": hashlib.sha256(data).hexdigest(),
        "input_name": model.graph.input[0].name,
        "input_shape": list(input_shape),
        "resize_roi_repaired": repaired,
        "logits_output": logits,
        "output_names": [o.name for o in model.graph.output],
        "prepared_unix_s": int(time.time()),
    }
    from chestnut.backend.fingerprint import record_fingerprint
    from chestnut.backend.jitcache import JitCache
    from chestnut.backend.model import OnnxModel

    private_dir(out.parent)  # made 0700 (the default <cache>/models) before the compile cache's folders, or refused
    t0 = time.monotonic()  # building it fills the compile cache (or verifies a cached capture)
    try:  # from the bytes, named as out will be (its model id), so the file waits until it is complete
        tg_model = OnnxModel(data, name=out.stem, origin=out, jit_cache=JitCache(),
                             progress=lambda msg: print(f"  {msg}", flush=True))
    except ModelError as e:  # it names the prepared file; the user gave src
        raise ModelError(e.reason, f"{e.detail} (prepared from {src})") from None
    meta["max_abs_diff_vs_onnxruntime"] = agreement_check(tg_model, data, {meta["input_name"]: x})
    meta["first_call_s"] = time.monotonic() - t0
    if meta["max_abs_diff_vs_onnxruntime"] > AGREEMENT_TOL:
        raise ModelError(
            "bad_model",
            f"{src}: tinygrad and onnxruntime disagree by {meta['max_abs_diff_vs_onnxruntime']:.3g} "
            f"> {AGREEMENT_TOL} on the check frame",
        )
    fp = record_fingerprint(tg_model)
    fp_path = out.with_suffix(".fingerprint.json")
    meta["fingerprint"] = str(fp_path)
    # each under a temporary name first (0600), renamed into place once all three are written, the model last; an
    # interruption (Ctrl-C) or a failure removes the temporaries: never a model without its fingerprint
    write_private_files([(fp_path, json.dumps(fp, indent=1)), (out.with_suffix(".json"), json.dumps(meta, indent=2)),
                         (out, data)])
    return meta


def _read_regular(path: Path) -> Any:
    """``path`` opened for reading in binary, a regular file only: a symlink is never followed, a FIFO never
    opened (``msgs/video.py`` ``open_regular``). Raises OSError (``NotRegularFileError`` among them)."""
    import os

    from chestnut.msgs.video import open_regular

    return os.fdopen(open_regular(path), "rb")


def file_sha256(path: Path) -> str:
    """The sha256 of ``path``'s bytes (hex), read in 1 MiB blocks; a regular file only (a symlink is not
    followed). Raises OSError."""
    h = hashlib.sha256()
    with _read_regular(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prepared_damage(out: Path, meta: dict[str, Any]) -> str | None:
    """Why the prepared model ``out`` is not what its metadata (``out.with_suffix('.json')``, written by
    :func:`prepare_model`) recorded, or None when it is: its sha256 must equal ``meta["sha256"]``, it must
    parse as ONNX (``onnx.load_model_from_string``), and the fingerprint beside it (``.fingerprint.json``, which
    the node refuses to start on when unreadable: ``node/contract.py`` ``read_fingerprint``) must be a JSON
    object recorded for that sha256, read as the node reads it (``backend/fingerprint.py``
    ``read_fingerprint_file``: a regular file, never a symlink, of at most ``FINGERPRINT_MAX_BYTES``, 1 MiB,
    refused from its size before it is read), and the file may not be writable by group or other (the node
    refuses such a model: ``backend/model.py`` ``read_model_file``; prepared again, it is written 0600). Never
    raises."""
    import os
    import stat

    try:
        mode = stat.S_IMODE(os.stat(out).st_mode)
    except OSError as e:
        return f"cannot read it: {e.strerror or e}"
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or other (mode {mode:04o}), which the node refuses"
    try:
        sha = file_sha256(out)
    except OSError as e:
        return f"cannot read it: {e.strerror or e}"
    want = meta.get("sha256")
    if sha != want:
        return f"its sha256 is {sha[:16]}, the metadata recorded {str(want)[:16]}"
    try:
        import onnx

        with _read_regular(out) as f:
            onnx.load_model_from_string(f.read())
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends: the file is not a model
        return f"it does not parse as ONNX ({type(e).__name__})"
    from chestnut.backend.fingerprint import FingerprintFileError, read_fingerprint_file

    fp_path = out.with_suffix(".fingerprint.json")
    try:
        fp = read_fingerprint_file(fp_path)
    except FingerprintFileError as e:
        if e.reason == "not_object":  # a JSON list, say: not the one recorded for this model
            return f"its fingerprint {fp_path.name} is not the one recorded for this model"
        return f"its fingerprint {fp_path.name} {e.problem}"
    if fp.get("model_sha256") != want:
        return f"its fingerprint {fp_path.name} is not the one recorded for this model"
    return None


def compile_cache_refusal(out: Path) -> str | None:
    """Why the compile cache would refuse the entry of the prepared model ``out`` -- the captured JIT
    :func:`prepare_model` stored (tinygrad on the host CPU, :class:`~chestnut.backend.model.OnnxModel`), which the
    node loads when it starts -- in one line naming the file and what is wrong
    (:meth:`~chestnut.backend.jitcache.JitCache.refusal`), or None when the entry is intact or there is none.
    Nothing is compiled or unpickled: ``out``'s inputs are read with ``onnx`` and the entry's pickle is hashed. A
    refused entry is discarded (:meth:`~chestnut.backend.jitcache.JitCache.discard`), so preparing again stores a
    fresh one without the load refusing it a second time. Raises OSError if ``out`` cannot be read, ModelError if
    an input of it has no fixed shape (never so in a file :func:`prepare_model` wrote), ConfigError if tinygrad
    was already imported in this process for another device than the host CPU."""
    from chestnut.backend.jitcache import JitCache
    from chestnut.backend.model import _graph_inputs, host_cache_key, model_label

    with _read_regular(out) as f:
        data = f.read()
    key = host_cache_key(hashlib.sha256(data).hexdigest(), _graph_inputs(data, model_label(out.stem, out), {}))
    cache = JitCache()
    if (refusal := cache.refusal(key)) is not None and cache.key_problem() is None:  # the key's: the entry is kept
        cache.discard(key)
    return refusal


def compile_cache_key_problem(say: Any = print) -> Any:
    """The compile cache key's problem (:class:`~chestnut.backend.jitcache.KeyProblem`, its one line said once in
    this process with ``say``), or None when the key is usable or not made yet."""
    from chestnut.backend.jitcache import JitCache, say_once

    if (problem := JitCache().key_problem()) is not None:
        say_once(str(problem), say)
    return problem


NOT_CACHED = "; not cached (the compile cache's key is refused: above)"


def agreement_check(model: Any, source: Path | bytes, inputs: dict[str, np.ndarray]) -> float:
    """Largest |tinygrad - onnxruntime| over every output of ``model`` (an OnnxModel of ``source``, a file or the
    model's bytes) on ``inputs``."""
    import onnxruntime as ort

    ours = model.run(inputs)
    src = source if isinstance(source, bytes) else str(source)
    ref = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, inputs)
    return max(float(np.max(np.abs(o - r))) for o, r in zip(ours.values(), ref, strict=True))


def prepare_for_dock(model: Path) -> int:
    """Compile ``model`` on the attached dock into the compile cache: the ladder with the model's rungs in a
    fresh process (``chestnut probe --real``), which stores the captured JIT (``backend/real_runner.py``)."""
    from chestnut.backend.probe import prepare_on_dock

    return prepare_on_dock(model, model.with_suffix(".fingerprint.json"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="fix shapes, repair, check and record a model for the node")
    prep.add_argument("--onnx", type=path_arg,
                      help="source ONNX file (default: PP-OCRv4 det from rapidocr-onnxruntime)")
    prep.add_argument("--shape", default=",".join(map(str, DEFAULT_SHAPE)), help="input shape N,C,H,W")
    prep.add_argument("--out", type=path_arg, help=f"prepared model path (default: {default_model_path()})")
    prep.add_argument("--force", action="store_true", help="prepare again even if up to date")
    prep.add_argument(
        "--for-dock",
        action="store_true",
        help="also compile it on the attached dock into the compile cache (chestnut probe --real)",
    )
    sub.add_parser("paths", help="print where the model and frames are")


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``--shape``'s ``N,C,H,W`` as four positive ints; raises ``ValueError`` (one line) otherwise."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        want = ",".join(map(str, DEFAULT_SHAPE))
        raise ValueError(f"--shape {text!r}: give the input shape N,C,H,W as 4 positive integers, e.g. {want}")
    n, c, h, w = (int(p) for p in parts)
    return n, c, h, w


def out_problem(out: Path, given: bool = True) -> str | None:
    """Why ``out`` cannot take the prepared model (checked before it is read as up to date, compiled or written),
    or None. ``out`` and the files written beside it (``.json`` metadata, ``.fingerprint.json``) must each be
    absent or a regular file of ours: a symlink, a folder, a FIFO or a file of another user there is refused,
    never followed, and kept. ``given`` (``--out``): its folder must exist (it is never created for a given
    ``--out``) and ``out`` must not end in ``.json`` (its metadata would overwrite it); the default path's
    folder (``<cache>/models``) is created 0700 when missing. Its folder must be one of ours that others
    cannot write."""
    import os
    import stat

    if given and not out.name:  # / or . (no file name: Path.with_suffix raises for it), a folder as .. is
        return f"--out {out} is a directory, not a regular file; give another path"
    if given and out.suffix == ".json":
        return f"--out {out}: the metadata goes to {out.with_suffix('.json')}; give a path ending in .onnx"
    if given and (missing := missing_folder(out)) is not None:
        return f"--out {missing}"
    paths = (out, out.with_suffix(".json"), out.with_suffix(".fingerprint.json"))
    try:
        private_dir(out.parent, targets=[p.name for p in paths])
        for p in paths:  # private_dir checked each is absent or a regular file, not a symlink
            try:
                owner = os.lstat(p).st_uid
            except FileNotFoundError:
                continue
            if owner != os.getuid():
                raise OutputDirError(p, f"is owned by uid {owner}, not by uid {os.getuid()}", "remove it")
            if not stat.S_ISREG(os.lstat(p).st_mode):  # swapped in since private_dir looked
                raise OutputDirError(p, "is not a regular file", "remove it")
    except OutputDirError as e:
        what = str(e).split("; ")[0]  # "<path> <problem>"
        if not given and e.path == out.parent:
            return f"folder {what}; give --out PATH in a folder of yours that others cannot write"
        if not given:
            return f"{what}; refused, never followed or replaced: remove it or give --out PATH"
        if e.path == out.parent:
            return f"--out {out}: folder {what}; give a folder of yours that others cannot write"
        return f"--out {what}; give another path" if e.path == out else f"--out {out}: {what}; give another path"
    return None


def run(args: argparse.Namespace) -> int:
    if args.action == "paths":
        for name, fn in (
            ("model", default_model_path),
            ("ppocr_det", ppocr_det_path),
            ("traffic_video", traffic_video_path),
            ("road_image", road_image_path),
        ):
            try:
                path = fn()
            except ModelError as e:
                print(f"{name}: {e}")
                continue
            missing = name == "model" and not path.exists()
            print(f"{name}: {path}" + (" (not prepared: `chestnut model prepare` makes it)" if missing else ""))
        return 0
    try:
        shape = parse_shape(args.shape)
    except ValueError as e:
        print(f"chestnut model prepare: {e}", file=sys.stderr)
        return 2
    if args.onnx is not None and (what := source_problem(args.onnx)) is not None:
        print(
            f"chestnut model prepare: --onnx {args.onnx}: {what}; give the path of an ONNX model "
            "(or leave --onnx out for the default PP-OCRv4 detector)",
            file=sys.stderr,
        )
        return 2
    try:
        src = args.onnx or ppocr_det_path()
    except ModelError as e:
        print(f"chestnut model prepare: {e}", file=sys.stderr)
        return 2
    out = args.out or (default_model_path() if args.onnx is None else cache_dir() / "models" / f"{src.stem}.onnx")
    if (problem := out_problem(out, given=args.out is not None)) is not None:
        print(f"chestnut model prepare: {problem}", file=sys.stderr)
        return 2
    meta_path = out.with_suffix(".json")
    if not args.force and out.is_file() and meta_path.is_file():
        damage = None
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            meta, damage = {}, f"its metadata {meta_path.name} does not read as JSON"
        if (
            isinstance(meta, dict)
            and isinstance(meta.get("max_abs_diff_vs_onnxruntime"), (int, float))
            and meta.get("source") == str(src)
            and meta.get("input_shape") == list(shape)
            and out.with_suffix(".fingerprint.json").is_file()
            and (damage := prepared_damage(out, meta)) is None
        ):
            ready = (f"model ready: {out} (sha256 {meta['sha256'][:16]}, max |tinygrad-onnxruntime| "
                     f"{meta['max_abs_diff_vs_onnxruntime']:.2e})")
            key_problem = compile_cache_key_problem()
            if key_problem is not None and not key_problem.damaged:  # compiling again would not cache it either
                print(ready + NOT_CACHED)
                return prepare_for_dock(out) if args.for_dock else 0
            try:
                refusal = None if key_problem is not None else compile_cache_refusal(out)
            except (OSError, ModelError) as e:  # the file changed since it was checked
                damage = str(e)
            else:
                if refusal is None and key_problem is None:
                    print(ready)
                    return prepare_for_dock(out) if args.for_dock else 0
                if refusal is not None:
                    print(f"compile cache entry of {out} refused ({refusal}); preparing it again")
        if damage is not None:
            print(f"prepared model {out} is damaged ({damage}); preparing it again")
    try:  # the check frame is read once the shape passed the model's dims (prepare_model); "preparing" is said once
        # the file passed its own checks, so an empty or damaged one is refused in its one line alone
        meta = prepare_model(src, out, shape, lambda: sample_frame(shape[2], shape[3]), started=lambda: print(
            f"preparing {src} -> {out} (input {list(shape)}); the first tinygrad run compiles, this takes a while",
            flush=True))
    except (ModelError, OutputDirError) as e:  # not an ONNX model, a failed check, an unfit target: one line
        print(f"chestnut model prepare: {e}", file=sys.stderr)
        return 2
    print(
        f"model ready: {out} (sha256 {meta['sha256'][:16]}, {meta['resize_roi_repaired']} Resize nodes repaired, "
        f"max |tinygrad-onnxruntime| {meta['max_abs_diff_vs_onnxruntime']:.2e}, "
        f"first call {meta['first_call_s']:.1f} s)" + (NOT_CACHED if compile_cache_key_problem() is not None else "")
    )
    return prepare_for_dock(out) if args.for_dock else 0
