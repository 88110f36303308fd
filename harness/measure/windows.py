"""Statistics of a trial's samples over its timed windows: which samples describe a window, and each metric's mean,
median and max over them.

A sample is a dict with ``t`` (``time.monotonic()``, seconds: the clock of the worker's events), ``edge`` ("start" or
"end") when the launcher took it at a window's edge (``harness.measure.sampler.Sampler.poke``), and one value per
metric (units in the metric's name: ``_percent``, ``_bytes``, ``_w``, ``_mhz``, ``_c``), None where the backend could
not read it. Windows are (start, end) pairs on the same clock, from the worker's ``phase`` events
(``windows_from_events``). Energy, power and throttling over the same windows: ``harness.measure.energy``, which
uses ``belongs`` and ``scopes`` from here.

Design: docs/design/sampling.md (edge samples, why a window's end sample may come late).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from harness.measure.gpm import GPM_METRICS, GPM_MIN_INTERVAL_S

EDGE_LAG_S = 0.5  # an end-edge sample taken at most this long after its window's end still describes the window
# Metrics that are not levels: a cumulative counter and a bitmask. phase_stats skips them (a mean means nothing);
# energy_over_windows and throttle_summary read them.
NON_STAT_METRICS = ("energy_mj", "throttle_reasons")
# Metrics averaged over a period of their own: nvmlDeviceGetUtilizationRates's "past sample period" is 1/6 s to 1 s by
# product (NVML API reference, nvmlUtilization_t); a GPM metric covers the interval between two GPM reads, at least
# GPM_MIN_INTERVAL_S apart (harness.measure.gpm). Over windows shorter than the shortest period a reading describes
# mostly the time around them (an H200 read 0 % utilization for 5 ms of training, and 0.0 % SM activity for 70 ms),
# so they get no statistic.
PERIOD_AVERAGED_S = {"gpu_util_percent": 1 / 6, "mem_util_percent": 1 / 6,
                     **{metric: GPM_MIN_INTERVAL_S for metric in GPM_METRICS}}


def windows_from_events(events: Iterable[dict[str, Any]], phase: str = "train") -> list[tuple[float, float]]:
    """The (start, end) monotonic times of every ``phase`` window in a worker's events."""
    windows: list[tuple[float, float]] = []
    open_at: float | None = None
    for event in events:
        if event.get("event") != "phase" or event.get("name") != phase:
            continue
        if event["edge"] == "start":
            open_at = event["t"]
        elif open_at is not None:
            windows.append((open_at, event["t"]))
            open_at = None
    return windows


def samples_until(samples: list[dict[str, Any]], last_event_t: float | None) -> list[dict[str, Any]]:
    """The samples taken at or before ``last_event_t`` (the worker's result or error event, after which it exits;
    None: all of them). A later sample, such as a short window's end-edge sample that comes late, reads a process
    tearing down (less memory than it held) or a zombie (0 bytes) or nothing, and a device it has left: not what
    the window's levels were."""
    return samples if last_event_t is None else [s for s in samples if s["t"] <= last_event_t]


def belongs(sample: dict[str, Any], ranges: list[tuple[float, float]]) -> bool:
    """Whether ``sample`` describes a time inside ``ranges`` ((start, end) pairs, seconds): taken inside one, or the
    end-edge sample taken at most EDGE_LAG_S after one's end; a start-edge sample (a baseline) never does."""
    edge, t = sample.get("edge"), sample["t"]
    if edge == "start":
        return False
    return any(a <= t <= b or (edge == "end" and b < t <= b + EDGE_LAG_S) for a, b in ranges)


def scopes(windows: list[tuple[float, float]]) -> list[tuple[str, list[tuple[float, float]]]]:
    """The ranges to read samples from, in order of preference: ``("windows", windows)``, then ``("span", [the first
    window's start to the last one's end])`` for windows too short to hold a sample (empty without windows)."""
    span = [(min(a for a, _ in windows), max(b for _, b in windows))] if windows else []
    return [("windows", windows), ("span", span)]


def phase_stats(samples: list[dict[str, Any]], windows: list[tuple[float, float]]) -> dict[str, dict[str, Any]]:
    """Mean, median, max and count of every metric over the samples that belong to ``windows``.

    A sample belongs to a window when it was taken inside it, or when it is the end-edge sample taken at most EDGE_LAG_S
    after the window's end; start-edge samples (baselines, which describe the time before the window) never do. Missing
    values (None) are left out. ``scope`` says which samples were used: ``"windows"`` (inside the timed windows);
    ``"span"`` when no sample fell inside them (windows shorter than the sampling interval), so the samples from the
    first window's start to the last one's end were used instead, evaluation pauses included; ``"none"`` when even that
    span holds no sample (statistics None, count 0); ``"too short"`` for a metric of PERIOD_AVERAGED_S when the windows
    together are shorter than the driver's own averaging period. NON_STAT_METRICS (a counter, a bitmask) are left out,
    on every device of a multi-device sample too (``<metric>@<i>``, ``harness.measure.multi_gpu``): see
    energy_over_windows and throttle_summary.
    """
    metrics = sorted({k for s in samples for k in s
                      if k not in ("t", "edge") and k.partition("@")[0] not in NON_STAT_METRICS})
    stats: dict[str, dict[str, Any]] = {}
    timed = sum(b - a for a, b in windows)
    for metric in metrics:
        period = PERIOD_AVERAGED_S.get(metric.partition("@")[0])
        if period is not None and timed < period:
            stats[metric] = {"mean": None, "median": None, "max": None, "count": 0, "scope": "too short"}
            continue
        for scope, ranges in scopes(windows):
            values = np.asarray([s[metric] for s in samples if s.get(metric) is not None and belongs(s, ranges)],
                                dtype=float)
            if values.size:
                stats[metric] = {"mean": float(values.mean()), "median": float(np.median(values)),
                                 "max": float(values.max()), "count": int(values.size), "scope": scope}
                break
        else:
            stats[metric] = {"mean": None, "median": None, "max": None, "count": 0, "scope": "none"}
    return stats
