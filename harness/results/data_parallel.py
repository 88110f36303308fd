"""The report's "Data-parallel scaling" section: global throughput and scaling efficiency against the number of
devices at each per-device batch size, the peak memory (on GPUs the peak over the trial's devices, and each
device's), per framework (docs/guide/data-parallel.md)."""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np

from harness.record.trial import TrialRecord
from harness.results.metrics import MB, Read, metrics_for, title
from harness.results.sections import Paragraph, Section, simple_table
from harness.results.tables import ReportData

_DEVICE_PART = re.compile(r"^(\d+ devices?|sync bn)$")


def _row(record: TrialRecord) -> str:
    """The framework row without the devices: its label and the variant's other parts."""
    rest = [part for part in record.variant.split(", ") if part and not _DEVICE_PART.match(part)]
    label = title(record.label)
    return f"{label} ({', '.join(rest)})" if rest else label


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _key(record: TrialRecord) -> tuple[str, int, int]:
    """(row without the devices, devices, per-device batch) of a record."""
    return _row(record), record.data_parallel, record.per_device_batch_size or record.batch_size


def _cells(records: list[TrialRecord], read: Read) -> dict[tuple[str, int, int], list[float]]:
    """(row, devices, per-device batch) -> the values of ``read`` over the ok trials (repeats, seeds)."""
    out: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for record in records:
        value = read(record) if record.status == "ok" else None
        if value is not None:
            out[_key(record)].append(float(value))
    return out


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


#: Why the all-reduce's share of a step is not in the report.
ALL_REDUCE = ("The all-reduce's share of the step is not measured: each framework overlaps it with the backward "
              "pass inside its own step (PyTorch's DistributedDataParallel all-reduces each bucket of gradients as "
              "soon as the backward pass has filled it, while it computes the rest; TensorFlow's MirroredStrategy "
              "and MXNet's kvstore reduce inside the step they run; XLA schedules JAX's collectives into the "
              "compiled step), so a clock outside the step sees only the sum, and separating them would take each "
              "framework's profiler inside the timed windows. Its cost is part of the scaling efficiency.")


def _memory_words(backend: str, title_unit: str) -> str:
    """What the memory table shows, on the host or on GPUs."""
    if backend != "nvml":
        return (f"{title_unit}, all devices of the trial together: on the CPU they share the worker's memory (the "
                "ranks' resident memory summed where each device is a process), which has no per-device figure:")
    return (f"{title_unit} on the most loaded device: the peak over the trial's devices, what has to fit on one GPU "
            "(the NVML memory of the trial's processes on each GPU, the device's used memory where NVML gives none):")


def _memory_reader(data: ReportData) -> tuple[Read, str, str]:
    """(read, title, unit) of the section's memory figure: on GPUs the peak over the trial's devices
    (``sampler.memory_peak_over_devices_bytes``; a one-device trial's own figure), on the host the report's memory
    metric (the worker process tree's resident memory, every rank together)."""
    metric = next(m for m in metrics_for(data.backend) if m.key == "memory")

    def read(record: TrialRecord) -> float | None:
        peak = record.sampler.memory_peak_over_devices_bytes
        return peak / MB if peak is not None else metric.read(record)

    return read, metric.title, metric.unit


def _per_device_rows(records: list[TrialRecord], per_device: list[int]) -> list[list[str]]:
    """Rows of each device's peak memory (MB, the median over repeats per device, device 0 first) for the trials
    whose sampler watched several GPUs (``sampler.devices``)."""
    cells: dict[tuple[str, int, int], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        summaries = record.sampler.devices if record.status == "ok" else None
        for device in summaries or []:
            if device.memory_peak_bytes is not None and device.index is not None:
                cells[_key(record)][device.index].append(device.memory_peak_bytes / MB)
    rows = []
    for row, devices in sorted({(key[0], key[1]) for key in cells}):
        values = [cells.get((row, devices, batch), {}) for batch in per_device]
        rows.append([row, str(devices), *(" / ".join(_fmt(_median(v[i]), 1) for i in sorted(v)) or "-"
                                          for v in values)])
    return rows


def data_parallel_section(data: ReportData) -> Section | None:
    """Throughput (global samples/s, median over repeats) and scaling efficiency = throughput(N) / (N x
    throughput(1)) at the same per-device batch size, peak memory and, where the sampler watched each GPU, each
    device's peak memory, for each framework row and device count; None when no trial ran on more than one
    device."""
    records = data.records
    if not any(r.data_parallel > 1 for r in records):
        return None
    throughput = _cells(records, lambda r: r.metrics.throughput_samples_per_s)
    read_memory, memory_title, memory_unit = _memory_reader(data)
    memory = _cells(records, read_memory)
    per_device = sorted({key[2] for key in throughput})
    rows, mem_rows = [], []
    for row, devices in sorted({(key[0], key[1]) for key in throughput}, key=lambda k: (k[0], k[1])):
        cells, mem_cells = [], []
        for batch in per_device:
            own = _median(throughput.get((row, devices, batch), []))
            one = _median(throughput.get((row, 1, batch), []))
            efficiency = own / (devices * one) if own is not None and one else None
            n = len(throughput.get((row, devices, batch), []))
            cells.append("-" if own is None else f"{_fmt(own, 0)} ({_fmt(efficiency, 2)}, n={n})"
                         if devices > 1 else f"{_fmt(own, 0)} (n={n})")
            mem_cells.append(_fmt(_median(memory.get((row, devices, batch), [])), 1))
        rows.append([row, str(devices), *cells])
        mem_rows.append([row, str(devices), *mem_cells])
    mechanisms = sorted({f"{title(r.framework)}: {r.metrics.data_parallelism.mechanism}" for r in records
                         if r.status == "ok" and r.metrics.data_parallelism is not None
                         and r.metrics.data_parallelism.mechanism})
    header = ["framework", "devices", *(f"{b} per device" for b in per_device)]
    align = "lr" + "r" * len(per_device)
    cpu = data.run.device == "cpu"
    device_rows = _per_device_rows(records, per_device)
    return Section("data_parallel", "Data-parallel scaling", (
        Paragraph("Throughput in global samples/s (every device's samples), the median over the ok repeats, and in "
                  "parentheses the scaling efficiency = throughput(N) / (N x throughput(1)) at the same per-device "
                  "batch size (1.00: perfect scaling), then how many trials the median rests on. Each step's global "
                  "batch is split into N contiguous equal shards, device d training on the d-th; gradients are "
                  "averaged over all of them (all-reduce) before one identical update. Evaluation runs on the first "
                  "device's model over the whole test set. With batchnorm each device normalises its own shard "
                  "unless the trial asks for synchronised batchnorm."),
        Paragraph(ALL_REDUCE),
        *((Paragraph("Mechanisms: " + "; ".join(mechanisms) + "."),) if mechanisms else ()),
        *((Paragraph("On the CPU the devices are logical devices (or processes) sharing the same cores and memory: "
                     "these figures measure the mechanism's overhead, not GPU scaling."),) if cpu else ()),
        simple_table(header, rows, align),
        Paragraph(_memory_words(data.backend, f"{memory_title} ({memory_unit})")),
        simple_table(header, mem_rows, align),
        *((Paragraph(f"Each device's peak ({memory_unit}), device 0 first (rank order), median over the ok "
                     "repeats:"), simple_table(header, device_rows, align)) if device_rows else ())))
