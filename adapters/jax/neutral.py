"""JAX's neutral builder: the canonical layers and blocks as functions of ``jax.lax`` ops over a parameter dict
(``adapters.jax.layers``), one ``visit_<kind>`` per layer kind, composed into the ``Functional`` model the training
mechanics train (``adapters.jax.training``), holding the canonical weights in JAX's layouts.

The layouts are TensorFlow's (both compute NHWC): conv kernels HWIO (``weight.transpose(2, 3, 1, 0)``), dense kernels
(in, out), and the first dense layer after flattening an (H, W, C) tensor has its input rows permuted by
``harness.neutral.models.chw_to_hwc_permutation`` (a batchnorm over those flat features has its parameters and
running statistics permuted the same way); the data is never permuted. Layernorm, embedding and attention keep the
canonical layouts. ``NeutralModel.canonical`` inverts this.

Design: docs/design/canonical-layout.md (names and layouts), docs/design/framework-caveats.md#jax (why no flax).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from adapters.base import Weights
from adapters.jax import layers as L
from adapters.jax.runtime import jax, jnp
from adapters.jax.training import Functional
from harness.neutral.info import LayerInfo, ModelInfo
from harness.neutral.models import chw_to_hwc_permutation, initial_buffers
from harness.neutral.visitor import LayerVisitor


class NeutralModel:
    """A neutral model as JAX holds it: ``model`` (the ``Functional``: its ``params`` are the parameters, its
    ``state`` the running statistics, numpy float32 in JAX's layouts under their canonical names) and the layout
    changes ``canonical`` undoes. transforms: canonical name -> "conv" (HWIO) or "dense" ((in, out)); perms:
    canonical name -> the permutation applied to its input features (a dense kernel's rows, a flat batchnorm's
    features)."""

    def __init__(self, model: Functional, transforms: dict[str, str], perms: dict[str, npt.NDArray[np.int64]]):
        self.model, self.transforms, self.perms = model, transforms, perms

    def canonical(self, arrays: Mapping[str, Any]) -> Weights:
        """``arrays`` (parameters or running statistics in JAX's layouts, on any device) as float32 numpy copies in
        the canonical layouts."""
        return {name: self._canonical(name, value) for name, value in arrays.items()}

    def _canonical(self, name: str, value: Any) -> npt.NDArray[np.float32]:
        array = np.array(value, dtype=np.float32)
        kind = self.transforms.get(name)
        if kind == "conv":
            array = array.transpose(3, 2, 0, 1)  # HWIO -> OIHW
        elif kind == "dense":
            array = array.T  # (in, out) -> (out, in)
        if name in self.perms:
            inverse = np.argsort(self.perms[name])
            array = array[:, inverse] if kind == "dense" else array[inverse]
        return np.ascontiguousarray(array)


class Builder(LayerVisitor):
    """Builds a ``NeutralModel`` (``build``); a ``visit_<kind>`` per layer kind (``harness.neutral.visitor``), each
    returning the layer's function (``layers.Layer``) and adding its parameters. compute: the precision policy of
    the multiplying layers (``layers.POLICIES``); sync_axis: the mesh axis over which batchnorm averages its moments
    (a data-parallel trial with synchronised batchnorm), else None."""

    adapter = "jax"

    def __init__(self, compute: L.Compute = L.FP32, sync_axis: str | None = None):
        self.compute, self.sync_axis = compute, sync_axis
        self.weights: Weights = {}
        self.buffers: Weights = {}
        self.params: dict[str, npt.NDArray[np.float32]] = {}
        self.stats: dict[str, npt.NDArray[np.float32]] = {}
        self.transforms: dict[str, str] = {}
        self.perms: dict[str, npt.NDArray[np.int64]] = {}
        self._flat: tuple[int, int, int] | None = None  # the (C, H, W) the next dense layer's input was flattened from
        self._dropouts = 0

    def build(self, info: ModelInfo, weights: Weights) -> NeutralModel:
        """The model of ``info`` holding ``weights`` and the running statistics among them (the others start at
        ``harness.neutral.models.initial_buffers``), on the host."""
        self.weights = weights
        self.buffers = {**initial_buffers(info), **{k: v for k, v in weights.items() if k in info.buffer_names()}}
        self.params, self.stats, self.transforms, self.perms = {}, {}, {}, {}
        self._flat, self._dropouts = None, 0
        forward = L.sequence([self.visit(layer) for layer in info.layers])

        def apply(params: L.Params, stats: L.Params, x: jax.Array, train: bool, key: jax.Array
                  ) -> tuple[jax.Array, L.Params]:
            """Logits in the compute dtype and the running statistics (updated only in training)."""
            y, updated = forward(params, stats, x, train, key)
            return y, {**stats, **updated}
        return NeutralModel(Functional(apply, self.params, self.stats, random=self._dropouts > 0), self.transforms,
                            self.perms)

    def _param(self, name: str, value: npt.NDArray[Any]) -> None:
        self.params[name] = np.asarray(value, dtype=np.float32)

    def visit_residual(self, layer: LayerInfo) -> L.Layer:
        self._flat = None
        body = [self.visit(child) for child in layer.body]
        self._flat = None
        shortcut = [self.visit(child) for child in layer.shortcut]
        self._flat = None
        return L.residual(body, shortcut, layer.spec.activation)

    def visit_conv2d(self, layer: LayerInfo) -> L.Layer:
        spec, w, b = layer.spec, f"{layer.name}.weight", f"{layer.name}.bias"
        self._param(w, self.weights[w].transpose(2, 3, 1, 0))  # OIHW -> HWIO
        self.transforms[w] = "conv"
        if spec.use_bias:
            self._param(b, self.weights[b])
        return L.conv(w, b if spec.use_bias else None, spec.stride, spec.padding, spec.activation, self.compute)

    def visit_dense(self, layer: LayerInfo) -> L.Layer:
        w, b = f"{layer.name}.weight", f"{layer.name}.bias"
        weight = self.weights[w]
        if self._flat is not None:
            perm = chw_to_hwc_permutation(self._flat)
            weight, self.perms[w] = weight[:, perm], perm
        self._param(w, np.ascontiguousarray(weight.T))  # (out, in) -> (in, out)
        self._param(b, self.weights[b])
        self.transforms[w], self._flat = "dense", None
        return L.dense(w, b, layer.spec.activation, self.compute)

    def visit_batchnorm(self, layer: LayerInfo) -> L.Layer:
        spec, name = layer.spec, layer.name
        flat = len(layer.input_shape) == 1
        channels = chw_to_hwc_permutation(self._flat) if flat and self._flat else None
        names = (f"{name}.weight", f"{name}.bias", f"{name}.running_mean", f"{name}.running_var")
        for item in names:
            trained = item in names[:2]
            value = np.asarray((self.weights if trained else self.buffers)[item], dtype=np.float32)
            (self.params if trained else self.stats)[item] = value if channels is None else value[channels]
            if channels is not None:
                self.perms[item] = channels
        return L.batchnorm(*names, spec.momentum, spec.epsilon, flat=flat, sync_axis=self.sync_axis)

    def _canonical_layout(self, layer: LayerInfo) -> None:
        """The layer's parameters as they are (only matmuls with .T, no conversion)."""
        for local in layer.params:
            self._param(f"{layer.name}.{local}", self.weights[f"{layer.name}.{local}"])
        self._flat = None

    def visit_layernorm(self, layer: LayerInfo) -> L.Layer:
        self._canonical_layout(layer)
        return L.layernorm(f"{layer.name}.weight", f"{layer.name}.bias", layer.spec.epsilon)

    def visit_embedding(self, layer: LayerInfo) -> L.Layer:
        self._canonical_layout(layer)
        return L.embedding(f"{layer.name}.token.weight", f"{layer.name}.position.weight", self.compute)

    def visit_attention(self, layer: LayerInfo) -> L.Layer:
        self._canonical_layout(layer)
        return L.attention(layer.name, layer.spec.heads, layer.spec.causal, self.compute)

    def visit_maxpool2d(self, layer: LayerInfo) -> L.Layer:
        return L.pool("maxpool2d", layer.spec.pool_size, layer.spec.stride or layer.spec.pool_size)

    def visit_avgpool2d(self, layer: LayerInfo) -> L.Layer:
        return L.pool("avgpool2d", layer.spec.pool_size, layer.spec.stride or layer.spec.pool_size)

    def visit_global_avgpool2d(self, layer: LayerInfo) -> L.Layer:
        self._flat = None
        return L.plain(lambda x: jnp.mean(x, axis=(1, 2)))  # channel order

    def visit_sequence_pool(self, layer: LayerInfo) -> L.Layer:
        self._flat = None
        return L.sequence_pool(layer.spec.mode)

    def visit_dropout(self, layer: LayerInfo) -> L.Layer:
        self._dropouts += 1
        return L.dropout(layer.spec.rate, self._dropouts)

    def visit_flatten(self, layer: LayerInfo) -> L.Layer:
        # (H, W, C) order (the next dense layer's rows are permuted to it); sequences position-major
        self._flat = (layer.input_shape[0], layer.input_shape[1], layer.input_shape[2]) \
            if len(layer.input_shape) == 3 else None
        return L.plain(lambda x: x.reshape(x.shape[0], -1))

    def visit_relu(self, layer: LayerInfo) -> L.Layer:
        return L.plain(jax.nn.relu)

    def visit_gelu(self, layer: LayerInfo) -> L.Layer:
        return L.plain(lambda x: jax.nn.gelu(x, approximate=False))  # the exact erf form

    def visit_softmax(self, layer: LayerInfo) -> L.Layer:
        return L.plain(lambda x: x)  # folded into the cross-entropy loss
