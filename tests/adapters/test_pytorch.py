"""PyTorch adapter: the conformance suite (tests/adapters/conformance.py), and what is PyTorch's own: OOM
classification and the GPU memory cap."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from adapters.pytorch.adapter import PyTorchAdapter
from tests.adapters import kit
from tests.adapters.conformance import *  # noqa: F403 (the conformance tests, collected here)
from tests.helpers import run_options


@pytest.fixture(scope="module")
def adapter_cls():
    return PyTorchAdapter


def test_resident_batches_are_rows_of_one_index_table_made_when_asked_for():
    """Resident mode's ``batches`` copies the epoch's step indices to the device at once, when it is called (before
    the epoch's first step; on CUDA one pinned, non-blocking copy instead of one pageable copy per step): int64 rows
    on the adapter's device, whole steps only, unchanged by a later change of the order; and they train."""
    adapter, data, _ = kit.make(PyTorchAdapter)
    order = np.random.default_rng(0).permutation(len(data.y_train))[:100]
    given = order.copy()
    batches = adapter.batches(order, 32, 0)
    order[:] = 0
    made = list(batches)
    assert [(b.dtype, b.device, tuple(b.shape)) for b in made] == [(torch.int64, adapter.device, (32,))] * 3
    np.testing.assert_array_equal(torch.cat(made).numpy(), given[:96])
    for batch in made:
        adapter.train_step(batch)
    mean, steps = adapter.read_loss()
    assert steps == 3 and np.isfinite(mean)


def test_oom_is_classified_by_exception_type():
    adapter = PyTorchAdapter()
    assert adapter.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert adapter.is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert not adapter.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not adapter.is_oom(ValueError("out of memory"))  # a message alone does not make an OOM


def test_real_cpu_allocation_failure_is_oom():
    # 4 PiB: the CPU allocator refuses it
    kit.check_allocation_failure_is_oom(PyTorchAdapter(), lambda: torch.empty(2**50, dtype=torch.float32), "4 PiB")


def test_memory_limit_on_a_gpu_is_a_per_process_fraction(monkeypatch):
    """No GPU here: the CUDA calls are replaced, to check what the adapter asks of them
    (torch.cuda.set_per_process_memory_fraction(limit / total_memory, device)) and what it records."""
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: calls.append((fraction, device)))
    adapter = PyTorchAdapter(run_options({"memory_limit_bytes": 20 * 2**30}))
    adapter._apply_memory_limit(1)
    assert calls == [(0.25, 1)] and isinstance(calls[0][0], float)  # the call insists on a float
    adapter.device = torch.device("cuda:1")  # what prepare sets; settings() reads no CUDA state
    settings = adapter.settings().record()
    assert settings["memory_limit_bytes"] == 20 * 2**30 and settings["memory_fraction"] == 0.25
    assert settings["device_total_memory_bytes"] == 80 * 2**30

    calls.clear()
    above = PyTorchAdapter(run_options({"memory_limit_bytes": 100 * 2**30}))  # more than the device: a fraction of 1
    above._apply_memory_limit(0)
    assert calls == [(1.0, 0)]

    calls.clear()
    unlimited = PyTorchAdapter(run_options({"tensorflow_memory_growth": True, "memory_limit_bytes": None}))
    unlimited._apply_memory_limit(0)
    unlimited.device = torch.device("cuda:0")
    assert calls == [] and unlimited.settings().record()["memory_limit_bytes"] is None


# -- a model of your own ---------------------------------------------------------------------------------------------

def _native(seed=0, options=None, **kwargs):
    """PyTorchAdapter with specs/models.py's torch_cnn adopted and built on digits (prepare seeded torch first)."""
    import importlib.util

    from harness.neutral import datasets
    from harness.neutral.native import NativeSource
    from harness.spec import ROOT

    module = importlib.util.spec_from_file_location("spec_models", ROOT / "specs" / "models.py")
    models_py = importlib.util.module_from_spec(module)
    module.loader.exec_module(models_py)
    data = datasets.load(datasets.DigitsData(name="digits"))
    feed, classes = datasets.describe_input(datasets.DigitsData(name="digits"))
    adapter = PyTorchAdapter(options)
    adapter.prepare("cpu", 2, seed)
    made = models_py.torch_cnn(**kwargs)
    adapter.build(adapter.native_model(made, NativeSource("models.py:torch_cnn", feed, classes, seed)),
                  "image_classification", kit.SGD)
    adapter.load(data)
    return adapter, data


def test_a_module_of_your_own_learns_and_its_weights_follow_the_seed():
    adapter, data = _native()
    loss0, acc0 = adapter.evaluate(256)
    kit.train_epochs(adapter, data, epochs=2, batch_size=32)
    loss1, acc1 = adapter.evaluate(256)
    assert loss1 < 0.5 * loss0 and acc1 > 0.9, (loss0, acc0, loss1, acc1)
    weights = adapter.get_weights()
    assert "0.weight" in weights and "4.running_mean" in adapter.get_buffers()  # the module's own names
    again, other = _native()[0].get_weights(), _native(seed=1)[0].get_weights()
    fresh = _native()[0].get_weights()
    assert all(np.array_equal(again[k], fresh[k]) for k in fresh)  # the same seed, the same initial weights
    assert not np.array_equal(other["0.weight"], fresh["0.weight"])


def test_its_flops_counted_by_torch_equal_the_same_layers_counted_by_the_neutral_model():
    """FlopCounterMode on the module of your own against the neutral model's per-layer count of the same layers
    (harness.neutral.info: forward 2 FLOPs per multiply-accumulate, backward twice that but the first layer's input
    gradient): two independent counts of one architecture."""
    from harness.neutral import models
    from harness.spec import ModelSpec

    adapter, _ = _native()
    flops, source = adapter.train_flops_per_sample()
    neutral = models.analyze(ModelSpec.model_validate({"layers": [
        {"type": "conv2d", "filters": 16, "kernel_size": 3, "padding": "same", "activation": "relu"},
        {"type": "maxpool2d", "pool_size": 2}, {"type": "conv2d", "filters": 32, "kernel_size": 3, "padding": "same"},
        {"type": "batchnorm"}, {"type": "relu"}, {"type": "flatten"},
        {"type": "dense", "units": 64, "activation": "relu"}, {"type": "dense", "units": 10}]}), (8, 8, 1), 10)
    assert source == "torch.utils.flop_counter.FlopCounterMode"
    assert flops == neutral.train_flops_per_sample, (flops, neutral.train_flops_per_sample)
    assert sum(w.size for w in adapter.get_weights().values()) == neutral.parameter_count


def test_an_object_that_is_no_module_is_refused():
    from harness.neutral.info import Input
    from harness.neutral.native import NativeModelError, NativeSource

    adapter = PyTorchAdapter()
    with pytest.raises(NativeModelError, match=r"^m.py:f returned a builtins.list, not a torch.nn.Module$"):
        adapter.native_model([1, 2], NativeSource("m.py:f", Input.images((8, 8, 1)), 10, 0))
