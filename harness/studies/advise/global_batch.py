"""``harness advise --global-batch G``: a batch that may not fit on one device, reached by gradient accumulation
(a micro-batch that fits, k of them per optimizer step) or by data parallelism over the devices there are, the plans
measured side by side and the one with the highest throughput (the least time per sample) recommended.

Every plan trains G samples per optimizer step at the learning rate the spec's ``learning_rate_scaling`` gives G,
so they are the same optimisation (Goyal et al. 2017, "Accurate, Large Minibatch SGD", section 2) but for batchnorm:
it normalises each micro-batch (each device's shard, unless synchronised) on its own, so with batchnorm a plan with
accumulation is not the same model update as one batch of G (the caveat the answer carries).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness import plan as planning
from harness.neutral.models import ModelInfo
from harness.plan import Trial
from harness.plan.support import has_batchnorm
from harness.record import TrialRecord
from harness.results import store
from harness.spec import Spec
from harness.studies.advise.predict import t_interval
from harness.studies.advise.trials import derived, entry_dicts, log

#: Optimizer steps each plan's trial times (its epochs are set to hold them after the warm-up).
GLOBAL_STEPS = 20
#: Micro-batches per device count: the largest that fits and divides, and its halves.
PLANS_PER_DEVICES = 3


@dataclass(frozen=True)
class Plan:
    """One way to train ``micro_batch x accumulation x devices`` samples per optimizer step: ``micro_batch`` samples
    per device per forward pass, ``accumulation`` forward passes per step, over ``devices`` devices."""

    micro_batch: int
    accumulation: int
    devices: int = 1

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.devices

    @property
    def name(self) -> str:
        parts = ([f"{self.devices} devices x"] if self.devices > 1 else []) + [f"{self.micro_batch}"]
        if self.accumulation > 1:
            parts.append(f"x {self.accumulation} accumulated")
        return " ".join(parts)


def plans(global_batch: int, largest: int, devices: int = 1) -> list[Plan]:
    """The plans that reach ``global_batch``: for one device and, where there are several, for all of them, the
    largest micro-batch per device that fits (at most ``largest``) and divides the device's share, and up to
    ``PLANS_PER_DEVICES`` - 1 of its halves that divide it too.

    Args:
        global_batch: G, samples per optimizer step.
        largest: the largest micro-batch per device that holds (``harness max-batch``'s recommendation).
        devices: the devices data parallelism may use (1: accumulation only).

    Returns:
        The plans, one device's first, each micro-batch descending.

    Raises:
        ValueError: G or largest below 1.
    """
    if global_batch < 1 or largest < 1:
        raise ValueError(f"no plan for a global batch of {global_batch} with micro-batches up to {largest}")
    out = []
    for d in sorted({1, devices}):
        if global_batch % d:
            continue
        share = global_batch // d
        top = max(m for m in range(1, min(largest, share) + 1) if share % m == 0)
        halves = [top // 2 ** i for i in range(PLANS_PER_DEVICES) if top % 2 ** i == 0]
        out += [Plan(m, share // m, d) for m in halves]
    return out


def measure(spec: Spec, spec_path: str | Path, label: str, chosen: list[Plan], repeats: int, train_size: int,
            folder: Path) -> dict[Plan, list[TrialRecord]]:
    """Each plan ``repeats`` times for one entry (a sweep per device count, each trial ``GLOBAL_STEPS`` timed
    optimizer steps). Returns each plan's records."""
    from harness.studies import sweep

    steps_per_epoch = max(1, train_size // chosen[0].global_batch)
    epochs = max(1, math.ceil((spec.warmup_steps + GLOBAL_STEPS) / steps_per_epoch))
    out: dict[Plan, list[TrialRecord]] = {p: [] for p in chosen}
    for d in sorted({p.devices for p in chosen}):
        group = {p.micro_batch * d: p for p in chosen if p.devices == d}
        lr = planning.scaled_learning_rate(spec, chosen[0].global_batch)

        def adjust(trial: Trial, group: dict[int, Plan] = group, lr: float = lr) -> Trial:
            p = group[trial.micro_batch_size]
            return replace(trial, accumulation_steps=p.accumulation, samples_per_step=p.global_batch,
                           learning_rate=lr, epochs=epochs, evaluate_every=epochs)

        run = derived(spec, spec_path, batch_sizes=sorted(group), repeats=repeats, epochs=1, target_accuracy=None,
                      seeds=None, accumulation_steps=1, evaluate_every=1, frameworks=entry_dicts(spec, [label]),
                      **({"data_parallel": {"devices": d}} if d > 1 else {}))
        log(f"global batch {chosen[0].global_batch} for {label}: {', '.join(p.name for p in group.values())}")
        run_dir = sweep.run_spec(run, folder, spec_path, adjust=adjust)
        for record in store.read_trials(run_dir):
            if record.label == label and record.batch_size in group:
                out[group[record.batch_size]].append(record)
    return out


def answer(spec: Spec, label: str, global_batch: int, largest: int | None,
           measured: dict[Plan, list[TrialRecord]], devices: int) -> dict[str, Any]:
    """advice.json's ``global_batch`` of one entry: per plan its throughput (median, 95 % interval over repeats)
    and seconds per optimizer step, the recommended plan (the highest median throughput) and its runner-up, and
    the notes that apply (one device; batchnorm with accumulation)."""
    rows: list[dict[str, Any]] = []
    for p, records in measured.items():
        ok = [r.metrics.throughput_samples_per_s for r in records if r.ok and r.metrics.throughput_samples_per_s]
        failed = [f"{r.status}: {r.reason}" for r in records if not r.ok]
        interval = t_interval(ok)
        rows.append({"plan": p.name, "micro_batch": p.micro_batch, "accumulation": p.accumulation,
                     "devices": p.devices, "throughput_median": statistics.median(ok) if ok else None,
                     "throughput_interval": list(interval) if interval else None,
                     "step_s": global_batch / statistics.median(ok) if ok else None, "repeats": len(ok),
                     "failed": failed[0] if failed else None})
    ranked = sorted((r for r in rows if r["throughput_median"]), key=lambda r: -r["throughput_median"])
    notes = []
    if devices == 1:
        notes.append("one device: data parallelism needs several (each a GPU); the plans use accumulation")
    model = planning.trained_model(spec, planning.entry_for(spec, label))
    if any(r["accumulation"] > 1 for r in rows) and has_batchnorm(model):
        which = "the model has batchnorm" if isinstance(model, ModelInfo) else "if the model has batchnorm"
        notes.append(f"{which}: with accumulation each micro-batch is normalised on its own, so the update is not "
                     "that of one batch of G (a micro-batch's statistics, not G's)")
    return {"global_batch": global_batch, "largest_that_holds": largest, "rows": rows,
            "batch_size": ranked[0]["plan"] if ranked else None,
            "plan": {k: ranked[0][k] for k in ("micro_batch", "accumulation", "devices")} if ranked else None,
            "runner_up": ranked[1]["plan"] if len(ranked) > 1 else None,
            "reason": None if ranked else "no plan trained (see its run)", "notes": notes}
