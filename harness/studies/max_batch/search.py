"""The largest batch that fits (seed 004): measured, one worker process per probe, never guessed.

Each probe trains the spec's model at one batch size in a fresh worker under the memory cap (three optimizer steps
and an evaluation; synthetic images of the dataset's shape by default, the real dataset with ``with_dataset``);
``ok`` fits, ``oom`` does not, any other ending stops the search with its reason. The search probes small sizes,
fits ``peak_bytes = fixed + per_sample x B`` (first from the neutral model's per-sample bytes through one measured
peak), brackets and narrows the limit, and confirms the answer in a second fresh worker; a size seen both fitting and
failing is the ``fits_sometimes`` band, never the answer. The limit is that measured boundary. The recommendation
keeps a margin below it (by default twice the spread of the peak across the answer's probes) less what a run holds
beyond a probe, and must hold in run checks: the spec's trial as ``harness run`` runs it, in fresh workers
(``harness.studies.max_batch.runcheck``). The result never names a size that was not ok in two fresh workers.

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

from harness.execution.launcher import run_worker
from harness.execution.protocol import Payload
from harness.measure.machine import resolve_device
from harness.neutral import datasets, memory
from harness.plan import accumulation_conflict, check_devices, entry_for, model_info, plan
from harness.spec import DataParallelSpec, Spec, SpecError
from harness.studies.max_batch import runcheck
from harness.studies.max_batch.memory_model import MemoryModel, fit_memory_model
from harness.studies.max_batch.probe import MaxBatchResult, Probe, probe_spec, resolve_cap
from harness.studies.max_batch.probe import peak as probe_peak
from harness.studies.max_batch.probe import reason as probe_reason

DEFAULT_INITIAL_SIZES = (16, 64, 256)  # without a neutral prediction to anchor
ANCHOR_SIZE = 16  # the one small size probed first when the neutral model gives the slope
DEFAULT_TOLERANCE = 0.05
MAX_JUMP = 8  # without an upper bound, a probe is at most this many times the largest fitting size
DEFAULT_MAX_BATCH = 1 << 20
# A worker that ran out of memory even for its error report exits "without reporting why", with this last log line.
MEMORY_ERROR_LINE = "without reporting why: MemoryError"


class _Stop(Exception):
    def __init__(self, probe: Probe):
        self.probe = probe


def find_max_batch(spec: Spec, framework: str, device: str | None = None, *, memory_limit_mb: float | None = None,
                   margin: float | None = None, tolerance: float = DEFAULT_TOLERANCE,
                   initial_sizes: Sequence[int] | None = None, min_batch: int = 1, max_batch: int | None = None,
                   timeout_s: float | None = None, spec_file: str | Path | None = None, with_dataset: bool = False,
                   data_parallel: int | None = None, run_checks: int = runcheck.RUN_CHECKS,
                   on_probe: Callable[[Probe, Any], None] | None = None) -> MaxBatchResult:
    """Searches the largest batch size of ``framework`` that fits ``spec``'s memory cap (see the module docstring).

    device: "cpu" or "cuda:N"; None resolves the spec's device ("auto": a GPU when NVML sees one).
    memory_limit_mb: overrides the spec's. margin: fraction of the limit kept free for the recommendation
    (0 <= margin < 1); None keeps the margin the spread of the answer's peaks justifies (``runcheck.margin_samples``).
    tolerance: the search stops when the smallest failing size is within tolerance x the largest fitting one.
    initial_sizes: the small sizes probed first. min_batch / max_batch: the range searched (per-device batches).
    timeout_s: per probe (default: the spec's timeout_s). spec_file: named in errors about the probe spec.
    with_dataset: probe with the spec's real dataset resident (max_batch is then at most its training images //
    accumulation_steps // devices). data_parallel: N devices (None: the spec's own ``data_parallel``, else one):
    every size is a per-device batch, each probe a data-parallel trial of N x it. run_checks: run checks of each
    candidate for the recommendation (0: confirmed in two probes instead). on_probe(probe, outcome): called after
    every probe and run check (outcome: harness.execution.launcher.Outcome).
    Raises ValueError for a margin, tolerance, range or device count out of bounds (with_dataset: a training set
    smaller than min_batch x accumulation_steps x devices), data parallelism the framework cannot do for this model
    or that this machine has no devices for, a dataset that cannot be loaded, or a device whose memory cannot be told.
    """
    if margin is not None and not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), not {margin}")
    if tolerance < 0 or run_checks < 0:
        raise ValueError(f"tolerance and run_checks must be >= 0, not {tolerance} and {run_checks}")
    max_batch = max_batch or DEFAULT_MAX_BATCH
    if not 1 <= min_batch <= max_batch:
        raise ValueError(f"need 1 <= min_batch <= max_batch, not {min_batch} and {max_batch}")
    device = device or resolve_device(spec.device)
    try:
        dp = check_data_parallel(spec, framework, device, data_parallel, spec_file or "spec")
    except SpecError as err:
        raise ValueError(err.message) from None
    search = _Search(spec, framework, device, memory_limit_mb if memory_limit_mb is not None else spec.memory_limit_mb,
                     margin, tolerance, min_batch, max_batch, timeout_s if timeout_s is not None else spec.timeout_s,
                     spec_file or "<max-batch probe>", with_dataset, on_probe, dp, run_checks)
    if initial_sizes is None:
        initial_sizes = (ANCHOR_SIZE,) if search.result.neutral is not None else DEFAULT_INITIAL_SIZES
    try:
        search.initial(sorted({min(max(s, min_batch), search.max_batch) for s in initial_sizes}))
        if search.bracket():
            search.recommend()
    except _Stop as stop:
        search.stopped(stop.probe)
    search.refit()
    sometimes = search.result.sometimes()
    search.result.fits_sometimes = [sometimes[0], sometimes[-1]] if sometimes else None
    return search.result


def check_data_parallel(spec: Spec, framework: str, device: str, devices: int | None,
                        spec_file: str | Path) -> DataParallelSpec | None:
    """The data parallelism of a search on ``devices`` devices (None: the spec's own ``data_parallel``), checked
    before anything runs: at least one device, not combined with gradient accumulation, no more devices than this
    machine has (``harness.plan.check_devices``: on the CPU one logical device per available core, on a GPU machine
    the GPUs NVML counts), and a built-in adapter that trains this model data-parallel on ``device``'s kind (an
    adapter of HARNESS_ADAPTERS is decided by its worker, at the first probe). Returns the DataParallelSpec, None for
    one device. Raises SpecError naming ``spec_file`` and ``--data-parallel`` (the spec's ``data_parallel`` when
    ``devices`` is None)."""
    from adapters import declaration  # the registry imports no framework
    from adapters.base import data_parallel_gap

    field = "--data-parallel" if devices is not None else "data_parallel"
    own = spec.data_parallel
    if devices is not None and devices < 1:
        raise SpecError(spec_file, field, f"the device count is at least 1, not {devices}")
    dp = own if devices is None else DataParallelSpec(
        devices=devices, sync_batchnorm=own is not None and own.sync_batchnorm)
    if dp is None or dp.size == 1:
        return None
    if spec.accumulation_steps > 1:
        raise SpecError(spec_file, field, accumulation_conflict(dp.size, spec.accumulation_steps))
    gpus = None
    if device != "cpu":
        from harness.measure import machine

        found = machine.gpus()
        gpus = len(found["devices"]) if found.get("available") else None
    try:
        check_devices(spec.model_copy(update={"data_parallel": dp, "variants": None}), spec_file, device, gpus)
    except SpecError as err:
        raise SpecError(spec_file, field, err.message) from None
    record = declaration(entry_for(spec, framework).name)
    if record is not None and (why := data_parallel_gap(record, model_info(spec), dp.size, dp.sync_batchnorm,
                                                        device)) is not None:
        raise SpecError(spec_file, field, why)
    return dp


class _Search:
    """The state of one search: the probes so far (in ``result``) and the steps of the module docstring."""

    def __init__(self, spec: Spec, framework: str, device: str, limit_mb: float | None, margin: float | None,
                 tolerance: float, min_batch: int, max_batch: int, timeout_s: float, spec_file: str | Path,
                 with_dataset: bool, on_probe: Callable[[Probe, Any], None] | None,
                 dp: DataParallelSpec | None = None, run_checks: int = 0):
        self.spec, self.framework, self.device = spec, framework, device
        self.min_batch, self.max_batch, self.tolerance = min_batch, max_batch, tolerance
        self.timeout_s, self.spec_file, self.with_dataset, self.on_probe = timeout_s, spec_file, with_dataset, on_probe
        self.dp, self.devices, self.run_checks = dp, 1 if dp is None else dp.size, run_checks
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
        self._run_bound: int | None = None  # the largest per-device batch a run of the spec trains (run_bound)
        self.bound = f"batch size {max_batch} (max_batch)"  # what the upper bound is, for the no_oom reason
        if with_dataset:
            self._dataset_bound()
        self.result.max_batch = self.max_batch
        self._neutral()

    def _neutral(self) -> None:
        """The neutral model's memory line (``harness.neutral.memory.predict``), per batch sample B: fixed = the
        parameters, gradients, optimizer state, buffers and accumulator (and the resident dataset with
        ``with_dataset``); per sample = the activations saved for the backward pass plus the probe's data per batch
        sample. Under data parallelism B is the per-device batch and the line is one process's: a framework that
        drives every device from one process (its declaration's ``data_parallel`` "devices") holds N replicas and N
        devices' activations, one with a process per device (PyTorch) one. Its limit against the cap is
        ``neutral_limit``."""
        from adapters import attention, declaration  # the registry imports no framework

        spec, result = self.spec, self.result
        predicted = memory.predict(model_info(spec), 1, spec.optimizer, spec.accumulation_steps,
                                   attention=attention(result.framework))
        record = declaration(entry_for(spec, result.framework).name)
        replicas = self.devices if record is not None and record.data_parallel == "devices" else 1
        fixed = replicas * predicted.fixed + (result.dataset_bytes or 0)
        per_sample = replicas * predicted.activations_per_sample + result.probe_data_bytes_per_sample
        result.neutral = MemoryModel(float(fixed), float(per_sample), 0.0, 0)
        result.neutral_limit = result.neutral.predict_limit(self.cap_bytes)

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
        ("run"), or, without ``again``, what earlier probes of it say (every one ok). Raises _Stop for one that
        neither fits nor runs out of memory."""
        if not again and self.result.probed(batch_size, kind) is not None:
            return self.result.fits(batch_size)
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
        self.result.probes.append(record)
        if self.on_probe is not None:
            self.on_probe(record, outcome)
        if status not in ("ok", "oom"):
            raise _Stop(record)
        if earlier and status not in earlier:
            self.result.notes.append(
                f"batch size {batch_size} fitted in {earlier.count('ok') + (status == 'ok')} and ran out of memory "
                f"in {earlier.count('oom') + (status == 'oom')} of its "
                + ("probes: it fits sometimes, so it is never the answer" if kind == "probe" else "run checks"))
        return status == "ok"

    def _run(self, batch_size: int, limit_mb: float | None, interval_s: float | None, kind: str = "probe") -> Any:
        """One worker group at ``batch_size`` per device: a probe, or a run check (``kind`` "run")."""
        if kind == "run":
            pspec = runcheck.run_check_spec(self.spec, self.framework, batch_size, limit_mb, self.device,
                                            self.spec_file, self.dp)
            trial = runcheck.run_check_trial(pspec, self.device)
        else:
            pspec = probe_spec(self.spec, self.framework, batch_size, limit_mb, self.device, self.spec_file,
                               self.with_dataset, self.dp)
            trial = plan(pspec, self.device)[0]
            if self.with_dataset:  # the whole dataset resident, but one step per epoch (see harness.execution.worker)
                trial = replace(trial, max_steps_per_epoch=1)
        return run_worker(Payload(trial=trial, spec=pspec), self.timeout_s, interval_s, self.device, trial.threads)

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

    def anchored(self) -> int | None:
        """The neutral model's guess of the limit through the measured peak of the largest size that fits (see
        the module docstring, step 2); None without a neutral model or such a peak."""
        neutral = self.result.neutral
        peaks = [(p.batch_size, p.peak_bytes) for p in self.result.probes if p.kind == "probe"
                 and p.status == "ok" and p.peak_bytes is not None and self.result.fits(p.batch_size)]
        if neutral is None or not peaks or neutral.per_sample_bytes <= 0:
            return None
        size, peak = max(peaks)
        return MemoryModel(peak - neutral.per_sample_bytes * size, neutral.per_sample_bytes, 0.0,
                           1).predict_limit(self.cap_bytes)

    def refit(self) -> int | None:
        """Refits the memory model to every successful probe with a peak (run checks, whose conditions differ, are
        left out); returns its predicted limit."""
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
        result.predicted_limit = self.refit()
        climb = 0  # consecutive steps up past the prediction
        while True:
            lo, hi = self.bounds()
            prediction, fitted = self.refit(), True
            if prediction is None:
                prediction, fitted = self.anchored(), False
            if result.predicted_limit is None:
                result.predicted_limit = prediction
                result.predicted_by = ("the memory model fitted to the first probes" if fitted else
                                       "the neutral model's per-sample bytes through the first probe's peak")
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
                return True
            if hi is None:
                size, purpose, climb = self._upward(lo, prediction, climb, fitted)
            else:
                size, purpose = self._inside(lo, hi, prediction, fitted)
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

    def _upward(self, lo: int, prediction: int | None, climb: int, fitted: bool = True) -> tuple[int, str, int]:
        """The next probe above everything that fitted, with no failure yet: up to the prediction (a fitted one at
        most MAX_JUMP x; the neutral model's guess, ``fitted`` False, as it is); doubling without one; where the
        prediction is already passed, one tolerance step up, the step doubling each time. Returns (size, purpose,
        the new count of steps past the prediction)."""
        g = self.gap(lo)
        jump = lo * MAX_JUMP if fitted else self.max_batch
        if prediction is None:
            size, purpose = 2 * lo, "doubling"
        elif prediction > lo:  # at least one tolerance step up, so that an OOM there closes the bracket
            size, purpose, climb = max(prediction, lo + g), "prediction" if fitted else "neutral-model guess", 0
        else:
            size, purpose, climb = lo + (g << climb), "step up", climb + 1
        return min(size, jump, self.max_batch), purpose, climb

    def _inside(self, lo: int, hi: int, prediction: int | None, fitted: bool = True) -> tuple[int, str]:
        """The next probe inside the bracket: the prediction where it falls inside, else the midpoint (geometric
        while hi > MAX_JUMP x lo; one step above lo where a fitted model puts the limit there); kept one
        tolerance step away from both ends, so that either outcome of a probe next to an end closes the bracket."""
        g = self.gap(lo)
        if hi - lo <= 2 * g:
            return (lo + hi) // 2, "bisection"
        inside = prediction is not None and lo < prediction < hi
        # a bracket spanning orders of magnitude (a guess far off) is halved on a log scale, else arithmetically
        middle = math.isqrt(lo * hi) if hi > MAX_JUMP * lo else (lo + hi) // 2
        if fitted and prediction is not None and lo - g <= prediction <= lo:
            prediction, inside = lo + g, True  # the model puts the limit at lo: one step above it decides
        size = prediction if inside and prediction is not None else middle
        size = min(max(size, lo + g), hi - g)
        return size, "prediction" if size == prediction else "bisection"

    # ----------------------------------------------------------------------------------------- the recommendation

    def recommend(self) -> None:
        """Step 6: the recommendation below the limit (docs/design/max-batch.md): the margin (``margin``, else the
        one the spread of the answer's peaks justifies), then, with run checks, less what a run holds beyond a probe,
        confirmed in run checks; without (or where a run cannot train the size), confirmed in two probes."""
        result = self.result
        if result.limit is None:
            return
        per_sample = result.model.per_sample_bytes if result.model is not None else None
        result.peak_spread = runcheck.peak_spread(result.peaks(result.limit), result.limit, per_sample)
        spread = result.peak_spread
        headroom = result.cap_bytes - spread["max_bytes"] if spread and result.status == "no_oom" else None
        result.margin_samples, result.margin_basis = runcheck.margin_samples(result.limit, result.margin, spread,
                                                                             headroom)
        target = max(self.min_batch, result.limit - result.margin_samples)
        if self.run_checks:
            try:
                if self._recommend_by_runs(target):
                    return
            except _Stop as stop:  # a run check that ended neither ok nor oom: no recommendation, the limit stands
                result.recommended, result.recommended_by = None, ""
                result.notes.append(f"the run check at batch size {stop.probe.batch_size} ended {stop.probe.status} "
                                    f"(not an out-of-memory error): {stop.probe.reason}; nothing is recommended")
                return
        self._recommend_by_probes(target)

    def run_bound(self) -> int:
        """The largest per-device batch a run of the spec can train: its training samples // accumulation_steps //
        devices (loaded once). Raises ValueError for a dataset that cannot be loaded."""
        if self._run_bound is None:
            train = runcheck.run_train_size(self.spec)
            self.result.run_check = runcheck.run_shape(self.spec, train)
            self._run_bound = train // self.spec.accumulation_steps // self.devices
        return self._run_bound

    def _recommend_by_runs(self, target: int) -> bool:
        """The recommendation confirmed by run checks: a run at the smallest size that fitted the probes measures
        what a run adds (``_run_offset``); then the largest of a few candidates, from ``target`` less that down,
        that is ok in every run check. False when no run can train a size that fitted (the caller confirms in
        probes instead; a note says why). Raises _Stop."""
        result = self.result
        sizes = sorted({p.batch_size for p in result.probes if p.kind == "probe" and result.fits(p.batch_size)})
        try:
            bound = self.run_bound()
        except ValueError as err:
            result.notes.append(f"no run check: the spec's dataset cannot be loaded here ({err})")
            return False
        if not sizes or sizes[0] > bound:
            result.notes.append(f"no run check: a run of the spec trains at most {bound} per device (its "
                                f"{(result.run_check or {}).get('train_size')} training samples), below every size "
                                "that fitted; the recommendation is confirmed in probes")
            return False
        offset = self._run_offset(sizes[0])
        if offset is None:
            result.recommended, result.recommended_by = None, ""
            result.notes.append(f"a run of the spec at batch size {sizes[0]} ran out of memory although its probes "
                                "fitted: a run holds more than the probes (its dataset); nothing is recommended")
            return True
        if target - offset > bound:
            result.notes.append(f"the recommendation is at most {bound}: a run of the spec cannot train more per "
                                f"device (its {(result.run_check or {}).get('train_size')} training samples)")
        floor = sizes[0]  # ok in its probes and in the run that measured the offset: never recommend below it
        if target - offset < floor:
            result.notes.append(f"the margin ({result.margin_samples} samples) and what a run adds ({offset}) leave "
                                f"no size above {floor}, the smallest that held in a run: the recommendation is "
                                f"tried there")
        self._run_candidates(max(floor, min(target - offset, bound)), offset, floor)
        return True

    def _run_candidates(self, target: int, offset: int, floor: int) -> None:
        """From ``target`` down to ``floor``, the first candidate ok in every run check and, with the default
        margin, whose run checks' own spread of the peak (runs vary more than probes: more steps, the whole dataset)
        keeps no more than the margin applied: else the margin grows to SPREAD_FACTOR x that spread and the candidate
        moves below it (not below ``floor``, where it is accepted). A run check that runs out of memory moves the
        candidate one margin (at least one tolerance step) down. At most MAX_RUN_CANDIDATES candidates; none ok:
        nothing is recommended. Raises _Stop."""
        result = self.result
        assert result.limit is not None and result.margin_samples is not None  # recommend() set them
        per_sample = result.model.per_sample_bytes if result.model is not None else None
        step = max(result.margin_samples, self.gap(result.limit))
        for _ in range(runcheck.MAX_RUN_CANDIDATES):
            if not all(self.probe(target, "run check", again=True, kind="run") for _ in range(self.run_checks)):
                if target == floor:
                    break
                target = max(floor, target - step)
                continue
            spread = runcheck.peak_spread(result.peaks(target, "run"), target, per_sample)
            needed, _ = runcheck.margin_samples(result.limit, None, spread)
            if result.margin is not None or needed <= result.margin_samples or target == floor:
                result.recommended, result.recommended_by = target, "runs"
                return
            result.notes.append(f"the run checks at {target} spread {(spread or {}).get('spread_bytes', 0) / 1e6:,.1f}"
                                f" MB in their peaks, more than the probes at the answer: the margin grows to {needed} "
                                "samples")
            result.margin_samples = needed
            result.margin_basis = f"{runcheck.SPREAD_FACTOR} x the spread of the peak across the run checks at {target}"
            target = max(floor, min(target - self.gap(result.limit), result.limit - needed - offset))
        tried = len({p.batch_size for p in result.probes if p.purpose == "run check"})
        result.recommended, result.recommended_by = None, ""
        result.notes.append(f"no size from the margin's target down to {floor} held in every run check ({tried} "
                            "sizes tried): nothing is recommended")

    def _run_offset(self, size: int) -> int | None:
        """A run check at ``size``, which fitted the probes: how far its peak stands above the mean of the probes'
        peaks there (``result.run_offset``), in samples at the fitted per-sample bytes (0 where a peak or the slope
        is missing, or the run's peak is lower). None when the run ran out of memory. Raises _Stop."""
        result = self.result
        if not self.probe(size, "run offset", again=True, kind="run"):
            return None
        run, probes = result.peaks(size, "run"), result.peaks(size)
        probe_peak = sum(probes) / len(probes) if probes else None
        offset = run[-1] - probe_peak if run and probe_peak is not None else None
        samples = runcheck.offset_samples(offset, result.model.per_sample_bytes if result.model else None)
        result.run_offset = {"batch_size": size, "run_peak_bytes": run[-1] if run else None,
                             "probe_peak_bytes": probe_peak, "offset_bytes": offset, "offset_samples": samples}
        return samples

    def _recommend_by_probes(self, target: int) -> None:
        """The recommendation confirmed in the search's probes: ``target`` probed, the largest size at or below it
        that fits, confirmed like the limit (a size whose confirmation fails is passed over for the next one below;
        memory is not always monotonic in the batch size, so it is verified, not assumed)."""
        result = self.result
        result.recommended, result.recommended_by = result.limit, "probes"
        if result.limit is None or target >= result.limit:
            return
        self.probe(target, "margin")
        if "ok" not in result.statuses(target):
            result.notes.append(f"batch size {target} ran out of memory although {result.limit} fits: memory is not "
                                f"monotonic in the batch size here")
        while True:
            candidates = [p.batch_size for p in result.probes if p.kind == "probe" and p.batch_size <= target
                          and result.fits(p.batch_size)]
            result.recommended = max(candidates) if candidates else None
            if result.recommended is None or result.confirmed(result.recommended):
                result.recommended_by = "probes" if result.recommended is not None else ""
                return
            self.probe(result.recommended, "confirmation", again=True)

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
