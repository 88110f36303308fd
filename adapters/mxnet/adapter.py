"""MXNet adapter: ``MXNetAdapter`` implements ``adapters.base.Adapter`` from the parts of this package, the neutral
builder (``adapters.mxnet.neutral``: the canonical layers as a Gluon ``HybridSequential``, the blocks Gluon lacks in
``adapters.mxnet.layers``), the training mechanics (``adapters.mxnet.training``: any Gluon block, imperative or
hybridized, fp32 or AMP's fp16, accumulation, several contexts over a kvstore; with ``batchnorm``, ``optimizers`` and
``precision``) and the input (``adapters.mxnet.inputs``: resident or Gluon's ``DataLoader``). Here: the device and
contexts, threads and seed, AMP's initialisation, a model of your own (a ``gluon.HybridBlock``, ``native_model``), and
the telemetry. Precisions: fp32 everywhere, fp16 on a CUDA GPU (AMP); bf16 and tf32 are not declared (the
declaration's notes say why).

Design: docs/design/framework-caveats.md#mxnet (the asynchronous engine, threads, the two modes, why no bf16 or tf32).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from typing import Any

import numpy as np

from adapters.base import (
    DataParallel,
    DeviceUnavailable,
    Model,
    RunOptions,
    Settings,
    Weights,
    device_index,
    device_kind,
)
from adapters.mxnet import DECLARATION, precision
from adapters.mxnet import layers as L
from adapters.mxnet.batchnorm import BatchNormLayer
from adapters.mxnet.inputs import Inputs
from adapters.mxnet.neutral import Builder, NeutralNet
from adapters.mxnet.runtime import gluon, inter_op_threads, mx, nd, omp_threads, thread_settings
from adapters.mxnet.training import HYBRIDIZE_FLAGS, Training
from adapters.parts import Facade
from harness.neutral.info import ModelInfo
from harness.neutral.native import NativeModelError, NativeSource
from harness.neutral.steps import to_layout
from harness.spec import OptimizerSpec

#: What ``train_flops_per_sample`` answers: MXNet 1.9.1 has nothing that counts FLOPs.
NO_FLOP_COUNTER = ("MXNet 1.9.1 has no FLOP counter: its profiler (mx.profiler) records operator times and memory, "
                   "not FLOPs, and Block.summary counts parameters and output shapes only")


class MXNetAdapter(Facade[Training, Inputs], declaration=DECLARATION):
    def __init__(self, options: RunOptions | None = None) -> None:
        super().__init__(options)
        self.ctx = mx.cpu()
        # every device's context: [self.ctx], or data-parallel (``options.data_parallel``) one per device, the first
        # being self.ctx (evaluation, predict, get_weights)
        self.contexts: list[Any] = [self.ctx]
        self._threads_requested: int | None = None
        self._memory_limit: dict[str, Any] = {}  # the GPU memory limit requested and not applied, for settings()
        self._neutral: NeutralNet | None = None  # the neutral builder's model, for the canonical state
        self._own: Any = None  # any other model build trains (a model of your own's block), for its names
        self._initialised: dict[str, Any] = {}  # how native_model initialised a model of your own, for settings()

    # -- setup ---------------------------------------------------------------------------------------------------

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
        build sees no GPU (``mx.context.num_gpus()`` is 0 on a CPU-only wheel) or N is out of range. Data-parallel:
        one context per device (``_contexts``). Then AMP for fp16 (``adapters.mxnet.precision.init_amp``), before the
        model's first forward pass traces or runs anything.

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
            # fp32 means fp32, as in the PyTorch adapter: MXNet has no TF32 switch of its own, and cuDNN 8's default
            # math mode allows TF32 on Ampere and later. cuBLAS and cuDNN read NVIDIA_TF32_OVERRIDE when MXNet creates
            # their handles, at its first GPU operator, after this; a value the launcher set is kept.
            os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
            self.ctx = mx.gpu(device_index(device))
            if self.options.memory_limit_bytes:
                # MXNet 1.9.1 has no per-process cap on GPU memory (MXNET_GPU_MEM_POOL_RESERVE only sets how much
                # of the device its pool leaves free for other uses, https://mxnet.apache.org/versions/1.9.1/api/faq/
                # env_var), so nothing is applied and settings say so.
                self._memory_limit = {"memory_limit": "not supported by MXNet on GPU",
                                      "memory_limit_requested_bytes": self.options.memory_limit_bytes}
        else:
            self.ctx = mx.cpu()
        self.contexts = [self.ctx]
        if self.options.data_parallel is not None:
            self.contexts = self._contexts(self.options.data_parallel, device)
            self.ctx = self.contexts[0]
        self._threads_requested = threads
        mx.random.seed(seed)
        precision.init_amp(self.options.precision)

    def _contexts(self, parallel: DataParallel, device: str) -> list[Any]:
        """One Gluon context per device of the trial (``DataParallel.devices``): "cpu:i" is ``mx.cpu(i)``, "cuda:i"
        ``mx.gpu(i)``. One process drives them all. On the CPU the contexts are one physical device, but each is a
        device of its own to MXNet: its own arrays, its own engine worker threads (``ThreadedEnginePerDevice`` keeps
        ``MXNET_CPU_WORKER_NTHREADS`` workers per CPU context, each operator with ``OMP_NUM_THREADS`` OpenMP threads),
        and the kvstore copies and sums across them for real. Raises DeviceUnavailable for a multi-process trial, a
        device of another kind than ``device``'s, or a GPU this build does not see."""
        contexts = []
        for name, (kind, index) in zip(parallel.devices, parallel.one_process_devices("mxnet")):
            if kind != device_kind(device) or kind not in ("cpu", "cuda"):
                raise DeviceUnavailable(f"the data-parallel trial's device {name} is not a {device_kind(device)} "
                                        f"device like the trial's ({device})")
            if kind == "cuda" and (problem := self.device_problem(name)) is not None:
                raise DeviceUnavailable(problem)
            contexts.append(mx.gpu(index) if kind == "cuda" else mx.cpu(index))
        return contexts

    def neutral_model(self, info: ModelInfo, weights: Weights) -> Model:
        """``adapters.mxnet.neutral.Builder``'s ``HybridSequential``, initialised on every context (batchnorm
        ``SyncBatchNorm`` over them when a data-parallel trial asks for sync batchnorm); its canonical names and
        batchnorm layers are kept for ``get_weights`` and ``build``."""
        dp = self.options.data_parallel
        self._neutral = Builder(len(self.contexts) if dp is not None and dp.sync_batchnorm else 0).build(
            info, weights, self.contexts)
        return self._neutral.net

    def native_model(self, model: object, source: NativeSource) -> Model:
        """A ``mxnet.gluon.HybridBlock`` of your own (``harness.neutral.native.make`` called its factory after
        ``prepare`` set ``mx.random.seed``), its output taken as the logits (``adapters.mxnet.layers.Logits``: an
        NDArray, or the first of a tuple), its parameters on every context of the trial (data-parallel: one copy per
        device, the same values on each). Raises NativeModelError (field ``model``) for anything but a HybridBlock: a
        plain ``gluon.Block`` cannot be hybridized, so the compiled mode would not be what it says.

        Initialisation is ``block.initialize(mx.init.Uniform(), ctx=contexts, force_reinit=False)``'s
        (https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/gluon/block.html#mxnet.gluon.Block.initialize),
        parameter by parameter: one not yet initialised gets the initializer it carries where it has one
        (``Dense(weight_initializer=...)``; biases' zeros, batchnorm's ones and zeros) and Gluon's default
        ``mx.init.Uniform()``, U(-0.07, 0.07), where not, drawn from MXNet's generator that ``prepare`` seeded; one
        the factory initialised already keeps its values (a deferred one its initializer: ``initialize`` again would
        replace it with the default), moved to the trial's contexts (``Parameter.reset_ctx``) where it was put
        elsewhere. Shapes left to Gluon's deferred initialisation (a layer without ``in_channels`` / ``in_units``)
        are completed by a forward pass of two zero samples of ``source.input`` (NCHW float32 images, int64 token ids)
        on the first context, outside ``autograd.record`` (inference: batchnorm's running statistics do not move),
        waited for. The eager mode makes the block imperative (``hybridize(False)``, should the factory have
        hybridized it); the compiled mode hybridizes it in ``build`` as it does the neutral model. Its batchnorm
        layers train as MXNet's own: no running-variance correction (``build``)."""
        if not isinstance(model, gluon.HybridBlock):
            raise NativeModelError("model", f"{source.factory} returned a {type(model).__module__}."
                                            f"{type(model).__qualname__}, not a mxnet.gluon.HybridBlock")
        self._neutral = None
        params = list(model.collect_params().values())
        kept, deferred = 0, False
        for param in params:
            try:
                held = param.list_ctx()  # raises RuntimeError unless initialised (or its initialisation deferred)
            except RuntimeError:
                param.initialize(None, ctx=self.contexts, default_init=mx.init.Uniform())
            else:
                kept += 1
                if list(held) != self.contexts:
                    param.reset_ctx(self.contexts)
            try:
                param.data(self.ctx)
            except gluon.parameter.DeferredInitializationError:
                deferred = True
        net = L.Logits(model)
        if self.mode == "eager":
            net.hybridize(False)
        if deferred:
            zeros = np.zeros((2, *source.input.shape), np.int64 if source.input.kind == "tokens" else np.float32)
            net(nd.array(zeros if source.input.kind == "tokens" else to_layout(zeros, "NCHW"), ctx=self.ctx,
                         dtype=zeros.dtype))
            nd.waitall()  # an error of the model's operators is raised here, not at some later wait
        self._initialised = {
            "initialisation": "Gluon's: each parameter's own initializer, else mx.init.Uniform() (U(-0.07, 0.07)); "
                              "parameters the factory initialised are kept",
            "gluon_parameters": len(params), "parameters_kept_from_factory": kept}  # running statistics included
        return net

    def train_flops_per_sample(self) -> tuple[int | None, str]:
        """(None, ``NO_FLOP_COUNTER``): MXNet 1.9.1 has no FLOP counter (https://mxnet.apache.org/versions/1.9.1/api/
        python/docs/api/mxnet/profiler/index.html: operator timings and memory)."""
        return None, NO_FLOP_COUNTER

    def make_parts(self, model: Model, task: str, optimizer: OptimizerSpec) -> tuple[Training, Inputs]:
        """``model`` (a Gluon block initialised on the contexts) trained through ``adapters.mxnet.training.Training``;
        the input (``adapters.mxnet.inputs.Inputs``) for ``task``. The neutral builder's batchnorm layers get the
        running-variance correction to the canonical (unbiased) update where MXNet's kernel is biased, for the
        cross-framework equivalence; any other model (a model of your own) is not claimed equal to another
        framework's, so its batchnorm trains as MXNet's own (biased on the CPU, unbiased with cuDNN), and ``settings``
        says so. Raises TypeError for anything but a ``gluon.Block``."""
        if not isinstance(model, gluon.Block):
            raise TypeError(f"the mxnet adapter trains a gluon.Block, not {type(model).__name__}")
        batchnorms: list[BatchNormLayer] = []
        if self._neutral is not None and model is self._neutral.net:
            batchnorms, self._own = self._neutral.batchnorms, None
        else:
            self._neutral, self._own = None, model.block if isinstance(model, L.Logits) else model
        return (Training(model, task, optimizer, self.options, self.contexts, batchnorms),
                Inputs(self.options, self.contexts, task != "image_classification"))

    # -- steps ---------------------------------------------------------------------------------------------------

    def wait(self) -> None:
        """``nd.waitall``: every operator queued on the engine is done
        (https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/ndarray/ndarray.html#mxnet.ndarray.waitall).
        MXNet runs operators asynchronously on its engine's worker threads, so errors and results surface at such a
        synchronisation point. The loss is read by ``read_loss``, after the clock (its sum is one more operator and
        engine round trip)."""
        nd.waitall()

    # -- state ---------------------------------------------------------------------------------------------------

    def get_weights(self) -> Weights:
        """The first context's copy (data-parallel: every context's is the same, each updated with the same summed
        gradient by the same optimizer arithmetic). Another model than the neutral one: by the names Gluon's
        ``save_parameters`` writes ("0.weight", "3.gamma": the path of child names, ``_own_params``)."""
        if self._neutral is not None:
            return self._neutral.state(self.ctx, trained=True)
        return {name: p.data(self.ctx).asnumpy() for name, p in self._own_params().items() if p.grad_req != "null"}

    def get_buffers(self) -> Weights:
        """The first context's running statistics: what ``evaluate`` and ``predict`` use. Data-parallel with
        per-device batchnorm, every context keeps its own, updated from its own shard, so they differ; this is device
        0's, not an average (Gluon's ``save_parameters`` would write the mean over the contexts:
        ``Parameter._reduce``). With SyncBatchNorm every context's are the same."""
        if self._neutral is not None:
            return self._neutral.state(self.ctx, trained=False)
        return {name: p.data(self.ctx).asnumpy() for name, p in self._own_params().items() if p.grad_req == "null"}

    def _own_params(self) -> dict[str, Any]:
        """The parameters of a model other than the neutral one by their path of child names, as
        ``Block.save_parameters`` names them (``_collect_params_with_prefix``, MXNet 1.9.1): the same in every
        process, where Gluon's own names ("hybridsequential0_conv0_weight") count the blocks made before."""
        if self._own is None:
            raise RuntimeError("the model is not built yet (build)")
        params: dict[str, Any] = self._own._collect_params_with_prefix()
        return params

    # -- telemetry -----------------------------------------------------------------------------------------------

    def memory_stats(self) -> dict[str, int]:
        """Always empty: MXNet 1.9.1 keeps no allocator peak counters. On a GPU, ``mx.context.gpu_memory_info`` gives
        only the device's current free and total bytes (cudaMemGetInfo), which includes the memory MXNet's pool holds
        and other processes' memory, so it is no peak of MXNet's tensors."""
        return {}

    def settings(self) -> Settings:
        """Thread settings as libmxnet read them at import (``runtime.thread_settings``; the count in effect,
        ``runtime.omp_threads``) and the request,
        AMP's target dtype ("" without AMP), the hybridize flags ({} in the eager mode), AMP's loss scale and its
        policy (fp16), and, on a GPU, the memory pool type (``MXNET_GPU_MEM_POOL_TYPE``, default "Naive":
        https://mxnet.apache.org/versions/1.9.1/api/faq/env_var) and the memory limit not applied; data-parallel, the
        contexts, the kvstore and the batchnorm kind; the batchnorm running variance (corrected, or MXNet's own for a
        model of your own) and how a model of your own was initialised (``native_model``)."""
        hybridized = self.mode == "compiled"
        extras: dict[str, Any] = {
            "threads_requested": self._threads_requested, **thread_settings(),
            "amp_target_dtype": precision.AMP_DTYPES.get(self.options.precision) or "",
            "hybridized": hybridized,
            "hybridize": dict(HYBRIDIZE_FLAGS) if hybridized else {},
            "optimizer_impl": "PyTorch semantics on MXNet's SGD / adam_update (epsilon * sqrt(1 - beta2^t))",
            "running_variance": (
                "MXNet's own (biased on the CPU, unbiased with cuDNN on a GPU): a model of your own gets no correction"
                if self._own is not None else
                "canonical: corrected to the unbiased update where MXNet's kernel is biased (the CPU)"),
            **(self._initialised if self._own is not None else {}),
        }
        trained = self._training.settings() if self._training is not None else {}
        kvstore = trained.pop("kvstore", "device")  # created at build
        extras.update(trained)
        if self.ctx.device_type == "gpu":
            extras["MXNET_GPU_MEM_POOL_TYPE"] = os.environ.get("MXNET_GPU_MEM_POOL_TYPE", "Naive")
            extras["MXNET_CUDNN_AUTOTUNE_DEFAULT"] = os.environ.get("MXNET_CUDNN_AUTOTUNE_DEFAULT", "1")
            extras["NVIDIA_TF32_OVERRIDE"] = os.environ.get("NVIDIA_TF32_OVERRIDE", "")
            extras.update(self._memory_limit)
        data_parallel = None
        if len(self.contexts) > 1:
            # the contexts (on the CPU each with its own engine workers), the all-reduce, batchnorm
            dp = self.options.data_parallel
            data_parallel = {
                "contexts": [str(ctx) for ctx in self.contexts], "kvstore": kvstore, "update_on_kvstore": False,
                "batchnorm": ("the model's own (per device, unless they are SyncBatchNorm)" if self._own is not None
                              else "SyncBatchNorm (global batch)" if dp is not None and dp.sync_batchnorm
                              else "BatchNorm (per device)")}
        return Settings(precision=self.options.precision, compile=self.mode, intra_op_threads=omp_threads(),
                        inter_op_threads=inter_op_threads(), memory_limit_bytes=None,
                        loader=self.loader_settings(),
                        data_parallel=data_parallel, **extras)

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
