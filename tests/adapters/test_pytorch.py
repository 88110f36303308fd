"""PyTorch adapter: real training on the CPU, the canonical weights, and OOM classification."""

import torch

from adapters.pytorch import PyTorchAdapter
from tests.adapters import kit


def test_learns_digits_on_cpu():
    kit.check_learns_digits(PyTorchAdapter)


def test_holds_canonical_weights_and_matches_reference_forward():
    kit.check_same_initial_weights_and_logits(PyTorchAdapter)


def test_parameter_count_matches_model():
    kit.check_parameter_count(PyTorchAdapter)


def test_oom_is_classified_by_exception_type():
    adapter = PyTorchAdapter()
    assert adapter.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert adapter.is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert not adapter.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not adapter.is_oom(ValueError("out of memory"))  # a message alone does not make an OOM


def test_real_cpu_allocation_failure_is_oom():
    adapter = PyTorchAdapter()
    try:
        torch.empty(2**50, dtype=torch.float32)  # 4 PiB: the CPU allocator refuses it
    except BaseException as exc:  # noqa: BLE001 - the point is to classify whatever it raised
        assert adapter.is_oom(exc), repr(exc)
    else:
        raise AssertionError("a 4 PiB allocation succeeded")
