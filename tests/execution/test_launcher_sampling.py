"""The launcher's side of sampling: a worker without a sampler, and energy, statistics and throttling from a
(fake) NVML around a real worker."""

from __future__ import annotations

import json
import threading
import time

import pytest

from harness.execution.protocol import Payload
from harness.measure.nvml import NvmlBackend
from harness.record import SamplerInfo, TrialRecord
from harness.results import derived
from tests.fakes.nvml import (
    UUID0,
    fake_nvml,
)


def _fault_trial(tmp_path, batch=64, epochs=3):
    from harness.plan import checked_spec as validate
    from harness.plan import plan
    from tests.helpers import base_spec

    spec = validate(base_spec(frameworks=["fault"], batch_sizes=[batch], epochs=epochs, warmup_steps=0),
                    tmp_path / "s.yaml")
    return spec, plan(spec, "cpu")[0]


def test_a_worker_can_run_without_any_sampler(fault_adapter, monkeypatch, tmp_path):
    from harness.execution import launcher

    monkeypatch.setattr(launcher, "make_backend", lambda *a, **k: pytest.fail("no backend may be made"))
    spec, trial = _fault_trial(tmp_path)
    threads_seen = set()

    def on_event(event):
        threads_seen.update(t.name for t in threading.enumerate())

    outcome = launcher.run_worker(Payload(trial=trial), 60, None, "cuda:0", trial.threads,
                                  on_event=on_event)
    assert outcome.status == "ok" and outcome.samples == []
    assert outcome.sampler == {"backend": None, "interval_s": None}
    assert threads_seen and "harness-sampler" not in threads_seen


def test_the_launcher_reports_energy_stats_and_throttling_from_nvml(fault_adapter, monkeypatch, tmp_path):
    """A real worker sampled through the fake NVML, whose energy counter runs at exactly 100 W."""
    from harness.execution import launcher

    monkeypatch.setenv("HARNESS_STEP_SLEEP", "*:0.01")  # 22 steps of >= 10 ms per epoch: windows of ~0.25 s
    nvml = fake_nvml()
    nvml.energy_mj = lambda: int(100_000 * time.monotonic())  # 100 W = 100_000 mJ/s
    made = {}

    def make(device, visible=None):
        made["backend"] = NvmlBackend(0, nvml=nvml)
        return made["backend"], None

    monkeypatch.setattr(launcher, "make_backend", make)
    spec, trial = _fault_trial(tmp_path)
    outcome = launcher.run_worker(Payload(trial=trial), 60, 0.05, "cuda:0", trial.threads)
    assert outcome.status == "ok"
    info = outcome.sampler
    assert info["backend"] == "nvml" and info["uuid"] == UUID0 and info["interval_s"] == 0.05
    energy, metrics = info["energy"], outcome.result().metrics
    assert energy["method"] == "counter" and energy["windows"] == 3 and energy["short_windows"] == 0
    assert energy["mean_power_w"] == pytest.approx(100.0, rel=0.02)
    assert energy["seconds"] == pytest.approx(metrics.measured_s, rel=0.05)
    assert "joules_per_sample" not in energy  # derived by the readers (harness.results.derived), from the record:
    record = TrialRecord(id=trial.id, framework=trial.framework, label=trial.row, batch_size=trial.batch_size, repeat=0,
                         device="cuda:0", status="ok", wall_s=1.0, metrics=metrics,
                         sampler=SamplerInfo.from_measure(info))
    assert derived.energy_per_sample_j(record) == pytest.approx(energy["joules"] / metrics.measured_samples)
    assert record.sampler.stat("gpu_util_pct", "mean") == 87.0 and record.sampler.energy.energy_j == energy["joules"]
    assert info["stats"]["gpu_util_percent"]["mean"] == 87.0 and info["stats"]["power_w"]["scope"] == "windows"
    # GPM values every period at least 100 ms after the last GPM read (interval 0.05 s: about every other sample)
    gpm = info["stats"]["sm_active_percent"]
    assert gpm["mean"] == 62.5 and 1 <= gpm["count"] < info["stats"]["gpu_util_percent"]["count"]
    times = nvml.gpm_sample_times
    assert len(times) >= 3 and all(b - a > 0.1 for a, b in zip(times, times[1:]))
    assert "energy_mj" not in info["stats"] and "throttle_reasons" not in info["stats"]
    assert info["throttle"]["share"] == {"sw_power_cap": 1.0}
    assert info["sample_cost_s"]["count"] == len(outcome.samples) and info["sample_cost_s"]["median"] < 0.05
    # windows of ~0.25 s: every end is sampled; a start right after the previous end (a short evaluation between
    # epochs) may be dropped, that end sample standing for it
    edges = [s.get("edge") for s in outcome.samples if s.get("edge")]
    assert edges.count("end") == 3 and edges.count("start") + info["edge_samples_dropped"] == 3
    assert nvml.calls["nvmlShutdown"] == 1  # closed after the sampler stopped
    json.dumps(info, allow_nan=False)  # the trial record is JSON


def test_levels_leave_out_samples_taken_after_the_workers_last_event():
    """A short window's end-edge sample can come after the worker's result (2026-11-27: 5 ms late, the worker gone
    or tearing down, reading 0 or half its memory): the levels (``stats``) leave it out. (The energy, a board
    counter, keeps every sample: tests/measure/test_multi_gpu.py checks both sides for each device.)"""
    from harness.execution.launcher import sampler_info
    from harness.measure.host import HostBackend
    from harness.measure.sampler import Sampler
    from harness.record.events import Phase, Result
    from harness.record.metrics import TrialMetrics

    events = [Phase(name="train", edge="start", t=1.0), Phase(name="train", edge="end", t=2.0),
              Result(metrics=TrialMetrics(), t=2.002)]
    sampler = Sampler(HostBackend())
    sampler.samples = [{"t": 1.5, "cpu_percent": 90.0, "rss_bytes": 300.0, "rss_anon_bytes": 200.0},
                       {"t": 2.005, "edge": "end", "cpu_percent": 40.0, "rss_bytes": 150.0, "rss_anon_bytes": 100.0}]
    stats = sampler_info(sampler, None, events)["stats"]
    assert stats["rss_anon_bytes"] == {"mean": 200.0, "median": 200.0, "max": 200.0, "count": 1, "scope": "windows"}
    assert stats["cpu_percent"]["count"] == 1 and stats["cpu_percent"]["mean"] == 90.0
    # the late sample alone in the window (beside the start edge's baseline): no level rather than the exiting worker's
    sampler.samples = [{"t": 1.0, "edge": "start", "cpu_percent": 0.0, "rss_bytes": 300.0, "rss_anon_bytes": 200.0},
                       sampler.samples[1]]
    assert sampler_info(sampler, None, events)["stats"]["rss_anon_bytes"] == {
        "mean": None, "median": None, "max": None, "count": 0, "scope": "none"}
    events[-1] = Result(metrics=TrialMetrics(), t=2.01)  # taken before the worker's last event: it belongs
    assert sampler_info(sampler, None, events)["stats"]["rss_anon_bytes"]["max"] == 100.0
