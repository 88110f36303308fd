"""The records of a run, typed, from the worker to the report: the worker's events (``events``), what it measured
(``metrics.TrialMetrics``), how the device was sampled (``sampler.SamplerInfo``), a finished trial
(``trial.TrialRecord``, with its ``Placement``) and the run (``run.RunRecord``), the schema version and the mapping
of older versions' names (``version``, ``legacy``), and the one suffix convention for units (``units``).

Both sides import it: the worker (``harness.execution``, in every framework's environment: pydantic and numpy only,
never pandas or a framework) and the readers (``harness.results``, ``harness.studies``). It imports nothing else of
the harness: the lowest layer, beside ``harness.spec``.
"""

from harness.record.events import (
    Epoch,
    Error,
    ErrorKind,
    Event,
    MemoryLimit,
    MemoryPeak,
    Phase,
    Ready,
    Result,
    Start,
    event_data,
    first,
    parse_events,
    phase_windows,
)
from harness.record.metrics import (
    AllocatorMemory,
    DataParallelism,
    EpochMetrics,
    GradientNoise,
    PredictedMemory,
    TimeToTarget,
    TrialMetrics,
)
from harness.record.phases import TrialPhases
from harness.record.run import FrameworkEnvironment, Interruption, RunRecord
from harness.record.sampler import DeviceSummary, EnergyInfo, MetricStats, SamplerInfo, ThrottleInfo
from harness.record.trial import STATUSES, Placement, Status, TrialRecord
from harness.record.version import SCHEMA_VERSION, SchemaError, check_version

__all__ = ["SCHEMA_VERSION", "STATUSES", "AllocatorMemory", "DataParallelism", "DeviceSummary", "EnergyInfo", "Epoch",
           "EpochMetrics", "Error", "ErrorKind", "Event", "FrameworkEnvironment", "GradientNoise", "Interruption",
           "MemoryLimit", "MemoryPeak", "MetricStats", "Phase", "Placement", "PredictedMemory", "Ready", "Result",
           "RunRecord", "SamplerInfo", "SchemaError", "Start", "Status", "ThrottleInfo", "TimeToTarget", "TrialMetrics",
           "TrialPhases", "TrialRecord", "check_version", "event_data", "first", "parse_events", "phase_windows"]
