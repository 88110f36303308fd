"""MXNet's training mechanics, written against any Gluon block whatever built it: imperative or hybridized, fp32 or
AMP's fp16 (``adapters.mxnet.precision``), the optimizer on a ``gluon.Trainer`` (``adapters.mxnet.optimizers``),
gradient accumulation over micro-batches, data parallelism over several contexts through a kvstore, the batchnorm
running-variance correction (``adapters.mxnet.batchnorm``), the device-resident loss sum, evaluation and prediction.

Design: docs/design/framework-caveats.md#mxnet (the asynchronous engine, the two modes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from adapters.base import RunOptions, micro_batch_size
from adapters.mxnet import precision
from adapters.mxnet.batchnorm import BatchNormLayer, RunningVariance
from adapters.mxnet.optimizers import optimizer_for
from adapters.mxnet.runtime import autograd, gluon, nd
from harness.neutral.precision import LOSS_SCALE_BACKOFF
from harness.spec import OptimizerSpec

#: ``HybridBlock.hybridize``'s flags in the compiled mode (https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/
#: gluon/hybrid_block.html): one cached graph whose memory is allocated once and whose shapes are fixed.
HYBRIDIZE_FLAGS = {"static_alloc": True, "static_shape": True}

#: One context's part of a step (``adapters.mxnet.inputs.Inputs.arrays``): ``take(None)`` gathers all its samples as
#: (x, y) on its context, ``take(slice(a, b))`` its samples a:b, so that a micro-batch's samples are made when it runs.
Take = Callable[[slice | None], tuple[Any, Any]]
#: A step as ``adapters.mxnet.inputs.Inputs.arrays`` gives it: each context's ``Take`` and the step's samples B.
Step = tuple[list[Take], int]


class Training:
    """One trial's training of ``net`` (a Gluon block, initialised on every one of ``contexts``: one, or one per
    device of a data-parallel trial, the first being the one evaluation and prediction use) with ``optimizer``, in
    the options' precision and mode. ``batchnorms``: the model's batchnorm layers (the neutral builder's), whose
    running variance is corrected where MXNet's kernel updates it with the biased batch variance.

    The compiled mode (``options.compile``) hybridizes ``net`` with ``HYBRIDIZE_FLAGS``; eager leaves it imperative.
    Hybridized, a new input shape (evaluation's batches, ``predict``) re-plans the cached graph, which costs tens of
    microseconds for this project's models (measured on 1.9.1; memory stays flat however often the shapes alternate),
    so training, evaluation and ``predict`` share the one graph and need no padding. fp16 runs under AMP, which the
    adapter initialised before any framework op (``precision.init_amp``); the Trainer then scales the loss
    dynamically.

    The loss is ``gluon.loss.SoftmaxCrossEntropyLoss(axis=-1)``: sparse labels, log-softmax of the logits inside, over
    the last axis (the classes, or each position's vocabulary); a per-sample loss, the mean over a sequence's positions
    for next-token logits (N, L, V). ``task`` is not needed beyond that: both tasks train with it."""

    def __init__(self, net: Any, task: str, optimizer: OptimizerSpec, options: RunOptions, contexts: list[Any],
                 batchnorms: Sequence[BatchNormLayer]):
        self.net, self.contexts, self.ctx = net, contexts, contexts[0]
        self.hybridized = options.compile == "compiled"
        self.sync_batchnorm = options.data_parallel is not None and options.data_parallel.sync_batchnorm
        self.amp_dtype = precision.AMP_DTYPES[options.precision]
        if self.hybridized:
            net.hybridize(**HYBRIDIZE_FLAGS)
        sync = contexts if self.sync_batchnorm else ()
        self.variance = RunningVariance(batchnorms, self.ctx, HYBRIDIZE_FLAGS if self.hybridized else None, sync)
        self.loss_fn = gluon.loss.SoftmaxCrossEntropyLoss(axis=-1)
        self.params = net.collect_params()
        self._grad_req = "write"
        self.trainer = self._trainer(optimizer_for(optimizer))
        if self.amp_dtype is not None:
            precision.init_trainer(self.trainer)
        # the losses since the last read, on the device: (B, 1) -> float32 (B,) per-sample sums for plain steps, (B, k)
        # -> (1,) sums over the B samples for k > 1 micro-batches; data-parallel (B, 1, d) -> device d's (B / N,)
        # per-sample sums on its context. Each step's loss is the sum of its keys' sums / B.
        self._loss_sums: dict[tuple[int, ...], Any] = {}

    def _trainer(self, opt: Any) -> Any:
        """The ``gluon.Trainer`` of the parameters with optimizer ``opt``. One device: kvstore=None, the update runs
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
        (and read them while the CPU batchnorm kernel may still be writing them: see ``RunningVariance.correct``).
        Here every copy is the same; allreduce_grads creates the kvstore, broadcasts, and sums the still-zero
        gradients."""
        if len(self.contexts) == 1:
            return gluon.Trainer(self.params, opt, kvstore=None)
        trainer = gluon.Trainer(self.params, opt, kvstore="device", update_on_kvstore=False)
        trainer.allreduce_grads()
        nd.waitall()
        return trainer

    def step(self, arrays: Step, micro_batches: int) -> None:
        """One optimizer step on a batch of B samples, given as each context's part (``arrays``: the ``Take``s, one,
        or data-parallel one per context, ``_step_parallel``, and B). Forward and backward run under
        ``autograd.record`` and the Trainer steps with ``batch_size = batch``: the backward pass of the per-sample loss
        vector gives the gradient of the sum, which ``Trainer.step`` rescales by 1 / batch_size, so the update uses
        the mean gradient
        (https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/gluon/trainer.html#mxnet.gluon.Trainer.step).
        Returns once the work is queued; an error in it (an out-of-memory one too) is raised by the next ``wait`` or
        loss read. The loss goes into the per-sample running sum with one queued operator a step. In fp16 the
        backward pass starts from the loss times AMP's loss scale (``precision.scaled``).

        With ``micro_batches`` k > 1 (gradient accumulation) the parameters' ``grad_req`` is ``add``: the gradients
        are zeroed, each micro-batch of B / k runs forward and backward on its own (adding the gradient of its summed
        loss), and one ``Trainer.step(B)`` applies the sum rescaled by 1 / B, the mean over all B samples. Raises
        ValueError when k does not divide B, and data-parallel for gradient accumulation."""
        takes, batch = arrays
        if len(takes) > 1 and micro_batches != 1:
            raise ValueError("gradient accumulation with data parallelism is not supported")
        if len(takes) > 1:
            self._step_parallel(takes, batch)
        elif micro_batches == 1:
            self._step(takes[0], batch)
        else:
            self._accumulate(takes[0], batch, micro_batches)

    def _step(self, take: Take, batch: int) -> None:
        self._set_grad_req("write")
        x, y = take(None)
        before = self.variance.before(self.ctx)
        with autograd.record():
            loss = self.loss_fn(self.net(x), y)
            scaled = self._scaled(loss)
        scaled.backward()
        if self.variance:
            self.variance.correct(before, batch, self.ctx)
        self.trainer.step(batch)
        self._add_loss((batch, 1), loss)  # per sample: no mean queued every step

    def _accumulate(self, take: Take, batch: int, micro_batches: int) -> None:
        micro = micro_batch_size(batch, micro_batches)
        self._set_grad_req("add")
        self.params.zero_grad()
        sums = []
        for start in range(0, batch, micro):
            before = self.variance.before(self.ctx)
            with autograd.record():
                x, y = take(slice(start, start + micro))
                loss = self.loss_fn(self.net(x), y)
                scaled = self._scaled(loss)
            scaled.backward()  # adds the gradient of this micro-batch's summed loss into the parameters' grads
            if self.variance:
                self.variance.correct(before, micro, self.ctx)
            sums.append(loss.sum())
        self.trainer.step(batch)  # the sum over all B samples, rescaled by 1 / B: the mean gradient
        key = (batch, micro_batches)
        held = self._loss_sums.get(key)
        self._loss_sums[key] = nd.add_n(*sums) if held is None else nd.add_n(held, *sums)  # (1,): / B when read

    def _step_parallel(self, takes: list[Take], batch: int) -> None:
        """One data-parallel step, as a Gluon user writes it for several contexts: context d gathers its shard
        (``adapters.base.shard(indices, N, d)``) from its own copy of the training set; under one ``autograd.record``
        every context runs the forward pass and its per-sample loss; ``autograd.backward`` over the N losses leaves in
        each context's gradient arrays the gradient of its shard's summed loss; then ``Trainer.step(B)`` with the
        global batch B: the kvstore sums each gradient over the N contexts (pushpull on the "device" kvstore, see
        ``_trainer``: the all-reduce) and every context applies the update rescaled by 1 / B to its own copy, the
        update of the mean gradient over all B samples, the same on every context. Everything is queued on the engine
        (each context's operators on that context's workers), nothing waited for.

        Batchnorm normalises over each context's own shard (``nn.BatchNorm``, per device), or with
        ``sync_batchnorm`` over the global batch (``SyncBatchNorm``); each context updates its own running statistics
        (identical ones with SyncBatchNorm), corrected to the unbiased update (``RunningVariance``) with the values
        per channel of the shard, or of the global batch. The loss (the per-sample losses of every shard) goes into
        each context's own running sum: the global batch's mean when read."""
        self._set_grad_req("write")
        before = [self.variance.before(ctx) for ctx in self.contexts]
        with autograd.record():
            losses = []
            for take in takes:
                x, y = take(None)
                losses.append(self.loss_fn(self.net(x), y))
            scaled = self._scaled(losses)
        autograd.backward(scaled)
        if self.variance:
            normalised = batch if self.sync_batchnorm else batch // len(takes)  # samples each batchnorm saw
            for ctx, old in zip(self.contexts, before):
                self.variance.correct(old, normalised, ctx)
        self.trainer.step(batch)
        for device, loss in enumerate(losses):  # one sum per device
            self._add_loss((batch, 1, device), loss)

    def gradient_norms(self, arrays: Step, micro_batches: int) -> tuple[list[float], float]:
        """Squared L2 norms of the ``micro_batches`` k micro-batch gradients of a batch of B samples on one context
        (``arrays``: its ``Take`` and B), and of their mean (``Adapter.gradient_norms``), at the current
        parameters (``_squared_norms``). Those forward passes move batchnorm's running statistics (the parameters
        without a gradient), so they are copied before and written back after, once the engine is idle: the CPU
        kernel writes them undeclared (``RunningVariance.correct``). The Trainer (its optimizer state, AMP's loss
        scale) and the loss sums are not touched. fp16: the loss is scaled by AMP's current loss scale; where the
        scaled gradients overflow (a step would be skipped), the norms are taken again at half the scale
        (``LOSS_SCALE_BACKOFF``), down to 1, as the dynamic scaling would back off, without changing the Trainer's.

        Returns:
            ([|g_1|^2, ..., |g_k|^2], |G|^2): each parameter's sum of squares in float32 on the device, summed over
            the parameters in float64 here; returns once the engine is idle.

        Raises:
            ValueError: k < 2, k does not divide B, or a data-parallel step (several contexts).
        """
        takes, batch = arrays
        if len(takes) > 1:
            raise ValueError("gradient norms are measured on one device")
        take = takes[0]
        if micro_batches < 2:
            raise ValueError(f"gradient norms need at least 2 micro-batches, not {micro_batches}")
        micro = micro_batch_size(batch, micro_batches)
        held = [p for p in self.params.values() if p.grad_req == "null"]
        nd.waitall()  # the last step's undeclared writes of the running statistics are done before they are copied
        saved = [p.data(self.ctx).copy() for p in held]
        scale = None if self.amp_dtype is None else precision.loss_scale(self.trainer)
        try:
            while True:
                squares = self._squared_norms(take, batch, micro, scale)
                if scale is None or scale <= 1.0 or np.isfinite(squares).all():
                    break
                scale *= LOSS_SCALE_BACKOFF
        finally:
            nd.waitall()  # every backward kernel is done: nothing writes the running statistics any more
            for param, old in zip(held, saved):
                old.copyto(param.data(self.ctx))
            nd.waitall()
        totals = squares.sum(axis=1)
        return [float(v) for v in totals[:-1]], float(totals[-1])

    def _squared_norms(self, take: Take, batch: int, micro: int, scale: float | None) -> npt.NDArray[np.float64]:
        """(k + 1, parameters) read back: row i < k each trained parameter's squared L2 norm of the gradient of
        micro-batch i's mean loss, row k of the mean of those gradients. Each micro-batch of ``micro`` samples runs
        forward and backward as in ``_accumulate`` (the same slices under ``autograd.record``: training mode, dropout
        drawing from MXNet's generator), from its loss times ``scale`` (fp16; None: unscaled); its gradient is the
        parameters' gradient arrays / (``micro`` x ``scale``) (backward of the per-sample loss gives the summed
        loss's), taken before the next backward overwrites them. The parameters' ``grad_req`` stays as training set
        it (with "add" the gradients are zeroed before each backward); what the gradient arrays hold afterwards is
        never read by a step, which overwrites (``write``) or zeroes (``_accumulate``) them before its backward."""
        trained = [p for p in self.params.values() if p.grad_req != "null"]
        unscale = 1.0 / (micro if scale is None else micro * scale)
        total = [nd.zeros_like(p.grad(self.ctx)) for p in trained]
        rows = []
        for start in range(0, batch, micro):
            if self._grad_req == "add":
                self.params.zero_grad()
            with autograd.record():
                x, y = take(slice(start, start + micro))
                loss = self.loss_fn(self.net(x), y)
                scaled = loss if scale is None else loss * scale
            scaled.backward()
            grads = [p.grad(self.ctx) * unscale for p in trained]
            rows.append(_squares(grads))
            for summed, grad in zip(total, grads):
                summed += grad
        rows.append(_squares([summed / (batch // micro) for summed in total]))
        squares: npt.NDArray[np.float64] = nd.stack(*rows).asnumpy().astype(np.float64)
        return squares

    def _scaled(self, loss: Any) -> Any:
        """``loss`` as backward should see it: itself, or under AMP (fp16) scaled (``precision.scaled``)."""
        return loss if self.amp_dtype is None else precision.scaled(loss, self.trainer)

    def _set_grad_req(self, req: str) -> None:
        """``write`` (each backward overwrites the gradients) for plain steps, ``add`` (backward adds into them) for
        gradient accumulation (https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/gluon/parameter.html,
        ``grad_req``). Switched only when the kind of step changes, which a trial does at most once; parameters
        without a gradient (batchnorm's running statistics) stay ``null``."""
        if req != self._grad_req:
            self.params.setattr("grad_req", req)
            self._grad_req = req

    def _add_loss(self, key: tuple[int, ...], loss: Any) -> None:
        """Adds a step's per-sample ``loss`` (float32 (B,)) into the running sum of ``key``: one queued operator
        (``+=``, or a copy at the first step after a read), nothing waited for."""
        held = self._loss_sums.get(key)
        if held is None:
            self._loss_sums[key] = loss.copy()
        else:
            held += loss

    def take_loss_sum(self) -> float:
        """Each running sum's total (one ``sum`` operator and ``asscalar`` per batch shape: one in a trial;
        data-parallel one per context) / B; the sums are dropped."""
        sums, self._loss_sums = self._loss_sums, {}
        return sum(float(held.sum().asscalar()) / key[0] for key, held in sums.items())

    def evaluate(self, x: Any, y: Any, batch_size: int) -> tuple[float, float]:
        """Mean loss and accuracy over (x, y) on the first context, in batches of ``batch_size``. Outside
        ``autograd.record`` Gluon runs in inference mode. Batches of ``batch_size`` and a smaller last one reuse the
        hybridized graph (a new shape re-plans it; no padding is needed). For a next-token model the loss of a
        sequence is the mean over its L positions, so the mean over the sequences is the mean over every position, and
        the accuracy counts every position. Data-parallel: with the first context's copy of the parameters and
        running statistics."""
        total_loss = nd.zeros((1,), ctx=self.ctx, dtype=np.float64)
        correct = nd.zeros((1,), ctx=self.ctx, dtype=np.int64)
        n = x.shape[0]
        for start in range(0, n, batch_size):
            logits = self.net(x[start:start + batch_size])
            labels = y[start:start + batch_size]
            total_loss += self.loss_fn(logits, labels).sum().astype(np.float64)
            correct += (logits.argmax(axis=-1).astype(np.int64) == labels).sum()
        return float(total_loss.asscalar()) / n, float(correct.asscalar()) / y.size

    def predict(self, x: Any) -> npt.NDArray[np.float32]:
        """Logits of ``x`` (on the first context), float32, in inference mode."""
        logits: npt.NDArray[np.float32] = self.net(x).asnumpy().astype(np.float32, copy=False)
        return logits  # fp16 under AMP: its last dense layer's output

    def compilations(self) -> None:
        """None: MXNet counts no hybridized graphs (``Adapter.compilations``)."""
        return None

    def settings(self) -> dict[str, Any]:
        """AMP's loss scale and its policy (fp16), and data-parallel the kvstore Gluon created."""
        out: dict[str, Any] = {}
        scaler = getattr(self.trainer, "_amp_loss_scaler", None)  # set by amp.init_trainer
        if scaler is not None:
            out["loss_scale"] = float(scaler.loss_scale)  # the current one (2^16 before the first step)
            out["loss_scaling"] = "dynamic (AMP LossScaler: x0.5 and skip the step on inf/nan, x2 after 2000 steps)"
        kvstore = getattr(self.trainer, "_kvstore", None)
        if kvstore is not None:
            out["kvstore"] = kvstore.type
        return out


def _squares(arrays: Sequence[Any]) -> Any:
    """float32 (len(arrays),): each array's sum of squares, queued on its context."""
    return nd.concat(*[nd.sum(nd.square(a.astype(np.float32, copy=False))) for a in arrays], dim=0)
