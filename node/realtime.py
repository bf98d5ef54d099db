"""Realtime scheduling for the node and its worker, as openpilot does it.

openpilot's ``common/realtime.py`` ``config_realtime_process(cores, priority)`` pins a process to its
cores (``os.sched_setaffinity``) and makes it ``SCHED_FIFO`` at ``priority``
(``os.sched_setscheduler``); ``selfdrive/modeld/modeld.py`` calls it with priority 54. The node does
the same at start (:func:`config_realtime_process`, ``[realtime]`` in the node config), and so does its
worker, one priority below the node (:data:`WORKER_PRIORITY_BELOW`), so the node's watchdog can always
preempt a worker spinning in a wait. The camera, the logger and the twin stay below the node.

Without the right to it (no ``CAP_SYS_NICE``, ``RLIMIT_RTPRIO`` below the priority, a seccomp filter such
as systemd's ``RestrictRealtime=``) the kernel answers ``EPERM``: that is one line in the log, and the
process runs on with the policy it had (sched_setscheduler(2), sched_setaffinity(2)).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from typing import Any

POLICIES = {"fifo": "SCHED_FIFO", "rr": "SCHED_RR", "other": "SCHED_OTHER"}
"""``[realtime] policy`` -> the ``os`` constant; ``other`` asks for no realtime policy at all."""
DEFAULT_PRIORITY = 54  # openpilot selfdrive/modeld/modeld.py: config_realtime_process(7, 54)
WORKER_PRIORITY_BELOW = 1  # the worker runs this many priorities below the node
GRANT_HINT = ("grant it: systemd CPUSchedulingPolicy=/CPUSchedulingPriority=/LimitRTPRIO= "
              "(launch/chestnut-node.service), or `ulimit -r {priority}` / limits.conf rtprio for this user")


def config_realtime_process(policy: str, priority: int, cpus: tuple[int, ...] = (),
                            who: str = "node", all_threads: bool = False,
                            reset_on_fork: bool = False) -> tuple[bool, str]:
    """Ask for ``policy`` (a key of :data:`POLICIES`) at ``priority`` (1..99 for fifo and rr) and, when
    ``cpus`` is not empty, for those CPUs only, for this process: its calling thread and the threads it
    starts from now on, or with ``all_threads`` every thread it has now (``/proc/self/task``; Linux's
    ``sched_setscheduler`` sets one thread). With ``reset_on_fork`` the policy carries
    ``SCHED_RESET_ON_FORK`` (sched(7)): every task this one starts afterwards, a process -- tinygrad 0.14's
    compile pool (``engine/worker.py``), a runner's helpers -- or a thread, begins at the normal policy and
    cannot hold a core at this priority. Returns
    (everything granted, one line saying what was set or why not); never raises for a refusal
    (``PermissionError``, another ``OSError``, a platform without these calls). Raises ``ValueError`` for
    an unknown policy."""
    if policy not in POLICIES:
        raise ValueError(f"realtime policy {policy!r}; use one of {', '.join(POLICIES)}")
    notes, ok = [], True
    if cpus:
        try:
            os.sched_setaffinity(0, set(cpus))
            notes.append(f"pinned to CPU {','.join(map(str, cpus))}")
        except (OSError, AttributeError) as e:
            ok = False
            notes.append(f"CPU affinity {','.join(map(str, cpus))} refused ({_why(e)})")
    if policy == "other":
        notes.append("no realtime policy asked for ([realtime] policy = other)")
        return ok, f"{who} scheduling: " + "; ".join(notes)
    try:
        const = getattr(os, POLICIES[policy]) | (getattr(os, "SCHED_RESET_ON_FORK", 0) if reset_on_fork else 0)
        tids = [int(t) for t in os.listdir("/proc/self/task")] if all_threads else [0]
        for tid in tids:
            try:
                os.sched_setscheduler(tid, const, os.sched_param(priority))
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
        notes.insert(0, f"{POLICIES[policy]} priority {priority}")
    except (OSError, AttributeError) as e:
        ok = False
        notes.insert(0, f"{POLICIES[policy]} priority {priority} refused ({_why(e)}); running on "
                        f"{current_policy()}; {GRANT_HINT.format(priority=priority)}")
    return ok, f"{who} scheduling: " + "; ".join(notes)


def current_policy() -> str:
    """This process's policy and priority, e.g. ``SCHED_OTHER`` or ``SCHED_FIFO priority 54``."""
    try:
        pol = os.sched_getscheduler(0) & ~getattr(os, "SCHED_RESET_ON_FORK", 0)
        prio = os.sched_getparam(0).sched_priority
    except (OSError, AttributeError):
        return "its current policy"
    name = next((n for n in POLICIES.values() if getattr(os, n, None) == pol), f"policy {pol}")
    return f"{name} priority {prio}" if prio else name


def worker_priority(priority: int) -> int:
    """The worker's priority for a node at ``priority``: :data:`WORKER_PRIORITY_BELOW` below, at least 1."""
    return max(1, priority - WORKER_PRIORITY_BELOW)


def cpus_apart(cpus: tuple[int, ...]) -> bool:
    """Whether the node and its worker can run at the same time on two CPUs: ``cpus`` (``realtime.cpus``, where both
    are pinned; empty: any) names two or more, or, empty, this process may run on two or more (its affinity). On
    one CPU the node, a priority above its worker, would hold the worker off while it busy-waits for it."""
    if cpus:
        return len(set(cpus)) >= 2
    try:
        return len(os.sched_getaffinity(0)) >= 2
    except (AttributeError, OSError):
        return (os.cpu_count() or 1) >= 2


def _why(e: BaseException) -> str:
    if isinstance(e, PermissionError):
        return "EPERM: not permitted"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}"


CAMERA_PRIORITY = 51
"""The camera's SCHED_FIFO priority in a launched stack: above CPU-bound host work, so the frame rate the
node and the control daemon judge (``freq_ok``) is the camera's own and not the host's load, and below the
node (:data:`DEFAULT_PRIORITY`) and its worker: nothing the node waits on outranks it but the node itself."""
CONTROL_PRIORITY = 52
"""The control daemon's SCHED_FIFO priority: above the camera, below the node and its worker (openpilot runs
its control loop at realtime priority too, ``common/realtime.py`` ``Priority.CTRL_HIGH``)."""


def add_priority_argument(p: Any, default: int, who: str) -> None:
    """``--rt-priority N`` for a program of the stack (``who``): SCHED_FIFO at N, 0 for none."""
    p.add_argument("--rt-priority", type=_priority, default=default,
                   help=f"the {who}'s SCHED_FIFO priority (default {default}, below the node's {DEFAULT_PRIORITY}; "
                        "0: no realtime policy)")


def _priority(text: str) -> int:
    """argparse type of ``--rt-priority``: 0 (none) or a SCHED_FIFO priority 1..99 (sched(7))."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: want 0..99") from None
    if not 0 <= value <= 99:
        raise argparse.ArgumentTypeError(f"{value}: want 0 (no realtime policy) or 1..99")
    return value


def apply_priority(priority: int, who: str, log: logging.Logger) -> bool:
    """Ask for SCHED_FIFO at ``priority`` (0: none) for every thread of this process and those it starts
    later; one INFO line when granted, one WARNING line (no traceback) when refused. Returns whether it was
    granted. A priority not below the default node's worker (:func:`worker_priority` of :data:`DEFAULT_PRIORITY`)
    is granted with one WARNING line first: that program would preempt the node's per-frame work (openpilot keeps
    its camera and control below modeld the same way), which is right only where the node is set higher."""
    if priority == 0:
        return True
    if priority >= (worker := worker_priority(DEFAULT_PRIORITY)):
        log.warning("%s SCHED_FIFO priority %d is not below the node's worker's %d (a node at the default %d): it "
                    "would preempt the node's per-frame work; keep it below the node's [realtime] priority minus 1",
                    who, priority, worker, DEFAULT_PRIORITY)
    ok, line = config_realtime_process("fifo", priority, (), who, all_threads=True)
    log.log(logging.INFO if ok else logging.WARNING, "%s", line)
    return ok


def normal_policy() -> None:
    """Put this thread back on SCHED_OTHER (always permitted: it only lowers the priority; a platform
    without these calls keeps what it has)."""
    try:
        if os.sched_getscheduler(0) & ~getattr(os, "SCHED_RESET_ON_FORK", 0) != os.SCHED_OTHER:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (OSError, AttributeError):
        pass


class IdleCollector:
    """Python's cyclic garbage collector run between frames, never in the middle of one.

    CPython collects generation 0 whenever its allocations outnumber its deallocations by the first threshold
    (700, ``gc.get_threshold()``), wherever that allocation happens -- in the middle of a frame as likely as
    anywhere -- and now and then every object the imports and the model left (a full collection: 17-21 ms in a
    node serving the tiny model of ``tests/bench/bench_node.py``, timed with ``gc.callbacks``). openpilot turns
    the collector off in its realtime processes (``common/realtime.py`` ``config_realtime_process`` calls
    ``gc.disable()``) and lives with what reference counting leaves; here the collector keeps its work but
    moves it:

    - :meth:`engage`, once the process is ready (its imports done, its model loaded) and before it raises its
      scheduling priority: a full collection, then ``gc.freeze()`` (every object alive then is kept out of all
      later collections: the process's code and models, alive until it exits), then ``gc.disable()``;
    - :meth:`collect_due`, where a frame's output is out and before the next one is waited for: the oldest
      generation whose count passed its threshold (``gc.get_count()`` against ``gc.get_threshold()``), if any --
      CPython 3.11's choice in ``Modules/gcmodule.c`` ``collect_generations`` less one of its checks, which
      puts a full collection off until the objects promoted since the last one are a quarter of those it kept:
      with the heap frozen a full collection walks only what was made since, so it is not put off here;
    - :meth:`release`, when the process stops serving: the collector as it was. As a context manager:
      :meth:`engage` on entry, :meth:`release` on exit.

    Cycles are collected as they were, only later by at most one frame. Used by the node (after a turn's frames
    are answered), its worker (after each command but a WAKE, which comes just before a RUN), the camera (after
    each frame) and the control daemon (after each step). On CPython 3.14 and later, whose collector is incremental
    (``gc.get_count()`` and the thresholds mean other things there), it does nothing: CPython's own collector
    stays in charge. Not thread-safe: one thread (the process's loop) calls it."""

    def __init__(self) -> None:
        self.engaged = False
        self.collections = [0, 0, 0]  # made by collect_due, per generation
        self._was_enabled = True
        self._thresholds: tuple[int, ...] = (0, 0, 0)

    def __enter__(self) -> IdleCollector:
        self.engage()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def engage(self) -> None:
        """Collect everything once, freeze what survives, turn automatic collection off (idempotent; nothing on
        CPython 3.14 and later)."""
        if self.engaged or sys.version_info >= (3, 14):
            return
        self._thresholds = gc.get_threshold()
        gc.collect()
        gc.freeze()
        self._was_enabled = gc.isenabled()
        gc.disable()
        self.engaged = True

    def collect_due(self) -> int | None:
        """The collection due now, made: the generation collected (0, 1 or 2), or None when none is due (or
        the collector is not engaged, or a threshold of 0 turned collection off, as it does for CPython)."""
        if not self.engaged:
            return None
        counts = gc.get_count()
        if not self._thresholds[0] or counts[0] <= self._thresholds[0]:
            return None
        gen = next(g for g in (2, 1, 0) if g == 0 or counts[g] > self._thresholds[g])
        gc.collect(gen)
        self.collections[gen] += 1
        return gen

    def release(self) -> None:
        """Automatic collection as it was before :meth:`engage`, every frozen object collectable again."""
        if not self.engaged:
            return
        self.engaged = False
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
