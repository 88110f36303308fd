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
from adapters.keras.backends import Backend
from adapters.keras.inputs import to_tensor
from harness.spec import OptimizerSpec

#: The micro-batches of one step: (x, y) pairs of backend tensors on the device.
Parts = Iterable[tuple[Any, Any]]
#: The name Keras gives a ``keras.random.SeedGenerator``'s state variable (non-trainable: dropout's seeds).
_SEED_STATE = "seed_generator_state"
#: ``keras.optimizers.LossScaleOptimizer``'s default ``initial_scale``: fp16's loss scale before the first step.
INITIAL_LOSS_SCALE = 2.0 ** 15


def _squares(tensors: list[Any]) -> Any:
    """float32 (tensors,): each float32 tensor's sum of squares."""
    return keras.ops.stack([keras.ops.sum(keras.ops.square(t)) for t in tensors])


def _loss() -> Any:
    """The training loss: the mean sparse softmax cross-entropy of the logits (over every position of a next-token
    model's)."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Training:
    """One trial's training of ``model`` with ``optimizer`` in the options' precision and mode. Compiled at the first
    step (``compile``), when the micro-batches per step are known."""

    def __init__(self, model: Any, optimizer: OptimizerSpec, options: RunOptions, backend: Backend) -> None:
        self.model, self.optimizer, self.options, self.backend = model, optimizer, options, backend
        self.compiled_for: int | None = None  # the micro-batches per step Model.compile fixed
        self._loss_sum = 0.0  # the steps' losses since the last read, on the host (train_on_batch returns them there)
        self._settings: dict[str, Any] = {}
        self._loss_fn = _loss()  # the loss compile gives the model, for gradient_norms
        # gradient_norms' functions (Backend.gradient, Backend.compiled), made at its first call
        self._gradient: Any = None
        self._part: Any = None

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
        self.model.compile(optimizer=optimizer, jit_compile=self.options.compile == "compiled", loss=_loss())
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

    def gradient_norms(self, parts: Parts, micro_batches: int) -> tuple[list[float], float]:
        """Squared L2 norms of the gradients of the ``micro_batches`` k parts' mean losses, and of their mean
        (``Adapter.gradient_norms``), at the current variables; nothing the training depends on is changed.

        Written once against Keras's stateless API, as Keras's own JAX train step computes its loss: each part's
        logits from ``Model.stateless_call`` in training mode (batchnorm normalises with the part's moments, dropout
        draws), with the variables' current values as inputs, the loss ``compile`` gives the model (``_loss``) plus
        the model's own losses (``return_losses``: regularisers, ``add_loss``), in fp16 times the loss scale; its
        gradients by the backend's own mechanism (``Backend.gradient``: ``jax.grad``, ``torch.autograd.grad``,
        ``tf.GradientTape``), each part's in one function (``_part_norms``, jitted on JAX in the compiled mode). No
        variable is assigned inside it (the stateless scope keeps batchnorm's moving statistics and the seed
        generators' states as values): the non-trainable values go from one part to the next (each part's dropout
        masks its own), and afterwards only the seed generators' states are assigned (``_SEED_STATE``: the next call
        draws other masks, as the other frameworks' random state advances), never the moving statistics; the
        optimizer, its loss scale and the loss sum are not touched.

        fp16: the loss is scaled by the ``LossScaleOptimizer``'s current scale (before the first step, its initial
        one), divided out again; where a gradient overflows (a step would be skipped) the whole call is repeated at
        half the scale, down to 1, as the JAX adapter does, without changing the optimizer's. Each part's
        per-variable squared sums are float32 on the device; the host reads them once, at the end, and adds them up
        in float64.

        Args:
            parts: the k micro-batches (x, y) on the device (``Inputs.arrays``).
            micro_batches: k >= 2, the number of parts.

        Returns:
            ([|g_1|^2, ..., |g_k|^2], |G|^2), G the mean of the k gradients.
        """
        if self._part is None:
            self._gradient = self.backend.gradient(self._micro_loss)
            self._part = self.backend.compiled(self._part_norms)
        parts = list(parts)
        trainable = [v.value for v in self.model.trainable_variables]
        state = [v.value for v in self.model.non_trainable_variables]
        scale = self._loss_scale()
        while True:
            sums, after = self._squared_norms(parts, micro_batches, trainable, state, scale)
            if scale is None or scale <= 1.0 or np.isfinite(sums).all():
                break
            scale /= 2.0  # the LossScaleOptimizer's backoff
        for variable, value in zip(self.model.non_trainable_variables, after):
            if variable.name == _SEED_STATE:
                variable.assign(value)
        return [float(s) for s in sums[:-1]], float(sums[-1])

    def _squared_norms(self, parts: list[tuple[Any, Any]], micro_batches: int, trainable: list[Any],
                       state: list[Any], scale: float | None) -> tuple[npt.NDArray[np.float64], list[Any]]:
        """(float64 (k + 1,): each part's squared gradient norm and their mean's, summed over the variables in float64
        from float32 per-variable sums; the non-trainable values after the last part)."""
        ops = keras.ops
        factor = None if scale is None else ops.convert_to_tensor(scale, "float32")
        count = ops.convert_to_tensor(float(micro_batches), "float32")
        total = [ops.zeros(v.shape, "float32") for v in self.model.trainable_variables]
        rows, mean = [], None
        for x, y in parts:
            total, squares, mean, state = self._part(trainable, state, total, count, x, y, factor)
            rows.append(squares)
        rows.append(mean)  # the last part's: of the k gradients' mean
        sums = np.asarray(ops.convert_to_numpy(ops.stack(rows)), np.float64).sum(axis=1)  # the one read back
        return sums, state

    def _part_norms(self, trainable: list[Any], state: list[Any], total: list[Any], count: Any, x: Any, y: Any,
                    scale: Any) -> tuple[list[Any], Any, Any, list[Any]]:
        """One part's gradients (``_micro_loss``'s, float32, ``scale`` divided out): ``total`` plus them, their
        per-variable squared sums (float32 (variables,)), those of that sum over ``count`` (after the k-th part: of
        the mean gradient; an elementwise pass over the parameters, so that the whole call is one function per part
        size) and the non-trainable values after the part. One jitted function on JAX in the compiled mode
        (``Backend.compiled``): one compilation per micro-batch size."""
        ops = keras.ops
        grads, state = self._gradient(trainable, state, x, y, scale)
        grads = [ops.cast(g, "float32") if scale is None else ops.cast(g, "float32") / scale for g in grads]
        total = [t + g for t, g in zip(total, grads)]
        return total, _squares(grads), _squares([t / count for t in total]), state

    def _micro_loss(self, trainable: list[Any], state: list[Any], x: Any, y: Any,
                    scale: Any) -> tuple[Any, list[Any]]:
        """The loss a training step minimises on (x, y) (times ``scale`` unless None) at the values ``trainable``,
        ``state`` of the model's variables, and the non-trainable values after it: ``Model.stateless_call`` in
        training mode, nothing assigned."""
        logits, state, losses = self.model.stateless_call(trainable, state, x, training=True, return_losses=True)
        loss = self._loss_fn(y, logits)
        for extra in losses:
            loss = loss + keras.ops.cast(extra, "float32")
        return (loss if scale is None else loss * scale), list(state)

    def _loss_scale(self) -> float | None:
        """fp16's loss scale: the compiled ``LossScaleOptimizer``'s current one, before the first step its initial
        one; None in the other precisions."""
        if self.options.precision != "fp16":
            return None
        optimizer = getattr(self.model, "optimizer", None)
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
        return INITIAL_LOSS_SCALE

    def compilations(self) -> None:
        """None: Keras keeps its train function's traces behind private attributes (a jitted step inside a wrapper on
        JAX, a tf.function inside one on TensorFlow), so no recompilation is counted for its rows."""
        return None

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
