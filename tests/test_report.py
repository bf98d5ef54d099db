"""The report's words on differences: an exact 0 is counted and said, never drawn as a made-up value."""

from __future__ import annotations

from chestnut.node.offline.report import describe_diffs


def test_all_identical():
    assert describe_diffs("replayed / logged", [0.0, 0.0, 0.0]) == (
        "replayed / logged: all 3 frames identical (difference exactly 0)")


def test_some_identical():
    assert describe_diffs("primary / fallback", [0.0, 2.5e-7, 0.0, 1e-5]) == (
        "primary / fallback: 2 of 4 frames identical (difference exactly 0, not drawn on the log axis); "
        "largest difference 1e-05")


def test_none_identical_and_none_compared():
    assert describe_diffs("primary / fallback", [3e-6, 1.25e-4]) == (
        "primary / fallback: 2 frames, none identical; largest difference 0.000125")
    assert describe_diffs("primary / fallback", []) == "primary / fallback: no frame compared"
