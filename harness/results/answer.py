"""The report's first section: the answer the run's data supports, before the evidence. Per row (framework and
variant): the fastest batch size with its 95 % interval and the knee, the most accurate after the run's epochs, the
first to reach the target accuracy, and the powers-of-two verdict where the spec has neighbours of one. The same rule
for the knee serves ``harness advise`` (``fastest_and_knee``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from harness.results.batch_studies import power_neighbours
from harness.results.metrics import title
from harness.results.sections import BulletList, Paragraph, Section
from harness.results.tables import ReportData, cell_values

#: The knee: the smallest size whose throughput interval reaches this share of the best median throughput.
KNEE_SHARE = 0.95


@dataclass(frozen=True)
class Point:
    """One batch size's throughput: the median over repeats (samples/s) and its 95 % interval (None: one repeat)."""

    batch_size: int
    median: float
    interval: tuple[float, float] | None = None


def fastest_and_knee(points: Sequence[Point]) -> tuple[Point, Point]:
    """The point of the highest median throughput, and the knee: the smallest batch size whose interval (its median
    without one) reaches ``KNEE_SHARE`` of that median.

    Raises:
        ValueError: no points.
    """
    if not points:
        raise ValueError("no size was measured")
    best = max(points, key=lambda p: p.median)
    goal = KNEE_SHARE * best.median
    knee = next(p for p in sorted(points, key=lambda p: p.batch_size)
                if (p.interval[1] if p.interval is not None else p.median) >= goal)
    return best, knee


def _fastest_line(data: ReportData, row: str) -> str | None:
    metric = data.metric("throughput")
    if metric is None:
        return None
    cis = data.cis.get("throughput", {})
    points = [Point(bs, float(np.median(values)), cis.get((row, bs))) for bs in data.batch_sizes
              if (values := cell_values(data.records, metric, row, bs))]
    if not points:
        return None
    best, knee = fastest_and_knee(points)
    sure = (f", 95 % interval {best.interval[0]:,.0f}..{best.interval[1]:,.0f}" if best.interval else
            ", one repeat: no interval")
    return (f"fastest at batch size {best.batch_size} ({best.median:,.0f} samples/s{sure}); the knee, the "
            f"smallest within {100 * KNEE_SHARE:g} % of it: {knee.batch_size}")


def _accurate_line(data: ReportData, row: str) -> str | None:
    metric = data.metric("accuracy")
    if metric is None:
        return None
    medians = [(float(np.median(values)), -bs) for bs in data.batch_sizes
               if (values := cell_values(data.records, metric, row, bs))]
    if not medians:
        return None
    best, size = max(medians)
    epochs = data.spec.get("epochs") or 1
    return f"most accurate after {epochs} epoch{'' if epochs == 1 else 's'}: batch size {-size} ({best:.2f} %)"


def _target_line(data: ReportData, row: str) -> str | None:
    target = data.spec.get("target_accuracy")
    if not target:
        return None
    reached = []
    for bs in data.batch_sizes:
        seconds = [r.metrics.time_to_target.training_s for r in data.cell_records(row, bs)
                   if r.ok and r.metrics.time_to_target is not None]
        if seconds:
            reached.append((float(np.median(seconds)), bs))
    if not reached:
        return f"no batch size reached {100 * target:g} % test accuracy"
    fastest, size = min(reached)
    return f"first to {100 * target:g} % test accuracy: batch size {size} ({fastest:.2f} s of training)"


def _powers_line(data: ReportData, row: str) -> str | None:
    found = [f"{other} vs {n}: {change:+.1f} %" + (" (within the noise)" if verdict == "no measurable difference"
                                                  else "")
             for n, other, change, verdict in power_neighbours(data, row)]
    return "powers of two: " + "; ".join(found) if found else None


def answer_section(data: ReportData) -> Section | None:
    """The answer first: one line per finding per row (``title`` of the framework and variant); None when no trial
    ended ok."""
    items = []
    for row in data.frameworks:
        found = [line for line in (_fastest_line(data, row), _accurate_line(data, row), _target_line(data, row),
                                   _powers_line(data, row)) if line]
        if found:
            items.append(f"{title(row)}: " + "; ".join(found) + ".")
    if not items:
        return None
    return Section("answer", "The answer", (
        BulletList(tuple(items)),
        Paragraph("Medians over the repeats that ended ok; intervals are 95 % (see each table below). The batch size "
                  "to train with per objective, time and energy to a target predicted from the gradient noise scale: "
                  "`harness advise` (the guide's page docs/guide/which-batch-size.md)."),))
