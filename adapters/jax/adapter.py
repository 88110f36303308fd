"""JAX adapter: the canonical layers as ``jax.lax`` ops over a parameter dict (``adapters.jax.layers``), optax
optimizers, one jit-compiled train step per (batch size, micro-batches), data resident on the device, NHWC; or, with
``input: loader``, each step's batch from a Grain pipeline put on the device ahead of the step (``open_loader``).
``JaxAdapter`` implements ``adapters.base.Adapter``: one mode, "compiled" (``jax.jit`` of the whole step, XLA); fp32
(``lax.Precision.HIGHEST``), tf32 (GPUs), bf16, and fp16 (GPUs) with dynamic loss scaling (``_scaled_update``).
Weights go into TensorFlow's layouts in ``build`` and back in ``get_weights`` / ``get_buffers``.

Design: docs/design/framework-caveats.md#jax (why no flax, layouts, precision, memory and CPU threads).
"""

from __future__ import annotations

import collections
import functools
import importlib.metadata
import importlib.util
import itertools
import os
from collections.abc import Iterable, Iterator
from typing import Any

# Before the import: otherwise JAX maps 75 % of GPU memory at its first use
# (https://docs.jax.dev/en/latest/gpu_memory_allocation.html).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# XLA's CPU client has no intra-op thread count: with one thread asked for (OMP_NUM_THREADS=1, which the launcher sets
# before this module is imported), Eigen's thread pool is turned off through XLA_FLAGS.
if os.environ.get("OMP_NUM_THREADS") == "1" and "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from adapters.base import Adapter, DeviceUnavailable, device_index, micro_batch_size, shard
from adapters.jax import DECLARATION
from adapters.jax import layers as L
from harness.neutral.models import chw_to_hwc_permutation, initial_buffers

Params = L.Params
#: fp16's dynamic loss scaling (``_scaled_update``): the initial scale (PyTorch's ``GradScaler`` default) and
#: the finite steps in a row after which the scale doubles.
LOSS_SCALE_INIT, LOSS_SCALE_GROWTH_STEPS = 2.0 ** 16, 2000
#: The mesh axis of a data-parallel trial (``JaxAdapter._data_parallel_step``): the global batch is sharded along it.
DATA = "data"


def _cache_size(jitted: Any) -> int | None:
    """How many times a jitted function was compiled (its cache's size), where JAX tells."""
    size = getattr(jitted, "_cache_size", None)
    return int(size()) if callable(size) else None


def _oom_types() -> tuple[type, ...]:
    found = [getattr(jax.errors, "JaxRuntimeError", None)]
    try:
        from jax._src.lib import _jax as _lib  # where XlaRuntimeError lives in recent jaxlib
        found.append(getattr(_lib, "XlaRuntimeError", None))
    except ImportError:  # pragma: no cover - older jaxlib
        pass
    return tuple(t for t in found if isinstance(t, type))


class JaxAdapter(Adapter, declaration=DECLARATION):
    def __init__(self) -> None:
        self.device: Any = None
        self._gpu = False
        self._loss_sum: jax.Array | None = None  # float32 (), on the device, carried through the jitted step
        self._loss_steps = 0  # the steps in it since the last read
        self._layers: list[L.Layer] = []
        self._dropouts = 0
        self.tokens = self.next_token = False
        self._perms: dict[str, np.ndarray] = {}  # canonical name -> the permutation applied to its first axis
        self._transforms: dict[str, str] = {}  # canonical name -> "conv" | "dense" (layout changes get_weights undoes)
        # The jitted train steps: (B, micro-batches) -> resident mode's (``_summed_step``), and (B, micro-batches,
        # "loader") -> loader mode's (``_summed_batch_step``).
        self._steps: dict[tuple[Any, ...], Any] = {}
        self._source: Any = None  # input: loader: open_loader's InputSource, read through grain in epoch_batches
        self._loader_settings: dict[str, Any] = {}  # open_loader's pipeline, for settings()
        self._memory: dict[str, Any] = {}
        self._precision, self._compute = "fp32", L.FP32
        self._scaler: tuple[jax.Array, jax.Array] | None = None  # fp16: (loss scale, finite steps in a row)
        # Data-parallel (``options.data_parallel``): the Mesh of its N devices (axis DATA), else None. The training
        # state and the training data go to ``_placement``: the device, or replicated over the mesh.
        self._mesh: Mesh | None = None
        self._placement: Any = None
        self._sync_batchnorm = False

    # ------------------------------------------------------------------------------------------------------ setup

    def versions(self) -> dict[str, str]:
        out = {"jax": jax.__version__, "optax": optax.__version__}
        for dist in ("jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", *(
                ("grain",) if self.options.input == "loader" else ())):
            try:
                out[dist.replace("-", "_")] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
        return out

    def device_problem(self, device: str) -> str | None:
        """jax.devices("gpu") (https://docs.jax.dev/en/latest/_autosummary/jax.devices.html) raises RuntimeError
        when no GPU backend is installed or none initialises (a CPU-only jaxlib without the CUDA plugin). It starts
        the GPU backend: the probe sets XLA_PYTHON_CLIENT_PREALLOCATE=false so that this takes no memory."""
        if not device.startswith("cuda"):
            return None
        try:
            devices = jax.devices("gpu")
        except RuntimeError as err:
            if not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
                return f"JAX {jax.__version__} sees no GPU (a CPU-only build: no CUDA plugin installed)"
            return f"JAX {jax.__version__} sees no GPU ({str(err).splitlines()[0][:160]})"
        index = device_index(device)
        return None if index < len(devices) else f"JAX sees {len(devices)} GPU(s); {device} is not one"

    def prepare(self, device: str, threads: int | None, seed: int) -> None:
        self._precision = self.options.precision
        self._compute = L.POLICIES[self._precision]
        # what the ops without a precision argument use (jax.nn.dot_product_attention's): "highest" or "default"
        jax.config.update("jax_default_matmul_precision", self._compute.precision.name.lower())
        if device.startswith("cuda"):
            self._apply_memory_limit()
            if (problem := self.device_problem(device)) is not None:
                raise DeviceUnavailable(problem)
            self.device, self._gpu = jax.devices("gpu")[device_index(device)], True
        else:
            self.device = jax.devices("cpu")[0]
        self._mesh, self._placement, self._sync_batchnorm = None, self.device, False
        if self.options.data_parallel is not None:
            self._prepare_data_parallel(self.options.data_parallel)
        self._seed = seed

    def _prepare_data_parallel(self, parallel: Any) -> None:
        """A ``jax.sharding.Mesh`` over the trial's devices (``DataParallel.devices``: "cpu:i" is the i-th of
        ``jax.devices("cpu")``, host devices that ``--xla_force_host_platform_device_count`` in XLA_FLAGS makes (the
        declaration's ``data_parallel_environment``, set before JAX is imported); "cuda:i" the i-th GPU) with one axis,
        DATA; the first of them is ``self.device`` (evaluation, ``predict``, memory statistics). One process drives
        them all. Raises DeviceUnavailable when JAX sees fewer devices than the trial names."""
        found = []
        for name, (kind, index) in zip(parallel.devices, parallel.one_process_devices("jax")):
            platform = "gpu" if kind == "cuda" else kind
            try:
                devices = jax.devices(platform)
            except RuntimeError as err:
                raise DeviceUnavailable(f"JAX {jax.__version__} has no {platform} devices for {name}: "
                                        f"{str(err).splitlines()[0][:160]}") from err
            if index >= len(devices):
                hint = (" (XLA_FLAGS must hold --xla_force_host_platform_device_count="
                        f"{parallel.size} before JAX is imported; it is {os.environ.get('XLA_FLAGS', '')!r})"
                        if platform == "cpu" else "")
                raise DeviceUnavailable(f"JAX sees {len(devices)} {platform} device(s); the data-parallel trial "
                                        f"needs {name}{hint}")
            found.append(devices[index])
        self._mesh = Mesh(np.array(found), (DATA,))
        self._placement = NamedSharding(self._mesh, P())  # replicated on every device of the mesh
        self.device, self._gpu = found[0], found[0].platform == "gpu"
        self._sync_batchnorm = parallel.sync_batchnorm

    def _apply_memory_limit(self) -> None:
        """``options.memory_limit_bytes`` on a GPU: XLA_PYTHON_CLIENT_MEM_FRACTION = limit / the device's memory
        (NVML's, else nvidia-smi's), set before JAX's GPU backend starts; XLA's allocator then fails past it with
        RESOURCE_EXHAUSTED. Written from the documentation; no GPU was available to run it."""
        limit = self.options.memory_limit_bytes
        if not limit:
            return
        total = _gpu_total_memory()
        if total:
            fraction = min(float(limit) / total, 1.0)
            os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.4f}"
            self._memory = {"memory_limit_bytes": int(limit), "memory_fraction": fraction,
                            "device_total_memory_bytes": total}
        else:
            self._memory = {"memory_limit_bytes": int(limit), "memory_limit_skipped": "device memory unknown"}

    def build(self, info: Any, weights: dict[str, np.ndarray], optimizer: Any) -> None:
        """The canonical weights in JAX's layouts, batchnorm's running statistics from ``weights``' buffers if it has
        them, else ``harness.neutral.models.initial_buffers``, and the optimizer (``_optimizer``). The layouts are
        TensorFlow's (both compute NHWC): conv kernels HWIO (``weight.transpose(2, 3, 1, 0)``), dense kernels (in,
        out), and the first dense layer after flattening an (H, W, C) tensor has its input rows permuted by
        ``harness.neutral.models.chw_to_hwc_permutation`` (a batchnorm over those flat features has its parameters and
        running statistics permuted the same way); the data is never permuted. Layernorm, embedding and attention keep
        the canonical layouts. ``get_weights`` / ``get_buffers`` invert this (``_canonical``)."""
        buffers = {**initial_buffers(info), **{k: v for k, v in weights.items() if k in info.buffer_names()}}
        self._layers, self._perms, self._transforms, self._steps = [], {}, {}, {}
        self._loss_sum, self._loss_steps = None, 0
        params: dict[str, np.ndarray] = {}
        stats: dict[str, np.ndarray] = {}
        flatten_from: tuple[int, int, int] | None = None
        self._dropouts = 0
        self.next_token, self.tokens = info.task == "next_token", info.task != "image_classification"
        for layer in info.layers:
            fn, flatten_from = self._add_layer(layer, weights, buffers, params, stats, flatten_from)
            self._layers.append(fn)
        # Data-parallel: the state replicated on every device of the mesh (``_placement``).
        self.params = jax.device_put({k: jnp.asarray(v, jnp.float32) for k, v in params.items()}, self._placement)
        self.stats = jax.device_put({k: jnp.asarray(v, jnp.float32) for k, v in stats.items()}, self._placement)
        self.tx = _optimizer(optimizer)
        self.opt_state = jax.device_put(self.tx.init(self.params), self._placement)
        # Every leaf of the state on the device, committed, as the step's outputs are: an uncommitted leaf (a key made
        # off the device) would make the second call compile the step again, inside the timed loop.
        self._key = jax.device_put(jax.random.PRNGKey(self._seed), self._placement)
        self._scaler = None if self._compute.dtype != jnp.float16 else jax.device_put(
            (jnp.asarray(LOSS_SCALE_INIT, jnp.float32), jnp.asarray(0, jnp.int32)), self._placement)
        self._eval = jax.jit(self._eval_batch)
        self._logits = jax.jit(self._infer)

    def _add_layer(self, layer: Any, weights: dict[str, np.ndarray], buffers: dict[str, np.ndarray],
                   params: dict[str, np.ndarray], stats: dict[str, np.ndarray],
                   flatten_from: tuple[int, int, int] | None) -> tuple[L.Layer, tuple[int, int, int] | None]:
        """One layer's or block's parameters (JAX layout, under canonical names) and forward function; also the
        (C, H, W) shape the next dense layer's input was flattened from, or None."""
        spec, kind, name = layer.spec, layer.kind, layer.name
        w, b = f"{name}.weight", f"{name}.bias"
        if kind == "residual":
            body = [self._add_layer(child, weights, buffers, params, stats, None)[0] for child in layer.body]
            shortcut = [self._add_layer(child, weights, buffers, params, stats, None)[0] for child in layer.shortcut]
            return L.residual(body, shortcut, spec.activation), None
        if kind == "conv2d":
            params[w] = np.asarray(weights[w]).transpose(2, 3, 1, 0)  # OIHW -> HWIO
            self._transforms[w] = "conv"
            if spec.use_bias:
                params[b] = np.asarray(weights[b])
            return (L.conv(w, b if spec.use_bias else None, spec.stride, spec.padding, spec.activation, self._compute),
                    flatten_from)
        if kind == "dense":
            weight = np.asarray(weights[w])
            if flatten_from is not None:
                perm = chw_to_hwc_permutation(flatten_from)
                weight, self._perms[w] = weight[:, perm], perm
            params[w], params[b] = np.ascontiguousarray(weight.T), np.asarray(weights[b])  # (out, in) -> (in, out)
            self._transforms[w] = "dense"
            return L.dense(w, b, spec.activation, self._compute), None
        if kind == "batchnorm":
            channels = chw_to_hwc_permutation(flatten_from) if len(layer.input_shape) == 1 and flatten_from else None
            names = (w, b, f"{name}.running_mean", f"{name}.running_var")
            for item in names:
                value = np.asarray((weights if item in (w, b) else buffers)[item])
                (params if item in (w, b) else stats)[item] = value if channels is None else value[channels]
                if channels is not None:
                    self._perms[item] = channels
            return L.batchnorm(*names, spec.momentum, spec.epsilon, flat=len(layer.input_shape) == 1,
                               sync_axis=DATA if self._sync_batchnorm else None), flatten_from
        if kind in ("layernorm", "embedding", "attention"):
            for local in layer.params:  # canonical layouts as they are: only matmuls with .T, no conversion
                params[f"{name}.{local}"] = np.asarray(weights[f"{name}.{local}"])
            if kind == "layernorm":
                return L.layernorm(w, b, spec.epsilon), None
            if kind == "embedding":
                return L.embedding(f"{name}.token.weight", f"{name}.position.weight", self._compute), None
            return L.attention(name, spec.heads, spec.causal, self._compute), None
        if kind in ("maxpool2d", "avgpool2d"):
            return L.pool(kind, spec.pool_size, spec.stride or spec.pool_size), flatten_from
        if kind == "global_avgpool2d":
            return L.plain(lambda x: jnp.mean(x, axis=(1, 2))), None  # channel order
        if kind == "sequence_pool":
            return L.sequence_pool(spec.mode), None
        if kind == "dropout":
            self._dropouts += 1
            return L.dropout(spec.rate, self._dropouts), flatten_from
        if kind == "flatten":
            shape = tuple(layer.input_shape) if len(layer.input_shape) == 3 else None
            return L.plain(lambda x: x.reshape(x.shape[0], -1)), shape  # (H, W, C) order; sequences position-major
        if kind == "relu":
            return L.plain(jax.nn.relu), flatten_from
        if kind == "gelu":
            return L.plain(lambda x: jax.nn.gelu(x, approximate=False)), flatten_from
        return L.plain(lambda x: x), flatten_from  # softmax: folded into the cross-entropy loss

    # ---------------------------------------------------------------------------------------------------- compute

    def _forward(self, params: Params, stats: Params, x: jax.Array, train: bool, key: jax.Array
                 ) -> tuple[jax.Array, Params]:
        """Logits (float32 whatever the compute dtype) and the updated running statistics (only in training)."""
        updated: Params = {}
        for fn in self._layers:
            x, new = fn(params, stats, x, train, key)
            updated.update(new)
        return x.astype(jnp.float32), {**stats, **updated}

    def _loss(self, params: Params, stats: Params, x: jax.Array, y: jax.Array, key: jax.Array,
              scale: jax.Array | None) -> tuple[jax.Array, tuple[Params, jax.Array]]:
        """The loss to differentiate (times fp16's loss ``scale``, if any), and (the running statistics, the loss).
        Data-parallel (inside ``jax.shard_map``, ``x`` the device's shard): the loss is the ``lax.pmean`` over DATA of
        the shards' means, the global batch's mean, so its gradient is the global batch's (below)."""
        logits, stats = self._forward(params, stats, x, True, key)
        # over the samples, or for a next-token model over every position of (B, L, V) logits and (B, L) labels
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        if self._mesh is not None:
            # The all-reduces: this pmean, and in the backward pass a psum over DATA of every parameter's gradient
            # (the transpose of the replicated parameters' use by per-device values, which shard_map's varying
            # manual axes track: check_vma), times 1 / N from the pmean: the mean over all B samples' gradients.
            loss = lax.pmean(loss, DATA)
        return (loss if scale is None else loss * scale), (stats, loss)

    def _step(self, micro_batches: int, state: tuple[Any, ...], x_all: jax.Array, y_all: jax.Array,
              indices: jax.Array) -> tuple[tuple[Any, ...], jax.Array]:
        """Resident mode's optimizer step: the samples ``indices`` (int32 (B,)) gathered from the dataset on the
        device (``x_all``, ``y_all``; data-parallel: the device's shard of them), then ``_train_on`` them, in one
        traced function. Each micro-batch's samples are gathered on their own, as it is trained on (the parts are
        drawn lazily): with gradient accumulation only one micro-batch's inputs are made at a time."""
        def parts() -> Iterator[tuple[jax.Array, jax.Array]]:
            for part in jnp.split(indices, micro_batches):
                yield x_all[part], y_all[part]
        return self._train_on(micro_batches, state, parts())

    def _train_on(self, micro_batches: int, state: tuple[Any, ...],
                  parts: Iterable[tuple[jax.Array, jax.Array]]) -> tuple[tuple[Any, ...], jax.Array]:
        """One optimizer step on a batch on the device, given as its ``micro_batches`` k consecutive parts (x, y) of
        B / k samples each (x float32 (B / k, H, W, C) images or int32 (B / k, L) tokens, y int32 (B / k,) or
        (B / k, L) labels): the path that resident mode (``_step``, gathering each part) and loader mode
        (``_summed_batch_step``, slicing the loader's batch) share. Each part runs forward and backward on its own
        (running statistics updated after each, as k forward passes in training mode would), the gradients and
        losses averaged over the k before the one update. ``state`` is (parameters, optimizer state, running
        statistics, PRNG key, fp16's (loss scale, finite steps in a row) or None); returns the new state and the
        step's loss (float32 (): the mean over the B samples)."""
        params, opt_state, stats, key, scaler = state
        key, step_key = jax.random.split(key)
        if self._mesh is not None:  # each device its own dropout masks
            step_key = jax.random.fold_in(step_key, lax.axis_index(DATA))
        grad_fn = jax.grad(self._loss, has_aux=True)
        grads, loss = None, jnp.zeros((), jnp.float32)
        for (x_part, y_part), part_key in zip(parts, jax.random.split(step_key, micro_batches)):
            part_grads, (stats, part_loss) = grad_fn(params, stats, x_part, y_part, part_key,
                                                     None if scaler is None else scaler[0])
            grads = part_grads if grads is None else jax.tree_util.tree_map(jnp.add, grads, part_grads)
            loss = loss + part_loss
        if grads is None:  # checked while tracing (Python): no micro-batch ran
            raise ValueError(f"micro_batches must be at least 1, not {micro_batches}")
        if micro_batches > 1:
            grads = jax.tree_util.tree_map(lambda g: g / micro_batches, grads)
            loss = loss / micro_batches
        if self._mesh is not None and not self._sync_batchnorm:
            # each device's running statistics moved by its own shard's moments: their mean over the devices (the
            # running mean is then the one-device run's; the running variance the mean of the shards' variances)
            stats = lax.pmean(stats, DATA)
        if scaler is not None:
            params, opt_state, scaler = _scaled_update(self.tx, grads, params, opt_state, scaler)
            return (params, opt_state, stats, key, scaler), loss
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, stats, key, None), loss

    def _summed_step(self, micro_batches: int, state: tuple[Any, ...], loss_sum: jax.Array, x_all: jax.Array,
                     y_all: jax.Array, indices: jax.Array) -> tuple[tuple[Any, ...], jax.Array]:
        """``_step``, and ``loss_sum`` (float32 ()) plus its loss, inside the same executable: the running sum that
        ``read_loss`` reads never costs a dispatch or a read of its own."""
        state, loss = self._step(micro_batches, state, x_all, y_all, indices)
        return state, loss_sum + loss

    def _summed_batch_step(self, micro_batches: int, state: tuple[Any, ...], loss_sum: jax.Array, x: jax.Array,
                           y: jax.Array) -> tuple[tuple[Any, ...], jax.Array]:
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
        mapped = jax.shard_map(functools.partial(self._summed_step, micro_batches), mesh=self._mesh,
                               in_specs=(P(), P(), P(), P(), P(DATA)), out_specs=(P(), P()))
        return jax.jit(mapped, donate_argnums=(0, 1) if self._gpu else ())

    def _infer(self, params: Params, stats: Params, x: jax.Array) -> jax.Array:
        """Logits in inference mode (running statistics, no dropout: the key is not drawn from)."""
        return self._forward(params, stats, x, False, self._key)[0]

    def _eval_batch(self, params: Params, stats: Params, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = self._infer(params, stats, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()
        return loss, jnp.sum(jnp.argmax(logits, axis=-1) == y)

    # --------------------------------------------------------------------------------------------------- contract

    def _inputs(self, x: np.ndarray, placement: Any = None) -> jax.Array:
        """Images as float32 NHWC, or token ids as int32, on the device (or ``placement``)."""
        return jax.device_put(jnp.asarray(x, jnp.int32 if self.tokens else jnp.float32),
                              self.device if placement is None else placement)

    def load(self, data: Any) -> None:
        """Data-parallel: the training set on every device (each gathers its shard of a step from its copy), the
        test set on the first (evaluation). ``input: loader``: the test set only (the training batches come through
        ``open_loader``'s pipeline)."""
        if self.options.input == "resident":
            self.x_train = self._inputs(data.x_train, self._placement)
            self.y_train = jax.device_put(jnp.asarray(data.y_train, jnp.int32), self._placement)
        self.x_test = self._inputs(data.x_test)
        self.y_test = jax.device_put(jnp.asarray(data.y_test, jnp.int32), self.device)

    def unsupported(self, info: Any) -> str | None:
        """The declaration's gaps (``support_gap``); with ``input: loader`` also a missing ``grain`` (the loader,
        installed by requirements/jax-cpu.txt and jax-gpu.txt), found without importing it."""
        if self.options.input == "loader" and importlib.util.find_spec("grain") is None:
            return ("the jax adapter's data loader (input: loader) is grain, which is not installed in this "
                    "environment (requirements/jax-cpu.txt, requirements/jax-gpu.txt)")
        return super().unsupported(info)

    def open_loader(self, source: Any) -> None:
        """Grain (https://google-grain.readthedocs.io, Google's data loader for JAX), its dataset API: in
        ``epoch_batches`` a ``grain.MapDataset`` whose element p is step p's batch of the epoch's order (``_Steps``:
        one ``source.read`` of the step's samples, the whole batch at once, as PyTorch's ``__getitems__`` reads it),
        made an iterator by ``to_iter_dataset(grain.ReadOptions(num_threads=workers, prefetch_buffer_size=workers x
        prefetch))``: ``options.loader.workers`` threads read elements ahead, returned in the dataset's order (0: each
        is read in the training thread when asked for). The buffer is grain's elements in flight, so it must be at
        least the threads (grain 0.2.18 warns that fewer would run otherwise); ``workers x prefetch`` batches read
        ahead is PyTorch's ``num_workers x prefetch_factor``. Then ``_device_prefetch``: ``options.loader.prefetch``
        batches already given to ``jax.device_put`` ahead of the step.

        Why a MapDataset of steps and not per-sample elements with ``.batch(B)``, or ``grain.DataLoader`` with a
        sampler: the trial's order is given per epoch (``harness.neutral.datasets.epoch_order``), and an element per
        step follows it exactly; reading 32 digits one by one and stacking them took 1.2 ms a batch against 0.17 ms
        for one read (grain 0.2.18, one CPU thread). Why not ``grain.experimental.device_put``: it is experimental,
        and its stages are threads, which would read in the background even with 0 workers; the device queue needs
        no thread, as ``jax.device_put`` only starts the transfer (https://docs.jax.dev/en/latest/async_dispatch.html).
        Records the settings under ``settings()["loader"]``."""
        import grain  # here, not at the top: resident mode neither needs grain nor pays for its import

        workers, prefetch = self.options.loader.workers, self.options.loader.prefetch
        self._source = source
        self._read_options = grain.ReadOptions(num_threads=workers, prefetch_buffer_size=workers * prefetch)
        self._loader_settings = {
            "loader": DECLARATION.loader, "num_threads": workers, "prefetch_buffer_size": workers * prefetch,
            "device_put_prefetch": prefetch, "source": "files" if source.from_files else "memory"}

    def epoch_batches(self, order: np.ndarray, samples_per_step: int, epoch: int) -> Iterator[Any]:
        """Step p's (x, y), p = 0 ... len(order) // samples_per_step - 1: ``source.read(order[p * samples_per_step:
        (p + 1) * samples_per_step], epoch)`` as float32 (B, H, W, C) images or int32 (B, L) tokens and int32
        labels (the dtypes resident mode trains on), committed to the device by ``jax.device_put`` (the transfer
        started, maybe not finished). Nothing is read before the first ``next``, as a ``for`` loop over a loader
        starts it; the pipeline's threads end with the epoch (``_device_prefetch``)."""
        import grain

        steps = grain.MapDataset.source(_Steps(self._source, order, samples_per_step, epoch, self.tokens))
        return _device_prefetch(steps.to_iter_dataset(self._read_options), self.device,
                                self.options.loader.prefetch)

    def set_train_images(self, images: np.ndarray) -> None:
        """A new device array of the same shape and dtype (JAX arrays are immutable; the old one is freed): the train
        step takes the dataset as an argument, so nothing is retraced."""
        if images.shape != self.x_train.shape:
            raise ValueError(f"images of shape {images.shape}, not {self.x_train.shape}")
        self.x_train = jax.device_put(jnp.asarray(images, jnp.float32), self._placement)

    def compilations(self) -> int | None:
        """Entries in the jit caches of the train step functions, resident and loader mode's (one per traced and
        compiled input signature; ``_cache_size`` of a jitted function, the count jax's own tests read); None where
        this jax lacks it."""
        sizes = [getattr(step, "_cache_size", None) for step in self._steps.values()]
        return None if any(size is None for size in sizes) else sum(size() for size in sizes if size is not None)

    def train_step(self, indices: np.ndarray, micro_batches: int = 1, position: int | None = None) -> None:
        """One step (``_summed_step``, jitted once per (B, micro_batches)); ``indices`` go in as numpy at every step
        (``position`` is not needed). Data-parallel: ``_data_parallel_step``, without micro-batches."""
        micro_batch_size(len(indices), micro_batches)  # raises ValueError for an uneven split
        key = (len(indices), micro_batches)
        if self._mesh is not None and key not in self._steps:
            if micro_batches != 1:
                raise ValueError("gradient accumulation with data parallelism is not supported")
            shard(np.asarray(indices), len(self._mesh.devices), 0)  # raises ValueError unless N divides B
            self._steps[key] = self._data_parallel_step(micro_batches)
        if key not in self._steps:
            # The state and the loss sum are donated on a GPU (https://docs.jax.dev/en/latest/faq.html#buffer-donation);
            # XLA's CPU client cannot reuse donated buffers (it would warn each time).
            self._steps[key] = jax.jit(functools.partial(self._summed_step, micro_batches),
                                       donate_argnums=(0, 1) if self._gpu else ())
        # Plain numpy into the jitted step: jit copies it to the device of the committed data. jnp.asarray first
        # would block the host until the queued steps are nearly done (measured: 2.2 vs 1.2 ms of host time per
        # step at batch 64 on the CPU, benchmarks/harness_vs_loop.py), losing the overlap of dispatch and compute.
        self._run(self._steps[key], self.x_train, self.y_train, np.asarray(indices, dtype=np.int32))

    def train_batch(self, batch: Any, micro_batches: int = 1) -> None:
        """One step on a batch of ``epoch_batches`` (``_summed_batch_step``, jitted once per (B, micro_batches): every
        batch of a trial has the same shapes and dtypes, so it compiles once). Not data-parallel (``input_gap``
        refuses loader mode with several devices): raises ValueError there."""
        x, y = batch
        micro_batch_size(int(x.shape[0]), micro_batches)  # raises ValueError for an uneven split
        key = (int(x.shape[0]), micro_batches, "loader")
        if key not in self._steps:
            if self._mesh is not None:
                raise ValueError("input: loader is not combined with data parallelism (adapters.base.input_gap)")
            self._steps[key] = jax.jit(functools.partial(self._summed_batch_step, micro_batches),
                                       donate_argnums=(0, 1) if self._gpu else ())  # as in train_step
        self._run(self._steps[key], x, y)

    def _run(self, step: Any, *inputs: Any) -> None:
        """Queues ``step(state, loss sum, *inputs)`` (a jitted ``_summed_step`` or ``_summed_batch_step``) and keeps
        its new state and loss sum; counts the step."""
        state = (self.params, self.opt_state, self.stats, self._key, self._scaler)
        if self._loss_sum is None:  # the first step: the sum starts (committed to the device, as the step returns it)
            self._loss_sum = jax.device_put(jnp.zeros((), jnp.float32), self._placement)
        elif self._mesh is not None and not self._gpu:
            # Host devices: one data-parallel step in flight at a time. XLA's CPU client runs each device's part of a
            # step on a thread of a pool of max(cores, devices) threads, where an all-reduce blocks its thread until
            # every device arrives; with steps queued ahead, one device's next step can hold the threads another
            # device needs to finish this one, and the all-reduce's rendezvous aborts the process after 40 s
            # (jaxlib 0.10.2 on 2 cores and 2 host devices: within the first 100 queued steps; never with a sync per
            # step, or with 2N threads). So the step waits for the one before (its loss sum) before it is queued.
            self._loss_sum.block_until_ready()
        (self.params, self.opt_state, self.stats, self._key, self._scaler), self._loss_sum = step(
            state, self._loss_sum, *inputs)
        self._loss_steps += 1

    def wait(self) -> None:
        """Blocks until the last step's outputs are ready (one jitted executable: its outputs complete together;
        https://docs.jax.dev/en/latest/async_dispatch.html; the loss sum is one of them), without copying anything to
        the host; before the first step, until the parameters are."""
        if self._loss_sum is None:
            for leaf in jax.tree_util.tree_leaves(self.params):
                leaf.block_until_ready()
        else:
            self._loss_sum.block_until_ready()

    def _take_loss_sum(self) -> float:
        """The sum copied to the host (``float``) and a new zero sum put on the device."""
        if self._loss_sum is None:
            raise RuntimeError("no loss sum: read_loss reads only after a train_step")
        total = float(self._loss_sum)
        self._loss_sum = jax.device_put(jnp.zeros((), jnp.float32), self._placement)
        return total

    def _first(self, tree: Any) -> Any:
        """Data-parallel: the first device's copy of each replicated array of ``tree`` (no copy is made); else
        ``tree``."""
        if self._mesh is None:
            return tree
        return jax.tree_util.tree_map(
            lambda a: next(s.data for s in a.addressable_shards if s.device == self.device), tree)

    def evaluate(self, batch_size: int) -> tuple[float, float]:
        """Data-parallel: on the first device, with its copy of the parameters and statistics (``_first``)."""
        n = int(self.x_test.shape[0])
        total = jnp.zeros((), jnp.float32)
        correct = jnp.zeros((), jnp.int32)
        params, stats = self._first(self.params), self._first(self.stats)
        for start in range(0, n, batch_size):
            loss, right = self._eval(params, stats, self.x_test[start:start + batch_size],
                                     self.y_test[start:start + batch_size])
            total, correct = total + loss, correct + right
        count = int(self.y_test.size)  # samples, or every position of every sequence
        return float(total) / count, float(correct) / count

    def predict(self, images: np.ndarray) -> np.ndarray:
        return np.asarray(self._logits(self._first(self.params), self._first(self.stats), self._inputs(images)),
                          dtype=np.float32)

    def _canonical(self, name: str, value: Any) -> np.ndarray:
        array = np.array(value, dtype=np.float32)
        kind = self._transforms.get(name)
        if kind == "conv":
            array = array.transpose(3, 2, 0, 1)  # HWIO -> OIHW
        elif kind == "dense":
            array = array.T  # (in, out) -> (out, in)
        if name in self._perms:
            inverse = np.argsort(self._perms[name])
            array = array[:, inverse] if kind == "dense" else array[inverse]
        return np.ascontiguousarray(array)

    def get_weights(self) -> dict[str, np.ndarray]:
        return {name: self._canonical(name, value) for name, value in self._first(self.params).items()}

    def get_buffers(self) -> dict[str, np.ndarray]:
        return {name: self._canonical(name, value) for name, value in self._first(self.stats).items()}

    def reset_memory_stats(self) -> None:
        """JAX cannot reset its allocator's peak: ``memory_stats`` reports the peak since the worker started,
        compilation and warm-up included."""

    def memory_stats(self) -> dict[str, int]:
        stats = self.device.memory_stats() if self.device is not None else None
        if not stats or "peak_bytes_in_use" not in stats:
            return {}  # the CPU backend keeps no allocator statistics
        return {"allocator_peak_bytes": int(stats["peak_bytes_in_use"])}

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "platform": getattr(self.device, "platform", None),
            "XLA_PYTHON_CLIENT_PREALLOCATE": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "precision": self._precision,
            "compute_dtype": self._compute.dtype.name,  # of conv, dense, attention, the embedding's output
            "matmul_precision": self._compute.precision.name.lower(),  # of those ops; "highest" is float32
            "donated_state": self._gpu,
            # How often each train step was compiled: 1 each, or a retrace happened (and cost a timed step).
            # (a loader-mode step is named "<B>x<k> loader")
            "train_step_compilations": {" ".join([f"{key[0]}x{key[1]}", *key[2:]]): _cache_size(f)
                                        for key, f in self._steps.items()},
            "allocator_peak": "since the worker started (JAX cannot reset it)",
            "intra_op_threads": 1 if "xla_cpu_multi_thread_eigen=false" in os.environ.get("XLA_FLAGS", "") else
            "XLA's default (every core; it has no intra-op thread count)",
        }
        if self._loader_settings:
            out["loader"] = self._loader_settings
        if self._mesh is not None:
            out["data_parallel"] = {
                "devices": [str(d) for d in self._mesh.devices.flat], "mechanism": DECLARATION.data_parallel_mechanism,
                "batchnorm": "synchronised (pmean of the batch moments)" if self._sync_batchnorm else
                "per device; running statistics: the mean of the devices' (pmean)",
                "evaluation": "the first device",
                "steps_in_flight": "any (GPUs)" if self._gpu else "one (host devices: see train_step)"}
        if self._compute.dtype != jnp.float32:
            out["master_weights"] = "float32"
        if self._scaler is not None:  # the scale after the last step (a sync)
            out.update(loss_scale=float(self._scaler[0]), loss_scale_init=LOSS_SCALE_INIT,
                       loss_scale_growth_steps=LOSS_SCALE_GROWTH_STEPS)
        if self._gpu:
            out["XLA_PYTHON_CLIENT_MEM_FRACTION"] = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
            out["memory_limit_bytes"] = None
            out.update(self._memory)
        return out

    def is_oom(self, exc: BaseException) -> bool:
        # XLA reports an allocation failure as a runtime error with the RESOURCE_EXHAUSTED status.
        types = _oom_types()
        return bool(types) and isinstance(exc, types) and "RESOURCE_EXHAUSTED" in str(exc)


class _Steps:
    """The epoch as a sequence of steps, for ``grain.MapDataset.source`` (a ``Sequence``: ``__len__`` and
    ``__getitem__``): element p is ``source.read(order[p * size:(p + 1) * size], epoch)`` (``harness.neutral.inputs
    .InputSource``, augmented for the epoch) as float32 (size, H, W, C) images or int32 (size, L) tokens and int32
    labels; whole steps only. Read in grain's threads."""

    def __init__(self, source: Any, order: np.ndarray, size: int, epoch: int, tokens: bool):
        self.source, self.order, self.size, self.epoch, self.tokens = source, order, size, epoch, tokens

    def __len__(self) -> int:
        return len(self.order) // self.size

    def __getitem__(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= position < len(self):
            raise IndexError(f"step {position} of {len(self)}")
        x, y = self.source.read(self.order[position * self.size:(position + 1) * self.size], self.epoch)
        return np.asarray(x, np.int32 if self.tokens else np.float32), np.asarray(y, np.int32)


def _device_prefetch(batches: Any, device: Any, size: int) -> Iterator[Any]:
    """The elements of ``batches`` (an iterable of host arrays or tuples of them), each ``jax.device_put`` on
    ``device`` ``size`` elements before it is yielded: flax's ``jax_utils.prefetch_to_device`` pattern
    (https://flax.readthedocs.io/en/latest/api_reference/flax.jax_utils.html), a queue filled in the consuming thread,
    where ``device_put`` only starts each transfer (https://docs.jax.dev/en/latest/async_dispatch.html). The iterator
    of ``batches`` is made at the first ``next`` and closed (grain's ends its threads) when this one ends or is
    dropped."""
    iterator = iter(batches)
    queue: collections.deque[Any] = collections.deque()

    def enqueue(count: int) -> None:
        for batch in itertools.islice(iterator, count):
            queue.append(jax.device_put(batch, device))
    try:
        enqueue(size)
        while queue:
            yield queue.popleft()
            enqueue(1)
    finally:
        close = getattr(iterator, "close", None)
        if callable(close):
            close()


def _scaled_update(tx: optax.GradientTransformation, grads: Params, params: Params, opt_state: Any,
                   scaler: tuple[jax.Array, jax.Array]) -> tuple[Params, Any, tuple[jax.Array, jax.Array]]:
    """fp16's update with dynamic loss scaling (float16's range is too small for small gradients; bfloat16 has
    float32's and needs none). ``grads`` are of the loss times ``scaler[0]`` (float32 scalar, initially
    ``LOSS_SCALE_INIT``), divided by it here; ``scaler[1]`` (int32 scalar) counts the finite steps in a row. Returns the
    parameters and optimizer state (updated, or kept when a gradient is inf or nan: the step is skipped, while
    batchnorm's running statistics keep the forward pass's update, as in PyTorch's ``GradScaler``) and the next (scale,
    count) (``_next_loss_scale``); both live in the jitted step's carried state.

    optax has no loss scaling (``optax.apply_if_finite`` skips non-finite updates but neither scales nor unscales), so
    this is a few ``jnp.where``, written from the description of ``torch.amp.GradScaler`` (its defaults: initial scale
    2 ** 16, factors 2 and 0.5, 2000 steps; https://docs.pytorch.org/docs/stable/amp.html#gradient-scaling)."""
    scale, good = scaler
    grads = jax.tree_util.tree_map(lambda g: g / scale, grads)
    finite = jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)]).all()
    updates, new_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)

    def keep(new: jax.Array, old: jax.Array) -> jax.Array:
        return jnp.where(finite, new, old)
    kept = jax.tree_util.tree_map(keep, (new_params, new_state), (params, opt_state))
    return *kept, _next_loss_scale(scale, good, finite)


def _next_loss_scale(scale: jax.Array, good: jax.Array, finite: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(scale, finite steps in a row) after a step: halved and 0 after a non-finite gradient; doubled and 0 when the
    count reaches ``LOSS_SCALE_GROWTH_STEPS``; else the same scale and the count plus one."""
    good = jnp.where(finite, good + 1, 0)
    grow = good >= LOSS_SCALE_GROWTH_STEPS
    scale = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), scale * 0.5)
    return scale, jnp.where(grow, 0, good).astype(jnp.int32)


def _optimizer(optimizer: Any) -> optax.GradientTransformation:
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


def _gpu_total_memory() -> int | None:
    """The first visible GPU's memory in bytes, from NVML (nvidia-ml-py) or nvidia-smi; None when neither tells."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = (pynvml.nvmlDeviceGetHandleByUUID(visible) if visible.startswith(("GPU-", "MIG-"))
                      else pynvml.nvmlDeviceGetHandleByIndex(int(visible or 0)))
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no bindings, no driver: try nvidia-smi
        pass
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i",
                              visible or "0"], capture_output=True, text=True, timeout=30, check=True).stdout
        return int(float(out.strip().splitlines()[0]) * 2**20)  # MiB
    except Exception:  # noqa: BLE001
        return None
