"""What the TensorFlow adapter's step does with the gradients (``adapters.tensorflow.training``): dense gradients,
fp16's dynamic loss scaling, and the optimizer update with PyTorch's semantics on TF's fused training kernels
(``make_update``). Written against plain ``tf.Variable``s, whatever model holds them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from harness.neutral.precision import (
    LOSS_SCALE_BACKOFF,
    LOSS_SCALE_GROWTH,
    LOSS_SCALE_GROWTH_STEPS,
    LOSS_SCALE_INIT,
)
from harness.spec import OptimizerSpec


def dense_gradients(grads: list[Any]) -> list[Any]:
    """The gradients as dense tensors: an embedding's (``tf.gather`` of its table) is a ``tf.IndexedSlices`` of the
    rows looked up (https://www.tensorflow.org/api_docs/python/tf/IndexedSlices), which ``tf.convert_to_tensor``
    scatters into the full (vocab, D) gradient, zero elsewhere: what PyTorch's dense embedding gradient is, and what
    the fused optimizer kernels and the accumulation sums take. Other gradients pass as they are."""
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


class DynamicLossScale:
    """Dynamic loss scaling for float16 training, the algorithm of https://www.tensorflow.org/guide/mixed_precision
    (its "Loss scaling" sections) and of Keras's ``LossScaleOptimizer``
    (https://keras.io/api/mixed_precision/loss_scale_optimizer/), here around the adapter's own optimizer, with the
    harness's constants and rule (``harness.neutral.precision``: ``next_loss_scale``): the loss is multiplied by the
    scale before the gradients are taken (so that small float16 gradients do not flush to zero) and the float32
    gradients divided by it; when any of them is not finite the optimizer step is skipped and the scale multiplied
    by ``LOSS_SCALE_BACKOFF`` (halved), and after ``growth_steps`` (``LOSS_SCALE_GROWTH_STEPS``, 2000) finite steps in
    a row by ``LOSS_SCALE_GROWTH`` (doubled). The scale (float32) and the count (int64) are non-trainable variables,
    created on the current device (or under the current strategy's scope), updated inside the train step. The
    initial scale is ``LOSS_SCALE_INIT`` = 2^16, PyTorch's ``GradScaler`` default and the JAX adapter's (Keras
    starts at 2^15), so that every framework skips the same early steps. ``growth_steps`` is read when the train
    step is traced (its first call)."""

    def __init__(self, initial: float = LOSS_SCALE_INIT, growth_steps: int = LOSS_SCALE_GROWTH_STEPS) -> None:
        self.scale = tf.Variable(initial, dtype=tf.float32, trainable=False, name="loss_scale")
        self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="loss_scale_good_steps")
        self.growth_steps = growth_steps

    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        return loss * self.scale

    def unscale(self, grads: list[tf.Tensor]) -> list[tf.Tensor]:
        return [g / self.scale for g in grads]

    def apply(self, grads: list[tf.Tensor], update: Callable[[list[tf.Tensor]], None]) -> None:
        """``update(grads)`` and the scale's growth count when every gradient is finite, else the scale backed off
        and the count reset (``tf.cond``: the branch not taken does not run); ``next_loss_scale``'s rule."""
        finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in grads]))

        def step() -> tf.Tensor:
            update(grads)
            grow = self.good_steps + 1 >= self.growth_steps
            self.scale.assign(tf.where(grow, self.scale * LOSS_SCALE_GROWTH, self.scale))
            self.good_steps.assign(tf.where(grow, tf.constant(0, tf.int64), self.good_steps + 1))
            return tf.constant(True)

        def skip() -> tf.Tensor:
            self.scale.assign(self.scale * LOSS_SCALE_BACKOFF)
            self.good_steps.assign(0)
            return tf.constant(False)

        tf.cond(finite, step, skip)


def make_update(opt: OptimizerSpec, variables: list[tf.Variable]) -> Callable[[list[tf.Tensor]], None]:
    """The optimizer step with PyTorch's semantics, on TF's fused training kernels (one op per variable, the kernels
    behind ``tf.compat.v1.train``'s optimizers; https://www.tensorflow.org/api_docs/python/tf/raw_ops/
    ResourceApplyMomentum and .../ResourceApplyAdam). Weight decay is coupled L2, as in PyTorch: g <- g +
    weight_decay * p. The state variables are created here, on the current device, zero-initialized like PyTorch's.

    sgd: ``ResourceApplyMomentum`` computes accum <- momentum * accum + g; p <- p - lr * accum, which is
    ``torch.optim.SGD`` with dampening 0 and no Nesterov (PyTorch's first step sets accum = g: the same from 0).
    adam: ``ResourceApplyAdam`` computes p <- p - lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps'), with
    epsilon added before the bias correction (Keras's form); ``torch.optim.Adam`` adds it after, p <- p - lr /
    (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps). Passing eps' = eps * sqrt(1 - b2^t) each step makes the two
    the same update.
    """
    lr, wd = float(opt.learning_rate), float(opt.weight_decay)

    def f32(x: Any) -> tf.Tensor:  # built while the train step is traced: graph constants, not captures
        return tf.cast(x, tf.float32)

    def decayed(g: tf.Tensor, p: tf.Variable) -> tf.Tensor:
        return g + wd * p if wd else g

    if opt.name == "sgd":
        if not opt.momentum:
            def sgd(grads: list[tf.Tensor]) -> None:
                for g, p in zip(grads, variables):
                    tf.raw_ops.ResourceApplyGradientDescent(var=p.handle, alpha=f32(lr), delta=decayed(g, p))
            return sgd
        momentum = float(opt.momentum)
        accums = [tf.Variable(tf.zeros_like(p), trainable=False) for p in variables]

        def sgd_momentum(grads: list[tf.Tensor]) -> None:
            for g, p, accum in zip(grads, variables, accums):
                tf.raw_ops.ResourceApplyMomentum(var=p.handle, accum=accum.handle, lr=f32(lr), grad=decayed(g, p),
                                                 momentum=f32(momentum), use_nesterov=False)
        return sgd_momentum

    beta1, beta2, eps = float(opt.beta1), float(opt.beta2), float(opt.epsilon)
    step = tf.Variable(0.0, dtype=tf.float64, trainable=False)
    m = [tf.Variable(tf.zeros_like(p), trainable=False) for p in variables]
    v = [tf.Variable(tf.zeros_like(p), trainable=False) for p in variables]

    def adam(grads: list[tf.Tensor]) -> None:
        t = step.assign_add(1.0)
        # The bias corrections in double precision, as PyTorch computes them, then float32 for the kernel.
        beta1_power = tf.pow(tf.constant(beta1, tf.float64), t)
        beta2_power = tf.pow(tf.constant(beta2, tf.float64), t)
        scalars = {"lr": f32(lr), "beta1": f32(beta1), "beta2": f32(beta2), "beta1_power": f32(beta1_power),
                   "beta2_power": f32(beta2_power), "epsilon": f32(eps * tf.sqrt(1.0 - beta2_power))}
        for g, p, m_i, v_i in zip(grads, variables, m, v):
            tf.raw_ops.ResourceApplyAdam(var=p.handle, m=m_i.handle, v=v_i.handle, grad=decayed(g, p),
                                         use_locking=False, use_nesterov=False, **scalars)
    return adam
