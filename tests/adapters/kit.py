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


def make(adapter_cls, seed: int = 0, optimizer: OptimizerSpec = SGD, threads: int = 2):
    """A prepared, built and loaded adapter on the CPU, with the digits data and the CNN."""
    data, info = digits()
    adapter = adapter_cls()
    adapter.prepare("cpu", threads, seed)
    adapter.build(info, models.initial_weights(info, seed), optimizer)
    adapter.load(data)
    return adapter, data, info


def train_epochs(adapter, data, epochs: int, batch_size: int, seed: int = 0) -> list[float]:
    """Trains for real; returns the mean of the synced losses of each epoch."""
    means = []
    n = len(data.y_train)
    for epoch in range(epochs):
        order = datasets.epoch_order(n, seed, epoch)
        losses = []
        for start in range(0, n - batch_size + 1, batch_size):
            adapter.train_step(order[start:start + batch_size])
            losses.append(adapter.sync())
        means.append(float(np.mean(losses)))
    return means


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
