"""Shared checks for the per-framework adapter suites: every adapter is held to the same tests."""

from __future__ import annotations

import numpy as np
import pytest

from adapters.base import RunOptions
from harness.neutral import datasets, models
from harness.spec import DigitsData, ModelSpec, OptimizerSpec
from tests.trials import run_options

# The seed-002 CNN, sized for 8x8 digits: conv 3x3 same (32) -> maxpool 2 -> flatten -> dense 128 -> dense 10.
CNN = ModelSpec.model_validate({"layers": [
    {"type": "conv2d", "filters": 32, "kernel_size": 3, "padding": "same", "activation": "relu",
     "kernel_init": "he_uniform"},
    {"type": "maxpool2d", "pool_size": 2},
    {"type": "flatten"},
    {"type": "dense", "units": 128, "activation": "relu", "kernel_init": "he_uniform"},
    {"type": "dense", "units": 10},
]})
SGD = OptimizerSpec(name="sgd", learning_rate=0.05, momentum=0.9)


def digits(model: ModelSpec = CNN):
    data = datasets.load(DigitsData(name="digits"))
    info = models.analyze(model, data.x_train.shape[1:], data.num_classes)
    return data, info


def make(adapter_cls, seed: int = 0, optimizer: OptimizerSpec = SGD, threads: int = 2,
         weights: dict[str, np.ndarray] | None = None, model: ModelSpec = CNN):
    """A prepared, built and loaded adapter on the CPU, with the digits data and ``model`` (default the CNN), holding
    ``weights`` (default: the canonical ``models.initial_weights(info, seed)``; it may hold buffers too)."""
    data, info = digits(model)
    adapter = adapter_cls()
    adapter.prepare("cpu", threads, seed)
    adapter.build(info, models.initial_weights(info, seed) if weights is None else weights, optimizer)
    adapter.load(data)
    return adapter, data, info


def epoch_batches(n: int, batch_size: int, epoch: int, seed: int = 0) -> list[np.ndarray]:
    """The full batches of epoch ``epoch`` in the harness's order (``datasets.epoch_order``); a last partial batch is
    dropped, as the harness's loop does."""
    order = datasets.epoch_order(n, seed, epoch)
    return [order[start:start + batch_size] for start in range(0, n - batch_size + 1, batch_size)]


def batches(n: int, batch_size: int, steps: int, seed: int = 0) -> list[np.ndarray]:
    """The first ``steps`` batches of a run, epoch after epoch: what every framework is fed in the same order."""
    out: list[np.ndarray] = []
    epoch = 0
    while len(out) < steps:
        out.extend(epoch_batches(n, batch_size, epoch, seed))
        epoch += 1
    return out[:steps]


def train_epochs(adapter, data, epochs: int, batch_size: int, seed: int = 0) -> list[float]:
    """Trains for real; returns the mean of the synced losses of each epoch."""
    means = []
    for epoch in range(epochs):
        losses = train_on(adapter, epoch_batches(len(data.y_train), batch_size, epoch, seed))[0]
        means.append(float(np.mean(losses)))
    return means


def train_on(adapter, steps: list[np.ndarray], keep: tuple[int, ...] = (), micro_batches: int = 1,
             staged: bool = False) -> tuple[list[float], dict[int, dict[str, np.ndarray]]]:
    """One train_step per batch in ``steps`` (of ``micro_batches`` micro-batches each), the loss read after each;
    ``staged``: the steps are the epoch the adapter staged (``stage_epoch``), each told its position. Returns the
    loss of every step and the canonical state after each step count in ``keep`` (0: before the first step): the
    weights (``get_weights``) and the buffers (``get_buffers``, batchnorm's running statistics) in one dict."""
    losses: list[float] = []
    kept: dict[int, dict[str, np.ndarray]] = {}
    if 0 in keep:
        kept[0] = {**adapter.get_weights(), **adapter.get_buffers()}
    for count, batch in enumerate(steps, start=1):
        adapter.train_step(batch, micro_batches=micro_batches, position=count - 1 if staged else None)
        losses.append(adapter.read_loss()[0])
        if count in keep:
            kept[count] = {**adapter.get_weights(), **adapter.get_buffers()}
    return losses, kept


def max_differences(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, float]:
    """The largest absolute difference between same-named arrays of ``a`` and ``b``, and the largest relative one
    (|a - b| / |b| over the elements where |b| > 1e-3, so that near-zero entries do not dominate). For reporting how
    close two frameworks came; the assertions use ``np.testing.assert_allclose``."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    abs_max = rel_max = 0.0
    for name, ref in b.items():
        diff = np.abs(np.asarray(a[name], np.float64) - np.asarray(ref, np.float64))
        abs_max = max(abs_max, float(diff.max(initial=0.0)))
        big = np.abs(ref) > 1e-3
        rel_max = max(rel_max, float((diff[big] / np.abs(ref[big])).max(initial=0.0)))
    return abs_max, rel_max


def check_learns_digits(adapter_cls) -> None:
    """Loss falls and test accuracy ends well above chance (10%) after a short real training run on the CPU."""
    adapter, data, _ = make(adapter_cls)
    loss0, acc0 = adapter.evaluate(256)
    epoch_losses = train_epochs(adapter, data, epochs=3, batch_size=32)
    loss1, acc1 = adapter.evaluate(256)
    assert np.isfinite(epoch_losses).all()
    assert epoch_losses[-1] < 0.5 * epoch_losses[0], epoch_losses
    assert loss1 < 0.5 * loss0, (loss0, loss1)
    assert acc0 < 0.3 and acc1 > 0.9, (acc0, acc1)


def check_same_initial_weights_and_logits(adapter_cls) -> None:
    """The adapter holds exactly the canonical initial weights, and its logits match a numpy forward pass."""
    adapter, data, info = make(adapter_cls)
    weights = models.initial_weights(info, 0)
    held = adapter.get_weights()
    assert sorted(held) == sorted(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(held[name], value, err_msg=name)
    images = data.x_test[:16]
    np.testing.assert_allclose(adapter.predict(images), numpy_forward(info, weights, images), rtol=1e-4, atol=1e-5)


def check_parameter_count(adapter_cls) -> None:
    _, _, info = make(adapter_cls)
    adapter = make(adapter_cls)[0]
    assert sum(v.size for v in adapter.get_weights().values()) == info.parameter_count == 67_274


def numpy_forward(info, weights, images: np.ndarray, training: bool = False,
                  batch_stats: dict[int, tuple[np.ndarray, np.ndarray]] | None = None) -> np.ndarray:
    """A float64 reference forward pass in the canonical layout, written independently of every framework.

    Inference mode (default): batchnorm normalises with the running statistics, ``weights``' "<i>.running_mean" /
    "<i>.running_var" if it has them, else 0 and 1; dropout is the identity. ``training``: batchnorm normalises with
    the batch's mean and biased variance, and ``batch_stats`` (if given) receives each batchnorm's (mean, biased
    variance) by layer index; dropout is still the identity (its masks are the frameworks' own)."""
    x = images.astype(np.float64).transpose(0, 3, 1, 2)  # NCHW
    for layer in info.layers:
        spec = layer.spec
        if layer.kind == "conv2d":
            w, b = weights[f"{layer.index}.weight"].astype(np.float64), weights[f"{layer.index}.bias"]
            k = spec.kernel_size
            if spec.padding == "same":
                x = np.pad(x, ((0, 0), (0, 0), (k // 2, k // 2), (k // 2, k // 2)))
            n, c, h, wd = x.shape
            ho, wo = h - k + 1, wd - k + 1
            patches = np.stack([x[:, :, i:i + ho, j:j + wo] for i in range(k) for j in range(k)], axis=-1)
            # patches: (N, C, Ho, Wo, k*k); weights (O, C, k, k)
            x = np.einsum("nchwk,ock->nohw", patches, w.reshape(w.shape[0], c, k * k)) + b[None, :, None, None]
            if spec.activation == "relu":
                x = np.maximum(x, 0)
        elif layer.kind == "maxpool2d":
            p, s = spec.pool_size, spec.stride or spec.pool_size
            ho, wo = layer.output_shape[1:]
            x = np.max(np.stack([x[:, :, i:i + s * ho:s, j:j + s * wo:s] for i in range(p) for j in range(p)]), axis=0)
        elif layer.kind == "avgpool2d":
            p, s = spec.pool_size, spec.stride or spec.pool_size
            ho, wo = layer.output_shape[1:]
            x = np.mean(np.stack([x[:, :, i:i + s * ho:s, j:j + s * wo:s] for i in range(p) for j in range(p)]), axis=0)
        elif layer.kind == "global_avgpool2d":
            x = x.mean(axis=(2, 3))
        elif layer.kind == "batchnorm":
            axes = (0, 2, 3) if x.ndim == 4 else (0,)
            shape = (1, -1, 1, 1) if x.ndim == 4 else (1, -1)
            if training:
                mean, var = x.mean(axis=axes), x.var(axis=axes)  # the biased batch variance
                if batch_stats is not None:
                    batch_stats[layer.index] = (mean, var)
            else:
                mean = weights.get(f"{layer.index}.running_mean", np.zeros(x.shape[1])).astype(np.float64)
                var = weights.get(f"{layer.index}.running_var", np.ones(x.shape[1])).astype(np.float64)
            gamma, beta = weights[f"{layer.index}.weight"], weights[f"{layer.index}.bias"]
            x = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + spec.epsilon) * gamma.reshape(shape) \
                + beta.reshape(shape)
        elif layer.kind == "flatten":
            x = x.reshape(x.shape[0], -1)
        elif layer.kind == "dense":
            x = x @ weights[f"{layer.index}.weight"].astype(np.float64).T + weights[f"{layer.index}.bias"]
            if spec.activation == "relu":
                x = np.maximum(x, 0)
        elif layer.kind == "relu":
            x = np.maximum(x, 0)
    return x


def check_allocator_options_on_cpu(adapter_cls) -> None:
    """The worker sets ``options`` before ``prepare``. On the CPU a memory limit and memory growth off are accepted
    and are no-ops for the adapter (the worker caps a CPU worker process itself): it trains, and its settings claim
    neither a framework memory limit nor a memory-growth setting."""
    data, info = digits()
    adapter = adapter_cls()
    adapter.options = run_options({"tensorflow_memory_growth": False, "memory_limit_bytes": 2 * 10**9})
    adapter.prepare("cpu", 2, 0)
    adapter.build(info, models.initial_weights(info, 0), SGD)
    adapter.load(data)
    adapter.train_step(batches(len(data.y_train), 32, 1)[0])
    assert np.isfinite(adapter.read_loss()[0])
    settings = adapter.settings()
    assert not {"memory_limit_bytes", "memory_limit", "memory_growth"} & set(settings), settings
    assert adapter_cls.options == RunOptions()  # the instance's options, not the class default, were set


# A small model with every layer kind that has a training and an inference mode, or buffers.
NORM_CNN = ModelSpec.model_validate({"layers": [
    {"type": "conv2d", "filters": 8, "kernel_size": 3, "padding": "same", "kernel_init": "he_uniform"},
    {"type": "batchnorm"}, {"type": "relu"}, {"type": "avgpool2d", "pool_size": 2},
    {"type": "flatten"}, {"type": "batchnorm", "momentum": 0.5}, {"type": "dropout", "rate": 0.2},
    {"type": "dense", "units": 10},
]})


def check_inference_after_training(adapter_cls) -> None:
    """After training steps (batchnorm in training mode, dropout on), predict and evaluate run in inference mode on
    the state the adapter reports: its logits are the numpy reference's on ``get_weights`` + ``get_buffers``. predict
    follows the last train_step without a sync in between, so an adapter whose running statistics are still being
    written (asynchronous engines) would be caught."""
    adapter, data, info = make(adapter_cls, model=NORM_CNN)
    for batch in batches(len(data.y_train), 32, 3):
        adapter.train_step(batch)
    logits = adapter.predict(data.x_test)
    state = {**adapter.get_weights(), **adapter.get_buffers()}
    assert sorted(state) == sorted(info.param_names() + info.buffer_names())
    assert not np.allclose(state["1.running_var"], 1.0)  # the running statistics did move
    reference = numpy_forward(info, state, data.x_test)
    np.testing.assert_allclose(logits, reference, rtol=1e-4, atol=1e-5)
    shifted = reference - reference.max(axis=1, keepdims=True)
    ref_loss = float(-(shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True)))[
        np.arange(len(data.y_test)), data.y_test].mean())
    assert adapter.evaluate(64)[0] == pytest.approx(ref_loss, rel=1e-5)


def check_set_train_images(adapter_cls) -> None:
    """set_train_images overwrites the resident training images in place, also after the train step was compiled or
    traced: an adapter that steps on images A, is switched to B and steps again must end with exactly the weights of
    an adapter that was loaded with those images from the start."""
    import dataclasses

    adapter, data, _ = make(adapter_cls)
    original = data.x_train.copy()
    first, *rest = batches(len(data.y_train), 32, 4)
    augmented = datasets.augment(data.x_train, seed=0, epoch=0)
    given = augmented.copy()
    assert not np.allclose(augmented, data.x_train)
    train_on(adapter, [first])  # compiles / traces the step on the original images
    adapter.set_train_images(augmented)
    train_on(adapter, rest)
    # The adapter holds its own copy: neither the loaded dataset nor the array it was given may change (the harness
    # augments the original images again each epoch).
    np.testing.assert_array_equal(data.x_train, original)
    np.testing.assert_array_equal(augmented, given)
    mixed = augmented.copy()
    mixed[first] = data.x_train[first]  # the first batch saw the original images
    reference = adapter_cls()
    reference.prepare("cpu", 2, 0)
    _, info = digits()
    reference.build(info, models.initial_weights(info, 0), SGD)
    reference.load(dataclasses.replace(data, x_train=mixed))
    train_on(reference, [first, *rest])
    for name, value in reference.get_weights().items():
        np.testing.assert_allclose(adapter.get_weights()[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
    unaugmented, _, _ = make(adapter_cls)
    train_on(unaugmented, [first, *rest])
    assert max_differences(unaugmented.get_weights(), reference.get_weights())[0] > 1e-4  # the images did matter


def check_allocation_failure_is_oom(adapter, allocate, what: str) -> None:
    """``allocate()`` (an allocation the CPU allocator must refuse, of ``what``) raises, and ``adapter`` classifies
    whatever it raised as its OOM."""
    try:
        allocate()
    except BaseException as exc:  # noqa: BLE001 - the point is to classify whatever it raised
        assert adapter.is_oom(exc), repr(exc)
    else:
        raise AssertionError(f"an allocation of {what} succeeded")


def check_execution_declared(adapter, runs: list[tuple[str, str, str]], refuses: dict[tuple[str, str, str], str]):
    """``adapter`` accepts each (precision, compile, device) of ``runs`` and refuses each of ``refuses`` with a reason
    that starts with the given text; the registry (``adapters.unsupported``, what the plan decides from without
    importing the framework) gives the very same reasons, so plan time and the worker cannot disagree."""
    import adapters

    info = digits()[1]
    for precision, compile, device in runs:
        assert adapter.unsupported_execution(precision, compile, device) is None, (precision, compile, device)
        assert adapters.unsupported(adapter.name, info, precision, compile, device) is None
    for (precision, compile, device), start in refuses.items():
        why = adapter.unsupported_execution(precision, compile, device)
        assert why is not None and why.startswith(start), (precision, compile, device, why)
        assert adapters.unsupported(adapter.name, info, precision, compile, device) == why
