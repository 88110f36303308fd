"""Statistics over repeats (medians and percentile-bootstrap confidence intervals), over seeds (means and Student-t
intervals), and the noise of a metric on a machine (pooled spread of log values).

The two intervals are scipy.stats's (``bootstrap``, ``t.interval``) computed in numpy and ``scipy.special``, to the
bit: importing scipy.stats alone costs the report about a second of CPU (``tests/results/test_stats.py`` holds them
equal)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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
    # scipy.stats.bootstrap(..., method="percentile"): resamples drawn as rng.integers(0, n, (resamples, n)), the
    # statistic over the last axis, then scipy.stats.quantile's default ('linear', Hyndman and Fan's 7) at alpha/2
    # and 1 - alpha/2 in scipy's own arithmetic
    rng = np.random.default_rng(seed)
    theta = np.sort(np.median(data[rng.integers(0, data.size, (resamples, data.size))], axis=-1))
    alpha = np.asarray((1 - confidence) / 2, dtype=theta.dtype)
    p = np.stack((alpha, 1 - alpha))
    n = float(theta.size)
    jg = p * n + (1 - p)
    jp1 = jg // 1
    j = jp1 - 1
    g = jg % 1
    g[j < 0] = 0
    low_i, high_i = np.clip(j, 0.0, n - 1).astype(np.int64), np.clip(jp1, 0.0, n - 1).astype(np.int64)
    low, high = (1 - g) * theta[low_i] + g * theta[high_i]
    return float(low), float(high)


def mean_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The Student-t confidence interval of the mean of ``values`` (scipy.stats.t), or None for fewer than two
    values; for the spread over seeds, whose values are independent draws of the same training."""
    data = _finite(values)
    if data.size < 2:
        return None
    if np.all(data == data[0]):  # no spread: a zero-width interval (scipy's would be nan)
        return float(data[0]), float(data[0])
    from scipy.special import stdtrit  # here, not at the top: a run with one seed never needs it

    # scipy.stats.t.interval(confidence, n - 1, loc=mean, scale=sem) as scipy computes it: ppf(q) * scale + loc
    scale, loc, q = np.std(data, ddof=1) / np.sqrt(data.size), data.mean(), np.asarray(confidence)
    low = stdtrit(data.size - 1, (1.0 - q) / 2) * scale + loc
    high = stdtrit(data.size - 1, (1.0 + q) / 2) * scale + loc
    return float(low), float(high)


def overlaps(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool | None:
    """Whether two intervals overlap (None when either is missing)."""
    if a is None or b is None:
        return None
    return a[0] <= b[1] and b[0] <= a[1]


def log_spread(groups: Sequence[Sequence[float]]) -> tuple[float, int] | None:
    """The pooled within-group standard deviation of log values, and its degrees of freedom: each group (a cell's
    repeats, or a cell's medians over runs) is centred on its own mean, and the squared deviations of all groups
    are summed over sum(n_i - 1). On the log scale a deviation is relative (0.05 is about 5 %), so cells of
    different magnitudes pool. Groups of fewer than two positive finite values are left out; None when none is
    left."""
    squares, df = 0.0, 0
    for group in groups:
        data = _finite(group)
        data = np.log(data[data > 0])
        if data.size < 2:
            continue
        if np.any(data != data[0]):  # equal values have no spread (their mean may differ from them in the last bit)
            squares += float(((data - data.mean()) ** 2).sum())
        df += data.size - 1
    return (float(np.sqrt(squares / df)), df) if df else None


def moderated(own: tuple[float, int] | None, pooled: tuple[float, int], prior_df: int) -> tuple[float, int]:
    """A cell's spread shrunk towards the pooled one, as a moderated t-statistic does (Smyth, "Linear models and
    empirical Bayes methods for assessing differential expression", 2004): s^2 = (d0 s0^2 + d s^2) / (d0 + d) with
    d0 = ``prior_df`` degrees of freedom given to the pooled spread s0; a noisy cell keeps most of its own spread, a
    cell with few repeats borrows from the others. Returns (s, d0 + d)."""
    s0, _ = pooled
    if own is None:
        return s0, prior_df
    s, d = own
    return float(np.sqrt((prior_df * s0 ** 2 + d * s ** 2) / (prior_df + d))), prior_df + d


def pooled(spreads: Sequence[tuple[float, int] | None]) -> tuple[float, int] | None:
    """Spreads (s, df) of several groups pooled into one: sqrt(sum(df s^2) / sum(df)), sum(df); None when no
    group has a spread."""
    known = [s for s in spreads if s is not None]
    df = sum(d for _, d in known)
    return (float(np.sqrt(sum(d * s ** 2 for s, d in known) / df)), df) if df else None
