"""The primary runner on a real Chestnut dock: tinygrad 0.14 with ``DEV=USB+AMD:LLVM``, kept thin.

What it adds around tinygrad (``docs/protocol.md``; tinygrad 0.14 ``runtime/ops_amd.py``, ``runtime/support/usb.py``,
``runtime/support/system.py``):

- **Environment first.** ``DEV=USB+AMD:LLVM``, ``GMMU=0`` and ``HCQDEV_WAIT_TIMEOUT_MS=3000`` are
  set before tinygrad is imported (its ``getenv`` is cached), only in the process that owns the dock
  (:func:`prepare_environment` raises :class:`ConfigError` if tinygrad is already imported with other
  settings). ``Device.DEFAULT`` is never evaluated with ``DEV`` unset.
- **The GPU firmware cache.** tinygrad downloads AMD firmware on first use into
  ``~/.cache/tinygrad/downloads/fw/`` (file name = md5 of the linux-firmware URL). An offline node
  needs it filled in advance: :func:`check_firmware_cache` says so clearly, and
  :func:`fill_firmware` (``chestnut probe --fill-firmware DIR``) fills it from a local copy of
  linux-firmware's ``amdgpu/`` files, checking each file's sha256 against tinygrad's table.
- **The device lock.** tinygrad takes a non-blocking ``flock`` on ``<tmpdir>/am_usb:<bus>-<addr>.lock``
  and never releases it. :class:`~chestnut.backend.docklock.DockLock` opens it safely (no symlink, no
  chmod), waits for it with back-off and then names the lock file and the process holding it,
  instead of failing on the first try. With ``lock_first`` (the node's worker, ``chestnut probe``,
  ``chestnut acceptance``) the ladder's ``usb_ids`` takes it before any rung touches the dock, and tinygrad
  is handed that same lock when it opens the device (``backend/docklock.py``): it is never let go in between.
- **Clear errors.** Every tinygrad failure is classified (:mod:`chestnut.backend.classify`); no dock is
  "no Chestnut dock found", never an ``ExceptionGroup``; a link that is not at LTSSM 0x78 is a PCIe
  error. The ladder's dock steps run through pyusb before tinygrad opens the device, and the LTSSM
  step powers the link on with a bounded wait for training (tinygrad 0.14 reads it only once).
- **The copy path's own timing.** Every copy-in / copy-out of a frame is rated (MB/s) and every
  frame's fence wait timed (:class:`CopyTimer`); ``probe()`` reports them for the usb layer's health.
- **The model, precompiled.** ``OnnxRunner`` in a ``TinyJit`` on the dock (captured on the 2nd call),
  kept in the compile cache (:mod:`chestnut.backend.jitcache`, its ownership and HMAC rules) under a
  key of the model's sha256, the input specs, the device *and its GPU architecture*
  (``"AMD:gfx1100"``) and the tinygrad version: a start or a recovery with a warm cache unpickles the
  captured kernels and runs them once against the recorded output digest instead of compiling the
  graph again (openpilot#35172: "takes 2m to load the model" when it compiles). A cold start compiles,
  captures and stores, with a progress line per phase; ``chestnut model prepare --for-dock`` does that
  ahead of time.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from chestnut.backend import protocol as P
from chestnut.backend.classify import classify
from chestnut.backend.docklock import (
    LOCK_BACKOFF_S,
    DockLock,
    dock_lock_path,
    keep_umask_around_tinygrads_lock,
    lock_holders,
)
from chestnut.backend.errors import ChestnutError, ConfigError, GpuLayerError, ModelError, UsbLayerError
from chestnut.backend.interface import DockObservation, LadderReport, LadderStep, ModelSpec, StepResult
from chestnut.backend.jitcache import CacheKey, JitCache, private_tinygrad_cache
from chestnut.backend.ladder import DockQualifier, LadderConfig, Outcome, UsbDock
from chestnut.backend.model import TensorSpec, outputs_digest, verification_inputs
from chestnut.backend.retry import RetryPolicy, install_in_tinygrad
from chestnut.backend.stages import StageClock
from chestnut.backend.warp import WarpSpec, warp_program, warp_tensor

REAL_DEV = "USB+AMD:LLVM"  # tinygrad 0.14: the AMD GPU behind the USB bridge, LLVM compiler
TINYGRAD_DEVICE = "AMD"
FW_COMMIT = "0a6871b19abf5d6e024b5d208b101ae53e7fa0de"  # tinygrad 0.14 helpers.fetch_fw pins linux-firmware here
FW_URL = "https://gitlab.com/kernel-firmware/linux-firmware/-/raw/{commit}/{path}/{name}"

log = logging.getLogger("chestnut.real_runner")


# ------------------------------------------------------------------ environment
def real_environment(wait_timeout_ms: int = P.WAIT_TIMEOUT_MS) -> dict[str, str]:
    """The variables tinygrad must see at import in the dock's process (tinygrad 0.14 ``helpers.py``
    ``getenv`` is cached)."""
    return {"DEV": REAL_DEV, "GMMU": "0", "HCQDEV_WAIT_TIMEOUT_MS": str(int(wait_timeout_ms))}


def prepare_environment(
    wait_timeout_ms: int = P.WAIT_TIMEOUT_MS,
    environ: MutableMapping[str, str] | None = None,
    modules: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Set :func:`real_environment` in ``environ`` (default ``os.environ``) before tinygrad's import.

    Raises :class:`ConfigError` ``tinygrad_imported`` if tinygrad is already imported in this process
    and the environment differs (its cached ``getenv`` would ignore the new values). Returns the
    variables set.
    """
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if environ is os.environ:
        private_tinygrad_cache()  # tinygrad's disk cache: a private directory, or off (backend/jitcache.py)
    want = real_environment(wait_timeout_ms)
    if "tinygrad" in modules:
        wrong = {k: environ.get(k) for k, v in want.items() if environ.get(k) != v}
        if wrong:
            raise ConfigError(
                "tinygrad_imported",
                f"tinygrad was imported in this process before the dock's "
                f"environment was set ({wrong} instead of {want}); run the "
                f"dock in a fresh process",
            )
        return want
    environ.update(want)
    return want


# ------------------------------------------------------------------ GPU firmware cache
def tinygrad_root() -> Path:
    """tinygrad's package directory, found without importing it."""
    spec = importlib.util.find_spec("tinygrad")
    if spec is None or spec.origin is None:
        raise ConfigError("no_tinygrad", "tinygrad is not installed")
    return Path(spec.origin).parent


def firmware_hashes() -> dict[str, str]:
    """tinygrad 0.14's AMD firmware table (``runtime/autogen/am/fw.py``): file name -> sha256, read as text."""
    src = (tinygrad_root() / "runtime" / "autogen" / "am" / "fw.py").read_text()
    for node in ast.parse(src).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "hashes" for t in node.targets):
            return dict(ast.literal_eval(node.value))
    raise ConfigError("no_firmware_table", "tinygrad's runtime/autogen/am/fw.py has no `hashes` table")


def downloads_dir(environ: Mapping[str, str] | None = None) -> Path:
    """tinygrad 0.14 ``helpers._ensure_downloads_dir``: ``/raid/downloads`` on a tinybox, else
    ``$XDG_CACHE_HOME`` (default ``~/.cache``) ``/tinygrad/downloads``."""
    environ = os.environ if environ is None else environ
    if Path("/etc/tinybox-release").is_file():
        return Path("/raid/downloads")
    return Path(environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))) / "tinygrad" / "downloads"


def firmware_url(name: str, path: str = "amdgpu") -> str:
    return FW_URL.format(commit=FW_COMMIT, path=path, name=name)


def firmware_cache_file(name: str, environ: Mapping[str, str] | None = None) -> Path:
    """Where tinygrad's ``fetch(url, subdir="fw")`` keeps firmware ``name``: ``<downloads>/fw/<md5(url)>``."""
    return downloads_dir(environ) / "fw" / hashlib.md5(firmware_url(name).encode()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def firmware_status(
    environ: Mapping[str, str] | None = None, hashes: Mapping[str, str] | None = None
) -> tuple[list[str], list[str]]:
    """(cached with the right sha256, not cached) firmware names of tinygrad's table."""
    hashes = firmware_hashes() if hashes is None else hashes
    present: list[str] = []
    missing: list[str] = []
    for name, sha in sorted(hashes.items()):
        f = firmware_cache_file(name, environ)
        (present if f.is_file() and _sha256(f) == sha else missing).append(name)
    return present, missing


def check_firmware_cache(environ: Mapping[str, str] | None = None, hashes: Mapping[str, str] | None = None) -> int:
    """Raise ConfigError ``firmware_missing`` if the cache holds none of tinygrad's AMD firmware files.

    (Which files a GPU needs is known only once tinygrad reads its IP versions; an empty cache is
    certain to fail offline, a partial one is reported by the load if a file is missing.) Returns the
    number of files cached.
    """
    present, missing = firmware_status(environ, hashes)
    if not present:
        where = downloads_dir(environ) / "fw"
        raise ConfigError(
            "firmware_missing",
            f"the GPU firmware cache {where} holds none of the {len(missing)} AMD "
            f"firmware files tinygrad needs, and an offline node cannot download "
            f"them: fill it with `chestnut probe --fill-firmware DIR` (DIR = a "
            f"copy of linux-firmware's amdgpu/ files)",
        )
    return len(present)


@dataclass
class FirmwareFill:
    """What :func:`fill_firmware` did, by firmware file name."""

    copied: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    bad_hash: list[str] = field(default_factory=list)
    not_found: list[str] = field(default_factory=list)


def _read_firmware(src: Path, name: str) -> bytes | None:
    for base in (src, src / "amdgpu"):
        if (base / name).is_file():
            return (base / name).read_bytes()
        if (base / f"{name}.zst").is_file():
            import zstandard

            return zstandard.ZstdDecompressor().decompress(
                (base / f"{name}.zst").read_bytes(), max_output_size=64 << 20
            )
    return None


def fill_firmware(
    src: Path, environ: Mapping[str, str] | None = None, hashes: Mapping[str, str] | None = None
) -> FirmwareFill:
    """Copy tinygrad's AMD firmware files from ``src`` (or ``src/amdgpu``; ``.zst`` accepted) into the cache.

    A file is written only if its sha256 matches tinygrad's table; writes are atomic (temp + rename).
    Raises ConfigError ``no_firmware_dir`` if ``src`` is not a directory.
    """
    if not src.is_dir():
        raise ConfigError("no_firmware_dir", f"{src} is not a directory")
    hashes = firmware_hashes() if hashes is None else hashes
    out = FirmwareFill()
    for name, sha in sorted(hashes.items()):
        dest = firmware_cache_file(name, environ)
        if dest.is_file() and _sha256(dest) == sha:
            out.already.append(name)
            continue
        data = _read_firmware(src, name)
        if data is None:
            out.not_found.append(name)
            continue
        if hashlib.sha256(data).hexdigest() != sha:
            out.bad_hash.append(name)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=dest.parent, delete=False) as tmp:
            tmp.write(data)
        os.replace(tmp.name, dest)
        out.copied.append(name)
    return out


# ------------------------------------------------------------------ the copy path's own timing
COPY_STATS_KEY = "copy_timing"  # DockObservation.extra key of CopyTimer.stats() (node/health.py reads it)
MIN_TIMED_COPY_BYTES = 4096  # smaller copies are latency, not bandwidth: not rated
BASELINE_COPIES = 8  # the first copies of a size class: the rate this link gives it
COPY_WINDOW = 16  # the latest copies of a size class (and fence waits) the stats speak for


def _size_class(direction: str, nbytes: int) -> tuple[str, int]:
    return direction, 1 << max(0, int(nbytes) - 1).bit_length()


class CopyTimer:
    """The copy path's own timing, for the usb layer's health (openpilot#38483: one link register "is not
    sufficient on a wide range of devices"; the copies themselves are the end-to-end evidence).

    :meth:`copy` records one copy (``"in"`` / ``"out"``, bytes, seconds); copies of at least
    :data:`MIN_TIMED_COPY_BYTES` are rated in MB/s (1e6 bytes/s) per direction and size class (the
    power of two at or above ``nbytes``). A class's *baseline* is the median rate of its first
    :data:`BASELINE_COPIES` copies -- the rate this host, cable and bridge give it, since that varies
    too widely for a table -- and its *current* rate the median of its latest :data:`COPY_WINDOW`
    (medians: one late copy on a busy host is no marginal link). :meth:`fence` records how long a
    frame's completion (its fence / signal) took against ``wait_timeout_ms``. :meth:`stats` is JSON-ready.
    """

    def __init__(self, wait_timeout_ms: float = P.WAIT_TIMEOUT_MS, window: int = COPY_WINDOW) -> None:
        self.wait_timeout_ms = float(wait_timeout_ms)
        self.window = window
        self.copies = 0
        self.first: dict[tuple[str, int], list[float]] = {}
        self.recent: dict[tuple[str, int], list[float]] = {}
        self.fences: list[float] = []  # ms
        self.fence_count = 0

    def copy(self, direction: str, nbytes: int, seconds: float) -> None:
        self.copies += 1
        if nbytes < MIN_TIMED_COPY_BYTES:
            return
        mbps = nbytes / max(seconds, 1e-9) / 1e6
        cls = _size_class(direction, nbytes)
        first = self.first.setdefault(cls, [])
        if len(first) < BASELINE_COPIES:
            first.append(mbps)
        self.recent[cls] = [*self.recent.get(cls, [])[-(self.window - 1) :], mbps]

    def fence(self, seconds: float) -> None:
        self.fence_count += 1
        self.fences = [*self.fences[-(self.window - 1) :], seconds * 1e3]

    def stats(self) -> dict[str, Any]:
        """``copies`` (all), ``rated`` (size classes with a baseline and a full window), the ``slowest``
        class relative to its baseline (``direction``, ``bytes`` = the class, ``mbps`` = current median,
        ``baseline_mbps``, ``ratio``), ``fences`` (all), ``fence_max_ms`` in the window and
        ``wait_timeout_ms``."""
        slowest: dict[str, Any] | None = None
        rated = 0
        for cls, recent in sorted(self.recent.items()):
            first = self.first[cls]
            if len(first) < BASELINE_COPIES or len(recent) < self.window:
                continue
            rated += 1
            base, now = float(np.median(first)), float(np.median(recent))
            ratio = now / base if base > 0 else 1.0
            if slowest is None or ratio < slowest["ratio"]:
                slowest = {
                    "direction": cls[0],
                    "bytes": cls[1],
                    "mbps": round(now, 3),
                    "baseline_mbps": round(base, 3),
                    "ratio": round(ratio, 4),
                }
        return {
            "copies": self.copies,
            "rated": rated,
            "slowest": slowest,
            "fences": self.fence_count,
            "fence_max_ms": round(max(self.fences), 3) if self.fences else None,
            "wait_timeout_ms": self.wait_timeout_ms,
        }


# ------------------------------------------------------------------ the compiled model
# a cached JIT's load, s: read + HMAC check + unpickle (weights copied in) + one verification run;
# tests/bench/bench_dock_jit.py measures 0.5 s for the PP-OCRv4 detector on the host CPU (25.9 s cold)
WARM_LOAD_BOUND_S = 15.0


def tinygrad_version() -> str:
    """The installed tinygrad's version (package metadata; tinygrad is not imported)."""
    from importlib.metadata import version

    return version("tinygrad")


def dock_cache_key(
    onnx_bytes: bytes, inputs: tuple[TensorSpec, ...], device: str, arch: str, tg_version: str | None = None
) -> CacheKey:
    """The compile cache's key for a captured JIT of ``onnx_bytes`` on ``device`` (a tinygrad device name)
    with GPU architecture ``arch`` (tinygrad 0.14 ``runtime/ops_amd.py`` ``AMDDevice.arch``, e.g.
    ``"gfx1100"``): the device field is ``"<device>:<arch>"``, so an entry built for another GPU never
    matches."""
    return CacheKey(
        hashlib.sha256(onnx_bytes).hexdigest(),
        tuple((s.name, s.shape, s.dtype) for s in inputs),
        f"{device}:{arch}",
        tg_version or tinygrad_version(),
    )


def cached_on_dock(model_bytes: bytes, root: Path | None = None) -> bool:
    """Whether the compile cache at ``root`` (default: :func:`~chestnut.backend.jitcache.default_cache_dir`)
    names an entry for this model on the dock (device ``AMD:<arch>``) and the installed tinygrad.

    A hint for the start-up budget only (``node/config.py``): the GPU architecture is known once the dock
    is opened, and whether the entry is trusted is decided by :meth:`JitCache.load` when it is loaded.
    Metadata files are read as JSON, up to :data:`~chestnut.backend.jitcache.MAX_META_BYTES` each;
    nothing is unpickled. A missing or unreadable cache is cold.
    """
    from chestnut.backend.jitcache import MAX_META_BYTES, default_cache_dir

    root = default_cache_dir() if root is None else root
    sha, tg = hashlib.sha256(model_bytes).hexdigest(), tinygrad_version()
    try:
        metas = sorted(root.glob("*.json"))
    except OSError:
        return False
    for meta_path in metas:
        try:
            if not meta_path.is_file() or meta_path.is_symlink() or meta_path.stat().st_size > MAX_META_BYTES:
                continue
            key = json.loads(meta_path.read_bytes()).get("key", {})
        except (OSError, ValueError, AttributeError):
            continue
        if (
            isinstance(key, dict)
            and key.get("model_sha256") == sha
            and str(key.get("device", "")).startswith(f"{TINYGRAD_DEVICE}:")
            and key.get("tinygrad_version") == tg
        ):
            return True
    return False


@dataclass
class DockJit:
    """A captured model on a tinygrad device: ``call(inputs)`` runs it (name -> numpy array, in and out).

    ``built``: compiled in this process (a cold cache) rather than loaded from the compile cache;
    ``key``: its compile cache key; ``stored``: where the entry was written (None if not).
    """

    jit: Any
    device: str
    outputs: tuple[TensorSpec, ...]
    key: CacheKey
    built: bool
    stored: Path | None = None

    def call(
        self, inputs: dict[str, np.ndarray], timer: CopyTimer | None = None, stages: StageClock | None = None
    ) -> dict[str, np.ndarray]:
        """One run; with ``timer``, each input's copy-in, the run's completion (fence) and each output's
        copy-out are timed; with ``stages``, the same three spans are its stage times (s).

        What tinygrad 0.14 lets one time without changing it: ``copy_in`` is each input's
        ``Tensor(a, device).realize()`` (the allocation and ``AMDAllocator._copyin``); ``compute`` is
        the captured JIT's launch (``TinyJit.__call__``) to ``Device.synchronize()`` (its signal wait:
        ``HCQSignal.wait``); ``copy_out`` each output's ``Tensor.numpy()`` (``AMDAllocator._copyout``) and
        its copy into a host array. Without a ``timer`` or ``stages`` nothing is synchronized between."""
        from tinygrad import Tensor

        clock = time.perf_counter
        timed = timer is not None or stages is not None
        if stages is not None:
            stages.begin()
        moved = {}
        for k, v in inputs.items():
            a = np.ascontiguousarray(v)
            t0 = clock()
            moved[k] = Tensor(a, device=self.device).realize()
            dt = clock() - t0
            if timer is not None:
                timer.copy("in", a.nbytes, dt)
            if stages is not None:
                stages.add("copy_in", dt)
        t0 = clock()
        out = self.jit(**moved)
        if timed:
            from tinygrad import Device

            Device[self.device].synchronize()
            dt = clock() - t0
            if timer is not None:
                timer.fence(dt)
            if stages is not None:
                stages.add("compute", dt)
        result = {}
        for k, t in out.items():
            t0 = clock()
            result[k] = t.numpy().copy()
            dt = clock() - t0
            if timer is not None:
                timer.copy("out", result[k].nbytes, dt)
            if stages is not None:
                stages.add("copy_out", dt)
        if stages is not None:
            stages.end()
        return result


def load_or_build_jit(
    onnx_bytes: bytes,
    name: str,
    inputs: tuple[TensorSpec, ...],
    device: str,
    arch: str,
    cache: JitCache | None,
    progress: Callable[[str], None] | None = None,
    tg_version: str | None = None,
    warp: WarpSpec | None = None,
) -> DockJit:
    """The model's captured ``TinyJit`` on ``device``: from ``cache`` when a trusted entry for this key
    reproduces its recorded output digest, else parsed, compiled, captured (three calls on zeros;
    tinygrad 0.14 ``engine/jit.py`` ``TinyJit`` captures on the 2nd) and stored.

    The same code path serves the dock (``device="AMD"``) and the host CPU (``"CPU"``, how it is
    tested without a dock). ``progress`` receives one line per phase. Raises what tinygrad raises
    (the runner translates it); a refused or stale entry is rebuilt (the cache logs why).

    With ``warp`` (``backend/warp.py``), ``inputs`` is the raw frame's one spec and the JIT is the warp
    (``warp_tensor``) then the model, one graph on ``device``: on a dock the full frame is copied in and
    warped on the GPU. Its key is the program image's (``warp_program``), so each warp has its own entry.
    """
    say = progress or (lambda _msg: None)
    image = onnx_bytes if warp is None else warp_program(warp, onnx_bytes)
    key = dock_cache_key(image, inputs, device, arch, tg_version)
    check = verification_inputs(inputs)
    if cache is not None and (hit := cache.load(key)) is not None:
        jit, meta = hit
        say(f"{name}: compile cache hit for {key.device} ({key.digest[:12]}); verifying")
        dj = DockJit(jit, device, tuple(TensorSpec.from_json(o) for o in meta.get("outputs", [])), key, built=False)
        if outputs_digest(dj.call(check)) == meta.get("verify_digest"):
            return dj
        say(f"{name}: cached entry {key.digest[:12]} reproduced another output; rebuilding")
    from tinygrad import Tensor, TinyJit, dtypes
    from tinygrad.nn.onnx import OnnxRunner

    say(f"{name}: parsing the ONNX graph for {device} ({arch})")
    runner = OnnxRunner(Tensor(onnx_bytes, dtype=dtypes.uint8, device="CPU"))
    runner.to(device)
    if warp is None:
        jit = TinyJit(lambda **kw: {k: v.realize() for k, v in runner(kw).items()})
    else:
        (frame_name,) = (s.name for s in inputs)
        jit = TinyJit(
            lambda **kw: {k: v.realize() for k, v in runner({frame_name: warp_tensor(warp, kw[frame_name])}).items()}
        )
    dj = DockJit(jit, device, (), key, built=True)
    zeros = {s.name: np.zeros(s.shape, s.dtype) for s in inputs}
    say(f"{name}: first run on {device} (compiles every kernel: minutes for a real model on a dock)")
    outs = dj.call(zeros)
    say(f"{name}: capturing the JIT")
    dj.call(zeros)
    dj.call(zeros)
    dj.outputs = tuple(TensorSpec(k, tuple(v.shape), v.dtype.name) for k, v in outs.items())
    if cache is not None:
        extra = {
            "outputs": [o.to_json() for o in dj.outputs],
            "verify_digest": outputs_digest(dj.call(check)),
            "model_name": name,
            "arch": arch,
        }
        dj.stored = cache.store(key, jit, extra)
        say(f"{name}: compiled and {'cached as ' + str(dj.stored) if dj.stored else 'not cached (refused)'}")
    return dj


# ------------------------------------------------------------------ the runner
class _TinygradConfigSpace:
    """Configuration reads through tinygrad's own controller (``CustomASM24Controller.pcie_cfg_req``), for
    :func:`~chestnut.backend.ladder.check_bars` on a dock tinygrad owns."""

    def __init__(self, ctrl: Any) -> None:
        self.ctrl = ctrl

    def cfg_read(self, byte_addr: int, bus: int = P.GPU_BUS, dev: int = 0, fn: int = 0, size: int = 4) -> int:
        return int(self.ctrl.pcie_cfg_req(byte_addr, bus=bus, dev=dev, fn=fn, size=size))


def check_tinygrads_bars(device: Any) -> None:
    """The BARs tinygrad's ``USBPCIDevice.__init__`` assigned with ``System.pci_setup_usb_bars``
    (``device.iface.pci_dev._bar_info``), checked as the twin's ladder checks them
    (:func:`~chestnut.backend.ladder.check_bars`, read back through tinygrad's controller). Raises the typed
    error; a device without a USB PCI device (not a dock) is not checked."""
    from chestnut.backend.ladder import check_bars

    pci = getattr(getattr(device, "iface", None), "pci_dev", None)
    bars = getattr(pci, "_bar_info", None)
    if pci is None or not isinstance(bars, dict):
        return
    try:
        check_bars(_TinygradConfigSpace(pci.usb), dict(bars))
    except ChestnutError:
        raise
    except Exception as e:
        raise translate(e) from e


class RealRunner:
    """:class:`~chestnut.backend.interface.PrimaryRunner` on a real dock through tinygrad 0.14.

    Construct it only in the process that will own the dock (it sets the environment; see
    :func:`prepare_environment`). ``usb_backend`` is passed to pyusb for the ladder's USB steps.
    ``jit_cache``: the compile cache (True = :class:`~chestnut.backend.jitcache.JitCache` at its default
    directory, None/False = compile every time); ``progress`` receives the load's phase lines (default:
    this module's log, INFO). ``lock_first``: the ladder's ``usb_ids`` takes the dock's lock (one try;
    :class:`~chestnut.backend.ladder.DockQualifier` ``lock``) and the runner holds it from then on: ``gpu_arch``
    hands it to tinygrad without letting go (tinygrad's own ``flock_acquire`` gets a ``dup`` of the held
    descriptor, :func:`~chestnut.backend.docklock.keep_umask_around_tinygrads_lock`), and a re-qualification in
    this process keeps it (the node's worker, ``chestnut probe``, ``chestnut acceptance``: a dock another process
    holds is refused before the LTSSM rung's power-on). Otherwise ``gpu_arch`` waits for the lock to be free
    (with back-off) and tinygrad takes it.
    """

    kind = "real"

    def __init__(
        self,
        *,
        wait_timeout_ms: int = P.WAIT_TIMEOUT_MS,
        lock_timeout_s: float = 10.0,
        config: LadderConfig | None = None,
        usb_backend: Any = None,
        jit_cache: JitCache | None | bool = True,
        progress: Callable[[str], None] | None = None,
        lock_first: bool = False,
    ) -> None:
        prepare_environment(wait_timeout_ms)
        self.jit_cache = JitCache() if jit_cache is True else (jit_cache or None)
        self.progress = progress or (lambda line: log.info("%s", line))
        self.compiled: DockJit | None = None
        self.copy_timer = CopyTimer(wait_timeout_ms)
        self.stages = StageClock()  # the last run's copy-in / compute / copy-out (s), for the stage budget
        self.config = config or LadderConfig(wait_timeout_ms=wait_timeout_ms)
        self.lock_timeout_s = lock_timeout_s
        self.lock_first = lock_first
        self.dock = UsbDock(usb_backend, self.config.ctrl_timeout_ms)
        self._lock: DockLock | None = None  # lock_first: the one usb_ids took, kept across re-qualifications
        self.device: Any = None
        self._jit: Any = None
        self._inputs: tuple[TensorSpec, ...] = ()
        self._outputs: tuple[TensorSpec, ...] = ()
        self.model_inputs: tuple[TensorSpec, ...] = ()  # the model's own (= the inputs without a warp)
        self.model_compiled: DockJit | None = None  # with a warp: the model alone, for the warm-up
        self._qualifier: DockQualifier | None = None
        self._failed: ChestnutError | None = None

    # ------------------------------------------------------------------ qualification
    def qualify(self, on_step: Callable[[LadderStep], None] | None = None) -> LadderReport:
        """The dock rungs: USB steps and the LTSSM through pyusb (no claim), then ``gpu_arch`` by opening
        tinygrad's device (firmware cache check, lock with back-off, BARs and GPU init inside tinygrad); with
        ``lock_first``, ``usb_ids`` takes the dock's lock first (one held already is kept) and tinygrad is
        handed it."""
        self._qualifier = DockQualifier(self.dock, self.config, gpu_step=self._gpu_step, lock=self.lock_first)
        if self.lock_first:  # one held already is kept: a second open of the file would not get it
            self._qualifier.dock_lock = self._lock
        report = self._qualifier.run(on_step=on_step)
        if self.lock_first:
            self._lock = self._qualifier.dock_lock
        return report

    def _gpu_step(self, q: DockQualifier) -> Outcome:
        check_firmware_cache()
        path = dock_lock_path(q.dev.bus, q.dev.address)
        if q.dock_lock is None or q.dock_lock.fd is None:  # not lock_first: wait until nobody holds it
            DockLock(path).wait_free(self.lock_timeout_s)
        # lock_first: usb_ids's lock stays held; tinygrad's flock_acquire is handed a dup of it (backend/docklock.py)
        self.device = self._open_device(path)
        check_tinygrads_bars(self.device)
        arch = str(getattr(self.device, "arch", ""))
        if arch not in P.SUPPORTED_ARCHS:
            raise GpuLayerError(
                "unsupported_arch",
                f"tinygrad opened a {arch or 'unknown'} GPU; supported: {', '.join(P.SUPPORTED_ARCHS)}",
            )
        return Outcome(StepResult.PASS, f"AMD {arch} opened by tinygrad ({REAL_DEV})")

    def _open_device(self, lock_path: Path) -> Any:
        """``Device["AMD"]`` with lock retries; every failure typed (no ExceptionGroup, "no Chestnut dock found")."""
        deadline = time.monotonic() + self.lock_timeout_s
        attempt = 0
        while True:
            try:
                from tinygrad import Device

                # tinygrad's USB3 with bounded retry of idempotent transfers (backend/retry.py); the GPU's wait is ours
                install_in_tinygrad(RetryPolicy(gpu_wait_ms=self.config.wait_timeout_ms))
                keep_umask_around_tinygrads_lock()  # its lock call leaves umask(0) (backend/docklock.py)
                return Device[TINYGRAD_DEVICE]
            except Exception as e:
                err = translate(e)
                if err.reason == "lock_held" and time.monotonic() < deadline:
                    time.sleep(LOCK_BACKOFF_S[min(attempt, len(LOCK_BACKOFF_S) - 1)])
                    attempt += 1
                    continue
                if err.reason == "lock_held":
                    holders = lock_holders(lock_path)
                    who = f"pid {', '.join(map(str, holders))}" if holders else "another process"
                    raise UsbLayerError(
                        "lock_held", f"the dock's lock file {lock_path} is held by {who} ({err.detail})"
                    ) from e
                raise err from e

    # ------------------------------------------------------------------ model
    def load(self, model: ModelSpec) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        """The model's captured JIT on the dock, from the compile cache or built and stored
        (:func:`load_or_build_jit`)."""
        self._check_alive()
        if self.device is None:
            report = self.qualify()
            failure = report.first_failure
            if failure is not None:
                raise failure.error or GpuLayerError("not_qualified", failure.detail)
        from chestnut.backend.model import _graph_inputs, model_label

        path = Path(model.path)
        if not path.is_file():
            raise ModelError("missing_model", f"model file {path} does not exist")
        onnx_bytes = path.read_bytes()
        self.model_inputs = _graph_inputs(onnx_bytes, model_label(model.name, path), dict(model.input_shapes))
        self._inputs = self.model_inputs if model.warp is None else (warped_input(model.warp, self.model_inputs),)
        self.model_compiled = None
        try:
            self.compiled = load_or_build_jit(
                onnx_bytes, model.name, self._inputs, TINYGRAD_DEVICE, self.arch, self.jit_cache, self.progress,
                warp=model.warp,
            )
            if model.warp is not None:  # the model alone too: the warm-up's fingerprint is recorded on its input
                self.model_compiled = load_or_build_jit(
                    onnx_bytes, model.name, self.model_inputs, TINYGRAD_DEVICE, self.arch, self.jit_cache,
                    self.progress,
                )
        except ChestnutError:
            raise
        except Exception as e:
            raise self._fail(translate(e)) from e
        self._jit = self.compiled.jit
        self._outputs = self.compiled.outputs
        return self._inputs, self._outputs

    @property
    def arch(self) -> str:
        """The opened GPU's architecture (tinygrad 0.14 ``AMDDevice.arch``), "" before ``gpu_arch``."""
        return str(getattr(self.device, "arch", ""))

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One inference on the dock. ModelError for wrong inputs; a layer error for any dock failure.
        Sets ``stages.last`` (s) for a run that returns; what each stage includes: :meth:`DockJit.call`."""
        self.stages.begin()
        self._check_alive()
        if self._jit is None:
            raise ModelError("not_loaded", "no model is loaded")
        compiled = self.compiled
        if self.model_compiled is not None and inputs_match(self.model_inputs, inputs):
            compiled = self.model_compiled  # a warped program's model on its own input (the warm-up)
        else:
            check_inputs(self._inputs, inputs)
        assert compiled is not None
        try:
            return compiled.call(inputs, self.copy_timer, self.stages)
        except Exception as e:
            raise self._fail(translate(e)) from e

    # ------------------------------------------------------------------ health
    def probe(self) -> DockObservation:
        """USB presence, IDs, bus/address and speed (pyusb), the LTSSM byte (one control transfer) and the
        copy path's timing (:class:`CopyTimer`, ``extra[COPY_STATS_KEY]``)."""
        obs = self.dock.observe()
        if self._failed is not None:
            obs.extra["failed"] = str(self._failed)
        obs.extra[COPY_STATS_KEY] = self.copy_timer.stats()
        return obs

    def close(self) -> None:
        """Drop the model, pyusb's handle and the dock's lock ``usb_ids`` took (``lock_first``); tinygrad keeps its
        lock (handed over by ``gpu_arch``, or its own) and claim until the process exits."""
        self._jit = None
        if self._qualifier is not None:
            self._qualifier.release()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _check_alive(self) -> None:
        if self._failed is not None:
            raise type(self._failed)(
                self._failed.reason,
                f"the dock failed earlier in this process and tinygrad "
                f"keeps that state; start a fresh process "
                f"({self._failed.detail})",
            )

    def _fail(self, err: ChestnutError) -> ChestnutError:
        if err.layer is not None:
            self._failed = err
        return err


def inputs_match(specs: tuple[TensorSpec, ...], inputs: dict[str, np.ndarray]) -> bool:
    """Whether ``inputs`` are exactly ``specs`` (names, shapes, dtypes): :func:`check_inputs` without raising."""
    return set(inputs) == {s.name for s in specs} and all(
        isinstance(inputs[s.name], np.ndarray)
        and tuple(inputs[s.name].shape) == s.shape
        and inputs[s.name].dtype == np.dtype(s.dtype)
        for s in specs
    )


def warped_input(warp: WarpSpec, model_inputs: tuple[TensorSpec, ...]) -> TensorSpec:
    """The raw frame spec a warped program takes in place of the model's one input. Raises ModelError
    ``bad_warp`` when the model's inputs are not the one float32 [1, 3, h, w] tensor the warp makes."""
    want = TensorSpec(model_inputs[0].name if model_inputs else "x", warp.output_shape, "float32")
    if model_inputs != (want,):
        got = ", ".join(f"{s.name} {s.dtype}{list(s.shape)}" for s in model_inputs)
        raise ModelError("bad_warp", f"the warp makes float32{list(warp.output_shape)}; the model's inputs are {got}")
    return warp.frame_spec(want.name)


def check_inputs(specs: tuple[TensorSpec, ...], inputs: dict[str, np.ndarray]) -> None:
    """Raise ModelError unless ``inputs`` has exactly ``specs``' names, shapes and dtypes."""
    if set(inputs) != {s.name for s in specs}:
        raise ModelError("bad_input", f"inputs {sorted(inputs)} != model inputs {[s.name for s in specs]}")
    for s in specs:
        a = inputs[s.name]
        if not isinstance(a, np.ndarray) or tuple(a.shape) != s.shape or a.dtype != np.dtype(s.dtype):
            got = f"{a.dtype}{list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
            raise ModelError("bad_input", f"input {s.name!r}: got {got}, want {s.dtype}{list(s.shape)}")


def translate(exc: BaseException) -> ChestnutError:
    """tinygrad's failure as a typed error, with dock-specific wording for two of tinygrad 0.14's messages.

    No dock (tinygrad: "AMD:0 does not exist (0 devices available)", possibly inside an
    ExceptionGroup) becomes UsbLayerError ``no_dock`` "no Chestnut dock found ..."; a missing GPU
    firmware download becomes ConfigError with the fill command; everything else is :func:`classify`.
    """
    err = classify(exc)
    if err.reason == "no_dock":
        ids = ", ".join(f"0x{v:04X}:0x{p:04X}" for v, p in P.USB_IDS)
        out: ChestnutError = UsbLayerError("no_dock", f"no Chestnut dock found (no USB device {ids}): {err.detail}")
    elif err.reason == "firmware_download_failed":
        out = ConfigError(
            "firmware_missing",
            f"the GPU firmware is not in {downloads_dir() / 'fw'} and cannot be "
            f"downloaded: fill the cache with `chestnut probe --fill-firmware DIR` "
            f"({err.detail})",
        )
    else:
        return err
    out.__cause__ = exc
    return out
