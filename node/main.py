"""``chestnut run``: the supervised inference node (openpilot modeld's shape).

One process, one single-threaded main loop that reads top to bottom. Per camera frame:

1. preprocess the frame (``node.preprocess``); a frame that cannot be used is answered with an
   invalid ``modelOutput`` that says why, so every frame still gets exactly one output;
2. if the primary runs (active, or in shadow during recovery), hand the frame to the primary worker
   (shared memory + a command packet) and start its deadline;
3. run the fallback on the host CPU when it must answer, or on every frame in hot standby;
4. wait for the primary's result until the per-frame deadline (150 ms); a late or missing result
   is answered by the fallback at the deadline and the late result is discarded (watchdog);
5. check the primary's output (finite, shape/dtype, range, stale, agreement with the fallback);
6. publish ``modelOutput`` from the source that serves, and ``chestnutActive``.

Between frames: the watchdog's periodic check (a worker silent 3000 ms + margin after a request is
killed), heartbeat (alive) supervision, worker start/exit, the supervisor's timers, ``controlState``
(a return to the primary waits for the consumer), health at 5 Hz, ``nodeState`` at 1 Hz and on
every transition, a dock probe at 1 Hz, and ``WATCHDOG=1`` to systemd from this loop only.

The node never imports tinygrad's dock path: the primary lives in the worker process
(``node.worker``). The fallback (onnxruntime by default) is warm before ``READY=1``; without a usable
fallback the node exits with :data:`EXIT_NO_FALLBACK`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np
import zmq

from chestnut.backend.errors import ChestnutError, ConfigError, Layer, ModelError
from chestnut.backend.interface import ModelSpec, StepResult
from chestnut.backend.protocol import USB_IDS
from chestnut.fallback.standby import FallbackModel
from chestnut.launch.camerad import frame_to_array
from chestnut.msgs.messaging import PubMaster, SubMaster, drain_sock, new_message, sub_sock
from chestnut.node import config as node_config
from chestnut.node.config import NodeConfig
from chestnut.node.framedrop import FrameDropFilter
from chestnut.node.health import (
    ActiveFlag,
    Evidence,
    HealthMonitor,
    Level,
    chestnut_active,
    evidence_from_error,
    evidence_from_ladder,
    evidence_from_observation,
    evidence_from_run,
    evidence_from_validity,
    evidence_from_watchdog,
    fill_active,
    fill_health,
)
from chestnut.node.preprocess import preprocess
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
from chestnut.node.validity import StaleDetector, ValidityReport, check_outputs, contracts_from_specs, fingerprint
from chestnut.node.watchdog import ActionKind, RequestKind, Watchdog, WatchdogAction, WatchdogConfig
from chestnut.node.worker import RunnerSpec, WorkerHandle, WorkerResult, describe_returncode

log = logging.getLogger("chestnut.node")

EXIT_OK = 0
EXIT_NO_FALLBACK = 3          # the node cannot serve at all: no usable fallback model
EXIT_CONFIG = 2               # the configuration is unusable
NS = 1_000_000_000
LOOP_PERIOD_MS = 50           # longest the loop sleeps without a frame (20 Hz housekeeping)
STOP_BUDGET_S = 5.0           # the process manager's stop budget


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("chestnut", "tinygrad", "pycapnp", "pyzmq", "onnxruntime", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


class SdNotify:
    """systemd's notify protocol (``sd_notify``) over ``$NOTIFY_SOCKET``; a no-op when it is unset."""

    def __init__(self) -> None:
        addr = os.environ.get("NOTIFY_SOCKET", "")
        self.sock: socket.socket | None = None
        if addr:
            self.addr = "\0" + addr[1:] if addr.startswith("@") else addr
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def notify(self, state: str) -> None:
        if self.sock is not None:
            try:
                self.sock.sendto(state.encode(), self.addr)
            except OSError as e:
                log.warning("sd_notify %s failed: %s", state, e)


def look_for_dock(kind: str, prefix: str | None = None) -> tuple[bool, str]:
    """A cheap look for the dock without claiming it: (present, detail). A fresh enumeration every call."""
    if kind == "cpu":
        return True, "primary on the host CPU"
    if kind == "none":
        return False, "dock disabled (dock.kind = none)"
    try:
        import usb.core

        backend = None
        if kind == "twin":
            from chestnut.backend.sim.pyusb_backend import twin_backend

            backend = twin_backend(prefix, cached=False)
        for vid, pid in USB_IDS:
            dev = usb.core.find(idVendor=vid, idProduct=pid, backend=backend)
            if dev is not None:
                return True, f"{vid:04x}:{pid:04x} at bus {dev.bus} address {dev.address}"
        return False, "no Chestnut dock enumerated"
    except Exception as e:  # pyusb/libusb/twin-socket errors: the dock cannot be seen
        return False, f"no Chestnut dock found ({type(e).__name__}: {e})"


@dataclass
class FrameResult:
    outputs: dict[str, np.ndarray] | None
    source: Source
    exec_s: float
    reason: str
    deadline_missed: bool = False
    report: ValidityReport | None = None


class Node:
    """The node's state and its main loop (:meth:`run`)."""

    def __init__(self, cfg: NodeConfig, prefix: str | None = None) -> None:
        self.cfg = cfg
        self.prefix = prefix
        self.stop_requested = False
        self.exit_code = EXIT_OK
        now = time.monotonic_ns()
        self.spec_in = ModelSpec(cfg.model.path, cfg.model.name, {cfg.model.input: tuple(cfg.model.shape)},
                                 self._read_fingerprint())
        self.fallback: FallbackModel | None = None
        self.health = HealthMonitor()
        self.watchdog = Watchdog(WatchdogConfig(frame_deadline_ms=cfg.timing.deadline_ms,
                                                wait_timeout_ms=cfg.dock.wait_timeout_ms))
        self.sup = Supervisor(now, SupervisorConfig(shadow_frames=cfg.timing.shadow_frames),
                              on_transition=self._log_transition)
        self.active = ActiveFlag(now)
        self.framedrop = FrameDropFilter()
        self.stale = StaleDetector()
        self.contracts: tuple[Any, ...] = ()
        self.worker: WorkerHandle | None = None
        self.worker_beats = 0
        self.pending_events: deque[tuple[Event, str, Layer | None]] = deque()
        self.last_frame_id: int | None = None
        self.frames_in = self.frames_out = 0
        self.bad_frames = 0
        self.next_health_ns = self.next_state_ns = self.next_probe_ns = now
        self.state_dirty = True
        self.notify = SdNotify()
        self.versions = _versions()

    # ---------------------------------------------------------------- set-up

    def _read_fingerprint(self) -> dict[str, Any] | None:
        path = self.cfg.fingerprint_path
        if not path.is_file():
            return None
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise ConfigError("fingerprint", f"{path} is unreadable: {e}") from e

    def open(self) -> None:
        self.pm = PubMaster(["modelOutput", "chestnutActive", "chestnutHealth", "nodeState"], prefix=self.prefix)
        self.frames = sub_sock(self.cfg.timing.frame_service, prefix=self.prefix)
        self.sm = SubMaster(["controlState"], prefix=self.prefix)
        self.poller = zmq.Poller()
        self.poller.register(self.frames, zmq.POLLIN)

    def warm_fallback(self) -> bool:
        """Load and warm the fallback (it answers frames from now on). False when it cannot serve."""
        fb = self.cfg.fallback
        try:
            t0 = time.monotonic()
            self.fallback = FallbackModel(self.cfg.fallback_path, fb.engine, name=f"{self.cfg.model.name}-fallback",
                                          input_shapes={self.cfg.model.input: tuple(self.cfg.model.shape)},
                                          threads=fb.threads)
            last = self.fallback.warm()
        except ChestnutError as e:
            log.error("no usable fallback model: %s", e)
            self._feed(Event.FALLBACK_FAILED, str(e))
            return False
        self.contracts = contracts_from_specs(self.fallback.outputs,
                                              {k: v for k, v in self.cfg.model.ranges.items()
                                               if k in {s.name for s in self.fallback.outputs}},
                                              self.cfg.timing.agreement_tol)
        log.info("fallback %s (%s, %s standby) warm in %.2f s, %.1f ms per frame", self.fallback.model_id,
                 fb.engine, fb.standby, time.monotonic() - t0, last * 1e3)
        self._feed(Event.FALLBACK_READY, f"fallback {fb.engine} warm")
        return True

    # ---------------------------------------------------------------- supervisor glue

    def _log_transition(self, t: Transition) -> None:
        log.warning("%s -> %s on %s: %s", t.from_state.value, t.to_state.value, t.event.value, t.reason)
        self.state_dirty = True

    def _feed(self, event: Event, reason: str = "", layer: Layer | None = None) -> None:
        self.pending_events.append((event, reason, layer))
        self._drain_events()

    def _drain_events(self) -> None:
        while self.pending_events:
            event, reason, layer = self.pending_events.popleft()
            for t in self.sup.handle(event, time.monotonic_ns(), reason, layer):
                self._perform(t)

    def _perform_all(self, transitions: list[Transition]) -> None:
        for t in transitions:
            self._perform(t)
        self._drain_events()

    def _perform(self, t: Transition) -> None:
        if t.action is Action.SPAWN_WORKER:
            self._start_worker()
        elif t.action is Action.BACK_OFF:
            self._kill_worker(t.reason)
        elif t.action is Action.LOOK_FOR_DOCK:
            present, detail = look_for_dock(self.cfg.dock.kind, self.prefix)
            if not present:
                self.health.apply([Evidence(Layer.USB, Level.ERROR, detail, hard=True, tag="absent")],
                                  time.monotonic_ns())
            self.pending_events.append((Event.DOCK_FOUND if present else Event.DOCK_ABSENT, detail, Layer.USB))
        elif t.action in (Action.STOP, Action.ABORT):
            self.stop_requested = True
            if t.action is Action.ABORT:
                self.exit_code = EXIT_NO_FALLBACK
        elif t.action is Action.START_SHADOW:
            self.stale.reset()

    def _start_worker(self) -> None:
        self._kill_worker("replacing the worker")
        if self.cfg.dock.kind == "none":
            self.pending_events.append((Event.DOCK_ABSENT, "dock disabled (dock.kind = none)", Layer.USB))
            return
        from chestnut.backend.ladder import LadderConfig

        options: dict[str, Any] = dict(self.cfg.dock.options)
        if self.cfg.dock.kind in ("twin", "real"):
            options.setdefault("wait_timeout_ms", int(self.cfg.dock.wait_timeout_ms))
        if self.cfg.dock.kind == "twin" and self.prefix is not None:
            options.setdefault("prefix", self.prefix)
        spec = RunnerSpec(self.cfg.dock.kind, options)
        ladder = LadderConfig(wait_timeout_ms=int(self.cfg.dock.wait_timeout_ms),
                              require_fingerprint=self.spec_in.fingerprint is not None)
        self.worker = WorkerHandle()
        self.worker_beats = 0
        try:
            self.worker.start(spec, self.spec_in, ladder)
        except ChestnutError as e:
            self.pending_events.append((Event.QUALIFY_FAILED, str(e), e.layer))
        self.state_dirty = True

    def _kill_worker(self, why: str) -> None:
        if self.worker is None:
            return
        w, self.worker = self.worker, None
        if w.alive:
            log.info("killing worker %s: %s", w.pid, why)
        w.kill()
        w.stop(0.5)
        self._watchdog_actions(self.watchdog.worker_stopped(time.monotonic_ns()))
        self.state_dirty = True

    def _poll_worker_start(self) -> None:
        w = self.worker
        if w is None or w.ready:
            return
        try:
            ready = w.poll_ready()
        except ChestnutError as e:
            now = time.monotonic_ns()
            if w.ladder is not None:
                self.health.apply(evidence_from_ladder(w.ladder), now)
            elif (ev := evidence_from_error(e)) is not None:
                self.health.apply([ev], now)
            failed = w.ladder.first_failure if w.ladder is not None else None
            if failed is not None and failed.name == "usb_ids":
                event = Event.DOCK_ABSENT
            elif failed is not None and failed.name in ("model_loaded", "warmup") or isinstance(e, ModelError):
                event = Event.LOAD_FAILED
            else:
                event = Event.QUALIFY_FAILED
            self._feed(event, str(e), e.layer)
            return
        if ready:
            now = time.monotonic_ns()
            if w.ladder is not None:
                self.health.apply(evidence_from_ladder(w.ladder), now)
                steps = ", ".join(f"{s.name} {s.duration_s * 1e3:.0f} ms" for s in w.ladder.steps
                                  if s.result in (StepResult.PASS, StepResult.WARN))
                log.info("worker %s qualified and loaded: %s", w.pid, steps)
            self._watchdog_actions(self.watchdog.worker_started(now))
            self._feed(Event.QUALIFIED, "qualification ladder passed")
            self._feed(Event.LOADED, "model loaded; warm-up matched its fingerprint"
                       if self.spec_in.fingerprint else "model loaded")

    def _check_worker_alive(self) -> None:
        w = self.worker
        if w is None or w.alive:
            return
        how = describe_returncode(w.returncode)
        now = time.monotonic_ns()
        self.health.apply([Evidence(Layer.GPU, Level.ERROR, f"primary worker exited ({how})", hard=True,
                                    tag="worker_died")], now)
        self._watchdog_actions(self.watchdog.worker_stopped(now))
        self._kill_worker("it exited")
        self._feed(Event.WORKER_DIED, f"primary worker exited ({how})", Layer.GPU)

    def _watchdog_actions(self, actions: list[WatchdogAction]) -> set[int]:
        """Apply watchdog actions; returns the frame seqs that must be answered from the fallback."""
        answer: set[int] = set()
        now = time.monotonic_ns()
        for a in actions:
            ev = evidence_from_watchdog(a)
            if ev is not None:
                self._apply_health([ev], now)
            if a.kind is ActionKind.ANSWER_FROM_FALLBACK and a.seq is not None:
                answer.add(a.seq)
            elif a.kind is ActionKind.KILL_WORKER:
                log.error("watchdog: %s", a.reason)
                self._kill_worker(a.reason)
                self._feed(Event.WORKER_DIED, a.reason, a.layer)
            elif a.kind is ActionKind.FAIL_OVER:
                self._feed(Event.DEADLINE_MISS_RUN, a.reason, Layer.GPU)
        return answer

    def _apply_health(self, evidence: list[Evidence], now: int) -> None:
        changes = self.health.apply(evidence, now)
        for c in changes:
            if c.new is Level.ERROR and self.sup.wants_worker:
                self._feed(Event.PRIMARY_FAULT, self.health.status(c.layer).reason, c.layer)

    # ---------------------------------------------------------------- one frame

    def on_frame(self, event: Any) -> None:
        cf = event.cameraFrame
        frame_id = int(cf.frameId)
        if self.last_frame_id is not None and frame_id <= self.last_frame_id:
            self.bad_frames += 1
            log.error("cameraFrame %d after %d: frame ids must increase; frame dropped", frame_id, self.last_frame_id)
            return
        self.last_frame_id = frame_id
        self.frames_in += 1
        drop_perc = self.framedrop.update(frame_id)
        try:
            img = frame_to_array(cf)
            inputs = preprocess(self.cfg.model.preprocess, img, self.cfg.model.input, tuple(self.cfg.model.shape))
        except (ValueError, KeyError) as e:
            self.bad_frames += 1
            log.error("cameraFrame %d unusable: %s", frame_id, e)
            self._publish_output(frame_id, cf, FrameResult(None, Source.NONE, 0.0, f"bad frame: {e}"), drop_perc,
                                 valid=False)
            return
        result = self._infer(frame_id, inputs)
        self._publish_output(frame_id, cf, result, drop_perc, valid=True)
        self._publish_active(result.source)

    def _infer(self, frame_id: int, inputs: dict[str, np.ndarray]) -> FrameResult:
        assert self.fallback is not None
        w = self.worker
        submitted = False
        if self.sup.runs_primary and w is not None and w.ready and w.alive:
            try:
                if w.can_submit:
                    w.submit(frame_id, inputs)
                    self._watchdog_actions(self.watchdog.request(frame_id, time.monotonic_ns(), RequestKind.FRAME))
                    submitted = True
            except ChestnutError as e:
                log.error("submit of frame %d failed: %s", frame_id, e)
        fb_out: dict[str, np.ndarray] | None = None
        fb_exec = 0.0
        if self.cfg.fallback.standby == "hot" or self.sup.serving is not Source.PRIMARY or not submitted:
            t0 = time.perf_counter()
            fb_out = self.fallback.run(inputs)
            fb_exec = time.perf_counter() - t0
        primary: WorkerResult | None = None
        late = False
        answer_fb: set[int] = set()
        if submitted and w is not None:
            primary, late, answer_fb = self._await_primary(w, frame_id)
        report = None
        p_out = primary.outputs if primary is not None and primary.ok else None
        if p_out is not None:
            now = time.monotonic_ns()
            in_fp = fingerprint(inputs)
            report = check_outputs(p_out, self.contracts, input_fp=in_fp, stale=self.stale, reference=fb_out)
            self._apply_health(evidence_from_run(primary.exec_time_s * 1e3) + [evidence_from_validity(report)], now)
            if self.sup.state in (State.SHADOWING, State.AWAITING_SWITCH):
                self._perform_all(self.sup.shadow(report.ok, now, report.reason))
        serve_primary = (self.sup.serving is Source.PRIMARY and p_out is not None and report is not None
                         and report.ok and frame_id not in answer_fb)
        if serve_primary:
            assert primary is not None
            return FrameResult(p_out, Source.PRIMARY, primary.exec_time_s, "", report=report)
        if fb_out is None:
            t0 = time.perf_counter()
            fb_out = self.fallback.run(inputs)
            fb_exec = time.perf_counter() - t0
        reason = self.sup.reason if self.sup.serving is not Source.PRIMARY else (
            "primary missed the deadline" if late or frame_id in answer_fb else
            f"primary output invalid: {report.reason}" if report is not None and not report.ok else
            f"primary failed: {primary.error}" if primary is not None and primary.error is not None else
            "primary unavailable")
        return FrameResult(fb_out, Source.FALLBACK, fb_exec, reason, deadline_missed=late or frame_id in answer_fb,
                           report=report)

    def _await_primary(self, w: WorkerHandle, frame_id: int) -> tuple[WorkerResult | None, bool, set[int]]:
        """Wait for frame ``frame_id``'s result until its deadline; returns (result, missed, fallback seqs)."""
        deadline_ns = time.monotonic_ns() + int(self.cfg.timing.deadline_ms * 1e6)
        answer: set[int] = set()
        while True:
            now = time.monotonic_ns()
            timeout_s = max(0.0, (deadline_ns - now) / NS)
            res = w.poll_result(timeout_s=timeout_s) if w.alive else None
            now = time.monotonic_ns()
            if res is None:
                if not w.alive or now >= deadline_ns:
                    answer |= self._watchdog_actions(self.watchdog.check(now))
                    if not w.alive:
                        self._check_worker_alive()
                    return None, True, answer | {frame_id}
                continue
            verdict = self.watchdog.response(res.seq, now)
            answer |= self._watchdog_actions(list(verdict.actions))
            if res.error is not None:
                log.error("primary run of frame %d failed: %s", res.seq, res.error)
                ev = evidence_from_error(res.error) if isinstance(res.error, ChestnutError) else None
                if ev is not None:
                    self._apply_health([ev], now)
                else:
                    self._feed(Event.PRIMARY_FAULT, str(res.error), Layer.GPU)
                if res.seq == frame_id:
                    return res, False, answer
                continue
            if res.seq != frame_id:
                continue  # a late result of an earlier frame: discarded by the watchdog's verdict
            if not verdict.use_result:
                return None, True, answer | {frame_id}
            return res, False, answer

    # ---------------------------------------------------------------- publishing

    def _publish_output(self, frame_id: int, cf: Any, r: FrameResult, drop_perc: float, valid: bool) -> None:
        msg = new_message("modelOutput", valid=valid)
        mo = msg.modelOutput
        mo.frameId = frame_id
        mo.source = r.source.value
        assert self.fallback is not None
        mo.modelId = (self.fallback.model_id if r.source is Source.FALLBACK
                      else self._primary_model_id() if r.source is Source.PRIMARY else "")
        outs = mo.init("outputs", len(r.outputs or {}))
        for t, (name, arr) in zip(outs, (r.outputs or {}).items(), strict=True):
            a = np.ascontiguousarray(arr)
            t.name = name
            shape = t.init("shape", a.ndim)
            for i, d in enumerate(a.shape):
                shape[i] = int(d)
            t.dtype = a.dtype.name
            t.data = a.tobytes()
        mo.executionTime = float(r.exec_s)
        mo.frameAge = max(0.0, (msg.logMonoTime - int(cf.timestampEof)) / NS)
        mo.frameDropPerc = float(drop_perc)
        mo.deadlineMissed = r.deadline_missed
        if r.report is not None:
            mo.agreementChecked = r.report.agreement_checked
            mo.primaryAgrees = r.report.primary_agrees
            mo.maxAbsDiff = float(r.report.max_abs_diff)
        mo.reason = r.reason
        self.pm.send("modelOutput", msg)
        self.frames_out += 1

    def _primary_model_id(self) -> str:
        from chestnut.fallback.model import model_id

        if not hasattr(self, "_pid_cache"):
            self._pid_cache = model_id(self.cfg.model.name, self.cfg.model.path.read_bytes())
        return self._pid_cache

    def _publish_active(self, source: Source) -> None:
        now = time.monotonic_ns()
        active, reason = chestnut_active(self.health, source)
        self.active.update(active, reason, source, now)
        msg = new_message("chestnutActive")
        fill_active(msg.chestnutActive, self.active)
        self.pm.send("chestnutActive", msg)

    def _publish_housekeeping(self, now: int) -> None:
        if now >= self.next_health_ns:
            for c in self.health.refresh(now):
                if c.new is Level.ERROR and self.sup.wants_worker:
                    self._feed(Event.PRIMARY_FAULT, self.health.status(c.layer).reason, c.layer)
            msg = new_message("chestnutHealth")
            fill_health(msg.chestnutHealth, self.health)
            self.pm.send("chestnutHealth", msg)
            self.next_health_ns = now + int(NS / self.cfg.timing.health_hz)
            # ChestnutActive also changes between frames (a layer going STALE or ERROR): publish at once
            active, reason = chestnut_active(self.health, self.sup.serving)
            if active != self.active.active:
                self._publish_active(self.sup.serving)
        if now >= self.next_state_ns or self.state_dirty:
            msg = new_message("nodeState")
            ns = msg.nodeState
            fill_node_state(ns, self.sup)
            ns.workerPid = (self.worker.pid or 0) if self.worker is not None else 0
            vers = ns.init("versions", len(self.versions))
            for kv, (k, v) in zip(vers, self.versions.items(), strict=True):
                kv.key, kv.value = k, v
            ns.standby = self.cfg.fallback.standby
            ns.dock = self.cfg.dock.kind
            ns.framesIn, ns.framesOut = self.frames_in, self.frames_out
            self.pm.send("nodeState", msg)
            self.next_state_ns = now + int(NS / self.cfg.timing.node_state_hz)
            self.state_dirty = False

    # ---------------------------------------------------------------- housekeeping

    def _housekeeping(self) -> None:
        now = time.monotonic_ns()
        self._poll_worker_start()
        self._check_worker_alive()
        w = self.worker
        if w is not None and w.alive:
            prog = w.progress()
            if prog.beats > self.worker_beats:
                self._watchdog_actions(self.watchdog.heartbeat(now, prog.beats - self.worker_beats))
                self.worker_beats = prog.beats
            # drain results of frames already answered (late ones); pair them for the logical check
            while (res := w.poll_result(0.0)) is not None:
                self._watchdog_actions(list(self.watchdog.response(res.seq, now).actions))
            if w.ready and now >= self.next_probe_ns:
                if (self.cfg.dock.kind != "cpu" and w.latest_probe is not None
                        and w.latest_probe.observation is not None):
                    self._apply_health(evidence_from_observation(w.latest_probe.observation), now)
                w.request_probe()
                self.next_probe_ns = now + int(NS / self.cfg.timing.probe_hz)
        elif now >= self.next_probe_ns and self.sup.state in (State.DEGRADED, State.LOOKING):
            present, detail = look_for_dock(self.cfg.dock.kind, self.prefix)
            if not present:
                self._apply_health([Evidence(Layer.USB, Level.ERROR, detail, hard=True, tag="absent")], now)
            self.next_probe_ns = now + int(NS / self.cfg.timing.probe_hz)
        self._watchdog_actions(self.watchdog.check(now))
        self._perform_all(self.sup.tick(now))
        self.sm.update(0)
        if self.sm.alive["controlState"]:
            cs = self.sm["controlState"]
            self._perform_all(self.sup.consumer(bool(cs.engaged), bool(cs.allowSourceSwitch), now))
        else:
            self._perform_all(self.sup.consumer(False, True, now))
        self._publish_housekeeping(time.monotonic_ns())

    # ---------------------------------------------------------------- main loop

    def run(self) -> int:
        self.open()
        try:
            if not self.warm_fallback():
                self._publish_housekeeping(time.monotonic_ns())
                return EXIT_NO_FALLBACK
            self.notify.notify("READY=1")
            log.info("ready: answering %s from the fallback while the primary qualifies", self.cfg.timing.frame_service)
            while not self.stop_requested:
                nxt = self.watchdog.next_check_ns()
                timeout_ms = LOOP_PERIOD_MS if nxt is None else max(0, min(LOOP_PERIOD_MS,
                                                                            (nxt - time.monotonic_ns()) // 1_000_000))
                if self.poller.poll(timeout_ms):
                    for ev in drain_sock(self.frames):
                        self.on_frame(ev)
                        self._housekeeping()
                self._housekeeping()
                self.notify.notify("WATCHDOG=1")
        finally:
            self.close()
        return self.exit_code

    def request_stop(self) -> None:
        self.stop_requested = True

    def close(self) -> None:
        self.notify.notify("STOPPING=1")
        self._feed(Event.STOP, "stop requested")
        if self.worker is not None:
            w, self.worker = self.worker, None
            report = w.stop(STOP_BUDGET_S - 1.0)
            log.info("worker stopped: %s", report)
        self._publish_housekeeping(time.monotonic_ns())
        self.pm.close()
        self.frames.close(linger=0)
        self.sm.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    node_config.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = node_config.from_args(args)
    except ConfigError as e:
        log.error("%s", e)
        return EXIT_CONFIG
    node = Node(cfg)

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        node.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return node.run()


def main() -> int:
    """Entry point for process managers (openpilot-style ``PythonProcess``): config from ``$CHESTNUT_CONFIG``."""
    from chestnut.launch.cli import main as cli_main

    argv = ["run"]
    if os.environ.get("CHESTNUT_CONFIG"):
        argv += ["--config", os.environ["CHESTNUT_CONFIG"]]
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
