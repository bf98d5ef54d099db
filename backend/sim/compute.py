"""The twin's GPU compute in a process of its own: LOAD compiles, RUN runs, off the process that answers USB.

Why a process: the twin daemon answers every client's control and bulk transfers from threads of one
Python process. A compile (tinygrad's ONNX parse, kernel codegen and JIT capture, or onnxruntime's session
build) and a model run hold that process's GIL for hundreds of milliseconds at a time; in-process, the
connection threads then miss their replies for over a second and the client reads the dock as unplugged.
A real dock's bridge answers control transfers while its GPU is busy, so here the compute runs in a
child process and the engine thread (``engine.py``) only waits for its reply, with the GIL released.

One child per parent process (:func:`acquire` / :func:`release`, reference counted by the engines using it),
so the compile cache (:func:`compile_program`, which lives in the child) is shared by every twin of the process:
a real model compiles once while any twin of the process is open. It is started lazily (the first LOAD), and
stopped when the last engine releases it (``Twin.close()``), at interpreter exit (``atexit``), or by itself:
its socket's EOF (the parent closed it or died) and a parent-pid watchdog (``os.getppid()``, every
:data:`WATCHDOG_S`) both end it with ``os._exit``. ``PR_SET_PDEATHSIG`` is not used: it follows the parent
*thread* that forked, and the engine thread that starts the child may end before another twin stops using it.

Wire (a socketpair, ``multiprocessing.connection.Connection`` framing of pickled tuples; every request
carries an id ``rid``, replies come in request order):

- ``("load", rid, onnx_bytes, engine)`` -> ``("ok", rid, signature)`` (the model's ``signature()``) or
  ``("error", rid, "Type: message")`` (the compile failed: ``ModelError``, tinygrad on an odd graph);
- ``("run", rid, (sha256, engine), warp, inputs)`` with ``inputs`` a list of ``(name, dtype, shape, bytes)``
  and ``warp`` a :class:`~chestnut.backend.warp.WarpSpec` or None (``warp_numpy`` then runs here, before the
  model) -> ``("ok", rid, [output bytes in the model's output order])``, ``("missing", rid)`` (this child
  never compiled it, or its LRU dropped it: LOAD it again) or ``("error", rid, message)``;
- ``("cancel", rid)``: the parent gave up on request ``rid`` (a GPU or queue reset); not yet started, it is
  skipped; started, its reply is dropped.

If the child dies, every request waiting on it fails with :class:`ComputeDied` (one log line) and the next
request starts a new child.

Priority: a RUN stands for the GPU's own compute, which a real dock does beside the host and not on its
CPU. So the child runs each RUN at ``SCHED_RR`` ``priority`` (default :data:`DEFAULT_PRIORITY`) and drops back
to ``SCHED_OTHER`` between RUNs; a LOAD (tens of seconds of pure-Python tinygrad compile for a real model)
always runs at the normal policy: at a realtime priority it would hold a core for that long, and the
kernel's RT throttling (``/proc/sys/kernel/sched_rt_runtime_us`` 950000) would leave the rest of that core
5 %. ``SCHED_RR`` rather than ``SCHED_FIFO`` so two twins' RUNs at the same priority share a core in 100 ms
slices. The priority must stay below the node's own realtime priority (openpilot's modeld runs at 54,
``selfdrive/modeld/modeld.py`` ``config_realtime_process``): the twin stands for a device, the node is what
must not be starved. Where the system refuses (no ``CAP_SYS_NICE`` or ``RLIMIT_RTPRIO``), one INFO line and
RUNs at the normal policy.

Test hook: while the file named by ``$CHESTNUT_TWIN_HOLD_LOAD`` exists, the child holds every LOAD before
compiling it, in steps that keep its GIL (as a compile does), so a test can observe a load in progress.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_PRIORITY = 10
"""``SCHED_RR`` priority of a RUN in the compute child (0: the normal policy). Below the twin daemon's
(:data:`DEFAULT_BRIDGE_PRIORITY`), so the bridge answers while the GPU computes, and below the node's."""
DEFAULT_BRIDGE_PRIORITY = 20
"""``SCHED_RR`` priority of the twin daemon's threads, which answer USB (``daemon.serve``; 0: normal)."""
MAX_PRIORITY = 49
"""Highest realtime priority the twin accepts: it must stay below the node's (openpilot modeld: 54)."""
WATCHDOG_S = 0.5          # s between the child's checks that its parent is still alive
STOP_WAIT_S = 1.0         # s an idle child gets to exit on EOF before it is killed
HOLD_STEP_S = 0.2         # s per GIL-holding step of the test hook
HOLD_ENV = "CHESTNUT_TWIN_HOLD_LOAD"


class ComputeDied(RuntimeError):
    """The compute child exited (or could not be started) while a request waited on it."""


def check_priority(priority: int, what: str) -> int:
    """``priority`` if it is 0 (normal policy) or 1..:data:`MAX_PRIORITY`; raises ValueError otherwise."""
    if not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
        raise ValueError(f"{what} {priority!r}: use 0 (normal scheduling) or 1..{MAX_PRIORITY} (SCHED_RR, below "
                         "the node's realtime priority)")
    return priority


def set_realtime(priority: int) -> str | None:
    """Put the calling thread (and the threads and processes it starts later) at ``SCHED_RR`` ``priority``
    (0: leave it alone). Returns None when granted, else one line saying why not (``PermissionError``
    without ``CAP_SYS_NICE``/``RLIMIT_RTPRIO``, or a system without the call)."""
    if priority <= 0:
        return None
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(priority))
    except (OSError, AttributeError) as e:
        return f"SCHED_RR priority {priority} refused ({getattr(e, 'strerror', None) or e}); normal scheduling"
    return None


def _normal_policy() -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


# ====================================================================== the child
def _hold_load() -> None:
    """The test hook: hold the LOAD while ``$CHESTNUT_TWIN_HOLD_LOAD`` exists, keeping the GIL meanwhile."""
    path = os.environ.get(HOLD_ENV)
    if not path:
        return
    sleep_with_gil = ctypes.PyDLL(None).usleep  # PyDLL: the GIL stays held during the call
    while os.path.exists(path):
        sleep_with_gil(int(HOLD_STEP_S * 1e6))


COMPILE_CACHE_SIZE = 8  # programs a compute process keeps compiled (LRU)
PROGRAM_ENGINES = ("tinygrad", "onnxruntime")
_cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
_cache_lock = threading.Lock()


def compile_program(onnx_bytes: bytes, engine: str = "tinygrad") -> Any:
    """The warmed executor of a program, compiled once per process (LRU by sha256 and engine).

    ``engine``: ``"tinygrad"`` — :class:`OnnxModel` on the host CPU through the compile cache
    (``backend/jitcache.py``), the same kernels tinygrad runs for the CPU reference, so results are
    bit-exact with it; ``"onnxruntime"`` — :class:`~chestnut.backend.model.OrtModel`'s
    onnxruntime session, an order of magnitude faster on a small host (a GPU's real-time budget
    cannot be met by tinygrad's CPU backend there). Both expose ``inputs``, ``outputs``, ``run`` and
    ``signature()``. Raises :class:`chestnut.backend.errors.ModelError` for a graph it cannot load
    and ``ValueError`` for an unknown engine.
    """
    from chestnut.backend.jitcache import JitCache
    from chestnut.backend.model import OnnxModel, OrtModel

    if engine not in PROGRAM_ENGINES:
        raise ValueError(f"program engine {engine!r}: use one of {PROGRAM_ENGINES}")
    sha = hashlib.sha256(onnx_bytes).hexdigest()
    with _cache_lock:
        model = _cache.get((sha, engine))
        if model is not None:
            _cache.move_to_end((sha, engine))
            return model
        if engine == "tinygrad":
            model = OnnxModel(onnx_bytes, name=f"program-{sha[:12]}", jit_cache=JitCache())
        else:
            model = OrtModel(onnx_bytes, name=f"program-{sha[:12]}", threads=1)
        model.warm()
        _cache[(sha, engine)] = model
        while len(_cache) > COMPILE_CACHE_SIZE:
            _cache.popitem(last=False)
        return model


def _load(onnx_bytes: bytes, engine: str) -> dict[str, Any]:
    _hold_load()
    return dict(compile_program(onnx_bytes, engine).signature())


def _run(key: tuple[str, str], warp: Any, inputs: list[tuple[str, str, tuple[int, ...], bytes]]) -> list[bytes] | None:
    import numpy as np

    from chestnut.backend.warp import warp_numpy

    with _cache_lock:
        model = _cache.get(key)
    if model is None:
        return None
    arrays = {name: np.frombuffer(raw, dtype=dtype).reshape(shape) for name, dtype, shape, raw in inputs}
    if warp is not None:  # the GPU's warp: the raw frame to the model's input, then the model
        name = model.inputs[0].name
        arrays = {name: warp_numpy(warp, arrays[name])}
    result = model.run(arrays)
    return [np.ascontiguousarray(result[s.name], dtype=s.dtype).tobytes() for s in model.outputs]


def child_main(fd: int, parent_pid: int, priority: int) -> None:
    """The compute child's body (``python -m chestnut.backend.sim.compute FD PARENT_PID PRIORITY``). Never returns."""
    _normal_policy()  # a realtime daemon's policy is inherited through fork: compiles run at the normal one
    conn = Connection(fd)
    rt_note = set_realtime(priority) if priority else None
    run_rt = priority > 0 and rt_note is None
    _normal_policy()
    conn.send(("hello", 0, os.getpid(), rt_note))
    requests: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
    cancelled: set[int] = set()

    def read() -> None:
        try:
            while True:
                msg = conn.recv()
                if msg[0] == "cancel":
                    cancelled.add(msg[1])
                else:
                    requests.put(msg)
        except (EOFError, OSError):
            os._exit(0)

    def watch() -> None:
        while True:
            threading.Event().wait(WATCHDOG_S)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=read, name="compute-read", daemon=True).start()
    threading.Thread(target=watch, name="compute-watchdog", daemon=True).start()
    while True:
        msg = requests.get()
        op, rid = msg[0], msg[1]
        if rid in cancelled:
            cancelled.discard(rid)
            continue
        reply: tuple[Any, ...]
        try:
            if op == "load":
                reply = ("ok", rid, _load(msg[2], msg[3]))
            elif op == "run":
                if run_rt:
                    set_realtime(priority)
                try:
                    outputs = _run(msg[2], msg[3], msg[4])
                finally:
                    if run_rt:
                        _normal_policy()
                reply = ("missing", rid) if outputs is None else ("ok", rid, outputs)
            else:
                reply = ("error", rid, f"unknown compute request {op!r}")
        except Exception as e:  # ModelError, tinygrad or onnxruntime failing on an odd graph or input
            reply = ("error", rid, f"{type(e).__name__}: {e}")
        if rid in cancelled:
            cancelled.discard(rid)
            continue
        try:
            conn.send(reply)
        except OSError:
            os._exit(0)


# ====================================================================== the parent's side
class ComputeChild:
    """The parent's handle on one compute child: :meth:`submit` a request, get a Future of its reply.

    Thread-safe. A dead child (or none yet) is (re)started by the next :meth:`submit`."""

    def __init__(self, priority: int = DEFAULT_PRIORITY) -> None:
        self.priority = check_priority(priority, "compute priority")
        self._lock = threading.Lock()
        self._rids = itertools.count(1)
        self._pending: dict[int, Future[tuple[Any, ...]]] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._conn: Connection | None = None
        self._stopping = False
        self.starts = 0

    @property
    def pid(self) -> int | None:
        p = self._proc
        return None if p is None or p.poll() is not None else p.pid

    def status(self) -> dict[str, Any]:
        """``{"pid", "pending", "starts", "priority"}``: the child now (pid None: none running). Lock-free (the
        twin calls it holding its own lock, which must never wait for a request being sent)."""
        return {"pid": self.pid, "pending": len(self._pending), "starts": self.starts, "priority": self.priority}

    def _start(self) -> None:
        """Lock held: spawn a child. Raises ComputeDied if it cannot be started."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "chestnut.backend.sim.compute", str(child.fileno()), str(os.getpid()),
                 str(self.priority)],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, close_fds=True)
        except OSError as e:
            parent.close()
            raise ComputeDied(f"the program engine's compute process could not be started: {e}") from None
        finally:
            child.close()
        self._proc, self._sock = proc, parent
        self._conn = conn = Connection(os.dup(parent.fileno()))
        self.starts += 1
        threading.Thread(target=self._read, args=(proc, conn), name="twin-compute-reader", daemon=True).start()

    def _read(self, proc: subprocess.Popen[bytes], conn: Connection) -> None:
        """The reader of one child's replies; at its EOF every request still waiting on it fails."""
        try:
            while True:
                msg = conn.recv()
                if msg[0] == "hello":
                    _, _, pid, note = msg
                    how = note or (f"RUN at SCHED_RR priority {self.priority}" if self.priority
                                   else "RUN at normal scheduling")
                    log.info("program engine compute process pid %d started: %s", pid, how)
                    continue
                with self._lock:
                    fut = self._pending.pop(msg[1], None)
                if fut is not None:
                    fut.set_result(msg)
        except (EOFError, OSError):
            pass
        with self._lock:
            mine = self._proc is proc
            stopping = self._stopping or not mine
            if mine:
                self._proc = self._sock = self._conn = None
                waiting, self._pending = self._pending, {}
            else:
                waiting = {}
        with contextlib.suppress(OSError):
            conn.close()
        code = proc.poll()
        if code is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(STOP_WAIT_S)
        if not stopping:
            log.warning("program engine compute process pid %d exited (code %s) with %d request(s) waiting; the "
                        "next LOAD or RUN starts a new one", proc.pid, code, len(waiting))
        for fut in waiting.values():
            fut.set_exception(ComputeDied(f"the program engine's compute process (pid {proc.pid}) exited "
                                          f"(code {code})"))

    def submit(self, msg: tuple[Any, ...]) -> tuple[int, Future[tuple[Any, ...]]]:
        """Send ``msg`` (its op and arguments; the rid is added) to the child, starting one if none runs (also
        when the child has exited but its reader has not yet seen the end: requests it left fail here).
        Returns the rid and a Future of the reply tuple; the Future raises ComputeDied if the child dies
        first. Raises ComputeDied if no child can be started."""
        fut: Future[tuple[Any, ...]] = Future()
        orphans: dict[int, Future[tuple[Any, ...]]] = {}
        with self._lock:
            self._stopping = False
            dead = self._proc is not None and self._proc.poll() is not None
            if dead:  # reaped before its reader saw the EOF: its requests fail here, a new child takes this one
                orphans, self._pending = self._pending, {}
                if self._sock is not None:
                    self._sock.close()
                self._proc = self._sock = self._conn = None
            if self._conn is None:
                self._start()
            rid = next(self._rids)
            self._pending[rid] = fut
            conn = self._conn
            assert conn is not None
            try:
                conn.send((msg[0], rid, *msg[1:]))
            except OSError as e:  # the reader sees the EOF and fails the others
                self._pending.pop(rid, None)
                fut.set_exception(ComputeDied(f"the program engine's compute process went away: {e}"))
        for orphan in orphans.values():
            orphan.set_exception(ComputeDied("the program engine's compute process exited"))
        return rid, fut

    def cancel(self, rid: int) -> None:
        """Give up on request ``rid``: skipped if not started, its reply dropped."""
        with self._lock:
            self._pending.pop(rid, None)
            conn = self._conn
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(("cancel", rid))

    def stop(self) -> None:
        """End the child: EOF, :data:`STOP_WAIT_S` to exit, then SIGKILL (at once when it is busy). Idempotent."""
        with self._lock:
            self._stopping = True
            proc, sock, busy = self._proc, self._sock, bool(self._pending)
        if proc is None:
            return
        if busy:
            proc.kill()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the reader; the child reads EOF
            sock.close()
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_shared: ComputeChild | None = None
_users = 0
_shared_lock = threading.Lock()


def acquire(priority: int = DEFAULT_PRIORITY) -> ComputeChild:
    """The process's compute child (created on the first call, with that call's ``priority``); pair with
    :func:`release`."""
    global _shared, _users
    with _shared_lock:
        if _shared is None:
            _shared = ComputeChild(priority)
        _users += 1
        return _shared


def release(child: ComputeChild) -> None:
    """One user fewer; the last one stops the child (its compile cache goes with it)."""
    global _shared, _users
    with _shared_lock:
        if child is not _shared:
            child.stop()
            return
        _users -= 1
        if _users > 0:
            return
        _shared, _users = None, 0
    child.stop()


def running_pids() -> tuple[int, ...]:
    """The pid of the process's compute child, if one runs."""
    with _shared_lock:
        child = _shared
    pid = None if child is None else child.pid
    return () if pid is None else (pid,)


@atexit.register
def _stop_at_exit() -> None:
    with _shared_lock:
        child = _shared
    if child is not None:
        child.stop()


if __name__ == "__main__":
    child_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
