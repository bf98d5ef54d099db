"""``chestnut probe``: the ladder printed step by step against the twin daemon, and its exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from twinfixtures import hold_dock_lock, let_go

from chestnut.backend.sim.client import running_twin

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def probe(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DEV", "GMMU", "HCQDEV_WAIT_TIMEOUT_MS")}
    return subprocess.run([sys.executable, "-m", "chestnut.launch.cli", "probe", *args], env=env,
                          capture_output=True, text=True, timeout=100)


def test_probe_prints_every_rung_and_exits_0_when_qualified(tiny_onnx, tmp_path):
    fp = tmp_path / "tiny.fp.json"
    rec = probe("--record-fingerprint", str(fp), "--model", str(tiny_onnx))
    assert rec.returncode == 0, rec.stderr
    assert json.loads(fp.read_text())["outputs"]["prob"]["shape"] == [1, 1, 16, 32]
    with running_twin():
        out = probe("--twin", "--model", str(tiny_onnx), "--fingerprint", str(fp))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    rungs = [line.split()[1] for line in lines if line.startswith("[")]
    assert rungs == ["usb_ids", "link_speed", "link_stability", "ltssm", "gpu_arch", "model_loaded", "warmup"]
    assert all(line.startswith("[PASS]") for line in lines if line.startswith("["))
    assert " ms " in lines[1] and "bit-exact" in out.stdout and lines[-1] == "qualified"


def test_probe_names_the_first_failure_and_what_to_do(tmp_path):
    with running_twin() as twin:
        twin.fault("ltssm_stuck", repeat=True)
        out = probe("--twin")
        js = probe("--twin", "--json")
    assert out.returncode == 1
    assert "[FAIL] ltssm" in out.stdout and "[SKIP] gpu_arch" in out.stdout
    assert "first failure: ltssm (pcie layer)" in out.stdout and "LTSSM=0x4C" in out.stdout
    assert "what to do: power-cycle the dock" in out.stdout
    steps = json.loads(js.stdout)
    assert js.returncode == 1 and [s["result"] for s in steps] == ["pass", "pass", "pass", "fail", "skipped"]
    assert steps[3]["reason"] == "ltssm_stuck"


def test_probe_without_a_twin_says_so_first_and_how_to_start_one():
    prefix = f"t{os.getpid()}-nobody"
    out = probe("--twin", "--prefix", prefix)
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == (f"chestnut probe: the twin daemon is not running on prefix {prefix!r}: start it with "
                          f"`chestnut twin --prefix {prefix} serve` (or run a whole stack with `chestnut launch`), "
                          "then probe again\n")


def test_a_step_longer_than_two_seconds_says_so_every_five_seconds():
    from chestnut.backend.probe import Ticker

    t = Ticker("recording the fingerprint", out=None)
    t.step("recording the fingerprint", now=100.0)
    said = [(now, t.due(now)) for now in (101.9, 102.1, 103.0, 106.9, 107.2, 112.5)]
    assert said == [
        (101.9, None),
        (102.1, "       ... recording the fingerprint (2 s)"),
        (103.0, None),
        (106.9, None),
        (107.2, "       ... recording the fingerprint (7 s)"),
        (112.5, "       ... recording the fingerprint (12 s)"),
    ]
    t.step("model_loaded: loading and compiling the model", now=113.0)
    assert t.due(114.0) is None
    assert t.due(115.5) == "       ... model_loaded: loading and compiling the model (2 s)"


def test_record_fingerprint_refuses_a_folder_target_and_a_garbage_model_in_one_line(tmp_path):
    """Both were tracebacks (the garbage model's ending ``ModelError: bad_model ...``)."""
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not an onnx model\n")
    folder = tmp_path / "fps"
    folder.mkdir()
    r = probe("--record-fingerprint", str(folder), "--model", str(garbage))
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (f"chestnut probe: --record-fingerprint {folder} exists and is not a regular file; give "
                        "another path\n")
    r = probe("--record-fingerprint", str(tmp_path / "nowhere" / "fp.json"), "--model", str(garbage))
    assert r.returncode == 2
    assert r.stderr == (f"chestnut probe: --record-fingerprint {tmp_path / 'nowhere' / 'fp.json'}: folder "
                        f"{tmp_path / 'nowhere'} does not exist; create it or give another path\n")
    r = probe("--record-fingerprint", str(folder / "fp.json"), "--model", str(garbage))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("chestnut probe: no fingerprint for garbage: bad_model: ")
    assert list(folder.iterdir()) == []


def test_a_shape_without_a_model_or_malformed_is_refused_in_one_line(capsys):
    """``--shape`` fixes the --model's inputs: without --model it was silently ignored."""
    from chestnut.launch.cli import main

    assert main(["probe", "--shape", "x=1,3,32,64"]) == 2
    assert capsys.readouterr().err == (
        "chestnut probe: --shape fixes the input shapes of --model; give --model too (or leave --shape out)\n"
    )
    for bad in ("bad", "x=1,0", "=1,2", "x=1,,2"):
        with pytest.raises(SystemExit) as info:
            main(["probe", "--shape", bad])
        assert info.value.code == 2
        assert capsys.readouterr().err == (
            f"chestnut probe: error: argument --shape: {bad!r}: want NAME=D0,D1,... (an input's name, positive "
            "dimensions) (chestnut probe --help)\n"
        )


@pytest.mark.parametrize("plant", ["fifo", "huge"])
def test_a_fingerprint_that_is_a_fifo_or_huge_is_refused_in_one_line_before_the_dock(plant, tiny_onnx, tmp_path):
    """A FIFO hung the probe in its open; a 4 GiB file was read whole (a MemoryError traceback)."""
    fp = tmp_path / "tiny.fp.json"
    if plant == "fifo":
        os.mkfifo(fp)
    else:
        with open(fp, "wb") as f:
            f.truncate(1 << 32)  # sparse: no disk, and refused from its size before a byte is read
    env = {k: v for k, v in os.environ.items() if k not in ("DEV", "GMMU", "HCQDEV_WAIT_TIMEOUT_MS")}
    r = subprocess.run([sys.executable, "-m", "chestnut.launch.cli", "probe", "--twin", "--model", str(tiny_onnx),
                        "--fingerprint", str(fp)], env=env, capture_output=True, text=True, timeout=30)
    problem = "is a FIFO, not a regular file" if plant == "fifo" else "is 4294967296 bytes, over the 1048576 a " \
                                                                       "fingerprint may hold"
    assert (r.returncode, r.stderr.splitlines(), r.stdout) == (2, [f"chestnut probe: --fingerprint {fp} {problem}"], "")


@pytest.mark.parametrize("value", ["-3", "0", "1.5", "soon", "60001", "99999999999999999999"])
def test_a_wait_timeout_that_is_no_positive_whole_ms_is_refused_in_one_line(capsys, value):
    """``--wait-timeout-ms -3`` went on to climb the ladder; ``chestnut run`` refuses the same value.
    ``--wait-timeout-ms 99999999999999999999`` was taken: no bound, where ``chestnut run`` and ``chestnut check``
    stop at a minute."""
    from chestnut.launch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["probe", "--twin", "--wait-timeout-ms", value])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"chestnut probe: error: argument --wait-timeout-ms: {value!r}: give a whole number of milliseconds, > 0 "
        "and <= 60000 (a minute, the node's own bound) (chestnut probe --help)\n"
    )


def test_the_wait_timeout_bound_is_the_nodes_own():
    from chestnut.backend.probe import _wait_timeout_ms
    from chestnut.msgs.argtypes import MAX_WAIT_TIMEOUT_MS
    from chestnut.node.config import MAX_MS

    assert (MAX_WAIT_TIMEOUT_MS, _wait_timeout_ms("60000"), _wait_timeout_ms("1")) == (MAX_MS, 60000, 1)


def test_a_model_that_is_a_fifo_says_so_unopened(capsys, tmp_path):
    """It said 'does not exist' of a FIFO that exists."""
    from chestnut.launch.cli import main

    fifo = tmp_path / "m.onnx"
    os.mkfifo(fifo)
    assert main(["probe", "--twin", "--model", str(fifo)]) == 2
    assert capsys.readouterr().err == f"chestnut probe: model {fifo} is a FIFO, not a model file\n"


def test_a_model_path_the_os_refuses_is_one_line(capsys, tmp_path):
    """A 300-character file name was a traceback (``OSError: [Errno 36] File name too long``), and one under a
    file (ENOTDIR) or a missing one still does not exist."""
    from chestnut.launch.cli import main

    long_name = tmp_path / ("m" * 295 + ".onnx")
    assert main(["probe", "--twin", "--model", str(long_name)]) == 2
    assert capsys.readouterr().err == f"chestnut probe: model {long_name} cannot be read (File name too long)\n"
    (tmp_path / "file").write_bytes(b"")
    for gone in (tmp_path / "file" / "m.onnx", tmp_path / "none.onnx"):
        assert main(["probe", "--twin", "--model", str(gone)]) == 2
        assert capsys.readouterr().err == f"chestnut probe: model {gone} does not exist\n"


def test_a_record_fingerprint_path_the_os_refuses_is_one_line(capsys, tmp_path):
    """``--record-fingerprint <a 300-character name>`` was a traceback (``path.exists()``: ENAMETOOLONG)."""
    from chestnut.launch.cli import main

    model = tmp_path / "m.onnx"
    model.write_bytes(b"")
    target = tmp_path / ("f" * 295 + ".json")
    assert main(["probe", "--twin", "--model", str(model), "--record-fingerprint", str(target)]) == 2
    assert capsys.readouterr().err == (f"chestnut probe: --record-fingerprint {target} cannot be written (File name "
                                       "too long); give another path\n")


def test_record_fingerprint_never_writes_through_a_symlink_nor_into_a_shared_folder(capsys, tmp_path, tiny_onnx):
    """A planted symlink was followed (its target overwritten, exit 0) and ``/tmp`` itself taken, as no other output
    path of chestnut's is (``msgs/outdir.py`` ``file_target_problem``)."""
    from chestnut.launch.cli import main

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "fp.json"
    link.symlink_to(victim)
    assert main(["probe", "--record-fingerprint", str(link), "--model", str(tiny_onnx)]) == 2
    assert capsys.readouterr().err == (f"chestnut probe: --record-fingerprint {link} is a symlink: remove it "
                                       f"(rm {link}) or give another path\n")
    assert victim.read_text() == "precious\n"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp
    target = shared / "fp.json"
    assert main(["probe", "--record-fingerprint", str(target), "--model", str(tiny_onnx)]) == 2
    assert capsys.readouterr().err == (f"chestnut probe: --record-fingerprint {target}: folder {shared} is writable "
                                       "by group/other (mode 1777); give a folder of yours that no one else can "
                                       "write to\n")
    assert list(shared.iterdir()) == []


def test_a_recorded_fingerprint_is_0600_whatever_the_umask_and_replaces_an_old_file(capsys, tmp_path, tiny_onnx):
    """It was written with the umask's mode (0644 under 022), an old file's mode kept."""
    import stat

    from chestnut.launch.cli import main

    target = tmp_path / "fp.json"
    target.write_text("old")
    target.chmod(0o644)
    old = os.umask(0o022)
    try:
        assert main(["probe", "--record-fingerprint", str(target), "--model", str(tiny_onnx)]) == 0
    finally:
        os.umask(old)
    assert capsys.readouterr().err == ""
    assert stat.S_IMODE(os.lstat(target).st_mode) == 0o600
    assert json.loads(target.read_text())["outputs"]["prob"]["shape"] == [1, 1, 16, 32]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp.json"]  # no temporary left beside it


# ------------------------------------------------------------------ the dock's lock (backend/docklock.py)
def twin_resets(twin) -> int:
    """The twin's GPU resets so far: its log's ``PCIe power off: GPU reset`` lines (``backend/sim/twin.py``)."""
    return twin.daemon.log_path.read_text().count("PCIe power off: GPU reset")


def test_with_the_lock_free_the_probe_takes_it_at_usb_ids_runs_every_rung_and_gives_it_back():
    from chestnut.backend.docklock import dock_lock_path, lock_holders

    with running_twin() as twin:
        st = twin.status()
        out = probe("--twin")
        js = probe("--twin", "--json")
        resets = twin_resets(twin)
    path = dock_lock_path(st["usb"]["bus"], st["usb"]["address"])
    assert (out.returncode, out.stderr) == (0, "")
    lines = out.stdout.splitlines()
    assert [line.split()[:2] for line in lines if line.startswith("[")] == [
        ["[PASS]", "usb_ids"], ["[PASS]", "link_speed"], ["[PASS]", "link_stability"], ["[PASS]", "ltssm"],
        ["[PASS]", "gpu_arch"]]
    assert lines[1].endswith(f"0xADD1:0x0001 at bus {st['usb']['bus']} address {st['usb']['address']}, product "
                             f"'custom ASM2464PD Chestnut', lock {path} taken")
    assert lines[-1] == "qualified"
    assert (js.returncode, js.stderr) == (0, "")
    assert [s["result"] for s in json.loads(js.stdout)] == ["pass"] * 5
    assert resets == 1  # the second probe found the link up and reset the GPU, as it should on a free dock
    assert lock_holders(path) == []  # given back at exit


def test_a_dock_whose_lock_another_process_holds_is_refused_at_usb_ids_and_never_reset():
    """A probe beside a serving node ran every rung, the GPU reset among them, and failed the node over."""
    from chestnut.backend.docklock import dock_lock_path

    with running_twin() as twin:
        assert probe("--twin").returncode == 0  # the link is up and the BARs assigned, as under a serving node
        st = twin.status()
        bus, address = st["usb"]["bus"], st["usb"]["address"]
        path = dock_lock_path(bus, address)
        holder, code = hold_dock_lock(bus, address)
        try:
            resets = twin_resets(twin)
            out = probe("--twin")
            js = probe("--twin", "--json")
            after = twin.status()
            resets_after = twin_resets(twin)
        finally:
            let_go(holder)
    words = (f"the dock usb:{bus}-{address} is in use by pid {holder.pid} ({sys.executable} -c {code}): it holds "
             f"the dock's lock file {path}")
    refusal = f"chestnut probe: {words}; stop it first, then probe again\n"
    advice = "another process owns the dock; stop it (see `lsof` on the lock file) or wait for it to exit"
    assert (out.returncode, out.stderr) == (2, refusal)
    lines = out.stdout.splitlines()
    assert len(lines) == 3 and lines[0] == f"qualification ladder against the twin (prefix {twin.daemon.prefix})"
    assert lines[1].startswith("[FAIL] usb_ids         usb ")
    assert lines[1].endswith(f" ms  UsbLayerError lock_held: {words}")
    assert lines[2] == f"{'':<44}-> {advice}"
    assert (js.returncode, js.stderr) == (2, refusal)
    steps = json.loads(js.stdout)
    assert [(s["name"], s["result"], s["reason"]) for s in steps] == [
        ("usb_ids", "fail", "lock_held"), ("link_speed", "skipped", ""), ("link_stability", "skipped", ""),
        ("ltssm", "skipped", ""), ("gpu_arch", "skipped", "")]
    assert (steps[0]["detail"], steps[0]["advice"]) == (f"UsbLayerError lock_held: {words}", advice)
    assert resets_after == resets == 0  # the first probe powered the link on; nothing reset it since
    assert (after["bridge"], after["pcie"]) == (st["bridge"], st["pcie"])
    assert (after["bridge"]["pcie_power"], after["bridge"]["ltssm"]) == (True, 0x78)


def test_a_twin_dock_that_is_unplugged_is_named_so_not_a_daemon_that_is_not_running():
    """The twin's daemon answered before the ladder ran (``twin_daemon_missing``), so a ladder that finds no dock
    says the dock is unplugged and how to plug it in."""
    import io

    from chestnut.backend.errors import Layer
    from chestnut.backend.interface import LadderReport, LadderStep, StepResult
    from chestnut.backend.probe import print_summary

    report = LadderReport([LadderStep("usb_ids", Layer.USB, StepResult.FAIL, 0.01, "no device 174c:2464",
                                      "check the cable and power", "no_dock")])
    out = io.StringIO()
    print_summary(report, out, twin=True)
    assert out.getvalue().splitlines() == [
        "first failure: usb_ids (usb layer) -- no device 174c:2464",
        "what to do: check the cable and power",
        "(the twin: its daemon runs, but its dock is unplugged; `chestnut twin plug` plugs it in)",
    ]
    out = io.StringIO()
    print_summary(report, out, twin=False)  # a real dock: the ladder's own advice only
    assert len(out.getvalue().splitlines()) == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="plants a file of another uid (needs root)")
def test_a_dock_lock_file_another_user_planted_is_one_line_and_exit_2_as_a_held_lock():
    """``lock_unusable`` (the lock file belongs to another uid) was the ladder's table, a "first failure" and a
    "what to do" line, exit 1; it is the held lock's one line now, exit 2, and the dock untouched."""
    from chestnut.backend.docklock import dock_lock_path

    with running_twin() as twin:
        assert probe("--twin").returncode == 0
        st = twin.status()
        path = dock_lock_path(st["usb"]["bus"], st["usb"]["address"])
        saved = os.stat(path) if os.path.exists(path) else None
        if saved is None:
            path.touch(mode=0o600)
        os.chown(path, 65534, 65534)
        try:
            resets = twin_resets(twin)
            out = probe("--twin")
            resets_after = twin_resets(twin)
        finally:
            if saved is None:
                path.unlink()
            else:
                os.chown(path, saved.st_uid, saved.st_gid)
    assert out.returncode == 2
    assert out.stderr.startswith(f"chestnut probe: the dock's lock file {path} ") and out.stderr.count("\n") == 1
    assert "65534" in out.stderr
    assert "first failure" not in out.stdout and "what to do" not in out.stdout
    assert resets_after == resets
