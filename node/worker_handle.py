"""The node's side of the primary worker: :class:`WorkerHandle` spawns, feeds, watches and stops one worker.

The node never touches the GPU: it drives a :class:`WorkerHandle`, whose child process
(``python -m chestnut.node.worker``, :mod:`chestnut.node.worker`) builds the runner and answers
requests. Recovery from anything sticky in tinygrad (a stored device error, a latched async USB
error, the cached device list, a leaked lock: tinygrad 0.14 ``runtime/ops_amd.py`` and
``runtime/support/usb.py`` keep them per process) is to kill the worker and start a fresh one.

Why a plain ``subprocess`` and not ``multiprocessing``: the child gets exactly the descriptors and
environment chosen here (tinygrad's ``getenv`` is cached at import, ``helpers.py``, so the
environment must be right before the child's first import), it does not re-import the node's
``__main__``, and no ``multiprocessing`` resource tracker or pickling is involved.

Channels (openpilot modeld's big-model worker, with a typed protocol instead of one byte):

- **commands and responses**: the socket pair of :mod:`chestnut.node.wire`;
- **tensors**: shared memory (:mod:`chestnut.node.shm`) sized from the model's input and output
  specs once the model is loaded, with ``slots`` (default 2) tagged slots: a late result of frame
  n can never be read as frame n+1;
- **heartbeat**: the worker writes ``CLOCK_MONOTONIC`` ns into the shared control block every
  ``heartbeat_period_s``, with its state and progress counters; the node reads them without a
  system call, also while the worker is inside a long inference.

Stopping follows openpilot's manager for modeld: ask and wait 2 s, SIGTERM and 0.5 s, SIGKILL and
0.5 s, inside the process manager's 5 s stop budget.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from chestnut.backend.errors import ChestnutError, ConfigError, ModelError
from chestnut.backend.interface import DockObservation, LadderReport, ModelSpec
from chestnut.backend.model import TensorSpec
from chestnut.backend.stages import StageTimes
from chestnut.node.runner_loader import RUNNER_KINDS, RunnerSpec, unknown_kind
from chestnut.node.shm import (
    IO_GAP_NS,
    ControlBlock,
    ControlSnapshot,
    SharedSegment,
    SlotBuffers,
    SlotLayout,
    WorkerState,
)
from chestnut.node.wire import (
    HEADER_BYTES,
    HEARTBEAT_PERIOD_S,
    PACKET_MAX_BYTES,
    STATUS_ERROR,
    Msg,
    WorkerError,
    error_from_json,
    ladder_from_json,
    model_spec_to_json,
    observation_from_json,
    pack,
    stages_from_payload,
    unpack,
)

if TYPE_CHECKING:
    from chestnut.backend.ladder import LadderConfig

log = logging.getLogger("chestnut.node.worker")

STOP_ASK_S = 2.0        # openpilot's manager stops modeld: join 2 s after asking ...
STOP_TERMINATE_S = 0.5  # ... then SIGTERM and 0.5 s ...
STOP_KILL_S = 0.5       # ... then SIGKILL and 0.5 s, inside the 5 s stop budget
STOP_TICK_S = 0.05      # a stop that waits calls its ``while_waiting`` this often (the node's 20 Hz loop period)
STOP_BUDGET_S = 5.0     # the process manager's stop budget (openpilot's manager gives modeld 5 s)
DEFAULT_SLOTS = 2
_SEQ_TYPES = (int, np.integer)  # a request's seq: any integer but a bool (a tuple: isinstance's fast form)
_WAKE = pack(Msg.WAKE)  # packed once


@dataclass
class WorkerResult:
    """The answer to one :meth:`WorkerHandle.submit`.

    ``outputs``: name -> array of the output spec's shape and dtype (empty when ``error`` is set);
    fresh copies, or with ``poll_result(copy=False)`` read-only views into shared memory that stay
    valid until the next :meth:`WorkerHandle.submit`. ``exec_time_s``: time inside
    ``runner.run`` measured by the worker; ``roundtrip_s``: submit to receipt, measured by the node;
    ``stages``: the run's copy-in / compute / copy-out (s) when the runner times them, else None.
    """

    seq: int
    outputs: dict[str, np.ndarray]
    exec_time_s: float
    roundtrip_s: float
    error: ChestnutError | None = None
    stages: StageTimes | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class ProbeResult:
    """The answer to :meth:`WorkerHandle.request_probe`; ``at_s`` is ``time.monotonic()`` at receipt."""

    at_s: float
    observation: DockObservation | None
    error: ChestnutError | None


@dataclass(frozen=True)
class WorkerProgress:
    """What the node sees of the worker without asking it: heartbeat age, state, the run in progress."""

    heartbeat_age_s: float
    state: WorkerState
    busy_seq: int | None      # the request inside runner.run, or None
    busy_for_s: float | None  # how long it has been inside
    runs_started: int
    runs_done: int
    runs_failed: int
    beats: int = 0            # heartbeats since the worker started (the watchdog's alive supervision counts these)
    late_peak_ns: int = 0     # the worker's heartbeat timer: its worst lateness of the last second (ns)
    transfer_errors: int = 0  # the runner's failed transfer attempts so far (0 for a runner that does not count)
    progress: int = 0         # the worker's progress reports (backend/progress.py: bytes moved, steps, engine ticks)
    stalled_s: float = 0.0    # how long the worker has waited on the dock without progress (0: not waiting)


@dataclass(frozen=True)
class StopReport:
    """How :meth:`WorkerHandle.stop` ended.

    ``how``: ``"asked"`` (exited after the STOP command), ``"terminated"`` (SIGTERM),
    ``"killed"`` (SIGKILL), ``"already_exited"``, ``"not_started"``, or ``"not_reaped"`` (still
    not gone after SIGKILL: stuck in the kernel, e.g. uninterruptible USB I/O).
    """

    how: str
    returncode: int | None
    duration_s: float

    HOW_WORDS = {"asked": "exited when asked", "terminated": "ended by SIGTERM", "killed": "ended by SIGKILL",
                 "already_exited": "had exited on its own", "not_started": "was never started",
                 "not_reaped": "not reaped after SIGKILL (stuck in the kernel, e.g. in uninterruptible USB I/O)"}

    def describe(self) -> str:
        """One line for a person: how it stopped, its exit status (:func:`describe_returncode`) and how long the
        stop took, e.g. ``"exited when asked (exit code 0) in 120 ms"``."""
        how = self.HOW_WORDS.get(self.how, self.how)
        if self.how == "not_started":
            return how
        took = f"{self.duration_s * 1e3:.0f} ms" if self.duration_s < 1.0 else f"{self.duration_s:.1f} s"
        return f"{how} ({describe_returncode(self.returncode)}) in {took}"


IDENTITY_MAX_ITEMS = 32       # identity fields kept from a worker (backend/probe.py IDENTITY_KEYS has 8)
IDENTITY_MAX_CHARS = 1024     # per key or value


def _identity(raw: object) -> dict[str, str]:
    """A worker's identity map, bounded (:data:`IDENTITY_MAX_ITEMS`, :data:`IDENTITY_MAX_CHARS`); anything
    that is not a JSON object is no identity."""
    if not isinstance(raw, dict):
        return {}
    return {str(k)[:IDENTITY_MAX_CHARS]: str(v)[:IDENTITY_MAX_CHARS] for k, v in list(raw.items())[:IDENTITY_MAX_ITEMS]}


def stalled_ns(now_ns: int, progress_ns: int, io_ns: int, io_depth: int, io_gap_ns: int = IO_GAP_NS) -> int:
    """How long (ns) a worker has been waiting on the dock without progress at ``now_ns``: since its last
    progress (or the start of its current stretch of dock I/O, ``node/shm.py`` ``ControlBlock.dock_io``) while
    it is inside a transfer (``io_depth`` > 0) or did one within ``io_gap_ns``; 0 when it is not talking to the
    dock (host work, idle) or has reported nothing yet. All times CLOCK_MONOTONIC ns."""
    waiting = io_depth > 0 or (io_ns > 0 and now_ns - io_ns <= io_gap_ns)
    if not waiting or progress_ns <= 0:
        return 0
    return max(0, now_ns - progress_ns)


def describe_returncode(rc: int | None) -> str:
    if rc is None:
        return "exit status not yet known"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _emergency_kill(proc: subprocess.Popen[bytes]) -> None:
    """Finaliser: a handle dropped (or the interpreter exiting) without stop() never leaves a worker behind."""
    if proc.poll() is None:
        proc.kill()
        try:
            proc.wait(STOP_KILL_S)
        except subprocess.TimeoutExpired:
            pass


class WorkerHandle:
    """The node's side of one primary worker process. Every method returns within the time it is given.

    Life: ``start()`` -> ``poll_ready()`` until True -> ``submit()`` / ``poll_result()`` ... ->
    ``stop()``. One handle drives one process; after it exits, stop() it (releases descriptors and
    shared memory) and start a new handle. Use it from one thread, the one that should outlive the
    worker: Linux delivers ``PR_SET_PDEATHSIG`` when the *thread* that spawned the child exits.

    Integration with a ``poll``/``select`` loop: :meth:`fileno` becomes readable when a message
    (ready, result, probe) or EOF arrives. After the worker exits it stays readable (EOF) until
    :meth:`stop`: watch :attr:`alive` and stop/replace the handle when it turns False.
    """

    def __init__(self, *, slots: int = DEFAULT_SLOTS, heartbeat_period_s: float = HEARTBEAT_PERIOD_S,
                 realtime: tuple[str, int, tuple[int, ...]] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.heartbeat_period_s = heartbeat_period_s
        self.realtime = realtime  # (policy, priority, cpus) the worker asks for at start (node/realtime.py)
        self.inputs: tuple[TensorSpec, ...] = ()
        self._inputs_memo: tuple[tuple[TensorSpec, ...], frozenset[str],
                                 tuple[tuple[TensorSpec, np.dtype], ...]] | None = None  # _input_checks
        self.outputs: tuple[TensorSpec, ...] = ()
        self.ladder: LadderReport | None = None
        self.identity: dict[str, str] = {}  # the worker's dock identity (backend/probe.py IDENTITY_KEYS)
        self.runner_kind: str | None = None
        self.start_error: ChestnutError | None = None
        self.latest_probe: ProbeResult | None = None
        self.spawned_at_s: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ctl: ControlBlock | None = None
        self._slots: SlotBuffers | None = None
        self._poller = select.poll()
        self._ready = False
        self._ever_ready = False
        self._eof = False
        self._exit_noted = False
        self._exit_unsaid: int | None = None  # the level of an exit seen before it was reaped, said once it is
        self._last_seq: int | None = None
        self._probe_pending = False
        self._free_slots: deque[int] = deque()
        self._in_flight: OrderedDict[int, tuple[int, float]] = OrderedDict()  # seq -> (slot, submitted_at_s)
        self._awaiting: deque[int] = deque()  # seqs sent whose RESULT has not arrived, oldest first
        self._done: deque[tuple[int, int, int, ChestnutError | None, float, float, StageTimes | None]] = deque()
        self._finalizer: weakref.finalize | None = None

    # ---------------------------------------------------------------- life
    def start(self, spec: RunnerSpec, model: ModelSpec, ladder: LadderConfig | None = None) -> None:
        """Spawn the worker and send it ``spec``, ``model`` and the ladder's settings; returns at once.

        The worker then runs the qualification ladder (:mod:`chestnut.backend.ladder`: the
        runner's dock steps, ``model_loaded``, ``warmup`` against ``model.fingerprint``; ``ladder``
        defaults to ``LadderConfig()``, which requires a fingerprint) and reports; poll
        :meth:`poll_ready`.

        Raises :class:`ConfigError` for an unknown runner kind or settings that are not JSON,
        :class:`WorkerError` ``"spawn_failed"`` if the process cannot be started, ``RuntimeError``
        if this handle already started a worker.
        """
        if self._proc is not None:
            raise RuntimeError("this handle already started a worker; use a new WorkerHandle")
        if spec.kind not in RUNNER_KINDS and ":" not in spec.kind:
            raise ConfigError("unknown_runner", unknown_kind(spec.kind))
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in spec.env.items()):
            raise ConfigError("bad_setting", f"runner env must map str to str, got {spec.env!r}")
        try:
            ladder_json = dataclasses.asdict(ladder) if ladder is not None else {}
            start_msg = json.dumps({"runner": spec.to_json(), "model": model_spec_to_json(model),
                                    "ladder": ladder_json}).encode()
        except (TypeError, ValueError) as e:
            raise ConfigError("bad_setting", f"runner options and model spec must be JSON: {e}") from e
        if len(start_msg) + HEADER_BYTES > PACKET_MAX_BYTES:
            raise ConfigError("bad_setting", f"runner and model spec take {len(start_msg)} bytes of JSON, "
                                             f"the limit is {PACKET_MAX_BYTES - HEADER_BYTES}")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ctl = ControlBlock.create()
        env = {k: v for k, v in os.environ.items() if k != "DEV"}
        env.update(spec.env)
        cmd = [sys.executable, "-m", "chestnut.node.worker", "--sock-fd", str(theirs.fileno()),
               "--ctl-fd", str(ctl.segment.fd), "--parent-pid", str(os.getpid()),
               "--heartbeat-period-s", repr(self.heartbeat_period_s)]
        if self.realtime is not None:
            policy, priority, cpus = self.realtime
            cmd += ["--rt-policy", policy, "--rt-priority", str(priority), "--rt-cpus", ",".join(map(str, cpus))]
        try:
            proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(), ctl.segment.fd), env=env,
                                    stdin=subprocess.DEVNULL)
        except OSError as e:
            ours.close()
            ctl.segment.close()
            raise WorkerError("spawn_failed", f"{cmd[0]}: {e}") from e
        finally:
            theirs.close()
        self.spawned_at_s = time.monotonic()
        self._proc, self._sock, self._ctl = proc, ours, ctl
        self._finalizer = weakref.finalize(self, _emergency_kill, proc)
        ours.setblocking(False)
        self._poller.register(ours.fileno(), select.POLLIN)
        self._send(pack(Msg.START, payload=start_msg))
        log.info("worker pid %d spawned (runner %s, model %s)", proc.pid, spec.kind, model.name)

    def poll_ready(self) -> bool:
        """True once the model is loaded and the slots are mapped (submit() is allowed). Never blocks.

        Raises the typed error of the ladder's first failing step (the whole report is in
        :attr:`ladder`) or :class:`WorkerError` ``"worker_exited"`` if the worker died first.
        """
        self._pump()
        if self.start_error is not None:
            raise self.start_error
        return self._ready

    @property
    def ready(self) -> bool:
        return self._ready and not self._eof

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        """True while the worker process exists and its command socket is open (a stopped process is alive)."""
        return self._proc is not None and not self._eof and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The worker's exit status once reaped (negative: the signal that killed it), else None."""
        return self._proc.poll() if self._proc is not None else None

    def fileno(self) -> int:
        """The command socket's descriptor, for ``select``/``poll``; -1 before start and after stop."""
        return self._sock.fileno() if self._sock is not None else -1

    # ---------------------------------------------------------------- supervision
    def heartbeat_age_s(self) -> float:
        """Seconds since the worker's last heartbeat (since spawn if it has not beaten yet); inf before start."""
        if self._ctl is None or self.spawned_at_s is None:
            return float("inf")
        hb_ns = self._ctl.heartbeat_ns()
        if hb_ns == 0:
            return time.monotonic() - self.spawned_at_s
        return max(0.0, (time.monotonic_ns() - hb_ns) / 1e9)

    def late_peak_ns(self) -> int:
        """:attr:`WorkerProgress.late_peak_ns` alone, without a whole snapshot (read with every result); 0 before
        start."""
        return self._ctl.late_peak_ns() if self._ctl is not None else 0

    def transfer_errors(self) -> int:
        """:attr:`WorkerProgress.transfer_errors` alone, without a whole snapshot (read with every result); 0
        before start."""
        return self._ctl.transfer_errors() if self._ctl is not None else 0

    def progress(self) -> WorkerProgress:
        """The control block: heartbeat age, state, the run in progress and the run counters."""
        if self._ctl is None:
            return WorkerProgress(float("inf"), WorkerState.SPAWNED, None, None, 0, 0, 0, 0)
        s: ControlSnapshot = self._ctl.snapshot()
        busy = s.busy_seq >= 0
        now = time.monotonic_ns()
        return WorkerProgress(self.heartbeat_age_s(), s.state, s.busy_seq if busy else None,
                              (now - s.busy_since_ns) / 1e9 if busy else None,
                              s.runs_started, s.runs_done, s.runs_failed, s.beats, s.late_peak_ns,
                              s.transfer_errors, s.progress,
                              stalled_ns(now, s.progress_ns, s.io_ns, s.io_depth) / 1e9)

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Sequence numbers submitted whose result has not been returned by poll_result yet, oldest first."""
        return tuple(self._in_flight)

    @property
    def oldest_in_flight(self) -> int | None:
        """The first of :attr:`in_flight` (the oldest unanswered request), or None (without building the tuple)."""
        return next(iter(self._in_flight), None)

    @property
    def slot_free(self) -> bool:
        """A slot is free for the next :meth:`submit` (:attr:`can_submit` without the looks at readiness and the
        process, for a caller that has just made them)."""
        return bool(self._free_slots)

    @property
    def can_submit(self) -> bool:
        return self.ready and self.slot_free and self.alive

    # ---------------------------------------------------------------- requests
    def submit(self, seq: int, inputs: Mapping[str, np.ndarray]) -> None:
        """Copy ``inputs`` into a free slot and send RUN ``seq``; returns at once (answer via poll_result).

        ``inputs``: exactly the model's input names, each a numpy array of the declared shape and
        dtype (any strides). ``seq`` must be larger than every earlier one. Raises
        :class:`ModelError` ``"bad_input"`` (names, type, shape or dtype; nothing is sent),
        :class:`WorkerError` ``"not_ready"``, ``"busy"`` (all ``slots`` requests in flight),
        ``"bad_seq"`` or ``"worker_exited"``.
        """
        if self.start_error is not None:
            raise WorkerError("not_ready", f"the worker failed to start: {self.start_error}")
        if self._proc is not None and not self.alive:
            raise WorkerError("worker_exited", f"worker pid {self.pid} {describe_returncode(self.returncode)}")
        if self._slots is None or not self._ready:
            raise WorkerError("not_ready", "submit() before poll_ready() returned True")
        if isinstance(seq, bool) or not isinstance(seq, _SEQ_TYPES):
            raise WorkerError("bad_seq", f"seq must be an int, got {type(seq).__name__}")
        seq = int(seq)
        if self._last_seq is not None and seq <= self._last_seq:
            raise WorkerError("bad_seq", f"seq {seq} is not larger than the previous {self._last_seq}")
        if not 0 <= seq < 2**63:
            raise WorkerError("bad_seq", f"seq {seq} is outside [0, 2**63)")
        slot = self._free_slots[0] if self._free_slots else -1
        targets = self._slots.inputs[slot] if slot >= 0 else {}
        # filled in place (next_inputs): the slot's own arrays, of the specs by construction, already where the
        # worker reads them: no check and no copy
        in_place = (type(inputs) is dict and len(inputs) == len(targets)
                    and all(inputs.get(name) is dst for name, dst in targets.items()))
        if not in_place:
            self.check_inputs(inputs)
        if slot < 0:
            raise WorkerError("busy", f"all {self.slots} slots are in flight (seqs {list(self._in_flight)})")
        if not in_place:
            for name, dst in targets.items():
                if inputs[name] is not dst:
                    np.copyto(dst, inputs[name], casting="no")
        self._slots.set_in_seq(slot, seq)
        self._slots.set_out_seq(slot, -1)
        submitted_at_s = time.monotonic()  # before sending: the woken worker may preempt this process
        self._send(pack(Msg.RUN, seq, slot=slot))
        os.sched_yield()  # the worker first (docs/architecture.md, "Hand-overs on the per-frame path")
        if self._eof:
            raise WorkerError("worker_exited", f"worker pid {self.pid} {describe_returncode(self.returncode)}")
        self._free_slots.popleft()
        self._in_flight[seq] = (slot, submitted_at_s)
        self._awaiting.append(seq)
        self._last_seq = seq

    def submitted_at(self, seq: int) -> float | None:
        """When request ``seq`` was sent (``time.monotonic()``, s, taken before the send), while it is in flight."""
        held = self._in_flight.get(seq)
        return held[1] if held is not None else None

    def wake(self) -> bool:
        """Tell the worker a RUN is likely soon (WAKE, ``node/wire.py``): woken by it, the worker takes it and
        waits again, so its wake-up from an idle CPU is done before the :meth:`submit` (``node/policy.py``
        ``prewake_at``). Nothing is sent while the worker is not ready or has no free slot; returns whether it
        was sent. Never raises (a worker gone is noted as by any send, and the submit says it)."""
        if self._ready and not self._eof and self._free_slots:
            try:
                self._send(_WAKE)
            except WorkerError:  # its socket's buffer is full: the worker is not reading; the submit says it
                return False
            return not self._eof
        return False

    def next_inputs(self) -> Mapping[str, np.ndarray] | None:
        """The input arrays of the slot the next :meth:`submit` fills (writable views of the shared segment the
        worker reads, name -> array of the input spec's shape and dtype), or None while none is free or the worker
        is not ready. A caller that writes an input into its array here and passes that very array to
        :meth:`submit` saves submit's copy of it (a full camera frame: megabytes). Valid until that submit."""
        if self._slots is None or not self.ready or not self._free_slots:
            return None
        return self._slots.inputs[self._free_slots[0]]

    def _input_checks(self) -> tuple[frozenset[str], tuple[tuple[TensorSpec, np.dtype], ...]]:
        """:attr:`inputs`' names and (spec, numpy dtype) pairs, made once per :attr:`inputs` (every submit reads
        them)."""
        memo = self._inputs_memo
        if memo is None or memo[0] is not self.inputs:
            memo = self._inputs_memo = (self.inputs, frozenset(s.name for s in self.inputs),
                                        tuple((s, np.dtype(s.dtype)) for s in self.inputs))
        return memo[1], memo[2]

    def check_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        """Raise :class:`ModelError` ``"bad_input"`` unless ``inputs`` matches :attr:`inputs` exactly."""
        names, specs = self._input_checks()
        if not isinstance(inputs, Mapping) or inputs.keys() != names:
            got = sorted(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
            raise ModelError("bad_input", f"inputs {got} != model inputs {[s.name for s in self.inputs]}")
        for s, dtype in specs:
            a = inputs[s.name]
            if not isinstance(a, np.ndarray):
                raise ModelError("bad_input", f"input {s.name!r}: got {type(a).__name__}, want a numpy array")
            if a.shape != s.shape or a.dtype != dtype:
                raise ModelError("bad_input", f"input {s.name!r}: got {a.dtype}{list(a.shape)}, "
                                              f"want {s.dtype}{list(s.shape)}")

    def poll_result(self, timeout_s: float = 0.0, *, copy: bool = True, spin_s: float = 0.0) -> WorkerResult | None:
        """The next result, oldest request first, waiting at most ``timeout_s``; None if none came.

        A failed run comes back as a result with ``error`` set (the runner's typed error, or
        :class:`WorkerError`). When the worker dies or is killed, every request in flight comes
        back with :class:`WorkerError` ``"worker_exited"``. ``copy=False`` returns read-only views
        of shared memory, valid until the next :meth:`submit`. ``spin_s``: the first part of the wait (s, at
        most ``timeout_s``) looks for the result without sleeping (a busy wait: a result that comes then wakes
        no process, ``node/policy.py`` ``busy_wait_window``); the rest sleeps in ``poll``.
        """
        now = time.monotonic()
        deadline = now + max(0.0, timeout_s)
        spin_end = min(deadline, now + spin_s)
        while True:
            self._pump()
            if self._done:
                return self._deliver(copy)
            if self._eof or self._sock is None:
                return None
            if time.monotonic() < spin_end:  # the busy wait: look again at once
                continue
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                if self._proc is not None and self._proc.poll() is not None:
                    self._note_exit()  # exited, but a descendant still holds the socket open
                    return self._deliver(copy) if self._done else None
                return None
            self._poller.poll(max(1, int(remaining_s * 1000 + 0.999)))

    def request_probe(self) -> bool:
        """Ask the runner for a :class:`DockObservation` between runs; the answer lands in :attr:`latest_probe`.

        Returns False (nothing sent) if a probe is already pending or the worker is not ready.
        The answer is taken in by any later poll_result()/poll_ready().
        """
        if self._probe_pending or not self.ready:
            return False
        self._send(pack(Msg.PROBE))
        self._probe_pending = not self._eof
        return self._probe_pending

    # ---------------------------------------------------------------- ending
    def kill(self, reap_timeout_s: float = STOP_KILL_S) -> bool:
        """SIGKILL the worker now and reap it (waiting at most ``reap_timeout_s``); True if reaped.

        A worker whose command socket has closed is exiting on its own (it reported a failure, its interpreter is
        ending): it gets the first half of ``reap_timeout_s`` to be reaped as it is, with its own exit status,
        before it is killed. For the watchdog. Requests in flight come back from poll_result with
        ``"worker_exited"``. Call :meth:`stop` afterwards to release the descriptors and shared memory.
        """
        if self._proc is None:
            return True
        proc = self._proc
        end = time.monotonic() + max(0.0, reap_timeout_s)
        if self._eof and proc.poll() is None:
            self._wait(reap_timeout_s / 2)
        was_running = proc.poll() is None
        if was_running:
            if self._eof:
                log.warning("killing worker pid %d: its command socket closed, but it had not exited %.0f ms later",
                            proc.pid, reap_timeout_s / 2 * 1e3)
            else:
                log.warning("killing worker pid %d", proc.pid)
            proc.kill()
        reaped = self._wait(max(0.0, end - time.monotonic()))
        self._note_exit(("killed by the node" if reaped else "SIGKILL sent, not yet reaped") if was_running else None)
        self._say_exit()
        return reaped

    def stop(self, budget_s: float = STOP_BUDGET_S, while_waiting: Callable[[], None] | None = None) -> StopReport:
        """Stop the worker and release everything, within ``budget_s``.

        openpilot modeld's sequence (openpilot's manager): send STOP and wait 2 s, SIGTERM and wait 0.5 s,
        SIGKILL and wait 0.5 s (3 s in all). With a smaller budget the wait after STOP shrinks
        first. A worker whose command socket has closed is exiting on its own: no STOP can reach it, and the
        wait after STOP is its time to exit (``"already_exited"`` when it does). The descriptors and shared
        memory are released in every case; unreturned results
        are dropped. ``while_waiting`` is called about every :data:`STOP_TICK_S` while the worker is
        waited for (the node keeps publishing its health and state through a slow stop); what it raises
        propagates, and the worker is then left as it is (``__exit__`` or a later ``stop`` finishes it).
        """
        t0 = time.monotonic()
        if self._proc is None:
            return StopReport("not_started", None, 0.0)
        proc = self._proc
        ask_s = min(STOP_ASK_S, max(0.0, budget_s - STOP_TERMINATE_S - STOP_KILL_S))
        if proc.poll() is not None or (self._eof and self._wait(ask_s, while_waiting)):
            how = "already_exited"
        else:
            term_s = min(STOP_TERMINATE_S, max(0.0, (budget_s - ask_s) / 2))
            kill_s = min(STOP_KILL_S, max(0.0, budget_s - ask_s - term_s))
            how = "not_reaped"
            asked = False
            if not self._eof:
                try:
                    self._send(pack(Msg.STOP))
                except WorkerError:  # its command socket is full: it is not listening, escalate below
                    pass
                asked = self._wait(ask_s, while_waiting)
            if asked:
                how = "asked"
            else:
                log.warning("worker pid %d did not stop within %.1f s; SIGTERM", proc.pid, ask_s)
                proc.terminate()
                if self._wait(term_s, while_waiting):
                    how = "terminated"
                else:
                    log.warning("worker pid %d survived SIGTERM for %.1f s; SIGKILL", proc.pid, term_s)
                    proc.kill()
                    if self._wait(kill_s, while_waiting):
                        how = "killed"
                    else:
                        log.error("worker pid %d not reaped %.1f s after SIGKILL", proc.pid, kill_s)
        self._note_exit(f"stopped by the node ({how})", logging.INFO)
        self._say_exit()
        self._release()
        return StopReport(how, proc.poll(), time.monotonic() - t0)

    def __enter__(self) -> WorkerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- internals
    def _wait(self, timeout_s: float, tick: Callable[[], None] | None = None) -> bool:
        """Whether the worker exited within ``timeout_s`` (s); ``tick`` is called every :data:`STOP_TICK_S`
        meanwhile."""
        assert self._proc is not None
        end = time.monotonic() + max(0.0, timeout_s)
        while True:
            left = max(0.0, end - time.monotonic())
            step = left if tick is None else min(left, STOP_TICK_S)
            try:
                self._proc.wait(timeout=step)
                return True
            except subprocess.TimeoutExpired:
                if tick is None or step >= left:
                    return False
                tick()

    def _send(self, data: bytes) -> None:
        if self._sock is None or self._eof:
            return
        try:
            self._sock.send(data, socket.MSG_NOSIGNAL)
        except BlockingIOError as e:
            raise WorkerError("busy", "the worker is not reading its command socket") from e
        except OSError:  # EPIPE / ECONNRESET: the worker is gone
            self._note_exit()

    def _pump(self) -> None:
        """Take in every message already waiting on the socket (never blocks)."""
        while self._sock is not None and not self._eof:
            try:
                data = self._sock.recv(PACKET_MAX_BYTES)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._note_exit()
                return
            try:
                self._dispatch(*unpack(data))
            except (ValueError, KeyError, TypeError) as e:
                self._protocol_violation(f"{type(e).__name__}: {e}")
                return

    def _dispatch(self, kind: Msg, status: int, slot: int, seq: int, value: int, payload: bytes) -> None:
        if kind is Msg.RESULT:
            if not self._awaiting:
                raise ValueError(f"RESULT {seq} with no request in flight")
            want_seq = self._awaiting[0]
            want_slot, submitted_at_s = self._in_flight[want_seq]
            if seq != want_seq or slot != want_slot:
                raise ValueError(f"RESULT {seq} in slot {slot}, expected {want_seq} in slot {want_slot}")
            self._awaiting.popleft()
            error = error_from_json(json.loads(payload)) if status == STATUS_ERROR else None
            stages = stages_from_payload(payload) if error is None else None
            if error is None and self._slots is not None and self._slots.out_seq(slot) != seq:
                raise ValueError(f"RESULT {seq}: slot {slot} holds the output of {self._slots.out_seq(slot)}")
            self._done.append((seq, slot, value, error, submitted_at_s, time.monotonic(), stages))
        elif kind is Msg.READY:
            ready = json.loads(payload)
            self.inputs = tuple(TensorSpec.from_json(s) for s in ready["inputs"])
            self.outputs = tuple(TensorSpec.from_json(s) for s in ready["outputs"])
            self.ladder = ladder_from_json(ready.get("ladder"))
            self.runner_kind = str(ready.get("kind"))
            self.identity = _identity(ready.get("identity"))
            layout = SlotLayout.build(self.inputs, self.outputs, self.slots)
            segment = SharedSegment.create("chestnut-worker-slots", layout.total_bytes)
            self._slots = SlotBuffers(segment, layout, writer="node")
            assert self._sock is not None
            try:
                socket.send_fds(self._sock, [pack(Msg.BUFFERS, payload=json.dumps(layout.to_json()).encode())],
                                [segment.fd], socket.MSG_NOSIGNAL)
            except OSError:
                self._note_exit()
        elif kind is Msg.BUFFERS_OK:
            self._ready = self._ever_ready = True
            self._free_slots = deque(range(self.slots))
        elif kind is Msg.START_FAILED:
            failed = json.loads(payload)
            self.ladder = ladder_from_json(failed.get("ladder"))
            self.identity = _identity(failed.get("identity"))
            self.start_error = error_from_json(failed["error"])
        elif kind is Msg.PROBE_RESULT:
            self._probe_pending = False
            probe = json.loads(payload)
            if "error" in probe:
                self.latest_probe = ProbeResult(time.monotonic(), None, error_from_json(probe["error"]))
            else:
                self.latest_probe = ProbeResult(time.monotonic(), observation_from_json(probe["observation"]), None)
        else:
            raise ValueError(f"unexpected message {kind.name} from the worker")

    def _deliver(self, copy: bool) -> WorkerResult:
        seq, slot, exec_ns, error, submitted_at_s, received_at_s, stages = self._done.popleft()
        outputs: dict[str, np.ndarray] = {}
        if error is None and self._slots is not None:
            views = self._slots.outputs[slot]
            outputs = {k: v.copy() for k, v in views.items()} if copy else dict(views)
        self._in_flight.pop(seq, None)
        if slot >= 0:
            self._free_slots.append(slot)
        return WorkerResult(seq, outputs, exec_ns / 1e9, received_at_s - submitted_at_s, error, stages)

    def _note_exit(self, how: str | None = None, level: int = logging.WARNING) -> None:
        """The worker is gone (EOF, send failure, reaped, or killed): fail what is in flight, once."""
        self._eof = True
        if self._exit_noted:
            return
        self._exit_noted = True
        self._ready = False
        rc = self._proc.poll() if self._proc is not None else None
        if how is None and rc is None:  # its socket closed before it was reaped: its status is said once it is
            self._exit_unsaid = level
        detail = f"worker pid {self.pid} {how or 'exited' + ('' if rc is None else f' ({describe_returncode(rc)})')}"
        if not self._ever_ready and self.start_error is None:
            self.start_error = WorkerError("worker_exited", f"{detail} before it was ready")
        now_s = time.monotonic()
        while self._awaiting:
            seq = self._awaiting.popleft()
            error = WorkerError("worker_exited", f"{detail} with request {seq} in flight")
            self._done.append((seq, -1, 0, error, self._in_flight[seq][1], now_s, None))
        if self._probe_pending:
            self._probe_pending = False
            self.latest_probe = ProbeResult(now_s, None, WorkerError("worker_exited", detail))
        if self._exit_unsaid is None:
            log.log(level, "%s", detail)

    def _say_exit(self) -> None:
        """The line of an exit seen (its socket closed) before the worker was reaped, with the exit status it
        has now (:meth:`kill` and :meth:`stop` reap it): once."""
        if self._exit_unsaid is None or self._proc is None:
            return
        level, self._exit_unsaid = self._exit_unsaid, None
        log.log(level, "worker pid %d exited (%s)", self._proc.pid, describe_returncode(self._proc.poll()))

    def _protocol_violation(self, detail: str) -> None:
        log.error("worker pid %s broke the protocol: %s; killing it", self.pid, detail)
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._wait(STOP_KILL_S)
        self._note_exit(f"killed after a protocol violation ({detail})")

    def _release(self) -> None:
        if self._sock is not None:
            try:
                self._poller.unregister(self._sock.fileno())
            except KeyError:
                pass
            self._sock.close()
            self._sock = None
        if self._slots is not None:
            segment = self._slots.segment
            self._slots.release()
            self._slots = None
            segment.close()
        if self._ctl is not None:
            self._ctl.segment.close()
            self._ctl = None
        self._free_slots.clear()
        self._done.clear()
        self._in_flight.clear()
        self._awaiting.clear()
        if self._finalizer is not None:
            self._finalizer.detach()
