"""The twin daemon as pytest fixtures, for tests that drive a runner or the ladder against it in-process.

``daemon, dock = twin_fixtures(PREFIX)`` at a test module's top level gives it ``daemon`` (one twin
daemon on ``PREFIX`` for the module, its client yielded) and ``dock`` (that daemon with every fault
cleared, power-cycled and this process's cached device lists forgotten: a fresh dock per test, as
tinygrad sees one after a replug)."""

from __future__ import annotations

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
