"""The report's plots: each metric against batch size, and each trial's sampled time series with its phases shaded
(matplotlib, Agg backend). ``metric_figure`` and ``trial_figure`` draw; ``plot``/``plot_trial`` save them as the PNGs
report.md links, and ``harness.results.html`` embeds the same figures as inline SVG."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.record.events import PhaseName, phase_windows
from harness.results.metrics import MB, Metric, title
from harness.results.store import read_events, read_lines
from harness.results.tables import ReportData


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def metric_figure(data: ReportData, metric: Metric) -> tuple[Any, dict[str, str]]:
    """The metric against batch size (log2 axis), a line per row; ok cells only. Returns the figure and, per point,
    its SVG group id (``<metric key>-<n>``) and a hover text (row, batch size, value with unit), which the HTML report
    puts into the SVG as each point's <title>."""
    plt = _pyplot()
    table = data.tables[metric.key]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    tips: dict[str, str] = {}
    for fw in data.frameworks:
        points = [(bs, v) for bs, v in table.loc[fw].items() if isinstance(v, float)]
        if not points:
            continue
        xs, ys = zip(*points)
        (line,) = ax.plot(xs, ys, label=title(fw))
        for bs, value in points:
            gid = f"{metric.key}-{len(tips)}"
            ax.plot([bs], [value], marker="o", color=line.get_color(), gid=gid)
            tips[gid] = f"{title(fw)}, batch size {bs}: {value:,.{metric.digits}f} {metric.unit}".strip()
    ax.set_xscale("log", base=2)
    ax.set_xticks(data.batch_sizes, [str(b) for b in data.batch_sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel(f"{metric.title} ({metric.unit})" if metric.unit else metric.title)
    ax.set_title(metric.title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    return fig, tips


def plot(data: ReportData, out_dir: Path,
         then: Callable[[str, Any, dict[str, str]], None] | None = None) -> list[Path]:
    """One PNG per metric (``metric_figure``), ``out_dir/<metric key>.png``; ``then(key, figure, tips)``, when given,
    is called with each figure after it is saved (the HTML report saves it again), before it is closed."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric in data.metrics:
        fig, tips = metric_figure(data, metric)
        path = out_dir / f"{metric.key}.png"
        fig.savefig(path)
        if then is not None:
            then(metric.key, fig, tips)
        plt.close(fig)
        paths.append(path)
    return paths


SERIES_TITLES = {"cpu_percent": "CPU %", "rss_bytes": "RSS MB", "gpu_util_percent": "GPU use %",
                 "mem_util_percent": "memory use %", "device_memory_used_bytes": "device MB",
                 "process_memory_bytes": "process MB", "power_w": "power W", "sm_clock_mhz": "SM MHz",
                 "temperature_c": "temperature C", "sm_active_percent": "SM active %",
                 "sm_occupancy_percent": "SM occupancy %", "tensor_active_percent": "tensor active %",
                 "dram_bw_util_percent": "DRAM bandwidth %"}


def trial_figure(run_dir: Path, trial_id: str) -> Any | None:
    """The sampled metrics of one trial over time (seconds since the worker started), with the warm-up (grey) and
    the timed windows (green) shaded; None when the trial has no samples."""
    samples = read_lines(run_dir / "samples" / f"{trial_id}.jsonl")
    try:
        events = read_events(run_dir, trial_id)
    except FileNotFoundError:
        events = []
    names = [m for m in SERIES_TITLES if any(s.get(m) is not None for s in samples)]
    if not samples or not names:
        return None
    plt = _pyplot()
    t0 = events[0].t if events else samples[0]["t"]
    fig, axes = plt.subplots(len(names), 1, figsize=(7, 1.6 * len(names) + 0.6), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        scale = 1 / MB if name.endswith("_bytes") else 1.0
        points = [(s["t"] - t0, s[name] * scale) for s in samples if s.get(name) is not None]
        ax.plot(*zip(*points), lw=1, marker=".", ms=2)
        ax.set_ylabel(SERIES_TITLES[name], fontsize=8)
        shaded: tuple[tuple[PhaseName, str], ...] = (("warmup", "0.85"), ("train", "#c8e6c9"))
        for phase, color in shaded:
            for a, b in phase_windows(events, phase):
                ax.axvspan(a - t0, b - t0, color=color, lw=0)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the worker started")
    axes[0, 0].set_title(f"{trial_id}: warm-up grey, timed windows green", fontsize=9)
    fig.tight_layout()
    return fig


def plot_trial(run_dir: Path, trial_id: str, out: Path, then: Callable[[Any], None] | None = None) -> Path | None:
    """``trial_figure`` saved as a PNG at ``out`` (``then(figure)``, when given, is called with it before it is
    closed); None when the trial has no samples."""
    fig = trial_figure(run_dir, trial_id)
    if fig is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    if then is not None:
        then(fig)
    _pyplot().close(fig)
    return out
