"""Output validity: the checks behind the ``output`` health layer (:mod:`chestnut.node.health`), for every source.

Each check returns a :class:`CheckResult` with a precise, human-readable reason. The checks, in the
order :func:`check_outputs` runs them:

============  ===========================================================  ========
check         passes when                                                  severity
============  ===========================================================  ========
present       exactly the declared output names came back                  hard
shape         the tensor's shape equals the declared ``TensorSpec.shape``  hard
dtype         the tensor's dtype equals the declared ``TensorSpec.dtype``  hard
finite        no NaN and no +-inf (openpilot modeld fails over on these)   hard
range         every finite value lies in the declared ``[lo, hi]``         hard
stale         not (output identical to the previous one while the input    soft
              changed), both compared byte for byte
agreement     ``|a-b| <= max(tol, tol*max(|a|,|b|))`` element-wise against  soft
              the fallback's output (openpilot process replay's tolerance;
              NaN equals only NaN)
============  ===========================================================  ========

*Hard* failures make the output layer ERROR at once; *soft* ones are debounced by
:mod:`chestnut.node.health` (a bit-identical output on a changed input, or a disagreement within
float noise of the tolerance, can happen once without a fault; a run of them cannot).
Whatever the severity, a frame whose output fails any check is not served from the primary.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from chestnut.backend.model import TensorSpec

DEFAULT_AGREEMENT_TOL = 1e-3
"""Default primary-vs-fallback tolerance (absolute below 1, relative above). Our choice: the
dock's GPU and the host CPU round differently; PP-OCRv4 through tinygrad matches onnxruntime to
~2e-5 (``chestnut model prepare`` checks it), so 1e-3 leaves room for a GPU's reordering.
Configure it per output."""


class Check(StrEnum):
    PRESENT = "present"
    SHAPE = "shape"
    DTYPE = "dtype"
    FINITE = "finite"
    RANGE = "range"
    STALE = "stale"
    AGREEMENT = "agreement"


HARD_CHECKS: frozenset[Check] = frozenset({Check.PRESENT, Check.SHAPE, Check.DTYPE, Check.FINITE, Check.RANGE})
"""Checks whose failure expires at once (no debouncing); the others are debounced by health."""


@dataclass(frozen=True)
class CheckResult:
    """One check on one output tensor (``output`` is ``""`` for checks over the whole output set)."""

    check: Check
    output: str
    ok: bool
    reason: str
    max_abs_diff: float = 0.0  # agreement only: largest |primary - fallback|; inf for a NaN mismatch

    @property
    def hard(self) -> bool:
        """True when a failure of this check expires at once (see :data:`HARD_CHECKS`)."""
        return self.check in HARD_CHECKS


BOUNDED_MAGNITUDE = 1e30
"""A contract range within +-this (and a tensor that passed it) bounds both sides of an agreement compare so far
below float32's largest (3.4e38) that their difference cannot overflow: :func:`compare_tensors` ``bounded``."""


@dataclass(frozen=True)
class OutputContract:
    """The declared contract of one output: its spec, an optional value range and the agreement tolerance.

    ``value_range`` is inclusive ``(lo, hi)``, e.g. ``(0.0, 1.0)`` for a probability map; ``None``
    means unbounded. ``tol`` is the primary-vs-fallback tolerance for this output.
    """

    spec: TensorSpec
    value_range: tuple[float, float] | None = None
    tol: float = DEFAULT_AGREEMENT_TOL
    # made once from ``spec`` (every frame's checks read them): its name, shape and numpy dtype (None for a dtype
    # name numpy does not know: :func:`check_dtype` then raises as it did), and the four per-tensor checks passed
    name: str = field(init=False, repr=False, compare=False)
    shape: tuple[int, ...] = field(init=False, repr=False, compare=False)
    dtype: np.dtype | None = field(init=False, repr=False, compare=False)
    passed: tuple[CheckResult, ...] = field(init=False, repr=False, compare=False)
    bounded: bool = field(init=False, repr=False, compare=False)
    """Its range lies within +-:data:`BOUNDED_MAGNITUDE` (an output that passed it compares ``bounded``)."""

    def __post_init__(self) -> None:
        name = self.spec.name
        try:
            dtype: np.dtype | None = np.dtype(self.spec.dtype)
        except TypeError:
            dtype = None
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shape", tuple(self.spec.shape))
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "passed", tuple(_ok(c, name) for c in (Check.SHAPE, Check.DTYPE, Check.FINITE,
                                                                           Check.RANGE)))
        r = self.value_range
        object.__setattr__(self, "bounded", r is not None and max(abs(r[0]), abs(r[1])) <= BOUNDED_MAGNITUDE)


def contracts_from_specs(specs: Iterable[TensorSpec], ranges: Mapping[str, tuple[float, float]] | None = None,
                         tol: float = DEFAULT_AGREEMENT_TOL) -> tuple[OutputContract, ...]:
    """One :class:`OutputContract` per spec, with ``ranges[name]`` where given. Raises ``ValueError``
    for a range whose ``lo > hi`` or a range naming an undeclared output."""
    specs = tuple(specs)
    ranges = dict(ranges or {})
    unknown = sorted(set(ranges) - {s.name for s in specs})
    if unknown:
        raise ValueError(f"value range given for undeclared output(s) {unknown}")
    for name, (lo, hi) in ranges.items():
        if lo > hi:
            raise ValueError(f"value range of {name!r} is empty: lo={lo} > hi={hi}")
    return tuple(OutputContract(s, ranges.get(s.name), tol) for s in specs)


@functools.lru_cache(maxsize=1024)
def _ok(check: Check, output: str) -> CheckResult:
    """The passed ``check`` of ``output`` (immutable, so made once per pair: every frame passes the same checks)."""
    return CheckResult(check, output, True, "ok")


def _index(arr: np.ndarray, flat: int) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, arr.shape)) if arr.ndim else ()


def check_present(outputs: Mapping[str, np.ndarray], contracts: Iterable[OutputContract]) -> CheckResult:
    """Exactly the declared names: reports missing and undeclared outputs (sorted)."""
    declared = {c.name for c in contracts}
    if outputs.keys() == declared:  # the common case in one comparison
        return _ok(Check.PRESENT, "")
    missing, extra = sorted(declared - set(outputs)), sorted(set(outputs) - declared)
    if not missing and not extra:
        return _ok(Check.PRESENT, "")
    parts = ([f"missing output(s) {missing}"] if missing else []) + ([f"undeclared output(s) {extra}"] if extra else [])
    return CheckResult(Check.PRESENT, "", False, "; ".join(parts))


def check_shape(name: str, arr: np.ndarray, spec: TensorSpec) -> CheckResult:
    if tuple(arr.shape) == tuple(spec.shape):
        return _ok(Check.SHAPE, name)
    return CheckResult(Check.SHAPE, name, False, f"{name}: shape {tuple(arr.shape)} != declared {tuple(spec.shape)}")


def check_dtype(name: str, arr: np.ndarray, spec: TensorSpec) -> CheckResult:
    if arr.dtype == np.dtype(spec.dtype):
        return _ok(Check.DTYPE, name)
    declared = np.dtype(spec.dtype).name
    return CheckResult(Check.DTYPE, name, False, f"{name}: dtype {arr.dtype.name} != declared {declared}")


def _finite_and_in_range(arr: np.ndarray, value_range: tuple[float, float] | None) -> bool:
    """True when every value of a float tensor is finite and in the inclusive ``value_range`` (None: any),
    from its minimum and maximum alone (a NaN makes both NaN, an infinity one of them infinite); False
    sends the caller to :func:`check_finite` and :func:`check_range` for the reasons. Other dtypes and empty
    tensors: False (the full checks are as cheap there)."""
    if arr.dtype.kind != "f" or arr.size == 0:
        return False
    lo_v, hi_v = float(arr.min()), float(arr.max())
    if not (math.isfinite(lo_v) and math.isfinite(hi_v)):
        return False
    return value_range is None or (value_range[0] <= lo_v and hi_v <= value_range[1])


def check_finite(name: str, arr: np.ndarray) -> CheckResult:
    """No NaN and no +-inf. Integer and bool tensors are finite by construction."""
    if arr.dtype.kind not in "fc" or bool(np.isfinite(arr).all()):
        return _ok(Check.FINITE, name)
    bad = ~np.isfinite(arr)
    n_nan = int(np.count_nonzero(np.isnan(arr)))
    n_inf = int(np.count_nonzero(bad)) - n_nan
    first = _index(arr, int(np.flatnonzero(bad)[0]))
    return CheckResult(Check.FINITE, name, False,
                       f"{name}: {n_nan + n_inf} non-finite value(s) ({n_nan} NaN, {n_inf} inf), first at {first}")


def check_range(name: str, arr: np.ndarray, value_range: tuple[float, float] | None) -> CheckResult:
    """Every value in the inclusive ``value_range``; NaN is not counted here (:func:`check_finite` is)."""
    if value_range is None or arr.size == 0:
        return _ok(Check.RANGE, name)
    lo, hi = value_range
    bad = (arr < lo) | (arr > hi)
    n = int(np.count_nonzero(bad))
    if n == 0:
        return _ok(Check.RANGE, name)
    vals = arr[bad]
    first = _index(arr, int(np.flatnonzero(bad)[0]))
    return CheckResult(Check.RANGE, name, False,
                       f"{name}: {n} value(s) outside [{lo:g}, {hi:g}] (min {float(vals.min()):g}, "
                       f"max {float(vals.max()):g}), first at {first}")


Tensors = Mapping[str, np.ndarray]


class _Held:
    """A copy of the tensors last shown, kept in buffers reused from frame to frame (no allocation once
    warm), compared byte for byte: equal only with the same names, shapes, dtypes and bytes."""

    __slots__ = ("arrays",)

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] | None = None

    def same(self, tensors: Tensors) -> bool:
        held = self.arrays
        if held is None or held.keys() != tensors.keys():
            return False
        for name, old in held.items():
            new = np.asarray(tensors[name])
            if new.shape != old.shape or new.dtype != old.dtype:
                return False
            if new.size and new.tobytes() != old.tobytes():  # C-order bytes, one memcmp
                return False
        return True

    def hold(self, tensors: Tensors) -> None:
        held = self.arrays if self.arrays is not None and self.arrays.keys() == tensors.keys() else {}
        for name, arr in tensors.items():
            new = np.asarray(arr)
            old = held.get(name)
            if old is not None and old.shape == new.shape and old.dtype == new.dtype:
                np.copyto(old, new, casting="no")
            else:
                held[name] = np.array(new, order="C")
        self.arrays = held


class StaleDetector:
    """Flags an output identical to the previous one while the input changed (one detector per model).

    Inputs and outputs are compared byte for byte with the last *checked* frame's (copies held in buffers
    reused from frame to frame: for a 24 KB input and a 2 KB output, two compares and two copies cost less than
    hashing both, and they are exact: no digest to collide). In two steps, so that the input's half runs while
    the model computes: :meth:`see_input` (before the outputs exist: right after the primary's request is sent)
    and :meth:`check_output`; :meth:`check` does both. A frame whose output never comes (a miss) leaves the
    previous checked frame the one compared with. The first frame, and any frame whose input equals the previous
    one's, pass. ``run`` counts consecutive stale frames.
    """

    def __init__(self) -> None:
        self._prev_input = _Held()   # the last checked frame's
        self._next_input = _Held()   # the frame seen by see_input, held until its output is checked
        self._prev_output = _Held()
        self.reset()

    def reset(self) -> None:
        """Forget the previous frame (call when a new worker or model starts)."""
        self._prev_input.arrays = None
        self._prev_output.arrays = None
        self._seen: bool | None = None  # the seen input differs from the previous checked one; None: none seen
        self.run = 0

    def see_input(self, inputs: Tensors) -> None:
        """This frame's model inputs (name -> array, any shape and dtype), before its outputs are checked."""
        changed = self._prev_input.arrays is not None and not self._prev_input.same(inputs)
        if changed or self._prev_input.arrays is None:
            self._next_input.hold(inputs)
        self._seen = changed

    def check_output(self, outputs: Tensors) -> CheckResult:
        """This frame's outputs against the previous checked frame's, its input given by the last
        :meth:`see_input`; without one since the last check (a :meth:`reset` in between) a first frame's: it
        passes."""
        seen, self._seen = self._seen, None
        stale = bool(seen) and self._prev_output.same(outputs)
        if seen is None:  # no input for this output: the next frame is judged as a first one
            self._prev_input.arrays = None
        elif seen or self._prev_input.arrays is None:  # the seen input becomes the previous one (swap: no copy)
            self._prev_input, self._next_input = self._next_input, self._prev_input
        self._prev_output.hold(outputs)
        if not stale:
            self.run = 0
            return _ok(Check.STALE, "")
        self.run += 1
        return CheckResult(Check.STALE, "", False,
                           f"output identical to the previous frame's while the input changed ({self.run} in a row)")

    @property
    def last_output(self) -> Mapping[str, np.ndarray] | None:
        """The last checked frame's outputs (the detector's own copies: read them, never write them), or None."""
        return self._prev_output.arrays

    def check(self, inputs: Tensors, outputs: Tensors) -> CheckResult:
        """:meth:`see_input` then :meth:`check_output`, for a frame whose inputs and outputs are both in hand."""
        self.see_input(inputs)
        return self.check_output(outputs)


@dataclass(frozen=True)
class Comparison:
    """Element-wise comparison of two tensors under openpilot's replay tolerance."""

    ok: bool
    max_abs_diff: float  # inf when one side is NaN where the other is not, or inf vs finite
    n_mismatch: int
    first_mismatch: tuple[int, ...] | None


def compare_tensors(a: np.ndarray, b: np.ndarray, tol: float, *, bounded: bool = False) -> Comparison:
    """``|a-b| <= max(tol, tol*max(|a|,|b|))`` element-wise (openpilot process replay).

    Computed in the wider float type of the two (at least float32: float32 outputs are compared in
    float32, float64 ones in float64). Equal values always match; NaN matches only NaN and an
    infinity only the same infinity (taken literally, ``tol*max(|a|,|b|)`` would be infinite and let
    +inf match anything). Shapes must be equal (raises ``ValueError`` otherwise: the caller checks
    shapes first). The common case (everything finite and within tolerance) takes one fast pass.
    ``bounded``: the caller checked both tensors finite and within +-:data:`BOUNDED_MAGNITUDE` (an output that
    passed a contract range that narrow, and the reference the same contract's checked output): of one float
    dtype, they are then compared without numpy's type promotion or error-state guard (neither can be needed:
    no operand is NaN or infinite and no difference overflows), which at 20 Hz, on caches each frame finds cold,
    cost more than the compare itself (``docs/architecture.md``); the result is the same.
    """
    if a.shape != b.shape:
        raise ValueError(f"cannot compare shapes {a.shape} and {b.shape}")
    if bounded and a.dtype == b.dtype and a.dtype.kind == "f" and a.dtype.itemsize >= 4 and a.size:
        diff = np.subtract(a, b)
        np.abs(diff, out=diff)
        dmax = float(diff.max())
        if dmax <= float(a.dtype.type(tol)):
            return Comparison(True, dmax, 0, None)
    dt = np.result_type(a.dtype, b.dtype, np.float32)
    x, y = np.asarray(a, dtype=dt), np.asarray(b, dtype=dt)
    if x.size == 0:
        return Comparison(True, 0.0, 0, None)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.subtract(x, y)
        np.abs(diff, out=diff)
        if dt.kind == "f":  # every difference within the bound's floor (tol in the type compared in): no bound
            dmax = float(diff.max())
            if dmax <= float(dt.type(tol)) and math.isfinite(dmax):  # NaN compares False
                return Comparison(True, dmax, 0, None)
        bound = np.abs(x)
        np.maximum(bound, np.abs(y), out=bound)
        bound *= tol
        np.maximum(bound, tol, out=bound)
        if bool(np.less_equal(diff, bound).all()):  # NaN compares False; an infinity shows up in the max below
            dmax = float(diff.max())
            if np.isfinite(dmax):
                return Comparison(True, dmax, 0, None)
    return _compare_slow(x, y, tol)


def _compare_slow(x: np.ndarray, y: np.ndarray, tol: float) -> Comparison:
    """:func:`compare_tensors` with NaN and infinity handling and the mismatch details."""
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(x - y)
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        bound = np.maximum(tol, tol * np.maximum(np.abs(x), np.abs(y)))
        match = same | (np.isfinite(x) & np.isfinite(y) & (diff <= bound))
    diff[same] = 0.0
    diff[np.isnan(diff)] = np.inf  # NaN against a number
    n_mismatch = int(match.size - np.count_nonzero(match))
    first = _index(x, int(np.flatnonzero(~match)[0])) if n_mismatch else None
    return Comparison(n_mismatch == 0, float(diff.max()) if diff.size else 0.0, n_mismatch, first)


def check_agreement(name: str, primary: np.ndarray, fallback: np.ndarray, tol: float,
                    bounded: bool = False) -> CheckResult:
    """The primary's tensor against the fallback's under :func:`compare_tensors` (``bounded``: its own);
    reports the max abs diff."""
    if primary.shape != fallback.shape:
        return CheckResult(Check.AGREEMENT, name, False,
                           f"{name}: primary shape {primary.shape} != fallback shape {fallback.shape}", np.inf)
    c = compare_tensors(primary, fallback, tol, bounded=bounded)
    if c.ok:
        return CheckResult(Check.AGREEMENT, name, True, "ok", c.max_abs_diff)
    return CheckResult(Check.AGREEMENT, name, False,
                       f"{name}: {c.n_mismatch} value(s) differ from the fallback beyond tol {tol:g} "
                       f"(max abs diff {c.max_abs_diff:g}, first at {c.first_mismatch})", c.max_abs_diff)


@dataclass(frozen=True)
class ValidityReport:
    """All check results for one frame's output, in the order they ran."""

    results: tuple[CheckResult, ...]
    # made once from ``results`` (each is read several times a frame)
    ok: bool = field(init=False, repr=False, compare=False)
    """Every check passed."""
    agreement_checked: bool = field(init=False, repr=False, compare=False)
    """Whether the primary was compared with the fallback (``modelOutput.agreementChecked``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ok", all(r.ok for r in self.results))
        object.__setattr__(self, "agreement_checked", any(r.check is Check.AGREEMENT for r in self.results))

    @property
    def first_failure(self) -> CheckResult | None:
        return next((r for r in self.results if not r.ok), None)

    @property
    def reason(self) -> str:
        """The first failure's reason, or ``"ok"``."""
        f = self.first_failure
        return f.reason if f is not None else "ok"

    @property
    def primary_agrees(self) -> bool:
        """All agreement checks passed (``modelOutput.primaryAgrees``); False when none ran."""
        if not self.agreement_checked:
            return False
        agr = [r for r in self.results if r.check is Check.AGREEMENT]
        return bool(agr) and all(r.ok for r in agr)

    @property
    def max_abs_diff(self) -> float:
        """Largest |primary - fallback| over all outputs (``modelOutput.maxAbsDiff``); 0 when none compared."""
        if not self.agreement_checked:
            return 0.0
        return max((r.max_abs_diff for r in self.results if r.check is Check.AGREEMENT), default=0.0)


def check_outputs(outputs: Mapping[str, np.ndarray], contracts: Iterable[OutputContract], *,
                  inputs: Tensors | None = None, stale: StaleDetector | None = None,
                  reference: Mapping[str, np.ndarray] | None = None,
                  reference_checked: bool = False) -> ValidityReport:
    """Run every check on one frame's output (see the module table for order and severity).

    ``stale`` enables the stale check, against ``inputs`` (the frame's model inputs) or, without them, the input
    the detector saw last (:meth:`StaleDetector.see_input`);
    ``reference`` (the fallback's outputs for the same frame) enables the agreement check for every
    declared output present in both; ``reference_checked``: the reference passed these same contracts (the node's
    valid fallback output, ``node/policy.py`` ``agreement_reference``), so an output that passed a range within
    +-:data:`BOUNDED_MAGNITUDE` is compared ``bounded`` (:func:`compare_tensors`). Never raises for bad output
    data: every problem is a result.
    """
    contracts = tuple(contracts)
    results = [check_present(outputs, contracts)]
    bounded: set[str] = set()  # outputs that passed a range narrow enough for a bounded compare
    for c in contracts:
        arr = outputs.get(c.name)
        if arr is None:
            continue
        arr = np.asarray(arr)
        fine = _finite_and_in_range(arr, c.value_range)  # the common case in two reductions, no temporaries
        if fine and arr.shape == c.shape and c.dtype is not None and arr.dtype == c.dtype:
            results += c.passed  # the four passed checks, made once per contract
            if reference_checked and c.bounded:
                bounded.add(c.name)
            continue
        results.append(check_shape(c.name, arr, c.spec))
        results.append(check_dtype(c.name, arr, c.spec))
        if fine:
            results.append(_ok(Check.FINITE, c.name))
            results.append(_ok(Check.RANGE, c.name))
        else:
            results.append(check_finite(c.name, arr))
            results.append(check_range(c.name, arr, c.value_range))
    if stale is not None:
        results.append(stale.check(inputs, outputs) if inputs is not None else stale.check_output(outputs))
    if reference is not None:
        for c in contracts:
            if c.name in outputs and c.name in reference:
                results.append(check_agreement(c.name, np.asarray(outputs[c.name]), np.asarray(reference[c.name]),
                                               c.tol, c.name in bounded))
    return ValidityReport(tuple(results))
