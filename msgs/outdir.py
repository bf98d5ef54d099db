"""Private output directories and the files written into them (reports, logs, exports, the model cache).

What the stack writes may hold camera frames and a dock's identity, so no other user may read it, and
no one may make us write through a planted symlink:

- :func:`private_dir` creates a missing directory 0700 (missing parents too) and accepts an existing one
  only if it is a real directory (not a symlink), ours, and not writable by group/other; it is opened
  with ``O_NOFOLLOW | O_DIRECTORY`` and checked with ``fstat`` on that descriptor, the same rules as the
  runtime directory (``msgs/paths.py``), except that an existing directory may be readable by others
  (its files are 0600 all the same).
- :func:`check_folders_above` is the rule for every folder above an output directory (checked by
  :func:`private_dir` before it creates anything): each must belong to us or root and not be writable by
  group/other unless it has the sticky bit, like ``/tmp`` (1777) -- the rule of the runtime directory's
  base and the folders above it (``msgs/paths.py`` ``changeable_folder``, which walks them) and of the
  compile cache's ancestors. In a folder others may write without the sticky bit, another user could rename
  or replace what we create in it.
- :func:`new_private_dir` creates a fresh directory (a run's own), never an existing one: a name taken by
  a directory of ours gets a ``-2``, ``-3`` ... suffix, a planted symlink or a foreign entry is refused.
- :func:`write_private` writes a 0600 temp file beside the target (``O_CREAT | O_EXCL | O_NOFOLLOW``,
  relative to the directory's descriptor) and renames it over the target, so a reader never sees half a
  file; a target that is a symlink (or not a regular file) is refused, never followed or replaced.
  :func:`write_private_files` does so for files that belong together, renamed only once all are written.
- :func:`open_private` opens a 0600 file for appending or exclusive creation the same way (a log that
  a child process writes to).

Every refusal is an :class:`OutputDirError` whose ``str()`` is one line: what, which path, how to fix.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Literal

from chestnut.msgs.paths import changeable_folder, owned_problem

DIR_MODE = 0o700
FILE_MODE = 0o600


class OutputDirError(PermissionError):
    """An output directory or file the stack must not write. ``str()`` is one line; ``path`` is the culprit,
    ``problem`` what is wrong with it and ``fix`` the advice (the line's parts, for a caller with its own)."""

    def __init__(self, path: str | os.PathLike[str], problem: str, fix: str) -> None:
        super().__init__(f"{path} {problem}; {fix}")
        self.path = Path(path)
        self.problem, self.fix = problem, fix


class OutputExistsError(OutputDirError, FileExistsError):
    """:func:`open_private` ``"xb"`` found the file already there (it is never overwritten)."""


def dir_problem(st: os.stat_result, uid: int) -> str | None:
    """Why a directory with status ``st`` cannot take our output (None when it can): ``uid``'s, no group/other
    write."""
    return owned_problem(st, uid, stat.S_ISDIR, "is not a directory", 0o022)


def _open_dir(path: Path) -> int:
    """Open ``path`` as a directory without following a final symlink, and check it (see the module doc)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        try:
            st = os.lstat(path)
        except OSError:
            raise OutputDirError(path, f"cannot be opened ({e.strerror})", "give another directory") from None
        if stat.S_ISLNK(st.st_mode):
            raise OutputDirError(path, "is a symlink", "give the real directory or a new path") from None
        raise OutputDirError(
            path, dir_problem(st, os.getuid()) or f"cannot be opened ({e.strerror})", "give another directory"
        ) from None
    problem = dir_problem(os.fstat(fd), os.getuid())
    if problem is not None:
        os.close(fd)
        raise OutputDirError(path, problem, "give a directory of yours (or a new path: it is created 0700)")
    return fd


def check_folders_above(path: str | os.PathLike[str]) -> None:
    """Refuse an output directory ``path`` (existing or about to be created) in a folder another user could
    change: its real parent and every folder above that which exists must belong to this user or root and
    must not be writable by group/other unless sticky (``/tmp``, 1777, is fine: no one else can rename or
    remove what we make in it). ``path`` itself is not checked here (see :func:`private_dir`).

    Raises :class:`OutputDirError` naming the first such folder, from ``/`` down; it never creates,
    changes or follows anything at ``path``."""
    p = Path(path)
    try:
        holder = p.absolute().parent.resolve()  # "a/.." resolves below its lexical parent: a superset is checked
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        why = getattr(e, "strerror", None) or e
        raise OutputDirError(p, f"cannot be resolved ({why})", "give another path") from None
    try:  # a folder that does not exist ends the walk: private_dir creates it and those below it 0700
        found = changeable_folder(holder, os.getuid())
    except OSError as e:
        raise OutputDirError(e.filename, f"cannot be examined ({e.strerror})", "give another path") from None
    if found is not None:
        folder, problem = found
        raise OutputDirError(
            folder, f"(above {p}) {problem}", "give a path whose folders only you (or root) can change"
        )


def missing_folder(path: str | os.PathLike[str]) -> str | None:
    """The one line refusing an output ``path`` (a file, or a directory made for it) given on a command line whose
    folder does not exist: ``"<path>: folder <folder> does not exist; create it or give another path"``; None
    when it exists (whatever it is: :func:`private_dir` judges it). Every command checks its outputs with it
    before it makes anything, so a typo never makes a tree of folders (``/nonexist/`` at the root, as root);
    only :func:`private_dir`'s own callers inside a folder they made create folders below it."""
    folder = Path(path).parent
    if os.path.lexists(folder):
        return None
    return f"{path}: folder {folder} does not exist; create it or give another path"


def file_target_problem(path: Path) -> str | None:
    """Why a file the user named on the command line (``launch --json FILE``, ``probe --record-fingerprint OUT``)
    cannot be written (checked before the work, so none is lost to a typo), or None: its folder must exist (it is
    not created: :func:`missing_folder`'s line) and be one of ours that no one else can write to, not a symlink
    (:func:`private_dir`: a world-writable folder such as ``/tmp`` would let another user swap the file), and
    ``path`` must not be a symlink (never followed) or anything but a regular file; a path the OS refuses to look
    up (a name over 255 bytes) is named with its reason. Write it with :func:`write_private`, which refuses the
    same again at the write."""
    if (missing := missing_folder(path)) is not None:
        return missing
    try:
        private_dir(path.parent)  # it exists: only checked, never created or changed
    except OutputDirError as e:
        return f"{path}: folder {e.path} {e.problem}; give a folder of yours that no one else can write to"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # ENAMETOOLONG
        return f"{path} cannot be written ({e.strerror or e}); give another path"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink: remove it (rm {path}) or give another path"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} exists and is not a regular file; give another path"
    return None


def private_dir(path: str | os.PathLike[str], targets: Iterable[str] = ()) -> Path:
    """Create ``path`` (0700, with any missing parents) or accept it if it is fit; returns it as a ``Path``.

    ``targets``: names of files about to be written there, each refused if it is a symlink or not a
    regular file (so a report fails before its first file, not halfway). Raises :class:`OutputDirError`
    for a symlink, a non-directory, a directory of another user or one writable by group/other, one in a
    folder another user could change (:func:`check_folders_above`, checked before anything is created), or
    one that cannot be created (the reason, e.g. "permission denied")."""
    p = Path(path)
    check_folders_above(p)
    try:
        missing = [d for d in (p, *p.parents) if not os.path.lexists(d)]
        for d in reversed(missing):  # os.makedirs gives only the last one the mode
            os.mkdir(d, DIR_MODE)
    except FileExistsError:
        pass  # created meanwhile, or a dangling symlink: _open_dir says which
    except OSError as e:
        raise OutputDirError(
            p, f"cannot be created ({(e.strerror or str(e)).lower()})", "give another directory"
        ) from None
    dfd = _open_dir(p)
    try:
        for name in targets:
            _check_target(dfd, p / name)
    finally:
        os.close(dfd)
    return p


def new_private_dir(parent: str | os.PathLike[str], name: str, max_tries: int = 100) -> Path:
    """Create a fresh directory ``parent/name`` (0700), or ``name-2``, ``name-3`` ... while the name is taken by
    a directory of ours (another run in the same second); returns its path. Never reuses an existing entry.

    ``parent`` must pass :func:`private_dir` (created if missing). The directory is made with ``mkdir``
    relative to ``parent``'s descriptor (``mkdir`` never follows a symlink at its own name), then opened
    ``O_NOFOLLOW | O_DIRECTORY`` and checked with ``fstat``. Raises :class:`OutputDirError` for a symlink, a
    non-directory or a directory of another user at the name (planted: refused, never followed), or when
    ``max_tries`` names are all taken."""
    p = private_dir(parent)
    dfd = _open_dir(p)
    try:
        for i in range(max_tries):
            cand = name if i == 0 else f"{name}-{i + 1}"
            try:
                os.mkdir(cand, DIR_MODE, dir_fd=dfd)
            except FileExistsError:
                st = os.lstat(cand, dir_fd=dfd)
                if stat.S_ISLNK(st.st_mode):
                    raise OutputDirError(
                        p / cand, "is a symlink (never followed)", f"remove it (rm {p / cand}) and start again"
                    ) from None
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                    raise OutputDirError(
                        p / cand, dir_problem(st, os.getuid()) or "is not ours", "remove it or give another folder"
                    ) from None
                continue  # a directory of ours: taken, try the next name
            except OSError as e:
                raise OutputDirError(
                    p / cand, f"cannot be created ({(e.strerror or str(e)).lower()})", "give another folder"
                ) from None
            fd = os.open(cand, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                problem = dir_problem(os.fstat(fd), os.getuid())
            finally:
                os.close(fd)
            if problem is not None:  # replaced between mkdir and open
                raise OutputDirError(p / cand, problem, "remove it and start again")
            return p / cand
    finally:
        os.close(dfd)
    raise OutputDirError(p / name, f"and {max_tries - 1} suffixed names are all taken", "remove old ones")


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)
"""What a non-regular ``st_mode`` is, in words: ``msgs/video.py`` ``file_kind``'s, which this module cannot import
(``msgs/video.py`` imports it: no import cycles, ``tests/importgraph.py``)."""


def os_reason(e: OSError) -> str:
    """The OS's words for ``e``, lower case, as a one-line refusal quotes them: "file name too long"
    (``ENAMETOOLONG``), "not a directory" (``ENOTDIR``: a path through a regular file), "too many levels of
    symbolic links" (``ELOOP``) -- ``strerror(3)``; ``str(e)`` when it carries none."""
    return (e.strerror or str(e)).lower()


def _check_target(dfd: int, path: Path, named: bool = False) -> None:
    """Refuse ``path`` (a file about to be written in the directory ``dfd``) unless it is missing or a regular
    file. ``named``: the path is one the user gave as the file to write (``export --mcap OUT``), so the advice is
    another file path (for a directory: a file path inside it); else the name is ours, in a directory the user
    gave, and the advice is another directory. Never "remove it" for what is not a symlink: a directory or a
    device there is the user's (or the system's), never ours to have deleted."""
    try:
        st = os.lstat(path.name, dir_fd=dfd)
    except FileNotFoundError:
        return
    except OSError as e:  # ENAMETOOLONG: a name over NAME_MAX (255 bytes on Linux)
        raise OutputDirError(path, f"cannot be examined ({os_reason(e)})", "give another path") from None
    if stat.S_ISLNK(st.st_mode):
        raise OutputDirError(path, "is a symlink",
                             f"remove it (rm {path}) or give another {'path' if named else 'directory'}")
    if stat.S_ISREG(st.st_mode):
        return
    kind = next((words for test, words in _KINDS if test(st.st_mode)), "not a file")
    if not named:
        raise OutputDirError(path, f"is {kind}, not a regular file", "give another directory")
    if stat.S_ISDIR(st.st_mode):
        raise OutputDirError(path, "is a directory, not a file",
                             f"give a file path inside it ({path}/NAME) or another file path")
    raise OutputDirError(path, f"is {kind}, not a regular file", "give another file path")


def write_private(path: str | os.PathLike[str], data: bytes | str) -> Path:
    """Write ``data`` (``str`` as UTF-8) to ``path`` (mode 0600) by temp file + rename; returns ``path``.

    The parent directory must pass :func:`private_dir` (it is created if missing). Raises
    :class:`OutputDirError` (see the module doc; also for a write that fails, e.g. a full disk)."""
    return write_private_files([(path, data)])[0]


def write_private_files(files: Sequence[tuple[str | os.PathLike[str], bytes | str]]) -> list[Path]:
    """Write files of one folder as one: each ``(path, data)`` first to a 0600 temporary beside it
    (``.<name>.<pid>.tmp``, ``O_EXCL | O_NOFOLLOW`` through the folder's descriptor), and only when every one is
    complete renamed into place, in the order given (the file whose presence says "complete" goes last). A
    failure or an interruption (Ctrl-C) before then removes every temporary not yet renamed, so each path holds
    what it held or its complete new file, never part of one. Returns the paths. Raises :class:`OutputDirError`
    (:func:`write_private`'s lines) and ``ValueError`` for paths in more than one folder."""
    items = [(Path(p), d.encode() if isinstance(d, str) else d) for p, d in files]
    if len({p.parent for p, _ in items}) != 1:
        raise ValueError(f"write_private_files: {len(items)} files, not all in one folder")
    parent = private_dir(items[0][0].parent)
    dfd = _open_dir(parent)
    pending: list[str] = []  # temporaries made and not yet renamed into place
    try:
        for p, _ in items:
            _check_target(dfd, p)
        for p, raw in items:
            tmp = f".{p.name}.{os.getpid()}.tmp"
            try:
                fd = os.open(
                    tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=dfd
                )
            except OSError as e:
                raise OutputDirError(
                    parent / tmp, f"cannot be created ({e.strerror})", "remove it or give another directory"
                ) from None
            pending.append(tmp)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(raw)
            except OSError as e:
                raise OutputDirError(p, f"cannot be written ({e.strerror})", "free space or give another directory") \
                    from None
        for p, _ in items:
            try:
                os.replace(pending[0], p.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError as e:
                raise OutputDirError(p, f"cannot be written ({e.strerror})", "free space or give another directory") \
                    from None
            pending.pop(0)
    finally:
        for tmp in pending:  # an error or an interruption (KeyboardInterrupt) before every file was in place
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
        os.close(dfd)
    return [p for p, _ in items]


def open_private(path: str | os.PathLike[str], mode: Literal["ab", "xb"] = "ab") -> IO[bytes]:
    """Open ``path`` for appending (``"ab"``) or exclusive creation (``"xb"``), mode 0600 when created.

    Raises :class:`OutputDirError` for an unfit directory or a symlinked or non-regular target, and
    :class:`OutputExistsError` (also a ``FileExistsError``) when ``"xb"`` finds the file there. Every line is about
    the file ``path``, a path the caller was given as the file to write (``export --mcap OUT``): an unfit folder
    of its own is named as the file's folder ("``/tmp/x.mcap`` is in folder ``/tmp``, which is writable by
    group/other (mode 1777); give a file path in a folder of yours"), a directory at ``path`` asks for a file path
    inside it, a device or FIFO for another file path."""
    p = Path(path)
    try:
        parent = private_dir(p.parent)
    except OutputDirError as e:
        if e.path != p.parent:  # a folder above it: that line names the folder already
            raise
        # the file's own folder is what is unfit: said of the file the caller named, with a file's advice
        fix = "give a file path in the real folder" if e.problem == "is a symlink" else \
            "give a file path in a folder of yours"
        raise OutputDirError(p, f"is in folder {p.parent}, which {e.problem}", fix) from None
    dfd = _open_dir(parent)
    try:
        _check_target(dfd, p, named=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        flags |= os.O_APPEND if mode == "ab" else os.O_EXCL
        try:
            fd = os.open(p.name, flags, FILE_MODE, dir_fd=dfd)
        except FileExistsError:
            raise OutputExistsError(p, "already exists", f"remove it (rm {p}) or give another path") from None
        except OSError as e:
            raise OutputDirError(p, f"cannot be opened ({e.strerror})", "give another path") from None
    finally:
        os.close(dfd)
    return os.fdopen(fd, mode)


__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "OutputDirError",
    "OutputExistsError",
    "check_folders_above",
    "dir_problem",
    "file_target_problem",
    "new_private_dir",
    "open_private",
    "os_reason",
    "private_dir",
    "write_private",
]
