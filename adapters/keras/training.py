"""Keras's training mechanics, for any ``keras.Model`` whatever built it (the neutral builder's functional model, or a
user's own, e.g. ``keras.applications.MobileNetV3Small``): ``Model.compile`` with PyTorch's optimizer formulas
(``adapters.keras.optimizers``), ``jit_compile`` False or True, gradient accumulation through the optimizer's
``gradient_accumulation_steps``, fp16's ``LossScaleOptimizer``, steps through ``Model.train_on_batch`` (the public
step API a Keras user's own loop calls), the loss sum, evaluation and prediction. The dtype policy of the trial's
precision (``adapters.keras.POLICIES``) is Keras's global one, set by ``prepare`` before any model is built; the
model's outputs are logits. Imported after KERAS_BACKEND is set (importing it imports Keras).

Design: docs/design/framework-caveats.md#keras-3 (what train_on_batch costs, the optimizers of our own).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras
import numpy as np
import numpy.typing as npt

from adapters.base import RunOptions, Weights
from adapters.keras import optimizers
from adapters.keras.inputs import to_tensor
from harness.spec import OptimizerSpec

#: The micro-batches of one step: (x, y) pairs of backend tensors on the device.
Parts = Iterable[tuple[Any, Any]]


class Training:
    """One trial's training of ``model`` with ``optimizer`` in the options' precision and mode. Compiled at the first
    step (``compile``), when the micro-batches per step are known."""

    def __init__(self, model: Any, optimizer: OptimizerSpec, options: RunOptions) -> None:
        self.model, self.optimizer, self.options = model, optimizer, options
        self.compiled_for: int | None = None  # the micro-batches per step Model.compile fixed
        self._loss_sum = 0.0  # the steps' losses since the last read, on the host (train_on_batch returns them there)
        self._settings: dict[str, Any] = {}

    def compile(self, micro_batches: int) -> None:
        """``Model.compile`` with the optimizer (PyTorch's SGD or Adam with the coupled L2 term; with more than one
        micro-batch per step ``gradient_accumulation_steps`` = their number, Keras's own accumulation: the mean of
        the k micro-batches' gradients, applied at every k-th ``train_on_batch``), in fp16 wrapped in Keras's
        ``LossScaleOptimizer`` (dynamic loss scaling, Keras's defaults: what ``compile`` itself wraps around the
        optimizer of a ``mixed_float16`` model, here whatever the model's own policy), the mean sparse cross-entropy
        of the logits (over every position for a next-token model), ``jit_compile`` from the mode (XLA on JAX and
        TensorFlow, ``torch.compile`` on PyTorch), and no metrics but the loss. Once per trial: raises ValueError when
        a later step asks for other micro-batches (Keras fixes the accumulation with the optimizer; compiling again
        would restart its state)."""
        if self.compiled_for is not None:
            if micro_batches != self.compiled_for:
                raise ValueError(f"the Keras model was compiled for {self.compiled_for} micro-batch(es) per step; "
                                 "Keras fixes gradient accumulation with the optimizer")
            return
        optimizer = optimizers.make(self.optimizer, micro_batches)
        if self.options.precision == "fp16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, name="loss_scale_optimizer")
        self.model.compile(optimizer=optimizer, jit_compile=self.options.compile == "compiled",
                           loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        self.compiled_for = micro_batches
        self._settings = {"jit_compile": bool(self.model.jit_compile), "gradient_accumulation_steps": micro_batches,
                          "optimizer": type(self.model.optimizer).__name__,
                          "loss_scaling": isinstance(self.model.optimizer, keras.optimizers.LossScaleOptimizer)}

    def step(self, parts: Parts, micro_batches: int) -> None:
        """One optimizer step on its ``micro_batches`` k parts (x, y): ``train_on_batch`` on each, the optimizer
        applying their mean gradient at the k-th. ``train_on_batch`` returns the loss on the host, so every call
        waits for the device: the price of Keras's public step API (the native adapters keep the loss on the device
        and synchronise only at the edges of the timed windows). The step's loss, the mean of its micro-batches',
        is therefore summed on the host."""
        self.compile(micro_batches)
        total = 0.0
        for x, y in parts:
            total += float(self.model.train_on_batch(x, y))
        self._loss_sum += total / micro_batches

    def take_loss_sum(self) -> float:
        """The sum of the steps' losses since the last read, restarted: ``train_on_batch`` resets Keras's metrics and
        returns its batch's mean loss on the host at every call, so the sum is kept there."""
        total, self._loss_sum = self._loss_sum, 0.0
        return total

    def predict(self, inputs: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """``predict_on_batch`` (inference mode) of ``inputs`` (float32 NHWC images or integer token ids), the logits
        float32."""
        return np.asarray(self.model.predict_on_batch(to_tensor(np.asarray(inputs))), dtype=np.float32)

    def evaluate(self, x: npt.NDArray[Any], y: npt.NDArray[np.int64], batch_size: int) -> tuple[float, float]:
        """Mean cross-entropy and accuracy over (x, y) (host arrays), ``predict`` in batches of ``batch_size``; the
        loss from the float32 logits in float64 on the host, over every position for a next-token model."""
        total, correct, count = 0.0, 0, 0
        for start in range(0, len(y), batch_size):
            logits = self.predict(x[start:start + batch_size]).astype(np.float64)
            labels = y[start:start + batch_size]
            shifted = logits - logits.max(axis=-1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
            picked = np.take_along_axis(log_probs, labels[..., None].astype(np.int64), axis=-1)[..., 0]
            total -= float(picked.sum())
            correct += int((logits.argmax(axis=-1) == labels).sum())
            count += labels.size
        return total / count, correct / count

    def state(self, trained: bool) -> Weights:
        """The model's own float variables (``trainable_variables``, or the non-trainable ones: batchnorm's moving
        statistics) under their Keras paths, float32 numpy: the state of a model that is not the neutral builder's
        (whose canonical state is ``adapters.keras.neutral.NeutralModel.state``)."""
        variables = self.model.trainable_variables if trained else self.model.non_trainable_variables
        return {v.path: np.asarray(keras.ops.convert_to_numpy(v.value), np.float32)
                for v in variables if "float" in str(v.dtype)}

    def settings(self) -> dict[str, Any]:
        """What ``compile`` chose, for the record: jit_compile (as Keras kept it), the accumulation steps, the
        optimizer's class, whether the loss is scaled."""
        return dict(self._settings)
