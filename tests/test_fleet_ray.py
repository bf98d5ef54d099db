"""Fleet replay and check: one unit per segment on the local pool or a two-node Ray cluster, same results.

The fleet: ``tests/drivelog.py``'s drive (180 frames in four 3 s segments, tiny model) copied under new
route ids by ``chestnut fleet make``. The Ray cluster runs on this machine: a head and a second node,
one CPU and 100 MB of object store each (Ray's ``ray.cluster_utils.Cluster``), torn down at the end.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from drivelog import _msg, build_drive, tamper_tensor, write_drive

from chestnut.launch.cli import main
from chestnut.msgs.logfile import SegmentFileReader, find_log_files
from chestnut.node.offline.executor import RAY_INSTALL_HINT, LocalExecutor
from chestnut.node.offline.fleet import (
    check_fleet,
    check_rows,
    make_fleet,
    replay_fleet,
    replay_rows,
    replay_segment_rows,
)
from chestnut.node.offline.replay import KIND_VALUES, find_node_config, replay
from chestnut.node.offline.units import Unit, run_unit

pytestmark = pytest.mark.slow

ROUTE = "2026-01-01--00-00-00"
COPIES = 4
SEGMENTS = 4  # per copy
OBJECT_STORE = 100 * 1024 * 1024  # Ray's minimum is 75 MiB


@pytest.fixture(scope="module")
def source(drive_items: list, tmp_path_factory) -> Path:
    logs = tmp_path_factory.mktemp("source") / "logs"
    write_drive(drive_items, logs)
    return logs


@pytest.fixture(scope="module")
def drive_items(tiny_onnx: Path) -> list:
    return build_drive(tiny_onnx)


@pytest.fixture(scope="module")
def fleet(source: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fleet") / "fleet"
    make_fleet(source, COPIES, out)
    return out


@pytest.fixture(scope="module")
def alone(source: Path) -> str:
    """The digest of the source log replayed on its own, in this process."""
    return replay(source, jit_cache=False).digest()


@pytest.fixture(scope="module")
def local(fleet: Path):
    return replay_fleet(fleet, LocalExecutor(1), jit_cache=False), check_fleet(fleet, LocalExecutor(1))


# ---------------------------------------------------------------- without Ray


def test_fleet_make_writes_copies_under_new_route_ids(source, tmp_path, capsys):
    out = tmp_path / "fleet"
    assert main(["fleet", "make", "--from", str(source), "--copies", "3", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"3 route(s), 12 segment(s) in {out}"
    assert sorted(p.name for p in out.iterdir()) == [f"{ROUTE}-{k:05d}--{n}" for k in (1, 2, 3) for n in range(4)]
    for n in range(SEGMENTS):
        original = (source / f"{ROUTE}--{n}" / "rlog.zst").read_bytes()
        copy = out / f"{ROUTE}-00002--{n}" / "rlog.zst"
        assert copy.read_bytes() == original
        assert stat.S_IMODE(copy.stat().st_mode) == 0o600 and stat.S_IMODE(copy.parent.stat().st_mode) == 0o700
    # never over an existing route: one line, exit 2, nothing written
    before = sorted(p.name for p in out.iterdir())
    assert main(["fleet", "make", "--from", str(source), "--copies", "4", str(out)]) == 2
    assert sorted(p.name for p in out.iterdir()) == before
    assert capsys.readouterr().err == (
        f"chestnut fleet make: {out / before[0]} already exists: give an empty OUT directory\n"
    )
    # a count out of range: the parser's one line, before anything is read
    with pytest.raises(SystemExit) as info:
        main(["fleet", "make", "--from", str(source), "--copies", "0", str(tmp_path / "x")])
    assert info.value.code == 2 and not (tmp_path / "x").exists()
    assert capsys.readouterr().err == (
        "chestnut fleet make: error: argument --copies: '0': give a number of copies in 1..100000 "
        "(chestnut fleet make --help)\n"
    )


def test_fleet_make_refuses_an_unfit_out_directory_and_writes_nothing(source, tmp_path, caplog, capsys):
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "link").symlink_to(victim)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # writable by anyone: another user could plant a route's directory there
    for out, why in ((tmp_path / "link", "symlink"), (shared, "writable")):
        caplog.clear()
        assert main(["fleet", "make", "--from", str(source), "--copies", "1", str(out)]) == 2
        (line,) = capsys.readouterr().err.splitlines()  # one line on stderr, the program named once
        assert line.startswith(f"chestnut fleet make: OUT {out}") and why in line, line
        assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []  # not logged as well
    assert list(victim.iterdir()) == [] and list(shared.iterdir()) == []


def test_local_fleet_equals_each_log_replayed_alone(fleet, alone, local):
    fr, fc = local
    assert fr.run.units == COPIES * SEGMENTS and fr.run.failed == [] and not fr.run.interrupted
    assert sorted(Path(k).name for k in fr.logs) == [f"{ROUTE}-{k:05d}" for k in range(1, COPIES + 1)]
    assert {r.digest() for r in fr.logs.values()} == {alone}
    assert fr.ok and fc.ok and all(r.violations == [] for r in fc.logs.values())
    two = replay_fleet(fleet, LocalExecutor(2), jit_cache=False)
    assert two.digest() == fr.digest()
    assert two.run.executor == "local, 2 process(es)" and two.run.units == len(two.run.outcomes)
    assert [(r.log, r.segments, r.frames, r.problems) for r in replay_rows(fr)] == [
        (f"{ROUTE}-{k:05d}", SEGMENTS, 180, 0) for k in range(1, COPIES + 1)
    ]
    # the drive's one failover: the worker dies at frame 60 (drivelog.py)
    assert {r.log: r.failovers for r in check_rows(fc)} == {
        f"{ROUTE}-{k:05d}": {"primary_fault": 1} for k in range(1, COPIES + 1)
    }


def test_fleet_table_puts_the_broken_log_first_and_a_corrupt_segment_does_not_stop_the_run(tiny_onnx, source, tmp_path):
    fleet = tmp_path / "fleet"
    make_fleet(source, 3, fleet)
    bad_log = tmp_path / "bad"
    write_drive(tamper_tensor(build_drive(tiny_onnx), 150, 3, 0.5), bad_log)
    make_fleet(bad_log, 1, tmp_path / "one")
    (tmp_path / "one" / f"{ROUTE}-00001--0").rename(fleet / "2026-02-02--00-00-00-00001--0")
    for n in (1, 2, 3):  # the tampered drive as its own route in the fleet
        (tmp_path / "one" / f"{ROUTE}-00001--{n}").rename(fleet / f"2026-02-02--00-00-00-00001--{n}")
    seg = fleet / f"{ROUTE}-00002--1" / "rlog.zst"
    data = seg.read_bytes()
    seg.write_bytes(data[: len(data) // 2])
    damage = SegmentFileReader(seg)
    list(damage)
    r = replay_fleet(fleet, LocalExecutor(1), jit_cache=False)
    assert r.run.units == 16 and r.run.failed == []  # every segment ran, the corrupt one too
    rows = replay_rows(r)
    assert [(x.log, x.mismatches, x.damage) for x in rows] == [
        (f"{ROUTE}-00002", 0, 1),
        ("2026-02-02--00-00-00-00001", 1, 0),
        (f"{ROUTE}-00001", 0, 0),
        (f"{ROUTE}-00003", 0, 0),
    ]
    worst = replay_segment_rows(r)
    assert (worst[0].log, worst[0].index) == (f"{ROUTE}-00002", 1)
    assert worst[0].first == f"byte {damage.damage[0].offset}: {damage.damage[0].reason}"
    assert [(w.log, w.index, w.problems) for w in worst][1:] == [("2026-02-02--00-00-00-00001", 2, 1)]
    assert [(f.frame_id, f.kind) for f in r.logs[str(fleet / "2026-02-02--00-00-00-00001")].mismatches] == [
        (150, KIND_VALUES)
    ]
    out = tmp_path / "report"
    assert main(["replay", str(fleet), "--no-jit-cache", "--report", str(out)]) == 1
    page = (out / "index.html").read_text()
    assert "FAIL: 1 replay mismatch(es), 0 contract violation(s), 1 damaged file(s), 0 failed segment(s)" in page
    assert page.index(f"{ROUTE}-00002") < page.index(f"{ROUTE}-00001")  # worst first
    assert f"byte {damage.damage[0].offset}" in page


@pytest.mark.parametrize(("after_s", "engine"), [(2.0, "onnxruntime"), (4.0, None)])
def test_plan_reads_the_twin_engine_only_near_the_node_config(drive_items, tmp_path, after_s, engine):
    """The driver resolves every log's plan from its first segment: it reads up to 3 s past the node's
    config for the 1 Hz twinState, not the whole segment."""
    init_t = next(t for t, s, _ in drive_items if s == "initData")
    m = _msg("twinState", init_t + int(after_s * 1e9))
    m.twinState.programEngine = "onnxruntime"
    items = sorted([*drive_items, (m.logMonoTime, "twinState", m.to_bytes())], key=lambda i: i[0])
    write_drive(items, tmp_path / "logs", segment_seconds=10.0)  # one file: all of it would be read otherwise
    files = find_log_files(tmp_path / "logs")
    assert len(files) == 1
    config = find_node_config(files)
    assert config["model"]["name"] == "tiny"
    assert config.get("twin", {}).get("program_engine") == engine


def test_local_worker_sigkilled_mid_run_has_its_segment_retried(fleet, local):
    fr, _ = local
    killed: list[str] = []

    def kill_once(o):
        # the process that sent this result already holds its next segment: kill it under that segment
        if not killed:
            killed.append(o.worker)
            os.kill(int(o.worker.split("@")[0]), signal.SIGKILL)

    r = replay_fleet(fleet, LocalExecutor(2), on_outcome=kill_once, jit_cache=False)
    assert r.run.failed == [] and len(r.run.outcomes) == r.run.units == COPIES * SEGMENTS
    assert r.digest() == fr.digest()
    # the pool broke: the killed process's segment and the one beside it ran again in a fresh pool
    assert 1 <= len(r.run.retried) <= 2 and all(o.attempts == 2 for o in r.run.retried)
    assert killed[0] not in {o.worker for o in r.run.retried}


def _submit_failing_once(monkeypatch, at_call: int, then_sigint: bool = False) -> list[int]:
    """``ProcessPoolExecutor.submit`` raising ``OSError('handle is closed')`` at its ``at_call``-th call, as it did
    when a Ctrl-C to the whole process group broke the pool while the driver handed out a unit (its call queue's
    connection closed under the spawn); ``then_sigint``: that Ctrl-C reaches the driver first -- its SIGINT
    handler, the run's Ctrl-C deferral, is called as the signal would call it, synchronously (an ``os.kill`` of
    this process is delivered to whichever of its threads the kernel picks, and was lost in a long pytest
    process)."""
    from concurrent.futures import ProcessPoolExecutor

    calls = [0]
    real = ProcessPoolExecutor.submit

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == at_call:
            if then_sigint:
                handler = signal.getsignal(signal.SIGINT)
                assert getattr(handler, "__qualname__", "") == "DeferredInterrupt._on_sigint", handler
                handler(signal.SIGINT, None)
            raise OSError("handle is closed")
        return real(self, fn, *args, **kwargs)

    monkeypatch.setattr(ProcessPoolExecutor, "submit", submit)
    return calls


def test_a_pool_that_breaks_as_it_takes_a_unit_is_replaced_and_every_segment_still_runs(fleet, local, monkeypatch):
    fr, _ = local
    calls = _submit_failing_once(monkeypatch, at_call=3)
    r = replay_fleet(fleet, LocalExecutor(2), jit_cache=False)
    assert calls[0] > 3
    assert r.run.failed == [] and len(r.run.outcomes) == r.run.units == COPIES * SEGMENTS
    assert r.digest() == fr.digest()


def test_a_ctrl_c_that_broke_the_pool_as_it_took_a_unit_stops_the_run(fleet, monkeypatch):
    # as in a terminal: a pytest started from a script's background job inherits SIGINT ignored, and the run's
    # deferral takes over only Python's default handler (conftest restores the one inherited afterwards)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _submit_failing_once(monkeypatch, at_call=3, then_sigint=True)
    r = replay_fleet(fleet, LocalExecutor(2), jit_cache=False)
    assert r.run.interrupted and not r.ok
    assert len(r.run.outcomes) < COPIES * SEGMENTS


def test_interrupted_run_keeps_what_finished(fleet):
    seen = []

    def stop_after_two(o):
        seen.append(o)
        if len(seen) == 2:
            raise KeyboardInterrupt

    r = replay_fleet(fleet, LocalExecutor(1), on_outcome=stop_after_two, jit_cache=False)
    assert r.run.interrupted and len(r.run.outcomes) == 2 and not r.ok
    assert [s.index for s in next(iter(r.logs.values())).segments] == [0, 1]


def _replay_of_a_fleet(source: Path, tmp_path: Path, new_group: bool = False) -> subprocess.Popen[str]:
    """``chestnut -vv replay`` of an 80-segment fleet of ``source`` (seconds of work after its first segment) on two
    pool processes, started with SIGINT's default action; with ``new_group`` in a process group of its own, as a
    shell's job."""
    fleet = tmp_path / "fleet"
    make_fleet(source, 20, fleet)
    cmd = [sys.executable, "-m", "chestnut.launch.cli", "-vv", "replay", str(fleet), "--workers", "2", "--no-jit-cache"]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_group,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.parametrize(("signum", "status", "named"),
                         [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")])
def test_ctrl_c_on_the_command_stops_the_pool_and_prints_what_finished(source, tmp_path, signum, status, named):
    """A SIGTERM is handled as a Ctrl-C (``launch/cli.py`` ``as_ctrl_c``) and named as itself: the run's line said
    "INTERRUPTED (Ctrl-C)" for it."""
    proc = _replay_of_a_fleet(source, tmp_path)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the first segment is done: the pool is running
            if "segment 1/80 done" in line:
                break
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status, err[-2000:]
    assert "Traceback" not in err
    done = re.search(r"interrupted: (\d+) of 80 segment\(s\) finished", out)
    assert done is not None and 1 <= int(done[1]) < 80
    assert f"local, 2 process(es): {done[1]} of 80 segment(s)" in out
    assert f"; INTERRUPTED ({named}): only the segments that finished are counted" in out


def test_shipped_bytes_give_the_result_of_the_path(fleet, tmp_path):
    seg = sorted(fleet.rglob("rlog.zst"))[1]
    unit = Unit("extract", "x", 1, str(seg))
    assert run_unit(unit, seg.read_bytes()) == run_unit(unit)


def _run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent,
        env=env,
    )


def test_node_twin_and_launch_never_import_ray():
    code = (
        "import sys\n"
        "import chestnut.node.main, chestnut.backend.sim.daemon, chestnut.backend.sim.cli, chestnut.launch.stack\n"
        "import chestnut.node.offline.replay_cli, chestnut.node.offline.check_cli\n"
        "import chestnut.node.offline.fleet_cli\n"
        "from chestnut.launch.cli import build_parser\n"
        "sys.argv = ['chestnut', 'launch']; build_parser()\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    done = _run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_executor_ray_without_ray_says_how_to_install(fleet):
    code = (
        "import sys\nsys.modules['ray'] = None  # as if the cluster extra were not installed\n"
        "from chestnut.launch.cli import main\n"
        f"sys.exit(main(['replay', {str(fleet)!r}, '--executor', 'ray']))\n"
    )
    done = _run_python(code)
    assert done.returncode == 2
    assert done.stderr == f"chestnut replay: {RAY_INSTALL_HINT}\n"  # one line, the program named once


def test_ray_address_where_nothing_listens_is_one_line(fleet):
    pytest.importorskip("ray", reason="the cluster extra: pip install 'chestnut[cluster]'")
    code = (
        "import sys\nfrom chestnut.launch.cli import main\n"
        f"sys.exit(main(['check', {str(fleet)!r}, '--executor', 'ray', '--ray-address', '127.0.0.1:1']))\n"
    )
    done = _run_python(code)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.rstrip("\n")]
    assert done.stderr.startswith("chestnut check: no Ray cluster answers at 127.0.0.1:1 (")
    assert done.stderr.endswith("start one with ray start --head, or give the address it printed\n")


def test_ray_address_auto_naming_a_cluster_that_is_gone_is_one_line(fleet):
    """``--ray-address auto`` went to Ray unprobed: a stale ``RAY_ADDRESS`` (or ``ray start`` record) was
    minutes of Ray's own retry lines."""
    pytest.importorskip("ray", reason="the cluster extra: pip install 'chestnut[cluster]'")
    from ray._private.services import canonicalize_bootstrap_address

    code = (
        "import sys\nfrom chestnut.launch.cli import main\n"
        f"sys.exit(main(['check', {str(fleet)!r}, '--executor', 'ray', '--ray-address', 'auto']))\n"
    )
    done = _run_python(code, env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"})
    assert done.returncode == 2
    gone = canonicalize_bootstrap_address("127.0.0.1:1")  # Ray's own: localhost made the node's address
    assert done.stderr == (
        f"chestnut check: --ray-address auto: no Ray cluster answers at {gone}, from RAY_ADDRESS "
        "([Errno 111] Connection refused): start one with ray start --head, or give the address it printed\n"
    )


@pytest.mark.parametrize(
    ("running", "why"),
    [
        ([], "--ray-address auto: no running Ray cluster found (RAY_ADDRESS is unset, no ray start recorded one, "
             "none runs on this machine): start one with ray start --head, or give HOST:PORT"),
        (["10.0.0.2:6379", "10.0.0.1:6379"], "--ray-address auto: 2 Ray clusters run on this machine "
                                             "(10.0.0.1:6379, 10.0.0.2:6379); give the one to use as HOST:PORT"),
    ],
)
def test_ray_address_auto_without_one_cluster_says_so_in_our_words(running, why, monkeypatch):
    """Ray's own refusal ("Could not find any running Ray instance ... the `--address` flag") named a flag
    ``chestnut`` does not have."""
    pytest.importorskip("ray", reason="the cluster extra: pip install 'chestnut[cluster]'")
    from ray._private import services

    from chestnut.node.offline.ray_executor import ExecutorError, _probe

    def none_found(addr):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "canonicalize_bootstrap_address_or_die", none_found)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: set(running))
    with pytest.raises(ExecutorError) as info:
        _probe("auto")
    assert str(info.value) == why


@pytest.mark.parametrize("workers", [0, -2])
def test_ray_executor_refuses_a_worker_count_below_1_before_any_cluster(workers, monkeypatch):
    """``RayExecutor(workers=0)`` read 0 as "one actor per CPU" and started a cluster; -2 was refused only after
    ``ray.init`` had started one with -2 CPUs."""
    pytest.importorskip("ray", reason="the cluster extra: pip install 'chestnut[cluster]'")
    import ray

    from chestnut.node.offline.ray_executor import RayExecutor

    def no_cluster(*a, **k):
        raise AssertionError("ray.init called")

    monkeypatch.setattr(ray, "init", no_cluster)
    with pytest.raises(ValueError) as info:
        RayExecutor(workers=workers)
    assert str(info.value) == f"workers must be >= 1, got {workers}"


def test_ray_executor_bounds_a_private_clusters_actors_by_this_machine_not_a_clusters_at_an_address(monkeypatch):
    """A private cluster's actors all run here (``ray.init(num_cpus=workers)``): over ``replay.py`` ``max_workers``
    is refused before ``ray.init``; a cluster at an address is bounded by its own CPUs, so the count goes through."""
    pytest.importorskip("ray", reason="the cluster extra: pip install 'chestnut[cluster]'")
    import ray

    from chestnut.node.config import cpu_count
    from chestnut.node.offline import ray_executor
    from chestnut.node.offline.replay import max_workers
    from chestnut.node.offline.units import ExecutorError

    def no_cluster(*a, **k):
        raise ConnectionError("no cluster in this test")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # whatever a test before left running
    monkeypatch.setattr(ray, "init", no_cluster)
    monkeypatch.setattr(ray_executor, "_probe", lambda address: address)
    n = max_workers() + 1
    with pytest.raises(ValueError) as info:
        ray_executor.RayExecutor(workers=n)
    assert str(info.value) == (f"workers must be at most {n - 1} on this machine (4 per CPU it may run on, "
                               f"{cpu_count()} CPUs: more only take turns for them, each with its own memory), got {n}")
    with pytest.raises(ExecutorError) as reached:
        ray_executor.RayExecutor(address="10.0.0.1:6379", workers=n)
    assert str(reached.value) == "cannot reach a Ray cluster at 10.0.0.1:6379: no cluster in this test"


# ---------------------------------------------------------------- on a two-node Ray cluster


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray", reason="the cluster extra: pip install 'chestnut[cluster]'")
    import ray
    from ray.cluster_utils import Cluster

    # every file of the cluster (sessions, sockets, its address) in a directory of ours, mode 0700; short,
    # since Ray's socket paths live under it
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp
    c = None
    try:
        c = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "object_store_memory": OBJECT_STORE, "include_dashboard": False},
        )
        c.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False, configure_logging=False)
        yield c
    finally:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
    left = _survivors({int(w.split("@")[0]) for ex in STARTED for w in ex.worker_ids() if w})
    assert left == [], f"Ray worker processes outlived the cluster: {left}"


STARTED: list = []  # every executor the cluster tests started: their workers must end with the cluster


def _survivors(pids: set[int], wait_s: float = 10.0) -> list[int]:
    """The processes of ``pids`` still alive after ``wait_s`` (SIGKILLed then, to leave the machine clean)."""
    deadline = time.monotonic() + wait_s
    alive = sorted(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if _alive(p)]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    return alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def _ray(**kw):
    from chestnut.node.offline.ray_executor import RayExecutor

    ex = RayExecutor(**kw)
    STARTED.append(ex)
    return ex


@pytest.mark.timeout(300)
def test_ray_two_nodes_same_results_as_local(cluster, fleet, local):
    fr, fc = local
    ex = _ray()
    try:
        assert (ex.workers, ex.nodes) == (2, 2)  # one actor per CPU of the cluster, one CPU per node
        r = replay_fleet(fleet, ex, jit_cache=False)
        c = check_fleet(fleet, ex)
        assert r.digest() == fr.digest() and c.digest() == fc.digest()
        assert len(set(ex.worker_ids())) == 2 and {o.worker for o in r.run.outcomes} == set(ex.worker_ids())
    finally:
        ex.close()  # its actors hold the cluster's CPUs
    shipped = _ray(ship_logs=True)
    try:
        assert replay_fleet(fleet, shipped, jit_cache=False).digest() == fr.digest()
    finally:
        shipped.close()


@pytest.mark.timeout(300)
def test_ray_worker_sigkilled_mid_run_has_its_segment_retried(cluster, fleet, local):
    fr, _ = local
    ex = _ray()
    killed: list[str] = []

    def kill_once(o):
        # the worker that sent this result already holds its next segment: kill it under that segment
        if not killed:
            killed.append(o.worker)
            os.kill(int(o.worker.split("@")[0]), signal.SIGKILL)

    try:
        r = replay_fleet(fleet, ex, on_outcome=kill_once, jit_cache=False)
        assert r.run.failed == [] and r.run.units == len(r.run.outcomes) == COPIES * SEGMENTS
        assert r.digest() == fr.digest()
        assert len(r.run.retried) == 1 and r.run.retried[0].worker != killed[0]
        assert killed[0] not in ex.worker_ids()  # the actor came back as a new process
    finally:
        ex.close()


@pytest.mark.timeout(300)
def test_ray_ctrl_c_cancels_and_keeps_what_finished(cluster, fleet, local):
    fr, _ = local
    ex = _ray()

    def interrupt_at_the_third(o):
        if len(seen) == 2:
            raise KeyboardInterrupt
        seen.append(o)

    seen: list = []
    try:
        r = replay_fleet(fleet, ex, on_outcome=interrupt_at_the_third, jit_cache=False)
    finally:
        ex.close()
    assert r.run.interrupted and len(r.run.outcomes) == 3 and not r.ok
    first = sorted(r.logs)[0]
    assert [s.index for s in r.logs[first].segments] == sorted(
        o.unit.index for o in r.run.outcomes if o.unit.log == first
    )  # the log holds the segments that finished, in segment order
    # nothing is left running: a new pool gets every CPU of the cluster again
    again = _ray()
    try:
        assert replay_fleet(fleet, again, jit_cache=False).digest() == fr.digest()
    finally:
        again.close()


@pytest.mark.timeout(300)
def test_cli_on_the_cluster_writes_the_fleet_report(cluster, fleet, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["check", str(fleet), "--executor", "ray", "--ray-address", cluster.address, "--report", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"ray, 2 actor(s) on 2 node(s): {COPIES * SEGMENTS} of {COPIES * SEGMENTS} segment(s)" in text
    page = (out / "index.html").read_text()
    assert "PASS: 0 replay mismatch(es), 0 contract violation(s), 0 damaged file(s), 0 failed segment(s)" in page
    assert page.count(f"{ROUTE}-0000") == COPIES


@pytest.mark.parametrize("after", ["start", "first segment"])
def test_a_terminals_ctrl_c_reaching_every_process_stops_the_run_without_a_traceback(source, tmp_path, after):
    """A terminal sends Ctrl-C to the whole foreground process group: the pool's workers get it too, also while
    they are still starting (importing, before their initializer ignores it), and the driver's wait may be
    anywhere in concurrent.futures' code. Exit 130, one summary, no traceback from any process."""
    proc = _replay_of_a_fleet(source, tmp_path, new_group=True)
    try:
        assert proc.stderr is not None
        if after == "first segment":
            for line in proc.stderr:
                if "segment 1/80 done" in line:
                    break
        else:  # the first pool worker exists: it is starting up, its initializer has not run
            import psutil

            def pool_workers() -> list:
                found = []
                for c in psutil.Process(proc.pid).children():
                    with contextlib.suppress(psutil.Error):  # one that ended meanwhile
                        if "spawn_main" in " ".join(c.cmdline()):
                            found.append(c)
                return found

            t_end = time.monotonic() + 60
            while not pool_workers() and time.monotonic() < t_end:
                time.sleep(0.001)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert re.search(r"interrupted: \d+ of 80 segment\(s\) finished", out), out[-2000:]
