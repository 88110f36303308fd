"""benchmarks/step_host_costs.py on the CPU (its figures mean something on a GPU; here it must run and write them):
the PyTorch adapter's steps timed with the epochs' batches made inside and before the clock, and the profiler's
table of the step's operations."""

from __future__ import annotations

import json

import pytest

from benchmarks import step_host_costs


def test_it_times_the_adapters_steps_both_ways_and_writes_the_profile(tmp_path):
    assert step_host_costs.main(["--frameworks", "pytorch", "--steps", "6", "--repeats", "2", "--batch-size", "64",
                                 "--out", str(tmp_path)]) == 0
    costs = json.loads((tmp_path / "costs.json").read_text(encoding="utf-8"))
    figures = costs["pytorch"]
    assert "error" not in figures, figures
    assert set(figures) == {"batches_inside_us_per_step", "batches_before_us_per_step"}  # no CUDA: no pinned copy
    assert all(value > 0 for value in figures.values())
    assert costs["batch_size"] == 64 and costs["steps"] == 6
    profile = (tmp_path / "torch_profile.txt").read_text(encoding="utf-8")
    assert "aten::" in profile and "Self CPU" in profile


def test_a_framework_it_does_not_drive_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as end:
        step_host_costs.main(["--frameworks", "pytorch,mxnet", "--out", str(tmp_path)])
    assert end.value.code == 2 and "mxnet not one of pytorch, jax" in capsys.readouterr().err
    assert not (tmp_path / "costs.json").exists()
