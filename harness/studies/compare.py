"""Compare two runs of the same study: per framework, batch size and metric, the change and whether it is a
regression beyond the noise of this machine.

A cell's value is the median over its ok repeats, the change new / base - 1. A change is a **regression** when it goes
the bad way (throughput or accuracy down, memory up) by more than the threshold **and** its log exceeds
t(1 - alpha / m, df) standard errors (Bonferroni over the m tests). The standard error comes from the repeats' spread
(pooled over cells, moderated per cell), from a history's run-to-run spread where there is one, or else, for
throughput, from an assumed run-to-run drift (``drift_pct``, default ``DEFAULT_DRIFT_PCT``). ``compare_rows``
applies the same rule to two interleaved rows of one run. Cells present or ok on one side only are listed, never
dropped.

Design: docs/design/compare.md (the noise model and the drift floor); measured rates:
docs/findings/2026-11-23-compare.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats as scipy_stats

from harness.record.trial import TrialRecord
from harness.results import tables
from harness.results.metrics import Metric, metrics_for
from harness.results.stats import log_spread, moderated, pooled
from harness.results.store import read_run, read_trials
from harness.studies import history

# metric key in harness.results.report -> True when higher is better
COMPARED = {"throughput": True, "accuracy": True, "memory": False, "allocator_peak": False}
DEFAULT_THRESHOLD_PCT = 5.0
DEFAULT_ALPHA = 0.05  # the chance of any false alarm in a comparison of two runs of the same code
DEFAULT_HISTORY_RUNS = 10
DEFAULT_DRIFT_PCT = 5.0  # assumed run-to-run drift without a history (module docstring)
DRIFTING = {"throughput"}  # metrics that move with the machine's speed from one run to the next
PRIOR_DF = 4  # degrees of freedom the pooled spread lends each cell's own (stats.moderated)
MEDIAN_SE = math.sqrt(math.pi / 2)


@dataclass
class Row:
    """One compared cell and metric. ``change_pct`` is (new - base) / base x 100; ``score`` the log change over its
    standard error and ``needed`` the score a regression must exceed (None without a noise estimate)."""

    framework: str
    batch_size: int
    metric: str
    base: float | None
    new: float | None
    change_pct: float | None
    noise: str
    verdict: str  # "regression", "improvement", "same", "base only", "new only", "failed in base", "failed in new"
    score: float | None = None
    needed: float | None = None


@dataclass
class _Test:
    """What is known of one cell and metric before the verdicts: values, spreads, and the row to fill in."""

    key: str
    row: Row
    n_base: int
    n_new: int
    within: tuple[float, int] | None  # (s, df) of log values, moderated
    between: tuple[float, int] | None
    drift: float = 0.0  # assumed run-to-run drift (log scale) when there is no history spread

    def standard_error(self) -> float | None:
        within = (None if self.within is None else
                  MEDIAN_SE * self.within[0] * math.sqrt(1 / self.n_base + 1 / self.n_new))
        if self.between is not None:
            return max(within or 0.0, math.sqrt(2) * self.between[0])
        if self.drift > 0:
            return math.sqrt((within or 0.0) ** 2 + 2 * self.drift ** 2)
        return within

    def drifting(self) -> bool:
        """Whether the assumed drift is part of this test's noise."""
        return self.between is None and self.drift > 0

    def df(self) -> float:
        dfs = [part[1] for part in (self.within, self.between) if part is not None]
        return max(dfs) if dfs else math.inf  # the drift alone is assumed, not estimated


def _cells(records: list[TrialRecord]) -> set[tuple[str, int]]:
    return {(r.row, r.batch_size) for r in records}


def _status(records: list[TrialRecord], cell: tuple[str, int]) -> str:
    statuses = sorted({r.status for r in records if (r.row, r.batch_size) == cell})
    return "/".join(statuses)


def history_medians(history_file: str | Path | None, spec_name: str, device: str | None, exclude: set[str],
                    last: int) -> list[dict[str, Any]]:
    """The history rows (``harness.studies.history``) of ``spec_name`` on ``device``, the runs in ``exclude``
    left out, the ``last`` newest; [] without a file."""
    if history_file is None or not Path(history_file).exists():
        return []
    rows = [r for r in history.read(history_file)
            if r.get("spec") == spec_name and r.get("device") == device and r.get("run") not in exclude]
    return rows[-last:] if last > 0 else []


def compare_runs(base_dir: str | Path, new_dir: str | Path, threshold_pct: float = DEFAULT_THRESHOLD_PCT,
                 alpha: float = DEFAULT_ALPHA, history_file: str | Path | None = None,
                 history_runs: int = DEFAULT_HISTORY_RUNS,
                 drift_pct: float = DEFAULT_DRIFT_PCT) -> tuple[list[Row], dict[str, Any]]:
    """Rows for every cell of either run and every compared metric, and a summary (run names, devices, counts, and
    per metric what the comparison could resolve). ``drift_pct``: the run-to-run drift assumed where no history
    spread is known (module docstring). Raises FileNotFoundError when a directory is not a run, ValueError for a
    negative ``drift_pct``."""
    if not drift_pct >= 0:
        raise ValueError(f"the drift must be 0 or more percent, not {drift_pct:g}")
    base_run, new_run = read_run(base_dir), read_run(new_dir)
    past = history_medians(history_file, new_run.name, history.device_name(new_run), {Path(new_dir).name},
                           history_runs)
    rows, summary = _compare(read_trials(base_dir), read_trials(new_dir), past, threshold_pct, alpha,
                             math.log1p(drift_pct / 100))
    summary.update(base=Path(base_dir).name, new=Path(new_dir).name, base_device=base_run.device,
                   new_device=new_run.device)
    if base_run.name != new_run.name:
        summary["warning"] = "the runs come from different specs"
    return rows, summary


def compare_rows(run_dir: str | Path, base_row: str, new_row: str, threshold_pct: float = DEFAULT_THRESHOLD_PCT,
                 alpha: float = DEFAULT_ALPHA) -> tuple[list[Row], dict[str, Any]]:
    """Two rows of one run against each other (an interleaved A/B: the baseline and the candidate as two framework
    entries of one spec, e.g. two interpreters, whose trials alternate), cell by cell at each batch size, with the
    same rule and noise model as ``compare_runs``. The machine's drift from one run to the next then falls on both
    sides alike, so only the repeat-to-repeat noise is left to tell apart from a change; a history does not apply.
    ``base_row``/``new_row``: row names as the report prints them (``TrialRecord.row``: the entry's label, with its
    variant in parentheses). Raises FileNotFoundError when the directory is not a run and ValueError
    naming the run's rows when a row is not in it or both are the same."""
    records = read_trials(run_dir)
    run = read_run(run_dir)
    present = sorted({r.row for r in records})
    for name in (base_row, new_row):
        if name not in present:
            raise ValueError(f"{run_dir}: no row {name!r}; its rows: {', '.join(present) or 'none'}")
    if base_row == new_row:
        raise ValueError(f"give two different rows, not {base_row!r} twice")
    common = f"{new_row} vs {base_row}"
    base = [r.model_copy(update={"label": common, "variant": ""}) for r in records if r.row == base_row]
    new = [r.model_copy(update={"label": common, "variant": ""}) for r in records if r.row == new_row]
    rows, summary = _compare(base, new, [], threshold_pct, alpha)
    name = Path(run_dir).name
    summary.update(base=f"{name} [{base_row}]", new=f"{name} [{new_row}]", base_device=run.device,
                   new_device=run.device, interleaved=True)
    return rows, summary


def _compare(base: list[TrialRecord], new: list[TrialRecord], past: list[dict[str, Any]],
             threshold_pct: float, alpha: float, drift: float = 0.0) -> tuple[list[Row], dict[str, Any]]:
    """The rows and the summary's counts for two sets of trial records (cells keyed by row and batch size)."""
    backend = next((r.sampler.backend for r in base + new if r.sampler.backend), "host")
    metrics = {m.key: m for m in metrics_for(backend) if m.key in COMPARED}
    rows: list[Row] = []
    tests: list[_Test] = []
    for cell in sorted(_cells(base) | _cells(new), key=lambda c: (c[0], c[1])):
        fw, bs = cell
        if cell not in _cells(new) or cell not in _cells(base):
            rows.append(Row(fw, bs, "-", None, None, None, "", "base only" if cell not in _cells(new) else "new only"))
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
            row = Row(fw, bs, metric.title, b, n, (n - b) / b * 100 if b else None, "", "same")
            rows.append(row)
            tests.append(_Test(key, row, len(b_values), len(n_values), log_spread([b_values, n_values]),
                               _history_spread(past, key, fw, bs), drift if key in DRIFTING else 0.0))
    resolvable = _judge(tests, metrics, threshold_pct, alpha)
    summary = {
        "threshold_pct": threshold_pct, "alpha": alpha, "history_runs": len(past), "tests": _noisy(tests),
        "drift_pct": math.expm1(drift) * 100 if any(t.drifting() for t in tests) else None,
        "regressions": sum(r.verdict == "regression" for r in rows), "resolvable": resolvable,
        "missing": [f"{r.framework} bs{r.batch_size}: {r.verdict}" for r in rows
                    if r.verdict in ("base only", "new only", "failed in base", "failed in new")],
    }
    return rows, summary


def _noisy(tests: list[_Test]) -> int:
    """The tests that noise could fail: those with a standard error above zero (a metric that repeats exactly, such
    as the accuracy of a deterministic training, cannot raise a false alarm through noise)."""
    return sum(bool(t.standard_error()) for t in tests)


def _history_spread(past: list[dict[str, Any]], key: str, framework: str, batch_size: int) -> tuple[float, int] | None:
    values = [v for row in past if (v := row.get("cells", {}).get(f"{framework}/{batch_size}", {}).get(key))]
    return log_spread([values])


def _judge(tests: list[_Test], metrics: dict[str, Metric], threshold_pct: float,
           alpha: float) -> dict[str, dict[str, Any]]:
    """Moderates every test's spreads, sets each row's score and verdict, and returns what each metric could
    resolve (see the module docstring)."""
    resolvable: dict[str, dict[str, Any]] = {}
    pooled_within = {key: pooled([t.within for t in tests if t.key == key]) for key in metrics}
    pooled_between = {key: pooled([t.between for t in tests if t.key == key]) for key in metrics}
    for t in tests:
        if (prior_within := pooled_within[t.key]) is not None:
            t.within = moderated(t.within, prior_within, PRIOR_DF)
        if (prior_between := pooled_between[t.key]) is not None:
            t.between = moderated(t.between, prior_between, PRIOR_DF)
    count = max(1, _noisy(tests))
    limit = math.log1p(threshold_pct / 100)
    for t in tests:
        row, higher_better = t.row, COMPARED[t.key]
        se = t.standard_error()
        worse = row.change_pct is not None and (row.change_pct < -threshold_pct if higher_better
                                                else row.change_pct > threshold_pct)
        better = row.change_pct is not None and (row.change_pct > threshold_pct if higher_better
                                                 else row.change_pct < -threshold_pct)
        if se is None or row.base is None or row.new is None or row.base <= 0 or row.new <= 0:
            row.noise = "threshold only (no repeats)"
            beyond = True
        else:
            row.needed = float(scipy_stats.t.ppf(1 - alpha / count, t.df()))
            change = abs(math.log(row.new / row.base))
            row.score = math.inf if se == 0 and change > 0 else 0.0 if se == 0 else change / se
            beyond = row.score > row.needed
            row.noise = (f"{row.score:.1f} se, needs {row.needed:.1f}" if math.isfinite(row.score)
                         else "no spread in repeats")
            if t.drifting():
                row.noise += ", with drift" if t.within is not None else " (drift only, no repeats)"
        row.verdict = ("regression" if worse and beyond else "improvement" if better and beyond else "same")
    for key, metric in metrics.items():
        mine = [t for t in tests if t.key == key and t.standard_error() is not None]
        if not mine:
            continue
        n = int(np.median([min(t.n_base, t.n_new) for t in mine]))
        needed = float(scipy_stats.t.ppf(1 - alpha / count, float(np.median([t.df() for t in mine]))))
        se = float(np.median([t.standard_error() for t in mine]))
        within, between = pooled_within[key], pooled_between[key]
        drift = max((t.drift for t in mine if t.drifting()), default=0.0)
        resolvable[metric.title] = {
            "pct": max(threshold_pct, math.expm1(needed * se) * 100), "repeats": n, "cells": len(mine),
            "within_pct": None if within is None else math.expm1(within[0]) * 100,
            "between_pct": None if between is None else math.expm1(between[0]) * 100,
            "drift_pct": math.expm1(drift) * 100 if drift else None,
            "repeats_for_threshold": _repeats_for(limit / needed, None if within is None else within[0], drift),
        }
    return resolvable


def _repeats_for(se_limit: float, within: float | None, drift: float) -> int | None:
    """Repeats a side for a standard error of ``se_limit``: 2 x (pi / 2) s^2 / r + 2 d^2 <= se_limit^2 (0 when
    the drift alone already exceeds it: no number of repeats gets there)."""
    room = se_limit ** 2 - 2 * drift ** 2
    if room <= 0:
        return 0
    if within is None or within == 0:
        return None
    return math.ceil(2 * MEDIAN_SE ** 2 * within ** 2 / room)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def resolvable_lines(summary: dict[str, Any]) -> list[str]:
    """One line per metric: what this comparison could tell apart from noise, and what it would take."""
    lines = []
    if summary.get("drift_pct") is not None:
        lines.append(f"- Without a history: between-run drift floor {summary['drift_pct']:.1f} % assumed for "
                     "throughput (runs minutes apart differ by more than their repeats, and two runs cannot tell a "
                     "shift of the whole run from a change; --drift-pct sets it, --history measures it, --rows "
                     "cancels it)")
    for title, r in summary.get("resolvable", {}).items():
        spreads = [f"repeat-to-repeat spread {r['within_pct']:.1f} %" if r.get("within_pct") is not None else "",
                   f"run-to-run spread {r['between_pct']:.1f} % over {summary['history_runs']} history runs"
                   if r.get("between_pct") is not None else "",
                   f"assumed drift {r['drift_pct']:.1f} %" if r.get("drift_pct") is not None else ""]
        if r.get("repeats_for_threshold") == 0 and r["pct"] > summary["threshold_pct"]:
            more = (f"; no number of repeats resolves {summary['threshold_pct']:g} % against the assumed drift: "
                    "a history or an interleaved run (--rows) can")
        elif r.get("repeats_for_threshold") and r["pct"] > summary["threshold_pct"]:
            more = f"; {summary['threshold_pct']:g} % would take about {r['repeats_for_threshold']} repeats"
        else:
            more = ""
        lines.append(f"- {title}: changes under {r['pct']:.1f} % cannot be told apart from noise on this machine "
                     f"with {r['repeats']} repeat(s) ({'; '.join(filter(None, spreads))}; {r['cells']} cells){more}")
    return lines


def to_markdown(rows: list[Row], summary: dict[str, Any]) -> str:
    """The comparison as Markdown: a header with the verdict and what it could resolve, then one table row per
    cell and metric."""
    lines = [f"# Compare {summary['base']} -> {summary['new']}", "",
             f"- Regressions beyond {summary['threshold_pct']:g}% and the noise: {summary['regressions']} "
             f"({summary['tests']} tests, at most {summary['alpha'] * 100:g} % chance of any false alarm where the "
             "noise model holds)",
             f"- Devices: {summary['base_device']} -> {summary['new_device']}"]
    if summary.get("interleaved"):
        lines.append("- Two rows of one run, their trials interleaved: the machine's drift between runs falls on both")
    if summary.get("warning"):
        lines.append(f"- Warning: {summary['warning']}")
    if summary["missing"]:
        lines.append(f"- Missing or failed on one side: {'; '.join(summary['missing'])}")
    lines += resolvable_lines(summary)
    lines += ["", "| framework | batch size | metric | base | new | change % | noise | verdict |",
              "| --- | ---: | --- | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        verdict = "**regression**" if r.verdict == "regression" else r.verdict
        lines.append(f"| {r.framework} | {r.batch_size} | {r.metric} | {_fmt(r.base)} | {_fmt(r.new)} | "
                     f"{_fmt(r.change_pct, 1)} | {r.noise} | {verdict} |")
    return "\n".join(lines) + "\n"
