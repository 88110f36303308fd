"""TensorFlow adapter: raw ``tf.Variable``s and ``tf.nn`` ops in ``tf.function``s (no XLA), data resident on the
device, NHWC.

Layouts: conv kernels are HWIO (``weight.transpose(2, 3, 1, 0)``), dense kernels (in, out) (``weight.T``), and the
first dense layer after flattening an (H, W, C) tensor has its input rows permuted by
``harness.models.chw_to_hwc_permutation`` so that it computes exactly the canonical channel-first model; the data
itself is never permuted. ``get_weights`` inverts all of this.

The train step is one ``tf.function`` per batch size with a fully static ``input_signature``, so it is traced once
and never retraced in the timed loop (https://www.tensorflow.org/guide/function#controlling_retracing); evaluation
and prediction use one whose batch dimension is None, so a smaller last batch does not retrace either.

The optimizer is PyTorch's (``torch.optim.SGD`` / ``Adam``, coupled L2 weight decay) on TF's fused training kernels
(``ResourceApplyMomentum`` / ``ResourceApplyAdam``: one op per variable), not ``keras.optimizers``: Keras 3's SGD would
agree for a constant learning rate, but its Adam adds epsilon to sqrt(v) before the bias correction where PyTorch adds
it after (see ``_make_update``), and the spec makes the optimizer identical in every framework.

Sync reads the last loss with ``.numpy()``, after ``tf.test.experimental.sync_devices()`` on a GPU
(https://www.tensorflow.org/api_docs/python/tf/test/experimental/sync_devices); on the CPU, eager TF is synchronous.
GPU memory growth is on (https://www.tensorflow.org/guide/gpu#limiting_gpu_memory_growth), and the allocator peak
comes from ``tf.config.experimental.get_memory_info`` after ``reset_memory_stats``
(https://www.tensorflow.org/api_docs/python/tf/config/experimental/get_memory_info); TF keeps no such statistics for
the CPU (``get_memory_info("CPU:0")`` raises ValueError "Allocator stats not available").
"""

from __future__ import annotations

import os
from typing import Any, Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before the import: silences TF's C++ INFO and WARNING logs

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from adapters.base import Adapter, DeviceUnavailable  # noqa: E402
from harness.models import chw_to_hwc_permutation  # noqa: E402


def _f32(array: np.ndarray) -> np.ndarray:
    return np.asarray(array, dtype=np.float32)


def _default_threads() -> int:
    # What TF uses for a thread count of 0: the CPUs this process may run on (tsl::port::NumSchedulableCPUs).
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class TensorFlowAdapter(Adapter):
    name = "tensorflow"

    def __init__(self) -> None:
        self.device = "/CPU:0"
        self._gpu = False
        self._last_loss: tf.Tensor | None = None
        # layer index -> (kind, kernel, bias, inverse row permutation of a dense kernel fed by an HWC flatten or None)
        self._params: dict[int, tuple[str, tf.Variable, tf.Variable, np.ndarray | None]] = {}
        self._forward_layers: list[Callable[[tf.Tensor], tf.Tensor]] = []
        self._train_fns: dict[int, Any] = {}

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

    def prepare(self, device: str, threads: int | None, seed: int) -> None:
        """Must run before any TF op in the process: TF fixes visible devices, memory growth and thread pools when its
        context starts, and raises RuntimeError for a later change (repeating the same settings is allowed). For
        ``cuda:N`` only GPU N is made visible (it is then "/GPU:0"), with memory growth
        (https://www.tensorflow.org/api_docs/python/tf/config/experimental/set_memory_growth) and TF32 off
        (https://www.tensorflow.org/api_docs/python/tf/config/experimental/enable_tensor_float_32_execution). Raises
        DeviceUnavailable when TF sees no such GPU (a CPU-only build such as tensorflow-cpu, or no driver)."""
        if device.startswith("cuda"):
            gpus = tf.config.list_physical_devices("GPU")
            if not gpus:
                cuda_build = tf.sysconfig.get_build_info().get("is_cuda_build", False)
                why = "no GPU was found by this CUDA build" if cuda_build else "this is a CPU-only build"
                raise DeviceUnavailable(f"TensorFlow {tf.__version__} sees no GPU ({why})")
            index = int(device.partition(":")[2] or 0)
            if index >= len(gpus):
                raise DeviceUnavailable(f"TensorFlow sees {len(gpus)} GPU(s); {device} is not one")
            tf.config.set_visible_devices([gpus[index]], "GPU")
            tf.config.experimental.set_memory_growth(gpus[index], True)
            # fp32 means fp32: no TF32 in matmuls or convolutions (the other frameworks' defaults differ otherwise).
            tf.config.experimental.enable_tensor_float_32_execution(False)
            self.device, self._gpu = "/GPU:0", True
        else:
            tf.config.set_visible_devices([], "GPU")
            self.device, self._gpu = "/CPU:0", False
        if threads is not None:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.random.set_seed(seed)

    def build(self, info: Any, weights: dict[str, np.ndarray], optimizer: Any) -> None:
        """Creates float32 ``tf.Variable``s on the device from the canonical ``weights`` (conv OIHW -> HWIO, dense
        (out, in) -> (in, out), rows of the first dense kernel after a flatten of (C, H, W) permuted to the (H, W, C)
        order TF flattens in) and the optimizer state. A trailing softmax is left to the loss."""
        self._params = {}
        self._forward_layers = []
        self._train_fns = {}
        self._last_loss = None
        flatten_from: tuple[int, int, int] | None = None  # the (C, H, W) shape the next dense layer's input came from
        with tf.device(self.device):
            for layer in info.layers:
                spec = layer.spec
                w_name, b_name = f"{layer.index}.weight", f"{layer.index}.bias"
                if layer.kind == "conv2d":
                    kernel = tf.Variable(_f32(weights[w_name]).transpose(2, 3, 1, 0), name=w_name)  # OIHW -> HWIO
                    bias = tf.Variable(_f32(weights[b_name]), name=b_name)
                    self._params[layer.index] = ("conv2d", kernel, bias, None)
                    self._forward_layers.append(_conv(kernel, bias, spec.padding.upper(), spec.activation == "relu"))
                elif layer.kind == "dense":
                    weight = _f32(weights[w_name])
                    inverse = None
                    if flatten_from is not None:
                        perm = chw_to_hwc_permutation(flatten_from)
                        weight, inverse = weight[:, perm], np.argsort(perm)
                        flatten_from = None
                    kernel = tf.Variable(np.ascontiguousarray(weight.T), name=w_name)  # (out, in) -> (in, out)
                    bias = tf.Variable(_f32(weights[b_name]), name=b_name)
                    self._params[layer.index] = ("dense", kernel, bias, inverse)
                    self._forward_layers.append(_dense(kernel, bias, spec.activation == "relu"))
                elif layer.kind == "maxpool2d":
                    self._forward_layers.append(_maxpool(spec.pool_size, spec.stride or spec.pool_size))
                elif layer.kind == "flatten":
                    if len(layer.input_shape) == 3:
                        flatten_from = tuple(layer.input_shape)
                    features = int(np.prod(layer.input_shape))
                    self._forward_layers.append(lambda x, n=features: tf.reshape(x, (-1, n)))  # NHWC: (H, W, C) order
                elif layer.kind == "relu":
                    self._forward_layers.append(tf.nn.relu)
                # softmax: folded into the cross-entropy loss
            self._variables = [v for _, kernel, bias, _ in self._params.values() for v in (kernel, bias)]
            self._update = _make_update(optimizer, self._variables)
        c, h, w = info.input_shape
        image_spec = tf.TensorSpec((None, h, w, c), tf.float32)
        self._logits_fn = tf.function(self._logits, input_signature=[image_spec], jit_compile=False, autograph=False)
        self._eval_fn = tf.function(self._eval_batch, input_signature=[image_spec, tf.TensorSpec((None,), tf.int64)],
                                    jit_compile=False, autograph=False)

    def _forward(self, x: tf.Tensor) -> tf.Tensor:
        for fn in self._forward_layers:
            x = fn(x)
        return x

    def _logits(self, x: tf.Tensor) -> tf.Tensor:
        with tf.device(self.device):
            return self._forward(x)

    def _eval_batch(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        with tf.device(self.device):
            logits = self._forward(x)
            loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=1), y), tf.int64))
            return tf.reduce_sum(tf.cast(loss, tf.float64)), correct

    def _train(self, indices: tf.Tensor) -> tf.Tensor:
        with tf.device(self.device):
            x = tf.gather(self.x_train, indices)
            y = tf.gather(self.y_train, indices)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=self._forward(x)))
            self._update(tape.gradient(loss, self._variables))
            return loss

    def load(self, data: Any) -> None:
        """Copies the four arrays to the device once, as ``tf.constant``s placed under ``tf.device``: NHWC float32
        images, int64 labels."""
        with tf.device(self.device):
            self.x_train = tf.constant(data.x_train, dtype=tf.float32)
            self.y_train = tf.constant(data.y_train, dtype=tf.int64)
            self.x_test = tf.constant(data.x_test, dtype=tf.float32)
            self.y_test = tf.constant(data.y_test, dtype=tf.int64)
        self._train_fns = {}  # the train step captures the training tensors when it is traced

    def train_step(self, indices: np.ndarray) -> None:
        """One step on ``indices`` (int64 (B,)): gather, forward, ``tf.GradientTape`` gradients and the optimizer
        update in one ``tf.function``, traced on the first call with each batch size B and never again."""
        fn = self._train_fns.get(len(indices))
        if fn is None:
            fn = tf.function(self._train, input_signature=[tf.TensorSpec((len(indices),), tf.int64)],
                             jit_compile=False, autograph=False)
            self._train_fns[len(indices)] = fn
        self._last_loss = fn(np.asarray(indices, dtype=np.int64))

    def sync(self) -> float:
        """Blocks until queued work is done; returns the last step's loss (nan before the first step)."""
        if self._gpu:
            tf.test.experimental.sync_devices()
        return float("nan") if self._last_loss is None else float(self._last_loss.numpy())

    def evaluate(self, batch_size: int) -> tuple[float, float]:
        """(mean cross-entropy, accuracy in [0, 1]) over the test set in batches of ``batch_size``; per-batch sums
        are accumulated on the device in float64 and read once at the end."""
        n = int(self.x_test.shape[0])
        with tf.device(self.device):
            total_loss = tf.zeros((), tf.float64)
            correct = tf.zeros((), tf.int64)
            for start in range(0, n, batch_size):
                loss, right = self._eval_fn(self.x_test[start:start + batch_size], self.y_test[start:start + batch_size])
                total_loss += loss
                correct += right
        return float(total_loss.numpy()) / n, float(correct.numpy()) / n

    def predict(self, images: np.ndarray) -> np.ndarray:
        """float32 (N, classes) logits for float32 NHWC ``images`` (N, H, W, C)."""
        with tf.device(self.device):
            x = tf.constant(np.asarray(images, dtype=np.float32))
        return self._logits_fn(x).numpy()

    def get_weights(self) -> dict[str, np.ndarray]:
        """Copies of the current parameters, converted back to the canonical layout and names ("<index>.weight",
        "<index>.bias"): the exact inverse of ``build``'s conversion."""
        out: dict[str, np.ndarray] = {}
        for index, (kind, kernel, bias, inverse) in self._params.items():
            k = kernel.numpy()
            if kind == "conv2d":
                weight = k.transpose(3, 2, 0, 1)  # HWIO -> OIHW
            else:
                weight = k.T if inverse is None else k.T[:, inverse]  # (in, out) -> (out, in), undo the HWC rows
            out[f"{index}.weight"] = np.ascontiguousarray(weight)
            out[f"{index}.bias"] = bias.numpy().copy()
        return out

    def reset_memory_stats(self) -> None:
        """Restarts the GPU allocator's peak (https://www.tensorflow.org/api_docs/python/tf/config/experimental/
        reset_memory_stats). Nothing on the CPU, which has no allocator statistics."""
        if self._gpu:
            tf.config.experimental.reset_memory_stats("GPU:0")

    def memory_stats(self) -> dict[str, int]:
        """On a GPU, ``allocator_peak_bytes``: the BFC allocator's peak bytes in use by tensors since the last
        ``reset_memory_stats`` (``get_memory_info(...)["peak"]``). TF does not expose the bytes the allocator reserved
        from the device, so ``allocator_reserved_peak_bytes`` is absent. ``{}`` on the CPU, where
        ``get_memory_info("CPU:0")`` raises ValueError."""
        if not self._gpu:
            return {}
        return {"allocator_peak_bytes": int(tf.config.experimental.get_memory_info("GPU:0")["peak"])}

    def settings(self) -> dict[str, Any]:
        intra = tf.config.threading.get_intra_op_parallelism_threads()
        inter = tf.config.threading.get_inter_op_parallelism_threads()
        out: dict[str, Any] = {"intra_op_threads": intra or _default_threads(),  # 0 is TF's "all schedulable CPUs"
                               "inter_op_threads": inter or _default_threads(),
                               "data_format": "NHWC", "jit_compile": False,
                               "optimizer_impl": "PyTorch semantics on ResourceApplyMomentum/Adam",
                               "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "")}
        if self._gpu:
            out["memory_growth"] = True
            out["TF_GPU_ALLOCATOR"] = os.environ.get("TF_GPU_ALLOCATOR", "")
            out["allow_tf32"] = tf.config.experimental.tensor_float_32_execution_enabled()
        return out

    def is_oom(self, exc: BaseException) -> bool:
        # tf.errors.ResourceExhaustedError is what TF raises when an allocator refuses a tensor, on the CPU and the GPU
        # (https://www.tensorflow.org/api_docs/python/tf/errors/ResourceExhaustedError). A host-to-GPU copy that finds
        # no room raises InternalError "Dst tensor is not initialized." instead (tensorflow/tensorflow#7025), which has
        # no type of its own, so that one is recognised by its message.
        if isinstance(exc, tf.errors.ResourceExhaustedError):
            return True
        return isinstance(exc, tf.errors.InternalError) and "Dst tensor is not initialized" in str(exc)


def _conv(kernel: tf.Variable, bias: tf.Variable, padding: str, relu: bool) -> Callable[[tf.Tensor], tf.Tensor]:
    # TF's "SAME" pads an odd kernel by k // 2 on every side at stride 1, as the canonical model does.
    def fn(x: tf.Tensor) -> tf.Tensor:
        y = tf.nn.bias_add(tf.nn.conv2d(x, kernel, strides=1, padding=padding, data_format="NHWC"), bias)
        return tf.nn.relu(y) if relu else y
    return fn


def _dense(kernel: tf.Variable, bias: tf.Variable, relu: bool) -> Callable[[tf.Tensor], tf.Tensor]:
    def fn(x: tf.Tensor) -> tf.Tensor:
        y = tf.nn.bias_add(tf.matmul(x, kernel), bias)
        return tf.nn.relu(y) if relu else y
    return fn


def _maxpool(pool: int, stride: int) -> Callable[[tf.Tensor], tf.Tensor]:
    return lambda x: tf.nn.max_pool2d(x, ksize=pool, strides=stride, padding="VALID", data_format="NHWC")


def _make_update(opt: Any, variables: list[tf.Variable]) -> Callable[[list[tf.Tensor]], None]:
    """The optimizer step with PyTorch's semantics, on TF's fused training kernels (one op per variable, the kernels
    behind ``tf.compat.v1.train``'s optimizers; https://www.tensorflow.org/api_docs/python/tf/raw_ops/
    ResourceApplyMomentum and .../ResourceApplyAdam). Weight decay is coupled L2, as in PyTorch: g <- g +
    weight_decay * p. The state variables are created here, on the current device, zero-initialized like PyTorch's.

    sgd: ``ResourceApplyMomentum`` computes accum <- momentum * accum + g; p <- p - lr * accum, which is
    ``torch.optim.SGD`` with dampening 0 and no Nesterov (PyTorch's first step sets accum = g: the same from 0).
    adam: ``ResourceApplyAdam`` computes p <- p - lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps'), with
    epsilon added before the bias correction (Keras's form); ``torch.optim.Adam`` adds it after, p <- p - lr /
    (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps). Passing eps' = eps * sqrt(1 - b2^t) each step makes the two
    the same update.
    """
    lr, wd = float(opt.learning_rate), float(opt.weight_decay)

    def f32(x: Any) -> tf.Tensor:  # built while the train step is traced: graph constants, not captures
        return tf.cast(x, tf.float32)

    def decayed(g: tf.Tensor, p: tf.Variable) -> tf.Tensor:
        return g + wd * p if wd else g

    if opt.name == "sgd":
        if not opt.momentum:
            def sgd(grads: list[tf.Tensor]) -> None:
                for g, p in zip(grads, variables):
                    tf.raw_ops.ResourceApplyGradientDescent(var=p.handle, alpha=f32(lr), delta=decayed(g, p))
            return sgd
        momentum = float(opt.momentum)
        accums = [tf.Variable(tf.zeros_like(p), trainable=False) for p in variables]

        def sgd_momentum(grads: list[tf.Tensor]) -> None:
            for g, p, accum in zip(grads, variables, accums):
                tf.raw_ops.ResourceApplyMomentum(var=p.handle, accum=accum.handle, lr=f32(lr), grad=decayed(g, p),
                                                 momentum=f32(momentum), use_nesterov=False)
        return sgd_momentum

    beta1, beta2, eps = float(opt.beta1), float(opt.beta2), float(opt.epsilon)
    step = tf.Variable(0.0, dtype=tf.float64, trainable=False)
    m = [tf.Variable(tf.zeros_like(p), trainable=False) for p in variables]
    v = [tf.Variable(tf.zeros_like(p), trainable=False) for p in variables]

    def adam(grads: list[tf.Tensor]) -> None:
        t = step.assign_add(1.0)
        # The bias corrections in double precision, as PyTorch computes them, then float32 for the kernel.
        beta1_power = tf.pow(tf.constant(beta1, tf.float64), t)
        beta2_power = tf.pow(tf.constant(beta2, tf.float64), t)
        scalars = {"lr": f32(lr), "beta1": f32(beta1), "beta2": f32(beta2), "beta1_power": f32(beta1_power),
                   "beta2_power": f32(beta2_power), "epsilon": f32(eps * tf.sqrt(1.0 - beta2_power))}
        for g, p, m_i, v_i in zip(grads, variables, m, v):
            tf.raw_ops.ResourceApplyAdam(var=p.handle, m=m_i.handle, v=v_i.handle, grad=decayed(g, p),
                                         use_locking=False, use_nesterov=False, **scalars)
    return adam
