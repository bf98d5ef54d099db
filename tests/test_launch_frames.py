"""``chestnut launch`` on full-size frames: ``--frames native``, ``--synthetic``, ``--pixel-format``,
``--transport`` reach the camera's command line, the node is switched to the warp, ``--dock-timing`` turns on
the twin's timing model, and bad combinations are one line and exit 2."""

import argparse
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from chestnut.launch.assets import traffic_video_path
from chestnut.launch.camerad import source_size
from chestnut.launch.frames import (
    DOCK_LATENCY_US,
    DOCK_LINK_MBPS,
    FrameOptions,
    frame_options,
    read_node_toml,
    write_frame_node_config,
)
from chestnut.launch.rundir import render_config
from chestnut.launch.stack import argument_problem
from chestnut.node.config import load_config

CHESTNUT = str(Path(sys.executable).with_name("chestnut"))


def test_native_synthetic_nv12_is_openpilots_road_frame_through_the_ring_on_the_dock_like_twin():
    opts = FrameOptions(frames="native", synthetic=True, pixel_format="nv12", dock_timing=True)
    assert opts.camera_args() == [
        "--synthetic",
        "--height",
        "1208",
        "--width",
        "1928",
        "--pixel-format",
        "nv12",
        "--transport",
        "auto",
    ]
    assert (DOCK_LINK_MBPS, DOCK_LATENCY_US) == (5600.0, 125.0)
    assert opts.twin_args() == ["--link-mbps", "5600", "--latency-us", "125"]
    assert opts.node_preprocess() == "warp:ppocr"
    # the primary's program takes the full frame: it crosses the copy path every frame
    assert opts.node_config_changes == {"preprocess": "warp:ppocr", "frame": "nv12:1928x1208"}
    assert FrameOptions(frames="native", synthetic=True, warp_on="node").node_config_changes == {
        "preprocess": "warp:ppocr"
    }
    assert opts.problem() is None


def test_native_video_keeps_its_size_and_model_frames_take_the_models_input_size():
    assert FrameOptions(frames="native", transport="shm").camera_args() == [
        "--native",
        "--pixel-format",
        "bgr24",
        "--transport",
        "shm",
    ]
    model = FrameOptions(model_hw=(64, 96))
    assert model.camera_args() == ["--height", "64", "--width", "96", "--pixel-format", "bgr24", "--transport", "auto"]
    assert model.twin_args() == []
    assert model.node_preprocess() == "ppocr"  # BGR at the model's size: no warp, the node config as given
    assert model.node_config_changes == {}
    video = FrameOptions(frames="native", native_hw=(576, 704))
    assert video.node_config_changes == {"preprocess": "warp:ppocr", "frame": "bgr888:704x576"}
    nv12 = FrameOptions(pixel_format="nv12", synthetic=True)
    assert nv12.camera_args()[:5] == ["--synthetic", "--height", "128", "--width", "256"]
    assert nv12.node_preprocess() == "warp:ppocr"  # nv12 needs the conversion even at the model's size
    assert nv12.node_model_frame() == "nv12:256x128"
    assert FrameOptions(frames="native", preprocess="warp:unit").node_preprocess() == "warp:unit"
    assert FrameOptions(dock_timing=True, link_mbps=10000, latency_us=0).twin_args() == [
        "--link-mbps",
        "10000",
        "--latency-us",
        "0",
    ]


LATENCY_WANT = "give a latency in microseconds >= 0 and <= 100000 (a thirtieth of the 3000 ms device wait timeout)"


@pytest.mark.parametrize("text", ["100000", "0", "125"])
def test_a_latency_up_to_its_bound_is_taken(text):
    from chestnut.msgs.argtypes import MAX_DOCK_LATENCY_US, dock_latency_us

    assert MAX_DOCK_LATENCY_US == 100_000.0
    assert dock_latency_us(text) == float(text)
    assert FrameOptions(dock_timing=True, latency_us=dock_latency_us(text)).problem() is None


def assert_refused_by_launch_and_twin_serve(option: str, text: str, want: str, capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    """``chestnut launch --dock-timing OPTION TEXT`` and ``chestnut twin serve OPTION TEXT`` each refuse it in
    argparse's one line naming ``want``, exit 2, and the launch makes no run directory."""
    from chestnut.launch.cli import main

    runs = ["--runs-dir", str(tmp_path / "runs")]
    for name, argv in (("launch", ["launch", "--dock-timing", option, text, *runs]),
                       ("twin serve", ["twin", "serve", option, text])):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert capsys.readouterr().err == (f"chestnut {name}: error: argument {option}: {text!r}: {want} "
                                           f"(chestnut {name} --help)\n")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("text", ["-1", "1e12", "100001", "inf", "nan", "soon"])
def test_a_latency_out_of_bounds_is_one_line_exit_2_for_launch_and_twin_serve_alike(text, capsys, tmp_path):
    """``--latency-us 1e12`` was taken: the primary never served, the node blamed "no_product_string ... permission
    issue", exit 0. ``chestnut twin serve`` took any finite latency; both take one type (``msgs/argtypes.py``)."""
    assert_refused_by_launch_and_twin_serve("--latency-us", text, LATENCY_WANT, capsys, tmp_path)


LINK_WANT = "give a link rate in Mbps >= 12 (USB 1.1 Full Speed) and <= 40000 (USB4)"


@pytest.mark.parametrize("text", ["12", "480", "5600", "40000"])
def test_a_link_rate_within_its_bounds_is_taken(text):
    from chestnut.msgs.argtypes import MAX_LINK_MBPS, MIN_LINK_MBPS, link_mbps

    assert (MIN_LINK_MBPS, MAX_LINK_MBPS) == (12.0, 40_000.0)
    assert link_mbps(text) == float(text)
    assert FrameOptions(dock_timing=True, link_mbps=link_mbps(text)).problem() is None


@pytest.mark.parametrize("text", ["0", "-5", "11.9", "1e-300", "40001", "1e12", "inf", "nan", "fast"])
def test_a_link_rate_out_of_bounds_is_one_line_exit_2_for_launch_and_twin_serve_alike(text, capsys, tmp_path):
    """``chestnut launch --link-mbps 1e-300`` was taken (any rate > 0: one 256 KiB chunk in ~1e292 s), and so was
    any finite rate; the slowest link a device with bulk endpoints has is USB 1.1's 12 Mbps."""
    assert_refused_by_launch_and_twin_serve("--link-mbps", text, LINK_WANT, capsys, tmp_path)


@pytest.mark.parametrize(
    ("opts", "line"),
    [
        (
            FrameOptions(link_mbps=5000),
            "--link-mbps sets the twin's dock-like timing model: add --dock-timing (or leave --link-mbps out)",
        ),
        (
            FrameOptions(latency_us=10),
            "--latency-us sets the twin's dock-like timing model: add --dock-timing (or leave --latency-us out)",
        ),
        (
            FrameOptions(dock_timing=True, dock_kind="cpu"),
            "--dock-timing is the twin's timing model, and the node configuration's dock.kind is 'cpu': leave "
            '--dock-timing out or use a configuration with dock.kind = "twin"',
        ),
        (
            FrameOptions(pixel_format="nv12", model_hw=(33, 64)),
            "--pixel-format nv12 --frames model: an nv12 frame has an even width and height, the model's input is "
            "64x33 (WxH); use --frames native or --pixel-format bgr24",
        ),
        (
            FrameOptions(frames="native", synthetic=True, model_frame="nv12:704x576"),
            "the node configuration's model.frame = 'nv12:704x576' is not the camera's frames (bgr888:1928x1208): "
            "leave model.frame out (chestnut launch sets it) or change --frames / --pixel-format",
        ),
    ],
)
def test_bad_combinations_are_one_line(opts, line):
    assert opts.problem() == line
    assert argument_problem(10.0, 20.0, [], opts) == line


def test_the_rendered_stack_runs_the_camera_and_twin_with_the_options(run_base, tmp_path, monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    opts = FrameOptions(frames="native", synthetic=True, pixel_format="nv12", transport="shm", dock_timing=True)
    conf = render_config(
        tmp_path,
        "frames-test",
        20.0,
        [],
        ["--engine", "onnxruntime", *opts.twin_args()],
        camera_args=opts.camera_args(),
    ).read_text()
    commands = [line for line in conf.splitlines() if line.startswith("command=")]
    camera = next(c for c in commands if " camera " in c)
    twin = next(c for c in commands if " twin serve " in c)
    env = conf.split("[program:camera]", 1)[1].split("\n[", 1)[0]
    assert 'GLIBC_TUNABLES="glibc.cpu.x86_non_temporal_threshold=0x100000"' in env  # big frames: streaming stores
    inline = render_config(tmp_path, "frames-test", 20.0, [], [], streaming_copies=False).read_text()
    assert 'GLIBC_TUNABLES=""' in inline.split("[program:camera]", 1)[1].split("\n[", 1)[0]
    assert camera.endswith(
        "camera --rate 20.0 --synthetic --height 1208 --width 1928 --pixel-format nv12 --transport shm"
    )
    assert twin.endswith("twin serve --engine onnxruntime --link-mbps 5600 --latency-us 125")


def test_the_runs_node_config_is_the_given_one_with_the_warp(tmp_path):
    given = tmp_path / "given.toml"
    given.write_text(
        "[model]\nshape = [1, 3, 64, 128]\n[model.ranges]\ntext_prob = [0.0, 1.0]\n[timing]\ndeadline_ms = 120\n"
    )
    table = read_node_toml(given)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    opts = FrameOptions(frames="native", synthetic=True, pixel_format="nv12", model_hw=(64, 128))
    path = write_frame_node_config(run_dir, table, opts)
    assert path == run_dir / "node.toml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = tomllib.loads(path.read_text())
    assert data["model"] == {
        "shape": [1, 3, 64, 128],
        "preprocess": "warp:ppocr",
        "frame": "nv12:1928x1208",
        "ranges": {"text_prob": [0.0, 1.0]},
    }
    assert data["timing"] == {"deadline_ms": 120}
    cfg = load_config(path)
    assert (cfg.model.preprocess, cfg.model.frame, cfg.model.shape, cfg.timing.deadline_ms) == (
        "warp:ppocr",
        "nv12:1928x1208",
        (1, 3, 64, 128),
        120.0,
    )


@pytest.mark.parametrize(("rate", "given", "changes"), [
    (10.0, "", {"frame_period_ms": 100.0}),
    (20.0, "", {}),                                       # node/config.py's default period, 50 ms
    (40.0, "[timing]\nframe_period_ms = 25\n", {}),      # the given config's own period is the camera's
    (20.0, "[timing]\nframe_period_ms = 25\n", {"frame_period_ms": 50.0}),
], ids=["10Hz", "20Hz", "given-40Hz", "given-other"])
def test_the_runs_node_config_takes_the_cameras_frame_period(tmp_path, rate, given, changes):
    """``--rate`` is the camera's: the node's ``timing.frame_period_ms`` follows it (its stage budget and the bound
    on its runs, ``node/health.py`` ``StageBudget``, judge the frames the camera sends)."""
    toml = tmp_path / "given.toml"
    toml.write_text(given)
    table = read_node_toml(toml)
    args = argparse.Namespace(frames="model", synthetic=False, pixel_format="bgr24", transport="auto",
                              dock_timing=False, link_mbps=None, latency_us=None, warp=None, rate=rate)
    opts = frame_options(args, table)
    assert (opts.node_config_changes, opts.node_timing_changes) == ({}, changes)
    if changes:
        run_dir = tmp_path / "run"
        run_dir.mkdir(mode=0o700)
        cfg = load_config(write_frame_node_config(run_dir, table, opts))
        assert cfg.timing.frame_period_ms == changes["frame_period_ms"]


def test_the_default_node_config_gives_the_models_size_and_preprocess():
    table = read_node_toml(None)  # launch/node.toml
    assert table["model"]["shape"] == [1, 3, 128, 256] and table["model"]["preprocess"] == "ppocr"


def test_a_bad_combination_stops_the_launch_before_anything_starts(tmp_path):
    r = subprocess.run(
        [
            CHESTNUT,
            "launch",
            "--seconds",
            "10",
            "--frames",
            "native",
            "--link-mbps",
            "5000",
            "--runs-dir",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        "ERROR chestnut.launch: --link-mbps sets the twin's dock-like timing model: add --dock-timing "
        "(or leave --link-mbps out)"
    )
    assert not (tmp_path / "runs").exists()


def test_an_unreadable_node_config_is_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    r = subprocess.run(
        [CHESTNUT, "launch", "--seconds", "10", "--node-config", str(bad), "--runs-dir", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and f"ERROR chestnut.launch: --node-config: {bad} is not valid TOML: " in lines[0]
    assert not (tmp_path / "runs").exists()


def test_native_video_frames_are_the_traffic_videos_own_size():
    args = argparse.Namespace(
        frames="native",
        synthetic=False,
        pixel_format="nv12",
        transport="auto",
        dock_timing=False,
        link_mbps=None,
        latency_us=None,
        warp="primary",
        rate=20.0,
    )
    assert source_size(traffic_video_path()) == source_size(traffic_video_path(), "nv12") == (576, 704)
    opts = frame_options(args, read_node_toml(None))
    assert (opts.native_hw, opts.model_hw, opts.preprocess) == ((576, 704), (128, 256), "ppocr")
    assert opts.node_config_changes == {"preprocess": "warp:ppocr", "frame": "nv12:704x576"}
    assert opts.camera_args() == ["--native", "--pixel-format", "nv12", "--transport", "auto"]


def test_a_node_config_the_node_would_refuse_is_refused_before_it_is_rewritten(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('stray = 1\n[model]\npreprocess = "ppocr"\n')  # a key outside every section
    r = subprocess.run(
        [
            CHESTNUT,
            "launch",
            "--seconds",
            "10",
            "--frames",
            "native",
            "--synthetic",
            "--node-config",
            str(bad),
            "--runs-dir",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        f"ERROR chestnut.launch: --node-config: unknown section [stray] in {bad}; "
        "known: model, fallback, dock, timing, realtime"
    ), r.stderr
    assert not (tmp_path / "runs").exists()
