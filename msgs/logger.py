"""``chestnut record``: subscribe to every logged service and write log segments (openpilot's loggerd).

Every service of :data:`~chestnut.msgs.services.SERVICE_LIST` with ``should_log`` (or the ones named
with ``--services``) is received on its own SUB socket and written, byte for byte as published, to
``<log-dir>/<route>--<n>/rlog.zst`` and ``rlog.mcap`` (:mod:`chestnut.msgs.logfile`), segments of
``--segment-seconds`` (default 60 s). ``--logs qlog|both`` adds the light log (``qlog.*``: every
``decimation``-th message of a service). ``--format zst|mcap`` writes one format only.
``--mcap-encoding``: the MCAP files' channels: ``json`` (JSON Schema generated from the Cap'n Proto
schema, frames as ``foxglove.RawImage``: what Foxglove opens, :mod:`chestnut.msgs.jsonschema`),
``capnproto`` (the published bytes) or ``both``; ``auto`` (default) is ``json`` when the rlog is
also written (it already holds the exact bytes for replay) and ``both`` when MCAP is the only format.

- A ``cameraFrame`` whose pixels are in the camera's shared-memory ring (``msgs/visionipc.py``) is
  logged with its pixels copied into ``data`` (its ``buffer`` kept), so a log holds every frame's
  pixels whichever way it travelled; one the camera overwrote before the logger read it is logged
  without them and counted (``frames_unread``).
- Every received message is checked with :func:`~chestnut.msgs.messaging.log_from_bytes` (bounded
  traversal); malformed ones, and ones whose union member is not the socket's service, are counted
  per (service, reason), the first of each logged, and skipped.
- Buffers are bounded: ZeroMQ keeps at most ``--rcvhwm`` messages per service (newer ones are
  dropped by ZeroMQ while the logger lags), one loop drains at most :data:`DRAIN_MAX_MESSAGES` per
  socket, and the writers hold one zstd block / one MCAP chunk (1 MiB) per file. Messages drained
  together are written in ``logMonoTime`` order.
- The flush policy (``--flush-messages``, ``--flush-seconds``) bounds what a crash loses; the loop
  wakes at least every :data:`POLL_MS` ms so the time bound holds without traffic.
- SIGINT / SIGTERM: the loop ends within one poll, the open segment is closed cleanly (zstd frame
  ended, MCAP summary and footer written) and the process exits 0.
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

import zmq

from chestnut.msgs.logfile import FORMATS, MCAP_ENCODINGS, SEGMENT_SECONDS, FlushPolicy, RouteWriter
from chestnut.msgs.messaging import REASON_WRONG_SERVICE, MalformedMessageError, SubSocket, log_from_bytes, sub_sock
from chestnut.msgs.services import SERVICE_LIST, UnknownServiceError, get_service
from chestnut.msgs.visionipc import FrameBufferError, FrameOverwrittenError, FrameReader, inline_event

_log = logging.getLogger("chestnut.record")

POLL_MS = 100  # ms; bounds the reaction to SIGINT/SIGTERM and the granularity of time-based flushes
RCVHWM_MESSAGES = 100  # per service: ZeroMQ receive queue (100 frames of 128x256x3 = 9.8 MB at most)
DRAIN_MAX_MESSAGES = 200  # per socket per loop, so one busy service cannot starve the others
STATUS_INTERVAL_S = 60.0  # s between INFO lines with the counters


def logged_services() -> list[str]:
    """Names of the services the registry marks ``should_log``, in registry order."""
    return [s.name for s in SERVICE_LIST.values() if s.should_log]


class Recorder:
    """The logger's sockets and route writer; :meth:`step` is one loop iteration.

    ``services``: names to subscribe to (raises :class:`UnknownServiceError` for an unknown one).
    Counters: ``received`` and ``written`` (service -> messages), ``malformed`` ((service, reason)
    -> messages).
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
            _log.warning("%s: skipped a malformed message (%s): %s; further ones are only counted", service, reason,
                         detail)

    def step(self, timeout_ms: int = POLL_MS) -> int:
        """Wait up to ``timeout_ms`` for messages, write what arrived (time-ordered), apply the
        rotation and flush policies. Returns the number of messages written."""
        batch: list[tuple[int, str, bytes]] = []
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
                    if service == "cameraFrame" and self.frame_reader.in_ring(event.cameraFrame):
                        data = self._inline(event, data)
                    batch.append((event.logMonoTime, service, data))
        batch.sort(key=lambda item: item[0])
        for log_mono_time, service, data in batch:
            self.writer.write(service, log_mono_time, data)
            self.written[service] += 1
        self.writer.tick()
        return len(batch)

    def _inline(self, event: object, data: bytes) -> bytes:
        """A ring frame's bytes with its pixels inline; the metadata alone when they cannot be read."""
        try:
            return inline_event(event, self.frame_reader)
        except (FrameOverwrittenError, FrameBufferError, ValueError) as e:
            self.frames_unread += 1
            if self.frames_unread == 1:
                _log.warning("cameraFrame: logged without its pixels: %s; further ones are only counted", e)
            return data

    def close_sockets(self) -> None:
        for sock in self.socks.values():
            self.poller.unregister(sock)
            sock.close(linger=0)
        self.socks.clear()

    def close(self) -> None:
        """Close the sockets, then the open segment (cleanly)."""
        self.close_sockets()
        self.writer.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-dir", type=Path, default=Path("logs"), help="where routes are written (default ./logs)")
    parser.add_argument("--segment-seconds", type=float, default=SEGMENT_SECONDS,
                        help=f"segment length in s (default {SEGMENT_SECONDS:g})")
    parser.add_argument("--format", choices=("both", *FORMATS), default="both",
                        help="file format(s): zst (openpilot rlog), mcap, or both (default)")
    parser.add_argument("--mcap-encoding", choices=("auto", *MCAP_ENCODINGS, "both"), default="auto",
                        help="channels of the .mcap files: json (Foxglove), capnproto (exact bytes) or both; auto "
                        "(default): json next to an rlog, both when mcap is the only format")
    parser.add_argument("--logs", choices=("rlog", "qlog", "both"), default="rlog",
                        help="rlog = every message (default); qlog = light log honouring each service's "
                        "decimation; both")
    parser.add_argument("--services", nargs="+", metavar="SERVICE", default=None,
                        help="services to record (default: every service with should_log)")
    parser.add_argument("--flush-messages", type=int, default=FlushPolicy.every_messages,
                        help="flush after this many pending messages (default %(default)s)")
    parser.add_argument("--flush-seconds", type=float, default=FlushPolicy.interval_s,
                        help="flush at least this often, in s (default %(default)s)")
    parser.add_argument("--fsync", action="store_true", help="fsync on every flush (survives power loss)")
    parser.add_argument("--rcvhwm", type=int, default=RCVHWM_MESSAGES,
                        help="ZeroMQ receive queue bound per service, messages (default %(default)s)")
    parser.add_argument("--prefix", default=None, help="runtime prefix of the stack (default: $CHESTNUT_PREFIX)")


def mcap_encodings(choice: str, formats: Iterable[str]) -> tuple[str, ...]:
    """The MCAP channel encodings for ``--mcap-encoding choice`` when writing ``formats``."""
    if choice == "auto":
        return ("json",) if "zst" in formats else MCAP_ENCODINGS
    return MCAP_ENCODINGS if choice == "both" else (choice,)


def run(args: argparse.Namespace) -> int:
    """Record until SIGINT/SIGTERM; 0 after a clean stop, 2 for bad arguments, 1 on a write error."""
    stop_signal: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_signal.append(signum)

    services = args.services or logged_services()
    formats = FORMATS if args.format == "both" else (args.format,)
    try:
        policy = FlushPolicy(args.flush_messages, args.flush_seconds, args.fsync)
        for s in services:
            get_service(s)
        if args.rcvhwm < 1:
            raise ValueError(f"--rcvhwm must be >= 1, got {args.rcvhwm}")
        if not args.segment_seconds > 0:
            raise ValueError(f"--segment-seconds must be > 0, got {args.segment_seconds}")
    except (ValueError, UnknownServiceError) as e:
        _log.error("%s", e)
        return 2
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
            mcap_encodings=mcap_encodings(getattr(args, "mcap_encoding", "auto"), formats),
        )
        try:
            recorder = Recorder(writer, services, prefix=args.prefix, rcvhwm=args.rcvhwm)
        except BaseException:
            writer.close()
            raise
        _log.info("recording %d services to %s (%s; %s)", len(services), writer.segment_dir, "+".join(formats),
                  args.logs)
        next_status_s = time.monotonic() + STATUS_INTERVAL_S
        segment = writer.segment
        while not stop_signal:
            recorder.step(POLL_MS)
            if writer.segment != segment:
                _log.info("segment %s--%d closed; now writing %s", writer.route, segment, writer.segment_dir)
                segment = writer.segment
            if time.monotonic() >= next_status_s:
                next_status_s += STATUS_INTERVAL_S
                _log.info("written %d messages, malformed %d", sum(recorder.written.values()),
                          sum(recorder.malformed.values()))
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
            _log.info("stopped%s: %d messages written to %s (route %s, segments 0..%d); malformed skipped: %s",
                      f" by signal {stop_signal[0]}" if stop_signal else "", sum(recorder.written.values()),
                      w.log_dir, w.route, w.segment, dict(recorder.malformed) or "none")
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
