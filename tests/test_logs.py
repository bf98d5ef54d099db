"""Log segments (rlog.zst and MCAP), the reader, and ``chestnut record`` as a real process."""

import io
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import capnp
import pytest
import zstandard as zstd
from mcap.exceptions import McapError
from mcap.reader import NonSeekingReader, make_reader
from mcap.records import Footer
from mcap.stream_reader import StreamReader

from chestnut.msgs.logfile import (
    MCAP_SCHEMA_NAME,
    FlushPolicy,
    LogDamage,
    LogReader,
    McapSegmentWriter,
    RlogSegmentWriter,
    RouteWriter,
    SegmentFileReader,
    code_generator_request,
    parse_segment_dir,
)
from chestnut.msgs.logger import Recorder, logged_services
from chestnut.msgs.messaging import PubMaster, log_from_bytes, new_message
from chestnut.msgs.schema import SCHEMA_SHA256, log
from chestnut.msgs.services import SERVICE_LIST

FORMATS = ["zst", "mcap"]
FRAME_BYTES = 128 * 256 * 3


# ---------------------------------------------------------------- helpers

_SCALARS = {
    "bool": True, "int8": -8, "int16": -1601, "int32": -320001, "int64": -(1 << 40) - 3, "uint8": 201,
    "uint16": 60001, "uint32": 4_000_000_001, "uint64": (1 << 63) + 5, "float32": 1.5, "float64": -2.75,
}


def _value(typ, schema, k):
    """A non-default value of Cap'n Proto type ``typ`` (``schema``: its struct/enum/list schema)."""
    kind = typ.which()
    if kind in _SCALARS:
        return _SCALARS[kind]
    if kind == "text":
        return f"text-{k}"
    if kind == "data":
        return bytes((k + i) % 256 for i in range(24))
    if kind == "enum":
        return list(schema.enumerants)[-1]
    if kind == "struct":
        return _struct_dict(schema, k)
    assert kind == "list", kind
    elem = typ.list.elementType
    elem_schema = schema.elementType if elem.which() in ("struct", "enum", "list") else None
    return [_value(elem, elem_schema, k + i) for i in range(2)]


def _struct_dict(schema, k):
    """Every field of a struct set to a non-default value (the last member of a union)."""
    names = list(schema.non_union_fields) + list(schema.union_fields[-1:])
    out = {}
    for name in names:
        field = schema.fields[name]
        if field.proto.which() == "group":
            out[name] = _struct_dict(field.schema, k)
        else:
            typ = field.proto.slot.type
            out[name] = _value(typ, field.schema if typ.which() in ("struct", "enum", "list") else None, k)
    return out


def every_member_events(t0_ns):
    """One fully populated Event per union member (serialized), logMonoTime = t0 + 1000 * i ns."""
    out = []
    for i, member in enumerate(log.Event.schema.union_fields):
        msg = log.Event.new_message(logMonoTime=t0_ns + 1000 * i, valid=False)
        msg.from_dict({member: _struct_dict(log.Event.schema.fields[member].schema, i)})
        out.append((member, msg.to_bytes(), msg.to_dict()))
    return out


def frame_event(frame_id, t_ns=None):
    msg = new_message("cameraFrame")
    if t_ns is not None:
        msg.logMonoTime = t_ns
    f = msg.cameraFrame
    f.frameId = frame_id
    f.width, f.height = 256, 128
    f.data = random.Random(frame_id).randbytes(FRAME_BYTES)  # incompressible, like sensor noise
    return msg.to_bytes()


def stamped(service, t_ns, k=0):
    msg = log.Event.new_message(logMonoTime=t_ns)
    msg.init(service)
    if service == "modelOutput":
        msg.modelOutput.frameId = k
    return msg.to_bytes()


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def single_file(tmp_path, fmt, name="rlog"):
    (path,) = tmp_path.rglob(f"{name}.{fmt}")
    return path


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_union_member_round_trips_byte_for_byte(tmp_path, fmt):
    t0 = time.monotonic_ns() + 10**9  # after the header that RouteWriter stamps now
    events = every_member_events(t0)
    assert [m for m, _, _ in events] == list(log.Event.schema.union_fields)
    with RouteWriter(tmp_path, formats=[fmt]) as w:
        for member, data, _ in events:
            w.write(member, log_from_bytes(data).logMonoTime, data)
    reader = LogReader(tmp_path, fmt=fmt)
    raw = list(reader.iter_raw())
    header, rest = raw[0], raw[1:]
    assert header[1] == "initData"
    assert [(s, d) for _, s, d in rest] == [(m, d) for m, d, _ in events]
    decoded = list(LogReader(tmp_path, fmt=fmt))[1:]
    assert [e.to_dict() for _, _, e in decoded] == [d for _, _, d in events]
    assert [t for t, _, _ in decoded] == [t0 + 1000 * i for i in range(len(events))]
    assert reader.damage == [] and list(reader.complete.values()) == [True]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_segment_starts_with_an_init_data_header(tmp_path, fmt):
    clock = FakeClock()
    with RouteWriter(tmp_path, formats=[fmt], segment_seconds=5.0, clock=clock, config={"k": "v"}) as w:
        for i in range(3):
            w.write("modelOutput", 10 + i, stamped("modelOutput", 10 + i, i))
            clock.t += 5.0
    segs = sorted(p.name for p in tmp_path.iterdir())
    assert [parse_segment_dir(s) for s in segs] == [(w.route, 0), (w.route, 1), (w.route, 2)]
    for n, seg in enumerate(segs):
        items = list(SegmentFileReader(tmp_path / seg / f"rlog.{fmt}"))
        assert [s for _, s, _, _ in items] == ["initData", "modelOutput"]
        init = items[0][3].initData
        versions = {kv.key: kv.value for kv in init.versions}
        assert {"chestnut", "tinygrad", "pycapnp", "pyzmq"} <= set(versions)
        assert versions["tinygrad"] == "0.14.0"
        assert init.schemaHash == SCHEMA_SHA256
        assert init.segmentSeconds == 5.0
        assert init.hostname == os.uname().nodename
        assert abs(init.wallTimeNanos - time.time_ns()) < 60e9
        assert '"k": "v"' in init.config and f'"segment": {n}' in init.config


@pytest.mark.parametrize("fmt", FORMATS)
def test_reader_merges_segments_and_routes_in_time_order(tmp_path, fmt):
    clock = FakeClock()
    base = time.monotonic_ns() + 10**9  # after the initData headers, stamped now
    expected = []
    # route A: three segments; each file is slightly out of order (by less than the reader's 1 s
    # window), and a segment's earliest message is older than the previous segment's latest
    route_a, route_b = "2026-01-01--00-00-00", "2026-01-01--00-00-01"
    with RouteWriter(tmp_path / "a", formats=[fmt], segment_seconds=1.0, clock=clock, route=route_a) as w:
        for seg in range(3):
            for ms in (seg * 100 + 5, seg * 100 + 1, seg * 100 + 50, seg * 100 + 120):
                t = base + ms * 10**6
                w.write("modelOutput", t, stamped("modelOutput", t, ms))
                expected.append(t)
            clock.t += 1.0
    # route B, given separately, interleaves with route A
    with RouteWriter(tmp_path / "b", formats=[fmt], segment_seconds=1.0, clock=clock, route=route_b) as w:
        for ms in (3, 77, 160, 299):
            t = base + ms * 10**6
            w.write("chestnutActive", t, stamped("chestnutActive", t))
            expected.append(t)
    reader = LogReader([tmp_path / "b", tmp_path / "a"], fmt=fmt)
    assert len(reader.files) == 4
    everything = [(t, s) for t, s, _ in reader]
    assert [t for t, _ in everything] == sorted(t for t, _ in everything)
    assert [s for _, s in everything].count("initData") == 4
    assert [t for t, s in everything if s != "initData"] == sorted(expected)
    assert reader.out_of_order == 0 and reader.damage == [] and set(reader.complete.values()) == {True}


def test_auto_format_reads_one_file_per_segment(tmp_path):
    with RouteWriter(tmp_path) as w:
        w.write("modelOutput", 7, stamped("modelOutput", 7))
    assert sorted(p.name for p in w.segment_dir.iterdir()) == ["rlog.mcap", "rlog.zst"]
    assert [f.name for f in LogReader(tmp_path).files] == ["rlog.zst"]
    assert [f.name for f in LogReader(tmp_path, fmt="mcap").files] == ["rlog.mcap"]
    with pytest.raises(FileNotFoundError, match="no qlog.zst/mcap under"):
        LogReader(tmp_path, name="qlog")


@pytest.mark.parametrize("fmt", FORMATS)
def test_light_log_keeps_every_decimation_th_message(tmp_path, fmt):
    with RouteWriter(tmp_path, formats=[fmt], full=False, light=True) as w:
        for i in range(45):
            for service in ("modelOutput", "controlState", "cameraFrame", "chestnutActive"):
                w.write(service, 100 + i, stamped(service, 100 + i, i))
    assert sorted(p.name for p in w.segment_dir.iterdir()) == [f"qlog.{fmt}"]
    kept = [(s, t) for t, s, _ in LogReader(tmp_path, name="qlog") if s != "initData"]
    # decimation in msgs/services.py: modelOutput 20, controlState 10, cameraFrame None, chestnutActive 1
    assert [t - 100 for s, t in kept if s == "modelOutput"] == [0, 20, 40]
    assert [t - 100 for s, t in kept if s == "controlState"] == [0, 10, 20, 30, 40]
    assert [t - 100 for s, t in kept if s == "chestnutActive"] == list(range(45))
    assert not [s for s, _ in kept if s == "cameraFrame"]


# ---------------------------------------------------------------- damage


def _write_flushed(path, writer_cls, n):
    """n frames, one flush each; returns (message sizes, file size after each flush)."""
    w = writer_cls(path, FlushPolicy(every_messages=1))
    sizes, ends = [], []
    for i in range(n):
        data = frame_event(i, t_ns=1000 + i)
        w.write("cameraFrame", 1000 + i, data)
        sizes.append(len(data))
        ends.append(path.stat().st_size)
    return w, sizes, ends


def test_truncated_zst_yields_every_flushed_message_and_reports_the_offset(tmp_path):
    full = tmp_path / "rlog.zst"
    w, sizes, ends = _write_flushed(full, RlogSegmentWriter, 5)
    big = log.Event.new_message(logMonoTime=2000)
    big.init("cameraFrame").data = random.Random(7).randbytes(300_000)  # three zstd blocks (128 KiB max)
    big_bytes = big.to_bytes()
    w.write("cameraFrame", 2000, big_bytes)
    ends.append(full.stat().st_size)
    w.close()
    blob = full.read_bytes()
    not_closed = "zstd frame not finished (the writer did not close the file)"
    partial = "truncated message: the stream ends {} bytes into it; " + not_closed
    mid4 = (ends[4] - ends[3]) // 2
    for k, cut, reason in [
        (0, ends[0], not_closed),  # a crash right after the flush of frame 0
        (2, ends[2] + 3, not_closed),  # inside the next block's 3-byte header: nothing of frame 3
        (3, ends[3] + mid4, partial.format(mid4 - 3)),  # inside frame 4's raw block (3-byte header)
        (4, ends[5] - 10, partial.format(len(big_bytes) - 10)),  # inside the big one's last block
    ]:
        cut_path = tmp_path / f"cut{k}.zst"
        cut_path.write_bytes(blob[:cut])
        seen = []
        reader = LogReader(cut_path, on_damage=seen.append)
        ids = [e.cameraFrame.frameId for _, _, e in reader]
        assert ids == list(range(k + 1))
        assert seen == reader.damage == [LogDamage(cut_path, sum(sizes[: k + 1]), reason)]
        assert reader.complete == {cut_path: False}


def test_corrupt_zst_block_is_reported_and_earlier_messages_survive(tmp_path):
    path = tmp_path / "rlog.zst"
    w, sizes, ends = _write_flushed(path, RlogSegmentWriter, 4)
    w.close()
    blob = path.read_bytes()
    for at, reason in [
        (0, "zstd: "),  # the 3-byte header of frame 2's block: reserved block type, zstd refuses it
        (5, "framing: segment table claims"),  # frame 2's bytes (a raw block): its Cap'n Proto framing
    ]:
        bad = bytearray(blob)
        bad[ends[1] + at : ends[1] + at + 3] = b"\xff\xff\xff"
        path.write_bytes(bytes(bad))
        reader = SegmentFileReader(path)
        assert [e.cameraFrame.frameId for _, _, _, e in reader] == [0, 1]
        assert [d.offset for d in reader.damage] == [sizes[0] + sizes[1]]
        assert reader.damage[0].reason.startswith(reason), reader.damage[0].reason
        assert reader.complete is False


def test_truncated_mcap_reads_to_the_cut_and_reports_the_record_offset(tmp_path):
    full = tmp_path / "rlog.mcap"
    w, _, ends = _write_flushed(full, McapSegmentWriter, 5)
    w.close()
    blob = full.read_bytes()
    for k, cut, reason in [
        (1, ends[1], "no footer: the file ends after its last complete record"),
        (3, ends[3] + 20, "truncated record: the file ends inside it"),
    ]:
        cut_path = tmp_path / f"cut{k}.mcap"
        cut_path.write_bytes(blob[:cut])
        reader = LogReader(cut_path)
        assert [e.cameraFrame.frameId for _, _, e in reader] == list(range(k + 1))
        assert [(d.path, d.offset, d.reason) for d in reader.damage] == [(cut_path, ends[k], reason)]
        # the mcap package's own non-seeking reader also gets every message before the cut
        got = []
        with open(cut_path, "rb") as f, pytest.raises((McapError, struct.error)):
            for _, _, message in NonSeekingReader(f).iter_messages(log_time_order=False):
                got.append(log_from_bytes(message.data).cameraFrame.frameId)
        assert got == list(range(k + 1))
    # chunk 3 damaged in its header (the compression name) or its compressed data (CRC / zstd):
    # the record's length is intact, so the reader skips it and goes on
    for at in (40, 90):
        bad = bytearray(blob)
        bad[ends[2] + at] ^= 0xFF
        (tmp_path / "bad.mcap").write_bytes(bytes(bad))
        reader = LogReader(tmp_path / "bad.mcap")
        assert [e.cameraFrame.frameId for _, _, e in reader] == [0, 1, 2, 4]
        assert [d.offset for d in reader.damage] == [ends[2]]
        assert reader.complete == {tmp_path / "bad.mcap": True}


def test_malformed_message_inside_a_file_is_reported_and_skipped(tmp_path):
    path = tmp_path / "rlog.zst"
    first, second, third = (stamped("modelOutput", t, t) for t in (10, 20, 30))
    assert first[:4] == b"\x00\x00\x00\x00"  # one segment: 8-byte table, root pointer at bytes 8..16
    # root struct pointer: offset 1000 words (far past the segment's end), 2 data words, 1 pointer
    bad = first[:8] + struct.pack("<Q", (1000 << 2) | (2 << 32) | (1 << 48)) + second[16:]
    w = RlogSegmentWriter(path)
    for data in (first, bad, third):
        w.write("modelOutput", 0, data)
    w.close()
    reader = SegmentFileReader(path)
    assert [t for t, _, _, _ in reader] == [10, 30]
    assert [(d.offset, d.reason.split(":")[0]) for d in reader.damage] == [(len(first), "malformed Event (framing)")]
    assert reader.complete is True


def test_a_newer_writers_unknown_member_is_counted_not_damage(tmp_path):
    path = tmp_path / "rlog.zst"
    first, second, third = (stamped("chestnutActive", t) for t in (10, 20, 30))
    # one segment: 8-byte table, root pointer, then Event's data section; the union discriminant is
    # its 16-bit slot 5 (log.Event.schema.node.struct.discriminantOffset), i.e. byte 8 + 8 + 10
    assert log.Event.schema.node.struct.discriminantOffset == 5
    newer = bytearray(second)
    newer[26:28] = struct.pack("<H", 200)
    w = RlogSegmentWriter(path)
    for data in (first, bytes(newer), third):
        w.write("chestnutActive", 0, data)
    w.close()
    reader = SegmentFileReader(path)
    assert [t for t, _, _, _ in reader] == [10, 30]
    assert (reader.unknown_members, reader.damage, reader.complete) == (1, [], True)


# ---------------------------------------------------------------- MCAP interoperability


def test_mcap_is_readable_by_the_mcap_package_and_self_describing(tmp_path):
    events = every_member_events(time.monotonic_ns() + 10**9)
    with RouteWriter(tmp_path, formats=["mcap"]) as w:
        for member, data, _ in events:
            w.write(member, log_from_bytes(data).logMonoTime, data)
    path = single_file(tmp_path, "mcap")
    with open(path, "rb") as f:
        reader = make_reader(f)
        summary = reader.get_summary()
        assert summary is not None and summary.statistics.message_count == len(events) + 1
        (schema,) = summary.schemas.values()
        assert (schema.name, schema.encoding) == (MCAP_SCHEMA_NAME, "capnproto")
        assert schema.data == code_generator_request()
        assert {c.topic: c.message_encoding for c in summary.channels.values()} == {
            **{"initData": "capnproto"}, **{m: "capnproto" for m, _, _ in events}
        }
        messages = [(c.topic, m.log_time, m.publish_time, m.data) for _, c, m in reader.iter_messages()]
        (meta,) = [m for m in reader.iter_metadata() if m.name == "chestnut"]
    assert [(t, d) for t, _, _, d in messages[1:]] == [(m, d) for m, d, _ in events]
    # MCAP times are Unix ns: logMonoTime plus the route's one offset, kept in the metadata and in initData
    offset = w.unix_offset_ns
    assert int(meta.metadata["unix_offset_ns"]) == offset
    assert json.loads(log_from_bytes(messages[0][3]).initData.config)["unix_offset_ns"] == offset
    assert all(lt == pt == log_from_bytes(d).logMonoTime + offset for _, lt, pt, d in messages)
    assert abs(messages[0][1] - time.time_ns()) < 60 * 10**9

    # a consumer that only has the file: build the schema from the CodeGeneratorRequest, decode
    pkg = Path(capnp.__file__).parent
    schema_capnp = capnp.SchemaParser().load(str(pkg / "schema.capnp"), imports=[str(pkg.parent)])
    loader = capnp.SchemaLoader()
    with schema_capnp.CodeGeneratorRequest.from_bytes(schema.data) as req:
        assert [(f.filename, len(f.imports)) for f in req.requestedFiles] == [("chestnut.capnp", 0)]
        roots = [n for n in req.nodes if n.displayName == MCAP_SCHEMA_NAME]
        assert len(roots) == 1 and roots[0].which() == "struct"
        names = {n.displayName for n in req.nodes}
        assert {"chestnut.capnp", "chestnut.capnp:CameraFrame.PixelEncoding", "chestnut.capnp:LayerHealth"} <= names
        for node in req.nodes:
            loader.load_dynamic(node)
        event_type = capnp._StructModule(loader.get(roots[0].id).as_struct(), "Event")
    for (_, _, original), (_, _, _, stored) in zip(events, messages[1:], strict=True):
        with event_type.from_bytes(stored) as ev:
            assert ev.to_dict() == original


# ---------------------------------------------------------------- chestnut record


def test_recorder_counts_and_skips_malformed_messages(tmp_path):
    with PubMaster(["modelOutput", "chestnutActive"]) as pm, RouteWriter(tmp_path, formats=["zst"]) as w:
        rec = Recorder(w, ["modelOutput", "chestnutActive"])
        try:
            deadline = time.monotonic() + 10
            while not rec.written["chestnutActive"]:  # wait for the subscription to reach the publisher
                assert time.monotonic() < deadline
                pm.send("chestnutActive", new_message("chestnutActive"))
                rec.step(20)
            pm.sock["modelOutput"].send(b"not a capnp message")
            pm.sock["modelOutput"].send(b"\x00" * 7)
            pm.sock["modelOutput"].send(new_message("chestnutActive").to_bytes())  # wrong service
            sentinel = new_message("modelOutput")
            sentinel.modelOutput.frameId = 99
            pm.send("modelOutput", sentinel)
            while not rec.written["modelOutput"]:
                assert time.monotonic() < deadline
                rec.step(20)
            assert rec.malformed == {("modelOutput", "framing"): 2, ("modelOutput", "wrong service"): 1}
            assert rec.received["modelOutput"] == 4
        finally:
            rec.close_sockets()
    outputs = [e.modelOutput.frameId for _, s, e in LogReader(tmp_path) if s == "modelOutput"]
    assert outputs == [99]


def test_a_recorder_behind_the_stack_at_its_stop_still_writes_what_its_sockets_hold(tmp_path):
    """The stack's last messages were sent before the logger's stop: ``drain_at_stop`` writes them (a frame
    the node answered is then in the log, not a missing one)."""
    from chestnut.msgs.logger import drain_at_stop

    with PubMaster(["modelOutput"]) as pm, RouteWriter(tmp_path, formats=["zst"]) as w:
        rec = Recorder(w, ["modelOutput"])
        try:
            deadline = time.monotonic() + 10
            while not rec.written["modelOutput"]:  # wait for the subscription to reach the publisher
                assert time.monotonic() < deadline
                pm.send("modelOutput", new_message("modelOutput"))
                rec.step(20)
            for k in range(30):  # sent while the recorder does not step: it is behind
                m = new_message("modelOutput")
                m.modelOutput.frameId = 1000 + k
                pm.send("modelOutput", m)
            assert drain_at_stop(rec, limit_s=30.0, poll_ms=1000) >= 30
        finally:
            rec.close_sockets()
    outputs = [e.modelOutput.frameId for _, s, e in LogReader(tmp_path) if s == "modelOutput"]
    assert [f for f in outputs if f >= 1000] == [1000 + k for k in range(30)]  # every one, in order


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--flush-seconds", "-1"], "argument --flush-seconds: '-1': give a number of seconds > 0"),
        (["--flush-seconds", "nan"], "argument --flush-seconds: 'nan': give a number of seconds > 0"),
        (["--flush-messages", "0"], "argument --flush-messages: '0': give a number of messages >= 1"),
        (["--rcvhwm", "x"], "argument --rcvhwm: 'x': give a number of messages >= 1 and <= 10000"),
        # an OverflowError traceback (ZMQ_RCVHWM is a C int)
        (["--rcvhwm", "99999999999999"],
         "argument --rcvhwm: '99999999999999': give a number of messages >= 1 and <= 10000"),
        (["--segment-seconds", "inf"], "argument --segment-seconds: 'inf': give a number of seconds >= 1 and <= 3600"),
        # ~10 empty segment directories a second
        (["--segment-seconds", "1e-300"],
         "argument --segment-seconds: '1e-300': give a number of seconds >= 1 and <= 3600"),
        (["--segment-seconds", "3601"],
         "argument --segment-seconds: '3601': give a number of seconds >= 1 and <= 3600"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_a_bad_record_argument_is_one_line_under_records_own_name(args, why, tmp_path, capsys):
    """``--flush-seconds -1`` printed the FlushPolicy's repr; an unknown flag pointed at ``chestnut --help``
    instead of the subcommand's."""
    from chestnut.launch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["record", "--log-dir", str(tmp_path / "logs"), *args])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"chestnut record: error: {why} (chestnut record --help)\n"
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("planted", ["shared", "symlink"])
def test_a_log_dir_others_can_write_or_a_symlink_is_refused_exit_2_and_kept(planted, tmp_path, caplog):
    """A 1777 ``--log-dir`` (a shared /tmp-like directory) exited 1, a runtime failure; it is a refused path."""
    from chestnut.launch.cli import main

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    given = shared if planted == "shared" else tmp_path / "link"
    if planted == "symlink":
        given.symlink_to(shared)
    why = {
        "shared": "is writable by group/other (mode 1777); "
        "give a directory of yours (or a new path: it is created 0700)",
        "symlink": "is a symlink; give the real directory or a new path",
    }[planted]
    assert main(["record", "--log-dir", str(given)]) == 2
    assert [r.getMessage() for r in caplog.records if r.name == "chestnut.record"] == [f"--log-dir {given} {why}"]
    assert list(shared.iterdir()) == []
    assert given.is_symlink() == (planted == "symlink")


def _start_logger(tmp_path, *extra):
    log_dir = tmp_path / "logs"
    stderr = open(tmp_path / "record.stderr", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        # both MCAP encodings: the capnproto channels are read back here like the rlog
        [sys.executable, "-m", "chestnut.launch.cli", "record", "--log-dir", str(log_dir), "--mcap-encoding", "both",
         "--frames", "raw",  # these tests compare the logged bytes with the published ones
         *extra],
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )
    stderr.close()
    deadline = time.monotonic() + 20
    while not list(log_dir.glob("*--0/rlog.mcap")):
        assert proc.poll() is None, (tmp_path / "record.stderr").read_text()
        assert time.monotonic() < deadline, "chestnut record did not start"
        time.sleep(0.05)
    return proc, log_dir


def _publish_frames(n, period_s=0.02):
    """Publish frames 0..n-1 on cameraFrame; returns id -> bytes."""
    sent = {}
    with PubMaster(["cameraFrame"]) as pm:
        time.sleep(0.2)  # let the logger (re)connect to the freshly bound endpoint
        for i in range(n):
            sent[i] = frame_event(i)
            pm.send("cameraFrame", sent[i])
            time.sleep(period_s)
        time.sleep(0.05)
    return sent


def _logged_frames(log_dir, fmt):
    reader = LogReader(log_dir, fmt=fmt)
    frames = [(log_from_bytes(d).cameraFrame.frameId, d) for _, s, d in reader.iter_raw() if s == "cameraFrame"]
    return reader, frames


@pytest.fixture
def reap():
    procs = []
    yield procs.append
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_record_stops_on_a_signal_with_complete_segments(tmp_path, reap, signum):
    proc, log_dir = _start_logger(tmp_path)
    reap(proc)
    sent = _publish_frames(40)
    time.sleep(0.3)
    proc.send_signal(signum)
    assert proc.wait(timeout=5) == 0
    zst, mcap_path = single_file(log_dir, "zst"), single_file(log_dir, "mcap")
    dobj = zstd.ZstdDecompressor().decompressobj()
    dobj.decompress(zst.read_bytes())
    assert dobj.eof and dobj.unused_data == b""  # the zstd frame was ended
    records = list(StreamReader(io.BytesIO(mcap_path.read_bytes()), emit_chunks=True).records)
    assert isinstance(records[-1], Footer) and records[-1].summary_start > 0
    for fmt in FORMATS:
        reader, frames = _logged_frames(log_dir, fmt)
        assert reader.damage == [] and all(reader.complete.values())
        ids = [i for i, _ in frames]
        assert len(ids) >= 20 and ids == list(range(ids[0], 40))  # contiguous up to the last one sent
        assert all(data == sent[i] for i, data in frames)
    assert f"stopped by signal {int(signum)}" in (tmp_path / "record.stderr").read_text()


@pytest.mark.timeout(60)
def test_sigkilled_record_leaves_segments_readable_up_to_the_last_flush(tmp_path, reap):
    proc, log_dir = _start_logger(tmp_path, "--flush-seconds", "0.2")
    reap(proc)
    sent = _publish_frames(30)
    time.sleep(1.0)  # > flush interval (0.2 s) + one poll (0.1 s): every frame has been flushed
    proc.kill()
    proc.wait(timeout=5)
    for fmt, reason in [
        ("zst", "zstd frame not finished (the writer did not close the file)"),
        ("mcap", "no footer: the file ends after its last complete record"),
    ]:
        reader, frames = _logged_frames(log_dir, fmt)
        ids = [i for i, _ in frames]
        assert len(ids) >= 15 and ids == list(range(ids[0], 30))
        assert all(data == sent[i] for i, data in frames)
        assert [d.reason for d in reader.damage] == [reason]
        assert list(reader.complete.values()) == [False]


def test_record_subscribes_to_every_service_the_registry_logs():
    assert logged_services() == [name for name, s in SERVICE_LIST.items() if s.should_log]


def test_a_zstd_bomb_is_read_in_bounded_memory(tmp_path):
    """64 KiB of zstd that decompress to 2 GiB of zeros (nonsense as Events): the reader reports it and gives
    up at the damage limit without holding more than a few pieces in memory (a child process's peak RSS)."""
    import subprocess
    import sys

    import zstandard as zstd

    path = tmp_path / "rlog.zst"
    with open(path, "wb") as f:
        w = zstd.ZstdCompressor(level=19).stream_writer(f)
        zeros = bytes(1 << 24)
        for _ in range(128):
            w.write(zeros)
        w.flush(zstd.FLUSH_FRAME)
    assert path.stat().st_size < 1 << 17
    code = ("import resource, sys\nfrom chestnut.msgs.logfile import SegmentFileReader\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "r = SegmentFileReader(sys.argv[1])\nn = sum(1 for _ in r)\n"
            "grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before\n"
            "print(n, len(r.damage), r.damage[-1].reason, grew // 1024)\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    n, damage, *reason, grew_mb = out.stdout.split()
    assert (n, damage, " ".join(reason)) == ("0", "101", "abandoned after 100 damage reports")
    assert int(grew_mb) < 256, out.stdout  # 2 GiB decompressed would be 2048


def test_record_takes_the_bounds_of_its_queue_and_segments_themselves():
    import argparse

    from chestnut.msgs.logger import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    low = p.parse_args(["--rcvhwm", "1", "--segment-seconds", "1"])
    high = p.parse_args(["--rcvhwm", "10000", "--segment-seconds", "3600"])
    assert (low.rcvhwm, low.segment_seconds, high.rcvhwm, high.segment_seconds) == (1, 1.0, 10000, 3600.0)


def test_record_refuses_a_planted_runtime_directory_before_any_log_file(tmp_path, capsys, monkeypatch):
    """It wrote a segment first, then said "cannot write the log" (the log was fine) and exited 1."""
    from chestnut.launch.cli import main
    from chestnut.msgs.paths import runtime_base

    prefix = f"planted-{os.getpid()}"
    planted = runtime_base() / f"chestnut-{os.getuid()}" / prefix
    planted.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    planted.write_text("")
    monkeypatch.setenv("CHESTNUT_PREFIX", prefix)
    try:
        assert main(["record", "--log-dir", str(tmp_path / "logs")]) == 2
        assert capsys.readouterr().err == (
            f"chestnut record: runtime directory {planted} is not a directory; remove it (rm -r {planted}) and start "
            "again, or choose another CHESTNUT_PREFIX\n")
        assert planted.is_file() and list((tmp_path / "logs").iterdir()) == []  # kept; no segment made
    finally:
        planted.unlink()
