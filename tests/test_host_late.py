"""Host starvation told apart from dock faults (node/policy.py host_late, node/watchdog.py, node/hostload.py),
and the node's realtime scheduling (node/realtime.py, the [realtime] config). Pure: figures and clocks are
passed in; nothing here measures time."""

from __future__ import annotations

import argparse
import logging
import os
import threading

import pytest

from chestnut.backend.errors import ConfigError, Layer
from chestnut.node import config as node_config
from chestnut.node import realtime
from chestnut.node.hostload import HostMeter, read_cpu_pressure
from chestnut.node.policy import HostFigures, HostThresholds, count_miss, host_late
from chestnut.node.watchdog import ActionKind, RequestKind, Watchdog, WatchdogConfig

MS = 1_000_000
LATE = "host late: loop woke 38 ms late, cpu pressure 64 %"


# ---------------------------------------------------------------- the rule
def test_an_on_time_host_is_not_late():
    assert host_late(HostFigures(loop_late_ms=2.0, worker_late_ms=1.0, cpu_pressure_pct=12.0)) == ""
    assert host_late(HostFigures()) == ""  # no PSI on this kernel: only the wake-ups speak


def test_a_late_host_is_named_with_its_figures():
    assert host_late(HostFigures(loop_late_ms=38.2, cpu_pressure_pct=64.0)) == LATE
    assert host_late(HostFigures(worker_late_ms=25.0)) == "host late: worker's timer woke 25 ms late"
    # a result past the deadline although the dock's own stages fit inside it: the time was lost on the host
    assert host_late(HostFigures(dock_ms=14.0, elapsed_ms=180.0)) == "host late: the dock took 14 ms of the 180 ms"
    # the dock itself took longer than the deadline, on an on-time host: the dock's
    assert host_late(HostFigures(dock_ms=170.0, elapsed_ms=180.0)) == ""


def test_the_thresholds_are_the_configured_ones():
    th = HostThresholds(late_ms=50.0, cpu_pressure_pct=90.0)
    assert host_late(HostFigures(loop_late_ms=38.0, cpu_pressure_pct=64.0), th) == ""
    assert host_late(HostFigures(loop_late_ms=50.0), th) == "host late: loop woke 50 ms late"


# ---------------------------------------------------------------- the node's miss count
def test_host_late_misses_do_not_count_towards_a_failover():
    run = 0
    for _ in range(10):
        v = count_miss(run, 3, True, 150.0, "no primary result", host=LATE)
        assert not v.fail_over and v.host == LATE
        run = v.run
    assert run == 0


def test_on_time_misses_still_fail_over_and_host_misses_between_them_neither_count_nor_reset():
    v1 = count_miss(0, 3, True, 150.0, "a")
    v2 = count_miss(v1.run, 3, True, 150.0, "host's", host=LATE)
    v3 = count_miss(v2.run, 3, True, 150.0, "b")
    assert (v1.run, v2.run, v3.run) == (1, 1, 2) and not v3.fail_over
    v4 = count_miss(v3.run, 3, True, 150.0, "c")
    assert v4.fail_over and v4.run == 3 and "3 consecutive frames" in v4.reason


# ---------------------------------------------------------------- the watchdog
def _watchdog() -> Watchdog:
    wd = Watchdog(WatchdogConfig(alive_enabled=False))
    wd.worker_started(0)
    return wd


def _miss_frames(wd: Watchdog, n: int, host: str, start_seq: int = 1) -> list:
    """``n`` frames requested 200 ms apart, each past its 150 ms deadline at the check."""
    actions = []
    for i in range(n):
        seq, t0 = start_seq + i, (start_seq + i) * 200 * MS
        wd.request(seq, t0)
        actions += wd.check(t0 + 160 * MS, host)
        actions += list(wd.response(seq, t0 + 170 * MS, host).actions)  # the late result, discarded
    return actions


def test_watchdog_host_late_misses_are_answered_from_the_fallback_but_not_failed_over():
    wd = _watchdog()
    actions = _miss_frames(wd, 6, LATE)
    kinds = [(a.kind, a.entity) for a in actions]
    assert (ActionKind.ANSWER_FROM_FALLBACK, "host") in kinds
    assert all(a.kind is not ActionKind.FAIL_OVER for a in actions)
    assert sum(a.kind is ActionKind.ANSWER_FROM_FALLBACK for a in actions) == 6
    assert all(LATE in a.reason for a in actions if a.entity == "host")
    assert wd.host_misses == 6 and not wd.expired


def test_watchdog_on_time_misses_fail_the_gpu_over():
    wd = _watchdog()
    actions = _miss_frames(wd, 3, "")
    fail = [a for a in actions if a.kind is ActionKind.FAIL_OVER]
    assert len(fail) == 1 and fail[0].layer is Layer.GPU and wd.host_misses == 0


def test_a_hung_gpu_fails_over_whatever_the_host_does():
    wd = _watchdog()
    wd.request(1, 0)
    assert wd.check(160 * MS, LATE)[0].entity == "host"  # the deadline miss: the host's
    hang_ns = int(wd.config.hang_timeout_ms * MS) + 1
    kills = [a for a in wd.check(hang_ns, LATE) if a.kind is ActionKind.KILL_WORKER]
    assert len(kills) == 1 and kills[0].entity == "hang" and kills[0].layer is Layer.GPU


def test_a_silent_worker_is_killed_whatever_the_host_does():
    wd = Watchdog(WatchdogConfig())
    wd.worker_started(0)
    kills = [a for a in wd.check(10_000 * MS, LATE) if a.kind is ActionKind.KILL_WORKER]
    assert len(kills) == 1 and kills[0].entity == "alive"


def test_commands_are_not_deadline_judged():
    wd = _watchdog()
    wd.request(1, 0, RequestKind.COMMAND)
    assert wd.check(500 * MS, LATE) == []


# ---------------------------------------------------------------- the figures
def test_the_meter_keeps_the_worst_lateness_of_its_window():
    m = HostMeter(window_ms=1000.0, psi_path=__import__("pathlib").Path("/nonexistent/psi"))
    m.loop_woke(0, 5 * MS)
    m.loop_woke(100 * MS, 138 * MS)          # 38 ms late
    m.loop_woke(200 * MS, 190 * MS)          # woke early (an event): no lateness
    m.worker_late(12 * MS, 300 * MS)
    f = m.figures(1000 * MS)
    assert (f.loop_late_ms, f.worker_late_ms, f.cpu_pressure_pct) == (38.0, 12.0, None)
    assert m.figures(1500 * MS).loop_late_ms == 0.0  # out of the window


def test_cpu_pressure_is_psi_some_avg10(tmp_path):
    psi = tmp_path / "cpu"
    psi.write_text("some avg10=63.72 avg60=27.06 avg300=8.68 total=33373854\n"
                   "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert read_cpu_pressure(psi) == 63.72
    assert read_cpu_pressure(tmp_path / "absent") is None
    psi.write_text("garbage\n")
    assert read_cpu_pressure(psi) is None


# ---------------------------------------------------------------- realtime scheduling
def test_the_realtime_config_is_parsed(tmp_path):
    cfg = node_config.load_config(node_config.DEFAULT_CONFIG)
    assert (cfg.realtime.policy, cfg.realtime.priority, cfg.realtime.cpus) == ("fifo", 54, ())
    toml = tmp_path / "node.toml"
    cpu = max(os.sched_getaffinity(0))
    toml.write_text(f'[realtime]\npolicy = "rr"\npriority = 10\ncpus = [{cpu}]\n'
                    '[timing]\nhost_late_ms = 30\nhost_cpu_pressure_pct = 70\n')
    cfg = node_config.load_config(toml)
    assert (cfg.realtime.policy, cfg.realtime.priority, cfg.realtime.cpus) == ("rr", 10, (cpu,))
    assert (cfg.timing.host_late_ms, cfg.timing.host_cpu_pressure_pct) == (30.0, 70.0)
    for bad in ('policy = "idle"', "priority = 0", "priority = 100", "cpus = [-1]"):
        toml.write_text(f"[realtime]\n{bad}\n")
        with pytest.raises(ConfigError, match="realtime"):
            node_config.load_config(toml)


def test_settings_of_the_wrong_type_or_out_of_range_are_one_line_each(tmp_path):
    toml = tmp_path / "node.toml"
    cases = {
        "[realtime]\npriority = true": "realtime.priority = True; want an integer",
        '[realtime]\npriority = "54"': "realtime.priority = '54'; want an integer",
        "[realtime]\npriority = 54.5": "realtime.priority = 54.5; want an integer",
        "[realtime]\ncpus = 1": "realtime.cpus = 1; want a list of integers, e.g. [0, 1]",
        '[realtime]\ncpus = ["1"]': "realtime.cpus = ['1']; want a list of integers, e.g. [0, 1]",
        "[realtime]\ncpus = [4096]": "realtime.cpus = [4096]; want distinct CPUs of this host's",
        "[realtime]\ncpus = [0, 0]": "realtime.cpus = [0, 0]; want distinct CPUs of this host's",
        "[timing]\nhost_late_ms = inf": "timing.host_late_ms = inf; want a finite number > 0",
        '[timing]\nhost_late_ms = "20"': "timing.host_late_ms = '20'; want a number",
        "[timing]\nhost_cpu_pressure_pct = 150": "timing.host_cpu_pressure_pct = 150.0; want at most 100",
    }
    for text, line in cases.items():
        toml.write_text(text + "\n")
        with pytest.raises(ConfigError) as info:
            node_config.load_config(toml)
        assert str(info.value.detail).startswith(line), (text, info.value.detail)
    toml.write_text("[timing]\nhost_late_ms = 25\n")  # an integer is a number
    assert node_config.load_config(toml).timing.host_late_ms == 25.0


def test_the_camera_and_control_priorities_are_checked_at_the_command_line(capsys):
    p = argparse.ArgumentParser(prog="chestnut camera")
    realtime.add_priority_argument(p, realtime.CAMERA_PRIORITY, "camera")
    assert p.parse_args([]).rt_priority == 51 and p.parse_args(["--rt-priority", "0"]).rt_priority == 0
    for bad in ("500", "-1", "x"):
        with pytest.raises(SystemExit) as info:
            p.parse_args(["--rt-priority", bad])
        assert info.value.code == 2
    assert "argument --rt-priority: 'x' is not a number: want 0..99" in capsys.readouterr().err
    assert realtime.CAMERA_PRIORITY < realtime.CONTROL_PRIORITY < realtime.worker_priority(realtime.DEFAULT_PRIORITY)


@pytest.mark.parametrize(("priority", "warned"), [(52, False), (53, True), (99, True)])
def test_a_camera_priority_not_below_the_nodes_worker_is_warned_about_in_one_line(priority, warned, monkeypatch):
    """``chestnut camera --rt-priority 60`` was taken silently, above the node's 54."""
    monkeypatch.setattr(realtime, "config_realtime_process", lambda *a, **k: (True, "camera scheduling: granted"))
    log = logging.getLogger("test.camera")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        assert realtime.apply_priority(priority, "camera", log) is True
    finally:
        log.removeHandler(handler)
    lines = [(r.levelname, r.getMessage()) for r in records]
    warning = ("WARNING", f"camera SCHED_FIFO priority {priority} is not below the node's worker's 53 (a node at "
                          "the default 54): it would preempt the node's per-frame work; keep it below the node's "
                          "[realtime] priority minus 1")
    assert lines == ([warning] if warned else []) + [("INFO", "camera scheduling: granted")]


def test_the_realtime_flags_override_the_file():
    p = argparse.ArgumentParser()
    node_config.add_arguments(p)
    cfg = node_config.from_args(p.parse_args(["--rt-policy", "other", "--rt-priority", "20", "--rt-cpus", "0,1"]))
    assert (cfg.realtime.policy, cfg.realtime.priority, cfg.realtime.cpus) == ("other", 20, (0, 1))
    with pytest.raises(ConfigError, match="--rt-cpus"):
        node_config.from_args(p.parse_args(["--rt-cpus", "one"]))
    cfg = node_config.from_args(p.parse_args(["--rt-priority", "0"]))  # 0: no realtime policy
    assert cfg.realtime.policy == "other"


@pytest.mark.parametrize("text", ["", ",", " , "])
def test_an_rt_cpus_that_names_no_cpu_is_refused_in_one_line(text, capsys):
    """``chestnut run --rt-cpus=`` was taken as the default (any CPU) without a word: a pinning asked for and not
    done. Leaving the flag out is how to say any CPU."""
    from chestnut.launch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["run", "--dock", "none", f"--rt-cpus={text}"])
    assert (info.value.code, capsys.readouterr()) == (2, ("", (
        f"chestnut run: error: argument --rt-cpus: {text!r}: give CPU numbers such as 1 or 0,1 (leave --rt-cpus out "
        "for any CPU) (chestnut run --help)\n")))


def _refuse(*_args):
    raise PermissionError(1, "Operation not permitted")


def test_a_refused_realtime_policy_is_one_line_not_a_traceback(monkeypatch, caplog):
    monkeypatch.setattr(os, "sched_setscheduler", _refuse)
    monkeypatch.setattr(os, "sched_setaffinity", _refuse)
    ok, line = realtime.config_realtime_process("fifo", 54, (1,), "node")
    assert not ok and "\n" not in line
    assert line.startswith("node scheduling: SCHED_FIFO priority 54 refused (EPERM: not permitted)")
    assert "LimitRTPRIO=" in line and "CPU affinity 1 refused" in line

    from chestnut.node.main import apply_realtime

    cfg = node_config.load_config(node_config.DEFAULT_CONFIG)
    with caplog.at_level(logging.INFO, logger="chestnut.node"):
        assert apply_realtime(cfg) is False
    records = [r for r in caplog.records if r.name == "chestnut.node"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING and records[0].exc_info is None
    assert "refused (EPERM" in records[0].getMessage()


def test_a_granted_policy_says_so_and_other_asks_for_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "sched_setscheduler", lambda pid, pol, param: calls.append((pid, pol,
                                                                                          param.sched_priority)))
    assert realtime.config_realtime_process("fifo", 54) == (True, "node scheduling: SCHED_FIFO priority 54")
    assert calls == [(0, os.SCHED_FIFO, 54)]
    ok, line = realtime.config_realtime_process("other", 54, (), "worker")
    assert ok and "no realtime policy" in line and len(calls) == 1
    # the worker asks for every thread it has once it serves (its heartbeat thread started long before)
    threading.Thread(target=threading.Event().wait, args=(5.0,), daemon=True).start()
    tids = sorted(int(t) for t in os.listdir("/proc/self/task"))
    assert realtime.config_realtime_process("fifo", 53, (), "worker", all_threads=True, reset_on_fork=True)[0]
    assert sorted(pid for pid, _, _ in calls[1:]) == tids
    assert {(pol, p) for _, pol, p in calls[1:]} == {(os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, 53)}
    assert realtime.worker_priority(54) == 53 and realtime.worker_priority(1) == 1


def test_cpu_pressure_alone_never_makes_a_miss_the_hosts():
    # a hung or slow GPU beside CPU-bound load, on an on-time node and worker: the dock's
    assert host_late(HostFigures(cpu_pressure_pct=95.0)) == ""
    assert host_late(HostFigures(cpu_pressure_pct=95.0, dock_ms=170.0, elapsed_ms=180.0)) == ""
    # the node's own figures decide; the pressure is named beside them from its threshold on
    assert host_late(HostFigures(loop_late_ms=38.0, cpu_pressure_pct=39.0)) == "host late: loop woke 38 ms late"
    assert host_late(HostFigures(dock_ms=14.0, elapsed_ms=180.0, cpu_pressure_pct=40.0)) == \
        "host late: the dock took 14 ms of the 180 ms, cpu pressure 40 %"


def test_a_miss_run_while_the_link_failed_transfers_is_the_usb_layers():
    from chestnut.node.policy import miss_run_blame

    why = "3 consecutive frames without a primary result within the deadline (150 ms)"
    assert miss_run_blame(why, 0) == (Layer.GPU, why)  # a hung GPU: its fence polls complete
    assert miss_run_blame(why, 12) == (Layer.USB, why + "; the link failed 12 transfer attempt(s) meanwhile")


def test_a_result_the_host_delayed_excuses_the_frames_queued_behind_it_for_the_window():
    """A late result whose dock stages fit (the host cost it 60 ms) makes the next misses, of frames that
    queued behind it, the host's too -- within the window only, and never a result's own verdict."""
    from chestnut.node.hostload import HostMeter

    meter = HostMeter(window_ms=1000.0)
    meter.result_outside(5_000_000_000, 60_000_000)
    assert host_late(meter.figures(5_100_000_000, pressure=0.0)) == "host late: a result lost 60 ms outside the dock"
    assert host_late(meter.figures(5_100_000_000, dock_ms=170.0, elapsed_ms=180.0, pressure=0.0)) == ""
    assert host_late(meter.figures(6_100_000_000, pressure=0.0)) == ""  # out of the window: the dock's again
    meter.result_outside(7_000_000_000, 19_000_000)
    assert host_late(meter.figures(7_000_000_000, pressure=0.0)) == ""  # under 20 ms: the host's jitter
