"""``chestnut probe``: run the qualification ladder against the twin or a real dock, step by step.

    chestnut probe --twin                      # the twin daemon of $CHESTNUT_PREFIX (chestnut twin serve)
    chestnut probe --twin --model m.onnx       # + model loaded + warm-up against its fingerprint
    chestnut probe --real --model m.onnx --fingerprint m.fp.json
    chestnut probe --record-fingerprint m.fp.json --model m.onnx   # on the host CPU, no dock
    chestnut probe --fill-firmware /path/to/linux-firmware/amdgpu   # fill tinygrad's GPU firmware cache

Each rung prints as it is decided: PASS / WARN / FAIL / SKIP, its duration and what was seen; then the
first failure and what to do about it. Exit status: 0 qualified (WARNs allowed), 1 a rung failed,
2 the probe could not run (bad arguments, unreadable files).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

from chestnut.backend import protocol as P
from chestnut.backend.errors import ChestnutError
from chestnut.backend.interface import LadderReport, LadderStep, ModelSpec, StepResult

MARKS = {StepResult.PASS: "PASS", StepResult.WARN: "WARN", StepResult.FAIL: "FAIL", StepResult.SKIPPED: "SKIP"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--twin", action="store_true", help="probe the twin daemon (default)")
    target.add_argument("--real", action="store_true", help="probe a real dock through tinygrad (DEV=USB+AMD:LLVM)")
    parser.add_argument("--prefix", help="twin runtime prefix (default: $CHESTNUT_PREFIX)")
    parser.add_argument("--model", type=Path, help="ONNX model: also run 'model loaded' and 'warm-up'")
    parser.add_argument("--name", help="model display name (default: the file stem)")
    parser.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,...",
                        help="fix an input's shape (repeatable)")
    parser.add_argument("--fingerprint", type=Path, help="recorded fingerprint JSON of the model (default: record "
                                                         "one now on the host CPU)")
    parser.add_argument("--record-fingerprint", type=Path, metavar="OUT",
                        help="record the model's fingerprint on the host CPU into OUT and exit")
    parser.add_argument("--fill-firmware", type=Path, metavar="DIR",
                        help="fill tinygrad's GPU firmware cache from DIR (linux-firmware amdgpu files) and exit")
    parser.add_argument("--wait-timeout-ms", type=int, default=P.WAIT_TIMEOUT_MS, help="device wait timeout")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    out = {}
    for item in items:
        name, _, dims = item.partition("=")
        try:
            out[name] = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise SystemExit(f"chestnut probe: bad --shape {item!r}; use NAME=D0,D1,...") from None
    return out


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
    if twin and fail.reason == "no_dock":
        print("(the twin: is its daemon running for this prefix? start it with `chestnut twin serve`)", file=out)


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
        return json.loads(out.read_text())


def prepare_on_dock(model: Path, fingerprint: Path) -> int:
    """``chestnut probe --real --model MODEL --fingerprint FP`` in a fresh process (tinygrad must be imported
    there with the dock's environment): the full ladder, whose ``model_loaded`` rung compiles the model on
    the dock and stores the captured JIT in the compile cache. Returns its exit status."""
    cmd = [sys.executable, "-m", "chestnut.launch.cli", "probe", "--real", "--model", str(model)]
    if fingerprint.is_file():
        cmd += ["--fingerprint", str(fingerprint)]
    env = {k: v for k, v in os.environ.items() if k not in ("DEV", "GMMU", "HCQDEV_WAIT_TIMEOUT_MS")}
    print(f"compiling {model} on the dock into the compile cache: {' '.join(cmd[2:])}", flush=True)
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
    if args.model is not None:
        if not args.model.is_file():
            print(f"chestnut probe: model {args.model} does not exist", file=sys.stderr)
            return 2
        spec = ModelSpec(args.model, args.name or args.model.stem, _shapes(args.shape))

    if args.record_fingerprint is not None:
        if spec is None:
            print("chestnut probe: --record-fingerprint needs --model", file=sys.stderr)
            return 2
        from chestnut.backend.fingerprint import record_fingerprint

        fp = record_fingerprint(spec)
        args.record_fingerprint.write_text(json.dumps(fp, indent=1))
        print(f"fingerprint of {spec.name} (seed {fp['seed']}) written to {args.record_fingerprint}")
        return 0

    runner: Any
    if args.real:
        from chestnut.backend.real_runner import RealRunner

        runner = RealRunner(wait_timeout_ms=args.wait_timeout_ms,
                            progress=None if args.json else (lambda line: print(f"       {line}", flush=True)))
    else:
        from chestnut.backend.twin_runner import TwinRunner

        runner = TwinRunner(args.prefix, wait_timeout_ms=args.wait_timeout_ms)

    if spec is not None:
        try:
            if args.fingerprint is not None:
                fp = json.loads(args.fingerprint.read_text())
            elif args.real:
                fp = _record_fingerprint_subprocess(spec)
            else:
                from chestnut.backend.fingerprint import record_fingerprint

                fp = record_fingerprint(spec)
        except (OSError, ValueError, subprocess.CalledProcessError, ChestnutError) as e:
            print(f"chestnut probe: no fingerprint for {spec.name}: {e}", file=sys.stderr)
            return 2
        spec = ModelSpec(spec.path, spec.name, spec.input_shapes, fp)

    from chestnut.backend.ladder import full_ladder

    target = "a real dock (tinygrad DEV=USB+AMD:LLVM)" if args.real else f"the twin (prefix {runner.prefix})"
    if not args.json:
        print(f"qualification ladder against {target}")
    try:
        report = full_ladder(runner, spec, on_step=None if args.json else print_step)
    finally:
        runner.close()
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print_summary(report, twin=not args.real)
    return 0 if report.passed else 1
