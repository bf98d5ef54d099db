"""What a user trial of the offline commands found (``chestnut check``, ``replay``, ``export``, ``fleet make``,
``camera``, ``record``), each pinned by its exact line and exit status:

1. a path the OS cannot look up (too long: ``ENAMETOOLONG``; through a regular file: ``ENOTDIR``; a symlink loop:
   ``ELOOP``) was a traceback, exit 1 (``check``'s "violations" status): now one line naming the path and the
   OS's reason, exit 2 (``msgs/logfile.py`` ``LogPathError``, ``msgs/outdir.py`` ``os_reason``);
2. a folder of ``chestnut record``'s default ``rlog.mcap`` only (JSON channels) was "0 frames ... 0 mismatch(es)",
   exit 0, with its WARNING twice: now the WARNING once and one line naming the file and the rlog.zst to give,
   exit 2 (``node/offline/fleet_cli.py`` ``readable_logs``);
3. ``export --mcap`` advice: a folder of the user's was told "remove it", a device "give another directory",
   a file in ``/tmp`` "give a directory of yours" (``msgs/outdir.py`` ``open_private``, ``_check_target``);
4. ``check LOG | head`` exited 1, silently: now 141 (``fleet_cli.py`` ``stdout_console``, ``launch/cli.py``);
5. ``record --prefix ../x`` was refused after the route's first segment files were made: now before anything.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chestnut.launch.cli import main

CHESTNUT = "import sys; from chestnut.launch.cli import main; sys.exit(main(sys.argv[1:]))"
LOG_FIX = "give a log file (rlog.zst / rlog.mcap) or a folder of them"
LONG_NAME = "x" * 300  # over NAME_MAX (255 bytes on Linux): ENAMETOOLONG
JSON_FIX = "give the rlog.zst written beside it (or a log recorded with --mcap-encoding both)"
NO_RLOG_FIX = ("there is no rlog.zst beside it; chestnut record writes a log that check and replay read with "
               "--mcap-encoding capnproto or both, or in its default format (an rlog.zst beside the MCAP)")


def _errors(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING]


@pytest.fixture
def zst_log(tmp_path: Path) -> Path:
    from drivelog import write_one_message_log

    return write_one_message_log(tmp_path / "logs")


@pytest.fixture
def json_only(tmp_path: Path) -> Path:
    """A folder holding only the ``rlog.mcap`` that ``chestnut record`` writes beside an rlog by default (JSON
    channels only, ``--mcap-encoding auto``); returns that file."""
    from drivelog import MS, _clock_at, _msg

    from chestnut.msgs.logfile import RouteWriter

    m = _msg("nodeState", 10_000 * 1_000_000_000)
    m.nodeState.state = "active"
    now = [m.logMonoTime - MS]
    with _clock_at(now), RouteWriter(tmp_path / "view", formats=("mcap",), mcap_encodings=("json",),
                                     clock=lambda: now[0] / 1e9, route="2026-01-01--00-00-00") as w:
        now[0] = m.logMonoTime
        w.write("nodeState", m.logMonoTime, m.to_bytes())
    (f,) = (tmp_path / "view").glob("*/rlog.mcap")
    return f


def _unusable(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A path of ``kind`` and the OS's words for it (``strerror(3)``, lower case)."""
    if kind == "too long":
        return tmp_path / LONG_NAME, "file name too long"
    if kind == "through a file":
        (tmp_path / "regular").write_text("")
        return tmp_path / "regular" / "x", "not a directory"
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    return tmp_path / "loop1", "too many levels of symbolic links"


KINDS = ["too long", "through a file", "symlink loop"]


# ---------------------------------------------------------------- 1. paths the OS cannot look up


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", ["check", "replay"])
def test_a_log_path_the_os_cannot_look_up_is_one_line_exit_2(command, kind, tmp_path, caplog) -> None:
    path, reason = _unusable(tmp_path, kind)
    assert main([command, str(path)]) == 2
    assert _errors(caplog, f"chestnut.{command}") == [f"{path}: {reason}; {LOG_FIX}"]


@pytest.mark.parametrize("kind", KINDS)
def test_export_of_a_log_path_the_os_cannot_look_up_is_one_line_exit_2_and_writes_nothing(kind, tmp_path,
                                                                                           caplog) -> None:
    path, reason = _unusable(tmp_path, kind)
    (tmp_path / "out").mkdir(mode=0o700)
    assert main(["export", str(path), "--mcap", str(tmp_path / "out" / "e.mcap")]) == 2
    assert _errors(caplog, "chestnut.export") == [f"LOG {path}: {reason}; {LOG_FIX}"]
    assert os.listdir(tmp_path / "out") == []


@pytest.mark.parametrize("kind", KINDS)
def test_fleet_make_from_a_path_the_os_cannot_look_up_is_one_line_exit_2(kind, tmp_path, capsys) -> None:
    path, reason = _unusable(tmp_path, kind)
    assert main(["fleet", "make", "--from", str(path), "--copies", "2", str(tmp_path / "fleet")]) == 2
    assert capsys.readouterr().err == f"chestnut fleet make: {path}: {reason}; {LOG_FIX}\n"
    assert not (tmp_path / "fleet").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_a_camera_source_the_os_cannot_look_up_is_one_line_exit_2(kind, tmp_path, caplog) -> None:
    path, reason = _unusable(tmp_path, kind)
    assert main(["camera", "--source", str(path)]) == 2
    assert _errors(caplog, "chestnut.camera") == [
        f"camera source {path}: {reason}; give a video, an image folder or an image"
    ]


def test_an_export_file_name_too_long_is_one_line_exit_2(zst_log, tmp_path, caplog) -> None:
    (tmp_path / "out").mkdir(mode=0o700)
    out = tmp_path / "out" / f"{'y' * 300}.mcap"
    assert main(["export", str(zst_log), "--mcap", str(out)]) == 2
    assert _errors(caplog, "chestnut.export") == [
        f"--mcap {out} cannot be examined (file name too long); give another path"
    ]
    assert os.listdir(tmp_path / "out") == []


# ---------------------------------------------------------------- 2. a log of JSON channels only


@pytest.mark.parametrize("command", ["check", "replay"])
def test_a_folder_of_json_only_mcap_is_one_line_exit_2(command, json_only, caplog, capsys) -> None:
    """Nothing left to read: the refusal alone (the file's own WARNING said the same a line earlier). No rlog.zst
    beside it (``record --format mcap --mcap-encoding json``): it was told to give the rlog.zst beside it."""
    assert main([command, str(json_only.parent.parent)]) == 2
    assert _errors(caplog, "chestnut.logs") == []
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"chestnut {command}: nothing to {command} in {json_only} (JSON channels only): "
                            f"{NO_RLOG_FIX}\n")


@pytest.mark.parametrize("command", ["check", "replay"])
def test_a_json_only_mcap_named_beside_its_rlog_names_the_rlog_to_give(command, json_only, zst_log, capsys) -> None:
    """``record``'s default: an rlog.zst beside the JSON view, which the user named instead of the folder."""
    (rlog,) = zst_log.rglob("rlog.zst")
    rlog.rename(json_only.parent / "rlog.zst")
    assert main([command, str(json_only)]) == 2
    assert capsys.readouterr() == ("", f"chestnut {command}: nothing to {command} in {json_only} (JSON channels "
                                       f"only): {JSON_FIX}\n")


def test_a_json_only_mcap_beside_a_readable_log_is_left_out_with_its_warning_once(json_only, zst_log, caplog,
                                                                                   capsys) -> None:
    assert main(["check", str(json_only), str(zst_log)]) == 0
    assert _errors(caplog, "chestnut.logs") == [
        f"{json_only} holds only JSON channels (a Foxglove view, msgs/jsonschema.py): {NO_RLOG_FIX}"
    ]
    assert capsys.readouterr().out.splitlines()[-1] == "0 violation(s)"


# ---------------------------------------------------------------- 3. export --mcap advice


def test_export_onto_a_folder_asks_for_a_file_path_inside_it_and_keeps_it(zst_log, tmp_path, caplog) -> None:
    folder = tmp_path / "mine"
    folder.mkdir(mode=0o700)
    (folder / "keep.txt").write_text("mine")
    assert main(["export", str(zst_log), "--mcap", str(folder)]) == 2
    assert _errors(caplog, "chestnut.export") == [
        f"--mcap {folder} is a directory, not a file; give a file path inside it ({folder}/NAME) or another file path"
    ]
    assert os.listdir(folder) == ["keep.txt"]


def test_export_onto_a_fifo_asks_for_another_file_path(zst_log, tmp_path, caplog) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert main(["export", str(zst_log), "--mcap", str(fifo)]) == 2
    assert _errors(caplog, "chestnut.export") == [
        f"--mcap {fifo} is a FIFO, not a regular file; give another file path"
    ]


@pytest.mark.skipif(os.getuid() != 0, reason="/dev is root's: only root gets past its folder to the device")
def test_export_onto_dev_full_asks_for_another_file_path(zst_log, caplog) -> None:
    assert main(["export", str(zst_log), "--mcap", "/dev/full"]) == 2
    assert _errors(caplog, "chestnut.export") == [
        "--mcap /dev/full is a character device, not a regular file; give another file path"
    ]


def test_export_into_a_shared_sticky_folder_names_the_files_folder_and_asks_for_a_folder_of_yours(
        zst_log, tmp_path, caplog) -> None:
    sticky = tmp_path / "sticky"  # as /tmp (README: "/tmp itself is no output folder")
    sticky.mkdir()
    sticky.chmod(0o1777)
    out = sticky / "x_trial.mcap"
    assert main(["export", str(zst_log), "--mcap", str(out)]) == 2
    assert _errors(caplog, "chestnut.export") == [
        f"--mcap {out} is in folder {sticky}, which is writable by group/other (mode 1777); "
        "give a file path in a folder of yours"
    ]
    assert os.listdir(sticky) == []


# ---------------------------------------------------------------- 4. a closed output pipe


@pytest.mark.parametrize("command", ["check", "replay"])
def test_output_to_a_reader_that_went_away_is_exit_141_quietly(command, zst_log) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line (`| head -0`)
    try:
        proc = subprocess.Popen([sys.executable, "-c", CHESTNUT, command, str(zst_log)], stdout=write_end,
                                stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (141, "")


# ---------------------------------------------------------------- 5. record --prefix


@pytest.mark.parametrize("given", ["missing", "existing"])
def test_record_refuses_a_bad_prefix_before_it_makes_anything(given, tmp_path, capsys) -> None:
    log_dir = tmp_path / "logs"
    if given == "existing":
        log_dir.mkdir(mode=0o700)
    assert main(["record", "--log-dir", str(log_dir), "--prefix", "../x"]) == 2
    assert capsys.readouterr().err == (
        "chestnut record: prefix '../x' is not a valid prefix: use 1-48 characters from [A-Za-z0-9_.-], not '.' or "
        "'..' (e.g. CHESTNUT_PREFIX=bench1), or unset CHESTNUT_PREFIX for 'default'\n"
    )
    assert (os.listdir(log_dir) == []) if given == "existing" else not log_dir.exists()


# ---------------------------------------------------------------- 6. record --format mcap --mcap-encoding json


def _record_until_written(log_dir: Path, caplog: pytest.LogCaptureFixture, *args: str) -> tuple[int, list[str]]:
    """``chestnut record --log-dir LOG_DIR ARGS`` in this process, stopped (SIGINT, its Ctrl-C) once its first log
    file is there; its exit status and its WARNING lines and worse."""
    import signal
    import threading
    import time

    def stop() -> None:
        deadline = time.monotonic() + 30
        while not list(log_dir.glob("*/rlog.*")) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)  # record's own handler (installed before its first file) takes it

    stopper = threading.Thread(target=stop)
    stopper.start()
    try:
        rc = main(["record", "--log-dir", str(log_dir), "--services", "nodeState", *args])
    finally:
        stopper.join()
    return rc, _errors(caplog, "chestnut.record")


JSON_ONLY_WARNING = ("--format mcap --mcap-encoding json writes JSON channels only and no rlog.zst: Foxglove opens "
                     "the log, but chestnut check and replay cannot read it (--mcap-encoding capnproto or both, or "
                     "the default --format both, writes a log they read)")


@pytest.mark.parametrize(("args", "warned"), [
    (["--format", "mcap", "--mcap-encoding", "json"], [JSON_ONLY_WARNING]),
    (["--format", "mcap"], []),  # auto: both encodings
    (["--mcap-encoding", "json"], []),  # the rlog.zst beside it
    (["--format", "mcap", "--mcap-encoding", "capnproto"], []),
])
def test_record_says_once_at_the_start_that_a_json_only_log_cannot_be_checked(args, warned, tmp_path,
                                                                                caplog) -> None:
    """It recorded in silence, exit 0, and check's refusal then named an rlog.zst that is not there."""
    assert _record_until_written(tmp_path / "logs", caplog, *args) == (0, warned)


def test_check_of_a_json_only_recording_says_how_to_record_one_it_reads(tmp_path, caplog, capsys) -> None:
    log_dir = tmp_path / "logs"
    assert _record_until_written(log_dir, caplog, "--format", "mcap", "--mcap-encoding", "json") == (
        0, [JSON_ONLY_WARNING])
    (mcap,) = log_dir.glob("*/rlog.mcap")
    capsys.readouterr()
    assert main(["check", str(log_dir)]) == 2
    assert capsys.readouterr() == ("", f"chestnut check: nothing to check in {mcap} (JSON channels only): "
                                       f"{NO_RLOG_FIX}\n")
