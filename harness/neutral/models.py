"""The framework-neutral model: shape inference, parameter counts, FLOPs and seeded initial weights.

``analyze(model, input, num_classes)`` is the entry point; the pieces live beside it: ``info`` (ModelInfo,
LayerInfo, Input, ModelError, ``requirements``), ``shapes`` (each plain layer's rules), ``blocks`` (the residual
block), ``weights`` (initial weights and buffers), ``memory`` (the memory breakdown). Everything is re-exported here.

Activations are channel-first, (C, H, W) per sample, or (L, D) for sequences; weights are in PyTorch's layout (conv2d
OIHW, dense (out, in), attention's packed in_proj) under canonical names ("<layer>.weight", "<block>.<layer>.weight");
every adapter converts from this layout. FLOPs count 2 * M * N * K per matrix product; a training step is the forward
pass plus a backward pass of two products per forward product, less the input gradients nothing needs.

Design: docs/design/canonical-layout.md (every layer's conventions, the FLOPs rules and how they are tested).
"""

from __future__ import annotations

from harness.neutral.blocks import residual
from harness.neutral.info import (
    FEATURES,
    TASKS,
    Input,
    LayerInfo,
    ModelError,
    ModelInfo,
    Site,
    describe_feature,
    requirements,
)
from harness.neutral.shapes import attention_flops, layer_info
from harness.neutral.weights import (
    ORDER_FREE,
    chw_to_hwc_permutation,
    flatten_feeds_dense,
    initial_buffers,
    initial_weights,
    initialize,
)
from harness.spec import ModelSpec

__all__ = ["FEATURES", "ORDER_FREE", "Input", "LayerInfo", "ModelError", "ModelInfo", "TASKS", "analyze",
           "attention_flops", "chw_to_hwc_permutation", "describe_feature", "flatten_feeds_dense", "initial_buffers",
           "initial_weights", "initialize", "requirements"]


def analyze(model: ModelSpec, input: Input | tuple[int, ...], num_classes: int) -> ModelInfo:
    """Infers every layer's and block's shapes, parameters and FLOPs.

    input: an ``Input`` (``Input.images((H, W, C))``, ``Input.tokens(L, vocab, per_position)``; see
    ``harness.neutral.datasets.describe_input``), or one image's (height, width, channels) as a tuple.
    num_classes: the dataset's label count. The model's output must be (num_classes,), or (L, num_classes) for
    per-position targets (a next-token model). Raises ModelError naming the first layer (its path) that does not fit.
    """
    feed = input if isinstance(input, Input) else Input.images(tuple(input))
    shape = feed.model_shape
    vocab: int | None = feed.vocab if feed.kind == "tokens" else None
    if vocab is not None and model.layers[0].type != "embedding":
        raise ModelError(0, f"a model fed token sequences must start with an embedding layer, not "
                            f"{model.layers[0].type}")
    infos: list[LayerInfo] = []
    for i, layer in enumerate(model.layers):
        site = Site.top(i)
        infos.append(residual(site, layer, shape) if layer.type == "residual" else
                     layer_info(site, layer, shape, vocab))
        shape, vocab = infos[-1].output_shape, None
    last = len(model.layers) - 1
    if feed.per_position:
        (length,) = feed.shape
        if shape != (length, num_classes):
            raise ModelError(last, f"the model outputs {shape}, but the dataset's labels are the next token at each "
                                   f"of its {length} positions: it must output ({length}, {num_classes})")
    elif shape != (num_classes,):
        hint = "; pool the sequence first (sequence_pool)" if len(shape) == 2 and shape[-1] == num_classes else ""
        raise ModelError(last, f"the model outputs {shape} but the dataset has {num_classes} classes{hint}")
    return ModelInfo(feed.model_shape, num_classes, tuple(infos), feed)

