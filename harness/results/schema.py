"""What a run directory holds, as a versioned schema: ``SCHEMA_VERSION`` (written into run.json and every trial
record), the trial record as a pydantic model (``TrialRecord``, published as JSON Schema by ``harness schema`` and in
``results/trial.schema.json``), and the check every reader makes (``check_version``).

Versions: 0 is every run written before the schema was versioned (no ``schema_version`` field); its records have the
same fields as version 1, some of them absent in older runs (``precision``, ``compile``, ``placement``), which readers
treat as missing. Version 1 adds ``schema_version``. A reader of this harness reads versions 0 and 1 and refuses a
newer one in one line (``SchemaError``) rather than misreading fields it does not know.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harness.plan import Status

#: The version this harness writes (run.json's and each trial record's ``schema_version``).
SCHEMA_VERSION = 1

__all__ = ["SCHEMA_VERSION", "EpochMetrics", "MetricStats", "Placement", "SamplerInfo", "SchemaError", "Status",
           "TrialMetrics", "TrialRecord", "check_version", "trial_schema", "trial_schema_json"]


class SchemaError(ValueError):
    """A run directory this harness cannot read: written by a newer harness, or not a run directory. The message is
    one line naming the file, the version found and what to do."""


def check_version(value: Any, where: str) -> int:
    """The schema version of a run.json or trial record (0 when it has none). Raises SchemaError for a version newer
    than ``SCHEMA_VERSION`` or one that is not a whole number; ``where`` names the file in the message."""
    version = value.get("schema_version", 0) if isinstance(value, dict) else 0
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise SchemaError(f"{where}: schema_version {version!r} is not a version this harness knows")
    if version > SCHEMA_VERSION:
        raise SchemaError(f"{where}: written with schema version {version}; this harness reads versions 0 to "
                          f"{SCHEMA_VERSION}: upgrade the harness (pip install -U) to read it")
    return version


class _Open(BaseModel):
    """Known fields typed; fields a later minor change adds are kept (extra="allow")."""

    model_config = ConfigDict(extra="allow")


class Placement(_Open):
    """Where and when the trial ran (harness.execution.executors.Placement plus ``beside``)."""

    node: str = Field(description="host name of the machine that ran the worker")
    node_id: str | None = Field(None, description="Ray's node id on a cluster, else null")
    device: str = Field(description="the device as NVML numbers it (cuda:N) or cpu")
    cpus: list[int] | None = Field(None, description="the cores the worker was pinned to; null when not pinned")
    started: float = Field(description="wall clock at the trial's start, seconds since the epoch")
    ended: float = Field(description="wall clock at the trial's end, seconds since the epoch")
    beside: list[str] = Field(default_factory=list, description="ids of trials that ran at the same time on the node")
    devices: list[str] | None = Field(None, description="a data-parallel trial's GPUs as NVML numbers them, where the "
                                                        "executor chose them (slots, Ray); else null")


class EpochMetrics(_Open):
    """One evaluation of a trial (``metrics.epochs``): after epoch ``epoch`` (0-based), which is every epoch unless
    the spec's ``evaluate_every`` k > 1 (then every k-th and the last)."""

    epoch: int | None = None
    train_loss: float | None = Field(None, description="mean loss over every optimizer step since the evaluation "
                                     "before, warm-up steps included (records without train_loss_steps: the mean of "
                                     "the losses of the timed windows' last steps)")
    train_loss_steps: int | None = Field(None, description="the optimizer steps train_loss averages")
    test_loss: float | None = None
    test_accuracy: float | None = Field(None, description="fraction, 0..1")
    timed_seconds: float | None = Field(None, description="seconds inside the timed windows since the "
                                           "evaluation before (the epoch's, with an evaluation every epoch)")


class TrialMetrics(_Open):
    """What the worker measured (``metrics``); absent for trials that did not end ok. Units in the descriptions."""

    throughput: float | None = Field(None, description="training samples per second over the timed windows")
    seconds_per_epoch: float | None = Field(None, description="samples per epoch / throughput, seconds")
    step_time_median_s: float | None = Field(None, description="median time per step over the timed windows, s")
    step_time_p90_s: float | None = Field(None, description="90th percentile of the time per step, s")
    first_step_seconds: float | None = Field(None, description="the first step alone, compilation included, s")
    measured_steps: int | None = None
    measured_samples: int | None = None
    measured_seconds: float | None = Field(None, description="seconds inside the timed windows")
    final_train_loss: float | None = None
    test_loss: float | None = None
    test_accuracy: float | None = Field(None, description="fraction, 0..1, after the last epoch")
    achieved_flops: float | None = Field(None, description="training FLOP/s (throughput x FLOPs per sample)")
    mfu: float | None = Field(None, description="fraction of the device's peak in the trial's precision")
    data_bytes: int | None = Field(None, description="bytes of the dataset held on the device")
    memory: dict[str, Any] = Field(default_factory=dict, description="framework allocator peaks, bytes")
    epochs: list[EpochMetrics] = Field(default_factory=list)


class MetricStats(_Open):
    """One sampled metric over the trial's timed windows (``harness.measure.sampler.phase_stats``), in the metric's
    own unit (``_percent``: percent, ``_bytes``: bytes, ``_w``: watts, ``_mhz``, ``_c``)."""

    mean: float | None = None
    median: float | None = None
    max: float | None = None
    count: int = Field(0, description="samples with a value that the statistics used")
    scope: str | None = Field(None, description="windows (samples inside the timed windows and their end-edge "
                                                "samples), span (windows shorter than the interval: the samples from "
                                                "the first window's start to the last one's end) or none")


class SamplerInfo(_Open):
    """How the device was sampled during the trial (``sampler``; results/README.md lists every field)."""

    backend: str | None = Field(None, description="nvml or host; null when the trial ran without a sampler")
    interval_s: float | None = Field(None, description="seconds between periodic samples")
    unavailable: dict[str, str] = Field(default_factory=dict, description="metric -> why the device, driver, "
                                        "bindings or permissions did not provide it")
    stats: dict[str, MetricStats] = Field(
        default_factory=dict,
        description="per sampled metric: host cpu_percent, rss_bytes; NVML gpu_util_percent, mem_util_percent, "
                    "device_memory_used_bytes, process_memory_bytes, power_w, sm_clock_mhz, temperature_c, and on "
                    "Hopper and newer the GPM metrics (nvmlGpmMetricsGet, "
                    "https://docs.nvidia.com/deploy/nvml-api/group__nvmlGpmFunctions.html), percent over each "
                    "sampling period: sm_active_percent (NVML_GPM_METRIC_SM_UTIL), sm_occupancy_percent "
                    "(NVML_GPM_METRIC_SM_OCCUPANCY), tensor_active_percent (NVML_GPM_METRIC_ANY_TENSOR_UTIL), "
                    "dram_bw_util_percent (NVML_GPM_METRIC_DRAM_BW_UTIL); a data-parallel trial on GPUs: these "
                    "over its devices (energy and power summed, memory the most loaded device's, utilization the "
                    "mean) and each device's as <metric>@<i>")
    devices: list[dict[str, Any]] | None = Field(
        None, description="a data-parallel trial on GPUs: per device, in the order of the record's devices: index, "
                          "device (as the worker numbered it), device_selector, name, uuid, memory_peak_bytes (peak "
                          "NVML memory of the trial's processes on it, else the device's: memory_source), "
                          "gpu_util_mean_percent, joules, energy_method")
    memory_peak_over_devices_bytes: float | None = Field(
        None, description="a data-parallel trial on GPUs: the largest of its devices' memory_peak_bytes, bytes")


class TrialRecord(_Open):
    """One line of ``trials.jsonl``: one finished trial, whatever its status (results/README.md says what each
    field means)."""

    schema_version: int = Field(SCHEMA_VERSION, description="the schema of this record; 0 when absent")
    id: str = Field(description="<label>-bs<batch size>-r<repeat>[-s<seed>][-v<variant>]")
    framework: str = Field(description="the adapter's name")
    label: str = Field(description="the row in reports: the framework entry's label, else the name")
    batch_size: int = Field(gt=0, description="samples per micro-batch")
    repeat: int = Field(ge=0)
    seed: int = 0
    variant: str = ""
    device: str = Field(description="cpu or cuda:N (as NVML numbers it)")
    threads: int | None = None
    learning_rate: float | None = None
    precision: str = "fp32"
    compile: str = "default"
    accumulation_steps: int = 1
    effective_batch_size: int | None = None
    data_parallel: int = Field(1, ge=1, description="devices the trial trained on (data parallelism; 1: one device)")
    per_device_batch_size: int | None = Field(None, description="samples per device per forward pass: batch_size / "
                                                                "data_parallel")
    devices: list[str] = Field(default_factory=list, description="the data-parallel devices (empty: one device, "
                                                                 "``device``)")
    status: Status
    reason: str = ""
    wall_seconds: float = Field(description="the worker's whole life, seconds")
    returncode: int | None = None
    # model_validate({}) is TrialMetrics() / SamplerInfo(): mypy reads Field(None, ...) as no default, so the classes
    # themselves do not type as zero-argument factories
    metrics: TrialMetrics = Field(default_factory=lambda: TrialMetrics.model_validate({}))
    sampler: SamplerInfo = Field(default_factory=lambda: SamplerInfo.model_validate({}),
                                 description="the sampler's backend, statistics, energy")
    versions: dict[str, Any] = Field(default_factory=dict)
    settings: dict[str, Any] = Field(default_factory=dict)
    finished: str | None = Field(None, description="UTC time the record was written, ISO 8601")
    placement: Placement | None = None

    def data(self) -> dict[str, Any]:
        """The record as its trials.jsonl line holds it: the fields it was given (a trial that did not run has no
        ``accumulation_steps``; one that ran has ``placement``), values as given (a NaN loss stays NaN, as
        ``json.dumps`` writes it) and the extra fields (``log_tail``, ``traceback``, a metric added later)."""
        return self.model_dump(exclude_unset=True)


def trial_schema() -> dict[str, Any]:
    """The JSON Schema of a trial record (draft 2020-12, as pydantic writes it), with the version it describes."""
    schema = TrialRecord.model_json_schema()
    schema["description"] = (schema.get("description", "") + f" Schema version {SCHEMA_VERSION}.").strip()
    return schema


def trial_schema_json() -> str:
    return json.dumps(trial_schema(), indent=2, sort_keys=True) + "\n"
