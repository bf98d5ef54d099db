"""The service registry: every topic on the bus, its nominal rate, its size bound and how it is logged.

A service name is the name of the ``Event`` union member it carries (cereal's convention).
``frequency_hz == 0`` means on demand: such a service is always *alive* and its rate is not checked.
``decimation`` keeps every n-th message in a light ("qlog") log; ``None`` keeps none.
``max_bytes`` is the largest serialised ``Event`` a subscriber accepts: every subscriber sets it as
``ZMQ_MAXMSGSIZE``, so ZeroMQ refuses a bigger message before it is buffered (``msgs/messaging.py``).

Rates: camera 20 Hz (openpilot's model rate, ``DT_MDL`` = 0.05 s in ``common/realtime.py``); health
5 Hz and node state 1 Hz are our choices; ``twinFault`` is sent when a fault event happens.
Bounds: a frame is at most 1920x1080x3 bytes (6.2 MB, the
largest frame ``msgs/schema.py`` sizes its traversal limit for), so ``cameraFrame`` and
``modelOutput`` (its output tensors: a one-channel float32 map of a 1920x1080 frame is 8.3 MB) get
16 MiB; ``initData`` (versions and the configuration as JSON) 1 MiB; every other service is a few
hundred bytes of levels, counters and reason texts: 64 KiB.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Service:
    name: str
    frequency_hz: float  # Hz; 0 = on demand
    should_log: bool
    decimation: int | None  # keep every n-th message in the light log; None = never
    max_bytes: int = 64 << 10  # largest serialised Event a subscriber accepts (ZMQ_MAXMSGSIZE), bytes


FRAME_MAX_BYTES = 16 << 20  # cameraFrame / modelOutput bound: 2.6x a 1920x1080x3 frame (6.2 MB)
INIT_DATA_MAX_BYTES = 1 << 20  # initData bound: versions and the node's configuration as JSON

SERVICE_LIST: dict[str, Service] = {
    s.name: s
    for s in (
        Service("initData", 0.0, True, 1, INIT_DATA_MAX_BYTES),
        Service("cameraFrame", 20.0, True, None, FRAME_MAX_BYTES),
        Service("modelOutput", 20.0, True, 20, FRAME_MAX_BYTES),
        Service("chestnutActive", 20.0, True, 1),
        Service("chestnutHealth", 5.0, True, 1),
        Service("nodeState", 1.0, True, 1),
        Service("controlState", 20.0, True, 10),
        Service("twinState", 1.0, True, 1),
        Service("twinFault", 0.0, True, 1),
    )
}

SOFT_DISABLE_S = 3.0
"""How long a consumer of ``chestnutActive`` keeps control after one of its checks failed before it
exits (s): openpilot's soft-disable time. The control daemon (``chestnut control``) applies it and
``chestnut check`` bounds ``controlState.engaged`` by it."""


def soft_disable_left(remaining_s: float) -> str:
    """``controlState.softDisableRemaining`` (s left before control is exited) in words, the one wording the
    control daemon's log and the live view use: ``"2.50 s left of 3.0 s"``. The soft disable counts from the
    first failing step, so it may start with less than :data:`SOFT_DISABLE_S` left (a graced late frame)."""
    return f"{remaining_s:.2f} s left of {SOFT_DISABLE_S:.1f} s"


class UnknownServiceError(KeyError):
    """Raised for a service name that is not in :data:`SERVICE_LIST`."""

    def __str__(self) -> str:
        return f"unknown service {self.args[0]!r}; known services: {', '.join(sorted(SERVICE_LIST))}"


def get_service(name: str) -> Service:
    """Return the registry entry for ``name``; raises :class:`UnknownServiceError` if absent."""
    try:
        return SERVICE_LIST[name]
    except KeyError:
        raise UnknownServiceError(name) from None
