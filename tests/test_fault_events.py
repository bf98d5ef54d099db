"""Fault events on the record: every armed / fired / cleared / expired event, with what it hit."""

from __future__ import annotations

import json

from chestnut.backend.sim.faults import FaultSpec, FaultTable, Phase, TransferSite


def test_a_one_shot_fault_records_armed_fired_with_its_site_and_expired():
    table = FaultTable()
    f = table.add(FaultSpec("timeout", after=1), 10.0)
    site = TransferSite("out", "bulk")
    assert table.check("timeout", 10.1, Phase.SERVING, site) is None  # the first one is let through
    assert table.check("timeout", 10.2, Phase.SERVING, site) is f
    assert table.prune(10.3) == [f]
    events = table.drain_events()
    assert [(e.action, e.t_s, e.site, e.fired, e.opportunities) for e in events] == [
        ("armed", 10.0, "", 0, 0),
        ("fired", 10.2, "bulk out #2", 1, 2),
        ("expired", 10.3, "", 1, 2),
    ]
    assert {e.kind for e in events} == {"timeout"} and {e.fault_id for e in events} == {f.id}
    assert [json.loads(e.params) for e in events] == [{"after": 1}] * 3  # only what was given beyond the kind
    assert table.drain_events() == []


def test_a_packet_fault_names_the_packet_and_a_clear_is_recorded():
    table = FaultTable()
    f = table.add(FaultSpec("gpu_hang", repeat=True), 1.0)
    for _ in range(3):
        table.check("gpu_hang", 2.0, Phase.SERVING)
    table.clear(f.id, 5.0)
    events = table.drain_events()
    assert [(e.action, e.site) for e in events] == [
        ("armed", ""),
        ("fired", "packet #1"),
        ("fired", "packet #2"),
        ("fired", "packet #3"),
        ("cleared", ""),
    ]
    assert events[-1].t_s == 5.0 and events[-1].fired == 3


def test_the_event_queue_is_bounded_and_counts_what_it_dropped():
    table = FaultTable()
    table.add(FaultSpec("timeout", repeat=True), 0.0)
    for _ in range(FaultTable.EVENTS + 10):
        table.check("timeout", 0.0, Phase.SERVING, TransferSite("in", "bulk"))
    assert len(table.drain_events()) == FaultTable.EVENTS and table.events_dropped == 11


def test_the_twin_daemon_publishes_a_one_shot_fault_armed_fired_and_spent_when_it_happens():
    import time

    import zmq

    from chestnut.backend import protocol as P
    from chestnut.backend.sim.client import running_twin
    from chestnut.backend.sim.libusb_codes import UsbError
    from chestnut.msgs.messaging import log_from_bytes, sub_sock

    with running_twin(args=["--training-delay-ms", "2"]) as twin:
        sock = sub_sock("twinFault", timeout_ms=3000)
        try:
            time.sleep(0.3)  # the subscription reaches the daemon's publisher before the first event
            d = twin.enumerate()[0]
            h = twin.open(d.bus, d.address)
            twin.fault("timeout")
            try:
                twin.ctrl_transfer(h, P.REQTYPE_VENDOR_IN, P.REQ_XDATA_READ, P.XDATA_LTSSM, 0, 1, 100)
            except UsbError:
                pass
            got = []
            while len(got) < 3:
                try:
                    ev = log_from_bytes(sock.recv()).twinFault
                except zmq.Again:
                    break
                got.append((ev.kind, str(ev.action), ev.site, ev.params))
        finally:
            sock.close(linger=0)
    assert got == [
        ("timeout", "armed", "", "{}"),
        ("timeout", "fired", f"control in {P.REQ_XDATA_READ:#04x} #1", "{}"),
        ("timeout", "expired", "", "{}"),
    ]


def _twin_fault(t_ns: int, action: str, site: str = "", fired: int = 0) -> bytes:
    from chestnut.msgs.messaging import new_message

    m = new_message("twinFault")
    m.logMonoTime = t_ns
    tf = m.twinFault
    tf.id, tf.kind, tf.action, tf.site, tf.params, tf.fired = 1, "timeout", action, site, "{}", fired
    return m.to_bytes()


def test_a_one_shot_fault_spent_within_a_second_is_on_the_report_timeline_and_story(tmp_path):
    import time

    from chestnut.msgs.logfile import RouteWriter
    from chestnut.msgs.messaging import log_from_bytes
    from chestnut.node.offline.report import fault_spans, story_rows, write_report
    from chestnut.node.offline.timeline import read_timeline

    t0 = time.monotonic_ns() + 10**9
    items = [
        _twin_fault(t0, "armed"),
        _twin_fault(t0 + 200_000_000, "fired", "bulk out #1", 1),
        _twin_fault(t0 + 300_000_000, "expired", "", 1),
    ]
    with RouteWriter(tmp_path / "logs", formats=("zst",)) as w:
        for data in items:
            w.write("twinFault", log_from_bytes(data).logMonoTime, data)
    tl = read_timeline(tmp_path / "logs")
    ((name, armed, end, fired),) = fault_spans(tl)
    assert name == "timeout#1" and round(end - armed, 3) == 0.3 and [round(f - armed, 3) for f in fired] == [0.2]
    assert [(what, why) for _, what, kind, why in story_rows(tl) if kind == "fault"] == [
        ("fault timeout#1 injected", "parameters: the kind's defaults"),
        ("fault timeout#1 fired", "hit bulk out #1"),
        ("fault timeout#1 spent (a one-shot: fired once and fires no more)", ""),  # the summary's word: spent
    ]
    page = write_report(tmp_path / "report", tl).read_text()
    assert "fault timeout#1 fired" in page and "hit bulk out #1" in page
