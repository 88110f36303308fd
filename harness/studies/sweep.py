"""Runs a whole spec: plan the trials, run each in its own worker, write every finished trial before the next."""

from __future__ import annotations

import signal
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness import __version__
from harness.execution.environments import probe_entries
from harness.execution.executors import ExecutorError, LocalExecutor, local_slots
from harness.execution.launcher import Outcome
from harness.execution.protocol import Payload
from harness.measure import machine, peaks
from harness.measure.machine import resolve_device
from harness.plan import Status, Trial, check_devices, data_parallel_settings, plan, unsupported_reason
from harness.results.schema import SCHEMA_VERSION, Placement, SamplerInfo, TrialMetrics, TrialRecord
from harness.results.store import (
    append_trial,
    create_run_dir,
    drop_torn_tail,
    read_run,
    read_trials,
    write_json,
    write_lines,
)
from harness.spec import Spec, SpecError


def trial_record(trial: Trial, outcome: Outcome) -> TrialRecord:
    """The record of one trial a worker ran: identity, status and reason, metrics, sampler statistics, versions
    (its trials.jsonl line is ``TrialRecord.data``)."""
    result = outcome.result() or {}
    ready = next((e for e in outcome.events if e.get("event") == "ready"), {})
    metrics = dict(result.get("metrics", {}))
    add_mfu({"metrics": metrics, "device": trial.device, "sampler": outcome.sampler,
             "data_parallel": trial.data_parallel}, trial.precision)
    extra: dict[str, Any] = {}
    if outcome.status != "ok":
        extra["log_tail"] = outcome.log_tail[-2000:]
        error = next((e for e in outcome.events if e.get("event") == "error"), None)
        if error is not None:
            extra["traceback"] = error.get("traceback", "")
    return TrialRecord(
        **_identity(trial), accumulation_steps=trial.accumulation_steps,
        effective_batch_size=trial.effective_batch_size, status=outcome.status, reason=outcome.reason,
        wall_seconds=outcome.wall_seconds, returncode=outcome.returncode,
        metrics=TrialMetrics.model_validate(metrics), sampler=SamplerInfo.model_validate(outcome.sampler),
        versions=result.get("versions") or ready.get("versions", {}),
        settings=result.get("settings") or ready.get("settings", {}), finished=_now(), **extra)


def skipped_record(trial: Trial, oom_batch_size: int) -> TrialRecord:
    """The record of a trial not run because a smaller batch size of the same framework ran out of memory."""
    return _not_run(trial, "skipped", f"not run: batch size {oom_batch_size} already ran out of memory (after_oom: "
                                      "skip)")


def unsupported_record(trial: Trial, reason: str) -> TrialRecord:
    """The record of a trial not run because its adapter cannot build the model (``harness.plan.unsupported_reason``:
    decided before any worker starts; a worker decides the same for adapters the registry has no table for)."""
    return _not_run(trial, "unsupported", f"not run: {reason}")


def _not_run(trial: Trial, status: Status, reason: str) -> TrialRecord:
    """The record of a trial no worker ran: its identity, status and reason, and empty measurements."""
    return TrialRecord(**_identity(trial), status=status, wall_seconds=0.0, returncode=None,
                       metrics=TrialMetrics.model_validate({}), sampler=SamplerInfo.model_validate({}), versions={},
                       settings={}, finished=_now(), reason=reason)


def _identity(trial: Trial) -> dict[str, Any]:
    """The fields that say which trial a record is, in every record whether it ran or not (``batch_size`` is the
    trial's micro_batch_size, the spec's batch size)."""
    return {"schema_version": SCHEMA_VERSION, "id": trial.id, "framework": trial.framework, "label": trial.row,
            "batch_size": trial.micro_batch_size, "repeat": trial.repeat, "seed": trial.seed, "variant": trial.variant,
            "device": trial.device, "threads": trial.threads, "learning_rate": trial.learning_rate,
            "precision": trial.precision, "compile": trial.compile, "data_parallel": trial.data_parallel,
            "per_device_batch_size": trial.per_device_batch_size, "devices": list(trial.devices)}


def add_mfu(record: dict[str, Any], precision: str = "fp32") -> None:
    """Adds ``metrics.mfu`` (fraction), ``peak_flops`` (FLOP/s) and ``peak_source`` for a GPU trial whose device
    (the name NVML reported) is in harness.measure.peaks, against the peak of the trial's ``precision`` (mixed
    precision: the low precision's, where the matrix work runs). A GPU trial whose device or precision is not in the
    table gets ``metrics.mfu_note`` instead, e.g. "unknown device: no peak (NVIDIA L40S)" (``peaks.missing``); a
    CPU trial neither. A data-parallel trial (``record["data_parallel"]`` N > 1) achieves its FLOP/s on N GPUs: its
    peak is N x the device's (GPUs of different names have no common entry: the note)."""
    achieved = record["metrics"].get("achieved_flops")
    if not achieved or not record["device"].startswith("cuda"):
        return
    name = record.get("sampler", {}).get("name")
    peak = peaks.lookup(name, precision)
    if peak is not None:
        total = peak[0] * int(record.get("data_parallel") or 1)
        record["metrics"].update({"mfu": achieved / total, "peak_flops": total, "peak_source": peak[1]})
    else:
        record["metrics"]["mfu_note"] = peaks.missing(name, precision)


def spec_differences(old: Any, new: Any, path: str = "") -> list[str]:
    """Dotted paths of the fields where two JSON-like specs differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            out += spec_differences(old.get(key), new.get(key), f"{path}.{key}" if path else str(key))
        return out
    return [] if old == new else [path or "(the whole spec)"]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_spec(spec: Spec, out_root: str | Path, spec_path: str | Path | None = None,
             on_start: Callable[[Trial, int, int], None] | None = None,
             on_end: Callable[[Trial, dict[str, Any]], None] | None = None,
             on_event: Callable[[dict[str, Any]], None] | None = None,
             resume: str | Path | None = None, executor: Any = None) -> Path:
    """Runs every trial of ``spec`` and returns the run directory (see harness.results.store for its layout).

    Each trial's record is on disk (fsynced) before the next trial starts; a failing trial is recorded with its
    status and reason and the sweep goes on. ``on_start(trial, index, total)``, ``on_end(trial, record)`` and
    ``on_event(worker event)`` report progress.

    A run stopped on the way (Ctrl-C, SIGTERM or SIGHUP through ``raise_on_signals``, or an error of the harness) is
    marked in run.json (``interrupted``: why, when, the trials finished and not run) and the exception goes on, with
    ``run_dir`` set on it; the worker of the trial in progress is killed on the way out.

    ``resume``: an interrupted run directory to finish instead of starting a new one. Trials already in its
    trials.jsonl (whatever their status) are not run again; a torn last line (a crash mid-write) is removed and that
    trial runs again. Raises SpecError when ``spec`` differs from the spec the run started with, naming the fields.

    ``executor``: where trials run (``harness.execution.executors``: ``LocalExecutor`` over this machine's slots, or
    ``RayExecutor``); default one trial at a time on this machine. It is closed (workers still running killed) when
    the run ends or stops. run.json records it (``executors``: one entry per session, a resume adds one). A
    data-parallel trial takes as many of its slots or GPUs as it has devices, trials start strictly in plan order
    (``_run_trials``), and a spec whose trials need more devices than ``executor`` has raises SpecError before
    anything is written (``check_executor``).
    """
    if executor is not None:
        check_executor(spec, executor, spec_path)  # before anything is written
    run_dir, run_info, done = (_reopen(spec, Path(resume), spec_path) if resume is not None else
                               _create(spec, out_root, spec_path))
    device = run_info["device"]
    trials = [t for t in plan(spec, device) if t.id not in done]
    executor = executor or LocalExecutor(local_slots(device))
    run_info.setdefault("executors", []).append(executor.describe())  # one per session (a resume adds one)
    write_json(run_dir / "run.json", run_info)
    try:
        _run_trials(spec, run_dir, device, trials, on_start, on_end, on_event, executor)
    except BaseException as exc:  # KeyboardInterrupt, Interrupted (SIGTERM, SIGHUP) or a bug: say so in run.json
        mark_interrupted(run_dir, exc)
        exc.run_dir = run_dir  # type: ignore[attr-defined]
        raise
    run_info = read_run(run_dir)
    run_info["finished"] = _now()
    write_json(run_dir / "run.json", run_info)
    return run_dir


class Interrupted(BaseException):
    """The orchestrator received SIGTERM or SIGHUP (a cancelled job, a closed terminal). Like KeyboardInterrupt it is
    not an Exception, so nothing on the way catches it by accident; the worker is killed on the way out."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def raise_on_signals(signums: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> None:
    """Makes SIGTERM and SIGHUP raise ``Interrupted`` in the main thread (call it from the main thread)."""
    def handler(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    for signum in signums:
        signal.signal(signum, handler)


def mark_interrupted(run_dir: Path, exc: BaseException) -> None:
    """Records in run.json why the run stopped before its end, which trials finished and which did not run; a later
    ``--resume`` moves this into ``interruptions`` and continues."""
    run_info = read_run(run_dir)
    finished = [r["id"] for r in read_trials(run_dir)]
    done = set(finished)
    why = (exc.args[0] if isinstance(exc, Interrupted) else "SIGINT (Ctrl-C)" if isinstance(exc, KeyboardInterrupt)
           else f"{type(exc).__name__}: {exc}"[:300])
    run_info["interrupted"] = {"by": why, "at": _now(), "finished": finished,
                               "not_run": [t for t in run_info.get("planned_trials", []) if t not in done]}
    write_json(run_dir / "run.json", run_info)


def _run_trials(spec: Spec, run_dir: Path, device: str, trials: list[Trial],
                on_start: Callable[[Trial, int, int], None] | None,
                on_end: Callable[[Trial, dict[str, Any]], None] | None,
                on_event: Callable[[dict[str, Any]], None] | None, executor: Any) -> None:
    """Runs ``trials`` in plan order on ``executor``, each record on disk
    before the next trial is dispatched once the executor is full (see run_spec). A trial whose built-in adapter
    cannot build the model is recorded ``unsupported`` without a worker (``unsupported_record``); one whose row
    already ran out of memory at a smaller batch size is ``skipped`` (``after_oom: skip``; with several trials in
    flight, a larger size already dispatched runs anyway). Each record of a worker's trial carries its
    ``placement``: node, device(s), pinned cores, start and end, and ``beside``: the trials that ran at the same
    time on the same node.

    Scheduling: strictly in plan order. The next trial starts when the executor has room for it (a data-parallel
    trial on N devices: N slots or GPUs, ``executor.has_room(N)``); until then no later trial starts, even one that
    would fit. So a data-parallel trial is never starved by one-device trials taking each slot as it frees (it gets
    the slots as the trials before it end), at the price of slots left idle while it waits for them; and nothing
    deadlocks, since no trial needs more than the executor has (``check_executor``, before the run)."""
    if spec.exclusive:
        executor.capacity = 1
    oom_at = _oom_sizes(read_trials(run_dir))
    unsupported = {key: unsupported_reason(spec, key[0], key[1], key[2], device, key[3], key[4], key[5])
                   for key in {_support_key(t) for t in trials}}
    pending = list(enumerate(trials))
    spans: list[dict[str, Any]] = []  # placements of the trials finished in this session, for ``beside``
    in_flight: dict[str, Trial] = {}  # trial id -> trial, for the trials the executor is running
    try:
        while pending or executor.running:
            while pending and _fits(executor, pending[0][1]):
                index, trial = pending.pop(0)
                if on_start is not None:
                    on_start(trial, index, len(trials))
                limit = oom_at.get((trial.row, trial.repeat, trial.variant))
                if (reason := unsupported[_support_key(trial)]) is not None:
                    record = unsupported_record(trial, reason)
                elif spec.after_oom == "skip" and limit is not None and trial.batch_size > limit:
                    record = skipped_record(trial, limit)
                else:
                    executor.submit(trial.id, Payload(trial=trial, spec=spec), spec.timeout_s,
                                    spec.sampler.interval_s, trial.threads, on_event=on_event)
                    in_flight[trial.id] = trial
                    continue
                append_trial(run_dir, record.data())
                if on_end is not None:
                    on_end(trial, record.data())
            if not executor.running:
                if pending and not _fits(executor, pending[0][1]):  # the executor is idle: room would never come
                    executor.check(pending[0][1].data_parallel)
                    raise RuntimeError(f"{pending[0][1].id}: the executor is idle and has no room for it")
                continue
            finished = executor.wait()
            trial = in_flight.pop(finished.key)
            record = _finished_record(run_dir, trial, finished, spans, executor)
            if record.status == "oom":
                key = (trial.row, trial.repeat, trial.variant)
                oom_at[key] = min(oom_at.get(key, trial.batch_size), trial.batch_size)
            if on_end is not None:
                on_end(trial, record.data())
    finally:
        executor.close()


def _fits(executor: Any, trial: Trial) -> bool:
    """Whether ``trial`` may start now on ``executor``: below its capacity in trials, with room for its devices."""
    return len(executor.running) < executor.capacity and executor.has_room(trial.data_parallel)


def _finished_record(run_dir: Path, trial: Trial, finished: Any, spans: list[dict[str, Any]],
                     executor: Any) -> TrialRecord:
    """Writes the samples, events and record of a trial the executor ran (``finished``: its Finished) and returns
    the record: its ``placement``, and the device(s) it really ran on (a slot's GPUs, a node's) as its ``device``
    and ``devices``."""
    outcome = finished.outcome
    placement = placement_record(finished.placement, spans, executor)
    update: dict[str, Any] = {"placement": Placement(**placement)}
    if finished.placement.device != "?":
        update["device"] = finished.placement.device
    if finished.placement.devices:
        update["devices"] = list(finished.placement.devices)
    record = trial_record(trial, outcome).model_copy(update=update)
    spans.append({"id": trial.id, **placement})
    write_lines(run_dir / "samples" / f"{trial.id}.jsonl", outcome.samples)
    write_lines(run_dir / "events" / f"{trial.id}.jsonl", outcome.events)
    append_trial(run_dir, record.data())
    return record


def check_executor(spec: Spec, executor: Any, spec_path: str | Path | None = None) -> None:
    """Raises SpecError (one line naming the file and the ``data_parallel`` field; the CLI exits 2) when a trial of
    ``spec`` needs more devices than ``executor`` can ever give it at once (``executor.check``: more slots than the
    local executor has, more GPUs than any Ray node). Stopping before the run, rather than recording such trials
    ``unsupported``, is what the user who gave the executor its slots (``--devices``, ``--parallel``) and the spec
    its device counts needs to hear: the two disagree, and a sweep without its largest device counts would measure
    no scaling at all."""
    for field, dp in data_parallel_settings(spec):
        if dp is None or dp.size == 1:
            continue
        try:
            executor.check(dp.size)
        except ExecutorError as err:
            raise SpecError(spec_path or "spec", field, f"{err}; give the executor more (--devices, --parallel) or "
                                                        "the trial fewer devices") from None


def placement_record(placement: Any, spans: list[dict[str, Any]], executor: Any) -> dict[str, Any]:
    """A record's ``placement``: where and when the trial ran (``harness.execution.executors.Placement``) and
    ``beside``, the ids of the trials whose run overlapped its own on the same node: those finished before it in
    this session and, on this machine, those still running. (The report recomputes overlaps from every record, which
    also catches a trial on a cluster node that started during this one and finished after it.)"""
    from dataclasses import asdict

    mine = asdict(placement)
    beside = [s["id"] for s in spans if s["node"] == mine["node"] and s["started"] < mine["ended"]
              and s["ended"] > mine["started"]]
    beside += [other for other, started in executor.running_here().items() if started < mine["ended"]]
    return {**mine, "beside": sorted(set(beside))}


def _create(spec: Spec, out_root: str | Path, spec_path: str | Path | None) -> tuple[Path, dict[str, Any], set[str]]:
    """A new run directory and its run.json contents (the machine, each framework entry's environment as its probe
    reported it, the resolved device, the planned trials). Raises SpecError, with nothing written, when an entry's
    interpreter fails its probe."""
    env = machine.collect()
    device = resolve_device(spec.device, env["gpu"])
    check_devices(spec, spec_path or "spec", device, len(env["gpu"]["devices"]) if "devices" in env["gpu"] else None)
    frameworks = probe_entries(spec, spec_path or "spec", device)
    run_dir = create_run_dir(out_root, spec.name)
    run_info = {
        "schema_version": SCHEMA_VERSION,
        "harness_version": __version__,
        "spec_file": str(spec_path) if spec_path else None,
        "spec": spec.model_dump(mode="json"),
        "device": device,
        "environment": env,
        "frameworks": frameworks,
        "planned_trials": [t.id for t in plan(spec, device)],
        "started": _now(),
        "finished": None,
    }
    return run_dir, run_info, set()


def _reopen(spec: Spec, run_dir: Path, spec_path: str | Path | None) -> tuple[Path, dict[str, Any], set[str]]:
    """An interrupted run directory, its run.json marked resumed, and the ids of its finished trials. Raises
    SpecError when ``spec`` differs from the one the run started with."""
    run_info = read_run(run_dir)
    differences = spec_differences(run_info["spec"], spec.model_dump(mode="json"))
    if differences:
        raise SpecError(spec_path or "spec", "", f"cannot resume {run_dir}: the spec differs from the one it "
                                                 f"started with in {', '.join(differences[:8])}")
    frameworks = probe_entries(spec, spec_path or "spec", run_info.get("device") or resolve_device(spec.device))
    drop_torn_tail(run_dir / "trials.jsonl")
    run_info.setdefault("frameworks", frameworks)
    if run_info.get("interrupted"):
        run_info.setdefault("interruptions", []).append(run_info.pop("interrupted"))
    run_info.setdefault("resumed", []).append(_now())
    run_info["finished"] = None
    return run_dir, run_info, {r["id"] for r in read_trials(run_dir)}


def _oom_sizes(records: list[dict[str, Any]]) -> dict[tuple[str, int, str], int]:
    """The smallest batch size that ran out of memory per (row label, repeat, variant), from finished trials."""
    oom_at: dict[tuple[str, int, str], int] = {}
    for finished in records:
        if finished["status"] == "oom":
            key = (finished.get("label") or finished["framework"], finished["repeat"], finished.get("variant", ""))
            oom_at[key] = min(oom_at.get(key, finished["batch_size"]), finished["batch_size"])
    return oom_at


def _support_key(trial: Trial) -> tuple[str, str, str, int, bool, str]:
    """What decides whether a built-in adapter can run a trial (``harness.plan.unsupported_reason``'s arguments
    besides the spec and the device)."""
    return trial.framework, trial.precision, trial.compile, trial.data_parallel, trial.sync_batchnorm, trial.input
