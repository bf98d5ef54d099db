"""The restarts of a launched run, for ``chestnut launch``'s summary: every program supervisord restarted
(its exit status or signal, from supervisord's own log) and every primary worker the node restarted, each
with its time on the run's one clock (s since the log's first message), its cause and the frames it cost.

supervisord writes ``exited: <program> (<exit status N | terminated by SIGNAME>; [not ]expected)`` when a
program exits and ``spawned: '<program>' with pid N`` when it starts one (supervisor's ``process.py``
wording), in local time with milliseconds. The frames a restart cost come from the log
(:mod:`chestnut.node.offline.restarts`): for the node, the camera frames logged while no node process ran
that got no ``modelOutput``; for the twin and a worker, the outputs the primary did not serve until it
served again.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NS = 1_000_000_000
_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \w+ (exited|spawned): '?([\w-]+)'? ?(.*)$")
MATCH_WINDOW_S = 10.0
"""A program's exit and the log's restart of it are the same when this close (s; our choice: a restart's
silence in the log starts at the process's last message, which a killed node sends within a frame period
of its death, and supervisord logs the exit within its own poll, well under a second)."""


@dataclass(frozen=True)
class Exit:
    """One ``exited:`` line: the Unix time (ns), the program, its cause and whether supervisord restarted it."""

    wall_ns: int
    program: str
    cause: str
    restarted: bool


def supervisor_exits(supervisord_log: str) -> list[Exit]:
    """Each program exit in supervisord's log, with whether a ``spawned:`` of the same program followed it."""
    events: list[tuple[int, str, str, str]] = []
    for line in supervisord_log.splitlines():
        m = _LINE.match(line.strip())
        if m is None:
            continue
        stamp, ms, verb, program, rest = m.groups()
        wall_ns = int(time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) * NS) + int(ms) * 1_000_000
        events.append((wall_ns, verb, program, rest.strip()))
    out = []
    for i, (wall_ns, verb, program, rest) in enumerate(events):
        if verb != "exited":
            continue
        cause = rest.strip("()").split(";")[0].strip() or "exited"
        again = any(v == "spawned" and p == program for _, v, p, _ in events[i + 1:])
        out.append(Exit(wall_ns, program, cause, again))
    return out


def last_error(program_log: Path) -> str:
    """``its last error: LINE`` of a program's log (``launch/supervise.py`` ``last_words``) when it has an ERROR
    line, else ""; the log's last 64 KiB are read."""
    from chestnut.launch.supervise import last_words, read_tail

    words = last_words(read_tail(program_log, 65536))
    return words if words.startswith("its last error: ") else ""


def run_restarts(run_dir: Path, wall_start_ns: int) -> list[dict[str, Any]]:
    """The run's restarts as JSON-ready dicts (``t_s``, ``what``, ``cause``, ``frames_lost``, ``back_s``), in
    time order: each program supervisord restarted (``wall_start_ns``: the Unix ns of the log's first message,
    the summary's clock), matched with the log's account of it for the frames it cost, and each worker the
    node restarted. Empty when the run has neither log nor supervisord log."""
    from chestnut.node.offline.restarts import Restart, node_restarts, twin_restarts, worker_restarts
    from chestnut.node.offline.timeline import read_timeline

    try:
        text = (run_dir / "supervisord.log").read_text(errors="replace")
    except OSError:
        text = ""
    try:
        tl = read_timeline([run_dir / "logs"])
    except FileNotFoundError:
        tl = None
    out: list[dict[str, Any]] = []
    logged: dict[str, list[Restart]] = {"node": node_restarts(tl), "twin": twin_restarts(tl)} if tl else {}
    for e in supervisor_exits(text):
        if not e.restarted:
            continue
        t_s = round((e.wall_ns - wall_start_ns) / NS, 3) if wall_start_ns else None
        near: Restart | None = None
        if tl is not None and t_s is not None:
            at = t_s
            seen = logged.get(e.program, [])
            near = min(seen, key=lambda r: abs(tl.seconds(r.t_ns) - at), default=None)
            if near is not None and abs(tl.seconds(near.t_ns) - at) > MATCH_WINDOW_S:
                near = None
            if near is not None:
                seen.remove(near)
        back = round(tl.seconds(near.back_ns), 3) if tl is not None and near is not None and near.back_ns else None
        cause = e.cause
        if cause.startswith("exit status") and (words := last_error(run_dir / f"{e.program}.log")):
            cause = f"{cause}; {words}"  # why it exited, as its own log says (a full disk, a bad argument)
        out.append({"t_s": t_s, "what": e.program, "cause": cause,
                    "frames_lost": near.frames if near is not None else None, "back_s": back})
    if tl is not None:
        for r in worker_restarts(tl):
            out.append({"t_s": round(tl.seconds(r.t_ns), 3), "what": "worker", "cause": r.cause,
                        "frames_lost": r.frames, "back_s": round(tl.seconds(r.back_ns), 3) if r.back_ns else None})
    return sorted(out, key=lambda d: (d["t_s"] is None, d["t_s"] or 0.0, d["what"]))


def restart_lines(restarts: list[dict[str, Any]]) -> list[str]:
    """:func:`restart_line` of each restart, in order, except that a run of restarts of one program for one cause
    whose cost is unknown (a crash loop: a recorder on a full disk restarted every few seconds) is one line,
    ``restart 5.0 s: record (exit status 1; its last error: ...), log messages meanwhile lost; 6 more the same
    way, the last at 21.7 s``."""
    out: list[str] = []
    i = 0
    while i < len(restarts):
        r, j = restarts[i], i + 1
        while (j < len(restarts) and r.get("frames_lost") is None and restarts[j].get("frames_lost") is None
               and (restarts[j]["what"], restarts[j]["cause"]) == (r["what"], r["cause"])):
            j += 1
        line = restart_line(r)
        if j - i > 1:
            last = restarts[j - 1].get("t_s")
            line += f"; {j - i - 1} more the same way" + (f", the last at {last:.1f} s" if last is not None else "")
        out.append(line)
        i = j
    return out


def restart_line(r: dict[str, Any]) -> str:
    """``"restart 9.4 s: node (terminated by SIGKILL), 18 frame(s) unanswered, serving again at 11.2 s"`` (a
    worker's or the twin's: frames "answered by the fallback", ``chestnut.node.offline.restarts.frames_text``)."""
    from chestnut.node.offline.restarts import frames_text

    when = f"{r['t_s']:.1f} s" if r.get("t_s") is not None else "time unknown"
    lost = frames_text(r["what"], r.get("frames_lost"))
    back = f", serving again at {r['back_s']:.1f} s" if r.get("back_s") is not None else ""
    return f"restart {when}: {r['what']} ({r['cause']}), {lost}{back}"

