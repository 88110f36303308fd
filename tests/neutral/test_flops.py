"""Training FLOPs and saved activations of the neutral model against counters nobody on the project wrote:
``torch.utils.flop_counter.FlopCounterMode`` over a PyTorch training step (forward and backward) and
``torch.autograd.graph.saved_tensors_hooks`` over its forward pass, on the PyTorch adapter's own model."""

from __future__ import annotations

import pytest
import yaml

from harness.neutral import datasets, memory, models
from harness.spec import ROOT, ModelSpec, validate

torch = pytest.importorskip("torch")
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from adapters.pytorch.adapter import PyTorchAdapter  # noqa: E402
from adapters.pytorch.training import Training  # noqa: E402

BATCH = 2


def spec_model(name: str) -> models.ModelInfo:
    """The analysed model of ``specs/<name>.yaml`` (its dataset described, not loaded)."""
    spec = validate(yaml.safe_load((ROOT / "specs" / f"{name}.yaml").read_text()), f"{name}.yaml")
    return models.analyze(spec.model, *datasets.describe_input(spec.dataset))


def built(info: models.ModelInfo) -> tuple[Training, torch.Tensor, torch.Tensor]:
    """The PyTorch adapter's training mechanics of the model of ``info`` in training mode, and a batch of BATCH inputs
    and labels."""
    torch.manual_seed(0)
    adapter = PyTorchAdapter()
    adapter.build_neutral(info, models.initial_weights(info, 0), _sgd())
    training = adapter.training
    feed = info.input
    if feed.kind == "tokens":
        x = torch.randint(0, feed.vocab, (BATCH, *feed.shape))
        y = torch.randint(0, info.num_classes, (BATCH, feed.shape[0]) if feed.per_position else (BATCH,))
    else:
        h, w, c = feed.shape
        x, y = torch.randn(BATCH, c, h, w), torch.randint(0, info.num_classes, (BATCH,))
    return training, x, y


def _sgd():
    from harness.spec import OptimizerSpec

    return OptimizerSpec(name="sgd", learning_rate=0.1, momentum=0.9)


def counted_flops(info: models.ModelInfo, math_attention: bool = False) -> float:
    """FlopCounterMode's FLOPs per sample of one forward and backward pass of the adapter's model (with
    ``math_attention`` attention runs PyTorch's unfused math path, whose products the counter sees)."""
    adapter, x, y = built(info)
    counter = FlopCounterMode(display=False)
    with counter, (sdpa_kernel(SDPBackend.MATH) if math_attention else _nothing()):
        adapter.loss(adapter.model(x), y).backward()
    return counter.get_total_flops() / BATCH


def saved_bytes(info: models.ModelInfo, math_attention: bool = False) -> float:
    """Bytes per sample that autograd keeps for the backward pass of the adapter's model (each storage once, the
    parameters and buffers not counted), through saved_tensors_hooks."""
    adapter, x, y = built(info)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            (sdpa_kernel(SDPBackend.MATH) if math_attention else _nothing()):
        adapter.loss(adapter.model(x), y)
    held = {p.untyped_storage().data_ptr() for p in (*adapter.net.parameters(), *adapter.net.buffers())}
    return sum(n for ptr, n in storages.items() if ptr not in held) / BATCH


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def attention_core_flops(info: models.ModelInfo) -> int:
    """Forward FLOPs of every attention layer's score and weighted-value products (4·L·L·D each)."""
    return sum(4 * layer.input_shape[0] ** 2 * layer.input_shape[1] for layer in info.walk()
               if layer.kind == "attention")


@pytest.mark.parametrize("name", ["cnn", "resnet_small", "resnet18"])
def test_image_models_count_what_flop_counter_mode_counts(name):
    info = spec_model(name)
    assert info.train_flops_per_sample == counted_flops(info)
    # below 3 x forward by the first convolution's input gradient, which nothing needs
    first = next(layer for layer in info.leaves() if layer.params)
    assert info.train_flops_per_sample == 3 * info.forward_flops_per_sample - first.forward_flops


def test_a_transformer_counts_what_flop_counter_mode_counts():
    info = spec_model("transformer_small")
    # PyTorch's unfused math attention: every product is a bmm the counter sees, forward and backward
    assert info.train_flops_per_sample == counted_flops(info, math_attention=True)
    # the fused CPU kernel (_scaled_dot_product_flash_attention_for_cpu) has no formula in the counter: it misses
    # the scores and weighted values, forward (4·L·L·D) and backward (twice that), which the harness counts
    assert info.train_flops_per_sample == counted_flops(info) + 3 * attention_core_flops(info)
    # an embedding starts the model: every matrix product's input depends on a parameter, so 3 x forward exactly
    assert info.train_flops_per_sample == 3 * info.forward_flops_per_sample


@pytest.mark.parametrize("layers", [
    # layers without parameters before the first convolution: its input still needs no gradient
    [{"type": "maxpool2d", "pool_size": 2}, {"type": "relu"},
     {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": 1}, {"type": "flatten"},
     {"type": "dense", "units": 10}],
    # a batchnorm first: its gamma and beta make the convolution's input need a gradient
    [{"type": "batchnorm"}, {"type": "conv2d", "filters": 4, "kernel_size": 3}, {"type": "flatten"},
     {"type": "dense", "units": 10}],
    # a block first: its body's first convolution and its projection both see the raw images
    [{"type": "residual", "activation": "relu", "body": [
        {"type": "conv2d", "filters": 4, "kernel_size": 3, "stride": 2, "padding": 1, "use_bias": False},
        {"type": "batchnorm"}, {"type": "relu"}, {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": 1}]},
     {"type": "global_avgpool2d"}, {"type": "dense", "units": 10}],
    # an identity block first, then a dense layer on the flattened images
    [{"type": "residual", "body": [{"type": "relu"}]}, {"type": "flatten"}, {"type": "dense", "units": 10}],
])
def test_which_input_gradients_are_skipped(layers):
    info = models.analyze(ModelSpec.model_validate({"layers": layers}), (8, 8, 3), 10)
    assert info.train_flops_per_sample == counted_flops(info)


@pytest.mark.parametrize("name", ["cnn", "resnet_small"])
def test_saved_activations_of_image_models(name):
    info = spec_model(name)
    attention = PyTorchAdapter.declaration.capabilities.attention
    predicted = memory.predict(info, BATCH, _sgd(), attention=attention).activations_per_sample
    assert saved_bytes(info) == pytest.approx(predicted, rel=0.005)


def test_saved_activations_of_attention_follow_the_declared_implementation():
    """PyTorch's own attention (declared fused: a log-sum-exp, not the probabilities) and its math path (unfused:
    the probabilities), each against the prediction for that implementation."""
    info = spec_model("transformer_small")
    fused = memory.predict(info, BATCH, _sgd(), attention="fused").activations_per_sample
    unfused = memory.predict(info, BATCH, _sgd(), attention="unfused").activations_per_sample
    assert PyTorchAdapter.declaration.capabilities.attention == "fused"
    assert saved_bytes(info) == pytest.approx(fused, rel=0.005)
    assert unfused > 1.1 * fused  # the probabilities, heads x L x L per layer, are what tells them apart
    # the math path also keeps q and k scaled by sqrt(1 / sqrt(D / heads)) each, copies beside the projection's output
    scaled_copies = sum(2 * layer.input_shape[0] * layer.input_shape[1] * 4 for layer in info.walk()
                        if layer.kind == "attention")
    assert saved_bytes(info, math_attention=True) == pytest.approx(unfused + scaled_copies, rel=0.005)
