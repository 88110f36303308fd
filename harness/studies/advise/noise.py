"""The gradient noise scale from the squared gradient norms a trial recorded (``harness.record.GradientNoise``).

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training", Appendix A: with G the true
gradient and Sigma the per-sample gradient covariance, the squared norm of a gradient over b samples has expectation
E|G_b|^2 = |G|^2 + tr(Sigma) / b. From the norms at two sizes taken at the same parameters (micro-batches of b and
their mean over B = k b):

    |G|^2    ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1 / b - 1 / B)

each unbiased, and B_simple = tr(Sigma) / |G|^2, a ratio taken of averages (the paper's exponential moving averages),
never averaged itself: one noisy |G|^2 near zero would dominate a mean of ratios.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.record import GradientNoise

#: The exponential moving average's weight of the older evaluations (per evaluation, bias-corrected as Adam's).
DECAY = 0.5
#: The evaluations the estimate at a point pools: that one and the ones before it.
WINDOW = 3
#: The confidence of the interval (a bootstrap over the pooled probes).
CONFIDENCE = 0.95


def estimates(noise: GradientNoise) -> tuple[np.ndarray, np.ndarray]:
    """The unbiased estimates of |G|^2 and tr(Sigma) of each probe of one evaluation.

    Args:
        noise: one evaluation's squared norms (b = ``micro_batch`` < B = ``batch``).

    Returns:
        (|G|^2 per probe, tr(Sigma) per probe), float64 arrays of ``len(noise.big)``.

    Raises:
        ValueError: b >= B (one micro-batch: no second size to compare with).
    """
    b, big_b = noise.micro_batch, noise.batch
    if b >= big_b:
        raise ValueError(f"the noise scale needs two sizes: micro-batches of {b} in batches of {big_b}")
    small, big = np.asarray(noise.small, np.float64), np.asarray(noise.big, np.float64)
    return (big_b * big - b * small) / (big_b - b), (small - big) / (1 / b - 1 / big_b)


@dataclass
class NoiseScale:
    """The gradient noise scale of one trial: a trajectory over its evaluations and a value with its interval.

    trajectory: per evaluation, {"epoch", "train_loss", "test_accuracy", "b_simple"} with b_simple from the moving
    averages of |G|^2 and tr(Sigma) up to it (None while the |G|^2 average is not positive). at_epoch: the
    evaluation the value is taken at (the first to reach the target accuracy, else the last); b_simple and interval:
    the ratio of the means over the probes of the ``WINDOW`` evaluations up to it, and its ``CONFIDENCE`` bootstrap
    interval (``scipy.stats.bootstrap``, paired over probes); None with ``reason`` when it cannot be estimated.
    micro_batch, batch: b and B. probes: how many the value pools.
    """

    micro_batch: int
    batch: int
    trajectory: list[dict[str, Any]] = field(default_factory=list)
    at_epoch: int | None = None
    b_simple: float | None = None
    interval: tuple[float, float] | None = None
    probes: int = 0
    reason: str | None = None

    def record(self) -> dict[str, Any]:
        """As advice.json holds it."""
        return {"b_simple": self.b_simple, "interval": list(self.interval) if self.interval else None,
                "at_epoch": self.at_epoch, "micro_batch": self.micro_batch, "batch": self.batch,
                "probes": self.probes, "reason": self.reason, "trajectory": self.trajectory}


def noise_scale(epochs: list[Any], target: float | None = None, seed: int = 0) -> NoiseScale:
    """The noise scale of one trial from its evaluations (``harness.record.EpochMetrics`` with ``gradient_noise``).

    Args:
        epochs: the trial's evaluations in order; those without ``gradient_noise`` are ignored.
        target: a test accuracy: the value is taken at the first evaluation that reached it (the noise scale grows
            as the loss falls, and the steps to this target are what it predicts); None: at the last.
        seed: the bootstrap's.

    Returns:
        The ``NoiseScale``; its ``reason`` says why ``b_simple`` is None (no measurement, or an estimate of |G|^2
        that is not positive: the gradient is drowned in noise at these sizes).
    """
    measured = [e for e in epochs if e.gradient_noise is not None]
    if not measured:
        return NoiseScale(0, 0, reason="no gradient norms were recorded")
    first = measured[0].gradient_noise
    scale = NoiseScale(first.micro_batch, first.batch)
    try:
        per = [estimates(e.gradient_noise) for e in measured]
    except ValueError as err:
        scale.reason = str(err)
        return scale
    g_avg = s_avg = 0.0
    for i, (epoch, (g2, trace)) in enumerate(zip(measured, per)):
        g_avg = DECAY * g_avg + (1 - DECAY) * float(g2.mean())
        s_avg = DECAY * s_avg + (1 - DECAY) * float(trace.mean())
        correction = 1 - DECAY ** (i + 1)  # the averages start at 0: divided out, as Adam's moments
        value = (s_avg / correction) / (g_avg / correction) if g_avg > 0 else None
        scale.trajectory.append({"epoch": epoch.epoch, "train_loss": epoch.train_loss,
                                 "test_accuracy": epoch.test_accuracy, "b_simple": value})
    at = next((i for i, e in enumerate(measured) if target is not None and (e.test_accuracy or 0) >= target),
              len(measured) - 1)
    scale.at_epoch = measured[at].epoch
    pooled_g = np.concatenate([g for g, _ in per[max(0, at - WINDOW + 1):at + 1]])
    pooled_s = np.concatenate([s for _, s in per[max(0, at - WINDOW + 1):at + 1]])
    scale.probes = len(pooled_g)
    if pooled_g.mean() <= 0:
        scale.reason = (f"the estimate of |G|^2 is not positive at epoch {scale.at_epoch} (the gradient is drowned "
                        "in noise at these sizes: measure at a larger batch, or with more probes)")
        return scale
    scale.b_simple = float(pooled_s.mean() / pooled_g.mean())
    scale.interval = ratio_interval(pooled_s, pooled_g, seed)
    return scale


def ratio_interval(numerator: np.ndarray, denominator: np.ndarray, seed: int = 0) -> tuple[float, float] | None:
    """The ``CONFIDENCE`` interval of mean(numerator) / mean(denominator), paired samples, by the bootstrap
    (``scipy.stats.bootstrap``, BCa where it can, else percentile); None with fewer than 3 pairs. An upper end that
    a resample with a mean denominator at or below zero would make unbounded is ``inf``."""
    if len(numerator) < 3:
        return None
    from scipy import stats

    def ratio(s: np.ndarray, g: np.ndarray, axis: int = -1) -> np.ndarray:
        g_mean = np.mean(g, axis=axis)
        return np.where(g_mean > 0, np.mean(s, axis=axis) / np.where(g_mean > 0, g_mean, 1.0), np.inf)

    for method in ("BCa", "percentile"):
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")  # BCa on near-constant data: scipy warns, then the percentile method
            try:
                result = stats.bootstrap((numerator, denominator), ratio, paired=True, vectorized=True,
                                         confidence_level=CONFIDENCE, n_resamples=2000, method=method,
                                         random_state=np.random.default_rng(seed))
            except (ValueError, FloatingPointError):
                continue
        low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
        if not (math.isnan(low) or math.isnan(high)):
            return low, high
    return None
