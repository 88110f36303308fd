"""How the device was sampled during a trial (the record's ``sampler``): the sampler's statistics over the timed
windows, energy, throttling and, for a data-parallel trial on GPUs, each device. The sampler (``harness.measure``)
describes its backend in its own terms; ``SamplerInfo.from_measure`` is where that becomes the record, its readings'
names in the record's suffix convention (``harness.record.units.stat_name``: ``gpu_util_percent`` ->
``gpu_util_pct``). The backend's own fields (NVML ``name``, ``uuid``, ``mig``, ``notes``, ``transient_errors``,
``metrics`` ...) stay as it wrote them (``Open``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from harness.record.base import Open
from harness.record.units import stat_name


class MetricStats(Open):
    """One sampled metric over the trial's timed windows, in the metric's own unit (its name's suffix)."""

    mean: float | None = None
    median: float | None = None
    max: float | None = None
    count: int = Field(default=0, description="samples with a value that the statistics used")
    scope: str | None = Field(default=None, description=(
        "windows (samples inside the timed windows and their end-edge samples), span (windows shorter than the "
        "interval: the samples from the first window's start to the last one's end), none, or too short (a metric the "
        "driver averages over its own period, longer than the windows together: harness.measure.windows)"))


class EnergyInfo(Open):
    """Board energy over the timed windows (``harness.measure.energy.energy_over_windows``)."""

    energy_j: float | None = Field(default=None, description="joules over the timed windows")
    method: str | None = Field(default=None, description="counter (NVML's total-energy counter) or power_integral")
    duration_s: float | None = Field(default=None, description="seconds of the windows")
    mean_power_w: float | None = Field(default=None, description="energy_j / duration_s")
    windows: int | None = None
    short_windows: int | None = Field(default=None, description="windows shorter than short_window_s (approximate)")
    short_window_s: float | None = None
    unbracketed_edges: int | None = None
    note: str | None = None


class ThrottleInfo(Open):
    """Clocks-event reasons in the samples of the timed windows (``harness.measure.energy.throttle_summary``)."""

    count: int | None = None
    scope: str | None = None
    any_mask: int | None = None
    share: dict[str, float] = Field(default_factory=dict, description="reason -> fraction of samples")


class DeviceSummary(Open):
    """One GPU of a data-parallel trial over its timed windows (``harness.measure.multi_gpu.device_summaries``)."""

    index: int | None = None
    device: str | None = Field(default=None, description="as the worker numbered it")
    name: str | None = None
    memory_peak_bytes: float | None = Field(default=None, description="peak NVML memory of the trial's processes on "
                                                                      "it, else the device's (memory_source)")
    gpu_util_mean_pct: float | None = None
    energy_j: float | None = None
    energy_method: str | None = None


#: Keys the sampler (``harness.measure``) writes under another name in the record: energy's, a device summary's.
ENERGY_NAMES = {"joules": "energy_j", "seconds": "duration_s"}
DEVICE_NAMES = {"joules": "energy_j", "gpu_util_mean_percent": "gpu_util_mean_pct"}
#: What the sampler wrote that the record derives instead (``harness.results.derived``).
DERIVED = ("joules_per_sample",)


class SamplerInfo(Open):
    """The sampler's backend, statistics and energy (results/README.md lists every field)."""

    backend: str | None = Field(default=None, description="nvml or host; null when the trial ran without a sampler")
    interval_s: float | None = Field(default=None, description="seconds between periodic samples")
    name: str | None = Field(default=None, description="NVML's name of the GPU(s)")
    unavailable: dict[str, str] = Field(default_factory=dict, description="metric -> why the device, driver, "
                                        "bindings or permissions did not provide it")
    note: str | None = Field(default=None, description="why NVML was not used, if so")
    notes: list[str] = Field(default_factory=list)
    errors: list[str] = Field(default_factory=list)
    stats: dict[str, MetricStats] = Field(
        default_factory=dict,
        description="per sampled metric: host cpu_pct, rss_bytes; NVML gpu_util_pct, mem_util_pct, "
                    "device_memory_used_bytes, process_memory_bytes, power_w, sm_clock_mhz, temperature_c, and on "
                    "Hopper and newer the GPM metrics (nvmlGpmMetricsGet, "
                    "https://docs.nvidia.com/deploy/nvml-api/group__nvmlGpmFunctions.html), percent over each "
                    "sampling period: sm_active_pct (NVML_GPM_METRIC_SM_UTIL), sm_occupancy_pct "
                    "(NVML_GPM_METRIC_SM_OCCUPANCY), tensor_active_pct (NVML_GPM_METRIC_ANY_TENSOR_UTIL), "
                    "dram_bw_util_pct (NVML_GPM_METRIC_DRAM_BW_UTIL); a data-parallel trial on GPUs: these "
                    "over its devices (energy and power summed, memory the most loaded device's, utilization the "
                    "mean) and each device's as <metric>@<i>")
    energy: EnergyInfo | None = None
    throttle: ThrottleInfo | None = None
    devices: list[DeviceSummary] | None = Field(
        default=None, description="a data-parallel trial on GPUs: per device, in the order of the record's devices")
    memory_peak_over_devices_bytes: float | None = Field(
        default=None, description="a data-parallel trial on GPUs: the largest of its devices' memory_peak_bytes")

    def stat(self, metric: str, statistic: str) -> float | None:
        """One statistic (mean, median, max) of one sampled metric (the record's name), None where absent."""
        stats = self.stats.get(metric)
        value = getattr(stats, statistic, None) if stats is not None else None
        return None if value is None else float(value)

    @classmethod
    def from_measure(cls, info: dict[str, Any]) -> SamplerInfo:
        """The record's ``sampler`` from what the launcher's sampler reported (``harness.execution.launcher.
        sampler_info``, in ``harness.measure``'s names): every reading's name through ``stat_name``, energy's and
        each device's keys through ``ENERGY_NAMES`` and ``DEVICE_NAMES``, ``DERIVED`` left out. Also how an older
        record's sampler is read (``harness.record.legacy``)."""
        data = dict(info)
        if isinstance(data.get("stats"), dict):
            data["stats"] = {stat_name(k): v for k, v in data["stats"].items()}
        if isinstance(data.get("energy"), dict):
            data["energy"] = {ENERGY_NAMES.get(k, k): v for k, v in data["energy"].items() if k not in DERIVED}
        if isinstance(data.get("devices"), list):
            data["devices"] = [{DEVICE_NAMES.get(k, k): v for k, v in d.items()} if isinstance(d, dict) else d
                               for d in data["devices"]]
        return cls.model_validate(data)
