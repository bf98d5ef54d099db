"""A bench's own runtime prefix, whose runtime directory goes when the bench ends, if the bench made it.

Every program of the stack leaves its prefix's directory, ``<base>/chestnut-<uid>/<prefix>`` (``msgs/paths.py``
``runtime_dir``), behind when it stops, on purpose: its ``<service>.pub.lock`` files stay (``msgs/messaging.py``
``take_pub_lock``: a flock file unlinked while another program opens it would give two publishers two different
locks), and a user's stack runs on the same prefix again. A bench takes a fresh prefix each run (``<name>-<pid>``),
so every run left one more directory in ``/tmp/chestnut-<uid>``. :func:`own_prefix` removes it at the end -- only a
directory the bench made: one that was there before it started (a prefix the user gave, a stack of theirs) is kept,
and nothing outside it, ``chestnut-<uid>`` itself included, is touched.

Benches are scripts run from the repository root (``.venv/bin/python tests/bench/bench_X.py``): Python puts this
folder first on ``sys.path``, so ``from benchprefix import own_prefix`` finds this module.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from chestnut.msgs.paths import PREFIX_ENV, check_prefix, runtime_base


def prefix_dir(prefix: str) -> str:
    """The runtime directory of ``prefix`` (``msgs/paths.py`` ``runtime_dir``'s path), made or not: nothing is
    created or checked here."""
    return os.path.join(runtime_base(), f"chestnut-{os.getuid()}", prefix)


@contextmanager
def own_prefix(name: str, env: bool = False) -> Iterator[str]:
    """The prefix ``name`` for the ``with`` block; when the block ends, however it ends, its runtime directory is
    removed with all in it if it was not there when the block began (so: the bench made it). Put the ``with``
    around every program the bench starts on the prefix, so they have stopped by then.

    ``env``: the programs find the prefix in ``$CHESTNUT_PREFIX``. A ``$CHESTNUT_PREFIX`` already set is the
    user's choice: it is yielded instead of ``name`` and its directory is never removed; else ``name`` is set
    there for the block and unset after it. Raises ``msgs/paths.py`` ``PrefixError`` (a ValueError) for a
    malformed ``name``."""
    given = os.environ.get(PREFIX_ENV) if env else None
    if given:
        yield given
        return
    prefix = check_prefix(name)
    path = prefix_dir(prefix)
    made = not os.path.lexists(path)
    if env:
        os.environ[PREFIX_ENV] = prefix
    try:
        yield prefix
    finally:
        if env:
            os.environ.pop(PREFIX_ENV, None)
        if made:
            shutil.rmtree(path, ignore_errors=True)  # never follows a symlink (rmtree refuses one at the top)
