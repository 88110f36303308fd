"""``run.json``: ``RunRecord``, what a run is (the spec as run, the machine, the frameworks' environments, the planned
trials) and how far it got (its sessions, interruptions, end). It changes only through its methods, each returning
the next record (a session started, the run interrupted, resumed, finished), and is written only through
``harness.results.store.RunFile``."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from harness.record.base import Open, Strict
from harness.record.version import SCHEMA_VERSION


class FrameworkEnvironment(Open):
    """A framework entry's interpreter as its probe reported it before the first trial
    (``harness.execution.probes.probe_entries``): the entry as given (``label``, ``name``, ``python``,
    ``command``), then what the probe found (``argv``, ``executable``, ``python_version``, ``platform``, ``numpy``,
    ``versions`` (with the entry's ``packages``), ``packages``, and for a model of your own ``model``)."""

    label: str
    name: str
    python: str | None = None
    command: list[str] | None = None
    executable: str | None = None
    python_version: str | None = None
    numpy: str | None = None
    versions: dict[str, Any] = Field(default_factory=dict)
    model: dict[str, Any] | None = Field(default=None, description=(
        "a model of your own, as its probe found it (harness.execution.native_probe): factory, kwargs, model_type, "
        "parameter_count, output_shape; null for the spec's neutral model"))


class Interruption(Strict):
    """Why a run stopped before its end, when, and which planned trials had finished and which had not run."""

    by: str = Field(description="the signal (SIGTERM, SIGHUP, SIGINT (Ctrl-C)) or the harness's own error")
    at: str = Field(description="UTC time, ISO 8601")
    finished: list[str] = Field(default_factory=list)
    not_run: list[str] = Field(default_factory=list)


class RunRecord(Strict):
    """``run.json`` of a run directory (results/README.md says what each field holds)."""

    schema_version: int = SCHEMA_VERSION
    harness_version: str | None = None
    spec_file: str | None = None
    spec: dict[str, Any] = Field(description="the spec as run (after CLI overrides), as JSON")
    device: str = Field(default="cpu", description="the resolved device: cpu or cuda:N")
    environment: dict[str, Any] = Field(default_factory=dict, description="the machine and the harness's own "
                                                                          "environment (harness.measure.machine)")
    frameworks: list[FrameworkEnvironment] = Field(default_factory=list)
    planned_trials: list[str] = Field(default_factory=list)
    started: str | None = Field(default=None, description="UTC time, ISO 8601")
    finished: str | None = Field(default=None, description="UTC time, ISO 8601; null while running or interrupted")
    executors: list[dict[str, Any]] = Field(default_factory=list, description=(
        "one entry per session (the first run and each --resume): the executor's description "
        "(harness.execution.executors)"))
    interrupted: Interruption | None = None
    interruptions: list[Interruption] = Field(default_factory=list, description="earlier interruptions, resumed")
    resumed: list[str] = Field(default_factory=list, description="when each --resume started")

    @property
    def name(self) -> str:
        """The spec's name."""
        return str(self.spec.get("name", ""))

    def session(self, executor: dict[str, Any]) -> RunRecord:
        """A session begins on ``executor`` (its description): one ``executors`` entry per session."""
        return self.model_copy(update={"executors": [*self.executors, executor]})

    def interrupt(self, by: str, at: str, finished: list[str]) -> RunRecord:
        """The run stopped at ``at`` by ``by`` with ``finished`` trials done: the rest of the plan is not run."""
        done = set(finished)
        return self.model_copy(update={"interrupted": Interruption(
            by=by, at=at, finished=list(finished), not_run=[t for t in self.planned_trials if t not in done])})

    def resume(self, at: str, frameworks: list[FrameworkEnvironment]) -> RunRecord:
        """A --resume at ``at``: the interruption moves to ``interruptions``, the run is unfinished again;
        ``frameworks`` fill in a run recorded without them."""
        return self.model_copy(update={
            "interrupted": None, "finished": None, "resumed": [*self.resumed, at],
            "interruptions": [*self.interruptions, *([self.interrupted] if self.interrupted else [])],
            "frameworks": self.frameworks or frameworks})

    def finish(self, at: str) -> RunRecord:
        return self.model_copy(update={"finished": at})

    def data(self) -> dict[str, Any]:
        """run.json's JSON data (``interrupted`` only while interrupted)."""
        return self.model_dump(exclude={"interrupted"} if self.interrupted is None else set())
