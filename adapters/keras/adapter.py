"""Keras 3 adapter: the neutral model as a functional ``keras.Model`` of Keras layers (``keras.layers``, and
``adapters.keras.layers`` where the canonical model needs its own), compiled with ``Model.compile`` and trained
through ``Model.train_on_batch``, the public API a Keras user's custom loop calls, on the backend its declaration
names (``KerasJAXAdapter``, ``KerasPyTorchAdapter``, ``KerasTensorFlowAdapter``). Data resident on the device as
backend tensors, each step's batch gathered there with ``keras.ops.take``; NHWC for images, (B, L, D) for sequences.

Design: docs/design/framework-caveats.md#keras-3 (what train_on_batch costs, the layers and optimizers of our own).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from typing import Any

import numpy as np

from adapters import keras as declarations
from adapters.base import Adapter, DeviceUnavailable, device_index, micro_batch_size
from harness.neutral.models import ORDER_FREE, chw_to_hwc_permutation, flatten_feeds_dense, initial_buffers

#: The dtype policy of each precision (https://keras.io/api/mixed_precision/policy/).
POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


def import_keras(backend: str) -> Any:
    """Keras on ``backend``: sets KERAS_BACKEND, then imports Keras (https://keras.io/getting_started/#configuring-
    your-backend: the backend is read once, when Keras is first imported). Raises RuntimeError when Keras was already
    imported in this process with another backend, ImportError when Keras is older than 3 (no multi-backend)."""
    if "keras" in sys.modules:
        keras = sys.modules["keras"]
        current = keras.backend.backend() if hasattr(keras, "backend") else "unknown"
        if current != backend:
            raise RuntimeError(f"Keras was imported on the {current} backend before the Keras adapter could set "
                               f"KERAS_BACKEND={backend}; a worker process holds one backend")
        return keras
    os.environ["KERAS_BACKEND"] = backend
    keras = importlib.import_module("keras")
    if int(keras.__version__.split(".")[0]) < 3:
        raise ImportError(f"Keras {keras.__version__} has no backends; the Keras adapter needs Keras 3")
    return keras


class KerasAdapter(Adapter):
    """One backend's Keras. A subclass names its declaration; ``BACKEND`` is its ``backend``."""

    BACKEND = ""

    def __init__(self) -> None:
        # before anything imports Keras: TensorFlow imports it on its own (tf.keras), on KERAS_BACKEND's backend
        os.environ["KERAS_BACKEND"] = self.BACKEND
        self.device = "cpu"
        self._gpu = False
        self._keras: Any = None
        self._model: Any = None
        self._compiled_for: int | None = None  # the micro-batches per step Model.compile fixed (gradient accumulation)
        self._optimizer_spec: Any = None
        self._loss_sum = 0.0  # the steps' losses since the last read, on the host (train_on_batch returns them there)
        self._loss_steps = 0
        self._params: dict[str, tuple[tuple[Any, ...], Any]] = {}
        self._buffers: dict[str, tuple[tuple[Any, ...], Any]] = {}
        self._order: Any = None
        self._steps_staged = 0
        self.tokens = False
        self._settings: dict[str, Any] = {}

    # -- setup ---------------------------------------------------------------------------------------------------

    def _backend_module(self) -> Any:
        """The backend's module (importing it). Raises ImportError naming the fix when it is not installed."""
        module = {"torch": "torch", "jax": "jax", "tensorflow": "tensorflow"}[self.BACKEND]
        try:
            return importlib.import_module(module)
        except ImportError as err:
            raise ImportError(f"Keras's {self.BACKEND} backend is not installed here ({err}); make the environment "
                              f"with `harness envs create {self.name}`") from err

    def versions(self) -> dict[str, str]:
        """Keras's version (from its distribution's metadata, without importing it) and the backend's, with CUDA and
        cuDNN where the backend reports them. Raises ImportError naming the fix when Keras is missing or older than
        3 (the environment probe reports it before a run starts)."""
        try:
            version = importlib.metadata.version("keras")
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(f"no Keras here; make the environment with `harness envs create {self.name}` (or pip "
                              "install 'keras>=3' there)") from None
        if int(version.split(".")[0]) < 3:
            raise ImportError(f"Keras {version} is older than Keras 3 (no backends); make the environment with "
                              f"`harness envs create {self.name}` (or pip install 'keras>=3' there)")
        out = {"keras": version}
        fw = self._backend_module()
        if self.BACKEND == "jax":
            out["jax"] = fw.__version__
            out["jaxlib"] = importlib.metadata.version("jaxlib")
        elif self.BACKEND == "torch":
            out["torch"] = fw.__version__.split("+")[0]
            if fw.version.cuda:
                out["cuda"] = str(fw.version.cuda)
            if fw.backends.cudnn.is_available():
                out["cudnn"] = str(fw.backends.cudnn.version())
        else:
            out["tensorflow"] = fw.__version__
            build = fw.sysconfig.get_build_info()
            for key in ("cuda", "cudnn"):
                if build.get(f"{key}_version"):
                    out[key] = str(build[f"{key}_version"])
        return out

    def device_problem(self, device: str) -> str | None:
        """The backend's own device query (torch.cuda.device_count, jax.devices("gpu"),
        tf.config.list_physical_devices("GPU")), which creates no context."""
        if not device.startswith("cuda"):
            return None
        index, fw = device_index(device), self._backend_module()
        if self.BACKEND == "torch":
            count = fw.cuda.device_count()
            what = f"PyTorch {fw.__version__}"
        elif self.BACKEND == "jax":
            try:
                count = len(fw.devices("gpu"))
            except RuntimeError:
                count = 0
            what = f"JAX {fw.__version__}"
        else:
            count = len(fw.config.list_physical_devices("GPU"))
            what = f"TensorFlow {fw.__version__}"
        if not count:
            return f"{what} (Keras's backend) sees no CUDA device (a CPU-only build, or no driver)"
        return None if index < count else f"{what} sees {count} GPU(s); {device} is not one"

    def prepare(self, device: str, threads: int | None, seed: int) -> None:
        """Before Keras is imported: the backend's device (torch: KERAS_TORCH_DEVICE, read by Keras's torch backend
        when it is imported; JAX: jax_default_device; TensorFlow: only that GPU visible, with memory growth, or
        none), its threads (intra-op ``threads``, inter-op 1) and, in fp32, its TF32 off (torch's matmul and cuDNN
        flags, JAX's default matmul precision "highest", TF's tensor_float_32_execution); then Keras
        (``import_keras``), its seed (``keras.utils.set_random_seed``: Python, numpy and the backend) and the dtype
        policy of ``options.precision`` (``POLICIES``). Raises DeviceUnavailable for a GPU the backend cannot see."""
        if self.options.data_parallel is not None:
            raise DeviceUnavailable("the Keras adapter trains on one device")
        if (problem := self.device_problem(device)) is not None:
            raise DeviceUnavailable(problem)
        self._gpu = device.startswith("cuda")
        index = device_index(device)
        fw = self._backend_module()
        fp32 = self.options.precision == "fp32"
        applied: dict[str, Any] = {}
        if self.BACKEND == "torch":
            os.environ["KERAS_TORCH_DEVICE"] = f"cuda:{index}" if self._gpu else "cpu"
            if threads is not None:
                fw.set_num_threads(threads)
                try:
                    fw.set_num_interop_threads(1)
                except RuntimeError:  # already set in this process (tests): it can be set once
                    pass
            fw.backends.cuda.matmul.allow_tf32 = fw.backends.cudnn.allow_tf32 = not fp32
            if self._gpu and self.options.memory_limit_bytes:
                total = fw.cuda.get_device_properties(index).total_memory
                fraction = min(self.options.memory_limit_bytes / total, 1.0)
                fw.cuda.set_per_process_memory_fraction(fraction, index)
                applied["memory_fraction"] = fraction
            self.device = os.environ["KERAS_TORCH_DEVICE"]
        elif self.BACKEND == "jax":
            if self._gpu and self.options.memory_limit_bytes:
                raise DeviceUnavailable("the Keras adapter on JAX takes no memory cap on a GPU (XLA's fraction must "
                                        "be set before JAX starts); the native JAX adapter does")
            target = fw.devices("gpu")[index] if self._gpu else fw.devices("cpu")[0]
            fw.config.update("jax_default_device", target)
            fw.config.update("jax_default_matmul_precision", "highest" if fp32 else "default")
            self.device = str(target)
        else:
            gpus = fw.config.list_physical_devices("GPU")
            if self._gpu:
                fw.config.set_visible_devices([gpus[index]], "GPU")
                if self.options.memory_limit_bytes:
                    mib = max(int(self.options.memory_limit_bytes) // 2**20, 1)
                    fw.config.set_logical_device_configuration(
                        gpus[index], [fw.config.LogicalDeviceConfiguration(memory_limit=mib)])
                    applied["memory_limit_bytes"] = mib * 2**20
                elif self.options.allocator.tensorflow_memory_growth:
                    fw.config.experimental.set_memory_growth(gpus[index], True)
                    applied["memory_growth"] = True
                fw.config.experimental.enable_tensor_float_32_execution(not fp32)
            else:
                fw.config.set_visible_devices([], "GPU")
            if threads is not None:
                fw.config.threading.set_intra_op_parallelism_threads(threads)
                fw.config.threading.set_inter_op_parallelism_threads(1)
            self.device = "/GPU:0" if self._gpu else "/CPU:0"
        keras = self._keras = import_keras(self.BACKEND)
        keras.utils.set_random_seed(seed)
        keras.config.set_dtype_policy(POLICIES[self.options.precision])
        self._seed = seed
        self._settings = {"keras_backend": keras.backend.backend(), "device": self.device,
                          "dtype_policy": POLICIES[self.options.precision], "tf32": not fp32 and self._gpu,
                          "train_api": "keras.Model.train_on_batch", **applied}

    # -- the model -----------------------------------------------------------------------------------------------

    def build(self, info: Any, weights: dict[str, np.ndarray], optimizer: Any) -> None:
        """The functional model of ``info`` (weights converted: conv OIHW -> HWIO, dense (out, in) -> (in, out), the
        rows of a dense layer after a flatten of (C, H, W) permuted to the (H, W, C) order Keras flattens in, and the
        features of a batchnorm between the two; attention's (3D, D) in-projection split into Keras's query, key and
        value kernels (D, heads, D / heads)), its logits float32 in every policy (a float32 ``Activation`` last, as
        https://keras.io/api/mixed_precision/ recommends). A trailing softmax is left to the loss. Compiled at the
        first step (``_compile``), when the micro-batches per step are known. Kernels and embedding tables are made
        with the "zeros" initializer and then assigned (``_keep``): Keras's random initializers would only be
        overwritten, and on JAX each draw compiles its own kernel (a third of a CNN's build time, measured)."""
        keras = self._keras
        if keras is None:
            raise RuntimeError("the Keras adapter's build ran before prepare")
        self._params, self._buffers = {}, {}
        self._optimizer_spec, self._compiled_for = optimizer, None
        self.tokens = info.task != "image_classification"
        buffers = {**initial_buffers(info), **{k: v for k, v in weights.items() if k in info.buffer_names()}}
        if self.tokens:
            inputs = keras.Input(shape=tuple(info.input_shape), dtype="int32", name="tokens")
        else:
            c, h, w = info.input_shape
            inputs = keras.Input(shape=(h, w, c), dtype="float32", name="images")
        x, flatten_from = inputs, None
        for position, layer in enumerate(info.layers):
            x, flatten_from = self._add(layer, x, weights, buffers, flatten_from, info.layers[position + 1:])
        logits = keras.layers.Activation("linear", dtype="float32", name="logits")(x)
        self._model = keras.Model(inputs, logits, name="neutral")

    def _keep(self, name: str, variables: tuple[Any, ...], values: tuple[np.ndarray, ...], to_canonical: Any = None,
              trainable: bool = True) -> None:
        """Assigns ``values`` (Keras's layouts) to ``variables`` and registers them as the canonical parameter (or
        buffer) ``name``, which ``to_canonical`` of their values gives back (default: the one value as it is)."""
        for variable, value in zip(variables, values):
            if tuple(variable.shape) != value.shape:
                raise ValueError(f"{name}: Keras's {variable.path} is {tuple(variable.shape)}, the value {value.shape}")
            variable.assign(np.asarray(value, np.float32))
        (self._params if trainable else self._buffers)[name] = (variables, to_canonical or (lambda v: v))

    def _add(self, layer: Any, x: Any, weights: dict[str, np.ndarray], buffers: dict[str, np.ndarray],
             flatten_from: tuple[int, int, int] | None, following: Any = ()) -> tuple[Any, Any]:
        """One layer or block applied to the symbolic tensor ``x``, its variables set from the canonical weights;
        returns the output and the (C, H, W) shape the next dense layer's input was flattened from in (H, W, C)
        order, or None. ``following``: the top-level layers after this one (a flatten looks ahead)."""
        kind, tag = layer.kind, layer.name.replace(".", "_")
        if kind == "residual":
            y = skip = x
            for child in layer.body:
                y, _ = self._add(child, y, weights, buffers, None)
            for child in layer.shortcut:
                skip, _ = self._add(child, skip, weights, buffers, None)
            out = self._keras.layers.Add(name=f"{tag}_add")([y, skip])
            return (self._keras.layers.ReLU(name=f"{tag}_relu")(out) if layer.spec.activation == "relu" else out), None
        if kind == "conv2d":
            return self._conv(layer, x, weights, tag), None
        if kind == "dense":
            return self._dense(layer, x, weights, tag, flatten_from), None
        if kind == "batchnorm":
            return self._batchnorm(layer, x, weights, buffers, tag, flatten_from), flatten_from
        if kind == "layernorm":
            norm = self._keras.layers.LayerNormalization(axis=-1, epsilon=layer.spec.epsilon, name=tag)
            y = norm(x)
            self._keep(f"{layer.name}.weight", (norm.gamma,), (_f32(weights[f"{layer.name}.weight"]),))
            self._keep(f"{layer.name}.bias", (norm.beta,), (_f32(weights[f"{layer.name}.bias"]),))
            return y, None
        if kind == "attention":
            return self._attention(layer, x, weights, tag), None
        if kind == "embedding":
            return self._embedding(layer, x, weights, tag), None
        if kind == "flatten":
            if len(layer.input_shape) == 3 and flatten_feeds_dense(following):
                return self._keras.layers.Flatten(name=tag)(x), tuple(layer.input_shape)  # NHWC: (H, W, C) order
            if len(layer.input_shape) == 3:
                x = self._keras.layers.Permute((3, 1, 2), name=f"{tag}_chw")(x)  # the canonical (C, H, W) order
            return self._keras.layers.Flatten(name=tag)(x), None
        return self._parameterless(layer, x, tag), (flatten_from if kind in ORDER_FREE | {"softmax"} else None)

    def _parameterless(self, layer: Any, x: Any, tag: str) -> Any:
        """Pooling, dropout, relu, gelu and a trailing softmax (folded into the loss: the identity here)."""
        keras, spec, kind = self._keras, layer.spec, layer.kind
        if kind in ("maxpool2d", "avgpool2d"):
            pool = keras.layers.MaxPooling2D if kind == "maxpool2d" else keras.layers.AveragePooling2D
            return pool(spec.pool_size, strides=spec.stride or spec.pool_size, padding="valid", name=tag)(x)
        if kind == "global_avgpool2d":
            return keras.layers.GlobalAveragePooling2D(name=tag)(x)
        if kind == "sequence_pool":
            if spec.mode == "mean":
                return keras.layers.GlobalAveragePooling1D(name=tag)(x)
            from adapters.keras.layers import LastPosition

            return LastPosition(name=tag)(x)
        if kind == "dropout":
            return keras.layers.Dropout(spec.rate, seed=self._seed + layer.index, name=tag)(x)
        if kind == "relu":
            return keras.layers.ReLU(name=tag)(x)
        if kind == "gelu":
            return keras.layers.Activation(_activation("gelu"), name=tag)(x)
        if kind == "softmax":
            return x
        raise ValueError(f"the {self.name} adapter cannot build {kind} layers")

    def _conv(self, layer: Any, x: Any, weights: dict[str, np.ndarray], tag: str) -> Any:
        """``keras.layers.Conv2D`` (HWIO kernel from OIHW); an explicit padding of p zeros is ``ZeroPadding2D(p)``
        then a "valid" convolution ("same" pads an odd kernel by k // 2 on every side at stride 1, as canonical)."""
        keras, spec, name = self._keras, layer.spec, layer.name
        if isinstance(spec.padding, int) and spec.padding:
            x = keras.layers.ZeroPadding2D(spec.padding, name=f"{tag}_pad")(x)
        kernel = _f32(weights[f"{name}.weight"])
        conv = keras.layers.Conv2D(kernel.shape[0], spec.kernel_size, strides=spec.stride,
                                   padding=spec.padding if isinstance(spec.padding, str) else "valid",
                                   use_bias=spec.use_bias, activation=_activation(spec.activation),
                                   kernel_initializer="zeros", name=tag)  # assigned below (see _keep)
        y = conv(x)
        self._keep(f"{name}.weight", (conv.kernel,), (kernel.transpose(2, 3, 1, 0),), lambda k: k.transpose(3, 2, 0, 1))
        if spec.use_bias:
            self._keep(f"{name}.bias", (conv.bias,), (_f32(weights[f"{name}.bias"]),))
        return y

    def _dense(self, layer: Any, x: Any, weights: dict[str, np.ndarray], tag: str,
               flatten_from: tuple[int, int, int] | None) -> Any:
        """``keras.layers.Dense`` ((in, out) kernel from (out, in)); after a flatten in (H, W, C) order its rows
        permuted to that order. On (B, L, D) Keras applies it per position."""
        name = layer.name
        weight = _f32(weights[f"{name}.weight"])
        inverse: np.ndarray | None = None
        if flatten_from is not None:
            perm = chw_to_hwc_permutation(flatten_from)
            weight, inverse = weight[:, perm], np.argsort(perm)
        dense = self._keras.layers.Dense(weight.shape[0], activation=_activation(layer.spec.activation),
                                         kernel_initializer="zeros", name=tag)  # assigned below
        y = dense(x)
        self._keep(f"{name}.weight", (dense.kernel,), (np.ascontiguousarray(weight.T),),
                   lambda k: k.T if inverse is None else k.T[:, inverse])
        self._keep(f"{name}.bias", (dense.bias,), (_f32(weights[f"{name}.bias"]),))
        return y

    def _batchnorm(self, layer: Any, x: Any, weights: dict[str, np.ndarray], buffers: dict[str, np.ndarray],
                   tag: str, flatten_from: tuple[int, int, int] | None) -> Any:
        """``adapters.keras.layers.BatchNorm`` on the channels (NHWC's last axis); after a flatten in (H, W, C) order
        its features permuted like the next dense layer's rows."""
        from adapters.keras.layers import BatchNorm

        name, spec = layer.name, layer.spec
        perm = chw_to_hwc_permutation(flatten_from) if len(layer.input_shape) == 1 and flatten_from else None
        inverse = None if perm is None else np.argsort(perm)

        def order(a: np.ndarray) -> np.ndarray:
            return _f32(a) if perm is None else np.ascontiguousarray(_f32(a)[perm])

        def back(a: np.ndarray) -> np.ndarray:
            return a if inverse is None else a[inverse]
        norm = BatchNorm(spec.momentum, spec.epsilon, name=tag)
        y = norm(x)
        self._keep(f"{name}.weight", (norm.gamma,), (order(weights[f"{name}.weight"]),), back)
        self._keep(f"{name}.bias", (norm.beta,), (order(weights[f"{name}.bias"]),), back)
        for stat, variable in (("running_mean", norm.moving_mean), ("running_var", norm.moving_variance)):
            self._keep(f"{name}.{stat}", (variable,), (order(buffers[f"{name}.{stat}"]),), back, trainable=False)
        return y

    def _embedding(self, layer: Any, x: Any, weights: dict[str, np.ndarray], tag: str) -> Any:
        """``adapters.keras.layers.TokenAndPosition``: Keras's ``Embedding`` of the tokens plus the position table."""
        from adapters.keras.layers import TokenAndPosition

        name = layer.name
        length, = layer.input_shape
        table = _f32(weights[f"{name}.token.weight"])
        embed = TokenAndPosition(table.shape[0], length, table.shape[1], name=tag)
        y = embed(x)
        self._keep(f"{name}.token.weight", (embed.token.embeddings,), (table,))
        self._keep(f"{name}.position.weight", (embed.position,), (_f32(weights[f"{name}.position.weight"]),))
        return y

    def _attention(self, layer: Any, x: Any, weights: dict[str, np.ndarray], tag: str) -> Any:
        """``keras.layers.MultiHeadAttention(heads, key_dim=D / heads)`` called as ``mha(x, x, use_causal_mask=...)``
        (https://keras.io/api/layers/attention_layers/multi_head_attention/). Its query, key and value kernels are
        (D, heads, D / heads) (head h takes columns h D / heads onwards of x W^T, the canonical split), so each is
        the canonical rows' W.T reshaped, their biases (heads, D / heads); the output kernel (heads, D / heads, D) is
        W_out.T reshaped. Its variables are found by their paths (``query/kernel``, ...)."""
        keras, spec, name = self._keras, layer.spec, layer.name
        length, dim = layer.input_shape
        heads = spec.heads
        head_dim = dim // heads
        mha = keras.layers.MultiHeadAttention(heads, head_dim, kernel_initializer="zeros", name=tag)  # assigned below
        y = mha(x, x, use_causal_mask=spec.causal)
        found = {"/".join(v.path.split("/")[-2:]): v for v in mha.weights}
        kernels = tuple(found[f"{part}/kernel"] for part in ("query", "key", "value"))
        biases = tuple(found[f"{part}/bias"] for part in ("query", "key", "value"))
        in_weight, in_bias = _f32(weights[f"{name}.in_proj.weight"]), _f32(weights[f"{name}.in_proj.bias"])
        self._keep(f"{name}.in_proj.weight", kernels,
                   tuple(part.T.reshape(dim, heads, head_dim) for part in np.split(in_weight, 3)),
                   lambda *ks: np.concatenate([k.reshape(dim, dim).T for k in ks]))
        self._keep(f"{name}.in_proj.bias", biases,
                   tuple(part.reshape(heads, head_dim) for part in np.split(in_bias, 3)),
                   lambda *bs: np.concatenate([b.reshape(dim) for b in bs]))
        self._keep(f"{name}.out_proj.weight", (found["attention_output/kernel"],),
                   (_f32(weights[f"{name}.out_proj.weight"]).T.reshape(heads, head_dim, dim),),
                   lambda k: k.reshape(dim, dim).T)
        self._keep(f"{name}.out_proj.bias", (found["attention_output/bias"],),
                   (_f32(weights[f"{name}.out_proj.bias"]),))
        return y

    def _compile(self, micro_batches: int) -> None:
        """``Model.compile`` with the optimizer (``adapters.keras.layers``: PyTorch's SGD or Adam, the coupled L2 term;
        ``gradient_accumulation_steps`` = the micro-batches per step when more than one, Keras's own accumulation:
        the mean of the k micro-batches' gradients, applied every k-th ``train_on_batch``), the mean sparse
        cross-entropy of the logits (over every position for a next-token model), ``jit_compile`` from the mode, and
        no metrics but the loss. Under mixed_float16 ``compile`` wraps the optimizer in a ``LossScaleOptimizer``
        (dynamic loss scaling). Raises ValueError when a later step asks for other micro-batches: Keras fixes the
        accumulation with the optimizer."""
        if self._compiled_for is not None:
            if micro_batches != self._compiled_for:
                raise ValueError(f"the {self.name} adapter was compiled for {self._compiled_for} micro-batch(es) per "
                                 f"step; Keras fixes gradient accumulation with the optimizer")
            return
        from adapters.keras import layers as KL

        keras, spec = self._keras, self._optimizer_spec
        extra = {"gradient_accumulation_steps": micro_batches} if micro_batches > 1 else {}
        if spec.name == "sgd":
            optimizer = KL.SGD(spec.learning_rate, spec.momentum, spec.weight_decay, **extra)
        else:
            optimizer = KL.Adam(spec.learning_rate, spec.beta1, spec.beta2, spec.epsilon, spec.weight_decay, **extra)
        jit = self.compile_mode(self.options.compile) == "compiled"
        self._model.compile(optimizer=optimizer, jit_compile=jit,
                            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        self._compiled_for = micro_batches
        self._settings.update({"jit_compile": bool(self._model.jit_compile), "gradient_accumulation_steps":
                               micro_batches, "optimizer": type(self._model.optimizer).__name__,
                               "loss_scaling": POLICIES[self.options.precision] == "mixed_float16"})

    # -- data ----------------------------------------------------------------------------------------------------

    def _tensor(self, array: np.ndarray) -> Any:
        ops = self._keras.ops
        if array.dtype.kind in "iu":
            array = array.astype(np.int32)  # JAX's default integers (x64 off); the same on every backend
        return ops.convert_to_tensor(array)

    def load(self, data: Any) -> None:
        """The four arrays as backend tensors on the device (``keras.ops.convert_to_tensor``): float32 NHWC images or
        int32 (N, L) token ids, int32 labels."""
        self.x_train, self.y_train = self._tensor(data.x_train), self._tensor(data.y_train)
        self.x_test, self.y_test = data.x_test, data.y_test

    def set_train_images(self, images: np.ndarray) -> None:
        self.x_train = self._tensor(np.asarray(images, np.float32))

    def stage_epoch(self, order: np.ndarray, samples_per_step: int) -> None:
        self._order, self._steps_staged = self._tensor(order), samples_per_step

    def train_step(self, indices: np.ndarray, micro_batches: int = 1, position: int | None = None) -> None:
        """Gathers each micro-batch on the device (``keras.ops.take``) and calls ``train_on_batch`` on it: k calls
        for k micro-batches, the optimizer applying their mean gradient at the k-th. ``train_on_batch`` returns the
        loss on the host, so every call waits for the device: the price of Keras's public step API. The loss sum is
        therefore kept on the host (``_take_loss_sum``)."""
        size = micro_batch_size(len(indices), micro_batches)
        self._compile(micro_batches)
        ops = self._keras.ops
        if position is not None and self._order is not None and self._steps_staged == len(indices):
            idx = self._order[position * len(indices):(position + 1) * len(indices)]
        else:
            idx = self._tensor(np.asarray(indices))
        total = 0.0
        for i in range(micro_batches):
            part = idx if micro_batches == 1 else idx[i * size:(i + 1) * size]
            total += float(self._model.train_on_batch(ops.take(self.x_train, part, axis=0),
                                                      ops.take(self.y_train, part, axis=0)))
        self._loss_sum += total / micro_batches
        self._loss_steps += 1

    def wait(self) -> None:
        """The device idle: ``train_on_batch`` already returned its loss on the host; on a GPU the backend's own
        synchronisation as well (torch.cuda.synchronize, jax.block_until_ready on the parameters,
        TensorFlow's sync_devices)."""
        if not self._gpu or self._model is None:
            return
        fw = self._backend_module()
        if self.BACKEND == "torch":
            fw.cuda.synchronize()
        elif self.BACKEND == "jax":
            fw.block_until_ready([v.value for v in self._model.trainable_variables])
        else:
            fw.test.experimental.sync_devices()

    def _take_loss_sum(self) -> float:
        """The sum of the steps' losses since the last read: ``train_on_batch`` resets Keras's metrics and returns
        its batch's mean loss on the host at every call, so the sum is kept there (a step's loss: the mean of its
        micro-batches')."""
        total, self._loss_sum = self._loss_sum, 0.0
        return total

    # -- evaluation and state ------------------------------------------------------------------------------------

    def evaluate(self, batch_size: int) -> tuple[float, float]:
        """``predict_on_batch`` over the test set; the cross-entropy and accuracy from the float32 logits in
        float64 on the host."""
        total, correct, count = 0.0, 0, 0
        for start in range(0, len(self.y_test), batch_size):
            logits = self.predict(self.x_test[start:start + batch_size]).astype(np.float64)
            labels = self.y_test[start:start + batch_size]
            shifted = logits - logits.max(axis=-1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
            picked = np.take_along_axis(log_probs, labels[..., None].astype(np.int64), axis=-1)[..., 0]
            total -= float(picked.sum())
            correct += int((logits.argmax(axis=-1) == labels).sum())
            count += labels.size
        return total / count, correct / count

    def predict(self, images: np.ndarray) -> np.ndarray:
        return np.asarray(self._model.predict_on_batch(self._tensor(np.asarray(images))), dtype=np.float32)

    def _read(self, held: dict[str, tuple[tuple[Any, ...], Any]]) -> dict[str, np.ndarray]:
        ops = self._keras.ops
        return {name: np.asarray(fn(*(ops.convert_to_numpy(v.value) for v in variables)), np.float32)
                for name, (variables, fn) in held.items()}

    def get_weights(self) -> dict[str, np.ndarray]:
        return self._read(self._params)

    def get_buffers(self) -> dict[str, np.ndarray]:
        return self._read(self._buffers)

    # -- telemetry -----------------------------------------------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        return dict(self._settings)

    def compilations(self) -> int | None:
        """None: Keras keeps its train function's traces behind private attributes (a jitted step inside a
        wrapper on JAX, a tf.function inside one on TensorFlow), so no recompilation is counted for its rows."""
        return None

    def reset_memory_stats(self) -> None:
        if not self._gpu:
            return
        fw = self._backend_module()
        if self.BACKEND == "torch":
            fw.cuda.reset_peak_memory_stats()
        elif self.BACKEND == "tensorflow":
            fw.config.experimental.reset_memory_stats("GPU:0")

    def memory_stats(self) -> dict[str, int]:
        """On a GPU, the backend allocator's peak: torch.cuda.max_memory_allocated and max_memory_reserved,
        tf.config.experimental.get_memory_info("GPU:0")["peak"], JAX's device.memory_stats()["peak_bytes_in_use"]
        (since the process started: JAX cannot restart it). Nothing on the CPU."""
        if not self._gpu:
            return {}
        fw = self._backend_module()
        if self.BACKEND == "torch":
            return {"allocator_peak_bytes": int(fw.cuda.max_memory_allocated()),
                    "allocator_reserved_peak_bytes": int(fw.cuda.max_memory_reserved())}
        if self.BACKEND == "tensorflow":
            return {"allocator_peak_bytes": int(fw.config.experimental.get_memory_info("GPU:0")["peak"])}
        stats = fw.config.jax_default_device.memory_stats() or {}
        return {"allocator_peak_bytes": int(stats["peak_bytes_in_use"])} if "peak_bytes_in_use" in stats else {}

    def is_oom(self, exc: BaseException) -> bool:
        """The backend's out-of-memory error, as its native adapter classifies it: torch.OutOfMemoryError (the
        CUDA caching allocator) or the CPU allocator's RuntimeError "DefaultCPUAllocator: can't allocate memory";
        tf.errors.ResourceExhaustedError (or InternalError "Dst tensor is not initialized.", a host-to-GPU copy
        without room); JAX's runtime error with the RESOURCE_EXHAUSTED status."""
        fw = self._backend_module()
        if self.BACKEND == "torch":
            return isinstance(exc, fw.OutOfMemoryError) or (
                isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc))
        if self.BACKEND == "tensorflow":
            return isinstance(exc, fw.errors.ResourceExhaustedError) or (
                isinstance(exc, fw.errors.InternalError) and "Dst tensor is not initialized" in str(exc))
        types = tuple(t for t in (getattr(fw.errors, "JaxRuntimeError", None),) if isinstance(t, type))
        return bool(types) and isinstance(exc, types) and "RESOURCE_EXHAUSTED" in str(exc)


def _f32(array: np.ndarray) -> np.ndarray:
    return np.asarray(array, dtype=np.float32)


def _activation(name: str) -> Any:
    if name == "gelu":
        from adapters.keras.layers import exact_gelu

        return exact_gelu
    return None if name in (None, "none", "linear") else name


class KerasJAXAdapter(KerasAdapter, declaration=declarations.JAX):
    BACKEND = "jax"


class KerasPyTorchAdapter(KerasAdapter, declaration=declarations.TORCH):
    BACKEND = "torch"


class KerasTensorFlowAdapter(KerasAdapter, declaration=declarations.TENSORFLOW):
    BACKEND = "tensorflow"
