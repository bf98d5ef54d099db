"""The records offline validation reads a log into: one light record per logged message (no pixels,
no tensors), merged in ``logMonoTime`` order into a :class:`Timeline`, and the :class:`Violation` a
contract reports. Shared by :mod:`~chestnut.node.offline.contracts` (``chestnut check``),
:mod:`~chestnut.node.offline.replay` (``chestnut replay``) and :mod:`~chestnut.node.offline.report`.

A log is read file by file with :class:`~chestnut.msgs.logfile.LogReader`; damage (a truncated or
corrupt file) is recorded with its byte offset, never raised, and becomes a *gap*: a window of
unreadable log that contracts treat as missing data, never as evidence.

Times are ``logMonoTime`` in ns (CLOCK_MONOTONIC); reports show seconds since the log's first message.
A message stamped ``logMonoTime`` 0 (a publisher that never set it) cannot be placed by its time: it is
placed where the logger wrote it, at the time of the message before it in its file, and listed in
:attr:`Timeline.unstamped` (``docs/contracts.md`` "Time"). So is a message whose ``logMonoTime`` is absurd
(:data:`ABSURD_NS` away from the messages around it in its file, which return to their own clock after it:
a publisher's clock that lies, e.g. 10^6 s ahead or 2^64-1), listed in :attr:`Timeline.misstamped`.

**Node sessions.** One node process is one :class:`Session`, from its first message to its last. The
node's ``nodeState.framesIn`` / ``framesOut`` counters start from 0 in every process, so a counter that
goes down between two ``nodeState`` messages is a restart: the old session ends with the last node
message before the largest silence between those two, the new one starts with the first after it.
Contracts use sessions for what a dead node owes and what a consumer still believes
(``docs/contracts.md`` "Restarts").

**Repeated headers.** A segment after the first begins with a copy of the node's most recent ``initData``
(``msgs/logfile.py`` ``CARRIED_SERVICES``: its configuration, so a segment read alone is judged by the run's
settings), listed in the segment header's config. Such a copy is an :class:`InitRec` with ``carried`` set: it
gives the configuration and nothing else -- no node session, no file span, no clock of its own (its
``logMonoTime`` is the original's, from an earlier segment).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chestnut.msgs.logfile import LogDamage, LogReader, carried_items, find_log_files

log = logging.getLogger("chestnut.check")

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000
SLACK_MS = 100.0
"""Publishing slack on top of every time bound (ms, our choice): the node publishes a fallback answer
after the deadline plus one fallback inference (~15 ms for PP-OCRv4 on onnxruntime, 2 cores), and a
loaded 2-core host adds scheduling jitter."""
ABSURD_NS = 60 * NS_PER_S
"""A message this far (ns) from the log's clock around it in its file is mis-stamped (our choice: a minute is
far beyond the logger's reorder window and any stall of a running stack, and well below the absurd stamps
seen: 10^6 s ahead, 2^64-1)."""
ABSURD_LOOKAHEAD = 64  # messages after a suspect one searched for the clock's return (a real jump never returns)
ALIVE_PERIODS = 10.0  # cereal SubMaster: a service is alive if a message came within 10 / frequency s
LAYER_NAMES = ("usb", "pcie", "gpu", "output")  # LayerHealth.Layer order


def config_section(config: dict[str, Any], name: str) -> dict[str, Any]:
    """``config[name]`` when it is a table (dict), else ``{}``."""
    section = config.get(name)
    return section if isinstance(section, dict) else {}



# ---------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class FrameRec:
    t_ns: int
    frame_id: int
    eof_ns: int
    service: str = "cameraFrame"
    placed: bool = False  # its logMonoTime was 0 or absurd: t_ns is where the logger wrote it, not its receipt


@dataclass(frozen=True, slots=True)
class OutputRec:
    t_ns: int
    frame_id: int
    source: str
    model_id: str
    execution_time_s: float
    frame_age_s: float
    frame_drop_perc: float
    deadline_missed: bool
    agreement_checked: bool
    primary_agrees: bool
    max_abs_diff: float
    reason: str
    service: str = "modelOutput"
    stages_s: tuple[float, float, float] = (0.0, 0.0, 0.0)  # copyInTime, computeTime, copyOutTime; 0 in older logs
    deadline_s: float = 0.0  # the primary's deadline in force for the frame (s); 0: not asked, or an older log


@dataclass(frozen=True, slots=True)
class ActiveRec:
    t_ns: int
    active: bool
    source: str
    reason: str
    since_ns: int
    service: str = "chestnutActive"


@dataclass(frozen=True, slots=True)
class LayerRec:
    layer: str
    level: str
    reason: str
    last_change_ns: int
    advisory: bool = False  # a WARN that informs: the layer counts as OK for ChestnutActive (docs/health.md)

    @property
    def usable(self) -> bool:
        """OK, or an advisory WARN: what ``chestnutActive`` may be true beside (``node/health.py`` ``layer_usable``)."""
        return self.level == "ok" or (self.level == "warn" and self.advisory)


@dataclass(frozen=True, slots=True)
class HealthRec:
    t_ns: int
    layers: tuple[LayerRec, ...]
    overall: str
    service: str = "chestnutHealth"

    def layer(self, name: str) -> LayerRec | None:
        return next((la for la in self.layers if la.layer == name), None)


@dataclass(frozen=True, slots=True)
class NodeStateRec:
    t_ns: int
    state: str
    reason: str
    worker_pid: int
    restarts: int
    frames_in: int = 0  # frames the node process received so far (counts from 0 in each process)
    service: str = "nodeState"


@dataclass(frozen=True, slots=True)
class ControlRec:
    t_ns: int
    engaged: bool
    soft_disabling: bool
    can_engage: bool
    events: tuple[str, ...]
    service: str = "controlState"


@dataclass(frozen=True, slots=True)
class InitRec:
    t_ns: int
    config: dict[str, Any]
    wall_ns: int = 0  # initData.wallTimeNanos: ns since the Unix epoch when the log (segment) started
    service: str = "initData"
    carried: bool = False  # a copy the logger repeated after a segment's header (see the module docstring)


@dataclass(frozen=True, slots=True)
class TwinRec:
    """One ``twinState``: the twin's live faults (``"<kind>#<id>:<fired>"``) at ``t_ns``."""

    t_ns: int
    faults: tuple[str, ...]
    present: bool
    service: str = "twinState"


@dataclass(frozen=True, slots=True)
class FaultRec:
    """One ``twinFault``: a fault event (armed, fired, cleared, expired) of the twin's fault ``fault_id``;
    ``site``: what a firing hit (a transfer, TLP or packet)."""

    t_ns: int
    fault_id: int
    kind: str
    action: str
    site: str
    params: str
    fired: int = 0  # times fired so far
    service: str = "twinFault"


Record = FrameRec | OutputRec | ActiveRec | HealthRec | NodeStateRec | ControlRec | InitRec | TwinRec | FaultRec


def _init_record(t: int, ev: Any) -> InitRec:
    try:
        config = json.loads(ev.initData.config or "{}")
    except ValueError:
        config = {}
    return InitRec(t, config if isinstance(config, dict) else {}, int(ev.initData.wallTimeNanos))


def _health_record(t: int, ev: Any) -> HealthRec:
    h = ev.chestnutHealth
    layers = tuple(LayerRec(str(la.layer), str(la.level), la.reason, la.lastChange, bool(la.advisory))
                   for la in h.layers)
    return HealthRec(t, layers, str(h.overall))


def _output_record(t: int, ev: Any) -> OutputRec:
    m = ev.modelOutput
    return OutputRec(t, m.frameId, str(m.source), m.modelId, float(m.executionTime), float(m.frameAge),
                     float(m.frameDropPerc), m.deadlineMissed, m.agreementChecked, m.primaryAgrees,
                     float(m.maxAbsDiff), m.reason,
                     stages_s=(float(m.copyInTime), float(m.computeTime), float(m.copyOutTime)),
                     deadline_s=float(m.deadline))


_RECORDERS: dict[str, Callable[[int, Any], Record]] = {
    "cameraFrame": lambda t, ev: FrameRec(t, ev.cameraFrame.frameId, ev.cameraFrame.timestampEof),
    "modelOutput": _output_record,
    "chestnutActive": lambda t, ev: ActiveRec(t, ev.chestnutActive.active, str(ev.chestnutActive.source),
                                              ev.chestnutActive.reason, ev.chestnutActive.since),
    "chestnutHealth": _health_record,
    "nodeState": lambda t, ev: NodeStateRec(t, str(ev.nodeState.state), ev.nodeState.reason,
                                            ev.nodeState.workerPid, ev.nodeState.restarts,
                                            int(ev.nodeState.framesIn)),
    "controlState": lambda t, ev: ControlRec(t, ev.controlState.engaged, ev.controlState.softDisabling,
                                             ev.controlState.canEngage, tuple(ev.controlState.events)),
    "initData": _init_record,
    "twinState": lambda t, ev: TwinRec(t, tuple(ev.twinState.faults), bool(ev.twinState.present)),
    "twinFault": lambda t, ev: FaultRec(t, ev.twinFault.id, ev.twinFault.kind, str(ev.twinFault.action),
                                        ev.twinFault.site, ev.twinFault.params, ev.twinFault.fired),
}


def record_of(t_ns: int, service: str, event: Any) -> Record | None:
    """The light record of one logged ``Event`` reader (None for services no contract reads)."""
    recorder = _RECORDERS.get(service)
    return recorder(t_ns, event) if recorder is not None else None


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class DamageRec:
    """A :class:`~chestnut.msgs.logfile.LogDamage` with where it sits in the drive: ``t_ns`` = the last
    message read from the file before it (None: none), ``frame_id`` = the last frame read from it."""

    path: str
    offset: int
    reason: str
    t_ns: int | None
    frame_id: int | None


def damaged_files(damage: Iterable[DamageRec]) -> int:
    """How many distinct files ``damage`` names: a log file is reported at each place it is damaged
    (``msgs/logfile.py`` ``SegmentFileReader``), a damaged video once (``node/offline/replay.py``)."""
    return len({d.path for d in damage})


def damage_count(files: int, records: int) -> str:
    """The offline tools' verdict words for ``files`` damaged files holding ``records`` damage records:
    ``"N damaged file(s)"``, and ``"N damaged file(s) (M damage records)"`` where a file holds more than one."""
    return f"{files} damaged file(s)" + (f" ({records} damage records)" if records > files else "")


@dataclass(frozen=True)
class UnstampedRec:
    """A message logged with ``logMonoTime`` 0, placed at ``t_ns`` (the time of the message before it in
    its file); ``frame_id``: its own id for a ``cameraFrame`` or ``modelOutput``, else None."""

    path: str
    service: str
    t_ns: int
    frame_id: int | None


@dataclass(frozen=True)
class MisstampedRec:
    """A message whose ``logMonoTime`` (``stamped_ns``) is absurd (:data:`ABSURD_NS`), placed at ``t_ns``
    (the time of the message before it in its file); ``frame_id`` as :class:`UnstampedRec`'s."""

    path: str
    service: str
    t_ns: int
    stamped_ns: int
    frame_id: int | None


def misstamped(times: Sequence[int]) -> list[bool]:
    """Which of ``times`` (one file's ``logMonoTime`` values, file order) are absurd: over :data:`ABSURD_NS`
    from the clock so far (the latest plausible time; at the start, the median of the first messages) while
    a message within the next :data:`ABSURD_LOOKAHEAD` is back within it. A jump the messages after it keep
    is the clock's own (not absurd)."""
    if not times:
        return []
    head = sorted(times[:ABSURD_LOOKAHEAD])
    clock = head[len(head) // 2]
    flags = []
    for i, t in enumerate(times):
        bad = abs(t - clock) > ABSURD_NS and any(
            abs(u - clock) <= ABSURD_NS for u in times[i + 1:i + 1 + ABSURD_LOOKAHEAD])
        flags.append(bad)
        if not bad:
            clock = t
    return flags


@dataclass
class FileExtract:
    """What one log file holds, as records, and where it was damaged.

    ``gaps`` are (start ns, end ns or None) windows of unreadable log inside this file; None = the
    damage ran to the end of the file (the next file, if any, closes the gap).
    """

    path: str
    records: list[Record] = field(default_factory=list)
    damage: list[DamageRec] = field(default_factory=list)
    gaps: list[tuple[int | None, int | None]] = field(default_factory=list)
    unstamped: list[UnstampedRec] = field(default_factory=list)
    first_ns: int | None = None
    last_ns: int | None = None
    misstamped: list[MisstampedRec] = field(default_factory=list)


class FileRecorder:
    """Collects :class:`FileExtract` data while a file is read (also used by replay's own pass)."""

    def __init__(self, path: Path | str) -> None:
        self.extract = FileExtract(str(path))
        self._last_frame: int | None = None
        self._prev_ns: int | None = None  # logMonoTime of the message read before (file order)
        self._open_gap: int | None | bool = False  # False: no gap open; else its start (None = before anything)
        self._carried: frozenset[tuple[str, int]] = frozenset()  # copies the file's header lists (msgs/logfile.py)

    def on_damage(self, dmg: LogDamage) -> None:
        x = self.extract
        x.damage.append(DamageRec(str(dmg.path), dmg.offset, dmg.reason, x.last_ns, self._last_frame))
        if self._open_gap is False:
            self._open_gap = x.last_ns

    def add(self, t_ns: int, service: str, event: Any) -> Record | None:
        """Record one message read from the file (``t_ns``: its ``logMonoTime``). A message stamped 0
        takes the time of the message read before it (None is returned, and nothing recorded, for one
        that has no message before it: it cannot be placed)."""
        x = self.extract
        if service == "initData":
            if (service, t_ns) in self._carried:  # a repeated copy: the configuration, and no time of the file's
                copy = dataclasses.replace(_init_record(t_ns, event), carried=True)
                x.records.append(copy)
                return copy
            self._carried = self._carried | carried_items(event.initData)
        if t_ns == 0:
            if self._prev_ns is None:
                x.unstamped.append(UnstampedRec(x.path, service, 0, _frame_id_of(service, event)))
                return None
            t_ns = self._prev_ns
            x.unstamped.append(UnstampedRec(x.path, service, t_ns, _frame_id_of(service, event)))
        self._prev_ns = t_ns
        if self._open_gap is not False:
            x.gaps.append((self._open_gap, t_ns))  # type: ignore[arg-type]
            self._open_gap = False
        x.first_ns = t_ns if x.first_ns is None else min(x.first_ns, t_ns)
        x.last_ns = t_ns if x.last_ns is None else max(x.last_ns, t_ns)
        rec = record_of(t_ns, service, event)
        if isinstance(rec, FrameRec) and x.unstamped and x.unstamped[-1].t_ns == t_ns and \
                x.unstamped[-1].frame_id == rec.frame_id and x.unstamped[-1].service == service:
            rec = dataclasses.replace(rec, placed=True)
        if rec is not None:
            x.records.append(rec)
            if isinstance(rec, FrameRec):
                self._last_frame = rec.frame_id
        return rec

    def finish(self) -> FileExtract:
        if self._open_gap is not False:
            self.extract.gaps.append((self._open_gap, None))  # type: ignore[arg-type]
            self._open_gap = False
        self._place_misstamped()
        return self.extract

    def _place_misstamped(self) -> None:
        """Records whose time is absurd (:func:`misstamped`) take the time of the record before them in the
        file, as one stamped 0 does; the file's first and last times are then those of its records."""
        x = self.extract
        own = [r for r in x.records if not (isinstance(r, InitRec) and r.carried)]  # a copy is not of its clock
        flags = misstamped([r.t_ns for r in own])
        if not any(flags):
            return
        placed: list[Record] = []
        for r, bad in zip(own, flags, strict=True):
            if bad:
                at = placed[-1].t_ns if placed else next(q.t_ns for q, b in zip(own, flags, strict=True) if not b)
                x.misstamped.append(MisstampedRec(x.path, r.service, at, r.t_ns, getattr(r, "frame_id", None)))
                r = (dataclasses.replace(r, t_ns=at, placed=True) if isinstance(r, FrameRec)
                     else dataclasses.replace(r, t_ns=at))
            placed.append(r)
        it = iter(placed)  # the file's order kept: each of its own records replaced by its placed one
        x.records = [r if isinstance(r, InitRec) and r.carried else next(it) for r in x.records]
        x.first_ns, x.last_ns = min(r.t_ns for r in placed), max(r.t_ns for r in placed)


def _frame_id_of(service: str, event: Any) -> int | None:
    if service == "cameraFrame":
        return int(event.cameraFrame.frameId)
    if service == "modelOutput":
        return int(event.modelOutput.frameId)
    return None


def extract_file(path: Path | str) -> FileExtract:
    """Read one log file (``.zst`` or ``.mcap``) into records; damage is recorded, never raised.

    Read in file order (reorder window 0: :class:`Timeline` sorts by time itself), so that a damage
    report comes right after the last message read before it."""
    rec = FileRecorder(path)
    reader = LogReader(path, on_damage=rec.on_damage, reorder_window_ns=0)
    for t, service, event in reader:
        rec.add(t, service, event)
    return rec.finish()


@dataclass(frozen=True)
class Session:
    """One node process as the log shows it: its first and last message (ns), and when it published
    ``nodeState`` stopping (None: it did not; a killed node never does)."""

    start_ns: int
    end_ns: int
    stopping_ns: int | None = None


NODE_RECORDS = (OutputRec, ActiveRec, HealthRec, NodeStateRec)  # what only the node publishes (and its initData)


def node_sessions(events: Sequence[Record]) -> list[Session]:
    """The node processes in ``events`` (time-ordered), first to last (see the module docstring)."""
    times: list[int] = []
    states: list[tuple[int, NodeStateRec]] = []  # (index into times, record)
    for r in events:
        if isinstance(r, NODE_RECORDS) or (isinstance(r, InitRec) and not r.carried
                                           and isinstance(r.config.get("model"), dict)):
            if isinstance(r, NodeStateRec):
                states.append((len(times), r))
            times.append(r.t_ns)
    if not times:
        return []
    cuts: list[int] = []  # index into times of each new session's first message
    for (i, a), (j, b) in zip(states, states[1:], strict=False):
        if b.frames_in < a.frames_in:
            cuts.append(max(range(i + 1, j + 1), key=lambda k: (times[k] - times[k - 1], -k)))
    bounds = [0, *cuts, len(times)]
    sessions = []
    for k0, k1 in zip(bounds, bounds[1:], strict=False):
        t0, t1 = times[k0], times[k1 - 1]
        stop = next((s.t_ns for _, s in states if s.state == "stopping" and t0 <= s.t_ns <= t1), None)
        sessions.append(Session(t0, t1, stop))
    return sessions


@dataclass
class Timeline:
    """Every record of a log in ``logMonoTime`` order (ties: file order, then file position), the
    per-service lists, the damage, and the gaps (ns windows; an open end is the log's end)."""

    events: list[Record]
    damage: list[DamageRec]
    gaps: list[tuple[int, int]]
    files: list[str]
    start_ns: int
    end_ns: int
    frames: list[FrameRec] = field(default_factory=list)
    outputs: list[OutputRec] = field(default_factory=list)
    actives: list[ActiveRec] = field(default_factory=list)
    healths: list[HealthRec] = field(default_factory=list)
    node_states: list[NodeStateRec] = field(default_factory=list)
    controls: list[ControlRec] = field(default_factory=list)
    inits: list[InitRec] = field(default_factory=list)
    twins: list[TwinRec] = field(default_factory=list)
    faults: list[FaultRec] = field(default_factory=list)
    unstamped: list[UnstampedRec] = field(default_factory=list)
    misstamped: list[MisstampedRec] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)
    _frame_times: list[int] = field(default_factory=list, repr=False)  # bisect indexes
    _health_times: list[int] = field(default_factory=list, repr=False)

    @classmethod
    def from_extracts(cls, extracts: Sequence[FileExtract]) -> Timeline:
        """Merge per-file extracts (in segment order) into one timeline."""
        keyed = [(r.t_ns, i, j, r) for i, x in enumerate(extracts) for j, r in enumerate(x.records)]
        keyed.sort(key=lambda k: k[:3])
        events = [k[3] for k in keyed]
        firsts = [x.first_ns for x in extracts if x.first_ns is not None]
        lasts = [x.last_ns for x in extracts if x.last_ns is not None]
        start = min(firsts) if firsts else 0
        end = max(lasts) if lasts else 0
        gaps: list[tuple[int, int]] = []
        for i, x in enumerate(extracts):
            for g0, g1 in x.gaps:
                if g1 is None:  # damage ran to the end of the file: the next file's first message closes it
                    g1 = next((y.first_ns for y in extracts[i + 1:] if y.first_ns is not None), end)
                if g0 is None:  # nothing readable before it: the previous file's last message opens it
                    g0 = next((y.last_ns for y in reversed(extracts[:i]) if y.last_ns is not None), start)
                gaps.append((g0, max(g0, g1)))
        tl = cls(events, [d for x in extracts for d in x.damage], sorted(gaps), [x.path for x in extracts],
                 start, end)
        lists: dict[type, list[Any]] = {FrameRec: tl.frames, OutputRec: tl.outputs, ActiveRec: tl.actives,
                                        HealthRec: tl.healths, NodeStateRec: tl.node_states,
                                        ControlRec: tl.controls, InitRec: tl.inits, TwinRec: tl.twins,
                                        FaultRec: tl.faults}
        for r in events:
            lists[type(r)].append(r)
        tl._frame_times = [f.t_ns for f in tl.frames]
        tl._health_times = [h.t_ns for h in tl.healths]
        tl.unstamped = [u for x in extracts for u in x.unstamped]
        tl.misstamped = [m for x in extracts for m in getattr(x, "misstamped", [])]
        tl.sessions = node_sessions(events)
        return tl

    def session_end(self, i: int) -> int:
        """When node process ``i`` ended as far as the log shows (ns): its last message when a successor
        started (it died or stopped then); the log's end for the last one (nothing says it is gone)."""
        return self.sessions[i].end_ns if i < len(self.sessions) - 1 else max(self.end_ns, self.sessions[i].end_ns)

    def session_at(self, t_ns: int) -> int | None:
        """Index into :attr:`sessions` of the node process running at ``t_ns`` (None: none ran; see
        :meth:`session_end`)."""
        return next((i for i, s in enumerate(self.sessions) if s.start_ns <= t_ns <= self.session_end(i)), None)

    def overlaps_gap(self, t0: int, t1: int) -> bool:
        """Whether [t0, t1] (ns) touches unreadable log."""
        return any(g0 <= t1 and t0 <= g1 for g0, g1 in self.gaps)

    def frame_at(self, t_ns: int) -> int | None:
        """The id of the newest ``cameraFrame`` logged at or before ``t_ns`` (None before the first)."""
        i = bisect.bisect_right(self._frame_times, t_ns)
        return self.frames[i - 1].frame_id if i else None

    def node_config(self) -> dict[str, Any]:
        """The node's configuration: the first ``initData`` whose config has a ``model`` section (the
        node's own header); the logger's segment headers carry only the logger's settings."""
        return next((r.config for r in self.inits if isinstance(r.config.get("model"), dict)), {})

    def layer_at(self, name: str, t_ns: int) -> LayerRec | None:
        """The level of layer ``name`` at ``t_ns``: the next ``chestnutHealth`` if its ``lastChange`` for
        the layer is at or before ``t_ns`` (the change had happened) and the same node process published
        it (a successor's health says nothing of its predecessor's time), else the previous one."""
        i = bisect.bisect_right(self._health_times, t_ns)
        if i < len(self.healths) and self.session_at(self.healths[i].t_ns) == self.session_at(t_ns):
            nxt = self.healths[i].layer(name)
            if nxt is not None and nxt.last_change_ns <= t_ns:
                return nxt
        return self.healths[i - 1].layer(name) if i else None

    def wall_start(self) -> str:
        """The wall-clock time of the log's first message, ``YYYY-MM-DD HH:MM:SS UTC`` (from the first
        ``initData``'s ``wallTimeNanos``, moved back by its offset from the first message); "" without one."""
        first = next((r for r in self.inits if r.wall_ns), None)
        if first is None:
            return ""
        wall_ns = first.wall_ns - (first.t_ns - self.start_ns)
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(wall_ns / NS_PER_S))

    def seconds(self, t_ns: int | None) -> float:
        """``t_ns`` as seconds since the log's first message."""
        return 0.0 if t_ns is None else (t_ns - self.start_ns) / NS_PER_S


def default_node_config() -> tuple[dict[str, Any], str]:
    """(the configuration ``chestnut run`` uses without flags, where it comes from): ``launch/node.toml``
    when present, else the built-in defaults of :class:`chestnut.node.config.NodeConfig`. Used for a log
    that carries no node configuration."""
    from chestnut.backend.errors import ConfigError
    from chestnut.node.config import DEFAULT_CONFIG, NodeConfig, load_config

    try:
        if DEFAULT_CONFIG.is_file():
            return load_config(DEFAULT_CONFIG).to_json(), str(DEFAULT_CONFIG)
    except ConfigError as e:
        log.warning("%s", e)
    return NodeConfig().to_json(), "the node's built-in defaults"


def read_timeline(paths: Iterable[Path | str] | Path | str) -> Timeline:
    """Find the log files under ``paths`` (rlog; ``.zst`` preferred) and merge them into a timeline.
    Raises ``FileNotFoundError`` when there is none."""
    return Timeline.from_extracts([extract_file(p) for p in find_log_files(paths)])


@dataclass(frozen=True)
class Anomaly:
    """An anomaly of the node's inputs, not a fault of the node (``chestnut check`` lists it and its exit status
    stays 0): when (``t_ns``), its ``kind`` (``timestamp``, ``frame_id`` or ``initial_state``), which frame,
    and what exactly."""

    t_ns: int
    kind: str
    frame_id: int | None
    message: str


@dataclass(frozen=True)
class Violation:
    """One broken contract: when (``t_ns``, ns), which frame, and what exactly."""

    t_ns: int
    contract: str
    frame_id: int | None
    message: str

