"""``chestnut camera``: a camerad-like source publishing real frames as ``cameraFrame``.

By default it loops the real city-traffic video of the PyPI wheel ``mvtb-data==1.6.1`` (350 frames,
704x576), decoded with PyAV and resized to the model input (default 128x256, the shape openpilot's
models use), at 20 Hz. Any video, image folder or single image works (``--source``).

Timing as a camera gives it: ``frameId`` counts from 0 and never repeats within a run;
``timestampSof`` (ns, CLOCK_MONOTONIC) is the frame's scheduled start on a drift-free 1/rate grid;
``timestampEof`` is when the frame, decoded and resized ahead of its tick, is sent (readout done). A
source that falls behind its schedule skips ticks rather than bursting, and the skipped ids are never
reused, so downstream frame-drop accounting sees real gaps.

Transport (``--transport``): a frame up to ``msgs/visionipc.py`` ``INLINE_MAX_BYTES`` travels inline
(pixels in ``data``); a bigger one, or every one with ``shm``, is copied into the camera's
shared-memory ring and only its metadata (``buffer``: session, slot, sequence number) is published
(``msgs/visionipc.py``). The ring is removed when the camera stops; when it is killed, the kernel frees
the buffers once the last subscriber unmaps them. At a stop the frame waiting for its tick
is not sent, and the socket lingers (:data:`STOP_LINGER_MS`) so the last frame sent reaches every
subscriber: the node and the logger see the same last frame.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from chestnut.launch.signals import StopFlag
from chestnut.msgs.frames import fill_frame
from chestnut.msgs.messaging import PubMaster
from chestnut.msgs.visionipc import INLINE_MAX_BYTES, FrameBufferError, FrameRing

log = logging.getLogger("chestnut.camera")

STOP_LINGER_MS = 1000  # at stop, queued frames get this long to reach the subscribers (ZMQ_LINGER)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".tif", ".tiff", ".webp"}


def iter_frames(source: Path, height: int, width: int, loop: bool = True) -> Iterator[np.ndarray]:
    """Yield uint8 [height, width, 3] BGR frames from a video, an image folder or one image.

    Raises FileNotFoundError for a missing source and ValueError for a folder without images or a
    file FFmpeg cannot decode.
    """
    import av

    if not source.exists():
        raise FileNotFoundError(f"camera source {source} does not exist")
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ValueError(f"camera source {source} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    else:
        files = [source]
    while True:
        n = 0
        for f in files:
            try:
                with av.open(str(f)) as container:
                    for frame in container.decode(video=0):
                        n += 1
                        yield frame.to_ndarray(format="bgr24", width=width, height=height)
            except (av.error.FFmpegError, IndexError) as e:  # PyAV raises IndexError for a file without video
                raise ValueError(f"{f} cannot be decoded as video or image: {e or type(e).__name__}") from e
        if n == 0:
            raise ValueError(f"camera source {source} has no video frames")
        if not loop:
            return


def ring_frame(ring: FrameRing, frame_id: int, img: np.ndarray, sof_ns: int, source_name: str) -> object:
    """Copy a uint8 [H, W, 3] BGR image into the ring's next slot and build its metadata-only
    ``cameraFrame`` (``timestampEof``: ns, CLOCK_MONOTONIC, once the pixels are in the slot)."""
    index, seq = ring.write(np.ascontiguousarray(img))
    msg = fill_frame(frame_id, img[:0], sof_ns, time.monotonic_ns(), source_name)
    cf = msg.cameraFrame  # type: ignore[attr-defined]
    cf.height, cf.width = int(img.shape[0]), int(img.shape[1])
    ring.fill(cf, index, seq, img.nbytes)
    return msg


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", type=Path, help="video, image folder or image (default: mvtb-data traffic video)")
    p.add_argument("--rate", type=float, default=20.0, help="frames per second (default 20)")
    p.add_argument("--height", type=int, default=128)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--frames", type=int, default=0, help="stop after this many frames (0 = run until stopped)")
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
        type=float,
        default=1.0,
        help="s between binding the socket and the first frame (default 1): ZeroMQ drops what a PUB "
        "sends before a subscriber's connection is up, so subscribers get time to (re)connect",
    )


def run(args: argparse.Namespace) -> int:
    from chestnut.launch.assets import traffic_video_path

    source = args.source or traffic_video_path()
    if args.rate <= 0 or args.width <= 0 or args.height <= 0:
        log.error("--rate, --width and --height must be > 0")
        return 2
    try:  # open the source before binding: a bad source is a one-line error, not a traceback
        frames = iter_frames(Path(source), args.height, args.width, loop=not args.no_loop)
        first = next(frames)
    except (FileNotFoundError, ValueError, StopIteration) as e:
        log.error("%s", e or f"camera source {source} has no frames")
        return 2
    flag = StopFlag()
    period_ns = int(1e9 / args.rate)
    pending: list[np.ndarray] = [first]
    transport = getattr(args, "transport", "auto")
    ring: FrameRing | None = None
    if transport == "shm" or (transport == "auto" and first.nbytes > INLINE_MAX_BYTES):  # before the first send
        try:
            ring = FrameRing(first.nbytes)
        except (FrameBufferError, ValueError) as e:
            log.error("%s", e)
            return 2
    try:
        return _publish(args, source, frames, pending, flag, period_ns, ring)
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
) -> int:
    sent = skipped = 0
    with PubMaster(["cameraFrame"]) as pm:
        log.info("camera: %s at %.1f Hz, %dx%d, %s", source, args.rate, args.width, args.height,
                 "inline" if ring is None else f"shared-memory ring of {ring.slots}")
        time.sleep(max(0.0, args.start_delay))
        t0 = time.monotonic_ns()
        frame_id = 0
        while not flag.stop and (args.frames == 0 or sent < args.frames):
            sof = t0 + frame_id * period_ns
            now = time.monotonic_ns()
            if now - sof > period_ns:  # fell behind: skip whole ticks, never burst
                behind = (now - sof) // period_ns
                frame_id += int(behind)
                skipped += int(behind)
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
                time.sleep((sof - now) / 1e9)
            if flag.stop:  # stopped while waiting for the tick: the last frame sent stays the last one
                break
            if ring is None:
                msg = fill_frame(frame_id, img, sof, time.monotonic_ns(), Path(source).name)
            else:
                msg = ring_frame(ring, frame_id, img, sof, Path(source).name)
            pm.send("cameraFrame", msg)
            sent += 1
            frame_id += 1
        for sock in pm.sock.values():  # deliver the last frame to every subscriber before the socket goes
            sock.close(linger=STOP_LINGER_MS)
    log.info("camera: sent %d frames, skipped %d ticks", sent, skipped)
    return 0
