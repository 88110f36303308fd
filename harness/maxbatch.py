"""The largest batch that fits (seed 004): measured, one worker process per probe, never guessed.

Each probe trains the spec's model at one batch size in a fresh worker (``harness.launcher.run_worker``) under the
memory cap: three full optimizer steps and an evaluation at that batch size. The worker's status decides: ``ok``
fits, ``oom`` (the framework's own out-of-memory error, see ``harness.limits`` on the CPU, or Python's own
``MemoryError``, which the worker reports as oom: an allocation outside the framework's allocator failing under the
cap, numpy or a module PyTorch imports lazily when the cap is below its runtime's needs) does not; so does a worker
that ran out of memory even for its error report (it exits "without reporting why" with MemoryError last in its log). On the CPU, a probe that ends
``error`` or ``crashed`` under the cap (MXNet's engine can abort with SIGABRT when a thread's stack or a buffer cannot
be allocated) runs once more without the cap: if that control run is ok, the cap caused the failure and it counts as
out of memory (the reason says so). Any other ending (``error``, ``crashed``, ``timeout``) stops the search with its
reason, since it says nothing about memory.

The probe: the spec as it is (model, optimizer, allocator settings, accumulation_steps, threads, seed) except that
the data are **synthetic images of the spec's dataset's shape and classes** (the real dataset may be too small for
large batches: digits has 1438 training images), ``accumulation_steps`` x B training samples and B test samples, for
``epochs: 3`` of one optimizer step each with no warm-up; the spec's variants, repeats and target accuracy are
dropped (its ``optimizer`` is used). The probe's data are inside the cap: accumulation_steps + 1 images per batch
sample (plus the framework's own copy where it makes one), which the fitted per-sample bytes therefore include.

The search:

1. probe a few small sizes (``initial_sizes``, default 16, 64, 256; stopping at the first that runs out of memory);
   if even the smallest probed size fails, probe ``min_batch``: if that fails too, nothing fits;
2. fit the memory model ``peak_bytes = fixed + per_sample x B`` by least squares over the successful probes, and
   predict the limit from the cap: floor((cap - fixed) / per_sample);
3. probe the prediction (at most MAX_JUMP times the largest fitting size; doubling while there is no prediction;
   once sizes above the prediction fit, steps of tolerance x the largest fitting size, doubling each time) until a
   size fails, so that the largest fitting size and the smallest failing one bracket the limit;
4. narrow the bracket until the gap is at most ``tolerance`` x the largest fitting size (at least 1): each probe is
   the model's prediction refitted with every successful probe so far, where it falls inside the bracket, else the
   midpoint, kept one tolerance step away from both ends (so a probe next to an end closes the bracket whichever
   way it goes);
5. with a ``margin`` m > 0, probe floor(limit x (1 - m)) too; the recommendation is the largest size at or below it
   that was probed successfully (memory is not always monotonic in the batch size, so it is verified, not assumed).

The result never names a size that was not probed successfully.

What the cap and the peak are:

- CPU: the cap is ``memory_limit_mb`` (or, without one, the host's available memory less 2 GiB), applied to each
  probe's worker by ``harness.limits`` as memory beyond what the worker holds once the framework is imported. The
  peak fitted is the worker's ``memory_peak`` event, measured from the same baseline: TensorFlow's CPU BFC
  allocator peak (the capped quantity, exact); for PyTorch and MXNet an estimate of the capped VmData peak, which
  the kernel does not keep (see ``harness.limits.peak_estimate``), so the prediction is approximate and the probes
  around it decide.
- GPU: the cap is ``memory_limit_mb`` (applied by the adapters through each framework's own limit) or the device's
  total memory (NVML); the peak is the framework allocator's peak (``metrics.memory.allocator_peak_bytes``), else
  NVML's per-process memory (``sampler.stats.process_memory_bytes.max``), else the device memory in use. CUDA's own
  context is outside the allocator peak, so a prediction from the device total errs high; again the probes decide.
  (Written from the documentation; no GPU was available to run it.)

Outputs (``write_run``): ``<out>/<UTC time>-<spec name>-max-batch-<framework>/`` with ``run.json`` (settings,
environment, the result), ``probes.jsonl`` (one line per probe, appended as it finishes), ``events/<probe>.jsonl``
and ``max_batch.md``.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from harness import datasets
from harness.launcher import run_worker
from harness.plan import plan
from harness.runner import resolve_device
from harness.spec import Spec, validate

DEFAULT_INITIAL_SIZES = (16, 64, 256)
DEFAULT_TOLERANCE = 0.05
MAX_JUMP = 8  # without an upper bound, a probe is at most this many times the largest fitting size
DEFAULT_MAX_BATCH = 1 << 20
CPU_HEADROOM_BYTES = 2 << 30  # without memory_limit_mb, the CPU cap is the available memory less this
PROBE_EPOCHS = 3  # one optimizer step per epoch: three steps, three evaluations
# A worker that ran out of memory even for its error report exits "without reporting why", with this last log line.
MEMORY_ERROR_LINE = "without reporting why: MemoryError"

STATUSES = ("found", "no_oom", "nothing_fits", "stopped")


@dataclass
class Probe:
    """One worker at one batch size. peak_bytes: the fitted memory figure (see the module docstring), None when the
    worker did not report it; seconds: the worker's wall time."""

    index: int
    batch_size: int
    status: str
    reason: str
    peak_bytes: float | None
    peak_source: str
    seconds: float
    purpose: str = ""
    log_tail: str = ""


@dataclass
class MemoryModel:
    """peak_bytes = fixed_bytes + per_sample_bytes x batch size, least squares over ``points`` probes; r2 is the
    coefficient of determination (1.0 for two points, which a line always fits)."""

    fixed_bytes: float
    per_sample_bytes: float
    r2: float
    points: int

    def predict_limit(self, cap_bytes: float) -> int | None:
        """The largest batch size whose predicted peak is within ``cap_bytes``; None when the per-sample cost is not
        positive (no prediction) or the fixed part alone exceeds the cap (0)."""
        if self.per_sample_bytes <= 0:
            return None
        return max(0, math.floor((cap_bytes - self.fixed_bytes) / self.per_sample_bytes + 1e-9))  # not 399.99..

    def predict_peak(self, batch_size: int) -> float:
        return self.fixed_bytes + self.per_sample_bytes * batch_size


def fit_memory_model(points: Sequence[tuple[float, float]]) -> MemoryModel | None:
    """Least-squares line through (batch size, peak bytes) points; None with fewer than two distinct sizes."""
    if len({b for b, _ in points}) < 2:
        return None
    x = np.asarray([b for b, _ in points], dtype=float)
    y = np.asarray([p for _, p in points], dtype=float)
    per_sample, fixed = np.polyfit(x, y, 1)
    residual = float(np.sum((y - (fixed + per_sample * x)) ** 2))
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - residual / total if total > 0 else (1.0 if residual == 0 else 0.0)
    return MemoryModel(float(fixed), float(per_sample), r2, len(points))


@dataclass
class MaxBatchResult:
    """What the search found.

    status: ``found`` (limit and smallest_oom bracket the limit within the tolerance), ``no_oom`` (max_batch fitted:
    the cap was not reached), ``nothing_fits`` (even min_batch ran out of memory), ``stopped`` (a probe ended
    neither ok nor oom; ``reason`` says how). limit: the largest size probed successfully (None when nothing fits);
    recommended: the largest size probed successfully at or below limit x (1 - margin). predicted_limit: the
    model's prediction from the probes before it was first probed; final_predicted_limit: from every successful
    probe (model is that final fit). cap_bytes and the peaks are
    bytes; for the CPU they count from the worker's baseline (see harness.limits).
    """

    framework: str
    device: str
    status: str
    reason: str
    cap_bytes: float
    cap_source: str
    margin: float
    tolerance: float
    probes: list[Probe] = field(default_factory=list)
    model: MemoryModel | None = None
    predicted_limit: int | None = None
    final_predicted_limit: int | None = None
    limit: int | None = None
    smallest_oom: int | None = None
    recommended: int | None = None
    probe_data_bytes_per_sample: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["probes"] = [{k: v for k, v in asdict(p).items() if k != "log_tail"} for p in self.probes]
        return out

    def probed(self, batch_size: int) -> Probe | None:
        return next((p for p in self.probes if p.batch_size == batch_size), None)


class _Stop(Exception):
    def __init__(self, probe: Probe):
        self.probe = probe


def probe_spec(spec: Spec, framework: str, batch_size: int, memory_limit_mb: float | None, device: str,
               spec_file: str | Path = "<max-batch probe>") -> Spec:
    """The spec one probe runs (see the module docstring): synthetic data of the spec's image shape and classes,
    accumulation_steps x ``batch_size`` training and ``batch_size`` test samples, 3 epochs of one step, no warm-up."""
    shape, classes = datasets.describe(spec.dataset)
    data = spec.model_dump(mode="json")
    data.update({
        "dataset": {"name": "synthetic", "shape": list(shape), "classes": classes,
                    "size": batch_size * spec.accumulation_steps, "test_size": batch_size},
        "frameworks": [framework], "batch_sizes": [batch_size], "epochs": PROBE_EPOCHS, "warmup_steps": 0,
        "repeats": 1, "variants": None,
        "target_accuracy": None, "memory_limit_mb": memory_limit_mb, "device": device,
    })
    return validate(data, spec_file)


def _peak(outcome: Any, device: str) -> tuple[float | None, str]:
    """The fitted memory figure of a probe (see the module docstring) and where it came from."""
    if device == "cpu":
        event = next((e for e in outcome.events if e.get("event") == "memory_peak"), None)
        if event is not None and event.get("peak_bytes") is not None:
            return float(event["peak_bytes"]), str(event.get("source", "memory_peak"))
        stats = outcome.sampler.get("stats", {}).get("rss_bytes", {})
        return (float(stats["max"]), "sampler rss_bytes max (absolute)") if stats.get("max") else (None, "none")
    result = outcome.result() or {}
    allocator = result.get("metrics", {}).get("memory", {}).get("allocator_peak_bytes")
    if allocator:
        return float(allocator), "allocator_peak_bytes"
    stats = outcome.sampler.get("stats", {})
    for metric in ("process_memory_bytes", "device_memory_used_bytes"):
        if stats.get(metric, {}).get("max"):
            return float(stats[metric]["max"]), f"sampler {metric} max"
    return None, "none"


def _reason(outcome: Any) -> str:
    """The worker's reason (the first line of the exception's message), completed from the error's traceback where
    that line says little: MXNet's messages start with a traceback of their own (the last line is the error, e.g.
    "MXNetError: Failed to allocate CPU Memory"), TensorFlow's with "Graph execution error" (the line "OOM when
    allocating tensor with shape[...]" follows)."""
    error = next((e for e in outcome.events if e.get("event") == "error"), {})
    lines = [line.strip() for line in error.get("traceback", "").splitlines() if line.strip()]
    if "Traceback (most recent call last)" in outcome.reason and lines:
        return lines[-1]
    detail = next((line for line in lines if line.startswith("OOM when allocating")), None)
    return f"{outcome.reason}: {detail[:300]}" if detail else outcome.reason


def resolve_cap(device: str, memory_limit_mb: float | None) -> tuple[float, str]:
    """(cap bytes, where it came from) for a device: memory_limit_mb when given, else the GPU's total memory (NVML)
    or, on the CPU, the host's available memory less CPU_HEADROOM_BYTES. Raises ValueError when there is none."""
    if memory_limit_mb is not None:
        return memory_limit_mb * 1e6, f"memory_limit_mb {memory_limit_mb:g}"
    if device == "cpu":
        import psutil

        available = psutil.virtual_memory().available
        return float(max(available - CPU_HEADROOM_BYTES, 1)), "host available memory less 2 GiB (no memory_limit_mb)"
    from harness import environment
    from harness.sampler import nvml_visible_index

    gpus = environment.gpus()
    if not gpus.get("available"):
        raise ValueError(f"no memory_limit_mb and NVML cannot tell {device}'s memory ({gpus.get('reason', '')})")
    target = nvml_visible_index(device)
    for gpu in gpus["devices"]:
        if gpu["index"] == target or gpu["uuid"] == target:
            return float(gpu["memory_total_bytes"]), f"{gpu['name']} total memory (NVML)"
    raise ValueError(f"no memory_limit_mb and NVML lists no device for {device}")


def find_max_batch(spec: Spec, framework: str, device: str | None = None, *, memory_limit_mb: float | None = None,
                   margin: float = 0.0, tolerance: float = DEFAULT_TOLERANCE,
                   initial_sizes: Sequence[int] | None = None, min_batch: int = 1, max_batch: int | None = None,
                   timeout_s: float | None = None, spec_file: str | Path | None = None,
                   on_probe: Callable[[Probe, Any], None] | None = None) -> MaxBatchResult:
    """Searches the largest batch size of ``framework`` that fits ``spec``'s memory cap (see the module docstring).

    device: "cpu" or "cuda:N"; None resolves the spec's device ("auto": a GPU when NVML sees one).
    memory_limit_mb: overrides the spec's. margin: fraction kept free for the recommendation (0 <= margin < 1).
    tolerance: the search stops when the smallest failing size is within tolerance x the largest fitting one.
    initial_sizes: the small sizes probed first. min_batch / max_batch: the range searched. timeout_s: per probe
    (default: the spec's timeout_s). spec_file: named in errors about the probe spec.
    on_probe(probe, outcome): called after every probe (outcome: harness.launcher.Outcome).
    """
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), not {margin}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, not {tolerance}")
    max_batch = max_batch or DEFAULT_MAX_BATCH
    if not 1 <= min_batch <= max_batch:
        raise ValueError(f"need 1 <= min_batch <= max_batch, not {min_batch} and {max_batch}")
    device = device or resolve_device(spec.device)
    limit_mb = memory_limit_mb if memory_limit_mb is not None else spec.memory_limit_mb
    cap_bytes, cap_source = resolve_cap(device, limit_mb)
    # The worker caps exactly this (on the CPU always: without a cap, an OOM would be the kernel's OOM killer).
    applied_mb = limit_mb if limit_mb is not None else (cap_bytes / 1e6 if device == "cpu" else None)
    shape, _ = datasets.describe(spec.dataset)
    result = MaxBatchResult(framework=framework, device=device, status="stopped", reason="", cap_bytes=cap_bytes,
                            cap_source=cap_source, margin=margin, tolerance=tolerance,
                            probe_data_bytes_per_sample=(spec.accumulation_steps + 1) * (int(np.prod(shape)) * 4 + 8))
    timeout = timeout_s if timeout_s is not None else spec.timeout_s
    file = spec_file or "<max-batch probe>"

    def probe(batch_size: int, purpose: str) -> bool:
        """True when ``batch_size`` fits. Raises _Stop for a probe that neither fits nor runs out of memory."""
        if (done := result.probed(batch_size)) is not None:
            return done.status == "ok"
        pspec = probe_spec(spec, framework, batch_size, applied_mb, device, file)
        trial = plan(pspec, device)[0]
        outcome = run_worker(trial.payload(pspec), timeout, pspec.sampler.interval_s, device, trial.threads)
        status, reason = outcome.status, _reason(outcome)
        if status == "error" and MEMORY_ERROR_LINE in reason:  # a raised MemoryError the worker reports as oom
            status, reason = "oom", f"{reason} (Python's MemoryError: an allocation outside the framework failed)"
        if status in ("error", "crashed") and device == "cpu" and applied_mb is not None:
            status, reason = control(batch_size, status, reason)
        peak, source = _peak(outcome, device) if status in ("ok", "oom") else (None, "")
        if status == "oom" and peak is not None:  # reached before the failure: a lower bound, not fitted
            source += " (at the failure: a lower bound)"
        record = Probe(index=len(result.probes), batch_size=batch_size, status=status, reason=reason,
                       peak_bytes=peak, peak_source=source, seconds=outcome.wall_seconds, purpose=purpose,
                       log_tail="" if status in ("ok", "oom") else outcome.log_tail[-2000:])
        result.probes.append(record)
        if on_probe is not None:
            on_probe(record, outcome)
        if status not in ("ok", "oom"):
            raise _Stop(record)
        return status == "ok"

    def control(batch_size: int, status: str, reason: str) -> tuple[str, str]:
        """A probe that failed under the CPU cap otherwise than with an OOM (a C++ runtime that cannot allocate a
        thread's stack or a buffer often aborts instead of raising) runs again without the cap: if it then runs ok,
        the cap caused the failure, and it counts as out of memory; else the original failure stands."""
        free = probe_spec(spec, framework, batch_size, None, device, file)
        trial = plan(free, device)[0]
        outcome = run_worker(trial.payload(free), timeout, None, device, trial.threads)
        if outcome.status == "ok":
            return "oom", (f"{reason} (under the cap; the same probe without the cap ran ok, so the cap caused it: "
                           f"counted as out of memory)")
        result.notes.append(f"batch size {batch_size} failed without the cap too ({outcome.status}): not a memory "
                            f"failure")
        return status, reason

    def refit() -> int | None:
        points = [(p.batch_size, p.peak_bytes) for p in result.probes if p.status == "ok" and p.peak_bytes is not None]
        result.model = fit_memory_model(points)
        result.final_predicted_limit = result.model.predict_limit(cap_bytes) if result.model is not None else None
        return result.final_predicted_limit

    def bounds() -> tuple[int | None, int | None]:
        ok = [p.batch_size for p in result.probes if p.status == "ok"]
        lo = max(ok) if ok else None
        oom = [p.batch_size for p in result.probes if p.status == "oom" and (lo is None or p.batch_size > lo)]
        return lo, (min(oom) if oom else None)

    def gap(lo: int) -> int:
        return max(1, math.floor(tolerance * lo))

    try:
        sizes = sorted({min(max(s, min_batch), max_batch) for s in (initial_sizes or DEFAULT_INITIAL_SIZES)})
        for size in sizes:
            if not probe(size, "initial"):
                break
        lo, hi = bounds()
        if lo is None:  # the smallest initial size already failed
            if not probe(min_batch, "smallest"):
                result.status = "nothing_fits"
                result.smallest_oom = min_batch
                result.reason = (f"even batch size {min_batch} runs out of memory under the cap "
                                 f"({cap_bytes / 1e6:,.0f} MB)")
                return result
            lo, hi = bounds()
        # 2-4: probe the prediction, then close the bracket around it.
        result.predicted_limit = refit()
        climb = 0  # consecutive steps up past the prediction
        while True:
            lo, hi = bounds()
            g = gap(lo)
            if hi is not None and hi - lo <= g:
                result.status, result.limit, result.smallest_oom = "found", lo, hi
                result.reason = f"{lo} fits and {hi} runs out of memory"
                break
            prediction = refit()
            if result.predicted_limit is None:
                result.predicted_limit = prediction
            if hi is None:
                if lo >= max_batch:
                    result.status, result.limit = "no_oom", lo
                    result.reason = f"batch size {max_batch} (max_batch) fits: the cap was not reached"
                    break
                # Up to the prediction (at most MAX_JUMP x); doubling without one; where the prediction is already
                # passed, one tolerance step up, the step doubling each time.
                if prediction is None:
                    size, purpose = 2 * lo, "doubling"
                elif prediction > lo:  # at least one tolerance step up, so that an OOM there closes the bracket
                    size, purpose, climb = max(prediction, lo + g), "prediction", 0
                else:
                    size, purpose, climb = lo + (g << climb), "step up", climb + 1
                size = min(size, lo * MAX_JUMP, max_batch)
            elif hi - lo > 2 * g:
                # Inside the bracket: the prediction where it falls inside, else the midpoint; kept one tolerance
                # step away from both ends, so that either outcome of a probe next to an end closes the bracket.
                inside = prediction is not None and lo < prediction < hi
                size = prediction if inside else (lo + hi) // 2
                size = min(max(size, lo + g), hi - g)
                purpose = "prediction" if size == prediction else "bisection"
            else:
                size, purpose = (lo + hi) // 2, "bisection"
            probe(size, purpose)
        refit()
        # 5: the margin
        result.recommended = result.limit
        if margin > 0 and result.limit is not None:
            target = max(min_batch, math.floor(result.limit * (1 - margin)))
            if target < result.limit:
                fits = probe(target, "margin")
                candidates = [p.batch_size for p in result.probes if p.status == "ok" and p.batch_size <= target]
                result.recommended = max(candidates) if candidates else None
                if not fits:
                    result.notes.append(f"batch size {target} ran out of memory although {result.limit} fits: memory "
                                        f"is not monotonic in the batch size here")
        refit()
    except _Stop as stop:
        lo, hi = bounds()
        refit()
        result.status = "stopped"
        result.limit = None
        result.recommended = None
        result.smallest_oom = hi
        result.reason = (f"batch size {stop.probe.batch_size} ended {stop.probe.status} (not an out-of-memory "
                         f"error): {stop.probe.reason}")
        if lo is not None:
            result.notes.append(f"the largest size that fitted before the search stopped: {lo}")
        else:
            result.notes.append(f"no probe fitted; if that failure is about memory after all (e.g. MXNet's "
                                f"\"Resource temporarily unavailable\" when it cannot start a thread), the cap "
                                f"({cap_bytes / 1e6:,.0f} MB) is below what the framework needs for its own runtime "
                                "(thread stacks, lazily imported modules): try a larger memory_limit_mb")
    return result


# ----------------------------------------------------------------------------------------------------------- output

def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f}"


def table(result: MaxBatchResult) -> str:
    """The probes as a short plain-text table, in the order they ran, then the result lines."""
    rows = [("#", "batch", "status", "peak MB", "model MB", "seconds", "purpose / reason")]
    for p in result.probes:
        model = _mb(result.model.predict_peak(p.batch_size)) if result.model is not None else "-"
        note = p.purpose if p.status == "ok" else f"{p.purpose}: {p.reason}"[:70]
        rows.append((str(p.index + 1), str(p.batch_size), p.status, _mb(p.peak_bytes), model, f"{p.seconds:.1f}",
                     note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i in (0, 1, 3, 4, 5) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             .rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.extend(summary_lines(result))
    return "\n".join(lines)


def summary_lines(result: MaxBatchResult) -> list[str]:
    out = [f"{result.framework} on {result.device}: {result.status}: {result.reason}",
           f"cap: {_mb(result.cap_bytes)} MB ({result.cap_source})"]
    if result.model is not None:
        m = result.model
        out.append(f"memory model: {_mb(m.fixed_bytes)} MB + {m.per_sample_bytes / 1e3:,.1f} kB x batch "
                   f"(r^2 {m.r2:.3f}, {m.points} probes); predicted limit: {result.predicted_limit} from the "
                   f"first probes, {result.final_predicted_limit} from all")
    else:
        out.append("memory model: not enough successful probes with a peak to fit")
    out.append(f"largest batch that fits: {result.limit if result.limit is not None else '-'}"
               + (f" (smallest that failed: {result.smallest_oom})" if result.smallest_oom is not None else ""))
    out.append(f"recommended (margin {result.margin:g}): "
               f"{result.recommended if result.recommended is not None else '-'}")
    out.extend(f"note: {n}" for n in result.notes)
    return out


def markdown(result: MaxBatchResult, spec: Spec) -> str:
    """max_batch.md: the result, the probes and how they were made."""
    lines = [f"# Largest batch: {spec.name}, {result.framework} on {result.device}", ""]
    lines += [f"- {line}" for line in summary_lines(result)]
    lines += ["", "## Probes", "", "| # | batch | status | peak MB | model MB | seconds | purpose | reason |",
              "| ---: | ---: | --- | ---: | ---: | ---: | --- | --- |"]
    for p in result.probes:
        model = _mb(result.model.predict_peak(p.batch_size)) if result.model is not None else "-"
        reason = p.reason.replace("|", "\\|")[:160]
        lines.append(f"| {p.index + 1} | {p.batch_size} | {p.status} | {_mb(p.peak_bytes)} | {model} | "
                     f"{p.seconds:.1f} | {p.purpose} | {reason} |")
    sources = sorted({p.peak_source for p in result.probes if p.peak_source})
    lines += ["", "## Method", "",
              f"Each probe is one worker process: {PROBE_EPOCHS} optimizer steps (one per epoch, no warm-up) and an "
              "evaluation at the batch size, on synthetic images of the spec's shape and classes "
              f"({spec.accumulation_steps} x B training and B test images, "
              f"{result.probe_data_bytes_per_sample:,} bytes per batch sample, inside the cap). "
              "OOM is the worker's status `oom` (the framework's own out-of-memory error); any other failure stops "
              "the search. The memory model is a least-squares line through the peaks of the successful probes; "
              f"peak sources: {', '.join(sources) or 'none'}. "
              "On the CPU the cap and the peaks count from the worker's memory once the framework is imported "
              "(see harness/limits.py).", ""]
    return "\n".join(lines)


class RunWriter:
    """The run directory of one search (see the module docstring), written as the search goes: run.json at once,
    each probe appended (flushed and fsynced) to probes.jsonl as it finishes, the result and max_batch.md at the end."""

    def __init__(self, out_root: str | Path, spec: Spec, framework: str, device: str,
                 spec_path: str | Path | None = None, settings: dict[str, Any] | None = None):
        from harness import __version__, environment
        from harness.results import create_run_dir, write_json

        self.spec = spec
        self.run_dir = create_run_dir(out_root, f"{spec.name}-max-batch-{framework}")
        self.info: dict[str, Any] = {
            "kind": "max-batch", "harness_version": __version__, "spec_file": str(spec_path) if spec_path else None,
            "spec": spec.model_dump(mode="json"), "framework": framework, "device": device,
            "settings": settings or {}, "environment": environment.collect(), "started": _now(), "finished": None,
            "result": None}
        write_json(self.run_dir / "run.json", self.info)

    def probe(self, probe: Probe, outcome: Any | None = None) -> None:
        from harness.results import append_line, write_lines

        append_line(self.run_dir / "probes.jsonl", asdict(probe))
        if outcome is not None:
            write_lines(self.run_dir / "events" / f"probe{probe.index + 1}-bs{probe.batch_size}.jsonl",
                        outcome.events)

    def finish(self, result: MaxBatchResult) -> Path:
        from harness.results import write_json

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


# -------------------------------------------------------------------------------------------------------------- CLI

def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, not {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("batch sizes must be positive")
    return sizes


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), not {text}")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``max-batch SPEC --framework NAME [--memory-limit-mb X] [--margin F] [--out DIR] ...``."""
    parser = subparsers.add_parser(
        "max-batch", help="find the largest batch size that fits the memory cap (one worker per probe)",
        description="Probes batch sizes, each in its own worker, fits peak memory = fixed + per-sample x batch, "
                    "predicts the limit from the cap and bisects to it. Exit 0 with the result, 1 when a probe "
                    "failed otherwise than out of memory, 2 for a bad spec or arguments.")
    parser.add_argument("spec", help="a YAML spec, e.g. specs/max_batch.yaml")
    parser.add_argument("--framework", required=True, help="pytorch, tensorflow, mxnet (or a registered adapter)")
    parser.add_argument("--memory-limit-mb", type=float, help="the cap (MB = 10^6 bytes); default: the spec's "
                                                              "memory_limit_mb, else the device's memory")
    parser.add_argument("--margin", type=_fraction, default=0.0,
                        help="fraction of the limit kept free in the recommendation (default 0)")
    parser.add_argument("--tolerance", type=_fraction, default=DEFAULT_TOLERANCE,
                        help=f"stop when the bracket is within this fraction (default {DEFAULT_TOLERANCE})")
    parser.add_argument("--initial-sizes", type=_sizes, help="small sizes probed first (default 16,64,256)")
    parser.add_argument("--max-batch", type=int, help="the largest size to try")
    parser.add_argument("--device", help="cpu or cuda:N (default: the spec's device)")
    parser.add_argument("--timeout", type=float, help="seconds per probe (default: the spec's timeout_s)")
    parser.add_argument("--out", default="results", help="folder that receives the run directory (default: results)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """The ``max-batch`` command: 0 with the result printed, 1 when the search stopped on a non-OOM failure, 2 for a
    bad spec or arguments."""
    from adapters import available_names
    from harness import spec as spec_module

    try:
        spec = spec_module.load(args.spec)
        if args.memory_limit_mb is not None and args.memory_limit_mb <= 0:
            raise spec_module.SpecError(args.spec, "memory_limit_mb", "--memory-limit-mb must be positive")
        if args.framework not in available_names():
            raise spec_module.SpecError(args.spec, "frameworks", f"unknown framework {args.framework!r}; expected "
                                                                 f"one of {', '.join(available_names())}")
        if args.device is not None:
            spec_module.validate({**spec.model_dump(mode="json"), "device": args.device}, args.spec)
    except spec_module.SpecError as err:
        print(str(err), file=sys.stderr)
        return 2
    device = args.device or resolve_device(spec.device)
    settings = {"memory_limit_mb": args.memory_limit_mb, "margin": args.margin, "tolerance": args.tolerance,
                "initial_sizes": args.initial_sizes, "max_batch": args.max_batch, "timeout_s": args.timeout}
    writer = RunWriter(args.out, spec, args.framework, device, args.spec, settings)

    def on_probe(probe: Probe, outcome: Any) -> None:
        writer.probe(probe, outcome)
        peak = f", peak {_mb(probe.peak_bytes)} MB" if probe.peak_bytes is not None else ""
        detail = f": {probe.reason[:120]}" if probe.reason else ""
        print(f"probe {probe.index + 1}: batch {probe.batch_size} {probe.status}{detail}{peak} "
              f"({probe.seconds:.1f} s, {probe.purpose})", file=sys.stderr, flush=True)

    try:
        result = find_max_batch(spec, args.framework, device, memory_limit_mb=args.memory_limit_mb,
                                margin=args.margin, tolerance=args.tolerance, initial_sizes=args.initial_sizes,
                                max_batch=args.max_batch, timeout_s=args.timeout, spec_file=args.spec,
                                on_probe=on_probe)
    except ValueError as err:
        print(f"{args.spec}: {err}", file=sys.stderr)
        return 2
    run_dir = writer.finish(result)
    print(table(result))
    print(f"\nwritten to {run_dir}")
    return 1 if result.status == "stopped" else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m harness.maxbatch SPEC --framework NAME ...`` (the same as ``harness max-batch``)."""
    parser = argparse.ArgumentParser(prog="harness")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["max-batch", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
