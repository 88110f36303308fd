"""TensorFlow adapter: real training on the CPU, the canonical weights, PyTorch's optimizer semantics, no retracing,
and OOM classification."""

import numpy as np
import pytest
import tensorflow as tf

from adapters.base import DeviceUnavailable
from adapters.pytorch.adapter import PyTorchAdapter
from adapters.tensorflow.adapter import TensorFlowAdapter
from harness.neutral import datasets, models
from harness.spec import OptimizerSpec
from tests.adapters import kit
from tests.trials import run_options


def test_learns_digits_on_cpu():
    kit.check_learns_digits(TensorFlowAdapter)


def test_holds_canonical_weights_and_matches_reference_forward():
    kit.check_same_initial_weights_and_logits(TensorFlowAdapter)


def test_parameter_count_matches_model():
    kit.check_parameter_count(TensorFlowAdapter)


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
        tf_adapter.train_step(batch)
        torch_adapter.train_step(batch)
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
    assert adapter._train_fns[(32, 1)].experimental_get_tracing_count() == 1
    assert adapter._eval_fn.experimental_get_tracing_count() == 1
    for batch in kit.batches(len(data.y_train), 32, 3):  # gradient accumulation: one more function, traced once
        adapter.train_step(batch, micro_batches=4)
        assert np.isfinite(adapter.read_loss()[0])
    assert adapter._train_fns[(32, 4)].experimental_get_tracing_count() == 1
    assert adapter._train_fns[(32, 1)].experimental_get_tracing_count() == 1


def test_cpu_settings_and_memory_stats():
    adapter = kit.make(TensorFlowAdapter)[0]
    settings = adapter.settings()
    assert settings["intra_op_threads"] == 2 and settings["inter_op_threads"] == 1
    assert settings["jit_compile"] is False
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
        with tf.device(adapter.device):
            tf.zeros((2**42,))  # 16 TiB of float32: the CPU allocator refuses it
    kit.check_allocation_failure_is_oom(adapter, allocate, "16 TiB")


def test_allocator_options_on_cpu():
    kit.check_allocator_options_on_cpu(TensorFlowAdapter)


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
    adapter = TensorFlowAdapter()
    adapter.options = run_options(options)
    adapter._configure_gpu_memory(object())
    assert growth == growth_calls
    if logical is None:
        assert logical_devices == []
    else:
        assert logical_devices == [[tf.config.LogicalDeviceConfiguration(memory_limit=logical)]]
    adapter._gpu = True  # what prepare sets on a GPU; settings() reads no GPU state
    recorded = adapter.settings()
    for key, value in settings.items():
        assert recorded[key] == value, key
    assert ("memory_growth_skipped" in recorded) == (bool(logical) and options.get("tensorflow_memory_growth", True))


def test_inference_after_training_uses_the_running_statistics():
    kit.check_inference_after_training(TensorFlowAdapter)


def test_set_train_images_replaces_the_images_in_place_after_the_step_was_traced():
    kit.check_set_train_images(TensorFlowAdapter)


def test_a_staged_epoch_gives_the_same_steps_with_its_own_index_tensors():
    """stage_epoch puts one index tensor per step on the device; a step told its position uses that step's tensor
    (the same object), a step without one, or of another length, is converted. Training through the staged tensors
    gives exactly the weights of training without them."""
    states = []
    for staged in (False, True):
        adapter, data, _ = kit.make(TensorFlowAdapter)
        order = datasets.epoch_order(len(data.y_train), 0, 0)
        if staged:
            adapter.stage_epoch(order, 32)
            assert len(adapter._staged) == len(order) // 32
            assert adapter._indices_tensor(order[64:96], 2) is adapter._staged[2]
            for other, position in ((order[64:96].copy(), None), (order[65:97], None), (order[64:80], 2)):
                tensor = adapter._indices_tensor(other, position)
                assert all(tensor is not t for t in adapter._staged)
                np.testing.assert_array_equal(tensor.numpy(), other)
        for step in range(5):
            adapter.train_step(order[step * 32:(step + 1) * 32], position=step if staged else None)
        adapter.read_loss()
        states.append(adapter.get_weights())
    for name, value in states[0].items():
        np.testing.assert_array_equal(states[1][name], value, err_msg=name)


def test_the_registry_record_names_this_class_and_the_class_takes_it():
    import adapters

    record = adapters.BUILTIN["tensorflow"]
    assert adapters.get("tensorflow") is TensorFlowAdapter and TensorFlowAdapter.declaration is record
    assert TensorFlowAdapter.name == "tensorflow" and TensorFlowAdapter.PRECISIONS == record.precisions
