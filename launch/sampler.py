"""``chestnut launch``'s process sampler: CPU, memory and open files of each stack program over the run
(:class:`ProcessSampler`, read with ``psutil``), for the summary's processes table."""

from __future__ import annotations

import time
from typing import Any

SAMPLE_SETTLE_S = 10.0  # resource figures "at start" are taken this long after the first output


class ProcessSampler:
    """CPU (% of one core, averaged over the run), resident memory (MB: peak, and at start and end) and open
    file descriptors (at start and end) of each stack program, and how many processes it had.

    Programs are supervisord's children, named by their ``chestnut`` subcommand; a program's own
    children (the node's worker) are counted under ``<name>/child``. "Start" is the first sample at or
    after :attr:`start_mark` (a ``time.monotonic()`` time; default: the first sample), "end" the last."""

    NAMES = {"twin": "twin", "record": "record", "control": "control", "run": "node", "camera": "camera"}

    def __init__(self, supervisord_pid: int) -> None:
        import psutil

        self.psutil = psutil
        self.root = psutil.Process(supervisord_pid)
        self.cpu_start: dict[int, tuple[str, float, float]] = {}
        self.cpu_last: dict[int, float] = {}
        self.rss_peak_mb: dict[str, float] = {}
        self.seconds: dict[str, float] = {}
        self.start_mark = 0.0
        # label -> (rss MB, open fds, processes), summed over the label's processes in one sample
        self.first: dict[str, tuple[float, int, int]] = {}
        self.last: dict[str, tuple[float, int, int]] = {}

    def _name(self, proc: Any) -> str | None:
        try:
            cmd = proc.cmdline()
        except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
            return None
        if "chestnut.launch.cli" in cmd:
            i = cmd.index("chestnut.launch.cli")
            return self.NAMES.get(cmd[i + 1]) if i + 1 < len(cmd) else None
        return None

    def sample(self) -> None:
        try:
            kids = self.root.children()
        except self.psutil.NoSuchProcess:
            return
        now = time.monotonic()
        agg: dict[str, tuple[float, int, int]] = {}
        for k in kids:
            name = self._name(k)
            if name is None:
                continue
            try:
                tree = [(k, name)] + [(c, f"{name}/child") for c in k.children(recursive=True)]
            except self.psutil.NoSuchProcess:
                continue
            for p, label in tree:
                try:
                    t = p.cpu_times()
                    cpu = t.user + t.system
                    rss = p.memory_info().rss / 1e6
                    fds = p.num_fds()
                except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
                    continue
                if p.pid not in self.cpu_start:
                    self.cpu_start[p.pid] = (label, now, cpu)
                self.cpu_last[p.pid] = cpu
                self.seconds[str(p.pid)] = now
                self.rss_peak_mb[label] = max(self.rss_peak_mb.get(label, 0.0), rss)
                r0, f0, n0 = agg.get(label, (0.0, 0, 0))
                agg[label] = (r0 + rss, f0 + fds, n0 + 1)
        if now >= self.start_mark:
            for label, v in agg.items():
                self.first.setdefault(label, v)
        self.last = agg if agg else self.last

    def report(self) -> dict[str, dict[str, float]]:
        cpu: dict[str, float] = {}
        span: dict[str, float] = {}
        for pid, (label, t0, c0) in self.cpu_start.items():
            cpu[label] = cpu.get(label, 0.0) + self.cpu_last[pid] - c0
            span[label] = max(span.get(label, 0.0), self.seconds[str(pid)] - t0)
        out: dict[str, dict[str, float]] = {}
        for label in sorted(cpu):
            row = {
                "cpu_percent": 100 * cpu[label] / span[label] if span.get(label) else 0.0,
                "rss_peak_mb": self.rss_peak_mb[label],
            }
            for when, table in (("start", self.first), ("end", self.last)):
                if label in table:
                    rss, fds, n = table[label]
                    row |= {f"rss_{when}_mb": rss, f"fds_{when}": fds, f"processes_{when}": n}
            out[label] = row
        return out
