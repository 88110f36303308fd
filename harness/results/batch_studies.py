"""The report's sections for the batch-size studies a spec turns on that have no module of their own: learning-rate
scaling and gradient accumulation, time to a target accuracy, and powers of two against their neighbours."""

from __future__ import annotations

import numpy as np

from harness.results.metrics import Metric, Read, scaled, title
from harness.results.sections import Paragraph, Section, batch_table, simple_table
from harness.results.tables import ReportData, cell_values, format_cell, metric_table, noise_verdict


def _per_cell(data: ReportData, read: Read, digits: int) -> list[tuple[str, list[str]]]:
    """Rows of any per-trial value in the table layout (median over ok repeats)."""
    metric = Metric("x", "x", "", read, digits, "")
    table = metric_table(data.records, metric, data.frameworks, data.batch_sizes)
    return [(title(fw), [format_cell(v, digits) for v in table.loc[fw]]) for fw in data.frameworks]


def scaling_section(data: ReportData) -> Section | None:
    """Effective batch size and learning rate used, when the spec accumulates gradients or scales the rate."""
    spec, sizes = data.spec, data.batch_sizes
    if spec.get("accumulation_steps", 1) <= 1 and spec.get("learning_rate_scaling", "none") == "none":
        return None
    return Section("scaling", "Learning rate and effective batch size", (
        Paragraph(f"Learning-rate scaling: {spec.get('learning_rate_scaling', 'none')} relative to batch size "
                  f"{spec.get('base_batch_size')}; gradient accumulation: {spec.get('accumulation_steps', 1)} "
                  "micro-batches of the batch size per optimizer step (effective batch size = steps x batch size). "
                  "Batchnorm normalises each micro-batch on its own, so with batchnorm accumulation is not the same "
                  "as one large batch."),
        Paragraph("Effective batch size:"),
        batch_table(_per_cell(data, scaled(lambda r: r.metrics.effective_batch_size), 0), sizes),
        Paragraph("Learning rate used:"),
        batch_table(_per_cell(data, scaled(lambda r: r.learning_rate), 5), sizes)))


def _reached(read: str) -> Read:
    """A field of ``metrics.time_to_target`` (None where the target was not reached)."""
    return scaled(lambda r: None if r.metrics.time_to_target is None else getattr(r.metrics.time_to_target, read))


def time_to_target_section(data: ReportData) -> Section | None:
    """Epochs and training seconds to the spec's target accuracy, and the batch size that got there first."""
    target = data.spec.get("target_accuracy")
    if not target:
        return None
    records, sizes = data.records, data.batch_sizes
    epochs = _per_cell(data, _reached("epochs"), 0)
    seconds = _per_cell(data, _reached("training_s"), 2)
    seconds_metric = Metric("t", "t", "", _reached("training_s"), 2, "")
    firsts = []
    for fw in data.frameworks:
        reached = [(float(np.median(values)), bs) for bs in sizes
                   if (values := cell_values(records, seconds_metric, fw, bs))]
        if reached:
            best_seconds, best_size = min(reached)
            firsts.append(f"{title(fw)}: batch size {best_size} ({best_seconds:.2f} s)")
        else:
            firsts.append(f"{title(fw)}: not reached")
    every = data.spec.get("evaluate_every_samples")
    when = (f"epochs (a partial one counted) until the test accuracy after an evaluation (every {every:,} training "
            "samples)" if every else "epochs until the test accuracy after an epoch")
    steps = (("Optimizer steps (warm-up included):", _per_cell(data, _reached("steps"), 0)),) if every else ()
    return Section("time_to_target", f"Time to {100 * target:g}% test accuracy", (
        Paragraph(f"Training seconds (timed windows only, warm-up and evaluation excluded) and {when} first reached "
                  "the target; empty where it was never reached."),
        Paragraph("Epochs:"), batch_table(epochs, sizes),
        *(part for label, cells in steps for part in (Paragraph(label), batch_table(cells, sizes))),
        Paragraph("Training seconds:"), batch_table(seconds, sizes),
        Paragraph("First to reach it: " + "; ".join(firsts) + ".")))


def power_neighbours(data: ReportData, row: str) -> list[tuple[int, int, float, str]]:
    """Per power of two n of the run and each neighbour n - 1 or n + 1 it has, for ``row``: (n, the neighbour, the
    change of its median throughput against n's in %, ``noise_verdict``'s verdict), where both have an ok trial."""
    sizes, metric = data.batch_sizes, data.metric("throughput")
    if metric is None:
        return []
    cis = data.cis.get("throughput", {})
    out = []
    for n in (n for n in sizes if n & (n - 1) == 0):
        base = cell_values(data.records, metric, row, n)
        for other in (n - 1, n + 1):
            values = cell_values(data.records, metric, row, other)
            if other not in sizes or not base or not values:
                continue
            change = float((np.median(values) - np.median(base)) / np.median(base) * 100)
            out.append((n, other, change, noise_verdict(cis.get((row, n)), cis.get((row, other)), change)))
    return out


def powers_of_two_section(data: ReportData) -> Section | None:
    """Throughput of n - 1 and n + 1 against each power of two n the run has a neighbour of (seed 000)."""
    sizes = data.batch_sizes
    if data.metric("throughput") is None or not any(n & (n - 1) == 0 and (n - 1 in sizes or n + 1 in sizes)
                                                     for n in sizes):
        return None
    rows = [[title(fw), str(n), str(other), f"{change:+.1f}", verdict] for fw in data.frameworks
            for n, other, change, verdict in power_neighbours(data, fw)]
    return Section("powers_of_two", "Powers of two against their neighbours", (
        Paragraph("Throughput of n - 1 and n + 1 relative to the power of two n. With repeats, 'no measurable "
                  "difference' means the 95% intervals of the medians overlap."),
        simple_table(["framework", "n", "neighbour", "change %", "verdict"], rows, "lrrrl")))
