"""One probe of the max-batch search (``harness.studies.max_batch.search`` says what a probe is and why): the spec
it runs, how its memory peak and reason are read from the worker's outcome, the cap it runs under, and the records
of probes and of the search's result. A run check (``harness.studies.max_batch.runcheck``) is recorded as a probe of
kind ``run``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.neutral import datasets
from harness.plan import checked_spec, entry_for
from harness.record.events import Error, MemoryLimit, MemoryPeak, first
from harness.spec import DataParallelSpec, Spec
from harness.studies.max_batch.memory_model import MemoryModel

if TYPE_CHECKING:
    from harness.execution.launcher import Outcome

CPU_HEADROOM_BYTES = 2 << 30  # without memory_limit_mb, the CPU cap is the available memory less this
# A probe's steps (docs/findings/2026-11-28-probe-steps.md): the peak settles at the second optimizer step (the first
# allocates the optimizer's state), so PROBE_EPOCHS epochs of PROBE_STEPS steps each (the settled step, then safety
# steps that train again after an evaluation, as a run does) where that was measured; FULL_PROBE_EPOCHS of every step
# elsewhere (MXNet's pooled allocator kept growing over whole epochs; frameworks not measured keep the probe they had).
PROBE_EPOCHS = 2
PROBE_STEPS = 2
SHORT_PROBES = frozenset({"pytorch", "tensorflow", "jax"})
FULL_PROBE_EPOCHS = 3  # each: every step over the probe's data (with_dataset: the first step only), an evaluation
STATUSES = ("found", "no_oom", "nothing_fits", "stopped")


@dataclass
class Probe:
    """One worker (one worker group: N ranks for PyTorch data parallelism) at one batch size. batch_size: the
    per-device batch (the batch of one optimizer step on one device); global_batch_size: the samples of one step
    over all devices, devices x batch_size (0: not set, read as batch_size). peak_bytes: the fitted memory figure
    (see ``peak``; on the CPU bytes above the worker's baseline), None when the worker did not report it; seconds: the
    worker's wall time. kind: ``probe`` (the search's, in its probe conditions), ``run`` (a run check: the spec's
    trial as ``harness run`` runs it, ``harness.studies.max_batch.runcheck``) or ``compile`` (ok, and uncounted: it
    compiled a probe's or run check's steps into the persistent compilation cache before the one counted,
    ``find_max_batch``'s ``compile_first``)."""

    index: int
    batch_size: int
    status: str
    reason: str
    peak_bytes: float | None
    peak_source: str
    seconds: float
    purpose: str = ""
    log_tail: str = ""
    global_batch_size: int = 0
    kind: str = "probe"


class Stop(Exception):
    """A probe or run check that ended neither ok nor oom (``probe``: its record): it stops the search (the result
    is ``stopped`` with its reason) or, in a run check, the recommendation."""

    def __init__(self, probe: Probe):
        super().__init__(f"batch size {probe.batch_size} ended {probe.status}: {probe.reason}")
        self.probe = probe


@dataclass
class MaxBatchResult:
    """What the search found (see the module docstring for fits, fails and fits sometimes).

    status: ``found`` (limit and smallest_oom bracket the limit within the tolerance), ``no_oom`` (max_batch fitted:
    the cap was not reached), ``nothing_fits`` (even min_batch did not fit), ``stopped`` (a probe ended neither ok
    nor oom; ``reason`` says how). limit: the largest size that fits, ok in both of its probes (None when nothing
    fits); smallest_oom: the smallest size above it that ran out of memory at least once; recommended: the largest
    size at or below limit x (1 - margin) that fits, ok in both of its probes. fits_sometimes: [smallest, largest]
    batch size seen both fitting and running out of memory (never the limit nor the recommendation), None when
    no size was. predicted_limit: the first prediction the search probed toward (``predicted_by`` says whose);
    final_predicted_limit: from every successful probe (model is that final fit). neutral: the neutral model's
    memory line (``harness.neutral.memory``: fixed bytes and saved activations plus probe data per batch sample;
    not fitted: r2 0, 0 points), neutral_limit its limit against the cap, measured by nothing. max_batch: the largest
    size the search may probe. with_dataset: the probes held the spec's real dataset (dataset_bytes bytes, train_size
    training images) instead of synthetic data (probe_data_bytes_per_sample bytes per batch sample above
    ``run_data``: the training and test samples of a run of the spec, which every probe holds at least, and their
    bytes). cap_bytes and the peaks are bytes; for the CPU they count from the worker's baseline (see
    harness.execution.limits).

    Data parallelism: data_parallel N devices; every batch size above (limit, smallest_oom, recommended, the band,
    max_batch) is the per-device batch, and ``global_batch`` gives N x it. The recommendation (``recommend``):
    margin the fraction given (None: the margin the spread justifies), peak_spread the spread of the peak across the
    answer's probes, margin_samples and margin_basis the samples kept below the limit and why, run_offset how much
    above a probe's peak a run's peak is at the same size (bytes, and samples at the fitted per-sample bytes),
    run_checks the run checks asked per candidate, run_check what one does (``runcheck.run_shape``), recommended_by
    ``runs`` (ok in that many run checks), ``probes`` (ok in two probes) or "" (none). probe_epochs and probe_steps:
    what each probe trains (``probe_shape``: epochs of at most that many steps; None every step). Docs:
    docs/design/max-batch.md.
    """

    framework: str
    device: str
    status: str
    reason: str
    cap_bytes: float
    cap_source: str
    margin: float | None
    tolerance: float
    probes: list[Probe] = field(default_factory=list)
    model: MemoryModel | None = None
    predicted_limit: int | None = None
    predicted_by: str = ""
    neutral: MemoryModel | None = None
    neutral_limit: int | None = None
    final_predicted_limit: int | None = None
    limit: int | None = None
    smallest_oom: int | None = None
    recommended: int | None = None
    fits_sometimes: list[int] | None = None
    max_batch: int | None = None
    with_dataset: bool = False
    dataset_bytes: int | None = None
    train_size: int | None = None
    probe_data_bytes_per_sample: int = 0
    run_data: dict[str, Any] | None = None
    data_parallel: int = 1
    peak_spread: dict[str, Any] | None = None
    margin_samples: int | None = None
    margin_basis: str = ""
    run_offset: dict[str, Any] | None = None
    run_checks: int = 0
    run_check: dict[str, Any] | None = None
    probe_epochs: int = 0
    probe_steps: int | None = None
    recommended_by: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON data (run.json's ``result``): every field, the probes without their log tails, and the
        global batches ``global_limit``, ``global_recommended``, ``global_smallest_oom`` (N x the per-device ones)."""
        out = asdict(self)
        out["probes"] = [{k: v for k, v in asdict(p).items() if k != "log_tail"} for p in self.probes]
        out.update({f"global_{name}": self.global_batch(getattr(self, name))
                    for name in ("limit", "recommended", "smallest_oom")})
        return out

    def global_batch(self, batch_size: int | None) -> int | None:
        """The global batch of a per-device ``batch_size``: data_parallel x it (None for None)."""
        return None if batch_size is None else batch_size * self.data_parallel

    def probed(self, batch_size: int, kind: str = "probe") -> Probe | None:
        """The first probe of ``batch_size`` of ``kind``, None if it was not probed."""
        return next((p for p in self.probes if p.batch_size == batch_size and p.kind == kind), None)

    def statuses(self, batch_size: int, kind: str = "probe") -> list[str]:
        """The statuses of every probe of ``kind`` of ``batch_size``, in the order they ran (empty if none)."""
        return [p.status for p in self.probes if p.batch_size == batch_size and p.kind == kind]

    def fits(self, batch_size: int) -> bool:
        """True when ``batch_size`` was probed and every probe of it was ok."""
        statuses = self.statuses(batch_size)
        return bool(statuses) and all(s == "ok" for s in statuses)

    def confirmed(self, batch_size: int) -> bool:
        """True when ``batch_size`` fits and was ok in (at least) two probes: what the answer must be."""
        return self.fits(batch_size) and len(self.statuses(batch_size)) >= 2

    def sometimes(self) -> list[int]:
        """The sizes seen both fitting and running out of memory in the search's probes, ascending."""
        return sorted({p.batch_size for p in self.probes if {"ok", "oom"} <= set(self.statuses(p.batch_size))})

    def peaks(self, batch_size: int, kind: str = "probe") -> list[float]:
        """The peaks (bytes) of the probes of ``kind`` of ``batch_size`` that were ok and reported one."""
        return [p.peak_bytes for p in self.probes
                if p.batch_size == batch_size and p.kind == kind and p.status == "ok" and p.peak_bytes is not None]


def probe_shape(spec: Spec, framework: str, with_dataset: bool = False) -> tuple[int, int | None]:
    """(epochs, steps per epoch at most; None: every step) of a probe of ``framework`` (a label or name): PROBE_EPOCHS
    of PROBE_STEPS for the frameworks in SHORT_PROBES, else FULL_PROBE_EPOCHS of every step (``with_dataset``: of one
    step each, the whole dataset resident)."""
    if entry_for(spec, framework).name in SHORT_PROBES:
        return PROBE_EPOCHS, PROBE_STEPS
    return FULL_PROBE_EPOCHS, 1 if with_dataset else None


def probe_spec(spec: Spec, framework: str, batch_size: int, memory_limit_mb: float | None, device: str,
               spec_file: str | Path = "<max-batch probe>", with_dataset: bool = False,
               data_parallel: DataParallelSpec | None = None, run_sizes: tuple[int, int] | None = None) -> Spec:
    """The spec one probe runs (see the module docstring): ``probe_shape``'s epochs (the caller cuts each to its
    steps, see ``_Search._run``), no warm-up, and synthetic data of the spec's image
    shape and classes (for token sequences, the spec's own synthetic tokens): as many training and test samples as a
    run of the spec holds (``run_sizes``: its training and test samples), and at least accumulation_steps x G
    training samples, G the global batch (``batch_size`` per device x the devices of ``data_parallel``, None: one
    device); without ``run_sizes``, accumulation_steps x G training and G test samples; or with ``with_dataset``
    the spec's own dataset; ``framework`` (a
    label or name, see ``harness.plan.entry_for``) in its entry's interpreter. Raises SpecError."""
    shape, classes = datasets.describe(spec.dataset)
    entry = entry_for(spec, framework)
    data = spec.model_dump(mode="json")
    batch_size *= 1 if data_parallel is None else data_parallel.size  # the global batch from here on
    train, test = run_sizes or (0, batch_size)
    # a run evaluates its whole test set, in batches of at most the batch size: so does the probe
    sizes = {"size": max(train, batch_size * spec.accumulation_steps), "test_size": test}
    if not with_dataset and data["dataset"]["name"] == "synthetic_tokens":  # token sequences: the same task, resized
        data["dataset"] = {**data["dataset"], **sizes}
    elif not with_dataset:
        data["dataset"] = {"name": "synthetic", "shape": list(shape), "classes": classes, **sizes}
    data.update({
        "frameworks": [entry.model_dump(mode="json", exclude_none=True)], "batch_sizes": [batch_size],
        "epochs": probe_shape(spec, framework, with_dataset)[0], "warmup_steps": 0,
        "repeats": 1, "variants": None,
        "target_accuracy": None, "memory_limit_mb": memory_limit_mb, "device": device,
        "data_parallel": None if data_parallel is None else data_parallel.model_dump(mode="json"),
    })
    return checked_spec(data, spec_file)


def peak(outcome: Outcome, device: str) -> tuple[float | None, str]:
    """The fitted memory figure of a probe (bytes; see the module docstring) and where it came from. On the CPU: the
    worker's peak above its capped baseline (``MemoryPeak``), else the sampler's RSS. On a GPU, what the framework's
    cap binds: the allocator's reserved peak where it reports one (PyTorch: ``max_memory_reserved``), else its peak
    of live tensors (JAX's and TensorFlow's BFC ``peak_bytes_in_use``), else NVML's per-process memory, else the
    device's memory in use; (None, "none") without any."""
    if device == "cpu":
        event = first(outcome.events, MemoryPeak)
        if event is not None and event.peak_bytes is not None:
            return float(event.peak_bytes), event.source or "memory_peak"
        limit = first(outcome.events, MemoryLimit)
        if limit is not None and limit.cpu_allocator_limit_mib is not None:
            # the cap counts a tensor allocator's bytes (TensorFlow's): process memory is another quantity, and a
            # line through it would be drawn against the wrong cap
            return None, (event.source if event is not None and event.source else
                          "none (the capped allocator reported no peak)")
        stats = outcome.sampler.get("stats", {}).get("rss_bytes", {})
        if not stats.get("max"):
            return None, "none"
        # no peak reported at the worker's exit: the sampler's RSS, from the baseline the cap was applied at
        base = limit.baseline.get("rss_bytes") if limit is not None else None
        if base is not None:
            return float(stats["max"]) - base, "sampler rss_bytes max less the capped baseline (no memory_peak)"
        return float(stats["max"]), "sampler rss_bytes max (absolute)"
    result = outcome.result()
    memory = None if result is None else result.metrics.memory
    # What the cap binds: PyTorch's caching allocator refuses to hold more than its fraction of the device
    # (torch.cuda.set_per_process_memory_fraction counts reserved memory), so its reserved peak, not its peak of
    # live tensors, is what reaches the cap (a line through the tensors' peaks put the limit a third too high on an
    # H200: docs/findings/2026-11-27-gpu-run.md)
    reserved = None if memory is None else memory.allocator_reserved_peak_bytes
    if reserved:
        return float(reserved), "allocator_reserved_peak_bytes"
    allocator = None if memory is None else memory.allocator_peak_bytes
    if allocator:
        return float(allocator), "allocator_peak_bytes"
    stats = outcome.sampler.get("stats", {})
    for metric in ("process_memory_bytes", "device_memory_used_bytes"):
        if stats.get(metric, {}).get("max"):
            return float(stats[metric]["max"]), f"sampler {metric} max"
    return None, "none"


def reason(outcome: Outcome) -> str:
    """The worker's reason (the first line of the exception's message), completed from the error's traceback where
    that line says little: MXNet's messages start with a traceback of their own (the last line is the error, e.g.
    "MXNetError: Failed to allocate CPU Memory"), TensorFlow's with "Graph execution error" (the line "OOM when
    allocating tensor with shape[...]" follows)."""
    error = first(outcome.events, Error)
    lines = [line.strip() for line in (error.traceback if error is not None else "").splitlines() if line.strip()]
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
