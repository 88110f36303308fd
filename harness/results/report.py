"""Run directory -> the report's sections (``harness.results.sections``: computed once from the run's typed
``ReportData``), rendered as ``report.md`` and ``report.html`` (``harness.results.html``), and ``plots/*.png``.

Every table has one row per framework and one column per batch size, like the tables of the Ohio State thesis quoted
in seed 002, so the two can be put side by side. A cell is the median over the repeats that ended ``ok``; a cell
with no ``ok`` repeat shows the status instead (``oom``, ``error``, ``timeout``, ``crashed``, ``skipped``,
``unsupported``). The tables are ``harness.results.tables``'s; the sections come from ``overview`` (header, layouts,
metrics, failures, plots), the study modules and ``notes`` (how the run was measured).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.results import html
from harness.results.answer import answer_section
from harness.results.batch_studies import powers_of_two_section, scaling_section, time_to_target_section
from harness.results.data import build, load_run
from harness.results.data_parallel import data_parallel_section
from harness.results.input_pipeline import input_pipeline_section
from harness.results.keras_native import keras_native_section
from harness.results.memory_breakdown import memory_breakdown_section
from harness.results.models import models_section
from harness.results.notes import measurement_notes, slow_window_notes
from harness.results.overview import (
    environment_section,
    failed_section,
    header_section,
    memory_layers_section,
    metric_section,
    ohio_state_section,
    plots_section,
)
from harness.results.placement import side_by_side_section
from harness.results.plots import TrialFigures, plot, plot_trial
from harness.results.precision import precision_accuracy_section
from harness.results.sections import Section, to_markdown
from harness.results.tables import ReportData
from harness.results.time_budget import time_budget_section

__all__ = ["ReportData", "build", "render_markdown", "sections", "trial_plots", "write"]


def study_sections(data: ReportData) -> list[Section | None]:
    """Sections for the batch-size studies a spec turns on: learning-rate scaling and gradient accumulation,
    data-parallel scaling, the input pipeline (resident against loader), time to a target accuracy, powers of two
    against their neighbours, and mixed precision's accuracy against fp32's (None for each the run does not have)."""
    return [scaling_section(data), data_parallel_section(data), input_pipeline_section(data),
            time_to_target_section(data), powers_of_two_section(data), precision_accuracy_section(data)]


def sections(data: ReportData) -> list[Section]:
    """The whole report as sections: the header, the answer the data supports, the environments, the models (where an
    entry brings its own), the Ohio State layout, the memory layers, one section per metric, Keras over native
    (where a Keras row's native framework is in the run), the study sections, how the sampler fared, where the
    trials' time went, the failed trials and the plots. Sections with nothing to say are left out."""
    found = [header_section(data), answer_section(data), environment_section(data), models_section(data),
             ohio_state_section(data),
             memory_layers_section(data), memory_breakdown_section(data),
             *(metric_section(data, metric) for metric in data.metrics),
             keras_native_section(data), *study_sections(data), measurement_notes(data), slow_window_notes(data),
             time_budget_section(data), side_by_side_section(data), failed_section(data), plots_section(data)]
    return [section for section in found if section is not None]


def render_markdown(data: ReportData, computed: list[Section] | None = None) -> str:
    """The whole report.md text: ``sections`` (or the ``computed`` ones) in Markdown."""
    return to_markdown(sections(data) if computed is None else computed)


def _one_blas_thread() -> Any:
    """A context in which BLAS uses one thread (threadpoolctl, a dependency of scikit-learn's): matplotlib's transforms
    call numpy.linalg on 3x3 matrices thousands of times a report, and OpenBLAS's other threads spin after each call,
    about as much CPU again as the whole report on a 2-core machine, for no speed."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - scikit-learn brings it
        import contextlib

        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


def trial_plots(run_dir: Path, trial_ids: list[str]) -> dict[str, str | None]:
    """Each trial's time series saved as ``plots/trials/<id>.png``, in one figure redrawn from trial to trial
    (``TrialFigures``); returns, per trial, the same figure as report.html's inline SVG (None: no samples, no
    figure)."""
    svgs: dict[str, str | None] = {}
    figures = TrialFigures()
    for trial_id in trial_ids:
        svgs[trial_id] = None

        def keep(fig: Any, trial_id: str = trial_id) -> None:
            svgs[trial_id] = html.svg(fig)

        plot_trial(run_dir, trial_id, run_dir / "plots" / "trials" / f"{trial_id}.png", then=keep, figures=figures)
    return svgs


def write(run_dir: str | Path, data: ReportData | None = None) -> Path:
    """Writes ``report.md`` and ``report.html`` (``harness.results.html``), both from one computation of the
    sections, and ``plots/`` (per-metric plots, and per-trial time series in ``plots/trials/``) into the run
    directory; returns the report's path. ``data``: the run as ``build`` read it, where the caller has it (None:
    read here). BLAS is held to one thread meanwhile (``_one_blas_thread``)."""
    run_dir = Path(run_dir)
    with _one_blas_thread():
        data = load_run(run_dir).data if data is None else data
        # each figure drawn once: saved as the PNG report.md links, then as report.html's inline SVG
        metric_svgs: dict[str, str] = {}

        def keep_metric(key: str, fig: Any, tips: dict[str, str]) -> None:
            metric_svgs[key] = html.svg(fig, tips)

        plot(data, run_dir / "plots", then=keep_metric)
        trial_svgs = trial_plots(run_dir, [record.id for record in data.records if record.status == "ok"])
        computed = sections(data)
    path = run_dir / "report.md"
    path.write_text(to_markdown(computed), encoding="utf-8")
    html.write(data, run_dir, computed, metric_svgs, trial_svgs)
    return path
