"""The decision's arithmetic (``harness.studies.advise``): the gradient noise scale's estimator on norms whose
expectations are known, its interval, the candidates, the knee and the prediction of time to target."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.record import EpochMetrics, GradientNoise
from harness.studies.advise.noise import estimates, noise_scale
from harness.studies.advise.predict import Speed, candidates, fastest_and_knee, predict, steps_to_target


def _epoch(epoch, g2, trace, b=4, big=32, probes=4, accuracy=0.5, noise=0.0, rng=None):
    """An evaluation whose norms are their expectations E|G_b|^2 = |G|^2 + tr(Sigma) / b (plus relative noise)."""
    rng = rng or np.random.default_rng(epoch)
    small = [(g2 + trace / b) * (1 + noise * rng.standard_normal()) for _ in range(probes)]
    whole = [(g2 + trace / big) * (1 + noise * rng.standard_normal()) for _ in range(probes)]
    return EpochMetrics(epoch=epoch, train_loss=1.0 / (epoch + 1), test_accuracy=accuracy,
                        gradient_noise=GradientNoise(micro_batch=b, batch=big, small=small, big=whole, seconds=0.1))


def test_the_estimates_invert_the_expected_norms_exactly():
    e = _epoch(0, g2=2.0, trace=300.0)
    g2, trace = estimates(e.gradient_noise)
    assert np.allclose(g2, 2.0) and np.allclose(trace, 300.0)
    scale = noise_scale([e, _epoch(1, 2.0, 300.0), _epoch(2, 2.0, 300.0)])
    assert scale.b_simple == pytest.approx(150.0)
    assert [row["b_simple"] for row in scale.trajectory] == pytest.approx([150.0] * 3)


def test_the_value_is_taken_where_the_target_is_first_reached_and_the_trajectory_grows_as_the_loss_falls():
    epochs = [_epoch(i, g2=4.0 / (i + 1), trace=100.0, accuracy=0.8 + 0.05 * i) for i in range(5)]
    scale = noise_scale(epochs, target=0.9)
    assert scale.at_epoch == 2
    # pooled over epochs 0..2 (WINDOW): mean tr(Sigma) / mean |G|^2, a ratio of means, never a mean of ratios
    assert scale.b_simple == pytest.approx(100.0 / np.mean([4.0, 2.0, 4.0 / 3]))
    values = [row["b_simple"] for row in scale.trajectory]
    assert values == sorted(values) and values[0] == pytest.approx(25.0)
    assert noise_scale(epochs).at_epoch == 4  # no target: the last evaluation


def test_the_interval_holds_the_true_value_in_most_draws():
    """Norms with 20 % relative noise around their expectations: the 95 % bootstrap interval holds B_simple = 150
    in at least 85 of 100 draws, and is never a point."""
    held = 0
    for draw in range(100):
        rng = np.random.default_rng(draw)
        scale = noise_scale([_epoch(i, 2.0, 300.0, probes=8, noise=0.2, rng=rng) for i in range(3)], seed=draw)
        low, high = scale.interval
        assert low < high
        held += low <= 150.0 <= high
    assert held >= 85, held


def test_what_cannot_be_estimated_says_why():
    assert noise_scale([EpochMetrics(epoch=0)]).reason == "no gradient norms were recorded"
    drowned = _epoch(0, g2=-1.0, trace=300.0)  # |G|^2 estimated below zero: all noise
    scale = noise_scale([drowned])
    assert scale.b_simple is None and "not positive" in scale.reason
    one = EpochMetrics(epoch=0, gradient_noise=GradientNoise(micro_batch=8, batch=8, small=[1.0], big=[1.0],
                                                             seconds=0.0))
    assert "two sizes" in noise_scale([one]).reason


def test_candidates_are_powers_of_two_with_the_ends_the_recommendation_and_neighbours_of_one():
    assert candidates(8, 256) == [8, 16, 32, 63, 64, 65, 128, 256]
    assert candidates(6, 200, recommended=180) == [6, 8, 16, 31, 32, 33, 64, 128, 180, 200]
    assert candidates(4, 4) == [4]
    with pytest.raises(ValueError):
        candidates(0, 4)


def test_the_fastest_and_the_knee():
    speeds = [Speed(8, [0.01] * 3, [800.0, 810.0, 790.0]), Speed(16, [0.01] * 3, [1500.0, 1520.0, 1480.0]),
              Speed(32, [0.02] * 3, [1590.0, 1600.0, 1610.0]), Speed(64, [0.04] * 3, [1620.0, 1660.0, 1580.0])]
    best, knee = fastest_and_knee(speeds)
    assert best.batch_size == 64
    assert knee.batch_size == 16  # its interval, 1500 +- 50, reaches 0.95 x 1620 = 1539
    speeds[1] = Speed(16, [0.01] * 3, [1450.0, 1460.0, 1440.0])  # 1450 +- 25 does not
    assert fastest_and_knee(speeds)[1].batch_size == 32


def test_time_to_target_is_steps_times_step_time_and_the_best_size_minimises_it():
    assert steps_to_target(100, 100, 50) == 100
    speeds = [Speed(b, [t], [b / t]) for b, t in ((8, 0.001), (32, 0.0012), (128, 0.003), (512, 0.011))]
    p = predict(speeds, b_noise=110.0, interval=(80.0, 150.0), s_min=48.0)
    seconds = {r["batch_size"]: r["seconds"] for r in p.rows}
    assert seconds[32] == pytest.approx(48 * (1 + 110 / 32) * 0.0012)
    assert p.time_best == min(seconds, key=seconds.get)
    brute = {b: min(((1 + n / s.batch_size) * s.step_s[0], s.batch_size) for s in speeds)[1] for b, n in
             ((0, 80.0), (1, 110.0), (2, 150.0))}
    assert p.time_range == (min(brute.values()), max(brute.values()))
    assert p.energy_best is None and p.energy_range is None  # no energy per step measured
    relative = predict(speeds, 110.0, None, None)  # without S_min: ranked, no seconds
    assert relative.time_best == p.time_best and all(r["seconds"] is None for r in relative.rows)


def test_the_energy_answer_says_whether_the_counter_is_missing_or_the_windows_were_too_short():
    """On the H200 (2026-11-28) every JAX trial's windows were shorter than the counter's refresh: that is no
    missing counter, and the answer must say which; sizes without a figure are named, not silently dropped."""
    from harness.studies.advise.command import entry_answer
    from harness.studies.advise.noise import NoiseScale

    noise = NoiseScale(8, 64, b_simple=100.0, interval=(80.0, 130.0))
    short = "the timed windows total 0.022 s, less than the reading's refresh (0.1 s): no energy figure"

    def energy(speeds):
        return entry_answer("x", ("energy",), None, speeds, noise, 100, 64, 0.9, "cuda:0")["objectives"]["energy"]

    cpu = energy([Speed(64, [0.01], [6400.0]), Speed(128, [0.015], [8533.0])])
    assert cpu["batch_size"] is None and cpu["reason"].startswith("no energy counter on cuda:0")
    windows = energy([Speed(64, [0.01], [6400.0], energy_notes=[short])])
    assert windows["batch_size"] is None and windows["reason"] == f"no size has an energy figure ({short})"
    partial = energy([Speed(64, [0.01], [6400.0], [2.0]), Speed(128, [0.015], [8533.0], energy_notes=[short]),
                      Speed(256, [0.02], [12800.0], [3.0])])
    assert partial["batch_size"] == 256 and partial["unranked"] == [128]  # (1 + 100/256) 3.0 < (1 + 100/64) 2.0
    assert "sizes without an energy figure, not ranked: 128" in partial["note"]
    assert partial["predicted"] == pytest.approx(100 / (1 + 100 / 64) * (1 + 100 / 256) * 3.0)


def test_a_throughput_trial_times_no_more_than_the_training_to_the_target_it_predicts():
    """The compute goal (issue 56): on digits training to the target takes hundredths of a second, less than a
    second of timing a trial; the bound turns each throughput trial into about the training it predicts."""
    from harness.studies.advise.noise import NoiseScale
    from harness.studies.advise.trials import MIN_BOUNDED_STEPS, MIN_TIMED_S, MIN_TIMED_STEPS, steps_model, timed_steps

    assert timed_steps(64, None, None) == MIN_TIMED_STEPS  # nothing calibrated
    assert timed_steps(64, 0.001, None) == round(MIN_TIMED_S / 0.001)  # about a second
    assert timed_steps(64, 0.05, None) == round(MIN_TIMED_S / 0.05)  # 20 steps of 50 ms
    assert timed_steps(64, 0.4, None) == MIN_BOUNDED_STEPS  # slow steps: the least count, 4 s
    model = steps_model(NoiseScale(8, 64, b_simple=100.0, interval=(80.0, 130.0)), 120, 64)
    assert model == pytest.approx((100.0, 120 / (1 + 100 / 64)))
    b_noise, s_min = model
    at_512 = s_min * (1 + b_noise / 512)
    assert timed_steps(512, 0.001, model) == math.ceil(at_512) < round(MIN_TIMED_S / 0.001)
    assert timed_steps(8, 0.01, model) == round(MIN_TIMED_S / 0.01)  # the goal caps a long prediction
    tiny = (1.0, 2.0)  # 2 steps predicted: the floor
    assert timed_steps(512, 0.001, tiny) == MIN_BOUNDED_STEPS
    assert timed_steps(512, 0.001, tiny, floor_s=0.5) == 500  # an energy counter's refresh
    assert steps_model(NoiseScale(8, 64, b_simple=100.0), None, 64) is None  # the target was not reached
    assert steps_model(NoiseScale(8, 64, reason="one micro-batch"), 120, 64) is None


def test_a_throughput_trial_trains_the_steps_it_times_not_whole_epochs(tmp_path):
    """A trial asked for 100 timed steps at batch 8 of 4096 training samples (512 steps an epoch) trains the warm-up
    and those 100, not the epoch (the copy task's throughput stage trained 512 steps at 8 and spent 0.46 of an
    exhaustive sweep's compute); where an epoch holds fewer, the fewest epochs, each an equal share."""
    from harness.plan import checked_spec
    from harness.studies.advise.trials import _adjust, _steps_epochs
    from tests.helpers import base_spec

    spec = checked_spec(base_spec(warmup_steps=1), tmp_path / "s.yaml")
    assert _steps_epochs(spec, 4096, 8, 100) == (1, 101)
    assert _steps_epochs(spec, 4096, 256, 50) == (4, 13)  # 16 steps an epoch: 4 epochs of 13, 52 >= 51 steps
    assert _steps_epochs(spec, 4096, 4096, 9) == (10, 1)
    from harness.plan import plan

    trial = _adjust(lambda t: (4, 13))(plan(spec, "cpu")[0])
    assert (trial.epochs, trial.evaluate_every, trial.max_steps_per_epoch) == (4, 4, 13)


def test_successive_halving_keeps_the_faster_half_and_judges_the_prediction():
    """Each round trains the survivors with new seeds; the slower half goes (an unreached seed counts as
    infinitely slow); at most two get the last round; the prediction held when within HOLD_RATIO of the best."""
    from harness.studies.advise.validate import HOLD_RATIO, SEEDS_PER_ROUND, successive_halving

    true_s = {8: 0.20, 16: 0.12, 32: 0.08, 64: 0.05, 128: 0.04, 256: 0.045, 512: None}  # 512 never reaches it
    calls = []

    def train(sizes, seeds):
        calls.append((list(sizes), list(seeds)))
        return {b: [None if true_s[b] is None else true_s[b] * (1 + 0.01 * s) for s in seeds] for b in sizes}

    result = successive_halving(sorted(true_s), train, first_seed=3)
    assert [c[0] for c in calls] == [[8, 16, 32, 64, 128, 256, 512], [32, 64, 128, 256], [128, 256]]
    assert [c[1] for c in calls] == [[3, 4], [5, 6], [7, 8]] and SEEDS_PER_ROUND == 2
    assert result.best == 128 and len(result.seconds[128]) == 6 and len(result.seconds[8]) == 2
    held = result.judge(256)  # the runner-up, the same 6 seeds
    assert held["held"] is True and held["ratio"] == pytest.approx(0.045 / 0.04)
    assert held["measured_best_s"] == pytest.approx(0.04 * 1.055) and held["rounds"][-1] == [128, 256]
    slow = result.judge(16)  # dropped after round 1, its 2 seeds
    assert slow["predicted_measured_s"] == pytest.approx(0.12 * 1.035) and slow["held"] is False
    assert slow["ratio"] > HOLD_RATIO and slow["measured_best"] == 128
    never = result.judge(512)
    assert never["held"] is False and never["ratio"] is None and never["sizes"]["512"]["reached"] == 0
    assert result.judge(1024)["held"] is None  # not a candidate: cannot be told
    budget = iter([True, False])
    cut = successive_halving(sorted(true_s), train, first_seed=0, allows=lambda: next(budget))
    assert cut.cut and len(cut.rounds) == 1 and cut.best == 128
    with pytest.raises(ValueError):
        successive_halving([], train, first_seed=0)


def test_the_plans_for_a_global_batch_reach_it_with_micro_batches_that_hold():
    from harness.studies.advise.global_batch import Plan, plans

    one = plans(1024, 100)  # 64 is the largest divisor of 1024 up to 100
    assert one == [Plan(64, 16), Plan(32, 32), Plan(16, 64)] and all(p.global_batch == 1024 for p in one)
    assert plans(96, 1000) == [Plan(96, 1), Plan(48, 2), Plan(24, 4)]  # it fits: one batch, then halves
    assert plans(12, 5) == [Plan(4, 3), Plan(2, 6), Plan(1, 12)]
    assert plans(10, 4)[0] == Plan(2, 5) and Plan(5, 2) not in plans(10, 4)  # 5 does not hold
    multi = plans(1024, 100, devices=4)
    assert multi[:3] == one and multi[3:] == [Plan(64, 4, 4), Plan(32, 8, 4), Plan(16, 16, 4)]
    assert multi[3].name == "4 devices x 64 x 4 accumulated" and Plan(96, 1).name == "96"
    assert all(p.devices == 1 for p in plans(1022, 100, devices=4))  # 4 does not divide 1022
    with pytest.raises(ValueError):
        plans(0, 10)


def test_the_time_energy_frontier_keeps_the_sizes_no_other_beats_in_both():
    from harness.studies.advise.plot import frontier

    points = [(64, 1.0, 10.0), (128, 0.8, 12.0), (256, 0.9, 13.0), (512, 0.7, 20.0), (32, 1.5, 9.0), (16, 1.5, 9.5)]
    assert frontier(points) == [512, 128, 64, 32]  # 256 loses to 128 in both; 16 to 32 in joules at equal seconds
    assert frontier([(8, 1.0, 1.0), (16, 1.0, 1.0)]) == [8, 16]  # equal points beat neither
