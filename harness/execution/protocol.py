"""What crosses between the orchestrator and a worker, typed: the payload in, the events out.

In: one line of JSON on the worker's standard input, a ``Payload``: the trial (``harness.plan.Trial`` itself, the
frozen dataclass, validated field by field with its own types: the spec's ``TimingSpec``, ``OptimizerSpec``,
``Precision`` and ``CompileMode`` among them) and the whole ``Spec``, plus what the launcher adds for the process
(``env``, ``cpus``, ``launcher_pid``; ``harness.execution.bootstrap`` applies those with the standard library alone,
before anything else is imported). The worker validates it once; nothing downstream restates a default.

Out: one line per event on the worker's original standard output, ``EVENT_PREFIX`` + JSON: ``start``, ``ready``,
``phase``, ``epoch``, ``result``, ``error``, and under a CPU memory cap ``memory_limit`` and ``memory_peak``
(``harness.execution.limits``). Each is a model of ``harness.record.events`` (re-exported here) with its ``event``
name as the discriminator and ``t``, a ``time.monotonic()`` stamp; the ``result`` event carries the record's typed
``TrialMetrics``. ``event_line`` is how the worker writes one, ``parse_event`` how the launcher reads it back, typed.

This module runs in every framework's environment (the worker imports it): it needs only pydantic and the harness's
own record, spec and plan modules (numpy, PyYAML), never pandas or a framework.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harness.plan import Trial
from harness.record.events import (
    EVENT,
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
    _Event,
    event_data,
)

__all__ = ["EVENT_PREFIX", "Epoch", "Error", "ErrorKind", "Event", "MemoryLimit", "MemoryPeak", "Payload", "Phase",
           "Ready", "Result", "Start", "event_line", "parse_event"]

#: The mark of an event line on a worker's standard output; any other line there is a wrapper's chatter (logged).
EVENT_PREFIX = "@harness-event "


class Payload(BaseModel):
    """What a worker reads on standard input: the trial, resolved by the plan (its model, dataset, optimizer and process
    settings included: ``harness.plan.Trial``), and the process settings the launcher adds (``env``: environment
    variables the bootstrap sets before any import; ``cpus``: the cores it pins the process to, None for no pinning;
    ``launcher_pid``: for ``PR_SET_PDEATHSIG``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trial: Trial
    env: dict[str, str] = Field(default_factory=dict)
    cpus: list[int] | None = None
    launcher_pid: int | None = None

    def line(self) -> bytes:
        """The payload as the one line the worker reads (JSON, newline-terminated)."""
        return self.model_dump_json().encode() + b"\n"


def event_line(event: _Event, t: float, default: Any = None) -> tuple[str, dict[str, Any]]:
    """The line a worker writes for ``event`` stamped ``t``, and the data it holds (``event``, ``t``, then the
    fields the event was made with: ``harness.record.events.event_data``). ``default``: ``json.dumps``'s fallback for
    values JSON lacks (numpy scalars)."""
    record = event_data(event.model_copy(update={"t": t}))
    return EVENT_PREFIX + json.dumps(record, default=default) + "\n", record


def parse_event(line: bytes | str) -> Event | None:
    """The event of a worker's output line, typed; None for a line without ``EVENT_PREFIX``. Raises ValueError
    (json.JSONDecodeError, pydantic.ValidationError) for a marked line that is not a valid event."""
    text = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
    if not text.startswith(EVENT_PREFIX):
        return None
    return EVENT.validate_python(json.loads(text[len(EVENT_PREFIX):]))
