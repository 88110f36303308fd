"""The Keras adapter's own layers and optimizers, written against Keras 3's public API (``keras.layers.Layer``,
``keras.ops``, ``keras.optimizers.Optimizer``) so that they run on every backend: what the canonical model needs and
Keras's built-in classes compute differently. Imported by ``adapters.keras.adapter`` only, after KERAS_BACKEND is
set (importing it imports Keras, and so the backend).

- ``BatchNorm``: Keras's ``BatchNormalization`` updates its moving variance with the batch's biased variance; the
  canonical model (``harness.spec.BatchNorm``, PyTorch's convention) with the unbiased one.
- ``TokenAndPosition``: Keras 3 has no learned position embedding (KerasHub's ``PositionEmbedding`` is another
  package): ``keras.layers.Embedding`` for the tokens plus a position table.
- ``LastPosition``: the last position of a sequence (no Keras layer takes one element of an axis).
- ``SGD`` and ``Adam``: PyTorch's update formulas (``harness.spec.OptimizerSpec``): Keras's ``Adam`` adds epsilon
  before the bias correction and its ``weight_decay`` is decoupled; here weight decay is the coupled L2 term
  g <- g + weight_decay * p, inside Keras's own optimizer machinery (gradient accumulation, loss scaling,
  ``iterations``), as https://keras.io/guides/making_new_layers_and_models_via_subclassing/ and the ``Optimizer``
  subclassing contract (``build``, ``update_step``) describe.
"""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops


def exact_gelu(x: Any) -> Any:
    """The exact (erf) GELU: ``keras.activations.gelu(x, approximate=False)`` (Keras's default is the tanh
    approximation, https://keras.io/api/layers/activations/#gelu-function)."""
    return keras.activations.gelu(x, approximate=False)


class BatchNorm(keras.layers.Layer):
    """Batch normalisation over the last axis of (N, H, W, C) or (N, F), in float32 whatever the dtype policy (as
    Keras's ``BatchNormalization`` computes it under a mixed policy), the output in the policy's compute dtype.

    Training: the batch's mean and biased variance (two passes: the mean, then the mean of the squared deviations)
    normalise it, and the moving statistics become (1 - momentum) * moving + momentum * batch statistic, the batch
    variance the unbiased one (x n / (n - 1), n the values per channel): the canonical update. Inference: the moving
    statistics. Variables ``gamma``, ``beta`` (trainable) and ``moving_mean``, ``moving_variance`` (not), (C,)."""

    def __init__(self, momentum: float, epsilon: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum, self.epsilon = float(momentum), float(epsilon)

    def build(self, input_shape: Any) -> None:
        features = (int(input_shape[-1]),)
        self.gamma = self.add_weight(shape=features, initializer="ones", name="gamma")
        self.beta = self.add_weight(shape=features, initializer="zeros", name="beta")
        self.moving_mean = self.add_weight(shape=features, initializer="zeros", name="moving_mean", trainable=False)
        self.moving_variance = self.add_weight(shape=features, initializer="ones", name="moving_variance",
                                               trainable=False)

    def call(self, x: Any, training: bool = False) -> Any:
        x = ops.cast(x, "float32")
        axes = tuple(range(len(x.shape) - 1))
        if training:
            mean = ops.mean(x, axis=axes)
            variance = ops.mean(ops.square(x - mean), axis=axes)
            count = ops.cast(ops.size(x), "float32") / float(x.shape[-1])
            m = self.momentum
            self.moving_mean.assign((1.0 - m) * self.moving_mean + m * mean)
            self.moving_variance.assign((1.0 - m) * self.moving_variance + m * variance * count / (count - 1.0))
        else:
            mean, variance = self.moving_mean, self.moving_variance
        y = (x - mean) * ops.rsqrt(variance + self.epsilon) * self.gamma + self.beta
        return ops.cast(y, self.compute_dtype)


class TokenAndPosition(keras.layers.Layer):
    """(B, L) integer ids -> (B, L, D): ``keras.layers.Embedding(vocab, D)`` of the tokens plus a learned (L, D)
    position table, added in float32 (the embedding kept in float32 under a mixed policy), then cast to the
    compute dtype. Variables: ``token.embeddings`` (vocab, D) and ``position`` (L, D)."""

    def __init__(self, vocab: int, length: int, dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.length, self.dim = int(length), int(dim)
        self.token = keras.layers.Embedding(vocab, dim, dtype="float32", embeddings_initializer="zeros", name="token")

    def build(self, input_shape: Any) -> None:
        self.token.build(input_shape)
        self.position = self.add_weight(shape=(self.length, self.dim), initializer="zeros", name="position")

    def call(self, ids: Any) -> Any:
        return ops.cast(self.token(ids) + ops.cast(self.position, "float32"), self.compute_dtype)


class LastPosition(keras.layers.Layer):
    """(B, L, D) -> (B, D): the last position."""

    def call(self, x: Any) -> Any:
        return x[:, -1]


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
