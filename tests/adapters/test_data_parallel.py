"""Data parallelism across frameworks (issue 29's "in each framework and across frameworks"): the CNN of
tests/adapters/kit.py trained 10 SGD steps of global batch 32 on two CPU devices (tests/adapters/data_parallel_run.py:
PyTorch DistributedDataParallel over two gloo ranks, TensorFlow MirroredStrategy over two logical CPUs, MXNet's
"device" kvstore over two contexts, JAX shard_map over two host devices) ends with the same parameters in every
framework, and the same as PyTorch on one device at batch 32 (in the interpreter of PyTorch's rank 0, after the
two-device run: the driver trains a framework's runs in one interpreter). Each framework's own two-device run against
its one-device run, and accumulation against devices, are in tests/adapters/test_{framework}_data_parallel.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from harness.execution import environments
from harness.execution.ranks import RANK_VARIABLES
from harness.neutral import datasets, models
from harness.spec import ROOT, DigitsData
from tests.adapters import kit
from tests.adapters.data_parallel_run import runs_argument
from tests.adapters.kit import PARAM_ATOL, PARAM_RTOL

FRAMEWORKS = ("pytorch", "tensorflow", "mxnet", "jax")

#: The same tolerance as the one-device equivalence across frameworks (tests/adapters/test_equivalence.py:
#: |a - b| <= 1e-5 + 1e-5 |b| per element after 10 steps). Observed maxima of |a - b| against PyTorch on two devices
#: (test_report_the_largest_differences): TensorFlow 3.0e-7, MXNet 1.3e-6, JAX 2.4e-7, PyTorch on one device 2.1e-7.
RTOL, ATOL = PARAM_RTOL, PARAM_ATOL


def _python(framework: str) -> str:
    """The interpreter of ``framework``'s in-process tests: this one, or envs/jax (made when missing) for JAX."""
    return str(environments.create("jax", ROOT / "envs")[0]) if framework == "jax" else sys.executable


def _drive(argv: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"}
    for name in (*RANK_VARIABLES, "JAX_PLATFORMS"):
        env.pop(name, None)
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{argv}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    """"<framework>-<devices>" -> the driver's saved parameters (canonical names); a driver command per framework
    (PyTorch's two runs in one), two at a time."""
    folder: Path = tmp_path_factory.mktemp("data_parallel_across")
    jobs = {f"{name}-2": (name, 2) for name in FRAMEWORKS} | {"pytorch-1": ("pytorch", 1)}
    per_framework: dict[str, list[tuple[int, Path]]] = {}
    for key, (name, devices) in jobs.items():
        per_framework.setdefault(name, []).append((devices, folder / f"{key}.npz"))
    argv = [[_python(name), "-m", "tests.adapters.data_parallel_run", name, *runs_argument(runs)]
            for name, runs in per_framework.items()]
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(_drive, argv))
    result = {}
    for key in jobs:
        with np.load(folder / f"{key}.npz") as saved:
            result[key] = {k[2:]: saved[k] for k in saved.files if k.startswith("w:")}
    return result


@pytest.fixture(scope="module")
def initial() -> dict[str, np.ndarray]:
    """The canonical initial weights of the driver's CNN (seed 0)."""
    data = datasets.load(DigitsData(name="digits"))
    return models.initial_weights(models.analyze(kit.CNN, data.x_train.shape[1:], data.num_classes), 0)


def test_every_parameter_moved_well_beyond_the_tolerance(runs, initial):
    """The comparisons below can fail: in 10 steps every parameter moved by more than 100 x ``ATOL``."""
    for name, value in runs["pytorch-1"].items():
        assert np.abs(value - initial[name]).max() > 100 * ATOL, name


@pytest.mark.parametrize("framework", FRAMEWORKS[1:])
@pytest.mark.parametrize("reference", ["pytorch-2", "pytorch-1"])
def test_two_devices_train_alike_in_every_framework(runs, framework, reference):
    """``framework`` on two devices ends where PyTorch does on two devices and on one (every element within
    ``ATOL + RTOL |b|``)."""
    ours, theirs = runs[f"{framework}-2"], runs[reference]
    assert sorted(ours) == sorted(theirs)
    for name, value in ours.items():
        np.testing.assert_allclose(value, theirs[name], rtol=RTOL, atol=ATOL, err_msg=f"{framework} {name}")


def test_pytorch_on_two_devices_trains_like_one(runs):
    """The reference pair itself: DistributedDataParallel over two ranks and one process agree."""
    for name, value in runs["pytorch-2"].items():
        np.testing.assert_allclose(value, runs["pytorch-1"][name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_report_the_largest_differences(runs, record_property):
    """The figures of the comment on RTOL (kept in the JUnit properties): max |a - b| of each run against PyTorch's
    two-device run; each is far inside the tolerance."""
    for key in runs:
        worst = max(float(np.abs(v - runs["pytorch-2"][n]).max()) for n, v in runs[key].items())
        record_property(f"max_abs_vs_pytorch-2:{key}", worst)
        assert worst < ATOL, (key, worst)
