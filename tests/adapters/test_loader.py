"""Loader mode (``input: loader``) in the frameworks of the development environment, in process: each framework's own
data loader (tests/adapters/loader_checks.py) trains as resident mode does, with its loader recorded. JAX's check
runs in envs/jax (tests/adapters/jax_suite.py)."""

from __future__ import annotations

from tests.adapters import loader_checks


def test_pytorch_dataloader_trains_as_resident_mode():
    from adapters.pytorch.adapter import PyTorchAdapter

    settings = loader_checks.check(PyTorchAdapter, "torch.utils.data.DataLoader")
    assert settings["num_workers"] == 1 and settings["prefetch_factor"] == 2 and settings["persistent_workers"]
    assert settings["pin_memory"] is False  # on the CPU: nothing to pin for


def test_tensorflow_tf_data_trains_as_resident_mode():
    from adapters.tensorflow.adapter import TensorFlowAdapter

    settings = loader_checks.check(TensorFlowAdapter, "tf.data.Dataset")
    assert settings["num_parallel_calls"] == 1 and settings["prefetch"] == 2 and settings["deterministic"]


def test_mxnet_dataloader_trains_as_resident_mode():
    from adapters.mxnet.adapter import MXNetAdapter

    settings = loader_checks.check(MXNetAdapter, "mxnet.gluon.data.DataLoader")
    assert settings["num_workers"] == 1 and settings["prefetch"] == 2 and settings["thread_pool"] is False
