"""``chestnut launch``'s process control: supervisord started with this launch's environment
(:func:`start_supervisord`), the waits for the stack to come up (:func:`wait_for`, which gives up on a node
that exits at every start), the stop in :data:`STOP_ORDER` (:func:`stop_stack`, :func:`shut_down`), and the
search for whatever of the launch survived it (:func:`stack_pids`, :func:`kill_stack`).

The stop order lets the log hold everything the node answered: the control daemon leaves first (a consumer
that is gone sees no node going silent, so a stop is never a ``commIssue``), then the camera, then -- once the
node has answered the camera's last frame -- the node, then the logger, after a drain period, and the twin
last. supervisord's own priorities give the same order when it stops the stack by itself."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from chestnut.launch.rundir import RUN_UMASK, remove_runtime_dir
from chestnut.msgs.paths import RuntimeDirError

log = logging.getLogger("chestnut.launch")

PROGRAMS = ("twin", "record", "node", "camera", "control")
# consumer first, then the source, the node, the logger, the dock: see the module docstring
STOP_ORDER = ("control", "camera", "node", "record", "twin")
LAUNCH_ID_ENV = "CHESTNUT_LAUNCH_ID"  # set in every program of one launch (with CHESTNUT_PREFIX)
LAST_ANSWER_WAIT_S = 2.0  # after the camera stopped: longest wait for the node's answer to its last frame
LOGGER_DRAIN_S = 0.5  # after the node stopped: the logger's time to take in its last messages (POLL_MS x 5)
ENVIRON_MAX_BYTES = 1 << 20  # bound on one /proc/<pid>/environ read (Linux caps argv + envp near ARG_MAX)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h: orphans of our tree are re-parented to us, not to init
SUPERVISORD_STOP_S = 40.0  # after the stop: longest wait for supervisord itself to exit before SIGKILL


def start_supervisord(conf: Path, prefix: str, launch_id: str) -> subprocess.Popen[bytes]:
    """Start supervisord on ``conf`` in a session of its own, with ``CHESTNUT_PREFIX=prefix`` and
    ``CHESTNUT_LAUNCH_ID=launch_id`` in its (and every program's) environment, umask :data:`RUN_UMASK`, and
    SIGTERM when this process dies; this process becomes the tree's child subreaper first."""
    supervisord = str(Path(sys.executable).parent / "supervisord")
    _become_subreaper()
    return subprocess.Popen(
        [supervisord, "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent,
        umask=RUN_UMASK,  # supervisord runs in the foreground (nodaemon), so its own umask setting never applies
        env=dict(os.environ, CHESTNUT_PREFIX=prefix, **{LAUNCH_ID_ENV: launch_id}),
    )


def shut_down(proc: subprocess.Popen[bytes], conf: Path, view: Any, prefix: str, launch_id: str) -> None:
    """End the launch: the programs in :data:`STOP_ORDER` (:func:`stop_stack`) while supervisord runs, the view's
    subscriptions closed, supervisord itself (SIGTERM, SIGKILL after :data:`SUPERVISORD_STOP_S`), then whatever
    of the launch is left (:func:`kill_stack`), each note logged; last the prefix's runtime directory is removed
    when only the stack's leftovers are in it (``launch/rundir.py`` ``remove_runtime_dir``; why it is kept
    otherwise is logged). The view's subscribers log no INFO line for the publishers that go away meanwhile: the
    stop is what takes them away (a message over a service's bound is a WARNING and still shows)."""
    messaging = logging.getLogger("chestnut.msgs.messaging")
    level = messaging.level
    messaging.setLevel(logging.WARNING)
    try:
        if proc.poll() is None:
            for note in stop_stack(conf, view):
                log.warning("stop: %s", note)
        view.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=SUPERVISORD_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if killed := kill_stack(prefix, launch_id):
            log.warning("killed %d process(es) of the stack left after supervisord: %s", len(killed), killed)
        if (kept := remove_runtime_dir(prefix)) is not None:
            log.info("%s", kept)
    finally:
        messaging.setLevel(level)


def wait_for(view: Any, service: str, deadline_s: float, conf: Path | None = None, flag: Any = None) -> bool:
    """Wait up to ``deadline_s`` (s) until ``service`` is seen; with ``conf``, give up early once supervisord has
    given up on the node or the node exits at every start (:func:`node_exits`, from ``supervisord.log`` beside
    ``conf``); with ``flag`` (:class:`~chestnut.launch.signals.StopFlag`), give up as soon as it is set (within
    one ``view.update``, 100 ms)."""
    t_end = time.monotonic() + deadline_s
    next_status = time.monotonic() + 2.0
    while time.monotonic() < t_end and not (flag is not None and flag.stop):
        view.update(100)
        if view.sm.seen[service]:
            return True
        if conf is not None and time.monotonic() >= next_status:
            next_status = time.monotonic() + 2.0
            if program_state(conf, "node") in ("FATAL", "EXITED", "BACKOFF"):
                return False
            if node_exits(read_tail(conf.parent / "supervisord.log")) >= CRASH_LOOP_EXITS:
                return False
    return False


CRASH_LOOP_EXITS = 2
"""A node that has exited unexpectedly this often before it answered a frame exits at every start (its
configuration or model cannot run): ``chestnut launch`` stops waiting and names the cause."""
LOG_TAIL_BYTES = 64 * 1024  # bound on reading the end of a program's log


def read_tail(path: Path, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last ``max_bytes`` of ``path`` as text ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - max_bytes))
            return f.read(max_bytes).decode(errors="replace")
    except OSError:
        return ""


def node_exits(supervisord_log: str) -> int:
    """How often the node exited unexpectedly, from supervisord's log (its ``exited: node (exit status N; not
    expected)`` lines, supervisor's ``process.py`` wording)."""
    return sum(1 for line in supervisord_log.splitlines() if "exited: node (" in line and "not expected" in line)


SUPERVISORD_LOG_MAX_BYTES = 64 << 20  # bound on one scan of supervisord.log (supervisord rotates it at 50 MB)


def programs_not_started(supervisord_log: Path, programs: Iterable[str]) -> dict[str, str]:
    """Which of ``programs`` (each asked to start in this run) never ran, from supervisord's own log: name ->
    why, in one line. A program ran once supervisord logged ``success: NAME entered RUNNING state`` (it stayed
    up for its ``startsecs``); one that supervisord gave up on (``gave up: NAME entered FATAL state``: it exited
    within its ``startsecs`` at each of its start retries) did not run as asked even if it ran before. The
    wording is supervisor 4's (``process.py`` ``transition``, ``finish``, ``record_spawnerr``; ``supervisord.py``
    ``handle_signal``). The log is read line by line, at most :data:`SUPERVISORD_LOG_MAX_BYTES`; a log that cannot
    be read says nothing (empty result).

    A program the launch's stop ended while it started is not one that failed: it is left out when, without an
    exit at start, it was stopped within its ``startsecs`` (``stopped: NAME``, what a stop of a starting program
    logs) or never spawned before supervisord was told to exit (a stop in the launch's first second), unless
    supervisord failed to spawn something (``spawnerr:``, which names no program)."""
    wanted = list(programs)
    ran: set[str] = set()
    gave_up: set[str] = set()
    spawned: set[str] = set()
    stopped_starting: set[str] = set()  # its last spawn ended by a stop, before it entered RUNNING
    exits: dict[str, list[str]] = {name: [] for name in wanted}
    exit_request = spawn_error = False
    try:
        with open(supervisord_log, "rb") as f:
            for raw in f:
                if f.tell() > SUPERVISORD_LOG_MAX_BYTES:
                    break
                line = raw.decode(errors="replace")
                exit_request = exit_request or " indicating exit request" in line
                spawn_error = spawn_error or " spawnerr: " in line
                for name in wanted:
                    if f"success: {name} entered RUNNING state" in line:
                        ran.add(name)
                    elif f"gave up: {name} entered FATAL state" in line:
                        gave_up.add(name)
                    elif f"exited: {name} (" in line and "not expected)" in line:
                        exits[name].append(line.split(f"exited: {name} (", 1)[1].split(";", 1)[0])
                    elif f"spawned: '{name}' with pid" in line:
                        spawned.add(name)
                        stopped_starting.discard(name)
                    elif f"stopped: {name} (" in line and name not in ran:
                        stopped_starting.add(name)
    except OSError:
        return {}
    out = {}
    for name in wanted:
        n = len(exits[name])
        last = f", the last with {exits[name][-1]}" if n else ""
        if name in gave_up:
            out[name] = f"supervisord gave up on it (FATAL) after {n} exit(s) at start{last}"
        elif name in ran or (n == 0 and name in stopped_starting):
            continue
        elif n == 0 and name not in spawned and exit_request and not spawn_error:
            continue
        else:
            out[name] = f"it never stayed up past its start ({n} exit(s) at start{last})"
    return out


def not_started_lines(run_dir: Path, asked: list[str]) -> dict[str, str]:
    """For each program of ``asked`` that did not run (:func:`programs_not_started`,
    from ``<run_dir>/supervisord.log``), one line for the summary: which program, why, its log's last error
    line or last line (:func:`last_words`, when its log has any) and where its log is. Name -> line; empty when
    every program ran."""
    out = {}
    for name, why in programs_not_started(run_dir / "supervisord.log", asked).items():
        program_log = run_dir / f"{name}.log"
        tail = read_tail(program_log)
        last = f"; {last_words(tail)}" if tail.strip() else ""
        out[name] = f"program {name} did not run: {why}{last}; see {program_log}"
    return out


def last_words(program_log: str) -> str:
    """``its last error: LINE`` with :func:`last_error_line` of ``program_log`` when that is an ERROR / CRITICAL
    line, else ``its log ends: LINE`` (a state change or the last line, which say what it did last, not what
    failed)."""
    line = last_error_line(program_log)
    return f"its last error: {line}" if line.startswith(("ERROR ", "CRITICAL ")) else f"its log ends: {line}"


def last_error_line(node_log: str) -> str:
    """The node log's last ERROR / CRITICAL line (else its last state change to ``stopping``, else its last
    line), without the timestamp: what made the node exit."""
    lines = [ln.strip() for ln in node_log.splitlines() if ln.strip()]
    if not lines:
        return "(node.log is empty)"
    last = lines[-1]
    for marks in ((" ERROR ", " CRITICAL "), (" -> stopping",)):
        if found := next((ln for ln in reversed(lines) if any(m in ln for m in marks)), None):
            last = found
            break
    return last.split(" ", 2)[2] if last[:4].isdigit() and last.count(" ") >= 2 else last


def program_state(conf: Path, name: str) -> str:
    """supervisord's state of one program (RUNNING, STARTING, BACKOFF, FATAL, EXITED ...), or "UNKNOWN"."""
    exe = str(Path(sys.executable).parent / "supervisorctl")
    try:
        out = subprocess.run([exe, "-c", str(conf), "status", name], capture_output=True, text=True, timeout=10,
                             start_new_session=True).stdout  # a Ctrl-C is the launch's (:func:`supervisorctl`)
    except (OSError, subprocess.SubprocessError):
        return "UNKNOWN"
    parts = out.split()
    return parts[1] if len(parts) > 1 else "UNKNOWN"


STACK_SOCKETS = ("supervisor.sock", "twin.sock")  # supervisord's control socket, the twin's (backend/sim/wire.py)


class DockLockPathError(RuntimeDirError):
    """The twin's dock lock file (``backend/docklock.py`` ``dock_lock_path`` at the twin's first bus and address)
    is one the node could never take: a symlink, not a regular file, another user's or writable by group/other
    (``open_dock_lock``'s ``lock_unusable``). A :class:`~chestnut.msgs.paths.RuntimeDirError`, so ``chestnut
    launch`` refuses it as it refuses a path planted in the runtime directory: one line, exit 2
    (``launch/cli.py``). ``str()`` is the node's own line, then what it means for the run; ``path`` is the lock
    file."""

    def __init__(self, path: Path, detail: str) -> None:
        PermissionError.__init__(self, f"{detail} (the node could never take the dock: nothing started)")
        self.path = path


def check_stack_sockets(prefix: str, node_toml: dict[str, Any] | None = None) -> None:
    """Refuse now what would stop a program of the stack from binding its socket in ``prefix``'s runtime
    directory: anything at a name of ``msgs/paths.py`` ``STACK_SOCKET_NAMES`` (supervisord's control socket, the
    twin's and the camera's frame ring hand-over ``cameraFrame.vipc``) but nothing or a socket of ours
    (``check_socket_path``: the twin would refuse it at each of supervisord's restarts, the camera at its start).
    With a node whose dock is the twin (``node_toml``'s ``[dock] kind``, default ``twin``: ``node/config.py``),
    also the twin's dock lock file when one is there (:class:`DockLockPathError`; a missing one is made by the
    node). Raises :class:`~chestnut.msgs.paths.SocketPathError` / :class:`DockLockPathError` (one line each;
    ``chestnut launch`` exits 2 on them) or what :func:`~chestnut.msgs.paths.runtime_dir` raises."""
    from chestnut.backend.docklock import dock_lock_path, open_dock_lock
    from chestnut.backend.errors import UsbLayerError
    from chestnut.backend.sim.cli import default_bus_address
    from chestnut.msgs.paths import STACK_SOCKET_NAMES, check_socket_path, runtime_dir

    path = dock_lock_path(*default_bus_address(prefix))  # the twin launch serves has no --bus / --address
    if (node_toml or {}).get("dock", {}).get("kind", "twin") == "twin" and os.path.lexists(path):
        try:  # first: refused, it leaves no runtime directory behind
            os.close(open_dock_lock(path))  # the node's own open and checks; it exists, so nothing is created
        except UsbLayerError as e:
            raise DockLockPathError(path, e.detail) from None
    for name in STACK_SOCKET_NAMES:
        check_socket_path(runtime_dir(prefix) / name)


LOCK_UNUSABLE = "lock_unusable"  # backend/docklock.py: the reason of a dock lock file the node cannot use


def dock_never_taken(summary: dict[str, Any]) -> str | None:
    """The one line that fails a run (exit 1, a failed start) whose node never took the dock: ``ChestnutActive``
    was never true (``summary``'s ``first_active_s`` None) and a start of its primary was refused for an unusable
    dock lock file (a ``nodeState`` transition's or a restart's cause with :data:`LOCK_UNUSABLE`, e.g. a
    directory planted at the lock's path while the stack started); else None. The line ends with the node's
    own words, which name the file and the fix, without its ``retry in N s``."""
    if summary.get("first_active_s") is not None:
        return None
    causes = [str(t[2]) for t in summary.get("transitions") or [] if len(t) > 2]
    causes += [str(r.get("cause", "")) for r in summary.get("restarts") or [] if isinstance(r, dict)]
    refused = [c for c in causes if LOCK_UNUSABLE in c]
    if not refused:
        return None
    words = refused[-1][refused[-1].index(LOCK_UNUSABLE):].split("; retry in ")[0]
    return f"the node never took the dock (ChestnutActive was never true): {words}"


def running_stack(prefix: str) -> str | None:
    """What of a stack already answers on ``prefix`` (the twin's or supervisord's socket), else None. Call
    :func:`check_stack_sockets` first: a connect follows a symlink."""
    import socket as _socket

    from chestnut.msgs.paths import runtime_dir

    for name in STACK_SOCKETS:
        path = runtime_dir(prefix) / name
        if not path.exists():
            continue
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            s.connect(str(path))
            return f"{path} answers"
        except OSError:
            continue
        finally:
            s.close()
    return None


def _die_with_parent() -> None:
    """In supervisord's child: PR_SET_PDEATHSIG(SIGTERM), so a killed ``chestnut launch`` stops its stack."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def supervisorctl(conf: Path, *args: str, timeout_s: float = 30.0) -> int:
    """Run ``supervisorctl -c conf ARGS``; returns its exit code (-1 when it could not run or timed out). It runs in
    a session of its own, as supervisord does: a terminal's Ctrl-C (SIGINT to the whole foreground process group)
    is the launch's stop signal, for its :class:`~chestnut.launch.signals.StopFlag`; it does not kill a start or a
    stop under way halfway (``exit -2``, a false failure of the program asked, the stop order cut)."""
    exe = str(Path(sys.executable).parent / "supervisorctl")
    try:
        return subprocess.run(
            [exe, "-c", str(conf), *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=timeout_s,
            start_new_session=True,
        ).returncode
    except (OSError, subprocess.SubprocessError):
        return -1


def _become_subreaper() -> bool:
    """``prctl(PR_SET_CHILD_SUBREAPER)``: the stack's orphans (a killed supervisord's programs) become our
    children, so :func:`kill_stack` can reap them. False where the kernel refuses."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def environ_matches(environ: bytes, want: dict[str, str]) -> bool:
    """True when the NUL-separated ``KEY=VALUE`` block ``environ`` (``/proc/<pid>/environ``) holds every
    ``want`` pair exactly."""
    found = {}
    for entry in environ.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep:
            found[key] = value
    return all(found.get(k.encode()) == v.encode() for k, v in want.items())


def stack_pids(prefix: str, launch_id: str | None = None, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Pids of this user's processes whose environment has ``CHESTNUT_PREFIX=prefix`` (and, given,
    ``CHESTNUT_LAUNCH_ID=launch_id``), read from ``/proc/<pid>/environ`` (at most
    :data:`ENVIRON_MAX_BYTES` each). Other users' processes, zombies and processes gone meanwhile are
    skipped; ``exclude`` and this process never count."""
    want = {"CHESTNUT_PREFIX": prefix, **({LAUNCH_ID_ENV: launch_id} if launch_id is not None else {})}
    uid, me = os.getuid(), os.getpid()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in exclude or int(entry.name) == me:
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            fd = os.open(f"/proc/{entry.name}/environ", os.O_RDONLY | os.O_NOFOLLOW)
            try:
                data = os.read(fd, ENVIRON_MAX_BYTES)
            finally:
                os.close(fd)
        except OSError:  # gone, or not ours to read
            continue
        if data and environ_matches(data, want):
            out.append(int(entry.name))
    return sorted(out)


def kill_stack(prefix: str, launch_id: str, term_wait_s: float = 3.0, kill_wait_s: float = 5.0) -> list[int]:
    """End every process of this launch (:func:`stack_pids`): SIGTERM, then after ``term_wait_s`` (s) SIGKILL
    for what is left, until none is left or ``kill_wait_s`` more passed; reaps those that are our children
    (we are the subreaper). Returns the pids found (empty after a clean stop)."""
    found: list[int] = []
    t_kill = time.monotonic() + term_wait_s
    t_end = t_kill + kill_wait_s
    sig = signal.SIGTERM
    while True:
        _reap(found)
        pids = stack_pids(prefix, launch_id)
        now = time.monotonic()
        if not pids or now >= t_end:
            return found
        if sig == signal.SIGTERM and now >= t_kill:
            sig = signal.SIGKILL
        for pid in pids:
            if pid not in found:
                found.append(pid)
            elif sig == signal.SIGTERM:
                continue  # asked once already
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        time.sleep(0.05)


def _reap(pids: list[int]) -> None:
    """Collect those of ``pids`` that are our exited children (orphans re-parented to us), without blocking;
    other children of this process are left to their owners."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def stop_stack(conf: Path, view: Any) -> list[str]:
    """Stop the programs one at a time in :data:`STOP_ORDER` through supervisorctl, waiting between the
    camera and the node for the node's answer to the camera's last frame (at most
    :data:`LAST_ANSWER_WAIT_S`), and between the node and the logger :data:`LOGGER_DRAIN_S`. ``view``:
    a :class:`~chestnut.launch.top.StackView` that still subscribes. Returns notes on what did not go
    as planned (empty when all went well)."""
    notes: list[str] = []
    for name in STOP_ORDER:
        rc = supervisorctl(conf, "stop", name)
        if rc != 0:
            notes.append(f"supervisorctl stop {name}: exit {rc}")
        if name == "camera":
            if not wait_last_answer(view, LAST_ANSWER_WAIT_S):
                notes.append(f"the node did not answer the camera's last frame within {LAST_ANSWER_WAIT_S:g} s")
        elif name == "node":
            time.sleep(LOGGER_DRAIN_S)
    return notes


def wait_last_answer(view: Any, timeout_s: float) -> bool:
    """After the camera stopped: wait until ``view`` saw a ``modelOutput`` for the newest ``cameraFrame`` it
    saw (or a later one). True at once when no frame was ever seen."""
    t_end = time.monotonic() + timeout_s
    view.update(0)
    sm = view.sm
    while True:
        if not sm.seen["cameraFrame"]:
            return True
        if sm.seen["modelOutput"] and int(sm["modelOutput"].frameId) >= int(sm["cameraFrame"].frameId):
            return True
        if time.monotonic() >= t_end:
            return False
        view.update(50)
