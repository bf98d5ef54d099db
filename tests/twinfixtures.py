"""The twin daemon as pytest fixtures, for tests that drive a runner or the ladder against it in-process.

``daemon, dock = twin_fixtures(PREFIX)`` at a test module's top level gives it ``daemon`` (one twin
daemon on ``PREFIX`` for the module, its client yielded) and ``dock`` (that daemon with every fault
cleared, power-cycled and this process's cached device lists forgotten: a fresh dock per test, as
tinygrad sees one after a replug).

``hold_dock_lock(bus, address)`` / ``let_go(holder)``: another process holding the dock's lock file
(``backend/docklock.py`` ``DockLock``), as a probe or a second node would."""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from chestnut.backend.sim.client import TwinClient, running_twin
from chestnut.backend.sim.usb3 import forget_device_lists


def twin_fixtures(prefix: str) -> tuple[Any, Any]:
    @pytest.fixture(scope="module")
    def daemon() -> Iterator[TwinClient]:
        with running_twin(prefix) as client:
            yield client
        forget_device_lists()

    @pytest.fixture
    def dock(daemon: TwinClient) -> TwinClient:
        daemon.clear()
        daemon.power_cycle(0)
        forget_device_lists()
        return daemon

    return daemon, dock


HOLD = ("import sys;from chestnut.backend.docklock import *;DockLock(dock_lock_path({bus},{address})).acquire(5);"
        "print('held',flush=True);sys.stdin.read()")


def hold_dock_lock(bus: int, address: int) -> tuple[subprocess.Popen[str], str]:
    """A child process that holds the lock of the dock at ``bus``-``address`` until :func:`let_go`, once it holds
    it; returns it and its ``-c`` code as a holder's line names it (its command line is ``<python> -c <code>``, the
    code quoted as a shell takes it: ``backend/docklock.py`` ``holder_command``)."""
    code = HOLD.format(bus=bus, address=address)
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder, shlex.quote(code)


def let_go(holder: subprocess.Popen[str]) -> None:
    """End a :func:`hold_dock_lock` child (its lock goes with it)."""
    assert holder.stdin is not None
    holder.stdin.close()
    holder.wait(timeout=10)
