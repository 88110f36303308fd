"""A history of runs for the nightly job: one summary row per run in a JSON-lines file, and trend plots.

A row: ``run`` (directory name), ``spec``, ``started``, ``commit`` (the harness's git commit), ``device`` (its name),
``versions`` (framework versions the workers reported), and ``cells``: for every "<framework>/<batch size>", the
median over ok repeats of each tracked metric (None when no repeat ended ok) and the statuses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import adapters  # the registry of declarations: imports no framework
from harness.record.run import RunRecord
from harness.results.data import build
from harness.results.store import append_line, read_lines

TRACKED = ("throughput", "seconds_per_epoch", "accuracy", "memory", "util")


def device_name(run: RunRecord) -> str | None:
    """The device a run (its run.json) measured, by name: the GPU's NVML name on cuda, else the CPU's model."""
    env = run.environment
    gpu_names = [d.get("name") for d in env.get("gpu", {}).get("devices", [])]
    return gpu_names[0] if run.device.startswith("cuda") and gpu_names else env.get("cpu")


def summary_row(run_dir: str | Path) -> dict[str, Any]:
    """The history row of one run directory."""
    data = build(run_dir)
    run = data.run
    metrics = {m.key: m for m in data.metrics if m.key in TRACKED}
    cells: dict[str, dict[str, Any]] = {}
    for fw in data.frameworks:
        for bs in data.batch_sizes:
            statuses = sorted({r.status for r in data.cell_records(fw, bs)})
            if not statuses:
                continue
            cell: dict[str, Any] = {"status": "/".join(statuses)}
            for key in metrics:
                value = data.tables[key].loc[fw, bs]
                cell[key] = value if isinstance(value, float) else None
            cells[f"{fw}/{bs}"] = cell
    versions: dict[str, str] = {}
    framework_keys = {k for declared in adapters.declarations() for k in declared.version_keys}
    for r in data.records:
        versions.update({k: v for k, v in r.versions.items() if k in framework_keys})
    return {"run": Path(run_dir).name, "spec": run.name, "started": run.started,
            "commit": run.environment.get("git", {}).get("commit"),
            "device": device_name(run),
            "versions": versions, "backend": data.backend, "cells": cells}


def append(history_file: str | Path, run_dir: str | Path) -> dict[str, Any]:
    """Appends the run's row to the history file (flushed and fsynced) and returns it. A run already in the file is
    not added twice."""
    path = Path(history_file)
    row = summary_row(run_dir)
    if any(existing.get("run") == row["run"] for existing in read_lines(path)):
        return row
    append_line(path, row)
    return row


def read(history_file: str | Path) -> list[dict[str, Any]]:
    """The rows of a history file, oldest first."""
    return read_lines(Path(history_file))


def plot(history_file: str | Path, metric: str, out: str | Path, frameworks: list[str] | None = None,
         batch_sizes: list[int] | None = None) -> Path:
    """One line per framework and batch size: ``metric`` (a key of TRACKED) over the runs in the history file.
    Raises ValueError for an unknown metric or an empty history."""
    if metric not in TRACKED:
        raise ValueError(f"unknown metric {metric!r}; choose from {', '.join(TRACKED)}")
    rows = read(history_file)
    if not rows:
        raise ValueError(f"{history_file} holds no runs")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for i, row in enumerate(rows):
        for key, cell in row["cells"].items():
            fw, bs = key.rsplit("/", 1)
            if (frameworks and fw.split(" (")[0] not in frameworks) or (batch_sizes and int(bs) not in batch_sizes):
                continue
            if cell.get(metric) is not None:
                series.setdefault(key, []).append((i, cell[metric]))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for key, points in sorted(series.items(), key=lambda kv: (kv[0].rsplit("/", 1)[0], int(kv[0].rsplit("/", 1)[1]))):
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=key)
    ax.set_xticks(range(len(rows)), [(r.get("started") or r["run"])[:10] + "\n" + (r.get("commit") or "")[:7]
                                     for r in rows], fontsize=7)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} over {len(rows)} runs of {rows[-1]['spec']}")
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
