"""The node's ``modelOutput`` drafted while the primary computes (node/main.py ``Node._draft_output``): a primary
answer of the drafted frame and tensor specs fills only the values; every other answer gets a fresh builder, and
either way the message published is field for field, and byte for byte in size, the one a fresh build makes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from chestnut.backend.model import TensorSpec
from chestnut.msgs.messaging import log_from_bytes
from chestnut.node.main import FrameResult, Node
from chestnut.node.policy import Answer, FrameClock, Source

SPECS = (TensorSpec("prob", (1, 1, 2, 2), "float32"), TensorSpec("aux", (3,), "int32"))
PRIMARY_ID, FALLBACK_ID = "tiny@0123456789abcdef", "tiny-fallback@fedcba9876543210"


class _Pub:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, service: str, msg: Any) -> None:
        assert service == "modelOutput"
        self.sent.append(msg.to_bytes())


class _Publisher:
    """The node's publishing half alone: its own methods, the attributes they read."""

    _prepare_output = Node._prepare_output
    _draft_output = Node._draft_output
    _drafted = Node._drafted
    _output_builder = Node._output_builder
    _publish_output = Node._publish_output

    def __init__(self) -> None:
        self.next_output: Any = None
        self.output_draft: Any = None
        self.primary_model_id = PRIMARY_ID
        self.fallback = SimpleNamespace(model_id=FALLBACK_ID)
        self.pm = _Pub()
        self.frames_out = 0

    def publish(self, frame_id: int, answer: Answer) -> tuple[dict[str, Any], int]:
        """(the published modelOutput as a dict less its publish-time stamp, the message's size in bytes)"""
        cf = SimpleNamespace(timestampEof=1)
        self._publish_output(frame_id, cf, FrameResult(answer, deadline_ms=45.0), FrameClock(1, "unknown"), 0.0)
        data = self.pm.sent[-1]
        d = log_from_bytes(data).to_dict()
        d.pop("logMonoTime")
        return d, len(data)


def _outputs(order: tuple[str, ...] = ("prob", "aux"), aux_dtype: str = "int32") -> dict[str, np.ndarray]:
    made = {"prob": np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2) / 8, "aux": np.array([1, -2, 3], aux_dtype)}
    return {k: made[k] for k in order}


def _fresh(frame_id: int, answer: Answer) -> tuple[dict[str, Any], int]:
    return _Publisher().publish(frame_id, answer)


def test_a_drafted_primary_answer_is_the_message_a_fresh_build_makes() -> None:
    p = _Publisher()
    p._draft_output(7, SPECS)
    answer = Answer(Source.PRIMARY, _outputs(), 0.004, True, "")
    got, size = p.publish(7, answer)
    assert p.output_draft is None and p.next_output is None  # the drafted builder was the one sent
    assert (got, size) == _fresh(7, answer)
    mo = got["modelOutput"]
    assert (mo["frameId"], mo["source"], mo["modelId"]) == (7, "primary", PRIMARY_ID)
    assert [(t["name"], t["shape"], t["dtype"]) for t in mo["outputs"]] == [
        ("prob", [1, 1, 2, 2], "float32"), ("aux", [3], "int32")]
    assert mo["outputs"][0]["data"] == (np.arange(4, dtype=np.float32) / 8).tobytes()
    assert mo["outputs"][1]["data"] == np.array([1, -2, 3], np.int32).tobytes()


@pytest.mark.parametrize(("frame_id", "answer"), [
    (7, Answer(Source.FALLBACK, _outputs(), 0.002, True, "fallback answered: the primary missed its deadline")),
    (7, Answer(Source.NONE, None, 0.0, False, "no model answered")),
    (8, Answer(Source.PRIMARY, _outputs(), 0.004, True, "")),               # another frame's draft (left behind)
    (7, Answer(Source.PRIMARY, _outputs(("aux", "prob")), 0.004, True, "")),  # another order
    (7, Answer(Source.PRIMARY, _outputs(aux_dtype="int64"), 0.004, False, "aux: dtype int64 != declared int32")),
    (7, Answer(Source.PRIMARY, {"prob": _outputs()["prob"]}, 0.004, False, "missing output(s) ['aux']")),
], ids=["fallback", "none", "other-frame", "other-order", "other-dtype", "fewer"])
def test_any_other_answer_takes_a_fresh_builder(frame_id: int, answer: Answer) -> None:
    p = _Publisher()
    p._draft_output(7, SPECS)
    got, size = p.publish(frame_id, answer)
    assert (got, size) == _fresh(frame_id, answer)
    assert p.output_draft is None
    mo = got["modelOutput"]
    assert mo["frameId"] == frame_id
    assert mo.get("modelId", "") == {Source.PRIMARY: PRIMARY_ID, Source.FALLBACK: FALLBACK_ID}.get(answer.source, "")
    assert [t["name"] for t in mo.get("outputs", [])] == list(answer.outputs or {})


def test_the_next_frame_after_a_refused_draft_is_drafted_again() -> None:
    p = _Publisher()
    p._draft_output(7, SPECS)
    p.publish(7, Answer(Source.FALLBACK, _outputs(), 0.002, True, "fallback answered"))
    p._prepare_output()  # between frames
    p._draft_output(8, SPECS)
    answer = Answer(Source.PRIMARY, _outputs(), 0.004, True, "")
    assert p.publish(8, answer) == _fresh(8, answer)
