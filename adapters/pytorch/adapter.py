"""PyTorch adapter: eager mode or ``torch.compile``, fp32 or mixed precision (``torch.autocast``, with
``torch.amp.GradScaler`` in fp16), data resident on the device, NCHW images and (B, L, D) sequences.
``PyTorchAdapter`` implements ``adapters.base.Adapter``; its blocks are in ``adapters.pytorch.layers``. The canonical
layouts and batchnorm are PyTorch's own, so the weights are copied in unchanged.

Design: docs/design/framework-caveats.md#pytorch (execution modes, precision and their sources).
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from adapters.base import (
    Adapter,
    DataParallel,
    DeviceUnavailable,
    data_parallel_gap,
    device_index,
    device_kind,
    micro_batch_size,
    shard,
)
from adapters.pytorch import DECLARATION
from adapters.pytorch import layers as L
from harness.neutral.models import initial_buffers


class PyTorchAdapter(Adapter, declaration=DECLARATION):
    #: The process group's timeout (``init_process_group(timeout=...)``, data-parallel only): how long a rank waits
    #: for the others at the rendezvous (rank 0's TCPStore for the rest to join, the others to reach it) and in every
    #: collective after it, before it fails with an error instead of hanging. It must exceed the longest time one rank
    #: can spend outside a collective while the others wait inside one: rank 0's evaluation of the whole test set
    #: (the others wait in its broadcast), a slow rank's torch.compile of the first step, ranks started seconds apart.
    #: Ten minutes, NCCL's own default (gloo's is 30): a rank that never arrives ends the trial after that; one that
    #: exits is caught at once (gloo: "Connection closed by peer" in the next collective; and the worker's watcher,
    #: ``harness.execution.ranks``).
    DDP_TIMEOUT = timedelta(minutes=10)

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._loss_sum: torch.Tensor | None = None  # float32 (), on the device: the losses since the last read
        self._loss_steps = 0  # the steps in it
        self._tensors: dict[str, tuple[nn.Module, str, bool]] = {}  # canonical name -> (module, attribute, trained)
        self.tokens = self.next_token = False
        self._memory_limit: dict[str, Any] = {}  # what _apply_memory_limit applied, for settings()
        self.precision, self.mode = "fp32", self.DEFAULT_COMPILE  # from options, in build
        self._autocast_dtype: torch.dtype | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self._ranks: DataParallel | None = None  # options.data_parallel once prepare joined the process group
        self._sync_batchnorm = False  # build makes nn.SyncBatchNorm layers (in _layer)
        self._loader_settings: dict[str, Any] = {}  # open_loader's DataLoader, for settings()

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

    def unsupported(self, info: Any) -> str | None:
        """The declaration's gaps (``support_gap``), then data parallelism's on this rank's device
        (``data_parallel_gap``: sync batchnorm on the CPU, for a model with batchnorm)."""
        dp = self.options.data_parallel
        return super().unsupported(info) or (None if dp is None else data_parallel_gap(
            self.declaration, info, dp.size, dp.sync_batchnorm, self.device.type))

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

    def build(self, info: Any, weights: dict[str, np.ndarray], optimizer: Any) -> None:
        """The canonical layers and blocks as torch modules (NCHW for images, (B, L, D) for sequences: weights
        copied in unchanged), in training mode except inside ``evaluate`` and ``predict``. Batchnorm's running
        statistics start from ``weights``' buffers if it has them, else from
        ``harness.neutral.models.initial_buffers``. Every parameter and buffer is kept under its canonical name
        (``self._params``, ``self._buffers``) for ``get_weights`` and ``get_buffers``. Data-parallel: the module is
        trained through ``DistributedDataParallel`` (``_ddp``), its batchnorm layers ``nn.SyncBatchNorm`` when
        ``sync_batchnorm`` is asked for; evaluation and prediction use the unwrapped module."""
        buffers = {**initial_buffers(info), **{k: v for k, v in weights.items() if k in info.buffer_names()}}
        self._tensors = {}
        self._sync_batchnorm = self._ranks is not None and self._ranks.sync_batchnorm
        self._loss_sum, self._loss_steps = None, 0
        self.next_token = info.task == "next_token"
        self.tokens = info.task != "image_classification"
        self.net = L.Network(*[self._layer(layer) for layer in info.layers])
        with torch.no_grad():
            for name, (_, _, trained) in self._tensors.items():
                self._tensor(name).copy_(torch.from_numpy((weights if trained else buffers)[name]))
        self.net = self.net.to(self.device).train()
        self.precision = self.options.precision
        self.mode = self.compile_mode(self.options.compile)
        self._autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        # The same parameters either way: torch.compile and DDP wrap the module, they do not copy it. Under DDP the
        # wrapper is compiled, as PyTorch recommends (TorchDynamo's DDPOptimizer splits the graph at the gradient
        # buckets so that their all-reduces still overlap the backward pass); it compiles L.Network's own forward.
        trained = self.net if self._ranks is None else self._ddp()
        compiled = self.mode == "compiled"
        self.model: nn.Module = torch.compile(trained) if compiled else trained
        # evaluate and predict: the same module; under DDP the unwrapped one (on one rank alone: no collectives)
        self._inference: nn.Module = (self.model if self._ranks is None else
                                      torch.compile(self.net) if compiled else self.net)
        self._dynamo_counters: Any = None
        self._compilations = 0
        if self.mode == "compiled":
            from torch._dynamo.utils import counters  # TorchDynamo's process-wide statistics

            self._dynamo_counters = counters
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None
        params = self.net.parameters()
        if optimizer.name == "sgd":
            self.opt: torch.optim.Optimizer = torch.optim.SGD(
                params, lr=optimizer.learning_rate, momentum=optimizer.momentum, weight_decay=optimizer.weight_decay)
        else:
            self.opt = torch.optim.Adam(params, lr=optimizer.learning_rate, betas=(optimizer.beta1, optimizer.beta2),
                                        eps=optimizer.epsilon, weight_decay=optimizer.weight_decay)

    def _ddp(self) -> nn.Module:
        """``torch.nn.parallel.DistributedDataParallel(self.net)`` with its defaults
        (https://docs.pytorch.org/docs/stable/notes/ddp.html): constructing it broadcasts rank 0's parameters and
        buffers (every rank built the same canonical ones anyway); in every backward pass the gradients are
        all-reduced and divided by N, in buckets of 25 MiB launched by autograd hooks as each bucket's gradients are
        ready, overlapping the rest of the backward pass; so with equal shards every rank's gradient is the mean over
        the global batch before the identical ``opt.step``. ``broadcast_buffers`` (default): every training forward
        first broadcasts rank 0's buffers, so the batchnorm running statistics of every rank are rank 0's, updated
        from rank 0's shard alone (without sync batchnorm; with it, from the global batch)."""
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(self.net, device_ids=[self.device] if self.device.type == "cuda" else None)

    def _keep(self, layer: Any, module: nn.Module, names: dict[str, str]) -> nn.Module:
        """Registers ``module``'s tensors under their canonical names: ``names`` maps a canonical local name
        (``weight``, ``in_proj.weight``, ...) to its attribute path in ``module`` (``weight``, ``mha.in_proj_weight``,
        ...); parameters are the names in ``layer.params``, the rest buffers."""
        for local, attribute in names.items():
            self._tensors[f"{layer.name}.{local}"] = (module, attribute, local in layer.params)
        return module

    def _tensor(self, name: str) -> torch.Tensor:
        """The parameter or buffer of canonical ``name`` (wherever ``.to(device)`` put it)."""
        module, attribute, trained = self._tensors[name]
        return module.get_parameter(attribute) if trained else module.get_buffer(attribute)

    def _layer(self, layer: Any) -> nn.Module:
        """One canonical layer or block as a module (``torch.nn``'s own layers; softmax folds into the loss)."""
        spec, kind = layer.spec, layer.kind
        if kind == "residual":
            return L.Residual(nn.Sequential(*[self._layer(child) for child in layer.body]),
                             nn.Sequential(*[self._layer(child) for child in layer.shortcut]),
                             spec.activation == "relu")
        plain = {"weight": "weight", "bias": "bias"}
        if kind == "conv2d":
            padding = (spec.kernel_size // 2 if spec.padding == "same" else 0 if spec.padding == "valid"
                       else spec.padding)  # an integer: that many zeros on every side, as PyTorch pads
            conv = nn.Conv2d(layer.input_shape[0], spec.filters, spec.kernel_size, stride=spec.stride,
                             padding=padding, bias=spec.use_bias)
            return L.activated(self._keep(layer, conv, {k: v for k, v in plain.items() if k in layer.params}), spec)
        if kind == "dense":  # on (B, F), or per position on (B, L, D): nn.Linear acts on the last axis
            return L.activated(self._keep(layer, nn.Linear(layer.input_shape[-1], spec.units), plain), spec)
        if kind == "batchnorm":
            # momentum is PyTorch's own convention (the weight of the new batch), running_var is updated with the
            # unbiased batch variance: the canonical semantics, natively (harness.spec.BatchNorm).
            # Sync batchnorm: what SyncBatchNorm.convert_sync_batchnorm would turn the layer into, made in place of
            # it so that the canonical names keep pointing at the module trained (convert makes new modules).
            norm = (nn.SyncBatchNorm if self._sync_batchnorm else
                    nn.BatchNorm2d if len(layer.input_shape) == 3 else nn.BatchNorm1d)
            module = norm(layer.input_shape[0], eps=spec.epsilon, momentum=spec.momentum)
            return self._keep(layer, module, {**plain, "running_mean": "running_mean", "running_var": "running_var"})
        if kind == "layernorm":
            return self._keep(layer, nn.LayerNorm(layer.input_shape[-1], eps=spec.epsilon), plain)
        if kind == "embedding":
            length, dim = layer.output_shape
            return self._keep(layer, L.Embedding(spec.vocab, length, dim),
                              {"token.weight": "token.weight", "position.weight": "position.weight"})
        if kind == "attention":
            length, dim = layer.input_shape
            module = L.SelfAttention(dim, spec.heads, length if spec.causal else None)
            return self._keep(layer, module, {
                "in_proj.weight": "mha.in_proj_weight", "in_proj.bias": "mha.in_proj_bias",
                "out_proj.weight": "mha.out_proj.weight", "out_proj.bias": "mha.out_proj.bias"})
        if kind == "maxpool2d":
            return nn.MaxPool2d(spec.pool_size, spec.stride or spec.pool_size)
        if kind == "avgpool2d":
            return nn.AvgPool2d(spec.pool_size, spec.stride or spec.pool_size)  # no padding
        if kind == "global_avgpool2d":
            return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())  # (N, C, 1, 1) -> (N, C)
        if kind == "sequence_pool":
            return L.SequencePool(spec.mode)
        if kind == "dropout":
            return nn.Dropout(spec.rate)
        if kind == "flatten":
            return nn.Flatten()  # NCHW flattens channel-first: the canonical order
        if kind == "relu":
            return nn.ReLU()
        if kind == "gelu":
            return nn.GELU()  # the exact erf form (approximate="none")
        if kind == "softmax":
            return nn.Identity()  # folded into the cross-entropy loss
        raise ValueError(f"the pytorch adapter cannot build {kind} layers")

    def _to_device_inputs(self, inputs: np.ndarray) -> torch.Tensor:
        """NHWC float32 images as NCHW, or (N, L) int64 token ids as they are, on the device."""
        if self.tokens:
            return torch.tensor(inputs, dtype=torch.int64, device=self.device)
        # torch.tensor always copies: from_numpy(...).to("cpu") would share the caller's array (for one channel the
        # NCHW transpose is already contiguous), and set_train_images would then write into the harness's dataset.
        # Contiguous NCHW, PyTorch's default memory format: a copy of the transposed NHWC array would keep its
        # channels-last strides, and then which convolution kernel runs (about 30 % apart on the CPU) would depend
        # on how a batch is gathered (benchmarks/harness_vs_loop.py).
        return torch.tensor(np.ascontiguousarray(inputs.transpose(0, 3, 1, 2)), dtype=torch.float32,
                            device=self.device)

    def load(self, data: Any) -> None:
        if self.options.input == "resident":  # a loader brings the training batches itself (open_loader)
            self.x_train = self._to_device_inputs(data.x_train)
            self.y_train = torch.from_numpy(data.y_train).to(self.device)
        self.x_test = self._to_device_inputs(data.x_test)
        self.y_test = torch.from_numpy(data.y_test).to(self.device)

    def open_loader(self, source: Any) -> None:
        """A ``torch.utils.data.DataLoader`` over ``source`` (https://pytorch.org/docs/stable/data.html): a map-style
        dataset whose ``__getitems__`` reads a whole batch (``source.read``) and converts it to the tensors
        resident mode holds (NCHW float32, or int64 tokens), a batch sampler yielding each step's samples of the
        epoch's order, ``num_workers`` = ``options.loader.workers`` worker processes (persistent across epochs),
        ``prefetch_factor`` = ``options.loader.prefetch`` batches per worker, and ``pin_memory`` on CUDA so that
        the copy to the device can overlap (``non_blocking``)."""
        workers = self.options.loader.workers
        self._batches = _EpochBatches()
        self._loader = torch.utils.data.DataLoader(
            _Samples(source, self.tokens), batch_sampler=self._batches, collate_fn=_as_is, num_workers=workers,
            pin_memory=self.device.type == "cuda", persistent_workers=workers > 0,
            prefetch_factor=self.options.loader.prefetch if workers > 0 else None)
        self._loader_settings = {"loader": "torch.utils.data.DataLoader", "num_workers": workers,
                                 "prefetch_factor": self.options.loader.prefetch if workers > 0 else None,
                                 "persistent_workers": workers > 0, "pin_memory": self.device.type == "cuda",
                                 "source": "files" if source.from_files else "memory"}

    def epoch_batches(self, order: np.ndarray, samples_per_step: int, epoch: int) -> Any:
        self._batches.order, self._batches.size, self._batches.epoch = order, samples_per_step, epoch
        for x, y in self._loader:
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def train_batch(self, batch: Any, micro_batches: int = 1) -> None:
        x, y = batch
        micro_batch_size(len(x), micro_batches)  # raises ValueError for an uneven split
        self._count_compilations(lambda: self._train_on(zip(x.chunk(micro_batches), y.chunk(micro_batches)),
                                                        micro_batches))

    def _autocast(self) -> Any:
        """``torch.autocast`` in the trial's low precision around a forward pass and its loss; nothing in fp32/tf32."""
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def _backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, through the GradScaler in fp16 (the loss scaled, so that small gradients survive)."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def _step(self) -> None:
        """``opt.step()``; in fp16 ``scaler.step`` (unscales the gradients, skips the step on inf/nan) and
        ``scaler.update`` (https://pytorch.org/docs/stable/amp.html#gradient-scaling)."""
        if self.scaler is None:
            self.opt.step()
            return
        self.scaler.step(self.opt)
        self.scaler.update()

    def _loss(self, logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Softmax cross-entropy: over the samples, or for a next-token model over every position (logits
        (B, L, V) and labels (B, L) flattened to B x L rows)."""
        if self.next_token:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction=reduction)
        return F.cross_entropy(logits, y, reduction=reduction)

    def set_train_images(self, images: np.ndarray) -> None:
        """Copies ``images`` (float32 NHWC) over the resident training images (NCHW) in place."""
        self.x_train.copy_(torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))))

    def train_step(self, indices: np.ndarray, micro_batches: int = 1, position: int | None = None) -> None:
        """One optimizer step (``_train_step``; ``indices`` are converted at every step, ``position`` is not
        needed); in the compiled mode the graphs TorchDynamo captures in it are counted (``_count_compilations``)."""
        self._count_compilations(lambda: self._train_step(indices, micro_batches))

    def _count_compilations(self, step: Any) -> None:
        """Runs ``step()``; in the compiled mode counts the graphs TorchDynamo captures in it
        (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``, read around the step so that the graphs of
        evaluation are not counted)."""
        if self._dynamo_counters is None:
            step()
            return
        before = self._dynamo_counters["stats"]["unique_graphs"]
        step()
        self._compilations += self._dynamo_counters["stats"]["unique_graphs"] - before

    def compilations(self) -> int | None:
        return self._compilations if self._dynamo_counters is not None else None

    def _train_step(self, indices: np.ndarray, micro_batches: int = 1) -> None:
        """One optimizer step on the resident samples ``indices``. Data-parallel: this rank runs its shard
        (``shard(indices, N, rank)``) through the DDP module, whose backward all-reduces the gradients (their mean
        over the ranks: the global batch's with equal shards); the recorded loss is the shard's mean, averaged over
        the ranks when it is read (``_take_loss_sum``). Gradient accumulation is not combined with it (ValueError)."""
        if self._ranks is not None:
            if micro_batches > 1:
                raise ValueError("gradient accumulation with data parallelism is not supported")
            indices = shard(indices, self._ranks.size, self._ranks.rank)
        micro_batch_size(len(indices), micro_batches)  # raises ValueError for an uneven split
        idx = torch.from_numpy(indices).to(self.device, non_blocking=True)
        # each micro-batch gathered as it is trained on: only one micro-batch's inputs exist at a time
        self._train_on(((self.x_train.index_select(0, part), self.y_train.index_select(0, part))
                        for part in idx.chunk(micro_batches)), micro_batches)

    def _train_on(self, parts: Iterable[tuple[torch.Tensor, torch.Tensor]], micro_batches: int) -> None:
        """One optimizer step on a batch on the device, given as its ``micro_batches`` k consecutive parts (x, y) of
        B / k samples (resident mode gathers each as it comes, ``_train_step``; a loader's batch is chunked,
        ``train_batch``). Each part runs forward and backward on its own, with k > 1 its mean loss scaled by 1 / k
        (``backward`` adds into ``.grad``), so that the one ``opt.step`` applies the mean gradient over all B samples
        while only one micro-batch's activations are alive at a time. The recorded loss is the mean over all B
        samples."""
        self.opt.zero_grad(set_to_none=True)
        for x, y in parts:
            with self._autocast():
                loss = self._loss(self.model(x), y)
                if micro_batches > 1:
                    loss = loss / micro_batches
            self._backward(loss)
            self._add_loss(loss)  # k adds of mean / k: the step adds the mean over its B samples
        self._step()
        self._loss_steps += 1

    def _add_loss(self, loss: torch.Tensor) -> None:
        """Adds ``loss`` (a scalar tensor) to the running sum on the device, detached: one queued ``add_``, no read
        back (the sum is made at the first step)."""
        if self._loss_sum is None:
            self._loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        self._loss_sum.add_(loss.detach())

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

    def _take_loss_sum(self) -> float:
        """The sum's ``.item()`` (one scalar copy) and ``zero_`` (queued, before the next step). Data-parallel: first
        all-reduced (summed, then divided by N: gloo has no average) into the mean of the ranks' shard losses, which
        with equal shards is the global batch's mean loss, on every rank."""
        if self._loss_sum is None:
            raise RuntimeError("no loss sum: read_loss reads only after a train_step")
        if self._ranks is not None:
            dist.all_reduce(self._loss_sum, op=dist.ReduceOp.SUM)
            self._loss_sum.div_(self._ranks.size)
        total = float(self._loss_sum.item())
        self._loss_sum.zero_()
        return total

    def evaluate(self, batch_size: int) -> tuple[float, float]:
        """Data-parallel: rank 0 evaluates its unwrapped module over the whole test set while the others wait in
        the broadcast of its (loss, accuracy), which every rank returns."""
        if self._ranks is None:
            return self._evaluate(batch_size)
        result = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self._ranks.rank == 0:
            result.copy_(torch.tensor(self._evaluate(batch_size), dtype=torch.float64))
        dist.broadcast(result, src=0)
        loss, accuracy = result.tolist()
        return float(loss), float(accuracy)

    @torch.no_grad()
    def _evaluate(self, batch_size: int) -> tuple[float, float]:
        self.net.eval()
        total_loss = torch.zeros((), device=self.device, dtype=torch.float64)
        correct = torch.zeros((), device=self.device, dtype=torch.int64)
        n = self.x_test.shape[0]
        for start in range(0, n, batch_size):
            with self._autocast():
                logits = self._inference(self.x_test[start:start + batch_size]).float()
            y = self.y_test[start:start + batch_size]
            total_loss += self._loss(logits, y, reduction="sum").double()
            correct += (logits.argmax(dim=-1) == y).sum()
        self.net.train()
        count = self.y_test.numel()  # samples, or every position of every sequence
        return float(total_loss.item()) / count, float(correct.item()) / count

    @torch.no_grad()
    def predict(self, images: np.ndarray) -> np.ndarray:
        self.net.eval()
        with self._autocast():
            logits = self._inference(self._to_device_inputs(images if self.tokens else images.astype(np.float32)))
        self.net.train()
        return logits.float().cpu().numpy()

    def get_weights(self) -> dict[str, np.ndarray]:
        return {name: self._tensor(name).detach().cpu().numpy().copy()
                for name, (_, _, trained) in self._tensors.items() if trained}

    def get_buffers(self) -> dict[str, np.ndarray]:
        return {name: self._tensor(name).detach().cpu().numpy().copy()
                for name, (_, _, trained) in self._tensors.items() if not trained}

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

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"intra_op_threads": torch.get_num_threads(),
                               "inter_op_threads": torch.get_num_interop_threads()}
        dtype = self._autocast_dtype
        out.update({"precision": self.precision, "compile": self.mode,
                    "autocast_dtype": None if dtype is None else str(dtype).removeprefix("torch.")})
        if self.mode == "compiled":
            out["torch_compile"] = {"backend": "inductor", "mode": "default"}
        if self.scaler is not None:
            out["loss_scale"] = float(self.scaler.get_scale())
        if self.device.type == "cuda":
            out["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
            out["allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
            out["cudnn_benchmark"] = torch.backends.cudnn.benchmark
            out["memory_limit_bytes"] = None
            out.update(self._memory_limit)
        if self._loader_settings:
            out["loader"] = self._loader_settings
        if self._ranks is not None:
            out["data_parallel"] = {
                "mechanism": "DistributedDataParallel", "backend": dist.get_backend(), "world_size": self._ranks.size,
                "rank": self._ranks.rank, "device": str(self.device), "sync_batchnorm": self._sync_batchnorm,
                "broadcast_buffers": True, "bucket_cap_mb": 25, "timeout_s": self.DDP_TIMEOUT.total_seconds()}
        return out

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


class _Samples(torch.utils.data.Dataset):
    """The loader's map-style dataset: ``__getitems__`` reads a whole step (the batch sampler's one key, (epoch, the
    step's int64 indices)) through ``source.read`` and returns the tensors resident mode would gather (NCHW float32
    images, or int64 tokens; int64 labels), so that the DataLoader's workers do the conversion (collate:
    ``_as_is``)."""

    def __init__(self, source: Any, tokens: bool):
        self.source, self.tokens = source, tokens

    def __len__(self) -> int:
        return len(self.source)

    def __getitems__(self, keys: list[tuple[int, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
        ((epoch, indices),) = keys
        x, y = self.source.read(indices, epoch)
        if not self.tokens:
            x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        return torch.from_numpy(x), torch.from_numpy(y)


def _as_is(batch: Any) -> Any:
    """The DataLoader's collate_fn: ``_Samples.__getitems__`` made the batch already."""
    return batch


class _EpochBatches:
    """The DataLoader's batch sampler: the epoch's ``order`` cut into steps of ``size`` samples, each one key
    (epoch, the step's int64 indices) (the epoch draws the augmentation), as Gluon's loader gets them; set before
    each epoch's iterator (in the training process, where a batch sampler runs)."""

    def __init__(self) -> None:
        self.order: np.ndarray = np.zeros(0, dtype=np.int64)
        self.size, self.epoch = 1, 0

    def __len__(self) -> int:
        return len(self.order) // self.size

    def __iter__(self) -> Any:
        for start in range(0, len(self) * self.size, self.size):
            yield [(self.epoch, self.order[start:start + self.size])]
