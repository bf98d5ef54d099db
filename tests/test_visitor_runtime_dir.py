"""A command that only visits a stack (``chestnut dump``, ``top``, ``probe``, a twin client) leaves no runtime
directory behind (``launch/cli.py`` ``VISITORS``, ``msgs/paths.py`` ``made_dirs_removed``): a ``chestnut dump`` or
``chestnut probe --twin`` of a prefix nobody runs left an empty ``chestnut-<uid>/<prefix>/``.

Each test has a fresh ``$XDG_RUNTIME_DIR`` (``tests/conftest.py`` ``run_base``), so what is left is what it made."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import pytest

from chestnut.launch.cli import visits_only
from chestnut.msgs.paths import made_dirs_removed, runtime_dir

pytestmark = [pytest.mark.timeout(60)]


def chestnut(*argv: str) -> subprocess.CompletedProcess:
    """``chestnut ARGV`` in a process of its own, under the test's ``$XDG_RUNTIME_DIR`` and prefix. A ``dump`` (which
    waits for a publisher, ``-n 0`` too) is stopped with Ctrl-C once it said it waits: exit 130."""
    if argv[0] != "dump":
        return subprocess.run([sys.executable, "-m", "chestnut.launch.cli", *argv], capture_output=True, text=True,
                              timeout=50)
    proc = subprocess.Popen([sys.executable, "-m", "chestnut.launch.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stderr is not None
        waiting = proc.stderr.readline()
        assert waiting.endswith("; waiting\n"), waiting
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, waiting + err)


@pytest.mark.parametrize(("argv", "code"), [
    (["dump", "controlState", "-n", "0"], 130),
    (["probe", "--twin"], 1),
    (["twin", "status"], 1),
    (["twin", "clear"], 1),
])
def test_a_visit_to_a_prefix_nobody_runs_leaves_nothing(argv, code, run_base):
    r = chestnut(*argv)
    assert r.returncode == code, r.stderr
    assert os.listdir(run_base) == []


def test_a_directory_there_before_and_one_filled_meanwhile_stay(run_base):
    uid_dir = run_base / f"chestnut-{os.getuid()}"
    before = runtime_dir("there-before")
    assert chestnut("dump", "controlState", "-n", "0", "--prefix", "there-before").returncode == 130
    assert sorted(os.listdir(uid_dir)) == ["there-before"] and os.listdir(before) == []
    with made_dirs_removed():
        filled = runtime_dir("filled")
        (filled / "controlState.pub.lock").write_text("1\n")  # a publisher started while the visit ran
        made = runtime_dir("made")
    assert sorted(os.listdir(uid_dir)) == ["filled", "there-before"] and not made.exists()


def test_the_user_directory_the_visit_made_goes_after_its_prefix(run_base):
    with made_dirs_removed():
        runtime_dir("a")
        runtime_dir("b")
    assert os.listdir(run_base) == []


def test_a_command_that_publishes_or_serves_is_no_visitor():
    """The twin daemon, a publisher, the launch own what they make (the launch removes it itself)."""
    runs = [("twin", "serve"), ("twin", "libusb"), ("twin", "status"), ("twin", "fault"), ("control", None),
            ("dump", None), ("top", None), ("probe", None), ("foxglove", None), ("launch", None), ("run", None),
            ("camera", None), ("record", None)]
    assert [visits_only(argparse.Namespace(command=c, twin_command=t)) for c, t in runs] == [
        False, False, True, True, False, True, True, True, True, False, False, False, False]
