"""What another user could leave at a path one of our programs is about to create, for the tests that check it is
refused and kept: a regular file (content ``important``), a directory, or a symlink to a file of ours (content
``precious``) that must stay untouched."""

from __future__ import annotations

import time
from pathlib import Path


def plant(path: Path, kind: str, victim: Path) -> None:
    """Put a ``kind`` ("file", "dir" or "symlink") at ``path``; ``victim`` is written ``precious`` first and is
    the symlink's target. Raises ``ValueError`` for another kind."""
    victim.write_text("precious\n")
    if kind == "file":
        path.write_text("important\n")
    elif kind == "dir":
        path.mkdir(0o700)
    elif kind == "symlink":
        path.symlink_to(victim)
    else:
        raise ValueError(f"plant: unknown kind {kind!r}")


def plant_run_names(runs: Path, victim: Path) -> None:
    """Make ``runs`` (0700) and a symlink to ``victim`` (a 0700 directory, made too) at every run-directory name
    ``chestnut launch`` can pick from 2 s ago to ten minutes on (a loaded machine is slow)."""
    runs.mkdir(mode=0o700)
    victim.mkdir(mode=0o700)
    now = time.time()
    for i in range(-2, 600):
        (runs / time.strftime("%Y-%m-%d--%H-%M-%S", time.gmtime(now + i))).symlink_to(victim)
