"""The checks every adapter's block tests make (tests/adapters/test_<framework>_blocks.py), written once: a narrow
ResNet and a causal decoder from perturbed weights give the float64 reference's logits (tests/adapters/reference.py)
and hold exactly the canonical parameters; causal attention does not look ahead; the next-token loss learns the copy
task. Each returns what its caller may check further in its own framework."""

from __future__ import annotations

import numpy as np

from harness.neutral import datasets, models
from harness.spec import OptimizerSpec
from tests.adapters import reference, scenarios

RESNET, IMAGES = scenarios.BLOCK_MODELS["resnet"]
TRANSFORMER, _TOKENS = scenarios.BLOCK_MODELS["decoder"]
TOKENS = _TOKENS.model_copy(update={"size": 512})  # enough sequences to learn the copy task


def build(adapter_cls, model, cfg, weights=None, optimizer=scenarios.BLOCK_OPTIMIZERS["sgd-momentum"]):
    return scenarios.make_on(adapter_cls, model, cfg, optimizer, weights)


def resnet_gives_the_reference(adapter_cls):
    """The ResNet (a projection shortcut, strided and padded bias-free convolutions, batchnorm on non-trivial
    running statistics): logits within 1e-5 + 1e-4 |b| of the reference; the parameters and buffers held are exactly
    the canonical ones, under their names and in their order, and a bias-free convolution has no bias. Returns
    (adapter, weights)."""
    info = models.analyze(RESNET, *datasets.describe_input(IMAGES))
    assert [c.name for c in info.layers[4].shortcut] == ["4.shortcut", "4.shortcut_bn"]  # a projection is tested
    weights = scenarios.perturbed(info)
    adapter, data, _ = build(adapter_cls, RESNET, IMAGES, weights)
    np.testing.assert_allclose(adapter.predict(data.x_test), reference.forward(info, weights, data.x_test),
                               rtol=1e-4, atol=1e-5)
    held, buffers = adapter.get_weights(), adapter.get_buffers()
    assert list(held) == info.param_names() and "4.shortcut.bias" not in held and "0.bias" not in held
    assert list(buffers) == info.buffer_names()
    for name, value in {**held, **buffers}.items():  # the exact inverse of build's conversion
        np.testing.assert_array_equal(value, weights[name], err_msg=name)
    return adapter, weights


def decoder_gives_the_reference_and_does_not_look_ahead(adapter_cls):
    """The two-layer causal decoder: next-token logits (64 test sequences, 8 positions, 8 tokens) float32 within
    1e-5 + 1e-4 |b| of the reference; changing later tokens leaves earlier positions' logits exactly as they were;
    the parameters held are exactly the canonical ones. Returns the adapter."""
    info = models.analyze(TRANSFORMER, *datasets.describe_input(TOKENS))
    assert info.task == "next_token"
    weights = scenarios.perturbed(info)
    adapter, data, _ = build(adapter_cls, TRANSFORMER, TOKENS, weights)
    logits = adapter.predict(data.x_test)
    assert logits.shape == (64, 8, 8) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, reference.forward(info, weights, data.x_test), rtol=1e-4, atol=1e-5)
    changed = data.x_test.copy()
    changed[:, 5:] = (changed[:, 5:] + 1) % 8  # later tokens change: earlier positions' logits must not
    after = adapter.predict(changed)
    np.testing.assert_array_equal(after[:, :5], logits[:, :5])
    assert not np.allclose(after[:, 5:], logits[:, 5:])
    held = adapter.get_weights()
    assert list(held) == info.param_names() and adapter.get_buffers() == {}
    for name, value in held.items():
        np.testing.assert_array_equal(value, weights[name], err_msg=name)
    return adapter


def copy_task_trains(adapter_cls):
    """15 epochs of Adam (lr 0.01, batch 32) on 512 copy sequences: the test loss falls by more than 1 and the
    accuracy over every position reaches 90 % of the task's ceiling (the copied half learnt; chance is 1/8).
    Returns the adapter."""
    adapter, data, _ = build(adapter_cls, TRANSFORMER, TOKENS, optimizer=OptimizerSpec(name="adam", learning_rate=0.01))
    loss_before, _ = adapter.evaluate(64)
    for epoch in range(15):
        for batch in adapter.batches(datasets.epoch_order(len(data.y_train), 0, epoch), 32, epoch):
            adapter.train_step(batch)
        adapter.read_loss()
    loss, accuracy = adapter.evaluate(64)
    assert loss < loss_before - 1.0 and accuracy > 0.9 * datasets.accuracy_ceiling(TOKENS), (loss, accuracy)
    return adapter
