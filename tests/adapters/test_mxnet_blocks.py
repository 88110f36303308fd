"""MXNet builds the residual and transformer layers of the neutral model from the canonical weights: its logits equal
the float64 numpy reference (tests/adapters/reference.py) for a narrow ResNet (projection shortcut, strided and padded
bias-free convolutions, batchnorm with non-trivial running statistics) and for a two-layer causal transformer;
causal attention does not look ahead; the next-token loss trains; and it trains the shared block scenarios
(tests/adapters/scenarios.py) like PyTorch, step by step, with the tolerances of tests/adapters/test_jax.py."""

from __future__ import annotations

import numpy as np
import pytest

from adapters.mxnet import MXNetAdapter
from harness.neutral import datasets, models
from harness.spec import OptimizerSpec
from tests.adapters import reference, scenarios

RESNET, IMAGES = scenarios.BLOCK_MODELS["resnet"]
TRANSFORMER, _TOKENS = scenarios.BLOCK_MODELS["decoder"]
TOKENS = _TOKENS.model_copy(update={"size": 512})  # enough sequences to learn the copy task


def build(model, cfg, weights=None, optimizer=scenarios.BLOCK_OPTIMIZERS["sgd-momentum"]):
    return scenarios.make_on(MXNetAdapter, model, cfg, optimizer, weights)


def test_a_resnet_with_a_projection_shortcut_gives_the_reference_logits():
    info = models.analyze(RESNET, *datasets.describe_input(IMAGES))
    assert [c.name for c in info.layers[4].shortcut] == ["4.shortcut", "4.shortcut_bn"]  # a projection is tested
    weights = scenarios.perturbed(info)
    adapter, data, _ = build(RESNET, IMAGES, weights)
    np.testing.assert_allclose(adapter.predict(data.x_test), reference.forward(info, weights, data.x_test),
                               rtol=1e-4, atol=1e-5)
    assert list(adapter.get_weights()) == info.param_names()  # the same names, in the same order
    assert "4.shortcut.bias" not in adapter.get_weights() and "0.bias" not in adapter.get_weights()
    assert adapter._layers["4.shortcut"].bias is None  # nn.Conv2D(use_bias=False): no bias at all, not a zero one
    assert list(adapter.get_buffers()) == info.buffer_names()
    np.testing.assert_array_equal(adapter.get_buffers()["4.shortcut_bn.running_var"],
                                  weights["4.shortcut_bn.running_var"])
    # the CPU kernel's biased running-variance update is corrected inside blocks and shortcuts too
    assert {block for block, _, _ in adapter._variance_fixups} == {
        adapter._layers[name] for name in ("1", "3.1", "4.1", "4.4", "4.shortcut_bn")}


def test_a_causal_transformer_gives_the_reference_logits_and_does_not_look_ahead():
    info = models.analyze(TRANSFORMER, *datasets.describe_input(TOKENS))
    assert info.task == "next_token"
    weights = scenarios.perturbed(info)
    adapter, data, _ = build(TRANSFORMER, TOKENS, weights)
    logits = adapter.predict(data.x_test)
    assert logits.shape == (64, 8, 8) and logits.dtype == np.float32  # (test sequences, positions, vocabulary)
    np.testing.assert_allclose(logits, reference.forward(info, weights, data.x_test), rtol=1e-4, atol=1e-5)
    changed = data.x_test.copy()
    changed[:, 5:] = (changed[:, 5:] + 1) % 8  # later tokens change: earlier positions' logits must not
    after = adapter.predict(changed)
    np.testing.assert_array_equal(after[:, :5], logits[:, :5])
    assert not np.allclose(after[:, 5:], logits[:, 5:])
    assert list(adapter.get_weights()) == info.param_names() and adapter.get_buffers() == {}


def test_the_next_token_loss_trains_the_copy_task():
    adam = OptimizerSpec(name="adam", learning_rate=0.01)
    adapter, data, _ = build(TRANSFORMER, TOKENS, optimizer=adam)
    loss_before, _ = adapter.evaluate(64)
    for epoch in range(15):
        order = datasets.epoch_order(len(data.y_train), 0, epoch)
        for step in range(len(order) // 32):
            adapter.train_step(order[step * 32:(step + 1) * 32])
        adapter.sync()
    loss, accuracy = adapter.evaluate(64)
    ceiling = datasets.accuracy_ceiling(TOKENS)
    # the copied half is learnt: from chance (1/8) to near the ceiling (0.67: the first half is random)
    assert loss < loss_before - 1.0 and accuracy > 0.9 * ceiling, (loss, accuracy)


@pytest.fixture(scope="module")
def mxnet_block_runs():
    return scenarios.run_blocks(MXNetAdapter)


def test_the_residual_and_transformer_models_give_the_same_logits(mxnet_block_runs, pytorch_block_runs):
    """A narrow ResNet (strided projection shortcut, batchnorm on running statistics) and a causal decoder
    (embedding, layernorm, attention, gelu, next-token logits (N, L, vocab)) from the same perturbed weights, as
    PyTorch's (``scenarios.assert_same_block_logits``)."""
    scenarios.assert_same_block_logits(mxnet_block_runs, pytorch_block_runs)


@pytest.mark.parametrize("scenario", scenarios.BLOCK_SCENARIOS)
@pytest.mark.parametrize("step", [1, 10])
def test_the_residual_and_transformer_models_train_the_same(mxnet_block_runs, pytorch_block_runs, scenario, step):
    """1 and 10 steps of SGD with momentum and of Adam (batchnorm in training mode, its running statistics
    included; the decoder's next-token loss over every position): every array within 1e-5 + 1e-4 * |b| of
    PyTorch's, the losses within 1e-5 relative, every weight moved by step 10."""
    scenarios.assert_trained_alike(mxnet_block_runs, pytorch_block_runs, scenario, step, rtol=1e-4,
                                   moved=lambda name: name.endswith(".weight"), min_move=1e-5)
