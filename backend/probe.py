"""``chestnut probe``: run the qualification ladder against the twin or a real dock, step by step.

    chestnut probe --twin                      # the twin daemon of $CHESTNUT_PREFIX (chestnut twin serve)
    chestnut probe --twin --model m.onnx       # + model loaded + warm-up against its fingerprint
    chestnut probe --real --model m.onnx --fingerprint m.fp.json
    chestnut probe --record-fingerprint m.fp.json --model m.onnx   # on the host CPU, no dock
    chestnut probe --fill-firmware /path/to/linux-firmware/amdgpu   # fill tinygrad's GPU firmware cache

Each rung prints as it is decided: PASS / WARN / FAIL / SKIP, its duration and what was seen; then the
first failure and what to do about it. A step still running after 2 s (recording the model's fingerprint,
a rung such as the model's compile) says so every 5 s with its time so far (:class:`Ticker`).

The probe takes the dock's lock (``backend/docklock.py``, the file tinygrad and a serving node hold) in the
``usb_ids`` rung, as soon as the dock's bus and address are known and before any rung sends the bridge a vendor
request or resets the GPU, and holds it to its exit (a node starting meanwhile is refused at its own ``usb_ids``,
``load_failed (usb): lock_held``, and backs off without touching the dock). A dock another process
holds is refused: ``usb_ids`` fails with ``lock_held`` (its line, or its entry with ``--json``; the later rungs are
not run) and one line on stderr names the holder, e.g. ``chestnut probe: the dock usb:3-2 is in use by pid 1234
(python -m chestnut.node.worker ...): it holds the dock's lock file /tmp/am_usb:3-2.lock; stop it first, then probe
again``.

Exit status: 0 qualified (WARNs allowed), 1 a rung failed,
or, against the twin, no twin daemon answers (one line first, how to start it; no ladder), 2 the probe could not run
(bad arguments, unreadable files, something not a socket of ours at the twin's socket path, a dock in use by another
process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from chestnut.backend import protocol as P
from chestnut.backend.errors import ChestnutError
from chestnut.backend.interface import LadderReport, LadderStep, ModelSpec, StepResult
from chestnut.msgs.argtypes import MAX_WAIT_TIMEOUT_MS, checked_int, path_arg
from chestnut.msgs.outdir import OutputDirError, file_target_problem, write_private

MARKS = {StepResult.PASS: "PASS", StepResult.WARN: "WARN", StepResult.FAIL: "FAIL", StepResult.SKIPPED: "SKIP"}
OS_RELEASE_MAX_BYTES = 64 << 10  # /etc/os-release is a few hundred bytes (os-release(5))
IDENTITY_KEYS = ("tinygrad", "host_os", "usb_id", "usb_path", "usb_speed_mbps", "bridge_firmware", "gpu_arch",
                 "gpu_firmware")


# ------------------------------------------------------------------ versions and identity
def host_os(os_release: Path = Path("/etc/os-release")) -> str:
    """``"<system> <kernel release> (<PRETTY_NAME>)"``: the kernel from ``platform``, the distribution from
    os-release(5) (read up to :data:`OS_RELEASE_MAX_BYTES`; left out when unreadable)."""
    import platform

    base = f"{platform.system()} {platform.release()}"
    try:
        with open(os_release, "rb") as f:
            text = f.read(OS_RELEASE_MAX_BYTES).decode(errors="replace")
    except OSError:
        return base
    for line in text.splitlines():
        if line.startswith("PRETTY_NAME="):
            return f"{base} ({line.split('=', 1)[1].strip().strip(chr(34))})"
    return base


def usb_identity(dev: Any) -> dict[str, str]:
    """The dock as USB sees it (a pyusb device; the twin's pyusb face gives the same fields):
    ``usb_id`` VID:PID, ``usb_path`` bus, port chain and address (``usb.core.Device.port_numbers``),
    ``usb_speed_mbps`` and ``bridge_firmware``, the device release number ``bcdDevice`` of the device
    descriptor (USB 2.0 spec 9.6.1), where the ASM2464's firmware reports its version."""
    from chestnut.backend.ladder import UsbDock

    ports = getattr(dev, "port_numbers", None) or ()
    bcd = getattr(dev, "bcdDevice", None)
    speed = UsbDock.speed_mbps(dev)
    return {
        "usb_id": f"0x{dev.idVendor:04X}:0x{dev.idProduct:04X}",
        "usb_path": f"bus {dev.bus} port {'.'.join(map(str, ports)) or '?'} address {dev.address}",
        "usb_speed_mbps": str(speed) if speed is not None else "unknown",
        "bridge_firmware": f"{bcd >> 8:x}.{bcd & 0xFF:02x} (bcdDevice 0x{bcd:04X})" if bcd is not None else "unknown",
    }


def gpu_firmware(arch: str, ip_versions: dict[int, tuple[int, ...]] | None = None) -> str:
    """The AMD firmware files tinygrad 0.14 loads for this GPU (``runtime/support/am/amdev.py``
    ``AMFirmware.__init__``: ``psp_<MP0>_sos``, ``smu_<MP1>``, ``sdma_<SDMA0>``, ``gc_<GC>_*``), each with
    the first 12 hex digits of its sha256 from tinygrad's table (``runtime/autogen/am/fw.py``), as
    ``"name@sha, ..."``. With ``ip_versions`` (tinygrad's ``AMDDevice.ip_versions``, HWIP id -> version)
    every IP block is named; without (the twin, whose GPU loads no firmware) the GC files of ``arch``."""
    from chestnut.backend.real_runner import firmware_hashes

    table = firmware_hashes()

    def ver(v: tuple[int, ...]) -> str:
        return "_".join(map(str, v))

    if ip_versions:
        gc, mp0, mp1, sdma = (ip_versions.get(k) for k in (1, 15, 16, 3))  # tinygrad am.py GC/MP0/MP1/SDMA0_HWIP
        prefixes = [f"psp_{ver(mp0)}_sos.bin" if mp0 else "", f"smu_{ver(mp1)}.bin" if mp1 else "",
                    f"sdma_{ver(sdma)}.bin" if sdma else "", f"gc_{ver(gc)}_" if gc else ""]
    else:
        digits = arch[3:] if arch.startswith("gfx") and len(arch) > 5 else ""
        try:
            prefixes = [f"gc_{int(digits[:-2])}_{int(digits[-2], 16)}_{int(digits[-1], 16)}_"] if digits else []
        except ValueError:
            prefixes = []
    names = sorted(n for n in table for p in prefixes if p and n.startswith(p))
    if any(n.startswith("gc_1") and n[3:5] in ("10", "11") for n in names):  # PFP/ME own files only from GC 12
        names = [n for n in names if not n.endswith(("_pfp.bin", "_me.bin"))]
    return ", ".join(f"{n}@{table[n][:12]}" for n in names) or "unknown"


def runner_identity(runner: Any) -> dict[str, str]:
    """Versions and identity of a qualified runner's dock (:data:`IDENTITY_KEYS`; "unknown" where not seen):
    tinygrad's version, the host OS, :func:`usb_identity`, the GPU architecture and :func:`gpu_firmware`.
    Works for the twin and the real runner alike; never raises."""
    from importlib.metadata import PackageNotFoundError, version

    out = dict.fromkeys(IDENTITY_KEYS, "unknown")
    try:
        out["tinygrad"] = version("tinygrad")
    except PackageNotFoundError:
        out["tinygrad"] = "absent"
    out["host_os"] = host_os()
    q = getattr(runner, "qualifier", None) or getattr(runner, "_qualifier", None)
    dev = getattr(q, "dev", None)
    if dev is not None:
        try:
            out.update(usb_identity(dev))
        except Exception:  # a vanished device: its fields stay unknown
            pass
    device = getattr(runner, "device", None)
    arch = str(getattr(device, "arch", "") or getattr(getattr(q, "gpu", None), "arch", "") or "")
    if arch:
        out["gpu_arch"] = arch
        try:
            out["gpu_firmware"] = gpu_firmware(arch, getattr(device, "ip_versions", None))
        except ChestnutError:
            pass
    return out


def _wait_timeout_ms(text: str) -> int:
    """``--wait-timeout-ms``: a whole number of milliseconds > 0 (a wait of 0 or less never waits for the GPU) and
    at most ``msgs/argtypes.py`` ``MAX_WAIT_TIMEOUT_MS`` (a minute, the node's own bound: a wait this long already
    leaves a hung dock unseen for a minute); one line, exit 2 otherwise."""
    return checked_int(text, lambda ms: 0 < ms <= MAX_WAIT_TIMEOUT_MS,
                       f"give a whole number of milliseconds, > 0 and <= {MAX_WAIT_TIMEOUT_MS} (a minute, the "
                       "node's own bound)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--twin", action="store_true", help="probe the twin daemon (default)")
    target.add_argument("--real", action="store_true", help="probe a real dock through tinygrad (DEV=USB+AMD:LLVM)")
    parser.add_argument("--prefix", help="twin runtime prefix (default: $CHESTNUT_PREFIX)")
    parser.add_argument("--model", type=path_arg, help="ONNX model: also run 'model loaded' and 'warm-up'")
    parser.add_argument("--name", help="model display name (default: the file stem)")
    parser.add_argument("--shape", type=shape_arg, action="append", default=[], metavar="NAME=D0,D1,...",
                        help="with --model: fix that model's input NAME to these positive dimensions (repeatable)")
    parser.add_argument("--fingerprint", type=path_arg, help="recorded fingerprint JSON of the model (default: record "
                                                         "one now on the host CPU)")
    parser.add_argument("--record-fingerprint", type=path_arg, metavar="OUT",
                        help="record the model's fingerprint on the host CPU into OUT and exit")
    parser.add_argument("--fill-firmware", type=path_arg, metavar="DIR",
                        help="fill tinygrad's GPU firmware cache from DIR (linux-firmware amdgpu files) and exit")
    parser.add_argument("--wait-timeout-ms", type=_wait_timeout_ms, default=P.WAIT_TIMEOUT_MS,
                        help=f"device wait timeout, ms > 0 and <= {MAX_WAIT_TIMEOUT_MS} "
                             f"(default {P.WAIT_TIMEOUT_MS}: tinygrad's)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def shape_arg(text: str) -> tuple[str, tuple[int, ...]]:
    """``--shape NAME=D0,D1,...``: a model input's name and its dimensions (each a positive integer, in
    elements); raises ``argparse.ArgumentTypeError`` (one line) otherwise."""
    name, _, dims = text.partition("=")
    parts = [d.strip() for d in dims.split(",")]
    if not name.strip() or not all(d.isdigit() and int(d) > 0 for d in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: want NAME=D0,D1,... (an input's name, positive dimensions)")
    return name.strip(), tuple(int(d) for d in parts)


def model_path_problem(path: Path) -> str | None:
    """Why ``--model`` ``path`` is no model file, told from its stat alone (a FIFO is never opened), or None:
    ``"does not exist"``, ``"is a FIFO, not a model file"`` (a folder, a device: ``msgs/video.py``
    ``file_kind``), or ``"cannot be read (<the OS's reason>)"`` -- a name over the file system's 255 bytes was a
    traceback (``OSError`` ``ENAMETOOLONG``), as ``--fingerprint`` says of such a path."""
    import errno
    import stat

    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return "does not exist"
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISREG(st.st_mode):
        return None
    from chestnut.msgs.video import file_kind

    return f"is {file_kind(st.st_mode)}, not a model file"


def fingerprint_target_problem(path: Path) -> str | None:
    """Why ``--record-fingerprint`` cannot write to ``path`` (checked before the model is loaded or
    compiled), or None: the rule of every output file named on a command line (``msgs/outdir.py``
    ``file_target_problem``, as ``launch --json``): its folder must exist and be a real folder of ours that no one
    else can write to (not ``/tmp`` itself), and ``path`` must not be a symlink (never followed), a folder or
    another non-regular file; a path the OS refuses to look up (a name over 255 bytes) is named with its reason."""
    problem = file_target_problem(path)
    return None if problem is None else f"--record-fingerprint {problem}"


PROGRESS_AFTER_S = 2.0  # a step still running after this long is said to be running ...
PROGRESS_EVERY_S = 5.0  # ... and again this often, with its time so far


class Ticker:
    """Progress for steps longer than :data:`PROGRESS_AFTER_S`: while one runs, a line ``... <what> (N s)``
    once it has run that long and every :data:`PROGRESS_EVERY_S` after, from a background thread. ``what``
    names the running step (:meth:`step` moves on to the next one); ``out`` None prints nothing (``--json``).
    A context manager: the thread ends with the block."""

    def __init__(self, what: str, out: TextIO | None = sys.stdout) -> None:
        self.out = out
        self._what, self._t0, self._said = what, time.monotonic(), 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="probe-progress", daemon=True)

    def step(self, what: str, now: float | None = None) -> None:
        """The next step, ``what``, runs from ``now`` (``time.monotonic()``; None: now)."""
        with self._lock:
            self._what, self._t0, self._said = what, time.monotonic() if now is None else now, 0

    def due(self, now: float) -> str | None:
        """The progress line owed at ``now`` (``time.monotonic()``), or None; counts it as said."""
        with self._lock:
            ran = now - self._t0
            owed = 0 if ran < PROGRESS_AFTER_S else 1 + int((ran - PROGRESS_AFTER_S) // PROGRESS_EVERY_S)
            if owed <= self._said:
                return None
            self._said = owed
            return f"       ... {self._what} ({ran:.0f} s)"

    def _loop(self) -> None:
        while not self._done.wait(0.25):
            line = self.due(time.monotonic())
            if line is not None and self.out is not None:
                print(line, file=self.out, flush=True)

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def _rung_words(name: str) -> str:
    return {"model_loaded": "model_loaded: loading and compiling the model", "warmup": "warmup: the first run"}.get(
        name, name
    )


def print_step(step: LadderStep, out: TextIO = sys.stdout) -> None:
    ms = step.duration_s * 1e3
    line = f"[{MARKS[step.result]}] {step.name:<15} {step.layer.value:<6} {ms:9.1f} ms  {step.detail}"
    print(line, file=out)
    if step.result in (StepResult.WARN, StepResult.FAIL) and step.advice:
        print(f"       {'':<15} {'':<6} {'':>12}  -> {step.advice}", file=out)
    out.flush()


def print_summary(report: LadderReport, out: TextIO = sys.stdout, twin: bool = False) -> None:
    fail = report.first_failure
    for s in report.steps:
        if s.result is StepResult.SKIPPED:
            print_step(s, out)
    if fail is None:
        warns = [s.name for s in report.steps if s.result is StepResult.WARN]
        print(f"qualified{' with warnings: ' + ', '.join(warns) if warns else ''}", file=out)
        return
    print(f"first failure: {fail.name} ({fail.layer.value} layer) -- {fail.detail}", file=out)
    print(f"what to do: {fail.advice}", file=out)
    if twin and fail.reason == "no_dock":  # its daemon answered before the ladder (twin_daemon_missing)
        print("(the twin: its daemon runs, but its dock is unplugged; `chestnut twin plug` plugs it in)", file=out)


def twin_daemon_missing(prefix: str | None) -> tuple[int, str] | None:
    """``(exit status, line)`` when no twin daemon of ``prefix`` (default ``$CHESTNUT_PREFIX``) answers, else None:
    the ladder would only say that no dock is enumerated, with a dock's cable-and-power advice. Nothing answers: 1, as
    for a dock that is not there, and the line says how to start the daemon; a twin socket path that holds something
    not a socket of ours (``backend/sim/client.py`` :class:`TwinSocketRefused`): 2, its line, as ``chestnut twin``."""
    from chestnut.backend.sim.client import daemon_missing

    missing = daemon_missing(prefix)
    if missing is None:
        return None
    code, line = missing
    return code, (f"{line}, then probe again" if code == 1 else line)


def _record_fingerprint_subprocess(spec: ModelSpec) -> dict[str, Any]:
    """Record the fingerprint in a DEV=CPU child: the dock's process must not import tinygrad for the CPU."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "fp.json"
        cmd = [sys.executable, "-m", "chestnut.launch.cli", "probe", "--model", str(spec.path), "--name", spec.name,
               "--record-fingerprint", str(out)]
        for k, v in spec.input_shapes.items():
            cmd += ["--shape", f"{k}={','.join(map(str, v))}"]
        env = {k: v for k, v in os.environ.items() if k not in ("DEV", "GMMU", "HCQDEV_WAIT_TIMEOUT_MS")}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        from chestnut.backend.fingerprint import read_fingerprint_file

        return read_fingerprint_file(out)  # the bounded reader of every fingerprint file


def dock_refused(report: LadderReport) -> str | None:
    """The one line for a dock whose lock the probe could not take, when ``usb_ids`` failed for it
    (``backend/ladder.py`` ``DockQualifier.take_lock``): ``lock_held`` (another process holds it: its holder's
    words, and to stop it first) or ``lock_unusable`` (the lock file is not one the node would use:
    ``backend/docklock.py``, its words and fix); else None. Nothing of the dock was touched in either case."""
    fail = report.first_failure
    if fail is None or fail.name != "usb_ids" or fail.error is None:
        return None
    if fail.reason == "lock_held":
        return f"{fail.error.detail}; stop it first, then probe again"
    if fail.reason == "lock_unusable":
        return str(fail.error.detail)
    return None


def prepare_on_dock(model: Path, fingerprint: Path) -> int:
    """``chestnut probe --real --model MODEL --fingerprint FP`` in a fresh process (tinygrad must be imported
    there with the dock's environment): the full ladder, whose ``model_loaded`` rung compiles the model on
    the dock and stores the captured JIT in the compile cache. Returns its exit status."""
    cmd = [sys.executable, "-m", "chestnut.launch.cli", "probe", "--real", "--model", str(model)]
    if fingerprint.is_file():
        cmd += ["--fingerprint", str(fingerprint)]
    env = {k: v for k, v in os.environ.items() if k not in ("DEV", "GMMU", "HCQDEV_WAIT_TIMEOUT_MS")}
    print(f"compiling {model} on the dock into the compile cache: chestnut {' '.join(cmd[3:])}", flush=True)
    return subprocess.run(cmd, env=env).returncode


def run(args: argparse.Namespace) -> int:
    if args.fill_firmware is not None:
        from chestnut.backend.real_runner import downloads_dir, fill_firmware

        try:
            res = fill_firmware(args.fill_firmware)
        except ChestnutError as e:
            print(f"chestnut probe: {e}", file=sys.stderr)
            return 2
        print(f"GPU firmware cache {downloads_dir() / 'fw'}: {len(res.copied)} copied, {len(res.already)} already "
              f"there, {len(res.bad_hash)} with a wrong sha256 (skipped), {len(res.not_found)} not in "
              f"{args.fill_firmware}")
        for name in res.bad_hash:
            print(f"  wrong sha256: {name}")
        return 0 if res.copied or res.already else 1

    spec = None
    if args.shape and args.model is None:
        print("chestnut probe: --shape fixes the input shapes of --model; give --model too (or leave --shape out)",
              file=sys.stderr)
        return 2
    if args.model is not None:
        if (what := model_path_problem(args.model)) is not None:
            print(f"chestnut probe: model {args.model} {what}", file=sys.stderr)
            return 2
        spec = ModelSpec(args.model, args.name or args.model.stem, dict(args.shape))  # shape_arg's (name, dims) pairs

    if args.record_fingerprint is not None:
        if spec is None:
            print("chestnut probe: --record-fingerprint needs --model", file=sys.stderr)
            return 2
        if (problem := fingerprint_target_problem(args.record_fingerprint)) is not None:
            print(f"chestnut probe: {problem}", file=sys.stderr)
            return 2
        from chestnut.backend.fingerprint import record_fingerprint

        try:
            fp = record_fingerprint(spec)
            write_private(args.record_fingerprint, json.dumps(fp, indent=1))  # 0600, temp file + rename, no symlink
        except ChestnutError as e:  # not an ONNX model, a shape it cannot take: one line
            print(f"chestnut probe: no fingerprint for {spec.name}: {e}", file=sys.stderr)
            return 2
        except OutputDirError as e:  # the target turned into a symlink, its folder into another's since the check
            print(f"chestnut probe: --record-fingerprint {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"chestnut probe: --record-fingerprint {args.record_fingerprint}: {e.strerror or e}",
                  file=sys.stderr)
            return 2
        print(f"fingerprint of {spec.name} (seed {fp['seed']}) written to {args.record_fingerprint}")
        return 0

    recorded = None  # --fingerprint's, read before the dock is touched (backend/fingerprint.py's bounded reader)
    if spec is not None and args.fingerprint is not None:
        from chestnut.backend.fingerprint import FingerprintFileError, read_fingerprint_file

        try:
            recorded = read_fingerprint_file(args.fingerprint)
        except FingerprintFileError as e:  # a FIFO is never opened, a huge file never read: one line
            print(f"chestnut probe: --fingerprint {e}", file=sys.stderr)
            return 2

    runner: Any
    if args.real:
        from chestnut.backend.real_runner import RealRunner

        runner = RealRunner(wait_timeout_ms=args.wait_timeout_ms, lock_first=True,
                            progress=None if args.json else (lambda line: print(f"       {line}", flush=True)))
    else:
        if (refused := twin_daemon_missing(args.prefix)) is not None:
            code, line = refused
            print(f"chestnut probe: {line}", file=sys.stderr)
            return code
        from chestnut.backend.twin_runner import TwinRunner

        runner = TwinRunner(args.prefix, wait_timeout_ms=args.wait_timeout_ms, lock_first=True)

    out = None if args.json else sys.stdout  # progress lines would break the JSON
    if spec is not None:
        try:
            if recorded is not None:
                fp = recorded
            else:
                with Ticker(f"recording the fingerprint of {spec.name} on the host CPU (tinygrad compiles it)", out):
                    if args.real:
                        fp = _record_fingerprint_subprocess(spec)
                    else:
                        from chestnut.backend.fingerprint import record_fingerprint

                        fp = record_fingerprint(spec)
        except (OSError, ValueError, subprocess.CalledProcessError, ChestnutError) as e:
            runner.close()  # the dock's claim (a real one's USB interface) goes back before the exit
            print(f"chestnut probe: no fingerprint for {spec.name}: {e}", file=sys.stderr)
            return 2
        spec = ModelSpec(spec.path, spec.name, spec.input_shapes, fp)

    from chestnut.backend.ladder import STEPS, full_ladder

    target = "a real dock (tinygrad DEV=USB+AMD:LLVM)" if args.real else f"the twin (prefix {runner.prefix})"
    if not args.json:
        print(f"qualification ladder against {target}", flush=True)
    names = [name for name, _ in STEPS]
    ticker = Ticker(_rung_words(names[0]), out)

    def on_step(step: LadderStep) -> None:
        print_step(step)
        later = names[names.index(step.name) + 1 :] if step.name in names else []
        ticker.step(_rung_words(later[0]) if later else "the ladder's end")

    try:
        with ticker:
            report = full_ladder(runner, spec, on_step=None if args.json else on_step)
        identity = runner_identity(runner)
    finally:
        runner.close()
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    if (lock_refusal := dock_refused(report)) is not None:
        print(f"chestnut probe: {lock_refusal}", file=sys.stderr)
        return 2
    if not args.json:
        print("identity: " + "; ".join(f"{k} {v}" for k, v in identity.items()))
        print_summary(report, twin=not args.real)
    return 0 if report.passed else 1
