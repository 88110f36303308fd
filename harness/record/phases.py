"""Where a trial's wall time went (``TrialRecord.phases``): its worker's life cut into phases on the monotonic clock
the launcher and the worker's events share (``time.monotonic()``, one clock per machine). Only ``timed_s`` enters
throughput; the rest is what a sweep pays per trial (docs/design/timing.md#where-a-trials-time-goes)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import Field

from harness.record.base import Strict
from harness.record.events import Phase, Ready, Result, Start, first


class TrialPhases(Strict):
    """Seconds of each phase of one worker's life, from the launcher's start of it to its exit; a phase the worker
    did not reach is None. ``start_s`` + ... + ``teardown_s`` is ``total_s`` (what is in no phase is ``other_s``)."""

    start_s: float | None = Field(default=None, description=(
        "from the launcher's start of the worker to its start event: the interpreter and the harness's imports "
        "(cold), or the fork of a preloaded parent (forked)"))
    import_s: float | None = Field(default=None, description="the adapter's module and so the framework imported "
                                                             "(nearly 0 when forked from a parent that holds it)")
    prepare_s: float | None = Field(default=None, description="the device, threads and seed set (Adapter.prepare)")
    data_s: float | None = Field(default=None, description="the dataset loaded into host memory")
    build_s: float | None = Field(default=None, description="the model built, the data placed on the device, the "
                                                            "loader opened")
    warmup_s: float | None = Field(default=None, description="the warm-up steps, compilation included")
    timed_s: float | None = Field(default=None, description="the timed windows (what throughput counts)")
    eval_s: float | None = Field(default=None, description="the evaluations of the test set")
    other_s: float | None = Field(default=None, description="the rest of training: between windows (loss reads, "
                                                            "epoch ends, augmentation), and the result's assembly")
    teardown_s: float | None = Field(default=None, description="from the result to the worker's exit")
    total_s: float | None = Field(default=None, description="from the launcher's start of the worker to its exit")

    @property
    def outside_training_s(self) -> float | None:
        """What is neither timed training nor evaluation: the per-trial cost a sweep pays besides its work."""
        if self.total_s is None:
            return None
        return self.total_s - (self.timed_s or 0.0) - (self.eval_s or 0.0)

    @classmethod
    def from_events(cls, events: Iterable[Any], started: float, ended: float) -> TrialPhases:
        """The phases of a worker the launcher started at ``started`` and saw end at ``ended`` (monotonic seconds),
        from its events (``harness.record.events``)."""
        events = list(events)
        spans: dict[str, float] = {}
        opened: dict[str, float] = {}
        for event in events:
            if isinstance(event, Phase):
                if event.edge == "start":
                    opened[event.name] = event.t
                elif event.name in opened:
                    spans[event.name] = spans.get(event.name, 0.0) + event.t - opened.pop(event.name)
        start, ready, result = first(events, Start), first(events, Ready), first(events, Result, last=True)
        out: dict[str, float | None] = {"total_s": ended - started,
                                        "start_s": None if start is None else start.t - started}
        for name in ("import", "data", "build", "warmup", "eval"):
            out[f"{name}_s"] = spans.get(name)
        out["timed_s"] = spans.get("train")
        imported = _edge(events, "import", "end")
        data = _edge(events, "data", "start")
        if imported is not None and data is not None:
            out["prepare_s"] = data - imported
        if result is not None:
            out["teardown_s"] = ended - result.t
        if ready is not None and result is not None:
            training = result.t - ready.t
            out["other_s"] = training - sum(spans.get(n, 0.0) for n in ("warmup", "train", "eval"))
        return cls(**out)


def _edge(events: list[Any], name: str, edge: str) -> float | None:
    """The time of the first ``edge`` of phase ``name``, or None."""
    return next((e.t for e in events if isinstance(e, Phase) and e.name == name and e.edge == edge), None)
