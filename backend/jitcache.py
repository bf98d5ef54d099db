"""The compile cache: captured tinygrad JITs, pickled per machine, model, shape, device and version.

The first call of a real model costs tens of seconds in tinygrad (graph planning and kernel
compiles); a pickled captured ``TinyJit`` loads in about a second. An entry's key is the sha256 of
everything that makes a capture valid: the model bytes' sha256, the input specs, the tinygrad
device, the tinygrad version and this machine (CPU model, architecture, Python, clang).

Unpickling runs code, so nothing is unpickled that this user did not write:

- **Ownership and modes first** (the rule OpenSSH's ``StrictModes`` applies to keys): every
  ancestor of the cache directory belongs to this user or root and is not writable by group/other
  unless sticky; the cache directory and every file read from it belong to this user and are not
  writable by group/other; the key file is not even readable by them. Files are opened
  ``O_NOFOLLOW`` relative to the directory's descriptor (a symlink is refused), must be regular
  files, and are read up to a bound (:data:`MAX_PICKLE_BYTES`, :data:`MAX_META_BYTES`).
- **An HMAC before the pickle.** ``<digest>.json`` carries the metadata (the key's fields, the
  pickle's sha256, the output digest ...) and ``hmac``, an HMAC-SHA256 of that metadata keyed by
  ``hmac.key``: 32 random bytes, created 0600 beside the entries. Whoever can write an entry but
  cannot read the key cannot forge one. The pickle's sha256 is compared only after the MAC matched,
  and ``pickle.loads`` runs only after both.
- **A bad key is the key's problem** (:class:`KeyProblem`), never an entry's: no entry is discarded or trusted
  for it, and every process that meets it says one line naming the key, what is wrong and the fix, and compiles
  without the cache. A damaged key of ours (a regular file of this user, 0600, of the wrong size) is replaced
  by a new one when a model is next cached (its entries then fail the HMAC and are compiled again); a key of
  another mode or owner, a symlink or not a regular file is neither used nor replaced: another user may have read
  or written it, so the user decides (``chmod 600``, or remove it).
- **Created private, written atomically**: the directory 0700, files 0600 (``O_CREAT | O_EXCL``,
  then ``fsync`` and ``rename``; the metadata last, so a half-written entry never verifies).

Anything refused is logged in one line (which file, why) and rebuilt; a loaded JIT must still
reproduce, bit for bit, the output digest recorded when it was built (``backend/model.py``).
``chestnut model prepare`` makes the same checks short of unpickling for the prepared model's entry
(:meth:`JitCache.refusal`) and prepares a refused one again (``launch/assets.py``).

tinygrad's own disk cache (tinygrad 0.14 ``helpers.py``: ``CACHEDB``, default
``$XDG_CACHE_HOME/tinygrad/cache.db``, an sqlite file whose values ``diskcache_get`` unpickles as they are:
compiled kernels, beam results) is kept to the same ownership rule: :func:`private_tinygrad_cache` points it
at ``tinygrad/cache.db`` beside the project's cache, a directory created 0700 and checked like the cache
directory above, its files checked like an entry's and kept 0600 (``cache.db`` is created so before tinygrad
opens it; sqlite gives its journal files the database's mode); where that is refused, tinygrad's disk cache is turned
off (``CACHELEVEL=0``; the project's signed cache still holds the captured JITs). Every process that runs
tinygrad code calls it before tinygrad's first compile (``backend/model.py`` ``ensure_cpu_device`` for the
fallback and the CPU runner, the runners' environments for the worker). A database sqlite calls damaged
(``SQLITE_NOTADB``, ``SQLITE_CORRUPT``: garbage bytes, a torn write) is a cache's damage, not the model's: it is
moved aside with sqlite's files beside it (``cache.db.corrupt-<UTC time>``, kept for a look) and tinygrad compiles
into a fresh one, said in one line -- when this call finds it, or when tinygrad meets it while it compiles
(:func:`damaged_tinygrad_cache`, ``backend/model.py`` ``OnnxModel``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import pickle
import platform
import shutil
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from chestnut.msgs.paths import changeable_folder

log = logging.getLogger("chestnut.jitcache")


def default_cache_dir() -> Path:
    """``$CHESTNUT_CACHE/jit`` or ``~/.cache/chestnut/jit``."""
    return Path(os.environ.get("CHESTNUT_CACHE") or Path.home() / ".cache" / "chestnut") / "jit"


TINYGRAD_CACHE_FILES = ("cache.db", "cache.db-wal", "cache.db-shm", "cache.db-journal")  # sqlite's files


def tinygrad_cache_dir() -> Path:
    """``$CHESTNUT_CACHE/tinygrad`` or ``~/.cache/chestnut/tinygrad``: where tinygrad's disk cache is kept."""
    return Path(os.environ.get("CHESTNUT_CACHE") or Path.home() / ".cache" / "chestnut") / "tinygrad"


def _tinygrad_cache_off(environ: MutableMapping[str, str], why: str) -> None:
    log.warning("tinygrad's disk cache is off (CACHELEVEL=0): %s", why)
    environ["CACHELEVEL"] = "0"
    helpers = sys.modules.get("tinygrad.helpers")
    if helpers is not None:
        helpers.CACHELEVEL.value = 0


def _chmod_private(dir_fd: int, name: str) -> None:
    """Make ``name`` (in the directory ``dir_fd``, never through a symlink) mode 0600."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _create_private(dir_fd: int, name: str) -> None:
    """Create ``name`` (in the directory ``dir_fd``) empty and mode 0600 unless it exists: an empty file is an
    empty sqlite database, so tinygrad opens this one instead of creating its own with the umask's mode."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except FileExistsError:
        return
    os.close(fd)


SQLITE_DAMAGE = (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT)
"""sqlite's primary result codes of a damaged database (https://sqlite.org/rescode.html: "file is not a database",
"database disk image is malformed"); a busy, locked or read-only database is none."""


def sqlite_damage(e: BaseException | None) -> str | None:
    """sqlite's own words when ``e``, or an exception it was raised from, is sqlite's report of a damaged database
    (:data:`SQLITE_DAMAGE`; ``sqlite_errorcode`` is the extended code, its low byte the primary one); else None."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, sqlite3.DatabaseError) and (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF in SQLITE_DAMAGE:
            return str(e)
        e = e.__cause__ or e.__context__
    return None


def _db_damage(db: Path) -> str | None:
    """sqlite's words if the database ``db`` is damaged (:func:`sqlite_damage`), read-only: its schema, the first
    thing tinygrad's ``diskcache_get`` reads through; None when it reads (or fails for another reason, which
    tinygrad meets and reports itself)."""
    try:
        con = sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)
        try:
            con.execute("SELECT count(*) FROM sqlite_master").fetchone()
        finally:
            con.close()
    except sqlite3.Error as e:
        return sqlite_damage(e)
    return None


def _checked_files(dir_fd: int, root: Path) -> list[tuple[str, os.stat_result]]:
    """(name, ``lstat``) of each of :data:`TINYGRAD_CACHE_FILES` in the directory ``dir_fd`` (``root``) that exists,
    once every one is a regular file of this user that others cannot write; raises :class:`CacheRefused` naming the
    first that is not (a symlink included), OSError if one cannot be stat'ed."""
    found = []
    for name in TINYGRAD_CACHE_FILES:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise CacheRefused(f"{root / name} is a symlink")
        _check_file(root / name, st, private=False)
        found.append((name, st))
    return found


def _set_aside(root: Path, why: str) -> str:
    """Move tinygrad's damaged database in ``root`` (checked as :func:`private_tinygrad_cache` checks it) and
    sqlite's files beside it to ``<name>.corrupt-<UTC time>`` in the same directory (nothing is removed; only
    files of this user are renamed) and create a fresh empty ``cache.db`` 0600. ``why``: sqlite's words. Returns the
    line that says so; raises :class:`CacheRefused` or OSError (then nothing was renamed, or not every file)."""
    stamp = time.strftime("%Y-%m-%d--%H-%M-%S", time.gmtime())  # the run directories' format (launch/rundir.py)
    real = Path(os.path.realpath(root))
    fd = JitCache(root)._open_root(create=False)
    try:
        for name, _ in _checked_files(fd, root):
            os.rename(name, f"{name}.corrupt-{stamp}", src_dir_fd=fd, dst_dir_fd=fd)
        _create_private(fd, TINYGRAD_CACHE_FILES[0])
    finally:
        os.close(fd)
    db = real / TINYGRAD_CACHE_FILES[0]
    return f"tinygrad's disk cache {db} is damaged ({why}); moved it aside to {db}.corrupt-{stamp} and compiling afresh"


def damaged_tinygrad_cache(e: BaseException) -> str | None:
    """When ``e`` (or an exception it was raised from) is sqlite's report that tinygrad's disk cache is damaged
    (:func:`sqlite_damage`), what tinygrad met while it compiled: the one line saying so, after tinygrad's
    connection to the database is closed (``helpers._db_connection``, opened again by the next ``db_connection``)
    and the database moved aside (:func:`_set_aside`), so the next compile in this process starts a fresh one.
    A database that is not this user's private one (:func:`tinygrad_cache_dir`), or one that cannot be moved, is
    left where it is and tinygrad's disk cache turned off (``CACHELEVEL=0``) instead. None for any other error
    (nothing is done then)."""
    why = sqlite_damage(e)
    helpers = sys.modules.get("tinygrad.helpers")
    if why is None or helpers is None:
        return None
    conn = getattr(helpers, "_db_connection")  # noqa: B009 - a module attribute mypy cannot see
    setattr(helpers, "_db_connection", None)  # noqa: B010
    getattr(helpers, "_db_tables").clear()  # noqa: B009 - the tables tinygrad created in that database
    if conn is not None:
        conn.close()
    root = tinygrad_cache_dir()
    db = os.path.realpath(getattr(helpers, "CACHEDB"))  # noqa: B009
    try:
        if db != str(Path(os.path.realpath(root)) / TINYGRAD_CACHE_FILES[0]):
            raise CacheRefused(f"it is not the private one in {root}")
        return _set_aside(root, why)
    except (CacheRefused, OSError) as refused:
        os.environ["CACHELEVEL"] = "0"
        getattr(helpers, "CACHELEVEL").value = 0  # noqa: B009
        return (f"tinygrad's disk cache {db} is damaged ({why}) and stays where it is ({refused}); compiling "
                f"without it (CACHELEVEL=0)")


def private_tinygrad_cache(root: Path | None = None, environ: MutableMapping[str, str] | None = None) -> Path | None:
    """Point tinygrad 0.14's disk cache (``helpers.CACHEDB``, read by ``db_connection`` when it first opens the
    database; ``CACHEDB`` in the environment for processes tinygrad starts) at ``root/cache.db`` (default
    :func:`tinygrad_cache_dir`), after creating ``root`` 0700 and checking it: every ancestor this user's or
    root's and not writable by others unless sticky, ``root`` this user's and not writable by others, each of
    :data:`TINYGRAD_CACHE_FILES` that exists a regular file (no symlink) of this user not writable by others,
    made 0600 if others could read it. ``cache.db`` is created empty and 0600 before tinygrad opens it (sqlite
    would create it with the umask's mode, 0644, and its journal files with the database's). Until tinygrad opens
    it in this process, a database sqlite calls damaged (:func:`sqlite_damage`) is moved aside and a fresh one
    made (:func:`_set_aside`), said in one WARNING line.

    Returns the database path, or None when something is refused or tinygrad already opened another database in
    this process: tinygrad's disk cache is then off (``CACHELEVEL=0``), with one line logged saying why.
    Idempotent; never raises for a refused cache.
    """
    environ = os.environ if environ is None else environ
    root = Path(root or tinygrad_cache_dir())
    db = Path(os.path.realpath(root)) / TINYGRAD_CACHE_FILES[0]
    try:
        fd = JitCache(root)._open_root(create=True)
    except (CacheRefused, OSError) as e:
        _tinygrad_cache_off(environ, str(e).replace("the cache directory", "tinygrad's cache directory"))
        return None
    try:
        for name, st in _checked_files(fd, root):
            if stat.S_IMODE(st.st_mode) & 0o077:  # ours, readable by others (made before it was created 0600)
                _chmod_private(fd, name)
        _create_private(fd, TINYGRAD_CACHE_FILES[0])  # sqlite gives its -wal, -shm, -journal the database's mode
    except (CacheRefused, OSError) as e:
        _tinygrad_cache_off(environ, str(e))
        return None
    finally:
        os.close(fd)
    helpers = sys.modules.get("tinygrad.helpers")
    if (helpers is None or getattr(helpers, "_db_connection") is None) and (why := _db_damage(db)):  # noqa: B009
        try:
            log.warning("%s", _set_aside(root, why))
        except (CacheRefused, OSError) as e:
            _tinygrad_cache_off(environ, f"{db} is damaged ({why}) and cannot be moved aside: {e}")
            return None
    environ["CACHEDB"] = str(db)
    if helpers is not None:
        opened = getattr(helpers, "CACHEDB")  # noqa: B009 - a module attribute mypy cannot see
        if getattr(helpers, "_db_connection") is not None and os.path.realpath(opened) != str(db):  # noqa: B009
            _tinygrad_cache_off(environ, f"tinygrad already opened {opened} in this process")
            return None
        setattr(helpers, "CACHEDB", str(db))  # noqa: B010
    return db


@cache
def machine_fingerprint() -> dict[str, str]:
    """What about this machine makes a compiled kernel valid: CPU model, arch, Python, clang version."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                cpu += line.split(":", 1)[1].strip() + "|"
    except OSError:
        cpu = platform.processor()
    clang = ""
    if exe := shutil.which("clang"):
        try:
            clang = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout.splitlines()[
                0
            ]
        except (OSError, subprocess.SubprocessError, IndexError):
            clang = "unknown"
    return {
        "cpu": hashlib.sha256(cpu.encode()).hexdigest()[:16],
        "arch": platform.machine(),
        "python": platform.python_version(),
        "clang": clang,
    }


@dataclass(frozen=True)
class CacheKey:
    model_sha256: str
    inputs: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype)
    device: str
    tinygrad_version: str

    def fields(self) -> dict[str, Any]:
        return {
            "model_sha256": self.model_sha256,
            "inputs": [list(map(str, (n, list(s), d))) for n, s, d in self.inputs],
            "device": self.device,
            "tinygrad_version": self.tinygrad_version,
            "machine": machine_fingerprint(),
        }

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.fields(), sort_keys=True).encode()).hexdigest()[:32]


KEY_NAME = "hmac.key"
KEY_BYTES = 32  # HMAC-SHA256 key length (RFC 2104: at least the hash's output length)
MAX_PICKLE_BYTES = 1 << 30  # largest pickle read (bytes); the PP-OCRv4 detector's is ~10 MB
MAX_META_BYTES = 1 << 20  # largest metadata file read (bytes)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class CacheRefused(Exception):
    """A cache file or directory that must not be trusted; ``str()`` says which and why."""


class _OtherKey(CacheRefused):
    """An entry whose HMAC checks, built for another key than the one it was looked up under."""


CACHE_OFF = "the compile cache is off (models are compiled, not cached; its entries are kept)"


class KeyProblem(CacheRefused):
    """``hmac.key`` itself cannot be used: the key's problem, never an entry's (no entry is discarded or trusted
    for it). ``str()`` is the one line naming the key file, what is wrong and the fix. ``damaged``: a regular file
    of this user that others cannot read or write, of the wrong size -- ours, damaged (a truncation, ``: >``), so
    :meth:`JitCache.store` replaces it by a new key (the entries signed with the old one then fail their HMAC and
    are compiled again); any other problem (mode, owner, symlink, not a regular file, unreadable) is left for the
    user to fix: another user may have read or written that key, so it is neither used nor replaced."""

    def __init__(self, path: Path, what: str, fix: str, damaged: bool = False, ino: int | None = None) -> None:
        super().__init__(f"compile cache key {path} {what}; {fix}")
        self.damaged, self.ino = damaged, ino


def _remove_fix(path: Path) -> str:
    return f"{CACHE_OFF} until you remove {path}: a new key is made, and every compiled entry is compiled again"


_said: set[str] = set()


def say_once(line: str, say: Any = None) -> None:
    """``line`` said once in this process (``say``, default a WARNING of this module's logger): a bad key is
    named by every process that meets it, once, not by every load and store of one process."""
    if line not in _said:
        _said.add(line)
        (say or (lambda text: log.warning("%s", text)))(line)


def meta_mac(key: bytes, meta: dict[str, Any]) -> str:
    """HMAC-SHA256 (hex) of ``meta`` without its ``hmac`` field, as canonical JSON (sorted keys)."""
    body = {k: v for k, v in meta.items() if k != "hmac"}
    return hmac.new(key, json.dumps(body, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def _check_file(path: Path, st: os.stat_result, private: bool) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise CacheRefused(f"{path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise CacheRefused(f"{path} belongs to uid {st.st_uid}, not to uid {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) & (0o077 if private else 0o022):
        who = "readable or writable" if private else "writable"
        raise CacheRefused(f"{path} is {who} by group/other (mode {_mode(st)})")


def _open_cache_file(dir_fd: int, path: Path, name: str) -> int | None:
    """``name`` (``path``) opened for reading relative to ``dir_fd``, never through a symlink; None if it does not
    exist. Raises :class:`CacheRefused` naming ``path``: a symlink, or the OS's reason it cannot be opened."""
    try:
        return os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CacheRefused(f"{path} is a symlink") from None
        raise CacheRefused(f"{path} cannot be opened ({e.strerror})") from None


def _read_bounded(dir_fd: int, root: Path, name: str, limit: int, private: bool = False) -> bytes | None:
    """The bytes of ``root/name`` (opened relative to ``dir_fd``) after the checks; None if it does not exist.
    Raises :class:`CacheRefused` (naming the file and why) for a file that fails a check or cannot be opened or read,
    OSError if it cannot be stat'ed."""
    path = root / name
    fd = _open_cache_file(dir_fd, path, name)
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        _check_file(path, st, private)
        if st.st_size > limit:
            raise CacheRefused(f"{path} holds {st.st_size} bytes, more than the limit of {limit}")
        chunks, left = [], st.st_size + 1  # one byte more: a file that grew since fstat is caught
        try:
            while left > 0 and (chunk := os.read(fd, min(left, 1 << 24))):
                chunks.append(chunk)
                left -= len(chunk)
        except OSError as e:  # EIO from a bad sector: refused like any other damage
            raise CacheRefused(f"{path} cannot be read ({e.strerror or e})") from None
        data = b"".join(chunks)
        if len(data) != st.st_size:
            raise CacheRefused(f"{path} changed while it was read")
        return data
    finally:
        os.close(fd)


def _read_key(dir_fd: int, root: Path) -> bytes | None:
    """The bytes of ``root/hmac.key`` (opened relative to ``dir_fd``, never through a symlink), None if it does
    not exist; raises :class:`KeyProblem` for a key that is not a regular file of this user that group/other
    cannot read or write, that cannot be opened or read, or that does not hold :data:`KEY_BYTES` bytes."""
    path = root / KEY_NAME
    try:
        fd = _open_cache_file(dir_fd, path, KEY_NAME)
    except CacheRefused as e:
        raise KeyProblem(path, str(e)[len(str(path)) + 1:], _remove_fix(path)) from None
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        try:
            _check_file(path, st, private=True)
        except CacheRefused as e:
            what = str(e)[len(str(path)) + 1:]
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():  # ours: the mode only
                raise KeyProblem(path, what, f"{CACHE_OFF} until you run chmod 600 {path}, or remove it if another "
                                             "user may have read or written it (a new key is made, and every compiled "
                                             "entry is compiled again)") from None
            raise KeyProblem(path, what, _remove_fix(path)) from None
        try:
            data = os.read(fd, KEY_BYTES + 1) if st.st_size == KEY_BYTES else b""
        except OSError as e:
            raise KeyProblem(path, f"cannot be read ({e.strerror or e})", _remove_fix(path)) from None
        if st.st_size != KEY_BYTES or len(data) != KEY_BYTES:
            raise KeyProblem(path, f"holds {st.st_size} bytes, not {KEY_BYTES} (damaged)",
                             "a new key replaces it when a model is next cached, and every compiled entry is "
                             "compiled again", damaged=True, ino=st.st_ino)
        return data
    finally:
        os.close(fd)


def _write_temp(dir_fd: int, name: str, data: bytes) -> str:
    """A fresh 0600 temp file under ``dir_fd`` holding ``data``, fsync'ed; its name."""
    tmp = f".{name}.tmp{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.close(fd)
    return tmp


def _write_atomic(dir_fd: int, name: str, data: bytes) -> None:
    """Write ``name`` under ``dir_fd``: a fresh 0600 temp file, fsync, rename over ``name``, fsync the dir."""
    os.replace(_write_temp(dir_fd, name, data), name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


class JitCache:
    """A directory of ``<digest>.pkl`` + ``<digest>.json`` entries and their ``hmac.key`` (see the module docstring).

    :meth:`load` returns None for a missing, refused or stale entry (and logs why, one line);
    :meth:`store` returns None when the directory itself is refused (nothing is written then);
    :meth:`refusal` says why an entry would be refused without loading it (``chestnut model prepare``), and
    :meth:`discard` removes one.
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or default_cache_dir()

    def _open_root(self, create: bool) -> int:
        """An fd of the checked cache directory (created 0700 when ``create``, with any missing folder above it:
        ``mkdir``'s ``parents`` would make those at the default 0755; nothing is made when a folder above it that
        exists is refused: ``msgs/paths.py`` ``changeable_folder``); raises CacheRefused or OSError."""
        real = Path(os.path.realpath(self.root))
        # the folders above it first, before one is made: a refused $CHESTNUT_CACHE (0777) was left with jit/ and
        # tinygrad/ made in it
        if (above := changeable_folder(real.parent, os.geteuid())) is not None:
            raise CacheRefused(f"{above[0]} (above the cache directory) {above[1]}")
        if create:
            for folder in reversed([p for p in (self.root, *self.root.parents) if not p.exists()]):
                folder.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.close(fd)
            raise CacheRefused(f"the cache directory {self.root} belongs to uid {st.st_uid}, not to uid {os.geteuid()}")
        if stat.S_IMODE(st.st_mode) & 0o022:
            os.close(fd)
            raise CacheRefused(f"the cache directory {self.root} is writable by group/other (mode {_mode(st)})")
        return fd

    def _key(self, dir_fd: int, create: bool) -> bytes | None:
        """The cache's HMAC key (:func:`_read_key`), None when there is none and not ``create``. With ``create``, a
        missing key is made (32 random bytes, 0600, linked into place whole: never seen empty) and a damaged key
        of ours (:class:`KeyProblem` ``damaged``) replaced by a new one, said once (:func:`say_once`). Raises
        :class:`KeyProblem` for any other problem of the key, OSError if it cannot be written."""
        try:
            key = _read_key(dir_fd, self.root)
        except KeyProblem as e:
            if not (create and e.damaged):
                raise
            say_once(str(e))
            tmp = _write_temp(dir_fd, KEY_NAME, os.urandom(KEY_BYTES))
            try:
                if os.stat(KEY_NAME, dir_fd=dir_fd, follow_symlinks=False).st_ino == e.ino:  # not replaced since
                    os.replace(tmp, KEY_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                    os.fsync(dir_fd)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dir_fd)
            return _read_key(dir_fd, self.root)
        if key is None and create:
            tmp = _write_temp(dir_fd, KEY_NAME, os.urandom(KEY_BYTES))
            try:
                os.link(tmp, KEY_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # fails if another process made it
                os.fsync(dir_fd)
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp, dir_fd=dir_fd)
            key = _read_key(dir_fd, self.root)
        return key

    def key_problem(self) -> KeyProblem | None:
        """What is wrong with this cache's key (:class:`KeyProblem`), or None: a usable key, no key yet (made when
        a model is first cached), or no cache directory. Nothing is created or replaced; never raises (a refused
        directory is :meth:`refusal`'s to name)."""
        try:
            dir_fd = self._open_root(create=False)
        except (CacheRefused, OSError):
            return None
        try:
            _read_key(dir_fd, self.root)
        except KeyProblem as e:
            return e
        finally:
            os.close(dir_fd)
        return None

    def _entry(self, dir_fd: int, key: CacheKey) -> tuple[bytes, dict[str, Any]] | None:
        """The pickle's bytes and the metadata of the entry for ``key`` in the checked directory ``dir_fd``, once
        trusted: the metadata carries this cache's HMAC and ``key``, the pickle hashes to the sha256 it records, every
        file passes the ownership and mode checks. None when the entry has no metadata file. Nothing is unpickled.
        Raises :class:`CacheRefused` naming the file and what is wrong (:class:`_OtherKey` for a genuine entry of
        another key), OSError if a file cannot be stat'ed."""
        pkl, meta_name = f"{key.digest}.pkl", f"{key.digest}.json"
        mac_key = self._key(dir_fd, create=False)  # a bad key is named even where this key has no entry
        raw = _read_bounded(dir_fd, self.root, meta_name, MAX_META_BYTES)
        if raw is None:
            return None
        if mac_key is None:
            raise CacheRefused(f"{self.root / KEY_NAME} is missing, so no entry can be verified")
        try:
            meta = json.loads(raw)
        except ValueError:
            raise CacheRefused(f"{self.root / meta_name} is not JSON") from None
        if not isinstance(meta, dict) or not hmac.compare_digest(str(meta.get("hmac", "")), meta_mac(mac_key, meta)):
            raise CacheRefused(f"{self.root / meta_name} does not carry this cache's HMAC (tampered or foreign)")
        if meta.get("key") != key.fields():
            raise _OtherKey(f"{self.root / meta_name} was built for another key")
        blob = _read_bounded(dir_fd, self.root, pkl, MAX_PICKLE_BYTES)
        if blob is None:
            raise CacheRefused(f"{self.root / pkl} is missing (its metadata {meta_name} is there)")
        if (sha := hashlib.sha256(blob).hexdigest()) != meta.get("pickle_sha256"):
            raise CacheRefused(f"{self.root / pkl} does not match its metadata: its sha256 is {sha[:16]}, "
                               f"{meta_name} recorded {str(meta.get('pickle_sha256'))[:16]}")
        return blob, meta

    def load(self, key: CacheKey) -> tuple[Any, dict[str, Any]] | None:
        """Return (unpickled JIT, metadata) if a matching, trusted, intact entry exists; else None (and says why)."""
        pkl = f"{key.digest}.pkl"
        try:
            dir_fd = self._open_root(create=False)
        except FileNotFoundError:
            return None
        except (CacheRefused, OSError) as e:
            log.warning("compile cache refused: %s; rebuilding without it", e)
            return None
        try:
            entry = self._entry(dir_fd, key)
        except _OtherKey:
            log.warning("compile cache entry %s was built for another key; rebuilding", pkl)
            return None
        except KeyProblem as e:  # the key's problem: the entry is kept, never trusted
            say_once(str(e))
            return None
        except CacheRefused as e:
            log.warning("compile cache entry %s refused: %s; rebuilding", pkl, e)
            return None
        finally:
            os.close(dir_fd)
        if entry is None:
            return None
        blob, meta = entry
        try:
            return pickle.loads(blob), meta  # noqa: S301 - written by this user, MAC and modes checked above
        except Exception as e:  # a foreign tinygrad/pickle raises anything
            log.warning("compile cache entry %s failed to load (%s: %s); rebuilding", pkl, type(e).__name__, e)
            return None

    def refusal(self, key: CacheKey) -> str | None:
        """Why :meth:`load` would refuse the entry for ``key``, in one line naming the file and what is wrong, or
        None when the entry is intact or there is none (no cache directory, no metadata file: the model is compiled
        when it is loaded). The checks :meth:`load` makes before it unpickles -- ownership and modes, the metadata's
        HMAC and key, the pickle's sha256 -- and nothing is unpickled, not even an authenticated pickle: it costs a
        read and a hash of the pickle. What only a load can tell (a pickle that fails to load, a JIT that reproduces
        another output, ``backend/model.py``) is not checked. Never raises."""
        try:
            dir_fd = self._open_root(create=False)
        except FileNotFoundError:
            return None
        except CacheRefused as e:
            return str(e)
        except OSError as e:
            return f"the cache directory {self.root} cannot be opened ({e.strerror or e})"
        try:
            self._entry(dir_fd, key)
        except CacheRefused as e:
            return str(e)
        except OSError as e:
            return f"a file of the entry {key.digest} in {self.root} cannot be examined ({e.strerror or e})"
        finally:
            os.close(dir_fd)
        return None

    def discard(self, key: CacheKey) -> None:
        """Remove the entry for ``key`` from the checked cache directory: its metadata first (without it the entry
        is absent), then its pickle; a symlink there is removed, never followed. Nothing is removed when the
        directory is missing or refused. Never raises: a file that cannot be removed stays (and :meth:`load`
        refuses it, naming it)."""
        try:
            dir_fd = self._open_root(create=False)
        except (CacheRefused, OSError):
            return
        try:
            for name in (f"{key.digest}.json", f"{key.digest}.pkl"):
                try:
                    os.unlink(name, dir_fd=dir_fd)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    log.warning("compile cache entry %s could not be removed (%s)", self.root / name, e.strerror or e)
                    return
        finally:
            os.close(dir_fd)

    def store(self, key: CacheKey, jit: Any, extra: dict[str, Any]) -> Path | None:
        """Write an entry atomically (0600 files in a 0700 directory); returns the pickle's path, None if refused."""
        try:
            dir_fd = self._open_root(create=True)
        except (CacheRefused, OSError) as e:
            log.warning("compile cache refused: %s; the compiled model is not cached", e)
            return None
        try:
            mac_key = self._key(dir_fd, create=True)
            assert mac_key is not None
            blob = pickle.dumps(jit)
            meta = {"key": key.fields(), "pickle_sha256": hashlib.sha256(blob).hexdigest(), **extra}
            meta["hmac"] = meta_mac(mac_key, meta)
            _write_atomic(dir_fd, f"{key.digest}.pkl", blob)
            _write_atomic(dir_fd, f"{key.digest}.json", json.dumps(meta, indent=1).encode())
        except KeyProblem as e:
            say_once(str(e))
            return None
        except CacheRefused as e:
            log.warning("compile cache refused: %s; the compiled model is not cached", e)
            return None
        finally:
            os.close(dir_fd)
        return self.root / f"{key.digest}.pkl"
