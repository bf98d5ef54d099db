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
