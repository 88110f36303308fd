"""Keras adapter suite, run in one Keras environment (envs/keras-jax, envs/keras-torch or envs/keras-tensorflow: one
backend per process, chosen by KERAS_BACKEND before Keras is imported): the conformance suite
(tests/adapters/conformance.py), the block checks against the numpy reference, and what is Keras's own. The adapter is
named by HARNESS_KERAS_ADAPTER ("keras-jax", ...). Not collected by the main suite: tests/adapters/test_keras_<backend>
.py runs it in each environment and requires every test to pass."""

import os

import numpy as np
import pytest

import adapters
from harness.neutral import datasets, models
from harness.plan.support import unsupported
from tests.adapters import block_checks, kit, reference, scenarios
from tests.adapters.conformance import *  # noqa: F403 (the conformance tests, collected here)

NAME = os.environ["HARNESS_KERAS_ADAPTER"]
ADAPTER = adapters.get(NAME)
BACKEND = ADAPTER.declaration.backend


@pytest.fixture(scope="module")
def adapter_cls():
    return ADAPTER


def test_keras_runs_on_the_declared_backend():
    adapter = kit.make(ADAPTER)[0]
    import keras

    assert keras.backend.backend() == BACKEND == os.environ["KERAS_BACKEND"]
    assert int(keras.__version__.split(".")[0]) >= 3
    settings = adapter.settings().record()
    assert settings["keras_backend"] == BACKEND and settings["dtype_policy"] == "float32"
    assert settings["train_api"] == "keras.Model.train_on_batch" and settings["precision"] == "fp32"
    assert settings["compile"] == ADAPTER.declaration.default_compile and settings["loader"] is None
    assert settings["data_parallel"] is None
    if BACKEND != "jax":  # JAX's CPU threads are XLA's own: not told
        assert settings["intra_op_threads"] == 2 and settings["inter_op_threads"] == 1
    versions = adapter.versions()
    assert versions["keras"] == keras.__version__ and set(ADAPTER.declaration.version_keys) - {"tensorflow_cpu"} <= set(
        versions)


def test_resnet_gives_the_reference():
    block_checks.resnet_gives_the_reference(ADAPTER)


def test_decoder_gives_the_reference_and_does_not_look_ahead():
    block_checks.decoder_gives_the_reference_and_does_not_look_ahead(ADAPTER)


def test_modes_map_to_jit_compile_and_train_alike():
    """eager and compiled are Model.compile(jit_compile=False / True), recorded; three steps of each end within
    float32 rounding of each other (the same arithmetic, traced or not). The default is Keras's own on a CPU."""
    weights = {}
    for mode in ("eager", "compiled"):
        adapter, data, _ = kit.make(kit.configured(ADAPTER, compile=mode))
        kit.train_on(adapter, kit.batches(len(data.y_train), 32, 3))
        assert adapter.settings().record()["jit_compile"] is (mode == "compiled")
        weights[mode] = adapter.get_weights()
    for name, value in weights["eager"].items():
        np.testing.assert_allclose(weights["compiled"][name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    assert ADAPTER.declaration.default_compile == {"jax": "compiled", "torch": "eager", "tensorflow": "eager"}[BACKEND]


def test_bf16_is_keras_mixed_bfloat16_within_its_rounding():
    """mixed_bfloat16: float32 variables (the canonical weights exactly), bf16 compute, float32 logits within the
    derived bf16 bound of the reference (``scenarios.bf16_tolerance``); a step trains to a finite loss."""
    adapter, data, info = kit.make(kit.configured(ADAPTER, precision="bf16"))
    assert adapter.settings().record()["dtype_policy"] == "mixed_bfloat16"
    logits = adapter.predict(data.x_test[:64])
    assert logits.dtype == np.float32
    scenarios.assert_bf16_close(logits, reference.forward(info, models.initial_weights(info, 0), data.x_test[:64]),
                                info)
    losses = kit.train_on(adapter, kit.batches(len(data.y_train), 32, 2))[0]
    assert np.isfinite(losses).all()
    for name, value in adapter.get_weights().items():
        assert value.dtype == np.float32 and np.isfinite(value).all(), name


def test_fp16_scales_the_loss_whatever_built_the_model():
    """fp16 (mixed_float16) compiles the optimizer inside Keras's LossScaleOptimizer, also for a model that is not
    the neutral builder's and was built in float32; recorded as loss scaling. Compiled only: the plan trains fp16 on
    CUDA GPUs alone."""
    import keras

    adapter = kit.configured(ADAPTER, precision="fp16")()
    adapter.prepare("cpu", 2, 0)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(dtype="float32"),
                              keras.layers.Dense(10, dtype="float32")])
    adapter.build(model, "image_classification", kit.SGD)
    adapter.training.compile(1)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    settings = adapter.settings().record()
    assert settings["loss_scaling"] is True and settings["dtype_policy"] == "mixed_float16"


def test_a_keras_model_of_its_own_trains_through_the_same_mechanics():
    """The training mechanics take any keras.Model, not only the neutral builder's: a model built with Keras's own
    layers and initializers learns the digits through ``build`` (the same steps, accumulation included), and its
    state is its own variables under their Keras paths, the trainable ones moved by training."""
    import keras

    adapter = ADAPTER()
    adapter.prepare("cpu", 2, 0)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu", name="conv"),
                              keras.layers.BatchNormalization(name="norm"), keras.layers.Flatten(),
                              keras.layers.Dense(10, name="out")], name="own")
    adapter.build(model, "image_classification", kit.SGD)
    data, _ = kit.digits()
    adapter.load(data)
    before = adapter.get_weights()
    assert sorted(before) == ["own/conv/bias", "own/conv/kernel", "own/norm/beta", "own/norm/gamma", "own/out/bias",
                              "own/out/kernel"]
    assert sorted(adapter.get_buffers()) == ["own/norm/moving_mean", "own/norm/moving_variance"]
    loss0 = adapter.evaluate(256)[0]
    for epoch in range(2):
        kit.train_on(adapter, kit.epoch_batches(len(data.y_train), 32, epoch), micro_batches=2, epoch=epoch)
    loss1, accuracy = adapter.evaluate(256)
    assert loss1 < 0.5 * loss0 and accuracy > 0.85, (loss0, loss1, accuracy)
    assert adapter.settings().record()["gradient_accumulation_steps"] == 2
    assert all(np.abs(adapter.get_weights()[name] - value).max() > 1e-4 for name, value in before.items())


def test_a_model_that_is_no_keras_model_is_refused():
    adapter = ADAPTER()
    adapter.prepare("cpu", 2, 0)
    with pytest.raises(TypeError, match=f"the {NAME} adapter trains a keras.Model, not dict"):
        adapter.build({}, "image_classification", kit.SGD)


def test_batches_are_staged_on_the_device_when_called():
    """Resident mode: ``batches`` converts the epoch's whole steps to the backend's int32 tensors when it is called
    (outside the timed windows), each step a slice of them; the partial last step is left out."""
    import keras

    adapter, data, _ = kit.make(ADAPTER)
    order = datasets.epoch_order(len(data.y_train), 0, 0)[:100]
    staged = list(adapter.batches(order, 32, 0))
    assert len(staged) == 3
    for p, batch in enumerate(staged):
        assert keras.ops.is_tensor(batch) and keras.backend.standardize_dtype(batch.dtype) == "int32"
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(batch), order[p * 32:(p + 1) * 32])


def test_execution_is_declared_as_the_plan_decides():
    """fp32 and bf16 in both modes on the CPU; fp16 (mixed_float16, loss scaling) on CUDA GPUs only; no tf32; no
    data parallelism and no loader mode (``harness.plan.support``, from the declaration)."""
    kit.check_execution_declared(NAME, [(p, m, "cpu") for p in ("fp32", "bf16") for m in ("eager", "compiled")], {
        ("fp16", "default", "cpu"): f"the {NAME} adapter does not train in fp16 on cpu (only on cuda)",
        ("tf32", "default", "cpu"): f"the {NAME} adapter does not train in tf32 on cpu: Keras 3 has no TF32"})
    record, info = adapters.BUILTIN[NAME], kit.digits()[1]
    assert unsupported(record, info, data_parallel=2).startswith(f"the {NAME} adapter does not train data-parallel")
    assert unsupported(record, info, input="loader") == f"the {NAME} adapter has no data loader mode (input: loader)"


def test_gradient_accumulation_is_fixed_at_the_first_step():
    """Keras's accumulation is the optimizer's ``gradient_accumulation_steps``: a later step with other micro-batches
    is refused rather than silently re-compiled with fresh optimizer state; an uneven split is refused too."""
    adapter, _, _ = kit.make(ADAPTER)
    kit.step(adapter, np.arange(32), micro_batches=2)
    assert adapter.settings().record()["gradient_accumulation_steps"] == 2
    with pytest.raises(ValueError, match="compiled for 2 micro-batch"):
        kit.step(adapter, np.arange(32), micro_batches=1)
    with pytest.raises(ValueError, match="cannot be split into 3 equal micro-batches"):
        kit.step(adapter, np.arange(32), micro_batches=3)


def test_a_gpu_is_unavailable_here():
    from adapters.base import DeviceUnavailable

    assert "sees no CUDA device" in ADAPTER().device_problem("cuda:0")
    with pytest.raises(DeviceUnavailable):
        ADAPTER().prepare("cuda:0", 1, 0)


def test_oom_is_classified_by_type():
    """An allocation the CPU allocator refuses (4 PiB) raises what ``is_oom`` classifies as the backend's OOM; a
    message alone makes none. TensorFlow's CPU allocator waits about 10 s for memory before it refuses, so there
    the error is made by its documented constructor (``tf.errors.ResourceExhaustedError(node_def, op, message)``)."""
    adapter = kit.make(ADAPTER)[0]
    import keras

    if BACKEND == "tensorflow":
        import tensorflow as tf

        assert adapter.is_oom(tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor"))
        assert not adapter.is_oom(tf.errors.InvalidArgumentError(None, None, "OOM when allocating tensor"))
        return
    kit.check_allocation_failure_is_oom(adapter, lambda: keras.ops.convert_to_numpy(
        keras.ops.zeros((2**48, 4), "float32")), "4 PiB")
    assert not adapter.is_oom(RuntimeError("out of memory"))
