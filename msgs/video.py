"""Camera frames logged as video: one Matroska file per segment, written and read with PyAV.

openpilot's loggerd writes each segment's road camera to ``fcamera.hevc`` beside the rlog; ``chestnut
record --frames video`` (the default) does the same with ``<segment>/fcamera.mkv`` and logs each
``cameraFrame`` with its metadata only: ``data`` empty and ``video`` (``msgs/chestnut.capnp``
``VideoFrameRef``) naming the file, the frame's number in it (from 0, decode order), the encoder and
whether decoding gives the camera's bytes back exactly.

**Codecs** (:class:`VideoOptions`):

- ``ffv1`` (default, lossless): FFmpeg's FFV1 level 3 with a CRC per slice (``slicecrc``), and the
  logger's own CRC-32 of each frame in the log (``VideoFrameRef.crc32``), so a damaged frame is refused
  instead of giving wrong pixels. BGR / RGB frames are stored as ``bgr0`` (FFV1's
  reversible colour transform), ``gray8`` as ``gray``, ``nv12`` as ``yuv420p`` (its U and V planes
  de-interleaved, which only moves bytes). Every format round-trips bit-exactly
  (``tests/test_video_log.py``), so ``chestnut replay`` of a video-logged run sees the camera's bytes.
- ``h264`` (lossy, for long drives): libx264 at ``--crf`` (default 23, x264's own default), preset
  ``veryfast``, ``tune=zerolatency`` (no frames held in the encoder's look-ahead, so a killed logger
  loses no more than with FFV1) and a keyframe every :data:`H264_GOP` frames. Replay of such a log
  reports mismatches by design: the model sees other pixels than the node saw. Needs an even width and
  height (``yuv420p``).

**Crash bound**: every FFV1 frame is a keyframe, and FFmpeg's Matroska muxer (``libavformat/matroskaenc.c``
``mkv_write_packet``) starts a new cluster at a video keyframe once the open one holds more than 4 KiB,
writing out the previous one; ``cluster_time_limit`` (:data:`CLUSTER_TIME_LIMIT_MS`) does it for h264
between keyframes, and ``flush_packets`` hands every packet to the file at once. The file object is
flushed with the logs' flush policy. A SIGKILLed logger so leaves a file that decodes up to its last
written cluster: it loses the newest one or two frames, plus those still queued for the encoder thread
(:class:`SegmentVideo`, at most ``QUEUE_FRAMES``, none while it keeps up); a closed file ends with
Matroska's cues.

**Reading** (:class:`LoggedFrames`): one segment directory; a frame with ``video`` set is decoded from
its file, any other is read as ``msgs/frames.py`` ``frame_to_array`` reads it, so old raw logs read as
before. Refused in one line naming the file and the frame (:class:`VideoFrameError`, a ``ValueError``):
a file name that is not ``fcamera.mkv`` / ``fcamera-<n>.mkv`` (never a path), a missing, non-regular or
symlinked file, a stream that is not FFV1 / h264 or whose size differs from the frame's, a frame over
``msgs/services.py`` ``FRAME_MAX_BYTES``, a packet over :func:`packet_limit`, a frame past the end of a
truncated file, a frame that fails to decode, and a lossless frame whose decoded bytes do not have the
CRC-32 the logger recorded (``VideoFrameRef.crc32``: FFV1's own slice CRC only makes FFmpeg conceal a
damaged slice with the previous frame's, ``libavcodec/ffv1dec.c``). The rest of the log still reads.
"""

from __future__ import annotations

import os
import queue
import re
import stat
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import IO, Any

import av
import numpy as np

from chestnut.msgs.frames import frame_shape, frame_to_array
from chestnut.msgs.outdir import open_private
from chestnut.msgs.schema import log
from chestnut.msgs.services import FRAME_MAX_BYTES

__all__ = [
    "CLUSTER_TIME_LIMIT_MS",
    "FOXGLOVE_KEYFRAME_NS",
    "FRAME_MODES",
    "FoxgloveVideo",
    "FoxgloveVideoThread",
    "H264_GOP",
    "VIDEO_CODECS",
    "VIDEO_FILE",
    "LoggedFrames",
    "NotRegularFileError",
    "SegmentVideo",
    "VideoFrameError",
    "VideoOptions",
    "VideoWriter",
    "file_kind",
    "open_regular",
    "packet_limit",
    "pixels_crc32",
    "preview",
    "segment_videos",
    "video_event",
    "video_file_name",
]

FRAME_MODES = ("video", "raw")  # chestnut record --frames: pixels to a video file, or inline in the log
VIDEO_CODECS = {"ffv1": "ffv1", "h264": "libx264"}  # --video-codec -> FFmpeg encoder
VIDEO_FILE = "fcamera.mkv"  # the segment's first video file (openpilot's fcamera.hevc, in Matroska)
_VIDEO_FILE_RE = re.compile(r"fcamera(?:-([1-9][0-9]{0,3}))?\.mkv")
_DECODERS = ("ffv1", "h264")  # the codecs a logged video may hold
CRF_DEFAULT = 23  # libx264's own default constant rate factor
H264_PRESET = "veryfast"  # x264 preset: a 1928x1208 frame in ~20 ms of one core here
H264_GOP = 20  # frames between h264 keyframes: 1 s at 20 Hz, what a truncated file loses at most
CLUSTER_TIME_LIMIT_MS = 1000  # a Matroska cluster is closed (written) after this, like the logs' flush interval
TIME_BASE = Fraction(1, 1000)  # pts in ms since the file's first frame (Matroska's default timescale)

# (input format of the array handed to PyAV, the stream's pixel format) per (encoding, lossless)
_FORMATS: dict[tuple[str, bool], tuple[str, str]] = {
    ("bgr888", True): ("bgr24", "bgr0"),
    ("rgb888", True): ("rgb24", "bgr0"),
    ("gray8", True): ("gray", "gray"),
    ("nv12", True): ("yuv420p", "yuv420p"),
    ("bgr888", False): ("bgr24", "yuv420p"),
    ("rgb888", False): ("rgb24", "yuv420p"),
    ("gray8", False): ("gray", "gray"),
    ("nv12", False): ("yuv420p", "yuv420p"),
}


class NotRegularFileError(FileNotFoundError):
    """A FIFO, socket, device, directory or symlink where a regular file belongs (so no such *file*: a
    ``FileNotFoundError``, which every offline tool reports in one line); ``kind`` names what is there.

    Every such path is one we read, never one we write, so ``fix`` says what to give instead: it is never
    "remove it" (``/dev/zero`` named as a log is not the user's to remove)."""

    def __init__(self, path: str | os.PathLike[str], kind: str, fix: str = "give a regular file") -> None:
        super().__init__(f"{os.fspath(path)}: {kind}, not a regular file; {fix}")
        self.kind, self.fix = kind, fix


_FILE_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symlink"),
)


def file_kind(mode: int) -> str:
    """What ``mode`` (an ``st_mode``) is, in words: "a regular file", "a FIFO", "a symlink", ..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a file")


def open_regular(path: str | os.PathLike[str], follow: bool = False) -> int:
    """A read-only fd of ``path``, which must be a regular file: never a FIFO, socket or device (opening a
    FIFO waits for a writer, forever for a planted one: ``open(2)``), nor a symlink unless ``follow``.

    ``lstat`` (``stat`` with ``follow``) first, so that a FIFO or device is never opened at all; then
    ``O_NONBLOCK`` (a FIFO swapped in meanwhile opens at once), ``O_NOFOLLOW`` unless ``follow``, and an
    ``fstat`` of what was opened. Raises :class:`NotRegularFileError`, FileNotFoundError and OSError (ELOOP
    for a symlink swapped in between the two looks). The fd is blocking again on return."""
    st = os.stat(path) if follow else os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(path, file_kind(st.st_mode))
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(path, file_kind(mode))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class VideoFrameError(ValueError):
    """A logged frame whose pixels cannot be read from its video file. ``str()`` is one line naming the
    file and the frame number, what is wrong and what to do; ``problem`` is the part after them."""

    def __init__(self, where: str, index: int, problem: str) -> None:
        super().__init__(f"{where} frame {index}: {problem}")
        self.where, self.index, self.problem = where, index, problem


@dataclass(frozen=True)
class VideoOptions:
    """How ``chestnut record`` encodes frames: ``codec`` ``"ffv1"`` (lossless) or ``"h264"`` (lossy, at
    ``crf``, 0-51, lower is better). Raises ValueError for anything else."""

    codec: str = "ffv1"
    crf: int = CRF_DEFAULT

    def __post_init__(self) -> None:
        if self.codec not in VIDEO_CODECS:
            raise ValueError(f"--video-codec must be one of {', '.join(VIDEO_CODECS)}, got {self.codec!r}")
        if not 0 <= self.crf <= 51:
            raise ValueError(f"--crf must be 0..51 (x264's range), got {self.crf}")

    @property
    def lossless(self) -> bool:
        return self.codec == "ffv1"

    @property
    def encoder(self) -> str:
        return VIDEO_CODECS[self.codec]


def video_file_name(k: int) -> str:
    """The segment's ``k``-th video file (from 0): ``fcamera.mkv``, then ``fcamera-1.mkv``, ... (a new
    file whenever the frames' size or encoding changes)."""
    return VIDEO_FILE if k == 0 else f"fcamera-{k}.mkv"


MAX_VIDEO_FILES = 10_000  # fcamera.mkv, fcamera-1.mkv ... fcamera-9999.mkv: the names _VIDEO_FILE_RE takes


def segment_videos(segment_file: Path, strict: bool = True) -> list[Path]:
    """The video files beside a segment file, in order (:func:`video_file_name`; the rlog's
    ``VideoFrameRef`` names them by file name), up to the first absent one. Never followed: a symlink,
    FIFO or device among them raises :class:`NotRegularFileError` (``strict``) or ends the list there."""
    videos = []
    for k in range(MAX_VIDEO_FILES):
        video = segment_file.parent / video_file_name(k)
        try:
            mode = video.lstat().st_mode
        except FileNotFoundError:
            break
        if not stat.S_ISREG(mode):
            if strict:
                raise NotRegularFileError(video, file_kind(mode), "give a log whose video files are regular files")
            break
        videos.append(video)
    return videos


def packet_limit(frame_bytes: int) -> int:
    """Largest compressed packet read for a frame of ``frame_bytes`` raw bytes: twice the raw size plus
    64 KiB (FFV1 and h264 never need more than a little over the raw size; our bound)."""
    return 2 * frame_bytes + (64 << 10)


def _nv12_to_yuv420p(a: np.ndarray, h: int, w: int) -> np.ndarray:
    """[H*3/2, W(, 1)] nv12 -> [H*3/2, W] yuv420p (Y, then the U plane, then the V plane): bytes moved only."""
    flat = a.reshape(h * 3 // 2, w)
    uv = flat[h:].reshape(h // 2, w // 2, 2)
    return np.concatenate([flat[:h].reshape(-1), uv[:, :, 0].reshape(-1), uv[:, :, 1].reshape(-1)]).reshape(
        h * 3 // 2, w
    )


def _yuv420p_to_nv12(a: np.ndarray, h: int, w: int) -> np.ndarray:
    """The inverse of :func:`_nv12_to_yuv420p`, as a [H*3/2, W, 1] nv12 array."""
    flat = a.reshape(-1)
    q = (h // 2) * (w // 2)
    out = np.empty((h * 3 // 2, w), np.uint8)
    out[:h] = flat[: h * w].reshape(h, w)
    uv = out[h:].reshape(h // 2, w // 2, 2)
    uv[:, :, 0] = flat[h * w : h * w + q].reshape(h // 2, w // 2)
    uv[:, :, 1] = flat[h * w + q : h * w + 2 * q].reshape(h // 2, w // 2)
    return out[:, :, None]


class VideoWriter:
    """One Matroska file of ``width`` x ``height`` frames in ``encoding`` (a ``CameraFrame.PixelEncoding``
    name), created 0600 and exclusively (``msgs/outdir.py`` ``open_private``). :meth:`write` takes a
    uint8 array of ``msgs/frames.py`` ``frame_shape`` and returns its frame number. Raises ValueError
    for an encoding or size the codec cannot store (h264: even width and height)."""

    def __init__(self, path: Path, width: int, height: int, encoding: str, options: VideoOptions) -> None:
        self.path = Path(path)
        self.width, self.height, self.encoding, self.options = int(width), int(height), str(encoding), options
        key = (self.encoding, options.lossless)
        if key not in _FORMATS:
            raise ValueError(f"no video format for {self.encoding!r} frames")
        self.shape = frame_shape(self.height, self.width, self.encoding)
        if not options.lossless and (self.width % 2 or self.height % 2):
            raise ValueError(f"h264 needs an even width and height, not {self.width}x{self.height}")
        self._in_fmt, pix_fmt = _FORMATS[key]
        self.frames = 0
        self._first_ms: int | None = None
        self._last_pts = -1
        self._fh: IO[bytes] = open_private(self.path, "xb")
        try:
            self._container: Any = av.open(
                self._fh,
                "w",
                format="matroska",
                options={"flush_packets": "1", "cluster_time_limit": str(CLUSTER_TIME_LIMIT_MS)},
            )
            stream: Any = self._container.add_stream(options.encoder, rate=20)
            stream.width, stream.height, stream.pix_fmt = self.width, self.height, pix_fmt
            stream.time_base = TIME_BASE
            if options.lossless:
                stream.options = {"level": "3", "slicecrc": "1", "g": "1"}
            else:
                stream.options = {
                    "crf": str(options.crf),
                    "preset": H264_PRESET,
                    "tune": "zerolatency",
                    "g": str(H264_GOP),
                }
            self._stream = stream
        except BaseException:
            self._fh.close()
            raise

    def write(self, pixels: np.ndarray, t_ns: int) -> int:
        """Encode one frame (``t_ns``: its time, ns, for the file's timestamps); returns its number."""
        index = self.reserve(pixels)
        self.encode(pixels, t_ns)
        return index

    def reserve(self, pixels: np.ndarray) -> int:
        """The number the next frame gets; raises ValueError for pixels of another size (nothing reserved)."""
        if pixels.size != int(np.prod(self.shape)):
            raise ValueError(f"{self.path}: a {pixels.shape} frame for a {self.shape} video")
        index = self.frames
        self.frames += 1
        return index

    def encode(self, pixels: np.ndarray, t_ns: int) -> None:
        """Encode the frame :meth:`reserve` numbered (frames in the order reserved)."""
        if self.encoding == "nv12":
            arr = _nv12_to_yuv420p(pixels, self.height, self.width)
        elif self.encoding == "gray8":
            arr = pixels.reshape(self.height, self.width)
        else:
            arr = np.ascontiguousarray(pixels).reshape(self.height, self.width, 3)
        frame = av.VideoFrame.from_ndarray(arr, format=self._in_fmt)
        if self._in_fmt != self._stream.pix_fmt:
            frame = frame.reformat(format=self._stream.pix_fmt)
        ms = t_ns // 1_000_000
        if self._first_ms is None:
            self._first_ms = ms
        pts = max(ms - self._first_ms, self._last_pts + 1)  # strictly increasing
        self._last_pts = pts
        frame.pts, frame.time_base = pts, TIME_BASE
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def flush(self, fsync: bool = False) -> None:
        """Hand what the muxer wrote to the OS (and to the disk with ``fsync``)."""
        self._fh.flush()
        if fsync:
            os.fsync(self._fh.fileno())

    def close(self, fsync: bool = False) -> None:
        """Drain the encoder, write Matroska's cues and close the file."""
        try:
            for packet in self._stream.encode():
                self._container.mux(packet)
            self._container.close()
            self.flush(fsync)
        finally:
            self._fh.close()


class SegmentVideo:
    """The video files of one segment directory (``RouteWriter``'s, ``msgs/logfile.py``): the first frame
    opens ``fcamera.mkv``; a frame of another size or encoding closes it and opens the next
    (:func:`video_file_name`). Frames are numbered at once and encoded by a thread of their own (PyAV
    releases the GIL in ``avcodec_send_frame``), so the logger keeps reading the camera's ring while a
    big frame is encoded; at most :data:`QUEUE_FRAMES` wait for it (:meth:`add` blocks beyond). Flushes
    with the logs' policy: every ``every_messages`` frames or ``interval_s`` seconds (``clock``, s),
    checked on :meth:`add` and :meth:`maybe_flush`. A write error of the thread is raised by the next
    call."""

    QUEUE_FRAMES = 8  # 28 MB of 1928x1208 NV12 frames; 0.4 s at 20 Hz

    def __init__(
        self,
        seg_dir: Path,
        options: VideoOptions,
        every_messages: int,
        interval_s: float,
        fsync: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.seg_dir = Path(seg_dir)
        self.options = options
        self.every_messages, self.interval_s, self.fsync = every_messages, interval_s, fsync
        self._clock = clock
        self._writer: VideoWriter | None = None
        self._files = 0
        self._pending = 0
        self._last_flush_s = clock()
        self.paths: list[Path] = []
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue(maxsize=self.QUEUE_FRAMES)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closing = False  # the thread was told to end

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _put(self, item: tuple[Any, ...]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._encode_loop, name="chestnut-video", daemon=True)
            self._thread.start()
        self._queue.put(item)

    def _encode_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            op, writer, *rest = item
            try:
                if op == "frame":
                    writer.encode(*rest)
                elif op == "flush":
                    writer.flush(self.fsync)
                else:
                    writer.close(self.fsync)
            except Exception as e:  # raised in the logger's thread by its next call, as a write error
                if self._error is None:
                    self._error = e if isinstance(e, OSError) else OSError(f"{writer.path}: cannot encode: {e}")

    def add(self, width: int, height: int, encoding: str, pixels: np.ndarray, t_ns: int) -> tuple[str, int]:
        """Number one frame and queue it for encoding; returns (file name, frame number). Raises
        ValueError when the codec cannot store it (nothing is written then) and OSError for a write error."""
        self._raise_error()
        w = self._writer
        if w is None or (w.width, w.height, w.encoding) != (width, height, encoding):
            path = self.seg_dir / video_file_name(self._files)
            new = VideoWriter(path, width, height, encoding, self.options)  # ValueError: the old file stays open
            self._files += 1
            self.paths.append(path)
            if w is not None:
                self._put(("close", w))
            self._writer = w = new
        index = w.reserve(pixels)
        self._put(("frame", w, pixels, t_ns))
        self._pending += 1
        self.maybe_flush()
        return w.path.name, index

    def maybe_flush(self) -> None:
        self._raise_error()
        if self._writer is None or not self._pending:
            return
        if self._pending >= self.every_messages or self._clock() - self._last_flush_s >= self.interval_s:
            self._put(("flush", self._writer))
            self._pending = 0
            self._last_flush_s = self._clock()

    def close(self, wait: bool = True) -> None:
        """Encode what is queued, close the open file cleanly (encoder drained, cues written) and end the
        thread; with ``wait`` False the thread does it while the caller goes on (a segment rollover must
        not stall the logger's reading of the ring), and :meth:`join` waits. Idempotent; raises a write
        error of the thread when it waited."""
        w, self._writer = self._writer, None
        if w is not None:
            self._put(("close", w))
        if self._thread is not None and not self._closing:
            self._closing = True
            self._queue.put(None)
        if wait:
            self.join()

    def join(self) -> None:
        """Wait for the thread to finish closing; raises its write error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_error()


FOXGLOVE_KEYFRAME_NS = 1_000_000_000
"""ns between keyframes of the ``foxglove.CompressedVideo`` stream (:class:`FoxgloveVideo`): Foxglove
decodes from the keyframe before the point it seeks to, so a seek decodes at most 1 s of frames."""
FOXGLOVE_VIDEO_PRESET = "ultrafast"
"""x264 preset of the Foxglove stream: the view, not the record (the FFV1 file is); ~28 ms of CPU for a
1928x1208 frame of noise here, ~1 ms for the default 256x128 frame (x264's fastest preset)."""
FOXGLOVE_VIDEO_CRF = 23  # libx264's own default constant rate factor


class FoxgloveVideo:
    """Camera frames as H.264 for Foxglove's ``foxglove.CompressedVideo`` (format ``h264``): one Annex B
    access unit per frame, at the frame's own size, no B-frames (``tune=zerolatency``: each frame's unit
    comes out of :meth:`encode` at once, as Foxglove wants one frame per message), and an IDR keyframe
    (with SPS / PPS) on the first frame and then once :data:`FOXGLOVE_KEYFRAME_NS` passed since the last.

    :meth:`encode` takes a uint8 array of ``msgs/frames.py`` ``frame_shape`` (``bgr888``, ``rgb888``,
    ``gray8`` or ``nv12``) and its time (ns); a frame of another size or encoding than the one before
    starts a new stream (a keyframe). An odd width or height loses its last column or row (4:2:0 needs
    even ones). Returns ``(data, keyframe)``."""

    def __init__(self, preset: str = FOXGLOVE_VIDEO_PRESET, crf: int = FOXGLOVE_VIDEO_CRF) -> None:
        self.preset, self.crf = preset, crf
        self._ctx: Any = None
        self._key: tuple[int, int, str] | None = None
        self._last_key_ns: int | None = None
        self._first_ms = 0
        self._last_pts = -1
        self.frames = 0

    def _open(self, width: int, height: int) -> None:
        ctx = av.CodecContext.create("libx264", "w")
        ctx.width, ctx.height, ctx.pix_fmt = width, height, "yuv420p"
        ctx.time_base = TIME_BASE
        ctx.options = {
            "preset": self.preset,
            "tune": "zerolatency",
            "crf": str(self.crf),
            "forced-idr": "1",  # a keyframe asked for (pict_type I) is an IDR, where a decoder may start
            "g": "1000000",  # keyframes come from the time rule, not from x264's own interval
        }
        ctx.open()
        self._ctx = ctx

    def encode(self, pixels: np.ndarray, width: int, height: int, encoding: str, t_ns: int) -> tuple[bytes, bool]:
        w, h = int(width) & ~1, int(height) & ~1
        if w == 0 or h == 0:
            raise ValueError(f"a {width}x{height} frame is too small for H.264")
        key = (int(width), int(height), str(encoding))
        if key != self._key:
            self._open(w, h)
            self._key, self._last_key_ns, self._last_pts = key, None, -1
            self._first_ms = t_ns // 1_000_000
        if encoding == "nv12":
            img = pixels.reshape(int(height) * 3 // 2, int(width))
            frame = av.VideoFrame.from_ndarray(_nv12_to_yuv420p(img, int(height), int(width)), format="yuv420p")
        else:
            fmt = {"bgr888": "bgr24", "rgb888": "rgb24", "gray8": "gray"}.get(str(encoding), "bgr24")
            chans = 1 if fmt == "gray" else 3
            arr = pixels.reshape(int(height), int(width), chans)[:h, :w]
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(arr if chans == 3 else arr[:, :, 0]), format=fmt)
        if frame.width != w or frame.height != h or frame.format.name != "yuv420p":
            frame = frame.reformat(width=w, height=h, format="yuv420p")
        pts = max(t_ns // 1_000_000 - self._first_ms, self._last_pts + 1)  # ms, strictly increasing
        self._last_pts = pts
        frame.pts, frame.time_base = pts, TIME_BASE
        want_key = self._last_key_ns is None or t_ns - self._last_key_ns >= FOXGLOVE_KEYFRAME_NS
        if want_key:
            frame.pict_type = av.video.frame.PictureType.I
        packets = self._ctx.encode(frame)
        keyframe = any(p.is_keyframe for p in packets)
        if keyframe:
            self._last_key_ns = t_ns
        self.frames += 1
        return b"".join(bytes(p) for p in packets), keyframe


FOXGLOVE_QUEUE_FRAMES = 4  # frames waiting for the Foxglove encoder thread (200 ms at 20 Hz)


class FoxgloveVideoThread:
    """:class:`FoxgloveVideo` in a thread of its own, so the logger's loop does not wait for an encode (PyAV
    releases the GIL while x264 works). :meth:`submit` queues a frame with ``meta`` (anything, returned with
    its unit); :meth:`results` hands back ``(meta, unit)`` of the frames encoded since, in order. At most
    :data:`FOXGLOVE_QUEUE_FRAMES` wait: with ``drop`` a frame that finds the queue full is not encoded
    (counted in ``dropped``; the Foxglove view skips it, the record keeps it), else :meth:`submit` waits.
    A frame the encoder refuses is counted in ``refused``, the first reason kept in ``first_error``.
    :meth:`close` waits for the queued frames and returns their results."""

    def __init__(self, drop: bool = True, queue_frames: int = FOXGLOVE_QUEUE_FRAMES) -> None:
        self.video = FoxgloveVideo()
        self.drop = drop
        self.dropped = self.refused = 0
        self.first_error = ""
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_frames)
        self._lock = threading.Lock()
        self._out: list[tuple[Any, bytes]] = []
        self._thread = threading.Thread(target=self._loop, name="foxglove-video", daemon=True)
        self._thread.start()

    def submit(self, pixels: np.ndarray, width: int, height: int, encoding: str, t_ns: int, meta: Any) -> bool:
        """Queue one frame (``FoxgloveVideo.encode``'s arguments); False when it was dropped."""
        item = (pixels, width, height, encoding, t_ns, meta)
        if not self.drop:
            self._queue.put(item)
            return True
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            pixels, width, height, encoding, t_ns, meta = item
            try:
                unit, _ = self.video.encode(pixels, width, height, encoding, t_ns)
            except (ValueError, av.FFmpegError) as e:
                with self._lock:
                    self.refused += 1
                    self.first_error = self.first_error or str(e)
                continue
            if unit:
                with self._lock:
                    self._out.append((meta, unit))

    def results(self) -> list[tuple[Any, bytes]]:
        """The ``(meta, unit)`` encoded since the last call, in submission order."""
        with self._lock:
            out, self._out = self._out, []
        return out

    def close(self) -> list[tuple[Any, bytes]]:
        """Encode what is queued, end the thread; the last :meth:`results`."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        return self.results()


PREVIEW_MAX_BYTES = 64 << 10
"""Pixels of the ``/camera/image`` preview in a live JSON MCAP when frames are logged as video (our
choice): the 128x256 default frame at half size (24 KB), 1928x1208 at 1/11 (175x109); the MCAP is
Foxglove's view, the rlog and the video are the record, and ``chestnut export`` writes full frames."""


def preview(pixels: np.ndarray, width: int, height: int, encoding: str) -> tuple[int, int, str, bytes]:
    """A Foxglove ``RawImage`` preview of a frame: (width, height, RawImage encoding, bytes), every
    ``k``-th pixel of every ``k``-th row for the smallest integer ``k`` that fits
    :data:`PREVIEW_MAX_BYTES`; ``nv12`` is scaled and converted to ``bgr8`` by FFmpeg's swscale."""
    channels = 1 if encoding == "gray8" else 3
    k = 1
    while (width // k) * (height // k) * channels > PREVIEW_MAX_BYTES:
        k += 1
    w, h = max(1, width // k), max(1, height // k)
    if encoding == "nv12":
        frame = av.VideoFrame.from_ndarray(pixels.reshape(height * 3 // 2, width), format="nv12")
        img = frame.reformat(width=w, height=h, format="bgr24").to_ndarray()
        return w, h, "bgr8", np.ascontiguousarray(img).tobytes()
    img = pixels.reshape(height, width, channels)[: h * k : k, : w * k : k]
    name = {"bgr888": "bgr8", "rgb888": "rgb8", "gray8": "mono8"}.get(encoding, "bgr8")
    return w, h, name, np.ascontiguousarray(img).tobytes()


def pixels_crc32(pixels: np.ndarray) -> int:
    """CRC-32 (zlib's) of a frame's bytes, C order: what ``VideoFrameRef.crc32`` records (~1.5 ms for a
    3.5 MB frame here)."""
    return zlib.crc32(np.ascontiguousarray(pixels).data.cast("B"))


def video_event(event: Any, file: str, index: int, options: VideoOptions, crc32: int = 0) -> bytes:
    """The bytes of the ``cameraFrame`` Event ``event`` as logged with its pixels in a video: every field
    kept (``buffer`` too, when the frame travelled through the ring) except ``data``, which is empty, and
    ``video`` saying the pixels are frame ``index`` of ``file``, with their ``crc32``
    (:func:`pixels_crc32`; 0: not recorded). Built afresh, since a Cap'n Proto message keeps the space of
    a field it no longer points to."""
    d = event.to_dict()
    cf = d["cameraFrame"]
    cf.pop("data", None)
    cf["video"] = {
        "file": file,
        "index": index,
        "codec": options.encoder,
        "lossless": options.lossless,
        "crc32": crc32,
    }
    return bytes(log.Event.new_message(**d).to_bytes())


# ---------------------------------------------------------------- reading


class _VideoFile:
    """Sequential decoder of one video file; frames asked for in increasing order are decoded once."""

    def __init__(self, path: Path, width: int, height: int, encoding: str) -> None:
        self.path = path
        self.width, self.height, self.encoding = width, height, encoding
        self.shape = frame_shape(height, width, encoding)
        self.frame_bytes = int(np.prod(self.shape))
        self.ended_at: int | None = None  # frames in the file, once its end (or damage) was met
        self.end_reason = ""
        self._container: Any = None
        self._frames: Any = None
        self._next = 0
        self._fh: IO[bytes] | None = None
        self._open()

    def _fail(self, index: int, problem: str) -> VideoFrameError:
        return VideoFrameError(str(self.path), index, problem)

    def _open(self) -> None:
        self.close()
        try:
            fd = open_regular(self.path)
        except NotRegularFileError as e:
            raise self._fail(
                0, f"{e.kind}, not a regular file: refused (a video is read only from a regular file, never followed)"
            ) from None
        except FileNotFoundError:
            raise self._fail(0, "missing: the log names a video file that is not in the segment directory") from None
        except OSError as e:
            raise self._fail(0, f"cannot be opened ({e.strerror}); a symlink is never followed") from None
        fh = os.fdopen(fd, "rb")
        try:
            container = av.open(fh, "r", format="matroska")
        except (av.FFmpegError, ValueError, OSError) as e:
            fh.close()
            raise self._fail(0, f"not a readable Matroska file ({e})") from None
        try:
            if not container.streams.video:
                raise self._fail(0, "holds no video stream")
            stream = container.streams.video[0]
            ctx = stream.codec_context
            if ctx.name not in _DECODERS:
                raise self._fail(0, f"codec {ctx.name!r} is not one chestnut record writes ({', '.join(_DECODERS)})")
            if (ctx.width, ctx.height) != (self.width, self.height):
                raise self._fail(
                    0, f"the stream is {ctx.width}x{ctx.height}, the log says {self.width}x{self.height} (WxH)"
                )
        except BaseException:
            container.close()
            fh.close()
            raise
        self._fh, self._container, self._next = fh, container, 0
        self._frames = self._decode(stream)

    def _decode(self, stream: Any) -> Any:
        limit = packet_limit(self.frame_bytes)
        for packet in self._container.demux(stream):
            if packet.size > limit:
                raise ValueError(f"a packet of {packet.size} bytes (at most {limit} for this frame size)")
            yield from packet.decode()

    def frame(self, index: int) -> np.ndarray:
        """Frame ``index`` (from 0) as a uint8 array of ``frame_shape``; raises VideoFrameError."""
        if self.ended_at is not None and index >= self.ended_at:
            raise self._fail(index, self.end_reason)
        if index < self._next or self._frames is None:
            self._open()
        while True:
            try:
                frame = next(self._frames)
            except StopIteration:
                self._end(f"the file ends after {self._next} frame(s) (truncated: the logger was killed?)")
                raise self._fail(index, self.end_reason) from None
            except (av.FFmpegError, ValueError, OSError) as e:
                self._end(f"unreadable after {self._next} frame(s): {e}")
                raise self._fail(index, self.end_reason) from None
            n = self._next
            self._next += 1
            if n == index:
                return self._pixels(frame, index)

    def _end(self, reason: str) -> None:
        self.ended_at, self.end_reason = self._next, reason
        self._frames = None

    def _pixels(self, frame: Any, index: int) -> np.ndarray:
        if (frame.width, frame.height) != (self.width, self.height):
            raise self._fail(index, f"decoded {frame.width}x{frame.height}, the log says {self.width}x{self.height}")
        if self.encoding == "nv12":
            return _yuv420p_to_nv12(frame.to_ndarray(format="yuv420p"), self.height, self.width)
        if self.encoding == "gray8":
            return frame.to_ndarray(format="gray").reshape(self.shape).copy()
        fmt = "rgb24" if self.encoding == "rgb888" else "bgr24"
        return np.ascontiguousarray(frame.to_ndarray(format=fmt)).reshape(self.shape)

    def close(self) -> None:
        if self._frames is not None:
            self._frames.close()
            self._frames = None
        if self._container is not None:
            self._container.close()
            self._container = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class LoggedFrames:
    """Pixels of the ``cameraFrame`` messages of one log segment (``seg_dir``: the directory of its rlog).

    :meth:`read` returns a uint8 array of ``msgs/frames.py`` ``frame_shape`` ([H, W, 3]; [H, W, 1] for
    ``gray8``; [H * 3/2, W, 1] for ``nv12``) for a frame logged either way: decoded from its video file
    (``video`` set), or ``frame_to_array``'s. Raises :class:`VideoFrameError` (see the module doc) and
    ``frame_to_array``'s ValueError. At most :data:`OPEN_FILES` files are open at once.
    """

    OPEN_FILES = 2

    def __init__(self, seg_dir: Path | str | None) -> None:
        self.seg_dir = None if seg_dir is None else Path(seg_dir)
        self._files: dict[str, _VideoFile] = {}
        self._failed: dict[str, str] = {}  # file name -> why it cannot be opened

    @staticmethod
    def in_video(cf: Any) -> bool:
        return bool(cf._has("video")) and len(cf.data) == 0

    def read(self, cf: Any) -> np.ndarray:
        if not self.in_video(cf):
            return frame_to_array(cf)
        ref = cf.video
        name, index = str(ref.file), int(ref.index)
        if not _VIDEO_FILE_RE.fullmatch(name):
            raise VideoFrameError(
                f"cameraFrame {cf.frameId}: video file {name!r}",
                index,
                "not a name chestnut record writes (fcamera.mkv, fcamera-<n>.mkv); the log was not written by it",
            )
        width, height, encoding = int(cf.width), int(cf.height), str(cf.encoding)
        where = (self.seg_dir or Path(".")) / name
        h, w, c = frame_shape(height, width, encoding)
        if h * w * c > FRAME_MAX_BYTES:
            raise VideoFrameError(
                str(where),
                index,
                f"{width}x{height} {encoding} is {h * w * c} bytes, over the {FRAME_MAX_BYTES}-byte frame bound "
                "(msgs/services.py FRAME_MAX_BYTES); refused",
            )
        if name in self._failed:
            raise VideoFrameError(str(where), index, self._failed[name])
        video = self._files.get(name)
        if video is not None and (video.width, video.height, video.encoding) != (width, height, encoding):
            raise VideoFrameError(
                str(where),
                index,
                f"the log says {width}x{height} {encoding}, its earlier frames {video.width}x{video.height} "
                f"{video.encoding}",
            )
        if video is None:
            while len(self._files) >= self.OPEN_FILES:
                self._files.pop(next(iter(self._files))).close()
            try:
                video = _VideoFile(where, width, height, encoding)
            except VideoFrameError as e:
                self._failed[name] = e.problem
                raise VideoFrameError(str(where), index, e.problem) from None
            self._files[name] = video
        pixels = video.frame(index)
        crc = int(ref.crc32)
        if ref.lossless and crc and pixels_crc32(pixels) != crc:
            raise VideoFrameError(
                str(where),
                index,
                f"decodes to other bytes than the camera sent (CRC-32 {pixels_crc32(pixels):08x}, logged "
                f"{crc:08x}): the video file is damaged",
            )
        return pixels

    def close(self) -> None:
        for video in self._files.values():
            video.close()
        self._files.clear()

    def __enter__(self) -> LoggedFrames:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
