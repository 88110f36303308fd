"""Reading records of older schema versions: the one place that maps their names to this version's.

Versions 0 and 1 (``harness.record.version``) wrote the same fields (1 added ``schema_version``; in 0 some are
absent: ``precision``, ``compile``, ``placement``, read as their defaults), with units spelt ``_seconds`` and
``_percent`` beside ``_s`` and ``_pct``, derived figures stored (MFU, energy per sample: this version derives them
in ``harness.results.derived``), and a data-parallel trial's devices loose in ``metrics``. ``trial`` and ``run`` turn
such a record's data into this version's; fields those versions wrote that this one has no place for are left out.
An events file carries no version of its own: ``event`` recognises the old names in an event (an ``epoch``'s
``timed_seconds``, a ``result``'s old metric names) and maps them the same way.
"""

from __future__ import annotations

from typing import Any

from harness.record.events import EVENT, Event
from harness.record.metrics import PREDICTED_PARTS, TrialMetrics
from harness.record.run import RunRecord
from harness.record.sampler import SamplerInfo
from harness.record.trial import TrialRecord

#: Old name -> new name, per part of a trial record (versions 0 and 1 -> 2).
RECORD = {"wall_seconds": "wall_s"}
METRICS = {"throughput": "throughput_samples_per_s", "seconds_per_epoch": "epoch_time_s",
           "measured_seconds": "measured_s", "first_step_seconds": "first_step_s",
           "input_wait_seconds": "input_wait_s", "achieved_flops": "achieved_flops_per_s"}
EPOCH = {"timed_seconds": "timed_s"}
TIME_TO_TARGET = {"training_seconds": "training_s", "wall_seconds": "wall_s"}
PREDICTED = {**{part: f"{part}_bytes" for part in PREDICTED_PARTS}, "activations_per_sample":
             "activations_per_sample_bytes"}
PLACEMENT = {"started": "started_unix_s", "ended": "ended_unix_s"}
#: ``metrics`` keys of a data-parallel trial that moved into ``metrics.data_parallelism``.
DATA_PARALLELISM = {"devices": "devices", "sync_batchnorm": "sync_batchnorm", "data_parallel_mechanism": "mechanism"}
#: Stored figures this version derives on reading (``harness.results.derived``); SamplerInfo drops its own.
DERIVED = ("mfu", "peak_flops", "peak_source", "mfu_note")


def _renamed(data: dict[str, Any], names: dict[str, str], known: set[str] | None = None) -> dict[str, Any]:
    """``data`` with its keys renamed by ``names``; keys outside ``known`` (after renaming) left out."""
    out = {names.get(key, key): value for key, value in data.items()}
    return out if known is None else {key: value for key, value in out.items() if key in known}


def metrics(data: dict[str, Any]) -> dict[str, Any]:
    """An old record's ``metrics`` in this version's names."""
    old = {k: v for k, v in data.items() if k not in DERIVED}
    moved = {new: old.pop(key) for key, new in DATA_PARALLELISM.items() if key in old}
    out = _renamed(old, METRICS, set(TrialMetrics.model_fields))
    if moved:
        out["data_parallelism"] = moved
    if isinstance(out.get("epochs"), list):
        out["epochs"] = [_renamed(e, EPOCH) for e in out["epochs"] if isinstance(e, dict)]
    if isinstance(out.get("time_to_target"), dict):
        out["time_to_target"] = _renamed(out["time_to_target"], TIME_TO_TARGET)
    if isinstance(out.get("memory_predicted"), dict):
        out["memory_predicted"] = _renamed(out["memory_predicted"], PREDICTED)
    return out


def trial(data: dict[str, Any], version: int) -> TrialRecord:
    """A trial record of schema ``version`` (0 to the current one) as this version's ``TrialRecord``."""
    if version >= 2:
        return TrialRecord.model_validate(data)
    out = _renamed(data, RECORD, set(TrialRecord.model_fields))
    out["schema_version"] = version
    out.setdefault("label", out.get("framework"))
    out["metrics"] = metrics(out.get("metrics") or {})
    out["sampler"] = SamplerInfo.from_measure(out.get("sampler") or {})
    if isinstance(out.get("placement"), dict):
        out["placement"] = _renamed(out["placement"], PLACEMENT)
    return TrialRecord.model_validate(out)


def run(data: dict[str, Any], version: int) -> RunRecord:
    """run.json of schema ``version`` as this version's ``RunRecord``."""
    if version >= 2:
        return RunRecord.model_validate(data)
    out = {key: value for key, value in data.items() if key in RunRecord.model_fields}
    out["schema_version"] = version
    return RunRecord.model_validate(out)


def event(data: dict[str, Any]) -> Event:
    """One line of an events file, of any version, as this version's typed event."""
    if data.get("event") == "epoch" and "timed_seconds" in data:
        data = _renamed(data, EPOCH)
    elif data.get("event") == "result" and isinstance(data.get("metrics"), dict):
        old = set(METRICS) | set(DERIVED) | {"data_parallel_mechanism"}
        if old & set(data["metrics"]):
            data = {**data, "metrics": metrics(data["metrics"])}
    return EVENT.validate_python(data)
