"""A Keras model of your own on JAX, PyTorch and TensorFlow trains alike (the issue "Your own model"): the same factory
(specs/models.py:keras_cnn, conv -> max pool -> conv -> batchnorm -> dense -> dense, no dropout) on each backend starts
from the same initial weights, drawn once per seed (``adapters.keras.weights``, on Keras's numpy backend) and loaded
into each (``KerasAdapter.native_model``), and trains on the same batches; after 1 and 10 steps of SGD with momentum
and of Adam its parameters agree across the three backends with the tolerances of the native adapters' equivalence
tests (``kit.PARAM_RTOL``, ``kit.PARAM_ATOL``: 1e-5 + 1e-5 x |b|, as tests/adapters/keras_checks.py holds the neutral
batchnorm models to), and every one of them moved by far more than that.

Each environment's run is ``keras_native.run`` in the interpreter that also runs that backend's suite and scenarios
(``keras_checks.in_env_folder``, made once per pytest command for this file and test_keras_<backend>.py alike): the
weights file is drawn once before them (``keras_checks.native_weights``, in envs/keras-jax), and all three load it.
Measured (Keras 3.15.1; JAX 0.10.2, torch 2.13.0, TensorFlow 2.21.0 on x86-64, 2 threads): the
largest difference between two backends is 4e-7 after 10 SGD steps and 2.5e-6 after 10 Adam steps, with one exception,
the bias of the convolution that feeds the batchnorm (``PRE_NORM_BIAS``). Batchnorm subtracts each channel's batch
mean, so that bias's true gradient is exactly zero and what each backend computes for it is its own rounding residue
of a sum that cancels (about 1e-6, different on each backend). SGD scales the residue by the learning rate (the bias
moves by 1.5e-7 in 10 steps, and agrees within the tolerance), but Adam divides it by its own running magnitude plus
epsilon (1e-4), so the bias takes steps of up to lr x |g| / (|g| + eps): 1.3e-5 to 3.4e-5 apart between backends,
noise rather than training. For Adam that array is held to what it is instead (``test_the_bias_before_batchnorm_holds
_only_rounding``): near its zero start on every backend, below a bound that the other biases, trained by real
gradients, exceed 25-fold.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from harness.execution import environments
from harness.spec import ROOT
from tests.adapters import kit, scenarios
from tests.adapters.keras_checks import in_env_folder, native_weights, read_in_env

NAMES = ("keras-jax", "keras-torch", "keras-tensorflow")
#: the bias of the second convolution, which feeds the batchnorm (``keras_native.positional_names``)
PRE_NORM_BIAS = "3.Conv2D.bias"
#: Adam's bound on that bias after 10 steps from 0: 10 x lr (2e-3) x 1e-2, the most a gradient of at most 1 % of
#: epsilon moves it; every other bias of the model (true gradients >> epsilon) moves by more than 5e-3 (observed:
#: 1.2e-2 to 1.6e-2, of the 2e-2 that 10 Adam steps can move a variable at most).
NOISE_BOUND = 10 * scenarios.ADAM.learning_rate * 1e-2


@pytest.fixture(scope="module")
def native_runs(tmp_path_factory) -> tuple[object, dict[str, dict[str, np.ndarray]]]:
    """(the weights file, {adapter name: ``keras_native.run`` in its environment}); the file is drawn once, and it
    is the same file (not drawn again) after each of the three runs."""
    weights, runs = native_weights(tmp_path_factory), {}
    drawn = (weights.parent / "drawn").read_text()
    for name in NAMES:
        folder = in_env_folder(tmp_path_factory, name)
        proc = read_in_env(folder)
        assert proc.returncode == 0, proc.stderr[-3000:]
        stat = weights.stat()
        assert f"{stat.st_ino} {stat.st_mtime_ns}" == drawn, f"{name} drew the weights again"
        with np.load(folder / "native.npz") as loaded:
            runs[name] = dict(loaded)
    return weights, runs


def _names(run: dict[str, np.ndarray], prefix: str, step: int) -> list[str]:
    return sorted(k.split("|")[2] for k in run if k.startswith(f"{prefix}|{step}|"))


def test_every_backend_starts_from_the_weights_drawn_once(native_runs):
    """Before the first step each backend holds exactly the arrays of the weights file (read with h5py: the Keras
    weights file is HDF5, a dataset per variable), bit for bit, for both optimizers' models."""
    import h5py

    weights, runs = native_runs
    stored: list[np.ndarray] = []
    with h5py.File(weights, "r") as f:
        f.visititems(lambda _, item: stored.append(np.asarray(item)) if isinstance(item, h5py.Dataset) else None)
    expected = sorted((a.shape, a.astype(np.float32).tobytes()) for a in stored)
    assert len(expected) == 12  # 2 convs, 2 denses (kernel, bias), batchnorm (gamma, beta, mean, variance)
    for name, prefix in itertools.product(NAMES, (f"native-{o}" for o in scenarios.OPTIMIZERS)):
        start = [runs[name][f"{prefix}|0|{v}"] for v in _names(runs[name], prefix, 0)]
        assert sorted((a.shape, a.tobytes()) for a in start) == expected, (name, prefix)


@pytest.mark.parametrize("optimizer", list(scenarios.OPTIMIZERS))
@pytest.mark.parametrize("step", [1, 10])
def test_parameters_agree_across_the_backends(native_runs, optimizer, step):
    """Each pair of backends: the 10 losses within 1e-5 relative, every trainable variable and moving statistic
    within ``kit.PARAM_ATOL`` + ``kit.PARAM_RTOL`` x |b| after ``step`` steps (for Adam, all but ``PRE_NORM_BIAS``:
    see the module docstring), and by step 10 each of them moved by more than 100 x ``kit.PARAM_ATOL``."""
    runs, prefix = native_runs[1], f"native-{optimizer}"
    names = _names(runs[NAMES[0]], prefix, step)
    assert len(names) == 12 and PRE_NORM_BIAS in names
    compared = [n for n in names if not (optimizer.startswith("adam") and n == PRE_NORM_BIAS)]
    for a, b in itertools.combinations(NAMES, 2):
        assert _names(runs[a], prefix, step) == names == _names(runs[b], prefix, step)
        np.testing.assert_allclose(runs[a][f"{prefix}|losses|"], runs[b][f"{prefix}|losses|"], rtol=1e-5)
        for name in compared:
            np.testing.assert_allclose(runs[a][f"{prefix}|{step}|{name}"], runs[b][f"{prefix}|{step}|{name}"],
                                       rtol=kit.PARAM_RTOL, atol=kit.PARAM_ATOL,
                                       err_msg=f"{a} vs {b}: {name} after {step} step(s) of {optimizer}")
    if step == 10:
        run = runs[NAMES[0]]
        for name in (n for n in names if n != PRE_NORM_BIAS):
            moved = np.abs(run[f"{prefix}|10|{name}"] - run[f"{prefix}|0|{name}"]).max()
            assert moved > 100 * kit.PARAM_ATOL, f"{name} moved by only {moved:.2g} in 10 steps of {optimizer}"


def test_the_bias_before_batchnorm_holds_only_rounding(native_runs):
    """``PRE_NORM_BIAS`` starts at 0 and, its true gradient being zero, stays below ``NOISE_BOUND`` on every backend
    after 10 Adam steps (observed: at most 3.3e-5), while the other biases move by more than 5e-3."""
    runs = native_runs[1]
    prefix = "native-adam-wd-eps1e-4"
    for name in NAMES:
        assert not runs[name][f"{prefix}|0|{PRE_NORM_BIAS}"].any()
        assert np.abs(runs[name][f"{prefix}|10|{PRE_NORM_BIAS}"]).max() < NOISE_BOUND, name
        others = [n for n in _names(runs[name], prefix, 10) if n.endswith(".bias") and n != PRE_NORM_BIAS]
        assert len(others) == 3 and all(np.abs(runs[name][f"{prefix}|10|{n}"]).max() > 5e-3 for n in others), name


def test_the_trained_models_score_the_test_set_alike(native_runs):
    """After the 10 steps, each pair: the test loss within 1e-5 relative, the accuracy within one test image (an
    image on the decision boundary may fall either way)."""
    runs = native_runs[1]
    for optimizer, (a, b) in itertools.product(scenarios.OPTIMIZERS, itertools.combinations(NAMES, 2)):
        (loss_a, acc_a), (loss_b, acc_b) = (runs[n][f"native-{optimizer}|evaluate|"] for n in (a, b))
        assert abs(loss_a - loss_b) <= 1e-5 * abs(loss_b) and abs(acc_a - acc_b) <= 1.5 / 359, (optimizer, a, b)


def test_drawing_the_weights_of_no_keras_model_names_the_factory(tmp_path):
    """The probe draws the shared weights before it adopts the model (``harness.execution.native_probe.check``), so a
    factory that returns no ``keras.Model`` is first met by ``adapters.keras.weights``: in envs/keras-torch,
    ``draw_shared_weights`` of ``collections:OrderedDict`` raises NativeModelError for the ``model`` field whose one
    line names the factory and what it returned, and leaves no file behind."""
    from harness.neutral import native
    from harness.neutral.info import Input
    from harness.spec import NativeModel

    python = environments.create("keras-torch", ROOT / "envs")[0]
    path = tmp_path / "weights"
    with pytest.raises(native.NativeModelError) as err:
        native.draw_shared_weights("adapters.keras.weights", NativeModel(factory="collections:OrderedDict"),
                                   Input.images((8, 8, 1)), 10, 0, path, python=str(python))
    assert err.value.field == "model"
    assert str(err.value) == ("drawing the initial weights of collections:OrderedDict failed: collections:OrderedDict "
                              "returned a collections.OrderedDict, not a keras.Model")
    assert not list(tmp_path.iterdir())
