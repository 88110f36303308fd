"""PyTorch adapter: the conformance suite (tests/adapters/conformance.py), and what is PyTorch's own: OOM
classification and the GPU memory cap."""

from types import SimpleNamespace

import pytest
import torch

from adapters.pytorch.adapter import PyTorchAdapter
from tests.adapters import kit
from tests.adapters.conformance import *  # noqa: F403 (the conformance tests, collected here)
from tests.helpers import run_options


@pytest.fixture(scope="module")
def adapter_cls():
    return PyTorchAdapter


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
