"""TensorFlow adapter: raw ``tf.Variable``s and ``tf.nn`` ops in ``tf.function``s (XLA in the "compiled" mode only),
data resident on the device or fed by a ``tf.data`` pipeline (``input: loader``), NHWC for images, (B, L, D) for
sequences. ``TensorFlowAdapter`` implements ``adapters.base.Adapter``; its layers are in ``adapters.tensorflow.layers``
(Keras's own for layernorm and attention), its optimizer update and fp16's loss scaling in
``adapters.tensorflow.training``. Every parameter and buffer is kept under its canonical name with the variables that
hold it and the inverse of its layout conversion (``build``), from which ``get_weights`` and ``get_buffers`` rebuild the
canonical arrays.

Design: docs/design/framework-caveats.md#tensorflow (Keras's two layers, tracing, XLA, mixed precision, the optimizer).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before the import: silences TF's C++ INFO and WARNING logs

import numpy as np
import tensorflow as tf

from adapters.base import Adapter, DataParallel, DeviceUnavailable, device_index, device_kind, micro_batch_size, shard
from adapters.tensorflow import DECLARATION
from adapters.tensorflow import layers as L
from adapters.tensorflow.training import DynamicLossScale, dense_gradients, make_update
from harness.neutral.models import chw_to_hwc_permutation, flatten_feeds_dense, initial_buffers

#: The compute dtype of each precision (tf32 is float32 with TF32 matmuls and convolutions on a GPU).
_COMPUTE = {"fp32": tf.float32, "tf32": tf.float32, "bf16": tf.bfloat16, "fp16": tf.float16}


def _f32(array: np.ndarray) -> np.ndarray:
    return np.asarray(array, dtype=np.float32)


def _same(value: np.ndarray) -> np.ndarray:
    return value


def _default_threads() -> int:
    # What TF uses for a thread count of 0: the CPUs this process may run on (tsl::port::NumSchedulableCPUs).
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class TensorFlowAdapter(Adapter, declaration=DECLARATION):
    def __init__(self) -> None:
        self.device = "/CPU:0"
        self._gpu = False
        self._last_loss: tf.Tensor | None = None  # the last step's loss (what ``wait`` reads to know it is done)
        self._loss_sum: tf.Variable | None = None  # float32 (), on the device: the losses since the last read
        self._loss_steps = 0  # the steps in it
        # canonical name -> (the variables holding it, the function of their values that gives the canonical array)
        self._params: dict[str, L.Held] = {}
        self._buffers: dict[str, L.Held] = {}  # batchnorm's running statistics, the same way
        self._forward_layers: list[L.Layer] = []
        self.tokens = self.next_token = False
        self._memory_settings: dict[str, Any] = {}  # what _configure_gpu_memory applied, for settings()
        self._train_fns: dict[tuple[int, int], Any] = {}  # (batch size, micro-batches) -> traced train step
        self._compilations = 0  # tracings of train step functions (see compilations)
        self._train_calls: dict[tuple[int, int], Any] = {}  # the same -> its concrete function, what a step calls
        self._staged: list[tf.Tensor] = []  # this epoch's index batches on the device, by the step's position
        # input: loader (train_batch): (batch size, micro-batches) -> traced step on a batch, and its concrete function
        self._batch_fns: dict[tuple[int, int], Any] = {}
        self._batch_calls: dict[tuple[int, int], Any] = {}
        self._source: Any = None  # open_loader's InputSource
        self._sample_specs: tuple[tuple[int, ...], tf.DType, tuple[int, ...]] = ((), tf.float32, ())  # build
        self._loader_settings: dict[str, Any] = {}  # open_loader's tf.data pipeline, for settings()
        self._compute = tf.float32  # the compute dtype (build, from options.precision)
        self._jit = False  # XLA (build, from options.compile)
        self._loss_scale: DynamicLossScale | None = None  # fp16 only
        # Data parallelism (prepare, from options.data_parallel): the strategy over the replicas' devices, or None
        self._strategy: tf.distribute.MirroredStrategy | None = None
        self._replica_devices: tuple[str, ...] = ()
        self._replica_fns: list[Any] = []  # the XLA-compiled per-replica functions (compiled mode), for compilations

    def versions(self) -> dict[str, str]:
        out = {"tensorflow": tf.__version__}
        try:
            import keras

            out["keras"] = keras.__version__
        except ImportError:  # pragma: no cover - TF 2.16+ depends on Keras 3
            pass
        build = tf.sysconfig.get_build_info()
        if build.get("cuda_version"):
            out["cuda"] = str(build["cuda_version"])
        if build.get("cudnn_version"):
            out["cudnn"] = str(build["cudnn_version"])
        return out

    def device_problem(self, device: str) -> str | None:
        """tf.config.list_physical_devices("GPU") (https://www.tensorflow.org/api_docs/python/tf/config/
        list_physical_devices): lists GPUs without creating the TF context (so ``prepare`` can still configure them);
        tf.sysconfig.get_build_info()["is_cuda_build"] tells a CPU-only build (tensorflow-cpu)."""
        if not device.startswith("cuda"):
            return None
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            cuda_build = tf.sysconfig.get_build_info().get("is_cuda_build", False)
            why = "no GPU was found by this CUDA build" if cuda_build else "a CPU-only build"
            return f"TensorFlow {tf.__version__} sees no GPU ({why})"
        index = device_index(device)
        return None if index < len(gpus) else f"TensorFlow sees {len(gpus)} GPU(s); {device} is not one"

    def prepare(self, device: str, threads: int | None, seed: int) -> None:
        """Must run before any TF op in the process: TF fixes visible devices, memory growth and thread pools when its
        context starts, and raises RuntimeError for a later change (repeating the same settings is allowed). For
        ``cuda:N`` only GPU N is made visible (it is then "/GPU:0"), with memory growth
        (https://www.tensorflow.org/api_docs/python/tf/config/experimental/set_memory_growth) or a memory limit as
        ``options`` ask (``_configure_gpu_memory``) and TF32 off, or on for ``options.precision`` "tf32"
        (https://www.tensorflow.org/api_docs/python/tf/config/experimental/enable_tensor_float_32_execution). Raises
        DeviceUnavailable when TF sees no such GPU (a CPU-only build such as tensorflow-cpu, or no driver).
        With ``options.data_parallel``, the devices are its (``_prepare_replicas``) and a ``MirroredStrategy`` over
        them is created last."""
        data_parallel = self.options.data_parallel
        if data_parallel is not None:
            self._prepare_replicas(device, data_parallel)
        elif device.startswith("cuda"):
            if (problem := self.device_problem(device)) is not None:
                raise DeviceUnavailable(problem)
            gpus = tf.config.list_physical_devices("GPU")
            index = device_index(device)
            tf.config.set_visible_devices([gpus[index]], "GPU")
            self._configure_gpu_memory(gpus[index])
            # fp32 means fp32: no TF32 in matmuls or convolutions (the other frameworks' defaults differ otherwise);
            # tf32 asks for it.
            tf.config.experimental.enable_tensor_float_32_execution(self._precision() == "tf32")
            self.device, self._gpu = "/GPU:0", True
        else:
            tf.config.set_visible_devices([], "GPU")
            self.device, self._gpu = "/CPU:0", False
        if threads is not None:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.random.set_seed(seed)
        if data_parallel is not None:
            self._strategy = _strategy(self._replica_devices)

    def _prepare_replicas(self, device: str, data_parallel: DataParallel) -> None:
        """The N devices of a data-parallel trial, before TF's context starts. CPU: the one physical CPU split into N
        logical CPU devices, "/cpu:0" ... (https://www.tensorflow.org/api_docs/python/tf/config/
        set_logical_device_configuration); they share the host's memory, TF's CPU allocator (so a
        ``cpu_allocator_cap`` caps them together) and its intra-op thread pool. The CPU's memory cap is the worker's
        process limit, never a logical device configuration, so nothing else configures them. GPUs: "cuda:i" ... made
        visible (then "/gpu:0" ... in increasing physical order), each with ``_configure_gpu_memory`` (a memory
        limit then applies to every GPU: a logical device each) and TF32 as for one GPU. Raises ValueError when the
        devices are not all of ``device``'s kind, DeviceUnavailable when TF lacks one, RuntimeError when TF started
        before (its devices are then fixed)."""
        kind, n = device_kind(device), data_parallel.size
        if any(device_kind(d) != kind for d in data_parallel.devices):
            raise ValueError(f"the data-parallel devices {', '.join(data_parallel.devices)} are not all {kind} "
                             "devices")
        if kind == "cuda":
            for d in data_parallel.devices:
                if (problem := self.device_problem(d)) is not None:
                    raise DeviceUnavailable(problem)
            gpus = tf.config.list_physical_devices("GPU")
            picked = sorted({device_index(d) for d in data_parallel.devices})
            if len(picked) != n:
                raise ValueError(f"the data-parallel devices {', '.join(data_parallel.devices)} repeat a GPU")
            tf.config.set_visible_devices([gpus[i] for i in picked], "GPU")
            for i in picked:
                self._configure_gpu_memory(gpus[i])
            tf.config.experimental.enable_tensor_float_32_execution(self._precision() == "tf32")
            self._replica_devices = tuple(f"/gpu:{i}" for i in range(n))
            self.device, self._gpu = "/GPU:0", True
        else:
            tf.config.set_visible_devices([], "GPU")
            cpu = tf.config.list_physical_devices("CPU")[0]
            try:
                tf.config.set_logical_device_configuration(
                    cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
            except RuntimeError as err:  # "Virtual devices cannot be modified after being initialized"
                raise RuntimeError(
                    f"TensorFlow cannot split the CPU into {n} logical devices: its runtime started before prepare "
                    f"(with {len(tf.config.list_logical_devices('CPU'))} CPU device(s)); TF fixes its devices when "
                    f"it starts ({err})") from err
            self._replica_devices = tuple(f"/cpu:{i}" for i in range(n))
            self.device, self._gpu = "/CPU:0", False

    def _configure_gpu_memory(self, gpu: Any) -> None:
        """The allocator settings of ``options``, applied to the one visible GPU before TF's context starts.

        ``memory_limit_bytes``: a logical device with that ``memory_limit`` (in whole 2^20-byte units, TF's "MB",
        rounded down so that the cap is never above the request;
        https://www.tensorflow.org/api_docs/python/tf/config/set_logical_device_configuration,
        https://www.tensorflow.org/guide/gpu#limiting_gpu_memory_growth). TF refuses memory growth on a device that
        has a logical device configuration (``set_memory_growth`` raises ValueError "Cannot set memory growth on device
        when virtual devices configured", and the GPU options it builds then carry no allow_growth), so with a limit
        growth is not enabled, whatever ``tensorflow_memory_growth`` says, and settings record ``memory_growth``
        False and why: TF's BFC allocator then takes the whole limit from the device at its first allocation.
        Without a limit, ``tensorflow_memory_growth`` (default True) enables growth
        (https://www.tensorflow.org/api_docs/python/tf/config/experimental/set_memory_growth); False leaves TF's
        default, which maps nearly all of the GPU's memory when the context starts."""
        growth = self.options.allocator.tensorflow_memory_growth
        limit = self.options.memory_limit_bytes
        self._memory_settings = {"memory_limit_bytes": None, "memory_growth": growth}
        if limit:
            mib = max(int(limit) // 2**20, 1)
            tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=mib)])
            self._memory_settings = {"memory_limit_bytes": mib * 2**20, "memory_limit_requested_bytes": int(limit),
                                     "memory_growth": False}
            if growth:
                self._memory_settings["memory_growth_skipped"] = (
                    "TensorFlow cannot combine memory growth with a memory limit (logical device configuration)")
        elif growth:
            tf.config.experimental.set_memory_growth(gpu, True)

    def _precision(self) -> str:
        return self.options.precision

    def _mode(self) -> str:
        return self.compile_mode(self.options.compile)

    def build(self, info: Any, weights: dict[str, np.ndarray], optimizer: Any) -> None:
        """Creates float32 ``tf.Variable``s on the device from the canonical ``weights`` (conv OIHW -> HWIO, dense
        (out, in) -> (in, out), rows of the first dense kernel after a flatten of (C, H, W) permuted to the (H, W, C)
        order TF flattens in, and so are the features of a batchnorm between the two; Keras's layers for layernorm
        and attention, their variables set from the canonical ones) and the optimizer state over all of them. A
        trailing softmax is left to the loss. Batchnorm's running statistics are non-trainable variables, from
        ``weights``' buffers if it has them, else ``harness.neutral.models.initial_buffers``. Inputs: NHWC float32
        images, or (B, L) int64 token ids. The compute dtype (``_COMPUTE``) and XLA (``jit_compile``, the "compiled"
        mode) come from ``options``. Data-parallel: every variable is created under the strategy's scope, so it is a
        ``MirroredVariable`` with a copy on each replica's device (batchnorm's running statistics: ``_keep``), except
        the loss sum, an ordinary variable on the first device."""
        self._compute, self._jit = _COMPUTE[self._precision()], self._mode() == "compiled"
        self._params, self._buffers = {}, {}
        self._train_fns, self._train_calls, self._replica_fns = {}, {}, []
        self._batch_fns, self._batch_calls = {}, {}
        self._last_loss = None
        self.next_token, self.tokens = info.task == "next_token", info.task != "image_classification"
        buffers = {**initial_buffers(info), **{k: v for k, v in weights.items() if k in info.buffer_names()}}
        with self._placement():
            flatten_from: tuple[int, int, int] | None = None
            self._forward_layers = []
            for position, layer in enumerate(info.layers):
                fn, flatten_from = self._add_layer(layer, weights, buffers, flatten_from, info.layers[position + 1:])
                self._forward_layers.append(fn)
            self._variables = [v for variables, _ in self._params.values() for v in variables]
            self._update = make_update(optimizer, self._variables)
            self._loss_scale = DynamicLossScale() if self._compute == tf.float16 else None
        with tf.device(self.device):
            # added to inside the train step's function (assign_add), read and zeroed by read_loss
            self._loss_sum, self._loss_steps = tf.Variable(0.0, dtype=tf.float32, trainable=False, name="loss_sum"), 0
        # Evaluation and prediction: a batch dimension of None, so a smaller last batch does not retrace.
        if self.tokens:
            input_spec = tf.TensorSpec((None, *info.input_shape), tf.int64)
            label_spec = tf.TensorSpec((None, *info.input_shape) if self.next_token else (None,), tf.int64)
        else:
            c, h, w = info.input_shape
            input_spec, label_spec = tf.TensorSpec((None, h, w, c), tf.float32), tf.TensorSpec((None,), tf.int64)
        # one sample's input shape and dtype and its labels' shape, as a loader's batches carry them (open_loader)
        self._sample_specs = (tuple(input_spec.shape[1:]), input_spec.dtype, tuple(label_spec.shape[1:]))
        if self._strategy is not None and self._jit:  # see _replica_step
            self._replica_fns = [tf.function(self._replica_gradients, jit_compile=True, autograph=False),
                                 tf.function(self._apply, jit_compile=True, autograph=False)]
        # Data-parallel with batchnorm, evaluation reads the running statistics' mean over the replicas' copies,
        # which lie on N devices, so it is not XLA-compiled: an XLA cluster reads variables of its own device only.
        jit = self._jit and not (self._strategy is not None and self._buffers)
        self._logits_fn = tf.function(self._logits, input_signature=[input_spec], jit_compile=jit, autograph=False)
        self._eval_fn = tf.function(self._eval_batch, input_signature=[input_spec, label_spec], jit_compile=jit,
                                    autograph=False)

    def _keep(self, name: str, value: np.ndarray, to_canonical: Any = _same, trainable: bool = True) -> tf.Variable:
        """A float32 variable named ``name`` holding ``value`` (already in TF's layout), registered as the canonical
        parameter (or, not ``trainable``, buffer) ``name`` that ``to_canonical`` of its value gives back.

        Data-parallel, a buffer (batchnorm's running statistics) is a sync-on-read variable with MEAN aggregation
        (https://www.tensorflow.org/api_docs/python/tf/VariableSynchronization, what tf.keras 2's BatchNormalization
        used): each replica updates its own copy from its own batch statistics, with no communication in the step,
        and a read in the cross-replica context (``get_buffers``, ``evaluate``, ``predict``, all under the strategy's
        scope) is the mean of the copies. The update being linear in the batch statistics, that mean is (1 - momentum)
        * running + momentum * (the mean over the replicas of their shards' statistics): the global batch's mean for
        ``running_mean``, the mean of the shards' unbiased variances for ``running_var``; with sync batchnorm every
        copy is the same. (Keras 3's BatchNormalization creates them with aggregation "none", so that each copy is
        its own replica's and a read gives the first device's.)"""
        sync: dict[str, Any] = {}
        if not trainable and self._strategy is not None:
            sync = {"synchronization": tf.VariableSynchronization.ON_READ, "aggregation": tf.VariableAggregation.MEAN}
        variable = tf.Variable(value, trainable=trainable, name=name, **sync)
        (self._params if trainable else self._buffers)[name] = ((variable,), to_canonical)
        return variable

    def _add_layer(self, layer: Any, weights: dict[str, np.ndarray], buffers: dict[str, np.ndarray],
                   flatten_from: tuple[int, int, int] | None, following: Any = ()
                   ) -> tuple[L.Layer, tuple[int, int, int] | None]:
        """One layer's or block's variables (TF layout, under canonical names) and forward function; also the
        (C, H, W) shape the next dense layer's input was flattened from in (H, W, C) order, or None. ``following``:
        the top-level layers after this one (a flatten looks ahead, ``flatten_feeds_dense``)."""
        spec, kind, name = layer.spec, layer.kind, layer.name
        w, b = f"{name}.weight", f"{name}.bias"
        if kind == "residual":  # its input is never an (H, W, C)-ordered flatten: see flatten_feeds_dense
            body = [self._add_layer(child, weights, buffers, None)[0] for child in layer.body]
            shortcut = [self._add_layer(child, weights, buffers, None)[0] for child in layer.shortcut]
            return L.residual(body, shortcut, spec.activation), None
        if kind == "conv2d":
            kernel = self._keep(w, _f32(weights[w]).transpose(2, 3, 1, 0), lambda k: k.transpose(3, 2, 0, 1))  # HWIO
            bias = self._keep(b, _f32(weights[b])) if spec.use_bias else None
            return L.conv(kernel, bias, spec.stride, spec.padding, spec.activation, self._compute), None
        if kind == "dense":  # on (B, F), or per position on (B, L, D)
            weight, inverse = _f32(weights[w]), None
            if flatten_from is not None:
                perm = chw_to_hwc_permutation(flatten_from)
                weight, inverse = weight[:, perm], np.argsort(perm)
            kernel = self._keep(w, np.ascontiguousarray(weight.T),  # (out, in) -> (in, out); undo the HWC rows
                                lambda k, inv=inverse: k.T if inv is None else k.T[:, inv])
            return L.dense(kernel, self._keep(b, _f32(weights[b])), spec.activation, self._compute), None
        if kind == "batchnorm":
            return self._add_batchnorm(layer, weights, buffers, flatten_from), flatten_from
        if kind in ("layernorm", "attention"):
            return self._add_keras_layer(layer, weights), None
        if kind == "embedding":
            token, position = (self._keep(f"{name}.{table}.weight", _f32(weights[f"{name}.{table}.weight"]))
                               for table in ("token", "position"))
            return L.embedding(token, position, self._compute), None
        if kind in ("maxpool2d", "avgpool2d"):
            op = tf.nn.max_pool2d if kind == "maxpool2d" else tf.nn.avg_pool2d
            return L.pool(op, spec.pool_size, spec.stride or spec.pool_size), None
        if kind == "global_avgpool2d":
            # (N, H, W, C) -> (N, C): channel order, the canonical one, so no permutation follows.
            return (lambda x, training: tf.reduce_mean(x, axis=(1, 2))), None
        if kind == "sequence_pool":
            return L.sequence_pool(spec.mode), None
        if kind == "flatten":
            features = int(np.prod(layer.input_shape))
            if len(layer.input_shape) == 3 and flatten_feeds_dense(following):
                return L.flatten(features, channels_first=False), tuple(layer.input_shape)  # NHWC: (H, W, C) order
            return L.flatten(features, channels_first=len(layer.input_shape) == 3), None
        if kind == "dropout":
            return L.dropout(spec.rate), flatten_from
        if kind in ("relu", "gelu"):
            return (lambda x, training: L.activate(x, kind)), flatten_from
        if kind == "softmax":
            return (lambda x, training: x), flatten_from  # folded into the cross-entropy loss
        raise ValueError(f"the tensorflow adapter cannot build {kind} layers")

    def _add_batchnorm(self, layer: Any, weights: dict[str, np.ndarray], buffers: dict[str, np.ndarray],
                       flatten_from: tuple[int, int, int] | None) -> L.Layer:
        """Channels are the last axis in NHWC, so gamma, beta and the statistics need no transposition; after a
        channel-last flatten (``flatten_from``) the features are in (H, W, C) order and are permuted like the next
        dense layer's rows."""
        name, spec, flat = layer.name, layer.spec, len(layer.input_shape) == 1
        perm = chw_to_hwc_permutation(flatten_from) if flat and flatten_from is not None else None
        inverse = None if perm is None else np.argsort(perm)
        back = _same if inverse is None else (lambda a: a[inverse])

        def tf_order(array: np.ndarray) -> np.ndarray:
            return _f32(array) if perm is None else np.ascontiguousarray(_f32(array)[perm])
        gamma, beta = (self._keep(f"{name}.{p}", tf_order(weights[f"{name}.{p}"]), back) for p in ("weight", "bias"))
        mean, var = (self._keep(f"{name}.{stat}", tf_order(buffers[f"{name}.{stat}"]), back, trainable=False)
                     for stat in ("running_mean", "running_var"))
        sync = self.options.data_parallel is not None and self.options.data_parallel.sync_batchnorm
        return L.batchnorm(gamma, beta, mean, var, spec.momentum, spec.epsilon, flat, self._compute, sync)

    def _add_keras_layer(self, layer: Any, weights: dict[str, np.ndarray]) -> L.Layer:
        """Layernorm or attention: Keras's layer with its variables set from the canonical weights, those variables
        registered under the canonical names (``layers.layer_norm``, ``.multi_head_attention``)."""
        spec, name = layer.spec, layer.name
        canonical = {local: _f32(weights[f"{name}.{local}"]) for local in layer.params}
        if layer.kind == "layernorm":
            fn, held = L.layer_norm(layer.input_shape, spec.epsilon, canonical["weight"], canonical["bias"],
                                    self._compute)
        else:
            length, dim = layer.input_shape
            fn, held = L.multi_head_attention(length, dim, spec.heads, spec.causal, canonical, self._compute)
        self._params.update({f"{name}.{local}": held[local] for local in layer.params})
        return fn

    def _forward(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        """The model on ``x``; ``training`` (a Python bool, fixed when a function is traced) selects batchnorm's batch
        statistics and running-statistics update, and dropout. The logits are float32 in every precision."""
        for fn in self._forward_layers:
            x = fn(x, training)
        return L.to(x, tf.float32)

    def _placement(self) -> Any:
        """Where ``build`` creates the model's and the optimizer's variables: under the strategy's scope when
        data-parallel (mirrored on every replica's device), else on the device."""
        return self._strategy.scope() if self._strategy is not None else tf.device(self.device)

    @contextlib.contextmanager
    def _on_first_device(self) -> Any:
        """Evaluation, prediction and the state read: on the (first) device, and data-parallel in the strategy's
        cross-replica context, where a mirrored variable reads as the first device's copy and a sync-on-read one
        (batchnorm's running statistics, ``_keep``) as the mean of the copies."""
        with contextlib.ExitStack() as stack:
            if self._strategy is not None:
                stack.enter_context(self._strategy.scope())
            stack.enter_context(tf.device(self.device))
            yield

    def _logits(self, x: tf.Tensor) -> tf.Tensor:
        with self._on_first_device():
            return self._forward(x, training=False)

    def _eval_batch(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        with self._on_first_device():
            logits = self._forward(x, training=False)
            loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)  # (B,) or (B, L)
            correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=-1), y), tf.int64))
            return tf.reduce_sum(tf.cast(loss, tf.float64)), correct

    def _train(self, indices: tf.Tensor) -> tf.Tensor:
        """One step on the resident samples ``indices`` (int64 (B,)): their batch gathered on the device, then
        ``_train_on``."""
        with tf.device(self.device):
            return self._train_on(tf.gather(self.x_train, indices), tf.gather(self.y_train, indices))

    def _train_on(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        """One step on the batch ``x`` (float32 (B, H, W, C) images or int64 (B, L) tokens), ``y`` (int64 (B,) or
        (B, L)) on the device, the body of a step's function (resident mode gathers the batch, ``_train``; a loader
        brings it, ``train_batch``); the loss is the mean over the samples, or over every position of a next-token
        model's (B, L) labels (``sparse_softmax_cross_entropy_with_logits`` takes (B, L, V) logits as they are)."""
        with tf.device(self.device):
            with tf.GradientTape() as tape:
                logits = self._forward(x, training=True)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
                scaled = loss if self._loss_scale is None else self._loss_scale.scale_loss(loss)
            self._apply(self._gradients(tape, scaled))
            self._loss_variable().assign_add(tf.cast(loss, tf.float32))
            return loss

    def _gradients(self, tape: tf.GradientTape, loss: tf.Tensor) -> list[tf.Tensor]:
        """The float32 gradients of ``loss`` (scaled in fp16) for every variable, dense, and unscaled in fp16."""
        grads = dense_gradients(tape.gradient(loss, self._variables))
        return grads if self._loss_scale is None else self._loss_scale.unscale(grads)

    def _loss_variable(self) -> tf.Variable:
        """The loss sum variable ``build`` created (checked while a step's function is traced)."""
        if self._loss_sum is None:
            raise RuntimeError("the TensorFlow adapter's train step ran before build")
        return self._loss_sum

    def _apply(self, grads: list[tf.Tensor]) -> None:
        """The optimizer update with ``grads``; in fp16 only when they are all finite (``DynamicLossScale``)."""
        if self._loss_scale is None:
            self._update(grads)
        else:
            self._loss_scale.apply(grads, self._update)

    def _train_accumulated(self, indices: tf.Tensor, micro_batches: int) -> tf.Tensor:
        """Gradient accumulation on the resident samples ``indices`` (int64 (B,)): ``_accumulate`` with micro-batch i
        gathered on the device from row i of ``indices`` reshaped to (k, B / k), inside the loop (one micro-batch's
        samples at a time)."""
        with tf.device(self.device):
            parts = tf.reshape(indices, (micro_batches, -1))

            def micro_batch(i: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
                part = tf.gather(parts, i)
                return tf.gather(self.x_train, part), tf.gather(self.y_train, part)

            return self._accumulate(micro_batch, micro_batches)

    def _train_on_accumulated(self, x: tf.Tensor, y: tf.Tensor, micro_batches: int) -> tf.Tensor:
        """Gradient accumulation on a loader's batch ``x``, ``y`` (``_train_on``'s shapes): ``_accumulate`` with
        micro-batch i the i-th of k consecutive slices of B / k samples (``x`` reshaped to (k, B / k, ...))."""
        with tf.device(self.device):
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
        with tf.device(self.device):

            def body(i: tf.Tensor, loss_sum: tf.Tensor, *grad_sums: tf.Tensor) -> tuple[tf.Tensor, ...]:
                x, y = micro_batch(i)
                with tf.GradientTape() as tape:
                    logits = self._forward(x, training=True)
                    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)) / k
                    scaled = loss if self._loss_scale is None else self._loss_scale.scale_loss(loss)
                grads = self._gradients(tape, scaled)
                return (i + 1, loss_sum + loss, *[s + g for s, g in zip(grad_sums, grads)])

            start = (tf.constant(0), tf.zeros((), tf.float32), *[tf.zeros_like(v) for v in self._variables])
            _, loss, *grads = tf.while_loop(lambda i, *_: i < k, body, start, parallel_iterations=1,
                                            maximum_iterations=k)
            self._apply(grads)  # in fp16 a non-finite gradient of any micro-batch makes its sum non-finite
            self._loss_variable().assign_add(tf.cast(loss, tf.float32))  # the mean of the k micro-batches' means
            return loss

    def _train_replicated(self, indices: tf.Tensor) -> tf.Tensor:
        """One data-parallel step, the body of the step's ``tf.function`` (the cross-replica context): replica d
        trains on ``shard(indices, N, d)``, the d-th contiguous B / N of the global batch, given to it as a per-replica
        value (``experimental_distribute_values_from_function``, https://www.tensorflow.org/api_docs/python/tf/
        distribute/Strategy#experimental_distribute_values_from_function), ``strategy.run`` runs ``_replica_step`` on
        every replica (https://www.tensorflow.org/api_docs/python/tf/distribute/Strategy#run), and the global batch's
        mean loss, which every replica returns, is added to the loss sum on the first device."""
        strategy = self._strategy
        assert strategy is not None
        n, batch = strategy.num_replicas_in_sync, int(indices.shape[0])
        bounds = [(int(part[0]), int(part[-1]) + 1) for part in (shard(np.arange(batch), n, d) for d in range(n))]
        shards = strategy.experimental_distribute_values_from_function(
            lambda context: indices[bounds[context.replica_id_in_sync_group][0]:
                                    bounds[context.replica_id_in_sync_group][1]])
        loss = strategy.experimental_local_results(strategy.run(self._replica_step, args=(shards,)))[0]
        with tf.device(self.device):
            self._loss_variable().assign_add(loss)
        return loss

    def _replica_step(self, indices: tf.Tensor) -> tf.Tensor:
        """One replica's part of a data-parallel step (the replica context, on its device): its shard gathered, the
        gradients of its loss (``_replica_gradients``), one all-reduce that sums them and the loss over the replicas
        (``ReplicaContext.all_reduce``, https://www.tensorflow.org/api_docs/python/tf/distribute/
        ReplicaContext#all_reduce: the strategy's cross-device ops), then the update (``_apply``) of this replica's
        copies of the variables with the summed gradients: every replica applies the same update to identical
        copies, so they stay identical (the variables have aggregation NONE, so an assignment in the replica
        context goes to the replica's own copy, with no further communication). In the compiled mode the gradients
        and the update are each an XLA-compiled function (``_replica_fns``); the gather and the all-reduce are not
        (an XLA cluster lies on one device, and MirroredStrategy's all-reduce is a ``merge_call`` on CPUs, which
        cannot be inside a nested ``tf.function``). Returns the global batch's mean loss."""
        replica = tf.distribute.get_replica_context()
        x = tf.gather(self.x_train, indices)
        y = tf.gather(self.y_train, indices)
        count = int(np.prod(y.shape)) * replica.num_replicas_in_sync  # samples, or positions, of the global batch
        gradients, update = self._replica_fns if self._replica_fns else (self._replica_gradients, self._apply)
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
            logits = self._forward(x, training=True)
            per_sample = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            loss = tf.reduce_sum(per_sample) / count
            scaled = loss if self._loss_scale is None else self._loss_scale.scale_loss(loss)
        return tf.cast(loss, tf.float32), self._gradients(tape, scaled)

    def load(self, data: Any) -> None:
        """Copies the four arrays to the device once, placed under ``tf.device``: NHWC float32 images or (N, L) int64
        token ids, int64 labels ((N,), or (N, L) for a next-token model). The training inputs are a non-trainable
        ``tf.Variable`` so that set_train_images can overwrite images in place (``assign``) without re-tracing the
        train step; the rest are ``tf.constant``s. Data-parallel on GPUs, the training inputs are mirrored variables,
        a copy on each GPU, from which each replica gathers its shard; on the CPU there is one copy, on the first
        logical device, since the logical devices share the host's memory (TF hands a host tensor from one to another
        without copying it). With ``options.input == "loader"`` the test set only (the training batches come from
        ``open_loader``'s pipeline)."""
        dtype = np.int64 if self.tokens else np.float32
        mirrored = self._strategy is not None and self._gpu
        if self.options.input == "resident":
            with self._strategy.scope() if mirrored and self._strategy is not None else tf.device(self.device):
                self.x_train = tf.Variable(data.x_train.astype(dtype, copy=False), trainable=False, name="x_train")
                self.y_train = (tf.Variable(data.y_train.astype(np.int64), trainable=False, name="y_train")
                                if mirrored else tf.constant(data.y_train, dtype=tf.int64))
        with tf.device(self.device):
            self.x_test = tf.constant(data.x_test, dtype=dtype)
            self.y_test = tf.constant(data.y_test, dtype=tf.int64)
        self._train_fns, self._train_calls = {}, {}  # the train step captures the training tensors when it is traced
        self._batch_fns, self._batch_calls = {}, {}
        self._compilations = 0  # tracings of train step functions (tf.function's experimental_get_tracing_count)

    def set_train_images(self, images: np.ndarray) -> None:
        """Overwrites the training images (float32 NHWC) in place with ``tf.Variable.assign`` (data-parallel on GPUs,
        every copy: an assignment in the cross-replica context)."""
        with self._on_first_device():
            self.x_train.assign(images.astype(np.float32, copy=False))

    def stage_epoch(self, order: np.ndarray, samples_per_step: int) -> None:
        """Moves the epoch's index batches to the device now, one int64 tensor per step (``Adapter.stage_epoch``):
        a concrete function called with a numpy array converts it at every call, which measured about 80 us more
        per call than a tensor argument on the CPU (benchmarks/harness_vs_loop.py; 10 % of a step of the digits CNN
        at batch 64). ``train_step`` uses the staged tensor of its ``position``, or converts ``indices`` without one."""
        order = np.ascontiguousarray(order, dtype=np.int64)
        with tf.device(self.device):
            self._staged = [tf.constant(order[start:start + samples_per_step])
                            for start in range(0, len(order) - samples_per_step + 1, samples_per_step)]

    def _indices_tensor(self, indices: np.ndarray, position: int | None) -> tf.Tensor:
        """The staged tensor of step ``position`` of the epoch (``stage_epoch``), else a new one of ``indices``."""
        staged = self._staged[position] if position is not None and 0 <= position < len(self._staged) else None
        if staged is not None and staged.shape[0] == len(indices):
            return staged
        return tf.constant(indices, dtype=tf.int64)

    def train_step(self, indices: np.ndarray, micro_batches: int = 1, position: int | None = None) -> None:
        """One step on ``indices`` (int64 (B,)): gather, forward, ``tf.GradientTape`` gradients and the optimizer
        update in one ``tf.function`` with a fully static ``input_signature``, traced on the first call with each (B,
        micro_batches) and never again (https://www.tensorflow.org/guide/function#controlling_retracing). With
        ``micro_batches`` k > 1 the gradients of k micro-batches of B / k are summed inside that function
        (``_train_accumulated``). In the "compiled" mode the function is XLA-compiled (``jit_compile=True``) when it
        is first called. Data-parallel (``_train_replicated``): the N replicas each train on their shard of
        ``indices`` within that one function, which the compiled mode does not XLA-compile whole (its parts:
        ``_replica_step``); no accumulation then (ValueError)."""
        if self._strategy is not None and micro_batches != 1:
            raise ValueError("gradient accumulation with data parallelism is not supported")
        key = (len(indices), micro_batches)
        fn = self._train_calls.get(key)
        if fn is None:
            signature = [tf.TensorSpec((len(indices),), tf.int64)]
            if self._strategy is not None:
                shard(np.asarray(indices), self._strategy.num_replicas_in_sync, 0)  # ValueError for an uneven split
                python_fn = self._train_replicated
            elif micro_batches == 1:
                python_fn = self._train
            else:
                micro_batch_size(len(indices), micro_batches)  # raises ValueError for an uneven split
                python_fn = functools.partial(self._train_accumulated, micro_batches=micro_batches)
            fn = self._trace(python_fn, signature, key, self._train_fns, self._train_calls)
        self._last_loss = fn(self._indices_tensor(indices, position))  # the function also adds it to the loss sum
        self._loss_steps += 1

    def _trace(self, python_fn: Callable[..., tf.Tensor], signature: list[tf.TensorSpec], key: tuple[int, int],
               functions: dict[tuple[int, int], Any], calls: dict[tuple[int, int], Any]) -> Any:
        """``python_fn`` as a step's ``tf.function`` with the fully static ``signature`` (XLA-compiled in the compiled
        mode, one device), traced now and counted in ``compilations``; kept under ``key`` in ``functions``, and its
        concrete function in ``calls``, which is returned: what a step calls. The concrete function is called
        directly because a tf.function's own call matches its arguments against its signature every time (measured
        on the CPU: 400 us a call against 225 us for the concrete function, about 5 % of a step at batch 64;
        benchmarks/harness_vs_loop.py)."""
        function = tf.function(python_fn, input_signature=signature, autograph=False,
                               jit_compile=self._jit and self._strategy is None)
        functions[key], calls[key] = function, function.get_concrete_function()
        self._compilations += function.experimental_get_tracing_count()
        return calls[key]

    # -- input: loader ---------------------------------------------------------------------------------------------

    def open_loader(self, source: Any) -> None:
        """Keeps ``source`` (``harness.neutral.inputs.InputSource``) for the ``tf.data`` pipeline that
        ``epoch_batches`` builds each epoch as TensorFlow's input-pipeline guide recommends
        (https://www.tensorflow.org/guide/data_performance): ``tf.data.Dataset.from_tensor_slices`` of the epoch's
        index batches (int64 (steps, B)), ``map`` of a function that reads one whole step with ``source.read``
        (through ``tf.numpy_function``: the harness's reader, Pillow for an image folder's files), giving the batch
        static shapes, with ``num_parallel_calls`` = ``options.loader.workers`` and ``deterministic=True`` (batches in
        order) or, with 0 workers, a sequential ``map`` (no ``num_parallel_calls``), then ``prefetch`` of
        ``options.loader.prefetch`` batches (https://www.tensorflow.org/api_docs/python/tf/data/Dataset#map,
        #prefetch). Every read runs in this process, on tf.data's threads: ``tf.numpy_function`` holds the GIL
        while its Python function runs (https://www.tensorflow.org/api_docs/python/tf/numpy_function), so parallel
        reads overlap only where numpy and Pillow release it, and they contend with the training loop's own Python.
        Records the settings under ``settings()["loader"]``."""
        if self._strategy is not None:
            raise ValueError("the tensorflow adapter's loader does not feed a data-parallel trial (input_gap)")
        workers, prefetch = self.options.loader.workers, self.options.loader.prefetch
        self._source = source
        self._loader_settings = {
            "loader": "tf.data.Dataset", "num_parallel_calls": workers or None, "prefetch": prefetch,
            "deterministic": True, "source": "files" if source.from_files else "memory",
            "read": "tf.numpy_function (the harness's reader, Pillow for files)"}

    def epoch_batches(self, order: np.ndarray, samples_per_step: int, epoch: int) -> Iterator[Any]:
        """The batches of epoch ``epoch`` (``Adapter.epoch_batches``): the pipeline of ``open_loader`` over ``order``
        (int64 (N,)) cut into whole steps of ``samples_per_step``, with ``epoch`` a constant of its read (the
        augmentation's draws), iterated in this eager context: each batch is (x, y), float32 (B, H, W, C) images or
        int64 (B, L) tokens and int64 (B,) or (B, L) labels, with static shapes, so that ``train_batch``'s function
        is traced once. On a GPU each batch is then copied to the device (``tf.identity`` under ``tf.device``)
        before the step's function is called; on the CPU the pipeline's tensors are already there. The pipeline is
        built, and its iterator started, when the epoch's first batch is asked for, as a training loop's ``for x, y
        in dataset`` starts each epoch: 5 to 30 ms on the CPU (measured with TF 2.21, mostly the iterator's start),
        counted in that step's wait for its input."""
        if self._source is None:
            raise RuntimeError("epoch_batches before open_loader")
        steps = len(order) // samples_per_step
        index_batches = np.ascontiguousarray(order[:steps * samples_per_step], dtype=np.int64).reshape(
            steps, samples_per_step)
        x_shape, x_dtype, y_shape = self._sample_specs
        read = _Reader(self._source, x_dtype.as_numpy_dtype)
        workers, prefetch = self.options.loader.workers, self.options.loader.prefetch

        def read_batch(indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            # stateful (the default): tf.data's map_parallelization optimization, on by default, would run a
            # stateless map in parallel even with 0 workers (tf.data.experimental.OptimizationOptions)
            x, y = tf.numpy_function(read, [indices, tf.constant(epoch, tf.int64)], (x_dtype, tf.int64),
                                     stateful=True, name="read")
            x.set_shape((samples_per_step, *x_shape))
            y.set_shape((samples_per_step, *y_shape))
            return x, y

        dataset = tf.data.Dataset.from_tensor_slices(index_batches)
        if workers:
            dataset = dataset.map(read_batch, num_parallel_calls=workers, deterministic=True)
        else:
            dataset = dataset.map(read_batch)
        for x, y in dataset.prefetch(prefetch):
            if self._gpu:
                with tf.device(self.device):
                    x, y = tf.identity(x), tf.identity(y)
            yield x, y

    def train_batch(self, batch: Any, micro_batches: int = 1) -> None:
        """One step on a loader's batch (x, y) from ``epoch_batches``: the shared step (``_train_on``, or with
        ``micro_batches`` k > 1 ``_accumulate`` over k consecutive slices of B / k) in a ``tf.function`` whose
        ``input_signature`` is the batch's static shapes, traced on the first call with each (B, micro_batches) and
        never again, as ``train_step``'s (and XLA-compiled in the compiled mode). Not data-parallel (ValueError):
        ``adapters.base.input_gap`` refuses a loader there."""
        if self._strategy is not None:
            raise ValueError("the tensorflow adapter's loader does not feed a data-parallel trial (input_gap)")
        x, y = batch
        key = (int(x.shape[0]), micro_batches)
        fn = self._batch_calls.get(key)
        if fn is None:
            micro_batch_size(key[0], micro_batches)  # raises ValueError for an uneven split
            python_fn = (self._train_on if micro_batches == 1 else
                         functools.partial(self._train_on_accumulated, micro_batches=micro_batches))
            signature = [tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(y.shape, y.dtype)]
            fn = self._trace(python_fn, signature, key, self._batch_fns, self._batch_calls)
        self._last_loss = fn(x, y)  # the function also adds it to the loss sum
        self._loss_steps += 1

    def compilations(self) -> int | None:
        """Tracings of train step functions (``tf.function.experimental_get_tracing_count``; in the compiled mode each
        traced graph is also XLA-compiled once, on its first call); data-parallel in the compiled mode also those of
        the XLA-compiled per-replica functions (``_replica_step``), traced once per replica with the step."""
        return self._compilations + sum(fn.experimental_get_tracing_count() for fn in self._replica_fns)

    def wait(self) -> None:
        """Blocks until queued work is done: ``sync_devices`` on a GPU
        (https://www.tensorflow.org/api_docs/python/tf/test/experimental/sync_devices), then the last step's loss
        copied to the host (``.numpy()``, the window's end edge as before sums; nothing is restarted). On the CPU,
        eager TF is synchronous."""
        if self._gpu:
            tf.test.experimental.sync_devices()
        if self._last_loss is not None:
            self._last_loss.numpy()

    def _take_loss_sum(self) -> float:
        """The sum variable's value (``.numpy()``) and ``assign(0)``."""
        variable = self._loss_variable()
        total = float(variable.numpy())
        variable.assign(0.0)
        return total

    def evaluate(self, batch_size: int) -> tuple[float, float]:
        """(mean cross-entropy, accuracy in [0, 1]) over the test set (over every position of every sequence for a
        next-token model) in batches of ``batch_size``; per-batch sums are accumulated on the device in float64 and
        read once at the end. Data-parallel: the first device's copy of the model, with batchnorm's running statistics
        read as the mean of the replicas' copies (``_keep``), over the whole test set on the first device."""
        n = int(self.x_test.shape[0])
        with self._on_first_device():
            total_loss = tf.zeros((), tf.float64)
            correct = tf.zeros((), tf.int64)
            for start in range(0, n, batch_size):
                stop = start + batch_size
                loss, right = self._eval_fn(self.x_test[start:stop], self.y_test[start:stop])
                total_loss += loss
                correct += right
        count = self.y_test.shape.num_elements()  # samples, or every position of every sequence
        return float(total_loss.numpy()) / count, float(correct.numpy()) / count

    def predict(self, images: np.ndarray) -> np.ndarray:
        """float32 logits, (N, classes), for float32 NHWC ``images`` (N, H, W, C) or int64 (N, L) token ids; (N, L,
        vocab) for a next-token model."""
        with self._on_first_device():
            x = tf.constant(np.asarray(images, dtype=np.int64 if self.tokens else np.float32))
            return self._logits_fn(x).numpy()

    def get_weights(self) -> dict[str, np.ndarray]:
        """Copies of the current parameters under their canonical names, in the canonical layout: the exact inverse
        of ``build``'s conversion (HWIO -> OIHW, (in, out) -> (out, in), the HWC order undone, Keras's attention
        kernels joined into the fused in-projection). Data-parallel: the first device's copies."""
        with self._on_first_device():
            return {name: _canonical(held) for name, held in self._params.items()}

    def get_buffers(self) -> dict[str, np.ndarray]:
        """Copies of batchnorm's running statistics under their canonical names ("<name>.running_mean",
        "<name>.running_var"), in the canonical feature order. Data-parallel: the mean of the replicas' copies
        (``_keep``)."""
        with self._on_first_device():
            return {name: _canonical(held) for name, held in self._buffers.items()}

    def reset_memory_stats(self) -> None:
        """Restarts the GPU allocator's peak (https://www.tensorflow.org/api_docs/python/tf/config/experimental/
        reset_memory_stats), of every GPU of a data-parallel trial. Nothing on the CPU, which has no allocator
        statistics."""
        for gpu in self._gpu_names():
            tf.config.experimental.reset_memory_stats(gpu)

    def _gpu_names(self) -> list[str]:
        """The GPUs this adapter trains on, as ``get_memory_info`` names them: "GPU:0", ... (none on the CPU)."""
        if not self._gpu:
            return []
        return [f"GPU:{i}" for i in range(max(len(self._replica_devices), 1))]

    def memory_stats(self) -> dict[str, int]:
        """On a GPU, ``allocator_peak_bytes``: the BFC allocator's peak bytes in use by tensors since the last
        ``reset_memory_stats`` (``get_memory_info(...)["peak"]``,
        https://www.tensorflow.org/api_docs/python/tf/config/experimental/get_memory_info). TF does not expose the
        bytes the allocator reserved from the device, so ``allocator_reserved_peak_bytes`` is absent. ``{}`` on the
        CPU, where TF keeps no such statistics: ``get_memory_info("CPU:0")`` raises ValueError "Allocator stats not
        available". Data-parallel: the largest of the GPUs' peaks (each holds a replica)."""
        if not self._gpu:
            return {}
        return {"allocator_peak_bytes": max(int(tf.config.experimental.get_memory_info(gpu)["peak"])
                                            for gpu in self._gpu_names())}

    def cpu_allocator_peak(self) -> int | None:
        """The CPU BFC allocator's peak bytes since it was created (``get_memory_info("CPU:0")["peak"]``), which TF
        keeps only when the worker's memory limit put CPU tensors in a BFC allocator
        (``DECLARATION.cpu_allocator_cap``); None otherwise, or when TF is already shutting down."""
        try:
            return int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
        except Exception:  # noqa: BLE001 - no BFC allocator on the CPU, or TF already shutting down
            return None

    def settings(self) -> dict[str, Any]:
        """Threads, data format, the precision ("precision", "compute_dtype"), the execution mode ("compile",
        "jit_compile"), the optimizer's implementation and, in fp16, the loss scale now ("loss_scale"); on a GPU
        also the allocator settings and whether TF32 is on; data-parallel, the replicas' devices
        ("data_parallel_devices"), the strategy's cross-device ops ("cross_device_ops") and "sync_batchnorm"; with
        ``input: loader`` the tf.data pipeline's settings ("loader", ``open_loader``)."""
        intra = tf.config.threading.get_intra_op_parallelism_threads()
        inter = tf.config.threading.get_inter_op_parallelism_threads()
        out: dict[str, Any] = {"intra_op_threads": intra or _default_threads(),  # 0 is TF's "all schedulable CPUs"
                               "inter_op_threads": inter or _default_threads(),
                               "data_format": "NHWC", "precision": self._precision(),
                               "compute_dtype": self._compute.name, "compile": self._mode(), "jit_compile": self._jit,
                               "optimizer_impl": "PyTorch semantics on ResourceApplyMomentum/Adam",
                               "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "")}
        if self._loss_scale is not None:
            out["loss_scale"] = float(self._loss_scale.scale.numpy())
        if self._gpu:
            out.update(self._memory_settings)
            out["TF_GPU_ALLOCATOR"] = os.environ.get("TF_GPU_ALLOCATOR", "")
            out["allow_tf32"] = tf.config.experimental.tensor_float_32_execution_enabled()
        if self._strategy is not None and self.options.data_parallel is not None:
            ops = getattr(self._strategy.extended, "_cross_device_ops", None)  # what MirroredStrategy chose
            options = getattr(ops, "_options", None)
            implementation = getattr(getattr(options, "implementation", None), "name", "")
            out["data_parallel_devices"] = list(self._replica_devices)
            out["cross_device_ops"] = type(ops).__name__ + (f" ({implementation})" if implementation else "")
            out["sync_batchnorm"] = self.options.data_parallel.sync_batchnorm
        if self._loader_settings:
            out["loader"] = self._loader_settings
        return out

    def unsupported(self, info: Any) -> str | None:
        """``support_gap``'s reason, and, data-parallel in the compiled mode, a model with batchnorm and sync
        batchnorm asked for: its all-reduce of the moments lies inside the forward pass, which is XLA-compiled per
        replica there (``_replica_step``), and MirroredStrategy's all-reduce (a ``merge_call`` on CPUs) cannot run
        inside that nested function."""
        reason = super().unsupported(info)
        data_parallel = self.options.data_parallel
        if (reason is None and data_parallel is not None and data_parallel.sync_batchnorm and self._mode() == "compiled"
                and info.buffer_names()):
            return ("the tensorflow adapter has no sync batchnorm in the compiled mode: the all-reduce of the batch "
                    "statistics would lie inside the XLA-compiled forward pass of each replica, where "
                    "MirroredStrategy cannot all-reduce (use the eager mode, or per-device batchnorm)")
        return reason

    def is_oom(self, exc: BaseException) -> bool:
        # tf.errors.ResourceExhaustedError is what TF raises when an allocator refuses a tensor, on the CPU and the GPU
        # (https://www.tensorflow.org/api_docs/python/tf/errors/ResourceExhaustedError). A host-to-GPU copy that finds
        # no room raises InternalError "Dst tensor is not initialized." instead (tensorflow/tensorflow#7025), which has
        # no type of its own, so that one is recognised by its message.
        if isinstance(exc, tf.errors.ResourceExhaustedError):
            return True
        return isinstance(exc, tf.errors.InternalError) and "Dst tensor is not initialized" in str(exc)


#: The process's MirroredStrategy of each device list (``_strategy``).
_STRATEGIES: dict[tuple[str, ...], tf.distribute.MirroredStrategy] = {}


def _strategy(devices: tuple[str, ...]) -> tf.distribute.MirroredStrategy:
    """The ``tf.distribute.MirroredStrategy`` over ``devices`` (https://www.tensorflow.org/api_docs/python/tf/
    distribute/MirroredStrategy; its default cross-device ops are CollectiveAllReduce, RING on CPUs and NCCL on
    physical GPUs), one per process: every MirroredStrategy numbers its collective ops from the same keys (group 1,
    instances from 100), so the all-reduces of a second one over the same devices in the process would be matched
    with the first's ("Shape mismatch in the collective instance 100"). A worker trains one trial; tests build
    several adapters in one process."""
    if devices not in _STRATEGIES:
        _STRATEGIES[devices] = tf.distribute.MirroredStrategy(list(devices))
    return _STRATEGIES[devices]


class _Reader:
    """The ``tf.numpy_function`` of a loader's read: ``source.read(indices, epoch)`` (int64 (B,) indices, the epoch
    an int64 scalar) as (x in ``dtype``, int64 labels), the dtypes the pipeline declares."""

    def __init__(self, source: Any, dtype: Any):
        self.source, self.dtype = source, dtype

    def __call__(self, indices: np.ndarray, epoch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.source.read(indices, int(epoch))
        return x.astype(self.dtype, copy=False), y.astype(np.int64, copy=False)


def _canonical(held: L.Held) -> np.ndarray:
    """The canonical array of a parameter or buffer from the current values of the variables that hold it."""
    variables, to_canonical = held
    return np.array(to_canonical(*[v.numpy() for v in variables]), dtype=np.float32, order="C")  # always a copy
