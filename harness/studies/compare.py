"""Compare two runs of the same study: per framework, batch size and metric, the change and whether it is a
regression beyond the noise.

A cell's value is the median over its ok repeats (as in the report). A change is a **regression** when it goes the
bad way (throughput or accuracy down, time or memory up) by more than the threshold (percent of the base value) and,
where both runs have two or more ok repeats of the cell, the 95% bootstrap intervals of the two medians do not
overlap. Without repeats the threshold alone decides, and the table says so. Cells present or ok on one side only are
listed as such, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.results import tables
from harness.results.metrics import metrics_for, row_key
from harness.results.stats import median_ci, overlaps
from harness.results.store import read_run, read_trials

# metric key in harness.results.report -> True when higher is better
COMPARED = {"throughput": True, "accuracy": True, "memory": False, "allocator_peak": False}
DEFAULT_THRESHOLD_PCT = 5.0


@dataclass
class Row:
    """One compared cell and metric. ``change_pct`` is (new - base) / base x 100."""

    framework: str
    batch_size: int
    metric: str
    base: float | None
    new: float | None
    change_pct: float | None
    noise: str
    verdict: str  # "regression", "improvement", "same", "base only", "new only", "failed in base", "failed in new"


def _cells(records: list[dict[str, Any]]) -> set[tuple[str, int]]:
    return {(row_key(r), r["batch_size"]) for r in records}


def _status(records: list[dict[str, Any]], cell: tuple[str, int]) -> str:
    statuses = sorted({r["status"] for r in records if (row_key(r), r["batch_size"]) == cell})
    return "/".join(statuses)


def compare_runs(base_dir: str | Path, new_dir: str | Path,
                 threshold_pct: float = DEFAULT_THRESHOLD_PCT) -> tuple[list[Row], dict[str, Any]]:
    """Rows for every cell of either run and every compared metric, and a summary (run names, devices, counts).
    Raises FileNotFoundError when a directory is not a run."""
    base_run, new_run = read_run(base_dir), read_run(new_dir)
    base, new = read_trials(base_dir), read_trials(new_dir)
    backend = next((r["sampler"].get("backend") for r in base + new if r.get("sampler", {}).get("backend")), "host")
    metrics = {m.key: m for m in metrics_for(backend) if m.key in COMPARED}
    rows: list[Row] = []
    for cell in sorted(_cells(base) | _cells(new), key=lambda c: (c[0], c[1])):
        fw, bs = cell
        if cell not in _cells(new) or cell not in _cells(base):
            side = "base only" if cell not in _cells(new) else "new only"
            rows.append(Row(fw, bs, "-", None, None, None, "", side))
            continue
        for key, metric in metrics.items():
            b_values = tables.cell_values(base, metric, fw, bs)
            n_values = tables.cell_values(new, metric, fw, bs)
            if not b_values or not n_values:
                if key == "throughput":  # say it once per cell, on the main metric
                    which = "failed in base" if not b_values else "failed in new"
                    status = _status(base if not b_values else new, cell)
                    rows.append(Row(fw, bs, metric.title, None, None, None, status, which))
                continue
            b, n = float(np.median(b_values)), float(np.median(n_values))
            change = (n - b) / b * 100 if b else None
            b_ci, n_ci = median_ci(b_values), median_ci(n_values)
            overlap = overlaps(b_ci, n_ci)
            noise = ("threshold only (no repeats)" if overlap is None
                     else "intervals overlap" if overlap else "intervals apart")
            worse = change is not None and (change < -threshold_pct if COMPARED[key] else change > threshold_pct)
            better = change is not None and (change > threshold_pct if COMPARED[key] else change < -threshold_pct)
            if overlap:  # within the noise, whatever the size of the change
                verdict = "same"
            else:
                verdict = "regression" if worse else "improvement" if better else "same"
            rows.append(Row(fw, bs, metric.title, b, n, change, noise, verdict))
    summary = {
        "base": Path(base_dir).name, "new": Path(new_dir).name, "threshold_pct": threshold_pct,
        "base_device": base_run.get("device"), "new_device": new_run.get("device"),
        "regressions": sum(r.verdict == "regression" for r in rows),
        "missing": [f"{r.framework} bs{r.batch_size}: {r.verdict}" for r in rows
                    if r.verdict in ("base only", "new only", "failed in base", "failed in new")],
    }
    if base_run.get("spec", {}).get("name") != new_run.get("spec", {}).get("name"):
        summary["warning"] = "the runs come from different specs"
    return rows, summary


def _fmt(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def to_markdown(rows: list[Row], summary: dict[str, Any]) -> str:
    """The comparison as Markdown: a header with the verdict, then one table row per cell and metric."""
    lines = [f"# Compare {summary['base']} -> {summary['new']}", "",
             f"- Regressions beyond {summary['threshold_pct']:g}% and the noise: {summary['regressions']}",
             f"- Devices: {summary['base_device']} -> {summary['new_device']}"]
    if summary.get("warning"):
        lines.append(f"- Warning: {summary['warning']}")
    if summary["missing"]:
        lines.append(f"- Missing or failed on one side: {'; '.join(summary['missing'])}")
    lines += ["", "| framework | batch size | metric | base | new | change % | noise | verdict |",
              "| --- | ---: | --- | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.framework} | {r.batch_size} | {r.metric} | {_fmt(r.base)} | {_fmt(r.new)} | "
                     f"{_fmt(r.change_pct, 1)} | {r.noise} | {'**regression**' if r.verdict == 'regression' else r.verdict} |")
    return "\n".join(lines) + "\n"
