"""``chestnut run``: the supervised inference node (openpilot modeld's shape).

One process, one single-threaded main loop that reads top to bottom. Per camera frame:

0. a frame read more than ``timing.max_frame_age_ms`` after its ``timestampEof`` (the node or its camera is behind) is
   answered at once without a model: ``valid=False``, source none, "stale frame" (docs/health.md);
1. preprocess the frame (``node.preprocess``); a frame that cannot be used is answered with an
   invalid ``modelOutput`` that says why, so every frame still gets exactly one output;
2. if the primary runs (active, or in shadow during recovery), hand the frame to the primary worker
   (shared memory + a command packet); its deadline counts from the frame's ``timestampEof``, so time
   spent queued behind a slow primary counts. A frame already past its deadline when the node takes it,
   or one the worker cannot take because every slot still holds an unanswered request, is a miss;
3. run the fallback on the host CPU when it must answer, or on every frame in hot standby;
4. wait for the primary's result until its deadline in force (adaptive, ``node/deadline.py``: the primary's
   own recent latency with a margin, 25..150 ms; published as ``modelOutput.deadline``); a late or missing result
   is answered by the fallback at the deadline and the late result is discarded (watchdog);
   ``timing.miss_run`` (3) consecutive misses fail the ``gpu`` layer over;
5. check every source's output (finite, shape/dtype, range, stale; the primary's also for agreement with
   a valid fallback output);
6. publish ``modelOutput`` from the source that serves with a valid output -- or ``valid=False`` with each
   source's reason when none has one, or when the frame's ``timestampEof`` gives no age -- and
   ``chestnutActive``.

Each decision in these steps (which source answers, when the worker is declared failed, what the
output's validity and reason are) is a pure function of :mod:`chestnut.node.policy`; this module does
the I/O around them.

Between frames: the watchdog's periodic check (a worker silent 3000 ms + margin after a request is
killed), heartbeat (alive) supervision, worker start/exit (a worker not qualified and loaded within
``timing.start_timeout_s`` is killed, and so is one whose load waits on the dock without progress for the
wait timeout + 100 ms: docs/health.md "Progress during load"), the supervisor's timers, ``controlState``
(a return to the primary waits for the consumer), health at 5 Hz, ``chestnutActive`` at once on change,
``nodeState`` at 1 Hz and on every transition, a dock probe at 1 Hz, and ``WATCHDOG=1`` to systemd
from this loop only.

Failing over while the worker still has requests in flight (a deadline-miss run: the worker is
stuck in a wait) does not kill it at once: it *drains* -- no new requests, the fallback serves --
until it answers (its typed error names the failing layer, e.g. ``pcie link_down`` after the
3000 ms wait timeout) or the watchdog kills it at the wait timeout + margin. The retry waits for
the drained worker to be gone: a new worker could not take the dock's lock before anyway.

The node never imports tinygrad's dock path: the primary lives in the worker process
(``node.worker``). The fallback (onnxruntime by default) is warm before ``READY=1``; without a usable
fallback the node exits with :data:`EXIT_NO_FALLBACK`, with an unusable configuration with
:data:`EXIT_CONFIG`.
"""

from __future__ import annotations

import _thread
import argparse
import dataclasses
import functools
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import zmq

from chestnut.backend.errors import ChestnutError, ConfigError, Layer, ModelError
from chestnut.backend.interface import ModelSpec, StepResult
from chestnut.backend.jitcache import JitCache
from chestnut.backend.model import TensorSpec
from chestnut.backend.sim.hostwait import FILE_NAME as HOSTWAIT_FILE
from chestnut.backend.stages import StageTimes
from chestnut.fallback.standby import FallbackModel
from chestnut.msgs.frames import CAMERA_RESTART_MIN_STEP
from chestnut.msgs.messaging import START_REFUSALS, PubMaster, SubMaster, iter_events, new_message, sub_sock
from chestnut.msgs.paths import runtime_dir
from chestnut.msgs.template import TemplateError
from chestnut.msgs.visionipc import FrameBufferError, FrameReader
from chestnut.node import config as node_config
from chestnut.node.config import NodeConfig
from chestnut.node.contract import (
    ContractError,
    DeclaredContract,
    check_fallback,
    declare_contract,
    describe_file,
    file_identity,
    read_fingerprint,
)
from chestnut.node.deadline import Deadline, DeadlineRule, adaptive_deadline
from chestnut.node.docklook import DockLooker
from chestnut.node.framedrop import FrameDropFilter
from chestnut.node.health import (
    DEFAULT_DEBOUNCE,
    ActiveFlag,
    Evidence,
    HealthMonitor,
    Level,
    StageBudget,
    chestnut_active,
    evidence_from_error,
    evidence_from_ladder,
    evidence_from_observation,
    evidence_from_run,
    evidence_from_validity,
    evidence_from_watchdog,
    fill_active,
    fill_health,
    layer_usable,
)
from chestnut.node.hostload import HostMeter
from chestnut.node.output_template import STEADY_FRAMES, OutputTemplate
from chestnut.node.policy import (
    BUSY_WAIT_SAMPLES,
    HOST_LATE,
    WARM_MAX_BYTES,
    Answer,
    Candidate,
    FrameClock,
    HostThresholds,
    Pairing,
    PrimaryView,
    StartFailure,
    Submit,
    active_as_published,
    active_for_output,
    agreement_reference,
    busy_wait_window,
    choose_answer,
    count_miss,
    decide_submission,
    drains_on_fail_over,
    fallback_must_run,
    frame_age_s,
    frame_clock,
    host_excuse,
    host_late,
    is_primary_fault,
    late_result_reason,
    mark_deadline_miss,
    miss_run_blame,
    needs_wake,
    no_result_reason,
    pair_response,
    prewake_at,
    primary_serves,
    run_risk_excuse,
    shadow_vote,
    slow_copy_excuse,
    slow_link_while,
    start_failure,
    start_timed_out,
    timed_out_start_failure,
    warm_window,
    with_frame_clock,
    with_input_validity,
)
from chestnut.node.preprocess import preprocess, primary_warp
from chestnut.node.realtime import IdleCollector, cpus_apart, worker_priority
from chestnut.node.runner_loader import dock_runner_spec
from chestnut.node.shm import WorkerState
from chestnut.node.supervisor import (
    Action,
    Event,
    Source,
    State,
    Supervisor,
    SupervisorConfig,
    Transition,
    fill_node_state,
)
from chestnut.node.validity import Check, StaleDetector, ValidityReport, check_outputs
from chestnut.node.watchdog import ActionKind, RequestKind, Verdict, Watchdog, WatchdogAction, WatchdogConfig
from chestnut.node.worker_handle import WorkerHandle, WorkerResult, describe_returncode

log = logging.getLogger("chestnut.node")

EXIT_OK = 0
EXIT_CONFIG = 2               # the configuration is unusable (a bad key or value, an unreadable fingerprint)
EXIT_NO_FALLBACK = 3          # the node cannot serve at all: no usable fallback model
MODEL_FIX = ("prepare it again with `chestnut model prepare` (it checks the file's sha256 and rebuilds a damaged "
             "one), or name another file in the config's [model] / [fallback]")
OWN_MODEL_FIX = ("name another file (--model / --fallback-model, or the config's [model] / [fallback] path), or "
                 "replace this one")
NS = 1_000_000_000
HostJudge = Callable[[], str]  # why the host was late around a result, "" when on time (Node._host_late_result)
LOOK_RETRY, LOOK_ABSENT, LOOK_LINK = "retry", "absent", "link"  # DockLooker purposes: the supervisor's retry,
# the absent dock's ERROR while degraded, the link speed while a worker qualifies
LOOP_PERIOD_MS = 50           # longest the loop sleeps without a frame (20 Hz housekeeping)
STOP_BUDGET_S = 5.0           # the process manager's stop budget
WORKER_STOP_BUDGET_S = STOP_BUDGET_S - 1.0  # the worker's share; the rest is ours (publish, close sockets)
STOP_EVENTS = frozenset({Event.STOP, Event.FALLBACK_FAILED})  # what a stopping node's supervisor still hears
WATCHDOG_DEFAULT_PERIOD_S = 1.0  # WATCHDOG=1 period when systemd gives no WATCHDOG_USEC
INIT_DATA_PERIOD_S = 10.0     # initData is re-sent this often (on-demand service; it is the log's header)
DISAGREE_RUN = DEFAULT_DEBOUNCE[Layer.OUTPUT].fail_after  # disagreeing frames in a row the node logs (3)
BAD_FRAME_LOG_PERIOD_S = 1.0  # a repeated per-frame error is logged at most this often (then counted)
DEADLINE_LOG_PERIOD_S = 10.0  # the adaptive deadline is logged when its basis changes, else at most this often
MISS_STAGES_KEPT = 20          # stage times of late results kept for a miss run's blame: 1 s at 20 Hz
LINK_READINGS_KEPT = 300      # the link's speed readings kept for a start's blame: 5 min at the 1 Hz probe
MISS_WARNS_KEPT = 8           # deadline-miss WARN reasons kept (mark_deadline_miss): more than a run before a failover


@functools.cache
def _dtype_name(dtype: np.dtype) -> str:
    """``dtype.name`` (numpy computes it in Python on every read; an output's dtype is one of a few)."""
    return dtype.name


class LogEvery:
    """For a per-frame error logged at most once per ``period_s`` (CLOCK_MONOTONIC) and counted otherwise:
    :meth:`due` is True at most once a period, and at once for a ``reason`` other than the last one."""

    def __init__(self, period_s: float = BAD_FRAME_LOG_PERIOD_S) -> None:
        self.period_s, self.next_s, self.reason = period_s, 0.0, ""

    def due(self, reason: str = "") -> bool:
        now = time.monotonic()
        if now < self.next_s and reason == self.reason:
            return False
        self.next_s, self.reason = now + self.period_s, reason
        return True


def model_fix(path: Path) -> str:
    """The advice after the node refuses the model file ``path``: :data:`MODEL_FIX` for the prepared default model
    (``chestnut model prepare`` checks its sha256 and rebuilds it), :data:`OWN_MODEL_FIX` for a file the user gave
    (``--model``, a configuration's path), which that command does not rebuild (``launch/stack.py`` ``prepare``
    advises the same)."""
    try:
        prepared = path.expanduser().resolve() == node_config.default_model_path().resolve()
    except (OSError, RuntimeError):  # a symlink loop, an unreadable folder: not the prepared file
        prepared = False
    return MODEL_FIX if prepared else OWN_MODEL_FIX


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("chestnut", "tinygrad", "pycapnp", "pyzmq", "onnxruntime", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


class SdNotify:
    """systemd's notify protocol (``sd_notify``) over ``$NOTIFY_SOCKET``; a no-op when it is unset.

    ``watchdog_period_s``: half of ``$WATCHDOG_USEC`` (systemd's advice for ``WatchdogSec``) when it is
    set for this process (``$WATCHDOG_PID`` unset or ours), else :data:`WATCHDOG_DEFAULT_PERIOD_S`.
    """

    def __init__(self) -> None:
        addr = os.environ.get("NOTIFY_SOCKET", "")
        self.sock: socket.socket | None = None
        if addr:
            self.addr = "\0" + addr[1:] if addr.startswith("@") else addr
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.watchdog_period_s = WATCHDOG_DEFAULT_PERIOD_S
        usec, pid = os.environ.get("WATCHDOG_USEC", ""), os.environ.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_period_s = int(usec) / 2e6
        self._next_watchdog_s = 0.0

    def notify(self, state: str) -> None:
        if self.sock is not None:
            try:
                self.sock.sendto(state.encode(), self.addr)
            except OSError as e:
                log.warning("sd_notify %s failed: %s", state, e)

    def watchdog(self) -> None:
        """``WATCHDOG=1``, at most once per :attr:`watchdog_period_s`."""
        now = time.monotonic()
        if self.sock is not None and now >= self._next_watchdog_s:
            self._next_watchdog_s = now + self.watchdog_period_s
            self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def evidence_from_worker_error(err: ChestnutError) -> Evidence:
    """A failed primary request as hard evidence: a typed dock error against its own layer; an error
    without a layer (the worker died, the runner raised something untyped, the model refused the
    input) against ``gpu``, the layer of the primary's compute, so that the failure is named in health."""
    ev = evidence_from_error(err)
    if ev is not None:
        return ev
    reason = f"primary worker: {err.reason}: {err.detail}" if err.detail else f"primary worker: {err.reason}"
    return Evidence(Layer.GPU, Level.ERROR, reason, hard=True, tag=err.reason)


class _StopDuringStart(BaseException):
    """SIGINT/SIGTERM during start-up (reading the configuration, declaring the contract, warming the fallback,
    which may compile for many seconds): a stop, not an error, so a :class:`BaseException` as Python's own
    ``KeyboardInterrupt`` is (https://docs.python.org/3/library/exceptions.html#exception-hierarchy), which no
    ``except Exception`` around a model load or run takes for that model's failure. Never raised inside an
    import (:func:`_stop_deferred`)."""


STOP_RETRY_S = 0.02  # a stop deferred out of an import is tried again this often (:func:`_stop_deferred`)


def _stop_deferred(signum: int, frame: FrameType | None, pending: Callable[[], bool]) -> bool:
    """True when the signal handler's ``frame`` (the one the signal interrupted) runs inside an import: the stop is
    then not raised there; the signal is delivered again in :data:`STOP_RETRY_S` while ``pending()``
    (``_thread.interrupt_main``: the handler runs again in the main thread, https://docs.python.org/3/library/
    _thread.html#thread.interrupt_main), until no import runs. An import may run Python under native code that
    cannot take an exception raised there: an extension module's init (onnxruntime's pybind11 module imports
    numpy and Python modules of its own from C++) turns it into "ImportError: initialization failed", which the
    contract's load took for a model that cannot be run (exit 3), or C++ ends the process (SIGABRT)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib."):

            def again() -> None:
                if pending():
                    _thread.interrupt_main(signal.Signals(signum))

            retry = threading.Timer(STOP_RETRY_S, again)
            retry.daemon = True
            retry.start()
            return True
        frame = frame.f_back
    return False


@dataclass
class FrameResult:
    """One frame's published answer (:class:`~chestnut.node.policy.Answer`), whether the primary missed the
    frame's deadline, the primary's output checks (None when it gave no output) and the primary's stage
    times (s, None unless it gave an output and its runner times its stages)."""

    answer: Answer
    deadline_missed: bool = False
    report: ValidityReport | None = None
    stages: StageTimes | None = None
    deadline_ms: float = 0.0  # the primary's deadline in force for this frame (node/deadline.py); 0: not judged


def stale_frame_reason(eof_ns: int, now_ns: int, max_age_ms: float, sent_ns: int = 0) -> str:
    """Why a frame read at ``now_ns`` with ``timestampEof`` = ``eof_ns`` (both CLOCK_MONOTONIC ns) is too old
    to run a model on: read more than ``max_age_ms`` (``timing.max_frame_age_ms``) after its EOF. "" when it
    is not, and when its age is unknown (``eof_ns`` 0 or in the future: :func:`frame_clock` says so).
    ``sent_ns``: its message's ``logMonoTime`` (0: unknown, a ring notice). A frame its camera published over
    the bound after its EOF is named the camera's (its stamp is old when it is sent: a late camera, or a wrong
    stamp); one published in time and read late, or of unknown publish time, the node's (it is behind)."""
    if eof_ns <= 0 or eof_ns > now_ns or now_ns - eof_ns <= max_age_ms * 1e6:
        return ""
    read = f"stale frame: read {(now_ns - eof_ns) / 1e6:.0f} ms after its EOF (bound {max_age_ms:.0f} ms); "
    if eof_ns < sent_ns <= now_ns and sent_ns - eof_ns > max_age_ms * 1e6:
        return read + (f"its camera published it {(sent_ns - eof_ns) / 1e6:.0f} ms after that EOF: the camera is "
                       "late or its stamp wrong, not the node")
    return read + "the node is behind"


STALE_FRAME_SOURCE = "intake"  # the output layer's condition for stale frames (node/health.py Evidence.source)


def published_stages(r: FrameResult) -> StageTimes:
    """The stage times ``modelOutput`` carries for ``r``: the primary's own when it served and timed them;
    else the serving model's run time as compute with no copies (the fallback runs in the node's memory;
    a runner that does not time its stages counts all of its time as compute); zeros when none served."""
    a = r.answer
    if a.source is Source.PRIMARY and r.stages is not None:
        return r.stages
    return StageTimes(compute=max(0.0, float(a.exec_s)))


def primary_inputs(specs: tuple[TensorSpec, ...], inputs: dict[str, np.ndarray],
                   full: np.ndarray | None) -> dict[str, np.ndarray]:
    """What the primary is sent: the full frame when its one input is that frame (its program warps it),
    else the same warped ``inputs`` as the fallback (a runner that does not warp, or no ``model.frame``)."""
    if full is not None and len(specs) == 1 and specs[0].dtype == "uint8" and specs[0].shape == full.shape:
        return {specs[0].name: full}
    return inputs


@dataclass
class PrimaryOutcome:
    """What became of one frame's primary request: the result (None if none is usable), whether the
    frame missed its deadline, and why the primary does not answer it (empty when it does)."""

    result: WorkerResult | None
    missed: bool
    why: str


class Node:
    """The node's state and its main loop (:meth:`run`). ``prefix`` picks the runtime directory
    (default ``$CHESTNUT_PREFIX``). Raises :class:`ConfigError` for an unreadable fingerprint file."""

    def __init__(self, cfg: NodeConfig, prefix: str | None = None) -> None:
        self.cfg = cfg
        self.prefix = prefix
        self.stop_requested = False
        self.stop_reason = "stop requested"  # the stop's reason in nodeState: a signal's, or why start-up failed
        self.stop_said = False  # the stop's reason is a refusal the caller prints (run, main): not logged again
        self.starting = True
        self.stop_pending = False  # a stop during start-up deferred out of an import (:func:`_stop_deferred`)
        self.exit_code = EXIT_OK
        now = time.monotonic_ns()
        # model.frame with a warp:<name> preprocess: the primary's program warps the full frame (docs/warp.md)
        self.warp = primary_warp(cfg.model.frame, cfg.model.preprocess, tuple(cfg.model.shape))
        self.format_refused, self.format_log = 0, LogEvery()  # _frame_format_refused
        self.spec_in = ModelSpec(cfg.model.path, cfg.model.name, {cfg.model.input: tuple(cfg.model.shape)},
                                 self._read_fingerprint(), self.warp)
        self.primary_model_id = self._read_primary_model_id()
        self.fallback: FallbackModel | None = None
        self.health = HealthMonitor(hold_until_reported=True)  # every ERROR reaches a chestnutHealth
        # the primary's copy-in / compute / copy-out against the frame, its run times against the deadline
        # the stages share the camera's frame period (timing.frame_period_ms: chestnut launch sets its --rate's)
        self.stage_budget = StageBudget(cfg.timing.frame_period_ms / 1e3, deadline_s=cfg.timing.deadline_ms / 1e3)
        self.primary_timed = False  # the primary's last result carried stage times (the budget must judge them)
        t = cfg.timing
        self.watchdog = Watchdog(WatchdogConfig(frame_deadline_ms=t.deadline_ms,
                                                wait_timeout_ms=cfg.dock.wait_timeout_ms,
                                                hang_margin_ms=t.hang_margin_ms, miss_run=t.miss_run))
        self.sup = Supervisor(now, SupervisorConfig(
            shadow_frames=t.shadow_frames, backoff_initial_s=t.backoff_initial_s, backoff_factor=t.backoff_factor,
            backoff_max_s=t.backoff_max_s, stable_after_s=t.stable_after_s, flap_window_s=t.flap_window_s,
            flap_max_failovers=t.flap_max_failovers, flap_backoff_s=t.flap_backoff_s),
            on_transition=self._log_transition)
        self.active = ActiveFlag(now)
        self.health_published_ok = False  # the last chestnutHealth sent showed every layer OK (active_as_published)
        self.framedrop = FrameDropFilter()
        self.stale = StaleDetector()           # the primary's outputs
        self.fallback_stale = StaleDetector()  # the fallback's: the output checks apply to every source
        self.contracts: tuple[Any, ...] = ()  # the declared contract's outputs (declare_contract)
        self.contract: DeclaredContract | None = None
        self.disagree_run = self.disagreements = 0  # hot standby: primary outputs that disagree with the fallback
        self.answering = False  # the contract is declared and the fallback warm (or not required): frames answered
        self.worker: WorkerHandle | None = None
        self.worker_ready_seen = False   # this worker's readiness was taken in (fed QUALIFIED/LOADED)
        self.link_speed_mbps: int | None = None  # the dock's USB speed at the last probe or enumeration (Mbps)
        # every such reading, (ns, Mbps): the link while a start's wait went on (node/policy.py slow_link_while)
        self.link_readings: deque[tuple[int, int]] = deque(maxlen=LINK_READINGS_KEPT)
        self.draining = False            # failed over; the worker only finishes what is in flight
        self.worker_beats = 0
        self.probe_seen_at_s = 0.0       # receipt time of the last probe result applied to health
        self.miss_run = 0                # consecutive frames the primary did not answer in time
        self.errors_at_good = 0          # the worker's failed transfer attempts at its last result in time
        # the stage times (ms: copy-in, compute, copy-out) of the results since the primary's last one in time: whose
        # a run of misses is on a link below SuperSpeed (node/policy.py miss_run_blame)
        self.run_stages: deque[tuple[float, float, float]] = deque(maxlen=MISS_STAGES_KEPT)
        self.link_look_ns = 0            # when a miss last asked the node's own look at the link speed
        # the host's own lateness (node/hostload.py): a deadline miss while it was late is the host's
        self.host = HostMeter(t.host_window_ms, twin_wait_path=(runtime_dir(prefix) / HOSTWAIT_FILE
                                                                if cfg.dock.kind == "twin" else None))
        self.host_thresholds = HostThresholds(t.host_late_ms, t.host_cpu_pressure_pct, t.deadline_ms)
        self.host_misses = 0             # deadline misses blamed on the host (not counted towards a failover)
        self.miss_warns: deque[str] = deque(maxlen=MISS_WARNS_KEPT)  # the last deadline misses' gpu WARN reasons
        self.result_at_ns = 0            # receipt of the worker's last result (CLOCK_MONOTONIC ns)
        self.after_output: deque[Callable[[], object]] = deque()  # _after_output's work, until the output is out
        # the node and its worker can run on two CPUs at once (their affinity): only then does the node's busy wait
        # for a result leave the worker a CPU, and the worker's wake-up on a WAKE stay off the node's CPU
        self.cpus_apart = cpus_apart(cfg.realtime.cpus)
        self.prewake_ns = 0              # when to wake before the next frame to WAKE the worker (0: not to)
        self.worker_woken_ns = 0         # when the last WAKE went to the worker (CLOCK_MONOTONIC ns)
        self.collector = IdleCollector()  # engaged once answering (run): cycle collections between frames only
        self.roundtrips: deque[float] = deque(maxlen=BUSY_WAIT_SAMPLES)  # the worker's last round trips (s)
        self.next_output: tuple[Any, Any] | None = None  # (Event builder, its modelOutput): _prepare_output
        self.output_template: OutputTemplate | None = None  # the primary's answer: _ready_output_template
        self.template_refused: tuple[str, tuple[TensorSpec, ...]] | None = None  # a (model, specs) it cannot be
        # the fallback's steady answer: (model id, reason, ((name, shape, dtype str), ...)), frames in a row seen
        self.answer_seen: tuple[str, str, tuple[tuple[str, tuple[int, ...], str], ...]] | None = None
        self.answer_streak = 0
        self.answer_template: OutputTemplate | None = None  # made for answer_template_key (_ready_answer_template)
        self.answer_template_key: object = None
        self.answer_refused: set[object] = set()  # tensors whose template cannot be made (their sizes decide it)
        # the primary's adaptive deadline (node/deadline.py): its recent latencies (ms) and the deadline in force
        self.deadline_rule = DeadlineRule(ceiling_ms=t.deadline_ms, floor_ms=min(t.deadline_floor_ms, t.deadline_ms),
                                          host_late_ms=t.host_late_ms, adaptive=t.adaptive_deadline,
                                          period_ms=t.frame_period_ms)
        self.latencies: deque[float] = deque(maxlen=self.deadline_rule.window)
        self.deadline: Deadline = adaptive_deadline((), self.deadline_rule)
        self.deadline_log = LogEvery(DEADLINE_LOG_PERIOD_S)
        self.host_last_late_ns = 0
        self.dock_off_logged = False  # dock.kind = none: the first move into degraded was logged (_log_transition)
        self.host_late_at_ns: int | None = None  # the last time _host_late found the host late
        self.host_late_reason = ""
        self.slow_copy_since_ns: int | None = None  # the copy path's usb WARN holds since (ns); None: copies OK
        self.run_risk_since_ns: int | None = None  # the stage budget's deadline at risk since (ns); None: not
        # the dock's own time per frame (stage times, ms) and the camera's frame period (ms): a dock slower than
        # the camera is not excused by a late host (node/policy.py dock_outpaced)
        self.dock_recent: deque[float] = deque(maxlen=9)
        self.frame_periods: deque[float] = deque(maxlen=20)
        self.outpaced_log = LogEvery()
        self.host_log = LogEvery()
        self.pending_events: deque[tuple[Event, str, Layer | None]] = deque()
        self.last_frame_id: int | None = None
        self.last_sof_ns = 0
        self.next_init_ns = 0
        self.camera_restarts = 0
        self.seq_offset = 0  # request seq = frame id + offset (see on_frame: camera restarts)
        self.frames_in = self.frames_out = 0
        self.bad_frames = 0
        self.bad_frame_log = LogEvery()
        self.bad_timestamps = 0          # frames whose timestampEof gives no age (0, or in the future)
        self.stale_frames = 0            # frames read over timing.max_frame_age_ms after their EOF
        self.stale_log = LogEvery()
        self.fallback_invalid = 0        # fallback outputs that failed their checks
        self.primary_invalid, self.primary_invalid_log = 0, LogEvery()  # serving primary outputs that failed theirs
        self.timestamp_log, self.fallback_log = LogEvery(), LogEvery()
        self.submit_failures, self.submit_log = 0, LogEvery()  # frames the primary worker would not take
        self.fallback_failures, self.fallback_fail_log = 0, LogEvery()  # fallback runs that raised
        self.out_of_order = 0
        self.order_log = LogEvery()
        self.frame_reader = FrameReader(self.prefix)  # inline frames, or the camera's shared-memory ring
        self.looker = DockLooker(cfg.dock.kind, self.prefix)  # the node's own enumerations, off this loop
        self.cameras_gone = 0            # times the camera of the mapped ring went away (stopped or died)
        self.ring_session: int | None = None  # the camera session whose ring is mapped, once a ring frame came
        self.next_health_ns = self.next_state_ns = self.next_probe_ns = now
        self.state_dirty = True
        self.notify = SdNotify()
        self.versions = _versions()
        from chestnut.backend.probe import IDENTITY_KEYS, host_os

        # host and dock identity: the dock's fields from the first worker that climbs the ladder (backend/probe.py)
        self.identity = {**dict.fromkeys(IDENTITY_KEYS, "unknown"), "tinygrad": self.versions["tinygrad"],
                         "host_os": host_os()}

    # ---------------------------------------------------------------- set-up

    def _read_fingerprint(self) -> dict[str, Any] | None:
        return read_fingerprint(self.cfg.fingerprint_path)

    def _read_primary_model_id(self) -> str:
        """``modelOutput.modelId`` of the primary; "" while the file cannot be read (the worker reports why). Read
        as the worker reads it (``backend/model.py`` ``read_model_file``): a FIFO is never opened, a file over
        ``MAX_MODEL_BYTES`` is refused from its size, unread (a 40 GB sparse file was a MemoryError traceback)."""
        from chestnut.backend.errors import ModelError
        from chestnut.backend.model import model_id, read_model_file

        try:
            return model_id(self.cfg.model.name, read_model_file(self.cfg.model.path, "primary model"))
        except (OSError, ModelError):
            return ""

    def open(self) -> None:
        self.pm = PubMaster(["modelOutput", "chestnutActive", "chestnutHealth", "nodeState", "initData"],
                            prefix=self.prefix)
        self.sm = SubMaster(["controlState"], prefix=self.prefix)

    def subscribe_frames(self) -> None:
        """Subscribe to the frame service, once the node can answer (the fallback is warm). A subscription
        made earlier would queue the frames sent while the models load and answer them all as stale frames
        once the loop starts: an output-layer WARN on every start on a slow host, for frames the node was
        never ready to serve (a process manager starts consumers on ``READY=1``, not before)."""
        self.poller = zmq.Poller()  # the frames and their connection monitor: a lost connection wakes the loop
        self.frames = sub_sock(self.cfg.timing.frame_service, self.poller, prefix=self.prefix)
        # and the mapped ring's notice pipe: its camera's notices come one pipe write after the pixels, before
        # the same frame's bus message (msgs/visionipc.py); each frame is taken once, by whichever comes first
        self.frame_reader.shm.poller = self.poller

    def declare_contract(self) -> int | None:
        """The node's output contract from the primary model file and the configuration
        (:func:`chestnut.node.contract.declare_contract`); None when declared, else one line and the exit code:
        :data:`EXIT_CONFIG` for a ``model.ranges`` key the primary does not output, and for a primary file that is
        missing, unreadable or fails its known-answer check while ``fallback.path`` names another file (the
        configuration names a model the node cannot use); :data:`EXIT_NO_FALLBACK` for such a primary file that is
        the fallback's too (``fallback.path`` unset or the same file: refused as primary and as fallback, the node
        cannot serve)."""
        try:
            self.contract = declare_contract(self.cfg, self.spec_in.fingerprint)
        except ConfigError as e:
            self.stop_reason = f"unusable configuration: {e}"
            log.error("%s", self.stop_reason)
            return EXIT_CONFIG
        except ContractError as e:
            self.stop_reason = f"no output contract: {e.detail}"
            log.error("%s; %s", self.stop_reason, model_fix(self.cfg.model.path))
            return EXIT_NO_FALLBACK if self.cfg.fallback_is_primary else EXIT_CONFIG
        self.contracts = self.contract.outputs
        log.info("output contract %s from the primary model %s: %s (known answer: %s)", self.contract.fingerprint,
                 self.cfg.model.path, self.contract.describe(), self.contract.known_answer)
        c = self.contract
        self._identify_file("model", self.cfg.model.path, c.model_sha256, c.model_bytes, c.known_answer,
                            self.cfg.fingerprint_path)
        return None

    def _identify_file(self, role: str, path: Path, sha256: str, nbytes: int, check: str, fp_path: Path) -> None:
        """A model file the node runs, once at start: its path, size, sha256 and known-answer check into the log
        and into ``initData`` / ``nodeState`` ``identity`` (``node/contract.py`` ``file_identity``), so a run's log
        names the exact bytes, a file with no recorded fingerprint too (unchecked)."""
        log.info("%s", describe_file(role, path, sha256, nbytes, check, fp_path))
        self.identity.update(file_identity(role, path, sha256, nbytes, check))
        self.next_init_ns = 0
        self.state_dirty = True

    def warm_fallback(self) -> bool:
        """Load the fallback, check it against the contract, and warm it (it answers frames from now on).
        False when the node cannot serve: no usable fallback and ``fallback.required`` (else the node runs on
        the primary alone, ``self.fallback`` None)."""
        fb = self.cfg.fallback
        assert self.contract is not None  # declare_contract ran first
        try:
            t0 = time.monotonic()
            name = f"{self.cfg.model.name}-fallback"
            if (fb.engine == "onnxruntime" and fb.threads == 1 and self.contract.model is not None
                    and self.cfg.fallback_is_primary):
                fallback = FallbackModel.of(self.contract.model, name)  # the contract's session: one load, not two
            else:
                fallback = FallbackModel(self.cfg.fallback_path, fb.engine, name=name,
                                         input_shapes={self.cfg.model.input: tuple(self.cfg.model.shape)},
                                         threads=fb.threads, jit_cache=JitCache() if fb.engine == "tinygrad" else None)
            refusal, check = check_fallback(self.contract, fallback, self.cfg.fallback_path)
            if refusal is None:
                self.fallback = fallback
                last = self.fallback.warm()
            self.starting = False  # from here on a stop request waits for the loop (no child is mid-spawn)
        except Exception as e:  # ModelError, or anything the engine raises: no fallback, no service (a stop is not one)
            self.starting = False
            log.error("no usable fallback model (%s, %s): %s: %s; %s", self.cfg.fallback_path, fb.engine,
                      type(e).__name__, e, model_fix(self.cfg.fallback_path))
            return self._without_fallback(str(e))
        if refusal is not None:
            log.error("%s", refusal)
            return self._without_fallback(refusal)
        assert self.fallback is not None
        if self.fallback.sha256 != self.contract.model_sha256:  # a file of its own: identified as the primary's is
            self._identify_file("fallback", self.cfg.fallback_path, self.fallback.sha256, self.fallback.nbytes, check,
                                self.cfg.fallback_path.with_suffix(".fingerprint.json"))
        log.info("fallback %s (%s, %s standby) warm in %.2f s, %.1f ms per frame", self.fallback.model_id,
                 fb.engine, fb.standby, time.monotonic() - t0, last * 1e3)
        self._feed(Event.FALLBACK_READY, f"fallback {fb.engine} warm")
        return True

    def _without_fallback(self, why: str) -> bool:
        """No fallback: the node refuses to start (False) unless ``fallback.required`` is false, when it runs
        on the primary alone (every frame the primary does not answer is published not valid)."""
        self.fallback = None
        if self.cfg.fallback.required:
            self._feed(Event.FALLBACK_FAILED, why)
            self.stop_reason = f"no usable fallback: {why}"
            return False
        log.warning("running without a fallback (fallback.required = false): a frame the primary does not answer "
                    "is published not valid")
        self._feed(Event.FALLBACK_READY, "no fallback (fallback.required = false)")
        return True

    # ---------------------------------------------------------------- supervisor glue

    def _log_transition(self, t: Transition) -> None:
        """One log line per supervisor transition: a failover (``-> degraded``) is a WARNING, every other state
        change (start-up, recovery, stop) routine, INFO. With ``dock.kind = none`` the dock is off by the user's
        choice, not failing: the supervisor's looks for it and their back-off (``dock_absent``, ``retry_due``, at
        most ``timing.backoff_max_s`` apart, 30 s by default: ``node/config.py``) are DEBUG; the node says once,
        at INFO as it is ready, that it serves from the fallback only (:meth:`run`), and its first move into degraded
        is INFO. A dock configured but absent still warns at each look."""
        if self.cfg.dock.kind == "none" and t.event in (Event.DOCK_ABSENT, Event.RETRY_DUE):
            # the first move into degraded once at INFO, so the log shows every state the node was in
            level = logging.DEBUG if self.dock_off_logged or t.to_state is not State.DEGRADED else logging.INFO
            self.dock_off_logged = self.dock_off_logged or level == logging.INFO
        elif t.to_state is State.STOPPING and self.stop_said:  # a refusal at start: its one line is the caller's
            level = logging.DEBUG
        else:
            level = logging.WARNING if t.to_state.value == "degraded" else logging.INFO
        log.log(level, "%s -> %s on %s: %s", t.from_state.value, t.to_state.value, t.event.value, t.reason)
        self.state_dirty = True

    def _feed(self, event: Event, reason: str = "", layer: Layer | None = None) -> None:
        self.pending_events.append((event, reason, layer))
        self._drain_events()

    def _drain_events(self) -> None:
        """The queued events, in order, through the supervisor. Once a stop is requested only the events that
        end in STOPPING (:data:`STOP_EVENTS`) reach it: a look, a worker's readiness or failure that comes in
        while stopping starts nothing (logged at DEBUG)."""
        while self.pending_events:
            event, reason, layer = self.pending_events.popleft()
            if self.stop_requested and event not in STOP_EVENTS:
                log.debug("stopping: %s not handled (%s)", event.value, reason)
                continue
            for t in self.sup.handle(event, time.monotonic_ns(), reason, layer):
                self._perform(t)

    def _perform_all(self, transitions: list[Transition]) -> None:
        for t in transitions:
            self._perform(t)
        self._drain_events()

    def _perform(self, t: Transition) -> None:
        if self.stop_requested and t.action in (Action.SPAWN_WORKER, Action.LOOK_FOR_DOCK):
            return  # taken as the stop came (a signal between two steps): no new work, close() stops the node
        if t.action is Action.SPAWN_WORKER:
            self._start_worker()
        elif t.action is Action.BACK_OFF:
            self._fail_over_worker(t.reason)
        elif t.action is Action.LOOK_FOR_DOCK:
            self.looker.ask(LOOK_RETRY)  # answered in _take_looks (node/docklook.py: never on this loop)
        elif t.action in (Action.STOP, Action.ABORT):
            self.stop_requested = True
            if t.action is Action.ABORT:
                self.exit_code = EXIT_NO_FALLBACK
                self.stop_reason = t.reason
        elif t.action is Action.START_SHADOW:
            self.stale.reset()
            self.miss_run = 0
        # LOAD_PRIMARY and SERVE_PRIMARY need nothing here: the worker loads the model as the ladder's
        # last rungs, and who serves follows from the supervisor's state.

    def _start_worker(self) -> None:
        self._kill_worker("replacing the worker")
        if self.cfg.dock.kind == "none":
            self.pending_events.append((Event.DOCK_ABSENT, "dock disabled (dock.kind = none)", Layer.USB))
            return
        from chestnut.backend.ladder import LadderConfig

        # twin and real: lock_first, the dock's lock at usb_ids before any rung touches the dock (a dock another
        # process holds is refused there, never reset)
        spec = dock_runner_spec(self.cfg.dock.kind, self.cfg.dock.options, int(self.cfg.dock.wait_timeout_ms),
                                self.prefix)
        ladder = LadderConfig(wait_timeout_ms=int(self.cfg.dock.wait_timeout_ms),
                              require_fingerprint=self.spec_in.fingerprint is not None)
        rt = self.cfg.realtime
        self.worker = WorkerHandle(realtime=(rt.policy, worker_priority(rt.priority), rt.cpus))
        self.roundtrips.clear()  # another worker: its own pace
        self.worker_ready_seen = False
        self.worker_beats = 0
        self.probe_seen_at_s = 0.0
        try:
            self.worker.start(spec, self.spec_in, ladder)
        except ChestnutError as e:  # an unusable runner spec, or the process could not be spawned
            log.error("cannot start a primary worker: %s", e)
            self.worker = None
            self.pending_events.append((Event.QUALIFY_FAILED, str(e), e.layer))
        self.state_dirty = True

    def _fail_over_worker(self, why: str) -> None:
        """BACK_OFF: the fallback serves from now on. A worker with requests in flight drains (see the
        module docstring); any other is killed now."""
        w = self.worker
        if w is not None and drains_on_fail_over(w.alive, w.ready, len(w.in_flight), len(self.watchdog.outstanding)):
            if not self.draining:
                log.warning("worker %s drains: %d request(s) in flight (oldest frame %d); killed when answered or "
                            "at the wait timeout + margin", w.pid, len(w.in_flight), w.in_flight[0])
            self.draining = True
            return
        self._kill_worker(why)

    def _kill_worker(self, why: str) -> None:
        if self.worker is None:
            return
        w, self.worker = self.worker, None
        self.draining = False
        if w.alive:
            log.info("killing worker %s: %s", w.pid, why)
        w.kill()
        w.stop(0.5)
        self._watchdog_actions(self.watchdog.worker_stopped(time.monotonic_ns()))
        self.state_dirty = True

    def _poll_worker_start(self, now: int) -> None:
        w = self.worker
        if w is None or self.worker_ready_seen or self.draining:
            return
        try:
            ready = w.poll_ready()
        except ChestnutError as e:
            self._take_identity(w)
            if w.ladder is not None:
                self.health.apply(evidence_from_ladder(w.ladder), now)
            elif (ev := evidence_from_error(e)) is not None:
                self.health.apply([ev], now)
            failed = w.ladder.first_failure if w.ladder is not None else None
            # the dock's lock refused at usb_ids is a failed load (the dock is there), not a missing dock
            kind = start_failure(failed.name if failed is not None else None, isinstance(e, ModelError), e.reason)
            self._feed_start_failure(kind, str(e), e.layer)
            return
        if not ready:
            if self._stalled(w):
                return
            spawned_s = w.spawned_at_s if w.spawned_at_s is not None else time.monotonic()
            if start_timed_out(spawned_s, time.monotonic(), self.cfg.timing.start_timeout_s):
                self._start_timed_out(w)
            return
        # readiness may have been taken in by any earlier pump of the handle (poll_result, probe):
        # the flag above, not w.ready, says whether the node has acted on it
        self.worker_ready_seen = True
        self._take_identity(w)
        if w.ladder is not None:
            self.health.apply(evidence_from_ladder(w.ladder), now)
            steps = ", ".join(f"{s.name} {s.duration_s * 1e3:.0f} ms" for s in w.ladder.steps
                              if s.result in (StepResult.PASS, StepResult.WARN))
            log.info("worker %s qualified and loaded: %s", w.pid, steps)
        if not self.primary_model_id:
            self.primary_model_id = self._read_primary_model_id()
        self.latencies.clear()  # a new worker's latency is its own: the ceiling until it has shown it
        self.run_stages.clear()
        self.deadline = adaptive_deadline((), self.deadline_rule)
        self._watchdog_actions(self.watchdog.worker_started(now))
        self._feed(Event.QUALIFIED, "qualification ladder passed")
        self._feed(Event.LOADED, "model loaded; warm-up matched its fingerprint"
                   if self.spec_in.fingerprint else "model loaded")

    def _take_identity(self, w: WorkerHandle) -> None:
        """The worker's dock identity into ``initData`` / ``nodeState`` (sent at once when it changed) and the log."""
        known = {k: v for k, v in w.identity.items() if k in self.identity and v != "unknown"}
        if not known or all(self.identity[k] == v for k, v in known.items()):
            return
        self.identity.update(known)
        log.info("dock identity: %s", "; ".join(f"{k} {v}" for k, v in self.identity.items()))
        self.next_init_ns = 0
        self.state_dirty = True

    def _start_timed_out(self, w: WorkerHandle) -> None:
        """A worker that has not qualified and loaded within ``start_timeout_s``: hung (a wait without a
        timeout of its own, or a lost message); killed, and counted against the step it was in."""
        state = w.progress().state
        loading = state is WorkerState.LOADING
        why = (f"primary worker {w.pid} not ready {self.cfg.timing.start_timeout_s:g} s after spawn "
               f"(stuck {state.name.lower()}, heartbeat {w.heartbeat_age_s() * 1e3:.0f} ms old)")
        layer = Layer.GPU
        spawned_ns = int(w.spawned_at_s * NS) if w.spawned_at_s is not None else time.monotonic_ns()
        if (link := slow_link_while(self.link_readings, spawned_ns)) is not None:
            # on a USB 2 link the load's copies are ~10x slower: the link's failure, not the GPU's
            layer, why = Layer.USB, f"{why} on a {link} (copies ~10x slower than SuperSpeed)"
        log.error("%s; killing it", why)
        self.health.apply([Evidence(layer, Level.ERROR, why, hard=True, tag="start_timeout")], time.monotonic_ns())
        self._kill_worker(why)
        self._feed_start_failure(timed_out_start_failure(loading), why, layer)

    def _stalled(self, w: WorkerHandle) -> bool:
        """A worker in its long command (qualifying and loading: the START) that has waited on the dock without
        progress (``backend/progress.py``: no bytes moved, no step, no engine tick) longer than the wait timeout +
        stall margin: ended now, whatever its own waits would do (tinygrad 0.14's copy-in drain waits 10 s), and
        counted as a failed start. Its other commands are frames (the watchdog's hang check) and probes (bounded
        transfers, queued behind the frames). True when it was ended."""
        prog = w.progress()
        limit_ms = self.watchdog.config.stall_timeout_ms
        if prog.state not in (WorkerState.QUALIFYING, WorkerState.LOADING) or prog.stalled_s * 1e3 <= limit_ms:
            return False
        c = self.watchdog.config
        what = prog.state.name.lower()
        why = (f"primary worker {w.pid} made no progress for {prog.stalled_s * 1e3:.0f} ms while {what}: waiting "
               f"on the dock longer than the wait timeout + margin ({c.wait_timeout_ms:g} + {c.stall_margin_ms:g} ms)")
        layer = Layer.GPU
        # the link while it waited, not only at the last look: a write a USB 2 link truncated is never completed
        if (link := slow_link_while(self.link_readings, time.monotonic_ns() - int(prog.stalled_s * NS))) is not None:
            layer, why = Layer.USB, f"{why} on a {link}"
        log.error("%s; killing it", why)
        self.health.apply([Evidence(layer, Level.ERROR, why, hard=True, tag="stall")], time.monotonic_ns())
        self._kill_worker(why)
        self._feed_start_failure(timed_out_start_failure(prog.state is WorkerState.LOADING), why, layer)
        return True

    def _feed_start_failure(self, kind: StartFailure, reason: str, layer: Layer | None) -> None:
        """A failed start to the supervisor; a failed load after QUALIFIED (the worker climbs the dock rungs
        and loads in one go: the dock qualified). The dock's lock refused at ``usb_ids`` is a failed load too
        (``node/policy.py`` ``start_failure``): its transitions are those it had when the lock came with the
        data path, in the model's load, QUALIFIED's words included."""
        if kind is StartFailure.LOAD_FAILED:
            self._feed(Event.QUALIFIED, "qualification ladder passed up to the model load")
        self._feed(Event(kind.value), reason, layer)

    def _check_worker_alive(self) -> None:
        w = self.worker
        if w is None or w.alive:
            return
        if self.stop_requested:
            # a stop is not a failure: the SIGTERM that stops the node reaches its worker too when it is sent to
            # the process group (``timeout``, a terminal, systemd's control-group kill); close() reaps the worker
            return
        now = time.monotonic_ns()
        # reaped first (one whose socket closed gets its time to exit on its own: WorkerHandle.kill), so the reason
        # names its exit status; the watchdog answers what it held from the fallback (worker_stopped)
        self._kill_worker("it exited")
        how = describe_returncode(w.returncode)
        self.health.apply([Evidence(Layer.GPU, Level.ERROR, f"primary worker exited ({how})", hard=True,
                                    tag="worker_died")], now)
        self._feed(Event.WORKER_DIED, f"primary worker exited ({how})", Layer.GPU)

    def _watchdog_actions(self, actions: list[WatchdogAction]) -> set[int]:
        """Apply watchdog actions; returns the frame seqs that must be answered from the fallback.
        Their evidence goes to health; the supervisor hears of them through their own events."""
        answer: set[int] = set()
        now = time.monotonic_ns()
        for a in actions:
            if (a.kind is ActionKind.FAIL_OVER or a.entity == "hang") and a.layer is Layer.GPU:
                layer, reason = self._miss_run_blame(a.reason)  # a slow or failing link's, not the gpu's
                a = dataclasses.replace(a, layer=layer, reason=reason)
            ev = evidence_from_watchdog(a)
            if ev is not None:
                self._apply_watchdog_evidence(ev, now)
            if a.kind is ActionKind.ANSWER_FROM_FALLBACK and a.seq is not None:
                answer.add(a.seq)
                if a.entity == "host":
                    self._host_miss(a.reason, now)
            elif a.kind is ActionKind.KILL_WORKER:
                log.error("watchdog: %s", a.reason)
                self._kill_worker(a.reason)
                self._feed(Event.WORKER_DIED, a.reason, a.layer)
            elif a.kind is ActionKind.FAIL_OVER:
                self._feed(Event.DEADLINE_MISS_RUN, a.reason, a.layer or Layer.GPU)
        return answer

    def _apply_watchdog_evidence(self, ev: Evidence, now: int) -> None:
        """A deadline miss's or the watchdog's evidence to health; a miss's gpu WARN reason is kept for
        ``chestnutActive`` (:func:`~chestnut.node.policy.mark_deadline_miss`)."""
        self.health.apply([ev], now)
        if ev.tag == "deadline_miss" and ev.level is Level.WARN:
            self.miss_warns.append(ev.reason)

    def _apply_health(self, evidence: list[Evidence], now: int) -> None:
        """Apply evidence; while a worker should run, a layer at ERROR after bad evidence is a primary
        fault -- also when it was ERROR already (a layer still recovering from the last fault)."""
        self.health.apply(evidence, now)
        for ev in evidence:
            status = self.health.status(ev.layer)
            if is_primary_fault(ev.level is Level.ERROR, status.level is Level.ERROR, self.sup.wants_worker):
                self._feed(Event.PRIMARY_FAULT, status.reason, ev.layer)
                return

    def _on_primary_error(self, res: WorkerResult) -> None:
        assert res.error is not None
        log.error("primary run of frame %d failed: %s", res.seq, res.error)
        self._apply_health([evidence_from_worker_error(res.error)], time.monotonic_ns())

    # ---------------------------------------------------------------- one frame

    def on_frame(self, cf: Any, valid: bool = True, sent_ns: int = 0) -> None:
        """One ``cameraFrame``: a ``CameraFrame`` reader from the bus or the :class:`~chestnut.msgs.visionipc.RingFrame`
        of the camera's notice (the same fields). ``valid``: its message's ``Event.valid``; a frame its camera
        marked not valid is answered as any other, and the answer published not valid (cereal's convention: a
        message made from an input that is not valid is not valid either; ``node/policy.py``
        ``with_input_validity``). ``sent_ns``: its message's ``logMonoTime`` (0: unknown), which tells a stale
        frame the camera sent late from one the node read late (:func:`stale_frame_reason`)."""
        frame_id = int(cf.frameId)
        sof = int(cf.timestampSof)
        if (self.last_frame_id is not None and frame_id <= self.last_frame_id and sof > self.last_sof_ns
                and frame_id < self.last_frame_id - CAMERA_RESTART_MIN_STEP):
            # a restarted camera counts from the start again with newer timestamps: a new stream, followed
            # (consumers and `chestnut check` see the one decrease of ids right after the camera's)
            self.camera_restarts += 1
            self.seq_offset += self.last_frame_id + 1 - frame_id
            log.warning("camera restarted: frame id %d after %d with a newer start-of-frame; following the new "
                        "stream (restart %d)", frame_id, self.last_frame_id, self.camera_restarts)
            self.framedrop.reset()
            self.frame_periods.clear()
            self.stale.reset()
            self.fallback_stale.reset()
            self.last_frame_id = None
        if self.last_frame_id is not None and frame_id <= self.last_frame_id:
            # a repeated or reordered frame: answering it would break the increasing frame ids consumers rely on
            self.out_of_order += 1
            if self.order_log.due():
                log.warning("cameraFrame %d after %d: frame ids must increase; dropped (%d so far)", frame_id,
                          self.last_frame_id, self.out_of_order)
            return
        if self.last_frame_id is not None and sof > self.last_sof_ns:
            self.frame_periods.append((sof - self.last_sof_ns) / 1e6 / (frame_id - self.last_frame_id))
        self.last_frame_id = frame_id
        self.last_sof_ns = sof
        self.frames_in += 1
        drop_perc = self.framedrop.update(frame_id)
        now = time.monotonic_ns()
        eof = int(cf.timestampEof)
        if stale := stale_frame_reason(eof, now, self.cfg.timing.max_frame_age_ms, int(sent_ns)):
            self._stale_frame(frame_id, cf, stale, drop_perc, now)
            return
        try:
            img = self.frame_reader.view(cf)  # a ring frame is read in place: no copy before preprocessing
            inputs = preprocess(self.cfg.model.preprocess, img, self.cfg.model.input, tuple(self.cfg.model.shape),
                                str(cf.encoding), self._input_slot())  # "warp:<name>" resizes / converts a full
            # frame (node/preprocess.py); written where the primary's worker reads it when it will likely take it
            # the primary's own warp takes the full frame (checked always; copied, before the torn-frame
            # check below, while there is a worker to send it to)
            full, refusal = None, ""
            if self.warp is not None:
                try:
                    full = self.warp.check_frame(img, str(cf.encoding))
                except ValueError as e:  # another camera format: the fallback's CPU warp takes any frame
                    refusal = f"the primary cannot take this frame: {e}"
                    self._frame_format_refused(refusal)
            full = None if full is None or self.worker is None else self._copy_full_frame(full)
            self.frame_reader.verify(cf)  # lapped by the camera while read: dropped, never torn
            if self.frame_reader.session != self.ring_session:  # the first frame of a camera's ring
                self.ring_session = self.frame_reader.session
                log.info("frame ring of camera session %x mapped (%s, %dx%d)", self.ring_session,
                         cf.encoding, cf.width, cf.height)
        except (ValueError, KeyError, FrameBufferError) as e:
            self.bad_frames += 1
            if self.bad_frame_log.due(type(e).__name__):  # at once for a new kind, then at most once a second
                log.warning("cameraFrame %d unusable: %s (%d such frames so far)", frame_id, e, self.bad_frames)
            clock = frame_clock(frame_id, eof, time.monotonic_ns(), self.cfg.dock.wait_timeout_ms)
            bad = Answer(Source.NONE, None, 0.0, False, f"bad frame: {e}")
            self._publish_output(frame_id, cf, FrameResult(bad), clock, drop_perc)
            return
        clock = frame_clock(frame_id, eof, time.monotonic_ns(), self.cfg.dock.wait_timeout_ms)
        if not clock.age_known:
            self._bad_timestamp(clock)
        # the worker's request seq: the frame id, plus an offset that keeps it increasing across camera restarts
        started = time.monotonic_ns()
        result = self._infer(frame_id + self.seq_offset, inputs, clock, full, refusal)
        result.answer = with_input_validity(with_frame_clock(result.answer, clock), valid)
        self._publish_output(frame_id, cf, result, clock, drop_perc)
        self._run_after_output()
        host = self.host_last_late_ns >= started and self.sup.serving is Source.PRIMARY
        by_fallback = result.answer.source is not Source.PRIMARY
        self._publish_active(result.answer.source, result.answer.valid, result.answer.reason,
                             host_frame=frame_id if host and by_fallback else None,
                             missed_frame=frame_id if result.deadline_missed and by_fallback else None)

    def _input_slot(self) -> np.ndarray | None:
        """Where the preprocess writes this frame's model input when the primary will likely take the same
        tensor (its worker ready with a free slot, its one input the fallback's by name, shape and dtype, no
        ``model.frame`` warp of its own): the worker's next input slot (``WorkerHandle.next_inputs``), so the
        request sends it with no copy and no check. None otherwise: a new array. The fallback reads the same
        array; nothing writes a slot while a request holds it."""
        if self.warp is not None or not self.sup.runs_primary or self.draining:
            return None
        return self._slot_array(self.cfg.model.input, tuple(self.cfg.model.shape), np.dtype(np.float32))

    def _slot_array(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """The array of the worker's next input slot (``WorkerHandle.next_inputs``) when the primary has one
        input, ``name``, of ``shape`` and ``dtype``; else None (no worker, none ready or free, another input)."""
        w = self.worker
        slot = w.next_inputs() if w is not None and len(w.inputs) == 1 else None
        dst = slot.get(name) if slot is not None else None
        return dst if dst is not None and dst.shape == shape and dst.dtype == dtype else None

    def _copy_full_frame(self, full: np.ndarray) -> np.ndarray:
        """``full``, a frame the primary takes whole (its program warps it), copied once out of the frame ring:
        straight into the worker's next input slot when it is the primary's one input (:meth:`_slot_array`; the
        submit then sends it without a second copy), else into a new array."""
        w = self.worker
        dst = self._slot_array(w.inputs[0].name, full.shape, full.dtype) if w is not None and w.inputs else None
        if dst is None:
            return np.array(full)
        np.copyto(dst, full)
        return dst

    def _frame_format_refused(self, why: str) -> None:
        """A frame the primary's warp cannot take (``model.frame`` is another format): counted, logged once per
        distinct reason and then at most every :data:`BAD_FRAME_LOG_PERIOD_S`; the fallback answers it."""
        self.format_refused += 1
        if self.format_log.due(why):
            log.warning("%s; the fallback answers such frames (%d so far)", why, self.format_refused)

    def _stale_frame(self, frame_id: int, cf: Any, why: str, drop_perc: float, now: int) -> None:
        """A frame read over ``timing.max_frame_age_ms`` after its EOF: answered at once, without reading its
        pixels or running a model (``valid`` False, source none, ``why``), so a backlog drains instead of
        being served late; counted, logged at most every :data:`BAD_FRAME_LOG_PERIOD_S`, and the output
        layer is WARN (tag ``stale_frame``) while such frames come."""
        self.stale_frames += 1
        if self.stale_log.due():
            log.warning("cameraFrame %d: %s; answered without a model (%d such frames so far)", frame_id, why,
                        self.stale_frames)
        self.health.apply([Evidence(Layer.OUTPUT, Level.WARN, why, tag="stale_frame", source=STALE_FRAME_SOURCE,
                                    counted=False)], now)
        clock = frame_clock(frame_id, int(cf.timestampEof), now, self.cfg.dock.wait_timeout_ms)
        self._publish_output(frame_id, cf, FrameResult(Answer(Source.NONE, None, 0.0, False, why)), clock, drop_perc)
        self._publish_active(Source.NONE, False, why)

    def _bad_timestamp(self, clock: FrameClock) -> None:
        """A frame whose age is unknown: counted, logged at most every :data:`BAD_FRAME_LOG_PERIOD_S`."""
        self.bad_timestamps += 1
        if self.timestamp_log.due():
            log.warning("%s; its output is published as not valid (%d such frames so far)", clock.age_problem,
                      self.bad_timestamps)

    def _run_fallback(self, inputs: dict[str, np.ndarray]) -> Candidate:
        """The fallback's answer, checked like any source's (present, shape, dtype, finite, range, stale).
        It never takes the node down: a failed run is a candidate without outputs that says why, counted and
        logged at ERROR once a :data:`BAD_FRAME_LOG_PERIOD_S` (s) for the same cause (its class and ``reason``),
        at once for another."""
        if self.fallback is None:
            return Candidate(None, None, 0.0, "no fallback (fallback.required = false)")
        t0 = time.perf_counter()
        try:
            out = self.fallback.run(inputs)
        except Exception as e:  # ModelError or the engine's own error classes
            self.fallback_failures += 1
            if self.fallback_fail_log.due(f"{type(e).__name__}: {getattr(e, 'reason', '')}"):
                log.error("fallback run failed: %s: %s (%d such frames so far)", type(e).__name__, e,
                          self.fallback_failures)
            return Candidate(None, None, time.perf_counter() - t0, f"fallback failed: {type(e).__name__}: {e}")
        exec_s = time.perf_counter() - t0
        report = check_outputs(out, self.contracts, inputs=inputs, stale=self.fallback_stale)
        if not report.ok:
            self.fallback_invalid += 1
            if self.fallback_log.due():
                log.error("fallback output invalid: %s (%d so far)", report.reason, self.fallback_invalid)
        return Candidate(out, report, exec_s)

    def _submit_failed(self, seq: int, e: ChestnutError) -> str:
        """A frame the primary worker would not take: counted, logged at ERROR once a
        :data:`BAD_FRAME_LOG_PERIOD_S` (s) for the same cause (its class and ``reason``), at once for another
        cause, with the count so far; returns the frame's ``why``."""
        self.submit_failures += 1
        if self.submit_log.due(f"{type(e).__name__}: {e.reason}"):
            log.error("submit of frame %d failed: %s (%d such frames so far)", seq, e, self.submit_failures)
        return f"submit to the primary failed: {e}"

    def _infer(self, seq: int, inputs: dict[str, np.ndarray], clock: FrameClock,
               full: np.ndarray | None = None, refusal: str = "") -> FrameResult:
        """One frame through the decisions of :mod:`chestnut.node.policy`; the I/O between them. ``inputs``
        are the fallback's; ``full``, the full frame, goes to a primary whose program warps it itself;
        ``refusal``: why the primary's program cannot take this frame at all (another camera format): it is
        not sent, and the fallback answers it."""
        w = self.worker
        ready = w is not None and w.ready and w.alive  # one look at the process (a waitpid) for both flags
        view = PrimaryView(self.sup.runs_primary, ready, self.draining, ready and w is not None and w.slot_free,
                           w.oldest_in_flight if w is not None else None)
        deadline_ms = self.deadline.ms  # in force for this frame, whatever the results on the way change
        sub = decide_submission(view, clock.base_ns, time.monotonic_ns(), deadline_ms)
        why, submitted = sub.why, False
        if refusal:
            why = refusal
        elif sub.verdict is Submit.MISS:
            self._primary_missed(seq, sub.why, evidence=True, deadline_ms=deadline_ms)
        elif sub.verdict is Submit.SUBMIT and w is not None:
            try:
                w.submit(seq, primary_inputs(w.inputs, inputs, full))
                if actions := self.watchdog.request(seq, clock.base_ns, RequestKind.FRAME, deadline_ms):
                    self._watchdog_actions(actions)
                submitted = True
            except ChestnutError as e:
                why = self._submit_failed(seq, e)
        if submitted:  # while the primary computes: the stale check's input half (its output half after the result)
            self.stale.see_input(inputs)
        fallback: Candidate | None = None
        if fallback_must_run(self.cfg.fallback.standby == "hot", self.sup.serving is Source.PRIMARY, submitted):
            fallback = self._run_fallback(inputs)
        outcome = PrimaryOutcome(None, False, why)
        if submitted and w is not None:
            outcome = self._await_primary(w, seq, clock.base_ns + int(deadline_ms * 1e6), deadline_ms,
                                          agreement_reference(fallback) is not None)
        res = outcome.result
        primary: Candidate | None = None
        report: ValidityReport | None = None
        if res is not None and res.ok:
            now = time.monotonic_ns()
            report = check_outputs(res.outputs, self.contracts, stale=self.stale,
                                   reference=agreement_reference(fallback), reference_checked=True)
            self._note_agreement(report)
            self.miss_run = 0
            self._after_output(self._good_result)
            self.primary_timed = res.stages is not None
            if report.ok:  # OK and the stage budget's WARNs: nothing that could change this frame's answer
                self._after_output(functools.partial(self._judge_run, res, report, now))
            else:  # the result's own record first (the watchdog's response): the judgement may fail it over
                self._run_after_output()
                self._judge_run(res, report, now)
            if self.sup.state in (State.SHADOWING, State.AWAITING_SWITCH):
                # without a fallback (fallback.required = false) nothing can agree: the primary's own checks vote
                vote = shadow_vote(report) if self.fallback is not None else report.ok
                if vote is not None:
                    self._perform_all(self.sup.shadow(vote, now, report.reason))
            primary = Candidate(res.outputs, report, res.exec_time_s)
        elif outcome.missed:
            self._primary_missed(seq, outcome.why, evidence=False, deadline_ms=deadline_ms)
        if fallback is None and not primary_serves(self.sup.serving, primary):
            fallback = self._run_fallback(inputs)
        answer = choose_answer(self.sup.serving, self.sup.reason, primary, fallback, outcome.why)
        if self.sup.serving is Source.PRIMARY and primary is not None and report is not None and not report.ok:
            self._primary_rejected(seq - self.seq_offset, report, answer)
        return FrameResult(answer, outcome.missed, report, res.stages if res is not None and res.ok else None,
                           deadline_ms if sub.verdict is not Submit.SKIP and not refusal else 0.0)

    def _good_result(self) -> None:
        """After a primary result with outputs: the transfer errors so far are the baseline of the next miss run's,
        and the stage times kept for its blame start again (``_miss_run_blame``)."""
        self.errors_at_good = self._transfer_errors()
        self.run_stages.clear()

    def _primary_rejected(self, frame_id: int, report: ValidityReport, answer: Answer) -> None:
        """A frame the serving primary answered with an output that failed its checks (``answer``: the fallback's
        instead, or none valid): counted, logged at WARNING at once for a new cause (the failing checks and
        outputs), then at most once a :data:`BAD_FRAME_LOG_PERIOD_S` (s), with the count so far. One such frame
        clears ``ChestnutActive`` and was otherwise only in its ``modelOutput`` reason."""
        self.primary_invalid += 1
        cause = ", ".join(sorted({f"{r.check.value} {r.output}".rstrip() for r in report.results if not r.ok}))
        if self.primary_invalid_log.due(cause):
            by = ("the fallback answered it" if answer.valid and answer.source is Source.FALLBACK
                  else "no source gave a valid output for it")
            log.warning("primary output invalid on frame %d: %s; %s (%d such frames so far)", frame_id,
                        report.reason, by, self.primary_invalid)

    def _judge_run(self, res: WorkerResult, report: ValidityReport, now: int) -> None:
        """A primary result's evidence: its layers advanced (:func:`evidence_from_run`), its output checks, and
        the stage budget's verdict on its stage times (WARN or OK, never ERROR: ``node/health.py`` ``StageBudget``)."""
        slow = self._excuse_run_risk(self.stage_budget.observe(res.stages, now, res.exec_time_s), now) \
            if res.stages is not None else []
        self._apply_health(evidence_from_run(res.exec_time_s * 1e3) + [evidence_from_validity(report)] + slow, now)

    def _note_agreement(self, report: ValidityReport) -> None:
        """Hot standby: a run of frames whose primary output disagrees with a valid fallback output is shown
        (one WARNING when the run reaches the output layer's debounce, ``node/health.py`` ``DEFAULT_DEBOUNCE``;
        one INFO when they agree again), naming the side its own checks speak against: the primary when one
        of its own checks failed too, else neither (the fallback's passed, or it would not be compared)."""
        if not report.agreement_checked:
            return
        if report.primary_agrees:
            if self.disagree_run >= DISAGREE_RUN:
                log.info("hot standby: primary and fallback agree again after %d frames that did not",
                         self.disagree_run)
            self.disagree_run = 0
            return
        self.disagree_run += 1
        self.disagreements += 1
        if self.disagree_run != DISAGREE_RUN:
            return
        own = [r for r in report.results if r.check is not Check.AGREEMENT and not r.ok]
        against = (f"evidence against the primary, which fails its own checks too ({own[0].reason})" if own else
                   "both pass their own checks (the fallback's answer is no proof: the output layer counts the run "
                   "against the primary, and chestnut check shows each frame's maxAbsDiff)")
        agree = next(r for r in report.results if r.check is Check.AGREEMENT and not r.ok)
        log.warning("hot standby: the primary disagrees with the fallback for %d frames in a row (%s); %s "
                    "(%d disagreeing frames so far)", self.disagree_run, agree.reason, against, self.disagreements)

    def _primary_missed(self, frame_id: int, why: str, evidence: bool, deadline_ms: float | None = None) -> None:
        """One frame the primary did not answer in time. Counts towards ``timing.miss_run``, which fails
        the gpu layer over (the watchdog counts only frames it saw requested; a stuck worker stops
        taking frames once its slots are full, and those frames are misses too). ``evidence``: record
        a gpu WARN for it (the watchdog already did for a frame it saw requested). ``deadline_ms``: the
        frame's deadline in force (default: the current one)."""
        now = time.monotonic_ns()
        deadline_ms = self.deadline.ms if deadline_ms is None else deadline_ms
        host = self._host_late(now)
        if host:
            if evidence:  # the watchdog's own verdict on a requested frame was the host's already
                self._host_miss(f"frame {frame_id}: {why}; {host}", now)
        elif evidence:
            self._apply_watchdog_evidence(Evidence(Layer.GPU, Level.WARN, f"frame {frame_id}: {why}",
                                                   tag="deadline_miss"), now)
        verdict = count_miss(self.miss_run, self.cfg.timing.miss_run, self.sup.runs_primary, deadline_ms, why, host,
                             self._queued_behind(frame_id, now))
        if verdict.run > self.miss_run:
            self._look_at_link(now)
        self.miss_run = verdict.run
        if verdict.fail_over:
            layer, reason = self._miss_run_blame(verdict.reason)
            self.health.apply([Evidence(layer, Level.ERROR, reason, hard=True, tag="deadline_miss_run")], now)
            self._feed(Event.DEADLINE_MISS_RUN, reason, layer)

    def _miss_run_blame(self, reason: str) -> tuple[Layer, str]:
        """:func:`~chestnut.node.policy.miss_run_blame` with the node's figures: the worker's failed transfer attempts
        since the primary's last result in time, the link's speed and the stage times of the results since then."""
        return miss_run_blame(reason, self._transfer_errors() - self.errors_at_good, self.link_speed_mbps,
                              tuple(self.run_stages))

    def _look_at_link(self, now: int) -> None:
        """A counted miss while the primary serves: the node's own enumeration (no claim, no vendor request, off the
        loop: ``node/docklook.py``) reads the link's speed again, at most once a probe period. A worker stuck on a
        copy answers no probe, so without it a link that fell to USB 2 under the frames would still read as the
        SuperSpeed of the last probe when the run of misses is blamed (:meth:`_miss_run_blame`)."""
        if self.cfg.dock.kind in ("cpu", "none") or now - self.link_look_ns < NS / self.cfg.timing.probe_hz:
            return
        self.link_look_ns = now
        self.looker.ask(LOOK_LINK)

    def _queued_behind(self, seq: int, now: int) -> str:
        """Why frame ``seq``'s miss only queued behind the worker's oldest unanswered request, still within the
        ceiling, or as that request could start only after a slower one (``node/watchdog.py``
        ``queued_behind``, the watchdog's own rule); "" when it counts."""
        return self.watchdog.queued(seq, now)

    def _transfer_errors(self) -> int:
        """The worker's failed transfer attempts so far (its control block; 0 without a worker)."""
        w = self.worker
        return w.transfer_errors() if w is not None and w.alive else 0

    def _host_late(self, now: int, dock_ms: float | None = None, elapsed_ms: float | None = None) -> str:
        """:func:`~chestnut.node.policy.host_excuse` at ``now``: the node's loop and the worker's timer over the
        last ``timing.host_window_ms`` and the CPU pressure (``node/hostload.py``) against the dock's own pace;
        "" when the host was on time, or late but the dock is slower than the camera while the node itself was not
        starved."""
        w = self.worker
        if w is not None and w.alive:
            self.host.worker_late(w.late_peak_ns(), now)
        th = self.host_thresholds
        if th.deadline_ms != self.deadline.ms:  # a late result's dock time is held against the deadline in force
            th = HostThresholds(th.late_ms, th.cpu_pressure_pct, self.deadline.ms)
        figures = self.host.figures(now, dock_ms, elapsed_ms)
        excuse = host_excuse(figures, self.dock_recent, self.frame_periods, th)
        if excuse.host:
            self.host_late_at_ns, self.host_late_reason = now, excuse.host
        if excuse.overruled and self.outpaced_log.due():
            log.warning("%s: deadline misses count against the dock although the %s", excuse.overruled,
                        host_late(figures, th))
        return excuse.host

    def _host_late_result(self, res: WorkerResult, now: int) -> HostJudge:
        """:meth:`_host_late` for a result arriving at ``now``, with the dock's own time for it (its stage
        times, when its runner times them) against the time since the worker could start it: its submission,
        or the previous result's receipt if that came later -- the worker runs one request at a time, so a
        request queued behind a slow run waited for the dock, not for the host. The figures are recorded now;
        the verdict is a function, judged once when first asked: only a late result needs it at once (the
        watchdog's), an on-time one after its frame's output is out (the adaptive deadline's hold)."""
        started = self.watchdog.started_ns(res.seq)
        if started is not None:
            started = max(started, self.result_at_ns)
        self.result_at_ns = now
        dock_ms = sum(res.stages.as_list()) * 1e3 if res.stages is not None else None
        if dock_ms is not None and res.error is None:
            self.dock_recent.append(dock_ms)
            assert res.stages is not None
            self.run_stages.append((res.stages.copy_in * 1e3, res.stages.compute * 1e3, res.stages.copy_out * 1e3))
        if dock_ms is not None and started is not None:  # what the host cost it: the frames behind it wait as long
            self.host.result_outside(now, now - started - int(dock_ms * 1e6))
        elapsed_ms = (now - started) / 1e6 if started is not None else None
        judged: list[str] = []

        def judge() -> str:
            if not judged:
                judged.append(self._host_late(now, dock_ms, elapsed_ms))
            return judged[0]
        return judge

    def _observe_latency(self, res: WorkerResult, elapsed_ns: int, host: HostJudge) -> None:
        """One primary result's latency (its frame's deadline base to its receipt, ``elapsed_ns``; late ones
        too) into the adaptive deadline's window, and the deadline for the next frame (``node/deadline.py``):
        held while the host is late (``host``, :meth:`_host_late_result`)."""
        if res.error is not None or elapsed_ns < 0:
            return
        self.latencies.append(elapsed_ns / 1e6)
        self.deadline = adaptive_deadline(self.latencies, self.deadline_rule, previous=self.deadline,
                                          host_late=bool(host()))
        if self.deadline_log.due(self.deadline.basis):  # what sets the deadline: at once when that changes
            log.info("primary %s", self.deadline.describe())

    def _after_output(self, work: Callable[[], object]) -> None:
        """``work`` that cannot change the frame's answer (the adaptive deadline's sample, health evidence with no
        ERROR in it: only an ERROR fails a layer over, ``node/policy.py`` ``is_primary_fault``): done right after the
        frame's ``modelOutput`` is sent, so the output does not wait for it (:meth:`_run_after_output`)."""
        self.after_output.append(work)

    def _run_after_output(self) -> None:
        """The work :meth:`_after_output` put off, in the order it came; before anything else reads its results."""
        while self.after_output:
            self.after_output.popleft()()

    def _host_miss(self, reason: str, now: int) -> None:
        """A deadline miss while the host was late: counted as the host's (``chestnutHealth.host``), logged
        at most every :data:`BAD_FRAME_LOG_PERIOD_S`; no evidence against a dock layer."""
        self.host_misses += 1
        self.host_last_late_ns = now
        self.host.last_figures_reason = reason.rpartition(HOST_LATE)[2] or reason
        if self.host_log.due():
            log.warning("deadline miss while the host was late, not counted against the dock: %s (%d so far)",
                        reason, self.host_misses)

    def _await_primary(self, w: WorkerHandle, frame_id: int, deadline_ns: int, deadline_ms: float,
                       compared: bool = False) -> PrimaryOutcome:
        """Wait for frame ``frame_id``'s result until its deadline (``deadline_ns``, CLOCK_MONOTONIC; the
        deadline in force ``deadline_ms`` after the frame's base). ``compared``: the result will be compared with
        the fallback's output (hot standby), which the warm-up before the busy wait then warms too."""
        sent_s = w.submitted_at(frame_id)
        sleep_s, spin_s = (warm_window(*busy_wait_window(time.monotonic() - sent_s, self.roundtrips))
                           if self.cpus_apart and sent_s is not None else (0.0, 0.0))
        while True:
            if not self._is_current(w) or self.draining:  # failed over on the way: the fallback answers now
                return PrimaryOutcome(None, False, self.sup.reason)
            now = time.monotonic_ns()
            res = None
            if w.alive:
                if spin_s and now + int((sleep_s + spin_s) * NS) < deadline_ns:
                    res = self._sleep_before_busy_wait(w, sleep_s)
                    if res is None:
                        self._warm_result_path(compared)
                        res = w.poll_result(timeout_s=max(0.0, (deadline_ns - time.monotonic_ns()) / NS), spin_s=spin_s)
                    spin_s = 0.0  # once per frame
                else:
                    res = w.poll_result(timeout_s=max(0.0, (deadline_ns - now) / NS))
            now = time.monotonic_ns()
            if res is not None and res.error is None:
                self.roundtrips.append(res.roundtrip_s)
            if res is None:
                if not w.alive:
                    self._check_worker_alive()
                    return PrimaryOutcome(None, False, f"primary worker exited ({describe_returncode(w.returncode)})")
                if now < deadline_ns:
                    continue
                self.host.loop_woke(deadline_ns, now)
                self._watchdog_actions(self.watchdog.check(now, self._host_late(now)))
                return PrimaryOutcome(None, True, no_result_reason(deadline_ms))
            if (res.error is None and res.seq == frame_id and self.sup.serving is Source.PRIMARY
                    and self.watchdog.in_time(res.seq, now)):
                # the serving primary's answer to this frame, in time: nothing else decides this frame's answer, so
                # the response's record (the watchdog's PASS, the host's figures, the deadline's sample) waits
                # until the output is out (Watchdog.in_time; _infer runs it first where a judgement could fail over)
                self._after_output(functools.partial(self._take_response, res, now))
                return PrimaryOutcome(res, False, "")
            verdict, host = self._record_response(res, now)
            self._after_output(functools.partial(self._observe_latency, res, verdict.elapsed_ns, host))
            if res.error is not None:
                self._on_primary_error(res)
            pairing = pair_response(res.seq, frame_id, res.error is not None, verdict.use_result)
            if pairing is Pairing.EARLIER:
                continue  # an earlier frame's late result (discarded by the watchdog's verdict) or failure
            if pairing is Pairing.FAILED:
                return PrimaryOutcome(res, False, f"primary failed: {res.error}")
            if pairing is Pairing.LATE:
                return PrimaryOutcome(None, True, late_result_reason(verdict.elapsed_ns / 1e6, deadline_ms))
            return PrimaryOutcome(res, False, "")

    def _record_response(self, res: WorkerResult, now: int) -> tuple[Verdict, HostJudge]:
        """A result received at ``now`` recorded: the host's figures for it (:meth:`_host_late_result`), the
        watchdog's response and its actions applied; returns the verdict and the host's judge."""
        host = self._host_late_result(res, now)
        verdict = self.watchdog.response(res.seq, now, host)
        if verdict.actions:
            self._watchdog_actions(list(verdict.actions))
        return verdict, host

    def _take_response(self, res: WorkerResult, now: int) -> None:
        """The record of a result :meth:`_await_primary` answered with at once (in time, by
        ``Watchdog.in_time``): :meth:`_record_response`, the adaptive deadline's sample. A verdict that does not
        let the result be used would be a watchdog bug, said at ERROR."""
        verdict, host = self._record_response(res, now)
        if verdict.actions or not verdict.use_result:
            log.error("frame %d: the watchdog's response disagrees with its in-time look (%s)", res.seq,
                      "; ".join(a.reason for a in verdict.actions) or "result not usable")
        self._observe_latency(res, verdict.elapsed_ns, host)

    def _warm_result_path(self, compared: bool) -> None:
        """The result's path run once, before the result comes (``node/policy.py`` ``WARM_LEAD_S``): the output
        checks on the last checked output (``StaleDetector.last_output``; without the stale check, which keeps
        state, and against itself as the reference when ``compared``) and the primary's template filled with it,
        their results dropped. Pure: nothing here changes what any frame is answered with. Skipped with no
        output checked yet for this worker, or one over :data:`~chestnut.node.policy.WARM_MAX_BYTES`."""
        held = self.stale.last_output
        if not held or sum(a.nbytes for a in held.values()) > WARM_MAX_BYTES:
            return
        check_outputs(held, self.contracts, reference=held if compared else None, reference_checked=True)
        tpl = self.output_template
        if tpl is not None and tpl.matches(held):
            tpl.warm(held)

    @staticmethod
    def _sleep_before_busy_wait(w: WorkerHandle, sleep_s: float) -> WorkerResult | None:
        """Sleep ``sleep_s`` (s) before the busy wait for a result: in ``poll`` for its whole milliseconds (a result
        that comes then wakes the node: returned), then in ``time.sleep`` for the rest (under 1 ms, the finer
        timer ``poll`` lacks; a result that comes then is seen right after)."""
        whole = int(sleep_s * 1000) / 1000
        res = w.poll_result(timeout_s=whole)
        if res is None and sleep_s > whole:
            time.sleep(sleep_s - whole)
        return res

    # ---------------------------------------------------------------- publishing

    def _output_builder(self) -> tuple[Any, Any]:
        """A ``modelOutput`` Event builder and its member, made after the previous output was sent
        (:meth:`_prepare_output`): a fresh builder's allocation and first touches cost more than the rest of the
        message at 20 Hz, where every frame finds the CPU's caches cold."""
        made, self.next_output = self.next_output, None
        if made is None:
            msg = new_message("modelOutput")
            return msg, msg.modelOutput
        made[0].logMonoTime = time.monotonic_ns()  # stamped when filled, as a new message would be
        return made

    def _ready_output_template(self, specs: tuple[TensorSpec, ...]) -> None:
        """The template of the primary's answer (``node/output_template.py``) for its model and the worker's
        output ``specs``, made once per worker between frames (:meth:`_housekeeping`: a few builds of the message,
        0.5 ms for the tiny model's 2 KB, ~4 ms at ``TEMPLATE_MAX_BYTES``); one it cannot be (a tensor of no
        bytes, outputs over that size) is said at DEBUG once, and such answers are built field by field."""
        tpl = self.output_template
        if tpl is not None and tpl.specs is specs and tpl.model_id == self.primary_model_id:
            return
        key = (self.primary_model_id, specs)
        if self.template_refused == key:
            return
        try:
            self.output_template = OutputTemplate(self.primary_model_id, specs)
        except TemplateError as e:
            self.output_template, self.template_refused = None, key
            log.debug("the primary's modelOutput is built field by field: %s", e)

    def _note_answer(self, model_id: str, reason: str, outputs: Mapping[str, np.ndarray]) -> None:
        """A valid answer of the fallback built field by field: counted towards its template (``STEADY_FRAMES``
        in a row the same, :meth:`_ready_answer_template`)."""
        key = (model_id, reason, tuple((n, a.shape, a.dtype.str) for n, a in outputs.items()))
        if key == self.answer_seen:
            self.answer_streak += 1
        else:
            self.answer_seen, self.answer_streak = key, 1

    def _ready_answer_template(self) -> None:
        """The template of the fallback's answer (``node/output_template.py``) once it has been the same for
        ``STEADY_FRAMES`` frames in a row (the node in one state: its reason, the supervisor's, is the same), made
        between frames from :meth:`_housekeeping`; one it cannot be is said at DEBUG once and not tried again."""
        seen = self.answer_seen
        if seen is None or self.answer_streak < STEADY_FRAMES or seen == self.answer_template_key:
            return
        model_id, reason, tensors = seen
        if tensors in self.answer_refused:
            return
        specs = tuple(TensorSpec(n, shape, np.dtype(dt).name) for n, shape, dt in tensors)
        try:
            self.answer_template = OutputTemplate(model_id, specs, Source.FALLBACK.value, reason)
        except TemplateError as e:
            self.answer_refused.add(tensors)
            log.debug("the fallback's modelOutput is built field by field: %s", e)
            return
        self.answer_template_key = seen

    def _prepare_output(self) -> None:
        """The next frame's ``modelOutput`` builder (:meth:`_output_builder`), made while no frame waits."""
        if self.next_output is None:
            msg = new_message("modelOutput")
            self.next_output = (msg, msg.modelOutput)

    def _publish_output(self, frame_id: int, cf: Any, r: FrameResult, clock: FrameClock, drop_perc: float) -> None:
        """Publish frame ``frame_id``'s ``modelOutput``: the primary's answer as it should be (valid, no reason,
        the template's tensors) from its template (:meth:`_ready_output_template`), the fallback's steady valid
        answer from its own (:meth:`_ready_answer_template`), any other built field by field; the bytes are the
        same either way."""
        a = r.answer
        source = a.source
        outputs = a.outputs or {}
        report = r.report
        # hot standby's figures: (agreementChecked, primaryAgrees, maxAbsDiff)
        agreement = ((True, report.primary_agrees, float(report.max_abs_diff))
                     if report is not None and report.agreement_checked else (False, False, 0.0))
        stages = published_stages(r)
        model_id = (self.primary_model_id if source is Source.PRIMARY else self.fallback.model_id
                    if source is Source.FALLBACK and self.fallback is not None else "")
        tpl = self.output_template if source is Source.PRIMARY else self.answer_template
        if (tpl is not None and a.valid and tpl.answers(source.value, model_id, a.reason)
                and tpl.matches(outputs)):
            now = time.monotonic_ns()
            try:
                data = tpl.fill((now, frame_id, float(a.exec_s), frame_age_s(clock, int(cf.timestampEof), now),
                                 float(drop_perc), r.deadline_missed, agreement[1], agreement[0], agreement[2],
                                 *stages.as_list(), float(r.deadline_ms) / 1e3), outputs)
            except (struct.error, OverflowError, ValueError):
                pass  # a value the field cannot hold as it is: the builder converts it as for any other answer
            else:
                self._sent_output(data)
                return
        msg, mo = self._output_builder()
        msg.valid = a.valid
        mo.source = source.value
        mo.frameId = frame_id
        mo.modelId = model_id
        outs = mo.init("outputs", len(outputs))
        for t, (name, arr) in zip(outs, outputs.items(), strict=True):
            c = np.asarray(arr)  # not ascontiguousarray: it makes a 0-d tensor 1-d
            t.name = name
            t.shape = list(c.shape)  # a numpy shape holds Python ints
            t.dtype = _dtype_name(c.dtype)
            t.data = c.tobytes()  # C order, whatever the strides
        # a fresh builder holds every default (0, false, ""): only what differs is set, each set costs at 20 Hz
        mo.executionTime = float(a.exec_s)
        mo.frameAge = frame_age_s(clock, int(cf.timestampEof), int(msg.logMonoTime))
        if drop_perc:
            mo.frameDropPerc = float(drop_perc)
        if r.deadline_missed:
            mo.deadlineMissed = True
        if r.deadline_ms:
            mo.deadline = float(r.deadline_ms) / 1e3
        if agreement[0]:
            mo.agreementChecked, mo.primaryAgrees, mo.maxAbsDiff = agreement
        if a.reason:
            mo.reason = a.reason
        if stages.copy_in or stages.copy_out:
            mo.copyInTime, mo.computeTime, mo.copyOutTime = stages.as_list()
        elif stages.compute:
            mo.computeTime = stages.compute
        self._sent_output(msg)
        if source is Source.FALLBACK and a.valid and outputs:
            self._note_answer(model_id, a.reason, outputs)

    def _sent_output(self, msg: Any) -> None:
        """Send a frame's ``modelOutput`` (a builder or its bytes), then give the CPU up once."""
        self.pm.send("modelOutput", msg)
        os.sched_yield()  # the bookkeeping after this waits (docs/architecture.md, "Hand-overs on the per-frame path")
        self.frames_out += 1

    def _publish_active(self, source: Source, valid: bool = True, output_reason: str = "",
                        host_frame: int | None = None, missed_frame: int | None = None) -> None:
        """``chestnutActive`` after a frame answered by ``source`` (``valid``: its output was valid, else
        ``output_reason`` says why), or between frames (``valid`` True: health decides alone). ``host_frame``:
        the frame the fallback answered because the primary's miss was the host's (docs/health.md "The host"):
        ``active`` is false as for any frame the primary did not answer, and its reason starts with
        ``host late`` so that a consumer can tell an overloaded host from a failing dock. ``missed_frame``: the
        frame the fallback answered after the primary missed its deadline; while single misses are all that
        clears ``active`` (no failover), the reason starts with ``deadline miss: `` (``mark_deadline_miss``)."""
        now = time.monotonic_ns()
        active, reason = chestnut_active(self.health, source)
        if host_frame is not None and not active:
            reason = f"{HOST_LATE}the fallback answered frame {host_frame} ({self.host.last_figures_reason})"
        if active and self.primary_timed and (unjudged := self.stage_budget.pending()):
            active, reason = False, unjudged  # the budget has not judged the primary's stages yet
        active, reason = active_as_published(
            *active_for_output(active, reason, valid, output_reason), self.health_published_ok
        )
        reason = mark_deadline_miss(active, reason, self.sup.serving is Source.PRIMARY, self.miss_warns,
                                    missed_frame, self.active.reason)
        self.active.update(active, reason, source, now)
        msg = new_message("chestnutActive")
        fill_active(msg.chestnutActive, self.active)
        self.pm.send("chestnutActive", msg)

    def _fill_host(self, builder: Any, now: int) -> None:
        """``ChestnutHealth.host``: WARN while the host is late by :func:`~chestnut.node.policy.host_late` (its
        reason), else OK; the figures, the misses blamed on the host and the last one's time. It is not a
        dock layer: it neither enters ``overall`` nor clears ``chestnutActive`` (docs/health.md)."""
        late = self._host_late(now)
        f = self.host.last_figures
        builder.level = "warn" if late else "ok"
        builder.reason = late or "host on time"
        builder.loopLateMs = f.loop_late_ms
        builder.workerLateMs = f.worker_late_ms
        builder.twinWaitMs = f.twin_wait_ms
        builder.cpuPressure = f.cpu_pressure_pct if f.cpu_pressure_pct is not None else float("nan")
        builder.lateMisses = min(self.host_misses, 2**32 - 1)
        builder.lastLate = self.host_last_late_ns

    def _publish_init_data(self) -> None:
        """``initData``: the node's versions and effective configuration, the header replay and the contract
        check read a log's settings from. Sent at start and every :data:`INIT_DATA_PERIOD_S` (a logger
        that starts later still records it)."""
        msg = new_message("initData")
        init = msg.initData
        vers = init.init("versions", len(self.versions))
        for kv, (k, v) in zip(vers, self.versions.items(), strict=True):
            kv.key, kv.value = k, v
        init.config = json.dumps({**self.cfg.to_json(),
                                  **({"contract": self.contract.to_json()} if self.contract is not None else {})})
        init.hostname = socket.gethostname()
        init.wallTimeNanos = time.time_ns()
        from chestnut.msgs.schema import SCHEMA_SHA256

        init.schemaHash = SCHEMA_SHA256
        ident = init.init("identity", len(self.identity))
        for kv, (k, v) in zip(ident, self.identity.items(), strict=True):
            kv.key, kv.value = k, v
        self.pm.send("initData", msg)

    def _publish_housekeeping(self, now: int) -> None:
        if now >= self.next_init_ns:
            self._publish_init_data()
            self.next_init_ns = now + int(INIT_DATA_PERIOD_S * NS)
        if now >= self.next_health_ns:
            self.health.refresh(now)
            msg = new_message("chestnutHealth")
            fill_health(msg.chestnutHealth, self.health)
            self._fill_host(msg.chestnutHealth.host, now)
            self.pm.send("chestnutHealth", msg)
            self.health_published_ok = all(layer_usable(s) for s in self.health.statuses())
            self.health.reported(now)
            # on a drift-free grid: counted from this send, every interval would add the loop's wake-up lag and
            # the rate fall below the 0.8 x health_hz a SubMaster's freq_ok allows; a stall skips whole periods
            period_ns = int(NS / self.cfg.timing.health_hz)
            self.next_health_ns += period_ns * max(1, (now - self.next_health_ns) // period_ns + 1)
        # ChestnutActive drops between frames too (a failover, a layer going STALE or ERROR): at once. It
        # rises only with a frame the primary served.
        if not self.starting and self.active.active and not chestnut_active(self.health, self.sup.serving)[0]:
            self._publish_active(self.sup.serving)
        if now >= self.next_state_ns or self.state_dirty:
            msg = new_message("nodeState")
            ns = msg.nodeState
            fill_node_state(ns, self.sup)
            ns.workerPid = (self.worker.pid or 0) if self.worker is not None else 0
            vers = ns.init("versions", len(self.versions))
            for kv, (k, v) in zip(vers, self.versions.items(), strict=True):
                kv.key, kv.value = k, v
            ident = ns.init("identity", len(self.identity))
            for kv, (k, v) in zip(ident, self.identity.items(), strict=True):
                kv.key, kv.value = k, v
            ns.standby = self.cfg.fallback.standby
            ns.dock = self.cfg.dock.kind
            ns.framesIn, ns.framesOut = self.frames_in, self.frames_out
            self.pm.send("nodeState", msg)
            self.next_state_ns = now + int(NS / self.cfg.timing.node_state_hz)
            self.state_dirty = False

    # ---------------------------------------------------------------- housekeeping

    def _check_camera(self) -> None:
        """A camera whose ring we map that stopped or died (``msgs/visionipc.py`` ``camera_gone``): its ring
        is unmapped at once, so its memory is freed and no frame of it is read again (a late message naming
        it is answered invalid: no camera serves that ring); the next ring frame maps the new camera's."""
        if self.frame_reader.camera_gone():
            self.cameras_gone += 1
            log.warning("camera gone: the frame ring of camera session %x is unmapped; its frames are no longer "
                        "read, the next camera's ring is mapped with its first frame (%d so far)",
                        self.ring_session or 0, self.cameras_gone)
            self.ring_session = None

    def _housekeeping(self) -> None:
        self._run_after_output()
        now = time.monotonic_ns()
        self._check_camera()
        self._poll_worker_start(now)
        self._check_worker_alive()
        w = self.worker
        if w is not None and w.alive:
            prog = w.progress()
            if prog.beats > self.worker_beats:
                self._watchdog_actions(self.watchdog.heartbeat(now, prog.beats - self.worker_beats))
                self.worker_beats = prog.beats
            # results of frames already answered (late ones, or a draining worker's): pair them for the
            # logical check; their errors are evidence
            while self._is_current(w) and (res := w.poll_result(0.0)) is not None:
                verdict, host = self._record_response(res, now)
                self._observe_latency(res, verdict.elapsed_ns, host)
                if res.error is not None:
                    self._on_primary_error(res)
            if self._is_current(w) and self.draining and not w.in_flight:
                self._kill_worker("drained after failing over")
            elif self._is_current(w) and not self.draining and self.worker_ready_seen and now >= self.next_probe_ns:
                probe = w.latest_probe
                if (self.cfg.dock.kind != "cpu" and probe is not None and probe.observation is not None
                        and probe.at_s > self.probe_seen_at_s):
                    self.probe_seen_at_s = probe.at_s
                    self._read_link(probe.observation.speed_mbps, now)
                    self._apply_health(self._excuse_slow_copies(evidence_from_observation(probe.observation), now),
                                       now)
                w.request_probe()
                self.next_probe_ns = now + int(NS / self.cfg.timing.probe_hz)
            elif self._is_current(w) and not self.worker_ready_seen and now >= self.next_probe_ns:
                # the worker is still qualifying or loading (seconds on a USB 2 link): the node's own enumeration
                # keeps the usb layer's link speed current (a USB 2 WARN settled from the first, not STALE)
                if self.cfg.dock.kind not in ("cpu", "none"):
                    self.looker.ask(LOOK_LINK)
                self.next_probe_ns = now + int(NS / self.cfg.timing.probe_hz)
        elif now >= self.next_probe_ns and self.sup.state in (State.DEGRADED, State.LOOKING):
            self.looker.ask(LOOK_ABSENT)
            self.next_probe_ns = now + int(NS / self.cfg.timing.probe_hz)
        self._take_looks(now)
        due = self.watchdog.next_check_ns()
        self._watchdog_actions(self.watchdog.check(now, self._host_late(now) if due is not None and now >= due else ""))
        if not self.draining and not self.stop_requested:  # a retry waits until the drained worker is gone (it
            self._perform_all(self.sup.tick(now))  # holds the dock); a stopping node retries nothing
        self._consumer(now)
        self._publish_housekeeping(time.monotonic_ns())
        self._prepare_output()
        if w is not None and self._is_current(w) and w.ready:
            self._ready_output_template(w.outputs)
        self._ready_answer_template()

    def _take_looks(self, now: int) -> None:
        """The node's finished looks at the dock (:class:`~chestnut.node.docklook.DockLooker`): the supervisor's
        retry (``dock_found`` / ``dock_absent``), the absent dock's ERROR while degraded, the link's speed while a
        worker qualifies."""
        retry, absent = self.looker.take(LOOK_RETRY), self.looker.take(LOOK_ABSENT)
        for gone in {id(x): x for x in (retry, absent) if x is not None and not x.present}.values():
            self._apply_health([Evidence(Layer.USB, Level.ERROR, gone.detail, hard=True, tag="absent")], now)
        link = self.looker.take(LOOK_LINK)
        if link is not None and link.observation is not None and self.worker is not None:
            self._read_link(link.observation.speed_mbps, now)
            if not self.worker_ready_seen:
                self._apply_health(evidence_from_observation(link.observation), now)
        if retry is not None:
            self._feed(Event.DOCK_FOUND if retry.present else Event.DOCK_ABSENT, retry.detail, Layer.USB)

    def _read_link(self, mbps: int | None, now: int) -> None:
        """The link's speed as a probe or the node's own look read it at ``now`` (None: not known): the current
        one (a run of misses' blame) and one more reading of the link's history (a start's stalled wait,
        :meth:`_stalled`)."""
        self.link_speed_mbps = mbps
        if mbps is not None:
            self.link_readings.append((now, mbps))

    def _excuse_slow_copies(self, evidence: list[Evidence], now: int) -> list[Evidence]:
        """A probe's copy-path usb WARN (slow copies or a slow fence) made advisory, with why, while
        :func:`~chestnut.node.policy.slow_copy_excuse` excuses it: a late host, or copies slow for too short a
        time to call the link marginal. It then shows in ``chestnutHealth`` but does not clear ``ChestnutActive``."""
        out = []
        for ev in evidence:
            if ev.source == "copy_path" and ev.level is Level.WARN:
                self.slow_copy_since_ns = self.slow_copy_since_ns if self.slow_copy_since_ns is not None else now
                why = slow_copy_excuse((now - self.slow_copy_since_ns) / NS, self._host_late_ago_s(now),
                                       self.host_late_reason)
                if why:
                    ev = dataclasses.replace(ev, advisory=True, reason=f"{ev.reason}; advisory: {why}")
            elif ev.source == "copy_path":
                self.slow_copy_since_ns = None
            out.append(ev)
        return out

    def _host_late_ago_s(self, now: int) -> float | None:
        """How long ago (s) the node last found the host late (:meth:`_host_late`); None: not since it started."""
        return (now - self.host_late_at_ns) / NS if self.host_late_at_ns is not None else None

    def _excuse_run_risk(self, evidence: list[Evidence], now: int) -> list[Evidence]:
        """The stage budget's "deadline at risk" WARNs made advisory, with why, while
        :func:`~chestnut.node.policy.run_risk_excuse` excuses them (the host was late within 3 s, and the runs have
        been at risk for under 10 s): shown in ``chestnutHealth``, ``ChestnutActive`` not cleared on the dock's
        account. An empty list (the budget not judging yet) leaves the streak as it was."""
        if not evidence:
            return evidence
        if not any(ev.tag == "deadline_at_risk" for ev in evidence):
            self.run_risk_since_ns = None
            return evidence
        self.run_risk_since_ns = self.run_risk_since_ns if self.run_risk_since_ns is not None else now
        why = run_risk_excuse((now - self.run_risk_since_ns) / NS, self._host_late_ago_s(now), self.host_late_reason)
        if not why:
            return evidence
        return [dataclasses.replace(ev, advisory=True, reason=f"{ev.reason}; advisory: {why}")
                if ev.tag == "deadline_at_risk" else ev for ev in evidence]

    def _is_current(self, w: WorkerHandle) -> bool:
        """``w`` is still the node's worker (a fault handled on the way may have replaced it)."""
        return self.worker is w

    def _consumer(self, now: int) -> None:
        """``controlState``: the consumer's last word stands for ``timing.consumer_timeout_s`` after it
        arrived (cereal's *alive*, 10 periods = 0.5 s at 20 Hz, is too short a silence to take as consent
        to switch under an engaged consumer); after that nobody is controlling."""
        self.sm.update(0)
        heard = self.sm.seen["controlState"] and now - self.sm.recv_time_ns["controlState"] <= int(
            self.cfg.timing.consumer_timeout_s * NS)
        if heard:
            cs = self.sm["controlState"]
            self._perform_all(self.sup.consumer(bool(cs.engaged), bool(cs.allowSourceSwitch), now))
        else:
            self._perform_all(self.sup.consumer(False, True, now))

    # ---------------------------------------------------------------- main loop

    def run(self) -> int:
        try:
            try:
                self.open()
                if (refused := self.declare_contract()) is not None:
                    self.starting = False
                    return refused
                if not self.warm_fallback():
                    self._publish_housekeeping(time.monotonic_ns())
                    return EXIT_NO_FALLBACK
            except _StopDuringStart:
                log.info("stopped during start-up")
                return EXIT_OK
            except Exception as e:  # refused while opening (a publisher busy, a runtime directory): said by the caller
                self.stop_reason = str(e).partition("\n")[0] or type(e).__name__
                self.stop_said = isinstance(e, START_REFUSALS)
                raise
            if self.stop_requested:  # a signal after the fallback was warm (or one deferred out of an import until
                log.info("stopped during start-up")  # then), before the loop: never ready, stopping
                return EXIT_OK
            self.subscribe_frames()
            self.collector.engage()  # from here on, Python's cycle collections only between frames
            self.answering = True
            self.notify.notify("READY=1")
            if self.cfg.dock.kind == "none":  # said once: the supervisor's retries are DEBUG (_log_transition)
                log.info("ready: answering %s from the fallback only: the dock is disabled (dock.kind = none), no "
                         "primary runs", self.cfg.timing.frame_service)
            else:
                log.info("ready: answering %s from the fallback while the primary qualifies",
                         self.cfg.timing.frame_service)
            while not self.stop_requested and self._turn():
                pass
        finally:
            self.close()
        return self.exit_code

    def _turn(self) -> bool:
        """One turn of the main loop: wait for a frame (at most :data:`LOOP_PERIOD_MS`, until the watchdog's next
        check or the pre-frame wake, whichever is first), then answer the frames that came, or, with none, send
        the pre-frame wake when due and nothing else, else do the housekeeping; then the service manager's
        watchdog notice, a due cycle collection and the next pre-frame wake. False when a stop was asked during
        the wait (the loop ends: :meth:`close` stops)."""
        nxt = self.watchdog.next_check_ns()
        now = time.monotonic_ns()
        timeout_ms = LOOP_PERIOD_MS if nxt is None else max(0, min(LOOP_PERIOD_MS, (nxt - now) // 1_000_000))
        if self.prewake_ns:  # its whole milliseconds (the poll's unit): up to one early
            timeout_ms = max(0, min(timeout_ms, (self.prewake_ns - now) // 1_000_000))
        asked_ns = now + timeout_ms * 1_000_000
        answered = False
        ready = dict(self.poller.poll(timeout_ms))
        if self.stop_requested:  # a signal during the poll: nothing more of this turn, close() stops
            return False
        received_ns = time.monotonic_ns()
        if ready:
            for cf, valid, sent_ns in self._frames_woken(ready):
                if self.stop_requested:
                    break
                if not self.frame_reader.first_sight(cf):
                    continue  # the bus's copy of a frame its ring notice brought: no WAKE, no answer
                if not answered and needs_wake(self.worker_woken_ns, time.monotonic_ns()):  # no pre-frame
                    self._wake_worker()  # WAKE for it: the worker's wake-up overlaps the frame's
                    # preprocessing instead of following the RUN (Msg.WAKE)
                self.on_frame(cf, valid, sent_ns)
                answered = True
                if not self.stop_requested:
                    self._housekeeping()  # between two queued frames too: results, the watchdog, health
        else:
            self.host.loop_woke(asked_ns, received_ns)
            if self._prewake(received_ns):  # the next frame is due: the WAKE alone, nothing to delay it
                return True
        if not answered and not self.stop_requested:  # a turn that answered a frame has just done it
            self._housekeeping()
        self.notify.watchdog()
        self.collector.collect_due()  # the frames of this turn are answered; the next one is not here yet
        if answered:  # the next frame's pre-frame wake, from this turn's receipt
            self.prewake_ns = prewake_at(received_ns, self.frame_periods) if self._wakes_worker() else 0
        return True

    def _wakes_worker(self) -> bool:
        """Whether a frame now would likely go to the primary's worker and that worker is worth a WAKE: one runs
        the primary, and it can run on another CPU than the node (``cpus_apart``: on one CPU the node, a priority
        above its worker, would hold the woken worker off until the RUN anyway)."""
        return self.worker is not None and self.cpus_apart and self.sup.runs_primary

    def _wake_worker(self) -> None:
        """A WAKE for the worker (``WorkerHandle.wake``) when :meth:`_wakes_worker`; when it went out is kept for
        :func:`~chestnut.node.policy.needs_wake`."""
        w = self.worker
        if w is not None and self._wakes_worker() and w.wake():
            self.worker_woken_ns = time.monotonic_ns()

    def _prewake(self, now: int) -> bool:
        """The pre-frame wake (``node/policy.py`` ``prewake_at``): woken at ``now`` (CLOCK_MONOTONIC ns) with
        no frame, within a millisecond of :attr:`prewake_ns` (the poll's timeout has whole milliseconds: up to
        one early), the node WAKEs the worker, once per frame; the frame's receipt then sends none
        (``needs_wake``) unless it came late. No sleep for the rest of that millisecond: a frame that came
        meanwhile would wait for it. Returns whether this was that wake (the loop then goes back to waiting for
        the frame at once: housekeeping and collections wait until the frame is answered)."""
        at = self.prewake_ns
        if not at or now < at - 1_000_000:
            return False
        self.prewake_ns = 0
        self._wake_worker()
        return True

    def _frames_woken(self, ready: dict[Any, int]) -> Iterator[tuple[Any, bool, int]]:
        """The frames of one wake-up (``ready``: the poll's result), oldest first: the bus's ``cameraFrame``
        readers, then the ring's notices. The bus first: a frame queued there may be older than the first notice
        (its own notice went out before the ring was mapped); a notice of a frame taken already is skipped by
        the caller. Woken by a notice alone, the bus (and its connection monitor) has nothing: not asked. Each
        bus frame is received when the caller asks for it (:func:`~chestnut.msgs.messaging.iter_events`), so
        the empty queue's receive and the socket's heal come after the frame before it was answered. Each comes
        with its message's ``valid`` and ``logMonoTime`` (a notice's frame: True and 0, unknown)."""
        if not self.frame_reader.only_notices(ready):
            for ev in iter_events(self.frames):
                yield ev.cameraFrame, ev.valid, ev.logMonoTime
        for notice in self.frame_reader.notices():  # the camera's own record in its own pipe: no flag
            yield notice, True, 0

    def request_stop(self, signum: int, frame: FrameType | None = None) -> None:
        """From the SIGINT/SIGTERM handler (``frame``: the one it interrupted): the loop stops at its next turn,
        during start-up at once, or as soon as no import runs (:func:`_stop_deferred`); from here on the node
        starts no new work (a frame, a retry, a look, a worker), only :meth:`close`'s stop sequence. Logged once
        at INFO; a signal while already stopping (a terminal or ``timeout`` signals the process and its group, a
        stop asked twice) only at DEBUG."""
        if self.stop_requested and not self.stop_pending:
            log.debug("signal %d: already stopping", signum)
            return
        if not self.stop_requested:
            log.info("signal %d: stopping", signum)
            self.stop_requested = True
        self.stop_pending = False
        if self.starting:
            if _stop_deferred(signum, frame, lambda: self.stop_pending):
                self.stop_pending = True
                return
            self.starting = False  # raise once: close() must run undisturbed
            raise _StopDuringStart()

    def _publish_stopping(self) -> None:
        """``chestnutActive`` false (source none) and ``nodeState`` stopping now, and ``chestnutHealth`` when due."""
        self.state_dirty = True
        if self.answering:
            self._publish_active(Source.NONE)
        self._publish_housekeeping(time.monotonic_ns())

    def close(self) -> None:
        """The stop sequence: STOPPING=1; ``chestnutActive`` false and ``nodeState`` stopping published at
        once; the worker stopped and reaped (ask, terminate, kill; within :data:`WORKER_STOP_BUDGET_S`) while
        ``chestnutHealth`` and ``nodeState`` go on at their rates (a worker slow to stop, e.g. one busy
        qualifying, never silences them: ``chestnut check``'s ``health_not_silent``); then a final
        ``chestnutActive``, ``chestnutHealth`` and ``nodeState`` stopping, the node's last word."""
        self.starting = False
        self.collector.release()  # the stop sequence's garbage collected as any program's
        self.notify.notify("STOPPING=1")
        self._feed(Event.STOP, self.stop_reason)
        self.looker.close()
        if not hasattr(self, "sm"):  # stopped (or failed) before the sockets were all open
            for sock in ("pm", "frames"):
                if hasattr(self, sock):
                    getattr(self, sock).close()
            self.notify.close()
            return
        self._publish_stopping()
        if self.worker is not None:
            w, self.worker = self.worker, None
            self.draining = False
            report = w.stop(WORKER_STOP_BUDGET_S, while_waiting=lambda: self._publish_housekeeping(time.monotonic_ns()))
            log.info("worker pid %s stopped: %s", w.pid, report.describe())
        self.next_health_ns = min(self.next_health_ns, time.monotonic_ns())  # a final health, whenever it is due
        self._publish_stopping()
        self.pm.close()
        if hasattr(self, "frames"):  # subscribed once the fallback was warm
            self.frames.close(linger=0)
        self.sm.close()
        self.notify.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    node_config.add_arguments(p)


def apply_realtime(cfg: NodeConfig) -> bool:
    """The node's ``[realtime]`` scheduling for this process, every thread it has and those it starts later
    (``node/realtime.py``): one INFO line when granted, one WARNING line when the system refuses it (the
    node runs on as it was). True when granted."""
    from chestnut.node.realtime import config_realtime_process

    rt = cfg.realtime
    ok, line = config_realtime_process(rt.policy, rt.priority, rt.cpus, "node", all_threads=True)
    log.log(logging.INFO if ok else logging.WARNING, "%s", line)
    return ok


def run(args: argparse.Namespace) -> int:
    """``chestnut run``. Exit codes: :data:`EXIT_OK` after SIGINT/SIGTERM (from here on, start-up included:
    the handlers are installed before the configuration is read), :data:`EXIT_CONFIG`, :data:`EXIT_NO_FALLBACK`."""
    nodes: list[Node] = []
    deferred: list[int] = []  # a stop before the node existed, deferred out of an import (:func:`_stop_deferred`)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if nodes:
            nodes[0].request_stop(signum, frame)
            return
        if not deferred:
            log.info("signal %d: stopping", signum)
        deferred[:] = [signum]
        if _stop_deferred(signum, frame, lambda: bool(deferred) and not nodes):
            return
        deferred.clear()
        raise _StopDuringStart()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        try:
            cfg = node_config.from_args(args)
            node = Node(cfg)
        except ConfigError as e:
            log.error("unusable configuration: %s", e)
            return EXIT_CONFIG
        nodes.append(node)
        if deferred:  # asked while an import ran, before the node existed: the stop is raised here, outside it
            node.stop_requested = True
            raise _StopDuringStart()
        runtime_dir(node.prefix)  # a runtime directory that must not be used: its one line, before scheduling's
        apply_realtime(cfg)
    except _StopDuringStart:
        if nodes:
            nodes[0].close()
        log.info("stopped during start-up")
        return EXIT_OK
    return node.run()


def main(argv: list[str] | None = None) -> int:
    """Entry point for process managers (openpilot-style ``PythonProcess``): ``chestnut run``'s options,
    with ``--config`` from ``$CHESTNUT_CONFIG`` when it is set and ``argv`` has none. Logs at INFO to
    stderr; a runtime directory that must not be used, a malformed ``$CHESTNUT_PREFIX`` or a service
    another live process already publishes is one line on stderr and exit code 2."""
    p = argparse.ArgumentParser(prog="chestnut run", description="run the supervised inference node")
    add_arguments(p)
    argv = sys.argv[1:] if argv is None else list(argv)
    if os.environ.get("CHESTNUT_CONFIG") and "--config" not in argv:
        argv += ["--config", os.environ["CHESTNUT_CONFIG"]]
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except START_REFUSALS as e:
        print(f"chestnut run: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
