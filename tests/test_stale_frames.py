"""A node that falls behind answers a frame read over ``timing.max_frame_age_ms`` after its EOF at once,
without a model: ``valid`` False, source none, a reason naming the age and the bound; counted, logged once a
second, the output layer WARN while it happens, one output per frame (``node/main.py`` ``_stale_frame``)."""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np
import pytest
from nodeharness import running_node, write_node_config

from chestnut.backend.errors import ConfigError
from chestnut.launch.camerad import fill_frame
from chestnut.node.config import NodeConfig, validate
from chestnut.node.main import stale_frame_reason

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]
MS = 1_000_000


def test_the_reason_names_the_age_and_the_bound():
    now = 50_000 * MS
    assert stale_frame_reason(now - 2500 * MS, now, 1000.0) == (
        "stale frame: read 2500 ms after its EOF (bound 1000 ms); the node is behind"
    )
    assert stale_frame_reason(now - 1000 * MS, now, 1000.0) == ""  # at the bound: still served
    assert stale_frame_reason(now - 1001 * MS, now, 1000.0).startswith("stale frame: read 1001 ms")
    assert stale_frame_reason(0, now, 1000.0) == ""  # age unknown: frame_clock says so, not this
    assert stale_frame_reason(now + 5 * MS, now, 1000.0) == ""
    # its message's logMonoTime tells who was late: published in time and read late, the node
    assert stale_frame_reason(now - 2500 * MS, now, 1000.0, sent_ns=now - 2490 * MS) == (
        "stale frame: read 2500 ms after its EOF (bound 1000 ms); the node is behind"
    )
    # published over the bound after its EOF, the camera (a late camera, or a wrong stamp)
    assert stale_frame_reason(now - 2500 * MS, now, 1000.0, sent_ns=now - 3 * MS) == (
        "stale frame: read 2500 ms after its EOF (bound 1000 ms); its camera published it 2497 ms after that EOF: "
        "the camera is late or its stamp wrong, not the node"
    )
    # a logMonoTime in the future or before the EOF is no evidence: the node's, as with none
    for sent in (now + 5 * MS, now - 3000 * MS):
        assert stale_frame_reason(now - 2500 * MS, now, 1000.0, sent_ns=sent).endswith("; the node is behind")


def test_the_bound_must_be_at_least_the_deadline():
    cfg = NodeConfig()
    assert cfg.timing.max_frame_age_ms == 1000.0
    cfg.timing.deadline_ms = 1000.0
    cfg.timing.max_frame_age_ms = 1000.0
    assert validate(cfg).timing.max_frame_age_ms == 1000.0  # a bound equal to the deadline is allowed
    cfg.timing.deadline_ms, cfg.timing.max_frame_age_ms = 150.0, 149.0
    with pytest.raises(
        ConfigError, match=re.escape("timing.max_frame_age_ms = 149.0; want at least timing.deadline_ms (150.0)")
    ):
        validate(cfg)


def _frame(fid: int) -> np.ndarray:
    return np.random.default_rng(fid).integers(0, 256, (32, 64, 3), dtype=np.uint8)


def test_stale_frames_are_answered_without_a_model_and_the_output_layer_warns(tmp_path, tiny_onnx):
    aged: set[int] = set()  # frame ids sent with an EOF 3 s in the past

    def frames(fid: int) -> Any:
        if fid in aged:
            now = time.monotonic_ns()
            return fill_frame(fid, _frame(fid), now - 3050 * MS, now - 3000 * MS, "behind")
        return _frame(fid)

    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, dock="cpu")
    with running_node(cfg, tmp_path / "node.log", frames) as (node, bus):
        bus.wait_for(
            lambda r: (
                r
                if len(r.outputs) > 3
                and all(o.source == "primary" for o in r.outputs[-3:])
                and r.active
                and r.active[-1].active
                else None
            ),
            60.0,
            "the primary serving",
        )
        first = bus.next_frame_id + 2
        aged.update(range(first, first + 4))
        t0 = time.monotonic_ns()
        last = first + 10
        rec = bus.wait_for(lambda r: r if any(o.frame_id >= last for o in r.outputs) else None, 30.0, "more frames")
        warn = bus.wait_for(
            lambda r: next(
                (
                    h
                    for h in r.health
                    if h.mono_ns >= t0
                    and h.layers["output"][0] == "warn"
                    and h.layers["output"][1].startswith("stale frame")
                ),
                None,
            ),
            10.0,
            "output WARN",
        )
        log = node.log_tail()
    by_id: dict[int, list[Any]] = {}
    for o in rec.outputs:
        by_id.setdefault(o.frame_id, []).append(o)
    assert all(len(v) == 1 for v in by_id.values()), "one output per frame"
    # sent now with an EOF 3 s old: the camera's lateness, not the node's
    want = re.compile(r"stale frame: read 30\d\d ms after its EOF \(bound 1000 ms\); its camera published it "
                      r"30\d\d ms after that EOF: the camera is late or its stamp wrong, not the node")
    for fid in range(first, first + 4):
        (o,) = by_id[fid]
        assert (o.source, o.valid, o.deadline_missed, o.exec_s) == ("none", False, False, 0.0), o
        assert want.fullmatch(o.reason), o.reason
        assert o.frame_age_s >= 3.0
    assert want.fullmatch(warn.layers["output"][1]), warn
    fresh = [by_id[f][0] for f in range(first - 2, last + 1) if f not in aged and f in by_id]
    assert fresh and all(o.valid and o.source in ("primary", "fallback") for o in fresh), fresh
    drops = [a for a in rec.active if not a.active and a.reason.startswith("output WARN: stale frame")]
    assert drops and want.fullmatch(drops[0].reason.removeprefix("output WARN: ")), rec.active[-8:]
    lines = [ln for ln in log.splitlines() if "answered without a model" in ln]
    assert len(lines) >= 1 and lines[0].endswith("not the node; answered without a model (1 such frames so far)")
    assert re.search(rf"cameraFrame {first}: stale frame: read 30\d\d ms", lines[0]), lines[0]
    assert len(lines) <= 2  # 4 frames in 0.2 s: logged at most once a second
