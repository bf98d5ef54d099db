"""The node's configuration: a TOML file (``launch/node.toml`` is the default) plus command-line flags.

Every field has a default, so ``chestnut run`` with no file serves the prepared PP-OCRv4 detector
(``chestnut model prepare``) on the twin. Paths may use ``~``. A malformed file or value raises
:class:`~chestnut.backend.errors.ConfigError` naming the key.

The start-up budget (``timing.start_timeout_s``: a worker not qualified and loaded by then is killed) is
one number with the ladder's own step bounds (``backend/ladder.py``): 0 derives it
(:func:`start_budget_s`: the sum of every rung's bound, the model load's being the compile bound on a
cold compile cache and :data:`~chestnut.backend.real_runner.WARM_LOAD_BOUND_S` on a warm one, plus
:data:`START_MARGIN_S`), and for a real dock a set value shorter than that sum is refused, so no rung is
cut off before its own bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chestnut.backend.errors import ConfigError
from chestnut.backend.ladder import DockQualifier, LadderConfig, UsbDock
from chestnut.backend.model import untrusted_file
from chestnut.backend.protocol import WAIT_TIMEOUT_MS
from chestnut.backend.real_runner import WARM_LOAD_BOUND_S, cached_on_dock
from chestnut.msgs.argtypes import path_arg
from chestnut.node.deadline import DEADLINE_ANSWER_MS, DEADLINE_FLOOR_MS, DEADLINE_PERIOD_MS
from chestnut.node.policy import HOST_CPU_PRESSURE_PCT, HOST_LATE_MS, HOST_WINDOW_MS
from chestnut.node.preprocess import PREPROCESSORS, WARP_PREFIX, primary_warp
from chestnut.node.realtime import DEFAULT_PRIORITY, POLICIES

START_MARGIN_S = 5.0  # a worker's spawn and tinygrad's import before the first rung (s)


def cache_dir() -> Path:
    """``$CHESTNUT_CACHE`` or ``~/.cache/chestnut``: prepared models and compile caches."""
    return Path(os.environ.get("CHESTNUT_CACHE") or Path.home() / ".cache" / "chestnut")


def default_model_path() -> Path:
    """Where ``chestnut model prepare`` puts the PP-OCRv4 detector (``launch/assets.py``) and the node's
    ``[model] path`` defaults to: ``<cache_dir()>/models/ppocr_det_128x256.onnx``."""
    return cache_dir() / "models" / "ppocr_det_128x256.onnx"


DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "launch" / "node.toml"
DOCK_KINDS = ("twin", "real", "cpu", "none")
FRAME_SERVICES = ("cameraFrame",)
"""The services ``timing.frame_service`` may name: a service carries the ``Event`` member of its own name
(``msgs/services.py``), and the node reads a frame as ``event.cameraFrame`` (``node/main.py`` ``on_frame``), so
only a ``cameraFrame`` service carries frames it can serve."""
MAX_INPUT_ELEMENTS = 1 << 24
"""Most elements a model input may have (N*C*H*W): 64 MiB of float32, four times the 16 MiB bound of a
``cameraFrame`` (``msgs/services.py``), so any input a frame can give fits and an absurd shape is refused
when the configuration loads, not as an allocation failure at start."""
MAX_MS = 60_000.0
"""Upper bound of every per-frame time in milliseconds (``dock.wait_timeout_ms`` and the ``[timing]`` ``_ms``
keys): a minute, twice tinygrad's own default fence wait (30000 ms, ``HCQDEV_WAIT_TIMEOUT_MS``) and 1200 frames
of openpilot's 20 Hz camera: a frame answered, judged stale or a hang declared later than that is of use to no
one, and a wait this long leaves the watchdog blind to a hung dock for as long."""
MAX_DURATION_S = 30 * 24 * 3600.0
"""Upper bound of every ``[timing]`` ``_s`` key (start budget, consumer timeout, back-offs, windows), s: 30
days, past any run's length (``chestnut launch --seconds`` stops at a week, ``msgs/argtypes.py``), so a
back-off this long already means "never again", and every time the node adds to its clock in nanoseconds
stays far inside an int64 (292 years)."""
MAX_RATE_HZ = 100.0
"""Upper bound of the ``[timing]`` ``_hz`` keys (``health_hz``, ``node_state_hz``, ``probe_hz``), Hz: the rate
of openpilot's fastest services (``carState``, ``controlsState``); the node's loop would spend itself
publishing at a higher one."""
MAX_COUNT = 1000
"""Upper bound of the ``[timing]`` counts (``shadow_frames``, ``miss_run``, ``flap_max_failovers``): 50 s of
frames at openpilot's 20 Hz; each is a handful by design (defaults 20, 3 and 3), and a count past this never
completes in a run."""
MAX_BACKOFF_FACTOR = 10.0
"""Upper bound of ``timing.backoff_factor``: the second retry already waits ten times the first, and
``factor ** 64`` (``node/supervisor.py`` raises it to at most the 64th power) stays a finite float."""
MAX_AGREEMENT_TOL = 1.0
"""Upper bound of ``timing.agreement_tol``: a relative tolerance of 1 already takes any two outputs of the same
sign as agreeing, so a larger one checks nothing."""


def cpu_count() -> int:
    """The CPUs this process may run on (its affinity, else ``os.cpu_count()``): the upper bound of
    ``fallback.threads``, as ``realtime.cpus`` names CPUs of this host's set."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass
class ModelConfig:
    # default: where `chestnut model prepare` puts the PP-OCRv4 detector ($CHESTNUT_CACHE or ~/.cache/chestnut)
    path: Path = field(default_factory=default_model_path)
    name: str = "ppocr_det"
    input: str = "x"
    shape: tuple[int, ...] = (1, 3, 128, 256)  # N, C, H, W
    preprocess: str = "ppocr"
    frame: str = ""                            # e.g. "nv12:1928x1208": the primary warps that full frame
    fingerprint: Path | None = None            # default: <path>.fingerprint.json when it exists
    ranges: dict[str, tuple[float, float]] = field(default_factory=lambda: {"text_prob": (0.0, 1.0)})
    # not a setting: whether [model.ranges] was written in the file (the built-in default and the shipped
    # launch/node.toml name the PP-OCRv4 detector's output, and apply only to a primary that has it); set by
    # load_config: a written key naming no primary output is refused (node/contract.py)
    ranges_given: bool = field(default=False, repr=False, compare=False)


@dataclass
class FallbackConfig:
    path: Path | None = None                   # default: the primary's model file
    engine: str = "onnxruntime"                # onnxruntime | tinygrad
    standby: str = "hot"                       # hot: every frame; warm: only when needed
    threads: int = 1
    # false: a fallback refused at load (unusable, or not of the primary's output contract: node/contract.py)
    # leaves the node serving from the primary alone; true: the node refuses to start without one
    required: bool = True


@dataclass
class DockConfig:
    kind: str = "twin"                         # twin | real | cpu (primary on the host) | none
    wait_timeout_ms: float = WAIT_TIMEOUT_MS   # tinygrad's HCQDEV_WAIT_TIMEOUT_MS / our fence waits
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class TimingConfig:
    frame_service: str = "cameraFrame"
    deadline_ms: float = 150.0                 # openpilot modeld's per-frame deadline: the adaptive deadline's ceiling
    # the primary's deadline follows its own latency between this floor and deadline_ms (node/deadline.py,
    # docs/health.md "Adaptive deadline"); adaptive_deadline = false: deadline_ms for every frame
    deadline_floor_ms: float = DEADLINE_FLOOR_MS
    adaptive_deadline: bool = True
    # the camera's frame period: the adaptive deadline aims to have the fallback's answer inside it
    # (node/deadline.py DEADLINE_PERIOD_MS, openpilot DT_MDL)
    frame_period_ms: float = DEADLINE_PERIOD_MS
    # a frame read this long after its timestampEof is answered at once, without a model: valid=False, "stale
    # frame" (docs/health.md). Our choice: 20 frames at 20 Hz, the health layers' stale_after_ms
    # (node/health.py DEFAULT_DEBOUNCE); well over deadline_ms, so a frame only queued behind one late
    # frame (a deadline miss answered by the fallback) is still served, and one this old is of no use
    max_frame_age_ms: float = 1000.0
    shadow_frames: int = 20                    # agreeing shadow frames before a return to the primary
    agreement_tol: float = 1e-3                # |a-b| <= max(tol, tol*max(|a|,|b|))
    health_hz: float = 5.0
    node_state_hz: float = 1.0
    probe_hz: float = 1.0
    hang_margin_ms: float = 250.0              # watchdog: a frame request unanswered wait_timeout_ms + this is a hang
    miss_run: int = 3                          # consecutive deadline misses that fail the gpu layer over
    start_timeout_s: float = 0.0               # ladder + load, else killed; 0 = derived (start_budget_s)
    consumer_timeout_s: float = 2.0            # the last controlState stands this long (a consumer's gap is no consent)
    backoff_initial_s: float = 1.0             # retry back-off: initial * factor**n, at most backoff_max_s
    backoff_factor: float = 2.0
    backoff_max_s: float = 30.0
    stable_after_s: float = 60.0               # primary served this long before a fault: back-off starts over
    flap_window_s: float = 600.0               # flap_max_failovers failovers within this window ...
    flap_max_failovers: int = 3
    flap_backoff_s: float = 300.0              # ... raise every back-off to this until a stable period
    # a deadline miss while the host itself was late is the host's, not counted towards a failover
    # (node/policy.py host_late, docs/health.md "The host"): a wake-up this late, ms ...
    host_late_ms: float = HOST_LATE_MS
    host_cpu_pressure_pct: float = HOST_CPU_PRESSURE_PCT  # ... or /proc/pressure/cpu some avg10 this high, %
    host_window_ms: float = HOST_WINDOW_MS    # ... within this window before the miss


@dataclass
class RealtimeConfig:
    """The node's and its worker's scheduling (``node/realtime.py``; openpilot modeld: SCHED_FIFO 54). The
    worker runs one priority below the node. ``cpus``: CPUs both are pinned to; empty: any."""

    policy: str = "fifo"                       # fifo | rr | other (ask for nothing)
    priority: int = DEFAULT_PRIORITY           # 1..99 for fifo and rr
    cpus: tuple[int, ...] = ()


@dataclass
class NodeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    fallback: FallbackConfig = field(default_factory=FallbackConfig)
    dock: DockConfig = field(default_factory=DockConfig)
    timing: TimingConfig = field(default_factory=TimingConfig)
    realtime: RealtimeConfig = field(default_factory=RealtimeConfig)

    def to_json(self) -> dict[str, Any]:
        def conv(v: Any) -> Any:
            if isinstance(v, Path):
                return str(v)
            if isinstance(v, dict):
                return {k: conv(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [conv(x) for x in v]
            return v

        out: dict[str, Any] = conv(dataclasses.asdict(self))
        out["model"].pop("ranges_given", None)  # not a setting
        return out

    @property
    def fallback_path(self) -> Path:
        return self.fallback.path or self.model.path

    @property
    def fallback_is_primary(self) -> bool:
        """Whether the fallback's model file is the primary's: ``fallback.path`` unset, or naming the same file
        (symlinks followed; compared as given where a path cannot be resolved: a symlink loop)."""
        try:
            return self.fallback_path.expanduser().resolve() == self.model.path.expanduser().resolve()
        except (OSError, RuntimeError):
            return self.fallback_path == self.model.path

    @property
    def fingerprint_path(self) -> Path:
        """``model.fingerprint``, else the file beside the model's: its suffix replaced by ``.fingerprint.json``
        (``det.onnx`` -> ``det.fingerprint.json``). A model path with no file name (``/``, ``.``: a folder, which
        the node refuses as its model file in one line, exit 3, as any folder) gets ``.fingerprint.json`` appended:
        ``Path.with_suffix`` raises for it, and ``chestnut run --model /`` was a ``ValueError`` traceback."""
        if self.model.fingerprint:
            return self.model.fingerprint
        path = self.model.path
        return path.with_suffix(".fingerprint.json") if path.name else Path(f"{path}.fingerprint.json")


def _toml_kind(current: Any, key: str) -> type | None:
    """The TOML type a setting takes, from its default's (None: checked by its own conversion below)."""
    if key in ("ranges", "path", "fingerprint") or isinstance(current, Path):
        return None
    for kind in (bool, tuple, int, float, str):  # bool before int: True is an int to Python
        if isinstance(current, kind):
            return kind
    return None


def _is_kind(value: Any, kind: type) -> bool:
    """Whether a TOML value is of ``kind`` as written: no silent coercion (``true`` is no priority, ``"54"``
    no number); an integer is also a number; a list's items are integers (not booleans)."""
    if kind is tuple:
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


RANGE_WANT = "want [low, high], two finite numbers with low <= high"


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _ranges(value: Any) -> dict[str, tuple[float, float]]:
    """``[model.ranges]`` as written (output name -> ``[low, high]``), each pair checked here: two finite numbers,
    low <= high (raises ConfigError naming the pair)."""
    if not isinstance(value, dict):
        raise ConfigError("config", f"model.ranges = {value!r}; want a table of output name = [low, high]")
    out: dict[str, tuple[float, float]] = {}
    for name, pair in value.items():
        ok = isinstance(pair, list) and len(pair) == 2 and all(_number(v) for v in pair)
        try:
            lo, hi = (float(pair[0]), float(pair[1])) if ok else (math.nan, math.nan)
        except OverflowError:  # an integer too large for a float
            lo = hi = math.nan
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise ConfigError("config", f"model.ranges.{name} = {pair!r}; {RANGE_WANT}")
        out[name] = (lo, hi)
    return out


def _path(value: Any, where: str, key: str) -> Path | None:
    """A path key as written: a string, ``~`` expanded; an empty one is None (the key's default: the primary's
    file for ``fallback.path``, ``<path>.fingerprint.json`` for ``model.fingerprint``), except for ``model.path``,
    which has no default to fall back to once set: an empty one names no file and is refused."""
    if not isinstance(value, str):
        raise ConfigError("config", f"{where}.{key} = {value!r}; want a file path (a string)")
    if value == "":
        if (where, key) == ("model", "path"):
            raise ConfigError("config", f"{where}.{key} = ''; want a file path (a non-empty string; leave the key "
                                        "out for the default)")
        return None
    return Path(value).expanduser()


def _apply(section: Any, values: dict[str, Any], where: str) -> None:
    names = {f.name: f for f in dataclasses.fields(section) if f.name != "ranges_given"}
    for key, value in values.items():
        if key not in names:
            raise ConfigError("config", f"unknown key {where}.{key}; known: {', '.join(sorted(names))}")
        current = getattr(section, key)
        want = _toml_kind(current, key)
        if want is not None and not _is_kind(value, want):
            shown = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
                     tuple: "a list of integers, e.g. [0, 1]"}[want]
            raise ConfigError("config", f"{where}.{key} = {value!r}; want {shown}")
        # every value is of its kind here (checked above, or by _ranges and _path), so no conversion can fail
        # with Python's own text as the reason
        if key == "ranges":
            value = _ranges(value)
        elif isinstance(current, Path) or key in ("path", "fingerprint"):
            value = _path(value, where, key)
        elif isinstance(current, tuple):
            value = tuple(int(v) for v in value)
        elif isinstance(current, bool):
            value = bool(value)
        elif isinstance(current, int):
            value = int(value)
        elif isinstance(current, float):
            try:
                value = float(value)
            except OverflowError:  # an integer too large for a float
                raise ConfigError("config", f"{where}.{key} = {value!r}; want a finite number") from None
        elif isinstance(current, str):
            value = str(value)
        setattr(section, key, value)
        if key == "ranges":
            section.ranges_given = True  # written in the file: each key must name a primary output (node/contract.py)


def ladder_bounds_s(ladder: LadderConfig, warm: bool) -> dict[str, float]:
    """Each rung's bound in seconds (``backend/ladder.py`` ``DockQualifier.steps``, ``model_steps``), the
    model load's being :data:`~chestnut.backend.real_runner.WARM_LOAD_BOUND_S` when ``warm``."""
    bounds = {s.name: s.bound_s for s in DockQualifier(UsbDock(None, ladder.ctrl_timeout_ms), ladder).steps()}
    bounds["model_loaded"] = min(WARM_LOAD_BOUND_S, ladder.load_bound_s) if warm else ladder.load_bound_s
    bounds["warmup"] = ladder.warmup_bound_s
    return bounds


def start_budget_s(ladder: LadderConfig, warm: bool) -> float:
    """The start-up budget, s: every rung's bound (:func:`ladder_bounds_s`) plus :data:`START_MARGIN_S`."""
    return round(sum(ladder_bounds_s(ladder, warm).values()) + START_MARGIN_S, 1)


def required_start_budget(cfg: NodeConfig) -> tuple[float, bool]:
    """(budget s, warm) for ``cfg``: warm only for a real dock whose compile cache names the model
    (:func:`~chestnut.backend.real_runner.cached_on_dock`); a twin or an unreadable model counts cold."""
    warm = False
    if cfg.dock.kind == "real":
        from chestnut.backend.errors import ModelError
        from chestnut.backend.model import read_model_file

        try:  # bounded, never a FIFO (backend/model.py read_model_file); the worker reports a bad file
            warm = cached_on_dock(read_model_file(cfg.model.path.expanduser(), "primary model"))
        except (OSError, ModelError):
            warm = False
    return start_budget_s(LadderConfig(wait_timeout_ms=int(cfg.dock.wait_timeout_ms)), warm), warm


def _check_start_budget(cfg: NodeConfig) -> None:
    t = cfg.timing
    if t.start_timeout_s < 0:
        raise ConfigError("config", f"timing.start_timeout_s = {t.start_timeout_s}; want >= 0 (0 = derived)")
    need, warm = required_start_budget(cfg)
    if t.start_timeout_s == 0:
        t.start_timeout_s = need
    elif cfg.dock.kind == "real" and t.start_timeout_s < need:
        ladder = LadderConfig(wait_timeout_ms=int(cfg.dock.wait_timeout_ms))
        parts = ", ".join(f"{k} {v:g}" for k, v in ladder_bounds_s(ladder, warm).items())
        hint = "" if warm else (f"; a warm compile cache (`chestnut model prepare --for-dock`) needs "
                                f"{start_budget_s(ladder, True):g} s")
        raise ConfigError("config", f"timing.start_timeout_s = {t.start_timeout_s:g} s is shorter than the ladder's "
                                    f"bounds with a {'warm' if warm else 'cold'} compile cache ({need:g} s: {parts}, "
                                    f"+ {START_MARGIN_S:g} s start): set it to at least {need:g} or to 0 (derived)"
                                    f"{hint}")


def _non_finite(value: Any, where: str) -> tuple[str, float] | None:
    """The first float in ``value`` (a setting, or a table or list of them) that is NaN or infinite, with its key."""
    if isinstance(value, float) and not math.isfinite(value):
        return where, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else ()
    for k, v in items:
        found = _non_finite(v, f"{where}.{k}" if isinstance(value, dict) else f"{where}[{k}]")
        if found is not None:
            return found
    return None


def _check_finite(cfg: NodeConfig) -> None:
    """One check for every float the configuration holds, from the file, a flag or code: NaN passes no comparison
    (``nan > 0`` and ``nan < 0`` are both false) and inf passes every lower bound, so a key whose own check is
    a bound alone would take either silently."""
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            found = _non_finite(getattr(getattr(cfg, section.name), f.name), f"{section.name}.{f.name}")
            if found is not None:
                raise ConfigError("config", f"{found[0]} = {found[1]}; want a finite number")


def _at_most() -> dict[str, tuple[float, str]]:
    """Each bounded number's key -> (its upper bound, the bound in words)."""
    ms = (MAX_MS, f"{MAX_MS:g} ms, a minute")
    s_ = (MAX_DURATION_S, f"{MAX_DURATION_S:.0f} s, 30 days")
    hz = (MAX_RATE_HZ, f"{MAX_RATE_HZ:g} Hz")
    count = (float(MAX_COUNT), f"{MAX_COUNT}, 50 s of frames at 20 Hz")
    bounds = {"dock.wait_timeout_ms": ms}
    for f in dataclasses.fields(TimingConfig):
        if f.name.endswith("_ms"):
            bounds[f"timing.{f.name}"] = ms
        elif f.name.endswith("_s"):
            bounds[f"timing.{f.name}"] = s_
        elif f.name.endswith("_hz"):
            bounds[f"timing.{f.name}"] = hz
    for key in ("shadow_frames", "miss_run", "flap_max_failovers"):
        bounds[f"timing.{key}"] = count
    bounds["timing.backoff_factor"] = (MAX_BACKOFF_FACTOR, f"{MAX_BACKOFF_FACTOR:g}")
    bounds["timing.agreement_tol"] = (MAX_AGREEMENT_TOL, f"{MAX_AGREEMENT_TOL:g}: it takes any two outputs of "
                                                         "one sign as agreeing")
    return bounds


def _check_at_most(cfg: NodeConfig) -> None:
    """Every number of the configuration with an upper bound (:func:`_at_most`) within it. A NaN or infinite
    value passes here and is refused by its own range or by :func:`_check_finite`."""
    for key, (bound, words) in _at_most().items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not (isinstance(value, float) and not math.isfinite(value)) and value > bound:
            raise ConfigError("config", f"{key} = {value}; want at most {words}")


def deadline_refusal(deadline_ms: float, wait_timeout_ms: float, deadline: str = "timing.deadline_ms",
                     wait: str = "dock.wait_timeout_ms") -> str | None:
    """The one rule for a per-frame deadline and the device wait timeout, both in milliseconds: ``0 < deadline_ms <
    wait_timeout_ms`` (a frame's deadline ends before the wait after which the watchdog calls the dock hung).
    ``None`` when the two keep it, else the refusal in one line, the two named ``deadline`` and ``wait`` (the
    configuration's keys, as :func:`validate` refuses them; ``chestnut check`` passes its flags). Raises nothing."""
    if 0 < deadline_ms < wait_timeout_ms:
        return None
    return f"{deadline} = {deadline_ms}; want 0 < it < {wait} ({wait_timeout_ms})"


def validate(cfg: NodeConfig) -> NodeConfig:
    """Check values; raises ConfigError naming the key. A ``timing.start_timeout_s`` of 0 is replaced by the
    derived budget (:func:`required_start_budget`)."""
    if cfg.dock.kind not in DOCK_KINDS:
        raise ConfigError("config", f"dock.kind = {cfg.dock.kind!r}; use one of {', '.join(DOCK_KINDS)}")
    if cfg.fallback.engine not in ("onnxruntime", "tinygrad"):
        raise ConfigError("config", f"fallback.engine = {cfg.fallback.engine!r}; use onnxruntime or tinygrad")
    if cfg.fallback.standby not in ("hot", "warm"):
        raise ConfigError("config", f"fallback.standby = {cfg.fallback.standby!r}; use hot or warm")
    if len(cfg.model.shape) != 4 or min(cfg.model.shape) <= 0:
        raise ConfigError("config", f"model.shape = {list(cfg.model.shape)}; want N, C, H, W > 0")
    if math.prod(cfg.model.shape) > MAX_INPUT_ELEMENTS:
        raise ConfigError("config", f"model.shape = {list(cfg.model.shape)}: {math.prod(cfg.model.shape)} elements, "
                                    f"over the {MAX_INPUT_ELEMENTS} a model input may have (64 MiB of float32)")
    base = cfg.model.preprocess.removeprefix(WARP_PREFIX)
    if base not in PREPROCESSORS:
        known = sorted(PREPROCESSORS) + [WARP_PREFIX + k for k in sorted(PREPROCESSORS)]
        raise ConfigError("config", f"model.preprocess = {cfg.model.preprocess!r}; use one of {', '.join(known)}")
    if cfg.model.input == "":
        raise ConfigError("config", "model.input = ''; want the name of the model's input (a non-empty string)")
    # onnxruntime's intra_op_num_threads (backend/model.py OrtModel): 0 is onnxruntime's own default (one thread
    # per physical core, SessionOptions' initial value), so it is kept; a negative count means nothing there
    # (onnxruntime 1.32 takes -2 without a word) and is refused; more threads than the CPUs this process may
    # run on (cpu_count) only contend with each other and the node (100000 made 32000 threads and 16 GB)
    ncpu = cpu_count()
    if not 0 <= cfg.fallback.threads <= ncpu:
        raise ConfigError("config", f"fallback.threads = {cfg.fallback.threads}; want 0..{ncpu} (onnxruntime's "
                                    f"intra-op threads, at most the {ncpu} CPUs this process may run on; 0: "
                                    "onnxruntime's default, one per physical core)")
    t = cfg.timing
    if t.frame_service not in FRAME_SERVICES:
        raise ConfigError("config", f"timing.frame_service = {t.frame_service!r}; want a service that carries "
                                    f"camera frames: {', '.join(FRAME_SERVICES)}")
    wait = cfg.dock.wait_timeout_ms
    if not 0 < wait < math.inf:
        raise ConfigError("config", f"dock.wait_timeout_ms = {wait}; want a finite number > 0")
    _check_at_most(cfg)
    refusal = deadline_refusal(t.deadline_ms, wait)
    if refusal is not None:
        raise ConfigError("config", refusal)
    if not 0 < t.deadline_floor_ms <= t.deadline_ms:
        raise ConfigError("config", f"timing.deadline_floor_ms = {t.deadline_floor_ms}; want 0 < it <= "
                                    f"timing.deadline_ms ({t.deadline_ms})")
    if not DEADLINE_ANSWER_MS < t.frame_period_ms < math.inf:
        raise ConfigError("config", f"timing.frame_period_ms = {t.frame_period_ms}; want a finite period over the "
                                    f"{DEADLINE_ANSWER_MS:g} ms the fallback's answer needs")
    if not t.max_frame_age_ms >= t.deadline_ms:
        raise ConfigError("config", f"timing.max_frame_age_ms = {t.max_frame_age_ms}; want at least timing.deadline_ms "
                                    f"({t.deadline_ms}): a frame younger than its deadline is never stale")
    _check_start_budget(cfg)
    positive = {"shadow_frames": t.shadow_frames, "health_hz": t.health_hz, "node_state_hz": t.node_state_hz,
                "probe_hz": t.probe_hz, "miss_run": t.miss_run, "start_timeout_s": t.start_timeout_s,
                "consumer_timeout_s": t.consumer_timeout_s, "backoff_initial_s": t.backoff_initial_s,
                "flap_max_failovers": t.flap_max_failovers, "agreement_tol": t.agreement_tol,
                "stable_after_s": t.stable_after_s, "flap_window_s": t.flap_window_s,
                "flap_backoff_s": t.flap_backoff_s}
    for key, value in positive.items():
        if not value > 0:
            raise ConfigError("config", f"timing.{key} = {value}; want > 0")
    for key in ("host_late_ms", "host_cpu_pressure_pct", "host_window_ms"):
        if not 0 < getattr(t, key) < math.inf:
            raise ConfigError("config", f"timing.{key} = {getattr(t, key)}; want a finite number > 0")
    if t.host_cpu_pressure_pct > 100:
        raise ConfigError("config", f"timing.host_cpu_pressure_pct = {t.host_cpu_pressure_pct}; want at most 100 "
                                    "(a share of time, %)")
    rt = cfg.realtime
    if rt.policy not in POLICIES:
        raise ConfigError("config", f"realtime.policy = {rt.policy!r}; use one of {', '.join(POLICIES)}")
    if rt.policy != "other" and not 1 <= rt.priority <= 99:
        raise ConfigError("config", f"realtime.priority = {rt.priority}; want 1..99 for {rt.policy} "
                                    "(no realtime: policy = \"other\")")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if any(c not in cpus for c in rt.cpus) or len(set(rt.cpus)) != len(rt.cpus):
        raise ConfigError("config", f"realtime.cpus = {list(rt.cpus)}; want distinct CPUs of this host's "
                                    f"{', '.join(map(str, cpus))}")
    if t.hang_margin_ms < 0:
        raise ConfigError("config", f"timing.hang_margin_ms = {t.hang_margin_ms}; want >= 0")
    if not t.backoff_initial_s <= t.backoff_max_s or t.backoff_factor < 1:
        raise ConfigError("config", f"timing.backoff_initial_s = {t.backoff_initial_s}, backoff_max_s = "
                                    f"{t.backoff_max_s}, backoff_factor = {t.backoff_factor}; want initial <= max "
                                    "and factor >= 1")
    if cfg.model.frame:
        primary_warp(cfg.model.frame, cfg.model.preprocess, tuple(cfg.model.shape))
    for name, (lo, hi) in cfg.model.ranges.items():
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise ConfigError("config", f"model.ranges.{name} = [{lo}, {hi}]; {RANGE_WANT}")
    _check_finite(cfg)  # last: a key with a range of its own above is refused with that range
    cfg.model.path = cfg.model.path.expanduser()
    if cfg.fallback.path is not None:
        cfg.fallback.path = cfg.fallback.path.expanduser()
    return cfg


CONFIG_MAX_BYTES = 1 << 20
"""The most bytes a node configuration file may have: the shipped ``launch/node.toml`` is under 3 KiB, so a
file 300 times that is no configuration, and reading stops there instead of taking a huge file into memory."""


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "a special file"


def read_config_text(path: Path) -> str:
    """The text of the node configuration file ``path`` (``chestnut run --config``, ``chestnut launch
    --node-config``): a regular file (a FIFO is opened without waiting for a writer, ``O_NONBLOCK``, and refused
    like a directory or a device), at most :data:`CONFIG_MAX_BYTES`, UTF-8 (TOML's encoding). It decides which
    model runs, so it is refused, as a model file is, when another user could change it: the file or its folder
    owned by another user than this one or root, or writable by group or other (``backend/model.py``
    ``untrusted_file``; a folder with the sticky bit is fine). Raises :class:`ConfigError` with one line naming
    the file otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError("config", f"cannot read {path}: {e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError("config", f"cannot read {path}: {_file_kind(st.st_mode)}, not a regular file")
        refusal = untrusted_file(path, st, "node configuration")
        if refusal is not None:
            raise ConfigError("config", refusal)
        chunks, left = [], CONFIG_MAX_BYTES + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise ConfigError("config", f"cannot read {path}: {e}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > CONFIG_MAX_BYTES:
        raise ConfigError("config", f"cannot read {path}: over the {CONFIG_MAX_BYTES} bytes a node configuration "
                                    "may have")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("config", f"{path} is not valid TOML: {e}") from None


def load_config(path: Path | None) -> NodeConfig:
    """Read ``path`` (TOML, :func:`read_config_text`) over the defaults; ``None`` = the defaults alone."""
    cfg = NodeConfig()
    if path is None:
        return validate(cfg)
    try:
        data = tomllib.loads(read_config_text(Path(path)))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("config", f"{path} is not valid TOML: {e}") from None
    sections = {f.name for f in dataclasses.fields(cfg)}
    for name, values in data.items():
        section = getattr(cfg, name) if name in sections else None
        if section is None:
            raise ConfigError("config", f"unknown section [{name}] in {path}; known: "
                                        f"{', '.join(f.name for f in dataclasses.fields(cfg))}")
        if not isinstance(values, dict):
            raise ConfigError("config", f"[{name}] in {path} is a section (a table of keys), not the value "
                                        f"{values!r}")
        _apply(section, values, name)
    if Path(path).resolve() == DEFAULT_CONFIG:  # the shipped file's ranges are the defaults' (the PP-OCRv4 detector's)
        cfg.model.ranges_given = False
    return validate(cfg)


def rt_cpus_arg(text: str) -> str:
    """``--rt-cpus``: the text, when it names at least one CPU; raises ``argparse.ArgumentTypeError`` (one line)
    for one that names none (``--rt-cpus=``, ``--rt-cpus ,``), which was taken as the default, any CPU, without a
    word: a pinning asked for and not done. Its numbers are checked by :func:`from_args` (``realtime.cpus``)."""
    if not any(c.strip() for c in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r}: give CPU numbers such as 1 or 0,1 (leave --rt-cpus out for any "
                                         "CPU)")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=path_arg, help=f"TOML file (default: {DEFAULT_CONFIG} when present)")
    p.add_argument("--model", type=path_arg, help="primary model (ONNX)")
    p.add_argument("--fallback-model", type=path_arg, help="fallback model (ONNX; default: the primary's file)")
    p.add_argument("--dock", choices=DOCK_KINDS, help="where the primary runs")
    p.add_argument("--standby", choices=("hot", "warm"), help="fallback standby mode")
    p.add_argument("--deadline-ms", type=float,
                   help="the primary's per-frame deadline at most (the adaptive deadline's ceiling), ms")
    p.add_argument("--wait-timeout-ms", type=float,
                   help=f"device wait timeout, ms (default 3000, at most {MAX_MS:g})")
    p.add_argument("--shadow-frames", type=int, help="agreeing shadow frames before returning to the primary")
    p.add_argument("--rt-policy", choices=tuple(POLICIES), help="the node's scheduling policy (default fifo; "
                   "other: no realtime)")
    p.add_argument("--rt-priority", type=int, help="the node's realtime priority, 1..99 (default 54, openpilot "
                   "modeld's; the worker runs one below); 0: no realtime policy, as --rt-policy other")
    p.add_argument("--rt-cpus", type=rt_cpus_arg,
                   help="CPUs to pin the node and its worker to, e.g. 1 or 0,1 (leave it out for any)")


def from_args(args: argparse.Namespace) -> NodeConfig:
    path = args.config if args.config is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    cfg = load_config(path)
    if args.model is not None:
        cfg.model.path = args.model.expanduser()
    if args.fallback_model is not None:
        cfg.fallback.path = args.fallback_model.expanduser()
    if args.dock is not None:
        cfg.dock.kind = args.dock
    if args.standby is not None:
        cfg.fallback.standby = args.standby
    if args.deadline_ms is not None:
        cfg.timing.deadline_ms = args.deadline_ms
    if args.wait_timeout_ms is not None:
        cfg.dock.wait_timeout_ms = args.wait_timeout_ms
    if args.shadow_frames is not None:
        cfg.timing.shadow_frames = args.shadow_frames
    if getattr(args, "rt_policy", None) is not None:
        cfg.realtime.policy = args.rt_policy
    if getattr(args, "rt_priority", None) is not None:
        cfg.realtime.priority = args.rt_priority
        if args.rt_priority == 0:
            cfg.realtime.policy = "other"
    if getattr(args, "rt_cpus", None) is not None:
        try:
            cfg.realtime.cpus = tuple(int(c) for c in args.rt_cpus.split(",") if c.strip())
        except ValueError as e:
            raise ConfigError("config", f"--rt-cpus {args.rt_cpus!r}: want CPU numbers such as 1 or 0,1") from e
    return validate(cfg)
