"""harness.spec.devices: the one reading of a device string that specs, plans, executors, NVML and adapters share."""

import pytest

from harness.spec.devices import device_index, device_kind, is_gpu


@pytest.mark.parametrize(("device", "kind", "index"), [("cpu", "cpu", 0), ("cpu:3", "cpu", 3), ("cuda", "cuda", 0),
                                                       ("cuda:0", "cuda", 0), ("cuda:12", "cuda", 12)])
def test_kind_and_index(device, kind, index):
    assert (device_kind(device), device_index(device)) == (kind, index)


@pytest.mark.parametrize("device", ["cuda:x", "cuda:", "cuda:-1", "cpu:1.5"])
def test_a_bad_index_is_an_error_naming_the_device(device):
    with pytest.raises(ValueError, match=repr(device).replace(".", r"\.")):
        device_index(device)


@pytest.mark.parametrize(("device", "gpu"), [("cuda:0", True), ("cuda:7", True), ("cuda", False), ("cpu", False),
                                             ("cuda:x", False), ("gpu:0", False), ("cuda:0:1", False)])
def test_is_gpu_is_cuda_n_exactly(device, gpu):
    assert is_gpu(device) is gpu
