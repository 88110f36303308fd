"""The framework-neutral model: shapes, parameter counts and FLOPs by hand, seeded weights."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from harness import models
from harness.spec import ModelSpec

SEED002 = ModelSpec.model_validate({"layers": [
    {"type": "conv2d", "filters": 32, "kernel_size": 3, "padding": "same", "activation": "relu",
     "kernel_init": "he_uniform"},
    {"type": "maxpool2d", "pool_size": 2},
    {"type": "flatten"},
    {"type": "dense", "units": 128, "activation": "relu", "kernel_init": "he_uniform"},
    {"type": "dense", "units": 10},
]})


def test_seed002_cnn_on_cifar10_by_hand():
    info = models.analyze(SEED002, (32, 32, 3), 10)
    # conv: 32 filters x (3 in-channels x 3 x 3) + 32 biases = 896
    # after maxpool 2: 32 x 16 x 16 = 8192 features
    # dense 1: 8192 x 128 + 128 = 1,048,704; dense 2: 128 x 10 + 10 = 1,290
    assert [layer.output_shape for layer in info.layers] == [(32, 32, 32), (32, 16, 16), (8192,), (128,), (10,)]
    assert info.parameter_count == 896 + 1_048_704 + 1_290 == 1_050_890
    # conv: 2 x (32 x 32 output positions) x 32 filters x 27 = 1,769,472; dense: 2 x 8192 x 128 = 2,097,152;
    # dense: 2 x 128 x 10 = 2,560
    assert info.forward_flops_per_sample == 1_769_472 + 2_097_152 + 2_560 == 3_869_184
    assert info.train_flops_per_sample == 3 * 3_869_184


def test_seed002_cnn_on_digits_by_hand():
    info = models.analyze(SEED002, (8, 8, 1), 10)
    # conv 32 x 9 + 32 = 320; flatten 32 x 4 x 4 = 512; dense 512 x 128 + 128 = 65,664; dense 1,290
    assert info.parameter_count == 320 + 65_664 + 1_290 == 67_274
    assert info.forward_flops_per_sample == 2 * 64 * 32 * 9 + 2 * 512 * 128 + 2 * 128 * 10


def test_valid_padding_and_strided_pool_shapes():
    spec = ModelSpec.model_validate({"layers": [
        {"type": "conv2d", "filters": 6, "kernel_size": 5}, {"type": "maxpool2d", "pool_size": 3, "stride": 2},
        {"type": "flatten"}, {"type": "dense", "units": 10}, {"type": "softmax"}]})
    info = models.analyze(spec, (32, 32, 3), 10)
    assert info.layers[0].output_shape == (6, 28, 28)
    assert info.layers[1].output_shape == (6, 13, 13)  # (28 - 3) // 2 + 1
    assert info.softmax_output


def test_model_errors_name_the_layer():
    bad = ModelSpec.model_validate({"layers": [{"type": "conv2d", "filters": 4, "kernel_size": 9}]})
    with pytest.raises(models.ModelError, match="larger than the 8x8 input") as info:
        models.analyze(bad, (8, 8, 1), 10)
    assert info.value.layer == 0
    with pytest.raises(ValueError, match="softmax is allowed only as the last layer"):
        ModelSpec.model_validate({"layers": [{"type": "softmax"}, {"type": "flatten"}]})


def test_initial_weights_are_deterministic_and_canonical():
    info = models.analyze(SEED002, (8, 8, 1), 10)
    a, b = models.initial_weights(info, 7), models.initial_weights(info, 7)
    c = models.initial_weights(info, 8)
    assert list(a) == info.param_names() == ["0.weight", "0.bias", "3.weight", "3.bias", "4.weight", "4.bias"]
    assert a["0.weight"].shape == (32, 1, 3, 3) and a["3.weight"].shape == (128, 512)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
        assert a[name].dtype == np.float32
    assert not np.array_equal(a["0.weight"], c["0.weight"])
    assert not a["0.bias"].any()
    # he_uniform bound sqrt(6 / fan_in); glorot_uniform sqrt(6 / (fan_in + fan_out))
    assert np.abs(a["0.weight"]).max() <= np.sqrt(6 / 9)
    assert np.abs(a["4.weight"]).max() <= np.sqrt(6 / (128 + 10))
    assert np.abs(a["3.weight"]).max() > 0.9 * np.sqrt(6 / 512)  # fills its range, not a tiny constant


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 5))
def test_chw_to_hwc_permutation_matches_a_channel_last_flatten(c, h, w):
    x = np.random.default_rng(0).random((c, h, w))
    perm = models.chw_to_hwc_permutation((c, h, w))
    np.testing.assert_array_equal(x.reshape(-1)[perm], x.transpose(1, 2, 0).reshape(-1))
