"""PyTorch's optimizers inside Keras's optimizer machinery, for any ``keras.Model`` the training mechanics train
(``adapters.keras.training``), written against Keras 3's public ``keras.optimizers.Optimizer`` subclassing contract
(``build``, ``update_step``; https://keras.io/guides/making_new_layers_and_models_via_subclassing/ and
https://keras.io/api/optimizers/) so that they run on every backend. Keras's ``Adam`` adds epsilon before the bias
correction and its ``weight_decay`` is decoupled; here weight decay is the coupled L2 term g <- g + weight_decay * p
(``harness.spec.OptimizerSpec``), and everything else is Keras's own: gradient accumulation
(``gradient_accumulation_steps``), loss scaling (``LossScaleOptimizer``), the step count ``iterations``. Imported after
KERAS_BACKEND is set (importing it imports Keras, and so the backend).
"""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops

from harness.spec import OptimizerSpec


def make(spec: OptimizerSpec, gradient_accumulation_steps: int = 1) -> Any:
    """``SGD`` or ``Adam`` with ``spec``'s settings; with ``gradient_accumulation_steps`` k > 1 Keras's own
    accumulation: the mean of k consecutive ``train_on_batch`` calls' gradients applied at every k-th."""
    extra = {"gradient_accumulation_steps": gradient_accumulation_steps} if gradient_accumulation_steps > 1 else {}
    if spec.name == "sgd":
        return SGD(spec.learning_rate, spec.momentum, spec.weight_decay, **extra)
    return Adam(spec.learning_rate, spec.beta1, spec.beta2, spec.epsilon, spec.weight_decay, **extra)


class _TorchFormOptimizer(keras.optimizers.Optimizer):
    """The shared part of ``SGD`` and ``Adam``: the coupled L2 term, and state slots as Keras's own optimizers keep
    them: a list per slot of variables made from the model's (``add_variable_from_reference``), indexed by
    ``_get_variable_index`` (what every built-in Keras optimizer's ``update_step`` uses)."""

    def __init__(self, learning_rate: float, weight_decay_l2: float, name: str, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.weight_decay_l2 = float(weight_decay_l2)

    def _slot(self, variables: list[Any], name: str) -> list[Any]:
        return [self.add_variable_from_reference(v, name=name) for v in variables]

    def _gradient(self, gradient: Any, variable: Any) -> Any:
        """The dense gradient with the L2 term. On TensorFlow an embedding's gradient is a ``tf.IndexedSlices`` of
        the rows looked up, a row once per occurrence; ``keras.ops.convert_to_tensor`` sums them into the dense
        (vocab, D) gradient (PyTorch's) through ``tf.convert_to_tensor`` (``keras.ops`` keeps the slices, and its
        ``square`` of them squares each occurrence apart, as Keras's own ``Adam`` then does on TensorFlow)."""
        if keras.backend.backend() == "tensorflow" and hasattr(gradient, "indices"):
            import tensorflow as tf

            gradient = tf.convert_to_tensor(gradient)
        g = ops.cast(gradient, variable.dtype)
        return ops.add(g, ops.multiply(variable, self.weight_decay_l2)) if self.weight_decay_l2 else g


class SGD(_TorchFormOptimizer):
    """``torch.optim.SGD`` (dampening 0, no Nesterov): v <- momentum * v + g; p <- p - lr * v, g with the coupled L2
    term; without momentum p <- p - lr * g. (Keras's ``SGD`` keeps v' = -lr v, the same for a constant rate.)"""

    def __init__(self, learning_rate: float, momentum: float = 0.0, weight_decay_l2: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(learning_rate, weight_decay_l2, name="sgd_torch_form", **kwargs)
        self.momentum = float(momentum)

    def build(self, variables: list[Any]) -> None:
        if self.built:
            return
        super().build(variables)
        self._velocities = self._slot(variables, "velocity") if self.momentum else []

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        lr = ops.cast(learning_rate, variable.dtype)
        g = self._gradient(gradient, variable)
        if self.momentum:
            v = self._velocities[self._get_variable_index(variable)]
            self.assign(v, ops.add(ops.multiply(v, self.momentum), g))
            g = v
        self.assign_sub(variable, ops.multiply(g, lr))


class Adam(_TorchFormOptimizer):
    """``torch.optim.Adam``: m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2; p <- p - lr / (1 - b1^t) * m /
    (sqrt(v) / sqrt(1 - b2^t) + eps), epsilon after the bias correction, g with the coupled L2 term; t is Keras's
    ``iterations`` + 1 (the optimizer steps, not the micro-batches, under gradient accumulation). 1 - b^t is
    computed as -expm1(t log b), exact to float32's precision (1 - 0.999 in float32 is off by 1.3e-5 of itself)."""

    def __init__(self, learning_rate: float, beta1: float, beta2: float, epsilon: float, weight_decay_l2: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(learning_rate, weight_decay_l2, name="adam_torch_form", **kwargs)
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(epsilon)

    def build(self, variables: list[Any]) -> None:
        if self.built:
            return
        super().build(variables)
        self._m, self._v = self._slot(variables, "m"), self._slot(variables, "v")

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        g = self._gradient(gradient, variable)
        t = ops.cast(self.iterations + 1, dtype)
        correction1 = -ops.expm1(t * math.log(self.beta1)) if self.beta1 else ops.cast(1.0, dtype)
        correction2 = -ops.expm1(t * math.log(self.beta2)) if self.beta2 else ops.cast(1.0, dtype)
        index = self._get_variable_index(variable)
        m, v = self._m[index], self._v[index]
        self.assign(m, ops.add(ops.multiply(m, self.beta1), ops.multiply(g, 1.0 - self.beta1)))
        self.assign(v, ops.add(ops.multiply(v, self.beta2), ops.multiply(ops.square(g), 1.0 - self.beta2)))
        denominator = ops.add(ops.divide(ops.sqrt(v), ops.sqrt(correction2)), self.eps)
        self.assign_sub(variable, ops.divide(ops.multiply(m, lr / correction1), denominator))
