"""One finished trial: ``TrialRecord``, a line of ``trials.jsonl`` (published as JSON Schema by ``harness schema`` and
in ``results/trial.schema.json``), and ``Placement``, where and when it ran: the one type an executor hands back
(``harness.execution.executors``) and the record keeps."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from harness.record.base import Strict
from harness.record.metrics import TrialMetrics
from harness.record.phases import TrialPhases
from harness.record.sampler import SamplerInfo
from harness.record.version import SCHEMA_VERSION

#: Every status a trial can end with, in one place: the launcher classifies a worker's end into one
#: (``harness.execution.launcher``: ok, oom, error, timeout, crashed), the sweep decides the others before any worker
#: starts (skipped: ``after_oom: skip``; unsupported: the adapter cannot build the model) and the record publishes
#: them (``TrialRecord.status``).
Status = Literal["ok", "oom", "error", "timeout", "crashed", "skipped", "unsupported"]
STATUSES: tuple[str, ...] = get_args(Status)


@dataclass(config=ConfigDict(extra="forbid"))
class Placement:
    """Where and when a trial ran: ``node`` (host name; ``node_id``: Ray's node id on a cluster), ``device`` (as NVML
    numbers it, or "cpu"), ``cpus`` (the cores the worker was pinned to, None when not pinned), ``started_unix_s`` and
    ``ended_unix_s`` (wall clock on the driver, seconds since the epoch), ``devices`` (a data-parallel trial's GPUs as
    NVML numbers them, where the executor chose them; else None) and ``beside`` (ids of the trials that ran at the
    same time on the same node; the sweep fills it in)."""

    node: str
    device: str
    cpus: list[int] | None
    started_unix_s: float
    ended_unix_s: float
    node_id: str | None = None
    devices: list[str] | None = None
    beside: list[str] = dataclasses.field(default_factory=list)

    def overlaps(self, other: Placement) -> bool:
        """Whether ``other`` ran on the same node at a time this one ran."""
        return (other.node == self.node and other.started_unix_s < self.ended_unix_s
                and other.ended_unix_s > self.started_unix_s)


class TrialRecord(Strict):
    """One line of ``trials.jsonl``: one finished trial, whatever its status (results/README.md says what each
    field means)."""

    schema_version: int = Field(default=SCHEMA_VERSION, description="the schema of this record; 0 when absent")
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
    data_parallel: int = Field(default=1, ge=1, description="devices the trial trained on (1: one device)")
    per_device_batch_size: int | None = Field(default=None, description="samples per device per forward pass: "
                                                                        "batch_size / data_parallel")
    devices: list[str] = Field(default_factory=list, description="the data-parallel devices (empty: one device, "
                                                                 "``device``)")
    status: Status
    reason: str = ""
    wall_s: float = Field(description="the worker's whole life, seconds")
    returncode: int | None = None
    metrics: TrialMetrics = Field(default_factory=TrialMetrics, description="what the worker measured; empty for "
                                                                           "trials that did not end ok")
    sampler: SamplerInfo = Field(default_factory=SamplerInfo, description="the sampler's backend, statistics, energy")
    versions: dict[str, Any] = Field(default_factory=dict, description="what the framework reported: versions")
    settings: dict[str, Any] = Field(default_factory=dict, description="the framework's settings: threads, "
                                                                       "allocator, loader")
    finished: str | None = Field(default=None, description="UTC time the record was written, ISO 8601")
    placement: Placement | None = None
    start: Literal["cold", "forked"] | None = Field(default=None, description=(
        "how the worker started: cold (a new interpreter that imported the framework) or forked (from a parent "
        "per environment that had imported it, harness.execution.forkserver)"))
    phases: TrialPhases | None = Field(default=None, description="where the worker's wall time went, seconds")
    log_tail: str | None = Field(default=None, description="not ok: the end of the worker's standard error")
    traceback: str | None = Field(default=None, description="not ok: the worker's traceback, where it sent one")

    @property
    def row(self) -> str:
        """The row the trial belongs to in reports, compare and history: its label, plus its variant in parentheses
        when the spec has variants."""
        return f"{self.label} ({self.variant})" if self.variant else self.label

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def data(self) -> dict[str, Any]:
        """The record as its trials.jsonl line holds it: the fields it was given (a trial that did not run has no
        ``accumulation_steps``; one that ran has ``placement``), values as given (a NaN loss stays NaN, as
        ``json.dumps`` writes it)."""
        return {"schema_version": self.schema_version, **self.model_dump(exclude_unset=True)}
