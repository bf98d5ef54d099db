"""``chestnut launch --json FILE``: the target is checked before the run (a typo never costs a run) and the
summary is written 0600, never through a symlink."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from chestnut.launch.summary import json_target_problem, write_summary_json


def test_a_missing_folder_is_named_before_the_run(tmp_path: Path):
    target = tmp_path / "nope" / "s.json"
    assert json_target_problem(target) == (
        f"{target}: folder {target.parent} does not exist; create it or give another path"
    )


def test_a_planted_symlink_is_refused_and_its_target_untouched(tmp_path: Path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    link = tmp_path / "s.json"
    link.symlink_to(victim)
    problem = write_summary_json(link, {"outputs": 1})
    assert problem == f"{link} is a symlink: remove it (rm {link}) or give another path"
    assert victim.read_text() == "keep"


def test_a_folder_in_the_way_is_refused(tmp_path: Path):
    (target := tmp_path / "s.json").mkdir()
    assert json_target_problem(target) == f"{target} exists and is not a regular file; give another path"


def test_the_summary_is_written_private_and_replaces_an_old_one(tmp_path: Path):
    target = tmp_path / "s.json"
    target.write_text("x" * 1000)
    os.chmod(target, 0o644)  # an old summary another tool wrote: replaced, its mode not kept
    assert write_summary_json(target, {"outputs": 3, "stop_s": 1.5}) is None
    assert json.loads(target.read_text()) == {"outputs": 3, "stop_s": 1.5}
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    fresh = tmp_path / "t.json"
    assert write_summary_json(fresh, {}) is None
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "t.json"]  # no temporary file left


def test_a_folder_others_can_write_to_is_refused_before_the_run(tmp_path: Path):
    """``--json /tmp/s.json`` was accepted: another user could put a symlink or a file of theirs there."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    target = shared / "s.json"
    line = (f"{target}: folder {shared} is writable by group/other (mode 1777); give a folder of yours that no one "
            "else can write to")
    assert json_target_problem(target) == line
    assert write_summary_json(target, {"outputs": 1}) == line
    shared.chmod(0o770)
    assert json_target_problem(target) == line.replace("mode 1777", "mode 0770")
    assert list(shared.iterdir()) == []


def test_a_symlinked_folder_is_refused_and_nothing_is_written_through_it(tmp_path: Path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    target = link / "s.json"
    line = f"{target}: folder {link} is a symlink; give a folder of yours that no one else can write to"
    assert json_target_problem(target) == line
    assert write_summary_json(target, {"outputs": 1}) == line
    assert list(real.iterdir()) == []


def test_a_folder_swapped_for_a_symlink_after_the_check_is_not_written_through(tmp_path: Path, monkeypatch):
    """The check passes, then the folder becomes a symlink before the write: the write refuses it too."""
    from chestnut.launch import summary

    real, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    elsewhere.mkdir(mode=0o700)
    target = real / "s.json"
    checked = summary.json_target_problem

    def check_then_swap(path: Path) -> str | None:
        problem = checked(path)
        real.rename(tmp_path / "moved")
        real.symlink_to(elsewhere)
        return problem

    monkeypatch.setattr(summary, "json_target_problem", check_then_swap)
    assert write_summary_json(target, {"outputs": 1}) == (
        f"{real} is a symlink; give the real directory or a new path")
    assert list(elsewhere.iterdir()) == []


def test_the_launch_refuses_a_shared_json_folder_before_anything_starts(tmp_path: Path):
    import subprocess
    import sys

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    r = subprocess.run([str(Path(sys.executable).with_name("chestnut")), "launch", "--seconds", "3", "--no-live",
                        "--runs-dir", str(tmp_path / "runs"), "--json", str(shared / "s.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = r.stderr.splitlines()
    assert line.endswith(f" ERROR chestnut.launch: --json: {shared / 's.json'}: folder {shared} is writable by "
                         "group/other (mode 1777); give a folder of yours that no one else can write to")
    assert not (tmp_path / "runs").exists()
