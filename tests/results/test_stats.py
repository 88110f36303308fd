"""harness.results.stats's intervals are scipy.stats's, to the bit, computed without importing scipy.stats."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as scipy_stats

from harness.results.stats import mean_ci, median_ci


def _samples() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    found = []
    for i in range(300):
        n = int(rng.integers(2, 12))
        kind = i % 3  # timings (log-normal), ties (small integers), large values of either sign
        values = (rng.lognormal(3, 1, n) if kind == 0 else rng.integers(0, 4, n).astype(float) if kind == 1
                  else rng.normal(0, 1e6, n))
        if not np.all(values == values[0]):
            found.append(values)
    return found


@pytest.mark.parametrize("confidence", [0.95, 0.8])
def test_median_ci_is_scipys_bootstrap(confidence: float) -> None:
    for values in _samples():
        for seed in (0, 7):
            ref = scipy_stats.bootstrap((values,), np.median, confidence_level=confidence, n_resamples=2000,
                                        method="percentile", random_state=np.random.default_rng(seed))
            expected = (float(ref.confidence_interval.low), float(ref.confidence_interval.high))
            assert median_ci(list(values), confidence, seed=seed) == expected, values


@pytest.mark.parametrize("confidence", [0.95, 0.8])
def test_mean_ci_is_scipys_t_interval(confidence: float) -> None:
    for values in _samples():
        low, high = scipy_stats.t.interval(confidence, values.size - 1, loc=values.mean(),
                                           scale=scipy_stats.sem(values))
        assert mean_ci(list(values), confidence) == (float(low), float(high)), values
