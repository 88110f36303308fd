"""The framework-neutral model of a spec: its layers and ``ModelSpec``. Imports only ``harness.spec.base``."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator

from harness.spec.base import _Strict

Initializer = Literal["he_uniform", "he_normal", "glorot_uniform", "glorot_normal", "zeros"]
Activation = Literal["relu", "none"]


class Conv2D(_Strict):
    """2-D convolution, stride 1. Weights in the canonical layout OIHW."""

    type: Literal["conv2d"]
    filters: int = Field(gt=0)
    kernel_size: int = Field(gt=0)
    padding: Literal["same", "valid"] = "valid"
    activation: Activation = "none"
    kernel_init: Initializer = "glorot_uniform"
    bias_init: Initializer = "zeros"


class MaxPool2D(_Strict):
    """Max pooling with a square window; stride defaults to the window size; no padding."""

    type: Literal["maxpool2d"]
    pool_size: int = Field(default=2, gt=0)
    stride: int | None = Field(default=None, gt=0)


class AvgPool2D(_Strict):
    """Average pooling with a square window; stride defaults to the window size; no padding (every window is whole,
    so every average is over pool_size^2 values)."""

    type: Literal["avgpool2d"]
    pool_size: int = Field(default=2, gt=0)
    stride: int | None = Field(default=None, gt=0)


class GlobalAvgPool2D(_Strict):
    """The mean over the height and width of each channel: (C, H, W) -> (C,)."""

    type: Literal["global_avgpool2d"]


class BatchNorm(_Strict):
    """Batch normalisation over the channels of a (C, H, W) input (statistics over batch, height and width) or over
    the features of a flat (F,) input (statistics over the batch), with a learned scale (gamma, "weight", initially 1)
    and shift (beta, "bias", initially 0).

    Training mode normalises with the batch's mean and biased variance and updates the running statistics, which
    start at mean 0 and variance 1, as running <- (1 - momentum) * running + momentum * batch statistic, with the
    UNBIASED batch variance (n / (n - 1) x the biased one, n the values per channel in the batch): PyTorch's
    convention, in which momentum is the weight of the new batch (Keras and MXNet call 1 - momentum their momentum).
    Inference mode normalises with the running statistics. The normalisation is (x - mean) / sqrt(var + epsilon).
    """

    type: Literal["batchnorm"]
    momentum: float = Field(default=0.1, gt=0, le=1)
    epsilon: float = Field(default=1e-5, gt=0)


class Dropout(_Strict):
    """Inverted dropout: in training mode each value is zeroed with probability ``rate`` and the others are scaled by
    1 / (1 - rate); in inference mode the identity. The masks are each framework's own random draws."""

    type: Literal["dropout"]
    rate: float = Field(ge=0, lt=1)


class Flatten(_Strict):
    """Flattens (C, H, W) in channel-first order, whatever layout a framework computes in."""

    type: Literal["flatten"]


class Dense(_Strict):
    """Fully connected layer. Weights in the canonical layout (out, in)."""

    type: Literal["dense"]
    units: int = Field(gt=0)
    activation: Activation = "none"
    kernel_init: Initializer = "glorot_uniform"
    bias_init: Initializer = "zeros"


class ReLU(_Strict):
    type: Literal["relu"]


class Softmax(_Strict):
    """Allowed only as the last layer; it is folded into the softmax cross-entropy loss on the logits."""

    type: Literal["softmax"]


Layer = Annotated[Union[Conv2D, MaxPool2D, AvgPool2D, GlobalAvgPool2D, BatchNorm, Dropout, Flatten, Dense, ReLU,
                         Softmax], Field(discriminator="type")]


class ModelSpec(_Strict):
    """A framework-neutral model: a layer list applied to NHWC images; its output is the class logits."""

    layers: list[Layer] = Field(min_length=1)

    @field_validator("layers")
    @classmethod
    def _softmax_last(cls, layers: list[Any]) -> list[Any]:
        for i, layer in enumerate(layers[:-1]):
            if layer.type == "softmax":
                raise ValueError(f"softmax is allowed only as the last layer (found at index {i})")
        return layers
