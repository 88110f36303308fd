"""``Adapter.gradient_norms`` in every framework (the gradient noise scale's measurements): the driver
``tests.adapters.gradient_norms_run`` runs in each framework's interpreter (JAX's envs/jax, Keras's
envs/keras-<backend>, the others this one) and this file compares what they saved. The same model, weights and
batches give the same squared norms in PyTorch, TensorFlow, MXNet, JAX and Keras on each backend (1e-5 relative;
observed at most 1.7e-6, batchnorm; Keras 4.3e-7), and on softmax regression the exact per-sample gradients computed
in numpy; taking them changes no parameter, buffer or later step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from harness.execution import environments
from harness.neutral import datasets
from harness.spec import ROOT, DigitsData
from tests.adapters.gradient_norms_run import SAMPLES, STEP, STEPS_BEFORE

#: PyTorch first: the reference
FRAMEWORKS = ("pytorch", "tensorflow", "mxnet", "jax", "keras-jax", "keras-torch", "keras-tensorflow")
#: the drivers two at a time, the longest first (CPU-seconds: JAX's and keras-jax's 15, XLA compiling most of it;
#: keras-tensorflow's 8, TensorFlow's 7, keras-torch's 6, PyTorch's and MXNet's 4)
LONGEST_FIRST = ("jax", "keras-jax", "keras-tensorflow", "tensorflow", "keras-torch", "pytorch", "mxnet")
#: the drivers in an environment of their own (made when missing, ``harness envs create``)
OWN_ENVIRONMENT = ("jax", "keras-jax", "keras-torch", "keras-tensorflow")
#: |a - b| <= RTOL |b| for every norm of every pair of frameworks (the issue asked for 1e-3).
RTOL = 1e-5


def _python(framework: str) -> str:
    return str(environments.create(framework, ROOT / "envs")[0]) if framework in OWN_ENVIRONMENT else sys.executable


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, dict]:
    folder = tmp_path_factory.mktemp("gradient_norms")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1",
           "TF_CPP_MIN_LOG_LEVEL": "2", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    env.pop("JAX_PLATFORMS", None)

    def drive(framework: str) -> None:
        argv = [_python(framework), "-m", "tests.adapters.gradient_norms_run", framework,
                str(folder / f"{framework}.json")]
        # each driver trains two adapters of every model alike: their second train step is the first's compiled
        # program, read from the suite's compilation cache (tests/conftest.py: about 3 of 15 CPU-seconds on JAX),
        # which also holds every program of the JAX drivers once an earlier run has compiled them
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{argv}\n{proc.stderr[-3000:]}"

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(drive, LONGEST_FIRST))
    return {f: json.loads((folder / f"{f}.json").read_text()) for f in FRAMEWORKS}


def _flat(entry: dict) -> np.ndarray:
    return np.array([x for k in ("k4", "k8") for x in [*entry[k][0], entry[k][1]]])


@pytest.mark.parametrize("model", ["softmax", "cnn", "batchnorm"])
def test_every_framework_measures_the_same_norms(saved, model):
    reference = _flat(saved["pytorch"][model])
    assert reference.min() > 0
    for framework in FRAMEWORKS[1:]:
        np.testing.assert_allclose(_flat(saved[framework][model]), reference, rtol=RTOL, err_msg=framework)


def test_softmax_regression_norms_equal_numpy_per_sample_gradients(saved):
    """Exact: per-sample gradients of softmax cross-entropy of a dense layer, (p - y) x^T and p - y, averaged over
    each micro-batch at the weights the driver saved before taking the norms."""
    data = datasets.load(DigitsData(name="digits"))
    order = datasets.epoch_order(len(data.y_train), 0, 0)
    probe = order[STEPS_BEFORE * STEP:STEPS_BEFORE * STEP + SAMPLES]
    weights = saved["pytorch"]["softmax"]["weights"]
    w, b = np.asarray(weights["1.weight"], np.float64), np.asarray(weights["1.bias"], np.float64)
    x = data.x_train[probe].reshape(len(probe), -1).astype(np.float64)
    logits = x @ w.T + b
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(probe)), data.y_train[probe]] -= 1
    per_sample = np.concatenate([(p[:, :, None] * x[:, None, :]).reshape(len(probe), -1), p], axis=1)
    for k in (4, 8):
        parts = per_sample.reshape(k, -1, per_sample.shape[1]).mean(axis=1)
        exact = [*(parts ** 2).sum(axis=1), (parts.mean(axis=0) ** 2).sum()]
        for framework in FRAMEWORKS:
            small, big = saved[framework]["softmax"][f"k{k}"]
            np.testing.assert_allclose([*small, big], exact, rtol=RTOL, err_msg=f"{framework} k={k}")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_taking_norms_changes_nothing_training_depends_on(saved, framework):
    """Parameters and buffers (batchnorm's running statistics) as before, the next step's loss as in an adapter
    that took none (dropout excepted: its random state may advance), and the refusals one line each."""
    for model, entry in saved[framework].items():
        assert entry["changed"] == [], (model, entry["changed"])
        if model != "dropout":
            assert entry["loss_after"] == entry["loss_without"], model
        small, big = entry["k8"]
        assert np.mean(small) > big > 0, model  # E|g_b|^2 exceeds E|G_B|^2 by tr(Sigma) (1/b - 1/B)
        assert "2 micro-batches" in entry["refusals"]["one"] and "3" in entry["refusals"]["indivisible"], model
