"""PyTorch builds the residual and transformer layers of the neutral model from the canonical weights: its logits
equal the float64 numpy reference (tests/adapters/reference.py) for a narrow ResNet (projection shortcut, strided and
padded bias-free convolutions, batchnorm with non-trivial running statistics) and for a two-layer causal
transformer; causal attention does not look ahead; the next-token loss trains."""

from __future__ import annotations

from adapters.pytorch.adapter import PyTorchAdapter
from tests.adapters import block_checks


def test_a_resnet_with_a_projection_shortcut_gives_the_reference_logits():
    block_checks.resnet_gives_the_reference(PyTorchAdapter)


def test_a_causal_transformer_gives_the_reference_logits_and_does_not_look_ahead():
    block_checks.decoder_gives_the_reference_and_does_not_look_ahead(PyTorchAdapter)


def test_the_next_token_loss_trains_the_copy_task():
    block_checks.copy_task_trains(PyTorchAdapter)
