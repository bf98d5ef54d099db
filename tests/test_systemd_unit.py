"""The example systemd unit (``launch/chestnut-node.service``) runs the node with least privilege, and the
udev rule beside it (``launch/99-chestnut-dock.rules``) gives the unit's group the dock, and only the dock."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from chestnut.backend import protocol as P

LAUNCH = Path(__file__).resolve().parent.parent / "launch"
UNIT = LAUNCH / "chestnut-node.service"
RULES = LAUNCH / "99-chestnut-dock.rules"
EXPOSURE_AIM = 2.0  # systemd-analyze's scale: 0 (locked down) .. 10 (UNSAFE); <= 3 is "OK"; ours with realtime: 1.4


def service_settings() -> dict[str, list[str]]:
    """``[Service]`` key -> every value it is given (a key may repeat, e.g. SystemCallFilter=)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed (Debian's systemd package); the exposure score is not measured",
)
def test_systemd_analyze_rates_the_unit_at_most_2_0():
    r = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(UNIT)], capture_output=True, text=True, timeout=60
    )
    m = re.search(r"Overall exposure level for chestnut-node\.service: (\d+\.\d)", r.stdout)
    assert m is not None, r.stdout + r.stderr
    assert float(m.group(1)) <= EXPOSURE_AIM, r.stdout
    for directive in (
        "User=/DynamicUser=",
        "NoNewPrivileges=",
        "ProtectSystem=",
        "ProtectHome=",
        "UMask=",
        "CapabilityBoundingSet=~CAP_SYS_ADMIN",
        "RestrictAddressFamilies=~AF_(INET|INET6)",
    ):
        line = next(ln for ln in r.stdout.splitlines() if directive in ln)
        assert line.startswith("✓"), line


def test_the_unit_sets_what_least_privilege_asks_for():
    s = service_settings()
    want = {
        "User": ["chestnut"],
        "Group": ["chestnut"],
        "UMask": ["0077"],
        "NoNewPrivileges": ["yes"],
        "CapabilityBoundingSet": [""],
        "AmbientCapabilities": [""],
        "RuntimeDirectory": ["chestnut"],
        "RuntimeDirectoryMode": ["0700"],
        "CacheDirectory": ["chestnut"],
        "CacheDirectoryMode": ["0700"],
        "ProtectSystem": ["strict"],
        "ProtectHome": ["yes"],
        "DevicePolicy": ["closed"],
        "DeviceAllow": ["char-usb_device rw"],
        "RestrictAddressFamilies": ["AF_UNIX AF_NETLINK"],
        "IPAddressDeny": ["any"],
        # the dock's lock file stays where tinygrad takes it: the shared, real /tmp
        "PrivateTmp": ["no"],
        "ReadWritePaths": ["/tmp"],
        # realtime as openpilot gives modeld, granted up to that priority only (node/realtime.py)
        "CPUSchedulingPolicy": ["fifo"],
        "CPUSchedulingPriority": ["54"],
        "LimitRTPRIO": ["54"],
        "RestrictRealtime": ["no"],
    }
    assert {k: s.get(k) for k in want} == want
    env = dict(v.split("=", 1) for v in s["Environment"])
    assert env == {
        "CHESTNUT_PREFIX": "default",
        "CHESTNUT_CACHE": "/var/cache/chestnut",
        "XDG_CACHE_HOME": "/var/cache/chestnut",
    }  # no TMPDIR: tempfile.gettempdir() is /tmp
    assert "PrivateUsers" not in s and "PrivateDevices" not in s


def test_the_udev_rule_gives_the_units_group_exactly_the_docks_usb_ids():
    rules = [ln for ln in RULES.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    pat = re.compile(
        r'SUBSYSTEM=="usb", ENV\{DEVTYPE\}=="usb_device", ATTR\{idVendor\}=="([0-9a-f]{4})", '
        r'ATTR\{idProduct\}=="([0-9a-f]{4})", GROUP="(\w+)", MODE="(\d{4})"'
    )
    parsed = [pat.fullmatch(ln) for ln in rules]
    assert all(parsed), rules
    assert [(int(m.group(1), 16), int(m.group(2), 16)) for m in parsed if m] == list(P.USB_IDS)
    assert {(m.group(3), m.group(4)) for m in parsed if m} == {(service_settings()["Group"][0], "0660")}
