"""The worker process: one trial, one fresh interpreter, one framework.

Run as ``python -m harness.worker --events-fd N`` with the trial (JSON, see ``harness.plan.Trial.payload``) on
standard input. It imports the trial's adapter, builds the model from the canonical weights, loads the dataset to the
device once, runs the shared training loop below and writes events, one JSON object per line, to file descriptor N.
The framework's own stdout and stderr go wherever the launcher sent them (a log whose tail is kept for errors).

Every event carries ``t``, a ``time.monotonic()`` stamp (CLOCK_MONOTONIC on Linux: the same clock in every process of
the machine, so the launcher's sampler can place its samples in the worker's phases).

The loop: each epoch is floor(N / batch size) full batches in the order ``harness.datasets.epoch_order`` gives (the
remainder is dropped, so no smaller last batch changes shapes and triggers a retrace or re-allocation inside a timed
window). The first ``warmup_steps`` optimizer steps of the run are warm-up: they train like any other step (every
framework takes exactly the same optimizer steps) but are not timed. After warm-up, the steps of each epoch are timed
in windows of ``timing.sync_every`` steps with a device sync at both edges of every window. Evaluation on the test set
follows each epoch, outside the timed windows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np

EXIT_OK, EXIT_FAILED = 0, 1


class TrialError(Exception):
    """A trial that cannot run as specified (the reason is user-facing)."""


class Events:
    """Writes events to the launcher's pipe, one JSON line each, flushed at once."""

    def __init__(self, fd: int | None):
        self._out = os.fdopen(fd, "w", buffering=1, encoding="utf-8") if fd is not None else None
        self.log: list[dict[str, Any]] = []

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "t": time.monotonic(), **fields}
        self.log.append(record)
        if self._out is not None:
            self._out.write(json.dumps(record, default=_jsonable) + "\n")
        return record


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def train(adapter: Any, data: Any, trial: dict[str, Any], emit: Callable[..., Any]) -> dict[str, Any]:
    """The shared training loop (see the module docstring). Returns the trial's training metrics.

    adapter: a prepared, built and loaded Adapter. data: harness.datasets.Data. trial: the payload's trial fields
    (batch_size, epochs, warmup_steps, seed, sync_every). emit: Events.emit. Times are in seconds (perf_counter);
    throughput is in samples per second. Raises TrialError when the batch size exceeds the training set or warm-up
    leaves no step to measure.
    """
    from harness.datasets import augment, epoch_order

    micro = trial["batch_size"]
    accumulation = trial.get("accumulation_steps", 1)
    batch = micro * accumulation  # samples per optimizer step
    epochs, warmup = trial["epochs"], trial["warmup_steps"]
    sync_every, seed = trial["sync_every"], trial["seed"]
    target = trial.get("target_accuracy")
    n = len(data.y_train)
    steps_per_epoch = n // batch
    if steps_per_epoch == 0:
        what = f"batch size {micro}" if accumulation == 1 else f"effective batch size {batch} ({accumulation} x {micro})"
        raise TrialError(f"{what} exceeds the {n} training samples")

    def step(indices: np.ndarray) -> None:
        if accumulation == 1:
            adapter.train_step(indices)
        else:
            adapter.train_step(indices, micro_batches=accumulation)
    if warmup >= steps_per_epoch * epochs:
        raise TrialError(f"warmup_steps {warmup} leaves none of the {steps_per_epoch * epochs} steps to measure")

    step_seconds: list[float] = []  # per-step time of each window (window time / its steps)
    measured_seconds = 0.0
    measured_steps = 0
    epoch_records: list[dict[str, Any]] = []
    nonfinite = False
    reached: dict[str, Any] | None = None
    train_started = time.perf_counter()
    warm = warmup == 0
    adapter.sync()
    if warm:
        adapter.reset_memory_stats()
    else:
        emit("phase", name="warmup", edge="start")
    for epoch in range(epochs):
        order = epoch_order(n, seed, epoch)
        if trial.get("augmentation"):
            emit("phase", name="augment", epoch=epoch, edge="start")
            adapter.set_train_images(augment(data.x_train, seed, epoch))
            adapter.sync()
            emit("phase", name="augment", epoch=epoch, edge="end")
        losses: list[float] = []
        position = 0
        if not warm:  # the warm-up steps still left fall at the start of this epoch
            count = min(warmup - epoch * steps_per_epoch, steps_per_epoch)
            for position in range(count):
                step(order[position * batch:(position + 1) * batch])
            losses.append(adapter.sync())
            position = count
            if epoch * steps_per_epoch + count == warmup:
                warm = True
                emit("phase", name="warmup", edge="end")
                adapter.reset_memory_stats()
        epoch_seconds = 0.0
        if position < steps_per_epoch:
            adapter.sync()
            emit("phase", name="train", epoch=epoch, edge="start")
            start = previous = time.perf_counter()
            while position < steps_per_epoch:
                count = min(sync_every, steps_per_epoch - position)
                for _ in range(count):
                    step(order[position * batch:(position + 1) * batch])
                    position += 1
                losses.append(adapter.sync())
                now = time.perf_counter()
                step_seconds.append((now - previous) / count)
                measured_steps += count
                previous = now
            epoch_seconds = previous - start
            emit("phase", name="train", epoch=epoch, edge="end")
            measured_seconds += epoch_seconds
        nonfinite = nonfinite or not all(math.isfinite(x) for x in losses)
        emit("phase", name="eval", epoch=epoch, edge="start")
        test_loss, test_accuracy = adapter.evaluate(micro)
        emit("phase", name="eval", epoch=epoch, edge="end")
        if target is not None and reached is None and test_accuracy >= target:
            # training_seconds: timed training only (warm-up steps and evaluations excluded);
            # wall_seconds: from the first step to the end of this evaluation, everything included.
            reached = {"epochs": epoch + 1, "training_seconds": measured_seconds,
                       "wall_seconds": time.perf_counter() - train_started}
        record = {"epoch": epoch, "train_loss": float(np.mean(losses)) if losses else math.nan,
                  "test_loss": test_loss, "test_accuracy": test_accuracy, "timed_seconds": epoch_seconds}
        epoch_records.append(record)
        emit("epoch", **record)

    memory = adapter.memory_stats()
    throughput = measured_steps * batch / measured_seconds
    per_step = np.asarray(step_seconds)
    return {
        "steps_per_epoch": steps_per_epoch,
        "total_steps": steps_per_epoch * epochs,
        "measured_steps": measured_steps,
        "measured_samples": measured_steps * batch,
        "measured_seconds": measured_seconds,
        "throughput": throughput,
        "seconds_per_epoch": steps_per_epoch * batch / throughput,
        "step_time_median_s": float(np.median(per_step)),
        "step_time_p90_s": float(np.percentile(per_step, 90)),
        "final_train_loss": epoch_records[-1]["train_loss"],
        "test_loss": epoch_records[-1]["test_loss"],
        "test_accuracy": epoch_records[-1]["test_accuracy"],
        "nonfinite_loss": nonfinite,
        "batch_size": micro,
        "accumulation_steps": accumulation,
        "effective_batch_size": batch,
        "target_accuracy": target,
        "time_to_target": reached,
        "epochs": epoch_records,
        "memory": memory,
    }


def run(payload: dict[str, Any], events: Events) -> int:
    """Runs one trial end to end and reports it through ``events``. Returns the process exit status."""
    adapter = None
    try:
        import adapters
        from harness import datasets, models
        from harness.spec import OptimizerSpec, Spec

        trial = payload["trial"]
        spec = Spec.model_validate(payload["spec"])
        events.emit("start", pid=os.getpid(), framework=trial["framework"], batch_size=trial["batch_size"])
        try:
            adapter = adapters.get(trial["framework"])()
        except ImportError as err:
            raise TrialError(f"{trial['framework']} is not installed here ({err})") from None
        if trial["device"] == "cpu" and trial.get("memory_limit_bytes"):
            from harness.limits import apply_cpu_memory_limit  # see there for what the limit means on the CPU

            apply_cpu_memory_limit(trial["memory_limit_bytes"], trial["framework"], emit=events.emit)
        adapter.options = {"tensorflow_memory_growth": spec.allocator.tensorflow_memory_growth,
                           "memory_limit_bytes": trial.get("memory_limit_bytes")}
        adapter.prepare(trial["device"], trial["threads"], trial["seed"])
        data = datasets.load(spec.dataset, seed=trial["seed"])
        info = models.analyze(spec.model, tuple(data.x_train.shape[1:]), data.num_classes)
        base_optimizer = OptimizerSpec.model_validate(trial["optimizer"]) if trial.get("optimizer") else spec.optimizer
        optimizer = base_optimizer.model_copy(update={"learning_rate": trial["learning_rate"]})
        adapter.build(info, models.initial_weights(info, trial["seed"]), optimizer)
        adapter.load(data)
        adapter.sync()
        events.emit("ready", versions=adapter.versions(), settings=adapter.settings())
        metrics = train(adapter, data, trial, events.emit)
        metrics.update({
            "parameter_count": info.parameter_count,
            "train_flops_per_sample": info.train_flops_per_sample,
            "achieved_flops": metrics["throughput"] * info.train_flops_per_sample,
            "data_bytes": data.nbytes,
        })
        events.emit("result", metrics=metrics, versions=adapter.versions(), settings=adapter.settings())
        return EXIT_OK
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the process exits non-zero
        oom = False
        if adapter is not None:
            try:
                oom = adapter.is_oom(exc)
            except Exception:  # noqa: BLE001 - a broken classifier must not hide the original error
                oom = False
        # Python's own MemoryError is an out-of-memory too: an allocation outside the framework's allocator (numpy,
        # a lazily imported module) failing, typically under a CPU memory cap (harness.limits).
        oom = oom or isinstance(exc, MemoryError)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = reason if isinstance(exc, TrialError) else f"{type(exc).__name__}: {reason}".rstrip(": ")
        events.emit("error", kind="oom" if oom else "error", reason=reason[:500],
                    traceback="".join(traceback.format_exception(exc))[-4000:])
        return EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--events-fd", type=int, required=True, help="file descriptor for the JSON-lines events")
    args = parser.parse_args(argv)
    payload = json.loads(sys.stdin.read())
    events = Events(args.events_fd)
    return run(payload, events)


if __name__ == "__main__":
    sys.exit(main())
