"""MXNet's neutral builder: the canonical layers and blocks as Gluon ``HybridBlock``s in one ``HybridSequential``
(NCHW images, (B, L) token ids, (B, L, D) sequences), holding the canonical weights unchanged.

Conv2D weights are OIHW and Dense weights (out, in): MXNet's own layouts, so the canonical arrays are copied in as they
are; so are batchnorm's and layernorm's gamma and beta, batchnorm's running statistics, the embedding tables and
attention's projections (``adapters.mxnet.layers.params``). A trailing softmax is folded into the loss
(``gluon.loss.SoftmaxCrossEntropyLoss`` on the logits, ``adapters.mxnet.training``). Dropout is ``nn.Dropout``, active
only under ``autograd.record`` (in a training step).

Design: docs/design/canonical-layout.md (names and layouts), docs/design/framework-caveats.md#mxnet.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters.base import Weights
from adapters.mxnet import layers as L
from adapters.mxnet.batchnorm import BatchNormLayer
from adapters.mxnet.runtime import gluon, mx, nd, nn
from harness.neutral.info import LayerInfo, ModelInfo
from harness.neutral.models import initial_buffers
from harness.neutral.visitor import LayerVisitor


class NeutralNet:
    """A neutral model as MXNet holds it. net: the ``HybridSequential``; blocks: the blocks that hold parameters, by
    canonical layer name ("0", "3.1", "3.shortcut_bn"); tensors: every parameter and buffer by canonical full name,
    (Gluon ``Parameter``, trained), in ``info.param_names()`` / ``buffer_names()`` order; batchnorms: every batchnorm
    layer (its block, canonical momentum and per-sample input shape), for the training mechanics' running-variance
    correction (``adapters.mxnet.batchnorm``)."""

    def __init__(self, net: nn.HybridSequential, blocks: dict[str, Any], tensors: dict[str, tuple[Any, bool]],
                 batchnorms: list[BatchNormLayer]):
        self.net, self.blocks, self.tensors, self.batchnorms = net, blocks, tensors, batchnorms

    def state(self, ctx: Any, trained: bool) -> Weights:
        """The parameters (``trained``) or the buffers as context ``ctx`` holds them, float32 numpy copies under their
        canonical names (``asnumpy`` waits for the writes queued on each, then copies to a new host array)."""
        return {name: param.data(ctx).asnumpy() for name, (param, is_trained) in self.tensors.items()
                if is_trained == trained}


class Builder(LayerVisitor):
    """Builds a ``NeutralNet`` (``build``); a ``visit_<kind>`` per layer kind (``harness.neutral.visitor``), each
    returning the layer's block (None: nothing to run, a softmax).

    sync_devices: batchnorm is ``gluon.contrib.nn.SyncBatchNorm`` over that many devices (a data-parallel trial with
    synchronised batchnorm: mean and variance summed over the contexts, a barrier and a reduction across the contexts'
    engine threads inside the operator, forward and backward); 0: ``nn.BatchNorm``."""

    adapter = "mxnet"

    def __init__(self, sync_devices: int = 0):
        self.sync_devices = sync_devices
        self.blocks: dict[str, Any] = {}
        self.tensors: dict[str, tuple[Any, bool]] = {}
        self.batchnorms: list[BatchNormLayer] = []

    def build(self, info: ModelInfo, weights: Weights, contexts: list[Any]) -> NeutralNet:
        """The model of ``info`` holding ``weights`` (and the buffers it has; the others start at
        ``harness.neutral.models.initial_buffers``), a copy on every one of ``contexts`` (data-parallel: one per
        device; ``Parameter.set_data`` writes every context's copy), not hybridized."""
        self.blocks, self.tensors, self.batchnorms = {}, {}, []
        net = nn.HybridSequential()
        for layer in info.layers:
            self._add(net, layer)
        net.initialize(mx.init.Zero(), ctx=contexts)
        buffers = {**initial_buffers(info), **{k: v for k, v in weights.items() if k in info.buffer_names()}}
        for name, (param, trained) in self.tensors.items():
            param.set_data(nd.array((weights if trained else buffers)[name], ctx=contexts[0], dtype=np.float32))
        return NeutralNet(net, self.blocks, self.tensors, self.batchnorms)

    def _add(self, net: nn.HybridSequential, layer: LayerInfo) -> None:
        block = self.visit(layer)
        if block is not None:
            net.add(block)

    def _keep(self, layer: LayerInfo, block: Any) -> Any:
        """Registers ``block``'s parameters and buffers under their canonical names (``layers.params``)."""
        self.blocks[layer.name] = block
        held = L.params(block)
        for local in (*layer.params, *layer.buffers):
            self.tensors[f"{layer.name}.{local}"] = (held[local], local in layer.params)
        return block

    def visit_residual(self, layer: LayerInfo) -> Any:
        body = nn.HybridSequential()
        for child in layer.body:
            self._add(body, child)
        shortcut = nn.HybridSequential() if layer.shortcut else None
        for child in layer.shortcut:  # the projection: a strided 1x1 conv without bias, then a batchnorm
            self._add(shortcut, child)
        return L.Residual(body, shortcut, layer.spec.activation == "relu")

    def visit_conv2d(self, layer: LayerInfo) -> Any:
        spec = layer.spec
        padding = (spec.kernel_size // 2 if spec.padding == "same" else 0 if spec.padding == "valid"
                   else spec.padding)  # an integer: that many zeros on every side
        conv = nn.Conv2D(spec.filters, spec.kernel_size, strides=spec.stride, padding=padding, use_bias=spec.use_bias,
                         in_channels=layer.input_shape[0])
        return L.activated(self._keep(layer, conv), spec)

    def visit_dense(self, layer: LayerInfo) -> Any:
        # on (N, F), or per position on (N, L, D): flatten=False applies the weight to the last axis only
        dense = nn.Dense(layer.spec.units, in_units=layer.input_shape[-1], flatten=len(layer.input_shape) == 1)
        return L.activated(self._keep(layer, dense), layer.spec)

    def visit_batchnorm(self, layer: LayerInfo) -> Any:
        # MXNet's momentum is the weight of the old running value: 1 - the canonical momentum. axis 1: the channels of
        # NCHW or the features of a flat input. Its running variance may be updated with the biased batch variance:
        # the training mechanics correct that (adapters.mxnet.batchnorm), inside residual blocks and shortcuts too.
        spec, channels = layer.spec, layer.input_shape[0]
        if self.sync_devices:
            block = gluon.contrib.nn.SyncBatchNorm(in_channels=channels, num_devices=self.sync_devices,
                                                   momentum=1.0 - spec.momentum, epsilon=spec.epsilon)
        else:
            block = nn.BatchNorm(axis=1, momentum=1.0 - spec.momentum, epsilon=spec.epsilon, in_channels=channels)
        self.batchnorms.append(BatchNormLayer(block, spec.momentum, tuple(layer.input_shape)))
        return self._keep(layer, block)

    def visit_layernorm(self, layer: LayerInfo) -> Any:
        # over the last axis, biased variance (MXNet's LayerNorm, as torch.nn.LayerNorm)
        return self._keep(layer, nn.LayerNorm(axis=-1, epsilon=layer.spec.epsilon,
                                              in_channels=layer.input_shape[-1]))

    def visit_embedding(self, layer: LayerInfo) -> Any:
        length, dim = layer.output_shape
        return self._keep(layer, L.Embedding(layer.spec.vocab, length, dim))

    def visit_attention(self, layer: LayerInfo) -> Any:
        return self._keep(layer, L.SelfAttention(layer.input_shape[1], layer.spec.heads, layer.spec.causal))

    def visit_maxpool2d(self, layer: LayerInfo) -> Any:
        return nn.MaxPool2D(layer.spec.pool_size, layer.spec.stride or layer.spec.pool_size)

    def visit_avgpool2d(self, layer: LayerInfo) -> Any:
        return nn.AvgPool2D(layer.spec.pool_size, layer.spec.stride or layer.spec.pool_size)  # no padding

    def visit_global_avgpool2d(self, layer: LayerInfo) -> Any:
        return L.sequential(nn.GlobalAvgPool2D(), nn.Flatten())  # (N, C, 1, 1) -> (N, C)

    def visit_sequence_pool(self, layer: LayerInfo) -> Any:
        return L.SequencePool(layer.spec.mode)

    def visit_dropout(self, layer: LayerInfo) -> Any:
        return nn.Dropout(layer.spec.rate)  # active only under autograd.record(), i.e. in a training step

    def visit_flatten(self, layer: LayerInfo) -> Any:
        return nn.Flatten()  # NCHW flattens channel-first: the canonical order

    def visit_relu(self, layer: LayerInfo) -> Any:
        return nn.Activation("relu")

    def visit_gelu(self, layer: LayerInfo) -> Any:
        return nn.GELU()  # the exact erf form (layers.activated)

    def visit_softmax(self, layer: LayerInfo) -> None:
        return None  # folded into the cross-entropy loss
