"""PyTorch adapter: ``PyTorchAdapter`` implements ``adapters.base.Adapter`` from three parts of this package, the
neutral builder (``adapters.pytorch.neutral``: the canonical layers as ``torch.nn`` modules), the training mechanics
(``adapters.pytorch.training``: any ``nn.Module``, eager or compiled, fp32 or mixed precision, accumulation, DDP) and
the input (``adapters.pytorch.inputs``: resident or a DataLoader). Here: the device, threads and seed, the process
group of a data-parallel trial, the GPU memory cap, and the telemetry.

Design: docs/design/framework-caveats.md#pytorch (execution modes, precision and their sources).
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

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
from adapters.parts import Facade
from adapters.pytorch import DECLARATION
from adapters.pytorch import layers as L
from adapters.pytorch.inputs import Inputs
from adapters.pytorch.neutral import Builder, NeutralModule
from adapters.pytorch.training import Training
from harness.neutral.info import ModelInfo
from harness.neutral.native import NativeModelError, NativeSource
from harness.spec import OptimizerSpec


class PyTorchAdapter(Facade[Training, Inputs], declaration=DECLARATION):
    #: The process group's timeout (``init_process_group(timeout=...)``, data-parallel only): how long a rank waits
    #: for the others at the rendezvous (rank 0's TCPStore for the rest to join, the others to reach it) and in every
    #: collective after it, before it fails with an error instead of hanging. It must exceed the longest time one rank
    #: can spend outside a collective while the others wait inside one: rank 0's evaluation of the whole test set
    #: (the others wait in its broadcast), a slow rank's torch.compile of the first step, ranks started seconds apart.
    #: Ten minutes, NCCL's own default (gloo's is 30): a rank that never arrives ends the trial after that; one that
    #: exits is caught at once (gloo: "Connection closed by peer" in the next collective; and the worker's watcher,
    #: ``harness.execution.ranks``).
    DDP_TIMEOUT = timedelta(minutes=10)

    def __init__(self, options: RunOptions | None = None) -> None:
        super().__init__(options)
        self.device = torch.device("cpu")
        self._memory_limit: dict[str, Any] = {}  # what _apply_memory_limit applied, for settings()
        self._ranks: DataParallel | None = None  # options.data_parallel once prepare joined the process group
        self._neutral: NeutralModule | None = None  # the neutral builder's model, for the canonical state

    # -- setup ---------------------------------------------------------------------------------------------------

    def versions(self) -> dict[str, str]:
        out = {"torch": torch.__version__.split("+")[0], "torch_build": torch.__version__}
        if torch.version.cuda:
            out["cuda"] = torch.version.cuda
        if torch.backends.cudnn.is_available():
            out["cudnn"] = str(torch.backends.cudnn.version())
        return out

    def device_problem(self, device: str) -> str | None:
        """torch.cuda.is_available and device_count (https://pytorch.org/docs/stable/cuda.html): neither creates a
        CUDA context. torch.version.cuda is None in a CPU-only build."""
        if not device.startswith("cuda"):
            return None
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"a CUDA {torch.version.cuda} build"
            return f"PyTorch {torch.__version__} sees no CUDA device ({build})"
        index, count = device_index(device), torch.cuda.device_count()
        return None if index < count else f"PyTorch sees {count} CUDA device(s); {device} is not one"

    def prepare(self, device: str, threads: int | None, seed: int) -> None:
        """The device, threads and seed. Data-parallel (``options.data_parallel``, one process per device): this
        process is rank r of N; it trains on ``devices[r]`` (a GPU; every rank on the CPU trains on "cpu"), seeds
        ``seed + r`` (each rank its own dropout masks, rank 0 those of one device) and joins the process group
        (``_join``)."""
        dp = self.options.data_parallel
        if dp is not None:
            device = self._rank_device(dp, device)
        if device.startswith("cuda"):
            if (problem := self.device_problem(device)) is not None:
                raise DeviceUnavailable(problem)
            index = device_index(device)
            torch.cuda.set_device(index)
            # fp32 means fp32: no TF32 in matmuls or convolutions (the other frameworks' defaults differ otherwise);
            # tf32 asks for it.
            tf32 = self.options.precision == "tf32"
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
            self._apply_memory_limit(index)
        self.device = torch.device(device)
        if threads is not None:
            torch.set_num_threads(threads)
            if torch.get_num_interop_threads() != 1:
                # Allowed once per process, before any inter-op work; a worker process calls this first thing.
                torch.set_num_interop_threads(1)
        torch.manual_seed(seed if dp is None else seed + dp.rank)
        if dp is not None:
            self._join(dp)

    @staticmethod
    def _rank_device(dp: DataParallel, device: str) -> str:
        """The device of this rank: ``dp.devices[dp.rank]`` on GPUs, "cpu" on the CPU (the ranks' "cpu:0", "cpu:1",
        ... are processes, not devices PyTorch tells apart). Raises ValueError unless there is one process per device
        and the devices are of ``device``'s kind."""
        if dp.processes != dp.size or dp.rank >= dp.size:
            raise ValueError(f"the pytorch adapter trains data-parallel with one process per device: rank {dp.rank} "
                             f"of {dp.processes} processes for {dp.size} devices")
        mine = dp.devices[dp.rank]
        if device_kind(mine) != device_kind(device):
            raise ValueError(f"data-parallel devices {', '.join(dp.devices)} for a trial on {device}")
        return mine if device_kind(mine) == "cuda" else "cpu"

    def _join(self, dp: DataParallel) -> None:
        """``torch.distributed.init_process_group`` as a torchrun-launched script calls it: backend gloo on the CPU,
        NCCL on GPUs (bound to this rank's GPU, ``device_id``), ``init_method="env://"`` (MASTER_ADDR, MASTER_PORT from
        ``harness.execution.ranks``; rank and world size from ``dp``, which the worker took from RANK and
        WORLD_SIZE), timeout ``DDP_TIMEOUT``; https://docs.pytorch.org/docs/stable/distributed.html. A rank that
        cannot form the group (the others never arrive, rank 0 unreachable) raises RuntimeError saying so after the
        timeout. The group is destroyed at the interpreter's exit (``_leave``): the adapter has no end of its own."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        extra: dict[str, Any] = {"device_id": self.device} if self.device.type == "cuda" else {}
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        try:
            dist.init_process_group(backend, init_method="env://", rank=dp.rank, world_size=dp.size,
                                    timeout=self.DDP_TIMEOUT, **extra)
        except (RuntimeError, ValueError) as exc:  # DistStoreError, DistNetworkError; ValueError: a variable unset
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__  # no C++ trace
            raise RuntimeError(
                f"rank {dp.rank} of {dp.size} could not join the {backend} process group at {where} within "
                f"{self.DDP_TIMEOUT.total_seconds():g} s (env:// rendezvous): {first}") from exc
        self._ranks = dp
        atexit.register(_leave)

    def _apply_memory_limit(self, index: int) -> None:
        """``options.memory_limit_bytes`` on a GPU: ``torch.cuda.set_per_process_memory_fraction(limit /
        total_memory, index)`` (https://pytorch.org/docs/stable/generated/torch.cuda.set_per_process_memory_fraction
        .html). The caching allocator then raises ``torch.OutOfMemoryError`` for an allocation that would take the
        memory it holds from the device past the fraction x total memory (the CUDA context itself is not counted). A
        limit at or above the device's memory is a fraction of 1: no cap. On the CPU nothing is done here (the worker
        caps the process)."""
        limit = self.options.memory_limit_bytes
        if not limit:
            return
        total = int(torch.cuda.get_device_properties(index).total_memory)
        fraction = min(float(limit) / total, 1.0)
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        self._memory_limit = {"memory_limit_bytes": int(limit), "memory_fraction": fraction,
                              "device_total_memory_bytes": total}

    def neutral_model(self, info: ModelInfo, weights: Weights) -> Model:
        """``adapters.pytorch.neutral.Builder``'s ``nn.Module`` (its batchnorm ``nn.SyncBatchNorm`` when a
        data-parallel trial asks for sync batchnorm); its canonical names are kept for ``get_weights``."""
        self._neutral = Builder(self._ranks is not None and self._ranks.sync_batchnorm).build(info, weights)
        return self._neutral.module

    def native_model(self, model: object, source: NativeSource) -> Model:
        """A ``torch.nn.Module`` of your own (``harness.neutral.native.make`` called it after ``prepare`` seeded
        ``torch.manual_seed``, so its initial weights follow the trial's seed), its output taken as the logits: a
        tensor, or the ``logits`` of a model output (transformers' ``ModelOutput``), or the first of a tuple
        (``adapters.pytorch.layers.Logits``). With sync batchnorm asked for, its batchnorm layers are made
        ``nn.SyncBatchNorm`` (``convert_sync_batchnorm``, what a DDP script does). Raises NativeModelError for
        anything else."""
        if not isinstance(model, nn.Module):
            raise NativeModelError("model", f"{source.factory} returned a {type(model).__module__}."
                                            f"{type(model).__qualname__}, not a torch.nn.Module")
        self._neutral = None
        if self._ranks is not None and self._ranks.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return L.Logits(model)

    def train_flops_per_sample(self) -> tuple[int | None, str]:
        """``torch.utils.flop_counter.FlopCounterMode`` around the loss, forward and backward, of two test samples
        in inference mode (so that batchnorm's running statistics do not move; the counted operations are the
        training mode's), divided by two; the gradients it leaves are cleared."""
        from torch.utils.flop_counter import FlopCounterMode

        training, x, y = self.training, self.inputs.x_test[:2], self.inputs.y_test[:2]
        training.net.eval()
        counter = FlopCounterMode(display=False)
        try:
            with counter:
                training.loss(training.net(x), y).backward()
        finally:
            training.net.train()
            training.opt.zero_grad(set_to_none=True)
        return int(counter.get_total_flops()) // len(x), "torch.utils.flop_counter.FlopCounterMode"

    def make_parts(self, model: Model, task: str, optimizer: OptimizerSpec) -> tuple[Training, Inputs]:
        """``model`` on the device, in training mode except inside ``evaluate`` and ``predict``, trained through
        ``adapters.pytorch.training.Training`` (DistributedDataParallel when data-parallel; evaluation and prediction
        use the unwrapped module); its input ``adapters.pytorch.inputs.Inputs``."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"the pytorch adapter trains a torch.nn.Module, not {type(model).__name__}")
        net = model.to(self.device)
        return (Training(net, task, optimizer, self.options, self.device, self._ranks),
                Inputs(self.options, self.device, task != "image_classification", self._ranks))

    # -- steps ---------------------------------------------------------------------------------------------------

    def wait(self) -> None:
        """``torch.cuda.synchronize`` on a GPU; nothing on the CPU, where eager and compiled steps run their kernels
        before returning (https://pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution: only CUDA
        work is asynchronous). Data-parallel: then ``dist.barrier()``, so that a timed window's edge is the moment
        every rank is there: it starts together on every rank and ends when the slowest rank is done."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._ranks is not None:
            dist.barrier()

    def agree(self, value: int) -> int:
        """Data-parallel: rank 0's ``value``, broadcast (``dist.broadcast``) to every rank."""
        if self._ranks is None:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(tensor, src=0)
        return int(tensor.item())

    # -- state ---------------------------------------------------------------------------------------------------

    def get_weights(self) -> Weights:
        if self._neutral is not None:
            return self._neutral.state(trained=True)
        return {name.removeprefix("module."): p.detach().cpu().numpy().copy()
                for name, p in self.training.net.named_parameters()}

    def get_buffers(self) -> Weights:
        if self._neutral is not None:
            return self._neutral.state(trained=False)
        return {name.removeprefix("module."): b.detach().cpu().numpy().copy()
                for name, b in self.training.net.named_buffers() if b.is_floating_point()}

    # -- telemetry -----------------------------------------------------------------------------------------------

    def reset_memory_stats(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def memory_stats(self) -> dict[str, int]:
        """On a GPU the caching allocator's peaks since ``reset_memory_stats`` (``reset_peak_memory_stats``):
        ``allocator_peak_bytes`` (``torch.cuda.max_memory_allocated``, what tensors held) and
        ``allocator_reserved_peak_bytes`` (``max_memory_reserved``, what it held from the device);
        https://pytorch.org/docs/stable/torch_cuda_memory.html."""
        if self.device.type != "cuda":
            return {}  # PyTorch keeps no allocator statistics for CPU tensors
        return {"allocator_peak_bytes": int(torch.cuda.max_memory_allocated(self.device)),
                "allocator_reserved_peak_bytes": int(torch.cuda.max_memory_reserved(self.device))}

    def settings(self) -> Settings:
        extras: dict[str, Any] = self._training.settings() if self._training is not None else {}
        if self.device.type == "cuda":
            extras.update({"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                           "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                           "cudnn_benchmark": torch.backends.cudnn.benchmark,
                           **{k: v for k, v in self._memory_limit.items() if k != "memory_limit_bytes"}})
        data_parallel = None
        if self._ranks is not None:
            data_parallel = {
                "mechanism": "DistributedDataParallel", "backend": dist.get_backend(), "world_size": self._ranks.size,
                "rank": self._ranks.rank, "device": str(self.device), "sync_batchnorm": self._ranks.sync_batchnorm,
                "broadcast_buffers": True, "bucket_cap_mb": 25, "timeout_s": self.DDP_TIMEOUT.total_seconds()}
        return Settings(precision=self.options.precision, compile=self.mode,
                        intra_op_threads=torch.get_num_threads(), inter_op_threads=torch.get_num_interop_threads(),
                        memory_limit_bytes=self._memory_limit.get("memory_limit_bytes"),
                        loader=self.loader_settings(),
                        data_parallel=data_parallel, **extras)

    def is_oom(self, exc: BaseException) -> bool:
        # torch.OutOfMemoryError (alias torch.cuda.OutOfMemoryError) is raised by the CUDA caching allocator. The CPU
        # allocator raises a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory"), which has no type of
        # its own, so that one is recognised by its message.
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


def _leave() -> None:
    """Destroys the default process group at the interpreter's exit (registered by ``PyTorchAdapter._join``), as a
    DDP script ends with ``dist.destroy_process_group()``: every rank is past its last collective by then (the
    trial's last evaluation), and NCCL warns about a group left undestroyed."""
    if dist.is_initialized():
        dist.destroy_process_group()
