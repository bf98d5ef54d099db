import os
import signal as _signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tinymodel import make_tiny_onnx  # noqa: E402

pytest_plugins = ["leakguard"]


def pytest_configure(config: pytest.Config) -> None:
    """Each pytest-xdist worker, or a run without workers, gets a temporary directory of its own (0700), removed
    when it ends: the dock lock files that tinygrad 0.14 places there (``<tempdir>/am_usb:<bus>-<addr>.lock``,
    ``System.flock_acquire``) of twins in two workers never meet (every twin enumerates at the same bus and
    address), and the tests' runtime directories (``<tempdir>/chestnut-<uid>/<prefix>``) go with it."""
    import os
    import tempfile

    # tinygrad reads DEV once, at its first import, and every use of it inside this process is the host CPU
    # (backend/model.py ensure_cpu_device): so it is, whichever test module imports it first (programs the
    # tests start choose their own device, e.g. the worker's runner)
    os.environ["DEV"] = "CPU"
    # Ray starts its workers at niceness 15 (its raylet's `worker_niceness`, read from RAY_worker_niceness): beside
    # CPU-bound load they then get almost no CPU and a fleet test waits minutes on work its cluster would do in
    # seconds. The tests' Ray workers run at the test's own priority (the product keeps Ray's default).
    os.environ.setdefault("RAY_worker_niceness", "0")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        if getattr(config.option, "numprocesses", None):  # pytest-xdist's controller: each worker makes its own
            return
        worker = "main"  # a run without workers is one
    base = Path(tempfile.gettempdir())
    mine = base / f"chestnut-tests-{os.getuid()}-{os.getpid()}-{worker}"
    mine.mkdir(mode=0o700)
    os.environ["TMPDIR"] = str(mine)
    tempfile.tempdir = None  # gettempdir() caches its first answer
    config.stash[_WORKER_TMP] = mine


_WORKER_TMP = pytest.StashKey[Path]()


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    mine = config.stash.get(_WORKER_TMP, None)
    if mine is not None:
        shutil.rmtree(mine, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_onnx(tmp_path_factory) -> Path:
    """A small real ONNX model: x float32[1,3,32,64] -> prob float32[1,1,16,32]."""
    return make_tiny_onnx(tmp_path_factory.mktemp("models") / "tiny.onnx")


@pytest.fixture(autouse=True)
def private_prefix(monkeypatch, request):
    """Every test runs its stack under its own runtime prefix so parallel stacks never collide."""
    import shutil

    from leakguard import tag_for

    from chestnut.msgs.paths import runtime_base

    prefix = tag_for(request.node.nodeid)
    monkeypatch.setenv("CHESTNUT_PREFIX", prefix)
    yield
    # the test's sockets go with it (found, not made: its base may be gone already)
    shutil.rmtree(runtime_base() / f"chestnut-{os.getuid()}" / prefix, ignore_errors=True)




_START_HANDLERS = {s: _signal.getsignal(s) for s in (_signal.SIGINT, _signal.SIGTERM)}
"""The process's SIGINT / SIGTERM handlers as pytest started: Python's (``default_int_handler``, ``SIG_DFL``)."""


def _reset_signal_handlers() -> None:
    for s, handler in _START_HANDLERS.items():
        if handler is not None and _signal.getsignal(s) is not handler:
            _signal.signal(s, handler)


@pytest.fixture(autouse=True)
def own_signal_handlers():
    """Each test starts and ends with the SIGINT / SIGTERM handlers pytest started with: a command run in-process
    (``launch/signals.py`` ``StopFlag``, the node's ``main``) -- in a test or in a module fixture, whose set-up
    comes before this -- installs its own for the life of a process, and one left behind swallowed a later
    test's Ctrl-C (the offline pool's deferral, ``node/offline/replay.py`` ``DeferredInterrupt``, takes SIGINT
    only over Python's default handler)."""
    _reset_signal_handlers()
    yield
    _reset_signal_handlers()


@pytest.fixture
def run_base(monkeypatch):
    """A fresh, short ``$XDG_RUNTIME_DIR`` (0700, ours; ``$RUNTIME_DIRECTORY`` unset), removed afterwards: pytest's
    ``tmp_path`` can be too long for the stack's socket paths (``msgs/paths.py`` ``check_socket_room``)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="rb"))
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# The test files that take longest (pytest --durations, summed per file), in that order. pytest-xdist's
# --dist loadfile hands files to workers in collection order, so these go first and the short ones fill in
# behind them: a long file started last would otherwise hold the whole run up on one worker.
LONGEST_FILES = (
    "test_tinygrad_on_twin.py", "test_e2e_launch.py", "test_replay.py", "test_node_failover.py",
    "test_fleet_ray.py", "test_contracts_launch.py", "test_acceptance.py", "test_link_faults.py",
    "test_foxglove_launch.py", "test_worker.py", "test_launch_frames_stack.py", "test_node_main.py",
    "test_stage_budget.py", "test_launch_stop_order.py", "test_warp_node.py", "test_twin_daemon.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
