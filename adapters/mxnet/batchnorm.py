"""MXNet's batchnorm running variance made canonical: where its kernel updates the running variance with the biased
batch variance (the CPU's), each training step corrects it to the canonical update with the unbiased one
(``harness.spec.BatchNorm``). A training mechanic: it works on the batchnorm blocks of any Gluon model whose layers'
momentum and input shape are known (``BatchNormLayer``; the neutral builder gives them, ``adapters.mxnet.neutral``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from adapters.mxnet.runtime import autograd, gluon, mx, nd, nn

_PROBED: dict[tuple[str, int, int, bool, int], bool] = {}


@dataclass(frozen=True)
class BatchNormLayer:
    """A batchnorm layer of a model: its Gluon block (``nn.BatchNorm`` or ``gluon.contrib.nn.SyncBatchNorm``), the
    canonical momentum (the weight of the new batch: MXNet's own is 1 - it) and the per-sample input shape (C, H, W)
    or (F,)."""

    block: Any
    momentum: float
    shape: tuple[int, ...]

    @property
    def per_sample(self) -> int:
        """Values per channel in one sample: H x W, or 1 on a flat input."""
        return int(np.prod(self.shape[1:]))


def running_var_is_biased(ctx: Any, shape: tuple[int, ...], hybridize: Mapping[str, bool] | None = None,
                          sync_contexts: Sequence[Any] = ()) -> bool:
    """Whether MXNet's BatchNorm on ``ctx``, for inputs of per-sample ``shape`` (C, H, W) or (F,), updates its running
    variance with the biased batch variance (the canonical update uses the unbiased one, harness.spec.BatchNorm).

    It differs by device in MXNet 1.9.1: the CPU kernels (native and oneDNN) use the biased variance, cuDNN's kernel
    the unbiased one (https://github.com/apache/mxnet/issues/18751, #14357). So it is measured, not assumed: one
    training step of a fresh BatchNorm with momentum 0 (the running variance becomes the batch's) on two samples of
    ``shape`` with at most 2 x 2 spatial positions (n = 2 to 8 values per channel, so n / (n - 1) is far from 1), run
    like the real net (hybridized with the flags ``hybridize``, or imperatively for None; forward and backward),
    compared with both variances. With ``sync_contexts`` (data-parallel synchronised batchnorm) it is
    ``gluon.contrib.nn.SyncBatchNorm`` over those contexts, two samples on each, compared with the variances of all of
    them (the global batch). Cached per (device, rank, channels, mode, contexts); raises RuntimeError if it matches
    neither."""
    key = (str(ctx), len(shape), shape[0], hybridize is not None, len(sync_contexts))
    if key not in _PROBED:
        contexts = list(sync_contexts) or [ctx]
        probe_shape = (2 * len(contexts), shape[0], *(min(d, 2) for d in shape[1:]))
        x = np.random.default_rng(0).standard_normal(probe_shape).astype(np.float32)
        block = (gluon.contrib.nn.SyncBatchNorm(in_channels=shape[0], num_devices=len(contexts), momentum=0.0)
                 if sync_contexts else nn.BatchNorm(axis=1, momentum=0.0, in_channels=shape[0]))
        block.initialize(mx.init.Zero(), ctx=contexts)
        if hybridize is not None:
            block.hybridize(**hybridize)
        data = [nd.array(x[2 * i:2 * i + 2], ctx=c) for i, c in enumerate(contexts)]
        with autograd.record():
            outs = [block(part) for part in data]
        autograd.backward(outs)
        nd.waitall()  # the CPU kernel's write of the running variance in backward is not declared to the engine
        got = block.running_var.data(contexts[0]).asnumpy().astype(np.float64)
        axes = (0, *range(2, x.ndim))
        biased = x.astype(np.float64).var(axis=axes)
        n = x.size // shape[0]
        if np.allclose(got, biased, rtol=1e-4):
            _PROBED[key] = True
        elif np.allclose(got, biased * n / (n - 1), rtol=1e-4):
            _PROBED[key] = False
        else:
            raise RuntimeError(f"MXNet's {type(block).__name__} on {ctx} updated its running variance to {got}, "
                               f"neither the biased ({biased}) nor the unbiased batch variance")
    return _PROBED[key]


class RunningVariance:
    """The correction of the batchnorm ``layers`` whose kernel on ``ctx`` (the first device) updates the running
    variance with the biased batch variance (``running_var_is_biased``, probed with the model's ``hybridize`` flags
    and, for synchronised batchnorm, its ``sync_contexts``). ``corrected``: those layers (empty on a GPU, where
    cuDNN's kernel is canonical already)."""

    def __init__(self, layers: Sequence[BatchNormLayer], ctx: Any, hybridize: Mapping[str, bool] | None,
                 sync_contexts: Sequence[Any] = ()):
        self.corrected = [layer for layer in layers
                          if running_var_is_biased(ctx, layer.shape, hybridize, sync_contexts)]

    def __bool__(self) -> bool:
        return bool(self.corrected)

    def before(self, ctx: Any) -> list[Any]:
        """Copies of context ``ctx``'s running variances of the corrected layers, taken before a step's forward pass
        (queued copy operators)."""
        return [layer.block.running_var.data(ctx).copy() for layer in self.corrected]

    def correct(self, before: list[Any], batch: int, ctx: Any) -> None:
        """Turns the running variance that a biased-variance kernel wrote in this forward and backward into the
        canonical one. With r the running variance before the step (``before``), v the biased batch variance, n the
        values per channel in the batch (``batch`` samples x the layer's values per sample) and c = n / (n - 1), MXNet
        wrote r' = (1 - m) r + m v, the canonical value is (1 - m) r + m c v = c r' - (c - 1)(1 - m) r: exact algebra
        on the two running values, queued like any operator (no wait), five small ops per layer. Raises ValueError for
        n < 2.

        The CPU kernel writes r' inside the backward pass without declaring that write to MXNet's engine (the running
        statistics are read-only inputs of the backward node), so an operator that only reads the running variance
        may run before the write (observed: it does). gamma's gradient is a declared output of the same backward
        kernel: ``reshape_like(var, gamma.grad())``, the running variance itself, reads it, which orders the
        correction after that kernel. Data-parallel: on context ``ctx``'s copy, with ``batch`` the samples its
        batchnorm normalised over (the shard's, or with SyncBatchNorm the global batch's)."""
        for layer, old in zip(self.corrected, before):
            n = batch * layer.per_sample
            if n < 2:
                raise ValueError(f"batchnorm needs more than 1 value per channel in a training batch, got {n}")
            c = n / (n - 1)
            var = layer.block.running_var.data(ctx)
            written = nd.reshape_like(var, layer.block.gamma.grad(ctx))  # = var, once the backward kernel is done
            nd.elemwise_sub(written * c, old * ((c - 1.0) * (1.0 - layer.momentum)), out=var)
