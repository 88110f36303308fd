"""The canonical optimizers (``harness.spec.OptimizerSpec``) on MXNet's own kernels, with PyTorch's semantics
(https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/optimizer/index.html): ``sgd`` is MXNet's own, ``state =
momentum * state + lr * (grad + wd * weight); weight -= state``, PyTorch's update scaled by lr, identical for a constant
learning rate. ``adam`` is ``PyTorchAdam``: MXNet's ``adam_update`` kernel with epsilon rescaled each step so that it
lands where PyTorch puts it. In both, ``wd`` is an L2 term added to the gradient (coupled), like ``weight_decay`` in
torch.optim.SGD/Adam. ``multi_precision`` is off (it only matters for float16 weights) and ``lazy_update`` is off (it
only matters for row_sparse gradients)."""

from __future__ import annotations

import math
from typing import Any

from adapters.mxnet.runtime import mx
from harness.spec import OptimizerSpec


class PyTorchAdam(mx.optimizer.Adam):
    """``torch.optim.Adam`` on MXNet's fused ``adam_update`` kernel (coupled L2 weight decay, no amsgrad).

    MXNet 1.9.1's ``Adam.update`` (mxnet/optimizer/optimizer.py) passes the kernel ``lr * sqrt(1 - beta2^t) /
    (1 - beta1^t)`` and ``epsilon``, and the kernel computes ``weight -= lr' * m / (sqrt(v) + epsilon)``: epsilon is
    added to sqrt(v) before the bias correction (Keras's form). PyTorch adds it after: ``weight -= lr / (1 - beta1^t)
    * m / (sqrt(v) / sqrt(1 - beta2^t) + epsilon)``. Passing ``epsilon * sqrt(1 - beta2^t)`` at step t makes the two
    the same update (as the TensorFlow adapter does for ``ResourceApplyAdam``).

    This is MXNet's ``Adam.update`` with that one change, so epsilon uses the same per-parameter step count t as
    MXNet's own learning-rate correction (``_index_update_count``, advanced by ``_update_count``). Both scalars are
    computed in float64 from an integer t, as PyTorch computes its bias corrections, and become the kernel's float32
    parameters. Nothing here waits for the engine: t and the scalars are Python numbers and ``adam_update`` is queued
    like any operator. The per-parameter path is the only one Adam has: its ``aggregate_num`` is 0 (only SGD, LARS
    and LAMB set it from ``MXNET_OPTIMIZER_AGGREGATION_SIZE``), so ``Updater`` calls ``update`` once per parameter.
    """

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        self._update_count(index)
        lr = self._get_lr(index)
        wd = self._get_wd(index)
        t = self._index_update_count[index]
        bias_correction1 = 1.0 - self.beta1 ** t
        bias_correction2_sqrt = math.sqrt(1.0 - self.beta2 ** t)
        kwargs: dict[str, Any] = {"beta1": self.beta1, "beta2": self.beta2,
                                  "epsilon": self.epsilon * bias_correction2_sqrt, "rescale_grad": self.rescale_grad}
        if self.clip_gradient:
            kwargs["clip_gradient"] = self.clip_gradient
        mean, var = state
        mx.nd.adam_update(weight, grad, mean, var, out=weight, lazy_update=self.lazy_update,
                          lr=lr * bias_correction2_sqrt / bias_correction1, wd=wd, **kwargs)


def optimizer_for(optimizer: OptimizerSpec) -> Any:
    """MXNet's SGD, or ``PyTorchAdam``, for the canonical optimizer spec."""
    if optimizer.name == "sgd":
        return mx.optimizer.SGD(learning_rate=optimizer.learning_rate, momentum=optimizer.momentum,
                                wd=optimizer.weight_decay, multi_precision=False, lazy_update=False)
    return PyTorchAdam(learning_rate=optimizer.learning_rate, beta1=optimizer.beta1, beta2=optimizer.beta2,
                       epsilon=optimizer.epsilon, wd=optimizer.weight_decay, multi_precision=False, lazy_update=False)
