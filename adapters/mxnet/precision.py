"""MXNet's mixed precision: AMP for fp16 (initialised once per process) and its dynamic loss scaling.

Design: docs/design/framework-caveats.md#mxnet (why no bf16 or tf32: the declaration's notes).
"""

from __future__ import annotations

from typing import Any

from adapters.mxnet.runtime import amp

#: The AMP target dtype of each precision this adapter trains in (None: no AMP); the plan lets no other through (the
#: declaration's ``precisions``).
AMP_DTYPES: dict[str, str | None] = {"fp32": None, "fp16": "float16"}
# What amp.init set up in this process: it rewrites mx.nd's and mx.sym's operators in place and cannot be undone.
_amp_target: str | None = None


def init_amp(precision: str) -> str | None:
    """Initialises MXNet's AMP for ``precision`` once per process and returns its target dtype ("float16"), or None
    for fp32. Raises RuntimeError when AMP already runs in this process for a different precision (``amp.init``
    wraps ``mx.nd``'s and ``mx.sym``'s operator functions in place, for every net built or traced afterwards, and has
    no inverse: the worker runs one trial per process, so this only guards against reusing a process).

    fp16 (``amp.init(target_dtype="float16")``, https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/contrib/
    amp/index.html), with AMP's own op lists (mxnet/contrib/amp/lists/symbol_fp16.py): parameters stay float32 (the
    master weights: ``amp_cast`` is inserted between a parameter and an fp16 operator, so gradients reach the
    parameters as float32, and the optimizer state is float32; ``multi_precision`` stays off); ``Convolution`` and
    ``FullyConnected`` run in float16; ``softmax``, ``log_softmax`` (so the loss), ``LayerNorm`` and ``mean`` in
    float32; ``batch_dot`` and the adds in the widest dtype of their inputs. Where AMP differs from the shared
    policy: ``BatchNorm`` is dtype-neutral in AMP, so it takes the float16 output of a convolution (its gamma, beta and
    running statistics stay float32 in MXNet's fp16 BatchNorm); so are pooling, relu, gelu, reshapes and dropout;
    attention's score product is float16 (both inputs come from a float16 dense layer), its softmax and the product
    with v float32 (the causal mask is float32, see ``adapters.mxnet.layers.SelfAttention``); the logits are the
    float16 output of the last dense layer, widened to float32 by the loss and by ``predict``. The loss is scaled
    dynamically (``amp.init_trainer``, ``scaled``)."""
    global _amp_target
    target = AMP_DTYPES[precision]
    if _amp_target is not None and target != _amp_target:
        raise RuntimeError(f"MXNet's AMP was initialised for {_amp_target} in this process and cannot be undone; "
                           f"{precision} needs a fresh process")
    if target is not None and _amp_target is None:
        amp.init(target_dtype=target)
        _amp_target = target
    return target


def init_trainer(trainer: Any) -> None:
    """Dynamic loss scaling on ``trainer`` (``amp.init_trainer``: its ``_amp_loss_scaler``, ``LossScaler`` in
    mxnet/contrib/amp/loss_scaler.py: 2^16 to start, doubled after 2000 steps without overflow, at most 2^24)."""
    amp.init_trainer(trainer)


def loss_scale(trainer: Any) -> float:
    """The current loss scale of ``trainer`` (``init_trainer``'s ``LossScaler``), by which ``scaled`` multiplies the
    loss."""
    return float(trainer._amp_loss_scaler.loss_scale)


def scaled(loss: Any, trainer: Any) -> Any:
    """``loss`` (float32 (B,), or data-parallel a list of each context's) as backward should see it under AMP, inside
    ``autograd.record``: ``amp.scale_loss``'s loss times the current loss scale, which also sets the Trainer's
    rescaling to 1 / scale so that ``Trainer.step`` unscales the gradients; the step checks them for inf/nan first and
    skips the update (halving the scale) when there are any (https://mxnet.apache.org/versions/1.9.1/api/python/docs/
    api/contrib/amp/index.html). That check copies one flag to the host (``asnumpy``), so in fp16 every training step
    waits for its own gradients before it returns."""
    with amp.scale_loss(loss, trainer) as out:
        return out
