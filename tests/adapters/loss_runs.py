"""The epoch's training loss as the harness's own loop (``harness.execution.worker.train``) reports it, with a real
adapter on the CPU: shared by tests/adapters/test_train_loss.py (PyTorch, TensorFlow, MXNet in one process) and
tests/adapters/jax_suite.py and scenarios.py (JAX in envs/jax, compared with PyTorch by test_jax.py).

The run: ``kit.CNN`` on digits, plain SGD at 0.01 (the issue's optimizer), batch 32, 2 epochs of 44 steps, 3 warm-up
steps, an evaluation after each epoch. ``FAST`` reads the loss every 3 steps (29 windows); ``SLOW`` slows every step by
3 ms and sizes ~30 ms windows by the measured step time, as a slower framework's would be (about 8 steps, 12
windows on an idle machine); its windows hold at least 4 steps (``min_window_steps``), so there are at most 21 of them
however loaded the machine is, and never FAST's 29."""

from __future__ import annotations

import time

import numpy as np

from harness.execution.worker import train
from harness.spec import OptimizerSpec
from tests.adapters import kit
from tests.helpers import loop_trial

OPTIMIZER = OptimizerSpec(name="sgd", learning_rate=0.01)
BATCH, EPOCHS, WARMUP, FAST_WINDOW = 32, 2, 3, 3
FAST = {"window": FAST_WINDOW}
SLOW = {"window": "auto", "window_seconds": 0.03, "min_window_steps": FAST_WINDOW + 1}
SLOW_STEP_S = 0.003
#: Relative rounding of a float32 sum of n positive losses, at most (n - 1) x 2^-24 (here n = 44 steps an epoch):
#: the bound for the same framework's epoch loss read in other windows (every step's loss is bit for bit the same).
SUM_RTOL = 44 * 2.0 ** -24


def slowed(adapter_cls: type, seconds: float = SLOW_STEP_S) -> type:
    """``adapter_cls`` whose every train_step also sleeps ``seconds`` after queueing its work: the same steps, more
    time each (fewer of them fit in an auto window)."""

    class Slowed(adapter_cls):
        def train_step(self, batch, micro_batches=1):
            super().train_step(batch, micro_batches)
            time.sleep(seconds)

    Slowed.__name__ = f"Slowed{adapter_cls.__name__}"
    return Slowed


def loop(adapter_cls: type, timing: dict, batch: int = BATCH, accumulation: int = 1) -> dict[str, list]:
    """The loop's per-epoch ``train_loss`` and ``train_loss_steps``, and its ``timed_windows``, for ``adapter_cls``
    built from the canonical weights; ``batch`` x ``accumulation`` samples per optimizer step. Asserts that nothing
    was traced or compiled inside the timed windows (``recompilations``)."""
    adapter, data, _ = kit.make(adapter_cls, optimizer=OPTIMIZER)
    trial = loop_trial(batch, timing, accumulation, epochs=EPOCHS, warmup_steps=WARMUP)
    metrics = train(adapter, data, trial, lambda event: None)
    assert metrics.recompilations in (None, 0), metrics.recompilations  # restarting the sum compiles nothing
    return {"train_loss": [e.train_loss for e in metrics.epochs],
            "steps": [e.train_loss_steps for e in metrics.epochs], "windows": [metrics.timed_windows]}


def per_step(adapter_cls: type) -> np.ndarray:
    """Every step's loss of the same run, read after each step (``kit.train_on``), float64 (EPOCHS x 44,)."""
    adapter, data, _ = kit.make(adapter_cls, optimizer=OPTIMIZER)
    steps = [b for epoch in range(EPOCHS) for b in kit.epoch_batches(len(data.y_train), BATCH, epoch)]
    return np.asarray(kit.train_on(adapter, steps)[0], dtype=np.float64)


def epoch_means(curve: np.ndarray) -> list[float]:
    """The mean over every step of each epoch: what ``train_loss`` must be."""
    return [float(part.mean()) for part in np.split(curve, EPOCHS)]


def old_windows_mean(curve: np.ndarray, window: int = FAST_WINDOW) -> list[float]:
    """What the loop reported before loss sums, from the same per-step losses: per epoch, the mean of the losses of
    the steps that ended a read (the warm-up's last, then each window of ``window`` steps' last)."""
    spe = len(curve) // EPOCHS
    means = []
    for epoch in range(EPOCHS):
        start = WARMUP if epoch == 0 else 0
        ends = ([WARMUP - 1] if epoch == 0 else []) + [min(p + window, spe) - 1 for p in range(start, spe, window)]
        means.append(float(np.mean(curve[[epoch * spe + i for i in ends]])))
    return means


def check_windows_do_not_change_the_loss(adapter_cls: type) -> dict[str, object]:
    """In one framework: the epoch loss of fast windows and of slowed steps in auto windows is the mean of every
    step's loss (within ``SUM_RTOL``) over all 44 steps of each epoch, warm-up included, although the windows differ;
    the windows' old mean is 10 x ``SUM_RTOL`` and more away from it (so these checks fail on it). Returns the runs
    for comparisons across frameworks."""
    curve = per_step(adapter_cls)
    exact = epoch_means(curve)
    runs = {"curve": curve, "fast": loop(adapter_cls, FAST), "slow": loop(slowed(adapter_cls), SLOW)}
    assert runs["fast"]["windows"] != runs["slow"]["windows"], runs  # the windows did differ (by construction)
    for name in ("fast", "slow"):
        assert runs[name]["steps"] == [44] * EPOCHS, (name, runs[name])
        np.testing.assert_allclose(runs[name]["train_loss"], exact, rtol=SUM_RTOL, atol=0, err_msg=name)
    old = old_windows_mean(curve)
    assert all(abs(o / e - 1) > 10 * SUM_RTOL for o, e in zip(old, exact)), (old, exact)
    return runs
