"""A float64 reference forward pass of the whole neutral model (layers and residual blocks, images and tokens),
written from the canonical definitions in ``harness.spec.layers`` and ``harness.neutral.models``, independently of
every framework. ``tests.adapters.kit.numpy_forward`` is the older one for the plain layers; this one covers blocks,
strided and padded convolutions, layernorm, gelu, embedding, attention and sequence pooling, in inference mode
(batchnorm on its running statistics, dropout the identity)."""

from __future__ import annotations

import math

import numpy as np
from scipy.special import erf


def forward(info, weights: dict[str, np.ndarray], inputs: np.ndarray) -> np.ndarray:
    """Logits for ``inputs`` (NHWC float images, or (N, L) int64 token ids): (N, classes), or (N, L, vocab) for a
    next-token model."""
    x = inputs.astype(np.float64).transpose(0, 3, 1, 2) if info.task == "image_classification" else inputs
    for layer in info.layers:
        x = _layer(layer, weights, x)
    return x


def _w(weights: dict[str, np.ndarray], name: str) -> np.ndarray:
    return weights[name].astype(np.float64)


def _activation(x: np.ndarray, activation: str) -> np.ndarray:
    return np.maximum(x, 0) if activation == "relu" else gelu(x) if activation == "gelu" else x


def gelu(x: np.ndarray) -> np.ndarray:
    """The exact GELU: x * Phi(x) = x / 2 * (1 + erf(x / sqrt(2)))."""
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def conv2d(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, stride: int, pad: int) -> np.ndarray:
    """(N, C, H, W) * (O, C, k, k) with ``pad`` zeros on every side and ``stride``."""
    k = w.shape[-1]
    x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    n, c, h, wd = x.shape
    ho, wo = (h - k) // stride + 1, (wd - k) // stride + 1
    patches = np.stack([x[:, :, i:i + stride * (ho - 1) + 1:stride, j:j + stride * (wo - 1) + 1:stride]
                        for i in range(k) for j in range(k)], axis=-1)
    out = np.einsum("nchwk,ock->nohw", patches, w.reshape(w.shape[0], c, k * k))
    return out if b is None else out + b[None, :, None, None]


def attention(x: np.ndarray, weights: dict[str, np.ndarray], name: str, heads: int, causal: bool) -> np.ndarray:
    """Multi-head self-attention on (N, L, D) in the canonical (torch.nn.MultiheadAttention) layout."""
    n, length, dim = x.shape
    qkv = x @ _w(weights, f"{name}.in_proj.weight").T + _w(weights, f"{name}.in_proj.bias")
    q, k, v = (part.reshape(n, length, heads, dim // heads).transpose(0, 2, 1, 3) for part in np.split(qkv, 3, -1))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dim // heads)
    if causal:
        scores = np.where(np.triu(np.ones((length, length), dtype=bool), 1), -np.inf, scores)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    context = (scores / scores.sum(axis=-1, keepdims=True)) @ v
    context = context.transpose(0, 2, 1, 3).reshape(n, length, dim)
    return context @ _w(weights, f"{name}.out_proj.weight").T + _w(weights, f"{name}.out_proj.bias")


def _layer(layer, weights: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    spec, kind, name = layer.spec, layer.kind, layer.name
    if kind == "residual":
        out = x
        for child in layer.body:
            out = _layer(child, weights, out)
        shortcut = x
        for child in layer.shortcut:
            shortcut = _layer(child, weights, shortcut)
        return _activation(out + shortcut, spec.activation)
    if kind == "conv2d":
        pad = spec.kernel_size // 2 if spec.padding == "same" else 0 if spec.padding == "valid" else spec.padding
        bias = _w(weights, f"{name}.bias") if spec.use_bias else None
        return _activation(conv2d(x, _w(weights, f"{name}.weight"), bias, spec.stride, pad), spec.activation)
    if kind == "dense":
        return _activation(x @ _w(weights, f"{name}.weight").T + _w(weights, f"{name}.bias"), spec.activation)
    if kind == "batchnorm":
        shape = (1, -1, 1, 1) if x.ndim == 4 else (1, -1)
        mean = weights.get(f"{name}.running_mean", np.zeros(x.shape[1])).astype(np.float64).reshape(shape)
        var = weights.get(f"{name}.running_var", np.ones(x.shape[1])).astype(np.float64).reshape(shape)
        return ((x - mean) / np.sqrt(var + spec.epsilon) * _w(weights, f"{name}.weight").reshape(shape)
                + _w(weights, f"{name}.bias").reshape(shape))
    if kind == "layernorm":
        mean, var = x.mean(axis=-1, keepdims=True), x.var(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(var + spec.epsilon) * _w(weights, f"{name}.weight") + _w(weights, f"{name}.bias")
    if kind == "embedding":
        return _w(weights, f"{name}.token.weight")[x] + _w(weights, f"{name}.position.weight")[None, :x.shape[1]]
    if kind == "attention":
        return attention(x, weights, name, spec.heads, spec.causal)
    if kind == "sequence_pool":
        return x.mean(axis=1) if spec.mode == "mean" else x[:, -1]
    if kind in ("maxpool2d", "avgpool2d"):
        p, s = spec.pool_size, spec.stride or spec.pool_size
        ho, wo = layer.output_shape[1:]
        windows = np.stack([x[:, :, i:i + s * ho:s, j:j + s * wo:s] for i in range(p) for j in range(p)])
        return windows.max(axis=0) if kind == "maxpool2d" else windows.mean(axis=0)
    if kind == "global_avgpool2d":
        return x.mean(axis=(2, 3))
    if kind == "flatten":
        return x.reshape(x.shape[0], -1)
    if kind == "relu":
        return np.maximum(x, 0)
    if kind == "gelu":
        return gelu(x)
    if kind in ("dropout", "softmax"):
        return x
    raise ValueError(f"no reference for {kind} layers")
