"""The adapter contract: what the harness's shared training loop asks of every framework.

An adapter runs in the worker process of one trial. The harness calls, in this order: ``prepare`` (device, threads,
seed, allocator settings: before any framework op), ``build`` (the model from the canonical weights), ``load`` (the
dataset to the device, once), then ``train_step`` many times with ``sync`` at the edges of every timed window, and
``evaluate``. Timing is never done inside an adapter: the loop in ``harness.execution.worker`` times every framework with the
same code.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

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


class DeviceUnavailable(RuntimeError):
    """The framework cannot use the requested device (a CPU-only build asked for cuda:N, an index out of range)."""


class Adapter(abc.ABC):
    """One framework behind the harness's interface. Instances live in a worker process, one trial each."""

    name: ClassVar[str]
    #: Set by the worker before ``prepare``: ``tensorflow_memory_growth`` (bool), ``memory_limit_bytes`` (int or
    #: None: the cap a GPU adapter applies through its framework's own limit; on the CPU the worker applies a process
    #: limit itself). Adapters read what applies to them and record it in ``settings``.
    options: dict[str, Any] = {}

    @abc.abstractmethod
    def versions(self) -> dict[str, str]:
        """Framework and runtime versions, e.g. {"torch": "2.13.0", "cuda": "13.0"}."""

    @abc.abstractmethod
    def prepare(self, device: str, threads: int | None, seed: int) -> None:
        """Selects the device ("cpu" or "cuda:N"), the CPU thread counts (intra-op ``threads``, inter-op 1; None keeps
        the framework's defaults) and the framework's RNG seed, and applies allocator settings. Called before any
        other framework op. Raises DeviceUnavailable."""

    @abc.abstractmethod
    def build(self, info: "ModelInfo", weights: dict[str, np.ndarray], optimizer: "OptimizerSpec") -> None:
        """Builds the model of ``info`` with exactly ``weights`` (canonical layout, see harness.neutral.models) and the
        optimizer. The loss is the mean softmax cross-entropy of the logits. ``weights`` may also hold buffers
        (batchnorm's ``"<i>.running_mean"`` / ``"<i>.running_var"``); a buffer it lacks starts at
        ``harness.neutral.models.initial_buffers``'s value."""

    @abc.abstractmethod
    def load(self, data: "Data") -> None:
        """Places the dataset on the device once (float32 images, int64 labels); train_step gathers from it."""

    def set_train_images(self, images: np.ndarray) -> None:
        """Replaces the training images on the device in place with ``images`` (float32 NHWC, the shape ``load``
        placed), without re-tracing or re-allocating anything the train step holds: the harness calls it once per
        epoch when the trial augments its data (harness.neutral.datasets.augment). Raises NotImplementedError when the
        adapter cannot."""
        raise NotImplementedError(f"the {self.name} adapter cannot replace its training images (augmentation)")

    @abc.abstractmethod
    def train_step(self, indices: np.ndarray, micro_batches: int = 1) -> None:
        """One optimizer step on the training samples ``indices`` (int64 (B,)). With ``micro_batches`` k > 1 (gradient
        accumulation), the B samples are k consecutive micro-batches of B / k, whose gradients are accumulated (as the
        mean over all B samples) before the one optimizer step. May return before the device has finished: the
        harness calls ``sync`` at the edges of timed windows."""

    @abc.abstractmethod
    def sync(self) -> float:
        """Waits until all queued device work is done and returns the loss of the last train_step (nan if none)."""

    @abc.abstractmethod
    def evaluate(self, batch_size: int) -> tuple[float, float]:
        """Mean cross-entropy loss and accuracy (fraction in [0, 1]) on the whole test set, in inference mode,
        in batches of ``batch_size`` (the last one may be smaller). Returns only when the device is done."""

    @abc.abstractmethod
    def predict(self, images: np.ndarray) -> np.ndarray:
        """Logits, float32 (N, classes), for float32 NHWC ``images``; inference mode."""

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
