"""A synthetic but correct drive, for replay and contract tests: real model outputs, exact timing, then doctored.

:func:`build_drive` plays the node's part at 20 Hz over 9 s (180 frames) and returns its messages as
``(logMonoTime ns, service, Event bytes)``; every output tensor is produced by actually running the
model (primary: tinygrad ``OnnxModel``; fallback: onnxruntime ``FallbackModel``, hot standby).

============  ==========  =====================================================================
frames        served by   what happens
============  ==========  =====================================================================
0-59          primary     active; control engages at frame 20
60            fallback    the worker dies: gpu ERROR; the output is followed by chestnutActive
                          false and nodeState degraded, each with its reason
61-119        fallback    degraded; control soft-disables and exits at frame 120 (3.0 s)
120-139       fallback    recovering; gpu OK again from frame 125; shadow frames
140           primary     shadow agreed after frame 139, consumer allows: nodeState active;
                          chestnutActive true with the first primary output
141-179       primary     active; control re-engages at frame 160
============  ==========  =====================================================================

Per frame, in the node's order (``node/main.py``): ``cameraFrame`` (EOF 1 ms before it),
``modelOutput`` 4 ms after the frame, ``chestnutActive`` 1 ms later, then the housekeeping: a
``nodeState`` on a transition, ``controlState``, ``chestnutHealth`` on every 4th frame (5 Hz) and
a periodic ``nodeState`` on every 20th (1 Hz).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from chestnut.msgs.logfile import RouteWriter
from chestnut.msgs.messaging import log_from_bytes, new_message
from chestnut.msgs.schema import log

FRAME_PERIOD_NS = 50_000_000
N_FRAMES = 180
FAULT_FRAME, RECOVER_FRAME, GPU_OK_FRAME, RETURN_FRAME = 60, 120, 125, 140
ENGAGE_FRAMES = (20, 160)
DISENGAGE_FRAME = 120
HEIGHT, WIDTH = 32, 64
MS = 1_000_000

Item = tuple[int, str, bytes]


def node_config(model_path: Path) -> dict[str, Any]:
    from chestnut.node.config import NodeConfig

    cfg = NodeConfig()
    cfg.model.path = Path(model_path)
    cfg.model.name = "tiny"
    cfg.model.input = "x"
    cfg.model.shape = (1, 3, HEIGHT, WIDTH)
    cfg.model.ranges = {"prob": (0.0, 1.0)}
    return cfg.to_json()


def frames(n: int = N_FRAMES, seed: int = 7) -> list[np.ndarray]:
    """uint8 [HEIGHT, WIDTH, 3] BGR frames: a moving gradient with seeded noise (every frame differs)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:HEIGHT, 0:WIDTH]
    out = []
    for i in range(n):
        base = ((xx * 4 + yy * 2 + i * 3) % 256)[..., None] + np.array([0, 40, 80])
        out.append(((base + rng.integers(0, 30, base.shape)) % 256).astype(np.uint8))
    return out


Outputs = list[dict[str, np.ndarray]]


@functools.cache
def model_outputs(model_path: str, n: int = N_FRAMES) -> tuple[Outputs, Outputs]:
    """(primary outputs, fallback outputs) for every frame of :func:`frames`, computed once per process."""
    from chestnut.backend.model import OnnxModel
    from chestnut.fallback.standby import FallbackModel
    from chestnut.node.preprocess import preprocess

    primary = OnnxModel(Path(model_path), name="tiny", input_shapes={"x": (1, 3, HEIGHT, WIDTH)})
    fallback = FallbackModel(Path(model_path), "onnxruntime", input_shapes={"x": (1, 3, HEIGHT, WIDTH)})
    p_out, f_out = [], []
    for img in frames(n):
        x = preprocess("ppocr", img, "x", (1, 3, HEIGHT, WIDTH))
        p_out.append(primary.run(x))
        f_out.append(fallback.run(x))
    return p_out, f_out


def _msg(service: str, t_ns: int) -> Any:
    m = new_message(service)
    m.logMonoTime = t_ns
    return m


def _fill_tensors(builder: Any, outputs: dict[str, np.ndarray]) -> None:
    ts = builder.init("outputs", len(outputs))
    for t, (name, arr) in zip(ts, sorted(outputs.items()), strict=True):
        t.name = name
        t.shape = list(arr.shape)
        t.dtype = arr.dtype.name
        t.data = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


def build_drive(model_path: Path, base_ns: int = 10_000 * 1_000_000_000, n: int = N_FRAMES) -> list[Item]:
    """The drive's messages in time order (see the module table)."""
    from chestnut.backend.model import model_id
    from chestnut.node.validity import compare_tensors

    p_out, f_out = model_outputs(str(model_path), n)
    mid = model_id("tiny", Path(model_path).read_bytes())
    fb_mid = model_id("tiny-fallback", Path(model_path).read_bytes())  # the node names its fallback so
    imgs = frames(n)
    items: list[Item] = []

    def put(m: Any) -> None:
        items.append((m.logMonoTime, m.which(), m.to_bytes()))

    state = {"node": "starting", "active": False, "since": base_ns, "gpu": ("ok", "fences advancing", base_ns),
             "engaged": False}

    def node_state(t: int, st: str, reason: str) -> None:
        state["node"] = st
        m = _msg("nodeState", t)
        m.nodeState.state = st
        m.nodeState.reason = reason
        m.nodeState.since = t
        m.nodeState.workerPid = 4242 if st in ("active", "recovering") else 0
        m.nodeState.standby = "hot"
        m.nodeState.dock = "twin"
        put(m)

    def active(t: int, on: bool, source: str, reason: str) -> None:
        if on != state["active"]:
            state["since"] = t
        state["active"] = on
        m = _msg("chestnutActive", t)
        a = m.chestnutActive
        a.active, a.source, a.reason, a.since = on, source, reason, state["since"]
        put(m)

    def health(t: int) -> None:
        m = _msg("chestnutHealth", t)
        layers = m.chestnutHealth.init("layers", 4)
        for entry, name in zip(layers, ("usb", "pcie", "gpu", "output"), strict=True):
            level, reason, changed = state["gpu"] if name == "gpu" else ("ok", "ok", base_ns)
            entry.layer, entry.level, entry.reason, entry.lastChange, entry.lastEvidence = name, level, reason, \
                changed, t
        m.chestnutHealth.overall = state["gpu"][0]
        put(m)

    init = _msg("initData", base_ns + 1 * MS)
    init.initData.config = json.dumps(node_config(model_path), sort_keys=True)
    put(init)
    for i, st in enumerate(("starting", "qualifying", "loading", "active")):
        node_state(base_ns + (2 + i) * MS, st, f"{st}: start-up step {i}")
    health(base_ns + 7 * MS)
    active(base_ns + 8 * MS, True, "primary", "all layers OK")

    for i in range(n):
        t = base_ns + (i + 1) * FRAME_PERIOD_NS
        cam = _msg("cameraFrame", t)
        cf = cam.cameraFrame
        cf.frameId, cf.timestampEof, cf.timestampSof = i, t - 1 * MS, t - 11 * MS
        cf.width, cf.height, cf.encoding, cf.sourceName = WIDTH, HEIGHT, "bgr888", "synthetic"
        cf.data = imgs[i].tobytes()
        put(cam)
        if i == FAULT_FRAME:
            state["gpu"] = ("error", "worker died (exit -9)", t + 2 * MS)
        elif i == GPU_OK_FRAME:
            state["gpu"] = ("ok", "fences advancing", t + 2 * MS)
        serving = "fallback" if FAULT_FRAME <= i < RETURN_FRAME else "primary"
        out = _msg("modelOutput", t + 4 * MS)
        mo = out.modelOutput
        mo.frameId, mo.source, mo.modelId = i, serving, mid if serving == "primary" else fb_mid
        _fill_tensors(mo, p_out[i] if serving == "primary" else f_out[i])
        mo.executionTime = 0.002
        mo.frameAge = 0.005
        primary_ran = serving == "primary" or i >= RECOVER_FRAME
        if primary_ran:
            c = compare_tensors(p_out[i]["prob"], f_out[i]["prob"], 1e-3)
            mo.agreementChecked, mo.primaryAgrees, mo.maxAbsDiff = True, c.ok, c.max_abs_diff
        mo.reason = "" if serving == "primary" else "fallback serving: worker died (exit -9)"
        put(out)
        on = serving == "primary" and state["gpu"][0] == "ok"
        active(t + 5 * MS, on, serving, "all layers OK" if on else (
            f"gpu ERROR: {state['gpu'][1]}" if state["gpu"][0] != "ok" else "fallback serving, not the primary"))
        # housekeeping after the frame: transitions, control, health, periodic node state
        if i == FAULT_FRAME:
            node_state(t + 6 * MS, "degraded", "primary_fault: worker died (exit -9)")
        elif i == RECOVER_FRAME:
            node_state(t + 6 * MS, "recovering", "retry_due: re-qualifying the dock")
        elif i == RETURN_FRAME - 1:
            node_state(t + 6 * MS, "active", "shadow_agreed: 20 shadow frames agreed; consumer allows the switch")
        if i in ENGAGE_FRAMES:
            state["engaged"] = True
        if i == DISENGAGE_FRAME:
            state["engaged"] = False
        ctl = _msg("controlState", t + 7 * MS)
        cs = ctl.controlState
        cs.engaged = state["engaged"]
        cs.canEngage = bool(state["active"])
        cs.softDisabling = state["engaged"] and not state["active"]
        if cs.softDisabling:
            cs.softDisableRemaining = max(0.0, 3.0 - (t - (base_ns + (FAULT_FRAME + 1) * FRAME_PERIOD_NS)) / 1e9)
        cs.allowSourceSwitch = not state["engaged"]
        put(ctl)
        if i % 4 == 0:
            health(t + 8 * MS)
        if i % 20 == 0:
            node_state(t + 9 * MS, state["node"], f"periodic: {state['node']}")
    items.sort(key=lambda it: it[0])
    return items


# ---------------------------------------------------------------- writing


@contextlib.contextmanager
def _clock_at(now: list[int]) -> Iterator[None]:
    """``time.monotonic_ns`` reads ``now[0]`` (the segment headers are stamped with the drive's clock)."""
    with mock.patch("time.monotonic_ns", lambda: now[0]):
        yield


def write_drive(items: list[Item], log_dir: Path, segment_seconds: float = 3.0,
                formats: tuple[str, ...] = ("zst",)) -> list[Path]:
    """Write ``items`` as the logger would (segments by the drive's own clock); returns segment dirs."""
    now = [items[0][0] - 1 * MS]
    with _clock_at(now):
        w = RouteWriter(log_dir, formats=formats, segment_seconds=segment_seconds, clock=lambda: now[0] / 1e9,
                        config={"services": ["cameraFrame", "modelOutput"]}, route="2026-01-01--00-00-00")
        with w:
            for t, service, data in items:
                now[0] = t
                w.write(service, t, data)
    return sorted(p for p in Path(log_dir).iterdir() if p.is_dir())


# ---------------------------------------------------------------- doctoring


def _edit(items: list[Item], pick: Callable[[int, str, Any], bool], change: Callable[[Any], None],
          expect: int = 1) -> list[Item]:
    out, hits = [], 0
    for t, service, data in items:
        if pick(t, service, log_from_bytes(data)):
            hits += 1
            with log.Event.from_bytes(data) as reader:
                b = reader.as_builder()
            change(b)
            data = b.to_bytes()
            t = b.logMonoTime
        out.append((t, service, data))
    if hits != expect:
        raise AssertionError(f"doctoring matched {hits} messages, expected {expect}")
    out.sort(key=lambda it: it[0])
    return out


def output_time(items: list[Item], frame_id: int) -> int:
    return next(t for t, s, d in items if s == "modelOutput" and log_from_bytes(d).modelOutput.frameId == frame_id)


def drop_output(items: list[Item], frame_id: int) -> list[Item]:
    out = [it for it in items if not (it[1] == "modelOutput"
                                      and log_from_bytes(it[2]).modelOutput.frameId == frame_id)]
    assert len(out) == len(items) - 1
    return out


def forge_active(items: list[Item], frame_id: int) -> list[Item]:
    """The chestnutActive published right after the output of ``frame_id`` says active=true."""
    t = output_time(items, frame_id) + 1 * MS
    return _edit(items, lambda tt, s, e: s == "chestnutActive" and tt == t,
                 lambda b: setattr(b.chestnutActive, "active", True))


def swap_output_ids(items: list[Item], a: int, b: int) -> list[Item]:
    ta, tb = output_time(items, a), output_time(items, b)

    def change(ev: Any) -> None:
        ev.modelOutput.frameId = b if ev.logMonoTime == ta else a

    return _edit(items, lambda t, s, e: s == "modelOutput" and t in (ta, tb), change, expect=2)


def tamper_tensor(items: list[Item], frame_id: int, flat_index: int, delta: float) -> list[Item]:
    def change(ev: Any) -> None:
        t = ev.modelOutput.outputs[0]
        arr = np.frombuffer(t.data, np.float32).copy()
        arr[flat_index] += np.float32(delta)
        t.data = arr.tobytes()

    return _edit(items, lambda t, s, e: s == "modelOutput" and e.modelOutput.frameId == frame_id, change)


def shift_frame_eof(items: list[Item], frame_id: int, earlier_ns: int) -> list[Item]:
    def change(ev: Any) -> None:
        ev.cameraFrame.timestampEof -= earlier_ns

    return _edit(items, lambda t, s, e: s == "cameraFrame" and e.cameraFrame.frameId == frame_id, change)


def remove(items: list[Item], pick: Callable[[int, str, Any], bool]) -> list[Item]:
    return [it for it in items if not pick(it[0], it[1], log_from_bytes(it[2]))]


def trailing_frames(items: list[Item], stopping: bool, n: int = 10) -> list[Item]:
    """``n`` more camera frames after the drive's last message, optionally after a nodeState ``stopping``."""
    last_t, last_id = max(it[0] for it in items), N_FRAMES - 1
    frame_t = max(t for t, s, _ in items if s == "cameraFrame")
    extra: list[Item] = []
    if stopping:
        m = _msg("nodeState", last_t + 1 * MS)
        m.nodeState.state, m.nodeState.reason = "stopping", "stop: stop requested"
        extra.append((m.logMonoTime, "nodeState", m.to_bytes()))
    for k in range(1, n + 1):
        t = frame_t + k * FRAME_PERIOD_NS
        m = _msg("cameraFrame", t)
        cf = m.cameraFrame
        cf.frameId, cf.timestampEof, cf.width, cf.height, cf.data = last_id + k, t - 1 * MS, WIDTH, HEIGHT, \
            bytes(HEIGHT * WIDTH * 3)
        extra.append((t, "cameraFrame", m.to_bytes()))
    return items + extra


def frame_time_of(items: list[Item], frame_id: int) -> int:
    return next(t for t, s, d in items if s == "cameraFrame" and log_from_bytes(d).cameraFrame.frameId == frame_id)


def repeat_then_skip(items: list[Item], repeat: int, skip_to: int) -> list[Item]:
    """The camera sends frame ``repeat`` twice (the copy one period later, where ``repeat + 1`` was due) and
    then skips to ``skip_to``: frames ``repeat + 1 .. skip_to - 1`` are never sent. The node answers the
    first copy and drops the repeat (``node/main.py`` ``Node.on_frame``), so each distinct frame keeps its
    one output; every other message stays."""
    gone = set(range(repeat + 1, skip_to))
    out = [it for it in items if not (it[1] == "cameraFrame" and log_from_bytes(it[2]).cameraFrame.frameId in gone)
           and not (it[1] == "modelOutput" and log_from_bytes(it[2]).modelOutput.frameId in gone)]
    t = frame_time_of(items, repeat)
    copy = _edit([it for it in items if it[0] == t and it[1] == "cameraFrame"], lambda *_: True,
                 lambda ev: setattr(ev, "logMonoTime", t + FRAME_PERIOD_NS))
    return sorted([*out, *copy], key=lambda it: it[0])


def zero_log_time(items: list[Item], frame_id: int) -> list[Item]:
    """The ``cameraFrame`` of ``frame_id`` carries ``logMonoTime`` 0 (a publisher that never stamped it);
    the logger writes it where it arrived, in file order among its neighbours."""
    t = frame_time_of(items, frame_id)
    out = []
    for it in items:
        if it[0] == t and it[1] == "cameraFrame":
            with log.Event.from_bytes(it[2]) as reader:
                b = reader.as_builder()
            b.logMonoTime = 0
            it = (t, it[1], b.to_bytes())  # written at its arrival (the logger's order), stamped 0
        out.append(it)
    return out


ALIVE_NS = 500 * MS  # cereal SubMaster alive: a message within 10 / 20 Hz
SOFT_DISABLE_NS = 3_000 * MS  # msgs/services.py SOFT_DISABLE_S
NODE_SERVICES = ("modelOutput", "chestnutActive", "chestnutHealth", "nodeState", "initData")


def restart_node(model_path: Path, items: list[Item], kill_frame: int, restart_s: float = 0.5,
                 warm_s: float = 1.0, control_follows: bool = True, restarted: bool = True) -> list[Item]:
    """The drive with its node killed (SIGKILL) right after it published ``kill_frame``'s output and
    ``chestnutActive`` (true: the primary serves; ``kill_frame`` < 60), and a new node started by
    supervisord ``restart_s`` later, which warms its fallback for ``warm_s`` and publishes nothing until
    then (``node/main.py`` ``Node.run``). The camera and the control daemon run on.

    From its start (``t_start``) the new node publishes ``initData``, its first ``chestnutHealth`` (every
    layer STALE with ``lastChange`` 0: no evidence yet) and ``nodeState`` qualifying, then answers every
    frame from the fallback with ``chestnutActive`` false until the drive's own fault at frame 60, after
    which the drive goes on as it was (degraded, recovering, active again at frame 140). Every
    ``nodeState`` carries ``framesIn`` / ``framesOut``, counted from 0 in each process.

    ``control_follows``: the control daemon sees ``chestnutActive`` go stale 0.5 s after the dead node's
    last one (cereal's alive: 10 periods at 20 Hz), soft-disables (``commIssue``) and is disengaged 3 s
    later for the rest of the drive, as ``chestnut control`` does; False: its messages stay as they were
    (engaged, every check passing). ``restarted`` False: no node ever starts again."""
    from chestnut.backend.model import model_id

    t_kill = output_time(items, kill_frame) + 1 * MS  # its chestnutActive: the dead node's last word
    t_stale = t_kill + ALIVE_NS
    t_start = t_kill + int((restart_s + warm_s) * 1e9) + 3 * MS  # off the drive's own message times
    fb_mid = model_id("tiny-fallback", Path(model_path).read_bytes())
    _, f_out = model_outputs(str(model_path), sum(1 for _, s, _ in items if s == "cameraFrame"))
    t_fault = frame_time_of(items, FAULT_FRAME)
    out: list[Item] = []
    for t, s, d in items:
        if s in NODE_SERVICES and t_kill < t and (t < t_start or not restarted):
            continue  # no node runs
        if s == "initData" and t > t_kill:
            continue  # the new node's own comes at its start
        if s == "modelOutput" and t_start < t < t_fault:
            with log.Event.from_bytes(d) as reader:
                b = reader.as_builder()
            mo = b.modelOutput
            mo.source, mo.modelId, mo.reason = "fallback", fb_mid, "fallback serving: the primary is qualifying"
            mo.agreementChecked = mo.primaryAgrees = False
            mo.maxAbsDiff = 0.0
            _fill_tensors(mo, f_out[mo.frameId])
            d = b.to_bytes()
        elif s == "chestnutActive" and t_start < t < t_fault:
            with log.Event.from_bytes(d) as reader:
                b = reader.as_builder()
            ca = b.chestnutActive
            ca.active, ca.source, ca.reason, ca.since = False, "fallback", "fallback serving, not the primary", t_start
            d = b.to_bytes()
        elif s == "controlState" and t > t_stale and control_follows:
            with log.Event.from_bytes(d) as reader:
                b = reader.as_builder()
            cs = b.controlState
            cs.canEngage = False
            cs.engaged = cs.softDisabling = t < t_stale + SOFT_DISABLE_NS
            cs.events = ["commIssue"] if cs.engaged else ["commIssue", "disengaged"]
            d = b.to_bytes()
        out.append((t, s, d))
    if not restarted:
        return out
    init = next(d for _, s, d in items if s == "initData")
    with log.Event.from_bytes(init) as reader:
        b = reader.as_builder()
    b.logMonoTime = t_start
    out.append((t_start, "initData", b.to_bytes()))
    h = _msg("chestnutHealth", t_start + 1 * MS)
    layers = h.chestnutHealth.init("layers", 4)
    for entry, name in zip(layers, ("usb", "pcie", "gpu", "output"), strict=True):
        entry.layer, entry.level, entry.reason, entry.lastChange = name, "stale", "no evidence yet", 0
    h.chestnutHealth.overall = "stale"
    out.append((h.logMonoTime, "chestnutHealth", h.to_bytes()))
    q = _msg("nodeState", t_start + 2 * MS)
    q.nodeState.state, q.nodeState.reason = "qualifying", "fallback_ready: fallback onnxruntime warm"
    out.append((q.logMonoTime, "nodeState", q.to_bytes()))
    out.sort(key=lambda it: it[0])
    final: list[Item] = []
    frames_in = frames_out = 0
    for t, s, d in out:  # framesIn / framesOut as each process counts them
        if t == t_start:
            frames_in = frames_out = 0
        if s == "cameraFrame" and not t_kill < t < t_start:
            frames_in += 1
        elif s == "modelOutput":
            frames_out += 1
        elif s == "nodeState":
            with log.Event.from_bytes(d) as reader:
                b = reader.as_builder()
            b.nodeState.framesIn, b.nodeState.framesOut = frames_in, frames_out
            d = b.to_bytes()
        final.append((t, s, d))
    return final


# ---------------------------------------------------------------- bulk logs (benchmarks)


def build_frames_log(model_path: Path, n: int, height: int, width: int, block: int = 20,
                     base_ns: int = 20_000 * 1_000_000_000, jit_cache: bool = False) -> list[Item]:
    """``n`` frames at 20 Hz with one real output each, served in alternating blocks of ``block`` frames
    by the primary (tinygrad; ``jit_cache``: the compile cache) and the fallback (onnxruntime); the
    node's initData first. Only what replay reads: ``initData``, ``cameraFrame``, ``modelOutput``,
    ``chestnutActive``."""
    from chestnut.backend.model import OnnxModel, model_id
    from chestnut.fallback.standby import FallbackModel
    from chestnut.node.config import NodeConfig
    from chestnut.node.preprocess import preprocess

    shape = (1, 3, height, width)
    cfg = NodeConfig()
    cfg.model.path, cfg.model.name, cfg.model.input, cfg.model.shape = Path(model_path), "bench", "x", shape
    from chestnut.backend.jitcache import JitCache

    primary = OnnxModel(Path(model_path), name="bench", input_shapes={"x": shape},
                        jit_cache=JitCache() if jit_cache else None)
    fallback = FallbackModel(Path(model_path), "onnxruntime", input_shapes={"x": shape})
    mid = model_id("bench", Path(model_path).read_bytes())
    rng = np.random.default_rng(3)
    items: list[Item] = []

    def put(m: Any) -> None:
        items.append((m.logMonoTime, m.which(), m.to_bytes()))

    init = _msg("initData", base_ns)
    init.initData.config = json.dumps(cfg.to_json(), sort_keys=True)
    put(init)
    for i in range(n):
        t = base_ns + (i + 1) * FRAME_PERIOD_NS
        img = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        cam = _msg("cameraFrame", t)
        cf = cam.cameraFrame
        cf.frameId, cf.timestampEof, cf.timestampSof, cf.width, cf.height = i, t - MS, t - 11 * MS, width, height
        cf.data = img.tobytes()
        put(cam)
        serving = "primary" if (i // block) % 2 == 0 else "fallback"
        x = preprocess("ppocr", img, "x", shape)
        out = _msg("modelOutput", t + 4 * MS)
        mo = out.modelOutput
        mo.frameId, mo.source, mo.modelId = i, serving, mid
        _fill_tensors(mo, (primary if serving == "primary" else fallback).run(x))
        put(out)
        act = _msg("chestnutActive", t + 5 * MS)
        act.chestnutActive.active, act.chestnutActive.source = serving == "primary", serving
        put(act)
    return items


def write_one_message_log(log_dir: Path) -> Path:
    """A log of one ``nodeState`` (state ``active``) and no node configuration, written under ``log_dir``; returns
    it. For commands that only need a log to open (replay looks at ``--model`` and nothing else)."""
    m = _msg("nodeState", 10_000 * 1_000_000_000)
    m.nodeState.state = "active"
    write_drive([(m.logMonoTime, m.which(), m.to_bytes())], log_dir)
    return log_dir
