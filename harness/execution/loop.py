"""The shared training loop of every framework (docs/design/timing.md): warm-up, timed windows synced at their
edges, the loss reads, input-wait time, epochs, evaluations and time to a target. It runs in the worker process
(``harness.execution.worker``) and asks the trial's adapter (``adapters.base.Adapter``) for each step; timing is
done here, never in an adapter.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from harness.execution.protocol import Epoch, Phase
from harness.neutral.datasets import augment, epoch_order
from harness.plan import Trial
from harness.record.metrics import AllocatorMemory, EpochMetrics, GradientNoise, TimeToTarget, TrialMetrics

if TYPE_CHECKING:
    from adapters.base import Adapter
    from harness.execution.protocol import _Event
    from harness.neutral.datasets import Data

SPIKE = 3.0  # a timed window whose per-step time exceeds this multiple of the median is counted slow
#: The stream of the gradient-norm probes' draws (``numpy.random.default_rng([seed, epoch, PROBES])``): apart from the
#: training order (``harness.neutral.datasets.epoch_order``), so measuring changes no batch training sees.
PROBES = 0x6E6F6973


class TrialError(Exception):
    """A trial that cannot run as specified (the reason is user-facing)."""


def train(adapter: Adapter, data: Data, trial: Trial, emit: Callable[[_Event], Any]) -> TrialMetrics:
    """The shared training loop (docs/design/timing.md). Returns the trial's training metrics.

    adapter: a prepared, built and loaded Adapter. data: the trial's dataset. trial: the payload's trial (its
    micro_batch_size, samples_per_step and accumulation_steps as the plan computed them; epochs, warmup_steps, seed,
    timing, augmentation, evaluate_every, target_accuracy and stop_at_target; max_steps_per_epoch cuts every epoch
    to its first steps: ``harness max-batch --with-dataset`` probes with the whole dataset resident but no whole
    epoch). emit: Events.emit. Times are in seconds (perf_counter); throughput is in samples per second. Raises
    TrialError when the batch size exceeds the training set or warm-up leaves no step to measure.
    """
    return _Loop(adapter, data, trial, emit).run()


class _Loop:
    """The state of one training run: the step counts, the timed windows so far and the epoch records."""

    def __init__(self, adapter: Adapter, data: Data, trial: Trial, emit: Callable[[_Event], Any]):
        self.adapter, self.data, self.emit = adapter, data, emit
        self.micro = trial.micro_batch_size
        self.devices = trial.data_parallel
        self.accumulation = trial.accumulation_steps
        self.batch = trial.samples_per_step  # samples per optimizer step, as the plan computed it
        self.epochs, self.warmup = trial.epochs, trial.warmup_steps
        self.timing, self.seed = trial.timing, trial.seed
        self.augmentation = trial.augmentation
        self.evaluate_every = trial.evaluate_every
        self.every_samples = trial.evaluate_every_samples
        self.target = trial.target_accuracy
        self.noise = trial.gradient_noise
        self.stop_at_target = trial.stop_at_target
        self.n = len(data.y_train)
        self.steps_per_epoch = self.n // self.batch
        if trial.max_steps_per_epoch:  # a max-batch probe holding the whole dataset: its first steps only
            self.steps_per_epoch = min(self.steps_per_epoch, trial.max_steps_per_epoch)
        if self.steps_per_epoch == 0:
            what = (f"batch size {self.micro}" if self.accumulation == 1 else
                    f"effective batch size {self.batch} ({self.accumulation} x {self.micro})")
            raise TrialError(f"{what} exceeds the {self.n} training samples")
        if self.noise is not None and self.batch % self.noise.micro_batches:
            raise TrialError(f"gradient_noise: {self.batch} samples per step cannot be split into "
                             f"{self.noise.micro_batches} equal micro-batches")
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
        self.loader = trial.input == "loader"  # each step's batch from the adapter's data loader
        self.batches: Iterator[Any] = iter(())  # the epoch's batches (Adapter.batches)
        self.staged: dict[int, Iterator[Any]] = {}  # later epochs' batches, made before a window (stage_ahead)
        self.fetch_seconds = 0.0  # time spent waiting for the loader's next batch, every step's
        self.input_wait_seconds = 0.0  # of that, inside the timed windows

    def step(self) -> None:
        """The epoch's next step: its batch (``Adapter.batches``), then ``Adapter.train_step``. With a loader the
        wait for the batch is timed alone: the input pipeline's share of the step."""
        if self.loader:
            start = time.perf_counter()
            batch = next(self.batches)
            self.fetch_seconds += time.perf_counter() - start
        else:
            batch = next(self.batches)
        self.adapter.train_step(batch, micro_batches=self.accumulation)

    def run(self) -> TrialMetrics:
        train_started = time.perf_counter()
        self.adapter.wait()
        if self.warm:
            self.adapter.reset_memory_stats()
            self.compilations_warm = self.adapter.compilations()
        else:
            self.emit(Phase(name="warmup", edge="start"))
        self.begin_epoch(0)
        for stop in self.evaluation_steps():  # the steps up to the next evaluation: a segment
            losses: list[tuple[float, int]] = []  # the loss reads: (mean, steps)
            seconds = self.train_segment(stop, losses)
            self.nonfinite = self.nonfinite or not all(math.isfinite(mean) for mean, steps in losses if steps)
            self.evaluate(losses, seconds, train_started)
            if self.reached is not None and self.stop_at_target:
                # MLPerf's rule: stop at the target; the metrics are of the epochs trained (a partial one counted)
                self.epochs = self.epoch + 1
                break
        return self.metrics()

    @property
    def done(self) -> int:
        """Optimizer steps trained so far, warm-up included."""
        return self.epoch * self.steps_per_epoch + self.position

    def evaluation_steps(self) -> list[int]:
        """The step counts after which the test set is evaluated, ascending, the last step's included: after every
        ``evaluate_every``-th epoch, or (``evaluate_every_samples`` k) at the first step at or past each multiple of
        k samples, one due during warm-up moved to its end."""
        total = self.epochs * self.steps_per_epoch
        if self.every_samples is None:
            ends = {e * self.steps_per_epoch for e in range(self.evaluate_every, self.epochs + 1, self.evaluate_every)}
        else:
            k = self.every_samples
            ends = {max(self.warmup, -(-j * k // self.batch)) for j in range(1, total * self.batch // k + 1)}
        return sorted({min(end, total) for end in ends} | {total})

    def begin_epoch(self, epoch: int) -> None:
        """The epoch's batches (made ahead by ``stage_ahead``, else now), and its augmented images when augmenting
        in resident mode (a loader reads and augments the epoch's samples itself)."""
        self.epoch, self.position = epoch, 0
        staged = self.staged.pop(epoch, None)
        self.batches = staged if staged is not None else self.epoch_batches(epoch)
        if self.augmentation and not self.loader:
            self.augment(epoch)

    def epoch_batches(self, epoch: int) -> Iterator[Any]:
        """``Adapter.batches`` of the epoch's order (``epoch_order``), its whole steps."""
        order = epoch_order(self.n, self.seed, epoch)[:self.steps_per_epoch * self.batch]
        return iter(self.adapter.batches(order, self.batch, epoch))

    def stage_ahead(self, count: int) -> None:
        """Before a window's clock starts, in resident mode without augmentation: the batches of the later epochs
        that its ``count`` steps run into, made now (their orders shuffled, their indices staged on the device),
        as a hand-written loop has every step's indices ready before it times anything (docs/design/timing.md:
        on a GPU a copy to the device inside a window waits behind the steps in flight). A loader's epoch starts
        stay inside the windows: its input pipeline is part of what it measures."""
        if self.loader or self.augmentation:
            return
        last = self.epoch + (self.position + count - 1) // self.steps_per_epoch
        for epoch in range(self.epoch + 1, last + 1):
            if epoch not in self.staged:
                self.staged[epoch] = self.epoch_batches(epoch)

    def train_segment(self, stop: int, losses: list[tuple[float, int]]) -> float:
        """Up to ``stop`` steps trained in all: what is left of warm-up, then timed windows; returns their
        seconds."""
        if self.position == self.steps_per_epoch and self.done < stop:
            self.begin_epoch(self.epoch + 1)
        while not self.warm:
            self.position = self.warm_up(self.epoch, losses)
            if self.done >= stop:
                return 0.0
            if self.position == self.steps_per_epoch:
                self.begin_epoch(self.epoch + 1)
        return self.timed(stop, losses)

    def augment(self, epoch: int) -> None:
        """This epoch's augmented training images, loaded to the device outside the timed windows."""
        self.emit(Phase(name="augment", epoch=epoch, edge="start"))
        self.adapter.set_train_images(augment(self.data.train_images, self.seed, epoch))
        self.adapter.wait()
        self.emit(Phase(name="augment", epoch=epoch, edge="end"))

    def warm_up(self, epoch: int, losses: list[tuple[float, int]]) -> int:
        """The warm-up steps still left, at the start of this epoch; returns the position after them."""
        count = min(self.warmup - epoch * self.steps_per_epoch, self.steps_per_epoch)
        self.adapter.wait()
        start = time.perf_counter()
        first = 0
        if epoch == 0 and count:  # the trial's first step alone: tracing, compilation, autotuning, first allocations
            self.step()
            self.adapter.wait()
            self.first_step_seconds = time.perf_counter() - start
            first = 1
        for _ in range(first, count):
            self.step()
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

    def timed(self, stop: int, losses: list[tuple[float, int]]) -> float:
        """The rest of the segment, up to ``stop`` steps in all, in timed windows synced at both edges; returns their
        seconds. Without augmentation a window runs on across the ends of epochs before ``stop`` (in resident mode the
        batches of the epochs it runs into are made before its clock starts: ``stage_ahead``; a loader's next epoch
        starts inside it, as a training loop starts its next epoch's iterator); with it, a window ends with its epoch
        (the augmented images are loaded between). Each window's clock stops when the device has done its work
        (``Adapter.wait``); the loss is read after that (``Adapter.read_loss``: the mean of the window's steps and their
        count), outside the clock, and the next window's clock starts after the read (reading a loss is the harness's
        own work: in MXNet a sum operator and an engine round trip, about 0.5 ms on this project's CPU)."""
        self.adapter.wait()
        self.emit(Phase(name="train", epoch=self.epoch, edge="start"))
        total = 0.0
        while True:
            left = stop - self.done
            if self.augmentation and not self.loader:  # a loader augments as it reads: windows run on
                left = min(left, self.steps_per_epoch - self.position)
            count = self.window_steps(left)
            self.stage_ahead(count)
            fetched = self.fetch_seconds
            start = time.perf_counter()
            for _ in range(count):
                if self.position == self.steps_per_epoch:
                    self.begin_epoch(self.epoch + 1)
                self.step()
                self.position += 1
            self.adapter.wait()
            seconds = time.perf_counter() - start
            self.input_wait_seconds += self.fetch_seconds - fetched
            losses.append(self.adapter.read_loss())  # the device is idle: only the read
            self.step_estimate = seconds / count
            self.step_seconds.append(self.step_estimate)
            self.measured_steps += count
            total += seconds
            if self.done == stop:
                break
            if self.position == self.steps_per_epoch:
                self.emit(Phase(name="train", epoch=self.epoch, edge="end"))
                self.begin_epoch(self.epoch + 1)  # augmenting: the epoch's images load between two windows
                self.adapter.wait()
                self.emit(Phase(name="train", epoch=self.epoch, edge="start"))
        self.emit(Phase(name="train", epoch=self.epoch, edge="end"))
        self.measured_seconds += total
        return total

    def evaluate(self, losses: list[tuple[float, int]], epoch_seconds: float, train_started: float) -> None:
        """The test set after the steps trained so far (outside the timed windows), its record and time to the target
        (``evaluation_steps`` says when), and the gradient norms where ``gradient_noise`` asks (every ``every``-th
        evaluation and the last, before the test set; the first to reach the target, after it); the record's
        ``epoch`` is the one its last step belongs to. ``losses``: the loss reads since the evaluation before, (mean,
        steps) each; the record's ``train_loss`` is their mean weighted by steps, the mean over every step
        (``train_loss_steps`` of them; nan when none), and ``timed_s`` the timed seconds since the evaluation
        before."""
        epoch, step = (self.done - 1) // self.steps_per_epoch, self.done
        key = None if self.every_samples is None else step  # several evaluations an epoch: probes drawn by step
        due = self.noise is not None and ((len(self.epoch_records) + 1) % self.noise.every == 0
                                          or step == self.epochs * self.steps_per_epoch)
        noise = self.gradient_norms(epoch, key) if due else None
        self.emit(Phase(name="eval", epoch=epoch, edge="start"))
        test_loss, test_accuracy = self.adapter.evaluate(self.micro)
        self.emit(Phase(name="eval", epoch=epoch, edge="end"))
        if self.target is not None and self.reached is None and test_accuracy >= self.target:
            # training_s: timed training only (warm-up steps and evaluations excluded);
            # wall_s: from the first step to the end of this evaluation, everything included.
            self.reached = {"epochs": epoch + 1, "steps": step, "training_s": self.measured_seconds,
                            "wall_s": time.perf_counter() - train_started}
            if noise is None and self.noise is not None:  # the norms where the target is first reached: the
                noise = self.gradient_norms(epoch, key)  # same parameters as before the test set
        steps = sum(count for _, count in losses)
        train_loss = sum(mean * count for mean, count in losses if count) / steps if steps else math.nan
        record: dict[str, Any] = {"epoch": epoch, "train_loss": train_loss, "train_loss_steps": steps,
                                  "test_loss": test_loss, "test_accuracy": test_accuracy, "timed_s": epoch_seconds,
                                  "gradient_noise": noise, "step": step}
        self.epoch_records.append(record)
        self.emit(Epoch(**record))

    def gradient_norms(self, epoch: int, step: int | None = None) -> GradientNoise | None:
        """The squared gradient norms of ``gradient_noise.probes`` batches of the trial's samples per step (B), each
        split into ``micro_batches`` (``Adapter.gradient_norms``), at the parameters reached after epoch ``epoch``;
        None when the trial measures none. The probe batches are drawn without replacement from the training set by
        (seed, epoch, ``PROBES``), the same in every framework; fewer when the set holds fewer. Outside the timed
        windows; the adapter changes no training state."""
        if self.noise is None:
            return None
        start = time.perf_counter()
        probes = min(self.noise.probes, self.n // self.batch)
        key = [self.seed, epoch, PROBES] + ([] if step is None else [step])  # several evaluations an epoch: by step
        order = np.random.default_rng(key).permutation(self.n)[:probes * self.batch]
        small, big = [], []
        for batch in self.adapter.batches(order.astype(np.int64), self.batch, epoch):
            norms, whole = self.adapter.gradient_norms(batch, self.noise.micro_batches)
            small.append(float(np.mean(norms)))
            big.append(float(whole))
        return GradientNoise(micro_batch=self.batch // self.noise.micro_batches, batch=self.batch, small=small,
                             big=big, seconds=time.perf_counter() - start)

    def metrics(self) -> TrialMetrics:
        """What the loop measured, typed (``harness.record.TrialMetrics``; the worker adds what it knows besides,
        ``harness.execution.worker``). Times in seconds, throughput in samples per second."""
        throughput = self.measured_steps * self.batch / self.measured_seconds
        per_step = np.asarray(self.step_seconds)
        epochs = [EpochMetrics(**record) for record in self.epoch_records]
        last = epochs[-1]
        warm = self.compilations_warm
        end = None if warm is None else self.adapter.compilations()
        return TrialMetrics(
            steps_per_epoch=self.steps_per_epoch,
            total_steps=self.done,
            measured_steps=self.measured_steps,
            measured_samples=self.measured_steps * self.batch,
            measured_s=self.measured_seconds,
            timed_windows=len(self.step_seconds),
            timing_window=self.timing.window,
            throughput_samples_per_s=throughput,
            epoch_time_s=self.steps_per_epoch * self.batch / throughput,
            # over windows: each window's duration over its steps (per step in latency mode, window: step)
            step_time_median_s=float(np.median(per_step)),
            step_time_p90_s=float(np.percentile(per_step, 90)),
            step_time_max_s=float(per_step.max()),
            # windows whose steps took more than SPIKE x the median: a recompilation (a shape or a guard the
            # compiled step had not seen), a garbage collection, or the machine's noise; the report names them
            slow_windows=int(np.sum(per_step > SPIKE * np.median(per_step))),
            first_step_s=self.first_step_seconds,
            # the framework's own count of traced/compiled train step graphs (Adapter.compilations): by the end of
            # warm-up, and how many more came inside the timed windows (None where the framework keeps no count)
            compilations_warmup=warm,
            recompilations=None if warm is None or end is None else end - warm,
            # input: loader: the time the timed steps waited for the loader's next batch (the shared loop's clock
            # around each ``next``), and its share of the timed seconds; resident: no wait is timed (0)
            input="loader" if self.loader else "resident",
            input_wait_s=self.input_wait_seconds,
            input_wait_share=self.input_wait_seconds / self.measured_seconds,
            final_train_loss=last.train_loss,
            test_loss=last.test_loss,
            test_accuracy=last.test_accuracy,
            nonfinite_loss=self.nonfinite,
            epochs=epochs,
            target_accuracy=self.target,
            time_to_target=None if self.reached is None else TimeToTarget(**self.reached),
            batch_size=self.micro,
            data_parallel=self.devices,
            per_device_batch_size=self.micro // self.devices,
            accumulation_steps=self.accumulation,
            effective_batch_size=self.batch,
            memory=AllocatorMemory(**self.adapter.memory_stats()),
        )
