"""The node's own look at the dock -- a fresh enumeration, no claim, no vendor request -- off its main loop.

An enumeration can block: on the twin it is a request to the twin daemon, answered within
``TwinClient``'s reply timeout (1 s) or not at all when the daemon is frozen (SIGSTOP, a stalled host);
on a dock, ``libusb_get_device_list`` walks a bus that may be resetting. The node's loop answers frames
at 20 Hz and publishes ``chestnutHealth`` at 5 Hz (``chestnut check``'s ``health_not_silent`` allows 10
periods, 2 s), so no enumeration runs on it: :class:`DockLooker` runs each look in one background
thread, and the loop takes finished looks when they are there. A look still running when the next is
asked is not doubled; its answer serves both.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from chestnut.backend.interface import DockObservation


@dataclass(frozen=True)
class Look:
    """One finished look: ``present``, ``detail`` (one line for a person), ``observation`` (the USB side as
    enumerated: IDs, bus/address, speed; None when nothing was seen or the dock kind has no USB side)."""

    present: bool
    detail: str
    observation: DockObservation | None


def look(kind: str, prefix: str | None = None) -> tuple[bool, str, DockObservation | None]:
    """One fresh enumeration for dock ``kind`` (``twin``, ``real``; ``cpu`` is always present, ``none``
    never): (present, detail, observation). Never raises: an enumeration failure (pyusb, libusb, the
    twin's socket) is "not present" with the error in ``detail``. Blocks while the enumeration does."""
    if kind == "cpu":
        return True, "primary on the host CPU", None
    if kind == "none":
        return False, "dock disabled (dock.kind = none)", None
    try:
        from chestnut.backend.ladder import UsbDock

        backend = None
        if kind == "twin":
            from chestnut.backend.sim.pyusb_backend import twin_backend

            backend = twin_backend(prefix, cached=False)
        for dev in UsbDock(backend).find_all():
            obs = DockObservation(True, (dev.idVendor, dev.idProduct), (dev.bus, dev.address),
                                  UsbDock.speed_mbps(dev))
            return True, f"{dev.idVendor:04x}:{dev.idProduct:04x} at bus {dev.bus} address {dev.address}", obs
    except Exception as e:  # noqa: BLE001 - pyusb/libusb/twin-socket errors: the dock cannot be seen
        return False, f"no Chestnut dock found ({type(e).__name__}: {e})", None
    if kind == "twin":  # a twin nobody runs enumerates nothing: say so, not a dock's cable and power
        from chestnut.backend.sim.client import daemon_missing

        if (missing := daemon_missing(prefix)) is not None:
            return False, f"no Chestnut dock enumerated: {missing[1]}", None
    return False, "no Chestnut dock enumerated", None


def look_for_dock(kind: str, prefix: str | None = None) -> tuple[bool, str]:
    """:func:`look` without the observation: (present, detail). Blocking; for tools, not the node's loop."""
    present, detail, _ = look(kind, prefix)
    return present, detail


class DockLooker:
    """Looks at the dock (:func:`look`) in a background thread. :meth:`ask` requests a look for a purpose
    (a name the caller chooses, e.g. ``"retry"``); :meth:`take` returns the finished look that answers it, once, or None
    while it runs. A purpose asked while a look is running is answered by the next look, so an answer is
    never older than its question. :meth:`close` stops the thread (it ends at its next look at the latest,
    as a daemon thread)."""

    def __init__(self, kind: str, prefix: str | None = None) -> None:
        self.kind, self.prefix = kind, prefix
        self._cv = threading.Condition()
        self._wanted: set[str] = set()
        self._done: dict[str, Look] = {}
        self._closed = False
        self._thread: threading.Thread | None = None

    def ask(self, purpose: str) -> None:
        with self._cv:
            if self._closed:
                return
            self._wanted.add(purpose)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dock-look", daemon=True)
                self._thread.start()
            self._cv.notify()

    def take(self, purpose: str) -> Look | None:
        with self._cv:
            return self._done.pop(purpose, None)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._wanted and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                asked, self._wanted = self._wanted, set()
            done = Look(*look(self.kind, self.prefix))
            with self._cv:
                for purpose in asked:
                    self._done[purpose] = done

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
