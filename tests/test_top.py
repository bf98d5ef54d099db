"""``chestnut top`` never shows stale data as live; the worker's pid is labelled; its --seconds and
--refresh-hz are refused up front in one line."""

from __future__ import annotations

import os

import pytest
from rich.console import Console

from chestnut.launch.top import StackView, stale_s
from chestnut.msgs.messaging import new_message

S = 1_000_000_000


def _text(view: StackView, now_ns: int) -> str:
    con = Console(record=True, width=200, file=open(os.devnull, "w"))  # noqa: SIM115
    con.print(view.render(now_ns))
    return con.export_text()


def _events(worker_pid: int) -> list:
    ns = new_message("nodeState")
    ns.nodeState.state = "active"
    ns.nodeState.workerPid = worker_pid
    ca = new_message("chestnutActive")
    ca.chestnutActive.active = True
    ca.chestnutActive.source = "primary"
    ca.chestnutActive.reason = "all layers OK"
    h = new_message("chestnutHealth")
    layers = h.chestnutHealth.init("layers", 4)
    for i, name in enumerate(("usb", "pcie", "gpu", "output")):
        layers[i].layer = name
    return [ns, ca, h]


def test_stale_after_three_periods_and_never_before_half_a_second():
    assert stale_s(10 * S, 10 * S - S // 2, 20.0) is None  # 0.5 s at 20 Hz: still live
    assert stale_s(10 * S, 10 * S - 6 * S // 10, 20.0) == 0.6
    assert stale_s(10 * S, 7 * S, 1.0) is None and stale_s(10 * S, 6 * S, 1.0) == 4.0  # 1 Hz: 3 s
    assert stale_s(10 * S, 0, 5.0) == float("inf")  # never received
    assert stale_s(10 * S, 1, 0.0) is None  # on demand: never stale


def test_a_silent_stack_is_shown_stale_not_live_and_the_worker_pid_is_labelled():
    view = StackView(prefix=f"top{os.getpid()}")
    try:
        t0 = 100 * S
        view.sm.update_msgs(t0, _events(worker_pid=4242))
        live = _text(view, t0 + S // 10)
        assert "ACTIVE" in live and "worker pid 4242" in live and "stale" not in live
        later = _text(view, t0 + 5 * S)  # every service silent for 5 s
        assert "ACTIVE" not in later.replace("last: active", "")  # no live ChestnutActive any more
        assert "stale 5 s" in later and "last: active, source primary" in later
        assert "health (stale 5 s)" in later
        view.sm.update_msgs(t0 + 5 * S, _events(worker_pid=0))
        assert "no worker" in _text(view, t0 + 5 * S) and "pid 0" not in _text(view, t0 + 5 * S)
    finally:
        view.close()


SECONDS_WANTED = "give 0 (until Ctrl-C) or a number of seconds up to 604800 (a week)"


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--refresh-hz", "0"], "argument --refresh-hz: '0': give a refresh rate in [0.2, 20] Hz (default 4)"),
        (["--refresh-hz", "nan"], "argument --refresh-hz: 'nan': give a refresh rate in [0.2, 20] Hz (default 4)"),
        (["--refresh-hz", "21"], "argument --refresh-hz: '21': give a refresh rate in [0.2, 20] Hz (default 4)"),
        # never redrew
        (["--refresh-hz", "1e-300"],
         "argument --refresh-hz: '1e-300': give a refresh rate in [0.2, 20] Hz (default 4)"),
        (["--refresh-hz", "0.19"], "argument --refresh-hz: '0.19': give a refresh rate in [0.2, 20] Hz (default 4)"),
        (["--seconds", "-1"], "argument --seconds: '-1': " + SECONDS_WANTED),
        (["--seconds", "inf"], "argument --seconds: 'inf': " + SECONDS_WANTED),
        (["--seconds", "604801"], "argument --seconds: '604801': " + SECONDS_WANTED),
    ],
)
def test_a_refresh_rate_or_duration_top_cannot_keep_is_refused_in_one_line(args, why, capsys):
    """``--refresh-hz 0`` was an AssertionError traceback from rich; ``--seconds -1`` ran until Ctrl-C."""
    from chestnut.launch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["top", *args])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"chestnut top: error: {why} (chestnut top --help)\n"


def test_top_takes_0_seconds_as_until_ctrl_c_and_refresh_rates_up_to_20_hz():
    from chestnut.launch.top import MAX_REFRESH_HZ, MIN_REFRESH_HZ, refresh_hz_arg
    from chestnut.msgs.argtypes import run_seconds

    assert [run_seconds(t) for t in ("0", "2.5", "604800")] == [0.0, 2.5, 604800.0]
    assert (MIN_REFRESH_HZ, MAX_REFRESH_HZ) == (0.2, 20.0)
    assert [refresh_hz_arg(t) for t in ("0.2", "0.5", "4", "20")] == [0.2, 0.5, 4.0, 20.0]
