"""PyTorch's training mechanics, for any ``torch.nn.Module`` whatever built it: the optimizer, eager or
``torch.compile``, fp32 or mixed precision (``torch.autocast``, with ``torch.amp.GradScaler`` in fp16), gradient
accumulation over micro-batches, DistributedDataParallel, the device-resident loss sum, evaluation and prediction.

Design: docs/design/framework-caveats.md#pytorch (execution modes, precision and their sources).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from adapters.base import DataParallel, RunOptions
from harness.spec import OptimizerSpec

#: The micro-batches of one step: (x, y) pairs on the device.
Parts = Iterable[tuple[torch.Tensor, torch.Tensor]]


class Training:
    """One trial's training of ``net`` (already on ``device``) for ``task`` with ``optimizer``, in the options'
    precision and mode; ``ranks``: this process's place in a data-parallel trial (the process group joined), else
    None. The same parameters whatever wraps them: ``torch.compile`` and DDP wrap the module, they do not copy it."""

    def __init__(self, net: nn.Module, task: str, optimizer: OptimizerSpec, options: RunOptions,
                 device: torch.device, ranks: DataParallel | None):
        self.net, self.device, self.ranks = net.train(), device, ranks
        self.next_token = task == "next_token"
        self.precision, self.mode = options.precision, options.compile
        self.autocast_dtype: torch.dtype | None = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        compiled = self.mode == "compiled"
        # Under DDP the wrapper is compiled, as PyTorch recommends (TorchDynamo's DDPOptimizer splits the graph at the
        # gradient buckets so that their all-reduces still overlap the backward pass); it compiles the wrapped
        # module's own forward (layers.Network's docstring says why that must be code outside torch).
        trained = net if ranks is None else _ddp(net, device)
        self.model: nn.Module = torch.compile(trained) if compiled else trained
        # evaluate and predict: the same module; under DDP the unwrapped one (on one rank alone: no collectives)
        self.inference: nn.Module = self.model if ranks is None else torch.compile(net) if compiled else net
        self._dynamo_counters: Any = None
        self._compilations = 0
        if compiled:
            from torch._dynamo.utils import counters  # TorchDynamo's process-wide statistics

            self._dynamo_counters = counters
        self.scaler = torch.amp.GradScaler(device.type) if self.precision == "fp16" else None
        self.opt = _optimizer(net.parameters(), optimizer)
        self._loss_sum: torch.Tensor | None = None  # float32 (), on the device: the losses since the last read

    def autocast(self) -> Any:
        """``torch.autocast`` in the trial's low precision around a forward pass and its loss; nothing in fp32/tf32."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def loss(self, logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Softmax cross-entropy: over the samples, or for a next-token model over every position (logits
        (B, L, V) and labels (B, L) flattened to B x L rows)."""
        if self.next_token:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction=reduction)
        return F.cross_entropy(logits, y, reduction=reduction)

    def step(self, parts: Parts, micro_batches: int) -> None:
        """One optimizer step on a batch on the device, given as its ``micro_batches`` k consecutive parts (x, y) of
        B / k samples. Each part runs forward and backward on its own, with k > 1 its mean loss scaled by 1 / k
        (``backward`` adds into ``.grad``), so that the one ``opt.step`` applies the mean gradient over all B samples
        while only one micro-batch's activations are alive at a time. The recorded loss is the mean over all B
        samples. Data-parallel: the DDP module's backward all-reduces the gradients (their mean over the ranks: the
        global batch's with equal shards); gradient accumulation is not combined with it (ValueError). In the
        compiled mode the graphs TorchDynamo captures here are counted (``compilations``)."""
        if self.ranks is not None and micro_batches > 1:
            raise ValueError("gradient accumulation with data parallelism is not supported")
        self._counted(lambda: self._step(parts, micro_batches))

    def _step(self, parts: Parts, micro_batches: int) -> None:
        self.opt.zero_grad(set_to_none=True)
        for x, y in parts:
            with self.autocast():
                loss = self.loss(self.model(x), y)
                if micro_batches > 1:
                    loss = loss / micro_batches
            # through the GradScaler in fp16: the loss scaled, so that small gradients survive
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            self._add_loss(loss)  # k adds of mean / k: the step adds the mean over its B samples
        if self.scaler is None:
            self.opt.step()
        else:  # unscales the gradients, skips the step on inf/nan (https://pytorch.org/docs/stable/amp.html)
            self.scaler.step(self.opt)
            self.scaler.update()

    def gradient_norms(self, parts: Parts, micro_batches: int) -> tuple[list[float], float]:
        """Squared L2 norms of the gradients of the ``micro_batches`` k parts' mean losses, and of their mean
        (``Adapter.gradient_norms``), at the current parameters; nothing the training depends on is changed.

        Each part runs forward as in ``_step`` (training mode, autocast, fp16's loss scale, which is divided out
        again), but its gradients are taken with ``torch.autograd.grad``, so the parameters' ``.grad``, the optimizer
        and the loss sum are not touched. The uncompiled module runs it (the same function as the trained one: no
        TorchDynamo graphs for a micro-batch size training may not use, none of them counted in ``compilations``).
        The buffers (batchnorm's running statistics and step count) are copied before and copied back after, bit
        for bit; dropout draws from the global generator, which advances. Each part's per-parameter squared sums
        are float32 on the device; the host reads them once, at the end (which waits for the device), and adds them
        up in float64.

        Args:
            parts: the k micro-batches (x, y) of one step on the device, as ``Inputs.arrays`` gives them.
            micro_batches: k, the number of parts.

        Returns:
            ([|g_1|^2, ..., |g_k|^2], |G|^2), G the mean of the k gradients.
        """
        params = [p for p in self.net.parameters() if p.requires_grad]
        saved = [b.detach().clone() for b in self.net.buffers()]
        # fp16: the loss scaled as _step scales it (GradScaler.scale), so that small gradients do not flush to zero;
        # a power of two, so dividing it out again is exact
        scale = None if self.scaler is None else self.scaler.get_scale()
        total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        rows: list[torch.Tensor] = []
        try:
            for x, y in parts:
                with self.autocast():
                    loss = self.loss(self.net(x), y)
                grads = torch.autograd.grad(loss if scale is None else loss * scale, params, allow_unused=True,
                                            materialize_grads=True)  # an unused parameter's gradient is zero
                with torch.no_grad():
                    grads_f32 = [g.float() if scale is None else g.float() / scale for g in grads]
                    rows.append(torch.stack([g.square().sum() for g in grads_f32]))
                    torch._foreach_add_(total, grads_f32)
        finally:
            with torch.no_grad():
                for buffer, value in zip(self.net.buffers(), saved):
                    buffer.copy_(value)
        with torch.no_grad():
            rows.append(torch.stack([(t / micro_batches).square().sum() for t in total]))
            sums = torch.stack(rows).cpu().numpy().astype(np.float64).sum(axis=1)  # the one read back
        return [float(s) for s in sums[:-1]], float(sums[-1])

    def _counted(self, step: Callable[[], None]) -> None:
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

    def _add_loss(self, loss: torch.Tensor) -> None:
        """Adds ``loss`` (a scalar tensor) to the running sum on the device, detached: one queued ``add_``, no read
        back (the sum is made at the first step)."""
        if self._loss_sum is None:
            self._loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        self._loss_sum.add_(loss.detach())

    def take_loss_sum(self) -> float:
        """The sum's ``.item()`` (one scalar copy) and ``zero_`` (queued, before the next step). Data-parallel: first
        all-reduced (summed, then divided by N: gloo has no average) into the mean of the ranks' shard losses, which
        with equal shards is the global batch's mean loss, on every rank."""
        if self._loss_sum is None:
            raise RuntimeError("no loss sum: read_loss reads only after a train_step")
        if self.ranks is not None:
            dist.all_reduce(self._loss_sum, op=dist.ReduceOp.SUM)
            self._loss_sum.div_(self.ranks.size)
        total = float(self._loss_sum.item())
        self._loss_sum.zero_()
        return total

    def evaluate(self, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> tuple[float, float]:
        """Mean loss and accuracy over (x, y) on the device, in batches of ``batch_size``. Data-parallel: rank 0
        evaluates its unwrapped module while the others wait in the broadcast of its (loss, accuracy), which every
        rank returns."""
        if self.ranks is None:
            loss, accuracy = self._evaluate(x, y, batch_size)
            return float(loss), float(accuracy)
        result = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.ranks.rank == 0:
            result.copy_(torch.tensor(self._evaluate(x, y, batch_size), dtype=torch.float64))
        dist.broadcast(result, src=0)
        loss, accuracy = result.tolist()
        return float(loss), float(accuracy)

    @torch.no_grad()
    def _evaluate(self, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> tuple[float, float]:
        self.net.eval()
        total_loss = torch.zeros((), device=self.device, dtype=torch.float64)
        correct = torch.zeros((), device=self.device, dtype=torch.int64)
        for start in range(0, x.shape[0], batch_size):
            with self.autocast():
                logits = self.inference(x[start:start + batch_size]).float()
            labels = y[start:start + batch_size]
            total_loss += self.loss(logits, labels, reduction="sum").double()
            correct += (logits.argmax(dim=-1) == labels).sum()
        self.net.train()
        count = y.numel()  # samples, or every position of every sequence
        return float(total_loss.item()) / count, float(correct.item()) / count

    def predict(self, x: torch.Tensor) -> npt.NDArray[np.float32]:
        """Logits of ``x`` (on the device), float32, in inference mode."""
        self.net.eval()
        with torch.no_grad(), self.autocast():
            logits = self.inference(x)
        self.net.train()
        result: npt.NDArray[np.float32] = logits.float().cpu().numpy()
        return result

    def settings(self) -> dict[str, Any]:
        """The mechanics' settings for the record: the autocast dtype, TorchInductor's options, the loss scale."""
        dtype = self.autocast_dtype
        out: dict[str, Any] = {"autocast_dtype": None if dtype is None else str(dtype).removeprefix("torch.")}
        if self.mode == "compiled":
            out["torch_compile"] = {"backend": "inductor", "mode": "default"}
        if self.scaler is not None:
            out["loss_scale"] = float(self.scaler.get_scale())
        return out


def _ddp(net: nn.Module, device: torch.device) -> nn.Module:
    """``torch.nn.parallel.DistributedDataParallel(net)`` with its defaults
    (https://docs.pytorch.org/docs/stable/notes/ddp.html): constructing it broadcasts rank 0's parameters and buffers
    (every rank built the same ones anyway); in every backward pass the gradients are all-reduced and divided by N, in
    buckets of 25 MiB launched by autograd hooks as each bucket's gradients are ready, overlapping the rest of the
    backward pass; so with equal shards every rank's gradient is the mean over the global batch before the identical
    ``opt.step``. ``broadcast_buffers`` (default): every training forward first broadcasts rank 0's buffers, so the
    batchnorm running statistics of every rank are rank 0's, updated from rank 0's shard alone (without sync
    batchnorm; with it, from the global batch)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(net, device_ids=[device] if device.type == "cuda" else None)


def _optimizer(params: Iterable[nn.Parameter], optimizer: OptimizerSpec) -> torch.optim.Optimizer:
    """``torch.optim.SGD`` (momentum, coupled weight decay) or ``torch.optim.Adam`` with the spec's settings: the
    canonical formulas (harness.spec.OptimizerSpec)."""
    if optimizer.name == "sgd":
        return torch.optim.SGD(params, lr=optimizer.learning_rate, momentum=optimizer.momentum,
                               weight_decay=optimizer.weight_decay)
    return torch.optim.Adam(params, lr=optimizer.learning_rate, betas=(optimizer.beta1, optimizer.beta2),
                            eps=optimizer.epsilon, weight_decay=optimizer.weight_decay)
