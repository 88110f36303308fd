"""The adapter contract: what the harness's shared training loop (``harness.execution.loop``) asks of every framework.

An adapter runs in the worker process of one trial, made with the trial's ``RunOptions``, and is called by lifecycle
(docs/design/layout.md#the-adapter-contract). Timing is never done inside an adapter, and whether a trial can run at
all is the plan's answer from the adapter's ``Declaration`` (``harness.plan.support``): adapters do not re-check it.
The built-in adapters implement it as ``adapters.parts.Facade``s of a ``Training`` and an ``Inputs`` part.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

from adapters.declaration import Declaration
from harness.spec import AllocatorSpec, CompileMode, InputMode, LoaderSpec, Precision
from harness.spec.devices import device_index, device_kind

__all__ = ["Adapter", "Batch", "DataParallel", "Declaration", "DeviceUnavailable", "Model", "RunOptions", "Settings",
           "Weights", "device_index", "device_kind", "micro_batch_size", "shard"]

if TYPE_CHECKING:
    from harness.neutral.datasets import Data
    from harness.neutral.info import ModelInfo
    from harness.neutral.inputs import InputSource
    from harness.neutral.native import NativeSource
    from harness.spec import OptimizerSpec

#: Named float32 arrays: the canonical parameters (``harness.neutral.models.initial_weights``) or buffers.
Weights = dict[str, npt.NDArray[np.float32]]
#: The framework's own model object (a ``torch.nn.Module``, ...), as a model source made it for ``Adapter.build``.
Model = Any
#: One optimizer step's batch as ``Adapter.batches`` yields it: opaque to the loop, handed back to ``train_step``.
Batch = Any


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
        one process. Raises DeviceUnavailable for a multi-process trial or a device named twice."""
        if self.processes != 1:
            raise DeviceUnavailable(f"the {framework} adapter drives every device of a data-parallel trial from one "
                                    f"process, not {self.processes}")
        if len(set(self.devices)) != len(self.devices):
            raise DeviceUnavailable(f"the data-parallel trial names a device twice: {', '.join(self.devices)}")
        return [(device_kind(name), device_index(name)) for name in self.devices]


class RunOptions(BaseModel):
    """How the worker asks an adapter to run its trial, given when the adapter is made (``Adapter(options)``) and
    built once from the trial (``harness.plan.Trial``) and the spec. Frozen: an adapter reads it, never changes it,
    and records what applies in ``settings``. The defaults are a plain fp32 run in the adapter's own mode with no
    cap."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: fp32, tf32, bf16 or fp16
    precision: Precision = "fp32"
    #: eager or compiled; "default" is the declaration's ``default_compile``, resolved when the adapter is made
    compile: CompileMode = "default"
    #: the trial's memory cap: on a GPU the adapter applies it through its framework's own limit; on the CPU the
    #: worker applies a process limit itself. None: no cap
    memory_limit_bytes: int | None = None
    #: the spec's allocator settings that the declaration names (e.g. tensorflow_memory_growth)
    allocator: AllocatorSpec = Field(default_factory=AllocatorSpec)
    #: data-parallel training over several devices; None: one device
    data_parallel: DataParallel | None = None
    #: where each step's batch comes from (resident: gathered on the device; loader: ``open_loader``'s loader)
    input: InputMode = "resident"
    #: the loader's workers and prefetch (``input == "loader"``)
    loader: LoaderSpec = Field(default_factory=LoaderSpec)
    #: a directory for the framework's persistent compilation cache (JAX's); None: no cache
    compilation_cache: str | None = None


class Settings(BaseModel):
    """What an adapter ran with, for the trial's record (``Adapter.settings``): a typed part every adapter fills,
    and the framework's own settings under their own names as further fields (``extra="allow"``: the allocator's
    variables, XLA or TorchInductor options, the loss scale, ...)."""

    model_config = ConfigDict(extra="allow")

    #: the precision trained in (``RunOptions.precision``)
    precision: Precision
    #: the execution mode trained in: "eager" or "compiled"
    compile: str
    #: CPU threads the framework's intra-op and inter-op pools used; None where it does not tell
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None
    #: the memory cap applied on a GPU (bytes; None: none)
    memory_limit_bytes: int | None = None
    #: input: loader: the framework's loader and its settings in the framework's own names, with ``loader`` (its
    #: name) and ``source`` ("files" or "memory"); None in resident mode
    loader: dict[str, Any] | None = None
    #: a data-parallel trial: the mechanism and its settings (world size, rank, sync batchnorm, ...); else None
    data_parallel: dict[str, Any] | None = None

    def record(self) -> dict[str, Any]:
        """The settings as the trial record holds them (JSON data, the extras flat beside the typed part)."""
        return self.model_dump(mode="json")


class DeviceUnavailable(RuntimeError):
    """The framework cannot use the requested device (a CPU-only build asked for cuda:N, an index out of range)."""


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


def micro_batch_size(samples_per_step: int, micro_batches: int) -> int:
    """The size of each of the ``micro_batches`` consecutive micro-batches that a step of ``samples_per_step``
    samples is split into (gradient accumulation). Raises ValueError unless ``micro_batches`` is a positive divisor
    of ``samples_per_step``."""
    if micro_batches < 1 or samples_per_step % micro_batches:
        raise ValueError(f"{samples_per_step} samples cannot be split into {micro_batches} equal micro-batches")
    return samples_per_step // micro_batches


class Adapter(abc.ABC):
    """One framework behind the harness's interface. Instances live in a worker process, one trial each.

    An adapter class names its declaration, ``class PyTorchAdapter(Adapter, declaration=DECLARATION)``, and gets
    ``declaration`` and ``name`` from it.

    Args:
        options: the trial's ``RunOptions`` (default: fp32 in the declaration's default mode), kept as ``options``
            with ``compile`` resolved to "eager" or "compiled"."""

    declaration: ClassVar[Declaration]
    name: ClassVar[str]

    def __init_subclass__(cls, declaration: Declaration | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if declaration is not None:
            cls.declaration, cls.name = declaration, declaration.name

    def __init__(self, options: RunOptions | None = None) -> None:
        options = options or RunOptions()
        self.options = options.model_copy(update={"compile": self.declaration.capabilities.mode(options.compile)})
        self._loss_steps = 0  # train_steps since the last read_loss: each adapter's train_step adds one

    @property
    def mode(self) -> str:
        """The execution mode this trial trains in, "eager" or "compiled" (``options.compile``, resolved)."""
        return self.options.compile

    # -- setup ---------------------------------------------------------------------------------------------------
    def device_problem(self, device: str) -> str | None:
        """Why the framework, as installed here, cannot train on ``device`` ("cpu", "cuda:N"); None when it can.

        One line ("PyTorch 2.13.0+cpu sees no CUDA device (a CPU-only build)") from the framework's own device query,
        without a context or memory; the environment probe asks it, ``prepare`` raises it. Default: None."""
        return None

    @abc.abstractmethod
    def prepare(self, device: str, threads: int | None, seed: int) -> None:
        """Selects the device, CPU threads and RNG seed; applies the options' precision, memory cap and allocator.

        Called before any other framework op.

        Args:
            device: "cpu" or "cuda:N".
            threads: intra-op threads (inter-op: 1); None keeps the framework's defaults.
            seed: the framework's RNG seed.

        Raises:
            DeviceUnavailable: the framework cannot use ``device`` (``device_problem``'s reason)."""

    @abc.abstractmethod
    def neutral_model(self, info: ModelInfo, weights: Weights) -> Model:
        """The neutral builder, a model source: the framework's model object for ``info``, holding ``weights``.

        Args:
            info: the analysed model (``harness.neutral.models.analyze``).
            weights: float32 parameters, canonical layout and names (``harness.neutral.models``); a batchnorm buffer
                (``"<name>.running_mean"``, ``"<name>.running_var"``) it lacks starts at
                ``harness.neutral.models.initial_buffers``'s.

        Raises:
            harness.neutral.visitor.UnknownLayer: a layer kind the builder lacks."""

    @abc.abstractmethod
    def build(self, model: Model, task: str, optimizer: OptimizerSpec) -> None:
        """Makes ``model`` the trial's model, with ``optimizer``, in the options' precision, mode and parallelism.

        Args:
            model: what a model source returned (``neutral_model``, ``native_model``).
            task: one of ``harness.neutral.info.TASKS``: the input and the loss, the mean softmax cross-entropy over the
                samples, or for ``next_token`` (logits (B, L, vocab), labels (B, L)) over all B x L positions.
            optimizer: the optimizer, its learning rate scaled by the plan."""

    def build_neutral(self, info: ModelInfo, weights: Weights, optimizer: OptimizerSpec) -> None:
        """``build`` of the neutral builder's model of ``info`` with ``weights`` (``neutral_model``'s arguments)."""
        self.build(self.neutral_model(info, weights), info.task, optimizer)

    def native_model(self, model: object, source: NativeSource) -> Model:
        """The other model source: ``model``, a spec's factory's, adopted as the framework's model for ``build``.

        Initialised for ``source.input`` where initialisation is lazy, with ``source.initial_weights`` where named.
        Default: adopts none (raises).

        Args:
            model: what the factory returned (``harness.neutral.native.make``, called after ``prepare`` set the seed).
            source: the spec's native model: its input and initial weights.

        Raises:
            harness.neutral.native.NativeModelError: ``model`` is not the framework's own model type (the declaration's
                ``native_model``); its field is ``model``."""
        from harness.neutral.native import NativeModelError

        raise NativeModelError("model", f"the {self.name} adapter trains no model of your own")

    def train_flops_per_sample(self) -> tuple[int | None, str]:
        """FLOPs of one sample's training step (forward and backward), by the framework's own counter.

        2 per multiply-accumulate (``torch.utils.flop_counter.FlopCounterMode``, JAX's cost analysis); called after
        training, outside the timed windows, for a model of your own (the neutral model's are counted per layer).

        Returns:
            (FLOPs, what counted them), or (None, why not): by default (None, "<title> has no FLOP counter")."""
        return None, f"{self.declaration.title} has no FLOP counter"

    @abc.abstractmethod
    def load(self, data: Data) -> None:
        """Places the dataset on the device once, in the model's layout (``harness.neutral.steps.to_layout``).

        Args:
            data: float32 NHWC images or int64 (N, L) token ids; int64 labels, (N,) or (N, L) for a next-token task.
                With ``options.input == "loader"`` only its test set is placed: the training samples come through
                ``open_loader``."""

    def open_loader(self, source: InputSource) -> None:
        """Builds the framework's own data loader (the declaration's ``loader``) over ``source``, once.

        With ``options.loader``'s workers and prefetch, as the framework recommends (``Settings.loader``); after
        ``load``, untimed.

        Args:
            source: the training samples; each step is one ``harness.neutral.steps.EpochSteps`` element.

        Raises:
            NotImplementedError: the adapter has no loader mode (the default)."""
        raise NotImplementedError(f"the {self.name} adapter has no data loader mode")

    def set_train_images(self, images: npt.NDArray[np.float32]) -> None:
        """Replaces the resident training images in place, re-tracing and re-allocating nothing of the step.

        Called once per epoch when the trial augments its data (``harness.neutral.datasets.augment``).

        Args:
            images: float32 NHWC, the shape ``load`` placed.

        Raises:
            NotImplementedError: the adapter cannot (the default)."""
        raise NotImplementedError(f"the {self.name} adapter cannot replace its training images (augmentation)")

    # -- steps ---------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def batches(self, order: npt.NDArray[np.int64], samples_per_step: int, epoch: int) -> Iterator[Batch]:
        """The batches of epoch ``epoch``, one per optimizer step in order.

        Resident mode: the steps' indices, which an adapter may move to the device for the whole epoch here, as a
        hand-written loop readies its batches before its clock starts (called before the epoch's first step and outside
        every timed window; ``train_step`` gathers them). Loader mode: the loader's batches, on the device as the
        framework's tensors (maybe still in transfer), started inside a window that runs across an epoch's end, as a
        training loop starts its next epoch; the loop times each ``next``, a step's wait for input.

        Args:
            order: int64 (N,), the epoch's sample order.
            samples_per_step: B; step ``p`` trains on ``harness.neutral.steps.steps(order, samples_per_step)[p]`` (whole
                steps only).
            epoch: from 0."""

    @abc.abstractmethod
    def train_step(self, batch: Batch, micro_batches: int = 1) -> None:
        """One optimizer step on ``batch``, of B samples; may return before the device has finished.

        Adds the step's loss (float32, the mean over the B samples) to the device-resident sum that ``read_loss`` reads
        and counts the step (``_loss_steps``); reads nothing back. Data-parallel (N devices): device (or rank) d trains
        on ``shard(indices, N, d)`` of the global batch, the gradients averaged over all B samples before the one
        identical update.

        Args:
            batch: one of ``batches``.
            micro_batches: k; with k > 1 (gradient accumulation) k consecutive micro-batches of B / k, their gradients
                accumulated as the mean over all B samples (the loss: the mean of their means) before the one step.

        Raises:
            ValueError: k does not divide B."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Waits until all queued device work is done, without restarting the loss sum (a timed window's edges)."""

    def agree(self, value: int) -> int:
        """``value`` as rank 0 of a multi-process data-parallel trial has it, on every rank.

        A broadcast every rank calls at the same point, outside the timed windows, so every rank times windows of the
        same steps. Default (one process): ``value``."""
        return value

    def read_loss(self) -> tuple[float, int]:
        """The mean loss of the train_steps since the previous read, and how many; the sum and count restart.

        Waits until all queued device work is done, then copies one scalar (the float32 sum's rounding: at most about n
        x 6e-8 relative for n steps); the sum is the adapter's (``_take_loss_sum``).

        Returns:
            (mean loss, steps); (nan, 0) when no step ran since."""
        self.wait()
        steps, self._loss_steps = self._loss_steps, 0
        if not steps:
            return float("nan"), 0
        return self._take_loss_sum() / steps, steps

    @abc.abstractmethod
    def _take_loss_sum(self) -> float:
        """The device-resident sum of the step losses since the last read, copied to the host, and the sum restarted
        at zero; called by ``read_loss`` after ``wait``, only when a step ran."""

    def gradient_norms(self, batch: Batch, micro_batches: int) -> tuple[list[float], float]:
        """Squared L2 norms of loss gradients at the current parameters, for the gradient noise scale.

        g_i is the gradient of micro-batch i's mean training loss (the loss ``train_step`` minimises, in the trial's
        precision, dropout drawing as in training) with respect to every trainable parameter; G = (g_1 + ... + g_k) / k
        is the gradient of the mean loss over all B samples. Nothing the training depends on changes: parameters,
        buffers (batchnorm's running statistics are restored), optimizer state and the loss sum (``read_loss``) are as
        before; dropout may advance the framework's random state. Returns only when the device is done (the norms are
        read back: never inside a timed window).

        The estimator of McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", Appendix A) takes
        E|g_i|^2 = |G_true|^2 + tr(Sigma) / b and E|G|^2 = |G_true|^2 + tr(Sigma) / B from these
        (``harness.studies.advise.noise``).

        Args:
            batch: one step's batch from ``batches`` (resident mode, one device) of B samples, split as ``train_step``
                splits it for gradient accumulation.
            micro_batches: k >= 2: k consecutive micro-batches of b = B / k samples.

        Returns:
            ([|g_1|^2, ..., |g_k|^2], |G|^2), float (computed in float32, summed over parameters in float64).

        Raises:
            ValueError: k < 2, or k does not divide B.
            NotImplementedError: the adapter cannot (the default; the plan refuses such a trial from
                ``Capabilities.gradient_noise``)."""
        raise NotImplementedError(f"the {self.name} adapter does not measure gradient norms")

    # -- evaluation ----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def evaluate(self, batch_size: int) -> tuple[float, float]:
        """Mean cross-entropy loss and accuracy (a fraction in [0, 1]) on the whole test set, in inference mode.

        In batches of ``batch_size`` (the last may be smaller), the device done when it returns; over every position for
        a next-token model; data-parallel, the first device's model (returned on every rank)."""

    @abc.abstractmethod
    def predict(self, inputs: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """Logits, float32 (N, classes), or (N, L, vocab) for a next-token model; inference mode.

        Args:
            inputs: float32 NHWC images, or int64 (N, L) token ids."""

    # -- state ---------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def get_weights(self) -> Weights:
        """The current parameters, canonical for a neutral model (data-parallel: the first device's, all equal)."""

    def get_buffers(self) -> Weights:
        """The current buffers (batchnorm's running statistics), canonical for a neutral model; default: none."""
        return {}

    # -- telemetry -----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def versions(self) -> dict[str, str]:
        """Versions, e.g. {"torch": "2.13.0", "cuda": "13.0"}: declared distributions ("-" as "_"), runtimes, builds."""

    @abc.abstractmethod
    def settings(self) -> Settings:
        """What changes the numbers: precision, mode, threads, memory cap, loader, parallelism, allocator, compiler."""

    def reset_memory_stats(self) -> None:
        """Restarts the allocator's peak counters (called when the measured phase begins). Default: nothing."""

    def memory_stats(self) -> dict[str, int]:
        """The framework allocator's own counters since ``reset_memory_stats``, in bytes.

        ``allocator_peak_bytes`` (held by tensors) and ``allocator_reserved_peak_bytes`` (held from the device); an
        absent key: the framework does not expose it here."""
        return {}

    def cpu_allocator_peak(self) -> int | None:
        """Peak bytes of the capped CPU tensor allocator (the declaration's ``cpu_allocator``); None without one.

        Called at the worker's exit (``harness.execution.limits``), so it must not raise. Default: None."""
        return None

    def compilations(self) -> int | None:
        """Graphs the framework has traced or compiled for the training step so far; None without a counter.

        Its own count (tf.function traces, JAX's jit cache entries, TorchDynamo's unique graphs), read when warm-up ends
        and at the trial's end: a rise between the two is a recompilation inside the timed windows."""
        return None

    @abc.abstractmethod
    def is_oom(self, exc: BaseException) -> bool:
        """Whether ``exc``, what the trial raised, is this framework's out-of-memory error (by exception type)."""
