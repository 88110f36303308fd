"""Run directory -> the report's sections (``harness.results.sections``: computed once), rendered as ``report.md``
and ``report.html`` (``harness.results.html``), and ``plots/*.png``.

Every table has one row per framework and one column per batch size, like the tables of the Ohio State thesis quoted
in seed 002, so the two can be put side by side. A cell is the median over the repeats that ended ``ok``; a cell
with no ``ok`` repeat shows the status instead (``oom``, ``error``, ``timeout``, ``crashed``, ``skipped``,
``unsupported``). The tables are ``harness.results.tables``'s; this module writes the text around them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.results import html
from harness.results.data_parallel import data_parallel_section
from harness.results.input_pipeline import input_pipeline_section
from harness.results.keras_native import keras_native_section
from harness.results.memory_breakdown import memory_breakdown_section
from harness.results.metrics import GPM_METRICS, Metric, scaled, title
from harness.results.placement import side_by_side_section
from harness.results.plots import plot, plot_trial
from harness.results.precision import precision_accuracy_section
from harness.results.sections import (
    BulletList,
    Images,
    Lines,
    Paragraph,
    Section,
    batch_table,
    simple_table,
    to_markdown,
)
from harness.results.tables import (
    MEMORY_NOTE,
    SPAN_NOTE,
    build,
    cell_values,
    format_cell,
    memory_rows,
    metric_row,
    metric_table,
    noise_pairs,
    noise_verdict,
    ohio_state_rows,
)

__all__ = ["build", "render_markdown", "sections", "write"]

GPM_KEYS = {m.key for m in GPM_METRICS}


def _execution(spec: dict[str, Any]) -> str:
    """Precision and execution mode in words, for the header (variants name theirs in the row labels)."""
    words = {"fp32": "precision fp32 (TF32 off on GPUs)", "tf32": "precision tf32 (fp32 storage, TF32 matrix work)",
             "bf16": "mixed precision bf16 (fp32 weights and optimizer state)",
             "fp16": "mixed precision fp16 (fp32 weights and optimizer state, dynamic loss scaling)"}
    variants = spec.get("variants") or {}
    precision = ("precision per row (variants)" if variants.get("precision")
                 else words.get(spec.get("precision", "fp32"), spec.get("precision")))
    mode = spec.get("compile", "default")
    compile = ("execution mode per row (variants)" if variants.get("compile") else
               "each framework's usual execution mode" if mode == "default" else f"{mode} execution")
    return f"{precision}; {compile}"


def _device_line(run: dict[str, Any]) -> str:
    env = run.get("environment", {})
    if run.get("device", "cpu").startswith("cuda"):
        gpu = env.get("gpu", {})
        names = ", ".join(d["name"] for d in gpu.get("devices", [])[:1]) or "unknown GPU"
        return f"{run['device']} ({names}, driver {gpu.get('driver', '?')})"
    return (f"cpu ({env.get('cpu', '?')}, {env.get('cpu_count_logical', '?')} logical cores, "
            f"{env.get('memory_total_bytes', 0) / 1e9:.1f} GB RAM)")

def _versions(records: list[dict[str, Any]]) -> str:
    import adapters  # the registry of declarations (imports no framework): each one's version keys, and CUDA's

    keys = {k for record in adapters.records() for k in record.version_keys} | {"cuda", "cudnn"}
    seen: dict[str, str] = {}
    for r in records:
        for name, version in r.get("versions", {}).items():
            if name in keys:
                seen.setdefault(name, version)
    return ", ".join(f"{k} {v}" for k, v in seen.items()) or "none reported"


def sections(data: dict[str, Any]) -> list[Section]:
    """The whole report as sections (``data``: ``harness.results.tables.compute``'s result): the header, the
    environments, the Ohio State layout, the memory layers, one section per metric, Keras over native (where a Keras
    row's native framework is in the run), the study sections, how the sampler fared, the failed trials and the
    plots. Sections with nothing to say are left out."""
    found = [header_section(data), environment_section(data), ohio_state_section(data), memory_layers_section(data),
             memory_breakdown_section(data), *(metric_section(data, metric) for metric in data["metrics"]),
             keras_native_section(data), *study_sections(data), measurement_notes(data), slow_window_notes(data),
             side_by_side_section(data), failed_section(data), plots_section(data)]
    return [section for section in found if section is not None]


def render_markdown(data: dict[str, Any], computed: list[Section] | None = None) -> str:
    """The whole report.md text: ``sections`` (or the ``computed`` ones) in Markdown."""
    return to_markdown(sections(data) if computed is None else computed)


def timing_mode(timing: dict[str, Any]) -> str:
    """How the run's timed windows were synchronized, in words (``timing``: the spec's timing section as JSON; a
    run written before windows existed has ``sync_every``)."""
    window = timing.get("window", "step" if timing.get("sync_every", 1) == 1 else timing.get("sync_every"))
    if window == "step":
        return ("latency mode: the device synchronized after every step (step times are per step; throughput "
                "includes a sync per step)")
    if window == "auto":
        return (f"timed windows of about {timing.get('window_seconds', 1.0):g} s and at least "
                f"{timing.get('min_window_steps', 10)} steps (at most up to the next evaluation), the device "
                "synchronized only at their edges; step times are window means")
    return f"timed windows of {window} steps, the device synchronized only at their edges; step times are window means"


def _evaluation(spec: dict[str, Any]) -> str:
    """When the test set was evaluated (``evaluate_every``, absent in runs before it: every epoch), in words."""
    every = spec.get("evaluate_every", 1)
    if every == 1:
        return "evaluation after each epoch, not timed"
    return (f"evaluation after every {every} epochs and the last, not timed; timed windows run on across the epochs "
            "between")


def header_section(data: dict[str, Any]) -> Section:
    """What was run, where and how (the report's title, level 1): device, versions, dataset, optimizer, threads,
    sampling, statuses, then the units and what the utilization figures mean."""
    run, records, spec = data["run"], data["records"], data["run"]["spec"]
    statuses = pd.Series([r["status"] for r in records]).value_counts().to_dict() if records else {}
    threads = spec.get("cpu_threads") or next((r.get("threads") for r in records if r.get("threads")), None)
    opt = spec["optimizer"]
    sampled = ("NVML (nvidia-ml-py)" if data["backend"] == "nvml" else "psutil (no GPU: the worker's CPU and memory)")
    interval = spec["sampler"]["interval_s"]
    items = [
        f"Run: `{Path(run.get('run_dir', '')).name or run.get('started')}` started {run.get('started')}, "
        f"finished {run.get('finished') or 'not finished'}",
        f"Device: {_device_line(run)}",
        f"Frameworks: {_versions(records)}; harness {run.get('harness_version')} "
        f"(git {run.get('environment', {}).get('git', {}).get('commit', 'unknown')[:12]})",
        f"Dataset: {spec['dataset']['name']}; {spec['epochs']} epochs of floor(N / batch size) full batches; "
        f"the first {spec['warmup_steps']} steps are warm-up (trained, not timed); {_evaluation(spec)}",
        f"Optimizer: {opt['name']} (learning rate {opt['learning_rate']}"
        + (f", momentum {opt['momentum']}" if opt['name'] == 'sgd' else '')
        + f", weight decay {opt['weight_decay']}); {_execution(spec)}; "
        + (f"seeds {', '.join(map(str, spec['seeds']))} (each its own trials; accuracy and loss are means over them)"
           if spec.get("seeds") else f"seed {spec['seed']}"),
        f"CPU threads: {threads} intra-op, 1 inter-op, the same for every framework"
        + f"; {timing_mode(spec.get('timing', {}))}",
        f"Sampling: {sampled} every {interval} s; statistics over samples inside the timed windows only",
        "Statuses: " + (", ".join(f"{k} {v}" for k, v in statuses.items()) or "no trial finished"),
        *([f"Interrupted by {run['interrupted']['by']} at {run['interrupted']['at']}: "
           f"{len(run['interrupted']['not_run'])} planned trial(s) not run; `harness run SPEC --resume RUN_DIR` "
           "continues it"] if run.get("interrupted") else []),
    ]
    notes = ["Units: MB = 10^6 bytes; times in seconds unless marked ms; throughput in samples per second.",
             "Each cell is the median over repeats that ended ok; otherwise the trial's status."]
    if data["backend"] == "nvml":
        notes.append("GPU use % is NVML's utilization.gpu: the percentage of time, over the driver's sample period "
                     "(1/6 s to 1 s), during which at least one kernel was running. It is not SM occupancy: one tiny "
                     "kernel at a time reads as 100%. Achieved GFLOP/s says how much of the GPU did work.")
        if any(m.key in GPM_KEYS for m in data["metrics"]):
            notes.append("SM active %, SM occupancy %, tensor active % and DRAM bandwidth % are NVML's GPM metrics "
                         "(Hopper and newer; nvmlGpmMetricsGet over two samples, each sampling period one interval): "
                         "the % of SMs busy, resident warps as a % of the SMs' maximum, the % of time the tensor pipes "
                         "ran any tensor operation, and DRAM bandwidth used as a % of its maximum; MFU % is achieved "
                         "FLOP/s over the datasheet peak. n/a: that trial's GPU, driver or permissions did not provide "
                         "it (see How the sampler fared).")
    else:
        notes.append("No GPU was used: the 'use %' rows are the worker process tree's CPU use (100 = one core busy) "
                     "and the memory rows its resident memory (RSS), in the layout of the GPU tables.")
    title_text = f"{spec['name']}: {len(records)} of {len(run.get('planned_trials', []))} trials"
    return Section("header", title_text, (BulletList(tuple(items)), Lines(tuple(notes))), level=1)


def environment_section(data: dict[str, Any]) -> Section | None:
    """Which interpreter each row ran in, with its Python, numpy and framework versions (run.json's ``frameworks``,
    from the probe before the first trial; runs made before the probe existed have none, and no section)."""
    entries = data["run"].get("frameworks") or []
    if not entries:
        return None
    rows = []
    for entry in entries:
        versions = ", ".join(f"{k} {v}" for k, v in (entry.get("versions") or {}).items() if not k.endswith("_build"))
        where = " ".join(entry["command"]) if entry.get("command") else (entry.get("executable") or "")
        rows.append([title(entry["label"]), entry["name"], versions, str(entry.get("python_version", "")),
                     str(entry.get("numpy", "")), f"`{where}`"])
    table = simple_table(["row", "framework", "versions", "Python", "numpy", "interpreter or command"], rows)
    return Section("frameworks", "Frameworks and their environments", (table,))


def ohio_state_section(data: dict[str, Any]) -> Section:
    """The combined table of the thesis (``harness.results.tables.ohio_state_rows``)."""
    span = data["marks"]["util"] or data["marks"]["memory"]
    return Section("ohio_state", "The Ohio State layout", (batch_table(ohio_state_rows(data), data["batch_sizes"]),
                                                           *((Paragraph(SPAN_NOTE),) if span else ())))


def memory_layers_section(data: dict[str, Any]) -> Section:
    """The memory layers the run measured, per framework (``harness.results.tables.memory_rows``)."""
    return Section("memory_layers", "Memory, layer by layer", (
        Paragraph(MEMORY_NOTE[data["backend"]]), batch_table(memory_rows(data), data["batch_sizes"])))


def metric_section(data: dict[str, Any], metric: Metric) -> Section:
    """One metric's section: its meaning, its table, and for metrics with repeats the pairs within the noise."""
    rows = [(title(fw), metric_row(data, metric, fw, metric.digits)) for fw in data["frameworks"]]
    unit = f" ({metric.unit})" if metric.unit else ""
    blocks: list[Any] = [Paragraph(metric.meaning + "."), batch_table(rows, data["batch_sizes"])]
    blocks += [Paragraph(SPAN_NOTE)] if data["marks"][metric.key] else []
    # why cells read n/a, where a record says so (metrics.<key>_note, e.g. mfu_note: "unknown device: no peak (...)")
    empty = sorted({str(n) for r in data["records"] if (n := (r.get("metrics") or {}).get(f"{metric.key}_note"))})
    blocks += [Paragraph(f"n/a: {'; '.join(empty)}.")] if empty else []
    if metric.ci and data["cis"][metric.key]:
        pairs = noise_pairs(data, metric)
        spread = (f"Cells show the mean over {len(data['seeds'])} seeds [95% t-interval of that mean] of each seed's "
                  "median over its repeats: the spread between trainings from other seeds (initial weights, batch "
                  "order, dropout). " if metric.over_seeds and len(data.get("seeds", [])) > 1 else
                  "Cells show the median [95% bootstrap interval of the median] over the repeats (no interval where "
                  "every repeat gave the same value): timing noise of the same training. ")
        blocks.append(Paragraph(spread + (f"Within the noise (intervals overlap): {'; '.join(pairs)}." if pairs
                                          else "No compared pair's intervals overlap.")))
    return Section(f"metric:{metric.key}", f"{metric.title}{unit}", tuple(blocks))


def failed_section(data: dict[str, Any]) -> Section | None:
    """The trials that did not end ok, with their reasons (the first 300 characters); None when every one did."""
    failed = [r for r in data["records"] if r["status"] != "ok"]
    if not failed:
        return None
    table = simple_table(["trial", "status", "reason"],
                         [[r["id"], r["status"], str(r.get("reason", ""))[:300]] for r in failed],
                         classes=["bad"] * len(failed))
    return Section("failed", "Trials that did not end ok", (table,))


def plots_section(data: dict[str, Any]) -> Section:
    """The links to the plots: one per metric (``plots/<key>.png``), then each ok trial's time series."""
    trials = ", ".join(f"[{r['id']}](plots/trials/{r['id']}.png)" for r in data["records"] if r["status"] == "ok")
    return Section("plots", "Plots", (
        Images(tuple((m.title, f"plots/{m.key}.png") for m in data["metrics"])),
        Paragraph("Per-trial time series (sampled metrics over time, warm-up and timed windows shaded): " + trials)))


def measurement_notes(data: dict[str, Any]) -> Section | None:
    """The "How the sampler fared" section: metrics the sampler could not read (and why), why NVML was not used,
    backend notes and errors, which energy method each trial's figure came from and how many windows were too short
    for it, and clocks-event (throttle) reasons seen during the timed windows. None when there is nothing to say."""
    unavailable: dict[str, set[str]] = {}
    notes: dict[str, list[str]] = {}
    methods: dict[str, list[str]] = {}
    short: list[str] = []
    throttled: list[str] = []
    for r in data["records"]:
        info = r.get("sampler") or {}
        for metric, why in (info.get("unavailable") or {}).items():
            unavailable.setdefault(metric, set()).add(str(why))
        for note in [info.get("note"), *(info.get("notes") or []), *(info.get("errors") or [])]:
            if note:
                notes.setdefault(str(note), []).append(r["id"])
        energy = info.get("energy") or {}
        if r["status"] == "ok" and data["backend"] == "nvml":
            methods.setdefault(energy.get("method") or "none", []).append(r["id"])
            if energy.get("short_windows"):
                short.append(f"{r['id']} ({energy['short_windows']} of {energy.get('windows')} windows "
                             f"< {energy.get('short_window_s')} s)")
        shares = (info.get("throttle") or {}).get("share") or {}
        active = [f"{reason} {share:.0%}" for reason, share in shares.items() if share and reason != "gpu_idle"]
        if active:
            throttled.append(f"{r['id']}: {', '.join(active)}")
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
                                "power reading lags the window edges): " + "; ".join(short[:20])
                                + ("; ..." if len(short) > 20 else "") + "."))
    if throttled:
        blocks.append(Paragraph("Clock throttling seen in the timed windows (share of samples; see "
                                "nvmlClocksEventReasons): " + "; ".join(throttled[:20]) + "."))
    return Section("sampler", "How the sampler fared", tuple(blocks)) if blocks else None


def slow_window_notes(data: dict[str, Any]) -> Section | None:
    """The trials whose framework counted recompilations after warm-up, and those with timed windows whose steps
    took more than 3 x their median step (the worker's ``slow_windows``): a recompilation of a compiled step, a
    garbage collection or the machine's noise, named so that a throughput is not read without it. None when there
    are none."""
    slow = [f"{r['id']} ({m['slow_windows']} of {m.get('timed_windows')} windows, the slowest "
            f"{m['step_time_max_s'] / m['step_time_median_s']:.1f} x the median step)"
            for r in data["records"] if r["status"] == "ok" and (m := r.get("metrics") or {}).get("slow_windows")]
    recompiled = [f"{r['id']} ({m['recompilations']} after warm-up, {m.get('compilations_warmup')} during it)"
                  for r in data["records"]
                  if r["status"] == "ok" and (m := r.get("metrics") or {}).get("recompilations")]
    blocks = []
    if slow:
        blocks.append(Paragraph("Timed windows whose steps took more than 3 x the trial's median step (a "
                                "recompilation, a garbage collection or other load on the machine; they are inside "
                                "the throughput): " + "; ".join(slow[:20]) + ("; ..." if len(slow) > 20 else "") + "."))
    if recompiled:
        blocks.append(Paragraph("Recompilations inside the timed windows, by the framework's own count of traced or "
                                "compiled train step graphs (their time is inside the throughput): "
                                + "; ".join(recompiled[:20]) + ("; ..." if len(recompiled) > 20 else "") + "."))
    return Section("slow_windows", "Slow windows and recompilations", tuple(blocks)) if blocks else None


def study_sections(data: dict[str, Any]) -> list[Section | None]:
    """Sections for the batch-size studies a spec turns on: learning-rate scaling and gradient accumulation,
    data-parallel scaling, the input pipeline (resident against loader), time to a target accuracy, powers of two
    against their neighbours, and mixed precision's accuracy against fp32's (None for each the run does not have)."""
    return [scaling_section(data), data_parallel_section(data), input_pipeline_section(data),
            time_to_target_section(data), powers_of_two_section(data), precision_accuracy_section(data)]


def _per_cell(data: dict[str, Any], read: Any, digits: int) -> list[tuple[str, list[str]]]:
    """Rows of any per-trial value in the table layout (median over ok repeats)."""
    metric = Metric("x", "x", "", read, digits, "")
    table = metric_table(data["records"], metric, data["frameworks"], data["batch_sizes"])
    return [(title(fw), [format_cell(v, digits) for v in table.loc[fw]]) for fw in data["frameworks"]]


def scaling_section(data: dict[str, Any]) -> Section | None:
    """Effective batch size and learning rate used, when the spec accumulates gradients or scales the rate."""
    spec, sizes = data["run"]["spec"], data["batch_sizes"]
    if spec.get("accumulation_steps", 1) <= 1 and spec.get("learning_rate_scaling", "none") == "none":
        return None
    return Section("scaling", "Learning rate and effective batch size", (
        Paragraph(f"Learning-rate scaling: {spec.get('learning_rate_scaling', 'none')} relative to batch size "
                  f"{spec.get('base_batch_size')}; gradient accumulation: {spec.get('accumulation_steps', 1)} "
                  "micro-batches of the batch size per optimizer step (effective batch size = steps x batch size). "
                  "Batchnorm normalises each micro-batch on its own, so with batchnorm accumulation is not the same "
                  "as one large batch."),
        Paragraph("Effective batch size:"),
        batch_table(_per_cell(data, scaled(1.0, "metrics", "effective_batch_size"), 0), sizes),
        Paragraph("Learning rate used:"),
        batch_table(_per_cell(data, lambda r: r.get("learning_rate"), 5), sizes)))


def time_to_target_section(data: dict[str, Any]) -> Section | None:
    """Epochs and training seconds to the spec's target accuracy, and the batch size that got there first."""
    target = data["run"]["spec"].get("target_accuracy")
    if not target:
        return None
    records, sizes = data["records"], data["batch_sizes"]
    epochs = _per_cell(data, scaled(1.0, "metrics", "time_to_target", "epochs"), 0)
    seconds = _per_cell(data, scaled(1.0, "metrics", "time_to_target", "training_seconds"), 2)
    seconds_metric = Metric("t", "t", "", scaled(1.0, "metrics", "time_to_target", "training_seconds"), 2, "")
    firsts = []
    for fw in data["frameworks"]:
        reached = [(float(np.median(values)), bs) for bs in sizes
                   if (values := cell_values(records, seconds_metric, fw, bs))]
        if reached:
            best_seconds, best_size = min(reached)
            firsts.append(f"{title(fw)}: batch size {best_size} ({best_seconds:.2f} s)")
        else:
            firsts.append(f"{title(fw)}: not reached")
    return Section("time_to_target", f"Time to {100 * target:g}% test accuracy", (
        Paragraph("Training seconds (timed windows only, warm-up and evaluation excluded) and epochs until the test "
                  "accuracy after an epoch first reached the target; empty where it was never reached."),
        Paragraph("Epochs:"), batch_table(epochs, sizes), Paragraph("Training seconds:"), batch_table(seconds, sizes),
        Paragraph("First to reach it: " + "; ".join(firsts) + ".")))


def powers_of_two_section(data: dict[str, Any]) -> Section | None:
    """Throughput of n - 1 and n + 1 against each power of two n the run has a neighbour of (seed 000)."""
    records, sizes = data["records"], data["batch_sizes"]
    powers = [n for n in sizes if n & (n - 1) == 0 and (n - 1 in sizes or n + 1 in sizes)]
    if not powers:
        return None
    metric = next(m for m in data["metrics"] if m.key == "throughput")
    cis = data["cis"].get("throughput", {})
    rows = []
    for fw in data["frameworks"]:
        for n in powers:
            base = cell_values(records, metric, fw, n)
            for other in (n - 1, n + 1):
                values = cell_values(records, metric, fw, other)
                if other not in sizes or not base or not values:
                    continue
                change = (np.median(values) - np.median(base)) / np.median(base) * 100
                verdict = noise_verdict(cis.get((fw, n)), cis.get((fw, other)), float(change))
                rows.append([title(fw), str(n), str(other), f"{change:+.1f}", verdict])
    return Section("powers_of_two", "Powers of two against their neighbours", (
        Paragraph("Throughput of n - 1 and n + 1 relative to the power of two n. With repeats, 'no measurable "
                  "difference' means the 95% intervals of the medians overlap."),
        simple_table(["framework", "n", "neighbour", "change %", "verdict"], rows, "lrrrl")))


def write(run_dir: str | Path) -> Path:
    """Writes ``report.md`` and ``report.html`` (``harness.results.html``), both from one computation of the
    sections, and ``plots/`` (per-metric plots, and per-trial time series in ``plots/trials/``) into the run
    directory; returns the report's path."""
    run_dir = Path(run_dir)
    data = build(run_dir)
    data["run"]["run_dir"] = str(run_dir)
    # each figure drawn once: saved as the PNG report.md links, then as report.html's inline SVG
    metric_svgs: dict[str, str] = {}

    def keep_metric(key: str, fig: Any, tips: dict[str, str]) -> None:
        metric_svgs[key] = html.svg(fig, tips)

    plot(data, run_dir / "plots", then=keep_metric)
    trial_svgs: dict[str, str | None] = {}

    def keep_trial(trial_id: str) -> Callable[[Any], None]:
        trial_svgs[trial_id] = None  # no samples: no figure

        def keep(fig: Any) -> None:
            trial_svgs[trial_id] = html.svg(fig)

        return keep

    for record in data["records"]:
        if record["status"] == "ok":
            plot_trial(run_dir, record["id"], run_dir / "plots" / "trials" / f"{record['id']}.png",
                       then=keep_trial(record["id"]))
    computed = sections(data)
    path = run_dir / "report.md"
    path.write_text(to_markdown(computed), encoding="utf-8")
    html.write(data, run_dir, computed, metric_svgs, trial_svgs)
    return path
