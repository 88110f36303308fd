"""A run directory as data: ``load_run(path)`` gives a ``Run`` whose trials, epochs, samples and summary are pandas
DataFrames with flat columns (units in their names) over its typed records (``harness.record``, read through
``harness.results.store``); ``load_history(folder)`` gives the trials of many runs. The report is written from the
same ``Run`` (``Run.data``, the ``ReportData`` that ``harness.results.tables`` computes from it), so what a user
computes from these frames and what the report prints come from one reading of the files.

Reading is strict about what would be misread and lenient about what a crash leaves: a torn last line of
trials.jsonl is dropped (as ``store.read_lines`` does); a run or record of a newer schema version is one-line
``SchemaError``; a missing samples file is ``FileNotFoundError`` naming the trial and the file (the trial's record is
still in ``trials``).

    import harness
    run = harness.load_run("results/20261123T120000Z-quick")
    ok = run.trials[run.trials.status == "ok"]
    ok.pivot_table(index="row", columns="batch_size", values="throughput_samples_per_s", aggfunc="median")
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd

from harness.record.events import Event, phase_windows
from harness.record.run import RunRecord
from harness.record.trial import TrialRecord
from harness.results import derived
from harness.results.schema import SCHEMA_VERSION, SchemaError
from harness.results.store import read_events, read_lines, read_run, read_trials
from harness.results.tables import ReportData, compute


def _cpus(record: TrialRecord) -> str | None:
    cpus = record.placement.cpus if record.placement is not None else None
    return None if cpus is None else ",".join(map(str, cpus))


def _phase(name: str) -> Callable[[TrialRecord], float | None]:
    """A reader of one of the record's phases (``TrialPhases``), seconds."""
    return lambda r: None if r.phases is None else getattr(r.phases, name)


#: The columns of ``Run.trials`` after the identity columns: name (units in the name) -> how it is read from a trial
#: record (results/README.md says what each field means).
TRIAL_COLUMNS: dict[str, Callable[[TrialRecord], Any]] = {
    "wall_seconds": lambda r: r.wall_s,
    "throughput_samples_per_s": lambda r: r.metrics.throughput_samples_per_s,
    "seconds_per_epoch": lambda r: r.metrics.epoch_time_s,
    "step_time_median_s": lambda r: r.metrics.step_time_median_s,
    "step_time_p90_s": lambda r: r.metrics.step_time_p90_s,
    "first_step_s": lambda r: r.metrics.first_step_s,
    "measured_steps": lambda r: r.metrics.measured_steps,
    "measured_samples": lambda r: r.metrics.measured_samples,
    "measured_seconds": lambda r: r.metrics.measured_s,
    "slow_windows": lambda r: r.metrics.slow_windows,
    "recompilations": lambda r: r.metrics.recompilations,
    "test_accuracy": lambda r: r.metrics.test_accuracy,
    "test_loss": lambda r: r.metrics.test_loss,
    "final_train_loss": lambda r: r.metrics.final_train_loss,
    "peak_memory_bytes": derived.peak_memory_bytes,
    "rss_peak_bytes": lambda r: r.sampler.stat("rss_bytes", "max"),
    "rss_anon_peak_bytes": lambda r: r.sampler.stat("rss_anon_bytes", "max"),
    "cpu_util_mean_pct": lambda r: r.sampler.stat("cpu_pct", "mean"),
    "gpu_util_mean_pct": lambda r: r.sampler.stat("gpu_util_pct", "mean"),
    "gpu_util_max_pct": lambda r: r.sampler.stat("gpu_util_pct", "max"),
    "sm_active_mean_pct": lambda r: r.sampler.stat("sm_active_pct", "mean"),
    "sm_occupancy_mean_pct": lambda r: r.sampler.stat("sm_occupancy_pct", "mean"),
    "tensor_active_mean_pct": lambda r: r.sampler.stat("tensor_active_pct", "mean"),
    "dram_bw_util_mean_pct": lambda r: r.sampler.stat("dram_bw_util_pct", "mean"),
    "device_memory_peak_bytes": lambda r: r.sampler.stat("device_memory_used_bytes", "max"),
    "process_memory_peak_bytes": lambda r: r.sampler.stat("process_memory_bytes", "max"),
    "allocator_peak_bytes": lambda r: r.metrics.memory.allocator_peak_bytes,
    "allocator_reserved_peak_bytes": lambda r: r.metrics.memory.allocator_reserved_peak_bytes,
    "data_bytes": lambda r: r.metrics.data_bytes,
    "power_mean_w": lambda r: None if r.sampler.energy is None else r.sampler.energy.mean_power_w,
    "energy_j": derived.energy_j,
    "energy_per_sample_j": derived.energy_per_sample_j,
    "achieved_flops_per_s": lambda r: r.metrics.achieved_flops_per_s,
    "mfu": derived.mfu_fraction,
    "sampler_backend": lambda r: r.sampler.backend,
    "node": lambda r: None if r.placement is None else r.placement.node,
    "pinned_cpus": _cpus,
    "started_unix_s": lambda r: None if r.placement is None else r.placement.started_unix_s,
    "ended_unix_s": lambda r: None if r.placement is None else r.placement.ended_unix_s,
    "finished": lambda r: r.finished,
    "worker_start": lambda r: r.start,
    **{f"phase_{name}": _phase(name) for name in ("start_s", "import_s", "prepare_s", "data_s", "build_s",
                                                   "warmup_s", "timed_s", "eval_s", "other_s", "teardown_s",
                                                   "total_s")},
}

IDENTITY = ("id", "row", "label", "framework", "environment", "variant", "precision", "compile", "batch_size",
            "effective_batch_size", "accumulation_steps", "data_parallel", "per_device_batch_size", "seed", "repeat",
            "device", "threads", "learning_rate", "status", "reason", "schema_version")
#: The identity columns read as the record's field of the same name.
_FIELDS = tuple(name for name in IDENTITY if name not in ("row", "environment"))


@dataclass
class Run:
    """One run directory, read once through ``harness.results.store``: ``info``, its run.json (``RunRecord``);
    ``records``, its trial records (``TrialRecord``, in the order they finished). The frames are computed on first
    use."""

    path: Path
    info: RunRecord
    records: list[TrialRecord]
    _samples: dict[str, pd.DataFrame] = field(default_factory=dict, repr=False)

    @property
    def spec(self) -> dict[str, Any]:
        """The spec as run (after CLI overrides), as run.json holds it."""
        return self.info.spec

    @property
    def machine(self) -> dict[str, Any]:
        """What run.json recorded about the machine and the harness's environment (``harness.measure.machine``)."""
        return self.info.environment

    @property
    def schema_version(self) -> int:
        return self.info.schema_version

    @cached_property
    def trials(self) -> pd.DataFrame:
        """One row per trial: the identity columns (``IDENTITY``; ``row`` is the report's row label, ``environment``
        the interpreter the framework entry ran in), then ``TRIAL_COLUMNS`` (NaN where a trial has no such value:
        not ok, or a metric its device does not have)."""
        environments = {entry.label: entry.executable or entry.python or "" for entry in self.info.frameworks}
        rows = []
        for record in self.records:
            row: dict[str, Any] = {key: getattr(record, key) for key in _FIELDS}
            row["row"] = record.row
            row["environment"] = environments.get(record.label)
            row.update({name: read(record) for name, read in TRIAL_COLUMNS.items()})
            rows.append(row)
        frame = pd.DataFrame(rows, columns=[*IDENTITY, *TRIAL_COLUMNS])
        for name in TRIAL_COLUMNS:
            if name not in ("sampler_backend", "node", "pinned_cpus", "finished"):
                frame[name] = pd.to_numeric(frame[name], errors="coerce")
        return frame

    @cached_property
    def epochs(self) -> pd.DataFrame:
        """One row per trial and evaluation (every epoch, unless the spec's ``evaluate_every`` k > 1: then every k-th
        and the last): ``id``, ``row``, ``batch_size``, ``seed``, ``repeat``, ``epoch`` (0-based, the epoch the
        evaluation followed), ``train_loss``, ``test_loss``, ``test_accuracy`` (fraction), ``timed_seconds`` (since
        the evaluation before)."""
        rows = [{"id": r.id, "row": r.row, "batch_size": r.batch_size, "seed": r.seed, "repeat": r.repeat,
                 "epoch": e.epoch, "train_loss": e.train_loss, "test_loss": e.test_loss,
                 "test_accuracy": e.test_accuracy, "timed_seconds": e.timed_s}
                for r in self.records for e in r.metrics.epochs]
        return pd.DataFrame(rows, columns=["id", "row", "batch_size", "seed", "repeat", "epoch", "train_loss",
                                           "test_loss", "test_accuracy", "timed_seconds"])

    def events(self, trial: str) -> list[Event]:
        """The worker's events of one trial (``events/<id>.jsonl``), typed; raises FileNotFoundError naming it."""
        return read_events(self.path, trial)

    def samples(self, trial: str) -> pd.DataFrame:
        """The sampler's time series of one trial: ``t`` (time.monotonic() seconds, the worker events' clock),
        ``t_s`` (seconds since the first sample), ``edge`` (start/end at a timed window's edge), each sampled metric
        (as in samples/*.jsonl, the sampler's names: ``cpu_percent``, ``rss_bytes``; with NVML ``gpu_util_percent``,
        ``power_w``, ...) and ``phase``: ``warmup``, ``train`` (a timed window), ``eval`` or ``other`` (start-up,
        between phases), from the worker's events. Raises KeyError for an unknown trial id and FileNotFoundError,
        naming the file, when the trial has no samples file (a trial that never started a worker, or a file lost)."""
        if trial in self._samples:
            return self._samples[trial]
        if trial not in {r.id for r in self.records}:
            raise KeyError(f"{self.path}: no trial {trial!r} in trials.jsonl")
        path = self.path / "samples" / f"{trial}.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"{path}: the samples of trial {trial} are missing (its record is in "
                                    "trials.jsonl; skipped and unsupported trials have none)")
        frame = pd.DataFrame(read_lines(path))
        if "edge" not in frame:
            frame["edge"] = None
        try:
            events = self.events(trial)
        except FileNotFoundError:
            events = []
        frame["phase"] = "other"
        for phase in ("warmup", "eval", "train"):
            for start, end in phase_windows(events, phase):
                frame.loc[(frame["t"] >= start) & (frame["t"] <= end), "phase"] = phase
        if len(frame):
            frame.insert(1, "t_s", frame["t"] - frame["t"].iloc[0])
        self._samples[trial] = frame
        return frame

    @cached_property
    def data(self) -> ReportData:
        """What the report prints, computed from this run (``harness.results.tables.compute``)."""
        return compute(self.info, self.records, self.path)

    def summary(self) -> pd.DataFrame:
        """The report's metric tables as one long frame: per metric, row and batch size, ``value`` (the median over
        ok repeats, or with several seeds the mean over seeds, as in the report), ``ci_low``/``ci_high`` (its 95 %
        interval where the report prints one), ``cell`` (the status text where no repeat ended ok), ``metric``,
        ``title``, ``unit`` and ``meaning``."""
        data = self.data
        rows = []
        for metric in data.metrics:
            table, cis = data.tables[metric.key], data.cis.get(metric.key, {})
            for row in table.index:
                for batch_size, value in table.loc[row].items():
                    number = isinstance(value, float)
                    low, high = cis.get((row, batch_size), (math.nan, math.nan))
                    rows.append({"metric": metric.key, "title": metric.title, "unit": metric.unit, "row": row,
                                 "batch_size": int(batch_size), "value": value if number else math.nan,
                                 "ci_low": low, "ci_high": high, "cell": "" if number else str(value),
                                 "meaning": metric.meaning})
        return pd.DataFrame(rows, columns=["metric", "title", "unit", "row", "batch_size", "value", "ci_low",
                                           "ci_high", "cell", "meaning"])


def load_run(path: str | os.PathLike[str]) -> Run:
    """Reads a run directory (run.json, trials.jsonl); a torn last line of trials.jsonl (a crash mid-write) is dropped.

    Args:
        path: the run directory, ``results/<UTC time>-<spec>/``.

    Returns:
        The ``Run``: ``info`` (run.json), ``records`` (the trials in the order they finished), and its frames.

    Raises:
        FileNotFoundError: ``path`` is not a run directory.
        SchemaError: run.json or a trial record was written with a newer schema than this harness reads
            (``harness.results.schema``)."""
    path = Path(path)
    return Run(path, read_run(path), read_trials(path))


def load_history(folder: str | os.PathLike[str] | list[str | os.PathLike[str]]) -> pd.DataFrame:
    """The trials of many runs in one frame, oldest run first.

    Args:
        folder: a folder whose run directories (each with a run.json) lie directly under it, or a list of run
            directories.

    Returns:
        ``Run.trials`` of every run, with ``run`` (the directory's name), ``run_started`` (run.json's start time) and
        ``git_commit`` in front.

    Raises:
        FileNotFoundError: no run directory there.
        SchemaError: as ``load_run``."""
    if isinstance(folder, (list, tuple)):
        paths = [Path(p) for p in folder]
    else:
        paths = sorted(p for p in Path(folder).iterdir() if (p / "run.json").is_file())
    if not paths:
        raise FileNotFoundError(f"{folder}: no run directories (folders with a run.json)")
    frames = []
    for path in paths:
        run = load_run(path)
        frame = run.trials.copy()
        frame.insert(0, "run", path.name)
        frame.insert(1, "run_started", run.info.started)
        frame.insert(2, "git_commit", (run.machine.get("git") or {}).get("commit"))
        frames.append(frame)
    history = pd.concat(frames, ignore_index=True)
    return history.sort_values(["run_started", "run"], kind="stable", ignore_index=True)


def build(run_dir: str | os.PathLike[str]) -> ReportData:
    """Reads a run directory (``load_run``: schema-checked) and computes what the report shows of it."""
    return load_run(run_dir).data


__all__ = ["SCHEMA_VERSION", "TRIAL_COLUMNS", "Run", "SchemaError", "build", "load_history", "load_run"]
