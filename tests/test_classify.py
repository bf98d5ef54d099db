"""Every row of the classification table, with the exact layer and reason it must produce.

Where tinygrad 0.14's own code can raise the message without a dock (its ``USB3`` over a stand-in
libusb, ``CustomASM24Controller`` over a stand-in transport, ``HCQSignal.wait``,
``System.flock_acquire``), the exception comes from tinygrad itself; the others are tinygrad's
f-strings filled in, and their fixed text is checked against tinygrad's source.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import subprocess
import sys
import tempfile
import urllib.error
from collections.abc import Callable
from pathlib import Path

import pytest
import usb.core

from chestnut.backend.classify import RULES, advice_for, classify, diagnose, match_rule, translated
from chestnut.backend.errors import (
    ChestnutError,
    ConfigError,
    GpuLayerError,
    Layer,
    PcieLayerError,
    UsbLayerError,
)
from chestnut.backend.model import ensure_cpu_device
from chestnut.backend.sim.libusb_codes import LIBUSB_ERROR_NO_DEVICE
from chestnut.backend.sim.libusb_codes import UsbError as TwinUsbError

ensure_cpu_device()

import tinygrad  # noqa: E402
from tinygrad.runtime.autogen import libusb as real_libusb  # noqa: E402
from tinygrad.runtime.support import usb as tg_usb  # noqa: E402
from tinygrad.runtime.support.hcq import HCQSignal  # noqa: E402
from tinygrad.runtime.support.system import System  # noqa: E402

TG = Path(tinygrad.__file__).parent

# libusb 1.0 libusb_strerror (English)
STRERROR = {
    -1: "Input/Output Error", -3: "Access denied (insufficient permissions)",
    -4: "No such device (it may have been disconnected)", -5: "Entity not found", -6: "Resource busy",
    -7: "Operation timed out", -8: "Overflow", -9: "Pipe error", -99: "Other error",
}


class FakeLibusb:
    """Stands in for tinygrad's libusb bindings so tinygrad's ``USB3`` code runs without a device."""

    def __init__(self, product: bytes = b"custom Chestnut", rc: dict[str, int] | None = None,
                 short_by: int = 0, ctrl_short_by: int = 0) -> None:
        self.product, self.rc, self.short_by, self.ctrl_short_by = product, rc or {}, short_by, ctrl_short_by

    def __getattr__(self, name: str):
        return getattr(real_libusb, name)

    def libusb_open(self, dev, handle):
        return self.rc.get("libusb_open", 0)

    def libusb_get_device(self, handle):
        return None

    def libusb_get_device_descriptor(self, dev, desc):
        return 0

    def libusb_get_string_descriptor_ascii(self, handle, index, buf, n):
        ctypes.memmove(buf, self.product, len(self.product))
        return len(self.product)

    def libusb_kernel_driver_active(self, handle, iface):
        return 0

    def libusb_set_configuration(self, handle, cfg):
        return 0

    def libusb_claim_interface(self, handle, iface):
        return self.rc.get("libusb_claim_interface", 0)

    def libusb_set_interface_alt_setting(self, handle, iface, alt):
        return 0

    def libusb_control_transfer(self, handle, reqtype, req, value, index, buf, length, timeout):
        return self.rc.get("libusb_control_transfer", length - self.ctrl_short_by)

    def libusb_bulk_transfer(self, handle, ep, buf, length, transferred, timeout):
        transferred.value = length - self.short_by
        return self.rc.get("libusb_bulk_transfer", 0)

    def libusb_handle_events(self, ctx):
        return self.rc.get("libusb_handle_events", 0)

    def libusb_strerror(self, rc):
        return STRERROR[rc].encode()


def raised(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 -- the point is to capture it
        return e
    raise AssertionError("expected an exception")


def tg_usb3(monkeypatch, **kw) -> Callable[[Callable[[tg_usb.USB3], object]], BaseException]:
    """Run ``fn(usb3)`` on tinygrad's real USB3 over a FakeLibusb and return what it raised."""
    fake = FakeLibusb(**kw)
    monkeypatch.setattr(tg_usb, "libusb", fake)

    def run(fn: Callable[[tg_usb.USB3], object]) -> BaseException:
        return raised(lambda: fn(tg_usb.USB3(None)))
    return run


class FakeBridgeUsb:
    """A transport for tinygrad's CustomASM24Controller: fixed LTSSM byte and TLP completion."""

    def __init__(self, ltssm: int = 0x78, cpl_status: int = 0, ret_status: int = 0) -> None:
        self.ltssm, self.cpl_status, self.ret_status = ltssm, cpl_status, ret_status

    def control_write(self, request, value=0, index=0, data=b"", timeout=1000):
        return None

    def control_read(self, request, length, value=0, index=0, timeout=1000):
        if request == 0xE4:
            return memoryview(bytes([self.ltssm]) * length)
        return memoryview(struct.pack("<IBBBB", 0, self.cpl_status << 5, 0, 0, self.ret_status))


def tg_controller(monkeypatch, **kw) -> BaseException:
    monkeypatch.setattr(tg_usb.time, "sleep", lambda s: None)
    return raised(lambda: tg_usb.CustomASM24Controller(FakeBridgeUsb(**kw)))


def tg_tlp(monkeypatch, **kw) -> BaseException:
    monkeypatch.setattr(tg_usb.time, "sleep", lambda s: None)
    ctrl = tg_usb.CustomASM24Controller(FakeBridgeUsb())
    ctrl.usb = FakeBridgeUsb(**kw)
    return raised(lambda: ctrl.pcie_cfg_req(0x0, bus=4))


class _StuckSignal:
    value = 4

    def _sleep(self, ms: int) -> None:
        return None


def _unsupported_arch() -> None:
    target = (10, 3, 0)  # the assertion of tinygrad 0.14 AMDDevice.__init__, on an RDNA2 target
    assert target[0] in (11, 12), f"Unsupported arch: gfx{target[0]}{target[1]:x}{target[2]:x}"


def usb_error(eno: int | None, code: int, text: str) -> usb.core.USBError:
    return usb.core.USBError(text, code, eno)


# (id, how to get the exception, expected class, expected reason)
CASES: list[tuple[str, Callable[..., BaseException], type[ChestnutError], str]] = [
    # configuration
    ("pyusb_no_backend", lambda mp: usb.core.NoBackendError("No backend available"), ConfigError, "no_libusb"),
    ("tinygrad_no_libusb", lambda mp: AttributeError("failed to load library libusb: try setting LIBUSB_PATH?"),
     ConfigError, "no_libusb"),
    ("fetch_sha_mismatch", lambda mp: RuntimeError("fetch sha mismatch, expected 4a51 but got 0000"),
     ConfigError, "firmware_bad"),
    ("firmware_urlerror", lambda mp: urllib.error.URLError("[Errno -3] Temporary failure in name resolution"),
     ConfigError, "firmware_download_failed"),
    # USB identity/ownership
    ("no_dock_amd", lambda mp: RuntimeError("AMD:0 does not exist (0 devices available)"), UsbLayerError, "no_dock"),
    ("no_such_dock", lambda mp: RuntimeError("AMD:1 does not exist (1 device available)"),
     UsbLayerError, "no_such_dock"),
    ("bad_product", lambda mp: tg_usb3(mp, product=b"USB Storage")(lambda u: None), UsbLayerError, "bad_product"),
    ("no_langid", lambda mp: ValueError("The device has no langid (permission issue, no string descriptors supported "
                                        "or device error)"), UsbLayerError, "no_product_string"),
    # USB transfers from tinygrad's USB3 over a failing libusb
    ("bulk_out_short", lambda mp: tg_usb3(mp, short_by=512)(lambda u: u.bulk_write(b"\0" * 4096)),
     UsbLayerError, "short_transfer"),
    ("control_short", lambda mp: tg_usb3(mp, ctrl_short_by=4)(lambda u: u.control_write(0xF0, data=b"\0" * 12)),
     UsbLayerError, "short_transfer"),
    ("async_no_device", lambda mp: tg_usb3(mp)(lambda u: (setattr(u, "_async_err", 5), u.bulk_wait(1))),
     UsbLayerError, "disconnect"),
    ("async_timed_out", lambda mp: tg_usb3(mp)(lambda u: (setattr(u, "_async_err", 2), u.bulk_wait(1))),
     UsbLayerError, "transfer_timeout"),
    ("async_stall", lambda mp: tg_usb3(mp)(lambda u: (setattr(u, "_async_err", 4), u.bulk_wait(1))),
     UsbLayerError, "stall"),
    ("async_overflow", lambda mp: tg_usb3(mp)(lambda u: (setattr(u, "_async_err", 6), u.bulk_wait(1))),
     UsbLayerError, "overflow"),
    ("async_cancelled", lambda mp: tg_usb3(mp)(lambda u: (setattr(u, "_async_err", 3), u.bulk_wait(1))),
     UsbLayerError, "cancelled"),
    ("async_short", lambda mp: tg_usb3(mp)(lambda u: (setattr(u, "_async_err", -1), u.bulk_wait(1))),
     UsbLayerError, "short_transfer"),
    ("async_error", lambda mp: tg_usb3(mp)(lambda u: (setattr(u, "_async_err", 1), u.bulk_wait(1))),
     UsbLayerError, "transfer_error"),
    ("bulk_out_no_device", lambda mp: tg_usb3(mp, rc={"libusb_bulk_transfer": -4})(lambda u: u.bulk_write(b"\0" * 512)),
     UsbLayerError, "disconnect"),
    ("bulk_in_timeout", lambda mp: tg_usb3(mp, rc={"libusb_bulk_transfer": -7})(lambda u: u.bulk_read(512)),
     UsbLayerError, "transfer_timeout"),
    ("control_pipe", lambda mp: tg_usb3(mp, rc={"libusb_control_transfer": -9})(lambda u: u.control_read(0xE4, 1)),
     UsbLayerError, "stall"),
    ("claim_busy", lambda mp: tg_usb3(mp, rc={"libusb_claim_interface": -6})(lambda u: None), UsbLayerError, "busy"),
    ("open_access", lambda mp: tg_usb3(mp, rc={"libusb_open": -3})(lambda u: None), UsbLayerError, "access_denied"),
    ("bulk_in_overflow", lambda mp: tg_usb3(mp, rc={"libusb_bulk_transfer": -8})(lambda u: u.bulk_read(512)),
     UsbLayerError, "overflow"),
    ("bulk_out_io", lambda mp: tg_usb3(mp, rc={"libusb_bulk_transfer": -1})(lambda u: u.bulk_write(b"\0" * 512)),
     UsbLayerError, "transfer_error"),
    ("open_not_found", lambda mp: tg_usb3(mp, rc={"libusb_open": -5})(lambda u: None), UsbLayerError, "not_found"),
    ("handle_events_other", lambda mp: tg_usb3(mp, rc={"libusb_handle_events": -99})(
        lambda u: (u._async_pending.__setitem__(7, None), u.bulk_wait(7))), UsbLayerError, "transfer_error"),
    # LIBUSB_ERROR_* names (other bindings and logs print them)
    ("name_no_device", lambda mp: RuntimeError("transfer failed: LIBUSB_ERROR_NO_DEVICE"), UsbLayerError, "disconnect"),
    ("name_timeout", lambda mp: RuntimeError("LIBUSB_ERROR_TIMEOUT"), UsbLayerError, "transfer_timeout"),
    ("name_pipe", lambda mp: RuntimeError("LIBUSB_ERROR_PIPE"), UsbLayerError, "stall"),
    ("name_busy", lambda mp: RuntimeError("LIBUSB_ERROR_BUSY"), UsbLayerError, "busy"),
    ("name_access", lambda mp: RuntimeError("LIBUSB_ERROR_ACCESS"), UsbLayerError, "access_denied"),
    ("name_overflow", lambda mp: RuntimeError("LIBUSB_ERROR_OVERFLOW"), UsbLayerError, "overflow"),
    ("name_io", lambda mp: RuntimeError("LIBUSB_ERROR_IO"), UsbLayerError, "transfer_error"),
    ("twin_usb_error", lambda mp: TwinUsbError(LIBUSB_ERROR_NO_DEVICE, "unplugged"), UsbLayerError, "disconnect"),
    ("name_not_found", lambda mp: RuntimeError("LIBUSB_ERROR_NOT_FOUND"), UsbLayerError, "not_found"),
    # pyusb USBError by errno (pyusb's libusb1 backend: LIBUSB_ERROR_* -> errno)
    ("pyusb_timeout", lambda mp: usb.core.USBTimeoutError("Operation timed out", -7, errno.ETIMEDOUT),
     UsbLayerError, "transfer_timeout"),
    ("pyusb_enodev", lambda mp: usb_error(errno.ENODEV, -4, "No such device (it may have been disconnected)"),
     UsbLayerError, "disconnect"),
    ("pyusb_etimedout", lambda mp: usb_error(errno.ETIMEDOUT, -7, "Operation timed out"),
     UsbLayerError, "transfer_timeout"),
    ("pyusb_epipe", lambda mp: usb_error(errno.EPIPE, -9, "Pipe error"), UsbLayerError, "stall"),
    ("pyusb_ebusy", lambda mp: usb_error(errno.EBUSY, -6, "Resource busy"), UsbLayerError, "busy"),
    ("pyusb_eacces", lambda mp: usb_error(errno.EACCES, -3, "Access denied (insufficient permissions)"),
     UsbLayerError, "access_denied"),
    ("pyusb_eoverflow", lambda mp: usb_error(errno.EOVERFLOW, -8, "Overflow"), UsbLayerError, "overflow"),
    ("pyusb_enoent", lambda mp: usb_error(errno.ENOENT, -5, "Entity not found"), UsbLayerError, "not_found"),
    ("pyusb_eio", lambda mp: usb_error(errno.EIO, -1, "Input/Output Error"), UsbLayerError, "transfer_error"),
    ("handle_events_plain", lambda mp: RuntimeError("libusb_handle_events: something new"),
     UsbLayerError, "transfer_error"),
    ("transport_reset", lambda mp: ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
     UsbLayerError, "disconnect"),
    ("transport_pipe", lambda mp: BrokenPipeError(errno.EPIPE, "Broken pipe"), UsbLayerError, "disconnect"),
    # PCIe, from tinygrad's CustomASM24Controller over a stand-in transport
    ("ltssm_stuck", lambda mp: tg_controller(mp, ltssm=0x4C), PcieLayerError, "ltssm_stuck"),
    ("ltssm_down", lambda mp: tg_controller(mp, ltssm=0x00), PcieLayerError, "link_down"),
    ("tlp_retries", lambda mp: tg_tlp(mp, ret_status=1), PcieLayerError, "tlp_retries_exhausted"),
    ("tlp_ur", lambda mp: tg_tlp(mp, cpl_status=0b001), PcieLayerError, "tlp_unsupported_request"),
    ("tlp_ca", lambda mp: tg_tlp(mp, cpl_status=0b100), PcieLayerError, "tlp_completer_abort"),
    ("tlp_crs", lambda mp: tg_tlp(mp, cpl_status=0b010), PcieLayerError, "tlp_config_retry"),
    ("tlp_reserved", lambda mp: tg_tlp(mp, cpl_status=0b011), PcieLayerError, "tlp_bad_completion"),
    # GPU
    ("unsupported_arch", lambda mp: raised(_unsupported_arch), GpuLayerError, "unsupported_arch"),
    ("drain", lambda mp: RuntimeError("GPU failed to drain USB copyin chunk 3 (10s, hung GPU?)"),
     GpuLayerError, "fence_stall"),
    ("wait_timeout", lambda mp: raised(lambda: HCQSignal.wait(_StuckSignal(), 5, timeout=5)),
     GpuLayerError, "wait_timeout"),
    ("hang", lambda mp: RuntimeError("Device hang detected"), GpuLayerError, "hang"),
    ("error_state", lambda mp: RuntimeError("Device is in error state"), GpuLayerError, "error_state"),
]


@pytest.mark.parametrize(("case_id", "make", "cls", "reason"), CASES, ids=[c[0] for c in CASES])
def test_classify_row(monkeypatch, case_id, make, cls, reason):
    exc = make(monkeypatch)
    err = classify(exc)
    assert type(err) is cls, (case_id, repr(exc), err)
    assert err.reason == reason
    assert err.__cause__ is exc
    assert err.detail  # the original message travels with the typed error
    assert advice_for(err)


def test_every_row_has_a_case(monkeypatch):
    hit = {match_rule(make(monkeypatch)) for _, make, _, _ in CASES}
    with tempfile.TemporaryDirectory() as d:
        hit.add(match_rule(_lock_error(Path(d))))
    missing = [(i, r.reason, r.pattern) for i, r in enumerate(RULES) if i not in hit]
    assert missing == []


def _lock_error(tmpdir: Path) -> BaseException:
    """tinygrad's own System.flock_acquire on a lock another process holds."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,os,sys,time; fd=os.open(sys.argv[1], os.O_RDWR|os.O_CREAT, 0o666); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", str(tmpdir / "am_usb.lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        old_umask, old_tmp = os.umask(0o022), tempfile.tempdir
        os.umask(old_umask)
        tempfile.tempdir = str(tmpdir)
        try:
            return raised(lambda: System.flock_acquire("am_usb.lock"))
        finally:
            tempfile.tempdir = old_tmp
            os.umask(old_umask)
            if getattr(System, "lock_fd", None):
                os.close(System.lock_fd)
                System.lock_fd = None
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.timeout(20)
def test_lock_held_from_tinygrad(tmp_path):
    err = classify(_lock_error(tmp_path))
    assert (type(err), err.reason) == (UsbLayerError, "lock_held")
    assert "am_usb.lock" in err.detail


@pytest.mark.parametrize(("source", "fragment"), [
    ("runtime/support/system.py", "Failed to acquire lock file"),
    ("runtime/support/system.py", "does not exist ({pluralize('device'"),
    ("runtime/ops_amd.py", "does not exist ({pluralize('device'"),
    ("runtime/ops_amd.py", "GPU failed to drain USB copyin chunk"),
    ("runtime/ops_amd.py", '"Device hang detected"'),
    ("runtime/ops_amd.py", '"Device is in error state"'),
    ("runtime/ops_amd.py", 'f"Unsupported arch: {self.arch}"'),
    ("runtime/support/hcq.py", "Wait timeout: {timeout} ms!"),
    ("helpers.py", "fetch sha mismatch"),
    ("runtime/support/c.py", "failed to load library {self.nm}"),
    ("runtime/support/usb.py", "bulk OUT 0x02 failed"),
    ("runtime/support/usb.py", "bulk IN 0x81 failed"),
    ("runtime/support/usb.py", "async bulk OUT failed: status="),
    ("runtime/support/usb.py", "PCIe link not up (LTSSM="),
])
def test_literal_messages_match_tinygrad_source(source, fragment):
    assert fragment in (TG / source).read_text()


def test_exception_group_unwraps_to_most_specific_member():
    group = ExceptionGroup("No interface for AMD:0 is available", [
        RuntimeError("No KFD interface"),
        RuntimeError("AMD:0 does not exist (0 devices available)"),
        RuntimeError("Failed to acquire lock file am_usb:1-4.lock. `sudo lsof /tmp/am_usb:1-4.lock` may help"),
    ])
    err = classify(group)
    assert (type(err), err.reason) == (UsbLayerError, "lock_held")
    assert not isinstance(err, BaseExceptionGroup)
    assert err.__cause__ is group


def test_nested_exception_group_and_unmatched_members():
    inner = ExceptionGroup("inner", [ValueError("x"), RuntimeError("PCIe link not up (LTSSM=0x00), not ready")])
    err = classify(ExceptionGroup("outer", [KeyError("k"), inner]))
    assert (type(err), err.reason) == (PcieLayerError, "link_down")


def test_unmatched_group_falls_back_to_default():
    err = classify(ExceptionGroup("g", [ValueError("a"), KeyError("b")]), default=UsbLayerError)
    assert (type(err), err.reason, err.layer) == (UsbLayerError, "unclassified", Layer.USB)


def test_cause_chain_is_classified_when_outer_is_not():
    try:
        try:
            raise RuntimeError("Wait timeout: 3000 ms! (the signal is not set to 9, but 8)")
        except RuntimeError as e:
            raise ValueError("while running") from e
    except ValueError as outer:
        err = classify(outer)
    assert (type(err), err.reason) == (GpuLayerError, "wait_timeout")


def test_hang_keeps_the_wait_timeout_it_followed():
    try:
        try:
            raise RuntimeError("Wait timeout: 3000 ms! (the signal is not set to 9, but 8)")
        except RuntimeError:
            raise RuntimeError("Device hang detected")  # noqa: B904 -- tinygrad raises it like this
    except RuntimeError as e:
        err = classify(e)
    assert (err.reason, "Wait timeout: 3000 ms" in err.detail) == ("hang", True)


def test_typed_error_passes_through_and_translated_reraises():
    e = PcieLayerError("link_down", "LTSSM=0x00")
    assert classify(e) is e
    with pytest.raises(GpuLayerError) as info:
        with translated():
            raise RuntimeError("Device is in error state")
    assert info.value.reason == "error_state"
    with pytest.raises(KeyboardInterrupt), translated():
        raise KeyboardInterrupt


# ---------------------------------------------------------------- signatures: a wedged bridge, not the cable

WEDGE_DETAIL = ("8.6 errors/s over 0.58 s (counter +0, 5/5 probe reads failed), above 5/s; last: transfer_timeout: "
                "USBTimeoutError: [Errno 110] Operation timed out (after UsbError: Operation timed out "
                "[LIBUSB_ERROR_TIMEOUT])")
POWER_CYCLE_BRIDGE = ("power-cycle the dock (unplug its power, or `chestnut twin power-cycle` on the twin): a wedged "
                      "bridge answers nothing until then; replugging the cable or another port does not help")


def test_every_probe_read_timing_out_on_an_enumerated_dock_is_a_wedged_bridge():
    """Found through the usb layer's transfers, blamed on the bridge: the pcie layer's error, with its remedy."""
    seen = UsbLayerError("unstable_link", WEDGE_DETAIL)
    err = classify(seen)
    assert (type(err), err.reason, err.detail, err.__cause__) == (PcieLayerError, "bridge_wedged", WEDGE_DETAIL, seen)
    assert err.layer is Layer.PCIE
    assert advice_for(err) == POWER_CYCLE_BRIDGE
    sig = diagnose("unstable_link", WEDGE_DETAIL)
    assert sig is not None and (sig.reason, sig.source) == ("bridge_wedged", "tinygrad#18137")


@pytest.mark.parametrize(("reason", "detail"), [
    ("unstable_link", WEDGE_DETAIL.replace("5/5", "3/5")),                      # some reads answered: the link
    ("unstable_link", WEDGE_DETAIL.replace("Operation timed out", "Input/Output Error")),  # errors, not silence
    ("disconnect", WEDGE_DETAIL),                                                # gone is gone
])
def test_a_flaky_or_vanished_link_is_not_a_wedged_bridge(reason, detail):
    e = UsbLayerError(reason, detail)
    assert diagnose(reason, detail) is None and classify(e) is e


def test_a_timed_out_transfer_is_not_advice_to_change_ports():
    """A timeout says nothing about the port's speed; what helps when nothing answers is a power-cycle."""
    for err in (classify(RuntimeError("libusb_control_transfer: Operation timed out")),
                classify(RuntimeError("async bulk OUT failed: status=2")),
                UsbLayerError("no_answer", "3 consecutive transfer attempts timed out")):
        advice = advice_for(err)
        assert "SuperSpeed" not in advice and "power-cycle the dock" in advice, (err, advice)
    assert advice_for(UsbLayerError("unstable_link", "9 of the last 100 transfer attempts failed")) == (
        "reseat or replace the USB cable; avoid hubs; check the dock's power supply")


def test_an_unusable_dock_lock_file_is_advice_about_the_file_not_the_model():
    err = UsbLayerError("lock_unusable", "the dock's lock file /tmp/am_usb:55-38.lock is a symlink (refused: it "
                                         "could point anywhere); remove it (sudo rm /tmp/am_usb:55-38.lock)")
    assert (err.reason, advice_for(err)) == (
        "lock_unusable", "remove the file the error names (the node makes the dock's lock file itself)")


def test_a_hang_tinygrad_declares_in_response_to_a_usb_error_is_the_usb_errors():
    # tinygrad 0.14 HCQCompiled.synchronize: a RuntimeError of the fence wait -> on_device_hang() raises anew
    err = classify(RuntimeError("Device hang detected"))  # alone: a hang
    assert (type(err).__name__, err.reason) == ("GpuLayerError", "hang")
    try:
        try:
            raise RuntimeError("bulk IN 0x81 failed: Pipe error [LIBUSB_ERROR_PIPE]")
        except RuntimeError:
            raise RuntimeError("Device hang detected")  # noqa: B904 - tinygrad raises it so, with the context
    except RuntimeError as e:
        err = classify(e)
    assert (type(err).__name__, err.reason) == ("UsbLayerError", "stall")
    assert err.detail.startswith("RuntimeError: Device hang detected (after RuntimeError: bulk IN 0x81 failed")


def test_an_empty_firmware_cache_is_told_how_to_fill_it_not_to_change_the_gpu():
    from chestnut.backend.classify import advice_for
    from chestnut.backend.errors import ConfigError

    assert advice_for(ConfigError("firmware_missing", "the GPU firmware cache /x holds none of ...")) == (
        "fill the GPU firmware cache: `chestnut probe --fill-firmware DIR` (DIR = a copy of linux-firmware's amdgpu/ "
        "files), then probe again")
