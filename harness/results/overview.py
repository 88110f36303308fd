"""The report's general sections, each computed from the run's ``ReportData``: the header (what was run, where and
how), the frameworks' environments, the Ohio State layout, the memory layers, one section per metric, the trials
that did not end ok, and the plots' links. ``harness.results.report`` puts them together with the study sections;
``harness.results.pair`` sets two runs' header and Ohio State layout side by side."""

from __future__ import annotations

from typing import Any

import pandas as pd

from harness.record.run import RunRecord
from harness.record.trial import TrialRecord
from harness.results.derived import mfu
from harness.results.metrics import GPM_METRICS, Metric, title
from harness.results.plots import NO_METRIC_PLOTS, plotted_metrics
from harness.results.sections import (
    BulletList,
    Images,
    Lines,
    Paragraph,
    Section,
    batch_table,
    simple_table,
)
from harness.results.tables import (
    MEMORY_NOTE,
    SPAN_NOTE,
    ReportData,
    memory_rows,
    metric_row,
    noise_pairs,
    ohio_state_rows,
)

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


def _device_line(run: RunRecord) -> str:
    env = run.environment
    if run.device.startswith("cuda"):
        gpu = env.get("gpu", {})
        names = ", ".join(d["name"] for d in gpu.get("devices", [])[:1]) or "unknown GPU"
        return f"{run.device} ({names}, driver {gpu.get('driver', '?')})"
    return (f"cpu ({env.get('cpu', '?')}, {env.get('cpu_count_logical', '?')} logical cores, "
            f"{env.get('memory_total_bytes', 0) / 1e9:.1f} GB RAM)")


def _versions(records: list[TrialRecord]) -> str:
    import adapters  # the registry of declarations (imports no framework): each one's version keys, and CUDA's

    keys = {k for declared in adapters.declarations() for k in declared.version_keys} | {"cuda", "cudnn"}
    seen: dict[str, str] = {}
    for r in records:
        for name, version in r.versions.items():
            if name in keys:
                seen.setdefault(name, version)
    return ", ".join(f"{k} {v}" for k, v in seen.items()) or "none reported"


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
    """When the test set was evaluated (``evaluate_every``, absent in runs before it: every epoch, or
    ``evaluate_every_samples``), in words."""
    samples = spec.get("evaluate_every_samples")
    if samples:
        return (f"evaluation every {samples:,} training samples (at the first step past each multiple) and after the "
                "last step, not timed")
    every = spec.get("evaluate_every", 1)
    if every == 1:
        return "evaluation after each epoch, not timed"
    return (f"evaluation after every {every} epochs and the last, not timed; timed windows run on across the epochs "
            "between")


def header_section(data: ReportData) -> Section:
    """What was run, where and how (the report's title, level 1): device, versions, dataset, optimizer, threads,
    sampling, statuses, then the units and what the utilization figures mean."""
    run, records, spec = data.run, data.records, data.spec
    statuses = pd.Series([r.status for r in records]).value_counts().to_dict() if records else {}
    threads = spec.get("cpu_threads") or next((r.threads for r in records if r.threads), None)
    opt = spec["optimizer"]
    sampled = ("NVML (nvidia-ml-py)" if data.backend == "nvml" else "psutil (no GPU: the worker's CPU and memory)")
    interval = spec["sampler"]["interval_s"]
    name = data.run_dir.name if data.run_dir is not None else run.started
    # the spec's option, or one the trials' environment set (JAX_COMPILATION_CACHE_DIR): their settings say
    cache = spec.get("compilation_cache") or next(
        (d for r in records if (d := (r.settings or {}).get("compilation_cache_dir"))), None)
    items = [
        f"Run: `{name}` started {run.started}, " + (f"finished {run.finished}" if run.finished else "not finished"),
        f"Device: {_device_line(run)}",
        f"Frameworks: {_versions(records)}; harness {run.harness_version} "
        f"(git {run.environment.get('git', {}).get('commit', 'unknown')[:12]})",
        f"Dataset: {spec['dataset']['name']}; {plural(spec['epochs'], 'epoch')} of floor(N / batch size) full "
        "batches; "
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
        *([f"Compilation cache: JAX's persistent cache in `{cache}`, shared by the trials: a first step or warm-up "
           "that found its programs there read them from disk instead of compiling"] if cache else []),
        *([f"Interrupted by {run.interrupted.by} at {run.interrupted.at}: {len(run.interrupted.not_run)} planned "
           "trial(s) not run; `harness run SPEC --resume RUN_DIR` continues it"] if run.interrupted else []),
    ]
    notes = ["Units: MB = 10^6 bytes; times in seconds unless marked ms; throughput in samples per second.",
             "Each cell is the median over repeats that ended ok; otherwise the trial's status."]
    if data.backend == "nvml":
        notes.append("GPU use % is NVML's utilization.gpu: the percentage of time, over the driver's sample period "
                     "(1/6 s to 1 s), during which at least one kernel was running. It is not SM occupancy: one tiny "
                     "kernel at a time reads as 100%. Achieved GFLOP/s says how much of the GPU did work.")
        if any(m.key in GPM_KEYS for m in data.metrics):
            notes.append("SM active %, SM occupancy %, tensor active % and DRAM bandwidth % are NVML's GPM metrics "
                         "(Hopper and newer; nvmlGpmMetricsGet over two samples, each sampling period one interval): "
                         "the % of SMs busy, resident warps as a % of the SMs' maximum, the % of time the tensor pipes "
                         "ran any tensor operation, and DRAM bandwidth used as a % of its maximum; MFU % is achieved "
                         "FLOP/s over the datasheet peak. n/a: that trial's GPU, driver or permissions did not provide "
                         "it (see How the sampler fared).")
    else:
        notes.append("No GPU was used: the 'use %' rows are the worker process tree's CPU use (100 = one core busy, "
                     "its CPU time over at least 50 ms) and the memory rows its anonymous resident memory, in the "
                     "layout of the GPU tables. No MFU: the harness knows the peak FLOP/s of GPUs only "
                     "(harness.measure.peaks); achieved GFLOP/s is given.")
    title_text = f"{spec['name']}: {len(records)} of {len(run.planned_trials)} trials"
    return Section("header", title_text, (BulletList(tuple(items)), Lines(tuple(notes))), level=1)


def environment_section(data: ReportData) -> Section | None:
    """Which interpreter each row ran in, with its Python, numpy and framework versions (run.json's ``frameworks``,
    from the probe before the first trial; runs made before the probe existed have none, and no section)."""
    if not data.run.frameworks:
        return None
    rows = []
    for entry in data.run.frameworks:
        versions = ", ".join(f"{k} {v}" for k, v in entry.versions.items() if not k.endswith("_build"))
        where = " ".join(entry.command) if entry.command else (entry.executable or "")
        rows.append([title(entry.label), entry.name, versions, str(entry.python_version or ""),
                     str(entry.numpy or ""), f"`{where}`"])
    table = simple_table(["row", "framework", "versions", "Python", "numpy", "interpreter or command"], rows)
    return Section("frameworks", "Frameworks and their environments", (table,))


#: What the Ohio State layout is: a reference layout, with this run's figures.
OHIO_STATE_NOTE = ("The layout of the Ohio State thesis tables that seed 002 quotes (use %, memory and accuracy per "
                   "framework and batch size), with this run's figures, to be read beside the reference's own.")


def plural(count: int, word: str) -> str:
    """``1 epoch``, ``2 epochs``."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def ohio_state_section(data: ReportData) -> Section:
    """The combined table of the thesis (``harness.results.tables.ohio_state_rows``)."""
    span = data.marks["util"] or data.marks["memory"]
    return Section("ohio_state", "The Ohio State layout", (
        Paragraph(OHIO_STATE_NOTE), batch_table(ohio_state_rows(data), data.batch_sizes),
        *((Paragraph(SPAN_NOTE),) if span else ())))


def memory_layers_section(data: ReportData) -> Section | None:
    """The memory layers the run measured (allocator, process, device), per framework
    (``harness.results.tables.memory_rows``); None where no row has a figure."""
    rows = memory_rows(data)
    if not rows:
        return None
    return Section("memory_layers", "Memory, layer by layer", (
        Paragraph(MEMORY_NOTE[data.backend]), batch_table(rows, data.batch_sizes)))


def empty_notes(data: ReportData, metric: Metric) -> list[str]:
    """Why a metric's cells read n/a, where the records say so: for MFU, ``harness.results.derived.mfu``'s notes
    (e.g. "unknown device: no peak (...)")."""
    if metric.key != "mfu":
        return []
    return sorted({found.note for r in data.records if (found := mfu(r)) is not None and found.note})


def metric_section(data: ReportData, metric: Metric) -> Section:
    """One metric's section: its meaning, its table, and for metrics with repeats the pairs within the noise."""
    rows = [(title(fw), metric_row(data, metric, fw, metric.digits)) for fw in data.frameworks]
    unit = f" ({metric.unit})" if metric.unit else ""
    blocks: list[Any] = [Paragraph(metric.meaning + "."), batch_table(rows, data.batch_sizes)]
    blocks += [Paragraph(SPAN_NOTE)] if data.marks[metric.key] else []
    empty = empty_notes(data, metric)
    blocks += [Paragraph(f"n/a: {'; '.join(empty)}.")] if empty else []
    if metric.ci and data.cis[metric.key]:
        pairs = noise_pairs(data, metric)
        spread = (f"Cells show the mean over {len(data.seeds)} seeds [95% t-interval of that mean] of each seed's "
                  "median over its repeats: the spread between trainings from other seeds (initial weights, batch "
                  "order, dropout). " if metric.over_seeds and len(data.seeds) > 1 else
                  "Cells show the median [95% bootstrap interval of the median] over the repeats (no interval where "
                  "every repeat gave the same value): " + (
                      "timing noise of the same training. " if not metric.over_seeds else
                      "the same seed, weights and batches each time, so only nondeterministic kernels differ. "))
        blocks.append(Paragraph(spread + (f"Within the noise (intervals overlap): {'; '.join(pairs)}." if pairs
                                          else "No compared pair's intervals overlap.")))
    return Section(f"metric:{metric.key}", f"{metric.title}{unit}", tuple(blocks))


def failed_section(data: ReportData) -> Section | None:
    """The trials that did not end ok, with their reasons (the first 300 characters); None when every one did."""
    failed = [r for r in data.records if r.status != "ok"]
    if not failed:
        return None
    table = simple_table(["trial", "status", "reason"], [[r.id, r.status, r.reason[:300]] for r in failed],
                         classes=["bad"] * len(failed))
    return Section("failed", "Trials that did not end ok", (table,))


def plots_section(data: ReportData) -> Section:
    """The links to the plots: one per metric drawn against batch size (``plots/<key>.png``,
    ``harness.results.plots.plotted_metrics``; with fewer than two batch sizes a line saying there are none), then each
    ok trial's time series."""
    trials = ", ".join(f"[{r.id}](plots/trials/{r.id}.png)" for r in data.records if r.status == "ok")
    drawn = plotted_metrics(data)
    against = (Images(tuple((m.title, f"plots/{m.key}.png") for m in drawn)) if drawn else Paragraph(NO_METRIC_PLOTS))
    return Section("plots", "Plots", (
        against,
        Paragraph("Per-trial time series (sampled metrics over time, warm-up and timed windows shaded): " + trials)))
