"""The real-dock runner, everything that runs without a dock: environment order, firmware cache, the lock,
error translation, and the ladder's USB steps through the twin's pyusb face (in a child process, as the
dock's own process would run them)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import urllib.error
from pathlib import Path

import pytest
import zstandard

from chestnut.backend.errors import ConfigError, UsbLayerError
from chestnut.backend.real_runner import (
    FW_COMMIT,
    DockLock,
    check_firmware_cache,
    dock_lock_path,
    fill_firmware,
    firmware_cache_file,
    firmware_hashes,
    lock_holders,
    prepare_environment,
    real_environment,
    tinygrad_root,
    translate,
)
from chestnut.backend.sim.client import running_twin

pytestmark = pytest.mark.timeout(120)


def child(code: str, env: dict[str, str] | None = None, timeout_s: float = 90) -> dict:
    """Run ``code`` in a fresh interpreter (no tinygrad imported yet); it prints one JSON line last."""
    base = {k: v for k, v in os.environ.items() if k not in ("DEV", "GMMU", "HCQDEV_WAIT_TIMEOUT_MS")}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**base, **(env or {})},
                         capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_environment_is_set_before_tinygrad_is_imported():
    got = child("""
        import json, sys
        from chestnut.backend.real_runner import prepare_environment
        before = "tinygrad" in sys.modules
        env = prepare_environment()
        import tinygrad
        from tinygrad.device import Device
        from tinygrad.helpers import getenv
        print(json.dumps({"before": before, "env": env, "wait": getenv("HCQDEV_WAIT_TIMEOUT_MS", 30000),
                          "gmmu": getenv("GMMU", 1), "opened": sorted(Device._opened_devices)}))
    """)
    assert got == {"before": False, "env": {"DEV": "USB+AMD:LLVM", "GMMU": "0", "HCQDEV_WAIT_TIMEOUT_MS": "3000"},
                   "wait": 3000, "gmmu": 0, "opened": []}


def test_tinygrad_already_imported_for_another_device_is_a_config_error():
    environ = {"DEV": "CPU"}
    with pytest.raises(ConfigError) as info:
        prepare_environment(environ=environ, modules={"tinygrad": object()})
    assert info.value.reason == "tinygrad_imported"
    assert environ == {"DEV": "CPU"}  # untouched
    same = dict(real_environment())
    assert prepare_environment(environ=same, modules={"tinygrad": object()}) == real_environment()
    fresh: dict[str, str] = {}
    prepare_environment(1500, environ=fresh, modules={})
    assert fresh["HCQDEV_WAIT_TIMEOUT_MS"] == "1500"


def test_no_dock_is_said_plainly_never_as_an_exception_group():
    group = ExceptionGroup("No interface for AMD:0 is available", [
        RuntimeError("No KFD"), RuntimeError("AMD:0 does not exist (0 devices available)")])
    err = translate(group)
    assert isinstance(err, UsbLayerError) and not isinstance(err, BaseExceptionGroup)
    assert err.reason == "no_dock" and err.detail.startswith("no Chestnut dock found")
    assert translate(RuntimeError("AMD:0 does not exist (0 devices available)")).reason == "no_dock"


def test_a_firmware_download_failure_names_the_fill_command():
    err = translate(urllib.error.URLError("[Errno -3] Temporary failure in name resolution"))
    assert isinstance(err, ConfigError) and err.reason == "firmware_missing"
    assert "chestnut probe --fill-firmware DIR" in err.detail
    assert translate(RuntimeError("PCIe link not up (LTSSM=0x00), custom firmware not ready")).reason == "link_down"


# ------------------------------------------------------------------ the GPU firmware cache
def test_firmware_table_and_url_are_tinygrads():
    table = firmware_hashes()
    assert len(table) > 20 and "psp_13_0_0_sos.bin" in table
    assert all(len(v) == 64 for v in table.values())
    assert FW_COMMIT in (tinygrad_root() / "helpers.py").read_text()


def test_cache_file_is_where_tinygrads_fetch_fw_looks(tmp_path):
    got = child("""
        import hashlib, json
        from chestnut.backend.real_runner import firmware_cache_file
        data = b"not really firmware"
        path = firmware_cache_file("gc_99_0_0_mec.bin")
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        from chestnut.backend.model import ensure_cpu_device
        ensure_cpu_device()
        from tinygrad.helpers import fetch_fw
        blob = fetch_fw("amdgpu", "gc_99_0_0_mec.bin", hashlib.sha256(data).hexdigest())  # no network here
        print(json.dumps({"same": blob == data, "path": str(path)}))
    """, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert got["same"] and got["path"].startswith(str(tmp_path / "tinygrad" / "downloads" / "fw"))


def test_fill_firmware_checks_every_file_and_the_cache_check(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    src = tmp_path / "linux-firmware" / "amdgpu"
    src.mkdir(parents=True)
    good, packed = b"good firmware", b"packed firmware"
    (src / "good.bin").write_bytes(good)
    (src / "packed.bin.zst").write_bytes(zstandard.ZstdCompressor().compress(packed))
    (src / "tampered.bin").write_bytes(b"evil")
    table = {"good.bin": hashlib.sha256(good).hexdigest(), "packed.bin": hashlib.sha256(packed).hexdigest(),
             "tampered.bin": hashlib.sha256(b"honest").hexdigest(), "absent.bin": "0" * 64}
    with pytest.raises(ConfigError) as info:
        check_firmware_cache(env, table)
    assert info.value.reason == "firmware_missing" and "--fill-firmware" in info.value.detail
    res = fill_firmware(src.parent, env, table)
    assert (res.copied, res.bad_hash, res.not_found) == (["good.bin", "packed.bin"], ["tampered.bin"], ["absent.bin"])
    assert firmware_cache_file("packed.bin", env).read_bytes() == packed
    assert check_firmware_cache(env, table) == 2
    assert fill_firmware(src.parent, env, table).already == ["good.bin", "packed.bin"]
    with pytest.raises(ConfigError):
        fill_firmware(tmp_path / "nowhere", env, table)


def test_probe_fill_firmware_command(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = subprocess.run([sys.executable, "-m", "chestnut.launch.cli", "probe", "--fill-firmware", str(empty)],
                         env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert "0 copied" in out.stdout and f"not in {empty}" in out.stdout


# ------------------------------------------------------------------ the device lock
def hold_lock(path: Path) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,os,sys; fd=os.open(sys.argv[1], os.O_RDWR|os.O_CREAT, 0o666); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_lock_held_by_another_process_backs_off_then_names_file_and_pid(tmp_path):
    path = tmp_path / "am_usb:3-7.lock"
    holder = hold_lock(path)
    try:
        assert lock_holders(path) == [holder.pid]
        sleeps: list[float] = []
        lock = DockLock(path, sleep=sleeps.append, clock=lambda: sum(sleeps))
        with pytest.raises(UsbLayerError) as info:
            lock.acquire(timeout_s=1.0)
        assert info.value.reason == "lock_held"
        assert str(path) in info.value.detail and f"pid {holder.pid}" in info.value.detail
        assert sleeps == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.25])  # back-off, capped by the deadline
    finally:
        holder.kill()
        holder.wait()
    lock = DockLock(path).acquire(timeout_s=1.0)
    assert lock.fd is not None and lock_holders(path) == [os.getpid()]
    lock.release()
    assert lock_holders(path) == []


def test_lock_path_is_tinygrads():
    import tempfile

    assert dock_lock_path(2, 5) == Path(tempfile.gettempdir()) / "am_usb:2-5.lock"
    assert "{devpref.lower()}_{pcibus.lower()}.lock" in (tinygrad_root() / "runtime/support/system.py").read_text()


# ------------------------------------------------------------------ the ladder through the twin's pyusb face
QUALIFY = """
    import json, sys
    import chestnut.backend.real_runner as rr
    from chestnut.backend.ladder import LadderConfig
    from chestnut.backend.sim.pyusb_backend import twin_backend
    {setup}
    r = rr.RealRunner(config=LadderConfig(stability_window_s=0.1), lock_timeout_s=0.5,
                      usb_backend=twin_backend(cached=False))
    report = r.qualify()
    print(json.dumps({{"steps": report.to_json(), "tinygrad": "tinygrad" in sys.modules}}))
"""
FAKE_FIRMWARE = """
    import hashlib
    data = b"fake"
    rr.firmware_hashes = lambda: {"fake.bin": hashlib.sha256(data).hexdigest()}
    p = rr.firmware_cache_file("fake.bin"); p.parent.mkdir(parents=True, exist_ok=True); p.write_bytes(data)
"""


def by_name(steps: list[dict]) -> dict[str, dict]:
    return {s["name"]: s for s in steps}


def test_usb_steps_pass_through_the_twin_then_an_empty_firmware_cache_stops_gpu_arch(tmp_path):
    with running_twin():
        got = child(QUALIFY.format(setup=""), env={"XDG_CACHE_HOME": str(tmp_path)})
    steps = by_name(got["steps"])
    assert [steps[n]["result"] for n in ("usb_ids", "link_speed", "link_stability", "ltssm")] == ["pass"] * 4
    assert "custom" in steps["usb_ids"]["detail"] and "LTSSM=0x78" in steps["ltssm"]["detail"]
    assert steps["gpu_arch"]["result"] == "fail" and steps["gpu_arch"]["reason"] == "firmware_missing"
    assert "--fill-firmware" in steps["gpu_arch"]["detail"]
    assert got["tinygrad"] is False  # nothing imported tinygrad before the dock's environment could be set


def test_lock_held_on_the_twin_stops_gpu_arch_naming_the_lock(tmp_path):
    with running_twin() as twin:
        twin.fault("lock_held")
        got = child(QUALIFY.format(setup=textwrap.indent(textwrap.dedent(FAKE_FIRMWARE), "    ").strip()),
                    env={"XDG_CACHE_HOME": str(tmp_path)})
        st = twin.status()
    gpu = by_name(got["steps"])["gpu_arch"]
    assert gpu["result"] == "fail" and gpu["reason"] == "lock_held"
    assert str(dock_lock_path(st["usb"]["bus"], st["usb"]["address"])) in gpu["detail"]
    assert f"pid {twin.daemon.pid}" in gpu["detail"]


LOCK_FIRST = """
    import json, os, sys
    import chestnut.backend.real_runner as rr
    from chestnut.backend.docklock import dock_lock_path, lock_holders
    from chestnut.backend.ladder import LadderConfig
    from chestnut.backend.sim.pyusb_backend import twin_backend
    {setup}
    r = rr.RealRunner(config=LadderConfig(stability_window_s=0.1), lock_timeout_s=0.5,
                      usb_backend=twin_backend(cached=False), lock_first=True)
    out = {{"steps": r.qualify().to_json(), "tinygrad": "tinygrad" in sys.modules}}
    if r._qualifier.dev is not None:
        path = dock_lock_path(r._qualifier.dev.bus, r._qualifier.dev.address)
        out["held"] = lock_holders(path) == [os.getpid()]
        out["again"] = r.qualify().to_json()  # a re-qualification in this process: the lock is kept, not retaken
        out["held_again"] = lock_holders(path) == [os.getpid()]
        r.close()
        out["after_close"] = lock_holders(path)
    print(json.dumps(out))
"""


def test_with_lock_first_a_dock_another_process_holds_fails_usb_ids_and_nothing_else_runs(tmp_path):
    """The node's worker (``lock_first``): the twin daemon holding the dock's lock, as another process would, fails
    ``usb_ids``; no later rung touches the dock (the LTSSM's power-on), and tinygrad is never imported."""
    with running_twin() as twin:
        twin.fault("lock_held")
        st = twin.status()
        got = child(LOCK_FIRST.format(setup=""), env={"XDG_CACHE_HOME": str(tmp_path)})
        after = twin.status()
    path = dock_lock_path(st["usb"]["bus"], st["usb"]["address"])
    assert [(s["name"], s["result"], s["reason"]) for s in got["steps"]] == [
        ("usb_ids", "fail", "lock_held"), ("link_speed", "skipped", ""), ("link_stability", "skipped", ""),
        ("ltssm", "skipped", ""), ("gpu_arch", "skipped", "")]
    detail = got["steps"][0]["detail"]
    assert detail.startswith(f"UsbLayerError lock_held: the dock usb:{st['usb']['bus']}-{st['usb']['address']} is in "
                             f"use by pid {twin.daemon.pid} (")
    assert detail.endswith(f"): it holds the dock's lock file {path}")
    assert got["tinygrad"] is False and got["held"] is False
    assert [(s["name"], s["result"], s["reason"]) for s in got["again"]][0] == ("usb_ids", "fail", "lock_held")
    assert got["after_close"] == [twin.daemon.pid]  # still the twin's: nothing of ours was held, nothing taken
    assert (after["bridge"], after["pcie"]) == (st["bridge"], st["pcie"])  # not powered on, not reset


def test_with_lock_first_the_lock_usb_ids_took_is_held_through_the_ladder_and_kept_on_requalifying(tmp_path):
    """``usb_ids`` takes the lock, ``gpu_arch`` keeps it (it no longer lets go for tinygrad to take it again:
    ``backend/docklock.py`` hands it over), a second ``qualify()`` in the process keeps the same lock, and
    ``close()`` gives back what tinygrad never got (here tinygrad finds no dock: the twin has no libusb face)."""
    with running_twin() as twin:
        st = twin.status()
        got = child(LOCK_FIRST.format(setup=textwrap.indent(textwrap.dedent(FAKE_FIRMWARE), "    ").strip()),
                    env={"XDG_CACHE_HOME": str(tmp_path)})
    path = dock_lock_path(st["usb"]["bus"], st["usb"]["address"])
    for steps in (got["steps"], got["again"]):
        assert [(s["name"], s["result"], s["reason"]) for s in steps] == [
            ("usb_ids", "pass", ""), ("link_speed", "pass", ""), ("link_stability", "pass", ""), ("ltssm", "pass", ""),
            ("gpu_arch", "fail", "no_dock")]
        assert steps[0]["detail"].endswith(f", lock {path} taken")
    assert (got["held"], got["held_again"], got["after_close"]) == (True, True, [])


def test_tinygrad_without_libusb_is_a_config_error(tmp_path):
    # LIBUSB_PATH names a file that is no library: tinygrad 0.14 `runtime/support/c.py` `DLL.findlib` takes an
    # existing LIBUSB_PATH first and only otherwise searches the system, so a missing path would find a system
    # libusb where one is installed
    broken = tmp_path / "no-libusb.so"
    broken.write_text("not a shared library\n")
    with running_twin():
        got = child(QUALIFY.format(setup=textwrap.indent(textwrap.dedent(FAKE_FIRMWARE), "    ").strip()),
                    env={"XDG_CACHE_HOME": str(tmp_path), "LIBUSB_PATH": str(broken)})
    gpu = by_name(got["steps"])["gpu_arch"]
    assert gpu["result"] == "fail" and gpu["reason"] == "no_libusb", gpu
    assert got["tinygrad"] is True


def test_no_dock_through_pyusb_stops_at_usb_ids(tmp_path):
    got = child(QUALIFY.format(setup=""), env={"XDG_CACHE_HOME": str(tmp_path)})
    usb_ids = by_name(got["steps"])["usb_ids"]
    assert usb_ids["result"] == "fail" and usb_ids["reason"] == "no_dock"
    assert "no Chestnut dock found" in usb_ids["detail"]
