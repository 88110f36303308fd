"""TensorFlow's neutral builder: the canonical layers and blocks as float32 ``tf.Variable``s and ``tf.nn`` ops
(``adapters.tensorflow.layers``; Keras's own layers for layernorm and attention), NHWC for images and (B, L, D) for
sequences, in a ``Network``: the model object the training mechanics (``adapters.tensorflow.training``) train.

Layouts. The canonical weights are converted once, here: conv OIHW -> HWIO, dense (out, in) -> (in, out), the rows of
the first dense kernel after a flatten of (C, H, W) permuted to the (H, W, C) order TF flattens in (and so are the
features of a batchnorm between the two), Keras's attention kernels split from the fused in-projection. Every
parameter and buffer is kept under its canonical name with the variables that hold it and the inverse of its
conversion (``layers.Held``), from which ``Network.state`` rebuilds the canonical arrays exactly.

Design: docs/design/canonical-layout.md (names and layouts), docs/design/framework-caveats.md#tensorflow (Keras's
two layers, the mixed-precision policy layer by layer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import tensorflow as tf

from adapters.base import Weights
from adapters.tensorflow import layers as L
from harness.neutral.info import LayerInfo, ModelInfo
from harness.neutral.models import chw_to_hwc_permutation, flatten_feeds_dense, initial_buffers
from harness.neutral.visitor import LayerVisitor

#: What a ``visit_<kind>`` returns: the layer's forward function and the (C, H, W) shape the next dense layer's input
#: was flattened from in (H, W, C) order (``Builder.visit_flatten``), or None.
Built = tuple[L.Layer, tuple[int, int, int] | None]


class Network:
    """A neutral model as TensorFlow holds it: ``layers`` (each ``(x, training) -> y``) applied in order, and per
    canonical name where its parameter (``params``) or buffer (``buffers``: batchnorm's running statistics) lives.
    Called as a Keras model is, ``network(x, training=...)``: ``training`` (a Python bool, fixed when a function is
    traced) selects batchnorm's batch statistics and running-statistics update, and dropout; the logits are float32
    in every precision."""

    def __init__(self, layers: list[L.Layer], params: dict[str, L.Held], buffers: dict[str, L.Held]) -> None:
        self.layers, self.params, self.buffers = layers, params, buffers

    def __call__(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        for layer in self.layers:
            x = layer(x, training)
        return L.to(x, tf.float32)

    @property
    def trainable_variables(self) -> list[tf.Variable]:
        """Every variable holding a parameter, in the canonical parameter order (the optimizer's order)."""
        return [v for variables, _ in self.params.values() for v in variables]

    @property
    def non_trainable_variables(self) -> list[tf.Variable]:
        """The buffers' variables (batchnorm's running statistics)."""
        return [v for variables, _ in self.buffers.values() for v in variables]

    def state(self, trained: bool) -> Weights:
        """The parameters (``trained``) or the buffers as canonical float32 arrays (always copies), from the current
        values of the variables holding them, under their canonical names in the canonical order."""
        return {name: _canonical(held) for name, held in (self.params if trained else self.buffers).items()}


class Builder(LayerVisitor):
    """Builds a ``Network`` (``build``) with a ``visit_<kind>(layer, flatten_from, following)`` per layer kind
    (``harness.neutral.visitor``), creating its variables in the current device scope (the adapter's
    ``Devices.placement``). compute: the compute dtype of the layers (float32, or bfloat16 / float16 for mixed
    precision; the variables are float32 throughout). replicated: data-parallel under a MirroredStrategy (the
    buffers become sync-on-read variables, ``_keep``). sync_batchnorm: batchnorm over the global batch."""

    adapter = "tensorflow"

    def __init__(self, compute: tf.DType = tf.float32, replicated: bool = False, sync_batchnorm: bool = False):
        self.compute, self.replicated, self.sync_batchnorm = compute, replicated, sync_batchnorm
        self.weights: Weights = {}
        self.params: dict[str, L.Held] = {}
        self.buffers: dict[str, L.Held] = {}

    def build(self, info: ModelInfo, weights: Weights) -> Network:
        """The model of ``info`` holding ``weights`` (and the buffers it has; the others start at
        ``harness.neutral.models.initial_buffers``). A trailing softmax is left to the loss. Inputs: NHWC float32
        images, or (B, L) int64 token ids."""
        self.weights = {**initial_buffers(info), **{k: _f32(v) for k, v in weights.items()}}
        self.params, self.buffers = {}, {}
        flatten_from: tuple[int, int, int] | None = None
        layers = []
        for position, layer in enumerate(info.layers):
            fn, flatten_from = self.visit(layer, flatten_from, info.layers[position + 1:])
            layers.append(fn)
        return Network(layers, self.params, self.buffers)

    def _keep(self, name: str, value: npt.NDArray[np.float32], to_canonical: Callable[..., Any] = L.same,
              trainable: bool = True) -> tf.Variable:
        """A float32 variable named ``name`` holding ``value`` (already in TF's layout), registered as the canonical
        parameter (or, not ``trainable``, buffer) ``name`` that ``to_canonical`` of its value gives back.

        Data-parallel, a buffer (batchnorm's running statistics) is a sync-on-read variable with MEAN aggregation
        (https://www.tensorflow.org/api_docs/python/tf/VariableSynchronization, what tf.keras 2's BatchNormalization
        used): each replica updates its own copy from its own batch statistics, with no communication in the step,
        and a read in the cross-replica context (the state, evaluation and prediction, all under the strategy's
        scope) is the mean of the copies. The update being linear in the batch statistics, that mean is (1 -
        momentum) * running + momentum * (the mean over the replicas of their shards' statistics): the global
        batch's mean for ``running_mean``, the mean of the shards' unbiased variances for ``running_var``; with sync
        batchnorm every copy is the same. (Keras 3's BatchNormalization creates them with aggregation "none", so
        that each copy is its own replica's and a read gives the first device's.)"""
        sync: dict[str, Any] = {}
        if not trainable and self.replicated:
            sync = {"synchronization": tf.VariableSynchronization.ON_READ, "aggregation": tf.VariableAggregation.MEAN}
        variable = tf.Variable(value, trainable=trainable, name=name, **sync)
        (self.params if trainable else self.buffers)[name] = ((variable,), to_canonical)
        return variable

    def _children(self, layers: Sequence[LayerInfo]) -> list[L.Layer]:
        # a block's input is never an (H, W, C)-ordered flatten: see flatten_feeds_dense
        return [self.visit(child, None, ())[0] for child in layers]

    def visit_residual(self, layer: LayerInfo, flatten_from: Any, following: Any) -> Built:
        return L.residual(self._children(layer.body), self._children(layer.shortcut), layer.spec.activation), None

    def visit_conv2d(self, layer: LayerInfo, flatten_from: Any, following: Any) -> Built:
        spec, w, b = layer.spec, f"{layer.name}.weight", f"{layer.name}.bias"
        kernel = self._keep(w, self.weights[w].transpose(2, 3, 1, 0), lambda k: k.transpose(3, 2, 0, 1))  # HWIO
        bias = self._keep(b, self.weights[b]) if spec.use_bias else None
        return L.conv(kernel, bias, spec.stride, spec.padding, spec.activation, self.compute), None

    def visit_dense(self, layer: LayerInfo, flatten_from: tuple[int, int, int] | None, following: Any) -> Built:
        """On (B, F), or per position on (B, L, D). After an (H, W, C)-ordered flatten (``flatten_from``) the rows
        of the kernel are permuted to that order."""
        w, b = f"{layer.name}.weight", f"{layer.name}.bias"
        weight, inverse = self.weights[w], None
        if flatten_from is not None:
            perm = chw_to_hwc_permutation(flatten_from)
            weight, inverse = weight[:, perm], np.argsort(perm)
        kernel = self._keep(w, np.ascontiguousarray(weight.T),  # (out, in) -> (in, out); undo the HWC rows
                            lambda k, inv=inverse: k.T if inv is None else k.T[:, inv])
        return L.dense(kernel, self._keep(b, self.weights[b]), layer.spec.activation, self.compute), None

    def visit_batchnorm(self, layer: LayerInfo, flatten_from: tuple[int, int, int] | None, following: Any) -> Built:
        """Channels are the last axis in NHWC, so gamma, beta and the statistics need no transposition; after a
        channel-last flatten (``flatten_from``) the features are in (H, W, C) order and are permuted like the next
        dense layer's rows."""
        name, spec, flat = layer.name, layer.spec, len(layer.input_shape) == 1
        perm = chw_to_hwc_permutation(flatten_from) if flat and flatten_from is not None else None
        inverse = None if perm is None else np.argsort(perm)
        back = L.same if inverse is None else (lambda a: a[inverse])

        def tf_order(array: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
            return array if perm is None else np.ascontiguousarray(array[perm])
        gamma, beta = (self._keep(f"{name}.{p}", tf_order(self.weights[f"{name}.{p}"]), back)
                       for p in ("weight", "bias"))
        mean, var = (self._keep(f"{name}.{stat}", tf_order(self.weights[f"{name}.{stat}"]), back, trainable=False)
                     for stat in ("running_mean", "running_var"))
        fn = L.batchnorm(gamma, beta, mean, var, spec.momentum, spec.epsilon, flat, self.compute, self.sync_batchnorm)
        return fn, flatten_from

    def _keras_layer(self, layer: LayerInfo, fn: L.Layer, held: dict[str, L.Held]) -> Built:
        """Keras's layer (layernorm, attention) with its variables set from the canonical weights, those variables
        registered under the canonical names (``layers.layer_norm``, ``.multi_head_attention``)."""
        self.params.update({f"{layer.name}.{local}": held[local] for local in layer.params})
        return fn, None

    def _canonical_params(self, layer: LayerInfo) -> Weights:
        return {local: self.weights[f"{layer.name}.{local}"] for local in layer.params}

    def visit_layernorm(self, layer: LayerInfo, flatten_from: Any, following: Any) -> Built:
        canonical = self._canonical_params(layer)
        return self._keras_layer(layer, *L.layer_norm(layer.input_shape, layer.spec.epsilon, canonical["weight"],
                                                      canonical["bias"], self.compute))

    def visit_attention(self, layer: LayerInfo, flatten_from: Any, following: Any) -> Built:
        length, dim = layer.input_shape
        return self._keras_layer(layer, *L.multi_head_attention(length, dim, layer.spec.heads, layer.spec.causal,
                                                                self._canonical_params(layer), self.compute))

    def visit_embedding(self, layer: LayerInfo, flatten_from: Any, following: Any) -> Built:
        token, position = (self._keep(f"{layer.name}.{table}.weight", self.weights[f"{layer.name}.{table}.weight"])
                           for table in ("token", "position"))
        return L.embedding(token, position, self.compute), None

    def visit_maxpool2d(self, layer: LayerInfo, flatten_from: Any, following: Any) -> Built:
        return L.pool(tf.nn.max_pool2d, layer.spec.pool_size, layer.spec.stride or layer.spec.pool_size), None

    def visit_avgpool2d(self, layer: LayerInfo, flatten_from: Any, following: Any) -> Built:
        return L.pool(tf.nn.avg_pool2d, layer.spec.pool_size, layer.spec.stride or layer.spec.pool_size), None

    def visit_global_avgpool2d(self, layer: LayerInfo, flatten_from: Any, following: Any) -> Built:
        # (N, H, W, C) -> (N, C): channel order, the canonical one, so no permutation follows.
        return (lambda x, training: tf.reduce_mean(x, axis=(1, 2))), None

    def visit_sequence_pool(self, layer: LayerInfo, flatten_from: Any, following: Any) -> Built:
        return L.sequence_pool(layer.spec.mode), None

    def visit_flatten(self, layer: LayerInfo, flatten_from: Any, following: Sequence[LayerInfo]) -> Built:
        """NHWC flattens in (H, W, C) order; when a dense layer takes the features (``flatten_feeds_dense``, looking
        at the ``following`` top-level layers) its rows absorb the order, else the flatten transposes to the
        canonical channel-first order first."""
        features = int(np.prod(layer.input_shape))
        if len(layer.input_shape) == 3 and flatten_feeds_dense(following):
            c, h, w = layer.input_shape
            return L.flatten(features, channels_first=False), (c, h, w)  # NHWC: (H, W, C) order
        return L.flatten(features, channels_first=len(layer.input_shape) == 3), None

    def visit_dropout(self, layer: LayerInfo, flatten_from: Any, following: Any) -> Built:
        return L.dropout(layer.spec.rate), flatten_from

    def visit_relu(self, layer: LayerInfo, flatten_from: Any, following: Any) -> Built:
        return (lambda x, training: L.activate(x, "relu")), flatten_from

    def visit_gelu(self, layer: LayerInfo, flatten_from: Any, following: Any) -> Built:
        return (lambda x, training: L.activate(x, "gelu")), flatten_from

    def visit_softmax(self, layer: LayerInfo, flatten_from: Any, following: Any) -> Built:
        return (lambda x, training: x), flatten_from  # folded into the cross-entropy loss


def _f32(array: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    return np.asarray(array, dtype=np.float32)


def _canonical(held: L.Held) -> npt.NDArray[np.float32]:
    """The canonical array of a parameter or buffer from the current values of the variables that hold it."""
    variables, to_canonical = held
    return np.array(to_canonical(*[v.numpy() for v in variables]), dtype=np.float32, order="C")  # always a copy
