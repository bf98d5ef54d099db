"""The node's one declared output contract: from the primary model file and the node configuration.

Consumers of ``modelOutput`` (control daemons) must receive the same output names, shapes and dtypes
whichever model answers a frame, so the contract is declared once, when the node starts, from the
primary model file (``[model] path``, run once on the host CPU with onnxruntime at the configured
input shape) and the configuration (``[model] ranges``, ``timing.agreement_tol``); never from whichever
model happens to load first. Every source's outputs are checked against it on every frame
(:func:`chestnut.node.validity.check_outputs`).

- A ``[model.ranges]`` key naming an output the primary does not have is refused
  (:class:`~chestnut.backend.errors.ConfigError` naming the key).
- The fallback is checked against the contract when it loads (:meth:`DeclaredContract.difference`): one
  line naming the first difference (input or output names, shapes, dtypes) refuses it.
- *Known answer*: where a warm-up fingerprint is recorded (``backend/fingerprint.py``: the model's output
  on a fixed, seeded input, recorded on the host CPU), the file is run on that input here and compared
  with it (:func:`~chestnut.backend.fingerprint.compare`, openpilot process replay's tolerance). A file
  that fails is damaged, not the dock: it is refused for both roles (:func:`known_answer`).

The contract's *fingerprint* (:attr:`DeclaredContract.fingerprint`) is the first 16 hex digits of a
SHA-256 over its canonical JSON (:meth:`DeclaredContract.to_json` without the fingerprint); the node
writes the contract into its ``initData`` configuration under ``"contract"``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chestnut.backend.errors import ConfigError, ModelError
from chestnut.backend.fingerprint import FingerprintFileError, read_fingerprint_file
from chestnut.backend.model import TensorSpec
from chestnut.node.config import NodeConfig
from chestnut.node.validity import OutputContract, contracts_from_specs

UNCHECKED = "unchecked: no fingerprint recorded"
"""What the known-answer check says of a model file with no fingerprint recorded for it (:func:`file_identity`):
its bytes are run as they are, so a flipped weight that still parses goes unnoticed; its sha256 still says which
file it was."""


def describe_spec(s: TensorSpec) -> str:
    """``"prob float32[1, 1, 16, 32]"``."""
    return f"{s.name} {s.dtype}{list(s.shape)}"


def spec_difference(what: str, have: tuple[TensorSpec, ...], want: tuple[TensorSpec, ...]) -> str | None:
    """The first difference between two spec lists (``what``: "input" or "output"), in one phrase, or None:
    other names first (``outputs ['a'] != the contract's ['prob']``), then per name a shape, then a dtype."""
    names, want_names = sorted(s.name for s in have), sorted(s.name for s in want)
    if names != want_names:
        return f"{what}s {names} != the contract's {want_names}"
    by_name = {s.name: s for s in have}
    for w in want:
        h = by_name[w.name]
        if tuple(h.shape) != tuple(w.shape):
            return f"{what} {w.name!r} has shape {list(h.shape)}, the contract's is {list(w.shape)}"
        if h.dtype != w.dtype:
            return f"{what} {w.name!r} has dtype {h.dtype}, the contract's is {w.dtype}"
    return None


@dataclass(frozen=True)
class DeclaredContract:
    """The node's contract: the primary file it was declared from (``source``, its ``model_sha256`` and
    ``model_bytes``), the model's inputs and the per-output :class:`~chestnut.node.validity.OutputContract` (spec,
    value range, agreement tolerance), and what the known-answer check found (``known_answer``: one phrase)."""

    source: Path
    model_sha256: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[OutputContract, ...]
    known_answer: str = UNCHECKED
    model: Any = field(default=None, compare=False, repr=False)  # the loaded OrtModel (the fallback may reuse it)
    model_bytes: int = field(default=0, compare=False)  # the size of the file's bytes it was declared from

    @property
    def output_specs(self) -> tuple[TensorSpec, ...]:
        return tuple(c.spec for c in self.outputs)

    def body(self) -> dict[str, Any]:
        """The contract as JSON-ready data (what its fingerprint is taken over)."""
        return {
            "source": str(self.source),
            "model_sha256": self.model_sha256,
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [{**c.spec.to_json(), "range": list(c.value_range) if c.value_range else None, "tol": c.tol}
                        for c in self.outputs],
        }

    @property
    def fingerprint(self) -> str:
        """First 16 hex digits of SHA-256 over :meth:`body` as sorted-key compact JSON."""
        raw = json.dumps(self.body(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(raw).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        return {**self.body(), "fingerprint": self.fingerprint, "known_answer": self.known_answer}

    def describe(self) -> str:
        """``"x float32[1, 3, 32, 64] -> prob float32[1, 1, 16, 32]"``."""
        return (", ".join(describe_spec(s) for s in self.inputs) + " -> "
                + ", ".join(describe_spec(s) for s in self.output_specs))

    def difference(self, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> str | None:
        """How a model with ``inputs`` -> ``outputs`` differs from the contract (one phrase), or None."""
        return spec_difference("input", inputs, self.inputs) or spec_difference("output", outputs, self.output_specs)


def known_answer(model: Any, fingerprint: dict[str, Any] | None) -> tuple[bool, str]:
    """Run ``model`` (anything with ``inputs`` and ``run``: :class:`~chestnut.backend.model.OrtModel`) on the
    fingerprint's fixed input and compare (:func:`chestnut.backend.fingerprint.compare`). Returns (ok, one
    phrase); (True, :data:`UNCHECKED`) without one. A fingerprint recorded for other inputs than the
    model's (another shape) fails."""
    from chestnut.backend.fingerprint import compare, fixed_inputs

    if fingerprint is None:
        return True, UNCHECKED
    try:
        rec_inputs = {k: (list(v["shape"]), str(v["dtype"])) for k, v in dict(fingerprint["inputs"]).items()}
        seed = int(fingerprint["seed"])
    except (KeyError, TypeError, ValueError) as e:
        return False, f"the fingerprint is malformed ({type(e).__name__}: {e})"
    mine = {s.name: (list(s.shape), s.dtype) for s in model.inputs}
    if rec_inputs != mine:
        return False, f"the fingerprint was recorded for inputs {rec_inputs}, the model takes {mine}"
    try:
        outputs = model.run(fixed_inputs(model.inputs, seed))
    except Exception as e:  # ModelError, or the engine's own error classes
        return False, f"it cannot run the fingerprint's input: {type(e).__name__}: {e}"
    check = compare(fingerprint, outputs)
    return check.ok, ("matches its recorded fingerprint: " if check.ok else "does not match its recorded "
                      "fingerprint on the host CPU: ") + check.detail


class ContractError(ModelError):
    """The contract cannot be declared, or a model is refused against it (``detail``: the one line)."""


def declare_contract(cfg: NodeConfig, fingerprint: dict[str, Any] | None) -> DeclaredContract:
    """The node's contract from ``cfg.model`` (its file run once on onnxruntime, one thread, at ``model.shape``)
    and ``cfg.model.ranges`` / ``cfg.timing.agreement_tol``. ``fingerprint``: the primary's recorded warm-up
    fingerprint, or None.

    Raises :class:`~chestnut.backend.errors.ConfigError` for a ``model.input`` the primary has no input of (its
    inputs named, ``backend/model.py`` ``unknown_input``) or a ``model.ranges`` key the primary does not
    output, and :class:`ContractError` for a primary file that cannot be read or run, or that fails its
    known-answer check (:func:`known_answer`)."""
    from chestnut.backend.model import OrtModel

    m = cfg.model
    try:
        model = OrtModel(m.path, name=m.name, input_shapes={m.input: tuple(m.shape)}, threads=1)
    except ModelError as e:
        if e.reason in ("missing_model", "untrusted_model"):  # the file itself: the line says only that
            raise ContractError("no_contract", f"the primary model declares the output contract, and its "
                                               f"{' '.join(e.detail.split())}") from e
        if e.reason != "unknown_input":
            raise ContractError("no_contract", f"the primary model declares the output contract and cannot be run at "
                                               f"model.shape {list(m.shape)}: {' '.join(e.detail.split())}") from e
        raise ConfigError("config", f"model.input = {m.input!r}: {e.detail}; name one of its inputs") from e
    except Exception as e:  # onnxruntime's own (an input shape the graph does not take): it names no file
        raise ContractError("no_contract", f"the primary model {m.path} declares the output contract and cannot be "
                                           f"run at model.shape {list(m.shape)}: {type(e).__name__}: "
                                           f"{' '.join(str(e).split())}") from e
    outputs = tuple(model.outputs)
    names = [s.name for s in outputs]
    ranges = dict(m.ranges)
    for key in list(ranges):
        if key in names:
            continue
        if not m.ranges_given:  # the built-in default (the PP-OCRv4 detector's output): only for a model that has it
            del ranges[key]
            continue
        raise ConfigError("config", f"model.ranges.{key}: the primary model {m.path} has no output {key!r} "
                                    f"(its outputs: {', '.join(names)})")
    ok, phrase = known_answer(model, fingerprint)
    if not ok:
        raise ContractError("known_answer", f"the model file {m.path} {phrase}: the file is damaged or not the one "
                                            "the fingerprint was recorded for; refused as primary and as fallback")
    return DeclaredContract(Path(m.path), model.sha256, tuple(model.inputs),
                            contracts_from_specs(outputs, ranges, cfg.timing.agreement_tol), phrase, model,
                            len(model.onnx_bytes))


def file_identity(role: str, path: Path, sha256: str, nbytes: int, check: str) -> dict[str, str]:
    """The identity of a model file the node runs, for ``initData`` / ``nodeState`` ``identity`` beside the host's
    and the dock's (``msgs/chestnut.capnp``): ``<role>_file`` (the path as given), ``<role>_sha256`` (of the bytes
    the node loaded), ``<role>_bytes`` and ``<role>_check`` (its known-answer phrase, or :data:`UNCHECKED`).
    ``role``: ``model`` (the primary, ``[model] path``) or ``fallback`` (a ``[fallback] path`` of its own)."""
    return {f"{role}_file": str(path), f"{role}_sha256": sha256, f"{role}_bytes": str(nbytes), f"{role}_check": check}


def describe_file(role: str, path: Path, sha256: str, nbytes: int, check: str, fp_path: Path) -> str:
    """The log line that identifies a model file at start: its path, size and sha256, and what its known-answer
    check found; an unchecked file names where its fingerprint would be (``chestnut probe --record-fingerprint``
    writes one)."""
    what = "model" if role == "model" else "fallback model"
    head = f"{what} file {path}: {nbytes} bytes, sha256 {sha256}"
    if check == UNCHECKED:
        return (f"{head}; {UNCHECKED} (none at {fp_path}): its weights are not checked, only identified by this "
                "sha256")
    return f"{head}; {check}"


def check_fallback(contract: DeclaredContract, fallback: Any, path: Path) -> tuple[str | None, str]:
    """(the one line that refuses ``fallback`` or None, what its known-answer check found) for ``fallback`` (a
    loaded :class:`~chestnut.fallback.standby.FallbackModel`, read from ``path``): its inputs and outputs must be
    the contract's (:meth:`DeclaredContract.difference`), and a file other than the primary's that has a
    fingerprint recorded beside it (``<path>.fingerprint.json``) must match it (:func:`known_answer`; the
    primary's own file passed its check when the contract was declared: its phrase is the contract's). A file
    with no fingerprint beside it is :data:`UNCHECKED`."""
    diff = contract.difference(tuple(fallback.inputs), tuple(fallback.outputs))
    if diff is not None:
        return (f"fallback model {path} refused: {diff} (the contract is declared by the primary model "
                f"{contract.source}: {contract.describe()})"), ""
    if fallback.sha256 == contract.model_sha256:
        return None, contract.known_answer
    fp_path = Path(path).with_suffix(".fingerprint.json")
    try:
        fp = read_fingerprint(fp_path)
    except ConfigError as e:
        return f"fallback model {path} refused: its fingerprint {e.detail}", ""
    if fp is None:
        return None, UNCHECKED
    ok, phrase = known_answer(fallback, fp)
    return (None, phrase) if ok else (f"fallback model {path} refused: it {phrase}", phrase)


def fallback_refusal(contract: DeclaredContract, fallback: Any, path: Path) -> str | None:
    """The one line that refuses ``fallback`` (read from ``path``), or None when it may serve
    (:func:`check_fallback`)."""
    return check_fallback(contract, fallback, path)[0]


def read_fingerprint(path: Path) -> dict[str, Any] | None:
    """The recorded fingerprint at ``path``, or None when nothing is there (the model is :data:`UNCHECKED`), read
    by the one bounded reader (``backend/fingerprint.py`` ``read_fingerprint_file``: a regular file, never a
    symlink, of at most ``FINGERPRINT_MAX_BYTES``, 1 MiB, refused from its size before it is read). Raises
    ConfigError ``fingerprint`` for anything else at ``path``, one line: ``"<path> is unreadable: it is N bytes,
    over the 1048576 a fingerprint may hold"``, ``"... it is a symlink, not a regular file"``, ``"... it does
    not read as JSON"``."""
    try:
        return read_fingerprint_file(path)
    except FingerprintFileError as e:
        if e.reason == "missing":
            return None
        raise ConfigError("fingerprint", f"{path} is unreadable: it {e.problem}") from None


def start_problem(cfg: NodeConfig) -> str | None:
    """The one line that stops a node with configuration ``cfg`` from starting, found before anything starts
    (``chestnut launch``), or None: a ``model.input`` the primary has no input of, a ``model.ranges`` key the
    primary does not output, a primary file that
    fails its known-answer check, or a fallback that is not of the contract while ``fallback.required``. A file
    that is missing or cannot be loaded is the node's own to name (None). The fallback is read with onnxruntime
    whatever its engine (the output specs do not depend on it; this process must not import tinygrad)."""
    from chestnut.backend.model import OrtModel

    try:
        contract = declare_contract(cfg, read_fingerprint(cfg.fingerprint_path))
    except ConfigError as e:
        return e.detail or str(e)
    except ContractError as e:
        return None if e.reason == "no_contract" else e.detail
    if not cfg.fallback.required:
        return None
    try:
        fallback = OrtModel(cfg.fallback_path, input_shapes={cfg.model.input: tuple(cfg.model.shape)}, threads=1)
    except Exception:  # ModelError or onnxruntime's own: the node's own load names it
        return None
    return fallback_refusal(contract, fallback, cfg.fallback_path)
