"""Blocks of the neutral model: the residual block, y = activation(body(x) + shortcut(x)).

The body's layers are analysed like top-level layers, named "<i>.<j>" (body layer j of block i) and found at spec
path "<i>.body.<j>". A projection shortcut is two ordinary layers, so that adapters build it with the code they
have for any conv2d and batchnorm: a 1x1 conv2d without bias named "<i>.shortcut" and a batchnorm named
"<i>.shortcut_bn" (PyTorch's defaults, momentum 0.1 and epsilon 1e-5).
"""

from __future__ import annotations

import math
from typing import Any

from harness.neutral.info import LayerInfo, ModelError, Site
from harness.neutral.shapes import layer_info
from harness.spec import BatchNorm, Conv2D, Residual


def residual(site: Site, block: Residual, shape: tuple[int, ...]) -> LayerInfo:
    """The analysed block: its body (in order), its shortcut (empty for identity, else the projection conv and
    batchnorm), output shape the body's, FLOPs the sum of the body's and the projection's (the addition and the
    activation are not counted). Raises ModelError naming the body or the layer that does not fit."""
    body: list[LayerInfo] = []
    current = shape
    for j, layer in enumerate(block.body):
        body.append(layer_info(site.child(str(j), f"body.{j}"), layer, current))
        current = body[-1].output_shape
    shortcut: tuple[LayerInfo, ...] = ()
    if current != shape:
        if block.shortcut == "identity":
            raise ModelError(f"{site.path}.body", f"the body changes {shape} to {current} and shortcut is identity; "
                                                  "keep the shape, or use shortcut: auto for a projection")
        shortcut = _projection(site, block, shape, current)
    flops = sum(layer.forward_flops for layer in (*body, *shortcut))
    return LayerInfo(site.index, block, shape, current, {}, flops, {}, site.name, site.path, tuple(body), shortcut)


def projection_stride(shape: tuple[int, ...], out: tuple[int, ...]) -> int | None:
    """The stride s = ceil(H / H') of the 1x1 projection from (C, H, W) to (C', H', W'), or None when no stride
    gives exactly H' x W' (a 1x1 convolution without padding outputs floor((H - 1) / s) + 1)."""
    (_, hin, win), (_, hout, wout) = shape, out
    stride = max(1, math.ceil(hin / hout))
    return stride if ((hin - 1) // stride + 1, (win - 1) // stride + 1) == (hout, wout) else None


def _projection(site: Site, block: Residual, shape: tuple[int, ...], out: tuple[int, ...]) -> tuple[LayerInfo, ...]:
    where = f"{site.path}.body"
    if len(shape) != 3 or len(out) != 3:
        raise ModelError(where, f"the body changes {shape} to {out}; a projection shortcut maps (C, H, W) to "
                                "(C', H', W') only: keep the shape of a flat or sequence input")
    stride = projection_stride(shape, out)
    if stride is None:
        raise ModelError(where, f"the body changes {shape} to {out}, which no 1x1 convolution stride of the "
                                "projection shortcut gives; keep the shape or halve it")
    conv: Any = Conv2D(type="conv2d", filters=out[0], kernel_size=1, stride=stride, padding="valid", use_bias=False,
                       kernel_init=block.shortcut_init)
    conv_info = layer_info(Site(site.index, f"{site.name}.shortcut", f"{site.path}.shortcut"), conv, shape)
    norm = layer_info(Site(site.index, f"{site.name}.shortcut_bn", f"{site.path}.shortcut_bn"),
                      BatchNorm(type="batchnorm"), out)
    return conv_info, norm
