"""One trial, resolved by the plan: ``Trial``, what a worker is given to train (its payload's ``trial``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from harness.neutral import datasets, models, native
from harness.neutral.models import ModelInfo
from harness.plan.support import Conditions, NativeTask
from harness.spec import (
    AllocatorSpec,
    CompileMode,
    Dataset,
    DigitsData,
    GradientNoiseSpec,
    InputMode,
    LoaderSpec,
    ModelSpec,
    NativeModel,
    OptimizerSpec,
    Precision,
    TimingSpec,
)


@dataclass(frozen=True)
class Trial:
    """One framework entry, one batch size, one repeat: one worker process. The worker receives it as it is, typed, in
    ``harness.execution.protocol.Payload``.

    id: stable and unique within a run, ``"<label>-bs<batch size>-r<repeat>"`` (the label as a slug, see
    ``harness.spec.FrameworkEntry``; the framework's name when the entry has no label). framework: the adapter's name;
    label: the row it belongs to. python, command: how the worker's interpreter is started (see FrameworkEntry; both
    None for the harness's own interpreter). device: "cpu" or "cuda:N" (``auto`` already resolved). threads: intra-op
    CPU threads for the framework (inter-op is 1), the same for every framework. micro_batch_size: the samples of one
    forward/backward pass (the spec's ``batch_sizes`` entry); accumulation_steps micro-batches make one optimizer step
    of samples_per_step = micro_batch_size x accumulation_steps samples, computed here once (``batch_size`` and
    ``effective_batch_size`` are the names the trial records keep for the two). learning_rate: what the optimizer uses,
    after the spec's scaling rule. memory_limit_bytes: the worker's memory cap, or None. target_accuracy: a test
    accuracy to time, or None. optimizer: the variant's optimizer, or the spec's (its learning rate before scaling:
    ``training_optimizer`` has the trial's). model: the spec's neutral model, or None where the entry brings its own
    (native_model: that ``harness.spec.NativeModel``); dataset: the spec's; allocator, compilation_cache (an absolute
    path, or None): the spec's process settings; worker_start: the spec's (``auto``: forked where possible; ``cold``).
    precision, compile: ``harness.spec.Precision`` and ``CompileMode`` ("default" is resolved by the adapter).
    max_steps_per_epoch: every epoch cut to its first steps, or None (``harness max-batch --with-dataset`` probes with
    the whole dataset resident but no whole epoch). data_parallel: N devices, each training on ``per_device_batch_size``
    = micro_batch_size / N samples of every step (``adapters.base.shard``); devices: those N devices ("cpu:0".."cpu:N-1"
    or "cuda:i"), empty for one device; sync_batchnorm: batchnorm over the global batch
    (``harness.spec.DataParallelSpec``). input: where each step's batch comes from (``harness.spec.InputMode``); loader:
    the data loader's workers and prefetch (``harness.spec.LoaderSpec``), for ``input == "loader"``. gradient_noise: the
    squared gradient norms measured at every evaluation (``harness.spec.GradientNoiseSpec``), or None. stop_at_target:
    the trial ends at the first evaluation that reaches ``target_accuracy``.
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
    optimizer: OptimizerSpec = dataclasses.field(default_factory=OptimizerSpec)
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
    model: ModelSpec | None = None
    native_model: NativeModel | None = None
    dataset: Dataset = dataclasses.field(default_factory=lambda: DigitsData(name="digits"))
    allocator: AllocatorSpec = dataclasses.field(default_factory=AllocatorSpec)
    compilation_cache: str | None = None
    worker_start: Literal["auto", "cold"] = "auto"

    def __post_init__(self) -> None:
        if self.samples_per_step != self.micro_batch_size * self.accumulation_steps:
            raise ValueError(f"samples_per_step {self.samples_per_step} is not micro_batch_size "
                             f"{self.micro_batch_size} x accumulation_steps {self.accumulation_steps}")
        if self.data_parallel > 1 and (len(self.devices) != self.data_parallel
                                       or self.micro_batch_size % self.data_parallel):
            raise ValueError(f"a data-parallel trial on {self.data_parallel} devices needs that many devices (got "
                             f"{self.devices}) and a batch size they divide ({self.micro_batch_size})")

    @property
    def training_optimizer(self) -> OptimizerSpec:
        """The optimizer the trial trains with: ``optimizer`` at the trial's ``learning_rate``."""
        return self.optimizer.model_copy(update={"learning_rate": self.learning_rate})

    def trained_model(self) -> ModelInfo | NativeTask:
        """What the trial trains, as the support rule takes it (``trained``).

        Raises:
            harness.neutral.models.ModelError: a neutral model the dataset does not fit (the plan's check catches
                it first).
        """
        return trained(self.model, self.native_model, self.dataset)

    @property
    def conditions(self) -> Conditions:
        """How this trial trains beyond its model, as the support rule takes it (``harness.plan.support``)."""
        return Conditions(self.precision, self.compile, self.device, self.data_parallel, self.sync_batchnorm,
                          self.input, self.memory_limit_bytes is not None, self.gradient_noise is not None)

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


def trained(model: ModelSpec | None, native_model: NativeModel | None, dataset: Dataset) -> ModelInfo | NativeTask:
    """What a trial trains, as the support rule takes it: for a model of your own (``native_model``), the task
    ``dataset`` sets (``harness.neutral.native.task``); else the neutral ``model``'s analysis for the dataset's input
    and classes.

    Raises:
        ValueError: neither a model of your own nor a neutral model.
        harness.neutral.models.ModelError: a neutral model the dataset does not fit.
    """
    feed, classes = datasets.describe_input(dataset)
    if native_model is not None:
        return NativeTask(native.task(feed))
    if model is None:
        raise ValueError("the spec has no neutral model: every framework entry brings its own")
    return models.analyze(model, feed, classes)
