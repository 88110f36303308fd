"""The answer in a real run: run checks, and the numbers that place the recommendation below the limit.

A probe (``harness.studies.max_batch.probe``) is not a run's trial: it trains a few optimizer steps with no warm-up
on synthetic data sized to the batch (accumulation_steps x G training and G test images, G the global batch) and
evaluates G test images after each step. A run's trial of the same spec holds the spec's whole dataset (e.g.
specs/max_batch.yaml: 2048 training and 256 test images, 28 MB, against 8 MB for a probe at batch 344), takes its
warm-up steps, trains every step of its epochs in timed windows and evaluates the whole test set. So a size that fits
every probe can still run out of memory in a run. A **run check** is that trial: the spec's own, planned by
``harness.plan.plan`` as ``harness run`` plans it (its dataset, warm-up, optimizer, evaluation, the cap, the devices),
in a fresh worker group, with its epochs cut to ``RUN_EPOCHS`` (more where the warm-up needs them, ``run_epochs``)
and each epoch to at most ``RUN_STEPS`` steps (at least warmup_steps + 1), so that it costs a few seconds: memory
reaches its steady peak within the first steps. No batch above ``largest_measured_batch`` is checked or recommended:
a run of the spec there has no step left to time after its warm-up.

The recommendation's numbers (docs/design/max-batch.md, step 6): the spread of the peak across the answer's probes
(``peak_spread``), the margin below the limit it justifies (``margin_samples``) and how many samples' worth a run's
peak stands above a probe's at the same size (``offset_samples``). Imports plan, spec and neutral only.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.neutral import datasets
from harness.plan import Trial, checked_spec, entry_for, plan
from harness.spec import DataParallelSpec, Spec, SyntheticData, SyntheticTokens

RUN_CHECKS = 2  # run checks of a candidate for the recommendation, each in a fresh worker group
RUN_STEPS = 5  # a run check's epochs are cut to this many steps (at least warmup_steps + 1)
RUN_EPOCHS = 2  # and to at most this many epochs: training again after an evaluation, as a run does
SPREAD_FACTOR = 2  # the default margin is this many times the spread of the peak across the answer's probes
#: And at least this fraction of the cap, in bytes: short probes placed the limit up to 9 % above the size a plain run
#: of the spec fails at (docs/findings/2026-11-28-probe-steps.md; docs/guide/max-batch.md).
MARGIN_FLOOR = 0.10


def run_check_spec(spec: Spec, framework: str, batch_size: int, memory_limit_mb: float | None, device: str,
                   spec_file: str | Path = "<max-batch run check>",
                   data_parallel: DataParallelSpec | None = None, train_size: int | None = None) -> Spec:
    """The spec of a run check at ``batch_size`` per device: the spec as it is (dataset, warm-up, optimizer,
    allocator, accumulation, evaluation) for ``framework``'s entry alone, at the global batch (per-device x the
    devices of ``data_parallel``; None: one device), with ``run_epochs`` epochs (RUN_EPOCHS, more where the warm-up
    needs them, at most the spec's; ``train_size``: the run's training samples, None: counted here), one repeat, no
    variants and no target accuracy, under ``memory_limit_mb`` (MB = 10^6 bytes) on ``device``. Raises SpecError,
    and ValueError for a dataset that cannot be counted."""
    devices = 1 if data_parallel is None else data_parallel.size
    train = train_size if train_size is not None else run_train_size(spec)
    data = spec.model_dump(mode="json")
    data.update({
        "frameworks": [entry_for(spec, framework).model_dump(mode="json", exclude_none=True)],
        "batch_sizes": [batch_size * devices],
        "epochs": run_epochs(spec, train // (batch_size * devices * spec.accumulation_steps)),
        "repeats": 1, "variants": None, "target_accuracy": None,
        "memory_limit_mb": memory_limit_mb, "device": device,
        "data_parallel": None if data_parallel is None else data_parallel.model_dump(mode="json"),
    })
    return checked_spec(data, spec_file)


def run_check_trial(rspec: Spec, device: str) -> Trial:
    """The trial of a run check's spec (``run_check_spec``) as ``harness run`` plans it, each epoch cut to
    ``run_steps(rspec)`` steps."""
    return replace(plan(rspec, device)[0], max_steps_per_epoch=run_steps(rspec))


def run_steps(spec: Spec) -> int:
    """The steps per epoch of a run check at most: RUN_STEPS, and more than the warm-up (the worker measures at
    least one step after it)."""
    return max(RUN_STEPS, spec.warmup_steps + 1)


def run_epochs(spec: Spec, steps_per_epoch: int) -> int:
    """The epochs of a run check whose epochs hold ``steps_per_epoch`` steps (the run's, training samples // the
    samples of a step): RUN_EPOCHS, or more where the warm-up would leave none of their steps to measure (the
    training loop's rule, ``harness.execution.loop``: warmup_steps < steps per epoch x epochs), at most the spec's
    epochs (a size that a run of the spec cannot measure is above ``largest_measured_batch``)."""
    steps = min(max(1, steps_per_epoch), run_steps(spec))
    return min(spec.epochs, max(RUN_EPOCHS, spec.warmup_steps // steps + 1))


def largest_measured_batch(spec: Spec, train_size: int, devices: int = 1) -> int:
    """The largest per-device batch for which a run of ``spec`` trains at least one timed step: the training loop
    (``harness.execution.loop``) takes training samples // (batch x accumulation_steps x devices) steps per epoch
    and raises "warmup_steps W leaves none of the N steps to measure" unless W < that x epochs; so each epoch needs
    warmup_steps // epochs + 1 steps. 0 when not even batch size 1 leaves a step."""
    steps = spec.warmup_steps // spec.epochs + 1
    return train_size // (steps * spec.accumulation_steps * devices)


def run_train_size(spec: Spec) -> int:
    """The training samples a run of ``spec`` holds (``run_sizes``). Raises ValueError."""
    return run_sizes(spec)[0]


def run_sizes(spec: Spec) -> tuple[int, int]:
    """The training and test samples a run of ``spec`` holds (a synthetic dataset's ``size`` and ``test_size``;
    other datasets are loaded to count them). Raises ValueError for a dataset that cannot be loaded."""
    if isinstance(spec.dataset, (SyntheticData, SyntheticTokens)):
        return spec.dataset.size, spec.dataset.test_size
    try:
        data = datasets.load(spec.dataset, seed=spec.seed, train_images=False)
    except datasets.DatasetError as err:
        raise ValueError(str(err)) from None
    return len(data.y_train), len(data.y_test)


def run_shape(spec: Spec, train_size: int) -> dict[str, Any]:
    """What a run check of ``spec`` does, for the result and its text: dataset, training samples, epochs, steps per
    epoch at most, warm-up steps."""
    return {"dataset": spec.dataset.name, "train_size": train_size, "epochs": min(spec.epochs, RUN_EPOCHS),
            "steps_per_epoch": run_steps(spec), "warmup_steps": spec.warmup_steps}


def peak_spread(peaks: list[float], batch_size: int, per_sample_bytes: float | None) -> dict[str, Any] | None:
    """The spread of the peak (bytes) across the probes of one size: {batch_size, peaks_bytes, min_bytes,
    max_bytes, spread_bytes (max - min), spread_samples (spread / per_sample_bytes: the batch samples it is worth,
    None without a positive per-sample figure)}; None with fewer than two peaks."""
    if len(peaks) < 2:
        return None
    spread = max(peaks) - min(peaks)
    samples = spread / per_sample_bytes if per_sample_bytes and per_sample_bytes > 0 else None
    return {"batch_size": batch_size, "peaks_bytes": list(peaks), "min_bytes": min(peaks), "max_bytes": max(peaks),
            "spread_bytes": spread, "spread_samples": samples}


def margin_samples(limit: int, margin: float | None, spread: dict[str, Any] | None,
                   headroom_bytes: float | None = None, floor_bytes: float = 0.0,
                   per_sample_bytes: float | None = None, where: str = "the answer's probes") -> tuple[int, str]:
    """(samples kept below ``limit``, why) for the recommendation. ``margin`` (a fraction in [0, 1)) keeps
    limit - floor(limit x (1 - margin)). None keeps the margin the spread justifies, in bytes: SPREAD_FACTOR x the
    spread of ``spread`` (``peak_spread`` of the answer, or of a candidate's run checks: ``where``; two fresh
    workers' peaks differ by about one standard deviation, the mean range of two normal draws being 1.13 sigma, so
    twice it keeps about two sigma of the peak's variation free), and at least ``floor_bytes`` (MARGIN_FLOOR of the
    cap: two equal peaks are no proof of a peak that never varies), less ``headroom_bytes``: what the cap leaves
    above the answer's highest peak where the cap was not reached (the limit is the search's upper bound, not a
    memory boundary), so the margin is never more than the cap requires. Bytes become samples at
    ``per_sample_bytes`` (None: the spread's own bytes per sample), rounded up; 0 where neither gives a figure."""
    if margin is not None:
        return limit - math.floor(limit * (1 - margin) + 1e-9), f"--margin {margin:g}: {margin:.0%} of the limit"
    measured = spread is not None and spread.get("spread_samples") is not None
    per_sample = per_sample_bytes if per_sample_bytes and per_sample_bytes > 0 else None
    if per_sample is None and measured and spread is not None and spread["spread_samples"] > 0:
        per_sample = spread["spread_bytes"] / spread["spread_samples"]
    if not measured and not (floor_bytes and per_sample):
        return 0, "no spread measured at the answer (fewer than two peaks, or no fitted bytes per sample)"
    needed = SPREAD_FACTOR * spread["spread_samples"] if measured and spread is not None else 0.0  # in samples
    basis = f"{SPREAD_FACTOR} x the spread of the peak across {where}" if measured else "no spread measured"
    if per_sample is None:  # a spread of 0 bytes and nothing to count bytes with: no margin to keep
        return math.ceil(needed - 1e-9), basis
    if floor_bytes / per_sample > needed:
        needed = floor_bytes / per_sample
        basis = (f"the floor, {floor_bytes / 1e6:,.1f} MB of the cap kept free: "
                 + (f"more than {SPREAD_FACTOR} x the spread of the peak across {where}" if measured else basis))
    if headroom_bytes is not None and headroom_bytes > 0:
        if headroom_bytes >= needed * per_sample:
            return 0, (f"the cap was not reached: {headroom_bytes / 1e6:,.1f} MB above the answer's highest peak, "
                       f"at least the {needed * per_sample / 1e6:,.1f} MB the margin needs ({basis})")
        needed -= headroom_bytes / per_sample
        basis += f", less the {headroom_bytes / 1e6:,.1f} MB the cap leaves above the answer's highest peak"
    return math.ceil(needed - 1e-9), basis


def offset_samples(offset_bytes: float | None, per_sample_bytes: float | None) -> int:
    """The batch samples worth ``offset_bytes`` (how much a run's peak stands above a probe's at one size; a
    negative or unknown offset is 0) at ``per_sample_bytes``, rounded up; 0 without a positive per-sample figure."""
    if offset_bytes is None or offset_bytes <= 0 or not per_sample_bytes or per_sample_bytes <= 0:
        return 0
    return math.ceil(offset_bytes / per_sample_bytes - 1e-9)


def tried(result: Any) -> list[str]:
    """Every size the run checks of ``result`` (a ``MaxBatchResult``) tried, in order, and how its run checks
    ended: "131 (out of memory in 1 of 1)", "124 (ok in 2)", "16 (ok in 3)"."""
    out = []
    for size in dict.fromkeys(p.batch_size for p in result.probes if p.kind == "run"):
        statuses = result.statuses(size, "run")
        oom = statuses.count("oom")
        out.append(f"{size} (ok in {len(statuses)})" if not oom else
                   f"{size} (out of memory in {oom} of {len(statuses)})")
    return out
