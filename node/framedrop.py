"""The frame-drop percentage published in ``modelOutput.frameDropPerc``, computed as openpilot's modeld does.

openpilot ``selfdrive/modeld/modeld.py`` (read from its public source):

- per frame, ``dropped = max(0, frame_id - last_frame_id - 1)``, where ``last_frame_id`` starts at 0
  and is the id of the previous frame seen;
- a first-order low-pass filter (``common/filter_simple.py`` ``FirstOrderFilter``, time constant
  ``rc = 10 s``, ``dt = 1 / MODEL_FREQ = 0.05 s``, ``alpha = dt / (rc + dt)``) is updated with
  ``min(dropped, 10)``: ``x = (1 - alpha) * x + alpha * min(dropped, 10)``;
- for the first 10 frames (``run_count < 10``) the filter is held at 0 so that the start-up gap
  (the first id minus 0) never counts;
- the published ratio is ``x / (1 + x)`` (dropped per received, turned into dropped per sent), and
  ``frameDropPerc = 100 * ratio``.

Consequences the tests pin down: a repeated frame id counts 0 drops; a frame id that goes backwards
(a camera restart, or a ``UInt32`` wrap) counts 0 drops; a huge gap counts as 10.
"""

from __future__ import annotations

MODEL_FREQ_HZ = 20.0  # openpilot ModelConstants.MODEL_FREQ
FILTER_RC_S = 10.0  # openpilot modeld: FirstOrderFilter(0., 10., 1. / MODEL_FREQ)
MAX_DROPS_PER_FRAME = 10  # openpilot modeld: min(vipc_dropped_frames, 10)
WARMUP_FRAMES = 10  # openpilot modeld: "if run_count < 10: # let frame drops warm up"


class FrameDropFilter:
    """Filtered frame-drop measure over a stream of camera frame ids.

    ``update(frame_id)`` is called once per frame that reaches the model and returns the drop
    percentage in [0, 100). ``dt_s`` is the nominal frame period in seconds (openpilot: 1/20 s);
    ``rc_s`` the filter's time constant in seconds. Raises ``ValueError`` for non-positive
    ``dt_s``/``rc_s`` or a negative frame id.
    """

    def __init__(self, dt_s: float = 1.0 / MODEL_FREQ_HZ, rc_s: float = FILTER_RC_S,
                 max_drops_per_frame: int = MAX_DROPS_PER_FRAME, warmup_frames: int = WARMUP_FRAMES) -> None:
        if dt_s <= 0 or rc_s <= 0:
            raise ValueError(f"dt_s and rc_s must be > 0, got dt_s={dt_s}, rc_s={rc_s}")
        self.alpha = dt_s / (rc_s + dt_s)
        self.max_drops_per_frame = max_drops_per_frame
        self.warmup_frames = warmup_frames
        self.reset()

    def reset(self) -> None:
        """Forget everything: the next frame is treated like the first of a new camera session."""
        self.x = 0.0  # filtered drops per received frame
        self.last_frame_id = 0
        self.run_count = 0
        self.last_dropped = 0  # raw drops before the latest frame (unfiltered, unclamped)

    def update(self, frame_id: int) -> float:
        """Account for one received frame; returns the drop percentage (``100 * x / (1 + x)``)."""
        if frame_id < 0:
            raise ValueError(f"frame id must be >= 0, got {frame_id}")
        dropped = max(0, frame_id - self.last_frame_id - 1)
        self.last_frame_id = frame_id
        self.last_dropped = dropped
        self.x = (1.0 - self.alpha) * self.x + self.alpha * min(dropped, self.max_drops_per_frame)
        if self.run_count < self.warmup_frames:
            self.x = 0.0
        self.run_count += 1
        return self.perc

    @property
    def ratio(self) -> float:
        """Fraction of frames dropped, in [0, 1)."""
        return self.x / (1.0 + self.x)

    @property
    def perc(self) -> float:
        """Percentage of frames dropped, in [0, 100) (``modelOutput.frameDropPerc``)."""
        return 100.0 * self.ratio
