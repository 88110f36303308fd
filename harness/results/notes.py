"""The report's notes on how a run was measured: "How the sampler fared" (metrics not measured and why, sampler
notes, the energy method, short windows, throttling) and "Short and slow windows, recompilations"."""

from __future__ import annotations

from typing import Any

from harness.results.sections import BulletList, Paragraph, Section
from harness.results.tables import ReportData

#: The record metric that stands for each group of period-averaged metrics (``harness.measure.windows.
#: PERIOD_AVERAGED_S``: no statistic over timed windows shorter than the period) -> what the note says of them.
TOO_SHORT = {
    "gpu_util_pct": "No GPU utilization where the timed windows together were shorter than the driver's averaging "
                    "period (1/6 s; nvmlDeviceGetUtilizationRates): ",
    "sm_active_pct": "No GPM figures (SM activity and occupancy, tensor-pipe activity, DRAM bandwidth) where the timed "
                     "windows together were shorter than the interval between two GPM reads (0.1 s; "
                     "nvmlGpmMetricsGet): ",
}

#: A trial whose mean timed window is under this share of the timing goal (``timing.window_seconds``) is named.
SHORT_SHARE = 0.1

#: The host backend's levels (record names): read from the live worker only (harness.measure.windows.samples_until).
HOST_LEVELS = ("cpu_pct", "rss_bytes", "rss_anon_bytes")


def _few(items: list[str]) -> str:
    return "; ".join(items[:20]) + ("; ..." if len(items) > 20 else "")


def measurement_notes(data: ReportData) -> Section | None:
    """The "How the sampler fared" section: metrics the sampler could not read (and why), why NVML was not used,
    backend notes and errors, which energy method each trial's figure came from and how many windows were too short
    for it, the metrics with no statistic over windows too short for them (period-averaged GPU metrics; on the CPU,
    windows that held no sample of the live worker), and clocks-event (throttle) reasons seen during the timed
    windows. None when there is nothing to say."""
    unavailable: dict[str, set[str]] = {}
    notes: dict[str, list[str]] = {}
    methods: dict[str, list[str]] = {}
    short: list[str] = []
    no_energy: list[str] = []
    too_short: dict[str, list[str]] = {metric: [] for metric in TOO_SHORT}
    unsampled: list[str] = []
    throttled: list[str] = []
    for r in data.records:
        info = r.sampler
        for metric, why in info.unavailable.items():
            unavailable.setdefault(metric, set()).add(str(why))
        for note in [info.note, *info.notes, *info.errors]:
            if note:
                notes.setdefault(str(note), []).append(r.id)
        energy = info.energy
        if r.status == "ok" and data.backend == "nvml":
            methods.setdefault((energy.method if energy else None) or "none", []).append(r.id)
            if energy is not None and energy.energy_j is None and energy.method and energy.duration_s is not None:
                no_energy.append(f"{r.id} ({energy.duration_s:.3f} s)")
            elif energy is not None and energy.short_windows:
                short.append(f"{r.id} ({energy.short_windows} of {energy.windows} windows "
                             f"< {energy.short_window_s} s)")
        for metric, ids in too_short.items():
            stat = info.stats.get(metric)
            if r.status == "ok" and stat is not None and stat.scope == "too short":
                ids.append(r.id)
        if r.status == "ok" and data.backend == "host" and any(
                (stat := info.stats.get(metric)) is not None and stat.scope == "none" for metric in HOST_LEVELS):
            unsampled.append(f"{r.id} ({r.metrics.measured_s:.3f} s)" if r.metrics.measured_s is not None else r.id)
        shares = info.throttle.share if info.throttle is not None else {}
        active = [f"{reason} {share:.0%}" for reason, share in shares.items() if share and reason != "gpu_idle"]
        if active:
            throttled.append(f"{r.id}: {', '.join(active)}")
    blocks: list[Any] = []
    if unavailable:
        why_not = [f"{metric}: {'; '.join(sorted(why))}" for metric, why in sorted(unavailable.items())]
        blocks += [Paragraph("Not measured (the device or driver does not provide it):"), BulletList(tuple(why_not))]
    if notes:
        counted = [f"{note} ({len(ids)} trial{'s' if len(ids) > 1 else ''})" for note, ids in notes.items()]
        blocks += [Paragraph("Sampler notes:"), BulletList(tuple(counted))]
    if methods:
        names = {"counter": "NVML's total-energy counter (nvmlDeviceGetTotalEnergyConsumption)",
                 "power_integral": "power integrated over time (nvmlDeviceGetPowerUsage; no energy counter)",
                 "none": "no energy figure (neither counter nor power readings)"}
        blocks.append(Paragraph("Energy came from: " + "; ".join(f"{names.get(m, m)}: {len(ids)} trials"
                                                                 for m, ids in methods.items()) + "."))
    if short:
        blocks.append(Paragraph("Energy of windows shorter than the readings' refresh is approximate (the counter or "
                                "power reading lags the window edges): " + _few(short) + "."))
    if no_energy:
        blocks.append(Paragraph("No energy figure where the timed windows together were shorter than the reading's "
                                "refresh (both edges would read the same value): " + _few(no_energy) + "."))
    blocks += [Paragraph(TOO_SHORT[metric] + _few(ids) + ".") for metric, ids in too_short.items() if ids]
    if unsampled:
        blocks.append(Paragraph("No CPU use or memory figure where no sample of the live worker fell in the timed "
                                "windows (together shorter than the sampling interval, and the worker had exited "
                                "when their end-edge sample came: docs/design/sampling.md): " + _few(unsampled) + "."))
    if throttled:
        blocks.append(Paragraph("Clock throttling seen in the timed windows (share of samples; see "
                                "nvmlClocksEventReasons): " + _few(throttled) + "."))
    return Section("sampler", "How the sampler fared", tuple(blocks)) if blocks else None


def slow_window_notes(data: ReportData) -> Section | None:
    """The trials whose mean timed window was under ``SHORT_SHARE`` of the timing goal, those whose framework counted
    recompilations after warm-up, and those with timed windows whose steps took more than 3 x their median step (the
    worker's ``slow_windows``): a recompilation of a compiled step, a garbage collection or the machine's noise,
    named so that a throughput is not read without it. None when there are none."""
    ok = [r for r in data.records if r.status == "ok"]
    slow = [f"{r.id} ({m.slow_windows} of {m.timed_windows} windows, the slowest "
            f"{(m.step_time_max_s or 0.0) / (m.step_time_median_s or 1.0):.1f} x the median step)"
            for r in ok if (m := r.metrics).slow_windows]
    recompiled = [f"{r.id} ({m.recompilations} after warm-up, {m.compilations_warmup} during it)"
                  for r in ok if (m := r.metrics).recompilations]
    goal = (data.spec.get("timing") or {}).get("window_seconds", 1.0)
    short = [f"{r.id} ({1e3 * m.measured_s / m.timed_windows:.0f} ms)" for r in ok
             if (m := r.metrics).timing_window == "auto" and m.timed_windows and m.measured_s is not None
             and m.measured_s / m.timed_windows < SHORT_SHARE * goal]
    blocks = []
    if short:
        blocks.append(Paragraph(f"Timed windows far shorter than the goal of about {goal:g} s (the mean window; "
                                "an evaluation or the trial's end came first: each window's edges are synced, so its "
                                "throughput holds a sync per few steps, and its CPU and energy figures are coarse): "
                                + _few(short) + "."))
    if slow:
        blocks.append(Paragraph("Timed windows whose steps took more than 3 x the trial's median step (a "
                                "recompilation, a garbage collection or other load on the machine; they are inside "
                                "the throughput): " + _few(slow) + "."))
    if recompiled:
        blocks.append(Paragraph("Recompilations inside the timed windows, by the framework's own count of traced or "
                                "compiled train step graphs (their time is inside the throughput): "
                                + _few(recompiled) + "."))
    return Section("slow_windows", "Short and slow windows, recompilations", tuple(blocks)) if blocks else None
