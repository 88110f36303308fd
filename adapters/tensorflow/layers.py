"""The TensorFlow adapter's layers, what its neutral builder (``adapters.tensorflow.neutral``) assembles: each canonical
layer kind as a function ``(x, training) -> y`` over ``tf.nn`` ops and the builder's ``tf.Variable``s, NHWC for images
and (B, L, D) for sequences, weights in the layouts the builder converts them to. Layer normalisation and attention,
which ``tf.nn`` has no op for, are Keras's own layers (``layer_norm``, ``multi_head_attention``). Mixed precision:
``tf.cast`` at the op (``to``) to the precision's compute dtype (``COMPUTE``), and ``KERAS_POLICY`` for the Keras
layers.

Design: docs/design/framework-caveats.md#tensorflow (why Keras's layers, the mixed-precision policy layer by layer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import numpy.typing as npt
import tensorflow as tf

Layer = Callable[[tf.Tensor, bool], tf.Tensor]  # (x, training) -> y
#: Where a canonical parameter lives in TensorFlow: the variables holding it and the function that assembles the
#: canonical array from their values (the inverse of the conversion that filled them).
Held = tuple[tuple[tf.Variable, ...], Callable[..., npt.NDArray[Any]]]
#: The compute dtype of each precision (tf32 is float32 with TF32 matmuls and convolutions on a GPU).
COMPUTE = {"fp32": tf.float32, "tf32": tf.float32, "bf16": tf.bfloat16, "fp16": tf.float16}


def same(value: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """The identity: the inverse of a layout conversion that changed nothing."""
    return value


def to(x: tf.Tensor | tf.Variable, dtype: tf.DType) -> tf.Tensor | tf.Variable:
    """``x`` cast to ``dtype`` (https://www.tensorflow.org/api_docs/python/tf/cast), or ``x`` itself, no op added,
    when it already has that dtype (a float32 variable in fp32: the graph is the one without mixed precision)."""
    return x if x.dtype == dtype else tf.cast(x, dtype)


#: The Keras dtype policy (https://keras.io/api/mixed_precision/policy/) of each compute dtype: float32 variables
#: throughout, the computation in the compute dtype.
KERAS_POLICY = {tf.float32: "float32", tf.bfloat16: "mixed_bfloat16", tf.float16: "mixed_float16"}


def activate(y: tf.Tensor, activation: str) -> tf.Tensor:
    """relu, the exact (erf) gelu (https://www.tensorflow.org/api_docs/python/tf/nn/gelu, ``approximate=False``), or
    nothing."""
    if activation == "relu":
        return tf.nn.relu(y)
    if activation == "gelu":
        return tf.nn.gelu(y, approximate=False)
    return y


def conv(kernel: tf.Variable, bias: tf.Variable | None, stride: int, padding: str | int, activation: str,
         compute: tf.DType = tf.float32) -> Layer:
    """``tf.nn.conv2d`` on NHWC with an HWIO kernel (https://www.tensorflow.org/api_docs/python/tf/nn/conv2d), in
    ``compute`` (input, kernel and bias cast to it; the output (N, H', W', O) in it).
    ``padding``: "same" (stride 1 only: TF's "SAME" pads an odd kernel by k // 2 on every side then, as the canonical
    model does), "valid", or p zeros on every side as an explicit padding list [[0, 0], [p, p], [p, p], [0, 0]] (never
    "SAME" with a stride: TF then pads more at the bottom and right than at the top and left)."""
    pad = padding.upper() if isinstance(padding, str) else [[0, 0], [padding, padding], [padding, padding], [0, 0]]

    def fn(x: tf.Tensor, training: bool) -> tf.Tensor:
        y = tf.nn.conv2d(to(x, compute), to(kernel, compute), strides=stride, padding=pad, data_format="NHWC")
        return activate(y if bias is None else tf.nn.bias_add(y, to(bias, compute)), activation)
    return fn


def dense(kernel: tf.Variable, bias: tf.Variable, activation: str, compute: tf.DType = tf.float32) -> Layer:
    """x (B, F) @ kernel (F, units) + bias; on a sequence (B, L, D) per position, as one (B L, D) @ (D, units) matrix
    product (what ``torch.nn.Linear`` computes too). In ``compute``: x, kernel and bias cast to it, the output in
    it."""
    def fn(x: tf.Tensor, training: bool) -> tf.Tensor:
        x, kernel_c, bias_c = to(x, compute), to(kernel, compute), to(bias, compute)
        if x.shape.rank == 3:
            length, width = x.shape[1], x.shape[2]
            y = tf.nn.bias_add(tf.matmul(tf.reshape(x, (-1, width)), kernel_c), bias_c)
            return activate(tf.reshape(y, (-1, length, kernel.shape[1])), activation)
        return activate(tf.nn.bias_add(tf.matmul(x, kernel_c), bias_c), activation)
    return fn


def pool(op: Callable[..., tf.Tensor], size: int, stride: int) -> Layer:
    """VALID: no padding, every window whole (so an average is always over size^2 values, as in the other
    frameworks)."""
    return lambda x, training: op(x, ksize=size, strides=stride, padding="VALID", data_format="NHWC")


def dropout(rate: float) -> Layer:
    """``tf.nn.dropout``: inverted dropout (kept values scaled by 1 / (1 - rate)), drawn from TF's seeded
    generator; the identity in inference."""
    return lambda x, training: tf.nn.dropout(x, rate=rate) if training and rate > 0 else x


def flatten(features: int, channels_first: bool) -> Layer:
    """(N, H, W, C) -> (N, features) in TF's own (H, W, C) order, or, with ``channels_first``, transposed to (N, C,
    H, W) first: the canonical order, for a flatten whose features reach no dense layer that could absorb the order
    in its rows (``neutral.Builder.visit_flatten``). A (B, L, D) sequence flattens position-major, the canonical
    order."""
    if channels_first:
        return lambda x, training: tf.reshape(tf.transpose(x, (0, 3, 1, 2)), (-1, features))
    return lambda x, training: tf.reshape(x, (-1, features))


def batchnorm(gamma: tf.Variable, beta: tf.Variable, mean: tf.Variable, var: tf.Variable, momentum: float,
              epsilon: float, flat: bool, compute: tf.DType = tf.float32, sync: bool = False) -> Layer:
    """Batchnorm on NHWC (channels last) with ``FusedBatchNormV3`` (https://www.tensorflow.org/api_docs/python/tf/
    raw_ops/FusedBatchNormV3), the kernel behind Keras's fused batchnorm and cuDNN's on a GPU. A flat (N, F) input is
    run as (N, 1, 1, F).

    Training: the batch is normalised with its mean and biased variance, and with ``exponential_avg_factor`` =
    momentum the op returns (1 - momentum) * running + momentum * batch statistic, the batch variance being the
    unbiased one (TF applies Bessel's correction to the variance it returns, as cuDNN does): the canonical update
    (``harness.spec.BatchNorm``), assigned back to the running variables. Inference: the running statistics. Always
    in float32 (a ``compute`` input is cast up, the output back to ``compute``).

    Under ``tf.distribute.MirroredStrategy`` (the adapter's data parallelism) the layer runs in each replica on its
    own shard, so the batch statistics are the shard's, and the assignments go to the replica's own copy of the
    running statistics (the neutral builder makes them sync-on-read variables). ``sync``: in a replica context with
    more than one replica, the statistics are the global batch's instead (``sync_moments``) and the layer is
    ``tf.nn.batch_normalization`` with them, the running statistics updated with the same canonical formula."""
    def fn(x: tf.Tensor, training: bool) -> tf.Tensor:
        features = x.shape[-1]
        x = to(x, tf.float32)
        x4 = tf.reshape(x, (-1, 1, 1, features)) if flat else x
        common = {"x": x4, "scale": gamma, "offset": beta, "mean": mean, "variance": var, "epsilon": epsilon,
                  "data_format": "NHWC"}
        replica = tf.distribute.get_replica_context() if sync and training else None
        if replica is not None and replica.num_replicas_in_sync > 1:
            batch_mean, batch_var, count = sync_moments(x4, replica)
            y = tf.nn.batch_normalization(x4, batch_mean, batch_var, beta, gamma, epsilon)
            mean.assign((1.0 - momentum) * mean + momentum * batch_mean)
            var.assign((1.0 - momentum) * var + momentum * batch_var * (count / (count - 1.0)))
        elif training:
            y, new_mean, new_var, *_ = tf.raw_ops.FusedBatchNormV3(exponential_avg_factor=momentum, is_training=True,
                                                                    **common)
            mean.assign(new_mean)
            var.assign(new_var)
        else:
            y = tf.raw_ops.FusedBatchNormV3(is_training=False, **common)[0]
        return to(tf.reshape(y, (-1, features)) if flat else y, compute)
    return fn


def sync_moments(x: tf.Tensor, replica: tf.distribute.ReplicaContext) -> tuple[tf.Tensor, tf.Tensor, float]:
    """The per-channel mean and biased variance of the global batch, every replica's NHWC shard ``x`` together, and
    the global count of values per channel (static: the replicas' shards are equal): two passes, each a sum
    all-reduced over the replicas (``ReplicaContext.all_reduce``, https://www.tensorflow.org/api_docs/python/tf/
    distribute/ReplicaContext#all_reduce, whose gradient is the all-reduce of the incoming gradients, so the backward
    pass is the global batch's too): the sum of x, then the sum of squared deviations from the global mean (not E[x^2]
    - E[x]^2, which loses digits when the mean is large against the spread). What Keras's ``BatchNormalization(
    synchronized=True)`` does on the TF backend (``keras.src.backend.tensorflow.nn``), in its two-pass form."""
    count = float(x.shape[0] * x.shape[1] * x.shape[2] * replica.num_replicas_in_sync)
    total = replica.all_reduce(tf.distribute.ReduceOp.SUM, tf.reduce_sum(x, axis=(0, 1, 2)))
    batch_mean = total / count
    squares = replica.all_reduce(tf.distribute.ReduceOp.SUM, tf.reduce_sum(tf.square(x - batch_mean), axis=(0, 1, 2)))
    return batch_mean, squares / count, count


def layer_norm(shape: tuple[int, ...], epsilon: float, weight: npt.NDArray[Any], bias: npt.NDArray[Any],
               compute: tf.DType = tf.float32) -> tuple[Layer, dict[str, Held]]:
    """``keras.layers.LayerNormalization(axis=-1, epsilon)`` over the last axis of (B, F) or (B, L, D): (x - mean) /
    sqrt(biased var + epsilon) * gamma + beta (https://keras.io/api/layers/normalization_layers/layer_normalization/),
    gamma and beta (D,) the canonical "weight" and "bias" as they are. ``shape``: the per-sample input shape. Returns
    the layer and where "weight" and "bias" are held. Its dtype policy is ``KERAS_POLICY[compute]``: float32
    variables, the normalisation in float32, the output in ``compute``."""
    norm = keras.layers.LayerNormalization(axis=-1, epsilon=epsilon, dtype=KERAS_POLICY[compute])
    norm.build((None, *shape))
    norm.gamma.assign(weight)
    norm.beta.assign(bias)
    return (lambda x, training: norm(x)), {"weight": ((norm.gamma.value,), same), "bias": ((norm.beta.value,), same)}


def embedding(token: tf.Variable, position: tf.Variable, compute: tf.DType = tf.float32) -> Layer:
    """(B, L) int64 ids -> (B, L, D) in ``compute``: ``tf.nn.embedding_lookup`` of the token table (vocab, D)
    (https://www.tensorflow.org/api_docs/python/tf/nn/embedding_lookup) plus the position table (L, D), in float32,
    then cast. Its gradient is ``tf.IndexedSlices``, which the train step makes dense
    (``optimizer.dense_gradients``)."""
    return lambda x, training: to(tf.nn.embedding_lookup(token, x) + position, compute)


def multi_head_attention(length: int, dim: int, heads: int, causal: bool, weights: dict[str, npt.NDArray[Any]],
                         compute: tf.DType = tf.float32) -> tuple[Layer, dict[str, Held]]:
    """Self-attention on (B, L, D) as ``keras.layers.MultiHeadAttention(heads, key_dim=D / heads)`` called as
    ``mha(x, x, use_causal_mask=causal)`` (https://keras.io/api/layers/attention_layers/multi_head_attention/; with
    no dropout and no attention scores asked for, Keras 3 computes it with ``keras.ops.dot_product_attention``:
    softmax(q k^T / sqrt(D / heads)) v, the causal mask through ``tf.where``), which is
    ``torch.nn.MultiheadAttention``'s arithmetic.

    Layouts. ``weights``: the canonical local names ("in_proj.weight" (3D, D): the q, k, v rows; "in_proj.bias"
    (3D,); "out_proj.weight" (D, D); "out_proj.bias" (D,)). Keras's query, key and value kernels are (D, heads,
    D / heads) (``EinsumDense`` "abc,cde->abde": head h takes columns h D / heads onwards of x W^T, the canonical
    split), so each is W.T reshaped, and its biases (heads, D / heads); its output kernel is (heads, D / heads, D),
    W_out.T reshaped, its bias (D,). Returns the layer and where each canonical parameter is held: "in_proj.weight"
    in three Keras variables, assembled back by concatenating the rows.

    Its dtype policy is ``KERAS_POLICY[compute]``: float32 variables; the projections and the score and value
    products in ``compute``, the softmax in float32 (Keras's TF ``dot_product_attention`` always takes it in at least
    float32); the output (B, L, D) in ``compute``."""
    head_dim = dim // heads
    mha = keras.layers.MultiHeadAttention(heads, head_dim, dtype=KERAS_POLICY[compute])
    mha.build((None, length, dim), (None, length, dim))
    projections = (mha._query_dense, mha._key_dense, mha._value_dense)  # Keras's own attributes (no public access)
    for dense_layer, w, b in zip(projections, np.split(weights["in_proj.weight"], 3),
                                 np.split(weights["in_proj.bias"], 3)):
        dense_layer.kernel.assign(w.T.reshape(dim, heads, head_dim))
        dense_layer.bias.assign(b.reshape(heads, head_dim))
    mha._output_dense.kernel.assign(weights["out_proj.weight"].T.reshape(heads, head_dim, dim))
    mha._output_dense.bias.assign(weights["out_proj.bias"])

    def in_weight(*kernels: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return np.concatenate([k.reshape(dim, dim).T for k in kernels])

    def in_bias(*biases: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return np.concatenate([b.reshape(dim) for b in biases])

    held = {"in_proj.weight": (tuple(d.kernel.value for d in projections), in_weight),
            "in_proj.bias": (tuple(d.bias.value for d in projections), in_bias),
            "out_proj.weight": ((mha._output_dense.kernel.value,), lambda k: k.reshape(dim, dim).T),
            "out_proj.bias": ((mha._output_dense.bias.value,), same)}
    return (lambda x, training: mha(x, x, use_causal_mask=causal, training=training)), held


def sequence_pool(mode: str) -> Layer:
    """(B, L, D) -> (B, D): the mean over positions, or the last position."""
    if mode == "mean":
        return lambda x, training: tf.reduce_mean(x, axis=1)
    return lambda x, training: x[:, -1]


def residual(body: Sequence[Layer], shortcut: Sequence[Layer], activation: str) -> Layer:
    """activation(body(x) + shortcut(x)); an empty shortcut is the identity. Two sides of different dtypes (mixed
    precision: one side went through a layer with parameters, the other did not) are added in float32."""
    def fn(x: tf.Tensor, training: bool) -> tf.Tensor:
        y = skip = x
        for layer in body:
            y = layer(y, training)
        for layer in shortcut:
            skip = layer(skip, training)
        if y.dtype != skip.dtype:
            y, skip = to(y, tf.float32), to(skip, tf.float32)
        return activate(y + skip, activation)
    return fn

