"""Hand-written, idiomatic training loops, one per framework: the reference that ``benchmarks/harness_vs_loop.py``
holds the harness's throughput against.

Each loop trains the spec's model (built natively, with the framework's own layers, from the same canonical initial
weights as the harness: ``harness.neutral.models.initial_weights``) on the spec's dataset (``harness.neutral.datasets
.load``), resident on the device, with the same batch size, optimizer (SGD with momentum), CPU threads, batch order
(``harness.neutral.datasets.epoch_order`` of every epoch, the last partial batch dropped; Keras ``fit`` shuffles by
itself) and warm-up steps as a harness trial, but none of the harness: no adapter, no shared loop, no per-step
host-to-device copy of the indices. What every loop does:

- before the clock starts: the model, the data and the batch indices of every step (the epoch permutations cut into
  batches) are placed on the device, and the first ``warmup_steps`` optimizer steps run (tracing, compilation,
  first-touch allocation), then the device is synced;
- timed (``time.perf_counter``, the device synced at both edges only): every remaining step of every epoch, each a
  gather of the batch on the device, forward, backward and the optimizer update; nothing is read back in between;
- after: the test accuracy (a check that the loop trained the same model as the harness, not a timing).

Throughput = timed samples / timed seconds, as the harness computes its ``throughput`` metric.

The loops (the framework's idiomatic way to train with data already on the device):

- ``pytorch``: eager ``nn.Sequential``, ``torch.optim.SGD``; per step ``x[idx]``, ``zero_grad``, ``backward``,
  ``step``; the resident images NCHW with default strides, so the convolution runs the same kernels as in the
  harness's adapter (channels-last strides would pick others). Threads: ``torch.set_num_threads``, inter-op 1. On a
  GPU (``--device cuda:N``): ``torch.cuda.set_device``, TF32 off in matmuls and convolutions (fp32, as the adapter
  sets it), the model, the data and every step's indices on the device, ``torch.cuda.synchronize`` at both edges;
  and a second variant, ``eager-host-indices``, copying each step's indices from pageable host memory as it is
  queued (``non_blocking``), to show what such a copy costs.
- ``tensorflow``: two loops, the faster counts. ``tf_function``: a Keras model and ``keras.optimizers.SGD`` in a
  ``tf.function`` train step (gather, ``tf.GradientTape``, ``apply_gradients``) called once per step from Python with
  the step's index tensor; ``keras_fit``: ``model.compile`` + ``model.fit`` on a ``tf.data`` pipeline of the resident
  tensors (shuffled each epoch, full batches only, prefetched), ``verbose=0``; its warm-up is a ``fit`` of
  ``warmup_steps`` batches, and the timed ``fit`` covers every epoch (so it times ``warmup_steps`` more steps than
  the others; the rate is what counts). Both with ``jit_compile=False``, as the harness's adapter (Keras 3's
  default ``"auto"`` would turn XLA on: other kernels, not a lighter loop). Threads: ``tf.config.threading``
  (intra-op as asked, inter-op 1).
- ``mxnet``: Gluon ``HybridSequential`` hybridized with ``static_alloc``/``static_shape``, ``autograd.record``,
  ``backward``, ``gluon.Trainer.step(batch_size)``; per step ``nd.take``. Threads: ``OMP_NUM_THREADS`` (read when
  libmxnet loads; the driver sets it as the harness's launcher does).
- ``jax``: a ``jax.jit``-compiled update step over a parameter dict (``lax`` convolution and pooling), optax SGD with
  momentum; per step the jitted function gets the state, the resident data and the step's index array;
  ``block_until_ready`` at the edges. Threads: with one thread, ``XLA_FLAGS`` turns XLA's Eigen pool off, as the
  harness's adapter does (``adapters/jax/runtime.py``, on any device: the flags concern XLA's CPU client only, so on
  a GPU they change nothing the step runs; nothing here sets ``JAX_PLATFORMS``). On a GPU: ``jax_default_device``
  is the GPU of ``--device cuda:N`` (JAX's default device for ``cuda:0``), where the data, indices and state are put;
  JAX without a GPU backend is an error, never a silent CPU run. On a GPU two more variants, each from the initial
  weights, change one thing: ``jit-host-indices`` gives each step its indices as numpy (copied by the jitted call),
  ``jit-donated`` donates the parameters and optimizer state to each step (``donate_argnums``).

Run from the repository root in the framework's environment (the thread variables as the harness's launcher sets
them: ``harness.execution.launcher.worker_settings``; ``harness_vs_loop.py`` does all of this)::

    OMP_NUM_THREADS=1 envs/pytorch/bin/python -m benchmarks.idiomatic_loops --framework pytorch --batch-size 64 \\
        --epochs 10 --threads 1

It prints one JSON object on standard output (its last line): per loop variant, the timed steps, samples and
seconds, the throughput, the final training loss and the test accuracy, and ``best``/``throughput``: the fastest
variant. Supported layers: conv2d, maxpool2d, avgpool2d, flatten, dense, relu (and a trailing softmax, folded into
the loss); optimizer: sgd. Devices: ``--device cpu`` (default) for every framework; ``--device cuda:N`` for PyTorch
and JAX only: TensorFlow and MXNet are refused with one line (``device_refusal``: their GPU builds are not installed
on the GPU machines this benchmark is run on), before anything is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.neutral import datasets, models  # noqa: E402
from harness.spec import load as load_spec  # noqa: E402
from harness.spec.devices import device_index  # noqa: E402

SUPPORTED = {"conv2d", "maxpool2d", "avgpool2d", "flatten", "dense", "relu", "softmax"}
#: The loops that run on a GPU (``--device cuda:N``); the others run on the CPU only.
GPU_LOOPS = ("pytorch", "jax")
DEVICE = re.compile(r"cpu|cuda:\d+")


def device_refusal(framework: str, device: str) -> str | None:
    """Why ``framework``'s loop does not run on ``device`` (one line), or None when it does: TensorFlow's and
    MXNet's loops on a GPU (their GPU builds are not available on the GPU machines). Imports nothing."""
    if device.startswith("cuda") and framework not in GPU_LOOPS:
        return (f"{framework} not supported on a GPU in this benchmark: no {framework} GPU build on the GPU machines "
                f"(on {device} only {' and '.join(GPU_LOOPS)} run)")
    return None


class Job:
    """What one loop trains and how long: the model, data, initial weights, optimizer and the step schedule."""

    def __init__(self, args: argparse.Namespace):
        spec = load_spec(args.spec)
        self.seed = spec.seed if args.seed is None else args.seed
        self.batch = args.batch_size
        self.epochs = args.epochs
        self.warmup = spec.warmup_steps if args.warmup_steps is None else args.warmup_steps
        self.threads = args.threads
        self.device = args.device
        self.data = datasets.load(spec.dataset, seed=self.seed)
        self.info = models.analyze(spec.model, tuple(self.data.x_train.shape[1:]), self.data.num_classes)
        unsupported = {layer.kind for layer in self.info.layers} - SUPPORTED
        if unsupported:
            raise SystemExit(f"idiomatic_loops: layers {sorted(unsupported)} are not supported (only "
                             f"{sorted(SUPPORTED)})")
        if spec.optimizer.name != "sgd" or spec.optimizer.weight_decay:
            raise SystemExit("idiomatic_loops: only sgd without weight decay is supported")
        if spec.accumulation_steps != 1 or spec.augmentation or spec.learning_rate_scaling != "none":
            raise SystemExit("idiomatic_loops: no gradient accumulation, augmentation or learning-rate scaling")
        self.lr, self.momentum = spec.optimizer.learning_rate, spec.optimizer.momentum
        self.weights = models.initial_weights(self.info, self.seed)
        self.n = len(self.data.y_train)
        self.steps_per_epoch = self.n // self.batch
        self.total_steps = self.steps_per_epoch * self.epochs
        if self.steps_per_epoch == 0 or self.warmup >= self.total_steps:
            raise SystemExit(f"idiomatic_loops: batch {self.batch} x {self.epochs} epochs leaves no step to time "
                             f"after {self.warmup} warm-up steps")

    def step_indices(self) -> list[np.ndarray]:
        """int64 (B,) indices of every optimizer step of the run, in order: each epoch's ``epoch_order`` in full
        batches (the remainder dropped), as the harness's loop takes them."""
        out = []
        for epoch in range(self.epochs):
            order = datasets.epoch_order(self.n, self.seed, epoch)
            out.extend(order[s * self.batch:(s + 1) * self.batch] for s in range(self.steps_per_epoch))
        return out

    def hwc_weights(self) -> dict[str, np.ndarray]:
        """The canonical weights in a channel-last framework's layout: conv HWIO, dense (in, out), the first dense
        layer after a flatten of (C, H, W) with its input rows in (H, W, C) order (as the harness's TF/JAX adapters)."""
        out: dict[str, np.ndarray] = {}
        flatten_from = None
        for layer in self.info.layers:
            w, b = f"{layer.index}.weight", f"{layer.index}.bias"
            if layer.kind == "flatten" and len(layer.input_shape) == 3:
                flatten_from = tuple(layer.input_shape)
            elif layer.kind == "conv2d":
                out[w], out[b] = self.weights[w].transpose(2, 3, 1, 0), self.weights[b]
            elif layer.kind == "dense":
                weight = self.weights[w]
                if flatten_from is not None:
                    weight, flatten_from = weight[:, models.chw_to_hwc_permutation(flatten_from)], None
                out[w], out[b] = np.ascontiguousarray(weight.T), self.weights[b]
        return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}

    def record(self, timed_steps: int, seconds: float, final_loss: float, accuracy: float) -> dict[str, Any]:
        return {"timed_steps": timed_steps, "timed_samples": timed_steps * self.batch, "timed_seconds": seconds,
                "throughput": timed_steps * self.batch / seconds, "final_train_loss": final_loss,
                "test_accuracy": accuracy}


# ------------------------------------------------------------------------------------------------------- PyTorch

def run_pytorch(job: Job) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    gpu = job.device.startswith("cuda")
    if gpu:
        if not torch.cuda.is_available() or device_index(job.device) >= torch.cuda.device_count():
            raise SystemExit(f"idiomatic_loops: PyTorch {torch.__version__} (CUDA {torch.version.cuda}) sees "
                             f"{torch.cuda.device_count()} CUDA device(s); {job.device} is not one")
        torch.cuda.set_device(device_index(job.device))
        # fp32 means fp32, as the adapter sets it: no TF32 in matmuls or convolutions (cuDNN's default allows it)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device(job.device)
    torch.set_num_threads(job.threads)
    torch.set_num_interop_threads(1)
    torch.manual_seed(job.seed)

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        """The network from the job's initial weights on the device, and its optimizer."""
        layers: list[nn.Module] = []
        for layer in job.info.layers:
            spec = layer.spec
            if layer.kind in ("conv2d", "dense"):
                module = (nn.Conv2d(layer.input_shape[0], spec.filters, spec.kernel_size,
                                    padding=spec.kernel_size // 2 if spec.padding == "same" else 0)
                          if layer.kind == "conv2d" else nn.Linear(layer.input_shape[0], spec.units))
                with torch.no_grad():
                    module.weight.copy_(torch.from_numpy(job.weights[f"{layer.index}.weight"]))
                    module.bias.copy_(torch.from_numpy(job.weights[f"{layer.index}.bias"]))
                layers.append(module)
                if spec.activation == "relu":
                    layers.append(nn.ReLU())
            elif layer.kind in ("maxpool2d", "avgpool2d"):
                pool = nn.MaxPool2d if layer.kind == "maxpool2d" else nn.AvgPool2d
                layers.append(pool(spec.pool_size, spec.stride or spec.pool_size))
            elif layer.kind == "flatten":
                layers.append(nn.Flatten())
            elif layer.kind == "relu":
                layers.append(nn.ReLU())
        net = nn.Sequential(*layers).to(device).train()
        return net, torch.optim.SGD(net.parameters(), lr=job.lr, momentum=job.momentum)

    # NCHW, resident, with the default (contiguous_format) strides. torch.tensor of the transposed NHWC array would
    # keep NHWC strides (channels-last memory), and x[idx] would keep them too, sending the convolution down
    # PyTorch's channels-last kernels: another algorithm than the harness's adapter runs (its index_select returns
    # a contiguous_format batch), not a lighter loop.
    x = torch.empty(job.data.x_train.shape[0], *job.info.input_shape)
    x.copy_(torch.from_numpy(job.data.x_train).permute(0, 3, 1, 2))
    x = x.to(device)  # the same tensor on the CPU; on a GPU the copy keeps the contiguous strides
    y = torch.from_numpy(job.data.y_train).to(device)
    indices = job.step_indices()

    def run(on_device: bool) -> dict[str, Any]:
        """One run from the initial weights: ``on_device``, every step's indices on the device before the clock;
        else each step's copied there as it is queued (``non_blocking`` from pageable memory: what the harness's
        adapter did until 2026-11-27, kept as a variant on a GPU to show that copy's cost)."""
        net, opt = build()
        batches: list[Any] = [torch.from_numpy(idx).to(device) for idx in indices] if on_device else indices

        def train(steps: list[Any]) -> torch.Tensor:
            for idx in steps:
                if not on_device:
                    idx = torch.from_numpy(idx).to(device, non_blocking=True)
                opt.zero_grad()
                loss = F.cross_entropy(net(x[idx]), y[idx])
                loss.backward()
                opt.step()
            return loss

        if job.warmup:
            train(batches[:job.warmup]).item()
        if gpu:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = train(batches[job.warmup:])
        if gpu:
            torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            final = loss.item()  # after the clock, as the harness reads its loss after the window's wait
        else:
            final = loss.item()  # the CPU is synchronous; the read is the edge anyway
            seconds = time.perf_counter() - start
        net.eval()
        with torch.no_grad():
            logits = net(torch.from_numpy(job.data.x_test).permute(0, 3, 1, 2).contiguous().to(device))
        accuracy = float((logits.argmax(1).cpu() == torch.from_numpy(job.data.y_test)).float().mean())
        return job.record(len(batches) - job.warmup, seconds, final, accuracy)

    variants = {"eager": run(True)}
    if gpu:
        variants["eager-host-indices"] = run(False)
    versions = {"torch": torch.__version__, "device": str(x.device), "intra_op_threads": torch.get_num_threads(),
                "inter_op_threads": torch.get_num_interop_threads()}
    if gpu:
        versions.update({"cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(device),
                         "allow_tf32": torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32})
    return variants, versions


# ---------------------------------------------------------------------------------------------------- TensorFlow

def run_tensorflow(job: Job) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    tf.config.set_visible_devices([], "GPU")
    tf.config.threading.set_intra_op_parallelism_threads(job.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.random.set_seed(job.seed)
    weights = job.hwc_weights()
    c, h, w = job.info.input_shape

    def make_model() -> keras.Model:
        model = keras.Sequential([keras.Input((h, w, c))])
        for layer in job.info.layers:
            spec = layer.spec
            if layer.kind == "conv2d":
                model.add(keras.layers.Conv2D(spec.filters, spec.kernel_size, padding=spec.padding,
                                              activation=spec.activation if spec.activation == "relu" else None))
            elif layer.kind == "dense":
                model.add(keras.layers.Dense(spec.units,
                                             activation=spec.activation if spec.activation == "relu" else None))
            elif layer.kind in ("maxpool2d", "avgpool2d"):
                pool = keras.layers.MaxPooling2D if layer.kind == "maxpool2d" else keras.layers.AveragePooling2D
                model.add(pool(spec.pool_size, spec.stride or spec.pool_size))
            elif layer.kind == "flatten":
                model.add(keras.layers.Flatten())
            elif layer.kind == "relu":
                model.add(keras.layers.ReLU())
        params = [layer for layer in job.info.layers if layer.kind in ("conv2d", "dense")]
        for keras_layer, layer in zip([lyr for lyr in model.layers if lyr.weights], params):
            keras_layer.set_weights([weights[f"{layer.index}.weight"], weights[f"{layer.index}.bias"]])
        return model

    x = tf.constant(job.data.x_train)  # NHWC, resident
    y = tf.constant(job.data.y_train)
    x_test, y_test = tf.constant(job.data.x_test), job.data.y_test
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def accuracy(model: keras.Model) -> float:
        return float(np.mean(np.argmax(model(x_test, training=False).numpy(), axis=1) == y_test))

    results: dict[str, dict[str, Any]] = {}

    # tf.function custom loop: the step's indices are a tensor made before the clock starts.
    model = make_model()
    optimizer = keras.optimizers.SGD(job.lr, momentum=job.momentum)

    @tf.function(jit_compile=False)
    def train_step(idx: tf.Tensor) -> tf.Tensor:
        xb, yb = tf.gather(x, idx), tf.gather(y, idx)
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    batches = [tf.constant(idx) for idx in job.step_indices()]
    for idx in batches[:job.warmup]:
        train_step(idx).numpy()
    start = time.perf_counter()
    for idx in batches[job.warmup:]:
        loss = train_step(idx)
    final = float(loss.numpy())  # waits for the last step
    seconds = time.perf_counter() - start
    results["tf_function"] = job.record(len(batches) - job.warmup, seconds, final, accuracy(model))

    # Keras fit on a tf.data pipeline of the resident tensors (its own shuffle; full batches only).
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(job.lr, momentum=job.momentum), loss=loss_fn, jit_compile=False)
    dataset = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(job.n, seed=job.seed, reshuffle_each_iteration=True)
               .batch(job.batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
    if job.warmup:
        model.fit(dataset.take(job.warmup), epochs=1, verbose=0, shuffle=False)
    start = time.perf_counter()
    # fit returns after it has read the last epoch's loss: the end edge is synced
    history = model.fit(dataset, epochs=job.epochs, verbose=0, shuffle=False)
    seconds = time.perf_counter() - start
    results["keras_fit"] = job.record(job.total_steps, seconds, float(history.history["loss"][-1]), accuracy(model))
    versions = {"tensorflow": tf.__version__, "keras": keras.__version__,
                "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
                "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads()}
    return results, versions


# --------------------------------------------------------------------------------------------------------- MXNet

def run_mxnet(job: Job) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    import builtins
    import warnings

    with warnings.catch_warnings():  # MXNet 1.9.1 needs numpy's removed aliases (as adapters/mxnet/runtime.py restores)
        warnings.simplefilter("ignore")
        for alias in ("bool", "int", "float", "complex", "object", "str"):
            if not hasattr(np, alias):
                setattr(np, alias, getattr(builtins, alias))
        import mxnet as mx
        from mxnet import autograd, gluon, nd
        from mxnet.gluon import nn

    ctx = mx.cpu()
    mx.random.seed(job.seed)
    net = nn.HybridSequential()
    blocks = {}
    for layer in job.info.layers:
        spec = layer.spec
        if layer.kind == "conv2d":
            block = nn.Conv2D(spec.filters, spec.kernel_size, in_channels=layer.input_shape[0],
                              padding=spec.kernel_size // 2 if spec.padding == "same" else 0,
                              activation="relu" if spec.activation == "relu" else None)
        elif layer.kind == "dense":
            block = nn.Dense(spec.units, in_units=layer.input_shape[0],
                             activation="relu" if spec.activation == "relu" else None)
        elif layer.kind in ("maxpool2d", "avgpool2d"):
            pool = nn.MaxPool2D if layer.kind == "maxpool2d" else nn.AvgPool2D
            block = pool(spec.pool_size, spec.stride or spec.pool_size)
        elif layer.kind == "flatten":
            block = nn.Flatten()
        elif layer.kind == "relu":
            block = nn.Activation("relu")
        else:
            continue
        net.add(block)
        if layer.kind in ("conv2d", "dense"):
            blocks[layer.index] = block
    net.initialize(mx.init.Zero(), ctx=ctx)
    for index, block in blocks.items():
        block.weight.set_data(nd.array(job.weights[f"{index}.weight"], ctx=ctx))
        block.bias.set_data(nd.array(job.weights[f"{index}.bias"], ctx=ctx))
    net.hybridize(static_alloc=True, static_shape=True)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": job.lr, "momentum": job.momentum},
                            kvstore=None)
    x = nd.array(job.data.x_train.transpose(0, 3, 1, 2), ctx=ctx)  # NCHW, resident
    y = nd.array(job.data.y_train, ctx=ctx, dtype=np.int64)
    batches = [nd.array(idx, ctx=ctx, dtype=np.int64) for idx in job.step_indices()]
    nd.waitall()

    def train(steps: list[Any]) -> Any:
        for idx in steps:
            with autograd.record():
                loss = loss_fn(net(nd.take(x, idx)), nd.take(y, idx))
            loss.backward()
            trainer.step(job.batch)
        return loss

    if job.warmup:
        train(batches[:job.warmup])
    nd.waitall()
    start = time.perf_counter()
    loss = train(batches[job.warmup:])
    nd.waitall()
    seconds = time.perf_counter() - start
    logits = net(nd.array(job.data.x_test.transpose(0, 3, 1, 2), ctx=ctx))
    accuracy = float(np.mean(logits.asnumpy().argmax(axis=1) == job.data.y_test))
    result = job.record(len(batches) - job.warmup, seconds, float(loss.mean().asscalar()), accuracy)
    versions = {"mxnet": mx.__version__, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", ""),
                "MXNET_CPU_WORKER_NTHREADS": os.environ.get("MXNET_CPU_WORKER_NTHREADS", "")}
    return {"gluon_hybridized": result}, versions


# ----------------------------------------------------------------------------------------------------------- JAX

def run_jax(job: Job) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    # The same thread setting as adapters/jax/runtime.py: with one thread, XLA's Eigen pool off (before jax is
    # imported).
    if os.environ.get("OMP_NUM_THREADS") == "1" and "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
        # flags only: a token without the dashes ends XLA's parsing of the rest (adapters.declaration.append_flags)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    import jax
    import jax.numpy as jnp
    import optax

    if job.device.startswith("cuda"):
        try:
            gpus = jax.devices("gpu")
        except RuntimeError as err:  # no GPU backend (a CPU-only jaxlib, or JAX_PLATFORMS without it)
            raise SystemExit(f"idiomatic_loops: JAX {jax.__version__} has no GPU for {job.device} "
                             f"(JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}): {err}") from None
        if device_index(job.device) >= len(gpus):
            raise SystemExit(f"idiomatic_loops: JAX sees {len(gpus)} GPU(s); {job.device} is not one")
        # every array and jitted call below without a device of its own goes there (cuda:0 is JAX's default anyway)
        jax.config.update("jax_default_device", gpus[device_index(job.device)])
    jax.config.update("jax_default_matmul_precision", "highest")  # as the adapter (fp32; no effect on the CPU)
    forward_layers: list[Callable[[dict[str, jax.Array], jax.Array], jax.Array]] = []
    for layer in job.info.layers:
        spec, i = layer.spec, layer.index
        if layer.kind == "conv2d":
            relu = spec.activation == "relu"
            forward_layers.append(_jax_conv(f"{i}.weight", f"{i}.bias", spec.padding.upper(), relu))
        elif layer.kind == "dense":
            forward_layers.append(_jax_dense(f"{i}.weight", f"{i}.bias", spec.activation == "relu"))
        elif layer.kind in ("maxpool2d", "avgpool2d"):
            forward_layers.append(_jax_pool(layer.kind, spec.pool_size, spec.stride or spec.pool_size))
        elif layer.kind == "flatten":
            forward_layers.append(lambda p, x: x.reshape(x.shape[0], -1))
        elif layer.kind == "relu":
            forward_layers.append(lambda p, x: jax.nn.relu(x))

    def forward(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        for fn in forward_layers:
            x = fn(p, x)
        return x

    tx = optax.sgd(job.lr, momentum=job.momentum)

    def loss_fn(p: dict[str, jax.Array], xb: jax.Array, yb: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(forward(p, xb), yb).mean()

    def train_step(p: Any, state: Any, x: jax.Array, y: jax.Array, idx: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(p, x[idx], y[idx])
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    x = jax.device_put(job.data.x_train)  # NHWC, resident
    y = jax.device_put(job.data.y_train.astype(np.int32))
    host = [idx.astype(np.int32) for idx in job.step_indices()]
    on_device = [jax.device_put(idx) for idx in host]
    jax.block_until_ready(on_device)
    gpu = job.device.startswith("cuda")

    def run(batches: list[Any], donate: bool) -> dict[str, Any]:
        """One run from the initial weights over ``batches`` (device arrays, or numpy that each jitted call copies
        to the device), the parameters and optimizer state donated to each step or not."""
        step = jax.jit(train_step, donate_argnums=(0, 1) if donate else ())
        params = {k: jnp.asarray(v) for k, v in job.hwc_weights().items()}
        opt_state = tx.init(params)
        loss = None
        for idx in batches[:job.warmup]:
            params, opt_state, loss = step(params, opt_state, x, y, idx)
        jax.block_until_ready((params, opt_state, loss))
        start = time.perf_counter()
        for idx in batches[job.warmup:]:
            params, opt_state, loss = step(params, opt_state, x, y, idx)
        jax.block_until_ready((params, opt_state, loss))
        seconds = time.perf_counter() - start
        logits = jax.jit(forward)(params, jax.device_put(job.data.x_test))
        accuracy = float(np.mean(np.asarray(logits).argmax(axis=1) == job.data.y_test))
        return job.record(len(batches) - job.warmup, seconds, float(loss), accuracy)

    variants = {"jit": run(on_device, donate=False)}
    if gpu:  # what the harness's JAX step does differently, one at a time (XLA's CPU client cannot donate)
        variants["jit-host-indices"] = run(host, donate=False)
        variants["jit-donated"] = run(on_device, donate=True)
    versions = {"jax": jax.__version__, "optax": optax.__version__, "device": str(next(iter(x.devices()))),
                "platform": next(iter(x.devices())).platform, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    return variants, versions


def _jax_conv(w: str, b: str, padding: str, relu: bool) -> Callable[..., Any]:
    import jax
    from jax import lax

    def conv(p: dict[str, Any], x: Any) -> Any:
        out = lax.conv_general_dilated(x, p[w], (1, 1), padding, dimension_numbers=("NHWC", "HWIO", "NHWC")) + p[b]
        return jax.nn.relu(out) if relu else out
    return conv


def _jax_dense(w: str, b: str, relu: bool) -> Callable[..., Any]:
    import jax

    def dense(p: dict[str, Any], x: Any) -> Any:
        out = x @ p[w] + p[b]
        return jax.nn.relu(out) if relu else out
    return dense


def _jax_pool(kind: str, size: int, stride: int) -> Callable[..., Any]:
    import jax.numpy as jnp
    from jax import lax

    def pool(p: dict[str, Any], x: Any) -> Any:
        window, strides = (1, size, size, 1), (1, stride, stride, 1)
        if kind == "maxpool2d":
            return lax.reduce_window(x, -jnp.inf, lax.max, window, strides, "VALID")
        return lax.reduce_window(x, 0.0, lax.add, window, strides, "VALID") / (size * size)
    return pool


LOOPS: dict[str, Callable[[Job], tuple[dict[str, dict[str, Any]], dict[str, Any]]]] = {
    "pytorch": run_pytorch, "tensorflow": run_tensorflow, "mxnet": run_mxnet, "jax": run_jax}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--framework", required=True, choices=sorted(LOOPS))
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--spec", default=str(ROOT / "specs" / "quick.yaml"),
                        help="model, dataset, optimizer, seed and warm-up come from it (default: specs/quick.yaml)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: the spec's")
    parser.add_argument("--threads", type=int, default=1, help="intra-op CPU threads (inter-op 1; default: 1)")
    parser.add_argument("--seed", type=int, default=None, help="default: the spec's")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default) or cuda:N (PyTorch and JAX only; cuda means cuda:0)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        args.device = "cuda:0"
    if not DEVICE.fullmatch(args.device):
        parser.error(f"--device is cpu or cuda:N, not {args.device!r}")
    if (refusal := device_refusal(args.framework, args.device)) is not None:
        raise SystemExit(f"idiomatic_loops: {refusal}")
    job = Job(args)
    variants, versions = LOOPS[args.framework](job)
    best = max(variants, key=lambda name: variants[name]["throughput"])
    print(json.dumps({"framework": args.framework, "device": job.device, "batch_size": job.batch, "epochs": job.epochs,
                      "warmup_steps": job.warmup, "steps_per_epoch": job.steps_per_epoch, "threads": job.threads,
                      "variants": variants, "best": best, "throughput": variants[best]["throughput"],
                      "versions": versions}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
