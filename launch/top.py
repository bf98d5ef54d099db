"""``chestnut top``: a live terminal view of the stack (rich).

Shows the node's state and why, ``ChestnutActive`` and the serving source, each health layer's
level and reason, input and output frame rates, latencies, frame drops, worker restarts and the
control daemon's state. :class:`StackView` is also used by ``chestnut launch`` for its live status.

Nothing stale is shown as live: a value whose service has sent nothing for :data:`STALE_PERIODS` of its
periods (at least :data:`STALE_MIN_S`; rates from ``msgs/services.py``) is drawn dim with "stale N s"
(:func:`stale_s`), and a service never heard from says "no data". The node's primary worker is
labelled ``worker pid N`` (``no worker`` when ``nodeState.workerPid`` is 0).
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from typing import Any

import numpy as np
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from chestnut.launch.signals import StopFlag
from chestnut.msgs.argtypes import checked_float, run_seconds
from chestnut.msgs.messaging import SubMaster
from chestnut.msgs.services import get_service, soft_disable_left

SERVICES = ["cameraFrame", "modelOutput", "chestnutActive", "chestnutHealth", "nodeState", "controlState"]
MAX_REFRESH_HZ = 20.0  # --refresh-hz: the view polls the bus every 50 ms (StackView.update(50)) between redraws
MIN_REFRESH_HZ = 0.2
"""``--refresh-hz`` lower bound, Hz: a redraw at least every 5 s, SubMaster's long rate window (``msgs/submaster.py``
``LONG_WINDOW_S``), so no window of the rates shown passes undrawn; at 1e-300 Hz the view never redrew."""
LEVEL_STYLE = {"ok": "green", "warn": "yellow", "error": "bold red", "stale": "magenta"}
NS = 1e9
STALE_PERIODS = 3.0  # a service silent for this many of its periods is shown stale ...
STALE_MIN_S = 0.5  # ... and never sooner than this (s): a 20 Hz service is stale after 0.5 s, nodeState after 3 s
STALE_STYLE = "dim"


def stale_s(now_ns: int, recv_ns: int, frequency_hz: float) -> float | None:
    """Seconds since the service's last message if that is too long ago to show it as live, else None.

    ``frequency_hz`` 0 (on demand) is never stale; ``recv_ns`` 0 (never received) is ``inf``."""
    if frequency_hz <= 0:
        return None
    if not recv_ns:
        return float("inf")
    age = (now_ns - recv_ns) / NS
    return age if age > max(STALE_PERIODS / frequency_hz, STALE_MIN_S) else None


def _stale_text(age: float | None) -> str:
    if age is None:
        return ""
    return "no data" if age == float("inf") else f"stale {age:.0f} s"


class StackView:
    """Reads the stack's services and renders them. ``update(timeout_ms)`` then ``render()``."""

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = prefix
        self.sm = SubMaster(SERVICES, poll="modelOutput", prefix=prefix, ignore_alive=["controlState"])
        self.exec_ms: deque[float] = deque(maxlen=100)
        self.age_ms: deque[float] = deque(maxlen=100)
        self.outputs_by_source: dict[str, int] = {}
        self.frames_in = 0
        self.cam_times: deque[int] = deque(maxlen=41)
        self.out_times: deque[int] = deque(maxlen=41)
        self.first_active_ns: int | None = None  # CLOCK_MONOTONIC ns the first ChestnutActive true was read

    def update(self, timeout_ms: int = 100) -> None:
        self.sm.update(timeout_ms)
        now = self.sm.mono_time_ns()
        if self.first_active_ns is None and self.sm.updated["chestnutActive"] and self.sm["chestnutActive"].active:
            self.first_active_ns = now
        if self.sm.updated["cameraFrame"]:
            self.frames_in += 1
            self.cam_times.append(now)
        if self.sm.updated["modelOutput"]:
            mo = self.sm["modelOutput"]
            self.exec_ms.append(mo.executionTime * 1e3)
            self.age_ms.append(mo.frameAge * 1e3)
            src = str(mo.source)
            self.outputs_by_source[src] = self.outputs_by_source.get(src, 0) + 1
            self.out_times.append(now)

    @staticmethod
    def _rate(times: deque[int]) -> float:
        return (len(times) - 1) / ((times[-1] - times[0]) / NS) if len(times) > 2 and times[-1] > times[0] else 0.0

    def stale(self, service: str, now_ns: int) -> float | None:
        """:func:`stale_s` of one service at ``now_ns``."""
        return stale_s(now_ns, self.sm.recv_time_ns[service], get_service(service).frequency_hz)

    def render(self, now_ns: int | None = None) -> Group:
        sm = self.sm
        now = sm.mono_time_ns() if now_ns is None else now_ns
        ns, ca, ctl = sm["nodeState"], sm["chestnutActive"], sm["controlState"]
        if not any(sm.seen.values()):
            from chestnut.msgs.paths import current_prefix

            return Group(Text(f"nothing is publishing on prefix {self.prefix or current_prefix()!r} yet "
                              "(start a stack: chestnut launch; or set CHESTNUT_PREFIX)", style="yellow"))
        st = {s: self.stale(s, now) for s in SERVICES}
        head = Table.grid(padding=(0, 2))
        if st["chestnutActive"] is not None:
            head.add_row(Text("ChestnutActive", style=STALE_STYLE), Text(_stale_text(st["chestnutActive"]),
                         style="bold magenta"), Text(f"last: {'active' if ca.active else 'inactive'}, source "
                                                     f"{ca.source}", style=STALE_STYLE), "")
        else:
            active = Text("ACTIVE", style="bold green") if ca.active else Text("INACTIVE", style="bold red")
            head.add_row("ChestnutActive", active, f"source: {ca.source}", f"reason: {ca.reason}")
        worker = f"worker pid {ns.workerPid}" if ns.workerPid else "no worker"
        if st["nodeState"] is not None:
            head.add_row(Text("node", style=STALE_STYLE), Text(_stale_text(st["nodeState"]), style="bold magenta"),
                         Text(f"last: {ns.state}, {worker}, restarts {ns.restarts}", style=STALE_STYLE), "")
        else:
            head.add_row("node", Text(str(ns.state), style="bold"), f"{worker}  restarts {ns.restarts}",
                         f"reason: {ns.reason}")
        ctl_txt = "ENGAGED" if ctl.engaged else "disengaged"
        if ctl.softDisabling:
            ctl_txt = f"SOFT DISABLE {soft_disable_left(ctl.softDisableRemaining)}"
        if st["controlState"] is not None:
            head.add_row(Text("control", style=STALE_STYLE), Text(_stale_text(st["controlState"]),
                                                                  style="bold magenta"),
                         Text(f"last: {ctl_txt}", style=STALE_STYLE), "")
        else:
            head.add_row("control", ctl_txt, "events: " + ", ".join(ctl.events), "")
        health_stale = st["chestnutHealth"]
        layers = Table(title="health" + (f" ({_stale_text(health_stale)})" if health_stale is not None else ""),
                       expand=False, style=STALE_STYLE if health_stale is not None else "")
        for col in ("layer", "level", "reason", "changed"):
            layers.add_column(col)
        for lh in sm["chestnutHealth"].layers:
            lvl = str(lh.level)
            age = f"{(now - lh.lastChange) / NS:.1f} s ago" if lh.lastChange else "-"
            style = STALE_STYLE if health_stale is not None else LEVEL_STYLE.get(lvl, "")
            layers.add_row(str(lh.layer), Text(lvl.upper(), style=style), lh.reason, age,
                           style=STALE_STYLE if health_stale is not None else None)
        out_stale = st["modelOutput"]
        rates = Table(title="frames" + (f" (outputs {_stale_text(out_stale)})" if out_stale is not None else ""),
                      expand=False)
        for col in ("in Hz", "out Hz", "exec p50/p99 ms", "age p50 ms", "drop %", "by source"):
            rates.add_column(col)
        ex = np.array(self.exec_ms) if self.exec_ms else np.zeros(1)
        ag = np.array(self.age_ms) if self.age_ms else np.zeros(1)
        cam_hz = 0.0 if st["cameraFrame"] is not None else self._rate(self.cam_times)
        out_hz = 0.0 if out_stale is not None else self._rate(self.out_times)
        rates.add_row(f"{cam_hz:.1f}", f"{out_hz:.1f}",
                      f"{np.percentile(ex, 50):.1f} / {np.percentile(ex, 99):.1f}", f"{np.percentile(ag, 50):.1f}",
                      f"{sm['modelOutput'].frameDropPerc:.2f}",
                      ", ".join(f"{k} {v}" for k, v in sorted(self.outputs_by_source.items())),
                      style=STALE_STYLE if out_stale is not None else None)
        checks = "  ".join(
            f"{s}: {'ok' if st[s] is None and sm.valid[s] else (_stale_text(st[s]) or 'NOT OK')}" for s in SERVICES[1:5]
        )
        return Group(head, layers, rates, Text(checks, style="dim"))

    def close(self) -> None:
        self.sm.close()


def refresh_hz_arg(text: str) -> float:
    """``--refresh-hz``: redraws per second, Hz, a number in [:data:`MIN_REFRESH_HZ`, :data:`MAX_REFRESH_HZ`]; raises
    ``argparse.ArgumentTypeError`` (one line) for anything else, nan and inf included."""
    return checked_float(text, lambda hz: MIN_REFRESH_HZ <= hz <= MAX_REFRESH_HZ,
                         f"give a refresh rate in [{MIN_REFRESH_HZ:g}, {MAX_REFRESH_HZ:g}] Hz (default 4)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seconds", type=run_seconds, default=0.0, help="stop after this long, s (0 = until Ctrl-C, the default)"
    )
    p.add_argument(
        "--refresh-hz",
        type=refresh_hz_arg,
        default=4.0,
        help=f"redraws per second, Hz (default 4, {MIN_REFRESH_HZ:g} to {MAX_REFRESH_HZ:g})",
    )
    p.add_argument("--prefix", help="the stack's runtime prefix (default: $CHESTNUT_PREFIX)")


class _NoLive:
    """What a view drawn nowhere (``chestnut launch --no-live``) is drawn with."""

    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, *_a: object) -> None:
        return None


def live_display(view: StackView, refresh_hz: float, on: bool = True) -> Any:
    """A context manager drawing ``view``: rich's ``Live`` refreshed ``refresh_hz`` times a second, or with
    ``on`` false a stand-in that draws nothing; either has ``update(renderable)``."""
    return Live(view.render(), refresh_per_second=refresh_hz) if on else _NoLive()


def end_live_line(live: Any) -> None:
    """End the live view's last frame with a newline: off a terminal, rich's ``Live`` leaves its final frame
    without one, and the next output would continue that line."""
    console = getattr(live, "console", None)
    if console is not None and not console.is_terminal:
        console.line()


def run(args: argparse.Namespace) -> int:
    flag = StopFlag()
    view = StackView(args.prefix)
    t_end = time.monotonic() + args.seconds if args.seconds > 0 else float("inf")
    try:
        with live_display(view, args.refresh_hz) as live:
            next_draw = 0.0
            while not flag.stop and time.monotonic() < t_end:
                view.update(50)
                if time.monotonic() >= next_draw:
                    live.update(view.render())
                    next_draw = time.monotonic() + 1 / args.refresh_hz
        end_live_line(live)
    finally:
        view.close()
    return 0
