"""The node's and worker's garbage collection between frames (``node/realtime.py`` ``IdleCollector``)."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator

import pytest

from chestnut.node.realtime import IdleCollector


class _Node:
    """A container that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def small_thresholds() -> Iterator[None]:
    """Thresholds (10, 2, 2) for the test, everything as it was afterwards."""
    old, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(10, 2, 2)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()
        if enabled:
            gc.enable()


def _allocate(keep: list[object], n: int = 50) -> None:
    """``n`` new container objects kept alive: generation 0's count rises by ``n`` (well over its threshold 10)."""
    keep.extend([] for _ in range(n))


def test_engage_freezes_and_disables(small_thresholds: None) -> None:
    c = IdleCollector()
    assert gc.isenabled() is True
    c.engage()
    assert (c.engaged, gc.isenabled()) == (True, False)
    assert gc.get_freeze_count() > 0  # everything alive at engage is out of later collections
    assert gc.get_count()[1:] == (0, 0)  # the full collection before the freeze reset the older counts
    c.release()
    assert (c.engaged, gc.isenabled(), gc.get_freeze_count()) == (False, True, 0)


def test_each_collection_is_of_the_oldest_generation_past_its_threshold(small_thresholds: None) -> None:
    """Thresholds 10, 2, 2: three of generation 0, then one of 1; after three of generation 1, a full one (CPython
    3.11 would put that one off while few objects were promoted: the frozen heap makes it cheap here)."""
    c = IdleCollector()
    c.engage()
    keep: list[object] = []
    assert c.collect_due() is None  # nothing allocated yet
    made = []
    for _ in range(13):
        _allocate(keep)
        made.append(c.collect_due())
    assert made == [0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 2]
    assert c.collections == [9, 3, 1]
    assert c.collect_due() is None  # all counts reset by the full collection
    c.release()


def test_a_cycle_made_while_engaged_is_collected_when_due(small_thresholds: None) -> None:
    c = IdleCollector()
    c.engage()
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gone: list[bool] = []
    weakref.finalize(a, gone.append, True)
    del a, b
    keep: list[object] = []
    _allocate(keep)
    assert gone == []  # automatic collection is off: allocations alone collect nothing
    assert c.collect_due() == 0
    assert gone == [True]
    c.release()


def test_not_engaged_or_zero_threshold_collects_nothing(small_thresholds: None) -> None:
    c = IdleCollector()
    keep: list[object] = []
    _allocate(keep)
    assert c.collect_due() is None  # never engaged: CPython's own collector is in charge
    c.release()  # nothing to release
    assert gc.isenabled() is True
    gc.set_threshold(0)  # CPython's way to turn collection off
    c.engage()
    _allocate(keep)
    assert c.collect_due() is None
    assert c.collections == [0, 0, 0]
    c.release()


def test_release_keeps_a_collector_that_was_off_off(small_thresholds: None) -> None:
    gc.disable()
    c = IdleCollector()
    c.engage()
    c.release()
    assert gc.isenabled() is False


def test_as_a_context_manager_it_releases_on_an_exception(small_thresholds: None) -> None:
    with pytest.raises(RuntimeError), IdleCollector() as c:
        assert (c.engaged, gc.isenabled()) == (True, False)
        raise RuntimeError("a failed step")
    assert (c.engaged, gc.isenabled(), gc.get_freeze_count()) == (False, True, 0)


def test_on_an_incremental_collector_it_leaves_cpython_in_charge(small_thresholds: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "version_info", (3, 14, 0, "final", 0))
    c = IdleCollector()
    c.engage()
    assert (c.engaged, gc.isenabled(), gc.get_freeze_count()) == (False, True, 0)
    keep: list[object] = []
    _allocate(keep)
    assert c.collect_due() is None
