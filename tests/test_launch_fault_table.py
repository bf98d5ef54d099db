"""The launch summary's fault table says what happened: ``chestnut launch --fault gpu_hang@20+10`` showed
``gpu_hang#1 expired (twin)`` at the instant the hang fired and ``clear (launch)`` 10 s later, which read as a
contradiction. A one-shot fault fires once and is spent as it fires (``backend/sim/faults.py``
``Fault.expired``); the launch's clear at the end of its DURATION then finds nothing left to remove. The table
now says so: ``spent (twin)`` with what the fault left behind, and the clear with what the twin removed
(``launch/summary.py`` ``fault_rows``, ``launch/faultplan.py`` ``ScheduleStep``); the ``--json`` summary carries
the same (``fault_events[].fired`` / ``spent``, ``fault_schedule[].id`` / ``removed``), and so does ``faults.json``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from drivelog import write_drive

from chestnut.backend.sim.faults import spent_on_expiry
from chestnut.launch.faultplan import FaultPlan, FaultRunner, faults_file_text
from chestnut.launch.summary import fault_rows, print_summary, summarize, write_summary_json
from chestnut.msgs.messaging import new_message

S = 10**9
MS = 10**6
HANG_LEFT = ("a one-shot: fired once and fires no more; the state it latched stays until GPU reset: 0xF3 off then "
             "on, chestnut twin power-cycle, or a brown-out")


def twin_fault(t_ns: int, fid: int, kind: str, action: str, params: str = "{}", site: str = "",
               fired: int = 0) -> tuple[int, str, bytes]:
    m = new_message("twinFault")
    m.logMonoTime = t_ns
    tf = m.twinFault
    tf.id, tf.kind, tf.action, tf.params, tf.site, tf.fired = fid, kind, action, params, site, fired
    return t_ns, "twinFault", m.to_bytes()


def node_state(t_ns: int) -> tuple[int, str, bytes]:
    m = new_message("nodeState")
    m.logMonoTime = t_ns
    return t_ns, "nodeState", m.to_bytes()


class Clock:
    """The run's clock (``launch/summary.py`` ``StackClock``) with its zero at ``t_zero_ns``."""

    def __init__(self, t_zero_ns: int) -> None:
        self.t_zero_ns = t_zero_ns

    def seconds(self, t_ns: int) -> float:
        return (t_ns - self.t_zero_ns) / S


class Twin:
    """A ``TwinClient`` stand-in: the twin's fault ids in injection order, and what a clear removes."""

    removes: dict[int, int] = {}
    next_id = 1

    def __init__(self, prefix: str) -> None:
        pass

    def __enter__(self) -> Twin:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def fault(self, kind: str, **params: Any) -> dict[str, Any]:
        fid, Twin.next_id = Twin.next_id, Twin.next_id + 1
        return {"id": fid, "kind": kind}

    def clear(self, fault_id: int | None) -> int:
        return Twin.removes[int(fault_id or 0)]

    def status(self) -> dict[str, Any]:
        return {"usb": {"present": True}}

    def power_cycle(self, off_s: float = 0.0) -> None:
        pass


def carried_out(monkeypatch: pytest.MonkeyPatch, plans: list[str], removes: dict[int, int],
                steps: list[tuple[float, int]], t_zero_ns: int) -> FaultRunner:
    """``plans`` carried out by a :class:`FaultRunner` on a :class:`Twin` (its clear of fault id N removes
    ``removes[N]``): each (elapsed s, CLOCK_MONOTONIC ns) of ``steps`` is one :meth:`FaultRunner.step` at that
    time, on a run's clock whose zero is ``t_zero_ns``."""
    monkeypatch.setattr("chestnut.backend.sim.client.TwinClient", Twin)
    monkeypatch.setattr(Twin, "removes", removes)
    monkeypatch.setattr(Twin, "next_id", 1)
    runner = FaultRunner("p", [FaultPlan.parse(p) for p in plans], Clock(t_zero_ns))  # type: ignore[arg-type]
    for elapsed, t_ns in steps:
        monkeypatch.setattr("chestnut.launch.faultplan.time.monotonic_ns", lambda t=t_ns: t)
        runner.step(elapsed)
    return runner


def test_a_one_shot_hang_reads_spent_as_it_fires_and_its_clear_finds_nothing_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capsys) -> None:
    """``--fault gpu_hang@15+10``: injected at 17.5 s, fired and spent at 17.6 s, cleared by the launch at 27.5 s."""
    caplog.set_level(logging.INFO, logger="chestnut.launch")
    t0 = 10 * S  # the log's first message: the logger's initData, 1 ms before the first item (tests/drivelog.py)
    write_drive([
        node_state(t0 + MS),
        twin_fault(t0 + 17_538_000_000, 1, "gpu_hang", "armed"),
        twin_fault(t0 + 17_578_000_000, 1, "gpu_hang", "fired", site="packet #1", fired=1),
        twin_fault(t0 + 17_578_000_000, 1, "gpu_hang", "expired", fired=1),
        node_state(t0 + 30 * S),
    ], tmp_path / "logs")
    s = summarize(tmp_path / "logs", 0)
    assert s["t_zero_ns"] == t0
    runner = carried_out(monkeypatch, ["gpu_hang@15+10"], {1: 0},
                         [(15.0, t0 + 17_534_000_000), (25.0, t0 + 27_533_000_000)], t0)
    s["fault_schedule"] = runner.schedule_rows(t0)
    assert s["fault_schedule"] == [
        {"t_s": 17.534, "action": "inject", "fault": "gpu_hang", "detail": "", "id": 1},
        {"t_s": 27.533, "action": "clear", "fault": "gpu_hang", "detail": "", "id": 1, "removed": 0},
    ]
    # the --json summary says what the table says: the one-shot's end is "spent", never "expired"
    assert [(e["action"], e["fired"], e["spent"]) for e in s["fault_events"]] == [
        ("armed", 0, False), ("fired", 1, False), ("spent", 1, True)]
    assert fault_rows(s) == [
        (17.534, "gpu_hang#1", "inject (launch)", ""),
        (17.538, "gpu_hang#1", "armed (twin)", "the kind's defaults"),
        (17.578, "gpu_hang#1", "fired (twin)", "hit packet #1"),
        (17.578, "gpu_hang#1", "spent (twin)", HANG_LEFT),
        (27.533, "gpu_hang#1", "clear (launch)", "nothing left in the twin to remove (gpu_hang#1 spent at 17.6 s)"),
    ]
    assert [r.getMessage() for r in caplog.records] == [
        "t=17.5 s: injected gpu_hang#1",
        "t=27.5 s: cleared gpu_hang#1: the twin had nothing left to remove (spent as it fired, or expired)",
    ]
    s.update(transitions=[], control=[], contracts={"one_output_per_frame": 0})
    print_summary(s, tmp_path)
    out = capsys.readouterr().out
    assert "expired" not in out and "spent (twin)" in out and "nothing left in the twin to remove" in out
    assert write_summary_json(tmp_path / "s.json", s) is None
    back = json.loads((tmp_path / "s.json").read_text())
    assert (back["fault_events"], back["fault_schedule"]) == (s["fault_events"], s["fault_schedule"])
    # the run directory's faults.json carries the same (it held the schedule alone)
    assert json.loads(faults_file_text(s)) == {"fault_schedule": back["fault_schedule"],
                                               "fault_events": back["fault_events"]}


def test_a_fault_that_lasts_until_cleared_is_removed_and_a_for_fault_expires(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``slow_gpu`` lasts until cleared: the launch's clear removes it. ``timeout`` with ``for_s`` that never
    fires (no bulk IN came): it expires when its ``--for`` ends, before the launch's clear; ``wedged``, a
    one-shot: spent as it fires, and the launch power-cycles the bridge after its clear."""
    t0 = 10 * S
    write_drive([
        node_state(t0 + MS),
        twin_fault(t0 + 5 * S, 1, "slow_gpu", "armed"),
        twin_fault(t0 + 6 * S, 1, "slow_gpu", "fired", site="packet #1", fired=1),
        twin_fault(t0 + 6 * S, 2, "timeout", "armed", params='{"for_s": 2.0, "on": "bulk_in"}'),
        twin_fault(t0 + 8 * S, 2, "timeout", "expired", params='{"for_s": 2.0, "on": "bulk_in"}'),
        twin_fault(t0 + 9 * S, 1, "slow_gpu", "cleared", fired=4),
        twin_fault(t0 + 9 * S, 3, "wedged", "armed"),
        twin_fault(t0 + 9 * S, 3, "wedged", "fired", site="control in 0xe4 #1", fired=1),
        twin_fault(t0 + 9 * S, 3, "wedged", "expired", fired=1),
        node_state(t0 + 20 * S),
    ], tmp_path / "logs")
    s = summarize(tmp_path / "logs", 0)
    # the --json summary's words are the table's: "expired" only for the --for that ended unfired
    assert [(e["fault"], e["action"], e["fired"], e["spent"]) for e in s["fault_events"]] == [
        ("slow_gpu#1", "armed", 0, False), ("slow_gpu#1", "fired", 1, False), ("timeout#2", "armed", 0, False),
        ("timeout#2", "expired", 0, False), ("slow_gpu#1", "cleared", 4, False), ("wedged#3", "armed", 0, False),
        ("wedged#3", "fired", 1, False), ("wedged#3", "spent", 1, True)]
    runner = carried_out(monkeypatch, ["slow_gpu@5+4", "timeout@6+4,for_s=2,on=bulk_in", "wedged@9+1"],
                         {1: 1, 2: 0, 3: 0},
                         [(5.0, t0 + 5 * S), (6.0, t0 + 6 * S), (9.0, t0 + 9 * S), (10.0, t0 + 10 * S)], t0)
    s["fault_schedule"] = runner.schedule_rows(t0)
    assert [(r["action"], r["fault"], r["id"], r.get("removed"), r["detail"]) for r in s["fault_schedule"]] == [
        ("inject", "slow_gpu", 1, None, ""),
        ("inject", "timeout", 2, None, '{"for_s": 2.0, "on": "bulk_in"}'),
        ("inject", "wedged", 3, None, ""),
        ("clear", "slow_gpu", 1, 1, ""),
        ("clear", "timeout", 2, 0, ""),
        ("clear", "wedged", 3, 0, "then power_cycle"),
    ]
    rows = [(t, fault, what, detail) for t, fault, what, detail in fault_rows(s) if what.endswith("(launch)")
            or what in ("spent (twin)", "expired (twin)", "cleared (twin)")]
    assert rows == [
        (5.0, "slow_gpu#1", "inject (launch)", ""),
        (6.0, "timeout#2", "inject (launch)", '{"for_s": 2.0, "on": "bulk_in"}'),
        (8.0, "timeout#2", "expired (twin)", "its --for 2 s ended"),
        (9.0, "wedged#3", "inject (launch)", ""),
        (9.0, "slow_gpu#1", "clear (launch)", "removed from the twin"),
        (9.0, "slow_gpu#1", "cleared (twin)", ""),
        (9.0, "wedged#3", "spent (twin)", "a one-shot: fired once and fires no more; the state it latched stays "
                                          "until chestnut twin power-cycle"),
        (10.0, "timeout#2", "clear (launch)", "nothing left in the twin to remove (timeout#2 expired at 8.0 s)"),
        (10.0, "wedged#3", "clear (launch)", "nothing left in the twin to remove (wedged#3 spent at 9.0 s); "
                                             "then power_cycle"),
    ]


@pytest.mark.parametrize(("kind", "params", "fired", "spent"), [
    ("gpu_hang", "{}", 1, True),            # once by default: spent as it fires
    ("gpu_hang", '{"for_s": 5.0}', 1, True),  # fired within its --for: spent all the same
    ("gpu_hang", '{"for_s": 5.0}', 0, False),  # never fired: its --for ended
    ("slow_gpu", '{"for_s": 5.0}', 3, False),  # lasts until cleared: only its --for ends it
    ("timeout", '{"repeat": true, "for_s": 1.0}', 2, False),
    ("gpu_hang", "not json", 1, False),
])
def test_an_expiry_is_spent_only_for_a_fault_that_fired_and_does_not_repeat(kind, params, fired, spent):
    assert spent_on_expiry(kind, params, fired) is spent


def test_a_repeating_faults_fires_are_one_row_with_their_count_and_the_last_time():
    """A repeating ``slow_gpu`` fires on every packet it hits: a 30 s fault was 3002 rows of ``fired (twin) hit
    packet #N`` in the printed summary, burying the node-state and control tables. The ``--json`` summary keeps
    every event."""
    events = [{"t_s": 5.0, "fault": "slow_gpu#1", "action": "armed", "site": "", "params": {}}]
    events += [{"t_s": 5.0 + i / 20, "fault": "slow_gpu#1", "action": "fired", "site": f"packet #{i + 1}"}
               for i in range(600)]
    events += [{"t_s": 6.0, "fault": "nan_output#2", "action": "fired", "site": ""}]
    rows = fault_rows({"fault_events": events, "fault_schedule": []})
    fired = [r for r in rows if r[2] == "fired (twin)"]
    assert fired == [(5.0, "slow_gpu#1", "fired (twin)", "hit packet #1; fired 600 times, the last at t=35.0 s"),
                     (6.0, "nan_output#2", "fired (twin)", "")]
    assert len(events) == 602 and events[1]["site"] == "packet #1"  # the summary's own events are not changed
