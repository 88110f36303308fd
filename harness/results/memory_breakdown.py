"""The report's memory breakdown: what a training step holds by data structure, predicted from the neutral model
(``harness.neutral.memory``, recorded by the worker as ``metrics.memory_predicted``), beside what each framework was
measured to hold; the difference is the framework's own overhead and workspace."""

from __future__ import annotations

from harness.record.metrics import PREDICTED_PARTS
from harness.record.trial import TrialRecord
from harness.results.derived import host_memory_bytes
from harness.results.metrics import MB, Metric, Read, scaled, title
from harness.results.sections import Paragraph, Section, batch_table
from harness.results.tables import ReportData, format_cell, metric_table

PART_TITLES = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
               "buffers": "buffers (batchnorm running statistics)", "accumulator": "gradient accumulator",
               "activations": "activations saved for the backward pass", "total": "total predicted"}
NOTE = {
    "nvml": "Measured: the framework allocator's peak of live tensors where it has one (PyTorch, TensorFlow), else "
            "NVML's memory of the worker process (which also holds the CUDA context and the allocator's cache). "
            "Difference = measured - predicted - the resident dataset: what the framework adds (workspaces for "
            "convolutions and matrix products, temporaries of the backward pass, allocator rounding).",
    "host": "Measured on the CPU: the peak anonymous resident memory of the worker, which also holds the "
            "interpreter's and the framework's own allocations (hundreds of MB before the first tensor), so the "
            "difference here is mostly "
            "the runtime, not the training step; on a GPU the allocator's own peak makes it the framework's "
            "overhead and workspace.",
}


def _measured(record: TrialRecord) -> float | None:
    """Bytes the framework was measured to hold (see NOTE)."""
    if (allocator := record.metrics.memory.allocator_peak_bytes) is not None:
        return float(allocator)
    if (value := record.sampler.stat("process_memory_bytes", "max")) is not None:
        return value
    return host_memory_bytes(record)


def _part(part: str) -> Read:
    """A predicted part's bytes (``metrics.memory_predicted.<part>_bytes``)."""
    return scaled(lambda r: None if r.metrics.memory_predicted is None else
                  getattr(r.metrics.memory_predicted, f"{part}_bytes"))


_total = _part("total")


def _difference(record: TrialRecord) -> float | None:
    measured, predicted = _measured(record), _total(record)
    if measured is None or predicted is None:
        return None
    return (measured - predicted - (record.metrics.data_bytes or 0)) / MB


def memory_breakdown_section(data: ReportData) -> Section | None:
    """The section, or None for a run whose records predate the prediction."""
    records, sizes, frameworks = data.records, data.batch_sizes, data.frameworks
    if not any(r.metrics.memory_predicted is not None for r in records):
        return None
    rows = []
    for part in (*PREDICTED_PARTS, "data"):
        read = scaled(lambda r: r.metrics.data_bytes) if part == "data" else _part(part)
        metric = Metric(part, part, "MB", scaled(read, 1 / MB), 2, "")
        table = metric_table(records, metric, frameworks, sizes)
        cells = [next((format_cell(v, 2) for v in table[bs] if isinstance(v, float)), "") for bs in sizes]
        rows.append((PART_TITLES.get(part, "dataset resident on the device (not in the total)"), cells))
    for fw in frameworks:
        for label, read in (("measured", scaled(_measured, 1 / MB)), ("difference", _difference)):
            table = metric_table(records, Metric(label, label, "MB", read, 2, ""), [fw], sizes)
            rows.append((f"{title(fw)} {label}", [format_cell(v, 2) for v in table.loc[fw]]))
    rows.extend(_growth_rows(records, frameworks, sizes))
    return Section("memory_breakdown", "Memory by data structure (MB)", (
        Paragraph("Predicted from the model for one training step (harness.neutral.memory: parameters, gradients, "
                  "optimizer state, buffers, the gradient accumulator and the activations each layer keeps for the "
                  "backward pass, float32), the same for every framework; then, per framework, the measured peak "
                  "and the difference. " + NOTE[data.backend] + " " + GROWTH),
        batch_table(rows, sizes)))


GROWTH = ("The growth rows divide what the measured peak grew by from the smallest batch size by what the prediction "
          "grew by (the activations alone): everything that does not depend on the batch size (the runtime, the "
          "libraries, the weights) cancels, so 1.0 x means the framework keeps exactly the predicted activations "
          "per sample, and more is its per-sample overhead (the backward pass's temporaries, workspaces, copies).")


def _growth_rows(records: list[TrialRecord], frameworks: list[str], sizes: list[int]) -> list[tuple[str, list[str]]]:
    """Per framework: (measured peak at B - at the smallest B) / (predicted total at B - at the smallest B), as
    "2.50 x" cells ("" for the smallest size, a size either is missing for, or no growth predicted)."""
    if len(sizes) < 2:
        return []
    measured = metric_table(records, Metric("m", "m", "B", _measured, 0, ""), frameworks, sizes)
    predicted = metric_table(records, Metric("p", "p", "B", _total, 0, ""), frameworks, sizes)
    rows = []
    for fw in frameworks:
        cells = [""]
        for bs in sizes[1:]:
            m0, m1, p0, p1 = measured.loc[fw, sizes[0]], measured.loc[fw, bs], predicted.loc[fw, sizes[0]], \
                predicted.loc[fw, bs]
            numbers = all(isinstance(v, float) for v in (m0, m1, p0, p1))
            cells.append(f"{(m1 - m0) / (p1 - p0):.2f} x" if numbers and p1 > p0 else "")
        rows.append((f"{title(fw)} growth from batch {sizes[0]}, measured / predicted", cells))
    return rows
