"""JAX's training mechanics, for any functional model whatever built it (``Functional``: an apply function, its
parameters and its batch statistics): optax optimizers with PyTorch's semantics, one ``jax.jit`` of the whole train
step per (batch size, micro-batches), gradient accumulation inside that step, fp16's dynamic loss scaling, data
parallelism (``jax.shard_map`` over a ``Mesh`` of the trial's devices), the device-resident loss sum, evaluation and
prediction.

Design: docs/design/framework-caveats.md#jax (one mode, precision, data parallelism and their sources).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from adapters.base import RunOptions, micro_batch_size, shard
from adapters.jax.runtime import jax, jnp, lax, optax
from harness.neutral.precision import (
    LOSS_SCALE_BACKOFF,
    LOSS_SCALE_GROWTH,
    LOSS_SCALE_GROWTH_STEPS,
    LOSS_SCALE_INIT,
)
from harness.spec import OptimizerSpec

#: The mesh axis of a data-parallel trial (``Training._data_parallel_step``): the global batch is sharded along it.
DATA = "data"
#: A model's forward pass: (params, state, x, train, PRNG key) -> (logits, the state after it).
Apply = Callable[[Any, Any, Any, bool, Any], tuple[Any, Any]]


@dataclass(frozen=True)
class Functional:
    """A JAX model as the training mechanics take it. ``apply(params, state, x, train, key)`` returns the logits (any
    float dtype: the mechanics use them as float32) and the new ``state``; ``params`` (a pytree of float32 arrays) are
    trained, ``state`` (a pytree: batchnorm's running statistics) is only updated by training forward passes (with
    ``train`` False it is returned unchanged); ``key`` draws dropout's masks. Inside a data-parallel step ``apply``
    runs under ``jax.shard_map`` with the mesh axis ``DATA`` bound, over which a synchronised batchnorm averages
    its moments. The neutral builder (``adapters.jax.neutral``) makes one; a Flax module's ``apply`` with
    ``{"params": ..., "batch_stats": ...}`` and ``rngs={"dropout": key}`` fits the same shape. ``random``: whether
    ``apply`` draws from ``key`` in training; False (the neutral model without dropout) and the step neither splits
    nor advances the key (the split's threefry hash runs even where nothing reads it, since the key is carried: 86
    against 64 us a step of a one-dense-layer model at batch 512 on this project's CPU, median of 5 runs)."""

    apply: Apply
    params: Any
    state: Any
    random: bool = True


def _cache_size(jitted: Any) -> int | None:
    """How many times a jitted function was compiled (its cache's size), where JAX tells."""
    size = getattr(jitted, "_cache_size", None)
    return int(size()) if callable(size) else None


class Training:
    """One trial's training of ``model`` for ``task`` with ``optimizer``, in the options' precision, on ``device``,
    or data-parallel over ``mesh`` (a ``jax.sharding.Mesh`` with the one axis ``DATA``, whose first device is
    ``device``; None: one device). ``seed`` starts the PRNG key of dropout. The training state (parameters,
    optimizer state, batch statistics, key, fp16's loss scale) lives on ``placement``: the device, or replicated over
    the mesh; every leaf committed, as the step's outputs are (an uncommitted leaf, a key made off the device, would
    make the second call compile the step again, inside the timed loop)."""

    def __init__(self, model: Functional, task: str, optimizer: OptimizerSpec, options: RunOptions, device: Any,
                 mesh: Any, seed: int):
        self.apply, self.task, self.device, self.mesh = model.apply, task, device, mesh
        self.random = model.random
        self.gpu = device.platform == "gpu"
        self.sync_batchnorm = options.data_parallel is not None and options.data_parallel.sync_batchnorm
        self.placement: Any = device if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.params = self.put(jax.tree_util.tree_map(lambda v: jnp.asarray(v, jnp.float32), model.params))
        self.stats = self.put(jax.tree_util.tree_map(lambda v: jnp.asarray(v, jnp.float32), model.state))
        self.tx = _optimizer(optimizer)
        self.opt_state = self.put(self.tx.init(self.params))
        self.key = self.put(jax.random.PRNGKey(seed))
        #: fp16: (loss scale, finite steps in a row), float32 and int32 scalars carried through the step; else None
        self.scaler: tuple[Any, Any] | None = None if options.precision != "fp16" else self.put(
            (jnp.asarray(LOSS_SCALE_INIT, jnp.float32), jnp.asarray(0, jnp.int32)))
        self.loss_sum: Any = None  # float32 (), on the device, carried through the jitted step
        # The jitted train steps: (B, micro-batches) -> resident mode's (``_summed_step``), and (B, micro-batches,
        # "loader") -> loader mode's (``_summed_batch_step``).
        self.steps: dict[tuple[Any, ...], Any] = {}
        #: each step's inputs after the state and loss sum, as shapes, dtypes and shardings (``step_flops``)
        self.signatures: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self._norms: dict[tuple[int, int], Any] = {}  # gradient_norms' jits per (B, k), apart from the train steps'
        self._norm_calls = 0  # gradient_norms calls so far: each draws dropout masks of its own (_squared_norms)
        self._eval = jax.jit(self._eval_batch)
        self._logits = jax.jit(self._infer)

    def put(self, tree: Any) -> Any:
        """``tree`` committed to the placement (the device, or replicated over the mesh)."""
        return jax.device_put(tree, self.placement)

    # -- the step ----------------------------------------------------------------------------------------------

    def step(self, arrays: tuple[Any, Any, Any], micro_batches: int) -> None:
        """Queues one optimizer step on ``arrays`` (x, y, indices: ``Inputs.arrays``) and keeps its new state and loss
        sum. Resident mode: ``indices`` (int32 (B,), on one device already there, ``Inputs.batches``; over a mesh
        numpy, which jit shards) of the samples of ``x``, ``y`` (the dataset on the placement) to train on. A copy to
        the device made here would wait behind the queued steps (``jnp.asarray`` of numpy: 2.2 against 1.2 ms of host
        time a step at batch 64 on the CPU), so it is made before the window. Loader mode (``indices`` None): ``x``,
        ``y`` are the batch on the device. One jitted step per (B, micro-batches) and mode: every batch of a trial has
        the same shapes and dtypes, so each compiles once. Raises ValueError when ``micro_batches`` does not divide B,
        and data-parallel for gradient accumulation or a B that the devices do not divide."""
        x, y, indices = arrays
        size = int(x.shape[0]) if indices is None else len(indices)
        micro_batch_size(size, micro_batches)  # raises ValueError for an uneven split
        key: tuple[Any, ...] = (size, micro_batches) if indices is not None else (size, micro_batches, "loader")
        if key not in self.steps:
            if self.mesh is not None:
                if micro_batches != 1:
                    raise ValueError("gradient accumulation with data parallelism is not supported")
                shard(np.asarray(indices), len(self.mesh.devices), 0)  # raises ValueError unless N divides B
                self.steps[key] = self._data_parallel_step(micro_batches)
            else:
                step = self._summed_step if indices is not None else self._summed_batch_step
                # The state and the loss sum are donated on a GPU (https://docs.jax.dev/en/latest/faq.html
                # #buffer-donation); XLA's CPU client cannot reuse donated buffers (it would warn each time).
                self.steps[key] = jax.jit(functools.partial(step, micro_batches),
                                          donate_argnums=(0, 1) if self.gpu else ())
            self.signatures[key] = tuple(
                jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=getattr(a, "sharding", None))
                for a in (x, y, *(() if indices is None else (indices,))))
        self._run(self.steps[key], x, y, *(() if indices is None else (indices,)))

    def _run(self, step: Any, *inputs: Any) -> None:
        """Queues ``step(state, loss sum, *inputs)`` and keeps its new state and loss sum."""
        state = (self.params, self.opt_state, self.stats, self.key, self.scaler)
        if self.loss_sum is None:  # the first step: the sum starts (committed to the device, as the step returns it)
            self.loss_sum = self.put(jnp.zeros((), jnp.float32))
        elif self.mesh is not None and not self.gpu:
            # Host devices: one data-parallel step in flight at a time. XLA's CPU client runs each device's part of a
            # step on a thread of a pool of max(cores, devices) threads, where an all-reduce blocks its thread until
            # every device arrives; with steps queued ahead, one device's next step can hold the threads another
            # device needs to finish this one, and the all-reduce's rendezvous aborts the process after 40 s
            # (jaxlib 0.10.2 on 2 cores and 2 host devices: within the first 100 queued steps; never with a sync per
            # step, or with 2N threads). So the step waits for the one before (its loss sum) before it is queued.
            self.loss_sum.block_until_ready()
        (self.params, self.opt_state, self.stats, self.key, self.scaler), self.loss_sum = step(
            state, self.loss_sum, *inputs)

    def _loss(self, params: Any, stats: Any, x: Any, y: Any, key: Any, scale: Any) -> tuple[Any, tuple[Any, Any]]:
        """The loss to differentiate (times fp16's loss ``scale``, if any), and (the batch statistics, the loss): the
        mean softmax cross-entropy over the samples, or for a next-token model over every position of (B, L, V)
        logits and (B, L) labels. Data-parallel (inside ``jax.shard_map``, ``x`` the device's shard): the loss is the
        ``lax.pmean`` over DATA of the shards' means, the global batch's mean, so its gradient is the global
        batch's."""
        logits, stats = self.apply(params, stats, x, True, key)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()
        if self.mesh is not None:
            # The all-reduces: this pmean, and in the backward pass a psum over DATA of every parameter's gradient
            # (the transpose of the replicated parameters' use by per-device values, which shard_map's varying
            # manual axes track: check_vma), times 1 / N from the pmean: the mean over all B samples' gradients.
            loss = lax.pmean(loss, DATA)
        return (loss if scale is None else loss * scale), (stats, loss)

    def _train_on(self, micro_batches: int, state: tuple[Any, ...],
                  parts: Iterable[tuple[Any, Any]]) -> tuple[tuple[Any, ...], Any]:
        """One optimizer step on a batch on the device, given as its ``micro_batches`` k consecutive parts (x, y) of
        B / k samples each (x float32 (B / k, H, W, C) images or int32 (B / k, L) tokens, y int32 (B / k,) or
        (B / k, L) labels): the path that resident mode (``_summed_step``, gathering each part) and loader mode
        (``_summed_batch_step``, slicing the loader's batch) share. Each part runs forward and backward on its own
        (batch statistics updated after each, as k forward passes in training mode would), the gradients and
        losses averaged over the k before the one update. ``state`` is (parameters, optimizer state, batch
        statistics, PRNG key, fp16's (loss scale, finite steps in a row) or None); returns the new state and the
        step's loss (float32 (): the mean over the B samples)."""
        params, opt_state, stats, key, scaler = state
        if self.random:
            key, step_key = jax.random.split(key)
            if self.mesh is not None:  # each device its own dropout masks
                step_key = jax.random.fold_in(step_key, lax.axis_index(DATA))
            part_keys = list(jax.random.split(step_key, micro_batches))
        else:  # nothing draws from the key (Functional.random): it stays as it is, and no hash runs
            part_keys = [key] * micro_batches
        grad_fn = jax.grad(self._loss, has_aux=True)
        grads, loss = None, jnp.zeros((), jnp.float32)
        for (x_part, y_part), part_key in zip(parts, part_keys):
            part_grads, (stats, part_loss) = grad_fn(params, stats, x_part, y_part, part_key,
                                                     None if scaler is None else scaler[0])
            grads = part_grads if grads is None else jax.tree_util.tree_map(jnp.add, grads, part_grads)
            loss = loss + part_loss
        if grads is None:  # checked while tracing (Python): no micro-batch ran
            raise ValueError(f"micro_batches must be at least 1, not {micro_batches}")
        if micro_batches > 1:
            grads = jax.tree_util.tree_map(lambda g: g / micro_batches, grads)
            loss = loss / micro_batches
        if self.mesh is not None and not self.sync_batchnorm:
            # each device's running statistics moved by its own shard's moments: their mean over the devices (the
            # running mean is then the one-device run's; the running variance the mean of the shards' variances)
            stats = lax.pmean(stats, DATA)
        if scaler is not None:
            params, opt_state, scaler = _scaled_update(self.tx, grads, params, opt_state, scaler)
            return (params, opt_state, stats, key, scaler), loss
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, stats, key, None), loss

    def _summed_step(self, micro_batches: int, state: tuple[Any, ...], loss_sum: Any, x_all: Any, y_all: Any,
                     indices: Any) -> tuple[tuple[Any, ...], Any]:
        """Resident mode's step: the samples ``indices`` (int32 (B,)) gathered from the dataset on the device
        (``x_all``, ``y_all``; data-parallel: the device's shard of them), then ``_train_on`` them, and ``loss_sum``
        (float32 ()) plus the step's loss, in one traced function: the running sum that ``read_loss`` reads never
        costs a dispatch or a read of its own. Each micro-batch's samples are gathered on their own, as it is trained
        on (the parts are drawn lazily): with gradient accumulation only one micro-batch's inputs are made at a
        time."""
        def parts() -> Iterator[tuple[Any, Any]]:
            for part in jnp.split(indices, micro_batches):
                yield x_all[part], y_all[part]
        state, loss = self._train_on(micro_batches, state, parts())
        return state, loss_sum + loss

    def _summed_batch_step(self, micro_batches: int, state: tuple[Any, ...], loss_sum: Any, x: Any,
                           y: Any) -> tuple[tuple[Any, ...], Any]:
        """Loader mode's step: ``_train_on`` the loader's batch, and ``loss_sum`` plus its loss, in one executable
        (as ``_summed_step``)."""
        state, loss = self._train_on(micro_batches, state, zip(jnp.split(x, micro_batches),
                                                               jnp.split(y, micro_batches)))
        return state, loss_sum + loss

    def _data_parallel_step(self, micro_batches: int) -> Any:
        """The data-parallel step: ``_summed_step`` per device under ``jax.shard_map`` over the mesh, the state, the
        loss sum and the dataset replicated (``P()``), the global batch's indices sharded along DATA (``P(DATA)``:
        contiguous equal parts in mesh order, so device d gathers ``shard(indices, N, d)``'s samples from its copy of
        the dataset); the all-reduces are in ``_loss`` (and batchnorm's with sync). shard_map, not plain ``jit`` with
        a sharded batch: under GSPMD a mean over the sharded batch axis is the global batch's, which would make every
        batchnorm synchronised; per device, each normalises its own shard, as the other frameworks' data parallelism
        does unless asked to synchronise."""
        P = jax.sharding.PartitionSpec
        mapped = jax.shard_map(functools.partial(self._summed_step, micro_batches), mesh=self.mesh,
                               in_specs=(P(), P(), P(), P(), P(DATA)), out_specs=(P(), P()))
        return jax.jit(mapped, donate_argnums=(0, 1) if self.gpu else ())

    def gradient_norms(self, arrays: tuple[Any, Any, Any], micro_batches: int) -> tuple[list[float], float]:
        """Squared L2 norms of the ``micro_batches`` k micro-batch gradients of ``arrays`` (x_all, y_all, indices:
        the samples ``indices``, int32 (B,) on the device, of the resident set), and of their mean
        (``Adapter.gradient_norms``), at the current parameters: one jitted call per (B, k) (``_squared_norms``), read
        back when done. The training state is an input only (neither donated nor replaced), so the parameters,
        optimizer state, batch statistics, key, loss scale and loss sum stay as they are. fp16: the loss is scaled by
        the training's current loss scale; where the scaled gradients overflow (a step would be skipped), the call is
        repeated at half the scale (``LOSS_SCALE_BACKOFF``), down to 1, as the dynamic scaling would back off, without
        changing the training's.

        Returns:
            ([|g_1|^2, ..., |g_k|^2], |G|^2): per-parameter sums of squares in float32, added up in float64 here.

        Raises:
            ValueError: k < 2, or k does not divide B.
        """
        x_all, y_all, indices = arrays
        if micro_batches < 2:
            raise ValueError(f"gradient norms need at least 2 micro-batches, not {micro_batches}")
        micro_batch_size(len(indices), micro_batches)  # raises ValueError for an uneven split
        key = (len(indices), micro_batches)
        if key not in self._norms:
            self._norms[key] = jax.jit(functools.partial(self._squared_norms, micro_batches))
        scale = None if self.scaler is None else float(self.scaler[0])
        while True:
            squares = np.asarray(self._norms[key](
                self.params, self.stats, self.key, None if scale is None else jnp.asarray(scale, jnp.float32),
                self._norm_calls, x_all, y_all, indices), dtype=np.float64)
            if scale is None or scale <= 1.0 or np.isfinite(squares).all():
                break
            scale *= LOSS_SCALE_BACKOFF
        self._norm_calls += 1
        totals = squares.sum(axis=1)
        return [float(v) for v in totals[:-1]], float(totals[-1])

    def _squared_norms(self, micro_batches: int, params: Any, stats: Any, key: Any, scale: Any, call: Any, x_all: Any,
                       y_all: Any, indices: Any) -> Any:
        """float32 (k + 1, parameters): row i < k each parameter's squared L2 norm of the gradient of micro-batch
        i's mean loss, row k of their mean's. The micro-batches are ``_train_on``'s (consecutive parts of
        ``indices``, gathered), in training mode (``_loss``: fp16's times ``scale``, float32 (), unscaled here), all
        from the same batch statistics (batchnorm normalises with the batch's moments: the running ones a
        micro-batch leaves do not change the next one's gradient; they are dropped). Dropout's keys are split as the
        next step's, folded with ``call`` (the calls so far: each probe its own masks) and the training key is not
        advanced (the training after the norms is the one without them). A ``lax.scan`` over the parts carrying the
        gradients' running sum: one micro-batch's gradients exist at a time besides it."""
        if self.random:
            _, step_key = jax.random.split(key)
            part_keys = jax.random.split(jax.random.fold_in(step_key, call), micro_batches)
        else:  # nothing draws from the key (Functional.random)
            part_keys = jnp.broadcast_to(key, (micro_batches, *key.shape))
        grad_fn = jax.grad(self._loss, has_aux=True)

        def micro(total: Any, part: tuple[Any, Any]) -> tuple[Any, Any]:
            part_indices, part_key = part
            grads, _ = grad_fn(params, stats, x_all[part_indices], y_all[part_indices], part_key, scale)
            if scale is not None:
                grads = jax.tree_util.tree_map(lambda g: g / scale, grads)
            return jax.tree_util.tree_map(jnp.add, total, grads), _squares(grads)

        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        total, squares = lax.scan(micro, zeros, (indices.reshape(micro_batches, -1), part_keys))
        mean = jax.tree_util.tree_map(lambda g: g / micro_batches, total)
        return jnp.concatenate([squares, _squares(mean)[None]])

    def wait(self) -> None:
        """Blocks until the last step's outputs are ready (one jitted executable: its outputs complete together;
        https://docs.jax.dev/en/latest/async_dispatch.html; the loss sum is one of them), without copying anything to
        the host; before the first step, until the parameters are."""
        if self.loss_sum is None:
            for leaf in jax.tree_util.tree_leaves(self.params):
                leaf.block_until_ready()
        else:
            self.loss_sum.block_until_ready()

    def take_loss_sum(self) -> float:
        """The sum copied to the host (``float``) and a new zero sum put on the device."""
        if self.loss_sum is None:
            raise RuntimeError("no loss sum: read_loss reads only after a train_step")
        total = float(self.loss_sum)
        self.loss_sum = self.put(jnp.zeros((), jnp.float32))
        return total

    def step_flops(self) -> tuple[float | None, int]:
        """XLA's cost analysis of the first train step made (``jitted.lower(...).compile().cost_analysis()``, its
        "flops": XLA's ``HloCostAnalysis`` of the optimised program, 2 per multiply-add, elementwise ops counted
        too; https://docs.jax.dev/en/latest/aot.html), lowered again from its recorded input signature (no step
        runs, nothing is donated; the step's own jit cache is not touched), and the samples one device trains in
        it (B, or B / N data-parallel: the analysis is of one device's program). (None, samples) where the backend
        reports no flops. Raises RuntimeError before the first step."""
        if not self.steps:
            raise RuntimeError("no train step has run: its cost analysis needs one")
        key, jitted = next(iter(self.steps.items()))
        state = (self.params, self.opt_state, self.stats, self.key, self.scaler)
        loss_sum = self.loss_sum if self.loss_sum is not None else self.put(jnp.zeros((), jnp.float32))
        analysis: Any = jitted.lower(state, loss_sum, *self.signatures[key]).compile().cost_analysis()
        if isinstance(analysis, (list, tuple)):  # older jaxlib: one dict per program
            analysis = analysis[0] if analysis else None
        flops = analysis.get("flops") if isinstance(analysis, dict) else None
        samples = int(key[0]) // (1 if self.mesh is None else int(self.mesh.devices.size))
        return (float(flops) if flops is not None and flops > 0 else None), samples

    def compilations(self) -> int | None:
        """Entries in the jit caches of the train steps, resident and loader mode's (one per traced and compiled
        input signature; ``_cache_size`` of a jitted function, the count jax's own tests read); None where this jax
        lacks it."""
        sizes = [_cache_size(step) for step in self.steps.values()]
        return None if any(size is None for size in sizes) else sum(size for size in sizes if size is not None)

    # -- evaluation and state ----------------------------------------------------------------------------------

    def first(self, tree: Any) -> Any:
        """Data-parallel: the first device's copy of each replicated array of ``tree`` (no copy is made); else
        ``tree``."""
        if self.mesh is None:
            return tree
        return jax.tree_util.tree_map(
            lambda a: next(s.data for s in a.addressable_shards if s.device == self.device), tree)

    def _infer(self, params: Any, stats: Any, x: Any) -> Any:
        """Logits (float32) in inference mode (batch statistics, no dropout: the key is not drawn from)."""
        return self.apply(params, stats, x, False, self.key)[0].astype(jnp.float32)

    def _eval_batch(self, params: Any, stats: Any, x: Any, y: Any) -> tuple[Any, Any]:
        logits = self._infer(params, stats, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()
        return loss, jnp.sum(jnp.argmax(logits, axis=-1) == y)

    def evaluate(self, x: Any, y: Any, batch_size: int) -> tuple[float, float]:
        """Mean loss and accuracy over (x, y) on the device, in batches of ``batch_size``, over every sample (or
        every position of every sequence). Data-parallel: on the first device, with its copy of the parameters and
        statistics (``first``)."""
        n = int(x.shape[0])
        total = jnp.zeros((), jnp.float32)
        correct = jnp.zeros((), jnp.int32)
        params, stats = self.first(self.params), self.first(self.stats)
        for start in range(0, n, batch_size):
            loss, right = self._eval(params, stats, x[start:start + batch_size], y[start:start + batch_size])
            total, correct = total + loss, correct + right
        count = int(y.size)
        return float(total) / count, float(correct) / count

    def predict(self, x: Any) -> npt.NDArray[np.float32]:
        """Logits of ``x`` (on the device) as float32 numpy, in inference mode (data-parallel: the first device's
        state)."""
        return np.asarray(self._logits(self.first(self.params), self.first(self.stats), x), dtype=np.float32)

    def settings(self) -> dict[str, Any]:
        """The mechanics' settings for the record: donation, each train step's compilations, the loss scale."""
        out: dict[str, Any] = {
            "donated_state": self.gpu,
            "step_key": "split every step (dropout draws from it)" if self.random else
                        "not split (nothing draws from it)",
            # How often each train step was compiled: 1 each, or a retrace happened (and cost a timed step).
            # (a loader-mode step is named "<B>x<k> loader")
            "train_step_compilations": {" ".join([f"{key[0]}x{key[1]}", *key[2:]]): _cache_size(f)
                                        for key, f in self.steps.items()}}
        if self.scaler is not None:  # the scale after the last step (a sync)
            out.update(loss_scale=float(self.scaler[0]), loss_scale_init=LOSS_SCALE_INIT,
                       loss_scale_growth_steps=LOSS_SCALE_GROWTH_STEPS)
        return out


def _squares(tree: Any) -> Any:
    """float32 (leaves,): each leaf's sum of squares, in float32."""
    return jnp.stack([jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in jax.tree_util.tree_leaves(tree)])


def _scaled_update(tx: Any, grads: Any, params: Any, opt_state: Any,
                   scaler: tuple[Any, Any]) -> tuple[Any, Any, tuple[Any, Any]]:
    """fp16's update with dynamic loss scaling (``harness.neutral.precision``: float16's range is too small for small
    gradients; bfloat16 has float32's and needs none). ``grads`` are of the loss times ``scaler[0]`` (float32 scalar,
    initially ``LOSS_SCALE_INIT``), divided by it here; ``scaler[1]`` (int32 scalar) counts the finite steps in a
    row. Returns the parameters and optimizer state (updated, or kept when a gradient is inf or nan: the step is
    skipped, while batchnorm's running statistics keep the forward pass's update, as in PyTorch's ``GradScaler``) and
    the next (scale, count) (``next_loss_scale``); both live in the jitted step's carried state.

    optax has no loss scaling (``optax.apply_if_finite`` skips non-finite updates but neither scales nor unscales), so
    this is a few ``jnp.where``, the shared rule of ``harness.neutral.precision`` (PyTorch's ``GradScaler``'s
    defaults; https://docs.pytorch.org/docs/stable/amp.html#gradient-scaling)."""
    scale, good = scaler
    grads = jax.tree_util.tree_map(lambda g: g / scale, grads)
    finite = jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)]).all()
    updates, new_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)

    def keep(new: Any, old: Any) -> Any:
        return jnp.where(finite, new, old)
    new_params, new_state = jax.tree_util.tree_map(keep, (new_params, new_state), (params, opt_state))
    return new_params, new_state, next_loss_scale(scale, good, finite)


def next_loss_scale(scale: Any, good: Any, finite: Any) -> tuple[Any, Any]:
    """``harness.neutral.precision.next_loss_scale`` in jnp ops, traced into the step: (scale, finite steps in a row)
    after a step, halved (``LOSS_SCALE_BACKOFF``) and 0 after a non-finite gradient; doubled (``LOSS_SCALE_GROWTH``)
    and 0 when the count reaches ``LOSS_SCALE_GROWTH_STEPS``; else the same scale and the count plus one."""
    good = jnp.where(finite, good + 1, 0)
    grow = good >= LOSS_SCALE_GROWTH_STEPS
    scale = jnp.where(finite, jnp.where(grow, scale * LOSS_SCALE_GROWTH, scale), scale * LOSS_SCALE_BACKOFF)
    return scale, jnp.where(grow, 0, good).astype(jnp.int32)


def _optimizer(optimizer: OptimizerSpec) -> Any:
    """optax with PyTorch's semantics (``harness.spec.OptimizerSpec``): weight decay is ``optax.add_decayed_weights``
    before the optimizer (an L2 term added to the gradient, as in torch.optim); SGD is ``optax.sgd`` (``trace``: v <-
    momentum * v + g, then -lr * v, PyTorch's form); Adam is ``optax.adam`` with ``eps_root=0`` (m_hat / (sqrt(v_hat)
    + eps): epsilon where PyTorch puts it; https://optax.readthedocs.io/en/latest/api/optimizers.html#optax.adam)."""
    if optimizer.name == "sgd":
        main = optax.sgd(optimizer.learning_rate, momentum=optimizer.momentum or None)
    else:
        main = optax.adam(optimizer.learning_rate, b1=optimizer.beta1, b2=optimizer.beta2, eps=optimizer.epsilon,
                          eps_root=0.0)
    if optimizer.weight_decay:
        return optax.chain(optax.add_decayed_weights(optimizer.weight_decay), main)
    return main
