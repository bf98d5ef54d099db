"""The camera's tick schedule: a host stall of up to three periods loses no frame (the late frames go out and
the grid catches up); a longer one skips the ticks already past, so the next frame is at most a period late."""

from __future__ import annotations

from chestnut.launch.camerad import LATE_MAX_PERIODS, ticks_to_skip

MS = 1_000_000
P = 50 * MS  # 20 Hz


def test_on_time_and_early_frames_skip_nothing():
    assert ticks_to_skip(1000 * MS, 1000 * MS, P) == 0
    assert ticks_to_skip(990 * MS, 1000 * MS, P) == 0


def test_a_stall_of_up_to_three_periods_loses_no_frame():
    assert LATE_MAX_PERIODS == 3
    assert ticks_to_skip(1000 * MS + P + 1, 1000 * MS, P) == 0  # a 50 ms hiccup (skipped a frame before)
    assert ticks_to_skip(1000 * MS + 3 * P, 1000 * MS, P) == 0


def test_a_longer_stall_skips_every_tick_already_past():
    assert ticks_to_skip(1000 * MS + 3 * P + 1, 1000 * MS, P) == 3  # the next frame is 1 ns late
    assert ticks_to_skip(1000 * MS + 10 * P + 7 * MS, 1000 * MS, P) == 10  # 7 ms late
    assert ticks_to_skip(1000 * MS + 4 * P, 1000 * MS, P, late_max_periods=0) == 4
