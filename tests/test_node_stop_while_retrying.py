"""A stop requested while the node's retry is due, or while its look for the dock is answered, starts no new work:
the supervisor's next transition is ``-> stopping on stop`` (``node/main.py`` ``Node.run`` / ``Node.request_stop``,
``docs/architecture.md`` "stop budget"). The node runs in this process (``dock.kind = "none"``: no worker), its loop
driven through its poll, where a signal finds it, and a look at the dock that is answered as it is asked.

- the signal interrupts the poll of the turn in which the retry falls due: no ``retry_due``, no look;
- the signal comes while the look for the dock is out: its answer is not taken, no back-off is logged;
- the signal comes in the middle of a turn, as the node takes the look's answer: ``dock_found`` reaches no
  transition and no worker starts;
- a second signal while stopping is logged at DEBUG only, the first at INFO.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from nodeharness import write_node_config

from chestnut.node.config import load_config
from chestnut.node.docklook import Look
from chestnut.node.main import EXIT_OK, LOOK_RETRY, Node
from chestnut.node.supervisor import State

pytestmark = [pytest.mark.timeout(60)]

BACKOFF_S = 0.2
START = [("starting", "fallback_ready", "qualifying"), ("qualifying", "dock_absent", "degraded")]


class InstantLooker:
    """The node's dock looker (``node/docklook.py`` ``DockLooker``: ``ask`` / ``take`` / ``close``) whose looks are
    finished as they are asked, all with ``answer``; ``on_take(purpose)`` runs as the node takes one. ``asked``:
    (purpose, whether the node was stopping then)."""

    def __init__(self, node: Node, answer: Look) -> None:
        self.node, self.answer = node, answer
        self.asked: list[tuple[str, bool]] = []
        self.done: set[str] = set()
        self.on_take: Callable[[str], None] = lambda _purpose: None

    def ask(self, purpose: str) -> None:
        self.asked.append((purpose, self.node.stop_requested))
        self.done.add(purpose)

    def take(self, purpose: str) -> Look | None:
        if purpose not in self.done:
            return None
        self.done.discard(purpose)
        self.on_take(purpose)
        return self.answer

    def close(self) -> None:
        pass


def make_node(tmp_path: Path, tiny_onnx: Path, answer: Look) -> tuple[Node, InstantLooker]:
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none", standby="warm",
                            timing={"backoff_initial_s": BACKOFF_S})
    node = Node(load_config(cfg))
    looker = InstantLooker(node, answer)
    node.looker = looker  # type: ignore[assignment]
    return node, looker


def drive_poll(node: Node, each_turn: Callable[[Any], None]) -> None:
    """Wrap the poller the node makes once its fallback is warm: each poll is the node's own, then
    ``each_turn(real_poll)`` runs before it returns (a signal there interrupts the poll, as SIGINT would)."""
    subscribe = node.subscribe_frames

    def subscribe_and_wrap() -> None:
        subscribe()
        real_poll = node.poller.poll

        def poll(timeout_ms: int) -> list[Any]:
            ready = list(real_poll(timeout_ms))
            each_turn(real_poll)
            return ready

        node.poller.poll = poll  # type: ignore[method-assign]
    node.subscribe_frames = subscribe_and_wrap  # type: ignore[method-assign]


def until_retry_due(node: Node, real_poll: Any) -> None:
    """The node's poll goes on until its supervisor's retry is due (as a loop turn that sleeps through it)."""
    while (left_ns := (node.sup.retry_at_ns or 0) - time.monotonic_ns()) > 0:
        real_poll(-(-left_ns // 1_000_000))


def transitions(node: Node) -> list[tuple[str, str, str]]:
    return [(t.from_state.value, t.event.value, t.to_state.value) for t in node.sup.history]


def from_signal(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    """The node's own log lines from the first ``signal`` line on: (level, message)."""
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "chestnut.node"]
    first = next(i for i, (_, m) in enumerate(lines) if m.startswith("signal "))
    return lines[first:]


def test_a_signal_in_the_poll_where_the_retry_falls_due_stops_without_retrying(
        tmp_path: Path, tiny_onnx: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="chestnut.node")
    node, looker = make_node(tmp_path, tiny_onnx, Look(False, "dock disabled (dock.kind = none)", None))
    due_at_signal: list[bool] = []

    def each_turn(real_poll: Any) -> None:
        if node.stop_requested or node.sup.state is not State.DEGRADED:
            return
        until_retry_due(node, real_poll)
        due_at_signal.append(time.monotonic_ns() >= (node.sup.retry_at_ns or 0))
        node.request_stop(signal.SIGINT)
        node.request_stop(signal.SIGTERM)  # a terminal signals the process and its group: the stop comes twice

    drive_poll(node, each_turn)
    assert node.run() == EXIT_OK
    assert due_at_signal == [True]
    assert transitions(node) == START + [("degraded", "stop", "stopping")]
    assert from_signal(caplog) == [
        ("INFO", "signal 2: stopping"),
        ("DEBUG", "signal 15: already stopping"),
        ("INFO", "degraded -> stopping on stop: stop: stop requested"),
    ]
    assert looker.asked == []  # not even the absent dock's look: the interrupted turn did nothing more


def test_a_signal_while_the_look_for_the_dock_is_out_leaves_its_answer_untaken(
        tmp_path: Path, tiny_onnx: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="chestnut.node")
    node, looker = make_node(tmp_path, tiny_onnx, Look(False, "dock disabled (dock.kind = none)", None))

    def each_turn(real_poll: Any) -> None:
        if node.stop_requested:
            return
        if node.sup.state is State.DEGRADED:
            until_retry_due(node, real_poll)  # this turn's housekeeping fires the retry and asks for a look
        elif node.sup.state is State.LOOKING:
            node.request_stop(signal.SIGINT)  # the look is answered already; the stop comes first

    drive_poll(node, each_turn)
    assert node.run() == EXIT_OK
    assert transitions(node) == START + [("degraded", "retry_due", "looking"), ("looking", "stop", "stopping")]
    assert looker.asked == [("absent", False), (LOOK_RETRY, False)]
    assert looker.done == {LOOK_RETRY}  # answered, never taken
    assert from_signal(caplog) == [
        ("INFO", "signal 2: stopping"),
        ("INFO", "looking -> stopping on stop: stop: stop requested"),
    ]


def test_a_signal_in_the_middle_of_a_turn_starts_no_worker(
        tmp_path: Path, tiny_onnx: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="chestnut.node")
    found = "1234:5678 at bus 1 address 2"
    node, looker = make_node(tmp_path, tiny_onnx, Look(True, found, None))
    spawns: list[int] = []

    def on_take(purpose: str) -> None:
        if purpose == LOOK_RETRY:
            spawns.append(node.sup.spawns)
            node.request_stop(signal.SIGINT)  # as the node takes the look's answer
    looker.on_take = on_take

    def each_turn(real_poll: Any) -> None:
        if not node.stop_requested and node.sup.state is State.DEGRADED:
            until_retry_due(node, real_poll)

    drive_poll(node, each_turn)
    assert node.run() == EXIT_OK
    assert transitions(node) == START + [("degraded", "retry_due", "looking"), ("looking", "stop", "stopping")]
    assert spawns == [1] and node.sup.spawns == 1 and node.worker is None
    assert from_signal(caplog) == [
        ("INFO", "signal 2: stopping"),
        ("DEBUG", f"stopping: dock_found not handled ({found})"),
        ("INFO", "looking -> stopping on stop: stop: stop requested"),
    ]
