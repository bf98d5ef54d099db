"""What each face of the twin costs: tinygrad 0.14's own ``USB3`` over real libusb (the libusb face, umockdev)
against the socket face's ``TwinUSB3``, on one twin daemon.

Run: ``.venv/bin/python tests/bench/bench_libusb_face.py [--n N] [--mib 1,4]``

For each face, in a child process (the libusb one under ``umockdev-wrapper``, through
``python -m chestnut.backend.sim.libusb_face``): N one-byte XDATA reads (vendor control IN ``0xE4``, the
per-control-transfer cost, p50/p99 in us), then ``pcie_mem_write`` (``0xF0`` mode 1 + bulk OUT ``0x02``)
and ``pcie_mem_read`` (``0xF0`` mode 2 + bulk IN ``0x81``) of each size to VRAM, in MB/s (best of 3).
Prints one line per face and measure, and the libusb face's ioctls per control transfer. Needs umockdev
(``launch/setup.sh`` installs it); without it, only the socket face is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchprefix import own_prefix

from chestnut.backend.sim.client import running_twin

CHILD = """
import json, os, statistics, sys, time
os.environ["DEV"] = "CPU"
from tinygrad.runtime.support.usb import CustomASM24Controller
from tinygrad.runtime.support.system import System
n, sizes, face = int(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")], sys.argv[3]
if face == "libusb":
    from tinygrad.runtime.support.usb import USB3
    from chestnut.backend.sim import libusb_face
else:
    from chestnut.backend.sim.usb3 import TwinUSB3 as USB3
usb = USB3(USB3.list_devices(0xADD1, 0x0001)[0][0])
ctrl = CustomASM24Controller(usb)
vram = System.pci_setup_usb_bars(ctrl, gpu_bus=4, mem_base=0x10000000, pref_mem_base=(32 << 30))[0][0] + (16 << 20)
ioctls0 = sum(libusb_face.ACTIVE.stats.ioctls.values()) if face == "libusb" else 0
lat = []
for _ in range(n):
    t = time.perf_counter()
    usb.control_read(0xE4, 1, value=0xB450)
    lat.append((time.perf_counter() - t) * 1e6)
out = {"ctrl_p50_us": statistics.median(lat), "ctrl_p99_us": sorted(lat)[int(0.99 * (n - 1))]}
if face == "libusb":
    out["ioctls_per_ctrl"] = (sum(libusb_face.ACTIVE.stats.ioctls.values()) - ioctls0) / n
for mib in sizes:
    data, w, r = bytes(mib << 20), [], []
    for _ in range(3):
        t = time.perf_counter(); ctrl.pcie_mem_write(vram, data); w.append(time.perf_counter() - t)
        t = time.perf_counter(); ctrl.pcie_mem_read(vram, len(data)); r.append(time.perf_counter() - t)
    out[f"bulk_out_{mib}MiB_MBps"] = len(data) / min(w) / 1e6
    out[f"bulk_in_{mib}MiB_MBps"] = len(data) / min(r) / 1e6
print(json.dumps(out))
"""


def run_face(face: str, n: int, mib: str) -> dict | str:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:   # 0600, in $TMPDIR
        f.write(CHILD)
    try:
        cmd = [sys.executable, *(["-m", "chestnut.backend.sim.libusb_face"] if face == "libusb" else []),
               f.name, str(n), mib, face]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(f.name)
    if p.returncode != 0:
        return (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=500, help="control transfers per face (default 500)")
    ap.add_argument("--mib", default="1,4", help="bulk sizes in MiB, comma-separated (default 1,4)")
    args = ap.parse_args()
    if args.n < 1 or not all(s.isdigit() and 0 < int(s) <= 64 for s in args.mib.split(",")):
        sys.exit("--n must be >= 1 and --mib sizes in 1..64")
    # its own prefix (its runtime directory removed at the end): the default one's would keep the twin's log
    with own_prefix(f"bench-libusb-{os.getpid()}", env=True), running_twin():
        for face in ("socket", "libusb"):
            out = run_face(face, args.n, args.mib)
            if isinstance(out, str):
                print(f"{face:6s} face: not measured: {out}")
                continue
            print(f"{face:6s} face: control transfer p50 {out['ctrl_p50_us']:.0f} us, p99 {out['ctrl_p99_us']:.0f} us"
                  + (f", {out['ioctls_per_ctrl']:.1f} usbdevfs ioctls each" if "ioctls_per_ctrl" in out else ""))
            for k, v in out.items():
                if k.startswith("bulk_"):
                    print(f"{face:6s} face: {k.replace('_MBps', '')} {v:.0f} MB/s")


if __name__ == "__main__":
    main()
