"""Keras 3 on each backend, held to what every adapter is held to: its suite in its own environment
(tests/adapters/keras_suite.py: the conformance suite, the block checks against the numpy reference and Keras's own
checks), and the same training as PyTorch, step by step (tests/adapters/scenarios.py: the CNN, the batchnorm models,
the narrow ResNet and the causal decoder, 10 steps of SGD with momentum and of Adam, gradient accumulation, the loop's
epoch losses), with the tolerances the native adapters meet (tests/adapters/test_jax.py). One file per backend
imports these tests (test_keras_jax.py, ...), so that the backends run side by side; each defines the ``keras_name``
fixture. The same interpreter also trains the Keras model of your own that tests/adapters/test_keras_native.py
compares across the backends (``in_env_folder``)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from harness.execution import environments
from harness.spec import ROOT
from tests.adapters import scenarios

#: the tests in keras_suite.py per backend (10 of them the conformance suite's; MobileNetV3Small is adopted on the
#: torch backend only): all must pass, none skipped
SUITE_TESTS = {"keras-jax": 27, "keras-torch": 28, "keras-tensorflow": 27}


def _keras_python(keras_name: str) -> str:
    """envs/<keras_name> (made when missing, ``harness envs create``), with pytest for its suite."""
    python = str(environments.create(keras_name, ROOT / "envs")[0])
    if subprocess.run([python, "-c", "import pytest"], capture_output=True).returncode != 0:
        subprocess.run([python, "-m", "pip", "install", "--quiet", "pytest>=8"], check=True)
    return python



def _env(keras_name: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2", "HARNESS_KERAS_ADAPTER": keras_name,
            "TF_CPP_MIN_LOG_LEVEL": "2"}


#: What one interpreter in the Keras environment runs (``in_env_folder``): the suite (tests/adapters/keras_suite.py,
#: by pytest, its report on stdout and its exit status in the file ``suite-exit``), then, in the same interpreter,
#: ``scenarios.run`` and ``scenarios.run_blocks`` of the adapter into ``all.npz`` and ``keras_native.run`` from the
#: shared weights file (argument 2) into ``native.npz`` (any output on stderr). One interpreter instead of three:
#: importing Keras and its backend (5 CPU-seconds on TensorFlow), the harness and the digits once. Nothing of the
#: tests is imported before pytest collects them; the scenarios compare with PyTorch as before.
_IN_ENV = """
import contextlib, os, sys
from pathlib import Path
import pytest
out = Path(sys.argv[1])
code = pytest.main(["tests/adapters/keras_suite.py", "-q", "-p", "no:cacheprovider"])
sys.stdout.flush()
(out / "suite-exit").write_text(str(int(code)))
with contextlib.redirect_stdout(sys.stderr):
    import numpy as np
    import adapters
    from tests.adapters import keras_native, scenarios
    cls = adapters.get(os.environ["HARNESS_KERAS_ADAPTER"])
    np.savez(out / "all.npz", **scenarios.run(cls), **scenarios.run_blocks(cls))
    np.savez(out / "native.npz", **keras_native.run(cls, Path(sys.argv[2])))
"""

#: The environment that draws the shared weights of the model of your own (``native_weights``), on Keras's numpy
#: backend: the first of tests/adapters/test_keras_native.py's backends.
DRAWS = "keras-jax"


def native_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared initial weights of keras_cnn for seed 0 (``keras_native.shared_weights``), drawn once per pytest
    command by ``adapters.keras.weights`` in envs/keras-jax (``made_once``), before any Keras interpreter of
    ``in_env_folder`` loads them; the file ``drawn`` beside it holds its inode and mtime just after the draw."""
    from harness.neutral import datasets, native
    from harness.spec import DigitsData, NativeModel
    from tests.adapters import keras_native
    from tests.helpers import made_once

    def draw(folder: Path) -> None:
        feed, classes = datasets.describe_input(DigitsData(name="digits"))
        path = native.draw_shared_weights("adapters.keras.weights", NativeModel(factory=keras_native.FACTORY), feed,
                                          classes, 0, folder / "keras_cnn-seed0", python=_keras_python(DRAWS))
        (folder / "drawn").write_text(f"{path.stat().st_ino} {path.stat().st_mtime_ns}")

    return made_once(tmp_path_factory, "keras-native-weights", draw) / "keras_cnn-seed0"


def in_env_folder(tmp_path_factory: pytest.TempPathFactory, keras_name: str) -> Path:
    """The folder of ``_IN_ENV`` run once per pytest command in envs/<keras_name> (``made_once``: whichever test asks
    first, this backend's file or tests/adapters/test_keras_native.py, runs it; the other reads it): its outputs, and
    the process's ``stdout``, ``stderr`` and ``returncode`` in files of those names."""
    from tests.helpers import made_once

    weights = native_weights(tmp_path_factory)

    def make(folder: Path) -> None:
        proc = subprocess.run([_keras_python(keras_name), "-c", _IN_ENV, str(folder), str(weights)], cwd=ROOT,
                              capture_output=True, text=True, timeout=1800, env=_env(keras_name))
        for name in ("stdout", "stderr", "returncode"):
            (folder / name).write_text(str(getattr(proc, name)))

    return made_once(tmp_path_factory, f"keras-in-env-{keras_name}", make)


def read_in_env(folder: Path) -> SimpleNamespace:
    """The process of ``in_env_folder``: its stdout, stderr and returncode."""
    return SimpleNamespace(stdout=(folder / "stdout").read_text(), stderr=(folder / "stderr").read_text(),
                           returncode=int((folder / "returncode").read_text()))


@pytest.fixture(scope="module")
def in_env(keras_name, tmp_path_factory):
    """(the process, its folder): ``_IN_ENV`` run once in the Keras environment, for the suite's test and the
    scenarios' fixture (``keras_runs``)."""
    folder = in_env_folder(tmp_path_factory, keras_name)
    return read_in_env(folder), folder


def test_the_keras_adapter_suite_passes_in_its_own_environment(in_env, keras_name):
    proc, folder = in_env
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert (folder / "suite-exit").exists(), tail
    assert (folder / "suite-exit").read_text() == "0", tail
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(rf"\b{SUITE_TESTS[keras_name]} passed\b", summary), tail
    assert not re.search(r"skipped|failed|error", summary), tail


@pytest.fixture(scope="module")
def keras_runs(in_env) -> dict[str, np.ndarray]:
    """scenarios.run and scenarios.run_blocks of Keras, in its environment (the interpreter of the suite)."""
    proc, folder = in_env
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(folder / "all.npz") as loaded:
        return dict(loaded)


@pytest.fixture(scope="module")
def runs(keras_runs, pytorch_runs):
    """{"keras": ..., "pytorch": ...}: scenarios.run of each (Keras in its environment, PyTorch here)."""
    return {"keras": {k: v for k, v in keras_runs.items() if k in pytorch_runs}, "pytorch": pytorch_runs}


@pytest.fixture(scope="module")
def block_runs(keras_runs, pytorch_block_runs):
    """{"keras": ..., "pytorch": ...}: scenarios.run_blocks of each."""
    return {"keras": {k: v for k, v in keras_runs.items() if k.startswith("blocks-")}, "pytorch": pytorch_block_runs}


def test_layers_and_blocks_are_apart(keras_runs, pytorch_runs, pytorch_block_runs):
    """The one-process run holds exactly the keys of both runs, none of them shared."""
    assert not set(pytorch_runs) & set(pytorch_block_runs)
    assert sorted(keras_runs) == sorted([*pytorch_runs, *pytorch_block_runs])


def test_the_same_scenarios_ran(runs):
    assert sorted(runs["keras"]) == sorted(runs["pytorch"]) and len(runs["keras"]) > 100


def test_same_input_gives_same_logits(runs):
    """|a - b| <= 1e-5 + 1e-4 * |b| for the logits, 1e-5 relative for the test loss and accuracy."""
    for key in (k for k in runs["pytorch"] if k.startswith("logits-") or k.startswith("norm-inference-")):
        if key.endswith("|predict|"):
            np.testing.assert_allclose(runs["keras"][key], runs["pytorch"][key], rtol=1e-4, atol=1e-5, err_msg=key)
        else:
            np.testing.assert_allclose(runs["keras"][key], runs["pytorch"][key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("scenario", [f"ten-{name}" for name in scenarios.OPTIMIZERS] +
                         [f"norm-ten-{name}" for name in scenarios.NORM_MODELS])
@pytest.mark.parametrize("step", [1, 10])
def test_parameters_agree_after_steps(runs, scenario, step):
    """SGD with momentum and weight decay (the coupled L2 term), Adam with weight decay and PyTorch's placement of
    epsilon, and the batchnorm models (running statistics included): every array within 1e-5 + 1e-5 * |b| of
    PyTorch's after 1 and 10 steps, the losses within 1e-5 relative; every array moved."""
    scenarios.assert_trained_alike(runs["keras"], runs["pytorch"], scenario, step, rtol=1e-5,
                                   moved=lambda name: not name.endswith(".bias"), min_move=1e-4)


@pytest.mark.parametrize("name", list(scenarios.OPTIMIZERS))
def test_loss_curves_of_a_real_run_agree(runs, name):
    """Two epochs of batch 32 (88 steps): every step's loss within 5e-3 relative, the final test loss too, the
    accuracy within one test image."""
    scenarios.assert_curves_agree(runs["keras"], runs["pytorch"], name)


def test_a_fast_and_a_slowed_framework_report_the_same_epoch_loss(runs):
    """The loop's epoch losses (train_on_batch's host losses summed) read every 3 steps and slowed in auto windows
    agree with PyTorch's the other way round, within 1e-5 relative."""
    scenarios.assert_epoch_losses_agree(runs["keras"], runs["pytorch"])


def test_gradient_accumulation_equals_one_large_batch(runs):
    """Four micro-batches of 8 through the optimizer's gradient_accumulation_steps = one batch of 32, over 3 steps
    (and both equal PyTorch's)."""
    scenarios.assert_accumulation_alike(runs["keras"], runs["pytorch"])


def test_the_residual_and_transformer_models_give_the_same_logits(block_runs):
    scenarios.assert_same_block_logits(block_runs["keras"], block_runs["pytorch"])


@pytest.mark.parametrize("scenario", scenarios.BLOCK_SCENARIOS)
@pytest.mark.parametrize("step", [1, 10])
def test_the_residual_and_transformer_models_train_the_same(block_runs, scenario, step):
    """The narrow ResNet (batchnorm in training mode, running statistics included) and the causal decoder
    (next-token loss over every position; on TensorFlow the embedding's IndexedSlices gradient made dense), 1 and
    10 steps of SGD with momentum and of Adam: every array within 1e-5 + 1e-4 * |b| of PyTorch's, the losses within
    1e-5 relative, every weight moved by step 10."""
    scenarios.assert_trained_alike(block_runs["keras"], block_runs["pytorch"], scenario, step, rtol=1e-4,
                                   moved=lambda name: name.endswith(".weight"), min_move=1e-5)
