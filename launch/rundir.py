"""``chestnut launch``'s run directory: a fresh ``runs/<UTC time>/`` of its own for each launch, private to
this user (:func:`make_run_dir`), and the supervisord configuration rendered into it from
``launch/supervisord.conf`` (:func:`render_config`); and, once the stack stopped, its prefix's runtime directory
removed when nothing but the stack's own leftovers is in it (:func:`remove_runtime_dir`), and left as it was
found by a launch refused before anything started (:func:`refusal_undone`)."""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import secrets
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from chestnut.msgs.outdir import new_private_dir, private_dir, write_private

TEMPLATE = Path(__file__).with_name("supervisord.conf")
T = TypeVar("T")
RUN_UMASK = 0o077  # supervisord and every program: logs (camera frames), reports and the pidfile are 0600


def make_run_dir(runs_dir: Path, now: time.struct_time | None = None) -> Path:
    """Create a fresh ``<runs_dir>/<YYYY-mm-dd--HH-MM-SS UTC>/logs`` 0700 (``msgs/outdir.py``
    ``new_private_dir``); returns the run dir. A run never shares a directory: a name already taken by a
    directory of ours (a launch in the same second) gets a ``-2``, ``-3`` ... suffix.

    The logs hold camera frames and the dock's identity, so no other user may read them. Raises
    :class:`~chestnut.msgs.outdir.OutputDirError` (one line) before anything is written for a ``runs_dir``
    that is a symlink, not ours or group/other-writable, and for a symlink or a foreign entry at the run's
    name (never followed)."""
    runs = private_dir(runs_dir).resolve()  # runs_dir itself is no symlink: resolve only names its folders
    run_dir = new_private_dir(runs, time.strftime("%Y-%m-%d--%H-%M-%S", now or time.gmtime()))
    private_dir(run_dir / "logs")
    return run_dir


def render_config(
    run_dir: Path,
    prefix: str,
    rate_hz: float,
    node_args: list[str],
    twin_args: list[str],
    log_format: str = "both",
    foxglove_port: int = 8765,
    camera_args: list[str] | None = None,
    streaming_copies: bool = True,
) -> Path:
    """Write ``supervisord.conf`` for this run; returns its path. ``camera_args``: ``chestnut camera``'s
    arguments beyond ``--rate`` (:meth:`FrameOptions.camera_args`; none: the camera's defaults). With
    ``streaming_copies`` (a camera whose big frames go through the ring) the camera is started with the
    ``GLIBC_TUNABLES`` of ``msgs/visionipc.py`` ``streaming_copy_tunables``; without (``--transport inline``,
    whose big frames are copied and read back at once, which streaming stores make slower:
    ``tests/bench/bench_frames.py``'s inline rows) with the environment's own value, checked the same way."""
    from chestnut.msgs.paths import runtime_dir
    from chestnut.msgs.visionipc import streaming_copy_tunables

    py = sys.executable
    # supervisord's control socket lives in the stack's private runtime dir: a unix socket path must stay
    # under 108 bytes, which a deep run directory would exceed
    text = TEMPLATE.read_text().format(
        run_dir=run_dir,
        sock_dir=runtime_dir(prefix),
        # as root, supervisord's own line for it: it runs as root by choice (supervisor/options.py
        # set_uid_or_exit: "you can set user=root in the config file to avoid this message", a CRIT line)
        user_line=f"user={pwd.getpwuid(0).pw_name}" if os.getuid() == 0 else "",
        ctl_password=secrets.token_hex(16),  # this run's, in this 0600 file only (supervisorctl -c reads it)
        python=py,
        prefix=prefix,
        rate=rate_hz,
        node_args=" ".join(node_args),
        twin_args=" ".join(twin_args),
        camera_args=" ".join(camera_args or []),
        log_dir=run_dir / "logs",
        log_format=log_format,
        foxglove_port=int(foxglove_port),
        path=os.environ.get("PATH", ""),
        camera_tunables=streaming_copy_tunables(os.environ.get("GLIBC_TUNABLES"), streaming=streaming_copies),
    )
    conf = run_dir / "supervisord.conf"
    write_private(conf, text)
    return conf


def _stack_entry(name: str) -> tuple[str, int] | None:
    """What the stack leaves at ``name`` in a runtime directory, as (what, ``S_IFMT`` type), else None: a
    service's publisher lock file (``msgs/messaging.py`` ``PUB_LOCK_SUFFIX``), a service's ``ipc://`` socket or
    another socket of the stack (``msgs/paths.py`` ``STACK_SOCKET_NAMES``), the twin's host-wait figure
    (``backend/sim/hostwait.py`` ``FILE_NAME``)."""
    from chestnut.backend.sim.hostwait import FILE_NAME as HOSTWAIT_FILE
    from chestnut.msgs.messaging import PUB_LOCK_SUFFIX
    from chestnut.msgs.paths import STACK_SOCKET_NAMES
    from chestnut.msgs.services import SERVICE_LIST

    if name.endswith(PUB_LOCK_SUFFIX) and name[: -len(PUB_LOCK_SUFFIX)] in SERVICE_LIST:
        return "lock", stat.S_IFREG
    if name in SERVICE_LIST or name in STACK_SOCKET_NAMES:
        return "socket", stat.S_IFSOCK
    if name == HOSTWAIT_FILE:
        return "file", stat.S_IFREG
    return None


def _not_the_stacks(path: Path, name: str) -> str:
    return (f"runtime directory {path} kept: {name} in it is not the stack's (another program's file on this prefix, "
            "say a `chestnut twin serve` of its own, or planted); remove it once nothing uses it")


def remove_runtime_dir(prefix: str) -> str | None:
    """Remove ``prefix``'s runtime directory (``msgs/paths.py`` ``runtime_dir``: ``<base>/chestnut-<uid>/<prefix>``)
    once its stack stopped, with the stack's leftovers in it; returns None when it is gone (or was never there),
    else one line saying why it is kept. Raises nothing.

    Kept, untouched, unless every entry is a leftover of the stack (:func:`_stack_entry`) of the right type
    and ours, the directory itself is ours and 0700 (``private_problem``), and no process holds any of its
    publisher locks: a foreign file (a log, anything planted) or a live publisher (a program that outlived the
    stop) keeps it. The publisher locks are taken here (``flock(LOCK_EX | LOCK_NB)``, the publishers' own lock)
    and held while the entries are unlinked and the directory removed, so no publisher can start in it
    meanwhile; a file that comes in meanwhile makes the ``rmdir`` fail and keeps it. Nothing is followed
    (``O_NOFOLLOW``, ``dir_fd``). ``chestnut-<uid>`` above it is shared by every prefix and stays."""
    from chestnut.msgs.paths import private_problem, runtime_base

    uid = os.getuid()
    user_dir = runtime_base() / f"chestnut-{uid}"
    path = user_dir / prefix
    fds: list[int] = []
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fds.append(os.open(user_dir, flags))
        fds.append(os.open(prefix, flags, dir_fd=fds[0]))
        if (problem := private_problem(os.fstat(fds[0]), uid) or private_problem(os.fstat(fds[1]), uid)) is not None:
            return f"runtime directory {path} kept: {problem}"
        names = sorted(os.listdir(fds[1]))
        for name in names:  # everything judged before anything is removed
            st = os.lstat(name, dir_fd=fds[1])
            entry = _stack_entry(name)
            if entry is None or stat.S_IFMT(st.st_mode) != entry[1] or st.st_uid != uid:
                return _not_the_stacks(path, name)
        for name in names:
            if _stack_entry(name) == ("lock", stat.S_IFREG):
                fds.append(os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fds[1]))
                if not stat.S_ISREG(os.fstat(fds[-1]).st_mode):
                    return _not_the_stacks(path, name)
                try:
                    fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return f"runtime directory {path} kept: a live process holds {name}"
        for name in names:
            os.unlink(name, dir_fd=fds[1])
        os.rmdir(prefix, dir_fd=fds[0])
    except FileNotFoundError:
        return None if not fds[1:] else f"runtime directory {path} kept: an entry went away meanwhile"
    except OSError as e:
        if e.errno == errno.ENOTEMPTY:
            return f"runtime directory {path} kept: something came into it meanwhile"
        return f"runtime directory {path} kept: {e.strerror or e}"
    finally:
        for fd in reversed(fds):
            os.close(fd)
    return None


def refusal_undone(checks: Callable[[], T]) -> T:
    """Run ``checks`` (``chestnut launch``'s checks before anything starts, which take and release the publisher
    locks in the prefix's runtime directory: ``msgs/messaging.py`` ``check_publishable``) and return what it
    returns. When it refuses -- returns an ``int`` (the exit status) or raises -- the runtime directory is left as
    it was found: the lock files it made are removed (one another process holds stays) and the directory too when
    it made it and nothing else is in it; a directory that was there before stays. Nothing is followed. A malformed
    ``CHESTNUT_PREFIX`` names no directory: ``checks`` refuses it."""
    from chestnut.msgs.messaging import PUB_LOCK_SUFFIX
    from chestnut.msgs.paths import current_prefix, runtime_base

    try:
        prefix = current_prefix()
    except ValueError:
        return checks()
    path = runtime_base() / f"chestnut-{os.getuid()}" / prefix
    before = set(_lock_names(path))
    existed = os.path.lexists(path)
    try:
        out = checks()
    except BaseException:
        _remove_new_locks(path, before, existed, PUB_LOCK_SUFFIX)
        raise
    if isinstance(out, int):
        _remove_new_locks(path, before, existed, PUB_LOCK_SUFFIX)
    return out


def _lock_names(path: Path) -> list[str]:
    """The publisher lock files' names in ``path`` (none when it cannot be read)."""
    from chestnut.msgs.messaging import PUB_LOCK_SUFFIX

    try:
        return [n for n in os.listdir(path) if n.endswith(PUB_LOCK_SUFFIX)] if not path.is_symlink() else []
    except OSError:
        return []


def _remove_new_locks(path: Path, before: set[str], existed: bool, suffix: str) -> None:
    """Unlink the lock files in ``path`` not in ``before`` (each held with ``flock(LOCK_EX | LOCK_NB)`` while it
    is unlinked, so one a publisher took meanwhile stays), then ``rmdir`` ``path`` unless it ``existed``."""
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        for name in sorted(set(os.listdir(dfd)) - before):
            if not name.endswith(suffix):
                continue
            try:
                fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
            except OSError:
                continue
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode) and os.fstat(fd).st_uid == os.getuid():
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.unlink(name, dir_fd=dfd)
            except OSError:  # held by a live publisher (BlockingIOError), or gone
                pass
            finally:
                os.close(fd)
    finally:
        os.close(dfd)
    if not existed:
        try:
            os.rmdir(path)
        except OSError:  # something else is in it: it stays
            pass
