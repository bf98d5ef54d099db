"""``cameraFrame`` pixels: building a frame message from an image and reading an image back out.

The layout is the one ``msgs/chestnut.capnp`` gives ``CameraFrame``: ``data`` holds ``height`` rows of
``width`` pixels, row-major, 3 bytes per pixel (B, G, R) for ``bgr888`` and 1 byte for ``gray8``, no
padding; ``nv12`` holds ``height`` rows of Y then ``height / 2`` rows of interleaved U, V (FFmpeg's
``nv12``), read as a one-channel array of ``height * 3 / 2`` rows (:func:`frame_shape`). Both the
camera (``chestnut camera``) and every reader of frames (the node, replay) use these functions, so
what the node infers on is exactly what the camera sent.
"""

from __future__ import annotations

import numpy as np

from chestnut.msgs.messaging import new_message

CAMERA_RESTART_MIN_STEP = 20
"""A ``frameId`` more than this below the previous one (with a newer start of frame) is a restarted
camera counting from 0 again, a new stream; any other id that does not increase is a repeated or
reordered frame. Our choice: a camera restart takes longer than 20 frames (1 s at 20 Hz), and
``chestnut camera`` never sends an id twice. The node (``node/main.py`` ``Node.on_frame``) and
``chestnut check`` apply the same rule."""


def frame_shape(height: int, width: int, encoding: str) -> tuple[int, int, int]:
    """The uint8 array (rows, columns, channels) of a ``height`` x ``width`` frame in ``encoding``
    (a ``CameraFrame.PixelEncoding`` name): [H, W, 3] for ``bgr888`` / ``rgb888``, [H, W, 1] for ``gray8``,
    [H * 3/2, W, 1] for ``nv12`` (Y rows, then UV rows). Raises ValueError for an odd-sized ``nv12`` frame."""
    if encoding == "nv12":
        if height % 2 or width % 2:
            raise ValueError(f"an nv12 frame has an even width and height, not {width}x{height}")
        return height * 3 // 2, width, 1
    return height, width, 1 if encoding == "gray8" else 3


def fill_frame(
    frame_id: int, img: np.ndarray, sof_ns: int, eof_ns: int, source_name: str, encoding: str = "bgr888"
) -> object:
    """Build a ``cameraFrame`` Event for a uint8 image: [H, W, 3] BGR (``bgr888``, the default) or, for
    ``nv12``, the [H * 3/2, W] (or [H * 3/2, W, 1]) planes of an H x W frame (``sof_ns``/``eof_ns``: ns,
    CLOCK_MONOTONIC)."""
    msg = new_message("cameraFrame")
    cf = msg.cameraFrame
    cf.frameId = frame_id
    cf.timestampSof = sof_ns
    cf.timestampEof = eof_ns
    rows = int(img.shape[0])
    cf.height, cf.width = (rows * 2 // 3 if encoding == "nv12" else rows), int(img.shape[1])
    cf.encoding = encoding
    cf.data = np.ascontiguousarray(img).tobytes()
    cf.sourceName = source_name
    return msg


def frame_to_array(cf: object) -> np.ndarray:
    """A ``cameraFrame`` reader -> uint8 array of :func:`frame_shape` (a writable copy): [H, W, 3], or [H, W, 1]
    for ``gray8``, [H * 3/2, W, 1] for ``nv12``. Raises what :func:`frame_view` raises."""
    return frame_view(cf).copy()


def frame_view(cf: object) -> np.ndarray:
    """:func:`frame_to_array` without its copy: a read-only uint8 array over the ``bytes`` that reading ``data``
    gives (pycapnp copies a ``Data`` field out of the message once per read; nothing else holds those bytes).
    Raises ValueError when ``data`` does not hold exactly H * W * C bytes, and for a frame whose pixels
    stayed in the camera's shared-memory ring (``buffer`` set, ``data`` empty: ``msgs/visionipc.py``)."""
    h, w, channels = frame_shape(int(cf.height), int(cf.width), str(cf.encoding))  # type: ignore[attr-defined]
    data = cf.data  # type: ignore[attr-defined]
    if not data and cf._has("buffer"):  # type: ignore[attr-defined]
        raise ValueError(
            f"cameraFrame {cf.frameId}: its pixels were in the camera's shared-memory ring, not in the message "  # type: ignore[attr-defined]
            "(read it live with msgs/visionipc.py FrameReader; chestnut record logs the pixels inline)"
        )
    if len(data) != h * w * channels:
        raise ValueError(f"cameraFrame {cf.frameId}: {len(data)} bytes for {h}x{w}x{channels} (HxWxC)")  # type: ignore[attr-defined]
    return np.frombuffer(data, np.uint8).reshape(h, w, channels)
