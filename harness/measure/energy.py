"""Energy, power and throttling over a trial's measured windows, from the sampler's samples.

Energy per measured window (``energy_over_windows``): from the energy counter where the GPU has one (Volta and newer),
  else by integrating power; see that function for the method and its limits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from harness.measure.windows import belongs, scopes

# NVML refreshes its power and energy readings roughly every 20-100 ms depending on the GPU (NVIDIA does not document
# the period; PETSc's PetscLogGpuEnergyMeter notes: "For newer GPUs, energy readings are updated every 20-100ms").
# A counter reading can be stale by up to one refresh at each window edge, so shorter windows are flagged.
COUNTER_UPDATE_S = 0.1
# nvmlDeviceGetPowerUsage: "On Ampere (except GA100) or newer GPUs, the API returns power averaged over 1 sec interval"
# (older GPUs: instantaneous). An integral of such readings smears each window over about a second: windows shorter
# than this are flagged when energy comes from power integration.
POWER_AVERAGING_S = 1.0
# nvmlClocksEventReasons bits (https://docs.nvidia.com/deploy/nvml-api/group__nvmlClocksEventReasons.html).
THROTTLE_BITS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def throttle_summary(samples: list[dict[str, Any]], windows: list[tuple[float, float]]) -> dict[str, Any] | None:
    """How often each clocks-event reason was active in the samples of ``windows`` (membership and scope as in
    phase_stats): {"count", "scope", "any_mask" (OR of all masks), "share": {reason: fraction of samples}}; None
    when no sample has the bitmask."""
    for scope, ranges in scopes(windows):
        masks = [int(s["throttle_reasons"]) for s in samples
                 if s.get("throttle_reasons") is not None and belongs(s, ranges)]
        if masks:
            any_mask = 0
            for mask in masks:
                any_mask |= mask
            share = {name: sum(1 for m in masks if m & bit) / len(masks) for bit, name in THROTTLE_BITS.items()
                     if any_mask & bit}
            return {"count": len(masks), "scope": scope, "any_mask": any_mask, "share": share}
    return None


def _series(samples: list[dict[str, Any]], metric: str) -> tuple[np.ndarray, np.ndarray]:
    points = sorted((s["t"], float(s[metric])) for s in samples if s.get(metric) is not None)
    return np.asarray([p[0] for p in points], dtype=float), np.asarray([p[1] for p in points], dtype=float)


def energy_over_windows(samples: list[dict[str, Any]], windows: list[tuple[float, float]]) -> dict[str, Any]:
    """Board energy over the measured windows, in joules.

    Returns {"joules": float | None, "method": "counter" | "power_integral" | None, "seconds": total window time,
    "short_windows": how many windows are shorter than ``short_window_s``, "short_window_s", "windows": how many,
    "unbracketed_edges": window edges outside the readings' time range (their value is the nearest reading's, so the
    energy is underestimated), "mean_power_w": joules / seconds or None, "note": why a method was not used, if so}.

    - ``"counter"`` where samples carry ``energy_mj`` (nvmlDeviceGetTotalEnergyConsumption, Volta and newer): per
      window, the counter linearly interpolated at the window's end minus at its start, summed. The counter's own
      refresh (roughly 20-100 ms; COUNTER_UPDATE_S = 0.1 s assumed) makes each edge uncertain by up to that long at
      the board's power, so windows shorter than COUNTER_UPDATE_S are counted as short.
    - ``"power_integral"`` otherwise: the trapezoidal integral of ``power_w`` over each window (readings linearly
      interpolated at the edges). On Ampere (except GA100) and newer GPUs NVML's power is a 1 s moving average, which
      smears energy across window edges by about a second: windows shorter than POWER_AVERAGING_S count as short.
      Between samples power is assumed linear, so the result is only as good as the sampling interval.
    When the windows together are shorter than the method's refresh, ``joules`` is None and ``note`` says why (the edges
    would read the same value). Both are board-level: every process on the GPU, plus idle power. Approximate by
    construction; the edge samples the launcher takes at each window's start and end (Sampler.poke) put readings close
    to the edges.
    """
    seconds = float(sum(b - a for a, b in windows))
    out: dict[str, Any] = {"joules": None, "method": None, "seconds": seconds, "short_windows": 0,
                           "short_window_s": None, "windows": len(windows), "unbracketed_edges": 0,
                           "mean_power_w": None}
    if not windows:
        return out
    notes = []
    t, energy = _series(samples, "energy_mj")
    if t.size >= 2 and np.any(np.diff(energy) < 0):
        notes.append("the energy counter went backwards (driver reloaded?): power integrated instead")
    elif t.size >= 2:
        joules = 0.0
        for a, b in windows:
            joules += float(np.interp(b, t, energy) - np.interp(a, t, energy)) / 1000.0
        out.update(joules=joules, method="counter", short_window_s=COUNTER_UPDATE_S,
                   unbracketed_edges=sum((e < t[0]) + (e > t[-1]) for w in windows for e in w))
    if out["method"] is None:
        t, power = _series(samples, "power_w")
        if t.size >= 1:
            joules = 0.0
            for a, b in windows:
                inside = (t > a) & (t < b)
                ts = np.concatenate(([a], t[inside], [b]))
                ps = np.concatenate(([np.interp(a, t, power)], power[inside], [np.interp(b, t, power)]))
                joules += float(np.sum((ps[1:] + ps[:-1]) / 2.0 * np.diff(ts)))
            out.update(joules=joules, method="power_integral", short_window_s=POWER_AVERAGING_S,
                       unbracketed_edges=sum((e < t[0]) + (e > t[-1]) for w in windows for e in w))
    if out["method"] is not None:
        out["short_windows"] = sum(1 for a, b in windows if b - a < out["short_window_s"])
        out["unbracketed_edges"] = int(out["unbracketed_edges"])
        if seconds < out["short_window_s"]:
            # all the timed time fits inside one refresh of the reading: a counter read at two edges that close reads
            # the same value (an H200 gave 0.0 J for 5.6 ms of training), so there is no figure, not a zero
            notes.append(f"the timed windows total {seconds:.3f} s, less than the reading's refresh "
                         f"({out['short_window_s']} s): no energy figure")
            out["joules"] = None
        out["mean_power_w"] = out["joules"] / seconds if seconds > 0 and out["joules"] is not None else None
    if notes:
        out["note"] = "; ".join(notes)
    return out
