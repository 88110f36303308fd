"""fp16's dynamic loss scaling, one rule for every framework that writes it itself (TensorFlow's and JAX's adapters;
PyTorch's ``torch.amp.GradScaler`` and MXNet's AMP have the same defaults built in).

float16's range is too small for small gradients (bfloat16 has float32's and needs none): the loss is multiplied by
the scale before the gradients are taken and the float32 gradients divided by it; a step whose gradients are not all
finite is skipped and the scale halved; after ``LOSS_SCALE_GROWTH_STEPS`` finite steps in a row the scale doubles.
The defaults of ``torch.amp.GradScaler`` (https://docs.pytorch.org/docs/stable/amp.html#gradient-scaling: initial
scale 2 ** 16, factors 2 and 0.5, 2000 steps), so that every framework skips the same early steps (Keras's
``LossScaleOptimizer`` starts at 2 ** 15).
"""

from __future__ import annotations

#: The scale the first fp16 step multiplies its loss by.
LOSS_SCALE_INIT = 2.0 ** 16
#: Finite steps in a row after which the scale doubles.
LOSS_SCALE_GROWTH_STEPS = 2000
#: What a finite run of ``LOSS_SCALE_GROWTH_STEPS`` multiplies the scale by, and what a non-finite step does.
LOSS_SCALE_GROWTH, LOSS_SCALE_BACKOFF = 2.0, 0.5


def next_loss_scale(scale: float, good_steps: int, finite: bool) -> tuple[float, int]:
    """(scale, finite steps in a row) after one step, as plain numbers: the rule each framework writes in its own ops
    (a tf.cond, a jnp.where); tests hold those to this. Halved and 0 after a non-finite step; doubled and 0 when the
    count reaches ``LOSS_SCALE_GROWTH_STEPS``; else the same scale and the count plus one."""
    if not finite:
        return scale * LOSS_SCALE_BACKOFF, 0
    good_steps += 1
    if good_steps >= LOSS_SCALE_GROWTH_STEPS:
        return scale * LOSS_SCALE_GROWTH, 0
    return scale, good_steps
