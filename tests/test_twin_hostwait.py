"""The twin's own wait for a host CPU (backend/sim/hostwait.py) and how the node's host judgement uses it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from chestnut.backend.sim.client import running_twin
from chestnut.backend.sim.hostwait import FILE_NAME, ThreadTimes, WaitPeak, decode, encode, read_peak_ms, thread_times
from chestnut.msgs.paths import runtime_dir
from chestnut.node.hostload import HostMeter
from chestnut.node.policy import HostFigures, host_late

MS = 1_000_000


def _waits(waits: dict[tuple[int, int], int]) -> dict[tuple[int, int], ThreadTimes]:
    """Threads asleep at the sample (not runnable), with only their ended waits."""
    return {key: ThreadTimes(0, ns, 0, False) for key, ns in waits.items()}


def test_the_peak_is_the_worst_single_threads_wait_within_the_window():
    peak = WaitPeak(window_ns=1000 * MS)
    assert peak.sample(0, _waits({(1, 1): 5 * MS, (1, 2): 0})) == 0
    assert peak.sample(400 * MS, _waits({(1, 1): 12 * MS, (1, 2): 3 * MS})) == 7 * MS
    # a thread first seen inside the window counts from its first sample, a gone one is no longer judged
    assert peak.sample(800 * MS, _waits({(1, 1): 13 * MS, (1, 3): 40 * MS})) == 8 * MS
    assert peak.sample(900 * MS, _waits({(1, 1): 13 * MS, (1, 3): 65 * MS})) == 25 * MS
    # the sample at 0 has left the window at 1500 ms (the one at 400 ms is the base for the last second)
    assert peak.sample(1500 * MS, _waits({(1, 1): 14 * MS, (1, 3): 65 * MS})) == 25 * MS
    assert peak.sample(1900 * MS, _waits({(1, 1): 14 * MS, (1, 3): 65 * MS})) == 1 * MS  # since 900 ms: 13 -> 14
    assert peak.sample(2900 * MS, _waits({(1, 1): 14 * MS, (1, 3): 65 * MS})) == 0


def test_a_wait_still_going_on_counts_from_the_first_sample_that_saw_the_thread_runnable_and_idle():
    """The kernel adds a wait to schedstat only when it ends: a runnable thread whose CPU time and slices stand
    still has waited at least since the first sample that saw it so."""
    peak, key = WaitPeak(window_ns=1000 * MS), (1, 1)
    assert peak.sample(0, {key: ThreadTimes(7 * MS, 2 * MS, 10, True)}) == 0  # runnable: may be running now
    assert peak.sample(50 * MS, {key: ThreadTimes(7 * MS, 2 * MS, 10, True)}) == 50 * MS
    assert peak.sample(120 * MS, {key: ThreadTimes(7 * MS, 2 * MS, 10, True)}) == 120 * MS
    # it got a CPU (one more slice): the wait ended, and the kernel's own count now holds it
    assert peak.sample(170 * MS, {key: ThreadTimes(9 * MS, 152 * MS, 11, True)}) == 150 * MS
    # runnable at the last sample with new counters, and still idle: a new wait since then, on top of the ended one
    assert peak.sample(220 * MS, {key: ThreadTimes(9 * MS, 152 * MS, 11, True)}) == 200 * MS


def test_the_samplers_own_lateness_is_the_twins_wait_within_the_window():
    peak, key = WaitPeak(window_ns=1000 * MS), (1, 1)
    asleep = {key: ThreadTimes(9 * MS, 0, 4, False)}
    assert peak.sample(0, asleep, late_ns=1 * MS) == 1 * MS
    assert peak.sample(400 * MS, asleep, late_ns=300 * MS) == 300 * MS
    assert peak.sample(450 * MS, _waits({key: 40 * MS})) == 300 * MS
    assert peak.sample(1399 * MS, asleep) == 300 * MS
    assert peak.sample(1400 * MS, asleep) == 0  # a window after it


def test_the_record_says_the_sampler_is_late_while_it_is(tmp_path: Path):
    """Held off by the host, the sampler rewrites nothing: the record's age less the 50 ms sample period is how
    long the twin has waited so far, and the reader counts it when it is more than the record's peak -- if the twin
    was able to work at the record's sample. A hung GPU waits for no CPU: its sampler's lateness excuses nothing
    (a hang beside a host late at realtime priorities was excused until the watchdog's 3.25 s)."""
    path = tmp_path / FILE_NAME
    path.write_bytes(encode(31 * MS, 10**12))
    assert read_peak_ms(path, 10**12 + 50 * MS) == 31.0
    assert read_peak_ms(path, 10**12 + 81 * MS) == 31.0
    assert read_peak_ms(path, 10**12 + 82 * MS) == 32.0
    assert read_peak_ms(path, 10**12 + 350 * MS) == 300.0
    path.write_bytes(encode(31 * MS, 10**12, able=False))
    assert read_peak_ms(path, 10**12 + 350 * MS) == 31.0


def test_a_thread_that_ran_or_slept_between_samples_is_not_waiting():
    peak, key = WaitPeak(window_ns=1000 * MS), (1, 1)
    peak.sample(0, {key: ThreadTimes(7 * MS, 0, 10, True)})
    assert peak.sample(50 * MS, {key: ThreadTimes(8 * MS, 0, 10, True)}) == 0  # more CPU time: it ran
    assert peak.sample(100 * MS, {key: ThreadTimes(8 * MS, 0, 11, True)}) == 0  # another slice: it ran
    assert peak.sample(150 * MS, {key: ThreadTimes(8 * MS, 0, 11, False)}) == 0  # asleep
    assert peak.sample(200 * MS, {key: ThreadTimes(8 * MS, 0, 11, True)}) == 0  # woken: counts from here
    assert peak.sample(250 * MS, {key: ThreadTimes(8 * MS, 0, 11, True)}) == 50 * MS
    assert peak.sample(300 * MS, {}) == 0  # gone


def test_a_record_round_trips_and_a_torn_or_short_one_is_no_figure():
    assert decode(encode(31 * MS, 123456789)) == (31 * MS, 123456789, True)
    assert decode(encode(31 * MS, 123456789, able=False)) == (31 * MS, 123456789, False)
    torn = bytearray(encode(31 * MS, 123456789))
    torn[0] ^= 1
    assert decode(bytes(torn)) is None
    assert decode(encode(1, 2)[:24]) is None


def test_the_file_is_read_only_when_fresh_regular_and_ours(tmp_path: Path):
    path = tmp_path / FILE_NAME
    assert read_peak_ms(path, 10**12) == 0.0  # absent: a real dock
    path.write_bytes(encode(31 * MS, 10**12))
    assert read_peak_ms(path, 10**12 + 30 * MS) == 31.0
    assert read_peak_ms(path, 10**12 + 1000 * MS) == 950.0  # the sampler (every 50 ms) held off for 950 ms
    assert read_peak_ms(path, 10**12 + 1001 * MS) == 0.0  # a second without a sample: the daemon is gone
    link = tmp_path / "link"
    link.symlink_to(path)
    assert read_peak_ms(link, 10**12) == 0.0  # never through a link
    (tmp_path / "dir").mkdir()
    assert read_peak_ms(tmp_path / "dir", 10**12) == 0.0


def test_a_thread_that_waits_for_a_cpu_is_measured():
    """Two busy threads of one child pinned to one CPU: each waits on the run queue while the other runs, and
    schedstat says so (the figure the twin publishes is real run-queue time, not an estimate)."""
    code = ("import os, threading\nos.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "def spin():\n    while True: pass\nthreading.Thread(target=spin, daemon=True).start()\nspin()\n")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        peak, got, deadline = WaitPeak(), 0, time.monotonic() + 30
        while got < 20 * MS and time.monotonic() < deadline:
            got = peak.sample(time.monotonic_ns(), thread_times([child.pid]))
            time.sleep(0.05)
        assert got >= 20 * MS
        assert {pid for pid, _ in thread_times([child.pid])} == {child.pid}
        assert len(thread_times([child.pid])) == 2
        assert set(thread_times([child.pid], main_only=True)) == {(child.pid, child.pid)}  # the twin's GPU thread
    finally:
        child.kill()
        child.wait()
    assert thread_times([child.pid]) == {}  # gone: left out, no error


_STARVE = """\
import os, sys, threading, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
def spin():
    while True: pass
threading.Thread(target=spin, name="starved", daemon=True).start()
time.sleep(0.05)
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
except PermissionError:
    print("no-rt", flush=True)
    sys.exit(0)
print(threading.get_native_id(), flush=True)
end = time.monotonic() + 3.0
while time.monotonic() < end: pass
"""


def test_a_thread_starved_right_now_is_counted_before_its_wait_ends():
    """A realtime spinner holds the one CPU a normal busy thread of its process may use: that thread stays
    runnable without a CPU (the kernel's RT throttling aside) and its schedstat wait does not grow until it runs
    again -- the figure must show the wait while it lasts, which is when a node judges its deadline misses."""
    child = subprocess.Popen([sys.executable, "-c", _STARVE], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().strip()
        if line == "no-rt":
            import pytest

            pytest.skip("SCHED_FIFO not permitted here: no thread can be starved on demand")
        spinner = int(line)
        peak, got, deadline = WaitPeak(), 0, time.monotonic() + 2.5
        first: dict[tuple[int, int], int] = {}
        while time.monotonic() < deadline:
            times = {k: t for k, t in thread_times([child.pid]).items() if k[1] != spinner}
            for key, t in times.items():
                first.setdefault(key, t.wait_ns)
            got = peak.sample(time.monotonic_ns(), times)
            if got >= 100 * MS:
                break
            time.sleep(0.02)
        assert got >= 100 * MS
        # the kernel's own count of ended waits has not caught up: the figure is the ongoing wait's
        assert max(times[k].wait_ns - first[k] for k in times) < 100 * MS
    finally:
        child.kill()
        child.wait()


def test_a_twin_wait_of_20_ms_makes_a_miss_the_hosts_and_less_does_not():
    assert host_late(HostFigures(twin_wait_ms=31.0)) == "host late: the twin waited 31 ms for a CPU"
    assert host_late(HostFigures(twin_wait_ms=19.9)) == ""
    assert HostFigures(loop_late_ms=3.0, worker_late_ms=5.0, twin_wait_ms=31.0).peak_late_ms == 31.0


def test_the_host_meter_reads_the_twins_file(tmp_path: Path):
    path = tmp_path / FILE_NAME
    now = time.monotonic_ns()
    path.write_bytes(encode(42 * MS, now))
    assert HostMeter(twin_wait_path=path).figures(now).twin_wait_ms == 42.0
    assert HostMeter().figures(now).twin_wait_ms == 0.0


def test_the_daemon_keeps_the_file_beside_its_socket_and_removes_it_at_stop():
    path = runtime_dir() / FILE_NAME
    with running_twin() as twin:
        deadline = time.monotonic() + 10
        while (got := decode(path.read_bytes()) if path.exists() else None) is None or got[1] == 0:
            assert time.monotonic() < deadline, "no hostwait record within 10 s"
            time.sleep(0.05)
        st = path.lstat()
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        first = decode(path.read_bytes())
        while (again := decode(path.read_bytes())) is None or again[1] == first[1]:
            assert time.monotonic() < deadline, "the record was not rewritten"
            time.sleep(0.05)
        assert 0 <= time.monotonic_ns() - again[1] < 10**10
        twin.daemon.stop()
    assert not path.exists()
