import os

import pytest

from chestnut.backend.sim.client import running_twin
from chestnut.msgs.messaging import SubMaster


@pytest.mark.timeout(60)
def test_twin_publishes_its_state_with_live_faults_and_engine():
    prefix = f"t{os.getpid()}-twinstate"
    with SubMaster(["twinState"], prefix=prefix) as sm, running_twin(prefix, ["--engine", "onnxruntime"]) as tc:
        fid = tc.fault("slow_gpu", delay_ms=5)["id"]
        seen = None
        for _ in range(60):
            sm.update(100)
            if sm.updated["twinState"] and list(sm["twinState"].faults):
                seen = sm["twinState"]
                break
        assert seen is not None
        assert list(seen.faults) == [f"slow_gpu#{fid}:0"]
        assert (seen.present, seen.speedMbps, seen.programEngine, seen.wedged) == (True, 5000, "onnxruntime", False)
