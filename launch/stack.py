"""``chestnut launch``: the whole stack under supervisord, for a bounded time or until Ctrl-C.

Programs: the twin of the dock, the logger, the node, the camera source (started once the node
publishes) and the reference control daemon. supervisord (the PyPI ``supervisor`` package) runs
them with restart policies and per-program logs; the configuration is rendered from
``launch/supervisord.conf`` into the run directory ``runs/<UTC time>/``, which also holds the logs
(``logs/``: rlog + MCAP segments) and every program's output.

The stop order (``launch/supervise.py`` ``STOP_ORDER``, ``stop_stack``) lets the log hold everything the node
answered: the control daemon leaves first (a consumer that is gone sees no node going silent, so a
stop is never a ``commIssue``), then the camera, then -- once the node has answered the camera's last
frame -- the node, then the logger, after a drain period, and the twin last. supervisord's own
priorities give the same order when it stops the stack by itself (``chestnut launch`` killed).
Every program carries ``CHESTNUT_PREFIX`` and this launch's ``CHESTNUT_LAUNCH_ID`` in its
environment, so whatever survives the stop (supervisord killed, a program that ignores SIGTERM) is
found by those and killed (``launch/supervise.py`` ``kill_stack``); launch is the tree's child subreaper,
so it also reaps them.

While the stack runs, a live status (``chestnut top``'s view) is shown, and faults given with
``--fault KIND@START[+DURATION]`` are injected into the twin at those times (seconds after the node
first answers a frame) and cleared after their duration. At the end the stack is stopped cleanly
and a summary is printed from the recorded log: frames in and out, outputs per source, latencies,
time to the first output and to ``ChestnutActive``, state transitions and faults.

The jobs live in rooms of their own: the fault plans (``launch/faultplan.py``), the run directory and
supervisord's configuration (``launch/rundir.py``), the frame options (``launch/frames.py``), process
control (``launch/supervise.py``), the process sampler (``launch/sampler.py``), and the summary and its
printing (``launch/summary.py``); :func:`run` here is the sequence of steps: :func:`prepare`,
:func:`start`, :func:`come_up`, :func:`start_foxglove`, :func:`drive`, the stop, :func:`finish_summary`
and :func:`verdict`.

Exit status (:func:`exit_code`): 0 when the run and its contracts are clean, 1 when not (also for a program that
never ran: ``launch/supervise.py`` ``not_started_lines``, a summary line each; for a node that never took the dock:
``dock_never_taken``), 2 for arguments and planted paths refused before anything starts, 130 for a Ctrl-C (143 for
a SIGTERM) that cut a timed run (``--seconds N``) short. With ``--seconds 0`` Ctrl-C is the normal end of the run,
so it exits 0 or 1 like a timed run that ran out. A Ctrl-C before the stack started (while :func:`prepare`
checks) exits 130 after one line (a SIGTERM: 143, named so), whatever ``--seconds``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from chestnut.launch.faultplan import FaultPlan, FaultRunner, faults_file_text
from chestnut.launch.frames import (
    FRAME_SIZES,
    MAX_RATE_HZ,
    RATE_WANT,
    FrameOptions,
    add_dock_timing_arguments,
    check_model_file,
    frame_options,
    launch_rate_hz,
    model_file_problem,
    model_input_problem,
    read_node_toml,
    write_frame_node_config,
)
from chestnut.launch.rundir import make_run_dir, refusal_undone, render_config
from chestnut.launch.sampler import SAMPLE_SETTLE_S, ProcessSampler
from chestnut.launch.signals import stop_words
from chestnut.launch.summary import (
    StackClock,
    check_contracts,
    json_target_problem,
    print_summary,
    stop_figures,
    summarize,
    write_run_file,
    write_summary_json,
)
from chestnut.launch.supervise import (
    CRASH_LOOP_EXITS,
    check_stack_sockets,
    dock_never_taken,
    last_words,
    node_exits,
    not_started_lines,
    read_tail,
    running_stack,
    shut_down,
    start_supervisord,
    supervisorctl,
    wait_for,
)
from chestnut.msgs.argtypes import MAX_RUN_SECONDS, MIN_FRAME_RATE_HZ, checked_int, path_arg, run_seconds
from chestnut.msgs.outdir import OutputDirError

log = logging.getLogger("chestnut.launch")

NS = 1_000_000_000
FAULT_SETTLE_S = 5.0
"""Our choice: how long a run goes on after its last planned fault is cleared when ``--seconds`` would have
ended it sooner (``--fault-from active`` on a slow start moves the plan later), so the log holds the node's
answer to the clear -- a fresh worker's qualification takes a few seconds on the twin."""


PREPARE_FIX = "run `chestnut model prepare` again (it checks the file's sha256 and rebuilds a damaged one)"


def argument_problem(
    seconds: float, rate: float, faults: list[FaultPlan], frames: FrameOptions | None = None
) -> str | None:
    """The one line that refuses ``chestnut launch``'s ``--seconds`` (s), ``--rate`` (Hz) and ``--fault``
    plans together, or None when they can run: a fault whose START is at or after the end of a bounded
    run (``seconds > 0``) would never be injected. ``frames``: the camera and twin options
    (:meth:`FrameOptions.problem`)."""
    if frames is not None and (problem := frames.problem()) is not None:
        return problem
    if not (0 <= seconds <= MAX_RUN_SECONDS):  # also nan (every comparison false) and inf
        return f"--seconds {seconds:g}: give 0 (until Ctrl-C) or a number of seconds up to {MAX_RUN_SECONDS:g} (a week)"
    if not MIN_FRAME_RATE_HZ <= rate <= MAX_RATE_HZ:
        return f"--rate {rate:g}: {RATE_WANT}"
    for f in faults:
        if seconds > 0 and f.start_s >= seconds:
            return (
                f"--fault {f.kind}@{f.start_s:g} starts at or after the end of the run (--seconds {seconds:g}): "
                f"give a START below {seconds:g} or a longer --seconds"
            )
    return None


def foxglove_port(text: str) -> int:
    """``--foxglove PORT``: a TCP port in 0..65535, what ``chestnut foxglove --port`` serves on (0: any free
    port, named in the run's ``foxglove.log``); raises ``argparse.ArgumentTypeError`` (one line) otherwise, so
    a port the Foxglove server would refuse stops the launch before anything starts."""
    return checked_int(text, lambda port: 0 <= port <= 65535, "give a TCP port in 0..65535 (0: any free; default 8765)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seconds",
        type=run_seconds,
        default=60.0,
        help=f"run this long after the first output, at most {MAX_RUN_SECONDS:g} s, a week (0 = until Ctrl-C, which "
        "then ends the run normally: exit 0 when it and its contracts are clean, 1 when not; a Ctrl-C or SIGTERM "
        "that cuts a timed run short exits 130 or 143); a timed run goes on until its --fault plan is carried out "
        f"(injected and cleared, then {FAULT_SETTLE_S:g} s more), and exits 1 when a planned fault never could be "
        "(no ChestnutActive)",
    )
    p.add_argument("--rate", type=launch_rate_hz, default=20.0,
                   help=f"camera rate, Hz (default 20, {MIN_FRAME_RATE_HZ:g} to {MAX_RATE_HZ:g})")
    p.add_argument("--runs-dir", type=path_arg, default=Path("runs"), help="where run directories go (default ./runs)")
    p.add_argument(
        "--fault",
        type=FaultPlan.parse,
        action="append",
        default=[],
        help="inject KIND@START[+DURATION][,key=value]: START s after the node's first output (or its first "
        "ChestnutActive, --fault-from active); after DURATION s the fault is cleared (a pulled cable is plugged "
        "back, a wedged bridge power-cycled); kinds: `chestnut twin kinds`; repeatable",
    )
    p.add_argument(
        "--fault-from",
        choices=("output", "active"),
        default="output",
        help="what --fault's START counts from: the node's first output (default; a fault may then meet the "
        "primary while it loads) or the first ChestnutActive (the primary serving)",
    )
    p.add_argument(
        "--twin-engine",
        choices=("onnxruntime", "tinygrad"),
        default="onnxruntime",
        help="how the twin's GPU executes programs (default onnxruntime: real time on 2 cores)",
    )
    p.add_argument("--node-config", type=path_arg, help="node TOML (default: launch/node.toml)")
    p.add_argument(
        "--frames",
        choices=FRAME_SIZES,
        default="model",
        help="model (default): the camera resizes to the model's input; native: the source's own size (the "
        "traffic video's 704x576, --synthetic's 1928x1208), warped to the model's input (--warp)",
    )
    p.add_argument(
        "--synthetic", action="store_true", help="the camera's moving test pattern instead of the traffic video"
    )
    p.add_argument(
        "--pixel-format",
        choices=("bgr24", "nv12"),
        default="bgr24",
        help="the camera's frames: bgr24 (default) or nv12 (YUV 4:2:0, openpilot's cameras; the node warps them)",
    )
    p.add_argument(
        "--transport",
        choices=("auto", "shm", "inline"),
        default="auto",
        help="how frames reach the node: shm (the camera's shared-memory ring, only metadata on the bus), inline "
        "(pixels in the message); auto (default): shm for frames over 256 KiB (every native frame), else inline",
    )
    p.add_argument(
        "--warp",
        choices=("primary", "node"),
        default=None,
        help="where frames that are not the model's input are warped to it: primary (default; its program takes "
        "the full frame, which crosses the copy path every frame: [model] frame) or node (the node's CPU warp; "
        "the primary takes the model's input); the fallback always warps on the CPU; only with --frames native "
        "or --pixel-format nv12",
    )
    add_dock_timing_arguments(p)
    p.add_argument("--no-live", action="store_true", help="no live status view")
    p.add_argument(
        "--log-format",
        choices=("both", "zst", "mcap"),
        default="both",
        help="log segment format(s): both (default, ~300 MB/min at 20 Hz), zst (openpilot rlog) or mcap",
    )
    p.add_argument("--json", type=path_arg, help="also write the summary as JSON here (0600; its folder must exist, be "
                   "yours and writable by no one else, and not be a symlink)")
    p.add_argument(
        "--foxglove",
        type=foxglove_port,
        nargs="?",
        const=8765,
        default=None,
        metavar="PORT",
        help="also serve the stack to Foxglove on ws://127.0.0.1:PORT (a TCP port in 0..65535, 0: any free one, "
        "named in the run's foxglove.log; default port 8765; chestnut foxglove)",
    )


@dataclasses.dataclass
class Launch:
    """One launch while it runs: where it lives, its supervisord, and what the run loop found."""

    args: argparse.Namespace
    prefix: str
    run_dir: Path
    conf: Path
    launch_id: str
    proc: subprocess.Popen[bytes]
    t_launch_ns: int  # CLOCK_MONOTONIC ns when supervisord was started
    view: Any  # chestnut.launch.top.StackView
    flag: Any  # chestnut.launch.signals.StopFlag
    sampler: ProcessSampler
    clock: StackClock
    faults: FaultRunner
    died: bool = False  # supervisord ended by itself (killed): the run failed whatever the log says
    failed_start: bool = False  # the stack never came up: the run failed whatever the log says
    t_stop_ns: int = 0  # CLOCK_MONOTONIC ns when the stop began
    faults_missed: bool = False  # a planned fault was never injected (the primary never served): the run failed
    # the programs supervisord was asked to start (autostart ones at its start, then the camera, foxglove)
    asked: list[str] = dataclasses.field(default_factory=lambda: ["twin", "record", "node", "control"])


def run(args: argparse.Namespace) -> int:
    """``chestnut launch``: refuse what cannot run (exit 2), start the stack, wait for it to come up, run it
    with its faults for ``--seconds``, stop it, and print the summary; returns the exit status
    (:func:`exit_code`). A Ctrl-C before the stack starts (the checks of :func:`prepare` can take seconds) is one
    line and exit 130, the shell's status for it (a SIGTERM: 143); from :func:`start` on, a stop signal stops it."""
    try:
        prepared = refusal_undone(lambda: prepare(args))  # refused: the runtime directory as it was found
    except KeyboardInterrupt as e:  # a SIGTERM too (launch/cli.py as_ctrl_c), which names itself in it
        name, code = stop_words(e)
        log.warning("stopped by %s before the stack started: nothing was started (exit %d)", name, code)
        return code
    if isinstance(prepared, int):
        return prepared
    launch = start(args, *prepared)
    try:
        if come_up(launch):
            start_foxglove(launch)
        drive(launch)
    finally:
        launch.t_stop_ns = time.monotonic_ns()
        log.info("stopping the stack")
        shut_down(launch.proc, launch.conf, launch.view, launch.prefix, launch.launch_id)
    code = verdict(launch, summary := finish_summary(launch))  # --json first: a reader gone (`| head`) exits 141
    print_summary(summary, launch.run_dir)
    return code


def prepare(args: argparse.Namespace) -> tuple[str, Path, Path] | int:
    """Everything before the stack starts: the arguments and the node configuration checked, the run
    directory made and supervisord's configuration written. Returns (prefix, run dir, configuration), or 2
    after one log line that names what is refused."""
    from chestnut.backend.errors import ChestnutError, ConfigError
    from chestnut.launch.assets import default_model_path
    from chestnut.msgs.paths import current_prefix

    try:
        node_toml = read_node_toml(args.node_config)
    except ConfigError as e:
        log.error("--node-config: %s", e.detail or e)
        return 2
    try:
        frames = frame_options(args, node_toml)
    except (ChestnutError, FileNotFoundError, ValueError) as e:  # the camera's source cannot be read
        log.error("--frames native: %s", e)
        return 2
    if (problem := argument_problem(args.seconds, args.rate, args.fault, frames)) is not None:
        log.error("%s", problem)
        return 2
    if args.node_config is not None:  # the node's own config check, before anything starts (or it is rewritten)
        from chestnut.node.config import load_config

        try:
            node_cfg = load_config(args.node_config)
        except ConfigError as e:
            log.error("--node-config: %s", e.detail or e)
            return 2
        model = node_cfg.model
        # a model the node could never read or load fails every start: said here, once, before anything starts
        fix = PREPARE_FIX if model.path == default_model_path() else ""  # the prepared one: prepare it again
        if (checked := check_model_file(model.path, "model", fix)).problem is not None:  # parsed once, for both
            log.error("--node-config: [model] path: %s", checked.problem)
            return 2
        fallback = node_cfg.fallback.path
        if fallback not in (None, model.path) and (problem := model_file_problem(fallback, "fallback model")):
            log.error("--node-config: [fallback] path: %s", problem)
            return 2
        if (problem := model_input_problem(model.path, model.input, model.shape, checked.model)) is not None:
            log.error("--node-config: %s", problem)
            return 2
        from chestnut.node.contract import start_problem

        if (problem := start_problem(node_cfg)) is not None:  # the output contract (node/contract.py)
            log.error("--node-config: %s", problem)
            return 2
    if args.foxglove is not None:  # a port in use would fail the server at every start, after the stack started
        from chestnut.launch.foxglove import DEFAULT_HOST, bind_problem

        if (found := bind_problem(DEFAULT_HOST, args.foxglove, "--foxglove PORT")) is not None:
            log.error("--foxglove %d: %s", args.foxglove, found[1])
            return 2
    if args.json and (problem := json_target_problem(args.json)) is not None:
        log.error("--json: %s", problem)
        return 2
    if shutil.which("supervisord", path=str(Path(sys.executable).parent)) is None:
        log.error("supervisord not found next to %s; run `bash launch/setup.sh`", sys.executable)
        return 2
    if args.node_config is None:
        if not default_model_path().is_file():
            log.error("the default model is not prepared: run `chestnut model prepare` (part of launch/setup.sh)")
            return 2
        if (problem := model_file_problem(default_model_path(), "the default model", PREPARE_FIX)) is not None:
            log.error("%s", problem)
            return 2
    prefix = current_prefix()
    check_stack_sockets(prefix, node_toml)  # a path planted at a socket or the dock's lock: 1 line, exit 2 (cli.py)
    if (other := running_stack(prefix)) is not None:
        log.error(
            "a stack is already running on prefix %r (%s); stop it first, or choose another prefix with "
            "CHESTNUT_PREFIX=NAME",
            prefix,
            other,
        )
        return 2
    from chestnut.msgs.messaging import check_publishable
    from chestnut.msgs.services import SERVICE_LIST

    for service in SERVICE_LIST:  # a planted lock file or socket path would stop one program after the start:
        check_publishable(service, prefix)  # said here, in one line, exit 2 (launch/cli.py), nothing started
    try:
        run_dir = make_run_dir(args.runs_dir)
    except OutputDirError as e:
        log.error("--runs-dir: %s", e)
        return 2
    node_args = ["--config", str(args.node_config.resolve())] if args.node_config else []
    if frames.node_config_changes or frames.node_timing_changes:  # the warp or --rate: this run's own node config
        try:
            node_conf = write_frame_node_config(run_dir, node_toml, frames)
        except ConfigError as e:
            log.error("--node-config: %s", e.detail or e)
            return 2
        node_args = ["--config", str(node_conf)]
        log.info(
            "node: %s for %s %s frames at %g Hz (%s)",
            ", ".join([f"model.{k} = {v!r}" for k, v in frames.node_config_changes.items()]
                      + [f"timing.{k} = {v:g}" for k, v in frames.node_timing_changes.items()]),
            frames.frames,
            frames.frame_format(),
            frames.rate_hz,
            node_conf,
        )
    conf = render_config(
        run_dir,
        prefix,
        args.rate,
        node_args,
        ["--engine", args.twin_engine, *frames.twin_args()],
        args.log_format,
        foxglove_port=args.foxglove if args.foxglove is not None else 8765,
        camera_args=frames.camera_args(),
        streaming_copies=frames.transport != "inline",
    )
    return prefix, run_dir, conf


def start(args: argparse.Namespace, prefix: str, run_dir: Path, conf: Path) -> Launch:
    """Start supervisord on ``conf`` (its programs but the camera) and what watches the run: the live view,
    the process sampler, the run's clock and the fault plans. The stop signals' handlers come first: a stop signal
    from here on is the run's (:class:`~chestnut.launch.signals.StopFlag`), never a traceback with the stack
    started."""
    from chestnut.launch.signals import StopFlag

    flag = StopFlag()
    from chestnut.launch.top import StackView

    launch_id = f"{os.getpid()}-{run_dir.name}"
    t_launch = time.monotonic_ns()
    proc = start_supervisord(conf, prefix, launch_id)
    log.info("stack launched under supervisord pid %d (run dir %s)", proc.pid, run_dir)
    clock = StackClock(run_dir / "logs", t_launch)
    return Launch(
        args=args,
        prefix=prefix,
        run_dir=run_dir,
        conf=conf,
        launch_id=launch_id,
        proc=proc,
        t_launch_ns=t_launch,
        flag=flag,
        view=StackView(),
        sampler=ProcessSampler(proc.pid),
        clock=clock,
        faults=FaultRunner(prefix, args.fault, clock),
    )


def come_up(launch: Launch) -> bool:
    """Wait for the node's first ``nodeState``, start the camera, wait for the first ``modelOutput``. False
    (and the stop flag set, the cause logged) when the stack did not come up; False too when a stop signal
    came meanwhile: it ends the wait at once and the camera is not started after it."""
    run_dir, conf, flag = launch.run_dir, launch.conf, launch.flag
    up = wait_for(launch.view, "nodeState", 120.0, conf, flag)
    if flag.stop:
        log.info("a stop signal came while the node came up: the camera is not started")
        return False
    if not up:
        log.error("the node did not come up; last lines of %s:\n%s", run_dir / "node.log",
                  read_tail(run_dir / "node.log", 1500))
        launch.failed_start = True
    else:
        launch.asked.append("camera")
        if (cam_rc := supervisorctl(conf, "start", "camera")) != 0:
            log.error("supervisorctl start camera: exit %d; see %s", cam_rc, run_dir / "camera.log")
            launch.failed_start = True
        elif not wait_for(launch.view, "modelOutput", 60.0, conf, flag) and not flag.stop:
            if (exits := node_exits(read_tail(run_dir / "supervisord.log"))) >= CRASH_LOOP_EXITS:
                log.error("the node exits at every start (%d exits before its first output; %s); %s",
                          exits, run_dir / "supervisord.log", last_words(read_tail(run_dir / "node.log")))
            else:
                log.error("no modelOutput within 60 s of starting the camera; see %s", run_dir)
            launch.failed_start = True
    if not launch.failed_start:
        return not flag.stop
    flag.stop = True
    if (code := launch.proc.poll()) is not None:
        launch.died = True
        log.error("supervisord exited (code %s) while the stack started; see %s", code, run_dir / "supervisord.log")
    return False


def start_foxglove(launch: Launch) -> None:
    """With ``--foxglove PORT``: start the Foxglove server (before the run's zero: starting it takes a second)."""
    port = launch.args.foxglove
    if port is None or launch.flag.stop:
        return
    launch.asked.append("foxglove")
    if supervisorctl(launch.conf, "start", "foxglove") == 0:
        if port == 0:  # the server chose a free port: it names it in its log
            log.info("Foxglove: on a free port, named in %s (layout launch/foxglove-layout.json)",
                     launch.run_dir / "foxglove.log")
        else:
            log.info("Foxglove: ws://127.0.0.1:%d (layout launch/foxglove-layout.json)", port)
    else:
        log.error("the Foxglove server did not start; see %s", launch.run_dir / "foxglove.log")


def run_over(now: float, end: float, fault_t0: float | None, plan_end_s: float, carried_out: bool) -> bool:
    """Whether a timed run past its ``--seconds`` (``end``, CLOCK_MONOTONIC s, at or before ``now``) is over.
    It is not cut short of its fault plan: once the plan's zero ``fault_t0`` has come (the first output, or
    the first ChestnutActive with ``--fault-from active``), the run goes on until the plan is ``carried_out``
    (every fault injected, and cleared where it has a DURATION) and :data:`FAULT_SETTLE_S` past the plan's end
    (``plan_end_s`` after its zero); a plan that ends by ``end`` ends the run on time. Without a zero (no
    ChestnutActive yet) the run ends on time and its planned faults are reported as never injected."""
    if fault_t0 is None:
        return True
    plan_end = fault_t0 + plan_end_s
    return carried_out and (plan_end <= end or now >= plan_end + FAULT_SETTLE_S)


def drive(launch: Launch) -> None:
    """The run itself: for ``--seconds`` after the first output (0: until Ctrl-C), or until supervisord ends,
    update the live view, carry out the fault plans and sample the processes."""
    from chestnut.launch.top import end_live_line, live_display

    args, view, proc, flag = launch.args, launch.view, launch.proc, launch.flag
    t0 = time.monotonic()
    launch.sampler.start_mark = t0 + SAMPLE_SETTLE_S
    log.info("clock: times are s since the stack's first message, %s", launch.clock.wall_start())
    fault_t0: float | None = t0 if args.fault_from == "output" else None  # the fault plans' zero
    if fault_t0 is not None:
        launch.faults.log_plan(launch.clock.seconds(int(fault_t0 * NS)))
    next_sample = 0.0
    with live_display(view, 4, on=not args.no_live) as live:
        next_draw = 0.0
        extended = False
        while not flag.stop and proc.poll() is None:
            now = time.monotonic()
            if args.seconds > 0 and now - t0 >= args.seconds:
                if fault_t0 is None or run_over(now, t0 + args.seconds, fault_t0, launch.faults.plan_end_s,
                                                launch.faults.carried_out):
                    break
                if not extended:
                    extended = True
                    log.info("the run goes on past --seconds %g until its planned faults are carried out "
                             "(the last at %.1f s) and %g s more", args.seconds,
                             launch.clock.seconds(int((fault_t0 + launch.faults.plan_end_s) * NS)), FAULT_SETTLE_S)
            view.update(50)
            if fault_t0 is None and view.first_active_ns is not None:  # --fault-from active: the primary serves
                fault_t0 = view.first_active_ns / NS
                launch.faults.log_plan(launch.clock.seconds(view.first_active_ns))
            if fault_t0 is not None:
                launch.faults.step(time.monotonic() - fault_t0)
            if time.monotonic() >= next_sample:
                launch.sampler.sample()
                next_sample = time.monotonic() + 1.0
            if time.monotonic() >= next_draw:
                live.update(view.render())
                next_draw = time.monotonic() + 0.25
    end_live_line(live)
    if launch.faults.pending:
        launch.faults_missed = not flag.stop  # asked for and never done: the run did not test what it was to
        log.error("%d planned fault(s) not injected: %s", len(launch.faults.pending),
                  "the run ended first" if fault_t0 is not None else "the primary never served (no ChestnutActive)")
    if (code := proc.poll()) is not None and not flag.stop:
        launch.died = True
        log.error("supervisord exited (code %s) before the end of the run; see %s", code,
                  launch.run_dir / "supervisord.log")


def finish_summary(launch: Launch) -> dict[str, Any]:
    """The run's summary from its log (:func:`~chestnut.launch.summary.summarize`) with what launch itself
    knows (the stop time and a signal that cut the run short, the fault schedule, in ``faults.json`` with the twin's
    fault events, the processes, the contracts and the report); :func:`run` prints it."""
    run_dir = launch.run_dir
    summary = summarize(run_dir / "logs", launch.t_launch_ns)
    summary.update(stop_figures(summary, launch.t_launch_ns, launch.t_stop_ns, launch.flag, launch.args.seconds))
    summary["fault_schedule"] = launch.faults.schedule_rows(summary["t_zero_ns"] or launch.t_launch_ns)
    summary["outputs_lost"] = write_run_file(run_dir / "faults.json", faults_file_text(summary))
    summary["processes"] = launch.sampler.report()
    from chestnut.launch.restarts import last_error, run_restarts

    summary["restarts"] = run_restarts(run_dir, summary.get("wall_start_ns") or 0)  # cause, frames lost
    summary["recorder_words"] = last_error(run_dir / "record.log")  # why the log may end early (a full disk)
    summary["programs_not_started"] = not_started_lines(run_dir, launch.asked)  # each: why, its last error
    summary["contracts"], summary["report"] = check_contracts(run_dir, summary["fault_schedule"], summary.get(
        "wall_start") or None, list_violations=not launch.failed_start, lost=summary["outputs_lost"])
    return summary


def verdict(launch: Launch, summary: dict[str, Any]) -> int:
    """The exit status (:func:`exit_code`) of the run ``summary`` tells; writes ``--json``."""
    args = launch.args
    json_lost = False  # the summary asked for could not be written: the run's caller cannot read its verdict
    if args.json and (problem := write_summary_json(args.json, summary)) is not None:
        log.error("--json: %s", problem)
        json_lost = True
    # which frames were owed an output is the contract check's call (one_output_per_frame): a node restarted
    # under supervision owes nothing for the frames sent while none ran, which missing_outputs still lists
    if (never := dock_never_taken(summary)) is not None:  # its lock file refused every start of the primary
        log.error("%s", never)
    ok = summary["outputs"] > 0 and bool(summary["contracts"]) and not any(summary["contracts"].values())
    ok = ok and not launch.died and not launch.failed_start and not json_lost and not launch.faults_missed
    ok = ok and never is None
    ok = ok and not summary.get("programs_not_started") and not summary.get("outputs_lost")  # never ran, unwritten
    return exit_code(ok, args.seconds, launch.flag.signum)


def exit_code(ok: bool, seconds: float, signum: int | None) -> int:
    """``chestnut launch``'s exit status: ``ok`` -- the run and its contracts were clean; ``seconds`` -- the
    ``--seconds`` asked (0: until stopped); ``signum`` -- the stop signal it ended on (SIGINT: Ctrl-C, SIGTERM:
    a process manager or ``kill``), None when it was not stopped. 128 + the signal (the shell's convention: 130,
    143) only for a timed run cut short, so a script can tell it did not run its time; with ``seconds == 0`` a
    stop signal is the normal end."""
    if signum is not None and seconds > 0:
        return 128 + signum
    return 0 if ok else 1
