"""The Keras neutral builder's own layers (``adapters.keras.neutral``), written against Keras 3's public API
(``keras.layers.Layer``, ``keras.ops``) so that they run on every backend: what the canonical model needs and Keras's
built-in layers compute differently. Imported after KERAS_BACKEND is set (importing it imports Keras, and so the
backend). The optimizers with PyTorch's formulas are ``adapters.keras.optimizers``.

- ``BatchNorm``: Keras's ``BatchNormalization`` updates its moving variance with the batch's biased variance; the
  canonical model (``harness.spec.BatchNorm``, PyTorch's convention) with the unbiased one.
- ``TokenAndPosition``: Keras 3 has no learned position embedding (KerasHub's ``PositionEmbedding`` is another
  package): ``keras.layers.Embedding`` for the tokens plus a position table.
- ``LastPosition``: the last position of a sequence (no Keras layer takes one element of an axis).
- ``exact_gelu``: Keras's GELU defaults to the tanh approximation; the canonical one is exact.
"""

from __future__ import annotations

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
