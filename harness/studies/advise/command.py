"""``harness advise``: which batch size, per objective, for each framework entry of a spec.

The stages, each by the studies that exist (docs/guide/which-batch-size.md): memory (``harness.studies.max_batch``:
the limit and the recommendation that holds, which bound the candidates), throughput (a sweep of the candidates
with repeats: step time, throughput, energy per step), the gradient noise scale (one trial of the spec's model
measuring squared gradient norms at every evaluation, trained toward the target), then the prediction of steps,
time and energy to the target per candidate (``harness.studies.advise.predict``). Writes ``advice.json`` (the
machine-readable answer) and ``advice.md`` (the answer first, then the evidence) in a run directory of its own that
also holds each stage's run directory.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

from harness import plan as planning
from harness.plan import Trial
from harness.plan.entries import entry_named
from harness.record import TrialRecord
from harness.results import store
from harness.spec import GradientNoiseSpec, Spec, SpecError
from harness.studies.advise.noise import NoiseScale, noise_scale
from harness.studies.advise.predict import Speed, candidates, fastest_and_knee, predict

OBJECTIVES = ("memory", "throughput", "time", "energy")
#: The smallest batch the noise trial uses by default, where the spec has one (``check``).
NOISE_BATCH = 64
#: Timed steps a throughput trial has at least (its epochs are raised to give them): with 10, an MLP on digits timed
#: 10 ms at batch 256 on this project's CPU and its repeats spread 5-fold.
MIN_TIMED_STEPS = 50
#: Timed seconds a throughput trial aims at: on an H200 (2026-11-28) 50 steps were 10 to 30 ms of JAX and about
#: 0.1 s of PyTorch, shorter than NVML's energy counter refresh (0.1 s): no energy figure, and intervals to 0.
MIN_TIMED_S = 1.0


@dataclass
class Options:
    """What ``advise`` was asked. frameworks: entry labels (empty: every entry). objectives: of ``OBJECTIVES``. target:
    the test accuracy to reach (None: the spec's). budget_s: the command's wall-time bound, or None. repeats: of
    each throughput candidate. noise_batch: the noise trial's batch size (None: the spec's base_batch_size, else its
    smallest batch size that ``micro_batches`` divides). micro_batches, probes: ``GradientNoiseSpec``'s. device:
    None for the spec's. out: the folder that receives the run directory."""

    frameworks: list[str] = field(default_factory=list)
    objectives: tuple[str, ...] = OBJECTIVES
    target: float | None = None
    budget_s: float | None = None
    repeats: int = 3
    noise_batch: int | None = None
    micro_batches: int = 8
    probes: int = 8
    device: str | None = None
    out: str | Path = "results"


class Budget:
    """The command's wall-time bound: whether a stage may start, and what was cut (``spent``: seconds per stage)."""

    def __init__(self, seconds: float | None):
        self.start, self.seconds = time.monotonic(), seconds
        self.spent: dict[str, float] = {}
        self.cut: list[str] = []

    def allows(self, stage: str) -> bool:
        if self.seconds is not None and time.monotonic() - self.start >= self.seconds:
            self.cut.append(stage)
            return False
        return True

    def timed(self, stage: str, work: Callable[[], Any]) -> Any:
        begun = time.monotonic()
        try:
            return work()
        finally:
            self.spent[stage] = round(self.spent.get(stage, 0.0) + time.monotonic() - begun, 1)


def log(line: str) -> None:
    print(f"advise: {line}", file=sys.stderr, flush=True)


def check(spec: Spec, spec_path: str | Path, options: Options) -> tuple[list[str], int, int]:
    """Everything checked before anything runs: the entries, the objectives, the noise trial's batch size and its
    split. Returns (the entries' labels, the noise trial's batch size, its micro-batches). Raises SpecError (one
    line naming the file and the field or argument)."""
    labels = [entry.row for entry in spec.entries]
    for name in options.frameworks:
        if name not in labels and name not in {entry.name for entry in spec.entries}:
            raise SpecError(spec_path, "--framework", f"{name!r} is not an entry of the spec (its entries: "
                                                      f"{', '.join(labels)})")
    chosen = [entry_named(spec, name, spec_path).row for name in options.frameworks] or labels
    unknown = [o for o in options.objectives if o not in OBJECTIVES]
    if unknown or not options.objectives:
        raise SpecError(spec_path, "--objective", f"{', '.join(unknown) or 'none given'}: each is one of "
                                                  f"{', '.join(OBJECTIVES)}")
    if options.target is not None and not 0 < options.target <= 1:
        raise SpecError(spec_path, "--target-accuracy", f"{options.target} is not a fraction in (0, 1]")
    if options.repeats < 1:
        raise SpecError(spec_path, "--repeats", "at least 1")
    k = options.micro_batches
    # the noise trial's size: the one asked for, else the spec's base_batch_size (the learning rate is for it), else
    # its smallest batch size of at least NOISE_BATCH that k micro-batches divide: |G|^2 is estimated from the
    # difference of two norms, lost in their noise where tr(Sigma) / B dwarfs it (batch 8 in micro-batches of 1 on
    # digits: the estimate was negative with 8 probes)
    divisible = sorted(b for b in spec.batch_sizes if b % k == 0)
    fallback = next((b for b in divisible if b >= NOISE_BATCH), divisible[-1] if divisible else min(spec.batch_sizes))
    batch = options.noise_batch or spec.base_batch_size or fallback
    if k < 2 or batch % k:
        raise SpecError(spec_path, "--micro-batches", f"the noise trial's batch of {batch} samples cannot be split "
                                                      f"into {k} equal micro-batches (k >= 2 dividing it)")
    if spec.data_parallel is not None and spec.data_parallel.size > 1:
        raise SpecError(spec_path, "data_parallel", "advise measures one device; --global-batch plans are not "
                                                    "built yet")
    for label in chosen:
        why = planning.unsupported_reason(
            spec.model_copy(update={"gradient_noise": GradientNoiseSpec(micro_batches=k, probes=options.probes)}),
            label, device=options.device or "cpu")
        if why is not None:
            raise SpecError(spec_path, "frameworks", f"{label}: {why}")
    return chosen, batch, k


def derived(spec: Spec, spec_path: str | Path, **changes: Any) -> Spec:
    """``spec`` with ``changes`` (its variants dropped), checked as a spec file is."""
    data = spec.model_dump(mode="json", exclude_none=True)
    data.update(changes)
    data.pop("variants", None)
    return planning.checked_spec(data, spec_path)


def run_directory(out: str | Path, spec: Spec) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    folder = Path(out) / f"advise-{spec.name}-{stamp}"
    folder.mkdir(parents=True, exist_ok=False)
    return folder


def advise(spec: Spec, spec_path: str | Path, options: Options) -> Path:
    """Runs the stages and writes the answer (see the module docstring). Returns the run directory.

    Raises:
        SpecError: a bad spec or argument (``check``), before anything runs.
    """
    from harness.measure.machine import resolve_device

    labels, noise_batch, k = check(spec, spec_path, options)
    device = options.device or resolve_device(spec.device)
    target = options.target if options.target is not None else spec.target_accuracy
    folder = run_directory(options.out, spec)
    budget = Budget(options.budget_s)
    answer: dict[str, Any] = {"spec": str(spec_path), "device": device, "target_accuracy": target,
                              "objectives": list(options.objectives), "entries": {}}

    # memory: max-batch per entry; the smallest recommendation bounds every entry's candidates
    memory: dict[str, dict[str, Any]] = {}
    if "memory" in options.objectives:
        for label in labels:
            if budget.allows(f"memory {label}"):
                memory[label] = budget.timed("memory", partial(max_batch, spec, spec_path, label, device, folder))
    train_size = _train_size(spec)
    bounds = [m["recommended"] for m in memory.values() if m.get("recommended")]
    largest = min(min(bounds) if bounds else max(spec.batch_sizes), train_size // 2)
    sizes = candidates(min(min(spec.batch_sizes), largest), largest, min(bounds) if bounds else None)
    answer["candidates"] = sizes

    speeds: dict[str, list[Speed]] = {label: [] for label in labels}
    if {"throughput", "time", "energy"} & set(options.objectives) and budget.allows("throughput"):
        run_dir = budget.timed("throughput", partial(_throughput, spec, spec_path, labels, sizes, train_size,
                                                     options.repeats, folder))
        answer["throughput_run"] = str(run_dir)
        speeds = _speeds(store.read_trials(run_dir), labels)

    noise: dict[str, NoiseScale] = {}
    reached: dict[str, int | None] = {}
    if {"time", "energy"} & set(options.objectives) and budget.allows("noise"):
        run_dir = budget.timed("noise", partial(_noise, spec, spec_path, labels, noise_batch, k, options.probes,
                                                target, folder))
        answer["noise_run"] = str(run_dir)
        noise, reached = _noise_scales(store.read_trials(run_dir), labels, noise_batch, k, target, spec.seed)

    for label in labels:
        answer["entries"][label] = entry_answer(label, options.objectives, memory.get(label), speeds[label],
                                                noise.get(label), reached.get(label), noise_batch, target, device)
    answer["spent"] = {"seconds": budget.spent, "wall_s": round(time.monotonic() - budget.start, 1),
                       "cut": budget.cut}
    answer["notes"] = [f"the budget of {options.budget_s:.0f} s cut: {', '.join(budget.cut)}; the answer rests on "
                       "the stages that ran"] if budget.cut else []
    (folder / "advice.json").write_text(json.dumps(answer, indent=2, default=str), encoding="utf-8")
    from harness.studies.advise.output import markdown

    (folder / "advice.md").write_text(markdown(answer), encoding="utf-8")
    return folder


def _entries(spec: Spec, labels: list[str]) -> list[dict[str, Any]]:
    return [planning.entry_for(spec, label).model_dump(mode="json", exclude_none=True) for label in labels]


def _throughput(spec: Spec, spec_path: str | Path, labels: list[str], sizes: list[int], train_size: int,
                repeats: int, folder: Path) -> Path:
    """The throughput stage: every candidate size ``repeats`` times (a sweep as ``harness run`` runs one), each
    trial timing at least ``MIN_TIMED_STEPS`` steps and about ``MIN_TIMED_S`` seconds. A calibration sweep first
    times the smallest and the largest size (one trial each, ``MIN_TIMED_STEPS`` steps) and each size's epochs
    follow from the step time interpolated between them. Returns the stage's run directory."""
    from harness.studies import sweep

    def steps_epochs(batch: int, steps: int) -> int:  # epochs for ``steps`` timed steps after warm-up
        return max(1, math.ceil((spec.warmup_steps + steps) / max(1, train_size // batch)))

    def sweep_of(batch_sizes: list[int], count: int) -> Spec:
        return derived(spec, spec_path, batch_sizes=batch_sizes, repeats=count, epochs=1, target_accuracy=None,
                       seeds=None, accumulation_steps=1, evaluate_every=1, frameworks=_entries(spec, labels))

    def adjust(epochs: Callable[[Trial], int]) -> Callable[[Trial], Trial]:
        return lambda trial: replace(trial, epochs=epochs(trial), evaluate_every=epochs(trial))

    ends = sorted({min(sizes), max(sizes)})
    log(f"throughput: calibrating at {' and '.join(map(str, ends))}")
    calibration = sweep.run_spec(sweep_of(ends, 1), folder / "calibration", spec_path,
                                 adjust=adjust(lambda t: steps_epochs(t.samples_per_step, MIN_TIMED_STEPS)))
    step_s = {(label, s.batch_size): s.step_s_median
              for label, speeds in _speeds(store.read_trials(calibration), labels).items() for s in speeds}

    def epochs(trial: Trial) -> int:
        batch, least = trial.samples_per_step, steps_epochs(trial.samples_per_step, MIN_TIMED_STEPS)
        known = [(b, step_s[(trial.row, b)]) for b in ends if (trial.row, b) in step_s]
        if not known:
            return least
        (b0, t0), (b1, t1) = known[0], known[-1]
        per_step = t0 if b1 == b0 else t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
        return max(least, steps_epochs(batch, math.ceil(MIN_TIMED_S / max(per_step, 1e-6))))

    log(f"throughput: {len(sizes)} sizes x {repeats} repeats x {len(labels)} entries, about {MIN_TIMED_S:g} s "
        "timed a trial")
    return sweep.run_spec(sweep_of(sizes, repeats), folder, spec_path, adjust=adjust(epochs))


def _noise(spec: Spec, spec_path: str | Path, labels: list[str], batch: int, k: int, probes: int,
           target: float | None, folder: Path) -> Path:
    """The noise stage: one trial per entry at ``batch``, its gradient norms measured at every evaluation
    (``harness.spec.GradientNoiseSpec``), trained for the spec's epochs toward ``target`` and stopped there
    (``stop_at_target``). Returns its run directory."""
    from harness.studies import sweep

    noise_spec = derived(spec, spec_path, batch_sizes=[batch], repeats=1, seeds=None, accumulation_steps=1,
                         target_accuracy=target, stop_at_target=target is not None, evaluate_every=1,
                         gradient_noise={"micro_batches": k, "probes": probes}, frameworks=_entries(spec, labels))
    log(f"noise scale: batch {batch} in {k} micro-batches of {batch // k}, {spec.epochs} epoch(s)")
    return sweep.run_spec(noise_spec, folder, spec_path)


def _noise_scales(records: list[TrialRecord], labels: list[str], batch: int, k: int, target: float | None,
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
        reached[record.label] = (None if at is None or record.metrics.steps_per_epoch is None
                                 else at.epochs * record.metrics.steps_per_epoch)
    return noise, reached


def max_batch(spec: Spec, spec_path: str | Path, label: str, device: str, folder: Path) -> dict[str, Any]:
    """``harness max-batch`` of one entry (its run directory in ``folder``): the limit and the recommendation."""
    from harness.studies.max_batch import find_max_batch, write_run

    log(f"memory: max-batch for {label}")
    result = find_max_batch(spec, label, device, spec_file=spec_path)
    run_dir = write_run(result, spec, folder, spec_path)
    return {"limit": result.limit, "recommended": result.recommended, "status": result.status,
            "reason": result.reason, "cap_bytes": result.cap_bytes, "run": str(run_dir)}


def _train_size(spec: Spec) -> int:
    from harness.neutral import datasets

    return len(datasets.load(spec.dataset, seed=spec.seed).y_train)


def _speeds(records: list[TrialRecord], labels: list[str]) -> dict[str, list[Speed]]:
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


def entry_answer(label: str, objectives: tuple[str, ...], memory: dict[str, Any] | None, speeds: list[Speed],
                 noise: NoiseScale | None, steps_at_noise_batch: int | None, noise_batch: int,
                 target: float | None, device: str) -> dict[str, Any]:
    """One entry's answer per objective: ``batch_size`` (None with ``reason`` when it cannot be answered), its
    runner-up or range, and the evidence it rests on."""
    out: dict[str, Any] = {"objectives": {}, "speeds": [s.record() for s in speeds],
                           "noise_scale": None if noise is None else noise.record()}
    answers = out["objectives"]
    if "memory" in objectives:
        if memory is None:
            answers["memory"] = {"batch_size": None, "reason": "not measured (the budget)"}
        else:
            answers["memory"] = {"batch_size": memory["recommended"], "limit": memory["limit"],
                                 "reason": None if memory["recommended"] else
                                 f"max-batch found no recommendation: {memory['status']} {memory['reason']}".strip()}
    if "throughput" in objectives:
        if not speeds:
            answers["throughput"] = {"batch_size": None, "reason": "no candidate trained (see the throughput run)"}
        else:
            fastest, knee = fastest_and_knee(speeds)
            answers["throughput"] = {"batch_size": fastest.batch_size, "knee": knee.batch_size,
                                     "throughput": fastest.throughput_median,
                                     "interval": fastest.throughput_interval}
    prediction, s_min = None, None  # one for both objectives, where the noise scale and step times are there
    if noise is not None and noise.b_simple is not None and speeds:
        s_min = (None if steps_at_noise_batch is None else
                 steps_at_noise_batch / (1 + noise.b_simple / noise_batch))
        prediction = predict(speeds, noise.b_simple, noise.interval, s_min)
    for objective in ("time", "energy"):
        if objective not in objectives:
            continue
        why = None
        if noise is None:
            why = "the noise scale was not measured (the budget)"
        elif noise.b_simple is None:
            why = f"the noise scale cannot be estimated: {noise.reason}"
        elif not speeds:
            why = "no candidate's step time was measured"
        elif objective == "energy" and not any(s.energy_median for s in speeds):
            notes = [note for s in speeds for note in s.energy_notes]
            why = (f"no size has an energy figure ({notes[0]})" if notes else
                   f"no energy counter on {device} (NVML's total-energy counter is read on NVIDIA GPUs only): the "
                   "energy objective needs one")
        if why is not None:
            answers[objective] = {"batch_size": None, "reason": why}
            continue
        assert noise is not None and prediction is not None
        unranked = [s.batch_size for s in speeds if objective == "energy" and s.energy_median is None]
        best = prediction.time_best if objective == "time" else prediction.energy_best
        spread = prediction.time_range if objective == "time" else prediction.energy_range
        row = next(r for r in prediction.rows if r["batch_size"] == best)
        answers[objective] = {
            "batch_size": best, "range": list(spread) if spread else None,
            "predicted": row["seconds"] if objective == "time" else row["joules"],
            "predicted_steps": row["steps"], "s_min": s_min, "b_noise": noise.b_simple,
            "reason": None, "rows": prediction.rows,
            "unranked": unranked,
            "note": "; ".join(filter(None, [
                None if s_min is not None else
                (f"the noise trial did not reach {target} in its epochs: sizes are ranked, the seconds not predicted"
                 if target is not None else "no target accuracy: sizes are ranked, the seconds not predicted"),
                f"sizes without an energy figure, not ranked: {', '.join(map(str, unranked))}" if unranked else None,
            ])) or None}
    return out
