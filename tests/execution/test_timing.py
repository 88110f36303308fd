"""The shared loop's timed windows: where it synchronizes the device, how long its windows are, what it reports."""

from __future__ import annotations

import collections
import time
from types import SimpleNamespace

import numpy as np
import pytest

from harness.execution.loop import train
from harness.neutral.datasets import Data
from harness.record import TrialMetrics, TrialRecord
from harness.results.overview import timing_mode
from harness.spec import SpecError, TimingSpec, load
from tests.helpers import loop_trial


def _data(samples: int, shape: tuple[int, ...]) -> Data:
    """A dataset of ``samples`` zero images of ``shape`` (H, W, C) and no test set: the loop's input, nothing more."""
    return Data(np.zeros((samples, *shape), np.float32), np.zeros(samples, np.int64),
                np.zeros((0, *shape), np.float32), np.zeros(0, np.int64), 2)


def step_loss(step: int) -> float:
    """The loss of the run's ``step``-th train step (0-based) in ``RecordingAdapter``: falling, with a sawtooth, so
    that the losses read at different steps average to different numbers."""
    return 2.0 / (1.0 + 0.1 * step) + 0.3 * (step % 3)


class RecordingAdapter:
    """Just what the loop calls, recording the order of steps, waits and loss reads; a step takes ``step_s`` of wall
    time and has the loss ``step_loss`` of its place in the run, which ``read_loss`` averages as the contract says."""

    def __init__(self, step_s: float = 0.0, read_s: float = 0.0):
        self.step_s, self.read_s, self.calls = step_s, read_s, []
        self.pending, self.unstaged = collections.deque(), 0  # the batches made, in order, not yet trained on
        self.steps, self.unread = 0, []  # steps so far; the losses since the last read

    def batches(self, order, batch_size, epoch):
        self.calls.append("stage")
        made = [order[p * batch_size:(p + 1) * batch_size] for p in range(len(order) // batch_size)]
        self.pending.extend(made)
        return iter(made)

    def set_train_images(self, images):
        self.calls.append("images")

    def train_step(self, indices, micro_batches=1):
        self.calls.append("step")
        if not self.pending or self.pending.popleft() is not indices:
            self.unstaged += 1  # not the next batch of the epochs' orders, in the order they were made
        if self.step_s:
            time.sleep(self.step_s)
        self.unread.append(step_loss(self.steps))
        self.steps += 1

    def wait(self):
        self.calls.append("wait")

    def agree(self, value):
        return value  # one process: the contract's default (Adapter.agree)

    def read_loss(self):
        self.calls.append("read")
        if self.read_s:
            time.sleep(self.read_s)  # a slow loss read
        losses, self.unread = self.unread, []
        return (float(np.mean(losses)) if losses else float("nan")), len(losses)

    def evaluate(self, batch_size):
        self.calls.append("eval")
        return 0.5, 0.9

    def compilations(self):
        return None  # keeps no count (the adapter default)

    def reset_memory_stats(self):
        pass

    def memory_stats(self):
        return {}


def _train(timing: dict, samples: int = 88, batch: int = 4, epochs: int = 1, warmup: int = 0, step_s: float = 0.0,
           read_s: float = 0.0, evaluate_every: int = 1, augmentation: bool = False, events: list | None = None,
           adapter_cls: type = RecordingAdapter, **fields):
    adapter = adapter_cls(step_s, read_s)
    data = _data(samples, (8, 8, 1))
    trial = loop_trial(batch, timing, epochs=epochs, warmup_steps=warmup, evaluate_every=evaluate_every,
                       augmentation=augmentation, **fields)
    events = [] if events is None else events
    metrics = train(adapter, data, trial, lambda event: events.append((event.event, event.fields())))
    assert adapter.unstaged == 0  # every step's indices were the next batch of the orders made for its epochs
    return adapter.calls, metrics.model_dump()  # the record's TrialMetrics, as its trials.jsonl line holds them


def _report_data(metrics: TrialMetrics) -> SimpleNamespace:
    """What the report's notes read of a run: one ok trial with these metrics."""
    record = TrialRecord(id="x-bs4-r0", framework="x", label="x", batch_size=4, repeat=0, device="cpu", status="ok",
                         wall_s=1.0, metrics=metrics)
    return SimpleNamespace(records=[record], backend="host", spec={"timing": {"window": "auto", "window_seconds": 1.0}})


def _timed_windows(calls: list[str]) -> list[int]:
    """Steps between consecutive waits up to the last evaluation (warm-up steps are the first group when any)."""
    last_eval = len(calls) - 1 - calls[::-1].index("eval")
    timed = calls[:last_eval]
    start = len(timed) - 1 - timed[::-1].index("read")  # the loss read after the last window
    windows, count = [], 0
    for call in timed[:start + 1]:
        if call == "step":
            count += 1
        elif count and call != "stage":
            windows.append(count)
            count = 0
    return windows


def test_latency_mode_syncs_after_every_step():
    calls, metrics = _train({"window": "step"})
    assert _timed_windows(calls) == [1] * 22
    assert metrics["timed_windows"] == 22 and metrics["timing_window"] == "step"


def test_fixed_windows_sync_only_at_their_edges():
    calls, metrics = _train({"window": 5})
    assert _timed_windows(calls) == [5, 5, 5, 5, 2]
    assert metrics["timed_windows"] == 5 and metrics["measured_steps"] == 22


def test_auto_windows_last_about_the_target_and_never_leave_a_short_remainder():
    # 4 ms steps, a 0.05 s target: about 13 steps a window; at least 3; 60 steps an epoch.
    calls, metrics = _train({"window": "auto", "window_seconds": 0.05, "min_window_steps": 3},
                            samples=240, warmup=2, step_s=0.004)
    first, warmup, *windows = _timed_windows(calls)
    # the trial's first step runs alone (synced on both sides: its time is first_step_s), then the warm-up
    assert first == 1 and warmup == 1 and sum(windows) == 58 and metrics["timed_windows"] == len(windows)
    assert 0.004 <= metrics["first_step_s"] < 0.05
    assert all(w >= 3 for w in windows)
    assert 2 <= len(windows) <= 8, windows  # not one sync a step, not one window for the epoch
    # Each window's measured time is close to the target (sleep only ever overshoots).
    assert 0.03 < np.median(np.asarray(windows) * 0.004) < 0.1


def test_auto_windows_without_warmup_start_at_the_minimum_and_fill_a_short_epoch():
    calls, _ = _train({"window": "auto", "window_seconds": 10.0, "min_window_steps": 4}, samples=88)
    assert _timed_windows(calls) == [4, 18]  # first window: no estimate yet; then the rest of the epoch
    calls, _ = _train({"window": "auto", "min_window_steps": 30}, samples=88)
    assert _timed_windows(calls) == [22]  # an epoch shorter than the minimum is one window


def test_a_window_with_a_stall_is_counted_slow_and_named_in_the_report():
    """One step that stalls (as a recompilation would) makes its window's per-step time far above the median: the
    worker counts it in slow_windows, and the report names the trial."""
    adapter = RecordingAdapter(0.002)
    steps = []
    stall = adapter.train_step

    def train_step(indices, micro_batches=1):
        steps.append(1)
        stall(indices, micro_batches)
        if len(steps) == 30:  # the 28th timed step (after 2 warm-up steps): inside the sixth window of 5
            time.sleep(0.2)

    adapter.train_step = train_step
    data = _data(200, (1, 1, 1))
    trial = loop_trial(4, {"window": 5}, warmup_steps=2)
    metrics = train(adapter, data, trial, lambda event: None)
    assert metrics.slow_windows == 1 and metrics.step_time_max_s > 5 * metrics.step_time_median_s
    from harness.results.notes import slow_window_notes

    section = slow_window_notes(_report_data(metrics))
    assert section.title == "Short and slow windows, recompilations"
    assert "x-bs4-r0 (1 of 10 windows, the slowest" in section.blocks[0].text
    assert slow_window_notes(_report_data(metrics.model_copy(update={"slow_windows": 0}))) is None


def test_windows_far_shorter_than_the_goal_are_named_in_the_report():
    """An MLP on digits timed windows of 7 to 25 ms under a header saying "about 1 s", with no word (issue 59): the
    report names each trial whose mean window is under a tenth of the goal, and no other."""
    from harness.results.notes import slow_window_notes

    metrics = TrialMetrics(timing_window="auto", timed_windows=4, measured_s=0.04, slow_windows=0)
    (block,) = slow_window_notes(_report_data(metrics)).blocks
    assert "far shorter than the goal of about 1 s" in block.text and "x-bs4-r0 (10 ms)" in block.text
    assert slow_window_notes(_report_data(metrics.model_copy(update={"measured_s": 0.4}))) is None
    assert slow_window_notes(_report_data(metrics.model_copy(update={"timing_window": "5"}))) is None


def test_a_recompilation_after_warm_up_is_counted_by_the_adapter_and_named_in_the_report():
    """An adapter whose framework counts its compiled graphs: one compiled in the first warm-up step and one more
    inside the timed windows (a shape the step had not seen). The worker records 1 during warm-up and 1 after, and
    the report names the trial; an adapter that keeps no count gives None."""
    adapter = RecordingAdapter()
    adapter.count, steps, step = 0, [], adapter.train_step

    def train_step(indices, micro_batches=1):
        steps.append(1)
        step(indices, micro_batches)
        if len(steps) in (1, 20):
            adapter.count += 1

    adapter.train_step, adapter.compilations = train_step, lambda: adapter.count
    data = _data(200, (1, 1, 1))
    trial = loop_trial(4, {"window": 5}, warmup_steps=2)
    metrics = train(adapter, data, trial, lambda event: None)
    assert (metrics.compilations_warmup, metrics.recompilations) == (1, 1)
    from harness.results.notes import slow_window_notes
    from harness.results.sections import to_markdown

    text = to_markdown([slow_window_notes(_report_data(metrics.model_copy(update={"slow_windows": 0})))])
    assert "Recompilations inside the timed windows" in text and "x-bs4-r0 (1 after warm-up, 1 during it)" in text
    del adapter.compilations
    adapter.compilations = lambda: None
    metrics = train(adapter, data, trial, lambda event: None)
    assert metrics.compilations_warmup is None and metrics.recompilations is None


def test_each_epoch_is_staged_before_its_first_step():
    """``batches`` once per epoch, before the epoch's warm-up and timed steps (so outside every timed window: a
    wait comes between it and the first step's window), with the samples per optimizer step."""
    calls, _ = _train({"window": 5}, epochs=3, warmup=2)
    assert calls.count("stage") == 3
    starts = [i for i, call in enumerate(calls) if call == "stage"]
    assert all(calls[i + 1] == "wait" for i in starts[1:])  # after an epoch's evaluation, a wait opens the next
    assert "step" not in calls[:starts[0]] and calls[starts[0] + 1:].count("step") == 3 * 22


def test_former_sync_every_and_bad_windows(tmp_path):
    assert TimingSpec.model_validate({"sync_every": 1}).window == "step"
    assert TimingSpec.model_validate({"sync_every": 8}).window == 8
    path = tmp_path / "bad.yaml"
    for timing, field in (("{window: 0}", "timing.window"), ("{window: often}", "timing.window"),
                          ("{window: 4, sync_every: 4}", "timing"), ("{window_seconds: 0}", "timing.window_seconds")):
        path.write_text("name: t\nframeworks: [pytorch]\n"
                        "model: {layers: [{type: flatten}, {type: dense, units: 10}]}\n"
                        f"dataset: {{name: digits}}\nbatch_sizes: [8]\ntiming: {timing}\n")
        with pytest.raises(SpecError) as err:
            load(path)
        assert field in str(err.value) and str(path) in str(err.value)


def test_the_report_states_the_mode():
    assert "after every step" in timing_mode({"window": "step"})
    assert "after every step" in timing_mode({"sync_every": 1})  # a run written before windows
    auto = timing_mode(TimingSpec().model_dump(mode="json"))
    assert "about 1 s" in auto and "only at their edges" in auto
    assert "windows of 16 steps" in timing_mode({"window": 16})


def test_the_loss_read_is_outside_the_clock():
    """Each window's clock stops at ``wait`` (the device is done); the loss is read by ``read_loss`` after it, and
    the next window's clock starts after the read: a slow read (50 ms a window) leaves the 2 ms steps' time alone."""
    calls, metrics = _train({"window": 5}, samples=80, batch=4, step_s=0.002, read_s=0.05)
    assert _timed_windows(calls) == [5] * 4
    timed = calls[calls.index("step"):]
    ends = [i for i, call in enumerate(timed) if call == "wait" and "step" in timed[i - 1:i]]  # window end edges
    assert len(ends) == 4 and all(timed[i + 1] == "read" for i in ends)  # the read right after each end edge
    assert 0.002 <= metrics["step_time_median_s"] < 0.0045 and max(metrics["epochs"][0]["timed_s"], 0) < 0.1


def _windows_between_syncs(calls: list[str]) -> list[list[str]]:
    """The calls between consecutive waits or reads (a timed window's steps, and any staging inside it)."""
    out, current = [], []
    for call in calls:
        if call in ("read", "wait"):
            if "step" in current:
                out.append(current)
            current = []
        else:
            current.append(call)
    return out


def test_windows_run_on_across_epochs_between_evaluations():
    """evaluate_every 3 over 3 epochs of 10 steps: one evaluation, at the end; fixed windows of 4 run across the ends
    of epochs, so 30 steps are 7 windows of 4 and a last one of 2, where one evaluation per epoch cuts them at every
    epoch's end (4, 4, 2 three times). In resident mode the batches of the epoch a window runs into are made before
    its clock starts (no copy to the device queued behind the window's steps); a loader's next epoch starts inside
    the window, as a training loop starts its next epoch's iterator."""
    events: list = []
    calls, metrics = _train({"window": 4}, samples=40, epochs=3, evaluate_every=3, events=events)
    windows = _windows_between_syncs(calls)
    assert [w.count("step") for w in windows] == [4] * 7 + [2] and calls.count("eval") == 1
    # epoch 1 begins inside the window of steps 9-12, staged before it; epoch 2 after the window ending with step 20
    assert calls.count("stage") == 3 and not [i for i, w in enumerate(windows) if "stage" in w[1:]]
    assert [i for i, w in enumerate(windows) if w[0] == "stage"] == [2]
    loader_calls, _ = _train({"window": 4}, samples=40, epochs=3, evaluate_every=3, input="loader")
    loader_windows = _windows_between_syncs(loader_calls)
    assert [w.count("step") for w in loader_windows] == [4] * 7 + [2]
    assert [i for i, w in enumerate(loader_windows) if "stage" in w[1:]] == [2]
    assert [e["epoch"] for e in metrics["epochs"]] == [2] and metrics["measured_steps"] == 30
    assert metrics["epochs"][0]["timed_s"] > 0 and metrics["timed_windows"] == 8
    train_phases = [(f["edge"], f["epoch"]) for name, f in events if name == "phase" and f["name"] == "train"]
    # the phase is left only where windows break: after step 20, to stage epoch 2 outside the clock
    assert train_phases == [("start", 0), ("end", 1), ("start", 2), ("end", 2)]
    calls, metrics = _train({"window": 4}, samples=40, epochs=3)
    assert [w.count("step") for w in _windows_between_syncs(calls)] == [4, 4, 2] * 3
    assert [e["epoch"] for e in metrics["epochs"]] == [0, 1, 2]


def test_every_kth_epoch_and_the_last_are_evaluated_and_windows_never_cross_an_evaluation():
    calls, metrics = _train({"window": "auto", "min_window_steps": 3, "window_seconds": 100.0}, samples=40,
                            epochs=5, evaluate_every=2, warmup=13)
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 3, 4]
    evals = [i for i, call in enumerate(calls) if call == "eval"]
    # warm-up takes epoch 0 and 3 steps of epoch 1; then 7 steps to the first evaluation, 20, 10
    steps_between = [calls[a:b].count("step") for a, b in zip([0] + evals, evals)]
    assert steps_between == [20, 20, 10] and metrics["measured_steps"] == 37
    # the first step alone, the rest of epoch 0's warm-up, epoch 1's 3; then one window to each evaluation
    assert [w.count("step") for w in _windows_between_syncs(calls)] == [1, 9, 3, 7, 20, 10]


def test_every_k_samples_is_evaluated_at_the_first_step_past_each_multiple_and_the_target_stops_mid_epoch():
    """evaluate_every_samples 12 at batch 4 over 3 epochs of 10 steps: after steps 3, 6, ..., 30 (the one due in
    warm-up, step 3, at its end, step 4); windows end at each evaluation and run on across the ends of epochs."""
    calls, metrics = _train({"window": 10}, samples=40, epochs=3, warmup=4, evaluate_every_samples=12)
    assert [e["step"] for e in metrics["epochs"]] == [4, 6, 9, 12, 15, 18, 21, 24, 27, 30]
    assert [e["epoch"] for e in metrics["epochs"]] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    evals = [i for i, call in enumerate(calls) if call == "eval"]
    assert [calls[a:b].count("step") for a, b in zip([0] + evals, evals)] == [4, 2, 3, 3, 3, 3, 3, 3, 3, 3]
    assert metrics["measured_steps"] == 26 and metrics["total_steps"] == 30
    # 7 samples: every step past 7, 14, 21, ... (steps 2, 4, 6, 7, 9, ...); a batch above k: every step
    _, metrics = _train({"window": 10}, samples=40, epochs=1, evaluate_every_samples=7)
    assert [e["step"] for e in metrics["epochs"]] == [2, 4, 6, 7, 9, 10]
    _, metrics = _train({"window": 10}, samples=40, epochs=1, evaluate_every_samples=3)
    assert [e["step"] for e in metrics["epochs"]] == list(range(1, 11))
    # stop_at_target at the first evaluation past warm-up (RecordingAdapter's accuracy is 0.9): mid-epoch
    _, metrics = _train({"window": 10}, samples=40, epochs=3, warmup=1, evaluate_every_samples=16,
                        target_accuracy=0.8, stop_at_target=True)
    assert [e["step"] for e in metrics["epochs"]] == [4] and metrics["time_to_target"]["steps"] == 4
    assert metrics["time_to_target"]["epochs"] == 1 and metrics["total_steps"] == 4 and metrics["measured_steps"] == 3


def test_augmented_epochs_end_their_windows_before_the_next_epochs_images():
    calls, metrics = _train({"window": 4}, samples=40, epochs=3, evaluate_every=3, augmentation=True)
    windows = _windows_between_syncs(calls)
    assert [w.count("step") for w in windows] == [4, 4, 2] * 3 and not any("images" in w for w in windows)
    assert calls.count("images") == 3 and calls.count("eval") == 1 and metrics["measured_steps"] == 30


def test_evaluate_every_is_checked_and_stated_in_the_report(tmp_path):
    from harness.results.overview import _evaluation

    path = tmp_path / "bad.yaml"
    path.write_text("name: t\nframeworks: [pytorch]\nmodel: {layers: [{type: flatten}, {type: dense, units: 10}]}\n"
                    "dataset: {name: digits}\nbatch_sizes: [8]\nevaluate_every: 0\n")
    with pytest.raises(SpecError) as err:
        load(path)
    assert "evaluate_every" in str(err.value) and str(path) in str(err.value)
    path.write_text(path.read_text().replace("evaluate_every: 0", "evaluate_every: 3"))
    from harness.plan import plan

    spec = load(path)
    assert {t.evaluate_every for t in plan(spec, "cpu")} == {3}
    assert _evaluation({}) == "evaluation after each epoch, not timed"
    assert "after every 5 epochs and the last" in _evaluation({"evaluate_every": 5})
    assert "every 1,000 training samples" in _evaluation({"evaluate_every_samples": 1000})
    path.write_text(path.read_text() + "evaluate_every_samples: 100\n")
    with pytest.raises(SpecError, match="evaluate_every.*evaluate_every_samples, not both"):
        load(path)
    path.write_text(path.read_text().replace("evaluate_every: 3", "evaluate_every: 1"))
    assert {t.evaluate_every_samples for t in plan(load(path), "cpu")} == {100}


class LastStepAdapter(RecordingAdapter):
    """An adapter that keeps no sum: a read gives the last step's loss, as one step, so the loop averages the
    losses at the windows' ends."""

    def read_loss(self):
        last = self.unread[-1] if self.unread else float("nan")
        super().read_loss()
        return last, 1


class NanStepAdapter(RecordingAdapter):
    """Step 10's loss alone is NaN (inside a window of 5, not at its end), as a one-off overflow would be."""

    def train_step(self, indices, micro_batches=1):
        super().train_step(indices, micro_batches)
        if self.steps == 11:
            self.unread[-1] = float("nan")


TIMINGS = [{"window": "step"}, {"window": 3}, {"window": 7},
           {"window": "auto", "window_seconds": 0.006, "min_window_steps": 2}]


def test_train_loss_is_the_mean_over_every_step_whatever_the_windows():
    """22 steps an epoch, 5 of them warm-up: every evaluation's train_loss is the mean of step_loss over every step
    since the evaluation before, warm-up included (train_loss_steps of them), whether the loop reads after every
    step, every 3 or 7, or in ~6 ms windows of 1 ms steps (as a faster or slower framework would). The loop before
    loss sums averaged the losses at the windows' ends: LastStepAdapter shows its answer moving with the windows by
    far more than the tolerance, so this test fails on it."""
    exact = [np.mean([step_loss(i) for i in range(22 * e, 22 * (e + 1))]) for e in range(3)]
    for timing in TIMINGS:
        _, metrics = _train(timing, epochs=3, warmup=5, step_s=0.001 if timing["window"] == "auto" else 0.0)
        assert [e["train_loss_steps"] for e in metrics["epochs"]] == [22, 22, 22], timing
        assert [e["train_loss"] for e in metrics["epochs"]] == pytest.approx(exact, rel=1e-12), timing
        assert metrics["final_train_loss"] == metrics["epochs"][-1]["train_loss"]
        _, metrics = _train(timing, epochs=3, warmup=5, evaluate_every=2)
        assert [(e["epoch"], e["train_loss_steps"]) for e in metrics["epochs"]] == [(1, 44), (2, 22)], timing
        assert metrics["epochs"][0]["train_loss"] == pytest.approx(np.mean(exact[:2]), rel=1e-12)
    old = {timing["window"]: _train(timing, epochs=3, warmup=5, adapter_cls=LastStepAdapter)[1]["epochs"][0]
           for timing in TIMINGS[:3]}
    for window in ("step", 3, 7):  # even one read per step missed the warm-up's steps but its last
        assert abs(old[window]["train_loss"] / exact[0] - 1) > 0.01, window
    assert abs(old[3]["train_loss"] / old[7]["train_loss"] - 1) > 0.01
    assert old[3]["train_loss_steps"] == 1 + 6  # the warm-up's read and six windows' (a last step each)


def test_a_nonfinite_step_inside_a_window_is_caught():
    """A NaN loss at a step that ends no window: the window's mean is NaN, so the epoch's train_loss is and the
    trial's nonfinite_loss is true (read at the windows' ends alone, the NaN was invisible)."""
    _, metrics = _train({"window": 5}, adapter_cls=NanStepAdapter)
    assert metrics["nonfinite_loss"] is True and np.isnan(metrics["final_train_loss"])
    _, metrics = _train({"window": 5})
    assert metrics["nonfinite_loss"] is False and np.isfinite(metrics["final_train_loss"])
