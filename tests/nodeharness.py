"""Driving a real ``chestnut run`` node from a test or a benchmark.

- :func:`write_node_config`: a node TOML for the tiny test model (or any model);
- :func:`record_fingerprint`: ``chestnut probe --record-fingerprint`` in a child process;
- :class:`NodeProcess`: ``python -m chestnut.launch.cli run --config ...`` as a child, with its log,
  its process tree (psutil) and the SIGTERM stop sequence;
- :class:`Bus`: a thread that plays camera (``cameraFrame``, noise images at ``rate_hz``) and control
  daemon (``controlState``) and records everything the node publishes (``modelOutput``,
  ``chestnutActive``, ``chestnutHealth``, ``nodeState``) as plain records stamped with the
  publisher's ``logMonoTime`` (ns, CLOCK_MONOTONIC: the same clock as ``time.monotonic_ns()`` here).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import zmq

from chestnut.launch.camerad import fill_frame
from chestnut.msgs.messaging import PubMaster, drain_sock, new_message, sub_sock

NODE_SERVICES = ("modelOutput", "chestnutActive", "chestnutHealth", "nodeState")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str | Path):
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def write_node_config(path: Path, model: Path, *, fingerprint: Path | None = None, dock: str = "twin",
                      standby: str = "hot", fallback_model: Path | None = None, shape: tuple[int, ...] = (1, 3, 32, 64),
                      preprocess: str = "unit", ranges: dict[str, tuple[float, float]] | None = None,
                      timing: dict[str, Any] | None = None, dock_extra: dict[str, Any] | None = None,
                      fallback_extra: dict[str, Any] | None = None) -> Path:
    """A node TOML: the tiny model's contract by default (``x`` [1,3,32,64] -> ``prob`` in [0, 1])."""
    lines = ["[model]", f"path = {_toml_value(model)}", 'name = "tiny"', 'input = "x"',
             f"shape = {_toml_value(list(shape))}", f"preprocess = {_toml_value(preprocess)}"]
    if fingerprint is not None:
        lines.append(f"fingerprint = {_toml_value(fingerprint)}")
    lines += ["", "[model.ranges]"]
    ranges = ranges if ranges is not None else {"prob": (0.0, 1.0)}
    lines += [f"{k} = {_toml_value(list(v))}" for k, v in ranges.items()]
    lines += ["", "[fallback]", 'engine = "onnxruntime"', f"standby = {_toml_value(standby)}"]
    if fallback_model is not None:
        lines.append(f"path = {_toml_value(fallback_model)}")
    lines += [f"{k} = {_toml_value(v)}" for k, v in (fallback_extra or {}).items()]
    lines += ["", "[dock]", f"kind = {_toml_value(dock)}"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in (dock_extra or {}).items()]
    lines += ["", "[timing]"] + [f"{k} = {_toml_value(v)}" for k, v in (timing or {}).items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def record_fingerprint(model: Path, out: Path, timeout_s: float = 120.0) -> Path:
    """``chestnut probe --twin --model M --record-fingerprint OUT`` (the host CPU; no twin needed)."""
    proc = subprocess.run([sys.executable, "-m", "chestnut.launch.cli", "probe", "--twin", "--model", str(model),
                           "--record-fingerprint", str(out)], capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"recording the fingerprint failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return out


def tiny_8x16_twin_config(tmp_path: Path) -> Path:
    """A node config for a twin primary running an 8x16 tiny model (with its fingerprint), a 1000 ms deadline
    and a 60 s start budget: its 1.5 KB input and 128 B output are below the copy timer's rated size
    (4096 bytes), so the usb layer's reason is the stage budget's alone."""
    from tinymodel import make_tiny_onnx

    model = make_tiny_onnx(tmp_path / "tiny8x16.onnx", 8, 16)
    fp = record_fingerprint(model, tmp_path / "tiny8x16.fingerprint.json")
    return write_node_config(tmp_path / "node.toml", model, fingerprint=fp, shape=(1, 3, 8, 16),
                             timing={"deadline_ms": 1000.0, "start_timeout_s": 60.0})


def exit_of(cfg: Path, log_path: Path, timeout_s: float = 60.0) -> tuple[int, str]:
    """Run ``chestnut run --config cfg`` on ``$CHESTNUT_PREFIX`` until it exits by itself (a refused start):
    (its exit code, the tail of its log at ``log_path``); killed afterwards whatever happened. Raises
    ``subprocess.TimeoutExpired`` when it is still running after ``timeout_s``."""
    node = NodeProcess(cfg, os.environ["CHESTNUT_PREFIX"], log_path).start()
    try:
        assert node.proc is not None
        rc = node.proc.wait(timeout_s)
    finally:
        node.kill()
    return rc, node.log_tail()


class NodeProcess:
    """``chestnut run --config CONFIG`` as a child process of this one, logging to ``log_path``."""

    def __init__(self, config: Path, prefix: str, log_path: Path, env: dict[str, str] | None = None,
                 python_args: tuple[str, ...] = ()) -> None:
        """``python_args`` go to the interpreter before ``-m chestnut.launch.cli`` (e.g. a profiler's ``-m cProfile
        -o FILE``)."""
        self.config, self.prefix, self.log_path = config, prefix, log_path
        self.env = {**os.environ, "CHESTNUT_PREFIX": prefix, **(env or {})}
        self.python_args = python_args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> NodeProcess:
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen([sys.executable, *self.python_args, "-m", "chestnut.launch.cli", "run",
                                          "--config", str(self.config)], env=self.env, stdout=logf,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def log_tail(self, nbytes: int = 6000) -> str:
        try:
            return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> tuple[int | None, float]:
        """Send ``sig`` and wait; returns (exit code, seconds to exit). Kills after ``timeout_s``."""
        assert self.proc is not None
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None, time.monotonic() - t0
        return self.proc.returncode, time.monotonic() - t0

    def kill(self) -> None:
        """SIGKILL the node and every descendant still there (test clean-up)."""
        if self.proc is None:
            return
        rest = self.descendants()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        for p in rest:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(rest, timeout=5)


@dataclass(frozen=True)
class Out:
    frame_id: int
    source: str
    valid: bool
    deadline_missed: bool
    reason: str
    agreement_checked: bool
    primary_agrees: bool
    exec_s: float
    mono_ns: int
    recv_ns: int
    tensors: dict[str, np.ndarray] | None = None  # with Bus(record_tensors=True)
    frame_age_s: float = 0.0
    deadline_s: float = 0.0  # modelOutput.deadline: the primary's deadline in force for the frame (0: not asked)


@dataclass(frozen=True)
class Active:
    active: bool
    source: str
    reason: str
    mono_ns: int


@dataclass(frozen=True)
class Health:
    layers: dict[str, tuple[str, str]]  # layer -> (level, reason)
    mono_ns: int
    host_late_misses: int = 0  # chestnutHealth.host.lateMisses: deadline misses blamed on the host so far


@dataclass(frozen=True)
class NodeStateRec:
    state: str
    worker_pid: int
    reason: str
    restarts: int
    mono_ns: int


@dataclass
class Records:
    outputs: list[Out] = field(default_factory=list)
    active: list[Active] = field(default_factory=list)
    health: list[Health] = field(default_factory=list)
    states: list[NodeStateRec] = field(default_factory=list)
    sent: dict[int, int] = field(default_factory=dict)  # frame id -> send time (ns)


class Bus(threading.Thread):
    """Camera + control daemon + recorder for one node (see the module docstring). Thread-safe reads via
    :meth:`snapshot`; settings (``engaged``, ``allow_switch``, ``control``, ``publishing``) may be set
    from the test thread at any time. Frames are uint8 noise of ``height`` x ``width`` (every frame
    differs, so the node's stale check can see a frozen output); ``frame_fn(frame_id)`` overrides: it
    returns an image, or a whole ``cameraFrame`` Event builder (e.g. a malformed one). ``between``: another
    running bus at the same rate; this one's frames go out half a period after each of its frames (a bench
    measuring two processes side by side without their frames meeting). ``grid_s``: the CLOCK_MONOTONIC time
    (s) of the first frame; every later one is a whole number of periods after it, unless a tick runs late."""

    def __init__(self, prefix: str, height: int = 32, width: int = 64, rate_hz: float = 20.0,
                 frame_fn: Callable[[int], Any] | None = None, seed: int = 0, record_tensors: bool = False,
                 between: Bus | None = None) -> None:
        super().__init__(name="node-bus", daemon=True)
        self.prefix, self.height, self.width = prefix, height, width
        self.period_s = 1.0 / rate_hz
        self.frame_fn = frame_fn
        self.record_tensors = record_tensors
        self.rng = np.random.default_rng(seed)
        self.engaged = False
        self.allow_switch = True
        self.control = False
        self.publishing = True
        self.next_frame_id = 0
        self.grid_s = time.monotonic()
        if between is not None:
            ahead = (self.grid_s - between.grid_s) / self.period_s
            self.grid_s = between.grid_s + (math.floor(ahead) + 1.5) * self.period_s
        self._lock = threading.Lock()
        self._rec = Records()
        self._stop_evt = threading.Event()
        self._started = threading.Event()
        self.error: BaseException | None = None

    def start(self) -> None:
        super().start()
        self._started.wait(10)

    def snapshot(self) -> Records:
        with self._lock:
            r = self._rec
            return Records(list(r.outputs), list(r.active), list(r.health), list(r.states), dict(r.sent))

    def close(self) -> None:
        self._stop_evt.set()
        self.join(10)

    def wait_for(self, pred: Callable[[Records], Any], timeout_s: float, what: str = "") -> Any:
        """Poll ``pred(snapshot)`` until it returns something truthy; raises AssertionError on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = pred(self.snapshot())
            if got:
                return got
            if self.error is not None:
                raise AssertionError(f"the bus thread failed: {self.error!r}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what or pred}")
            time.sleep(0.02)

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # reported to the test through wait_for
            self.error = e
            self._started.set()

    def _run(self) -> None:
        pm = PubMaster(["cameraFrame", "controlState"], prefix=self.prefix)
        poller = zmq.Poller()
        socks = {s: sub_sock(s, poller, prefix=self.prefix) for s in NODE_SERVICES}
        self._started.set()
        next_s = self.grid_s
        try:
            while not self._stop_evt.is_set():
                now = time.monotonic()
                if now >= next_s:
                    self._tick(pm)
                    # on the grid: a late tick is not made up for, the next frame is the next grid point's
                    next_s += self.period_s * (math.floor((now - next_s) / self.period_s) + 1)
                poller.poll(max(0, int((next_s - time.monotonic()) * 1000)))
                recv_ns = time.monotonic_ns()  # receipt: before decoding (the recorder's own cost)
                for service, sock in socks.items():
                    events = drain_sock(sock)
                    if events:
                        self._record(service, events, recv_ns)
        finally:
            for sock in socks.values():
                sock.close(linger=0)
            pm.close()

    def _tick(self, pm: PubMaster) -> None:
        if self.publishing:
            fid = self.next_frame_id
            made = (self.frame_fn(fid) if self.frame_fn is not None
                    else self.rng.integers(0, 256, (self.height, self.width, 3), dtype=np.uint8))
            now = time.monotonic_ns()
            pm.send("cameraFrame", fill_frame(fid, made, now, now, "nodeharness") if isinstance(made, np.ndarray)
                    else made)
            with self._lock:
                self._rec.sent[fid] = now
            self.next_frame_id = fid + 1
        if self.control:
            msg = new_message("controlState")
            cs = msg.controlState
            cs.engaged = self.engaged
            cs.allowSourceSwitch = self.allow_switch
            cs.canEngage = True
            pm.send("controlState", msg)

    def _record(self, service: str, events: list[Any], recv: int) -> None:
        recs: list[Any] = []
        for ev in events:
            t = int(ev.logMonoTime)
            if service == "modelOutput":
                m = ev.modelOutput
                tensors = ({str(x.name): np.frombuffer(x.data, dtype=str(x.dtype)).reshape(tuple(x.shape)).copy()
                            for x in m.outputs} if self.record_tensors else None)
                recs.append(Out(int(m.frameId), str(m.source), bool(ev.valid), bool(m.deadlineMissed), str(m.reason),
                                bool(m.agreementChecked), bool(m.primaryAgrees), float(m.executionTime), t, recv,
                                tensors, float(m.frameAge), float(m.deadline)))
            elif service == "chestnutActive":
                a = ev.chestnutActive
                recs.append(Active(bool(a.active), str(a.source), str(a.reason), t))
            elif service == "chestnutHealth":
                h = ev.chestnutHealth
                recs.append(Health({str(la.layer): (str(la.level), str(la.reason)) for la in h.layers}, t,
                                   int(h.host.lateMisses)))
            else:
                n = ev.nodeState
                recs.append(NodeStateRec(str(n.state), int(n.workerPid), str(n.reason), int(n.restarts), t))
        with self._lock:
            {"modelOutput": self._rec.outputs, "chestnutActive": self._rec.active, "chestnutHealth": self._rec.health,
             "nodeState": self._rec.states}[service].extend(recs)


def unanswered_frames(rec: Records, last_id: int | None = None) -> tuple[list[int], list[int]]:
    """(frames sent without an output, frames with more than one output), over the sent ids from the first
    answered one up to ``last_id`` (default: the last sent)."""
    if not rec.outputs:
        return sorted(rec.sent), []
    counts: dict[int, int] = {}
    for o in rec.outputs:
        counts[o.frame_id] = counts.get(o.frame_id, 0) + 1
    first = min(counts)
    last = max(rec.sent) if last_id is None else last_id
    missing = [f for f in sorted(rec.sent) if first <= f <= last and f not in counts]
    doubled = sorted(f for f, n in counts.items() if n != 1)
    return missing, doubled


@contextlib.contextmanager
def running_node(cfg: Path, log_path: Path, frame_fn: Callable[[int], Any] | None = None, *,
                 env: dict[str, str] | None = None,
                 record_tensors: bool = False) -> Iterator[tuple[NodeProcess, Bus]]:
    """A :class:`Bus` (camera frames from ``frame_fn``, see :class:`Bus`; ``record_tensors`` as there) and
    ``chestnut run --config cfg`` on ``$CHESTNUT_PREFIX`` (``env``: more environment for it, see
    :class:`NodeProcess`), logging to ``log_path``; on the way out the bus is closed, the node killed and the
    prefix's runtime directory removed."""
    from chestnut.msgs.paths import runtime_dir

    prefix = os.environ["CHESTNUT_PREFIX"]
    bus = Bus(prefix, frame_fn=frame_fn, record_tensors=record_tensors)
    bus.start()
    node = NodeProcess(cfg, prefix, log_path, env=env).start()
    try:
        yield node, bus
    finally:
        bus.close()
        node.kill()
        shutil.rmtree(runtime_dir(prefix), ignore_errors=True)
