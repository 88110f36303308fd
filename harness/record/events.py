"""The worker's events, typed: each a model with its ``event`` name as the discriminator and ``t``, a
``time.monotonic()`` stamp (``harness.execution.protocol`` says how they travel: one marked JSON line each on the
worker's standard output). The launcher keeps them as these models, the run directory's ``events/<trial id>.jsonl``
holds them as JSON lines (``event_data``; ``parse_events`` reads them back), and every reader works on the models:
``phase_windows`` instead of searching dicts for a string.

Events keep extra fields (``extra="allow"``): a detail a worker adds reaches the events file without a change here.
The ``Result`` event's ``metrics`` are the record's own ``TrialMetrics`` (strict).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from harness.record.metrics import GradientNoise, TrialMetrics


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


#: import: the adapter's module (the framework) imported; data: the dataset loaded; build: the model built, the data
#: placed on the device and the loader opened; warmup, train (a timed window), eval, augment (an epoch's images).
PhaseName = Literal["import", "data", "build", "warmup", "train", "eval", "augment"]


class Phase(_Event):
    """An edge of a phase (``PhaseName``): the framework's import, the data, the model's build, warm-up, a timed
    training window, an evaluation, an augmentation load."""

    event: Literal["phase"] = "phase"
    name: PhaseName
    edge: Literal["start", "end"]
    epoch: int | None = None


class Epoch(_Event):
    """An evaluation after epoch ``epoch``: the fields of the record's ``EpochMetrics`` (which describes them)."""

    event: Literal["epoch"] = "epoch"
    epoch: int
    train_loss: float
    train_loss_steps: int
    test_loss: float
    test_accuracy: float
    timed_s: float
    gradient_noise: GradientNoise | None = None
    step: int | None = None


class Result(_Event):
    """The trial ended: its metrics (the record's ``metrics``), versions and settings."""

    event: Literal["result"] = "result"
    metrics: TrialMetrics
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
EVENT: TypeAdapter[Event] = TypeAdapter(Event)

E = TypeVar("E", bound=_Event)


def event_data(event: _Event) -> dict[str, Any]:
    """An event as the events file and the worker's line hold it: ``event``, ``t``, then the fields it was made (or
    read) with; values as they are (a NaN loss stays NaN for ``json.dumps``)."""
    return {"event": event.event, "t": event.t, **event.fields()}


def parse_events(rows: Iterable[dict[str, Any]]) -> list[Event]:
    """Events from their data (the lines of an events file, ``event_data``'s output); raises
    pydantic.ValidationError for one that is not a valid event."""
    return [EVENT.validate_python(row) for row in rows]


def first(events: Iterable[Any], kind: type[E], last: bool = False) -> E | None:
    """The first (``last``: the last) event of type ``kind``, or None."""
    found = [event for event in events if isinstance(event, kind)]
    return (found[-1] if last else found[0]) if found else None


def phase_windows(events: Iterable[Any], phase: PhaseName = "train") -> list[tuple[float, float]]:
    """The (start, end) monotonic times of every ``phase`` window in a worker's events: a start edge opens one, the
    next end edge closes it."""
    windows: list[tuple[float, float]] = []
    open_at: float | None = None
    for event in events:
        if not isinstance(event, Phase) or event.name != phase:
            continue
        if event.edge == "start":
            open_at = event.t
        elif open_at is not None:
            windows.append((open_at, event.t))
            open_at = None
    return windows
