"""The kit's bookkeeping without a dock: the twin it starts runs the onnxruntime program engine (as
``chestnut launch`` does, 20 Hz on a small host), and every planned step it did not reach is in report.json as
"not run", naming the step that failed."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from chestnut.backend.sim import client as sim_client
from chestnut.launch import acceptance as A


class FakeDaemon:
    started: list[list[str]] = []

    def __init__(self, prefix: str, args: list[str] = ()) -> None:  # type: ignore[assignment]
        self.args = list(args)

    def start(self) -> FakeDaemon:
        FakeDaemon.started.append(self.args)
        return self

    def client(self) -> Any:
        return argparse.Namespace(close_connection=lambda: None)

    def stop(self) -> None:
        pass


def kit_args(out: Path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    A.add_arguments(p)
    return p.parse_args(["--twin", "--out", str(out), "--sizes", "65536,4194304", *extra])


@pytest.fixture
def kit(tmp_path, tiny_onnx, monkeypatch):
    monkeypatch.setattr(sim_client, "TwinDaemon", FakeDaemon)
    FakeDaemon.started.clear()
    lines: list[str] = []
    k = A.Kit(kit_args(tmp_path / "out", "--model", str(tiny_onnx), "--prefix", "x3kit"), say=lines.append)
    monkeypatch.setattr(k, "fingerprint", lambda: {})
    return k, lines


def test_the_kits_twin_runs_the_onnxruntime_engine_and_unreached_steps_are_not_run(kit, tmp_path, monkeypatch):
    k, lines = kit

    def dock_steps(fp: dict) -> bool:
        k.add(A.StepRecord("ladder", True, {}, "7 rungs passed"))
        k.add(A.StepRecord("copy_65536", True, {}, "in 1 MB/s"))
        k.add(A.StepRecord("copy_4194304", True, {}, "in 1 MB/s"))
        k.add(A.StepRecord("fingerprint", True, {}, "exact"))
        return True

    monkeypatch.setattr(k, "dock_steps", dock_steps)
    monkeypatch.setattr(k, "node_steps", lambda: k.add(A.StepRecord("frames", False, {}, "the primary did not serve")))
    assert k.run() == 1
    assert FakeDaemon.started == [["--engine", "onnxruntime"]]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(s["name"], s["verdict"], s["detail"]) for s in report["steps"]][-3:] == [
        ("frames", "fail", "the primary did not serve"),
        ("unplug", "not run", "not run: the frames step failed"),
        ("replug", "not run", "not run: the frames step failed"),
    ]
    assert report["passed"] is False
    assert report["failed_steps"] == ["frames"] and report["not_run_steps"] == ["unplug", "replug"]
    assert lines[-1] == "NOT accepted: failed step(s) frames; not run: unplug, replug"
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<tr class=not_run><td>replug</td><td>NOT RUN</td>" in page


def test_a_failed_ladder_leaves_every_later_step_not_run(kit, tmp_path, monkeypatch):
    k, lines = kit
    monkeypatch.setattr(k, "dock_steps", lambda fp: k.add(A.StepRecord("ladder", False, {}, "ltssm failed")) and False)
    assert k.run() == 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(s["name"], s["verdict"]) for s in report["steps"]] == [
        ("ladder", "fail"),
        ("copy_65536", "not run"),
        ("copy_4194304", "not run"),
        ("fingerprint", "not run"),
        ("frames", "not run"),
        ("unplug", "not run"),
        ("replug", "not run"),
    ]
    assert {s["detail"] for s in report["steps"][1:]} == {"not run: the ladder step failed"}
    assert lines[-1] == (
        "NOT accepted: failed step(s) ladder; not run: copy_65536, copy_4194304, fingerprint, frames, unplug, replug"
    )


def test_the_twin_engine_can_be_chosen():
    assert kit_args(Path("/tmp/x"), "--twin-engine", "tinygrad").twin_engine == "tinygrad"


@pytest.mark.parametrize(
    ("option", "value", "want"),
    [
        ("--min-copy-mbps", "nan", "give a copy rate in MB/s > 0"),
        ("--min-copy-mbps", "inf", "give a copy rate in MB/s > 0"),
        ("--min-copy-mbps", "-1", "give a copy rate in MB/s > 0"),
        ("--min-copy-mbps", "0", "give a copy rate in MB/s > 0"),
        ("--min-copy-mbps", "fast", "give a copy rate in MB/s > 0"),
        ("--frames", "-3", "give a number of frames > 0 and <= 72000"),
        ("--frames", "0", "give a number of frames > 0 and <= 72000"),
        ("--frames", "nan", "give a number of frames > 0 and <= 72000"),
        ("--frames", "99999999999999999", "give a number of frames > 0 and <= 72000"),  # ran until killed
        ("--frames", "72001", "give a number of frames > 0 and <= 72000"),
        ("--detect-bound-ms", "nan", "give a time in milliseconds > 0"),
        ("--detect-bound-ms", "-5", "give a time in milliseconds > 0"),
        ("--recover-bound-s", "nan", "give a number of seconds > 0"),
        ("--recover-bound-s", "-inf", "give a number of seconds > 0"),
        ("--sizes", "nan", "want bytes per copy, comma-separated"),
        ("--sizes", "65536,-1", f"each size in 1 .. {64 << 20} bytes"),
    ],
)
def test_a_number_the_kit_cannot_judge_by_is_refused_in_one_line(tmp_path, capsys, option, value, want):
    """NaN compares false with every figure: ``--min-copy-mbps nan`` would pass any copy. Refused as argparse
    reads it, before anything starts: one line, exit 2, no --out written."""
    from chestnut.launch.cli import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(["acceptance", "--twin", "--out", str(out), f"{option}={value}"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"chestnut acceptance: error: argument {option}: {value!r}: {want} (chestnut acceptance --help)"
    ]
    assert not out.exists()


@pytest.mark.parametrize("plant", ["fifo", "huge"])
def test_a_fingerprint_file_that_is_no_fingerprint_is_refused_in_one_line_before_any_step(plant, tmp_path, tiny_onnx,
                                                                                         capsys):
    """A FIFO was passed over (a fresh one recorded in its place), a huge file read whole (a MemoryError)."""
    from nodeharness import write_node_config

    from chestnut.launch.cli import main

    fp = tmp_path / "tiny.fingerprint.json"
    if plant == "fifo":
        os.mkfifo(fp)
    else:
        with open(fp, "wb") as f:
            f.truncate(1 << 32)  # sparse: 4 GiB that cost no disk
    cfg = write_node_config(tmp_path / "node.toml", tiny_onnx, fingerprint=fp)
    out = tmp_path / "out"
    assert main(["acceptance", "--twin", "--config", str(cfg), "--out", str(out)]) == 2
    problem = "is a FIFO, not a regular file" if plant == "fifo" else "is 4294967296 bytes, over the 1048576 a " \
                                                                       "fingerprint may hold"
    assert capsys.readouterr().err.splitlines() == [
        f"chestnut acceptance: fingerprint: {fp} is unreadable: it {problem}"]
    assert not out.exists()


def _kit_with(tmp_path, tiny_onnx, monkeypatch, prefix: str) -> tuple[A.Kit, list[str]]:
    monkeypatch.setattr(sim_client, "TwinDaemon", FakeDaemon)
    lines: list[str] = []
    k = A.Kit(kit_args(tmp_path / "out", "--model", str(tiny_onnx), "--prefix", prefix), say=lines.append)
    monkeypatch.setattr(k, "fingerprint", lambda: {})
    monkeypatch.setattr(k, "dock_steps", lambda fp: False)
    return k, lines


def test_a_runtime_directory_there_before_the_kit_keeps_what_is_not_the_stacks(tmp_path, tiny_onnx, monkeypatch):
    """A --prefix the person gave may be their own stack's: the kit removed its whole runtime directory."""
    from chestnut.msgs.paths import runtime_dir

    theirs = runtime_dir("x3mine")
    (theirs / "notes.txt").write_text("mine")
    k, lines = _kit_with(tmp_path, tiny_onnx, monkeypatch, "x3mine")
    k.run()
    assert (theirs / "notes.txt").read_text() == "mine"
    assert (f"runtime directory {theirs} kept: notes.txt in it is not the stack's (another program's file on this "
            "prefix, say a `chestnut twin serve` of its own, or planted); remove it once nothing uses it") in lines


def test_a_runtime_directory_the_kit_made_is_removed(tmp_path, tiny_onnx, monkeypatch):
    from chestnut.msgs.paths import runtime_dir

    k, lines = _kit_with(tmp_path, tiny_onnx, monkeypatch, "x3fresh")
    made = runtime_dir("x3fresh")  # as the twin daemon makes it once the kit has started
    (made / "twin.log").write_text("log")
    k.run()
    assert not made.exists() and not any("kept" in line for line in lines)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_kits_dock_process_never_resets_a_dock_another_process_holds(tmp_path, tiny_onnx):
    """``chestnut acceptance``'s dock process takes the dock's lock at ``usb_ids`` (``lock_first``): beside a process
    holding it (a serving node, a probe) its ladder fails there, ``lock_held`` naming the holder, nothing is copied,
    and the dock is neither powered on nor reset (it once ran every rung, the GPU reset among them, and only then
    met the lock)."""
    import sys

    from twinfixtures import hold_dock_lock, let_go

    from chestnut.backend.docklock import dock_lock_path
    from chestnut.launch.acceptance_dock import run_dock_process

    prefix = os.environ["CHESTNUT_PREFIX"]
    with sim_client.running_twin(prefix) as twin:
        st = twin.status()
        bus, address = st["usb"]["bus"], st["usb"]["address"]
        path = dock_lock_path(bus, address)
        holder, code = hold_dock_lock(bus, address)
        try:
            params = {"twin": True, "prefix": prefix, "wait_timeout_ms": 3000, "model": str(tiny_onnx), "name": "tiny",
                      "shapes": {"x": [1, 3, 32, 64]}, "fingerprint": {"seed": 0, "outputs": {}}, "sizes": [65536]}
            env = {k: v for k, v in os.environ.items() if k not in ("DEV", "GMMU", "HCQDEV_WAIT_TIMEOUT_MS")}
            res = run_dock_process(params, env)
            after = twin.status()
            log = twin.daemon.log_path.read_text()
        finally:
            let_go(holder)
    words = (f"UsbLayerError lock_held: the dock usb:{bus}-{address} is in use by pid {holder.pid} "
             f"({sys.executable} -c {code}): it holds the dock's lock file {path}")
    assert [(r["name"], r["result"]) for r in res["ladder"]] == [
        ("usb_ids", "fail"), ("link_speed", "skipped"), ("link_stability", "skipped"), ("ltssm", "skipped"),
        ("gpu_arch", "skipped")]
    assert (res["ladder"][0]["reason"], res["ladder"][0]["detail"]) == ("lock_held", words)
    assert (res["copies"], res["fingerprint"]) == ([], None)
    assert (after["bridge"], after["pcie"]) == (st["bridge"], st["pcie"]) and log.count("PCIe power") == 0
