"""Step 6 of the max-batch search (``harness.studies.max_batch.search``): the recommendation below the limit it
found. The margin (``margin``, else the one the spread of the answer's peaks justifies, ``runcheck.margin_samples``)
is kept below the limit; with run checks (``harness.studies.max_batch.runcheck``: the spec's trial as ``harness run``
runs it, in fresh workers) less what a run holds beyond a probe, and confirmed in run checks; without them (or where
a run cannot train the size, or a run check ended neither ok nor oom), confirmed in two probes. Never above the
largest batch a run of the spec can time a step at (``runcheck.largest_measured_batch``). Every size here is a
per-device batch; bytes are bytes.

Design: docs/design/max-batch.md (step 6).
"""

from __future__ import annotations

from typing import Protocol

from harness.spec import Spec
from harness.studies.max_batch import runcheck
from harness.studies.max_batch.probe import MaxBatchResult, Stop


class Prober(Protocol):
    """What the recommendation asks of the search (``search._Search``): its result so far, the spec and range, and
    one probe or run check at a time."""

    result: MaxBatchResult
    spec: Spec
    min_batch: int
    devices: int
    run_checks: int
    margin_floor: float

    def probe(self, batch_size: int, purpose: str, again: bool = False, kind: str = "probe") -> bool:
        """True when ``batch_size`` fits (``search._Search.probe``). Raises Stop."""
        ...

    def gap(self, lo: int) -> int:
        """One tolerance step above ``lo``, in samples (at least 1)."""
        ...


class Recommendation:
    """The recommendation of one search (module docstring), written into ``search.result``: ``recommended``,
    ``recommended_by``, ``peak_spread``, ``margin_samples``, ``margin_basis``, ``run_offset``, ``run_check`` and
    notes."""

    def __init__(self, search: Prober):
        self.search, self.result = search, search.result
        self._train: int | None = None  # the training samples of a run of the spec (``_bound``)
        self._offset_bytes = 0.0  # what a run adds beyond a probe (``_run_offset``)
        self._headroom = 0.0  # bytes the cap leaves above the answer's highest peak where it was not reached
        self._floor = 0.0  # the margin's floor in bytes (``margin_floor`` of the cap; 0 with an explicit margin)

    def recommend(self) -> None:
        """Step 6: the recommendation below the limit (docs/design/max-batch.md): the margin (``margin``, else the
        one the spread of the answer's peaks justifies), then, with run checks, less what a run holds beyond a probe,
        confirmed in run checks; without (or where a run cannot train the size), confirmed in two probes."""
        result = self.result
        if result.limit is None:
            return
        per_sample = self.per_sample()
        peaks = result.peaks(result.limit)
        result.peak_spread = runcheck.peak_spread(peaks, result.limit, per_sample)
        # where the cap was not reached the limit is the search's bound, not a memory boundary: the margin is judged
        # against what the cap leaves above the answer's highest peak; where it was, the limit is the boundary
        self._headroom = max(0.0, result.cap_bytes - max(peaks)) if peaks and result.status == "no_oom" else 0.0
        self._floor = self.search.margin_floor * result.cap_bytes if result.margin is None else 0.0
        result.margin_samples, result.margin_basis = self._margin(result.peak_spread, "the answer's probes")
        target = max(self.search.min_batch, result.limit - result.margin_samples)
        bound = self._bound()
        if bound is not None and bound < self.search.min_batch:
            result.notes.append(f"nothing is recommended: {self._bound_reason(bound)}")
            return
        unbounded = target
        if bound is not None and target > bound:
            result.notes.append(f"the recommendation is at most {bound}: {self._bound_reason(bound)}")
            target = bound
        if self.search.run_checks:
            try:
                if self._recommend_by_runs(unbounded, bound):
                    return
            except Stop as stop:  # neither ok nor oom: says nothing about memory; the probes confirm instead
                result.recommended, result.recommended_by = None, ""
                result.notes.append(f"the run check at batch size {stop.probe.batch_size} ended {stop.probe.status} "
                                    f"(not an out-of-memory error): {stop.probe.reason}; the recommendation is "
                                    "confirmed in probes instead, not in a run")
        self._recommend_by_probes(target)

    def per_sample(self) -> float | None:
        """The bytes per batch sample that turn bytes into samples for the margin and the offset: the fitted line's
        where its slope is positive, else the neutral model's (peaks whose noise hides the slope, JAX's under 400 MB
        at batch 16..22 of specs/max_batch.yaml: the neutral model's per-sample bytes are below every framework's
        measured ones, so a margin in samples errs large); None without either."""
        for line in (self.result.model, self.result.neutral):
            if line is not None and line.per_sample_bytes > 0:
                return line.per_sample_bytes
        return None

    def _margin(self, spread: dict | None, where: str) -> tuple[int, str]:
        """(samples kept below the limit, why) for ``spread`` (``runcheck.peak_spread`` of the answer's probes, or of
        a candidate's run checks: ``where``): ``runcheck.margin_samples`` with the floor and, where the cap was not
        reached, its headroom."""
        return runcheck.margin_samples(self.result.limit or 0, self.result.margin, spread, self._headroom or None,
                                       self._floor, self.per_sample(), where)

    def _free(self, spread: dict | None) -> float:
        """The bytes of the cap's headroom (where it was not reached) left once the margin for ``spread`` is kept:
        what a run may add beyond a probe before it moves the recommendation (0 with an explicit margin)."""
        if self.result.margin is not None or not self._headroom:
            return 0.0
        spread_bytes = runcheck.SPREAD_FACTOR * spread["spread_bytes"] if spread else 0.0
        return max(0.0, self._headroom - max(spread_bytes, self._floor))

    def _bound(self) -> int | None:
        """The largest per-device batch a run of the spec trains with at least one timed step
        (``runcheck.largest_measured_batch``: its training samples, accumulation, devices, warm-up and epochs; a
        larger batch ends in "warmup_steps W leaves none of the N steps to measure", or exceeds the training set), and
        ``result.run_check``; None, with a note, for a dataset that cannot be counted here."""
        spec = self.search.spec
        if self._train is None:
            try:
                self._train = runcheck.run_train_size(spec)
            except ValueError as err:
                self.result.notes.append(f"no run check, and no bound from a run's steps: the spec's dataset cannot "
                                         f"be counted here ({err})")
                return None
            self.result.run_check = runcheck.run_shape(spec, self._train)
        return runcheck.largest_measured_batch(spec, self._train, self.search.devices)

    def _bound_reason(self, bound: int) -> str:
        """Why no batch above ``bound`` (``_bound``) is recommended, in words."""
        spec, train = self.search.spec, self._train
        per_epoch = spec.warmup_steps // spec.epochs + 1
        parts = [f"{spec.accumulation_steps} (accumulation_steps)"] if spec.accumulation_steps > 1 else []
        parts += [f"{self.search.devices} (devices)"] if self.search.devices > 1 else []
        per_step = "".join(f" x {p}" for p in parts)
        if per_epoch == 1:
            return (f"a run of the spec trains no larger batch per device: its {train} training samples hold no "
                    f"step of {bound + 1}{per_step}")
        return (f"a larger batch leaves a run of the spec no step to time: with warmup_steps {spec.warmup_steps} "
                f"over {spec.epochs} epochs each epoch needs {per_epoch} steps, and its {train} training samples "
                f"hold {per_epoch} steps of at most {bound}{per_step}")

    def _recommend_by_runs(self, target: int, bound: int | None) -> bool:
        """The recommendation confirmed by run checks: a run at the smallest size that fitted the probes measures
        what a run adds (``_run_offset``); then the search downward from ``target`` (the limit less the margin) less
        that, at most ``bound`` (``_bound``: a bound below that target needs no offset), for a size ok in every run
        check (``_run_candidates``). False when no run check can be made (the
        dataset cannot be counted, ``bound`` None) or a run cannot train any size that fitted (the caller confirms in
        probes instead; a note says why). Raises Stop."""
        result = self.result
        sizes = sorted({p.batch_size for p in result.probes if p.kind == "probe" and result.fits(p.batch_size)})
        if bound is None:
            return False
        if not sizes or sizes[0] > bound:
            result.notes.append(f"no run check: a run of the spec trains at most {bound} per device, below every "
                                "size that fitted; the recommendation is confirmed in probes")
            return False
        floor = sizes[0]  # ok in its probes; held in the run that measures the offset, it is the search's floor
        offset = self._run_offset(floor)
        if offset is None:
            result.notes.append(f"a run of the spec at batch size {floor} ran out of memory although its probes "
                                "fitted: a run holds more than the probes; the recommendation is searched below it")
            self._run_candidates(max(self.search.min_batch, floor // 2), self.search.min_batch - 1, floor)
            return True
        if target - offset < floor:
            result.notes.append(f"the margin ({result.margin_samples} samples) and what a run adds ({offset}) leave "
                                f"no size above {floor}, the smallest that held in a run: the recommendation is "
                                f"tried there")
        self._run_candidates(max(floor, min(target - offset, bound)), floor, None)
        return True

    def _run_candidates(self, target: int, held: int, failed: int | None) -> None:
        """The search downward for the recommendation, from ``target``: the first candidate ok in every run check
        (each stops at its first failure) is ``recommended``, unless, with the default margin, its run checks' own
        spread of the peak (runs vary more than probes: more steps, the whole dataset) needs more margin than the
        one applied: the margin then grows to SPREAD_FACTOR x that spread and the candidate moves below it; or
        unless its run checks' highest peak leaves less of the cap free than the floor (``margin_floor`` of the cap,
        the default margin only): the candidate then moves down by the bytes missing, in samples. A failure moves
        the candidate down one step (the margin, at least one tolerance step), the step doubling with each failure,
        but never more than half the way to ``held``, the largest size below it that held in a run (bisection toward
        it; ``held`` itself is checked once the candidates reach it); below ``held`` when it fails too, by halves
        down to min_batch. So a recommendation comes unless not even min_batch holds in a run.
        ``failed``: a size that failed a run check before (None: none). Every size tried is named in the notes.
        Raises Stop."""
        result = self.result
        assert result.limit is not None and result.margin_samples is not None  # recommend() set them
        per_sample = self.per_sample()
        smallest = self.search.min_batch
        step = max(result.margin_samples, self.search.gap(result.limit))
        failures = 0 if failed is None else 1
        while True:
            ok = all(self.search.probe(target, "run check", again=True, kind="run")
                     for _ in range(self.search.run_checks))
            if ok:
                spread = runcheck.peak_spread(result.peaks(target, "run"), target, per_sample)
                needed, basis = self._margin(spread, f"the run checks at {target}")
                offset = runcheck.offset_samples(self._offset_bytes - self._free(spread), per_sample)
                # the margin those run checks justify, judged against the limit (and, where the cap was not
                # reached, against the cap's headroom): a target at or below the limit less it needs no more
                below = target <= result.limit - needed - offset
                # the bytes the runs' highest peak leaves free of the cap, short of the floor (a peak above the cap
                # in a run that was ok does not measure what the cap binds, and is not judged)
                highest = max(result.peaks(target, "run"), default=0.0)
                short = self._floor - (result.cap_bytes - highest) if highest <= result.cap_bytes else 0.0
                if target > held and short > 0:
                    nxt = target - max(self.search.gap(target), runcheck.offset_samples(short, per_sample))
                    result.notes.append(f"the run checks at {target} peaked at {highest / 1e6:,.1f} MB, leaving "
                                        f"less of the cap free than the floor ({self._floor / 1e6:,.1f} MB): the "
                                        f"candidate moves down to {max(held, smallest, nxt)}")
                elif result.margin is not None or needed <= result.margin_samples or below or target <= held:
                    result.recommended, result.recommended_by = target, "runs"
                    self._tried_note()
                    return
                else:
                    result.notes.append(f"the run checks at {target} spread "
                                        f"{(spread or {}).get('spread_bytes', 0) / 1e6:,.1f} MB in their peaks, "
                                        f"more than the probes at the answer: the margin grows to {needed} samples")
                    result.margin_samples, result.margin_basis = needed, basis
                    nxt = min(target - self.search.gap(target), result.limit - needed - offset)
            else:
                failures += 1
                if target <= held:  # the size that held in a run failed now: search below it
                    held = smallest - 1
                if target <= smallest:
                    result.recommended, result.recommended_by = None, ""
                    self._tried_note(f"not even batch size {smallest} held in every run check: nothing is "
                                     "recommended")
                    return
                nxt = max(target - (step << (failures - 1)), (held + target) // 2)
            target = max(held, smallest, min(nxt, target - 1))

    def _tried_note(self, outcome: str = "") -> None:
        """A note naming every size the run checks tried and how each ended, with ``outcome`` after it."""
        tried = runcheck.tried(self.result)
        if tried and (outcome or len(tried) > 1):
            self.result.notes.append(f"run checks: {'; '.join(tried)}" + (f": {outcome}" if outcome else ""))

    def _run_offset(self, size: int) -> int | None:
        """A run check at ``size``, which fitted the probes: how far its peak stands above the mean of the probes'
        peaks there (``result.run_offset``), in samples at the fitted per-sample bytes (0 where a peak or the slope
        is missing, or the run's peak is lower; where the cap was not reached, only what the cap's headroom left
        after the margin does not hold: ``_free``). None when the run ran out of memory. Raises Stop."""
        result = self.result
        if not self.search.probe(size, "run offset", again=True, kind="run"):
            return None
        run, probes = result.peaks(size, "run"), result.peaks(size)
        probe_peak = sum(probes) / len(probes) if probes else None
        offset = run[-1] - probe_peak if run and probe_peak is not None else None
        self._offset_bytes = offset or 0.0
        free = self._free(result.peak_spread)
        samples = runcheck.offset_samples(None if offset is None else offset - free, self.per_sample())
        result.run_offset = {"batch_size": size, "run_peak_bytes": run[-1] if run else None,
                             "probe_peak_bytes": probe_peak, "offset_bytes": offset, "offset_samples": samples,
                             "headroom_bytes": free}
        return samples

    def _recommend_by_probes(self, target: int) -> None:
        """The recommendation confirmed in the search's probes: ``target`` probed, the largest size at or below it
        that fits, confirmed like the limit (a size whose confirmation fails is passed over for the next one below;
        memory is not always monotonic in the batch size, so it is verified, not assumed)."""
        result = self.result
        result.recommended, result.recommended_by = result.limit, "probes"
        if result.limit is None or target >= result.limit:
            return
        self.search.probe(target, "margin")
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
            self.search.probe(result.recommended, "confirmation", again=True)
