"""``twin serve``'s signal handler: one INFO line on the first signal, DEBUG for a later one (backend/sim/daemon.py)."""
import logging

from chestnut.backend.sim.daemon import StopOnSignal


def test_second_signal_logs_at_debug(caplog):
    stops = []
    h = StopOnSignal(lambda: stops.append(1))
    caplog.set_level(logging.DEBUG, logger="chestnut")
    h(15, None)
    h(2, None)
    got = [(r.levelname, r.getMessage()) for r in caplog.records if "signal" in r.getMessage()]
    assert got == [("INFO", "signal 15: stopping"), ("DEBUG", "signal 2: already stopping")]
    assert stops == [1]
