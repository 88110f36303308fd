"""The JAX adapter's layers: each canonical layer kind as a function ``(params, stats, x, train, key) -> (y, updated
stats)`` over ``jax.lax`` and ``jax.nn`` ops, NHWC for images and (B, L, D) for sequences, weights in the layouts the
neutral builder (``adapters.jax.neutral``) converts them to. Imported by that module only (it is not an adapter of its
own).

Precision (``Compute``, one per harness precision in ``POLICIES``): the layers that multiply (conv, dense, attention's
projections and its score and value products, the embedding's output) cast their input and their float32 weights to
the compute dtype at the op (``astype``) and return that dtype; batchnorm and layernorm cast their input to float32
and return float32 (their parameters and running statistics are float32); every other layer keeps the dtype it is
given. The parameters stay float32: the derivative of a cast is the cast back, so the gradients reach the float32
parameters as float32. ``astype`` is ``lax.convert_element_type``, which returns an array of the dtype asked for
unmodified (https://docs.jax.dev/en/latest/_autosummary/jax.lax.convert_element_type.html): in fp32 no cast is
emitted and the computation is exactly the one without a policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from adapters.jax.runtime import jax, jnp, lax

#: Named arrays: the parameters or the running statistics of the neutral model (canonical names, JAX's layouts).
Params = dict[str, jax.Array]
#: A layer: (parameters, running statistics, x, training, PRNG key) -> (y, the statistics it updated).
Layer = Callable[[Params, Params, jax.Array, bool, jax.Array], tuple[jax.Array, Params]]
HIGHEST, DEFAULT = lax.Precision.HIGHEST, lax.Precision.DEFAULT


class Compute(NamedTuple):
    """How the multiplying layers compute: operands cast to ``dtype`` (float32, bfloat16 or float16) and the
    ``precision`` of ``lax.conv_general_dilated`` / ``jnp.dot`` (https://docs.jax.dev/en/latest/_autosummary/
    jax.lax.Precision.html: it "only has an effect on float32 computations"; on NVIDIA GPUs DEFAULT uses TF32 for
    float32 operands where the GPU has it, HIGHEST uses float32; on the CPU it changes nothing)."""

    dtype: jnp.dtype
    precision: lax.Precision

    def cast(self, x: jax.Array) -> jax.Array:
        """``x`` in the compute dtype (the identity when it already is)."""
        return x.astype(self.dtype)


#: The harness's precisions: fp32 exactly (HIGHEST); tf32 float32 operands at DEFAULT precision (TF32 on NVIDIA
#: GPUs); bf16 and fp16 16-bit operands (DEFAULT: the precision has nothing left to choose for them).
POLICIES = {"fp32": Compute(jnp.dtype(jnp.float32), HIGHEST), "tf32": Compute(jnp.dtype(jnp.float32), DEFAULT),
            "bf16": Compute(jnp.dtype(jnp.bfloat16), DEFAULT), "fp16": Compute(jnp.dtype(jnp.float16), DEFAULT)}
FP32 = POLICIES["fp32"]


def activate(y: jax.Array, activation: str) -> jax.Array:
    """relu, the exact (erf) gelu, or nothing."""
    if activation == "relu":
        return jax.nn.relu(y)
    if activation == "gelu":
        return jax.nn.gelu(y, approximate=False)
    return y


def conv(w: str, b: str | None, stride: int, padding: str | int, activation: str, compute: Compute = FP32
         ) -> Layer:
    """NHWC (B, H, W, C) * HWIO kernel -> (B, H', W', O) in ``compute.dtype``. ``padding``: "same", "valid", or p
    zeros on every side (canonical integer padding)."""
    pad = padding.upper() if isinstance(padding, str) else [(padding, padding), (padding, padding)]

    def layer(p: Params, s: Params, x: jax.Array, train: bool, key: jax.Array) -> tuple[jax.Array, Params]:
        y = lax.conv_general_dilated(compute.cast(x), compute.cast(p[w]), (stride, stride), pad,
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=compute.precision)
        return activate(y if b is None else y + compute.cast(p[b]), activation), {}
    return layer


def dense(w: str, b: str, activation: str, compute: Compute = FP32) -> Layer:
    """On (B, F), or per position on (B, L, D): the (in, out) kernel acts on the last axis; ``compute.dtype`` out."""
    def layer(p: Params, s: Params, x: jax.Array, train: bool, key: jax.Array) -> tuple[jax.Array, Params]:
        y = jnp.dot(compute.cast(x), compute.cast(p[w]), precision=compute.precision)
        return activate(y + compute.cast(p[b]), activation), {}
    return layer


def pool(kind: str, size: int, stride: int) -> Layer:
    def layer(p: Params, s: Params, x: jax.Array, train: bool, key: jax.Array) -> tuple[jax.Array, Params]:
        window, strides = (1, size, size, 1), (1, stride, stride, 1)
        if kind == "maxpool2d":
            return lax.reduce_window(x, -jnp.inf, lax.max, window, strides, "VALID"), {}
        return lax.reduce_window(x, 0.0, lax.add, window, strides, "VALID") / (size * size), {}  # whole windows
    return layer


def batchnorm(w: str, b: str, mean: str, var: str, momentum: float, epsilon: float, flat: bool,
              sync_axis: str | None = None) -> Layer:
    """The canonical batchnorm (harness.spec.BatchNorm) over the last axis (channels of NHWC, or flat features), in
    float32: a 16-bit input is cast up, the output is float32. ``sync_axis``: the mesh axis of a data-parallel step
    (inside ``jax.shard_map``) over which the batch moments are averaged (``lax.pmean`` of the shard's mean, then of
    its mean squared deviation from that global mean: synchronised batchnorm, the moments of the global batch, its
    count for the unbiased running variance); None: the moments of the batch this device sees."""
    axes = (0,) if flat else (0, 1, 2)

    def moment(value: jax.Array) -> jax.Array:
        local = jnp.mean(value, axis=axes)
        return local if sync_axis is None else lax.pmean(local, sync_axis)

    def layer(p: Params, s: Params, x: jax.Array, train: bool, key: jax.Array) -> tuple[jax.Array, Params]:
        x = x.astype(jnp.float32)  # float32 whatever the compute dtype (statistics and output)
        if not train:
            return (x - s[mean]) / jnp.sqrt(s[var] + epsilon) * p[w] + p[b], {}
        batch_mean = moment(x)
        batch_var = moment(jnp.square(x - batch_mean))  # biased: what normalises
        n = x.size // x.shape[-1] * (1 if sync_axis is None else lax.axis_size(sync_axis))
        new = {mean: (1 - momentum) * s[mean] + momentum * lax.stop_gradient(batch_mean),
               var: (1 - momentum) * s[var] + momentum * lax.stop_gradient(batch_var) * n / max(n - 1, 1)}
        return (x - batch_mean) / jnp.sqrt(batch_var + epsilon) * p[w] + p[b], new
    return layer


def layernorm(w: str, b: str, epsilon: float) -> Layer:
    """Over the last axis with the biased variance (harness.spec.LayerNorm), in float32 (a 16-bit input is cast up);
    JAX itself has no layer-norm layer."""
    def layer(p: Params, s: Params, x: jax.Array, train: bool, key: jax.Array) -> tuple[jax.Array, Params]:
        x = x.astype(jnp.float32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * lax.rsqrt(var + epsilon) * p[w] + p[b], {}
    return layer


def embedding(token: str, position: str, compute: Compute = FP32) -> Layer:
    """(B, L) int ids -> (B, L, D): token[ids] + position[:L], summed in float32 and returned in ``compute.dtype``."""
    def layer(p: Params, s: Params, x: jax.Array, train: bool, key: jax.Array) -> tuple[jax.Array, Params]:
        return compute.cast(jnp.take(p[token], x, axis=0) + p[position][:x.shape[1]]), {}
    return layer


def attention(name: str, heads: int, causal: bool, compute: Compute = FP32) -> Layer:
    """Multi-head self-attention on (B, L, D) with the canonical (torch.nn.MultiheadAttention) weights as they are:
    the fused in-projection (3D, D) split into q, k and v, then ``jax.nn.dot_product_attention`` (its default, the
    XLA implementation: softmax(q k^T / sqrt(D / heads)) v per head; https://docs.jax.dev/en/latest/_autosummary/
    jax.nn.dot_product_attention.html) with ``is_causal``, then the output projection; (B, L, D) in
    ``compute.dtype``. With 16-bit q, k and v that implementation computes the scores with float32 results and the
    softmax in float32, and casts the probabilities to the 16-bit dtype for the value product."""
    def layer(p: Params, s: Params, x: jax.Array, train: bool, key: jax.Array) -> tuple[jax.Array, Params]:
        batch, length, dim = x.shape
        qkv = jnp.dot(compute.cast(x), compute.cast(p[f"{name}.in_proj.weight"]).T, precision=compute.precision)
        qkv = qkv + compute.cast(p[f"{name}.in_proj.bias"])
        q, k, v = (part.reshape(batch, length, heads, dim // heads) for part in jnp.split(qkv, 3, axis=-1))
        # its products follow jax_default_matmul_precision, which the adapter sets to compute.precision
        context = jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=1.0 / math.sqrt(dim // heads))
        context = context.reshape(batch, length, dim)
        out = jnp.dot(context, compute.cast(p[f"{name}.out_proj.weight"]).T, precision=compute.precision)
        return out + compute.cast(p[f"{name}.out_proj.bias"]), {}
    return layer


def sequence_pool(mode: str) -> Layer:
    def layer(p: Params, s: Params, x: jax.Array, train: bool, key: jax.Array) -> tuple[jax.Array, Params]:
        return (jnp.mean(x, axis=1) if mode == "mean" else x[:, -1]), {}
    return layer


def dropout(rate: float, index: int) -> Layer:
    def layer(p: Params, s: Params, x: jax.Array, train: bool, key: jax.Array) -> tuple[jax.Array, Params]:
        if not train or rate == 0:
            return x, {}
        keep = jax.random.bernoulli(jax.random.fold_in(key, index), 1.0 - rate, x.shape)
        return jnp.where(keep, x / (1.0 - rate), 0.0), {}
    return layer


def sequence(layers: Sequence[Layer]) -> Layer:
    """The layers one after the other, their updated statistics merged."""
    def layer(p: Params, s: Params, x: jax.Array, train: bool, key: jax.Array) -> tuple[jax.Array, Params]:
        updated: Params = {}
        for fn in layers:
            x, new = fn(p, s, x, train, key)
            updated.update(new)
        return x, updated
    return layer


def residual(body: Sequence[Layer], shortcut: Sequence[Layer], activation: str) -> Layer:
    """activation(body(x) + shortcut(x)); an empty shortcut is the identity."""
    run_body, run_shortcut = sequence(body), sequence(shortcut)

    def layer(p: Params, s: Params, x: jax.Array, train: bool, key: jax.Array) -> tuple[jax.Array, Params]:
        y, new = run_body(p, s, x, train, key)
        skip, new_shortcut = run_shortcut(p, s, x, train, key) if shortcut else (x, {})
        return activate(y + skip, activation), {**new, **new_shortcut}
    return layer


def plain(fn: Callable[[jax.Array], jax.Array]) -> Layer:
    """A layer without parameters: ``fn(x)``."""
    def layer(p: Params, s: Params, x: jax.Array, train: bool, key: jax.Array) -> tuple[jax.Array, Params]:
        return fn(x), {}
    return layer
