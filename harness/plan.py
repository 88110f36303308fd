"""Spec -> the ordered list of trials a run executes."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from harness.spec import Spec


@dataclass(frozen=True)
class Trial:
    """One framework, one batch size, one repeat: one worker process.

    id: stable and unique within a run, ``"<framework>-bs<batch size>-r<repeat>"``. device: "cpu" or "cuda:N"
    (``auto`` already resolved). threads: intra-op CPU threads for the framework (inter-op is 1), the same for every
    framework. learning_rate: what the optimizer uses (the spec's, until scaling rules exist).
    """

    id: str
    framework: str
    batch_size: int
    repeat: int
    device: str
    threads: int
    seed: int
    epochs: int
    warmup_steps: int
    sync_every: int
    learning_rate: float

    def payload(self, spec: Spec) -> dict[str, Any]:
        """What the worker reads on standard input: the trial and the whole spec, as JSON-ready data."""
        return {"trial": asdict(self), "spec": spec.model_dump(mode="json")}


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask), the default thread count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def plan(spec: Spec, device: str) -> list[Trial]:
    """The trials of ``spec`` in run order.

    ``cpu_threads: null`` becomes every available CPU, set explicitly for every framework: left to themselves the
    frameworks disagree (MXNet uses half the cores on x86 unless OMP_NUM_THREADS is set; PyTorch and TensorFlow use
    all of them), which would make the comparison unfair.

    Repeats are the outer loop and, within one batch size, the frameworks alternate, so slow drift of the machine
    (heat, other load) spreads over every framework instead of masquerading as a difference between them. Every
    repeat uses the spec's seed: the same weights and batches; repeats measure timing noise, not seed variance.
    """
    return [
        Trial(id=f"{framework}-bs{batch}-r{repeat}", framework=framework, batch_size=batch, repeat=repeat,
              device=device, threads=spec.cpu_threads or available_cpus(), seed=spec.seed, epochs=spec.epochs,
              warmup_steps=spec.warmup_steps,
              sync_every=spec.timing.sync_every, learning_rate=spec.optimizer.learning_rate)
        for repeat in range(spec.repeats)
        for batch in spec.batch_sizes
        for framework in spec.frameworks
    ]
