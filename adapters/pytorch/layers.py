"""The PyTorch adapter's blocks for the neutral layers ``torch.nn`` has no module of its own for (the residual block,
token plus position embedding, self-attention on (B, L, D) with the canonical weights, sequence pooling), and the
activation a layer spec names. Imported by ``adapters.pytorch.adapter``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.neutral.native import output_logits


def activated(module: nn.Module, spec: Any) -> nn.Module:
    """``module`` followed by its spec's activation (relu, gelu in its exact erf form, or none)."""
    activation = getattr(spec, "activation", "none")
    if activation == "none":
        return module
    return nn.Sequential(module, nn.ReLU() if activation == "relu" else nn.GELU())


class Residual(nn.Module):
    """y = activation(body(x) + shortcut(x)); an empty shortcut is the identity."""

    def __init__(self, body: nn.Sequential, shortcut: nn.Sequential, relu: bool):
        super().__init__()
        self.body, self.shortcut, self.relu = body, shortcut, relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x) + self.shortcut(x)
        return F.relu(out) if self.relu else out


class Embedding(nn.Module):
    """Token plus learned position embedding: (B, L) int64 ids -> (B, L, D)."""

    def __init__(self, vocab: int, length: int, dim: int):
        super().__init__()
        self.token, self.position = nn.Embedding(vocab, dim), nn.Embedding(length, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.token(ids) + self.position.weight[:ids.shape[1]]


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` as self-attention on (B, L, D), its weights in the canonical layout as they are
    (in_proj_weight (3D, D): q, k, v rows; out_proj); causal with a boolean mask of the keys after each query
    (https://pytorch.org/docs/stable/generated/torch.nn.MultiheadAttention.html)."""

    def __init__(self, dim: int, heads: int, causal_length: int | None):
        super().__init__()
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=True)
        mask = None if causal_length is None else torch.triu(
            torch.ones(causal_length, causal_length, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, need_weights=False, attn_mask=self.mask, is_causal=self.mask is not None)[0]


class SequencePool(nn.Module):
    """(B, L, D) -> (B, D): the mean over positions, or the last position."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1) if self.mode == "mean" else x[:, -1]


class Network(nn.Sequential):
    """The model: its layers in order, as ``nn.Sequential``, with a ``forward`` of its own. A model compiled inside
    ``DistributedDataParallel`` (``torch.compile(DDP(net))``) is only compiled from the wrapped module's own frame
    (DDP's forward graph-breaks, and TorchDynamo skips frames of torch's own code such as ``nn.Sequential.forward``),
    so the wrapped module's forward must be code outside torch: with a plain ``nn.Sequential`` nothing is compiled
    (torch 2.13; https://github.com/pytorch/pytorch/issues/140416)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self:
            x = module(x)
        return x


class Logits(nn.Module):
    """A model of your own whose output becomes the logits the harness trains on: a tensor as it is, a model output's
    ``logits`` (transformers' ``ModelOutput``), or the first element of a tuple or list. ``module`` keeps its own
    parameter names under ``module.``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = output_logits(self.module(x), torch.Tensor, "the model returned", "a tensor")
        return logits
