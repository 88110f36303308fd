"""The memory model of the max-batch search, seed 004's rule of thumb fitted to measurements:
``peak_bytes = fixed_bytes + per_sample_bytes x batch size``. Imports nothing of the harness."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class MemoryModel:
    """peak_bytes = fixed_bytes + per_sample_bytes x batch size, least squares over ``points`` probes; r2 is the
    coefficient of determination (1.0 for two points, which a line always fits)."""

    fixed_bytes: float
    per_sample_bytes: float
    r2: float
    points: int

    def predict_limit(self, cap_bytes: float) -> int | None:
        """The largest batch size whose predicted peak is within ``cap_bytes``; None when the per-sample cost is not
        positive (no prediction) or the fixed part alone exceeds the cap (0)."""
        if self.per_sample_bytes <= 0:
            return None
        return max(0, math.floor((cap_bytes - self.fixed_bytes) / self.per_sample_bytes + 1e-9))  # not 399.99..

    def predict_peak(self, batch_size: int) -> float:
        return self.fixed_bytes + self.per_sample_bytes * batch_size


def fit_memory_model(points: Sequence[tuple[float, float]]) -> MemoryModel | None:
    """Least-squares line through (batch size, peak bytes) points; None with fewer than two distinct sizes."""
    if len({b for b, _ in points}) < 2:
        return None
    x = np.asarray([b for b, _ in points], dtype=float)
    y = np.asarray([p for _, p in points], dtype=float)
    per_sample, fixed = np.polyfit(x, y, 1)
    residual = float(np.sum((y - (fixed + per_sample * x)) ** 2))
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - residual / total if total > 0 else (1.0 if residual == 0 else 0.0)
    return MemoryModel(float(fixed), float(per_sample), r2, len(points))
