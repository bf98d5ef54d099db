"""``chestnut check``: the node's contracts, checked over a whole log.

A log is read into a :class:`~chestnut.node.offline.timeline.Timeline` (light records in ``logMonoTime``
order, the damage, the node's processes as :class:`~chestnut.node.offline.timeline.Session`). Each
contract is a small function over it, registered by name in :data:`CONTRACTS`; it yields every
:class:`~chestnut.node.offline.timeline.Violation` it finds, with its time and frame id. Each one's
docstring says what it means for gaps, duplicates and restarts; ``docs/contracts.md`` says the same.

=======================  ==================================================================================
contract                 holds when (source of the rule)
=======================  ==================================================================================
log_intact               every log file reads to its end (damage is reported with its byte offset; the rest
                         is still checked) and every node message carries its time (``logMonoTime`` 0 or
                         absurd is reported; another publisher's is an input anomaly)
one_output_per_frame     every distinct ``cameraFrame`` a running node owes gets exactly one ``modelOutput``
                         (``docs/architecture.md``): repeated ids are owed nothing; frames logged while no
                         node ran, or still in flight when their node died or stopped or the log ended, or
                         whose answer fell into unreadable log, are not judged
frame_ids_increase       ``frameId`` strictly increases within ``modelOutput`` (the camera's: an anomaly);
                         skipped ids are allowed; a camera restart (an id more than 20 lower) starts a
                         stream the outputs follow once
deadline_or_fallback     no ``modelOutput`` from the primary later than its frame's deadline + slack after
                         its frame's ``timestampEof``: the deadline the node published for that frame
                         (``modelOutput.deadline``, the adaptive deadline in force, ``docs/health.md``), at
                         most ``timing.deadline_ms`` (150 ms, openpilot modeld), which older logs use
active_only_when_healthy ``chestnutActive.active`` is never true while a layer is not OK (an advisory WARN,
                         a stage over its share with the deadline not at risk, counts as OK; the layer's level
                         at that instant, reconstructed from the same node process's ``chestnutHealth`` and
                         each layer's ``lastChange``) or while its source is not the primary; a frame served
                         by the fallback never leaves a consumer believing a live (not stale) ``active``
                         (``docs/health.md``)
switch_has_reason        every change of ``modelOutput.source`` between primary and fallback within one node
                         process is announced with a reason, after the previous output and before the next
                         output: a ``nodeState`` with a reason, or a ``chestnutActive`` naming the new source
                         with a reason (the node publishes the output, then ``chestnutActive``, then
                         ``nodeState``: ``node/main.py``)
control_disengages       ``controlState.engaged`` never starts while ``chestnutActive`` is false or stale,
                         and never lasts longer than the soft-disable time (3 s, openpilot) + slack after
                         ``chestnutActive`` went false or stale or ``canEngage`` went false
health_not_silent        within a node process, ``chestnutHealth`` never silent longer than its service
                         allows: 10 / f (cereal's *alive*; 5 Hz -> 2 s, :data:`~chestnut.msgs.services.SERVICE_LIST`);
                         the last process is judged to the log's end
worker_answers           while a node process's ``nodeState`` is ``active``, no frame waits longer than the
                         wait timeout + the hang margin + slack (3000 + 250 + 100 ms, :mod:`chestnut.node.watchdog`)
                         for a primary answer
=======================  ==================================================================================

The inputs' own faults (absurd timestamps, repeated or skipped camera ids, a log that begins mid-episode)
are no violations: :func:`input_anomalies` lists them (``docs/contracts.md`` "Input anomalies").

Times are ``logMonoTime`` in ns (CLOCK_MONOTONIC); reports show seconds since the log's first message.
Missing data is never evidence: a contract that needs a message to be present excuses any window
that overlaps a gap left by a damaged file. *Stale* is cereal's SubMaster rule: a message older than
10 periods of its service (0.5 s for ``chestnutActive`` at 20 Hz) binds no consumer.
"""

from __future__ import annotations

import bisect
import functools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chestnut.msgs.frames import CAMERA_RESTART_MIN_STEP
from chestnut.msgs.services import SERVICE_LIST, SOFT_DISABLE_S
from chestnut.node.offline.timeline import (
    ABSURD_NS,
    ALIVE_PERIODS,
    LAYER_NAMES,
    NS_PER_MS,
    NS_PER_S,
    SLACK_MS,
    ActiveRec,
    Anomaly,
    ControlRec,
    FrameRec,
    MisstampedRec,
    NodeStateRec,
    OutputRec,
    Timeline,
    UnstampedRec,
    Violation,
    config_section,
    default_node_config,
    read_timeline,
)
from chestnut.node.policy import frame_clock
from chestnut.node.watchdog import FRAME_DEADLINE_MS, HANG_MARGIN_MS, WAIT_TIMEOUT_MS

# ---------------------------------------------------------------- parameters


@dataclass(frozen=True)
class CheckParams:
    """The bounds the contracts use. Defaults are the node's (see the module table for sources)."""

    deadline_ms: float = FRAME_DEADLINE_MS
    slack_ms: float = SLACK_MS
    wait_timeout_ms: float = WAIT_TIMEOUT_MS
    hang_margin_ms: float = HANG_MARGIN_MS
    soft_disable_s: float = SOFT_DISABLE_S
    health_hz: float = SERVICE_LIST["chestnutHealth"].frequency_hz
    active_hz: float = SERVICE_LIST["chestnutActive"].frequency_hz

    @property
    def answer_bound_ns(self) -> int:
        """Deadline + slack, ns: the latest a frame's answer may come."""
        return int((self.deadline_ms + self.slack_ms) * NS_PER_MS)

    @property
    def hang_bound_ns(self) -> int:
        """Wait timeout + hang margin + slack, ns: the longest a frame may wait for a primary answer while the
        node says active (the watchdog's hang rule counts from the request, this from the frame's EOF, and the
        node's state change is published like any answer: the slack applies as on every bound)."""
        return int((self.wait_timeout_ms + self.hang_margin_ms + self.slack_ms) * NS_PER_MS)

    @property
    def health_silence_ns(self) -> int:
        return int(ALIVE_PERIODS / self.health_hz * NS_PER_S)

    @property
    def active_alive_ns(self) -> int:
        """How long a consumer believes one ``chestnutActive`` (ns): 10 periods (cereal's alive)."""
        return int(ALIVE_PERIODS / self.active_hz * NS_PER_S)

    @classmethod
    def from_config(cls, config: dict[str, Any], **overrides: Any) -> CheckParams:
        """Bounds from the node's configuration (``initData.config``, :class:`chestnut.node.config.NodeConfig`
        JSON: ``timing.deadline_ms``, ``timing.health_hz``, ``timing.hang_margin_ms``,
        ``dock.wait_timeout_ms``); keys that are absent keep the defaults."""
        values: dict[str, Any] = {}
        timing, dock = config_section(config, "timing"), config_section(config, "dock")
        for key, section, name in (("deadline_ms", timing, "deadline_ms"), ("health_hz", timing, "health_hz"),
                                   ("hang_margin_ms", timing, "hang_margin_ms"),
                                   ("wait_timeout_ms", dock, "wait_timeout_ms")):
            if isinstance(section.get(name), int | float) and section[name] > 0:
                values[key] = float(section[name])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


# ---------------------------------------------------------------- contracts


ContractFn = Callable[[Timeline, CheckParams], Iterator[Violation]]




@dataclass(frozen=True)
class Contract:
    name: str
    description: str
    fn: ContractFn


CONTRACTS: dict[str, Contract] = {}
"""The registry, in report order: name -> :class:`Contract`."""


def contract(name: str, description: str) -> Callable[[ContractFn], ContractFn]:
    def register(fn: ContractFn) -> ContractFn:
        if name in CONTRACTS:
            raise ValueError(f"contract {name!r} registered twice")
        CONTRACTS[name] = Contract(name, description, fn)
        return fn

    return register


def _v(tl: Timeline, name: str, t_ns: int, message: str, frame_id: int | None = None) -> Violation:
    return Violation(t_ns, name, tl.frame_at(t_ns) if frame_id is None else frame_id, message)


@contract("log_intact", "every log file reads to its end and every message carries its time")
def log_intact(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    """A truncated or corrupt file: one violation per damage, with its byte offset (the rest of the log is
    still read and checked). A node message stamped ``logMonoTime`` 0, or with an absurd one
    (:data:`~chestnut.node.offline.timeline.ABSURD_NS` off the log's clock): one violation per message, placed
    where the logger wrote it (the previous message's time in its file) so that it is checked like the
    others; another publisher's (the camera's) is an input anomaly (:func:`input_anomalies`).
    Duplicates and restarts are no concern of this one: every file is read whole, whoever wrote it."""
    for d in tl.damage:
        t = d.t_ns if d.t_ns is not None else tl.start_ns
        yield Violation(t, "log_intact", d.frame_id, f"{d.path}: byte {d.offset}: {d.reason}")
    for u in tl.unstamped:
        if u.service in NODE_SERVICES:  # another publisher's clock is an input anomaly (input_anomalies)
            yield Violation(u.t_ns or tl.start_ns, "log_intact", u.frame_id, unstamped_line(u))
    for m in tl.misstamped:
        if m.service in NODE_SERVICES:
            yield Violation(m.t_ns, "log_intact", m.frame_id, misstamped_line(m))


NODE_SERVICES = frozenset({"modelOutput", "chestnutActive", "chestnutHealth", "nodeState"})
"""What only the node publishes (and stamps): a time of one of these that lies is the node's fault."""


def unstamped_line(u: UnstampedRec) -> str:
    what = u.service if u.frame_id is None else f"{u.service} {u.frame_id}"
    where = "checked at the time of the message before it" if u.t_ns else "nothing before it: not checked"
    return f"{u.path}: {what} has logMonoTime 0 (never stamped); {where}"


def misstamped_line(m: MisstampedRec) -> str:
    what = m.service if m.frame_id is None else f"{m.service} {m.frame_id}"
    return (f"{m.path}: {what} has logMonoTime {m.stamped_ns}, {(m.stamped_ns - m.t_ns) / NS_PER_S:+.0f} s off the "
            "log's clock around it; checked at the time of the message before it")


def camera_order(tl: Timeline) -> tuple[list[int], list[bool]]:
    """Per ``tl.frames``: its stream number and whether it is *fresh* (its id is above every earlier id of
    its stream). The node's rule (``node/main.py`` ``Node.on_frame``): an id more than
    :data:`~chestnut.msgs.frames.CAMERA_RESTART_MIN_STEP` below the previous one starts a new stream (a
    restarted camera counts from 0 again); any other id that does not increase is a repeated or
    reordered frame, which the node drops unanswered."""
    streams: list[int] = []
    fresh: list[bool] = []
    k, top = 0, None
    for f in tl.frames:
        if top is not None and f.frame_id < top - CAMERA_RESTART_MIN_STEP:
            k, top = k + 1, None
        fresh.append(top is None or f.frame_id > top)
        top = f.frame_id if top is None else max(top, f.frame_id)
        streams.append(k)
    return streams, fresh


def streams(tl: Timeline) -> tuple[list[int], list[int]]:
    """Stream numbers of ``tl.frames`` and ``tl.outputs``: camera streams as :func:`camera_order` finds them;
    the node's outputs follow a new camera stream once, at their first id decrease after it. Any other
    decrease stays in its stream (and is a ``frame_ids_increase`` violation)."""
    frame_k, _ = camera_order(tl)
    resets = [f.t_ns for f, k, prev in zip(tl.frames[1:], frame_k[1:], frame_k, strict=False) if k != prev]
    out_k: list[int] = []
    out = 0
    last_out = None
    for o in tl.outputs:
        cam = bisect.bisect_right(resets, o.t_ns)  # camera streams begun by now
        if last_out is not None and o.frame_id < last_out and out < cam:
            out += 1
            last_out = None
        last_out = o.frame_id if last_out is None else max(last_out, o.frame_id)
        out_k.append(out)
    return frame_k, out_k


def frame_base_ns(f: FrameRec, wait_timeout_ms: float) -> int:
    """When the node counts frame ``f``'s deadline and age from (ns), as it does (``node/policy.py``
    ``frame_clock``, with the frame's ``logMonoTime`` as its receipt): its ``timestampEof`` when that is a time
    of the host's clock not after the frame was logged and not older than the wait timeout, else the frame's
    ``logMonoTime`` (an EOF of 0 or ahead of the clock is the camera's lie, not a late node). A frame whose
    ``logMonoTime`` itself lied (``placed`` where the logger wrote it) has no receipt time: its EOF, unless that
    is 0 or absurd too."""
    if f.placed:
        return f.eof_ns if f.eof_ns and abs(f.eof_ns - f.t_ns) <= ABSURD_NS else f.t_ns
    return frame_clock(f.frame_id, f.eof_ns, f.t_ns, wait_timeout_ms).base_ns


def owed(tl: Timeline, f: FrameRec, bound_ns: int) -> bool:
    """Whether the node owes frame ``f`` an answer: a node process ran when it was logged
    (:meth:`~chestnut.node.offline.timeline.Timeline.session_at`), had not published ``stopping``, and
    still ran when the answer fell due (its ``logMonoTime`` + ``bound_ns``); the answer's window is
    readable. A frame logged while no node ran, or still in flight when its node died (a successor
    started) or stopped or the log ended, is owed nothing."""
    i = tl.session_at(f.t_ns)
    if i is None:
        return False
    s = tl.sessions[i]
    due = f.t_ns + bound_ns  # from receipt: a plausible EOF is earlier, one that lies (0, ahead) is no due date
    if s.stopping_ns is not None and f.t_ns >= s.stopping_ns:
        return False
    return due <= tl.session_end(i) and not tl.overlaps_gap(f.t_ns, due)


@contract("one_output_per_frame", "every distinct cameraFrame a running node owes gets exactly one modelOutput")
def one_output_per_frame(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    """Frames are matched to outputs by (camera stream, frame id).

    - Gaps: skipped frame ids are not frames; a frame whose answer window overlaps unreadable log is not
      judged.
    - Duplicates: a repeated (or reordered) frame id is owed nothing (the node drops it: the first copy's
      one answer covers it); a second output for a frame is a violation, whichever copy it answers.
    - Restarts: only a running node owes answers (:func:`owed`); answers from a node that started later
      to frames logged before it started are accepted.
    """
    name = "one_output_per_frame"
    by_frame: dict[tuple[int, int], list[OutputRec]] = {}
    frame_streams, output_streams = streams(tl)
    _, fresh = camera_order(tl)
    for o, k in zip(tl.outputs, output_streams, strict=True):
        by_frame.setdefault((k, o.frame_id), []).append(o)
    bound = p.answer_bound_ns
    seen: set[tuple[int, int]] = set()
    for f, k, new in zip(tl.frames, frame_streams, fresh, strict=True):
        if not new:
            continue
        seen.add((k, f.frame_id))
        answers = by_frame.get((k, f.frame_id), [])
        for extra in answers[1:]:
            yield _v(tl, name, extra.t_ns, f"frame {f.frame_id} answered {len(answers)} times "
                     f"(sources {', '.join(a.source for a in answers)})", f.frame_id)
        if not answers and owed(tl, f, bound):
            yield _v(tl, name, f.t_ns, f"frame {f.frame_id} has no modelOutput", f.frame_id)
    first = tl.frames[0].frame_id if tl.frames else None
    for (k, fid), answers in by_frame.items():
        if (k, fid) in seen or first is None or (k == 0 and fid < first):
            continue  # a frame from before the log began
        o = answers[0]
        eof = o.t_ns - int(o.frame_age_s * NS_PER_S)
        if tl.overlaps_gap(eof - bound, o.t_ns):
            continue
        yield _v(tl, name, o.t_ns, f"modelOutput for frame {fid}, which is not in the log", fid)


@contract("frame_ids_increase", "frame ids strictly increase within cameraFrame and within modelOutput")
def frame_ids_increase(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    """Gaps (skipped ids) are allowed. A camera that restarts counts from 0 again: an id more than
    :data:`~chestnut.msgs.frames.CAMERA_RESTART_MIN_STEP` below the previous starts a new stream, and the
    node's outputs may follow it once (one output decrease per camera stream, after it). Any other
    camera id that does not increase breaks the camera's contract (``cameraFrame.frameId`` strictly
    increases), not the node's: it is an input anomaly (:func:`input_anomalies`), and the node drops the
    frame; an output id that does not increase is the node's violation. A node restart changes nothing
    here: a new node answers with the camera's ids."""
    last: dict[str, int] = {}
    frame_k, _ = camera_order(tl)
    frame_index = {id(f): i for i, f in enumerate(tl.frames)}
    camera_resets = output_resets = 0
    for r in tl.events:
        if isinstance(r, FrameRec | OutputRec):
            prev = last.get(r.service)
            if isinstance(r, FrameRec):
                i = frame_index[id(r)]
                if i and frame_k[i] != frame_k[i - 1]:
                    camera_resets += 1
                    last[r.service] = r.frame_id
                    continue
            if prev is not None and r.frame_id <= prev:
                if isinstance(r, OutputRec) and output_resets < camera_resets and r.frame_id < prev:
                    output_resets += 1
                    last[r.service] = r.frame_id
                    continue
                if isinstance(r, OutputRec):  # the camera's own ids are its anomalies (input_anomalies)
                    yield Violation(r.t_ns, "frame_ids_increase", r.frame_id,
                                    f"{r.service} frame id {r.frame_id} after {prev}")
            last[r.service] = r.frame_id if prev is None else max(prev, r.frame_id)


@contract("deadline_or_fallback", "no primary output later than the per-frame deadline + slack")
def deadline_or_fallback(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    """Measured from the frame's ``timestampEof``, the frame matched by (camera stream, frame id) as
    ``one_output_per_frame`` matches it (:func:`streams`: a restarted camera counts its ids from 0 again;
    the first copy's for a repeated id; the output's own ``frameAge`` when the frame is not in the log).
    Gaps change nothing: each primary output is judged on its own."""
    frame_streams, output_streams = streams(tl)
    eof: dict[tuple[int, int], int] = {}
    for f, k in zip(tl.frames, frame_streams, strict=True):
        eof.setdefault((k, f.frame_id), frame_base_ns(f, p.wait_timeout_ms))  # as the node counts it
    for o, k in zip(tl.outputs, output_streams, strict=True):
        if o.source != "primary":
            continue
        frame_eof = eof.get((k, o.frame_id), o.t_ns - int(o.frame_age_s * NS_PER_S))
        late_ms = (o.t_ns - frame_eof) / NS_PER_MS
        deadline_ms, which = frame_deadline_ms(o, p)
        if late_ms > deadline_ms + p.slack_ms:
            yield _v(tl, "deadline_or_fallback", o.t_ns, f"primary output {late_ms:.1f} ms after the frame's EOF "
                     f"({which} {deadline_ms:g} ms + slack {p.slack_ms:g} ms)", o.frame_id)


def frame_deadline_ms(o: OutputRec, p: CheckParams) -> tuple[float, str]:
    """The deadline a primary output is judged by (ms) and what it is: the one the node published for its frame
    (``modelOutput.deadline``, the adaptive deadline in force, docs/health.md), never above ``p.deadline_ms``;
    ``p.deadline_ms`` itself for an output that carries none (an older log)."""
    if o.deadline_s > 0:
        return min(round(o.deadline_s * 1e3, 3), p.deadline_ms), "deadline in force"
    return p.deadline_ms, "deadline"


def believed(latest: ActiveRec | None, t_ns: int, p: CheckParams) -> bool:
    """Whether a consumer at ``t_ns`` believes ``active``: the newest ``chestnutActive`` says true and is
    still alive (cereal's SubMaster: a message within 10 periods, 0.5 s at 20 Hz); a true that went stale
    binds nobody."""
    return latest is not None and latest.active and t_ns - latest.t_ns <= p.active_alive_ns


@contract("active_only_when_healthy", "ChestnutActive never true while a layer is not OK or the fallback serves")
def active_only_when_healthy(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    """Each true ``chestnutActive`` is judged against the layers' levels at its instant, as the node that
    published it knew them (a successor's health never judges its predecessor's messages). A frame served
    by the fallback must not leave a consumer believing ``active`` (:func:`believed`): the node publishes a
    false one after the output, or the last true one has gone stale by then. Restarts: a killed node's
    last true goes stale 0.5 s after it, as every consumer sees; a node restarted within that time must
    say false before its first fallback frame. The false must come before the node's next output (camera
    frames logged in between do not count: the logger orders different publishers by arrival). Gaps: a
    fallback frame whose window is unreadable is not judged."""
    name = "active_only_when_healthy"
    for a in tl.actives:
        if not a.active:
            continue
        why = []
        if a.source != "primary":
            why.append(f"its source is {a.source}")
        for layer in LAYER_NAMES:
            la = tl.layer_at(layer, a.t_ns)
            if la is None:
                why.append(f"no health reported for {layer}")
            elif not la.usable:
                why.append(f"{layer} is {la.level.upper()} ({la.reason})")
        if why:
            yield _v(tl, name, a.t_ns, "chestnutActive true while " + "; ".join(why))
    # A fallback-served frame: the consumer's view of ``active`` after the frame's publications must be false.
    events = tl.events
    latest: ActiveRec | None = None
    for i, r in enumerate(events):
        if isinstance(r, ActiveRec):
            latest = r
        elif isinstance(r, OutputRec) and r.source == "fallback" and believed(latest, r.t_ns, p):
            after = None
            end_t = tl.end_ns
            for nxt in events[i + 1:]:
                # the node's next output ends the window; a camera frame does not: it comes from another
                # publisher, and the logger orders messages of different publishers by their arrival
                if isinstance(nxt, OutputRec):
                    end_t = nxt.t_ns
                    break
                if isinstance(nxt, ActiveRec):
                    after = nxt
                    break
            if (after is None or after.active) and not tl.overlaps_gap(r.t_ns, end_t):
                yield _v(tl, name, r.t_ns, f"frame {r.frame_id} served by the fallback while chestnutActive "
                         "stayed true", r.frame_id)


@contract("switch_has_reason", "every source switch is announced with a reason in chestnutActive or nodeState")
def switch_has_reason(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    """A switch is a change of source between two outputs of one node process; a restarted node's first
    source is no switch (its start is announced by its own ``nodeState``). Duplicates are outputs like
    any other; a switch whose window touches unreadable log is not judged."""
    events = tl.events
    prev: OutputRec | None = None
    prev_i = -1
    prev_session: int | None = None
    for i, r in enumerate(events):
        if not isinstance(r, OutputRec) or r.source not in ("primary", "fallback"):
            continue  # an unusable frame answered without a model (source none) is no switch
        session = tl.session_at(r.t_ns)
        if prev is not None and r.source != prev.source and session == prev_session:
            # the node's next output ends the window; a camera frame does not: it comes from another publisher,
            # and the logger orders messages of different publishers by their arrival (as active_only_when_healthy)
            end = next((j for j in range(i + 1, len(events)) if isinstance(events[j], OutputRec)), len(events))
            window = events[prev_i + 1:end]
            announced = any(
                (isinstance(w, NodeStateRec) and w.reason)
                or (isinstance(w, ActiveRec) and w.source == r.source and w.reason)
                for w in window
            )
            t_end = events[end].t_ns if end < len(events) else tl.end_ns
            if not announced and not tl.overlaps_gap(prev.t_ns, t_end):
                yield _v(tl, "switch_has_reason", r.t_ns, f"source switched {prev.source} -> {r.source} at frame "
                         f"{r.frame_id} with no reason in chestnutActive or nodeState", r.frame_id)
        prev, prev_i, prev_session = r, i, session


@contract("control_disengages", "the control daemon is never engaged while checks failed beyond the soft disable")
def control_disengages(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    """At most one violation per engagement and fault: engaging while ``chestnutActive`` is false or
    stale (every ``chestnutActive`` the daemon may have acted on: the newest one published ``slack_ms``
    before the engaging ``controlState`` and all since -- one published 2 ms before it may still have been on its
    way), or still engaged soft-disable + slack after ``chestnutActive`` went false, went stale (its
    newest true older than 10 periods: a dead node's last word) or ``canEngage`` went false. A window
    that touches unreadable log is not judged. The state before the log's first ``controlState`` is unknown
    (a log that begins mid-episode, e.g. a logger restarted while the daemon soft-disables): an engagement
    in progress then did not start in the log, and its soft-disable time counts from the first evidence the
    log holds (:func:`input_anomalies` lists it as ``initial_state``)."""
    name = "control_disengages"
    limit_ns = int((p.soft_disable_s + p.slack_ms / 1000.0) * NS_PER_S)
    slack_ns = int(p.slack_ms * NS_PER_MS)
    latest: ActiveRec | None = None
    # the chestnutActive messages the daemon may have acted on at a controlState: the newest one published a slack
    # before it and every one since (a false published 2 ms before an engage may still have been on its way)
    recent: deque[ActiveRec] = deque()
    inactive_since: int | None = None  # when the consumer last saw chestnutActive turn false or go stale
    stale = False  # inactive_since is the staleness of the newest true, not a false
    checks_failed_since: int | None = None  # when canEngage last turned false
    engaged: bool | None = None  # None: the state before the log's first controlState is unknown (never a start)
    reported = False  # this engagement's fault is reported
    for r in tl.events:
        if isinstance(r, ActiveRec):
            if r.active:
                inactive_since, stale = None, False
            elif inactive_since is None:
                inactive_since, stale = r.t_ns, False
            latest = r
            recent.append(r)
            continue
        if not isinstance(r, ControlRec):
            continue
        while len(recent) > 1 and recent[1].t_ns <= r.t_ns - slack_ns:
            recent.popleft()
        if latest is not None and latest.active and not believed(latest, r.t_ns, p) and inactive_since is None:
            inactive_since, stale = latest.t_ns + p.active_alive_ns, True
        if r.can_engage:
            checks_failed_since = None
        elif checks_failed_since is None:
            checks_failed_since = r.t_ns
        if not r.engaged or (inactive_since is None and checks_failed_since is None):
            reported = False
        if (r.engaged and engaged is False and latest is not None
                and not any(believed(a, r.t_ns, p) for a in recent)):
            reported = True
            why = latest.reason if not latest.active else "it went stale"
            yield _v(tl, name, r.t_ns, f"engaged while chestnutActive was false ({why})")
        elif r.engaged and not reported:
            since = min((s for s in (inactive_since, checks_failed_since) if s is not None), default=None)
            if since is not None and r.t_ns - since > limit_ns and not tl.overlaps_gap(since, r.t_ns):
                reported = True
                what = ("its checks failed" if since != inactive_since
                        else "chestnutActive went stale" if stale else "chestnutActive went false")
                yield _v(tl, name, r.t_ns, f"still engaged {(r.t_ns - since) / NS_PER_S:.2f} s after {what} "
                         f"(soft disable {p.soft_disable_s:g} s)")
        engaged = r.engaged


@contract("health_not_silent", "chestnutHealth never silent longer than 10 / its frequency while a node runs")
def health_not_silent(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    """Judged within each node process, from its first health to its end (its last message; the last
    process: the log's end, so a node that dies and is not restarted is reported), or to ``stopping``. Restarts:
    the silence between a dead node's last message and its successor's first is the supervisor's
    restart, not the node's silence. Gaps: a silence that touches unreadable log is not judged."""
    name = "health_not_silent"
    limit = p.health_silence_ns
    if not tl.healths:
        if tl.outputs:
            yield _v(tl, name, tl.outputs[0].t_ns, "no chestnutHealth in a log with modelOutputs")
        return
    for i, s in enumerate(tl.sessions):
        end = tl.session_end(i)
        healths = [h.t_ns for h in tl.healths if s.start_ns <= h.t_ns <= end]
        if not healths:
            continue
        if s.stopping_ns is not None:  # the node publishes health until it stops
            end = min(end, max(s.stopping_ns, healths[-1]))
        times = [*healths, end]
        for t0, t1 in zip(times, times[1:], strict=False):
            if t1 - t0 > limit and not tl.overlaps_gap(t0, t1):
                ending = "the log ends" if t1 == end and t0 == times[-2] else "the next one"
                yield _v(tl, name, t0 + limit, f"chestnutHealth silent for {(t1 - t0) / NS_PER_S:.2f} s until "
                         f"{ending} (allowed {limit / NS_PER_S:g} s)")


@contract("worker_answers", "while active, no frame waits longer than the wait timeout + margin for the primary")
def worker_answers(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    """Active means the node process's latest ``nodeState`` says ``active``; a process that ends (a
    successor started) is active no more, and its successor starts inactive. Repeated frames and gaps in ids are
    frames like others here (waiting starts at the first frame after a primary answer); a wait that
    touches unreadable log is not judged."""
    name = "worker_answers"
    bound = p.hang_bound_ns
    active = False
    waiting_since: int | None = None  # EOF of the oldest frame since the last primary answer
    waiting_frame: int | None = None
    reported = False
    session: int | None = None
    for r in tl.events:
        now_session = tl.session_at(r.t_ns)
        if now_session != session:
            active, waiting_since, waiting_frame, reported = False, None, None, False
            session = now_session
        if isinstance(r, NodeStateRec):
            now_active = r.state == "active"
            if now_active != active:
                waiting_since, waiting_frame, reported = None, None, False
            active = now_active
        elif isinstance(r, OutputRec) and r.source == "primary":
            waiting_since, waiting_frame, reported = None, None, False
        elif isinstance(r, FrameRec) and active and waiting_since is None:
            waiting_since, waiting_frame = min(frame_base_ns(r, p.wait_timeout_ms), r.t_ns), r.frame_id
        if (active and waiting_since is not None and not reported and r.t_ns - waiting_since > bound
                and not tl.overlaps_gap(waiting_since, r.t_ns)):
            reported = True
            yield _v(tl, name, r.t_ns, f"no primary answer for {(r.t_ns - waiting_since) / NS_PER_MS:.0f} ms since "
                     f"frame {waiting_frame} while nodeState was active (bound {bound / NS_PER_MS:g} ms)",
                     waiting_frame)


def input_anomalies(tl: Timeline, p: CheckParams) -> list[Anomaly]:
    """What is wrong with the node's inputs, not with the node (listed by ``chestnut check``; its exit status
    stays 0), in time order:

    - ``timestamp``: a message of another publisher than the node stamped ``logMonoTime`` 0 or absurdly
      (placed where the logger wrote it, :mod:`~chestnut.node.offline.timeline`); a ``cameraFrame`` whose
      ``timestampEof`` is 0 or after its ``logMonoTime`` (the node answers it not valid, its deadline counted
      from receipt: :func:`frame_base_ns`);
    - ``frame_id``: a camera id repeated or out of order (the node drops the frame), or a skip of ids within
      a camera stream (the frames never came);
    - ``initial_state``: the log begins with the control daemon engaged (the state before it is unknown:
      :func:`control_disengages`).
    """
    out: list[Anomaly] = []
    out += [Anomaly(u.t_ns or tl.start_ns, "timestamp", u.frame_id, unstamped_line(u))
            for u in tl.unstamped if u.service not in NODE_SERVICES]
    out += [Anomaly(m.t_ns, "timestamp", m.frame_id, misstamped_line(m))
            for m in tl.misstamped if m.service not in NODE_SERVICES]
    for f in tl.frames:
        if f.eof_ns == 0 or (f.eof_ns > f.t_ns and not f.placed):
            what = "0 (not set)" if f.eof_ns == 0 else f"{(f.eof_ns - f.t_ns) / NS_PER_MS:.1f} ms after its logMonoTime"
            out.append(Anomaly(f.t_ns, "timestamp", f.frame_id, f"cameraFrame {f.frame_id}: timestampEof is {what}: "
                               "its age is unknown (the node answers it not valid)"))
    frame_k, fresh = camera_order(tl)
    top: int | None = None
    for i, (f, k, new) in enumerate(zip(tl.frames, frame_k, fresh, strict=True)):
        if i and k != frame_k[i - 1]:
            top = None
        if top is not None and not new:
            what = "repeated" if f.frame_id == top else "out of order"
            out.append(Anomaly(f.t_ns, "frame_id", f.frame_id,
                               f"cameraFrame frame id {f.frame_id} after {top} ({what}; the node drops it)"))
        elif top is not None and f.frame_id > top + 1:
            out.append(Anomaly(f.t_ns, "frame_id", f.frame_id, f"cameraFrame frame id {f.frame_id} after {top}: "
                               f"{f.frame_id - top - 1} id(s) skipped (frames the camera never sent)"))
        top = f.frame_id if top is None else max(top, f.frame_id)
    if tl.controls and tl.controls[0].engaged:
        c = tl.controls[0]
        state = "soft-disabling" if c.soft_disabling else "engaged"
        out.append(Anomaly(c.t_ns, "initial_state", None, f"the log begins with the control daemon {state}: the "
                           "state before it is unknown (its engagement is not judged as a start)"))
    return sorted(out, key=lambda a: (a.t_ns, a.kind, a.frame_id or 0))


def check_timeline(tl: Timeline, params: CheckParams, only: Iterable[str] | None = None) -> list[Violation]:
    """Run the contracts (all, or those named in ``only``) over ``tl``; violations sorted by time,
    then contract. Raises ``KeyError`` for an unknown contract name."""
    names = list(CONTRACTS) if only is None else list(only)
    for n in names:
        if n not in CONTRACTS:
            raise KeyError(f"unknown contract {n!r}; known: {', '.join(CONTRACTS)}")
    order = {n: i for i, n in enumerate(CONTRACTS)}
    found = [v for n in names for v in CONTRACTS[n].fn(tl, params)]
    return sorted(found, key=lambda v: (v.t_ns, order[v.contract], v.frame_id or 0, v.message))


@dataclass
class CheckResult:
    timeline: Timeline
    params: CheckParams
    violations: list[Violation]
    config_origin: str = "given"  # where the bounds' configuration came from

    @functools.cached_property
    def anomalies(self) -> list[Anomaly]:
        """The inputs' anomalies (:func:`input_anomalies`): reported, never a violation."""
        return input_anomalies(self.timeline, self.params)

    def counts(self) -> dict[str, int]:
        """Violations per contract, every contract listed (0 when it held)."""
        out = dict.fromkeys(CONTRACTS, 0)
        for v in self.violations:
            out[v.contract] += 1
        return out


def check_log(paths: Iterable[Path | str] | Path | str, params: CheckParams | None = None,
              only: Iterable[str] | None = None, **overrides: Any) -> CheckResult:
    """Read the log under ``paths`` and check it. ``params`` default to the node's configuration found
    in the log (``initData``) with ``overrides`` (e.g. ``slack_ms=50``) on top."""
    tl = read_timeline(paths)
    origin = "the log's node initData"
    if params is None:
        config = tl.node_config()
        if not config:
            config, origin = default_node_config()
            origin += " (the log carries no node configuration)"
        params = CheckParams.from_config(config, **overrides)
    else:
        origin = "given"
    return CheckResult(tl, params, check_timeline(tl, params, only), origin)


