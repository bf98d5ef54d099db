"""Where the stack's sockets and runtime files live, and why no other user can redirect them.

Every stack runs in its own private runtime directory, ``<base>/chestnut-<uid>/<prefix>``.
``<base>`` is ``$RUNTIME_DIRECTORY`` (set by systemd's ``RuntimeDirectory=``; its first entry),
else ``$XDG_RUNTIME_DIR``, else the system temp dir; ``<prefix>`` is ``$CHESTNUT_PREFIX`` (default
``"default"``), so parallel stacks and tests never collide.

ZeroMQ binds and connects ``ipc://`` sockets by path, so every directory on that path must be one
no other user can change:

- ``<base>`` and every folder above it belong to us or to root, and group/other cannot write to them
  unless they are sticky (``/tmp``: others may not rename or remove what we own in it);
- ``chestnut-<uid>/`` and ``<prefix>/`` are real directories (not symlinks), belong to us, and have
  no group/other permission bits at all (mode 0700).

Every Unix socket path is at most :data:`SUN_PATH_MAX` (107) bytes (``sun_path`` is 108 bytes with its NUL:
unix(7)), so ``<prefix>`` is at most :data:`PREFIX_MAX` (48) characters, which fits under ``/run/user/<uid>`` for
any uid, and a runtime directory too long for the longest socket name the stack uses
(:data:`LONGEST_SOCKET_NAME`) is refused before anything is created (:func:`check_socket_room`).

A directory that breaks a rule is refused with :class:`RuntimeDirError`; nothing is ever chmodded
(a directory we create is born 0700; one we did not create is not ours to repair). The directories
are created and checked relative to an open descriptor of their parent (``mkdir(dir_fd=)``, then
``open(O_NOFOLLOW | O_DIRECTORY, dir_fd=)`` and ``fstat``), so swapping a path component for a
symlink between the check and the use cannot redirect us.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from chestnut.msgs.services import SERVICE_LIST

PREFIX_ENV = "CHESTNUT_PREFIX"
DEFAULT_PREFIX = "default"
PREFIX_MAX = 48  # characters: what fits under /run/user/<uid> for any 32-bit uid (see runtime_dir)
_PREFIX_RE = re.compile(rf"^[A-Za-z0-9_.-]{{1,{PREFIX_MAX}}}$")
SUN_PATH_MAX = 107  # bytes of a Unix socket's path: sun_path is 108 bytes with its terminating NUL (unix(7))
STACK_SOCKET_NAMES = ("cameraFrame.vipc", "twin.sock", "supervisor.sock")
"""The Unix sockets in the runtime directory besides each service's ``ipc://`` one: the frame ring's hand-over
(``msgs/visionipc.py`` ``SOCKET_NAME``), the twin's (``backend/sim/wire.py`` ``SOCKET_NAME``) and supervisord's
control socket (``launch/supervise.py`` ``STACK_SOCKETS``)."""
LONGEST_SOCKET_NAME = max((*SERVICE_LIST, *STACK_SOCKET_NAMES), key=len)
BASE_ENVS = ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR")  # in order of preference; then the temp dir
PRIVATE_MODE = 0o700
SOCKET_MODE = 0o600
UMASK_LOCK = threading.Lock()
"""Held around every change of this process's umask that is set back again (:func:`bind_private_socket`, and
``backend/docklock.py``'s wrapper of tinygrad's lock call, which sets ``umask(0)``): ``os.umask`` is process-wide, so
two such windows in two threads must not interleave (the later one would set the first one's mask back for good)."""


class RuntimeDirError(PermissionError):
    """A runtime directory the stack must not use. ``str()`` is one line: what, which path, how to fix.

    ``path`` is the offending directory.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str, fix: str) -> None:
        super().__init__(f"runtime directory {path} {problem}; {fix}")
        self.path = Path(path)


class SocketPathError(RuntimeDirError):
    """Something other than a stale socket of ours lies where one of our programs binds a Unix socket
    (a publisher's ``ipc://`` path, the twin's ``twin.sock``): a bind would first unlink it (libzmq's
    ``ipc_listener_t`` removes the path before it binds; the twin replaces a stale socket) or fail on it.
    ``str()`` is one line: which path, what is there, how to fix. ``path`` is the socket path. A
    :class:`RuntimeDirError`, so every program refuses it as it refuses a subverted runtime directory (one
    line, exit 2). ``what`` names what lies there (e.g. ``a symlink, not a socket``)."""

    def __init__(self, path: str | os.PathLike[str], what: str) -> None:
        PermissionError.__init__(
            self, f"socket path {path} holds {what}: refused, nothing replaced; remove it and start again"
        )
        self.path = Path(path)
        self.what = what


def check_socket_path(path: str | os.PathLike[str]) -> None:
    """Refuse (:class:`SocketPathError`) anything at ``path`` but nothing or a socket of ours (this effective
    uid's), which a bind may replace: a regular file, a directory, a symlink (never followed), a FIFO or device,
    or another user's socket is kept and refused. ``lstat`` only: nothing is opened, unlinked or followed.
    The rule of every socket path in the runtime directory (README "What nobody else can subvert")."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISSOCK(st.st_mode):
        if st.st_uid == os.geteuid():
            return
        raise SocketPathError(path, f"a socket of uid {st.st_uid}, not one of ours (uid {os.geteuid()})")
    what = ("a symlink" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
            else "a regular file" if stat.S_ISREG(st.st_mode) else "a special file")
    raise SocketPathError(path, f"{what}, not a socket")


def bind_private_socket(path: str | os.PathLike[str], bind: Callable[[], object]) -> None:
    """Run ``bind`` (the bind of a Unix socket at ``path``: ``sock.bind(path)``, ZeroMQ's ``sock.bind("ipc://"
    + path)``) with group/other cleared from the umask, so the socket file is born with no permission for another
    user whatever the process umask (a login shell's 022 made ``chestnut twin serve``'s and ``chestnut run``'s
    sockets ``srwxr-xr-x``: connectable by anyone who could reach the folder), then make it :data:`SOCKET_MODE`
    (0600; the owner's execute bit, meaningless on a socket, goes). There is no moment at which another user could
    connect. The umask is only narrowed (``old | 0o077``: a thread creating a file meanwhile gets no wider mode) and
    set back under :data:`UMASK_LOCK`. An error from ``bind`` propagates, the umask set back."""
    with UMASK_LOCK:
        old = os.umask(0o077)
        os.umask(old | 0o077)
        try:
            bind()
        finally:
            os.umask(old)
    os.chmod(path, SOCKET_MODE)


class PrefixError(ValueError):
    """A malformed prefix (``$CHESTNUT_PREFIX`` or an explicit one). ``str()`` is one line: what, how to fix."""


def shown_cut(text: str, limit: int = PREFIX_MAX) -> str:
    """``text`` as a refusal line shows it: its ``repr`` when at most ``limit`` characters, else its first ``limit``
    characters and its length (``'abc...'... (5000 characters)``): an argument is never echoed whole."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def check_prefix(prefix: str, source: str = "prefix") -> str:
    """``prefix`` when it is 1-:data:`PREFIX_MAX` characters from ``[A-Za-z0-9_.-]`` and not ``.`` / ``..`` (it names a
    directory); else raises :class:`PrefixError` naming ``source`` (e.g. ``"CHESTNUT_PREFIX"``)."""
    if not _PREFIX_RE.match(prefix) or prefix in (".", ".."):
        raise PrefixError(
            f"{source} {shown_cut(prefix)} is not a valid prefix: use 1-{PREFIX_MAX} characters from [A-Za-z0-9_.-], "
            f"not '.' or '..' (e.g. {PREFIX_ENV}=bench1), or unset {PREFIX_ENV} for {DEFAULT_PREFIX!r}"
        )
    return prefix


def current_prefix() -> str:
    """The active prefix: ``$CHESTNUT_PREFIX`` or ``"default"``; raises :class:`PrefixError` if malformed."""
    return check_prefix(os.environ.get(PREFIX_ENV, DEFAULT_PREFIX), PREFIX_ENV)


def runtime_base() -> Path:
    """``<base>``: the first entry of ``$RUNTIME_DIRECTORY``, else ``$XDG_RUNTIME_DIR``, else the temp dir."""
    for name in BASE_ENVS:
        value = os.environ.get(name, "")
        if value:
            return Path(value.split(":")[0])
    return Path(tempfile.gettempdir())


def trusted_owners(uid: int) -> str:
    """The owners a file or folder that ``uid`` relies on may have, as a refusal names them: ``"uid 1000 or
    root"``, and for root itself (uid 0) ``"root"`` ("uid 0 or root" named one owner twice)."""
    return "root" if uid == 0 else f"uid {uid} or root"


def base_problem(st: os.stat_result, uid: int) -> str | None:
    """Why a directory with status ``st`` cannot be ``<base>`` for ``uid`` (None when it can)."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in (uid, 0):
        return f"belongs to uid {st.st_uid}, not to {trusted_owners(uid)}"
    if stat.S_IMODE(st.st_mode) & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"is writable by group/other without the sticky bit (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def changeable_folder(holder: Path, uid: int) -> tuple[Path, str] | None:
    """The first of the folders from ``/`` down to ``holder`` (a real path: symlinks resolved) that another user
    than ``uid`` could change, with why (:func:`base_problem`); None when none could. The walk ends at the first
    folder that does not exist (those below it are yet to be made, by us). The rule of ``<base>`` and the folders
    above it (this module's docstring) and of the folders above an output directory (``msgs/outdir.py``
    ``check_folders_above``). Raises ``OSError`` (``filename``: the folder) for a folder that cannot be stat'ed."""
    for folder in (*reversed(holder.parents), holder):
        try:
            st = os.stat(folder)
        except FileNotFoundError:
            return None
        problem = base_problem(st, uid)
        if problem is not None:
            return folder, problem
    return None


MAXSYMLINKS = 40
"""Symlinks one lookup follows before it fails with ``ELOOP`` (Linux ``include/linux/namei.h``, path_resolution(7))."""


def lookup_folders(path: str | os.PathLike[str]) -> list[Path]:
    """Every folder in which a name of ``path`` is looked up when it is opened, as real paths (no symlink in them),
    in the order met, each once: the folders along ``path`` as given (a relative one from the working directory),
    and, for each symlink met, the folders along its target, followed as the kernel follows them
    (path_resolution(7)), up to the folder of the file it ends at. A folder in which only ``..`` is looked up is
    not one (that name cannot be replaced). Whoever can change one of these folders can change what ``path``
    opens. Raises OSError for a name that cannot be looked up (``ELOOP`` past :data:`MAXSYMLINKS` symlinks)."""
    given = Path(path)
    todo = list((given if given.is_absolute() else Path(os.getcwd()) / given).parts[1:])
    here, folders, links = Path("/"), [], 0
    while todo:
        name = todo.pop(0)
        if name == "..":
            here = here.parent  # ``here`` is a real path: its parent is the folder ``..`` names
            continue
        if here not in folders:
            folders.append(here)
        if stat.S_ISLNK(os.lstat(here / name).st_mode):
            links += 1
            if links > MAXSYMLINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
            target = Path(os.readlink(here / name))
            here = Path("/") if target.is_absolute() else here
            todo[:0] = target.parts[1:] if target.is_absolute() else target.parts
            continue
        here = here / name
    return folders


def owned_problem(st: os.stat_result, uid: int, is_kind: Callable[[int], bool], not_kind: str,
                  mask: int = 0o077, must: str = "") -> str | None:
    """Why a file with status ``st`` fails the rule every file or descriptor the project takes from outside meets
    (None when it passes): of its kind (``is_kind(st.st_mode)``, a ``stat.S_IS*``; else ``not_kind``), ``uid``'s,
    and none of ``mask``'s permission bits set (0o077: no group/other access at all, said "reachable"; 0o022: no
    group/other write, said "writable"), ``must`` added to the mode when set (e.g. ", must be 0700")."""
    if not is_kind(st.st_mode):
        return not_kind
    if st.st_uid != uid:
        return f"belongs to uid {st.st_uid}, not to uid {uid}"
    if (mode := stat.S_IMODE(st.st_mode)) & mask:
        return f"is {'writable' if mask == 0o022 else 'reachable'} by group/other (mode {mode:04o}{must})"
    return None


def private_problem(st: os.stat_result, uid: int) -> str | None:
    """Why a directory with status ``st`` cannot be a private runtime directory of ``uid`` (None when it can)."""
    return owned_problem(st, uid, stat.S_ISDIR, "is not a directory", 0o077, ", must be 0700")


def _open_private(parent_fd: int, parent: Path, name: str, uid: int, per_prefix: bool) -> int:
    """Create ``name`` (0700) under ``parent_fd`` if missing, open it without following a symlink, check it.

    ``per_prefix``: ``name`` is the prefix's own directory, so another prefix is a way out; the
    ``chestnut-<uid>`` directory above it is shared by every prefix, and its fix never suggests one."""
    path = parent / name
    other = f", or choose another {PREFIX_ENV}" if per_prefix else ""
    try:
        os.mkdir(name, PRIVATE_MODE, dir_fd=parent_fd)
    except FileExistsError:
        pass
    except OSError as e:
        raise RuntimeDirError(path, f"cannot be created ({e.strerror})", f"check the permissions of {parent}") from None
    else:
        for made in _MADE_IN_BLOCKS:
            made.append(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    except OSError as e:
        try:
            st = os.lstat(name, dir_fd=parent_fd)
        except OSError:
            raise RuntimeDirError(path, f"cannot be opened ({e.strerror})", "start again") from None
        if stat.S_ISLNK(st.st_mode):
            raise RuntimeDirError(path, "is a symlink", f"remove it (rm {path}) and start again") from None
        problem = private_problem(st, uid) or f"cannot be opened ({e.strerror})"
        raise RuntimeDirError(path, problem, f"remove it (rm -r {path}) and start again{other}") from None
    found = private_problem(os.fstat(fd), uid)
    if found is not None:
        os.close(fd)
        raise RuntimeDirError(
            path,
            found,
            f"it is not ours to repair: remove it (rm -r {path}) and start again{other}",
        )
    return fd


_MADE_IN_BLOCKS: list[list[Path]] = []
"""One list per :func:`made_dirs_removed` block running now: the directories :func:`runtime_dir` created in it."""


@contextlib.contextmanager
def made_dirs_removed() -> Iterator[None]:
    """For a command that only visits a stack (``chestnut dump``, ``top``, ``probe``, a twin client: it reads locks,
    connects to sockets and owns nothing there): the runtime directories :func:`runtime_dir` creates inside the
    block are removed at its end, the prefix's before ``chestnut-<uid>``, each only while empty (``rmdir``: a
    directory another program has put something in since, a publisher's lock file or socket, stays). A directory
    that was there before is never touched. They are created all the same while the block runs: the checks of this
    module's docstring stand while it connects, and no other user can make them first."""
    made: list[Path] = []
    _MADE_IN_BLOCKS.append(made)
    try:
        yield
    finally:
        del _MADE_IN_BLOCKS[next(i for i, m in enumerate(_MADE_IN_BLOCKS) if m is made)]
        for path in reversed(made):
            with contextlib.suppress(OSError):  # not empty, or gone already: not ours to remove now
                os.rmdir(path)


def check_socket_room(path: Path) -> None:
    """Refuse (:class:`RuntimeDirError`) a runtime directory ``path`` whose longest socket path,
    ``<path>/<LONGEST_SOCKET_NAME>``, is over :data:`SUN_PATH_MAX` bytes: a bind or connect there fails (libzmq's
    ``ipc_address_t::resolve`` with ``ENAMETOOLONG``, Python's ``AF_UNIX path too long``), so every program stops
    here, before it creates a directory or starts anything. The fix names the longest prefix that fits.
    :data:`PREFIX_MAX` (48) fits any base ``/run/user/<uid>``: ``/run/user/4294967295/chestnut-4294967295/`` is 41
    bytes, the longest socket name 16 (``cameraFrame.vipc``)."""
    longest = os.fsencode(path / LONGEST_SOCKET_NAME)
    over = len(longest) - SUN_PATH_MAX
    if over <= 0:
        return
    room = len(os.fsencode(path.name)) - over
    fix = (f"use a {PREFIX_ENV} of at most {room} characters, or " if room >= 1 else "") + (
        f"point {' / '.join(BASE_ENVS)} at a shorter directory")
    raise RuntimeDirError(
        path,
        f"is too long for the stack's sockets: {os.fsdecode(longest)} is {len(longest)} bytes, over the "
        f"{SUN_PATH_MAX} a Unix socket path holds (sun_path is 108 bytes with its NUL: unix(7))",
        fix,
    )


def runtime_dir(prefix: str | None = None) -> Path:
    """Create (if needed), check and return the private runtime directory ``<base>/chestnut-<uid>/<prefix>``.

    Raises :class:`PrefixError` (a ``ValueError``) for a malformed prefix and :class:`RuntimeDirError`
    (a ``PermissionError``) for a base, a folder above it (:func:`changeable_folder`, naming the base and that
    folder) or a directory that breaks the rules of this module's docstring, or one too
    long for the stack's sockets (:func:`check_socket_room`, checked first: nothing is created then).
    """
    prefix = current_prefix() if prefix is None else check_prefix(prefix)
    uid = os.getuid()
    base = runtime_base()
    check_socket_room(base / f"chestnut-{uid}" / prefix)
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise RuntimeDirError(
            base,
            f"cannot be opened ({e.strerror})",
            f"create it, or unset {' / '.join(BASE_ENVS)} to use {tempfile.gettempdir()}",
        ) from None
    fds = [base_fd]
    try:
        try:
            above = changeable_folder(Path(os.path.realpath(base)).parent, uid)
        except OSError as e:
            above = (Path(e.filename), f"cannot be examined ({e.strerror})")
        if above is not None:
            raise RuntimeDirError(
                base,
                f"is under {above[0]}, which {above[1]}",
                f"point {' / '.join(BASE_ENVS)} at a directory whose folders only you (or root) can change",
            )
        problem = base_problem(os.fstat(base_fd), uid)
        if problem is not None:
            raise RuntimeDirError(base, problem, f"point {' / '.join(BASE_ENVS)} at a directory of yours")
        user_dir = base / f"chestnut-{uid}"
        fds.append(_open_private(base_fd, base, user_dir.name, uid, per_prefix=False))
        fds.append(_open_private(fds[-1], user_dir, prefix, uid, per_prefix=True))
    finally:
        for fd in fds:
            os.close(fd)
    return user_dir / prefix


PROC_LOCKS = "/proc/locks"
PROC_LOCKS_MAX_BYTES = 1 << 20
"""Bound (bytes) on one read of ``/proc/locks``: one line (~60 bytes) per lock held on the system, so ~17 000 locks."""


def flock_holders(path: str | os.PathLike[str], proc_locks: str | os.PathLike[str] = PROC_LOCKS) -> list[int]:
    """The pids holding a ``flock`` on the file at ``path`` (not followed), as ``/proc/locks`` lists them (proc(5):
    ``1: FLOCK  ADVISORY  WRITE 12345 08:01:1234 0 EOF``, the device as major:minor in hex and the inode), its
    first :data:`PROC_LOCKS_MAX_BYTES` bytes read; empty when either cannot be read."""
    try:
        st = os.lstat(path)
        with open(proc_locks, "rb") as f:
            table = f.read(PROC_LOCKS_MAX_BYTES).decode("ascii", "replace")
    except OSError:
        return []
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in table.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == inode and parts[4].isdigit():
            pids.append(int(parts[4]))
    return pids
