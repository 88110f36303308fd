"""TensorFlow builds the residual and transformer layers of the neutral model from the canonical weights: its logits
equal the float64 numpy reference (tests/adapters/reference.py) for a narrow ResNet (projection shortcut, strided and
padded bias-free convolutions, batchnorm with non-trivial running statistics) and for a two-layer causal transformer
(Keras's LayerNormalization and MultiHeadAttention inside the adapter's tf.functions); causal attention does not look
ahead; the next-token loss trains; and it trains step for step like PyTorch (the shared block scenarios,
tests/adapters/scenarios.py, with the tolerances of tests/adapters/test_jax.py).

Observed (TF 2.21 / Keras 3.15, torch 2.13, x86-64 CPU, 2 threads): logits within 1.9e-9 (ResNet) and 3.8e-6
(decoder) of PyTorch's and 6.6e-9 / 3.8e-6 of the reference; after 1 step every array within 2.9e-7 of PyTorch's
and after 10 steps within 4.9e-7 (both models, both optimizers); the losses within 6.1e-7 relative."""

from __future__ import annotations

import numpy as np
import pytest

from adapters.declaration import ALL_LAYERS, ALL_TASKS
from adapters.tensorflow.adapter import TensorFlowAdapter
from adapters.tensorflow.neutral import Builder
from harness.neutral import datasets, models
from harness.plan.support import unsupported
from harness.spec import ModelSpec, SyntheticData
from tests.adapters import block_checks, kit, reference, scenarios


def build(model, cfg, weights=None, optimizer=scenarios.BLOCK_OPTIMIZERS["sgd-momentum"]):
    return block_checks.build(TensorFlowAdapter, model, cfg, weights, optimizer)


def test_it_declares_every_layer_and_task_and_builds_every_kind():
    """The declaration names every layer and task, the plan's rule accepts the block models, and the neutral builder
    has a ``visit_<kind>`` for every layer kind of the declaration (its options are the kinds' own)."""
    declaration = TensorFlowAdapter.declaration
    assert declaration.capabilities.layers == ALL_LAYERS and declaration.capabilities.tasks == ALL_TASKS
    for model, cfg in scenarios.BLOCK_MODELS.values():
        assert unsupported(declaration, models.analyze(model, *datasets.describe_input(cfg))) is None
    assert Builder.kinds() == {kind for kind in ALL_LAYERS if "." not in kind}


def test_a_resnet_with_a_projection_shortcut_gives_the_reference_logits():
    block_checks.resnet_gives_the_reference(TensorFlowAdapter)


def test_a_causal_transformer_gives_the_reference_logits_and_does_not_look_ahead():
    # also: Keras's attention kernels joined back into exactly the canonical in-projection
    block_checks.decoder_gives_the_reference_and_does_not_look_ahead(TensorFlowAdapter)


def test_a_flatten_that_feeds_no_dense_layer_directly_keeps_the_canonical_order():
    """A flatten of (C, H, W) followed by a residual block on the flat features and by a layernorm: no dense layer's
    rows can absorb TF's (H, W, C) order there, so the flatten transposes to channel-first first."""
    model = ModelSpec.model_validate({"layers": [
        {"type": "conv2d", "filters": 2, "kernel_size": 3, "stride": 2, "padding": 1},
        {"type": "flatten"},
        {"type": "residual", "body": [{"type": "dense", "units": 32, "activation": "gelu"}]},
        {"type": "layernorm"}, {"type": "dense", "units": 5}]})
    cfg = SyntheticData(name="synthetic", shape=[8, 8, 3], classes=5, size=32, test_size=16)
    info = models.analyze(model, *datasets.describe_input(cfg))
    weights = scenarios.perturbed(info)
    adapter, data, _ = build(model, cfg, weights)
    np.testing.assert_allclose(adapter.predict(data.x_test), reference.forward(info, weights, data.x_test),
                               rtol=1e-4, atol=1e-5)


def test_the_next_token_loss_trains_the_copy_task():
    adapter = block_checks.copy_task_trains(TensorFlowAdapter)
    assert adapter.training.functions[(32, 1)].experimental_get_tracing_count() == 1
    assert adapter.training.eval_fn.experimental_get_tracing_count() == 1


def test_gradient_accumulation_with_an_embedding_equals_one_batch():
    """Four micro-batches of 4 = one batch of 16 over 3 steps of the decoder: the embedding's sparse
    (``tf.IndexedSlices``) gradients are summed densely across the micro-batches."""
    kept = {}
    for k in (1, 4):
        adapter, data, _ = build(block_checks.TRANSFORMER, block_checks.TOKENS)
        losses, states = kit.train_on(adapter, kit.batches(len(data.y_train), 16, 3), keep=(3,), micro_batches=k)
        kept[k] = (losses, states[3])
    np.testing.assert_allclose(kept[4][0], kept[1][0], rtol=1e-5)
    for name, value in kept[1][1].items():
        np.testing.assert_allclose(kept[4][1][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def tensorflow_block_runs():
    return scenarios.run_blocks(TensorFlowAdapter)


def test_the_residual_and_transformer_models_give_the_same_logits_as_pytorch(tensorflow_block_runs,
                                                                            pytorch_block_runs):
    """A narrow ResNet (strided projection shortcut, batchnorm on running statistics) and a causal decoder
    (embedding, layernorm, attention, gelu, next-token logits (N, L, vocab)) from the same perturbed weights, as
    PyTorch's (``scenarios.assert_same_block_logits``)."""
    scenarios.assert_same_block_logits(tensorflow_block_runs, pytorch_block_runs)


@pytest.mark.parametrize("scenario", scenarios.BLOCK_SCENARIOS)
@pytest.mark.parametrize("step", [1, 10])
def test_the_residual_and_transformer_models_train_like_pytorch(tensorflow_block_runs, pytorch_block_runs, scenario,
                                                                step):
    """1 and 10 steps of SGD with momentum and of Adam (batchnorm in training mode, its running statistics
    included; the decoder's next-token loss over every position): every array within 1e-5 + 1e-4 * |b| of
    PyTorch's, the losses within 1e-5 relative, every weight moved by step 10."""
    scenarios.assert_trained_alike(tensorflow_block_runs, pytorch_block_runs, scenario, step, rtol=1e-4,
                                   moved=lambda name: name.endswith(".weight"), min_move=1e-5)
