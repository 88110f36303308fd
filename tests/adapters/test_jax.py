"""JAX: its adapter suite in its own environment, and the same training as PyTorch, step by step.

JAX needs numpy >= 2 and MXNet numpy < 2, so JAX cannot join the development environment: its suite
(tests/adapters/jax_suite.py) runs under envs/jax's interpreter, and the equivalence runs the shared scenarios
(tests/adapters/scenarios.py) there and compares them with PyTorch's, run here. The tolerances are those of
tests/test_equivalence.py for the other three frameworks."""

from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import pytest

from harness.execution import environments, probes
from harness.plan import checked_spec
from harness.results import store
from harness.spec import ROOT, FrameworkEntry, validate
from harness.studies import sweep
from tests.adapters import scenarios
from tests.helpers import base_spec

SUITE_TESTS = 29  # the tests in jax_suite.py (the conformance suite's and JAX's own): all must pass, none skipped


@pytest.fixture(scope="module")
def jax_python() -> str:
    """envs/jax (made when missing), with pytest for its suite."""
    python = str(environments.create("jax", ROOT / "envs")[0])
    if subprocess.run([python, "-c", "import pytest"], capture_output=True).returncode != 0:
        subprocess.run([python, "-m", "pip", "install", "--quiet", "pytest>=8"], check=True)
    return python


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}


#: What one interpreter in envs/jax runs (``in_env``): the suite (tests/adapters/jax_suite.py, by pytest, its report
#: on stdout and its exit status in the file ``suite-exit``), then, in the same interpreter, ``scenarios.run`` and
#: ``scenarios.run_blocks`` of the adapter into ``all.npz`` (any output on stderr), as tests/adapters/keras_checks.py
#: does for Keras. One interpreter instead of three (the suite, the layers, the blocks): JAX, the harness and the
#: digits loaded once. Nothing of the tests is imported before pytest collects them; the scenarios compare with
#: PyTorch as before.
_IN_ENV = """
import contextlib, sys
from pathlib import Path
import pytest
out = Path(sys.argv[1])
code = pytest.main(["tests/adapters/jax_suite.py", "-q", "-p", "no:cacheprovider"])
sys.stdout.flush()
(out / "suite-exit").write_text(str(int(code)))
with contextlib.redirect_stdout(sys.stderr):
    import numpy as np
    import adapters
    from tests.adapters import scenarios
    cls = adapters.get("jax")
    np.savez(out / "all.npz", **scenarios.run(cls), **scenarios.run_blocks(cls))
"""


@pytest.fixture(scope="module")
def in_env(jax_python, tmp_path_factory):
    """(the process, its folder): ``_IN_ENV`` run once in envs/jax, for the suite's test and the scenarios'
    fixtures (``jax_runs``)."""
    folder = tmp_path_factory.mktemp("jax")
    proc = subprocess.run([jax_python, "-c", _IN_ENV, str(folder)], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800, env=_env())
    return proc, folder


def test_the_jax_adapter_suite_passes_in_its_own_environment(in_env):
    proc, folder = in_env
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert (folder / "suite-exit").exists(), tail
    assert (folder / "suite-exit").read_text() == "0", tail
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(rf"\b{SUITE_TESTS} passed\b", summary) and not re.search(r"skipped|failed|error", summary), tail


def test_a_loader_trial_needs_the_declared_loader_modules_in_the_environment(jax_python):
    """The declaration's ``loader_modules`` (grain) are what the environment probe requires of JAX's interpreter for
    a spec whose trials use ``input: loader`` (its own or a variant's), and nothing for a resident spec or another
    framework; a module missing there is a one-line refusal naming the loader."""
    resident = validate(base_spec(frameworks=["jax", "pytorch"]), "spec.yaml")
    assert probes.loader_modules(resident, "jax") == {}
    for changes in ({"input": "loader"}, {"variants": {"input": ["resident", "loader"]}}):
        spec = validate(base_spec(frameworks=["jax", "pytorch"], **changes), "spec.yaml")
        assert probes.loader_modules(spec, "jax") == {"grain": "grain"}, changes
        assert probes.loader_modules(spec, "pytorch") == {}
    entry = FrameworkEntry(name="jax", python=jax_python)
    with pytest.raises(ValueError, match=r"lacks xyz-dist, which the jax adapter's data loader needs for input: "
                                         r"loader in the worker \(pip install xyz-dist there\)$"):
        probes.probe(entry, {}, loader={"no_such_module_xyz": "xyz-dist"})
    assert probes.probe(entry, {}, loader={"grain": "grain"})["versions"]["jax"]


@pytest.fixture(scope="module")
def jax_runs(in_env) -> dict[str, np.ndarray]:
    """scenarios.run and scenarios.run_blocks of JAX, in envs/jax (the interpreter of the suite)."""
    proc, folder = in_env
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(folder / "all.npz") as loaded:
        return dict(loaded)


@pytest.fixture(scope="module")
def runs(jax_runs, pytorch_runs):
    """{"jax": ..., "pytorch": ...}: scenarios.run of each (JAX in envs/jax, PyTorch here)."""
    return {"jax": {k: v for k, v in jax_runs.items() if k in pytorch_runs}, "pytorch": pytorch_runs}


def test_layers_and_blocks_are_apart(jax_runs, pytorch_runs, pytorch_block_runs):
    """The one-process run holds exactly the keys of both runs, none of them shared."""
    assert not set(pytorch_runs) & set(pytorch_block_runs)
    assert sorted(jax_runs) == sorted([*pytorch_runs, *pytorch_block_runs])


def test_the_same_scenarios_ran(runs):
    assert sorted(runs["jax"]) == sorted(runs["pytorch"])
    assert len(runs["jax"]) > 100


def test_same_input_gives_same_logits(runs):
    """Tolerance |a - b| <= 1e-5 + 1e-4 * |b|, as between the other frameworks."""
    for key in (k for k in runs["pytorch"] if k.startswith("logits-") or k.startswith("norm-inference-")):
        if key.endswith("|predict|"):
            np.testing.assert_allclose(runs["jax"][key], runs["pytorch"][key], rtol=1e-4, atol=1e-5, err_msg=key)
        else:  # evaluate: (loss, accuracy)
            np.testing.assert_allclose(runs["jax"][key], runs["pytorch"][key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("scenario", [f"ten-{name}" for name in scenarios.OPTIMIZERS] +
                         [f"norm-ten-{name}" for name in scenarios.NORM_MODELS])
@pytest.mark.parametrize("step", [1, 10])
def test_parameters_agree_after_steps(runs, scenario, step):
    """SGD with momentum and weight decay, Adam with weight decay and a large epsilon (optax's placement of epsilon
    must be PyTorch's), and the batchnorm models (running statistics included): every array after 1 and 10 steps
    within 1e-5 + 1e-5 * |b| of PyTorch's, the losses of those steps within 1e-5 relative; every array moved."""
    scenarios.assert_trained_alike(runs["jax"], runs["pytorch"], scenario, step, rtol=1e-5,
                                   moved=lambda name: not name.endswith(".bias"), min_move=1e-4)


@pytest.mark.parametrize("name", list(scenarios.OPTIMIZERS))
def test_loss_curves_of_a_real_run_agree(runs, name):
    """Two epochs of batch 32 (88 steps): every step's loss within 5e-3 relative and the final test loss too, the
    accuracy within one test image, as between the other frameworks."""
    scenarios.assert_curves_agree(runs["jax"], runs["pytorch"], name)


def test_a_fast_and_a_slowed_framework_report_the_same_epoch_loss(runs):
    """The loop's epoch losses of JAX slowed in auto windows and of PyTorch reading every 3 steps, and the other way
    round, agree within 1e-5 relative (tests/adapters/test_train_loss.py says why; observed 4e-8)."""
    scenarios.assert_epoch_losses_agree(runs["jax"], runs["pytorch"])


def test_gradient_accumulation_equals_one_large_batch_in_jax(runs):
    """Four micro-batches of 8 = one batch of 32, in JAX, over 3 steps (and both equal PyTorch's)."""
    scenarios.assert_accumulation_alike(runs["jax"], runs["pytorch"])


@pytest.fixture(scope="module")
def block_runs(jax_runs):
    """scenarios.run_blocks of JAX, in envs/jax."""
    return {k: v for k, v in jax_runs.items() if k.startswith("blocks-")}


def test_the_residual_and_transformer_models_give_the_same_logits(block_runs, pytorch_block_runs):
    """A narrow ResNet (strided projection shortcut, batchnorm on running statistics) and a causal decoder
    (embedding, layernorm, attention, gelu, next-token logits (N, L, vocab)) from the same perturbed weights, as
    PyTorch's (``scenarios.assert_same_block_logits``)."""
    scenarios.assert_same_block_logits(block_runs, pytorch_block_runs)


@pytest.mark.parametrize("scenario", scenarios.BLOCK_SCENARIOS)
@pytest.mark.parametrize("step", [1, 10])
def test_the_residual_and_transformer_models_train_the_same(block_runs, pytorch_block_runs, scenario, step):
    """1 and 10 steps of SGD with momentum and of Adam (batchnorm in training mode, its running statistics
    included; the decoder's next-token loss over every position): every array within 1e-5 + 1e-4 * |b| of
    PyTorch's, the losses within 1e-5 relative, every weight moved by step 10."""
    scenarios.assert_trained_alike(block_runs, pytorch_block_runs, scenario, step, rtol=1e-4,
                                   moved=lambda name: name.endswith(".weight"), min_move=1e-5)


def test_a_memory_capped_cpu_trial_dispatches_inline_and_an_uncapped_one_does_not(jax_python, tmp_path):
    """Under ``memory_limit_mb`` on a CPU the adapter turns JAX's async dispatch off before the CPU client exists and
    limits glibc's malloc to one arena (its threads' arenas made the capped peak differ by ~40 MB between fresh
    workers: adapters/jax/adapter.py ``_inline_cpu``); the trial's settings read the option back from jax.config.
    Without the cap JAX keeps its defaults, and both train."""
    settings = {}
    for name, cap in (("capped", {"memory_limit_mb": 400}), ("uncapped", {})):
        spec = checked_spec(base_spec(frameworks=[{"name": "jax", "python": jax_python}], batch_sizes=[16], epochs=1,
                                      cpu_threads=1, **cap), tmp_path / f"{name}.yaml")
        (record,) = store.read_trials(sweep.run_spec(spec, tmp_path / name))
        assert record.status == "ok", record.reason
        settings[name] = (record.settings["cpu_async_dispatch"], record.settings.get("malloc_arenas"))
    assert settings["capped"][0].startswith("off: each step runs on the calling thread"), settings
    assert settings["capped"][1] == "1 (mallopt M_ARENA_MAX: a memory-capped CPU trial)", settings
    assert settings["uncapped"] == ("on (JAX's default)", None), settings
