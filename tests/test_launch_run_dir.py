"""Each ``chestnut launch`` gets a fresh run directory of its own (``launch/rundir.py`` ``make_run_dir``,
``msgs/outdir.py`` ``new_private_dir``): a planted symlink at the run's name is refused in one line and never
followed, a foreign entry is refused, a directory of ours already there (a launch in the same second) is
never reused: the run takes the next ``-N`` suffix. Nothing is written before the check."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from planted import plant_run_names

from chestnut.launch.rundir import make_run_dir
from chestnut.msgs.outdir import OutputDirError, new_private_dir

CHESTNUT = str(Path(sys.executable).with_name("chestnut"))
T0 = time.gmtime(0)
NAME = "1970-01-01--00-00-00"


def _mode(p: Path) -> int:
    return os.lstat(p).st_mode & 0o777


def test_a_symlink_at_the_runs_name_is_refused_and_not_followed(tmp_path):
    runs, victim = tmp_path / "runs", tmp_path / "victim"
    runs.mkdir(mode=0o700)
    victim.mkdir(mode=0o700)
    (runs / NAME).symlink_to(victim)
    with pytest.raises(OutputDirError) as e:
        make_run_dir(runs, T0)
    link = runs.resolve() / NAME
    assert str(e.value) == f"{link} is a symlink (never followed); remove it (rm {link}) and start again"
    assert list(victim.iterdir()) == []  # no logs/ written through it
    assert sorted(p.name for p in runs.iterdir()) == [NAME]


def test_a_dangling_symlink_at_the_runs_name_is_refused(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o700)
    (runs / NAME).symlink_to(tmp_path / "nowhere")
    with pytest.raises(OutputDirError, match="is a symlink"):
        make_run_dir(runs, T0)
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="handing a directory to another uid needs root")
def test_a_foreign_directory_at_the_runs_name_is_refused(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o700)
    (runs / NAME).mkdir(mode=0o777)
    os.chmod(runs / NAME, 0o777)
    os.chown(runs / NAME, 65534, 65534)
    with pytest.raises(OutputDirError) as e:
        make_run_dir(runs, T0)
    path = runs.resolve() / NAME
    assert str(e.value) == f"{path} belongs to uid 65534, not to uid 0; remove it or give another folder"
    assert list((runs / NAME).iterdir()) == []


def test_a_directory_of_ours_at_the_runs_name_is_never_reused(tmp_path):
    runs = tmp_path / "runs"
    old = runs / NAME
    old.mkdir(parents=True, mode=0o700)
    (old / "node.log").write_text("precious\n")
    first = make_run_dir(runs, T0)
    second = make_run_dir(runs, T0)
    assert (first.name, second.name) == (f"{NAME}-2", f"{NAME}-3")
    assert (old / "node.log").read_text() == "precious\n" and sorted(p.name for p in old.iterdir()) == ["node.log"]
    assert [_mode(p) for p in (first, first / "logs", second, second / "logs")] == [0o700] * 4
    assert list((first / "logs").iterdir()) == []


def test_names_run_out_in_one_line(tmp_path):
    (tmp_path / "r" / "x").mkdir(parents=True)
    (tmp_path / "r" / "x-2").mkdir()
    with pytest.raises(OutputDirError) as e:
        new_private_dir(tmp_path / "r", "x", max_tries=2)
    assert str(e.value) == f"{tmp_path / 'r' / 'x'} and 1 suffixed names are all taken; remove old ones"


def test_launch_refuses_a_planted_run_dir_in_one_line(tmp_path):
    runs, victim = tmp_path / "runs", tmp_path / "victim"
    plant_run_names(runs, victim)
    r = subprocess.run(
        [CHESTNUT, "launch", "--seconds", "3", "--no-live", "--runs-dir", str(runs)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    assert " ERROR chestnut.launch: --runs-dir: " in lines[0] and "is a symlink (never followed); remove it" in lines[0]
    assert list(victim.iterdir()) == []
