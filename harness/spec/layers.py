"""The framework-neutral model of a spec: its layers, blocks and ``ModelSpec``. Imports only ``harness.spec.base``.

Shapes are per sample and channel-first: images (C, H, W), flat features (F,), token ids (L,) and sequences (L, D)
(position, width). The shape rules, parameters and FLOPs of each layer are ``harness.neutral.models``'s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from harness.spec.base import _Strict

Initializer = Literal["he_uniform", "he_normal", "glorot_uniform", "glorot_normal", "zeros"]
Activation = Literal["relu", "none"]
DenseActivation = Literal["relu", "gelu", "none"]


class Conv2D(_Strict):
    """2-D convolution of a (C, H, W) input. Weights in the canonical layout OIHW, bias (O,) unless ``use_bias`` is
    false (then the layer has no "<name>.bias" parameter: a convolution followed by batchnorm needs none).

    ``stride``: the step of the kernel in height and width. ``padding``: ``valid`` (none), ``same`` (output the size
    of the input; odd kernels and stride 1 only), or an integer p >= 0: p zero rows and columns on each side
    (PyTorch's ``padding=p``; the output is floor((H + 2p - k) / stride) + 1). ``same`` with a stride above 1 is an
    error: TensorFlow's ``same`` pads a strided convolution asymmetrically (more at the bottom and right), so it is
    not one computation in every framework; give the integer padding instead (k // 2 for an odd kernel k).
    """

    type: Literal["conv2d"]
    filters: int = Field(gt=0)
    kernel_size: int = Field(gt=0)
    stride: int = Field(default=1, gt=0)
    padding: Literal["same", "valid"] | int = "valid"
    use_bias: bool = True
    activation: Activation = "none"
    kernel_init: Initializer = "glorot_uniform"
    bias_init: Initializer = "zeros"

    @field_validator("padding", mode="before")
    @classmethod
    def _padding(cls, padding: Any) -> Any:
        if isinstance(padding, bool) or not (padding in ("same", "valid") or (isinstance(padding, int)
                                                                               and padding >= 0)):
            raise ValueError(f"must be 'same', 'valid' or a non-negative integer (zeros on each side), "
                             f"not {padding!r}")
        return padding

    @model_validator(mode="after")
    def _same_needs_stride_1(self) -> Conv2D:
        if self.padding == "same" and self.stride != 1:
            raise ValueError(f"padding 'same' needs stride 1 (frameworks pad a strided 'same' convolution "
                             f"differently); give an integer padding instead, e.g. padding: {self.kernel_size // 2}")
        return self


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


class LayerNorm(_Strict):
    """Layer normalisation over the last axis: the F features of a flat (F,) input, or the D values of each position
    of a (L, D) sequence: y = (x - mean) / sqrt(var + epsilon) * weight + bias, with the biased variance over that
    axis, in training and inference alike (``torch.nn.LayerNorm(D, eps)``). "weight" (D,) starts at 1, "bias" (D,)
    at 0. No running statistics."""

    type: Literal["layernorm"]
    epsilon: float = Field(default=1e-5, gt=0)


class Dropout(_Strict):
    """Inverted dropout: in training mode each value is zeroed with probability ``rate`` and the others are scaled by
    1 / (1 - rate); in inference mode the identity. The masks are each framework's own random draws."""

    type: Literal["dropout"]
    rate: float = Field(ge=0, lt=1)


class Flatten(_Strict):
    """Flattens (C, H, W) in channel-first order, whatever layout a framework computes in; a (L, D) sequence in
    position-major order (feature l * D + d)."""

    type: Literal["flatten"]


class Dense(_Strict):
    """Fully connected layer. Weights in the canonical layout (out, in), bias (out,). On a flat (F,) input:
    (F,) -> (units,); on a (L, D) sequence it acts on every position alike: (L, D) -> (L, units). ``activation:
    gelu`` is the exact GELU (see ``GELU``)."""

    type: Literal["dense"]
    units: int = Field(gt=0)
    activation: DenseActivation = "none"
    kernel_init: Initializer = "glorot_uniform"
    bias_init: Initializer = "zeros"


class ReLU(_Strict):
    type: Literal["relu"]


class GELU(_Strict):
    """The exact GELU, x * Phi(x) = x / 2 * (1 + erf(x / sqrt(2))) (``torch.nn.GELU()``, ``approximate="none"``;
    Keras's ``gelu(approximate=False)``, ``jax.nn.gelu(approximate=False)``), never the tanh approximation."""

    type: Literal["gelu"]


class Embedding(_Strict):
    """Token embedding plus learned position embedding: token ids (L,) -> (L, dim), out[l] = token[ids[l]] +
    position[l]. "token.weight" is (vocab, dim), "position.weight" (L, dim) with L the input's length; both start
    as normal(0, 0.02) draws (GPT-2's). It must be the first layer of a model fed token sequences, and ``vocab`` at
    least the dataset's vocabulary."""

    type: Literal["embedding"]
    vocab: int = Field(gt=0)
    dim: int = Field(gt=0)


class Attention(_Strict):
    """Multi-head self-attention on a (L, D) sequence -> (L, D), in ``torch.nn.MultiheadAttention``'s arithmetic and
    canonical layout (see ``harness.neutral.models``): q, k, v = x W_q^T + b_q, ...; each of ``heads`` heads takes
    D / heads consecutive columns; softmax(q_h k_h^T / sqrt(D / heads)) v_h; heads concatenated in order; output
    projection. ``causal``: position i attends to positions j <= i only. No dropout inside. D must be divisible by
    ``heads`` (checked against the input's width)."""

    type: Literal["attention"]
    heads: int = Field(gt=0)
    causal: bool = False


class SequencePool(_Strict):
    """A sequence-classification head's pooling: (L, D) -> (D,), the mean over positions (``mean``) or the last
    position (``last``, for a causal model, whose last position has seen the whole sequence)."""

    type: Literal["sequence_pool"]
    mode: Literal["mean", "last"] = "mean"


class Softmax(_Strict):
    """Allowed only as the last layer; it is folded into the softmax cross-entropy loss on the logits."""

    type: Literal["softmax"]


PlainLayer = Annotated[(Conv2D | MaxPool2D | AvgPool2D | GlobalAvgPool2D | BatchNorm | LayerNorm | Dropout | Flatten
                        | Dense | ReLU | GELU | Embedding | Attention | SequencePool | Softmax),
                       Field(discriminator="type")]


class Residual(_Strict):
    """A residual block: y = activation(body(x) + shortcut(x)).

    ``body``: plain layers (no block inside a block). ``shortcut``: ``identity`` (x itself: the body must keep the
    shape) or ``auto``: x itself when the body keeps the shape, else a projection of (C, H, W) to the body's
    (C', H', W'): a 1x1 convolution without bias, stride s = ceil(H / H') (which must give H' and W' exactly), no
    padding, initialised by ``shortcut_init``, then a batchnorm (momentum 0.1, epsilon 1e-5), as in ResNet's
    option B. ``activation``: applied after the addition (``relu`` in ResNet's basic block, ``none`` in a pre-norm
    transformer block).
    """

    type: Literal["residual"]
    body: list[PlainLayer] = Field(min_length=1)
    shortcut: Literal["auto", "identity"] = "auto"
    activation: Activation = "none"
    shortcut_init: Initializer = "glorot_uniform"

    @field_validator("body")
    @classmethod
    def _no_softmax_inside(cls, body: list[Any]) -> list[Any]:
        for j, layer in enumerate(body):
            if layer.type in ("softmax", "embedding"):
                raise ValueError(f"{layer.type} is not allowed in a residual body (found at body index {j})")
        return body


Layer = Annotated[(Conv2D | MaxPool2D | AvgPool2D | GlobalAvgPool2D | BatchNorm | LayerNorm | Dropout | Flatten | Dense
                   | ReLU | GELU | Embedding | Attention | SequencePool | Softmax | Residual),
                  Field(discriminator="type")]


class ModelSpec(_Strict):
    """A framework-neutral model: a list of layers and blocks applied to NHWC images or to token sequences; its
    output is the class logits, (classes,), or for a next-token model one row of logits per position, (L, vocab)."""

    layers: list[Layer] = Field(min_length=1)

    @field_validator("layers")
    @classmethod
    def _softmax_last(cls, layers: list[Any]) -> list[Any]:
        for i, layer in enumerate(layers[:-1]):
            if layer.type == "softmax":
                raise ValueError(f"softmax is allowed only as the last layer (found at index {i})")
        return layers
