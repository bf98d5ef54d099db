"""``chestnut probe --twin`` with no twin daemon running says so first, with how to start it
(``backend/probe.py`` ``twin_daemon_missing``): it led with the ladder's ``[FAIL] usb_ids ... no Chestnut dock found``
and a dock's cable-and-power advice, and the daemon hint came last."""

from __future__ import annotations

import os

import pytest

from chestnut.launch.cli import main
from chestnut.msgs.paths import runtime_dir

pytestmark = [pytest.mark.timeout(60)]


def test_no_twin_daemon_is_one_line_saying_how_to_start_it_and_no_ladder(capsys):
    prefix = os.environ["CHESTNUT_PREFIX"]
    assert main(["probe", "--twin"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"chestnut probe: the twin daemon is not running on prefix {prefix!r}: start it with `chestnut twin "
                   f"--prefix {prefix} serve` (or run a whole stack with `chestnut launch`), then probe again\n")


def test_the_default_prefix_needs_no_prefix_in_the_hint_and_json_gets_the_same_line(capsys, run_base):
    assert main(["probe", "--twin", "--prefix", "default", "--json"]) == 1
    assert capsys.readouterr() == ("", "chestnut probe: the twin daemon is not running on prefix 'default': start it "
                                       "with `chestnut twin serve` (or run a whole stack with `chestnut launch`), then "
                                       "probe again\n")


def test_something_planted_at_the_twin_socket_is_refused_as_chestnut_twin_does(capsys):
    sock = runtime_dir() / "twin.sock"
    sock.mkdir()
    assert main(["probe", "--twin"]) == 2
    assert capsys.readouterr() == ("", f"chestnut probe: socket path {sock} holds a directory, not a socket: refused, "
                                       "nothing replaced; remove it and start again\n")


def test_a_fingerprint_that_cannot_be_recorded_closes_the_runner_before_the_exit(capsys, monkeypatch, tmp_path):
    """The runner (a real dock's claimed USB interface, the twin's connection) goes back on every exit of the probe:
    it stayed open when the fingerprint could not be recorded."""
    import chestnut.backend.fingerprint as fingerprint
    import chestnut.backend.probe as probe
    import chestnut.backend.twin_runner as twin_runner
    from chestnut.backend.errors import ChestnutError

    closed = []

    class Runner:
        prefix = "p"

        def __init__(self, *args, **kwargs) -> None:
            pass

        def close(self) -> None:
            closed.append(True)

    def no_fingerprint(spec):
        raise ChestnutError("bad_model", "not an ONNX model")

    monkeypatch.setattr(probe, "twin_daemon_missing", lambda prefix: None)
    monkeypatch.setattr(twin_runner, "TwinRunner", Runner)
    monkeypatch.setattr(fingerprint, "record_fingerprint", no_fingerprint)
    model = tmp_path / "m.onnx"
    model.write_bytes(b"not onnx")
    assert main(["probe", "--twin", "--model", str(model)]) == 2
    assert capsys.readouterr().err == "chestnut probe: no fingerprint for m: bad_model: not an ONNX model\n"
    assert closed == [True]


def test_the_nodes_look_at_a_twin_nobody_runs_names_the_missing_daemon():
    """``chestnut run`` (dock.kind = twin) with no twin daemon looped on 'no Chestnut dock enumerated', a dock's
    cable and power, where probe names the daemon and how to start it."""
    from chestnut.node.docklook import look

    prefix = os.environ["CHESTNUT_PREFIX"]
    assert look("twin", prefix) == (False, f"no Chestnut dock enumerated: the twin daemon is not running on prefix "
                                           f"{prefix!r}: start it with `chestnut twin --prefix {prefix} serve` (or run "
                                           "a whole stack with `chestnut launch`)", None)


def test_the_ladder_on_a_twin_nobody_runs_says_how_to_start_it():
    """The node's first ``dock_absent`` comes from its worker's ``usb_ids`` rung: it said ``no Chestnut dock found (no
    USB device ... enumerated)``, a dock's cable and power, where every later one, from the node's own looks
    (``node/docklook.py``), said that the twin daemon is not running and how to start it."""
    from chestnut.backend.twin_runner import TwinRunner

    prefix = os.environ["CHESTNUT_PREFIX"]
    runner = TwinRunner(prefix)
    try:
        failure = runner.qualify().first_failure
    finally:
        runner.close()
    assert failure is not None and failure.name == "usb_ids"
    assert str(failure.error) == (
        "no_dock: no Chestnut dock found (no USB device 0xADD1:0x0001, 0x3801:0x0001 enumerated): the twin daemon is "
        f"not running on prefix {prefix!r}: start it with `chestnut twin --prefix {prefix} serve` (or run a whole "
        "stack with `chestnut launch`)")
