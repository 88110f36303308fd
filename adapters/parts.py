"""An adapter's two parts as contracts, and the facade that hands the contract's calls to them, written once.

Every framework's package splits its adapter by concern (docs/design/layout.md#the-adapter-contract): ``training.py``
holds a class that satisfies ``Training`` (the step, accumulation, precision, data parallelism, the loss sum,
evaluation and prediction), ``inputs.py`` one that satisfies ``Inputs`` (the data on the device, resident or through
the framework's own loader), and ``adapter.py`` a ``Facade`` subclass that makes the two (``make_parts``) and keeps
what is the framework's own: the device, threads and seed, the model sources, the state and the telemetry. A step's
batch goes from ``Inputs.batches`` through ``Inputs.arrays`` to ``Training.step``; what it is in between (an index
tensor, (x, y) micro-batches, one context's gather per device) is the framework's choice, opaque to the facade.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from adapters.base import Adapter, Batch, Model, RunOptions

if TYPE_CHECKING:
    from harness.neutral.datasets import Data
    from harness.neutral.inputs import InputSource
    from harness.spec import OptimizerSpec

__all__ = ["Arrays", "Facade", "Inputs", "Training"]

#: One step's arrays as ``Inputs.arrays`` gives them and ``Training.step`` takes them, in the framework's own form.
Arrays = Any


class Training(Protocol):
    """A framework's training mechanics for one trial's model, made at ``build`` (``Facade.make_parts``)."""

    def step(self, arrays: Arrays, micro_batches: int) -> None:
        """One optimizer step on a batch's ``arrays`` (``Inputs.arrays``), its loss added to the device-resident sum.

        Args:
            arrays: one step of B samples, as ``Inputs.arrays`` gave it.
            micro_batches: k; k > 1: gradient accumulation over k consecutive micro-batches of B / k.

        Raises:
            ValueError: k does not divide B, or k > 1 in a data-parallel trial."""

    def gradient_norms(self, arrays: Arrays, micro_batches: int) -> tuple[list[float], float]:
        """``Adapter.gradient_norms`` on a resident batch's ``arrays`` (``Inputs.arrays``), on one device.

        Returns:
            ([|g_1|^2, ..., |g_k|^2], |G|^2), float.

        Raises:
            ValueError: k does not divide B."""

    def take_loss_sum(self) -> float:
        """The loss sum of the steps since the last read, copied to the host, and the sum restarted at zero."""

    def evaluate(self, x: Any, y: Any, batch_size: int) -> tuple[float, float]:
        """Mean cross-entropy and accuracy (in [0, 1]) over the test set (``Inputs.x_test``, ``Inputs.y_test``)."""

    def predict(self, x: Any) -> npt.NDArray[np.float32]:
        """Logits, float32 (N, classes) or (N, L, vocab), of ``x`` as ``Inputs.tensor`` made it; inference mode."""

    def compilations(self) -> int | None:
        """Graphs traced or compiled for the training step so far (``Adapter.compilations``); None: no counter."""


class Inputs(Protocol):
    """A framework's input for one trial: the test set, and the training set resident or through its loader."""

    #: the test set as ``Training.evaluate`` takes it (after ``load``)
    x_test: Any
    y_test: Any
    #: the loader and its settings in the framework's own names (``Settings.loader``); None in resident mode
    loader_settings: dict[str, Any] | None

    def load(self, data: Data) -> None:
        """The test set, and in resident mode the training set, placed once (``Adapter.load``)."""

    def open_loader(self, source: InputSource) -> None:
        """The framework's own loader over ``source`` (``Adapter.open_loader``).

        Raises:
            NotImplementedError: the framework has no loader mode here."""

    def set_train_images(self, images: npt.NDArray[np.float32]) -> None:
        """The resident training images replaced in place (``Adapter.set_train_images``); float32 NHWC."""

    def batches(self, order: npt.NDArray[np.int64], samples_per_step: int, epoch: int) -> Iterator[Batch]:
        """The batches of an epoch, one per optimizer step (``Adapter.batches``)."""

    def arrays(self, batch: Batch, micro_batches: int) -> Arrays:
        """What ``Training.step`` takes for a batch of ``batches`` split into ``micro_batches``.

        Raises:
            ValueError: ``micro_batches`` (or a data-parallel trial's devices) does not divide the batch."""

    def tensor(self, inputs: npt.NDArray[Any]) -> Any:
        """Host inputs (float32 NHWC images, integer (N, L) token ids) as ``Training.predict`` takes them."""


TrainingT = TypeVar("TrainingT", bound=Training)
InputsT = TypeVar("InputsT", bound=Inputs)


class Facade(Adapter, Generic[TrainingT, InputsT]):
    """An adapter made of a ``Training`` and an ``Inputs``: the contract's calls that belong to one of them handed to
    it, once for every framework. A subclass makes its parts (``make_parts``) and implements the rest of the
    contract; it overrides a delegation only where its framework adds to it."""

    def __init__(self, options: RunOptions | None = None) -> None:
        super().__init__(options)
        self._training: TrainingT | None = None
        self._inputs: InputsT | None = None

    @property
    def training(self) -> TrainingT:
        """The training part. Raises RuntimeError before ``build``."""
        if self._training is None:
            raise RuntimeError("the model is not built yet (build)")
        return self._training

    @property
    def inputs(self) -> InputsT:
        """The input part. Raises RuntimeError before ``build``."""
        if self._inputs is None:
            raise RuntimeError("the model is not built yet (build)")
        return self._inputs

    @abc.abstractmethod
    def make_parts(self, model: Model, task: str, optimizer: OptimizerSpec) -> tuple[TrainingT, InputsT]:
        """The trial's training of ``model`` and its input, for ``build`` (whose arguments these are).

        Raises:
            TypeError: ``model`` is not the framework's model object."""

    def build(self, model: Model, task: str, optimizer: OptimizerSpec) -> None:
        """``make_parts``: ``model`` trained through the framework's ``Training``, its data through its ``Inputs``."""
        self._training, self._inputs = self.make_parts(model, task, optimizer)

    def load(self, data: Data) -> None:
        self.inputs.load(data)

    def open_loader(self, source: InputSource) -> None:
        self.inputs.open_loader(source)

    def set_train_images(self, images: npt.NDArray[np.float32]) -> None:
        self.inputs.set_train_images(images)

    def batches(self, order: npt.NDArray[np.int64], samples_per_step: int, epoch: int) -> Iterator[Batch]:
        return self.inputs.batches(order, samples_per_step, epoch)

    def train_step(self, batch: Batch, micro_batches: int = 1) -> None:
        """``Training.step`` on the batch's arrays (``Inputs.arrays``), counted for ``read_loss``."""
        self.training.step(self.inputs.arrays(batch, micro_batches), micro_batches)
        self._loss_steps += 1

    def gradient_norms(self, batch: Batch, micro_batches: int) -> tuple[list[float], float]:
        """``Training.gradient_norms`` on the batch's arrays (``Inputs.arrays``), split as ``train_step`` splits them;
        an adapter whose declaration has no ``gradient_noise`` measures none (``Adapter.gradient_norms``).

        Raises:
            ValueError: a data-parallel trial or a loader's batch (one device, resident input only), fewer than 2
                micro-batches, or ones that do not divide the batch."""
        if not self.declaration.capabilities.gradient_noise:
            return super().gradient_norms(batch, micro_batches)
        if self.options.data_parallel is not None:
            raise ValueError("gradient norms are measured on one device")
        if self.options.input != "resident":
            raise ValueError("gradient norms are measured on resident batches (input: resident), not a loader's")
        if micro_batches < 2:
            raise ValueError(f"gradient norms need at least 2 micro-batches, not {micro_batches}")
        return self.training.gradient_norms(self.inputs.arrays(batch, micro_batches), micro_batches)

    def _take_loss_sum(self) -> float:
        return self.training.take_loss_sum()

    def evaluate(self, batch_size: int) -> tuple[float, float]:
        return self.training.evaluate(self.inputs.x_test, self.inputs.y_test, batch_size)

    def predict(self, inputs: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        return self.training.predict(self.inputs.tensor(inputs))

    def compilations(self) -> int | None:
        """``Training.compilations``; None before ``build``."""
        return None if self._training is None else self._training.compilations()

    def loader_settings(self) -> dict[str, Any] | None:
        """``Inputs.loader_settings`` for ``Settings.loader``; None before ``build``."""
        return None if self._inputs is None else self._inputs.loader_settings
