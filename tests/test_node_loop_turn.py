"""One turn of the node's main loop (``node/main.py`` ``Node._turn``) with its collaborators replaced by
recorders: what it waits for, and what it does, in which order, with no frame, with a frame and at the
pre-frame wake."""

from __future__ import annotations

import time
import types
from collections import deque
from collections.abc import Iterator
from typing import Any

from chestnut.node.main import LOOP_PERIOD_MS, Node
from chestnut.node.policy import PREWAKE_LEAD_S

PERIOD_MS = 50.0


class Loop(types.SimpleNamespace):
    """The attributes and calls ``Node._turn`` uses; each call it makes is appended to ``events``."""

    def __init__(self, polls: list[tuple[dict[Any, int], list[Any]]], next_check_ns: int | None = None) -> None:
        events: list[Any] = []
        script = iter(polls)  # each poll's result and the frames it brings
        state: dict[str, list[Any]] = {"frames": []}

        def poll(timeout_ms: int) -> list[tuple[Any, int]]:
            ready, frames = next(script)
            events.append(("poll", timeout_ms))
            state["frames"] = frames
            if ready.get("stop"):
                self.stop_requested = True
            return list(ready.items())

        def frames_woken(_ready: dict[Any, int]) -> Iterator[tuple[Any, bool, int]]:
            for cf in state["frames"]:
                yield cf, True, 0

        def wake_worker() -> None:
            events.append("WAKE")
            self.worker_woken_ns = time.monotonic_ns()

        super().__init__(
            events=events, stop_requested=False, prewake_ns=0, worker_woken_ns=0,
            frame_periods=deque([PERIOD_MS] * 5, maxlen=20),
            watchdog=types.SimpleNamespace(next_check_ns=lambda: next_check_ns),
            poller=types.SimpleNamespace(poll=poll),
            frame_reader=types.SimpleNamespace(first_sight=lambda cf: cf != "seen"),
            host=types.SimpleNamespace(loop_woke=lambda asked, received: events.append("loop_woke")),
            notify=types.SimpleNamespace(watchdog=lambda: events.append("notify")),
            collector=types.SimpleNamespace(collect_due=lambda: events.append("collect")),
            _frames_woken=frames_woken, _wake_worker=wake_worker, _wakes_worker=lambda: True,
            on_frame=lambda cf, valid, sent_ns: events.append(("frame", cf)),
            _housekeeping=lambda: events.append("housekeeping"),
        )
        self._prewake = types.MethodType(Node._prewake, self)
        self._turn = types.MethodType(Node._turn, self)


FRAME = ({"bus": 1}, ["f1"])
NOTHING: tuple[dict[Any, int], list[Any]] = ({}, [])


def test_with_nothing_due_the_turn_waits_a_loop_period_and_does_its_housekeeping() -> None:
    n = Loop([NOTHING])
    assert n._turn() is True
    assert n.events == [("poll", LOOP_PERIOD_MS), "loop_woke", "housekeeping", "notify", "collect"]
    assert n.prewake_ns == 0


def test_the_wait_ends_at_the_watchdogs_next_check_or_the_pre_frame_wake_whichever_is_first() -> None:
    now = time.monotonic_ns()
    n = Loop([NOTHING], next_check_ns=now + 20_500_000)
    n.prewake_ns = now + 60_000_000
    n._turn()
    assert n.events[0] in (("poll", 20), ("poll", 19))  # whole milliseconds, rounded down
    n = Loop([NOTHING], next_check_ns=now + 20_500_000)
    n.prewake_ns = now + 3_700_000
    n._turn()
    assert n.events[0] in (("poll", 3), ("poll", 2))
    # woken 2+ ms before the pre-frame wake is due: an ordinary turn, the wake still set
    assert n.events[1:] == ["loop_woke", "housekeeping", "notify", "collect"] and n.prewake_ns == now + 3_700_000


def test_the_pre_frame_wake_sends_the_wake_alone_and_goes_back_to_waiting() -> None:
    n = Loop([NOTHING])
    n.prewake_ns = time.monotonic_ns() + 400_000  # within a millisecond: due at this turn's wake-up
    assert n._turn() is True
    assert n.events == [("poll", 0), "loop_woke", "WAKE"]  # no housekeeping, no watchdog notice, no collection
    assert n.prewake_ns == 0


def test_a_frame_with_no_wake_before_it_is_woken_for_then_answered_and_the_next_wake_set() -> None:
    n = Loop([FRAME])
    before = time.monotonic_ns()
    assert n._turn() is True
    after = time.monotonic_ns()
    assert n.events == [("poll", LOOP_PERIOD_MS), "WAKE", ("frame", "f1"), "housekeeping", "notify", "collect"]
    lead = round((PERIOD_MS / 1e3 - PREWAKE_LEAD_S) * 1e9)  # one median period after the receipt, less the lead
    assert before + lead <= n.prewake_ns <= after + lead


def test_frames_after_the_pre_frame_wake_send_none_and_each_is_followed_by_housekeeping() -> None:
    n = Loop([NOTHING, ({"bus": 1}, ["f1", "f2"])])
    n.prewake_ns = time.monotonic_ns()
    n._turn()
    n._turn()
    assert n.events == [("poll", 0), "loop_woke", "WAKE",
                        ("poll", LOOP_PERIOD_MS), ("frame", "f1"), "housekeeping", ("frame", "f2"), "housekeeping",
                        "notify", "collect"]


def test_a_frame_taken_already_is_neither_woken_for_nor_answered_and_sets_no_wake() -> None:
    n = Loop([({"ring": 1}, ["seen"])])
    n._turn()
    assert n.events == [("poll", LOOP_PERIOD_MS), "housekeeping", "notify", "collect"]
    assert n.prewake_ns == 0


def test_a_stop_asked_during_the_wait_ends_the_loop_with_nothing_more_done() -> None:
    n = Loop([({"stop": 1}, ["f1"])])
    assert n._turn() is False
    assert n.events == [("poll", LOOP_PERIOD_MS)]
