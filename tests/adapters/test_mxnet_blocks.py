"""MXNet builds the residual and transformer layers of the neutral model from the canonical weights: its logits equal
the float64 numpy reference (tests/adapters/reference.py) for a narrow ResNet (projection shortcut, strided and padded
bias-free convolutions, batchnorm with non-trivial running statistics) and for a two-layer causal transformer;
causal attention does not look ahead; the next-token loss trains; and it trains the shared block scenarios
(tests/adapters/scenarios.py) like PyTorch, step by step, with the tolerances of tests/adapters/test_jax.py."""

from __future__ import annotations

import pytest

from adapters.mxnet.adapter import MXNetAdapter
from tests.adapters import block_checks, scenarios


def test_a_resnet_with_a_projection_shortcut_gives_the_reference_logits():
    adapter, _ = block_checks.resnet_gives_the_reference(MXNetAdapter)
    blocks = adapter._neutral.blocks
    assert blocks["4.shortcut"].bias is None  # nn.Conv2D(use_bias=False): no bias at all, not a zero one
    # the CPU kernel's biased running-variance update is corrected inside blocks and shortcuts too
    assert [layer.block for layer in adapter.training.variance.corrected] == [
        blocks[name] for name in ("1", "3.1", "4.1", "4.4", "4.shortcut_bn")]


def test_a_causal_transformer_gives_the_reference_logits_and_does_not_look_ahead():
    block_checks.decoder_gives_the_reference_and_does_not_look_ahead(MXNetAdapter)


def test_the_next_token_loss_trains_the_copy_task():
    block_checks.copy_task_trains(MXNetAdapter)


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
