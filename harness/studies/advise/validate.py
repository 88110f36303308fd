"""``harness advise --validate``: the candidates trained to the target with several seeds, by successive halving
(Jamieson and Talwalkar 2016, "Non-stochastic Best Arm Identification and Hyperparameter Optimization"; the rung
structure of Li et al. 2018, Hyperband), and the prediction judged against what was measured.

Each round trains every surviving size with ``SEEDS_PER_ROUND`` new seeds until it reaches the target
(``stop_at_target``, at most the spec's epochs); the sizes are ranked by the median over all their seeds so far of
the seconds of timed training to the target (``harness.record.TimeToTarget.training_s``, the quantity the
prediction gives), a seed that never reached it counting as infinitely slow; the better half (rounded up) goes on,
until at most two are left, which get one last round. The predicted size held when its measured median lies within
``HOLD_RATIO`` of the measured best's (issue 56's goal for the pick).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: New seeds each surviving size trains with per round.
SEEDS_PER_ROUND = 2
#: The prediction held when its size's measured median seconds to target is at most this multiple of the best's.
HOLD_RATIO = 1.25


def median_seconds(values: list[float | None]) -> float:
    """The median of seconds to target over seeds, a seed that did not reach it counting as infinitely slow
    (``math.inf`` when at least half did not); ``math.inf`` for no values."""
    if not values:
        return math.inf
    return statistics.median([math.inf if v is None else v for v in values])


@dataclass
class Validation:
    """What successive halving measured: per size, the seconds to target of each seed it trained with (None: not
    reached), the sizes each round trained, and the measured best (None when no size reached the target)."""

    seconds: dict[int, list[float | None]] = field(default_factory=dict)
    rounds: list[list[int]] = field(default_factory=list)
    cut: bool = False

    @property
    def best(self) -> int | None:
        last = self.rounds[-1] if self.rounds else []
        ranked = sorted(last, key=lambda b: (median_seconds(self.seconds[b]), b))
        return ranked[0] if ranked and math.isfinite(median_seconds(self.seconds[ranked[0]])) else None

    def judge(self, predicted: int | None) -> dict[str, Any]:
        """The record ``advice.json`` keeps under the time objective's ``validation``.

        Args:
            predicted: the size the prediction recommends (None: none).

        Returns:
            ``measured_best`` and its median seconds, the predicted size's median seconds (None where it was not
            trained), their ratio, ``held`` (ratio <= ``HOLD_RATIO``; None where it cannot be told), the rounds,
            and per size the seeds' seconds and medians.
        """
        best = self.best
        best_s = None if best is None else median_seconds(self.seconds[best])
        pick_s = median_seconds(self.seconds[predicted]) if predicted in self.seconds else None
        ratio = None  # inf: the pick never reached the target
        if pick_s is not None and best_s is not None:
            ratio = pick_s / best_s if best_s > 0 else (1.0 if pick_s == 0 else math.inf)
        return {"measured_best": best, "measured_best_s": best_s, "predicted": predicted,
                "predicted_measured_s": None if pick_s is None else _finite(pick_s),
                "ratio": None if ratio is None else _finite(ratio),
                "held": None if ratio is None else ratio <= HOLD_RATIO, "hold_ratio": HOLD_RATIO,
                "rounds": self.rounds, "cut": self.cut,
                "sizes": {str(b): {"seconds": s, "median_s": _finite(median_seconds(s)),
                                   "reached": sum(v is not None for v in s), "seeds": len(s)}
                          for b, s in sorted(self.seconds.items())}}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def successive_halving(sizes: list[int], train: Callable[[list[int], list[int]], dict[int, list[float | None]]],
                       first_seed: int, allows: Callable[[], bool] = lambda: True) -> Validation:
    """Successive halving over ``sizes`` (see the module docstring).

    Args:
        sizes: the candidate batch sizes.
        train: trains the given sizes with the given seeds to the target; returns per size the seconds to target of
            each seed (None: not reached).
        first_seed: the first round's first seed; each round's seeds follow the last round's.
        allows: asked before each round (a budget); False ends the halving with what was measured (``cut``).

    Returns:
        The Validation.

    Raises:
        ValueError: no sizes.
    """
    if not sizes:
        raise ValueError("successive halving needs at least one size")
    result = Validation(seconds={b: [] for b in sizes})
    alive, seed = sorted(sizes), first_seed
    while True:
        if not allows():
            result.cut = True
            break
        seeds = list(range(seed, seed + SEEDS_PER_ROUND))
        seed += SEEDS_PER_ROUND
        measured = train(alive, seeds)
        for b in alive:
            result.seconds[b].extend(measured.get(b, [None] * len(seeds)))
        result.rounds.append(list(alive))
        if len(alive) <= 2:
            break
        ranked = sorted(alive, key=lambda b: (median_seconds(result.seconds[b]), b))
        alive = sorted(ranked[:max(2, math.ceil(len(alive) / 2))])
    return result
