"""Statistics over repeats (medians and bootstrap confidence intervals, scipy.stats.bootstrap) and over seeds (means
and Student-t intervals, scipy.stats.t)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy import stats as scipy_stats

CONFIDENCE = 0.95


def _finite(values: Sequence[float]) -> np.ndarray:
    return np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float)


def median_ci(values: Sequence[float], confidence: float = CONFIDENCE, resamples: int = 2000,
              seed: int = 0) -> tuple[float, float] | None:
    """The percentile-bootstrap confidence interval of the median of ``values`` (scipy.stats.bootstrap), or None
    for fewer than two values or values that are all equal (a zero-width interval says nothing about noise, so it is
    returned as (v, v)). Deterministic for a given seed."""
    data = _finite(values)
    if data.size < 2:
        return None
    if np.all(data == data[0]):
        return float(data[0]), float(data[0])
    result = scipy_stats.bootstrap((data,), np.median, confidence_level=confidence, n_resamples=resamples,
                                   method="percentile", random_state=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def mean_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The Student-t confidence interval of the mean of ``values`` (scipy.stats.t), or None for fewer than two
    values; for the spread over seeds, whose values are independent draws of the same training."""
    data = _finite(values)
    if data.size < 2:
        return None
    if np.all(data == data[0]):  # no spread: a zero-width interval (scipy's would be nan)
        return float(data[0]), float(data[0])
    low, high = scipy_stats.t.interval(confidence, data.size - 1, loc=data.mean(), scale=scipy_stats.sem(data))
    return float(low), float(high)


def overlaps(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool | None:
    """Whether two intervals overlap (None when either is missing)."""
    if a is None or b is None:
        return None
    return a[0] <= b[1] and b[0] <= a[1]
