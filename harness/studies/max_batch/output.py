"""What a max-batch search leaves: the probe table printed on the terminal, ``max_batch.md``, and the run directory
``<out>/<UTC time>-<spec name>-max-batch-<framework>/`` (``run.json`` with the settings, the environment and the
result; ``probes.jsonl``, one line per probe appended as it finishes; ``events/<probe>.jsonl``)."""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness.measure import machine
from harness.results.schema import SCHEMA_VERSION
from harness.results.store import append_line, create_run_dir, write_events, write_json
from harness.spec import Spec
from harness.spec.frameworks import slug
from harness.studies.max_batch.probe import MaxBatchResult, Probe
from harness.version import __version__


def _steps(steps: int | None) -> str:
    """A probe's steps per epoch, in words."""
    if steps is None:
        return "every step over its training images"
    return "one optimizer step" if steps == 1 else f"its first {steps} optimizer steps"


def mb(value: float | None) -> str:
    """Bytes as MB (10^6 bytes) with one decimal, "-" for None."""
    return "-" if value is None else f"{value / 1e6:,.1f}"


def table(result: MaxBatchResult) -> str:
    """The probes and run checks as a short plain-text table, in the order they ran (under data parallelism
    ``batch`` is the per-device batch and ``global`` N x it), then the result lines."""
    dp = result.data_parallel > 1
    rows = [("#", "batch", *(("global",) if dp else ()), "status", "peak MB", "model MB", "seconds",
             "purpose / reason")]
    for p in result.probes:
        model = mb(result.model.predict_peak(p.batch_size)) if result.model is not None else "-"
        note = p.purpose if p.status == "ok" else f"{p.purpose}: {p.reason}"[:70]
        rows.append((str(p.index + 1), str(p.batch_size), *((str(result.global_batch(p.batch_size)),) if dp else ()),
                     p.status, mb(p.peak_bytes), model, f"{p.seconds:.1f}", note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {0, 1, 2, 4, 5, 6} if dp else {0, 1, 3, 4, 5}
    lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             .rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.extend(summary_lines(result))
    return "\n".join(lines)


def per_device(result: MaxBatchResult, batch_size: int | None) -> str:
    """A per-device batch in words: "370", or under data parallelism "185 per device, global 370"; "-" for None."""
    if batch_size is None:
        return "-"
    if result.data_parallel == 1:
        return str(batch_size)
    return f"{batch_size} per device, global {result.global_batch(batch_size)}"


def summary_lines(result: MaxBatchResult) -> list[str]:
    """The result in a few lines: status, cap, probe data, memory model, the answer, the band, the spread of the
    answer's peak, the margin, the run checks, the recommendation, the notes."""
    dp = f", data-parallel on {result.data_parallel} devices" if result.data_parallel > 1 else ""
    out = [f"{result.framework} on {result.device}{dp}: {result.status}: {result.reason}",
           f"cap: {mb(result.cap_bytes)} MB ({result.cap_source})", f"probe data: {probe_data(result)}"]
    if result.data_parallel > 1:
        out.append(f"data parallelism: every batch below is per device (global = {result.data_parallel} x it); each "
                   "probe is one data-parallel trial, and the cap applies to each worker process as in a run (a "
                   "rank per device where the framework runs one process per device, else the one process that "
                   "drives every device)")
    if result.model is not None:
        m = result.model
        first = (f"{result.predicted_limit} first ({result.predicted_by or 'the first probes'})"
                 if result.predicted_limit is not None else
                 f"none first ({result.predicted_by.removeprefix('none: ') or 'no prediction'})")
        out.append(f"memory model: {mb(m.fixed_bytes)} MB + {m.per_sample_bytes / 1e3:,.1f} kB x batch "
                   f"(r^2 {m.r2:.3f}, {m.points} probes); predicted limit: {first}, "
                   f"{result.final_predicted_limit} from all probes")
    else:
        out.append("memory model: not enough successful probes with a peak to fit")
    out.extend(neutral_lines(result))
    out.append(f"largest batch that fits: {per_device(result, result.limit)}"
               + (" (ok in both of its probes)" if result.limit is not None else "")
               + (f" (smallest that failed: {result.smallest_oom})" if result.smallest_oom is not None else ""))
    band = result.fits_sometimes
    out.append("fits sometimes: " + ("none seen" if band is None else
                                     f"{band[0]}..{band[1]} (ok in some probes, out of memory in others: "
                                     "never the answer)"))
    out.extend(recommendation_lines(result))
    out.extend(f"note: {n}" for n in result.notes)
    return out


def recommendation_lines(result: MaxBatchResult) -> list[str]:
    """The spread of the peak across the answer's probes, the margin it justifies, what a run adds beyond a probe,
    and the recommendation with what confirmed it."""
    out = []
    spread = result.peak_spread
    if spread is not None:
        samples = spread["spread_samples"]
        worth = (f" ({samples:,.1f} samples at {spread['spread_bytes'] / samples / 1e3:,.1f} kB per sample)"
                 if samples else "")
        out.append(f"peak at the answer: {mb(spread['min_bytes'])}..{mb(spread['max_bytes'])} MB over "
                   f"{len(spread['peaks_bytes'])} probes, spread {mb(spread['spread_bytes'])} MB{worth}")
    elif result.limit is not None:
        out.append("peak at the answer: fewer than two probes reported one, no spread")
    if result.margin_samples is not None:
        out.append(f"margin: {result.margin_samples} samples below the limit ({result.margin_basis})")
    offset = result.run_offset
    if offset is not None and offset["offset_bytes"] is not None:
        held = (f"; the cap's {offset['headroom_bytes'] / 1e6:,.1f} MB of headroom beyond the margin holds the rest"
                if offset.get("headroom_bytes") else "")
        out.append(f"a run's peak against the probes': {offset['offset_bytes'] / 1e6:+,.1f} MB at batch size "
                   f"{offset['batch_size']} ({offset['offset_samples']} samples kept below the margin's target"
                   f"{held})")
    out.append(f"recommended: {per_device(result, result.recommended)}" + _confirmed_by(result))
    return out


def _confirmed_by(result: MaxBatchResult) -> str:
    """How the recommendation was confirmed, in words ("" without one)."""
    if result.recommended is None:
        return ""
    if result.recommended_by != "runs":
        return " (ok in both of its probes)"
    shape, peaks = result.run_check or {}, result.peaks(result.recommended, "run")
    span = f"; peaks {mb(min(peaks))}..{mb(max(peaks))} MB" if peaks else ""
    return (f" (ok in {result.statuses(result.recommended, 'run').count('ok')} run checks, each the spec's trial as "
            f"`harness run` runs it: its {shape.get('dataset')} dataset ({shape.get('train_size')} training "
            f"samples), warm-up steps {shape.get('warmup_steps')}, epochs {shape.get('epochs')} of at most "
            f"{shape.get('steps_per_epoch')} steps, an evaluation after each{span})")


def neutral_lines(result: MaxBatchResult) -> list[str]:
    """The neutral model's prediction (harness.neutral.memory) against what the probes measured: its limit against
    the measured one, its per-sample bytes against the fitted slope, its fixed bytes against the fitted intercept."""
    n = result.neutral
    if n is None:
        return []
    out = [f"neutral model (parameters, gradients, optimizer state, buffers{', dataset' if result.with_dataset else ''}"
           f" + saved activations and probe data per sample): {mb(n.fixed_bytes)} MB + "
           f"{n.per_sample_bytes / 1e3:,.1f} kB x batch; its limit under the cap: "
           f"{result.neutral_limit if result.neutral_limit is not None else '-'}"]
    if result.neutral_limit and result.limit:
        out[-1] += f" against {result.limit} measured ({result.neutral_limit / result.limit:.2f} x)"
    m = result.model
    if m is not None and n.per_sample_bytes > 0:
        out.append(f"framework overhead: {m.per_sample_bytes / n.per_sample_bytes:.2f} x the neutral per-sample bytes "
                   f"({(m.per_sample_bytes - n.per_sample_bytes) / 1e3:+,.1f} kB per sample: transient gradients, "
                   f"workspaces, copies) and {(m.fixed_bytes - n.fixed_bytes) / 1e6:+,.1f} MB fixed (the framework's "
                   "runtime and caches above the worker's baseline)")
    return out


def probe_data(result: MaxBatchResult) -> str:
    """What the probes held as data, in words (see harness.studies.max_batch.search)."""
    if result.with_dataset:
        return (f"the spec's dataset resident, as in a run (--with-dataset): {result.train_size} training images, "
                f"{mb(result.dataset_bytes)} MB in all; batch sizes up to {result.max_batch}")
    run = result.run_data
    if run is None:
        return (f"synthetic images of the dataset's shape sized to each batch, "
                f"{result.probe_data_bytes_per_sample:,} bytes per batch sample")
    return (f"synthetic images of the dataset's shape, as many as a run of the spec holds ({run['train_size']} "
            f"training and {run['test_size']} test, {mb(run['bytes'])} MB; more training samples where the batch "
            "needs more), "
            f"{result.probe_data_bytes_per_sample:,} bytes per batch sample")


def markdown(result: MaxBatchResult, spec: Spec) -> str:
    """max_batch.md: the result, the probes and how they were made."""
    dp = f", data-parallel on {result.data_parallel} devices" if result.data_parallel > 1 else ""
    lines = [f"# Largest batch: {spec.name}, {result.framework} on {result.device}{dp}", ""]
    lines += [f"- {line}" for line in summary_lines(result)]
    lines += ["", "## Probes", "", "| # | batch | global | kind | status | peak MB | model MB | seconds | purpose | "
                                   "reason |", "| ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | --- | --- |"]
    for p in result.probes:
        model = mb(result.model.predict_peak(p.batch_size)) if result.model is not None else "-"
        reason = p.reason.replace("|", "\\|")[:160]
        lines.append(f"| {p.index + 1} | {p.batch_size} | {result.global_batch(p.batch_size)} | {p.kind} | "
                     f"{p.status} | {mb(p.peak_bytes)} | {model} | {p.seconds:.1f} | {p.purpose} | {reason} |")
    sources = sorted({p.peak_source for p in result.probes if p.peak_source})
    if result.with_dataset:
        data = (f"with the spec's dataset loaded whole, as in a run ({result.train_size} training images, "
                f"{result.dataset_bytes:,} bytes, inside the cap; each epoch cut to its first step, the evaluation "
                "over the whole test set), so no batch exceeds the training set")
    else:
        data = (f"on synthetic images of the spec's shape and classes ({probe_data(result)}: at least "
                f"{spec.accumulation_steps} x B training and B test images, inside the cap)")
    lines += ["", "## Method", "",
              f"Each probe is one worker process{_group(result)}: {result.probe_epochs} epochs without warm-up, "
              f"{_steps(result.probe_steps)} and an evaluation at the batch size each, {data}. "
              "OOM is the worker's status `oom` (the framework's own out-of-memory error); any other failure stops "
              "the search. The answer (and the recommendation) was ok in two probes, each in a fresh worker; a size "
              "that was ok in one probe and out of memory in another fits only sometimes: it is reported in the "
              "band, never as the answer, and the search went on below it. "
              "The limit is that measured boundary. The recommendation keeps the margin above below it (by default "
              "twice the spread of the peak across the answer's probes) and what a run holds beyond a probe (measured "
              "by a run check at the smallest size that fitted), and was ok in every run check made of it: the "
              "spec's own trial as `harness run` runs it (kind `run`), each in a fresh worker; a size that failed "
              "one moved the candidate down (by steps that double, at most half the way to the largest size that "
              "held in a run). "
              "The search draws its line through the two largest sizes that fit; the memory model reported is a "
              "least-squares line through the peaks of the successful probes; "
              f"peak sources: {', '.join(sources) or 'none'}. "
              "On the CPU the cap and the peaks count from the worker's memory once the framework is imported "
              "(see harness/execution/limits.py).", ""]
    if any(p.kind == "compile" for p in result.probes):
        lines += ["Before the first probe and the first run check of each size, a worker of kind `compile` trained it "
                  "once to compile its steps into the persistent compilation cache; its peak (what compiling "
                  "borrowed included: XLA's autotuning on a GPU) is shown but not compared, and the probes and run "
                  "checks after it read their steps from the cache. One that failed would have been the size's "
                  "probe.", ""]
    return "\n".join(lines)


def _group(result: MaxBatchResult) -> str:
    """Under data parallelism, what a probe is beyond one worker process, in words ("" for one device)."""
    if result.data_parallel == 1:
        return ""
    return (f" group, one data-parallel trial on {result.data_parallel} devices training the global batch "
            f"({result.data_parallel} x the per-device batch; a process per device where the framework runs one, "
            "each under the cap)")


class RunWriter:
    """The run directory of one search (see the module docstring), written as the search goes: run.json at once,
    each probe appended (flushed and fsynced) to probes.jsonl as it finishes, the result and max_batch.md at the end."""

    def __init__(self, out_root: str | Path, spec: Spec, framework: str, device: str,
                 spec_path: str | Path | None = None, settings: dict[str, Any] | None = None):
        self.spec = spec
        self.run_dir = create_run_dir(out_root, f"{spec.name}-max-batch-{slug(framework)}")
        self.info: dict[str, Any] = {
            "kind": "max-batch", "schema_version": SCHEMA_VERSION, "harness_version": __version__,
            "spec_file": str(spec_path) if spec_path else None,
            "spec": spec.model_dump(mode="json"), "framework": framework, "device": device,
            "settings": settings or {}, "environment": machine.collect(), "started": _now(), "finished": None,
            "result": None}
        write_json(self.run_dir / "run.json", self.info)

    def probe(self, probe: Probe, outcome: Any | None = None) -> None:
        append_line(self.run_dir / "probes.jsonl", asdict(probe))
        if outcome is not None:
            write_events(self.run_dir / "events" / f"probe{probe.index + 1}-bs{probe.batch_size}.jsonl",
                         outcome.events)

    def finish(self, result: MaxBatchResult) -> Path:
        self.info.update({"finished": _now(), "result": result.to_dict()})
        write_json(self.run_dir / "run.json", self.info)
        (self.run_dir / "max_batch.md").write_text(markdown(result, self.spec), encoding="utf-8")
        return self.run_dir


def write_run(result: MaxBatchResult, spec: Spec, out_root: str | Path, spec_path: str | Path | None = None) -> Path:
    """Writes the run directory of a finished search at once (probes without their events) and returns it."""
    writer = RunWriter(out_root, spec, result.framework, result.device, spec_path)
    for probe in result.probes:
        writer.probe(probe)
    return writer.finish(result)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
