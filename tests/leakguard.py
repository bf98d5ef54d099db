"""A pytest plugin that fails a test which leaves something running or held after it.

Every test runs with ``CHESTNUT_TEST_ID`` set to a tag of its own (``conftest.py`` ``private_prefix``); every
process it starts -- directly, through supervisord, or re-parented to init after its parent died -- inherits
it. After the test's teardown the guard looks, through ``/proc/<pid>/environ``, for live processes that still
carry the tag. A leak is reported as an error of that test, naming it and what was left; the process is then
killed, so one leak does not cascade.

Processes that module or session fixtures start carry the session's tag (``CHESTNUT_TEST_SESSION``, the pytest
process's pid) but no test's. Those left after the last test of their module, and any dock lock still held
then (``<tempdir>/am_usb:*.lock``, tinygrad 0.14's ``System.flock_acquire``: a module's shared stack holds one
across its tests, and may move it to a new address), are an error of the module's last test. Process-lifetime
helpers of the pytest process itself are not leaks: tinygrad 0.14's compile pool (``engine/worker.py``
``get_worker_pool``), multiprocessing's resource tracker and the twin's compute child while a twin of the
process is open (``backend/sim/compute.py`` ``running_pids``).

Shared memory needs no check: the project's segments are anonymous (``memfd``, ``node/shm.py``), and the
sockets of a test live in its private runtime prefix, removed with it.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

TEST_VAR = "CHESTNUT_TEST_ID"
SESSION_VAR = "CHESTNUT_TEST_SESSION"
GRACE_S = float(os.environ.get("CHESTNUT_LEAK_GRACE_S", "10"))
"""s a process on its way out (SIGTERM sent, exit pending) gets before it is a leak; waited for, not slept"""
POLL_S = 0.05
MAX_ENVIRON_BYTES = 1 << 20  # a bounded read of /proc/<pid>/environ


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read(MAX_ENVIRON_BYTES)
    except OSError:  # gone, or a kernel thread
        return b""


def _stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` after the command name (state first, flags at index 6; proc(5)); [] when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _state(pid: int) -> str:
    fields = _stat_fields(pid)
    return fields[0] if fields else "X"


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()[:300]
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _helpers_of_this_process() -> set[int]:
    """The pids of the pytest process's own lifetime helpers (see the module docstring)."""
    pids: set[int] = set()
    tg = sys.modules.get("tinygrad.engine.worker")
    pool = getattr(tg, "worker_pool", None)
    for p in getattr(pool, "_pool", None) or ():
        if p.pid is not None:
            pids.add(p.pid)
    rt = sys.modules.get("multiprocessing.resource_tracker")
    tracker = getattr(getattr(rt, "_resource_tracker", None), "_pid", None)
    if tracker is not None:
        pids.add(tracker)
    compute = sys.modules.get("chestnut.backend.sim.compute")
    for pid in getattr(compute, "running_pids", lambda: ())():
        pids.add(pid)
    return pids


PF_KTHREAD = 0x00200000
"""``/proc/<pid>/stat`` flags bit of a kernel thread (linux ``include/linux/sched.h``)"""
EXEC_SETTLE_S = 1.0
"""s a process caught inside execve(2) gets to show its new environment before it is taken for none of ours"""


def _no_address_space(pid: int) -> bool:
    """A zombie, a process gone, or a kernel thread: nothing of its environment will ever show."""
    fields = _stat_fields(pid)
    try:
        return fields[0] in ("Z", "X") or bool(int(fields[6]) & PF_KTHREAD)
    except (IndexError, ValueError):
        return True


def _settled_environ(pid: int) -> bytes:
    """``/proc/<pid>/environ``, looked at again while the process is inside execve(2).

    Between execve's new address space and its argument set-up the kernel shows an empty environment and an
    empty command line (fs/proc/base.c ``environ_read``: no ``mm->env_end`` yet); a test's
    ``sh -c "sleep 60 &"`` that exits while its child still exec-s leaves the child there, and one read in
    seven found it so beside two CPU hogs. Once the command line shows, exec is over and the environment
    read after it is the new one (empty only for a process started with none)."""
    settle_by = time.monotonic() + EXEC_SETTLE_S
    while True:
        env = _environ(pid)
        if env or _no_address_space(pid):
            return env
        try:
            shown = Path(f"/proc/{pid}/cmdline").read_bytes()[:1] != b""
        except OSError:
            return b""
        if shown or time.monotonic() >= settle_by:
            return _environ(pid)
        time.sleep(0.002)


def carriers(marker: bytes, exclude: set[int] | None = None) -> list[int]:
    """Live (not zombie) processes whose environment holds the exact entry ``marker`` (``b"NAME=value"``)."""
    skip = (exclude or set()) | {os.getpid()}
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid in skip:
            continue
        env = _settled_environ(pid)
        if env and marker in env.split(b"\0") and _state(pid) not in ("Z", "X"):
            found.append(pid)
    return found


def _survivors(marker: bytes, grace_s: float) -> list[tuple[int, str]]:
    """The carriers of ``marker`` still alive after ``grace_s`` (waited for, not slept), with their command lines."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = carriers(marker, _helpers_of_this_process())
        if not alive or time.monotonic() >= deadline:
            return [(p, _cmdline(p)) for p in alive]
        time.sleep(POLL_S)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _lock_holders() -> dict[tuple[int, int, int], set[int]]:
    """``/proc/locks``: (major, minor, inode) -> the pids holding a lock on that file (proc(5))."""
    holders: dict[tuple[int, int, int], set[int]] = {}
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return holders
    for line in lines:
        parts = line.split()
        if "->" in parts:  # a waiter, not a holder
            continue
        try:
            pid = int(parts[4])
            major, minor, inode = parts[5].split(":")
            holders.setdefault((int(major, 16), int(minor, 16), int(inode)), set()).add(pid)
        except (IndexError, ValueError):
            continue
    return holders


def _held_locks() -> set[str]:
    """The dock lock files in the temporary directory held by this pytest process or a process it started
    (``/proc/locks``; a lock another user of the machine holds is none of this run's business). tinygrad
    never removes its lock files, so one lying there unheld is no leak."""
    tmp = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(tmp) if n.startswith("am_usb:") and n.endswith(".lock")]
    except OSError:
        return set()
    holders = _lock_holders()
    session = f"{SESSION_VAR}={os.getpid()}".encode()
    held = set()
    for n in names:
        path = os.path.join(tmp, n)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        pids = holders.get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino), set())
        if any(pid == os.getpid() or session in _environ(pid).split(b"\0") for pid in pids):
            held.add(path)
    return held


def tag_for(nodeid: str) -> str:
    """The tag a test's processes carry (short, stable for the node id, unique per pytest process)."""
    import hashlib

    return f"t{os.getpid()}-{hashlib.sha1(nodeid.encode()).hexdigest()[:10]}"


def pytest_configure(config: pytest.Config) -> None:
    os.environ[SESSION_VAR] = str(os.getpid())


@pytest.fixture(autouse=True)
def leak_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Tags the test's processes and, after its teardown, reports what it left (see the module docstring)."""
    tag = tag_for(request.node.nodeid)
    monkeypatch.setenv(TEST_VAR, tag)
    yield
    left = _survivors(f"{TEST_VAR}={tag}".encode(), GRACE_S)
    _kill([p for p, _ in left])
    if left:
        pytest.fail(f"{request.node.nodeid} left behind: " + "; ".join(f"process {p} ({cmd})" for p, cmd in left),
                    pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    result = yield
    if nextitem is not None and nextitem.path == item.path:
        return result
    # the module's fixtures are torn down now: what carries the session's tag but no test's is theirs
    marker = f"{SESSION_VAR}={os.getpid()}".encode()
    ours = f"{TEST_VAR}=t{os.getpid()}-".encode()  # a test's own leak is that test's, reported by leak_guard

    def fixtures_left(grace_s: float) -> list[tuple[int, str]]:
        return [(p, c) for p, c in _survivors(marker, grace_s)
                if not any(e.startswith(ours) for e in _environ(p).split(b"\0"))]

    left = fixtures_left(0.0)
    if left:
        left = fixtures_left(GRACE_S)
    _kill([p for p, _ in left])
    problems = [f"process {p} ({c})" for p, c in left] + [f"a held lock on {n}" for n in sorted(_held_locks())]
    if problems:  # an error of the module's last test's teardown: it reaches the report under xdist too
        pytest.fail(f"{item.path.name}: its fixtures left behind: " + "; ".join(problems), pytrace=False)
    return result
