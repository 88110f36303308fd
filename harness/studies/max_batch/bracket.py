"""The next probe of the max-batch search (``harness.studies.max_batch.search``, steps 2-4 of
docs/design/max-batch.md): the memory line near the limit and where it puts the next probe, above everything that
fitted or inside the bracket. Pure functions over sizes and peaks; imports the memory model only.

Measured peaks are not a straight line in the batch size everywhere (PyTorch's per-sample bytes under glibc's
allocator grow from about 0.6 MB at batch 16..64 to 0.9 MB near its limit under 400 MB, specs/max_batch.yaml): a line
through two small sizes, extrapolated several times their size, puts the limit too high. So the line is drawn through
the two largest sizes that fit (far enough apart that noise does not decide its slope), a long extrapolation is probed
only part of the way (``AIM``), and a prediction beyond a failure puts the next probe a quarter of the bracket below
that failure instead of at its middle.
"""

from __future__ import annotations

import math

import numpy as np

from harness.studies.max_batch.memory_model import MemoryModel, fit_memory_model

AIM = 0.7  # a prediction more than LONG x the largest size that fits is probed this fraction of the way to it
LONG = 2.0
PARTNER = 0.75  # the line's second point: the largest fitting size at most this fraction of the largest one
MAX_JUMP = 8  # a bracket wider than this factor is halved on a log scale after the neutral model's guess
BELOW_FAILURE = "below the failure"


def local_line(points: dict[int, float]) -> MemoryModel | None:
    """The memory line near the limit, from ``points`` {size: peak bytes (the mean of its probes)}: through the
    largest size that fits, with the steeper of two slopes: the chord to the largest fitting size at most PARTNER x
    it (else the next one below it), and the least-squares line through every point (a bump in the peaks between
    two neighbours, glibc's allocator changing how it serves a tensor of some size, flattens the chord and would put
    the limit far too high). None with fewer than two sizes."""
    sizes = sorted(points)
    if len(sizes) < 2:
        return None
    top = sizes[-1]
    below = [s for s in sizes[:-1] if s <= PARTNER * top]
    partner = below[-1] if below else sizes[-2]
    chord = fit_memory_model([(partner, points[partner]), (top, points[top])])
    overall = fit_memory_model(list(points.items()))
    assert chord is not None and overall is not None  # two distinct sizes at least
    slope = max(chord.per_sample_bytes, overall.per_sample_bytes)
    return MemoryModel(points[top] - slope * top, slope, chord.r2, len(points))


def curved_limit(points: dict[int, float], cap_bytes: float) -> int | None:
    """Where a parabola through the fitting sizes' peaks (least squares, at least three sizes, the largest at least
    4 x the smallest) reaches ``cap_bytes``, when it bends upward (per-sample bytes growing with the batch); None
    otherwise."""
    sizes = sorted(points)
    if len(sizes) < 3 or sizes[-1] < 4 * sizes[0]:
        return None
    a, b, c = np.polyfit(np.asarray(sizes, float), np.asarray([points[s] for s in sizes], float), 2)
    if a <= 0:
        return None
    root = (-b + math.sqrt(max(0.0, b * b - 4 * a * (c - cap_bytes)))) / (2 * a)
    return max(0, math.floor(root))


def upward(lo: int, prediction: int | None, climb: int, gap: int, fitted: bool, largest: int,
           ceiling: int | None = None) -> tuple[int, str, int]:
    """The next probe above everything that fitted (largest ``lo``), with no failure yet, at most ``largest``: the
    prediction (a fitted one more than LONG x ``lo`` only AIM of the way there, and at most ``ceiling``, where the
    neutral model's per-sample bytes put the limit, ``_Search.ceiling``; the neutral model's guess, ``fitted``
    False, as it is), at least one tolerance step (``gap``) above ``lo``; doubling without one; where the prediction
    is at or below ``lo``, one step up, the step doubling each time (``climb``: the steps so far). Returns (size,
    purpose, the new climb)."""
    if prediction is None:
        size, purpose = 2 * lo, "doubling"
    elif prediction > lo:
        far = fitted and prediction > LONG * lo
        size = lo + math.ceil(AIM * (prediction - lo)) if far else prediction
        # at least one step up: a failure there closes the bracket
        size, purpose, climb = max(size, lo + gap), "prediction" if fitted else "neutral-model guess", 0
        if fitted and ceiling is not None and size > max(ceiling, lo + gap):
            size, purpose = max(ceiling, lo + gap), "prediction, at most the neutral model's limit"
    else:
        size, purpose, climb = lo + (gap << climb), "step up", climb + 1
    return min(size, largest), purpose, climb


def inside(lo: int, hi: int, prediction: int | None, gap: int, fitted: bool, hi_fitted: bool = False,
           missed: bool = False) -> tuple[int, str]:
    """The next probe inside the bracket (``lo`` fits, ``hi`` failed at least once): one step below ``hi`` where
    ``hi`` also fitted once (``hi_fitted``: the boundary is there, within the noise); the prediction where it falls
    inside; one step above ``lo`` where a fitted line puts the limit at ``lo``; a quarter of the bracket below ``hi``
    where it puts the limit at or beyond ``hi`` (the line is too steep nowhere but too shallow near the limit: see
    the module docstring) while the bracket is within LONG x ``lo`` and the last such probe did not fail too
    (``missed``); else the middle: geometric while hi > MAX_JUMP x lo after the neutral model's guess (``fitted``
    False), so that a guess orders of magnitude off costs a few probes; arithmetic after a fitted line's (measured
    peaks put the limit within a small factor: on a GPU a geometric middle of 64..240,000 probes 4,000). Kept one
    tolerance step (``gap``) away from both ends, so that either outcome of a probe next to an end closes the
    bracket."""
    if hi - lo <= 2 * gap:
        return (lo + hi) // 2, "bisection"
    middle = math.isqrt(lo * hi) if hi > MAX_JUMP * lo and not fitted else (lo + hi) // 2
    size, purpose = middle, "bisection"
    if hi_fitted:
        size, purpose = hi - gap, "below a size that fits sometimes"
    elif prediction is not None and lo < prediction < hi:
        size, purpose = prediction, "prediction"
    elif fitted and prediction is not None and prediction <= lo:
        size, purpose = lo + gap, "prediction"  # the line puts the limit at lo: one step above it decides
    elif fitted and prediction is not None and hi <= LONG * lo and not missed:
        size, purpose = hi - max(gap, (hi - lo) // 4), BELOW_FAILURE
    return min(max(size, lo + gap), hi - gap), purpose
