"""The report's words on differences: an exact 0 is counted and said, never drawn as a made-up value."""

from __future__ import annotations

from chestnut.node.offline.report import describe_diffs


def test_all_identical():
    assert describe_diffs("replayed / logged", [0.0, 0.0, 0.0]) == (
        "replayed / logged: all 3 frames identical (difference exactly 0)")


def test_some_identical():
    assert describe_diffs("primary / fallback", [0.0, 2.5e-7, 0.0, 1e-5]) == (
        "primary / fallback: 2 of 4 frames identical (difference exactly 0, not drawn on the log axis); "
        "largest difference 1e-05")


def test_none_identical_and_none_compared():
    assert describe_diffs("primary / fallback", [3e-6, 1.25e-4]) == (
        "primary / fallback: 2 frames, none identical; largest difference 0.000125")
    assert describe_diffs("primary / fallback", []) == "primary / fallback: no frame compared"


# ---------------------------------------------------------------- faults from inject to clear, legends

MS = 1_000_000


def _fault_log(tmp_path):
    """A log of 8 s: nodeState at 10 Hz, a one-shot ``timeout`` armed at 1 s after the first message, fired
    0.2 s later and expired at 0.3 s (as the twin sends them), primary outputs with stage times and
    primary / fallback differences."""
    import time

    from chestnut.msgs.logfile import RouteWriter
    from chestnut.msgs.messaging import new_message

    t0 = time.monotonic_ns() + 10**9
    items = []
    for k in range(80):
        m = new_message("nodeState")
        m.nodeState.state = "active"
        m.logMonoTime = t0 - 10**9 + k * 100 * MS
        items.append(m)
        o = new_message("modelOutput")
        o.logMonoTime = m.logMonoTime + MS
        mo = o.modelOutput
        mo.frameId, mo.source, mo.executionTime, mo.frameAge = k, "primary", 0.01, 0.012
        mo.copyInTime, mo.computeTime, mo.copyOutTime = 0.004, 0.005, 0.001
        mo.agreementChecked, mo.primaryAgrees, mo.maxAbsDiff = True, True, 1e-5 * (1 + k % 3)
        items.append(o)
    for dt, action, site, fired in ((0, "armed", "", 0), (200, "fired", "bulk out #1", 1), (300, "expired", "", 1)):
        m = new_message("twinFault")
        m.logMonoTime = t0 + dt * MS
        tf = m.twinFault
        tf.id, tf.kind, tf.action, tf.site, tf.params, tf.fired = 1, "timeout", action, site, "{}", fired
        items.append(m)
    items.sort(key=lambda m: m.logMonoTime)
    with RouteWriter(tmp_path / "logs", formats=("zst",)) as w:
        for m in items:
            w.write(m.which(), m.logMonoTime, m.to_bytes())
    return tmp_path / "logs", t0


def test_each_fault_is_drawn_and_tabled_from_inject_to_clear_with_its_events(tmp_path):
    from chestnut.node.offline.report import FaultInterval, fault_intervals, write_report
    from chestnut.node.offline.timeline import read_timeline

    logs, t0 = _fault_log(tmp_path)
    tl = read_timeline(logs)
    armed = tl.seconds(t0)
    inject, clear = round(armed + 0.01, 3), round(armed + 5.0, 3)  # launch's steps, on the log's clock
    schedule = [{"t_s": inject, "action": "inject", "fault": "timeout", "detail": ""},
                {"t_s": clear, "action": "clear", "fault": "timeout", "detail": ""}]
    (iv,) = fault_intervals(tl, schedule)
    assert iv == FaultInterval("timeout#1", armed, clear, "cleared by launch",
                               [(armed, "armed"), (tl.seconds(t0 + 200 * MS), "fired"),
                                (tl.seconds(t0 + 300 * MS), "expired")])
    # without launch's schedule (chestnut check of a log alone): the twin's own end
    (alone,) = fault_intervals(tl)
    assert (alone.start_s, alone.end_s, alone.end_how) == (armed, tl.seconds(t0 + 300 * MS), "expired (twin)")
    page = write_report(tmp_path / "report", tl, fault_schedule=schedule).read_text()
    assert "<h2>faults (1)</h2>" in page
    assert (f"<tr class=\"bad\"><td>timeout#1</td><td>{armed:.3f}</td><td>{tl.seconds(t0 + 200 * MS):.3f}</td>"
            f"<td>{clear:.3f}</td><td>cleared by launch</td></tr>") in page


def test_no_legend_covers_a_title_or_leaves_the_figure(tmp_path, monkeypatch):
    """Every legend is right of its panel or inside it, never over the title line above it, and whole inside
    the figure (no entry cut): checked on the drawn figures of the report."""
    from chestnut.node.offline import report
    from chestnut.node.offline.timeline import read_timeline

    figures: list[str] = []
    problems: list[tuple[str, str, str]] = []
    legends = [0]
    real_save = report._save_png

    def check_then_save(fig, path):
        fig.canvas.draw()  # at the figure's own dpi; the checks are done before savefig draws it again
        renderer = fig.canvas.get_renderer()
        fb = fig.bbox
        for ax in fig.axes:
            leg = ax.get_legend()
            if leg is None:
                continue
            legends[0] += 1
            lb, ab = leg.get_window_extent(renderer), ax.get_window_extent(renderer)
            right_of = lb.x0 >= ab.x1 - 1
            inside = ab.x0 - 1 <= lb.x0 and lb.x1 <= ab.x1 + 1 and ab.y0 - 1 <= lb.y0 and lb.y1 <= ab.y1 + 1
            if not (right_of or inside):
                problems.append((path.name, ax.get_title(loc="left"), "over the title line"))
            for t in leg.get_texts():
                tb = t.get_window_extent(renderer)
                if not (fb.x0 <= tb.x0 and tb.x1 <= fb.x1 and fb.y0 <= tb.y0 and tb.y1 <= fb.y1):
                    problems.append((path.name, ax.get_title(loc="left"), f"{t.get_text()!r} cut"))
        figures.append(path.name)
        real_save(fig, path)

    monkeypatch.setattr(report, "_save_png", check_then_save)
    logs, _ = _fault_log(tmp_path)
    report.write_report(tmp_path / "report", read_timeline(logs))
    assert figures == ["timeline.png", "agreement.png", "latency.png"]
    assert problems == []
    checked = legends[0]
    assert checked >= 6  # latency, source, health, state, drops; agreement; stages and the histograms


def test_the_deadline_in_force_and_its_range():
    from chestnut.node.offline.report import deadline_in_force
    from chestnut.node.offline.timeline import OutputRec

    def out(deadline_s: float) -> OutputRec:
        return OutputRec(0, 1, "primary", "m", 0.01, 0.03, 0.0, False, False, False, 0.0, "", deadline_s=deadline_s)

    assert deadline_in_force([out(0.0), out(0.15), out(0.0395), out(0.041)]) == "41.0 ms (39.5 .. 150.0 ms)"
    assert deadline_in_force([out(0.0)]) == ""  # no frame the primary was asked, or an older log
