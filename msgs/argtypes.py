"""Command-line numbers checked as argparse reads them: one shared parser for the ``type=`` functions of every
``chestnut`` subcommand, so a bad number is one line naming what is wanted (``OneLineParser``, exit 2)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


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
