"""Keras's input: the training set resident on the device as backend tensors (``keras.ops.convert_to_tensor``), each
step's micro-batches gathered there with ``keras.ops.take``, as the native adapters gather theirs; images NHWC (the
harness's own layout), token ids int32. The test set stays on the host (``Training.evaluate`` converts each batch).
Keras has no loader mode here (its declaration has no ``loader``: the plan refuses ``input: loader``). Imported after
KERAS_BACKEND is set (importing it imports Keras).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import numpy.typing as npt

from adapters.base import micro_batch_size
from harness.neutral.datasets import Data
from harness.neutral.inputs import InputSource
from harness.neutral.steps import steps


def to_tensor(array: npt.NDArray[Any]) -> Any:
    """``array`` as a backend tensor on the device; integers as int32 (JAX's default integers, with x64 off: the same
    on every backend)."""
    if array.dtype.kind in "iu":
        array = array.astype(np.int32)
    return keras.ops.convert_to_tensor(array)


class Inputs:
    """The trial's data: the training set on the device (``load``), the test set on the host."""

    def __init__(self) -> None:
        self.x_train: Any = None
        self.y_train: Any = None
        self.x_test: npt.NDArray[Any] = np.zeros(0, np.float32)
        self.y_test: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.loader_settings: dict[str, Any] | None = None  # resident only

    def load(self, data: Data) -> None:
        """Float32 NHWC images (or int32 (N, L) token ids) and int32 labels as backend tensors on the device."""
        self.x_train, self.y_train = to_tensor(data.train_images), to_tensor(data.y_train)
        self.x_test, self.y_test = data.x_test, data.y_test

    def set_train_images(self, images: npt.NDArray[np.float32]) -> None:
        """``images`` (float32 NHWC) as the training images from the next step on: a new tensor in place of the old
        one, which nothing compiled holds (each step's batch is gathered outside ``train_on_batch``)."""
        self.x_train = to_tensor(np.asarray(images, np.float32))

    def open_loader(self, source: InputSource) -> None:
        """Raises NotImplementedError: Keras has no data loader mode here."""
        raise NotImplementedError("the Keras adapters have no data loader mode")

    def tensor(self, inputs: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """``inputs`` on the host, as ``Training.predict`` takes them (it converts them batch by batch)."""
        return np.asarray(inputs)

    def batches(self, order: npt.NDArray[np.int64], samples_per_step: int, epoch: int) -> Iterator[Any]:
        """The epoch's steps (``harness.neutral.steps.steps``) as int32 index tensors on the device, staged now: the
        whole steps' indices converted in one copy, then sliced per step."""
        count = len(steps(order, samples_per_step))
        if not count:
            return iter([])
        staged = to_tensor(np.asarray(order[:count * samples_per_step], np.int64))
        return iter([staged[p * samples_per_step:(p + 1) * samples_per_step] for p in range(count)])

    def arrays(self, batch: Any, micro_batches: int) -> Iterator[tuple[Any, Any]]:
        """The step's ``micro_batches`` consecutive micro-batches as (x, y), each gathered (``keras.ops.take``) as it
        is trained on. Raises ValueError when ``micro_batches`` does not divide the batch."""
        size = micro_batch_size(int(batch.shape[0]), micro_batches)
        pieces = [batch] if micro_batches == 1 else [batch[i * size:(i + 1) * size] for i in range(micro_batches)]
        take = keras.ops.take
        return ((take(self.x_train, part, axis=0), take(self.y_train, part, axis=0)) for part in pieces)
