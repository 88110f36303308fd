"""TensorFlow adapter: the conformance suite (tests/adapters/conformance.py), and what is TensorFlow's own: PyTorch's
optimizer semantics, no retracing, the epoch's index tensors staged when ``batches`` is called, the CPU settings, the
GPU memory options, and OOM classification."""

import numpy as np
import pytest
import tensorflow as tf

from adapters.base import DeviceUnavailable
from adapters.pytorch.adapter import PyTorchAdapter
from adapters.tensorflow.adapter import TensorFlowAdapter
from harness.neutral import datasets, models
from harness.spec import OptimizerSpec
from tests.adapters import kit
from tests.adapters.conformance import *  # noqa: F403 (the conformance tests, collected here)
from tests.helpers import run_options


@pytest.fixture(scope="module")
def adapter_cls():
    return TensorFlowAdapter


@pytest.mark.parametrize("optimizer", [
    OptimizerSpec(name="sgd", learning_rate=0.05, momentum=0.9, weight_decay=0.01),
    OptimizerSpec(name="sgd", learning_rate=0.1),
    # epsilon large enough that adding it before or after Adam's bias correction (Keras's form or PyTorch's) shows
    OptimizerSpec(name="adam", learning_rate=0.002, epsilon=1e-4, weight_decay=0.01),
], ids=["sgd-momentum-wd", "sgd-plain", "adam-wd"])
def test_trains_exactly_like_pytorch(optimizer):
    """The same batches from the same weights give the same weights after several steps: the optimizer (coupled weight
    decay, PyTorch's Adam epsilon), the HWIO/(in, out) layouts and the flatten permutation all hold during training."""
    tf_adapter, data, info = kit.make(TensorFlowAdapter, optimizer=optimizer)
    torch_adapter = kit.make(PyTorchAdapter, optimizer=optimizer)[0]
    order = datasets.epoch_order(len(data.y_train), 0, 0)
    for step in range(8):
        batch = order[step * 32:(step + 1) * 32]
        kit.step(tf_adapter, batch)
        kit.step(torch_adapter, batch)
        np.testing.assert_allclose(tf_adapter.read_loss()[0], torch_adapter.read_loss()[0], rtol=1e-4)
    initial = models.initial_weights(info, 0)
    expected = torch_adapter.get_weights()
    held = tf_adapter.get_weights()
    for name, value in expected.items():
        assert np.abs(value - initial[name]).max() > 1e-3, f"{name} did not train"
        # observed <4e-7; Keras-style Adam epsilon or no weight decay: ~1e-2
        np.testing.assert_allclose(held[name], value, rtol=0, atol=1e-5, err_msg=name)


def test_train_and_evaluate_never_retrace():
    adapter, data, _ = kit.make(TensorFlowAdapter)
    assert np.isnan(adapter.read_loss()[0])  # no step yet
    kit.train_epochs(adapter, data, epochs=1, batch_size=32)
    for batch_size in (256, 100, 7):  # 360 test images: a smaller last batch every time
        loss, accuracy = adapter.evaluate(batch_size)
        assert np.isfinite(loss) and 0 <= accuracy <= 1
    training = adapter.training
    assert training.functions[(32, 1)].experimental_get_tracing_count() == 1
    assert training.eval_fn.experimental_get_tracing_count() == 1
    kit.train_on(adapter, kit.batches(len(data.y_train), 32, 3), micro_batches=4)  # one more function, traced once
    assert training.functions[(32, 4)].experimental_get_tracing_count() == 1
    assert training.functions[(32, 1)].experimental_get_tracing_count() == 1
    assert adapter.compilations() == 2


def test_batches_stages_the_epochs_index_tensors_when_called(monkeypatch):
    """In resident mode ``batches`` converts the epoch's steps to int64 index tensors on the device when it is called
    (outside the timed windows), one per whole step: iterating them converts nothing (``tf.constant`` is made to fail
    after the call). Training through those staged tensors gives exactly the weights of training one step at a time
    (each step its own ``batches`` call)."""
    states = []
    for staged in (True, False):
        adapter, data, _ = kit.make(TensorFlowAdapter)
        order = datasets.epoch_order(len(data.y_train), 0, 0)[:5 * 32 + 7]  # and a partial step, dropped
        if staged:
            batches = adapter.batches(order, 32, 0)
            with monkeypatch.context() as patched:
                patched.setattr(tf, "constant", lambda *args, **kwargs: pytest.fail("converted after batches"))
                tensors = list(batches)
            assert len(tensors) == 5
            for step, tensor in enumerate(tensors):
                assert isinstance(tensor, tf.Tensor) and tensor.dtype == tf.int64 and tensor.device.endswith("CPU:0")
                np.testing.assert_array_equal(tensor.numpy(), order[step * 32:(step + 1) * 32])
            for tensor in tensors:
                adapter.train_step(tensor)
        else:
            for step in range(5):
                kit.step(adapter, order[step * 32:(step + 1) * 32])
        assert adapter.read_loss()[1] == 5
        states.append(adapter.get_weights())
    for name, value in states[0].items():
        np.testing.assert_array_equal(states[1][name], value, err_msg=name)


def test_cpu_settings_and_memory_stats():
    adapter = kit.make(TensorFlowAdapter)[0]
    settings = adapter.settings().record()
    assert settings["intra_op_threads"] == 2 and settings["inter_op_threads"] == 1
    assert settings["jit_compile"] is False and settings["data_format"] == "NHWC"
    assert settings["data_parallel"] is None and settings["loader"] is None
    adapter.reset_memory_stats()
    assert adapter.memory_stats() == {}  # TF keeps no allocator statistics for the CPU
    assert adapter.versions()["tensorflow"] == tf.__version__


def test_missing_gpu_is_device_unavailable():
    index = len(tf.config.list_physical_devices("GPU"))  # one past the last GPU: cuda:0 on a CPU-only build
    with pytest.raises(DeviceUnavailable, match="GPU"):
        TensorFlowAdapter().prepare(f"cuda:{index}", 2, 0)


def test_oom_is_classified_by_exception_type():
    adapter = TensorFlowAdapter()
    assert adapter.is_oom(tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[1024]"))
    assert adapter.is_oom(tf.errors.InternalError(None, None, "Dst tensor is not initialized."))
    assert not adapter.is_oom(tf.errors.InternalError(None, None, "cuDNN launch failure"))
    assert not adapter.is_oom(tf.errors.InvalidArgumentError(None, None, "Matrix size-incompatible"))
    assert not adapter.is_oom(ValueError("OOM when allocating tensor"))  # a message alone does not make an OOM


def test_real_cpu_allocation_failure_is_oom():
    adapter = TensorFlowAdapter()
    adapter.prepare("cpu", 2, 0)

    def allocate():
        with tf.device(adapter.devices.device):
            tf.zeros((2**42,))  # 16 TiB of float32: the CPU allocator refuses it
    kit.check_allocation_failure_is_oom(adapter, allocate, "16 TiB")


@pytest.mark.parametrize("options, growth_calls, logical, settings", [
    ({"tensorflow_memory_growth": True, "memory_limit_bytes": None}, [True], None,
     {"memory_limit_bytes": None, "memory_growth": True}),
    ({"tensorflow_memory_growth": False, "memory_limit_bytes": None}, [], None,
     {"memory_limit_bytes": None, "memory_growth": False}),
    ({}, [True], None, {"memory_limit_bytes": None, "memory_growth": True}),  # growth is the default
    # 3.5 GiB + 1000 bytes: whole MiB, rounded down; memory growth cannot be combined with a logical device
    ({"tensorflow_memory_growth": True, "memory_limit_bytes": 7 * 2**29 + 1000}, [], 3584,
     {"memory_limit_bytes": 3584 * 2**20, "memory_limit_requested_bytes": 7 * 2**29 + 1000, "memory_growth": False}),
    ({"tensorflow_memory_growth": False, "memory_limit_bytes": 2**30}, [], 1024,
     {"memory_limit_bytes": 2**30, "memory_limit_requested_bytes": 2**30, "memory_growth": False}),
], ids=["growth", "no-growth", "default", "limit-and-growth", "limit"])
def test_gpu_memory_options(monkeypatch, options, growth_calls, logical, settings):
    """No GPU here: TF's configuration calls are replaced, to check what the adapter asks of them for each option and
    what it records."""
    growth, logical_devices = [], []
    monkeypatch.setattr(tf.config.experimental, "set_memory_growth", lambda gpu, on: growth.append(on))
    monkeypatch.setattr(tf.config, "set_logical_device_configuration",
                        lambda gpu, devices: logical_devices.append(devices))
    adapter = TensorFlowAdapter(run_options(options))
    adapter.devices.configure_gpu_memory(object())
    assert growth == growth_calls
    if logical is None:
        assert logical_devices == []
    else:
        assert logical_devices == [[tf.config.LogicalDeviceConfiguration(memory_limit=logical)]]
    adapter.devices.gpu = True  # what prepare sets on a GPU; settings() reads no GPU state
    recorded = adapter.settings().record()
    for key, value in settings.items():
        assert recorded[key] == value, key
    assert ("memory_growth_skipped" in recorded) == (bool(logical) and options.get("tensorflow_memory_growth", True))
