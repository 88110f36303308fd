"""Benchmark specs: the pydantic models of a spec file, and ``load(path)``.

A spec is a YAML file (read with ``yaml.safe_load``) that names the frameworks, the framework-neutral model, the
dataset, the batch sizes and the training budget of a sweep. Every model here is strict: an unknown key, a wrong type
or an out-of-range value is an error. ``load`` turns the first validation error into one line of the form
``FILE: field.path: what is wrong`` inside a :class:`SpecError`; the CLI prints that line and exits with status 2.

This package holds the field rules only and imports nothing else of the harness: the checks that need the model,
the dataset files or the adapter registry are in ``harness.plan`` (``plan.load``, ``plan.checked_spec``). Its
modules, each importable on its own: ``base`` (the strict base model, ``SpecError``), ``devices`` (device strings),
``layers`` (the model), ``dataset`` (the data), ``frameworks`` (framework entries), ``options`` (optimizer, timing,
precision, data parallelism, variants, ...); this module holds ``Spec``, ``validate`` and ``load``, and re-exports
every model under ``harness.spec``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from harness.spec.base import SpecError, _Strict
from harness.spec.dataset import (
    Cifar10Data,
    Dataset,
    DigitsData,
    GeneratedImages,
    ImageFolderData,
    SyntheticData,
    SyntheticTokens,
)
from harness.spec.devices import is_gpu
from harness.spec.frameworks import (
    ROOT,
    FrameworkEntry,
    FrameworkItem,
    NativeModel,
    as_entry,
    expand_backends,
    resolve_entries,
    select_frameworks,
)
from harness.spec.layers import (
    GELU,
    Activation,
    Attention,
    AvgPool2D,
    BatchNorm,
    Conv2D,
    Dense,
    DenseActivation,
    Dropout,
    Embedding,
    Flatten,
    GlobalAvgPool2D,
    Initializer,
    Layer,
    LayerNorm,
    MaxPool2D,
    ModelSpec,
    PlainLayer,
    ReLU,
    Residual,
    SequencePool,
    Softmax,
)
from harness.spec.options import (
    AllocatorSpec,
    CompileMode,
    DataParallelSpec,
    GradientNoiseSpec,
    InputMode,
    LoaderSpec,
    OptimizerSpec,
    Precision,
    SamplerSpec,
    TimingSpec,
    VariantsSpec,
)

__all__ = ["Activation", "AllocatorSpec", "Attention", "AvgPool2D", "BatchNorm", "Cifar10Data", "CompileMode",
           "Conv2D", "DataParallelSpec", "Dataset", "Dense", "DenseActivation", "DigitsData", "Dropout", "Embedding",
           "Flatten", "FrameworkEntry", "FrameworkItem", "GELU", "GeneratedImages", "GlobalAvgPool2D",
           "GradientNoiseSpec", "ImageFolderData", "Initializer", "InputMode", "Layer", "LayerNorm", "LoaderSpec",
           "MaxPool2D", "ModelSpec", "NativeModel", "OptimizerSpec", "PlainLayer", "Precision", "ROOT", "ReLU",
           "Residual", "SamplerSpec", "SequencePool", "Softmax", "Spec", "SpecError", "SyntheticData",
           "SyntheticTokens", "TimingSpec", "VariantsSpec", "as_entry", "from_data", "load", "select_frameworks",
           "validate"]


class Spec(_Strict):
    """A whole benchmark spec. ``epochs`` counts full passes; each epoch is floor(N / effective batch size) full
    optimizer steps.

    memory_limit_mb: a cap on each worker's memory (MB = 10^6 bytes): on a GPU through the framework's own limit, on
    the CPU through a process limit; it makes OOM real on any machine. accumulation_steps: k micro-batches of the
    batch size per optimizer step (gradient accumulation; effective batch size = k x batch size).
    learning_rate_scaling: the learning rate used at batch size B is the optimizer's learning rate x B /
    base_batch_size (linear) or x sqrt(B / base_batch_size) (sqrt), with B the effective batch size.
    target_accuracy: time and epochs to reach this test accuracy (fraction) are reported per trial.
    stop_at_target: a trial ends at the first evaluation that reaches ``target_accuracy`` (MLPerf Training's rule:
    train to a fixed quality and stop), its remaining epochs not trained; its metrics are those of the epochs it
    trained.
    augmentation: random crop and flip of the training images, drawn by the harness from (seed, epoch) and loaded
    to the device before each epoch (outside the timed windows), identical for every framework.
    evaluate_every: the test set is evaluated after every k-th epoch and after the last (default 1: every epoch, as
    Keras's ``validation_freq`` and Lightning's ``check_val_every_n_epoch`` count); timed windows run on across the
    epochs in between (``harness.execution.worker``), which matters when an epoch is a few steps.
    evaluate_every_samples: instead, the test set is evaluated whenever another k training samples have been
    trained (at the first step boundary at or past each multiple of k, and after the last step; MLPerf's rule of
    evaluating at a fixed sample interval whatever the batch size), so that time to a target is resolved finer than
    an epoch; evaluations due during warm-up wait for its end.
    seeds: several seeds instead of ``seed``, each its own trials (initial weights, batch order, augmentation and
    dropout all follow the seed): accuracy and loss are then reported as the mean over the seeds with a 95 %
    t-interval, the spread that the small-vs-large-batch question needs; ``repeats`` (the same seed again) measure
    timing noise.
    after_oom: after an OOM at batch size b, larger batch sizes of that framework (same repeat and variant) are
    recorded as skipped (``skip``, the default) or run anyway (``try``).
    precision: ``Precision`` (default fp32). compile: ``CompileMode`` (default: each framework's usual mode). A
    combination a framework cannot run on the device is recorded ``unsupported`` with the reason, before training.
    devices: GPUs to run trials on side by side, one trial per device at a time (``harness.execution.executors``);
    ``--parallel`` and ``--devices`` on the command line do the same. exclusive: one trial at a time, whatever the
    executor could run at once, for studies where trials beside each other would disturb what is measured (host
    contention: CPU runs, data loading, memory bandwidth). data_parallel: ``DataParallelSpec``; ``batch_sizes`` are
    then global batches per optimizer step, each device training on batch size / N. input: ``InputMode``
    (default ``resident``); ``loader`` feeds every step through the framework's own data loader, configured by
    ``loader`` (``LoaderSpec``), and records the time each step waited for its batch.
    worker_start: how each trial's fresh worker process starts: ``auto`` (forked from a parent per environment that
    has imported the framework, where the framework's declaration says that is safe, ``harness.execution.forkserver``;
    cold otherwise) or ``cold`` (a new interpreter every time). Either way each trial has its own process, allocator
    and device state; the record says which path each trial took.
    compilation_cache: a directory for JAX's persistent compilation cache (``jax_compilation_cache_dir``, every
    program cached whatever its compile time), shared by the run's trials; None (the default): no cache, so every
    trial's first step and warm-up include compiling. A warm cache changes what first-step time means (a read from
    disk, not a compile); the report says when one was used. The other frameworks' caches are not set by the harness
    (``docs/design/framework-caveats.md``).
    gradient_noise: ``GradientNoiseSpec``: every evaluation also measures the squared gradient norms that the
    gradient noise scale is estimated from (``harness advise`` sets it; None, the default: not measured).
    model: the framework-neutral model, built by every framework alike; optional when every framework entry brings
    a model of its own (``FrameworkEntry.model``; ``harness.plan.check`` says which entries lack one).
    """

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    frameworks: list[FrameworkItem] = Field(min_length=1)
    model: ModelSpec | None = None
    dataset: Dataset
    batch_sizes: list[Annotated[int, Field(gt=0)]] = Field(min_length=1)
    epochs: int = Field(default=1, ge=1)
    warmup_steps: int = Field(default=5, ge=0)
    optimizer: OptimizerSpec = OptimizerSpec()
    seed: int = Field(default=0, ge=0)
    seeds: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1)
    device: str = "auto"
    cpu_threads: int | None = Field(default=None, ge=1)
    repeats: int = Field(default=1, ge=1)
    timeout_s: float = Field(default=1800.0, gt=0)
    sampler: SamplerSpec = SamplerSpec()
    timing: TimingSpec = TimingSpec()
    allocator: AllocatorSpec = AllocatorSpec()
    memory_limit_mb: float | None = Field(default=None, gt=0)
    accumulation_steps: int = Field(default=1, ge=1)
    learning_rate_scaling: Literal["none", "linear", "sqrt"] = "none"
    base_batch_size: int | None = Field(default=None, gt=0, validate_default=True)
    target_accuracy: float | None = Field(default=None, gt=0, le=1)
    stop_at_target: bool = False
    after_oom: Literal["skip", "try"] = "skip"
    augmentation: bool = False
    evaluate_every: int = Field(default=1, ge=1)
    evaluate_every_samples: int | None = Field(default=None, ge=1)
    precision: Precision = "fp32"
    compile: CompileMode = "default"
    variants: VariantsSpec | None = None
    devices: list[str] | None = Field(default=None, min_length=1)
    exclusive: bool = False
    data_parallel: DataParallelSpec | None = None
    input: InputMode = "resident"
    loader: LoaderSpec = LoaderSpec()
    worker_start: Literal["auto", "cold"] = "auto"
    compilation_cache: str | None = Field(default=None, min_length=1)
    gradient_noise: GradientNoiseSpec | None = None

    @field_validator("base_batch_size")
    @classmethod
    def _scaling_needs_a_base(cls, base: int | None, info: ValidationInfo) -> int | None:
        if info.data.get("learning_rate_scaling", "none") != "none" and base is None:
            raise ValueError(f"learning_rate_scaling {info.data['learning_rate_scaling']} needs base_batch_size "
                             "(the batch size the optimizer's learning rate is for)")
        return base

    @field_validator("stop_at_target")
    @classmethod
    def _stop_needs_a_target(cls, stop: bool, info: ValidationInfo) -> bool:
        if stop and info.data.get("target_accuracy") is None:
            raise ValueError("stop_at_target needs target_accuracy (the test accuracy to stop at)")
        return stop

    @field_validator("evaluate_every_samples")
    @classmethod
    def _one_evaluation_rule(cls, every: int | None, info: ValidationInfo) -> int | None:
        if every is not None and info.data.get("evaluate_every", 1) != 1:
            raise ValueError("give evaluate_every (epochs) or evaluate_every_samples, not both")
        return every

    @field_validator("frameworks", mode="before")
    @classmethod
    def _backend_lists(cls, frameworks: Any) -> Any:
        return expand_backends(frameworks)

    @field_validator("frameworks")
    @classmethod
    def _unique_labels(cls, frameworks: list[FrameworkItem]) -> list[FrameworkItem]:
        rows: dict[str, int] = {}
        slugs: dict[str, int] = {}
        for i, item in enumerate(frameworks):
            entry = as_entry(item)
            if entry.row in rows:
                what = "a framework is listed twice" if isinstance(item, str) else f"label {entry.row!r} is used twice"
                raise ValueError(f"{what} (entries {rows[entry.row]} and {i}); give each entry its own label")
            if entry.slug in slugs:
                raise ValueError(f"the labels of entries {slugs[entry.slug]} and {i} give the same trial id "
                                 f"{entry.slug!r}; make them differ in letters or digits")
            rows[entry.row], slugs[entry.slug] = i, i
        return frameworks

    @property
    def entries(self) -> list[FrameworkEntry]:
        """The frameworks as entries (a plain name is an entry with that name and no interpreter of its own)."""
        return [as_entry(item) for item in self.frameworks]

    @field_validator("seeds")
    @classmethod
    def _unique_seeds(cls, seeds: list[int] | None) -> list[int] | None:
        if seeds is not None and len(set(seeds)) != len(seeds):
            raise ValueError("a seed is listed twice")
        return seeds

    @field_validator("batch_sizes")
    @classmethod
    def _unique_sizes(cls, sizes: list[int]) -> list[int]:
        if len(set(sizes)) != len(sizes):
            raise ValueError("a batch size is listed twice")
        return sizes

    @field_validator("devices")
    @classmethod
    def _gpu_list(cls, devices: list[str] | None) -> list[str] | None:
        if devices is None:
            return None
        for device in devices:
            if not is_gpu(device):
                raise ValueError(f"devices lists GPUs as cuda:N, not {device!r}")
        if len(set(devices)) != len(devices):
            raise ValueError("a device is listed twice")
        return devices

    @field_validator("device")
    @classmethod
    def _device(cls, device: str) -> str:
        if device in ("auto", "cpu") or is_gpu(device):
            return device
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda:N', not {device!r}")


def _field_path(loc: tuple[Any, ...]) -> str:
    # pydantic puts the discriminator's tag in the location of a tagged union member ("conv2d"); it is kept, since
    # it names which layer kind was being read, except for a framework entry's ("name" or "entry"), which says
    # nothing the index does not.
    if len(loc) > 2 and loc[0] == "frameworks" and loc[2] in ("name", "entry"):
        loc = loc[:2] + loc[3:]
    return ".".join(str(part) for part in loc)


def validate(data: Any, file: str | os.PathLike[str]) -> Spec:
    """Validates already-parsed spec data against the field rules. Raises SpecError naming ``file`` and the first
    failing field. The checks that need the model, the data or the adapters are ``harness.plan.checked_spec``'s."""
    if not isinstance(data, dict):
        raise SpecError(file, "", "a spec must be a YAML mapping of field names to values")
    try:
        spec = Spec.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "unknown field"
        raise SpecError(file, _field_path(first["loc"]), message) from None
    return spec


def load(path: str | os.PathLike[str], overrides: dict[str, Any] | None = None) -> Spec:
    """Reads, overrides and validates a spec file.

    path: a YAML file. overrides: top-level fields that replace the file's (the CLI's ``--frameworks`` etc.).
    Raises SpecError (one line, naming the file and the field) for a missing or unreadable file, text that is not
    UTF-8, invalid YAML, or any field against its rules; a relative ``dataset.path`` is resolved against the spec
    file's folder. The checks that need the model, the data or the adapters are ``harness.plan.load``'s.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError(file, "", f"cannot read the spec: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        line = err.object[:err.start].count(b"\n") + 1
        raise SpecError(file, "", f"not UTF-8 text: byte 0x{err.object[err.start]:02x} at line {line}") from None
    import yaml  # here, not at the top: every worker imports this package and none reads a spec file

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SpecError(file, "", f"invalid YAML{where}: {getattr(err, 'problem', None) or err}") from None
    return from_data(data, file, file.parent, overrides)


def from_data(data: Any, file: str | os.PathLike[str], folder: str | os.PathLike[str],
              overrides: dict[str, Any] | None = None) -> Spec:
    """A spec from parsed data (a spec file's, or a dict of Python code's), as ``load`` makes it of a file.

    Args:
        data: the spec's fields (a mapping).
        file: what errors name (the spec file, or a name such as ``<dict>``).
        folder: what relative paths are resolved against: a framework entry's ``python`` and ``model`` factory
            (``{root}`` is the checkout), ``dataset.path`` and ``dataset.cache_dir``; a spec file's folder.
        overrides: top-level fields that replace the data's.

    Returns:
        The validated ``Spec``, its paths absolute.

    Raises:
        SpecError: any field against its rules (one line naming ``file`` and the field).
    """
    folder = Path(folder)
    if isinstance(data, dict) and overrides:
        overrides = dict(overrides)
        if overrides.get("frameworks") and isinstance(data.get("frameworks"), list):
            overrides["frameworks"] = select_frameworks(data["frameworks"], overrides["frameworks"])
        data = {**data, **{k: v for k, v in overrides.items() if v is not None}}
    spec = validate(data, file)
    spec = spec.model_copy(update={"frameworks": resolve_entries(spec.frameworks, folder)})
    if isinstance(spec.dataset, Cifar10Data) and spec.dataset.path and not spec.dataset.path.is_absolute():
        dataset = spec.dataset.model_copy(update={"path": (folder / spec.dataset.path).resolve()})
        spec = spec.model_copy(update={"dataset": dataset})
    if isinstance(spec.dataset, ImageFolderData):  # absolute, so that a worker started elsewhere finds the folder
        folders = {key: (folder / value).resolve() for key in ("path", "cache_dir")
                   if (value := getattr(spec.dataset, key)) is not None and not value.is_absolute()}
        spec = spec.model_copy(update={"dataset": spec.dataset.model_copy(update=folders)})
    return spec
