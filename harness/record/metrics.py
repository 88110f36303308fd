"""What the worker measured: ``TrialMetrics``, the trial record's ``metrics`` and the ``Result`` event's, built by the
worker (``harness.execution.loop`` and ``harness.execution.worker``) and read by every reader as this type. Units are
in the names (``harness.record.units``). Every field may be absent (None) in a record of an older version
(``harness.record.legacy``) or a trial whose framework does not report it; the worker of this version sets all of
those it can."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from harness.record.base import Strict


class GradientNoise(Strict):
    """The squared gradient norms of one evaluation (``harness.spec.GradientNoiseSpec``): ``probes`` batches of
    ``batch`` samples, each split into micro-batches of ``micro_batch`` samples (``Adapter.gradient_norms``), at the
    parameters training had reached. ``harness.studies.advise.noise`` estimates the gradient noise scale from them."""

    micro_batch: int = Field(description="b: samples per micro-batch")
    batch: int = Field(description="B: samples per probe batch (k b)")
    small: list[float] = Field(description="per probe: the mean over its k micro-batches of |g_i|^2")
    big: list[float] = Field(description="per probe: |G|^2, the squared norm of the mean of its k gradients")
    seconds: float = Field(description="seconds the measurement took (outside the timed windows)")


class EpochMetrics(Strict):
    """One evaluation of a trial (``metrics.epochs``): after epoch ``epoch`` (0-based), which is every epoch unless
    the spec's ``evaluate_every`` k > 1 (then every k-th and the last); with ``evaluate_every_samples`` after the
    step ``step`` within (or at the end of) epoch ``epoch``."""

    epoch: int | None = None
    step: int | None = Field(default=None, description="optimizer steps trained when evaluated, warm-up included")
    train_loss: float | None = Field(default=None, description=(
        "mean loss over every optimizer step since the evaluation before, warm-up steps included (records without "
        "train_loss_steps: the mean of the losses of the timed windows' last steps)"))
    train_loss_steps: int | None = Field(default=None, description="the optimizer steps train_loss averages")
    test_loss: float | None = None
    test_accuracy: float | None = Field(default=None, description="fraction, 0..1")
    timed_s: float | None = Field(default=None, description="seconds inside the timed windows since the evaluation "
                                                            "before (the epoch's, with an evaluation every epoch)")
    gradient_noise: GradientNoise | None = Field(
        default=None, description="the squared gradient norms measured before this evaluation (spec gradient_noise)")


class TimeToTarget(Strict):
    """When the test accuracy first reached the spec's ``target_accuracy``."""

    epochs: int = Field(description="epochs trained when an evaluation first reached the target (a partial one "
                                    "counted)")
    steps: int | None = Field(default=None, description="optimizer steps trained until then, warm-up included")
    training_s: float = Field(description="seconds inside the timed windows until then (warm-up and evaluations "
                                          "excluded)")
    wall_s: float = Field(description="seconds from the first step to the end of that evaluation, everything "
                                      "included")


class AllocatorMemory(Strict):
    """The framework allocator's own peaks since warm-up ended (``Adapter.memory_stats``), where it keeps them
    (PyTorch and TensorFlow on a GPU)."""

    allocator_peak_bytes: int | None = Field(default=None, description="peak bytes held by tensors")
    allocator_reserved_peak_bytes: int | None = Field(default=None, description="peak bytes the allocator held from "
                                                                                "the device")


class PredictedMemory(Strict):
    """One device's training step predicted from the neutral model (``harness.neutral.memory.predict``; float32)."""

    parameters_bytes: int | None = None
    gradients_bytes: int | None = None
    optimizer_state_bytes: int | None = None
    buffers_bytes: int | None = Field(default=None, description="batchnorm running statistics")
    accumulator_bytes: int | None = Field(default=None, description="the gradient accumulator")
    activations_bytes: int | None = Field(default=None, description="saved for the backward pass, for the "
                                                                            "per-device batch")
    activations_per_sample_bytes: int | None = None
    total_bytes: int | None = Field(default=None, description="the sum of the parts (the dataset not "
                                                                      "included)")
    attention: str | None = Field(default=None, description="what attention was assumed to keep: unfused or fused "
                                                            "(the adapter's declaration)")


#: PredictedMemory's parts, in the order the report lists them (each ``<part>_bytes``).
PREDICTED_PARTS = ("parameters", "gradients", "optimizer_state", "buffers", "accumulator", "activations", "total")


class DataParallelism(Strict):
    """A data-parallel trial's devices and mechanism (``metrics.data_parallelism``; None on one device)."""

    devices: list[str] = Field(default_factory=list, description="the devices, as the worker numbered them")
    sync_batchnorm: bool = False
    mechanism: str | None = Field(default=None, description="the framework's mechanism, from its declaration")


class TrialMetrics(Strict):
    """What the worker measured (``metrics``); absent for trials that did not end ok."""

    # the budget
    steps_per_epoch: int | None = None
    total_steps: int | None = None
    measured_steps: int | None = Field(default=None, description="optimizer steps inside the timed windows")
    measured_samples: int | None = Field(default=None, description="samples trained inside the timed windows")
    measured_s: float | None = Field(default=None, description="seconds inside the timed windows")
    timed_windows: int | None = None
    timing_window: str | int | None = Field(default=None, description="the spec's timing.window: auto, step or k "
                                                                       "steps")
    # speed
    throughput_samples_per_s: float | None = Field(default=None, description="training samples per second over the "
                                                                             "timed windows")
    epoch_time_s: float | None = Field(default=None, description="samples per epoch / throughput")
    step_time_median_s: float | None = Field(default=None, description="median over the timed windows of each "
                                                                       "window's time / its steps")
    step_time_p90_s: float | None = Field(default=None, description="90th percentile of the same")
    step_time_max_s: float | None = None
    slow_windows: int | None = Field(default=None, description="windows whose steps took more than 3 x the median")
    first_step_s: float | None = Field(default=None, description="the first step alone, compilation included")
    compilations_warmup: int | None = Field(default=None, description="the framework's count of traced or compiled "
                                                                      "train step graphs when warm-up ended")
    recompilations: int | None = Field(default=None, description="how many more came inside the timed windows")
    # input
    input: Literal["resident", "loader"] | None = None
    input_wait_s: float | None = Field(default=None, description="seconds the timed steps waited for the loader's "
                                                                 "next batch")
    input_wait_share: float | None = Field(default=None, description="input_wait_s / measured_s, 0..1")
    # what training reached
    final_train_loss: float | None = Field(default=None, description="the last evaluation's train_loss")
    test_loss: float | None = None
    test_accuracy: float | None = Field(default=None, description="fraction, 0..1, after the last epoch")
    nonfinite_loss: bool | None = None
    epochs: list[EpochMetrics] = Field(default_factory=list)
    target_accuracy: float | None = None
    time_to_target: TimeToTarget | None = None
    # the trial's shape, as the worker ran it
    batch_size: int | None = None
    data_parallel: int | None = None
    per_device_batch_size: int | None = None
    accumulation_steps: int | None = None
    effective_batch_size: int | None = None
    data_parallelism: DataParallelism | None = None
    precision: str | None = None
    compile: str | None = None
    compile_meaning: str | None = None
    # memory and model
    memory: AllocatorMemory = Field(default_factory=AllocatorMemory)
    memory_predicted: PredictedMemory | None = None
    data_bytes: int | None = Field(default=None, description="bytes of the dataset held on the device")
    data_skipped_files: int | None = Field(default=None, description="unreadable image files left out")
    model_source: Literal["neutral", "native"] | None = Field(default=None, description=(
        "neutral: the spec's framework-neutral model, built alike by every framework; native: a model of your own "
        "(the framework entry's model factory)"))
    parameter_count: int | None = Field(default=None, description="trainable parameters (a model of your own: the "
                                                                   "sizes of its trainable arrays)")
    train_flops_per_sample: int | None = Field(default=None, description="training FLOPs per sample (forward and "
                                               "backward, 2 FLOPs per multiply-accumulate); None where nothing "
                                               "counted them")
    flops_source: str | None = Field(default=None, description="what counted train_flops_per_sample, or why nothing "
                                                               "did")
    achieved_flops_per_s: float | None = Field(default=None, description="throughput x train_flops_per_sample")
