"""How late the host itself is: the figures :func:`chestnut.node.policy.host_late` judges a deadline miss by.

Three sources, each read without blocking:

- the node's own wake-ups: every timed wait of its main loop (the loop's poll, the wait for a frame's
  result until its deadline) records how much later than asked it woke (:meth:`HostMeter.loop_woke`);
- the worker's timer: its heartbeat thread measures how late each sleep of one heartbeat period ends and
  keeps the worst of the last second in the shared control block (``node/shm.py`` ``late_peak_ns``),
  which the node reads with the heartbeat (:meth:`HostMeter.worker_late`);
- the kernel's CPU pressure: ``/proc/pressure/cpu``, the ``some`` line's ``avg10`` (%: the share of the
  last 10 s in which at least one runnable task waited for a CPU; Linux >= 4.20 with PSI on,
  ``Documentation/accounting/psi.rst``), read at most every :data:`PRESSURE_PERIOD_S`
  (:func:`read_cpu_pressure`). Absent (an older kernel, ``psi=0``, a container that hides it): None,
  and only the wake-ups speak;
- on the twin, its GPU's (compute process's) worst wait for a CPU over its last second (``backend/sim/hostwait.py``,
  a file the twin daemon keeps beside its socket), read with each figure (:meth:`HostMeter.figures`).

Times are CLOCK_MONOTONIC ns, passed in; only :meth:`HostMeter.cpu_pressure` and the twin's figure read a file.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

from chestnut.backend.sim.hostwait import read_peak_ms
from chestnut.node.policy import HOST_WINDOW_MS, HostFigures

NS_PER_MS = 1_000_000
PSI_CPU = Path("/proc/pressure/cpu")
PRESSURE_PERIOD_S = 0.2  # PSI's avg10 moves slowly (a 10 s average): 5 reads a second are plenty
MAX_SAMPLES = 256  # wake-ups kept at most (the loop wakes ~20-40 times a second; the window is 1 s)


def read_cpu_pressure(path: Path = PSI_CPU) -> float | None:
    """``some avg10`` of a PSI file (``some avg10=12.34 avg60=... total=...``), in %; None when the file is
    absent or unreadable, or holds no such field. Never raises."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("some "):
            for part in line.split()[1:]:
                key, _, value = part.partition("=")
                if key == "avg10":
                    try:
                        return float(value)
                    except ValueError:
                        return None
    return None


class HostMeter:
    """The host's lateness over the last ``window_ms`` (default :data:`~chestnut.node.policy.HOST_WINDOW_MS`):
    the worst wake-up lateness of the node's loop and of the worker's timer (ms), and the CPU pressure (%)."""

    def __init__(self, window_ms: float = HOST_WINDOW_MS, psi_path: Path = PSI_CPU,
                 twin_wait_path: Path | None = None) -> None:
        self.window_ns = int(window_ms * NS_PER_MS)
        self.psi_path = psi_path
        self.twin_wait_path = twin_wait_path  # the twin daemon's hostwait file; None on a real dock
        self._loop: deque[tuple[int, int]] = deque(maxlen=MAX_SAMPLES)    # (woke at, late by) ns
        self._worker: deque[tuple[int, int]] = deque(maxlen=MAX_SAMPLES)
        self._outside: deque[tuple[int, int]] = deque(maxlen=MAX_SAMPLES)
        self._pressure: float | None = None
        self._pressure_at_s = -1e9
        self.last_figures = HostFigures()
        self.last_figures_reason = ""  # the last host-blamed miss's figures, as host_late named them

    def loop_woke(self, asked_ns: int, woke_ns: int) -> None:
        """The node's loop asked to wake at ``asked_ns`` and woke at ``woke_ns`` (a wake-up before the
        time asked, by an event, is no lateness)."""
        if woke_ns > asked_ns:
            self._add(self._loop, woke_ns, woke_ns - asked_ns)

    def worker_late(self, late_ns: int, now_ns: int) -> None:
        """The worker's timer's worst lateness of its last second (``late_ns``), read at ``now_ns``."""
        if late_ns > 0:
            self._add(self._worker, now_ns, late_ns)

    def result_outside(self, now_ns: int, lost_ns: int) -> None:
        """A result received at ``now_ns`` lost ``lost_ns`` outside the dock (request to receipt, less its
        stages)."""
        if lost_ns > 0:
            self._add(self._outside, now_ns, lost_ns)

    def _add(self, samples: deque[tuple[int, int]], at_ns: int, late_ns: int) -> None:
        """One sample; those older than the window before it are dropped, so a figure scans one window's worth."""
        since = at_ns - self.window_ns
        while samples and samples[0][0] < since:
            samples.popleft()
        samples.append((at_ns, late_ns))

    def cpu_pressure(self) -> float | None:
        """PSI ``some avg10`` (%), re-read at most every :data:`PRESSURE_PERIOD_S`; None where absent."""
        now_s = time.monotonic()
        if now_s - self._pressure_at_s >= PRESSURE_PERIOD_S:
            self._pressure, self._pressure_at_s = read_cpu_pressure(self.psi_path), now_s
        return self._pressure

    def figures(self, now_ns: int, dock_ms: float | None = None, elapsed_ms: float | None = None,
                pressure: float | None = None) -> HostFigures:
        """The figures at ``now_ns``: the worst lateness of each source within the window (ms), the CPU
        pressure (``pressure`` when given, else :meth:`cpu_pressure`), a late result's ``dock_ms`` /
        ``elapsed_ms`` when there is one, and the twin's wait for a CPU (0 without a twin)."""
        since = now_ns - self.window_ns

        def worst(samples: deque[tuple[int, int]]) -> float:
            return max((late for at, late in samples if at >= since), default=0) / NS_PER_MS

        twin = read_peak_ms(self.twin_wait_path, now_ns) if self.twin_wait_path is not None else 0.0
        f = HostFigures(worst(self._loop), worst(self._worker),
                        pressure if pressure is not None else self.cpu_pressure(), dock_ms, elapsed_ms, twin,
                        worst(self._outside))
        self.last_figures = f
        return f
