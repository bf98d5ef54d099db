"""``chestnut launch --rate 10``: the control daemon judges the per-frame services at the stack's frame rate.

It judged ``modelOutput`` and ``chestnutActive`` at the registry's 20 Hz whatever the camera's rate, so at 10 Hz
their freq_ok never passed (10 Hz is below 0.8 x 20) and control never engaged, with nothing in the summary
saying so. Now ``chestnut launch`` passes its ``--rate`` to ``chestnut control --frame-rate`` and the summary says
when control never engaged. Fake clock (ns) for the checks; the SubMaster's sockets only where named."""

from __future__ import annotations

import argparse

import pytest

from chestnut.launch.controld import (
    FRAME_SERVICES,
    SERVICES,
    ControlInputs,
    ControlLogic,
    add_arguments,
    control_submaster,
    failed_checks,
    frame_frequencies,
)
from chestnut.launch.rundir import render_config
from chestnut.launch.summary import control_lines
from chestnut.msgs.messaging import new_message
from chestnut.msgs.submaster import SubMasterChecks

MS = 1_000_000
S = 1000 * MS


def run_stack(sm: SubMasterChecks, frame_rate_hz: float, seconds: float) -> list[bool]:
    """``seconds`` of a healthy stack at ``frame_rate_hz`` (chestnutHealth at its 5 Hz) on a 10 ms update tick,
    each update a step of the control logic; returns whether control was engaged after each."""
    logic, engaged = ControlLogic(), []
    frame_ms = round(1000 / frame_rate_hz)
    for t_ms in range(0, int(seconds * 1000), 10):
        batch = []
        if t_ms % frame_ms == 0:
            batch += [new_message(s).as_reader() for s in FRAME_SERVICES]
        if t_ms % 200 == 0:
            batch.append(new_message("chestnutHealth").as_reader())
        sm.update_msgs(t_ms * MS, batch)
        failed = failed_checks(sm)
        x = ControlInputs(checks_ok=not failed, active=True, source="primary", frame_drop_perc=0.0,
                          failed_checks=failed)
        engaged.append(logic.step(t_ms * MS, x).engaged)
    return engaged


@pytest.mark.parametrize("frame_rate_hz", [10.0, 5.0, 20.0, 50.0])
def test_a_stack_at_any_frame_rate_passes_every_check_and_engages(frame_rate_hz):
    sm = SubMasterChecks(SERVICES, frequency_hz=frame_frequencies(frame_rate_hz))
    engaged = run_stack(sm, frame_rate_hz, 8.0)
    assert failed_checks(sm) == () and engaged[-1] is True


def test_judged_at_the_registrys_20_hz_a_10_hz_stack_never_engaged():
    """What the daemon did before: the per-frame services' freq_ok fail for good at 10 Hz."""
    sm = SubMasterChecks(SERVICES)
    assert not any(run_stack(sm, 10.0, 8.0))
    assert failed_checks(sm) == ("modelOutput.freq_ok", "chestnutActive.freq_ok")


def test_the_daemons_submaster_takes_the_frame_rate_for_the_per_frame_services_only(run_base):
    assert FRAME_SERVICES == ("modelOutput", "chestnutActive")
    with control_submaster(frame_rate_hz=10.0) as sm:
        assert sm.frequency_hz == {"modelOutput": 10.0, "chestnutActive": 10.0, "chestnutHealth": 5.0}
        assert sm.alive_timeout_ns["modelOutput"] == 1 * S  # 10 periods of 100 ms
    with control_submaster() as sm:  # the default: the registry's 20 Hz
        assert sm.frequency_hz == {"modelOutput": 20.0, "chestnutActive": 20.0, "chestnutHealth": 5.0}


def test_chestnut_control_takes_a_frame_rate_in_the_launch_rates_range(capsys):
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).frame_rate == 20.0
    assert [p.parse_args(["--frame-rate", t]).frame_rate for t in ("1", "10", "100")] == [1.0, 10.0, 100.0]
    from chestnut.launch.cli import main

    want = "give a camera rate in [1, 100] Hz (default 20, openpilot's model rate) (chestnut control --help)"
    for bad in ("0", "0.5", "101", "nan", "inf", "ten"):  # chestnut launch --rate refuses each the same
        with pytest.raises(SystemExit, match="^2$"):
            main(["control", "--frame-rate", bad])
        assert capsys.readouterr().err == f"chestnut control: error: argument --frame-rate: {bad!r}: {want}\n"


def test_the_rendered_stack_tells_control_the_cameras_rate(run_base, tmp_path):
    conf = render_config(tmp_path, "rate-test", 10.0, [], []).read_text()
    commands = [line for line in conf.splitlines() if line.startswith("command=")]
    camera = next(c for c in commands if " camera " in c)
    control = next(c for c in commands if "cli control" in c)
    assert " camera --rate 10.0 " in camera + " "
    assert control.endswith("-m chestnut.launch.cli control --frame-rate 10.0")


def test_the_summary_says_when_control_never_engaged():
    never = "control never engaged during the run (control.log says what it waited for)"
    assert control_lines({"control": [], "soft_disable_episodes": []}) == [never]
    assert control_lines({"control": [(3.2, "engaged")], "soft_disable_episodes": []}) == ["control    3.2 s  engaged"]
