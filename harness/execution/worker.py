"""The worker process: one trial, one fresh interpreter, one framework.

Started by ``harness.execution.bootstrap`` with the trial's ``harness.execution.protocol.Payload``, ``run`` imports the
trial's adapter, builds the model from the canonical weights, loads the dataset to the device once, runs the shared
training loop (``train``) and writes events (``harness.execution.protocol``), one ``EVENT_PREFIX`` + JSON line each
stamped with ``time.monotonic()``, to the original standard output; the framework's output goes to standard error.

Design: docs/design/timing.md (epochs, warm-up and the first step, timed windows, the loss reads, recompilations).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TextIO, cast

import numpy as np

from harness.execution.protocol import Epoch, Error, ErrorKind, Payload, Phase, Ready, Result, Start, event_line
from harness.neutral.datasets import Data, augment, epoch_order
from harness.plan import Trial

if TYPE_CHECKING:
    from adapters.base import RunOptions
    from harness.execution.protocol import _Event
    from harness.spec import CompileMode, Spec

EXIT_OK, EXIT_FAILED = 0, 1


class TrialError(Exception):
    """A trial that cannot run as specified (the reason is user-facing)."""


SPIKE = 3.0  # a timed window whose per-step time exceeds this multiple of the median is counted slow


class Unsupported(TrialError):
    """The adapter cannot build this trial's model (``Adapter.unsupported``): the trial's status is ``unsupported``."""


class Events:
    """Writes events (``harness.execution.protocol``) to the launcher, one ``EVENT_PREFIX`` + JSON line each, stamped
    with ``time.monotonic()`` and flushed at once; keeps their records in ``log``. ``out``: a text stream, or None to
    keep them only in ``log``."""

    def __init__(self, out: TextIO | None):
        self._out = out
        self.log: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # a data-parallel trial's rank watchers emit from their threads

    def emit(self, event: _Event) -> dict[str, Any]:
        line, record = event_line(event, time.monotonic(), default=_jsonable)
        with self._lock:
            self.log.append(record)
            if self._out is not None:
                self._out.write(line)
                self._out.flush()
        return record


def _affinity() -> list[int] | None:
    """The CPUs this process may run on (its affinity mask), or None where the platform does not tell."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def train(adapter: Any, data: Any, trial: Trial, emit: Callable[[_Event], Any]) -> dict[str, Any]:
    """The shared training loop (docs/design/timing.md). Returns the trial's training metrics.

    adapter: a prepared, built and loaded Adapter. data: harness.neutral.datasets.Data. trial: the payload's trial
    (its micro_batch_size, samples_per_step and accumulation_steps as the plan computed them; epochs, warmup_steps,
    seed, timing, augmentation, evaluate_every, target_accuracy; max_steps_per_epoch cuts every epoch to its first
    steps: ``harness max-batch --with-dataset`` probes with the whole dataset resident but no whole epoch). emit:
    Events.emit. Times are in seconds
    (perf_counter); throughput is in samples per second. Raises TrialError when the batch size exceeds the training
    set or warm-up leaves no step to measure.
    """
    return _Loop(adapter, data, trial, emit).run()


class _Loop:
    """The state of one training run: the step counts, the timed windows so far and the epoch records."""

    def __init__(self, adapter: Any, data: Any, trial: Trial, emit: Callable[[_Event], Any]):
        self.adapter, self.data, self.emit = adapter, data, emit
        self.micro = trial.micro_batch_size
        self.devices = trial.data_parallel
        self.accumulation = trial.accumulation_steps
        self.batch = trial.samples_per_step  # samples per optimizer step, as the plan computed it
        self.epochs, self.warmup = trial.epochs, trial.warmup_steps
        self.timing, self.seed = trial.timing, trial.seed
        self.augmentation = trial.augmentation
        self.evaluate_every = trial.evaluate_every
        self.target = trial.target_accuracy
        self.n = len(data.y_train)
        self.steps_per_epoch = self.n // self.batch
        if trial.max_steps_per_epoch:  # a max-batch probe holding the whole dataset: its first steps only
            self.steps_per_epoch = min(self.steps_per_epoch, trial.max_steps_per_epoch)
        if self.steps_per_epoch == 0:
            what = (f"batch size {self.micro}" if self.accumulation == 1 else
                    f"effective batch size {self.batch} ({self.accumulation} x {self.micro})")
            raise TrialError(f"{what} exceeds the {self.n} training samples")
        if self.warmup >= self.steps_per_epoch * self.epochs:
            raise TrialError(f"warmup_steps {self.warmup} leaves none of the {self.steps_per_epoch * self.epochs} "
                             "steps to measure")
        self.step_seconds: list[float] = []  # per-step time of each window (window time / its steps)
        self.step_estimate: float | None = None  # seconds per step, from the last synced period (auto windows)
        self.measured_seconds = 0.0
        self.measured_steps = 0
        self.epoch_records: list[dict[str, Any]] = []
        self.nonfinite = False
        self.reached: dict[str, Any] | None = None
        self.warm = self.warmup == 0
        self.first_step_seconds: float | None = None  # the first warm-up step, synced on both sides (see warm_up)
        self.compilations_warm: int | None = None  # the adapter's compilation count when warm-up ended
        self.epoch, self.position = 0, 0  # where training is: the epoch and the step within it
        self.order = np.arange(0)  # the epoch's sample order (begin_epoch)
        self.loader = trial.input == "loader"  # each step's batch from the adapter's data loader (epoch_batches)
        self.batches: Iterator[Any] = iter(())  # the epoch's loader batches
        self.fetch_seconds = 0.0  # time spent waiting for the loader's next batch, every step's
        self.input_wait_seconds = 0.0  # of that, inside the timed windows

    def step(self, order: np.ndarray, position: int) -> None:
        if self.loader:  # the wait for the batch, timed alone: the input pipeline's share of the step
            start = time.perf_counter()
            batch = next(self.batches)
            self.fetch_seconds += time.perf_counter() - start
            self.adapter.train_batch(batch, micro_batches=self.accumulation)
            return
        indices = order[position * self.batch:(position + 1) * self.batch]
        self.adapter.train_step(indices, micro_batches=self.accumulation, position=position)

    def run(self) -> dict[str, Any]:
        train_started = time.perf_counter()
        self.adapter.wait()
        if self.warm:
            self.adapter.reset_memory_stats()
            self.compilations_warm = self.adapter.compilations()
        else:
            self.emit(Phase(name="warmup", edge="start"))
        first = 0
        while first < self.epochs:  # the epochs up to the next evaluation: a segment
            last = min(self.epochs, (first // self.evaluate_every + 1) * self.evaluate_every) - 1
            losses: list[tuple[float, int]] = []  # the loss reads: (mean, steps)
            seconds = self.train_segment(first, last, losses)
            self.nonfinite = self.nonfinite or not all(math.isfinite(mean) for mean, steps in losses if steps)
            self.evaluate(last, losses, seconds, train_started)
            first = last + 1
        return self.metrics()

    def begin_epoch(self, epoch: int) -> None:
        """The epoch's order, staged (``Adapter.stage_epoch``), and its augmented images when augmenting."""
        self.epoch, self.position = epoch, 0
        self.order = epoch_order(self.n, self.seed, epoch)
        if self.loader:  # the loader reads (and augments) the epoch's samples itself
            self.batches = iter(self.adapter.epoch_batches(self.order[:self.steps_per_epoch * self.batch],
                                                           self.batch, epoch))
            return
        self.adapter.stage_epoch(self.order, self.batch)
        if self.augmentation:
            self.augment(epoch)

    def train_segment(self, first: int, last: int, losses: list[tuple[float, int]]) -> float:
        """Epochs ``first`` to ``last``: what is left of warm-up, then timed windows; returns their seconds."""
        self.begin_epoch(first)
        while not self.warm:
            self.position = self.warm_up(self.epoch, self.order, losses)
            if self.position == self.steps_per_epoch:
                if self.epoch == last:
                    return 0.0
                self.begin_epoch(self.epoch + 1)
        return self.timed(last, losses)

    def augment(self, epoch: int) -> None:
        """This epoch's augmented training images, loaded to the device outside the timed windows."""
        self.emit(Phase(name="augment", epoch=epoch, edge="start"))
        self.adapter.set_train_images(augment(self.data.train_images, self.seed, epoch))
        self.adapter.wait()
        self.emit(Phase(name="augment", epoch=epoch, edge="end"))

    def warm_up(self, epoch: int, order: np.ndarray, losses: list[tuple[float, int]]) -> int:
        """The warm-up steps still left, at the start of this epoch; returns the position after them."""
        count = min(self.warmup - epoch * self.steps_per_epoch, self.steps_per_epoch)
        self.adapter.wait()
        start = time.perf_counter()
        first = 0
        if epoch == 0 and count:  # the trial's first step alone: tracing, compilation, autotuning, first allocations
            self.step(order, 0)
            self.adapter.wait()
            self.first_step_seconds = time.perf_counter() - start
            first = 1
        for position in range(first, count):
            self.step(order, position)
        losses.append(self.adapter.read_loss())  # the warm-up steps' mean, the first step's included
        if count:  # compilation included: an estimate on the high side, so the first window errs short
            self.step_estimate = (time.perf_counter() - start) / count
        if epoch * self.steps_per_epoch + count == self.warmup:
            self.warm = True
            self.emit(Phase(name="warmup", edge="end"))
            self.adapter.reset_memory_stats()
            self.compilations_warm = self.adapter.compilations()
        return count

    def window_steps(self, left: int) -> int:
        """The steps of the next timed window when ``left`` steps remain before the next evaluation (or the epoch's
        end, when augmenting): ``timing.window`` (``harness.spec.TimingSpec``; docs/design/timing.md)."""
        window = self.timing.window
        if window == "step":
            return 1
        if window != "auto":
            return min(int(window), left)
        least = self.timing.min_window_steps
        steps = least if not self.step_estimate else max(least, math.ceil(self.timing.window_seconds
                                                                         / self.step_estimate))
        # every rank of a multi-process data-parallel trial times the same steps: rank 0's choice (Adapter.agree)
        return self.adapter.agree(left if left - steps < least else steps)

    def timed(self, last: int, losses: list[tuple[float, int]]) -> float:
        """The rest of the segment in timed windows, synced at both edges; returns their seconds. Without
        augmentation a window runs on across the ends of epochs before ``last`` (the next epoch's order is made and
        staged inside it, as a training loop shuffles between epochs); with it, a window ends with its epoch (the
        augmented images are loaded between). Each window's clock stops when the device has done its work
        (``Adapter.wait``); the loss is read after that (``Adapter.read_loss``: the mean of the window's steps and
        their count), outside the clock, and the next window's clock starts after the read (reading a loss is the
        harness's own work: in MXNet a sum operator and an engine round trip, about 0.5 ms on this project's CPU)."""
        self.adapter.wait()
        self.emit(Phase(name="train", epoch=self.epoch, edge="start"))
        total = 0.0
        while True:
            left = self.steps_per_epoch - self.position
            if not self.augmentation or self.loader:  # a loader augments as it reads: windows run on
                left += (last - self.epoch) * self.steps_per_epoch
            count = self.window_steps(left)
            fetched = self.fetch_seconds
            start = time.perf_counter()
            for _ in range(count):
                if self.position == self.steps_per_epoch:
                    self.begin_epoch(self.epoch + 1)
                self.step(self.order, self.position)
                self.position += 1
            self.adapter.wait()
            seconds = time.perf_counter() - start
            self.input_wait_seconds += self.fetch_seconds - fetched
            losses.append(self.adapter.read_loss())  # the device is idle: only the read
            self.step_estimate = seconds / count
            self.step_seconds.append(self.step_estimate)
            self.measured_steps += count
            total += seconds
            if self.position == self.steps_per_epoch:
                if self.epoch == last:
                    break
                self.emit(Phase(name="train", epoch=self.epoch, edge="end"))
                self.begin_epoch(self.epoch + 1)  # augmenting: the epoch's images load between two windows
                self.adapter.wait()
                self.emit(Phase(name="train", epoch=self.epoch, edge="start"))
        self.emit(Phase(name="train", epoch=self.epoch, edge="end"))
        self.measured_seconds += total
        return total

    def evaluate(self, epoch: int, losses: list[tuple[float, int]], epoch_seconds: float,
                 train_started: float) -> None:
        """The test set after epoch ``epoch`` (outside the timed windows), its record and time to the target. With
        ``evaluate_every`` k > 1 this follows every k-th epoch and the last. ``losses``: the loss reads since the
        evaluation before, (mean, steps) each; the record's ``train_loss`` is their mean weighted by steps, the mean
        over every step (``train_loss_steps`` of them; nan when none), and ``timed_seconds`` the timed seconds since
        the evaluation before."""
        self.emit(Phase(name="eval", epoch=epoch, edge="start"))
        test_loss, test_accuracy = self.adapter.evaluate(self.micro)
        self.emit(Phase(name="eval", epoch=epoch, edge="end"))
        if self.target is not None and self.reached is None and test_accuracy >= self.target:
            # training_seconds: timed training only (warm-up steps and evaluations excluded);
            # wall_seconds: from the first step to the end of this evaluation, everything included.
            self.reached = {"epochs": epoch + 1, "training_seconds": self.measured_seconds,
                            "wall_seconds": time.perf_counter() - train_started}
        steps = sum(count for _, count in losses)
        train_loss = sum(mean * count for mean, count in losses if count) / steps if steps else math.nan
        record = {"epoch": epoch, "train_loss": train_loss, "train_loss_steps": steps,
                  "test_loss": test_loss, "test_accuracy": test_accuracy, "timed_seconds": epoch_seconds}
        self.epoch_records.append(record)
        self.emit(Epoch(**record))

    def metrics(self) -> dict[str, Any]:
        throughput = self.measured_steps * self.batch / self.measured_seconds
        per_step = np.asarray(self.step_seconds)
        last = self.epoch_records[-1]
        return {
            "steps_per_epoch": self.steps_per_epoch,
            "total_steps": self.steps_per_epoch * self.epochs,
            "measured_steps": self.measured_steps,
            "measured_samples": self.measured_steps * self.batch,
            "measured_seconds": self.measured_seconds,
            "throughput": throughput,
            "seconds_per_epoch": self.steps_per_epoch * self.batch / throughput,
            # over windows: each window's duration over its steps (per step in latency mode, window: step)
            "step_time_median_s": float(np.median(per_step)),
            "step_time_p90_s": float(np.percentile(per_step, 90)),
            "step_time_max_s": float(per_step.max()),
            # windows whose steps took more than SPIKE x the median: a recompilation (a shape or a guard the
            # compiled step had not seen), a garbage collection, or the machine's noise; the report names them
            "slow_windows": int(np.sum(per_step > SPIKE * np.median(per_step))),
            "timed_windows": len(self.step_seconds),
            # input: loader: the time the timed steps waited for the loader's next batch (the shared loop's clock
            # around each ``next``), and its share of the timed seconds; resident: no wait is timed (0)
            "input": "loader" if self.loader else "resident",
            "input_wait_seconds": self.input_wait_seconds,
            "input_wait_share": self.input_wait_seconds / self.measured_seconds,
            "timing_window": self.timing.window,
            "final_train_loss": last["train_loss"],
            "test_loss": last["test_loss"],
            "test_accuracy": last["test_accuracy"],
            "nonfinite_loss": self.nonfinite,
            "batch_size": self.micro,
            "data_parallel": self.devices,
            "per_device_batch_size": self.micro // self.devices,
            "accumulation_steps": self.accumulation,
            "effective_batch_size": self.batch,
            "target_accuracy": self.target,
            "time_to_target": self.reached,
            "epochs": self.epoch_records,
            "memory": self.adapter.memory_stats(),
            "first_step_seconds": self.first_step_seconds,
            # the framework's own count of traced/compiled train step graphs (Adapter.compilations): by the end of
            # warm-up, and how many more came inside the timed windows (None where the framework keeps no count)
            "compilations_warmup": self.compilations_warm,
            "recompilations": (None if self.compilations_warm is None or (end := self.adapter.compilations()) is None
                               else end - self.compilations_warm),
        }


def run_options(adapter: Any, spec: Spec, trial: Trial, mode: str, rank: int = 0) -> RunOptions:
    """``Adapter.options``, built once: the trial's precision, ``mode`` (its compile mode as the adapter resolved it)
    and memory limit, and the spec's allocator settings that the adapter's declaration names
    (``Declaration.allocator_options``; the others keep their defaults, and all do for an adapter without one); for a
    data-parallel trial its devices, this process's ``rank`` and how many processes share them."""
    from adapters.base import RunOptions
    from harness.spec import AllocatorSpec

    declared = getattr(adapter, "declaration", None)
    allocator = AllocatorSpec(**{option: getattr(spec.allocator, option) for option in
                                 (declared.allocator_options if declared is not None else ())})
    data_parallel = None
    if trial.data_parallel > 1:
        from adapters.base import DataParallel

        processes = trial.data_parallel if declared is not None and declared.data_parallel == "processes" else 1
        data_parallel = DataParallel(devices=trial.devices, processes=processes, rank=rank,
                                     sync_batchnorm=trial.sync_batchnorm)
    return RunOptions(precision=trial.precision, compile=cast("CompileMode", mode),
                      memory_limit_bytes=trial.memory_limit_bytes, allocator=allocator, data_parallel=data_parallel,
                      input=trial.input, loader=trial.loader)


def _cannot_train(adapter: Any, info: Any, trial: Trial) -> str | None:
    """Why the adapter cannot train the model ``info`` in this trial (``Adapter.unsupported``, then its declaration's
    data-parallel and input gaps), or None."""
    from adapters.base import data_parallel_gap, input_gap

    return adapter.unsupported(info) or data_parallel_gap(
        adapter.declaration, info, trial.data_parallel, trial.sync_batchnorm, trial.device) or input_gap(
        adapter.declaration, trial.input, trial.data_parallel)


def _load(adapter: Any, spec: Spec, trial: Trial, data: Data) -> None:
    """``Adapter.load``; with ``input: loader`` then ``Adapter.open_loader`` over the trial's training set
    (``harness.neutral.inputs.for_dataset``: an image folder's files, else host memory), augmented by the loader's
    reads when the trial augments."""
    adapter.load(data)
    if trial.input == "loader":
        from harness.neutral import inputs

        adapter.open_loader(inputs.for_dataset(spec.dataset, data, trial.augmentation, trial.seed))


def _data_metrics(data: Data) -> dict[str, int]:
    """``data_bytes``: bytes of the dataset's arrays; for a dataset read from image files, ``data_skipped_files``: the
    unreadable files left out (``ImageFolderData.on_bad_file: skip``)."""
    out = {"data_bytes": int(data.nbytes)}
    if data.skipped_files is not None:
        out["data_skipped_files"] = len(data.skipped_files)
    return out


def run(payload: Payload | dict[str, Any], events: Events) -> int:
    """Runs one trial end to end and reports it through ``events``. ``payload``: the Payload, or its JSON data
    (validated here). Returns the process exit status."""
    adapter = None
    try:
        from harness.neutral import datasets, models

        payload = payload if isinstance(payload, Payload) else Payload.model_validate(payload)
        trial, spec = payload.trial, payload.spec
        events.emit(Start(pid=os.getpid(), framework=trial.framework, batch_size=trial.micro_batch_size,
                          python=sys.executable, affinity=_affinity()))
        adapter, ranks, rank = _adapter(payload, events)
        if trial.device == "cpu" and trial.memory_limit_bytes:
            from harness.execution.limits import apply_cpu_memory_limit  # see there for what the limit means on the CPU

            apply_cpu_memory_limit(trial.memory_limit_bytes, getattr(adapter, "declaration", None),
                                   emit=events.emit, allocator_peak=adapter.cpu_allocator_peak)
        precision = trial.precision
        if (why := adapter.unsupported_execution(precision, trial.compile, trial.device)) is not None:
            raise Unsupported(why)  # before the framework touches the device
        mode = adapter.compile_mode(trial.compile)  # "default" resolved to the adapter's own mode
        adapter.options = run_options(adapter, spec, trial, mode, rank)
        threads = trial.threads
        if adapter.options.data_parallel is not None and adapter.options.data_parallel.processes > 1:
            threads = max(1, threads // trial.data_parallel)  # the trial's threads shared by its ranks
        adapter.prepare(trial.device, threads, trial.seed)  # a rank's own device is in its options
        info = models.analyze(spec.model, *datasets.describe_input(spec.dataset))
        if (why := _cannot_train(adapter, info, trial)) is not None:
            raise Unsupported(why)  # before the data is loaded and anything is built
        # a loader reads an image folder's training images from their files: they are not held here as well
        data = datasets.load(spec.dataset, seed=trial.seed, train_images=trial.input == "resident")
        optimizer = (trial.optimizer or spec.optimizer).model_copy(update={"learning_rate": trial.learning_rate})
        adapter.build(info, models.initial_weights(info, trial.seed), optimizer)
        _load(adapter, spec, trial, data)
        adapter.wait()
        events.emit(Ready(versions=adapter.versions(), settings=adapter.settings()))
        metrics = train(adapter, data, trial, events.emit)
        metrics.update({
            "memory_predicted": _predicted_memory(info, trial, optimizer, adapter.ATTENTION),
            "parameter_count": info.parameter_count,
            "train_flops_per_sample": info.train_flops_per_sample,
            "achieved_flops": metrics["throughput"] * info.train_flops_per_sample,
            **_data_metrics(data),
            "precision": precision,
            "compile": mode,
            "compile_meaning": adapter.COMPILE_MODES.get(mode, ""),
        })
        if trial.data_parallel > 1:
            metrics.update({"devices": list(trial.devices), "sync_batchnorm": trial.sync_batchnorm,
                            "data_parallel_mechanism": adapter.declaration.data_parallel_mechanism})
        if ranks is not None:
            ranks.close()  # a rank that failed ends the trial here, before the result
        events.emit(Result(metrics=metrics, versions=adapter.versions(), settings=adapter.settings()))
        return EXIT_OK
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the process exits non-zero
        oom = False
        if adapter is not None:
            try:
                oom = adapter.is_oom(exc)
            except Exception:  # noqa: BLE001 - a broken classifier must not hide the original error
                oom = False
        # Python's own MemoryError is an out-of-memory too: an allocation outside the framework's allocator (numpy,
        # a lazily imported module) failing, typically under a CPU memory cap (harness.execution.limits).
        oom = oom or isinstance(exc, MemoryError)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = reason if isinstance(exc, TrialError) else f"{type(exc).__name__}: {reason}".rstrip(": ")
        kind: ErrorKind = "unsupported" if isinstance(exc, Unsupported) else "oom" if oom else "error"
        events.emit(Error(kind=kind, reason=reason[:500], traceback="".join(traceback.format_exception(exc))[-4000:]))
        return EXIT_FAILED


def _predicted_memory(info: Any, trial: Trial, optimizer: Any, attention: str) -> dict[str, Any]:
    """``harness.neutral.memory.predict`` of one device's training step (the per-device batch), as recorded."""
    from harness.neutral import memory

    predicted = memory.predict(info, trial.per_device_batch_size, optimizer, trial.accumulation_steps,
                               attention=attention)
    return {part: getattr(predicted, part) for part in memory.PARTS} | {
        "activations_per_sample": predicted.activations_per_sample, "total": predicted.total,
        "attention": predicted.attention}


def _adapter(payload: Payload, events: Events) -> tuple[Any, Any, int]:
    """The trial's adapter, made after a data-parallel trial's environment is set and its ranks started
    (``_data_parallel_start``; a built-in adapter's declaration is read before its framework is imported, that of
    an adapter of HARNESS_ADAPTERS from its class). Returns (adapter, the started ranks or None, this process's
    rank). Raises TrialError when the framework is not installed."""
    import adapters

    trial = payload.trial
    ranks, rank = None, 0
    if trial.data_parallel > 1 and (declared := adapters.declaration(trial.framework)) is not None:
        ranks, rank = _data_parallel_start(declared, payload, events)
    try:
        adapter = adapters.get(trial.framework)()
    except ImportError as err:
        raise TrialError(f"{trial.framework} is not installed here ({err})") from None
    if trial.data_parallel > 1 and adapters.declaration(trial.framework) is None:
        ranks, rank = _data_parallel_start(adapter.declaration, payload, events)
    return adapter, ranks, rank


def _data_parallel_start(declared: Any, payload: Payload, events: Events) -> tuple[Any, int]:
    """Before the framework is imported: sets the declaration's ``data_parallel_environment`` and, for a
    one-process-per-device framework, starts ranks 1..N-1 (``harness.execution.ranks``) when this process is rank
    0, the worker the launcher started. Returns (the started ranks or None, this process's rank). A rank that fails
    ends the trial: rank 0 reports it (``Error``, the rank's reason) and kills its process group."""
    from harness.execution.ranks import Ranks, bootstrap_argv, rank_environment, this_rank

    trial = payload.trial
    if declared is None:
        return None, 0
    os.environ.update(declared.data_parallel_variables(trial.data_parallel, os.environ))
    if declared.data_parallel != "processes":
        return None, 0
    mine = this_rank()
    if mine is not None:
        return None, mine[0]

    def failed(failure: Any) -> None:
        error = failure.error or {}
        reason = error.get("reason") or f"exited with status {failure.returncode}"
        kind: ErrorKind = error["kind"] if error.get("kind") in ("oom", "unsupported", "error") else "error"
        events.emit(Error(kind=kind, reason=f"rank {failure.rank}: {reason}"[:500],
                          traceback=str(error.get("traceback", ""))[-4000:]))
        _end_group()

    ranks = Ranks(argv=bootstrap_argv(), world=trial.data_parallel, on_failure=failed,
                  stdin_line=payload.model_copy(update={"launcher_pid": None}).model_dump_json())
    os.environ.update({k: v for k, v in rank_environment(0, trial.data_parallel, ranks.port).items()
                       if k != "HARNESS_RANK_OF"})
    ranks.start()
    return ranks, 0


def _end_group() -> None:
    """Kills this process's group when it leads one (the launcher starts each worker in its own session, so the group
    is the trial's ranks), else this process."""
    try:
        if os.getpgid(0) == os.getpid():
            os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(EXIT_FAILED)
