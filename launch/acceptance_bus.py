"""``chestnut acceptance``'s frame bus: camera frames to the node under test at :data:`FRAME_HZ` and what it
answers (:class:`FrameBus`, :class:`Seen`), with the conditions the kit's steps wait for
(:func:`serving_primary`, :func:`inactive_since`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FRAME_HZ = 20.0  # camera rate of the kit (Hz), openpilot's road camera


@dataclass
class Seen:
    """What the kit received from the node: (receipt ns, frame id, source) of every output; ChestnutActive
    (receipt ns, active); nodeState (receipt ns, state) and its identity; the deadline misses it blamed on a late
    host so far (chestnutHealth.host.lateMisses, docs/health.md "The host")."""

    outputs: list[tuple[int, int, str, str]] = field(default_factory=list)  # receipt ns, frame, source, reason
    active: list[tuple[int, bool]] = field(default_factory=list)
    states: list[tuple[int, str]] = field(default_factory=list)
    sent: dict[int, int] = field(default_factory=dict)
    identity: dict[str, str] = field(default_factory=dict)  # the latest nodeState's
    host_late_misses: list[tuple[int, int]] = field(default_factory=list)  # (receipt ns, host.lateMisses)
    init_identity: dict[str, str] = field(default_factory=dict)  # the latest initData's


class FrameBus(threading.Thread):
    """Publishes ``cameraFrame`` (uint8 noise, ``height`` x ``width``) at :data:`FRAME_HZ` and records the
    node's ``modelOutput``, ``chestnutActive``, ``nodeState`` and ``chestnutHealth``'s host misses."""

    def __init__(self, prefix: str, height: int, width: int) -> None:
        super().__init__(name="acceptance-bus", daemon=True)
        self.prefix, self.height, self.width = prefix, height, width
        self.seen = Seen()
        self.lock = threading.Lock()
        self.stop_evt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        import zmq

        from chestnut.msgs.frames import fill_frame
        from chestnut.msgs.messaging import PubMaster, drain_sock, sub_sock

        try:
            pm = PubMaster(["cameraFrame"], prefix=self.prefix)
            poller = zmq.Poller()
            socks = {
                s: sub_sock(s, poller, prefix=self.prefix)
                for s in ("modelOutput", "chestnutActive", "nodeState", "initData", "chestnutHealth")
            }
            rng = np.random.default_rng(0)
            fid, next_s = 0, time.monotonic()
            while not self.stop_evt.is_set():
                if time.monotonic() >= next_s:
                    now = time.monotonic_ns()
                    pm.send(
                        "cameraFrame",
                        fill_frame(
                            fid,
                            rng.integers(0, 256, (self.height, self.width, 3), dtype=np.uint8),
                            now,
                            now,
                            "acceptance",
                        ),
                    )
                    with self.lock:
                        self.seen.sent[fid] = now
                    fid += 1
                    next_s = max(next_s + 1.0 / FRAME_HZ, time.monotonic())
                poller.poll(max(0, int((next_s - time.monotonic()) * 1000)))
                recv = time.monotonic_ns()
                for service, sock in socks.items():
                    for ev in drain_sock(sock):
                        with self.lock:
                            if service == "modelOutput":
                                mo = ev.modelOutput
                                self.seen.outputs.append((recv, int(mo.frameId), str(mo.source), str(mo.reason)[:300]))
                            elif service == "chestnutActive":
                                self.seen.active.append((recv, bool(ev.chestnutActive.active)))
                            elif service == "chestnutHealth":
                                self.seen.host_late_misses.append((recv, int(ev.chestnutHealth.host.lateMisses)))
                            elif service == "initData":
                                self.seen.init_identity = {str(kv.key): str(kv.value) for kv in ev.initData.identity}
                            else:
                                self.seen.states.append((recv, str(ev.nodeState.state)))
                                self.seen.identity = {str(kv.key): str(kv.value) for kv in ev.nodeState.identity}
            for sock in socks.values():
                sock.close(linger=0)
            pm.close()
        except BaseException as e:  # reported by wait_for
            self.error = e

    def wait_for(self, pred: Callable[[Seen], Any], timeout_s: float) -> Any:
        """``pred(seen)`` until truthy (returned), or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.error is None:
            with self.lock:
                got = pred(self.seen)
            if got:
                return got
            time.sleep(0.02)
        return None


def serving_primary(since_ns: int, n: int = 3) -> Callable[[Seen], int | None]:
    """The receipt time of the ``n``-th consecutive primary output after ``since_ns`` with the node active."""

    def pred(s: Seen) -> int | None:
        outs = [o for o in s.outputs if o[0] >= since_ns]
        active = any(t >= since_ns and st == "active" for t, st in s.states)
        if active and len(outs) >= n and all(o[2] == "primary" for o in outs[-n:]):
            return outs[-1][0]
        return None

    return pred


def inactive_since(since_ns: int) -> Callable[[Seen], int | None]:
    """The first receipt after ``since_ns`` of ChestnutActive false or nodeState degraded."""

    def pred(s: Seen) -> int | None:
        times = [t for t, a in s.active if t >= since_ns and not a] + [
            t for t, st in s.states if t >= since_ns and st == "degraded"
        ]
        return min(times) if times else None

    return pred


def percentile_ms(values_ns: list[int], q: float) -> float:
    return round(float(np.percentile(np.asarray(values_ns, dtype=np.float64), q)) / 1e6, 3) if values_ns else -1.0
