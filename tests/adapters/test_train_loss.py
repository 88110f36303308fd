"""The epoch's training loss that the harness's loop reports (the mean over every step, summed on the device inside
each framework's step) does not depend on the windows, so frameworks of different speed report the same number for
the same model and batches: PyTorch, TensorFlow and MXNet here (JAX: tests/adapters/jax_suite.py and test_jax.py).
The runs: tests/adapters/loss_runs.py."""

from __future__ import annotations

import numpy as np
import pytest

from adapters.mxnet.adapter import MXNetAdapter
from adapters.pytorch.adapter import PyTorchAdapter
from adapters.tensorflow.adapter import TensorFlowAdapter
from tests.adapters import loss_runs

FRAMEWORKS = {"pytorch": PyTorchAdapter, "tensorflow": TensorFlowAdapter, "mxnet": MXNetAdapter}
#: Across frameworks. Each computes every step in float32 with its own kernels: their per-step losses agree within
#: ~1e-7 relative at the first step and drift apart slowly (tests/test_equivalence.py holds 10 steps to 1e-5); the
#: mean of 44 of them can differ by no more than the largest per-step difference (also asserted) plus the sums'
#: rounding (``loss_runs.SUM_RTOL``, 2.6e-6). Observed here: at most 5.7e-7 (MXNet against PyTorch, epoch 2; PyTorch
#: against TensorFlow 4.4e-8), where the windows' old mean was 1.4 % and 3.2 % off.
CROSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return {name: loss_runs.check_windows_do_not_change_the_loss(cls) for name, cls in FRAMEWORKS.items()}


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_the_epoch_loss_is_every_steps_mean_whatever_the_windows(runs, name):
    """The checks themselves run in the fixture (``check_windows_do_not_change_the_loss``); this names them."""
    assert runs[name]["fast"]["steps"] == runs[name]["slow"]["steps"] == [44, 44]


@pytest.mark.parametrize("fast,slow", [("pytorch", "tensorflow"), ("tensorflow", "pytorch"), ("pytorch", "mxnet"),
                                       ("mxnet", "tensorflow")])
def test_a_fast_and_a_slowed_framework_report_the_same_epoch_loss(runs, fast, slow):
    """One framework reading every 3 steps, the other slowed by 3 ms a step in ~30 ms auto windows: the same
    per-epoch train_loss within ``CROSS_RTOL``, and within the largest difference of their per-step losses. The
    windows' old mean of the fast one is more than 100 x ``CROSS_RTOL`` away from the other's loss."""
    a, b = runs[fast]["fast"]["train_loss"], runs[slow]["slow"]["train_loss"]
    np.testing.assert_allclose(a, b, rtol=CROSS_RTOL, atol=0)
    curves = [np.split(runs[name]["curve"], loss_runs.EPOCHS) for name in (fast, slow)]
    for epoch, (ca, cb) in enumerate(zip(*curves)):
        bound = np.abs(ca - cb).max() + 2 * loss_runs.SUM_RTOL * abs(b[epoch])
        assert abs(a[epoch] - b[epoch]) <= bound, (epoch, a, b, bound)
    old = loss_runs.old_windows_mean(runs[fast]["curve"])
    assert all(abs(o / x - 1) > 100 * CROSS_RTOL for o, x in zip(old, b)), (old, b)


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_gradient_accumulation_reports_the_mean_over_the_optimizer_steps(runs, name):
    """Batch 16 x 2 micro-batches: each optimizer step's loss is the mean of its two micro-batches', and the epoch's
    is the mean over its 44 optimizer steps: the same as one batch of 32 (tests/test_equivalence.py holds the two
    to 1e-5), read in other windows."""
    accumulated = loss_runs.loop(FRAMEWORKS[name], {"window": 7}, batch=16, accumulation=2)
    assert accumulated["steps"] == [44, 44]
    np.testing.assert_allclose(accumulated["train_loss"], runs[name]["fast"]["train_loss"], rtol=1e-5, atol=0)
