"""TensorFlow's training mechanics, for a model called as ``model(x, training=...)`` with ``trainable_variables``
(the neutral builder's ``Network``, or a Keras model): each step's gather, forward, ``tf.GradientTape`` gradients and
optimizer update (``adapters.tensorflow.optimizer``) in one ``tf.function`` per (batch size, micro-batches) with a
fully static input signature, XLA-compiled in the "compiled" mode; gradient accumulation in a ``tf.while_loop``; fp16's
loss scaling; data parallelism under a ``MirroredStrategy``; the device-resident loss sum; evaluation and prediction.

Design: docs/design/framework-caveats.md#tensorflow (tracing, XLA, mixed precision, the optimizer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import tensorflow as tf

from adapters.base import Model, RunOptions, micro_batch_size, shard
from adapters.tensorflow.devices import Devices
from adapters.tensorflow.optimizer import DynamicLossScale, dense_gradients, make_update
from harness.spec import OptimizerSpec


class Training:
    """One trial's training of ``model`` (its variables already created under ``devices.placement``) with
    ``optimizer``, in the options' mode; the precision is the model's own (the neutral builder casts at each layer),
    with fp16's loss scaling here. The optimizer's state and the loss scale are created under the same placement
    (mirrored when data-parallel); the loss sum is an ordinary variable on the first device."""

    def __init__(self, model: Model, task: str, optimizer: OptimizerSpec, options: RunOptions,
                 devices: Devices) -> None:
        self.model, self.devices, self.strategy = model, devices, devices.strategy
        self.tokens, self.next_token = task != "image_classification", task == "next_token"
        self.jit = options.compile == "compiled"
        self.variables: list[tf.Variable] = list(model.trainable_variables)
        with devices.placement():
            self.update = make_update(optimizer, self.variables)
            self.loss_scale = DynamicLossScale() if options.precision == "fp16" else None
        with tf.device(devices.device):
            # added to inside the train step's function (assign_add), read and zeroed by take_loss_sum
            self.loss_sum = tf.Variable(0.0, dtype=tf.float32, trainable=False, name="loss_sum")
        self.last_loss: tf.Tensor | None = None  # the last step's loss (what ``wait`` reads to know it is done)
        self.functions: dict[tuple[int, int], Any] = {}  # (batch size, micro-batches) -> the step's tf.function
        self.calls: dict[tuple[int, int], Any] = {}  # the same -> its concrete function, what a step calls
        self._compilations = 0  # tracings of step functions (see compilations)
        self.x_train: Any = None  # the resident training inputs the step gathers from (``resident``)
        self.y_train: Any = None
        # Data-parallel in the compiled mode: the XLA-compiled per-replica functions (``_replica_step``)
        self.replica_fns: list[Any] = []
        if self.strategy is not None and self.jit:
            self.replica_fns = [tf.function(self._replica_gradients, jit_compile=True, autograph=False),
                                tf.function(self._apply, jit_compile=True, autograph=False)]
        self.logits_fn: Any = None  # evaluation and prediction (``_inference``), made at their first call
        self.eval_fn: Any = None

    def resident(self, x_train: Any, y_train: Any) -> None:
        """The resident training inputs the steps gather from; a step function captures them when it is traced, so
        the functions traced before are dropped."""
        self.x_train, self.y_train = x_train, y_train
        self.functions, self.calls, self._compilations = {}, {}, 0

    # -- the step --------------------------------------------------------------------------------------------------

    def step(self, batch: Any, micro_batches: int) -> None:
        """One step on ``batch``: the resident samples' int64 (B,) indices (gathered on the device), or a loader's
        (x, y) batch. Gather, forward, gradients and the optimizer update run in one ``tf.function`` with a fully
        static ``input_signature``, traced on the first call with each (B, micro_batches) and never again
        (https://www.tensorflow.org/guide/function#controlling_retracing). With ``micro_batches`` k > 1 the gradients
        of k micro-batches of B / k are summed inside that function (``_accumulate``). In the "compiled" mode the
        function is XLA-compiled (``jit_compile=True``) when it is first called. Data-parallel
        (``_train_replicated``): the N replicas each train on their shard of the indices within that one function,
        which the compiled mode does not XLA-compile whole (its parts: ``_replica_step``); no accumulation then.
        Raises ValueError for accumulation under data parallelism, or a batch that k (or N) does not divide."""
        if self.strategy is not None and micro_batches != 1:
            raise ValueError("gradient accumulation with data parallelism is not supported")
        loader = isinstance(batch, tuple)
        key = (int((batch[0] if loader else batch).shape[0]), micro_batches)
        call = self.calls.get(key)
        if call is None:
            call = self._trace(batch, key)
        self.last_loss = call(*batch) if loader else call(batch)  # the function also adds it to the loss sum

    def _trace(self, batch: Any, key: tuple[int, int]) -> Any:
        """The step's ``tf.function`` for ``batch``'s shapes and ``key`` = (B, micro_batches) (XLA-compiled in the
        compiled mode, one device), traced now and counted in ``compilations``; kept in ``functions``, and its
        concrete function in ``calls``, which is returned: what a step calls. The concrete function is called
        directly because a tf.function's own call matches its arguments against its signature every time (what it
        cost: docs/findings/2026-11-23-harness-vs-loop.md)."""
        size, k = key
        python_fn: Callable[..., tf.Tensor]
        if isinstance(batch, tuple):
            x, y = batch
            signature = [tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(y.shape, y.dtype)]
            micro_batch_size(size, k)  # raises ValueError for an uneven split
            python_fn = self._train_on if k == 1 else functools.partial(self._train_on_accumulated, micro_batches=k)
        else:
            signature = [tf.TensorSpec((size,), tf.int64)]
            if self.strategy is not None:
                shard(np.arange(size), self.strategy.num_replicas_in_sync, 0)  # ValueError for an uneven split
                python_fn = self._train_replicated
            else:
                micro_batch_size(size, k)
                python_fn = self._train if k == 1 else functools.partial(self._train_accumulated, micro_batches=k)
        function = tf.function(python_fn, input_signature=signature, autograph=False,
                               jit_compile=self.jit and self.strategy is None)
        self.functions[key], self.calls[key] = function, function.get_concrete_function()
        self._compilations += function.experimental_get_tracing_count()
        return self.calls[key]

    def _loss(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        """The per-sample (B,) or, for a next-token model, per-position (B, L) cross-entropies of the model's
        float32 logits in training mode (``sparse_softmax_cross_entropy_with_logits`` takes (B, L, V) logits as they
        are)."""
        logits = tf.cast(self.model(x, training=True), tf.float32)
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)

    def _train(self, indices: tf.Tensor) -> tf.Tensor:
        """One step on the resident samples ``indices`` (int64 (B,)): their batch gathered on the device, then
        ``_train_on``."""
        with tf.device(self.devices.device):
            return self._train_on(tf.gather(self.x_train, indices), tf.gather(self.y_train, indices))

    def _train_on(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        """One step on the batch ``x`` (float32 (B, H, W, C) images or int64 (B, L) tokens), ``y`` (int64 (B,) or
        (B, L)) on the device: the loss is the mean over the samples, or over every position of a next-token
        model's labels."""
        with tf.device(self.devices.device):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(self._loss(x, y))
                scaled = loss if self.loss_scale is None else self.loss_scale.scale_loss(loss)
            self._apply(self._gradients(tape, scaled))
            self.loss_sum.assign_add(loss)
            return loss

    def _gradients(self, tape: tf.GradientTape, loss: tf.Tensor) -> list[tf.Tensor]:
        """The float32 gradients of ``loss`` (scaled in fp16) for every variable, dense, and unscaled in fp16."""
        grads = dense_gradients(tape.gradient(loss, self.variables))
        return grads if self.loss_scale is None else self.loss_scale.unscale(grads)

    def _apply(self, grads: list[tf.Tensor]) -> None:
        """The optimizer update with ``grads``; in fp16 only when they are all finite (``DynamicLossScale``)."""
        if self.loss_scale is None:
            self.update(grads)
        else:
            self.loss_scale.apply(grads, self.update)

    def _train_accumulated(self, indices: tf.Tensor, micro_batches: int) -> tf.Tensor:
        """Gradient accumulation on the resident samples ``indices`` (int64 (B,)): ``_accumulate`` with micro-batch i
        gathered on the device inside the loop (one micro-batch's samples at a time, ``_resident_parts``)."""
        with tf.device(self.devices.device):
            return self._accumulate(self._resident_parts(indices, micro_batches), micro_batches)

    def _resident_parts(self, indices: tf.Tensor,
                        micro_batches: int) -> Callable[[tf.Tensor], tuple[tf.Tensor, tf.Tensor]]:
        """The k = ``micro_batches`` consecutive micro-batches of the resident samples ``indices`` (int64 (B,)) as a
        function of i: micro-batch i's (x, y), gathered from the resident inputs by row i of ``indices`` reshaped to
        (k, B / k). Called under the device's ``tf.device``."""
        parts = tf.reshape(indices, (micro_batches, -1))

        def micro_batch(i: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            part = tf.gather(parts, i)
            return tf.gather(self.x_train, part), tf.gather(self.y_train, part)

        return micro_batch

    def _train_on_accumulated(self, x: tf.Tensor, y: tf.Tensor, micro_batches: int) -> tf.Tensor:
        """Gradient accumulation on a loader's batch ``x``, ``y`` (``_train_on``'s shapes): ``_accumulate`` with
        micro-batch i the i-th of k consecutive slices of B / k samples (``x`` reshaped to (k, B / k, ...))."""
        with tf.device(self.devices.device):
            xs = tf.reshape(x, (micro_batches, -1, *x.shape[1:]))
            ys = tf.reshape(y, (micro_batches, -1, *y.shape[1:]))
            return self._accumulate(lambda i: (tf.gather(xs, i), tf.gather(ys, i)), micro_batches)

    def _accumulate(self, micro_batch: Callable[[tf.Tensor], tuple[tf.Tensor, tf.Tensor]],
                    micro_batches: int) -> tf.Tensor:
        """Gradient accumulation, the body of a step's function: a ``tf.while_loop`` over the k micro-batches
        (``micro_batch(i)``: the i-th (x, y) of B / k samples, made inside the loop) whose loop variables are the
        running sums of the gradients of each micro-batch's mean loss / k, then one optimizer update with the sums:
        the mean gradient over all B samples. ``parallel_iterations=1`` keeps the iterations strictly one after the
        other, so only one micro-batch's activations are alive at a time (an unrolled Python loop would leave TF's
        executor free to run the independent forward passes side by side,
        https://www.tensorflow.org/api_docs/python/tf/while_loop); the graph's size does not grow with k either."""
        k = micro_batches
        with tf.device(self.devices.device):

            def body(i: tf.Tensor, loss_sum: tf.Tensor, *grad_sums: tf.Tensor) -> tuple[tf.Tensor, ...]:
                x, y = micro_batch(i)
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(self._loss(x, y)) / k
                    scaled = loss if self.loss_scale is None else self.loss_scale.scale_loss(loss)
                grads = self._gradients(tape, scaled)
                return (i + 1, loss_sum + loss, *[s + g for s, g in zip(grad_sums, grads)])

            start = (tf.constant(0), tf.zeros((), tf.float32), *[tf.zeros_like(v) for v in self.variables])
            _, loss, *grads = tf.while_loop(lambda i, *_: i < k, body, start, parallel_iterations=1,
                                            maximum_iterations=k)
            self._apply(grads)  # in fp16 a non-finite gradient of any micro-batch makes its sum non-finite
            self.loss_sum.assign_add(loss)  # the mean of the k micro-batches' means
            return loss

    def gradient_norms(self, batch: Any, micro_batches: int) -> tuple[list[float], float]:
        """Squared L2 norms of the gradients of the mean losses of the ``micro_batches`` k consecutive micro-batches
        of the resident ``batch``, and of their mean (``Adapter.gradient_norms``), at the current variables; nothing
        the training depends on is changed.

        Eager (it runs rarely, outside the timed windows; a ``tf.function`` would be traced per batch size): micro-batch
        i gathered as the accumulating step gathers it (``_resident_parts``), its loss and gradients as in
        ``_accumulate`` (the model in training mode, fp16's loss scale divided out again, ``_gradients``), without
        ``_apply`` or the loss sum. The model's buffers (batchnorm's running statistics, which the training forward
        assigns) are copied before and assigned back after, bit for bit; dropout's eager draws do not touch the
        step functions' random state. Each micro-batch's per-variable squared sums are float32 on the device; the
        host reads them once, at the end (``.numpy()``, which waits for the device), and adds them up in float64.

        Args:
            batch: the step's int64 (B,) index tensor (``Inputs.batches``, resident).
            micro_batches: k >= 2, a divisor of B.

        Returns:
            ([|g_1|^2, ..., |g_k|^2], |G|^2), G the mean of the k gradients.

        Raises:
            ValueError: a data-parallel trial, a loader's batch, fewer than 2 micro-batches or ones that do not divide
                the batch.
        """
        k = micro_batches
        if self.strategy is not None:
            raise ValueError("gradient norms are measured on one device")
        if isinstance(batch, tuple):  # a loader's (x, y)
            raise ValueError("gradient norms are measured on resident batches (input: resident), not a loader's")
        if k < 2:
            raise ValueError(f"gradient norms need at least 2 micro-batches, not {k}")
        micro_batch_size(int(batch.shape[0]), k)  # raises ValueError for an uneven split
        buffers = list(getattr(self.model, "non_trainable_variables", []))
        with tf.device(self.devices.device):
            saved = [tf.identity(v) for v in buffers]
            micro_batch = self._resident_parts(batch, k)
            total = [tf.zeros_like(v, dtype=tf.float32) for v in self.variables]
            rows = []
            try:
                for i in range(k):
                    x, y = micro_batch(tf.constant(i))
                    with tf.GradientTape() as tape:
                        loss = tf.reduce_mean(self._loss(x, y))
                        scaled = loss if self.loss_scale is None else self.loss_scale.scale_loss(loss)
                    grads = [tf.cast(g, tf.float32) for g in self._gradients(tape, scaled)]
                    rows.append(tf.stack([tf.reduce_sum(tf.square(g)) for g in grads]))
                    total = [t + g for t, g in zip(total, grads)]
            finally:
                for variable, value in zip(buffers, saved):
                    variable.assign(value)
            rows.append(tf.stack([tf.reduce_sum(tf.square(t / k)) for t in total]))
            sums = tf.stack(rows).numpy().astype(np.float64).sum(axis=1)  # the one read back
        return [float(s) for s in sums[:-1]], float(sums[-1])

    def _train_replicated(self, indices: tf.Tensor) -> tf.Tensor:
        """One data-parallel step, the body of the step's ``tf.function`` (the cross-replica context): replica d
        trains on ``shard(indices, N, d)``, the d-th contiguous B / N of the global batch, given to it as a per-replica
        value (``experimental_distribute_values_from_function``, https://www.tensorflow.org/api_docs/python/tf/
        distribute/Strategy#experimental_distribute_values_from_function), ``strategy.run`` runs ``_replica_step`` on
        every replica (https://www.tensorflow.org/api_docs/python/tf/distribute/Strategy#run), and the global batch's
        mean loss, which every replica returns, is added to the loss sum on the first device."""
        strategy = self.strategy
        assert strategy is not None
        n, batch = strategy.num_replicas_in_sync, int(indices.shape[0])
        bounds = [(int(part[0]), int(part[-1]) + 1) for part in (shard(np.arange(batch), n, d) for d in range(n))]
        shards = strategy.experimental_distribute_values_from_function(
            lambda context: indices[bounds[context.replica_id_in_sync_group][0]:
                                    bounds[context.replica_id_in_sync_group][1]])
        loss = strategy.experimental_local_results(strategy.run(self._replica_step, args=(shards,)))[0]
        with tf.device(self.devices.device):
            self.loss_sum.assign_add(loss)
        return loss

    def _replica_step(self, indices: tf.Tensor) -> tf.Tensor:
        """One replica's part of a data-parallel step (the replica context, on its device): its shard gathered, the
        gradients of its loss (``_replica_gradients``), one all-reduce that sums them and the loss over the replicas
        (``ReplicaContext.all_reduce``, https://www.tensorflow.org/api_docs/python/tf/distribute/
        ReplicaContext#all_reduce: the strategy's cross-device ops), then the update (``_apply``) of this replica's
        copies of the variables with the summed gradients: every replica applies the same update to identical
        copies, so they stay identical (the variables have aggregation NONE, so an assignment in the replica
        context goes to the replica's own copy, with no further communication). In the compiled mode the gradients
        and the update are each an XLA-compiled function (``replica_fns``); the gather and the all-reduce are not
        (an XLA cluster lies on one device, and MirroredStrategy's all-reduce is a ``merge_call`` on CPUs, which
        cannot be inside a nested ``tf.function``: hence the declaration's limit on sync batchnorm, whose all-reduce
        lies inside the forward pass, in that mode). Returns the global batch's mean loss."""
        replica = tf.distribute.get_replica_context()
        x = tf.gather(self.x_train, indices)
        y = tf.gather(self.y_train, indices)
        count = int(np.prod(y.shape)) * replica.num_replicas_in_sync  # samples, or positions, of the global batch
        gradients, update = self.replica_fns if self.replica_fns else (self._replica_gradients, self._apply)
        loss, grads = gradients(x, y, count)
        loss, *grads = replica.all_reduce(tf.distribute.ReduceOp.SUM, [loss, *grads])
        update(grads)
        return loss

    def _replica_gradients(self, x: tf.Tensor, y: tf.Tensor, count: int) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """A replica's loss, the sum of its samples' (or positions') cross-entropies over the ``count`` of the global
        batch, and its gradients: summed over the replicas, they are the global batch's mean loss and its gradients.
        What ``tf.nn.compute_average_loss(per_sample, global_batch_size=count)`` computes
        (https://www.tensorflow.org/api_docs/python/tf/nn/compute_average_loss), without its run-time checks of
        ``count`` (Assert ops, which XLA drops with a warning in the compiled mode)."""
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(self._loss(x, y)) / count
            scaled = loss if self.loss_scale is None else self.loss_scale.scale_loss(loss)
        return tf.cast(loss, tf.float32), self._gradients(tape, scaled)

    def compilations(self) -> int:
        """Tracings of step functions (``tf.function.experimental_get_tracing_count``; in the compiled mode each traced
        graph is also XLA-compiled once, on its first call); data-parallel in the compiled mode also those of the
        XLA-compiled per-replica functions (``_replica_step``), traced once per replica with the step."""
        return self._compilations + sum(int(fn.experimental_get_tracing_count()) for fn in self.replica_fns)

    def take_loss_sum(self) -> float:
        """The sum variable's value (``.numpy()``) and ``assign(0)``."""
        total = float(self.loss_sum.numpy())
        self.loss_sum.assign(0.0)
        return total

    # -- evaluation --------------------------------------------------------------------------------------------------

    def _inference(self, x: tf.Tensor) -> None:
        """Evaluation's and prediction's functions, for inputs shaped as ``x`` with a batch dimension of None, so
        that a smaller last batch does not retrace. Data-parallel with buffers (batchnorm), evaluation reads the
        running statistics' mean over the replicas' copies, which lie on N devices, so it is not XLA-compiled: an
        XLA cluster reads variables of its own device only."""
        input_spec = tf.TensorSpec((None, *x.shape[1:]), x.dtype)
        label_spec = tf.TensorSpec((None, *x.shape[1:]) if self.next_token else (None,), tf.int64)
        buffers = getattr(self.model, "non_trainable_variables", [])
        jit = self.jit and not (self.strategy is not None and buffers)
        self.logits_fn = tf.function(self._logits, input_signature=[input_spec], jit_compile=jit, autograph=False)
        self.eval_fn = tf.function(self._eval_batch, input_signature=[input_spec, label_spec], jit_compile=jit,
                                   autograph=False)

    def _logits(self, x: tf.Tensor) -> tf.Tensor:
        with self.devices.first():
            return tf.cast(self.model(x, training=False), tf.float32)

    def _eval_batch(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        with self.devices.first():
            logits = tf.cast(self.model(x, training=False), tf.float32)
            loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)  # (B,) or (B, L)
            correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=-1), y), tf.int64))
            return tf.reduce_sum(tf.cast(loss, tf.float64)), correct

    def evaluate(self, x: tf.Tensor, y: tf.Tensor, batch_size: int) -> tuple[float, float]:
        """(mean cross-entropy, accuracy in [0, 1]) over (x, y) (over every position of every sequence for a
        next-token model) in batches of ``batch_size``; per-batch sums are accumulated on the device in float64 and
        read once at the end. Data-parallel: the first device's copy of the model, with batchnorm's running
        statistics read as the mean of the replicas' copies, on the first device."""
        if self.eval_fn is None:
            self._inference(x)
        n = int(x.shape[0])
        with self.devices.first():
            total_loss = tf.zeros((), tf.float64)
            correct = tf.zeros((), tf.int64)
            for start in range(0, n, batch_size):
                loss, right = self.eval_fn(x[start:start + batch_size], y[start:start + batch_size])
                total_loss += loss
                correct += right
        count = y.shape.num_elements()  # samples, or every position of every sequence
        return float(total_loss.numpy()) / count, float(correct.numpy()) / count

    def predict(self, x: tf.Tensor) -> npt.NDArray[np.float32]:
        """float32 logits, (N, classes), for float32 NHWC images (N, H, W, C) or int64 (N, L) token ids on the first
        device (``Inputs.tensor``); (N, L, vocab) for a next-token model."""
        with self.devices.first():
            if self.logits_fn is None:
                self._inference(x)
            result: npt.NDArray[np.float32] = self.logits_fn(x).numpy()
            return result
