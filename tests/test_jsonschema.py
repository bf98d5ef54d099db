"""JSON Schema and JSON generated from chestnut.capnp; MCAP files of JSON channels; chestnut export."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time

import jsonschema
from mcap.reader import make_reader
from test_logs import every_member_events

from chestnut.msgs.jsonschema import all_topic_schemas, event_to_json, service_schema
from chestnut.msgs.logfile import LogReader, RouteWriter
from chestnut.msgs.messaging import log_from_bytes
from chestnut.msgs.schema import log


def _expected(value):
    """pycapnp's to_dict as JSON: bytes as base64 (enums are already their names)."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, dict):
        return {k: _expected(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expected(v) for v in value]
    return value


def test_every_member_and_field_of_the_schema_has_a_json_schema_and_a_value_that_validates():
    members = list(log.Event.schema.union_fields)
    assert {f"/{m}" for m in members} <= set(all_topic_schemas())
    for member, data, as_dict in every_member_events(time.monotonic_ns() + 10**9):
        schema = service_schema(member)
        struct_fields = set(log.Event.schema.fields[member].schema.fields)
        assert set(schema["properties"]) == {"logMonoTime", "valid"} | struct_fields, member
        service, body = event_to_json(log_from_bytes(data))
        assert service == member
        jsonschema.validate(body, schema)
        expected = _expected(as_dict[member])
        assert {k: body[k] for k in expected} == json.loads(json.dumps(expected)), member


def test_a_nan_is_null_in_json_and_still_valid():
    msg = log.Event.new_message()
    msg.init("modelOutput").executionTime = float("nan")
    _, body = event_to_json(log_from_bytes(msg.to_bytes()))
    assert body["executionTime"] is None
    jsonschema.validate(body, service_schema("modelOutput"))


def _json_mcap_topics(path):
    with open(path, "rb") as f:
        out = {}
        for schema, channel, message in make_reader(f).iter_messages():
            assert (channel.message_encoding, schema.encoding) == ("json", "jsonschema")
            out.setdefault(channel.topic, []).append(json.loads(message.data))
    return out


def test_chestnut_export_converts_an_rlog_into_json_mcap_and_refuses_an_existing_output(tmp_path, caplog):
    events = every_member_events(time.monotonic_ns() + 10**9)
    with RouteWriter(tmp_path / "logs", formats=("zst",)) as w:
        for member, data, _ in events:
            w.write(member, log_from_bytes(data).logMonoTime, data)
    out = tmp_path / "view.mcap"
    cmd = [sys.executable, "-m", "chestnut.launch.cli", "export", str(tmp_path / "logs"), "--mcap", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    topics = _json_mcap_topics(out)
    assert {f"/{m}" for m, _, _ in events} <= set(topics)
    (img,) = topics["/camera/image"]
    (frame,) = topics["/cameraFrame"]
    assert img["encoding"] == {"bgr888": "bgr8", "rgb888": "rgb8", "gray8": "mono8", "nv12": "nv12"}[frame["encoding"]]
    assert (img["width"], img["height"], img["data"]) == (frame["width"], frame["height"], frame["data"])
    with caplog.at_level("WARNING", logger="chestnut.logs"):
        assert LogReader(out).files and list(LogReader(out)) == []  # no capnproto channel to read
    assert "holds only JSON channels" in caplog.text  # said, not silently empty
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "Traceback" not in again.stderr and str(out) in again.stderr


def test_a_route_with_both_mcap_encodings_replays_from_the_capnp_channels_and_shows_json(tmp_path):
    events = every_member_events(time.monotonic_ns() + 10**9)
    with RouteWriter(tmp_path, formats=("mcap",), mcap_encodings=("capnproto", "json")) as w:
        for member, data, _ in events:
            w.write(member, log_from_bytes(data).logMonoTime, data)
    (path,) = tmp_path.glob("*/rlog.mcap")
    reader = LogReader(path)
    assert [s for _, s, _ in reader][1:] == [m for m, _, _ in events] and reader.damage == []
    with open(path, "rb") as f:
        encodings = {c.topic: c.message_encoding for c in make_reader(f).get_summary().channels.values()}
    assert encodings["cameraFrame"] == "capnproto" and encodings["/cameraFrame"] == "json"


def _paths(layout: dict) -> list[str]:
    out = []
    for cfg in layout["configById"].values():
        out += [p["value"] for p in cfg.get("paths", [])]
        out += [cfg[k] for k in ("path", "topicPath", "topicToRender") if k in cfg]
        out += [cfg["imageMode"]["imageTopic"]] if "imageMode" in cfg else []
    return out


def test_every_message_path_of_the_foxglove_layout_names_a_generated_topic_and_field():
    import re
    from pathlib import Path

    import chestnut.launch

    layout = json.loads((Path(chestnut.launch.__file__).parent / "foxglove-layout.json").read_text())
    topics = all_topic_schemas()
    paths = _paths(layout)
    assert len(paths) >= 15
    for path in paths:
        topic = next((t for t in sorted(topics, key=len, reverse=True) if path == t or path.startswith(t + ".")), None)
        assert topic is not None, path
        node = topics[topic][1]
        for part in [p for p in path[len(topic) + 1 :].split(".") if p]:
            name, index = re.fullmatch(r"(\w+)(\[\d+\])?", part).groups()
            node = node["properties"][name]
            if index:
                node = node["items"]
    panels = {k.split("!")[0] for k in layout["configById"]}
    assert {"Image", "Indicator", "StateTransitions", "Plot", "RawMessages", "RosOut"} <= panels


def _export_in_process(tmp_path, caplog, log_path) -> tuple[int, list[tuple[str, str]]]:
    """``chestnut export LOG --mcap tmp/out/view.mcap`` in this process: (exit code, [(level, message)])."""
    from chestnut.launch.cli import main

    (tmp_path / "out").mkdir(mode=0o700)
    caplog.set_level("INFO", logger="chestnut")
    rc = main(["export", str(log_path), "--mcap", str(tmp_path / "out" / "view.mcap")])
    return rc, [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("chestnut")]


def test_export_of_a_file_that_is_no_log_is_one_line_as_check_says_it(tmp_path, caplog):
    other = tmp_path / "model.onnx"
    other.write_bytes(b"\x08\x07 not a log")
    rc, lines = _export_in_process(tmp_path, caplog, other)
    assert (rc, lines) == (2, [(
        "ERROR",
        f"LOG {other}: not a log file (expected a .zst or .mcap suffix); give log files or directories "
        "(rlog.zst / rlog.mcap)",
    )])
    assert list((tmp_path / "out").iterdir()) == []


def test_export_of_a_missing_log_is_one_line(tmp_path, caplog):
    missing = tmp_path / "nope" / "rlog.zst"
    rc, lines = _export_in_process(tmp_path, caplog, missing)
    assert (rc, lines) == (2, [
        ("ERROR", f"LOG {missing}: no such file or directory; give log files or directories (rlog.zst / rlog.mcap)")
    ])
    assert list((tmp_path / "out").iterdir()) == []


def test_export_of_a_damaged_zst_with_no_message_is_one_line_and_leaves_nothing(tmp_path, caplog):
    damaged = tmp_path / "rlog.zst"
    damaged.write_bytes(b"\x00not zstd at all" * 8)
    out = tmp_path / "out" / "view.mcap"
    rc, lines = _export_in_process(tmp_path, caplog, damaged)
    assert (rc, lines) == (2, [(
        "ERROR",
        f"nothing exported from {damaged} ({damaged}: byte 0: zstd: zstd decompressor error: Unknown frame "
        f"descriptor); {out} not written: give a log that chestnut record wrote",
    )])
    assert list((tmp_path / "out").iterdir()) == []
