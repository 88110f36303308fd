"""Sampling a data-parallel trial follows every device and every rank: real workers (the fault adapter as ``fault_dp``,
whose ranks are real processes), on the host through psutil, and on GPUs through the fake NVML (tests/fakes/nvml.py,
the hardware boundary) with the launcher mapping the worker's GPUs to NVML's through CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import psutil
import pytest

from harness.execution.launcher import run_worker
from harness.execution.protocol import Payload
from harness.measure import nvml as nvml_module
from harness.measure.host import process_tree
from harness.plan import checked_spec, plan
from harness.record import Phase
from tests.fakes.fault_adapter import DATA_PARALLEL_REGISTRATION, REGISTRATION
from tests.fakes.nvml import fake_nvml, reading, uuids
from tests.helpers import ROOT, base_spec


@pytest.fixture
def ranks_folder(tmp_path, monkeypatch):
    """The fault_dp adapter registered for the workers, its ranks recording their pids in the returned folder and
    meeting there before training (HARNESS_FAULT_BARRIER), and steps of 20 ms."""
    folder = tmp_path / "pids"
    folder.mkdir()
    for name, value in {"HARNESS_ADAPTERS": f"{REGISTRATION},{DATA_PARALLEL_REGISTRATION}", "PYTHONPATH": str(ROOT),
                        "HARNESS_FAULT_PIDS": str(folder), "HARNESS_FAULT_BARRIER": "1",
                        "HARNESS_STEP_SLEEP": "*:0.02"}.items():
        monkeypatch.setenv(name, value)
    return folder


def _ranks(folder):
    """rank -> pid, as the ranks recorded themselves."""
    return {int(name.split("-")[0][4:]): int(name.split("-")[1]) for name in os.listdir(folder)}


def _dp_trial(tmp_path):
    spec = checked_spec(base_spec(frameworks=["fault_dp"], batch_sizes=[16], data_parallel=2, warmup_steps=1),
                        tmp_path / "s.yaml")
    return spec, plan(spec, "cpu")[0]


def test_the_host_sampler_follows_every_rank(ranks_folder, tmp_path):
    """Rank 1 is in rank 0's process tree (rank 0 starts it), so the sampled resident memory is the ranks' sum."""
    spec, trial = _dp_trial(tmp_path)
    seen = {}

    def on_event(event):
        if isinstance(event, Phase) and event.name == "train" and "rss" not in seen:
            ranks = _ranks(ranks_folder)
            seen["tree"] = {p.pid for p in process_tree(ranks[0])}
            seen["ranks"] = ranks
            seen["rss"] = [psutil.Process(pid).memory_info().rss for pid in ranks.values()]

    outcome = run_worker(Payload(trial=trial), 120, 0.05, "cpu", trial.threads, on_event=on_event)
    assert outcome.status == "ok", outcome.reason
    assert sorted(seen["ranks"]) == [0, 1] and seen["ranks"][1] in seen["tree"]
    rss = outcome.sampler["stats"]["rss_bytes"]
    assert outcome.sampler["backend"] == "host" and rss["scope"] == "windows"
    assert rss["max"] >= 0.9 * sum(seen["rss"]) and sum(seen["rss"]) > 1.5 * min(seen["rss"])


def test_every_gpu_of_a_data_parallel_trial_is_sampled(ranks_folder, tmp_path, monkeypatch):
    """The worker's cuda:0 and cuda:1 are NVML's GPUs 2 and 0 (CUDA_VISIBLE_DEVICES=2,0): each is sampled, the
    memory of each rank counted on the GPU that holds it, energy summed over the two GPUs."""
    nvml = fake_nvml(devices=uuids(3))
    nvml.energy_mj = lambda: int(100_000 * time.monotonic())  # 100 W x (index + 1): GPU 2 300 W, GPU 0 100 W

    def on_gpu(index):  # rank 0 on GPU 2 with rank 1's stray context; rank 1 on GPU 0; a foreign process on GPU 1
        ranks = _ranks(ranks_folder)
        table = {2: [(ranks.get(0), 1_500_000_000), (ranks.get(1), 250_000_000)], 0: [(ranks.get(1), 2_500_000_000)],
                 1: [(os.getpid(), 7_000_000_000)]}
        return [(pid, used) for pid, used in table[index] if pid is not None]

    nvml.device_processes = on_gpu
    monkeypatch.setattr(nvml_module, "_nvml", lambda: nvml)
    spec, trial = _dp_trial(tmp_path)
    trial = replace(trial, device="cuda:0", devices=("cuda:0", "cuda:1"))
    outcome = run_worker(Payload(trial=trial), 120, 0.05, "cuda:0", trial.threads,
                         env={"CUDA_VISIBLE_DEVICES": "2,0"})
    assert outcome.status == "ok", outcome.reason
    assert outcome.result().settings["cuda_visible_devices"] == "2,0"
    info = outcome.sampler
    assert info["backend"] == "nvml" and info.get("note") is None
    assert [(d["device"], d["uuid"]) for d in info["devices"]] == [("cuda:0", uuids(3)[2]), ("cuda:1", uuids(3)[0])]
    assert [d["memory_peak_bytes"] for d in info["devices"]] == [1.75e9, 2.5e9]
    assert info["memory_peak_over_devices_bytes"] == 2.5e9 and info["memory_peak_device"] == 1
    assert info["stats"]["process_memory_bytes"]["max"] == 2.5e9  # the most loaded GPU, the peak over devices
    assert info["stats"]["gpu_util_percent"]["mean"] == (reading("gpu", 2) + reading("gpu", 0)) / 2
    assert [d["gpu_util_mean_percent"] for d in info["devices"]] == [reading("gpu", 2), reading("gpu", 0)]
    assert info["energy"]["method"] == "counter" and info["energy"]["mean_power_w"] == pytest.approx(400, rel=0.02)
    first, second = (d["joules"] for d in info["devices"])
    assert first + second == pytest.approx(info["energy"]["joules"]) and first == pytest.approx(3 * second, rel=0.02)
    assert nvml.init_count == 0 and nvml.calls["nvmlInit"] == 2
