"""The ``ray`` executor: offline units of work on a Ray cluster (``chestnut[cluster]``, Ray 2.60).

The only module that imports Ray; :func:`chestnut.node.offline.executor.make_executor` loads it when
``--executor ray`` is asked for. Every worker is a :class:`SegmentWorker` actor that keeps its loaded
and compiled models for its lifetime (:func:`chestnut.node.offline.replay._model`: tinygrad compiles once
per process); the pool has one actor per CPU of the cluster (``ray.cluster_resources()["CPU"]``) unless
``workers`` says otherwise, placed with Ray's ``SPREAD`` strategy so that every node gets its share. The
driver keeps exactly one unit in flight per actor and hands the next one to whichever actor finishes
(``ray.wait``): a slow node takes fewer units.

Failures (Ray's fault-tolerance docs, "Actor fault tolerance": ``max_restarts``, ``max_task_retries``):
an actor whose process or node dies is restarted (:data:`MAX_RESTARTS` times) and the unit it held is
run again by Ray (:data:`MAX_TASK_RETRIES` times); a unit whose actor is gone for good is handed to
another actor, :data:`~chestnut.node.offline.units.MAX_ATTEMPTS` tries in all, then reported as
failed. A unit that raises by itself (a model that cannot load) fails at once: running it elsewhere
would fail the same way.

Logs: by default a worker reads a unit's path, so every node must see the same files at the same path
(a shared file system). With ``ship_logs`` the driver reads each file once (bounded by
:data:`~chestnut.node.offline.units.MAX_SHIP_BYTES`), puts it in the object store, and the actor
writes it to a private temporary file (:func:`~chestnut.node.offline.units.run_unit`).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayError, RayTaskError

from chestnut.node.offline.replay import check_workers
from chestnut.node.offline.units import (
    MAX_ATTEMPTS,
    ExecutorError,
    Outcome,
    Shipped,
    Unit,
    read_shipped,
    run_unit,
    worker_id,
)

log = logging.getLogger("chestnut.fleet")

MAX_RESTARTS = 4  # an actor restarted after its process died, per actor
MAX_TASK_RETRIES = 2  # a unit re-run by Ray on the restarted actor
START_TIMEOUT_S = 120.0  # actors started (a fresh node imports numpy, tinygrad, onnxruntime)
POLL_S = 0.2  # ray.wait period: how soon Ctrl-C is seen
PARENT_POLL_S = 1.0  # how often a worker checks that its raylet is still its parent
PROBE_TIMEOUT_S = 5.0  # TCP connect to an explicit --ray-address before Ray's client is let loose on it


def _auto_address() -> tuple[str, str]:
    """The cluster ``--ray-address auto`` names, as Ray resolves it (``RAY_ADDRESS``, else the address the
    last ``ray start`` recorded, else the one GCS process running on this machine), and where it came from.
    Raises :class:`ExecutorError` (one line, naming ``--ray-address``) when it names none or several: Ray's
    own text speaks of its ``--address`` flag."""
    from ray._private import services

    env = os.environ.get("RAY_ADDRESS", "")
    source = "RAY_ADDRESS" if env else "the last ray start's record"
    if env.startswith("ray://"):
        return env, source
    try:  # Ray's own resolution, a localhost address made the node's, as ray.init would
        return services.canonicalize_bootstrap_address_or_die("auto"), source
    except ValueError:
        raise ExecutorError(f"--ray-address auto: {source} {env!r} is not HOST:PORT or ray://HOST:PORT") from None
    except ConnectionError:
        running = sorted(services.find_gcs_addresses())
    if running:
        raise ExecutorError(
            f"--ray-address auto: {len(running)} Ray clusters run on this machine ({', '.join(running)}); "
            "give the one to use as HOST:PORT"
        )
    raise ExecutorError(
        "--ray-address auto: no running Ray cluster found (RAY_ADDRESS is unset, no ray start recorded one, "
        "none runs on this machine): start one with ray start --head, or give HOST:PORT"
    )


def _probe(address: str) -> str:
    """The address to give ``ray.init`` for ``--ray-address address``, refused at once (one line) where
    nothing listens: Ray's own client keeps retrying the GCS for minutes, in lines of its own. ``auto`` is
    resolved first (:func:`_auto_address`), so a stale ``RAY_ADDRESS`` or ``ray start`` record is refused
    the same way."""
    source = ""
    if address == "auto":
        address, source = _auto_address()
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise ExecutorError(
            f"--ray-address auto: {source} {address!r} is not HOST:PORT or ray://HOST:PORT" if source
            else f"--ray-address {address!r}: expected auto, HOST:PORT or ray://HOST:PORT"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:
        where = f"--ray-address auto: no Ray cluster answers at {address}, from {source}" if source else (
            f"no Ray cluster answers at {address}")
        raise ExecutorError(
            f"{where} ({e}): start one with ray start --head, or give the address it printed"
        ) from None
    return address


def _exit_with_parent() -> None:
    """End this worker process when its raylet (the parent that started it) is gone. Without it, actors
    outlived their node: with Ray 2.60's ``cluster_utils.Cluster``, idle ``ray::SegmentWorker`` processes
    of about 170 MB each were left, reparented to init, after the cluster was shut down
    (``tests/test_fleet_ray.py`` checks that none is left)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="chestnut-parent-watch", daemon=True).start()


def no_compile_pool() -> None:
    """Compile in this process, without tinygrad 0.14's pool of compile processes (``engine/worker.py``
    ``get_worker_pool``, sized by ``PARALLEL``): Ray ends an actor with SIGKILL, which leaves the pool's
    processes and its multiprocessing resource tracker running, re-parented to init."""
    os.environ["PARALLEL"] = "0"  # read when tinygrad is first imported
    helpers = sys.modules.get("tinygrad.helpers")
    if helpers is not None:
        helpers.PARALLEL.value = 0


class SegmentWorker:
    """One worker process of the pool: runs units, keeps its models loaded between them."""

    def __init__(self) -> None:
        from chestnut.backend.model import ensure_cpu_device

        _exit_with_parent()
        ensure_cpu_device()
        no_compile_pool()
        self.units = 0

    def ident(self) -> str:
        return worker_id()

    def run(
        self, unit: Unit, data: Shipped | bytes | None = None, next_data: Shipped | bytes | None = None
    ) -> tuple[Any, str, float]:
        t0 = time.perf_counter()
        result = run_unit(unit, data, next_data)
        self.units += 1
        return result, worker_id(), time.perf_counter() - t0


_Actor = ray.remote(num_cpus=1, max_restarts=MAX_RESTARTS, max_task_retries=MAX_TASK_RETRIES)(SegmentWorker)


class RayExecutor:
    """See the module docstring. ``address``: ``auto``, ``HOST:PORT``, ``ray://HOST:PORT``, or None for a
    private cluster on this machine (stopped by :meth:`close`); ``workers``: actors, None for one per CPU of
    the cluster. Raises :class:`~chestnut.node.offline.units.ExecutorError` when no cluster can be reached,
    ``ValueError`` when ``workers`` is below 1, or over this machine's bound for a private cluster
    (:func:`~chestnut.node.offline.replay.check_workers`), before any cluster is joined or started."""

    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        workers: int | None = None,
        ship_logs: bool = False,
        object_store_memory: int | None = None,
    ) -> None:
        if workers is not None:  # a private cluster's actors all run on this machine
            check_workers(workers, here=address is None)
        self.ship_logs = ship_logs
        self._owns = False
        self._temp: str | None = None
        if not ray.is_initialized():
            if address is not None:
                address = _probe(address)
            try:
                if address is None:
                    # Ray's session files (sockets, worker logs) in a directory of ours, mode 0700
                    self._temp = tempfile.mkdtemp(prefix="chestnut-ray-", dir="/tmp")
                    ray.init(
                        _temp_dir=self._temp,
                        num_cpus=workers,
                        object_store_memory=object_store_memory,
                        include_dashboard=False,
                        log_to_driver=False,
                        configure_logging=False,
                    )
                    self._owns = True
                else:
                    ray.init(address=address, log_to_driver=False, configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ExecutorError(f"cannot reach a Ray cluster at {address or 'this machine'}: {e}") from None
        cpus = int(ray.cluster_resources().get("CPU", 0))
        self.workers = int(workers) if workers is not None else max(cpus, 1)
        self.nodes = len([n for n in ray.nodes() if n.get("Alive")])
        self.pids: dict[int, str] = {}  # actor slot -> worker id it last reported
        self.start_s = 0.0  # from here to every actor answering (s)
        self._t_created = time.perf_counter()
        # the actors start now, while the driver resolves the logs' plans; run() waits for them
        self.actors: list[Any] = [_Actor.options(scheduling_strategy="SPREAD").remote() for _ in range(self.workers)]
        self._idents: list[Any] | None = [a.ident.remote() for a in self.actors]

    def describe(self) -> str:
        return (
            f"ray, {self.workers} actor(s) on {self.nodes} node(s)"
            f"{', logs shipped through the object store' if self.ship_logs else ''}"
        )

    def _started(self) -> None:
        if self._idents is None:
            return
        try:
            idents = ray.get(self._idents, timeout=START_TIMEOUT_S)
        except GetTimeoutError:
            raise ExecutorError(
                f"{self.workers} Ray actor(s) did not start within {START_TIMEOUT_S:g} s: "
                "are there that many free CPUs in the cluster?"
            ) from None
        self._idents = None
        self.pids = dict(enumerate(idents))
        self.start_s = time.perf_counter() - self._t_created

    def run(self, units: list[Unit], on_outcome: Callable[[Outcome], None] | None = None) -> Iterator[Outcome]:
        t0 = time.perf_counter()
        done = on_outcome or (lambda _o: None)
        if not self.actors:
            raise ExecutorError("this Ray executor was closed")
        self._started()
        todo = list(reversed(units))
        uses: dict[str, int] = {}
        for u in units:
            for p in (u.path, u.next_path):
                if p:
                    uses[p] = uses.get(p, 0) + 1
        shipped: dict[str, Any] = {}
        attempts: dict[tuple[str, int], int] = {}
        running: dict[Any, tuple[int, Unit, float, str]] = {}  # ref -> (actor slot, unit, queued s, pid then)
        idle = list(range(len(self.actors)))
        dead: set[int] = set()

        def ref_of(path: str | None) -> Any:
            if not self.ship_logs or path is None:
                return None
            if path not in shipped:
                shipped[path] = ray.put(read_shipped(path))
            return shipped[path]

        def release(u: Unit) -> None:
            for p in (u.path, u.next_path):
                if p:
                    uses[p] -= 1
                    if uses[p] == 0:
                        shipped.pop(p, None)

        def submit(slot: int, u: Unit) -> None:
            attempts[u.key] = attempts.get(u.key, 0) + 1
            ref = self.actors[slot].run.remote(u, ref_of(u.path), ref_of(u.next_path))
            running[ref] = (slot, u, time.perf_counter() - t0, self.pids[slot])

        try:
            while todo or running:
                while todo and idle:
                    submit(idle.pop(0), todo.pop())
                if not running:  # units left but every actor is gone
                    for u in reversed(todo):
                        out = Outcome(u, None, error="every Ray worker is gone", attempts=attempts.get(u.key, 0))
                        done(out)
                        yield out
                    return
                ready, _ = ray.wait(list(running), num_returns=1, timeout=POLL_S)
                for ref in ready:
                    slot, u, queued, pid_then = running.pop(ref)
                    now = time.perf_counter() - t0
                    try:
                        result, who, run_s = ray.get(ref)
                    except RayTaskError as e:  # the unit raised by itself: the same anywhere
                        idle.append(slot)
                        cause = e.cause if isinstance(e.cause, BaseException) else e
                        out = Outcome(
                            u,
                            None,
                            error=f"{type(cause).__name__}: {cause}",
                            worker=pid_then,
                            attempts=attempts[u.key],
                            queued_s=queued,
                            done_s=now,
                        )
                    except RayError as e:  # its process or node died and Ray's retries are spent, or its data was lost
                        if isinstance(e, ActorDiedError):  # gone for good (its restarts are spent)
                            dead.add(slot)
                        else:  # unavailable while Ray restarts it, or the unit's bytes were lost: it goes on
                            idle.append(slot)
                            if isinstance(e, RayActorError):
                                self.pids[slot] = ""  # its next process is not known yet
                        log.warning(
                            "%s: worker %s lost (%s); %s",
                            u.path,
                            pid_then,
                            type(e).__name__,
                            "retrying elsewhere" if attempts[u.key] < MAX_ATTEMPTS else "giving up",
                        )
                        if attempts[u.key] < MAX_ATTEMPTS:
                            todo.append(u)
                            continue
                        out = Outcome(
                            u,
                            None,
                            error=f"worker lost {attempts[u.key]} times ({type(e).__name__})",
                            worker=pid_then,
                            attempts=attempts[u.key],
                            queued_s=queued,
                            done_s=now,
                        )
                    else:
                        idle.append(slot)
                        # a different process answered: the actor was restarted under this unit and Ray ran it again
                        tries = attempts[u.key] + (1 if pid_then and who != pid_then else 0)
                        self.pids[slot] = who
                        out = Outcome(u, result, worker=who, attempts=tries, queued_s=queued, done_s=now, run_s=run_s)
                    release(u)
                    while todo and idle:  # the freed worker gets its next unit before anyone looks at this one
                        submit(idle.pop(0), todo.pop())
                    done(out)
                    yield out
                idle[:] = [s for s in idle if s not in dead]
        finally:
            for ref in running:
                ray.cancel(ref)
            shipped.clear()

    def worker_ids(self) -> list[str]:
        """The worker id (``pid@host``) each actor last reported, in pool order ("": restarting, unknown)."""
        return [self.pids[i] for i in sorted(self.pids)]

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self._owns and ray.is_initialized():
            ray.shutdown()
        if self._temp is not None:
            shutil.rmtree(self._temp, ignore_errors=True)
            self._temp = None
