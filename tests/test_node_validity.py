"""Output validity checks: each failure with its exact reason; openpilot's replay tolerance; staleness."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from chestnut.backend.model import TensorSpec
from chestnut.node.validity import (
    Check,
    CheckResult,
    OutputContract,
    StaleDetector,
    check_agreement,
    check_dtype,
    check_finite,
    check_outputs,
    check_present,
    check_range,
    check_shape,
    compare_tensors,
    contracts_from_specs,
)

PROB = TensorSpec("prob", (1, 1, 2, 4), "float32")
OK_PROB = np.array([[[[0.0, 0.25, 0.5, 1.0], [0.1, 0.2, 0.3, 0.4]]]], dtype=np.float32)


def ok(check, output=""):
    return CheckResult(check, output, True, "ok")


# ---------------------------------------------------------------- contracts


def test_contracts_from_specs_attach_ranges_and_refuse_bad_ones():
    (c,) = contracts_from_specs([PROB], {"prob": (0.0, 1.0)}, tol=1e-2)
    assert c == OutputContract(PROB, (0.0, 1.0), 1e-2) and c.name == "prob"
    with pytest.raises(ValueError, match=r"undeclared output\(s\) \['logits'\]"):
        contracts_from_specs([PROB], {"logits": (0, 1)})
    with pytest.raises(ValueError, match="value range of 'prob' is empty: lo=1 > hi=0"):
        contracts_from_specs([PROB], {"prob": (1, 0)})


# ---------------------------------------------------------------- single checks


def test_present_reports_missing_and_undeclared_outputs():
    contracts = contracts_from_specs([PROB, TensorSpec("aux", (1,), "float32")])
    assert check_present({"prob": OK_PROB, "aux": np.zeros(1, np.float32)}, contracts) == ok(Check.PRESENT)
    r = check_present({"prob": OK_PROB, "zz": OK_PROB, "extra": OK_PROB}, contracts)
    assert r == CheckResult(Check.PRESENT, "", False, "missing output(s) ['aux']; undeclared output(s) ['extra', 'zz']")
    assert r.hard


def test_shape_and_dtype_must_equal_the_declared_spec():
    assert check_shape("prob", OK_PROB, PROB) == ok(Check.SHAPE, "prob")
    assert check_shape("prob", OK_PROB.reshape(1, 1, 4, 2), PROB) == CheckResult(
        Check.SHAPE, "prob", False, "prob: shape (1, 1, 4, 2) != declared (1, 1, 2, 4)")
    assert check_dtype("prob", OK_PROB, PROB) == ok(Check.DTYPE, "prob")
    assert check_dtype("prob", OK_PROB.astype(np.float16), PROB) == CheckResult(
        Check.DTYPE, "prob", False, "prob: dtype float16 != declared float32")


def test_finite_counts_nan_and_inf_and_names_the_first():
    a = OK_PROB.copy()
    a[0, 0, 1, 2] = np.nan
    a[0, 0, 1, 3] = -np.inf
    assert check_finite("prob", a) == CheckResult(
        Check.FINITE, "prob", False, "prob: 2 non-finite value(s) (1 NaN, 1 inf), first at (0, 0, 1, 2)")
    assert check_finite("prob", OK_PROB) == ok(Check.FINITE, "prob")
    assert check_finite("ids", np.array([1, 2], np.int64)) == ok(Check.FINITE, "ids")


def test_range_is_inclusive_ignores_nan_and_reports_the_extremes():
    assert check_range("prob", OK_PROB, (0.0, 1.0)) == ok(Check.RANGE, "prob")  # 0 and 1 are in
    a = OK_PROB.copy()
    a[0, 0, 0, 1] = -0.25
    a[0, 0, 1, 0] = 1.5
    a[0, 0, 1, 1] = np.nan
    assert check_range("prob", a, (0.0, 1.0)) == CheckResult(
        Check.RANGE, "prob", False, "prob: 2 value(s) outside [0, 1] (min -0.25, max 1.5), first at (0, 0, 0, 1)")
    assert check_range("prob", a, None) == ok(Check.RANGE, "prob")
    assert check_range("count", np.array([0, 7, 300], np.int32), (0, 255)) == CheckResult(
        Check.RANGE, "count", False, "count: 1 value(s) outside [0, 255] (min 300, max 300), first at (2,)")


# ---------------------------------------------------------------- fingerprints and staleness


def _frame(i: int) -> dict[str, np.ndarray]:
    return {"x": np.full((1, 3, 4, 4), i, np.float32)}


def test_stale_means_identical_output_while_the_input_changed():
    d = StaleDetector()
    out_a, out_b = {"prob": OK_PROB}, {"prob": OK_PROB + 1}
    assert d.check(_frame(1), out_a).ok  # first frame
    assert d.check(_frame(1), {"prob": OK_PROB.copy()}).ok  # same input, same output: expected
    r = d.check(_frame(2), out_a)
    assert r == CheckResult(Check.STALE, "", False,
                            "output identical to the previous frame's while the input changed (1 in a row)")
    assert not r.hard
    assert d.check(_frame(3), out_a).reason.endswith("(2 in a row)") and d.run == 2
    assert d.check(_frame(4), out_b).ok and d.run == 0
    d.reset()
    assert d.check(_frame(5), out_b).ok  # after a reset the next frame is a first frame


def test_stale_compares_every_byte_name_shape_and_dtype_of_input_and_output():
    base_in, base_out = _frame(1), {"prob": OK_PROB}
    flipped = OK_PROB.copy()
    flipped.view(np.uint8)[0, 0, 0, 0] ^= 1  # one bit of one float
    changed_in = [_frame(2), {"y": base_in["x"]}, {"x": base_in["x"].reshape(1, 3, 2, 8)},
                  {"x": base_in["x"].view(np.int32)}, {**base_in, "z": np.zeros(1, np.float32)}]
    for new_in in changed_in:  # any change of the input makes an unchanged output stale
        d = StaleDetector()
        d.check(base_in, base_out)
        assert not d.check(new_in, {"prob": OK_PROB.copy()}).ok, new_in
    changed_out = [{"prob": flipped}, {"p": OK_PROB}, {"prob": OK_PROB.reshape(1, 1, 4, 2)},
                   {"prob": OK_PROB.view(np.int32)}, {"prob": OK_PROB, "aux": np.zeros(1, np.float32)}]
    for new_out in changed_out:  # any change of the output is not stale
        d = StaleDetector()
        d.check(base_in, base_out)
        assert d.check(_frame(2), new_out).ok, new_out
    d = StaleDetector()  # equal bytes in another memory layout are the same tensor; NaN bits equal themselves
    nan = np.full((2, 3), np.nan, np.float32)
    d.check({"x": np.ones((2, 3), np.float32)}, {"prob": nan})
    assert not d.check({"x": np.asfortranarray(np.zeros((2, 3), np.float32))}, {"prob": nan.copy()}).ok


def test_stale_holds_copies_not_the_callers_arrays():
    """A caller that reuses its buffers (a preprocessing buffer, a shared-memory result) is compared by value:
    the detector's copy of the previous frame does not change with them."""
    d = StaleDetector()
    x, out = _frame(1), {"prob": OK_PROB.copy()}
    d.check(x, out)
    x["x"][...] = 2  # the same buffers, new contents
    out["prob"][...] = 0.25
    assert d.check(x, out).ok  # the input changed and so did the output
    x["x"][...] = 3
    assert not d.check(x, out).ok  # the input changed, the output did not


def test_stale_judges_against_its_own_last_frame():
    """A detector not run on every frame (a warm standby's fallback) compares with the frames it saw: input A,
    then (unseen) B, then A again with the same output is a repeated input, not a stale output."""
    d = StaleDetector()
    assert d.check(_frame(1), {"prob": OK_PROB}).ok
    assert d.check(_frame(1), {"prob": OK_PROB.copy()}).ok and d.run == 0


# ---------------------------------------------------------------- agreement


def test_compare_uses_openpilots_replay_tolerance():
    tol = 1e-3
    a = np.array([0.0, 0.0, 1000.0, 1000.0, np.nan, np.nan, np.inf, np.inf, 1.0], np.float64)
    b = np.array([0.001, 0.0011, 1000.9, 1001.1, np.nan, 1.0, np.inf, -np.inf, 1.0], np.float64)
    c = compare_tensors(a, b, tol)
    # elementwise: |a-b| <= max(tol, tol*max(|a|,|b|)); NaN only equals NaN; an infinity only itself
    assert (c.ok, c.n_mismatch, c.first_mismatch) == (False, 4, (1,))
    assert not compare_tensors(np.array([np.inf]), np.array([1e300]), 1e-3).ok
    assert c.max_abs_diff == np.inf
    finite = compare_tensors(a[:4], b[:4], tol)
    assert finite.n_mismatch == 2 and finite.max_abs_diff == pytest.approx(1.1, abs=1e-9)
    assert compare_tensors(np.array([np.nan]), np.array([np.nan]), 0.0).ok
    assert compare_tensors(np.zeros((0, 3)), np.zeros((0, 3)), tol) == compare_tensors(np.zeros(0), np.zeros(0), tol)
    with pytest.raises(ValueError, match=r"cannot compare shapes \(2,\) and \(3,\)"):
        compare_tensors(np.zeros(2), np.zeros(3), tol)


def test_agreement_reports_max_abs_diff_and_the_first_mismatch():
    fb = OK_PROB.copy()
    prim = OK_PROB.copy()
    prim[0, 0, 0, 1] += 0.0005
    r = check_agreement("prob", prim, fb, 1e-3)
    assert r.ok and r.reason == "ok" and r.max_abs_diff == pytest.approx(0.0005, abs=1e-7)
    prim[0, 0, 1, 3] += 0.25
    r = check_agreement("prob", prim, fb, 1e-3)
    assert not r.ok and not r.hard and r.max_abs_diff == pytest.approx(0.25, abs=1e-6)
    assert r.reason == ("prob: 1 value(s) differ from the fallback beyond tol 0.001 "
                        f"(max abs diff {r.max_abs_diff:g}, first at (0, 0, 1, 3))")
    r = check_agreement("prob", prim.reshape(1, 1, 4, 2), fb, 1e-3)
    assert r == CheckResult(Check.AGREEMENT, "prob", False,
                            "prob: primary shape (1, 1, 4, 2) != fallback shape (1, 1, 2, 4)", np.inf)


some_f32 = hnp.arrays(np.float32, st.integers(1, 6),
                      elements=st.floats(-1e6, 1e6, width=32) | st.just(float("nan")))


@given(some_f32, st.floats(0, 1))
def test_compare_is_reflexive_and_symmetric(a, tol):
    assert compare_tensors(a, a.copy(), tol).ok
    b = a[::-1].copy()
    assert compare_tensors(a, b, tol).ok == compare_tensors(b, a, tol).ok
    assert compare_tensors(a, b, tol).n_mismatch == compare_tensors(b, a, tol).n_mismatch


@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(allow_nan=True, allow_infinity=True),
       st.floats(0, 1))
def test_compare_matches_the_scalar_rule(x, y, tol):
    import math

    expect = (x == y) or (math.isnan(x) and math.isnan(y)) or (
        math.isfinite(x) and math.isfinite(y) and abs(x - y) <= max(tol, tol * max(abs(x), abs(y))))
    assert compare_tensors(np.array([x]), np.array([y]), tol).ok == expect


# ---------------------------------------------------------------- the whole report


def test_check_outputs_runs_every_check_in_order():
    contracts = contracts_from_specs([PROB], {"prob": (0.0, 1.0)})
    stale = StaleDetector()
    rep = check_outputs({"prob": OK_PROB}, contracts, inputs=_frame(1), stale=stale, reference={"prob": OK_PROB})
    assert rep.results == (ok(Check.PRESENT), ok(Check.SHAPE, "prob"), ok(Check.DTYPE, "prob"),
                           ok(Check.FINITE, "prob"), ok(Check.RANGE, "prob"), ok(Check.STALE),
                           CheckResult(Check.AGREEMENT, "prob", True, "ok", 0.0))
    assert rep.ok and rep.reason == "ok" and rep.first_failure is None
    assert (rep.agreement_checked, rep.primary_agrees, rep.max_abs_diff) == (True, True, 0.0)


def test_check_outputs_without_reference_or_stale_detector():
    rep = check_outputs({"prob": OK_PROB}, contracts_from_specs([PROB]))
    assert [r.check for r in rep.results] == [Check.PRESENT, Check.SHAPE, Check.DTYPE, Check.FINITE, Check.RANGE]
    assert (rep.agreement_checked, rep.primary_agrees, rep.max_abs_diff) == (False, False, 0.0)


def test_check_outputs_first_failure_is_the_reason():
    contracts = contracts_from_specs([PROB], {"prob": (0.0, 1.0)})
    bad = OK_PROB.copy()
    bad[0, 0, 0, 0] = np.nan
    bad[0, 0, 0, 1] = 2.0
    rep = check_outputs({"prob": bad}, contracts, reference={"prob": OK_PROB})
    assert not rep.ok
    assert rep.first_failure.check is Check.FINITE
    assert rep.reason == "prob: 1 non-finite value(s) (1 NaN, 0 inf), first at (0, 0, 0, 0)"
    assert [r.check for r in rep.results if not r.ok] == [Check.FINITE, Check.RANGE, Check.AGREEMENT]
    assert rep.agreement_checked and not rep.primary_agrees and rep.max_abs_diff == np.inf


def test_check_outputs_with_a_missing_output_never_raises():
    contracts = contracts_from_specs([PROB, TensorSpec("aux", (2,), "float32")])
    rep = check_outputs({"prob": OK_PROB}, contracts, reference={"prob": OK_PROB, "aux": np.zeros(2, np.float32)})
    assert rep.reason == "missing output(s) ['aux']"
    assert [r.check for r in rep.results] == [Check.PRESENT, Check.SHAPE, Check.DTYPE, Check.FINITE, Check.RANGE,
                                              Check.AGREEMENT]


def test_check_outputs_flags_a_stale_primary():
    contracts = contracts_from_specs([PROB])
    stale = StaleDetector()
    assert check_outputs({"prob": OK_PROB}, contracts, inputs=_frame(1), stale=stale).ok
    rep = check_outputs({"prob": OK_PROB.copy()}, contracts, inputs=_frame(2), stale=stale)
    assert rep.first_failure.check is Check.STALE and not rep.first_failure.hard


def test_stale_in_two_steps_compares_with_the_last_checked_frame():
    """The node sees the primary's input while the model computes (``see_input``) and checks the output when it
    comes (``check_output``): a frame whose output never came is not the one compared with."""
    d = StaleDetector()
    d.see_input(_frame(1))
    assert d.check_output({"prob": OK_PROB}).ok
    d.see_input(_frame(2))  # missed: its output never came
    d.see_input(_frame(1))  # the same input as the last checked frame: the same output is expected
    assert d.check_output({"prob": OK_PROB.copy()}).ok and d.run == 0
    d.see_input(_frame(3))
    r = d.check_output({"prob": OK_PROB.copy()})
    assert (r.ok, r.reason) == (False, "output identical to the previous frame's while the input changed (1 in a row)")


def test_stale_output_without_a_seen_input_passes_and_the_next_frame_is_a_first_one():
    """A reset between a frame's see_input and its output (a failover on the way) leaves no input for it."""
    d = StaleDetector()
    d.check(_frame(1), {"prob": OK_PROB})
    d.see_input(_frame(2))
    d.reset()
    assert d.check_output({"prob": OK_PROB.copy()}).ok
    d.see_input(_frame(3))  # judged as a first frame: nothing to compare its input with
    assert d.check_output({"prob": OK_PROB.copy()}).ok
    d.see_input(_frame(4))
    assert not d.check_output({"prob": OK_PROB.copy()}).ok  # from here on as ever


_BOUNDED_F32 = hnp.arrays(np.float32, (2, 3), elements=st.floats(-1.0, 1.0, width=32))


@given(_BOUNDED_F32, _BOUNDED_F32, st.sampled_from([0.0, 1e-3, 0.5]))
def test_a_bounded_compare_is_the_general_one(a, b, tol):
    """compare_tensors(bounded=True) (both sides checked finite and within the bound: no promotion, no error-state
    guard) gives the general compare's answer, field for field."""
    assert compare_tensors(a, b, tol, bounded=True) == compare_tensors(a, b, tol)
    assert compare_tensors(a, b.astype(np.float64), tol, bounded=True) == compare_tensors(a, b.astype(np.float64), tol)


def test_only_an_output_that_passed_a_narrow_range_against_a_checked_reference_compares_bounded(monkeypatch):
    from chestnut.node import validity

    assert [validity.OutputContract(TensorSpec("p", (2,), "float32"), r).bounded
            for r in ((0.0, 1.0), (-1e30, 1e30), (-1e31, 1.0), None)] == [True, True, False, False]
    seen: list[bool] = []
    compare = validity.compare_tensors

    def spy(a, b, tol, *, bounded=False):
        seen.append(bounded)
        return compare(a, b, tol, bounded=bounded)

    monkeypatch.setattr(validity, "compare_tensors", spy)
    contracts = contracts_from_specs([TensorSpec("p", (2,), "float32"), TensorSpec("q", (2,), "float32")],
                                     {"p": (0.0, 1.0)})
    out = {"p": np.array([0.25, 0.5], np.float32), "q": np.array([3.0, 4.0], np.float32)}
    ref = {"p": np.array([0.25, 0.5], np.float32), "q": np.array([3.0, 4.0], np.float32)}
    checked = validity.check_outputs(out, contracts, reference=ref, reference_checked=True)
    plain = validity.check_outputs(out, contracts, reference=ref)
    assert checked == plain and checked.ok
    assert seen == [True, False, False, False]  # p bounded only with a checked reference; q has no range
    seen.clear()
    validity.check_outputs({"p": np.array([0.25, 1.5], np.float32), "q": out["q"]}, contracts, reference=ref,
                           reference_checked=True)
    assert seen == [False, False]  # p failed its range: the general compare
