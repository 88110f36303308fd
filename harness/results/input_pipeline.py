"""The report's "Input pipeline" section: throughput fed from the device (``input: resident``) against each framework's
own data loader (``input: loader``) at each batch size, the share of the timed steps spent waiting for the loader,
and the device's utilization in both modes (docs/guide/data.md#input-pipelines)."""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np

from harness.record.trial import TrialRecord
from harness.results.metrics import Read, metrics_for, title
from harness.results.sections import Paragraph, Section, simple_table
from harness.results.tables import ReportData

_INPUT_PART = re.compile(r"^(resident|loader)$")


def _row(record: TrialRecord) -> str:
    """The framework row without the input mode: its label and the variant's other parts."""
    rest = [part for part in record.variant.split(", ") if part and not _INPUT_PART.match(part)]
    label = title(record.label)
    return f"{label} ({', '.join(rest)})" if rest else label


def _cells(records: list[TrialRecord], read: Read) -> dict[tuple[str, str, int], list[float]]:
    """(row, input mode, batch size) -> the values of ``read`` over the ok trials (repeats, seeds)."""
    out: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for record in records:
        value = read(record) if record.status == "ok" else None
        if value is not None:
            out[(_row(record), record.metrics.input or "resident", record.batch_size)].append(float(value))
    return out


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _spread(values: list[float]) -> str:
    """The values' range as a percentage of their median ("±x %" of half the range), or "" for one value."""
    if len(values) < 2:
        return ""
    middle = float(np.median(values))
    return f" ±{50 * (max(values) - min(values)) / middle:.0f}%" if middle else ""


def _loader_words(records: list[TrialRecord]) -> list[str]:
    """Each framework's loader as its trials recorded it (``settings.loader``), e.g. "PyTorch:
    torch.utils.data.DataLoader (num_workers 2, prefetch_factor 2, ...)"."""
    seen: dict[str, str] = {}
    for record in records:
        loader = record.settings.get("loader")
        if record.status == "ok" and isinstance(loader, dict) and record.framework not in seen:
            options = ", ".join(f"{k} {v}" for k, v in loader.items() if k != "loader")
            seen[record.framework] = f"{title(record.framework)}: {loader.get('loader')} ({options})"
    return [seen[name] for name in sorted(seen)]


def input_pipeline_section(data: ReportData) -> Section | None:
    """Per framework row and batch size: resident and loader throughput (samples/s, median over the ok repeats,
    with the half-range in % and the count), loader / resident, the loader's input-wait share (the time the timed
    steps waited for the loader's next batch over the timed seconds, median), and the device's utilization in each
    mode (GPU use % on a GPU, the worker tree's CPU use % on the host); None when no trial used a loader."""
    records = data.records
    if not any(r.metrics.input == "loader" for r in records if r.status == "ok"):
        return None
    throughput = _cells(records, lambda r: r.metrics.throughput_samples_per_s)
    wait = _cells(records, lambda r: r.metrics.input_wait_share)
    util = next((m for m in metrics_for(data.backend) if m.key == "util"), None)
    usage = _cells(records, util.read) if util is not None else {}
    batches = sorted({key[2] for key in throughput})
    rows, wait_rows, util_rows = [], [], []
    for row in sorted({key[0] for key in throughput}):
        for mode in ("resident", "loader"):
            cells = []
            for batch in batches:
                values = throughput.get((row, mode, batch), [])
                own = _median(values)
                cells.append("-" if own is None else f"{own:,.0f}{_spread(values)} (n={len(values)})")
            rows.append([row, mode, *cells])
        ratios, shares = [], []
        for batch in batches:
            resident = _median(throughput.get((row, "resident", batch), []))
            loader = _median(throughput.get((row, "loader", batch), []))
            ratios.append("-" if resident is None or loader is None or not resident else f"{loader / resident:.2f}")
            share = _median(wait.get((row, "loader", batch), []))
            shares.append("-" if share is None else f"{100 * share:.1f}")
        wait_rows.append([row, "loader / resident", *ratios])
        wait_rows.append([row, "input wait % (loader)", *shares])
        if util is not None:
            for mode in ("resident", "loader"):
                medians = [_median(usage.get((row, mode, batch), [])) for batch in batches]
                util_rows.append([row, mode, *("-" if v is None else f"{v:.1f}" for v in medians)])
    header = ["framework", "input", *(str(b) for b in batches)]
    align = "ll" + "r" * len(batches)
    loaders = _loader_words(records)
    what = ("GPU use %" if data.backend == "nvml" else
            "CPU use % of the worker's process tree, the loader's worker processes included")
    return Section("input_pipeline", "Input pipeline", (
        Paragraph("Throughput (samples/s, the median over the ok repeats, ± half its range in %, n trials) with the "
                  "training set resident on the device (each step gathers its batch there) and through the "
                  "framework's own data loader (the host reads, decodes and augments each batch, then copies it "
                  "over). Both modes train on the same samples in the same order, with the same augmentation."),
        simple_table(header, rows, align),
        Paragraph("Loader over resident throughput, and the loader's input wait: the time the timed steps spent "
                  "waiting for the loader's next batch (the training loop's clock around each fetch), as a share of "
                  "the timed seconds. A share near 0 means the loader kept up; what is left of a low utilization "
                  "then is the step itself. Where the step is dispatched asynchronously (JAX, MXNet's engine, "
                  "TensorFlow on a GPU) a fetch can also wait for the device to finish the step before (its copy "
                  "queues behind it): there the share is an upper bound, and loader / resident the bottom line."),
        simple_table(header, wait_rows, align),
        *((Paragraph(f"{util.title} ({what}), median over the ok repeats, in both modes:"),
           simple_table(header, util_rows, align)) if util is not None and util_rows else ()),
        *((Paragraph("Loaders: " + "; ".join(loaders) + "."),) if loaders else ())))
