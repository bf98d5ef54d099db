"""Versions and identity of the host and the dock (``backend/probe.py``) and their bounds on the node side."""

from __future__ import annotations

import platform
from pathlib import Path
from types import SimpleNamespace

from chestnut.backend.probe import IDENTITY_KEYS, gpu_firmware, host_os, runner_identity, usb_identity
from chestnut.node.worker_handle import IDENTITY_MAX_CHARS, IDENTITY_MAX_ITEMS, _identity


def test_host_os_names_the_kernel_and_the_distribution(tmp_path: Path) -> None:
    rel = tmp_path / "os-release"
    rel.write_text('NAME="Ubuntu"\nPRETTY_NAME="Ubuntu 24.04.1 LTS"\nID=ubuntu\n')
    kernel = f"{platform.system()} {platform.release()}"
    assert host_os(rel) == f"{kernel} (Ubuntu 24.04.1 LTS)"
    assert host_os(tmp_path / "missing") == kernel


def test_usb_identity_reads_the_path_and_the_bridge_firmware_from_the_descriptor() -> None:
    dev = SimpleNamespace(
        idVendor=0xADD1, idProduct=0x0001, bus=3, address=12, port_numbers=(2, 1), speed=4, bcdDevice=0x0213
    )
    assert usb_identity(dev) == {
        "usb_id": "0xADD1:0x0001",
        "usb_path": "bus 3 port 2.1 address 12",
        "usb_speed_mbps": "5000",
        "bridge_firmware": "2.13 (bcdDevice 0x0213)",
    }


def test_gpu_firmware_names_the_files_tinygrad_loads_for_the_ip_versions() -> None:
    ip = {1: (11, 0, 0), 15: (13, 0, 0), 16: (13, 0, 0), 3: (6, 0, 0)}  # a gfx1100 (RX 7900)
    names = [item.split("@")[0] for item in gpu_firmware("gfx1100", ip).split(", ")]
    assert names == [
        "gc_11_0_0_imu.bin",
        "gc_11_0_0_mec.bin",
        "gc_11_0_0_rlc.bin",
        "psp_13_0_0_sos.bin",
        "sdma_6_0_0.bin",
        "smu_13_0_0.bin",
    ]
    assert all(len(item.split("@")[1]) == 12 for item in gpu_firmware("gfx1100", ip).split(", "))
    twin = [item.split("@")[0] for item in gpu_firmware("gfx1201").split(", ")]
    assert twin == [
        "gc_12_0_1_imu.bin",
        "gc_12_0_1_me.bin",
        "gc_12_0_1_mec.bin",
        "gc_12_0_1_pfp.bin",
        "gc_12_0_1_rlc.bin",
    ]
    assert gpu_firmware("nonsense") == "unknown"


def test_an_unqualified_runner_has_every_key_and_unknown_dock_fields() -> None:
    ident = runner_identity(SimpleNamespace())
    assert tuple(ident) == IDENTITY_KEYS
    assert {k: v for k, v in ident.items() if k not in ("tinygrad", "host_os")} == dict.fromkeys(
        IDENTITY_KEYS[2:], "unknown"
    )


def test_a_workers_identity_is_bounded() -> None:
    assert _identity(["not", "a", "map"]) == {}
    big = {f"k{i}": "v" * (IDENTITY_MAX_CHARS + 10) for i in range(IDENTITY_MAX_ITEMS + 5)}
    got = _identity(big)
    assert len(got) == IDENTITY_MAX_ITEMS and all(len(v) == IDENTITY_MAX_CHARS for v in got.values())
