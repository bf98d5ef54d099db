"""The primary worker process: ``python -m chestnut.node.worker``, a child of the node that owns the dock.

It builds the :class:`~chestnut.backend.interface.PrimaryRunner` its START command names
(:mod:`chestnut.node.runner_loader`), climbs the qualification ladder with it
(:mod:`chestnut.backend.ladder`: the dock steps, the model load, a warm-up checked against the
recorded fingerprint) and then runs one inference per RUN command, one command at a time, on the
socket pair of :mod:`chestnut.node.wire`, with its tensors in the shared slots of
:mod:`chestnut.node.shm`. A heartbeat thread beats into the shared control block meanwhile. The
node's side is :class:`chestnut.node.worker_handle.WorkerHandle`.

The worker dies with its parent (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, as openpilot modeld's
worker does, plus a parent-pid check on every heartbeat) and ignores SIGINT (a terminal's Ctrl-C
reaches the whole process group; stopping the worker is the node's decision). Every failure goes
back to the node as a typed error (:func:`chestnut.node.wire.error_to_json`).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from chestnut.backend import errors as backend_errors
from chestnut.backend import progress
from chestnut.backend.errors import ChestnutError, OutputLayerError
from chestnut.backend.interface import LadderReport, ModelSpec, PrimaryRunner
from chestnut.backend.model import TensorSpec
from chestnut.backend.stages import StageTimes
from chestnut.msgs.fdpass import recv_fds
from chestnut.node.realtime import POLICIES, IdleCollector, config_realtime_process, normal_policy
from chestnut.node.runner_loader import RunnerSpec, resolve_runner
from chestnut.node.shm import ControlBlock, SharedSegment, SlotBuffers, SlotLayout, WorkerState
from chestnut.node.wire import (
    HEARTBEAT_PERIOD_S,
    PACKET_MAX_BYTES,
    STATUS_ERROR,
    Msg,
    WorkerError,
    error_to_json,
    ladder_to_json,
    model_spec_from_json,
    pack,
    result_payload,
    unpack,
)

log = logging.getLogger(__name__)

EXIT_STOPPED = 0        # asked to stop, runner closed
EXIT_START_FAILED = 3   # qualification or model load failed (reported to the node first)
EXIT_PARENT_GONE = 4    # the node died or closed the command socket
EXIT_PROTOCOL = 5       # the node sent something the worker cannot understand


def release_on_sigterm() -> None:
    """Install the worker's SIGTERM handler: a SIGTERM (the node's stop escalation, openpilot's manager sequence;
    or a stop sent to the whole process group by ``timeout``, a terminal or systemd's control-group kill) first
    releases what ``multiprocessing`` registered in this process -- tinygrad 0.14's compile pool
    (``engine/worker.py`` ``get_worker_pool``, spawned on the first multi-kernel compile) and its named
    semaphores, which the pool's resource tracker otherwise reports as "leaked semaphore objects" -- then the
    process dies of the same SIGTERM, so the node still sees ``killed by SIGTERM``."""

    def on_sigterm(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        tg = sys.modules.get("tinygrad.engine.worker")
        if tg is not None:
            tg.terminate_worker_pool()
        if "multiprocessing.util" in sys.modules:
            import multiprocessing.util

            # the finalizers multiprocessing runs at a normal exit: unlink the semaphores, end daemonic children
            multiprocessing.util._exit_function()  # type: ignore[attr-defined]
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``, prctl(2)).

    The parent may have died before the prctl took effect: then this process was already
    re-parented, ``os.getppid()`` differs from ``parent_pid``, and it exits at once.
    """
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1  # <linux/prctl.h>
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(pr_set_pdeathsig, ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent_pid:
        os._exit(EXIT_PARENT_GONE)


LATE_PEAK_WINDOW_NS = 1_000_000_000  # the heartbeat's lateness is the worst of this last second


class _Heartbeat(threading.Thread):
    """Beats every ``period_s`` and exits the process if the parent is gone (re-parented). Each sleep's
    lateness (how much later than ``period_s`` it ended, ns) goes to the control block as the worst of the
    last second: the worker's side of the host's lateness (``node/hostload.py``)."""

    def __init__(self, ctl: ControlBlock, period_s: float, parent_pid: int) -> None:
        super().__init__(name="chestnut-heartbeat", daemon=True)
        self.ctl, self.period_s, self.parent_pid = ctl, period_s, parent_pid
        self.transfer_errors: Callable[[], int] | None = None  # the runner's error count, once it has one

    def run(self) -> None:
        period_ns = int(self.period_s * 1e9)
        recent: collections.deque[tuple[int, int]] = collections.deque()  # (woke at, late by) ns
        while True:
            self.ctl.beat()
            if os.getppid() != self.parent_pid:
                os._exit(EXIT_PARENT_GONE)
            asked = time.monotonic_ns() + period_ns
            time.sleep(self.period_s)
            woke = time.monotonic_ns()
            recent.append((woke, max(0, woke - asked)))
            while recent and recent[0][0] < woke - LATE_PEAK_WINDOW_NS:
                recent.popleft()
            self.ctl.set_late_peak(max(late for _, late in recent))
            if self.transfer_errors is not None:
                self.ctl.set_transfer_errors(self.transfer_errors())


class _LoadRecorder:
    """Passes ``load``/``run`` through to the runner for the ladder's model steps, keeping what load returned."""

    def __init__(self, runner: PrimaryRunner) -> None:
        self.runner = runner
        self.specs: tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]] | None = None

    def load(self, model: ModelSpec) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        self.specs = self.runner.load(model)
        return self.specs

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.runner.run(inputs)

    @property
    def model_inputs(self) -> tuple[TensorSpec, ...]:
        """The model's own inputs when the runner's program warps the frame (``ModelSpec.warp``), else ()."""
        return tuple(getattr(self.runner, "model_inputs", ()))


class _WorkerLoop:
    """The worker's main thread: start-up, then one command at a time until STOP or EOF."""

    def __init__(self, sock: socket.socket, ctl: ControlBlock, heartbeat: _Heartbeat | None = None) -> None:
        self.sock, self.ctl, self.heartbeat = sock, ctl, heartbeat
        self.runner: PrimaryRunner | None = None
        self.slots: SlotBuffers | None = None
        self.realtime: tuple[str, int, tuple[int, ...]] | None = None  # (policy, priority, cpus) once serving

    def count_transfer_errors(self) -> None:
        """Have the heartbeat publish the runner's failed transfer attempts (its retry wrapper's error count,
        ``backend/retry.py`` ``RetryingUSB3.log.errors``: one int, read without a lock) in the control block,
        live: the node blames a run of deadline misses on the usb layer when the link was failing transfers
        meanwhile."""
        errors_log: Any = getattr(getattr(self.runner, "usb", None), "log", None)
        if self.heartbeat is not None and isinstance(getattr(errors_log, "errors", None), int):
            self.heartbeat.transfer_errors = lambda: int(errors_log.errors)

    def serve_realtime(self) -> None:
        """The worker's realtime scheduling (``node/realtime.py``), asked once the model is loaded and
        warm, for every thread: qualification and the load (a cold tinygrad compile holds a core for tens
        of seconds) run at the normal policy, the per-frame path above CPU-bound host work."""
        if self.realtime is not None:
            policy, priority, cpus = self.realtime
            ok, line = config_realtime_process(policy, priority, cpus, "worker", all_threads=True,
                                               reset_on_fork=True)
            log.log(logging.INFO if ok else logging.WARNING, "%s", line)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> tuple[Msg, int, int, int, int, bytes, list[int]] | None:
        """The next command, waited for (None: the node closed the socket); a descriptor it carries closes on
        ``exec``."""
        data, fds, _flags = recv_fds(self.sock, PACKET_MAX_BYTES, 1, socket.MSG_CMSG_CLOEXEC)
        if not data:
            return None
        return (*unpack(data), fds)

    def serve(self) -> int:
        try:
            return self._serve()
        except (ValueError, KeyError, TypeError) as e:  # a malformed message from the node
            log.error("protocol error: %s: %s", type(e).__name__, e)
            self.close_runner()
            return EXIT_PROTOCOL

    def _serve(self) -> int:
        got = self.recv()
        if got is None:
            return EXIT_PARENT_GONE
        kind, _status, _slot, _seq, _value, payload, _fds = got
        if kind is not Msg.START:
            log.error("first message is %s, expected START", kind.name)
            return EXIT_PROTOCOL
        start = json.loads(payload)
        rc = self.start(RunnerSpec.from_json(start["runner"]), model_spec_from_json(start["model"]), start["ladder"])
        if rc is not None:
            return rc
        # serving: a frame has its own supervision (the node's hang check); the per-frame path reports nothing
        progress.set_sink(None)
        self.count_transfer_errors()
        collector = IdleCollector()  # the runner loaded: Python's cycle collections only between commands; its
        collector.engage()  # full collection before the realtime policy, as any heavy work (serve_realtime)
        self.serve_realtime()
        while True:
            got = self.recv()
            if got is None:
                log.warning("command socket closed by the node; exiting")
                self.close_runner()
                return EXIT_PARENT_GONE
            kind, _status, slot, seq, _value, payload, fds = got
            if fds and kind is not Msg.BUFFERS:  # a descriptor only BUFFERS carries: any other is not kept open
                for fd in fds:
                    os.close(fd)
            if kind is Msg.RUN:
                self.run(seq, slot)
            elif kind is Msg.WAKE:  # woken ahead of a RUN (its CPU out of idle, its wake-up off the RUN's path):
                continue  # nothing between them, the RUN is waited for at once
            elif kind is Msg.BUFFERS:
                try:
                    self.map_buffers(payload, fds)
                except OSError as e:
                    log.error("cannot map the slots: %s", e)
                    self.close_runner()
                    return EXIT_PROTOCOL
            elif kind is Msg.PROBE:
                self.probe()
            elif kind is Msg.STOP:
                self.ctl.set_state(WorkerState.STOPPING)
                self.close_runner()
                return EXIT_STOPPED
            else:
                log.error("unexpected command %s", kind.name)
                return EXIT_PROTOCOL
            collector.collect_due()  # a command answered (a RUN's RESULT sent: while the node publishes it)

    def start(self, spec: RunnerSpec, model: ModelSpec, ladder: Mapping[str, Any]) -> int | None:
        """The qualification ladder (chestnut.backend.ladder): the runner's dock steps, then
        ``model_loaded`` and ``warmup``; READY with the specs, or START_FAILED with the first failure."""
        report: LadderReport | None = None
        try:
            from chestnut.backend.ladder import LadderConfig, model_steps, run_steps

            config = LadderConfig(**ladder)
            self.ctl.set_state(WorkerState.QUALIFYING)
            self.runner = resolve_runner(spec)
            report = self.runner.qualify()
            recorder = _LoadRecorder(self.runner)
            if report.first_failure is None:
                self.ctl.set_state(WorkerState.LOADING)
                run_steps(model_steps(recorder, model, config), report)
            failed = report.first_failure
            if failed is not None:
                if isinstance(failed.error, ChestnutError):
                    raise failed.error
                raise backend_errors.LAYER_ERRORS[failed.layer](failed.reason or failed.name, failed.detail)
            assert recorder.specs is not None
            inputs, outputs = recorder.specs
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the node, typed
            self.ctl.set_state(WorkerState.FAILED)
            payload = {"error": error_to_json(e), "ladder": ladder_to_json(report), "identity": self.identity()}
            self.send(pack(Msg.START_FAILED, status=STATUS_ERROR, payload=json.dumps(payload).encode()))
            self.close_runner()
            return EXIT_START_FAILED
        ready = {"inputs": [s.to_json() for s in inputs], "outputs": [s.to_json() for s in outputs],
                 "ladder": ladder_to_json(report), "kind": getattr(self.runner, "kind", spec.kind),
                 "identity": self.identity()}
        self.send(pack(Msg.READY, payload=json.dumps(ready).encode()))
        return None

    def identity(self) -> dict[str, str]:
        """The runner's versions and identity (``backend/probe.py`` ``runner_identity``), {} without a runner."""
        if self.runner is None:
            return {}
        from chestnut.backend.probe import runner_identity

        return runner_identity(self.runner)

    def map_buffers(self, payload: bytes, fds: list[int]) -> None:
        if len(fds) != 1:
            raise ValueError(f"BUFFERS carried {len(fds)} descriptors, expected 1")
        layout = SlotLayout.from_json(json.loads(payload))
        self.slots = SlotBuffers(SharedSegment.attach(fds[0]), layout, writer="worker")
        self.ctl.set_state(WorkerState.READY)
        self.send(pack(Msg.BUFFERS_OK))

    def run(self, seq: int, slot: int) -> None:
        assert self.runner is not None
        self.ctl.run_started(seq)
        t0 = time.perf_counter_ns()
        exec_ns = 0
        try:
            if self.slots is None or not 0 <= slot < self.slots.layout.slots:
                raise WorkerError("protocol", f"RUN {seq} names slot {slot}, but the slots are not mapped or fewer")
            if self.slots.in_seq(slot) != seq:
                raise WorkerError("protocol", f"RUN {seq}: slot {slot} is tagged {self.slots.in_seq(slot)}")
            outputs = self.runner.run(self.slots.inputs[slot])
            exec_ns = time.perf_counter_ns() - t0
            self.store_outputs(slot, outputs)
            self.slots.set_out_seq(slot, seq)
        except BaseException as e:  # noqa: BLE001 - reported to the node, typed; the worker keeps serving
            exec_ns = exec_ns or time.perf_counter_ns() - t0
            self.ctl.run_finished(ok=False)
            self.send(pack(Msg.RESULT, seq, slot=slot, status=STATUS_ERROR, value=exec_ns,
                           payload=json.dumps(error_to_json(e)).encode()))
            return
        self.ctl.run_finished(ok=True)
        self.send(pack(Msg.RESULT, seq, slot=slot, value=exec_ns, payload=result_payload(self.stage_times())))

    def stage_times(self) -> StageTimes | None:
        """The runner's stage times for the run that just returned: ``runner.stages.last`` when the runner
        keeps a :class:`~chestnut.backend.stages.StageClock` (the twin and real runners), else None."""
        last = getattr(getattr(self.runner, "stages", None), "last", None)
        return last if isinstance(last, StageTimes) else None

    def store_outputs(self, slot: int, outputs: Mapping[str, np.ndarray]) -> None:
        assert self.slots is not None
        want = self.slots.outputs[slot]
        if set(outputs) != set(want):
            raise OutputLayerError("bad_output", f"runner outputs {sorted(outputs)} != declared {sorted(want)}")
        for name, dst in want.items():
            a = np.asarray(outputs[name])
            if a.shape != dst.shape or a.dtype != dst.dtype:
                raise OutputLayerError("bad_output", f"output {name!r}: got {a.dtype}{list(a.shape)}, "
                                                     f"declared {dst.dtype}{list(dst.shape)}")
        for name, dst in want.items():
            np.copyto(dst, outputs[name], casting="no")

    def probe(self) -> None:
        assert self.runner is not None
        self.ctl.set_state(WorkerState.PROBING)
        try:
            obs = dataclasses.asdict(self.runner.probe())
            payload: dict[str, Any] = {"observation": obs}
        except BaseException as e:  # noqa: BLE001
            payload = {"error": error_to_json(e)}
        self.ctl.set_state(WorkerState.READY)
        self.send(pack(Msg.PROBE_RESULT, payload=json.dumps(payload, default=str).encode()))

    def close_runner(self) -> None:
        if self.runner is None:
            return
        try:
            self.runner.close()
        except BaseException as e:  # noqa: BLE001 - closing a broken dock may fail; the process exits anyway
            log.warning("runner.close() failed: %s: %s", type(e).__name__, e)
        self.runner = None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the worker process (``python -m chestnut.node.worker --sock-fd N --ctl-fd M ...``)."""
    p = argparse.ArgumentParser(prog="chestnut.node.worker", description="the node's primary worker process")
    p.add_argument("--sock-fd", type=int, required=True, help="the SEQPACKET command socket")
    p.add_argument("--ctl-fd", type=int, required=True, help="the control block's shared-memory descriptor")
    p.add_argument("--parent-pid", type=int, required=True, help="the node's pid (the worker dies with it)")
    p.add_argument("--heartbeat-period-s", type=float, default=HEARTBEAT_PERIOD_S)
    p.add_argument("--rt-policy", choices=tuple(POLICIES), help="scheduling policy to ask for (node/realtime.py)")
    p.add_argument("--rt-priority", type=int, default=0)
    p.add_argument("--rt-cpus", default="", help="CPUs to pin to, e.g. 0,1 (empty: any)")
    args = p.parse_args(argv)
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    release_on_sigterm()
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s %(levelname)s chestnut-worker[{os.getpid()}] %(name)s: %(message)s")
    normal_policy()  # a realtime parent's policy is not the worker's until it serves (_WorkerLoop.serve_realtime)
    ctl = ControlBlock.attach(args.ctl_fd)
    ctl.set_pid(os.getpid())
    progress.set_sink(ctl)  # the runner's progress (bytes moved, steps, engine ticks) where the node watches it
    heartbeat = _Heartbeat(ctl, args.heartbeat_period_s, args.parent_pid)
    heartbeat.start()
    sock = socket.socket(fileno=args.sock_fd)
    sock.setblocking(True)
    try:
        loop = _WorkerLoop(sock, ctl, heartbeat)
        if args.rt_policy is not None:
            loop.realtime = (args.rt_policy, args.rt_priority, tuple(int(c) for c in args.rt_cpus.split(",") if c))
        return loop.serve()
    except (BrokenPipeError, ConnectionResetError):
        return EXIT_PARENT_GONE


if __name__ == "__main__":
    # run the package module's main (not this __main__ copy), so runners importing
    # chestnut.node.worker see the same classes as the loop that drives them
    from chestnut.node.worker import main as _main

    sys.exit(_main())
