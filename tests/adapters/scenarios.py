"""The scenarios the equivalence tests train every framework through, importable in any framework's environment
(tests/test_equivalence.py runs PyTorch, TensorFlow and MXNet in one process; tests/adapters/test_jax.py runs JAX in
its own environment through ``python -m tests.adapters.scenarios jax OUT.npz`` and compares with PyTorch).

``run(adapter_cls)`` trains and evaluates one framework through every scenario and returns flat arrays keyed
``"<scenario>|<step or what>|<array name>"``.
"""

from __future__ import annotations

import sys

import numpy as np

from harness.neutral import models
from harness.spec import ModelSpec, OptimizerSpec
from tests.adapters import kit

SGD = OptimizerSpec(name="sgd", learning_rate=0.05, momentum=0.9, weight_decay=1e-3)
# epsilon 1e-4: large enough that Keras's/MXNet's placement (added to sqrt(v) before the bias correction) instead of
# PyTorch's (after it) shows at once. Checked by undoing the epsilon rescaling of the MXNet adapter, then of the
# TensorFlow one: the parameters are 1.4e-3 off after the first step, 140 x PARAM_ATOL, and the loss curve 11 %.
ADAM = OptimizerSpec(name="adam", learning_rate=2e-3, epsilon=1e-4, weight_decay=1e-3)
OPTIMIZERS = {"sgd-momentum-wd": SGD, "adam-wd-eps1e-4": ADAM}

BATCH = 32


def _images(data, kind: str) -> np.ndarray:
    if kind == "digits":
        return data.x_test
    # Uniform noise: every pixel non-zero, unlike the digits' blank borders, so every kernel tap sees data everywhere.
    return np.random.default_rng(7).random((64, *data.x_test.shape[1:]), dtype=np.float32)


def _weights(info, kind: str) -> dict[str, np.ndarray]:
    weights = models.initial_weights(info, 0)
    if kind == "random-biases":
        # The canonical biases are all zero, which would leave the bias adds (and a bias applied to the wrong
        # axis) untested.
        rng = np.random.default_rng(11)
        weights = {name: (rng.normal(0.0, 0.1, value.shape).astype(np.float32) if name.endswith(".bias") else value)
                   for name, value in weights.items()}
    return weights


def _model(*layers: dict) -> ModelSpec:
    return ModelSpec.model_validate({"layers": list(layers)})


_CONV = {"type": "conv2d", "kernel_size": 3, "kernel_init": "he_uniform"}
NORM_MODELS = {
    # Batchnorm over conv channels with the defaults and with another momentum and epsilon, max and average pooling,
    # and a batchnorm over the flat features of a flatten: in TensorFlow, which flattens (H, W, C), those features
    # are permuted like the next dense layer's rows. Then dropout.
    "flatten": _model(
        {**_CONV, "filters": 8, "padding": "same"}, {"type": "batchnorm"}, {"type": "relu"},
        {"type": "maxpool2d", "pool_size": 2},
        {**_CONV, "filters": 16, "padding": "same"}, {"type": "batchnorm", "momentum": 0.2, "epsilon": 1e-3},
        {"type": "relu"}, {"type": "avgpool2d", "pool_size": 2},
        {"type": "flatten"}, {"type": "batchnorm", "momentum": 0.3},
        {"type": "dense", "units": 32, "activation": "relu", "kernel_init": "he_uniform"},
        {"type": "dropout", "rate": 0.5}, {"type": "dense", "units": 10}),
    # Overlapping average pooling (stride 1), a global average pool and a batchnorm over its (C,) output.
    "global-avgpool": _model(
        {**_CONV, "filters": 8}, {"type": "batchnorm"}, {"type": "relu"},
        {"type": "avgpool2d", "pool_size": 2, "stride": 1},
        {**_CONV, "filters": 16, "padding": "same"}, {"type": "relu"}, {"type": "dropout", "rate": 0.25},
        {"type": "global_avgpool2d"}, {"type": "batchnorm"}, {"type": "dense", "units": 10}),
}


def _without_dropout(model: ModelSpec) -> ModelSpec:
    return _model(*[layer.model_dump() for layer in model.layers if layer.type != "dropout"])


def _random_state(info) -> dict[str, np.ndarray]:
    """Weights and buffers in which nothing is at its default: random biases, gamma near 1, beta near 0, running
    means and variances away from 0 and 1 (so that a statistic applied to the wrong channel, a running variance read
    as a standard deviation or a swapped mean and variance all change the logits)."""
    rng = np.random.default_rng(5)
    state = {**models.initial_weights(info, 0), **models.initial_buffers(info)}
    for layer in info.layers:
        i = layer.index
        if layer.kind == "batchnorm":
            state[f"{i}.weight"] = rng.uniform(0.5, 1.5, layer.params["weight"]).astype(np.float32)
            state[f"{i}.running_mean"] = rng.normal(0.0, 0.5, layer.buffers["running_mean"]).astype(np.float32)
            state[f"{i}.running_var"] = rng.uniform(0.3, 3.0, layer.buffers["running_var"]).astype(np.float32)
        if layer.params:
            state[f"{i}.bias"] = rng.normal(0.0, 0.2, layer.params["bias"]).astype(np.float32)
    return state


def run(adapter_cls) -> dict[str, np.ndarray]:
    """Every scenario for one framework (see the module docstring)."""
    out: dict[str, np.ndarray] = {}

    def keep(prefix: str, result: tuple[list[float], dict[int, dict[str, np.ndarray]]]) -> None:
        out[f"{prefix}|losses|"] = np.asarray(result[0], dtype=np.float64)
        for step, state in result[1].items():
            for name, value in state.items():
                out[f"{prefix}|{step}|{name}"] = np.asarray(value)

    data, info = kit.digits()
    for weights_kind in ("initial", "random-biases"):
        for images_kind in ("digits", "noise"):
            adapter = kit.make(adapter_cls, weights=_weights(info, weights_kind))[0]
            out[f"logits-{weights_kind}-{images_kind}|predict|"] = adapter.predict(_images(data, images_kind))
    for name, optimizer in OPTIMIZERS.items():
        adapter, data, _ = kit.make(adapter_cls, optimizer=optimizer)
        keep(f"ten-{name}", kit.train_on(adapter, kit.batches(len(data.y_train), BATCH, 10), keep=(0, 1, 10)))
        adapter, data, _ = kit.make(adapter_cls, optimizer=optimizer)
        steps = kit.epoch_batches(len(data.y_train), BATCH, 0) + kit.epoch_batches(len(data.y_train), BATCH, 1)
        out[f"curve-{name}|losses|"] = np.asarray(kit.train_on(adapter, steps)[0])
        out[f"curve-{name}|evaluate|"] = np.asarray(adapter.evaluate(256))
    for k in (1, 4):
        adapter, data, _ = kit.make(adapter_cls, optimizer=OptimizerSpec(name="sgd", learning_rate=0.05, momentum=0.9))
        keep(f"accumulation-{k}", kit.train_on(adapter, kit.batches(len(data.y_train), BATCH, 3), keep=(0, 3),
                                               micro_batches=k))
    for model_name, model in NORM_MODELS.items():
        data, info = kit.digits(model)
        adapter = kit.make(adapter_cls, weights=_random_state(info), model=model)[0]
        out[f"norm-inference-{model_name}|predict|"] = adapter.predict(data.x_test)
        out[f"norm-inference-{model_name}|evaluate|"] = np.asarray(adapter.evaluate(100))
        adapter, data, _ = kit.make(adapter_cls, optimizer=SGD, model=_without_dropout(model))
        keep(f"norm-ten-{model_name}", kit.train_on(adapter, kit.batches(len(data.y_train), BATCH, 10),
                                                    keep=(0, 1, 10)))
    return out


if __name__ == "__main__":
    import adapters

    framework, path = sys.argv[1], sys.argv[2]
    np.savez(path, **run(adapters.get(framework)))
