"""Benchmark specs: the pydantic models of a spec file, and ``load(path)``.

A spec is a YAML file (read with ``yaml.safe_load``) that names the frameworks, the framework-neutral model, the
dataset, the batch sizes and the training budget of a sweep. Every model here is strict: an unknown key, a wrong type
or an out-of-range value is an error. ``load`` turns the first validation error into one line of the form
``FILE: field.path: what is wrong`` inside a :class:`SpecError`; the CLI prints that line and exits with status 2.

This module holds the field rules only and imports nothing else of the harness: the checks that need the model,
the dataset files or the adapter registry are in ``harness.plan`` (``plan.load``, ``plan.checked_spec``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, PositiveInt, ValidationError, ValidationInfo, field_validator, model_validator

from harness.spec.base import SpecError, _Strict
from harness.spec.devices import is_gpu
from harness.spec.frameworks import ROOT, FrameworkEntry, FrameworkItem, as_entry, resolve_entries, select_frameworks
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

__all__ = ["Activation", "AllocatorSpec", "Attention", "AvgPool2D", "BatchNorm", "Cifar10Data", "CompileMode",
           "Conv2D", "DataParallelSpec", "Dataset", "Dense", "DenseActivation", "DigitsData", "Dropout", "Embedding",
           "Flatten", "FrameworkEntry", "FrameworkItem", "GELU", "GeneratedImages", "GlobalAvgPool2D",
           "ImageFolderData", "Initializer", "InputMode", "Layer", "LayerNorm", "LoaderSpec", "MaxPool2D",
           "ModelSpec", "OptimizerSpec", "PlainLayer", "Precision", "ROOT", "ReLU", "Residual", "SamplerSpec",
           "SequencePool", "Softmax", "Spec", "SpecError", "SyntheticData", "SyntheticTokens", "TimingSpec",
           "VariantsSpec", "as_entry", "load", "select_frameworks", "validate"]


class DigitsData(_Strict):
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes): real data, offline."""

    name: Literal["digits"]
    test_fraction: float = Field(default=0.2, gt=0, lt=1)


class SyntheticData(_Strict):
    """Random images and labels drawn from the trial seed: for throughput and memory, not accuracy."""

    name: Literal["synthetic"]
    shape: tuple[int, int, int] = (32, 32, 3)
    classes: int = Field(default=10, ge=2)
    size: int = Field(default=1024, gt=0)
    test_size: int = Field(default=256, gt=0)

    @field_validator("shape")
    @classmethod
    def _positive(cls, shape: tuple[int, int, int]) -> tuple[int, int, int]:
        if min(shape) <= 0:
            raise ValueError("every dimension of shape (height, width, channels) must be positive")
        return shape


class SyntheticTokens(_Strict):
    """Token sequences with a learnable structure, drawn from the trial seed (``harness.neutral.datasets``).

    ``vocab`` token ids 0..vocab-1, sequences of ``length`` tokens, ``size`` training and ``test_size`` test
    sequences. ``task``: ``copy``, a next-token task (a random first half of length / 2 tokens, then its copy; the
    label at each position is the next token; ``length`` must be even), or ``sorted``, sequence classification
    (label 1 when the sequence is sorted ascending; half of the sequences are).
    """

    name: Literal["synthetic_tokens"]
    vocab: int = Field(default=16, ge=2)
    length: int = Field(default=16, ge=2)
    size: int = Field(default=2048, gt=0)
    test_size: int = Field(default=256, gt=0)
    task: Literal["copy", "sorted"] = "copy"

    @model_validator(mode="after")
    def _copy_needs_an_even_length(self) -> SyntheticTokens:
        if self.task == "copy" and self.length % 2:
            raise ValueError(f"the copy task needs an even length (a half and its copy), not {self.length}")
        return self


class Cifar10Data(_Strict):
    """CIFAR-10 from the standard python tarball ``cifar-10-python.tar.gz``, md5-verified before it is read.

    ``path``: the tarball; a relative path is taken relative to the spec file. A file named here is never
    downloaded. ``cache_dir``: the folder that holds the archive when ``path`` is not given (default
    ``$HARNESS_DATA``, else ``~/.cache/harness``). When the archive is not there, ``harness run`` and ``harness
    max-batch`` download it there once, before any trial starts (``harness.neutral.download``; from
    ``$HARNESS_CIFAR10_URL`` when set), unless ``--offline`` or ``HARNESS_OFFLINE=1`` asks for no network.
    ``limit_train``: use only the first N training images. ``limit_test``: only the first N test images.
    """

    name: Literal["cifar10"]
    path: Path | None = None
    cache_dir: Path | None = None
    limit_train: int | None = Field(default=None, gt=0)
    limit_test: int | None = Field(default=None, gt=0)


class GeneratedImages(_Strict):
    """A synthetic image folder written where ``ImageFolderData.path`` points when nothing is there yet
    (``harness.neutral.image_folder.make_image_folder``: real JPEG files, each class its own colour and stripe
    angle plus noise, drawn from ``seed``): ``classes`` folders of ``per_class`` images of ``size`` [height, width]
    pixels."""

    classes: int = Field(default=4, ge=2)
    per_class: int = Field(default=128, ge=1)
    size: tuple[PositiveInt, PositiveInt] = (64, 64)
    seed: int = Field(default=0, ge=0)


class ImageFolderData(_Strict):
    """Images in a folder with one sub-folder per class (``harness.neutral.image_folder``).

    ``path``: the folder; a relative path is taken relative to the spec file. Its sub-folders are the classes, class
    index = position in the sorted sub-folder names; their ``.jpg``, ``.jpeg`` and ``.png`` files are the images
    (other files and hidden names are ignored). When ``path`` holds ``train/`` and ``test/``, each with class
    sub-folders, they are the split (every test class must be a training class). ``test_fraction``: otherwise,
    this fraction of each class's images (rounded, at least one kept for training) is the test set, chosen from the
    file names and a fixed seed: the same split in every trial and framework.
    ``size``: [height, width] in pixels that every image is resized to (bilinear, Pillow's ``Image.resize``); without
    it every image must have the size of the first one. ``channels``: 3 (RGB) or 1 (grayscale); every image is
    converted to it. ``on_bad_file``: ``error`` stops at the first file that cannot be decoded, naming it; ``skip``
    leaves such files out and counts them (``metrics.data_skipped_files`` of the trial). ``cache_dir``: where the
    decoded arrays are cached (default ``$HARNESS_DATA``, else ``~/.cache/harness``); a relative path is taken
    relative to the spec file. ``generate``: ``GeneratedImages`` written to ``path`` first when it does not exist
    (a spec that brings its own data, e.g. specs/loader.yaml).
    """

    name: Literal["image_folder"]
    path: Path
    generate: GeneratedImages | None = None
    size: tuple[PositiveInt, PositiveInt] | None = None
    channels: Literal[1, 3] = 3
    test_fraction: float = Field(default=0.2, gt=0, lt=1)
    on_bad_file: Literal["error", "skip"] = "error"
    cache_dir: Path | None = None

    @field_validator("size", mode="before")
    @classmethod
    def _height_and_width(cls, size: Any) -> Any:
        if isinstance(size, (list, tuple)) and len(size) != 2:
            raise ValueError(f"size is [height, width] in pixels, two numbers, not {len(size)}")
        return size


Dataset = Annotated[DigitsData | SyntheticData | SyntheticTokens | Cifar10Data | ImageFolderData,
                    Field(discriminator="name")]


class OptimizerSpec(_Strict):
    """The optimizer, with semantics made identical in every framework.

    ``sgd``: v <- momentum * v + g; p <- p - lr * v (PyTorch's form; equal to Keras's and MXNet's for a constant
    learning rate). ``adam``: PyTorch's bias-corrected Adam, p <- p - lr * m_hat / (sqrt(v_hat) + epsilon); TensorFlow's
    and MXNet's kernels add epsilon before the bias correction, so those adapters pass epsilon * sqrt(1 - beta2^t)
    to get the same update. ``weight_decay`` is an L2 term added to the gradient (coupled, as
    in ``torch.optim.SGD``/``Adam`` and MXNet's ``wd``), never Keras's decoupled ``weight_decay``.
    """

    name: Literal["sgd", "adam"] = "sgd"
    learning_rate: float = Field(default=0.01, gt=0)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.999, ge=0, lt=1)
    epsilon: float = Field(default=1e-7, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _momentum_only_for_sgd(self) -> OptimizerSpec:
        if self.name != "sgd" and self.momentum:
            raise ValueError("momentum applies to sgd only (adam uses beta1)")
        return self


class SamplerSpec(_Strict):
    """Background sampling of the device (NVML) or, without a GPU, the worker's CPU and memory (psutil)."""

    interval_s: float = Field(default=0.1, gt=0, le=10)


class AllocatorSpec(_Strict):
    """Allocator settings that change the memory numbers; every trial records the values used.

    tensorflow_memory_growth: on by default (TensorFlow otherwise maps nearly all GPU memory at start,
    https://www.tensorflow.org/guide/gpu#limiting_gpu_memory_growth); turn it off to reproduce "TF grabs all
    memory". pytorch_cuda_alloc_conf: PYTORCH_CUDA_ALLOC_CONF for the workers
    (https://pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf).
    mxnet_gpu_mem_pool_type: MXNET_GPU_MEM_POOL_TYPE (Naive, Round or Unpooled; MXNet's default is Naive).
    """

    tensorflow_memory_growth: bool = True
    pytorch_cuda_alloc_conf: str | None = None
    mxnet_gpu_mem_pool_type: Literal["Naive", "Round", "Unpooled"] | None = None


class TimingSpec(_Strict):
    """How the training loop is timed. Every timed window is synchronized with the device at both edges (its
    ``sync``: torch.cuda.synchronize, block_until_ready, ...) and at no step inside, so host dispatch and device
    work overlap inside a window as in a plain training loop.

    ``window``: ``auto`` (the default): windows of about ``window_seconds`` of work and at least
    ``min_window_steps`` steps, at most up to the next evaluation (``evaluate_every``); the step time of the last
    window (or of the warm-up) sizes the next. ``step``: latency mode, a sync after every step: exact per-step
    percentiles, at the cost of the overlap (throughput then includes a sync per step). An integer k: fixed windows
    of k steps. Step-time percentiles are over windows (each window's duration over its steps). ``sync_every: k``
    (the former name) is read as ``window: k``, and ``sync_every: 1`` as ``window: step``.
    """

    window: Literal["auto", "step"] | PositiveInt = "auto"
    window_seconds: float = Field(default=1.0, gt=0)
    min_window_steps: int = Field(default=10, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _former_sync_every(cls, data: Any) -> Any:
        if isinstance(data, dict) and "sync_every" in data:
            if "window" in data:
                raise ValueError("give window or sync_every (its former name), not both")
            data = dict(data)
            every = data.pop("sync_every")
            data["window"] = "step" if every == 1 else every
        return data


#: Numerical precision of training: ``fp32`` (TF32 off on GPUs), ``tf32`` (fp32 storage, TensorFloat-32 matrix
#: products and convolutions on an NVIDIA GPU), ``bf16`` and ``fp16`` (mixed precision: fp32 master weights and
#: optimizer state, matrix products and convolutions in the low precision, the loss and softmax in fp32; fp16 with
#: dynamic loss scaling).
Precision = Literal["fp32", "tf32", "bf16", "fp16"]
#: Execution mode: ``default`` (each framework's usual one), ``eager`` or ``compiled``; what each means per framework
#: is its adapter's ``COMPILE_MODES`` (README, "Precision and compilation").
CompileMode = Literal["default", "eager", "compiled"]
#: Where a step's batch comes from: ``resident`` (the training set placed on the device once, each step gathering its
#: batch there) or ``loader`` (each framework's own data loader reads it on the host and copies it over).
InputMode = Literal["resident", "loader"]


class LoaderSpec(_Strict):
    """The data loader of ``input: loader`` (docs/guide/data.md#input-pipelines). ``workers``: processes (PyTorch's
    and Gluon's ``num_workers``), parallel calls (tf.data's ``num_parallel_calls``) or threads (JAX) that read and
    decode samples; 0 reads them in the training process. ``prefetch``: batches read ahead of the step (PyTorch's
    ``prefetch_factor`` per worker, tf.data's ``prefetch``, Gluon's ``prefetch``, JAX's device-put queue). Each trial
    records the names and values its framework used (``settings.loader``)."""

    workers: int = Field(default=2, ge=0)
    prefetch: int = Field(default=2, ge=1)


class DataParallelSpec(_Strict):
    """Data-parallel training over several devices: each optimizer step's global batch (the ``batch_sizes`` entry) is
    split into ``devices`` equal per-device batches (``adapters.base.shard``), the gradients are averaged over all
    of them (all-reduce), and every device applies the same update: each framework's own mechanism (its adapter's
    declaration: PyTorch DistributedDataParallel, TensorFlow MirroredStrategy, MXNet kvstore, JAX sharding).

    devices: N (on the CPU N logical devices, on a GPU machine the first N GPUs from the spec's device), or the GPUs
    as a list (``[cuda:0, cuda:1]``). Written as ``data_parallel: 2`` or ``data_parallel: [cuda:0, cuda:1]`` for
    short. sync_batchnorm: batchnorm normalises over the global batch (every device's shard) instead of each
    device's own; a framework without it records such trials ``unsupported``.
    """

    devices: int | list[str]
    sync_batchnorm: bool = False

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, data: Any) -> Any:
        if isinstance(data, (int, list)) and not isinstance(data, bool):
            return {"devices": data}
        return data

    @field_validator("devices")
    @classmethod
    def _device_list(cls, devices: int | list[str]) -> int | list[str]:
        if isinstance(devices, int):
            if devices < 1:
                raise ValueError(f"a device count is at least 1, not {devices}")
            return devices
        if not devices:
            raise ValueError("devices lists at least one GPU")
        for device in devices:
            if not is_gpu(device):
                raise ValueError(f"data-parallel devices are GPUs as cuda:N, not {device!r} (on the CPU give a count)")
        if len(set(devices)) != len(devices):
            twice = next(d for d in devices if devices.count(d) > 1)
            raise ValueError(f"{twice} is listed twice")
        return devices

    @property
    def size(self) -> int:
        """N, the number of devices."""
        return self.devices if isinstance(self.devices, int) else len(self.devices)


class VariantsSpec(_Strict):
    """Study variants crossed with the batch sizes: every combination of the lists given runs at every batch size.

    optimizer: several optimizers (each a full optimizer spec), e.g. SGD with momentum and Adam, for the
    seed-002 comparison of how optimizers tolerate large batches. augmentation: e.g. [false, true]. precision: e.g.
    [fp32, bf16]. compile: e.g. [eager, compiled]. data_parallel: device counts (or ``DataParallelSpec``s), e.g.
    [1, 2, 4, 8] for the scaling at each global batch size (1: one device, no data parallelism). input: e.g.
    [resident, loader], the same training fed from the device and through the framework's data loader.
    """

    optimizer: list[OptimizerSpec] | None = Field(default=None, min_length=1)
    augmentation: list[bool] | None = Field(default=None, min_length=1)
    precision: list[Precision] | None = Field(default=None, min_length=1)
    compile: list[CompileMode] | None = Field(default=None, min_length=1)
    data_parallel: list[DataParallelSpec] | None = Field(default=None, min_length=1)
    input: list[InputMode] | None = Field(default=None, min_length=1)


class Spec(_Strict):
    """A whole benchmark spec. ``epochs`` counts full passes; each epoch is floor(N / effective batch size) full
    optimizer steps.

    memory_limit_mb: a cap on each worker's memory (MB = 10^6 bytes): on a GPU through the framework's own limit, on
    the CPU through a process limit; it makes OOM real on any machine. accumulation_steps: k micro-batches of the
    batch size per optimizer step (gradient accumulation; effective batch size = k x batch size).
    learning_rate_scaling: the learning rate used at batch size B is the optimizer's learning rate x B /
    base_batch_size (linear) or x sqrt(B / base_batch_size) (sqrt), with B the effective batch size.
    target_accuracy: time and epochs to reach this test accuracy (fraction) are reported per trial.
    augmentation: random crop and flip of the training images, drawn by the harness from (seed, epoch) and loaded
    to the device before each epoch (outside the timed windows), identical for every framework.
    evaluate_every: the test set is evaluated after every k-th epoch and after the last (default 1: every epoch, as
    Keras's ``validation_freq`` and Lightning's ``check_val_every_n_epoch`` count); timed windows run on across the
    epochs in between (``harness.execution.worker``), which matters when an epoch is a few steps.
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
    """

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    frameworks: list[FrameworkItem] = Field(min_length=1)
    model: ModelSpec
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
    after_oom: Literal["skip", "try"] = "skip"
    augmentation: bool = False
    evaluate_every: int = Field(default=1, ge=1)
    precision: Precision = "fp32"
    compile: CompileMode = "default"
    variants: VariantsSpec | None = None
    devices: list[str] | None = Field(default=None, min_length=1)
    exclusive: bool = False
    data_parallel: DataParallelSpec | None = None
    input: InputMode = "resident"
    loader: LoaderSpec = LoaderSpec()

    @field_validator("base_batch_size")
    @classmethod
    def _scaling_needs_a_base(cls, base: int | None, info: ValidationInfo) -> int | None:
        if info.data.get("learning_rate_scaling", "none") != "none" and base is None:
            raise ValueError(f"learning_rate_scaling {info.data['learning_rate_scaling']} needs base_batch_size "
                             "(the batch size the optimizer's learning rate is for)")
        return base

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
    Raises SpecError (one line, naming the file and the field) for a missing or unreadable file, invalid YAML, or
    any field against its rules; a relative ``dataset.path`` is resolved against the spec file's folder. The checks
    that need the model, the data or the adapters are ``harness.plan.load``'s.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError(file, "", f"cannot read the spec: {err.strerror or err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SpecError(file, "", f"invalid YAML{where}: {getattr(err, 'problem', None) or err}") from None
    if isinstance(data, dict) and overrides:
        overrides = dict(overrides)
        if overrides.get("frameworks") and isinstance(data.get("frameworks"), list):
            overrides["frameworks"] = select_frameworks(data["frameworks"], overrides["frameworks"])
        data = {**data, **{k: v for k, v in overrides.items() if v is not None}}
    spec = validate(data, file)
    spec = spec.model_copy(update={"frameworks": resolve_entries(spec.frameworks, file.parent)})
    if isinstance(spec.dataset, Cifar10Data) and spec.dataset.path and not spec.dataset.path.is_absolute():
        dataset = spec.dataset.model_copy(update={"path": (file.parent / spec.dataset.path).resolve()})
        spec = spec.model_copy(update={"dataset": dataset})
    if isinstance(spec.dataset, ImageFolderData):  # absolute, so that a worker started elsewhere finds the folder
        folders = {key: (file.parent / value).resolve() for key in ("path", "cache_dir")
                   if (value := getattr(spec.dataset, key)) is not None and not value.is_absolute()}
        spec = spec.model_copy(update={"dataset": spec.dataset.model_copy(update=folders)})
    return spec
