"""Where offline units of work run: this machine's process pool (``local``) or a Ray cluster (``ray``).

A unit is one segment file (:class:`Unit`): ``replay`` runs :func:`~chestnut.node.offline.replay.replay_segment`
on it, ``extract`` reads it into a :class:`~chestnut.node.offline.timeline.FileExtract` for the contract
check. Both executors call the same :func:`run_unit`, so the executor changes where a unit runs, never
what it computes: results are equal bit for bit (``docs/offline.md``).

- :class:`LocalExecutor`: a spawn-context ``ProcessPoolExecutor`` of ``workers`` processes (``workers``
  1: this process). Each process keeps its loaded models for its lifetime
  (:func:`chestnut.node.offline.replay._model`).
- ``ray``: :class:`chestnut.node.offline.ray_executor.RayExecutor`, loaded only by :func:`make_executor`
  when asked for; nothing else imports Ray (``tests/test_fleet_ray.py`` checks it).

An executor's ``run(units, on_outcome)`` yields one :class:`Outcome` per unit in the order they finish;
``on_outcome`` is called for each (after the freed worker was handed its next unit). Units whose
worker died are retried (``attempts`` counts the tries); a unit that still fails is an outcome with
``error`` set, and the run goes on.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

from chestnut.node.offline.replay import (
    INTERRUPT_POLL_S,
    DeferredInterrupt,
    SegmentResult,
    SegmentTask,
    check_workers,
)
from chestnut.node.offline.timeline import FileExtract
from chestnut.node.offline.units import (
    EXECUTORS,
    KIND_EXTRACT,
    KIND_REPLAY,
    MAX_ATTEMPTS,
    MAX_SHIP_BYTES,
    RAY_INSTALL_HINT,
    ExecutorError,
    Outcome,
    Unit,
    read_shipped,
    relocate_extract,
    run_unit,
    worker_id,
)

log = logging.getLogger("chestnut.fleet")


class Executor(Protocol):
    name: str
    workers: int

    def run(self, units: list[Unit], on_outcome: Callable[[Outcome], None] | None = None) -> Iterator[Outcome]: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------- local


def _init_local_worker() -> None:
    from chestnut.backend.model import ensure_cpu_device

    ensure_cpu_device()


def _terminate_tree(pid: int) -> None:
    """SIGTERM a pool process and, first, the processes it started (tinygrad 0.14 ``engine/worker.py``
    ``get_worker_pool``: a compile pool per process, whose workers would otherwise be orphaned and print
    a traceback each when their parent's pipe breaks)."""
    import psutil

    try:
        parent = psutil.Process(pid)
        parent.suspend()  # it starts no child after the list is taken (one cut off mid-start-up prints a traceback)
        for child in parent.children(recursive=True):
            child.terminate()
        parent.terminate()
        parent.resume()
    except psutil.Error:  # already gone
        pass


def _init_pool_process() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle (it stops the pool)
    _init_local_worker()


def _local_unit(unit: Unit) -> tuple[SegmentResult | FileExtract, str, float]:
    t0 = time.perf_counter()
    result = run_unit(unit)
    return result, worker_id(), time.perf_counter() - t0


@dataclass
class LocalExecutor:
    """This machine's processes: ``workers`` spawn-context processes (1: this process, no pool, unless
    ``pool``). Raises ``ValueError`` when ``workers`` is below 1
    (:func:`~chestnut.node.offline.replay.check_workers`)."""

    workers: int = 1
    pool: bool | None = None  # None: a pool when workers > 1; True: a pool of one process too (benchmarks)
    name: str = "local"
    _t0: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        check_workers(self.workers)

    def describe(self) -> str:
        return f"local, {self.workers} process(es)"

    def run(self, units: list[Unit], on_outcome: Callable[[Outcome], None] | None = None) -> Iterator[Outcome]:
        self._t0 = time.perf_counter()
        done = on_outcome or (lambda _o: None)
        if not (self.workers > 1 if self.pool is None else self.pool) or len(units) <= 1:
            _init_local_worker()
            for u in units:
                queued = self._now()
                result, who, run_s = _local_unit(u)
                out = Outcome(u, result, worker=who, queued_s=queued, done_s=self._now(), run_s=run_s)
                done(out)
                yield out
            return
        yield from self._pool(units, done)

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _refill(
        self,
        ex: ProcessPoolExecutor,
        todo: list[Unit],
        running: dict[Future[Any], tuple[Unit, float]],
        attempts: dict[tuple[str, int], int],
    ) -> None:
        while todo and len(running) < self.workers:  # handed out as workers free up
            nxt = todo.pop()
            try:
                fut = ex.submit(_local_unit, nxt)
            except BaseException:  # a broken pool (its queues may be closed under the submit): the unit waits on
                todo.append(nxt)
                raise
            attempts[nxt.key] = attempts.get(nxt.key, 0) + 1
            running[fut] = (nxt, self._now())

    def _requeue(
        self, lost: list[tuple[Unit, float]], todo: list[Unit], attempts: dict[tuple[str, int], int]
    ) -> Iterator[Outcome]:
        """The units a broken pool had in flight (``lost``: each with its queued time): each goes again, up to
        :data:`MAX_ATTEMPTS`; the outcome of each that has had them all (its worker process died every time)."""
        for x, q in lost:
            if attempts[x.key] < MAX_ATTEMPTS:
                todo.append(x)
                continue
            yield Outcome(x, None, error=f"worker process died {attempts[x.key]} times", attempts=attempts[x.key],
                          queued_s=q, done_s=self._now())

    def _pool(self, units: list[Unit], done: Callable[[Outcome], None]) -> Iterator[Outcome]:
        import multiprocessing as mp
        from concurrent.futures.process import BrokenProcessPool

        ctx = mp.get_context("spawn")
        todo = list(reversed(units))
        attempts: dict[tuple[str, int], int] = {}
        with DeferredInterrupt() as sigint, _ManagerRaceQuiet():  # Ctrl-C taken at the loop's wait, never inside
            # the pool's own code
            while todo:
                ex = ProcessPoolExecutor(
                    max_workers=min(self.workers, len(todo)), mp_context=ctx, initializer=_init_pool_process
                )
                try:
                    running: dict[Future[Any], tuple[Unit, float]] = {}
                    while todo or running:
                        try:
                            self._refill(ex, todo, running, attempts)
                            finished, _ = wait(running, timeout=INTERRUPT_POLL_S, return_when=FIRST_COMPLETED)
                        except (BrokenProcessPool, OSError, RuntimeError):  # the pool broke as it took a unit
                            sigint.check()  # a Ctrl-C that reached its processes too: stop, not retry
                            lost, broken = list(running.values()), True
                        else:
                            sigint.check()
                            lost, broken = [], False
                        for fut in [] if broken else finished:
                            u, queued = running.pop(fut)
                            try:
                                result, who, run_s = fut.result()
                            except BrokenProcessPool:  # a worker died: every unit in flight goes again, up to a bound
                                lost, broken = [(u, queued), *running.values()], True
                                break
                            out = Outcome(
                                u,
                                result,
                                worker=who,
                                attempts=attempts[u.key],
                                queued_s=queued,
                                done_s=self._now(),
                                run_s=run_s,
                            )
                            try:
                                self._refill(ex, todo, running, attempts)  # the freed process's next unit first
                            except (BrokenProcessPool, OSError, RuntimeError):
                                sigint.check()
                                lost, broken = list(running.values()), True
                            done(out)
                            yield out
                            if broken:
                                break
                        if not broken:
                            continue
                        running.clear()
                        for out in self._requeue(lost, todo, attempts):
                            done(out)
                            yield out
                        break  # a fresh pool for the rest
                except KeyboardInterrupt:  # Ctrl-C: stop the units in flight now rather than at their end
                    for proc in list((getattr(ex, "_processes", None) or {}).values()):
                        _terminate_tree(proc.pid)
                    raise
                finally:
                    ex.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        pass


class _ManagerRaceQuiet:
    """While a pool runs: CPython 3.11's executor manager thread, finding the pool broken by a Ctrl-C that reached
    its workers as they started, counts them by iterating the executor's process dict while the main thread's
    submit may still add one (``concurrent/futures/process.py`` ``_ExecutorManagerThread.get_n_children_alive``):
    its ``RuntimeError: dictionary changed size during iteration`` went to stderr as a thread's traceback. That one
    error of that thread is logged at DEBUG instead; every other thread exception goes to the hook before."""

    def __enter__(self) -> _ManagerRaceQuiet:
        self._previous = threading.excepthook
        threading.excepthook = self._hook
        return self

    def __exit__(self, *exc: object) -> None:
        threading.excepthook = self._previous

    def _hook(self, args: threading.ExceptHookArgs) -> None:
        from concurrent.futures.process import _ExecutorManagerThread  # type: ignore[attr-defined]

        if (isinstance(args.thread, _ExecutorManagerThread) and args.exc_type is RuntimeError
                and "changed size during iteration" in str(args.exc_value)):
            log.debug("process pool manager thread: %s (a Ctrl-C broke the pool as it started)", args.exc_value)
            return
        self._previous(args)


def make_executor(
    name: str, *, workers: int | None = None, ray_address: str | None = None, ship_logs: bool = False
) -> Executor:
    """The executor called ``name``: ``local`` (``workers`` processes, default 1) or ``ray`` (connects to
    ``ray_address``: ``auto``, ``HOST:PORT`` or ``ray://HOST:PORT``; None starts a private one-machine
    cluster; ``workers`` actors, default the cluster's CPUs). ``ship_logs`` (ray only) sends every
    segment's bytes through the object store instead of the workers reading its path.

    Raises :class:`ExecutorError` when Ray is asked for and not installed (:data:`RAY_INSTALL_HINT`)
    or cannot connect, ``ValueError`` for an unknown name, a flag the executor does not take or ``workers``
    below 1 or, where they run on this machine (local, a private Ray cluster), over its bound
    (:func:`~chestnut.node.offline.replay.check_workers`; None is the executor's default)."""
    if workers is not None:  # 0 would otherwise read as "the default"
        check_workers(workers, here=name != "ray" or ray_address is None)
    if name == "local":
        if ship_logs or ray_address:
            raise ValueError("--ship-logs and --ray-address are for --executor ray (local workers read the paths)")
        return LocalExecutor(workers or 1)
    if name != "ray":
        raise ValueError(f"executor must be one of {EXECUTORS}, got {name!r}")
    try:
        import ray  # noqa: F401  (only probed here; ray_executor holds the Ray code)
    except ImportError:
        raise ExecutorError(RAY_INSTALL_HINT) from None
    from chestnut.node.offline.ray_executor import RayExecutor

    return RayExecutor(address=ray_address, workers=workers, ship_logs=ship_logs)


def units_of(kind: str, logs: Iterable[tuple[str, list[SegmentTask]]]) -> list[Unit]:
    """Units over ``(log, its tasks)`` pairs, log after log, segment after segment."""
    return [
        Unit(
            kind, log, t.index, t.path, t if kind == KIND_REPLAY else None, t.next_path if kind == KIND_REPLAY else None
        )
        for log, tasks in logs
        for t in tasks
    ]


__all__ = [
    "EXECUTORS",
    "KIND_EXTRACT",
    "KIND_REPLAY",
    "MAX_SHIP_BYTES",
    "RAY_INSTALL_HINT",
    "Executor",
    "ExecutorError",
    "LocalExecutor",
    "Outcome",
    "Unit",
    "make_executor",
    "read_shipped",
    "relocate_extract",
    "run_unit",
    "units_of",
    "worker_id",
]
