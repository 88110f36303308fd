"""PyTorch builds the residual and transformer layers of the neutral model from the canonical weights: its logits
equal the float64 numpy reference (tests/adapters/reference.py) for a narrow ResNet (projection shortcut, strided and
padded bias-free convolutions, batchnorm with non-trivial running statistics) and for a two-layer causal
transformer; causal attention does not look ahead; the next-token loss trains."""

from __future__ import annotations

import numpy as np

from adapters.pytorch import PyTorchAdapter
from harness.neutral import datasets, models
from harness.spec import ModelSpec, OptimizerSpec, SyntheticData, SyntheticTokens
from tests.adapters import reference

RESNET = ModelSpec.model_validate({"layers": [
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
    {"type": "global_avgpool2d"},
    {"type": "dense", "units": 5},
]})
TRANSFORMER = ModelSpec.model_validate({"layers": [
    {"type": "embedding", "vocab": 8, "dim": 16},
    {"type": "residual", "body": [{"type": "layernorm"}, {"type": "attention", "heads": 2, "causal": True}]},
    {"type": "residual", "body": [{"type": "layernorm"}, {"type": "dense", "units": 32, "activation": "gelu"},
                                  {"type": "dense", "units": 16}]},
    {"type": "residual", "body": [{"type": "layernorm"}, {"type": "attention", "heads": 2, "causal": True}]},
    {"type": "residual", "body": [{"type": "layernorm"}, {"type": "dense", "units": 32, "activation": "gelu"},
                                  {"type": "dense", "units": 16}]},
    {"type": "layernorm"},
    {"type": "dense", "units": 8},
]})
IMAGES = SyntheticData(name="synthetic", shape=[8, 8, 3], classes=5, size=64, test_size=32)
TOKENS = SyntheticTokens(name="synthetic_tokens", vocab=8, length=8, size=512, test_size=64, task="copy")


def build(model, cfg, weights=None, optimizer=OptimizerSpec(name="sgd", learning_rate=0.05, momentum=0.9)):
    data = datasets.load(cfg, seed=0)
    info = models.analyze(model, *datasets.describe_input(cfg))
    adapter = PyTorchAdapter()
    adapter.prepare("cpu", 2, 0)
    adapter.build(info, models.initial_weights(info, 0) if weights is None else weights, optimizer)
    adapter.load(data)
    return adapter, data, info


def perturbed(info, seed=1):
    """Initial weights with every parameter and buffer moved away from its trivial start (gamma 1, beta 0,
    running statistics 0 and 1, zero biases), so that no term of the forward pass hides."""
    rng = np.random.default_rng(seed)
    out = {name: (w + rng.normal(0, 0.1, w.shape)).astype(np.float32)
           for name, w in models.initial_weights(info, 0).items()}
    for name, buffer in models.initial_buffers(info).items():
        out[name] = (np.abs(buffer + rng.normal(0, 0.3, buffer.shape)) + 0.1).astype(np.float32)
    return out


def test_a_resnet_with_a_projection_shortcut_gives_the_reference_logits():
    info = models.analyze(RESNET, *datasets.describe_input(IMAGES))
    assert [c.name for c in info.layers[4].shortcut] == ["4.shortcut", "4.shortcut_bn"]  # a projection is tested
    weights = perturbed(info)
    adapter, data, _ = build(RESNET, IMAGES, weights)
    np.testing.assert_allclose(adapter.predict(data.x_test), reference.forward(info, weights, data.x_test),
                               rtol=1e-4, atol=1e-5)
    names = set(adapter.get_weights())
    assert names == set(info.param_names()) and "4.shortcut.bias" not in names and "0.bias" not in names
    assert set(adapter.get_buffers()) == set(info.buffer_names())
    np.testing.assert_array_equal(adapter.get_buffers()["4.shortcut_bn.running_var"],
                                  weights["4.shortcut_bn.running_var"])


def test_a_causal_transformer_gives_the_reference_logits_and_does_not_look_ahead():
    info = models.analyze(TRANSFORMER, *datasets.describe_input(TOKENS))
    assert info.task == "next_token"
    weights = perturbed(info)
    adapter, data, _ = build(TRANSFORMER, TOKENS, weights)
    logits = adapter.predict(data.x_test)
    assert logits.shape == (64, 8, 8)
    np.testing.assert_allclose(logits, reference.forward(info, weights, data.x_test), rtol=1e-4, atol=1e-5)
    changed = data.x_test.copy()
    changed[:, 5:] = (changed[:, 5:] + 1) % 8  # later tokens change: earlier positions' logits must not
    after = adapter.predict(changed)
    np.testing.assert_array_equal(after[:, :5], logits[:, :5])
    assert not np.allclose(after[:, 5:], logits[:, 5:])
    assert set(adapter.get_weights()) == set(info.param_names())


def test_the_next_token_loss_trains_the_copy_task():
    adam = OptimizerSpec(name="adam", learning_rate=0.01)
    adapter, data, info = build(TRANSFORMER, TOKENS, optimizer=adam)
    loss_before, accuracy_before = adapter.evaluate(64)
    for epoch in range(15):
        order = datasets.epoch_order(len(data.y_train), 0, epoch)
        for step in range(len(order) // 32):
            adapter.train_step(order[step * 32:(step + 1) * 32])
        adapter.sync()
    loss, accuracy = adapter.evaluate(64)
    ceiling = datasets.accuracy_ceiling(TOKENS)
    # the copied half is learnt: from chance (1/8) to near the ceiling (0.67: the first half is random)
    assert loss < loss_before - 1.0 and accuracy > 0.9 * ceiling, (loss, accuracy)
