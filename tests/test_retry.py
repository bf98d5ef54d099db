"""Bounded retry of idempotent transfers and the link-error policy, as pure code over a scripted USB3."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from chestnut.backend import protocol as P
from chestnut.backend.classify import advice_for
from chestnut.backend.errors import GpuLayerError, Layer, PcieLayerError, UsbLayerError
from chestnut.backend.retry import (
    RULES,
    Kind,
    LinkErrorLog,
    LinkErrorPolicy,
    RetryingUSB3,
    RetryPolicy,
    Verdict,
    control_in_kind,
    control_out_kind,
    install_in_tinygrad,
    judge,
)

TIMEOUT = "libusb_control_transfer: Operation timed out"
BULK_TIMEOUT = "bulk OUT 0x02 failed: Operation timed out"
IO_ERROR = "bulk IN 0x81 failed: Input/Output Error"
GONE = "libusb_control_transfer: No such device (it may have been disconnected)"


def short_write(n: int, m: int) -> AssertionError:
    """tinygrad 0.14 ``USB3.bulk_write``'s check of the bytes libusb moved."""
    return AssertionError(f"bulk OUT short write: {n}/{m} bytes")
VRAM = (0x1000_0000, 0x100_0000)


def tlp(address: int, value: int = 0) -> bytes:
    return struct.pack("<III", address & 0xFFFFFFFF, address >> 32, value)


class ScriptedUSB3:
    """tinygrad 0.14 ``USB3``: records every call; ``fail`` maps a call number (1-based, over all calls) to the
    RuntimeError text a synchronous call raises (or the exception itself) -- for an async submission, the
    ``libusb_transfer_status`` it latches in ``_async_err`` (never cleared; every later ``bulk_wait`` raises
    tinygrad's "async bulk OUT failed: status=N"); ``short`` maps a bulk IN's call number to the bytes it
    returns (tinygrad's ``bulk_read`` returns what arrived)."""

    def __init__(self, fail: dict[int, str | BaseException] | None = None, short: dict[int, int] | None = None) -> None:
        self.fail = fail or {}
        self.short = short or {}
        self.calls: list[tuple[Any, ...]] = []
        self.product = "custom"
        self._async_err = 0
        self._tags = iter(range(101, 10_000))

    def _call(self, *call: Any) -> None:
        self.calls.append(call)
        if len(self.calls) in self.fail:
            f = self.fail[len(self.calls)]
            raise f if isinstance(f, BaseException) else RuntimeError(f)

    def control_write(self, request: int, value: int = 0, index: int = 0, data: bytes = b"",
                      timeout: int = 1000) -> None:
        self._call("cw", request, value, index, bytes(data), timeout)

    def control_read(self, request: int, length: int, value: int = 0, index: int = 0,
                     timeout: int = 1000) -> bytes:
        self._call("cr", request, length, value, index, timeout)
        return bytes(length)

    def bulk_write(self, payload: Any, timeout: int = 1000) -> None:
        self._call("bw", len(payload), timeout)

    def bulk_read(self, length: int, timeout: int = 1000) -> bytes:
        self._call("br", length, timeout)
        return bytes(self.short.get(len(self.calls), length))

    def _submit(self, *call: Any) -> int:
        self.calls.append(call)
        status = self.fail.get(len(self.calls))
        if status is not None:
            self._async_err = self._async_err or int(status)  # the first failure stays
        return next(self._tags)

    def control_write_async(self, request: int, value: int = 0, index: int = 0, data: bytes = b"",
                            timeout: int = 1000) -> int:
        return self._submit("cwa", request, value, index, bytes(data), timeout)

    def control_read_async(self, request: int, length: int, value: int = 0, index: int = 0,
                           timeout: int = 1000) -> tuple[int, memoryview]:
        return self._submit("cra", request, length, value, index, timeout), memoryview(bytearray([len(self.calls)]
                                                                                                  * length))

    def bulk_write_async(self, payload: Any, timeout: int = 10000) -> int:
        return self._submit("bwa", len(payload), timeout)

    def bulk_wait(self, tag: int) -> None:
        self.calls.append(("wait", tag))
        if self._async_err:
            raise RuntimeError(f"async bulk OUT failed: status={self._async_err}")


def wrapped(fail: dict[int, str | BaseException] | None = None, short: dict[int, int] | None = None,
            **kw: Any) -> tuple[RetryingUSB3, ScriptedUSB3]:
    usb = ScriptedUSB3(fail, short)
    return RetryingUSB3(usb, clock=lambda: 100.0, value_regions=[VRAM], **kw), usb


# ---------------------------------------------------------------- what is idempotent


def test_the_table_says_which_transfers_are_repeated():
    assert {k for k, (retried, _) in RULES.items() if not retried} == {
        Kind.TLP_ACTION_WRITE, Kind.BULK_BARE, Kind.PCIE_POWER, Kind.OTHER}
    assert set(RULES) == set(Kind)


@pytest.mark.parametrize(("request_", "value", "index", "data", "kind"), [
    (P.REQ_XDATA_WRITE, 0xA800, 0x12, b"", Kind.XDATA_WRITE),
    (P.REQ_SRAM, 512 | P.SRAM_READ_FLAG, 1 << 8, b"", Kind.SRAM_ARM),
    (P.REQ_PCIE_POWER, 1, 0, b"", Kind.PCIE_POWER),
    (P.REQ_TLP, P.TLP_MEM_READ64 | 0x0F << 8, P.TLP_MODE_SINGLE, tlp(VRAM[0]), Kind.TLP_NONPOSTED),
    (P.REQ_TLP, P.TLP_CFG_WRITE0 | 0x0F << 8, P.TLP_MODE_SINGLE, tlp(0x10, 1), Kind.TLP_NONPOSTED),
    (P.REQ_TLP, P.TLP_MEM_WRITE64 | 0x0F << 8, P.TLP_MODE_SINGLE, tlp(VRAM[0] + 8, 5), Kind.TLP_VALUE_WRITE),
    (P.REQ_TLP, P.TLP_MEM_WRITE64 | 0x0F << 8, P.TLP_MODE_SINGLE, tlp(0x4000_0000, 5), Kind.TLP_ACTION_WRITE),
    (P.REQ_TLP, P.TLP_MEM_WRITE64 | 0x0F << 8, P.TLP_MODE_STREAM_WRITE, tlp(VRAM[0], 16), Kind.TLP_VALUE_WRITE),
    (P.REQ_TLP, P.TLP_MEM_WRITE64 | 0x0F << 8, P.TLP_MODE_STREAM_WRITE, tlp(VRAM[0] + VRAM[1], 16),
     Kind.TLP_ACTION_WRITE),
    (P.REQ_TLP, P.TLP_MEM_READ64 | 0x0F << 8, P.TLP_MODE_STREAM_READ, tlp(0x4000_0000, 16), Kind.TLP_STREAM_READ),
    (0x51, 0, 0, b"", Kind.OTHER),
])
def test_control_out_kinds(request_, value, index, data, kind):
    assert control_out_kind(request_, value, index, data, [VRAM]) is kind


def test_control_in_kinds():
    assert control_in_kind(P.REQ_XDATA_READ) is Kind.XDATA_READ
    assert control_in_kind(P.REQ_TLP) is Kind.TLP_COMPLETION
    assert control_in_kind(0x51) is Kind.OTHER


# ---------------------------------------------------------------- the policy


def test_attempt_timeouts_end_inside_the_frame_deadline():
    p = RetryPolicy()
    assert p.attempts * p.timeout_ms(1000) == 75 < 150
    assert p.timeout_ms(1000, 0x40000) == 25 + 14  # 256 KiB at the 20 MB/s floor
    assert p.timeout_ms(10) == 10  # never longer than the caller asked
    assert p.timeout_ms(0) == 25   # 0 is libusb's "forever": bounded
    assert p.timeout_ms(10000, 0x40000, gpu_wait=True) == 3000  # an armed SRAM read is also the GPU's whole wait
    assert p.timeout_ms(1000, 0x40000, gpu_wait=True) == 1000   # never longer than the caller asked
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


def log_of(outcomes: str, times: list[float] | None = None, policy: LinkErrorPolicy | None = None) -> LinkErrorLog:
    """'.' an attempt that went through, 't' a timeout, 'e' an I/O error; errors at ``times`` (default 0 s)."""
    log = LinkErrorLog(policy or LinkErrorPolicy())
    ts = iter(times or [0.0] * outcomes.count("t") + [0.0] * outcomes.count("e"))
    for o in outcomes:
        if o == ".":
            log.ok()
        else:
            log.error(next(ts), "x", timed_out=o == "t")
    return log


def test_scattered_errors_are_transient():
    assert judge(log_of("t" + "." * 30 + "e" + "." * 30 + "tt" + "." * 30, [0, 1, 2, 2.1]), 3.0) is None


def test_a_run_of_timeouts_is_no_answer_and_a_run_with_io_errors_an_unstable_link():
    v = judge(log_of("..ttt"), 0.0)
    assert v == Verdict("no_answer", "3 consecutive transfer attempts timed out (bound 3); the device is still "
                                     "there: a vanished one fails LIBUSB_ERROR_NO_DEVICE")
    assert judge(log_of("..tet"), 0.0) == Verdict("unstable_link", "3 consecutive transfer attempts failed (bound 3)")
    assert judge(log_of("..tt."), 0.0) is None


def test_five_failures_in_the_last_hundred_attempts_are_an_unstable_link():
    scattered = "t...................." * 4 + "t"
    assert judge(log_of(scattered, [0, 10, 20, 30, 40]), 40.0) == Verdict(
        "unstable_link", "5 of the last 85 transfer attempts failed (bound 5 of 100)")
    tail = ("t" + "." * 10) * 4
    assert judge(log_of("t" + "." * 60 + tail, [0, 10, 20, 30, 40]), 40.0) is None  # the first is 101 attempts back
    assert judge(log_of("t" + "." * 50 + tail, [0, 10, 20, 30, 40]), 40.0) is not None


def test_more_than_five_errors_per_second_over_two_seconds_are_an_unstable_link():
    policy = LinkErrorPolicy(ratio_window=10)  # the ratio rule out of the way
    outcomes = ("t" + "." * 10) * 11
    times = [0.2 * i for i in range(11)]
    assert judge(log_of(outcomes, times, policy), 2.0) == Verdict(
        "unstable_link", "11 transfer errors in 2 s, above 5/s (openpilot hardwared's bound)")
    assert judge(log_of(outcomes[:-11], times[:-1], policy), 2.0) is None  # 10 in 2 s: the bound itself


# ---------------------------------------------------------------- the wrapper


def test_an_xdata_read_that_times_out_is_read_again_with_a_bounded_timeout():
    u, usb = wrapped({1: TIMEOUT})
    assert u.control_read(P.REQ_XDATA_READ, 4, value=0xA800, timeout=1000) == bytes(4)
    assert usb.calls == [("cr", 0xE4, 4, 0xA800, 0, 25)] * 2
    assert (u.log.attempts, u.log.errors, u.log.retried_ok) == (2, 1, 1)


def test_a_bulk_out_is_sent_again_after_its_sram_arm():
    u, usb = wrapped({2: BULK_TIMEOUT})
    u.control_write(P.REQ_SRAM, 1024 // 512, 1 << 8, timeout=1000)
    u.bulk_write(bytes(1024), timeout=3000)
    arm = ("cw", P.REQ_SRAM, 2, 1 << 8, b"", 25)
    assert usb.calls == [arm, ("bw", 1024, 26), arm, ("bw", 1024, 26)]
    assert u.stats() == {"attempts": 3, "errors": 1, "retried_ok": 1, "not_retried": 0, "window_waits": 0,
                         "window_s": 60.0,
                         "errors_in_window": 1, "last_error": f"bulk OUT 0x02: transfer_timeout: RuntimeError: "
                                                              f"{BULK_TIMEOUT}"}


def test_a_bulk_in_is_read_again_after_its_streaming_read_header():
    u, usb = wrapped({2: IO_ERROR})
    hdr = tlp(0x4000_0000, 64 // 4)
    u.control_write(P.REQ_TLP, P.TLP_MEM_READ64 | 0x0F << 8, P.TLP_MODE_STREAM_READ, hdr, 5000)
    assert u.bulk_read(64, 30000) == bytes(64)
    again = ("cw", P.REQ_TLP, P.TLP_MEM_READ64 | 0x0F << 8, P.TLP_MODE_STREAM_READ, hdr, 25)
    assert usb.calls == [again, ("br", 64, 26), again, ("br", 64, 26)]  # a memory read: the link's timing


def test_a_tlp_completion_is_read_again_only_after_its_header():
    u, usb = wrapped({2: TIMEOUT})
    hdr = tlp(0x0400_0000)
    u.control_write(P.REQ_TLP, P.TLP_CFG_READ0 | 1 | 0x0F << 8, 0, hdr, 5000)
    u.control_read(P.REQ_TLP, 8, timeout=5000)
    again = ("cw", P.REQ_TLP, P.TLP_CFG_READ0 | 1 | 0x0F << 8, 0, hdr, 25)
    assert usb.calls == [again, ("cr", P.REQ_TLP, 8, 0, 0, 25), again, ("cr", P.REQ_TLP, 8, 0, 0, 25)]


def test_a_doorbell_in_a_value_region_is_rung_again_but_a_write_elsewhere_is_not():
    u, usb = wrapped({1: TIMEOUT})
    u.control_write(P.REQ_TLP, P.TLP_MEM_WRITE64 | 0x0F << 8, 0, tlp(VRAM[0] + 4, 9), 5000)
    assert len(usb.calls) == 2 and u.log.retried_ok == 1
    u, usb = wrapped({1: TIMEOUT})
    with pytest.raises(RuntimeError, match="Operation timed out"):
        u.control_write(P.REQ_TLP, P.TLP_MEM_WRITE64 | 0x0F << 8, 0, tlp(0x4000_0000, 9), 5000)
    assert usb.calls == [("cw", P.REQ_TLP, P.TLP_MEM_WRITE64 | 0x0F << 8, 0, tlp(0x4000_0000, 9), 5000)]
    assert (u.log.errors, u.log.not_retried) == (1, 1)


def test_a_bulk_out_without_its_arm_and_a_pcie_power_on_are_not_repeated():
    u, usb = wrapped({1: BULK_TIMEOUT, 2: TIMEOUT})
    with pytest.raises(RuntimeError):
        u.bulk_write(bytes(512), 3000)
    with pytest.raises(RuntimeError):
        u.control_write(P.REQ_PCIE_POWER, 1, timeout=10000)
    assert usb.calls == [("bw", 512, 3000), ("cw", P.REQ_PCIE_POWER, 1, 0, b"", 10000)]
    assert (u.log.errors, u.log.not_retried) == (2, 2)


def test_a_vanished_device_is_never_retried():
    u, usb = wrapped({1: GONE})
    with pytest.raises(RuntimeError, match="No such device"):
        u.control_read(P.REQ_XDATA_READ, 1, value=0xB450)
    assert len(usb.calls) == 1 and u.log.errors == 0


def test_every_try_timing_out_is_no_answer_with_the_last_error_as_cause():
    u, usb = wrapped({1: TIMEOUT, 2: TIMEOUT, 3: TIMEOUT})
    with pytest.raises(UsbLayerError) as info:
        u.control_read(P.REQ_XDATA_READ, 16, value=0xB800)
    assert info.value.reason == "no_answer"
    assert info.value.detail == ("3 consecutive transfer attempts timed out (bound 3); the device is still there: a "
                                 f"vanished one fails LIBUSB_ERROR_NO_DEVICE; last: control IN 0xE4: RuntimeError: "
                                 f"{TIMEOUT}")
    assert isinstance(info.value.__cause__, RuntimeError)
    assert usb.calls[3:] == [("cr", P.REQ_XDATA_READ, 1, P.XDATA_LTSSM, 0, 25)]  # the bridge still answers


def test_an_async_failure_with_a_transfer_that_is_not_idempotent_in_flight_is_counted_and_raised():
    """A bare bulk OUT (no arm before it) cannot be sent again: tinygrad's own error, and every later wait too."""
    u, usb = wrapped({1: "2"})
    tag = u.bulk_write_async(bytes(512), 10000)
    with pytest.raises(RuntimeError, match="status=2"):
        u.bulk_wait(tag)
    assert (u.log.errors, u.log.not_retried, usb._async_err) == (1, 1, 2)
    with pytest.raises(RuntimeError, match="status=2"):
        u.bulk_wait(u.control_write_async(P.REQ_XDATA_WRITE, 0xA000, 0))
    assert u.product == "custom"  # anything else passes through


def test_install_in_tinygrad_wraps_the_usb3_its_system_module_opens(monkeypatch):
    from chestnut.backend.model import ensure_cpu_device

    ensure_cpu_device()  # tinygrad's first import in this process, as the node's would be: the host CPU
    from tinygrad.runtime.support import system

    monkeypatch.setattr(system, "USB3", ScriptedUSB3)
    install_in_tinygrad()
    install_in_tinygrad()  # idempotent: one wrapper, not two
    usb = system.USB3({1: TIMEOUT})
    assert isinstance(usb, RetryingUSB3) and isinstance(usb.usb, ScriptedUSB3)
    usb.control_read(P.REQ_XDATA_READ, 1, value=0xB450)
    assert usb.log.retried_ok == 1


def test_a_bulk_in_keeps_its_sram_arm_across_other_traffic_as_tinygrads_copyout_sends_it():
    """tinygrad 0.14 ``_copyout``: ``scsi_read_arm``, then the SDMA copy's MMIO writes, then ``scsi_read``."""
    u, usb = wrapped({4: IO_ERROR})
    u.control_write(P.REQ_SRAM, 1 | P.SRAM_READ_FLAG, 1 << 8, timeout=1000)          # arm a 512-byte read
    u.control_write(P.REQ_TLP, P.TLP_MEM_WRITE64 | 0x0F << 8, P.TLP_MODE_STREAM_WRITE, tlp(VRAM[0], 2), 5000)
    u.bulk_write(bytes(8), 1000)                                                      # the doorbell's stream
    assert u.bulk_read(512, 10000) == bytes(512)
    arm = ("cw", P.REQ_SRAM, 1 | P.SRAM_READ_FLAG, 1 << 8, b"", 25)
    assert usb.calls[3:] == [("br", 512, 26), arm, ("br", 512, 3000)]  # a first ordinary try, then the GPU's wait


def copyin_chunks(u: RetryingUSB3, n: int) -> list[memoryview]:
    """tinygrad 0.14 ``_copyin``'s stream of ``n`` 1024-byte chunks: per chunk an async 0xF2 arm and an async
    0xE4 fence read, both waited, then the async bulk OUT, waited only when its window is armed again."""
    inflight: list[int | None] = [None, None]
    reads = []
    for seq in range(n):
        if inflight[seq & 1] is not None:
            u.bulk_wait(inflight[seq & 1])
        arm = u.control_write_async(P.REQ_SRAM, 1024 // 512, (seq & 1) * 16 | 1 << 8)
        rd, mv = u.control_read_async(P.REQ_XDATA_READ, 8, value=0xA800)
        u.bulk_wait(arm)
        u.bulk_wait(rd)
        reads.append(mv)
        inflight[seq & 1] = u.bulk_write_async(bytes([seq]) * 1024)
    for t in inflight:
        if t is not None:
            u.bulk_wait(t)
    return reads


def test_async_transfers_stay_in_flight_with_bounded_timeouts():
    u, usb = wrapped()
    copyin_chunks(u, 3)
    submits = [c for c in usb.calls if c[0] != "wait"]
    assert submits == [("cwa", P.REQ_SRAM, 2, 1 << 8, b"", 25), ("cra", 0xE4, 8, 0xA800, 0, 25), ("bwa", 1024, 26),
                       ("cwa", P.REQ_SRAM, 2, 16 | 1 << 8, b"", 25), ("cra", 0xE4, 8, 0xA800, 0, 25), ("bwa", 1024, 26),
                       ("cwa", P.REQ_SRAM, 2, 1 << 8, b"", 25), ("cra", 0xE4, 8, 0xA800, 0, 25), ("bwa", 1024, 26)]
    assert not any(c[0] in ("cw", "cr", "bw") for c in usb.calls)  # nothing was turned into a synchronous transfer
    assert (u.log.attempts, u.log.errors) == (9, 0)


def test_a_failed_async_transfer_is_submitted_again_with_everything_not_yet_waited_before_tinygrad_sees_it():
    """Chunk 1's arm times out (status 2, latched) while chunk 0's bulk OUT is still in flight: the wrapper lets
    them finish, clears the latch, submits chunk 0's arm and bulk OUT, chunk 1's arm and fence read again, in
    order, and waits them; tinygrad's waits see nothing, the fence read's buffer holds the new read."""
    u, usb = wrapped({6: "2"})  # calls: cwa cra wait wait bwa | cwa (fails) ...
    reads = copyin_chunks(u, 2)
    after = usb.calls[usb.calls.index(("cwa", P.REQ_SRAM, 2, 16 | 1 << 8, b"", 25)) + 1:]
    submits = [c for c in after if c[0] != "wait"]
    assert submits[:5] == [("cra", 0xE4, 8, 0xA800, 0, 25),                          # chunk 1's read, as asked
                           ("cwa", P.REQ_SRAM, 2, 1 << 8, b"", 25), ("bwa", 1024, 26),  # chunk 0 again, after its arm
                           ("cwa", P.REQ_SRAM, 2, 16 | 1 << 8, b"", 25),              # chunk 1's arm again
                           ("cra", 0xE4, 8, 0xA800, 0, 25)]                           # and its read
    assert usb._async_err == 0
    last_read = max(i for i, c in enumerate(usb.calls) if c[0] == "cra") + 1  # its call number: the data it returns
    assert bytes(reads[1]) == bytes([last_read]) * 8  # in the buffer tinygrad holds
    assert (u.log.errors, u.log.retried_ok, u.log.not_retried) == (1, 1, 0)


def test_an_async_failure_on_every_submission_is_an_unstable_link():
    """``async_error`` repeating (LIBUSB_TRANSFER_ERROR, status 1): three submissions fail, the link is judged."""
    class AlwaysFails(ScriptedUSB3):
        def _submit(self, *call: Any) -> int:
            self.calls.append(call)
            self._async_err = 1
            return next(self._tags)

    usb = AlwaysFails()
    u = RetryingUSB3(usb, clock=lambda: 100.0)
    arm = u.control_write_async(P.REQ_SRAM, 2, 1 << 8)
    with pytest.raises(UsbLayerError) as info:
        u.bulk_wait(arm)
    assert info.value.reason == "unstable_link"
    assert info.value.detail.startswith("3 consecutive transfer attempts failed (bound 3); last: async control OUT "
                                        "0xF2: RuntimeError: async bulk OUT failed: status=1")
    assert [c[0] for c in usb.calls if c[0] != "wait"] == ["cwa"] * 3
    with pytest.raises(RuntimeError, match="status=1"):  # and every later wait, as tinygrad's latch would
        u.bulk_wait(u.control_write_async(P.REQ_SRAM, 2, 1 << 8))


def test_an_armed_bulk_in_that_never_comes_while_the_bridge_answers_is_the_gpus_copy_not_the_link():
    """The armed SRAM read is also the wait for the GPU's copy into the window: every try timing out while one
    XDATA read of the LTSSM byte answers is a GPU that never did the copy, not a link that answers nothing. An
    ordinary first try (25 ms + the bytes), then -- the bridge answering -- the window armed again and read with the
    rest of the GPU's wait (3000 ms in all): the GPU is called dead at the wait timeout, not before or after."""
    u, usb = wrapped({2: TIMEOUT, 5: TIMEOUT})
    u.control_write(P.REQ_SRAM, 1 | P.SRAM_READ_FLAG, 1 << 8, timeout=1000)
    with pytest.raises(GpuLayerError) as info:
        u.bulk_read(512, 10000)
    assert info.value.reason == "copy_out_not_done"
    assert info.value.detail == ("bulk IN 0x81 timed out while the bridge answers (LTSSM 0x00): the GPU never wrote "
                                 f"the window (hung GPU?); last: RuntimeError: {TIMEOUT}")
    ltssm = ("cr", P.REQ_XDATA_READ, 1, P.XDATA_LTSSM, 0, 25)
    arm = ("cw", P.REQ_SRAM, 1 | P.SRAM_READ_FLAG, 1 << 8, b"", 25)
    assert usb.calls[1:] == [("br", 512, 26), ltssm, arm, ("br", 512, 3000), ltssm]
    assert (u.log.errors, u.log.error_run, sum(u.log.outcomes)) == (0, 0, 0)  # nothing held against the link
    assert u.log.window_waits == 1


def test_an_armed_bulk_in_lost_once_costs_one_ordinary_try_not_the_wait_timeout():
    """A read of the window lost on the wire (the device NAKed it until its timeout) while the GPU had written it:
    the first try ends at its ordinary bound (25 ms + the bytes), the bridge answers, the window is armed again and
    read. Not a link error (the link's evidence cannot tell it from a GPU still copying), not the GPU's wait."""
    u, usb = wrapped({2: TIMEOUT})
    u.control_write(P.REQ_SRAM, 1 | P.SRAM_READ_FLAG, 1 << 8, timeout=1000)
    assert u.bulk_read(512, 10000) == bytes(512)
    arm = ("cw", P.REQ_SRAM, 1 | P.SRAM_READ_FLAG, 1 << 8, b"", 25)
    assert usb.calls == [arm, ("br", 512, 26), ("cr", P.REQ_XDATA_READ, 1, P.XDATA_LTSSM, 0, 25), arm,
                         ("br", 512, 3000)]
    assert (u.log.errors, u.log.error_run, u.log.window_waits, u.log.attempts) == (0, 0, 1, 2)  # the arm, the read


def test_an_armed_bulk_in_that_never_comes_with_a_silent_bridge_is_a_wedged_bridge():
    # the ordinary first try and the bridge read after it time out (the link rules decide: 3 tries); each try:
    # the bulk IN and one read of the bridge's register time out; after the third, 2 more reads
    u, usb = wrapped({2: TIMEOUT, 3: TIMEOUT, 4: TIMEOUT, 6: TIMEOUT, 7: TIMEOUT, 9: TIMEOUT, 10: TIMEOUT,
                      11: TIMEOUT, 12: TIMEOUT})
    u.control_write(P.REQ_SRAM, 1 | P.SRAM_READ_FLAG, 1 << 8, timeout=1000)
    with pytest.raises(PcieLayerError) as info:
        u.bulk_read(512, 10000)
    assert info.value.reason == "bridge_wedged" and usb.calls[-1][:2] == ("cr", P.REQ_XDATA_READ)


def test_a_run_of_timeouts_with_the_bridges_own_register_unreadable_is_a_wedged_bridge_on_the_pcie_layer():
    """tinygrad#18137: the bridge stops answering vendor requests while the dock stays enumerated. Every try of
    an XDATA write times out, and two reads of the bridge's LTSSM byte time out too: the pcie layer's
    ``bridge_wedged`` (power-cycle the dock), not the cable's ``no_answer``."""
    u, usb = wrapped({i: TIMEOUT for i in range(1, 6)})
    with pytest.raises(PcieLayerError) as info:
        u.control_write(P.REQ_XDATA_WRITE, 0xA800, 0x12, timeout=1000)
    err = info.value
    assert (err.layer, err.reason) == (Layer.PCIE, "bridge_wedged")
    assert err.detail == ("3 consecutive transfer attempts timed out (bound 3); the device is still there: a vanished "
                          "one fails LIBUSB_ERROR_NO_DEVICE, and 2/2 reads of the bridge's own register (XDATA 0xB450, "
                          "the LTSSM byte) timed out: the bridge answers nothing (tinygrad#18137); last: control OUT "
                          f"0xE5: RuntimeError: {TIMEOUT}")
    assert usb.calls[3:] == [("cr", P.REQ_XDATA_READ, 1, P.XDATA_LTSSM, 0, 25)] * 2
    assert advice_for(err) == ("power-cycle the dock (unplug its power, or `chestnut twin power-cycle` on the twin): "
                               "a wedged bridge answers nothing until then; replugging the cable or another port "
                               "does not help")


def test_a_run_of_timeouts_while_the_bridge_answers_stays_the_links_no_answer():
    u, usb = wrapped({1: TIMEOUT, 2: TIMEOUT, 3: TIMEOUT, 4: TIMEOUT})  # the second bridge read answers
    with pytest.raises(UsbLayerError) as info:
        u.control_write(P.REQ_XDATA_WRITE, 0xA800, 0x12, timeout=1000)
    assert info.value.reason == "no_answer" and len(usb.calls) == 5


# ---------------------------------------------------------------- short and truncated transfers


def test_a_short_bulk_out_is_sent_whole_again_after_its_arm():
    """The issue's ``bulk OUT short write 4/8`` (an 8-byte stream into a doorbell region, 0xF0 mode 1): the
    header is sent again, then all 8 bytes; counted as a transient error that went through."""
    u, usb = wrapped({2: short_write(4, 8)})
    hdr = tlp(VRAM[0] + 0x100, 8 // 4)
    u.control_write(P.REQ_TLP, P.TLP_MEM_WRITE64 | 0x0F << 8, P.TLP_MODE_STREAM_WRITE, hdr, 5000)
    u.bulk_write(bytes(8), 1000)
    again = ("cw", P.REQ_TLP, P.TLP_MEM_WRITE64 | 0x0F << 8, P.TLP_MODE_STREAM_WRITE, hdr, 25)
    assert usb.calls == [again, ("bw", 8, 26), again, ("bw", 8, 26)]
    assert (u.log.attempts, u.log.errors, u.log.retried_ok, u.log.not_retried) == (3, 1, 1, 0)
    assert u.log.last_error.startswith("bulk OUT 0x02: short_transfer: AssertionError: bulk OUT short write: 4/8")


def test_a_short_bulk_in_is_read_again_after_its_arm_and_never_handed_up():
    u, usb = wrapped(short={2: 256})
    u.control_write(P.REQ_SRAM, 1 | P.SRAM_READ_FLAG, 1 << 8, timeout=1000)
    assert len(u.bulk_read(512, 10000)) == 512
    arm = ("cw", P.REQ_SRAM, 1 | P.SRAM_READ_FLAG, 1 << 8, b"", 25)
    assert usb.calls == [arm, ("br", 512, 26), arm, ("br", 512, 3000)]
    assert (u.log.errors, u.log.retried_ok) == (1, 1)
    u, usb = wrapped(short={1: 100})  # nothing to re-arm: raised, not returned short
    with pytest.raises(UsbLayerError) as info:
        u.bulk_read(512, 1000)
    assert (info.value.reason, info.value.detail) == ("short_transfer", "bulk IN 0x81: got 100 of 512 bytes")
    assert (u.log.errors, u.log.not_retried) == (1, 1)


def test_a_short_control_transfer_is_retried_like_a_timeout():
    class OneShortRead(ScriptedUSB3):
        def control_read(self, request: int, length: int, value: int = 0, index: int = 0,
                         timeout: int = 1000) -> bytes:  # tinygrad 0.14 USB3.control_read's bare length assert
            self._call("cr", request, length, value, index, timeout)
            got = length // 2 if len(self.calls) == 1 else length
            assert got == length
            return bytes(length)

    usb = OneShortRead()
    u = RetryingUSB3(usb, clock=lambda: 100.0)
    assert u.control_read(P.REQ_XDATA_READ, 4, value=0xA800) == bytes(4)
    assert len(usb.calls) == 2 and u.log.retried_ok == 1
    assert u.log.last_error.startswith("control IN 0xE4: short_transfer: AssertionError: ")


def test_a_run_of_short_transfers_fails_over_with_the_figure_in_the_reason():
    u, usb = wrapped({2: short_write(4, 8), 4: short_write(4, 8), 6: short_write(4, 8)})
    u.control_write(P.REQ_SRAM, 1, 0, timeout=1000)
    with pytest.raises(UsbLayerError) as info:
        u.bulk_write(bytes(512), 1000)
    assert info.value.reason == "unstable_link"
    assert info.value.detail.startswith("3 consecutive transfer attempts failed (bound 3); last: bulk OUT 0x02: "
                                        "AssertionError: bulk OUT short write: 4/8 bytes")
    assert isinstance(info.value.__cause__, AssertionError) and len(usb.calls) == 6


def test_a_rate_of_short_transfers_fails_over_with_the_rate_in_the_reason():
    now = [0.0]
    usb = ScriptedUSB3({14 * i + 2: short_write(256, 512) for i in range(11)})  # 14 calls a round
    u = RetryingUSB3(usb, clock=lambda: now[0], link=LinkErrorPolicy(ratio_window=10))
    with pytest.raises(UsbLayerError) as info:
        for i in range(11):  # each one goes through on its second try: 11 errors in 2 s
            now[0] = 0.2 * i
            u.control_write(P.REQ_SRAM, 1, 0, timeout=1000)
            u.bulk_write(bytes(512), 1000)
            for _ in range(10):
                u.control_read(P.REQ_XDATA_READ, 1, value=0xB450)
    assert info.value.reason == "unstable_link"
    assert info.value.detail.startswith("11 transfer errors in 2 s, above 5/s (openpilot hardwared's bound); last: ")
    assert u.log.retried_ok == 10
