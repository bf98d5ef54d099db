"""``chestnut record``: subscribe to every logged service and write log segments (openpilot's loggerd).

Every service of :data:`~chestnut.msgs.services.SERVICE_LIST` with ``should_log`` (or the ones named
with ``--services``) is received on its own SUB socket and written, byte for byte as published (camera
frames logged as video excepted, below), to ``<log-dir>/<route>--<n>/rlog.zst`` and ``rlog.mcap``
(:mod:`chestnut.msgs.logfile`), segments of ``--segment-seconds`` (default 60 s). ``--logs qlog|both``
adds the light log (``qlog.*``: every ``decimation``-th message of a service). ``--format zst|mcap``
writes one format only.
``--mcap-encoding``: the MCAP files' channels: ``json`` (JSON Schema generated from the Cap'n Proto
schema, frames as ``foxglove.RawImage``: what Foxglove opens, :mod:`chestnut.msgs.jsonschema`),
``capnproto`` (the published bytes) or ``both``; ``auto`` (default) is ``json`` when the rlog is
also written (it already holds the exact bytes for replay) and ``both`` when MCAP is the only format.
``--format mcap --mcap-encoding json`` (JSON only, no rlog) is said in one WARNING at the start: Foxglove opens such
a log, but ``chestnut check`` and ``replay`` cannot read it (:data:`JSON_ONLY_WARNING`).

- ``--frames video`` (default): each segment's camera frames go to ``<segment>/fcamera.mkv``
  (``msgs/video.py``: ``--video-codec ffv1``, lossless, the default, so replay sees the camera's bytes;
  ``--video-codec h264 --crf 23`` for long drives, lossy: replay then reports mismatches by design), and
  the logs keep each ``cameraFrame``'s metadata with ``video`` (file, frame number, CRC-32) and no
  pixels; a JSON MCAP's ``/camera/image`` is a preview of at most 64 KiB (``msgs/video.py``
  ``preview``; ``chestnut export`` writes full frames) and its ``/camera/video`` the frames at full size
  as ``foxglove.CompressedVideo`` (H.264, ``msgs/video.py`` ``FoxgloveVideo``), whatever ``--frames``.
  A frame the codec cannot store (h264 and an odd size) or whose ``data`` does not match its size is
  logged raw instead, counted (``frames_raw``).
  ``--frames raw``: the pixels inline in ``data``, as before. Either way a frame's pixels are read when
  it is received, from ``data`` or from the camera's shared-memory ring (``msgs/visionipc.py``;
  ``buffer`` kept in the log), so a log holds every frame's pixels whichever way it travelled; a ring
  frame the camera overwrote before the logger read it is logged without them and counted
  (``frames_unread``).
- Every segment after the first begins, right after the logger's own header, with the most recent ``initData``
  the logger wrote (the node's configuration; ``msgs/logfile.py`` ``CARRIED_SERVICES``, as openpilot's loggerd
  writes its ``init_data`` into every segment), so ``chestnut check`` / ``replay`` of one segment alone judge it by
  the run's configuration, not ``launch/node.toml``'s.
- Every received message is checked with :func:`~chestnut.msgs.messaging.log_from_bytes` (bounded
  traversal); malformed ones, and ones whose union member is not the socket's service, are counted
  per (service, reason), the first of each logged, and skipped. A message over its service's bound never
  arrives: ZeroMQ drops it with the connection, which is made again and said in one WARNING line naming the
  service and the bound, at most one a minute with the count since (``msgs/messaging.py`` ``SubSocket.heal``);
  the log itself holds no record of it (the schema has none, and its size is never read).
- Buffers are bounded: ZeroMQ keeps at most ``--rcvhwm`` messages per service (newer ones are
  dropped by ZeroMQ while the logger lags), one loop drains at most :data:`DRAIN_MAX_MESSAGES` per
  socket, and the writers hold one zstd block / one MCAP chunk (1 MiB) per file. Messages drained
  together are written in ``logMonoTime`` order.
- The flush policy (``--flush-messages``, ``--flush-seconds``) bounds what a crash loses; the loop
  wakes at least every :data:`POLL_MS` ms so the time bound holds without traffic.
- SIGINT / SIGTERM: the loop ends within one poll; what the sockets already hold is still written (for at
  most :data:`STOP_DRAIN_S`: a logger behind the stack at its stop keeps the stack's last messages, which
  the publishers sent before they stopped), the open segment is closed cleanly (zstd frame ended, MCAP
  summary and footer written) and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any

import zmq

from chestnut.msgs.argtypes import checked_float, checked_int, path_arg, positive_seconds
from chestnut.msgs.frames import frame_to_array
from chestnut.msgs.logfile import FORMATS, MCAP_ENCODINGS, SEGMENT_SECONDS, FlushPolicy, RouteWriter
from chestnut.msgs.messaging import REASON_WRONG_SERVICE, MalformedMessageError, SubSocket, log_from_bytes, sub_sock
from chestnut.msgs.outdir import OutputDirError, missing_folder, private_dir
from chestnut.msgs.paths import check_prefix, current_prefix, runtime_dir
from chestnut.msgs.services import SERVICE_LIST, UnknownServiceError, get_service
from chestnut.msgs.video import CRF_DEFAULT, FRAME_MODES, VIDEO_CODECS, VideoOptions
from chestnut.msgs.visionipc import FrameBufferError, FrameOverwrittenError, FrameReader

_log = logging.getLogger("chestnut.record")

POLL_MS = 100  # ms; bounds the reaction to SIGINT/SIGTERM and the granularity of time-based flushes
RCVHWM_MESSAGES = 100  # per service: ZeroMQ receive queue (100 frames of 128x256x3 = 9.8 MB at most)
DRAIN_MAX_MESSAGES = 200  # per socket per loop, so one busy service cannot starve the others
STATUS_INTERVAL_S = 60.0  # s between INFO lines with the counters
STOP_DRAIN_S = 2.0  # s, at most, to write what the sockets hold at a stop (supervisord waits 10 s: stopwaitsecs)
STOP_DRAIN_POLL_MS = 20  # ms without a message that ends the stop's drain


JSON_ONLY_WARNING = ("--format mcap --mcap-encoding json writes JSON channels only and no rlog.zst: Foxglove opens "
                     "the log, but chestnut check and replay cannot read it (--mcap-encoding capnproto or both, or "
                     "the default --format both, writes a log they read)")
"""The WARNING ``run`` says once at the start of a recording of JSON channels only; it recorded in silence, and
check's refusal of the log then named an rlog.zst that is not there."""


def logged_services() -> list[str]:
    """Names of the services the registry marks ``should_log``, in registry order."""
    return [s.name for s in SERVICE_LIST.values() if s.should_log]


class Recorder:
    """The logger's sockets and route writer; :meth:`step` is one loop iteration.

    ``services``: names to subscribe to (raises :class:`UnknownServiceError` for an unknown one).
    Counters: ``received`` and ``written`` (service -> messages), ``malformed`` ((service, reason)
    -> messages), ``frames_unread`` and ``frames_raw`` (see the module doc). Frames go to the segment's
    video when ``writer.video`` is set (:meth:`RouteWriter.write_frame`), else raw.
    """

    def __init__(
        self,
        writer: RouteWriter,
        services: Iterable[str],
        prefix: str | None = None,
        rcvhwm: int = RCVHWM_MESSAGES,
    ) -> None:
        self.writer = writer
        self.services = list(dict.fromkeys(services))
        for s in self.services:
            get_service(s)
        self.poller = zmq.Poller()
        self.socks: dict[str, SubSocket] = {}
        self.received: Counter[str] = Counter()
        self.written: Counter[str] = Counter()
        self.malformed: Counter[tuple[str, str]] = Counter()
        self.frame_reader = FrameReader(prefix)  # a ring frame is logged with its pixels (msgs/visionipc.py)
        self.frames_unread = 0  # ring frames logged without pixels: overwritten before the logger read them
        self.frames_raw = 0  # frames logged raw although the route logs video (see the module doc)
        try:
            for s in self.services:
                # ZMQ_MAXMSGSIZE = the service's bound, a lost connection is healed (msgs/messaging.py)
                self.socks[s] = sub_sock(s, self.poller, prefix=prefix, rcvhwm=rcvhwm)
        except BaseException:
            self.close_sockets()
            raise

    def _count_malformed(self, service: str, reason: str, detail: str) -> None:
        self.malformed[(service, reason)] += 1
        if self.malformed[(service, reason)] == 1:
            _log.warning(
                "%s: skipped a malformed message (%s): %s; further ones are only counted", service, reason, detail
            )

    def step(self, timeout_ms: int = POLL_MS) -> int:
        """Wait up to ``timeout_ms`` for messages, write what arrived (time-ordered), apply the
        rotation and flush policies. Returns the number of messages written."""
        # (logMonoTime, service, bytes, the Event reader, a frame's pixels when it goes to the video)
        batch: list[tuple[int, str, bytes, Any, Any]] = []
        if self.poller.poll(timeout_ms):
            for service, sock in self.socks.items():
                for _ in range(DRAIN_MAX_MESSAGES):
                    try:
                        data = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        sock.heal()  # a lost connection (e.g. a message over the bound) is made again
                        break
                    self.received[service] += 1
                    try:
                        event = log_from_bytes(data)
                    except MalformedMessageError as e:
                        self._count_malformed(service, e.reason, str(e))
                        continue
                    member = event.which()
                    if member != service:
                        self._count_malformed(service, REASON_WRONG_SERVICE, f"a {member!r} message")
                        continue
                    pixels = None
                    if service == "cameraFrame":
                        pixels = self._pixels(event.cameraFrame)  # now: the camera reuses a ring slot
                        if pixels is not None and self.writer.video is None:
                            if self.frame_reader.in_ring(event.cameraFrame):
                                data = _with_pixels(event, pixels)
                            pixels = None
                    batch.append((event.logMonoTime, service, data, event, pixels))
        batch.sort(key=lambda item: item[0])
        for log_mono_time, service, data, event, pixels in batch:
            if pixels is None:
                self.writer.write(service, log_mono_time, data)
            else:
                self._write_frame(log_mono_time, data, event, pixels)
            self.written[service] += 1
        self.writer.tick()
        return len(batch)

    def _pixels(self, cf: Any) -> Any:
        """A frame's pixels (uint8, ``msgs/frames.py`` ``frame_shape``): a verified copy out of the ring, or
        ``data`` read as the node reads it; None when they cannot be read (the frame is logged as received)."""
        if self.frame_reader.in_ring(cf):
            try:
                return self.frame_reader.read(cf)
            except (FrameOverwrittenError, FrameBufferError, ValueError) as e:
                self.frames_unread += 1
                if self.frames_unread == 1:
                    _log.warning("cameraFrame: logged without its pixels: %s; further ones are only counted", e)
                return None
        if self.writer.video is None:
            return None  # logged raw as received: nothing to read
        try:
            return frame_to_array(cf)
        except ValueError as e:
            self._count_raw(f"{e}")
            return None

    def _count_raw(self, why: str) -> None:
        self.frames_raw += 1
        if self.frames_raw == 1:
            _log.warning("cameraFrame: logged raw, not as video: %s; further ones are only counted", why)

    def _write_frame(self, log_mono_time: int, data: bytes, event: Any, pixels: Any) -> None:
        try:
            self.writer.write_frame(log_mono_time, event, pixels)
        except ValueError as e:  # the codec cannot store this frame: its pixels go inline
            self._count_raw(str(e))
            cf = event.cameraFrame
            self.writer.write("cameraFrame", log_mono_time, data if len(cf.data) else _with_pixels(event, pixels))

    def close_sockets(self) -> None:
        for sock in self.socks.values():
            self.poller.unregister(sock)
            sock.close(linger=0)
        self.socks.clear()

    def close(self) -> None:
        """Close the sockets, then the open segment (cleanly)."""
        self.close_sockets()
        self.writer.close()


def _with_pixels(event: Any, pixels: Any) -> bytes:
    """The bytes of a ``cameraFrame`` Event with ``pixels`` in ``data`` (``buffer`` kept: the log says
    the frame travelled through the ring); ``logMonoTime`` kept."""
    msg = event.as_builder()
    msg.cameraFrame.data = pixels.tobytes()
    return bytes(msg.to_bytes())


def _flush_messages(text: str) -> int:
    """``--flush-messages``: a count >= 1 (``FlushPolicy.every_messages``)."""
    return checked_int(text, lambda n: n >= 1, "give a number of messages >= 1")


MAX_RCVHWM = 10_000
"""Upper bound of ``--rcvhwm``, messages: 100 times the default (:data:`RCVHWM_MESSAGES`), up to 983 MB of
128x256 frames queued per service; a bigger queue is no buffer but a way to exhaust memory, and 99999999999999
overflowed ZMQ_RCVHWM's C int in a traceback."""
MIN_SEGMENT_SECONDS = 1.0
"""Lower bound of ``--segment-seconds``, s: a segment a second at most, each a directory of its own files; at 1e-300
the logger opened a new, empty segment each poll (:data:`POLL_MS`), ~10 directories a second."""
MAX_SEGMENT_SECONDS = 3600.0
"""Upper bound of ``--segment-seconds``, s: an hour, 60 times openpilot's 60 s segment (``msgs/logfile.py``
``SEGMENT_SECONDS``); a segment is what ``chestnut check`` and ``replay`` read whole and what one crash can cut."""


def _rcvhwm(text: str) -> int:
    """``--rcvhwm``: a queue bound in [1, :data:`MAX_RCVHWM`], in messages."""
    return checked_int(text, lambda n: 1 <= n <= MAX_RCVHWM, f"give a number of messages >= 1 and <= {MAX_RCVHWM}")


def _segment_seconds(text: str) -> float:
    """``--segment-seconds``: s in [:data:`MIN_SEGMENT_SECONDS`, :data:`MAX_SEGMENT_SECONDS`]; raises
    ``argparse.ArgumentTypeError`` (one line) otherwise, nan and inf included."""
    return checked_float(text, lambda s: MIN_SEGMENT_SECONDS <= s <= MAX_SEGMENT_SECONDS,
                         f"give a number of seconds >= {MIN_SEGMENT_SECONDS:g} and <= {MAX_SEGMENT_SECONDS:g}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-dir", type=path_arg, default=Path("logs"),
                        help="where routes are written (default ./logs)")
    parser.add_argument(
        "--segment-seconds",
        type=_segment_seconds,
        default=SEGMENT_SECONDS,
        help=f"segment length in s ({MIN_SEGMENT_SECONDS:g} to {MAX_SEGMENT_SECONDS:g}; default {SEGMENT_SECONDS:g})",
    )
    parser.add_argument(
        "--format",
        choices=("both", *FORMATS),
        default="both",
        help="file format(s): zst (openpilot rlog), mcap, or both (default)",
    )
    parser.add_argument(
        "--mcap-encoding",
        choices=("auto", *MCAP_ENCODINGS, "both"),
        default="auto",
        help="channels of the .mcap files: json (Foxglove), capnproto (exact bytes) or both; auto "
        "(default): json next to an rlog, both when mcap is the only format",
    )
    parser.add_argument(
        "--logs",
        choices=("rlog", "qlog", "both"),
        default="rlog",
        help="rlog = every message (default); qlog = light log honouring each service's decimation; both",
    )
    parser.add_argument(
        "--services",
        nargs="+",
        metavar="SERVICE",
        default=None,
        help="services to record (default: every service with should_log)",
    )
    parser.add_argument(
        "--flush-messages",
        type=_flush_messages,
        default=FlushPolicy.every_messages,
        help="flush after this many pending messages (default %(default)s)",
    )
    parser.add_argument(
        "--flush-seconds",
        type=positive_seconds,
        default=FlushPolicy.interval_s,
        help="flush at least this often, in s (default %(default)s)",
    )
    parser.add_argument("--fsync", action="store_true", help="fsync on every flush (survives power loss)")
    parser.add_argument(
        "--rcvhwm",
        type=_rcvhwm,
        default=RCVHWM_MESSAGES,
        help=f"ZeroMQ receive queue bound per service, messages (1 to {MAX_RCVHWM}; default %(default)s)",
    )
    parser.add_argument(
        "--frames",
        choices=FRAME_MODES,
        default="video",
        help="camera frames: video = a video file per segment, the logs keep the metadata "
        "(default); raw = the pixels inline in the logs",
    )
    parser.add_argument(
        "--video-codec",
        choices=tuple(VIDEO_CODECS),
        default="ffv1",
        help="ffv1 = lossless, replay is exact (default); h264 = lossy, for long drives (replay "
        "then reports mismatches)",
    )
    parser.add_argument(
        "--crf",
        type=int,
        default=CRF_DEFAULT,
        help="h264 constant rate factor, 0..51, lower is better (default %(default)s)",
    )
    parser.add_argument(
        "--no-mcap-video",
        action="store_true",
        help="no /camera/video (H.264 at the camera's size, Foxglove's CompressedVideo) in the JSON MCAP: saves "
        "its encode, ~1 %% of one core at 256x128 and 20 Hz, ~22 %% at 1928x1208",
    )
    parser.add_argument("--prefix", default=None, help="runtime prefix of the stack (default: $CHESTNUT_PREFIX)")


def drain_at_stop(recorder: Recorder, limit_s: float = STOP_DRAIN_S, poll_ms: int = STOP_DRAIN_POLL_MS) -> int:
    """Write what the sockets already hold, until one ``poll_ms`` poll brings nothing or ``limit_s`` (s)
    passed; returns the messages written."""
    n, t_end = 0, time.monotonic() + limit_s
    while time.monotonic() < t_end:
        got = recorder.step(poll_ms)
        if not got:
            break
        n += got
    return n


def mcap_encodings(choice: str, formats: Iterable[str]) -> tuple[str, ...]:
    """The MCAP channel encodings for ``--mcap-encoding choice`` when writing ``formats``."""
    if choice == "auto":
        return ("json",) if "zst" in formats else MCAP_ENCODINGS
    return MCAP_ENCODINGS if choice == "both" else (choice,)


def run(args: argparse.Namespace) -> int:
    """Record until SIGINT/SIGTERM; 0 after a clean stop, 2 for bad arguments (a malformed ``--prefix`` or
    ``$CHESTNUT_PREFIX`` included, refused before anything is created) or a refused log directory (or something
    planted in it), 1 on a write error."""
    stop_signal: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_signal.append(signum)

    # the prefix first, before anything is made (a refused one left a route of empty segment files behind): a
    # PrefixError is the one line launch/cli.py prints for it, "chestnut record: prefix '../x' is not ...", exit 2
    if args.prefix is not None:
        check_prefix(args.prefix)
    else:
        current_prefix()
    services = args.services or logged_services()
    formats = FORMATS if args.format == "both" else (args.format,)
    encodings = mcap_encodings(getattr(args, "mcap_encoding", "auto"), formats)
    try:
        policy = FlushPolicy(args.flush_messages, args.flush_seconds, args.fsync)
        for s in services:
            get_service(s)
        frames = getattr(args, "frames", "raw")
        video = None
        if frames == "video":
            video = VideoOptions(getattr(args, "video_codec", "ffv1"), getattr(args, "crf", CRF_DEFAULT))
    except (ValueError, UnknownServiceError) as e:
        _log.error("%s", e)
        return 2
    if (missing := missing_folder(args.log_dir)) is not None:  # the folder is made, never the ones above it
        _log.error("--log-dir %s", missing)
        return 2
    try:  # a refused --log-dir (planted symlink, another user's, writable by others) is a refused argument
        private_dir(args.log_dir)
    except OutputDirError as e:
        _log.error("--log-dir %s", e)
        return 2
    runtime_dir(args.prefix)  # a runtime directory someone planted: refused before a log file is made (its
    # RuntimeDirError is the CLI's one line, exit 2, as for every program: launch/cli.py)
    if "zst" not in formats and "capnproto" not in encodings:  # past every refusal: said once, when it records
        _log.warning("%s", JSON_ONLY_WARNING)
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    recorder = None
    try:
        writer = RouteWriter(
            args.log_dir,
            formats=formats,
            full=args.logs in ("rlog", "both"),
            light=args.logs in ("qlog", "both"),
            segment_seconds=args.segment_seconds,
            policy=policy,
            config={"services": services, "rcvhwm": args.rcvhwm},
            mcap_encodings=encodings,
            video=video,
            mcap_video=not getattr(args, "no_mcap_video", False),
            mcap_video_drop=True,  # live: a frame the view's encoder has no room for is left out of the view
        )
        try:
            recorder = Recorder(writer, services, prefix=args.prefix, rcvhwm=args.rcvhwm)
        except BaseException:
            writer.close()
            raise
        _log.info(
            "recording %d services to %s (%s; %s)", len(services), writer.segment_dir, "+".join(formats), args.logs
        )
        next_status_s = time.monotonic() + STATUS_INTERVAL_S
        segment = writer.segment
        while not stop_signal:
            recorder.step(POLL_MS)
            if writer.segment != segment:
                _log.info("segment %s--%d closed; now writing %s", writer.route, segment, writer.segment_dir)
                segment = writer.segment
            if time.monotonic() >= next_status_s:
                next_status_s += STATUS_INTERVAL_S
                _log.info(
                    "written %d messages, malformed %d",
                    sum(recorder.written.values()),
                    sum(recorder.malformed.values()),
                )
        drain_at_stop(recorder)
    except OutputDirError as e:  # something planted in the log directory: refused, never followed
        _log.error("cannot write the log: %s", e)
        return 2
    except OSError as e:
        _log.error("cannot write the log: %s", e)
        return 1
    finally:
        if recorder is not None:
            try:
                recorder.close()
            except OSError as e:
                _log.error("cannot close the log cleanly: %s", e)
            w = recorder.writer
            _log.info(
                "stopped%s: %d messages written to %s (route %s, segments 0..%d); malformed skipped: %s; "
                "frames %s (logged raw instead %d, without pixels %d)",
                f" by signal {stop_signal[0]}" if stop_signal else "",
                sum(recorder.written.values()),
                w.log_dir,
                w.route,
                w.segment,
                dict(recorder.malformed) or "none",
                "raw" if w.video is None else f"as video ({w.video.codec})",
                recorder.frames_raw,
                recorder.frames_unread,
            )
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
