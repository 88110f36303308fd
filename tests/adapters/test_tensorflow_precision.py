"""TensorFlow's execution modes and precisions, trained for real on the CPU.

Compiled (``tf.function(jit_compile=True)``: XLA) against the default eager mode (the same ``tf.function`` graphs
without XLA) in fp32: the logits of the digits CNN, the narrow ResNet and the causal decoder, and every parameter and
buffer after 1 and 10 SGD-momentum steps, within the equivalence tests' fp32 tolerance |a - b| <= 1e-5 + 1e-4 |b|
(observed on this CPU: logits within 4.3e-6, arrays within 6.0e-7 after 10 steps, the losses within 2.0e-7
relative), and XLA really compiled what ran (the step's concrete function carries ``_XlaMustCompile``; TF gives the
HLO of a function only when XLA compiles it).

bf16 (mixed precision, float32 variables): the logits against the float64 reference (``reference.forward``) from
perturbed weights within the project's derived bound ``scenarios.bf16_tolerance`` = T: 2 u per low-precision matrix
product on the way (u = 2^-8, bf16's unit roundoff: 8 significant bits; each product rounds both operands), relative
to max |logits|. Bounds and observed errors (eager / XLA): digits CNN T = 2.3e-2, observed 1.1e-2 / 4.6e-3; ResNet
4.7e-2, 4.1e-3 / 1.8e-3; decoder 0.10, 3.4e-2 / 2.6e-2 (fp32: 1e-6 or less). TF's eager bf16 kernels on a CPU
without AVX512-BF16 round more than the bound's model counts (activations are stored in bf16 between layers, and
one eager 64x512 @ 512x128 bf16 matmul of bf16-exact operands is off by 5.5e-3 of its largest output, 1.4 u, against
2.7e-3 under XLA: partial sums are rounded), which is why eager sits nearer the bound; it holds with a margin of 2.

bf16 training, 10 SGD-momentum steps from the fp32 run's start on its batches: the bound on the norm-wise distance
||bf16 - fp32|| over every parameter and buffer after 10 steps is derived the same way. A gradient carries the forward
pass's error (T) and the backward pass's own (the same products transposed, each rounding its two operands again:
T), so each step's update is off by at most 2 T of its size, and over the steps those differences add up to at most
2 T x the fp32 run's path length (the sum of its steps' norms); doubled for the feedback (the bf16 run's gradients are
taken at its own, slightly different, weights): 4 T x path. Observed distance / path: digits CNN 0.041 (bound 0.094;
after 1 step 0.017, under 2 T = 0.047: the growth is the feedback), ResNet 0.046 (0.19), decoder 0.016 (0.41). The
losses: within 4.6 % (digits CNN, whose loss first climbs to 6 at this learning rate), 0.5 % and 0.3 % of fp32's.

fp16 needs a GPU in the harness (the declaration's ``precisions``); its dynamic loss scaling is exercised here on the
CPU, where TensorFlow's float16 kernels run too: the scale grows after its run of finite steps, and a step whose
gradients overflow is skipped with the scale halved, by the harness's rule (``harness.neutral.precision``).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tensorflow as tf

from adapters.declaration import BOTH, CUDA
from adapters.tensorflow.adapter import TensorFlowAdapter
from adapters.tensorflow.optimizer import DynamicLossScale
from harness.neutral import datasets, models, precision
from tests.adapters import kit, reference, scenarios

MODELS = ["digits", *scenarios.BLOCK_MODELS]
STEPS = (1, 10)
#: Op types that are matrix products (forward and gradient), which mixed precision runs in the low precision.
PRODUCTS = {"Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "MatMul", "BatchMatMulV2", "Einsum"}
#: Op types that the policy keeps in float32.
FLOAT32_OPS = {"FusedBatchNormV3", "FusedBatchNormGradV3", "Softmax", "SparseSoftmaxCrossEntropyWithLogits"}


def configured(precision: str = "fp32", compile: str = "eager") -> type[TensorFlowAdapter]:
    """The adapter class made with these options (``kit.configured``)."""
    return kit.configured(TensorFlowAdapter, precision=precision, compile=compile)


def _setup(name: str, adapter_cls: type[TensorFlowAdapter], weights=None):
    """(adapter, data, info, batch size): the digits CNN (``kit.SGD``: learning rate 0.05, momentum 0.9; batch 32)
    or a block model (SGD-momentum, batch 16), prepared, built and loaded on the CPU."""
    if name == "digits":
        return (*kit.make(adapter_cls, weights=weights), 32)
    model, cfg = scenarios.BLOCK_MODELS[name]
    return (*scenarios.make_on(adapter_cls, model, cfg, scenarios.BLOCK_OPTIMIZERS["sgd-momentum"], weights), 16)


def _info(name: str):
    if name == "digits":
        return kit.digits()[1]
    model, cfg = scenarios.BLOCK_MODELS[name]
    return models.analyze(model, *datasets.describe_input(cfg))


@functools.cache
def logits_run(name: str, precision: str, mode: str) -> tuple[TensorFlowAdapter, np.ndarray, np.ndarray]:
    """(adapter, its float32 test logits, the float64 reference's) from ``scenarios.perturbed`` weights (every
    parameter and buffer away from its trivial start)."""
    weights = scenarios.perturbed(_info(name))
    adapter, data, info, _ = _setup(name, configured(precision, mode), weights)
    return adapter, adapter.predict(data.x_test), reference.forward(info, weights, data.x_test)


@functools.cache
def training_run(name: str, precision: str, mode: str):
    """(adapter, losses, the state kept before and after every step, the steps' indices): 10 steps from the
    canonical initial weights on the first epoch's batches, staged as the harness does (one ``batches`` call)."""
    adapter, data, _, batch = _setup(name, configured(precision, mode))
    order = datasets.epoch_order(len(data.y_train), 0, 0)
    steps = [order[i * batch:(i + 1) * batch] for i in range(max(STEPS))]
    losses, kept = kit.train_on(adapter, steps, keep=tuple(range(max(STEPS) + 1)))
    return adapter, losses, kept, steps


def _graph_ops(adapter: TensorFlowAdapter, batch: int) -> list[tf.Operation]:
    return adapter.training.calls[(batch, 1)].graph.get_operations()


def _dtype(op: tf.Operation) -> tf.DType:
    return op.get_attr("T")


# --- compiled (XLA) against eager, fp32 -------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_compiled_gives_the_eager_logits_and_is_compiled_by_xla(name):
    eager, logits, _ = logits_run(name, "fp32", "eager")
    compiled, xla_logits, _ = logits_run(name, "fp32", "compiled")
    np.testing.assert_allclose(xla_logits, logits, rtol=1e-4, atol=1e-5)
    x = compiled.inputs.x_test[:4]
    assert compiled.training.logits_fn.experimental_get_compiler_ir(x)(stage="hlo").startswith("HloModule")
    with pytest.raises(ValueError, match="jit_compile"):  # TF refuses it for a function that XLA does not compile
        eager.training.logits_fn.experimental_get_compiler_ir(x)(stage="hlo")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("step", STEPS)
def test_compiled_trains_like_eager(name, step):
    """Every parameter and buffer after ``step`` steps and every loss; the compiled step is XLA's (the concrete
    function the step calls must be compiled whole), traced once."""
    eager, losses, kept, _ = training_run(name, "fp32", "eager")
    compiled, xla_losses, xla_kept, steps = training_run(name, "fp32", "compiled")
    np.testing.assert_allclose(xla_losses, losses, rtol=1e-5)
    assert sorted(xla_kept[step]) == sorted(kept[step])
    for key, value in kept[step].items():
        np.testing.assert_allclose(xla_kept[step][key], value, rtol=1e-4, atol=1e-5, err_msg=f"{key} @ {step}")
        if step == 10 and key.endswith(".weight"):
            assert np.abs(value - kept[0][key]).max() > 1e-4, f"{key} did not move"
    key = (len(steps[0]), 1)
    assert compiled.training.calls[key].function_def.attr["_XlaMustCompile"].b
    assert not eager.training.calls[key].function_def.attr["_XlaMustCompile"].b
    assert compiled.training.functions[key].experimental_get_tracing_count() == 1
    assert compiled.compilations() == 1 and eager.compilations() == 1  # what the worker reads
    settings = compiled.settings().record()
    assert settings["jit_compile"] and settings["compile"] == "compiled"


def test_compiled_gradient_accumulation_equals_eager():
    """The accumulation loop (``tf.while_loop`` over 4 micro-batches) compiles too, and gives eager's step."""
    kept = {}
    for mode in ("eager", "compiled"):
        adapter, data, _ = kit.make(configured(compile=mode))
        kept[mode] = kit.train_on(adapter, kit.batches(len(data.y_train), 32, 2), keep=(2,), micro_batches=4)
    np.testing.assert_allclose(kept["compiled"][0], kept["eager"][0], rtol=1e-5)
    for key, value in kept["eager"][1][2].items():
        np.testing.assert_allclose(kept["compiled"][1][2][key], value, rtol=1e-4, atol=1e-5, err_msg=key)


# --- bf16 ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "mode"), [*[(name, "eager") for name in MODELS], ("digits", "compiled")])
def test_bf16_logits_are_the_reference_within_the_derived_bound(name, mode):
    """bf16 in both modes (XLA for the digits CNN only, for time: compiling the block models takes seconds each; the
    figures in the module docstring for them were measured once)."""
    _, logits, exact = logits_run(name, "bf16", mode)
    error = scenarios.assert_bf16_close(logits, exact, _info(name))
    fp32_error = float(np.abs(logits_run(name, "fp32", mode)[1] - exact).max() / np.abs(exact).max())
    assert fp32_error < 2e-6 and error > 1e-4, (fp32_error, error)  # bf16 was used: far above fp32's agreement
    assert logits.dtype == np.float32


@pytest.mark.parametrize("name", MODELS)
def test_bf16_runs_the_products_in_bf16_and_keeps_float32_variables(name):
    """In the traced train step every matrix product (forward and gradient) is bfloat16, batchnorm, softmax and the
    loss float32; every variable (the adapter's and Keras's), every parameter and buffer it reports, float32."""
    adapter, _, _, steps = training_run(name, "bf16", "eager")
    ops = _graph_ops(adapter, len(steps[0]))
    products = [op for op in ops if op.type in PRODUCTS]
    assert products and {_dtype(op) for op in products} == {tf.bfloat16}, {(op.type, _dtype(op)) for op in products}
    kept_float32 = [op for op in ops if op.type in FLOAT32_OPS]
    assert {_dtype(op) for op in kept_float32} == {tf.float32}
    assert {op.type for op in kept_float32} >= {"SparseSoftmaxCrossEntropyWithLogits"}
    if name == "resnet":
        assert {"FusedBatchNormV3", "FusedBatchNormGradV3"} <= {op.type for op in kept_float32}
    if name == "decoder":
        assert "Softmax" in {op.type for op in kept_float32}  # attention's, inside Keras's layer
    assert {v.dtype for v in adapter.training.variables} == {tf.float32}
    state = {**adapter.get_weights(), **adapter.get_buffers()}
    assert {v.dtype for v in state.values()} == {np.dtype(np.float32)}
    settings = adapter.settings().record()
    assert settings["precision"] == "bf16" and settings["compute_dtype"] == "bfloat16"


@pytest.mark.parametrize("name", MODELS)
def test_bf16_trains_near_the_fp32_run(name):
    """The loss falls, and after 10 steps ||bf16 - fp32|| over every parameter and buffer is within 4 T x the fp32
    run's path length (the module docstring's derivation)."""
    fp32_kept = training_run(name, "fp32", "eager")[2]
    _, losses, kept, _ = training_run(name, "bf16", "eager")
    assert np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0], losses

    def flat(state: dict[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([state[key].ravel() for key in sorted(state)]).astype(np.float64)

    path = sum(np.linalg.norm(flat(fp32_kept[t]) - flat(fp32_kept[t - 1])) for t in range(1, 11))
    distance = np.linalg.norm(flat(kept[10]) - flat(fp32_kept[10]))
    bound = 4 * scenarios.bf16_tolerance(_info(name)) * path
    assert 1e-6 * path < distance <= bound, (distance / path, bound / path)


# --- fp16's loss scaling, tf32, settings, refusals ----------------------------------------------------------------


def test_fp16_loss_scaling_grows_skips_and_halves():
    """fp16 (a GPU precision in the harness; TF's float16 kernels run on the CPU too): float16 products, float32
    logits; with a growth interval of 2 the scale doubles after 2 finite steps (2^12 -> 2^13); a scale that makes
    the scaled loss overflow skips the step (every parameter unchanged) and halves; accumulation applies it too."""
    adapter, data, _ = kit.make(configured("fp16"))
    adapter.training.loss_scale.growth_steps = 2  # read when the step is traced, at its first call
    first, second, third, fourth = kit.batches(len(data.y_train), 32, 4)
    assert float(adapter.training.loss_scale.scale.numpy()) == precision.LOSS_SCALE_INIT == 2.0 ** 16  # PyTorch's
    adapter.training.loss_scale.scale.assign(2.0 ** 12)  # low enough that this model's first steps stay finite
    kit.train_on(adapter, [first, second])
    assert float(adapter.training.loss_scale.scale.numpy()) == 2.0 ** 13
    assert int(adapter.training.loss_scale.good_steps.numpy()) == 0
    ops = _graph_ops(adapter, 32)
    assert {_dtype(op) for op in ops if op.type in PRODUCTS} == {tf.float16}
    assert adapter.predict(data.x_test[:4]).dtype == np.float32
    before = adapter.get_weights()
    adapter.training.loss_scale.scale.assign(3e38)  # loss x scale is inf in float32
    losses, _ = kit.train_on(adapter, [third])
    assert np.isfinite(losses).all()  # the unscaled loss is reported
    for key, value in adapter.get_weights().items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)
    assert float(adapter.training.loss_scale.scale.numpy()) == np.float32(1.5e38)
    assert adapter.settings().record()["loss_scale"] == float(np.float32(1.5e38))
    adapter.training.loss_scale.scale.assign(2.0 ** 10)
    kit.train_on(adapter, [fourth], micro_batches=2)
    assert max(np.abs(value - before[key]).max() for key, value in adapter.get_weights().items()) > 1e-4
    assert int(adapter.training.loss_scale.good_steps.numpy()) == 1


def test_loss_scale_follows_the_harness_rule(monkeypatch):
    """``DynamicLossScale.apply`` moves the scale and its count as ``harness.neutral.precision.next_loss_scale`` does,
    step for step, over finite and non-finite gradients and across two growths (a growth interval of 3 for both,
    instead of ``LOSS_SCALE_GROWTH_STEPS``, the default, to reach them), and updates only on finite gradients."""
    assert DynamicLossScale().growth_steps == precision.LOSS_SCALE_GROWTH_STEPS
    monkeypatch.setattr(precision, "LOSS_SCALE_GROWTH_STEPS", 3)
    scale, updates = DynamicLossScale(growth_steps=3), []
    expected = (precision.LOSS_SCALE_INIT, 0)
    pattern = (True, True, False, True, True, True, True, False, False, True, True, True)
    for finite in pattern:
        grads = [tf.constant([1.0, 2.0]), tf.constant([3.0 if finite else np.inf])]
        scale.apply(grads, lambda g: updates.append(len(g)))
        expected = precision.next_loss_scale(*expected, finite)
        assert (float(scale.scale.numpy()), int(scale.good_steps.numpy())) == expected, finite
    assert expected == (precision.LOSS_SCALE_INIT * 2 ** 2 * 2 ** -3, 0)  # two growths, three backoffs
    assert len(updates) == sum(pattern)


def test_settings_record_precision_and_mode():
    plain = kit.make(TensorFlowAdapter)[0]  # no options: an fp32 run in the declaration's mode
    assert {k: plain.settings().record()[k] for k in ("precision", "compute_dtype", "compile", "jit_compile")} == {
        "precision": "fp32", "compute_dtype": "float32", "compile": "eager", "jit_compile": False}
    assert "loss_scale" not in plain.settings().record()
    adapter = logits_run("digits", "bf16", "compiled")[0]
    assert {k: adapter.settings().record()[k] for k in ("precision", "compute_dtype", "compile", "jit_compile")} == {
        "precision": "bf16", "compute_dtype": "bfloat16", "compile": "compiled", "jit_compile": True}


def test_what_it_cannot_run_is_refused_with_a_reason():
    declaration = TensorFlowAdapter.declaration
    can = declaration.capabilities
    assert can.precisions == {"fp32": BOTH, "tf32": CUDA, "bf16": BOTH, "fp16": CUDA}
    assert set(can.compile_modes) == {"eager", "compiled"} and can.default_compile == "eager"
    kit.check_execution_declared("tensorflow", [("bf16", "compiled", "cpu"), ("bf16", "default", "cpu"),
                                                ("fp16", "compiled", "cuda:0"), ("tf32", "default", "cuda")], {
        ("fp16", "default", "cpu"): "the tensorflow adapter does not train in fp16 on cpu (only on cuda): fp16 with "
                                    "dynamic loss scaling is declared for CUDA GPUs only",
        ("tf32", "default", "cpu"): "the tensorflow adapter does not train in tf32 on cpu (only on cuda)"})
    assert TensorFlowAdapter().mode == "eager"
