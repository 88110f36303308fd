"""PyTorch builds the residual and transformer layers of the neutral model from the canonical weights: its logits
equal the float64 numpy reference (tests/adapters/reference.py) for a narrow ResNet (projection shortcut, strided and
padded bias-free convolutions, batchnorm with non-trivial running statistics) and for a two-layer causal
transformer; causal attention does not look ahead; the next-token loss trains."""

from __future__ import annotations

import numpy as np

from adapters.pytorch import PyTorchAdapter
from harness.neutral import datasets, models
from harness.spec import OptimizerSpec
from tests.adapters import reference, scenarios

RESNET, IMAGES = scenarios.BLOCK_MODELS["resnet"]
TRANSFORMER, _TOKENS = scenarios.BLOCK_MODELS["decoder"]
TOKENS = _TOKENS.model_copy(update={"size": 512})  # enough sequences to learn the copy task


def build(model, cfg, weights=None, optimizer=scenarios.BLOCK_OPTIMIZERS["sgd-momentum"]):
    return scenarios.make_on(PyTorchAdapter, model, cfg, optimizer, weights)


def test_a_resnet_with_a_projection_shortcut_gives_the_reference_logits():
    info = models.analyze(RESNET, *datasets.describe_input(IMAGES))
    assert [c.name for c in info.layers[4].shortcut] == ["4.shortcut", "4.shortcut_bn"]  # a projection is tested
    weights = scenarios.perturbed(info)
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
    weights = scenarios.perturbed(info)
    adapter, data, _ = build(TRANSFORMER, TOKENS, weights)
    logits = adapter.predict(data.x_test)
    assert logits.shape == (64, 8, 8)  # (test sequences, positions, vocabulary)
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
