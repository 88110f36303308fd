"""Step 6 of the max-batch search (``harness.studies.max_batch.search``): the recommendation below the limit it
found. The margin (``margin``, else the one the spread of the answer's peaks justifies, ``runcheck.margin_samples``)
is kept below the limit; with run checks (``harness.studies.max_batch.runcheck``: the spec's trial as ``harness run``
runs it, in fresh workers) less what a run holds beyond a probe, and confirmed in run checks; without them (or where
a run cannot train the size), confirmed in two probes. Every size here is a per-device batch; bytes are bytes.

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
        self._run_bound: int | None = None  # the largest per-device batch a run of the spec trains (run_bound)

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
        target = max(self.search.min_batch, result.limit - result.margin_samples)
        if self.search.run_checks:
            try:
                if self._recommend_by_runs(target):
                    return
            except Stop as stop:  # a run check that ended neither ok nor oom: no recommendation, the limit stands
                result.recommended, result.recommended_by = None, ""
                result.notes.append(f"the run check at batch size {stop.probe.batch_size} ended {stop.probe.status} "
                                    f"(not an out-of-memory error): {stop.probe.reason}; nothing is recommended")
                return
        self._recommend_by_probes(target)

    def run_bound(self) -> int:
        """The largest per-device batch a run of the spec can train: its training samples // accumulation_steps //
        devices (loaded once). Raises ValueError for a dataset that cannot be loaded."""
        if self._run_bound is None:
            train = runcheck.run_train_size(self.search.spec)
            self.result.run_check = runcheck.run_shape(self.search.spec, train)
            self._run_bound = train // self.search.spec.accumulation_steps // self.search.devices
        return self._run_bound

    def _recommend_by_runs(self, target: int) -> bool:
        """The recommendation confirmed by run checks: a run at the smallest size that fitted the probes measures
        what a run adds (``_run_offset``); then the largest of a few candidates, from ``target`` less that down,
        that is ok in every run check. False when no run can train a size that fitted (the caller confirms in
        probes instead; a note says why). Raises Stop."""
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
        nothing is recommended. Raises Stop."""
        result = self.result
        assert result.limit is not None and result.margin_samples is not None  # recommend() set them
        per_sample = result.model.per_sample_bytes if result.model is not None else None
        step = max(result.margin_samples, self.search.gap(result.limit))
        for _ in range(runcheck.MAX_RUN_CANDIDATES):
            checks = range(self.search.run_checks)
            if not all(self.search.probe(target, "run check", again=True, kind="run") for _ in checks):
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
            target = max(floor, min(target - self.search.gap(result.limit), result.limit - needed - offset))
        tried = len({p.batch_size for p in result.probes if p.purpose == "run check"})
        result.recommended, result.recommended_by = None, ""
        result.notes.append(f"no size from the margin's target down to {floor} held in every run check ({tried} "
                            "sizes tried): nothing is recommended")

    def _run_offset(self, size: int) -> int | None:
        """A run check at ``size``, which fitted the probes: how far its peak stands above the mean of the probes'
        peaks there (``result.run_offset``), in samples at the fitted per-sample bytes (0 where a peak or the slope
        is missing, or the run's peak is lower). None when the run ran out of memory. Raises Stop."""
        result = self.result
        if not self.search.probe(size, "run offset", again=True, kind="run"):
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
