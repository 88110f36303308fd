"""Background sampling of the device while a worker trains.

The sampler is a thread in the launcher's process, never in the worker. Every ``interval_s`` (default 0.1 s) it asks
its backend for one sample stamped with ``time.monotonic()``, the clock of the worker's events, and ``Sampler.poke``
adds a sample at every timed window's edge. Backends: ``NvmlBackend`` (``harness.measure.nvml``) on a GPU,
``MultiNvmlBackend`` (``harness.measure.multi_gpu``) on every GPU of a data-parallel trial, ``HostBackend``
(``harness.measure.host``, psutil: the worker's whole process tree, every rank of a data-parallel trial)
otherwise; ``make_backend`` falls back to the host and says why.
Statistics of the samples over the measured windows: ``harness.measure.windows`` (re-exported here); energy, power
and throttling over them: ``harness.measure.energy``.

Design: docs/design/sampling.md (the backends' metrics, why 0.1 s).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from harness.measure.host import HostBackend
from harness.measure.multi_gpu import MultiNvmlBackend
from harness.measure.nvml import NvmlBackend, nvml_visible_index
from harness.measure.windows import (
    EDGE_LAG_S,
    NON_STAT_METRICS,
    belongs,
    phase_stats,
    samples_until,
    scopes,
    windows_from_events,
)

# The statistics over a trial's timed windows live in harness.measure.windows; the launcher and the results import
# them from here too.
__all__ = ["DEFAULT_INTERVAL_S", "EDGE_LAG_S", "MIN_EDGE_GAP_S", "MIN_INTERVAL_S", "NON_STAT_METRICS", "Backend",
           "Sampler", "belongs", "interval_warning", "make_backend", "phase_stats", "samples_until", "scopes",
           "windows_from_events"]

DEFAULT_INTERVAL_S = 0.1
MIN_INTERVAL_S = 0.05  # below this interval_warning() warns
MIN_EDGE_GAP_S = 0.025  # edge samples (pokes) at most every 25 ms: a ~2 ms backend call then costs <= 8 % of a core


class Backend(Protocol):
    name: str
    unavailable: dict[str, str]

    def attach(self, pid: int) -> None: ...
    def sample(self) -> dict[str, float | None]: ...
    def close(self) -> None: ...
    def describe(self) -> dict[str, Any]: ...


def interval_warning(interval_s: float | None) -> str | None:
    """A one-line warning for a sampling interval below MIN_INTERVAL_S (50 ms), else None."""
    if interval_s is None or interval_s >= MIN_INTERVAL_S:
        return None
    return (f"{interval_s:g} s is below {MIN_INTERVAL_S * 1e3:.0f} ms: NVML averages utilization over 1/6 s..1 s and "
            f"refreshes power/energy every 20-100 ms, psutil counts CPU time in 10 ms ticks; faster sampling adds "
            f"launcher CPU load, not resolution (default {DEFAULT_INTERVAL_S:g} s)")


def make_backend(device: str | Sequence[str], nvml: Any = None,
                 visible: str | None = None) -> tuple[Backend, str | None]:
    """The backend for a trial's device(s): NVML for "cuda[:N]" when it can be initialised and the device found, else
    the host backend. Returns (backend, note); the note says why NVML is not used, or is None.

    ``device``: "cpu", "cuda[:N]", or the list of a data-parallel trial's GPUs (two or more: a
    ``harness.measure.multi_gpu.MultiNvmlBackend`` over them; the host backend, with the note, when NVML cannot
    watch every one of them). Each "cuda:N" is CUDA's numbering in the worker, mapped to NVML's through
    ``visible`` (the worker's CUDA_VISIBLE_DEVICES; None: this process's, ``nvml_visible_index``). ``nvml``: the
    pynvml module (tests pass a fake)."""
    devices = [device] if isinstance(device, str) else list(device)
    if not devices or not all(d.startswith("cuda") for d in devices):
        return HostBackend(), None
    made: list[NvmlBackend] = []
    try:
        for name in devices:
            target = nvml_visible_index(name, visible)
            notes = []
            order = os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
            if isinstance(target, int) and order != "PCI_BUS_ID":
                notes.append(f"CUDA_DEVICE_ORDER={order}: {name} was taken to be NVML device {target}, which holds "
                             f"only in PCI bus order; use GPU UUIDs in CUDA_VISIBLE_DEVICES to be sure")
            made.append(NvmlBackend(target, nvml=nvml, notes=notes))
    except Exception as err:  # noqa: BLE001 - no library, no driver, no such device: fall back, say why
        for backend in made:
            backend.close()
        return HostBackend(), f"NVML unavailable ({type(err).__name__}: {err}); sampling the host instead"
    if len(made) == 1:
        return made[0], None
    return MultiNvmlBackend(made, devices), None


@dataclass
class Sampler:
    """A thread sampling ``backend`` every ``interval_s`` seconds into ``samples``, and at once when poked.

    ``start(pid)`` attaches to the worker and starts the thread; ``poke(edge)`` asks for a sample now, tagged
    ``edge`` ("start" or "end" of a timed window; the launcher pokes when the worker's phase events arrive);
    ``stop()`` ends the thread: at once while it waits, else after the backend call in progress, waiting at most
    ``join_timeout_s`` (a call that blocks longer is abandoned: its sample is dropped, stop() returns False and the
    caller must not close the backend under it). Each sample is a dict with ``t`` (time.monotonic() just before the
    backend call, seconds), ``edge`` when poked, and the metrics. ``call_seconds`` holds how long each call took.

    Edge samples make short windows measurable: psutil's cpu_percent is the average since the previous call, so the
    sample at a window's end covers exactly the time since the sample at its start, however short the window. A poke
    that arrives less than ``min_edge_gap_s`` after the previous edge sample is dropped (counted in
    ``dropped_pokes``); a dropped "end" poke is deferred instead, to ``min_edge_gap_s`` after the previous edge
    sample, so every window still gets a sample at or after its end: windows of a few milliseconds (tiny epochs)
    would otherwise make the sampler call its backend
    hundreds of times a second and take CPU from the worker it measures (benchmarks/sampler_overhead.py measured a
    23 % slowdown). The samples before and after then stand for that edge, so a window's end sample may also cover
    the pause before it.
    """

    backend: Backend
    interval_s: float = DEFAULT_INTERVAL_S
    samples: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    call_seconds: list[float] = field(default_factory=list)
    min_edge_gap_s: float = MIN_EDGE_GAP_S

    def __post_init__(self) -> None:
        self._pokes: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._stopping = False
        self._abandoned = False
        self._last_edge_t: float | None = None
        self.dropped_pokes = 0
        self._thread: threading.Thread | None = None

    def start(self, pid: int) -> None:
        self.backend.attach(pid)
        self._thread = threading.Thread(target=self._loop, name="harness-sampler", daemon=True)
        self._thread.start()

    def poke(self, edge: str) -> None:
        """Asks for one sample now, tagged with ``edge``. Thread-safe; never blocks."""
        self._pokes.put(edge)

    def _take(self, edge: str | None) -> None:
        t = time.monotonic()
        try:
            values = self.backend.sample()
        except Exception as err:  # noqa: BLE001 - sampling must never take the run down
            self.errors.append(f"{type(err).__name__}: {err}")
            values = {}
        if self._abandoned:
            return  # stop() gave up on this call: the run's samples are final
        self.call_seconds.append(time.monotonic() - t)
        self.samples.append({"t": t, **({"edge": edge} if edge else {}), **values})

    def _loop(self) -> None:
        next_time = time.monotonic()
        pending_end: float | None = None  # when a deferred end-edge sample is due
        while True:
            due = next_time if pending_end is None else min(next_time, pending_end)
            delay = due - time.monotonic()
            if delay > 0:
                try:
                    edge = self._pokes.get(timeout=delay)
                except queue.Empty:
                    edge = None
                else:
                    if edge is None:  # stop
                        return
                    if self._last_edge_t is not None and time.monotonic() - self._last_edge_t < self.min_edge_gap_s:
                        self.dropped_pokes += 1  # the previous edge sample is recent enough to stand for this one
                        if edge == "end" and pending_end is None:
                            # A window closed: it still needs a sample after its end, or a window shorter than the gap
                            # would have none at all. Take it as soon as the gap allows.
                            pending_end = self._last_edge_t + self.min_edge_gap_s
                    else:
                        self._last_edge_t = time.monotonic()
                        pending_end = None
                        self._take(edge)
                    continue
            if self._stopping:
                return
            if pending_end is not None and pending_end <= time.monotonic():
                self._last_edge_t = time.monotonic()
                pending_end = None
                self._take("end")
                continue
            self._take(None)
            next_time += self.interval_s
            if next_time < time.monotonic():  # fell behind (a slow backend call): skip missed ticks, no burst
                next_time = time.monotonic() + self.interval_s

    def stop(self, join_timeout_s: float = 2.0) -> bool:
        """Stops the thread; True when it ended within ``join_timeout_s``."""
        self._stopping = True
        self._pokes.put(None)
        if self._thread is None:
            return True
        self._thread.join(join_timeout_s)
        if self._thread.is_alive():
            self._abandoned = True
            self.errors.append(f"the sampler thread was still inside a backend call {join_timeout_s:g} s after "
                               f"stop(); abandoned")
            return False
        return True
