"""MXNet adapter: a Gluon ``HybridSequential``, hybridized with ``static_alloc``/``static_shape`` in the "compiled"
mode (the default) and imperative in "eager", data resident on the device or fed by Gluon's ``DataLoader`` (``input:
loader``), NCHW images and (N, L, D) sequences, the canonical weights copied in unchanged. ``MXNetAdapter``
implements ``adapters.base.Adapter``; the blocks Gluon lacks (residual, embedding, attention, sequence pooling) are
``adapters.mxnet.layers``', AMP and the optimizers ``adapters.mxnet.training``'. Precisions: fp32 everywhere, fp16
on a CUDA GPU (AMP); bf16 and tf32 are not declared.

Design: docs/design/framework-caveats.md#mxnet (the asynchronous engine, threads, the two modes, why no bf16 or tf32).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from adapters.base import (
    Adapter,
    DeviceUnavailable,
    data_parallel_gap,
    device_index,
    device_kind,
    micro_batch_size,
    shard,
)
from adapters.mxnet import DECLARATION, layers, training
from adapters.mxnet.runtime import amp, autograd, gluon, mx, nd, nn
from harness.neutral.models import initial_buffers

# What libmxnet saw when it loaded (during the import above): its OpenMP thread count is derived from these once.
_THREAD_ENV = ("OMP_NUM_THREADS", "MXNET_OMP_MAX_THREADS", "MXNET_CPU_WORKER_NTHREADS", "MXNET_ENGINE_TYPE")
_ENV_AT_IMPORT = {key: os.environ.get(key) for key in _THREAD_ENV}
_CPUS_AT_IMPORT = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

HYBRIDIZE_FLAGS = {"static_alloc": True, "static_shape": True}

_PROBED: dict[tuple[str, int, int, bool, int], bool] = {}


def _running_var_is_biased(ctx: mx.Context, shape: tuple[int, ...], hybridized: bool = True,
                           sync_contexts: tuple[mx.Context, ...] = ()) -> bool:
    """Whether MXNet's BatchNorm on ``ctx``, for inputs of per-sample ``shape`` (C, H, W) or (F,), updates its running
    variance with the biased batch variance (the canonical update uses the unbiased one, harness.spec.BatchNorm).

    It differs by device in MXNet 1.9.1: the CPU kernels (native and oneDNN) use the biased variance, cuDNN's kernel
    the unbiased one (https://github.com/apache/mxnet/issues/18751, #14357). So it is measured, not assumed: one
    training step of a fresh BatchNorm with momentum 0 (the running variance becomes the batch's) on two samples of
    ``shape`` with at most 2 x 2 spatial positions (n = 2 to 8 values per channel, so n / (n - 1) is far from 1), run
    like the real net (``hybridized`` or not, forward and backward), compared with both variances. With
    ``sync_contexts`` (data-parallel synchronised batchnorm) it is ``gluon.contrib.nn.SyncBatchNorm`` over those
    contexts, two samples on each, compared with the variances of all of them (the global batch). Cached per
    (device, rank, channels, mode, contexts); raises RuntimeError if it matches neither."""
    key = (str(ctx), len(shape), shape[0], hybridized, len(sync_contexts))
    if key not in _PROBED:
        contexts = list(sync_contexts) or [ctx]
        probe_shape = (2 * len(contexts), shape[0], *(min(d, 2) for d in shape[1:]))
        x = np.random.default_rng(0).standard_normal(probe_shape).astype(np.float32)
        block = (gluon.contrib.nn.SyncBatchNorm(in_channels=shape[0], num_devices=len(contexts), momentum=0.0)
                 if sync_contexts else nn.BatchNorm(axis=1, momentum=0.0, in_channels=shape[0]))
        block.initialize(mx.init.Zero(), ctx=contexts)
        if hybridized:
            block.hybridize(**HYBRIDIZE_FLAGS)
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


class MXNetAdapter(Adapter, declaration=DECLARATION):
    def __init__(self) -> None:
        self.ctx = mx.cpu()
        # every device's context: [self.ctx], or data-parallel (``options.data_parallel``) one per device, the first
        # being self.ctx (evaluation, predict, get_weights)
        self._contexts: list[mx.Context] = [self.ctx]
        self._sync_batchnorm = False  # data-parallel with SyncBatchNorm instead of BatchNorm
        self._threads_requested: int | None = None
        # the losses since the last read, on the device: (B, k) -> float32 (B,) per-sample sums for k = 1, (1,) sums
        # over the B samples for k > 1 micro-batches; data-parallel (B, 1, d) -> device d's (B / N,) per-sample sums on
        # its context. Each step's loss is the sum of its keys' sums / B. And the steps in them.
        self._loss_sums: dict[tuple[int, ...], mx.nd.NDArray] = {}
        self._loss_steps = 0
        # the blocks that hold parameters, by canonical layer name ("0", "3.1", "3.shortcut_bn"), and every parameter
        # and buffer by canonical full name: (Gluon parameter, trained), in info.param_names()/buffer_names() order
        self._layers: dict[str, nn.HybridBlock] = {}
        self._tensors: dict[str, tuple[Any, bool]] = {}
        self.tokens = False  # token inputs (N, L) rather than images
        self._memory_limit: dict[str, Any] = {}  # the GPU memory limit requested and (not) applied, for settings()
        # (block, canonical momentum, values per channel in one sample) of each batchnorm whose kernel updates the
        # running variance with the biased batch variance, corrected in train_step (see _fix_running_variances)
        self._variance_fixups: list[tuple[nn.BatchNorm, float, int]] = []
        self._precision = "fp32"
        self._amp_dtype: str | None = None  # AMP's target dtype ("float16"), None without AMP
        self._hybridized = True
        self._staged: list[mx.nd.NDArray] = []  # this epoch's order on each device (stage_epoch)
        self._staged_batch = 0  # its samples per step
        self._train: list[tuple[mx.nd.NDArray, mx.nd.NDArray]] = []  # the resident training set on each device (load)
        self._loader: Any = None  # input: loader: open_loader's gluon.data.DataLoader
        self._batches = _EpochBatches()  # its batch sampler, set before each epoch (epoch_batches)
        self._loader_settings: dict[str, Any] = {}  # open_loader's DataLoader, for settings()

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

    def device_problem(self, device: str) -> str | None:
        """mx.context.num_gpus() (https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/mxnet/context/): 0 in
        a CPU-only wheel (``mxnet``; the CUDA builds are ``mxnet-cuXXX``) or without a driver."""
        if not device.startswith("cuda"):
            return None
        gpus = mx.context.num_gpus()
        if gpus == 0:
            return f"MXNet {mx.__version__} sees no CUDA device (a CPU-only build, or no driver)"
        index = device_index(device)
        return None if index < gpus else f"MXNet sees {gpus} CUDA device(s); {device} is not one"

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
            if (problem := self.device_problem(device)) is not None:
                raise DeviceUnavailable(problem)
            index = device_index(device)
            # fp32 means fp32, as in the PyTorch adapter: MXNet has no TF32 switch of its own, and cuDNN 8's default
            # math mode allows TF32 on Ampere and later. cuBLAS and cuDNN read NVIDIA_TF32_OVERRIDE when MXNet creates
            # their handles, at its first GPU operator, after this; a value the launcher set is kept.
            os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
            self.ctx = mx.gpu(index)
            if self.options.memory_limit_bytes:
                # MXNet 1.9.1 has no per-process cap on GPU memory (MXNET_GPU_MEM_POOL_RESERVE only sets how much
                # of the device its pool leaves free for other uses, https://mxnet.apache.org/versions/1.9.1/api/faq/
                # env_var), so nothing is applied and settings say so.
                self._memory_limit = {"memory_limit_bytes": None, "memory_limit": "not supported by MXNet on GPU",
                                      "memory_limit_requested_bytes": self.options.memory_limit_bytes}
        else:
            self.ctx = mx.cpu()
        self._contexts, self._sync_batchnorm = [self.ctx], False
        if self.options.data_parallel is not None:
            self._prepare_data_parallel(self.options.data_parallel, device)
        self._threads_requested = threads
        mx.random.seed(seed)

    def _prepare_data_parallel(self, parallel: Any, device: str) -> None:
        """One Gluon context per device of the trial (``DataParallel.devices``): "cpu:i" is ``mx.cpu(i)``, "cuda:i"
        ``mx.gpu(i)``; the first is ``self.ctx``. One process drives them all. On the CPU the contexts are one
        physical device, but each is a device of its own to MXNet: its own arrays, its own engine worker threads
        (``ThreadedEnginePerDevice`` keeps ``MXNET_CPU_WORKER_NTHREADS`` workers per CPU context, each operator with
        ``OMP_NUM_THREADS`` OpenMP threads), and the kvstore copies and sums across them for real. Raises
        DeviceUnavailable for a multi-process trial, a device of another kind than ``device``'s, or a GPU this build
        does not see."""
        contexts = []
        for name, (kind, index) in zip(parallel.devices, parallel.one_process_devices("mxnet")):
            if kind != device_kind(device) or kind not in ("cpu", "cuda"):
                raise DeviceUnavailable(f"the data-parallel trial's device {name} is not a {device_kind(device)} "
                                        f"device like the trial's ({device})")
            if kind == "cuda" and (problem := self.device_problem(name)) is not None:
                raise DeviceUnavailable(problem)
            contexts.append(mx.gpu(index) if kind == "cuda" else mx.cpu(index))
        self._contexts, self.ctx = contexts, contexts[0]
        self._sync_batchnorm = parallel.sync_batchnorm

    def unsupported(self, info: Any) -> str | None:
        """``Adapter.unsupported``, and data-parallel what this adapter lacks on its device kind
        (``adapters.base.data_parallel_gap``): synchronised batchnorm on the CPU (the declaration's
        ``sync_batchnorm_note`` says why)."""
        if len(self._contexts) > 1:
            kind = "cpu" if self.ctx.device_type == "cpu" else "cuda"
            why = data_parallel_gap(self.declaration, info, len(self._contexts), self._sync_batchnorm, kind)
            if why is not None:
                return why
        return super().unsupported(info)

    def _check_sync_batchnorm(self, info: Any) -> None:
        """Raises ValueError when the trial asks for synchronised batchnorm, ``info`` has batchnorm, and this adapter
        cannot: on the CPU (``unsupported``), or in fp16 (MXNet 1.9.1's SyncBatchNorm "does not support FP16
        training")."""
        if not (self._sync_batchnorm and any(layer.kind == "batchnorm" for layer in info.walk())):
            return
        if (why := self.unsupported(info)) is not None:
            raise ValueError(why)  # on the CPU
        if self._precision != "fp32":
            raise ValueError(f"the mxnet adapter has no synchronised batchnorm in {self._precision}: MXNet "
                             f"1.9.1's SyncBatchNorm 'does not support FP16 training'")

    def _trainer(self, opt: Any) -> gluon.Trainer:
        """The ``gluon.Trainer`` of ``self._params`` with optimizer ``opt``. One device: kvstore=None, the update runs
        locally on it (no kvstore copy of the weights).

        Data-parallel: Gluon's own default kvstore, "device" (https://mxnet.apache.org/versions/1.9.1/api/python/docs/
        api/gluon/trainer.html, https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/kvstore/): its CommDevice
        sums each gradient over the contexts in a merge buffer on one of the devices themselves (on GPUs with
        peer-to-peer copies where it can; "local" would sum on the host and copy back) and broadcasts the sum back into
        every context's gradient (pushpull, Trainer._allreduce_grads). update_on_kvstore=False: every context then
        applies the same update to its own copy with its own optimizer state (Trainer._update), as
        DistributedDataParallel does: AMP's dynamic loss scaling needs the update after the all-reduce (it checks the
        reduced gradients for overflow and skips the step), and it keeps the all-reduce a phase of its own
        (Trainer.allreduce_grads / Trainer.update). The kvstore is created here, not at the first step: Trainer
        creates it lazily and then broadcasts context 0's copy of every parameter to the others, the running
        statistics included, which at the first step would overwrite each context's own statistics with context 0's
        (and read them while the CPU batchnorm kernel may still be writing them: see _fix_running_variances). Here
        every copy is the same; allreduce_grads creates the kvstore, broadcasts, and sums the still-zero gradients."""
        if len(self._contexts) == 1:
            return gluon.Trainer(self._params, opt, kvstore=None)
        trainer = gluon.Trainer(self._params, opt, kvstore="device", update_on_kvstore=False)
        trainer.allreduce_grads()
        nd.waitall()
        return trainer

    def build(self, info: Any, weights: dict[str, np.ndarray], optimizer: Any) -> None:
        """Builds the Gluon model of ``info`` with exactly ``weights`` and a ``gluon.Trainer``.

        Conv2D weights are OIHW and Dense weights (out, in): MXNet's own layouts, so the canonical arrays are copied
        in unchanged; so are batchnorm's and layernorm's gamma and beta, batchnorm's running statistics (from
        ``weights``' buffers if it has them, else ``harness.neutral.models.initial_buffers``), the embedding tables
        and attention's projections (``adapters.mxnet.layers.params``). A trailing softmax is folded into
        ``SoftmaxCrossEntropyLoss`` on the logits. Batchnorm is ``nn.BatchNorm(axis=1)`` with MXNet's momentum = 1 -
        the canonical one; where its kernel updates the running variance with the biased batch variance (the CPU's;
        see ``_running_var_is_biased``), ``train_step`` corrects it to the canonical unbiased update
        (``_fix_running_variances``), inside residual blocks and their shortcuts too. Dropout is ``nn.Dropout``,
        active only under ``autograd.record``. Images are NCHW, token ids (N, L) and sequences (N, L, D). In the
        ``compiled`` mode (``options.compile``, the default) the net is hybridized with ``static_alloc=True,
        static_shape=True`` (https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/gluon/hybrid_block.html);
        ``eager`` leaves it imperative. ``options.precision`` fp16 initialises AMP first
        (``adapters.mxnet.training.init_amp``); a precision or mode this adapter lacks on the device raises ValueError.
        In the compiled mode a new input shape (evaluation's batches, ``predict``) re-plans the cached graph, which
        costs tens of microseconds for this model (measured on 1.9.1; memory stays flat however often the shapes
        alternate), so training, evaluation and ``predict`` share the one graph and need no padding.

        Optimizers, with PyTorch's semantics (``harness.spec.OptimizerSpec``; https://mxnet.apache.org/versions/1.9.1/
        api/python/docs/api/optimizer/index.html): ``sgd`` is MXNet's own, ``state = momentum * state + lr * (grad +
        wd * weight); weight -= state``, PyTorch's update scaled by lr, identical for a constant learning rate.
        ``adam`` is ``adapters.mxnet.training.PyTorchAdam``: MXNet's ``adam_update`` kernel with epsilon rescaled
        each step so that it lands where PyTorch puts it (see that class). In both, ``wd`` is an L2 term added to the
        gradient (coupled), like ``weight_decay`` in torch.optim.SGD/Adam. ``multi_precision`` is off (it only matters
        for float16 weights) and ``lazy_update`` is off (it only matters for row_sparse gradients).
        """
        ctx = self.ctx
        self._precision = self.options.precision
        mode = self.compile_mode(self.options.compile)
        kind = "cpu" if ctx.device_type == "cpu" else "cuda"
        if (why := self.unsupported_execution(self._precision, mode, kind)) is not None:
            raise ValueError(why)
        self._hybridized = mode == "compiled"
        self._check_sync_batchnorm(info)
        # before the net's first forward pass traces or runs anything
        self._amp_dtype = training.init_amp(self._precision)
        net = nn.HybridSequential()
        self._layers, self._tensors = {}, {}
        self._variance_fixups = []
        self.tokens = info.task != "image_classification"
        for layer in info.layers:
            self._add_layer(net, layer, ctx)
        net.initialize(mx.init.Zero(), ctx=self._contexts)  # data-parallel: a copy on every context
        buffers = {**initial_buffers(info), **{k: v for k, v in weights.items() if k in info.buffer_names()}}
        for name, (param, trained) in self._tensors.items():
            param.set_data(nd.array((weights if trained else buffers)[name], ctx=ctx, dtype=np.float32))
        if self._hybridized:
            net.hybridize(**HYBRIDIZE_FLAGS)
        self.net = net
        # sparse labels, log-softmax of the logits inside, over the last axis (the classes, or each position's
        # vocabulary); a per-sample loss, the mean over a sequence's positions for next-token logits (N, L, V)
        self.loss_fn = gluon.loss.SoftmaxCrossEntropyLoss(axis=-1)
        opt = training.optimizer_for(optimizer)
        self._params = net.collect_params()
        self._grad_req = "write"
        self.trainer = self._trainer(opt)
        self._loss_sums, self._loss_steps = {}, 0
        if self._amp_dtype is not None:
            amp.init_trainer(self.trainer)  # dynamic loss scaling (see _scaled)

    def _add_layer(self, net: Any, layer: Any, ctx: Any) -> None:
        """Appends one canonical layer's or residual block's Gluon blocks to ``net``; a block with parameters is kept
        in ``self._layers`` and its parameters and buffers in ``self._tensors``, by canonical name."""
        spec, kind = layer.spec, layer.kind
        block: nn.HybridBlock | None = None
        if kind == "residual":
            body = nn.HybridSequential()
            for child in layer.body:
                self._add_layer(body, child, ctx)
            shortcut = nn.HybridSequential() if layer.shortcut else None
            for child in layer.shortcut:  # the projection: a strided 1x1 conv without bias, then a batchnorm
                self._add_layer(shortcut, child, ctx)
            net.add(layers.Residual(body, shortcut, spec.activation == "relu"))
        elif kind == "conv2d":
            padding = (spec.kernel_size // 2 if spec.padding == "same" else 0 if spec.padding == "valid"
                       else spec.padding)  # an integer: that many zeros on every side
            block = nn.Conv2D(spec.filters, spec.kernel_size, strides=spec.stride, padding=padding,
                              use_bias=spec.use_bias, in_channels=layer.input_shape[0])
        elif kind == "dense":
            # on (N, F), or per position on (N, L, D): flatten=False applies the weight to the last axis only
            block = nn.Dense(spec.units, in_units=layer.input_shape[-1], flatten=len(layer.input_shape) == 1)
        elif kind == "batchnorm":
            # MXNet's momentum is the weight of the old running value: 1 - the canonical momentum. axis 1: the
            # channels of NCHW or the features of a flat input.
            if self._sync_batchnorm:
                # data-parallel over the global batch: mean and variance summed over the contexts (a barrier and a
                # reduction across the contexts' engine threads inside the operator, forward and backward)
                block = gluon.contrib.nn.SyncBatchNorm(in_channels=layer.input_shape[0],
                                                       num_devices=len(self._contexts),
                                                       momentum=1.0 - spec.momentum, epsilon=spec.epsilon)
            else:
                block = nn.BatchNorm(axis=1, momentum=1.0 - spec.momentum, epsilon=spec.epsilon,
                                     in_channels=layer.input_shape[0])
            sync = tuple(self._contexts) if self._sync_batchnorm else ()
            if _running_var_is_biased(ctx, layer.input_shape, self._hybridized, sync):
                per_sample = int(np.prod(layer.input_shape[1:]))  # values per channel in one sample: H x W or 1
                self._variance_fixups.append((block, spec.momentum, per_sample))
        elif kind == "layernorm":  # over the last axis, biased variance (MXNet's LayerNorm, as torch.nn.LayerNorm)
            block = nn.LayerNorm(axis=-1, epsilon=spec.epsilon, in_channels=layer.input_shape[-1])
        elif kind == "embedding":
            length, dim = layer.output_shape
            block = layers.Embedding(spec.vocab, length, dim)
        elif kind == "attention":
            block = layers.SelfAttention(layer.input_shape[1], spec.heads, spec.causal)
        elif kind == "maxpool2d":
            net.add(nn.MaxPool2D(spec.pool_size, spec.stride or spec.pool_size))
        elif kind == "avgpool2d":
            net.add(nn.AvgPool2D(spec.pool_size, spec.stride or spec.pool_size))  # no padding: whole windows
        elif kind == "global_avgpool2d":
            net.add(nn.GlobalAvgPool2D(), nn.Flatten())  # (N, C, 1, 1) -> (N, C)
        elif kind == "sequence_pool":
            net.add(layers.SequencePool(spec.mode))
        elif kind == "dropout":
            net.add(nn.Dropout(spec.rate))  # active only under autograd.record(), i.e. in train_step
        elif kind == "flatten":
            net.add(nn.Flatten())  # NCHW flattens channel-first: the canonical order
        elif kind == "relu":
            net.add(nn.Activation("relu"))
        elif kind == "gelu":
            net.add(nn.GELU())  # the exact erf form (see _activation)
        # softmax: folded into the cross-entropy loss
        if block is not None:
            self._layers[layer.name] = block
            held = layers.params(block)
            for local in (*layer.params, *layer.buffers):
                self._tensors[f"{layer.name}.{local}"] = (held[local], local in layer.params)
            net.add(block)
            activation = _activation(getattr(spec, "activation", "none"))
            if activation is not None:
                net.add(activation)

    def _to_device_inputs(self, inputs: np.ndarray, ctx: mx.Context | None = None) -> mx.nd.NDArray:
        """NHWC float32 images as NCHW, or (N, L) token ids as int64, on ``ctx`` (default the first device)."""
        ctx = self.ctx if ctx is None else ctx
        if self.tokens:
            return nd.array(inputs, ctx=ctx, dtype=np.int64)
        return nd.array(np.ascontiguousarray(inputs.transpose(0, 3, 1, 2)), ctx=ctx, dtype=np.float32)

    def load(self, data: Any) -> None:
        """Images (NCHW float32) or token ids (N, L) int64, and int64 labels ((N,), or (N, L) for a next-token
        model), resident on the device. Data-parallel: the training set resident on every device (each gathers its
        shard of a step from its own copy, as a Gluon user's ``split_and_load`` would place each device's slice), the
        test set on the first (evaluation). With ``options.input == "loader"`` the test set only (the training batches
        come from ``open_loader``'s DataLoader)."""
        if self.options.input == "resident":
            self._train = [(self._to_device_inputs(data.x_train, ctx),
                            nd.array(data.y_train, ctx=ctx, dtype=np.int64)) for ctx in self._contexts]
            self.x_train, self.y_train = self._train[0]
        self.x_test = self._to_device_inputs(data.x_test)
        self.y_test = nd.array(data.y_test, ctx=self.ctx, dtype=np.int64)
        nd.waitall()

    def set_train_images(self, images: np.ndarray) -> None:
        """Copies ``images`` (float32 NHWC) over the resident training images (NCHW) in place (``x[:] = ...``), on
        every device."""
        nchw = np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype=np.float32)
        for x, _ in self._train:
            x[:] = nchw

    def stage_epoch(self, order: np.ndarray, samples_per_step: int) -> None:
        """The epoch's order on the device as one int64 NDArray (``Adapter.stage_epoch``), whose slices (views, no
        copy) are the steps' indices: ``nd.from_numpy`` of a private copy (zero-copy DLPack; MXNet holds the copy
        until the last operator that reads it is done), then ``as_in_context`` on a GPU (one asynchronous copy an
        epoch); data-parallel, one such array on every device. Measured on 1.9.1 on this project's CPU: wrapping a
        step's indices with ``from_numpy`` costs 60 us and the gather that reads them then 157 us, against 8 us for a
        slice and 33 us for its gather; one call an epoch instead of one a step (at batch 64 on digits 0.3 ms of a 4 ms
        step went to indices before this)."""
        order = np.ascontiguousarray(order, dtype=np.int64)
        wrapped = nd.from_numpy(np.array(order, dtype=np.int64), zero_copy=True)
        self._staged = [wrapped.as_in_context(ctx) for ctx in self._contexts]
        self._staged_batch = samples_per_step

    def _indices(self, indices: np.ndarray, position: int | None, device: int = 0) -> mx.nd.NDArray:
        """``indices`` as an int64 NDArray on device ``device``'s context: step ``position``'s slice of the staged
        epoch (``stage_epoch``), else their own."""
        staged = self._staged
        if position is not None and staged:
            start = position * self._staged_batch
            if len(indices) == self._staged_batch and start + len(indices) <= staged[device].shape[0]:
                return staged[device][start:start + len(indices)]
        return self._wrap(indices, self._contexts[device])

    def _shards(self, indices: np.ndarray, position: int | None) -> list[mx.nd.NDArray]:
        """Data-parallel: device d's part of the step, ``adapters.base.shard(indices, N, d)``, as an int64 NDArray on
        its context: a slice of the staged step (a view), or its own wrapped copy."""
        n = len(self._contexts)
        parts = [shard(indices, n, d) for d in range(n)]  # raises ValueError unless N divides B
        per = len(parts[0])
        staged = self._staged
        if position is not None and staged and len(indices) == self._staged_batch:
            start = position * self._staged_batch
            if start + len(indices) <= staged[0].shape[0]:
                return [staged[d][start + d * per:start + (d + 1) * per] for d in range(n)]
        return [self._wrap(part, ctx) for part, ctx in zip(parts, self._contexts)]

    def _wrap(self, indices: np.ndarray, ctx: mx.Context | None = None) -> mx.nd.NDArray:
        """A private int64 copy of ``indices`` wrapped by ``nd.from_numpy`` (``train_step``'s docstring says why not
        ``nd.array``), on cpu(0), then moved to ``ctx`` (default the first device) by an asynchronous copy operator
        unless it is cpu(0)."""
        idx = nd.from_numpy(np.array(indices, dtype=np.int64), zero_copy=True)
        return idx.as_in_context(self.ctx if ctx is None else ctx)  # the array itself when already there

    def train_step(self, indices: np.ndarray, micro_batches: int = 1, position: int | None = None) -> None:
        """Gathers the batch on the device (``nd.take``), runs forward and backward under ``autograd.record`` and
        steps the Trainer with ``batch_size = len(indices)``: the backward pass of the per-sample loss vector gives the
        gradient of the sum, which ``Trainer.step`` rescales by 1 / batch_size, so the update uses the mean gradient
        (https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/gluon/trainer.html#mxnet.gluon.Trainer.step).
        Returns once the work is queued; an error in it (an out-of-memory one too) is raised by the next ``wait`` or
        loss read. The loss goes into the per-sample running sum (``_loss_sums``) with one queued operator a step.

        With ``micro_batches`` k > 1 (gradient accumulation) the parameters' ``grad_req`` is ``add``: the gradients
        are zeroed, each micro-batch of B / k runs forward and backward on its own (adding the gradient of its summed
        loss), and one ``Trainer.step(B)`` applies the sum rescaled by 1 / B, the mean over all B samples.

        The indices are the slice of the epoch's staged order (``stage_epoch``) at ``position`` when it is given;
        others go in through ``nd.from_numpy`` (zero-copy DLPack, https://mxnet.apache.org/versions/1.9.1/api/python/
        docs/api/ndarray/ndarray.html#mxnet.ndarray.from_numpy), not ``nd.array``: on the CPU, ``nd.array`` copies
        synchronously after waiting for every operator already queued on the CPU (``NDArray::WaitToWrite`` pushes an
        empty write to the CPU queue and waits for it), which would make every step wait for the previous one.
        ``from_numpy`` only wraps the memory, so it is given a private copy, which MXNet keeps alive until the gather
        has read it. In fp16 the backward pass starts from the loss times AMP's loss scale (``_scaled``).

        Data-parallel (``options.data_parallel``, N contexts): ``_train_step_parallel``."""
        if len(self._contexts) > 1:
            if micro_batches != 1:
                raise ValueError("gradient accumulation with data parallelism is not supported")
            self._train_step_parallel(indices, position)
            return
        idx = self._indices(indices, position)

        def take(part: slice | None) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
            chosen = idx if part is None else idx[part]
            return nd.take(self.x_train, chosen), nd.take(self.y_train, chosen)

        self._train_on(take, len(indices), micro_batches)

    def _train_on(self, take: Callable[[slice | None], tuple[mx.nd.NDArray, mx.nd.NDArray]], batch: int,
                  micro_batches: int) -> None:
        """One step on a batch of ``batch`` samples on the device, which ``take`` gives: ``take(None)`` the whole
        batch (x, y), ``take(slice(a, b))`` its samples a:b (resident mode gathers them, ``train_step``; a loader's
        batch is sliced, ``train_batch``), so that a micro-batch's samples are made when it runs. The rest is
        ``train_step``'s: forward and backward under ``autograd.record``, ``Trainer.step(batch)``, the loss into the
        running sum; with ``micro_batches`` k > 1 the gradients of k consecutive micro-batches of B / k added up
        (``grad_req`` ``add``) before the one ``Trainer.step(B)``."""
        if micro_batches == 1:
            self._set_grad_req("write")
            x, y = take(None)
            before = [block.running_var.data().copy() for block, _, _ in self._variance_fixups]
            with autograd.record():
                loss = self.loss_fn(self.net(x), y)
                scaled = self._scaled(loss)
            scaled.backward()
            if before:
                self._fix_running_variances(before, batch)
            self.trainer.step(batch)
            self._add_loss((batch, 1), loss)  # per sample: no mean queued every step
            return
        micro = micro_batch_size(batch, micro_batches)
        self._set_grad_req("add")
        self._params.zero_grad()
        sums = []
        for start in range(0, batch, micro):
            before = [block.running_var.data().copy() for block, _, _ in self._variance_fixups]
            with autograd.record():
                x, y = take(slice(start, start + micro))
                loss = self.loss_fn(self.net(x), y)
                scaled = self._scaled(loss)
            scaled.backward()  # adds the gradient of this micro-batch's summed loss into the parameters' grads
            if before:
                self._fix_running_variances(before, micro)
            sums.append(loss.sum())
        self.trainer.step(batch)  # the sum over all B samples, rescaled by 1 / B: the mean gradient
        key = (batch, micro_batches)
        held = self._loss_sums.get(key)
        self._loss_sums[key] = nd.add_n(*sums) if held is None else nd.add_n(held, *sums)  # (1,): / B when read
        self._loss_steps += 1

    # -- input: loader -------------------------------------------------------------------------------------------

    def open_loader(self, source: Any) -> None:
        """A ``gluon.data.DataLoader`` over ``source`` (https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/
        gluon/data/index.html#mxnet.gluon.data.DataLoader): a Dataset (``_Samples``) whose item of key (epoch, indices)
        is a whole step read with one ``source.read`` and made NCHW (or int64 tokens) in the reading worker, as the
        other frameworks' loaders read a step; a ``batch_sampler`` (``_EpochBatches``) yielding each step of the epoch's
        order as one such key, and ``batchify_fn`` (``_one``) passing that item on; ``num_workers`` =
        ``options.loader.workers`` worker processes (Gluon's multiprocessing pool, forked here once and kept for every
        epoch; 0: read in this process at each ``next``), ``prefetch`` = ``options.loader.prefetch`` batches asked of
        the workers ahead of the step (Gluon's ``prefetch`` works only with workers), ``thread_pool`` False: processes,
        as Gluon's default. The pool forks this process after the model and the test set exist; MXNet stops its engine
        around a fork and restarts it in the parent (``pthread_atfork`` handlers, ``LibraryInitializer`` in
        src/initialize.cc of 1.9.1), and the workers run no MXNet operator: the items come back as numpy arrays (pickled
        through the pool's pipe), not as NDArrays in shared memory (Gluon's ``default_mp_batchify_fn``), and
        ``epoch_batches`` wraps them without a copy. (Checked with the worker's settings,
        ``MXNET_CPU_WORKER_NTHREADS=1`` and ``OMP_NUM_THREADS=1``: no hang, the same batches as in this process, so
        ``thread_pool`` is not needed.) ``auto_reload`` False (1.9.1's default): an epoch's iterator, and its
        prefetching, starts when ``epoch_batches`` asks for the epoch's first batch, after the sampler holds the epoch's
        order. Records the settings under ``settings()["loader"]``."""
        if len(self._contexts) > 1:
            raise ValueError("the mxnet adapter's loader does not feed a data-parallel trial (input_gap)")
        workers, prefetch = self.options.loader.workers, self.options.loader.prefetch
        self._batches = _EpochBatches()
        self._loader = gluon.data.DataLoader(_Samples(source, self.tokens), batch_sampler=self._batches,
                                             batchify_fn=_one, num_workers=workers, prefetch=prefetch,
                                             thread_pool=False)
        self._loader_settings = {"loader": "mxnet.gluon.data.DataLoader", "num_workers": workers,
                                 "prefetch": prefetch if workers > 0 else None, "thread_pool": False,
                                 "source": "files" if source.from_files else "memory"}

    def epoch_batches(self, order: np.ndarray, samples_per_step: int, epoch: int) -> Iterator[Any]:
        """The batches of epoch ``epoch`` (``Adapter.epoch_batches``): the sampler set to ``order`` (int64 (N,)) in
        whole steps of ``samples_per_step`` and ``epoch``, then the DataLoader's iterator; each batch (x, y), NCHW
        float32 images or int64 (B, L) tokens and int64 labels ((B,) or (B, L)), wrapped by ``nd.from_numpy``
        (zero-copy; ``nd.array`` would wait for every operator queued on the CPU first, see ``train_step``) and
        moved to the adapter's context with ``as_in_context`` (on a GPU an asynchronous copy operator; on the CPU
        the array itself)."""
        if self._loader is None:
            raise RuntimeError("epoch_batches before open_loader")
        self._batches.order, self._batches.size, self._batches.epoch = order, samples_per_step, epoch
        for x, y in self._loader:
            yield (nd.from_numpy(x, zero_copy=True).as_in_context(self.ctx),
                   nd.from_numpy(y, zero_copy=True).as_in_context(self.ctx))

    def train_batch(self, batch: Any, micro_batches: int = 1) -> None:
        """One step on a loader's batch (x, y) from ``epoch_batches``: ``_train_on``, a micro-batch being a slice of
        the batch (a view); otherwise as ``train_step``. Not data-parallel (ValueError): ``adapters.base.input_gap``
        refuses a loader there."""
        if len(self._contexts) > 1:
            raise ValueError("the mxnet adapter's loader does not feed a data-parallel trial (input_gap)")
        x, y = batch

        def take(part: slice | None) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
            return (x, y) if part is None else (x[part], y[part])

        self._train_on(take, int(x.shape[0]), micro_batches)

    def _train_step_parallel(self, indices: np.ndarray, position: int | None) -> None:
        """One data-parallel step, as a Gluon user writes it for several contexts: context d gathers its shard
        (``adapters.base.shard(indices, N, d)``, ``_shards``) from its own copy of the training set; under one
        ``autograd.record`` every context runs the forward pass and its per-sample loss; ``autograd.backward`` over the
        N losses leaves in each context's gradient arrays the gradient of its shard's summed loss; then
        ``Trainer.step(B)`` with the global batch B: the kvstore sums each gradient over the N contexts (pushpull on
        the "device" kvstore, see ``build``: the all-reduce) and every context applies the update rescaled by 1 / B
        to its own copy, the update of the mean gradient over all B samples, the same on every context. Everything
        is queued on the engine (each context's operators on that context's workers), nothing waited for.

        Batchnorm normalises over each context's own shard (``nn.BatchNorm``, per device), or with
        ``sync_batchnorm`` over the global batch (``SyncBatchNorm``); each context updates its own running statistics
        (identical ones with SyncBatchNorm), corrected to the unbiased update (``_fix_running_variances``) with the
        values per channel of the shard, or of the global batch. The loss (the per-sample losses of every shard) goes
        into each context's own running sum: the global batch's mean when read."""
        shards = self._shards(indices, position)
        self._set_grad_req("write")
        before = [[block.running_var.data(ctx).copy() for block, _, _ in self._variance_fixups]
                  for ctx in self._contexts]
        with autograd.record():
            losses = [self.loss_fn(self.net(nd.take(x, idx)), nd.take(y, idx))
                      for (x, y), idx in zip(self._train, shards)]
            scaled = self._scaled(losses)
        autograd.backward(scaled)
        if self._variance_fixups:
            normalised = len(indices) if self._sync_batchnorm else len(shards[0])  # samples each batchnorm saw
            for ctx, old in zip(self._contexts, before):
                self._fix_running_variances(old, normalised, ctx)
        self.trainer.step(len(indices))
        for device, loss in enumerate(losses):  # one sum per device; the step counted once
            self._add_loss((len(indices), 1, device), loss, count=device == 0)

    def _add_loss(self, key: tuple[int, ...], loss: mx.nd.NDArray, count: bool = True) -> None:
        """Adds a step's per-sample ``loss`` (float32 (B,)) into the running sum of ``key``: one queued operator
        (``+=``, or a copy at the first step after a read), nothing waited for; counts the step if ``count``."""
        held = self._loss_sums.get(key)
        if held is None:
            self._loss_sums[key] = loss.copy()
        else:
            held += loss
        self._loss_steps += int(count)

    def _scaled(self, loss: Any) -> Any:
        """``loss`` (float32 (B,), or data-parallel a list of each context's) as backward should see it, inside
        ``autograd.record``: itself, or with AMP (fp16)
        ``amp.scale_loss``'s loss times the current loss scale, which also sets the Trainer's rescaling to 1 / scale
        so that ``Trainer.step`` unscales the gradients; the step checks them for inf/nan first and skips the update
        (halving the scale) when there are any (https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/contrib/
        amp/index.html; ``LossScaler`` in mxnet/contrib/amp/loss_scaler.py: 2^16 to start, doubled after 2000 steps
        without overflow, at most 2^24). That check copies one flag to the host (``asnumpy``), so in fp16 every
        ``train_step`` waits for its own gradients before it returns."""
        if self._amp_dtype is None:
            return loss
        with amp.scale_loss(loss, self.trainer) as scaled:
            return scaled

    def _fix_running_variances(self, before: list[mx.nd.NDArray], batch: int, ctx: mx.Context | None = None) -> None:
        """Turns the running variance that a biased-variance kernel (MXNet's CPU BatchNorm; see
        ``_running_var_is_biased``) wrote in this forward and backward into the canonical one. With r the running
        variance before the step, v the biased batch variance, n the values per channel in the batch and c = n / (n -
        1), MXNet wrote r' = (1 - m) r + m v, the canonical value is (1 - m) r + m c v = c r' - (c - 1)(1 - m) r:
        exact algebra on the two running values, queued like any operator (no wait), five small ops per layer.

        The CPU kernel writes r' inside the backward pass without declaring that write to MXNet's engine (the running
        statistics are read-only inputs of the backward node), so an operator that only reads the running variance
        may run before the write (observed: it does). gamma's gradient is a declared output of the same backward
        kernel: ``reshape_like(var, gamma.grad())``, the running variance itself, reads it, which orders the
        correction after that kernel. Data-parallel: on context ``ctx``'s copy (default the first device's), with
        ``batch`` the samples its batchnorm normalised over (the shard's, or with SyncBatchNorm the global batch's)."""
        ctx = self.ctx if ctx is None else ctx
        for (block, momentum, per_sample), old in zip(self._variance_fixups, before):
            n = batch * per_sample
            if n < 2:
                raise ValueError(f"batchnorm needs more than 1 value per channel in a training batch, got {n}")
            c = n / (n - 1)
            var = block.running_var.data(ctx)
            written = nd.reshape_like(var, block.gamma.grad(ctx))  # = var, once the backward kernel is done
            nd.elemwise_sub(written * c, old * ((c - 1.0) * (1.0 - momentum)), out=var)

    def _set_grad_req(self, req: str) -> None:
        """``write`` (each backward overwrites the gradients) for plain steps, ``add`` (backward adds into them) for
        gradient accumulation (https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/gluon/parameter.html,
        ``grad_req``). Switched only when the kind of step changes, which a trial does at most once; parameters
        without a gradient (batchnorm's running statistics) stay ``null``."""
        if req != self._grad_req:
            self._params.setattr("grad_req", req)
            self._grad_req = req

    def wait(self) -> None:
        """``nd.waitall``: every operator queued on the engine is done
        (https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/ndarray/ndarray.html#mxnet.ndarray.waitall).
        MXNet runs operators asynchronously on its engine's worker threads, so errors and results surface at such a
        synchronisation point. The loss is read by ``read_loss``, after the clock (its sum is one more operator and
        engine round trip)."""
        nd.waitall()

    def _take_loss_sum(self) -> float:
        """Each running sum's total (one ``sum`` operator and ``asscalar`` per batch shape: one in a trial;
        data-parallel one per context) / B; the sums are dropped."""
        sums, self._loss_sums = self._loss_sums, {}
        return sum(float(held.sum().asscalar()) / key[0] for key, held in sums.items())

    def evaluate(self, batch_size: int) -> tuple[float, float]:
        """Outside ``autograd.record`` Gluon runs in inference mode. Batches of ``batch_size`` and a smaller last one
        reuse the hybridized graph (a new shape re-plans it; no padding is needed). For a next-token model the loss
        of a sequence is the mean over its L positions, so the mean over the sequences is the mean over every
        position, and the accuracy counts every position. Data-parallel: on the first device (``self.ctx``, where the
        test set is), with its copy of the parameters and running statistics."""
        total_loss = nd.zeros((1,), ctx=self.ctx, dtype=np.float64)
        correct = nd.zeros((1,), ctx=self.ctx, dtype=np.int64)
        n = self.x_test.shape[0]
        for start in range(0, n, batch_size):
            logits = self.net(self.x_test[start:start + batch_size])
            y = self.y_test[start:start + batch_size]
            total_loss += self.loss_fn(logits, y).sum().astype(np.float64)
            correct += (logits.argmax(axis=-1).astype(np.int64) == y).sum()
        return float(total_loss.asscalar()) / n, float(correct.asscalar()) / self.y_test.size

    def predict(self, images: np.ndarray) -> np.ndarray:
        """Logits, float32 (N, classes) or (N, L, vocab) for a next-token model, for NHWC images or (N, L) token
        ids. Data-parallel: on the first device."""
        logits = self.net(self._to_device_inputs(images if self.tokens else images.astype(np.float32)))
        return logits.asnumpy().astype(np.float32, copy=False)  # fp16 under AMP: its last dense layer's output

    def get_weights(self) -> dict[str, np.ndarray]:
        """The first device's copy (data-parallel: every context's is the same, each updated with the same summed
        gradient by the same optimizer arithmetic); asnumpy copies to a new host array (after waiting for the writes
        queued on it)."""
        return {name: param.data(self.ctx).asnumpy() for name, (param, trained) in self._tensors.items() if trained}

    def get_buffers(self) -> dict[str, np.ndarray]:
        """The first device's running statistics: what ``evaluate`` and ``predict`` use. Data-parallel with per-device
        batchnorm, every context keeps its own, updated from its own shard, so they differ; this is device 0's, not
        an average (Gluon's ``save_parameters`` would write the mean over the contexts: ``Parameter._reduce``). With
        SyncBatchNorm every context's are the same."""
        return {name: param.data(self.ctx).asnumpy() for name, (param, trained) in self._tensors.items()
                if not trained}

    def memory_stats(self) -> dict[str, int]:
        """Always empty: MXNet 1.9.1 keeps no allocator peak counters. On a GPU, ``mx.context.gpu_memory_info`` gives
        only the device's current free and total bytes (cudaMemGetInfo), which includes the memory MXNet's pool holds
        and other processes' memory, so it is no peak of MXNet's tensors."""
        return {}

    def settings(self) -> dict[str, Any]:
        """Thread settings as libmxnet read them at import, the precision, AMP's target dtype ("" without AMP), the
        execution mode and the hybridize flags ({} in the eager mode), AMP's loss scale and its policy (fp16), and,
        on a GPU, the memory pool type (``MXNET_GPU_MEM_POOL_TYPE``, default "Naive": https://mxnet.apache.org/
        versions/1.9.1/api/faq/env_var); data-parallel, the contexts, the kvstore and the batchnorm kind."""
        out: dict[str, Any] = {
            "intra_op_threads": _omp_threads(),
            "inter_op_threads": int(_ENV_AT_IMPORT["MXNET_CPU_WORKER_NTHREADS"] or 1),
            "threads_requested": self._threads_requested,
            "OMP_NUM_THREADS": _ENV_AT_IMPORT["OMP_NUM_THREADS"] or "",
            "MXNET_OMP_MAX_THREADS": _ENV_AT_IMPORT["MXNET_OMP_MAX_THREADS"] or "",
            "MXNET_CPU_WORKER_NTHREADS": _ENV_AT_IMPORT["MXNET_CPU_WORKER_NTHREADS"] or "",
            "MXNET_ENGINE_TYPE": _ENV_AT_IMPORT["MXNET_ENGINE_TYPE"] or "ThreadedEnginePerDevice",
            "precision": self._precision,
            "amp_target_dtype": self._amp_dtype or "",
            "compile": "compiled" if self._hybridized else "eager",
            "hybridized": self._hybridized,
            "hybridize": dict(HYBRIDIZE_FLAGS) if self._hybridized else {},
            "optimizer_impl": "PyTorch semantics on MXNet's SGD / adam_update (epsilon * sqrt(1 - beta2^t))",
        }
        scaler = getattr(getattr(self, "trainer", None), "_amp_loss_scaler", None)  # set by amp.init_trainer
        if scaler is not None:
            out["loss_scale"] = float(scaler.loss_scale)  # the current one (2^16 before the first step)
            out["loss_scaling"] = "dynamic (AMP LossScaler: x0.5 and skip the step on inf/nan, x2 after 2000 steps)"
        if len(self._contexts) > 1:
            # data-parallel: the contexts (on the CPU each with its own engine workers), the all-reduce, batchnorm
            kvstore = getattr(getattr(self, "trainer", None), "_kvstore", None)  # created at the first step
            out["data_parallel"] = {
                "contexts": [str(ctx) for ctx in self._contexts],
                "kvstore": kvstore.type if kvstore is not None else "device",
                "update_on_kvstore": False,
                "batchnorm": "SyncBatchNorm (global batch)" if self._sync_batchnorm else "BatchNorm (per device)",
            }
        if self.ctx.device_type == "gpu":
            out["MXNET_GPU_MEM_POOL_TYPE"] = os.environ.get("MXNET_GPU_MEM_POOL_TYPE", "Naive")
            out["MXNET_CUDNN_AUTOTUNE_DEFAULT"] = os.environ.get("MXNET_CUDNN_AUTOTUNE_DEFAULT", "1")
            out["NVIDIA_TF32_OVERRIDE"] = os.environ.get("NVIDIA_TF32_OVERRIDE", "")
            out.update(self._memory_limit)
        if self._loader_settings:
            out["loader"] = self._loader_settings
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


def _activation(name: str) -> nn.HybridBlock | None:
    """The block of a layer's ``activation``: relu, the exact gelu, or None. ``nn.GELU`` is ``LeakyReLU(act_type=
    'gelu')``, which in MXNet 1.9.1 is the erf form, x / 2 * (1 + erf(x / sqrt(2))), with its exact derivative
    (``gelu`` and ``gelu_grad`` in src/operator/mshadow_op.h; the API page only lists the act_type: https://mxnet.
    apache.org/versions/1.9.1/api/python/docs/api/ndarray/ndarray.html#mxnet.ndarray.LeakyReLU). Measured on the
    CPU, on normal(0, 2) draws: within 1e-6 of the float64 erf form and 2e-7 of its derivative; the tanh
    approximation is 4.7e-4 away on [-4, 4]."""
    if name == "relu":
        return nn.Activation("relu")
    return nn.GELU() if name == "gelu" else None


class _Samples(gluon.data.Dataset):
    """The loader's Dataset: the item of key (epoch, indices), int64 (B,) indices of one step, is that step's batch
    read with ``source.read(indices, epoch)``: images as NCHW float32 (B, C, H, W) (what resident mode holds), or
    int64 (B, L) tokens, and int64 labels, numpy arrays. Its length is the source's samples."""

    def __init__(self, source: Any, tokens: bool):
        self.source, self.tokens = source, tokens

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: tuple[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        epoch, indices = key
        x, y = self.source.read(indices, epoch)
        if self.tokens:
            return np.ascontiguousarray(x, dtype=np.int64), y
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2), dtype=np.float32), y


def _one(items: list[Any]) -> Any:
    """The DataLoader's batchify_fn: a step is one key, whose item (``_Samples``) is the batch already."""
    return items[0]


class _EpochBatches(gluon.data.Sampler):
    """The DataLoader's batch sampler: the epoch's ``order`` cut into steps of ``size`` samples, each yielded as a
    batch of one key (``epoch``, the step's int64 indices) (the epoch draws the augmentation); set before each
    epoch's iterator (in the training process, where Gluon iterates a batch sampler)."""

    def __init__(self) -> None:
        self.order: np.ndarray = np.zeros(0, dtype=np.int64)
        self.size, self.epoch = 1, 0

    def __len__(self) -> int:
        return len(self.order) // self.size

    def __iter__(self) -> Iterator[list[tuple[int, np.ndarray]]]:
        order, size, epoch = np.asarray(self.order, dtype=np.int64), self.size, self.epoch
        for start in range(0, len(order) // size * size, size):
            yield [(epoch, order[start:start + size])]
