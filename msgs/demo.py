"""``chestnut demo``: a live pub/sub round trip -- synthetic camera frames and SubMaster's checks.

A child process (multiprocessing ``spawn``) publishes small synthetic ``cameraFrame``s (64x32 BGR,
a moving gradient) at ``--rate-hz`` (default 20 Hz, the service's nominal rate) for ``--seconds``;
this process subscribes with a :class:`~chestnut.msgs.messaging.SubMaster` and prints alive /
freq_ok / valid and the measured rates once a second, then one summary line. Exit code 0 when the
publisher finished cleanly and ``all_checks()`` held at the end of the run, 1 otherwise (e.g.
``--rate-hz 10`` shows freq_ok failing), 130 on Ctrl-C, 2 for a refused argument (one line): a ``--seconds``
under :data:`MIN_DEMO_SECONDS` -- too short for freq_ok to be judged, so the verdict would fail by
construction -- or over ``msgs/argtypes.py`` ``MAX_RUN_SECONDS`` (a week, ``chestnut launch --seconds``'s bound).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import signal
import time
from collections.abc import Sequence

import numpy as np

from chestnut.msgs.argtypes import (
    MAX_FRAME_RATE_HZ,
    MAX_RUN_SECONDS,
    MIN_FRAME_RATE_HZ,
    checked_float,
    frame_rate_hz,
)
from chestnut.msgs.messaging import LOSS_PUBLISHER_GONE, PubMaster, SubMaster, check_publishable, new_message
from chestnut.msgs.paths import current_prefix
from chestnut.msgs.submaster import SHORT_WINDOW_S

SERVICE = "cameraFrame"
WIDTH_PX, HEIGHT_PX = 64, 32
STATUS_PERIOD_S = 1.0
JOIN_TIMEOUT_S = 2.0
CONNECT_DELAY_S = 0.3  # s the publisher waits after binding, so the subscriber's first frames are not lost
MIN_DEMO_SECONDS = 2 * SHORT_WINDOW_S
"""Shortest ``--seconds``, s: freq_ok holds only once a full short window (``msgs/submaster.py``
``SHORT_WINDOW_S``, 1 s of the service's nominal intervals: 21 frames at 20 Hz) has been received, so a run of
1 s ends before it can hold and the verdict says FAILED whatever the rate; twice the window leaves the checks a
second of frames to be judged on (a 2 s run at 20 Hz ends with them held)."""


def demo_seconds(text: str) -> float:
    """``--seconds``: a duration in [:data:`MIN_DEMO_SECONDS`, ``MAX_RUN_SECONDS``] s; raises
    ``argparse.ArgumentTypeError`` (one line) otherwise, NaN and inf included -- a huge one (1e300) overflowed the
    publisher's nanosecond clock in the spawned process."""
    return checked_float(text, lambda s: MIN_DEMO_SECONDS <= s <= MAX_RUN_SECONDS,
                         f"give a number of seconds from {MIN_DEMO_SECONDS:g} (freq_ok needs a full "
                         f"{SHORT_WINDOW_S:g} s window of frames before it can hold) up to {MAX_RUN_SECONDS:g} "
                         "(a week)")


def synthetic_frame(frame_id: int, width: int = WIDTH_PX, height: int = HEIGHT_PX) -> bytes:
    """A BGR888 gradient shifted by ``frame_id``: ``height * width * 3`` bytes (uint8, row-major)."""
    x = (np.arange(width, dtype=np.uint16)[None, :] + 4 * frame_id) % 256
    y = np.arange(height, dtype=np.uint16)[:, None] * 255 // max(height - 1, 1)
    bgr = np.stack(np.broadcast_arrays(x, y, (x + y) // 2), axis=-1).astype(np.uint8)
    return bgr.tobytes()


def publish_camera_frames(
    phases: Sequence[tuple[float, float, bool]],
    prefix: str,
    width: int = WIDTH_PX,
    height: int = HEIGHT_PX,
    start_delay_s: float = 0.0,
    source_name: str = "synthetic",
) -> None:
    """Publish ``cameraFrame``s on ``prefix`` following ``phases`` of (rate Hz, duration s, valid).

    Frame ids count from 0 across phases; sends are scheduled on absolute times (no drift), so the
    average rate of each phase is exact even when single sends are late. Runs in a child process;
    SIGINT ends it quietly. ``start_delay_s`` gives subscribers time to connect (ZeroMQ drops what
    is published before a subscriber is connected). ``source_name`` goes into every frame.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with PubMaster([SERVICE], prefix=prefix) as pm:
        time.sleep(start_delay_s)
        frame_id = 0
        next_ns = time.monotonic_ns()
        for rate_hz, duration_s, valid in phases:
            period_ns = round(1e9 / rate_hz)
            end_ns = next_ns + round(duration_s * 1e9)
            while next_ns < end_ns:
                delay_s = (next_ns - time.monotonic_ns()) / 1e9
                if delay_s > 0:
                    time.sleep(delay_s)
                msg = new_message(SERVICE, valid=valid)
                frame = msg.cameraFrame
                frame.frameId = frame_id
                frame.timestampSof = frame.timestampEof = msg.logMonoTime
                frame.width, frame.height = width, height
                frame.encoding = "bgr888"
                frame.data = synthetic_frame(frame_id, width, height)
                frame.sourceName = source_name
                pm.send(SERVICE, msg)
                frame_id += 1
                next_ns += period_ns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=demo_seconds, default=5.0,
                        help=f"how long to run (s, {MIN_DEMO_SECONDS:g} to {MAX_RUN_SECONDS:g}; default 5)")
    parser.add_argument("--rate-hz", type=frame_rate_hz, default=20.0,
                        help=f"publish rate (Hz, {MIN_FRAME_RATE_HZ:g} to {MAX_FRAME_RATE_HZ:g}; default 20 = nominal)")
    parser.add_argument("--prefix", default=None, help="runtime prefix (default: $CHESTNUT_PREFIX)")


def run(args: argparse.Namespace) -> int:
    prefix = args.prefix or current_prefix()
    # what would stop the publishing child stops `chestnut demo` before the child starts: one line, exit 2
    check_publishable(SERVICE, prefix)
    sm = SubMaster([SERVICE], prefix=prefix)
    # the one publisher that can be gone is the demo's own (the prefix's publisher lock keeps others out), at its
    # planned end: that loss is counted, not logged; a message over the bound still is (LOSS_REFUSED)
    sm.sock[SERVICE].losses_logged |= {LOSS_PUBLISHER_GONE}
    publisher = mp.get_context("spawn").Process(
        target=publish_camera_frames,
        args=([(args.rate_hz, args.seconds, True)], prefix),
        kwargs={"start_delay_s": CONNECT_DELAY_S},
        daemon=True,
    )
    t0 = time.monotonic()
    publisher.start()
    checks_ok_s = 0.0
    final_ok = interrupted = False
    next_status, last = t0 + STATUS_PERIOD_S, t0
    try:
        while publisher.is_alive() or sm.updated[SERVICE]:
            sm.update(50)
            now = time.monotonic()
            if sm.updated[SERVICE]:
                final_ok = sm.all_checks()
            if sm.all_checks():
                checks_ok_s += now - last
            last = now
            if now >= next_status:
                next_status += STATUS_PERIOD_S
                print(_status_line(sm, now - t0), flush=True)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if publisher.is_alive():  # only when interrupted: it has finished otherwise
            publisher.terminate()
        publisher.join(JOIN_TIMEOUT_S)
        sm.close()
    published = sm[SERVICE].frameId + 1 if sm.seen[SERVICE] else 0
    ok = not interrupted and publisher.exitcode == 0 and final_ok
    print(
        f"demo: received {sm.recv_count[SERVICE]} of {published} frames; all_checks held {checks_ok_s:.1f} s "
        f"of {time.monotonic() - t0:.1f} s and {'held' if final_ok else 'FAILED'} at the last frame; "
        f"malformed {sum(sm.malformed[SERVICE].values())}"
    )
    return 130 if interrupted else 0 if ok else 1


def _status_line(sm: SubMaster, t_s: float) -> str:
    short_hz, long_hz = sm.freq_tracker[SERVICE].rates_hz()
    return (
        f"t={t_s:4.1f}s {SERVICE} frame={sm[SERVICE].frameId:<4d} alive={sm.alive[SERVICE]!s:5} "
        f"freq_ok={sm.freq_ok[SERVICE]!s:5} valid={sm.valid[SERVICE]!s:5} "
        f"rate={_hz(short_hz)}/{_hz(long_hz)} Hz (1 s/5 s windows)"
    )


def _hz(rate: float | None) -> str:
    return "  -  " if rate is None else f"{rate:5.1f}"
