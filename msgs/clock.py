"""The stack's two clocks: ``CLOCK_MONOTONIC`` and Unix time.

Every ``logMonoTime`` and every time the node, ``chestnut check`` and ``chestnut replay`` compute with is
``CLOCK_MONOTONIC`` (ns; Python's ``time.monotonic_ns``, as openpilot's ``logMonoTime`` is
``nanos_since_boot``): it never steps, but it counts from the machine's boot, so two machines' logs cannot
be lined up on it and a viewer places it in 1970. What a person or another machine reads -- MCAP
``log_time`` / ``publish_time`` and the Foxglove messages' timestamps, in the log and on the live server --
is Unix time (ns since 1970-01-01 UTC, ``CLOCK_REALTIME``), derived from the monotonic time with one offset
taken when the writer starts (:func:`unix_offset_ns`), so the gaps between messages stay the monotonic
ones even when NTP steps the wall clock during a run. The logger keeps its offset in every segment's
``initData`` config (``unix_offset_ns``) and in the MCAP ``chestnut`` metadata record.
"""

from __future__ import annotations

import json
import time
from typing import Any

__all__ = ["UNIX_OFFSET_KEY", "logged_unix_offset_ns", "unix_offset_ns"]

UNIX_OFFSET_KEY = "unix_offset_ns"  # the offset's key in initData's config and the MCAP metadata


def unix_offset_ns() -> int:
    """``CLOCK_REALTIME - CLOCK_MONOTONIC`` now, in ns: add it to a monotonic time to get Unix time.

    The monotonic reading is taken between two wall-clock readings and set against their midpoint, so the
    offset is off by at most half the time between them (microseconds)."""
    wall0 = time.time_ns()
    mono = time.monotonic_ns()
    wall1 = time.time_ns()
    return (wall0 + wall1) // 2 - mono


def logged_unix_offset_ns(log_mono_time_ns: int, init_data: Any) -> int:
    """The offset a log was written with, from one of its ``initData`` headers (``init_data``, the reader, at
    ``log_mono_time_ns``): its config's ``unix_offset_ns``, or for a log from before it the header's
    ``wallTimeNanos - logMonoTime`` (both taken as the header was made)."""
    try:
        config = json.loads(init_data.config or "{}")
    except (ValueError, UnicodeDecodeError):
        config = {}
    offset = config.get(UNIX_OFFSET_KEY) if isinstance(config, dict) else None
    if isinstance(offset, int) and not isinstance(offset, bool):
        return offset
    return int(init_data.wallTimeNanos) - int(log_mono_time_ns)
