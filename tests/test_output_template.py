"""A message made from a template (msgs/template.py ``MessageTemplate``) is byte for byte the one a fresh build of
the same values serialises to; the node publishes the primary's answer from one (node/output_template.py,
node/main.py ``Node._publish_output``) and every other answer field by field, the same bytes either way."""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chestnut.backend.model import TensorSpec
from chestnut.backend.stages import StageTimes
from chestnut.msgs.messaging import log_from_bytes, new_message
from chestnut.msgs.schema import log
from chestnut.msgs.template import MessageTemplate, TemplateError
from chestnut.node.main import FrameResult, Node
from chestnut.node.output_template import SCALARS, STEADY_FRAMES, TEMPLATE_MAX_BYTES, OutputTemplate
from chestnut.node.policy import Answer, FrameClock, Source
from chestnut.node.validity import Check, CheckResult, ValidityReport

SPECS = (TensorSpec("prob", (1, 1, 2, 2), "float32"), TensorSpec("aux", (3,), "int32"))
PRIMARY_ID, FALLBACK_ID = "tiny@0123456789abcdef", "tiny-fallback@fedcba9876543210"

# ---------------------------------------------------------------- the template itself

ACTIVE_FIELDS = (("logMonoTime", "u64"), ("since", "u64"), ("active", "bool"))


def _active(values: Sequence[Any]) -> Any:
    msg = new_message("chestnutActive")
    msg.logMonoTime = values[0]
    a = msg.chestnutActive
    a.since, a.active = values[1], values[2]
    a.source = "primary"
    a.reason = "all layers OK"
    return msg


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.booleans())
def test_a_filled_template_is_the_bytes_of_a_fresh_build(t: int, since: int, active: bool) -> None:
    tpl = MessageTemplate.make(_active, ACTIVE_FIELDS)
    assert tpl.fill((t, since, active)) == _active((t, since, active)).to_bytes()
    assert tpl.nbytes == len(_active((0, 0, False)).to_bytes())


def test_a_template_refuses_what_it_cannot_write() -> None:
    def reason(values: Sequence[Any]) -> Any:  # a Text field: its 4 bytes are 8 characters, and a NUL
        msg = _active((1, 2, True))
        msg.chestnutActive.reason = bytes(values[0]).hex()
        return msg

    with pytest.raises(TemplateError, match="not one of"):
        MessageTemplate.make(_active, (("logMonoTime", "u16"), ("since", "u64"), ("active", "bool")))
    with pytest.raises(TemplateError, match="does not show"):
        MessageTemplate.make(lambda v: _active((1, 2, True)), (("ignored", "u32"),))
    with pytest.raises(TemplateError, match="needs its size"):
        MessageTemplate.make(_active, (*ACTIVE_FIELDS, ("data", "data")))
    with pytest.raises(TemplateError, match="data sizes"):
        MessageTemplate.make(_active, ACTIVE_FIELDS, [4])
    with pytest.raises(TemplateError, match="not one u32"):  # a value the build changes: it shows in 5 bytes
        MessageTemplate.make(lambda v: _active((v[0] * 3, 2, True)), (("logMonoTime", "u32"),))
    with pytest.raises(TemplateError, match="hold another value"):  # ... or in 4 bytes, not as written
        MessageTemplate.make(lambda v: _active((v[0] ^ 0x10, 2, True)), (("logMonoTime", "u32"),))

    def valid(values: Sequence[Any]) -> Any:  # Event.valid defaults to true: stored XORed, its bit set for false
        msg = _active((1, 2, True))
        msg.valid = values[0]
        return msg

    with pytest.raises(TemplateError, match="default other than false"):
        MessageTemplate.make(valid, (("valid", "bool"),))
    with pytest.raises(TemplateError, match="8 byte"):
        MessageTemplate.make(reason, (("reason", "data"),), [4])


def test_a_fill_with_a_value_its_field_cannot_hold_raises_and_makes_nothing() -> None:
    tpl = MessageTemplate.make(lambda v: _tensor_msg(v, 8), (("logMonoTime", "u64"), ("t", "data")), [8])
    with pytest.raises(ValueError, match="4 bytes for a field of 8"):
        tpl.fill((1, np.zeros(1, np.float32)))
    with pytest.raises(struct.error):
        tpl.fill((-1, np.zeros(2, np.float32)))
    two = np.arange(2, dtype=np.float32)
    assert tpl.fill((5, two)) == _tensor_msg((5, two), 8).to_bytes()


def _tensor_msg(values: Sequence[Any], n: int) -> Any:
    msg = new_message("modelOutput")
    msg.logMonoTime = values[0]
    t = msg.modelOutput.init("outputs", 1)[0]
    t.name = "t"
    t.data = bytes(memoryview(np.ascontiguousarray(values[1])).cast("B"))
    assert len(t.data) == n
    return msg


# ---------------------------------------------------------------- the node's modelOutput


class _Pub:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, service: str, msg: Any) -> None:
        assert service == "modelOutput"
        self.sent.append(bytes(msg) if isinstance(msg, bytes | bytearray) else msg.to_bytes())


class _Publisher:
    """The node's publishing half alone: its own methods, the attributes they read."""

    _prepare_output = Node._prepare_output
    _ready_output_template = Node._ready_output_template
    _ready_answer_template = Node._ready_answer_template
    _note_answer = Node._note_answer
    def _output_builder(self) -> tuple[Any, Any]:
        self.built += 1
        return Node._output_builder(self)  # type: ignore[arg-type]
    _publish_output = Node._publish_output
    _sent_output = Node._sent_output

    def __init__(self, template: bool = True) -> None:
        self.next_output: Any = None
        self.output_template: Any = None
        self.template_refused: Any = None
        self.answer_seen: Any = None
        self.answer_streak = 0
        self.answer_template: Any = None
        self.answer_template_key: Any = None
        self.answer_refused: set[Any] = set()
        self.built = 0  # answers built field by field
        self.primary_model_id = PRIMARY_ID
        self.fallback = SimpleNamespace(model_id=FALLBACK_ID)
        self.pm = _Pub()
        self.frames_out = 0
        if template:
            self._ready_output_template(SPECS)

    def publish(self, frame_id: int, answer: Answer, report: ValidityReport | None = None,
                stages: StageTimes | None = None, drop: float = 0.0) -> tuple[dict[str, Any], bytes]:
        """(the published modelOutput as a dict less its publish-time stamp, the message's bytes less it)"""
        cf = SimpleNamespace(timestampEof=1)
        self._publish_output(frame_id, cf, FrameResult(answer, False, report, stages, 45.0), FrameClock(1, "unknown"),
                             drop)
        data = self.pm.sent[-1]
        d = log_from_bytes(data).to_dict()
        d.pop("logMonoTime")
        return d, _without_log_mono_time(data)


def _without_log_mono_time(data: bytes) -> bytes:
    """``data`` less the Event's ``logMonoTime`` (the first word of its data section: after the segment table, at
    the root pointer's word offset after it; https://capnproto.org/encoding.html)."""
    segments = struct.unpack_from("<I", data)[0] + 1
    table = (4 * (segments + 1) + 7) // 8 * 8
    at = table + 8 + 8 * (struct.unpack_from("<i", data, table)[0] >> 2)
    return data[:at] + data[at + 8:]


def _outputs(order: tuple[str, ...] = ("prob", "aux"), aux_dtype: str = "int32") -> dict[str, np.ndarray]:
    made = {"prob": np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2) / 8, "aux": np.array([1, -2, 3], aux_dtype)}
    return {k: made[k] for k in order}


def _fresh(frame_id: int, answer: Answer, **kw: Any) -> tuple[dict[str, Any], bytes]:
    return _Publisher(template=False).publish(frame_id, answer, **kw)


def _agreement(ok: bool, diff: float) -> ValidityReport:
    return ValidityReport((CheckResult(Check.FINITE, "prob", True, "ok"),
                           CheckResult(Check.AGREEMENT, "prob", ok, "ok" if ok else "differs", diff)))


def test_the_primary_answer_from_its_template_is_the_message_a_fresh_build_makes() -> None:
    p = _Publisher()
    assert p.output_template is not None
    answer = Answer(Source.PRIMARY, _outputs(), 0.004, True, "")
    got, data = p.publish(7, answer, stages=StageTimes(0.001, 0.002, 0.0005), drop=2.5)
    assert p.next_output is None  # no builder was taken
    assert (got, data) == _fresh(7, answer, stages=StageTimes(0.001, 0.002, 0.0005), drop=2.5)
    mo = got["modelOutput"]
    assert (mo["frameId"], mo["source"], mo["modelId"]) == (7, "primary", PRIMARY_ID)
    assert [(t["name"], t["shape"], t["dtype"]) for t in mo["outputs"]] == [
        ("prob", [1, 1, 2, 2], "float32"), ("aux", [3], "int32")]
    assert mo["outputs"][0]["data"] == (np.arange(4, dtype=np.float32) / 8).tobytes()
    assert mo["outputs"][1]["data"] == np.array([1, -2, 3], np.int32).tobytes()
    assert (mo["copyInTime"], mo["computeTime"], mo["copyOutTime"]) == pytest.approx((0.001, 0.002, 0.0005))
    assert mo["frameDropPerc"] == 2.5 and mo["deadline"] == pytest.approx(0.045)
    for ok, diff in ((True, 0.0625), (False, 3.0)):  # hot standby: the agreement's figures
        report = _agreement(ok, diff)
        got, data = p.publish(9, answer, report=report)
        assert (got, data) == _fresh(9, answer, report=report)
        mo = got["modelOutput"]
        assert (mo["agreementChecked"], mo.get("primaryAgrees", False), mo["maxAbsDiff"]) == (True, ok, diff)
    assert p.next_output is None


@pytest.mark.parametrize("answer", [
    Answer(Source.FALLBACK, _outputs(), 0.002, True, "fallback answered: the primary missed its deadline"),
    Answer(Source.NONE, None, 0.0, False, "no model answered"),
    Answer(Source.PRIMARY, _outputs(), 0.004, False, "input not valid: the camera published this frame ..."),
    Answer(Source.PRIMARY, _outputs(("aux", "prob")), 0.004, True, ""),
    Answer(Source.PRIMARY, _outputs(aux_dtype="int64"), 0.004, False, "aux: dtype int64 != declared int32"),
    Answer(Source.PRIMARY, {"prob": _outputs()["prob"]}, 0.004, False, "missing output(s) ['aux']"),
    Answer(Source.PRIMARY, _outputs(), 1e39, True, ""),  # beyond binary32: the builder's conversion (inf)
], ids=["fallback", "none", "not-valid", "other-order", "other-dtype", "fewer", "f32-overflow"])
def test_any_other_answer_is_built_field_by_field_to_the_same_bytes(answer: Answer) -> None:
    p = _Publisher()
    got, data = p.publish(7, answer)
    assert (got, data) == _fresh(7, answer)
    assert p.pm.sent[-1] != b"" and p.next_output is None
    mo = got["modelOutput"]
    assert mo["frameId"] == 7
    assert mo.get("modelId", "") == {Source.PRIMARY: PRIMARY_ID, Source.FALLBACK: FALLBACK_ID}.get(answer.source, "")
    assert [t["name"] for t in mo.get("outputs", [])] == list(answer.outputs or {})
    assert got["valid"] is answer.valid and mo.get("reason", "") == answer.reason


def test_a_model_whose_answer_cannot_be_a_template_is_built_field_by_field_and_asked_once(
        caplog: pytest.LogCaptureFixture) -> None:
    p = _Publisher(template=False)
    empty = (TensorSpec("prob", (1, 1, 2, 2), "float32"), TensorSpec("none", (0,), "float32"))
    with caplog.at_level(logging.DEBUG, logger="chestnut.node"):
        p._ready_output_template(empty)
        p._ready_output_template(empty)
    assert p.output_template is None and p.template_refused == (PRIMARY_ID, empty)
    assert [r.getMessage() for r in caplog.records] == [
        "the primary's modelOutput is built field by field: field 'none': a data field needs its size (bytes, at "
        "least 1)"]
    outs = {"prob": _outputs()["prob"], "none": np.zeros(0, np.float32)}
    answer = Answer(Source.PRIMARY, outs, 0.004, True, "")
    assert p.publish(7, answer) == _fresh(7, answer)


def test_a_new_worker_or_model_makes_a_new_template_and_the_same_one_is_kept() -> None:
    p = _Publisher()
    first = p.output_template
    p._ready_output_template(SPECS)
    assert p.output_template is first
    p.primary_model_id = "tiny@ffffffffffffffff"
    p._ready_output_template(SPECS)
    assert p.output_template is not first and p.output_template.model_id == "tiny@ffffffffffffffff"
    answer = Answer(Source.PRIMARY, _outputs(), 0.004, True, "")
    got, _ = p.publish(3, answer)
    assert got["modelOutput"]["modelId"] == "tiny@ffffffffffffffff"


def test_the_template_sets_every_field_a_frame_changes() -> None:
    """Every ModelOutput field but those the primary's answer holds fixed (its source, model id, tensor list and
    no reason) is one the template writes: a field added to the schema fails this until it is one."""
    fixed = {"source", "modelId", "outputs", "reason"}
    assert [name for name, _ in SCALARS] == ["logMonoTime"] + [
        f for f in log.ModelOutput.schema.fieldnames if f not in fixed]
    tpl = OutputTemplate(PRIMARY_ID, SPECS)
    assert tpl.template.data_sizes == (16, 12)
    assert tpl.matches(_outputs()) and not tpl.matches(_outputs(("aux", "prob")))


def test_outputs_over_the_template_size_are_built_field_by_field() -> None:
    big = (TensorSpec("prob", (1, 1, 256, 257), "float32"),)  # 263168 bytes, just over 256 KiB
    assert big[0].nbytes > TEMPLATE_MAX_BYTES >= 128 * 1024  # the prepared detector's 1x1x128x256 float32 fits
    with pytest.raises(TemplateError, match="outputs of 263168 bytes, over the 262144"):
        OutputTemplate(PRIMARY_ID, big)
    p = _Publisher(template=False)
    p._ready_output_template(big)
    assert p.output_template is None and p.template_refused == (PRIMARY_ID, big)
    answer = Answer(Source.PRIMARY, {"prob": np.ones((1, 1, 256, 257), np.float32)}, 0.004, True, "")
    assert p.publish(5, answer) == _fresh(5, answer)


FALLBACK_REASON = "the dock is disabled (dock.kind = none)"


def test_the_fallbacks_steady_answer_is_made_a_template_and_is_the_message_a_fresh_build_makes() -> None:
    p = _Publisher(template=False)
    answer = Answer(Source.FALLBACK, _outputs(), 0.002, True, FALLBACK_REASON)
    for frame in range(1, STEADY_FRAMES):
        assert p.publish(frame, answer) == _fresh(frame, answer)
        p._ready_answer_template()  # the housekeeping between frames
        assert p.answer_template is None  # not yet steady
    assert p.publish(STEADY_FRAMES, answer) == _fresh(STEADY_FRAMES, answer)
    assert p.built == STEADY_FRAMES
    p._ready_answer_template()
    tpl = p.answer_template
    assert tpl is not None and (tpl.source, tpl.model_id, tpl.reason) == ("fallback", FALLBACK_ID, FALLBACK_REASON)
    got, data = p.publish(10, answer, drop=5.0)
    assert p.built == STEADY_FRAMES  # from the template
    assert (got, data) == _fresh(10, answer, drop=5.0)
    assert got["modelOutput"]["reason"] == FALLBACK_REASON and got["modelOutput"]["source"] == "fallback"
    p._ready_answer_template()
    assert p.answer_template is tpl  # kept, not made again
    other = Answer(Source.FALLBACK, _outputs(), 0.002, True, "failed over: the USB link is down")
    assert p.publish(11, other) == _fresh(11, other)  # another reason: built field by field
    assert p.built == STEADY_FRAMES + 1
    assert p.publish(12, answer) == _fresh(12, answer)  # the template still answers its own reason
    assert p.built == STEADY_FRAMES + 1


@pytest.mark.parametrize("answers", [
    # the reason changes every frame: never steady
    [Answer(Source.FALLBACK, _outputs(), 0.002, True, f"deadline miss {i}") for i in range(6)],
    # the tensors change: a streak starts again
    [Answer(Source.FALLBACK, _outputs(), 0.002, True, "r"), Answer(Source.FALLBACK, _outputs(), 0.002, True, "r"),
     Answer(Source.FALLBACK, _outputs(aux_dtype="int64"), 0.002, True, "r")],
    # not valid, or no model: never a template
    [Answer(Source.FALLBACK, _outputs(), 0.002, False, "input not valid")] * 4,
    [Answer(Source.NONE, None, 0.0, False, "no source ran")] * 4,
], ids=["reason-per-frame", "tensors-change", "not-valid", "none"])
def test_an_answer_that_is_not_steady_and_valid_is_never_made_a_template(answers: list[Answer]) -> None:
    p = _Publisher(template=False)
    for frame, answer in enumerate(answers, 1):
        assert p.publish(frame, answer) == _fresh(frame, answer)
        p._ready_answer_template()
    assert p.answer_template is None and p.built == len(answers)


def test_a_0d_tensor_keeps_its_empty_shape_built_or_from_a_template() -> None:
    p = _Publisher(template=False)
    answer = Answer(Source.FALLBACK, {"score": np.array(3.5, np.float32)}, 0.002, True, FALLBACK_REASON)
    for frame in range(1, STEADY_FRAMES + 2):
        got, data = p.publish(frame, answer)
        assert (got, data) == _fresh(frame, answer)
        (t,) = got["modelOutput"]["outputs"]
        assert (t.get("shape", []), t["dtype"], t["data"]) == ([], "float32", np.float32(3.5).tobytes())
        p._ready_answer_template()
    assert p.answer_template is not None and p.built == STEADY_FRAMES  # the last one from the template


def test_a_fallback_answer_that_cannot_be_a_template_is_tried_once_whatever_its_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    p = _Publisher(template=False)
    outs = {"prob": _outputs()["prob"], "none": np.zeros(0, np.float32)}  # a tensor of no bytes: no template
    with caplog.at_level(logging.DEBUG, logger="chestnut.node"):
        for reason in ("dock disabled", "failed over"):  # two states, each steady in turn, twice
            for _ in range(2):
                answer = Answer(Source.FALLBACK, outs, 0.002, True, reason)
                for frame in range(STEADY_FRAMES):
                    assert p.publish(frame, answer) == _fresh(frame, answer)
                    p._ready_answer_template()
    assert p.answer_template is None
    assert [r.getMessage() for r in caplog.records] == [
        "the fallback's modelOutput is built field by field: field 'none': a data field needs its size (bytes, at "
        "least 1)"]
