"""The scenarios the equivalence tests train every framework through, importable in any framework's environment
(tests/test_equivalence.py runs PyTorch, TensorFlow and MXNet in one process; tests/adapters/test_jax.py runs JAX in
its own environment through ``python -m tests.adapters.scenarios jax OUT.npz [blocks]`` and compares with PyTorch).

``run(adapter_cls)`` trains and evaluates one framework through every scenario and returns flat arrays keyed
``"<scenario>|<step or what>|<array name>"``; ``run_blocks(adapter_cls)`` the same for the residual and transformer
models, in the frameworks that build them.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

from harness.neutral import datasets, models
from harness.spec import ModelSpec, OptimizerSpec, SyntheticData, SyntheticTokens
from tests.adapters import kit, loss_runs

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


def _keep(out: dict[str, np.ndarray], prefix: str,
          result: tuple[list[float], dict[int, dict[str, np.ndarray]]]) -> None:
    """Stores ``kit.train_on``'s losses and kept states in ``out`` under ``"<prefix>|<step or losses>|<name>"``."""
    out[f"{prefix}|losses|"] = np.asarray(result[0], dtype=np.float64)
    for step, state in result[1].items():
        for name, value in state.items():
            out[f"{prefix}|{step}|{name}"] = np.asarray(value)


def run(adapter_cls) -> dict[str, np.ndarray]:
    """Every scenario for one framework (see the module docstring)."""
    out: dict[str, np.ndarray] = {}
    keep = functools.partial(_keep, out)
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
    # the epoch losses the harness's loop reports, reading every 3 steps and slowed in auto windows (loss_runs)
    for name, cls, timing in (("fast", adapter_cls, loss_runs.FAST),
                              ("slow", loss_runs.slowed(adapter_cls), loss_runs.SLOW)):
        out[f"loop-train-loss|{name}|"] = np.asarray(loss_runs.loop(cls, timing)["train_loss"])
    return out


# The new layers (tests/adapters/test_pytorch_blocks.py's models, in every framework that builds them): a narrow ResNet
# with a strided projection shortcut and batchnorm in training mode, and a two-layer causal decoder on the copy task.
BLOCK_MODELS = {
    "resnet": (_model(
        {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": 1, "use_bias": False},
        {"type": "batchnorm"}, {"type": "relu"},
        {"type": "residual", "activation": "relu", "body": [
            {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": 1, "use_bias": False},
            {"type": "batchnorm"}]},
        {"type": "residual", "activation": "relu", "body": [
            {"type": "conv2d", "filters": 8, "kernel_size": 3, "stride": 2, "padding": 1, "use_bias": False},
            {"type": "batchnorm"}, {"type": "relu"},
            {"type": "conv2d", "filters": 8, "kernel_size": 3, "padding": 1, "use_bias": False},
            {"type": "batchnorm"}]},
        {"type": "global_avgpool2d"}, {"type": "dense", "units": 5}),
        SyntheticData(name="synthetic", shape=[8, 8, 3], classes=5, size=256, test_size=64)),
    "decoder": (_model(
        {"type": "embedding", "vocab": 8, "dim": 16},
        *[block for _ in range(2) for block in (
            {"type": "residual", "body": [{"type": "layernorm"}, {"type": "attention", "heads": 2, "causal": True}]},
            {"type": "residual", "body": [{"type": "layernorm"}, {"type": "dense", "units": 32, "activation": "gelu"},
                                          {"type": "dense", "units": 16}]})],
        {"type": "layernorm"}, {"type": "dense", "units": 8}),
        SyntheticTokens(name="synthetic_tokens", vocab=8, length=8, size=256, test_size=64, task="copy")),
}
# Adam's epsilon 1e-4: attention's key bias has a zero gradient in exact arithmetic (the softmax over keys is
# invariant to a shift that is the same for every key), so what the frameworks compute for it is rounding noise
# (~1e-9), which Adam with epsilon 1e-8 would turn into full steps of +-learning rate, a different sign in each
# framework (observed: 1.1.in_proj.bias, the k rows, off by 9e-5 after one step).
BLOCK_OPTIMIZERS = {"sgd-momentum": OptimizerSpec(name="sgd", learning_rate=0.05, momentum=0.9),
                    "adam": OptimizerSpec(name="adam", learning_rate=2e-3, epsilon=1e-4)}


def make_on(adapter_cls, model: ModelSpec, cfg, optimizer: OptimizerSpec = SGD,
            weights: dict[str, np.ndarray] | None = None):
    """A prepared (CPU, 2 threads, seed 0), built and loaded adapter on the dataset ``cfg`` (any dataset spec), with
    ``weights`` (default: the canonical initial weights); returns (adapter, data, info)."""
    data = datasets.load(cfg, seed=0)
    info = models.analyze(model, *datasets.describe_input(cfg))
    adapter = adapter_cls()
    adapter.prepare("cpu", 2, 0)
    adapter.build_neutral(info, models.initial_weights(info, 0) if weights is None else weights, optimizer)
    adapter.load(data)
    return adapter, data, info


def perturbed(info) -> dict[str, np.ndarray]:
    """Every parameter and buffer away from its trivial start (unit gamma, zero beta and biases, running statistics
    0 and 1), so that no term of the forward pass hides."""
    rng = np.random.default_rng(1)
    out = {name: (w + rng.normal(0, 0.1, w.shape)).astype(np.float32)
           for name, w in models.initial_weights(info, 0).items()}
    for name, buffer in models.initial_buffers(info).items():
        out[name] = (np.abs(buffer + rng.normal(0, 0.3, buffer.shape)) + 0.1).astype(np.float32)
    return out


def run_blocks(adapter_cls) -> dict[str, np.ndarray]:
    """The block models through one framework: logits from perturbed weights and buffers, then 1 and 10 steps of
    batch 16 with each optimizer from the canonical initial weights (batchnorm in training mode), keyed like
    ``run``."""
    out: dict[str, np.ndarray] = {}
    for name, (model, cfg) in BLOCK_MODELS.items():
        info = models.analyze(model, *datasets.describe_input(cfg))
        adapter, data, _ = make_on(adapter_cls, model, cfg, weights=perturbed(info))
        out[f"blocks-{name}-logits|predict|"] = adapter.predict(data.x_test)
        out[f"blocks-{name}-logits|evaluate|"] = np.asarray(adapter.evaluate(32))
        for opt_name, optimizer in BLOCK_OPTIMIZERS.items():
            adapter, data, _ = make_on(adapter_cls, model, cfg, optimizer)
            _keep(out, f"blocks-{name}-{opt_name}",
                  kit.train_on(adapter, kit.batches(len(data.y_train), 16, 10), keep=(0, 1, 10)))
    return out


#: bfloat16's unit roundoff: 8 significant bits (7 stored), so rounding to bf16 moves a value by at most 2^-8 of it.
BF16_UNIT = 2.0 ** -8
#: Matrix products per layer kind that mixed precision runs in the low precision: a convolution and a dense layer
#: one each; attention four (the input projection, the scores, the weighted values, the output projection).
_LOW_PRECISION_PRODUCTS = {"conv2d": 1, "dense": 1, "attention": 4}


def bf16_tolerance(info) -> float:
    """The bound on max |bf16 logits - exact logits| / max |exact logits| that a mixed-precision bf16 forward pass of
    ``info`` must meet, derived rather than fitted: each matrix product rounds both of its operands to bf16 (a
    relative error of at most ``BF16_UNIT`` each, 2 ``BF16_UNIT`` for their product; the fp32 accumulation adds
    nothing at this scale), and an error relative to the activations' scale passes through the later layers
    without growing much for these well-scaled models, so the errors of the products on the way add up: 2
    ``BF16_UNIT`` x the number of low-precision products (``_LOW_PRECISION_PRODUCTS``). Observed with PyTorch's
    autocast on the CPU: digits CNN 3.7e-3 (bound 3.1e-2), narrow ResNet 4.1e-3 (6.3e-2), decoder 2.7e-2 (0.10)."""
    products = sum(_LOW_PRECISION_PRODUCTS.get(layer.kind, 0) for layer in info.leaves())
    return 2 * BF16_UNIT * products


def assert_bf16_close(logits: np.ndarray, exact: np.ndarray, info) -> float:
    """``logits`` within ``bf16_tolerance(info)`` of ``exact`` (norm-wise, relative to max |exact|) and finite;
    returns the observed relative error."""
    assert np.isfinite(logits).all()
    error = float(np.abs(logits - exact).max() / np.abs(exact).max())
    assert error <= bf16_tolerance(info), (error, bf16_tolerance(info))
    return error


def group(out: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The arrays of one scenario: the keys that start with ``prefix + "|"``."""
    return {k: v for k, v in out.items() if k.startswith(prefix + "|")}


def assert_trained_alike(ours: dict[str, np.ndarray], torch: dict[str, np.ndarray], scenario: str, step: int,
                         rtol: float, moved, min_move: float) -> None:
    """A framework's run (``ours``) against PyTorch's (``torch``), both keyed like ``run``: the losses of
    ``scenario`` within 1e-5 relative, the same arrays kept, every array after ``step`` steps within 1e-5 + ``rtol``
    x |b|; at step 10 every array that ``moved(name)`` selects moved by more than ``min_move`` (so that agreeing is
    not agreeing on a model that did not train)."""
    mine, theirs = group(ours, scenario), group(torch, scenario)
    np.testing.assert_allclose(mine[f"{scenario}|losses|"], theirs[f"{scenario}|losses|"], rtol=1e-5)
    names = [k.split("|")[2] for k in theirs if k.split("|")[1] == str(step)]
    assert names and sorted(names) == sorted(k.split("|")[2] for k in mine if k.split("|")[1] == str(step))
    for name in names:
        start, after = theirs[f"{scenario}|0|{name}"], theirs[f"{scenario}|{step}|{name}"]
        if step == 10 and moved(name):
            assert np.abs(after - start).max() > min_move, f"{name} did not move"
        np.testing.assert_allclose(mine[f"{scenario}|{step}|{name}"], after, rtol=rtol, atol=1e-5,
                                   err_msg=f"{scenario} {name} after {step} step(s)")


def assert_same_block_logits(ours: dict[str, np.ndarray], torch: dict[str, np.ndarray]) -> None:
    """``run_blocks`` of a framework against PyTorch's: the same keys; each block model's logits from the same
    perturbed weights within |a - b| <= 1e-5 + 1e-4 * |b|, its test loss and accuracy (over every position for the
    decoder) within 1e-5 relative."""
    assert sorted(ours) == sorted(torch)
    assert torch["blocks-decoder-logits|predict|"].shape == (64, 8, 8)
    for name in BLOCK_MODELS:
        key = f"blocks-{name}-logits|"
        np.testing.assert_allclose(ours[key + "predict|"], torch[key + "predict|"], rtol=1e-4, atol=1e-5,
                                   err_msg=name)
        np.testing.assert_allclose(ours[key + "evaluate|"], torch[key + "evaluate|"], rtol=1e-5, err_msg=name)


def assert_curves_agree(ours: dict[str, np.ndarray], torch: dict[str, np.ndarray], name: str) -> None:
    """``run``'s two-epoch curve of optimizer ``name`` (88 steps of batch 32) against PyTorch's: every step's loss
    within 5e-3 relative and the final test loss too, the accuracy within one test image."""
    key = f"curve-{name}|losses|"
    assert len(torch[key]) == 88
    np.testing.assert_allclose(ours[key], torch[key], rtol=5e-3, atol=0)
    loss_o, acc_o = ours[f"curve-{name}|evaluate|"]
    loss_t, acc_t = torch[f"curve-{name}|evaluate|"]
    assert abs(loss_o - loss_t) <= 5e-3 * abs(loss_t) and abs(acc_o - acc_t) <= 1.5 / 359


def assert_epoch_losses_agree(ours: dict[str, np.ndarray], torch: dict[str, np.ndarray]) -> None:
    """The loop's epoch losses slowed in auto windows against PyTorch's read every 3 steps, and the other way round,
    within 1e-5 relative (tests/adapters/test_train_loss.py says why)."""
    for a, b in (("slow", "fast"), ("fast", "slow")):
        np.testing.assert_allclose(ours[f"loop-train-loss|{a}|"], torch[f"loop-train-loss|{b}|"], rtol=1e-5, atol=0,
                                   err_msg=f"{a} vs pytorch {b}")


def assert_accumulation_alike(ours: dict[str, np.ndarray], torch: dict[str, np.ndarray]) -> None:
    """Four micro-batches of 8 equal one batch of 32 over 3 steps (losses within 1e-5 relative, parameters within
    1e-6 + 1e-5 * |b|), and both equal PyTorch's."""
    one, four = group(ours, "accumulation-1"), group(ours, "accumulation-4")
    np.testing.assert_allclose(four["accumulation-4|losses|"], one["accumulation-1|losses|"], rtol=1e-5)
    for key, value in one.items():
        if key.split("|")[1] == "3":
            np.testing.assert_allclose(four[key.replace("accumulation-1", "accumulation-4")], value, rtol=1e-5,
                                       atol=1e-6, err_msg=key)
            np.testing.assert_allclose(value, torch[key], rtol=1e-5, atol=1e-5, err_msg=key)


#: The block scenarios that train (each compared after 1 and 10 steps).
BLOCK_SCENARIOS = [f"blocks-{m}-{o}" for m in BLOCK_MODELS for o in BLOCK_OPTIMIZERS]


if __name__ == "__main__":
    import adapters

    framework, path = sys.argv[1], sys.argv[2]
    which = sys.argv[3] if len(sys.argv) > 3 else "layers"  # layers, blocks, or all (both, in one process)
    cls = adapters.get(framework)
    if which == "all":
        np.savez(path, **run(cls), **run_blocks(cls))
    else:
        np.savez(path, **(run_blocks if which == "blocks" else run)(cls))
