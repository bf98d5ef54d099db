"""The proof that the twin speaks the dock's protocol: tinygrad 0.14's own ``CustomASM24Controller`` and
``System.pci_setup_usb_bars``, unmodified, drive the twin daemon through :class:`TwinUSB3`.

tinygrad runs in a child process with ``DEV=CPU`` set before its import (never evaluate
``Device.DEFAULT`` with ``DEV`` unset: it would probe devices).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from chestnut.backend import protocol as P
from chestnut.backend.sim.client import running_twin

PRELUDE = """
import json, os, sys
os.environ["DEV"] = "CPU"
from tinygrad.runtime.support.usb import CustomASM24Controller
from tinygrad.runtime.support.system import System
from chestnut.backend.sim.usb3 import TwinUSB3
from chestnut.backend.sim.client import TwinClient
out = {}
"""

PROOF = PRELUDE + """
devs = TwinUSB3.list_devices(0xADD1, 0x0001)
out["devices"] = [name for _, name in devs]
usb = TwinUSB3(devs[0][0])
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
ctrl.scsi_write(sram)
ctrl.scsi_read_arm(len(sram))
out["sram_round_trip"] = bytes(ctrl.scsi_read(len(sram))) == sram
ctrl.pcie_request(0x60, bars[5][0] + 0x10, 0xCAFEF00D)
out["mmio"] = ctrl.pcie_request(0x20, bars[5][0] + 0x10)
ctrl.write(0xA800, bytes([1, 2, 3, 4]))
out["fence"] = ctrl.read(0xA800, 4).hex()
out["xdata_read_600"] = len(ctrl.read(0xA000, 600))
again = CustomASM24Controller(usb)             # link already up: no power-on
print(json.dumps(out))
"""

FAULTS = PRELUDE + """
def err(fn):
    try:
        fn()
    except (RuntimeError, AssertionError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"

client = TwinClient()
devs = TwinUSB3.list_devices(0xADD1, 0x0001)
usb = TwinUSB3(devs[0][0])
ctrl = CustomASM24Controller(usb)
bars = System.pci_setup_usb_bars(ctrl, gpu_bus=4, mem_base=0x10000000, pref_mem_base=(32 << 30))
client.fault("bad_tlp", status="ur")
out["bad_tlp_ur"] = err(lambda: ctrl.pcie_cfg_req(0x00, bus=4, dev=0, fn=0, size=2))
client.fault("bad_tlp", status="ca")
out["bad_tlp_ca"] = err(lambda: ctrl.pcie_request(0x20, bars[5][0]))
out["unmapped"] = err(lambda: ctrl.pcie_request(0x20, 0x1000))
client.fault("ltssm_down")
out["ltssm_down"] = err(lambda: ctrl.pcie_cfg_req(0x00, bus=4, dev=0, fn=0, size=2))
usb.control_write(0xF3, value=0)
client.fault("ltssm_stuck", repeat=True)
out["ltssm_stuck"] = err(lambda: CustomASM24Controller(usb))
client.clear()
client.fault("timeout", on="0xE4")
out["timeout"] = err(lambda: ctrl.read(0xB450, 1))
client.fault("short", on="bulk_out")
out["short"] = err(lambda: ctrl.scsi_write(bytes(4096)))
client.fault("disconnect")
out["disconnect"] = err(lambda: ctrl.read(0xB450, 1))
out["cached_list"] = [n for _, n in TwinUSB3.list_devices(0xADD1, 0x0001)]
out["reopen"] = err(lambda: TwinUSB3(devs[0][0]))
new = client.plug()
client.fault("lock_held")
out["lock"] = err(lambda: System.flock_acquire(f"am_usb:{new.bus}-{new.address}.lock"))
client.clear()
out["lock_after_clear"] = err(lambda: System.flock_acquire(f"am_usb:{new.bus}-{new.address}.lock"))
out["new"] = f"usb:{new.bus}-{new.address}"
print(json.dumps(out))
"""


def run_tinygrad(script: str) -> dict:
    env = {**os.environ, "DEV": "CPU"}
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
def test_tinygrad_controller_and_bar_setup_run_unmodified_against_the_twin():
    with running_twin() as twin:
        d = twin.enumerate()[0]
        out = run_tinygrad(PROOF)
        assert out["devices"] == [f"usb:{d.bus}-{d.address}"]
        assert out["product"].startswith("custom")
        assert out["ltssm_before"] == P.LTSSM_DETECT
        assert out["ltssm_after"] == P.LTSSM_L0
        assert out["bars"] == {"0": [32 << 30, 16 << 30], "2": [48 << 30, 2 << 20], "5": [0x10000000, 512 << 10]}
        assert (out["vendor"], out["device"]) == (P.AMD_VENDOR_ID, P.GPU_DEVICE_ID)
        assert out["vram_round_trip"] and out["sram_round_trip"]
        assert out["mmio"] == 0xCAFEF00D
        assert out["fence"] == "01020304"
        assert out["xdata_read_600"] == 600
        st = twin.status()
        assert st["bridge"]["ltssm"] == P.LTSSM_L0
        assert st["pcie"]["bars"]["0"] == [32 << 30, 16 << 30]
        assert st["vram_pages"] == 4  # 256 KiB written: four 64 KiB pages of a 16 GiB BAR
        assert st["usb"]["open_handles"] == 0  # the child exited: its handles were closed


@pytest.mark.timeout(180)
def test_tinygrad_sees_the_twins_faults_with_its_own_messages():
    with running_twin() as twin:
        d = twin.enumerate()[0]
        out = run_tinygrad(FAULTS)
        nb, na = out["new"].split(":")[1].split("-")
        assert out["bad_tlp_ur"] == f"RuntimeError: TLP completion status: Unsupported Request: {4 << 24:#x}"
        assert out["bad_tlp_ca"] == "RuntimeError: TLP completion status: Completer Abort"
        assert out["unmapped"] == "RuntimeError: TLP completion status: Unsupported Request: 0x1000"
        assert out["ltssm_down"] == f"RuntimeError: TLP error after retries: ret_status=1, address={4 << 24:#x}"
        assert out["ltssm_stuck"] == "RuntimeError: PCIe link not up (LTSSM=0x4C), custom firmware not ready"
        assert out["timeout"] == "RuntimeError: libusb_control_transfer: Operation timed out"
        assert out["short"] == "AssertionError: bulk OUT short write: 2048/4096 bytes"
        gone = "No such device (it may have been disconnected)"
        assert out["disconnect"] == f"RuntimeError: libusb_control_transfer: {gone}"
        assert out["cached_list"] == [f"usb:{d.bus}-{d.address}"]  # the process's device list is cached
        assert out["reopen"] == f"RuntimeError: libusb_open: {gone}"
        assert out["new"] == f"usb:{d.bus}-{d.address + 1}"
        lock = os.path.join(tempfile.gettempdir(), f"am_usb:{nb}-{na}.lock")
        assert out["lock"] == (f"RuntimeError: Failed to acquire lock file am_usb:{nb}-{na}.lock. `sudo lsof {lock}` "
                               "may help identify the process holding the lock.")
        assert out["lock_after_clear"] == "no error"
