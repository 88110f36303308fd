"""Shared checks for the per-framework adapter suites: every adapter is held to the same tests."""

from __future__ import annotations

import numpy as np

from harness import datasets, models
from harness.spec import DigitsData, ModelSpec, OptimizerSpec

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


def digits():
    data = datasets.load(DigitsData(name="digits"))
    info = models.analyze(CNN, data.x_train.shape[1:], data.num_classes)
    return data, info


def make(adapter_cls, seed: int = 0, optimizer: OptimizerSpec = SGD, threads: int = 2,
         weights: dict[str, np.ndarray] | None = None):
    """A prepared, built and loaded adapter on the CPU, with the digits data and the CNN, holding ``weights``
    (default: the canonical ``models.initial_weights(info, seed)``)."""
    data, info = digits()
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


def train_on(adapter, steps: list[np.ndarray], keep: tuple[int, ...] = ()) -> tuple[list[float],
                                                                                  dict[int, dict[str, np.ndarray]]]:
    """One train_step per batch in ``steps``, synced after each. Returns the loss of every step and the canonical
    weights (``get_weights``) after each step count in ``keep`` (0: before the first step)."""
    losses: list[float] = []
    kept: dict[int, dict[str, np.ndarray]] = {}
    if 0 in keep:
        kept[0] = adapter.get_weights()
    for count, batch in enumerate(steps, start=1):
        adapter.train_step(batch)
        losses.append(adapter.sync())
        if count in keep:
            kept[count] = adapter.get_weights()
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


def numpy_forward(info, weights, images: np.ndarray) -> np.ndarray:
    """A float64 reference forward pass in the canonical layout, written independently of every framework."""
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
        elif layer.kind == "flatten":
            x = x.reshape(x.shape[0], -1)
        elif layer.kind == "dense":
            x = x @ weights[f"{layer.index}.weight"].astype(np.float64).T + weights[f"{layer.index}.bias"]
            if spec.activation == "relu":
                x = np.maximum(x, 0)
        elif layer.kind == "relu":
            x = np.maximum(x, 0)
    return x
