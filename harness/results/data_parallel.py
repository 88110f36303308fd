"""The report's "Data-parallel scaling" section: global throughput and scaling efficiency against the number of
devices at each per-device batch size, and the peak memory, per framework (docs/guide/data-parallel.md)."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import numpy as np

from harness.results.metrics import metrics_for, title
from harness.results.sections import Paragraph, Section, simple_table

_DEVICE_PART = re.compile(r"^(\d+ devices?|sync bn)$")


def _row(record: dict[str, Any]) -> str:
    """The framework row without the devices: its label and the variant's other parts."""
    rest = [part for part in (record.get("variant") or "").split(", ") if part and not _DEVICE_PART.match(part)]
    label = title(record.get("label") or record["framework"])
    return f"{label} ({', '.join(rest)})" if rest else label


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _cells(records: list[dict[str, Any]], read: Any) -> dict[tuple[str, int, int], list[float]]:
    """(row, devices, per-device batch) -> the values of ``read`` over the ok trials (repeats, seeds)."""
    out: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for record in records:
        value = read(record) if record.get("status") == "ok" else None
        if value is not None:
            devices = int(record.get("data_parallel") or 1)
            per_device = int(record.get("per_device_batch_size") or record["batch_size"])
            out[(_row(record), devices, per_device)].append(float(value))
    return out


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def data_parallel_section(data: dict[str, Any]) -> Section | None:
    """Throughput (global samples/s, median over repeats) and scaling efficiency = throughput(N) / (N x
    throughput(1)) at the same per-device batch size, and peak memory, for each framework row and device count;
    None when no trial ran on more than one device."""
    records = data["records"]
    if not any(int(r.get("data_parallel") or 1) > 1 for r in records):
        return None
    throughput = _cells(records, lambda r: r.get("metrics", {}).get("throughput"))
    memory_metric = next(m for m in metrics_for(data["backend"]) if m.key == "memory")
    memory = _cells(records, memory_metric.read)
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
    mechanisms = sorted({f"{title(r['framework'])}: {r['metrics'].get('data_parallel_mechanism')}" for r in records
                         if r.get("status") == "ok" and r.get("metrics", {}).get("data_parallel_mechanism")})
    header = ["framework", "devices", *(f"{b} per device" for b in per_device)]
    cpu = data["run"].get("device", "cpu") == "cpu"
    return Section("data_parallel", "Data-parallel scaling", (
        Paragraph("Throughput in global samples/s (every device's samples), the median over the ok repeats, and in "
                  "parentheses the scaling efficiency = throughput(N) / (N x throughput(1)) at the same per-device "
                  "batch size (1.00: perfect scaling), then how many trials the median rests on. Each step's global "
                  "batch is split into N contiguous equal shards, device d training on the d-th; gradients are "
                  "averaged over all of them (all-reduce) before one identical update. Evaluation runs on the first "
                  "device's model over the whole test set. With batchnorm each device normalises its own shard "
                  "unless the trial asks for synchronised batchnorm. The all-reduce's share of the step is not "
                  "measured."),
        *((Paragraph("Mechanisms: " + "; ".join(mechanisms) + "."),) if mechanisms else ()),
        *((Paragraph("On the CPU the devices are logical devices (or processes) sharing the same cores and memory: "
                     "these figures measure the mechanism's overhead, not GPU scaling."),) if cpu else ()),
        simple_table(header, rows, "lr" + "r" * len(per_device)),
        Paragraph(f"{memory_metric.title} ({memory_metric.unit}), all devices of the trial together:"),
        simple_table(header, mem_rows, "lr" + "r" * len(per_device))))
