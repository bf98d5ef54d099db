"""Every log segment begins with the run's configuration (``msgs/logfile.py`` ``CARRIED_SERVICES``).

The node publishes its ``initData`` (its configuration) at its start and every 10 s; a segment whose span had
none was judged by ``chestnut check`` and ``replay`` against ``launch/node.toml``'s defaults. The logger now
writes the most recent ``initData`` it logged right after the header of every later segment, as openpilot's
loggerd writes its ``init_data`` at the start of every segment (``system/loggerd/logger.cc``
``LoggerState::next``). Real ZeroMQ sockets, the recorder's own loop; segments rotate on a fake clock.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from chestnut.msgs.logfile import CARRIED_KEY, LogReader, RouteWriter, SegmentFileReader, find_log_files
from chestnut.msgs.logger import Recorder
from chestnut.msgs.messaging import PubMaster, log_from_bytes, new_message
from chestnut.node.config import NodeConfig
from chestnut.node.offline.contracts import check_log
from chestnut.node.offline.replay import find_node_config
from chestnut.node.offline.timeline import read_timeline

pytestmark = [pytest.mark.timeout(60)]

SEGMENT_S = 5.0
DEADLINE_MS, WAIT_TIMEOUT_MS, HANG_MARGIN_MS = 77.0, 1234.0, 321.0  # none of them node.toml's


class Clock:
    """The route writer's clock (s, monotonic): segments rotate when the test moves it."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _run_config() -> dict[str, Any]:
    cfg = NodeConfig().to_json()
    cfg["timing"] = {**cfg["timing"], "deadline_ms": DEADLINE_MS, "hang_margin_ms": HANG_MARGIN_MS}
    cfg["dock"] = {**cfg["dock"], "wait_timeout_ms": WAIT_TIMEOUT_MS}
    return cfg


class Spy:
    """What the recorder handed its route writer, in order: ``(service, bytes)``."""

    def __init__(self, w: RouteWriter) -> None:
        self.seen: list[tuple[str, bytes]] = []
        self._write = w.write
        w.write = self  # type: ignore[method-assign]

    def __call__(self, service: str, t: int, data: bytes) -> None:
        self.seen.append((service, bytes(data)))
        self._write(service, t, data)


def _until(rec: Recorder, spy: Spy, service: str, data: bytes, deadline: float) -> None:
    while (service, data) not in spy.seen:
        assert time.monotonic() < deadline, f"{service}: never logged"
        rec.step(20)


def _join(pm: PubMaster, rec: Recorder, spy: Spy, service: str, deadline: float) -> None:
    """Send throw-away ``service`` messages until one is logged (ZeroMQ drops what a publisher sends before a
    subscription reached it); one publisher, one connection: every later message arrives after them."""
    while not any(s == service for s, _ in spy.seen):
        assert time.monotonic() < deadline, f"the recorder never joined {service}"
        pm.send(service, new_message(service))
        rec.step(20)


def _record(log_dir: Path, formats: tuple[str, ...] = ("zst",)) -> tuple[bytes, list[Path]]:
    """A node's ``initData`` logged in segment 0 only, then ``controlState`` in segments 1 and 2: (the
    ``initData`` bytes as published, the segment folders)."""
    clock = Clock()
    deadline = time.monotonic() + 30
    with PubMaster(["initData", "controlState"]) as pm, \
            RouteWriter(log_dir, formats=formats, segment_seconds=SEGMENT_S, clock=clock) as w:
        spy = Spy(w)
        rec = Recorder(w, ["initData", "controlState"])
        try:
            _join(pm, rec, spy, "initData", deadline)  # an initData of no model: not the node's
            _join(pm, rec, spy, "controlState", deadline)
            init = new_message("initData")
            init.initData.config = json.dumps(_run_config())
            published = init.to_bytes()
            pm.send("initData", published)  # once, as a node at its start: segments 1 and 2 get none
            _until(rec, spy, "initData", published, deadline)
            for segment in (1, 2):
                clock.t += SEGMENT_S
                rec.step(0)  # the writer's tick rotates
                assert w.segment == segment
                filler = new_message("controlState")
                filler.controlState.softDisableRemaining = float(segment)
                sent = filler.to_bytes()
                pm.send("controlState", sent)
                _until(rec, spy, "controlState", sent, deadline)
        finally:
            rec.close_sockets()
    return published, sorted(p for p in log_dir.iterdir() if p.is_dir())


@pytest.mark.parametrize("fmt", ["zst", "mcap"])
def test_each_later_segment_begins_with_the_nodes_init_data_byte_for_byte(tmp_path: Path, fmt: str) -> None:
    published, segments = _record(tmp_path / "logs", (fmt,))
    t_init = log_from_bytes(published).logMonoTime
    assert len(segments) == 3
    for n, seg in enumerate(segments):
        items = list(SegmentFileReader(seg / f"rlog.{fmt}"))
        header_config = json.loads(items[0][3].initData.config)
        assert items[0][1] == "initData" and header_config["segment"] == n  # the logger's own header first
        if n == 0:
            assert CARRIED_KEY not in header_config
            assert [d for _, s, d, _ in items].count(published) == 1  # the original
            continue
        assert header_config[CARRIED_KEY] == [["initData", t_init]]
        assert (items[1][0], items[1][1], items[1][2]) == (t_init, "initData", published)  # as published
        assert [s for _, s, _, _ in items[2:]] == ["controlState"]  # and nothing else repeated


def test_a_later_segment_alone_is_checked_and_replayed_with_the_runs_configuration(tmp_path: Path) -> None:
    published, segments = _record(tmp_path / "logs")
    run_config = _run_config()
    for seg in segments[1:]:
        result = check_log(seg)
        assert result.config_origin == "the log's node initData"
        p = result.params
        assert (p.deadline_ms, p.wait_timeout_ms, p.hang_margin_ms) == (DEADLINE_MS, WAIT_TIMEOUT_MS, HANG_MARGIN_MS)
        assert find_node_config(find_log_files(seg)) == run_config  # what chestnut replay plans from


def test_a_repeated_copy_is_configuration_only_not_a_node_session_nor_the_files_start(tmp_path: Path) -> None:
    published, segments = _record(tmp_path / "logs")
    t_init = log_from_bytes(published).logMonoTime
    whole = read_timeline(tmp_path / "logs")
    assert [(r.t_ns, r.carried) for r in whole.inits if "model" in r.config] == [
        (t_init, False), (t_init, True), (t_init, True)]
    assert [(s.start_ns, s.end_ns) for s in whole.sessions] == [(t_init, t_init)]  # the original's alone
    alone = read_timeline(segments[2])
    header_t = next(t for t, _, _ in LogReader(segments[2], reorder_window_ns=0))  # the file's first message
    assert alone.start_ns == header_t > t_init  # the copy's older time is not the segment's start
    assert alone.node_config() == _run_config() and alone.sessions == []


def test_only_a_message_within_the_services_bound_is_held_for_the_next_segments(tmp_path: Path) -> None:
    """The logger's bounds hold: what a segment repeats is at most the service's ``max_bytes`` (``initData``:
    1 MiB, ``msgs/services.py``), as a subscriber never receives more; a bigger one is logged, never held."""
    from chestnut.msgs.services import SERVICE_LIST

    clock = Clock()
    bound = SERVICE_LIST["initData"].max_bytes
    within, over = new_message("initData"), new_message("initData")
    within.initData.config = json.dumps({"model": {"name": "within"}})
    over.initData.config = json.dumps({"model": {"name": "x" * bound}})
    small, big = within.to_bytes(), over.to_bytes()
    assert len(small) <= bound < len(big)
    with RouteWriter(tmp_path, formats=("zst",), segment_seconds=SEGMENT_S, clock=clock) as w:
        w.write("initData", log_from_bytes(small).logMonoTime, small)
        w.write("initData", log_from_bytes(big).logMonoTime, big)  # newer, but over the bound: not held
        clock.t += SEGMENT_S
        w.tick()
        assert w.segment == 1
    items = list(SegmentFileReader(tmp_path / f"{w.route}--1" / "rlog.zst"))
    assert [(s, d) for _, s, d, _ in items[1:]] == [("initData", small)]
    assert json.loads(items[0][3].initData.config)[CARRIED_KEY] == [["initData", log_from_bytes(small).logMonoTime]]
