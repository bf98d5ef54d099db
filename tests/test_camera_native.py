"""``chestnut camera`` at the source's native size and pixel format, and openpilot's 1928x1208 NV12 frame."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from chestnut.launch.assets import traffic_video_path
from chestnut.launch.camerad import iter_frames, synthetic_frames
from chestnut.msgs.frames import fill_frame, frame_shape, frame_to_array
from chestnut.msgs.messaging import log_from_bytes, recv_one, sub_sock
from chestnut.msgs.visionipc import FrameReader

ROOT = Path(__file__).resolve().parents[1]
CHESTNUT = str(ROOT / ".venv/bin/chestnut")


def _receive(args: list[str], count: int) -> list[tuple[object, np.ndarray]]:
    """Run ``chestnut camera ARGS`` until COUNT frames arrived here, stop it with SIGTERM (exit 0), and return
    (cameraFrame, verified pixels) per frame. The camera publishes from its start on, as a camera does: the
    frames it sent before this subscriber joined are not seen, so the first frame received is not frame 0."""
    sock = sub_sock("cameraFrame", timeout_ms=30000)
    cam = subprocess.Popen([CHESTNUT, "camera", *args, "--frames", "0", "--start-delay", "0"], cwd=ROOT)
    reader = FrameReader()
    got = []
    try:
        for _ in range(count):
            ev = recv_one(sock)
            assert ev is not None, "no frame within 30 s"
            cf = ev.cameraFrame
            got.append((cf, reader.read(cf)))
        cam.terminate()
        assert cam.wait(20) == 0
    finally:
        cam.kill()
        sock.close(linger=0)
        reader.close()
    return got


def _follows(source: Iterator[np.ndarray], got: list[tuple[object, np.ndarray]], search: int = 600) -> list[int]:
    """The positions in ``source`` of the received frames: the first is searched for among the first
    ``search`` source frames (the subscriber joined late), every later one must be the source's next frame.
    Raises AssertionError naming the frame that is not."""
    first = got[0][1]
    for at, want in enumerate(source):
        if want.shape == first.shape and (want == first).all():
            break
        assert at < search, f"frame {got[0][0].frameId} is none of the source's first {search} frames"
    else:
        raise AssertionError(f"frame {got[0][0].frameId} is not in the source")
    positions = [at]
    for cf, img in got[1:]:
        want = next(source)
        assert (img == want).all(), f"frame {cf.frameId} is not the source frame after frame {positions[-1]}"
        positions.append(positions[-1] + 1)
    return positions


def test_nv12_layout_and_its_round_trip():
    assert frame_shape(1208, 1928, "nv12") == (1812, 1928, 1)
    assert frame_shape(576, 704, "bgr888") == (576, 704, 3)
    assert frame_shape(4, 6, "gray8") == (4, 6, 1)
    with pytest.raises(ValueError, match=r"^an nv12 frame has an even width and height, not 7x4$"):
        frame_shape(4, 7, "nv12")
    planes = next(synthetic_frames(8, 12, "nv12"))
    assert planes.shape == (12, 12) and planes.dtype == np.uint8
    cf = log_from_bytes(fill_frame(0, planes, 1, 2, "t", "nv12").to_bytes()).cameraFrame
    assert (str(cf.encoding), cf.height, cf.width, len(cf.data)) == ("nv12", 8, 12, 144)
    assert (frame_to_array(cf)[:, :, 0] == planes).all()


def test_openpilot_sized_nv12_frames_through_the_ring():
    got = _receive(["--synthetic", "--width", "1928", "--height", "1208", "--pixel-format", "nv12", "--rate", "10"], 4)
    for cf, _ in got:
        assert (str(cf.encoding), cf.width, cf.height) == ("nv12", 1928, 1208)
        assert len(cf.data) == 0 and cf.buffer.size == 1928 * 1208 * 3 // 2 == 3_493_536  # in the ring, not inline
    planes = (img[:, :, 0] for _, img in got)
    _follows(synthetic_frames(1208, 1928, "nv12"), [(cf, p) for (cf, _), p in zip(got, planes, strict=True)])
    ids = [int(cf.frameId) for cf, _ in got]
    assert ids == sorted(set(ids))


def test_the_traffic_video_at_its_native_704x576():
    got = _receive(["--native", "--rate", "10", "--no-loop"], 3)
    for cf, _ in got:
        assert (str(cf.encoding), cf.width, cf.height, cf.buffer.size) == ("bgr888", 704, 576, 704 * 576 * 3)
    _follows(iter_frames(traffic_video_path(), None, None, loop=False), got)


def test_an_inline_native_frame_and_an_odd_nv12_size_is_one_line(tmp_path):
    got = _receive(["--native", "--rate", "10", "--transport", "inline", "--pixel-format", "nv12"], 1)
    ((cf, img),) = got
    assert (str(cf.encoding), cf.width, cf.height, len(cf.data)) == ("nv12", 704, 576, 704 * 576 * 3 // 2)
    assert not cf._has("buffer") and img.shape == (864, 704, 1)
    r = subprocess.run(
        [CHESTNUT, "camera", "--synthetic", "--width", "7", "--height", "4", "--pixel-format", "nv12"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith("an nv12 frame has an even width and height, not 7x4")
    assert "Traceback" not in r.stderr


def test_synthetic_native_is_openpilots_road_frame_the_size_launch_gives_it():
    """A synthetic source has no size of its own: ``--synthetic --native`` was refused (exit 2, "give its size with
    --width and --height"), though ``chestnut launch --frames native --synthetic`` and the README give it one,
    1928x1208; before that, ``--native`` was silently ignored (256x128 came out)."""
    from chestnut.launch.cli import main

    assert main(["camera", "--synthetic", "--native", "--pixel-format", "nv12", "--frames", "1", "--start-delay", "0",
                 "--rt-priority", "0"]) == 0  # it was 2; in this process, so no realtime policy
    got = _receive(["--synthetic", "--native", "--pixel-format", "nv12", "--rate", "10"], 2)
    for cf, _ in got:
        assert (str(cf.encoding), cf.width, cf.height, cf.buffer.size) == ("nv12", 1928, 1208, 3_493_536)
    planes = (img[:, :, 0] for _, img in got)
    _follows(synthetic_frames(1208, 1928, "nv12"), [(cf, p) for (cf, _), p in zip(got, planes, strict=True)])
    explicit = _receive(["--synthetic", "--native", "--width", "640", "--height", "480", "--rate", "10"], 1)
    assert [(str(cf.encoding), cf.width, cf.height) for cf, _ in explicit] == [("bgr888", 640, 480)]
    from chestnut.launch.camerad import SYNTHETIC_NATIVE_HW  # the one constant, launch's too
    from chestnut.launch.frames import FrameOptions

    assert SYNTHETIC_NATIVE_HW == FrameOptions(frames="native", synthetic=True).frame_hw == (1208, 1928)


@pytest.mark.parametrize(
    ("args", "hw"),
    [
        ([], (128, 256)),
        (["--synthetic"], (128, 256)),
        (["--synthetic", "--native"], (1208, 1928)),
        (["--synthetic", "--native", "--width", "640"], (1208, 640)),
        (["--synthetic", "--native", "--height", "480", "--width", "640"], (480, 640)),
        (["--synthetic", "--height", "64", "--width", "96"], (64, 96)),
        (["--height", "64", "--width", "96"], (64, 96)),
    ],
)
def test_the_frame_size_the_arguments_ask_for(args, hw):
    import argparse

    from chestnut.launch import camerad

    p = argparse.ArgumentParser()
    camerad.add_arguments(p)
    assert camerad.frame_hw(p.parse_args(args)) == hw


@pytest.mark.parametrize(
    ("option", "value", "want"),
    [
        ("--frames", "-3", "give a number of frames >= 0 (0: run until stopped)"),
        ("--frames", "nan", "give a number of frames >= 0 (0: run until stopped)"),
        ("--frames", "1.5", "give a number of frames >= 0 (0: run until stopped)"),
        ("--start-delay", "-5", "give a number of seconds >= 0 and <= 60"),
        ("--start-delay", "nan", "give a number of seconds >= 0 and <= 60"),
        ("--start-delay", "inf", "give a number of seconds >= 0 and <= 60"),
        ("--start-delay", "1e300", "give a number of seconds >= 0 and <= 60"),
        ("--start-delay", "60.5", "give a number of seconds >= 0 and <= 60"),
        ("--rate", "nan", "give a rate in Hz, >= 1 and <= 1000"),
        ("--rate", "-20", "give a rate in Hz, >= 1 and <= 1000"),
        ("--rate", "1e12", "give a rate in Hz, >= 1 and <= 1000"),
        ("--rate", "1e-300", "give a rate in Hz, >= 1 and <= 1000"),
        ("--rate", "0.5", "give a rate in Hz, >= 1 and <= 1000"),
    ],
)
def test_a_frame_count_delay_or_rate_it_cannot_run_is_one_line_and_exit_2(capsys, option, value, want):
    """``--frames -3`` sent 0 frames and exited 0, ``--start-delay -5`` was taken as 0, ``--rate nan`` was a
    traceback: refused as argparse reads them, before any socket is bound."""
    from chestnut.launch.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["camera", "--synthetic", f"{option}={value}"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"chestnut camera: error: argument {option}: {value!r}: {want} (chestnut camera --help)"
    ]


def test_frames_0_still_means_run_until_stopped():
    import argparse

    from chestnut.launch import camerad

    p = argparse.ArgumentParser()
    camerad.add_arguments(p)
    args = p.parse_args(["--synthetic", "--frames", "0", "--start-delay", "0"])
    assert (args.frames, args.start_delay, args.rate) == (0, 0.0, 20.0)
    args = p.parse_args(["--synthetic", "--start-delay", "60", "--rate", "1"])
    assert (args.start_delay, args.rate) == (60.0, 1.0)


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--width", "100000", "--height", "100000"],
         "--width 100000 --height 100000: a bgr24 frame of 30000000000 bytes, over the 16 MiB a cameraFrame carries "
         "(msgs/services.py FRAME_MAX_BYTES); give a smaller size"),
        (["--synthetic", "--width", "4096", "--height", "4096", "--pixel-format", "nv12"],
         "--width 4096 --height 4096: a nv12 frame of 25165824 bytes, over the 16 MiB a cameraFrame carries "
         "(msgs/services.py FRAME_MAX_BYTES); give a smaller size"),
    ],
)
def test_a_frame_size_over_the_services_bound_is_blamed_on_the_size_not_the_video(args, why, caplog):
    """``--width 100000 --height 100000`` was reported as the traffic video that cannot be decoded."""
    from chestnut.launch.cli import main

    caplog.set_level("ERROR")
    assert main(["camera", *args]) == 2
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [why]


def test_a_source_that_is_a_fifo_is_refused_unopened_and_a_fifo_in_a_folder_is_no_image(tmp_path):
    """``chestnut camera --source FIFO`` blocked in open() until a signal came."""
    fifo = tmp_path / "cam.mp4"
    os.mkfifo(fifo)
    with pytest.raises(ValueError) as e:
        next(iter_frames(fifo, None, None))
    assert str(e.value) == (f"camera source {fifo} is a FIFO, not a regular file (never opened): give a video, an "
                            "image folder or an image")
    folder = tmp_path / "imgs"
    folder.mkdir()
    os.mkfifo(folder / "a.png")
    with pytest.raises(ValueError, match="holds no images"):
        next(iter_frames(folder, None, None))


def test_a_source_ffmpeg_cannot_read_is_one_line_naming_it_and_ffmpegs_reason(tmp_path):
    """100 random bytes as ``--source`` ended in PyAV's own text: ``... cannot be decoded as video or image: [Errno
    1094995529] Invalid data found when processing input: '<file>'``; an image of a folder alike."""
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(np.random.default_rng(0).bytes(100))
    folder = tmp_path / "imgs"
    folder.mkdir()
    (folder / "a.png").write_bytes(garbage.read_bytes())
    (tmp_path / "empty").mkdir()
    for source, why in (
        (garbage, f"camera source {garbage} is not a readable video or image (FFmpeg: Invalid data found when "
                  "processing input)"),
        (folder, f"camera source {folder}: image a.png is not a readable image (FFmpeg's avcodec_send_packet(): "
                 "Invalid data found when processing input)"),
        (tmp_path / "empty", f"camera source {tmp_path / 'empty'} holds no images (.bmp, .jpeg, .jpg, .png, .ppm, "
                             ".tif, .tiff, .webp)"),
    ):
        r = subprocess.run([CHESTNUT, "camera", "--source", str(source), "--frames", "1", "--start-delay", "0"],
                           capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout) == (2, "")
        assert [line.split(" ", 2)[2] for line in r.stderr.splitlines()] == [f"ERROR chestnut.camera: {why}"]


def test_a_frame_ffmpeg_cannot_decode_after_others_is_named_by_its_number():
    import av

    from chestnut.launch.camerad import unreadable_source

    video = Path("/data/drive.mp4")
    e = av.error.InvalidDataError(1094995529, "Invalid data found when processing input", "avcodec_send_packet()")
    assert unreadable_source(video, video, 41, e) == (
        "camera source /data/drive.mp4: frame 42 cannot be decoded (FFmpeg's avcodec_send_packet(): Invalid data "
        "found when processing input)")


def test_a_source_without_a_video_stream_is_named_so(tmp_path):
    """An audio-only file (a WAV here) opens, but has no video stream: PyAV's ``decode(video=0)`` raised
    IndexError, and the line ended in "tuple index out of range"."""
    import wave

    wav = tmp_path / "sound.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(bytes(1600))
    with pytest.raises(ValueError) as e:
        next(iter_frames(wav, None, None))
    assert str(e.value) == f"{wav} cannot be decoded as video or image: it holds no video stream"


def _png(path: Path, width: int, height: int, rows: int) -> Path:
    """A 1-bit grayscale PNG declaring ``width`` x ``height`` whose IDAT holds ``rows`` zero rows, compressed: a
    12000x12000 one is 18 kB on disk (FFmpeg decoded it to a 432 MB bgr24 frame at ``--native``)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z = zlib.compressobj(9)
    row = bytes(1 + (width + 7) // 8)
    idat = b"".join(z.compress(row) for _ in range(rows)) + z.flush()
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
                     + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    return path


_BOUND = ("a camera source's frame has at most 9316096 px (4x openpilot's 1928x1208 road-camera frame, "
          "launch/camerad.py SOURCE_MAX_PIXELS); refused from its header, never decoded")


def test_an_image_over_the_source_bound_is_refused_from_its_header(tmp_path, caplog):
    """``chestnut camera --source big.png`` (12000x12000) was decoded whole before any size check: 992 MB RSS."""
    from chestnut.launch import camerad
    from chestnut.launch.cli import main

    assert camerad.SOURCE_MAX_PIXELS == 4 * 1928 * 1208 == 9_316_096
    big = _png(tmp_path / "big.png", 12000, 12000, 12000)  # whole and valid: it decoded (resized) before
    with pytest.raises(ValueError) as e:
        next(iter_frames(big, 128, 256))
    assert str(e.value) == f"camera source {big}: a frame of 12000x12000 (144000000 px); {_BOUND}"
    # a header and 1 row of 20000: decoding would fail on the data; PIL's own bomb guard refuses it first
    bomb = _png(tmp_path / "bomb.png", 20000, 20000, 1)
    with pytest.raises(ValueError) as e:
        next(iter_frames(bomb, None, None))
    assert str(e.value) == (f"camera source {bomb}: an image over PIL's decompression-bomb limit (Image size "
                            f"(400000000 pixels) exceeds limit of 178956970 pixels); {_BOUND}")
    caplog.set_level("ERROR")
    assert main(["camera", "--source", str(big), "--native", "--frames", "1", "--start-delay", "0",
                 "--rt-priority", "0"]) == 2
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        f"camera source {big}: a frame of 12000x12000 (144000000 px); {_BOUND}"
    ]


def test_at_the_bound_an_image_is_served_and_a_folder_refuses_the_big_one_as_it_comes(tmp_path):
    """9316096 px is allowed (a 4658x2000 image: its one frame, resized); in a folder the images under the bound
    are served and the one over it is refused when its turn comes."""
    edge = _png(tmp_path / "edge.png", 4658, 2000, 2000)
    assert 4658 * 2000 == 9_316_000 <= 9_316_096
    assert [f.shape for f in iter_frames(edge, 64, 96, loop=False)] == [(64, 96, 3)]
    folder = tmp_path / "imgs"
    folder.mkdir()
    _png(folder / "a.png", 64, 32, 32)
    big = _png(folder / "b.png", 3200, 3000, 1)  # 9600000 px
    frames = iter_frames(folder, None, None)
    assert next(frames).shape == (32, 64, 3)
    with pytest.raises(ValueError) as e:
        next(frames)
    assert str(e.value) == f"camera source {big}: a frame of 3200x3000 (9600000 px); {_BOUND}"


def test_a_video_over_the_bound_is_refused_from_its_container_header(monkeypatch):
    """A video's frame size comes from its container (the traffic video: h264 in mp4, 704x576); with the bound one
    pixel under it, the video is refused before a frame is decoded."""
    from chestnut.launch import camerad

    monkeypatch.setattr(camerad, "SOURCE_MAX_PIXELS", 704 * 576 - 1)
    video = traffic_video_path()
    with pytest.raises(ValueError) as e:
        next(iter_frames(video, 128, 256))
    assert str(e.value) == (
        f"camera source {video}: a frame of 704x576 (405504 px); a camera source's frame has at most 405503 px (4x "
        "openpilot's 1928x1208 road-camera frame, launch/camerad.py SOURCE_MAX_PIXELS); refused from its header, "
        "never decoded"
    )


def test_ffmpegs_decoder_is_held_to_the_guard(monkeypatch):
    """Where no header tells the size, FFmpeg's ``max_pixels`` stops the decoder: with the guard at 1000 px the
    traffic video's decoder (704x576) refuses to open, named in the one line of a file FFmpeg cannot read."""
    from chestnut.launch import camerad

    assert camerad._DECODE_GUARD == {"max_pixels": "18632192"}
    monkeypatch.setattr(camerad, "_DECODE_GUARD", {"max_pixels": "1000"})
    video = traffic_video_path()
    with pytest.raises(ValueError) as e:
        next(iter_frames(video, 128, 256))
    assert str(e.value) == (f"camera source {video} is not a readable video or image (FFmpeg's "
                            """avcodec_open2("h264", {'max_pixels': '1000'}): Invalid argument)""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_during_the_start_delay_stops_the_camera_at_once(signum):
    """``--start-delay 8`` ignored SIGTERM and Ctrl-C until the 8 s were over (a signal handler that returns lets
    ``time.sleep`` sleep on): now a stop during the delay ends the camera at once, exit 0 and the same last line
    as a stop at any other time, no frame sent."""
    cam = subprocess.Popen([CHESTNUT, "camera", "--synthetic", "--start-delay", "60"], cwd=ROOT,
                           stderr=subprocess.PIPE, text=True)
    try:
        assert cam.stderr is not None
        lines = [cam.stderr.readline()]  # the camera's handlers are set before it logs what it publishes
        while " INFO chestnut.camera: camera: synthetic-" not in lines[-1]:
            assert lines[-1], f"the camera ended before it published: {lines}"
            lines.append(cam.stderr.readline())
        t0 = time.monotonic()
        cam.send_signal(signum)
        rc = cam.wait(20)
        stopped_s = time.monotonic() - t0
        rest = cam.stderr.read().splitlines()
    finally:
        cam.kill()
        cam.wait()
    assert rc == 0
    assert stopped_s < 5.0  # the delay's 60 s would otherwise run out first; the linger is 1 s at most
    assert [line.split(" ", 2)[2] for line in rest] == ["INFO chestnut.camera: camera: sent 0 frames, skipped 0 ticks"]
