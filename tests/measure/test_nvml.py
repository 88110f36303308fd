"""The NVML backend against a fake NVML module (tests/fakes/nvml.py, the hardware boundary): every metric, degraded
and unavailable calls, GPM, falling back to the host, and which GPU a device name selects."""

from __future__ import annotations

import sys
import time
import types

import psutil
import pytest

from harness.measure.host import HostBackend
from harness.measure.nvml import NvmlBackend, nvml_visible_index
from harness.measure.sampler import make_backend
from harness.measure.windows import phase_stats
from tests.fakes.nvml import (
    GPM_ACTIVITY,
    GPM_ANY_TENSOR_UTIL,
    GPM_DRAM_BW_UTIL,
    GPM_SM_OCCUPANCY,
    GPM_SM_UTIL,
    MIG_UUID,
    UUID0,
    UUID1,
    DriverNotLoaded,
    FunctionNotFound,
    GpuIsLost,
    InvalidArgument,
    NoPermission,
    NotFound,
    NotSupported,
    Unknown,
    VersionMismatch,
    fake_nvml,
)

EXPECTED = {"energy_mj": 1_000_250, "power_w": 250.5, "gpu_util_percent": 87.0, "mem_util_percent": 40.0,
            "device_memory_used_bytes": 3e9, "process_memory_bytes": 2e9, "sm_clock_mhz": 1410.0,
            "temperature_c": 65.0, "throttle_reasons": 0x4}
# The GPM metrics over an interval of the fake GPU's default activity (tests/fakes/nvml.py GPM_ACTIVITY).
GPM = {"sm_active_percent": GPM_ACTIVITY[GPM_SM_UTIL], "sm_occupancy_percent": GPM_ACTIVITY[GPM_SM_OCCUPANCY],
       "tensor_active_percent": GPM_ACTIVITY[GPM_ANY_TENSOR_UTIL],
       "dram_bw_util_percent": GPM_ACTIVITY[GPM_DRAM_BW_UTIL]}
NO_GPM = dict.fromkeys(GPM)  # the first sample: no interval yet
# Each NVML call and the metrics it feeds.
CALLS = {
    "nvmlDeviceGetTotalEnergyConsumption": ("energy_mj",),
    "nvmlDeviceGetPowerUsage": ("power_w",),
    "nvmlDeviceGetUtilizationRates": ("gpu_util_percent", "mem_util_percent"),
    "nvmlDeviceGetMemoryInfo_v2": ("device_memory_used_bytes",),
    "nvmlDeviceGetComputeRunningProcesses": ("process_memory_bytes",),
    "nvmlDeviceGetClockInfo": ("sm_clock_mhz",),
    "nvmlDeviceGetTemperature": ("temperature_c",),
    "nvmlDeviceGetCurrentClocksEventReasons": ("throttle_reasons",),
}


def backend_on(nvml, tree_pids=None, device=0):
    backend = NvmlBackend(device, nvml=nvml)
    if tree_pids is not None:
        nvml.pids = list(tree_pids)
        backend.attach(tree_pids[0])
    else:
        backend.attach(4242)
    return backend


def test_nvml_backend_reads_every_metric_and_the_whole_worker_tree_memory(tree):
    nvml = fake_nvml()
    backend = backend_on(nvml, tree)
    # 1.5 GB (worker) + 0.5 GB (its child); not the other process's 5 bytes
    assert backend.sample() == {**EXPECTED, **NO_GPM}
    time.sleep(0.11)  # GPM reads must be more than 100 ms apart
    assert backend.sample() == {**EXPECTED, "energy_mj": 1_000_500, **GPM}
    backend.close()
    assert nvml.calls["nvmlDeviceGetMemoryInfo_v2"] == 2 and "nvmlDeviceGetMemoryInfo" not in nvml.calls
    info = backend.describe()
    assert info["name"] == "Fake GPU" and info["uuid"] == UUID0 and info["mig"] is False
    assert info["memory_info_version"] == 2 and info["unavailable"] == {} and info["transient_errors"] == {}
    assert set(info["metrics"]) == set(EXPECTED) | set(GPM)


def test_nvml_init_and_shutdown_balance(monkeypatch):
    nvml = fake_nvml()
    backend, note = make_backend("cuda:0", nvml=nvml)
    assert isinstance(backend, NvmlBackend) and note is None
    backend.close()
    assert nvml.calls["nvmlInit"] == nvml.calls["nvmlShutdown"] == 1


# How each call is named in an unavailable reason; device memory fails in both structs to be unavailable.
REASON_NAMES = {"nvmlDeviceGetMemoryInfo_v2": "nvmlDeviceGetMemoryInfo",
                "nvmlDeviceGetClockInfo": "nvmlDeviceGetClockInfo(NVML_CLOCK_SM)",
                "nvmlDeviceGetTemperature": "nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)"}
FALLBACKS = {"nvmlDeviceGetMemoryInfo_v2": "nvmlDeviceGetMemoryInfo",
             "nvmlDeviceGetCurrentClocksEventReasons": "nvmlDeviceGetCurrentClocksThrottleReasons"}
# the counter advances; pid 4242 is not on the fake GPU; GPM values need a previous GPM sample 100 ms before
VARYING = ("energy_mj", "process_memory_bytes", *GPM)


@pytest.mark.parametrize("error", [NotSupported, NoPermission, FunctionNotFound])
@pytest.mark.parametrize("call", CALLS)
def test_one_unsupported_metric_degrades_alone(call, error):
    fail = {call: error()}
    if call in FALLBACKS:  # else the older call would be used instead
        fail[FALLBACKS[call]] = error()
    nvml = fake_nvml(fail=fail)
    backend = backend_on(nvml)
    first, second = backend.sample(), backend.sample()
    lost = CALLS[call]
    for sample in (first, second):
        assert not set(lost) & set(sample)
        assert {k: v for k, v in sample.items() if k not in VARYING} == {
            k: v for k, v in EXPECTED.items() if k not in lost and k not in VARYING}
    assert nvml.calls[call] == 1  # not asked again
    assert backend.unavailable == {m: f"{REASON_NAMES.get(call, call)}: {error.text}" for m in lost}
    assert backend.describe()["unavailable"] == backend.unavailable
    assert not set(lost) & set(backend.describe()["metrics"])


@pytest.mark.parametrize("error", [NotSupported, NoPermission])
def test_device_memory_unsupported_in_both_structs_is_unavailable(error):
    nvml = fake_nvml(fail={"nvmlDeviceGetMemoryInfo_v2": error(), "nvmlDeviceGetMemoryInfo": error()})
    backend = backend_on(nvml)
    first, second = backend.sample(), backend.sample()
    assert "device_memory_used_bytes" not in first and "device_memory_used_bytes" not in second
    assert backend.unavailable == {"device_memory_used_bytes": f"nvmlDeviceGetMemoryInfo: {error.text}"}
    assert first["gpu_util_percent"] == 87.0


def test_bindings_without_a_call_mark_only_that_metric_unavailable():
    nvml = fake_nvml()
    del nvml.nvmlDeviceGetTotalEnergyConsumption  # nvidia-ml-py older than the call
    backend = backend_on(nvml)
    sample = backend.sample()
    assert "energy_mj" not in sample and sample["power_w"] == 250.5
    assert backend.unavailable["energy_mj"].startswith("nvidia-ml-py: ")


@pytest.mark.parametrize("error", [Unknown, GpuIsLost])
@pytest.mark.parametrize("call", CALLS)
def test_an_error_mid_run_drops_one_value_then_recovers(call, error):
    nvml = fake_nvml(fail={call: [None, error(), None]})  # the second call of three fails
    backend = backend_on(nvml)
    before, during, after = backend.sample(), backend.sample(), backend.sample()
    lost = CALLS[call]
    for metric in lost:
        assert before[metric] is not None and during[metric] is None and after[metric] is not None
    assert all(during[m] is not None for m in EXPECTED if m not in lost and m != "process_memory_bytes")
    assert backend.unavailable == {}
    assert backend.describe()["transient_errors"] == {m: {"count": 1, "last": f"{error.__name__}: {error.text}"}
                                                      for m in lost}
    if call == "nvmlDeviceGetMemoryInfo_v2":
        assert backend.describe()["memory_info_version"] == 2  # a transient error is no reason to leave v2


def test_process_memory_not_available_is_none_not_zero(tree):
    nvml = fake_nvml(process_memory=(None, None))  # NVML_VALUE_NOT_AVAILABLE: the bindings return None
    backend = backend_on(nvml, tree)
    assert backend.sample()["process_memory_bytes"] is None


def test_process_memory_before_the_worker_uses_the_gpu_is_zero(tree):
    nvml = fake_nvml()
    backend = backend_on(nvml, tree)
    nvml.pids = []  # only another (visible) process on the GPU
    assert backend.sample()["process_memory_bytes"] == 0.0


def test_process_memory_behind_a_pid_namespace_is_none_with_a_note(tree):
    nvml = fake_nvml()
    backend = backend_on(nvml, tree)
    nvml.pids = []
    nvml.other_pid = next(p for p in range(4_000_000, 4_100_000) if not psutil.pid_exists(p))
    assert backend.sample()["process_memory_bytes"] is None
    assert any("PID namespace" in n for n in backend.describe()["notes"])


def test_memory_v2_falls_back_to_v1_when_the_bindings_lack_it():
    nvml = fake_nvml()
    del nvml.nvmlMemory_v2
    backend = backend_on(nvml)
    assert backend.sample()["device_memory_used_bytes"] == 3.2e9
    info = backend.describe()
    assert info["memory_info_version"] == 1 and "nvmlMemory_v2" in info["memory_info_note"]


def test_memory_v2_falls_back_to_v1_when_the_call_takes_no_version():
    nvml = fake_nvml()
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=3_200_000_000)  # old signature
    backend = backend_on(nvml)
    assert backend.sample()["device_memory_used_bytes"] == 3.2e9
    assert backend.describe()["memory_info_version"] == 1


@pytest.mark.parametrize("error", [FunctionNotFound, VersionMismatch, NotSupported])
def test_memory_v2_refused_by_the_driver_falls_back_to_v1_in_the_same_sample(error):
    nvml = fake_nvml(fail={"nvmlDeviceGetMemoryInfo_v2": error()})
    backend = backend_on(nvml)
    assert backend.sample()["device_memory_used_bytes"] == 3.2e9
    assert backend.sample()["device_memory_used_bytes"] == 3.2e9
    assert nvml.calls["nvmlDeviceGetMemoryInfo_v2"] == 1 and nvml.calls["nvmlDeviceGetMemoryInfo"] == 2
    info = backend.describe()
    assert info["memory_info_version"] == 1 and error.text in info["memory_info_note"]
    assert "device_memory_used_bytes" not in info["unavailable"]


def test_throttle_reasons_use_the_older_call_when_the_driver_lacks_the_new_one():
    nvml = fake_nvml(fail={"nvmlDeviceGetCurrentClocksEventReasons": FunctionNotFound()})
    backend = backend_on(nvml)
    assert backend.sample()["throttle_reasons"] == 0x40 and backend.sample()["throttle_reasons"] == 0x40
    assert nvml.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1 and backend.unavailable == {}
    nvml = fake_nvml()
    del nvml.nvmlDeviceGetCurrentClocksEventReasons  # bindings older than the rename
    assert backend_on(nvml).sample()["throttle_reasons"] == 0x40


# --- GPM (Hopper and newer) -------------------------------------------------------------------------------------------

def gpm_of(sample):
    return {k: v for k, v in sample.items() if k in GPM}


def test_gpm_metrics_come_from_the_last_two_samples():
    """Each period reads one GPM sample; its values are nvmlGpmMetricsGet over the kept sample and the new one: none
    in the first period, then the activity of each interval alone."""
    nvml = fake_nvml()
    backend = backend_on(nvml)
    backend.gpm_min_interval_s = 0.0  # the fake GPU refreshes at once
    assert gpm_of(backend.sample()) == NO_GPM
    nvml.gpm_activity[GPM_SM_UTIL] = 80.0
    assert gpm_of(backend.sample()) == {**GPM, "sm_active_percent": 80.0}
    nvml.gpm_activity.update({GPM_SM_UTIL: 10.0, GPM_ANY_TENSOR_UTIL: 0.0})
    assert gpm_of(backend.sample()) == {**GPM, "sm_active_percent": 10.0, "tensor_active_percent": 0.0}
    assert nvml.calls["nvmlGpmSampleGet"] == 3 and nvml.calls["nvmlGpmMetricsGet"] == 2
    assert nvml.calls["nvmlGpmQueryDeviceSupport"] == 1 and len(nvml.gpm_buffers) == 2  # two buffers, reused
    backend.close()
    assert all(b.freed for b in nvml.gpm_buffers) and nvml.calls["nvmlGpmSampleFree"] == 2


def test_gpm_samples_are_read_more_than_100_ms_apart():
    nvml = fake_nvml()
    backend = backend_on(nvml)
    assert gpm_of(backend.sample()) == NO_GPM
    assert gpm_of(backend.sample()) == NO_GPM  # too soon: no read; the interval goes on
    assert nvml.calls["nvmlGpmSampleGet"] == 1
    time.sleep(0.12)
    assert gpm_of(backend.sample()) == GPM
    times = nvml.gpm_sample_times
    assert len(times) == 2 and times[1] - times[0] > 0.1


def test_gpm_on_a_gpu_older_than_hopper_is_unavailable_with_the_reason():
    nvml = fake_nvml(gpm=False)  # nvmlGpmQueryDeviceSupport: isSupportedDevice 0
    backend = backend_on(nvml)
    first, second = backend.sample(), backend.sample()
    for sample in (first, second):
        assert not set(GPM) & set(sample) and sample["gpu_util_percent"] == 87.0
    assert backend.unavailable == dict.fromkeys(
        GPM, "nvmlGpmQueryDeviceSupport: isSupportedDevice 0 (GPM needs a Hopper or newer GPU)")
    assert nvml.calls["nvmlGpmQueryDeviceSupport"] == 1 and "nvmlGpmSampleAlloc" not in nvml.calls
    assert not set(GPM) & set(backend.describe()["metrics"])
    backend.close()


@pytest.mark.parametrize("call, error, reason", [
    ("nvmlGpmQueryDeviceSupport", FunctionNotFound, "nvmlGpmQueryDeviceSupport: Function Not Found"),  # old driver
    ("nvmlGpmSampleAlloc", FunctionNotFound, "nvmlGpmSampleAlloc: Function Not Found"),
    ("nvmlGpmSampleGet", NoPermission, "nvmlGpmSampleGet: Insufficient Permissions"),  # profiling for admins only
    ("nvmlGpmMetricsGet", NotSupported, "nvmlGpmMetricsGet: Not Supported"),
])
def test_gpm_refused_by_the_driver_is_unavailable_with_the_reason(call, error, reason):
    nvml = fake_nvml(fail={call: error()})
    backend = backend_on(nvml)
    backend.gpm_min_interval_s = 0.0
    samples = [backend.sample() for _ in range(3)]
    assert backend.unavailable == dict.fromkeys(GPM, reason)
    assert nvml.calls[call] == 1  # not asked again
    assert all(not set(GPM) & set(s) for s in samples[1:]) and all(s["power_w"] == 250.5 for s in samples)
    backend.close()
    assert all(b.freed for b in nvml.gpm_buffers)


def test_gpm_buffers_allocated_before_a_refusal_are_freed():
    nvml = fake_nvml(fail={"nvmlGpmSampleAlloc": [None, NoPermission()]})  # the second buffer is refused
    backend = backend_on(nvml)
    assert not set(GPM) & set(backend.sample())
    assert len(nvml.gpm_buffers) == 1 and nvml.gpm_buffers[0].freed
    assert backend.unavailable["sm_active_percent"] == "nvmlGpmSampleAlloc: Insufficient Permissions"


@pytest.mark.parametrize("missing", ["nvmlGpmQueryDeviceSupport", "c_nvmlGpmMetricsGet_t", "NVML_GPM_METRIC_SM_UTIL"])
def test_bindings_without_gpm_mark_it_unavailable(missing):
    nvml = fake_nvml()
    delattr(nvml, missing)  # nvidia-ml-py older than GPM
    backend = backend_on(nvml)
    sample = backend.sample()
    assert not set(GPM) & set(sample) and sample["gpu_util_percent"] == 87.0
    assert set(backend.unavailable) == set(GPM)
    assert all(r.startswith("nvidia-ml-py: ") and missing in r for r in backend.unavailable.values())
    assert "nvmlGpmSampleAlloc" not in nvml.calls


def test_a_gpm_metric_the_gpu_lacks_is_unavailable_alone():
    nvml = fake_nvml(gpm_unsupported={GPM_DRAM_BW_UTIL})  # its nvmlReturn in nvmlGpmMetricsGet: Not Supported
    backend = backend_on(nvml)
    backend.gpm_min_interval_s = 0.0
    backend.sample()
    second, third = backend.sample(), backend.sample()
    expected = {k: v for k, v in GPM.items() if k != "dram_bw_util_percent"}
    assert gpm_of(second) == gpm_of(third) == expected
    assert backend.unavailable == {"dram_bw_util_percent": "nvmlGpmMetricsGet(NVML_GPM_METRIC_DRAM_BW_UTIL): "
                                                           "Not Supported"}


def test_a_gpm_error_mid_run_drops_one_value_then_recovers():
    nvml = fake_nvml(fail={"nvmlGpmSampleGet": [None, Unknown(), None]})
    backend = backend_on(nvml)
    backend.gpm_min_interval_s = 0.0
    first, during, after = backend.sample(), backend.sample(), backend.sample()
    assert gpm_of(first) == gpm_of(during) == NO_GPM and gpm_of(after) == GPM
    assert backend.unavailable == {}
    assert backend.describe()["transient_errors"] == dict.fromkeys(GPM, {"count": 1, "last": "NVMLError_Unknown: "
                                                                                              "Unknown Error"})


@pytest.mark.parametrize("entry", [MIG_UUID, f"MIG-{UUID0}/1/0"])
def test_gpm_of_a_mig_device_reads_its_gpu_instance(monkeypatch, entry):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", entry)
    nvml = fake_nvml()
    backend, note = make_backend("cuda:0", nvml=nvml)
    assert note is None and backend.mig
    backend.attach(4242)
    backend.gpm_min_interval_s = 0.0
    backend.sample()
    assert gpm_of(backend.sample()) == GPM
    assert nvml.calls["nvmlGpmMigSampleGet"] == 2 and "nvmlGpmSampleGet" not in nvml.calls
    assert {b.source for b in nvml.gpm_buffers} == {("handle0", 1)}  # the parent GPU, GPU instance 1
    assert any("GPU instance" in n for n in backend.describe()["notes"])


def test_gpm_of_a_mig_device_refused_is_unavailable_with_the_reason(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG_UUID)
    nvml = fake_nvml(fail={"nvmlGpmMigSampleGet": NotSupported()})
    backend, _ = make_backend("cuda:0", nvml=nvml)
    backend.attach(4242)
    assert not set(GPM) & set(backend.sample())
    assert backend.unavailable["sm_active_percent"] == "nvmlGpmMigSampleGet: Not Supported"


def test_gpm_metrics_get_statistics_like_utilization():
    samples = [{"t": 0.0, **NO_GPM, "gpu_util_percent": 90.0}, {"t": 0.2, **GPM, "gpu_util_percent": 90.0},
               {"t": 0.4, **{**GPM, "sm_active_percent": 37.5}, "gpu_util_percent": 90.0}]
    stats = phase_stats(samples, [(0.0, 0.5)])
    assert stats["sm_active_percent"] == {"mean": 50.0, "median": 50.0, "max": 62.5, "count": 2, "scope": "windows"}
    assert stats["dram_bw_util_percent"]["count"] == 2 and stats["gpu_util_percent"]["count"] == 3


# --- no NVML, no device ---------------------------------------------------------------------------------------------

def test_no_nvml_falls_back_to_host_with_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml now raises ImportError
    backend, note = make_backend("cuda:0")
    assert isinstance(backend, HostBackend)
    assert note.startswith("NVML unavailable (ModuleNotFoundError") and note.endswith("sampling the host instead")
    cpu_backend, cpu_note = make_backend("cpu")
    assert isinstance(cpu_backend, HostBackend) and cpu_note is None


@pytest.mark.parametrize("error", [InvalidArgument, NotFound])
def test_no_such_device_falls_back_to_host_and_shuts_nvml_down(monkeypatch, error):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = fake_nvml(fail={"nvmlDeviceGetHandleByIndex": error()})
    backend, note = make_backend("cuda:0", nvml=nvml)
    assert isinstance(backend, HostBackend)
    assert note == f"NVML unavailable ({error.__name__}: {error.text}); sampling the host instead"
    assert nvml.calls["nvmlInit"] == nvml.calls["nvmlShutdown"] == 1


def test_a_device_beyond_the_gpus_falls_back_to_host(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = fake_nvml()
    backend, note = make_backend("cuda:1", nvml=nvml)  # one GPU: NVML raises InvalidArgument for index 1
    assert isinstance(backend, HostBackend) and "InvalidArgument" in note
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CUDA sees no GPU at all
    backend, note = make_backend("cuda:0", nvml=fake_nvml())
    assert isinstance(backend, HostBackend) and "CUDA_VISIBLE_DEVICES=''" in note


def test_nvml_init_failure_falls_back_to_host(monkeypatch):
    nvml = fake_nvml(fail={"nvmlInit": DriverNotLoaded()})
    backend, note = make_backend("cuda:0", nvml=nvml)
    assert isinstance(backend, HostBackend) and "DriverNotLoaded: Driver Not Loaded" in note
    assert "nvmlShutdown" not in nvml.calls  # nothing to shut down


def test_machine_gpus_reads_the_fake_nvml():
    from harness.measure.machine import gpus
    from tests.fakes.nvml import DRIVER, MEMORY_TOTAL, POWER_LIMIT_MW

    nvml = fake_nvml(devices=(UUID0, UUID1), name=b"NVIDIA H100 80GB HBM3")
    info = gpus(nvml)
    assert info["available"] is True and info["driver"] == DRIVER
    assert [d["uuid"] for d in info["devices"]] == [UUID0, UUID1]
    assert {d["name"] for d in info["devices"]} == {"NVIDIA H100 80GB HBM3"}
    assert {d["memory_total_bytes"] for d in info["devices"]} == {MEMORY_TOTAL}
    assert {d["power_limit_w"] for d in info["devices"]} == {POWER_LIMIT_MW / 1000}
    assert nvml.calls["nvmlInit"] == nvml.calls["nvmlShutdown"] == 1
    assert gpus(fake_nvml(fail={"nvmlInit": DriverNotLoaded()})) == {"available": False,
                                                                     "reason": "NVMLError_DriverNotLoaded: Driver Not "
                                                                               "Loaded"}


# --- which device ---------------------------------------------------------------------------------------------------

def test_cuda_visible_devices_maps_to_nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert nvml_visible_index("cuda:3") == 3 and nvml_visible_index("cuda") == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert nvml_visible_index("cuda:0") == 2  # read from the environment
    assert nvml_visible_index("cuda:1", "3,1") == 1
    assert nvml_visible_index("cuda:0", "2,3") == 2
    assert nvml_visible_index("cuda:0", " 2, 3 ") == 2
    assert nvml_visible_index("cuda:0", "GPU-abc,1") == "GPU-abc"
    assert nvml_visible_index("cuda:1", "GPU-abc,1") == 1
    assert nvml_visible_index("cuda:0", MIG_UUID) == MIG_UUID
    assert nvml_visible_index("cuda:0", f"MIG-{UUID0}/1/0") == f"MIG-{UUID0}/1/0"
    assert nvml_visible_index("cuda:1", "0,2,-1,1") == 2
    for device, visible in (("cuda:2", "0,1"), ("cuda:2", "0,2,-1,1"), ("cuda:0", ""), ("cuda:0", "-1"),
                            ("cuda:0", "nonsense,0"), ("cpu", "0"), ("cuda:x", "0")):
        with pytest.raises(ValueError):
            nvml_visible_index(device, visible)


@pytest.mark.parametrize("entry", [UUID0, UUID0[:12], UUID0.upper()[:12]])
def test_a_uuid_or_unambiguous_prefix_selects_that_gpu(monkeypatch, entry):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{entry},0")
    backend, note = make_backend("cuda:0", nvml=fake_nvml(devices=(UUID1, UUID0)))
    assert note is None and backend.handle == "handle1" and backend.describe()["uuid"] == UUID0


def test_an_ambiguous_or_unknown_uuid_prefix_falls_back_to_host(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8932")  # both fake GPUs start so
    backend, note = make_backend("cuda:0", nvml=fake_nvml(devices=(UUID1, UUID0)))
    assert isinstance(backend, HostBackend) and "2 GPUs have a UUID starting with 'GPU-8932'" in note
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ffff")
    backend, note = make_backend("cuda:0", nvml=fake_nvml(devices=(UUID1, UUID0)))
    assert isinstance(backend, HostBackend) and "0 GPUs" in note


@pytest.mark.parametrize("entry", [MIG_UUID, f"MIG-{UUID0}/1/0"])
def test_a_mig_device_is_found_and_noted(monkeypatch, entry):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", entry)
    nvml = fake_nvml(fail={"nvmlDeviceGetUtilizationRates": NotSupported()})
    backend, note = make_backend("cuda:0", nvml=nvml)
    assert note is None and backend.handle == "mig-handle"
    backend.attach(4242)
    sample = backend.sample()
    info = backend.describe()
    assert info["mig"] is True and info["uuid"] == MIG_UUID and "MIG" in info["name"]
    assert any("per-process memory" in n for n in info["notes"])
    assert {"power_w", "energy_mj", "gpu_util_percent"} <= set(info["unavailable"])
    assert "power_w" not in sample and "energy_mj" not in sample and sample["device_memory_used_bytes"] == 3e9


def test_a_mig_instance_that_does_not_exist_falls_back_to_host(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"MIG-{UUID0}/2/0")
    backend, note = make_backend("cuda:0", nvml=fake_nvml())
    assert isinstance(backend, HostBackend) and "no MIG device with GPU instance 2" in note


def test_device_order_other_than_pci_bus_is_noted(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    backend, _ = make_backend("cuda:0", nvml=fake_nvml())
    assert any("CUDA_DEVICE_ORDER=FASTEST_FIRST" in n for n in backend.describe()["notes"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", UUID0)  # a UUID is unambiguous whatever the order
    backend, _ = make_backend("cuda:0", nvml=fake_nvml())
    assert backend.describe()["notes"] == []


