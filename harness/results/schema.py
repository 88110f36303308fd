"""What a run directory holds, as a versioned schema: the record types of ``harness.record`` (the trial record
``TrialRecord``, published as JSON Schema by ``harness schema`` and in ``results/trial.schema.json``; run.json's
``RunRecord``), ``SCHEMA_VERSION`` and the check every reader makes (``check_version``), gathered for the readers.

Versions (``harness.record.version``): 0 is every run written before the schema was versioned, 1 added
``schema_version``, 2 typed every field and put the units in the names with one suffix convention
(``harness.record.units``). A reader of this harness reads versions 0 to 2 (older names mapped in one place,
``harness.record.legacy``) and refuses a newer one in one line (``SchemaError``).
"""

from __future__ import annotations

import json
from typing import Any

from harness.record import (
    SCHEMA_VERSION,
    EpochMetrics,
    MetricStats,
    Placement,
    RunRecord,
    SamplerInfo,
    SchemaError,
    Status,
    TrialMetrics,
    TrialRecord,
    check_version,
)

__all__ = ["SCHEMA_VERSION", "EpochMetrics", "MetricStats", "Placement", "RunRecord", "SamplerInfo", "SchemaError",
           "Status", "TrialMetrics", "TrialRecord", "check_version", "trial_schema", "trial_schema_json"]


def trial_schema() -> dict[str, Any]:
    """The JSON Schema of a trial record (draft 2020-12, as pydantic writes it), with the version it describes."""
    schema = TrialRecord.model_json_schema()
    schema["description"] = (schema.get("description", "") + f" Schema version {SCHEMA_VERSION}.").strip()
    return schema


def trial_schema_json() -> str:
    return json.dumps(trial_schema(), indent=2, sort_keys=True) + "\n"
