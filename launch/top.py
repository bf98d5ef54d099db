"""``chestnut top``: a live terminal view of the stack (rich).

Shows the node's state and why, ``ChestnutActive`` and the serving source, each health layer's
level and reason, input and output frame rates, latencies, frame drops, worker restarts and the
control daemon's state. :class:`StackView` is also used by ``chestnut launch`` for its live status.
"""

from __future__ import annotations

import argparse
import time
from collections import deque

import numpy as np
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from chestnut.launch.signals import StopFlag
from chestnut.msgs.messaging import SubMaster

SERVICES = ["cameraFrame", "modelOutput", "chestnutActive", "chestnutHealth", "nodeState", "controlState"]
LEVEL_STYLE = {"ok": "green", "warn": "yellow", "error": "bold red", "stale": "magenta"}
NS = 1e9


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

    def update(self, timeout_ms: int = 100) -> None:
        self.sm.update(timeout_ms)
        now = self.sm.mono_time_ns()
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

    def render(self) -> Group:
        sm = self.sm
        now = sm.mono_time_ns()
        ns, ca, ctl = sm["nodeState"], sm["chestnutActive"], sm["controlState"]
        if not any(sm.seen.values()):
            from chestnut.msgs.paths import current_prefix

            return Group(Text(f"nothing is publishing on prefix {self.prefix or current_prefix()!r} yet "
                              "(start a stack: chestnut launch; or set CHESTNUT_PREFIX)", style="yellow"))
        head = Table.grid(padding=(0, 2))
        active = Text("ACTIVE", style="bold green") if ca.active else Text("INACTIVE", style="bold red")
        head.add_row("ChestnutActive", active, f"source: {ca.source}", f"reason: {ca.reason}")
        head.add_row("node", Text(str(ns.state), style="bold"), f"pid {ns.workerPid}  restarts {ns.restarts}",
                     f"reason: {ns.reason}")
        ctl_txt = "ENGAGED" if ctl.engaged else "disengaged"
        if ctl.softDisabling:
            ctl_txt = f"SOFT DISABLE {ctl.softDisableRemaining:.1f} s"
        head.add_row("control", ctl_txt, "events: " + ", ".join(ctl.events), "")
        layers = Table(title="health", expand=False)
        for col in ("layer", "level", "reason", "changed"):
            layers.add_column(col)
        for lh in sm["chestnutHealth"].layers:
            lvl = str(lh.level)
            age = f"{(now - lh.lastChange) / NS:.1f} s ago" if lh.lastChange else "-"
            layers.add_row(str(lh.layer), Text(lvl.upper(), style=LEVEL_STYLE.get(lvl, "")), lh.reason, age)
        rates = Table(title="frames", expand=False)
        for col in ("in Hz", "out Hz", "exec p50/p99 ms", "age p50 ms", "drop %", "by source"):
            rates.add_column(col)
        ex = np.array(self.exec_ms) if self.exec_ms else np.zeros(1)
        ag = np.array(self.age_ms) if self.age_ms else np.zeros(1)
        rates.add_row(f"{self._rate(self.cam_times):.1f}", f"{self._rate(self.out_times):.1f}",
                      f"{np.percentile(ex, 50):.1f} / {np.percentile(ex, 99):.1f}", f"{np.percentile(ag, 50):.1f}",
                      f"{sm['modelOutput'].frameDropPerc:.2f}",
                      ", ".join(f"{k} {v}" for k, v in sorted(self.outputs_by_source.items())))
        checks = "  ".join(f"{s}: {'ok' if sm.alive[s] and sm.valid[s] else 'NOT OK'}" for s in SERVICES[1:5])
        return Group(head, layers, rates, Text(checks, style="dim"))

    def close(self) -> None:
        self.sm.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0 = until Ctrl-C)")
    p.add_argument("--refresh-hz", type=float, default=4.0)
    p.add_argument("--prefix", help="the stack's runtime prefix (default: $CHESTNUT_PREFIX)")


def run(args: argparse.Namespace) -> int:
    flag = StopFlag()
    view = StackView(args.prefix)
    t_end = time.monotonic() + args.seconds if args.seconds > 0 else float("inf")
    try:
        with Live(view.render(), refresh_per_second=args.refresh_hz, screen=False) as live:
            next_draw = 0.0
            while not flag.stop and time.monotonic() < t_end:
                view.update(50)
                if time.monotonic() >= next_draw:
                    live.update(view.render())
                    next_draw = time.monotonic() + 1 / args.refresh_hz
    finally:
        view.close()
    return 0
