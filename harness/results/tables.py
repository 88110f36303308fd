"""A run as tables in the Ohio State layout: one row per framework (and variant), one column per batch size, each
cell the median over the repeats that ended ``ok`` (with its 95% bootstrap interval where there are repeats), or the
status where none did. ``compute`` turns a run's typed records into ``ReportData``, the one input of everything the
report, the terminal summary, history and the comparisons show (``harness.results.data.Run.data`` reads a run
directory into it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.record.run import RunRecord
from harness.record.trial import TrialRecord
from harness.results.derived import host_memory_bytes
from harness.results.metrics import MB, Metric, metrics_for, scaled, spec_rows, title
from harness.results.stats import mean_ci, median_ci, overlaps

Cell = tuple[str, int]  # (row, batch size)


@dataclass
class ReportData:
    """What the report shows of a run, computed once: the run (``RunRecord``) and its trial records, the rows
    (frameworks and variants, in the spec's order), batch sizes, seeds, the sampler backend, the metrics, and per
    metric its table (rows x batch sizes: a float, or the status text), the cells sampled over the whole span
    (``marks``) and the 95 % intervals (``cis``). ``run_dir``: the run directory, where it was read from one."""

    run: RunRecord
    records: list[TrialRecord]
    frameworks: list[str]
    batch_sizes: list[int]
    seeds: list[int]
    backend: str
    metrics: list[Metric]
    tables: dict[str, pd.DataFrame]
    marks: dict[str, set[Cell]]
    cis: dict[str, dict[Cell, tuple[float, float]]]
    run_dir: Path | None = None
    _by_key: dict[str, Metric] = field(default_factory=dict, repr=False)

    @property
    def spec(self) -> dict[str, Any]:
        """The spec as run (run.json's ``spec``)."""
        return self.run.spec

    def metric(self, key: str) -> Metric | None:
        """The run's metric of that key, or None."""
        if not self._by_key:
            self._by_key.update({m.key: m for m in self.metrics})
        return self._by_key.get(key)

    def cell_records(self, row: str, batch_size: int) -> list[TrialRecord]:
        return [r for r in self.records if r.row == row and r.batch_size == batch_size]


def cell_values(records: list[TrialRecord], metric: Metric, framework: str, batch_size: int) -> list[float]:
    """The metric's finite values over the repeats of one cell that ended ok."""
    return [v for r in records if r.row == framework and r.batch_size == batch_size
            and r.status == "ok" and (v := metric.read(r)) is not None and math.isfinite(v)]


def seed_values(records: list[TrialRecord], metric: Metric, framework: str, batch_size: int) -> list[float]:
    """Per seed of one cell (in seed order), the median of the metric over that seed's ok repeats."""
    return [float(np.median(values)) for seed in sorted({r.seed for r in records})
            if (values := cell_values([r for r in records if r.seed == seed], metric, framework, batch_size))]


def _over_seeds(records: list[TrialRecord], metric: Metric) -> bool:
    return metric.over_seeds and len({r.seed for r in records}) > 1


def metric_table(records: list[TrialRecord], metric: Metric, frameworks: list[str],
                 batch_sizes: list[int]) -> pd.DataFrame:
    """Rows: frameworks; columns: batch sizes; cells: the median over ok repeats (float), or for a metric over seeds
    in a run with several seeds the mean over seeds of each seed's median, or the status (str)."""
    table = pd.DataFrame(index=frameworks, columns=batch_sizes, dtype=object)
    seeds = _over_seeds(records, metric)
    for fw in frameworks:
        for bs in batch_sizes:
            ok = cell_values(records, metric, fw, bs)
            mine = [r for r in records if r.row == fw and r.batch_size == bs]
            if ok:
                table.loc[fw, bs] = float(np.mean(seed_values(records, metric, fw, bs)) if seeds else np.median(ok))
            elif mine:
                statuses = sorted({r.status for r in mine})
                table.loc[fw, bs] = "/".join(statuses) if statuses != ["ok"] else "n/a"
            else:
                table.loc[fw, bs] = ""
    return table


def ci_map(records: list[TrialRecord], metric: Metric, frameworks: list[str],
           batch_sizes: list[int]) -> dict[Cell, tuple[float, float]]:
    """95% intervals for the cells with two or more values: of the mean over seeds (t) for a metric over seeds in a
    run with several seeds, else of the median over ok repeats (bootstrap)."""
    out = {}
    seeds = _over_seeds(records, metric)
    for fw in frameworks:
        for bs in batch_sizes:
            interval = (mean_ci(seed_values(records, metric, fw, bs)) if seeds else
                        median_ci(cell_values(records, metric, fw, bs)))
            if interval is not None:
                out[(fw, bs)] = interval
    return out


def noise_pairs(data: ReportData, metric: Metric) -> list[str]:
    """Pairs of cells whose 95% intervals overlap: the frameworks at one batch size, and neighbouring batch sizes of
    one framework. Their difference is within the noise of this run."""
    cis = data.cis[metric.key]
    pairs = []
    fws, sizes = data.frameworks, data.batch_sizes
    for bs in sizes:
        for i, a in enumerate(fws):
            for b in fws[i + 1:]:
                if overlaps(cis.get((a, bs)), cis.get((b, bs))):
                    pairs.append(f"{title(a)} vs {title(b)} at batch size {bs}")
    for fw in fws:
        for x, y in zip(sizes, sizes[1:]):
            if overlaps(cis.get((fw, x)), cis.get((fw, y))):
                pairs.append(f"{title(fw)}: batch size {x} vs {y}")
    return pairs


def noise_verdict(base: tuple[float, float] | None, new: tuple[float, float] | None, change: float,
                  higher: str = "faster", lower: str = "slower") -> str:
    """The report's verdict on two cells from their 95% intervals (``ci_map``): "single runs: no interval" when
    either has none (fewer than two ok values), "no measurable difference" when the intervals overlap (the change is
    within the noise of this run), else ``higher`` or ``lower`` by the sign of ``change`` (new against base, e.g.
    new / base - 1)."""
    overlap = overlaps(base, new)
    return ("single runs: no interval" if overlap is None else "no measurable difference" if overlap else
            higher if change > 0 else lower)


def span_cells(records: list[TrialRecord], metric: Metric) -> set[Cell]:
    """(framework, batch size) cells whose sampler statistics came from the whole measured span instead of the timed
    windows (windows shorter than the sampling interval; see harness.measure.sampler.phase_stats)."""
    if metric.sampler_metric is None:
        return set()
    return {(r.row, r.batch_size) for r in records if r.status == "ok"
            and (stats := r.sampler.stats.get(metric.sampler_metric)) is not None and stats.scope == "span"}


SPAN_NOTE = ("\\* sampled over the whole measured span, evaluation pauses included: the timed windows were shorter "
             "than the sampling interval.")


def format_cell(value: Any, digits: int, mark: bool = False) -> str:
    if isinstance(value, float):
        return f"{value:,.{digits}f}" + ("*" if mark else "")
    return str(value)


def metric_row(data: ReportData, metric: Metric, framework: str, digits: int) -> list[str]:
    marks, cis = data.marks[metric.key], data.cis.get(metric.key, {})
    cells = []
    for bs, value in data.tables[metric.key].loc[framework].items():
        text = format_cell(value, digits, (framework, bs) in marks)
        if (framework, bs) in cis and cis[(framework, bs)][0] != cis[(framework, bs)][1]:
            low, high = cis[(framework, bs)]
            text += f" [{low:,.{digits}f}, {high:,.{digits}f}]"
        cells.append(text)
    return cells


def compute(run: RunRecord, records: list[TrialRecord], run_dir: Path | None = None) -> ReportData:
    """What the report shows of a run (its run.json and trial records; see ``ReportData``)."""
    spec = run.spec
    # Rows: frameworks in the spec's order, each with its variants in the order they ran.
    keys = list(dict.fromkeys(r.row for r in records))
    rows = spec_rows(spec)
    frameworks = sorted(keys, key=lambda k: (rows.index(k.split(" (")[0]) if k.split(" (")[0] in rows else 99,
                                             keys.index(k)))
    frameworks = frameworks or rows
    batch_sizes = [b for b in spec["batch_sizes"] if any(r.batch_size == b for r in records)] or spec["batch_sizes"]
    backend = next((r.sampler.backend for r in records if r.sampler.backend), "host")
    metrics = [m for m in metrics_for(backend) if not m.optional or any(m.read(r) is not None for r in records)]
    tables = {m.key: metric_table(records, m, frameworks, batch_sizes) for m in metrics}
    marks = {m.key: span_cells(records, m) for m in metrics}
    cis = {m.key: ci_map(records, m, frameworks, batch_sizes) for m in metrics if m.ci}
    seeds = sorted({r.seed for r in records})
    return ReportData(run, records, frameworks, batch_sizes, seeds, backend, metrics, tables, marks, cis, run_dir)


#: Rows the Ohio State layout adds after "GPU use %" on runs whose trials have them: NVML GPM metrics (Hopper and
#: newer) and MFU, so that utilization.gpu can be read against what the SMs did.
UTIL_ROWS = (("sm_active", "SM active %"), ("sm_occupancy", "SM occupancy %"), ("tensor_active", "tensor active %"),
             ("dram_bw", "DRAM bandwidth %"), ("mfu", "MFU %"))


def ohio_state_rows(data: ReportData) -> list[tuple[str, list[str]]]:
    """The combined table of the thesis: per framework a use % row (on a GPU followed by the UTIL_ROWS its trials
    have values for) and a memory row, then the accuracy rows."""
    metrics = {m.key: m for m in data.metrics}
    epochs = data.spec["epochs"]
    util, memory = metrics["util"], metrics["memory"]
    util_label = "GPU use %" if data.backend == "nvml" else "CPU use %"
    memory_label = "GPU memory MB" if data.backend == "nvml" else "memory MB"
    extra = [(metrics[key], label) for key, label in UTIL_ROWS if key in metrics
             and any(metrics[key].read(r) is not None for r in data.records)]
    rows = []
    for fw in data.frameworks:
        for metric, label in ((util, util_label), *extra, (memory, memory_label)):
            rows.append((f"{title(fw)} {label}", metric_row(data, metric, fw, 2)))
    for fw in data.frameworks:
        rows.append((f"{title(fw)} accuracy after {epochs} epoch{'' if epochs == 1 else 's'} %",
                     metric_row(data, metrics["accuracy"], fw, 2)))
    return rows


MEMORY_NOTE = {
    "nvml": "Three layers, peaks over the timed windows, MB = 10^6 bytes: NVML's device memory used (every process on "
            "the GPU), NVML's memory of the worker process (what its allocator reserved plus the CUDA context), and "
            "the framework allocator's own peak of live tensors (PyTorch max_memory_allocated, and "
            "max_memory_reserved; TensorFlow get_memory_info peak; MXNet exposes no peak). Every layer includes the "
            "dataset, which the harness keeps on the device (data MB row).",
    "host": "On the CPU: the anonymous resident memory of the worker process tree (RSS less its file-backed and shared "
            "pages), peak over the timed windows, MB = 10^6 bytes; it includes the interpreter's heap, the "
            "framework's allocations and the dataset (data MB row), not the libraries' code, whose resident share "
            "depends on how the worker started; the whole RSS is the RSS MB row. PyTorch, TensorFlow and MXNet keep "
            "no allocator statistics for CPU memory.",
}


def memory_rows(data: ReportData) -> list[tuple[str, list[str]]]:
    """Per framework, one row per memory layer the run has (see MEMORY_NOTE), plus the dataset's bytes."""
    if data.backend == "nvml":
        layers: list[tuple[str, Any]] = [
            ("NVML device MB", lambda r: r.sampler.stat("device_memory_used_bytes", "max")),
            ("NVML process MB", lambda r: r.sampler.stat("process_memory_bytes", "max")),
            ("allocator peak MB", lambda r: r.metrics.memory.allocator_peak_bytes),
            ("allocator reserved peak MB", lambda r: r.metrics.memory.allocator_reserved_peak_bytes)]
    else:
        layers = [("memory MB", host_memory_bytes), ("RSS MB", lambda r: r.sampler.stat("rss_bytes", "max"))]
    layers.append(("data MB", lambda r: r.metrics.data_bytes))
    rows = []
    for fw in data.frameworks:
        for label, read in layers:
            metric = Metric(label, label, "MB", scaled(read, 1 / MB), 1, "")
            table = metric_table(data.records, metric, [fw], data.batch_sizes)
            rows.append((f"{title(fw)} {label}", [format_cell(v, 1) for v in table.loc[fw]]))
    return rows


def summary_rows(data: ReportData) -> list[list[str]]:
    """Rows for the terminal summary: framework, batch size, status, throughput, s/epoch, use %, memory, accuracy."""
    metrics = {m.key: m for m in data.metrics}
    keys = ("throughput", "seconds_per_epoch", "util", "memory", "accuracy")
    rows = []
    for fw in data.frameworks:
        for bs in data.batch_sizes:
            cells = [format_cell(data.tables[k].loc[fw, bs], metrics[k].digits, (fw, bs) in data.marks[k])
                     for k in keys]
            statuses = sorted({r.status for r in data.cell_records(fw, bs)})
            rows.append([title(fw), str(bs), "/".join(statuses)] + cells)
    return rows
