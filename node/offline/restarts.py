"""Every restart a log shows, with its time, cause and the frames it cost (``chestnut check``, the report).

- **node**: one node process ends and another starts (:func:`~chestnut.node.offline.timeline.node_sessions`).
  Its cause as the log shows it: ``stopped`` when the old process published ``nodeState`` stopping, else
  killed or crashed (a process killed by a signal says nothing; its exit status or signal is the process
  manager's to give: ``chestnut launch``'s summary names it from supervisord's log). Frames it cost: camera
  frames logged from the old process's last output (those in flight when it died among them) to the new
  one's first output that got no ``modelOutput`` at all.
- **worker**: ``nodeState.restarts`` (worker spawns after the first, ``node/supervisor.py``) goes up within
  one node process. Time and cause: the failover before it (the ``nodeState`` entering ``degraded``, whose
  reason names the failure, e.g. ``primary_fault: worker died (killed by SIGKILL)``). Frames it cost: outputs
  after the primary's last one before the failover, up to its next one, that the primary did not serve.
- **twin**: ``twinState`` (1 Hz) silent for over :data:`TWIN_SILENCE_S` and then back: the twin process
  restarted or stalled (the log cannot tell them apart, and names no exit status). Frames it cost: outputs
  in the silence that the primary did not serve.

Times are ``logMonoTime`` ns; a window that touches unreadable log is still listed (restarts are accounts,
not verdicts).
"""

from __future__ import annotations

from dataclasses import dataclass

from chestnut.node.offline.contracts import streams
from chestnut.node.offline.timeline import NS_PER_S, NodeStateRec, Timeline

TWIN_SILENCE_S = 3.0
"""A ``twinState`` silence this long (s) is a twin restart or stall: 3 periods at its 1 Hz (our choice; a
loaded host delays one message, not three)."""


@dataclass(frozen=True)
class Restart:
    """One restart: when the old process went or failed (``t_ns``), ``what`` restarted (node, worker or twin),
    its ``cause``, the ``frames`` it cost and when service resumed (``back_ns``; None: not in the log)."""

    t_ns: int
    what: str
    cause: str
    frames: int
    back_ns: int | None

    def line(self, tl: Timeline) -> str:
        """``"node restart at 12.345 s: killed or crashed ...; 18 frame(s) unanswered; back at 12.900 s"`` -- or,
        for a worker or the twin, whose frames the fallback answered meanwhile, ``"...; 80 frame(s) answered by
        the fallback; ..."`` (:func:`frames_text`)."""
        back = f"; back at {tl.seconds(self.back_ns):.3f} s" if self.back_ns is not None else "; not back in the log"
        return (f"{self.what} restart at {tl.seconds(self.t_ns):.3f} s: {self.cause}; "
                f"{frames_text(self.what, self.frames)}{back}")


def frames_text(what: str, frames: int | None) -> str:
    """What a restart of ``what`` cost in frames: a node's restart leaves frames with no output at all
    ("unanswered"); a worker's or the twin's, frames the primary did not serve -- answered by the fallback. The
    recorder's restart costs no frame, only the log what was sent while it was down."""
    if frames is None:
        return "messages sent meanwhile not logged" if what == "record" else "frames unknown"
    return f"{frames} frame(s) unanswered" if what == "node" else f"{frames} frame(s) answered by the fallback"


def node_restarts(tl: Timeline) -> list[Restart]:
    """The node process restarts (see the module docstring)."""
    out: list[Restart] = []
    if len(tl.sessions) < 2:
        return out
    frame_k, output_k = streams(tl)
    answered = {(k, o.frame_id) for o, k in zip(tl.outputs, output_k, strict=True)}
    for old, new in zip(tl.sessions, tl.sessions[1:], strict=False):
        first_out = next((o.t_ns for o in tl.outputs if o.t_ns >= new.start_ns), None)
        end = first_out if first_out is not None else tl.end_ns
        last_out = max((o.t_ns for o in tl.outputs if old.start_ns <= o.t_ns <= old.end_ns), default=old.start_ns)
        lost = {(k, f.frame_id) for f, k in zip(tl.frames, frame_k, strict=True)
                if last_out < f.t_ns <= end and (k, f.frame_id) not in answered}
        cause = (f"stopped (nodeState stopping at {tl.seconds(old.stopping_ns):.3f} s)" if old.stopping_ns is not None
                 else "killed or crashed: it published no stopping (the log holds no exit status or signal)")
        out.append(Restart(old.end_ns, "node", f"{cause}; the new process started at {tl.seconds(new.start_ns):.3f} s",
                           len(lost), first_out))
    return out


def worker_restarts(tl: Timeline) -> list[Restart]:
    """The primary worker restarts within each node process (see the module docstring)."""
    out: list[Restart] = []
    prev: NodeStateRec | None = None
    failover: NodeStateRec | None = None
    for s in tl.node_states:
        if prev is not None and tl.session_at(prev.t_ns) != tl.session_at(s.t_ns):
            prev, failover = None, None
        if s.state == "degraded" and (prev is None or prev.state != "degraded"):
            failover = s
        if prev is not None and s.restarts > prev.restarts:
            since = failover if failover is not None else s
            last_good = max((o.t_ns for o in tl.outputs if o.source == "primary" and o.t_ns < since.t_ns), default=0)
            outs = [o for o in tl.outputs if o.t_ns > last_good and tl.session_at(o.t_ns) == tl.session_at(s.t_ns)]
            back = next((o.t_ns for o in outs if o.source == "primary"), None)
            lost = sum(1 for o in outs if back is None or o.t_ns < back)
            cause = since.reason or f"nodeState {since.state}"
            out.append(Restart(since.t_ns, "worker", cause, lost, back))
            failover = None
        prev = s
    return out


def twin_restarts(tl: Timeline) -> list[Restart]:
    """The twin's restarts or stalls (see the module docstring)."""
    out: list[Restart] = []
    limit = int(TWIN_SILENCE_S * NS_PER_S)
    for a, b in zip(tl.twins, tl.twins[1:], strict=False):
        if b.t_ns - a.t_ns > limit:
            lost = sum(1 for o in tl.outputs if a.t_ns < o.t_ns <= b.t_ns and o.source != "primary")
            out.append(Restart(a.t_ns, "twin", f"twinState silent {(b.t_ns - a.t_ns) / NS_PER_S:.1f} s (a restart "
                               "or a stall; the log holds no exit status)", lost, b.t_ns))
    return out


def restarts(tl: Timeline) -> list[Restart]:
    """Every node, worker and twin restart in ``tl``, in time order."""
    return sorted(node_restarts(tl) + worker_restarts(tl) + twin_restarts(tl), key=lambda r: (r.t_ns, r.what))

