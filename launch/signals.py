"""Stopping a daemon's loop on SIGINT / SIGTERM (the process manager's stop signals)."""

from __future__ import annotations

import os
import select
import signal
import time

SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}
"""The stop signals as a line says them."""


def stop_words(e: KeyboardInterrupt) -> tuple[str, int]:
    """What a ``KeyboardInterrupt`` stands for, as a line says it, and the shell's status for it: SIGTERM, 143, where
    its argument names it (``launch/cli.py`` ``as_ctrl_c`` raises ``KeyboardInterrupt("SIGTERM")`` for a SIGTERM),
    else SIGINT (Ctrl-C), 130 (Python raises it bare). A SIGTERM while ``chestnut launch`` checked was said
    "stopped by SIGINT (Ctrl-C) ... (exit 130)" and exited 143."""
    sig = signal.SIGTERM if e.args[:1] == (signal.SIGTERM.name,) else signal.SIGINT
    return SIGNAL_NAMES[sig], 128 + sig


class StopFlag:
    """Installs SIGINT and SIGTERM handlers that set :attr:`stop` (and remember :attr:`signum`, and in
    :attr:`t_ns` when the first of them came, CLOCK_MONOTONIC ns).

    The loop checks ``flag.stop`` each iteration and cleans up itself, within its stop budget; a wait of its
    own goes through :meth:`sleep`, which the first stop signal ends at once.
    """

    def __init__(self) -> None:
        self.stop = False
        self.signum: int | None = None
        self.t_ns: int | None = None
        self._wake: tuple[int, int] | None = None  # a pipe (read, write), made by the first sleep
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop = True
        self.signum = signum
        if self.t_ns is None:
            self.t_ns = time.monotonic_ns()
            if self._wake is not None:
                os.write(self._wake[1], b"!")  # one byte, once: the pipe never fills

    def sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` (finite, >= 0) or until a stop signal, whichever comes first; True when stopped.

        ``time.sleep`` would not do: a signal handler that returns lets it sleep on (PEP 475), so a stop during
        a long wait came only at its end. Here the handler writes to a pipe this waits on with ``select``, which,
        resumed after the handler, finds the byte at once; a signal before the wait is seen in :attr:`stop`."""
        if self._wake is None:
            self._wake = os.pipe()  # before stop is read: a signal from here on writes to it
        if not self.stop and seconds > 0:
            select.select([self._wake[0]], [], [], seconds)
        return self.stop
