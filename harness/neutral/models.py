"""The framework-neutral model: shape inference, parameter counts, FLOPs and seeded initial weights.

Canonical conventions, which every adapter converts from:

- activations are channel-first, (C, H, W) per sample; the datasets give NHWC images and adapters transpose or not;
- conv2d weights are OIHW (out channels, in channels, kernel height, kernel width), biases (O,);
- dense weights are (out, in), biases (out,);
- ``flatten`` orders features channel-first: feature index = c * H * W + h * W + w. A framework that flattens an
  (H, W, C) tensor must permute the rows of the following dense layer's input dimension, not the data (and the
  features of a batchnorm between the two);
- batchnorm's trainable parameters are "<i>.weight" (gamma, (C,) or (F,), initially 1) and "<i>.bias" (beta,
  initially 0); its running mean and variance are buffers, not parameters: "<i>.running_mean" (initially 0) and
  "<i>.running_var" (initially 1), from ``initial_buffers``. ``initial_weights``, ``param_names`` and
  ``parameter_count`` cover the trainable parameters only. The momentum and variance conventions are PyTorch's (see
  ``harness.spec.BatchNorm``): the running variance is updated with the unbiased batch variance, the normalisation in
  training mode uses the biased one;
- dropout is inverted dropout (kept values scaled by 1 / (1 - rate) in training, the identity in inference). Its
  masks are random draws of each framework's own generator and cannot be made equal across frameworks, so the
  equivalence of the frameworks is proven for inference and for training without dropout.

FLOPs follow the usual convention of counting 2 * M * N * K per matrix product (one multiply and one add per
multiply-accumulate) and the equivalent for a convolution; pooling (max, average, global average), batchnorm,
dropout, activations and bias adds are not counted (they are elementwise or reductions, O(1) per value). A
training step is counted as 3 x the forward pass (forward, plus the backward pass's gradient with respect to the
activations and with respect to the weights; the convention of Kaplan et al. 2020 and PaLM's MFU, which slightly
overcounts the first layer, whose input gradient is not needed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.spec import (AvgPool2D, BatchNorm, Conv2D, Dense, Dropout, Flatten, GlobalAvgPool2D, MaxPool2D, ModelSpec,
                          ReLU, Softmax)


class ModelError(ValueError):
    """A model that does not fit its input or its classes. ``layer`` is the index in the layer list, or None."""

    def __init__(self, layer: int | None, message: str):
        self.layer = layer
        super().__init__(message)


@dataclass(frozen=True)
class LayerInfo:
    """One layer with its inferred shapes (channel-first, per sample), its trainable parameter shapes (canonical) and
    its buffer shapes (batchnorm's running statistics: state, not trained)."""

    index: int
    spec: Any
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    forward_flops: int = 0
    buffers: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.spec.type


@dataclass(frozen=True)
class ModelInfo:
    """The analysed model. ``input_shape`` is (C, H, W); ``layers`` excludes nothing (a trailing softmax is kept
    and marked by ``softmax_output``; adapters fold it into the loss)."""

    input_shape: tuple[int, int, int]
    num_classes: int
    layers: tuple[LayerInfo, ...]

    @property
    def parameter_count(self) -> int:
        """Number of trainable scalars."""
        return int(sum(int(np.prod(shape)) for layer in self.layers for shape in layer.params.values()))

    @property
    def forward_flops_per_sample(self) -> int:
        """FLOPs of one sample's forward pass (2 * multiply-accumulates of convs and matmuls)."""
        return int(sum(layer.forward_flops for layer in self.layers))

    @property
    def train_flops_per_sample(self) -> int:
        """FLOPs of one sample's training step: 3 x forward (see the module docstring)."""
        return 3 * self.forward_flops_per_sample

    @property
    def softmax_output(self) -> bool:
        return bool(self.layers) and self.layers[-1].kind == "softmax"

    def param_names(self) -> list[str]:
        """Names of all parameters in a stable order: ``"<layer index>.weight"``, ``"<layer index>.bias"``."""
        return [f"{layer.index}.{name}" for layer in self.layers for name in layer.params]

    def buffer_names(self) -> list[str]:
        """Names of all buffers in a stable order: ``"<layer index>.running_mean"``, ``"<layer index>.running_var"``."""
        return [f"{layer.index}.{name}" for layer in self.layers for name in layer.buffers]


def analyze(model: ModelSpec, image_shape_hwc: tuple[int, int, int], num_classes: int) -> ModelInfo:
    """Infers every layer's shapes, parameters and FLOPs.

    image_shape_hwc: one image's (height, width, channels). num_classes: the dataset's label count, which the last
    layer's output must equal. Raises ModelError naming the first layer that does not fit.
    """
    h, w, c = image_shape_hwc
    shape: tuple[int, ...] = (c, h, w)
    infos: list[LayerInfo] = []
    for i, layer in enumerate(model.layers):
        infos.append(_layer_info(i, layer, shape))
        shape = infos[-1].output_shape
    if shape != (num_classes,):
        raise ModelError(len(model.layers) - 1, f"the model outputs {shape} but the dataset has {num_classes} classes")
    return ModelInfo((c, h, w), num_classes, tuple(infos))


def _layer_info(i: int, layer: Any, shape: tuple[int, ...]) -> LayerInfo:
    """One layer's output shape, parameters, buffers and forward FLOPs for an input of ``shape`` (channel-first)."""
    if isinstance(layer, Conv2D):
        return _conv2d(i, layer, shape)
    if isinstance(layer, (MaxPool2D, AvgPool2D)):
        cin, hin, win = _image_input(i, layer.type, shape)
        p, s = layer.pool_size, layer.stride or layer.pool_size
        if p > hin or p > win:
            raise ModelError(i, f"pool_size {p} is larger than the {hin}x{win} input")
        return LayerInfo(i, layer, shape, (cin, (hin - p) // s + 1, (win - p) // s + 1))
    if isinstance(layer, GlobalAvgPool2D):
        return LayerInfo(i, layer, shape, (_image_input(i, layer.type, shape)[0],))
    if isinstance(layer, BatchNorm):
        if len(shape) not in (1, 3):
            raise ModelError(i, f"batchnorm needs a (C, H, W) or a flat input, got {shape}")
        return LayerInfo(i, layer, shape, shape, {"weight": (shape[0],), "bias": (shape[0],)}, 0,
                         {"running_mean": (shape[0],), "running_var": (shape[0],)})
    if isinstance(layer, Flatten):
        return LayerInfo(i, layer, shape, (int(np.prod(shape)),))
    if isinstance(layer, Dense):
        if len(shape) != 1:
            raise ModelError(i, f"dense needs a flat input, got {shape}; add a flatten layer before it")
        return LayerInfo(i, layer, shape, (layer.units,), {"weight": (layer.units, shape[0]), "bias": (layer.units,)},
                         2 * shape[0] * layer.units)
    if isinstance(layer, (ReLU, Softmax, Dropout)):
        return LayerInfo(i, layer, shape, shape)
    raise ModelError(i, f"unsupported layer {layer!r}")  # pragma: no cover - the spec's union admits nothing else


def _image_input(i: int, kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) != 3:
        raise ModelError(i, f"{kind} needs a (C, H, W) input, got {shape}" + ("; is it after flatten?"
                                                                             if kind == "conv2d" else ""))
    return shape


def _conv2d(i: int, layer: Conv2D, shape: tuple[int, ...]) -> LayerInfo:
    cin, hin, win = _image_input(i, "conv2d", shape)
    k = layer.kernel_size
    if layer.padding == "same":
        if k % 2 == 0:
            raise ModelError(i, "padding 'same' needs an odd kernel_size (frameworks pad even kernels differently)")
        hout, wout = hin, win
    else:
        hout, wout = hin - k + 1, win - k + 1
        if hout <= 0 or wout <= 0:
            raise ModelError(i, f"kernel_size {k} is larger than the {hin}x{win} input")
    return LayerInfo(i, layer, shape, (layer.filters, hout, wout),
                     {"weight": (layer.filters, cin, k, k), "bias": (layer.filters,)},
                     2 * hout * wout * layer.filters * cin * k * k)


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 1:  # a bias: Keras's convention, fan_in = fan_out = its length
        return shape[0], shape[0]
    if len(shape) == 2:  # dense (out, in)
        return shape[1], shape[0]
    receptive = int(np.prod(shape[2:]))
    return shape[1] * receptive, shape[0] * receptive


def _initialize(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name == "zeros":
        return np.zeros(shape, dtype=np.float32)
    fan_in, fan_out = _fans(shape)
    if name == "he_uniform":
        limit = np.sqrt(6.0 / fan_in)
        return rng.uniform(-limit, limit, size=shape).astype(np.float32)
    if name == "glorot_uniform":
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-limit, limit, size=shape).astype(np.float32)
    if name in ("he_normal", "glorot_normal"):
        # Keras's variance-scaling normal: a normal truncated at 2 standard deviations, rescaled by 0.8796 (the std of
        # a unit normal truncated at +-2) so that the variance is 2/fan_in (he) or 2/(fan_in+fan_out) (glorot).
        variance = 2.0 / fan_in if name == "he_normal" else 2.0 / (fan_in + fan_out)
        std = np.sqrt(variance) / 0.87962566103423978
        values = rng.standard_normal(size=shape)
        while np.any(bad := np.abs(values) > 2.0):
            values[bad] = rng.standard_normal(size=int(bad.sum()))
        return (values * std).astype(np.float32)
    raise ValueError(f"unknown initializer {name!r}")


def initial_weights(info: ModelInfo, seed: int) -> dict[str, np.ndarray]:
    """Draws the initial parameters once, in the canonical layout, from ``seed``.

    Returns a dict from ``"<layer index>.weight"`` / ``"<layer index>.bias"`` to float32 arrays (conv OIHW, dense
    (out, in), batchnorm gamma (C,) = 1 and beta (C,) = 0, drawing nothing). Each layer draws from its own generator
    seeded by (seed, layer index), so adding a layer does not change the others' weights. Deterministic: the same seed
    gives the same arrays on any machine. Buffers are not included (see ``initial_buffers``).
    """
    weights: dict[str, np.ndarray] = {}
    for layer in info.layers:
        if not layer.params:
            continue
        if layer.kind == "batchnorm":
            weights[f"{layer.index}.weight"] = np.ones(layer.params["weight"], dtype=np.float32)
            weights[f"{layer.index}.bias"] = np.zeros(layer.params["bias"], dtype=np.float32)
            continue
        rng = np.random.default_rng([seed, layer.index])
        weights[f"{layer.index}.weight"] = _initialize(layer.spec.kernel_init, layer.params["weight"], rng)
        weights[f"{layer.index}.bias"] = _initialize(layer.spec.bias_init, layer.params["bias"], rng)
    return weights


def initial_buffers(info: ModelInfo) -> dict[str, np.ndarray]:
    """The initial buffers, float32: every batchnorm's ``"<i>.running_mean"`` (zeros) and ``"<i>.running_var"``
    (ones), the frameworks' common starting point. Adapters start from these unless ``build`` is given others."""
    buffers: dict[str, np.ndarray] = {}
    for layer in info.layers:
        for name, shape in layer.buffers.items():
            fill = 1.0 if name == "running_var" else 0.0
            buffers[f"{layer.index}.{name}"] = np.full(shape, fill, dtype=np.float32)
    return buffers


def chw_to_hwc_permutation(shape_chw: tuple[int, int, int]) -> np.ndarray:
    """Index map for a dense layer fed by a channel-last flatten.

    For an (H, W, C) tensor flattened in that order, feature j of the channel-last flatten is feature
    ``perm[j]`` of the canonical channel-first flatten, so ``kernel_hwc = weight[:, perm]`` (shape (out, in)).
    """
    c, h, w = shape_chw
    return np.arange(c * h * w).reshape(c, h, w).transpose(1, 2, 0).reshape(-1)
