"""How a spec's trials train and are measured, beside the model and the data: the optimizer, the sampler, the
allocator, the timing of the training loop, precision, execution mode and input (the ``Literal`` types), the data
loader, data parallelism and the study variants crossed with the batch sizes. Field rules only, for
``harness.spec.Spec`` and ``VariantsSpec``; imports nothing of the harness but ``harness.spec.base`` and
``harness.spec.devices``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from harness.spec.base import _Strict
from harness.spec.devices import is_gpu


class OptimizerSpec(_Strict):
    """The optimizer, with semantics made identical in every framework.

    ``sgd``: v <- momentum * v + g; p <- p - lr * v (PyTorch's form; equal to Keras's and MXNet's for a constant
    learning rate). ``adam``: PyTorch's bias-corrected Adam, p <- p - lr * m_hat / (sqrt(v_hat) + epsilon); TensorFlow's
    and MXNet's kernels add epsilon before the bias correction, so those adapters pass epsilon * sqrt(1 - beta2^t)
    to get the same update. ``weight_decay`` is an L2 term added to the gradient (coupled, as
    in ``torch.optim.SGD``/``Adam`` and MXNet's ``wd``), never Keras's decoupled ``weight_decay``.
    """

    name: Literal["sgd", "adam"] = "sgd"
    learning_rate: float = Field(default=0.01, gt=0)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.999, ge=0, lt=1)
    epsilon: float = Field(default=1e-7, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _momentum_only_for_sgd(self) -> OptimizerSpec:
        if self.name != "sgd" and self.momentum:
            raise ValueError("momentum applies to sgd only (adam uses beta1)")
        return self


class SamplerSpec(_Strict):
    """Background sampling of the device (NVML) or, without a GPU, the worker's CPU and memory (psutil)."""

    interval_s: float = Field(default=0.1, gt=0, le=10)


class AllocatorSpec(_Strict):
    """Allocator settings that change the memory numbers; every trial records the values used.

    tensorflow_memory_growth: on by default (TensorFlow otherwise maps nearly all GPU memory at start,
    https://www.tensorflow.org/guide/gpu#limiting_gpu_memory_growth); turn it off to reproduce "TF grabs all
    memory". pytorch_cuda_alloc_conf: PYTORCH_CUDA_ALLOC_CONF for the workers
    (https://pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf).
    mxnet_gpu_mem_pool_type: MXNET_GPU_MEM_POOL_TYPE (Naive, Round or Unpooled; MXNet's default is Naive).
    """

    tensorflow_memory_growth: bool = True
    pytorch_cuda_alloc_conf: str | None = None
    mxnet_gpu_mem_pool_type: Literal["Naive", "Round", "Unpooled"] | None = None


class TimingSpec(_Strict):
    """How the training loop is timed. Every timed window is synchronized with the device at both edges (its
    ``sync``: torch.cuda.synchronize, block_until_ready, ...) and at no step inside, so host dispatch and device
    work overlap inside a window as in a plain training loop.

    ``window``: ``auto`` (the default): windows of about ``window_seconds`` of work and at least
    ``min_window_steps`` steps, at most up to the next evaluation (``evaluate_every``); the step time of the last
    window (or of the warm-up) sizes the next. ``step``: latency mode, a sync after every step: exact per-step
    percentiles, at the cost of the overlap (throughput then includes a sync per step). An integer k: fixed windows
    of k steps. Step-time percentiles are over windows (each window's duration over its steps). ``sync_every: k``
    (the former name) is read as ``window: k``, and ``sync_every: 1`` as ``window: step``.
    """

    window: Literal["auto", "step"] | PositiveInt = "auto"
    window_seconds: float = Field(default=1.0, gt=0)
    min_window_steps: int = Field(default=10, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _former_sync_every(cls, data: Any) -> Any:
        if isinstance(data, dict) and "sync_every" in data:
            if "window" in data:
                raise ValueError("give window or sync_every (its former name), not both")
            data = dict(data)
            every = data.pop("sync_every")
            data["window"] = "step" if every == 1 else every
        return data


#: Numerical precision of training: ``fp32`` (TF32 off on GPUs), ``tf32`` (fp32 storage, TensorFloat-32 matrix
#: products and convolutions on an NVIDIA GPU), ``bf16`` and ``fp16`` (mixed precision: fp32 master weights and
#: optimizer state, matrix products and convolutions in the low precision, the loss and softmax in fp32; fp16 with
#: dynamic loss scaling).
Precision = Literal["fp32", "tf32", "bf16", "fp16"]
#: Execution mode: ``default`` (each framework's usual one), ``eager`` or ``compiled``; what each means per framework
#: is its adapter's ``COMPILE_MODES`` (README, "Precision and compilation").
CompileMode = Literal["default", "eager", "compiled"]
#: Where a step's batch comes from: ``resident`` (the training set placed on the device once, each step gathering its
#: batch there) or ``loader`` (each framework's own data loader reads it on the host and copies it over).
InputMode = Literal["resident", "loader"]


class LoaderSpec(_Strict):
    """The data loader of ``input: loader`` (docs/guide/data.md#input-pipelines). ``workers``: processes (PyTorch's
    and Gluon's ``num_workers``), parallel calls (tf.data's ``num_parallel_calls``) or threads (JAX) that read and
    decode samples; 0 reads them in the training process. ``prefetch``: batches read ahead of the step (PyTorch's
    ``prefetch_factor`` per worker, tf.data's ``prefetch``, Gluon's ``prefetch``, JAX's device-put queue). Each trial
    records the names and values its framework used (``settings.loader``)."""

    workers: int = Field(default=2, ge=0)
    prefetch: int = Field(default=2, ge=1)


class GradientNoiseSpec(_Strict):
    """The gradient noise scale's measurements (docs/guide/which-batch-size.md): at every ``every``-th evaluation and
    the last one scheduled (1: at each), before its test set, and at the first to reach ``target_accuracy`` (after
    its test set: the same parameters), ``probes`` batches of the trial's optimizer step (B samples, drawn from the
    training set by the harness from the seed and epoch) are each split into ``micro_batches`` k micro-batches of
    b = B / k, and the squared norms of the k micro-batch gradients and of their mean are recorded
    (``Adapter.gradient_norms``; McCandlish et al. 2018, Appendix A). Outside the timed windows; parameters and
    optimizer state are not changed. One device, resident input: the plan refuses a data-parallel or loader trial
    with the reason."""

    micro_batches: int = Field(default=8, ge=2)
    probes: int = Field(default=4, ge=1)
    every: int = Field(default=1, ge=1)


class DataParallelSpec(_Strict):
    """Data-parallel training over several devices: each optimizer step's global batch (the ``batch_sizes`` entry) is
    split into ``devices`` equal per-device batches (``adapters.base.shard``), the gradients are averaged over all
    of them (all-reduce), and every device applies the same update: each framework's own mechanism (its adapter's
    declaration: PyTorch DistributedDataParallel, TensorFlow MirroredStrategy, MXNet kvstore, JAX sharding).

    devices: N (on the CPU N logical devices, on a GPU machine the first N GPUs from the spec's device), or the GPUs
    as a list (``[cuda:0, cuda:1]``). Written as ``data_parallel: 2`` or ``data_parallel: [cuda:0, cuda:1]`` for
    short. sync_batchnorm: batchnorm normalises over the global batch (every device's shard) instead of each
    device's own; a framework without it records such trials ``unsupported``.
    """

    devices: int | list[str]
    sync_batchnorm: bool = False

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, data: Any) -> Any:
        if isinstance(data, (int, list)) and not isinstance(data, bool):
            return {"devices": data}
        return data

    @field_validator("devices")
    @classmethod
    def _device_list(cls, devices: int | list[str]) -> int | list[str]:
        if isinstance(devices, int):
            if devices < 1:
                raise ValueError(f"a device count is at least 1, not {devices}")
            return devices
        if not devices:
            raise ValueError("devices lists at least one GPU")
        for device in devices:
            if not is_gpu(device):
                raise ValueError(f"data-parallel devices are GPUs as cuda:N, not {device!r} (on the CPU give a count)")
        if len(set(devices)) != len(devices):
            twice = next(d for d in devices if devices.count(d) > 1)
            raise ValueError(f"{twice} is listed twice")
        return devices

    @property
    def size(self) -> int:
        """N, the number of devices."""
        return self.devices if isinstance(self.devices, int) else len(self.devices)


class VariantsSpec(_Strict):
    """Study variants crossed with the batch sizes: every combination of the lists given runs at every batch size.

    optimizer: several optimizers (each a full optimizer spec), e.g. SGD with momentum and Adam, for the
    seed-002 comparison of how optimizers tolerate large batches. augmentation: e.g. [false, true]. precision: e.g.
    [fp32, bf16]. compile: e.g. [eager, compiled]. data_parallel: device counts (or ``DataParallelSpec``s), e.g.
    [1, 2, 4, 8] for the scaling at each global batch size (1: one device, no data parallelism). input: e.g.
    [resident, loader], the same training fed from the device and through the framework's data loader.
    """

    optimizer: list[OptimizerSpec] | None = Field(default=None, min_length=1)
    augmentation: list[bool] | None = Field(default=None, min_length=1)
    precision: list[Precision] | None = Field(default=None, min_length=1)
    compile: list[CompileMode] | None = Field(default=None, min_length=1)
    data_parallel: list[DataParallelSpec] | None = Field(default=None, min_length=1)
    input: list[InputMode] | None = Field(default=None, min_length=1)
