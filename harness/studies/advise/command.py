"""``harness advise``: which batch size, per objective, for each framework entry of a spec.

The stages, each by the studies that exist (docs/guide/which-batch-size.md): memory (``harness.studies.max_batch``:
the limit and the recommendation that holds, which bound the candidates), a calibration of step times at the ends of
the candidates, the gradient noise scale (one trial of the spec's model measuring squared gradient norms at every
evaluation, trained toward the target), throughput (a sweep of the candidates with repeats: step time, throughput,
energy per step; each trial timing no more steps than the training to the target it predicts), then the prediction
of steps, time and energy to the target per candidate (``harness.studies.advise.predict``); the trials are
``harness.studies.advise.trials``. Writes ``advice.json`` (the
machine-readable answer) and ``advice.md`` (the answer first, then the evidence) in a run directory of its own that
also holds each stage's run directory.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

from harness import plan as planning
from harness.plan.entries import entry_named
from harness.results import store
from harness.spec import GradientNoiseSpec, Spec, SpecError
from harness.studies.advise import plot, trials
from harness.studies.advise.noise import NoiseScale
from harness.studies.advise.predict import Speed, candidates, fastest_and_knee, predict
from harness.studies.advise.trials import log, steps_model
from harness.studies.advise.validate import successive_halving

OBJECTIVES = ("memory", "throughput", "time", "energy")
#: The smallest batch the noise trial uses by default, where the spec has one (``check``).
NOISE_BATCH = 64


@dataclass
class Options:
    """What ``advise`` was asked. frameworks: entry labels (empty: every entry). objectives: of ``OBJECTIVES``. target:
    the test accuracy to reach (None: the spec's). budget_s: the command's wall-time bound, or None. repeats: of
    each throughput candidate. noise_batch: the noise trial's batch size (None: the spec's base_batch_size, else its
    smallest batch size that ``micro_batches`` divides). micro_batches, probes: ``GradientNoiseSpec``'s. device:
    None for the spec's. out: the folder that receives the run directory. validate: train the candidates to the
    target by successive halving (``harness.studies.advise.validate``) and judge the time answer. global_batch: G,
    samples per optimizer step, reached by accumulation or data parallelism (``harness.studies.advise.global_batch``;
    runs the memory stage)."""

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
    validate: bool = False
    global_batch: int | None = None


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


def check(spec: Spec, spec_path: str | Path, options: Options) -> tuple[list[str], int, int, int]:
    """Everything checked before anything runs: the entries, the objectives, the noise trial's batch size and its
    split, the global batch against the training set. Returns (the entries' labels, the noise trial's batch size,
    its micro-batches, the training set's size). Raises SpecError (one line naming the file and the field or
    argument)."""
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
    if options.validate and (options.target if options.target is not None else spec.target_accuracy) is None:
        raise SpecError(spec_path, "--validate", "needs a target accuracy (--target-accuracy or the spec's "
                                                 "target_accuracy)")
    if options.validate and "time" not in options.objectives:
        raise SpecError(spec_path, "--validate", "judges the time objective: add time to --objective")
    train_size = trials.train_size_of(spec)
    if options.global_batch is not None and not 2 <= options.global_batch <= train_size:
        raise SpecError(spec_path, "--global-batch", f"{options.global_batch} is not between 2 and the "
                                                     f"{train_size} training samples")
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
        noisy = spec.model_copy(update={"gradient_noise": GradientNoiseSpec(micro_batches=k, probes=options.probes)})
        why = planning.unsupported_reason(noisy, label, planning.spec_conditions(noisy, options.device or "cpu"))
        if why is not None:
            raise SpecError(spec_path, "frameworks", f"{label}: {why}")
    return chosen, batch, k, train_size


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

    labels, noise_batch, k, train_size = check(spec, spec_path, options)
    target = options.target if options.target is not None else spec.target_accuracy
    run = Stages(spec, spec_path, options, labels, options.device or resolve_device(spec.device), target,
                 run_directory(options.out, spec), Budget(options.budget_s), train_size)
    answer: dict[str, Any] = {"spec": str(spec_path), "device": run.device, "target_accuracy": target,
                              "objectives": list(options.objectives), "entries": {}}
    memory = run.memory()
    bounds = [m["recommended"] for m in memory.values() if m.get("recommended")]
    largest = min(min(bounds) if bounds else max(spec.batch_sizes), run.train_size // 2)
    sizes = candidates(min(min(spec.batch_sizes), largest), largest, min(bounds) if bounds else None)
    answer["candidates"] = sizes
    speeds, noise, reached = run.speed_and_noise(sizes, noise_batch, k, answer)
    for label in labels:
        answer["entries"][label] = entry_answer(label, options.objectives, memory.get(label), speeds[label],
                                                noise.get(label), reached.get(label), noise_batch, target, run.device)
        if options.global_batch:
            answer["entries"][label]["global_batch"] = global_batch(run, label, options.global_batch,
                                                                    memory.get(label))
    if options.validate and target is not None:
        for label in labels:
            validate(run, label, answer["entries"][label]["objectives"]["time"],
                     [s.batch_size for s in speeds[label]] or sizes)
    budget = run.budget
    answer["spent"] = {"seconds": budget.spent, "wall_s": round(time.monotonic() - budget.start, 1),
                       "cut": budget.cut}
    answer["notes"] = [f"the budget of {options.budget_s:.0f} s cut: {', '.join(budget.cut)}; the answer rests on "
                       "the stages that ran"] if budget.cut else []
    for label in labels:
        figure = plot.figure(label, answer["entries"][label]["objectives"].get("time") or {},
                             run.folder / "plots" / f"time-to-target-{re.sub(r'[^A-Za-z0-9_.-]+', '-', label)}.png")
        answer["entries"][label]["plot"] = None if figure is None else str(figure.relative_to(run.folder))
    (run.folder / "advice.json").write_text(json.dumps(answer, indent=2, default=str), encoding="utf-8")
    from harness.studies.advise.output import markdown

    (run.folder / "advice.md").write_text(markdown(answer), encoding="utf-8")
    return run.folder


@dataclass
class Stages:
    """One ``advise`` command's stages and what they share: the spec, the options, the entries' labels, the device,
    the target, the run directory, the budget and the training set's size."""

    spec: Spec
    spec_path: str | Path
    options: Options
    labels: list[str]
    device: str
    target: float | None
    folder: Path
    budget: Budget
    train_size: int

    def memory(self) -> dict[str, dict[str, Any]]:
        """max-batch per entry (``max_batch``), where the memory objective or ``--global-batch`` asks for it."""
        out: dict[str, dict[str, Any]] = {}
        if "memory" in self.options.objectives or self.options.global_batch:
            for label in self.labels:
                if self.budget.allows(f"memory {label}"):
                    out[label] = self.budget.timed("memory", partial(max_batch, self.spec, self.spec_path, label,
                                                                     self.device, self.folder))
        return out

    def speed_and_noise(self, sizes: list[int], noise_batch: int, k: int, answer: dict[str, Any]
                        ) -> tuple[dict[str, list[Speed]], dict[str, NoiseScale], dict[str, int | None]]:
        """Step times at the ends of ``sizes`` (calibration), the noise trial, then the throughput trials, each
        timing no more steps than the training to the target it predicts (the compute goal: where training to the
        target takes less than a second, timing a second a trial spends more than training each size to the target
        would). Returns per entry the speeds, the noise scale and the steps the noise trial took to the target;
        the stages' run directories go in ``answer``."""
        spec, path, labels, budget = self.spec, self.spec_path, self.labels, self.budget
        objectives = self.options.objectives
        speeds: dict[str, list[Speed]] = {label: [] for label in labels}
        step_s: dict[tuple[str, int], float] = {}
        if {"throughput", "time", "energy"} & set(objectives) and budget.allows("throughput"):
            step_s = budget.timed("throughput", partial(trials.calibrate, spec, path, labels, sizes, self.train_size,
                                                        self.folder / "calibration"))
        noise: dict[str, NoiseScale] = {}
        reached: dict[str, int | None] = {}
        if {"time", "energy"} & set(objectives) and budget.allows("noise"):
            run_dir = budget.timed("noise", partial(trials.noise_trial, spec, path, labels, noise_batch, k,
                                                    self.options.probes, self.target, self.folder, self.train_size))
            answer["noise_run"] = str(run_dir)
            noise, reached = trials.noise_scales(store.read_trials(run_dir), labels, noise_batch, k, self.target,
                                                 spec.seed)
        if step_s and budget.allows("throughput"):
            bound = {label: model for label in labels
                     if (model := steps_model(noise.get(label), reached.get(label), noise_batch)) is not None}
            floor_s = trials.MIN_ENERGY_S if "energy" in objectives and self.device != "cpu" else 0.0
            run_dir = budget.timed("throughput", partial(trials.throughput, spec, path, labels, sizes,
                                                         self.train_size, self.options.repeats, self.folder, step_s,
                                                         bound, floor_s))
            answer["throughput_run"] = str(run_dir)
            answer["throughput_bound"] = {label: {"b_noise": b, "s_min": s} for label, (b, s) in bound.items()}
            speeds = trials.speeds_of(store.read_trials(run_dir), labels)
        return speeds, noise, reached


def validate(run: Stages, label: str, time_answer: dict[str, Any], sizes: list[int]) -> None:
    """``--validate`` for one entry: ``sizes`` trained to the target by successive halving, the budget asked before
    each round; the judgement of the time answer's size goes in ``time_answer["validation"]``."""
    target = run.target
    assert target is not None  # check: --validate needs one
    every_samples = trials.evaluation_samples(run.train_size)

    def train(alive: list[int], seeds: list[int]) -> dict[int, list[float | None]]:
        return trials.validation_round(run.spec, run.spec_path, label, alive, seeds, target, every_samples,
                                       run.folder / f"validate-{label}")

    result = run.budget.timed("validate", partial(successive_halving, sizes, train, run.spec.seed,
                                                  lambda: run.budget.allows(f"validate {label}")))
    time_answer["validation"] = result.judge(time_answer.get("batch_size"))


def global_batch(run: Stages, label: str, size: int, memory: dict[str, Any] | None) -> dict[str, Any]:
    """``--global-batch`` for one entry: the plans that reach ``size`` (``harness.studies.advise.global_batch``)
    under the memory stage's recommendation, measured ``--repeats`` times; advice.json's ``global_batch``."""
    from harness.studies.advise import global_batch as plans_of

    largest = memory.get("recommended") if memory else None
    unanswered: dict[str, Any] = {"global_batch": size, "batch_size": None, "rows": [], "notes": []}
    if largest is None:
        found = "not run (the budget)" if memory is None else f"{memory['status']} {memory['reason'] or ''}".strip()
        return {**unanswered, "reason": f"no micro-batch is known to hold (max-batch: {found})"}
    if not run.budget.allows(f"global batch {label}"):
        return {**unanswered, "reason": "not measured (the budget)"}
    devices = gpu_count() if run.device != "cpu" else 1
    chosen = plans_of.plans(size, largest, devices)
    measured = run.budget.timed("global batch", partial(plans_of.measure, run.spec, run.spec_path, label, chosen,
                                                        run.options.repeats, run.train_size, run.folder))
    return plans_of.answer(run.spec, label, size, largest, measured, devices)


def gpu_count() -> int:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES's, else NVML's count (``harness.measure.machine.gpus``)."""
    from harness.execution.executors import visible_gpus
    from harness.measure.machine import gpus

    visible = visible_gpus()
    return max(1, len(visible) if visible is not None else len(gpus().get("devices", [])))


def max_batch(spec: Spec, spec_path: str | Path, label: str, device: str, folder: Path) -> dict[str, Any]:
    """``harness max-batch`` of one entry (its run directory in ``folder``): the limit and the recommendation."""
    from harness.studies.max_batch import find_max_batch, write_run

    log(f"memory: max-batch for {label}")
    result = find_max_batch(spec, label, device, spec_file=spec_path)
    run_dir = write_run(result, spec, folder, spec_path)
    return {"limit": result.limit, "recommended": result.recommended, "status": result.status,
            "reason": result.reason, "cap_bytes": result.cap_bytes, "run": str(run_dir)}


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
        model = steps_model(noise, steps_at_noise_batch, noise_batch)
        s_min = None if model is None else model[1]
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
