"""Classify failures from tinygrad 0.14, libusb and pyusb into the typed layer errors.

tinygrad 0.14 raises plain ``RuntimeError``/``AssertionError`` (and an ``ExceptionGroup`` when
several device interfaces fail); pyusb raises ``usb.core.USBError`` with an ``errno``. There are no
typed exceptions underneath, so the layer is read from the message. :data:`RULES` is
the table: the first row that matches wins, so rows run from most to least specific, and the row's
position doubles as its specificity when an ``ExceptionGroup`` has several members.

Some failures are known by the pattern of their evidence rather than by one message:
:data:`SIGNATURES` renames a typed error whose reason and detail show one (:func:`diagnose`). A
wedged bridge is the case in point: every vendor request times out while the device stays enumerated
at the same address and still answers standard requests (tinygrad#18137: after one large bulk write
the bridge locked until power-cycled) -- not a cable, which loses the device or corrupts transfers. It is
the pcie layer's :class:`PcieLayerError` ``bridge_wedged`` (the bridge is the dock's PCIe end), with the
remedy that works: power-cycle the dock.

Sources of the messages (tinygrad 0.14.0):

- ``runtime/support/usb.py``: ``checked()`` -> ``"<call or label>: <libusb_strerror>"``, e.g.
  ``"bulk OUT 0x02 failed: No such device (it may have been disconnected)"``;
  ``"async bulk OUT failed: status=<libusb_transfer_status or -1 for a short transfer>"``;
  ``"bulk OUT short write: n/m bytes"``; a bare ``assert`` on the product string and on the length
  of every control transfer; ``"PCIe link not up (LTSSM=0x..)"``; ``"TLP error after retries"``;
  ``"TLP completion status: ..."``.
- ``runtime/support/system.py``: ``"Failed to acquire lock file ..."``, ``"... does not exist (N devices available)"``.
- ``runtime/support/hcq.py``: ``"Wait timeout: N ms! ..."``.
- ``runtime/ops_amd.py``: ``"Device hang detected"``, ``"Device is in error state"``,
  ``"GPU failed to drain USB copyin chunk N ..."``, ``"AMD:0 does not exist (0 devices available)"``.
- ``helpers.py``: ``"fetch sha mismatch ..."``; a failed firmware download is a ``urllib.error.URLError``.
- libusb 1.0 ``libusb_strerror`` texts and ``LIBUSB_ERROR_*`` names; pyusb ``USBError.errno`` from
  ``usb/backend/libusb1.py`` (``LIBUSB_ERROR_NO_DEVICE`` -> ``ENODEV`` and so on).
"""

from __future__ import annotations

import errno as errno_mod
import re
import traceback
import urllib.error
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import usb.core

from chestnut.backend.errors import (
    ChestnutError,
    ConfigError,
    GpuLayerError,
    PcieLayerError,
    UsbLayerError,
)


@dataclass(frozen=True)
class Rule:
    """One row of the classification table.

    A row matches when the exception is an instance of ``exc_type``, its ``errno`` equals ``errno``
    (when given) and ``pattern`` is found (case-insensitive regex search) in the classified text:
    ``str(exc)``, or for an ``AssertionError`` also the source line of the failing ``assert``.
    """

    error: type[ChestnutError]
    reason: str
    pattern: str = ""
    exc_type: type[BaseException] = BaseException
    errno: int | None = None
    source: str = ""   # where the message is produced
    advice: str = ""   # what a person should do about it


# The libusb calls tinygrad's ``checked()`` names in its message prefix.
_LIBUSB_CALL = r"(?:bulk OUT 0x02 failed|bulk IN 0x81 failed|async submit failed|libusb_\w+): "
_USB_PY = "tinygrad 0.14 runtime/support/usb.py"
_SYSTEM_PY = "tinygrad 0.14 runtime/support/system.py"
_OPS_AMD = "tinygrad 0.14 runtime/ops_amd.py"
_HCQ_PY = "tinygrad 0.14 runtime/support/hcq.py"
_LIBUSB = "libusb 1.0 libusb_strerror / LIBUSB_ERROR_*"
_PYUSB = "pyusb 1.3 usb.core.USBError (errno from usb/backend/libusb1.py)"

_RECONNECT = "check the dock's cable and power; a fresh worker process is needed to see it again"
_REPLUG = "replug the dock into a SuperSpeed port; a fresh worker process is needed after any USB error"
_POWER_CYCLE = "power-cycle the dock (its PCIe link or GPU is wedged), then re-run `chestnut probe`"
_NO_ANSWER = ("a transfer got no answer; if every request times out while the dock stays enumerated, its bridge "
              "is wedged: power-cycle the dock")
_POWER_CYCLE_BRIDGE = ("power-cycle the dock (unplug its power, or `chestnut twin power-cycle` on the twin): a wedged "
                       "bridge answers nothing until then; replugging the cable or another port does not help")

RULES: tuple[Rule, ...] = (
    # ------------------------------------------------------------------ configuration (not dock faults)
    Rule(ConfigError, "no_libusb", exc_type=usb.core.NoBackendError, source="pyusb usb.core.find",
         advice="install libusb-1.0 (e.g. `apt-get install libusb-1.0-0`)"),
    Rule(ConfigError, "no_libusb", r"failed to load library libusb", source="tinygrad 0.14 runtime/support/c.py DLL",
         advice="install libusb-1.0 (e.g. `apt-get install libusb-1.0-0`) or set LIBUSB_PATH"),
    Rule(ConfigError, "firmware_bad", r"fetch sha mismatch", source="tinygrad 0.14 helpers.py fetch",
         advice="refill the GPU firmware cache: `chestnut probe --fill-firmware DIR`"),
    Rule(ConfigError, "firmware_download_failed", exc_type=urllib.error.URLError,
         source="tinygrad 0.14 helpers.py fetch",
         advice="the GPU firmware is not cached and cannot be downloaded: `chestnut probe --fill-firmware DIR`"),
    # ------------------------------------------------------------------ USB: enumeration, ownership, identity
    Rule(UsbLayerError, "lock_held", r"Failed to acquire lock file", source=_SYSTEM_PY,
         advice="another process owns the dock; stop it (see `lsof` on the lock file) or wait for it to exit"),
    Rule(UsbLayerError, "no_dock", r"does not exist \(0 devices available\)", source=_SYSTEM_PY,
         advice="no Chestnut dock found: " + _RECONNECT),
    Rule(UsbLayerError, "no_such_dock", r"does not exist \(\d+ devices? available\)", source=_SYSTEM_PY,
         advice="the device index is beyond the docks found; use index 0"),
    Rule(UsbLayerError, "no_product_string", r"The device has no langid", exc_type=ValueError,
         source="pyusb 1.3 usb.util.get_string (string descriptor 0 unanswered)",
         advice="the dock did not answer its string descriptors (a timed-out or failed transfer, or no permission "
                "on its device node): check the udev rule for 0xADD1:0x0001 / 0x3801:0x0001, then power-cycle the "
                "dock"),
    Rule(UsbLayerError, "bad_product", r"self\.product", exc_type=AssertionError, source=_USB_PY,
         advice="the bridge does not run the custom firmware (product string must start with 'custom' or 'AS2462')"),
    # ------------------------------------------------------------------ USB: transfers
    Rule(UsbLayerError, "short_transfer", r"bulk OUT short write", exc_type=AssertionError, source=_USB_PY,
         advice=_REPLUG),
    Rule(UsbLayerError, "short_transfer", r"libusb_control_transfer|in control_(?:read|write): assert",
         exc_type=AssertionError, source=_USB_PY, advice=_REPLUG),
    Rule(UsbLayerError, "disconnect", r"async bulk OUT failed: status=5\b", source=_USB_PY, advice=_RECONNECT),
    Rule(UsbLayerError, "transfer_timeout", r"async bulk OUT failed: status=2\b", source=_USB_PY, advice=_NO_ANSWER),
    Rule(UsbLayerError, "stall", r"async bulk OUT failed: status=4\b", source=_USB_PY, advice=_REPLUG),
    Rule(UsbLayerError, "overflow", r"async bulk OUT failed: status=6\b", source=_USB_PY, advice=_REPLUG),
    Rule(UsbLayerError, "cancelled", r"async bulk OUT failed: status=3\b", source=_USB_PY, advice=_REPLUG),
    Rule(UsbLayerError, "short_transfer", r"async bulk OUT failed: status=-1\b", source=_USB_PY, advice=_REPLUG),
    Rule(UsbLayerError, "transfer_error", r"async bulk OUT failed: status=1\b", source=_USB_PY, advice=_REPLUG),
    Rule(UsbLayerError, "disconnect", _LIBUSB_CALL + r"No such device", source=_LIBUSB, advice=_RECONNECT),
    Rule(UsbLayerError, "transfer_timeout", _LIBUSB_CALL + r"Operation timed out", source=_LIBUSB,
         advice=_NO_ANSWER),
    Rule(UsbLayerError, "stall", _LIBUSB_CALL + r"Pipe error", source=_LIBUSB, advice=_REPLUG),
    Rule(UsbLayerError, "busy", _LIBUSB_CALL + r"Resource busy", source=_LIBUSB,
         advice="another process or a kernel driver has claimed the dock's interface"),
    Rule(UsbLayerError, "access_denied", _LIBUSB_CALL + r"Access denied", source=_LIBUSB,
         advice="no permission on the USB device node: add a udev rule for 0xADD1:0x0001 / 0x3801:0x0001"),
    Rule(UsbLayerError, "overflow", _LIBUSB_CALL + r"Overflow", source=_LIBUSB, advice=_REPLUG),
    Rule(UsbLayerError, "transfer_error", _LIBUSB_CALL + r"Input/Output Error", source=_LIBUSB, advice=_REPLUG),
    Rule(UsbLayerError, "not_found", _LIBUSB_CALL + r"Entity not found", source=_LIBUSB, advice=_RECONNECT),
    Rule(UsbLayerError, "disconnect", r"\bLIBUSB_ERROR_NO_DEVICE\b", source=_LIBUSB, advice=_RECONNECT),
    Rule(UsbLayerError, "transfer_timeout", r"\bLIBUSB_ERROR_TIMEOUT\b", source=_LIBUSB, advice=_NO_ANSWER),
    Rule(UsbLayerError, "stall", r"\bLIBUSB_ERROR_PIPE\b", source=_LIBUSB, advice=_REPLUG),
    Rule(UsbLayerError, "busy", r"\bLIBUSB_ERROR_BUSY\b", source=_LIBUSB,
         advice="another process or a kernel driver has claimed the dock's interface"),
    Rule(UsbLayerError, "access_denied", r"\bLIBUSB_ERROR_ACCESS\b", source=_LIBUSB,
         advice="no permission on the USB device node: add a udev rule for 0xADD1:0x0001 / 0x3801:0x0001"),
    Rule(UsbLayerError, "overflow", r"\bLIBUSB_ERROR_OVERFLOW\b", source=_LIBUSB, advice=_REPLUG),
    Rule(UsbLayerError, "transfer_error", r"\bLIBUSB_ERROR_IO\b", source=_LIBUSB, advice=_REPLUG),
    Rule(UsbLayerError, "not_found", r"\bLIBUSB_ERROR_NOT_FOUND\b", source=_LIBUSB, advice=_RECONNECT),
    Rule(UsbLayerError, "transfer_timeout", exc_type=usb.core.USBTimeoutError, source=_PYUSB, advice=_NO_ANSWER),
    Rule(UsbLayerError, "disconnect", exc_type=usb.core.USBError, errno=errno_mod.ENODEV, source=_PYUSB,
         advice=_RECONNECT),
    Rule(UsbLayerError, "transfer_timeout", exc_type=usb.core.USBError, errno=errno_mod.ETIMEDOUT, source=_PYUSB,
         advice=_NO_ANSWER),
    Rule(UsbLayerError, "stall", exc_type=usb.core.USBError, errno=errno_mod.EPIPE, source=_PYUSB, advice=_REPLUG),
    Rule(UsbLayerError, "busy", exc_type=usb.core.USBError, errno=errno_mod.EBUSY, source=_PYUSB,
         advice="another process or a kernel driver has claimed the dock's interface"),
    Rule(UsbLayerError, "access_denied", exc_type=usb.core.USBError, errno=errno_mod.EACCES, source=_PYUSB,
         advice="no permission on the USB device node: add a udev rule for 0xADD1:0x0001 / 0x3801:0x0001"),
    Rule(UsbLayerError, "overflow", exc_type=usb.core.USBError, errno=errno_mod.EOVERFLOW, source=_PYUSB,
         advice=_REPLUG),
    Rule(UsbLayerError, "not_found", exc_type=usb.core.USBError, errno=errno_mod.ENOENT, source=_PYUSB,
         advice=_RECONNECT),
    Rule(UsbLayerError, "transfer_error", exc_type=usb.core.USBError, source=_PYUSB, advice=_REPLUG),
    Rule(UsbLayerError, "transfer_error",
         r"bulk OUT 0x02 failed|bulk IN 0x81 failed|libusb_handle_events|libusb_control_transfer|async bulk OUT failed",
         source=_USB_PY, advice=_REPLUG),
    Rule(UsbLayerError, "disconnect", exc_type=ConnectionResetError, source="the transport to the dock",
         advice=_RECONNECT),
    Rule(UsbLayerError, "disconnect", exc_type=BrokenPipeError, source="the transport to the dock", advice=_RECONNECT),
    # ------------------------------------------------------------------ PCIe
    Rule(PcieLayerError, "ltssm_stuck", r"PCIe link not up \(LTSSM=0x4C\)", source=_USB_PY, advice=_POWER_CYCLE),
    Rule(PcieLayerError, "link_down", r"PCIe link not up", source=_USB_PY,
         advice="the GPU's PCIe link did not train: check the dock's power supply, then power-cycle it"),
    Rule(PcieLayerError, "tlp_retries_exhausted", r"TLP error after retries", source=_USB_PY, advice=_POWER_CYCLE),
    Rule(PcieLayerError, "tlp_unsupported_request", r"TLP completion status: Unsupported Request", source=_USB_PY,
         advice=_POWER_CYCLE),
    Rule(PcieLayerError, "tlp_completer_abort", r"TLP completion status: Completer Abort", source=_USB_PY,
         advice=_POWER_CYCLE),
    Rule(PcieLayerError, "tlp_config_retry", r"TLP completion status: Config Retry", source=_USB_PY,
         advice="the GPU is still initialising; retry qualification after a short wait"),
    Rule(PcieLayerError, "tlp_bad_completion", r"TLP completion status", source=_USB_PY, advice=_POWER_CYCLE),
    # ------------------------------------------------------------------ GPU
    Rule(GpuLayerError, "unsupported_arch", r"Unsupported arch: gfx", exc_type=AssertionError, source=_OPS_AMD,
         advice="the dock carries a GPU tinygrad 0.14 cannot drive; use an RDNA3/RDNA4 card"),
    Rule(GpuLayerError, "fence_stall", r"failed to drain USB copyin chunk", source=_OPS_AMD, advice=_POWER_CYCLE),
    Rule(GpuLayerError, "wait_timeout", r"Wait timeout: \d+ ms", source=_HCQ_PY, advice=_POWER_CYCLE),
    Rule(GpuLayerError, "hang", r"Device hang detected", source=_OPS_AMD, advice=_POWER_CYCLE),
    Rule(GpuLayerError, "error_state", r"Device is in error state", source=_OPS_AMD, advice=_POWER_CYCLE),
)



@dataclass(frozen=True)
class Signature:
    """A failure named by the pattern of its evidence: a typed error of class ``found_in`` whose reason is one
    of ``hides_behind`` and whose detail matches ``pattern`` (case-insensitive regex search) becomes an
    ``error`` named ``reason``, with ``advice`` (``error`` may be another layer's class: the evidence came
    through one layer's transfers but speaks against another)."""

    reason: str
    error: type[ChestnutError]
    hides_behind: frozenset[str]
    pattern: str
    source: str
    advice: str
    found_in: type[ChestnutError] = UsbLayerError


SIGNATURES: tuple[Signature, ...] = (
    # every LTSSM read of the ladder's stability window timed out right after the dock enumerated and answered
    # its product string (standard requests): the bridge, not the cable (backend/ladder.py link_stability). The
    # bridge is the PCIe side's end of the dock (its firmware issues the TLPs), so it is the pcie layer's fault,
    # with the remedy that works: power-cycle the dock (a replug or another port does not help)
    Signature("bridge_wedged", PcieLayerError, frozenset({"unstable_link", "transfer_timeout", "no_answer"}),
              r"\b(\d+)/\1 probe reads failed.*timed out", source="tinygrad#18137", advice=_POWER_CYCLE_BRIDGE),
)
_SIG_COMPILED = tuple(re.compile(sig.pattern, re.IGNORECASE) for sig in SIGNATURES)

# reasons raised by our own code (not by a message of tinygrad's) and what to do about them
OWN_ADVICE: dict[str, str] = {
    "no_answer": _NO_ANSWER,   # backend/retry.py: every try of one transfer timed out
    "bridge_wedged": _POWER_CYCLE_BRIDGE,  # backend/retry.py: ... and the bridge's own register did not answer
    "slow_link": "move the dock to a SuperSpeed (USB 3) port and cable: a USB 2 link is too slow for the model's "
                 "copies",  # blame_slow_link
    "unstable_link": "reseat or replace the USB cable; avoid hubs; check the dock's power supply",
    # backend/real_runner.py check_firmware_cache: offline, tinygrad cannot download the GPU's firmware itself
    # backend/docklock.py: the lock file is not one the node can use (a symlink, another user's file, ...)
    "lock_unusable": "remove the file the error names (the node makes the dock's lock file itself)",
    "firmware_missing": "fill the GPU firmware cache: `chestnut probe --fill-firmware DIR` (DIR = a copy of "
                        "linux-firmware's amdgpu/ files), then probe again",
}


def diagnose(reason: str, detail: str) -> Signature | None:
    """The :data:`SIGNATURES` row a typed error's ``reason`` and ``detail`` show, or None."""
    for sig, rx in zip(SIGNATURES, _SIG_COMPILED, strict=True):
        if reason in sig.hides_behind and rx.search(detail):
            return sig
    return None


SUPERSPEED_MBPS = 5000  # USB 3 SuperSpeed (backend/protocol.py SUPERSPEED_MBPS); below it the link is USB 2
HIGHSPEED_MBPS = 480    # USB 2 High-Speed (backend/protocol.py HIGHSPEED_MBPS)
SLOW_LINK_REASONS = frozenset({"fence_stall", "wait_timeout", "hang", "copy_out_not_done", "start_timeout"})
"""GPU-layer reasons that a slow link produces by itself: on a USB 2 link tinygrad 0.14's copy-in drain
(``AMDAllocator._copyin``, 10 s) and the signal waits (``HCQSignal.wait``) time out because the bytes are
slow to cross (or a truncated bulk OUT never delivers the sentinel), not because the GPU stopped."""


def link_speed_text(speed_mbps: int | None) -> str | None:
    """``"480 Mbps, USB 2"`` for a link below SuperSpeed (``"12 Mbps, USB 1"`` below 480), None otherwise."""
    if speed_mbps is None or speed_mbps >= SUPERSPEED_MBPS:
        return None
    return f"{speed_mbps} Mbps, USB {2 if speed_mbps >= HIGHSPEED_MBPS else 1}"


def blame_slow_link(err: ChestnutError, speed_mbps: int | None) -> ChestnutError:
    """``err`` as the usb layer's when the link is below SuperSpeed and ``err`` is a GPU-layer failure a slow
    link causes (:data:`SLOW_LINK_REASONS`): :class:`UsbLayerError` ``slow_link`` with the speed and the
    original reason in its detail (``"fence_stall on a 480 Mbps, USB 2 link: ..."``), the original as
    ``__cause__``. Anything else, or a SuperSpeed (or unknown) link, returns ``err`` unchanged."""
    speed = link_speed_text(speed_mbps)
    if speed is None or not isinstance(err, GpuLayerError) or err.reason not in SLOW_LINK_REASONS:
        return err
    blamed = UsbLayerError("slow_link", f"{err.reason} on a {speed} link (copies ~10x slower than SuperSpeed, bulk "
                                        f"OUT transfers may be truncated): {err.detail}")
    blamed.__cause__ = err
    return blamed


UNCLASSIFIED = "unclassified"
_COMPILED = tuple(re.compile(r.pattern, re.IGNORECASE) if r.pattern else None for r in RULES)


def describe(exc: BaseException) -> str:
    """The text rules are matched against: ``str(exc)``; for an ``AssertionError`` also where it failed.

    A bare ``assert`` (tinygrad's product-string and control-transfer checks) has no message, so
    the failing frame's ``file:line in function`` and source line are appended; an exception with a
    ``name`` attribute naming a ``LIBUSB_ERROR_*`` (the twin's ``UsbError``) gets that name appended.
    """
    text = str(exc)
    name = getattr(exc, "name", None)  # an error object that carries its LIBUSB_ERROR_* name
    if isinstance(name, str) and name.startswith("LIBUSB_ERROR_"):
        text = f"{text} [{name}]"
    if isinstance(exc, AssertionError) and exc.__traceback__ is not None:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"assert failed at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}: {frame.line}"
        text = f"{text} ({where})" if text else where
    return text or type(exc).__name__


def match_rule(exc: BaseException) -> int | None:
    """Index in :data:`RULES` of the first row matching ``exc`` (ignoring causes), or None."""
    text = describe(exc)
    for i, (rule, rx) in enumerate(zip(RULES, _COMPILED, strict=True)):
        if not isinstance(exc, rule.exc_type):
            continue
        if rule.errno is not None and getattr(exc, "errno", None) != rule.errno:
            continue
        if rx is not None and not rx.search(text):
            continue
        return i
    return None


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            yield from _leaves(sub)
    else:
        yield exc


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` then its explicit causes / implicit contexts, without cycles."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _detail(exc: BaseException) -> str:
    parts = [f"{type(e).__name__}: {describe(e)}" for e in _chain(exc)]
    return parts[0] + "".join(f" (after {p})" for p in parts[1:])


RESPONSES = frozenset({"hang"})
"""Rules whose message is tinygrad's *response* to another error rather than a finding of its own: tinygrad
0.14 ``HCQCompiled.synchronize`` (``runtime/support/hcq.py``) catches any ``RuntimeError`` of the signal
wait -- a USB transfer that failed while it polled the fence included -- and calls ``on_device_hang()``
(``runtime/ops_amd.py``), which raises ``"Device hang detected"`` with the original as its context. Such an
error is named by the USB or PCIe error it responded to, when its chain holds one; alone, or after a GPU-side
error (a wait timeout), it is a hang."""


def _best(exc: BaseException) -> tuple[int | None, BaseException]:
    """The most specific (lowest rule index) member of ``exc``'s leaves and their cause chains."""
    best: tuple[int | None, BaseException] = (None, exc)
    for leaf in _leaves(exc):
        found: int | None = None
        for e in _chain(leaf):
            i = match_rule(e)
            if i is None:
                continue
            if found is None:
                found = i
            elif RULES[i].error is not GpuLayerError:  # the transport error the GPU-side response followed
                found = i
                break
            if RULES[found].reason not in RESPONSES:
                break  # the outermost classified exception of a chain speaks for it (see RESPONSES)
        if found is not None and (best[0] is None or found < best[0]):
            best = (found, leaf)
    return best


def classify(exc: BaseException, default: type[ChestnutError] = GpuLayerError) -> ChestnutError:
    """Map any exception to a typed :class:`ChestnutError` with a layer and a ``reason``.

    A :class:`ChestnutError` is returned unchanged, unless its reason and detail show a known failure
    signature (:func:`diagnose`): then it is renamed (the signature's class and reason, the same
    detail, the original as ``__cause__``). An ``ExceptionGroup`` is unwrapped to its most
    specific member (the one matching the earliest row of :data:`RULES`). An exception that no row
    matches directly is classified by its cause/context chain; failing that it becomes
    ``default(reason="unclassified")``. The returned error's ``detail`` holds the original message
    (with the chain), and ``__cause__`` the original exception.
    """
    if isinstance(exc, ChestnutError):
        sig = diagnose(exc.reason, exc.detail)
        if sig is None or not isinstance(exc, sig.found_in):
            return exc
        renamed = sig.error(sig.reason, exc.detail)
        renamed.__cause__ = exc
        return renamed
    i, member = _best(exc)
    if i is None:
        err: ChestnutError = default(UNCLASSIFIED, _detail(exc))
    else:
        detail = _detail(member)
        if member is not exc and isinstance(exc, BaseExceptionGroup):
            detail = f"{detail} [member of {type(exc).__name__}: {exc}]"
        err = RULES[i].error(RULES[i].reason, detail)
    err.__cause__ = exc
    return err


def advice_for(err: ChestnutError) -> str:
    """What a person should do about ``err`` (the signature or table row that produced it), or ``""``."""
    sig = next((sig for sig in SIGNATURES if sig.reason == err.reason and isinstance(err, sig.error)), None)
    if sig is not None:
        return sig.advice
    if err.reason in OWN_ADVICE:
        return OWN_ADVICE[err.reason]
    cause = err.__cause__
    if cause is not None:
        i, _ = _best(cause)
        if i is not None:
            return RULES[i].advice
    for rule in RULES:
        if rule.error is type(err) and rule.reason == err.reason and rule.advice:
            return rule.advice
    return ""


@contextmanager
def translated(default: type[ChestnutError] = GpuLayerError) -> Iterator[None]:
    """Re-raise any ``Exception`` raised inside the block as its classified :class:`ChestnutError`.

    ``KeyboardInterrupt``/``SystemExit`` pass through; typed errors pass through unchanged.
    """
    try:
        yield
    except ChestnutError:
        raise
    except Exception as e:
        raise classify(e, default) from e
