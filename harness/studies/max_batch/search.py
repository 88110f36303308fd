"""The largest batch that fits (seed 004): measured, one worker process per probe, never guessed.

Each probe trains the spec's model at one batch size in a fresh worker under the memory cap (two epochs of two optimizer
steps, each with an evaluation, where the framework's peak settles within them; three whole epochs elsewhere:
``probe.probe_shape``; synthetic images of the dataset's shape, as many as a run of the spec holds and at least the
batch's, by default; the real dataset with ``with_dataset``); ``ok`` fits, ``oom`` does not, any other ending stops the
search with its reason. The search probes two small sizes, draws ``peak_bytes = fixed + per_sample x B`` through the two
largest sizes that fit (``harness.studies.max_batch.bracket``), brackets and narrows the limit, and confirms the answer
in a second fresh worker; a size seen both fitting and failing is the ``fits_sometimes`` band, never the answer. The
limit is that measured boundary. The recommendation keeps a margin below it (by default twice the spread of the peak
across the answer's probes) less what a run holds beyond a probe, and must hold in run checks: the spec's trial as
``harness run`` runs it, in fresh workers, searched downward until a size holds in every run check
(``harness.studies.max_batch.runcheck``; the recommendation is ``harness.studies.max_batch.recommend``). The result
never names a size that was not ok in two fresh workers. Before the first probe, the trial the probes run is checked
against the plan's rule of what the adapter can train (``harness.studies.max_batch.checks``).

Under data parallelism (``data_parallel`` N devices) every probe is one data-parallel trial (for PyTorch, rank 0
and the ranks it starts), the sizes searched are per-device batches and each probe trains the global batch, N x it.

Design: docs/design/max-batch.md (the steps, what the cap and the peak are on a CPU and a GPU). Outputs:
``harness.studies.max_batch.output``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.execution.launcher import owner, run_worker
from harness.execution.protocol import Payload
from harness.measure.machine import resolve_device
from harness.neutral import datasets, memory
from harness.plan import entry_for, model_info, plan
from harness.spec import DataParallelSpec, Spec, SpecError
from harness.studies.max_batch import runcheck, warm
from harness.studies.max_batch.bracket import BELOW_FAILURE, MAX_JUMP, curved_limit, inside, local_line, upward
from harness.studies.max_batch.checks import check_bounds, check_search
from harness.studies.max_batch.memory_model import MemoryModel, fit_memory_model
from harness.studies.max_batch.probe import MaxBatchResult, Probe, Stop, probe_shape, probe_spec, resolve_cap
from harness.studies.max_batch.probe import peak as probe_peak
from harness.studies.max_batch.probe import reason as probe_reason
from harness.studies.max_batch.recommend import Recommendation

DEFAULT_INITIAL_SIZES = (16, 64)  # two small sizes: the fixed and per-sample bytes before any large guess
DEFAULT_TOLERANCE = 0.05
DEFAULT_MAX_BATCH = 1 << 20
__all__ = ["DEFAULT_INITIAL_SIZES", "DEFAULT_MAX_BATCH", "DEFAULT_TOLERANCE", "MAX_JUMP", "find_max_batch"]
# A worker that ran out of memory even for its error report exits "without reporting why", with this last log line.
MEMORY_ERROR_LINE = "without reporting why: MemoryError"


def find_max_batch(spec: Spec, framework: str, device: str | None = None, *, memory_limit_mb: float | None = None,
                   margin: float | None = None, tolerance: float = DEFAULT_TOLERANCE,
                   initial_sizes: Sequence[int] | None = None, min_batch: int = 1, max_batch: int | None = None,
                   timeout_s: float | None = None, spec_file: str | Path | None = None, with_dataset: bool = False,
                   data_parallel: int | None = None, run_checks: int = runcheck.RUN_CHECKS,
                   on_probe: Callable[[Probe, Any], None] | None = None,
                   compile_first: bool | None = None,
                   margin_floor: float = runcheck.MARGIN_FLOOR) -> MaxBatchResult:
    """Searches the largest batch size of ``framework`` that fits ``spec``'s memory cap (see the module docstring).

    device: "cpu" or "cuda:N"; None resolves the spec's device ("auto": a GPU when NVML sees one).
    memory_limit_mb: overrides the spec's. margin: fraction of the limit kept free for the recommendation
    (0 <= margin < 1); None keeps the margin the spread of the answer's peaks justifies (``runcheck.margin_samples``),
    at least ``margin_floor`` x the cap in bytes, and where the cap was not reached no more than the cap requires.
    tolerance: the search stops when the smallest failing size is within tolerance x the largest fitting one.
    initial_sizes: the small sizes probed first. min_batch / max_batch: the range searched (per-device batches).
    timeout_s: per probe (default: the spec's timeout_s). spec_file: named in errors about the probe spec.
    with_dataset: probe with the spec's real dataset resident (max_batch is then at most its training images //
    accumulation_steps // devices). data_parallel: N devices (None: the spec's own ``data_parallel``, else one):
    every size is a per-device batch, each probe a data-parallel trial of N x it. run_checks: run checks of each
    candidate for the recommendation (0: confirmed in two probes instead). on_probe(probe, outcome): called after
    every probe and run check (outcome: harness.execution.launcher.Outcome). compile_first: an uncounted worker
    compiles each size into the compilation cache first (``harness.studies.max_batch.warm``); None: where the
    framework's declaration says its peak includes compilation on this device (``compile_peak``: JAX on a GPU).
    Raises ValueError for a margin, tolerance, range or device count out of bounds (with_dataset: a training set
    smaller than min_batch x accumulation_steps x devices), data parallelism that this machine has no devices for, a
    trial the framework's adapter cannot train (its precision, compile mode, input, data parallelism or model on this
    device: ``checks.check_supported``, the reason a run would record), a dataset that cannot be loaded, or a device
    whose memory cannot be told. All of these before the first probe.
    """
    max_batch = check_bounds(margin, tolerance, run_checks, min_batch, max_batch or DEFAULT_MAX_BATCH)
    if not 0 <= margin_floor < 1:
        raise ValueError(f"margin_floor must be in [0, 1), not {margin_floor}")
    device = device or resolve_device(spec.device)
    try:
        dp = check_search(spec, framework, device, data_parallel, spec_file or "spec", memory_limit_mb)
    except SpecError as err:
        raise ValueError(err.message) from None
    if compile_first is None:
        compile_first = warm.compiles_into_peak(spec, framework, device)
    with owner(), warm.cached(spec, compile_first) as (spec, note):  # owner: the parents its workers fork from
        search = _Search(spec, framework, device,
                         memory_limit_mb if memory_limit_mb is not None else spec.memory_limit_mb, margin, tolerance,
                         min_batch, max_batch, timeout_s if timeout_s is not None else spec.timeout_s,
                         spec_file or "<max-batch probe>", with_dataset, on_probe, dp, run_checks, compile_first)
        search.margin_floor = margin_floor
        search.result.notes += [note] if note else []
        try:
            initial = DEFAULT_INITIAL_SIZES if initial_sizes is None else initial_sizes
            search.initial(sorted({min(max(s, min_batch), search.max_batch) for s in initial}))
            if search.bracket():
                search.recommend()
        except Stop as stop:
            search.stopped(stop.probe)
        search.refit()
    sometimes = search.result.sometimes()
    search.result.fits_sometimes = [sometimes[0], sometimes[-1]] if sometimes else None
    return search.result


class _Search:
    """The state of one search: the probes so far (in ``result``) and the steps of the module docstring."""

    def __init__(self, spec: Spec, framework: str, device: str, limit_mb: float | None, margin: float | None,
                 tolerance: float, min_batch: int, max_batch: int, timeout_s: float, spec_file: str | Path,
                 with_dataset: bool, on_probe: Callable[[Probe, Any], None] | None,
                 dp: DataParallelSpec | None = None, run_checks: int = 0, compile_first: bool = False):
        self.spec, self.framework, self.device = spec, framework, device
        self.compile_first = compile_first
        self.min_batch, self.max_batch, self.tolerance = min_batch, max_batch, tolerance
        self.timeout_s, self.spec_file, self.with_dataset, self.on_probe = timeout_s, spec_file, with_dataset, on_probe
        self.dp, self.devices, self.run_checks = dp, 1 if dp is None else dp.size, run_checks
        self.margin_floor = runcheck.MARGIN_FLOOR  # the default margin's floor, a fraction of the cap
        self.cap_bytes, cap_source = resolve_cap(device, limit_mb)
        # The worker caps exactly this (on the CPU always: without a cap, an OOM would be the kernel's OOM killer).
        self.applied_mb = limit_mb if limit_mb is not None else (self.cap_bytes / 1e6 if device == "cpu" else None)
        # every process of a probe holds the global batch's data: N x (accumulation + 1) images per per-device sample
        per_sample = (spec.accumulation_steps + 1) * datasets.sample_bytes(spec.dataset) * self.devices
        self.result = MaxBatchResult(
            framework=framework, device=device, status="stopped", reason="", cap_bytes=self.cap_bytes,
            cap_source=cap_source, margin=margin, tolerance=tolerance, with_dataset=with_dataset,
            probe_data_bytes_per_sample=0 if with_dataset else per_sample, data_parallel=self.devices,
            run_checks=run_checks)
        self.result.probe_epochs, self.result.probe_steps = probe_shape(spec, framework, with_dataset)
        self.bound = f"batch size {max_batch} (max_batch)"  # what the upper bound is, for the no_oom reason
        self.run_sizes: tuple[int, int] | None = None
        if with_dataset:
            self._dataset_bound()
        else:
            self._run_data()
        self.result.max_batch = self.max_batch
        self._neutral()

    def _neutral(self) -> None:
        """The neutral model's memory line (``harness.neutral.memory.predict``), per batch sample B: fixed = the
        parameters, gradients, optimizer state, buffers and accumulator (and the resident dataset with
        ``with_dataset``); per sample = the activations saved for the backward pass plus the probe's data per batch
        sample. Under data parallelism B is the per-device batch and the line is one process's: a framework that
        drives every device from one process (its declaration's ``data_parallel`` "devices") holds N replicas and N
        devices' activations, one with a process per device (PyTorch) one. Its limit against the cap is
        ``neutral_limit``. None for an entry with a model of its own: the search starts from probes alone."""
        from adapters import attention, declaration  # the registry imports no framework

        spec, result = self.spec, self.result
        if entry_for(spec, result.framework).model is not None:
            return
        predicted = memory.predict(model_info(spec), 1, spec.optimizer, spec.accumulation_steps,
                                   attention=attention(result.framework))
        declared = declaration(entry_for(spec, result.framework).name)
        replicas = self.devices if declared is not None and declared.data_parallel.kind == "devices" else 1
        run_data = result.run_data["bytes"] if result.run_data is not None else None
        fixed = replicas * predicted.fixed + (result.dataset_bytes or 0) + (run_data or 0)
        # the probe's data: the run's dataset in the fixed part where it holds the batch (the line below it), else
        # sized to the batch
        per_sample = replicas * predicted.activations_per_sample + (
            0 if run_data is not None else result.probe_data_bytes_per_sample)
        result.neutral = MemoryModel(float(fixed), float(per_sample), 0.0, 0)
        result.neutral_limit = result.neutral.predict_limit(self.cap_bytes)

    def _run_data(self) -> None:
        """The training and test samples a run of the spec holds (``runcheck.run_sizes``), which every probe's
        synthetic data hold at least (a run holds its whole dataset, and the framework's copy of it: leaving it out
        of a probe left 56 MB of a run at batch 16 out, specs/max_batch.yaml). A dataset that cannot be counted here
        leaves the probes' data sized to the batch alone, with a note."""
        try:
            train, test = runcheck.run_sizes(self.spec)
        except ValueError as err:
            self.result.notes.append(f"the probes' data are sized to the batch alone: the spec's dataset cannot be "
                                     f"counted here ({err})")
            return
        self.run_sizes = (train, test)
        self.result.run_data = {"train_size": train, "test_size": test,
                                "bytes": (train + test) * datasets.sample_bytes(self.spec.dataset)}

    def _dataset_bound(self) -> None:
        """With the real dataset: its bytes and training images, and the upper bound they set. Raises ValueError."""
        try:
            data = datasets.load(self.spec.dataset, seed=self.spec.seed)
        except datasets.DatasetError as err:
            raise ValueError(str(err)) from None
        result, steps = self.result, self.spec.accumulation_steps
        result.dataset_bytes, result.train_size = data.nbytes, len(data.y_train)
        largest = result.train_size // steps // self.devices
        if largest < self.min_batch:
            raise ValueError(f"the dataset's {result.train_size} training images hold no batch of "
                             f"{self.min_batch} x {steps} (accumulation_steps) x {self.devices} (devices)")
        if largest < self.max_batch:
            per_step = (f" // accumulation_steps {steps}" if steps > 1 else "") + (
                f" // {self.devices} devices" if self.devices > 1 else "")
            self.max_batch = largest
            self.bound = f"batch size {largest} (the training set's {result.train_size} images{per_step})"
            result.notes.append(f"with the dataset resident no batch can exceed the training set: the search's upper "
                                f"bound is {largest} ({result.train_size} training images{per_step})")

    # ------------------------------------------------------------------------------------------------- one probe

    def probe(self, batch_size: int, purpose: str, again: bool = False, kind: str = "probe") -> bool:
        """True when ``batch_size`` (per device) fits: a fresh worker group's probe (``kind`` "probe") or run check
        ("run"), or, without ``again``, what earlier probes of it say (every one ok). Raises Stop for one that
        neither fits nor runs out of memory."""
        first = self.result.probed(batch_size, kind) is None
        if not again and not first:
            return self.result.fits(batch_size)
        outcome = self._run(batch_size, self.applied_mb, self.spec.sampler.interval_s, kind)
        if self.compile_first and first:  # the first worker of the size and kind compiled its steps (warm.py)
            compiled = warm.compile_record(outcome, len(self.result.probes), batch_size, purpose, kind,
                                           self.devices, self.device)
            if compiled is not None:
                self._add(compiled, outcome)
                outcome = self._run(batch_size, self.applied_mb, self.spec.sampler.interval_s, kind)
        status, reason = outcome.status, probe_reason(outcome)
        if status == "error" and MEMORY_ERROR_LINE in reason:  # a raised MemoryError the worker reports as oom
            status, reason = "oom", f"{reason} (Python's MemoryError: an allocation outside the framework failed)"
        if status in ("error", "crashed") and self.device == "cpu" and self.applied_mb is not None:
            status, reason = self._control(batch_size, status, reason, kind)
        peak, source = probe_peak(outcome, self.device) if status in ("ok", "oom") else (None, "")
        if status == "oom" and peak is not None:  # reached before the failure: a lower bound, not fitted
            source += " (at the failure: a lower bound)"
        record = Probe(index=len(self.result.probes), batch_size=batch_size, status=status, reason=reason,
                       peak_bytes=peak, peak_source=source, seconds=outcome.wall_seconds, purpose=purpose,
                       log_tail="" if status in ("ok", "oom") else outcome.log_tail[-2000:],
                       global_batch_size=batch_size * self.devices, kind=kind)
        earlier = self.result.statuses(batch_size, kind)
        self._add(record, outcome)
        if status not in ("ok", "oom"):
            raise Stop(record)
        if earlier and status not in earlier:
            self.result.notes.append(
                f"batch size {batch_size} fitted in {earlier.count('ok') + (status == 'ok')} and ran out of memory "
                f"in {earlier.count('oom') + (status == 'oom')} of its "
                + ("probes: it fits sometimes, so it is never the answer" if kind == "probe" else "run checks"))
        return status == "ok"

    def _add(self, record: Probe, outcome: Any) -> None:
        """``record`` into the result, then ``on_probe``."""
        self.result.probes.append(record)
        if self.on_probe is not None:
            self.on_probe(record, outcome)

    def _run(self, batch_size: int, limit_mb: float | None, interval_s: float | None, kind: str = "probe") -> Any:
        """One worker group at ``batch_size`` per device: a probe, or a run check (``kind`` "run")."""
        if kind == "run":
            pspec = runcheck.run_check_spec(self.spec, self.framework, batch_size, limit_mb, self.device,
                                            self.spec_file, self.dp, self.run_sizes[0] if self.run_sizes else None)
            trial = runcheck.run_check_trial(pspec, self.device)
        else:
            pspec = probe_spec(self.spec, self.framework, batch_size, limit_mb, self.device, self.spec_file,
                               self.with_dataset, self.dp, self.run_sizes)
            trial = plan(pspec, self.device)[0]
            if self.result.probe_steps:  # each epoch cut to its first steps (probe.probe_shape)
                trial = replace(trial, max_steps_per_epoch=self.result.probe_steps)
        return run_worker(Payload(trial=trial), self.timeout_s, interval_s, self.device, trial.threads)

    def _control(self, batch_size: int, status: str, reason: str, kind: str = "probe") -> tuple[str, str]:
        """A probe that failed under the CPU cap otherwise than with an OOM (a C++ runtime that cannot allocate a
        thread's stack or a buffer often aborts instead of raising) runs again without the cap: if it then runs ok,
        the cap caused the failure, and it counts as out of memory; else the original failure stands."""
        outcome = self._run(batch_size, None, None, kind)
        if outcome.status == "ok":
            return "oom", (f"{reason} (under the cap; the same probe without the cap ran ok, so the cap caused it: "
                           f"counted as out of memory)")
        self.result.notes.append(f"batch size {batch_size} failed without the cap too ({outcome.status}): not a "
                                 f"memory failure")
        return status, reason

    # ------------------------------------------------------------------------------------------------ bookkeeping

    def fitting_peaks(self) -> dict[int, float]:
        """{size: the mean peak of its probes} of every size that fits (every probe ok) with a peak reported."""
        out = {}
        for size in {p.batch_size for p in self.result.probes if p.kind == "probe"}:
            peaks = self.result.peaks(size)
            if peaks and self.result.fits(size):
                out[size] = sum(peaks) / len(peaks)
        return out

    def predict(self) -> tuple[int | None, bool]:
        """(the predicted limit, whether a line fitted to measured peaks made it): the line through the two largest
        sizes that fit (``bracket.local_line``) where its slope is positive; else, with one such size or a slope
        that noise left at or below zero, the neutral model's per-sample bytes drawn through the largest one's peak
        (the module docstring, step 2); None without either."""
        points = self.fitting_peaks()
        line = local_line(points)
        if line is not None and line.per_sample_bytes > 0:
            straight = line.predict_limit(self.cap_bytes)
            curved = curved_limit(points, self.cap_bytes)
            return (curved if curved is not None and straight is not None and curved < straight else straight), True
        neutral = self.neutral_through(points)
        return (neutral.predict_limit(self.cap_bytes) if neutral is not None else None), False

    def neutral_through(self, points: dict[int, float]) -> MemoryModel | None:
        """The neutral model's per-sample bytes drawn through the peak of the largest size in ``points``; None
        without a neutral model (a model of the entry's own) or a point."""
        neutral = self.result.neutral
        if neutral is None or not points or neutral.per_sample_bytes <= 0:
            return None
        size = max(points)
        return MemoryModel(points[size] - neutral.per_sample_bytes * size, neutral.per_sample_bytes, 0.0, 1)

    def ceiling(self) -> int:
        """The highest size a probe above everything that fitted may try: max_batch, and at most where the neutral
        model's per-sample bytes drawn through the largest fitting size's peak reach the cap (every framework
        measured holds more per sample than the neutral model counts, 1.5 to 6 x: a line through two small sizes
        whose slope noise flattened would otherwise send the next probe orders of magnitude too far)."""
        neutral = self.neutral_through(self.fitting_peaks())
        limit = neutral.predict_limit(self.cap_bytes) if neutral is not None else None
        return self.max_batch if limit is None else min(self.max_batch, limit)

    def first_prediction(self, lo: int, prediction: int | None, fitted: bool) -> None:
        """Records the search's first prediction of the limit, made once the initial sizes are probed (``lo``: the
        largest that fits): ``predicted_limit`` and ``predicted_by``; a prediction at or below ``lo``, which fitted,
        is none (the peaks are not what the cap counts, or too noisy to give a slope), and ``predicted_by`` says
        why."""
        result = self.result
        if prediction is not None and prediction > lo:
            result.predicted_limit = prediction
            result.predicted_by = ("the line through the first probes' peaks" if fitted else
                                   "the neutral model's per-sample bytes through the first probe's peak")
            return
        peaks = self.fitting_peaks()
        if prediction is None:
            result.predicted_by = ("none: no probe that fitted reported a peak" if not peaks else
                                   "none: the peaks do not grow with the batch, and no neutral model")
            return
        shown = ", ".join(f"{size}: {peak / 1e6:,.1f} MB" for size, peak in sorted(peaks.items()))
        result.predicted_by = (f"none: the line through the peaks ({shown}) reaches the cap "
                               f"({self.cap_bytes / 1e6:,.1f} MB) at {prediction}, at or below {lo}, which fitted: "
                               "the peaks measured are not what the cap counts")

    def refit(self) -> int | None:
        """Refits the memory model to every successful probe with a peak (run checks, whose conditions differ, are
        left out): the line the result reports (``model``, least squares over every probe); returns its predicted
        limit."""
        points = [(p.batch_size, p.peak_bytes) for p in self.result.probes
                  if p.kind == "probe" and p.status == "ok" and p.peak_bytes is not None]
        self.result.model = fit_memory_model(points)
        model = self.result.model
        self.result.final_predicted_limit = model.predict_limit(self.cap_bytes) if model is not None else None
        return self.result.final_predicted_limit

    def bounds(self) -> tuple[int | None, int | None]:
        """(lo, hi): the largest size that fits (every probe ok), and the smallest size above it that ran out of
        memory at least once (it fails or fits sometimes); each None if there is none."""
        probes = [p for p in self.result.probes if p.kind == "probe"]
        fitting = [p.batch_size for p in probes if self.result.fits(p.batch_size)]
        lo = max(fitting) if fitting else None
        oom = [p.batch_size for p in probes if p.status == "oom" and (lo is None or p.batch_size > lo)]
        return lo, (min(oom) if oom else None)

    def gap(self, lo: int) -> int:
        return max(1, math.floor(self.tolerance * lo))

    # ------------------------------------------------------------------------------------------------- the steps

    def initial(self, sizes: list[int]) -> None:
        """Step 1: the initial sizes, up to the first that does not fit."""
        for size in sizes:
            if not self.probe(size, "initial"):
                break

    def bracket(self) -> bool:
        """Steps 2-5: probe the prediction, close the bracket around it, confirm its lower end. False when nothing
        fits (the result says so)."""
        result = self.result
        climb = 0  # consecutive steps up past the prediction
        predicted = False
        while True:
            lo, hi = self.bounds()
            prediction, fitted = self.predict()
            if not predicted and lo is not None:
                predicted = True
                self.first_prediction(lo, prediction, fitted)
            if lo is None:  # nothing fits (yet): the smallest size decides
                if self.result.probed(self.min_batch) is None:
                    self.probe(self.min_batch, "smallest")
                    continue
                self._nothing_fits(hi)
                return False
            closed = hi is not None and hi - lo <= self.gap(lo)
            if closed or (hi is None and lo >= self.max_batch):
                if not result.confirmed(lo):
                    self.probe(lo, "confirmation", again=True)
                    continue
                result.status, result.limit, result.smallest_oom = ("found" if closed else "no_oom"), lo, hi
                # closed implies hi is not None (the check repeats it for the type checker)
                result.reason = (f"{lo} fitted in both of its probes and {self._failed(hi)}"
                                 if closed and hi is not None else
                                 f"{self.bound} fitted in both of its probes: the cap was not reached")
                self.refit()  # the reported line, which the recommendation's sample counts use
                return True
            if hi is None:
                size, purpose, climb = upward(lo, prediction, climb, self.gap(lo), fitted, self.max_batch,
                                              self.ceiling())
            else:
                last = result.probes[-1]
                missed = last.purpose == BELOW_FAILURE and last.status == "oom"
                size, purpose = inside(lo, hi, prediction, self.gap(lo), fitted, "ok" in result.statuses(hi), missed)
            self.probe(size, purpose)

    def _failed(self, hi: int) -> str:
        """How the smallest failing size failed, for the reason."""
        statuses = self.result.statuses(hi)
        if "ok" not in statuses:
            return f"{hi} runs out of memory"
        return f"{hi} ran out of memory in {statuses.count('oom')} of its {len(statuses)} probes (it fits sometimes)"

    def _nothing_fits(self, smallest_oom: int | None) -> None:
        result = self.result
        result.status, result.smallest_oom = "nothing_fits", smallest_oom
        statuses = result.statuses(self.min_batch)
        if "ok" in statuses:
            result.reason = (f"no batch size fits in every probe: even batch size {self.min_batch} ran out of memory "
                             f"in {statuses.count('oom')} of its {len(statuses)} probes under the cap "
                             f"({self.cap_bytes / 1e6:,.0f} MB)")
        else:
            result.reason = (f"even batch size {self.min_batch} runs out of memory under the cap "
                             f"({self.cap_bytes / 1e6:,.0f} MB)")

    def recommend(self) -> None:
        """Step 6, the recommendation below the limit (``harness.studies.max_batch.recommend``)."""
        Recommendation(self).recommend()

    def stopped(self, probe: Probe) -> None:
        """The result of a search stopped by a probe that ended neither ok nor oom."""
        lo, hi = self.bounds()
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
