"""``chestnut camera``: a camerad-like source publishing real frames as ``cameraFrame``.

By default it loops the real city-traffic video of the PyPI wheel ``mvtb-data==1.6.1`` (350 frames,
704x576), decoded with PyAV and resized to the model input (default 128x256, the shape openpilot's
models use), at 20 Hz. Any video, image folder or single image works (``--source``). ``--native``
keeps the source's own size (an image folder: the first image's size, the others resized to it);
``--pixel-format nv12`` publishes YUV 4:2:0 (FFmpeg's ``nv12``, what openpilot's cameras give) instead
of BGR; ``--synthetic`` replaces the source by a moving test pattern of ``--width`` x ``--height``, and
``--synthetic --native`` by one of :data:`SYNTHETIC_NATIVE_HW` unless ``--width`` / ``--height`` say otherwise
(``--synthetic --native --pixel-format nv12``: openpilot's 1928x1208 road camera frame, 3.5 MB, as ``chestnut
launch --frames native --synthetic`` runs it).

Timing as a camera gives it: ``frameId`` counts from 0 and never repeats within a run;
``timestampSof`` (ns, CLOCK_MONOTONIC) is the frame's scheduled start on a drift-free 1/rate grid;
``timestampEof`` is when the frame, decoded and resized ahead of its tick, is sent (readout done). A
source up to :data:`LATE_MAX_PERIODS` periods behind its schedule (a host stall) sends the late frames
and catches up on the grid; one further behind skips the ticks already past (:func:`ticks_to_skip`), and
the skipped ids are never reused, so downstream frame-drop accounting sees real gaps. At a stop the
frame waiting for its tick is not sent, and the socket lingers (:data:`STOP_LINGER_MS`) so the last
frame sent reaches every subscriber: the node and the logger see the same last frame.

A source is sized from its header before any frame is decoded: a video or an image whose frame is over
:data:`SOURCE_MAX_PIXELS` is refused in one line naming it, its size and the bound (:func:`source_pixels_error`), and
FFmpeg's own guard (``max_pixels``) stops the decoder near that bound wherever no header tells the size.

Transport (``--transport``): a frame up to ``msgs/visionipc.py`` ``INLINE_MAX_BYTES`` travels inline
(pixels in ``data``); a bigger one, or every one with ``shm``, is copied into the camera's
shared-memory ring and only its metadata (``buffer``: session, slot, sequence number) is published
(``msgs/visionipc.py``). The ring is removed when the camera stops; when it is killed, the kernel frees
the buffers once the last subscriber unmaps them. ``--transport inline`` refuses, at start, a frame whose
message is over ``cameraFrame``'s ``max_bytes`` (``msgs/services.py``): every subscriber's
``ZMQ_MAXMSGSIZE`` would drop each one (:func:`inline_frame_error`); ``auto`` never sends such a frame
inline, since ``INLINE_MAX_BYTES`` is far below that bound.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from chestnut.launch.signals import StopFlag
from chestnut.msgs.argtypes import (
    MAX_FRAME_RATE_HZ,
    MIN_FRAME_RATE_HZ,
    checked_float,
    checked_int,
    frame_rate_hz,
    path_arg,
)
from chestnut.msgs.frames import fill_frame, frame_shape
from chestnut.msgs.messaging import PubMaster, context
from chestnut.msgs.services import FRAME_MAX_BYTES, get_service
from chestnut.msgs.visionipc import INLINE_MAX_BYTES, FrameBufferError, FrameRing
from chestnut.node.realtime import CAMERA_PRIORITY, IdleCollector, add_priority_argument, apply_priority

log = logging.getLogger("chestnut.camera")

LATE_MAX_PERIODS = 3  # a frame up to 3 periods late (150 ms at 20 Hz) still goes out: the camera's queue holds it
STOP_LINGER_MS = 1000  # at stop, queued frames get this long to reach the subscribers (ZMQ_LINGER)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".tif", ".tiff", ".webp"}


PIXEL_FORMATS = {"bgr24": "bgr888", "nv12": "nv12"}  # FFmpeg pixel format -> CameraFrame.PixelEncoding
DEFAULT_HW = (128, 256)
"""The frames' (H, W) in px without ``--native``: the input size openpilot's models use, the node's default ``[model]
shape`` H, W (``node/config.py``)."""
SYNTHETIC_NATIVE_HW = (1208, 1928)
"""(H, W) in px of the ``--synthetic --native`` test pattern: openpilot's road camera frame, 1928x1208 (openpilot
``system/camerad``, its AR0231 / OX03C10 sensors), 3.5 MB a frame in nv12. The one constant of that size: ``chestnut
launch --frames native --synthetic`` (``launch/frames.py`` ``FrameOptions.frame_hw``) gives it to the camera and to
the node's ``[model] frame``."""
SOURCE_MAX_PIXELS = 4 * SYNTHETIC_NATIVE_HW[0] * SYNTHETIC_NATIVE_HW[1]
"""The most pixels (width x height, 9316096) a source's frame may have: 4x :data:`SYNTHETIC_NATIVE_HW`, the largest
frame the camera publishes at its own size (openpilot's road camera), so a 4K UHD video (3840x2160, 8294400 px) still
comes in to be resized; a bgr24 frame at the bound decodes to 28 MB. A bigger one (a 12000x12000 PNG: 432 MB decoded)
is refused from its header (:func:`source_pixels_error`), and FFmpeg's decoder is held to twice it
(:data:`_DECODE_GUARD`)."""
_DECODE_GUARD = {"max_pixels": str(2 * SOURCE_MAX_PIXELS)}
"""FFmpeg's decompression-bomb guard for the probe in ``av.open`` and the decoder: the codec option ``max_pixels``
(FFmpeg ``libavcodec/options_table.h``), checked by ``av_image_check_size2`` before a picture is allocated. Twice
:data:`SOURCE_MAX_PIXELS`, since decoders check the picture they allocate, its width aligned up (``ff_get_buffer``:
a 4658x2000 PNG, 9316000 px, is checked as 4672x2000); the exact bound is the header's (:func:`source_pixels_error`)."""


def iter_frames(
    source: Path, height: int | None, width: int | None, loop: bool = True, pixel_format: str = "bgr24"
) -> Iterator[np.ndarray]:
    """Yield uint8 frames from a video, an image folder or one image: [height, width, 3] BGR for
    ``bgr24``, the [height * 3/2, width] planes for ``nv12`` (``msgs/frames.py`` ``frame_shape``).
    ``height``/``width`` None: the first frame's own size (rounded down to even for ``nv12``), kept for
    every later frame.

    Raises FileNotFoundError for a missing source or one the OS cannot look up (one line with its reason: too
    long, a symlink loop, a path through a regular file) and ValueError for a folder without images, a source that is
    no regular file (a FIFO, a device: told from its ``stat`` and never opened -- opening a FIFO waits for a
    writer, forever for a planted one, ``open(2)``), a file whose frames are over :data:`SOURCE_MAX_PIXELS`
    (:func:`source_pixels_error`, before its first frame is decoded) or a file FFmpeg cannot decode (named with
    FFmpeg's reason, :func:`unreadable_source`). In a folder, only regular files are images, each checked as it
    comes.
    """
    import os

    import av

    from chestnut.msgs.outdir import os_reason
    from chestnut.msgs.video import file_kind

    try:
        os.stat(source)  # follows a symlink: the source is the caller's choice
    except FileNotFoundError:
        raise FileNotFoundError(f"camera source {source} does not exist") from None
    except OSError as e:  # ENAMETOOLONG, ELOOP (a symlink loop), ENOTDIR (through a regular file), EACCES
        raise FileNotFoundError(f"camera source {source}: {os_reason(e)}; give a video, an image folder or an "
                                "image") from None
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if not files:
            raise ValueError(f"camera source {source} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    elif not source.is_file():
        raise ValueError(f"camera source {source} is {file_kind(os.stat(source).st_mode)}, not a regular file "
                         "(never opened): give a video, an image folder or an image")
    else:
        files = [source]
    while True:
        n = 0
        for f in files:
            if why := source_pixels_error(f):  # an image: from its header, before FFmpeg's probe decodes it
                raise ValueError(why)
            before = n  # frames decoded before this file's
            try:
                with av.open(str(f), options=_DECODE_GUARD) as container:
                    codec = container.streams.video[0].codec_context
                    if why := source_pixels_error(f, codec.width, codec.height):  # a video: its container's header
                        raise ValueError(why)
                    codec.options = dict(_DECODE_GUARD)  # the decoder's own context, opened at the first packet
                    for frame in container.decode(video=0):
                        n += 1
                        if height is None or width is None:
                            even = pixel_format == "nv12"
                            height = frame.height & ~1 if even else frame.height
                            width = frame.width & ~1 if even else frame.width
                        yield frame.to_ndarray(format=pixel_format, width=width, height=height)
            except IndexError as e:  # PyAV's decode(video=0) of a container without a video stream
                raise ValueError(f"{f} cannot be decoded as video or image: it holds no video stream") from e
            except av.error.FFmpegError as e:
                raise ValueError(unreadable_source(source, f, n - before, e)) from e
        if n == 0:
            raise ValueError(f"camera source {source} has no video frames")
        if not loop:
            return


def unreadable_source(source: Path, f: Path, decoded: int, e: Exception) -> str:
    """The one line for a camera ``source`` whose file ``f`` (``source`` itself, or an image of the folder
    ``source``) FFmpeg refused after ``decoded`` of its frames: what is refused and FFmpeg's short reason at the end
    (PyAV's ``strerror``, e.g. ``Invalid data found when processing input``, and the call of FFmpeg's that failed
    where PyAV names one instead of the file: ``avcodec_open2(...)``, ``avcodec_send_packet()``). It was PyAV's own
    text, ``[Errno 1094995529] Invalid data found when processing input: '<file>'``, after the file's name."""
    strerror, filename = getattr(e, "strerror", None), getattr(e, "filename", None)
    if not strerror:
        why = f"FFmpeg: {str(e) or type(e).__name__}"
    elif filename and filename != str(f):
        why = f"FFmpeg's {filename}: {strerror}"
    else:
        why = f"FFmpeg: {strerror}"
    what = f"camera source {source}: image {f.name}" if f != source else f"camera source {f}"
    if decoded:
        return f"{what}: frame {decoded + 1} cannot be decoded ({why})"
    return f"{what} is not a readable {'image' if f != source else 'video or image'} ({why})"


def source_pixels_error(f: Path, width: int = 0, height: int = 0) -> str | None:
    """Why ``f`` is refused as a camera source for its frame size, in one line, or None.

    ``width`` x ``height`` (px): its frame size as FFmpeg's probe of its container header found it, checked against
    :data:`SOURCE_MAX_PIXELS`; 0 x 0 (before it is opened): its image header read by PIL (``Image.open`` reads the
    header only; PIL's own decompression-bomb guard, ``Image.MAX_IMAGE_PIXELS``, stays as it is, and an image that
    guard refuses is named so). A file that is no image PIL knows is None here, left to its container's header.
    """
    if width * height == 0:
        import warnings

        from PIL import Image, UnidentifiedImageError

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # over our bound: refused below
                with Image.open(f) as im:
                    width, height = im.size
        except Image.DecompressionBombError as e:  # "Image size (N pixels) exceeds limit of M pixels, ..."
            return _pixels_line(f, f"an image over PIL's decompression-bomb limit ({str(e).split(', could')[0]})")
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError):  # no image, or a header PIL cannot read
            return None
    if width * height <= SOURCE_MAX_PIXELS:
        return None
    return _pixels_line(f, f"a frame of {width}x{height} ({width * height} px)")


def _pixels_line(f: Path, what: str) -> str:
    return (f"camera source {f}: {what}; a camera source's frame has at most {SOURCE_MAX_PIXELS} px (4x "
            f"openpilot's {SYNTHETIC_NATIVE_HW[1]}x{SYNTHETIC_NATIVE_HW[0]} road-camera frame, launch/camerad.py "
            "SOURCE_MAX_PIXELS); refused from its header, never decoded")


def source_size(source: Path, pixel_format: str = "bgr24") -> tuple[int, int]:
    """(height, width) in px of the frames ``--native`` publishes from ``source``: its first frame's own size,
    rounded down to even for ``nv12`` (:func:`iter_frames`). Raises what :func:`iter_frames` raises."""
    first = next(iter_frames(source, None, None, loop=False, pixel_format=pixel_format))
    rows = int(first.shape[0])
    return (rows * 2 // 3 if pixel_format == "nv12" else rows), int(first.shape[1])


def synthetic_frames(height: int, width: int, pixel_format: str = "bgr24") -> Iterator[np.ndarray]:
    """An endless moving test pattern, frames as :func:`iter_frames` gives them: diagonal luma ramps that
    shift 4 levels a frame, a chroma ramp across and down. Raises ValueError for an odd ``nv12`` size."""
    if pixel_format == "nv12" and (height % 2 or width % 2):
        raise ValueError(f"an nv12 frame has an even width and height, not {width}x{height}")
    y, x = np.mgrid[0:height, 0:width]
    luma = ((x + y) & 0xFF).astype(np.uint8)
    if pixel_format == "nv12":
        uv = np.empty((height // 2, width), np.uint8)
        uv[:, 0::2] = (np.arange(width // 2) * 256 // max(1, width // 2)).astype(np.uint8)[None, :]  # U across
        uv[:, 1::2] = (np.arange(height // 2) * 256 // max(1, height // 2)).astype(np.uint8)[:, None]  # V down
    else:
        bgr = np.stack([luma, (x & 0xFF).astype(np.uint8), (y & 0xFF).astype(np.uint8)], axis=2)
    k = 0
    while True:
        shift = np.uint8(4 * k & 0xFF)
        if pixel_format == "nv12":
            yield np.concatenate([luma + shift, uv])
        else:
            frame = bgr.copy()
            frame[:, :, 0] += shift
            yield frame
        k += 1


def ring_frame(
    ring: FrameRing, frame_id: int, img: np.ndarray, sof_ns: int, source_name: str, encoding: str = "bgr888"
) -> object:
    """Copy a frame (as :func:`iter_frames` gives it) into the ring's next slot, send its notice to the ring's
    subscribers (``FrameRing.announce``: they have it one socket hop later), then build its metadata-only
    ``cameraFrame`` for the bus (``timestampEof``: ns, CLOCK_MONOTONIC, once the pixels are in the slot)."""
    index, seq = ring.write(np.ascontiguousarray(img))
    eof_ns = time.monotonic_ns()
    rows = int(img.shape[0])
    height, width = (rows * 2 // 3 if encoding == "nv12" else rows), int(img.shape[1])
    ring.announce(frame_id, sof_ns, eof_ns, width, height, encoding, index, seq, img.nbytes)
    msg = fill_frame(frame_id, img[:0], sof_ns, eof_ns, source_name, encoding)
    cf = msg.cameraFrame  # type: ignore[attr-defined]
    cf.height, cf.width = height, width
    ring.fill(cf, index, seq, img.nbytes)
    return msg


def inline_frame_error(img: np.ndarray, source_name: str, encoding: str) -> str | None:
    """Why ``img`` cannot travel inline (one line naming ``--transport shm``), or None when it can.

    ``img``: a frame as the source gives it (uint8, HxWx3 BGR or (H*3/2)xWx1 NV12). The bound is
    ``cameraFrame``'s ``max_bytes`` (``msgs/services.py``), compared with the serialised size of the
    frame's own message, so the message's overhead counts too.
    """
    bound = get_service("cameraFrame").max_bytes
    if img.nbytes + (64 << 10) < bound:  # far below the bound: no need to build the message
        return None
    size = len(fill_frame(0, img, 0, 0, source_name, encoding).to_bytes())  # type: ignore[attr-defined]
    if size <= bound:
        return None
    return (
        f"--transport inline: a frame of {img.nbytes} bytes makes a {size}-byte cameraFrame message, over the "
        f"service's bound of {bound} bytes (msgs/services.py), which every subscriber drops; "
        "use --transport shm (or auto)"
    )


def ticks_to_skip(now_ns: int, sof_ns: int, period_ns: int, late_max_periods: int = LATE_MAX_PERIODS) -> int:
    """How many ticks a source that is late for the tick starting at ``sof_ns`` (ns, CLOCK_MONOTONIC) skips
    at ``now_ns``: 0 while it is at most ``late_max_periods`` periods late (the frame goes out late, and the
    ones after it catch up on the grid, as a camera's buffer queue delivers frames after a short host
    stall); beyond that, every whole tick already past, so the next frame sent is at most one period late
    and the skipped ids are lost frames."""
    late_ns = now_ns - sof_ns
    return int(late_ns // period_ns) if late_ns > late_max_periods * period_ns else 0


def _frame_count(text: str) -> int:
    """``--frames``: how many frames to send, an integer >= 0 (0: run until stopped); raises
    ``argparse.ArgumentTypeError`` (one line) otherwise."""
    return checked_int(text, lambda n: n >= 0, "give a number of frames >= 0 (0: run until stopped)")


MAX_START_DELAY_S = 60.0
"""Upper bound of ``--start-delay``, s: a minute, 60 times the default 1 s, which already leaves subscribers on this
host's IPC sockets ample time to connect (they take milliseconds); a longer wait is a typo, and 1e300 s overflowed
``time.sleep``'s timestamp in a traceback."""


def _start_delay_s(text: str) -> float:
    """``--start-delay``: seconds in [0, :data:`MAX_START_DELAY_S`]; raises ``argparse.ArgumentTypeError`` (one line)
    otherwise, nan and inf included."""
    return checked_float(text, lambda s: 0 <= s <= MAX_START_DELAY_S,
                         f"give a number of seconds >= 0 and <= {MAX_START_DELAY_S:g}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_priority_argument(p, CAMERA_PRIORITY, "camera")
    p.add_argument("--source", type=path_arg, help="video, image folder or image (default: mvtb-data traffic video)")
    p.add_argument("--rate", type=frame_rate_hz, default=20.0,
                   help=f"frames per second ({MIN_FRAME_RATE_HZ:g} to {MAX_FRAME_RATE_HZ:g}; default 20)")
    p.add_argument("--height", type=int, default=None,
                   help=f"frame height, px (default {DEFAULT_HW[0]}; --synthetic --native: {SYNTHETIC_NATIVE_HW[0]})")
    p.add_argument("--width", type=int, default=None,
                   help=f"frame width, px (default {DEFAULT_HW[1]}; --synthetic --native: {SYNTHETIC_NATIVE_HW[1]})")
    p.add_argument("--native", action="store_true",
                   help="keep the source's own size (ignores --height/--width); with --synthetic, openpilot's road "
                   f"camera frame, {SYNTHETIC_NATIVE_HW[1]}x{SYNTHETIC_NATIVE_HW[0]}, unless --width/--height "
                   "are given")
    p.add_argument(
        "--pixel-format",
        choices=sorted(PIXEL_FORMATS),
        default="bgr24",
        help="bgr24 (default) or nv12 (YUV 4:2:0, openpilot's camera format)",
    )
    p.add_argument(
        "--synthetic", action="store_true",
        help="a moving test pattern of --width x --height (with --native: "
        f"{SYNTHETIC_NATIVE_HW[1]}x{SYNTHETIC_NATIVE_HW[0]}) instead of --source",
    )
    p.add_argument("--frames", type=_frame_count, default=0,
                   help="stop after this many frames (>= 0; 0 = run until stopped, the default)")
    p.add_argument("--no-loop", action="store_true", help="stop at the end of the source instead of looping")
    p.add_argument(
        "--transport",
        choices=("auto", "inline", "shm"),
        default="auto",
        help="inline: pixels in the cameraFrame message; shm: in a shared-memory ring, only metadata on the bus "
        f"(msgs/visionipc.py); auto (default): inline up to {INLINE_MAX_BYTES >> 10} KiB a frame, else shm",
    )
    p.add_argument(
        "--start-delay",
        type=_start_delay_s,
        default=1.0,
        help=f"s, 0 to {MAX_START_DELAY_S:g}, between binding the socket and the first frame (default 1; a stop "
        "signal ends it at once): ZeroMQ drops what a PUB "
        "sends before a subscriber's connection is up, so subscribers get time to (re)connect",
    )


def frame_hw(args: argparse.Namespace) -> tuple[int, int]:
    """The (height, width) in px that ``args`` ask of a resized or synthetic source: ``--height`` / ``--width`` where
    given, else :data:`SYNTHETIC_NATIVE_HW` for ``--synthetic --native`` (a test pattern has no size of its own) and
    :data:`DEFAULT_HW` otherwise. A ``--native`` source that is not synthetic keeps its own size instead
    (:func:`iter_frames`)."""
    native = getattr(args, "synthetic", False) and getattr(args, "native", False)
    default = SYNTHETIC_NATIVE_HW if native else DEFAULT_HW
    height, width = getattr(args, "height", None), getattr(args, "width", None)
    return (default[0] if height is None else height, default[1] if width is None else width)


def frame_size_error(width: int, height: int, pixel_format: str, encoding: str) -> str | None:
    """Why a ``width`` x ``height`` frame (px) in ``pixel_format`` cannot be published, or None: its bytes
    (``msgs/frames.py`` ``frame_shape``) must fit the ``cameraFrame`` service's bound, which also bounds a ring
    slot (``msgs/services.py`` ``FRAME_MAX_BYTES``, 16 MiB). Checked before any source is opened, so the size is
    blamed and not the video."""
    try:
        rows, cols, channels = frame_shape(height, width, encoding)
    except ValueError as e:  # an odd-sized nv12 frame
        return str(e)
    if (size := rows * cols * channels) > FRAME_MAX_BYTES:
        return (f"--width {width} --height {height}: a {pixel_format} frame of {size} bytes, over the "
                f"{FRAME_MAX_BYTES >> 20} MiB a cameraFrame carries (msgs/services.py FRAME_MAX_BYTES); "
                "give a smaller size")
    return None


def run(args: argparse.Namespace) -> int:
    from chestnut.launch.assets import traffic_video_path

    synthetic = getattr(args, "synthetic", False)
    source: Path | str = args.source or ("" if synthetic else traffic_video_path())
    height, width = frame_hw(args)
    if args.rate <= 0 or width <= 0 or height <= 0:
        log.error("--rate, --width and --height must be > 0")
        return 2
    pixel_format = getattr(args, "pixel_format", "bgr24")
    encoding = PIXEL_FORMATS[pixel_format]
    if (synthetic or not getattr(args, "native", False)) and (why := frame_size_error(width, height,
                                                                                      pixel_format, encoding)):
        log.error("%s", why)
        return 2
    if synthetic:
        source = f"synthetic-{width}x{height}-{pixel_format}"
    try:  # open the source before binding: a bad source is a one-line error, not a traceback
        if synthetic:
            frames = synthetic_frames(height, width, pixel_format)
        else:
            native = getattr(args, "native", False)
            frames = iter_frames(
                Path(source),
                None if native else height,
                None if native else width,
                loop=not args.no_loop,
                pixel_format=pixel_format,
            )
        first = next(frames)
    except (FileNotFoundError, ValueError, StopIteration) as e:
        log.error("%s", e or f"camera source {source} has no frames")
        return 2
    flag = StopFlag()
    period_ns = int(1e9 / args.rate)
    pending: list[np.ndarray] = [first]
    transport = getattr(args, "transport", "auto")
    ring: FrameRing | None = None
    if transport == "inline" and (why := inline_frame_error(first, Path(source).name, encoding)):
        log.error("%s", why)
        return 2
    if transport == "shm" or (transport == "auto" and first.nbytes > INLINE_MAX_BYTES):  # before the first send
        try:
            ring = FrameRing(first.nbytes)
        except (FrameBufferError, ValueError) as e:
            log.error("%s", e)
            return 2
    try:
        return _publish(args, source, frames, pending, flag, period_ns, ring, encoding)
    finally:
        if ring is not None:
            ring.close()


def _publish(
    args: argparse.Namespace,
    source: Path | str,
    frames: Iterator[np.ndarray],
    pending: list[np.ndarray],
    flag: StopFlag,
    period_ns: int,
    ring: FrameRing | None,
    encoding: str,
) -> int:
    sent = skipped = 0
    # Python's cycle collections right after a frame goes out, never before its tick; the full one on entry,
    # before the priority
    with PubMaster(["cameraFrame"]) as pm, IdleCollector() as collector:
        # every check passed and its socket is open (a runtime directory it must not use was refused by then, the
        # refusal alone): now it publishes, at its priority -- every thread, zmq's I/O thread included
        apply_priority(getattr(args, "rt_priority", 0), "camera", log)
        rows, cols = pending[0].shape[:2]
        log.info(
            "camera: %s at %.1f Hz, %dx%d %s, %s",
            source,
            args.rate,
            cols,
            rows * 2 // 3 if encoding == "nv12" else rows,
            encoding,
            "inline" if ring is None else f"shared-memory ring of {ring.slots}",
        )
        flag.sleep(args.start_delay)  # a stop signal ends it at once: then no frame goes out
        t0 = time.monotonic_ns()
        frame_id = 0
        while not flag.stop and (args.frames == 0 or sent < args.frames):
            sof = t0 + frame_id * period_ns
            now = time.monotonic_ns()
            if behind := ticks_to_skip(now, sof, period_ns):  # fell far behind: those frames are lost
                frame_id += behind
                skipped += behind
                continue
            try:  # decode before the tick, so the frame goes out on it
                img = pending.pop() if pending else next(frames, None)
            except ValueError as e:
                log.error("%s", e)
                return 2
            if img is None:
                break
            now = time.monotonic_ns()
            if now < sof:
                flag.sleep((sof - now) / 1e9)
            if flag.stop:  # stopped while waiting for the tick: the last frame sent stays the last one
                break
            if ring is None:
                msg = fill_frame(frame_id, img, sof, time.monotonic_ns(), Path(source).name, encoding)
            else:  # the notice to the ring's subscribers first, then the metadata on the bus
                msg = ring_frame(ring, frame_id, img, sof, Path(source).name, encoding)
            pm.send("cameraFrame", msg)
            sent += 1
            frame_id += 1
            collector.collect_due()
        # deliver the last frames to every subscriber before the sockets go: destroy() closes them with the
        # linger and terminates the context, which waits it out; a close alone does not, since pyzmq never
        # terminates the context at exit (its Context __del__ skips it once the interpreter exits), and the
        # frames still queued for a subscriber behind the stream -- the logger, full-size frames inline -- died
        context().destroy(linger=STOP_LINGER_MS)
    log.info("camera: sent %d frames, skipped %d ticks", sent, skipped)
    return 0
