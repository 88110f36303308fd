"""Background sampling of the device while a worker trains, and statistics over the measured phase.

The sampler is a thread in the launcher's process, never in the worker (no GIL contention with the training loop).
Every ``interval_s`` it asks its backend for one sample, a dict of metric -> number stamped with ``time.monotonic()``
(the clock the worker stamps its phase events with). Backends:

- ``NvmlBackend`` (nvidia-ml-py, imported as ``pynvml``): device utilization % (``nvmlDeviceGetUtilizationRates``:
  the percent of time over the driver's last sample period, between 1/6 s and 1 s, during which one or more kernels
  ran; NOT the fraction of the GPU's SMs in use), memory-controller utilization %, device memory used (bytes), the
  worker process tree's own GPU memory (``nvmlDeviceGetComputeRunningProcesses``; None where NVML does not report
  it), power (W, ``nvmlDeviceGetPowerUsage`` reports mW). https://docs.nvidia.com/deploy/nvml-api/
- ``HostBackend`` (psutil), where there is no GPU: the worker process tree's CPU % (100 = one core busy) and resident
  memory (bytes).

A metric that fails is marked unavailable (with the reason) and no longer asked for; it never stops the trial.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import numpy as np
import psutil

MIN_INTERVAL_S = 0.05
EDGE_LAG_S = 0.5  # an end-edge sample taken at most this long after its window's end still describes the window


class Backend(Protocol):
    name: str
    unavailable: dict[str, str]

    def attach(self, pid: int) -> None: ...
    def sample(self) -> dict[str, float | None]: ...
    def close(self) -> None: ...
    def describe(self) -> dict[str, Any]: ...


def _process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


class HostBackend:
    """CPU % and RSS of a process and its children (psutil)."""

    name = "host"

    def __init__(self) -> None:
        self.unavailable: dict[str, str] = {}
        self._procs: dict[int, psutil.Process] = {}
        self._pid: int | None = None

    def attach(self, pid: int) -> None:
        self._pid = pid
        self._procs = {}
        self._read()  # primes cpu_percent, whose first call per process returns 0

    def sample(self) -> dict[str, float | None]:
        return self._read()

    def _read(self) -> dict[str, float | None]:
        if self._pid is None:
            return {}
        cpu = 0.0
        rss = 0
        for proc in _process_tree(self._pid):
            # psutil's cpu_percent compares against the previous call on the same Process object: keep them.
            proc = self._procs.setdefault(proc.pid, proc)
            try:
                with proc.oneshot():
                    cpu += proc.cpu_percent(None)
                    rss += proc.memory_info().rss
            except psutil.Error:
                continue
        return {"cpu_percent": cpu, "rss_bytes": float(rss)}

    def close(self) -> None:
        self._procs = {}

    def describe(self) -> dict[str, Any]:
        return {"backend": "host", "cpu_count": psutil.cpu_count(), "metrics": {
            "cpu_percent": "CPU use of the worker process tree, % (100 = one core busy)",
            "rss_bytes": "resident memory of the worker process tree, bytes"}}


def _nvml() -> Any:
    import pynvml  # nvidia-ml-py

    return pynvml


def nvml_visible_index(device: str, visible: str | None = None) -> int | str:
    """The NVML device (index, or a UUID string) that framework device ``device`` ("cuda:N") names.

    CUDA numbers devices among those in CUDA_VISIBLE_DEVICES, in PCI bus order once the worker runs with
    CUDA_DEVICE_ORDER=PCI_BUS_ID (which the launcher sets); NVML numbers all devices in PCI bus order.
    """
    index = int(device.partition(":")[2] or 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None or visible.strip() == "":
        return index
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    if index >= len(entries):
        raise ValueError(f"{device} is not among CUDA_VISIBLE_DEVICES={visible}")
    entry = entries[index]
    return int(entry) if entry.isdigit() else entry


class NvmlBackend:
    """NVML samples of one GPU and of the worker process tree's memory on it."""

    name = "nvml"
    METRICS = ("gpu_util_percent", "mem_util_percent", "device_memory_used_bytes", "process_memory_bytes", "power_w")

    def __init__(self, device: int | str = 0, nvml: Any = None):
        self.nvml = nvml or _nvml()
        self.nvml.nvmlInit()
        if isinstance(device, str):
            self.handle = self.nvml.nvmlDeviceGetHandleByUUID(device)
        else:
            self.handle = self.nvml.nvmlDeviceGetHandleByIndex(device)
        self.unavailable: dict[str, str] = {}
        self._pid: int | None = None
        self._pids: set[int] = set()

    def attach(self, pid: int) -> None:
        self._pid = pid
        self._pids = {pid}

    def _read(self, metric: str, read: Callable[[], float | None], out: dict[str, float | None]) -> None:
        if metric in self.unavailable:
            return
        try:
            out[metric] = read()
        except self.nvml.NVMLError as err:
            if isinstance(err, self.nvml.NVMLError_NotSupported) or isinstance(
                    err, getattr(self.nvml, "NVMLError_NoPermission", ())):
                self.unavailable[metric] = f"NVML: {err}"
            else:
                out[metric] = None  # a transient error: this sample lacks the metric, later ones may have it

    def _process_memory(self) -> float | None:
        if self._pid is not None:
            self._pids = {self._pid, *(p.pid for p in _process_tree(self._pid)[1:])}
        total = 0
        found = False
        for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if proc.pid in self._pids:
                found = True
                if proc.usedGpuMemory is None:  # NVML_VALUE_NOT_AVAILABLE (MIG, some containers)
                    return None
                total += proc.usedGpuMemory
        return float(total) if found else 0.0

    def sample(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        nvml, handle = self.nvml, self.handle
        util: dict[str, Any] = {}

        def rates() -> float:
            util["rates"] = nvml.nvmlDeviceGetUtilizationRates(handle)
            return float(util["rates"].gpu)

        self._read("gpu_util_percent", rates, out)
        if "rates" in util:
            out["mem_util_percent"] = float(util["rates"].memory)
        self._read("device_memory_used_bytes", lambda: float(nvml.nvmlDeviceGetMemoryInfo(handle).used), out)
        self._read("process_memory_bytes", self._process_memory, out)
        self._read("power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0, out)
        return out

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a broken NVML is not worth an error
            pass

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"backend": "nvml", "unavailable": dict(self.unavailable), "metrics": {
            "gpu_util_percent": "NVML utilization.gpu: % of the last 1/6 s..1 s in which any kernel ran "
                                "(not SM occupancy)",
            "mem_util_percent": "NVML utilization.memory: % of that period in which device memory was read or written",
            "device_memory_used_bytes": "NVML device memory used by all processes, bytes",
            "process_memory_bytes": "NVML memory of the worker process tree on this GPU, bytes",
            "power_w": "board power draw, W"}}
        for key, call in (("name", "nvmlDeviceGetName"), ("uuid", "nvmlDeviceGetUUID")):
            try:
                value = getattr(self.nvml, call)(self.handle)
                info[key] = value.decode() if isinstance(value, bytes) else value
            except Exception:  # noqa: BLE001
                pass
        return info


def make_backend(device: str) -> tuple[Backend, str | None]:
    """The backend for a trial's device: NVML for "cuda:N" when it can be initialised, else the host backend.
    Returns (backend, note); the note says why NVML is not used, or is None."""
    if device.startswith("cuda"):
        try:
            return NvmlBackend(nvml_visible_index(device)), None
        except Exception as err:  # noqa: BLE001 - no library, no driver, no such device: fall back, say why
            return HostBackend(), f"NVML unavailable ({type(err).__name__}: {err}); sampling the host instead"
    return HostBackend(), None


@dataclass
class Sampler:
    """A thread sampling ``backend`` every ``interval_s`` seconds into ``samples``, and at once when poked.

    ``start(pid)`` attaches to the worker and starts the thread; ``poke(edge)`` asks for a sample now, tagged
    ``edge`` ("start" or "end" of a timed window; the launcher pokes when the worker's phase events arrive);
    ``stop()`` ends the thread within the duration of one backend call plus a bounded join. Each sample is a dict
    with ``t`` (time.monotonic(), seconds), ``edge`` when poked, and the metrics.

    Edge samples make short windows measurable: psutil's cpu_percent is the average since the previous call, so the
    sample at a window's end covers exactly the time since the sample at its start, however short the window.
    """

    backend: Backend
    interval_s: float = 0.1
    samples: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._pokes: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._stopping = False
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
        self.samples.append({"t": t, **({"edge": edge} if edge else {}), **values})

    def _loop(self) -> None:
        next_time = time.monotonic()
        while True:
            delay = next_time - time.monotonic()
            if delay > 0:
                try:
                    edge = self._pokes.get(timeout=delay)
                except queue.Empty:
                    edge = None
                else:
                    if edge is None:  # stop
                        return
                    self._take(edge)
                    continue
            if self._stopping:
                return
            self._take(None)
            next_time += self.interval_s
            if next_time < time.monotonic():  # fell behind (a slow backend call): skip missed ticks, no burst
                next_time = time.monotonic() + self.interval_s

    def stop(self, join_timeout_s: float = 2.0) -> None:
        self._stopping = True
        self._pokes.put(None)
        if self._thread is not None:
            self._thread.join(join_timeout_s)


def windows_from_events(events: Iterable[dict[str, Any]], phase: str = "train") -> list[tuple[float, float]]:
    """The (start, end) monotonic times of every ``phase`` window in a worker's events."""
    windows: list[tuple[float, float]] = []
    open_at: float | None = None
    for event in events:
        if event.get("event") != "phase" or event.get("name") != phase:
            continue
        if event["edge"] == "start":
            open_at = event["t"]
        elif open_at is not None:
            windows.append((open_at, event["t"]))
            open_at = None
    return windows


def phase_stats(samples: list[dict[str, Any]], windows: list[tuple[float, float]]) -> dict[str, dict[str, Any]]:
    """Mean, median, max and count of every metric over the samples that belong to ``windows``.

    A sample belongs to a window when it was taken inside it, or when it is the end-edge sample taken at most
    EDGE_LAG_S after the window's end; start-edge samples (baselines, which describe the time before the window)
    never do. Missing values (None) are left out. ``scope`` says which samples were used: ``"windows"`` (inside the timed
    windows); ``"span"`` when no sample fell inside them (windows shorter than the sampling interval), so the samples
    from the first window's start to the last one's end were used instead, evaluation pauses included; ``"none"``
    when even that span holds no sample (statistics None, count 0).
    """
    metrics = sorted({k for s in samples for k in s if k not in ("t", "edge")})
    stats: dict[str, dict[str, Any]] = {}
    span = [(min(a for a, _ in windows), max(b for _, b in windows))] if windows else []

    def belongs(sample: dict[str, Any], ranges: list[tuple[float, float]]) -> bool:
        edge, t = sample.get("edge"), sample["t"]
        if edge == "start":
            return False
        return any(a <= t <= b or (edge == "end" and b < t <= b + EDGE_LAG_S) for a, b in ranges)

    for metric in metrics:
        for scope, ranges in (("windows", windows), ("span", span)):
            values = np.asarray([s[metric] for s in samples if s.get(metric) is not None and belongs(s, ranges)],
                                dtype=float)
            if values.size:
                stats[metric] = {"mean": float(values.mean()), "median": float(np.median(values)),
                                 "max": float(values.max()), "count": int(values.size), "scope": scope}
                break
        else:
            stats[metric] = {"mean": None, "median": None, "max": None, "count": 0, "scope": "none"}
    return stats
