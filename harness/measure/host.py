"""The host backend of the sampler, where there is no GPU: the worker process tree's CPU % (100 = one core busy)
and resident memory (bytes), from psutil."""

from __future__ import annotations

import time
from typing import Any

import psutil


def process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


#: The shortest time a CPU figure is measured over (``HostBackend``): 5 of Linux's 10 ms clock ticks.
MIN_RATE_S = 0.05


class HostBackend:
    """CPU % and RSS of a process and its children (psutil).

    Listing a process's children walks all of /proc (psutil's ``children(recursive=True)``: about 1.3 ms, most of a
    sample's cost), so the tree is listed again at most every ``tree_refresh_s`` seconds; in between, a sample reads
    only the known processes (about 0.1 ms). A child that starts in between is counted from the next refresh on.

    The tree holds every rank of a one-process-per-device data-parallel trial: rank 0 is the worker and starts ranks
    1..N-1 as its own children (``harness.execution.ranks.Ranks.start``) before it imports its framework, so they are
    counted from the first refresh after they start (at most ``tree_refresh_s`` later, in practice before the timed
    windows: the framework imports, model build and warm-up come first) and the figures are sums over all ranks.

    A process that has exited is left out, reaped or not (a zombie's /proc entry reads 0 bytes); a sample when no
    process of the tree is left (a timed window's deferred end sample, ``Sampler``, can come after a short trial's
    exit) has None for every metric: no reading, not 0 % and 0 bytes, which the window statistics would take for a
    measured value.

    CPU use is the tree's CPU time (user + system, ``psutil.Process.cpu_times``) gained since the sample it is
    measured from, over the time between: a rate, and Linux counts CPU time in clock ticks of 10 ms (USER_HZ 100),
    so one tick over 1.2 ms reads as more than 800 % of a core. A sample less than ``min_rate_s``
    after that base has no CPU figure (None) and leaves the base where it is, so the next sample's figure covers the
    whole time since; at 50 ms a tick is at most 20 % of one core. A process that exits keeps the CPU time it was last
    read with, so the tree's total does not fall back.
    """

    name = "host"

    def __init__(self, tree_refresh_s: float = 1.0, min_rate_s: float = MIN_RATE_S) -> None:
        self.unavailable: dict[str, str] = {}
        self.tree_refresh_s = tree_refresh_s
        self.min_rate_s = min_rate_s
        self._cpu_seen: dict[int, float] = {}  # pid -> its CPU seconds when last read (exited ones kept)
        self._base: tuple[float, float] | None = None  # (time, tree CPU seconds) the next rate is measured from
        self._procs: dict[int, psutil.Process] = {}
        self._tree: list[psutil.Process] = []
        self._tree_at: float | None = None
        self._pid: int | None = None

    def attach(self, pid: int) -> None:
        self._pid = pid
        self._procs = {}
        self._cpu_seen = {}
        self._base = None
        self._tree_at = None
        self._read()  # the base of the first CPU figure

    def sample(self) -> dict[str, float | None]:
        return self._read()

    def _current_tree(self) -> list[psutil.Process]:
        now = time.monotonic()
        if self._tree_at is None or now - self._tree_at >= self.tree_refresh_s:
            assert self._pid is not None
            # psutil's cpu_percent compares against the previous call on the same Process object: keep them.
            self._tree = [self._procs.setdefault(proc.pid, proc) for proc in process_tree(self._pid)]
            self._tree_at = now
        return self._tree

    def _read(self) -> dict[str, float | None]:
        if self._pid is None:
            return {}
        now = time.monotonic()
        rss = anon = 0
        read = False
        for proc in self._current_tree():
            try:
                with proc.oneshot():
                    if proc.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped: reads as 0 bytes
                        continue
                    times = proc.cpu_times()
                    self._cpu_seen[proc.pid] = times.user + times.system
                    memory = proc.memory_info()
                    rss += memory.rss
                    anon += memory.rss - getattr(memory, "shared", 0)  # Linux: RssAnon (shared = RssFile + RssShmem)
                read = True
            except psutil.Error:
                continue
        if not read:  # the worker is gone (a window's deferred end sample can come after its exit): no reading, not 0
            return {"cpu_percent": None, "rss_bytes": None, "rss_anon_bytes": None}
        return {"cpu_percent": self._rate(now), "rss_bytes": float(rss), "rss_anon_bytes": float(anon)}

    def _rate(self, now: float) -> float | None:
        """The tree's CPU use in % since the base (100 = one core busy), or None less than ``min_rate_s`` after it
        (the base then stays); the first call only sets the base."""
        total = sum(self._cpu_seen.values())
        if self._base is not None and now - self._base[0] < self.min_rate_s:
            return None
        rate = None if self._base is None else 100.0 * (total - self._base[1]) / (now - self._base[0])
        self._base = (now, total)
        return rate

    def close(self) -> None:
        self._procs = {}

    def describe(self) -> dict[str, Any]:
        return {"backend": "host", "cpu_count": psutil.cpu_count(), "unavailable": dict(self.unavailable), "metrics": {
            "cpu_percent": "CPU use of the worker process tree, % (100 = one core busy): its CPU time over at least "
                           f"{MIN_RATE_S * 1e3:.0f} ms since the sample before that",
            "rss_bytes": "resident memory of the worker process tree, bytes",
            "rss_anon_bytes": "of that, the anonymous memory (heap, the framework's allocations, tensors, the "
                              "dataset; not the libraries' file-backed pages), bytes"}}
