"""The adapter contract: what the harness's shared training loop asks of every framework.

An adapter runs in the worker process of one trial. The harness calls, in this order: ``prepare`` (device, threads,
seed, allocator settings: before any framework op), ``build`` (the model from the canonical weights), ``load`` (the
dataset to the device, once), then per epoch ``stage_epoch`` and ``train_step`` many times with ``wait`` at the edges
of every timed window and ``read_loss`` after each end edge, outside the clock, and ``evaluate``. Timing is never done
inside an adapter: the loop in ``harness.execution.worker`` times every framework with the same code.

The training loss: every ``train_step`` adds its loss to a running sum that stays on the device (a float32 scalar
tensor, variable or array, added to inside the step's own queued work: no read back, no sync per step) and counts the
step on the host; ``read_loss`` waits, reads the sum once and restarts it. The loop's ``train_loss`` of an epoch is
thus the mean over every one of its steps, whatever the window sizes, so frameworks of different speed report the
same number for the same steps.

What an adapter builds is declared, not discovered by failing: ``SUPPORTED_LAYERS`` (layer kinds and layer options,
the vocabulary of ``harness.neutral.models.requirements``) and ``SUPPORTED_TASKS``. A trial whose model needs
anything else is ``unsupported``, with the reason ``unsupported`` gives, before training: at plan time from the
registry's table for the built-in adapters (``adapters.BUILTIN_SUPPORT``, which must equal the classes'
declarations), and in the worker before ``build`` for every adapter.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from harness.neutral.info import TASKS, describe_feature, requirements

if TYPE_CHECKING:
    from harness.neutral.datasets import Data
    from harness.neutral.models import ModelInfo
    from harness.spec import OptimizerSpec


def micro_batch_size(batch_size: int, micro_batches: int) -> int:
    """The size of each of the ``micro_batches`` consecutive micro-batches that a step of ``batch_size`` samples is
    split into (gradient accumulation). Raises ValueError unless ``micro_batches`` is a positive divisor of
    ``batch_size``."""
    if micro_batches < 1 or batch_size % micro_batches:
        raise ValueError(f"{batch_size} samples cannot be split into {micro_batches} equal micro-batches")
    return batch_size // micro_batches


def staged_start(order: np.ndarray | None, indices: np.ndarray) -> int | None:
    """Where ``indices`` start in ``order`` (the epoch's order an adapter kept in ``Adapter.stage_epoch``) when they
    are a contiguous int64 slice of that very array, as the harness's loop passes them; None otherwise (another
    array, or a strided or differently typed view), and the adapter then converts ``indices`` itself. The memory
    decides, not the values: while the adapter holds ``order``, its memory cannot belong to another array, and a
    view of it at that place holds exactly ``order[start:start + len(indices)]``."""
    if order is None or indices.dtype != np.int64 or indices.strides != (8,) or not len(indices):
        return None
    offset = indices.ctypes.data - order.ctypes.data
    if offset < 0 or offset % 8 or offset // 8 + len(indices) > len(order):
        return None
    return offset // 8


#: The layer kinds every adapter built before blocks existed (and options of none of them): conv2d with stride 1,
#: "same" or "valid" padding and a bias, dense on flat inputs with relu or no activation, and the rest as they were.
BASIC_LAYERS = frozenset({"conv2d", "maxpool2d", "avgpool2d", "global_avgpool2d", "batchnorm", "dropout", "flatten",
                          "dense", "relu", "softmax"})
#: Image classification only: NHWC float32 images in, one label per sample.
IMAGE_TASKS = frozenset({"image_classification"})
#: Every layer kind and layer option of the neutral model (``harness.neutral.info.requirements``'s vocabulary).
ALL_LAYERS = BASIC_LAYERS | frozenset({
    "residual", "layernorm", "gelu", "embedding", "attention", "sequence_pool", "conv2d.stride", "conv2d.padding",
    "conv2d.no_bias", "dense.gelu", "dense.sequence", "attention.causal"})
#: Every task: images, sequence classification and next-token prediction.
ALL_TASKS = frozenset(TASKS)


#: Device kinds, for ``PRECISIONS``.
CPU, CUDA, BOTH = frozenset({"cpu"}), frozenset({"cuda"}), frozenset({"cpu", "cuda"})
#: What an adapter declares by default: fp32 on the CPU and on CUDA GPUs, one execution mode.
FP32_ONLY = {"fp32": BOTH}
EAGER_ONLY = {"eager": "the framework's usual execution"}


def device_kind(device: str) -> str:
    """"cpu" or "cuda" for a device string ("cpu", "cuda", "cuda:1")."""
    return device.partition(":")[0]


def execution_gap(adapter: str, precisions: dict[str, frozenset[str]], modes: dict[str, str], default: str,
                  precision: str, compile: str, device: str, notes: dict[str, str] | None = None) -> str | None:
    """None when the adapter trains in ``precision`` with ``compile`` ("default" is its ``default`` mode) on
    ``device``; else one line saying which it lacks, e.g. "the mxnet adapter does not train in fp16 on cpu (only on
    cuda)", followed by ``notes[precision]`` (why not; ``adapters.PRECISION_NOTES``) where there is one."""
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


def support_gap(adapter: str, layers: frozenset[str], tasks: frozenset[str], info: "ModelInfo") -> str | None:
    """None when ``layers`` and ``tasks`` cover every requirement of ``info`` (``harness.neutral.models
    .requirements``); else one line naming the first one missing and where, e.g. "the pytorch adapter does not
    support residual blocks (model.layers.1)"."""
    for feature, where in requirements(info):
        if feature not in (tasks if feature in TASKS else layers):
            return f"the {adapter} adapter does not support {describe_feature(feature)} ({where})"
    return None


class DeviceUnavailable(RuntimeError):
    """The framework cannot use the requested device (a CPU-only build asked for cuda:N, an index out of range)."""


class Adapter(abc.ABC):
    """One framework behind the harness's interface. Instances live in a worker process, one trial each."""

    name: ClassVar[str]
    #: Set by the worker before ``prepare``: ``tensorflow_memory_growth`` (bool), ``memory_limit_bytes`` (int or
    #: None: the cap a GPU adapter applies through its framework's own limit; on the CPU the worker applies a process
    #: limit itself), ``precision`` ("fp32", "tf32", "bf16", "fp16") and ``compile`` (the mode: "eager" or
    #: "compiled", never "default"). Adapters read what applies to them and record it in ``settings``.
    options: dict[str, Any] = {}
    #: Layer kinds ("conv2d", "residual", ...) and layer options ("conv2d.stride", "conv2d.padding",
    #: "conv2d.no_bias", "dense.gelu", "dense.sequence", "attention.causal") this adapter builds. The default is
    #: what every adapter built before blocks existed (an adapter written then declares nothing and keeps working).
    SUPPORTED_LAYERS: ClassVar[frozenset[str]] = BASIC_LAYERS
    #: Tasks (``harness.neutral.models.TASKS``: "image_classification", "sequence_classification", "next_token")
    #: this adapter trains: what its ``load`` takes and which loss it computes.
    SUPPORTED_TASKS: ClassVar[frozenset[str]] = IMAGE_TASKS

    #: Precisions this adapter trains in (``harness.spec.Precision``) -> the device kinds ("cpu", "cuda") it can
    #: there. Default: fp32 only.
    PRECISIONS: ClassVar[dict[str, frozenset[str]]] = FP32_ONLY
    #: Execution modes ("eager", "compiled") -> what each means in this framework, in words (recorded with every
    #: trial); ``DEFAULT_COMPILE`` is the one ``compile: default`` selects (the framework's usual mode).
    COMPILE_MODES: ClassVar[dict[str, str]] = EAGER_ONLY
    DEFAULT_COMPILE: ClassVar[str] = "eager"
    #: What this adapter's attention keeps for the backward pass, for the memory prediction
    #: (``harness.neutral.memory.ATTENTIONS``): "unfused" (the softmax probabilities, heads x L x L per sample) or
    #: "fused" (a kernel that keeps a log-sum-exp per head and query and recomputes the probabilities), the same on
    #: every device kind and precision it trains in. Keep ``adapters.BUILTIN_ATTENTION`` equal to it.
    ATTENTION: ClassVar[str] = "unfused"

    def compile_mode(self, compile: str) -> str:
        """The mode ``compile`` ("default", "eager", "compiled") selects in this adapter."""
        return self.DEFAULT_COMPILE if compile == "default" else compile

    def unsupported_execution(self, precision: str, compile: str, device: str) -> str | None:
        """None when this adapter trains in ``precision`` with ``compile`` on ``device``, else the reason (from
        ``PRECISIONS``, ``COMPILE_MODES`` and ``DEFAULT_COMPILE``; ``execution_gap``). The worker calls it with
        ``unsupported``, before ``build``; ``build`` then reads ``options["precision"]`` and ``options["compile"]``
        (the mode, "default" resolved)."""
        from adapters import PRECISION_NOTES  # the registry: light, and imported before any adapter module

        return execution_gap(self.name, self.PRECISIONS, self.COMPILE_MODES, self.DEFAULT_COMPILE, precision,
                             compile, device, PRECISION_NOTES.get(self.name))

    def compilations(self) -> int | None:
        """How many graphs the framework has traced or compiled for the training step so far, by its own counter
        (TensorFlow's tf.function tracing count, the entries of JAX's jit cache, TorchDynamo's unique graphs), or
        None where the framework keeps no such counter (eager execution, MXNet). The worker reads it when warm-up
        ends and at the end of the trial: a rise between the two is a recompilation inside the timed windows."""
        return None

    def unsupported(self, info: "ModelInfo") -> str | None:
        """None when this adapter can build and train ``info``; else the reason (one line naming the first layer
        kind, option or task it lacks and where). Default: from ``SUPPORTED_LAYERS`` and ``SUPPORTED_TASKS``
        (``support_gap``). The worker calls it after ``prepare`` and before ``build``, so an adapter that lacks a
        layer on one device only may override it and look at the device it prepared."""
        return support_gap(self.name, self.SUPPORTED_LAYERS, self.SUPPORTED_TASKS, info)

    @abc.abstractmethod
    def versions(self) -> dict[str, str]:
        """Framework and runtime versions, e.g. {"torch": "2.13.0", "cuda": "13.0"}."""

    def device_problem(self, device: str) -> str | None:
        """Why the framework, as installed in this interpreter, cannot train on ``device`` ("cpu", "cuda:N"), in one
        line (e.g. "PyTorch 2.13.0+cpu sees no CUDA device (a CPU-only build)"), or None when it can. Asks the
        framework's own device query without creating a context or taking memory; the environment probe calls it
        before a run starts and ``prepare`` raises DeviceUnavailable with it. Default: None (the CPU always works)."""
        return None

    @abc.abstractmethod
    def prepare(self, device: str, threads: int | None, seed: int) -> None:
        """Selects the device ("cpu" or "cuda:N"), the CPU thread counts (intra-op ``threads``, inter-op 1; None keeps
        the framework's defaults) and the framework's RNG seed, and applies allocator settings. Called before any
        other framework op. Raises DeviceUnavailable."""

    @abc.abstractmethod
    def build(self, info: "ModelInfo", weights: dict[str, np.ndarray], optimizer: "OptimizerSpec") -> None:
        """Builds the model of ``info`` with exactly ``weights`` (canonical layout, see harness.neutral.models) and the
        optimizer. The loss is the mean softmax cross-entropy of the logits: over the samples, or for a ``next_token``
        model (``info.task``; logits (B, L, vocab), labels (B, L)) over all B x L positions. ``weights`` may also hold
        buffers (batchnorm's ``"<name>.running_mean"`` / ``"<name>.running_var"``); a buffer it lacks starts at
        ``harness.neutral.models.initial_buffers``'s value."""

    @abc.abstractmethod
    def load(self, data: "Data") -> None:
        """Places the dataset on the device once (float32 NHWC images, or int64 (N, L) token ids; int64 labels, (N,)
        or (N, L) for a next-token task); train_step gathers from it."""

    def set_train_images(self, images: np.ndarray) -> None:
        """Replaces the training images on the device in place with ``images`` (float32 NHWC, the shape ``load``
        placed), without re-tracing or re-allocating anything the train step holds: the harness calls it once per
        epoch when the trial augments its data (harness.neutral.datasets.augment). Raises NotImplementedError when the
        adapter cannot."""
        raise NotImplementedError(f"the {self.name} adapter cannot replace its training images (augmentation)")

    def stage_epoch(self, order: np.ndarray, batch_size: int) -> None:
        """The epoch's sample order (int64 (N,), ``harness.neutral.datasets.epoch_order``) and the samples per
        optimizer step, given before the epoch's first step and outside every timed window. Each ``train_step`` of
        the epoch then receives the next ``batch_size`` of it as a slice (a view of ``order``), so an adapter may
        move the epoch's index batches to the device here rather than at every step, as a hand-written loop
        prepares its batches before its clock starts. Default: nothing (``train_step`` converts its ``indices``)."""

    @abc.abstractmethod
    def train_step(self, indices: np.ndarray, micro_batches: int = 1) -> None:
        """One optimizer step on the training samples ``indices`` (int64 (B,)). With ``micro_batches`` k > 1 (gradient
        accumulation), the B samples are k consecutive micro-batches of B / k, whose gradients are accumulated (as the
        mean over all B samples) before the one optimizer step. May return before the device has finished: the
        harness calls ``wait`` at the edges of timed windows. Adds the step's loss (float32, the mean over the B
        samples; with micro-batches the mean of the k micro-batches' means) to the device-resident sum that
        ``read_loss`` reads, and counts the step; reads nothing back."""

    def read_loss(self) -> tuple[float, int]:
        """The loss read: waits until all queued device work is done and returns (the mean loss of the train_steps
        since the previous read, how many steps that is), then restarts the sum and the count; (nan, 0) when no step
        ran since. One scalar copy whatever the number of steps; the float32 sum's rounding is at most about n x 6e-8
        relative for n steps (in practice sqrt(n) x 6e-8: 2e-6 for 1000 steps). ``sync`` is the same read. Default,
        for an adapter that keeps only its last step's loss (the contract before sums): (``sync()``, 1)."""
        return self.sync(), 1

    @abc.abstractmethod
    def sync(self) -> float:
        """``read_loss``'s mean alone: waits until all queued device work is done and returns the mean loss of the
        train_steps since the previous read (after a single step, that step's loss; nan if none), restarting the sum.
        Kept for callers of the older contract, where it returned the last step's loss: read after every step, the
        two are the same."""

    def wait(self) -> None:
        """Waits until all queued device work is done, without reading anything back or restarting the loss sum:
        the edges of a timed window, after whose end the worker stops the clock and reads the loss with
        ``read_loss``. The default is ``sync`` itself (a read inside the window, which restarts the sum): an adapter
        that keeps a sum must override it."""
        self.sync()

    @abc.abstractmethod
    def evaluate(self, batch_size: int) -> tuple[float, float]:
        """Mean cross-entropy loss and accuracy (fraction in [0, 1]) on the whole test set, in inference mode,
        in batches of ``batch_size`` (the last one may be smaller); for a next-token model both are over every
        position of every test sequence. Returns only when the device is done."""

    @abc.abstractmethod
    def predict(self, images: np.ndarray) -> np.ndarray:
        """Logits, float32 (N, classes), for float32 NHWC ``images`` (or int64 (N, L) token ids: (N, classes), or
        (N, L, vocab) for a next-token model); inference mode."""

    @abc.abstractmethod
    def get_weights(self) -> dict[str, np.ndarray]:
        """The current parameters in the canonical layout and naming of ``harness.neutral.models.initial_weights``."""

    def get_buffers(self) -> dict[str, np.ndarray]:
        """The current buffers (batchnorm's running statistics) in the canonical layout and naming of
        ``harness.neutral.models.initial_buffers``. Default: none (a model without batchnorm, or an adapter without it)."""
        return {}

    def reset_memory_stats(self) -> None:
        """Restarts the allocator's peak counters (called when the measured phase begins). Default: nothing."""

    def memory_stats(self) -> dict[str, int]:
        """The framework allocator's own counters since ``reset_memory_stats``, in bytes. Keys used by the report:
        ``allocator_peak_bytes`` (peak bytes held by tensors) and ``allocator_reserved_peak_bytes`` (peak bytes the
        allocator held from the device). Absent keys mean the framework does not expose that number here."""
        return {}

    def settings(self) -> dict[str, Any]:
        """Settings that change the numbers (allocator configuration, threads actually used), for the record."""
        return {}

    @abc.abstractmethod
    def is_oom(self, exc: BaseException) -> bool:
        """True when ``exc`` is this framework's out-of-memory error (classified by exception type)."""
