"""``chestnut dump SERVICE [SERVICE ...]``: print live messages, one line each (like cereal's dump).

Text line: ``<logMonoTime s> <service> valid=<bool> <member as JSON>``; ``Data`` fields are shown as
``"<N bytes>"``. ``--json``: one JSON object per line with ``logMonoTime`` (ns), ``service``, ``valid``
and the member under its service name. ``--raw``: no decoding: ``<receive time s> <service> <N> bytes
<hex of the first 32 bytes>`` (malformed messages show too). ``-n COUNT`` stops after COUNT messages (exit 0);
``-n 0`` prints none and stops once every SERVICE has a live publisher (it waits for one as below; over TCP, where
no publisher holds a lock, at once).
Ctrl-C ends it quietly with exit 130, a SIGTERM with 143 (``launch/cli.py`` ``as_ctrl_c``) and a reader that
went away (``chestnut dump SERVICE | head -1``) with 141, as every command without a stop of its own. Malformed
messages are counted and dropped as in every subscriber; after a ``-n`` run their counts per reason go to stderr.
A service that no live process publishes yet (no holder of its publisher lock, ``msgs/messaging.py``
:func:`publisher_pid`) is named in one line on stderr at the start; dump then waits for it. A service whose
socket path holds something that is not a socket of ours (a symlink, a regular file, a directory, another
user's socket) is refused in one line, never connected through (``msgs/paths.py`` :func:`check_socket_path`,
the publishers' rule): exit 2, as for an unknown service.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import zmq

from chestnut.msgs.argtypes import checked_int
from chestnut.msgs.messaging import (
    TCP_BASE_PORT_ENV,
    SocketPathError,
    SubSocket,
    drain_sock,
    drain_sock_raw,
    publisher_pid,
    sub_sock,
)
from chestnut.msgs.paths import PREFIX_ENV, current_prefix
from chestnut.msgs.services import SERVICE_LIST, UnknownServiceError

RAW_HEX_BYTES = 32  # bytes of each raw message shown in hex
POLL_MS = 100  # ms between checks for Ctrl-C / closed pipes when nothing arrives
EXIT_INTERRUPTED = 130  # 128 + SIGINT: launch/cli.py's, which this lower layer does not import


def _plain(value: Any) -> Any:
    """``to_dict()`` output made JSON-able: bytes become ``"<N bytes>"``."""
    if isinstance(value, bytes | bytearray):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def event_dict(event: Any) -> dict[str, Any]:
    """A JSON-able dict of an ``Event``: ``logMonoTime`` (ns), ``service``, ``valid``, ``<service>``."""
    service = event.which()
    return {
        "logMonoTime": event.logMonoTime,
        "service": service,
        "valid": bool(event.valid),
        service: _plain(getattr(event, service).to_dict()),
    }


def format_event(event: Any, as_json: bool = False) -> str:
    """One line for ``event`` (see the module doc for the two layouts)."""
    d = event_dict(event)
    if as_json:
        return json.dumps(d)
    service = d["service"]
    return f"{d['logMonoTime'] / 1e9:.6f} {service} valid={d['valid']} {json.dumps(d[service])}"


def format_raw(service: str, data: bytes, recv_time_ns: int) -> str:
    """One line for undecoded bytes: receive time (s), service, length and a hex prefix."""
    more = "..." if len(data) > RAW_HEX_BYTES else ""
    return f"{recv_time_ns / 1e9:.6f} {service} {len(data)} bytes {data[:RAW_HEX_BYTES].hex()}{more}"


def count_arg(text: str) -> int:
    """``-n COUNT``: how many messages to print, an integer >= 0 (0: none; dump stops once every service has a live
    publisher); raises ``argparse.ArgumentTypeError`` (one line) otherwise."""
    return checked_int(text, lambda n: n >= 0, "give a number of messages >= 0 (leave -n out to never stop)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("services", nargs="+", metavar="SERVICE", help=f"one of: {', '.join(SERVICE_LIST)}")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--json", action="store_true", help="one JSON object per message")
    mode.add_argument("--raw", action="store_true", help="undecoded: length and a hex prefix of each message")
    parser.add_argument(
        "-n",
        "--count",
        type=count_arg,
        default=None,
        metavar="COUNT",
        help="stop after COUNT messages, COUNT >= 0 (0: print none, stop once each SERVICE has a publisher; "
        "default: never stop)",
    )
    parser.add_argument("--prefix", default=None, help="runtime prefix of the stack (default: $CHESTNUT_PREFIX)")


def dump(
    services: list[str],
    out: Any = sys.stdout,
    as_json: bool = False,
    raw: bool = False,
    count: int | None = None,
    prefix: str | None = None,
    err: Any = sys.stderr,
) -> dict[str, dict[str, int]]:
    """Print messages of ``services`` to ``out`` until ``count`` are printed (or forever).

    The services nobody publishes yet on ``prefix`` are named in one line on ``err`` once the sockets are
    connected (``ipc://`` endpoints only: a TCP publisher holds no lock). ``count`` 0 prints nothing and returns
    once each of them has a live publisher, looked at every :data:`POLL_MS` (it returned at once, after saying
    "waiting"); over TCP at once.

    Returns the malformed-message counts per service (reason -> count). Raises
    :class:`UnknownServiceError` for an unregistered service, :class:`SocketPathError` for a socket path that
    holds something not a socket of ours (at the start, or when a lost connection is made again);
    KeyboardInterrupt and BrokenPipeError propagate to the caller after the sockets are closed.
    """
    poller = zmq.Poller()
    socks: list[SubSocket] = []
    try:
        for s in dict.fromkeys(services):
            socks.append(sub_sock(s, poller, prefix=prefix))
        if not os.environ.get(TCP_BASE_PORT_ENV):
            silent = [sock.service for sock in socks if publisher_pid(sock.service, prefix) is None]
            if silent:
                print(
                    f"chestnut dump: nothing publishes {', '.join(silent)} on prefix "
                    f"{prefix or current_prefix()!r} yet (start a stack with chestnut launch, or set {PREFIX_ENV} "
                    "to the running stack's); waiting",
                    file=err,
                    flush=True,
                )
            while count == 0 and silent:  # -n 0: "stop once connected", so not before a publisher is there
                time.sleep(POLL_MS / 1000)
                silent = [s for s in silent if publisher_pid(s, prefix) is None]
        printed = 0
        while count is None or printed < count:
            if not poller.poll(POLL_MS):
                continue
            for sock in socks:
                if raw:
                    now_ns = time.monotonic_ns()
                    lines = [format_raw(sock.service, data, now_ns) for data in drain_sock_raw(sock)]
                else:
                    lines = [format_event(event, as_json) for event in drain_sock(sock)]
                for line in lines[: None if count is None else count - printed]:
                    print(line, file=out, flush=True)
                    printed += 1
        return {sock.service: dict(sock.malformed or {}) for sock in socks}
    finally:
        for sock in socks:
            sock.close(linger=0)


def run(args: argparse.Namespace) -> int:
    try:
        malformed = dump(args.services, sys.stdout, args.json, args.raw, args.count, args.prefix)
    except (UnknownServiceError, SocketPathError) as e:
        print(f"chestnut dump: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, the usual end: no line; chestnut's main makes it 143 for a SIGTERM
        return EXIT_INTERRUPTED
    # a BrokenPipeError (the reader went away: `| head`) goes to chestnut's main: quietly, exit 141
    for service, reasons in malformed.items():
        if reasons:
            print(f"{service}: dropped malformed messages: {reasons}", file=sys.stderr)
    return 0
