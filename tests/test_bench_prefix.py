"""A bench removes the runtime directory of the prefix it made, and only that (``tests/bench/benchprefix.py``).

Every program of the stack leaves its prefix's directory behind (its ``<service>.pub.lock`` files stay on purpose), and
each bench run took a fresh prefix (``bench-<pid>``, ``bench-frames-<pid>``, ``bench-copy-<pid>``, ``load<pid>q``,
...): ``/tmp/chestnut-0`` held 75 such directories of benches here. A directory that was there before (a prefix the
user gave, a stack of theirs) is kept, and so is ``chestnut-<uid>`` itself.

Each test has a fresh ``$XDG_RUNTIME_DIR`` (``tests/conftest.py`` ``run_base``), so what is left is exactly what it
made.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chestnut.msgs.paths import PrefixError, runtime_dir

BENCH = Path(__file__).resolve().parent / "bench"
sys.path.insert(0, str(BENCH))

from benchprefix import own_prefix  # noqa: E402

pytestmark = [pytest.mark.timeout(120)]


def left(base: Path) -> list[str]:
    """What is in ``<base>/chestnut-<uid>``, sorted."""
    return sorted(os.listdir(base / f"chestnut-{os.getuid()}"))


def test_the_directory_the_block_made_goes_with_its_files_and_nothing_else(run_base):
    other = runtime_dir("someone-else")  # another prefix, there before: never touched
    with own_prefix("bench-x") as prefix:
        assert prefix == "bench-x"
        (runtime_dir(prefix) / "cameraFrame.pub.lock").write_text("1\n")
    assert left(run_base) == ["someone-else"]
    assert other.is_dir()


def test_a_directory_that_was_there_before_is_kept_as_it_was(run_base):
    kept = runtime_dir("users-stack")
    (kept / "nodeState.pub.lock").write_text("42\n")
    with own_prefix("users-stack") as prefix:
        (runtime_dir(prefix) / "cameraFrame.pub.lock").write_text("1\n")
    assert left(run_base) == ["users-stack"]
    assert sorted(os.listdir(kept)) == ["cameraFrame.pub.lock", "nodeState.pub.lock"]


def test_it_goes_when_the_bench_fails_too(run_base):
    with pytest.raises(RuntimeError, match="^subscriber did not connect$"), own_prefix("bench-y") as prefix:
        runtime_dir(prefix)
        raise RuntimeError("subscriber did not connect")
    assert left(run_base) == []


def test_a_prefix_the_user_gave_is_used_and_kept(run_base, monkeypatch):
    monkeypatch.setenv("CHESTNUT_PREFIX", "mine")
    with own_prefix("bench-copy-1", env=True) as prefix:
        assert (prefix, os.environ["CHESTNUT_PREFIX"]) == ("mine", "mine")
        runtime_dir(prefix)
    assert (left(run_base), os.environ["CHESTNUT_PREFIX"]) == (["mine"], "mine")
    monkeypatch.delenv("CHESTNUT_PREFIX")
    with own_prefix("bench-copy-1", env=True) as prefix:
        assert (prefix, os.environ["CHESTNUT_PREFIX"]) == ("bench-copy-1", "bench-copy-1")
        runtime_dir()
    assert (left(run_base), "CHESTNUT_PREFIX" in os.environ) == (["mine"], False)


def test_a_malformed_name_is_refused_before_anything(run_base):
    with pytest.raises(PrefixError), own_prefix("../x"):
        pass
    assert not (run_base / f"chestnut-{os.getuid()}").exists()


@pytest.mark.parametrize(
    "bench",
    [
        ["bench_pubsub.py", "--small", "5", "--frames", "5"],  # bench-<pid>, with two sockets of its own
        ["bench_twin.py", "--n", "50", "--bulk", "2"],  # bench-twin-<pid>, a twin daemon's
        ["bench_warp.py", "--frames", "2", "--frame", "nv12:512x256"],  # bench-warp-<pid>: it served the default prefix
    ],
)
def test_a_bench_leaves_no_runtime_directory(run_base, bench):
    env = {k: v for k, v in os.environ.items() if k != "CHESTNUT_PREFIX"}  # the bench's own prefix, as a user runs it
    r = subprocess.run([sys.executable, str(BENCH / bench[0]), *bench[1:]], env=env, capture_output=True, text=True,
                       timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    assert left(run_base) == []  # it was [f"bench-{pid}"] / [f"bench-twin-{pid}"] / ["default"]
