"""The adapter contract: what the harness's shared training loop asks of every framework.

An adapter runs in the worker process of one trial, and the loop (``harness.execution.worker``) calls it by lifecycle:
setup (``prepare`` before any framework op, ``build``, ``load``), steps (per epoch ``stage_epoch``, then
``train_step`` with the step's position, ``wait`` at the edges of every timed window and ``read_loss`` after an end
edge, outside the clock), evaluation, state and telemetry. Timing is never done inside an adapter.

The training loss: every ``train_step`` adds its loss to a running sum that stays on the device (added to inside the
step's own queued work: no read back per step) and counts the step on the host; ``read_loss`` waits, reads the sum
once and restarts it, so an epoch's ``train_loss`` is the mean over every one of its steps whatever the windows.

What an adapter builds and trains in is its class's ``declaration`` (``adapters.declaration.Declaration``), from
which the class attributes below are set; a trial that needs anything else is ``unsupported`` before training.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

from adapters.declaration import (
    ALL_LAYERS,
    ALL_TASKS,
    BASIC_LAYERS,
    BOTH,
    CPU,
    CUDA,
    EAGER_ONLY,
    FP32_ONLY,
    IMAGE_TASKS,
    Declaration,
)
from harness.neutral.info import TASKS, describe_feature, requirements
from harness.spec import AllocatorSpec, CompileMode, InputMode, LoaderSpec, Precision
from harness.spec.devices import device_index, device_kind

__all__ = ["ALL_LAYERS", "ALL_TASKS", "BASIC_LAYERS", "BOTH", "CPU", "CUDA", "Adapter", "DataParallel", "Declaration",
           "DeviceUnavailable", "EAGER_ONLY", "FP32_ONLY", "IMAGE_TASKS", "RunOptions", "data_parallel_gap",
           "device_index", "device_kind", "input_gap", "execution_gap", "micro_batch_size", "shard", "support_gap"]

if TYPE_CHECKING:
    from harness.neutral.datasets import Data
    from harness.neutral.inputs import InputSource
    from harness.neutral.models import ModelInfo
    from harness.spec import OptimizerSpec


class RunOptions(BaseModel):
    """How the worker asks an adapter to run its trial (``Adapter.options``), built once by the worker before
    ``prepare`` from the trial (``harness.plan.Trial``) and the spec, after ``Adapter.unsupported_execution`` has
    accepted the precision and mode. Frozen: an adapter reads it, never changes it, and records what applies in
    ``settings``. The defaults are a plain fp32 run in the adapter's own mode with no cap."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: fp32, tf32, bf16 or fp16
    precision: Precision = "fp32"
    #: eager or compiled as ``Adapter.compile_mode`` resolved it; default: the adapter's own mode
    compile: CompileMode = "default"
    #: the trial's memory cap: on a GPU the adapter applies it through its framework's own limit; on the CPU the
    #: worker applies a process limit itself. None: no cap
    memory_limit_bytes: int | None = None
    #: the spec's allocator settings that the declaration names (e.g. tensorflow_memory_growth)
    allocator: AllocatorSpec = Field(default_factory=AllocatorSpec)
    #: data-parallel training over several devices (``DataParallel``); None: one device
    data_parallel: DataParallel | None = None
    #: where each step's batch comes from (resident: gathered on the device; loader: ``open_loader``'s loader)
    input: InputMode = "resident"
    #: the loader's workers and prefetch (``input == "loader"``)
    loader: LoaderSpec = Field(default_factory=LoaderSpec)


class DataParallel(BaseModel):
    """A data-parallel trial as one worker process sees it (``RunOptions.data_parallel``).

    devices: every device of the trial in order, ``"cpu:0", "cpu:1", ...`` on the CPU (logical devices: TensorFlow
    logical CPU devices, ``mx.cpu(i)``, JAX host devices, one PyTorch process each) or ``"cuda:0", "cuda:1", ...``.
    processes: 1 when this one process drives every device (TensorFlow MirroredStrategy, MXNet kvstore, JAX
    sharding), else one process per device (PyTorch DistributedDataParallel: ``len(devices)`` ranks). rank: this
    process's rank (0 when ``processes`` is 1); it drives ``devices[rank]``. sync_batchnorm: batchnorm normalises
    over the global batch (every device's shard) instead of each device's own. The rendezvous of a multi-process trial
    is torchrun's (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` in the environment).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    devices: tuple[str, ...] = Field(min_length=2)
    processes: int = Field(default=1, ge=1)
    rank: int = Field(default=0, ge=0)
    sync_batchnorm: bool = False

    @property
    def size(self) -> int:
        """N, the number of devices."""
        return len(self.devices)

    def one_process_devices(self, framework: str) -> list[tuple[str, int]]:
        """Each device as (kind, index), ``"cuda:1"`` -> ("cuda", 1), for a framework that drives every device from
        one process. Raises DeviceUnavailable (defined below) for a multi-process trial or a device named twice."""
        if self.processes != 1:
            raise DeviceUnavailable(f"the {framework} adapter drives every device of a data-parallel trial from one "
                                    f"process, not {self.processes}")
        if len(set(self.devices)) != len(self.devices):
            raise DeviceUnavailable(f"the data-parallel trial names a device twice: {', '.join(self.devices)}")
        return [(device_kind(name), device_index(name)) for name in self.devices]


def shard(indices: npt.NDArray[np.int64], devices: int, device: int) -> npt.NDArray[np.int64]:
    """Device ``device``'s part of a step's samples under data parallelism: ``indices`` (int64 (B,), the step's
    slice of the epoch order) cut into ``devices`` equal contiguous parts, the d-th part for device d (rank d), so
    device 0 trains on the first B / N samples of the step. The same rule in every framework; with batchnorm each
    device normalises over its part. Raises ValueError unless ``devices`` divides B."""
    if devices < 1 or len(indices) % devices or not 0 <= device < devices:
        raise ValueError(f"{len(indices)} samples cannot be split into {devices} equal per-device batches "
                         f"(device {device})")
    per_device = len(indices) // devices
    return indices[device * per_device:(device + 1) * per_device]


RunOptions.model_rebuild()


def micro_batch_size(samples_per_step: int, micro_batches: int) -> int:
    """The size of each of the ``micro_batches`` consecutive micro-batches that a step of ``samples_per_step``
    samples is split into (gradient accumulation; the trial's ``micro_batch_size``, which the plan computed, so
    this only checks the step it was given). Raises ValueError unless ``micro_batches`` is a positive divisor of
    ``samples_per_step``."""
    if micro_batches < 1 or samples_per_step % micro_batches:
        raise ValueError(f"{samples_per_step} samples cannot be split into {micro_batches} equal micro-batches")
    return samples_per_step // micro_batches


def execution_gap(adapter: str, precisions: Mapping[str, frozenset[str]], modes: Mapping[str, str], default: str,
                  precision: str, compile: str, device: str, notes: Mapping[str, str] | None = None) -> str | None:
    """None when the adapter trains in ``precision`` with ``compile`` ("default" is its ``default`` mode) on
    ``device``; else one line saying which it lacks, e.g. "the mxnet adapter does not train in fp16 on cpu (only on
    cuda)", followed by ``notes[precision]`` (why not; ``Declaration.notes``) where there is one."""
    kind = device_kind(device)
    if kind not in precisions.get(precision, frozenset()):
        where = sorted(precisions.get(precision, ()))
        also = f" (only on {', '.join(where)})" if where else ""
        why = f": {notes[precision]}" if notes and precision in notes else ""
        return f"the {adapter} adapter does not train in {precision} on {kind}{also}{why}"
    mode = default if compile == "default" else compile
    if mode not in modes:
        return f"the {adapter} adapter has no {mode} mode (its modes: {', '.join(sorted(modes))})"
    return None


def support_gap(adapter: str, layers: frozenset[str], tasks: frozenset[str], info: ModelInfo) -> str | None:
    """None when ``layers`` and ``tasks`` cover every requirement of ``info`` (``harness.neutral.models
    .requirements``); else one line naming the first one missing and where, e.g. "the pytorch adapter does not
    support residual blocks (model.layers.1)"."""
    for feature, where in requirements(info):
        if feature not in (tasks if feature in TASKS else layers):
            return f"the {adapter} adapter does not support {describe_feature(feature)} ({where})"
    return None


def data_parallel_gap(record: Declaration, info: ModelInfo, devices: int, sync_batchnorm: bool,
                      device: str = "cpu") -> str | None:
    """None when the adapter of ``record`` trains ``info`` on ``devices`` devices (with ``sync_batchnorm``, which
    matters only for a model with batchnorm) on ``device``'s kind; else one line saying what it lacks."""
    if devices <= 1:
        return None
    if not record.data_parallel:
        return f"the {record.name} adapter does not train data-parallel" + (
            f": {record.data_parallel_mechanism}" if record.data_parallel_mechanism else "")
    if sync_batchnorm and any(layer.kind == "batchnorm" for layer in info.walk()) and (
            device_kind(device) not in record.sync_batchnorm):
        why = f": {record.sync_batchnorm_note}" if record.sync_batchnorm_note else ""
        return f"the {record.name} adapter has no synchronised batchnorm on {device_kind(device)}{why}"
    return None


def input_gap(record: Declaration, source: str, devices: int = 1, from_files: bool = False,
              augmentation: bool = False) -> str | None:
    """None when the adapter of ``record`` trains with ``source`` (``harness.spec.InputMode``) on ``devices``
    devices; else one line saying what it lacks. Loader mode needs the declaration's ``loader``, and is not combined
    with data parallelism (each device would need its shard of every batch from the loader)."""
    if source != "loader":
        return None
    if not record.loader:
        return f"the {record.name} adapter has no data loader mode (input: loader)"
    if devices > 1:
        return "input: loader is not combined with data parallelism yet (each device would need its own shard)"
    return None


class DeviceUnavailable(RuntimeError):
    """The framework cannot use the requested device (a CPU-only build asked for cuda:N, an index out of range)."""


class Adapter(abc.ABC):
    """One framework behind the harness's interface. Instances live in a worker process, one trial each.

    A built-in adapter names its record, ``class PyTorchAdapter(Adapter, declaration=DECLARATION)``, and gets
    ``name``, ``SUPPORTED_LAYERS``, ``SUPPORTED_TASKS``, ``PRECISIONS``, ``COMPILE_MODES``, ``DEFAULT_COMPILE``,
    ``ATTENTION`` and ``PRECISION_NOTES`` from it. Another adapter may set those attributes itself (the defaults:
    the basic layers, image classification, fp32 only, one "eager" mode, unfused attention) and gets a
    ``declaration`` made of them.
    """

    declaration: ClassVar[Declaration]
    name: ClassVar[str]
    SUPPORTED_LAYERS: ClassVar[frozenset[str]] = BASIC_LAYERS
    SUPPORTED_TASKS: ClassVar[frozenset[str]] = IMAGE_TASKS
    PRECISIONS: ClassVar[Mapping[str, frozenset[str]]] = FP32_ONLY
    COMPILE_MODES: ClassVar[Mapping[str, str]] = EAGER_ONLY
    DEFAULT_COMPILE: ClassVar[str] = "eager"
    ATTENTION: ClassVar[str] = "unfused"
    PRECISION_NOTES: ClassVar[Mapping[str, str]] = {}
    #: Set on the instance by the worker before ``prepare`` (``RunOptions``: precision, mode, memory cap, allocator
    #: settings); the class's default, an immutable fp32 run in the adapter's own mode, serves tests that build an
    #: adapter directly. Adapters record what applies in ``settings``.
    options: RunOptions = RunOptions()

    def __init_subclass__(cls, declaration: Declaration | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if declaration is not None:
            cls.declaration, cls.name = declaration, declaration.name
            cls.SUPPORTED_LAYERS, cls.SUPPORTED_TASKS = declaration.layers, declaration.tasks
            cls.PRECISIONS, cls.COMPILE_MODES = declaration.precisions, declaration.compile_modes
            cls.DEFAULT_COMPILE, cls.ATTENTION = declaration.default_compile, declaration.attention
            cls.PRECISION_NOTES = declaration.notes
        elif any(key in vars(cls) for key in _FACTS) and isinstance(getattr(cls, "name", None), str):
            cls.declaration = Declaration(
                name=cls.name, title=cls.name, adapter=f"{cls.__module__}:{cls.__qualname__}",
                precisions=cls.PRECISIONS, compile_modes=cls.COMPILE_MODES, default_compile=cls.DEFAULT_COMPILE,
                layers=cls.SUPPORTED_LAYERS, tasks=cls.SUPPORTED_TASKS, attention=cls.ATTENTION,
                notes=cls.PRECISION_NOTES)

    # -- setup ---------------------------------------------------------------------------------------------------

    def device_problem(self, device: str) -> str | None:
        """Why the framework, as installed in this interpreter, cannot train on ``device`` ("cpu", "cuda:N"), in one
        line (e.g. "PyTorch 2.13.0+cpu sees no CUDA device (a CPU-only build)"), or None when it can. Asks the
        framework's own device query without creating a context or taking memory; the environment probe calls it
        before a run starts and ``prepare`` raises DeviceUnavailable with it. Default: None (the CPU always works)."""
        return None

    def unsupported_execution(self, precision: str, compile: str, device: str) -> str | None:
        """None when this adapter trains in ``precision`` with ``compile`` ("default": ``DEFAULT_COMPILE``) on
        ``device``, else the reason (``execution_gap``). The worker calls it before ``prepare``."""
        return execution_gap(self.name, self.PRECISIONS, self.COMPILE_MODES, self.DEFAULT_COMPILE, precision,
                             compile, device, self.PRECISION_NOTES)

    def compile_mode(self, compile: str) -> str:
        """The mode ``compile`` ("default", "eager", "compiled") selects in this adapter."""
        return self.DEFAULT_COMPILE if compile == "default" else compile

    @abc.abstractmethod
    def prepare(self, device: str, threads: int | None, seed: int) -> None:
        """Selects the device ("cpu" or "cuda:N"), the CPU thread counts (intra-op ``threads``, inter-op 1; None keeps
        the framework's defaults) and the framework's RNG seed, and applies allocator settings. Called before any
        other framework op. Raises DeviceUnavailable."""

    def unsupported(self, info: ModelInfo) -> str | None:
        """None when this adapter can build and train ``info``; else the reason (one line naming the first layer
        kind, option or task it lacks and where; ``support_gap``). The worker calls it after ``prepare`` and before
        ``build``, so an adapter that lacks a layer on one device only may override it."""
        return support_gap(self.name, self.SUPPORTED_LAYERS, self.SUPPORTED_TASKS, info)

    @abc.abstractmethod
    def build(self, info: ModelInfo, weights: dict[str, npt.NDArray[np.float32]], optimizer: OptimizerSpec) -> None:
        """Builds the model of ``info`` with exactly ``weights`` (canonical layout, see harness.neutral.models) and the
        optimizer. The loss is the mean softmax cross-entropy of the logits: over the samples, or for a ``next_token``
        model (``info.task``; logits (B, L, vocab), labels (B, L)) over all B x L positions. ``weights`` may also hold
        buffers (batchnorm's ``"<name>.running_mean"`` / ``"<name>.running_var"``); a buffer it lacks starts at
        ``harness.neutral.models.initial_buffers``'s value."""

    @abc.abstractmethod
    def load(self, data: Data) -> None:
        """Places the dataset on the device once (float32 NHWC images, or int64 (N, L) token ids; int64 labels, (N,)
        or (N, L) for a next-token task); train_step gathers from it. With ``options.input == "loader"`` the test set
        only: the training samples come through ``open_loader``'s loader."""

    def set_train_images(self, images: npt.NDArray[np.float32]) -> None:
        """Replaces the training images on the device in place with ``images`` (float32 NHWC, the shape ``load``
        placed), without re-tracing or re-allocating anything the train step holds: the harness calls it once per
        epoch when the trial augments its data (harness.neutral.datasets.augment). Raises NotImplementedError when the
        adapter cannot."""
        raise NotImplementedError(f"the {self.name} adapter cannot replace its training images (augmentation)")

    # -- input pipeline (input: loader) ---------------------------------------------------------------------------

    def open_loader(self, source: InputSource) -> None:
        """Builds the framework's own data loader (the declaration's ``loader``) over ``source``
        (``harness.neutral.inputs.InputSource``: ``source.read(indices, epoch)`` gives a batch's host arrays), with
        ``options.loader``'s workers and prefetch as the framework's documentation recommends for training, and
        records its settings under ``settings()["loader"]`` in the framework's own names. Called once, after
        ``load`` and outside every timed window. Raises NotImplementedError without a loader mode."""
        raise NotImplementedError(f"the {self.name} adapter has no data loader mode")

    def epoch_batches(self, order: npt.NDArray[np.int64], samples_per_step: int, epoch: int) -> Iterator[Any]:
        """The loader's batches of epoch ``epoch``, one per optimizer step: step ``p``'s batch holds
        ``source.read(order[p * samples_per_step:(p + 1) * samples_per_step], epoch)``, on the device as the
        framework's tensors (its transfer started, maybe not finished), for ``train_batch``; whole steps only. The
        shared loop times each ``next`` of it: the time a step waited for its input. Called before the epoch's
        first step, outside every timed window for the first epoch (inside a window that runs across an epoch's end,
        as a training loop starts its next epoch's iterator)."""
        raise NotImplementedError(f"the {self.name} adapter has no data loader mode")

    def train_batch(self, batch: Any, micro_batches: int = 1) -> None:
        """One optimizer step on a batch ``epoch_batches`` yielded: otherwise as ``train_step`` (micro-batches,
        the loss sum, no read back)."""
        raise NotImplementedError(f"the {self.name} adapter has no data loader mode")

    # -- steps ---------------------------------------------------------------------------------------------------

    def stage_epoch(self, order: npt.NDArray[np.int64], samples_per_step: int) -> None:
        """The epoch's sample order (int64 (N,), ``harness.neutral.datasets.epoch_order``) and the samples per
        optimizer step (``harness.plan.Trial.samples_per_step``: micro-batch size x micro-batches), given before the
        epoch's first step and outside every timed window: step ``p`` of the epoch trains on
        ``order[p * samples_per_step:(p + 1) * samples_per_step]``, so an adapter may move the epoch's index batches to
        the device here, as a hand-written loop prepares its batches before its clock starts. Default: nothing."""

    @abc.abstractmethod
    def train_step(self, indices: npt.NDArray[np.int64], micro_batches: int = 1, position: int | None = None) -> None:
        """One optimizer step on the training samples ``indices`` (int64 (B,)). ``position``: the step's index in the
        epoch staged by ``stage_epoch`` (``indices`` is then that step's slice of its order, and the adapter may use
        what it staged); None: ``indices`` stand alone and the adapter converts them. With ``micro_batches`` k > 1
        (gradient accumulation), the B samples are k consecutive micro-batches of B / k, whose gradients are
        accumulated (as the mean over all B samples) before the one optimizer step. Data-parallel
        (``options.data_parallel``, N devices): ``indices`` are the global batch; device d trains on ``shard(indices,
        N, d)`` and the gradients are averaged over all B samples (all-reduced) before the one identical update on
        every device; a process of a multi-process trial trains on its rank's shard. May return before the device has
        finished. Adds the step's loss (float32, the mean over the B samples; with micro-batches the mean of the k
        micro-batches' means) to the device-resident sum that ``read_loss`` reads, and counts the step; reads nothing
        back (data-parallel: the mean over the global batch). Raises ValueError when k does not divide B."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Waits until all queued device work is done, without restarting the loss sum: the edges of a timed
        window."""

    def agree(self, value: int) -> int:
        """``value`` as rank 0 of a multi-process data-parallel trial has it, on every rank (a broadcast: a
        collective every rank calls at the same point), so every rank times windows of the same steps. Called outside
        the timed windows. Default (one process): ``value``."""
        return value

    #: train_steps queued since the last ``read_loss``: each adapter's ``train_step`` adds one per optimizer step.
    _loss_steps: int = 0

    def read_loss(self) -> tuple[float, int]:
        """The loss read: waits until all queued device work is done and returns (the mean loss of the train_steps
        since the previous read, how many steps that is), then restarts the sum and the count; (nan, 0) when no step
        ran since. One scalar copy whatever the number of steps; the float32 sum's rounding is at most about n x 6e-8
        relative for n steps (in practice sqrt(n) x 6e-8: 2e-6 for 1000 steps). The counting is here; the sum is
        the adapter's (``_take_loss_sum``)."""
        self.wait()
        steps, self._loss_steps = self._loss_steps, 0
        if not steps:
            return float("nan"), 0
        return self._take_loss_sum() / steps, steps

    def _take_loss_sum(self) -> float:
        """The device-resident sum of the step losses since the last read, copied to the host, and the sum restarted
        at zero; called by ``read_loss`` after ``wait``, only when a step ran. An adapter that overrides
        ``read_loss`` itself need not define it. Raises NotImplementedError otherwise."""
        raise NotImplementedError(f"{type(self).__name__} defines neither read_loss nor _take_loss_sum")

    # -- evaluation ----------------------------------------------------------------------------------------------

    @abc.abstractmethod
    def evaluate(self, batch_size: int) -> tuple[float, float]:
        """Mean cross-entropy loss and accuracy (fraction in [0, 1]) on the whole test set, in inference mode,
        in batches of ``batch_size`` (the last one may be smaller); for a next-token model both are over every
        position of every test sequence. Returns only when the device is done. Data-parallel: the first device's
        model (rank 0's, returned on every rank) over the whole test set."""

    @abc.abstractmethod
    def predict(self, images: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """Logits, float32 (N, classes), for float32 NHWC ``images`` (or int64 (N, L) token ids: (N, classes), or
        (N, L, vocab) for a next-token model); inference mode."""

    # -- state ---------------------------------------------------------------------------------------------------

    @abc.abstractmethod
    def get_weights(self) -> dict[str, npt.NDArray[np.float32]]:
        """The current parameters in the canonical layout and naming of ``harness.neutral.models.initial_weights``
        (data-parallel: the first device's, which every device's equal)."""

    def get_buffers(self) -> dict[str, npt.NDArray[np.float32]]:
        """The current buffers (batchnorm's running statistics) in the canonical layout and naming of
        ``harness.neutral.models.initial_buffers``. Default: none."""
        return {}

    # -- telemetry -----------------------------------------------------------------------------------------------

    @abc.abstractmethod
    def versions(self) -> dict[str, str]:
        """Framework and runtime versions, e.g. {"torch": "2.13.0", "cuda": "13.0"}: the keys of the declaration's
        distributions ("-" as "_"), then runtimes ("cuda", "cudnn") and builds."""

    def settings(self) -> dict[str, Any]:
        """Settings that change the numbers (allocator configuration, threads actually used), for the record."""
        return {}

    def reset_memory_stats(self) -> None:
        """Restarts the allocator's peak counters (called when the measured phase begins). Default: nothing."""

    def memory_stats(self) -> dict[str, int]:
        """The framework allocator's own counters since ``reset_memory_stats``, in bytes. Keys used by the report:
        ``allocator_peak_bytes`` (peak bytes held by tensors) and ``allocator_reserved_peak_bytes`` (peak bytes the
        allocator held from the device). Absent keys mean the framework does not expose that number here."""
        return {}

    def cpu_allocator_peak(self) -> int | None:
        """Peak bytes of the capped CPU tensor allocator (the declaration's ``cpu_allocator``) since it was
        created, or None where there is none or it keeps no count. Called at the worker's exit
        (``harness.execution.limits``), so it must not raise. Default: None."""
        return None

    def compilations(self) -> int | None:
        """How many graphs the framework has traced or compiled for the training step so far, by its own counter
        (TensorFlow's tf.function tracing count, the entries of JAX's jit cache, TorchDynamo's unique graphs), or
        None where the framework keeps no such counter. The worker reads it when warm-up ends and at the end of the
        trial: a rise between the two is a recompilation inside the timed windows."""
        return None

    @abc.abstractmethod
    def is_oom(self, exc: BaseException) -> bool:
        """True when ``exc`` is this framework's out-of-memory error (classified by exception type)."""


#: The class attributes a declaration sets (``Adapter.__init_subclass__``).
_FACTS = ("name", "SUPPORTED_LAYERS", "SUPPORTED_TASKS", "PRECISIONS", "COMPILE_MODES", "DEFAULT_COMPILE",
          "ATTENTION", "PRECISION_NOTES")
