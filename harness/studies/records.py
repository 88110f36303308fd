"""The records a sweep writes (``harness.record``): a trial's ``TrialRecord`` from what its worker reported (the
launcher's ``Outcome``) and where it ran (the executor's ``Placement``), the records of trials no worker ran, and the
run's first ``RunRecord``."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness.execution.launcher import Outcome
from harness.plan import Trial
from harness.record import (
    SCHEMA_VERSION,
    Error,
    FrameworkEnvironment,
    Placement,
    Ready,
    RunRecord,
    SamplerInfo,
    Status,
    TrialMetrics,
    TrialPhases,
    TrialRecord,
    first,
)
from harness.spec import Spec
from harness.version import __version__


def now() -> str:
    """UTC now, ISO 8601 to the second (records' ``finished``, run.json's times)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _identity(trial: Trial) -> dict[str, Any]:
    """The fields that say which trial a record is, in every record whether it ran or not (``batch_size`` is the
    trial's micro_batch_size, the spec's batch size)."""
    return {"schema_version": SCHEMA_VERSION, "id": trial.id, "framework": trial.framework, "label": trial.row,
            "batch_size": trial.micro_batch_size, "repeat": trial.repeat, "seed": trial.seed, "variant": trial.variant,
            "device": trial.device, "threads": trial.threads, "learning_rate": trial.learning_rate,
            "precision": trial.precision, "compile": trial.compile, "data_parallel": trial.data_parallel,
            "per_device_batch_size": trial.per_device_batch_size, "devices": list(trial.devices)}


def trial_record(trial: Trial, outcome: Outcome, placement: Placement | None = None) -> TrialRecord:
    """The record of one trial a worker ran: identity, status and reason, the worker's metrics (its ``result``
    event's, typed), the sampler's statistics (``SamplerInfo.from_measure``), versions and settings; with
    ``placement``, where it ran, and the device(s) it really ran on (a slot's GPUs, a node's) as its ``device`` and
    ``devices``. Its trials.jsonl line is ``TrialRecord.data``."""
    result, ready, error = outcome.result(), first(outcome.events, Ready), first(outcome.events, Error)
    failed: dict[str, Any] = {}
    if outcome.status != "ok":
        failed["log_tail"] = outcome.log_tail[-2000:]
        if error is not None:
            failed["traceback"] = error.traceback
    where: dict[str, Any] = {}
    if placement is not None:
        where["placement"] = placement
        if placement.device != "?":
            where["device"] = placement.device
        if placement.devices:
            where["devices"] = list(placement.devices)
    return TrialRecord(**{
        **_identity(trial), "accumulation_steps": trial.accumulation_steps,
        "effective_batch_size": trial.effective_batch_size, "status": outcome.status, "reason": outcome.reason,
        "wall_s": outcome.wall_seconds, "returncode": outcome.returncode,
        "metrics": result.metrics if result is not None else TrialMetrics(),
        "sampler": SamplerInfo.from_measure(outcome.sampler),
        "versions": (result.versions if result is not None else {}) or (ready.versions if ready else {}),
        "settings": (result.settings if result is not None else {}) or (ready.settings if ready else {}),
        "start": outcome.start, "phases": TrialPhases.from_events(outcome.events, outcome.started, outcome.ended),
        "finished": now(), **failed, **where})


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
    return TrialRecord(**_identity(trial), status=status, wall_s=0.0, returncode=None, metrics=TrialMetrics(),
                       sampler=SamplerInfo(), versions={}, settings={}, finished=now(), reason=reason)


def placement_record(placement: Placement, spans: list[tuple[str, Placement]],
                     running_here: dict[Any, float]) -> Placement:
    """A record's ``placement``: where and when the trial ran (the executor's ``Placement``) with ``beside``, the
    ids of the trials whose run overlapped its own on the same node: those finished before it in this session
    (``spans``: (id, placement)) and, on this machine, those still running (``running_here``: id -> start,
    time.time()). (The report recomputes overlaps from every record, which also catches a trial on a cluster node
    that started during this one and finished after it.)"""
    beside = [trial for trial, other in spans if placement.overlaps(other)]
    beside += [str(other) for other, started in running_here.items() if started < placement.ended_unix_s]
    return dataclasses.replace(placement, beside=sorted(set(beside)))


def new_run(spec: Spec, spec_path: str | Path | None, device: str, environment: dict[str, Any],
            frameworks: list[dict[str, Any]], planned: list[str]) -> RunRecord:
    """A new run's run.json: the spec as run, the machine, each framework entry's environment as its probe reported
    it (``harness.execution.probes.probe_entries``), the resolved device and the planned trials."""
    return RunRecord(harness_version=__version__, spec_file=str(spec_path) if spec_path else None,
                     spec=spec.model_dump(mode="json"), device=device, environment=environment,
                     frameworks=[FrameworkEnvironment.model_validate(f) for f in frameworks], planned_trials=planned,
                     started=now(), finished=None)
