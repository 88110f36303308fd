"""The worker process: one trial, one fresh interpreter, one framework.

Started by ``harness.execution.bootstrap`` with the trial's ``harness.execution.protocol.Payload``, ``run`` asks the
plan whether the adapter can train the trial (``harness.plan.support``), makes the adapter with the trial's options,
builds the model from the canonical weights, loads the dataset to the device once, runs the shared training loop
(``harness.execution.loop.train``) and writes events (``harness.execution.protocol``), one ``EVENT_PREFIX`` + JSON
line each stamped with ``time.monotonic()``, to the original standard output; the framework's output goes to standard
error.

Design: docs/design/timing.md (epochs, warm-up and the first step, timed windows, the loss reads, recompilations).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from harness.execution.loop import TrialError, train
from harness.execution.protocol import Error, ErrorKind, Payload, Phase, Ready, Result, Start, event_line
from harness.neutral import native
from harness.neutral.info import Input, ModelInfo
from harness.plan import Trial
from harness.plan.support import NativeTask
from harness.record.metrics import DataParallelism, PredictedMemory, TrialMetrics

if TYPE_CHECKING:
    from adapters.base import Adapter, RunOptions
    from adapters.declaration import Declaration
    from harness.execution.protocol import _Event
    from harness.execution.ranks import Ranks
    from harness.neutral.datasets import Data
    from harness.spec import NativeModel, OptimizerSpec

EXIT_OK, EXIT_FAILED = 0, 1


class Unsupported(TrialError):
    """The adapter cannot train this trial (``harness.plan.support``): the trial's status is ``unsupported``."""


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


def run_options(declaration: Declaration, trial: Trial, rank: int = 0) -> RunOptions:
    """The adapter's ``RunOptions``, built once: the trial's precision, compile mode (resolved by the declaration)
    and memory limit, and the trial's allocator settings that the declaration names (``Environment.allocator_options``;
    the others keep their defaults); for a data-parallel trial its devices, this process's ``rank`` and how many
    processes share them."""
    from adapters.base import DataParallel, RunOptions
    from harness.spec import AllocatorSpec

    allocator = AllocatorSpec(**{option: getattr(trial.allocator, option)
                                 for option in declaration.environment.allocator_options})
    data_parallel = None
    if trial.data_parallel > 1:
        processes = trial.data_parallel if declaration.data_parallel.kind == "processes" else 1
        data_parallel = DataParallel(devices=trial.devices, processes=processes, rank=rank,
                                     sync_batchnorm=trial.sync_batchnorm)
    return RunOptions(precision=trial.precision, compile=trial.compile, memory_limit_bytes=trial.memory_limit_bytes,
                      allocator=allocator, data_parallel=data_parallel, input=trial.input, loader=trial.loader,
                      compilation_cache=trial.compilation_cache)


def cannot_train(declaration: Declaration, info: ModelInfo | NativeTask, trial: Trial) -> str | None:
    """Why the adapter of ``declaration`` cannot train the model ``info`` in this trial, as the plan decides it
    (``harness.plan.support.unsupported``), or None."""
    from harness.plan.support import unsupported

    return unsupported(declaration, info, trial.conditions)


def _load(adapter: Adapter, trial: Trial, data: Data) -> None:
    """``Adapter.load``; with ``input: loader`` then ``Adapter.open_loader`` over the trial's training set
    (``harness.neutral.inputs.for_dataset``: an image folder's files, else host memory), augmented by the loader's
    reads when the trial augments."""
    adapter.load(data)
    if trial.input == "loader":
        from harness.neutral import inputs

        adapter.open_loader(inputs.for_dataset(trial.dataset, data, trial.augmentation, trial.seed))


def _data_metrics(data: Data) -> dict[str, int]:
    """``data_bytes``: bytes of the dataset's arrays; for a dataset read from image files, ``data_skipped_files``: the
    unreadable files left out (``ImageFolderData.on_bad_file: skip``). Fields of ``TrialMetrics``."""
    out = {"data_bytes": int(data.nbytes)}
    if data.skipped_files is not None:
        out["data_skipped_files"] = len(data.skipped_files)
    return out


def run(payload: Payload | dict[str, Any], events: Events) -> int:
    """Runs one trial end to end and reports it through ``events``. ``payload``: the Payload, or its JSON data
    (validated here). Returns the process exit status."""
    adapter: Adapter | None = None
    try:
        from harness.neutral import datasets, models

        payload = payload if isinstance(payload, Payload) else Payload.model_validate(payload)
        trial = payload.trial
        events.emit(Start(pid=os.getpid(), framework=trial.framework, batch_size=trial.micro_batch_size,
                          python=sys.executable, affinity=_affinity()))
        feed, classes = datasets.describe_input(trial.dataset)
        info = trial.trained_model()  # the neutral model's analysis, or a model of your own's task
        events.emit(Phase(name="import", edge="start"))
        cls, ranks, rank = _adapter_class(payload, info, events)
        events.emit(Phase(name="import", edge="end"))
        adapter = cls(run_options(cls.declaration, trial, rank))
        if trial.device == "cpu" and trial.memory_limit_bytes:
            from harness.execution.limits import apply_cpu_memory_limit  # see there for what the limit means on the CPU

            apply_cpu_memory_limit(trial.memory_limit_bytes, cls.declaration, emit=events.emit,
                                   allocator_peak=adapter.cpu_allocator_peak)
        threads = trial.threads
        if adapter.options.data_parallel is not None and adapter.options.data_parallel.processes > 1:
            threads = max(1, threads // trial.data_parallel)  # the trial's threads shared by its ranks
        adapter.prepare(trial.device, threads, trial.seed)  # a rank's own device is in its options
        # a loader reads an image folder's training images from their files: they are not held here as well
        events.emit(Phase(name="data", edge="start"))
        data = datasets.load(trial.dataset, seed=trial.seed, train_images=trial.input == "resident")
        events.emit(Phase(name="data", edge="end"))
        events.emit(Phase(name="build", edge="start"))
        optimizer = trial.training_optimizer
        if isinstance(info, ModelInfo):
            adapter.build_neutral(info, models.initial_weights(info, trial.seed), optimizer)
        else:
            assert trial.native_model is not None  # trained_model gives a NativeTask for a model of your own
            source = _native_source(cls.declaration, trial.native_model, feed, classes, trial.seed)
            adapter.build(adapter.native_model(native.make(trial.native_model, trial.seed), source), info.task,
                          optimizer)
        _load(adapter, trial, data)
        adapter.wait()
        events.emit(Phase(name="build", edge="end"))
        events.emit(Ready(versions=adapter.versions(), settings=adapter.settings().record()))
        measured = train(adapter, data, trial, events.emit)
        metrics = _metrics(adapter, info, trial, optimizer, measured, data)
        if ranks is not None:
            ranks.close()  # a rank that failed ends the trial here, before the result
        events.emit(Result(metrics=metrics, versions=adapter.versions(), settings=adapter.settings().record()))
        return EXIT_OK
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the process exits non-zero
        events.emit(_failure(adapter, exc))
        return EXIT_FAILED


def _metrics(adapter: Adapter, info: Any, trial: Any, optimizer: Any, measured: Any, data: Any) -> TrialMetrics:
    """The trial's metrics: the training loop's measurements with the model's, the data's and the trial's settings."""
    modes = type(adapter).declaration.capabilities.compile_modes
    added: dict[str, Any] = {**_model_metrics(adapter, info, trial, optimizer, measured), **_data_metrics(data),
                             "precision": trial.precision, "compile": adapter.mode,
                             "compile_meaning": modes.get(adapter.mode, "")}
    if trial.data_parallel > 1:
        added["data_parallelism"] = DataParallelism(devices=list(trial.devices), sync_batchnorm=trial.sync_batchnorm,
                                                    mechanism=type(adapter).declaration.data_parallel.mechanism)
    return TrialMetrics.model_validate({**measured.model_dump(exclude_unset=True), **added})


def _failure(adapter: Adapter | None, exc: BaseException) -> Error:
    """The error event for a trial that raised ``exc``: out-of-memory as the adapter classifies it (or Python's
    MemoryError), unsupported, or another error; the reason's first line and the traceback's end."""
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
    return Error(kind=kind, reason=reason[:500], traceback="".join(traceback.format_exception(exc))[-4000:])


def _native_source(declaration: Declaration, model: NativeModel, feed: Input, classes: int,
                   seed: int) -> native.NativeSource:
    """What the adapter needs to adopt the trial's model of your own; for a family that starts every backend from the
    same weights (``Family.shared_weights``), the weights file, drawn now unless it exists
    (``harness.neutral.native.draw_shared_weights``, in this interpreter)."""
    from harness.neutral.data import cache_folder

    weights, family = None, declaration.family
    if family.shared_weights:
        path = native.shared_weights_path(family.name or declaration.name, model, feed, classes, seed, cache_folder())
        weights = native.draw_shared_weights(family.shared_weights, model, feed, classes, seed, path)
    return native.NativeSource(model.factory, feed, classes, seed, weights)


def _model_metrics(adapter: Adapter, info: ModelInfo | NativeTask, trial: Trial, optimizer: OptimizerSpec,
                   measured: TrialMetrics) -> dict[str, Any]:
    """What the record says of the model: its source, parameter count, training FLOPs per sample (the neutral model's
    counted per layer; a model of your own's by the framework's counter, ``Adapter.train_flops_per_sample``, or None
    with the reason) and the achieved FLOP/s; the neutral model's predicted memory."""
    if isinstance(info, ModelInfo):
        flops: int | None = info.train_flops_per_sample
        out: dict[str, Any] = {
            "model_source": "neutral", "parameter_count": info.parameter_count, "flops_source": "the neutral model's "
            "layers (harness.neutral.info)",
            "memory_predicted": _predicted_memory(info, trial, optimizer, adapter.declaration.capabilities.attention)}
    else:
        flops, counted_by = adapter.train_flops_per_sample()
        out = {"model_source": "native", "parameter_count": int(sum(w.size for w in adapter.get_weights().values())),
               "flops_source": counted_by}
    throughput = measured.throughput_samples_per_s
    return {**out, "train_flops_per_sample": flops,
            "achieved_flops_per_s": None if throughput is None or flops is None else throughput * flops}


def _predicted_memory(info: ModelInfo, trial: Trial, optimizer: OptimizerSpec, attention: str) -> PredictedMemory:
    """``harness.neutral.memory.predict`` of one device's training step (the per-device batch), as recorded."""
    from harness.neutral import memory

    predicted = memory.predict(info, trial.per_device_batch_size, optimizer, trial.accumulation_steps,
                               attention=attention)
    return PredictedMemory(**{f"{part}_bytes": getattr(predicted, part) for part in memory.PARTS},
                           activations_per_sample_bytes=predicted.activations_per_sample,
                           total_bytes=predicted.total, attention=predicted.attention)


def _adapter_class(payload: Payload, info: ModelInfo | NativeTask,
                   events: Events) -> tuple[type[Adapter], Ranks | None, int]:
    """The trial's adapter class, once the plan's rule (``cannot_train``) accepts the trial: for a built-in adapter
    from its declaration before the framework is imported, for an adapter of HARNESS_ADAPTERS from its class; a
    data-parallel trial's environment is set and its ranks started (``_data_parallel_start``) before the import.
    Returns (class, the started ranks or None, this process's rank). Raises Unsupported, and TrialError when the
    framework is not installed."""
    import adapters

    trial = payload.trial
    declared = adapters.declaration(trial.framework)
    if declared is not None and (why := cannot_train(declared, info, trial)) is not None:
        raise Unsupported(why)  # before the framework is imported
    ranks, rank = None, 0
    if trial.data_parallel > 1 and declared is not None:
        ranks, rank = _data_parallel_start(declared, payload, events)
    try:
        cls = adapters.get(trial.framework)
    except ImportError as err:
        raise TrialError(f"{trial.framework} is not installed here ({err})") from None
    if declared is None:
        if (why := cannot_train(cls.declaration, info, trial)) is not None:
            raise Unsupported(why)
        if trial.data_parallel > 1:
            ranks, rank = _data_parallel_start(cls.declaration, payload, events)
    return cls, ranks, rank


def _data_parallel_start(declared: Declaration, payload: Payload, events: Events) -> tuple[Ranks | None, int]:
    """Before the framework is imported: sets the declaration's ``DataParallelism.environment`` and, for a
    one-process-per-device framework, starts ranks 1..N-1 (``harness.execution.ranks``) when this process is rank
    0, the worker the launcher started. Returns (the started ranks or None, this process's rank). A rank that fails
    ends the trial: rank 0 reports it (``Error``, the rank's reason) and kills its process group."""
    from harness.execution.entry import worker_command
    from harness.execution.ranks import Ranks, rank_environment, this_rank

    trial = payload.trial
    os.environ.update(declared.data_parallel.variables(trial.data_parallel, os.environ))
    if declared.data_parallel.kind != "processes":
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

    ranks = Ranks(argv=worker_command([sys.executable]), world=trial.data_parallel, on_failure=failed,
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
