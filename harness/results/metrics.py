"""What each reported number is: ``Metric`` (how it is read from a typed trial record, its title, unit and meaning),
the metrics of a run by sampler backend, and a row's title. No reading of files and no formatting here; figures
derived from a record (MFU, energy per sample, the memory peak) come from ``harness.results.derived``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import adapters  # the registry of declarations: imports no framework
from harness.record.trial import TrialRecord
from harness.results import derived

MB = 1e6

#: How a metric is read from a trial record: a number, or None where the record has none.
Read = Callable[[TrialRecord], "float | None"]


@dataclass(frozen=True)
class Metric:
    """One reported quantity: how to read it from a trial record, its title, unit and meaning."""

    key: str
    title: str
    unit: str
    read: Read
    digits: int
    meaning: str
    sampler_metric: str | None = None  # the sampler metric it reads (the record's name), whose statistics carry a scope
    ci: bool = False  # show the 95% interval: of the median over repeats, or of the mean over seeds (over_seeds)
    over_seeds: bool = False  # with several seeds: the mean over seeds of each seed's median over its repeats
    optional: bool = False  # reported only when some trial has a value (e.g. NVML GPM metrics: Hopper and newer)


def title(key: str) -> str:
    """A row's title: a built-in framework's name as its declaration writes it ("pytorch" -> "PyTorch"), any other
    label as it is, with the variant kept."""
    framework, _, variant = key.partition(" (")
    declared = adapters.BUILTIN.get(framework)
    return (declared.title if declared else framework) + (f" ({variant}" if variant else "")


def scaled(read: Callable[[TrialRecord], Any], scale: float = 1.0) -> Read:
    """``read`` as a float times ``scale`` (None stays None)."""
    def value(record: TrialRecord) -> float | None:
        found = read(record)
        return None if found is None else float(found) * scale

    return value


def sampler_stat(metric: str, stat: str, scale: float = 1.0) -> Read:
    """A statistic of a sampled metric (the record's name: ``gpu_util_pct``), times ``scale``."""
    return scaled(lambda r: r.sampler.stat(metric, stat), scale)


#: NVML GPM metrics (harness.measure.nvml; Hopper and newer, nvmlGpmMetricsGet), reported where a trial has them.
GPM_METRICS = [
    Metric("sm_active", "SM activity (mean)", "%", sampler_stat("sm_active_pct", "mean"), 2,
           "mean over the timed windows of NVML GPM SM activity (NVML_GPM_METRIC_SM_UTIL): the % of SMs busy, averaged "
           "over each sampling period; unlike GPU use %, a kernel on a few SMs reads low", "sm_active_pct",
           optional=True),
    Metric("sm_occupancy", "SM occupancy (mean)", "%", sampler_stat("sm_occupancy_pct", "mean"), 2,
           "mean of NVML GPM SM occupancy (NVML_GPM_METRIC_SM_OCCUPANCY): resident warps as a % of the SMs' maximum",
           "sm_occupancy_pct", optional=True),
    Metric("tensor_active", "Tensor-pipe activity (mean)", "%", sampler_stat("tensor_active_pct", "mean"), 2,
           "mean of NVML GPM tensor-pipe activity (NVML_GPM_METRIC_ANY_TENSOR_UTIL): % of time the SMs' tensor "
           "pipes ran any tensor operation", "tensor_active_pct", optional=True),
    Metric("dram_bw", "DRAM bandwidth utilization (mean)", "%", sampler_stat("dram_bw_util_pct", "mean"), 2,
           "mean of NVML GPM DRAM bandwidth utilization (NVML_GPM_METRIC_DRAM_BW_UTIL): % of the theoretical "
           "maximum DRAM bandwidth used", "dram_bw_util_pct", optional=True),
]


def metrics_for(backend: str) -> list[Metric]:
    """The metrics reported for a run whose sampler used ``backend`` ("nvml" or "host")."""
    device = _gpu_metrics() if backend == "nvml" else _cpu_metrics()
    return device[:3] + _common_metrics() + device[3:]


def _common_metrics() -> list[Metric]:
    """Every run's: speed, accuracy, loss, compute."""
    return [
        Metric("throughput", "Throughput", "samples/s", scaled(lambda r: r.metrics.throughput_samples_per_s), 1,
               "training samples per second over the timed windows (warm-up, evaluation excluded)", ci=True),
        Metric("seconds_per_epoch", "Time per epoch", "s", scaled(lambda r: r.metrics.epoch_time_s), 3,
               "samples per epoch / throughput: one epoch's training time without warm-up and evaluation", ci=True),
        Metric("step_ms", "Step time (median)", "ms", scaled(lambda r: r.metrics.step_time_median_s, 1e3), 3,
               "median over timed windows of window time / steps in the window"),
        Metric("step_p90_ms", "Step time (p90)", "ms", scaled(lambda r: r.metrics.step_time_p90_s, 1e3), 3,
               "90th percentile of the same per-step times"),
        Metric("first_step_s", "First step (compilation included)", "s", scaled(lambda r: r.metrics.first_step_s), 3,
               "the trial's first step alone, synced on both sides: tracing, compilation, autotuning and first "
               "allocations, plus one step's work; a warm-up step, never in the throughput"),
        Metric("accuracy", "Test accuracy after the last epoch", "%", scaled(lambda r: r.metrics.test_accuracy, 100.0),
               2, "share of the test set classified correctly after the last epoch", ci=True, over_seeds=True),
        Metric("train_loss", "Training loss (last epoch)", "", scaled(lambda r: r.metrics.final_train_loss), 4,
               "mean training loss over every optimizer step since the evaluation before the last one (the last "
               "epoch's steps, with an evaluation every epoch), warm-up steps included: each step's loss is summed "
               "on the device and read outside the timed windows, so the figure does not depend on where they end",
               ci=True, over_seeds=True),
        Metric("gflops", "Achieved training compute", "GFLOP/s",
               scaled(lambda r: r.metrics.achieved_flops_per_s, 1e-9), 2,
               "throughput x training FLOPs per sample (forward and backward, 2 FLOPs per multiply-accumulate: the "
               "neutral model's counted per layer, a model of your own's by its framework's counter, none where it "
               "has none)"),
    ]


def _gpu_metrics() -> list[Metric]:
    """An NVML-sampled run's device metrics: utilization, memory layers, MFU, GPM, power and energy."""
    return [
            Metric("util", "GPU use (mean)", "%", sampler_stat("gpu_util_pct", "mean"), 2,
                   "mean of NVML utilization.gpu over the timed windows: % of time any kernel ran (not SM occupancy)",
                   "gpu_util_pct"),
            Metric("util_max", "GPU use (max)", "%", sampler_stat("gpu_util_pct", "max"), 2,
                   "max of the same samples", "gpu_util_pct"),
            Metric("memory", "GPU memory (worker, peak)", "MB", scaled(derived.gpu_memory_bytes, 1 / MB), 1,
                   "peak NVML memory of the worker process on the GPU (device memory used where NVML does not report "
                   "per-process memory); MB = 10^6 bytes", "process_memory_bytes"),
            Metric("device_memory", "GPU memory (device, peak)", "MB",
                   sampler_stat("device_memory_used_bytes", "max", 1 / MB), 1,
                   "peak NVML device memory used, all processes; MB = 10^6 bytes", "device_memory_used_bytes"),
            Metric("allocator_peak", "Framework allocator peak", "MB", scaled(
                lambda r: r.metrics.memory.allocator_peak_bytes, 1 / MB), 1,
                   "the framework's own peak of tensor memory in the measured phase (PyTorch max_memory_allocated, "
                   "TensorFlow get_memory_info peak; MXNet exposes none)"),
            Metric("mfu", "Model FLOPs utilization", "%", scaled(derived.mfu_fraction, 100.0), 2,
                   "achieved training FLOP/s over the device's dense peak in the trial's precision (tf32, bf16 "
                   "and fp16 their Tensor Core peaks; harness.measure.peaks, each with its datasheet source); empty "
                   "for a device or precision not in the table"),
            *GPM_METRICS,
            Metric("power", "Power (mean)", "W", derived.mean_power_w, 1,
                   "mean board power over the timed windows (energy / time where NVML's energy counter exists, else "
                   "the mean of NVML power samples)", "power_w"),
            Metric("energy_per_sample", "Energy per training sample", "mJ",
                   scaled(derived.energy_per_sample_j, 1e3), 3,
                   "board energy over the timed windows (NVML total-energy counter, else integrated power) / samples "
                   "trained in them; the whole board, not only this process"),
        ]


def _cpu_metrics() -> list[Metric]:
    """A host-sampled run's: CPU use and memory."""
    return [
            Metric("util", "CPU use (mean)", "%", sampler_stat("cpu_pct", "mean"), 1,
                   "mean CPU use of the worker process tree over the timed windows (psutil; 100 = one core busy)",
                   "cpu_pct"),
            Metric("util_max", "CPU use (max)", "%", sampler_stat("cpu_pct", "max"), 1, "max of the same samples",
                   "cpu_pct"),
            Metric("memory", "Memory (peak)", "MB", scaled(derived.host_memory_bytes, 1 / MB), 1,
                   "peak anonymous resident memory of the worker process tree (psutil: RSS less its file-backed and "
                   "shared pages): the heap, the framework's allocations, tensors and the dataset, not the libraries' "
                   "code, whose resident share depends on how the process started; MB = 10^6 bytes (runs recorded "
                   "before this figure: the whole RSS)", "rss_anon_bytes"),
        ]


def spec_rows(spec: dict[str, Any]) -> list[str]:
    """The row labels of a run's spec (as in run.json), in the spec's order: a framework entry's label, else its
    name."""
    return [item if isinstance(item, str) else (item.get("label") or item["name"]) for item in spec["frameworks"]]
