"""``chestnut fleet make``: what it makes is what ``chestnut check`` and ``replay`` read, and what it cannot copy is
refused in one line, exit 2, before anything is written (``node/offline/fleet.py`` ``make_fleet``,
``node/offline/fleet_cli.py``):

1. a log file of another name (``odd/copy_rlog.zst``) was copied under that name, where check and replay never look
   ("no rlog.zst/mcap under OUT", exit 2): the copies are ``rlog.zst`` / ``rlog.mcap``, the route named after the
   file without its format suffix.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from chestnut.launch.cli import main
from chestnut.msgs.logfile import find_log_files


def _log(log_dir: Path, fmt: str = "zst") -> Path:
    """A log of one ``nodeState`` in ``fmt`` (one segment) under ``log_dir``; returns its log file."""
    from drivelog import _msg, write_drive

    m = _msg("nodeState", 10_000 * 1_000_000_000)
    m.nodeState.state = "active"
    (seg,) = write_drive([(m.logMonoTime, m.which(), m.to_bytes())], log_dir, formats=(fmt,))
    return seg / f"rlog.{fmt}"


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ---------------------------------------------------------------- 1. the copies are named as the readers look


@pytest.mark.parametrize("fmt", ["zst", "mcap"])
def test_a_log_file_of_another_name_is_copied_as_the_readers_find_it(fmt, tmp_path, capsys) -> None:
    (tmp_path / "odd").mkdir()
    src = _log(tmp_path / "logs", fmt).rename(tmp_path / "odd" / f"copy_rlog.{fmt}")
    out = tmp_path / "fleet"
    assert main(["fleet", "make", "--from", str(src), "--copies", "2", str(out)]) == 0
    assert capsys.readouterr().out == f"2 route(s), 2 segment(s) in {out}\n"
    assert _tree(out) == ["copy_rlog-00001--0", f"copy_rlog-00001--0/rlog.{fmt}",
                          "copy_rlog-00002--0", f"copy_rlog-00002--0/rlog.{fmt}"]
    copies = [out / "copy_rlog-00001--0" / f"rlog.{fmt}", out / "copy_rlog-00002--0" / f"rlog.{fmt}"]
    assert find_log_files(out) == copies  # check's and replay's own search of a folder
    assert [c.read_bytes() == src.read_bytes() for c in copies] == [True, True]
    assert main(["check", str(out)]) == 0
    assert "chestnut check: 2 log(s), worst first" in capsys.readouterr().out


def test_a_segments_log_file_of_another_name_keeps_its_route_and_segment(tmp_path, capsys) -> None:
    src = _log(tmp_path / "logs")
    src = src.rename(src.parent / "qlog-like.zst")
    out = tmp_path / "fleet"
    assert main(["fleet", "make", "--from", str(src), "--copies", "1", str(out)]) == 0
    assert capsys.readouterr().out == f"1 route(s), 1 segment(s) in {out}\n"
    assert _tree(out) == ["2026-01-01--00-00-00-00001--0", "2026-01-01--00-00-00-00001--0/rlog.zst"]
