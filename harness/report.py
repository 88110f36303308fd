"""Run directory -> ``report.md`` (tables in the Ohio State layout) and ``plots/*.png``.

Every table has one row per framework and one column per batch size, like the tables of the Ohio State thesis quoted
in seed 002, so the two can be put side by side. A cell is the median over the repeats that ended ``ok``; a cell
with no ``ok`` repeat shows the status instead (``oom``, ``error``, ``timeout``, ``crashed``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from harness.results import read_lines, read_run, read_trials
from harness.stats import median_ci, overlaps

FRAMEWORK_TITLES = {"pytorch": "PyTorch", "tensorflow": "TensorFlow", "mxnet": "MXNet"}
MB = 1e6


@dataclass(frozen=True)
class Metric:
    """One reported quantity: how to read it from a trial record, its title, unit and meaning."""

    key: str
    title: str
    unit: str
    read: Callable[[dict[str, Any]], float | None]
    digits: int
    meaning: str
    sampler_metric: str | None = None  # the sampler metric it reads, whose statistics carry a scope
    ci: bool = False  # show the 95% bootstrap interval of the median over repeats


def row_key(record: dict[str, Any]) -> str:
    """The row a trial belongs to: its framework, plus its variant in parentheses when the spec has variants."""
    variant = record.get("variant") or ""
    return f"{record['framework']} ({variant})" if variant else record["framework"]


def _get(record: dict[str, Any], *path: str) -> Any:
    value: Any = record
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _scaled(scale: float, *path: str) -> Callable[[dict[str, Any]], float | None]:
    def read(record: dict[str, Any]) -> float | None:
        value = _get(record, *path)
        return None if value is None else float(value) * scale

    return read


def _stat(metric: str, stat: str, scale: float = 1.0) -> Callable[[dict[str, Any]], float | None]:
    return _scaled(scale, "sampler", "stats", metric, stat)


def _gpu_memory(record: dict[str, Any]) -> float | None:
    process = _get(record, "sampler", "stats", "process_memory_bytes", "max")
    if process is not None:
        return process / MB
    device = _get(record, "sampler", "stats", "device_memory_used_bytes", "max")
    return None if device is None else device / MB


def _energy_per_sample(record: dict[str, Any]) -> float | None:
    joules = _get(record, "sampler", "energy", "joules")
    samples = _get(record, "metrics", "measured_samples")
    return joules / samples if joules is not None and samples else None


def _mean_power(record: dict[str, Any]) -> float | None:
    power = _get(record, "sampler", "energy", "mean_power_w")
    return power if power is not None else _get(record, "sampler", "stats", "power_w", "mean")


def metrics_for(backend: str) -> list[Metric]:
    """The metrics reported for a run whose sampler used ``backend`` ("nvml" or "host")."""
    common = [
        Metric("throughput", "Throughput", "samples/s", _scaled(1.0, "metrics", "throughput"), 1,
               "training samples per second over the timed windows (warm-up, evaluation excluded)", ci=True),
        Metric("seconds_per_epoch", "Time per epoch", "s", _scaled(1.0, "metrics", "seconds_per_epoch"), 3,
               "samples per epoch / throughput: one epoch's training time without warm-up and evaluation", ci=True),
        Metric("step_ms", "Step time (median)", "ms", _scaled(1e3, "metrics", "step_time_median_s"), 3,
               "median over timed windows of window time / steps in the window"),
        Metric("step_p90_ms", "Step time (p90)", "ms", _scaled(1e3, "metrics", "step_time_p90_s"), 3,
               "90th percentile of the same per-step times"),
        Metric("accuracy", "Test accuracy after the last epoch", "%", _scaled(100.0, "metrics", "test_accuracy"),
               2, "share of the test set classified correctly after the last epoch", ci=True),
        Metric("train_loss", "Training loss (last epoch)", "", _scaled(1.0, "metrics", "final_train_loss"), 4,
               "mean of the losses read at each sync during the last epoch"),
        Metric("gflops", "Achieved training compute", "GFLOP/s", _scaled(1e-9, "metrics", "achieved_flops"), 2,
               "throughput x training FLOPs per sample (3 x forward; 2 FLOPs per multiply-accumulate)"),
    ]
    if backend == "nvml":
        device = [
            Metric("util", "GPU use (mean)", "%", _stat("gpu_util_percent", "mean"), 2,
                   "mean of NVML utilization.gpu over the timed windows: % of time any kernel ran (not SM occupancy)",
                   "gpu_util_percent"),
            Metric("util_max", "GPU use (max)", "%", _stat("gpu_util_percent", "max"), 2, "max of the same samples",
                   "gpu_util_percent"),
            Metric("memory", "GPU memory (worker, peak)", "MB", _gpu_memory, 1,
                   "peak NVML memory of the worker process on the GPU (device memory used where NVML does not report "
                   "per-process memory); MB = 10^6 bytes", "process_memory_bytes"),
            Metric("device_memory", "GPU memory (device, peak)", "MB", _stat("device_memory_used_bytes", "max", 1 / MB),
                   1, "peak NVML device memory used, all processes; MB = 10^6 bytes", "device_memory_used_bytes"),
            Metric("allocator_peak", "Framework allocator peak", "MB", _scaled(1 / MB, "metrics", "memory",
                                                                                "allocator_peak_bytes"), 1,
                   "the framework's own peak of tensor memory in the measured phase (PyTorch max_memory_allocated, "
                   "TensorFlow get_memory_info peak; MXNet exposes none)"),
            Metric("mfu", "Model FLOPs utilization", "%", _scaled(100.0, "metrics", "mfu"), 2,
                   "achieved training FLOP/s over the device's fp32 peak (harness.peaks, each with its datasheet "
                   "source); empty for a device not in the table"),
            Metric("power", "Power (mean)", "W", _mean_power, 1,
                   "mean board power over the timed windows (energy / time where NVML's energy counter exists, else "
                   "the mean of NVML power samples)", "power_w"),
            Metric("energy_per_sample", "Energy per training sample", "mJ",
                   lambda r: None if (e := _energy_per_sample(r)) is None else e * 1e3, 3,
                   "board energy over the timed windows (NVML total-energy counter, else integrated power) / samples "
                   "trained in them; the whole board, not only this process"),
        ]
    else:
        device = [
            Metric("util", "CPU use (mean)", "%", _stat("cpu_percent", "mean"), 1,
                   "mean CPU use of the worker process tree over the timed windows (psutil; 100 = one core busy)",
                   "cpu_percent"),
            Metric("util_max", "CPU use (max)", "%", _stat("cpu_percent", "max"), 1, "max of the same samples",
                   "cpu_percent"),
            Metric("memory", "Resident memory (peak)", "MB", _stat("rss_bytes", "max", 1 / MB), 1,
                   "peak resident set size of the worker process tree (psutil); MB = 10^6 bytes", "rss_bytes"),
        ]
    return device[:3] + common + device[3:]


def cell_values(records: list[dict[str, Any]], metric: Metric, framework: str, batch_size: int) -> list[float]:
    """The metric's finite values over the repeats of one cell that ended ok."""
    return [v for r in records if row_key(r) == framework and r["batch_size"] == batch_size
            and r["status"] == "ok" and (v := metric.read(r)) is not None and math.isfinite(v)]


def metric_table(records: list[dict[str, Any]], metric: Metric, frameworks: list[str],
                 batch_sizes: list[int]) -> pd.DataFrame:
    """Rows: frameworks; columns: batch sizes; cells: the median over ok repeats (float), or the status (str)."""
    table = pd.DataFrame(index=frameworks, columns=batch_sizes, dtype=object)
    for fw in frameworks:
        for bs in batch_sizes:
            ok = cell_values(records, metric, fw, bs)
            mine = [r for r in records if row_key(r) == fw and r["batch_size"] == bs]
            if ok:
                table.loc[fw, bs] = float(np.median(ok))
            elif mine:
                statuses = sorted({r["status"] for r in mine})
                table.loc[fw, bs] = "/".join(statuses) if statuses != ["ok"] else "n/a"
            else:
                table.loc[fw, bs] = ""
    return table


def ci_map(records: list[dict[str, Any]], metric: Metric, frameworks: list[str],
           batch_sizes: list[int]) -> dict[tuple[str, int], tuple[float, float]]:
    """95% bootstrap intervals of the median for the cells with two or more ok repeats."""
    out = {}
    for fw in frameworks:
        for bs in batch_sizes:
            interval = median_ci(cell_values(records, metric, fw, bs))
            if interval is not None:
                out[(fw, bs)] = interval
    return out


def noise_pairs(data: dict[str, Any], metric: Metric) -> list[str]:
    """Pairs of cells whose 95% intervals overlap: the frameworks at one batch size, and neighbouring batch sizes of
    one framework. Their difference is within the noise of this run."""
    cis = data["cis"][metric.key]
    pairs = []
    fws, sizes = data["frameworks"], data["batch_sizes"]
    for bs in sizes:
        for i, a in enumerate(fws):
            for b in fws[i + 1:]:
                if overlaps(cis.get((a, bs)), cis.get((b, bs))):
                    pairs.append(f"{_title(a)} vs {_title(b)} at batch size {bs}")
    for fw in fws:
        for x, y in zip(sizes, sizes[1:]):
            if overlaps(cis.get((fw, x)), cis.get((fw, y))):
                pairs.append(f"{_title(fw)}: batch size {x} vs {y}")
    return pairs


def span_cells(records: list[dict[str, Any]], metric: Metric) -> set[tuple[str, int]]:
    """(framework, batch size) cells whose sampler statistics came from the whole measured span instead of the timed
    windows (windows shorter than the sampling interval; see harness.sampler.phase_stats)."""
    if metric.sampler_metric is None:
        return set()
    return {(row_key(r), r["batch_size"]) for r in records if r["status"] == "ok"
            and _get(r, "sampler", "stats", metric.sampler_metric, "scope") == "span"}


SPAN_NOTE = ("\\* sampled over the whole measured span, evaluation pauses included: the timed windows were shorter than "
             "the sampling interval.")


def _cell(value: Any, digits: int, mark: bool = False) -> str:
    if isinstance(value, float):
        return f"{value:,.{digits}f}" + ("*" if mark else "")
    return str(value)


def _row(data: dict[str, Any], metric: Metric, framework: str, digits: int) -> list[str]:
    marks, cis = data["marks"][metric.key], data["cis"].get(metric.key, {})
    cells = []
    for bs, value in data["tables"][metric.key].loc[framework].items():
        text = _cell(value, digits, (framework, bs) in marks)
        if (framework, bs) in cis and cis[(framework, bs)][0] != cis[(framework, bs)][1]:
            low, high = cis[(framework, bs)]
            text += f" [{low:,.{digits}f}, {high:,.{digits}f}]"
        cells.append(text)
    return cells


def markdown_table(rows: list[tuple[str, list[str]]], batch_sizes: list[int], corner: str = "batch size") -> str:
    """A Markdown table with the Ohio State layout: a header row of batch sizes, then one labelled row each."""
    header = f"| {corner} | " + " | ".join(str(b) for b in batch_sizes) + " |"
    rule = "| --- | " + " | ".join("---:" for _ in batch_sizes) + " |"
    body = [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return "\n".join([header, rule, *body])


def _title(key: str) -> str:
    framework, _, variant = key.partition(" (")
    return FRAMEWORK_TITLES.get(framework, framework) + (f" ({variant}" if variant else "")


def build(run_dir: str | Path) -> dict[str, Any]:
    """Reads a run and computes what the report shows: the run info, the records, the metrics and their tables."""
    run = read_run(run_dir)
    records = read_trials(run_dir)
    spec = run["spec"]
    # Rows: frameworks in the spec's order, each with its variants in the order they ran.
    keys = list(dict.fromkeys(row_key(r) for r in records))
    frameworks = sorted(keys, key=lambda k: (spec["frameworks"].index(k.split(" (")[0])
                                             if k.split(" (")[0] in spec["frameworks"] else 99, keys.index(k)))
    frameworks = frameworks or spec["frameworks"]
    batch_sizes = [b for b in spec["batch_sizes"] if any(r["batch_size"] == b for r in records)] or spec["batch_sizes"]
    backend = next((r["sampler"].get("backend") for r in records if r.get("sampler", {}).get("backend")), "host")
    metrics = metrics_for(backend)
    tables = {m.key: metric_table(records, m, frameworks, batch_sizes) for m in metrics}
    marks = {m.key: span_cells(records, m) for m in metrics}
    cis = {m.key: ci_map(records, m, frameworks, batch_sizes) for m in metrics if m.ci}
    return {"run": run, "records": records, "frameworks": frameworks, "batch_sizes": batch_sizes,
            "backend": backend, "metrics": metrics, "tables": tables, "marks": marks, "cis": cis}


def ohio_state_rows(data: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The combined table of the thesis: per framework a use % row and a memory row, then the accuracy rows."""
    metrics = {m.key: m for m in data["metrics"]}
    epochs = data["run"]["spec"]["epochs"]
    util, memory = metrics["util"], metrics["memory"]
    util_label = "GPU use %" if data["backend"] == "nvml" else "CPU use %"
    memory_label = "GPU memory MB" if data["backend"] == "nvml" else "RSS MB"
    rows = []
    for fw in data["frameworks"]:
        for metric, label in ((util, util_label), (memory, memory_label)):
            rows.append((f"{_title(fw)} {label}", _row(data, metric, fw, 2)))
    for fw in data["frameworks"]:
        rows.append((f"{_title(fw)} accuracy after {epochs} epochs %", _row(data, metrics["accuracy"], fw, 2)))
    return rows


def _device_line(run: dict[str, Any]) -> str:
    env = run.get("environment", {})
    if run.get("device", "cpu").startswith("cuda"):
        gpu = env.get("gpu", {})
        names = ", ".join(d["name"] for d in gpu.get("devices", [])[:1]) or "unknown GPU"
        return f"{run['device']} ({names}, driver {gpu.get('driver', '?')})"
    return (f"cpu ({env.get('cpu', '?')}, {env.get('cpu_count_logical', '?')} logical cores, "
            f"{env.get('memory_total_bytes', 0) / 1e9:.1f} GB RAM)")


def _versions(records: list[dict[str, Any]]) -> str:
    seen: dict[str, str] = {}
    for r in records:
        for name, version in r.get("versions", {}).items():
            if name in ("torch", "tensorflow", "keras", "mxnet", "cuda", "cudnn"):
                seen.setdefault(name, version)
    return ", ".join(f"{k} {v}" for k, v in seen.items()) or "none reported"


def render_markdown(data: dict[str, Any]) -> str:
    """The whole report.md text."""
    run, records, spec = data["run"], data["records"], data["run"]["spec"]
    statuses = pd.Series([r["status"] for r in records]).value_counts().to_dict() if records else {}
    threads = spec.get("cpu_threads") or next((r.get("threads") for r in records if r.get("threads")), None)
    opt = spec["optimizer"]
    sampled = ("NVML (nvidia-ml-py)" if data["backend"] == "nvml" else "psutil (no GPU: the worker's CPU and memory)")
    interval = spec["sampler"]["interval_s"]
    lines = [
        f"# {spec['name']}: {len(records)} of {len(run.get('planned_trials', []))} trials",
        "",
        f"- Run: `{Path(run.get('run_dir', '')).name or run.get('started')}` started {run.get('started')}, "
        f"finished {run.get('finished') or 'not finished'}",
        f"- Device: {_device_line(run)}",
        f"- Frameworks: {_versions(records)}; harness {run.get('harness_version')} "
        f"(git {run.get('environment', {}).get('git', {}).get('commit', 'unknown')[:12]})",
        f"- Dataset: {spec['dataset']['name']}; {spec['epochs']} epochs of floor(N / batch size) full batches; "
        f"the first {spec['warmup_steps']} steps are warm-up (trained, not timed); evaluation after each epoch, not timed",
        f"- Optimizer: {opt['name']} (learning rate {opt['learning_rate']}"
        + (f", momentum {opt['momentum']}" if opt['name'] == 'sgd' else '')
        + f", weight decay {opt['weight_decay']}); precision fp32 (TF32 off on GPUs); seed {spec['seed']}",
        f"- CPU threads: {threads} intra-op, 1 inter-op, the same for every framework"
        + f"; device synchronized every {spec['timing']['sync_every']} step(s), at both edges of each timed window",
        f"- Sampling: {sampled} every {interval} s; statistics over samples inside the timed windows only",
        f"- Statuses: " + (", ".join(f"{k} {v}" for k, v in statuses.items()) or "no trial finished"),
        "",
        "Units: MB = 10^6 bytes; times in seconds unless marked ms; throughput in samples per second.",
        "Each cell is the median over repeats that ended ok; otherwise the trial's status.",
    ]
    if data["backend"] == "nvml":
        lines.append("GPU use % is NVML's utilization.gpu: the percentage of time, over the driver's sample period "
                     "(1/6 s to 1 s), during which at least one kernel was running. It is not SM occupancy: one tiny "
                     "kernel at a time reads as 100%. Achieved GFLOP/s says how much of the GPU did work.")
    else:
        lines.append("No GPU was used: the 'use %' rows are the worker process tree's CPU use (100 = one core busy) "
                     "and the memory rows its resident memory (RSS), in the layout of the GPU tables.")
    any_span = data["marks"]["util"] or data["marks"]["memory"]
    lines += ["", "## The Ohio State layout", "", markdown_table(ohio_state_rows(data), data["batch_sizes"]), ""]
    lines += [SPAN_NOTE, ""] if any_span else []
    lines += ["## Memory, layer by layer", "", MEMORY_NOTE[data["backend"]], "",
              markdown_table(memory_rows(data), data["batch_sizes"]), ""]
    for metric in data["metrics"]:
        rows = [(_title(fw), _row(data, metric, fw, metric.digits)) for fw in data["frameworks"]]
        unit = f" ({metric.unit})" if metric.unit else ""
        lines += [f"## {metric.title}{unit}", "", metric.meaning + ".", "",
                  markdown_table(rows, data["batch_sizes"]), ""]
        lines += [SPAN_NOTE, ""] if data["marks"][metric.key] else []
        if metric.ci and data["cis"][metric.key]:
            pairs = noise_pairs(data, metric)
            lines += ["Cells show the median [95% bootstrap interval of the median] over the repeats (no interval where "
                      "every repeat gave the same value). "
                      + (f"Within the noise (intervals overlap): {'; '.join(pairs)}." if pairs
                         else "No compared pair's intervals overlap."), ""]
    lines += study_sections(data)
    lines += measurement_notes(data)
    failed = [r for r in records if r["status"] != "ok"]
    if failed:
        lines += ["## Trials that did not end ok", "", "| trial | status | reason |", "| --- | --- | --- |"]
        lines += [f"| {r['id']} | {r['status']} | {str(r.get('reason', '')).replace('|', '/')[:300]} |"
                  for r in failed]
        lines.append("")
    lines += ["## Plots", ""] + [f"![{m.title}](plots/{m.key}.png)" for m in data["metrics"]] + [""]
    lines += ["Per-trial time series (sampled metrics over time, warm-up and timed windows shaded): "
              + ", ".join(f"[{r['id']}](plots/trials/{r['id']}.png)" for r in records if r["status"] == "ok"), ""]
    return "\n".join(lines)


def measurement_notes(data: dict[str, Any]) -> list[str]:
    """The "How the sampler fared" section: metrics the sampler could not read (and why), why NVML was not used,
    backend notes and errors, which energy method each trial's figure came from and how many windows were too short
    for it, and clocks-event (throttle) reasons seen during the timed windows. Empty when there is nothing to say."""
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
    lines: list[str] = []
    if unavailable:
        lines += ["Not measured (the device or driver does not provide it):", ""]
        lines += [f"- {metric}: {'; '.join(sorted(why))}" for metric, why in sorted(unavailable.items())]
        lines.append("")
    if notes:
        lines += ["Sampler notes:", ""]
        lines += [f"- {note} ({len(ids)} trial{'s' if len(ids) > 1 else ''})" for note, ids in notes.items()]
        lines.append("")
    if methods:
        names = {"counter": "NVML's total-energy counter (nvmlDeviceGetTotalEnergyConsumption)",
                 "power_integral": "power integrated over time (nvmlDeviceGetPowerUsage; no energy counter)",
                 "none": "no energy figure (neither counter nor power readings)"}
        lines += ["Energy came from: " + "; ".join(f"{names.get(m, m)}: {len(ids)} trials"
                                                   for m, ids in methods.items()) + ".", ""]
    if short:
        lines += ["Energy of windows shorter than the readings' refresh is approximate (the counter or power reading "
                  "lags the window edges): " + "; ".join(short[:20]) + ("; ..." if len(short) > 20 else "") + ".", ""]
    if throttled:
        lines += ["Clock throttling seen in the timed windows (share of samples; see nvmlClocksEventReasons): "
                  + "; ".join(throttled[:20]) + ".", ""]
    return (["## How the sampler fared", ""] + lines) if lines else []


def study_sections(data: dict[str, Any]) -> list[str]:
    """Sections for the batch-size studies a spec turns on: learning-rate scaling and gradient accumulation, time to
    a target accuracy, and powers of two against their neighbours."""
    spec, records, sizes = data["run"]["spec"], data["records"], data["batch_sizes"]
    lines: list[str] = []

    def per_cell(read: Any, digits: int) -> list[tuple[str, list[str]]]:
        metric = Metric("x", "x", "", read, digits, "")
        table = metric_table(records, metric, data["frameworks"], sizes)
        return [(_title(fw), [_cell(v, digits) for v in table.loc[fw]]) for fw in data["frameworks"]]

    if spec.get("accumulation_steps", 1) > 1 or spec.get("learning_rate_scaling", "none") != "none":
        lines += ["## Learning rate and effective batch size", "",
                  f"Learning-rate scaling: {spec.get('learning_rate_scaling', 'none')} relative to batch size "
                  f"{spec.get('base_batch_size')}; gradient accumulation: {spec.get('accumulation_steps', 1)} "
                  "micro-batches of the batch size per optimizer step (effective batch size = steps x batch size). "
                  "Batchnorm normalises each micro-batch on its own, so with batchnorm accumulation is not the same "
                  "as one large batch.", "",
                  "Effective batch size:", "",
                  markdown_table(per_cell(_scaled(1.0, "metrics", "effective_batch_size"), 0), sizes), "",
                  "Learning rate used:", "",
                  markdown_table(per_cell(lambda r: r.get("learning_rate"), 5), sizes), ""]
    target = spec.get("target_accuracy")
    if target:
        epochs = per_cell(_scaled(1.0, "metrics", "time_to_target", "epochs"), 0)
        seconds = per_cell(_scaled(1.0, "metrics", "time_to_target", "training_seconds"), 2)
        seconds_metric = Metric("t", "t", "", _scaled(1.0, "metrics", "time_to_target", "training_seconds"), 2, "")
        firsts = []
        for fw in data["frameworks"]:
            reached = []
            for bs in sizes:
                values = cell_values(records, seconds_metric, fw, bs)
                if values:
                    reached.append((float(np.median(values)), bs))
            if reached:
                best_seconds, best_size = min(reached)
                firsts.append(f"{_title(fw)}: batch size {best_size} ({best_seconds:.2f} s)")
            else:
                firsts.append(f"{_title(fw)}: not reached")
        lines += [f"## Time to {100 * target:g}% test accuracy", "",
                  "Training seconds (timed windows only, warm-up and evaluation excluded) and epochs until the test "
                  "accuracy after an epoch first reached the target; empty where it was never reached.", "",
                  "Epochs:", "", markdown_table(epochs, sizes), "", "Training seconds:", "",
                  markdown_table(seconds, sizes), "", "First to reach it: " + "; ".join(firsts) + ".", ""]
    powers = [n for n in sizes if n & (n - 1) == 0 and (n - 1 in sizes or n + 1 in sizes)]
    if powers:
        lines += ["## Powers of two against their neighbours", "",
                  "Throughput of n - 1 and n + 1 relative to the power of two n. With repeats, 'no measurable "
                  "difference' means the 95% intervals of the medians overlap.", "",
                  "| framework | n | neighbour | change % | verdict |", "| --- | ---: | ---: | ---: | --- |"]
        metric = next(m for m in data["metrics"] if m.key == "throughput")
        cis = data["cis"].get("throughput", {})
        for fw in data["frameworks"]:
            for n in powers:
                base = cell_values(records, metric, fw, n)
                for other in (n - 1, n + 1):
                    values = cell_values(records, metric, fw, other)
                    if other not in sizes or not base or not values:
                        continue
                    change = (np.median(values) - np.median(base)) / np.median(base) * 100
                    overlap = overlaps(cis.get((fw, n)), cis.get((fw, other)))
                    verdict = ("single runs: no interval" if overlap is None else
                               "no measurable difference" if overlap else
                               "faster" if change > 0 else "slower")
                    lines.append(f"| {_title(fw)} | {n} | {other} | {change:+.1f} | {verdict} |")
        lines.append("")
    return lines


MEMORY_NOTE = {
    "nvml": "Three layers, peaks over the timed windows, MB = 10^6 bytes: NVML's device memory used (every process on "
            "the GPU), NVML's memory of the worker process (what its allocator reserved plus the CUDA context), and "
            "the framework allocator's own peak of live tensors (PyTorch max_memory_allocated, and "
            "max_memory_reserved; TensorFlow get_memory_info peak; MXNet exposes no peak). Every layer includes the "
            "dataset, which the harness keeps on the device (data MB row).",
    "host": "On the CPU there is one layer: the resident memory (RSS) of the worker process tree, peak over the timed "
            "windows, MB = 10^6 bytes; it includes the interpreter, the framework libraries and the dataset "
            "(data MB row). PyTorch, TensorFlow and MXNet keep no allocator statistics for CPU memory.",
}


def memory_rows(data: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """Per framework, one row per memory layer the run has (see MEMORY_NOTE), plus the dataset's bytes."""
    if data["backend"] == "nvml":
        layers = [("NVML device MB", ("sampler", "stats", "device_memory_used_bytes", "max")),
                  ("NVML process MB", ("sampler", "stats", "process_memory_bytes", "max")),
                  ("allocator peak MB", ("metrics", "memory", "allocator_peak_bytes")),
                  ("allocator reserved peak MB", ("metrics", "memory", "allocator_reserved_peak_bytes"))]
    else:
        layers = [("RSS MB", ("sampler", "stats", "rss_bytes", "max"))]
    layers.append(("data MB", ("metrics", "data_bytes")))
    rows = []
    for fw in data["frameworks"]:
        for label, path in layers:
            metric = Metric(label, label, "MB", _scaled(1 / MB, *path), 1, "")
            table = metric_table(data["records"], metric, [fw], data["batch_sizes"])
            rows.append((f"{_title(fw)} {label}", [_cell(v, 1) for v in table.loc[fw]]))
    return rows


def plot(data: dict[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per metric: the metric against batch size (log2 axis), a line per framework; ok cells only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric in data["metrics"]:
        table = data["tables"][metric.key]
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        for fw in data["frameworks"]:
            points = [(bs, v) for bs, v in table.loc[fw].items() if isinstance(v, float)]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=_title(fw))
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["batch_sizes"], [str(b) for b in data["batch_sizes"]])
        ax.set_xlabel("batch size")
        ax.set_ylabel(f"{metric.title} ({metric.unit})" if metric.unit else metric.title)
        ax.set_title(metric.title)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        path = out_dir / f"{metric.key}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


SERIES_TITLES = {"cpu_percent": "CPU %", "rss_bytes": "RSS MB", "gpu_util_percent": "GPU use %",
                 "mem_util_percent": "memory use %", "device_memory_used_bytes": "device MB",
                 "process_memory_bytes": "process MB", "power_w": "power W", "sm_clock_mhz": "SM MHz",
                 "temperature_c": "temperature C"}


def plot_trial(run_dir: Path, trial_id: str, out: Path) -> Path | None:
    """The sampled metrics of one trial over time (seconds since the worker started), with the warm-up (grey) and
    the timed windows (green) shaded. Returns the PNG's path, or None when the trial has no samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from harness.sampler import windows_from_events

    samples = read_lines(run_dir / "samples" / f"{trial_id}.jsonl")
    events = read_lines(run_dir / "events" / f"{trial_id}.jsonl")
    names = [m for m in SERIES_TITLES if any(s.get(m) is not None for s in samples)]
    if not samples or not names:
        return None
    t0 = events[0]["t"] if events else samples[0]["t"]
    fig, axes = plt.subplots(len(names), 1, figsize=(7, 1.6 * len(names) + 0.6), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        scale = 1 / MB if name.endswith("_bytes") else 1.0
        points = [(s["t"] - t0, s[name] * scale) for s in samples if s.get(name) is not None]
        ax.plot(*zip(*points), lw=1, marker=".", ms=2)
        ax.set_ylabel(SERIES_TITLES[name], fontsize=8)
        for phase, color in (("warmup", "0.85"), ("train", "#c8e6c9")):
            for a, b in windows_from_events(events, phase):
                ax.axvspan(a - t0, b - t0, color=color, lw=0)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the worker started")
    axes[0, 0].set_title(f"{trial_id}: warm-up grey, timed windows green", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def write(run_dir: str | Path) -> Path:
    """Writes ``report.md`` and ``plots/`` (per-metric plots, and per-trial time series in ``plots/trials/``) into
    the run directory and returns the report's path."""
    run_dir = Path(run_dir)
    data = build(run_dir)
    data["run"]["run_dir"] = str(run_dir)
    plot(data, run_dir / "plots")
    for record in data["records"]:
        if record["status"] == "ok":
            plot_trial(run_dir, record["id"], run_dir / "plots" / "trials" / f"{record['id']}.png")
    path = run_dir / "report.md"
    path.write_text(render_markdown(data), encoding="utf-8")
    return path


def summary_rows(data: dict[str, Any]) -> list[list[str]]:
    """Rows for the terminal summary: framework, batch size, status, throughput, s/epoch, use %, memory, accuracy."""
    metrics = {m.key: m for m in data["metrics"]}
    keys = ("throughput", "seconds_per_epoch", "util", "memory", "accuracy")
    rows = []
    for fw in data["frameworks"]:
        for bs in data["batch_sizes"]:
            cells = [_cell(data["tables"][k].loc[fw, bs], metrics[k].digits, (fw, bs) in data["marks"][k])
                     for k in keys]
            statuses = sorted({r["status"] for r in data["records"] if row_key(r) == fw and r["batch_size"] == bs})
            rows.append([_title(fw), str(bs), "/".join(statuses)] + cells)
    return rows
