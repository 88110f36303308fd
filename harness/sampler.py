"""Background sampling of the device while a worker trains, and statistics over the measured phase.

The sampler is a thread in the launcher's process, never in the worker (no GIL contention with the training loop).
Every ``interval_s`` it asks its backend for one sample, a dict of metric -> number stamped with ``time.monotonic()``
(the clock the worker stamps its phase events with; CLOCK_MONOTONIC is system-wide on Linux). Backends:

- ``NvmlBackend`` (nvidia-ml-py, imported as ``pynvml``; NVML reference: https://docs.nvidia.com/deploy/nvml-api/):
  ``gpu_util_percent`` and ``mem_util_percent`` (nvmlDeviceGetUtilizationRates: the percent of time over the driver's
  last sample period, between 1/6 s and 1 s depending on the product, during which one or more kernels ran / device
  memory was read or written; NOT the fraction of SMs in use), ``device_memory_used_bytes`` (nvmlDeviceGetMemoryInfo,
  the v2 struct where bindings and driver have it), ``process_memory_bytes`` (the worker process tree's memory from
  nvmlDeviceGetComputeRunningProcesses; None where NVML does not report it), ``power_w`` (nvmlDeviceGetPowerUsage),
  ``energy_mj`` (nvmlDeviceGetTotalEnergyConsumption), ``sm_clock_mhz`` (nvmlDeviceGetClockInfo NVML_CLOCK_SM),
  ``temperature_c`` (nvmlDeviceGetTemperature NVML_TEMPERATURE_GPU) and ``throttle_reasons`` (the
  nvmlClocksEventReasons bitmask). Power, energy, clocks and temperature describe the whole board, every process on it.
- ``HostBackend`` (psutil), where there is no GPU: the worker process tree's CPU % (100 = one core busy) and resident
  memory (bytes).

Degradation, one metric at a time: NotSupported, NoPermission or FunctionNotFound (or bindings without the call) mark
that metric unavailable for the rest of the run, with the reason, in ``describe()["unavailable"]``; any other error
leaves that metric None in that one sample. Nothing is ever raised into the run. No NVML library, no driver, no such
device: ``make_backend`` samples the host instead and says why.

Design decisions (no GPU was available to measure them; they rest on the NVML documentation):

- Utilization by polling nvmlDeviceGetUtilizationRates, not by draining nvmlDeviceGetSamples
  (NVML_GPU_UTILIZATION_SAMPLES). Each polled value already averages the driver's last 1/6 s..1 s, so polling at 0.1 s
  loses no utilization information, only phase alignment of at most one driver period. nvmlDeviceGetSamples returns
  the samples "maintained in the buffer by the driver" newer than a caller-kept ``lastSeenTimeStamp`` (a "CPU
  timestamp in microseconds" on a clock the documentation does not name, so aligning it with time.monotonic() would
  need a calibration that cannot be checked without a GPU); how many samples the buffer holds and what period each
  averages are not documented and may differ by product, so a late drain may silently lose samples. Its documented
  advantage (higher-frequency data at lower polling cost) cannot be verified here either.
- Default interval 0.1 s: below the shortest utilization averaging period (1/6 s), so every driver period is seen at
  least once; no faster, because utilization cannot change faster than that period, psutil's process CPU times
  advance in 10 ms clock ticks on Linux (psutil recommends at least 0.1 s between cpu_percent calls for accuracy), and
  NVML refreshes power/energy only every 20-100 ms. Short timed windows are covered by edge samples
  (``Sampler.poke``), not by a faster clock. ``interval_warning`` flags intervals below 50 ms;
  ``benchmarks/sampler_overhead.py`` measures what sampling costs the worker.
- Energy per measured window (``energy_over_windows``): from the energy counter where the GPU has one (Volta and newer),
  else by integrating power; see that function for the method and its limits.
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

DEFAULT_INTERVAL_S = 0.1
MIN_INTERVAL_S = 0.05  # below this interval_warning() warns
EDGE_LAG_S = 0.5  # an end-edge sample taken at most this long after its window's end still describes the window
MIN_EDGE_GAP_S = 0.025  # edge samples (pokes) at most every 25 ms: a ~2 ms backend call then costs <= 8 % of a core
# NVML refreshes its power and energy readings roughly every 20-100 ms depending on the GPU (NVIDIA does not document
# the period; PETSc's PetscLogGpuEnergyMeter notes: "For newer GPUs, energy readings are updated every 20-100ms").
# A counter reading can be stale by up to one refresh at each window edge, so shorter windows are flagged.
COUNTER_UPDATE_S = 0.1
# nvmlDeviceGetPowerUsage: "On Ampere (except GA100) or newer GPUs, the API returns power averaged over 1 sec interval"
# (older GPUs: instantaneous). An integral of such readings smears each window over about a second: windows shorter
# than this are flagged when energy comes from power integration.
POWER_AVERAGING_S = 1.0
# Metrics that are not levels: a cumulative counter and a bitmask. phase_stats skips them (a mean means nothing);
# energy_over_windows and throttle_summary read them.
NON_STAT_METRICS = ("energy_mj", "throttle_reasons")
# nvmlClocksEventReasons bits (https://docs.nvidia.com/deploy/nvml-api/group__nvmlClocksEventReasons.html).
THROTTLE_BITS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


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


def _process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


class HostBackend:
    """CPU % and RSS of a process and its children (psutil).

    Listing a process's children walks all of /proc (psutil's ``children(recursive=True)``: about 1.3 ms, most of a
    sample's cost), so the tree is listed again at most every ``tree_refresh_s`` seconds; in between, a sample reads
    only the known processes (about 0.1 ms). A child that starts in between is counted from the next refresh on.
    """

    name = "host"

    def __init__(self, tree_refresh_s: float = 1.0) -> None:
        self.unavailable: dict[str, str] = {}
        self.tree_refresh_s = tree_refresh_s
        self._procs: dict[int, psutil.Process] = {}
        self._tree: list[psutil.Process] = []
        self._tree_at: float | None = None
        self._pid: int | None = None

    def attach(self, pid: int) -> None:
        self._pid = pid
        self._procs = {}
        self._tree_at = None
        self._read()  # primes cpu_percent, whose first call per process returns 0

    def sample(self) -> dict[str, float | None]:
        return self._read()

    def _current_tree(self) -> list[psutil.Process]:
        now = time.monotonic()
        if self._tree_at is None or now - self._tree_at >= self.tree_refresh_s:
            assert self._pid is not None
            # psutil's cpu_percent compares against the previous call on the same Process object: keep them.
            self._tree = [self._procs.setdefault(proc.pid, proc) for proc in _process_tree(self._pid)]
            self._tree_at = now
        return self._tree

    def _read(self) -> dict[str, float | None]:
        if self._pid is None:
            return {}
        cpu = 0.0
        rss = 0
        for proc in self._current_tree():
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
        return {"backend": "host", "cpu_count": psutil.cpu_count(), "unavailable": dict(self.unavailable), "metrics": {
            "cpu_percent": "CPU use of the worker process tree, % (100 = one core busy)",
            "rss_bytes": "resident memory of the worker process tree, bytes"}}


def _nvml() -> Any:
    import pynvml  # nvidia-ml-py

    return pynvml


def nvml_visible_index(device: str, visible: str | None = None) -> int | str:
    """What CUDA device ``device`` ("cuda" or "cuda:N") is, as NVML can find it: an int (an NVML index) or a str
    (a GPU UUID or UUID prefix "GPU-...", or a MIG device: "MIG-<uuid>", or "MIG-GPU-<uuid>/<gi>/<ci>" before R470).

    ``visible`` is CUDA_VISIBLE_DEVICES (read from the environment when None; unset means every GPU is visible, and
    cuda:N is NVML device N). CUDA numbers the visible devices in the order of that list; integer entries name devices
    in CUDA's enumeration order, which is NVML's (PCI bus order) only with CUDA_DEVICE_ORDER=PCI_BUS_ID, which the
    launcher sets for its workers. As CUDA does, the list ends at the first invalid entry (e.g. "-1"). Raises ValueError
    when ``device`` is not a CUDA device or is not among the visible ones (an empty CUDA_VISIBLE_DEVICES hides all).
    """
    kind, _, number = device.partition(":")
    if kind != "cuda" or not (number == "" or number.isdigit()):
        raise ValueError(f"{device!r} is not a CUDA device (cuda or cuda:N)")
    index = int(number or 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None:
        return index
    entries: list[int | str] = []
    for raw in visible.split(","):
        entry = raw.strip()
        if entry.isdigit():
            entries.append(int(entry))
        elif entry.upper().startswith(("GPU-", "MIG-")) and len(entry) > 4:
            entries.append(entry)
        else:
            break  # CUDA: an invalid entry hides itself and every entry after it
    if index >= len(entries):
        raise ValueError(f"{device} is not among the {len(entries)} device(s) that CUDA_VISIBLE_DEVICES={visible!r} "
                         f"makes visible")
    return entries[index]


def _error_classes(nvml: Any, *names: str) -> tuple[type, ...]:
    return tuple(c for n in names if isinstance(c := getattr(nvml, n, None), type))


class NvmlBackend:
    """NVML samples of one GPU (or MIG device) and of the worker process tree's memory on it.

    ``device``: an NVML index, or a string from ``nvml_visible_index`` (GPU UUID or prefix, MIG UUID). ``nvml``: the
    pynvml module (tests pass a fake). ``notes``: lines for describe()["notes"]. Raises when NVML cannot be initialised
    or the device is not found (after shutting NVML down again); ``make_backend`` turns that into the host backend.
    """

    name = "nvml"
    METRICS = ("energy_mj", "power_w", "gpu_util_percent", "mem_util_percent", "device_memory_used_bytes",
               "process_memory_bytes", "sm_clock_mhz", "temperature_c", "throttle_reasons")
    DESCRIPTIONS = {
        "gpu_util_percent": "NVML utilization.gpu: % of the driver's last sample period (1/6 s..1 s) in which any "
                            "kernel ran (not SM occupancy)",
        "mem_util_percent": "NVML utilization.memory: % of that period in which device memory was read or written",
        "device_memory_used_bytes": "NVML device memory used by all processes, bytes (see memory_info_version)",
        "process_memory_bytes": "NVML memory of the worker process tree on this GPU, bytes (None: NVML does not report "
                                "it, e.g. MIG or a container's PID namespace)",
        "power_w": "board power draw, W (NVML: averaged over 1 s on Ampere except GA100 and newer, else instantaneous)",
        "energy_mj": "board energy counter, mJ since the driver was loaded (Volta and newer)",
        "sm_clock_mhz": "current SM clock, MHz",
        "temperature_c": "GPU die temperature, degrees C",
        "throttle_reasons": "nvmlClocksEventReasons bitmask of why clocks are held below their maximum",
    }
    # Errors that will not go away during a run: the metric is marked unavailable.
    PERMANENT = ("NVMLError_NotSupported", "NVMLError_NoPermission", "NVMLError_FunctionNotFound")

    def __init__(self, device: int | str = 0, nvml: Any = None, notes: Iterable[str] = ()):
        self.nvml = nvml or _nvml()
        self.unavailable: dict[str, str] = {}
        self.notes: list[str] = list(notes)
        self.transient: dict[str, dict[str, Any]] = {}
        self._permanent = _error_classes(self.nvml, *self.PERMANENT)
        self._pid: int | None = None
        self._pids: set[int] = set()
        self.selector = device
        self.mig = False
        self.nvml.nvmlInit()
        try:
            self.handle = self._resolve(device)
        except BaseException:
            self.close()
            raise
        self.uuid = self._text("nvmlDeviceGetUUID")
        self.device_name = self._text("nvmlDeviceGetName")
        self._memory_version = 2 if getattr(self.nvml, "nvmlMemory_v2", None) is not None else 1
        self.memory_note = "" if self._memory_version == 2 else "nvidia-ml-py has no nvmlMemory_v2: v1 struct"
        names = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
        self._throttle_calls = [n for n in names if hasattr(self.nvml, n)]
        if self.mig:
            self.notes.append("MIG device: NVML may not report per-process memory (process_memory_bytes None), and "
                              "does not support utilization rates on MIG-enabled GPUs")
            reason = ("MIG device: the board's power and energy are shared with the other MIG instances and cannot "
                      "be attributed to this one")
            self.unavailable.update({"power_w": reason, "energy_mj": reason})

    # --- resolving the device -------------------------------------------------------------------------------------
    def _resolve(self, device: int | str) -> Any:
        nvml = self.nvml
        if isinstance(device, int):
            return nvml.nvmlDeviceGetHandleByIndex(device)
        if device.upper().startswith("MIG-GPU-"):  # pre-R470 form: MIG-GPU-<uuid>/<gpu instance>/<compute instance>
            self.mig = True
            parent, gi, ci = device[4:].split("/")
            return self._mig_by_instance(self._by_uuid(parent), int(gi), int(ci))
        if device.upper().startswith("MIG-"):
            self.mig = True
            return nvml.nvmlDeviceGetHandleByUUID(device)  # accepts MIG device UUIDs (R470+)
        return self._by_uuid(device)

    def _by_uuid(self, uuid: str) -> Any:
        """The device whose UUID is ``uuid``, or starts with it (CUDA accepts unambiguous UUID prefixes)."""
        nvml = self.nvml
        try:
            return nvml.nvmlDeviceGetHandleByUUID(uuid)
        except nvml.NVMLError:
            pass
        matches = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            if _decode(nvml.nvmlDeviceGetUUID(handle)).lower().startswith(uuid.lower()):
                matches.append(handle)
        if len(matches) != 1:
            raise LookupError(f"{len(matches)} GPUs have a UUID starting with {uuid!r}; CUDA needs exactly one")
        return matches[0]

    def _mig_by_instance(self, parent: Any, gpu_instance: int, compute_instance: int) -> Any:
        nvml = self.nvml
        for index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(parent)):
            try:
                handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)
            except nvml.NVMLError:
                continue  # an empty slot
            if (nvml.nvmlDeviceGetGpuInstanceId(handle) == gpu_instance
                    and nvml.nvmlDeviceGetComputeInstanceId(handle) == compute_instance):
                return handle
        raise LookupError(f"no MIG device with GPU instance {gpu_instance} and compute instance {compute_instance}")

    def _text(self, call: str) -> str | None:
        try:
            return _decode(getattr(self.nvml, call)(self.handle))
        except Exception:  # noqa: BLE001 - a missing name or UUID is not worth failing for
            return None

    # --- sampling ---------------------------------------------------------------------------------------------------
    def attach(self, pid: int) -> None:
        self._pid = pid
        self._pids = {pid}

    def _read(self, metric: str, read: Callable[[], Any], out: dict[str, Any], *also: str) -> None:
        """out[metric] = read(), degrading as the module docstring says; ``also`` share the call's fate."""
        if metric in self.unavailable:
            return
        try:
            out[metric] = read()
            return
        except AttributeError as err:  # the bindings lack the call
            reason = f"nvidia-ml-py: {err}"
        except Exception as err:  # noqa: BLE001 - sampling never raises into the run
            if isinstance(err, self._permanent):
                reason = f"{getattr(read, 'call', metric)}: {err}"
            else:
                for name in (metric, *also):
                    out[name] = None  # this sample lacks it; later ones may have it
                    entry = self.transient.setdefault(name, {"count": 0, "last": ""})
                    entry["count"] += 1
                    entry["last"] = f"{type(err).__name__}: {err}"
                return
        for name in (metric, *also):
            self.unavailable[name] = reason

    def _memory_used(self) -> float:
        nvml = self.nvml
        if self._memory_version == 2:
            fallback = _error_classes(nvml, "NVMLError_FunctionNotFound", "NVMLError_NotSupported",
                                      "NVMLError_ArgumentVersionMismatch")
            try:
                return float(nvml.nvmlDeviceGetMemoryInfo(self.handle, version=nvml.nvmlMemory_v2).used)
            except TypeError as err:  # bindings whose nvmlDeviceGetMemoryInfo takes no version
                self.memory_note = f"v2 not in nvidia-ml-py ({err}): v1 struct"
            except fallback as err:  # a driver without nvmlDeviceGetMemoryInfo_v2
                self.memory_note = f"v2 refused by the driver ({type(err).__name__}: {err}): v1 struct"
            self._memory_version = 1
        return float(nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def _process_memory(self) -> float | None:
        if self._pid is not None:
            self._pids = {self._pid, *(p.pid for p in _process_tree(self._pid)[1:])}
        total = 0
        found = False
        foreign = False
        for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if proc.pid in self._pids:
                found = True
                if proc.usedGpuMemory is None:  # NVML_VALUE_NOT_AVAILABLE (MIG, some containers)
                    return None
                total += proc.usedGpuMemory
            elif not psutil.pid_exists(proc.pid):
                foreign = True
        if not found and foreign:
            # NVML lists PIDs this process cannot see: they are in another PID namespace (this process is in a
            # container; NVML reports host PIDs), so the worker's own entry cannot be recognised. Unknown, not 0.
            note = ("NVML lists GPU processes whose PIDs are not visible here (a PID namespace, e.g. a container): "
                    "the worker's own GPU memory cannot be attributed")
            if note not in self.notes:
                self.notes.append(note)
            return None
        return float(total) if found else 0.0

    def _throttle(self) -> int:
        while self._throttle_calls:
            call = self._throttle_calls[0]
            try:
                return int(getattr(self.nvml, call)(self.handle))
            except _error_classes(self.nvml, "NVMLError_FunctionNotFound"):
                if len(self._throttle_calls) == 1:
                    raise
                self._throttle_calls.pop(0)  # a driver older than the event-reasons name: use the throttle name
        raise AttributeError("no nvmlDeviceGetCurrentClocks{Event,Throttle}Reasons")

    def _temperature(self) -> float:
        nvml = self.nvml
        return float(nvml.nvmlDeviceGetTemperature(self.handle, nvml.NVML_TEMPERATURE_GPU))

    def sample(self) -> dict[str, Any]:
        """One sample. The energy counter is read first, closest to the sample's timestamp."""
        out: dict[str, Any] = {}
        nvml, handle = self.nvml, self.handle
        rates: dict[str, Any] = {}

        def utilization() -> float:
            rates["r"] = nvml.nvmlDeviceGetUtilizationRates(handle)
            return float(rates["r"].gpu)

        calls: list[tuple[str, Callable[[], Any], str, tuple[str, ...]]] = [
            ("energy_mj", lambda: int(nvml.nvmlDeviceGetTotalEnergyConsumption(handle)),
             "nvmlDeviceGetTotalEnergyConsumption", ()),
            ("power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0, "nvmlDeviceGetPowerUsage", ()),
            ("gpu_util_percent", utilization, "nvmlDeviceGetUtilizationRates", ("mem_util_percent",)),
            ("device_memory_used_bytes", self._memory_used, "nvmlDeviceGetMemoryInfo", ()),
            ("process_memory_bytes", self._process_memory, "nvmlDeviceGetComputeRunningProcesses", ()),
            ("sm_clock_mhz", lambda: float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
             "nvmlDeviceGetClockInfo(NVML_CLOCK_SM)", ()),
            ("temperature_c", self._temperature, "nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)", ()),
            ("throttle_reasons", self._throttle, "nvmlDeviceGetCurrentClocksEventReasons", ()),
        ]
        for metric, read, call, also in calls:
            self._read(metric, _Named(read, call), out, *also)
            if metric == "gpu_util_percent" and "r" in rates:
                out["mem_util_percent"] = float(rates["r"].memory)
        return out

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a broken NVML is not worth an error
            pass

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "backend": "nvml", "name": self.device_name, "uuid": self.uuid, "mig": self.mig,
            "device_selector": self.selector, "memory_info_version": self._memory_version,
            "unavailable": dict(self.unavailable), "notes": list(self.notes),
            "transient_errors": {k: dict(v) for k, v in self.transient.items()},
            "metrics": {m: self.DESCRIPTIONS[m] for m in self.METRICS if m not in self.unavailable},
        }
        if self.memory_note:
            info["memory_info_note"] = self.memory_note
        return info


class _Named:
    """A zero-argument reader with the NVML call's name, for unavailable reasons."""

    def __init__(self, read: Callable[[], Any], call: str):
        self.read, self.call = read, call

    def __call__(self) -> Any:
        return self.read()


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def make_backend(device: str, nvml: Any = None) -> tuple[Backend, str | None]:
    """The backend for a trial's device: NVML for "cuda[:N]" when it can be initialised and the device found, else
    the host backend. Returns (backend, note); the note says why NVML is not used, or is None. ``nvml``: the pynvml
    module (tests pass a fake)."""
    if not device.startswith("cuda"):
        return HostBackend(), None
    try:
        target = nvml_visible_index(device)
        notes = []
        order = os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        if isinstance(target, int) and order != "PCI_BUS_ID":
            notes.append(f"CUDA_DEVICE_ORDER={order}: {device} was taken to be NVML device {target}, which holds only "
                         f"in PCI bus order; use GPU UUIDs in CUDA_VISIBLE_DEVICES to be sure")
        return NvmlBackend(target, nvml=nvml, notes=notes), None
    except Exception as err:  # noqa: BLE001 - no library, no driver, no such device: fall back, say why
        return HostBackend(), f"NVML unavailable ({type(err).__name__}: {err}); sampling the host instead"


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
    sample, so every window still gets a sample at or after its end: windows of a few milliseconds (tiny epochs) would otherwise make the sampler call its backend
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


def _belongs(sample: dict[str, Any], ranges: list[tuple[float, float]]) -> bool:
    edge, t = sample.get("edge"), sample["t"]
    if edge == "start":
        return False
    return any(a <= t <= b or (edge == "end" and b < t <= b + EDGE_LAG_S) for a, b in ranges)


def _scopes(windows: list[tuple[float, float]]) -> list[tuple[str, list[tuple[float, float]]]]:
    span = [(min(a for a, _ in windows), max(b for _, b in windows))] if windows else []
    return [("windows", windows), ("span", span)]


def phase_stats(samples: list[dict[str, Any]], windows: list[tuple[float, float]]) -> dict[str, dict[str, Any]]:
    """Mean, median, max and count of every metric over the samples that belong to ``windows``.

    A sample belongs to a window when it was taken inside it, or when it is the end-edge sample taken at most
    EDGE_LAG_S after the window's end; start-edge samples (baselines, which describe the time before the window)
    never do. Missing values (None) are left out. ``scope`` says which samples were used: ``"windows"`` (inside the timed
    windows); ``"span"`` when no sample fell inside them (windows shorter than the sampling interval), so the samples
    from the first window's start to the last one's end were used instead, evaluation pauses included; ``"none"``
    when even that span holds no sample (statistics None, count 0). NON_STAT_METRICS (a counter, a bitmask) are left
    out: see energy_over_windows and throttle_summary.
    """
    metrics = sorted({k for s in samples for k in s if k not in ("t", "edge") and k not in NON_STAT_METRICS})
    stats: dict[str, dict[str, Any]] = {}
    for metric in metrics:
        for scope, ranges in _scopes(windows):
            values = np.asarray([s[metric] for s in samples if s.get(metric) is not None and _belongs(s, ranges)],
                                dtype=float)
            if values.size:
                stats[metric] = {"mean": float(values.mean()), "median": float(np.median(values)),
                                 "max": float(values.max()), "count": int(values.size), "scope": scope}
                break
        else:
            stats[metric] = {"mean": None, "median": None, "max": None, "count": 0, "scope": "none"}
    return stats


def throttle_summary(samples: list[dict[str, Any]], windows: list[tuple[float, float]]) -> dict[str, Any] | None:
    """How often each clocks-event reason was active in the samples of ``windows`` (membership and scope as in
    phase_stats): {"count", "scope", "any_mask" (OR of all masks), "share": {reason: fraction of samples}}; None
    when no sample has the bitmask."""
    for scope, ranges in _scopes(windows):
        masks = [int(s["throttle_reasons"]) for s in samples
                 if s.get("throttle_reasons") is not None and _belongs(s, ranges)]
        if masks:
            any_mask = 0
            for mask in masks:
                any_mask |= mask
            share = {name: sum(1 for m in masks if m & bit) / len(masks) for bit, name in THROTTLE_BITS.items()
                     if any_mask & bit}
            return {"count": len(masks), "scope": scope, "any_mask": any_mask, "share": share}
    return None


def _series(samples: list[dict[str, Any]], metric: str) -> tuple[np.ndarray, np.ndarray]:
    points = sorted((s["t"], float(s[metric])) for s in samples if s.get(metric) is not None)
    return np.asarray([p[0] for p in points], dtype=float), np.asarray([p[1] for p in points], dtype=float)


def energy_over_windows(samples: list[dict[str, Any]], windows: list[tuple[float, float]]) -> dict[str, Any]:
    """Board energy over the measured windows, in joules.

    Returns {"joules": float | None, "method": "counter" | "power_integral" | None, "seconds": total window time,
    "short_windows": how many windows are shorter than ``short_window_s``, "short_window_s", "windows": how many,
    "unbracketed_edges": window edges outside the readings' time range (their value is the nearest reading's, so the
    energy is underestimated), "mean_power_w": joules / seconds or None, "note": why a method was not used, if so}.

    - ``"counter"`` where samples carry ``energy_mj`` (nvmlDeviceGetTotalEnergyConsumption, Volta and newer): per
      window, the counter linearly interpolated at the window's end minus at its start, summed. The counter's own
      refresh (roughly 20-100 ms; COUNTER_UPDATE_S = 0.1 s assumed) makes each edge uncertain by up to that long at
      the board's power, so windows shorter than COUNTER_UPDATE_S are counted as short.
    - ``"power_integral"`` otherwise: the trapezoidal integral of ``power_w`` over each window (readings linearly
      interpolated at the edges). On Ampere (except GA100) and newer GPUs NVML's power is a 1 s moving average, which
      smears energy across window edges by about a second: windows shorter than POWER_AVERAGING_S count as short.
      Between samples power is assumed linear, so the result is only as good as the sampling interval.
    Both are board-level: every process on the GPU, plus idle power. Approximate by construction; the edge samples
    the launcher takes at each window's start and end (Sampler.poke) put readings close to the edges.
    """
    seconds = float(sum(b - a for a, b in windows))
    out: dict[str, Any] = {"joules": None, "method": None, "seconds": seconds, "short_windows": 0,
                           "short_window_s": None, "windows": len(windows), "unbracketed_edges": 0,
                           "mean_power_w": None}
    if not windows:
        return out
    notes = []
    t, energy = _series(samples, "energy_mj")
    if t.size >= 2 and np.any(np.diff(energy) < 0):
        notes.append("the energy counter went backwards (driver reloaded?): power integrated instead")
    elif t.size >= 2:
        joules = 0.0
        for a, b in windows:
            joules += float(np.interp(b, t, energy) - np.interp(a, t, energy)) / 1000.0
        out.update(joules=joules, method="counter", short_window_s=COUNTER_UPDATE_S,
                   unbracketed_edges=sum((e < t[0]) + (e > t[-1]) for w in windows for e in w))
    if out["method"] is None:
        t, power = _series(samples, "power_w")
        if t.size >= 1:
            joules = 0.0
            for a, b in windows:
                inside = (t > a) & (t < b)
                ts = np.concatenate(([a], t[inside], [b]))
                ps = np.concatenate(([np.interp(a, t, power)], power[inside], [np.interp(b, t, power)]))
                joules += float(np.sum((ps[1:] + ps[:-1]) / 2.0 * np.diff(ts)))
            out.update(joules=joules, method="power_integral", short_window_s=POWER_AVERAGING_S,
                       unbracketed_edges=sum((e < t[0]) + (e > t[-1]) for w in windows for e in w))
    if out["method"] is not None:
        out["short_windows"] = sum(1 for a, b in windows if b - a < out["short_window_s"])
        out["unbracketed_edges"] = int(out["unbracketed_edges"])
        out["mean_power_w"] = out["joules"] / seconds if seconds > 0 else None
    if notes:
        out["note"] = "; ".join(notes)
    return out
