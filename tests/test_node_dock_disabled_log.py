"""A dock that is off by the user's choice (``dock.kind = none``, ``chestnut run --dock none``) is no warning: the node
says once, at INFO as it is ready, that it serves from the fallback only, and its supervisor's looks for the dock and
their back-off are DEBUG (``node/main.py`` ``Node._log_transition``). A dock that is configured but absent still warns
at every look, as before.

It warned ``looking -> degraded on dock_absent: dock_absent (usb): dock disabled (dock.kind = none); retry in 30 s``
every 30 s, for as long as the node ran.

The node runs in this process, its loop driven through its poll (``tests/test_node_stop_while_retrying.py``), a
back-off of 0.05 s then 0.1 s (``timing.backoff_initial_s`` / ``backoff_max_s``), stopped after its third retry.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import pytest
from nodeharness import write_node_config

from chestnut.backend.errors import Layer
from chestnut.node.config import load_config
from chestnut.node.docklook import Look
from chestnut.node.main import EXIT_OK, Node
from chestnut.node.supervisor import Event, State

pytestmark = [pytest.mark.timeout(60)]

RETRIES = 3
ABSENT = "no Chestnut dock enumerated"  # node/docklook.py look: a configured dock that is not there


class AbsentLooker:
    """The node's dock looker (``node/docklook.py`` ``DockLooker``) whose every look is finished as it is asked and
    finds no dock (``detail``)."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        self.done: set[str] = set()

    def ask(self, purpose: str) -> None:
        self.done.add(purpose)

    def take(self, purpose: str) -> Look | None:
        if purpose not in self.done:
            return None
        self.done.discard(purpose)
        return Look(False, self.detail, None)

    def close(self) -> None:
        pass


def run_until_third_retry(tmp_path: Path, tiny_onnx: Path, dock: str, caplog: pytest.LogCaptureFixture
                          ) -> list[tuple[str, str]]:
    """Run a node with ``dock`` until its supervisor has retried :data:`RETRIES` times and is degraded again, then
    SIGINT it; its own log lines from its first transition on: (level, message)."""
    caplog.set_level(logging.DEBUG, logger="chestnut.node")
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock=dock, standby="warm",
                            timing={"backoff_initial_s": 0.05, "backoff_max_s": 0.1})
    node = Node(load_config(cfg))
    node.looker = AbsentLooker("dock disabled (dock.kind = none)" if dock == "none" else ABSENT)  # type: ignore
    if dock != "none":  # the worker's ladder finds no dock at its first rung (as the looks do): no process started
        node._start_worker = lambda: node.pending_events.append(  # type: ignore[method-assign]
            (Event.DOCK_ABSENT, ABSENT, Layer.USB))
    subscribe = node.subscribe_frames

    def subscribe_and_wrap() -> None:
        subscribe()
        real_poll = node.poller.poll

        def poll(timeout_ms: int) -> list[Any]:
            ready = list(real_poll(timeout_ms))
            retries = sum(t.event is Event.RETRY_DUE for t in node.sup.history)
            if retries >= RETRIES and node.sup.state is State.DEGRADED and not node.stop_requested:
                node.request_stop(signal.SIGINT)
            return ready

        node.poller.poll = poll  # type: ignore[method-assign]
    node.subscribe_frames = subscribe_and_wrap  # type: ignore[method-assign]
    assert node.run() == EXIT_OK
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "chestnut.node"]
    first = next(i for i, (_, m) in enumerate(lines) if m.startswith("starting -> qualifying"))
    return lines[first:]


def test_a_dock_disabled_by_choice_is_said_once_at_info_and_never_warned(tmp_path, tiny_onnx, caplog):
    """Its first move into degraded is INFO (the log went from qualifying to stopping without it), the looks and
    the back-off after it DEBUG."""
    off = "dock_absent (usb): dock disabled (dock.kind = none)"
    retry = "retry_due: back-off over; looking for the dock"
    assert run_until_third_retry(tmp_path, tiny_onnx, "none", caplog) == [
        ("INFO", "starting -> qualifying on fallback_ready: fallback_ready: fallback onnxruntime warm"),
        ("INFO", f"qualifying -> degraded on dock_absent: {off}; retry in 0.05 s"),  # every state is in the log
        ("INFO", "ready: answering cameraFrame from the fallback only: the dock is disabled (dock.kind = none), no "
                 "primary runs"),
        ("DEBUG", f"degraded -> looking on retry_due: {retry}"),
        ("DEBUG", f"looking -> degraded on dock_absent: {off}; retry in 0.1 s"),
        ("DEBUG", f"degraded -> looking on retry_due: {retry}"),
        ("DEBUG", f"looking -> degraded on dock_absent: {off}; retry in 0.1 s"),
        ("DEBUG", f"degraded -> looking on retry_due: {retry}"),
        ("DEBUG", f"looking -> degraded on dock_absent: {off}; retry in 0.1 s"),
        ("INFO", "signal 2: stopping"),
        ("INFO", "degraded -> stopping on stop: stop: stop requested"),
    ]


def test_a_configured_dock_that_is_absent_still_warns_at_every_look(tmp_path, tiny_onnx, caplog):
    absent = f"dock_absent (usb): {ABSENT}"
    retry = "retry_due: back-off over; looking for the dock"
    assert run_until_third_retry(tmp_path, tiny_onnx, "twin", caplog) == [
        ("INFO", "starting -> qualifying on fallback_ready: fallback_ready: fallback onnxruntime warm"),
        ("WARNING", f"qualifying -> degraded on dock_absent: {absent}; retry in 0.05 s"),
        ("INFO", "ready: answering cameraFrame from the fallback while the primary qualifies"),
        ("INFO", f"degraded -> looking on retry_due: {retry}"),
        ("WARNING", f"looking -> degraded on dock_absent: {absent}; retry in 0.1 s"),
        ("INFO", f"degraded -> looking on retry_due: {retry}"),
        ("WARNING", f"looking -> degraded on dock_absent: {absent}; retry in 0.1 s"),
        ("INFO", f"degraded -> looking on retry_due: {retry}"),
        ("WARNING", f"looking -> degraded on dock_absent: {absent}; retry in 0.1 s"),
        ("INFO", "signal 2: stopping"),
        ("INFO", "degraded -> stopping on stop: stop: stop requested"),
    ]
