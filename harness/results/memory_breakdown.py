"""The report's memory breakdown: what a training step holds by data structure, predicted from the neutral model
(``harness.neutral.memory``, recorded by the worker as ``metrics.memory_predicted``), beside what each framework was
measured to hold; the difference is the framework's own overhead and workspace."""

from __future__ import annotations

from typing import Any

from harness.results.metrics import MB, Metric, read_path, scaled, title
from harness.results.tables import format_cell, markdown_table, metric_table

PART_TITLES = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
               "buffers": "buffers (batchnorm running statistics)", "accumulator": "gradient accumulator",
               "activations": "activations saved for the backward pass", "total": "total predicted"}
NOTE = {
    "nvml": "Measured: the framework allocator's peak of live tensors where it has one (PyTorch, TensorFlow), else "
            "NVML's memory of the worker process (which also holds the CUDA context and the allocator's cache). "
            "Difference = measured - predicted - the resident dataset: what the framework adds (workspaces for "
            "convolutions and matrix products, temporaries of the backward pass, allocator rounding).",
    "host": "Measured on the CPU: the peak resident memory (RSS) of the worker, which also holds the interpreter and "
            "the framework's libraries (hundreds of MB before the first tensor), so the difference here is mostly "
            "the runtime, not the training step; on a GPU the allocator's own peak makes it the framework's "
            "overhead and workspace.",
}


def _measured(record: dict[str, Any]) -> float | None:
    """Bytes the framework was measured to hold (see NOTE)."""
    for path in (("metrics", "memory", "allocator_peak_bytes"), ("sampler", "stats", "process_memory_bytes", "max"),
                 ("sampler", "stats", "rss_bytes", "max")):
        if (value := read_path(record, *path)) is not None:
            return float(value)
    return None


def _difference(record: dict[str, Any]) -> float | None:
    measured, predicted = _measured(record), read_path(record, "metrics", "memory_predicted", "total")
    if measured is None or predicted is None:
        return None
    return (measured - predicted - (read_path(record, "metrics", "data_bytes") or 0)) / MB


def memory_breakdown_section(data: dict[str, Any]) -> list[str]:
    """The section, or nothing for a run whose records predate the prediction."""
    records, sizes, frameworks = data["records"], data["batch_sizes"], data["frameworks"]
    if not any(read_path(r, "metrics", "memory_predicted") for r in records):
        return []
    rows = []
    for part in (*PART_TITLES, "data"):
        path = ("metrics", "data_bytes") if part == "data" else ("metrics", "memory_predicted", part)
        metric = Metric(part, part, "MB", scaled(1 / MB, *path), 2, "")
        table = metric_table(records, metric, frameworks, sizes)
        cells = [next((format_cell(v, 2) for v in table[bs] if isinstance(v, float)), "") for bs in sizes]
        rows.append((PART_TITLES.get(part, "dataset resident on the device (not in the total)"), cells))
    for fw in frameworks:
        for label, read in (("measured", lambda r: None if (m := _measured(r)) is None else m / MB),
                            ("difference", _difference)):
            table = metric_table(records, Metric(label, label, "MB", read, 2, ""), [fw], sizes)
            rows.append((f"{title(fw)} {label}", [format_cell(v, 2) for v in table.loc[fw]]))
    return ["## Memory by data structure (MB)", "",
            "Predicted from the model for one training step (harness.neutral.memory: parameters, gradients, "
            "optimizer state, buffers, the gradient accumulator and the activations each layer keeps for the "
            "backward pass, float32), the same for every framework; then, per framework, the measured peak and the "
            "difference. " + NOTE[data["backend"]], "",
            markdown_table(rows, sizes), ""]
