"""Where the stack's sockets and runtime files live.

Every stack runs in its own private runtime directory, ``<base>/chestnut-<uid>/<prefix>``, created
with mode 0700 (the directory of ``ipc://`` sockets must not be reachable by other users).
``<base>`` is ``$XDG_RUNTIME_DIR`` when set, else the system temp dir; ``<prefix>`` is
``$CHESTNUT_PREFIX`` (default ``"default"``), so parallel stacks and tests never collide.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

PREFIX_ENV = "CHESTNUT_PREFIX"
DEFAULT_PREFIX = "default"
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def current_prefix() -> str:
    """The active prefix: ``$CHESTNUT_PREFIX`` or ``"default"``; raises ``ValueError`` if malformed."""
    prefix = os.environ.get(PREFIX_ENV, DEFAULT_PREFIX)
    if not _PREFIX_RE.match(prefix) or prefix in (".", ".."):
        raise ValueError(f"{PREFIX_ENV}={prefix!r}: use 1-64 characters from [A-Za-z0-9_.-]")
    return prefix


def runtime_dir(prefix: str | None = None) -> Path:
    """Create (if needed) and return the private runtime directory for ``prefix``.

    Raises ``PermissionError`` if the directory exists but belongs to another user or is
    readable by others (a socket directory another user controls is not ours to use).
    """
    prefix = current_prefix() if prefix is None else prefix
    if not _PREFIX_RE.match(prefix) or prefix in (".", ".."):
        raise ValueError(f"prefix {prefix!r}: use 1-64 characters from [A-Za-z0-9_.-]")
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"chestnut-{os.getuid()}"
    for d in (base, base / prefix):
        d.mkdir(mode=0o700, exist_ok=True)
        st = d.stat()
        if st.st_uid != os.getuid():
            raise PermissionError(f"{d} belongs to uid {st.st_uid}, not {os.getuid()}")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(d, 0o700)
    return base / prefix
