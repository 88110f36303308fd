"""JAX adapter suite, run in JAX's own environment (envs/jax: JAX needs numpy >= 2, the development environment has
numpy < 2 for MXNet): the conformance suite (tests/adapters/conformance.py), and what is JAX's own: one compilation
per step shape, the loss sum carried through the jitted step, Grain's loader, OOM classification, the precision
policy (traced products, bf16 against float64, fp16's loss scaling on the CPU), the neutral builder, and a Flax module
of your own (linen and nnx, ``adapters.jax.flax_model``). Not collected by the main suite (its name does not match
test_*.py): tests/adapters/test_jax.py runs it there with ``python -m pytest tests/adapters/jax_suite.py`` and
requires every test to pass."""

import functools

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from adapters.base import DeviceUnavailable
from adapters.declaration import ALL_LAYERS
from adapters.jax import DECLARATION
from adapters.jax.adapter import JaxAdapter
from adapters.jax.neutral import Builder
from adapters.jax.training import next_loss_scale
from harness.neutral import datasets, inputs, models, native
from harness.neutral import precision as loss_scaling
from harness.neutral.info import Input
from harness.plan.support import Conditions, NativeTask, unsupported
from harness.spec import ROOT, ModelSpec, NativeModel, OptimizerSpec
from tests.adapters import kit, loader_checks, loss_runs, reference, scenarios
from tests.adapters.conformance import *  # noqa: F403 (the conformance tests, collected here)
from tests.helpers import run_options


@pytest.fixture(scope="module")
def adapter_cls():
    return JaxAdapter


def test_the_train_step_compiles_once_per_shape():
    """Warm-up must hold the compilation: a second call with the step's own outputs as its state must not compile
    again (an uncommitted PRNG key once made it, and the first timed step then cost a compilation)."""
    adapter, data, _ = kit.make(JaxAdapter)
    for batch in kit.epoch_steps(adapter, kit.batches(len(data.y_train), 32, 5)):
        adapter.train_step(batch)
    kit.step(adapter, np.arange(64), micro_batches=2)
    adapter.read_loss()
    assert adapter.settings().record()["train_step_compilations"] == {"32x1": 1, "64x2": 1}
    assert adapter.compilations() == 2  # what the worker reads after warm-up and at the end


def test_resident_batches_are_made_when_asked_for():
    """Resident mode's ``batches`` makes the epoch's int32 index arrays when it is called, before the epoch's first
    step (outside the timed windows), as copies: an order changed afterwards changes nothing; whole steps only."""
    adapter, data, _ = kit.make(JaxAdapter)
    order = datasets.epoch_order(len(data.y_train), 0, 0)[:100]
    given = order.copy()
    batches = adapter.batches(order, 32, 0)
    order[:] = 0
    made = list(batches)
    assert [b.dtype for b in made] == [np.int32] * 3
    np.testing.assert_array_equal(np.concatenate(made), given[:96])


def test_indices_staged_on_the_device_train_as_numpy_ones():
    """On one device an epoch's step indices go to the device when ``batches`` is called (``Inputs.stage_indices``),
    not to every jitted step as numpy (as over a mesh): its batches are device arrays holding the same indices, and 5
    steps on them give the numpy steps' losses and weights exactly."""
    plain, data, _ = kit.make(JaxAdapter)
    staged, _, _ = kit.make(JaxAdapter)
    assert staged.inputs.stage_indices is True
    plain.inputs.stage_indices = False
    steps = kit.batches(len(data.y_train), 32, 5)
    batches = list(kit.epoch_steps(staged, steps))
    assert all(isinstance(b, jax.Array) and b.dtype == jnp.int32 for b in batches)
    np.testing.assert_array_equal(np.concatenate([np.asarray(b) for b in batches]), np.concatenate(steps))
    losses = {"plain": [], "staged": []}
    for name, adapter, made in (("plain", plain, kit.epoch_steps(plain, steps)), ("staged", staged, batches)):
        for batch in made:
            adapter.train_step(batch)
            losses[name].append(adapter.read_loss()[0])
    assert losses["staged"] == losses["plain"]
    staged_weights, plain_weights = staged.get_weights(), plain.get_weights()
    for name, value in plain_weights.items():
        np.testing.assert_array_equal(staged_weights[name], value, err_msg=name)


def test_the_step_key_is_split_only_where_a_layer_draws_from_it():
    """The jitted step splits its PRNG key for dropout's masks; a model without dropout leaves it alone (the split's
    hash would run every step for nothing: 86 against 64 us a step of a one-layer model at batch 512 on the CPU),
    and the record says which. With dropout the key moves at every step."""
    dropout = ModelSpec.model_validate({"layers": [
        {"type": "flatten"}, {"type": "dense", "units": 32, "activation": "relu"}, {"type": "dropout", "rate": 0.5},
        {"type": "dense", "units": 10}]})
    keys = {}
    for name, model in (("plain", kit.CNN), ("dropout", dropout)):
        adapter, data, _ = kit.make(JaxAdapter, model=model)
        before = np.asarray(adapter.training.key).copy()
        for batch in kit.epoch_steps(adapter, kit.batches(len(data.y_train), 32, 3)):
            adapter.train_step(batch)
        adapter.read_loss()
        keys[name] = (before, np.asarray(adapter.training.key), adapter.settings().record()["step_key"])
    before, after, setting = keys["plain"]
    np.testing.assert_array_equal(after, before)
    assert setting == "not split (nothing draws from it)"
    before, after, setting = keys["dropout"]
    assert not np.array_equal(after, before) and setting.startswith("split every step")


def test_the_epoch_loss_is_every_steps_mean_whatever_the_windows():
    """The loss sum carried through the jitted step: the loop's epoch loss is the mean over every step in fast and
    in slowed windows (``loss_runs``), with gradient accumulation too, and restarting the sum at each read compiles
    nothing new (the worker counts no recompilation)."""
    runs = loss_runs.check_windows_do_not_change_the_loss(JaxAdapter)
    accumulated = loss_runs.loop(JaxAdapter, {"window": 7}, batch=16, accumulation=2)
    assert accumulated["steps"] == [44, 44]
    np.testing.assert_allclose(accumulated["train_loss"], runs["fast"]["train_loss"], rtol=1e-5, atol=0)


class _Counted(inputs.InputSource):
    """An in-memory source that notes each read's epoch in ``reads`` (appended: grain's threads read too)."""

    reads: list[int] = []

    def read(self, indices, epoch):
        self.reads.append(epoch)
        return super().read(indices, epoch)


def test_the_loader_trains_as_resident_mode_does():
    """input: loader through grain (``loader_checks.check``: the parameters and epoch losses of resident mode, with
    0 and 1 reading threads), its pipeline recorded under settings()["loader"]; with gradient accumulation too, the
    loader's step compiled once for two epochs, only the test set placed on the device, and nothing read before an
    epoch's first ``next``."""
    assert loader_checks.check(JaxAdapter, "grain.MapDataset") == {
        "loader": "grain.MapDataset", "num_threads": 1, "prefetch_buffer_size": 2, "device_put_prefetch": 2,
        "source": "memory"}
    data, info = kit.digits()
    runs = {}
    for source in ("resident", "loader"):
        adapter = JaxAdapter(run_options({"input": source, "loader": {"workers": 2, "prefetch": 3}}))
        adapter.prepare("cpu", 1, 0)
        adapter.build_neutral(info, models.initial_weights(info, 0), kit.SGD)
        adapter.load(data)
        if source == "loader":
            assert adapter.inputs.x_train is None and adapter.inputs.y_train is None
            adapter.open_loader(_Counted(data.y_train, data.x_train, augmentation=True, seed=0))
        losses = []
        for epoch in range(2):
            order = datasets.epoch_order(len(data.y_train), 0, epoch)[:5 * 32]
            before = len(_Counted.reads)
            batches = adapter.batches(order, 32, epoch)
            assert len(_Counted.reads) == before  # lazy: the loop times each next, the input's wait
            if source == "resident":
                adapter.set_train_images(datasets.augment(data.x_train, 0, epoch))
            for batch in batches:
                adapter.train_step(batch, micro_batches=2)
            losses.append(adapter.read_loss())
        runs[source] = losses, adapter.get_weights(), adapter.settings().record()
    (losses, weights, settings), (resident_losses, resident, _) = runs["loader"], runs["resident"]
    assert _Counted.reads == [0] * 5 + [1] * 5
    assert [steps for _, steps in losses] == [5, 5]
    np.testing.assert_allclose([loss for loss, _ in losses], [loss for loss, _ in resident_losses], rtol=1e-5)
    for name, value in resident.items():
        np.testing.assert_allclose(weights[name], value, rtol=loader_checks.RTOL, atol=loader_checks.ATOL,
                                   err_msg=name)
    assert settings["train_step_compilations"] == {"32x2 loader": 1}
    assert settings["loader"] == {"loader": "grain.MapDataset", "num_threads": 2, "prefetch_buffer_size": 6,
                                  "device_put_prefetch": 3, "source": "memory"}
    can = DECLARATION.capabilities
    assert can.loader == "grain.MapDataset" and dict(can.loader_modules) == {"grain": "grain"}


def test_oom_is_classified_by_status_and_type():
    adapter = JaxAdapter()
    try:
        jnp.zeros((2**50,), jnp.float32).block_until_ready()  # 4 PiB: XLA's CPU allocator refuses it
    except Exception as exc:  # noqa: BLE001
        assert adapter.is_oom(exc), repr(exc)
        assert "RESOURCE_EXHAUSTED" in str(exc)
    else:
        pytest.fail("an allocation of 4 PiB succeeded")
    assert not adapter.is_oom(ValueError("RESOURCE_EXHAUSTED"))  # a message alone does not make an OOM
    assert not adapter.is_oom(RuntimeError("out of memory"))


def test_memory_settings_are_recorded():
    adapter, _, _ = kit.make(JaxAdapter)
    settings = adapter.settings().record()
    assert settings["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and settings["matmul_precision"] == "highest"
    assert settings["allocator_peak"] == "since the worker started (JAX cannot reset it)"
    assert adapter.memory_stats() == {}  # the CPU backend keeps no allocator statistics
    assert jax.config.jax_default_matmul_precision == "highest"


def test_a_gpu_is_unavailable_here():
    with pytest.raises(DeviceUnavailable):
        JaxAdapter().prepare("cuda:0", 1, 0)


def test_the_builder_builds_every_declared_layer_kind():
    """The neutral builder has a ``visit_<kind>`` for every layer kind the declaration names (its options, such as
    conv2d.stride, are the layer's own), and for no other."""
    assert Builder.kinds() == {kind for kind in DECLARATION.capabilities.layers if "." not in kind}
    assert DECLARATION.capabilities.layers == ALL_LAYERS


# ----------------------------------------------------------------------------------------------- precision and mode
# Tolerances of bf16 against exact arithmetic, derived from its mantissa: bfloat16 keeps 8 significant bits (7 stored
# and the implicit one), so rounding to the nearest bfloat16 changes a value by at most u = 2 ** -8 of itself. To
# first order the relative perturbations of a chain of operations add up, so a model's bf16 logits are within
# ROUNDINGS x u of their scale (the largest |logit|; a logit near zero has no relative accuracy of its own), where
# ROUNDINGS counts the roundings to bfloat16 on the model's longest path: 3 per conv or dense layer (its input, its
# weight, its output) and 1 per other op whose bfloat16 result is rounded.
BF16_U = 2.0 ** -8
ROUNDINGS = {
    "cnn": 3 * 3,  # conv, dense, dense
    "resnet": 5 * 3,  # the stem conv, one conv in the first block, two in the second, the dense layer
    # the embedding's output 1; per block (2): in-projection 3, the softmax's probabilities 1, the value product's
    # output 1, the out-projection's weight and output 2, the residual sum 1, dense 3, gelu's output 1, the second
    # dense's weight and output 2, the residual sum 1 (15); the last dense layer 3
    "decoder": 1 + 2 * 15 + 3,
}
# Training: a gradient has the forward pass's roundings and, per conv or dense layer, three more in the backward pass
# (the incoming cotangent, the weight gradient, the input gradient): 9 + 9 for the CNN. Each SGD step's update is
# then within TRAIN_ROUNDINGS x u of fp32's, so with a learning rate small enough that the runs do not diverge
# (0.02: the loss falls without jumps) each parameter array after n steps is within TRAIN_ROUNDINGS x u of the
# length of the path fp32's run took (the sum of its n steps' norms), in norm; the losses within that relative.
TRAIN_ROUNDINGS = 9 + 9
PLAIN_SGD = OptimizerSpec(name="sgd", learning_rate=0.02)


def _built(precision: str, model=kit.CNN, cfg=None, weights=None, optimizer=kit.SGD):
    """A JAX adapter on the CPU made with ``precision`` (as the worker makes it), built and loaded: the digits with
    ``model``, or the dataset ``cfg``; ``weights(info)`` or the canonical initial weights."""
    cls = kit.configured(JaxAdapter, precision=precision, compile="compiled")
    if cfg is None:
        data, info = kit.digits(model)
        adapter = kit.make(cls, model=model, optimizer=optimizer, weights=None if weights is None else weights(info))[0]
        return adapter, data, info
    info = models.analyze(model, *datasets.describe_input(cfg))
    adapter, data, _ = scenarios.make_on(cls, model, cfg, optimizer, None if weights is None else weights(info))
    return adapter, data, info


def _products(adapter) -> list:
    """Every dot_general and conv_general_dilated of the traced train step (forward and backward), nested jaxprs
    included."""
    training = adapter.training
    state = (training.params, training.opt_state, training.stats, training.key, training.scaler)
    closed = jax.make_jaxpr(functools.partial(training._summed_step, 1))(
        state, jnp.zeros((), jnp.float32), adapter.inputs.x_train, adapter.inputs.y_train,
        np.arange(16, dtype=np.int32))
    found, todo = [], [closed.jaxpr]
    while todo:
        for eqn in todo.pop().eqns:
            if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
                found.append(eqn)
            for value in eqn.params.values():
                for item in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(item, (jax_core.Jaxpr, jax_core.ClosedJaxpr)):
                        todo.append(getattr(item, "jaxpr", item))
    return found


def test_execution_modes_and_precisions_are_declared():
    """One mode, compiled (the default); fp32 and bf16 everywhere, tf32 and fp16 on CUDA GPUs only: the plan's rule
    from the declaration (``harness.plan.support``)."""
    can = JaxAdapter.declaration.capabilities
    assert can.default_compile == "compiled" and list(DECLARATION.capabilities.compile_modes) == ["compiled"]
    assert JaxAdapter(run_options({"compile": "default"})).mode == "compiled"
    runs = [("bf16", "cpu"), ("fp32", "cpu"), ("fp16", "cuda:0"), ("tf32", "cuda"), ("bf16", "cuda")]
    kit.check_execution_declared("jax", [(p, mode, d) for p, d in runs for mode in ("compiled", "default")], {
        ("fp16", "default", "cpu"): "the jax adapter does not train in fp16 on cpu (only on cuda): fp16 with "
                                    "dynamic loss scaling is declared for CUDA GPUs only",
        ("bf16", "eager", "cpu"): "the jax adapter has no eager mode (its modes: compiled)",
        ("tf32", "default", "cpu"): "the jax adapter does not train in tf32 on cpu (only on cuda)"})


def test_bf16_logits_are_the_float64_reference_within_bf16_rounding():
    """The digits CNN (canonical weights) and the block models (perturbed weights and running statistics, batchnorm
    and layernorm in float32): |logits - reference| <= ROUNDINGS x u x max |reference|, float32 logits, float32
    parameters. Observed, in units of u: CNN 0.90 (bound 9), ResNet 0.45 (15), decoder 5.6 (34)."""
    cases = [("cnn", kit.CNN, None, None)] + [(name, model, cfg, scenarios.perturbed)
                                              for name, (model, cfg) in scenarios.BLOCK_MODELS.items()]
    assert float(jnp.finfo(jnp.bfloat16).eps) / 2 == BF16_U  # eps = 2 ** -7, the spacing above 1
    for name, model, cfg, weights in cases:
        adapter, data, info = _built("bf16", model, cfg, weights)
        inputs = data.x_test[:256]
        expected = reference.forward(info, {**adapter.get_weights(), **adapter.get_buffers()}, inputs)
        logits = adapter.predict(inputs)
        assert logits.dtype == np.float32
        leaves = jax.tree_util.tree_leaves((adapter.training.params, adapter.training.stats))
        assert {str(leaf.dtype) for leaf in leaves} == {"float32"}
        scale = np.abs(expected).max()
        np.testing.assert_allclose(logits, expected, rtol=0, atol=ROUNDINGS[name] * BF16_U * scale, err_msg=name)


def test_bf16_trains_float32_master_weights_within_bf16_rounding_of_fp32():
    """10 plain SGD steps in bf16 and in fp32 from the same weights: bf16's loss falls, its parameters and optimizer
    state stay float32, and each array is within TRAIN_ROUNDINGS x u of fp32's path length of fp32's (observed:
    at most 6.3 u of 18), the losses within TRAIN_ROUNDINGS x u relative (observed 0.8 u)."""
    runs = {}
    for precision in ("bf16", "fp32"):
        adapter, data, _ = _built(precision, optimizer=PLAIN_SGD)
        runs[precision] = kit.train_on(adapter, kit.batches(len(data.y_train), 32, 10), keep=tuple(range(11)))
        leaves = jax.tree_util.tree_leaves((adapter.training.params, adapter.training.opt_state))
        assert {str(leaf.dtype) for leaf in leaves if jnp.issubdtype(leaf.dtype, jnp.floating)} == {"float32"}
    (losses, bf16), (fp32_losses, fp32) = runs["bf16"], runs["fp32"]
    assert losses[-1] < 0.7 * losses[0], losses
    np.testing.assert_allclose(losses, fp32_losses, rtol=TRAIN_ROUNDINGS * BF16_U)
    for name in fp32[10]:
        path = sum(np.linalg.norm(fp32[i + 1][name] - fp32[i][name]) for i in range(10))
        assert np.linalg.norm(bf16[10][name] - fp32[10][name]) <= TRAIN_ROUNDINGS * BF16_U * path, name
    assert kit.max_differences(bf16[10], fp32[10])[0] > 1e-4  # not the fp32 run itself


def test_each_precision_computes_every_product_as_declared():
    """Every conv and matrix product of the traced train step, forward and backward: fp32 float32 at HIGHEST, tf32
    float32 at DEFAULT (TF32 on NVIDIA GPUs), bf16 and fp16 with 16-bit operands (or, in attention, the 16-bit
    algorithm that ``jax.nn.dot_product_attention`` names); bf16's logits differ from fp32's by far more than
    float32 rounding; the settings record it all."""
    algorithms = {"bf16": lax.DotAlgorithmPreset.BF16_BF16_F32, "fp16": lax.DotAlgorithmPreset.F16_F16_F32}
    expected = {"fp32": ("float32", "highest"), "tf32": ("float32", "default"), "bf16": ("bfloat16", "default"),
                "fp16": ("float16", "default")}
    for precision, (dtype, dot) in expected.items():
        for model, cfg in [(kit.CNN, None), scenarios.BLOCK_MODELS["decoder"]]:
            adapter = _built(precision, model, cfg)[0]
            products = _products(adapter)
            assert len(products) >= 8
            for eqn in products:
                operands = {str(v.aval.dtype) for v in eqn.invars}
                given = eqn.params["precision"]
                if isinstance(given, lax.DotAlgorithmPreset):
                    assert given == algorithms.get(precision), (precision, eqn)
                else:
                    assert operands == {dtype} and given == (lax.Precision(dot),) * 2, (precision, eqn)
        settings = adapter.settings().record()
        assert (settings["precision"], settings["compute_dtype"], settings["matmul_precision"]) == (precision, dtype,
                                                                                                    dot)
        assert ("loss_scale" in settings) == (precision == "fp16")
        assert ("master_weights" in settings) == (dtype != "float32")
        assert jax.config.jax_default_matmul_precision == dot
    bf16, data, _ = _built("bf16")
    fp32 = _built("fp32")[0]
    gap = np.abs(bf16.predict(data.x_test) - fp32.predict(data.x_test)).max()
    assert gap > 1e-4 * np.abs(fp32.predict(data.x_test)).max(), gap  # fp32 against float64: 4e-7 of the scale


def test_the_loss_scale_rule_is_the_shared_one():
    """The jnp rule traced into the step (``training.next_loss_scale``) is ``harness.neutral.precision``'s: the same
    (scale, count) after finite and non-finite steps, below, at and past the growth threshold."""
    for scale, good, finite in [(2.0 ** 16, 0, True), (2.0 ** 16, 0, False), (1024.0, 1998, True),
                                (1024.0, loss_scaling.LOSS_SCALE_GROWTH_STEPS - 1, True), (1024.0, 1999, False),
                                (loss_scaling.LOSS_SCALE_INIT, 7, True)]:
        got = next_loss_scale(jnp.asarray(scale, jnp.float32), jnp.asarray(good, jnp.int32), jnp.asarray(finite))
        assert (float(got[0]), int(got[1])) == loss_scaling.next_loss_scale(scale, good, finite), (scale, good, finite)
        assert got[1].dtype == jnp.int32


def test_fp16_dynamic_loss_scaling_on_the_cpu():
    """fp16 is for GPUs, but XLA computes float16 on the CPU too, so the loss scaling runs here: 10 steps train with
    float32 master weights from the shared initial scale; a scale that overflows float16's gradients skips the step
    (parameters and optimizer state unchanged) and halves it; the 2000th finite step in a row doubles it; each finite
    step counts one."""
    adapter, data, _ = _built("fp16", optimizer=OptimizerSpec(name="sgd", learning_rate=0.02, momentum=0.9))
    training = adapter.training
    assert float(training.scaler[0]) == loss_scaling.LOSS_SCALE_INIT and int(training.scaler[1]) == 0
    steps = kit.batches(len(data.y_train), 32, 12)
    losses = kit.train_on(adapter, steps[:10])[0]
    assert np.isfinite(losses).all() and losses[-1] < 0.7 * losses[0], losses
    assert {str(leaf.dtype) for leaf in jax.tree_util.tree_leaves(training.params)} == {"float32"}

    def scaler(scale: float, count: int):
        return training.put((jnp.asarray(scale, jnp.float32), jnp.asarray(count, jnp.int32)))
    training.scaler = scaler(2.0 ** 40, 7)
    before = jax.tree_util.tree_map(np.asarray, (training.params, training.opt_state))
    kit.step(adapter, steps[10])
    adapter.read_loss()
    after = jax.tree_util.tree_map(np.asarray, (training.params, training.opt_state))
    leaves = zip(jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(before))
    assert all(np.array_equal(new, old) for new, old in leaves)
    assert (float(training.scaler[0]), int(training.scaler[1])) == (2.0 ** 39, 0)
    training.scaler = scaler(1024.0, 1998)
    kit.step(adapter, steps[11])
    assert (float(training.scaler[0]), int(training.scaler[1])) == (1024.0, 1999)
    kit.step(adapter, steps[0])
    assert (float(training.scaler[0]), int(training.scaler[1])) == (2048.0, 0)
    settings = adapter.settings().record()
    assert settings["loss_scale"] == 2048.0 and settings["loss_scale_init"] == loss_scaling.LOSS_SCALE_INIT
    assert settings["loss_scale_growth_steps"] == loss_scaling.LOSS_SCALE_GROWTH_STEPS
    assert settings["train_step_compilations"] == {"32x1": 1}


# ------------------------------------------------------------------------------------------------- a model of your own
def _native(model, seed: int = 0, optimizer=kit.SGD):
    """An fp32 adapter on the CPU that adopted ``model`` (a Flax module) for the digits as the worker does (prepare,
    native_model, build, load), and the data."""
    data, _ = kit.digits()
    adapter = JaxAdapter()
    adapter.prepare("cpu", 2, seed)
    source = native.NativeSource("tests:model", Input.images(data.x_train.shape[1:]), data.num_classes, seed)
    adapter.build(adapter.native_model(model, source), "image_classification", optimizer)
    adapter.load(data)
    return adapter, data


def test_a_flax_linen_cnn_of_your_own_learns_digits_and_counts_its_flops():
    """specs/models.py's flax_cnn (``native.make``): the PyTorch CNN's 38,346 parameters; 3 epochs of batch 32 reach
    > 90 % (Flax's batchnorm momentum, 0.99, makes the running statistics lag: 87 % after 2 epochs); the running
    statistics moved and ``evaluate``/``predict`` use them: the module's own ``apply(train=False)`` with the trained
    variables gives the same logits, its training mode (the batch's moments) others.

    FLOPs: XLA's cost analysis of the step against 3 x 2 x the forward multiply-adds (698,112). XLA counts only the
    taps of a padded conv's window inside the input (0.84 and 0.69 of the windows of the 8x8 and 4x4 convs), no input
    gradient for the first conv, and adds the elementwise ops and the optimizer's update: the padding-aware count
    without that gradient is 0.77 of the analytic, observed 0.82. The bounds fail a count per batch (x 32), of the
    forward pass only (/ 3) or with the padding counted."""
    adapter, data = _native(native.make(NativeModel(factory=f"{ROOT / 'specs' / 'models.py'}:flax_cnn")))
    assert sum(w.size for w in adapter.get_weights().values()) == \
        (9 * 16 + 16) + (9 * 16 * 32 + 32) + 2 * 32 + (512 * 64 + 64) + (64 * 10 + 10) == 38346
    epoch_losses = kit.train_epochs(adapter, data, epochs=3, batch_size=32)
    loss, accuracy = adapter.evaluate(256)
    assert epoch_losses[-1] < 0.3 * epoch_losses[0] and accuracy > 0.9, (epoch_losses, accuracy)
    mean = adapter.get_buffers()["['batch_stats']['BatchNorm_0']['mean']"]
    assert np.abs(mean).max() > 0.05 and len(adapter.get_buffers()) == 2  # mean and var, from zeros and ones
    training, x = adapter.training, jnp.asarray(data.x_test)
    variables = {"params": training.params, **training.stats}
    module = native.make(NativeModel(factory=f"{ROOT / 'specs' / 'models.py'}:flax_cnn"))
    own = np.asarray(module.apply(variables, x, train=False))
    np.testing.assert_allclose(adapter.predict(data.x_test), own, rtol=1e-5, atol=1e-5)
    assert accuracy == float(np.mean(own.argmax(-1) == data.y_test))
    assert np.abs(module.apply(variables, x, train=True, mutable=["batch_stats"])[0] - own).max() > 1e-2
    flops, source = adapter.train_flops_per_sample()
    analytic = 3 * 2 * (8 * 8 * 16 * 9 + 4 * 4 * 32 * 9 * 16 + 512 * 64 + 64 * 10)
    assert source == "XLA's cost analysis of the compiled train step" and 0.75 <= flops / analytic <= 0.95, flops
    assert adapter.settings().record()["train_step_compilations"] == {"32x1": 1}  # the analysis compiled aside


def test_only_a_flax_module_it_can_train_is_adopted():
    """Anything but a linen or nnx module is refused (NativeModelError, field ``model``), as is a linen module with
    batch statistics whose ``__call__`` takes no training flag; a flagless one without them is adopted (called with
    the input alone), its parameters drawn from the trial's seed (the same seed, the same; another, others). The
    plan refuses bf16, fp16 and synchronised batchnorm for a model of your own, and allows fp32 and tf32."""
    from flax import linen as nn

    class Flagless(nn.Module):
        norm: bool

        @nn.compact
        def __call__(self, x):
            x = x.reshape(x.shape[0], -1)
            return nn.Dense(10)(nn.BatchNorm(use_running_average=False)(x) if self.norm else x)

    for made, message in [
            (object(), r"tests:model returned a builtins\.object, not a flax\.linen\.Module or flax\.nnx\.Module$"),
            (Flagless(norm=True), r"has batch statistics but its __call__ takes no train or deterministic argument")]:
        with pytest.raises(native.NativeModelError, match=message) as caught:
            _native(made)
        assert caught.value.field == "model"
    draws = [_native(Flagless(norm=False), seed)[0] for seed in (0, 0, 1)]
    assert draws[0].predict(np.zeros((2, 8, 8, 1), np.float32)).shape == (2, 10)
    first, same, other = (a.get_weights()["['Dense_0']['kernel']"] for a in draws)
    assert np.array_equal(first, same) and not np.allclose(first, other)
    assert draws[0].settings().record()["native_training_flag"] == "__call__(x): the module has no training flag"
    task = NativeTask("image_classification")
    assert unsupported(DECLARATION, task) is None and unsupported(DECLARATION, task,
                                                                  Conditions("tf32", device="cuda")) is None
    for precision in ("bf16", "fp16"):
        assert f"cannot impose {precision}" in unsupported(DECLARATION, task, Conditions(precision, device="cuda:0"))
    assert "axis_name" in unsupported(DECLARATION, task, Conditions(data_parallel=2, sync_batchnorm=True))
    assert unsupported(DECLARATION, task, Conditions(data_parallel=2)) is None


def test_an_nnx_module_of_your_own_trains_in_its_own_train_and_eval_modes():
    """An nnx CNN with batchnorm and dropout: one epoch of Adam makes its loss fall; in training the step's key draws
    the dropout masks (two keys, two outputs; one key, the same), in inference the logits are the module's own in
    ``eval()`` mode with the trained parameters and running statistics."""
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, rngs):
            self.conv, self.norm = nnx.Conv(1, 8, (3, 3), rngs=rngs), nnx.BatchNorm(8, rngs=rngs)
            self.drop, self.out = nnx.Dropout(0.3, rngs=rngs), nnx.Linear(8 * 8 * 8, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(self.drop(nnx.relu(self.norm(self.conv(x)))).reshape(x.shape[0], -1))

    module = CNN(nnx.Rngs(0))
    adapter, data = _native(module, optimizer=OptimizerSpec(name="adam", learning_rate=0.01))
    loss0, _ = adapter.evaluate(256)
    kit.train_epochs(adapter, data, epochs=1, batch_size=32)
    loss1, accuracy = adapter.evaluate(256)
    assert loss1 < 0.3 * loss0 and accuracy > 0.85, (loss0, loss1, accuracy)
    assert sorted(adapter.get_buffers()) == ["['norm']['mean']", "['norm']['var']"]
    training, x = adapter.training, jnp.asarray(data.x_test[:64])
    apply = jax.jit(lambda key: training.apply(training.params, training.stats, x, True, key)[0])
    one, again, other = (np.asarray(apply(jax.random.PRNGKey(seed))) for seed in (1, 1, 2))
    assert np.array_equal(one, again) and not np.allclose(one, other)
    graph, params, stats, rest = nnx.split(module, nnx.Param, nnx.BatchStat, ...)
    nnx.replace_by_pure_dict(params, jax.device_get(training.params))
    nnx.replace_by_pure_dict(stats, jax.device_get(training.stats))
    trained = nnx.merge(graph, params, stats, rest)
    trained.eval()
    np.testing.assert_allclose(adapter.predict(data.x_test[:64]), np.asarray(trained(x)), rtol=1e-5, atol=1e-5)
    assert adapter.settings().record()["native_api"] == "flax.nnx"
