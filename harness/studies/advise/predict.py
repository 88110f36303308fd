"""From measurements to the batch size per objective: the candidates, the throughput curve and its knee, and steps,
time and energy to a target predicted from the gradient noise scale.

Steps to a target at batch size B (McCandlish et al. 2018, eq. 2.11; Shallue et al. 2018 measured the same three
regimes): S(B) = S_min (1 + B_noise / B), when the learning rate suits each size. With the measured seconds per step
t(B) and joules per step e(B), time to target T(B) = S(B) t(B) and energy to target E(B) = S(B) e(B). The size that
minimises T or E does not depend on S_min; S_min, which turns the curve into seconds, comes from one trial that
reached the target at a known size B0 in S0 steps: S_min = S0 / (1 + B_noise / B0).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from harness.results import answer
from harness.results.answer import Point
from harness.results.stats import mean_ci


def candidates(smallest: int, largest: int, recommended: int | None = None) -> list[int]:
    """The sizes the throughput stage measures: the powers of two from ``smallest`` to ``largest``, both ends, the
    memory recommendation when given, and n - 1 and n + 1 around the middle power of two (whether powers of two
    matter, seed 000). Sorted, unique, each within [smallest, largest].

    Raises:
        ValueError: smallest < 1 or largest < smallest.
    """
    if smallest < 1 or largest < smallest:
        raise ValueError(f"no batch sizes between {smallest} and {largest}")
    powers = [2 ** i for i in range(math.ceil(math.log2(smallest)), int(math.log2(largest)) + 1)]
    sizes = {smallest, largest, *powers}
    if recommended is not None:
        sizes.add(min(largest, max(smallest, recommended)))
    inner = [p for p in powers if smallest < p - 1 and p + 1 < largest]
    if inner:
        middle = inner[len(inner) // 2]
        sizes |= {middle - 1, middle + 1}
    return sorted(sizes)


@dataclass
class Speed:
    """One size's measured speed over its repeats: seconds per optimizer step and throughput (samples/s), medians
    and 95 % t-intervals of the mean over repeats (None with one repeat); joules per step where the device has an
    energy counter, and why a repeat has none where it has (``harness.record.EnergyInfo.note``)."""

    batch_size: int
    step_s: list[float]
    throughput: list[float]
    energy_per_step_j: list[float] = field(default_factory=list)
    energy_notes: list[str] = field(default_factory=list)

    @property
    def step_s_median(self) -> float:
        return statistics.median(self.step_s)

    @property
    def throughput_median(self) -> float:
        return statistics.median(self.throughput)

    @property
    def throughput_interval(self) -> tuple[float, float] | None:
        return t_interval(self.throughput)

    @property
    def energy_median(self) -> float | None:
        return statistics.median(self.energy_per_step_j) if self.energy_per_step_j else None

    def record(self) -> dict[str, Any]:
        interval = self.throughput_interval
        return {"batch_size": self.batch_size, "step_s_median": self.step_s_median,
                "throughput_median": self.throughput_median,
                "throughput_interval": list(interval) if interval else None,
                "energy_per_step_j": self.energy_median, "repeats": len(self.step_s)}


def t_interval(values: list[float]) -> tuple[float, float] | None:
    """The 95 % t-interval of the mean of ``values`` (``harness.results.stats.mean_ci``), its lower end at least 0 (a
    throughput or a time is not negative; with 2 repeats the interval is 12.7 standard errors wide); None for fewer
    than 2."""
    interval = mean_ci(values)
    return None if interval is None else (max(0.0, interval[0]), interval[1])


def fastest_and_knee(speeds: list[Speed]) -> tuple[Speed, Speed]:
    """The size of the highest median throughput, and the knee (``harness.results.answer.fastest_and_knee``: the
    rule every run's report also uses).

    Raises:
        ValueError: no speeds.
    """
    by_size = {s.batch_size: s for s in speeds}
    best, knee = answer.fastest_and_knee([Point(s.batch_size, s.throughput_median, s.throughput_interval)
                                          for s in speeds])
    return by_size[best.batch_size], by_size[knee.batch_size]


def steps_to_target(batch_size: float, b_noise: float, s_min: float) -> float:
    """S(B) = S_min (1 + B_noise / B): optimizer steps to the target at ``batch_size`` (McCandlish et al. 2018)."""
    return s_min * (1 + b_noise / batch_size)


@dataclass
class Prediction:
    """Per candidate size: predicted steps, seconds and joules to the target (seconds and joules None without
    S_min, joules None without energy), and the sizes that minimise time and energy, with the range of sizes that
    would be chosen anywhere in the noise scale's interval (``time_range``, ``energy_range``)."""

    rows: list[dict[str, Any]]
    time_best: int | None
    time_range: tuple[int, int] | None
    energy_best: int | None
    energy_range: tuple[int, int] | None


def predict(speeds: list[Speed], b_noise: float, interval: tuple[float, float] | None,
            s_min: float | None) -> Prediction:
    """Steps, time and energy to the target of every measured size from the noise scale ``b_noise`` (its
    ``interval``) and ``s_min`` (None: relative figures only, the best sizes still follow)."""
    def cost(s: Speed, b: float, per_step: float | None) -> float | None:
        return None if per_step is None else (1 + b / s.batch_size) * per_step

    def best(b: float, energy: bool) -> int | None:
        scored = [(c, s.batch_size) for s in speeds
                  if (c := cost(s, b, s.energy_median if energy else s.step_s_median)) is not None]
        return min(scored)[1] if scored else None

    rows = []
    for s in speeds:
        steps = steps_to_target(s.batch_size, b_noise, s_min) if s_min is not None else None
        energy = s.energy_median
        rows.append({"batch_size": s.batch_size, "steps": steps,
                     "relative_time": cost(s, b_noise, s.step_s_median),
                     "seconds": None if steps is None else steps * s.step_s_median,
                     "joules": None if steps is None or energy is None else steps * energy})
    ends = [b_noise] + ([x for x in interval if math.isfinite(x)] if interval else [])

    def spread(energy: bool) -> tuple[int, int] | None:
        chosen = [c for b in ends if (c := best(b, energy)) is not None]
        return (min(chosen), max(chosen)) if chosen else None

    return Prediction(rows, best(b_noise, False), spread(False), best(b_noise, True), spread(True))
