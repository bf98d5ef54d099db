"""The leak guard (tests/leakguard.py) reports what a test leaves behind, names the test, and cleans it up."""

import os
import textwrap
from pathlib import Path

pytest_plugins = ["pytester"]

HERE = Path(__file__).parent


def _run_inner(pytester, body: str):
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(HERE)!r})\npytest_plugins = ['leakguard']\n")
    pytester.makepyfile(test_inner=textwrap.dedent(body))
    os.environ["CHESTNUT_LEAK_GRACE_S"] = "0.5"  # the inner session's leaks are meant: no need to wait for them
    try:
        return pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    finally:
        del os.environ["CHESTNUT_LEAK_GRACE_S"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_test_that_leaks_a_child_process_is_reported_by_name_and_the_child_is_killed(pytester, tmp_path):
    pidfile = tmp_path / "leaked.pid"
    result = _run_inner(pytester, f"""
        import subprocess, sys
        from pathlib import Path

        def test_clean():
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            p.kill()
            p.wait()

        def test_leaky():
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            Path({str(pidfile)!r}).write_text(str(p.pid))
    """)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_inner.py::test_leaky left behind: process * (*time.sleep(60)*)*"])
    assert "test_clean left behind" not in result.stdout.str()
    pid = int(pidfile.read_text())
    assert not _alive(pid)


def test_an_orphan_reparented_to_init_is_still_found(pytester, tmp_path):
    pidfile = tmp_path / "orphan.pid"
    result = _run_inner(pytester, f"""
        import subprocess, sys

        def test_orphan_maker():
            # the shell starts a sleeper in the background and exits at once: the sleeper's parent is init
            subprocess.run(["sh", "-c", "sleep 60 & echo $! > {pidfile}"], check=True)
    """)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_orphan_maker left behind: process * (sleep 60)*"])
    assert not _alive(int(pidfile.read_text()))


def test_a_dock_lock_still_held_after_a_module_is_reported_and_one_merely_left_is_not(pytester, tmp_path):
    result = _run_inner(pytester, """
        import fcntl, os, tempfile
        from pathlib import Path

        HELD = []

        def test_lock_file_left_unheld():  # tinygrad never removes its lock files: no leak
            Path(tempfile.gettempdir(), "am_usb:9-8.lock").write_text("")

        def test_lock_left_held():
            fd = os.open(os.path.join(tempfile.gettempdir(), "am_usb:9-9.lock"), os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            HELD.append(fd)
    """)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_inner.py: its fixtures left behind: a held lock on */am_usb:9-9.lock*"])
    assert "9-8" not in result.stdout.str()


def test_a_module_fixture_that_leaks_is_named_at_the_end_of_its_module(pytester, tmp_path):
    pidfile = tmp_path / "fixture.pid"
    result = _run_inner(pytester, f"""
        import subprocess, sys
        import pytest
        from pathlib import Path

        @pytest.fixture(scope="module")
        def server():
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            Path({str(pidfile)!r}).write_text(str(p.pid))
            yield p   # never stopped

        def test_uses_server(server):
            assert server.poll() is None
    """)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_inner.py: its fixtures left behind: process * (*time.sleep(60)*)*"])
    assert not _alive(int(pidfile.read_text()))
