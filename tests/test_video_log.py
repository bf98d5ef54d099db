"""Camera frames logged as video (``msgs/video.py``): bit-exact FFV1 round trips, the logger's video per
segment, rollover and SIGKILL, bad video files, and the readers (replay, export) decoding it."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import av
import numpy as np
import pytest
from drivelog import MS, _clock_at, build_drive, write_drive

from chestnut.launch.camerad import synthetic_frames
from chestnut.msgs.frames import fill_frame, frame_shape, frame_to_array
from chestnut.msgs.logfile import LogReader, RouteWriter
from chestnut.msgs.logger import Recorder
from chestnut.msgs.messaging import PubMaster, log_from_bytes
from chestnut.msgs.services import FRAME_MAX_BYTES
from chestnut.msgs.video import (
    PREVIEW_MAX_BYTES,
    VIDEO_FILE,
    LoggedFrames,
    VideoFrameError,
    VideoOptions,
    VideoWriter,
    video_event,
)
from chestnut.msgs.visionipc import FrameRing

ROUTE = "2026-01-01--00-00-00"


def random_frames(n: int, height: int, width: int, encoding: str, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, frame_shape(height, width, encoding), dtype=np.uint8) for _ in range(n)]


def frame_event(frame_id: int, img: np.ndarray, encoding: str = "bgr888", t_ns: int | None = None):
    """A ``cameraFrame`` Event builder for ``img`` (as ``frame_shape`` gives it)."""
    msg = fill_frame(
        frame_id, img[:, :, 0] if encoding == "nv12" else img, 1000 + frame_id, 2000 + frame_id, "test", encoding
    )
    if encoding == "gray8":
        msg.cameraFrame.height = img.shape[0]
    if t_ns is not None:
        msg.logMonoTime = t_ns
    return msg


def logged_ref(seg_dir: Path, frame_id: int, img: np.ndarray, encoding: str, index: int, options: VideoOptions):
    """The logged (metadata-only) cameraFrame reader of frame ``index`` of ``seg_dir``'s video."""
    ev = log_from_bytes(frame_event(frame_id, img, encoding).to_bytes())
    return log_from_bytes(video_event(ev, VIDEO_FILE, index, options)).cameraFrame


def write_video(seg_dir: Path, frames: list[np.ndarray], encoding: str, options: VideoOptions) -> Path:
    h, w = frames[0].shape[0], frames[0].shape[1]
    if encoding == "nv12":
        h = h * 2 // 3
    writer = VideoWriter(seg_dir / VIDEO_FILE, w, h, encoding, options)
    for k, img in enumerate(frames):
        assert writer.write(img, k * 50 * MS) == k
    writer.close()
    return seg_dir / VIDEO_FILE


# ---------------------------------------------------------------- codecs


@pytest.mark.parametrize(
    "encoding,height,width",
    [("bgr888", 128, 256), ("rgb888", 48, 64), ("gray8", 33, 47), ("nv12", 48, 64), ("nv12", 1208, 1928)],
)
def test_ffv1_gives_the_camera_bytes_back_exactly(tmp_path, encoding, height, width):
    """Random pixels (no structure a codec could exploit) survive FFV1 bit for bit, in every encoding;
    the file is 0600."""
    n = 2 if width > 1000 else 5
    frames = random_frames(n, height, width, encoding)
    path = write_video(tmp_path, frames, encoding, VideoOptions("ffv1"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with LoggedFrames(tmp_path) as lf:
        for k, img in enumerate(frames):
            got = lf.read(logged_ref(tmp_path, k, img, encoding, k, VideoOptions()))
            assert got.shape == frame_shape(height, width, encoding) and got.dtype == np.uint8
            assert np.array_equal(got, img), f"frame {k} differs"


def test_h264_is_lossy_by_design_and_close(tmp_path):
    g = synthetic_frames(128, 256)
    frames = [next(g) for _ in range(10)]
    opts = VideoOptions("h264", crf=23)
    write_video(tmp_path, frames, "bgr888", opts)
    with LoggedFrames(tmp_path) as lf:
        cf = logged_ref(tmp_path, 3, frames[3], "bgr888", 3, opts)
        assert (str(cf.video.codec), bool(cf.video.lossless)) == ("libx264", False)
        got = lf.read(cf)
    err = np.abs(got.astype(np.int16) - frames[3].astype(np.int16))
    assert got.shape == (128, 256, 3) and err.max() > 0  # not exact ...
    assert err.mean() < 8  # ... but the same picture


def test_bad_video_options_are_one_line():
    with pytest.raises(ValueError, match=r"^--video-codec must be one of ffv1, h264, got 'vp9'$"):
        VideoOptions("vp9")
    with pytest.raises(ValueError, match=r"^--crf must be 0\.\.51 \(x264's range\), got 52$"):
        VideoOptions("h264", crf=52)


def test_h264_refuses_an_odd_frame_size(tmp_path):
    with pytest.raises(ValueError, match="h264 needs an even width and height, not 47x33"):
        VideoWriter(tmp_path / VIDEO_FILE, 47, 33, "bgr888", VideoOptions("h264"))


# ---------------------------------------------------------------- the route writer


def write_route(log_dir: Path, items: list, options: VideoOptions | None, segment_seconds: float = 3.0) -> list[Path]:
    """``items`` (drivelog's) written as the logger writes them, frames to video when ``options`` is set."""
    now = [items[0][0] - 1 * MS]
    with _clock_at(now):
        w = RouteWriter(
            log_dir,
            formats=("zst",),
            segment_seconds=segment_seconds,
            clock=lambda: now[0] / 1e9,
            config={"services": ["cameraFrame", "modelOutput"]},
            route=ROUTE,
            video=options,
        )
        with w:
            for t, service, data in items:
                now[0] = t
                if service == "cameraFrame" and options is not None:
                    ev = log_from_bytes(data)
                    w.write_frame(t, ev, frame_to_array(ev.cameraFrame))
                else:
                    w.write(service, t, data)
    return sorted(p for p in Path(log_dir).iterdir() if p.is_dir())


def frame_items(n: int, height: int = 32, width: int = 64, base_ns: int = 5_000 * 10**9, seed: int = 3):
    imgs = random_frames(n, height, width, "bgr888", seed)
    items = []
    for k, img in enumerate(imgs):
        t = base_ns + k * 50 * MS
        items.append((t, "cameraFrame", frame_event(k, img, t_ns=t).to_bytes()))
    return imgs, items


def test_rollover_closes_the_video_and_the_next_segment_starts_its_own(tmp_path):
    imgs, items = frame_items(100)  # 5 s at 20 Hz, 2 s segments: 40 + 40 + 20 frames
    segs = write_route(tmp_path / "logs", items, VideoOptions(), segment_seconds=2.0)
    assert [p.name for p in segs] == [f"{ROUTE}--{n}" for n in range(3)]
    seen = []
    for seg in segs:
        assert sorted(p.name for p in seg.iterdir()) == [VIDEO_FILE, "rlog.zst"]
        with av.open(str(seg / VIDEO_FILE)) as c:
            assert c.duration is not None  # closed cleanly: Matroska's duration and cues are written
        frames = [ev.cameraFrame for _, s, ev in LogReader(seg / "rlog.zst") if s == "cameraFrame"]
        assert [int(cf.video.index) for cf in frames] == list(range(len(frames)))  # from 0 in each segment
        assert all(len(cf.data) == 0 and cf.video.file == VIDEO_FILE for cf in frames)
        with LoggedFrames(seg) as lf:
            for cf in frames:
                assert np.array_equal(lf.read(cf), imgs[int(cf.frameId)])
                seen.append(int(cf.frameId))
    assert seen == list(range(100))
    assert [len([1 for _, s, _ in LogReader(seg / "rlog.zst") if s == "cameraFrame"]) for seg in segs] == [40, 40, 20]


def test_a_new_frame_size_opens_the_next_video_file(tmp_path):
    _, items = frame_items(3)
    small = random_frames(2, 16, 32, "bgr888", seed=9)
    t0 = items[-1][0]
    items += [
        (t0 + (k + 1) * 50 * MS, "cameraFrame", frame_event(10 + k, img, t_ns=t0 + (k + 1) * 50 * MS).to_bytes())
        for k, img in enumerate(small)
    ]
    (seg,) = write_route(tmp_path / "logs", items, VideoOptions(), segment_seconds=60.0)
    frames = [ev.cameraFrame for _, s, ev in LogReader(seg) if s == "cameraFrame"]
    assert [(str(cf.video.file), int(cf.video.index)) for cf in frames] == [
        ("fcamera.mkv", 0),
        ("fcamera.mkv", 1),
        ("fcamera.mkv", 2),
        ("fcamera-1.mkv", 0),
        ("fcamera-1.mkv", 1),
    ]
    with LoggedFrames(seg) as lf:
        assert np.array_equal(lf.read(frames[4]), small[1]) and np.array_equal(
            lf.read(frames[0]), frame_to_array(log_from_bytes(items[0][2]).cameraFrame)
        )


def test_video_logging_cuts_the_log_to_the_metadata(tmp_path):
    imgs, items = frame_items(40, 128, 256)
    (raw,) = write_route(tmp_path / "raw", items, None, segment_seconds=60.0)
    (vid,) = write_route(tmp_path / "video", items, VideoOptions(), segment_seconds=60.0)
    raw_bytes, vid_rlog = (raw / "rlog.zst").stat().st_size, (vid / "rlog.zst").stat().st_size
    assert raw_bytes > 40 * imgs[0].nbytes  # random pixels: zstd cannot shrink them
    assert vid_rlog < 40 * 1024  # metadata: a few hundred bytes a frame


def live_images(tmp_path: Path, imgs: list[np.ndarray], encoding: str) -> list[dict]:
    """The JSON ``/camera/image`` messages of a live MCAP of ``imgs`` logged as video."""
    import base64

    from mcap.reader import make_reader

    with RouteWriter(tmp_path, formats=("mcap",), mcap_encodings=("json",), video=VideoOptions(), route=ROUTE) as w:
        for k, img in enumerate(imgs):
            t = 10**9 + k * 50 * MS
            w.write_frame(t, log_from_bytes(frame_event(k, img, encoding, t_ns=t).to_bytes()), img)
    with open(tmp_path / f"{ROUTE}--0" / "rlog.mcap", "rb") as fh:
        messages = [(c.topic, json.loads(m.data)) for _, c, m in make_reader(fh).iter_messages()]
    assert [t for t, _ in messages].count("/cameraFrame") == len(imgs)
    images = [body for t, body in messages if t == "/camera/image"]
    for body in images:
        body["pixels"] = base64.b64decode(body.pop("data"))
        assert len(body["pixels"]) == body["step"] * body["height"]
    return images


def test_the_live_json_mcap_shows_a_video_logged_frame_as_a_preview(tmp_path):
    """Foxglove opens a run's MCAP with the camera image (a preview of at most PREVIEW_MAX_BYTES): the
    128x256 default frame at half size, every other pixel of every other row."""
    imgs = random_frames(3, 128, 256, "bgr888")
    images = live_images(tmp_path, imgs, "bgr888")
    assert [(b["width"], b["height"], b["encoding"], b["step"]) for b in images] == [(128, 64, "bgr8", 384)] * 3
    assert all(b["pixels"] == imgs[k][::2, ::2].tobytes() for k, b in enumerate(images))


def test_the_preview_of_a_full_size_nv12_frame_is_small_and_in_colour(tmp_path):
    g = synthetic_frames(1208, 1928, "nv12")
    (image,) = live_images(tmp_path, [next(g)[:, :, None]], "nv12")
    assert (image["width"], image["height"], image["encoding"], image["step"]) == (175, 109, "bgr8", 525)
    assert len(image["pixels"]) <= PREVIEW_MAX_BYTES


def _video_messages(path: Path) -> list[tuple[int, dict]]:
    from mcap.reader import make_reader

    with open(path, "rb") as fh:
        return [
            (m.log_time, json.loads(m.data))
            for s, c, m in make_reader(fh).iter_messages()
            if c.topic == "/camera/video" and s.name == "foxglove.CompressedVideo"
        ]


def _decode_units(bodies: list[dict]) -> list[av.VideoFrame]:
    import base64

    codec = av.CodecContext.create("h264", "r")
    return [f for b in bodies for f in codec.decode(av.Packet(base64.b64decode(b["data"])))]


@pytest.mark.parametrize(("frames", "raw"), [("video", False), ("raw", True)])
def test_the_live_json_mcap_carries_the_camera_as_h264_at_full_size_with_a_keyframe_every_second(
    tmp_path, frames, raw
):
    """``/camera/video``: foxglove.CompressedVideo, one H.264 access unit per frame at the frame's own size,
    an IDR keyframe first and then once a second (msgs/video.py FOXGLOVE_KEYFRAME_NS), from a video-logged
    frame's pixels or a raw frame's inline data."""
    g = synthetic_frames(128, 256, "bgr888")  # the camera's moving test pattern
    imgs = [next(g) for _ in range(45)]
    video = None if raw else VideoOptions()
    with RouteWriter(tmp_path, formats=("mcap",), mcap_encodings=("json",), video=video, route=ROUTE) as w:
        for k, img in enumerate(imgs):
            t = 10**9 + k * 50 * MS  # 20 Hz
            ev = log_from_bytes(frame_event(k, img, "bgr888", t_ns=t).to_bytes())
            if raw:
                w.write("cameraFrame", t, ev.as_builder().to_bytes())
            else:
                w.write_frame(t, ev, img)
    msgs = _video_messages(tmp_path / f"{ROUTE}--0" / "rlog.mcap")
    assert len(msgs) == 45 and {b["format"] for _, b in msgs} == {"h264"}
    assert [lt for lt, _ in msgs] == [10**9 + k * 50 * MS + w.unix_offset_ns for k in range(45)]
    decoded = _decode_units([b for _, b in msgs])
    assert len(decoded) == 45 and {(f.width, f.height) for f in decoded} == {(256, 128)}
    assert [k for k, f in enumerate(decoded) if f.key_frame] == [0, 20, 40]  # every 1 s at 20 Hz
    first = decoded[0].to_ndarray(format="bgr24").astype(int)
    assert np.abs(first - imgs[0]).mean() < 8  # lossy (x264 at crf 23), but the frame


def test_no_mcap_video_leaves_the_camera_video_out(tmp_path):
    img = random_frames(1, 128, 256, "bgr888")[0]
    kw = {"formats": ("mcap",), "mcap_encodings": ("json",), "video": VideoOptions(), "route": ROUTE}
    with RouteWriter(tmp_path, mcap_video=False, **kw) as w:  # chestnut record --no-mcap-video
        w.write_frame(10**9, log_from_bytes(frame_event(0, img, "bgr888", t_ns=10**9).to_bytes()), img)
    assert _video_messages(tmp_path / f"{ROUTE}--0" / "rlog.mcap") == []


def test_a_full_size_nv12_frame_is_one_decodable_keyframe(tmp_path):
    g = synthetic_frames(1208, 1928, "nv12")
    with RouteWriter(tmp_path, formats=("mcap",), mcap_encodings=("json",), video=VideoOptions(), route=ROUTE) as w:
        img = next(g)[:, :, None]
        w.write_frame(10**9, log_from_bytes(frame_event(0, img, "nv12", t_ns=10**9).to_bytes()), img)
    (frame,) = _decode_units([b for _, b in _video_messages(tmp_path / f"{ROUTE}--0" / "rlog.mcap")])
    assert (frame.width, frame.height, frame.key_frame) == (1928, 1208, True)


# ---------------------------------------------------------------- the logger on real sockets


def record_until(rec: Recorder, pm: PubMaster, make, n: int) -> dict[int, np.ndarray]:
    """Publish frames (``make(k) -> (builder, pixels)``), stepping the recorder between them, until ``n``
    were written after the first one that arrived (a PUB drops until the SUB is connected)."""
    sent: dict[int, np.ndarray] = {}
    deadline = time.monotonic() + 30
    k = 0
    first = None
    while first is None or rec.written["cameraFrame"] < n:
        assert time.monotonic() < deadline, f"only {rec.written['cameraFrame']} frames written"
        msg, pixels = make(k)
        sent[k] = pixels
        if first is None or k < first + n:
            pm.send("cameraFrame", msg)
        rec.step(20)
        if first is None and rec.written["cameraFrame"]:
            first = k
        k += 1
    return sent


def test_recorder_writes_inline_frames_to_the_video_and_metadata_to_the_log(tmp_path):
    g = synthetic_frames(32, 64)
    with RouteWriter(tmp_path, formats=["zst"], video=VideoOptions()) as w, PubMaster(["cameraFrame"]) as pm:
        rec = Recorder(w, ["cameraFrame"])
        try:

            def make(k):
                img = next(g)
                return frame_event(k, img), img

            sent = record_until(rec, pm, make, 8)
        finally:
            rec.close_sockets()
    assert (rec.frames_raw, rec.frames_unread) == (0, 0)
    (seg,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert stat.S_IMODE((seg / VIDEO_FILE).stat().st_mode) == 0o600
    frames = [ev.cameraFrame for _, s, ev in LogReader(tmp_path) if s == "cameraFrame"]
    assert len(frames) == 8 and [int(cf.video.index) for cf in frames] == list(range(8))
    with LoggedFrames(seg) as lf:
        for cf in frames:
            assert len(cf.data) == 0 and not cf._has("buffer")
            assert np.array_equal(lf.read(cf), sent[int(cf.frameId)])


def test_recorder_reads_ring_frames_into_the_video(tmp_path):
    imgs = [np.full((16, 32, 3), 7 * k % 256, np.uint8) for k in range(200)]
    with FrameRing(imgs[0].nbytes, slots=8) as ring, PubMaster(["cameraFrame"]) as pm:
        with RouteWriter(tmp_path, formats=["zst"], video=VideoOptions()) as w:
            rec = Recorder(w, ["cameraFrame"])

            def make(k):
                index, seq = ring.write(imgs[k])
                msg = fill_frame(k, imgs[k][:0], 1 + k, 2 + k, "test")
                msg.cameraFrame.height, msg.cameraFrame.width = 16, 32
                ring.fill(msg.cameraFrame, index, seq, imgs[k].nbytes)
                return msg, imgs[k]

            try:
                sent = record_until(rec, pm, make, 5)
            finally:
                rec.close_sockets()
    assert rec.frames_unread == 0
    (seg,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    frames = [ev.cameraFrame for _, s, ev in LogReader(tmp_path) if s == "cameraFrame"]
    assert len(frames) == 5
    with LoggedFrames(seg) as lf:
        for cf in frames:
            assert cf._has("buffer") and cf._has("video") and len(cf.data) == 0  # travelled through the ring
            assert np.array_equal(lf.read(cf), sent[int(cf.frameId)])


def test_a_frame_h264_cannot_store_is_logged_raw(tmp_path, caplog):
    img = random_frames(1, 33, 47, "bgr888")[0]
    with RouteWriter(tmp_path, formats=["zst"], video=VideoOptions("h264")) as w, PubMaster(["cameraFrame"]) as pm:
        rec = Recorder(w, ["cameraFrame"])
        try:
            record_until(rec, pm, lambda k: (frame_event(k, img), img), 3)
        finally:
            rec.close_sockets()
    assert rec.frames_raw == 3
    assert "cameraFrame: logged raw, not as video: h264 needs an even width and height, not 47x33" in caplog.text
    frames = [ev.cameraFrame for _, s, ev in LogReader(tmp_path) if s == "cameraFrame"]
    assert len(frames) == 3 and all(not cf._has("video") and np.array_equal(frame_to_array(cf), img) for cf in frames)


def decodable(log_dir: Path) -> int:
    """Frames of the first segment's video that decode now (0 while it has none)."""
    paths = list(log_dir.glob("*--0/" + VIDEO_FILE))
    if not paths:
        return 0
    n = 0
    try:
        with av.open(str(paths[0])) as c:
            for _ in c.decode(video=0):
                n += 1
    except (av.FFmpegError, OSError):
        pass
    return n


@pytest.mark.timeout(90)
def test_sigkilled_record_leaves_a_video_that_decodes_up_to_its_last_written_frame(tmp_path):
    log_dir = tmp_path / "logs"
    err = open(tmp_path / "record.stderr", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "chestnut.launch.cli",
            "record",
            "--log-dir",
            str(log_dir),
            "--format",
            "zst",
            "--flush-seconds",
            "0.2",
            "--services",
            "cameraFrame",
        ],
        stdout=subprocess.DEVNULL,
        stderr=err,
    )
    err.close()
    try:
        imgs = random_frames(400, 32, 64, "bgr888", seed=5)
        deadline = time.monotonic() + 60
        with PubMaster(["cameraFrame"]) as pm:
            k = 0
            while True:  # publish until the rlog on disk holds 30 frames
                assert proc.poll() is None, (tmp_path / "record.stderr").read_text()
                assert time.monotonic() < deadline and k < len(imgs), "chestnut record logged too few frames"
                pm.send("cameraFrame", frame_event(k, imgs[k]))
                k += 1
                time.sleep(0.02)
                if k % 10 == 0 and list(log_dir.glob("*--0/rlog.zst")):
                    logged = [ev for _, s, ev in LogReader(log_dir) if s == "cameraFrame"]
                    if len(logged) >= 30:
                        break
        # the encoder thread has caught up: all but the muxer's last frame or two are in the file
        while decodable(log_dir) < len(logged) - 2:
            assert time.monotonic() < deadline, f"the video holds {decodable(log_dir)} of {len(logged)} frames"
            time.sleep(0.05)
            logged = [ev for _, s, ev in LogReader(log_dir) if s == "cameraFrame"]
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    (seg,) = list(log_dir.glob("*--0"))
    frames = [ev.cameraFrame for _, s, ev in LogReader(log_dir) if s == "cameraFrame"]
    assert len(frames) >= 30 and [int(cf.video.index) for cf in frames] == list(range(len(frames)))
    decoded = 0
    with LoggedFrames(seg) as lf:
        for cf in frames:
            try:
                got = lf.read(cf)
            except VideoFrameError as e:
                n = int(cf.video.index)
                assert str(e) == (
                    f"{seg / VIDEO_FILE} frame {n}: the file ends after {decoded} frame(s) "
                    "(truncated: the logger was killed?)"
                )
                continue
            assert decoded == int(cf.video.index)  # a prefix of the file decodes, nothing after a failure
            assert np.array_equal(got, imgs[int(cf.frameId)])
            decoded += 1
    assert decoded >= len(frames) - 3  # the muxer's open cluster and its interleaving queue: a frame or two


# ---------------------------------------------------------------- bad video files


@pytest.fixture
def small_video_log(tmp_path):
    imgs, items = frame_items(20)
    (seg,) = write_route(tmp_path / "logs", items, VideoOptions(), segment_seconds=60.0)
    frames = [ev.cameraFrame for _, s, ev in LogReader(seg) if s == "cameraFrame"]
    return seg, imgs, frames


def test_a_missing_video_is_one_line_per_frame_and_the_log_still_reads(small_video_log):
    seg, _, frames = small_video_log
    (seg / VIDEO_FILE).unlink()
    reader = LogReader(seg)
    assert len([1 for _, s, _ in reader if s == "cameraFrame"]) == 20 and reader.damage == []
    with LoggedFrames(seg) as lf:
        for k in (0, 7):
            with pytest.raises(VideoFrameError) as e:
                lf.read(frames[k])
            assert str(e.value) == (
                f"{seg / VIDEO_FILE} frame {k}: missing: the log names a video file that is not "
                "in the segment directory"
            )


def test_a_truncated_video_decodes_up_to_the_cut(small_video_log):
    seg, imgs, frames = small_video_log
    path = seg / VIDEO_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with LoggedFrames(seg) as lf:
        good = 0
        while True:
            try:
                got = lf.read(frames[good])
            except VideoFrameError as e:
                assert str(e).startswith(f"{path} frame {good}: ")
                break
            assert np.array_equal(got, imgs[good])
            good += 1
        assert 5 <= good < 20
        with pytest.raises(VideoFrameError, match=rf"^{path} frame 19: .* after {good} frame\(s\)"):
            lf.read(frames[19])
        assert np.array_equal(lf.read(frames[0]), imgs[0])  # earlier frames still read (the file is reopened)


def test_a_damaged_frame_is_refused_by_its_crc_not_decoded_to_other_pixels(small_video_log):
    """FFmpeg conceals a damaged FFV1 slice (the previous frame's pixels): the logged CRC-32 catches it."""
    seg, imgs, frames = small_video_log
    path = seg / VIDEO_FILE
    with av.open(str(path)) as c:
        packet = [p for p in c.demux(video=0) if p.size][10]
        pos, size = packet.pos, packet.size
    data = bytearray(path.read_bytes())
    data[pos + size // 2] ^= 0xFF  # one byte inside frame 10's compressed pixels
    path.write_bytes(data)
    with LoggedFrames(seg) as lf:
        for k, cf in enumerate(frames):
            if k == 10:
                with pytest.raises(VideoFrameError) as e:
                    lf.read(cf)
                assert str(e.value).startswith(f"{path} frame 10: decodes to other bytes than the camera sent")
                assert str(e.value).endswith(f"logged {int(cf.video.crc32):08x}): the video file is damaged")
            else:
                assert np.array_equal(lf.read(cf), imgs[k])


def test_a_frame_claiming_a_huge_size_is_refused_before_the_file_is_opened(small_video_log):
    seg, _, frames = small_video_log
    msg = frames[0].as_builder()
    msg.width, msg.height = 20000, 20000
    with LoggedFrames(seg) as lf, pytest.raises(VideoFrameError) as e:
        lf.read(msg.as_reader())
    assert str(e.value) == (
        f"{seg / VIDEO_FILE} frame 0: 20000x20000 bgr888 is 1200000000 bytes, over the "
        f"{FRAME_MAX_BYTES}-byte frame bound (msgs/services.py FRAME_MAX_BYTES); refused"
    )


def test_a_video_whose_size_is_not_the_logged_one_is_refused(small_video_log):
    seg, _, frames = small_video_log
    msg = frames[0].as_builder()
    msg.width, msg.height = 128, 64
    with LoggedFrames(seg) as lf, pytest.raises(VideoFrameError) as e:
        lf.read(msg.as_reader())
    assert str(e.value) == f"{seg / VIDEO_FILE} frame 0: the stream is 64x32, the log says 128x64 (WxH)"


@pytest.mark.parametrize("name", ["../../etc/passwd", "/tmp/x.mkv", "fcamera.mkv.bak", "fcamera-01.mkv"])
def test_a_video_name_that_is_not_ours_is_refused(small_video_log, name):
    seg, _, frames = small_video_log
    msg = frames[3].as_builder()
    msg.video.file = name
    with LoggedFrames(seg) as lf, pytest.raises(VideoFrameError) as e:
        lf.read(msg.as_reader())
    assert str(e.value) == (
        f"cameraFrame 3: video file {name!r} frame 3: not a name chestnut record writes "
        "(fcamera.mkv, fcamera-<n>.mkv); the log was not written by it"
    )


def test_a_symlinked_video_is_not_followed(small_video_log, tmp_path):
    seg, _, frames = small_video_log
    (seg / VIDEO_FILE).rename(tmp_path / "elsewhere.mkv")
    (seg / VIDEO_FILE).symlink_to(tmp_path / "elsewhere.mkv")
    with LoggedFrames(seg) as lf, pytest.raises(VideoFrameError, match="frame 0: a symlink, not a regular file"):
        lf.read(frames[0])


# ---------------------------------------------------------------- readers: replay and export


@pytest.fixture(scope="module")
def drive(tiny_onnx: Path) -> list:
    return build_drive(tiny_onnx)


def test_replay_of_a_video_logged_drive_has_zero_mismatches(drive, tmp_path):
    """The drive (real model outputs over random frames) logged raw and as FFV1 video: the same replay
    results, frame for frame, none a mismatch."""
    from chestnut.node.offline.replay import KIND_OK, replay

    write_drive(drive, tmp_path / "raw")
    segs = write_route(tmp_path / "video", drive, VideoOptions())
    assert all((s / VIDEO_FILE).is_file() for s in segs) and len(segs) == 4
    r_raw = replay(tmp_path / "raw", jit_cache=False)
    r_vid = replay(tmp_path / "video", jit_cache=False)
    assert r_vid.ok and r_vid.mismatches == [] and r_vid.damage == []
    assert r_vid.replayed() == {"primary": 100, "fallback": 80}
    assert {f.kind for f in r_vid.frames} == {KIND_OK}
    assert r_vid.tensor_maxima() == {"prob": (0.0, 0)}
    assert [asdict(f) for f in r_vid.frames] == [asdict(f) for f in r_raw.frames]


def test_replay_names_the_missing_video_and_replays_the_other_segments(drive, tmp_path):
    """A missing video is one damaged file and its frames are not replayable, never model mismatches."""
    from chestnut.node.offline.replay import KIND_NOT_REPLAYABLE, VIDEO_DAMAGE_OFFSET, replay

    segs = write_route(tmp_path / "video", drive, VideoOptions())
    (segs[1] / VIDEO_FILE).unlink()
    r = replay(tmp_path / "video", jit_cache=False)
    lost = [f for f in r.frames if f.kind == KIND_NOT_REPLAYABLE]
    frames_in_1 = [int(ev.cameraFrame.frameId) for _, s, ev in LogReader(segs[1]) if s == "cameraFrame"]
    assert [f.frame_id for f in lost] == frames_in_1 and len(frames_in_1) == 60
    assert lost[0].detail == (
        f"video damaged: {segs[1] / VIDEO_FILE} frame 0: missing: the log names a video file that is not in the "
        "segment directory"
    )
    assert r.mismatches == [] and not r.ok  # the other segments replay clean; the damaged file fails the run
    assert [(d.path, d.offset, d.reason, d.frame_id) for d in r.damage] == [
        (
            str(segs[1] / VIDEO_FILE),
            VIDEO_DAMAGE_OFFSET,
            "frame 0: missing: the log names a video file that is not in the segment directory",
            frames_in_1[0],
        )
    ]


def test_export_puts_the_decoded_frames_back(tmp_path):
    from mcap.reader import make_reader

    from chestnut.msgs.export import export_mcap

    imgs, items = frame_items(30)
    write_route(tmp_path / "logs", items, VideoOptions(), segment_seconds=1.0)
    out = tmp_path / "out.mcap"
    n, damage = export_mcap([tmp_path / "logs"], out, with_capnp=True)
    assert damage == [] and n == 30 + 2  # the frames and two segments' initData headers
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    frames = [ev.cameraFrame for _, s, ev in LogReader(out) if s == "cameraFrame"]
    assert [int(cf.frameId) for cf in frames] == list(range(30))
    assert all(np.array_equal(frame_to_array(cf), imgs[int(cf.frameId)]) for cf in frames)
    with open(out, "rb") as fh:
        images = [json.loads(m.data) for _, c, m in make_reader(fh).iter_messages() if c.topic == "/camera/image"]
    assert len(images) == 30 and all(im["width"] == 64 and im["data"] for im in images)


def test_export_names_a_missing_video_and_exports_the_rest(tmp_path, caplog):
    from chestnut.msgs.export import export_mcap

    _, items = frame_items(10)
    (seg,) = write_route(tmp_path / "logs", items, VideoOptions(), segment_seconds=60.0)
    (seg / VIDEO_FILE).unlink()
    n, damage = export_mcap([tmp_path / "logs"], tmp_path / "out.mcap")
    assert n == 11
    assert damage == [
        f"{seg / VIDEO_FILE} frame 0: missing: the log names a video file that is not in the segment directory; "
        "9 more frame(s) of it without their pixels"
    ]


def test_record_refuses_a_bad_crf_in_one_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "chestnut.launch.cli",
            "record",
            "--log-dir",
            str(tmp_path / "l"),
            "--video-codec",
            "h264",
            "--crf",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("--crf must be 0..51 (x264's range), got 60")
    assert not (tmp_path / "l").exists()


def test_raw_mode_logs_the_published_bytes(tmp_path):
    """``--frames raw``: what was logged before video, the pixels inline, byte for byte."""
    img = random_frames(1, 32, 64, "bgr888")[0]
    with RouteWriter(tmp_path, formats=["zst"]) as w, PubMaster(["cameraFrame"]) as pm:
        rec = Recorder(w, ["cameraFrame"])
        try:
            record_until(rec, pm, lambda k: (frame_event(k, img, t_ns=10**9 + k), img), 3)
        finally:
            rec.close_sockets()
    logged = [
        (int(log_from_bytes(d).cameraFrame.frameId), d)
        for _, s, d in LogReader(tmp_path).iter_raw()
        if s == "cameraFrame"
    ]
    assert len(logged) == 3
    assert all(d == frame_event(fid, img, t_ns=10**9 + fid).to_bytes() for fid, d in logged)
    assert not list(tmp_path.rglob("*.mkv"))


def test_sigterm_closes_the_video_cleanly(tmp_path):
    log_dir = tmp_path / "logs"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "chestnut.launch.cli",
            "record",
            "--log-dir",
            str(log_dir),
            "--format",
            "zst",
            "--services",
            "cameraFrame",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        img = random_frames(1, 32, 64, "bgr888")[0]
        deadline = time.monotonic() + 60
        with PubMaster(["cameraFrame"]) as pm:
            k = 0
            while not list(log_dir.glob("*--0/fcamera.mkv")):
                assert proc.poll() is None and time.monotonic() < deadline, "no video written"
                pm.send("cameraFrame", frame_event(k, img))
                k += 1
                time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, err
    assert "frames as video (ffv1) (logged raw instead 0, without pixels 0)" in err
    (video,) = list(log_dir.glob("*--0/fcamera.mkv"))
    with av.open(str(video)) as c:
        assert c.duration is not None and c.streams.video[0].codec_context.name == "ffv1"
        n = sum(1 for _ in c.decode(video=0))
    assert n == len([1 for _, s, _ in LogReader(log_dir) if s == "cameraFrame"]) >= 1


def test_a_shipped_video_logged_segment_replays_as_the_one_read_from_its_path(drive, tmp_path):
    """``--ship-logs``: a segment travels with the video files beside it, so a worker that reads only what
    was shipped decodes the same frames as one that reads the path."""
    from chestnut.msgs.logfile import find_log_files
    from chestnut.node.offline.replay import (
        KIND_NOT_REPLAYABLE,
        KIND_OK,
        SegmentResult,
        find_node_config,
        plan_tasks,
        resolve_plan,
    )
    from chestnut.node.offline.units import KIND_REPLAY, Unit, read_shipped, run_unit

    write_route(tmp_path / "video", drive, VideoOptions())
    files = find_log_files(tmp_path / "video")
    plan = resolve_plan(find_node_config(files), config_origin="the log", jit_cache=False)
    task = plan_tasks(files, plan)[1]
    unit = Unit(KIND_REPLAY, "video", 1, task.path, task, task.next_path)
    shipped = read_shipped(task.path)
    assert list(shipped) == [Path(task.path).name, VIDEO_FILE]
    here = run_unit(unit)
    there = run_unit(unit, shipped, read_shipped(str(task.next_path)))
    assert isinstance(here, SegmentResult) and isinstance(there, SegmentResult)
    assert [asdict(f) for f in there.frames] == [asdict(f) for f in here.frames] and there.damage == here.damage
    assert len(here.frames) == 60 and {f.kind for f in here.frames} == {KIND_OK}
    # the segment file alone (no video): every frame is named as missing its video, none replays from stale pixels
    alone = run_unit(unit, Path(task.path).read_bytes())
    assert isinstance(alone, SegmentResult) and {f.kind for f in alone.frames} == {KIND_NOT_REPLAYABLE}
    assert [d.reason for d in alone.damage] == [
        "frame 0: missing: the log names a video file that is not in the segment directory"
    ]


def test_the_foxglove_encoder_thread_leaves_out_what_it_has_no_room_for_and_keeps_the_order():
    from chestnut.msgs.video import FoxgloveVideoThread

    g = synthetic_frames(1208, 1928, "nv12")
    imgs = [next(g)[:, :, None] for _ in range(12)]
    live = FoxgloveVideoThread(drop=True, queue_frames=1)
    taken = [live.submit(img, 1928, 1208, "nv12", k * 50 * MS, k) for k, img in enumerate(imgs)]  # faster than x264
    done = live.close()
    assert [k for k, _ in done] == [k for k, ok in enumerate(taken) if ok]  # each queued frame, in order
    assert live.dropped == taken.count(False) and live.dropped + len(done) == 12 and live.refused == 0
    waited = FoxgloveVideoThread(drop=False, queue_frames=1)  # an export: every frame, however slow
    assert all(waited.submit(img, 1928, 1208, "nv12", k * 50 * MS, k) for k, img in enumerate(imgs[:4]))
    assert [k for k, _ in waited.close()] == [0, 1, 2, 3] and waited.dropped == 0


def test_an_export_has_the_camera_as_h264_on_the_logs_own_unix_clock(tmp_path):
    """``chestnut export``: the log's offset (its initData), not the exporting machine's, and every frame."""
    from chestnut.msgs.export import export_mcap

    g = synthetic_frames(128, 256, "bgr888")
    ts = [10**12 + k * 50 * MS for k in range(5)]
    with RouteWriter(tmp_path / "logs", formats=("zst",), unix_offset_ns=1_800_000_000 * 10**9) as w:
        for k, t in enumerate(ts):
            w.write("cameraFrame", t, frame_event(k, next(g), "bgr888", t_ns=t).to_bytes())
    export_mcap([tmp_path / "logs"], tmp_path / "view.mcap")
    msgs = _video_messages(tmp_path / "view.mcap")
    assert [lt for lt, _ in msgs] == [t + 1_800_000_000 * 10**9 for t in ts]
    assert [f.key_frame for f in _decode_units([b for _, b in msgs])] == [True, False, False, False, False]
