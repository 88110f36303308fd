"""A fake of the pynvml module (nvidia-ml-py), the hardware boundary of ``harness.measure.nvml``,
``harness.measure.multi_gpu`` and ``harness.measure.machine.gpus``. It follows the NVML reference
(https://docs.nvidia.com/deploy/nvml-api/) in what the harness calls: names, arguments, struct fields, error classes
and the reference count of nvmlInit/nvmlShutdown, with readings that identify which call, and which GPU, produced
them."""

from __future__ import annotations

import os
import time
import types

CODES: dict[int, type] = {}  # nvmlReturn_t value -> error class


class NVMLError(Exception):
    """As in pynvml: ``NVMLError(code)`` with an nvmlReturn_t value is an instance of that code's subclass."""

    text = "NVML error"
    value: int | None = None

    def __new__(cls, value=None):
        if cls is NVMLError and isinstance(value, int) and value in CODES:
            cls = CODES[value]
        return Exception.__new__(cls)

    def __init__(self, value=None):
        super().__init__(value if isinstance(value, str) else
                         f"NVML error {value}" if value is not None and value != self.value else self.text)


def _error(name, text, value):
    cls = type(name, (NVMLError,), {"text": text, "value": value})
    CODES[value] = cls
    return cls


# Texts and nvmlReturn_t values as in nvml.h / pynvml.
NotSupported = _error("NVMLError_NotSupported", "Not Supported", 3)
NoPermission = _error("NVMLError_NoPermission", "Insufficient Permissions", 4)
FunctionNotFound = _error("NVMLError_FunctionNotFound", "Function Not Found", 13)
GpuIsLost = _error("NVMLError_GpuIsLost", "GPU is lost", 15)
Unknown = _error("NVMLError_Unknown", "Unknown Error", 999)
InvalidArgument = _error("NVMLError_InvalidArgument", "Invalid Argument", 2)
NotFound = _error("NVMLError_NotFound", "Not Found", 6)
DriverNotLoaded = _error("NVMLError_DriverNotLoaded", "Driver Not Loaded", 9)
Uninitialized = _error("NVMLError_Uninitialized", "Uninitialized", 1)
VersionMismatch = _error("NVMLError_ArgumentVersionMismatch", "Argument Version Mismatch", 25)
ERRORS = (NVMLError, NotSupported, NoPermission, FunctionNotFound, GpuIsLost, Unknown, InvalidArgument, NotFound,
          DriverNotLoaded, VersionMismatch, Uninitialized)

UUID0 = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
UUID1 = "GPU-8932aaaa-0000-4106-c12f-20bd9faed9f6"
MIG_UUID = "MIG-0f3e2a71-3b0c-5d5e-9c1f-6c0c3b1f2d10"
V2 = 0x02000028  # nvmlMemory_v2
CLOCK_SM, TEMPERATURE_GPU = 1, 0
MEMORY_TOTAL = 80_000_000_000
POWER_LIMIT_MW = 700_000
DRIVER = "550.54.15"

# GPM (https://docs.nvidia.com/deploy/nvml-api/group__nvmlGpmFunctions.html, group__nvmlGpmStructs.html): metric ids of
# nvmlGpmMetricId_t, struct versions, and what the fake GPU does in each interval (percent) unless a test changes it.
GPM_SM_UTIL, GPM_SM_OCCUPANCY, GPM_ANY_TENSOR_UTIL, GPM_DRAM_BW_UTIL = 2, 3, 5, 10
GPM_METRICS_GET_VERSION = GPM_SUPPORT_VERSION = 1
GPM_METRIC_MAX = 477
GPM_ACTIVITY = {GPM_SM_UTIL: 62.5, GPM_SM_OCCUPANCY: 31.25, GPM_ANY_TENSOR_UTIL: 45.0, GPM_DRAM_BW_UTIL: 20.0}
MIG_GPU_INSTANCE = 1


def uuids(count):
    """``count`` distinct GPU UUIDs, UUID0 first: a machine of several GPUs (``fake_nvml(devices=uuids(4))``)."""
    return (UUID0, *(f"GPU-{index:08x}-0000-4106-c12f-20bd9faed9f6" for index in range(1, count)))


def reading(name, index):
    """What GPU ``index`` reads for ``name``: GPU 0 the values the single-GPU tests know, each further GPU its own
    (utilization 10 points lower per index, memory 1 GB more, power 50 W more, energy counting (index + 1) times
    as fast, clocks 10 MHz lower, 1 degree hotter, the next clocks-event bit)."""
    return {"gpu": 87 - 10 * index, "memory": 40 + index, "used_v2": 3_000_000_000 + 1_000_000_000 * index,
            "used_v1": 3_200_000_000 + 1_000_000_000 * index, "power_mw": 250_500 + 50_000 * index,
            "energy_factor": index + 1, "clock": 1410 - 10 * index, "temperature": 65 + index,
            "reasons": 0x4 << index}[name]


class GpmMetric:
    """nvmlGpmMetric_t: ``metricId`` (IN), ``nvmlReturn`` and ``value`` (OUT)."""

    def __init__(self):
        self.metricId, self.nvmlReturn, self.value = 0, 0, 0.0


class GpmMetricsGet:
    """nvmlGpmMetricsGet_t (pynvml's c_nvmlGpmMetricsGet_t): version, numMetrics, sample1, sample2, metrics[]."""

    def __init__(self):
        self.version, self.numMetrics, self.sample1, self.sample2 = 0, 0, None, None
        self.metrics = [GpmMetric() for _ in range(GPM_METRIC_MAX)]


class GpmSample:
    """An nvmlGpmSample_t buffer: what nvmlGpmSampleGet read into it (the GPU's tick and cumulative counters)."""

    def __init__(self):
        self.freed, self.tick, self.counters, self.source = False, None, {}, None


def fake_nvml(fail=None, devices=(UUID0,), process_memory=(1_500_000_000, 500_000_000), name=b"Fake GPU", gpm=True,
              gpm_unsupported=()):
    """A stand-in for the pynvml module: every call the backend and ``machine.gpus()`` make, with readings that identify
    which call (and which argument) produced them. ``fail[call]``: an exception raised by every call, or a list consumed
    one per call (None: that call succeeds; once the list is used up, calls succeed). ``nvml.pids``: the worker tree's
    PIDs that the process list reports, paired with ``process_memory``; ``nvml.other_pid``: another process on the GPU.
    ``name``: what nvmlDeviceGetName returns for a whole GPU (bytes, as older bindings return it, or str).

    Several GPUs: ``devices`` lists their UUIDs (``uuids(n)``); GPU i reads ``reading(name, i)``; every GPU lists
    the same processes unless ``nvml.device_processes`` is set: a function of the GPU's index returning its
    (pid, bytes) pairs, asked at each nvmlDeviceGetComputeRunningProcesses. NVML's reference count: each nvmlInit
    adds one, each nvmlShutdown takes one (no error below zero, as the reference says), and every device call
    raises NVMLError_Uninitialized while the count is zero (``nvml.init_count``).

    GPM: ``gpm`` is nvmlGpmQueryDeviceSupport's isSupportedDevice (False: a GPU older than Hopper);
    ``gpm_unsupported``: metric ids whose nvmlReturn in nvmlGpmMetricsGet is NVML_ERROR_NOT_SUPPORTED. The fake GPU's
    counters advance by ``nvml.gpm_activity[id]`` (percent) per tick, one tick per nvmlGpmSampleGet, so a metric over
    two samples is the activity set between them; ``nvml.gpm_sample_times`` holds each sample read's
    time.monotonic()."""
    fail = dict(fail or {})
    nvml = types.SimpleNamespace()
    nvml.calls = {}
    nvml.pids = []
    nvml.other_pid = os.getpid()  # a real process, outside the worker's tree
    nvml.energy_mj = lambda: 1_000_000 + 250 * nvml.calls["nvmlDeviceGetTotalEnergyConsumption"]
    nvml.device_processes = None
    nvml.init_count = 0
    handles = {f"handle{i}": uuid for i, uuid in enumerate(devices)}
    migs = {3: (1, 0, MIG_UUID)}  # slot index -> (GPU instance, compute instance, UUID)

    def call(name, result):
        def function(*args, **kwargs):
            nvml.calls[name] = nvml.calls.get(name, 0) + 1
            plan = fail.get(name)
            if isinstance(plan, list):
                error = plan.pop(0) if plan else None
            else:
                error = plan
            if error is not None:
                raise error
            if name.startswith(("nvmlDevice", "nvmlGpm", "nvmlSystem")) and nvml.init_count <= 0:
                raise Uninitialized()
            return result(*args, **kwargs)
        return function

    def index_of(handle):
        return int(handle[len("handle"):]) if handle in handles else 0  # a MIG device: its parent GPU's readings

    def init():
        nvml.init_count += 1

    def shutdown():
        nvml.init_count = max(0, nvml.init_count - 1)

    def memory(handle, version=None):
        index = index_of(handle)
        if version is not None:
            assert version == V2
            return call("nvmlDeviceGetMemoryInfo_v2", lambda: types.SimpleNamespace(
                total=MEMORY_TOTAL, used=reading("used_v2", index), reserved=200_000_000))()
        return call("nvmlDeviceGetMemoryInfo", lambda: types.SimpleNamespace(total=MEMORY_TOTAL,
                                                                             used=reading("used_v1", index)))()

    def processes(handle):
        if nvml.device_processes is not None:
            pairs = list(nvml.device_processes(index_of(handle)))
        else:
            pairs = list(zip(nvml.pids, process_memory))
        mine = [types.SimpleNamespace(pid=pid, usedGpuMemory=m) for pid, m in pairs]
        return [*mine, types.SimpleNamespace(pid=nvml.other_pid, usedGpuMemory=5)]

    def by_index(index):
        if index >= len(devices):
            raise InvalidArgument()
        return f"handle{index}"

    def by_uuid(uuid):
        for handle, known in handles.items():
            if known == uuid:
                return handle
        if uuid == MIG_UUID:
            return "mig-handle"
        raise NotFound()

    def mig_parent(handle):
        if handle != "mig-handle":
            raise InvalidArgument()
        return "handle0"

    def mig_by_index(parent, index):
        if index not in migs:
            raise NotFound()
        return "mig-handle"

    nvml.gpm_activity = dict(GPM_ACTIVITY)
    nvml.gpm_sample_times = []
    nvml.gpm_buffers = []
    gpu = {"tick": 0, "counters": {k: 0.0 for k in GPM_ACTIVITY}}

    def gpm_alloc():
        nvml.gpm_buffers.append(GpmSample())
        return nvml.gpm_buffers[-1]

    def gpm_free(sample):
        if not isinstance(sample, GpmSample) or sample.freed:
            raise InvalidArgument()
        sample.freed = True

    def gpm_read(sample, source):
        if not isinstance(sample, GpmSample) or sample.freed:
            raise InvalidArgument()
        gpu["tick"] += 1
        for metric in gpu["counters"]:
            gpu["counters"][metric] += nvml.gpm_activity.get(metric, 0.0)
        sample.tick, sample.counters, sample.source = gpu["tick"], dict(gpu["counters"]), source
        nvml.gpm_sample_times.append(time.monotonic())
        return sample

    def gpm_sample_get(handle, sample):
        if handle not in handles:  # a MIG device handle: nvmlGpmMigSampleGet on its parent
            raise InvalidArgument()
        return gpm_read(sample, handle)

    def gpm_mig_sample_get(handle, gpu_instance, sample):
        if handle not in handles or gpu_instance != MIG_GPU_INSTANCE:
            raise InvalidArgument()
        return gpm_read(sample, (handle, gpu_instance))

    def gpm_support(handle):
        if handle not in handles:
            raise InvalidArgument()
        return types.SimpleNamespace(version=GPM_SUPPORT_VERSION, isSupportedDevice=int(bool(gpm)))

    def gpm_metrics_get(request):
        if request.version != GPM_METRICS_GET_VERSION:
            raise VersionMismatch()
        first, second = request.sample1, request.sample2
        if not 0 < request.numMetrics <= GPM_METRIC_MAX or not all(
                isinstance(s, GpmSample) and not s.freed and s.tick is not None for s in (first, second)):
            raise InvalidArgument()
        if first.source != second.source or second.tick <= first.tick:
            raise InvalidArgument()
        for metric in request.metrics[:request.numMetrics]:
            if metric.metricId in gpm_unsupported:
                metric.nvmlReturn, metric.value = NotSupported.value, 0.0
            elif metric.metricId not in first.counters:
                metric.nvmlReturn, metric.value = InvalidArgument.value, 0.0
            else:
                change = second.counters[metric.metricId] - first.counters[metric.metricId]
                metric.nvmlReturn, metric.value = 0, change / (second.tick - first.tick)
        return request

    nvml.c_nvmlGpmMetricsGet_t = GpmMetricsGet
    nvml.NVML_GPM_METRICS_GET_VERSION, nvml.NVML_GPM_SUPPORT_VERSION = GPM_METRICS_GET_VERSION, GPM_SUPPORT_VERSION
    nvml.NVML_GPM_METRIC_SM_UTIL, nvml.NVML_GPM_METRIC_SM_OCCUPANCY = GPM_SM_UTIL, GPM_SM_OCCUPANCY
    nvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, nvml.NVML_GPM_METRIC_DRAM_BW_UTIL = GPM_ANY_TENSOR_UTIL, GPM_DRAM_BW_UTIL
    for cls in ERRORS:
        setattr(nvml, cls.__name__, cls)
    nvml.NVML_CLOCK_SM, nvml.NVML_TEMPERATURE_GPU, nvml.nvmlMemory_v2 = CLOCK_SM, TEMPERATURE_GPU, V2
    functions = {
        "nvmlInit": init, "nvmlShutdown": shutdown,
        "nvmlSystemGetDriverVersion": lambda: DRIVER,
        "nvmlDeviceGetCount": lambda: len(devices),
        "nvmlDeviceGetHandleByIndex": by_index, "nvmlDeviceGetHandleByUUID": by_uuid,
        "nvmlDeviceGetUUID": lambda h: MIG_UUID if h == "mig-handle" else handles[h],
        "nvmlDeviceGetName": lambda h: b"Fake GPU MIG 1g.10gb" if h == "mig-handle" else name,
        "nvmlDeviceGetMaxMigDeviceCount": lambda h: 7, "nvmlDeviceGetMigDeviceHandleByIndex": mig_by_index,
        "nvmlDeviceGetGpuInstanceId": lambda h: migs[3][0], "nvmlDeviceGetComputeInstanceId": lambda h: migs[3][1],
        "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(gpu=reading("gpu", index_of(h)),
                                                                        memory=reading("memory", index_of(h))),
        "nvmlDeviceGetComputeRunningProcesses": processes,
        "nvmlDeviceGetPowerUsage": lambda h: reading("power_mw", index_of(h)),
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: POWER_LIMIT_MW,
        "nvmlDeviceGetTotalEnergyConsumption": lambda h: nvml.energy_mj() * reading("energy_factor", index_of(h)),
        "nvmlDeviceGetClockInfo": lambda h, kind: reading("clock", index_of(h)) if kind == CLOCK_SM else 7777,
        "nvmlDeviceGetTemperature": lambda h, sensor: (reading("temperature", index_of(h))
                                                       if sensor == TEMPERATURE_GPU else 7777),
        "nvmlDeviceGetCurrentClocksEventReasons": lambda h: reading("reasons", index_of(h)),
        "nvmlDeviceGetCurrentClocksThrottleReasons": lambda h: 0x40,
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": mig_parent,
        "nvmlGpmQueryDeviceSupport": gpm_support, "nvmlGpmSampleAlloc": gpm_alloc, "nvmlGpmSampleFree": gpm_free,
        "nvmlGpmSampleGet": gpm_sample_get, "nvmlGpmMigSampleGet": gpm_mig_sample_get,
        "nvmlGpmMetricsGet": gpm_metrics_get,
    }
    for name_, function in functions.items():
        setattr(nvml, name_, call(name_, function))
    nvml.nvmlDeviceGetMemoryInfo = memory
    return nvml
