"""Energy over timed windows from NVML's energy counter or from integrated power readings."""

from __future__ import annotations

import pytest

from harness.measure.energy import COUNTER_UPDATE_S, POWER_AVERAGING_S, energy_over_windows


def test_energy_from_the_counter_interpolates_at_the_window_edges():
    # 200 W for t in [0, 10] (200 J/s = 200_000 mJ/s), read every 0.5 s; then 50 W
    samples = [{"t": 0.5 * i, "energy_mj": 100_000 * i, "power_w": 1.0} for i in range(21)]
    samples += [{"t": 10.0 + 0.5 * i, "energy_mj": 2_000_000 + 25_000 * i} for i in range(1, 5)]
    samples.append({"t": 3.3, "energy_mj": None})  # a transient gap is skipped
    windows = [(1.25, 3.75), (9.0, 11.0), (4.0, 4.05)]  # 2.5 s at 200 W; 1 s at 200 W + 1 s at 50 W; 0.05 s
    energy = energy_over_windows(samples, windows)
    assert energy["method"] == "counter"
    assert energy["joules"] == pytest.approx(500 + 250 + 10)
    assert energy["seconds"] == pytest.approx(4.55) and energy["windows"] == 3
    assert energy["short_windows"] == 1 and energy["short_window_s"] == COUNTER_UPDATE_S
    assert energy["mean_power_w"] == pytest.approx(760 / 4.55) and energy["unbracketed_edges"] == 0


def test_energy_from_power_integration_when_there_is_no_counter():
    # power ramps 100 -> 300 W over [0, 2], then holds 300 W; trapezoids are exact for piecewise-linear power
    samples = [{"t": 0.0, "power_w": 100.0}, {"t": 1.0, "power_w": 200.0}, {"t": 2.0, "power_w": 300.0},
               {"t": 4.0, "power_w": 300.0}, {"t": 3.0, "power_w": None, "energy_mj": None}]
    energy = energy_over_windows(samples, [(0.5, 1.5), (2.0, 4.0), (3.0, 3.5)])
    # [0.5, 1.5]: mean 200 W -> 200 J; [2, 4]: 600 J; [3, 3.5]: 150 J
    assert energy["method"] == "power_integral" and energy["joules"] == pytest.approx(950.0)
    assert energy["short_window_s"] == POWER_AVERAGING_S and energy["short_windows"] == 1  # 0.5 s < 1 s
    assert energy["mean_power_w"] == pytest.approx(950 / 3.5)


def test_energy_counts_edges_outside_the_readings():
    samples = [{"t": 1.0, "power_w": 100.0}, {"t": 2.0, "power_w": 100.0}]
    energy = energy_over_windows(samples, [(0.0, 3.0)])
    assert energy["unbracketed_edges"] == 2 and energy["joules"] == pytest.approx(300.0)  # held flat outside


def test_energy_counter_that_goes_backwards_is_not_trusted():
    samples = [{"t": 0.0, "energy_mj": 5_000, "power_w": 10.0}, {"t": 1.0, "energy_mj": 10, "power_w": 10.0}]
    energy = energy_over_windows(samples, [(0.0, 1.0)])
    assert energy["method"] == "power_integral" and energy["joules"] == pytest.approx(10.0)
    assert "backwards" in energy["note"]


def test_energy_without_readings_or_windows_is_none():
    assert energy_over_windows([{"t": 1.0, "cpu_percent": 50.0}], [(0.0, 2.0)]) == {
        "joules": None, "method": None, "seconds": 2.0, "short_windows": 0, "short_window_s": None, "windows": 1,
        "unbracketed_edges": 0, "mean_power_w": None}
    assert energy_over_windows([{"t": 1.0, "energy_mj": 5}], [])["joules"] is None
    one = energy_over_windows([{"t": 1.0, "energy_mj": 5, "power_w": 20.0}], [(0.0, 2.0)])  # one counter reading
    assert one["method"] == "power_integral" and one["joules"] == pytest.approx(40.0)


