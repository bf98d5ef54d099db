"""A steady ``modelOutput``, made from a template (``msgs/template.py``) instead of built field by field.

Every answer the primary gives as it should (it serves, its output passed every check: ``valid`` true, no
``reason``) carries the same source, model id and tensor names, shapes and dtypes; only the publish time, the
frame id, the times and figures below and each tensor's bytes change from frame to frame. So does every valid
answer of the fallback while the node stays in one state: the same source, model id and reason (the
supervisor's, e.g. the dock disabled or failed over) frame after frame. The node makes the primary's template
once per model and worker, and the fallback's once its answer has been the same for
:data:`STEADY_FRAMES` frames, between two frames (``Node._ready_output_template``, from its housekeeping), and
fills a copy of its bytes per frame (:meth:`OutputTemplate.fill`); the message published is byte for byte the
one a fresh build of the same values serialises to (``tests/test_output_template.py``). Any other answer --
none, one not valid, outputs of another name, order, shape or dtype, another reason -- is built field by field
(``Node._publish_output``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from chestnut.backend.model import TensorSpec
from chestnut.msgs.messaging import new_message
from chestnut.msgs.template import MessageTemplate, TemplateError

SCALARS = (("logMonoTime", "u64"), ("frameId", "u32"), ("executionTime", "f32"), ("frameAge", "f32"),
           ("frameDropPerc", "f32"), ("deadlineMissed", "bool"), ("primaryAgrees", "bool"),
           ("agreementChecked", "bool"), ("maxAbsDiff", "f32"), ("copyInTime", "f32"), ("computeTime", "f32"),
           ("copyOutTime", "f32"), ("deadline", "f32"))
"""The fields a frame sets, in :meth:`OutputTemplate.fill`'s order (``logMonoTime`` is the ``Event``'s,
the rest ``ModelOutput``'s, ``msgs/log.capnp``); each tensor's ``data`` follows."""

ZERO_SCALARS = tuple(False if kind == "bool" else 0.0 if kind == "f32" else 0 for _, kind in SCALARS)
"""Every :data:`SCALARS` field at its zero (0, 0.0, False)."""


TEMPLATE_MAX_BYTES = 256 * 1024
"""The most output bytes (all tensors together) a template is made for: making one builds the message ~20 times
(``msgs/template.py`` ``MessageTemplate.make``), ~4 ms at this size on the test machine and ~60 ms at 1 MiB,
which the node spends between two frames; above it the per-frame copy of the tensors dominates either way. The
prepared PP-OCRv4 detector's output at 128x256 (1x1x128x256 float32) is 128 KiB."""


STEADY_FRAMES = 3
"""How many frames in a row a non-primary answer must have been the same (source, model id, reason, tensors)
before the node makes its template: a reason that changes every frame never costs a template's builds."""


class OutputTemplate:
    """The valid ``modelOutput`` of ``source`` (``"primary"`` or ``"fallback"``), model ``model_id``, with
    ``reason`` (empty: none) and tensors ``specs`` (in their order; each of at least one byte), as a
    :class:`~chestnut.msgs.template.MessageTemplate`.

    Raises :class:`~chestnut.msgs.template.TemplateError` when the message cannot be one (a tensor of no
    bytes; outputs over :data:`TEMPLATE_MAX_BYTES`; a layout the template does not reproduce)."""

    def __init__(self, model_id: str, specs: tuple[TensorSpec, ...], source: str = "primary",
                 reason: str = "") -> None:
        if (total := sum(s.nbytes for s in specs)) > TEMPLATE_MAX_BYTES:
            raise TemplateError(f"outputs of {total} bytes, over the {TEMPLATE_MAX_BYTES} a template is made for")
        self.model_id = model_id
        self.specs = specs
        self.source = source
        self.reason = reason
        self._want = tuple((s.name, s.shape, np.dtype(s.dtype)) for s in specs)
        names = tuple((s.name, "data") for s in specs)
        self.template = MessageTemplate.make(self._build, SCALARS + names, [s.nbytes for s in specs])

    def _build(self, values: Sequence[Any]) -> Any:
        """A fresh ``Event`` builder of the answer with ``values`` (:data:`SCALARS`, then each tensor's bytes)."""
        msg = new_message("modelOutput")
        msg.logMonoTime = values[0]
        mo = msg.modelOutput
        mo.frameId = values[1]
        mo.source = self.source
        mo.modelId = self.model_id
        tensors = mo.init("outputs", len(self.specs))
        for t, (name, shape, dtype), data in zip(tensors, self._want, values[len(SCALARS):], strict=True):
            t.name = name
            t.shape = list(shape)
            t.dtype = dtype.name
            t.data = bytes(data)
        if self.reason:  # where the node's builder sets it, after the tensors (the text's place in the message
            mo.reason = self.reason  # follows the order of the sets); an empty one is never set (a set one is a
            # pointer to "")
        (mo.executionTime, mo.frameAge, mo.frameDropPerc, mo.deadlineMissed, mo.primaryAgrees, mo.agreementChecked,
         mo.maxAbsDiff, mo.copyInTime, mo.computeTime, mo.copyOutTime, mo.deadline) = values[2:len(SCALARS)]
        return msg

    def answers(self, source: str, model_id: str, reason: str) -> bool:
        """This template is the valid answer of ``source``, ``model_id`` with ``reason``."""
        return source == self.source and reason == self.reason and model_id == self.model_id

    def matches(self, outputs: Mapping[str, np.ndarray]) -> bool:
        """``outputs`` are this template's tensors: the same names in the same order, shapes and dtypes."""
        if len(outputs) != len(self._want):
            return False
        for (name, arr), (want, shape, dtype) in zip(outputs.items(), self._want, strict=True):
            if name != want or arr.shape != shape or arr.dtype != dtype:
                return False
        return True

    def warm(self, outputs: Mapping[str, np.ndarray]) -> None:
        """:meth:`fill` once at zero values with ``outputs`` (:meth:`matches` true), the bytes dropped: the caches
        the next fill will find warm (``node/policy.py`` ``WARM_LEAD_S``). Raises what :meth:`fill` raises."""
        self.fill(ZERO_SCALARS, outputs)

    def fill(self, scalars: Sequence[Any], outputs: Mapping[str, np.ndarray]) -> bytearray:
        """The serialised ``Event``: ``scalars`` in :data:`SCALARS` order (ns, ids, s, %, bools), ``outputs``
        (:meth:`matches` true) in their order. Raises ``struct.error`` (a value outside its field's type: an id
        over 32 bits, a float beyond binary32) and ``ValueError``; nothing is made then."""
        return self.template.fill((*scalars, *(np.ascontiguousarray(a) for a in outputs.values())))
