"""Keras's neutral builder: the canonical layers and blocks as a functional ``keras.Model`` of ``keras.layers`` (and
``adapters.keras.layers`` where Keras's own compute something else), NHWC for images, (B, L, D) for sequences, holding
the canonical weights converted to Keras's layouts; the result (``NeutralModel``) gives them back in the canonical
layout and names. Imported after KERAS_BACKEND is set (importing it imports Keras).

The layouts are TensorFlow's: conv kernels HWIO from OIHW, dense kernels (in, out) from (out, in), the rows of a dense
layer after a flatten of (C, H, W) permuted to the (H, W, C) order Keras flattens in (and the features of a batchnorm
between the two the same way; the data is never permuted), attention's fused (3D, D) in-projection split into
``MultiHeadAttention``'s query, key and value kernels (D, heads, D / heads), found by their variable paths.

Design: docs/design/canonical-layout.md (names and layouts), docs/design/framework-caveats.md#keras-3.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import numpy.typing as npt

from adapters.base import Weights
from adapters.keras import layers as KL
from harness.neutral.info import LayerInfo, ModelInfo
from harness.neutral.models import chw_to_hwc_permutation, flatten_feeds_dense, initial_buffers
from harness.neutral.visitor import LayerVisitor

#: The (C, H, W) shape the next dense layer's input was flattened from in (H, W, C) order, or None.
Flat = tuple[int, int, int] | None
#: What a visit returns: the layer's symbolic output and the ``Flat`` the layers after it see.
Built = tuple[Any, Flat]
#: Keras's variables of one canonical tensor, the function of their values that gives the canonical array, and
#: whether it is a trained parameter (else a buffer).
Held = tuple[tuple[Any, ...], Callable[..., npt.NDArray[np.float32]], bool]


class NeutralModel:
    """A neutral model as Keras holds it: ``model`` (the functional ``keras.Model``) and, per canonical name, where its
    values live (``Held``)."""

    def __init__(self, model: Any, tensors: dict[str, Held]) -> None:
        self.model, self.tensors = model, tensors

    def state(self, trained: bool) -> Weights:
        """The parameters (``trained``) or the buffers, as float32 numpy arrays in the canonical layout and names, in
        the canonical order."""
        numpy = keras.ops.convert_to_numpy
        return {name: np.asarray(back(*(numpy(v.value) for v in variables)), np.float32)
                for name, (variables, back, is_trained) in self.tensors.items() if is_trained == trained}


class Builder(LayerVisitor):
    """Builds a ``NeutralModel`` (``build``); a ``visit_<kind>(layer, x, flat, following)`` per layer kind
    (``harness.neutral.visitor``), which applies the layer to the symbolic tensor ``x`` and sets its variables from
    the canonical weights. ``adapter``: the adapter's name (for ``UnknownLayer``); ``seed``: dropout's seeds."""

    def __init__(self, adapter: str, seed: int) -> None:
        self.adapter = adapter  # type: ignore[misc]  # per backend: the visitor names the adapter in its errors
        self.seed = seed
        self.weights: Weights = {}
        self.tensors: dict[str, Held] = {}

    def build(self, info: ModelInfo, weights: Weights) -> NeutralModel:
        """The functional model of ``info`` holding ``weights`` (and the buffers it has; the others start at
        ``harness.neutral.models.initial_buffers``), its logits float32 in every dtype policy (a float32
        ``Activation`` last, as https://keras.io/api/mixed_precision/ recommends); a trailing softmax is left to the
        loss. Kernels and embedding tables are made with the "zeros" initializer and then assigned (``_keep``):
        Keras's random initializers would only be overwritten, and on JAX each draw compiles its own kernel (a third
        of a CNN's build time, measured). Raises ``UnknownLayer`` for a layer kind without a ``visit_<kind>``."""
        self.weights = {**initial_buffers(info), **weights}
        self.tensors = {}
        if info.task != "image_classification":
            inputs = keras.Input(shape=tuple(info.input_shape), dtype="int32", name="tokens")
        else:
            c, h, w = info.input_shape
            inputs = keras.Input(shape=(h, w, c), dtype="float32", name="images")
        x, flat = inputs, None
        for position, layer in enumerate(info.layers):
            x, flat = self.visit(layer, x, flat, info.layers[position + 1:])
        logits = keras.layers.Activation("linear", dtype="float32", name="logits")(x)
        return NeutralModel(keras.Model(inputs, logits, name="neutral"), self.tensors)

    def _keep(self, name: str, variables: tuple[Any, ...], values: tuple[npt.NDArray[np.float32], ...],
              back: Callable[..., npt.NDArray[np.float32]] | None = None, trained: bool = True) -> None:
        """Assigns ``values`` (Keras's layouts) to ``variables`` and registers them as the canonical parameter (or
        buffer) ``name``, which ``back`` of their values gives back (default: the one value as it is). Raises
        ValueError when a shape differs."""
        for variable, value in zip(variables, values):
            if tuple(variable.shape) != value.shape:
                raise ValueError(f"{name}: Keras's {variable.path} is {tuple(variable.shape)}, the value {value.shape}")
            variable.assign(np.asarray(value, np.float32))
        self.tensors[name] = (variables, back or _same, trained)

    def _param(self, layer: LayerInfo, local: str) -> npt.NDArray[np.float32]:
        return _f32(self.weights[f"{layer.name}.{local}"])

    # -- blocks and layers with parameters -------------------------------------------------------------------------

    def visit_residual(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        y = skip = x
        for child in layer.body:
            y, _ = self.visit(child, y, None, ())
        for child in layer.shortcut:
            skip, _ = self.visit(child, skip, None, ())
        tag = _tag(layer)
        out = keras.layers.Add(name=f"{tag}_add")([y, skip])
        return (keras.layers.ReLU(name=f"{tag}_relu")(out) if layer.spec.activation == "relu" else out), None

    def visit_conv2d(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        """``keras.layers.Conv2D`` (HWIO kernel from OIHW); an explicit padding of p zeros is ``ZeroPadding2D(p)``
        then a "valid" convolution ("same" pads an odd kernel by k // 2 on every side at stride 1, as canonical)."""
        spec, tag = layer.spec, _tag(layer)
        if isinstance(spec.padding, int) and spec.padding:
            x = keras.layers.ZeroPadding2D(spec.padding, name=f"{tag}_pad")(x)
        kernel = self._param(layer, "weight")
        conv = keras.layers.Conv2D(kernel.shape[0], spec.kernel_size, strides=spec.stride,
                                   padding=spec.padding if isinstance(spec.padding, str) else "valid",
                                   use_bias=spec.use_bias, activation=_activation(spec.activation),
                                   kernel_initializer="zeros", name=tag)  # assigned below (see _keep)
        y = conv(x)
        self._keep(f"{layer.name}.weight", (conv.kernel,), (kernel.transpose(2, 3, 1, 0),),
                   lambda k: k.transpose(3, 2, 0, 1))
        if spec.use_bias:
            self._keep(f"{layer.name}.bias", (conv.bias,), (self._param(layer, "bias"),))
        return y, None

    def visit_dense(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        """``keras.layers.Dense`` ((in, out) kernel from (out, in)); after a flatten in (H, W, C) order its rows
        permuted to that order. On (B, L, D) Keras applies it per position."""
        weight = self._param(layer, "weight")
        inverse: npt.NDArray[np.intp] | None = None
        if flat is not None:
            perm = chw_to_hwc_permutation(flat)
            weight, inverse = weight[:, perm], np.argsort(perm)
        dense = keras.layers.Dense(weight.shape[0], activation=_activation(layer.spec.activation),
                                   kernel_initializer="zeros", name=_tag(layer))  # assigned below
        y = dense(x)
        self._keep(f"{layer.name}.weight", (dense.kernel,), (np.ascontiguousarray(weight.T),),
                   lambda k: k.T if inverse is None else k.T[:, inverse])
        self._keep(f"{layer.name}.bias", (dense.bias,), (self._param(layer, "bias"),))
        return y, None

    def visit_batchnorm(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        """``adapters.keras.layers.BatchNorm`` on the channels (NHWC's last axis); after a flatten in (H, W, C) order
        its features permuted like the next dense layer's rows (the flatten's order passes through it)."""
        perm = chw_to_hwc_permutation(flat) if len(layer.input_shape) == 1 and flat else None
        inverse = None if perm is None else np.argsort(perm)

        def order(a: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
            return a if perm is None else np.ascontiguousarray(a[perm])

        def back(a: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
            return a if inverse is None else a[inverse]
        norm = KL.BatchNorm(layer.spec.momentum, layer.spec.epsilon, name=_tag(layer))
        y = norm(x)
        self._keep(f"{layer.name}.weight", (norm.gamma,), (order(self._param(layer, "weight")),), back)
        self._keep(f"{layer.name}.bias", (norm.beta,), (order(self._param(layer, "bias")),), back)
        for stat, variable in (("running_mean", norm.moving_mean), ("running_var", norm.moving_variance)):
            self._keep(f"{layer.name}.{stat}", (variable,), (order(self._param(layer, stat)),), back, trained=False)
        return y, flat

    def visit_layernorm(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        norm = keras.layers.LayerNormalization(axis=-1, epsilon=layer.spec.epsilon, name=_tag(layer))
        y = norm(x)
        self._keep(f"{layer.name}.weight", (norm.gamma,), (self._param(layer, "weight"),))
        self._keep(f"{layer.name}.bias", (norm.beta,), (self._param(layer, "bias"),))
        return y, None

    def visit_embedding(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        """``adapters.keras.layers.TokenAndPosition``: Keras's ``Embedding`` of the tokens plus the position table."""
        length, = layer.input_shape
        table = self._param(layer, "token.weight")
        embed = KL.TokenAndPosition(table.shape[0], length, table.shape[1], name=_tag(layer))
        y = embed(x)
        self._keep(f"{layer.name}.token.weight", (embed.token.embeddings,), (table,))
        self._keep(f"{layer.name}.position.weight", (embed.position,), (self._param(layer, "position.weight"),))
        return y, None

    def visit_attention(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        """``keras.layers.MultiHeadAttention(heads, key_dim=D / heads)`` called as ``mha(x, x, use_causal_mask=...)``
        (https://keras.io/api/layers/attention_layers/multi_head_attention/). Its query, key and value kernels are
        (D, heads, D / heads) (head h takes columns h D / heads onwards of x W^T, the canonical split), so each is
        the canonical rows' W.T reshaped, their biases (heads, D / heads); the output kernel (heads, D / heads, D) is
        W_out.T reshaped. Its variables are found by their paths (``query/kernel``, ...)."""
        name = layer.name
        length, dim = layer.input_shape
        heads = layer.spec.heads
        head_dim = dim // heads
        mha = keras.layers.MultiHeadAttention(heads, head_dim, kernel_initializer="zeros",
                                              name=_tag(layer))  # assigned below
        y = mha(x, x, use_causal_mask=layer.spec.causal)
        found = {"/".join(v.path.split("/")[-2:]): v for v in mha.weights}
        kernels = tuple(found[f"{part}/kernel"] for part in ("query", "key", "value"))
        biases = tuple(found[f"{part}/bias"] for part in ("query", "key", "value"))
        in_weight, in_bias = self._param(layer, "in_proj.weight"), self._param(layer, "in_proj.bias")
        self._keep(f"{name}.in_proj.weight", kernels,
                   tuple(part.T.reshape(dim, heads, head_dim) for part in np.split(in_weight, 3)),
                   lambda *ks: np.concatenate([k.reshape(dim, dim).T for k in ks]))
        self._keep(f"{name}.in_proj.bias", biases,
                   tuple(part.reshape(heads, head_dim) for part in np.split(in_bias, 3)),
                   lambda *bs: np.concatenate([b.reshape(dim) for b in bs]))
        self._keep(f"{name}.out_proj.weight", (found["attention_output/kernel"],),
                   (self._param(layer, "out_proj.weight").T.reshape(heads, head_dim, dim),),
                   lambda k: k.reshape(dim, dim).T)
        self._keep(f"{name}.out_proj.bias", (found["attention_output/bias"],), (self._param(layer, "out_proj.bias"),))
        return y, None

    # -- layers without parameters (the order-free ones, harness.neutral.models.ORDER_FREE, pass ``flat`` on) ------

    def visit_flatten(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        """Keras flattens NHWC in (H, W, C) order: kept when a dense layer follows through order-free layers only
        (``flatten_feeds_dense``: its rows are permuted instead), else the canonical (C, H, W) order by a
        ``Permute`` first."""
        if len(layer.input_shape) == 3 and flatten_feeds_dense(following):
            c, h, w = layer.input_shape
            return keras.layers.Flatten(name=_tag(layer))(x), (c, h, w)
        if len(layer.input_shape) == 3:
            x = keras.layers.Permute((3, 1, 2), name=f"{_tag(layer)}_chw")(x)  # the canonical (C, H, W) order
        return keras.layers.Flatten(name=_tag(layer))(x), None

    def visit_maxpool2d(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        spec = layer.spec
        return keras.layers.MaxPooling2D(spec.pool_size, strides=spec.stride or spec.pool_size, padding="valid",
                                         name=_tag(layer))(x), None

    def visit_avgpool2d(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        spec = layer.spec
        return keras.layers.AveragePooling2D(spec.pool_size, strides=spec.stride or spec.pool_size, padding="valid",
                                             name=_tag(layer))(x), None

    def visit_global_avgpool2d(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        return keras.layers.GlobalAveragePooling2D(name=_tag(layer))(x), None

    def visit_sequence_pool(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        if layer.spec.mode == "mean":
            return keras.layers.GlobalAveragePooling1D(name=_tag(layer))(x), None
        return KL.LastPosition(name=_tag(layer))(x), None

    def visit_dropout(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        return keras.layers.Dropout(layer.spec.rate, seed=self.seed + layer.index, name=_tag(layer))(x), flat

    def visit_relu(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        return keras.layers.ReLU(name=_tag(layer))(x), flat

    def visit_gelu(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        return keras.layers.Activation(KL.exact_gelu, name=_tag(layer))(x), flat

    def visit_softmax(self, layer: LayerInfo, x: Any, flat: Flat, following: Sequence[LayerInfo]) -> Built:
        return x, flat  # folded into the cross-entropy loss


def _tag(layer: LayerInfo) -> str:
    """The Keras layer's name: the canonical name with "_" for "." (Keras's names take no dots)."""
    return layer.name.replace(".", "_")


def _activation(name: str | None) -> Any:
    """A fused activation as Keras's layers take it: the exact GELU, "relu", or None."""
    if name == "gelu":
        return KL.exact_gelu
    return None if name in (None, "none", "linear") else name


def _same(value: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    return value


def _f32(array: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    return np.asarray(array, dtype=np.float32)
