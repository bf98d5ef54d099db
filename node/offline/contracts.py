"""``chestnut check``: the node's contracts, checked over a whole log.

A log is read file by file with :class:`~chestnut.msgs.logfile.LogReader` and reduced to light
records (no pixels, no tensors), merged in ``logMonoTime`` order into a :class:`Timeline`. Each
contract is a small function over that time-ordered stream, registered by name in
:data:`CONTRACTS`; it yields every :class:`Violation` it finds, with its time and frame id.

=======================  ==================================================================================
contract                 holds when (source of the rule)
=======================  ==================================================================================
log_intact               every log file reads to its end: a truncated or corrupt file is reported with its
                         byte offset (:class:`~chestnut.msgs.logfile.LogDamage`); the rest is still checked
one_output_per_frame     every ``cameraFrame`` has exactly one ``modelOutput`` (``docs/architecture.md``);
                         excused: frames still in flight at the log's end (EOF + deadline + slack after its
                         last message), frames whose answer fell into unreadable log, and frames before the
                         node's first message or after it published ``stopping``
frame_ids_increase       ``frameId`` strictly increases within ``cameraFrame`` and within ``modelOutput``
deadline_or_fallback     no ``modelOutput`` from the primary later than the per-frame deadline + slack after
                         its frame's ``timestampEof`` (150 ms, openpilot modeld; ``timing.deadline_ms``)
active_only_when_healthy ``chestnutActive.active`` is never true while a layer is not OK (the layer's level
                         at that instant, reconstructed from ``chestnutHealth`` and each layer's
                         ``lastChange``) or while its source is not the primary; a frame served by the
                         fallback never leaves a consumer believing ``active`` (``docs/health.md``)
switch_has_reason        every change of ``modelOutput.source`` between primary and fallback is announced
                         with a reason, after the previous output and before the next frame: a ``nodeState``
                         with a reason, or a ``chestnutActive`` naming the new source with a reason (the node
                         publishes the output, then ``chestnutActive``, then ``nodeState``: ``node/main.py``)
control_disengages       ``controlState.engaged`` never starts while ``chestnutActive`` is false, and never
                         lasts longer than the soft-disable time (3 s, openpilot) + slack after
                         ``chestnutActive`` went false or ``canEngage`` went false
health_not_silent        ``chestnutHealth`` never silent longer than its service allows: 10 / f (cereal's
                         *alive*; 5 Hz -> 2 s, :data:`~chestnut.msgs.services.SERVICE_LIST`)
worker_answers           while ``nodeState`` is ``active``, no frame waits longer than the wait timeout +
                         the hang margin (3000 + 250 ms, :mod:`chestnut.node.watchdog`) for a primary answer
=======================  ==================================================================================

Times are ``logMonoTime`` in ns (CLOCK_MONOTONIC); reports show seconds since the log's first message.
Missing data is never evidence: a contract that needs a message to be present excuses any window
that overlaps a gap left by a damaged file.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chestnut.msgs.services import SERVICE_LIST, SOFT_DISABLE_S
from chestnut.node.offline.timeline import (
    ALIVE_PERIODS,
    LAYER_NAMES,
    NS_PER_MS,
    NS_PER_S,
    SLACK_MS,
    ActiveRec,
    ControlRec,
    FrameRec,
    NodeStateRec,
    OutputRec,
    Timeline,
    Violation,
    config_section,
    default_node_config,
    read_timeline,
)
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

    @property
    def answer_bound_ns(self) -> int:
        """Deadline + slack, ns: the latest a frame's answer may come."""
        return int((self.deadline_ms + self.slack_ms) * NS_PER_MS)

    @property
    def hang_bound_ns(self) -> int:
        return int((self.wait_timeout_ms + self.hang_margin_ms) * NS_PER_MS)

    @property
    def health_silence_ns(self) -> int:
        return int(ALIVE_PERIODS / self.health_hz * NS_PER_S)

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


@contract("log_intact", "every log file reads to its end (truncation and corruption reported with the byte offset)")
def log_intact(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    for d in tl.damage:
        t = d.t_ns if d.t_ns is not None else tl.start_ns
        yield Violation(t, "log_intact", d.frame_id, f"{d.path}: byte {d.offset}: {d.reason}")


def streams(tl: Timeline) -> tuple[list[int], list[int]]:
    """Stream numbers of ``tl.frames`` and ``tl.outputs``: a camera frame id that does not increase starts
    a new stream (a restarted camera counts from 0 again); the node's outputs follow it once, at their
    first id decrease after that camera reset. Any other decrease stays in its stream (and is a
    ``frame_ids_increase`` violation)."""
    frame_k: list[int] = []
    out_k: list[int] = []
    cam = out = 0
    last_cam = last_out = None
    for r in tl.events:
        if isinstance(r, FrameRec):
            if last_cam is not None and r.frame_id <= last_cam:
                cam += 1
            last_cam = r.frame_id
            frame_k.append(cam)
        elif isinstance(r, OutputRec):
            if last_out is not None and r.frame_id < last_out and out < cam:
                out += 1
            last_out = r.frame_id if last_out is None or out_k and out != out_k[-1] else max(last_out, r.frame_id)
            out_k.append(out)
    return frame_k, out_k


@contract("one_output_per_frame", "every cameraFrame has exactly one modelOutput")
def one_output_per_frame(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    name = "one_output_per_frame"
    by_frame: dict[tuple[int, int], list[OutputRec]] = {}
    frame_streams, output_streams = streams(tl)
    for o, k in zip(tl.outputs, output_streams, strict=True):
        by_frame.setdefault((k, o.frame_id), []).append(o)
    bound = p.answer_bound_ns
    seen: set[tuple[int, int]] = set()
    # the node answers from its first message until it publishes ``stopping``; frames outside are not its
    node_msgs = [r.t_ns for r in (tl.outputs[:1] + tl.node_states[:1] + tl.actives[:1] + tl.healths[:1])]
    started = min(node_msgs) if node_msgs else tl.end_ns + 1
    state_times = [s.t_ns for s in tl.node_states]
    for f, k in zip(tl.frames, frame_streams, strict=True):
        seen.add((k, f.frame_id))
        answers = by_frame.get((k, f.frame_id), [])
        if not answers:
            k = bisect.bisect_right(state_times, f.t_ns)
            if f.t_ns < started or (k and tl.node_states[k - 1].state == "stopping"):
                continue
        if len(answers) > 1:
            for extra in answers[1:]:
                yield _v(tl, name, extra.t_ns, f"frame {f.frame_id} answered {len(answers)} times "
                         f"(sources {', '.join(a.source for a in answers)})", f.frame_id)
        elif not answers:
            due = max(f.eof_ns, f.t_ns) + bound
            if due > tl.end_ns or tl.overlaps_gap(f.t_ns, due):
                continue  # in flight at the end of the log, or its answer fell into unreadable log
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
    """A camera that restarts counts from 0 again: that starts a new stream, and the node's outputs may
    follow it once (one output reset per camera reset, after it); any other decrease is a violation."""
    last: dict[str, int] = {}
    camera_resets = output_resets = 0
    for r in tl.events:
        if isinstance(r, FrameRec | OutputRec):
            prev = last.get(r.service)
            if prev is not None and r.frame_id <= prev:
                if isinstance(r, FrameRec):
                    camera_resets += 1
                    last[r.service] = r.frame_id
                    continue
                if output_resets < camera_resets and r.frame_id < prev:
                    output_resets += 1
                    last[r.service] = r.frame_id
                    continue
                yield Violation(r.t_ns, "frame_ids_increase", r.frame_id,
                                f"{r.service} frame id {r.frame_id} after {prev}")
            last[r.service] = r.frame_id if prev is None else max(prev, r.frame_id)


@contract("deadline_or_fallback", "no primary output later than the per-frame deadline + slack")
def deadline_or_fallback(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    eof = {f.frame_id: f.eof_ns for f in tl.frames}
    for o in tl.outputs:
        if o.source != "primary":
            continue
        frame_eof = eof.get(o.frame_id, o.t_ns - int(o.frame_age_s * NS_PER_S))
        late_ms = (o.t_ns - frame_eof) / NS_PER_MS
        if late_ms > p.deadline_ms + p.slack_ms:
            yield _v(tl, "deadline_or_fallback", o.t_ns, f"primary output {late_ms:.1f} ms after the frame's EOF "
                     f"(deadline {p.deadline_ms:g} ms + slack {p.slack_ms:g} ms)", o.frame_id)


@contract("active_only_when_healthy", "ChestnutActive never true while a layer is not OK or the fallback serves")
def active_only_when_healthy(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
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
            elif la.level != "ok":
                why.append(f"{layer} is {la.level.upper()} ({la.reason})")
        if why:
            yield _v(tl, name, a.t_ns, "chestnutActive true while " + "; ".join(why))
    # A fallback-served frame: the consumer's view of ``active`` after the frame's publications must be false.
    events = tl.events
    latest: ActiveRec | None = None
    for i, r in enumerate(events):
        if isinstance(r, ActiveRec):
            latest = r
        elif isinstance(r, OutputRec) and r.source == "fallback" and latest is not None and latest.active:
            after = None
            for nxt in events[i + 1:]:
                if isinstance(nxt, FrameRec | OutputRec):
                    break
                if isinstance(nxt, ActiveRec):
                    after = nxt
                    break
            if after is None or after.active:
                yield _v(tl, name, r.t_ns, f"frame {r.frame_id} served by the fallback while chestnutActive "
                         "stayed true", r.frame_id)


@contract("switch_has_reason", "every source switch is announced with a reason in chestnutActive or nodeState")
def switch_has_reason(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    events = tl.events
    prev: OutputRec | None = None
    prev_i = -1
    for i, r in enumerate(events):
        if not isinstance(r, OutputRec) or r.source not in ("primary", "fallback"):
            continue  # an unusable frame answered without a model (source none) is no switch
        if prev is not None and r.source != prev.source:
            end = next((j for j in range(i + 1, len(events)) if isinstance(events[j], FrameRec)), len(events))
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
        prev, prev_i = r, i


@contract("control_disengages", "the control daemon is never engaged while checks failed beyond the soft disable")
def control_disengages(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    """At most one violation per engagement and fault: engaging while ``chestnutActive`` is false, or still
    engaged soft-disable + slack after ``chestnutActive`` or ``canEngage`` went false."""
    name = "control_disengages"
    limit_ns = int((p.soft_disable_s + p.slack_ms / 1000.0) * NS_PER_S)
    latest: ActiveRec | None = None
    inactive_since: int | None = None  # when the consumer last saw chestnutActive turn false
    checks_failed_since: int | None = None  # when canEngage last turned false
    engaged = False
    reported = False  # this engagement's fault is reported
    for r in tl.events:
        if isinstance(r, ActiveRec):
            if r.active:
                inactive_since = None
            elif inactive_since is None:
                inactive_since = r.t_ns
            latest = r
            continue
        if not isinstance(r, ControlRec):
            continue
        if r.can_engage:
            checks_failed_since = None
        elif checks_failed_since is None:
            checks_failed_since = r.t_ns
        if not r.engaged or (inactive_since is None and checks_failed_since is None):
            reported = False
        if r.engaged and not engaged and latest is not None and not latest.active:
            reported = True
            yield _v(tl, name, r.t_ns, f"engaged while chestnutActive was false ({latest.reason})")
        elif r.engaged and not reported:
            since = min((s for s in (inactive_since, checks_failed_since) if s is not None), default=None)
            if since is not None and r.t_ns - since > limit_ns and not tl.overlaps_gap(since, r.t_ns):
                reported = True
                what = "chestnutActive went false" if since == inactive_since else "its checks failed"
                yield _v(tl, name, r.t_ns, f"still engaged {(r.t_ns - since) / NS_PER_S:.2f} s after {what} "
                         f"(soft disable {p.soft_disable_s:g} s)")
        engaged = r.engaged


@contract("health_not_silent", "chestnutHealth never silent longer than 10 / its frequency")
def health_not_silent(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    name = "health_not_silent"
    limit = p.health_silence_ns
    if not tl.healths:
        if tl.outputs:
            yield _v(tl, name, tl.outputs[0].t_ns, "no chestnutHealth in a log with modelOutputs")
        return
    # the node publishes health until it stops: the log's tail after ``stopping`` is not its silence
    stopped = next((r.t_ns for r in tl.node_states if r.state == "stopping"), None)
    end = tl.end_ns if stopped is None else min(tl.end_ns, max(stopped, tl.healths[-1].t_ns))
    times = [h.t_ns for h in tl.healths] + [end]
    for t0, t1 in zip(times, times[1:], strict=False):
        if t1 - t0 > limit and not tl.overlaps_gap(t0, t1):
            ending = "the log ends" if t1 == end and t0 == times[-2] else "the next one"
            yield _v(tl, name, t0 + limit, f"chestnutHealth silent for {(t1 - t0) / NS_PER_S:.2f} s until "
                     f"{ending} (allowed {limit / NS_PER_S:g} s)")


@contract("worker_answers", "while active, no frame waits longer than the wait timeout + margin for the primary")
def worker_answers(tl: Timeline, p: CheckParams) -> Iterator[Violation]:
    name = "worker_answers"
    bound = p.hang_bound_ns
    active = False
    waiting_since: int | None = None  # EOF of the oldest frame since the last primary answer
    waiting_frame: int | None = None
    reported = False
    for r in tl.events:
        if isinstance(r, NodeStateRec):
            now_active = r.state == "active"
            if now_active != active:
                waiting_since, waiting_frame, reported = None, None, False
            active = now_active
        elif isinstance(r, OutputRec) and r.source == "primary":
            waiting_since, waiting_frame, reported = None, None, False
        elif isinstance(r, FrameRec) and active and waiting_since is None:
            waiting_since, waiting_frame = min(r.eof_ns, r.t_ns), r.frame_id
        if (active and waiting_since is not None and not reported and r.t_ns - waiting_since > bound
                and not tl.overlaps_gap(waiting_since, r.t_ns)):
            reported = True
            yield _v(tl, name, r.t_ns, f"no primary answer for {(r.t_ns - waiting_since) / NS_PER_MS:.0f} ms since "
                     f"frame {waiting_frame} while nodeState was active (bound {bound / NS_PER_MS:g} ms)",
                     waiting_frame)


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


