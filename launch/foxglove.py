"""``chestnut foxglove``: the live stack in Foxglove, over the Foxglove WebSocket protocol.

A Foxglove WebSocket server (the ``foxglove-sdk`` package; the protocol ``foxglove.websocket.v1``,
which foxglove-sdk 0.30 names ``foxglove.sdk.v1`` in the handshake, accepted by Lichtblick since
lichtblick-suite/lichtblick#819)
that subscribes to every service of the stack (``CHESTNUT_PREFIX`` / ``--prefix``) and serves it
live as JSON, with the topics and JSON Schemas that :mod:`chestnut.msgs.jsonschema` generates from
``msgs/chestnut.capnp`` -- the same channels the MCAP segments carry:

- ``/<service>`` for each service (``/modelOutput``, ``/chestnutActive``, ``/chestnutHealth``, ...);
- ``/camera/image``: the camera frames as ``foxglove.RawImage`` (Image panel);
- ``/camera/video``: the camera frames at their own size as ``foxglove.CompressedVideo`` (H.264, a keyframe
  every second: ``msgs/video.py`` ``FoxgloveVideo``; the layout's Image panel), encoded only while a client
  subscribes to it, from the message's pixels or the camera's shared-memory ring (``msgs/visionipc.py``);
- ``/chestnut/levels``: layer levels, ``active``, ``source`` and latencies as numbers (Plot panel);
- ``/chestnut/log``: node state changes, ChestnutActive changes, control events and twin fault
  events as ``foxglove.Log`` (Log panel).

It binds loopback (``127.0.0.1``) by default: the stream carries every camera frame, so exposing
it is the user's explicit choice (``--host``). A loopback TCP port is still open to every local
user (the protocol has no authentication and TCP no peer credentials), unlike the stack's own
sockets (mode 0700): it runs only when asked for, and belongs on a machine one does not share.
``--port`` (default 8765, Foxglove's default).
Open it in Foxglove: *Open connection* -> *Foxglove WebSocket* -> ``ws://127.0.0.1:8765``, then
*Layout* -> *Import from file* -> ``launch/foxglove-layout.json``.

Log times and timestamps are Unix time (ns): each message's ``logMonoTime`` plus one offset taken
when the server starts (``msgs/clock.py``), the clock the MCAP log's times are on.

Every received message is checked with :func:`~chestnut.msgs.messaging.log_from_bytes` (bounded
traversal); malformed ones are counted per service and skipped. ZeroMQ keeps at most
:data:`RCVHWM_MESSAGES` per service; the SDK keeps at most ``message_backlog_size`` per client and
drops the oldest data message for a slow client. A client's malformed messages are one WARNING per client
host, then only counted (:class:`ClientMessageFilter`). SIGINT / SIGTERM stop it within one poll (exit 0).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
from collections import Counter
from types import FrameType
from typing import Any

import zmq

from chestnut.msgs.clock import unix_offset_ns
from chestnut.msgs.jsonschema import (
    TOPIC_VIDEO,
    DerivedState,
    all_topic_schemas,
    compressed_video,
    event_to_json,
    foxglove_messages,
)
from chestnut.msgs.messaging import MalformedMessageError, SubSocket, log_from_bytes, sub_sock
from chestnut.msgs.services import SERVICE_LIST

_log = logging.getLogger("chestnut.foxglove")

CLIENT_LOGGER = "foxglove.websocket.connected_client"
"""foxglove-sdk 0.30's logger for what a client sends (its Rust ``log`` records reach Python's ``logging`` under
this name): ``Invalid message from <host>:<port>: <why>`` at ERROR for each malformed client message."""
CLIENT_HOSTS_KEPT = 256  # distinct client hosts remembered by ClientMessageFilter; beyond them: only counted


class ClientMessageFilter(logging.Filter):
    """Bounds what clients can write to the log: a client's malformed message is the client's fault, not the
    stack's (a WARNING, not foxglove-sdk's ERROR), logged once per client host and then only counted in
    :attr:`dropped` (the stop line gives the count). Without it, any local WebSocket client writes one ERROR
    line per message it sends, without limit. At most :data:`CLIENT_HOSTS_KEPT` hosts are remembered."""

    def __init__(self) -> None:
        super().__init__()
        self.hosts: set[str] = set()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if not text.startswith("Invalid message from "):
            return True
        host = text.removeprefix("Invalid message from ").split(": ", 1)[0].rsplit(":", 1)[0]
        if host in self.hosts or len(self.hosts) >= CLIENT_HOSTS_KEPT:
            self.dropped += 1
            return False
        self.hosts.add(host)
        record.msg, record.args = f"{text}; further invalid messages from {host} are only counted", None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765  # Foxglove's default WebSocket port (foxglove-sdk start_server)
POLL_MS = 100  # ms; bounds the reaction to SIGINT/SIGTERM
RCVHWM_MESSAGES = 20  # per service: 1 s of frames; a viewer wants the newest, not a backlog
DRAIN_MAX_MESSAGES = 50  # per socket per loop
BACKLOG_MESSAGES = 256  # per client: outgoing messages the SDK buffers before dropping the oldest
# services converted only while a client subscribes to one of their topics (base64 of every frame costs CPU)
ON_DEMAND = {
    "cameraFrame": ("/cameraFrame", "/camera/image", "/camera/video"),
    "modelOutput": ("/modelOutput", "/chestnut/levels"),
}


class Bridge:
    """The stack's sockets and the Foxglove channels; :meth:`step` forwards what arrived.

    ``server`` is anything with ``stop()`` (the SDK's ``WebSocketServer``) or None (tests that
    only look at the channels). Counters: ``forwarded`` (service -> messages), ``malformed``.
    """

    def __init__(self, prefix: str | None = None, services: list[str] | None = None, context: Any = None) -> None:
        import foxglove

        self.context = context if context is not None else foxglove.Context()
        self.channels: dict[str, Any] = {}
        for topic, (name, schema) in all_topic_schemas().items():
            self.channels[topic] = foxglove.Channel(
                topic,
                message_encoding="json",
                schema=foxglove.Schema(name=name, encoding="jsonschema", data=json.dumps(schema).encode()),
                context=self.context,
            )
        self.state = DerivedState()
        self.unix_offset_ns = unix_offset_ns()  # log times in Unix ns: logMonoTime + this (msgs/clock.py)
        self.forwarded: Counter[str] = Counter()
        self.malformed: Counter[str] = Counter()
        self.unwatched: Counter[str] = Counter()
        self.prefix = prefix
        self._frames: Any = None  # msgs/visionipc.py FrameReader, on the first frame for /camera/video
        self._video: Any = None  # msgs/video.py FoxgloveVideo, while a client watches /camera/video
        self.video_skipped = 0
        self.poller = zmq.Poller()
        self.socks: dict[str, SubSocket] = {}
        try:
            for s in services or list(SERVICE_LIST):
                self.socks[s] = sub_sock(s, self.poller, prefix=prefix, rcvhwm=RCVHWM_MESSAGES)
        except BaseException:
            self.close()
            raise

    def forward(self, service: str, data: bytes) -> bool:
        """Convert one serialized ``Event`` and log it on its channels; False if it was malformed.

        Frames and model outputs (the large, 20 Hz services) are not converted while no client is
        subscribed to a topic they feed (:data:`ON_DEMAND`); they are counted in ``unwatched``."""
        topics = ON_DEMAND.get(service)
        if topics is not None and not any(self.channels[t].has_sinks() for t in topics):
            self.unwatched[service] += 1
            return True
        try:
            event = log_from_bytes(data)
            member, body = event_to_json(event)
        except (MalformedMessageError, KeyError) as e:
            self.malformed[service] += 1
            if self.malformed[service] == 1:
                _log.warning("%s: skipped a malformed message: %s; further ones are only counted", service, e)
            return False
        if member != service:
            self.malformed[service] += 1
            return False
        log_time = body["logMonoTime"] + self.unix_offset_ns
        for topic, message in foxglove_messages(service, body, self.state, self.unix_offset_ns):
            self.channels[topic].log(json.dumps(message).encode(), log_time=log_time)
        if service == "cameraFrame":
            self._forward_video(event.cameraFrame, body, log_time)
        self.forwarded[service] += 1
        return True

    def _forward_video(self, cf: Any, body: dict[str, Any], log_time: int) -> None:
        """The frame on ``/camera/video`` while a client watches it; the stream restarts (with a keyframe) for
        the next client after none watched."""
        channel = self.channels[TOPIC_VIDEO]
        if not channel.has_sinks():
            self._video = None
            return
        import av

        from chestnut.msgs.video import FoxgloveVideo
        from chestnut.msgs.visionipc import FrameReader

        if self._frames is None:
            self._frames = FrameReader(self.prefix)
        if self._video is None:
            self._video = FoxgloveVideo()
        try:
            pixels = self._frames.read(cf)
            unit, _ = self._video.encode(pixels, body["width"], body["height"], body["encoding"], body["logMonoTime"])
        except (ValueError, OSError, av.FFmpegError) as e:  # an overwritten ring slot, no ring, a refused frame
            self.video_skipped += 1
            if self.video_skipped == 1:
                _log.warning("%s: a frame not sent: %s; further ones are only counted", TOPIC_VIDEO, e)
            return
        if unit:
            channel.log(json.dumps(compressed_video(body, unit, self.unix_offset_ns)).encode(), log_time=log_time)

    def step(self, timeout_ms: int = POLL_MS) -> int:
        """Wait up to ``timeout_ms``, forward what arrived; returns the number of messages forwarded."""
        n = 0
        if self.poller.poll(timeout_ms):
            for service, sock in self.socks.items():
                for _ in range(DRAIN_MAX_MESSAGES):
                    try:
                        data = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        sock.heal()
                        break
                    n += self.forward(service, data)
        return n

    def close(self) -> None:
        if self._frames is not None:
            self._frames.close()
            self._frames = None
        for sock in self.socks.values():
            self.poller.unregister(sock)
            sock.close(linger=0)
        self.socks.clear()


def exposure_warning(host: str, port: int) -> str | None:
    """The one-line warning for a ``--host`` that is not loopback (None for ``localhost``, 127.0.0.0/8, ``::1``).

    A name other than ``localhost`` is not resolved: it may name any interface, so it is warned about too."""
    import ipaddress

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return (
        f"--host {host} is not loopback: every camera frame and the node's outputs go, without authentication, "
        f"to anyone who can reach this machine on port {port}; leave --host out to serve on {DEFAULT_HOST} only"
    )


def bind_problem(host: str, port: int, port_option: str = "--port") -> tuple[int, str] | None:
    """Why a server could not listen on ``host``:``port`` now, as (exit status, one line), or None when it can:
    a TCP socket is bound there (``SO_REUSEADDR``, as the SDK's listener sets it, so a closed connection's
    TIME_WAIT does not count) and closed at once. The line blames what is wrong: ``--host`` for a name that does
    not resolve or an address no interface of this machine has (``EADDRNOTAVAIL``; status 2, a refused
    argument), ``port_option`` for a port this user may not take (``EACCES``, a port under 1024: 2) or one another
    socket already listens on (``EADDRINUSE``: 1, a condition of the moment). ``host`` may be bracketed
    (``[::1]``)."""
    import errno
    import socket

    bare = host.strip("[]")
    host_fix = f"give an address of this machine, or leave --host out for {DEFAULT_HOST}"
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        return 2, f"--host {host}: cannot be resolved ({getattr(e, 'strerror', None) or e}); {host_fix}"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                return 2, f"--host {host}: no interface of this machine has that address ({e.strerror}); {host_fix}"
            if e.errno == errno.EADDRINUSE:
                return 1, (f"port {port} on {host} is already in use ({e.strerror}); choose another {port_option} "
                           "(0: any free one)")
            if e.errno == errno.EACCES:
                return 2, (f"{port_option} {port}: this user may not listen on port {port} on {host} ({e.strerror}); "
                           "choose one from 1024 up")
            return 1, f"cannot listen on {host}:{port} ({e.strerror})"
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="address to bind (default 127.0.0.1: loopback only; the stream carries every frame)",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (default %(default)s; 0: any free)")
    parser.add_argument("--prefix", default=None, help="runtime prefix of the stack (default: $CHESTNUT_PREFIX)")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; 0 after a clean stop, 2 for a bad port or a ``--host`` that is not this
    machine's (:func:`bind_problem`), 1 if the port cannot be bound (in use). Each refusal is one logged line,
    before anything is subscribed."""
    if not 0 <= args.port <= 65535:
        _log.error("--port %d: give a TCP port in 0..65535", args.port)
        return 2
    if (found := bind_problem(args.host, args.port)) is not None:
        _log.error("%s", found[1])
        return found[0]
    import foxglove

    stop: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    clients = ClientMessageFilter()
    logging.getLogger(CLIENT_LOGGER).addFilter(clients)
    bridge = None
    server = None
    try:
        bridge = Bridge(prefix=args.prefix)
        try:
            server = foxglove.start_server(
                name="chestnut",
                host=args.host,
                port=args.port,
                context=bridge.context,
                message_backlog_size=BACKLOG_MESSAGES,
            )
        except RuntimeError as e:  # taken since the probe: say what the probe says now
            found = bind_problem(args.host, args.port)
            _log.error("%s", found[1] if found is not None else f"cannot serve on {args.host}:{args.port}: {e}")
            return found[0] if found is not None else 1
        if (warning := exposure_warning(args.host, server.port)) is not None:
            _log.warning("%s", warning)
        _log.info(
            "serving %d topics at ws://%s:%d (Foxglove: Open connection -> Foxglove WebSocket; layout "
            "launch/foxglove-layout.json)",
            len(bridge.channels),
            args.host,
            server.port,
        )
        while not stop:
            bridge.step(POLL_MS)
    finally:
        if server is not None:
            server.stop()
        if bridge is not None:
            bridge.close()
            _log.info(
                "stopped: forwarded %d messages; malformed skipped: %s; invalid client messages not logged: %d",
                sum(bridge.forwarded.values()),
                dict(bridge.malformed) or "none",
                clients.dropped,
            )
        logging.getLogger(CLIENT_LOGGER).removeFilter(clients)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
