"""Bounded retry of idempotent USB transfers, and the policy that tells transient errors from a bad link.

Working docks see transient transfer errors: 0 to 815 bulk / 0xE4 I/O errors per hour on devices that
otherwise work (openpilot#38519). Failing the whole dock over on each of them (a fresh worker process,
a new qualification, shadow frames) would keep such a dock off the primary for good, so
:class:`RetryingUSB3` wraps the four synchronous transfer methods of tinygrad 0.14 ``USB3``
(``runtime/support/usb.py``; on the twin :class:`chestnut.backend.sim.usb3.TwinUSB3`, on a dock
tinygrad's own class through :func:`install_in_tinygrad`) and repeats a transfer that timed out or
failed with an I/O error -- but only when repeating it leaves the dock as one execution would.

What is and is not idempotent on this wire
------------------------------------------

A USB timeout means the host saw no answer, not that the device did nothing: the request may have
been executed and only its status stage or data lost (a lost receipt). tinygrad 0.14's own
``CustomASM24Controller.pcie_request`` re-issues a TLP up to 10 times, 1 ms apart, but only on a bad
return status in the completion; a USB error there escapes at once. The table (:data:`RULES`):

========================================  ===========  ====================================================
transfer                                  retried      why
========================================  ===========  ====================================================
0xE4 IN (XDATA read)                      yes          a read of bridge memory: no side effect
0xE5 OUT (XDATA write of one byte)        yes          sets a byte to a value: twice leaves the same byte
0xF2 OUT (arm the SRAM engine)            yes          carries slot and size, not a count: a second arm
                                                       replaces the first
0xF0 OUT, single, non-posted (MRd, CfgRd, yes, with    what ``pcie_request`` re-issues itself; the 0xF0 IN
CfgWr) and its 0xF0 IN completion         the header   is re-read only after the header is sent again (read
                                                       alone it could return a stale completion)
0xF0 OUT, posted MWr / streaming write    only into a  a value written to memory or to a register that
header (mode 1) and its bulk OUT          value region holds a value (a doorbell carries the write pointer,
                                                       tinygrad 0.14 ``AMDQueueDesc.signal_doorbell``) is
                                                       idempotent; a write that is an action (a mailbox
                                                       message, a FIFO push) is not, and the wire cannot
                                                       tell them apart: the runner names the regions
0xF0 OUT streaming read (mode 2) + bulk   yes, with    a memory read
IN                                        the header
bulk OUT into an SRAM window              yes, with    the whole image is sent again after its arm: the same
                                          its 0xF2 arm bytes land in the same place, and a chunk the GPU
                                                       already consumed is inert because its sentinel names
                                                       an old sequence number (tinygrad 0.14
                                                       ``AMDAllocator._copyin``); a bulk OUT replayed
                                                       without its arm is not (a partial first try moved
                                                       the armed stream on)
bulk IN of an SRAM window                 yes, with    a read of SRAM the GPU no longer writes; it is
                                          its 0xF2 arm also the wait for the GPU's copy (see
                                                       :class:`RetryPolicy`)
0xF3 OUT (PCIe power)                     no           power-on retrains the link for up to 10 s: the
                                                       ladder's job, never inside a frame
async transfers (``*_async``)             as their     they stay async and in flight together; tinygrad's
                                          synchronous  ``USB3`` latches the first failure in ``_async_err``
                                          twins, in    and never clears it, so the wrapper owns completion:
                                          order        on a transient failure at a wait it lets the rest
                                                       finish, clears the latch and submits again, in order,
                                                       every transfer not yet waited (a bulk OUT after its
                                                       arm) -- all idempotent, or none is sent again
========================================  ===========  ====================================================

Where a lost transfer shows up: on the twin, ``Twin._gate`` (``backend/sim/twin.py``) decides the
``timeout`` fault for each transfer that reaches the device and NAKs it until that transfer's own
timeout; the twin's ``USB3`` face (``backend/sim/usb3.py``) then raises tinygrad's text
(``"libusb_control_transfer: Operation timed out"``, ``"bulk OUT 0x02 failed: ..."``) or, for an async
transfer, latches ``_async_err = 2`` for the next ``bulk_wait``. The first to see it is the wrapper
below, called by tinygrad's ``CustomASM24Controller`` (``read``, ``write``, ``pcie_request``,
``scsi_write``/``scsi_read``) and ``AMDAllocator._copyin``/``_copyout``, or by our bounded copy protocol
(``backend/copy.py`` through :class:`~chestnut.backend.bridge.Bridge`). Without it the error went up
unchanged, the runner turned it sticky and the worker was replaced, each time.

Short and truncated transfers are lost transfers too, and retried by the same rules: tinygrad 0.14's
``USB3.bulk_write`` asserts ``"bulk OUT short write: n/m bytes"`` after libusb moved fewer bytes, its
control transfers assert their length, and its ``bulk_read`` returns what arrived (``_bulk_mv[:transferred]``),
which ``scsi_read``/``pcie_mem_read`` slice without looking. A short bulk OUT into an armed stream moved that
stream on by the bytes that crossed, so it is sent whole again only after its arm or header (which restarts
the stream at its first byte: the same bytes land in the same place); a short bulk IN is read again after its
arm and is never returned short (:meth:`RetryingUSB3.bulk_read` raises ``short_transfer`` instead), so no
result is built on a short transfer. On the twin they come from the ``short`` fault (``backend/sim/faults.py``).

A transfer that is not retried and fails is counted too, and raised as before (the worker is
replaced). Never retried inside tinygrad's copy (``_copyin``/``_copyout``): after a failed copy a
same-process retry "succeeds" and leaves the destination as it was (``tests/test_tinygrad_on_twin.py``
shows it); retry happens here, one transfer at a time, below the copy.

Bounds (:class:`RetryPolicy`): each retried transfer gets ``attempts`` tries of at most
``attempt_timeout_ms`` (plus the bytes at ``floor_bytes_per_ms`` for a bulk transfer), so a lost transfer is
retried inside the node's 150 ms frame deadline (openpilot modeld's deadline for the big model) -- except the
bulk IN of an armed SRAM window, which is also the wait for the GPU's copy and gets the GPU's whole wait
(``gpu_wait_ms``, the device wait timeout) after a first ordinary try: a slow GPU is the frame deadline's to
judge, not the transport's, and a lost read costs one short try, not the wait timeout.
A transfer that is not retried keeps the caller's timeout.

When the link is bad (:class:`LinkErrorPolicy`, :func:`judge`), the failing transfer raises
:class:`UsbLayerError` (the dock fails over): ``no_answer`` when ``max_error_run`` consecutive
attempts all timed out; ``unstable_link`` for such a run with I/O errors in it, for
``max_errors_in_window`` failures among the last ``ratio_window`` attempts, or for more than
``max_errors_per_s`` over ``rate_window_s`` (openpilot's hardware daemon judges link errors per
second over 2 s, at most 5 per second being stable; the ladder's ``link_stability`` uses the same
bound). A ``no_answer`` run after which the bridge's own register (0xE4 of the LTSSM byte, bridge memory)
does not answer either is a wedged bridge instead: :class:`~chestnut.backend.errors.PcieLayerError`
``bridge_wedged``, the dock's PCIe end, whose remedy is a power-cycle (tinygrad#18137), never the cable's.
Every verdict names its figure (the run, the count in the window, the rate). The counters go to health
through the runner's probe (:meth:`RetryingUSB3.stats`).
"""

from __future__ import annotations

import itertools
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from chestnut.backend import protocol as P
from chestnut.backend.classify import classify
from chestnut.backend.errors import ChestnutError, GpuLayerError, PcieLayerError, UsbLayerError

TRANSIENT_REASONS = frozenset({"transfer_timeout", "transfer_error", "short_transfer"})
"""Classified reasons (:mod:`chestnut.backend.classify`) worth another try: LIBUSB_ERROR_TIMEOUT,
LIBUSB_ERROR_IO and a short transfer (tinygrad 0.14 ``USB3.bulk_write``'s ``"bulk OUT short write: n/m
bytes"``, the bare ``assert`` on a control transfer's length, a bulk IN that returned fewer bytes than
asked, ``"async bulk OUT failed: status=-1"``). A vanished device, a halted endpoint or a busy interface are
not transient."""

STATS_KEY = "transient_errors"
"""The key of :meth:`RetryingUSB3.stats` in ``DockObservation.extra``."""


class Kind(StrEnum):
    """What a transfer does on this wire (the rows of :data:`RULES`)."""

    XDATA_READ = "xdata_read"
    XDATA_WRITE = "xdata_write"
    SRAM_ARM = "sram_arm"
    TLP_NONPOSTED = "tlp_nonposted"
    TLP_COMPLETION = "tlp_completion"
    TLP_VALUE_WRITE = "tlp_value_write"      # posted / streaming write into a value region
    TLP_ACTION_WRITE = "tlp_action_write"    # posted / streaming write anywhere else
    TLP_STREAM_READ = "tlp_stream_read"
    BULK_OUT_ARMED = "bulk_out_armed"        # after an idempotent arm / header of the same size
    BULK_IN_ARMED = "bulk_in_armed"
    BULK_BARE = "bulk_bare"                  # nothing replayable precedes it
    PCIE_POWER = "pcie_power"
    OTHER = "other"


RULES: dict[Kind, tuple[bool, str]] = {
    Kind.XDATA_READ: (True, "0xE4 reads bridge memory"),
    Kind.XDATA_WRITE: (True, "0xE5 sets one byte to a value"),
    Kind.SRAM_ARM: (True, "0xF2 carries slot and size; a second arm replaces the first"),
    Kind.TLP_NONPOSTED: (True, "a non-posted TLP; tinygrad's pcie_request re-issues it itself"),
    Kind.TLP_COMPLETION: (True, "re-read after its header is sent again"),
    Kind.TLP_VALUE_WRITE: (True, "a write of a value into a region the runner names as holding values"),
    Kind.TLP_ACTION_WRITE: (False, "a write outside the value regions may be an action (mailbox, FIFO)"),
    Kind.TLP_STREAM_READ: (True, "a streaming memory read"),
    Kind.BULK_OUT_ARMED: (True, "the whole image again after its arm; a consumed chunk's sentinel is stale"),
    Kind.BULK_IN_ARMED: (True, "the armed window or memory is read again after its arm"),
    Kind.BULK_BARE: (False, "nothing to re-arm: a partial first try moved the armed stream on"),
    Kind.PCIE_POWER: (False, "0xF3 retrains the link (up to 10 s): the ladder's job"),
    Kind.OTHER: (False, "not a request of this bridge's data path"),
}
"""Kind -> (retried, why)."""
_RETRIED = {k: v[0] for k, v in RULES.items()}


def _posted(fmt_type: int) -> bool:
    """Memory writes and messages get no completion (tinygrad 0.14 ``pcie_request``'s fast path)."""
    return (fmt_type & 0b11011111) == 0b01000000 or (fmt_type & 0b10111000) == 0b00110000


def tlp_address(data: bytes) -> int:
    """The 64-bit address of a 0xF0 OUT data stage (``<III``: low, high, value or dword count)."""
    lo, hi, _ = struct.unpack_from("<III", bytes(data).ljust(12, b"\0"))
    return lo | (hi << 32)


def in_regions(address: int, regions: Sequence[tuple[int, int]]) -> bool:
    """Whether ``address`` lies in one of ``regions`` ((base, size) pairs, bytes)."""
    return any(base <= address < base + size for base, size in regions)


def control_out_kind(request: int, value: int, index: int, data: bytes,
                     value_regions: Sequence[tuple[int, int]] = ()) -> Kind:
    """The :class:`Kind` of a vendor control OUT (bmRequestType 0x40) of tinygrad 0.14's
    ``CustomASM24Controller``: 0xE5, 0xF2, 0xF0 (by TLP type and mode, wValue low byte and wIndex),
    0xF3."""
    if request == P.REQ_XDATA_WRITE:
        return Kind.XDATA_WRITE
    if request == P.REQ_SRAM:
        return Kind.SRAM_ARM
    if request == P.REQ_PCIE_POWER:
        return Kind.PCIE_POWER
    if request != P.REQ_TLP:
        return Kind.OTHER
    fmt_type, mode = value & 0xFF, index & 0x3
    if mode == P.TLP_MODE_STREAM_READ:
        return Kind.TLP_STREAM_READ
    if mode == P.TLP_MODE_STREAM_WRITE or _posted(fmt_type):
        return Kind.TLP_VALUE_WRITE if in_regions(tlp_address(data), value_regions) else Kind.TLP_ACTION_WRITE
    return Kind.TLP_NONPOSTED


def control_in_kind(request: int) -> Kind:
    """The :class:`Kind` of a vendor control IN (bmRequestType 0xC0): 0xE4 or the 0xF0 completion."""
    if request == P.REQ_XDATA_READ:
        return Kind.XDATA_READ
    if request == P.REQ_TLP:
        return Kind.TLP_COMPLETION
    return Kind.OTHER


# ---------------------------------------------------------------- the policy (pure)


@dataclass(frozen=True)
class RetryPolicy:
    """How hard one idempotent transfer is tried: ``attempts`` tries, each bounded by what the dock needs for
    it -- ``attempt_timeout_ms`` for the request, plus ``nbytes / floor_bytes_per_ms`` for a bulk transfer's
    bytes, and for the bulk IN of an armed SRAM window the GPU's wait, ``gpu_wait_ms``.

    A control transfer on a working USB 3 link answers in well under a millisecond: 3 tries of 25 ms end
    within 75 ms, half the node's 150 ms frame deadline. ``floor_bytes_per_ms`` (20 000, i.e. 20 MB/s) is
    below what a USB 2 link moves (480 Mbps), so a slow link is not mistaken for a lost transfer. Reading an
    armed SRAM window is also the wait for the GPU's copy into it (tinygrad 0.14 ``AMDAllocator._copyout``
    reads right after ``scsi_read_arm``; ``scsi_read`` allows 10 s; the bridge NAKs until the GPU wrote the
    completion page), so that read gets the GPU's whole wait, ``gpu_wait_ms`` (3000 ms, the device wait
    timeout ``HCQDEV_WAIT_TIMEOUT_MS``, ``backend/protocol.py`` ``WAIT_TIMEOUT_MS``), in two tries: an ordinary
    one, then -- if the bridge still answers -- the rest of the wait (:meth:`RetryingUSB3._read_window`). A GPU
    that answers within the wait timeout is never called dead here; a slow one is the frame deadline's and the
    stage budget's; a read lost on the wire is read again after one ordinary try.
    """

    attempts: int = 3
    attempt_timeout_ms: int = 25
    floor_bytes_per_ms: int = 20_000
    gpu_wait_ms: int = P.WAIT_TIMEOUT_MS

    def __post_init__(self) -> None:
        if min(self.attempts, self.attempt_timeout_ms, self.floor_bytes_per_ms, self.gpu_wait_ms) < 1:
            raise ValueError("attempts, attempt_timeout_ms, floor_bytes_per_ms and gpu_wait_ms must be >= 1")

    def timeout_ms(self, caller_ms: int, nbytes: int = 0, gpu_wait: bool = False) -> int:
        """One attempt's timeout: the bound above, never more than the caller's own (0 = none: the bound)."""
        bound = self.attempt_timeout_ms + -(-nbytes // self.floor_bytes_per_ms)
        if gpu_wait:
            bound = max(bound, self.gpu_wait_ms)
        return bound if caller_ms <= 0 else min(caller_ms, bound)


@dataclass(frozen=True)
class LinkErrorPolicy:
    """When transient errors say the link is bad (see the module doc for the sources).

    ``max_error_run``: consecutive failed attempts (3: every try of one transfer failed);
    ``max_errors_in_window`` of the last ``ratio_window`` attempts (5 of 100: fifty times the rate of
    a link that loses one transfer in a thousand); ``max_errors_per_s`` over ``rate_window_s``
    (openpilot's hardware daemon: 5 per second over 2 s). ``report_window_s`` is the window of the
    rate published to health. ``bridge_reads``: reads of the bridge's own register after a ``no_answer``
    run that must all time out for the bridge to be called wedged (2: a link losing one transfer in ten
    names a good bridge wedged once in a hundred such runs; each read is bounded like one attempt, 25 ms).
    """

    max_error_run: int = 3
    ratio_window: int = 100
    max_errors_in_window: int = 5
    max_errors_per_s: float = 5.0
    rate_window_s: float = 2.0
    report_window_s: float = 60.0
    bridge_reads: int = 2


@dataclass
class LinkErrorLog:
    """The evidence :func:`judge` reads: outcomes of the last attempts, failure times, totals.

    Times are seconds on any monotonic clock. ``outcomes`` holds True for a failed attempt.
    """

    policy: LinkErrorPolicy
    attempts: int = 0
    errors: int = 0
    retried_ok: int = 0        # transfers that failed at least once and then went through
    not_retried: int = 0       # failures of transfers that are not idempotent
    window_waits: int = 0      # SRAM-window reads that outlasted one try while the bridge answered (not errors)
    error_run: int = 0
    timeouts_in_run: int = 0   # of ``error_run``, how many timed out (the rest: I/O errors)
    last_error: str = ""

    def __post_init__(self) -> None:
        self.outcomes: deque[bool] = deque(maxlen=self.policy.ratio_window)
        self.error_times: deque[float] = deque()

    def ok(self) -> None:
        """One attempt went through."""
        self.attempts += 1
        self.error_run = self.timeouts_in_run = 0
        self.outcomes.append(False)

    def error(self, now_s: float, what: str, timed_out: bool = True) -> None:
        """One attempt failed with a transient error (``what``: the transfer and the error; ``timed_out``:
        LIBUSB_ERROR_TIMEOUT rather than LIBUSB_ERROR_IO)."""
        self.attempts += 1
        self.errors += 1
        self.error_run += 1
        self.timeouts_in_run += int(timed_out)
        self.last_error = what
        self.outcomes.append(True)
        self.error_times.append(now_s)
        keep = max(self.policy.rate_window_s, self.policy.report_window_s)
        while self.error_times and self.error_times[0] < now_s - keep:
            self.error_times.popleft()

    def errors_since(self, since_s: float) -> int:
        return sum(1 for t in self.error_times if t >= since_s)


@dataclass(frozen=True)
class Verdict:
    """The link is bad: ``reason`` (``no_answer`` or ``unstable_link``) and the rule that said so."""

    reason: str
    detail: str


def judge(log: LinkErrorLog, now_s: float) -> Verdict | None:
    """Whether the link is bad, or None while its errors are transient. Pure: reads ``log`` only.

    A run of attempts that all timed out is ``no_answer``: on an open handle a device that left the bus
    fails LIBUSB_ERROR_NO_DEVICE, so it is still there and answers nothing (a wedged bridge does that,
    tinygrad#18137); the other rules are ``unstable_link``."""
    p = log.policy
    if log.error_run >= p.max_error_run:
        if log.timeouts_in_run == log.error_run:
            return Verdict("no_answer", f"{log.error_run} consecutive transfer attempts timed out (bound "
                                        f"{p.max_error_run}); the device is still there: a vanished one fails "
                                        "LIBUSB_ERROR_NO_DEVICE")
        return Verdict("unstable_link", f"{log.error_run} consecutive transfer attempts failed "
                                        f"(bound {p.max_error_run})")
    in_window = sum(log.outcomes)
    if in_window >= p.max_errors_in_window:
        return Verdict("unstable_link", f"{in_window} of the last {len(log.outcomes)} transfer attempts failed "
                                        f"(bound {p.max_errors_in_window} of {p.ratio_window})")
    recent = log.errors_since(now_s - p.rate_window_s)
    if recent > p.max_errors_per_s * p.rate_window_s:
        return Verdict("unstable_link", f"{recent} transfer errors in {p.rate_window_s:g} s, above "
                                        f"{p.max_errors_per_s:g}/s (openpilot hardwared's bound)")
    return None


# ---------------------------------------------------------------- the wrapper


@dataclass(slots=True)
class _Async:
    """An async transfer the wrapper submitted and owns until it is waited: ``method(*args, timeout_ms)`` of the
    wrapped USB3 sends it (again); ``reads``: it returns (tag, the buffer the data lands in)."""

    what: tuple[Any, ...]            # a format and its arguments naming the transfer
    kind: Kind
    method: Callable[..., Any]
    args: tuple[Any, ...]
    caller_ms: int
    nbytes: int = 0
    arm: _Replay | None = None       # a bulk OUT's 0xF2 arm or streaming header: sent again before it
    reads: bool = False
    inner: int = 0                   # the wrapped USB3's tag of the latest submission
    out: memoryview | None = None    # a control IN's buffer, the one handed to tinygrad
    pending_copy: memoryview | None = None


@dataclass(slots=True)
class _Replay:
    """A request that makes the next transfer repeatable: sent again before it."""

    request: int
    value: int
    index: int
    data: bytes
    timeout_ms: int
    nbytes: int          # the bytes the next bulk transfer moves under it (0: a TLP header for a completion)
    direction: str       # "out", "in" or "cpl"


class RetryingUSB3:
    """tinygrad 0.14 ``USB3`` with bounded retry of idempotent transfers (see the module doc).

    Same methods and arguments as the wrapped ``usb`` (timeouts in ms); anything else is passed
    through (``handle``, ``product``, ``close`` ...). ``value_regions``: (base, size) byte ranges of
    PCIe memory whose writes set values (VRAM, doorbells); may be set after construction, once the
    BARs are known. Async transfers stay async and in flight as tinygrad issues them; the wrapper owns their
    completion (the "async transfers" section below). Raises what the wrapped transfer raises; when
    :func:`judge` says the link is bad, :class:`UsbLayerError` ``no_answer`` / ``unstable_link`` naming the
    rule and the last error (its ``__cause__``).
    """

    def __init__(self, usb: Any, *, retry: RetryPolicy | None = None, link: LinkErrorPolicy | None = None,
                 value_regions: Sequence[tuple[int, int]] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.usb = usb
        self.retry = retry or RetryPolicy()
        self.log = LinkErrorLog(link or LinkErrorPolicy())
        self.value_regions: Sequence[tuple[int, int]] = tuple(value_regions)
        self.clock = clock
        self._arm: dict[str, _Replay | None] = {"out": None, "in": None, "cpl": None}  # per direction: what re-arms
        self._timeouts: dict[tuple[int, int, bool], int] = {}
        self._tags = itertools.count(1)  # this wrapper's async tags (the wrapped USB3's change on a retry)
        self._pending: dict[int, _Async] = {}  # tag -> transfer, in submission order, until waited
        self._async_failed: BaseException | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.usb, name)

    # ------------------------------------------------------------------ bookkeeping
    def stats(self) -> dict[str, Any]:
        """Counters for health (``DockObservation.extra[STATS_KEY]``): attempts, errors, retried_ok,
        not_retried, errors in the last ``report_window_s`` and that window, the last error."""
        now = self.clock()
        w = self.log.policy.report_window_s
        return {"attempts": self.log.attempts, "errors": self.log.errors, "retried_ok": self.log.retried_ok,
                "not_retried": self.log.not_retried, "window_waits": self.log.window_waits, "window_s": w,
                "errors_in_window": self.log.errors_since(now - w), "last_error": self.log.last_error}

    def _timeout(self, caller_ms: int, nbytes: int = 0, gpu_wait: bool = False) -> int:
        """:meth:`RetryPolicy.timeout_ms`, remembered per argument (the hot path of every transfer)."""
        key = (caller_ms, nbytes, gpu_wait)
        t = self._timeouts.get(key)
        if t is None:
            t = self._timeouts[key] = self.retry.timeout_ms(caller_ms, nbytes, gpu_wait)
        return t

    def _run(self, what: tuple[Any, ...], kind: Kind, attempt: Callable[..., Any], args: tuple[Any, ...],
             caller_ms: int, nbytes: int = 0, rp: _Replay | None = None, gpu_wait: bool = False) -> Any:
        """``attempt(*args, timeout_ms)`` with the retry rules of ``kind``; ``rp`` (an arm or header) is sent again
        before a retry. ``what``: a format and its arguments naming the transfer (formatted only for an error).
        ``gpu_wait``: the transfer is also the wait for the GPU (the bulk IN of an armed SRAM window): each try
        gets the GPU's whole wait (:meth:`_read_window`), and one that timed out while the bridge answers is the
        GPU's."""
        if gpu_wait:
            return self._read_window(what, kind, attempt, args, caller_ms, nbytes, rp)
        t_ms = self._timeout(caller_ms, nbytes) if _RETRIED[kind] else caller_ms
        try:
            out = attempt(*args, t_ms)
        except Exception as e:
            first = e
        else:
            self.log.ok()
            return out
        return self._retry_after(what[0] % what[1:], kind, attempt, args, t_ms, rp, gpu_wait, first)

    def _read_window(self, what: tuple[Any, ...], kind: Kind, attempt: Callable[..., Any], args: tuple[Any, ...],
                     caller_ms: int, nbytes: int, rp: _Replay | None) -> Any:
        """The bulk IN of an armed SRAM window, which is also the wait for the GPU's copy into it. A first try
        with an ordinary transfer's bound (``attempt_timeout_ms`` + the bytes): a healthy GPU has written the
        window by then. When it times out and the bridge still answers one XDATA read, the transfer was lost
        or the GPU is still copying -- neither is the link's fault, so it is not counted against the link --
        and the window is armed again and read with what is left of the GPU's wait (``gpu_wait_ms`` in all).
        So a lost transfer costs one short try, not the wait timeout, and a slow GPU still has its whole wait;
        a second timeout with the bridge answering is the GPU's (``copy_out_not_done``). Any other failure,
        or a bridge that does not answer, goes to the link rules as for any transfer."""
        quick = self._timeout(caller_ms, nbytes)
        t0 = self.clock()
        try:
            out = attempt(*args, quick)
        except Exception as e:
            first = e
        else:
            self.log.ok()
            return out
        whole = self._timeout(caller_ms, nbytes, True)
        err = first if isinstance(first, ChestnutError) else classify(first, default=UsbLayerError)
        if err.reason != "transfer_timeout" or isinstance(self._read_bridge_register(), ChestnutError):
            return self._retry_after(what[0] % what[1:], kind, attempt, args, whole, rp, True, first)
        self.log.window_waits += 1
        left = max(1, whole - int((self.clock() - t0) * 1e3))
        replay = self._sender(rp)
        try:
            if replay is not None:
                replay(quick)
            out = attempt(*args, left)
        except Exception as e:
            return self._retry_after(what[0] % what[1:], kind, attempt, args, left, rp, True, e)
        self.log.ok()
        return out

    def _retry_after(self, what: str, kind: Kind, attempt: Callable[..., Any], args: tuple[Any, ...], t_ms: int,
                     rp: _Replay | None, gpu_wait: bool, first: Exception) -> Any:
        """The tries after a first failure ``first`` (see :meth:`_run`)."""
        retried = _RETRIED[kind]
        tries = self.retry.attempts if retried else 1
        replay = self._sender(rp)
        e: Exception = first
        for i in range(tries):
            if i:
                try:
                    if replay is not None:
                        replay(t_ms)
                    out = attempt(*args, t_ms)
                except Exception as again:
                    e = again
                else:
                    self.log.ok()
                    self.log.retried_ok += 1
                    return out
            err = e if isinstance(e, ChestnutError) else classify(e, default=UsbLayerError)
            if err.reason not in TRANSIENT_REASONS:
                raise e
            self.log.error(self.clock(), f"{what}: {err.reason}: {err.detail}", err.reason == "transfer_timeout")
            if not retried:
                self.log.not_retried += 1
            bad = judge(self.log, self.clock())
            if (bad is not None or i + 1 >= tries or gpu_wait) and kind is Kind.BULK_IN_ARMED \
                    and err.reason == "transfer_timeout":
                self._blame_the_gpu_if_the_bridge_answers(what, err, e)
            if bad is not None:
                if bad.reason == "no_answer":
                    self._blame_the_bridge_if_it_answers_nothing(bad, what, err, e)
                raise UsbLayerError(bad.reason, f"{bad.detail}; last: {what}: {err.detail}") from e
            if i + 1 >= tries:
                raise e
        raise AssertionError("unreachable")  # pragma: no cover

    def _read_bridge_register(self) -> bytes | ChestnutError:
        """One 0xE4 read of the bridge's own LTSSM byte (``P.XDATA_LTSSM``, bridge memory: no TLP crosses the
        link), bounded like one retried attempt: its byte, or the classified failure."""
        try:
            return bytes(self.usb.control_read(P.REQ_XDATA_READ, 1, P.XDATA_LTSSM, 0, self.retry.timeout_ms(1000)))
        except Exception as e:  # noqa: BLE001 - the failure is the answer
            return e if isinstance(e, ChestnutError) else classify(e, default=UsbLayerError)

    def _blame_the_bridge_if_it_answers_nothing(self, bad: Verdict, what: str, err: ChestnutError,
                                                cause: BaseException) -> None:
        """A ``no_answer`` verdict (every attempt of a run timed out on a device that is still there) is a
        wedged bridge when the bridge's own register does not answer either: ``bridge_reads`` reads of its LTSSM
        byte (:meth:`_read_bridge_register`) that all time out. The bridge's firmware stopped answering vendor
        requests (tinygrad#18137: locked until power-cycled): raises :class:`PcieLayerError` ``bridge_wedged``
        (the bridge is the dock's PCIe end; its remedy is a power-cycle of the dock, not a replug), naming the
        run and the reads. Returns when one read answers or fails otherwise (the link rules decide)."""
        n = self.log.policy.bridge_reads
        for _ in range(n):
            got = self._read_bridge_register()
            if not isinstance(got, ChestnutError) or got.reason != "transfer_timeout":
                return
        raise PcieLayerError("bridge_wedged", f"{bad.detail}, and {n}/{n} reads of the bridge's own register (XDATA "
                             f"0x{P.XDATA_LTSSM:04X}, the LTSSM byte) timed out: the bridge answers nothing "
                             f"(tinygrad#18137); last: {what}: {err.detail}") from cause

    def _blame_the_gpu_if_the_bridge_answers(self, what: str, err: ChestnutError, cause: BaseException) -> None:
        """An armed bulk IN that timed out on every try -- of an SRAM window, on its first: that try had the GPU's
        whole wait -- is also the wait for the GPU's copy into that window (the bridge serves the read once the
        GPU has written the completion page; tinygrad 0.14 ``AMDAllocator._copyout`` reads the window right
        after queueing the SDMA copy). If the bridge
        still answers one XDATA read (0xE4 of the LTSSM byte, ``P.XDATA_LTSSM``), the link is alive and the
        GPU did not do the copy: raises :class:`GpuLayerError` ``copy_out_not_done`` (the gpu layer, as
        tinygrad's own "hung GPU?" drain error says), and the timeouts are not held against the link.
        Returns when the bridge does not answer either (then the link rules decide)."""
        ltssm = self._read_bridge_register()
        if isinstance(ltssm, ChestnutError):  # the bridge does not answer: the link rules decide
            return
        # the bulk IN's timeouts were the GPU's, not the link's: take them back out of the link's evidence
        for _ in range(min(self.log.error_run, len(self.log.outcomes))):
            self.log.outcomes.pop()
            self.log.error_times.pop()
            self.log.errors -= 1
        self.log.error_run = self.log.timeouts_in_run = 0
        state = f"LTSSM 0x{ltssm[0]:02X}" if ltssm else "XDATA read answered"
        raise GpuLayerError("copy_out_not_done", f"{what} timed out while the bridge answers ({state}): the GPU "
                            f"never wrote the window (hung GPU?); last: {err.detail}") from cause

    # ------------------------------------------------------------------ synchronous transfers
    def control_write(self, request: int, value: int = 0, index: int = 0, data: bytes = b"",
                      timeout: int = 1000) -> Any:
        data = bytes(data)
        kind = control_out_kind(request, value, index, data, self.value_regions)
        rp = self._replay_for(kind, request, value, index, data, timeout)
        if rp is not None:
            self._arm[rp.direction] = rp
        return self._run(("control OUT 0x%02X", request), kind, self.usb.control_write,
                         (request, value, index, data), timeout)

    def control_read(self, request: int, length: int, value: int = 0, index: int = 0,
                     timeout: int = 1000) -> Any:
        kind = control_in_kind(request)
        rp = None
        if kind is Kind.TLP_COMPLETION:
            rp, self._arm["cpl"] = self._arm["cpl"], None
            if rp is None:
                kind = Kind.OTHER  # a completion with no repeatable header before it
        return self._run(("control IN 0x%02X", request), kind, self.usb.control_read, (request, length, value, index),
                         timeout, rp=rp)

    def bulk_write(self, payload: Any, timeout: int = 1000) -> Any:
        n = len(memoryview(payload).cast("B"))
        rp, self._arm["out"] = self._arm["out"], None
        armed = rp is not None and rp.nbytes == n
        return self._run(("bulk OUT 0x02",), Kind.BULK_OUT_ARMED if armed else Kind.BULK_BARE, self.usb.bulk_write,
                         (payload,), timeout, n, rp if armed else None)

    def _whole_read(self, length: int, t_ms: int) -> Any:
        out = self.usb.bulk_read(length, t_ms)
        got = len(memoryview(out).cast("B")) if out is not None else 0
        if out is not None and got < length:
            raise UsbLayerError("short_transfer", f"bulk IN 0x81: got {got} of {length} bytes")
        return out

    def bulk_read(self, length: int, timeout: int = 1000) -> Any:
        """A bulk IN of ``length`` bytes. tinygrad 0.14 ``USB3.bulk_read`` returns whatever arrived
        (``_bulk_mv[:transferred]``) and its callers (``scsi_read``, ``pcie_mem_read``) slice it without
        looking, so a short read here raises :class:`UsbLayerError` ``short_transfer`` instead of being
        returned: retried with its arm like a timeout, never handed up."""
        rp, self._arm["in"] = self._arm["in"], None
        armed = rp is not None and rp.nbytes >= length
        gpu_wait = armed and rp is not None and rp.request == P.REQ_SRAM
        return self._run(("bulk IN 0x81",), Kind.BULK_IN_ARMED if armed else Kind.BULK_BARE, self._whole_read,
                         (length,), timeout, length, rp if armed else None, gpu_wait)

    # ------------------------------------------------------------------ async transfers
    # tinygrad's USB3 latches the first async failure in ``_async_err`` and raises it at every later
    # ``bulk_wait``. The wrapper owns each async transfer's completion instead: it submits the transfer to the
    # wrapped USB3 as tinygrad asked (asynchronously, in flight with the others; its timeout bounded like a
    # synchronous try), and when a wait reports a transient failure it lets every transfer still in flight
    # finish, clears the latch and submits again, in their order, all transfers not yet waited (a bulk OUT
    # after its arm), before tinygrad sees anything -- only if every one of them is idempotent (:data:`RULES`).
    def _try_ms(self, kind: Kind, caller_ms: int, nbytes: int = 0) -> int:
        return self._timeout(caller_ms, nbytes) if _RETRIED[kind] else caller_ms

    def _submit(self, rec: _Async) -> int:
        if self._async_failed is not None:  # given up on: tinygrad's latch stays, as tinygrad's USB3 would have it
            raise RuntimeError(str(self._async_failed))
        got = rec.method(*rec.args, self._try_ms(rec.kind, rec.caller_ms, rec.nbytes))
        if rec.reads:
            rec.inner, rec.out = int(got[0]), got[1]
        else:
            rec.inner = int(got)
        tag = next(self._tags)
        self._pending[tag] = rec
        return tag

    def _resubmit(self, rec: _Async) -> None:
        """Submit ``rec`` again (a control IN's data is copied into the buffer tinygrad holds once waited)."""
        got = rec.method(*rec.args, self._try_ms(rec.kind, rec.caller_ms, rec.nbytes))
        if rec.reads:
            rec.inner, rec.pending_copy = int(got[0]), got[1]
        else:
            rec.inner = int(got)

    def control_write_async(self, request: int, value: int = 0, index: int = 0, data: bytes = b"",
                            timeout: int = 1000) -> int:
        data = bytes(data)
        kind = control_out_kind(request, value, index, data, self.value_regions)
        rp = self._replay_for(kind, request, value, index, data, timeout)
        if rp is not None:
            self._arm[rp.direction] = rp
        return self._submit(_Async(("async control OUT 0x%02X", request), kind, self.usb.control_write_async,
                                   (request, value, index, data), timeout))

    def control_read_async(self, request: int, length: int, value: int = 0, index: int = 0,
                           timeout: int = 1000) -> tuple[int, memoryview]:
        kind = control_in_kind(request)
        if kind is Kind.TLP_COMPLETION:
            kind = Kind.OTHER  # its header went before it, not with it: nothing to send again
        rec = _Async(("async control IN 0x%02X", request), kind, self.usb.control_read_async,
                     (request, length, value, index), timeout, reads=True)
        tag = self._submit(rec)
        assert rec.out is not None
        return tag, rec.out

    def bulk_write_async(self, payload: Any, timeout: int = 10000) -> int:
        n = len(memoryview(payload).cast("B"))
        rp, self._arm["out"] = self._arm["out"], None
        armed = rp is not None and rp.nbytes == n
        return self._submit(_Async(("async bulk OUT 0x02",), Kind.BULK_OUT_ARMED if armed else Kind.BULK_BARE,
                                   self.usb.bulk_write_async, (payload,), timeout, n, rp if armed else None))

    def bulk_wait(self, tag: int) -> Any:
        """Wait for an async transfer of this wrapper. A transient failure reported by the wrapped USB3 is
        retried as the section above says (up to ``attempts`` submissions in all, each failure held against the
        link: :func:`judge` may raise :class:`UsbLayerError`); anything else is raised as tinygrad raised it."""
        if self._async_failed is not None:
            raise RuntimeError(str(self._async_failed))
        rec = self._pending.get(tag)
        if rec is None:  # done again (and waited) while an earlier wait recovered
            return None
        try:
            self.usb.bulk_wait(rec.inner)
        except Exception as e:
            err = classify(e, default=UsbLayerError)
            if err.reason not in TRANSIENT_REASONS:
                raise
            failed = e
        else:
            del self._pending[tag]
            self.log.ok()
            return None
        self._recover(rec, failed, err)
        return None

    def _drain(self, tags: Sequence[int]) -> None:
        """Let the wrapped USB3's transfers ``tags`` finish, whatever its latch says."""
        for t in tags:
            try:
                self.usb.bulk_wait(t)
            except Exception:  # noqa: BLE001, S110 - the latch: each was waited only to let it finish
                pass

    def _recover(self, failed: _Async, cause: BaseException, err: ChestnutError) -> None:
        recs = list(self._pending.values())  # in submission order: the failed one and every one not yet waited
        what = failed.what[0] % failed.what[1:]
        self.log.error(self.clock(), f"{what}: {err.reason}: {err.detail}", err.reason == "transfer_timeout")
        if not all(RULES[r.kind][0] for r in recs):
            self.log.not_retried += 1
            self._give_up(cause)
            raise cause
        last: BaseException = cause
        for _ in range(self.retry.attempts - 1):
            bad = judge(self.log, self.clock())
            if bad is not None:
                self._give_up(last)
                raise UsbLayerError(bad.reason, f"{bad.detail}; last: {what}: {err.detail}") from last
            self._drain([r.inner for r in recs])
            if hasattr(self.usb, "_async_err"):
                self.usb._async_err = 0
            try:
                waits: list[tuple[int, _Async | None]] = []
                for r in recs:
                    if r.arm is not None:
                        a = r.arm
                        waits.append((int(self.usb.control_write_async(a.request, a.value, a.index, a.data,
                                                                       self.retry.timeout_ms(a.timeout_ms))), None))
                    self._resubmit(r)
                    waits.append((r.inner, r))
                for t, w in waits:
                    self.usb.bulk_wait(t)
                    if w is not None and w.pending_copy is not None and w.out is not None:
                        w.out[:] = w.pending_copy
                        w.pending_copy = None
            except Exception as e:
                err = classify(e, default=UsbLayerError)
                if err.reason not in TRANSIENT_REASONS:
                    self._give_up(e)
                    raise
                self.log.error(self.clock(), f"{what}: {err.reason}: {err.detail}", err.reason == "transfer_timeout")
                last = e
                continue
            self.log.ok()
            self.log.retried_ok += 1
            self._pending.clear()
            return
        bad = judge(self.log, self.clock())
        self._give_up(last)
        if bad is not None:
            raise UsbLayerError(bad.reason, f"{bad.detail}; last: {what}: {err.detail}") from last
        raise last

    def _give_up(self, cause: BaseException) -> None:
        """From now on every async call raises ``cause``'s text (tinygrad's own error), as tinygrad's latch
        would; the wrapped USB3's latch is left set."""
        self._pending.clear()
        self._async_failed = cause

    # ------------------------------------------------------------------ replays
    @staticmethod
    def _replay_for(kind: Kind, request: int, value: int, index: int, data: bytes, timeout: int) -> _Replay | None:
        """What the next transfer needs sent again before a retry, for an idempotent arm or header."""
        if kind is Kind.SRAM_ARM:
            nbytes = (value & ~P.SRAM_READ_FLAG) * P.SECTOR
            return _Replay(request, value, index, data, timeout, nbytes, "in" if value & P.SRAM_READ_FLAG else "out")
        if kind in (Kind.TLP_VALUE_WRITE, Kind.TLP_STREAM_READ) and index & 0x3:
            dwords = struct.unpack_from("<III", data.ljust(12, b"\0"))[2]
            return _Replay(request, value, index, data, timeout, 4 * dwords,
                           "in" if kind is Kind.TLP_STREAM_READ else "out")
        if kind is Kind.TLP_NONPOSTED:
            return _Replay(request, value, index, data, timeout, 0, "cpl")
        return None

    def _sender(self, rp: _Replay | None) -> Callable[[int], None] | None:
        if rp is None:
            return None

        def send(t_ms: int) -> None:
            self.usb.control_write(rp.request, rp.value, rp.index, rp.data, self.retry.timeout_ms(rp.timeout_ms))
        return send


def install_in_tinygrad(retry: RetryPolicy | None = None, link: LinkErrorPolicy | None = None) -> None:
    """Make tinygrad 0.14 open the dock through :class:`RetryingUSB3`: ``USBPCIDevice.__init__``
    (``runtime/support/system.py``) calls the module-level name ``USB3(dev)``, which is replaced by a
    factory wrapping the real class. Call before the device is opened; idempotent."""
    from tinygrad.runtime.support import system

    real = getattr(system.USB3, "_chestnut_wrapped", system.USB3)

    def open_usb3(dev: Any, *args: Any, **kwargs: Any) -> RetryingUSB3:
        return RetryingUSB3(real(dev, *args, **kwargs), retry=retry, link=link)

    open_usb3._chestnut_wrapped = real  # type: ignore[attr-defined]
    if hasattr(real, "list_devices"):
        open_usb3.list_devices = real.list_devices  # type: ignore[attr-defined]  # the class method, unwrapped
    system.USB3 = open_usb3  # type: ignore[misc,assignment]
