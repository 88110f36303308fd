"""Spec -> the ordered list of trials a run executes (``plan``): entries x batch sizes x seeds x repeats x variants x
devices, and the numbers derived once per trial (micro-batch, samples per step, learning rate, devices)."""

from __future__ import annotations

import itertools
import math
import os
from typing import NamedTuple

from harness.plan.trial import Trial
from harness.spec import (
    CompileMode,
    DataParallelSpec,
    InputMode,
    OptimizerSpec,
    Precision,
    Spec,
)
from harness.spec.devices import device_index


def data_parallel_settings(spec: Spec) -> list[tuple[str, DataParallelSpec | None]]:
    """The spec's data-parallel settings with the field each comes from: ``variants.data_parallel``'s entries, else
    ``data_parallel`` (None: one device)."""
    if spec.variants is not None and spec.variants.data_parallel:
        return [(f"variants.data_parallel.{i}", dp) for i, dp in enumerate(spec.variants.data_parallel)]
    return [("data_parallel", spec.data_parallel)]


def data_parallel_devices(dp: DataParallelSpec, device: str) -> tuple[str, ...]:
    """The devices of a data-parallel trial run on ``device``: ``cpu:0..N-1`` on the CPU, the listed GPUs, or N
    consecutive GPUs from ``device``'s index."""
    if isinstance(dp.devices, list):
        return tuple(dp.devices)
    if device == "cpu":
        return tuple(f"cpu:{i}" for i in range(dp.size))
    first = device_index(device)
    return tuple(f"cuda:{first + i}" for i in range(dp.size))


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask), the default thread count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def variant_label(optimizer: OptimizerSpec) -> str:
    """A short name for an optimizer variant, e.g. "sgd lr=0.01 m=0.9" or "adam lr=0.001"."""
    label = f"{optimizer.name} lr={optimizer.learning_rate:g}"
    if optimizer.name == "sgd" and optimizer.momentum:
        label += f" m={optimizer.momentum:g}"
    if optimizer.weight_decay:
        label += f" wd={optimizer.weight_decay:g}"
    return label


class Variant(NamedTuple):
    """One combination of the spec's variant lists: its label ("" when the spec has none) and settings."""

    label: str
    optimizer: OptimizerSpec
    augmentation: bool
    precision: Precision
    compile: CompileMode
    data_parallel: DataParallelSpec | None = None
    input: InputMode = "resident"


def data_parallel_label(dp: DataParallelSpec | None) -> str:
    """A variant's words for its devices: "1 device", "2 devices", "2 devices, sync bn"."""
    n = 1 if dp is None else dp.size
    return f"{n} device{'s' if n > 1 else ''}" + (", sync bn" if dp is not None and dp.sync_batchnorm else "")


def variants(spec: Spec) -> list[Variant]:
    """Every combination of the spec's variant lists (optimizer, augmentation, precision, compile, data_parallel,
    input, in that order of nesting); one unnamed variant (the spec's own settings) when none are given. A label
    names only what varies, e.g. "adam lr=0.001, bf16, compiled"."""
    own = Variant("", spec.optimizer, spec.augmentation, spec.precision, spec.compile, spec.data_parallel, spec.input)
    if spec.variants is None:
        return [own]
    v = spec.variants
    out = []
    settings = [dp for _, dp in data_parallel_settings(spec)]
    for opt, aug, precision, compile, dp, source in itertools.product(
            v.optimizer or [spec.optimizer], v.augmentation if v.augmentation is not None else [spec.augmentation],
            v.precision or [spec.precision], v.compile or [spec.compile], settings, v.input or [spec.input]):
        parts = (([variant_label(opt)] if v.optimizer else []) +
                 ([f"aug {'on' if aug else 'off'}"] if v.augmentation is not None else []) +
                 ([precision] if v.precision else []) + ([compile] if v.compile else []) +
                 ([data_parallel_label(dp)] if v.data_parallel else []) + ([source] if v.input else []))
        out.append(Variant(", ".join(parts), opt, aug, precision, compile, dp, source))
    return out


def scaled_learning_rate(spec: Spec, effective_batch_size: int, optimizer: OptimizerSpec | None = None) -> float:
    """The optimizer's learning rate after ``learning_rate_scaling`` (none, linear or sqrt) relative to
    ``base_batch_size``: lr x B / base or lr x sqrt(B / base), with B the effective batch size."""
    lr = (optimizer or spec.optimizer).learning_rate
    if spec.learning_rate_scaling == "none" or spec.base_batch_size is None:
        return lr
    ratio = effective_batch_size / spec.base_batch_size
    return lr * ratio if spec.learning_rate_scaling == "linear" else lr * math.sqrt(ratio)


def plan(spec: Spec, device: str) -> list[Trial]:
    """The trials of ``spec`` in run order.

    ``cpu_threads: null`` becomes every available CPU, set explicitly for every framework: left to themselves the
    frameworks disagree (MXNet uses half the cores on x86 unless OMP_NUM_THREADS is set; PyTorch and TensorFlow use
    all of them), which would make the comparison unfair.

    Repeats are the outer loop and, within one batch size, the frameworks alternate, so slow drift of the machine
    (heat, other load) spreads over every framework instead of masquerading as a difference between them. Every
    repeat uses the same seed: the same weights and batches; repeats measure timing noise. Seed variance comes from
    ``seeds``: each seed its own trials (ids end in ``-s<seed>``), within each repeat.
    """
    return [
        Trial(id=f"{entry.slug}-bs{batch}-r{repeat}" + (f"-s{seed}" if spec.seeds else "") +
              (f"-v{index}" if variant.label else "") + (f"-dp{n}" if (n := _devices(variant)) > 1 else ""),
              framework=entry.name, data_parallel=n, sync_batchnorm=bool(variant.data_parallel
                                                                         and variant.data_parallel.sync_batchnorm),
              devices=data_parallel_devices(variant.data_parallel, device) if variant.data_parallel and n > 1 else (),
              label=entry.row, python=entry.python, command=tuple(entry.command) if entry.command else None,
              micro_batch_size=batch, repeat=repeat, variant=variant.label, augmentation=variant.augmentation,
              optimizer=variant.optimizer,
              precision=variant.precision, compile=variant.compile,
              device=device, threads=spec.cpu_threads or available_cpus(), seed=seed, epochs=spec.epochs,
              warmup_steps=spec.warmup_steps, timing=spec.timing,
              learning_rate=scaled_learning_rate(spec, batch * spec.accumulation_steps, variant.optimizer),
              accumulation_steps=spec.accumulation_steps, samples_per_step=batch * spec.accumulation_steps,
              memory_limit_bytes=None if spec.memory_limit_mb is None else int(spec.memory_limit_mb * 1e6),
              target_accuracy=spec.target_accuracy, evaluate_every=spec.evaluate_every, input=variant.input,
              evaluate_every_samples=spec.evaluate_every_samples,
              loader=spec.loader, gradient_noise=spec.gradient_noise, stop_at_target=spec.stop_at_target,
              model=spec.model if entry.model is None else None, native_model=entry.model, dataset=spec.dataset,
              allocator=spec.allocator, worker_start=spec.worker_start,
              compilation_cache=None if spec.compilation_cache is None else os.path.abspath(spec.compilation_cache))
        for repeat in range(spec.repeats)
        for seed in (spec.seeds or [spec.seed])
        for index, variant in enumerate(variants(spec))
        for batch in spec.batch_sizes
        for entry in spec.entries
    ]


def _devices(variant: Variant) -> int:
    return 1 if variant.data_parallel is None else variant.data_parallel.size
