"""Runs a whole spec: plan the trials, run each in its own worker, write every finished trial before the next."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.execution.executors import Executor, ExecutorError, Finished, LocalExecutor, local_slots
from harness.execution.probes import probe_entries
from harness.execution.protocol import Payload
from harness.execution.workers import Workers, owner
from harness.measure import machine
from harness.measure.machine import resolve_device
from harness.plan import Trial, check_devices, data_parallel_settings, plan, unsupported_reason
from harness.plan.support import Conditions
from harness.record import Event, FrameworkEnvironment, Placement, RunRecord, TrialRecord
from harness.results.store import (
    RunFile,
    append_trial,
    create_run_dir,
    drop_torn_tail,
    read_run,
    read_trials,
    write_events,
    write_lines,
)
from harness.spec import Spec, SpecError
from harness.studies.records import (
    new_run,
    now,
    placement_record,
    skipped_record,
    trial_record,
    unsupported_record,
)


def spec_differences(old: Any, new: Any, path: str = "") -> list[str]:
    """Dotted paths of the fields where two JSON-like specs differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            out += spec_differences(old.get(key), new.get(key), f"{path}.{key}" if path else str(key))
        return out
    return [] if old == new else [path or "(the whole spec)"]


def run_spec(spec: Spec, out_root: str | Path, spec_path: str | Path | None = None,
             on_start: Callable[[Trial, int, int], None] | None = None,
             on_end: Callable[[Trial, TrialRecord], None] | None = None,
             on_event: Callable[[Event], None] | None = None,
             resume: str | Path | None = None, executor: Executor | None = None,
             adjust: Callable[[Trial], Trial] | None = None) -> Path:
    """Runs every trial of ``spec`` and returns the run directory (see harness.results.store for its layout).

    Each trial's record is on disk (fsynced) before the next trial starts; a failing trial is recorded with its
    status and reason and the sweep goes on. ``on_start(trial, index, total)``, ``on_end(trial, record)`` (its
    ``TrialRecord``) and ``on_event(worker event)`` (typed, ``harness.record.events``) report progress. run.json is
    created and changed through ``harness.results.store.RunFile`` only.

    A run stopped on the way (Ctrl-C, SIGTERM or SIGHUP through ``raise_on_signals``, or an error of the harness) is
    marked in run.json (``interrupted``: why, when, the trials finished and not run) and the exception goes on, with
    ``run_dir`` set on it; the worker of the trial in progress and the preloaded parents are ended before that, so
    that nothing of the run outlives a Ctrl-C or SIGTERM by more than a moment while its report is written.

    ``resume``: an interrupted run directory to finish instead of starting a new one. Trials already in its
    trials.jsonl (whatever their status) are not run again; a torn last line (a crash mid-write) is removed and that
    trial runs again. Raises SpecError when ``spec`` differs from the spec the run started with, naming the fields.

    ``executor``: where trials run (an ``harness.execution.executors.Executor``: ``LocalExecutor`` over this
    machine's slots, or ``RayExecutor``); default one trial at a time on this machine. Whoever makes it closes it:
    the caller closes the one it passes (``with executor:``; that kills the workers still running when the run
    stops), the sweep the default one it makes, when the run ends or stops. An ``exclusive`` spec runs one trial
    at a time whatever the executor's capacity. A trial whose launcher raises is recorded ``error`` ("the launcher
    failed: ...") by every executor, and the run goes on. run.json records it (``executors``: one entry per session,
    a resume adds one). A data-parallel trial takes as many of its slots or GPUs as it has devices, trials start
    strictly in plan order (``_run_trials``), and a spec whose trials need more devices than ``executor`` has raises
    SpecError before anything is written (``check_executor``).

    ``adjust``: a study's change to each planned trial, made once before any runs (``harness advise`` gives each
    batch size the epochs its timed steps need); its id must stay the same.
    """
    if executor is not None:
        check_executor(spec, executor, spec_path)  # before anything is written
    # the owner of the preloaded parents the workers fork from: the sweep's own, closed at its end, unless one is
    # active (the test suite's, tests/conftest.py)
    with owner() as workers:
        return _sweep(spec, out_root, spec_path, on_start, on_end, on_event, resume, executor, adjust, workers)


def _sweep(spec: Spec, out_root: str | Path, spec_path: str | Path | None,
           on_start: Callable[[Trial, int, int], None] | None, on_end: Callable[[Trial, TrialRecord], None] | None,
           on_event: Callable[[Event], None] | None, resume: str | Path | None, executor: Executor | None,
           adjust: Callable[[Trial], Trial] | None, workers: Workers) -> Path:
    """``run_spec``'s run with ``workers`` (entered): the probes fork from it for the default executor (whose trials
    fork from the same parents: the same settings)."""
    owner = workers if executor is None else None
    run_dir, run_info, done = (_reopen(spec, Path(resume), spec_path, owner) if resume is not None else
                               _create(spec, out_root, spec_path, owner))
    device = run_info.device
    trials = [adjust(t) if adjust else t for t in plan(spec, device) if t.id not in done]
    made = executor is None  # the sweep closes only the executor it makes
    executor = executor or LocalExecutor(local_slots(device), exclusive=spec.exclusive)
    session = executor.describe()
    RunFile(run_dir).update(lambda run: run.session(session))  # one per session (a resume adds one)
    try:
        _run_trials(spec, run_dir, device, trials, on_start, on_end, on_event, executor)
    except BaseException as exc:  # KeyboardInterrupt, Interrupted (SIGTERM, SIGHUP) or a bug: say so in run.json
        # first the worker still running and the preloaded parents (whoever owns them: a stopped run leaves no
        # process), then run.json, then (the CLI) the report of what finished, which takes seconds
        if made:
            executor.close()
        if isinstance(exc, (KeyboardInterrupt, Interrupted)):
            workers.close()
        mark_interrupted(run_dir, exc)
        exc.run_dir = run_dir  # type: ignore[attr-defined]
        raise
    finally:
        if made:
            executor.close()
    RunFile(run_dir).update(lambda run: run.finish(now()))
    return run_dir


class Interrupted(BaseException):
    """The orchestrator received SIGTERM or SIGHUP (a cancelled job, a closed terminal). Like KeyboardInterrupt it is
    not an Exception, so nothing on the way catches it by accident; the worker is killed on the way out."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def raise_on_signals(signums: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> None:
    """Makes SIGTERM and SIGHUP raise ``Interrupted`` in the main thread (call it from the main thread)."""
    def handler(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    for signum in signums:
        signal.signal(signum, handler)


def mark_interrupted(run_dir: Path, exc: BaseException) -> None:
    """Records in run.json why the run stopped before its end, which trials finished and which did not run; a later
    ``--resume`` moves this into ``interruptions`` and continues."""
    finished = [r.id for r in read_trials(run_dir)]
    why = (exc.args[0] if isinstance(exc, Interrupted) else "SIGINT (Ctrl-C)" if isinstance(exc, KeyboardInterrupt)
           else f"{type(exc).__name__}: {exc}"[:300])
    RunFile(run_dir).update(lambda run: run.interrupt(why, now(), finished))


def _run_trials(spec: Spec, run_dir: Path, device: str, trials: list[Trial],
                on_start: Callable[[Trial, int, int], None] | None,
                on_end: Callable[[Trial, TrialRecord], None] | None,
                on_event: Callable[[Event], None] | None, executor: Executor) -> None:
    """Runs ``trials`` in plan order on ``executor``, each record on disk
    before the next trial is dispatched once the executor is full (see run_spec). A trial whose built-in adapter
    cannot build the model is recorded ``unsupported`` without a worker (``unsupported_record``); one whose row
    already ran out of memory at a smaller batch size is ``skipped`` (``after_oom: skip``; with several trials in
    flight, a larger size already dispatched runs anyway). Each record of a worker's trial carries its
    ``placement``: node, device(s), pinned cores, start and end, and ``beside``: the trials that ran at the same
    time on the same node.

    Scheduling: strictly in plan order. The next trial starts when the executor has room for it (a data-parallel
    trial on N devices: N slots or GPUs, ``executor.has_room(N)``); until then no later trial starts, even one that
    would fit. So a data-parallel trial is never starved by one-device trials taking each slot as it frees (it gets
    the slots as the trials before it end), at the price of slots left idle while it waits for them; and nothing
    deadlocks, since no trial needs more than the executor has (``check_executor``, before the run). An
    ``exclusive`` spec has one trial in flight at a time, whatever ``executor.capacity`` allows."""
    capacity = 1 if spec.exclusive else executor.capacity
    oom_at = _oom_sizes(read_trials(run_dir))
    unsupported = {key: unsupported_reason(spec, key[0], key[1]) for key in {_support_key(t) for t in trials}}
    pending = list(enumerate(trials))
    spans: list[tuple[str, Placement]] = []  # the trials finished in this session and where, for ``beside``
    in_flight: dict[str, Trial] = {}  # trial id -> trial, for the trials the executor is running
    while pending or executor.running:
        while pending and _fits(executor, pending[0][1], capacity):
            index, trial = pending.pop(0)
            if on_start is not None:
                on_start(trial, index, len(trials))
            limit = oom_at.get((trial.row, trial.repeat, trial.variant))
            if (reason := unsupported[_support_key(trial)]) is not None:
                record = unsupported_record(trial, reason)
            elif spec.after_oom == "skip" and limit is not None and trial.batch_size > limit:
                record = skipped_record(trial, limit)
            else:
                executor.submit(trial.id, Payload(trial=trial), spec.timeout_s,
                                spec.sampler.interval_s, trial.threads, on_event=on_event)
                in_flight[trial.id] = trial
                continue
            append_trial(run_dir, record)
            if on_end is not None:
                on_end(trial, record)
        if not executor.running:
            if pending and not _fits(executor, pending[0][1], capacity):  # idle: room would never come
                executor.check(pending[0][1].data_parallel)
                raise RuntimeError(f"{pending[0][1].id}: the executor is idle and has no room for it")
            continue
        finished = executor.wait()
        trial = in_flight.pop(finished.key)
        record = _finished_record(run_dir, trial, finished, spans, executor)
        if record.status == "oom":
            key = (trial.row, trial.repeat, trial.variant)
            oom_at[key] = min(oom_at.get(key, trial.batch_size), trial.batch_size)
        if on_end is not None:
            on_end(trial, record)


def _fits(executor: Executor, trial: Trial, capacity: int) -> bool:
    """Whether ``trial`` may start now on ``executor``: fewer than ``capacity`` trials in flight (the executor's, or
    1 for an exclusive spec), and room for its devices."""
    return len(executor.running) < capacity and executor.has_room(trial.data_parallel)


def _finished_record(run_dir: Path, trial: Trial, finished: Finished, spans: list[tuple[str, Placement]],
                     executor: Executor) -> TrialRecord:
    """Writes the samples, events and record of a trial the executor ran (``finished``: its Finished) and returns
    the record (``harness.studies.records.trial_record``: with its ``placement``, and the device(s) it really ran
    on)."""
    outcome = finished.outcome
    placement = placement_record(finished.placement, spans, executor.running_here())
    record = trial_record(trial, outcome, placement)
    spans.append((trial.id, placement))
    write_lines(run_dir / "samples" / f"{trial.id}.jsonl", outcome.samples)
    write_events(run_dir / "events" / f"{trial.id}.jsonl", outcome.events)
    append_trial(run_dir, record)
    return record


def check_executor(spec: Spec, executor: Executor, spec_path: str | Path | None = None) -> None:
    """Raises SpecError (one line naming the file and the ``data_parallel`` field; the CLI exits 2) when a trial of
    ``spec`` needs more devices than ``executor`` can ever give it at once (``executor.check``: more slots than the
    local executor has, more GPUs than any Ray node). Stopping before the run, rather than recording such trials
    ``unsupported``, is what the user who gave the executor its slots (``--devices``, ``--parallel``) and the spec
    its device counts needs to hear: the two disagree, and a sweep without its largest device counts would measure
    no scaling at all."""
    for field, dp in data_parallel_settings(spec):
        if dp is None or dp.size == 1:
            continue
        try:
            executor.check(dp.size)
        except ExecutorError as err:
            raise SpecError(spec_path or "spec", field, f"{err}; give the executor more (--devices, --parallel) or "
                                                        "the trial fewer devices") from None


def _create(spec: Spec, out_root: str | Path, spec_path: str | Path | None,
            workers: Workers | None = None) -> tuple[Path, RunRecord, set[str]]:
    """A new run directory and its run.json (``harness.studies.records.new_run``: the machine, each framework entry's
    environment as its probe reported it, the resolved device, the planned trials). ``workers``: each probe runs in a
    child of the preloaded parent of it that its entry's first trial will fork from (``Workers.probe_entries``).
    Raises SpecError, with nothing written, when an entry's interpreter fails its probe."""
    env = machine.collect()
    device = resolve_device(spec.device, env["gpu"])
    check_devices(spec, spec_path or "spec", device, len(env["gpu"]["devices"]) if "devices" in env["gpu"] else None)
    trials = plan(spec, device)
    frameworks = (workers.probe_entries(spec, spec_path or "spec", device, trials) if workers is not None else
                  probe_entries(spec, spec_path or "spec", device))
    record = new_run(spec, spec_path, device, env, frameworks, [t.id for t in trials])
    run_dir = create_run_dir(out_root, spec.name)
    RunFile.create(run_dir, record)
    return run_dir, record, set()


def _reopen(spec: Spec, run_dir: Path, spec_path: str | Path | None,
            workers: Workers | None = None) -> tuple[Path, RunRecord, set[str]]:
    """An interrupted run directory, its run.json marked resumed, and the ids of its finished trials. Raises
    SpecError when ``spec`` differs from the one the run started with."""
    run_info = read_run(run_dir)
    differences = spec_differences(run_info.spec, spec.model_dump(mode="json"))
    if differences:
        raise SpecError(spec_path or "spec", "", f"cannot resume {run_dir}: the spec differs from the one it "
                                                 f"started with in {', '.join(differences[:8])}")
    device = run_info.device or resolve_device(spec.device)
    frameworks = (workers.probe_entries(spec, spec_path or "spec", device, plan(spec, device)) if workers is not None
                  else probe_entries(spec, spec_path or "spec", device))
    drop_torn_tail(run_dir / "trials.jsonl")
    probed = [FrameworkEnvironment.model_validate(entry) for entry in frameworks]
    record = RunFile(run_dir).update(lambda run: run.resume(now(), probed))
    return run_dir, record, {r.id for r in read_trials(run_dir)}


def _oom_sizes(records: list[TrialRecord]) -> dict[tuple[str, int, str], int]:
    """The smallest batch size that ran out of memory per (row label, repeat, variant), from finished trials."""
    oom_at: dict[tuple[str, int, str], int] = {}
    for finished in records:
        if finished.status == "oom":
            key = (finished.label, finished.repeat, finished.variant)
            oom_at[key] = min(oom_at.get(key, finished.batch_size), finished.batch_size)
    return oom_at


def _support_key(trial: Trial) -> tuple[str, Conditions]:
    """What decides whether a built-in adapter can run a trial (``harness.plan.unsupported_reason``'s arguments
    besides the spec): its entry and its conditions."""
    return trial.label or trial.framework, trial.conditions
