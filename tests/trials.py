"""A trial for the shared training loop alone (``harness.execution.worker.train``), as a test builds one."""

from __future__ import annotations

from typing import Any

from harness.plan import Trial
from harness.spec import TimingSpec


def loop_trial(batch_size: int, timing: dict[str, Any] | TimingSpec, accumulation_steps: int = 1,
               **fields: Any) -> Trial:
    """A ``Trial`` with ``batch_size`` as its micro-batch and the samples per step the plan would compute; the
    fields the loop does not read get placeholders."""
    defaults: dict[str, Any] = {"id": "t-bs0-r0", "framework": "test", "repeat": 0, "device": "cpu", "threads": 1,
                                "seed": 0, "epochs": 1, "warmup_steps": 0, "learning_rate": 0.01}
    return Trial(**{**defaults, **fields}, micro_batch_size=batch_size, accumulation_steps=accumulation_steps,
                 samples_per_step=batch_size * accumulation_steps, timing=TimingSpec.model_validate(timing))


def run_options(options: dict[str, Any]) -> Any:
    """``adapters.base.RunOptions`` from flat test data: an ``AllocatorSpec`` field goes to ``allocator``."""
    from adapters.base import RunOptions
    from harness.spec import AllocatorSpec

    allocator = {k: v for k, v in options.items() if k in AllocatorSpec.model_fields}
    return RunOptions(**{k: v for k, v in options.items() if k not in allocator}, allocator=AllocatorSpec(**allocator))
