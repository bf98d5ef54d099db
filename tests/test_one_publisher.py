"""One publisher per service and prefix (``msgs/messaging.py`` ``pub_sock``): a second live process that
would bind a service's socket is refused in one line naming the holder, exit 2, and the first one keeps
its subscribers. A malformed ``CHESTNUT_PREFIX`` is one line and exit 2 in every command."""

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from chestnut.msgs.messaging import PublisherBusyError, PubMaster, new_message, pub_sock, recv_one, sub_sock
from chestnut.msgs.paths import PrefixError, current_prefix, runtime_dir

CHESTNUT = str(Path(sys.executable).with_name("chestnut"))

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from chestnut.msgs.messaging import PubMaster, new_message
    services = sys.argv[1].split(",")
    with PubMaster(services) as pm:
        print("held", flush=True)
        while True:
            for s in services:
                if s == "controlState":
                    m = new_message("controlState")
                    m.controlState.engaged = True
                    pm.send(s, m)
            time.sleep(0.02)
    """
)


@pytest.fixture
def holder():
    """A real process publishing the given services on the test's prefix; killed afterwards."""
    procs: list[subprocess.Popen] = []

    def start(*services: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", _HOLDER, ",".join(services)], stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline() == "held\n"
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _busy_line(command: str, service: str, pid: int) -> str:
    prefix = current_prefix()
    lock = f"{runtime_dir(prefix)}/{service}.pub.lock"
    return (
        f"chestnut {command}: {service} is already published on prefix {prefix!r} by pid {pid} (lock {lock}); "
        f"stop it (kill {pid}), or choose another prefix with CHESTNUT_PREFIX=NAME"
    )


def _stderr_lines(r: subprocess.CompletedProcess) -> list[str]:
    """stderr without the program's own INFO/WARNING log records (they carry a timestamp)."""
    return [line for line in r.stderr.splitlines() if not line[:4].isdigit()]


def test_a_second_control_is_refused_naming_the_holder_and_the_first_keeps_publishing(holder):
    first = holder("controlState")
    r = subprocess.run([CHESTNUT, "control"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert _stderr_lines(r) == [_busy_line("control", "controlState", first.pid)]
    sock = sub_sock("controlState", timeout_ms=5000)
    try:
        event = recv_one(sock)  # the first publisher's socket file was not replaced
    finally:
        sock.close()
    assert event is not None and event.controlState.engaged is True


def test_a_second_camera_is_refused_naming_the_holder(holder):
    first = holder("cameraFrame")
    r = subprocess.run([CHESTNUT, "camera", "--synthetic", "--rate", "5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert _stderr_lines(r) == [_busy_line("camera", "cameraFrame", first.pid)]


def test_a_second_node_is_refused_naming_the_holder(holder):
    first = holder("modelOutput")
    r = subprocess.run([CHESTNUT, "run", "--dock", "twin"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert _stderr_lines(r) == [_busy_line("run", "modelOutput", first.pid)]
    said = _busy_line("run", "modelOutput", first.pid).removeprefix("chestnut run: ")
    assert r.stderr.count(said) == 1  # said once: the node's own stop line does not repeat it


def test_the_lock_is_freed_when_its_holder_dies_or_closes(holder):
    first = holder("controlState")
    with pytest.raises(PublisherBusyError) as info:
        pub_sock("controlState")
    assert info.value.holder == first.pid and info.value.service == "controlState"
    first.kill()
    first.wait()
    with PubMaster(["controlState"]) as pm:  # a killed holder leaves no lock behind
        pm.send("controlState", new_message("controlState"))
        with pytest.raises(PublisherBusyError):  # one publisher per service, in this process too
            pub_sock("controlState")
    pub_sock("controlState").close()  # closed: free again
    lock = runtime_dir() / "controlState.pub.lock"
    assert stat.S_IMODE(os.lstat(lock).st_mode) == 0o600


def test_a_pub_master_that_meets_a_busy_service_releases_what_it_took(holder):
    holder("chestnutHealth")
    with pytest.raises(PublisherBusyError):
        PubMaster(["modelOutput", "chestnutHealth"])
    pub_sock("modelOutput").close()  # the first socket's lock was released with the failure


@pytest.mark.parametrize(
    "prefix, shown",
    [("a/b", "'a/b'"), ("", "''"), ("..", "'..'"), ("a b", "'a b'"),
     ("x" * 48 + "/", "'" + "x" * 48 + "'... (49 characters)"),
     ("y" * 5000, "'" + "y" * 48 + "'... (5000 characters)")],  # a long one is cut, never echoed whole
)
def test_a_malformed_prefix_is_one_line_and_exit_2(prefix, shown):
    env = {**os.environ, "CHESTNUT_PREFIX": prefix}
    r = subprocess.run(
        [CHESTNUT, "dump", "cameraFrame", "--count", "1"], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"chestnut dump: CHESTNUT_PREFIX {shown} is not a valid prefix: use 1-48 characters from "
        "[A-Za-z0-9_.-], not '.' or '..' (e.g. CHESTNUT_PREFIX=bench1), or unset CHESTNUT_PREFIX for 'default'"
    ]


def test_a_malformed_prefix_raises_the_prefix_error(monkeypatch):
    monkeypatch.setenv("CHESTNUT_PREFIX", "a/b")
    with pytest.raises(PrefixError):
        current_prefix()
    with pytest.raises(PrefixError):
        runtime_dir("../x")


def _dump_waiting(count: str, *services: str) -> subprocess.Popen:
    """``chestnut dump SERVICES -n COUNT`` started with nothing publishing, once it said so in its one line (SIGINT
    as a terminal's: a shell started in the background ignores it, and children inherit that)."""
    import select
    import signal

    proc = subprocess.Popen([CHESTNUT, "dump", *services, "-n", count], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stderr is not None
        ready, _, _ = select.select([proc.stderr], [], [], 30)
        assert ready, "dump said nothing"
        assert proc.stderr.readline() == (
            f"chestnut dump: nothing publishes {', '.join(services)} on prefix {current_prefix()!r} yet (start a "
            "stack with chestnut launch, or set CHESTNUT_PREFIX to the running stack's); waiting\n"
        )
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return proc


def test_dump_with_no_publisher_says_so_in_one_line_then_waits_for_one():
    import time

    proc = _dump_waiting("1", "controlState")
    try:
        with PubMaster(["controlState"]) as pm:
            for _ in range(600):  # until the late publisher's message reaches it
                if proc.poll() is not None:
                    break
                pm.send("controlState", new_message("controlState"))
                time.sleep(0.05)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and err == ""
    assert len(out.splitlines()) == 1 and " controlState valid=True " in out


def test_dump_n_0_waits_for_a_publisher_then_stops_without_a_message():
    """``-n 0`` ("print none, stop once connected") said "waiting" and exited 0 at once, nothing publishing."""
    import time

    proc = _dump_waiting("0", "controlState", "nodeState")
    try:
        with PubMaster(["controlState"]):
            time.sleep(1.0)
            assert proc.poll() is None  # one of the two publishes: still waiting
            with PubMaster(["nodeState"]):
                out, err = proc.communicate(timeout=30)  # no message sent: a publisher there is enough
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, out, err) == (0, "", "")


def test_dump_n_0_waiting_ends_with_ctrl_c_as_dump_does():
    import signal
    import time

    proc = _dump_waiting("0", "controlState")
    try:
        time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, out, err) == (130, "", "")


def test_dump_with_a_live_publisher_says_nothing_of_it(holder):
    holder("controlState")
    r = subprocess.run([CHESTNUT, "dump", "controlState", "-n", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == ""
    assert " controlState valid=True " in r.stdout
