"""The trials ``harness advise`` runs, each stage a sweep as ``harness run`` runs one (``harness.studies.sweep``):
the calibration (step times at the ends of the candidates), the throughput trials, and the noise trial; and what is
read back from them (seconds per step, the noise scale and the steps it took to the target).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness import plan as planning
from harness.plan import Trial
from harness.record import TrialRecord
from harness.results import store
from harness.spec import Spec
from harness.studies.advise.noise import NoiseScale, noise_scale
from harness.studies.advise.predict import Speed, steps_to_target

#: Timed steps of a trial whose step time is not known yet (the calibration, at the smallest and the largest
#: candidate): enough to size the throughput trials, whose own timing is what advise reports.
MIN_TIMED_STEPS = 20
#: Timed seconds a throughput trial aims at, at least MIN_BOUNDED_STEPS steps: 10 steps of a small model timed 10 ms
#: and spread its repeats 5-fold (docs/findings/2026-11-28-advise.md), while 10 steps of 0.4 s are steady (the copy
#: task's decoder at batch 256); 50 steps of a small model on a GPU are shorter than NVML's energy counter refresh
#: (docs/findings/2026-11-28-gpu-run.md).
MIN_TIMED_S = 1.0
#: Evaluations per epoch of the training set where advise measures time to the target by training (``--validate``):
#: every training set / 8 samples, the same at every batch size, so that steps to the target are resolved finer
#: than an epoch (an MLP on digits has 179 steps an epoch at batch 8, 2 at 512).
EVALUATIONS_PER_EPOCH = 8
#: The noise trial's gradient norms at every this-many evaluations (of EVALUATIONS_PER_EPOCH an epoch): twice an
#: epoch, while its steps to the target are resolved to an eighth of one.
NOISE_EVERY = 4
#: Timed steps a throughput trial has at least, whether its length comes from MIN_TIMED_S or from its predicted steps
#: to the target.
MIN_BOUNDED_STEPS = 10
#: Timed seconds a bounded trial has at least where energy is an objective on a device with an energy counter:
#: NVML's total-energy counter refreshes about every 0.1 s (docs/findings/2026-11-28-gpu-run.md).
MIN_ENERGY_S = 0.5


def log(line: str) -> None:
    print(f"advise: {line}", file=sys.stderr, flush=True)


def derived(spec: Spec, spec_path: str | Path, **changes: Any) -> Spec:
    """``spec`` with ``changes`` (its variants dropped), checked as a spec file is."""
    data = spec.model_dump(mode="json", exclude_none=True)
    data.update(changes)
    data.pop("variants", None)
    return planning.checked_spec(data, spec_path)


def train_size_of(spec: Spec) -> int:
    from harness.neutral import datasets

    return len(datasets.load(spec.dataset, seed=spec.seed).y_train)


def entry_dicts(spec: Spec, labels: list[str]) -> list[dict[str, Any]]:
    """The entries of ``labels`` as spec data (a derived spec's ``frameworks``)."""
    return [planning.entry_for(spec, label).model_dump(mode="json", exclude_none=True) for label in labels]


def _steps_epochs(spec: Spec, train_size: int, batch: int, steps: int) -> tuple[int, int]:
    """(epochs, steps per epoch) that hold the spec's warm-up and ``steps`` timed steps at ``batch``, and not many
    more: the fewest epochs of the training set's train_size // batch steps, each cut to an equal share (a trial
    of whole epochs timed a whole epoch where 100 steps were asked: 512 steps of the copy task at batch 8)."""
    needed = spec.warmup_steps + steps
    epochs = max(1, math.ceil(needed / max(1, train_size // batch)))
    return epochs, math.ceil(needed / epochs)


def _speed_spec(spec: Spec, spec_path: str | Path, labels: list[str], sizes: list[int], repeats: int) -> Spec:
    """The spec of a throughput sweep: ``sizes`` x ``repeats``, one evaluation at the end, no target."""
    return derived(spec, spec_path, batch_sizes=sizes, repeats=repeats, epochs=1, target_accuracy=None,
                   seeds=None, accumulation_steps=1, evaluate_every=1, frameworks=entry_dicts(spec, labels))


def _adjust(shape: Callable[[Trial], tuple[int, int]]) -> Callable[[Trial], Trial]:
    """``run_spec``'s hook: each trial's epochs and steps per epoch from ``shape``, evaluated once, after the
    last."""
    def adjusted(trial: Trial) -> Trial:
        epochs, steps = shape(trial)
        return replace(trial, epochs=epochs, evaluate_every=epochs, max_steps_per_epoch=steps)

    return adjusted


def calibrate(spec: Spec, spec_path: str | Path, labels: list[str], sizes: list[int], train_size: int,
               folder: Path) -> dict[tuple[str, int], float]:
    """Seconds per step at the smallest and the largest candidate (one trial each, ``MIN_TIMED_STEPS`` timed
    steps), per (entry label, batch size); the throughput trials' lengths are interpolated between them."""
    from harness.studies import sweep

    ends = sorted({min(sizes), max(sizes)})
    log(f"throughput: calibrating at {' and '.join(map(str, ends))}")
    run_dir = sweep.run_spec(_speed_spec(spec, spec_path, labels, ends, 1), folder, spec_path,
                             adjust=_adjust(lambda t: _steps_epochs(spec, train_size, t.samples_per_step,
                                                                    MIN_TIMED_STEPS)))
    return {(label, s.batch_size): s.step_s_median
            for label, speeds in speeds_of(store.read_trials(run_dir), labels).items() for s in speeds}


def timed_steps(batch: int, per_step_s: float | None, model: tuple[float, float] | None,
                floor_s: float = 0.0) -> int:
    """How many steps a throughput trial at ``batch`` times.

    Without a prediction: enough for ``MIN_TIMED_S`` seconds at ``per_step_s`` (the calibration's, interpolated),
    at least ``MIN_BOUNDED_STEPS`` (``MIN_TIMED_STEPS`` where ``per_step_s`` is None). With one (``model``:
    (B_noise, S_min), ``steps_model``): no more than the steps to the target it predicts, S(B) = S_min
    (1 + B_noise / B), and at least ``MIN_BOUNDED_STEPS`` and ``floor_s`` seconds (an energy counter's refresh).

    Args:
        batch: the trial's samples per step.
        per_step_s: its seconds per step, or None (not calibrated).
        model: (B_noise, S_min) or None.
        floor_s: the fewest seconds to time where a prediction bounds the trial.

    Returns:
        The timed steps, at least 1.
    """
    if per_step_s is None:
        return MIN_TIMED_STEPS
    goal = max(MIN_BOUNDED_STEPS, math.ceil(MIN_TIMED_S / max(per_step_s, 1e-9)))
    if model is None:
        return goal
    b_noise, s_min = model
    predicted = math.ceil(steps_to_target(batch, b_noise, s_min))
    least = max(MIN_BOUNDED_STEPS, math.ceil(floor_s / max(per_step_s, 1e-9)))
    return max(least, min(goal, predicted))


def steps_model(noise: NoiseScale | None, steps_at_noise_batch: int | None,
                noise_batch: int) -> tuple[float, float] | None:
    """(B_noise, S_min) of an entry, where its noise trial estimated a noise scale and reached the target:
    S_min = S0 / (1 + B_noise / B0) from the S0 steps it took at B0 = ``noise_batch``; else None."""
    if noise is None or noise.b_simple is None or steps_at_noise_batch is None:
        return None
    return noise.b_simple, steps_at_noise_batch / (1 + noise.b_simple / noise_batch)


def throughput(spec: Spec, spec_path: str | Path, labels: list[str], sizes: list[int], train_size: int,
                repeats: int, folder: Path, step_s: dict[tuple[str, int], float],
                bound: dict[str, tuple[float, float]], floor_s: float) -> Path:
    """The throughput stage: every candidate size ``repeats`` times (a sweep as ``harness run`` runs one), each
    trial timing ``timed_steps`` steps: about ``MIN_TIMED_S`` seconds from the calibration's step times
    (``step_s``), bounded by the predicted steps to the target where an entry has a prediction (``bound``).
    Returns the stage's run directory."""
    from harness.studies import sweep

    def shape(trial: Trial) -> tuple[int, int]:
        batch = trial.samples_per_step
        known = sorted((b, t) for (row, b), t in step_s.items() if row == trial.row)
        per_step = None
        if known:
            (b0, t0), (b1, t1) = known[0], known[-1]
            per_step = t0 if b1 == b0 else t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
        return _steps_epochs(spec, train_size, batch, timed_steps(batch, per_step, bound.get(trial.row), floor_s))

    how = ("no more than the predicted steps to the target" if bound else f"about {MIN_TIMED_S:g} s timed a trial")
    log(f"throughput: {len(sizes)} sizes x {repeats} repeats x {len(labels)} entries, {how}")
    return sweep.run_spec(_speed_spec(spec, spec_path, labels, sizes, repeats), folder, spec_path,
                          adjust=_adjust(shape))


def noise_trial(spec: Spec, spec_path: str | Path, labels: list[str], batch: int, k: int, probes: int,
           target: float | None, folder: Path, train_size: int) -> Path:
    """The noise stage: one trial per entry at ``batch``, trained for the spec's epochs toward ``target`` and
    stopped there (``stop_at_target``), evaluated every ``evaluation_samples(train_size)`` samples, so that the steps
    it took to the target (S0) are resolved finer than an epoch, and its gradient norms measured at every
    ``NOISE_EVERY``-th evaluation (``harness.spec.GradientNoiseSpec``). Returns its run directory."""
    from harness.studies import sweep

    noise_spec = derived(spec, spec_path, batch_sizes=[batch], repeats=1, seeds=None, accumulation_steps=1,
                         target_accuracy=target, stop_at_target=target is not None, evaluate_every=1,
                         evaluate_every_samples=evaluation_samples(train_size),
                         gradient_noise={"micro_batches": k, "probes": probes, "every": NOISE_EVERY},
                         frameworks=entry_dicts(spec, labels))
    log(f"noise scale: batch {batch} in {k} micro-batches of {batch // k}, {spec.epochs} epoch(s)")
    return sweep.run_spec(noise_spec, folder, spec_path)


def noise_scales(records: list[TrialRecord], labels: list[str], batch: int, k: int, target: float | None,
                  seed: int) -> tuple[dict[str, NoiseScale], dict[str, int | None]]:
    """Per entry: the noise scale of its noise trial, and the steps it took to the target (None: not reached)."""
    noise: dict[str, NoiseScale] = {}
    reached: dict[str, int | None] = {}
    for record in records:
        if record.label not in labels:
            continue
        if not record.ok:
            noise[record.label] = NoiseScale(batch // k, batch,
                                             reason=f"the noise trial ended {record.status}: {record.reason}")
            continue
        noise[record.label] = noise_scale(record.metrics.epochs, target, seed=seed)
        at = record.metrics.time_to_target
        reached[record.label] = None if at is None else at.steps  # the training loop records the steps
    return noise, reached


def speeds_of(records: list[TrialRecord], labels: list[str]) -> dict[str, list[Speed]]:
    """Per entry, per batch size, the ok trials' seconds per step (B / throughput), throughput and joules per timed
    step (where the device has an energy counter)."""
    out: dict[str, dict[int, Speed]] = {label: {} for label in labels}
    for r in records:
        m = r.metrics
        if r.label not in out or not r.ok or not m.throughput_samples_per_s:
            continue
        speed = out[r.label].setdefault(r.batch_size, Speed(r.batch_size, [], []))
        per_step = (m.effective_batch_size or r.batch_size) / m.throughput_samples_per_s
        speed.step_s.append(per_step)
        speed.throughput.append(m.throughput_samples_per_s)
        energy = r.sampler.energy.energy_j if r.sampler.energy is not None else None
        if energy is not None and m.measured_steps:
            speed.energy_per_step_j.append(energy / m.measured_steps)
        elif r.sampler.energy is not None and r.sampler.energy.note:
            speed.energy_notes.append(r.sampler.energy.note)
    return {label: sorted(by_size.values(), key=lambda s: s.batch_size) for label, by_size in out.items()}


def evaluation_samples(train_size: int) -> int:
    """The samples between evaluations where time to the target is measured by training: the ``train_size``
    samples of the training set over ``EVALUATIONS_PER_EPOCH`` (at least 1)."""
    return max(1, train_size // EVALUATIONS_PER_EPOCH)


def validation_round(spec: Spec, spec_path: str | Path, label: str, sizes: list[int], seeds: list[int],
                     target: float, every_samples: int, folder: Path) -> dict[int, list[float | None]]:
    """One round of ``--validate`` (``harness.studies.advise.validate``) for one entry: ``sizes`` x ``seeds``
    trained until ``target`` (``stop_at_target``, at most the spec's epochs), evaluated every
    ``every_samples`` samples (``evaluation_samples``). Returns per size the timed training
    seconds to the target of each seed, in ``seeds``' order (None: not reached, or the trial failed)."""
    from harness.studies import sweep

    run_spec = derived(spec, spec_path, batch_sizes=sizes, seeds=seeds, repeats=1, accumulation_steps=1,
                       target_accuracy=target, stop_at_target=True, evaluate_every=1,
                       evaluate_every_samples=every_samples, frameworks=entry_dicts(spec, [label]))
    log(f"validate {label}: {len(sizes)} sizes x seeds {seeds[0]}..{seeds[-1]} to {target}")
    run_dir = sweep.run_spec(run_spec, folder, spec_path)
    by_trial = {(r.batch_size, r.seed): r for r in store.read_trials(run_dir) if r.label == label}
    out: dict[int, list[float | None]] = {}
    for b in sizes:
        row = []
        for seed in seeds:
            record = by_trial.get((b, seed))
            at = None if record is None or not record.ok else record.metrics.time_to_target
            row.append(None if at is None else at.training_s)
        out[b] = row
    return out
