"""Figures derived from a trial record, computed here and nowhere else: model FLOPs utilization (``mfu``), energy
per sample, the report's peak memory and mean power. Records keep what was measured; these are read from it (a
record of an older version that stored an MFU or an energy per sample gets the same figure from here)."""

from __future__ import annotations

from dataclasses import dataclass

from harness.measure import peaks
from harness.record.trial import TrialRecord


@dataclass(frozen=True)
class Mfu:
    """Model FLOPs utilization of a GPU trial: ``fraction`` = achieved training FLOP/s / ``peak_flops_per_s`` (the
    device's dense peak in the trial's precision, N x that for a data-parallel trial on N GPUs, from ``source``), or
    only ``note`` saying why there is none (a device or precision not in ``harness.measure.peaks``)."""

    fraction: float | None
    peak_flops_per_s: float | None = None
    source: str | None = None
    note: str | None = None


def mfu(record: TrialRecord) -> Mfu | None:
    """The MFU of a GPU trial that achieved FLOP/s (``metrics.achieved_flops_per_s``) on a device named in
    ``harness.measure.peaks`` (the name NVML reported, ``sampler.name``), against the peak of the trial's precision
    (mixed precision: the low precision's, where the matrix work runs); a device or precision not in the table: an
    ``Mfu`` with only its ``note`` (e.g. "unknown device: no peak (NVIDIA L40S)"); None for a CPU trial or one
    without achieved FLOP/s. A data-parallel trial achieves its FLOP/s on N GPUs: its peak is N x the device's."""
    achieved = record.metrics.achieved_flops_per_s
    if not achieved or not record.device.startswith("cuda"):
        return None
    name = record.sampler.name
    found = peaks.lookup(name, record.precision)
    if found is None:
        return Mfu(None, note=peaks.missing(name, record.precision))
    total = found[0] * max(1, record.data_parallel)
    return Mfu(achieved / total, total, found[1])


def mfu_fraction(record: TrialRecord) -> float | None:
    found = mfu(record)
    return None if found is None else found.fraction


def energy_j(record: TrialRecord) -> float | None:
    """Board energy over the timed windows, joules (``sampler.energy``), None without a reading."""
    return None if record.sampler.energy is None else record.sampler.energy.energy_j


def energy_per_sample_j(record: TrialRecord) -> float | None:
    """Board energy over the timed windows / the samples trained in them, joules per sample."""
    joules, samples = energy_j(record), record.metrics.measured_samples
    return joules / samples if joules is not None and samples else None


def mean_power_w(record: TrialRecord) -> float | None:
    """Mean board power over the timed windows: energy / time where NVML's energy reading exists, else the mean of
    the power samples."""
    energy = record.sampler.energy
    if energy is not None and energy.mean_power_w is not None:
        return energy.mean_power_w
    return record.sampler.stat("power_w", "mean")


def peak_memory_bytes(record: TrialRecord) -> float | None:
    """The report's memory figure: the worker's NVML process memory on a GPU (the device's used memory where NVML
    has no per-process figure), ``host_memory_bytes`` on the CPU; peaks over the timed windows."""
    for metric in ("process_memory_bytes", "device_memory_used_bytes"):
        if (value := record.sampler.stat(metric, "max")) is not None:
            return value
    return host_memory_bytes(record)


def host_memory_bytes(record: TrialRecord) -> float | None:
    """On the CPU: the peak anonymous resident memory of the worker's process tree over the timed windows (its heap,
    the framework's allocations, tensors and the dataset; not the libraries' file-backed pages, whose resident count
    depends on how the process started: a worker forked from a preloaded parent faults in only the pages it touches,
    ``harness.execution.forkserver``); for a run recorded before that figure existed, the whole resident memory."""
    for metric in ("rss_anon_bytes", "rss_bytes"):
        if (value := record.sampler.stat(metric, "max")) is not None:
            return value
    return None


def gpu_memory_bytes(record: TrialRecord) -> float | None:
    """On a GPU: the worker's NVML process memory, else the device's used memory (peaks over the timed windows)."""
    for metric in ("process_memory_bytes", "device_memory_used_bytes"):
        if (value := record.sampler.stat(metric, "max")) is not None:
            return value
    return None
