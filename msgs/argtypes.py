"""Command-line numbers and paths checked as argparse reads them: one shared parser for the ``type=`` functions of
every ``chestnut`` subcommand, so a bad number or an empty path is one line naming what is wanted
(``OneLineParser``, exit 2)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

EMPTY_PATH_WANT = "an empty path is not a path; give a file or folder"
"""Why :func:`path_arg` refuses ``''``."""


def path_arg(text: str) -> Path:
    """A path on the command line (the ``type=`` of every path option and positional of ``chestnut``'s commands:
    ``check LOG``, ``acceptance --out``, ``camera --source``, ``export --mcap``, ...), as ``Path(text)``; raises
    ``argparse.ArgumentTypeError`` (one line, :data:`EMPTY_PATH_WANT`) for ``''``. ``Path('')`` is ``Path('.')``,
    the current directory, so an empty value (an unset shell variable: ``--out "$DIR"``) named it without a word:
    ``chestnut check ''`` checked the whole current directory, ``acceptance --out ''`` wrote its reports into it,
    ``camera --source ''`` said "camera source . holds no images"; what a given path may be is the command's to
    check, as before."""
    if text == "":
        raise argparse.ArgumentTypeError(EMPTY_PATH_WANT)
    return Path(text)


def checked_float(text: str, ok: Callable[[float], bool], want: str) -> float:
    """``text`` as a float when ``ok`` accepts it; raises ``argparse.ArgumentTypeError`` ``"'text': want"``
    otherwise. Text that is no number reads as NaN, and NaN fails every comparison, so a bound check in ``ok``
    (``0 < x <= 20``) refuses it and inf alike without a case of its own."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r}: {want}")
    return value


def positive_ms(text: str) -> float:
    """A time in milliseconds, finite and > 0 (``chestnut check --deadline-ms``, ``chestnut acceptance
    --detect-bound-ms``, ...); raises ``argparse.ArgumentTypeError`` (one line) otherwise, nan and inf included."""
    return checked_float(text, lambda ms: 0 < ms < math.inf, "give a time in milliseconds > 0")


MAX_WAIT_TIMEOUT_MS = 60_000
"""Upper bound of a device wait timeout on the command line (``chestnut probe --wait-timeout-ms``), ms: a minute,
the bound ``chestnut run --wait-timeout-ms`` and ``chestnut check --wait-timeout-ms`` already take
(``node/config.py`` ``MAX_MS``: twice tinygrad's own 30000 ms default fence wait); held here, in the lowest
layer, so ``backend/`` can reuse it (``tests/test_backend_probe.py`` asserts the two agree)."""


def positive_seconds(text: str) -> float:
    """A duration in seconds, finite and > 0 (``chestnut acceptance
    --recover-bound-s``); raises ``argparse.ArgumentTypeError`` (one line) otherwise, nan and inf included."""
    return checked_float(text, lambda s: 0 < s < math.inf, "give a number of seconds > 0")


def checked_int(text: str, ok: Callable[[int], bool], want: str) -> int:
    """``text`` as an int when ``ok`` accepts it; raises ``argparse.ArgumentTypeError`` ``"'text': want"``
    otherwise, text that is no integer included (``checked_float``'s twin for counts and ports)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {want}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r}: {want}")
    return value


MIN_FRAME_RATE_HZ = 1.0
"""Lower bound of a publisher's frame rate on the command line (``chestnut camera --rate``, ``chestnut demo
--rate-hz``, ``chestnut launch --rate``), Hz: a frame a second, so SubMaster's short rate window
(``msgs/submaster.py`` ``SHORT_WINDOW_S``, 1 s) sees one and the shortest demo (``msgs/demo.py``
``MIN_DEMO_SECONDS``, 2 s) publishes two; at 1e-300 Hz a frame's period overflowed the camera's clock and a demo
published none ("received 0 of 0 frames")."""
MAX_FRAME_RATE_HZ = 1000.0
"""Upper bound of a publisher's frame rate on the command line (``chestnut camera --rate``, ``chestnut demo
--rate-hz``), Hz: a frame's period must be a whole, non-zero number of nanoseconds on the tick grid, and a
rate over 1 kHz is no camera's (openpilot's road camera: 20 Hz)."""


def frame_rate_hz(text: str) -> float:
    """A frame rate, Hz, in [:data:`MIN_FRAME_RATE_HZ`, :data:`MAX_FRAME_RATE_HZ`]; raises
    ``argparse.ArgumentTypeError`` (one line) otherwise, NaN and inf included (0 Hz divided by zero, NaN has no
    period)."""
    return checked_float(text, lambda hz: MIN_FRAME_RATE_HZ <= hz <= MAX_FRAME_RATE_HZ,
                         f"give a rate in Hz, >= {MIN_FRAME_RATE_HZ:g} and <= {MAX_FRAME_RATE_HZ:g}")


MAX_RUN_SECONDS = 7 * 24 * 3600.0
"""Upper bound of a run's length on the command line (``chestnut launch --seconds``), s: a week, longer than
any test or soak run we make; a run meant to last longer is an open-ended one (``--seconds 0``, until Ctrl-C),
and a number such as 1e308 is a typo, not a plan."""


def run_seconds(text: str) -> float:
    """A run's length, s: 0 (until Ctrl-C) or a number in (0, :data:`MAX_RUN_SECONDS`]; raises
    ``argparse.ArgumentTypeError`` (one line) otherwise, NaN and inf included."""
    return checked_float(text, lambda s: 0 <= s <= MAX_RUN_SECONDS,
                         f"give 0 (until Ctrl-C) or a number of seconds up to {MAX_RUN_SECONDS:g} (a week)")


MAX_DOCK_LATENCY_US = 100_000.0
"""Upper bound of the twin's per-transfer latency on the command line (``chestnut launch --latency-us``,
``chestnut twin serve --latency-us``), us: 100 ms, a thirtieth of the 3000 ms device wait timeout
(``backend/protocol.py`` ``WAIT_TIMEOUT_MS``) and 800 USB 3 bus intervals: a frame takes many transfers, so a
slower one is no dock's timing but a hang (``--fault gpu_hang``, ``slow_gpu``), and at 1e12 us the primary never
served while the node blamed a permission issue."""
MIN_LINK_MBPS = 12.0
"""Lower bound of the twin's link rate on the command line (``--link-mbps`` of ``chestnut launch`` and ``chestnut
twin serve``), Mbps: USB 1.1 Full Speed, the slowest link a device with bulk endpoints can have (USB 2.0
specification, 5.8.3: a low-speed device has no bulk endpoints; the dock's data moves on bulk OUT ``0x02`` and
bulk IN ``0x81``, ``docs/protocol.md``), and the slowest the project names (``backend/classify.py``
``link_speed_text``, "12 Mbps, USB 1"). A rate near 0 is no link but a hang: one 256 KiB chunk would take
days."""
MAX_LINK_MBPS = 40_000.0
"""Upper bound of the twin's link rate on the command line, Mbps: USB4's 40 Gbps (USB4 specification 1.0, Gen 3
x2), the ASM2464PD bridge's own host link, so no dock's link is faster; the dock-like default is 5600
(``launch/frames.py`` ``DOCK_LINK_MBPS``, the firmware's ``0xF2`` SRAM DMA)."""


def dock_latency_us(text: str) -> float:
    """The twin's per-transfer latency, us, in [0, :data:`MAX_DOCK_LATENCY_US`] (``--latency-us`` of ``chestnut
    launch`` and ``chestnut twin serve``); raises ``argparse.ArgumentTypeError`` (one line) otherwise, NaN and inf
    included."""
    return checked_float(text, lambda us: 0 <= us <= MAX_DOCK_LATENCY_US,
                         f"give a latency in microseconds >= 0 and <= {MAX_DOCK_LATENCY_US:g} (a thirtieth of the "
                         "3000 ms device wait timeout)")


def link_mbps(text: str) -> float:
    """The twin's link rate, Mbps, in [:data:`MIN_LINK_MBPS`, :data:`MAX_LINK_MBPS`] (``--link-mbps`` of
    ``chestnut launch`` and ``chestnut twin serve``); raises ``argparse.ArgumentTypeError`` (one line) otherwise,
    NaN and inf included."""
    return checked_float(text, lambda mbps: MIN_LINK_MBPS <= mbps <= MAX_LINK_MBPS,
                         f"give a link rate in Mbps >= {MIN_LINK_MBPS:g} (USB 1.1 Full Speed) and <= "
                         f"{MAX_LINK_MBPS:g} (USB4)")
