"""The memory of a training step by data structure, predicted from the neutral model (bytes).

``predict(info, batch_size, optimizer, attention=...)`` splits what a training step holds into parameters, gradients,
optimizer state, buffers, a gradient accumulator, and the activations saved for the backward pass, per sample and for
the batch (``MemoryBreakdown``); ``saved_tensors`` lists those activations layer by layer (``SavedTensor``). It is a
model of what the frameworks keep, not a measurement: a measured peak is above it.

Design: docs/design/max-batch.md#the-neutral-memory-model (what each layer kind keeps, what the model leaves out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.neutral.info import LayerInfo, ModelInfo

INDEX_BYTES = 8  # int64 token ids, labels and argmax indices
LOGSUMEXP_BYTES = 4  # a fused attention kernel's log-sum-exp value: float32 whatever the compute dtype
#: What attention keeps for its backward pass (docs/design/max-batch.md#the-neutral-memory-model): the
#: probabilities, or a log-sum-exp.
ATTENTIONS = ("unfused", "fused")
#: The parts of ``MemoryBreakdown`` that add up to its total, in the order a report lists them.
PARTS = ("parameters", "gradients", "optimizer_state", "buffers", "accumulator", "activations")
MASK_BYTES = 1  # a dropout mask value


@dataclass(frozen=True)
class SavedTensor:
    """One tensor kept for the backward pass: ``layer`` its canonical name ("input" for the model's input, "loss"),
    ``what`` it is, ``bytes_per_sample``."""

    layer: str
    what: str
    bytes_per_sample: int


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted bytes of one training step by data structure (docs/design/max-batch.md#the-neutral-memory-model).

    batch_size: samples per forward and backward pass (the spec's batch size, one micro-batch). parameters,
    gradients, optimizer_state, buffers (batchnorm's running statistics), accumulator: bytes, independent of the
    batch size. activations_per_sample: bytes saved for the backward pass per sample (the sum of ``saved``);
    activations: for the batch. total: the sum of the parts. attention: the implementation assumed (``ATTENTIONS``)."""

    batch_size: int
    accumulation_steps: int
    dtype_bytes: int
    parameters: int
    gradients: int
    optimizer_state: int
    buffers: int
    accumulator: int
    activations_per_sample: int
    activations: int
    saved: tuple[SavedTensor, ...] = field(default=(), repr=False)
    attention: str = "unfused"

    @property
    def fixed(self) -> int:
        """Bytes that do not depend on the batch size."""
        return self.parameters + self.gradients + self.optimizer_state + self.buffers + self.accumulator

    @property
    def total(self) -> int:
        return self.fixed + self.activations


def predict(info: ModelInfo, batch_size: int, optimizer: Any, accumulation_steps: int = 1,
            dtype_bytes: int = 4, attention: str = "unfused") -> MemoryBreakdown:
    """The memory breakdown of a training step of ``batch_size`` samples per pass. Parameters, gradients and
    buffers take ``dtype_bytes`` per value; optimizer state is one momentum buffer per parameter for SGD with
    momentum > 0, none without, two for Adam; the accumulator (k > 1 only) one value per parameter, what the
    TensorFlow and JAX adapters keep (PyTorch and MXNet add into the gradients in place).

    optimizer: a ``harness.spec.OptimizerSpec`` (its ``name`` and ``momentum``). accumulation_steps: micro-batches
    per optimizer step (the effective batch is accumulation_steps x batch_size). dtype_bytes: bytes of a float
    value. attention: what the framework's attention keeps, one of ``ATTENTIONS`` (the adapter's declared
    ``Capabilities.attention``, read by ``adapters.attention``). Raises ValueError for a batch size or accumulation
    below 1 or an unknown attention."""
    if batch_size < 1 or accumulation_steps < 1:
        raise ValueError(f"batch_size {batch_size} and accumulation_steps {accumulation_steps} must be at least 1")
    count = info.parameter_count
    params = count * dtype_bytes
    buffers = sum(_elements(shape) for layer in info.leaves() for shape in layer.buffers.values()) * dtype_bytes
    if optimizer.name == "adam":
        state = 2 * params
    else:
        state = params if getattr(optimizer, "momentum", 0.0) > 0 else 0
    saved = saved_tensors(info, dtype_bytes, attention)
    per_sample = sum(t.bytes_per_sample for t in saved)
    return MemoryBreakdown(batch_size, accumulation_steps, dtype_bytes, params, params, state, buffers,
                           params if accumulation_steps > 1 else 0, per_sample, per_sample * batch_size, saved,
                           attention)


def saved_tensors(info: ModelInfo, dtype_bytes: int = 4, attention: str = "unfused") -> tuple[SavedTensor, ...]:
    """Every tensor kept for the backward pass, once each, in the order the forward pass makes them (what each layer
    kind keeps: the table of docs/design/max-batch.md#the-neutral-memory-model), with ``attention`` (one of
    ``ATTENTIONS``) saying what attention keeps. Raises ValueError for another attention."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention {attention!r} is not one of {', '.join(ATTENTIONS)}")
    walker = _Walker(dtype_bytes, attention)
    first = info.input_shape
    item = INDEX_BYTES if info.input is not None and info.input.kind == "tokens" else dtype_bytes
    walker.sizes["input"] = (_elements(first), item)
    current = "input"
    for layer in info.layers:
        current = walker.visit(layer, current)
    logits = info.layers[-1].output_shape
    walker.keep("loss:log_softmax", "log-softmax of the logits", _elements(logits), dtype_bytes)
    walker.keep("loss:labels", "labels (int64)", logits[0] if len(logits) == 2 else 1, INDEX_BYTES)
    return tuple(walker.saved.values())


def _elements(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= int(n)
    return out


class _Walker:
    """Follows the forward pass, naming each tensor it makes, and records what each layer keeps (once per tensor)."""

    def __init__(self, dtype_bytes: int, attention: str = "unfused"):
        self.item, self.attention = dtype_bytes, attention
        self.sizes: dict[str, tuple[int, int]] = {}  # tensor -> (elements per sample, bytes per element)
        self.saved: dict[str, SavedTensor] = {}

    def keep(self, tensor: str, what: str, elements: int | None = None, item: int | None = None,
             layer: str | None = None) -> None:
        if tensor in self.saved:
            return
        known = self.sizes.get(tensor, (0, self.item))
        count, size = (known[0] if elements is None else elements), (known[1] if item is None else item)
        self.saved[tensor] = SavedTensor(layer or tensor.split(":")[0], what, count * size)

    def make(self, name: str, suffix: str, shape: tuple[int, ...]) -> str:
        tensor = f"{name}:{suffix}"
        self.sizes[tensor] = (_elements(shape), self.item)
        return tensor

    def visit(self, layer: LayerInfo, x: str) -> str:
        """Records what ``layer`` keeps of its input ``x`` and of what it makes; returns its output tensor."""
        if layer.is_block:
            return self._residual(layer, x)
        kind, name, out_shape = layer.kind, layer.name, layer.output_shape
        if kind in ("flatten", "softmax"):
            return x  # a view; softmax is folded into the loss
        if kind in ("conv2d", "dense"):
            self.keep(x, "input", layer=name)
            out = self.make(name, "output", out_shape)
            activation = layer.spec.activation
            if activation == "gelu":
                self.keep(out, "pre-activation (gelu's input)")
                return self.make(name, "gelu", out_shape)
            if activation == "relu":
                out = self.make(name, "relu", out_shape)
                self.keep(out, "relu output")
            return out
        return self._other(layer, x)

    def _other(self, layer: LayerInfo, x: str) -> str:
        kind, name, shape, out_shape = layer.kind, layer.name, layer.input_shape, layer.output_shape
        if kind in ("batchnorm", "layernorm", "gelu", "maxpool2d", "attention", "embedding"):
            self.keep(x, "token ids" if kind == "embedding" else "input", layer=name)
        if kind == "layernorm":
            rows = shape[0] if len(shape) == 2 else 1
            self.keep(f"{name}:stats", "mean and inverse std per row", 2 * rows)
        elif kind == "maxpool2d":
            self.keep(f"{name}:argmax", "argmax indices (int64)", _elements(out_shape), INDEX_BYTES)
        elif kind == "dropout":
            self.keep(f"{name}:mask", "mask (1 byte per value)", _elements(shape), MASK_BYTES)
        elif kind == "attention":
            length, width = shape
            self.keep(f"{name}:qkv", "q, k and v", 3 * length * width)
            if self.attention == "fused":
                self.keep(f"{name}:logsumexp", "log-sum-exp per head and query (float32)", layer.spec.heads * length,
                          LOGSUMEXP_BYTES)
            else:
                self.keep(f"{name}:probabilities", "softmax probabilities", layer.spec.heads * length * length)
            self.keep(f"{name}:context", "context (the output projection's input)", length * width)
        out = self.make(name, "output", out_shape)
        if kind == "relu":
            self.keep(out, "output")
        return out

    def _residual(self, block: LayerInfo, x: str) -> str:
        y = x
        for layer in block.body:
            y = self.visit(layer, y)
        s = x
        for layer in block.shortcut:
            s = self.visit(layer, s)
        out = self.make(block.name, "sum", block.output_shape)
        if block.spec.activation == "relu":
            out = self.make(block.name, "relu", block.output_shape)
            self.keep(out, "relu output (after the addition)")
        return out
