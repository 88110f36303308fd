"""Units in names: one suffix convention for every field of a run directory's records (run.json, trials.jsonl) and
of the worker's events.

- ``_s`` seconds (``measured_s``, ``step_time_median_s``, ``wall_s``; a wall-clock time: ``_unix_s``, seconds since
  the epoch), ``_bytes`` bytes, ``_pct`` percent (0 to 100), ``_w`` watts, ``_j`` joules, ``_mhz`` megahertz, ``_c``
  degrees Celsius;
- ``_per_s`` a rate per second, with what it counts before it (``throughput_samples_per_s``,
  ``achieved_flops_per_s``);
- no suffix: counts, named by what they count (``measured_steps``, ``parameter_count``, ``train_flops_per_sample``),
  fractions from 0 to 1 (``test_accuracy``, ``input_wait_share``), losses, flags and names.

The sampler (``harness.measure``) names its readings with ``_percent`` (``gpu_util_percent``; the samples files keep
those names, as the backends read them); ``stat_name`` is the one place where a reading's name becomes the record's.
"""

from __future__ import annotations

#: The sampler's suffixes that the record writes differently (``harness.measure`` -> the record).
SAMPLER_SUFFIXES = {"_percent": "_pct"}


def stat_name(name: str) -> str:
    """A sampled metric's name in the record: ``gpu_util_percent`` -> ``gpu_util_pct``, ``cpu_percent@1`` ->
    ``cpu_pct@1`` (a data-parallel trial's device i); other names as they are."""
    base, at, index = name.partition("@")
    for old, new in SAMPLER_SUFFIXES.items():
        if base.endswith(old):
            base = base[: -len(old)] + new
    return base + at + index
