"""A run directory as data: ``load_run(path)`` gives a ``Run`` whose trials, epochs, samples and summary are pandas
DataFrames with flat columns (units in their names); ``load_history(folder)`` gives the trials of many runs. The
report is written from the same ``Run`` (``Run.data`` is what ``harness.results.tables`` computes from it), so what a
user computes from these frames and what the report prints come from one reading of the files.

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

from harness.measure.sampler import windows_from_events
from harness.results.metrics import read_path, row_key
from harness.results.schema import SCHEMA_VERSION, SchemaError
from harness.results.store import read_lines, read_run, read_trials


def _path(*keys: str) -> Callable[[dict[str, Any]], Any]:
    return lambda record: read_path(record, *keys)


def _peak_memory(record: dict[str, Any]) -> Any:
    """The report's memory metric in bytes: the worker's NVML process memory on a GPU (device memory where NVML has
    no per-process figure), the resident memory of the worker's process tree on the CPU."""
    for keys in (("process_memory_bytes", "max"), ("device_memory_used_bytes", "max"), ("rss_bytes", "max")):
        if (value := read_path(record, "sampler", "stats", *keys)) is not None:
            return value
    return None


def _energy_per_sample(record: dict[str, Any]) -> Any:
    joules, samples = read_path(record, "sampler", "energy", "joules"), read_path(record, "metrics", "measured_samples")
    return joules / samples if joules is not None and samples else None


def _placement(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda record: (record.get("placement") or {}).get(key)


#: The columns of ``Run.trials`` after the identity columns: name (units in the name) -> how it is read from a trial
#: record (results/README.md says what each field means).
TRIAL_COLUMNS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "wall_seconds": _path("wall_seconds"),
    "throughput_samples_per_s": _path("metrics", "throughput"),
    "seconds_per_epoch": _path("metrics", "seconds_per_epoch"),
    "step_time_median_s": _path("metrics", "step_time_median_s"),
    "step_time_p90_s": _path("metrics", "step_time_p90_s"),
    "first_step_s": _path("metrics", "first_step_seconds"),
    "measured_steps": _path("metrics", "measured_steps"),
    "measured_samples": _path("metrics", "measured_samples"),
    "measured_seconds": _path("metrics", "measured_seconds"),
    "slow_windows": _path("metrics", "slow_windows"),
    "recompilations": _path("metrics", "recompilations"),
    "test_accuracy": _path("metrics", "test_accuracy"),
    "test_loss": _path("metrics", "test_loss"),
    "final_train_loss": _path("metrics", "final_train_loss"),
    "peak_memory_bytes": _peak_memory,
    "rss_peak_bytes": _path("sampler", "stats", "rss_bytes", "max"),
    "cpu_util_mean_pct": _path("sampler", "stats", "cpu_percent", "mean"),
    "gpu_util_mean_pct": _path("sampler", "stats", "gpu_util_percent", "mean"),
    "gpu_util_max_pct": _path("sampler", "stats", "gpu_util_percent", "max"),
    "sm_active_mean_pct": _path("sampler", "stats", "sm_active_percent", "mean"),
    "sm_occupancy_mean_pct": _path("sampler", "stats", "sm_occupancy_percent", "mean"),
    "tensor_active_mean_pct": _path("sampler", "stats", "tensor_active_percent", "mean"),
    "dram_bw_util_mean_pct": _path("sampler", "stats", "dram_bw_util_percent", "mean"),
    "device_memory_peak_bytes": _path("sampler", "stats", "device_memory_used_bytes", "max"),
    "process_memory_peak_bytes": _path("sampler", "stats", "process_memory_bytes", "max"),
    "allocator_peak_bytes": _path("metrics", "memory", "allocator_peak_bytes"),
    "allocator_reserved_peak_bytes": _path("metrics", "memory", "allocator_reserved_peak_bytes"),
    "data_bytes": _path("metrics", "data_bytes"),
    "power_mean_w": _path("sampler", "energy", "mean_power_w"),
    "energy_j": _path("sampler", "energy", "joules"),
    "energy_per_sample_j": _energy_per_sample,
    "achieved_flops_per_s": _path("metrics", "achieved_flops"),
    "mfu": _path("metrics", "mfu"),
    "sampler_backend": _path("sampler", "backend"),
    "node": _placement("node"),
    "pinned_cpus": lambda r: None if (c := _placement("cpus")(r)) is None else ",".join(map(str, c)),
    "started_unix_s": _placement("started"),
    "ended_unix_s": _placement("ended"),
    "finished": _path("finished"),
}

IDENTITY = ("id", "row", "label", "framework", "environment", "variant", "precision", "compile", "batch_size",
            "effective_batch_size", "accumulation_steps", "data_parallel", "per_device_batch_size", "seed", "repeat",
            "device", "threads", "learning_rate", "status", "reason", "schema_version")


@dataclass
class Run:
    """One run directory, read once. ``info``: run.json as a dict; ``records``: the trial records (dicts, in the order
    they finished). The frames are computed on first use."""

    path: Path
    info: dict[str, Any]
    records: list[dict[str, Any]]
    _samples: dict[str, pd.DataFrame] = field(default_factory=dict, repr=False)

    @property
    def spec(self) -> dict[str, Any]:
        """The spec as run (after CLI overrides), as run.json holds it."""
        return self.info["spec"]

    @property
    def machine(self) -> dict[str, Any]:
        """What run.json recorded about the machine and the harness's environment (``harness.measure.machine``)."""
        return self.info.get("environment", {})

    @property
    def schema_version(self) -> int:
        return int(self.info.get("schema_version", 0))

    @cached_property
    def trials(self) -> pd.DataFrame:
        """One row per trial: the identity columns (``IDENTITY``; ``row`` is the report's row label, ``environment``
        the interpreter the framework entry ran in), then ``TRIAL_COLUMNS`` (NaN where a trial has no such value:
        not ok, or a metric its device does not have)."""
        environments = _environments(self.info)
        rows = []
        for record in self.records:
            row: dict[str, Any] = {key: record.get(key) for key in IDENTITY}
            row["row"] = row_key(record)
            row["label"] = record.get("label") or record["framework"]
            row["environment"] = environments.get(row["label"])
            row["schema_version"] = int(record.get("schema_version", 0))
            row["reason"] = record.get("reason") or ""
            row["variant"] = record.get("variant") or ""
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
        rows = [{"id": r["id"], "row": row_key(r), "batch_size": r["batch_size"], "seed": r.get("seed", 0),
                 "repeat": r["repeat"], **{k: e.get(k) for k in ("epoch", "train_loss", "test_loss", "test_accuracy",
                                                                  "timed_seconds")}}
                for r in self.records for e in (read_path(r, "metrics", "epochs") or [])]
        return pd.DataFrame(rows, columns=["id", "row", "batch_size", "seed", "repeat", "epoch", "train_loss",
                                           "test_loss", "test_accuracy", "timed_seconds"])

    def events(self, trial: str) -> list[dict[str, Any]]:
        """The worker's events of one trial (``events/<id>.jsonl``); raises FileNotFoundError naming it."""
        path = self.path / "events" / f"{trial}.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no events for trial {trial}")
        return read_lines(path)

    def samples(self, trial: str) -> pd.DataFrame:
        """The sampler's time series of one trial: ``t`` (time.monotonic() seconds, the worker events' clock),
        ``t_s`` (seconds since the first sample), ``edge`` (start/end at a timed window's edge), each sampled metric
        (as in samples/*.jsonl: ``cpu_percent``, ``rss_bytes``; with NVML ``gpu_util_percent``, ``power_w``,
        ...) and ``phase``: ``warmup``, ``train`` (a timed window), ``eval`` or ``other`` (start-up, between
        phases), from the worker's events. Raises KeyError for an unknown trial id and FileNotFoundError, naming
        the file, when the trial has no samples file (a trial that never started a worker, or a file lost)."""
        if trial in self._samples:
            return self._samples[trial]
        if trial not in {r["id"] for r in self.records}:
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
            for start, end in windows_from_events(events, phase):
                frame.loc[(frame["t"] >= start) & (frame["t"] <= end), "phase"] = phase
        if len(frame):
            frame.insert(1, "t_s", frame["t"] - frame["t"].iloc[0])
        self._samples[trial] = frame
        return frame

    @cached_property
    def data(self) -> dict[str, Any]:
        """What the report prints, computed from this run (``harness.results.tables.compute``)."""
        from harness.results import tables

        return tables.compute(self.info, self.records)

    def summary(self) -> pd.DataFrame:
        """The report's metric tables as one long frame: per metric, row and batch size, ``value`` (the median over
        ok repeats, or with several seeds the mean over seeds, as in the report), ``ci_low``/``ci_high`` (its 95 %
        interval where the report prints one), ``cell`` (the status text where no repeat ended ok), ``metric``,
        ``title``, ``unit`` and ``meaning``."""
        data = self.data
        rows = []
        for metric in data["metrics"]:
            table, cis = data["tables"][metric.key], data["cis"].get(metric.key, {})
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


def _environments(info: dict[str, Any]) -> dict[str, str]:
    """Per framework row label, the interpreter its workers ran in (as probed before the first trial)."""
    out = {}
    for entry in info.get("frameworks") or []:
        if isinstance(entry, dict) and entry.get("label"):
            out[entry["label"]] = entry.get("executable") or entry.get("python") or ""
    return out


def load_run(path: str | os.PathLike[str]) -> Run:
    """Reads a run directory (run.json, trials.jsonl). Raises FileNotFoundError when ``path`` is not a run directory
    and SchemaError when run.json or a trial record was written with a newer schema than this harness reads
    (``harness.results.schema``); a torn last line of trials.jsonl (a crash mid-write) is dropped."""
    path = Path(path)
    return Run(path, read_run(path), read_trials(path))


def load_history(folder: str | os.PathLike[str] | list[str | os.PathLike[str]]) -> pd.DataFrame:
    """The trials of many runs in one frame: ``Run.trials`` of every run directory directly under ``folder`` (or of
    each listed directory), oldest first, with ``run`` (the directory's name), ``run_started`` (run.json's start
    time) and ``git_commit``. Raises FileNotFoundError when there is no run there; SchemaError as ``load_run``."""
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
        frame.insert(1, "run_started", run.info.get("started"))
        frame.insert(2, "git_commit", read_path(run.machine, "git", "commit"))
        frames.append(frame)
    history = pd.concat(frames, ignore_index=True)
    return history.sort_values(["run_started", "run"], kind="stable", ignore_index=True)


__all__ = ["Run", "load_run", "load_history", "SchemaError", "SCHEMA_VERSION", "TRIAL_COLUMNS"]
