"""The framework-neutral model: shapes, parameter counts and FLOPs by hand, seeded weights."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.neutral import models
from harness.spec import ModelSpec
from tests.adapters.kit import CNN

SEED002 = CNN  # the seed-002 CNN (tests/adapters/kit.py)


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
    # training: 3 x forward, less the conv's input gradient (its input is the images: nothing needs it)
    assert info.train_flops_per_sample == 3 * 3_869_184 - 1_769_472 == 9_838_080


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


NORM_CNN = ModelSpec.model_validate({"layers": [
    {"type": "conv2d", "filters": 16, "kernel_size": 3, "padding": "same"},
    {"type": "batchnorm"},
    {"type": "relu"},
    {"type": "avgpool2d", "pool_size": 2},
    {"type": "conv2d", "filters": 32, "kernel_size": 3},
    {"type": "batchnorm", "momentum": 0.01, "epsilon": 1e-3},
    {"type": "maxpool2d", "pool_size": 3, "stride": 2},
    {"type": "dropout", "rate": 0.25},
    {"type": "global_avgpool2d"},
    {"type": "batchnorm"},
    {"type": "dense", "units": 10},
]})


def test_batchnorm_pooling_and_dropout_by_hand():
    info = models.analyze(NORM_CNN, (32, 32, 3), 10)
    # conv same 16: (16, 32, 32); batchnorm, relu keep it; avgpool 2: (16, 16, 16); conv valid 3: (32, 14, 14);
    # maxpool 3 stride 2: ((14 - 3) // 2 + 1 = 6); dropout keeps it; global average pool: (32,); batchnorm (32,)
    assert [layer.output_shape for layer in info.layers] == [
        (16, 32, 32), (16, 32, 32), (16, 32, 32), (16, 16, 16), (32, 14, 14), (32, 14, 14), (32, 6, 6), (32, 6, 6),
        (32,), (32,), (10,)]
    # conv 16 x 27 + 16 = 448; batchnorm 16 gammas + 16 betas = 32; conv 32 x 16 x 9 + 32 = 4,640; batchnorm 64;
    # batchnorm over the 32 pooled features 64; dense 32 x 10 + 10 = 330. Running statistics are not parameters.
    assert info.parameter_count == 448 + 32 + 4_640 + 64 + 64 + 330 == 5_578
    assert info.layers[1].params == {"weight": (16,), "bias": (16,)}
    assert info.layers[9].params == {"weight": (32,), "bias": (32,)}
    assert info.buffer_names() == ["1.running_mean", "1.running_var", "5.running_mean", "5.running_var",
                                   "9.running_mean", "9.running_var"]
    # Only the convolutions and the dense layer count (batchnorm, pooling and dropout are not FLOPs here):
    # 2 x (32 x 32) x 16 x 27 + 2 x (14 x 14) x 32 x 144 + 2 x 32 x 10
    assert info.forward_flops_per_sample == 884_736 + 1_806_336 + 640 == 2_691_712


def test_batchnorm_weights_and_buffers_start_at_the_frameworks_defaults():
    info = models.analyze(NORM_CNN, (32, 32, 3), 10)
    weights = models.initial_weights(info, 3)
    assert list(weights) == info.param_names()
    np.testing.assert_array_equal(weights["1.weight"], np.ones(16, np.float32))  # gamma
    np.testing.assert_array_equal(weights["1.bias"], np.zeros(16, np.float32))  # beta
    buffers = models.initial_buffers(info)
    assert list(buffers) == info.buffer_names()
    np.testing.assert_array_equal(buffers["5.running_mean"], np.zeros(32, np.float32))
    np.testing.assert_array_equal(buffers["5.running_var"], np.ones(32, np.float32))
    assert all(value.dtype == np.float32 for value in {**weights, **buffers}.values())
    # the other layers' draws do not depend on the batchnorm layers (each layer has its own generator)
    plain = models.analyze(ModelSpec.model_validate({"layers": [
        {"type": "conv2d", "filters": 16, "kernel_size": 3, "padding": "same"}, {"type": "flatten"},
        {"type": "dense", "units": 10}]}), (32, 32, 3), 10)
    np.testing.assert_array_equal(models.initial_weights(plain, 3)["0.weight"], weights["0.weight"])


def test_batchnorm_on_a_flat_input_and_layer_errors():
    flat = ModelSpec.model_validate({"layers": [
        {"type": "flatten"}, {"type": "batchnorm"}, {"type": "dense", "units": 10}]})
    info = models.analyze(flat, (8, 8, 1), 10)
    assert info.layers[1].params == {"weight": (64,), "bias": (64,)}
    assert info.parameter_count == 64 + 64 + 64 * 10 + 10
    for layers, index, message in [
        ([{"type": "flatten"}, {"type": "global_avgpool2d"}], 1, "global_avgpool2d needs a"),
        ([{"type": "flatten"}, {"type": "avgpool2d"}], 1, "avgpool2d needs a"),
        ([{"type": "avgpool2d", "pool_size": 9}], 0, "larger than the 8x8 input"),
    ]:
        with pytest.raises(models.ModelError, match=message) as err:
            models.analyze(ModelSpec.model_validate({"layers": layers}), (8, 8, 1), 10)
        assert err.value.layer == index


@pytest.mark.parametrize("layer", [
    {"type": "dropout", "rate": 1.0},
    {"type": "dropout", "rate": -0.1},
    {"type": "dropout"},  # the rate has no default
    {"type": "batchnorm", "momentum": 0.0},
    {"type": "batchnorm", "momentum": 1.5},
    {"type": "batchnorm", "epsilon": 0.0},
    {"type": "batchnorm", "axis": 1},  # unknown field
    {"type": "avgpool2d", "pool_size": 0},
    {"type": "global_avgpool2d", "pool_size": 2},
])
def test_invalid_new_layers_are_rejected(layer):
    with pytest.raises(ValueError):
        ModelSpec.model_validate({"layers": [layer, {"type": "flatten"}]})


def test_new_layer_defaults():
    spec = ModelSpec.model_validate({"layers": [
        {"type": "batchnorm"}, {"type": "avgpool2d"}, {"type": "dropout", "rate": 0.0}, {"type": "global_avgpool2d"}]})
    norm, pool, dropout, _ = spec.layers
    assert (norm.momentum, norm.epsilon) == (0.1, 1e-5)  # PyTorch's defaults, in PyTorch's momentum convention
    assert (pool.pool_size, pool.stride) == (2, None)
    assert dropout.rate == 0.0
