"""MXNet adapter: Gluon ``HybridSequential`` hybridized with ``static_alloc``/``static_shape``, data resident on the
device, NCHW.

MXNet runs every operator asynchronously on its engine's worker threads; errors and results surface at the next
synchronisation point, so ``sync`` is ``mx.nd.waitall`` (https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/
ndarray/ndarray.html#mxnet.ndarray.waitall). The CPU thread count is fixed when libmxnet loads, from ``OMP_NUM_THREADS``
(or ``MXNET_OMP_MAX_THREADS``; unset, half the logical CPUs on x86), and cannot be changed afterwards (see ``prepare``).
MXNet exposes no allocator peak counters, so ``memory_stats`` is empty.
"""

from __future__ import annotations

import builtins
import importlib.metadata
import math
import os
import platform
import re
import warnings
from typing import Any

import numpy as np

# MXNet 1.9.1 is the last release (the project was retired to the Apache Attic in 2023) and it references the numpy
# aliases that numpy 1.24 removed (np.bool, np.int, np.float, np.complex, np.object, np.str) at import time. Restore
# the missing ones, as the builtins they always aliased, before importing it. Probing them warns (FutureWarning on
# numpy 1.25+), hence the filter; importing MXNet itself raises DeprecationWarnings from numpy and distutils.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", DeprecationWarning)
    for _alias in ("bool", "int", "float", "complex", "object", "str"):
        if not hasattr(np, _alias):
            setattr(np, _alias, getattr(builtins, _alias))
    import mxnet as mx
    from mxnet import autograd, gluon, nd
    from mxnet.gluon import nn

from adapters.base import Adapter, DeviceUnavailable

# What libmxnet saw when it loaded (during the import above): its OpenMP thread count is derived from these once.
_THREAD_ENV = ("OMP_NUM_THREADS", "MXNET_OMP_MAX_THREADS", "MXNET_CPU_WORKER_NTHREADS", "MXNET_ENGINE_TYPE")
_ENV_AT_IMPORT = {key: os.environ.get(key) for key in _THREAD_ENV}
_CPUS_AT_IMPORT = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

HYBRIDIZE_FLAGS = {"static_alloc": True, "static_shape": True}


class _PyTorchAdam(mx.optimizer.Adam):
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
        nd.adam_update(weight, grad, mean, var, out=weight, lazy_update=self.lazy_update,
                       lr=lr * bias_correction2_sqrt / bias_correction1, wd=wd, **kwargs)


def _omp_threads() -> int:
    """The OpenMP threads MXNet gives each operator, by its own rule (``OpenMP::OpenMP`` and
    ``GetRecommendedOMPThreadCount`` in src/engine/openmp.cc of MXNet 1.9.1): ``MXNET_OMP_MAX_THREADS`` if set, else
    ``OMP_NUM_THREADS`` if set, else the processor count, halved on x86 (MXNet's guess at hyper-threading)."""
    omp = _ENV_AT_IMPORT["OMP_NUM_THREADS"]
    omp_threads = int(omp.split(",")[0]) if omp and omp.split(",")[0].strip().isdigit() else None
    cap = _ENV_AT_IMPORT["MXNET_OMP_MAX_THREADS"]
    if cap and cap.strip().isdigit():
        return int(cap) if omp_threads is not None else min(int(cap), _CPUS_AT_IMPORT)
    if omp_threads is not None:
        return omp_threads
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    return max(_CPUS_AT_IMPORT // 2, 1) if x86 else _CPUS_AT_IMPORT


class MXNetAdapter(Adapter):
    name = "mxnet"

    def __init__(self) -> None:
        self.ctx = mx.cpu()
        self._threads_requested: int | None = None
        self._last_loss: mx.nd.NDArray | None = None
        self._layers: dict[int, nn.HybridBlock] = {}

    def versions(self) -> dict[str, str]:
        out = {"mxnet": mx.__version__}
        dists = importlib.metadata.packages_distributions().get("mxnet") or []
        if dists:
            # The wheel's name carries its CUDA build (mxnet-cu112: CUDA 11.2); MXNet's Python API has no version call.
            out["mxnet_build"] = f"{dists[0]} {importlib.metadata.version(dists[0])}"
        features = mx.runtime.Features()
        cuda_tag = re.search(r"cu(\d+)(\d)$", dists[0]) if dists else None
        if features.is_enabled("CUDA"):
            out["cuda"] = f"{cuda_tag.group(1)}.{cuda_tag.group(2)}" if cuda_tag else "enabled"
        if features.is_enabled("CUDNN"):
            out["cudnn"] = "enabled"
        if features.is_enabled("MKLDNN"):
            out["mkldnn"] = "enabled"  # oneDNN kernels for convolution, pooling and dense on the CPU
        return out

    def prepare(self, device: str, threads: int | None, seed: int) -> None:
        """``device``: "cpu" -> ``mx.cpu()``; "cuda:N" -> ``mx.gpu(N)``. Raises DeviceUnavailable when this MXNet
        build sees no GPU (``mx.context.num_gpus()`` is 0 on a CPU-only wheel) or N is out of range.

        ``threads`` cannot be applied here: MXNet fixes its per-operator OpenMP thread count when libmxnet loads, from
        ``OMP_NUM_THREADS`` (https://mxnet.apache.org/versions/1.9.1/api/faq/env_var, "MXNET_CPU_WORKER_NTHREADS":
        "To change the number of threads used by individual operators, please set OMP_NUM_THREADS instead"), and
        its C call ``MXSetNumOMPThreads`` only sets the calling Python thread's OpenMP count, not that of the engine
        threads that run the operators (checked on 1.9.1). The worker's launcher sets ``OMP_NUM_THREADS``; the
        request and the count in effect are both in ``settings``. Inter-op parallelism is
        ``MXNET_CPU_WORKER_NTHREADS`` (default 1).
        """
        if device.startswith("cuda"):
            gpus = mx.context.num_gpus()
            if gpus == 0:
                raise DeviceUnavailable(f"MXNet {mx.__version__} sees no CUDA device (a CPU-only build?)")
            index = int(device.partition(":")[2] or 0)
            if index >= gpus:
                raise DeviceUnavailable(f"MXNet sees {gpus} CUDA device(s); {device} is not one")
            # fp32 means fp32, as in the PyTorch adapter: MXNet has no TF32 switch of its own, and cuDNN 8's default
            # math mode allows TF32 on Ampere and later. cuBLAS and cuDNN read NVIDIA_TF32_OVERRIDE when MXNet creates
            # their handles, at its first GPU operator, after this; a value the launcher set is kept.
            os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
            self.ctx = mx.gpu(index)
        else:
            self.ctx = mx.cpu()
        self._threads_requested = threads
        mx.random.seed(seed)

    def build(self, info: Any, weights: dict[str, np.ndarray], optimizer: Any) -> None:
        """Builds the Gluon model of ``info`` with exactly ``weights`` and a ``gluon.Trainer``.

        Conv2D weights are OIHW and Dense weights (out, in): MXNet's own layouts, so the canonical arrays are copied
        in unchanged. A trailing softmax is folded into ``SoftmaxCrossEntropyLoss`` on the logits. The net is
        hybridized with ``static_alloc=True, static_shape=True`` (https://mxnet.apache.org/versions/1.9.1/api/python/
        docs/api/gluon/hybrid_block.html): a new input shape (evaluation's batches, ``predict``) re-plans the cached
        graph, which costs tens of microseconds for this model (measured on 1.9.1; memory stays flat however often the
        shapes alternate), so training, evaluation and ``predict`` share the one graph and need no padding.

        Optimizers, with PyTorch's semantics (``harness.spec.OptimizerSpec``; https://mxnet.apache.org/versions/1.9.1/
        api/python/docs/api/optimizer/index.html): ``sgd`` is MXNet's own, ``state = momentum * state + lr * (grad +
        wd * weight); weight -= state``, PyTorch's update scaled by lr, identical for a constant learning rate.
        ``adam`` is ``_PyTorchAdam``: MXNet's ``adam_update`` kernel with epsilon rescaled each step so that it lands
        where PyTorch puts it (see that class). In both, ``wd`` is an L2 term added to the gradient (coupled), like
        ``weight_decay`` in torch.optim.SGD/Adam. ``multi_precision`` is off (it only matters for float16 weights)
        and ``lazy_update`` is off (it only matters for row_sparse gradients).
        """
        ctx = self.ctx
        net = nn.HybridSequential()
        self._layers = {}
        for layer in info.layers:
            spec = layer.spec
            block: nn.HybridBlock | None = None
            if layer.kind == "conv2d":
                block = nn.Conv2D(spec.filters, spec.kernel_size, in_channels=layer.input_shape[0],
                                  padding=spec.kernel_size // 2 if spec.padding == "same" else 0)
            elif layer.kind == "dense":
                block = nn.Dense(spec.units, in_units=layer.input_shape[0])
            elif layer.kind == "maxpool2d":
                net.add(nn.MaxPool2D(spec.pool_size, spec.stride or spec.pool_size))
            elif layer.kind == "flatten":
                net.add(nn.Flatten())  # NCHW flattens channel-first: the canonical order
            elif layer.kind == "relu":
                net.add(nn.Activation("relu"))
            # softmax: folded into the cross-entropy loss
            if block is not None:
                self._layers[layer.index] = block
                net.add(block)
                if spec.activation == "relu":
                    net.add(nn.Activation("relu"))
        net.initialize(mx.init.Zero(), ctx=ctx)
        for index, block in self._layers.items():
            block.weight.set_data(nd.array(weights[f"{index}.weight"], ctx=ctx, dtype=np.float32))
            block.bias.set_data(nd.array(weights[f"{index}.bias"], ctx=ctx, dtype=np.float32))
        net.hybridize(**HYBRIDIZE_FLAGS)
        self.net = net
        self.loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()  # sparse labels, log-softmax of the logits inside
        if optimizer.name == "sgd":
            opt: mx.optimizer.Optimizer = mx.optimizer.SGD(
                learning_rate=optimizer.learning_rate, momentum=optimizer.momentum, wd=optimizer.weight_decay,
                multi_precision=False, lazy_update=False)
        else:
            opt = _PyTorchAdam(learning_rate=optimizer.learning_rate, beta1=optimizer.beta1, beta2=optimizer.beta2,
                               epsilon=optimizer.epsilon, wd=optimizer.weight_decay, multi_precision=False,
                               lazy_update=False)
        # kvstore=None: one device, the update runs locally on it (no kvstore copy of the weights).
        self.trainer = gluon.Trainer(net.collect_params(), opt, kvstore=None)

    def _to_device_images(self, images: np.ndarray) -> mx.nd.NDArray:
        return nd.array(np.ascontiguousarray(images.transpose(0, 3, 1, 2)), ctx=self.ctx, dtype=np.float32)

    def load(self, data: Any) -> None:
        self.x_train = self._to_device_images(data.x_train)
        self.y_train = nd.array(data.y_train, ctx=self.ctx, dtype=np.int64)
        self.x_test = self._to_device_images(data.x_test)
        self.y_test = nd.array(data.y_test, ctx=self.ctx, dtype=np.int64)
        nd.waitall()

    def train_step(self, indices: np.ndarray) -> None:
        """Gathers the batch on the device (``nd.take``), runs forward and backward under ``autograd.record`` and
        steps the Trainer with ``batch_size = len(indices)``: the backward pass of the per-sample loss vector gives the
        gradient of the sum, which ``Trainer.step`` rescales by 1 / batch_size, so the update uses the mean gradient
        (https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/gluon/trainer.html#mxnet.gluon.Trainer.step).
        Returns once the work is queued; an error in it (an out-of-memory one too) is raised by the next ``sync``.

        The indices go in through ``nd.from_numpy`` (zero-copy DLPack, https://mxnet.apache.org/versions/1.9.1/api/
        python/docs/api/ndarray/ndarray.html#mxnet.ndarray.from_numpy), not ``nd.array``: on the CPU, ``nd.array``
        copies synchronously after waiting for every operator already queued on the CPU (``NDArray::WaitToWrite``
        pushes an empty write to the CPU queue and waits for it), which would make every step wait for the previous
        one. ``from_numpy`` only wraps the memory, so it is given a private copy, which MXNet keeps alive until the
        gather has read it."""
        idx = nd.from_numpy(np.array(indices, dtype=np.int64), zero_copy=True)  # on cpu(0)
        if self.ctx.device_type != "cpu":
            idx = idx.as_in_context(self.ctx)  # an asynchronous copy operator
        x = nd.take(self.x_train, idx)
        y = nd.take(self.y_train, idx)
        with autograd.record():
            loss = self.loss_fn(self.net(x), y)
        loss.backward()
        self.trainer.step(len(indices))
        self._last_loss = loss.mean()

    def sync(self) -> float:
        nd.waitall()
        return float("nan") if self._last_loss is None else float(self._last_loss.asscalar())

    def evaluate(self, batch_size: int) -> tuple[float, float]:
        """Outside ``autograd.record`` Gluon runs in inference mode. Batches of ``batch_size`` and a smaller last one
        reuse the hybridized graph (a new shape re-plans it; no padding is needed)."""
        total_loss = nd.zeros((1,), ctx=self.ctx, dtype=np.float64)
        correct = nd.zeros((1,), ctx=self.ctx, dtype=np.int64)
        n = self.x_test.shape[0]
        for start in range(0, n, batch_size):
            logits = self.net(self.x_test[start:start + batch_size])
            y = self.y_test[start:start + batch_size]
            total_loss += self.loss_fn(logits, y).sum().astype(np.float64)
            correct += (logits.argmax(axis=1).astype(np.int64) == y).sum()
        return float(total_loss.asscalar()) / n, float(correct.asscalar()) / n

    def predict(self, images: np.ndarray) -> np.ndarray:
        logits = self.net(self._to_device_images(images.astype(np.float32)))
        return logits.asnumpy()

    def get_weights(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for index, block in self._layers.items():
            out[f"{index}.weight"] = block.weight.data().asnumpy()  # asnumpy copies to a new host array
            out[f"{index}.bias"] = block.bias.data().asnumpy()
        return out

    def memory_stats(self) -> dict[str, int]:
        """Always empty: MXNet 1.9.1 keeps no allocator peak counters. On a GPU, ``mx.context.gpu_memory_info`` gives
        only the device's current free and total bytes (cudaMemGetInfo), which includes the memory MXNet's pool holds
        and other processes' memory, so it is no peak of MXNet's tensors."""
        return {}

    def settings(self) -> dict[str, Any]:
        """Thread settings as libmxnet read them at import, the hybridize flags and, on a GPU, the memory pool type
        (``MXNET_GPU_MEM_POOL_TYPE``, default "Naive": https://mxnet.apache.org/versions/1.9.1/api/faq/env_var)."""
        out: dict[str, Any] = {
            "intra_op_threads": _omp_threads(),
            "inter_op_threads": int(_ENV_AT_IMPORT["MXNET_CPU_WORKER_NTHREADS"] or 1),
            "threads_requested": self._threads_requested,
            "OMP_NUM_THREADS": _ENV_AT_IMPORT["OMP_NUM_THREADS"] or "",
            "MXNET_OMP_MAX_THREADS": _ENV_AT_IMPORT["MXNET_OMP_MAX_THREADS"] or "",
            "MXNET_CPU_WORKER_NTHREADS": _ENV_AT_IMPORT["MXNET_CPU_WORKER_NTHREADS"] or "",
            "MXNET_ENGINE_TYPE": _ENV_AT_IMPORT["MXNET_ENGINE_TYPE"] or "ThreadedEnginePerDevice",
            "hybridize": dict(HYBRIDIZE_FLAGS),
            "optimizer_impl": "PyTorch semantics on MXNet's SGD / adam_update (epsilon * sqrt(1 - beta2^t))",
        }
        if self.ctx.device_type == "gpu":
            out["MXNET_GPU_MEM_POOL_TYPE"] = os.environ.get("MXNET_GPU_MEM_POOL_TYPE", "Naive")
            out["MXNET_CUDNN_AUTOTUNE_DEFAULT"] = os.environ.get("MXNET_CUDNN_AUTOTUNE_DEFAULT", "1")
            out["NVIDIA_TF32_OVERRIDE"] = os.environ.get("NVIDIA_TF32_OVERRIDE", "")
        return out

    def is_oom(self, exc: BaseException) -> bool:
        # MXNet raises every C++ failure as mxnet.base.MXNetError (a RuntimeError), so the message tells OOM apart.
        # A failed cudaMalloc is reported with cudaGetErrorString(cudaErrorMemoryAllocation) = "out of memory" (e.g.
        # "cudaMalloc retry failed: out of memory" from the pooled storage manager); the CPU storage manager reports a
        # failed allocation as "Failed to allocate CPU Memory" (src/storage/cpu_device_storage.h), the counterpart of
        # PyTorch's "DefaultCPUAllocator: can't allocate memory". A tensor over MXNet's 2^31-element limit fails a
        # shape check instead ("Size of tensor you are trying to allocate is larger than 2^31 elements"): not an OOM.
        if not isinstance(exc, mx.base.MXNetError):
            return False
        message = str(exc).lower()
        return "out of memory" in message or "failed to allocate cpu memory" in message
