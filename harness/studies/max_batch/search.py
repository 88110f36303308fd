"""The largest batch that fits (seed 004): measured, one worker process per probe, never guessed.

Each probe trains the spec's model at one batch size in a fresh worker (``harness.execution.launcher.run_worker``) under the
memory cap: three full optimizer steps and an evaluation at that batch size. The worker's status decides: ``ok``
fits, ``oom`` (the framework's own out-of-memory error, see ``harness.execution.limits`` on the CPU, or Python's own
``MemoryError``, which the worker reports as oom: an allocation outside the framework's allocator failing under the
cap, numpy or a module PyTorch imports lazily when the cap is below its runtime's needs) does not; so does a worker
that ran out of memory even for its error report (it exits "without reporting why" with MemoryError last in its
log). On the CPU, a probe that ends
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
  probe's worker by ``harness.execution.limits`` as memory beyond what the worker holds once the framework is imported. The
  peak fitted is the worker's ``memory_peak`` event, measured from the same baseline: TensorFlow's CPU BFC
  allocator peak (the capped quantity, exact); for PyTorch and MXNet an estimate of the capped VmData peak, which
  the kernel does not keep (see ``harness.execution.limits.peak_estimate``), so the prediction is approximate and the probes
  around it decide.
- GPU: the cap is ``memory_limit_mb`` (applied by the adapters through each framework's own limit) or the device's
  total memory (NVML); the peak is the framework allocator's peak (``metrics.memory.allocator_peak_bytes``), else
  NVML's per-process memory (``sampler.stats.process_memory_bytes.max``), else the device memory in use. CUDA's own
  context is outside the allocator peak, so a prediction from the device total errs high; again the probes decide.
  (Written from the documentation; no GPU was available to run it.)

Outputs: see ``harness.studies.max_batch.output``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from harness.execution.launcher import run_worker
from harness.measure.machine import resolve_device
from harness.neutral import datasets
from harness.plan import checked_spec, entry_for, plan
from harness.spec import Spec
from harness.studies.max_batch.memory_model import MemoryModel, fit_memory_model

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
class MaxBatchResult:
    """What the search found.

    status: ``found`` (limit and smallest_oom bracket the limit within the tolerance), ``no_oom`` (max_batch fitted:
    the cap was not reached), ``nothing_fits`` (even min_batch ran out of memory), ``stopped`` (a probe ended
    neither ok nor oom; ``reason`` says how). limit: the largest size probed successfully (None when nothing fits);
    recommended: the largest size probed successfully at or below limit x (1 - margin). predicted_limit: the
    model's prediction from the probes before it was first probed; final_predicted_limit: from every successful
    probe (model is that final fit). cap_bytes and the peaks are
    bytes; for the CPU they count from the worker's baseline (see harness.execution.limits).
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
    accumulation_steps x ``batch_size`` training and ``batch_size`` test samples, 3 epochs of one step, no warm-up;
    ``framework`` (a label or name, see ``harness.plan.entry_for``) in its entry's interpreter."""
    shape, classes = datasets.describe(spec.dataset)
    entry = entry_for(spec, framework)
    data = spec.model_dump(mode="json")
    data.update({
        "dataset": {"name": "synthetic", "shape": list(shape), "classes": classes,
                    "size": batch_size * spec.accumulation_steps, "test_size": batch_size},
        "frameworks": [entry.model_dump(mode="json", exclude_none=True)], "batch_sizes": [batch_size],
        "epochs": PROBE_EPOCHS, "warmup_steps": 0,
        "repeats": 1, "variants": None,
        "target_accuracy": None, "memory_limit_mb": memory_limit_mb, "device": device,
    })
    return checked_spec(data, spec_file)


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
    from harness.measure import machine
    from harness.measure.nvml import nvml_visible_index

    gpus = machine.gpus()
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
    on_probe(probe, outcome): called after every probe (outcome: harness.execution.launcher.Outcome).
    Raises ValueError for a margin, tolerance or range out of bounds, or a device whose memory cannot be told.
    """
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), not {margin}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, not {tolerance}")
    max_batch = max_batch or DEFAULT_MAX_BATCH
    if not 1 <= min_batch <= max_batch:
        raise ValueError(f"need 1 <= min_batch <= max_batch, not {min_batch} and {max_batch}")
    device = device or resolve_device(spec.device)
    search = _Search(spec, framework, device, memory_limit_mb if memory_limit_mb is not None else spec.memory_limit_mb,
                     margin, tolerance, min_batch, max_batch, timeout_s if timeout_s is not None else spec.timeout_s,
                     spec_file or "<max-batch probe>", on_probe)
    try:
        if search.initial(sorted({min(max(s, min_batch), max_batch) for s in (initial_sizes or DEFAULT_INITIAL_SIZES)})):
            search.bracket()
            search.apply_margin()
        search.refit()
    except _Stop as stop:
        search.stopped(stop.probe)
    return search.result


class _Search:
    """The state of one search: the probes so far (in ``result``) and the steps of the module docstring."""

    def __init__(self, spec: Spec, framework: str, device: str, limit_mb: float | None, margin: float,
                 tolerance: float, min_batch: int, max_batch: int, timeout_s: float, spec_file: str | Path,
                 on_probe: Callable[[Probe, Any], None] | None):
        self.spec, self.framework, self.device = spec, framework, device
        self.min_batch, self.max_batch, self.tolerance = min_batch, max_batch, tolerance
        self.timeout_s, self.spec_file, self.on_probe = timeout_s, spec_file, on_probe
        self.cap_bytes, cap_source = resolve_cap(device, limit_mb)
        # The worker caps exactly this (on the CPU always: without a cap, an OOM would be the kernel's OOM killer).
        self.applied_mb = limit_mb if limit_mb is not None else (self.cap_bytes / 1e6 if device == "cpu" else None)
        shape, _ = datasets.describe(spec.dataset)
        self.result = MaxBatchResult(
            framework=framework, device=device, status="stopped", reason="", cap_bytes=self.cap_bytes,
            cap_source=cap_source, margin=margin, tolerance=tolerance,
            probe_data_bytes_per_sample=(spec.accumulation_steps + 1) * (int(np.prod(shape)) * 4 + 8))

    # ------------------------------------------------------------------------------------------------- one probe

    def probe(self, batch_size: int, purpose: str) -> bool:
        """True when ``batch_size`` fits. Raises _Stop for a probe that neither fits nor runs out of memory."""
        if (done := self.result.probed(batch_size)) is not None:
            return done.status == "ok"
        outcome = self._run(batch_size, self.applied_mb, self.spec.sampler.interval_s)
        status, reason = outcome.status, _reason(outcome)
        if status == "error" and MEMORY_ERROR_LINE in reason:  # a raised MemoryError the worker reports as oom
            status, reason = "oom", f"{reason} (Python's MemoryError: an allocation outside the framework failed)"
        if status in ("error", "crashed") and self.device == "cpu" and self.applied_mb is not None:
            status, reason = self._control(batch_size, status, reason)
        peak, source = _peak(outcome, self.device) if status in ("ok", "oom") else (None, "")
        if status == "oom" and peak is not None:  # reached before the failure: a lower bound, not fitted
            source += " (at the failure: a lower bound)"
        record = Probe(index=len(self.result.probes), batch_size=batch_size, status=status, reason=reason,
                       peak_bytes=peak, peak_source=source, seconds=outcome.wall_seconds, purpose=purpose,
                       log_tail="" if status in ("ok", "oom") else outcome.log_tail[-2000:])
        self.result.probes.append(record)
        if self.on_probe is not None:
            self.on_probe(record, outcome)
        if status not in ("ok", "oom"):
            raise _Stop(record)
        return status == "ok"

    def _run(self, batch_size: int, limit_mb: float | None, interval_s: float | None) -> Any:
        pspec = probe_spec(self.spec, self.framework, batch_size, limit_mb, self.device, self.spec_file)
        trial = plan(pspec, self.device)[0]
        return run_worker(trial.payload(pspec), self.timeout_s, interval_s, self.device, trial.threads)

    def _control(self, batch_size: int, status: str, reason: str) -> tuple[str, str]:
        """A probe that failed under the CPU cap otherwise than with an OOM (a C++ runtime that cannot allocate a
        thread's stack or a buffer often aborts instead of raising) runs again without the cap: if it then runs ok,
        the cap caused the failure, and it counts as out of memory; else the original failure stands."""
        outcome = self._run(batch_size, None, None)
        if outcome.status == "ok":
            return "oom", (f"{reason} (under the cap; the same probe without the cap ran ok, so the cap caused it: "
                           f"counted as out of memory)")
        self.result.notes.append(f"batch size {batch_size} failed without the cap too ({outcome.status}): not a "
                                 f"memory failure")
        return status, reason

    # ------------------------------------------------------------------------------------------------ bookkeeping

    def refit(self) -> int | None:
        """Refits the memory model to every successful probe with a peak; returns its predicted limit."""
        points = [(p.batch_size, p.peak_bytes) for p in self.result.probes
                  if p.status == "ok" and p.peak_bytes is not None]
        self.result.model = fit_memory_model(points)
        model = self.result.model
        self.result.final_predicted_limit = model.predict_limit(self.cap_bytes) if model is not None else None
        return self.result.final_predicted_limit

    def bounds(self) -> tuple[int | None, int | None]:
        """(largest size that fitted, smallest size above it that ran out of memory), each None if there is none."""
        ok = [p.batch_size for p in self.result.probes if p.status == "ok"]
        lo = max(ok) if ok else None
        oom = [p.batch_size for p in self.result.probes if p.status == "oom" and (lo is None or p.batch_size > lo)]
        return lo, (min(oom) if oom else None)

    def gap(self, lo: int) -> int:
        return max(1, math.floor(self.tolerance * lo))

    # ------------------------------------------------------------------------------------------------- the steps

    def initial(self, sizes: list[int]) -> bool:
        """Step 1. False when nothing fits (the result says so)."""
        for size in sizes:
            if not self.probe(size, "initial"):
                break
        lo, _ = self.bounds()
        if lo is None and not self.probe(self.min_batch, "smallest"):  # the smallest initial size already failed
            self.result.status, self.result.smallest_oom = "nothing_fits", self.min_batch
            self.result.reason = (f"even batch size {self.min_batch} runs out of memory under the cap "
                                  f"({self.cap_bytes / 1e6:,.0f} MB)")
            return False
        return True

    def bracket(self) -> None:
        """Steps 2-4: probe the prediction, then close the bracket around it."""
        result = self.result
        result.predicted_limit = self.refit()
        climb = 0  # consecutive steps up past the prediction
        while True:
            lo, hi = self.bounds()
            assert lo is not None  # initial() made sure something fits
            if hi is not None and hi - lo <= self.gap(lo):
                result.status, result.limit, result.smallest_oom = "found", lo, hi
                result.reason = f"{lo} fits and {hi} runs out of memory"
                return
            prediction = self.refit()
            if result.predicted_limit is None:
                result.predicted_limit = prediction
            if hi is None and lo >= self.max_batch:
                result.status, result.limit = "no_oom", lo
                result.reason = f"batch size {self.max_batch} (max_batch) fits: the cap was not reached"
                return
            if hi is None:
                size, purpose, climb = self._upward(lo, prediction, climb)
            else:
                size, purpose = self._inside(lo, hi, prediction)
            self.probe(size, purpose)

    def _upward(self, lo: int, prediction: int | None, climb: int) -> tuple[int, str, int]:
        """The next probe above everything that fitted, with no failure yet: up to the prediction (at most MAX_JUMP
        x); doubling without one; where the prediction is already passed, one tolerance step up, the step doubling
        each time. Returns (size, purpose, the new count of steps past the prediction)."""
        g = self.gap(lo)
        if prediction is None:
            size, purpose = 2 * lo, "doubling"
        elif prediction > lo:  # at least one tolerance step up, so that an OOM there closes the bracket
            size, purpose, climb = max(prediction, lo + g), "prediction", 0
        else:
            size, purpose, climb = lo + (g << climb), "step up", climb + 1
        return min(size, lo * MAX_JUMP, self.max_batch), purpose, climb

    def _inside(self, lo: int, hi: int, prediction: int | None) -> tuple[int, str]:
        """The next probe inside the bracket: the prediction where it falls inside, else the midpoint; kept one
        tolerance step away from both ends, so that either outcome of a probe next to an end closes the bracket."""
        g = self.gap(lo)
        if hi - lo <= 2 * g:
            return (lo + hi) // 2, "bisection"
        inside = prediction is not None and lo < prediction < hi
        size = prediction if inside else (lo + hi) // 2
        size = min(max(size, lo + g), hi - g)
        return size, "prediction" if size == prediction else "bisection"

    def apply_margin(self) -> None:
        """Step 5: the recommendation, floor(limit x (1 - margin)) verified by a probe."""
        result = self.result
        result.recommended = result.limit
        if result.margin <= 0 or result.limit is None:
            return
        target = max(self.min_batch, math.floor(result.limit * (1 - result.margin)))
        if target >= result.limit:
            return
        fits = self.probe(target, "margin")
        candidates = [p.batch_size for p in result.probes if p.status == "ok" and p.batch_size <= target]
        result.recommended = max(candidates) if candidates else None
        if not fits:
            result.notes.append(f"batch size {target} ran out of memory although {result.limit} fits: memory is not "
                                f"monotonic in the batch size here")

    def stopped(self, probe: Probe) -> None:
        """The result of a search stopped by a probe that ended neither ok nor oom."""
        lo, hi = self.bounds()
        self.refit()
        result = self.result
        result.status, result.limit, result.recommended, result.smallest_oom = "stopped", None, None, hi
        result.reason = (f"batch size {probe.batch_size} ended {probe.status} (not an out-of-memory error): "
                         f"{probe.reason}")
        if lo is not None:
            result.notes.append(f"the largest size that fitted before the search stopped: {lo}")
        else:
            result.notes.append(f"no probe fitted; if that failure is about memory after all (e.g. MXNet's "
                                f"\"Resource temporarily unavailable\" when it cannot start a thread), the cap "
                                f"({self.cap_bytes / 1e6:,.0f} MB) is below what the framework needs for its own "
                                "runtime (thread stacks, lazily imported modules): try a larger memory_limit_mb")
