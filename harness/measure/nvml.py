"""The NVML backend of the sampler (nvidia-ml-py, imported as ``pynvml``).

Per sample: GPU and memory utilization (nvmlDeviceGetUtilizationRates: the share of the driver's last 1/6 s..1 s in
which any kernel ran, not the share of SMs in use), device and per-process memory, power, energy, SM clock,
temperature, throttle reasons and, on Hopper and newer, the GPM metrics (SM activity, SM occupancy, tensor-pipe
activity, DRAM bandwidth utilization) over the interval since the previous GPM read. A metric NVML cannot give is
marked unavailable with its reason (``describe()["unavailable"]``) or left None in one sample; nothing is raised into
the run. The GPM metrics are read by ``harness.measure.gpm.GpmReader``.

Design: docs/design/sampling.md (each metric's NVML call, GPM intervals, polling instead of nvmlDeviceGetSamples).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable
from typing import Any, cast

import psutil

from harness.measure.gpm import GPM_METRICS, GPM_MIN_INTERVAL_S, GpmReader
from harness.measure.host import process_tree
from harness.spec.devices import device_index, is_gpu


def tree_pids(pid: int) -> set[int]:
    """``pid`` and every process below it now (``process_tree``): the PIDs whose GPU memory is the worker's."""
    return {pid, *(p.pid for p in process_tree(pid)[1:])}


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
    if device != "cuda" and not is_gpu(device):
        raise ValueError(f"{device!r} is not a CUDA device (cuda or cuda:N)")
    index = device_index(device)
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


def _error_classes(nvml: Any, *names: str) -> tuple[type[BaseException], ...]:
    # pynvml's NVMLError_* attributes are exception classes (the bindings are untyped, hence the cast)
    return cast(tuple[type[BaseException], ...],
                tuple(c for n in names if isinstance(c := getattr(nvml, n, None), type)))


class NvmlBackend:
    """NVML samples of one GPU (or MIG device) and of the worker process tree's memory on it.

    ``device``: an NVML index, or a string from ``nvml_visible_index`` (GPU UUID or prefix, MIG UUID). ``nvml``: the
    pynvml module (tests pass a fake). ``notes``: lines for describe()["notes"]. Raises when NVML cannot be initialised
    or the device is not found (after shutting NVML down again); ``make_backend`` turns that into the host backend.
    """

    name = "nvml"
    METRICS = ("energy_mj", "power_w", "gpu_util_percent", "mem_util_percent", "device_memory_used_bytes",
               "process_memory_bytes", "sm_clock_mhz", "temperature_c", "throttle_reasons", *GPM_METRICS)
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
        "sm_active_percent": "NVML GPM SM activity (NVML_GPM_METRIC_SM_UTIL): % of SMs busy, averaged over the "
                             "interval since the previous GPM sample",
        "sm_occupancy_percent": "NVML GPM SM occupancy (NVML_GPM_METRIC_SM_OCCUPANCY): % of the SMs' warp slots "
                                "holding a resident warp, over the same interval",
        "tensor_active_percent": "NVML GPM tensor-pipe activity (NVML_GPM_METRIC_ANY_TENSOR_UTIL): % of time the SMs' "
                                 "tensor pipes ran any tensor operation, over the same interval",
        "dram_bw_util_percent": "NVML GPM DRAM bandwidth utilization (NVML_GPM_METRIC_DRAM_BW_UTIL): % of the "
                                "theoretical maximum DRAM bandwidth used, over the same interval",
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
        self.selector = device
        self.mig = False
        self.gpm_min_interval_s = GPM_MIN_INTERVAL_S  # GPM reads at most this often (seconds)
        self._gpm: GpmReader | None = None
        self.nvml.nvmlInit()
        try:
            self.handle = self._resolve(device)
        except BaseException:
            self.close()
            raise
        self._gpm = GpmReader(self.nvml, self.handle, self.mig, self.unavailable, self.notes, self._failed)
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

    def _read(self, metric: str, read: _Named, out: dict[str, Any], *also: str) -> None:
        """out[metric] = read(), degrading as the module docstring says (``_failed``); ``also`` share the call's
        fate."""
        if metric in self.unavailable:
            return
        try:
            out[metric] = read()
        except Exception as err:  # noqa: BLE001 - sampling never raises into the run
            self._failed(read.call, err, (metric, *also), out)

    def _failed(self, call: str, err: BaseException, names: Iterable[str], out: dict[str, Any]) -> None:
        """The module docstring's degradation of the metrics ``names`` after ``call`` raised ``err``: missing
        bindings (AttributeError) and PERMANENT errors make them unavailable with the reason; any other error leaves
        them None in this sample (``out``) and is counted in ``transient`` (later samples may have them)."""
        names = [n for n in names if n not in self.unavailable]
        if isinstance(err, AttributeError):  # the bindings lack the call
            reason = f"nvidia-ml-py: {err}"
        elif isinstance(err, self._permanent):
            reason = f"{call}: {err}"
        else:
            for name in names:
                out[name] = None  # this sample lacks it; later ones may have it
                entry = self.transient.setdefault(name, {"count": 0, "last": ""})
                entry["count"] += 1
                entry["last"] = f"{type(err).__name__}: {err}"
            return
        for name in names:
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

    def _process_memory(self, listed: Collection[int] | None) -> float | None:
        """The GPU memory of the processes ``listed`` (``sample``'s ``pids``), or of the attached process's tree."""
        if listed is not None:
            pids = set(listed)
        else:
            pids = tree_pids(self._pid) if self._pid is not None else set()
        total = 0
        found = False
        foreign = False
        for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if proc.pid in pids:
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

    def sample(self, pids: Collection[int] | None = None) -> dict[str, Any]:
        """One sample. The energy counter is read first, closest to the sample's timestamp. ``pids``: the processes
        whose GPU memory is the trial's (``process_memory_bytes``) when the caller has listed them (a
        ``MultiNvmlBackend`` lists the worker's process tree once for all its devices); None: the attached process's
        tree, listed here when that metric is read."""
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
            ("process_memory_bytes", lambda: self._process_memory(pids), "nvmlDeviceGetComputeRunningProcesses", ()),
            ("sm_clock_mhz", lambda: float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
             "nvmlDeviceGetClockInfo(NVML_CLOCK_SM)", ()),
            ("temperature_c", self._temperature, "nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)", ()),
            ("throttle_reasons", self._throttle, "nvmlDeviceGetCurrentClocksEventReasons", ()),
        ]
        for metric, read, call, also in calls:
            self._read(metric, _Named(read, call), out, *also)
            if metric == "gpu_util_percent" and "r" in rates:
                out["mem_util_percent"] = float(rates["r"].memory)
        if self._gpm is not None:
            self._gpm.sample(out, self.gpm_min_interval_s)
        return out

    def close(self) -> None:
        if self._gpm is not None:
            self._gpm.close()
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
