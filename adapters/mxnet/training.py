"""The MXNet adapter's training machinery, apart from its model: MXNet's AMP for fp16 (once per process) and the
optimizers with PyTorch's semantics. Imported by ``adapters.mxnet.adapter`` only."""

from __future__ import annotations

import math
from typing import Any

from adapters.mxnet.runtime import amp, mx

#: The AMP target dtype of each precision this adapter trains in (None: no AMP).
_AMP_DTYPES = {"fp32": None, "fp16": "float16"}
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
    dynamically (``amp.init_trainer``, ``amp.scale_loss``; ``train_step``)."""
    global _amp_target
    if precision not in _AMP_DTYPES:
        raise ValueError(f"the mxnet adapter does not train in {precision}")
    target = _AMP_DTYPES[precision]
    if _amp_target is not None and target != _amp_target:
        raise RuntimeError(f"MXNet's AMP was initialised for {_amp_target} in this process and cannot be undone; "
                           f"{precision} needs a fresh process")
    if target is not None and _amp_target is None:
        amp.init(target_dtype=target)
        _amp_target = target
    return target


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

    def update(self, index, weight, grad, state):
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



def optimizer_for(optimizer: Any) -> Any:
    """MXNet's SGD, or ``PyTorchAdam``, for the canonical optimizer spec (see ``MXNetAdapter.build``)."""
    if optimizer.name == "sgd":
        return mx.optimizer.SGD(learning_rate=optimizer.learning_rate, momentum=optimizer.momentum,
                                wd=optimizer.weight_decay, multi_precision=False, lazy_update=False)
    return PyTorchAdam(learning_rate=optimizer.learning_rate, beta1=optimizer.beta1, beta2=optimizer.beta2,
                        epsilon=optimizer.epsilon, wd=optimizer.weight_decay, multi_precision=False, lazy_update=False)
