"""The framework-neutral model: shape inference, parameter counts, FLOPs and seeded initial weights.

``analyze(model, input, num_classes)`` is the entry point; the pieces live beside it: ``info`` (ModelInfo,
LayerInfo, Input, ModelError, ``requirements``), ``shapes`` (each plain layer's rules), ``blocks`` (the residual
block), ``weights`` (initial weights and buffers), ``memory`` (the memory breakdown). Everything is re-exported here.

Canonical conventions, which every adapter converts from:

- activations are channel-first, (C, H, W) per sample; the datasets give NHWC images and adapters transpose or not.
  Sequences are (L, D) per sample (position, width), in every framework; token ids (L,) int64;
- conv2d weights are OIHW (out channels, in channels, kernel height, kernel width), biases (O,) (none with
  ``use_bias: false``). Integer padding p pads p zeros on every side (PyTorch's ``padding=p``);
- dense weights are (out, in), biases (out,); on a (L, D) sequence the same matrix acts on every position;
- ``flatten`` orders features channel-first: feature index = c * H * W + h * W + w. A framework that flattens an
  (H, W, C) tensor must permute the rows of the following dense layer's input dimension, not the data (and the
  features of a batchnorm between the two);
- batchnorm's trainable parameters are "<name>.weight" (gamma, (C,) or (F,), initially 1) and "<name>.bias" (beta,
  initially 0); its running mean and variance are buffers, not parameters: "<name>.running_mean" (initially 0) and
  "<name>.running_var" (initially 1), from ``initial_buffers``. ``initial_weights``, ``param_names`` and
  ``parameter_count`` cover the trainable parameters only. The momentum and variance conventions are PyTorch's (see
  ``harness.spec.BatchNorm``): the running variance is updated with the unbiased batch variance, the normalisation in
  training mode uses the biased one;
- layernorm: "<name>.weight" and "<name>.bias", (D,), over the last axis, biased variance (``torch.nn.LayerNorm``);
- embedding: "<name>.token.weight" (vocab, dim) and "<name>.position.weight" (L, dim); out[l] = token[ids[l]] +
  position[l];
- attention on (L, D) with h heads (``torch.nn.MultiheadAttention(D, h, bias=True, batch_first=True)``'s
  ``in_proj_weight``/``in_proj_bias``/``out_proj``): "<name>.in_proj.weight" (3D, D), rows 0..D-1 the query
  projection, D..2D-1 the key, 2D..3D-1 the value; "<name>.in_proj.bias" (3D,) likewise; "<name>.out_proj.weight"
  (D, D) and "<name>.out_proj.bias" (D,). q = x W_q^T + b_q (and k, v); head i takes columns i*D/h .. (i+1)*D/h - 1
  of q, k and v; its weights are softmax(q_i k_i^T / sqrt(D / h)) over the keys, with every key j > query position
  masked out (to -inf before the softmax) when causal; its output those weights times v_i; the heads' outputs are
  concatenated in head order to (L, D), then y = concat W_o^T + b_o. A framework with separate q/k/v projections
  takes the three row blocks of in_proj (Keras's (D, h, D/h) kernels: the block transposed and reshaped);
- residual block i: y = activation(body(x) + shortcut(x)); body layer j is named "<i>.<j>" ("<i>.<j>.weight", ...);
  a projection shortcut is a 1x1 conv "<i>.shortcut.weight" (no bias, stride ceil(H / H')) and a batchnorm
  "<i>.shortcut_bn.weight"/"bias" with buffers "<i>.shortcut_bn.running_mean"/"running_var";
- a top-level layer i keeps the names "<i>.weight"/"<i>.bias";
- dropout is inverted dropout (kept values scaled by 1 / (1 - rate) in training, the identity in inference). Its
  masks are random draws of each framework's own generator and cannot be made equal across frameworks, so the
  equivalence of the frameworks is proven for inference and for training without dropout;
- the loss is the mean softmax cross-entropy of the logits: over the samples for classification, and for a
  next-token model (tokens in, (L, vocab) out, labels (N, L)) over every position of every sequence; accuracy is
  the share of samples, or of positions, whose argmax is the label.

FLOPs follow the usual convention of counting 2 * M * N * K per matrix product (one multiply and one add per
multiply-accumulate) and the equivalent for a convolution (at its real output positions, so a stride-2 convolution
counts a quarter of a stride-1 one); attention counts its q/k/v projections 2·L·D·3D, its scores 2·L·L·D, its
weighted values 2·L·L·D and its output projection 2·L·D·D, a causal mask as the full L x L (dense kernels compute the
masked half too); embedding lookups, pooling (max, average, global average, sequence), batchnorm, layernorm,
dropout, activations, softmax, the residual addition and bias adds are not counted (elementwise, lookups or
reductions, O(1) per value). A training step is the forward pass plus the backward pass, which computes for every
product of the forward pass two of its size: the gradient with respect to the weights and the one with respect to
the input (Kaplan et al. 2020's and PaLM's 3 x forward), except the input gradients nothing needs: those of the
layers whose input depends on no parameter (the images, or what pooling and activations made of them: the first
conv2d or dense, or a residual block's first body layer and its projection; of attention, its q/k/v projection's;
``info.backward_flops``). This is what ``torch.utils.flop_counter
.FlopCounterMode`` counts for a PyTorch training step (tests/test_flops.py), with two deliberate differences: the
backward of attention's scores and weighted values is counted as its 4 products, not the fused kernels' 5 (flash
attention recomputes the scores: hardware FLOPs, not model FLOPs), and not left out where the counter has no
formula (PyTorch's CPU flash kernel, ``_scaled_dot_product_flash_attention_for_cpu``).
"""

from __future__ import annotations

from harness.neutral.blocks import residual
from harness.neutral.info import (FEATURES, TASKS, Input, LayerInfo, ModelError, ModelInfo, Site, describe_feature,
                                  requirements)
from harness.neutral.shapes import attention_flops, layer_info
from harness.neutral.weights import chw_to_hwc_permutation, initial_buffers, initial_weights, initialize
from harness.spec import ModelSpec

__all__ = ["FEATURES", "Input", "LayerInfo", "ModelError", "ModelInfo", "TASKS", "analyze", "attention_flops",
           "chw_to_hwc_permutation", "describe_feature", "initial_buffers", "initial_weights", "initialize",
           "requirements"]


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

