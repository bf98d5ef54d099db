"""The node's pre-frame wake (``node/main.py`` ``Node._prewake`` / ``_wake_worker``, ``node/policy.py``
``prewake_at``): its WAKE goes out once per frame, only within a millisecond of the time it is due, and only
where a worker would take the frame."""

from __future__ import annotations

import time
import types

import pytest

from chestnut.node.main import Node
from chestnut.node.policy import needs_wake


class FakeWorker:
    def __init__(self, sends: bool = True) -> None:
        self.wakes = 0
        self.sends = sends

    def wake(self) -> bool:
        self.wakes += 1
        return self.sends


def node(worker: FakeWorker | None, cpus_apart: bool = True, runs_primary: bool = True) -> types.SimpleNamespace:
    n = types.SimpleNamespace(prewake_ns=0, worker_woken_ns=0, worker=worker, cpus_apart=cpus_apart,
                              sup=types.SimpleNamespace(runs_primary=runs_primary))
    for name in ("_wakes_worker", "_wake_worker", "_prewake"):
        setattr(n, name, types.MethodType(getattr(Node, name), n))
    return n


def test_the_pre_frame_wake_fires_once_within_a_millisecond_of_its_time_without_sleeping(monkeypatch):
    def no_sleep(_s: float) -> None:
        raise AssertionError("slept: a frame arriving meanwhile would wait")

    monkeypatch.setattr(time, "sleep", no_sleep)
    w = FakeWorker()
    n = node(w)
    now = time.monotonic_ns()
    assert n._prewake(now) is False and w.wakes == 0  # none due (prewake_ns 0)
    n.prewake_ns = now + 1_500_000
    assert n._prewake(now) is False and w.wakes == 0  # woken 1.5 ms early (the loop period, the watchdog): not it
    assert n.prewake_ns == now + 1_500_000
    n.prewake_ns = now + 400_000
    assert n._prewake(now) is True  # within a millisecond of it: the WAKE at once
    assert n.worker_woken_ns >= now and w.wakes == 1
    assert n.prewake_ns == 0 and n._prewake(time.monotonic_ns()) is False  # once per frame
    # the frame, on time (the lead after the wake was due, up to two after the WAKE): no WAKE of its own
    assert needs_wake(n.worker_woken_ns, n.worker_woken_ns + 2_400_000) is False


@pytest.mark.parametrize("worker, cpus_apart, runs_primary", [(None, True, True), (FakeWorker(), False, True),
                                                              (FakeWorker(), True, False)])
def test_no_wake_where_no_worker_would_take_the_frame_or_it_shares_the_nodes_cpu(worker, cpus_apart, runs_primary):
    n = node(worker, cpus_apart, runs_primary)
    n.prewake_ns = time.monotonic_ns()
    assert n._prewake(time.monotonic_ns()) is True  # the wake itself is spent (nothing else runs before the frame)
    assert n.worker_woken_ns == 0
    assert worker is None or worker.wakes == 0


def test_a_wake_the_worker_did_not_get_is_not_counted_on():
    w = FakeWorker(sends=False)  # not ready, no free slot, or gone: WorkerHandle.wake sent nothing
    n = node(w)
    n._wake_worker()
    assert w.wakes == 1 and n.worker_woken_ns == 0
