"""PyTorch in mixed precision and compiled: ``torch.autocast`` bf16 on the CPU gives the float64 reference's logits
within the derived bf16 bound (``scenarios.bf16_tolerance``) with float32 parameters, and trains; ``torch.compile``
trains exactly like eager mode in fp32; the combinations it cannot run are refused with a reason."""

from __future__ import annotations

import numpy as np
import pytest

from adapters.pytorch.adapter import PyTorchAdapter
from harness.neutral import datasets, models
from harness.spec import OptimizerSpec
from tests.adapters import kit, reference, scenarios

# A stable learning rate: at scenarios.SGD's 0.05 the loss first climbs to 6 and the run is chaotic enough that any
# rounding difference (bf16's, or fp32 summation order's) grows over 10 steps.
GENTLE = OptimizerSpec(name="sgd", learning_rate=0.01, momentum=0.9)


def configured(precision: str = "fp32", compile: str = "eager") -> type[PyTorchAdapter]:
    """The adapter class made with these options (``kit.configured``)."""
    return kit.configured(PyTorchAdapter, precision=precision, compile=compile)


@pytest.mark.parametrize("name", ["digits", *scenarios.BLOCK_MODELS])
def test_bf16_logits_are_the_reference_within_the_derived_bound(name):
    if name == "digits":
        adapter, data, info = kit.make(configured("bf16"))
        weights = models.initial_weights(info, 0)
    else:
        model, cfg = scenarios.BLOCK_MODELS[name]
        info = models.analyze(model, *datasets.describe_input(cfg))
        weights = scenarios.perturbed(info)
        adapter, data, _ = scenarios.make_on(configured("bf16"), model, cfg, weights=weights)
    logits = adapter.predict(data.x_test)
    exact = reference.forward(info, weights, data.x_test)
    error = scenarios.assert_bf16_close(logits, exact, info)
    assert error > 1e-4, error  # bf16 was used: fp32 agrees with the reference to about 1e-6
    assert logits.dtype == np.float32 and all(w.dtype == np.float32 for w in adapter.get_weights().values())
    assert adapter.settings().record()["autocast_dtype"] == "bfloat16"


def test_bf16_trains_near_the_fp32_run():
    """10 SGD steps of the digits CNN in bf16 and in fp32 from the same weights on the same batches: the bf16 loss
    falls like fp32's, each step's loss within 3 % of it (one forward pass's bound is 3.1e-2 of the logit scale;
    observed 1.4 %), and every weight array ends within half the distance fp32's moved from the start (the
    gradients differ by bf16 roundings each step, so the paths part slowly; observed at most 0.27 of it, for the
    dense layer after the flatten, 0.04-0.06 for the others)."""
    runs = {}
    for precision in ("fp32", "bf16"):
        adapter, data, _ = kit.make(configured(precision), optimizer=GENTLE)
        start = adapter.get_weights()
        runs[precision] = kit.train_on(adapter, kit.batches(len(data.y_train), 32, 10), keep=(10,))
    (fp32_losses, fp32_state), (bf16_losses, bf16_state) = runs["fp32"], runs["bf16"]
    assert bf16_losses[-1] < bf16_losses[0] - 0.5, bf16_losses
    np.testing.assert_allclose(bf16_losses, fp32_losses, rtol=3e-2)
    for name, value in fp32_state[10].items():
        moved, parted = np.abs(value - start[name]).max(), np.abs(bf16_state[10][name] - value).max()
        assert 1e-6 < parted <= 0.5 * moved, (name, parted, moved)


def test_compiled_trains_exactly_like_eager():
    """torch.compile (inductor, on the CPU: generated C++) against eager: the logits and 5 SGD-momentum steps of the
    digits CNN within the fp32 tolerances of the equivalence tests, and the compiled module was what ran."""
    runs = {}
    for mode in ("eager", "compiled"):
        adapter, data, _ = kit.make(configured(compile=mode), optimizer=scenarios.SGD)
        losses, states = kit.train_on(adapter, kit.batches(len(data.y_train), 32, 5), keep=(5,))
        runs[mode] = (losses, states[5], adapter.predict(data.x_test), adapter)
    compiled = runs["compiled"][3]
    assert compiled.training.model is not compiled.training.net
    assert compiled.settings().record()["torch_compile"]["backend"] == "inductor"
    # TorchDynamo captured the training step once for the five steps of one shape; eager keeps no count
    assert compiled.compilations() == 1 and runs["eager"][3].compilations() is None
    np.testing.assert_allclose(runs["compiled"][0], runs["eager"][0], rtol=1e-5)
    for name, value in runs["eager"][1].items():
        np.testing.assert_allclose(runs["compiled"][1][name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(runs["compiled"][2], runs["eager"][2], rtol=1e-4, atol=1e-5)


def test_what_it_cannot_run_is_refused_with_a_reason():
    kit.check_execution_declared("pytorch", [("bf16", "compiled", "cpu"), ("fp32", "default", "cuda:0")], {
        ("fp16", "default", "cpu"): "the pytorch adapter does not train in fp16 on cpu (only on cuda): fp16 with "
                                    "dynamic loss scaling is declared for CUDA GPUs only",
        ("tf32", "eager", "cpu"): "the pytorch adapter does not train in tf32 on cpu (only on cuda)"})
    assert PyTorchAdapter().mode == "eager"
