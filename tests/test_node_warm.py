"""The result's path warmed before the result comes (``node/main.py`` ``Node._warm_result_path``,
``node/policy.py`` ``WARM_LEAD_S``): the output checks and the primary's template run once on the last checked
output, and nothing any frame is answered with changes because of it."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

import chestnut.node.main as node_main
from chestnut.backend.model import TensorSpec
from chestnut.node.main import Node
from chestnut.node.output_template import SCALARS, ZERO_SCALARS, OutputTemplate
from chestnut.node.policy import WARM_MAX_BYTES
from chestnut.node.validity import Check, StaleDetector, check_outputs, contracts_from_specs

SPEC = TensorSpec("prob", (1, 1, 16, 32), "float32")
CONTRACTS = tuple(contracts_from_specs([SPEC], {"prob": (0.0, 1.0)}))


def frame(value: float) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    return {"x": np.full((1, 3, 32, 64), value, np.float32)}, {"prob": np.full(SPEC.shape, value, np.float32)}


def node(stale: StaleDetector, template: OutputTemplate | None = None) -> types.SimpleNamespace:
    n = types.SimpleNamespace(stale=stale, contracts=CONTRACTS, output_template=template)
    n._warm_result_path = types.MethodType(Node._warm_result_path, n)
    return n


def checked(stale: StaleDetector, value: float) -> Any:
    inputs, outputs = frame(value)
    return check_outputs(outputs, CONTRACTS, inputs=inputs, stale=stale)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    real = node_main.check_outputs

    def recording(outputs: Any, contracts: Any, **kw: Any) -> Any:
        seen.append({"outputs": outputs, "contracts": contracts, **kw})
        return real(outputs, contracts, **kw)

    monkeypatch.setattr(node_main, "check_outputs", recording)
    return seen


def test_the_checks_run_on_the_last_checked_output_without_the_stale_state_and_the_reference_only_when_compared(
        calls: list[dict[str, Any]]) -> None:
    stale = StaleDetector()
    checked(stale, 0.25)
    n = node(stale)
    n._warm_result_path(False)
    n._warm_result_path(True)
    held = stale.last_output
    assert held is not None and held["prob"].tolist() == frame(0.25)[1]["prob"].tolist()
    assert [(c["outputs"] is held, c["contracts"], c.get("stale"), c["reference"], c["reference_checked"])
            for c in calls] == [(True, CONTRACTS, None, None, True), (True, CONTRACTS, None, held, True)]


def test_nothing_is_warmed_before_an_output_was_checked_or_for_an_output_over_the_bound(
        calls: list[dict[str, Any]]) -> None:
    node(StaleDetector())._warm_result_path(True)  # a new worker: no output checked yet
    big = StaleDetector()
    big_spec = TensorSpec("prob", (WARM_MAX_BYTES // 4 + 1,), "float32")
    big.check({"x": np.zeros(1, np.float32)}, {"prob": np.zeros(big_spec.shape, np.float32)})
    node(big)._warm_result_path(True)
    assert calls == []
    small = StaleDetector()
    small.check({"x": np.zeros(1, np.float32)}, {"prob": np.zeros(WARM_MAX_BYTES // 4, np.float32)})
    node(small)._warm_result_path(False)  # at the bound itself: warmed
    assert len(calls) == 1


def test_the_warm_up_changes_no_verdict_the_stale_check_gives() -> None:
    """A frame whose output repeats the last one's while its input changed is stale, warmed before or not;
    the run count and the next frame's judgement are the same."""
    plain, warmed = StaleDetector(), StaleDetector()
    tpl = OutputTemplate("tiny@0123456789abcdef", (SPEC,))
    got: dict[str, list[Any]] = {"plain": [], "warmed": []}
    for inputs_value, output_value in ((0.1, 0.5), (0.2, 0.5), (0.3, 0.5), (0.4, 0.7), (0.4, 0.7)):
        inputs = {"x": np.full((1, 3, 32, 64), inputs_value, np.float32)}
        outputs = {"prob": np.full(SPEC.shape, output_value, np.float32)}
        for name, det in (("plain", plain), ("warmed", warmed)):
            det.see_input(inputs)
            if name == "warmed":
                node(det, tpl)._warm_result_path(True)
            report = check_outputs(outputs, CONTRACTS, stale=det)
            stale = next(r for r in report.results if r.check is Check.STALE)
            got[name].append((stale.ok, det.run))
    assert got["plain"] == got["warmed"] == [(True, 0), (False, 1), (False, 2), (True, 0), (True, 0)]


def test_the_template_is_warmed_with_zero_values_and_a_mismatched_template_is_left(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(ZERO_SCALARS) == len(SCALARS)
    assert [type(v) for v in ZERO_SCALARS] == [bool if kind == "bool" else float if kind == "f32" else int
                                               for _, kind in SCALARS]
    fills: list[tuple[Any, ...]] = []
    monkeypatch.setattr(OutputTemplate, "fill", lambda self, scalars, outputs: fills.append(tuple(scalars)))
    stale = StaleDetector()
    checked(stale, 0.25)
    node(stale, OutputTemplate("tiny@0123456789abcdef", (SPEC,)))._warm_result_path(False)
    other = OutputTemplate("tiny@0123456789abcdef", (TensorSpec("prob", (2,), "float32"),))
    node(stale, other)._warm_result_path(False)  # another worker's outputs: not this template's
    node(stale, None)._warm_result_path(False)  # no template (built field by field): the checks alone
    assert fills == [ZERO_SCALARS]
