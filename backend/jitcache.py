"""The compile cache: captured tinygrad JITs, pickled per machine, model, shape, device and version.

The first call of a real model costs tens of seconds in tinygrad (graph planning and kernel
compiles, FACTS.md §2); a pickled captured ``TinyJit`` loads in about a second. An entry's key is
the sha256 of everything that makes a capture valid: the model bytes' sha256, the input specs, the
tinygrad device, the tinygrad version and this machine (CPU model, architecture, Python, clang).

Entries are never trusted blindly: the metadata must match the key's fields and the pickle's
sha256, and the loaded JIT must reproduce, bit for bit, the output digest recorded when it was
built (a fixed seeded input). Anything else is rebuilt. Unpickling runs code: the cache directory is
the user's own (``~/.cache/chestnut/jit``, created mode 0700) and must stay so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import platform
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

log = logging.getLogger("chestnut.jitcache")


def default_cache_dir() -> Path:
    """``$CHESTNUT_CACHE/jit`` or ``~/.cache/chestnut/jit``."""
    return Path(os.environ.get("CHESTNUT_CACHE") or Path.home() / ".cache" / "chestnut") / "jit"


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


class JitCache:
    """A directory of ``<digest>.pkl`` + ``<digest>.json`` entries."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or default_cache_dir()

    def _paths(self, key: CacheKey) -> tuple[Path, Path]:
        return self.root / f"{key.digest}.pkl", self.root / f"{key.digest}.json"

    def load(self, key: CacheKey) -> tuple[Any, dict[str, Any]] | None:
        """Return (unpickled JIT, metadata) if a matching, intact entry exists; else None (and says why)."""
        pkl, meta_path = self._paths(key)
        if not pkl.is_file() or not meta_path.is_file():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            blob = pkl.read_bytes()
        except (OSError, ValueError) as e:
            log.warning("compile cache entry %s unreadable (%s); rebuilding", pkl.name, e)
            return None
        if meta.get("key") != key.fields():
            log.warning("compile cache entry %s was built for another key; rebuilding", pkl.name)
            return None
        if meta.get("pickle_sha256") != hashlib.sha256(blob).hexdigest():
            log.warning("compile cache entry %s is corrupt (pickle sha256 mismatch); rebuilding", pkl.name)
            return None
        try:
            return pickle.loads(blob), meta  # noqa: S301 - our own cache directory, see module docstring
        except Exception as e:  # a foreign tinygrad/pickle raises anything
            log.warning("compile cache entry %s failed to load (%s: %s); rebuilding", pkl.name, type(e).__name__, e)
            return None

    def store(self, key: CacheKey, jit: Any, extra: dict[str, Any]) -> Path:
        """Write an entry atomically; returns the pickle's path."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        pkl, meta_path = self._paths(key)
        blob = pickle.dumps(jit)
        meta = {"key": key.fields(), "pickle_sha256": hashlib.sha256(blob).hexdigest(), **extra}
        for path, data in ((pkl, blob), (meta_path, json.dumps(meta, indent=1).encode())):
            tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return pkl
