"""``chestnut twin ...``: run the Chestnut twin and break it on purpose.

    chestnut twin serve [--training-delay-ms MS] [--bus N] [--address N] [--link-mbps X --latency-us Y]
                        [--engine tinygrad|onnxruntime] [--priority N] [--compute-priority N]
    chestnut twin fault KIND [--once|--repeat] [--probability P] [--for SECONDS] [--phase PHASE]
                             [--after N] [--on TARGET] [--status ur|ca] [--delay-ms MS] [--off-s S]
                             [--nbytes N] [--seed N]
    chestnut twin clear [ID]
    chestnut twin status [--json]
    chestnut twin devices
    chestnut twin kinds
    chestnut twin plug | unplug | power-cycle [--off-s S]
    chestnut twin libusb COMMAND [ARGS...]     e.g. `chestnut twin libusb probe --real`

Every command but ``serve`` talks to the daemon of ``$CHESTNUT_PREFIX`` (or ``--prefix``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import zlib
from typing import Any

from chestnut.backend.sim.compute import DEFAULT_BRIDGE_PRIORITY, MAX_PRIORITY
from chestnut.backend.sim.compute import DEFAULT_PRIORITY as DEFAULT_COMPUTE_PRIORITY
from chestnut.backend.sim.faults import KINDS, MAX_AFTER, TLP_STATUSES, FaultSpec, Phase
from chestnut.msgs.argtypes import (
    MAX_DOCK_LATENCY_US,
    MAX_LINK_MBPS,
    MIN_LINK_MBPS,
    checked_float,
    checked_int,
    dock_latency_us,
    link_mbps,
)


def default_bus_address(prefix: str) -> tuple[int, int]:
    """A bus number (16..215) and first address (2..101) derived from the prefix (CRC-32), so twins of different
    prefixes seldom share tinygrad's lock file name (``am_usb:<bus>-<addr>.lock``): two prefixes meet in 1 of
    20,000 pairs, and ``chestnut twin serve --bus N --address N`` then sets one apart."""
    h = zlib.crc32(prefix.encode())
    return 16 + h % 200, 2 + (h >> 8) % 100


def _training_delay_ms(text: str) -> float:
    return checked_float(text, lambda v: 0 <= v < math.inf, "give a time in milliseconds >= 0")


MAX_BUS, MAX_ADDRESS = 255, 127  # a USB bus number and device address (usbfs: bus 1..255, address 1..127)


def _bus(text: str) -> int:
    return checked_int(text, lambda n: 1 <= n <= MAX_BUS, f"give a USB bus number >= 1 and <= {MAX_BUS}")


def _address(text: str) -> int:
    return checked_int(text, lambda n: 1 <= n <= MAX_ADDRESS, f"give a USB device address >= 1 and <= {MAX_ADDRESS}")


def _priority(text: str) -> int:
    """``--priority`` / ``--compute-priority``: 0 (normal scheduling) to :data:`MAX_PRIORITY`; refused in
    ``OneLineParser``'s one line (``chestnut twin serve: error: argument --priority: '60': ...``, exit 2), as every
    other refused number: it was a bare line without the program's name."""
    return checked_int(text, lambda n: 0 <= n <= MAX_PRIORITY,
                       f"give a SCHED_RR priority >= 0 (0: normal scheduling) and <= {MAX_PRIORITY} (below the "
                       "node's realtime priority)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix", help="runtime prefix of the twin (default: $CHESTNUT_PREFIX)")
    sub = parser.add_subparsers(dest="twin_command", metavar="SUBCOMMAND", required=True)

    s = sub.add_parser("serve", help="run the twin daemon in the foreground")
    s.add_argument("--training-delay-ms", type=_training_delay_ms, default=20.0,
                   help="PCIe link training time after 0xF3 on")
    s.add_argument("--bus", type=_bus, help=f"USB bus number, 1 to {MAX_BUS} (default: derived from the prefix)")
    s.add_argument("--address", type=_address,
                   help=f"first USB device address, 1 to {MAX_ADDRESS} (default: derived from the prefix)")
    s.add_argument("--link-mbps", type=link_mbps,
                   help=f"timing model: link bandwidth, Mbps (e.g. 5000; {MIN_LINK_MBPS:g} to "
                        f"{MAX_LINK_MBPS:g}); off by default")
    s.add_argument("--latency-us", type=dock_latency_us, default=0.0,
                   help=f"timing model: per-transfer latency, us (e.g. 125; at most {MAX_DOCK_LATENCY_US:g})")
    s.add_argument("--engine", choices=("tinygrad", "onnxruntime"), default="tinygrad",
                   help="how the GPU engine executes programs (default tinygrad: bit-exact with the CPU reference)")
    s.add_argument("--priority", type=_priority, default=DEFAULT_BRIDGE_PRIORITY, metavar="N",
                   help="SCHED_RR priority of the threads that answer USB (0: normal scheduling; at most "
                        f"{MAX_PRIORITY}, below the node's; default {DEFAULT_BRIDGE_PRIORITY})")
    s.add_argument("--compute-priority", type=_priority, default=DEFAULT_COMPUTE_PRIORITY, metavar="N",
                   help="SCHED_RR priority of a program RUN in the engine's compute process (0: normal; compiles "
                        f"always run at normal scheduling; default {DEFAULT_COMPUTE_PRIORITY})")

    f = sub.add_parser("fault", help="inject a fault (see `chestnut twin kinds`)")
    f.add_argument("kind", choices=sorted(KINDS), metavar="KIND", help=", ".join(KINDS))
    mode = f.add_mutually_exclusive_group()
    mode.add_argument("--once", dest="repeat", action="store_const", const=False, help="fire at most once")
    mode.add_argument("--repeat", dest="repeat", action="store_const", const=True, help="fire at every opportunity")
    f.add_argument("--probability", type=float, default=1.0, help="fire with this probability per opportunity")
    f.add_argument("--for", dest="for_s", type=float, metavar="SECONDS", help="exist only this long")
    f.add_argument("--phase", choices=[p.value for p in Phase], help="only while the twin is in this phase")
    f.add_argument("--after", type=int, default=0, metavar="N",
                   help=f"let the first N opportunities through (at most {MAX_AFTER}: twinFault.opportunities is a "
                        "UInt32)")
    f.add_argument("--on", help="transfer faults: any, control, control_in, control_out, bulk, bulk_in, bulk_out, "
                                "async, or a vendor request number such as 0xE4")
    f.add_argument("--status", choices=TLP_STATUSES, default="ca", help="bad_tlp: completion status")
    f.add_argument("--delay-ms", type=float, default=500.0, help="slow_gpu: added latency per packet")
    f.add_argument("--off-s", type=float, default=2.0, help="brownout: seconds the dock stays gone")
    f.add_argument("--nbytes", type=int, help="short: bytes moved; usb2: bytes of each bulk OUT kept")
    f.add_argument("--seed", type=int, help="seed of the --probability draw")

    c = sub.add_parser("clear", help="remove one fault (by id) or all")
    c.add_argument("id", type=int, nargs="?")
    st = sub.add_parser("status", help="show the dock's state and the injected faults")
    st.add_argument("--json", action="store_true", help="print JSON")
    sub.add_parser("devices", help="list what a fresh USB enumeration sees")
    sub.add_parser("kinds", help="list the fault kinds with their symptom and recovery")
    sub.add_parser("plug", help="plug the dock in (it enumerates at a new address)")
    sub.add_parser("unplug", help="pull the dock's cable")
    pc = sub.add_parser("power-cycle", help="switch the dock off and on (clears a wedge; VRAM is lost)")
    pc.add_argument("--off-s", type=float, default=0.0, help="seconds to stay off")
    lu = sub.add_parser("libusb", help="run a chestnut command with real libusb seeing the twin (the libusb face, "
                                       "umockdev; backend/sim/libusb_face.py)")
    lu.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS...]",
                    help="a chestnut command line, e.g. `probe --real`")


def _print_status(st: dict[str, Any]) -> None:
    u, b, g = st["usb"], st["bridge"], st["gpu"]
    present = f"present at {u['bus']}-{u['address']}" if u["present"] else "absent"
    print(f"usb:    {present}, {u['vid_pid'][0]:04x}:{u['vid_pid'][1]:04x} {u['product']!r}, {u['speed_mbps']} Mbps, "
          f"link errors {u['link_errors']}, halted {[hex(e) for e in u['halted']]}, {u['open_handles']} handles")
    print(f"bridge: LTSSM {b['ltssm']:#04x}, PCIe power {'on' if b['pcie_power'] else 'off'}, "
          f"wedged {b['wedged']}, copy-in fence {b['copyin_fence']}")
    bars = ", ".join(f"BAR{i} {a:#x}+{s:#x}" for i, (a, s) in st["pcie"]["bars"].items())
    print(f"pcie:   {bars}")
    print(f"gpu:    hung {g['hung']}, executing {g['executing']}, executed {g['executed']}, queue fence "
          f"{g['queue_fence']} (status {g['status']}), programs {g['programs']}, VRAM pages {st['vram_pages']}")
    print(f"phase:  {st['phase']}" + (f", lock file {st['lock_file']}" if st["lock_file"] else ""))
    if not st["faults"]:
        print("faults: none")
    for f in st["faults"]:
        how = "repeat" if f["repeat"] or (f["repeat"] is None and KINDS[f["kind"]].default_repeat) else "once"
        extra = "".join(f" {k}={f[k]}" for k in ("probability", "for_s", "phase", "after", "on") if f[k] not in
                        (None, 0, 1.0))
        print(f"fault {f['id']}: {f['kind']} ({how}{extra}) fired {f['fired']}/{f['opportunities']} opportunities")


def run(args: argparse.Namespace) -> int:
    from chestnut.msgs.paths import current_prefix

    prefix = args.prefix or current_prefix()
    cmd = args.twin_command
    if cmd == "serve":
        from chestnut.backend.sim.daemon import serve
        from chestnut.backend.sim.twin import TwinConfig

        bus, address = default_bus_address(prefix)
        config = TwinConfig(bus=args.bus if args.bus is not None else bus,
                            first_address=args.address if args.address is not None else address,
                            training_delay_s=args.training_delay_ms / 1000, link_mbps=args.link_mbps,
                            latency_us=args.latency_us, program_engine=args.engine,
                            bridge_priority=args.priority, compute_priority=args.compute_priority)
        code = serve(config, prefix)
        # The daemon has released its lock and socket. Exit without interpreter shutdown: an engine thread
        # may be inside a tinygrad compile whose process pool would otherwise be joined at exit, holding
        # the process past its stop budget.
        import logging
        import os

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if cmd == "libusb":
        from chestnut.backend.sim.libusb_face import main as libusb_face

        if not args.command:
            print("chestnut twin libusb: name a chestnut command, e.g. `chestnut twin libusb probe --real`",
                  file=sys.stderr)
            return 2
        return libusb_face(["--prefix", prefix, "-m", "chestnut.launch.cli", *args.command])
    if cmd == "kinds":
        for name, info in KINDS.items():
            print(f"{name}\n  symptom:  {info.symptom}\n  recovery: {info.recovery}")
        return 0

    from chestnut.backend.sim.client import TwinClient, TwinNotRunning, TwinSocketRefused

    spec: FaultSpec | None = None
    if cmd == "fault":  # checked before the daemon is asked, as `chestnut launch --fault` does: named either way
        try:
            spec = FaultSpec(args.kind, repeat=args.repeat, probability=args.probability, for_s=args.for_s,
                             phase=args.phase, after=args.after, on=args.on, status=args.status,
                             delay_ms=args.delay_ms, off_s=args.off_s, nbytes=args.nbytes, seed=args.seed).validate()
        except ValueError as e:
            print(f"chestnut twin fault: rejected: {e}", file=sys.stderr)
            return 2
    try:
        with TwinClient(prefix) as client:
            if spec is not None:
                entry = client.inject(spec)
                print(f"fault {entry['id']}: {entry['kind']} -- {entry['symptom']}")
            elif cmd == "clear":
                n = client.clear(args.id)
                if args.id is not None and n == 0:  # a fault id nobody injected, or one already gone
                    print(f"chestnut twin clear: no fault {args.id} (`chestnut twin status` lists them)",
                          file=sys.stderr)
                    return 2
                print(f"cleared {n} fault(s)")
            elif cmd == "status":
                st = client.status()
                if args.json:
                    print(json.dumps(st, indent=2))
                else:
                    _print_status(st)
            elif cmd == "devices":  # lsusb's line per device on stdout; none (unplugged) is said on stderr
                devices = client.enumerate()
                for d in devices:
                    print(f"Bus {d.bus:03d} Device {d.address:03d}: ID {d.vid:04x}:{d.pid:04x} {d.speed_mbps} Mbps")
                if not devices:
                    print("chestnut twin devices: no device enumerates (the dock is unplugged: `chestnut twin plug`)",
                          file=sys.stderr)
            elif cmd == "plug":
                before = client.status()
                plugged = client.plug()
                at = f" at {plugged.bus}-{plugged.address}" if plugged else ""
                print(f"already plugged in{at}" if before.get("usb", {}).get("present") else f"plugged in{at}")
                for f in before.get("faults", []):  # a disconnect still to come is a fault, not the cable's state
                    if f.get("kind") == "disconnect" and not f.get("expired"):
                        print(f"note: disconnect fault {f.get('id')} is armed and still to fire (fired "
                              f"{f.get('fired', 0)} times); `chestnut twin clear {f.get('id')}` removes it")
            elif cmd == "unplug":
                client.unplug()
                print("unplugged")
            elif cmd == "power-cycle":
                client.power_cycle(args.off_s)
                print(f"power-cycled (off {args.off_s} s)")
    except TwinNotRunning as e:  # no daemon: 1; a path planted at its socket (refused, kept): 2
        print(str(e), file=sys.stderr)
        return 2 if isinstance(e, TwinSocketRefused) else 1
    except ValueError as e:  # the twin's own check of the request, one line naming the field
        print(f"chestnut twin {cmd}: rejected: {e}", file=sys.stderr)
        return 2
    return 0
