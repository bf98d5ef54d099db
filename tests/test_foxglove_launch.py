"""Foxglove on a launched stack: a WebSocket client speaking the Foxglove WebSocket protocol reads the live
stack from ``chestnut launch --foxglove``; a JSON-only MCAP reader reads the run's log; a one-shot fault
that fires within a second is on the record, the summary and the report.

One launched stack (twin, logger, control, node, camera, foxglove) is shared by the module's tests.
Needs the prepared model (``chestnut model prepare``, part of ``launch/setup.sh``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import av
import jsonschema
import pytest
import websockets
from mcap.reader import make_reader

from chestnut.launch.assets import default_model_path
from chestnut.msgs.services import SERVICE_LIST

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# the protocol's subprotocol names: foxglove.websocket.v1 (Foxglove's ws-protocol) and the name
# foxglove-sdk 0.30 gives the same protocol (it refuses the older name with HTTP 400)
SUBPROTOCOLS = ["foxglove.websocket.v1", "foxglove.sdk.v1"]
WANTED = ("/modelOutput", "/chestnutActive", "/chestnutHealth", "/camera/image", "/camera/video")
OP_MESSAGE_DATA = 0x01  # binary server message: opcode u8, subscription id u32 LE, log time u64 LE, payload


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _client(port: int, deadline_s: float) -> dict:
    """Connect (retrying until the server is up), collect the advertisements, subscribe to WANTED and
    decode one message of each with its advertised JSON Schema."""
    t_end = time.monotonic() + deadline_s
    while True:
        try:
            ws = await websockets.connect(f"ws://127.0.0.1:{port}", subprotocols=SUBPROTOCOLS, max_size=None)
            break
        except OSError:
            assert time.monotonic() < t_end, "the Foxglove server never listened"
            await asyncio.sleep(0.3)
    out: dict = {"subprotocol": ws.subprotocol, "channels": {}, "messages": {}, "server_info": None}
    async with ws:
        subscribed: dict[int, str] = {}
        while len(out["messages"]) < len(WANTED):
            assert time.monotonic() < t_end, f"got {sorted(out['messages'])} of {WANTED}"
            frame = await asyncio.wait_for(ws.recv(), timeout=max(t_end - time.monotonic(), 0.1))
            if isinstance(frame, str):
                msg = json.loads(frame)
                if msg["op"] == "serverInfo":
                    out["server_info"] = msg
                elif msg["op"] == "advertise":
                    for ch in msg["channels"]:
                        out["channels"][ch["topic"]] = ch
                    subs = [
                        {"id": 100 + i, "channelId": out["channels"][t]["id"]}
                        for i, t in enumerate(WANTED)
                        if t in out["channels"]
                    ]
                    if len(subs) == len(WANTED) and not subscribed:
                        await ws.send(json.dumps({"op": "subscribe", "subscriptions": subs}))
                        subscribed = {s["id"]: t for s, t in zip(subs, WANTED, strict=True)}
                continue
            op, sub_id, log_time = struct.unpack_from("<BIQ", frame)
            assert op == OP_MESSAGE_DATA
            topic = subscribed[sub_id]
            out["messages"].setdefault(topic, (log_time, json.loads(frame[13:])))
    return out


def _decode_h264(data_b64: str) -> list:
    codec = av.CodecContext.create("h264", "r")
    return list(codec.decode(av.Packet(base64.b64decode(data_b64))))


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    if not default_model_path().is_file():
        pytest.fail("the real model is not prepared: run `bash launch/setup.sh` (chestnut model prepare)")
    tmp = tmp_path_factory.mktemp("foxglove")
    port = _free_port()
    env = dict(os.environ, CHESTNUT_PREFIX=f"fox{os.getpid()}")
    summary = tmp / "summary.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "chestnut.launch.cli",
            "launch",
            "--seconds",
            "10",
            "--no-live",
            "--foxglove",
            str(port),
            "--runs-dir",
            str(tmp / "runs"),
            "--fault",
            "timeout@1",
            "--json",
            str(summary),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        live = asyncio.run(_client(port, 120.0))
    finally:
        stdout, stderr = proc.communicate(timeout=240)
    assert summary.is_file(), stdout[-3000:] + stderr[-3000:]
    (run_dir,) = (tmp / "runs").iterdir()
    return live, json.loads(summary.read_text()), run_dir, stderr


def test_a_foxglove_websocket_client_decodes_the_live_stack_with_the_advertised_schemas(launched):
    live, summary, _, _ = launched
    assert live["subprotocol"] in SUBPROTOCOLS and live["server_info"]["name"] == "chestnut"
    channels = live["channels"]
    # every service on its own topic, plus the image, plot and log topics; each with a JSON Schema
    assert {f"/{s}" for s in SERVICE_LIST} | {"/camera/image", "/chestnut/levels", "/chestnut/log"} <= set(channels)
    assert all((c["encoding"], c["schemaEncoding"]) == ("json", "jsonschema") for c in channels.values())
    for topic in WANTED:
        schema = json.loads(channels[topic]["schema"])
        _, msg = live["messages"][topic]
        jsonschema.validate(msg, schema)
    assert channels["/camera/image"]["schemaName"] == "foxglove.RawImage"
    assert channels["/camera/video"]["schemaName"] == "foxglove.CompressedVideo"
    log_time, video = live["messages"]["/camera/video"]
    assert video["format"] == "h264"
    (frame,) = _decode_h264(video["data"])  # the client's stream starts with a keyframe, at the camera's size
    assert (frame.width, frame.height, frame.key_frame) == (256, 128, True)
    # Unix time (ns), not the machine's since-boot clock: between the run's wall-clock start and now
    assert summary["wall_start_ns"] - 10**9 <= log_time <= time.time_ns()
    assert summary["wall_start_ns"] // 10**9 - 1 <= video["timestamp"]["sec"] <= time.time()
    _, img = live["messages"]["/camera/image"]
    assert (img["width"], img["height"], img["encoding"], img["step"]) == (256, 128, "bgr8", 768)
    assert len(base64.b64decode(img["data"])) == 128 * 256 * 3
    _, out = live["messages"]["/modelOutput"]
    assert out["source"] in ("primary", "fallback") and out["outputs"][0]["dtype"] == "float32"
    _, health = live["messages"]["/chestnutHealth"]
    assert [la["layer"] for la in health["layers"]] == ["usb", "pcie", "gpu", "output"]
    _, active = live["messages"]["/chestnutActive"]
    assert isinstance(active["active"], bool) and active["reason"]


def test_the_runs_mcap_opens_with_a_json_only_reader_every_service_and_frames_as_images(launched):
    _, _, run_dir, _ = launched
    seen: dict[str, dict] = {}
    images = 0
    for path in sorted((run_dir / "logs").glob("*/rlog.mcap")):
        with open(path, "rb") as f:
            reader = make_reader(f)
            for schema, channel, message in reader.iter_messages():
                # a reader that only knows what Foxglove decodes: json messages with jsonschema schemas
                assert (channel.message_encoding, schema.encoding) == ("json", "jsonschema"), channel.topic
                body = json.loads(message.data)
                if channel.topic not in seen:
                    jsonschema.validate(body, json.loads(schema.data))
                    seen[channel.topic] = body
                if channel.topic == "/camera/image":
                    assert schema.name == "foxglove.RawImage"
                    assert len(base64.b64decode(body["data"])) == body["step"] * body["height"]
                    images += 1
    logged = {f"/{s}" for s, svc in SERVICE_LIST.items() if svc.should_log}
    assert logged <= set(seen), sorted(logged - set(seen))
    assert images > 100
    assert set(seen["/modelOutput"]) >= {"frameId", "source", "outputs", "executionTime", "frameAge"}
    assert set(seen["/cameraFrame"]) >= {"frameId", "width", "height", "encoding", "data"}


def test_the_runs_mcap_is_on_unix_time_and_has_the_camera_as_h264_at_its_size(launched):
    """Foxglove places the drive at the time it happened: every logTime / publishTime is Unix ns (within a
    minute of the run's wall-clock start), and /camera/video is foxglove.CompressedVideo whose first message
    is a keyframe that decodes to the camera's 256x128."""
    _, s, run_dir, _ = launched
    wall_start_ns = s["wall_start_ns"]
    assert abs(wall_start_ns - time.time_ns()) < 15 * 60 * 10**9  # the summary's start: this run's
    first_video = None
    times = []
    for path in sorted((run_dir / "logs").glob("*/rlog.mcap")):
        with open(path, "rb") as f:
            for schema, channel, message in make_reader(f).iter_messages():
                times.append((message.log_time, message.publish_time))
                if channel.topic == "/camera/video" and first_video is None:
                    assert schema.name == "foxglove.CompressedVideo"
                    first_video = json.loads(message.data)
    assert times and all(lt == pt for lt, pt in times)
    assert abs(min(t for t, _ in times) - wall_start_ns) < 60 * 10**9
    assert max(t for t, _ in times) - wall_start_ns < 10 * 60 * 10**9
    assert first_video is not None and first_video["format"] == "h264"
    (frame,) = _decode_h264(first_video["data"])
    assert (frame.width, frame.height, frame.key_frame) == (256, 128, True)


def test_a_one_shot_fault_firing_within_a_second_is_on_the_record_summary_and_report(launched):
    _, s, run_dir, stderr = launched
    events = [(e["fault"], e["action"]) for e in s["fault_events"]]
    assert ("timeout#1", "armed") in events and ("timeout#1", "fired") in events
    fired = next(e for e in s["fault_events"] if e["action"] == "fired")
    armed = next(e for e in s["fault_events"] if e["action"] == "armed")
    assert fired["t_s"] >= armed["t_s"] and fired["site"]  # the next transfer after it was armed, named
    assert [f["action"] for f in s["fault_schedule"]] == ["inject"]
    # injected no earlier than the logged schedule said, and logged at the time the summary gives (one clock)
    planned = float(re.search(r"fault schedule: timeout at ([0-9.]+) s", stderr).group(1))
    injected = float(re.search(r"t=([0-9.]+) s: injected timeout", stderr).group(1))
    assert s["fault_schedule"][0]["t_s"] >= planned - 0.05
    assert abs(s["fault_schedule"][0]["t_s"] - injected) <= 0.05 + 1e-9
    page = (run_dir / "report" / "index.html").read_text()
    assert "fault timeout#1 fired" in page and "fault schedule (1)" in page
    assert Path(run_dir / "faults.json").is_file()
