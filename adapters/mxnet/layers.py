"""The MXNet adapter's blocks for the layers Gluon 1.9.1 has no block of its own for: the residual block, token plus
position embedding, multi-head self-attention and sequence pooling, as ``HybridBlock``s that hybridize with the rest of
the net, and the activation a layer spec names. Images are NCHW and sequences (B, L, D); every weight is held in the
canonical layout (``harness.neutral.models``), so ``params`` maps each canonical local name to its Gluon ``Parameter``
as it is. Imported by the neutral builder (``adapters.mxnet.neutral``); ``Logits`` wraps a model of your own
(``adapters.mxnet.adapter``).
"""

from __future__ import annotations

import math
from typing import Any

from adapters.mxnet.runtime import nn

# Added to the score of every key after the query under a causal mask: exp(-1e30 - max) is exactly 0 in float32, as
# exp(-inf) is (the score itself is absorbed: s - 1e30 == -1e30), without an inf that a 0 x inf would turn into nan.
_MASKED = -1e30


def activated(block: nn.HybridBlock, spec: Any) -> nn.HybridBlock:
    """``block`` followed by its spec's activation: relu, the exact gelu, or none (``block`` itself). ``nn.GELU`` is
    ``LeakyReLU(act_type='gelu')``, which in MXNet 1.9.1 is the erf form, x / 2 * (1 + erf(x / sqrt(2))), with its
    exact derivative (``gelu`` and ``gelu_grad`` in src/operator/mshadow_op.h; the API page only lists the act_type:
    https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/ndarray/ndarray.html#mxnet.ndarray.LeakyReLU).
    Measured on the CPU, on normal(0, 2) draws: within 1e-6 of the float64 erf form and 2e-7 of its derivative; the
    tanh approximation is 4.7e-4 away on [-4, 4]."""
    activation = getattr(spec, "activation", "none")
    if activation == "none":
        return block
    return sequential(block, nn.Activation("relu") if activation == "relu" else nn.GELU())


def sequential(*blocks: nn.HybridBlock) -> nn.HybridSequential:
    """A ``HybridSequential`` of ``blocks`` in order."""
    out = nn.HybridSequential()
    out.add(*blocks)
    return out


class Residual(nn.HybridBlock):
    """y = activation(body(x) + shortcut(x)) (``harness.spec.Residual``); ``shortcut`` None is the identity.
    ``body`` and ``shortcut`` are ``HybridSequential``s of the adapter's ordinary layers (the projection: a
    strided 1x1 ``nn.Conv2D`` without bias and an ``nn.BatchNorm``), so every parameter stays that layer's."""

    def __init__(self, body: nn.HybridSequential, shortcut: nn.HybridSequential | None, relu: bool, **kwargs: Any):
        super().__init__(**kwargs)
        self.body = body  # registered as children (Block.__setattr__)
        self.shortcut = shortcut
        self.relu = relu

    def hybrid_forward(self, F: Any, x: Any) -> Any:
        out = self.body(x) + (x if self.shortcut is None else self.shortcut(x))
        return F.relu(out) if self.relu else out


class Embedding(nn.HybridBlock):
    """Token plus learned position embedding (``harness.spec.Embedding``): (B, L) ids -> (B, L, D),
    ``token.weight[ids] + position.weight``. The token table is an ``nn.Embedding`` (vocab, D) (dense gradient:
    ``sparse_grad`` off; https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/gluon/nn/index.html#mxnet.gluon.
    nn.Embedding), the position table a (L, D) parameter broadcast over the batch (every input has the model's
    length L)."""

    def __init__(self, vocab: int, length: int, dim: int, **kwargs: Any):
        super().__init__(**kwargs)
        with self.name_scope():
            self.token = nn.Embedding(vocab, dim)
            self.position = self.params.get("position_weight", shape=(length, dim))

    def hybrid_forward(self, F: Any, ids: Any, position: Any) -> Any:
        return F.broadcast_add(self.token(ids), F.expand_dims(position, axis=0))


class SelfAttention(nn.HybridBlock):
    """Multi-head self-attention on (B, L, D) -> (B, L, D) in ``torch.nn.MultiheadAttention``'s arithmetic
    (``harness.spec.Attention``), its weights in the canonical layout as they are: ``in_proj`` an
    ``nn.Dense(3D, flatten=False)`` whose (3D, D) weight holds the q, k and v rows in that order, ``out_proj`` an
    ``nn.Dense(D, flatten=False)``.

    Gluon 1.9.1 has no attention block, so the heads are built from operators (https://mxnet.apache.org/versions/
    1.9.1/api/python/docs/api/ndarray/ndarray.html): q, k, v are ``slice_axis`` thirds of the projection, each
    reshaped (B, L, H, D/H) -> transposed (B, H, L, D/H) -> merged (B*H, L, D/H); scores ``batch_dot(q / sqrt(D/H),
    k, transpose_b=True)`` (B*H, L, L); with ``causal``, every key j > i of query i gets -1e30 added (``_MASKED``;
    the mask, float32, from ``contrib.arange_like`` of the scores, so it needs no state and follows any batch size;
    under fp16 AMP the float32 mask makes the masked scores and their softmax float32);
    ``softmax`` over the keys; ``batch_dot`` with v; the heads put back side by side (B, L, D) in order; the output
    projection. No dropout inside.

    Not MXNet's fused ``interleaved_matmul_selfatt_qk`` / ``_valatt`` (https://mxnet.apache.org/versions/1.9.1/api/
    python/docs/api/ndarray/contrib/index.html, where ``arange_like`` is too): they take the projections time-major,
    (L, B, 3D), with each head's q, k and v interleaved, (H, 3, D/H), where the canonical in_proj stacks all heads'
    q, then k, then v, (3, H, D/H). Using them would mean holding in_proj row-permuted (and permuting it back for
    ``get_weights``) and transposing the sequence on the way in and out; the operators above take the canonical
    layout as it is.
    """

    def __init__(self, dim: int, heads: int, causal: bool, **kwargs: Any):
        super().__init__(**kwargs)
        self.dim, self.heads, self.causal = dim, heads, causal
        self.scale = 1.0 / math.sqrt(dim // heads)
        with self.name_scope():
            self.in_proj = nn.Dense(3 * dim, in_units=dim, flatten=False)
            self.out_proj = nn.Dense(dim, in_units=dim, flatten=False)

    def _split_heads(self, F: Any, x: Any) -> Any:
        """(B, L, D) -> (B*H, L, D/H), head h of sample b at b*H + h."""
        x = F.transpose(F.reshape(x, shape=(0, 0, self.heads, -1)), axes=(0, 2, 1, 3))
        return F.reshape(x, shape=(-3, 0, 0))

    def hybrid_forward(self, F: Any, x: Any) -> Any:
        qkv = self.in_proj(x)  # (B, L, 3D)
        q, k, v = (self._split_heads(F, F.slice_axis(qkv, axis=-1, begin=i * self.dim, end=(i + 1) * self.dim))
                   for i in range(3))
        scores = F.batch_dot(q * self.scale, k, transpose_b=True)  # (B*H, L, L)
        if self.causal:
            # (L,): 0 .. L-1, float32 whatever the scores' dtype: in float16 (AMP) -1e30 would be -inf and the
            # mask's 0 x -inf a nan
            keys = F.cast(F.contrib.arange_like(scores, axis=-1), dtype="float32")
            later = F.broadcast_greater(F.reshape(keys, shape=(1, -1)), F.reshape(keys, shape=(-1, 1)))  # j > i
            scores = F.broadcast_add(scores, F.expand_dims(later * _MASKED, axis=0))
        context = F.batch_dot(F.softmax(scores, axis=-1), v)  # (B*H, L, D/H)
        context = F.transpose(F.reshape(context, shape=(-4, -1, self.heads, 0, 0)), axes=(0, 2, 1, 3))
        return self.out_proj(F.reshape(context, shape=(0, 0, -3)))  # (B, L, H, D/H) -> (B, L, D)


class SequencePool(nn.HybridBlock):
    """(B, L, D) -> (B, D): the mean over positions (``mean``) or the last position (``last``)."""

    def __init__(self, mode: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.mode = mode

    def hybrid_forward(self, F: Any, x: Any) -> Any:
        if self.mode == "mean":
            return F.mean(x, axis=1)
        return F.squeeze(F.slice_axis(x, axis=1, begin=-1, end=None), axis=1)


def params(block: nn.HybridBlock) -> dict[str, Any]:
    """A parameterised layer's Gluon parameters by canonical local name: conv and dense ``weight`` and ``bias``
    (none for a conv without bias); batchnorm and layernorm ``gamma`` as ``weight``, ``beta`` as ``bias``, and
    batchnorm's buffers ``running_mean`` / ``running_var``; an embedding's ``token.weight`` and
    ``position.weight``; attention's ``in_proj.weight`` / ``.bias`` and ``out_proj.weight`` / ``.bias``. MXNet's
    own layouts are the canonical ones (OIHW, (out, in), (C,), (vocab, D), (L, D))."""
    if isinstance(block, nn.BatchNorm):
        return {"weight": block.gamma, "bias": block.beta, "running_mean": block.running_mean,
                "running_var": block.running_var}
    if isinstance(block, nn.LayerNorm):
        return {"weight": block.gamma, "bias": block.beta}
    if isinstance(block, Embedding):
        return {"token.weight": block.token.weight, "position.weight": block.position}
    if isinstance(block, SelfAttention):
        return {"in_proj.weight": block.in_proj.weight, "in_proj.bias": block.in_proj.bias,
                "out_proj.weight": block.out_proj.weight, "out_proj.bias": block.out_proj.bias}
    return {"weight": block.weight} if block.bias is None else {"weight": block.weight, "bias": block.bias}


class Logits(nn.HybridBlock):
    """A ``HybridBlock`` of your own (``MXNetAdapter.native_model``) whose output becomes the logits the harness
    trains on: an NDArray (a Symbol while hybridized) as it is, or the first element of a tuple or list. ``block``
    is its only child, so hybridizing this hybridizes it, and its parameters keep their own names."""

    def __init__(self, block: nn.HybridBlock, **kwargs: Any):
        super().__init__(**kwargs)
        self.block = block  # registered as the child "block" (Block.__setattr__)

    def hybrid_forward(self, F: Any, x: Any) -> Any:
        out = self.block(x)
        if isinstance(out, (tuple, list)):
            if not out:
                raise TypeError("the model returned an empty tuple, not logits")
            return out[0]
        return out
