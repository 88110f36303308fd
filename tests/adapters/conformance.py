"""The conformance suite: the tests every adapter passes, the same for each framework.

Not collected by itself (its name does not match test_*.py): a framework's test module imports these tests and gives
the ``adapter_cls`` fixture, ``from tests.adapters.conformance import *`` (tests/adapters/test_pytorch.py,
test_tensorflow.py and test_mxnet.py in the development environment; jax_suite.py and keras_suite.py in their own
environments). What is specific to one framework stays in its own module.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from harness.neutral import datasets, models
from harness.neutral.info import LayerInfo
from harness.neutral.visitor import UnknownLayer
from tests.adapters import kit
from tests.helpers import run_options

__all__ = [
    "test_a_layer_kind_the_builder_lacks_raises",
    "test_batches_are_the_whole_steps_of_the_order",
    "test_holds_canonical_weights_and_matches_reference_forward",
    "test_inference_after_training_uses_the_running_statistics",
    "test_learns_digits_on_cpu",
    "test_memory_options_on_cpu_are_accepted_and_not_claimed",
    "test_options_are_given_at_construction",
    "test_parameter_count_matches_model",
    "test_set_train_images_replaces_the_images_in_place",
    "test_the_registry_record_names_this_class",
]


def test_learns_digits_on_cpu(adapter_cls):
    """Loss falls and test accuracy ends well above chance (10%) after a short real training run on the CPU."""
    adapter, data, _ = kit.make(adapter_cls)
    loss0, acc0 = adapter.evaluate(256)
    epoch_losses = kit.train_epochs(adapter, data, epochs=3, batch_size=32)
    loss1, acc1 = adapter.evaluate(256)
    assert np.isfinite(epoch_losses).all()
    assert epoch_losses[-1] < 0.5 * epoch_losses[0], epoch_losses
    assert loss1 < 0.5 * loss0, (loss0, loss1)
    assert acc0 < 0.3 and acc1 > 0.9, (acc0, acc1)


def test_holds_canonical_weights_and_matches_reference_forward(adapter_cls):
    """The adapter holds exactly the canonical initial weights, and its logits match a numpy forward pass."""
    adapter, data, info = kit.make(adapter_cls)
    weights = models.initial_weights(info, 0)
    held = adapter.get_weights()
    assert sorted(held) == sorted(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(held[name], value, err_msg=name)
    images = data.x_test[:16]
    np.testing.assert_allclose(adapter.predict(images), kit.numpy_forward(info, weights, images), rtol=1e-4,
                               atol=1e-5)


def test_parameter_count_matches_model(adapter_cls):
    adapter, _, info = kit.make(adapter_cls)
    assert sum(v.size for v in adapter.get_weights().values()) == info.parameter_count == 67_274


def test_options_are_given_at_construction(adapter_cls):
    """The options an adapter is made with are its own, frozen, with "default" resolved to the declaration's mode."""
    options = run_options({"memory_limit_bytes": 10**9})
    adapter = adapter_cls(options)
    assert adapter.options.memory_limit_bytes == 10**9
    assert adapter.options.compile == adapter_cls.declaration.capabilities.default_compile == adapter.mode
    with pytest.raises(Exception, match="frozen"):
        adapter.options.precision = "bf16"
    assert adapter_cls().options.memory_limit_bytes is None  # nothing shared between instances


def test_memory_options_on_cpu_are_accepted_and_not_claimed(adapter_cls):
    """On the CPU a memory limit and memory growth off are accepted and are no-ops for the adapter (the worker caps
    a CPU worker process itself): it trains, and its settings claim neither a framework memory limit nor a
    memory-growth setting."""
    adapter, data, _ = kit.make(adapter_cls, options=run_options({"tensorflow_memory_growth": False,
                                                                  "memory_limit_bytes": 2 * 10**9}))
    kit.step(adapter, kit.batches(len(data.y_train), 32, 1)[0])
    assert np.isfinite(adapter.read_loss()[0])
    settings = adapter.settings().record()
    assert settings["memory_limit_bytes"] is None
    assert not {"memory_limit", "memory_growth"} & set(settings), settings


def test_batches_are_the_whole_steps_of_the_order(adapter_cls):
    """``batches`` gives one batch per whole step of the order (a last partial step is dropped), and training on
    them equals training on each step's samples alone."""
    adapter, data, _ = kit.make(adapter_cls)
    order = datasets.epoch_order(len(data.y_train), 0, 0)[:100]
    assert len(list(adapter.batches(order, 32, 0))) == 3
    for batch in adapter.batches(order, 32, 0):
        adapter.train_step(batch)
    alone, _, _ = kit.make(adapter_cls)
    for start in range(0, 96, 32):
        kit.step(alone, order[start:start + 32])
    assert adapter.read_loss()[1] == alone.read_loss()[1] == 3
    for name, value in alone.get_weights().items():
        np.testing.assert_allclose(adapter.get_weights()[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_a_layer_kind_the_builder_lacks_raises(adapter_cls):
    """A layer kind the neutral builder has no method for raises ``UnknownLayer`` naming the adapter, the kind and
    where, in every framework (none builds it as an identity or drops it)."""
    _, info = kit.digits()
    strange = LayerInfo(index=1, spec=SimpleNamespace(type="spiral"), input_shape=(32, 8, 8),
                        output_shape=(32, 8, 8))
    odd = dataclasses.replace(info, layers=(info.layers[0], strange, *info.layers[1:]))
    adapter = adapter_cls()
    adapter.prepare("cpu", 2, 0)
    with pytest.raises(UnknownLayer, match=rf"the {adapter_cls.name} adapter cannot build spiral layers "
                                           r"\(model.layers.1\)"):
        adapter.neutral_model(odd, models.initial_weights(info, 0))


def test_inference_after_training_uses_the_running_statistics(adapter_cls):
    """After training steps (batchnorm in training mode, dropout on), predict and evaluate run in inference mode on
    the state the adapter reports: its logits are the numpy reference's on ``get_weights`` + ``get_buffers``. predict
    follows the last train_step without a sync in between, so an adapter whose running statistics are still being
    written (asynchronous engines) would be caught."""
    adapter, data, info = kit.make(adapter_cls, model=kit.NORM_CNN)
    for batch in kit.epoch_steps(adapter, kit.batches(len(data.y_train), 32, 3)):
        adapter.train_step(batch)
    logits = adapter.predict(data.x_test)
    state = {**adapter.get_weights(), **adapter.get_buffers()}
    assert sorted(state) == sorted(info.param_names() + info.buffer_names())
    assert not np.allclose(state["1.running_var"], 1.0)  # the running statistics did move
    reference = kit.numpy_forward(info, state, data.x_test)
    np.testing.assert_allclose(logits, reference, rtol=1e-4, atol=1e-5)
    shifted = reference - reference.max(axis=1, keepdims=True)
    ref_loss = float(-(shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True)))[
        np.arange(len(data.y_test)), data.y_test].mean())
    assert adapter.evaluate(64)[0] == pytest.approx(ref_loss, rel=1e-5)


def test_set_train_images_replaces_the_images_in_place(adapter_cls):
    """set_train_images overwrites the resident training images in place, also after the train step was compiled or
    traced: an adapter that steps on images A, is switched to B and steps again must end with exactly the weights of
    an adapter that was loaded with those images from the start."""
    adapter, data, _ = kit.make(adapter_cls)
    original = data.x_train.copy()
    first, *rest = kit.batches(len(data.y_train), 32, 4)
    augmented = datasets.augment(data.x_train, seed=0, epoch=0)
    given = augmented.copy()
    assert not np.allclose(augmented, data.x_train)
    kit.train_on(adapter, [first])  # compiles / traces the step on the original images
    adapter.set_train_images(augmented)
    kit.train_on(adapter, rest)
    # The adapter holds its own copy: neither the loaded dataset nor the array it was given may change (the harness
    # augments the original images again each epoch).
    np.testing.assert_array_equal(data.x_train, original)
    np.testing.assert_array_equal(augmented, given)
    mixed = augmented.copy()
    mixed[first] = data.x_train[first]  # the first batch saw the original images
    reference, _, _ = kit.make(adapter_cls, data=dataclasses.replace(data, x_train=mixed))
    kit.train_on(reference, [first, *rest])
    for name, value in reference.get_weights().items():
        np.testing.assert_allclose(adapter.get_weights()[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
    unaugmented, _, _ = kit.make(adapter_cls)
    kit.train_on(unaugmented, [first, *rest])
    assert kit.max_differences(unaugmented.get_weights(), reference.get_weights())[0] > 1e-4  # the images mattered


def test_the_registry_record_names_this_class(adapter_cls):
    """The registry's declaration names this class, and the class takes its name and facts from that record."""
    import adapters

    assert adapters.get(adapter_cls.name) is adapter_cls
    assert adapter_cls.declaration is adapters.BUILTIN[adapter_cls.name]
