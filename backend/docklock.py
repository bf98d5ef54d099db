"""The dock's lock file: where tinygrad keeps it, and the one way this project opens and takes it.

tinygrad 0.14 (``runtime/support/system.py`` ``_System.flock_acquire``, called by ``USBPCIDevice`` with
devpref ``"AM"`` and pcibus ``usb:<bus>-<addr>``) takes a non-blocking exclusive ``flock`` on
``<tempdir>/am_usb:<bus>-<addr>.lock`` (``helpers.temp``: ``tempfile.gettempdir()``) before it opens
USB, and never releases it: only process exit does. It opens an existing file ``O_RDWR`` without
``O_CREAT`` and creates a missing one 0666 under ``umask(0)``.

The node takes the same lock at the same path before tinygrad does -- its worker in the qualification ladder's
first rung, ``usb_ids``, before any rung sends the dock a vendor request (``backend/ladder.py`` ``DockQualifier``
``lock``), so a dock another process holds is refused, never reset, and a busy dock is a clear error, not
tinygrad's first-try ``RuntimeError`` -- but opens it more carefully:

- ``O_NOFOLLOW`` always: a planted symlink (say to a file of ours elsewhere) is refused, never
  opened, so nothing outside the lock file is ever touched;
- ``O_CREAT | O_EXCL`` only when the file is missing, so an existing file is never re-created, and
  the file we create is the one we open; it is created 0600 whatever the umask (nothing of ours is
  reachable by another user; tinygrad in our processes opens it read-write as its owner), the process
  umask is never changed and nothing is ever chmodded (a file tinygrad created first keeps its mode);
- the result must be a regular file (``O_NONBLOCK`` keeps a planted FIFO or device from blocking
  the open);
- ``O_RDWR`` as tinygrad, so a file tinygrad could not open either (another user's, mode 0644) is
  refused here with :class:`~chestnut.backend.errors.UsbLayerError` ``lock_unusable``;
- the open file must belong to us or to root and be writable by nobody else (:func:`lock_file_problem`): the
  name ``am_usb:<bus>-<addr>.lock`` is fixed and the temp dir is shared, so another local user can create it
  first (``touch``, ``chmod 666``) and then hold a ``flock`` on it whenever they like; such a file is refused
  as ``lock_unusable`` naming its owner and mode, like a symlink, never used.

Once we created the file in the sticky temp dir, no other user can swap it before tinygrad opens it.

The file stays after its last holder is gone (``chestnut launch`` leaves ``am_usb:<bus>-<addr>.lock`` behind), on
purpose: it is the standard ``flock`` idiom, and unlinking a lock file races. A process that opened the file just
before the unlink goes on to lock the unlinked inode while the next one creates a fresh file at the name and locks
that: two holders of "the" dock lock at once. Only a lock file whose every user re-checks, after its ``flock``,
that the name still leads to the inode it locked may be unlinked, and tinygrad 0.14's ``flock_acquire`` does not.
An empty 0600 file of ours in the temp dir costs nothing and is reused by the next open.

tinygrad's ``flock_acquire`` also calls ``os.umask(0)`` and leaves it there, so every file and directory the
process creates afterwards would be world-writable (tinygrad's compile cache among them), against the unit's
``UMask=0077``: :func:`keep_umask_around_tinygrads_lock` makes that call restore the umask the process had, and
creates a missing lock file first, 0600, so tinygrad opens it rather than making its own 0666 one.

A lock this process already holds through a :class:`DockLock` is handed to tinygrad, not given up first: the
same wrapper answers tinygrad's ``flock_acquire`` for that file with a ``dup`` of the held descriptor (one open
file description, so one ``flock``, which tinygrad then keeps for the process's life, as it keeps its own). A
``flock`` belongs to the open file description, not to the process: tinygrad opening the file again would be
refused our own lock, and releasing it first would leave a moment in which another process could take the dock.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shlex
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chestnut.backend.errors import UsbLayerError
from chestnut.msgs.paths import PROC_LOCKS, UMASK_LOCK, flock_holders, trusted_owners

LOCK_DEVPREF = "am"  # tinygrad 0.14 USBPCIDevice("AM", ...) -> lock "am_usb:<bus>-<addr>.lock"
LOCK_CREATE_MODE = 0o600  # ours: private (tinygrad 0.14 flock_acquire creates 0666 under umask 0)
LOCK_BACKOFF_S = (0.05, 0.1, 0.2, 0.4, 0.8, 1.0)  # s between attempts of DockLock.acquire, growing
CMDLINE_MAX_BYTES = 4096  # bound on the read of a holder's /proc/<pid>/cmdline (more than a shown command needs)
HOLDER_COMMAND_MAX_CHARS = 200  # a holder's command as shown in one line, longer ones cut with "..."
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_HELD: dict[str, DockLock] = {}  # this process's held DockLocks by path: tinygrad's own flock_acquire gets a dup


def dock_lock_path(bus: int, address: int) -> Path:
    """tinygrad 0.14's lock file for the dock at ``bus``/``address``: ``<tempdir>/am_usb:<bus>-<addr>.lock``
    (``runtime/support/system.py`` ``USBPCIDevice.__init__``: ``System.flock_acquire(f"{devpref.lower()}_
    {pcibus.lower()}.lock")``, placed by ``helpers.temp``)."""
    return Path(tempfile.gettempdir()) / f"{LOCK_DEVPREF}_usb:{bus}-{address}.lock"


def _unusable(path: Path, problem: str, fix: str) -> UsbLayerError:
    return UsbLayerError("lock_unusable", f"the dock's lock file {path} {problem}; {fix}")


def open_dock_lock(path: str | os.PathLike[str]) -> int:
    """Open (creating it if missing) the lock file at ``path`` as this module's docstring says; returns the fd.

    Raises :class:`~chestnut.backend.errors.UsbLayerError` ``lock_unusable`` for a symlink, a file that
    is not a regular file, or one this user may not open read-write (``PermissionError``).
    """
    path = Path(path)
    fix = f"remove it (sudo rm {path}) once no process uses the dock"
    try:
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            try:
                fd = os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, LOCK_CREATE_MODE)
            except FileExistsError:  # created by someone else since: open theirs, same checks
                fd = os.open(path, _OPEN_FLAGS)
    except PermissionError:
        raise _unusable(path, "cannot be opened read-write by this user (tinygrad could not either)", fix) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _unusable(path, "is a symlink (refused: it could point anywhere)", fix) from None
        if e.errno == errno.EISDIR:  # O_RDWR on a directory
            raise _unusable(path, "is a directory, not a regular file", fix.replace("rm ", "rm -r ", 1)) from None
        raise _unusable(path, f"cannot be opened ({e.strerror})", fix) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _unusable(path, "is not a regular file", fix)
    problem = lock_file_problem(st, os.geteuid())
    if problem is not None:
        os.close(fd)
        raise _unusable(path, problem, fix)
    return fd


def lock_file_problem(st: os.stat_result, euid: int) -> str | None:
    """Why a lock file with status ``st`` is not one ``euid`` may take (None when it may): it must belong to
    ``euid`` or root and be writable by its owner only. Anyone who can open a file can ``flock`` it (flock(2)
    needs no write access), so a file another user planted in the sticky temp dir, or one group/other may
    rewrite, would let that user hold the dock's lock against us at will. One line naming owner and mode."""
    mode = stat.S_IMODE(st.st_mode)
    why = []
    if st.st_uid not in (euid, 0):
        why.append(f"not to {trusted_owners(euid)}")
    if mode & 0o022:
        why.append("writable by group/other")
    if not why:
        return None
    return f"belongs to uid {st.st_uid} with mode {mode:04o} ({', '.join(why)}: refused, another user could hold it)"


def try_flock(fd: int) -> bool:
    """Take tinygrad's exclusive, non-blocking ``flock`` on ``fd``; False if another open file holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_holders(path: Path, proc_locks: Path = Path(PROC_LOCKS)) -> list[int]:
    """PIDs holding a ``flock`` on ``path`` according to ``/proc/locks`` (a bounded read: ``msgs/paths.py``
    ``flock_holders``); empty if unknown."""
    return flock_holders(path, proc_locks)


def holder_command(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The command line of process ``pid`` as one line: ``/proc/<pid>/cmdline`` (proc(5): the arguments, each
    ended by a NUL) read up to :data:`CMDLINE_MAX_BYTES`, the arguments quoted as a shell would take them
    (``shlex.join``: an empty argument shows as ``''``, one with spaces in quotes), every character that is not
    printable (a newline in an argument) shown as ``?``; over :data:`HOLDER_COMMAND_MAX_CHARS`, the whole arguments
    that fit and `` ...`` (a first argument longer than that is cut, with ``...``). None when it cannot be read or
    is empty (a process gone meanwhile, a kernel thread)."""
    try:
        with open(proc / str(pid) / "cmdline", "rb") as f:
            raw = f.read(CMDLINE_MAX_BYTES)
    except OSError:
        return None
    if not raw.strip(b"\0"):
        return None
    args = [shlex.quote(a) for a in raw.decode(errors="replace").removesuffix("\0").split("\0")]
    args = ["".join(c if c.isprintable() else "?" for c in a) for a in args]
    text = " ".join(args)
    if len(text) <= HOLDER_COMMAND_MAX_CHARS:
        return text
    if len(args[0]) > HOLDER_COMMAND_MAX_CHARS - 4:
        return args[0][: HOLDER_COMMAND_MAX_CHARS - 3] + "..."
    shown = args[0]
    for a in args[1:]:
        if len(shown) + 1 + len(a) + 4 > HOLDER_COMMAND_MAX_CHARS:
            break
        shown += " " + a
    return shown + " ..."


def describe_holders(path: Path, proc_locks: Path = Path("/proc/locks")) -> str:
    """Who holds the ``flock`` on ``path``, for one line: ``"pid 1234 (<its command>)"`` per holder
    (:func:`lock_holders`, :func:`holder_command`; ``"pid 1234"`` alone when its command cannot be read), joined
    by ``", "``; ``"another process"`` when ``/proc/locks`` names none."""
    parts = []
    for pid in lock_holders(path, proc_locks):
        cmd = holder_command(pid)
        parts.append(f"pid {pid} ({cmd})" if cmd is not None else f"pid {pid}")
    return ", ".join(parts) or "another process"


class DockLock:
    """tinygrad's exclusive, non-blocking ``flock`` on the dock's lock file, taken with back-off.

    :meth:`acquire` retries for ``timeout_s`` (sleeps :data:`LOCK_BACKOFF_S`, growing), then raises
    UsbLayerError ``lock_held`` naming the lock file and the holding PIDs; a file that cannot be used
    at all raises ``lock_unusable`` at once (:func:`open_dock_lock`). The lock is held until
    :meth:`release` or process exit (tinygrad itself never releases it). While it is held, tinygrad's own
    ``flock_acquire`` for the same file in this process shares it (:func:`keep_umask_around_tinygrads_lock`):
    once tinygrad has it, :meth:`release` closes only this object's descriptor and the lock stays with tinygrad.
    """

    def __init__(
        self, path: Path, sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = Path(path)
        self.fd: int | None = None
        self._sleep, self._clock = sleep, clock

    def try_acquire(self) -> bool:
        if self.fd is not None:
            return True
        fd = open_dock_lock(self.path)
        if not try_flock(fd):
            os.close(fd)
            return False
        self.fd = fd
        _HELD[str(self.path)] = self
        return True

    def acquire(self, timeout_s: float) -> DockLock:
        deadline = self._clock() + timeout_s
        attempt = 0
        while not self.try_acquire():
            if self._clock() >= deadline:
                holders = lock_holders(self.path)
                who = f"held by pid {', '.join(map(str, holders))}" if holders else "held by another process"
                raise UsbLayerError(
                    "lock_held",
                    f"the dock's lock file {self.path} is {who} (waited {timeout_s:g} s); "
                    f"stop that process or wait for it to exit",
                )
            self._sleep(min(LOCK_BACKOFF_S[min(attempt, len(LOCK_BACKOFF_S) - 1)], max(0.0, deadline - self._clock())))
            attempt += 1
        return self

    def release(self) -> None:
        if self.fd is not None:
            if _HELD.get(str(self.path)) is self:
                del _HELD[str(self.path)]
            os.close(self.fd)
            self.fd = None

    def wait_free(self, timeout_s: float) -> None:
        """Wait (with back-off) until nobody holds the lock, then leave it free for tinygrad to take."""
        self.acquire(timeout_s)
        self.release()


def held_dock_lock(path: str | os.PathLike[str]) -> DockLock | None:
    """The :class:`DockLock` this process holds on the lock file ``path``, or None."""
    lock = _HELD.get(str(Path(path)))
    return lock if lock is not None and lock.fd is not None else None


def keep_umask_around_tinygrads_lock() -> None:
    """Wrap tinygrad 0.14's ``_System.flock_acquire`` (``runtime/support/system.py``, which sets ``os.umask(0)``
    to create its lock file 0666 and never sets it back) so that the process umask after the call is the one it
    had before, whether the lock was taken or refused, and a missing lock file is created first by
    :func:`open_dock_lock` (0600), so tinygrad opens ours and creates none. A lock file this process already holds
    through a :class:`DockLock` (:func:`held_dock_lock`) is not opened again: tinygrad gets a ``dup`` of the held
    descriptor (the same ``flock``, kept by tinygrad from then on; nothing is released in between). Call before
    tinygrad opens the dock; idempotent. tinygrad itself is not changed."""
    from tinygrad.runtime.support import system

    cls = type(system.System)
    real = getattr(cls.flock_acquire, "_chestnut_real", cls.flock_acquire)

    def flock_acquire(self: Any, name: str) -> int:
        held = held_dock_lock(Path(tempfile.gettempdir()) / name)  # helpers.temp's place
        if held is not None and held.fd is not None:  # ours already: shared, never released in between
            self.lock_fd = os.dup(held.fd)  # as tinygrad's own call sets it
            return int(self.lock_fd)
        with UMASK_LOCK:  # no socket bind's umask window (msgs/paths.py bind_private_socket) interleaves with this one
            before = os.umask(0o077)
            os.umask(before)
            try:  # a missing file is made here, 0600 (tinygrad would make it 0666); tinygrad then opens ours
                os.close(open_dock_lock(Path(tempfile.gettempdir()) / name))  # helpers.temp's place
            except UsbLayerError:
                pass  # a file no one can use: tinygrad's own open below fails on it as it always did
            try:
                return int(real(self, name))  # LOCK_NB: never waits with the lock held
            finally:
                os.umask(before)

    flock_acquire._chestnut_real = real  # type: ignore[attr-defined]
    cls.flock_acquire = flock_acquire  # type: ignore[method-assign]
