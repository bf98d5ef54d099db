"""How long the twin itself waited for a host CPU: the figure that keeps host load off the dock's record.

A real dock's GPU computes on its own silicon; the twin's "GPU" (the program engine's compute process,
:mod:`.compute`) and its bridge (the daemon's threads, :mod:`.daemon`) are host threads. When other
realtime work on the host (a second stack, another twin) holds every core, the twin's answers come late
although nothing on the dock failed -- and a node that judged that delay the dock's would fail over on host
load. So the twin measures it: Linux keeps, per thread, the time it spent runnable on a run queue without a
CPU (``/proc/<pid>/task/<tid>/schedstat``, second field, ns; ``Documentation/scheduler/sched-stats.rst``).
The kernel adds a wait to that figure only when it ends, so a thread that is runnable but has had no CPU since
the last sample is counted as waiting still (:class:`WaitPeak`). The daemon samples its compute child's main thread
-- the twin's GPU -- every :data:`SAMPLE_PERIOD_S` and publishes the **worst single thread's wait over the last
second, one still going on included**, in a small file in the prefix's runtime directory, which the node
reads beside its own wake-up lateness (``node/hostload.py``, ``node/policy.py`` ``host_late``).

The sampler is a twin thread too, at the bridge's priority (above the GPU's): how much later than asked it wakes
is the twin's own wait for the host, and counts in the figure; while the host holds it off altogether the file
is not rewritten, and its age says so -- :func:`read_peak_ms` counts a record older than one sample period as
the sampler being late by the difference. A realtime load above the twin's priorities on every core (two stacks
and their fallbacks on a 2-core host) stops the twin's bridge, its GPU and its sampler together for hundreds of
milliseconds: the figure must say so while it lasts, when a node judges the misses it causes. Both count only
while the twin is *able to work* (``twin.py`` ``Twin.can_work``: no fault state latched): a hung GPU (its engine
stopped: ``engine.py``, ``sdma.py``), a wedged bridge or a failed link waits for no CPU, so a host late beside it
must not excuse its misses.
On a real dock the file does not exist and the figure is 0.

Only the GPU's threads count, not the bridge's (the daemon's own, which answer USB): a GPU that is hung or
whose fence never moves computes nothing and waits for no CPU, so its misses stay the dock's beside any
load, while the bridge keeps answering the node's fence polls -- and a busy host would delay those too.

The file (:data:`FILE_NAME`, mode 0600, 32 bytes): four little-endian u64, ``peak_ns``, ``updated_ns``
(CLOCK_MONOTONIC ns of the sample), ``able`` (1: the twin was able to work at the sample) and
``peak_ns ^ updated_ns ^ able ^ MAGIC`` -- a torn read (the writer's
``pwrite`` and a reader's ``pread`` are not atomic together) fails that check and reads as no figure.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

FILE_NAME = "twin-hostwait"
MAGIC = 0x43484E5457414954  # "CHNTWAIT"
_LAYOUT = struct.Struct("<QQQQ")
SAMPLE_PERIOD_S = 0.05
"""How often the daemon samples its threads' waits (s): one frame period at 20 Hz."""
WINDOW_NS = 1_000_000_000
"""The figure is the worst thread's wait over this last stretch (ns): the node's host window
(``node/policy.py`` ``HOST_WINDOW_MS``)."""
FRESH_NS = 1_000_000_000
"""A record older than this (ns) is no figure: the daemon has stopped (a stopped daemon removes the file; one
that was killed leaves it). Up to this age the record's lateness counts (:func:`read_peak_ms`): one window,
``node/policy.py`` ``HOST_WINDOW_MS``, the longest a late host explains a miss anyway."""
MAX_SCHEDSTAT_BYTES = 128  # "<on-cpu ns> <run-queue wait ns> <slices>\n": three u64 in decimal fit in 64
MAX_STAT_HEAD_BYTES = 64  # "<tid> (<comm>) <state> ": a tid of at most 7 digits, comm at most 15 bytes (TASK_COMM_LEN)


class ThreadTimes(NamedTuple):
    """One thread's scheduler counters (``/proc/<pid>/task/<tid>/schedstat``: ns on a CPU, ns waiting on a run
    queue, times given a CPU; ``Documentation/scheduler/sched-stats.rst``) and whether it was runnable (state
    ``R`` in ``/proc/<pid>/task/<tid>/stat``, ``proc(5)``) when read. ``wait_ns`` grows only when a wait ends
    (the kernel adds it as the thread gets a CPU), so a wait still going on shows in none of the counters: only
    a runnable thread whose ``run_ns`` and ``slices`` stand still says so (:class:`WaitPeak`)."""

    run_ns: int
    wait_ns: int
    slices: int
    runnable: bool


def thread_times(pids: Iterable[int], proc: Path = Path("/proc"),
                 main_only: bool = False) -> dict[tuple[int, int], ThreadTimes]:
    """:class:`ThreadTimes` of every thread of ``pids`` (``main_only``: of each one's main thread, tid = pid):
    ``{(pid, tid): times}``. Threads and processes that are gone (or a kernel without schedstat) are left out;
    never raises. Each file is read bounded (:data:`MAX_SCHEDSTAT_BYTES`, :data:`MAX_STAT_HEAD_BYTES`)."""
    out: dict[tuple[int, int], ThreadTimes] = {}
    for pid in pids:
        try:
            tids = [str(pid)] if main_only else os.listdir(proc / str(pid) / "task")
        except OSError:
            continue
        for tid in tids:
            task = proc / str(pid) / "task" / tid
            try:
                with open(task / "schedstat", "rb") as f:
                    run_ns, wait_ns, slices = (int(v) for v in f.read(MAX_SCHEDSTAT_BYTES).split()[:3])
                with open(task / "stat", "rb") as f:
                    head = f.read(MAX_STAT_HEAD_BYTES)
                # "<tid> (<comm>) <state> ...": comm (at most 15 bytes) may hold ")" itself, the fields after it never
                close = head.rindex(b")")
                out[(pid, int(tid))] = ThreadTimes(run_ns, wait_ns, slices, head[close + 2:close + 3] == b"R")
            except (OSError, ValueError):
                continue
    return out


class WaitPeak:
    """The worst single thread's wait for a CPU over the last ``window_ns`` (ns), from samples of
    :func:`thread_times`, or the sampler's own lateness if more.

    ``sample(now_ns, times, late_ns)`` returns the largest of, for each thread, the sum of

    - the waits that ended within the window: its ``wait_ns`` now less its ``wait_ns`` at the oldest sample within
      the window (a thread first seen inside the window counts from its first sample), and
    - the wait still going on: a thread runnable at this sample and at an earlier one, its ``run_ns`` and
      ``slices`` unchanged since, has had no CPU in between although it wanted one, so it has waited at least
      since that earlier sample (a lower bound: it may have been waiting before). The kernel counts such a wait
      only once it ends, which for a thread starved for the length of a deadline miss run is after the judgement;

    and of the sampler's lateness (``late_ns``) at each sample within the window.
    """

    def __init__(self, window_ns: int = WINDOW_NS) -> None:
        self.window_ns = window_ns
        self._history: deque[tuple[int, dict[tuple[int, int], int]]] = deque()
        self._runnable: dict[tuple[int, int], tuple[int, int, int]] = {}  # thread -> (since ns, run_ns, slices)
        self._late: deque[tuple[int, int]] = deque()  # (sampled at, the sampler's own lateness) ns

    def sample(self, now_ns: int, times: dict[tuple[int, int], ThreadTimes], late_ns: int = 0) -> int:
        """The peak (ns) at ``now_ns``; ``late_ns``: how much later than asked the sampler itself woke for this
        sample (a twin thread's wait for the host as well, counted within the window like the threads'; the caller
        passes 0 while the twin is not able to work)."""
        if late_ns > 0:
            self._late.append((now_ns, late_ns))
        while self._late and self._late[0][0] <= now_ns - self.window_ns:
            self._late.popleft()
        waits = {key: t.wait_ns for key, t in times.items()}
        self._history.append((now_ns, waits))
        while len(self._history) > 1 and self._history[1][0] <= now_ns - self.window_ns:
            self._history.popleft()
        first: dict[tuple[int, int], int] = {}
        for _, old in self._history:
            for key, ns in old.items():
                first.setdefault(key, ns)
        peak = max((late for _, late in self._late), default=0)
        runnable: dict[tuple[int, int], tuple[int, int, int]] = {}
        for key, t in times.items():
            going_on = 0
            if t.runnable:
                since = self._runnable.get(key)
                if since is not None and since[1:] == (t.run_ns, t.slices):
                    going_on = now_ns - since[0]
                else:
                    since = (now_ns, t.run_ns, t.slices)
                runnable[key] = since
            peak = max(peak, t.wait_ns - first[key] + going_on)
        self._runnable = runnable
        return peak


def encode(peak_ns: int, updated_ns: int, able: bool = True) -> bytes:
    return _LAYOUT.pack(peak_ns, updated_ns, int(able), peak_ns ^ updated_ns ^ int(able) ^ MAGIC)


def decode(data: bytes) -> tuple[int, int, bool] | None:
    """``(peak_ns, updated_ns, able)``, or None for a short or torn record."""
    if len(data) != _LAYOUT.size:
        return None
    peak, updated, able, check = _LAYOUT.unpack(data)
    if check != peak ^ updated ^ able ^ MAGIC or able > 1:
        return None
    return peak, updated, bool(able)


class WaitPublisher:
    """The daemon's side: a thread that samples ``pids()`` (its compute child, the twin's GPU) every
    :data:`SAMPLE_PERIOD_S` and rewrites the file at ``path`` until :meth:`stop`. The file is created anew
    (``O_EXCL``, 0600, never following a link: a planted file or link at the path is replaced, not written
    through) and removed at stop."""

    def __init__(self, path: Path, pids: Callable[[], Iterable[int]],
                 can_work: Callable[[], bool] = lambda: True) -> None:
        self.path, self.pids, self.can_work = path, pids, can_work
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="twin-hostwait", daemon=True)
        self._fd: int | None = None

    def start(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.pwrite(self._fd, encode(0, time.monotonic_ns(), able=False), 0)  # nothing sampled yet
        self._thread.start()

    def _run(self) -> None:
        peak = WaitPeak()
        period_ns = int(SAMPLE_PERIOD_S * 1e9)
        asked = time.monotonic_ns() + period_ns
        while not self._stop.wait(max(0, asked - time.monotonic_ns()) / 1e9):
            now = time.monotonic_ns()
            # the GPU is the compute child's main thread, which runs every load and RUN (compute.py's loop); its
            # reader and parent-watch threads are housekeeping, whose waits (the watch wakes every 0.5 s whatever the
            # GPU does) would excuse a hung GPU's misses on a busy host
            able = self.can_work()
            value = peak.sample(now, thread_times(self.pids(), main_only=True), now - asked if able else 0)
            asked += period_ns
            if asked <= now:  # woke over a period late: the next sample one period from now, not at once
                asked = now + period_ns
            if self._fd is not None:
                try:
                    os.pwrite(self._fd, encode(value, now, able), 0)
                except OSError:
                    return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2 * SAMPLE_PERIOD_S + 1.0)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def read_peak_ms(path: Path, now_ns: int, fresh_ns: int = FRESH_NS) -> float:
    """The twin's worst wait for a host CPU over its last second (ms) from the file at ``path``, read at ``now_ns``
    (CLOCK_MONOTONIC): the record's peak, or, when the record is older than one :data:`SAMPLE_PERIOD_S` and the twin
    was able to work at its sample, its age less that period if more -- the sampler, a twin thread, has been held
    off that long and is still waiting.
    0.0 when the file is absent, not this user's regular file, torn, or older than ``fresh_ns``. Never raises: a
    missing figure only means the host is judged on the node's own."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return 0.0
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or (st.st_mode & 0o170000) != 0o100000:
            return 0.0
        got = decode(os.pread(fd, _LAYOUT.size, 0))
    except OSError:
        return 0.0
    finally:
        os.close(fd)
    if got is None or not 0 <= now_ns - got[1] <= fresh_ns:
        return 0.0
    peak, updated, able = got
    held_off = now_ns - updated - int(SAMPLE_PERIOD_S * 1e9) if able else 0
    return max(peak, held_off) / 1e6
