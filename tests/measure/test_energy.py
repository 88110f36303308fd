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




def test_windows_shorter_than_the_counters_refresh_give_no_figure_not_zero():
    """An H200 read 0.0 J for 5.6 ms of training (batch 1024 of a small CNN): both edges fell between two updates of
    the counter. Timed windows that together are shorter than the refresh get None and a note; longer ones keep their
    figure even where one window is short."""
    samples = [{"t": 0.1 * i, "energy_mj": 20_000 * (i // 1), "power_w": 200.0} for i in range(30)]
    flat = [{**s, "energy_mj": 20_000 * (i // 1 if i < 10 else 10)} for i, s in enumerate(samples)]
    short = energy_over_windows(flat, [(1.502, 1.5076)])
    assert short["joules"] is None and short["mean_power_w"] is None and short["method"] == "counter"
    assert "0.006 s, less than the reading's refresh (0.1 s)" in short["note"]
    longer = energy_over_windows(samples, [(0.5, 0.55), (1.0, 1.2)])
    assert longer["joules"] == pytest.approx(0.25 * 200) and "note" not in longer


def test_utilization_gets_no_statistic_over_windows_shorter_than_the_drivers_period():
    from harness.measure.windows import PERIOD_AVERAGED_S, phase_stats

    samples = [{"t": 0.05 * i, "gpu_util_percent": 0.0 if i < 20 else 90.0, "sm_active_percent": 50.0,
                "edge": "end" if i == 21 else None} for i in range(40)]
    tiny = phase_stats(samples, [(1.049, 1.05)])  # 1 ms: the end-edge sample at 1.05 s would read 90 %
    assert tiny["gpu_util_percent"] == {"mean": None, "median": None, "max": None, "count": 0, "scope": "too short"}
    # GPM covers the interval between two of its reads, at least 0.1 s: an H200 read 0.0 % SM activity over 70 ms
    assert tiny["sm_active_percent"] == {"mean": None, "median": None, "max": None, "count": 0, "scope": "too short"}
    gpm = phase_stats(samples, [(1.0, 1.0 + PERIOD_AVERAGED_S["sm_active_percent"] + 0.01)])
    assert gpm["sm_active_percent"]["mean"] == 50.0 and gpm["sm_active_percent"]["scope"] == "windows"
    assert PERIOD_AVERAGED_S["sm_active_percent"] == PERIOD_AVERAGED_S["tensor_active_percent"] == 0.1
    enough = phase_stats(samples, [(1.0, 1.0 + PERIOD_AVERAGED_S["gpu_util_percent"] + 0.01)])
    assert enough["gpu_util_percent"]["mean"] == pytest.approx(90.0)
    assert enough["gpu_util_percent"]["scope"] == "windows"
