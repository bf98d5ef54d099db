"""Stopping a daemon's loop on SIGINT / SIGTERM (the process manager's stop signals)."""

from __future__ import annotations

import signal
import time


class StopFlag:
    """Installs SIGINT and SIGTERM handlers that set :attr:`stop` (and remember :attr:`signum`, and in
    :attr:`t_ns` when the first of them came, CLOCK_MONOTONIC ns).

    The loop checks ``flag.stop`` each iteration and cleans up itself, within its stop budget.
    """

    def __init__(self) -> None:
        self.stop = False
        self.signum: int | None = None
        self.t_ns: int | None = None
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop = True
        self.signum = signum
        if self.t_ns is None:
            self.t_ns = time.monotonic_ns()
