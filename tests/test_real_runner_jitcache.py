"""The real runner's precompiled model (``backend/real_runner.py`` ``load_or_build_jit``) on the host CPU.

The dock runs the same function with ``device="AMD"``; here it runs with ``device="CPU"`` and an
architecture named by the test. Compiles are counted at tinygrad 0.14's ``device.py``
``Compiler.compile_cached`` (every kernel the graph needs goes through it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from chestnut.backend.jitcache import JitCache
from chestnut.backend.model import TensorSpec, ensure_cpu_device

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

INPUTS = (TensorSpec("x", (1, 3, 32, 64), "float32"),)
ARCH = "gfx1100"


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the ONNX graph is parsed for a build (tinygrad 0.14 ``nn/onnx.py`` ``OnnxRunner``).

    In one process tinygrad keeps lowered programs in memory, so a rebuild there compiles little;
    compile calls are counted across fresh processes in the last test, as a recovery's worker is one.
    """
    ensure_cpu_device()
    import tinygrad.nn.onnx as onnx_mod

    seen: list[int] = []
    real = onnx_mod.OnnxRunner

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **kw) -> None:
            seen.append(1)
            super().__init__(*a, **kw)

    monkeypatch.setattr(onnx_mod, "OnnxRunner", Counting)
    return seen


def _build(onnx_bytes: bytes, cache: JitCache, arch: str = ARCH, tg_version: str | None = None, lines=None):
    from chestnut.backend.real_runner import load_or_build_jit

    say = lines.append if lines is not None else None
    return load_or_build_jit(onnx_bytes, "tiny", INPUTS, "CPU", arch, cache, say, tg_version)


def _x() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(5).random((1, 3, 32, 64), dtype=np.float32)}


def test_first_start_builds_and_stores_with_progress_then_second_loads_without_compiling(
    tiny_onnx: Path, tmp_path: Path, parses: list[int]
) -> None:
    data = tiny_onnx.read_bytes()
    cache = JitCache(tmp_path / "jit")
    lines: list[str] = []
    first = _build(data, cache, lines=lines)
    assert first.built is True
    assert first.key.device == "CPU:gfx1100"
    assert first.stored == tmp_path / "jit" / f"{first.key.digest}.pkl"
    assert first.outputs == (TensorSpec("prob", (1, 1, 16, 32), "float32"),)
    assert [ln.split(": ", 1)[1].split(" ")[0] for ln in lines] == ["parsing", "first", "capturing", "compiled"]
    assert parses == [1]
    want = first.call(_x())

    parses.clear()
    lines.clear()
    second = _build(data, cache, lines=lines)
    assert second.built is False
    assert parses == []
    assert len(lines) == 1 and lines[0].startswith("tiny: compile cache hit for CPU:gfx1100")
    assert second.outputs == first.outputs
    got = second.call(_x())
    assert np.array_equal(got["prob"], want["prob"])
    assert parses == []


def test_an_entry_for_another_architecture_is_rebuilt_not_used(
    tiny_onnx: Path, tmp_path: Path, parses: list[int]
) -> None:
    data = tiny_onnx.read_bytes()
    cache = JitCache(tmp_path / "jit")
    other = _build(data, cache, arch="gfx1201")
    parses.clear()
    mine = _build(data, cache, arch=ARCH)
    assert mine.built is True and parses == [1]
    assert mine.key.digest != other.key.digest
    assert sorted(p.name for p in (tmp_path / "jit").glob("*.pkl")) == sorted(
        [f"{other.key.digest}.pkl", f"{mine.key.digest}.pkl"]
    )


def test_an_entry_for_another_tinygrad_version_is_rebuilt_not_used(
    tiny_onnx: Path, tmp_path: Path, parses: list[int]
) -> None:
    data = tiny_onnx.read_bytes()
    cache = JitCache(tmp_path / "jit")
    old = _build(data, cache, tg_version="0.13.0")
    assert old.key.tinygrad_version == "0.13.0"
    parses.clear()
    now = _build(data, cache)
    from importlib.metadata import version

    assert now.key.tinygrad_version == version("tinygrad")
    assert now.built is True and parses == [1]


def test_a_second_start_in_a_fresh_process_loads_the_cached_jit(tiny_onnx: Path, tmp_path: Path) -> None:
    """A recovery is a fresh worker process: the entry written by one process is loaded by the next."""
    code = textwrap.dedent(f"""
        import json, sys
        from chestnut.backend.model import TensorSpec, ensure_cpu_device
        ensure_cpu_device()
        from tinygrad import Device
        from tinygrad.codegen import to_program_cache
        Device["CPU"]  # opening the device builds its own queue programs (signal, wait, ...): not the model's
        before = len(to_program_cache)
        from chestnut.backend.jitcache import JitCache
        from chestnut.backend.real_runner import load_or_build_jit
        dj = load_or_build_jit(open({str(tiny_onnx)!r}, "rb").read(), "tiny",
                               (TensorSpec("x", (1, 3, 32, 64), "float32"),), "CPU", "gfx1100",
                               JitCache(__import__("pathlib").Path({str(tmp_path / "jit")!r})))
        print(json.dumps({{"built": dj.built, "compiles": len(to_program_cache) - before}}))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("DEV", "GMMU", "HCQDEV_WAIT_TIMEOUT_MS")}

    def start() -> dict:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=150)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = start()
    assert first["built"] is True and first["compiles"] > 0
    assert start() == {"built": False, "compiles": 0}


def _host_has_libusb() -> bool:
    """Whether pyusb finds a backend on this host (the ones ``usb.core.find`` tries, in its order)."""
    import usb.backend.libusb0
    import usb.backend.libusb1
    import usb.backend.openusb

    return any(m.get_backend() is not None for m in (usb.backend.libusb1, usb.backend.libusb0, usb.backend.openusb))


def test_prepare_for_dock_without_a_dock_names_the_first_rung(tiny_onnx: Path, tmp_path: Path) -> None:
    """``chestnut model prepare --for-dock`` climbs the ladder in a fresh process; with no dock it says so."""
    code = textwrap.dedent(f"""
        from pathlib import Path
        from chestnut.backend.probe import prepare_on_dock
        raise SystemExit(prepare_on_dock(Path({str(tiny_onnx)!r}), Path({str(tmp_path / "none.json")!r})))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("DEV", "GMMU", "HCQDEV_WAIT_TIMEOUT_MS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == (
        f"compiling {tiny_onnx} on the dock into the compile cache: chestnut probe --real --model {tiny_onnx}"
    )
    # The first rung fails either way; what it names depends on the host: without libusb (no pyusb backend
    # loads: pyusb 1.3 usb.core.find raises NoBackendError) nothing can be enumerated, a configuration
    # error with its install advice (backend/classify.py no_libusb), not a missing dock.
    why = "no Chestnut dock found" if _host_has_libusb() else "ConfigError no_libusb"
    assert any(ln.startswith("[FAIL] usb_ids") and why in ln for ln in lines), out.stdout
    assert any(ln.startswith("identity: tinygrad ") and "usb_path unknown" in ln for ln in lines)
    assert lines[-1].startswith("what to do: ")
