"""``cameraFrame`` pixels: building a frame message from an image and reading an image back out.

The layout is the one ``msgs/chestnut.capnp`` gives ``CameraFrame``: ``data`` holds ``height`` rows of
``width`` pixels, row-major, 3 bytes per pixel (B, G, R) for ``bgr888`` and 1 byte for ``gray8``, no
padding. Both the camera (``chestnut camera``) and every reader of frames (the node, replay) use these
two functions, so what the node infers on is exactly what the camera sent.
"""

from __future__ import annotations

import numpy as np

from chestnut.msgs.messaging import new_message
from chestnut.msgs.schema import log as schema

CAMERA_RESTART_MIN_STEP = 20
"""A ``frameId`` more than this below the previous one (with a newer start of frame) is a restarted
camera counting from 0 again, a new stream; any other id that does not increase is a repeated or
reordered frame. Our choice: a camera restart takes longer than 20 frames (1 s at 20 Hz), and
``chestnut camera`` never sends an id twice. The node (``node/main.py`` ``Node.on_frame``) and
``chestnut check`` apply the same rule."""


def fill_frame(frame_id: int, img: np.ndarray, sof_ns: int, eof_ns: int, source_name: str) -> object:
    """Build a ``cameraFrame`` Event for a uint8 [H, W, 3] BGR image (``sof_ns``/``eof_ns``: ns,
    CLOCK_MONOTONIC)."""
    msg = new_message("cameraFrame")
    cf = msg.cameraFrame
    cf.frameId = frame_id
    cf.timestampSof = sof_ns
    cf.timestampEof = eof_ns
    cf.height, cf.width = int(img.shape[0]), int(img.shape[1])
    cf.encoding = schema.CameraFrame.PixelEncoding.bgr888
    cf.data = np.ascontiguousarray(img).tobytes()
    cf.sourceName = source_name
    return msg


def frame_to_array(cf: object) -> np.ndarray:
    """A ``cameraFrame`` reader -> uint8 [H, W, C] array (a copy; C = 1 for ``gray8``, else 3).
    Raises ValueError when ``data`` does not hold exactly H * W * C bytes, and for a frame whose pixels
    stayed in the camera's shared-memory ring (``buffer`` set, ``data`` empty: ``msgs/visionipc.py``)."""
    channels = 1 if str(cf.encoding) == "gray8" else 3  # type: ignore[attr-defined]
    h, w = int(cf.height), int(cf.width)  # type: ignore[attr-defined]
    data = cf.data  # type: ignore[attr-defined]
    if not data and cf._has("buffer"):  # type: ignore[attr-defined]
        raise ValueError(
            f"cameraFrame {cf.frameId}: its pixels were in the camera's shared-memory ring, not in the message "  # type: ignore[attr-defined]
            "(read it live with msgs/visionipc.py FrameReader; chestnut record logs the pixels inline)"
        )
    if len(data) != h * w * channels:
        raise ValueError(f"cameraFrame {cf.frameId}: {len(data)} bytes for {h}x{w}x{channels}")  # type: ignore[attr-defined]
    return np.frombuffer(data, np.uint8).reshape(h, w, channels).copy()
