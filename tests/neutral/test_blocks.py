"""Blocks and sequence layers of the neutral model: ResNet-18 and GPT-style decoders counted by hand against the
published figures, residual naming and shortcuts, malformed blocks, canonical initial weights of the new layers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml

from harness.neutral import models
from harness.neutral.models import Input, ModelError
from harness.spec import ModelSpec
from tests.helpers import ROOT


def shipped_model(name: str) -> ModelSpec:
    return ModelSpec.model_validate(yaml.safe_load((ROOT / "specs" / name).read_text())["model"])


def conv(cin: int, cout: int, k: int) -> int:
    """Parameters of a bias-free conv (ResNet's): cout x cin x k x k."""
    return cout * cin * k * k


def bn(c: int) -> int:
    return 2 * c  # gamma and beta; the running statistics are buffers


# ---------------------------------------------------------------------------------------------------- ResNet-18

STAGES = [(64, 1), (128, 2), (256, 2), (512, 2)]  # (filters, stride of the stage's first block), 2 blocks per stage


def resnet18_by_hand() -> tuple[int, int]:
    """(parameters, forward multiply-accumulates) of the CIFAR ResNet-18 (kuangliu/pytorch-cifar's ResNet18: 3x3
    stem of 64 without max pooling, BasicBlock x [2, 2, 2, 2], 1x1 projection + batchnorm where the shape changes,
    4x4 average pooling = global on 4x4, linear 512 -> 10), by the layer arithmetic."""
    params = conv(3, 64, 3) + bn(64)
    macs = 32 * 32 * 64 * 3 * 9
    cin, size = 64, 32
    for filters, stride in STAGES:
        for block in range(2):
            s = stride if block == 0 else 1
            size //= s
            params += conv(cin, filters, 3) + bn(filters) + conv(filters, filters, 3) + bn(filters)
            macs += size * size * filters * (cin * 9 + filters * 9)
            if s != 1 or cin != filters:
                params += conv(cin, filters, 1) + bn(filters)
                macs += size * size * filters * cin
            cin = filters
    params += 512 * 10 + 10
    macs += 512 * 10
    return params, macs


def test_resnet18_parameters_and_flops_match_the_published_figures():
    info = models.analyze(shipped_model("resnet18.yaml"), (32, 32, 3), 10)
    params, macs = resnet18_by_hand()
    # 11,173,962: the parameter count widely cited for kuangliu/pytorch-cifar's ResNet18 (torchsummary's total).
    assert info.parameter_count == params == 11_173_962
    # 0.56 G multiply-accumulates per 32x32 image: the figure cited for the same network (thop/ptflops).
    assert info.forward_flops_per_sample == 2 * macs == 2 * 555_422_720
    assert round(macs / 1e9, 2) == 0.56
    assert [layer.output_shape for layer in info.layers[3:11:2]] == [(64, 32, 32), (128, 16, 16), (256, 8, 8),
                                                                       (512, 4, 4)]
    # projections exactly where the shape changes: the first block of stages 2, 3 and 4
    assert [i for i, layer in enumerate(info.layers) if layer.shortcut] == [5, 7, 9]
    projection = info.layers[5].shortcut[0]
    assert projection.params == {"weight": (128, 64, 1, 1)} and projection.spec.stride == 2


def test_resnet_small_by_hand():
    info = models.analyze(shipped_model("resnet_small.yaml"), (32, 32, 3), 10)
    # stem 16; stages 16 (stride 1), 32 (stride 2, projection), 64 (stride 2, projection); dense 64 -> 10
    assert info.parameter_count == (conv(3, 16, 3) + bn(16) + 2 * (conv(16, 16, 3) + bn(16))
                                    + conv(16, 32, 3) + conv(32, 32, 3) + 2 * bn(32) + conv(16, 32, 1) + bn(32)
                                    + conv(32, 64, 3) + conv(64, 64, 3) + 2 * bn(64) + conv(32, 64, 1) + bn(64)
                                    + 64 * 10 + 10) == 78_042
    macs = (32 * 32 * 16 * 27 + 2 * 32 * 32 * 16 * 144 + 16 * 16 * 32 * (144 + 288 + 16)
            + 8 * 8 * 64 * (288 + 576 + 32) + 640)
    assert info.forward_flops_per_sample == 2 * macs


# ------------------------------------------------------------------------------------------------ transformers

def gpt(vocab: int, length: int, width: int, heads: int, layers: int) -> ModelSpec:
    """A pre-LN decoder: embedding, layers x (residual[layernorm, causal attention], residual[layernorm, dense 4D
    gelu, dense D]), final layernorm, dense vocab."""
    attention = {"type": "residual", "body": [{"type": "layernorm"}, {"type": "attention", "heads": heads,
                                                                          "causal": True}]}
    mlp = {"type": "residual", "body": [{"type": "layernorm"}, {"type": "dense", "units": 4 * width,
                                                                 "activation": "gelu"},
                                        {"type": "dense", "units": width}]}
    return ModelSpec.model_validate({"layers": [{"type": "embedding", "vocab": vocab, "dim": width},
                                                *[attention, mlp] * layers, {"type": "layernorm"},
                                                {"type": "dense", "units": vocab}]})


def gpt_parameters(vocab: int, length: int, width: int, layers: int) -> int:
    """V·D + L·D + layers·(12·D² + 13·D) + 2·D + (D·V + V). Per layer: layernorm 2D; attention in_proj 3D² + 3D and
    out_proj D² + D; layernorm 2D; dense D -> 4D: 4D² + 4D; dense 4D -> D: 4D² + D; in all 12D² + 13D. The final
    layernorm 2D; an untied output layer D·V + V."""
    d = width
    return vocab * d + length * d + layers * (12 * d * d + 13 * d) + 2 * d + d * vocab + vocab


def chinchilla_forward_flops(vocab: int, length: int, width: int, layers: int) -> int:
    """Forward FLOPs of one sequence by Hoffmann et al. 2022 (Chinchilla), Appendix F, per token: per layer the
    q/k/v projections 2·3·D², the logits 2·L·D, the weighted values 2·L·D, the output projection 2·D², the
    feed-forward 2·2·D·4D; then the output logits 2·D·V. Left out, as the harness does: the embedding lookup
    (Chinchilla counts it as a matmul, 2·V·D) and the softmax (3·heads·L)."""
    d, n = width, length
    per_layer = 2 * 3 * d * d + 2 * n * d + 2 * n * d + 2 * d * d + 2 * 2 * d * 4 * d
    return n * (layers * per_layer + 2 * d * vocab)


@pytest.mark.parametrize("vocab, length, width, heads, layers", [(16, 32, 64, 4, 2), (50, 12, 24, 3, 3)])
def test_decoder_parameters_and_flops_by_hand(vocab, length, width, heads, layers):
    info = models.analyze(gpt(vocab, length, width, heads, layers), Input.tokens(length, vocab, True), vocab)
    assert info.parameter_count == gpt_parameters(vocab, length, width, layers)
    assert info.forward_flops_per_sample == chinchilla_forward_flops(vocab, length, width, layers)
    # the same, as 24·L·D² + 4·L²·D per layer plus the head's 2·L·D·V
    assert info.forward_flops_per_sample == layers * (24 * length * width ** 2 + 4 * length ** 2 * width) \
        + 2 * length * width * vocab
    assert info.task == "next_token" and info.layers[-1].output_shape == (length, vocab)


def test_shipped_decoders_match_the_formula():
    small = models.analyze(shipped_model("transformer_small.yaml"), Input.tokens(32, 16, True), 16)
    assert small.parameter_count == gpt_parameters(16, 32, 64, 2) == 104_208
    assert small.forward_flops_per_sample == chinchilla_forward_flops(16, 32, 64, 2)
    full = models.analyze(shipped_model("transformer.yaml"), Input.tokens(512, 8192, True), 8192)
    assert full.parameter_count == gpt_parameters(8192, 512, 768, 12) == 98_040_320


def test_attention_flops_count_both_products_at_full_length():
    # L = 5, D = 8: projections 2·5·8·24 = 1920, scores 2·5·5·8 = 400, values 400, output 2·5·8·8 = 640
    assert models.attention_flops(5, 8) == 1920 + 400 + 400 + 640
    causal = ModelSpec.model_validate({"layers": [{"type": "embedding", "vocab": 4, "dim": 8},
                                                  {"type": "attention", "heads": 2, "causal": True},
                                                  {"type": "sequence_pool", "mode": "last"},
                                                  {"type": "dense", "units": 2}]})
    info = models.analyze(causal, Input.tokens(5, 4), 2)
    assert info.layers[1].forward_flops == 3360  # causal counts the full L x L, as dense kernels compute it
    assert info.forward_flops_per_sample == 3360 + 2 * 8 * 2 and info.task == "sequence_classification"
    assert info.layers[1].params == {"in_proj.weight": (24, 8), "in_proj.bias": (24,), "out_proj.weight": (8, 8),
                                     "out_proj.bias": (8,)}


# --------------------------------------------------------------------------------------- residual blocks, convs

def block(filters: int, stride: int = 1, **extra) -> dict:
    return {"type": "residual", "activation": "relu", **extra, "body": [
        {"type": "conv2d", "filters": filters, "kernel_size": 3, "stride": stride, "padding": 1, "use_bias": False},
        {"type": "batchnorm"}, {"type": "relu"},
        {"type": "conv2d", "filters": filters, "kernel_size": 3, "padding": 1, "use_bias": False},
        {"type": "batchnorm"}]}


def test_residual_names_shortcut_and_buffers():
    spec = ModelSpec.model_validate({"layers": [
        {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same"}, block(4), block(8, 2),
        {"type": "global_avgpool2d"}, {"type": "dense", "units": 10}]})
    info = models.analyze(spec, (7, 7, 1), 10)
    assert info.param_names() == [
        "0.weight", "0.bias",
        "1.0.weight", "1.1.weight", "1.1.bias", "1.3.weight", "1.4.weight", "1.4.bias",
        "2.0.weight", "2.1.weight", "2.1.bias", "2.3.weight", "2.4.weight", "2.4.bias",
        "2.shortcut.weight", "2.shortcut_bn.weight", "2.shortcut_bn.bias",
        "4.weight", "4.bias"]
    assert info.buffer_names() == [f"{name}.{stat}" for name in ("1.1", "1.4", "2.1", "2.4", "2.shortcut_bn")
                                   for stat in ("running_mean", "running_var")]
    identity, projected = info.layers[1], info.layers[2]
    assert identity.shortcut == () and identity.output_shape == (4, 7, 7)
    # 7x7 -> stride 2, padding 1, kernel 3: (7 + 2 - 3) // 2 + 1 = 4; the 1x1 projection: stride ceil(7/4) = 2,
    # (7 - 1) // 2 + 1 = 4
    assert projected.output_shape == (8, 4, 4)
    conv_info, norm = projected.shortcut
    assert (conv_info.name, conv_info.path, conv_info.spec.stride, conv_info.spec.use_bias) == (
        "2.shortcut", "2.shortcut", 2, False)
    assert (norm.name, norm.kind, norm.output_shape) == ("2.shortcut_bn", "batchnorm", (8, 4, 4))
    assert [layer.index for layer in projected.walk()] == [2] * 8  # every child carries its block's index
    assert projected.body[0].path == "2.body.0" and projected.body[0].name == "2.0"
    # FLOPs: body 2·16·8·4·9 + 2·16·8·8·9 and the projection 2·16·8·4; the block's are its children's sum
    assert projected.forward_flops == 2 * 16 * 8 * 36 + 2 * 16 * 8 * 72 + 2 * 16 * 8 * 4
    assert info.forward_flops_per_sample == sum(layer.forward_flops for layer in info.layers)
    assert info.parameter_count == 4 * 9 + 4 + 2 * (4 * 4 * 9 + 8) + (8 * 4 * 9 + 16 + 8 * 8 * 9 + 16) \
        + (8 * 4 + 16) + 8 * 10 + 10


@pytest.mark.parametrize("layer, hwc, out, flops", [
    # (H + 2p - k) // s + 1: (9 + 2 - 3) // 2 + 1 = 5; FLOPs 2 x 5 x 5 x 6 x 2 x 9 at the real output positions
    ({"stride": 2, "padding": 1}, (9, 9, 2), (6, 5, 5), 2 * 25 * 6 * 18),
    ({"stride": 3}, (10, 7, 2), (6, 3, 2), 2 * 6 * 6 * 18),  # valid: (10 - 3) // 3 + 1 = 3, (7 - 3) // 3 + 1 = 2
    ({"padding": 2}, (4, 4, 2), (6, 6, 6), 2 * 36 * 6 * 18),  # 4 + 4 - 3 + 1 = 6
])
def test_strided_and_padded_convolutions(layer, hwc, out, flops):
    spec = ModelSpec.model_validate({"layers": [{"type": "conv2d", "filters": 6, "kernel_size": 3, **layer},
                                                {"type": "flatten"}, {"type": "dense", "units": 3}]})
    info = models.analyze(spec, hwc, 3)
    assert info.layers[0].output_shape == out and info.layers[0].forward_flops == flops


def test_a_conv_without_bias_has_no_bias_parameter_and_keeps_the_legacy_draw():
    with_bias = ModelSpec.model_validate({"layers": [{"type": "conv2d", "filters": 3, "kernel_size": 3},
                                                     {"type": "flatten"}, {"type": "dense", "units": 2}]})
    without = ModelSpec.model_validate({"layers": [{"type": "conv2d", "filters": 3, "kernel_size": 3,
                                                    "use_bias": False}, {"type": "flatten"},
                                                   {"type": "dense", "units": 2}]})
    a, b = (models.initial_weights(models.analyze(m, (5, 5, 1), 2), 4) for m in (with_bias, without))
    assert "0.bias" in a and "0.bias" not in b
    np.testing.assert_array_equal(a["0.weight"], b["0.weight"])
    # the legacy rule, derived by hand: top-level layer 0 draws glorot_uniform from default_rng([seed, 0])
    limit = math.sqrt(6 / (9 + 27))
    expected = np.random.default_rng([4, 0]).uniform(-limit, limit, size=(3, 1, 3, 3)).astype(np.float32)
    np.testing.assert_array_equal(b["0.weight"], expected)


# ------------------------------------------------------------------------------------------- malformed models

@pytest.mark.parametrize("layers, feed, classes, path, words", [
    ([{"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": 1}, block(8, 2, shortcut="identity"),
      {"type": "global_avgpool2d"}, {"type": "dense", "units": 10}], (8, 8, 1), 10, "1.body",
     "the body changes (4, 8, 8) to (8, 4, 4) and shortcut is identity"),
    ([{"type": "embedding", "vocab": 16, "dim": 30}, {"type": "residual", "body": [
        {"type": "layernorm"}, {"type": "attention", "heads": 4}]}, {"type": "dense", "units": 16}],
     Input.tokens(8, 16, True), 16, "1.body.1", "attention width 30 is not divisible by its 4 heads"),
    ([{"type": "embedding", "vocab": 16, "dim": 30}, {"type": "attention", "heads": 4}],
     Input.tokens(8, 16, True), 30, "1", "not divisible by its 4 heads"),
    ([{"type": "embedding", "vocab": 16, "dim": 8}, {"type": "residual", "body": [{"type": "dense", "units": 4}]},
      {"type": "dense", "units": 16}], Input.tokens(8, 16, True), 16, "1.body",
     "a projection shortcut maps (C, H, W) to (C', H', W') only"),
    ([{"type": "conv2d", "filters": 4, "kernel_size": 3}, {"type": "residual", "body": [
        {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": 2}]}, {"type": "flatten"},
      {"type": "dense", "units": 10}], (8, 8, 1), 10, "1.body", "which no 1x1 convolution stride"),
    ([{"type": "dense", "units": 4}], Input.tokens(8, 16, True), 16, "0", "must start with an embedding layer"),
    ([{"type": "flatten"}, {"type": "embedding", "vocab": 4, "dim": 2}], (2, 2, 1), 10, "1", "needs token ids"),
    ([{"type": "embedding", "vocab": 8, "dim": 4}, {"type": "dense", "units": 16}], Input.tokens(8, 16, True), 16,
     "0", "embedding vocab 8 is smaller than the dataset's 16 tokens"),
    ([{"type": "embedding", "vocab": 16, "dim": 4}, {"type": "sequence_pool"}, {"type": "dense", "units": 16}],
     Input.tokens(8, 16, True), 16, "2", "it must output (8, 16)"),
    ([{"type": "embedding", "vocab": 16, "dim": 4}, {"type": "dense", "units": 2}], Input.tokens(8, 16), 2, "1",
     "pool the sequence first"),
    ([{"type": "embedding", "vocab": 16, "dim": 4}, {"type": "batchnorm"}], Input.tokens(8, 16), 2, "1",
     "use layernorm on a sequence"),
    ([{"type": "conv2d", "filters": 2, "kernel_size": 3}, {"type": "layernorm"}], (4, 4, 1), 2, "1",
     "layernorm needs a flat (F,) or a sequence (L, D) input"),
])
def test_malformed_models_name_the_layer(layers, feed, classes, path, words):
    with pytest.raises(ModelError) as err:
        models.analyze(ModelSpec.model_validate({"layers": layers}), feed, classes)
    assert err.value.path == path and err.value.layer == int(path.split(".")[0])
    assert words in str(err.value), str(err.value)


# --------------------------------------------------------------------------------------------- initial weights

def test_new_layers_initial_weights():
    info = models.analyze(gpt(vocab=300, length=64, width=32, heads=4, layers=2), Input.tokens(64, 300, True), 300)
    weights = models.initial_weights(info, 1)
    assert list(weights) == info.param_names()
    assert all(value.dtype == np.float32 for value in weights.values())
    assert weights["0.token.weight"].shape == (300, 32) and weights["0.position.weight"].shape == (64, 32)
    # GPT-2's normal(0, 0.02): 9,600 draws, so the sample std is within a few percent of 0.02
    assert abs(float(weights["0.token.weight"].std()) - 0.02) < 0.001
    assert not np.array_equal(weights["0.token.weight"][:64], weights["0.position.weight"])
    in_proj = weights["1.1.in_proj.weight"]
    # torch.nn.MultiheadAttention's xavier_uniform_ on the whole (3D, D) matrix: bound sqrt(6 / (D + 3D))
    assert in_proj.shape == (96, 32) and np.abs(in_proj).max() <= math.sqrt(6 / (4 * 32))
    assert np.abs(in_proj).max() > 0.9 * math.sqrt(6 / (4 * 32))
    assert np.abs(weights["1.1.out_proj.weight"]).max() <= math.sqrt(6 / 64)  # dense's glorot_uniform
    for name in ("1.1.in_proj.bias", "1.1.out_proj.bias", "1.0.bias", "5.bias"):
        assert not weights[name].any(), name
    np.testing.assert_array_equal(weights["1.0.weight"], np.ones(32, np.float32))  # layernorm scale
    # two identical blocks at different places draw different weights (each parameter's generator is its name's)
    assert not np.array_equal(weights["1.1.in_proj.weight"], weights["3.1.in_proj.weight"])
    np.testing.assert_array_equal(weights["3.1.in_proj.weight"], models.initial_weights(info, 1)["3.1.in_proj.weight"])
    assert not np.array_equal(weights["1.1.in_proj.weight"], models.initial_weights(info, 2)["1.1.in_proj.weight"])


def test_a_block_s_weights_do_not_depend_on_other_blocks():
    first = models.analyze(ModelSpec.model_validate({"layers": [
        {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": 1}, block(4), block(8, 2),
        {"type": "global_avgpool2d"}, {"type": "dense", "units": 10}]}), (8, 8, 1), 10)
    changed = models.analyze(ModelSpec.model_validate({"layers": [
        {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": 1}, block(4), block(16, 2),
        {"type": "global_avgpool2d"}, {"type": "dense", "units": 10}]}), (8, 8, 1), 10)
    a, b = models.initial_weights(first, 0), models.initial_weights(changed, 0)
    for name in ("0.weight", "1.0.weight", "1.3.weight"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert a["2.0.weight"].shape == (8, 4, 3, 3) and b["2.0.weight"].shape == (16, 4, 3, 3)
    buffers = models.initial_buffers(first)
    np.testing.assert_array_equal(buffers["2.shortcut_bn.running_var"], np.ones(8, np.float32))
    np.testing.assert_array_equal(models.initial_weights(first, 0)["2.shortcut_bn.weight"], np.ones(8, np.float32))


# ------------------------------------------------------------------------------------------------ requirements

def test_requirements_list_the_task_kinds_and_options_in_model_order():
    spec = ModelSpec.model_validate({"layers": [
        {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": 1}, block(8, 2),
        {"type": "global_avgpool2d"}, {"type": "dense", "units": 10}]})
    needs = models.requirements(models.analyze(spec, (8, 8, 1), 10))
    assert needs[:3] == [("image_classification", "the dataset"), ("conv2d", "model.layers.0"),
                         ("conv2d.padding", "model.layers.0")]
    assert ("residual", "model.layers.1") in needs
    assert ("conv2d.stride", "model.layers.1.body.0") in needs and ("conv2d.no_bias", "model.layers.1.body.0") in needs
    assert ("conv2d.stride", "model.layers.1.shortcut") in needs
    assert ("batchnorm", "model.layers.1.shortcut_bn") in needs
    decoder = models.analyze(gpt(8, 4, 8, 2, 1), Input.tokens(4, 8, True), 8)
    features = {feature for feature, _ in models.requirements(decoder)}
    assert {"next_token", "embedding", "layernorm", "attention", "attention.causal", "dense.gelu",
            "dense.sequence", "residual"} <= features
    assert models.describe_feature("conv2d.stride") == "conv2d with stride > 1"
    assert models.describe_feature("gelu") == "gelu layers"
