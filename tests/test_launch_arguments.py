"""``chestnut launch``'s arguments are refused up front in one line: a fault that would start at or after
the end of the run, a camera rate out of bounds, a fault parameter that is not a number."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from chestnut.backend.sim.faults import FaultSpec
from chestnut.launch.faultplan import FaultPlan, FaultRunner
from chestnut.launch.stack import FAULT_SETTLE_S, MAX_RATE_HZ, argument_problem, run_over

CHESTNUT = str(Path(sys.executable).with_name("chestnut"))


def test_a_fault_at_or_after_the_end_of_the_run_is_refused():
    late = FaultPlan.parse("gpu_hang@50")
    assert argument_problem(10.0, 20.0, [FaultPlan.parse("slow_gpu@2+3"), late]) == (
        "--fault gpu_hang@50 starts at or after the end of the run (--seconds 10): "
        "give a START below 10 or a longer --seconds"
    )
    assert argument_problem(10.0, 20.0, [FaultPlan.parse("gpu_hang@10")]) is not None  # at the end: never injected
    assert argument_problem(10.0, 20.0, [FaultPlan.parse("gpu_hang@9.5")]) is None
    assert argument_problem(0.0, 20.0, [late]) is None  # 0 = until Ctrl-C: any START can come


def test_the_camera_rate_is_bounded():
    assert MAX_RATE_HZ == 100.0
    assert argument_problem(10.0, 100.0, []) is None
    assert argument_problem(10.0, 1.0, []) is None
    want = "--rate {}: give a camera rate in [1, 100] Hz (default 20, openpilot's model rate)"
    assert argument_problem(10.0, 1000.0, []) == want.format(1000)
    assert argument_problem(10.0, 0.0, []) == want.format(0)
    assert argument_problem(10.0, 1e-300, []) == want.format("1e-300")
    assert argument_problem(-1.0, 20.0, []) == ("--seconds -1: give 0 (until Ctrl-C) or a number of seconds up to "
                                                "604800 (a week)")


@pytest.mark.parametrize("rate", ["1e-300", "0.5", "0", "101", "nan", "inf"])
def test_a_launch_rate_out_of_the_cameras_bounds_is_refused_by_argparse(rate, tmp_path, capsys):
    """``chestnut launch --rate 1e-300`` passed launch's own check, (0, 100] Hz, and the camera then crashed
    (its frame period overflowed): launch takes the camera's lower bound (1 Hz) as argparse reads it."""
    from chestnut.launch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["launch", "--rate", rate, "--runs-dir", str(tmp_path / "runs")])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"chestnut launch: error: argument --rate: {rate!r}: give a camera rate in [1, 100] Hz (default 20, "
        "openpilot's model rate) (chestnut launch --help)\n"
    )
    assert not (tmp_path / "runs").exists()


def test_a_late_fault_stops_the_launch_before_anything_starts(tmp_path):
    r = subprocess.run(
        [CHESTNUT, "launch", "--seconds", "10", "--fault", "gpu_hang@50", "--runs-dir", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        "ERROR chestnut.launch: --fault gpu_hang@50 starts at or after the end of the run (--seconds 10): "
        "give a START below 10 or a longer --seconds"
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("slow_gpu@2,delay_ms=abc", "delay_ms (--delay-ms) = 'abc' is not a delay in milliseconds; give e.g. "
                                    "delay_ms=400"),
        ("short@2,nbytes=1.5", "nbytes (--nbytes) = 1.5 is not a byte count; give e.g. nbytes=4096"),
        ("slow_gpu@2,delay_ms=nan", "delay_ms (--delay-ms) = nan is not a delay in milliseconds; give e.g. "
                                    "delay_ms=400"),
        ("brownout@2,off_s=inf", "off_s (--off-s) = inf is not a duration in seconds; give e.g. off_s=2"),
        ("short@2,nbytes=-1", "nbytes (--nbytes) = -1: give a byte count >= 0"),
        ("slow_gpu@2,delay_ms=-1", "delay_ms (--delay-ms) = -1: give a value >= 0"),
        # "delay_ms and off_s must be >= 0" named an option not given (twin fault brownout --off-s -1 alike)
        ("brownout@2,off_s=-1", "off_s (--off-s) = -1: give a value >= 0"),
        ("slow_gpu@2,delay_ms=1e12", "delay_ms (--delay-ms) = 1e+12: at most 60000 ms (20x the 3000 ms wait timeout: "
                                     "any longer is a hang, gpu_hang)"),
        ("brownout@2,off_s=1e9", "off_s (--off-s) = 1e+09: at most 3600 s (longer off is an unplug: chestnut twin "
                                 "unplug)"),
        ("gpu_hang@2,for_s=1e300", "for_s (--for) = 1e+300: at most 604800 s (a week: the longest chestnut launch run, "
                                   "msgs/argtypes.py MAX_RUN_SECONDS)"),
        # a fault that could never fire (its opportunities past what twinFault.opportunities, a UInt32, carries)
        ("gpu_hang@2,after=1e23", "after (--after) = 1e+23: at most 4294967294 opportunities (it fires at opportunity "
                                  "after + 1, and twinFault.opportunities is a UInt32: msgs/chestnut.capnp)"),
        ("gpu_hang@2,after=4294967295", "after (--after) = 4294967295: at most 4294967294 opportunities (it fires at "
                                        "opportunity after + 1, and twinFault.opportunities is a UInt32: "
                                        "msgs/chestnut.capnp)"),
        ("short@2,nbytes=1073741825", "nbytes (--nbytes) = 1073741825: at most 1073741824 bytes (1 GiB, more than "
                                      "any transfer the node makes)"),
        ("bad_tlp@2,delay_ms=5", "delay_ms (--delay-ms) applies to slow_gpu, not bad_tlp"),
        ("timeout@2,nbytes=4", "nbytes (--nbytes) applies to short and usb2, not timeout"),
    ],
)
def test_a_fault_parameter_of_the_wrong_kind_is_named(text, why):
    with pytest.raises(argparse.ArgumentTypeError) as info:
        FaultPlan.parse(text)
    assert str(info.value) == f"{text!r}: {why}"


def test_the_largest_after_is_taken_and_its_firing_opportunity_fits_twinfault():
    from chestnut.backend.sim.faults import MAX_AFTER
    from chestnut.msgs.messaging import new_message

    assert FaultSpec("gpu_hang", after=4294967294).validate().after == MAX_AFTER == 2**32 - 2
    new_message("twinFault").twinFault.opportunities = MAX_AFTER + 1  # the opportunity it fires at is published


def test_fault_parameters_keep_their_types():
    plan = FaultPlan.parse("timeout@1,on=1,probability=0.5")
    assert plan.params == {"on": "1", "probability": 0.5}
    assert FaultSpec(plan.kind, **plan.params).validate().on == "1"
    with pytest.raises(ValueError, match=r"^after \(--after\) = 'x' is not a count; give e.g. after=3$"):
        FaultSpec("timeout", after="x").validate()  # type: ignore[arg-type]


def test_a_long_transfer_target_is_shown_cut_never_whole():
    with pytest.raises(ValueError) as info:
        FaultSpec("timeout", on="x" * 5000).validate()
    assert str(info.value) == ("--on '" + "x" * 48 + "'... (5000 characters); use one of any, control, control_in, "
                               "control_out, bulk, bulk_in, bulk_out, async or a request number like 0xE4")
    with pytest.raises(ValueError, match=r"^--on '0x100': a request number is one byte$"):
        FaultSpec("timeout", on="0x100").validate()


def test_a_bad_argument_is_one_line_naming_it_and_where_help_is(capsys):
    from chestnut.launch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["launch", "--fault", "gpu_hang@soon"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("chestnut launch: error: argument --fault: 'gpu_hang@soon': want "
                                       "KIND@START[+DURATION][,key=value] (chestnut launch --help)\n")


@pytest.mark.parametrize("text", ["1e308", "604801", "inf", "nan", "-1", "soon"])
def test_a_run_length_over_a_week_is_refused_before_anything_starts(text, capsys, tmp_path):
    """``--seconds 1e308`` started a run."""
    from chestnut.launch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["launch", "--seconds", text, "--runs-dir", str(tmp_path / "runs")])
    assert info.value.code == 2
    assert capsys.readouterr().err == (f"chestnut launch: error: argument --seconds: {text!r}: give 0 (until Ctrl-C) "
                                       "or a number of seconds up to 604800 (a week) (chestnut launch --help)\n")
    assert not (tmp_path / "runs").exists()
    assert argument_problem(1e308, 20.0, []) == ("--seconds 1e+308: give 0 (until Ctrl-C) or a number of seconds up "
                                                 "to 604800 (a week)")


def test_a_run_of_a_week_or_until_ctrl_c_is_taken():
    from chestnut.msgs.argtypes import MAX_RUN_SECONDS, run_seconds

    assert (run_seconds("604800"), run_seconds("0"), MAX_RUN_SECONDS) == (604800.0, 0.0, 7 * 24 * 3600)
    assert argument_problem(604800.0, 20.0, []) is None


@pytest.mark.parametrize("text", ["gpu_hang@nan", "gpu_hang@inf", "gpu_hang@5+inf", "gpu_hang@5+nan", "gpu_hang@-1"])
def test_a_fault_time_that_is_not_a_finite_number_is_refused(text):
    """``float("nan")`` passed every comparison: `gpu_hang@nan` ran the stack with no fault at all."""
    with pytest.raises(argparse.ArgumentTypeError, match="START must be a number >= 0 and DURATION a number > 0"):
        FaultPlan.parse(text)


@pytest.mark.parametrize("text", ["gpu_hang@5+1e12", "gpu_hang@1e12", "gpu_hang@5+604801", "gpu_hang@604801"])
def test_a_fault_time_over_a_week_is_refused_in_one_line(text, capsys, tmp_path):
    """``--seconds 20 --fault gpu_hang@5+1e12`` was taken: the run went on until its plan was carried out,
    "cleared at 1000000000007.7 s", so it never ended."""
    from chestnut.launch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["launch", "--seconds", "20", "--fault", text, "--runs-dir", str(tmp_path / "runs")])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"chestnut launch: error: argument --fault: {text!r}: START must be a number >= 0 and DURATION a number > 0 "
        "(seconds; not nan or inf), each at most 604800 (a week, the longest --seconds) (chestnut launch --help)\n"
    )
    assert not (tmp_path / "runs").exists()


def test_a_fault_of_a_week_is_taken():
    plan = FaultPlan.parse("gpu_hang@604800+604800")
    assert (plan.start_s, plan.duration_s) == (604800.0, 604800.0)


def test_a_timed_run_is_not_cut_short_of_its_fault_plan():
    """``--seconds 16 --fault fence_stall@2+3 --fault-from active`` on a host where the primary serves only
    15.7 s after the first output: the run goes on until the stall is cleared at 20.7 s and 5 s more."""
    assert FAULT_SETTLE_S == 5.0
    runner = FaultRunner("p", [FaultPlan.parse("fence_stall@2+3"), FaultPlan.parse("gpu_hang@1")], clock=None)  # type: ignore[arg-type]
    assert (runner.plan_end_s, runner.carried_out) == (5.0, False)
    t0, end = 100.0, 116.0
    assert run_over(116.0, end, None, 5.0, False)  # no ChestnutActive yet: on time (the faults are reported)
    assert not run_over(116.0, end, t0 + 15.7, 5.0, False)  # not yet carried out
    assert not run_over(120.8, end, t0 + 15.7, 5.0, True)  # cleared at 120.7: 5 s more
    assert not run_over(125.6, end, t0 + 15.7, 5.0, True)
    assert run_over(125.7, end, t0 + 15.7, 5.0, True)
    assert run_over(116.0, end, t0 + 1.0, 5.0, True)  # the plan fitted the run (over at 106): ends on time
    assert not run_over(116.0, end, t0 + 1.0, 5.0, False)  # ... unless it is not carried out yet (a slow clear)
    assert run_over(116.0, end, t0, 0.0, True)  # no plan


def test_the_fault_runner_is_carried_out_once_every_fault_is_injected_and_cleared():
    runner = FaultRunner("p", [FaultPlan.parse("fence_stall@2+3"), FaultPlan.parse("gpu_hang@1")], clock=None)  # type: ignore[arg-type]
    runner.pending = []
    runner.injected = [(FaultPlan.parse("gpu_hang@1"), 1)]  # no DURATION: never cleared, done once injected
    assert runner.carried_out
    runner.injected.append((FaultPlan.parse("fence_stall@2+3"), 2))
    assert not runner.carried_out


@pytest.mark.parametrize("port", ["99999", "-1", "65536", "http"])
def test_a_foxglove_port_the_server_would_refuse_stops_the_launch_before_anything_starts(port, capsys, tmp_path):
    """``--foxglove 99999`` ran the whole stack, and its Foxglove server then failed at every start."""
    from chestnut.launch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["launch", "--seconds", "5", "--no-live", "--foxglove", port, "--runs-dir", str(tmp_path / "runs")])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"chestnut launch: error: argument --foxglove: {port!r}: give a TCP port in 0..65535 (0: any free; "
        "default 8765) (chestnut launch --help)\n"
    )
    assert not (tmp_path / "runs").exists()


def test_the_foxglove_ports_the_server_takes_are_taken():
    from chestnut.launch.stack import foxglove_port

    assert [foxglove_port(t) for t in ("0", "1", "8765", "65535")] == [0, 1, 8765, 65535]


def test_a_foxglove_port_in_use_stops_the_launch_before_anything_starts(tmp_path):
    """The Foxglove server's bind failed at every supervisord start, in foxglove.log, and launch exited 0."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([CHESTNUT, "launch", "--seconds", "3", "--no-live", "--runs-dir", str(tmp_path / "runs"),
                            "--foxglove", str(port)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = r.stderr.splitlines()
    assert line.endswith(f" ERROR chestnut.launch: --foxglove {port}: port {port} on 127.0.0.1 is already in use "
                         "(Address already in use); choose another --foxglove PORT (0: any free one)")
    assert not (tmp_path / "runs").exists()


def test_an_unknown_fault_kind_lists_exactly_the_kinds_launch_accepts(capsys):
    """The list comes from the twin's fault table (backend/sim/faults.py KINDS), which also decides what
    ``--fault`` accepts: all 21 kinds, wedged, nan_output, brownout and lock_held among them."""
    from chestnut.backend.sim.faults import KINDS
    from chestnut.launch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["launch", "--fault", "bogus@1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == ("chestnut launch: error: argument --fault: 'bogus@1': unknown fault kind 'bogus'; known: "
                   f"{', '.join(KINDS)} (chestnut launch --help)\n")
    listed = err.split("known: ", 1)[1].removesuffix(" (chestnut launch --help)\n").split(", ")
    accepted = [kind for kind in listed if FaultPlan.parse(f"{kind}@1").kind == kind]
    assert accepted == listed == list(KINDS) and len(listed) == 21
    assert {"wedged", "nan_output", "brownout", "lock_held"} <= set(listed)
