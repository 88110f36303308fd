"""The report's plots: each metric against batch size, and each trial's sampled time series with its phases shaded
(matplotlib figures on the Agg canvas, outside pyplot). ``metric_figure`` and ``trial_figure`` (or ``TrialFigures``,
one figure redrawn from trial to trial) draw; ``plot``/``plot_trial`` save them as the PNGs report.md links, and
``harness.results.html`` embeds the same figures as inline SVG.

Each figure is laid out once (``_lay_out``: matplotlib's tight layout, no layout engine left behind, the ticks fixed
where the layout put them) and then drawn twice, once per output; see benchmarks/report_plots.py for what that
saves."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.record.events import PhaseName, phase_windows
from harness.results.metrics import MB, Metric, title
from harness.results.store import read_events, read_lines
from harness.results.tables import ReportData


def _figure(**kwargs: Any) -> Any:
    """A matplotlib figure on the Agg canvas, outside pyplot (nothing to close: it is freed with its last
    reference), whose renderer and its text metrics cache last as long as the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(dpi=100, **kwargs)
    FigureCanvasAgg(fig)
    return fig


def _lay_out(fig: Any) -> None:
    """``fig.tight_layout()``, then the ticks fixed (``_fix_ticks``) where the layout left them. ``tight_layout``
    leaves a placeholder layout engine on the figure, which makes each ``savefig`` draw the figure twice (a dry run
    first, for the engine): with the engine removed, it draws once."""
    fig.tight_layout()
    fig.set_layout_engine(None)  # (with matplotlib's default rcParams: no automatic layout)
    _fix_ticks(fig)


def _fix_ticks(fig: Any) -> None:
    """Each axis's ticks and labels fixed as its locator and formatter choose them now (a ``FixedLocator`` of the
    same ticks, a ``FixedFormatter`` of the same labels and offset), for the PNG's and the SVG's draws: each draw is
    spared the locator's search and the formatter's choices."""
    from matplotlib.ticker import FixedFormatter, FixedLocator

    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            locator = axis.get_major_locator()
            if isinstance(locator, FixedLocator):  # fixed already (and shared axes share it)
                continue
            ticks = locator()
            formatter = axis.get_major_formatter()
            labels = FixedFormatter(formatter.format_ticks(ticks))
            labels.set_offset_string(formatter.get_offset())
            axis.set_major_locator(FixedLocator(ticks))
            axis.set_major_formatter(labels)


#: What the report says in place of the plots against batch size when ``plotted_metrics`` draws none.
NO_METRIC_PLOTS = ("No plot against batch size: fewer than two batch sizes have a trial that ended ok, so the tables "
                   "hold every figure a plot would.")


def plotted_metrics(data: ReportData) -> list[Metric]:
    """The metrics drawn against batch size: every one of the run's metrics where at least two batch sizes have a
    trial that ended ok, none otherwise (a line needs two points: with one batch size, the tables hold every
    figure a plot would)."""
    sizes = {r.batch_size for r in data.records if r.status == "ok"}
    return list(data.metrics) if len(sizes) >= 2 else []


def metric_figure(data: ReportData, metric: Metric) -> tuple[Any, dict[str, str]]:
    """The metric against batch size (log2 axis), a line per row; ok cells only. Returns the figure and, per point,
    its SVG group id (``<metric key>-<n>``) and a hover text (row, batch size, value with unit), which the HTML report
    puts into the SVG as each point's <title>."""
    table = data.tables[metric.key]
    fig = _figure(figsize=(6.4, 4.0))
    ax = fig.subplots()
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
    _lay_out(fig)
    return fig, tips


def plot(data: ReportData, out_dir: Path,
         then: Callable[[str, Any, dict[str, str]], None] | None = None) -> list[Path]:
    """One PNG per metric drawn against batch size (``plotted_metrics``, ``metric_figure``),
    ``out_dir/<metric key>.png``; ``then(key, figure, tips)``, when given, is called with each figure after it is
    saved (the HTML report saves it again)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric in plotted_metrics(data):
        fig, tips = metric_figure(data, metric)
        path = out_dir / f"{metric.key}.png"
        fig.savefig(path)
        if then is not None:
            then(metric.key, fig, tips)
        paths.append(path)
    return paths


SERIES_TITLES = {"cpu_percent": "CPU %", "rss_bytes": "RSS MB", "gpu_util_percent": "GPU use %",
                 "mem_util_percent": "memory use %", "device_memory_used_bytes": "device MB",
                 "process_memory_bytes": "process MB", "power_w": "power W", "sm_clock_mhz": "SM MHz",
                 "temperature_c": "temperature C", "sm_active_percent": "SM active %",
                 "sm_occupancy_percent": "SM occupancy %", "tensor_active_percent": "tensor active %",
                 "dram_bw_util_percent": "DRAM bandwidth %"}


class TrialFigures:
    """Draws trials' time series (``figure``), reusing one figure for consecutive trials that sample the same
    metrics: its axes, lines and ticks stay, the new samples are set as the lines' data, the phase shading is
    drawn anew, the limits are autoscaled and the layout is computed again. A figure from ``figure`` holds its trial
    until the next call."""

    def __init__(self) -> None:
        self._names: tuple[str, ...] = ()
        self._fig: Any = None
        self._lines: list[Any] = []
        self._spans: list[Any] = []

    def _new(self, names: tuple[str, ...]) -> Any:
        fig = _figure(figsize=(7, 1.6 * len(names) + 0.6))
        axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
        self._lines = []
        for ax, name in zip(axes, names):
            (line,) = ax.plot([], [], lw=1, marker=".", ms=2)
            self._lines.append(line)
            ax.set_ylabel(SERIES_TITLES[name], fontsize=8)
            ax.grid(True, alpha=0.3)
        axes[-1].set_xlabel("seconds since the worker started")
        axes[0].set_title("", fontsize=9)
        self._names, self._fig, self._spans = names, fig, []
        return fig

    def figure(self, run_dir: Path, trial_id: str) -> Any | None:
        """The sampled metrics of one trial over time (seconds since the worker started), with the warm-up (grey)
        and the timed windows (green) shaded; None when the trial has no samples."""
        from matplotlib.ticker import AutoLocator, ScalarFormatter

        samples = read_lines(run_dir / "samples" / f"{trial_id}.jsonl")
        try:
            events = read_events(run_dir, trial_id)
        except FileNotFoundError:
            events = []
        names = tuple(m for m in SERIES_TITLES if any(s.get(m) is not None for s in samples))
        if not samples or not names:
            return None
        fig = self._fig if names == self._names else self._new(names)
        for ax in fig.axes:  # the ticks the last trial's layout fixed: found anew
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_locator(AutoLocator())
                axis.set_major_formatter(ScalarFormatter())
        for span in self._spans:
            span.remove()
        self._spans = []
        t0 = events[0].t if events else samples[0]["t"]
        shaded: tuple[tuple[PhaseName, str], ...] = (("warmup", "0.85"), ("train", "#c8e6c9"))
        windows = [(color, a - t0, b - t0) for phase, color in shaded for a, b in phase_windows(events, phase)]
        for ax, line, name in zip(fig.axes, self._lines, names):
            scale = 1 / MB if name.endswith("_bytes") else 1.0
            line.set_data(*zip(*[(s["t"] - t0, s[name] * scale) for s in samples if s.get(name) is not None]))
            self._spans += [ax.axvspan(a, b, color=color, lw=0) for color, a, b in windows]
        for ax in fig.axes:
            ax.relim()
            ax.autoscale_view()
        fig.axes[0].set_title(f"{trial_id}: warm-up grey, timed windows green", fontsize=9)
        _lay_out(fig)
        return fig


def trial_figure(run_dir: Path, trial_id: str) -> Any | None:
    """The sampled metrics of one trial over time (``TrialFigures.figure``) in a figure of its own; None when the
    trial has no samples."""
    return TrialFigures().figure(run_dir, trial_id)


def plot_trial(run_dir: Path, trial_id: str, out: Path, then: Callable[[Any], None] | None = None,
               figures: TrialFigures | None = None) -> Path | None:
    """The trial's figure (from ``figures``, which reuses one figure from trial to trial, or a figure of its own)
    saved as a PNG at ``out``; ``then(figure)``, when given, is called with it after. None when the trial has no
    samples."""
    fig = (figures or TrialFigures()).figure(run_dir, trial_id)
    if fig is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    if then is not None:
        then(fig)
    return out
