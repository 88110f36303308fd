"""The analysed model: what ``harness.neutral.models.analyze`` returns, and what each framework must build for it.

``Input`` says what a model is fed; ``LayerInfo`` is one layer or block with its shapes, parameters and FLOPs;
``ModelInfo`` the whole model; ``requirements`` the layer kinds, layer options and task an adapter needs to build it
(``harness.plan.support.unsupported`` compares them with what the adapter declares). Imports nothing of the harness.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: The tasks a model can have: what it is fed and which loss it trains with (see ``ModelInfo.task``).
TASKS = ("image_classification", "sequence_classification", "next_token")

#: How a support reason names each task, layer kind and layer option (``requirements``); a kind not listed reads
#: "<kind> layers".
FEATURES = {
    "image_classification": "image classification",
    "sequence_classification": "token inputs (sequence classification)",
    "next_token": "token inputs with a next-token loss",
    "residual": "residual blocks",
    "conv2d.stride": "conv2d with stride > 1",
    "conv2d.padding": "conv2d with an integer padding",
    "conv2d.no_bias": "conv2d without a bias (use_bias: false)",
    "dense.gelu": "dense with activation gelu",
    "dense.sequence": "dense on a (L, D) sequence",
    "attention.causal": "causal attention",
}


def describe_feature(feature: str) -> str:
    """The words for a task, layer kind or layer option of ``requirements``, e.g. "conv2d with stride > 1"."""
    return FEATURES.get(feature, f"{feature} layers")


class ModelError(ValueError):
    """A model that does not fit its input or its classes.

    ``path``: where, below ``model.layers``, in the spec's dotted field notation: ``"3"`` (top-level layer 3),
    ``"3.body.1"`` (the second layer of the body of residual block 3), ``"3.body"`` (the block's body as a whole),
    or None. ``layer``: the top-level index the path starts with (or None)."""

    def __init__(self, where: int | str | None, message: str):
        self.path = None if where is None else str(where)
        self.layer = None if self.path is None else int(self.path.split(".")[0])
        super().__init__(message)


@dataclass(frozen=True)
class Input:
    """What a model is fed, per sample.

    kind: ``images`` or ``tokens``. shape: images (H, W, C) as the datasets give them (NHWC batches); tokens (L,),
    int64 ids in [0, vocab). per_position: the targets are one class per position (a next-token task, labels
    (N, L)) instead of one per sample (labels (N,))."""

    kind: str
    shape: tuple[int, ...]
    vocab: int = 0
    per_position: bool = False

    @classmethod
    def images(cls, shape_hwc: tuple[int, ...]) -> Input:
        h, w, c = (int(x) for x in shape_hwc)
        return cls("images", (h, w, c))

    @classmethod
    def tokens(cls, length: int, vocab: int, per_position: bool = False) -> Input:
        return cls("tokens", (int(length),), int(vocab), per_position)

    @property
    def model_shape(self) -> tuple[int, ...]:
        """The first layer's input shape: (C, H, W) for images (channel-first, canonical), (L,) for tokens."""
        if self.kind == "images":
            h, w, c = self.shape
            return (c, h, w)
        return self.shape


@dataclass(frozen=True)
class Site:
    """Where a layer is: ``index`` the top-level position it is or belongs to, ``name`` its canonical parameter
    prefix ("3", "3.1", "3.shortcut"), ``path`` its spec path below ``model.layers`` ("3", "3.body.1")."""

    index: int
    name: str
    path: str

    @classmethod
    def top(cls, index: int) -> Site:
        return cls(index, str(index), str(index))

    def child(self, name: str, path: str) -> Site:
        return Site(self.index, f"{self.name}.{name}", f"{self.path}.{path}")


@dataclass(frozen=True)
class LayerInfo:
    """One layer or block with its inferred shapes (channel-first, per sample), its trainable parameter shapes
    (canonical) and its buffer shapes (batchnorm's running statistics: state, not trained).

    index: the top-level position in ``model.layers`` that this layer is, or belongs to (a residual body's layers
    and shortcut carry their block's index). params, buffers: local names -> shapes; the full names are
    ``"<name>.<local>"`` (``full_names``). forward_flops: FLOPs of one sample's forward pass; a block's is the sum of
    its children's. name: the canonical prefix ("3", "3.1", "3.shortcut", "3.shortcut_bn"). path: the spec path
    below ``model.layers`` ("3", "3.body.1", "3.shortcut"), for messages. body, shortcut: a residual block's
    analysed body layers and its projection (conv2d then batchnorm; empty for an identity shortcut)."""

    index: int
    spec: Any
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    forward_flops: int = 0
    buffers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    name: str = ""
    path: str = ""
    body: tuple[LayerInfo, ...] = ()
    shortcut: tuple[LayerInfo, ...] = ()

    def __post_init__(self) -> None:
        if not self.name:  # a top-level layer built positionally: its prefix and path are its index
            object.__setattr__(self, "name", str(self.index))
        if not self.path:
            object.__setattr__(self, "path", str(self.index))

    @property
    def kind(self) -> str:
        return self.spec.type

    @property
    def is_block(self) -> bool:
        return self.kind == "residual"

    @property
    def top_level(self) -> bool:
        return self.name == str(self.index)

    def full_names(self, local: dict[str, tuple[int, ...]]) -> list[str]:
        return [f"{self.name}.{key}" for key in local]

    def walk(self) -> Iterator[LayerInfo]:
        """This layer, then (for a block) its body layers and its shortcut layers, in that order."""
        yield self
        for child in (*self.body, *self.shortcut):
            yield from child.walk()


@dataclass(frozen=True)
class ModelInfo:
    """The analysed model. ``input_shape`` is the first layer's input, (C, H, W) for images or (L,) for tokens;
    ``input`` says what it is (``Input``); ``layers`` are the top-level layers and blocks, none excluded (a trailing
    softmax is kept and marked by ``softmax_output``; adapters fold it into the loss). ``num_classes``: the
    dataset's classes (the vocabulary for a next-token model)."""

    input_shape: tuple[int, ...]
    num_classes: int
    layers: tuple[LayerInfo, ...]
    input: Input | None = None

    def walk(self) -> Iterator[LayerInfo]:
        """Every layer and block, depth first: a block, then its body, then its shortcut."""
        for layer in self.layers:
            yield from layer.walk()

    def leaves(self) -> list[LayerInfo]:
        """Every layer that is not a block, in ``walk`` order: what holds the parameters and buffers."""
        return [layer for layer in self.walk() if not layer.is_block]

    @property
    def parameter_count(self) -> int:
        """Number of trainable scalars."""
        return int(sum(int(np.prod(shape)) for layer in self.leaves() for shape in layer.params.values()))

    @property
    def forward_flops_per_sample(self) -> int:
        """FLOPs of one sample's forward pass (2 * multiply-accumulates of convs and matmuls, attention's score and
        value products included; see ``harness.neutral.models``)."""
        return int(sum(layer.forward_flops for layer in self.layers))

    @property
    def backward_flops_per_sample(self) -> int:
        """FLOPs of one sample's backward pass: every layer's weight gradients, and its input gradient unless its input
        depends on no parameter (``backward_flops``; see ``harness.neutral.models``)."""
        return _backward(self.layers, False)[0]

    @property
    def train_flops_per_sample(self) -> int:
        """FLOPs of one sample's training step: forward plus backward (about 3 x forward; less by the input gradients
        nothing needs, those of the first layers with parameters)."""
        return self.forward_flops_per_sample + self.backward_flops_per_sample

    @property
    def softmax_output(self) -> bool:
        return bool(self.layers) and self.layers[-1].kind == "softmax"

    @property
    def task(self) -> str:
        """``image_classification`` (images -> (classes,)), ``sequence_classification`` (tokens -> (classes,)) or
        ``next_token`` (tokens -> (L, vocab): the loss is the mean softmax cross-entropy over every position of every
        sequence, the accuracy the share of positions whose next token is predicted right)."""
        if self.input is None or self.input.kind == "images":
            return "image_classification"
        return "next_token" if self.input.per_position else "sequence_classification"

    def param_names(self) -> list[str]:
        """Names of all parameters in a stable order (``walk`` order, then each layer's own order): ``"<i>.weight"``,
        ``"<i>.bias"`` for a top-level layer i, ``"<i>.<j>.weight"`` for body layer j of block i, and so on (see
        ``harness.neutral.models`` for every kind's names)."""
        return [name for layer in self.leaves() for name in layer.full_names(layer.params)]

    def buffer_names(self) -> list[str]:
        """Names of all buffers in a stable order: ``"<name>.running_mean"``, ``"<name>.running_var"``."""
        return [name for layer in self.leaves() for name in layer.full_names(layer.buffers)]


def input_gradient_flops(layer: LayerInfo) -> int:
    """One sample's FLOPs of the gradient with respect to ``layer``'s input, which the backward pass skips when that
    input depends on no parameter: a conv2d's or dense's forward FLOPs (the transposed product); attention's q/k/v
    projection's, 2·L·D·3D for (L, D) (the gradients through its scores and output projection also feed its weight
    gradients); 0 for every other kind (elementwise, lookups, reductions: not counted)."""
    if layer.kind in ("conv2d", "dense"):
        return layer.forward_flops
    if layer.kind == "attention":
        length, width = layer.input_shape
        return 2 * length * width * 3 * width
    return 0


def backward_flops(layer: LayerInfo, input_gradient: bool) -> int:
    """One sample's backward FLOPs of a plain layer (not a block): 2 x its forward FLOPs (the weight gradients and the
    input gradient, each a product of the forward's size; attention's score and value products likewise, 4 products
    for its 2), less ``input_gradient_flops`` when ``input_gradient`` is False (nothing upstream needs it)."""
    return 2 * layer.forward_flops - (0 if input_gradient else input_gradient_flops(layer))


def _backward(layers: tuple[LayerInfo, ...], needs_gradient: bool) -> tuple[int, bool]:
    """(backward FLOPs of ``layers`` run in sequence, whether their output depends on a parameter) for an input that
    does (``needs_gradient``) or does not: the model's input (images, token ids) does not, and neither does what
    layers without parameters (pooling, relu, flatten, ...) make of it. A block's body and shortcut both see its
    input; its output depends on a parameter if either side's does."""
    total = 0
    for layer in layers:
        if layer.is_block:
            body, body_depends = _backward(layer.body, needs_gradient)
            shortcut, shortcut_depends = _backward(layer.shortcut, needs_gradient)
            total, needs_gradient = total + body + shortcut, body_depends or shortcut_depends
        else:
            total += backward_flops(layer, needs_gradient)
            needs_gradient = needs_gradient or bool(layer.params)
    return total, needs_gradient


def _options(layer: LayerInfo) -> list[str]:
    """The options of a layer that an adapter may lack although it builds the kind (``requirements``)."""
    spec, out = layer.spec, []
    if layer.kind == "conv2d":
        out += ["stride"] if spec.stride > 1 else []
        out += ["padding"] if isinstance(spec.padding, int) else []
        out += [] if spec.use_bias else ["no_bias"]
    elif layer.kind == "dense":
        out += ["gelu"] if spec.activation == "gelu" else []
        out += ["sequence"] if len(layer.input_shape) == 2 else []
    elif layer.kind == "attention" and spec.causal:
        out.append("causal")
    return [f"{layer.kind}.{option}" for option in out]


def requirements(info: ModelInfo) -> list[tuple[str, str]]:
    """What an adapter must support to train ``info``, as (feature, where) pairs in model order: first the task
    (one of ``TASKS``, where "the dataset"), then for every layer, block and shortcut layer (``walk``) its kind
    ("conv2d", "residual", ...) and its options ("conv2d.stride", "conv2d.padding", "conv2d.no_bias",
    "dense.gelu", "dense.sequence", "attention.causal"), where "model.layers.<path>"."""
    out = [(info.task, "the dataset")]
    for layer in info.walk():
        where = f"model.layers.{layer.path}"
        out += [(layer.kind, where)] + [(option, where) for option in _options(layer)]
    return out
