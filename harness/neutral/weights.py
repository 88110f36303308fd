"""Seeded canonical initial weights and buffers of an analysed model (see ``harness.neutral.models`` for the layouts).

Generators: every parameter is drawn from a generator of its own, seeded by (seed, its full name), so adding or
changing a layer elsewhere leaves it unchanged. The one exception keeps the draws of the models that existed before
blocks: a top-level conv2d or dense layer i draws its weight and then its bias from one generator seeded by
(seed, i), bit for bit as before (the equivalence tests' reference weights depend on it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from harness.neutral.info import LayerInfo, ModelInfo

#: GPT-2's initialisation of token and position embeddings: normal(0, 0.02).
EMBEDDING_STD = 0.02
_NAMED = 0x6E616D65  # the tag of generators seeded by a parameter's name ("name")


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 1:  # a bias: Keras's convention, fan_in = fan_out = its length
        return shape[0], shape[0]
    if len(shape) == 2:  # dense (out, in)
        return shape[1], shape[0]
    receptive = int(np.prod(shape[2:]))
    return shape[1] * receptive, shape[0] * receptive


def initialize(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """``shape`` float32 values of the initializer ``name`` (``harness.spec.Initializer``), drawn from ``rng``:
    Keras's definitions, with fans (in, out) = (in, out) of a dense (out, in) matrix, (C k k, O k k) of an OIHW
    kernel, (n, n) of a vector. Raises ValueError for an unknown name."""
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


def named_generator(seed: int, name: str) -> np.random.Generator:
    """The generator of the parameter ``name`` (e.g. "3.1.weight"): seeded by (seed, the first 8 bytes of the
    name's BLAKE2b digest), the same on every machine."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return np.random.default_rng([seed, _NAMED, int.from_bytes(digest[:4], "little"),
                                  int.from_bytes(digest[4:], "little")])


def _initializers(layer: LayerInfo) -> dict[str, str]:
    """Which initializer each parameter of ``layer`` draws with ("ones"/"zeros" for the norms' scale and shift,
    "embedding" for normal(0, EMBEDDING_STD))."""
    spec = layer.spec
    if layer.kind in ("batchnorm", "layernorm"):
        return {"weight": "ones", "bias": "zeros"}
    if layer.kind == "embedding":
        return {"token.weight": "embedding", "position.weight": "embedding"}
    if layer.kind == "attention":  # torch.nn.MultiheadAttention's: xavier_uniform_ in_proj, zero biases
        return {"in_proj.weight": "glorot_uniform", "in_proj.bias": "zeros", "out_proj.weight": "glorot_uniform",
                "out_proj.bias": "zeros"}
    return {"weight": spec.kernel_init, "bias": spec.bias_init}


def initial_weights(info: ModelInfo, seed: int) -> dict[str, np.ndarray]:
    """Draws the initial parameters once, in the canonical layout, from ``seed``.

    Returns a dict from every name of ``info.param_names()`` (in that order) to a float32 array: conv OIHW, dense
    (out, in), batchnorm and layernorm scale 1 and shift 0 (drawing nothing), embedding tables normal(0, 0.02)
    (GPT-2's), attention's in_proj (3D, D) glorot-uniform over fans (D, 3D) and out_proj (D, D) glorot-uniform
    with zero biases (torch.nn.MultiheadAttention's in_proj; its out_proj as a dense layer's default). Each
    parameter has its own generator (see the module docstring), so the same seed gives the same arrays on any
    machine and adding a layer does not change the others' weights. Buffers are not included (``initial_buffers``).
    """
    weights: dict[str, np.ndarray] = {}
    for layer in info.leaves():
        if not layer.params:
            continue
        inits = _initializers(layer)
        legacy = np.random.default_rng([seed, layer.index]) if layer.top_level and layer.kind in (
            "conv2d", "dense") else None
        for local, shape in layer.params.items():
            name, init = f"{layer.name}.{local}", inits[local]
            if init in ("ones", "zeros") and layer.kind in ("batchnorm", "layernorm"):
                weights[name] = np.full(shape, 1.0 if init == "ones" else 0.0, dtype=np.float32)
                continue
            rng = legacy if legacy is not None else named_generator(seed, name)
            if init == "embedding":
                weights[name] = (rng.standard_normal(size=shape) * EMBEDDING_STD).astype(np.float32)
            else:
                weights[name] = initialize(init, shape, rng)
    return weights


def initial_buffers(info: ModelInfo) -> dict[str, np.ndarray]:
    """The initial buffers, float32: every batchnorm's (a shortcut's too) ``"<name>.running_mean"`` (zeros) and
    ``"<name>.running_var"`` (ones), the frameworks' common starting point. Adapters start from these unless
    ``build`` is given others."""
    buffers: dict[str, np.ndarray] = {}
    for layer in info.leaves():
        for local, shape in layer.buffers.items():
            fill = 1.0 if local == "running_var" else 0.0
            buffers[f"{layer.name}.{local}"] = np.full(shape, fill, dtype=np.float32)
    return buffers


#: Layers between a flatten of (C, H, W) and the dense layer after it that let an NHWC framework flatten in its own
#: (H, W, C) order: elementwise, or per feature with their parameters permuted like the dense layer's rows (batchnorm).
ORDER_FREE = frozenset({"relu", "gelu", "dropout", "batchnorm"})


def flatten_feeds_dense(following: Sequence[LayerInfo]) -> bool:
    """Whether the layers after a flatten of (C, H, W) (``following``: the top-level layers after it) reach a dense
    layer through ``ORDER_FREE`` layers only: then an NHWC adapter (TensorFlow, Keras) may flatten in (H, W, C) order
    and permute that dense layer's rows (and those batchnorms' features, ``chw_to_hwc_permutation``); otherwise (a
    residual block, a layernorm, the model's output first) it transposes to channel-first before flattening."""
    for layer in following:
        if layer.kind == "dense":
            return True
        if layer.kind not in ORDER_FREE:
            return False
    return False


def chw_to_hwc_permutation(shape_chw: tuple[int, int, int]) -> np.ndarray:
    """Index map for a dense layer fed by a channel-last flatten.

    For an (H, W, C) tensor flattened in that order, feature j of the channel-last flatten is feature
    ``perm[j]`` of the canonical channel-first flatten, so ``kernel_hwc = weight[:, perm]`` (shape (out, in)).
    """
    c, h, w = shape_chw
    return np.arange(c * h * w).reshape(c, h, w).transpose(1, 2, 0).reshape(-1)
