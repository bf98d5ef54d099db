"""``chestnut export LOG --mcap OUT``: convert an existing log into an MCAP file Foxglove opens.

Reads every message of ``LOG`` (files or directories of ``rlog.zst`` / ``rlog.mcap`` segments, in
time order across segments, :class:`~chestnut.msgs.logfile.LogReader`) and writes one ``.mcap``
whose channels are JSON with JSON Schemas generated from ``msgs/chestnut.capnp`` (frames as
``foxglove.RawImage``; :mod:`chestnut.msgs.jsonschema`); ``--with-capnp`` keeps the Cap'n Proto
channels as well (exact replay from the one file). A damaged input is exported up to the damage,
and each damage is named on one line. ``OUT`` must not exist (it is never overwritten).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from chestnut.msgs.logfile import FlushPolicy, LogReader, McapSegmentWriter

_log = logging.getLogger("chestnut.export")


def export_mcap(logs: list[Path], out: Path, with_capnp: bool = False) -> tuple[int, list[str]]:
    """Write ``out`` from ``logs``; returns (messages written, damage lines).

    Raises ``FileNotFoundError`` when no log is found, ``FileExistsError`` if ``out`` exists."""
    reader = LogReader(logs)
    encodings = ("capnproto", "json") if with_capnp else ("json",)
    writer = McapSegmentWriter(out, FlushPolicy(every_messages=1000, interval_s=60.0), encodings=encodings)
    try:
        for log_mono_time, service, data in reader.iter_raw():
            writer.write(service, log_mono_time, data)
    finally:
        writer.close()
    return writer.messages, [str(d) for d in reader.damage]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", type=Path, metavar="LOG", help="log files or directories")
    parser.add_argument("--mcap", type=Path, required=True, metavar="OUT", help="the .mcap file to write (new)")
    parser.add_argument("--with-capnp", action="store_true", help="keep the Cap'n Proto channels too")


def run(args: argparse.Namespace) -> int:
    """0 after a complete export, 1 if the input was damaged (exported up to the damage), 2 for bad paths."""
    try:
        n, damage = export_mcap(args.logs, args.mcap, args.with_capnp)
    except (FileNotFoundError, FileExistsError, IsADirectoryError, PermissionError) as e:
        _log.error("%s", e)
        return 2
    for line in damage:
        _log.warning("damaged input: %s", line)
    _log.info("wrote %d messages to %s", n, args.mcap)
    return 1 if damage else 0
