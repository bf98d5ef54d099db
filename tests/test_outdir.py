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
def test_report_cli_refuses_planted_symlink(tmp_path: Path, command: str, caplog: pytest.LogCaptureFixture) -> None:
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
    assert [r.getMessage() for r in caplog.records] == [
        f"chestnut {command}: --report {rep / 'index.html'} is a symlink; "
        f"remove it (rm {rep / 'index.html'}) or give another directory"
    ]
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
