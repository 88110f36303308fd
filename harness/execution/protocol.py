"""What crosses between the orchestrator and a worker, typed: the payload in, the events out.

In: one line of JSON on the worker's standard input, a ``Payload``: the trial (``harness.plan.Trial`` itself, the
frozen dataclass, validated field by field with its own types: the spec's ``TimingSpec``, ``OptimizerSpec``,
``Precision`` and ``CompileMode`` among them) and the whole ``Spec``, plus what the launcher adds for the process
(``env``, ``cpus``, ``launcher_pid``; ``harness.execution.bootstrap`` applies those with the standard library alone,
before anything else is imported). The worker validates it once; nothing downstream restates a default.

Out: one line per event on the worker's original standard output, ``EVENT_PREFIX`` + JSON: ``start``, ``ready``,
``phase``, ``epoch``, ``result``, ``error``, and under a CPU memory cap ``memory_limit`` and ``memory_peak``
(``harness.execution.limits``). Each is a model below with its ``event`` name as the discriminator and ``t``, a
``time.monotonic()`` stamp; ``parse_event`` is how the launcher reads a line. Events keep extra fields (``extra=
"allow"``): a detail a worker adds reaches the events file without a change here.

This module runs in every framework's environment (the worker imports it): it needs only pydantic and the harness's
own spec and plan modules (numpy, PyYAML), never pandas or a framework.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from harness.plan import Trial
from harness.spec import Spec

#: The mark of an event line on a worker's standard output; any other line there is a wrapper's chatter (logged).
EVENT_PREFIX = "@harness-event "


class Payload(BaseModel):
    """What a worker reads on standard input: the trial and the spec it belongs to, and the process settings the
    launcher adds (``env``: environment variables the bootstrap sets before any import; ``cpus``: the cores it pins
    the process to, None for no pinning; ``launcher_pid``: for ``PR_SET_PDEATHSIG``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trial: Trial
    spec: Spec
    env: dict[str, str] = Field(default_factory=dict)
    cpus: list[int] | None = None
    launcher_pid: int | None = None

    def line(self) -> bytes:
        """The payload as the one line the worker reads (JSON, newline-terminated)."""
        return self.model_dump_json().encode() + b"\n"


class _Event(BaseModel):
    """An event: its name (the discriminator) and when (``time.monotonic()``, seconds; set by the worker's emit)."""

    model_config = ConfigDict(extra="allow")

    event: str
    t: float = 0.0

    def fields(self) -> dict[str, Any]:
        """The fields the event was made with, without ``event`` and ``t`` (what the worker writes after those)."""
        return self.model_dump(exclude_unset=True, exclude={"event", "t"})


class Start(_Event):
    """The worker process started: its pid (which the sampler follows), interpreter and CPU affinity."""

    event: Literal["start"] = "start"
    pid: int
    framework: str
    batch_size: int
    python: str
    affinity: list[int] | None = None


class Ready(_Event):
    """The model is built and the data loaded: the framework's versions and settings."""

    event: Literal["ready"] = "ready"
    versions: dict[str, Any] = Field(default_factory=dict)
    settings: dict[str, Any] = Field(default_factory=dict)


class Phase(_Event):
    """An edge of a phase: warm-up, a timed training window run, an evaluation, an augmentation load."""

    event: Literal["phase"] = "phase"
    name: Literal["warmup", "train", "eval", "augment"]
    edge: Literal["start", "end"]
    epoch: int | None = None


class Epoch(_Event):
    """An evaluation after epoch ``epoch`` (``harness.results.schema.EpochMetrics`` describes the fields)."""

    event: Literal["epoch"] = "epoch"
    epoch: int
    train_loss: float
    train_loss_steps: int
    test_loss: float
    test_accuracy: float
    timed_seconds: float


class Result(_Event):
    """The trial ended: its metrics (the record's ``metrics``), versions and settings."""

    event: Literal["result"] = "result"
    metrics: dict[str, Any]
    versions: dict[str, Any] = Field(default_factory=dict)
    settings: dict[str, Any] = Field(default_factory=dict)


#: How a worker's own failure is classified (the launcher adds timeout and crashed, which no worker reports).
ErrorKind = Literal["unsupported", "oom", "error"]


class Error(_Event):
    """The trial failed in the worker: how (``kind``, the trial's status), why (one line) and the traceback."""

    event: Literal["error"] = "error"
    kind: ErrorKind
    reason: str
    traceback: str = ""


class MemoryLimit(_Event):
    """A CPU memory cap was applied (``harness.execution.limits.apply_cpu_memory_limit``; its fields there)."""

    event: Literal["memory_limit"] = "memory_limit"
    limit_bytes: int
    mechanism: str
    baseline: dict[str, int] = Field(default_factory=dict)
    rlimit_data_bytes: int | None = None
    peak_reset: bool = False
    cpu_allocator_limit_mib: int | None = None


class MemoryPeak(_Event):
    """The worker's peak memory under a CPU cap, reported at its exit (``harness.execution.limits``)."""

    event: Literal["memory_peak"] = "memory_peak"
    peak_bytes: int | None = None
    source: str = ""
    at_exit: dict[str, int] = Field(default_factory=dict)
    baseline: dict[str, int] = Field(default_factory=dict)
    cpu_allocator_peak_bytes: int | None = None


Event = Annotated[Start | Ready | Phase | Epoch | Result | Error | MemoryLimit | MemoryPeak,
                  Field(discriminator="event")]
_EVENT = TypeAdapter(Event)


def event_line(event: _Event, t: float, default: Any = None) -> tuple[str, dict[str, Any]]:
    """The line a worker writes for ``event`` stamped ``t``, and the record it holds (``event``, ``t``, then the
    fields the event was made with). ``default``: ``json.dumps``'s fallback for values JSON lacks (numpy scalars)."""
    record = {"event": event.event, "t": t, **event.fields()}
    return EVENT_PREFIX + json.dumps(record, default=default) + "\n", record


def parse_event(line: bytes | str) -> tuple[Event, dict[str, Any]] | None:
    """The event of a worker's output line, typed, and the record as it was sent (kept as is in the events file and
    the trial record); None for a line without ``EVENT_PREFIX``. Raises ValueError (json.JSONDecodeError,
    pydantic.ValidationError) for a marked line that is not a valid event."""
    text = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
    if not text.startswith(EVENT_PREFIX):
        return None
    record = json.loads(text[len(EVENT_PREFIX):])
    return _EVENT.validate_python(record), record
