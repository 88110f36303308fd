"""Keras adapter suite, run in one Keras environment (envs/keras-jax, envs/keras-torch or envs/keras-tensorflow: one
backend per process, chosen by KERAS_BACKEND before Keras is imported): the conformance suite
(tests/adapters/conformance.py), the block checks against the numpy reference, and what is Keras's own. The adapter is
named by HARNESS_KERAS_ADAPTER ("keras-jax", ...). Not collected by the main suite: tests/adapters/test_keras_<backend>
.py runs it in each environment and requires every test to pass."""

import os

import numpy as np
import pytest

import adapters
from harness.neutral import datasets, models, native
from harness.plan.support import Conditions, NativeTask, unsupported
from harness.spec import DigitsData, NativeModel, SyntheticData
from tests.adapters import block_checks, keras_native, kit, reference, scenarios
from tests.adapters.conformance import *  # noqa: F403 (the conformance tests, collected here)

NAME = os.environ["HARNESS_KERAS_ADAPTER"]
ADAPTER = adapters.get(NAME)
BACKEND = ADAPTER.declaration.family.backend


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
    assert settings["compile"] == ADAPTER.declaration.capabilities.default_compile and settings["loader"] is None
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
    defaults = {"jax": "compiled", "torch": "eager", "tensorflow": "eager"}
    assert ADAPTER.declaration.capabilities.default_compile == defaults[BACKEND]


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


def test_a_model_of_your_own_learns_the_digits_through_native_model():
    """specs/models.py:keras_cnn, made by its factory after ``prepare`` and adopted by ``native_model`` (Keras's own
    initialisation from the seed, no shared weights: ``source.initial_weights`` None), learns the digits through
    ``build``: an epoch of batch 32 takes the test loss below a third of its start and the accuracy above 0.85. Its
    state is its own variables (``get_weights``: the trainable ones under their Keras paths, 38 346 parameters, what
    the worker records; ``get_buffers``: batchnorm's moving statistics), each moved by more than 1e-3 but the bias of
    the convolution that feeds the batchnorm, whose gradient is zero (batchnorm subtracts each channel's mean). The
    declaration adopts a keras.Model and shares initial weights across the backends; the plan accepts the task."""
    declared = ADAPTER.declaration
    assert declared.capabilities.native_model == "keras.Model"
    assert declared.family.shared_weights == "adapters.keras.weights"
    assert unsupported(adapters.BUILTIN[NAME], NativeTask("image_classification")) is None
    adapter, data = keras_native.adopt(ADAPTER, kit.SGD, None)
    model = adapter.training.model
    before = adapter.get_weights()
    assert sorted(before) == sorted(v.path for v in model.trainable_variables)
    assert sum(w.size for w in before.values()) == 38346
    assert sorted(adapter.get_buffers()) == sorted(v.path for v in model.non_trainable_variables) and len(
        adapter.get_buffers()) == 2
    loss0 = adapter.evaluate(256)[0]
    kit.train_epochs(adapter, data, 1, 32)
    loss1, accuracy = adapter.evaluate(256)
    assert loss1 < loss0 / 3 and accuracy > 0.85, (loss0, loss1, accuracy)
    after, pre_norm_bias = adapter.get_weights(), model.layers[3].bias.path  # the conv that feeds the batchnorm
    for name, value in before.items():
        moved = np.abs(after[name] - value).max()
        assert moved < 1e-4 if name == pre_norm_bias else moved > 1e-3, (name, moved)


def test_a_model_of_your_own_follows_the_trials_seed_and_precision():
    """The factory runs after ``prepare``: the same seed makes the same initial weights and another seed others
    (Keras's initialisers draw from ``keras.utils.set_random_seed``), and in bf16 the model computes in
    mixed_bfloat16 (Keras's global dtype policy), its variables float32, its logits float32 and a step finite."""
    first, again, other = (keras_native.adopt(ADAPTER, kit.SGD, None, seed=s)[0].get_weights() for s in (0, 0, 1))
    kernels = [name for name in first if name.endswith("kernel")]
    assert len(kernels) == 4
    for a, b, c in zip(*(sorted(w.items()) for w in (first, again, other))):
        np.testing.assert_array_equal(a[1], b[1])
        assert a[0] not in kernels or not np.array_equal(a[1], c[1]), a[0]
    adapter, _ = keras_native.adopt(kit.configured(ADAPTER, precision="bf16"), kit.SGD, None)
    model = adapter.training.model
    assert {layer.dtype_policy.name for layer in model.layers[1:]} == {"mixed_bfloat16"}
    assert {str(v.dtype) for v in model.variables if v.trainable} == {"float32"}
    assert adapter.predict(np.zeros((2, 8, 8, 1), np.float32)).dtype == np.float32
    kit.step(adapter, np.arange(32))
    assert np.isfinite(adapter.read_loss()[0])


def test_an_object_that_is_no_keras_model_is_refused_naming_the_factory():
    """``native_model`` of what is not a ``keras.Model`` (``collections:OrderedDict`` returns an ``OrderedDict``)
    raises NativeModelError for the spec's ``model`` field, naming the factory and what it returned."""
    adapter = ADAPTER()
    adapter.prepare("cpu", 2, 0)
    feed, classes = datasets.describe_input(DigitsData(name="digits"))
    made = native.make(NativeModel(factory="collections:OrderedDict"))
    with pytest.raises(native.NativeModelError) as err:
        adapter.native_model(made, native.NativeSource("collections:OrderedDict", feed, classes, 0))
    assert err.value.field == "model"
    assert str(err.value) == "collections:OrderedDict returned a collections.OrderedDict, not a keras.Model"


def test_the_shared_initial_weights_load_exactly(tmp_path):
    """``adapters.keras.weights`` draws keras_cnn's weights for seed 3 in its own process (Keras's numpy backend, in
    this environment); ``native_model`` with that file gives a model whose every variable (``get_weights`` and
    ``get_buffers``) equals one of the file's arrays bit for bit (read with h5py: a dataset per variable), all of
    them used; the backend's own initialisation for the same seed differs (the file, not the seed, made them). A
    file of another model is refused with NativeModelError."""
    import h5py

    path = keras_native.shared_weights(tmp_path / "shared", seed=3)
    stored: list[np.ndarray] = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda _, item: stored.append(np.asarray(item)) if isinstance(item, h5py.Dataset) else None)
    adapter = keras_native.adopt(ADAPTER, kit.SGD, path, seed=3)[0]
    loaded = {**adapter.get_weights(), **adapter.get_buffers()}
    assert len(loaded) == len(stored) == 12
    assert sorted((a.shape, a.tobytes()) for a in loaded.values()) == sorted(
        (a.shape, a.astype(np.float32).tobytes()) for a in stored)
    own = keras_native.adopt(ADAPTER, kit.SGD, None, seed=3)[0].get_weights()
    kernels = [a for name, a in sorted(loaded.items()) if name.endswith("kernel")]
    assert len(kernels) == 4 and not any(any(np.array_equal(k, o) for o in own.values()) for k in kernels)
    with pytest.raises(native.NativeModelError, match="do not fit the model"):
        keras_native.adopt(ADAPTER, kit.SGD, path, seed=3, width=8)


if BACKEND == "torch":  # one backend, the quick one: under 1 s in this suite (6 s in a fresh process), where
    # TensorFlow's trace of the step takes about 8 s and JAX's build and XLA compilation of it about 50 s (2 CPU cores)

    def test_keras_applications_mobilenet_v3_small_is_adopted_and_steps():
        """``keras.applications.MobileNetV3Small`` (no pretrained weights, 32x32x3 input, 10 classes, no
        preprocessing, logits: ``classifier_activation=None``) from its factory by import path is adopted, steps once
        on 8 synthetic 32x32x3 images to a finite loss near ln 10, moves its weights and predicts (2, 10) logits."""
        cfg = SyntheticData(name="synthetic", size=16, test_size=8)
        data = datasets.load(cfg)
        feed, classes = datasets.describe_input(cfg)
        factory = "keras.applications:MobileNetV3Small"
        adapter = ADAPTER()
        adapter.prepare("cpu", 2, 0)
        made = native.make(NativeModel(factory=factory, kwargs={
            "weights": None, "input_shape": [32, 32, 3], "classes": 10, "include_preprocessing": False,
            "classifier_activation": None}))
        adapter.build(adapter.native_model(made, native.NativeSource(factory, feed, classes, 0)),
                      native.task(feed), kit.SGD)
        adapter.load(data)
        before = adapter.get_weights()
        assert len(before) > 100
        kit.step(adapter, np.arange(8))
        loss, steps = adapter.read_loss()
        assert steps == 1 and 1.0 < loss < 5.0, loss
        assert any(np.abs(adapter.get_weights()[name] - value).max() > 0 for name, value in before.items())
        assert adapter.predict(data.x_test[:2]).shape == (2, 10)


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
    assert unsupported(record, info,
                       Conditions(data_parallel=2)).startswith(f"the {NAME} adapter does not train data-parallel")
    assert unsupported(record, info,
                       Conditions(input="loader")) == f"the {NAME} adapter has no data loader mode (input: loader)"


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
