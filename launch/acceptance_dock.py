"""``chestnut acceptance``'s dock process: the ladder with the model's rungs, the copies and the fingerprint,
in a fresh process that owns the dock (:func:`dock_main`, run by :func:`run_dock_process`), as
``launch/acceptance.py``'s ``ladder``, ``copy_<bytes>`` and ``fingerprint`` steps describe them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

CHILD_TIMEOUT_S = 600.0  # the ladder's own bounds sum to about 230 s on a cold compile cache


def dock_main(params: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process that owns the dock: the ladder, the copies, the fingerprint and the identity. The runner
    takes the dock's lock in ``usb_ids`` and holds it to the end (``lock_first``): a dock another process holds (a
    serving node, a probe) fails the ladder there, ``lock_held``, and is never reset."""
    from chestnut.backend.fingerprint import compare, fixed_inputs, summarize
    from chestnut.backend.interface import ModelSpec
    from chestnut.backend.ladder import LadderConfig, model_steps, run_steps
    from chestnut.backend.probe import runner_identity

    runner: Any  # lock_first: the dock's lock at usb_ids, before any rung touches the dock (backend/ladder.py)
    if params["twin"]:
        from chestnut.backend.twin_runner import TwinRunner

        runner = TwinRunner(params["prefix"], wait_timeout_ms=params["wait_timeout_ms"], lock_first=True)
    else:
        from chestnut.backend.real_runner import RealRunner

        runner = RealRunner(wait_timeout_ms=params["wait_timeout_ms"], lock_first=True)
    fp = params["fingerprint"]
    spec = ModelSpec(Path(params["model"]), params["name"], {k: tuple(v) for k, v in params["shapes"].items()}, fp)
    out: dict[str, Any] = {"copies": [], "fingerprint": None}
    try:
        report = runner.qualify()
        if report.passed:
            out["copies"] = [copy_once(runner, n, params["twin"]) for n in params["sizes"]]
            run_steps(model_steps(runner, spec, LadderConfig(wait_timeout_ms=params["wait_timeout_ms"])), report)
        if report.passed:
            got = runner.run(fixed_inputs(runner._inputs, int(fp["seed"])))  # the specs load() found
            check = compare(fp, got)
            diff = max(
                abs(float(summarize(a)["mean"]) - float(fp["outputs"][k]["mean"]))
                for k, a in got.items()
                if k in fp["outputs"]
            )
            out["fingerprint"] = {
                "ok": check.ok,
                "exact": check.exact,
                "detail": check.detail,
                "max_mean_diff": diff,
                "seed": int(fp["seed"]),
            }
        out["ladder"] = report.to_json()
        out["identity"] = runner_identity(runner)
    finally:
        runner.close()
    return out


def copy_once(runner: Any, nbytes: int, twin: bool) -> dict[str, Any]:
    """Copy ``nbytes`` random bytes in and back out; MB/s each way (1 MB = 1e6 bytes)."""
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    try:
        if twin:  # the twin runner's copy path: tinygrad 0.14's AMDAllocator._copyin/_copyout over the twin's SDMA
            at = runner.scratch_offset(nbytes)  # free VRAM: below VRAM_HEAP_OFFSET are the rings
            t0 = time.perf_counter()
            runner._copy_in(at, data)
            t1 = time.perf_counter()
            back = bytes(runner._copy_out(at, nbytes))
            t2 = time.perf_counter()
        else:  # tinygrad's own Buffers on the dock (tinygrad 0.14 device.py Buffer.copy_from, as_memoryview)
            from tinygrad import Device, dtypes
            from tinygrad.device import Buffer

            buf = Buffer("AMD", nbytes, dtypes.uint8).allocate()
            src = Buffer("PYTHON", nbytes, dtypes.uint8, opaque=memoryview(bytearray(data)))
            t0 = time.perf_counter()
            buf.copy_from(src)
            Device["AMD"].synchronize()
            t1 = time.perf_counter()
            back = bytes(buf.as_memoryview())
            t2 = time.perf_counter()
    except Exception as e:  # a failed copy is this step's verdict, with the error as its detail
        return {"bytes": nbytes, "error": f"{type(e).__name__}: {e}"}
    return {
        "bytes": nbytes,
        "copy_in_mbps": round(nbytes / max(t1 - t0, 1e-9) / 1e6, 3),
        "copy_out_mbps": round(nbytes / max(t2 - t1, 1e-9) / 1e6, 3),
        "round_trip_exact": back == data,
    }


def run_dock_process(params: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """Run :func:`dock_main` in a fresh process (``python -m chestnut.launch.acceptance_dock PARAMS``) with
    ``env``; returns its result. Raises RuntimeError (with its last stderr line) when it fails, and
    ``subprocess.TimeoutExpired`` after :data:`CHILD_TIMEOUT_S`."""
    cmd = [sys.executable, "-m", "chestnut.launch.acceptance_dock", json.dumps(params)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"the dock's process exited {proc.returncode}: {tail[0]}")
    return dict(json.loads(lines[-1]))


if __name__ == "__main__":
    if len(sys.argv) == 2:
        print(json.dumps(dock_main(json.loads(sys.argv[1]))), flush=True)
        sys.exit(0)
    sys.exit(2)
