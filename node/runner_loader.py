"""Which :class:`~chestnut.backend.interface.PrimaryRunner` the worker builds, and loading its code.

The three built-in kinds are ours (``twin``, ``real``, ``cpu``). Any other runner is code named by
the configuration, ``"module:Class"`` or ``"/path/to/file.py:Class"``, and it runs with the dock and
the node's privileges, so it is loaded only when it is code its user owns: the rule OpenSSH applies
to ``~/.ssh`` (``sshd(8)`` *StrictModes*, ``ssh(1)`` on private keys). Every file executed for it
(the runner file, or each module file on the way to ``module``) and the folder that holds it must be

- a regular file (a folder for the folder), not a symbolic link (the file is opened ``O_NOFOLLOW``
  and checked on the open descriptor, so what is checked is what runs);
- owned by the user the worker runs as, or by root;
- not writable by group or other.

Anything else is refused with one :class:`ConfigError` ``"untrusted_runner"`` line that names the
path and the fix; nothing of it runs. A runner file is read at most :data:`RUNNER_FILE_MAX_BYTES`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from chestnut.backend.errors import ChestnutError, ConfigError
from chestnut.backend.interface import PrimaryRunner
from chestnut.node.cpu_runner import HostCpuRunner

RUNNER_KINDS = ("twin", "real", "cpu")
RUNNER_FILE_MAX_BYTES = 1 << 20  # a runner file larger than 1 MiB is refused (our bound)
TRUSTED_OWNERS_EXTRA = (0,)      # root owns system-installed packages


@dataclass(frozen=True)
class RunnerSpec:
    """Which :class:`PrimaryRunner` the worker builds, resolved inside the worker.

    ``kind``: ``"twin"`` (``chestnut.backend.twin_runner.TwinRunner``), ``"real"``
    (``chestnut.backend.real_runner.RealRunner``), ``"cpu"`` (:class:`HostCpuRunner`: the primary
    model on the host CPU, for machines without a dock), or ``"module:Class"`` /
    ``"/path/to/file.py:Class"`` for any other class implementing ``PrimaryRunner`` (loaded under
    the ownership rule of the module docstring). The class is called with ``**options``
    (JSON-serialisable). ``env`` is added to the worker's environment before its interpreter
    starts; ``DEV`` is never inherited from the node (the node's own tinygrad runs the fallback on
    the CPU), so the runner (or ``env``) chooses the device.
    """

    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "options": self.options, "env": self.env}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RunnerSpec:
        return cls(str(d["kind"]), dict(d.get("options", {})), dict(d.get("env", {})))


LOCK_FIRST_KINDS = ("twin", "real")  # the runners that take the dock's lock (backend/docklock.py)


def dock_runner_spec(kind: str, options: Mapping[str, Any], wait_timeout_ms: int, prefix: str | None) -> RunnerSpec:
    """The :class:`RunnerSpec` the node's worker builds for ``[dock]`` ``kind`` and ``options``. The twin and the
    real runner get the dock's wait timeout and (the twin) the node's prefix unless ``options`` name them, and
    always ``lock_first=True``: the ladder's ``usb_ids`` takes the dock's lock before any rung touches the dock and
    the runner holds it through the data path (``backend/ladder.py`` ``DockQualifier``), so a node starting while
    another process (``chestnut probe``, a second node) holds the dock fails ``lock_held`` at ``usb_ids`` and
    never resets that dock's GPU. ``options`` cannot turn that off."""
    opts: dict[str, Any] = dict(options)
    if kind in LOCK_FIRST_KINDS:
        opts.setdefault("wait_timeout_ms", int(wait_timeout_ms))
        opts["lock_first"] = True
    if kind == "twin" and prefix is not None:
        opts.setdefault("prefix", prefix)
    return RunnerSpec(kind, opts)


def unknown_kind(kind: str) -> str:
    """The one line for a runner kind that names nothing."""
    return f"runner kind {kind!r}: use one of {RUNNER_KINDS}, 'module:Class' or '/path/file.py:Class'"


def trust_refusal(path: str, mode: int, owner: int, uid: int, *, folder: bool = False) -> str | None:
    """Why ``path`` (with ``os.lstat``/``os.fstat`` ``mode`` and ``owner``) must not be executed by user
    ``uid``, as one line with the fix; None when it may. Pure: the caller stats.

    ``folder``: ``path`` is the folder that holds the code (a folder is expected, not a file)."""
    what = "runner folder" if folder else "runner file"
    if stat.S_ISLNK(mode):
        return f"{what} {path} is a symbolic link: point the runner at the real file"
    if folder and not stat.S_ISDIR(mode):
        return f"{what} {path} is not a folder"
    if not folder and not stat.S_ISREG(mode):
        return f"{what} {path} is not a regular file"
    if owner != uid and owner not in TRUSTED_OWNERS_EXTRA:
        return (f"{what} {path} is owned by uid {owner}, not by uid {uid} that runs the worker: only code its "
                f"user owns is loaded (chown it, or copy it to a file you own)")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{what} {path} is writable by group or other (mode {stat.S_IMODE(mode):04o}): only code no one "
                f"else can change is loaded (chmod go-w {path})")
    return None


def _refuse_untrusted(path: str, mode: int, owner: int, *, folder: bool = False) -> None:
    why = trust_refusal(path, mode, owner, os.getuid(), folder=folder)
    if why is not None:
        raise ConfigError("untrusted_runner", why)


def _check_folder(path: Path) -> None:
    parent = str(path.parent)
    try:
        st = os.stat(parent)  # a folder reached through a link is judged by what it links to
    except OSError as e:
        raise ConfigError("unknown_runner", f"runner folder {parent}: {e.strerror}") from e
    _refuse_untrusted(parent, st.st_mode, st.st_uid, folder=True)


def read_trusted_file(path: Path) -> bytes:
    """The bytes of the runner file ``path``, read from one ``O_NOFOLLOW`` descriptor after its checks.

    Raises :class:`ConfigError` ``"unknown_runner"`` (missing, unreadable, larger than
    :data:`RUNNER_FILE_MAX_BYTES`) or ``"untrusted_runner"`` (see the module docstring)."""
    _check_folder(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError as e:
        raise ConfigError("unknown_runner", f"runner file {path} does not exist") from e
    except OSError as e:
        try:
            st = os.lstat(path)
        except OSError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):
            _refuse_untrusted(str(path), st.st_mode, st.st_uid)
        raise ConfigError("unknown_runner", f"runner file {path}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        _refuse_untrusted(str(path), st.st_mode, st.st_uid)
        if st.st_size > RUNNER_FILE_MAX_BYTES:
            raise ConfigError("unknown_runner", f"runner file {path} is {st.st_size} bytes, more than the "
                                                f"{RUNNER_FILE_MAX_BYTES} a runner may have")
        chunks, left = [], RUNNER_FILE_MAX_BYTES + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > RUNNER_FILE_MAX_BYTES:
            raise ConfigError("unknown_runner", f"runner file {path} grew past {RUNNER_FILE_MAX_BYTES} bytes")
        return data
    finally:
        os.close(fd)


def _load_file(path: Path) -> ModuleType:
    source = read_trusted_file(path)
    mod_name = f"chestnut_runner_{path.stem}"
    mod_spec = importlib.util.spec_from_file_location(mod_name, path)
    if mod_spec is None:
        raise ConfigError("unknown_runner", f"runner file {path} is not a Python file")
    module = importlib.util.module_from_spec(mod_spec)  # sets __file__, __spec__; executes nothing
    sys.modules[mod_name] = module
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)  # the bytes checked above, nothing re-read
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    return module


def _import_checked(name: str) -> ModuleType:
    """``importlib.import_module(name)``, checking each not yet imported package and module file on the way."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in sys.modules:
            continue
        spec = importlib.util.find_spec(prefix)  # its parent is imported (and was checked) by now
        if spec is None:
            raise ConfigError("unknown_runner", f"no module named {prefix!r}")
        if spec.has_location and spec.origin:
            origin = Path(spec.origin)
            _check_folder(origin)
            try:
                st = os.lstat(origin)
            except OSError as e:
                raise ConfigError("unknown_runner", f"runner file {origin}: {e.strerror}") from e
            _refuse_untrusted(str(origin), st.st_mode, st.st_uid)
        importlib.import_module(prefix)
    return sys.modules[name]


def resolve_runner(spec: RunnerSpec) -> PrimaryRunner:
    """Build the runner ``spec`` names (see :class:`RunnerSpec`).

    Raises :class:`ConfigError`: ``"unknown_runner"`` (no such kind, file, module or attribute),
    ``"untrusted_runner"`` (code that fails the ownership rule; nothing of it ran), ``"runner_init"``
    (the code raised while loading or building the runner)."""
    try:
        if spec.kind == "cpu":
            return HostCpuRunner(**spec.options)
        if spec.kind == "twin":
            from chestnut.backend.twin_runner import TwinRunner
            return TwinRunner(**spec.options)  # type: ignore[no-any-return]
        if spec.kind == "real":
            from chestnut.backend.real_runner import RealRunner
            return RealRunner(**spec.options)  # type: ignore[no-any-return]
        if ":" not in spec.kind:
            raise ConfigError("unknown_runner", unknown_kind(spec.kind))
        where, _, attr = spec.kind.rpartition(":")
        module = _load_file(Path(where)) if where.endswith(".py") else _import_checked(where)
        factory = getattr(module, attr, None)
        if factory is None:
            raise ConfigError("unknown_runner", f"{where} has no attribute {attr!r}")
        return factory(**spec.options)  # type: ignore[no-any-return]
    except ChestnutError:
        raise
    except Exception as e:
        raise ConfigError("runner_init", f"building runner {spec.kind!r}: {type(e).__name__}: {e}") from e
