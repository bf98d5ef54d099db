"""``chestnut fleet make``: what it makes is what ``chestnut check`` and ``replay`` read, and what it cannot copy is
refused in one line, exit 2, before anything is written (``node/offline/fleet.py`` ``make_fleet``,
``node/offline/fleet_cli.py``):

1. a log file of another name (``odd/copy_rlog.zst``) was copied under that name, where check and replay never look
   ("no rlog.zst/mcap under OUT", exit 2): the copies are ``rlog.zst`` / ``rlog.mcap``, the route named after the
   file without its format suffix;
2. a source that is no log (a 0-byte file, 5000 random bytes) was copied ("2 route(s), 2 segment(s)", exit 0): it is
   read up to its first message with the reader check reads with, and refused, one line naming it and why; a clean
   log of zero messages (its writer closed before the first), which check reads as 0 frames, was then refused ("not a
   readable log (the log holds no message)"): it is copied as any other;
3. a FIFO ``rlog.zst`` in the ``--from`` folder refused the whole folder, where check and replay skip it with one
   WARNING: fleet make skips it the same way (never opened) and copies the rest;
4. an empty ``--from ''`` or ``OUT ''`` was the current folder (``Path('')`` is ``Path('.')``): the copies were written
   into it; now the parser's one line naming the argument, exit 2;
5. two logs under ``--from`` whose copies share their route ids (the same route in two folders, two loose
   ``rlog.zst``) stopped halfway with ``[Errno 17] File exists: ...``: now one line naming both, before anything is
   written;
6. a log file the copy cannot read (``EACCES``, ``EIO``) was a traceback: one line naming it, what was made removed.
"""

from __future__ import annotations

import os
import random
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


def _json_only(log_dir: Path) -> Path:
    """The ``rlog.mcap`` of JSON channels only that ``chestnut record`` writes beside an rlog by default."""
    from drivelog import MS, _clock_at, _msg

    from chestnut.msgs.logfile import RouteWriter

    m = _msg("nodeState", 10_000 * 1_000_000_000)
    m.nodeState.state = "active"
    now = [m.logMonoTime - MS]
    with _clock_at(now), RouteWriter(log_dir, formats=("mcap",), mcap_encodings=("json",),
                                     clock=lambda: now[0] / 1e9, route="2026-01-01--00-00-00") as w:
        now[0] = m.logMonoTime
        w.write("nodeState", m.logMonoTime, m.to_bytes())
    (f,) = log_dir.glob("*/rlog.mcap")
    return f


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


# ---------------------------------------------------------------- 2. a source that is no log is refused


READABLE_FIX = "give a log that chestnut check reads (rlog.zst / rlog.mcap) or a folder of them"
RANDOM = random.Random(0).randbytes(5000)


@pytest.mark.parametrize(("name", "data", "why"), [
    ("empty.zst", b"", "not a readable log (byte 0: empty file)"),
    ("random.zst", RANDOM, "not a readable log (byte 0: zstd: zstd decompressor error: Unknown frame descriptor)"),
    ("empty.mcap", b"", "not a readable log (byte 0: empty file)"),
    ("random.mcap", RANDOM, "not a readable log (byte 0: not an MCAP file (bad magic))"),
    ("random.bin", RANDOM, "not a log file (expected a .zst or .mcap suffix)"),
], ids=["empty-zst", "random-zst", "empty-mcap", "random-mcap", "random-bin"])
@pytest.mark.parametrize("out_there", [False, True], ids=["new-out", "empty-out"])
def test_a_file_that_is_no_log_is_refused_in_one_line_and_nothing_is_written(name, data, why, out_there, tmp_path,
                                                                              capsys) -> None:
    src = tmp_path / name
    src.write_bytes(data)
    out = tmp_path / "fleet"
    if out_there:
        out.mkdir(mode=0o700)
    assert main(["fleet", "make", "--from", str(src), "--copies", "2", str(out)]) == 2
    assert capsys.readouterr() == ("", f"chestnut fleet make: {src}: {why}; {READABLE_FIX}\n")
    assert (_tree(out) if out_there else out.exists()) == ([] if out_there else False)


@pytest.mark.parametrize("rlog_beside", [True, False])
def test_a_json_only_mcap_is_refused_with_the_rlog_to_give(rlog_beside, tmp_path, capsys) -> None:
    """The rlog.zst beside it is named only where there is one (``record --format mcap --mcap-encoding json``
    writes none: it was named all the same)."""
    src = _json_only(tmp_path / "view")
    if rlog_beside:
        _log(tmp_path / "zst").rename(src.with_suffix(".zst"))
    out = tmp_path / "fleet"
    assert main(["fleet", "make", "--from", str(src), "--copies", "1", str(out)]) == 2
    fix = ("give the rlog.zst written beside it (or a log recorded with --mcap-encoding both)" if rlog_beside else
           "there is no rlog.zst beside it; chestnut record writes a log that check and replay read with "
           "--mcap-encoding capnproto or both, or in its default format (an rlog.zst beside the MCAP)")
    assert capsys.readouterr() == ("", f"chestnut fleet make: {src}: not a readable log (JSON channels only); {fix}\n")
    assert not out.exists()


@pytest.mark.parametrize("fmt", ["zst", "mcap"])
@pytest.mark.parametrize("whole", [False, True], ids=["file", "folder"])
def test_a_clean_log_of_no_message_is_copied_as_check_reads_it(fmt, whole, tmp_path, capsys) -> None:
    """A log file whose writer closed before its first message (a whole zstd frame / MCAP file holding none): check
    reads it as 0 frames, no damage, so fleet make copies it as any other log."""
    from chestnut.msgs.logfile import McapSegmentWriter, RlogSegmentWriter
    from chestnut.node.offline.contracts import check_log

    seg = tmp_path / "logs" / "2026-01-01--00-00-00--0"
    seg.mkdir(parents=True)
    src = seg / f"rlog.{fmt}"
    (RlogSegmentWriter if fmt == "zst" else McapSegmentWriter)(src).close()
    out = tmp_path / "fleet"
    assert main(["fleet", "make", "--from", str(tmp_path / "logs" if whole else src), "--copies", "2", str(out)]) == 0
    assert capsys.readouterr() == (f"2 route(s), 2 segment(s) in {out}\n", "")
    copies = [out / f"2026-01-01--00-00-00-0000{k}--0" / f"rlog.{fmt}" for k in (1, 2)]
    assert find_log_files(out) == copies
    assert [c.read_bytes() == src.read_bytes() for c in copies] == [True, True]
    for log in (src, *copies):
        r = check_log(log)
        assert (len(r.timeline.events), r.timeline.damage, r.violations) == (0, [], [])


def test_a_folder_with_no_readable_log_is_refused_naming_its_first_file(tmp_path, capsys) -> None:
    for n, data in enumerate((b"", RANDOM)):
        (tmp_path / "logs" / f"r--{n}").mkdir(parents=True)
        (tmp_path / "logs" / f"r--{n}" / "rlog.zst").write_bytes(data)
    out = tmp_path / "fleet"
    assert main(["fleet", "make", "--from", str(tmp_path / "logs"), "--copies", "2", str(out)]) == 2
    assert capsys.readouterr() == ("", (
        f"chestnut fleet make: {tmp_path / 'logs'}: no readable log in it ({tmp_path / 'logs' / 'r--0' / 'rlog.zst'}: "
        f"byte 0: empty file; 1 more log file(s) without a message); {READABLE_FIX}\n"))
    assert not out.exists()


def test_a_damaged_segment_beside_a_readable_log_is_copied_as_it_is(tmp_path, capsys) -> None:
    """A folder that gives a message is copied whole, a damaged file too (the 0-byte rlog a node killed at a segment's
    start leaves): check reports of the copy what it reports of the source."""
    src = _log(tmp_path / "logs").parent.parent
    (src / "2026-01-01--00-00-00--1").mkdir()
    (src / "2026-01-01--00-00-00--1" / "rlog.zst").write_bytes(b"")
    out = tmp_path / "fleet"
    assert main(["fleet", "make", "--from", str(src), "--copies", "1", str(out)]) == 0
    assert capsys.readouterr().out == f"1 route(s), 2 segment(s) in {out}\n"
    assert _tree(out) == ["2026-01-01--00-00-00-00001--0", "2026-01-01--00-00-00-00001--0/rlog.zst",
                          "2026-01-01--00-00-00-00001--1", "2026-01-01--00-00-00-00001--1/rlog.zst"]
    assert (out / "2026-01-01--00-00-00-00001--1" / "rlog.zst").read_bytes() == b""
    from chestnut.node.offline.contracts import check_log

    def said(log: Path) -> list[tuple[str, int, str, int]]:
        r = check_log(log)
        return [(Path(d.path).parent.name.replace("-00001", ""), d.offset, d.reason, len(r.violations))
                for d in r.timeline.damage]

    assert said(out) == said(src) == [("2026-01-01--00-00-00--1", 0, "empty file", 1)]


# ---------------------------------------------------------------- 3. a FIFO in the folder is skipped, as check skips it


@pytest.mark.timeout(120)  # a FIFO that is opened blocks for good: fail, never hang
def test_a_log_file_in_the_folder_that_is_no_regular_file_is_skipped_with_one_warning(tmp_path, caplog,
                                                                                      capsys) -> None:
    seg = _log(tmp_path / "lg").parent
    os.mkfifo(seg / "rlog.mcap")  # beside the segment's regular rlog.zst
    (tmp_path / "lg" / "2026-01-01--00-00-00--1").mkdir()
    os.mkfifo(tmp_path / "lg" / "2026-01-01--00-00-00--1" / "rlog.zst")  # a segment of its own
    out = tmp_path / "fleet"
    assert main(["fleet", "make", "--from", str(tmp_path / "lg"), "--copies", "2", str(out)]) == 0
    assert capsys.readouterr() == (f"2 route(s), 2 segment(s) in {out}\n", "")
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "chestnut.fleet"] == [
        ("WARNING", f"{tmp_path / 'lg' / '2026-01-01--00-00-00--1' / 'rlog.zst'}: a FIFO, not a regular file: "
                    "skipped (never opened)"),
        ("WARNING", f"{seg / 'rlog.mcap'}: a FIFO, not a regular file: skipped (never opened)"),
    ]
    assert _tree(out) == ["2026-01-01--00-00-00-00001--0", "2026-01-01--00-00-00-00001--0/rlog.zst",
                          "2026-01-01--00-00-00-00002--0", "2026-01-01--00-00-00-00002--0/rlog.zst"]
    caplog.clear()
    assert main(["check", str(tmp_path / "lg")]) == 0  # what check does with the same folder
    assert [(r.levelname, r.getMessage().split(": ", 1)[1]) for r in caplog.records if r.name == "chestnut.check"] == [
        ("WARNING", "a FIFO, not a regular file: skipped (never opened)")] * 2


@pytest.mark.timeout(120)
def test_a_fifo_named_by_from_is_refused_in_one_line(tmp_path, capsys) -> None:
    fifo = tmp_path / "rlog.zst"
    os.mkfifo(fifo)
    out = tmp_path / "fleet"
    assert main(["fleet", "make", "--from", str(fifo), "--copies", "2", str(out)]) == 2
    assert capsys.readouterr() == ("", (
        f"chestnut fleet make: {fifo}: a FIFO, not a regular file; give a log file (rlog.zst / rlog.mcap) or a folder "
        "of them\n"))
    assert not out.exists()


# ---------------------------------------------------------------- 4. an empty path is refused, never taken for "."


@pytest.mark.parametrize(("which", "line"), [
    ("--from", "argument --from: an empty path is not a path; give a log file or a folder of them"),
    ("OUT", "argument OUT: an empty path is not a path; give the folder for the fleet"),
], ids=["from", "out"])
def test_an_empty_from_or_out_is_the_parsers_one_line_naming_it(which, line, tmp_path, monkeypatch, capsys) -> None:
    _log(tmp_path / "logs")
    monkeypatch.chdir(tmp_path)  # "" was this folder: the log to copy, or where the copies went
    source, out = ("", "fleet") if which == "--from" else ("logs", "")
    with pytest.raises(SystemExit) as info:
        main(["fleet", "make", "--from", source, "--copies", "2", out])
    assert info.value.code == 2
    assert capsys.readouterr() == ("", f"chestnut fleet make: error: {line} (chestnut fleet make --help)\n")
    assert sorted(os.listdir(tmp_path)) == ["logs"]


# ---------------------------------------------------------------- 5. two logs that would make the same routes


@pytest.mark.parametrize("loose", [False, True], ids=["same-route", "loose-rlogs"])
def test_two_logs_whose_copies_would_share_route_ids_are_refused_naming_both(loose, tmp_path, capsys) -> None:
    for where in ("a", "b"):
        f = _log(tmp_path / "logs" / where)
        if loose:
            f.rename(tmp_path / "logs" / where / "rlog.zst")
            f.parent.rmdir()
    a, b = ((tmp_path / "logs" / w / ("rlog.zst" if loose else "2026-01-01--00-00-00")) for w in ("a", "b"))
    route = "rlog-00001" if loose else "2026-01-01--00-00-00-00001"
    out = tmp_path / "fleet"
    assert main(["fleet", "make", "--from", str(tmp_path / "logs"), "--copies", "2", str(out)]) == 2
    assert capsys.readouterr() == ("", (
        f"chestnut fleet make: {a} and {b} would both be copied as route {route} ...: copy them one at a time, into "
        "different OUT folders\n"))
    assert not out.exists()


# ---------------------------------------------------------------- 6. a file the copy cannot read


def test_a_log_file_the_copy_cannot_read_is_one_line_and_nothing_is_left(tmp_path, monkeypatch, capsys) -> None:
    import errno

    from chestnut.node.offline import fleet

    seg = _log(tmp_path / "logs").parent
    (seg.parent / "2026-01-01--00-00-00--1").mkdir()
    locked = seg.parent / "2026-01-01--00-00-00--1" / "rlog.zst"
    locked.write_bytes((seg / "rlog.zst").read_bytes())
    opened = fleet.open_regular

    def open_regular(path, follow=False):  # as for another user's file 0600, which root would read all the same
        if Path(path) == locked:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return opened(path, follow=follow)

    monkeypatch.setattr(fleet, "open_regular", open_regular)
    out = tmp_path / "fleet"
    assert main(["fleet", "make", "--from", str(tmp_path / "logs"), "--copies", "2", str(out)]) == 2
    assert capsys.readouterr() == ("", f"chestnut fleet make: {locked}: permission denied; nothing written\n")
    assert not out.exists()
