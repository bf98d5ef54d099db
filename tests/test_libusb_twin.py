"""tinygrad's own ``USB3`` over real libusb-1.0 against the twin: the libusb face (``backend/sim/libusb_face.py``).

Every scenario runs in a child process, ``python -m chestnut.backend.sim.libusb_face -c CODE``, which
re-executes itself under ``umockdev-wrapper`` (umockdev's preload must be in a process from its start),
builds the testbed before the first libusb call (tinygrad caches its libusb context, ``USB3.ctx``) and
runs CODE there: ``USB3`` imported from ``tinygrad.runtime.support.usb``, unmodified, on libusb 1.0.26's
usbdevfs URBs, which the face forwards to this module's twin daemon. Those tests skip, with the one-line
reason the face's ``--check`` prints, only where umockdev cannot run (``launch/setup.sh`` installs it); the
ioctl numbers and the command line are checked everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from chestnut.backend import protocol as P
from chestnut.backend.sim.client import running_twin

pytestmark = pytest.mark.slow

GONE = "No such device (it may have been disconnected)"

PRELUDE = """
import json, os
os.environ["DEV"] = "CPU"
from tinygrad.runtime.autogen import libusb
from tinygrad.runtime.support.usb import USB3, CustomASM24Controller
from tinygrad.runtime.support.system import System
from chestnut.backend.sim import libusb_face
from chestnut.backend.sim.client import TwinClient
out = {}
def err(fn):
    try:
        fn()
    except (RuntimeError, AssertionError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"
"""

PROOF = PRELUDE + """
out["usb3"] = f"{USB3.__module__}.{USB3.__qualname__}"
out["libusb"] = os.path.basename(libusb.dll._name)
devs = USB3.list_devices(0xADD1, 0x0001)
out["devices"] = [name for _, name in devs]
usb = USB3(devs[0][0])
out["product"] = usb.product
out["ltssm_before"] = usb.control_read(0xE4, 1, value=0xB450)[0]
ctrl = CustomASM24Controller(usb)              # LTSSM != 0x78 -> 0xF3 power-on -> LTSSM == 0x78
out["ltssm_after"] = ctrl.read(0xB450, 1)[0]
bars = System.pci_setup_usb_bars(ctrl, gpu_bus=4, mem_base=0x10000000, pref_mem_base=(32 << 30))
out["bars"] = {str(k): list(v) for k, v in bars.items()}
out["vendor"] = ctrl.pcie_cfg_req(0x00, bus=4, dev=0, fn=0, size=2)
out["device"] = ctrl.pcie_cfg_req(0x02, bus=4, dev=0, fn=0, size=2)
data = bytes(range(256)) * 1024
ctrl.pcie_mem_write(bars[0][0] + 0x100000, data)
out["vram_round_trip"] = bytes(ctrl.pcie_mem_read(bars[0][0] + 0x100000, len(data))) == data
sram = bytes((i * 7 + 3) & 0xFF for i in range(100000))
ctrl.scsi_write(sram)                           # 0xF2 + bulk OUT 0x02
ctrl.scsi_read_arm(len(sram))
out["sram_round_trip"] = bytes(ctrl.scsi_read(len(sram))) == sram   # bulk IN 0x81
ctrl.write(0xA800, bytes([1, 2, 3, 4]))
out["xdata"] = ctrl.read(0xA800, 4).hex()
usb.control_write(0xF2, value=8, index=1 << 8)
bulk = usb.bulk_write_async(memoryview(bytearray(4096)))
usb.control_write_async(0xE5, value=0xA800, index=0x5A)
tag, mv = usb.control_read_async(0xE4, 1, value=0xA800)
usb.bulk_wait(bulk)
usb.bulk_wait(tag)
out["async_read"] = bytes(mv).hex()
out["stats"] = {"ioctls": libusb_face.ACTIVE.stats.ioctls, "urbs": libusb_face.ACTIVE.stats.urbs}
print(json.dumps(out))
"""

FAULTS = PRELUDE + """
from chestnut.backend.real_runner import translate
def seen(key, fn):   # tinygrad's error, and the real runner's classification of it
    try:
        fn()
    except (RuntimeError, AssertionError) as e:
        c = translate(e)
        out[key], out[key + "_class"] = f"{type(e).__name__}: {e}", f"{type(c).__name__} {c.reason}"
        return
    out[key] = "no error"
client = TwinClient()
devs = USB3.list_devices(0xADD1, 0x0001)
usb = USB3(devs[0][0])
ctrl = CustomASM24Controller(usb)
client.fault("timeout", on="0xE4")
seen("timeout", lambda: ctrl.read(0xB450, 1))
seen("after_timeout", lambda: ctrl.read(0xB450, 1))
client.fault("short", on="bulk_out")
seen("short_out", lambda: ctrl.scsi_write(bytes(4096)))
ctrl.scsi_write(bytes(range(256)) * 16)
ctrl.scsi_read_arm(4096)
client.fault("short", on="bulk_in", nbytes=512)
out["short_in"] = len(usb.bulk_read(4096))
client.fault("stall", on="bulk_in")
seen("stall", lambda: usb.bulk_read(512))
seen("still_halted", lambda: usb.bulk_read(512))
client.fault("disconnect")
seen("disconnect", lambda: ctrl.read(0xB450, 1))
seen("bulk_gone", lambda: usb.bulk_write(b"x"))
seen("reopen", lambda: USB3(devs[0][0]))
out["discards"] = libusb_face.ACTIVE.stats.ioctls.get("USBDEVFS_DISCARDURB", 0)
print(json.dumps(out))
"""

AM_INIT = """
from tinygrad import Device
Device["AMD"]
"""


@pytest.fixture(scope="module")
def face_ready() -> None:
    p = subprocess.run([sys.executable, "-m", "chestnut.backend.sim.libusb_face", "--check"], capture_output=True,
                       text=True, timeout=60)
    if p.returncode != 0:
        pytest.skip(f"umockdev cannot run here: {(p.stdout or p.stderr).strip().splitlines()[-1][:200]}")


def under_face(tmp_path: Path, args: list[str], env: dict[str, str] | None = None,
               check: bool = True) -> subprocess.CompletedProcess[str]:
    """``python -m chestnut.backend.sim.libusb_face ARGS`` for this test's twin (``$CHESTNUT_PREFIX``); the
    testbed's folder goes in ``$TMPDIR``, as the twin's runtime folder does."""
    full_env = {**os.environ, **(env or {})}
    p = subprocess.run([sys.executable, "-m", "chestnut.backend.sim.libusb_face", *args], env=full_env,
                       capture_output=True, text=True, timeout=120)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def run_script(tmp_path: Path, script: str) -> dict:
    p = under_face(tmp_path, ["-c", textwrap.dedent(script)], {"DEV": "CPU"})
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
def test_tinygrads_usb3_runs_over_real_libusb_against_the_twin(face_ready, tmp_path):
    with running_twin() as twin:
        d = twin.enumerate()[0]
        out = run_script(tmp_path, PROOF)
        assert out["usb3"] == "tinygrad.runtime.support.usb.USB3"
        assert out["libusb"].startswith("libusb-1.0.so")
        assert out["devices"] == [f"usb:{d.bus}-{d.address}"]
        assert out["product"].startswith("custom")
        assert out["ltssm_before"] == P.LTSSM_DETECT
        assert out["ltssm_after"] == P.LTSSM_L0
        assert out["bars"] == {"0": [32 << 30, 16 << 30], "2": [48 << 30, 2 << 20], "5": [0x10000000, 512 << 10]}
        assert (out["vendor"], out["device"]) == (P.AMD_VENDOR_ID, P.GPU_DEVICE_ID)
        assert out["vram_round_trip"] and out["sram_round_trip"]
        assert out["xdata"] == "01020304"
        assert out["async_read"] == "5a"
        ioctls = out["stats"]["ioctls"]
        # libusb's own sequence: capabilities at open, no kernel driver, configuration, claim, alt setting,
        # and every transfer (control ones too) a URB that is submitted, then reaped
        for name in ("USBDEVFS_GET_CAPABILITIES", "USBDEVFS_GETDRIVER", "USBDEVFS_SETCONFIGURATION",
                     "USBDEVFS_CLAIMINTERFACE", "USBDEVFS_SETINTERFACE"):
            assert ioctls.get(name) == 1, (name, ioctls)
        assert ioctls["USBDEVFS_SUBMITURB"] == out["stats"]["urbs"] > 100
        assert ioctls["USBDEVFS_REAPURBNDELAY"] >= ioctls["USBDEVFS_SUBMITURB"]
        st = twin.status()
        assert st["bridge"]["ltssm"] == P.LTSSM_L0
        assert st["pcie"]["bars"]["0"] == [32 << 30, 16 << 30]
        assert st["usb"]["open_handles"] == 0  # the child exited: the face closed its handle


@pytest.mark.timeout(120)
def test_usb_faults_reach_tinygrad_as_libusb_reports_them(face_ready, tmp_path):
    with running_twin():
        out = run_script(tmp_path, FAULTS)
    # the device NAKs: the URB is held until libusb's timer discards it, then reaped -ENOENT (TIMED_OUT)
    assert out["timeout"] == "RuntimeError: libusb_control_transfer: Operation timed out"
    assert out["discards"] == 1
    assert out["after_timeout"] == "no error"
    assert out["short_out"] == "AssertionError: bulk OUT short write: 2048/4096 bytes"
    assert out["short_in"] == 512                                       # status 0, a smaller actual_length
    assert out["stall"] == "RuntimeError: bulk IN 0x81 failed: Pipe error"  # -EPIPE: LIBUSB_ERROR_PIPE
    assert out["still_halted"] == "RuntimeError: bulk IN 0x81 failed: Pipe error"
    assert out["disconnect"] == f"RuntimeError: libusb_control_transfer: {GONE}"   # ENODEV: NO_DEVICE
    assert out["bulk_gone"] == f"RuntimeError: bulk OUT 0x02 failed: {GONE}"
    assert out["reopen"] == f"RuntimeError: libusb_open: {GONE}"   # the node went, as after an unplug
    # the real runner's classification (backend/real_runner.py translate) of what libusb raised
    assert out["timeout_class"] == "UsbLayerError transfer_timeout"
    assert out["short_out_class"] == "UsbLayerError short_transfer"
    assert out["stall_class"] == "UsbLayerError stall"
    assert out["disconnect_class"] == out["bulk_gone_class"] == out["reopen_class"] == "UsbLayerError disconnect"


@pytest.mark.timeout(120)
def test_probe_real_runs_the_ladder_over_libusb_up_to_the_gpu(face_ready, tmp_path):
    """``chestnut probe --real``: the ladder's USB rungs (pyusb on libusb) and the LTSSM pass on the twin;
    ``gpu_arch`` stops at tinygrad's firmware cache check (no AMD firmware offline); a timeout and a
    disconnect are classified as on a dock (``bridge_wedged``, ``disconnect``). tinygrad's own open,
    ``Device["AMD"]``, gets through ``USB3``, ``CustomASM24Controller`` and ``pci_setup_usb_bars`` into the
    AM driver and stops at its IP discovery: the twin's VRAM holds no discovery table."""
    with running_twin() as twin:
        d = twin.enumerate()[0]
        xdg = tmp_path / "cache"   # an empty tinygrad cache: no firmware, whatever this machine has cached
        xdg.mkdir(mode=0o700)
        p = under_face(tmp_path, ["-m", "chestnut.launch.cli", "probe", "--real", "--json"],
                       {"XDG_CACHE_HOME": str(xdg)}, check=False)
        steps = {s["name"]: s for s in json.loads(p.stdout[p.stdout.index("["):])}
        for name in ("usb_ids", "link_speed", "link_stability", "ltssm"):
            assert steps[name]["result"] == "pass", steps[name]
        assert f"bus {d.bus} address {d.address}" in steps["usb_ids"]["detail"]
        assert steps["gpu_arch"]["result"] == "fail"
        assert steps["gpu_arch"]["reason"] == "firmware_missing", steps["gpu_arch"]
        # the ladder classifies USB faults met through real libusb (pyusb's libusb1 backend) as on a dock
        for kind, params, reason in (("timeout", {"repeat": True, "on": "0xE4"}, "bridge_wedged"),
                                     ("disconnect", {"after": 3}, "disconnect")):   # past the string reads
            twin.clear()
            twin.plug()
            twin.power_cycle(0)
            twin.fault(kind, **params)
            p = under_face(tmp_path, ["-m", "chestnut.launch.cli", "probe", "--real", "--json"],
                           {"XDG_CACHE_HOME": str(xdg)}, check=False)
            ran = json.loads(p.stdout[p.stdout.index("["):])
            failed = [s for s in ran if s["result"] == "fail"]
            assert failed and failed[0]["reason"] == reason, (kind, ran)
            assert all(s["result"] == "skipped" for s in ran[ran.index(failed[0]) + 1:]), ran
        twin.clear()
        twin.plug()
        twin.power_cycle(0)
        p = under_face(tmp_path, ["-c", AM_INIT], {"DEV": "USB+AMD:LLVM", "XDG_CACHE_HOME": str(xdg)}, check=False)
        assert p.returncode != 0
        tail = p.stderr.strip().splitlines()
        assert tail[-1] == "AssertionError: discovery signatures mismatch", p.stderr[-3000:]
        assert "_run_discovery" in p.stderr and "pci_setup_usb_bars" not in tail[-1]
        st = twin.status()
        assert st["bridge"]["ltssm"] == P.LTSSM_L0 and st["pcie"]["bars"]["0"][1] == 16 << 30


def test_usbdevfs_ioctl_numbers_are_the_kernels():
    """The numbers libusb 1.0.26 sends on x86-64 (``include/uapi/linux/usbdevice_fs.h``, ``_IOC`` encoding)."""
    from chestnut.backend.sim import libusb_face as F

    assert F.URB_SIZE == 56
    assert (F.USBDEVFS_SUBMITURB, F.USBDEVFS_DISCARDURB, F.USBDEVFS_REAPURB, F.USBDEVFS_REAPURBNDELAY) == (
        0x8038550A, 0x550B, 0x4008550C, 0x4008550D)
    assert (F.USBDEVFS_SETINTERFACE, F.USBDEVFS_SETCONFIGURATION, F.USBDEVFS_GETDRIVER) == (
        0x80085504, 0x80045505, 0x41045508)
    assert (F.USBDEVFS_CLAIMINTERFACE, F.USBDEVFS_RELEASEINTERFACE, F.USBDEVFS_CLEAR_HALT, F.USBDEVFS_RESET) == (
        0x8004550F, 0x80045510, 0x80045515, 0x5514)
    assert (F.USBDEVFS_GET_CAPABILITIES, F.USBDEVFS_GET_SPEED) == (0x8004551A, 0x551F)


def test_bad_command_lines_are_one_line():
    face = [sys.executable, "-m", "chestnut.backend.sim.libusb_face"]
    for args in (["--bogus"], ["-m"], ["--prefix"]):
        p = subprocess.run([*face, *args], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and p.stderr.startswith("usage: ") and len(p.stderr.splitlines()) == 1, args
    p = subprocess.run([sys.executable, "-m", "chestnut.launch.cli", "twin", "libusb"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip() == "chestnut twin libusb: name a chestnut command, e.g. `chestnut twin libusb probe --real`"
