"""Keras adapter suite: the shared adapter checks of ``kit`` and ``block_checks`` (against the numpy reference), run in
one Keras environment (envs/keras-jax, envs/keras-torch or envs/keras-tensorflow: one backend per process, chosen by
KERAS_BACKEND before Keras is imported). The adapter is named by HARNESS_KERAS_ADAPTER ("keras-jax", ...). Not
collected by the main suite: tests/adapters/test_keras.py runs it in each environment and requires every test to
pass."""

import os

import numpy as np
import pytest

import adapters
from adapters.base import RunOptions
from harness.neutral import models
from tests.adapters import block_checks, kit, reference, scenarios
from tests.trials import run_options

NAME = os.environ["HARNESS_KERAS_ADAPTER"]
ADAPTER = adapters.get(NAME)
BACKEND = ADAPTER.declaration.backend


def test_keras_runs_on_the_declared_backend():
    adapter = kit.make(ADAPTER)[0]
    import keras

    assert keras.backend.backend() == BACKEND == os.environ["KERAS_BACKEND"]
    assert int(keras.__version__.split(".")[0]) >= 3
    settings = adapter.settings()
    assert settings["keras_backend"] == BACKEND and settings["dtype_policy"] == "float32"
    assert settings["train_api"] == "keras.Model.train_on_batch"
    versions = adapter.versions()
    assert versions["keras"] == keras.__version__ and set(ADAPTER.declaration.version_keys) - {"tensorflow_cpu"} <= set(
        versions)


def test_learns_digits_on_cpu():
    kit.check_learns_digits(ADAPTER)


def test_holds_canonical_weights_and_matches_reference_forward():
    kit.check_same_initial_weights_and_logits(ADAPTER)


def test_parameter_count_matches_model():
    kit.check_parameter_count(ADAPTER)


def test_inference_after_training_is_the_reference_on_the_reported_state():
    kit.check_inference_after_training(ADAPTER)


def test_set_train_images_replaces_the_images():
    kit.check_set_train_images(ADAPTER)


def test_allocator_options_on_cpu():
    kit.check_allocator_options_on_cpu(ADAPTER)


def test_resnet_gives_the_reference():
    block_checks.resnet_gives_the_reference(ADAPTER)


def test_decoder_gives_the_reference_and_does_not_look_ahead():
    block_checks.decoder_gives_the_reference_and_does_not_look_ahead(ADAPTER)


def test_modes_map_to_jit_compile_and_train_alike():
    """eager and compiled are Model.compile(jit_compile=False / True), recorded; three steps of each end within
    float32 rounding of each other (the same arithmetic, traced or not). The default is Keras's own on a CPU."""
    weights = {}
    for mode in ("eager", "compiled"):
        data, info = kit.digits()
        adapter = ADAPTER()
        adapter.options = run_options({"compile": mode})
        adapter.prepare("cpu", 2, 0)
        adapter.build(info, models.initial_weights(info, 0), kit.SGD)
        adapter.load(data)
        for batch in kit.batches(len(data.y_train), 32, 3):
            adapter.train_step(batch)
        assert np.isfinite(adapter.read_loss()[0])
        assert adapter.settings()["jit_compile"] is (mode == "compiled")
        weights[mode] = adapter.get_weights()
    for name, value in weights["eager"].items():
        np.testing.assert_allclose(weights["compiled"][name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    assert ADAPTER.DEFAULT_COMPILE == {"jax": "compiled", "torch": "eager", "tensorflow": "eager"}[BACKEND]


def test_bf16_is_keras_mixed_bfloat16_within_its_rounding():
    """mixed_bfloat16: float32 variables (the canonical weights exactly), bf16 compute, float32 logits within the
    derived bf16 bound of the reference (``scenarios.bf16_tolerance``); a step trains to a finite loss."""
    data, info = kit.digits()
    adapter = ADAPTER()
    adapter.options = run_options({"precision": "bf16"})
    adapter.prepare("cpu", 2, 0)
    weights = models.initial_weights(info, 0)
    adapter.build(info, weights, kit.SGD)
    adapter.load(data)
    assert adapter.settings()["dtype_policy"] == "mixed_bfloat16"
    logits = adapter.predict(data.x_test[:64])
    assert logits.dtype == np.float32
    scenarios.assert_bf16_close(logits, reference.forward(info, weights, data.x_test[:64]), info)
    for batch in kit.batches(len(data.y_train), 32, 2):
        adapter.train_step(batch)
    assert np.isfinite(adapter.read_loss()[0])
    for name, value in adapter.get_weights().items():
        assert value.dtype == np.float32 and np.isfinite(value).all(), name


def test_execution_is_declared_as_the_worker_decides():
    """fp32 and bf16 in both modes on the CPU; fp16 (mixed_float16, loss scaling) on CUDA GPUs only; no tf32."""
    adapter = ADAPTER()
    kit.check_execution_declared(adapter, [(p, m, "cpu") for p in ("fp32", "bf16") for m in ("eager", "compiled")], {
        ("fp16", "default", "cpu"): f"the {NAME} adapter does not train in fp16 on cpu (only on cuda)",
        ("tf32", "default", "cpu"): f"the {NAME} adapter does not train in tf32 on cpu: Keras 3 has no TF32"})


def test_gradient_accumulation_is_fixed_at_the_first_step():
    """Keras's accumulation is the optimizer's ``gradient_accumulation_steps``: a later step with other micro-batches
    is refused rather than silently re-compiled with fresh optimizer state."""
    adapter, data, _ = kit.make(ADAPTER)
    adapter.train_step(np.arange(32), micro_batches=2)
    assert adapter.settings()["gradient_accumulation_steps"] == 2
    with pytest.raises(ValueError, match="compiled for 2 micro-batch"):
        adapter.train_step(np.arange(32), micro_batches=1)


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


def test_options_are_the_instances():
    kit.make(ADAPTER)
    assert ADAPTER.options == RunOptions()
