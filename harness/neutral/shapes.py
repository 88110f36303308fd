"""The shape, parameter and FLOP rules of every plain layer (not a block), per sample and channel-first.

``layer_info(site, layer, shape, vocab)`` is one layer's ``LayerInfo`` for an input of ``shape``: (C, H, W) images,
(F,) flat features, (L, D) sequences, or, for the first layer of a model fed tokens (``vocab`` given), (L,) token
ids. The conventions (canonical layouts, what counts as a FLOP) are ``harness.neutral.models``'s docstring.
Raises ``ModelError`` naming the layer's path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from harness.neutral.info import LayerInfo, ModelError, Site


def layer_info(site: Site, layer: Any, shape: tuple[int, ...], vocab: int | None = None) -> LayerInfo:
    """One plain layer's output shape, parameters, buffers and forward FLOPs for an input of ``shape``.

    vocab: the dataset's vocabulary when the input is token ids (the first layer of a token model), else None."""
    kind = layer.type
    if vocab is not None and kind != "embedding":
        raise ModelError(site.path, f"a model fed token sequences must start with an embedding layer, not {kind}")
    if kind == "embedding":
        return _embedding(site, layer, shape, vocab)
    rule = _RULES.get(kind)
    if rule is None:  # pragma: no cover - the spec's union admits nothing else
        raise ModelError(site.path, f"unsupported layer {layer!r}")
    return rule(site, layer, shape)


def _info(site: Site, layer: Any, shape: tuple[int, ...], out: tuple[int, ...],
          params: dict[str, tuple[int, ...]] | None = None, flops: int = 0,
          buffers: dict[str, tuple[int, ...]] | None = None) -> LayerInfo:
    return LayerInfo(site.index, layer, shape, out, params or {}, flops, buffers or {}, site.name, site.path)


def image_input(site: Site, kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` when it is (C, H, W); raises ModelError naming ``kind`` otherwise."""
    if len(shape) != 3:
        hint = "; is it after flatten?" if kind == "conv2d" and len(shape) == 1 else ""
        raise ModelError(site.path, f"{kind} needs a (C, H, W) input, got {shape}{hint}")
    return shape


def _conv2d(site: Site, layer: Any, shape: tuple[int, ...]) -> LayerInfo:
    """Output floor((H + 2p - k) / s) + 1 (``same``: H, stride 1 only); FLOPs 2 x Ho x Wo x O x C x k x k, the
    real output positions of a strided convolution."""
    cin, hin, win = image_input(site, "conv2d", shape)
    k, s = layer.kernel_size, layer.stride
    if layer.padding == "same":
        if k % 2 == 0:
            raise ModelError(site.path, "padding 'same' needs an odd kernel_size (frameworks pad even kernels "
                                        "differently)")
        pad = k // 2
    else:
        pad = 0 if layer.padding == "valid" else int(layer.padding)
    if hin + 2 * pad < k or win + 2 * pad < k:
        padded = f" (padded by {pad})" if pad else ""
        raise ModelError(site.path, f"kernel_size {k} is larger than the {hin}x{win} input{padded}")
    hout, wout = (hin + 2 * pad - k) // s + 1, (win + 2 * pad - k) // s + 1
    params: dict[str, tuple[int, ...]] = {"weight": (layer.filters, cin, k, k)}
    if layer.use_bias:
        params["bias"] = (layer.filters,)
    return _info(site, layer, shape, (layer.filters, hout, wout), params, 2 * hout * wout * layer.filters * cin * k * k)


def _pool(site: Site, layer: Any, shape: tuple[int, ...]) -> LayerInfo:
    cin, hin, win = image_input(site, layer.type, shape)
    p, s = layer.pool_size, layer.stride or layer.pool_size
    if p > hin or p > win:
        raise ModelError(site.path, f"pool_size {p} is larger than the {hin}x{win} input")
    return _info(site, layer, shape, (cin, (hin - p) // s + 1, (win - p) // s + 1))


def _global_pool(site: Site, layer: Any, shape: tuple[int, ...]) -> LayerInfo:
    return _info(site, layer, shape, (image_input(site, layer.type, shape)[0],))


def _batchnorm(site: Site, layer: Any, shape: tuple[int, ...]) -> LayerInfo:
    if len(shape) not in (1, 3):
        hint = "; use layernorm on a sequence" if len(shape) == 2 else ""
        raise ModelError(site.path, f"batchnorm needs a (C, H, W) or a flat input, got {shape}{hint}")
    c = shape[0]
    return _info(site, layer, shape, shape, {"weight": (c,), "bias": (c,)}, 0,
                 {"running_mean": (c,), "running_var": (c,)})


def _layernorm(site: Site, layer: Any, shape: tuple[int, ...]) -> LayerInfo:
    if len(shape) not in (1, 2):
        raise ModelError(site.path, f"layernorm needs a flat (F,) or a sequence (L, D) input, got {shape}")
    d = shape[-1]
    return _info(site, layer, shape, shape, {"weight": (d,), "bias": (d,)})


def _flatten(site: Site, layer: Any, shape: tuple[int, ...]) -> LayerInfo:
    return _info(site, layer, shape, (int(np.prod(shape)),))


def _dense(site: Site, layer: Any, shape: tuple[int, ...]) -> LayerInfo:
    """(F,) -> (units,), or per position (L, D) -> (L, units); FLOPs 2 x in x units per position."""
    if len(shape) not in (1, 2):
        raise ModelError(site.path, f"dense needs a flat input, got {shape}; add a flatten layer before it")
    positions, width = (1, shape[0]) if len(shape) == 1 else shape
    out = (layer.units,) if len(shape) == 1 else (positions, layer.units)
    return _info(site, layer, shape, out, {"weight": (layer.units, width), "bias": (layer.units,)},
                 2 * positions * width * layer.units)


def _same_shape(site: Site, layer: Any, shape: tuple[int, ...]) -> LayerInfo:
    return _info(site, layer, shape, shape)


def _sequence_input(site: Site, kind: str, shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ModelError(site.path, f"{kind} needs a sequence (L, D) input, got {shape}")
    return shape


def _embedding(site: Site, layer: Any, shape: tuple[int, ...], vocab: int | None) -> LayerInfo:
    if vocab is None:
        raise ModelError(site.path, f"embedding needs token ids: it must be the first layer of a model fed token "
                                    f"sequences (its input here is {shape})")
    if layer.vocab < vocab:
        raise ModelError(site.path, f"embedding vocab {layer.vocab} is smaller than the dataset's {vocab} tokens")
    (length,) = shape
    return _info(site, layer, shape, (length, layer.dim),
                 {"token.weight": (layer.vocab, layer.dim), "position.weight": (length, layer.dim)})


def attention_flops(length: int, width: int) -> int:
    """One sample's forward FLOPs of self-attention on (L, D): q, k, v projections 2·L·D·3D, scores 2·L·L·D,
    weighted values 2·L·L·D, output projection 2·L·D·D; a causal mask is counted as the full L x L (dense kernels
    compute it all)."""
    return 2 * length * width * 3 * width + 2 * length * length * width * 2 + 2 * length * width * width


def _attention(site: Site, layer: Any, shape: tuple[int, ...]) -> LayerInfo:
    length, width = _sequence_input(site, "attention", shape)
    if width % layer.heads:
        raise ModelError(site.path, f"attention width {width} is not divisible by its {layer.heads} heads")
    params = {"in_proj.weight": (3 * width, width), "in_proj.bias": (3 * width,),
              "out_proj.weight": (width, width), "out_proj.bias": (width,)}
    return _info(site, layer, shape, shape, params, attention_flops(length, width))


def _sequence_pool(site: Site, layer: Any, shape: tuple[int, ...]) -> LayerInfo:
    return _info(site, layer, shape, (_sequence_input(site, "sequence_pool", shape)[1],))


_RULES = {"conv2d": _conv2d, "maxpool2d": _pool, "avgpool2d": _pool, "global_avgpool2d": _global_pool,
          "batchnorm": _batchnorm, "layernorm": _layernorm, "flatten": _flatten, "dense": _dense,
          "relu": _same_shape, "gelu": _same_shape, "dropout": _same_shape, "softmax": _same_shape,
          "attention": _attention, "sequence_pool": _sequence_pool}
