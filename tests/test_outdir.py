"""Private output directories (``msgs/outdir.py``) and the report writers that use them."""

from __future__ import annotations

import argparse
import logging
import os
import stat
from pathlib import Path

import pytest

from chestnut.msgs.outdir import OutputDirError, open_private, private_dir, write_private


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_new_dir_and_file_are_private(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"
    write_private(out / "index.html", "<p>x</p>")
    assert _mode(out) == 0o700
    assert _mode(tmp_path / "a") == 0o700
    assert _mode(out / "index.html") == 0o600
    assert (out / "index.html").read_text() == "<p>x</p>"
    assert sorted(os.listdir(out)) == ["index.html"]  # no temp file left


def test_symlinked_target_is_refused_and_victim_kept(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "rep"
    out.mkdir(mode=0o700)
    (out / "index.html").symlink_to(victim)
    with pytest.raises(OutputDirError) as e:
        write_private(out / "index.html", "evil")
    target = out / "index.html"
    assert str(e.value) == f"{target} is a symlink; remove it (rm {target}) or give another directory"
    with pytest.raises(OutputDirError):
        private_dir(out, ("timeline.png", "index.html"))
    with pytest.raises(OutputDirError):
        open_private(out / "index.html", "ab")
    assert victim.read_text() == "keep me"
    assert sorted(os.listdir(out)) == ["index.html"]


def test_symlinked_dir_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(OutputDirError) as e:
        write_private(link / "report.json", "{}")
    assert str(e.value) == f"{link} is a symlink; give the real directory or a new path"
    assert os.listdir(real) == []


def test_group_writable_dir_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "shared"
    out.mkdir()
    out.chmod(0o775)
    with pytest.raises(OutputDirError) as e:
        private_dir(out)
    assert str(e.value) == (
        f"{out} is writable by group/other (mode 0775); give a directory of yours (or a new path: it is created 0700)"
    )


def test_existing_empty_dir_of_ours_is_fine(tmp_path: Path) -> None:
    out = tmp_path / "rep"
    out.mkdir(mode=0o755)
    assert private_dir(out, ("index.html",)) == out
    write_private(out / "report.json", "{}")
    assert _mode(out / "report.json") == 0o600
    assert _mode(out) == 0o755  # not ours to chmod


def test_file_in_place_of_dir_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(OutputDirError) as e:
        private_dir(f)
    assert str(e.value) == f"{f} is not a directory; give another directory"


def test_open_private_exclusive(tmp_path: Path) -> None:
    with open_private(tmp_path / "o" / "node.log", "xb") as fh:
        fh.write(b"x")
    assert _mode(tmp_path / "o" / "node.log") == 0o600
    with pytest.raises(OutputDirError) as e:
        open_private(tmp_path / "o" / "node.log", "xb")
    p = tmp_path / "o" / "node.log"
    assert str(e.value) == f"{p} already exists; remove it (rm {p}) or give another path"


def _cli_args(mod: object, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    mod.add_arguments(p)  # type: ignore[attr-defined]
    return p.parse_args(argv)


@pytest.mark.parametrize("command", ["check", "replay"])
def test_report_cli_refuses_planted_symlink(
    tmp_path: Path, command: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    from chestnut.node.offline import check_cli, replay_cli

    mod = check_cli if command == "check" else replay_cli
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    rep = tmp_path / "rep"
    rep.mkdir(mode=0o700)
    (rep / "index.html").symlink_to(victim)
    args = _cli_args(mod, [str(tmp_path / "no-such-log"), "--report", str(rep)])
    with caplog.at_level(logging.ERROR):
        assert mod.run(args) == 2
    assert capsys.readouterr().err == (  # one line on stderr, the program named once
        f"chestnut {command}: --report {rep / 'index.html'} is a symlink; "
        f"remove it (rm {rep / 'index.html'}) or give another directory\n"
    )
    assert caplog.records == []
    assert victim.read_text() == "keep me"


def test_acceptance_refuses_symlinked_report_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from chestnut.launch import acceptance

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "acc"
    out.mkdir(mode=0o700)
    (out / "report.json").symlink_to(victim)
    with pytest.raises(OutputDirError) as e:
        acceptance.write_reports(out, {})
    assert str(e.value).startswith(f"{out / 'report.json'} is a symlink;")
    assert victim.read_text() == "keep me"


def _export(tmp_path: Path, logs: list[Path], out: Path, caplog: pytest.LogCaptureFixture) -> tuple[int, list[str]]:
    from chestnut.msgs import export

    p = argparse.ArgumentParser()
    export.add_arguments(p)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="chestnut.export"):
        rc = export.run(p.parse_args([*map(str, logs), "--mcap", str(out)]))
    return rc, [r.getMessage() for r in caplog.records]


def test_export_from_garbage_leaves_no_file_and_says_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    garbage = tmp_path / "rlog.zst"
    garbage.write_bytes(b"\x00" * 300)
    out = tmp_path / "view.mcap"
    rc, lines = _export(tmp_path, [garbage], out, caplog)
    assert rc == 2
    assert len(lines) == 1
    assert lines[0].startswith(f"nothing exported from {garbage} ({garbage}: byte 0: ")
    assert lines[0].endswith(f"); {out} not written: give a log that chestnut record wrote")
    assert not out.exists()
    assert _export(tmp_path, [garbage], out, caplog)[0] == 2 and not out.exists()  # a rerun is not blocked


def test_export_path_errors_are_one_precise_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from test_logs import every_member_events

    from chestnut.msgs.logfile import RouteWriter
    from chestnut.msgs.messaging import log_from_bytes

    with RouteWriter(tmp_path / "logs", formats=("zst",)) as w:
        for member, data, _ in every_member_events(10**12):
            w.write(member, log_from_bytes(data).logMonoTime, data)
    assert _mode(tmp_path / "logs") == 0o700
    (seg,) = (tmp_path / "logs").iterdir()
    assert _mode(seg) == 0o700 and {_mode(f) for f in seg.iterdir()} == {0o600}
    out = tmp_path / "new" / "view.mcap"
    assert _export(tmp_path, [tmp_path / "logs"], out, caplog) == (
        2, [f"--mcap {out}: folder {out.parent} does not exist; create it or give another path"])
    assert not out.parent.exists()  # an output's folder is never made (model prepare --out, launch --json alike)
    out.parent.mkdir(0o700)
    rc, _ = _export(tmp_path, [tmp_path / "logs"], out, caplog)
    assert rc == 0 and _mode(out) == 0o600
    assert _export(tmp_path, [tmp_path / "logs"], out, caplog) == (
        2,
        [f"--mcap {out} already exists; remove it (rm {out}) or give another path"],
    )
    missing = tmp_path / "nothere"
    rc, lines = _export(tmp_path, [missing], tmp_path / "x.mcap", caplog)
    assert rc == 2 and len(lines) == 1 and "Errno" not in lines[0] and str(missing) in lines[0]
    assert lines[0].endswith("; give log files or directories (rlog.zst / rlog.mcap)")


def test_launch_run_dir_is_private(tmp_path: Path) -> None:
    import time

    from chestnut.launch.rundir import make_run_dir

    run_dir = make_run_dir(tmp_path / "runs", time.gmtime(0))
    assert run_dir == (tmp_path / "runs" / "1970-01-01--00-00-00").resolve()
    assert [_mode(p) for p in (tmp_path / "runs", run_dir, run_dir / "logs")] == [0o700, 0o700, 0o700]
    (tmp_path / "link").symlink_to(tmp_path / "runs")
    with pytest.raises(OutputDirError) as e:
        make_run_dir(tmp_path / "link", time.gmtime(0))
    assert str(e.value) == f"{tmp_path / 'link'} is a symlink; give the real directory or a new path"


def test_prepared_model_files_are_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tinymodel import make_tiny_onnx

    from chestnut.launch.assets import prepare_model

    monkeypatch.setenv("CHESTNUT_CACHE", str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    prepare_model(make_tiny_onnx(tmp_path / "tiny.onnx"), models / "m.onnx", (1, 3, 32, 64), None)
    assert _mode(tmp_path / "cache") == 0o700 and _mode(models) == 0o700
    assert {p.name: _mode(p) for p in models.iterdir()} == {
        "m.onnx": 0o600,
        "m.json": 0o600,
        "m.fingerprint.json": 0o600,
    }


def test_report_files_are_private_and_a_rerun_replaces_them(tmp_path: Path) -> None:
    import time

    from chestnut.msgs.logfile import RouteWriter
    from chestnut.msgs.messaging import new_message
    from chestnut.node.offline.report import write_report
    from chestnut.node.offline.timeline import read_timeline

    with RouteWriter(tmp_path / "logs", formats=("zst",)) as w:
        m = new_message("nodeState")
        m.nodeState.state = "active"
        m.logMonoTime = time.monotonic_ns()
        w.write("nodeState", m.logMonoTime, m.to_bytes())
    tl = read_timeline(tmp_path / "logs")
    rep = tmp_path / "rep"
    for _ in range(2):
        assert write_report(rep, tl) == rep / "index.html"
        assert _mode(rep) == 0o700
        assert {p.name: _mode(p) for p in rep.iterdir()} == {
            "index.html": 0o600,
            "timeline.png": 0o600,
            "agreement.png": 0o600,
            "latency.png": 0o600,
        }


def test_acceptance_refuses_a_symlinked_out_before_any_step(
    tmp_path: Path, tiny_onnx: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from chestnut.launch import acceptance

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "acc"
    out.mkdir(mode=0o700)
    (out / "node.log").symlink_to(victim)
    p = argparse.ArgumentParser()
    acceptance.add_arguments(p)
    args = p.parse_args(["--twin", "--out", str(out), "--model", str(tiny_onnx)])
    assert acceptance.run(args) == 2
    target = out / "node.log"
    assert capsys.readouterr().err == (
        f"chestnut acceptance: --out {target} is a symlink; remove it (rm {target}) or give another directory\n"
    )
    assert victim.read_text() == "keep me" and sorted(os.listdir(out)) == ["node.log"]


# ---------------------------------------------------------------- the folders above an output


SHARED_FIX = "give a path whose folders only you (or root) can change"


def _world_writable(tmp_path: Path, mode: int = 0o777) -> Path:
    ww = tmp_path / "ww"
    ww.mkdir()
    ww.chmod(mode)  # no sticky bit: anyone may rename or replace what we create in it
    return ww


def _small_log(tmp_path: Path) -> Path:
    from test_logs import every_member_events

    from chestnut.msgs.logfile import RouteWriter
    from chestnut.msgs.messaging import log_from_bytes

    with RouteWriter(tmp_path / "logs", formats=("zst",)) as w:
        for member, data, _ in every_member_events(10**12):
            w.write(member, log_from_bytes(data).logMonoTime, data)
    return tmp_path / "logs"


@pytest.mark.parametrize("command", ["check", "replay", "fleet", "record", "export", "acceptance", "launch"])
def test_every_command_refuses_a_new_output_in_a_world_writable_folder_and_creates_nothing(
    tmp_path: Path,
    command: str,
    tiny_onnx: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from chestnut.launch.cli import main

    ww = _world_writable(tmp_path)
    where = ww.resolve()
    if command == "launch":  # its run directory (launch/stack.py): the same call, without starting a stack
        from chestnut.launch.rundir import make_run_dir

        with pytest.raises(OutputDirError) as e:
            make_run_dir(ww / "runs")
        assert str(e.value) == (
            f"{where} (above {ww / 'runs'}) is writable by group/other without the sticky bit (mode 0777); "
            f"{SHARED_FIX}"
        )
        assert list(ww.iterdir()) == []
        return
    logs = _small_log(tmp_path) if command in ("fleet", "export") else tmp_path / "no-such-log"
    argv, out, prefix = {
        "check": (["check", str(logs), "--report"], ww / "r", "chestnut check: --report "),
        "replay": (["replay", str(logs), "--report"], ww / "r", "chestnut replay: --report "),
        "fleet": (["fleet", "make", "--from", str(logs), "--copies", "2"], ww / "fl", "chestnut fleet make: OUT "),
        "record": (["record", "--log-dir"], ww / "l", "--log-dir "),
        "export": (["export", str(logs), "--mcap"], ww / "out.mcap", "--mcap "),  # its folder is never made
        "acceptance": (["acceptance", "--twin", "--model", str(tiny_onnx), "--out"], ww / "acc",
                       "chestnut acceptance: --out "),
    }[command]
    caplog.clear()
    assert main([*argv, str(out)]) == 2
    line = f"{prefix}{where} (above {out}) is writable by group/other without the sticky bit (mode 0777); {SHARED_FIX}"
    if command == "export":  # a file in ww itself: ww is the folder it is written in, named as the file's folder
        line = (f"{prefix}{out} is in folder {ww}, which is writable by group/other (mode 0777); give a file path in "
                "a folder of yours")
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    if command in ("acceptance", "check", "replay", "fleet"):  # a refusal of the command line: one line on stderr
        assert errors == [] and capsys.readouterr().err == line + "\n"
    else:
        assert errors == [line]
    assert list(ww.iterdir()) == []


def test_a_folder_above_that_others_may_write_is_refused_for_an_existing_output_too(tmp_path: Path) -> None:
    ww = _world_writable(tmp_path, 0o775)  # group-writable is the same: another user could swap what is in it
    (ww / "a").mkdir(mode=0o700)
    for out in (ww / "a", ww / "a" / "b" / "c"):
        with pytest.raises(OutputDirError) as e:
            private_dir(out)
        assert str(e.value) == (
            f"{ww.resolve()} (above {out}) is writable by group/other without the sticky bit (mode 0775); {SHARED_FIX}"
        )
        with pytest.raises(OutputDirError):
            write_private(out / "report.json", "{}")
    assert os.listdir(ww) == ["a"] and os.listdir(ww / "a") == []


def test_a_sticky_world_writable_folder_like_tmp_may_hold_a_new_output_but_is_no_output_itself(tmp_path: Path) -> None:
    sticky = _world_writable(tmp_path, 0o1777)  # as /tmp: no one else can rename or remove what we make there
    out = private_dir(sticky / "r" / "s")
    assert out == sticky / "r" / "s" and _mode(sticky / "r") == _mode(out) == 0o700
    write_private(sticky / "r" / "report.json", "{}")
    with pytest.raises(OutputDirError) as e:  # a file straight in it: the folder itself is refused, as ever
        write_private(sticky / "report.json", "{}")
    assert str(e.value) == (
        f"{sticky} is writable by group/other (mode 1777); "
        "give a directory of yours (or a new path: it is created 0700)"
    )
    assert sorted(os.listdir(sticky)) == ["r"]


@pytest.mark.skipif(os.getuid() != 0, reason="handing a folder to another uid needs root")
def test_a_folder_above_that_another_user_owns_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)  # its owner may rename what is in it, whatever its mode
    with pytest.raises(OutputDirError) as e:
        private_dir(theirs / "r")
    assert str(e.value) == (
        f"{theirs.resolve()} (above {theirs / 'r'}) belongs to uid 65534, not to root; {SHARED_FIX}"
    )
    assert os.listdir(theirs) == []


def test_export_to_a_symlink_asks_for_another_path(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``chestnut export LOG --mcap <symlink>`` said "or give another directory": OUT is a file path."""
    from chestnut.launch.cli import main

    logs = _small_log(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    link = tmp_path / "out.mcap"
    link.symlink_to(victim)
    caplog.clear()
    assert main(["export", str(logs), "--mcap", str(link)]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [f"--mcap {link} is a symlink; remove it (rm {link}) or give another path"]
    assert victim.read_text() == "keep"
