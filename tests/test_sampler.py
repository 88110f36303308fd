"""The sampler: the host backend on a real busy process, the NVML backend against a fake NVML module (the hardware
boundary), and gpu-marked tests against the real NVML."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types

import psutil
import pytest

from harness.execution.protocol import Payload
from harness.measure import host as host_module
from harness.measure.energy import COUNTER_UPDATE_S, POWER_AVERAGING_S, energy_over_windows, throttle_summary
from harness.measure.host import HostBackend
from harness.measure.nvml import NvmlBackend, nvml_visible_index
from harness.measure.sampler import (
    DEFAULT_INTERVAL_S,
    MIN_EDGE_GAP_S,
    Sampler,
    interval_warning,
    make_backend,
    phase_stats,
)
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

BUSY = "import time\nx = bytearray(80_000_000)\nend = time.time() + 30\nwhile time.time() < end: pass\n"


def test_host_backend_lists_the_process_tree_at_most_once_per_refresh_period(monkeypatch):
    """Listing children walks /proc; between refreshes a sample reads only the known processes, and a child that
    appears is counted from the next refresh on."""
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    child = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        listed = []
        real = host_module.process_tree

        def counting(pid):
            listed.append(pid)
            return real(pid) + ([psutil.Process(child.pid)] if len(listed) > 1 else [])  # the child "appears" later

        monkeypatch.setattr(host_module, "process_tree", counting)
        backend = HostBackend(tree_refresh_s=0.3)
        backend.attach(parent.pid)
        time.sleep(0.5)  # the child allocates its 80 MB meanwhile
        first = [backend.sample() for _ in range(5)]  # the first lists again (0.3 s passed), the rest reuse it
        assert len(listed) == 2
        assert all(s["rss_bytes"] > 80e6 for s in first)  # parent + child
        time.sleep(0.1)
        backend.sample()
        assert len(listed) == 2
    finally:
        for proc in (parent, child):
            proc.kill()
            proc.wait()


def _cpu_seconds(pid):
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def test_host_backend_sees_a_busy_process_and_its_memory():
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        sampler = Sampler(HostBackend(), interval_s=0.05)
        time.sleep(0.5)  # let it allocate
        sampler.start(proc.pid)
        time.sleep(0.2)
        cpu0, t0 = _cpu_seconds(proc.pid), time.monotonic()
        time.sleep(1.0)
        cpu1, t1 = _cpu_seconds(proc.pid), time.monotonic()
        sampler.stop()
    finally:
        proc.kill()
        proc.wait()
    samples = sampler.samples
    assert len(samples) >= 10
    stamps = [s["t"] for s in samples]
    assert stamps == sorted(stamps)
    stats = phase_stats(samples, [(t0, t1)])
    # one core spinning: ~100%, less on a loaded machine; the sampler must agree with the process's own CPU time
    expected = 100 * (cpu1 - cpu0) / (t1 - t0)
    assert expected > 20 and abs(stats["cpu_percent"]["mean"] - expected) < 20, (stats["cpu_percent"], expected)
    assert stats["rss_bytes"]["max"] > 80e6
    assert len(sampler.call_seconds) == len(samples) and all(0 <= c < 1 for c in sampler.call_seconds)


def test_phase_stats_only_counts_samples_inside_windows():
    samples = [{"t": float(t), "x": float(t)} for t in range(10)]
    stats = phase_stats(samples, [(2.0, 4.0), (8.0, 8.5)])
    assert stats["x"] == {"mean": (2 + 3 + 4 + 8) / 4, "median": 3.5, "max": 8.0, "count": 4, "scope": "windows"}
    assert phase_stats(samples, [(20.0, 21.0)])["x"] == {"mean": None, "median": None, "max": None, "count": 0,
                                                         "scope": "none"}


def test_phase_stats_falls_back_to_the_span_when_windows_are_shorter_than_the_interval():
    samples = [{"t": float(t), "x": float(t)} for t in range(10)]
    stats = phase_stats(samples, [(2.1, 2.2), (4.5, 4.6), (6.1, 6.3)])  # no sample inside any window
    assert stats["x"] == {"mean": 4.5, "median": 4.5, "max": 6.0, "count": 4, "scope": "span"}  # t = 3, 4, 5, 6


def test_phase_stats_leaves_out_the_counter_and_the_bitmask():
    samples = [{"t": float(t), "x": 1.0, "energy_mj": 1000 * t, "throttle_reasons": 4} for t in range(5)]
    assert set(phase_stats(samples, [(0.0, 4.0)])) == {"x"}


def test_throttle_summary_shares_each_reason():
    samples = [{"t": 1.0, "throttle_reasons": 0x4}, {"t": 2.0, "throttle_reasons": 0x4 | 0x40},
               {"t": 3.0, "throttle_reasons": 0x0}, {"t": 4.0, "throttle_reasons": None},
               {"t": 9.0, "throttle_reasons": 0x8}]  # outside the window
    summary = throttle_summary(samples, [(0.5, 4.5)])
    assert summary == {"count": 3, "scope": "windows", "any_mask": 0x44,
                       "share": {"sw_power_cap": 2 / 3, "hw_thermal_slowdown": 1 / 3}}
    assert throttle_summary([{"t": 1.0, "x": 1.0}], [(0.0, 2.0)]) is None


def test_sampler_stops_within_an_interval_even_with_a_slow_backend():
    class Slow(HostBackend):
        def sample(self):
            time.sleep(0.2)
            return {"cpu_percent": 1.0}

    sampler = Sampler(Slow(), interval_s=0.5)
    sampler.start(1)
    time.sleep(0.3)
    started = time.monotonic()
    assert sampler.stop() is True
    assert time.monotonic() - started < 0.5 + 0.2 + 0.1


def test_stop_while_a_backend_call_blocks_is_bounded_and_drops_the_late_sample():
    release = threading.Event()
    entered = threading.Event()

    class Stuck(HostBackend):
        def sample(self):
            entered.set()
            release.wait(10)
            return {"cpu_percent": 1.0}

    sampler = Sampler(Stuck(), interval_s=0.05)
    sampler.start(1)
    assert entered.wait(2)
    started = time.monotonic()
    assert sampler.stop(join_timeout_s=0.3) is False  # the call is still blocked: stop gives up
    assert 0.25 < time.monotonic() - started < 0.6
    assert "abandoned" in sampler.errors[-1]
    before = len(sampler.samples)
    release.set()  # the call returns after stop(): its sample must not land in the finished run
    sampler._thread.join(2)
    assert not sampler._thread.is_alive() and len(sampler.samples) == before == 0


def test_sampler_survives_a_backend_that_raises():
    class Broken(HostBackend):
        def sample(self):
            raise RuntimeError("driver went away")

    sampler = Sampler(Broken(), interval_s=0.05)
    sampler.start(1)
    time.sleep(0.2)
    sampler.stop()
    assert sampler.samples and sampler.errors[0] == "RuntimeError: driver went away"


def test_interval_warning_below_50_ms_only():
    assert interval_warning(DEFAULT_INTERVAL_S) is None and interval_warning(0.05) is None
    assert interval_warning(None) is None
    warning = interval_warning(0.01)
    assert warning is not None and "\n" not in warning and warning.startswith("0.01 s is below 50 ms")


# --- the NVML backend against the fake NVML (tests/fakes/nvml.py) ----------------------------------------------------

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


@pytest.fixture
def tree():
    """A real process with a child: the worker's process tree."""
    code = ("import subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            "print(c.pid, flush=True)\ntime.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    yield proc.pid, child
    os.kill(child, 9)
    proc.kill()
    proc.wait()


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


# --- energy -----------------------------------------------------------------------------------------------------------

def test_energy_from_the_counter_interpolates_at_the_window_edges():
    # 200 W for t in [0, 10] (200 J/s = 200_000 mJ/s), read every 0.5 s; then 50 W
    samples = [{"t": 0.5 * i, "energy_mj": 100_000 * i, "power_w": 1.0} for i in range(21)]
    samples += [{"t": 10.0 + 0.5 * i, "energy_mj": 2_000_000 + 25_000 * i} for i in range(1, 5)]
    samples.append({"t": 3.3, "energy_mj": None})  # a transient gap is skipped
    windows = [(1.25, 3.75), (9.0, 11.0), (4.0, 4.05)]  # 2.5 s at 200 W; 1 s at 200 W + 1 s at 50 W; 0.05 s
    energy = energy_over_windows(samples, windows)
    assert energy["method"] == "counter"
    assert energy["joules"] == pytest.approx(500 + 250 + 10)
    assert energy["seconds"] == pytest.approx(4.55) and energy["windows"] == 3
    assert energy["short_windows"] == 1 and energy["short_window_s"] == COUNTER_UPDATE_S
    assert energy["mean_power_w"] == pytest.approx(760 / 4.55) and energy["unbracketed_edges"] == 0


def test_energy_from_power_integration_when_there_is_no_counter():
    # power ramps 100 -> 300 W over [0, 2], then holds 300 W; trapezoids are exact for piecewise-linear power
    samples = [{"t": 0.0, "power_w": 100.0}, {"t": 1.0, "power_w": 200.0}, {"t": 2.0, "power_w": 300.0},
               {"t": 4.0, "power_w": 300.0}, {"t": 3.0, "power_w": None, "energy_mj": None}]
    energy = energy_over_windows(samples, [(0.5, 1.5), (2.0, 4.0), (3.0, 3.5)])
    # [0.5, 1.5]: mean 200 W -> 200 J; [2, 4]: 600 J; [3, 3.5]: 150 J
    assert energy["method"] == "power_integral" and energy["joules"] == pytest.approx(950.0)
    assert energy["short_window_s"] == POWER_AVERAGING_S and energy["short_windows"] == 1  # 0.5 s < 1 s
    assert energy["mean_power_w"] == pytest.approx(950 / 3.5)


def test_energy_counts_edges_outside_the_readings():
    samples = [{"t": 1.0, "power_w": 100.0}, {"t": 2.0, "power_w": 100.0}]
    energy = energy_over_windows(samples, [(0.0, 3.0)])
    assert energy["unbracketed_edges"] == 2 and energy["joules"] == pytest.approx(300.0)  # held flat outside


def test_energy_counter_that_goes_backwards_is_not_trusted():
    samples = [{"t": 0.0, "energy_mj": 5_000, "power_w": 10.0}, {"t": 1.0, "energy_mj": 10, "power_w": 10.0}]
    energy = energy_over_windows(samples, [(0.0, 1.0)])
    assert energy["method"] == "power_integral" and energy["joules"] == pytest.approx(10.0)
    assert "backwards" in energy["note"]


def test_energy_without_readings_or_windows_is_none():
    assert energy_over_windows([{"t": 1.0, "cpu_percent": 50.0}], [(0.0, 2.0)]) == {
        "joules": None, "method": None, "seconds": 2.0, "short_windows": 0, "short_window_s": None, "windows": 1,
        "unbracketed_edges": 0, "mean_power_w": None}
    assert energy_over_windows([{"t": 1.0, "energy_mj": 5}], [])["joules"] is None
    one = energy_over_windows([{"t": 1.0, "energy_mj": 5, "power_w": 20.0}], [(0.0, 2.0)])  # one counter reading
    assert one["method"] == "power_integral" and one["joules"] == pytest.approx(40.0)


# --- edge samples -------------------------------------------------------------------------------------------------

def test_poke_takes_a_tagged_sample_at_once():
    sampler = Sampler(HostBackend(), interval_s=5.0)  # periodic samples would be 5 s apart
    sampler.start(1)
    time.sleep(0.1)  # more than MIN_EDGE_GAP_S after the first periodic sample
    poked_at = time.monotonic()
    sampler.poke("end")
    time.sleep(0.1)
    sampler.stop()
    edges = [s for s in sampler.samples if s.get("edge") == "end"]
    assert len(edges) == 1 and 0 <= edges[0]["t"] - poked_at < 0.05
    assert "cpu_percent" in edges[0]


def test_pokes_closer_than_the_minimum_gap_are_dropped_and_a_dropped_end_is_deferred():
    sampler = Sampler(HostBackend(), interval_s=10.0)
    sampler.start(1)
    time.sleep(0.1)
    sampler.poke("start")
    sampler.poke("end")  # a window of almost no time: the end sample waits for the gap to pass
    sampler.poke("start")  # the next window opens at once: dropped
    sampler.poke("end")  # merges into the deferred end sample
    time.sleep(MIN_EDGE_GAP_S + 0.05)
    sampler.poke("start")  # far enough from the last edge sample: taken
    time.sleep(0.05)
    sampler.stop()
    assert [s.get("edge") for s in sampler.samples] == [None, "start", "end", "start"]
    start, end = sampler.samples[1]["t"], sampler.samples[2]["t"]
    assert MIN_EDGE_GAP_S - 0.002 <= end - start < MIN_EDGE_GAP_S + 0.03
    assert sampler.dropped_pokes == 3


def test_edge_samples_decide_membership():
    samples = [{"t": 1.0, "x": 100.0},             # before the window
               {"t": 2.01, "edge": "start", "x": 50.0},  # baseline: describes the time before the window
               {"t": 2.5, "x": 7.0},
               {"t": 3.02, "edge": "end", "x": 9.0},     # taken just after the end: describes the window
               {"t": 3.3, "x": 100.0},
               {"t": 4.0, "edge": "end", "x": 1.0}]      # an end sample too late for the window
    stats = phase_stats(samples, [(2.0, 3.0)])
    assert stats["x"]["count"] == 2 and stats["x"]["mean"] == 8.0 and stats["x"]["scope"] == "windows"


def test_edge_sampling_measures_a_window_shorter_than_the_interval():
    """A real busy process, a 0.3 s window, a 10 s interval: the end-edge sample alone describes the window."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        sampler = Sampler(HostBackend(), interval_s=10.0)
        time.sleep(0.3)
        sampler.start(proc.pid)
        time.sleep(0.05)
        start, cpu0 = time.monotonic(), _cpu_seconds(proc.pid)
        sampler.poke("start")
        time.sleep(0.3)
        end, cpu1 = time.monotonic(), _cpu_seconds(proc.pid)
        sampler.poke("end")
        time.sleep(0.05)
        sampler.stop()
    finally:
        proc.kill()
        proc.wait()
    stats = phase_stats(sampler.samples, [(start, end)])
    assert stats["cpu_percent"]["count"] == 1 and stats["cpu_percent"]["scope"] == "windows"
    expected = 100 * (cpu1 - cpu0) / (end - start)  # ~100, less on a loaded machine
    assert expected > 20 and abs(stats["cpu_percent"]["mean"] - expected) < 25, (stats["cpu_percent"], expected)


# --- the launcher's side ------------------------------------------------------------------------------------------

def _fault_trial(tmp_path, batch=64, epochs=3):
    from harness.plan import checked_spec as validate
    from harness.plan import plan
    from tests.conftest import base_spec

    spec = validate(base_spec(frameworks=["fault"], batch_sizes=[batch], epochs=epochs, warmup_steps=0),
                    tmp_path / "s.yaml")
    return spec, plan(spec, "cpu")[0]


def test_a_worker_can_run_without_any_sampler(fault_adapter, monkeypatch, tmp_path):
    from harness.execution import launcher

    monkeypatch.setattr(launcher, "make_backend", lambda device: pytest.fail("no backend may be made"))
    spec, trial = _fault_trial(tmp_path)
    threads_seen = set()

    def on_event(event):
        threads_seen.update(t.name for t in threading.enumerate())

    outcome = launcher.run_worker(Payload(trial=trial, spec=spec), 60, None, "cuda:0", trial.threads,
                                  on_event=on_event)
    assert outcome.status == "ok" and outcome.samples == []
    assert outcome.sampler == {"backend": None, "interval_s": None}
    assert threads_seen and "harness-sampler" not in threads_seen


def test_the_launcher_reports_energy_stats_and_throttling_from_nvml(fault_adapter, monkeypatch, tmp_path):
    """A real worker sampled through the fake NVML, whose energy counter runs at exactly 100 W."""
    from harness.execution import launcher

    monkeypatch.setenv("HARNESS_STEP_SLEEP", "*:0.01")  # 22 steps of >= 10 ms per epoch: windows of ~0.25 s
    nvml = fake_nvml()
    nvml.energy_mj = lambda: int(100_000 * time.monotonic())  # 100 W = 100_000 mJ/s
    made = {}

    def make(device):
        made["backend"] = NvmlBackend(0, nvml=nvml)
        return made["backend"], None

    monkeypatch.setattr(launcher, "make_backend", make)
    spec, trial = _fault_trial(tmp_path)
    outcome = launcher.run_worker(Payload(trial=trial, spec=spec), 60, 0.05, "cuda:0", trial.threads)
    assert outcome.status == "ok"
    info = outcome.sampler
    assert info["backend"] == "nvml" and info["uuid"] == UUID0 and info["interval_s"] == 0.05
    energy, metrics = info["energy"], outcome.result()["metrics"]
    assert energy["method"] == "counter" and energy["windows"] == 3 and energy["short_windows"] == 0
    assert energy["mean_power_w"] == pytest.approx(100.0, rel=0.02)
    assert energy["seconds"] == pytest.approx(metrics["measured_seconds"], rel=0.05)
    assert energy["joules_per_sample"] == pytest.approx(energy["joules"] / metrics["measured_samples"])
    assert info["stats"]["gpu_util_percent"]["mean"] == 87.0 and info["stats"]["power_w"]["scope"] == "windows"
    # GPM values every period at least 100 ms after the last GPM read (interval 0.05 s: about every other sample)
    gpm = info["stats"]["sm_active_percent"]
    assert gpm["mean"] == 62.5 and 1 <= gpm["count"] < info["stats"]["gpu_util_percent"]["count"]
    times = nvml.gpm_sample_times
    assert len(times) >= 3 and all(b - a > 0.1 for a, b in zip(times, times[1:]))
    assert "energy_mj" not in info["stats"] and "throttle_reasons" not in info["stats"]
    assert info["throttle"]["share"] == {"sw_power_cap": 1.0}
    assert info["sample_cost_s"]["count"] == len(outcome.samples) and info["sample_cost_s"]["median"] < 0.05
    # windows of ~0.25 s: every end is sampled; a start right after the previous end (a short evaluation between
    # epochs) may be dropped, that end sample standing for it
    edges = [s.get("edge") for s in outcome.samples if s.get("edge")]
    assert edges.count("end") == 3 and edges.count("start") + info["edge_samples_dropped"] == 3
    assert nvml.calls["nvmlShutdown"] == 1  # closed after the sampler stopped
    json.dumps(info, allow_nan=False)  # the trial record is JSON


# --- the real NVML (run with pytest -m gpu on a machine with an NVIDIA GPU) ----------------------------------------

MIB = 1 << 20
# The child below: prints "<phase> <time.monotonic()> <torch.cuda.memory_reserved()>" at each step, waits for a line on
# stdin before going on.
TORCH_CHILD = """
import sys, time, torch
def say(phase):
    torch.cuda.synchronize()
    print(phase, time.monotonic(), torch.cuda.memory_reserved(), flush=True)
    sys.stdin.readline()
torch.zeros(1, device="cuda")  # the CUDA context and the caching allocator's first block
say("context")
x = torch.empty(1024 * 1024 * 1024, dtype=torch.uint8, device="cuda")  # 1 GiB more
say("allocated")
idle_start = time.monotonic(); time.sleep(3.0); print("idle", idle_start, time.monotonic(), flush=True)
a = torch.randn(4096, 4096, device="cuda")
busy_start = time.monotonic(); end = busy_start + 4.0
while time.monotonic() < end:
    for _ in range(20): a = a @ a; a = a / a.norm()
    torch.cuda.synchronize()
print("busy", busy_start, time.monotonic(), flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def torch_child():
    pytest.importorskip("torch")
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # CUDA's cuda:0 is NVML's, as for the launcher's workers
    proc = subprocess.Popen([sys.executable, "-c", TORCH_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    yield proc
    proc.kill()
    proc.wait()


def _max_process_memory(backend, seconds=1.0):
    """The largest of a few NVML readings (the per-process figure can lag an allocation a little)."""
    readings = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        readings.append(backend.sample().get("process_memory_bytes"))
        time.sleep(0.1)
    if None in readings:
        pytest.skip(f"NVML does not attribute per-process memory here: {backend.describe()['notes']}")
    return max(readings)


@pytest.mark.gpu
def test_real_nvml_describes_and_samples_the_gpu():
    backend, note = make_backend("cuda:0")
    assert note is None, note
    backend.attach(os.getpid())
    sample = backend.sample()
    info = backend.describe()
    backend.close()
    assert info["uuid"].startswith(("GPU-", "MIG-")) and info["name"]
    assert info["memory_info_version"] in (1, 2)
    assert 0 <= sample["gpu_util_percent"] <= 100 and sample["device_memory_used_bytes"] > 0
    assert info["unavailable"] == {} or all(isinstance(r, str) for r in info["unavailable"].values())


@pytest.mark.gpu
def test_real_nvml_uuid_mapping_selects_the_same_gpu(monkeypatch):
    import pynvml

    pynvml.nvmlInit()
    try:
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    finally:
        pynvml.nvmlShutdown()
    for entry in (uuid, uuid[:12]):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", entry)
        backend, note = make_backend("cuda:0")
        assert note is None and backend.describe()["uuid"] == uuid
        backend.close()


@pytest.mark.gpu
def test_real_nvml_process_memory_matches_torch_reserved_plus_context(torch_child):
    """NVML's per-process memory = the CUDA context + what PyTorch's caching allocator reserved. The context's size
    is not known in advance (driver, GPU, lazy module loading), so it is only bounded; the exact claim is about the
    difference: 1 GiB more reserved by PyTorch is 1 GiB more in NVML, within 64 MiB."""
    backend, note = make_backend("cuda:0")
    assert note is None, note
    backend.attach(torch_child.pid)
    try:
        phase, _, reserved0 = torch_child.stdout.readline().split()
        assert phase == "context"
        nvml0 = _max_process_memory(backend)
        context = nvml0 - int(reserved0)
        assert 0 < context < 1024 * MIB, f"CUDA context {context / MIB:.0f} MiB"  # usually 250-600 MiB
        torch_child.stdin.write("\n")
        torch_child.stdin.flush()
        phase, _, reserved1 = torch_child.stdout.readline().split()
        assert phase == "allocated"
        nvml1 = _max_process_memory(backend)
        grown_nvml, grown_torch = nvml1 - nvml0, int(reserved1) - int(reserved0)
        assert grown_torch >= 1024 * MIB
        assert abs(grown_nvml - grown_torch) < 64 * MIB, (grown_nvml / MIB, grown_torch / MIB)
        assert abs(nvml1 - (int(reserved1) + context)) < 64 * MIB
    finally:
        backend.close()


def _idle_then_busy(sampler, child):
    """Samples ``child`` (the torch_child fixture) through its idle and busy phases; returns their monotonic
    (idle start, idle end, busy start, busy end) as the strings it printed."""
    sampler.start(child.pid)
    try:
        for _ in range(2):
            child.stdout.readline()
            child.stdin.write("\n")
            child.stdin.flush()
        _, idle_start, idle_end = child.stdout.readline().split()
        _, busy_start, busy_end = child.stdout.readline().split()
    finally:
        assert sampler.stop()
    return idle_start, idle_end, busy_start, busy_end


@pytest.mark.gpu
def test_real_nvml_utilization_and_energy_while_training_and_idle(torch_child):
    backend, note = make_backend("cuda:0")
    assert note is None, note
    sampler = Sampler(backend, 0.1)
    idle_start, idle_end, busy_start, busy_end = _idle_then_busy(sampler, torch_child)
    info = backend.describe()
    backend.close()
    # utilization averages the last 1/6 s..1 s: leave the first second of each phase out
    idle = phase_stats(sampler.samples, [(float(idle_start) + 1.0, float(idle_end))])
    busy = phase_stats(sampler.samples, [(float(busy_start) + 1.0, float(busy_end))])
    if "gpu_util_percent" in info["unavailable"]:
        pytest.skip(f"utilization unavailable: {info['unavailable']['gpu_util_percent']}")
    assert busy["gpu_util_percent"]["mean"] > 50, busy["gpu_util_percent"]
    assert idle["gpu_util_percent"]["mean"] < 10, idle["gpu_util_percent"]  # needs the GPU to itself
    energy = energy_over_windows(sampler.samples, [(float(busy_start), float(busy_end))])
    assert energy["method"] is not None, info["unavailable"]
    assert energy["joules"] > 0 and 10 < energy["mean_power_w"] < 2000, energy
    if energy["method"] == "counter":  # the counter and the integral of power describe the same seconds
        samples = [{k: v for k, v in s.items() if k != "energy_mj"} for s in sampler.samples]
        integral = energy_over_windows(samples, [(float(busy_start), float(busy_end))])
        assert 0.5 < integral["joules"] / energy["joules"] < 2.0, (integral, energy)


@pytest.mark.gpu
def test_real_nvml_gpm_sm_activity_while_training_and_idle(torch_child):
    """On Hopper and newer the GPM metrics have values, and SM activity is higher while a matmul loop runs than while
    the GPU idles; on older GPUs each is unavailable with a reason."""
    import pynvml

    backend, note = make_backend("cuda:0")
    assert note is None, note
    parent = (pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(backend.handle) if backend.mig else backend.handle)
    major, _ = pynvml.nvmlDeviceGetCudaComputeCapability(parent)
    sampler = Sampler(backend, 0.2)  # GPM reads more than 100 ms apart every period
    idle_start, idle_end, busy_start, busy_end = _idle_then_busy(sampler, torch_child)
    info = backend.describe()
    backend.close()
    gpm = ("sm_active_percent", "sm_occupancy_percent", "tensor_active_percent", "dram_bw_util_percent")
    reasons = {m: info["unavailable"][m] for m in gpm if m in info["unavailable"]}
    if major < 9:  # older than Hopper: no GPM
        assert set(reasons) == set(gpm) and all(isinstance(r, str) and r for r in reasons.values()), reasons
        return
    if any("Permission" in r for r in reasons.values()):
        pytest.skip(f"GPM needs profiling permission here: {reasons}")
    assert not reasons, reasons
    # each GPM value covers the period before its sample: leave the first half second of each phase out
    idle = phase_stats(sampler.samples, [(float(idle_start) + 0.5, float(idle_end))])
    busy = phase_stats(sampler.samples, [(float(busy_start) + 0.5, float(busy_end))])
    for metric in gpm:
        assert busy[metric]["count"] >= 5 and 0 <= busy[metric]["mean"] <= 100, (metric, busy[metric])
    assert busy["sm_active_percent"]["mean"] > idle["sm_active_percent"]["mean"] + 20, (busy, idle)
    assert idle["sm_active_percent"]["mean"] < 10, idle["sm_active_percent"]  # needs the GPU to itself
