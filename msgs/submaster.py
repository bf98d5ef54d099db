"""SubMaster's checks as pure logic: alive / freq_ok / valid per service, with the clock passed in.

The rules (openpilot cereal's ``SubMaster``, ``cereal/messaging/__init__.py``; the window lengths are ours):

- **alive**: a service with frequency ``f > 0`` is alive while its newest message is younger than
  ``ALIVE_PERIODS / f`` seconds (10 periods: 0.5 s at 20 Hz), i.e. ``now - recv_time < 10 / f``.
  An on-demand service (``f == 0``) is always alive. A service never received (``f > 0``) is not.
- **freq_ok**: the receive rate is judged over BOTH a short window (the newest
  ``max(2, round(SHORT_WINDOW_S * f))`` receive intervals) and a long window (the newest
  ``max(short, round(LONG_WINDOW_S * f))`` intervals, or as many as have been received). Rate over a
  window of ``n`` intervals = ``n / (t_newest - t_n_before)``. It needs a full short window first, and a
  service that is not alive is not freq_ok. On-demand services are always freq_ok. The bounds are
  ``FREQ_MIN_RATIO * f`` and ``FREQ_MAX_RATIO * f`` (inclusive), and the two sides are judged differently:

  - **too slow** when EITHER window's rate is below the lower bound (our choice, stricter than cereal): a
    slow-down fails within one short window, and recovery takes a full long window without the slow
    intervals (hysteresis: quick to fail, slow to trust again);
  - **too fast** only when BOTH windows' rates are above the upper bound (cereal's rule for either side:
    ``freq_ok = avg_freq_ok or recent_freq_ok``, "slow to fall"). A burst of the messages that queued
    during a gap (a host stall, a stopped publisher's catch-up) is above the bound over a window that
    starts after the gap, yet the window that still holds the gap sees the nominal rate, and the two never
    agree while the gap is in the long window: a catch-up is not a too-fast publisher. (cereal's
    conflated sockets never see such a burst at all: they keep only the newest message.) A publisher too
    fast for good is above the bound over both: a steady 30 Hz for a 20 Hz service fails as soon as the
    short window is full; a switch from 20 to 30 Hz once the long window is above 24 Hz (after 51
    intervals at 30 Hz, 1.7 s), and it recovers once either window is back within the bound. A gap of 10
    periods or more fails ``alive`` all the same.
- **valid**: the ``valid`` flag of the newest message; a service never received is not valid.
- **rates**: each service's nominal rate ``f`` is its registry rate (``msgs/services.py``), as cereal's
  ``SERVICE_LIST``; ``frequency_hz`` overrides it per service (our addition), for a stack that runs at another
  rate: ``chestnut launch --rate 10`` sends frames at 10 Hz, and the node answers each with a ``modelOutput`` and
  a ``chestnutActive``.
- ``all_alive / all_freq_ok / all_valid`` skip the services in ``ignore_alive / ignore_avg_freq /
  ignore_valid``; ``all_checks = all_alive and all_freq_ok and all_valid``.

Receive times are taken when the subscriber drains its sockets, so :meth:`SubMasterChecks.update_msgs`
should run at least as often as the fastest checked service publishes (as openpilot's loops do);
messages drained together share one receive time, which the window rate averages out.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from typing import Any

from chestnut.msgs.schema import log
from chestnut.msgs.services import get_service

ALIVE_PERIODS = 10.0  # alive = a message within 10 / f s (cereal SubMaster)
FREQ_MIN_RATIO = 0.8  # freq_ok lower bound, fraction of the nominal rate (cereal SubMaster)
FREQ_MAX_RATIO = 1.2  # freq_ok upper bound, fraction of the nominal rate (cereal SubMaster)
SHORT_WINDOW_S = 1.0  # s of nominal intervals in the short rate window
LONG_WINDOW_S = 5.0  # s of nominal intervals in the long rate window
NS_PER_S = 1_000_000_000


class FrequencyTracker:
    """Receive times of one service (ns) and the rate checks over the short and long windows.

    ``frequency_hz`` > 0. ``short_intervals`` / ``long_intervals`` are the window sizes in intervals.
    """

    def __init__(self, frequency_hz: float) -> None:
        if frequency_hz <= 0:
            raise ValueError(f"frequency_hz must be > 0, got {frequency_hz}")
        self.frequency_hz = frequency_hz
        self.short_intervals = max(2, round(SHORT_WINDOW_S * frequency_hz))
        self.long_intervals = max(self.short_intervals, round(LONG_WINDOW_S * frequency_hz))
        self.min_hz = FREQ_MIN_RATIO * frequency_hz
        self.max_hz = FREQ_MAX_RATIO * frequency_hz
        self.recv_times_ns: deque[int] = deque(maxlen=self.long_intervals + 1)

    def record(self, recv_time_ns: int) -> None:
        self.recv_times_ns.append(recv_time_ns)

    def rate_hz(self, intervals: int) -> float | None:
        """Rate (Hz) over the newest ``min(intervals, available)`` intervals; None before two receipts.

        ``math.inf`` when they all arrived at the same time (drained together).
        """
        n = min(intervals, len(self.recv_times_ns) - 1)
        if n < 1:
            return None
        span_ns = self.recv_times_ns[-1] - self.recv_times_ns[-1 - n]
        return math.inf if span_ns <= 0 else n * NS_PER_S / span_ns

    def rates_hz(self) -> tuple[float | None, float | None]:
        """(short-window rate, long-window rate), Hz."""
        return self.rate_hz(self.short_intervals), self.rate_hz(self.long_intervals)

    def too_slow(self) -> bool:
        """Either window's rate below ``min_hz`` (quick to fail, slow to trust again)."""
        return any(r is None or r < self.min_hz for r in self.rates_hz())

    def too_fast(self) -> bool:
        """Both windows' rates above ``max_hz``: a catch-up burst after a gap is above it over one only."""
        return all(r is not None and r > self.max_hz for r in self.rates_hz())

    def ok(self) -> bool:
        """A full short window received, not :meth:`too_slow` and not :meth:`too_fast`."""
        if len(self.recv_times_ns) < self.short_intervals + 1:
            return False
        return not self.too_slow() and not self.too_fast()


def default_member(service: str) -> Any:
    """A default-valued reader of ``service``'s union member (what ``sm[service]`` is before any message)."""
    msg = log.Event.new_message()
    if log.Event.schema.fields[service].proto.slot.type.which() == "list":
        msg.init(service, 0)
    else:
        msg.init(service)
    return getattr(msg.as_reader(), service)


class SubMasterChecks:
    """The state and checks of a subscriber aggregate over ``services``, driven by :meth:`update_msgs`.

    Per service (dicts keyed by service name): ``updated`` (got a message in the last update),
    ``seen``, ``recv_time_ns`` (ns, the clock's time of the newest receipt; 0 = never),
    ``recv_frame`` (the update count of the newest receipt; 0 = never), ``recv_count`` (messages
    received), ``logMonoTime`` (ns, the
    publisher's stamp), ``alive``, ``freq_ok``, ``valid``, ``malformed`` (``Counter`` reason -> count,
    filled by the socket layer), ``freq_tracker``. ``self[service]`` is the newest message's union
    member (a default-valued one before any). ``frame`` counts updates. ``frequency_hz``: nominal rates (Hz) that
    replace the registry's for some of ``services`` (each a finite number > 0, for a service that has a rate).
    Raises :class:`~chestnut.msgs.services.UnknownServiceError` for an unregistered service and ``ValueError`` for
    a rate it cannot take.
    """

    def __init__(
        self,
        services: Iterable[str],
        ignore_alive: Iterable[str] = (),
        ignore_valid: Iterable[str] = (),
        ignore_avg_freq: Iterable[str] = (),
        frequency_hz: Mapping[str, float] | None = None,
    ) -> None:
        self.services: list[str] = list(dict.fromkeys(services))
        for s in self.services:
            get_service(s)
        self.ignore_alive = set(ignore_alive)
        self.ignore_valid = set(ignore_valid)
        self.ignore_avg_freq = set(ignore_avg_freq)
        for s in self.ignore_alive | self.ignore_valid | self.ignore_avg_freq:
            get_service(s)
        self.frequency_hz = {s: get_service(s).frequency_hz for s in self.services}
        for s, hz in (frequency_hz or {}).items():
            if s not in self.frequency_hz:
                get_service(s)
                raise ValueError(f"a rate for {s!r}, which is not among the subscribed services {self.services}")
            if not (math.isfinite(hz) and hz > 0) or self.frequency_hz[s] == 0:
                raise ValueError(f"{s}: a nominal rate must be a finite number > 0 for a service that has one "
                                 f"(registry: {self.frequency_hz[s]:g} Hz), got {hz!r}")
            self.frequency_hz[s] = float(hz)
        self.frame = 0
        self.data: dict[str, Any] = {s: default_member(s) for s in self.services}
        self.updated = dict.fromkeys(self.services, False)
        self.seen = dict.fromkeys(self.services, False)
        self.recv_time_ns = dict.fromkeys(self.services, 0)
        self.recv_frame = dict.fromkeys(self.services, 0)
        self.recv_count = dict.fromkeys(self.services, 0)
        self.logMonoTime = dict.fromkeys(self.services, 0)
        self.valid = dict.fromkeys(self.services, False)
        self.alive = {s: self.frequency_hz[s] == 0 for s in self.services}
        self.freq_ok = {s: self.frequency_hz[s] == 0 for s in self.services}
        self.malformed: dict[str, Counter[str]] = {s: Counter() for s in self.services}
        self.freq_tracker = {s: FrequencyTracker(f) for s, f in self.frequency_hz.items() if f > 0}
        self.alive_timeout_ns = {s: round(ALIVE_PERIODS * NS_PER_S / f) for s, f in self.frequency_hz.items() if f > 0}

    def __getitem__(self, service: str) -> Any:
        return self.data[service]

    def update_msgs(self, now_ns: int, events: Iterable[Any]) -> None:
        """Take ``events`` (``Event`` readers, oldest first) as received at ``now_ns`` (ns) and re-check.

        Raises ``ValueError`` for an event of a service this aggregate does not subscribe to.
        """
        self.frame += 1
        self.updated = dict.fromkeys(self.services, False)
        for event in events:
            s = event.which()
            if s not in self.data:
                raise ValueError(f"an Event carrying {s!r} given to a SubMaster of {self.services}")
            self.data[s] = getattr(event, s)
            self.updated[s] = True
            self.seen[s] = True
            self.recv_time_ns[s] = now_ns
            self.recv_frame[s] = self.frame
            self.recv_count[s] += 1
            self.logMonoTime[s] = event.logMonoTime
            self.valid[s] = bool(event.valid)
            if s in self.freq_tracker:
                self.freq_tracker[s].record(now_ns)
        for s, tracker in self.freq_tracker.items():
            self.alive[s] = self.seen[s] and now_ns - self.recv_time_ns[s] < self.alive_timeout_ns[s]
            self.freq_ok[s] = self.alive[s] and tracker.ok()

    def _selected(self, service_list: Iterable[str] | None, ignore: set[str]) -> list[str]:
        chosen = self.services if service_list is None else list(service_list)
        for s in chosen:
            if s not in self.data:
                get_service(s)
                raise ValueError(f"{s!r} is not among the subscribed services {self.services}")
        return [s for s in chosen if s not in ignore]

    def all_alive(self, service_list: Iterable[str] | None = None) -> bool:
        return all(self.alive[s] for s in self._selected(service_list, self.ignore_alive))

    def all_freq_ok(self, service_list: Iterable[str] | None = None) -> bool:
        return all(self.freq_ok[s] for s in self._selected(service_list, self.ignore_avg_freq))

    def all_valid(self, service_list: Iterable[str] | None = None) -> bool:
        return all(self.valid[s] for s in self._selected(service_list, self.ignore_valid))

    def all_checks(self, service_list: Iterable[str] | None = None) -> bool:
        """alive and freq_ok and valid for every service of ``service_list`` (default: all), ignores applied."""
        service_list = None if service_list is None else list(service_list)
        return self.all_alive(service_list) and self.all_freq_ok(service_list) and self.all_valid(service_list)
