"""PyTorch's neutral builder: the canonical layers and blocks as ``torch.nn`` modules (NCHW for images, (B, L, D) for
sequences), holding the canonical weights unchanged: PyTorch's own layouts and batchnorm are the canonical ones.

Design: docs/design/canonical-layout.md (names and layouts), docs/design/framework-caveats.md#pytorch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from adapters.base import Weights
from adapters.pytorch import layers as L
from harness.neutral.info import LayerInfo, ModelInfo
from harness.neutral.models import initial_buffers
from harness.neutral.visitor import LayerVisitor


class NeutralModule:
    """A neutral model as PyTorch holds it: ``module`` (``layers.Network``) and, per canonical name, where its tensor
    lives (the module, the attribute path in it, and whether it is a trained parameter or a buffer)."""

    def __init__(self, module: L.Network, tensors: dict[str, tuple[nn.Module, str, bool]]):
        self.module, self.tensors = module, tensors

    def tensor(self, name: str) -> torch.Tensor:
        """The parameter or buffer of canonical ``name`` (wherever ``.to(device)`` put it)."""
        module, attribute, trained = self.tensors[name]
        return module.get_parameter(attribute) if trained else module.get_buffer(attribute)

    def state(self, trained: bool) -> Weights:
        """The parameters (``trained``) or the buffers, as float32 numpy copies under their canonical names."""
        return {name: self.tensor(name).detach().cpu().numpy().copy()
                for name, (_, _, is_trained) in self.tensors.items() if is_trained == trained}


class Builder(LayerVisitor):
    """Builds a ``NeutralModule`` (``build``); a ``visit_<kind>`` per layer kind (``harness.neutral.visitor``).
    sync_batchnorm: batchnorm layers are ``nn.SyncBatchNorm`` (data-parallel on GPUs)."""

    adapter = "pytorch"

    def __init__(self, sync_batchnorm: bool = False):
        self.sync_batchnorm = sync_batchnorm
        self.tensors: dict[str, tuple[nn.Module, str, bool]] = {}

    def build(self, info: ModelInfo, weights: Weights) -> NeutralModule:
        """The model of ``info`` holding ``weights`` (and the buffers it has; the others start at
        ``harness.neutral.models.initial_buffers``), on the CPU, in training mode."""
        buffers = {**initial_buffers(info), **{k: v for k, v in weights.items() if k in info.buffer_names()}}
        self.tensors = {}
        built = NeutralModule(L.Network(*[self.visit(layer) for layer in info.layers]), self.tensors)
        with torch.no_grad():
            for name, (_, _, trained) in self.tensors.items():
                built.tensor(name).copy_(torch.from_numpy((weights if trained else buffers)[name]))
        return built

    def _keep(self, layer: LayerInfo, module: nn.Module, names: dict[str, str]) -> nn.Module:
        """Registers ``module``'s tensors under their canonical names: ``names`` maps a canonical local name
        (``weight``, ``in_proj.weight``, ...) to its attribute path in ``module`` (``weight``, ``mha.in_proj_weight``,
        ...); parameters are the names in ``layer.params``, the rest buffers."""
        for local, attribute in names.items():
            self.tensors[f"{layer.name}.{local}"] = (module, attribute, local in layer.params)
        return module

    def visit_residual(self, layer: LayerInfo) -> nn.Module:
        return L.Residual(nn.Sequential(*[self.visit(child) for child in layer.body]),
                          nn.Sequential(*[self.visit(child) for child in layer.shortcut]),
                          layer.spec.activation == "relu")

    def visit_conv2d(self, layer: LayerInfo) -> nn.Module:
        spec = layer.spec
        padding = (spec.kernel_size // 2 if spec.padding == "same" else 0 if spec.padding == "valid"
                   else spec.padding)  # an integer: that many zeros on every side, as PyTorch pads
        conv = nn.Conv2d(layer.input_shape[0], spec.filters, spec.kernel_size, stride=spec.stride, padding=padding,
                         bias=spec.use_bias)
        return L.activated(self._keep(layer, conv, {k: v for k, v in _PLAIN.items() if k in layer.params}), spec)

    def visit_dense(self, layer: LayerInfo) -> nn.Module:
        # on (B, F), or per position on (B, L, D): nn.Linear acts on the last axis
        return L.activated(self._keep(layer, nn.Linear(layer.input_shape[-1], layer.spec.units), _PLAIN), layer.spec)

    def visit_batchnorm(self, layer: LayerInfo) -> nn.Module:
        # momentum is PyTorch's own convention (the weight of the new batch), running_var is updated with the unbiased
        # batch variance: the canonical semantics, natively (harness.spec.BatchNorm). Sync batchnorm: what
        # SyncBatchNorm.convert_sync_batchnorm would turn the layer into, made in place of it so that the canonical
        # names keep pointing at the module trained (convert makes new modules).
        norm: Any = (nn.SyncBatchNorm if self.sync_batchnorm else
                     nn.BatchNorm2d if len(layer.input_shape) == 3 else nn.BatchNorm1d)
        module = norm(layer.input_shape[0], eps=layer.spec.epsilon, momentum=layer.spec.momentum)
        return self._keep(layer, module, {**_PLAIN, "running_mean": "running_mean", "running_var": "running_var"})

    def visit_layernorm(self, layer: LayerInfo) -> nn.Module:
        return self._keep(layer, nn.LayerNorm(layer.input_shape[-1], eps=layer.spec.epsilon), _PLAIN)

    def visit_embedding(self, layer: LayerInfo) -> nn.Module:
        length, dim = layer.output_shape
        return self._keep(layer, L.Embedding(layer.spec.vocab, length, dim),
                          {"token.weight": "token.weight", "position.weight": "position.weight"})

    def visit_attention(self, layer: LayerInfo) -> nn.Module:
        length, dim = layer.input_shape
        module = L.SelfAttention(dim, layer.spec.heads, length if layer.spec.causal else None)
        return self._keep(layer, module, {
            "in_proj.weight": "mha.in_proj_weight", "in_proj.bias": "mha.in_proj_bias",
            "out_proj.weight": "mha.out_proj.weight", "out_proj.bias": "mha.out_proj.bias"})

    def visit_maxpool2d(self, layer: LayerInfo) -> nn.Module:
        return nn.MaxPool2d(layer.spec.pool_size, layer.spec.stride or layer.spec.pool_size)

    def visit_avgpool2d(self, layer: LayerInfo) -> nn.Module:
        return nn.AvgPool2d(layer.spec.pool_size, layer.spec.stride or layer.spec.pool_size)  # no padding

    def visit_global_avgpool2d(self, layer: LayerInfo) -> nn.Module:
        return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())  # (N, C, 1, 1) -> (N, C)

    def visit_sequence_pool(self, layer: LayerInfo) -> nn.Module:
        return L.SequencePool(layer.spec.mode)

    def visit_dropout(self, layer: LayerInfo) -> nn.Module:
        return nn.Dropout(layer.spec.rate)

    def visit_flatten(self, layer: LayerInfo) -> nn.Module:
        return nn.Flatten()  # NCHW flattens channel-first: the canonical order

    def visit_relu(self, layer: LayerInfo) -> nn.Module:
        return nn.ReLU()

    def visit_gelu(self, layer: LayerInfo) -> nn.Module:
        return nn.GELU()  # the exact erf form (approximate="none")

    def visit_softmax(self, layer: LayerInfo) -> nn.Module:
        return nn.Identity()  # folded into the cross-entropy loss


_PLAIN = {"weight": "weight", "bias": "bias"}

