"""``chestnut launch``'s run directory: a fresh ``runs/<UTC time>/`` of its own for each launch, private to
this user (:func:`make_run_dir`), and the supervisord configuration rendered into it from
``launch/supervisord.conf`` (:func:`render_config`)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from chestnut.msgs.outdir import new_private_dir, private_dir, write_private

TEMPLATE = Path(__file__).with_name("supervisord.conf")
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
