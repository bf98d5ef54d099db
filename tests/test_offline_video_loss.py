"""Offline tools over video-logged logs: frames the log holds no pixels of, ring losses the node handled,
damaged videos, non-regular files in a log, and fleets made from video logs."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard as zstd
from drivelog import MS, _clock_at, build_drive

from chestnut.launch.cli import main
from chestnut.msgs.frames import frame_to_array
from chestnut.msgs.logfile import LogReader, RouteWriter, find_log_files
from chestnut.msgs.messaging import log_from_bytes
from chestnut.msgs.video import VIDEO_FILE, LoggedFrames, NotRegularFileError, VideoFrameError, VideoOptions

ROUTE = "2026-01-01--00-00-00"
RING_REASON = (
    "bad frame: frame seq 10: slot 2 was overwritten (now frame 14, done); the reader fell more than 3 frames "
    "behind the camera"
)
LOG_FIX = "give a log file (rlog.zst / rlog.mcap) or a folder of them"  # an input that is not a regular file
OVERWRITTEN = 10  # the node answered none: its ring slot was reused before it read it (the logger kept the pixels)
UNREAD = 12  # the logger read the slot too late: logged without pixels (the node had served it)


@pytest.fixture(scope="module")
def drive(tiny_onnx: Path) -> list:
    return build_drive(tiny_onnx)


def _ring(ev, frame_id: int) -> None:
    buf = ev.cameraFrame.init("buffer")
    buf.session, buf.index, buf.seq, buf.size = 7, frame_id % 4, frame_id, len(ev.cameraFrame.data)


def write_ring_route(log_dir: Path, drive: list, doctor: bool = True) -> list[Path]:
    """The drive as ``chestnut record`` logs ring frames as video; with ``doctor``, frame OVERWRITTEN
    answered "none" for a ring overwrite and frame UNREAD logged without pixels."""
    now = [drive[0][0] - 1 * MS]
    with _clock_at(now):
        w = RouteWriter(
            log_dir,
            formats=("zst",),
            segment_seconds=3.0,
            clock=lambda: now[0] / 1e9,
            config={"services": ["cameraFrame", "modelOutput"]},
            route=ROUTE,
            video=VideoOptions(),
        )
        with w:
            for t, service, data in drive:
                now[0] = t
                ev = log_from_bytes(data).as_builder()
                if service == "cameraFrame":
                    fid = int(ev.cameraFrame.frameId)
                    _ring(ev, fid)
                    if doctor and fid == UNREAD:
                        ev.cameraFrame.data = b""
                        w.write(service, t, ev.to_bytes())
                    else:
                        ro = log_from_bytes(ev.to_bytes())
                        w.write_frame(t, ro, frame_to_array(log_from_bytes(data).cameraFrame))
                elif service == "modelOutput" and doctor and int(ev.modelOutput.frameId) == OVERWRITTEN:
                    ev.modelOutput.source, ev.modelOutput.reason = "none", RING_REASON
                    ev.modelOutput.init("outputs", 0)
                    w.write(service, t, ev.to_bytes())
                else:
                    w.write(service, t, data)
    return sorted(p for p in Path(log_dir).iterdir() if p.is_dir())


def test_a_ring_loss_and_a_frame_logged_without_pixels_are_not_model_mismatches(drive, tmp_path, capsys):
    from chestnut.node.offline.replay import KIND_NOT_REPLAYABLE, KIND_OK, KIND_TRANSPORT_LOSS, replay

    write_ring_route(tmp_path / "logs", drive)
    r = replay(tmp_path / "logs", jit_cache=False)
    assert r.mismatches == [] and r.damage == [] and r.ok
    odd = {f.frame_id: (f.kind, f.logged_source, f.replayed_with, f.detail) for f in r.frames if f.kind != KIND_OK}
    assert odd == {
        OVERWRITTEN: ("transport_loss", "none", "", f"the node could not read it in time: {RING_REASON}"),
        UNREAD: (
            "not_replayable",
            "primary",
            "",
            f"logged without pixels: cameraFrame {UNREAD} was overwritten in the camera's ring before the logger "
            "read it (chestnut record's 'without pixels' count)",
        ),
    }
    assert [f.kind for f in r.not_replayed] == [KIND_TRANSPORT_LOSS, KIND_NOT_REPLAYABLE]
    assert r.replayed() == {"primary": 98, "fallback": 80}
    assert main(["replay", str(tmp_path / "logs"), "--no-jit-cache"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal's width
    assert out.endswith(
        "0 mismatch(es), 0 model id mismatch(es), 0 damaged file(s); 1 not replayable, 1 transport loss"
    )
    assert "FrameReader" not in out  # no live-only advice for a log read offline


def test_a_none_answer_the_frame_contradicts_is_still_a_mismatch(drive, tmp_path):
    """Only a ring-overwrite reason on a ring frame is a transport loss: another "none" over a good frame
    stays a mismatch."""
    from chestnut.node.offline.replay import KIND_INPUT, replay

    (seg0, *_) = write_ring_route(tmp_path / "logs", drive, doctor=False)
    items = [(t, s, ev.as_builder()) for t, s, ev in LogReader(seg0)]
    for _, s, b in items:
        if s == "modelOutput" and int(b.modelOutput.frameId) == OVERWRITTEN:
            b.modelOutput.source, b.modelOutput.reason = "none", "bad frame: 0 bytes for 48x64x3 (HxWxC)"
    (seg0 / "rlog.zst").unlink()
    rewrite(seg0, items)
    r = replay(tmp_path / "logs", jit_cache=False)
    assert [(f.frame_id, f.kind) for f in r.mismatches] == [(OVERWRITTEN, KIND_INPUT)]


def test_a_frame_the_node_answered_as_stale_is_a_transport_loss(drive, tmp_path):
    """A frame the node read over ``timing.max_frame_age_ms`` after its EOF was answered "none" without a
    model (``node/main.py`` ``stale_frame_reason``): the node was behind, not wrong; replay says so."""
    from chestnut.node.main import stale_frame_reason
    from chestnut.node.offline.replay import KIND_TRANSPORT_LOSS, replay

    reason = stale_frame_reason(1, 1 + 2_500_000_000, 1000.0)
    assert reason == "stale frame: read 2500 ms after its EOF (bound 1000 ms); the node is behind"
    (seg0, *_) = write_ring_route(tmp_path / "logs", drive, doctor=False)
    items = [(t, s, ev.as_builder()) for t, s, ev in LogReader(seg0)]
    for _, s, b in items:
        if s == "modelOutput" and int(b.modelOutput.frameId) == OVERWRITTEN:
            b.modelOutput.source, b.modelOutput.reason = "none", reason
    (seg0 / "rlog.zst").unlink()
    rewrite(seg0, items)
    r = replay(tmp_path / "logs", jit_cache=False)
    assert r.mismatches == [] and r.ok
    assert [(f.frame_id, f.kind) for f in r.not_replayed] == [(OVERWRITTEN, KIND_TRANSPORT_LOSS)]


def rewrite(seg: Path, items: list) -> None:
    import zstandard as zstd

    with open(seg / "rlog.zst", "wb") as fh, zstd.ZstdCompressor().stream_writer(fh) as z:
        for _, _, b in items:
            z.write(b.to_bytes())


@pytest.mark.parametrize("harm", ["truncate", "missing"])
def test_a_damaged_video_is_a_damaged_file_and_its_frames_not_replayable(drive, tmp_path, capsys, harm):
    from chestnut.node.offline.replay import KIND_NOT_REPLAYABLE, VIDEO_DAMAGE_OFFSET, replay

    segs = write_ring_route(tmp_path / "logs", drive, doctor=False)
    video = segs[2] / VIDEO_FILE
    if harm == "missing":
        video.unlink()
    else:
        os.truncate(video, video.stat().st_size // 2)
    r = replay(tmp_path / "logs", jit_cache=False)
    assert r.mismatches == [] and not r.ok
    lost = [f for f in r.frames if f.kind == KIND_NOT_REPLAYABLE]
    assert lost and all(f.detail.startswith(f"video damaged: {video} frame ") for f in lost)
    assert [(d.path, d.offset) for d in r.damage] == [(str(video), VIDEO_DAMAGE_OFFSET)]
    assert main(["replay", str(tmp_path / "logs"), "--no-jit-cache"]) == 1
    raw = capsys.readouterr().out
    out = " ".join(raw.split())  # rich wraps at the terminal's width (a long path even inside a word)
    assert out.endswith(
        f"0 mismatch(es), 0 model id mismatch(es), 1 damaged file(s); {len(lost)} not replayable, 0 transport loss"
    )
    assert "".join(f"log damage: {video}: {r.damage[0].reason}".split()) in "".join(raw.split())
    from chestnut.node.offline.executor import LocalExecutor
    from chestnut.node.offline.fleet import replay_fleet, replay_rows

    ex = LocalExecutor(1)
    try:
        (row,) = replay_rows(replay_fleet(tmp_path / "logs", ex, jit_cache=False))
    finally:
        ex.close()
    assert (row.mismatches, row.damage) == (0, 1)  # the fleet table counts the damaged video too
    if harm == "missing":
        assert len(lost) == 60 and r.damage[0].reason == (
            "frame 0: missing: the log names a video file that is not in the segment directory"
        )


def _malformed(data: bytes) -> bytes:
    """``data`` (a one-segment Event) with its root pointer far past its segment: a framing error, which the reader
    reports as damage at that place and reads on after (``msgs/logfile.py`` ``SegmentFileReader``)."""
    import struct

    assert data[:4] == b"\x00\x00\x00\x00"
    return data[:8] + struct.pack("<Q", (1000 << 2) | (2 << 32) | (1 << 48)) + data[16:]


def test_damaged_files_are_counted_as_files_and_a_file_damaged_twice_shows_its_records(drive, tmp_path, capsys):
    """A log file damaged at two places and a missing video: 2 damaged files holding 3 damage records, which
    ``chestnut replay`` printed as "3 damaged file(s)"."""
    from chestnut.node.offline.executor import LocalExecutor
    from chestnut.node.offline.fleet import TABLE_HEADERS, replay_fleet, replay_rows, row_cells
    from chestnut.node.offline.replay import VIDEO_DAMAGE_OFFSET, replay

    segs = write_ring_route(tmp_path / "logs", drive, doctor=False)
    items = [(t, s, ev.as_builder()) for t, s, ev in LogReader(segs[0])]
    outputs = [i for i, (_, s, _) in enumerate(items) if s == "modelOutput"]
    (segs[0] / "rlog.zst").unlink()
    with open(segs[0] / "rlog.zst", "wb") as fh, zstd.ZstdCompressor().stream_writer(fh) as z:
        for i, (_, _, b) in enumerate(items):
            z.write(_malformed(b.to_bytes()) if i in outputs[3:5] else b.to_bytes())
    video = segs[2] / VIDEO_FILE
    video.unlink()
    r = replay(tmp_path / "logs", jit_cache=False)
    rlog = str(segs[0] / "rlog.zst")
    assert [(d.path, d.offset == VIDEO_DAMAGE_OFFSET) for d in r.damage] == [
        (rlog, False), (rlog, False), (str(video), True)]
    assert main(["replay", str(tmp_path / "logs"), "--no-jit-cache", "--report", str(tmp_path / "report")]) == 1
    out = " ".join(capsys.readouterr().out.split())
    kinds = [f.kind for f in r.not_replayed]
    assert (kinds.count("not_replayable"), kinds.count("transport_loss")) == (60, 0)
    assert out.endswith(
        "0 mismatch(es), 0 model id mismatch(es), 2 damaged file(s) (3 damage records); 60 not replayable, "
        "0 transport loss"
    )
    page = (tmp_path / "report" / "index.html").read_text()
    assert "FAIL: 0 replay mismatch(es), 0 model id mismatch(es), 2 damaged file(s) (3 damage records)</p>" in page
    ex = LocalExecutor(1)
    try:
        (row,) = replay_rows(replay_fleet(tmp_path / "logs", ex, jit_cache=False))
    finally:
        ex.close()
    assert (row.damage, row.damaged_files, row_cells(row)[5]) == (3, 2, "2 (3 records)")
    assert TABLE_HEADERS[5] == "damaged"


# ---------------------------------------------------------------- non-regular files (never opened)


def _run_cli(args: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """The CLI in a child, so that a hang would be a failed test, not a stuck suite."""
    code = "import sys; from chestnut.launch.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)  # a FIFO that is opened blocks for good: fail, never hang
def test_a_fifo_video_is_refused_without_being_opened(drive, tmp_path):
    segs = write_ring_route(tmp_path / "logs", drive, doctor=False)
    fifo = segs[0] / VIDEO_FILE
    fifo.unlink()
    os.mkfifo(fifo, 0o600)
    cf = next(ev.cameraFrame for _, s, ev in LogReader(segs[0]) if s == "cameraFrame")
    with LoggedFrames(segs[0]) as lf, pytest.raises(VideoFrameError) as e:
        lf.read(cf)
    assert str(e.value) == (
        f"{fifo} frame 0: a FIFO, not a regular file: refused (a video is read only from a regular file, never "
        "followed)"
    )
    out = tmp_path / "e.mcap"
    p = _run_cli(["export", str(tmp_path / "logs"), "--mcap", str(out)])
    assert p.returncode == 1, p.stderr
    assert f"damaged input: {fifo} frame 0: a FIFO, not a regular file" in p.stderr and out.is_file()


@pytest.mark.timeout(120)  # a FIFO that is opened blocks for good: fail, never hang
def test_a_fifo_log_file_in_a_directory_is_refused_and_named(drive, tmp_path):
    segs = write_ring_route(tmp_path / "logs", drive, doctor=False)
    fifo = segs[1] / "rlog.zst"
    fifo.unlink()
    os.mkfifo(fifo, 0o600)
    with pytest.raises(NotRegularFileError) as e:
        find_log_files(tmp_path / "logs")
    assert str(e.value) == f"{fifo}: a FIFO, not a regular file; {LOG_FIX}"
    with pytest.raises(NotRegularFileError, match=r": a FIFO, not a regular file"):
        find_log_files(fifo)  # named by hand: the same words, not "no such file"
    out = tmp_path / "w.mcap"
    p = _run_cli(["export", str(tmp_path / "logs"), "--mcap", str(out)])
    assert p.returncode == 2 and not out.exists()
    assert f"LOG {fifo}: a FIFO, not a regular file; {LOG_FIX}\n" in p.stderr
    p = _run_cli(["check", str(fifo)])
    assert p.returncode == 2 and "a FIFO, not a regular file" in p.stderr and "no such file" not in p.stderr


@pytest.mark.parametrize("command", ["check", "replay"])
def test_a_device_given_as_log_is_refused_with_what_to_give_not_remove(command, caplog):
    assert main([command, "/dev/zero"]) == 2  # never opened: reading it would never end
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        f"/dev/zero: a character device, not a regular file; {LOG_FIX}"  # an input: what to give, never "remove it"
    ]


def test_a_symlinked_log_file_found_in_a_walk_is_not_followed(drive, tmp_path):
    segs = write_ring_route(tmp_path / "logs", drive, doctor=False)
    (segs[1] / "rlog.zst").rename(tmp_path / "elsewhere.zst")
    (segs[1] / "rlog.zst").symlink_to(tmp_path / "elsewhere.zst")
    with pytest.raises(NotRegularFileError, match=r"rlog\.zst: a symlink, not a regular file"):
        find_log_files(tmp_path / "logs")
    assert stat.S_ISREG(os.stat(segs[1] / "rlog.zst").st_mode)  # a working link: refused all the same


# ---------------------------------------------------------------- fleet make


def test_a_fleet_made_from_a_video_log_carries_its_videos_and_replays_clean(drive, tmp_path):
    from chestnut.node.offline.fleet import make_fleet
    from chestnut.node.offline.replay import replay

    segs = write_ring_route(tmp_path / "logs", drive, doctor=False)
    dirs = make_fleet(tmp_path / "logs", 2, tmp_path / "fleet")
    assert len(dirs) == 2 * len(segs) == 8
    for d, src in zip(dirs, segs * 2, strict=True):
        assert sorted(p.name for p in d.iterdir()) == ["fcamera.mkv", "rlog.zst"]
        assert (d / VIDEO_FILE).read_bytes() == (src / VIDEO_FILE).read_bytes()
        assert {stat.S_IMODE(os.lstat(p).st_mode) for p in d.iterdir()} == {0o600}
    r = replay(tmp_path / "fleet", jit_cache=False)
    assert r.mismatches == [] and r.damage == [] and r.replayed() == {"primary": 200, "fallback": 160}


def test_fleet_make_refuses_a_symlinked_video_and_writes_nothing(drive, tmp_path):
    from chestnut.node.offline.fleet import make_fleet

    segs = write_ring_route(tmp_path / "logs", drive, doctor=False)
    (segs[1] / VIDEO_FILE).rename(tmp_path / "elsewhere.mkv")
    (segs[1] / VIDEO_FILE).symlink_to(tmp_path / "elsewhere.mkv")
    with pytest.raises(NotRegularFileError) as e:
        make_fleet(tmp_path / "logs", 1, tmp_path / "fleet")
    assert str(e.value) == (
        f"{segs[1] / VIDEO_FILE}: a symlink, not a regular file; give a log whose video files are regular files"
    )
    assert not (tmp_path / "fleet").exists()
