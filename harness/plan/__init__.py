"""Spec -> the ordered list of trials a run executes, and the checks of a spec that need more than its fields.

``load`` and ``checked_spec`` are what the commands use: the field rules of ``harness.spec`` and then the checks that
need the neutral model, the dataset files or the adapter registry (every framework named has an adapter; the model
fits the dataset's images or tokens and its classes; a CIFAR-10 tarball exists; an image folder has class folders
with images; augmentation has images to augment).
Every failure is a ``SpecError``: one line naming the file and the field (for the model, the layer's path, e.g.
``model.layers.3.body``), which the CLI prints before exiting with status 2. ``unsupported_reason`` says, also before
anything runs, which frameworks' adapters cannot build the model: their trials are recorded ``unsupported``. Imports
``harness.neutral`` and ``harness.spec``, and the adapter registry (which imports no framework).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args

from harness import spec as spec_module
from harness.neutral import datasets, image_folder, models, native
from harness.plan.entries import check_framework_name, entry_for
from harness.plan.support import NativeTask
from harness.spec import (
    Cifar10Data,
    CompileMode,
    DataParallelSpec,
    FrameworkEntry,
    GradientNoiseSpec,
    ImageFolderData,
    InputMode,
    LoaderSpec,
    OptimizerSpec,
    Precision,
    Spec,
    SpecError,
    SyntheticTokens,
    TimingSpec,
)
from harness.spec.devices import device_index

#: Every status a trial can end with, in one place: the launcher classifies a worker's end into one
#: (``harness.execution.launcher``: ok, oom, error, timeout, crashed), the sweep decides the others before any worker
#: starts (skipped: ``after_oom: skip``; unsupported: the adapter cannot build the model) and the record's schema
#: (``harness.results.schema.TrialRecord.status``) publishes them.
Status = Literal["ok", "oom", "error", "timeout", "crashed", "skipped", "unsupported"]
STATUSES: tuple[str, ...] = get_args(Status)


def load(path: str | os.PathLike[str], overrides: dict[str, Any] | None = None) -> Spec:
    """``harness.spec.load`` (read, override, field rules), then ``check``. Raises SpecError."""
    spec = spec_module.load(path, overrides)
    check(spec, path)
    return spec


def checked_spec(data: Any, file: str | os.PathLike[str]) -> Spec:
    """``harness.spec.validate`` of already-parsed data, then ``check``. Raises SpecError."""
    spec = spec_module.validate(data, file)
    check(spec, file)
    return spec


def check(spec: Spec, file: str | os.PathLike[str]) -> None:
    """The checks that need the adapters, the dataset files and the model. Raises SpecError naming ``file``."""
    for i, entry in enumerate(spec.entries):
        check_framework_name(entry.name, file, f"frameworks.{i}", entry.backend)
    base = Path(file).parent
    if isinstance(spec.dataset, Cifar10Data):
        try:
            datasets.resolve_cifar10_path(spec.dataset, base_dir=base)
        except datasets.DatasetError as err:
            raise SpecError(file, "dataset.path", str(err)) from None
    if isinstance(spec.dataset, ImageFolderData):  # the model is checked against the folder the spec means
        spec = spec.model_copy(update={"dataset": check_image_folder(spec.dataset, file)})
    if spec.model is None:
        lacking = [entry.row for entry in spec.entries if entry.model is None]
        if lacking:
            raise SpecError(file, "model", f"the entries {', '.join(lacking)} have no model of their own "
                                           "(frameworks.N.model): give the spec a model, or each entry one")
    try:
        if spec.model is not None:
            model_info(spec)
        else:
            datasets.describe_input(spec.dataset)
    except models.ModelError as err:
        raise SpecError(file, "model.layers" + (f".{err.path}" if err.path is not None else ""), str(err)) from None
    except datasets.DatasetError as err:  # an image folder's listing or first header (its path as given)
        raise SpecError(file, f"dataset.{err.field or 'path'}", str(err)) from None
    check_data_parallel(spec, file)
    augmenting = spec.augmentation or any((spec.variants and spec.variants.augmentation) or [])
    if augmenting and isinstance(spec.dataset, SyntheticTokens):
        field = "augmentation" if spec.augmentation else "variants.augmentation"
        raise SpecError(file, field, "augmentation (random crops and flips of images) needs an image dataset, not "
                                     "token sequences")


def check_image_folder(cfg: ImageFolderData, file: str | os.PathLike[str]) -> ImageFolderData:
    """An image folder's checks that need no decoding: the folder exists and has class folders, none of them empty,
    the test classes are training classes, and without ``size`` the first image's size can be read from its header
    (``harness.neutral.image_folder.describe``). A relative ``path`` is taken relative to the spec file. Returns
    ``cfg`` with that path. Raises SpecError naming the dataset field to fix (``dataset.path``, ``dataset.size``)."""
    base = Path(file).parent
    if not cfg.path.is_absolute():
        cfg = cfg.model_copy(update={"path": base / cfg.path})
    try:
        image_folder.describe(cfg)
    except datasets.DatasetError as err:
        raise SpecError(file, f"dataset.{err.field or 'path'}", str(err)) from None
    return cfg


def data_parallel_settings(spec: Spec) -> list[tuple[str, DataParallelSpec | None]]:
    """The spec's data-parallel settings with the field each comes from: ``variants.data_parallel``'s entries, else
    ``data_parallel`` (None: one device)."""
    if spec.variants is not None and spec.variants.data_parallel:
        return [(f"variants.data_parallel.{i}", dp) for i, dp in enumerate(spec.variants.data_parallel)]
    return [("data_parallel", spec.data_parallel)]


def accumulation_conflict(devices: int, accumulation_steps: int) -> str:
    """What a spec (or a max-batch search) that combines data parallelism and gradient accumulation is told."""
    return (f"{devices} devices with accumulation_steps {accumulation_steps}: data parallelism and gradient "
            "accumulation are not combined in one trial (compare them as separate trials)")


def check_data_parallel(spec: Spec, file: str | os.PathLike[str]) -> None:
    """Every global batch size splits into N equal per-device batches, and data parallelism is not combined with
    gradient accumulation. Raises SpecError naming ``file`` and the field."""
    for field, dp in data_parallel_settings(spec):
        if dp is None or dp.size == 1:
            continue
        if spec.accumulation_steps > 1:
            raise SpecError(file, field, accumulation_conflict(dp.size, spec.accumulation_steps))
        for i, batch in enumerate(spec.batch_sizes):
            if batch % dp.size:
                raise SpecError(file, f"batch_sizes.{i}", f"the global batch size {batch} does not split into "
                                                          f"{dp.size} equal per-device batches ({field}: {dp.size})")


def check_devices(spec: Spec, file: str | os.PathLike[str], device: str, gpus: int | None = None) -> None:
    """The data-parallel devices exist on this machine: on the CPU at most one device per available core; on a GPU
    machine (``device`` "cuda:N") N GPUs from ``device`` on, or the listed ones, among the ``gpus`` NVML counts
    (None: not checked). Raises SpecError naming ``file`` and the field."""
    for field, dp in data_parallel_settings(spec):
        if dp is None or dp.size == 1:
            continue
        if device == "cpu":
            if isinstance(dp.devices, list):
                raise SpecError(file, field, f"lists GPUs ({', '.join(dp.devices)}) but the run is on the CPU; give "
                                             "a device count")
            if dp.size > available_cpus():
                raise SpecError(file, field, f"{dp.size} devices on the CPU, but this process may use "
                                             f"{available_cpus()} cores (one logical device per core at most)")
            continue
        wanted = data_parallel_devices(dp, device)
        if gpus is not None and (missing := [d for d in wanted if device_index(d) >= gpus]):
            raise SpecError(file, field, f"{', '.join(missing)} named, but this machine has {gpus} GPU(s)")


def data_parallel_devices(dp: DataParallelSpec, device: str) -> tuple[str, ...]:
    """The devices of a data-parallel trial run on ``device``: ``cpu:0..N-1`` on the CPU, the listed GPUs, or N
    consecutive GPUs from ``device``'s index."""
    if isinstance(dp.devices, list):
        return tuple(dp.devices)
    if device == "cpu":
        return tuple(f"cpu:{i}" for i in range(dp.size))
    first = device_index(device)
    return tuple(f"cuda:{first + i}" for i in range(dp.size))


def model_info(spec: Spec) -> models.ModelInfo:
    """The spec's neutral model analysed for its dataset's input and classes. Raises models.ModelError, and
    ValueError for a spec without one (every entry brings a model of its own)."""
    if spec.model is None:
        raise ValueError("the spec has no neutral model: every framework entry brings its own")
    return models.analyze(spec.model, *datasets.describe_input(spec.dataset))


def trained_model(spec: Spec, entry: FrameworkEntry) -> models.ModelInfo | NativeTask:
    """What ``entry`` trains, as the plan's rule takes it (``harness.plan.support.unsupported``): the neutral
    model's analysis, or for an entry with a model of its own the task the dataset sets."""
    if entry.model is not None:
        return NativeTask(native.task(datasets.describe_input(spec.dataset)[0]))
    return model_info(spec)


def unsupported_reason(spec: Spec, framework: str, precision: str | None = None, compile: str | None = None,
                       device: str = "cpu", data_parallel: int = 1, sync_batchnorm: bool = False,
                       input: str = "resident") -> str | None:
    """Why the entry ``framework`` (its label or its adapter's name, ``entry_for``) cannot train its model (the
    spec's, or one of its own) in ``precision`` with ``compile`` on ``device`` (None: the spec's own), on
    ``data_parallel`` devices (with ``sync_batchnorm``), fed by ``input`` (``harness.spec.InputMode``), decided now
    from its adapter's declaration without importing the framework (``harness.plan.support.unsupported``); None when
    it can, and for an adapter of ``HARNESS_ADAPTERS``, whose declaration only its worker reads (the worker asks the
    same function). The spec must have passed ``check``."""
    from adapters import declaration  # the registry imports no framework
    from harness.plan.support import unsupported

    entry = entry_for(spec, framework)
    record = declaration(entry.name)
    if record is None:
        return None
    return unsupported(record, trained_model(spec, entry), precision or spec.precision, compile or spec.compile,
                       device, data_parallel, sync_batchnorm, input, spec.memory_limit_mb is not None,
                       spec.gradient_noise is not None)


@dataclass(frozen=True)
class Trial:
    """One framework entry, one batch size, one repeat: one worker process. The worker receives it as it is, typed,
    in ``harness.execution.protocol.Payload``.

    id: stable and unique within a run, ``"<label>-bs<batch size>-r<repeat>"`` (the label as a slug, see
    ``harness.spec.FrameworkEntry``; the framework's name when the entry has no label). framework: the adapter's
    name; label: the row it belongs to. python, command: how the worker's interpreter is started (see
    FrameworkEntry; both None for the harness's own interpreter). device: "cpu" or "cuda:N"
    (``auto`` already resolved). threads: intra-op CPU threads for the framework (inter-op is 1), the same for every
    framework. micro_batch_size: the samples of one forward/backward pass (the spec's ``batch_sizes`` entry);
    accumulation_steps micro-batches make one optimizer step of samples_per_step = micro_batch_size x
    accumulation_steps samples, computed here once (``batch_size`` and ``effective_batch_size`` are the names the
    trial records keep for the two). learning_rate: what the optimizer uses, after the spec's scaling rule.
    memory_limit_bytes: the worker's memory cap, or None. target_accuracy: a test accuracy to time, or None.
    optimizer: the variant's optimizer, or None for the spec's own. precision, compile: ``harness.spec.Precision``
    and ``CompileMode`` ("default" is resolved by the adapter). max_steps_per_epoch: every epoch cut to its first
    steps, or None (``harness max-batch --with-dataset`` probes with the whole dataset resident but no whole epoch).
    data_parallel: N devices, each training on ``per_device_batch_size`` = micro_batch_size / N samples of every
    step (``adapters.base.shard``); devices: those N devices ("cpu:0".."cpu:N-1" or "cuda:i"), empty for one
    device; sync_batchnorm: batchnorm over the global batch (``harness.spec.DataParallelSpec``). input: where each
    step's batch comes from (``harness.spec.InputMode``); loader: the data loader's workers and prefetch
    (``harness.spec.LoaderSpec``), for ``input == "loader"``. gradient_noise: the squared gradient norms measured at
    every evaluation (``harness.spec.GradientNoiseSpec``), or None. stop_at_target: the trial ends at the first
    evaluation that reaches ``target_accuracy``.
    """

    id: str
    framework: str
    micro_batch_size: int
    samples_per_step: int
    repeat: int
    device: str
    threads: int
    seed: int
    epochs: int
    warmup_steps: int
    timing: TimingSpec
    learning_rate: float
    accumulation_steps: int = 1
    memory_limit_bytes: int | None = None
    target_accuracy: float | None = None
    variant: str = ""
    optimizer: OptimizerSpec | None = None
    augmentation: bool = False
    evaluate_every: int = 1
    evaluate_every_samples: int | None = None
    precision: Precision = "fp32"
    compile: CompileMode = "default"
    label: str = ""
    python: str | None = None
    command: tuple[str, ...] | None = None
    max_steps_per_epoch: int | None = None
    data_parallel: int = 1
    devices: tuple[str, ...] = ()
    sync_batchnorm: bool = False
    input: InputMode = "resident"
    loader: LoaderSpec = dataclasses.field(default_factory=LoaderSpec)
    gradient_noise: GradientNoiseSpec | None = None
    stop_at_target: bool = False

    def __post_init__(self) -> None:
        if self.samples_per_step != self.micro_batch_size * self.accumulation_steps:
            raise ValueError(f"samples_per_step {self.samples_per_step} is not micro_batch_size "
                             f"{self.micro_batch_size} x accumulation_steps {self.accumulation_steps}")
        if self.data_parallel > 1 and (len(self.devices) != self.data_parallel
                                       or self.micro_batch_size % self.data_parallel):
            raise ValueError(f"a data-parallel trial on {self.data_parallel} devices needs that many devices (got "
                             f"{self.devices}) and a batch size they divide ({self.micro_batch_size})")

    @property
    def per_device_batch_size(self) -> int:
        """The samples each device trains on per forward pass: the batch size / ``data_parallel``."""
        return self.micro_batch_size // self.data_parallel

    @property
    def batch_size(self) -> int:
        """The spec's batch size, the micro-batch (the name trial ids and records use)."""
        return self.micro_batch_size

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step (the name trial records use)."""
        return self.samples_per_step

    @property
    def row(self) -> str:
        """The report row: the label, else the framework's name."""
        return self.label or self.framework


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
    for opt, aug, precision, compile, dp, source in itertools.product(
            v.optimizer or [spec.optimizer], v.augmentation if v.augmentation is not None else [spec.augmentation],
            v.precision or [spec.precision], v.compile or [spec.compile], _data_parallel_list(spec),
            v.input or [spec.input]):
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
              optimizer=None if not variant.label else variant.optimizer,
              precision=variant.precision, compile=variant.compile,
              device=device, threads=spec.cpu_threads or available_cpus(), seed=seed, epochs=spec.epochs,
              warmup_steps=spec.warmup_steps, timing=spec.timing,
              learning_rate=scaled_learning_rate(spec, batch * spec.accumulation_steps, variant.optimizer),
              accumulation_steps=spec.accumulation_steps, samples_per_step=batch * spec.accumulation_steps,
              memory_limit_bytes=None if spec.memory_limit_mb is None else int(spec.memory_limit_mb * 1e6),
              target_accuracy=spec.target_accuracy, evaluate_every=spec.evaluate_every, input=variant.input,
              evaluate_every_samples=spec.evaluate_every_samples,
              loader=spec.loader, gradient_noise=spec.gradient_noise, stop_at_target=spec.stop_at_target)
        for repeat in range(spec.repeats)
        for seed in (spec.seeds or [spec.seed])
        for index, variant in enumerate(variants(spec))
        for batch in spec.batch_sizes
        for entry in spec.entries
    ]


def _devices(variant: Variant) -> int:
    return 1 if variant.data_parallel is None else variant.data_parallel.size


def _data_parallel_list(spec: Spec) -> list[DataParallelSpec | None]:
    if spec.variants is not None and spec.variants.data_parallel:
        return list(spec.variants.data_parallel)
    return [spec.data_parallel]
