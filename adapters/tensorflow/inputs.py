"""TensorFlow's input: the dataset resident on the device (each step gathered inside the step's function by the indices
``batches`` staged on the device), or a ``tf.data`` pipeline reading each step through the harness's source; NHWC
float32 images or (N, L) int64 token ids, int64 labels.

A resident batch is the step's int64 (B,) index tensor; a loader's batch is (x, y) on the device. The training
mechanics (``adapters.tensorflow.training``) take either (``Inputs.arrays``: the batch itself).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import tensorflow as tf

from adapters.base import RunOptions
from adapters.tensorflow.devices import Devices
from harness.neutral.datasets import Data
from harness.neutral.inputs import InputSource
from harness.neutral.steps import EpochSteps, steps


class Inputs:
    """The trial's data on the device: the test set always; the training set resident, or a loader over the training
    samples (``options.input``). tokens: the model takes int64 token ids, not NHWC float32 images."""

    def __init__(self, options: RunOptions, devices: Devices, tokens: bool) -> None:
        self.options, self.devices, self.tokens = options, devices, tokens
        self.dtype = np.int64 if tokens else np.float32
        self.x_train: Any = None  # resident: a tf.Variable (set_train_images assigns to it); y_train likewise
        self.y_train: Any = None
        self.x_test: Any = None
        self.y_test: Any = None
        self._source: InputSource | None = None  # open_loader's
        self.loader_settings: dict[str, Any] | None = None

    def load(self, data: Data) -> None:
        """Copies the arrays to the device once, placed under ``tf.device``. The training inputs are a non-trainable
        ``tf.Variable`` so that ``set_train_images`` can overwrite images in place (``assign``) without re-tracing
        the train step; the rest are ``tf.constant``s. Data-parallel on GPUs, the training inputs are mirrored
        variables, a copy on each GPU, from which each replica gathers its shard; on the CPU there is one copy, on the
        first logical device, since the logical devices share the host's memory (TF hands a host tensor from one to
        another without copying it). With ``options.input == "loader"`` the test set only (the training batches come
        from ``open_loader``'s pipeline)."""
        strategy = self.devices.strategy
        mirrored = strategy is not None and self.devices.gpu
        if self.options.input == "resident":
            with strategy.scope() if mirrored and strategy is not None else tf.device(self.devices.device):
                self.x_train = tf.Variable(data.train_images.astype(self.dtype, copy=False), trainable=False,
                                           name="x_train")
                self.y_train = (tf.Variable(data.y_train.astype(np.int64), trainable=False, name="y_train")
                                if mirrored else tf.constant(data.y_train, dtype=tf.int64))
        with tf.device(self.devices.device):
            self.x_test = tf.constant(data.x_test, dtype=self.dtype)
            self.y_test = tf.constant(data.y_test, dtype=tf.int64)

    def set_train_images(self, images: npt.NDArray[np.float32]) -> None:
        """Overwrites the training images (float32 NHWC) in place with ``tf.Variable.assign`` (data-parallel on GPUs,
        every copy: an assignment in the cross-replica context)."""
        with self.devices.first():
            self.x_train.assign(images.astype(np.float32, copy=False))

    def open_loader(self, source: InputSource) -> None:
        """Keeps ``source`` for the ``tf.data`` pipeline that ``batches`` builds each epoch as TensorFlow's
        input-pipeline guide recommends (https://www.tensorflow.org/guide/data_performance):
        ``tf.data.Dataset.range`` over the epoch's steps, ``map`` of a function that reads one whole step
        (``harness.neutral.steps.EpochSteps``: the harness's reader, Pillow for an image folder's files) through
        ``tf.numpy_function``, giving the batch static shapes, with ``num_parallel_calls`` =
        ``options.loader.workers`` and ``deterministic=True`` (batches in order) or, with 0 workers, a sequential
        ``map`` (no ``num_parallel_calls``), then ``prefetch`` of ``options.loader.prefetch`` batches
        (https://www.tensorflow.org/api_docs/python/tf/data/Dataset#map, #prefetch). Every read runs in this process,
        on tf.data's threads: ``tf.numpy_function`` holds the GIL while its Python function runs
        (https://www.tensorflow.org/api_docs/python/tf/numpy_function), so parallel reads overlap only where numpy
        and Pillow release it, and they contend with the training loop's own Python. Records the settings
        (``Settings.loader``)."""
        workers, prefetch = self.options.loader.workers, self.options.loader.prefetch
        self._source = source
        self.loader_settings = {
            "loader": "tf.data.Dataset", "num_parallel_calls": workers or None, "prefetch": prefetch,
            "deterministic": True, "source": "files" if source.from_files else "memory",
            "read": "tf.numpy_function (the harness's reader, Pillow for files)"}

    def tensor(self, inputs: npt.NDArray[Any]) -> tf.Tensor:
        """float32 NHWC images or int64 (N, L) token ids as a constant on the first device (``Devices.first``)."""
        with self.devices.first():
            return tf.constant(np.asarray(inputs, dtype=self.dtype))

    def arrays(self, batch: Any, micro_batches: int) -> Any:
        """A batch of ``batches`` as ``Training.step`` takes it: itself (the step's function gathers a resident
        batch's micro-batches, ``Training._resident_parts``)."""
        return batch

    def batches(self, order: npt.NDArray[np.int64], samples_per_step: int, epoch: int) -> Iterator[Any]:
        """Resident: the epoch's steps (``harness.neutral.steps.steps``) moved to the device now, when called, one
        int64 (B,) tensor per step, and an iterator over them. The step's concrete function takes a tensor: called
        with a numpy array it converts it at every call (what it cost: docs/findings/2026-11-23-harness-vs-loop.md),
        so the epoch's conversions are done here, outside the timed windows of the first epoch. Loader:
        ``_loaded``, lazily (nothing is read before the first ``next``)."""
        if self._source is None:
            order = np.ascontiguousarray(order, dtype=np.int64)
            with tf.device(self.devices.device):
                return iter([tf.constant(step) for step in steps(order, samples_per_step)])
        return self._loaded(self._source, order, samples_per_step, epoch)

    def _loaded(self, source: InputSource, order: npt.NDArray[np.int64], samples_per_step: int,
                epoch: int) -> Iterator[tuple[Any, Any]]:
        """The batches of epoch ``epoch`` through ``open_loader``'s pipeline: each is (x, y), float32 (B, H, W, C)
        images or int64 (B, L) tokens and int64 (B,) or (B, L) labels, with static shapes, so that the step's
        function is traced once. On a GPU each batch is then copied to the device (``tf.identity`` under
        ``tf.device``) before the step's function is called; on the CPU the pipeline's tensors are already there.
        The pipeline is built, and its iterator started, when the epoch's first batch is asked for, as a training
        loop's ``for x, y in dataset`` starts each epoch: 5 to 30 ms on the CPU (measured with TF 2.21, mostly the
        iterator's start), counted in that step's wait for its input."""
        epoch_steps = EpochSteps(source, order, samples_per_step, epoch, tokens=self.tokens, image_dtype=self.dtype)
        x_dtype = tf.as_dtype(self.dtype)
        x_shape, y_shape = (samples_per_step, *self.x_test.shape[1:]), (samples_per_step, *self.y_test.shape[1:])

        def read(position: npt.NDArray[np.int64]) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
            return epoch_steps[int(position)]

        def read_batch(position: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            # stateful (the default): tf.data's map_parallelization optimization, on by default, would run a
            # stateless map in parallel even with 0 workers (tf.data.experimental.OptimizationOptions)
            x, y = tf.numpy_function(read, [position], (x_dtype, tf.int64), stateful=True, name="read")
            x.set_shape(x_shape)
            y.set_shape(y_shape)
            return x, y

        workers, prefetch = self.options.loader.workers, self.options.loader.prefetch
        dataset = tf.data.Dataset.range(len(epoch_steps))
        if workers:
            dataset = dataset.map(read_batch, num_parallel_calls=workers, deterministic=True)
        else:
            dataset = dataset.map(read_batch)
        for x, y in dataset.prefetch(prefetch):
            if self.devices.gpu:
                with tf.device(self.devices.device):
                    x, y = tf.identity(x), tf.identity(y)
            yield x, y
