"""The node's watchdog over the primary worker: AUTOSAR watchdog-manager supervision as pure logic.

Nothing here sleeps, reads a clock or touches a process: the caller passes ``now_ns``
(``time.monotonic_ns()``) and performs the :class:`WatchdogAction` s it gets back.

Four supervised entities (AUTOSAR Watchdog Manager, "Specification of Watchdog Manager": deadline, alive
and logical supervision; hang is the deadline of a request that never returns):

=========  ===================================================================  ==========  ===========
entity     checks                                                               on failure  on EXPIRED
=========  ===================================================================  ==========  ===========
deadline   a frame request's result within ``[min, deadline]``: the deadline    debounced   FAIL_OVER
           in force when it was requested (adaptive, node/deadline.py; at      (a run)     (gpu)
           most ``frame_deadline_ms``, 150 ms, openpilot modeld); a periodic
           :meth:`Watchdog.check` catches a result that never comes. Each
           miss: ANSWER_FROM_FALLBACK at once.
hang       no request unanswered longer than the wait timeout + margin          at once     KILL_WORKER
           (3000 + 250 ms) for frames, or the command timeout (60 s, modeld's               (gpu)
           start-up budget) for qualify/load commands
served     no frame waits longer than the wait timeout + margin for a result    at once     FAIL_OVER
           the node can use: every frame answered late (or not at all) since               (gpu)
           the oldest frame after the last on-time one (docs/health.md)
alive      worker heartbeats counted per window within [expected - min_margin,  debounced   KILL_WORKER
           expected + max_margin]                                                           (gpu)
logical    requests and responses pair up in order: each request seq greater    at once     KILL_WORKER
           than the last, each response seq equal to the oldest outstanding one             (output)
=========  ===================================================================  ==========  ===========

AUTOSAR expires deadline violations at once; the per-frame deadline is our exception to it: one
late frame is answered by the fallback, and only a *run* of misses
(``miss_run`` consecutive, or more than ``max_miss_ratio`` of the last ``miss_window_frames``)
fails the gpu layer over. The hang deadline keeps AUTOSAR's rule.

A miss while the host itself was late (the caller passes :func:`chestnut.node.policy.host_late`'s
reason as ``host`` to :meth:`Watchdog.response` and :meth:`Watchdog.check`) is the host's: it is
answered from the fallback all the same (entity ``"host"``), but the deadline entity neither counts
it nor takes it as an on-time frame, so it never fails the gpu layer over. The hang and alive
entities ignore ``host``: a worker silent for the wait timeout + margin is killed whatever the host does.
So does the served rule (:meth:`Watchdog.check`): a primary that answers every frame, but none within its
deadline, for the wait timeout + margin fails the gpu layer over whatever the host does, so no frame waits
longer than that for a primary answer while the node would still call the primary active (the contract
``worker_answers``, ``node/offline/contracts.py``).

A miss of a frame that is only queued behind an earlier request still within ``frame_deadline_ms`` (the
ceiling, 150 ms: :func:`queued_behind`) is answered from the fallback but not counted either: with the
adaptive deadline one slow frame would otherwise make the frames behind it miss too, and one late frame is a
miss, not a failover. Once the request at the head is older than the ceiling, the frames behind it count.

The hang margin (250 ms, our choice): inside the worker, tinygrad's own wait raises at
``HCQDEV_WAIT_TIMEOUT_MS=3000``; the margin lets the worker report that typed error itself (a
better diagnosis than a kill) and absorbs scheduling jitter on a loaded host, while the kill still
lands within the wait timeout + 10 %.

Per-entity status follows :data:`STATUS_TRANSITIONS` (OK -> FAILED -> EXPIRED; FAILED recovers to
OK with hysteresis; EXPIRED is left only by :meth:`Watchdog.worker_started`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from chestnut.backend.errors import Layer
from chestnut.backend.protocol import WAIT_TIMEOUT_MS  # tinygrad HCQDEV_WAIT_TIMEOUT_MS as openpilot sets it

NS_PER_MS = 1_000_000

FRAME_DEADLINE_MS = 150.0  # openpilot modeld: 0.15 s per-frame deadline for the big model on the dock
HANG_MARGIN_MS = 250.0  # our choice; see the module docstring
COMMAND_TIMEOUT_MS = 60_000.0  # openpilot modeld: 60 s for the big model's start-up on the dock
STALL_MARGIN_MS = 100.0  # our choice: a long command waiting on the dock without progress is ended at the wait
# timeout + this, so the worker is gone (the loop's 50 ms period, the kill and reap) by wait timeout + HANG_MARGIN_MS


class Status(StrEnum):
    """AUTOSAR WdgM local supervision status of one entity."""

    OK = "ok"
    FAILED = "failed"  # failing, within tolerance (debounced)
    EXPIRED = "expired"  # tolerance exhausted, or a fault that expires at once


class Result(StrEnum):
    """What one supervision cycle concluded (computed by the entity's supervision)."""

    PASS = "pass"  # correct, not (yet) enough to leave FAILED
    RECOVERED = "recovered"  # correct, and enough consecutive correct cycles to leave FAILED
    FAIL = "fail"  # incorrect, within tolerance
    FAIL_LIMIT = "fail_limit"  # incorrect, tolerance exhausted
    FATAL = "fatal"  # incorrect, expires at once (hang, logical)


STATUS_TRANSITIONS: dict[tuple[Status, Result], Status] = {
    (Status.OK, Result.PASS): Status.OK,
    (Status.OK, Result.RECOVERED): Status.OK,
    (Status.OK, Result.FAIL): Status.FAILED,
    (Status.OK, Result.FAIL_LIMIT): Status.EXPIRED,
    (Status.OK, Result.FATAL): Status.EXPIRED,
    (Status.FAILED, Result.PASS): Status.FAILED,
    (Status.FAILED, Result.RECOVERED): Status.OK,
    (Status.FAILED, Result.FAIL): Status.FAILED,
    (Status.FAILED, Result.FAIL_LIMIT): Status.EXPIRED,
    (Status.FAILED, Result.FATAL): Status.EXPIRED,
    **{(Status.EXPIRED, r): Status.EXPIRED for r in Result},
}
"""Every (status, result) pair: EXPIRED is absorbing until the worker is replaced."""


class ActionKind(StrEnum):
    ANSWER_FROM_FALLBACK = "answer_from_fallback"  # answer frame ``seq`` from the fallback now; never use its result
    DISCARD_LATE = "discard_late"  # a primary result for ``seq`` came after the fallback answered: drop it
    KILL_WORKER = "kill_worker"  # the worker is hung, silent or out of protocol: kill it (then worker_stopped)
    FAIL_OVER = "fail_over"  # a run of deadline misses: feed the supervisor DEADLINE_MISS_RUN


class RequestKind(StrEnum):
    FRAME = "frame"  # one inference: frame deadline + hang timeout
    COMMAND = "command"  # qualify / load / probe: command timeout only


@dataclass(frozen=True)
class WatchdogAction:
    """Something the caller must do. ``layer`` is the health layer the fault is evidence for (or None)."""

    kind: ActionKind
    entity: str  # "deadline", "hang", "alive", "logical"; "worker" for frames of a worker that is gone
    reason: str
    at_ns: int
    seq: int | None = None
    layer: Layer | None = None


@dataclass(frozen=True)
class Verdict:
    """The watchdog's ruling on one response: use the primary's result or not, and what else to do."""

    use_result: bool
    elapsed_ns: int  # request -> response; -1 when the response paired with no request
    actions: tuple[WatchdogAction, ...] = ()


@dataclass(frozen=True)
class WatchdogConfig:
    """Timing contracts, in milliseconds, and the debouncing of the deadline and alive entities."""

    frame_deadline_ms: float = FRAME_DEADLINE_MS
    frame_deadline_min_ms: float = 0.0  # AUTOSAR's lower bound; a faster result is not used
    wait_timeout_ms: float = WAIT_TIMEOUT_MS
    hang_margin_ms: float = HANG_MARGIN_MS
    command_timeout_ms: float = COMMAND_TIMEOUT_MS
    stall_margin_ms: float = STALL_MARGIN_MS
    miss_run: int = 3  # consecutive deadline misses that fail the gpu layer over (our choice: 150 ms of misses)
    miss_window_frames: int = 20  # 1 s at 20 Hz
    max_miss_ratio: float = 0.2  # more than this fraction of the window missed also fails over
    deadline_recover_after: int = 3  # on-time frames that bring the deadline entity from FAILED back to OK
    alive_enabled: bool = True
    alive_window_ms: float = 1000.0
    alive_expected: int = 20  # heartbeats per window: the worker beats every 50 ms (node/wire.py HEARTBEAT_PERIOD_S)
    alive_min_margin: int = 10  # 10..40 beats per window pass: jitter and a busy main loop are tolerated
    alive_max_margin: int = 20
    alive_failed_tolerance: int = 2  # failed windows tolerated; one more expires the entity
    alive_recover_after: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.frame_deadline_min_ms <= self.frame_deadline_ms:
            raise ValueError(f"need 0 <= frame_deadline_min_ms <= frame_deadline_ms, got "
                             f"{self.frame_deadline_min_ms}, {self.frame_deadline_ms}")
        if self.alive_window_ms <= 0 or self.miss_run < 1 or self.miss_window_frames < 1:
            raise ValueError("alive_window_ms must be > 0, miss_run and miss_window_frames >= 1")

    @property
    def hang_timeout_ms(self) -> float:
        """Wait timeout + margin: a frame request unanswered longer than this means a hung worker."""
        return self.wait_timeout_ms + self.hang_margin_ms

    @property
    def stall_timeout_ms(self) -> float:
        """Wait timeout + stall margin: a long command (qualification, load, probe) that waits on the dock this
        long without progress (``backend/progress.py``) is ended: no single wait may outlast the wait timeout."""
        return self.wait_timeout_ms + self.stall_margin_ms


class Entity:
    """One supervised entity: its status and the transitions it went through (via :data:`STATUS_TRANSITIONS`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.status = Status.OK
        self.transitions = 0  # status changes since the last reset

    def apply(self, result: Result) -> tuple[Status, Status]:
        """Apply one cycle's result; returns (old, new) status."""
        old = self.status
        self.status = STATUS_TRANSITIONS[(old, result)]
        if self.status is not old:
            self.transitions += 1
        return old, self.status

    def reset(self) -> None:
        self.status = Status.OK


@dataclass
class _Pending:
    start_ns: int
    kind: RequestKind
    answered: bool = False  # the fallback already answered this frame
    deadline_ns: int = 0    # frames: the deadline in force when it was requested (node/deadline.py)
    head_ns: int = 0        # when the worker could start it: the previous request's answer, if after start_ns


def _ms(ns: int) -> str:
    return f"{ns / NS_PER_MS:.1f} ms"


def queued_behind(seq: int, head_seq: int | None, head_age_ms: float | None, ceiling_ms: float,
                  own_ms: float | None = None, deadline_ms: float | None = None) -> str:
    """Why frame ``seq``'s deadline miss is only a queue behind an earlier request, or "" when it counts.

    ``head_seq``: the oldest request the worker has not answered (None: none), outstanding ``head_age_ms``
    (ms since its frame's deadline base); ``ceiling_ms``: the fixed deadline (``timing.deadline_ms``, 150 ms,
    openpilot modeld). A frame behind a head still within the ceiling missed because the head is slow, not
    because the primary failed: one slow frame is one miss. A head older than the ceiling is late by modeld's
    own rule, so the frames behind it count.

    The head itself, when it could only start after the request before it was answered: ``own_ms`` is the
    time since then (the worker runs one request at a time), ``deadline_ms`` its deadline in force. Within
    both its deadline (its own time) and the ceiling (since its frame), it missed only because it waited
    behind the slower one: not counted. Without this, one slow frame made every frame queued behind it miss
    its own deadline in turn as the head -- three misses, a failover -- although each took its usual time."""
    if head_seq is None or head_age_ms is None or head_age_ms > ceiling_ms:
        return ""
    if head_seq != seq:
        return (f"queued behind frame {head_seq} (outstanding {head_age_ms:.0f} ms, within the {ceiling_ms:g} ms "
                f"ceiling)")
    if own_ms is None or deadline_ms is None or own_ms > deadline_ms or own_ms >= head_age_ms:
        return ""
    return (f"queued: started {head_age_ms - own_ms:.0f} ms after its frame, behind a slower one; its own "
            f"{own_ms:.0f} ms within the {round(deadline_ms, 1):g} ms deadline, {head_age_ms:.0f} ms within the "
            f"{ceiling_ms:g} ms ceiling")


class Watchdog:
    """Deadline, hang, alive and logical supervision of one primary worker at a time.

    Typical main loop::

        wd.worker_started(now)                        # a fresh worker is up
        wd.request(seq, now)                          # frame sent to the worker
        verdict = wd.response(seq, now)               # result came back: use it only if verdict.use_result
        actions = wd.check(now)                       # periodically (poll timeout: wd.next_check_ns())
        actions = wd.worker_stopped(now)              # killed or died: unanswered frames -> fallback

    Raises ``ValueError`` only for programming errors (time going backwards is tolerated: an
    earlier ``now_ns`` simply finds nothing due).
    """

    def __init__(self, config: WatchdogConfig | None = None) -> None:
        self.config = c = config or WatchdogConfig()
        self.deadline = Entity("deadline")
        self.hang = Entity("hang")
        self.alive = Entity("alive")
        self.logical = Entity("logical")
        self._deadline_ns = int(c.frame_deadline_ms * NS_PER_MS)
        self._last_deadline_ns = self._deadline_ns  # the deadline of the last frame requested
        self._deadline_min_ns = int(c.frame_deadline_min_ms * NS_PER_MS)
        self._hang_ns = int(c.hang_timeout_ms * NS_PER_MS)
        self._command_ns = int(c.command_timeout_ms * NS_PER_MS)
        self._window_ns = int(c.alive_window_ms * NS_PER_MS)
        self._pending: OrderedDict[int, _Pending] = OrderedDict()
        self._unserved: tuple[int, int] | None = None  # (seq, request ns) of the oldest frame since an on-time one
        self._unserved_host = 0  # of the misses since then, the host's
        self._last_response_ns = 0
        self._last_seq: int | None = None
        self._outcomes: deque[bool] = deque(maxlen=c.miss_window_frames)  # True = missed
        self._miss_run = 0
        self._on_time_run = 0
        self._alive_start_ns: int | None = None  # start of the open alive window; None = alive off
        self._beats = 0
        self._alive_failed_run = 0
        self._alive_passed_run = 0
        self.misses = 0  # deadline misses since construction (the host's included)
        self.host_misses = 0  # of which the host was late (not counted by the deadline entity)
        self.queued_misses = 0  # of which only queued behind an earlier frame within the ceiling (not counted)
        self.kills = 0  # KILL_WORKER actions since construction

    # ---------------------------------------------------------------- worker lifecycle

    def worker_started(self, now_ns: int) -> list[WatchdogAction]:
        """A new worker is up: statuses back to OK, alive supervision starts its first window at ``now_ns``.

        Requests still outstanding from a previous worker are abandoned (answered from the fallback).
        """
        actions = self._abandon(now_ns, "worker replaced")
        for e in (self.deadline, self.hang, self.alive, self.logical):
            e.reset()
        self._outcomes.clear()
        self._miss_run = self._on_time_run = 0
        self._alive_failed_run = self._alive_passed_run = 0
        self._beats = 0
        self._alive_start_ns = now_ns if self.config.alive_enabled else None
        self._unserved, self._unserved_host = None, 0
        return actions

    def worker_stopped(self, now_ns: int) -> list[WatchdogAction]:
        """The worker is gone (killed, died, stopped): every unanswered frame is answered from the fallback now."""
        actions = self._abandon(now_ns, "worker gone")
        self._alive_start_ns = None
        self._unserved, self._unserved_host = None, 0
        return actions

    def _abandon(self, now_ns: int, why: str) -> list[WatchdogAction]:
        actions = [WatchdogAction(ActionKind.ANSWER_FROM_FALLBACK, "worker", f"{why} with frame {seq} unanswered",
                                  now_ns, seq)
                   for seq, p in self._pending.items() if p.kind is RequestKind.FRAME and not p.answered]
        self._pending.clear()
        return actions

    # ---------------------------------------------------------------- requests and responses

    def request(self, seq: int, now_ns: int, kind: RequestKind = RequestKind.FRAME,
                deadline_ms: float | None = None) -> list[WatchdogAction]:
        """A request ``seq`` was sent to the worker at ``now_ns``. Sequence numbers must strictly increase
        (across workers too); a violation is a logical fault (KILL_WORKER). ``deadline_ms``: a frame's
        deadline in force (the adaptive deadline, ``node/deadline.py``); None: ``frame_deadline_ms``. Raises
        ``ValueError`` for a deadline outside ``(frame_deadline_min_ms, frame_deadline_ms]``."""
        deadline_ns = self._deadline_ns
        if deadline_ms is not None:
            deadline_ns = int(deadline_ms * NS_PER_MS)
            if not self._deadline_min_ns < deadline_ns <= self._deadline_ns:
                raise ValueError(f"frame deadline {deadline_ms} ms outside ({self.config.frame_deadline_min_ms}, "
                                 f"{self.config.frame_deadline_ms}] ms")
        if self._last_seq is not None and seq <= self._last_seq:
            actions = self._logical_fault(now_ns, f"request seq {seq} not after previous request seq {self._last_seq}")
            if kind is RequestKind.FRAME:
                actions.append(WatchdogAction(ActionKind.ANSWER_FROM_FALLBACK, "logical",
                                              f"frame {seq}: request out of sequence", now_ns, seq))
            return actions
        self._last_seq = seq
        if kind is RequestKind.FRAME and self._unserved is not None and self._idle_since(now_ns):
            self._unserved, self._unserved_host = None, 0
        self._pending[seq] = _Pending(now_ns, kind, deadline_ns=deadline_ns)
        self._last_deadline_ns = deadline_ns if kind is RequestKind.FRAME else self._last_deadline_ns
        if kind is RequestKind.FRAME and self._unserved is None:
            self._unserved = (seq, now_ns)
        return []

    def _queued(self, seq: int, head: _Pending, now_ns: int, head_seq: int | None = None) -> str:
        """:func:`queued_behind` for frame ``seq`` with ``head`` (request ``head_seq``, default ``seq``) the
        oldest outstanding one at ``now_ns``."""
        head_seq = seq if head_seq is None else head_seq
        age_ms = (now_ns - head.start_ns) / NS_PER_MS
        own_ms = (now_ns - max(head.start_ns, head.head_ns)) / NS_PER_MS
        return queued_behind(seq, head_seq, age_ms, self.config.frame_deadline_ms, own_ms,
                             head.deadline_ns / NS_PER_MS)

    def queued(self, seq: int, now_ns: int) -> str:
        """:func:`queued_behind` for frame ``seq`` at ``now_ns`` against the oldest outstanding frame request
        ("" when none is outstanding): the node's own miss count (``node/main.py``) uses the same rule."""
        head = next(((s, q) for s, q in self._pending.items() if q.kind is RequestKind.FRAME), None)
        return "" if head is None else self._queued(seq, head[1], now_ns, head[0])

    def started_ns(self, seq: int) -> int | None:
        """When request ``seq`` was sent (ns), while it is outstanding; else None."""
        p = self._pending.get(seq)
        return p.start_ns if p is not None else None

    def in_time(self, seq: int, now_ns: int) -> bool:
        """Whether :meth:`response` for frame request ``seq`` at ``now_ns`` would let its result be used (its
        ``use_result``), without recording it: the oldest request outstanding, a frame not yet answered from the
        fallback, from a worker no entity has expired, within ``[min, frame_deadline]``. Such a response changes
        no entity's status beyond a PASS and returns no action, so a caller may answer with the result first and
        record the response right after (``node/main.py`` ``Node._await_primary``)."""
        p = self._pending.get(seq)
        if p is None or p.kind is not RequestKind.FRAME or p.answered or next(iter(self._pending)) != seq:
            return False
        elapsed = now_ns - p.start_ns
        return self._deadline_min_ns <= elapsed <= p.deadline_ns and not self.expired

    def response(self, seq: int, now_ns: int, host: str | Callable[[], str] = "") -> Verdict:
        """The worker answered request ``seq`` at ``now_ns``.

        ``use_result`` is True only for an in-order response to a live request, from a worker no
        entity has expired, and (for frames) within ``[min, frame_deadline]``. ``host``: why the host
        itself was late (empty: on time), or a function that says it, called only for a result outside
        those bounds; a late result then is the host's miss (module docstring).
        """
        if not self._pending or next(iter(self._pending)) != seq:
            expected = next(iter(self._pending), None)
            why = (f"response seq {seq} with no request outstanding" if expected is None
                   else f"response seq {seq} out of order (expected {expected})")
            return Verdict(False, -1, tuple(self._logical_fault(now_ns, why)))
        p = self._pending.pop(seq)
        self._last_response_ns = now_ns
        if self._pending:  # the next request can start only now (the worker runs one at a time)
            nxt = next(iter(self._pending.values()))
            nxt.head_ns = max(nxt.head_ns, now_ns)
        elapsed = now_ns - p.start_ns
        self.logical.apply(Result.PASS)
        if p.kind is RequestKind.COMMAND:
            return Verdict(not self.expired, elapsed)
        if p.answered:
            return Verdict(False, elapsed, (WatchdogAction(
                ActionKind.DISCARD_LATE, "deadline",
                f"frame {seq}: primary result after {_ms(elapsed)}, already answered from the fallback", now_ns, seq),))
        if self.expired:  # the worker is being replaced: nothing it says is used
            expired = ", ".join(n for n, st in self.statuses().items() if st is Status.EXPIRED)
            return Verdict(False, elapsed, (WatchdogAction(
                ActionKind.ANSWER_FROM_FALLBACK, "worker",
                f"frame {seq}: result from a worker being replaced ({expired} expired)", now_ns, seq),))
        if elapsed > p.deadline_ns or elapsed < self._deadline_min_ns:
            bound = (f"deadline {_ms(p.deadline_ns)}" if elapsed > p.deadline_ns
                     else f"minimum {_ms(self._deadline_min_ns)}")
            reason = f"frame {seq}: primary result after {_ms(elapsed)} ({bound})"
            queued = self._queued(seq, p, now_ns) if elapsed > p.deadline_ns else ""
            actions = self._miss(seq, reason, now_ns, host() if callable(host) else host, queued)
            return Verdict(False, elapsed, tuple(actions))
        head = next(((s, q.start_ns) for s, q in self._pending.items() if q.kind is RequestKind.FRAME), None)
        self._unserved, self._unserved_host = head, 0  # the wait starts with the oldest frame still in hand
        return Verdict(True, elapsed, tuple(self._frame_outcome(False, now_ns)))

    def heartbeat(self, now_ns: int, count: int = 1) -> list[WatchdogAction]:
        """``count`` worker heartbeats seen at ``now_ns`` (e.g. the growth of the worker's shared beat
        counter since the last look); ignored while no worker is supervised. Raises ``ValueError``
        for a negative count."""
        if count < 0:
            raise ValueError(f"heartbeat count must be >= 0, got {count}")
        if self._alive_start_ns is None:
            return []
        actions = self._close_alive_windows(now_ns)
        if self._alive_start_ns is not None:
            self._beats += count
        return actions

    # ---------------------------------------------------------------- periodic check

    def check(self, now_ns: int, host: str = "") -> list[WatchdogAction]:
        """Catch what never arrives: frames past their deadline, hung requests, closed alive windows.
        ``host``: why the host itself was late (empty: on time); a frame past its deadline then is the
        host's miss (module docstring). Hangs and lost heartbeats are judged whatever ``host`` says."""
        actions: list[WatchdogAction] = []
        head = next(((s, q) for s, q in self._pending.items() if q.kind is RequestKind.FRAME), None)
        for seq, p in self._pending.items():
            elapsed = now_ns - p.start_ns
            if p.kind is RequestKind.FRAME and not p.answered and elapsed > p.deadline_ns:
                p.answered = True
                queued = "" if head is None else self._queued(seq, head[1], now_ns, head[0])
                actions += self._miss(seq, f"frame {seq}: no primary result {_ms(elapsed)} after the request "
                                      f"(deadline {_ms(p.deadline_ns)})", now_ns, host, queued)
            limit = self._hang_ns if p.kind is RequestKind.FRAME else self._command_ns
            if elapsed > limit and self.hang.status is not Status.EXPIRED:
                self.hang.apply(Result.FATAL)
                what = "wait timeout + margin" if p.kind is RequestKind.FRAME else "command timeout"
                actions.append(self._kill("hang", f"worker hung: request {seq} ({p.kind.value}) unanswered after "
                                          f"{_ms(elapsed)} ({what} {_ms(limit)})", now_ns, Layer.GPU, seq))
        actions += self._unserved_check(now_ns)
        actions += self._close_alive_windows(now_ns)
        return actions

    def _unserved_check(self, now_ns: int) -> list[WatchdogAction]:
        """The served rule: the oldest frame requested since the last on-time result waited longer than the wait
        timeout + margin (3000 + 250 ms, tinygrad ``HCQDEV_WAIT_TIMEOUT_MS`` as openpilot sets it): FAIL_OVER
        on the gpu layer, the host's misses included (they excuse one late frame, not a primary that serves none)."""
        if self._unserved is None or self.expired or not self._frame_pending():
            return []
        seq, start_ns = self._unserved
        waited = now_ns - start_ns
        if waited <= self._hang_ns:
            return []
        self.deadline.apply(Result.FAIL_LIMIT)
        host = f", {self._unserved_host} of its misses while the host was late" if self._unserved_host else ""
        return [WatchdogAction(ActionKind.FAIL_OVER, "deadline", f"no frame answered by the primary within its "
                               f"deadline for {_ms(waited)} since frame {seq} (wait timeout + margin "
                               f"{_ms(self._hang_ns)}){host}", now_ns, None, Layer.GPU)]

    def _frame_pending(self) -> bool:
        return any(p.kind is RequestKind.FRAME for p in self._pending.values())

    def _idle_since(self, now_ns: int) -> bool:
        """The worker had no frame in hand for longer than the frame deadline before ``now_ns`` (a camera
        pause): the wait for an on-time result starts again with the next frame."""
        return not self._frame_pending() and now_ns - self._last_response_ns > self._deadline_ns

    def next_check_ns(self) -> int | None:
        """The earliest time at which :meth:`check` can find something new (a poll timeout), or None."""
        due: list[int] = []
        for p in self._pending.values():
            if p.kind is RequestKind.FRAME and not p.answered:
                due.append(p.start_ns + p.deadline_ns + 1)
            if self.hang.status is not Status.EXPIRED:
                due.append(p.start_ns + (self._hang_ns if p.kind is RequestKind.FRAME else self._command_ns) + 1)
        if self._alive_start_ns is not None:
            due.append(self._alive_start_ns + self._window_ns)
        if self._unserved is not None and not self.expired and self._frame_pending():
            due.append(self._unserved[1] + self._hang_ns + 1)
        return min(due, default=None)

    # ---------------------------------------------------------------- status

    @property
    def outstanding(self) -> tuple[int, ...]:
        """Sequence numbers of requests without a response, oldest first."""
        return tuple(self._pending)

    def statuses(self) -> dict[str, Status]:
        return {e.name: e.status for e in (self.deadline, self.hang, self.alive, self.logical)}

    @property
    def expired(self) -> bool:
        """Some entity expired: the worker must be replaced before its results are used again (read with every
        result: the four statuses are compared as they are, without building :meth:`statuses`)."""
        return (self.deadline.status is Status.EXPIRED or self.hang.status is Status.EXPIRED
                or self.alive.status is Status.EXPIRED or self.logical.status is Status.EXPIRED)

    # ---------------------------------------------------------------- internals

    def _kill(self, entity: str, reason: str, now_ns: int, layer: Layer, seq: int | None = None) -> WatchdogAction:
        self.kills += 1
        return WatchdogAction(ActionKind.KILL_WORKER, entity, reason, now_ns, seq, layer)

    def _logical_fault(self, now_ns: int, why: str) -> list[WatchdogAction]:
        was = self.logical.status
        self.logical.apply(Result.FATAL)
        if was is Status.EXPIRED:
            return []
        return [self._kill("logical", f"logical supervision: {why}", now_ns, Layer.OUTPUT)]

    def _miss(self, seq: int, reason: str, now_ns: int, host: str, queued: str = "") -> list[WatchdogAction]:
        """Frame ``seq`` missed its deadline: answered from the fallback; counted by the deadline entity
        unless the host was late (``host``), then the host's (entity ``"host"``) and not counted, or it was only
        queued behind a slower earlier frame (``queued``, :func:`queued_behind`): not counted either."""
        if host:
            self.misses += 1
            self.host_misses += 1
            self._unserved_host += 1
            return [WatchdogAction(ActionKind.ANSWER_FROM_FALLBACK, "host", f"{reason}; {host}", now_ns, seq)]
        if queued:
            self.misses += 1
            self.queued_misses += 1
            return [WatchdogAction(ActionKind.ANSWER_FROM_FALLBACK, "deadline", f"{reason}; {queued}", now_ns, seq)]
        return [WatchdogAction(ActionKind.ANSWER_FROM_FALLBACK, "deadline", reason, now_ns, seq),
                *self._frame_outcome(True, now_ns)]

    def _frame_outcome(self, missed: bool, now_ns: int) -> list[WatchdogAction]:
        c = self.config
        self._outcomes.append(missed)
        if not missed:
            self._miss_run = 0
            self._on_time_run += 1
            recovered = self.deadline.status is Status.FAILED and self._on_time_run >= c.deadline_recover_after
            self.deadline.apply(Result.RECOVERED if recovered else Result.PASS)
            return []
        self.misses += 1
        self._miss_run += 1
        self._on_time_run = 0
        in_window = sum(self._outcomes)
        if self._miss_run >= c.miss_run:
            why = f"{self._miss_run} consecutive deadline misses"
        elif in_window > c.max_miss_ratio * c.miss_window_frames:
            why = f"{in_window} of the last {len(self._outcomes)} frames missed the deadline"
        else:
            self.deadline.apply(Result.FAIL)
            return []
        old, _ = self.deadline.apply(Result.FAIL_LIMIT)
        if old is Status.EXPIRED:
            return []
        return [WatchdogAction(ActionKind.FAIL_OVER, "deadline", f"{why} (deadline {_ms(self._last_deadline_ns)})",
                               now_ns, None, Layer.GPU)]

    def _close_alive_windows(self, now_ns: int) -> list[WatchdogAction]:
        c = self.config
        actions: list[WatchdogAction] = []
        # Empty windows after the first repeat the same result: evaluating a bounded number of them
        # reaches every status they can reach; the rest are skipped arithmetically.
        budget = c.alive_failed_tolerance + c.alive_recover_after + 2
        while self._alive_start_ns is not None and now_ns >= self._alive_start_ns + self._window_ns:
            if budget == 0:
                skipped = (now_ns - self._alive_start_ns) // self._window_ns
                self._alive_start_ns += skipped * self._window_ns
                break
            budget -= 1
            beats, self._beats = self._beats, 0
            self._alive_start_ns += self._window_ns
            lo, hi = c.alive_expected - c.alive_min_margin, c.alive_expected + c.alive_max_margin
            if lo <= beats <= hi:
                self._alive_failed_run = 0
                self._alive_passed_run += 1
                recovered = self.alive.status is Status.FAILED and self._alive_passed_run >= c.alive_recover_after
                self.alive.apply(Result.RECOVERED if recovered else Result.PASS)
                continue
            self._alive_passed_run = 0
            self._alive_failed_run += 1
            limit = self._alive_failed_run > c.alive_failed_tolerance
            old, new = self.alive.apply(Result.FAIL_LIMIT if limit else Result.FAIL)
            if new is Status.EXPIRED and old is not Status.EXPIRED:
                actions.append(self._kill("alive", f"heartbeat lost: {self._alive_failed_run} window(s) in a row "
                                          f"outside {lo}..{hi} beats per {_ms(self._window_ns)} (last: {beats})",
                                          now_ns, Layer.GPU))
        return actions
