"""Every GPU of a data-parallel trial, against the fake NVML (tests/fakes/nvml.py, the hardware boundary) with several
GPUs that read differently: which GPUs CUDA_VISIBLE_DEVICES selects, each GPU's readings, the trial's over them
(energy and power summed, memory the most loaded GPU's, utilization averaged), the worker tree's memory on each GPU,
unavailable and failing metrics on one GPU, the fallback, NVML's reference count, and the per-device summaries."""

from __future__ import annotations

import pytest

from harness.measure.host import HostBackend
from harness.measure.multi_gpu import AGGREGATION, MultiNvmlBackend, combine, device_summaries
from harness.measure.sampler import make_backend
from harness.measure.windows import phase_stats
from tests.fakes.nvml import NotSupported, Unknown, fake_nvml, reading, uuids

DEVICES = ["cuda:0", "cuda:1", "cuda:2"]
VISIBLE = "2,0,1"  # the trial's cuda:0 is NVML's GPU 2, cuda:1 GPU 0, cuda:2 GPU 1
NVML_OF = [2, 0, 1]


def _three_gpus(tree_pids=None):
    nvml = fake_nvml(devices=uuids(3))
    if tree_pids is not None:
        worker, rank = tree_pids
        # NVML GPU 2 (the trial's cuda:0) holds the worker's 1.5 GB and the rank's stray 0.25 GB context; GPU 0 (the
        # trial's cuda:1) the rank's 2.5 GB; GPU 1 nothing of the trial.
        on = {2: [(worker, 1_500_000_000), (rank, 250_000_000)], 0: [(rank, 2_500_000_000)], 1: []}
        nvml.device_processes = lambda index: on[index]
    backend, note = make_backend(DEVICES, nvml=nvml, visible=VISIBLE)
    assert note is None and isinstance(backend, MultiNvmlBackend)
    return nvml, backend


def test_each_gpu_is_read_and_the_trial_combines_them(tree):
    nvml, backend = _three_gpus(tree)
    backend.attach(tree[0])
    sample = backend.sample()
    for i, index in enumerate(NVML_OF):
        assert sample[f"gpu_util_percent@{i}"] == reading("gpu", index)
        assert sample[f"power_w@{i}"] == reading("power_mw", index) / 1000
        assert sample[f"device_memory_used_bytes@{i}"] == reading("used_v2", index)
        assert sample[f"throttle_reasons@{i}"] == reading("reasons", index)
    assert [sample[f"process_memory_bytes@{i}"] for i in range(3)] == [1.75e9, 2.5e9, 0.0]
    assert sample["gpu_util_percent"] == pytest.approx(sum(reading("gpu", i) for i in range(3)) / 3)
    assert sample["power_w"] == pytest.approx(sum(reading("power_mw", i) for i in range(3)) / 1000)
    assert sample["energy_mj"] == sum(sample[f"energy_mj@{i}"] for i in range(3))
    assert sample["process_memory_bytes"] == 2.5e9  # the most loaded GPU, not the sum
    assert sample["device_memory_used_bytes"] == reading("used_v2", 2)
    assert sample["temperature_c"] == reading("temperature", 2)
    assert sample["throttle_reasons"] == 0x4 | 0x8 | 0x10
    assert sample["sm_clock_mhz"] == pytest.approx(1400.0)
    info = backend.describe()
    backend.close()
    assert [d["uuid"] for d in info["devices"]] == [uuids(3)[i] for i in NVML_OF]
    assert [(d["index"], d["device"], d["device_selector"]) for d in info["devices"]] == list(
        zip(range(3), DEVICES, NVML_OF))
    assert info["name"] == "Fake GPU" and info["uuid"] is None and info["backend"] == "nvml"
    assert "sum over the trial's devices" in info["metrics"]["energy_mj"]
    assert "max over the trial's devices" in info["metrics"]["process_memory_bytes"]
    assert nvml.calls["nvmlInit"] == 3 and nvml.init_count == 0  # every backend's init paired with a shutdown


def test_the_trial_reads_each_sample_once_per_gpu():
    nvml, backend = _three_gpus()
    backend.attach(4242)
    backend.sample()
    backend.sample()
    assert nvml.calls["nvmlDeviceGetUtilizationRates"] == 6 and nvml.calls["nvmlDeviceGetPowerUsage"] == 6
    backend.close()


def test_a_metric_one_gpu_lacks_is_unavailable_for_the_trial_and_kept_for_the_others():
    nvml = fake_nvml(devices=uuids(2), fail={"nvmlDeviceGetPowerUsage": [None, NotSupported()],
                                             "nvmlDeviceGetTemperature": [None, None, None, Unknown()]})
    backend, _ = make_backend(["cuda:0", "cuda:1"], nvml=nvml, visible="0,1")
    backend.attach(4242)
    first, second, third = backend.sample(), backend.sample(), backend.sample()
    assert first["power_w@0"] == 250.5 and "power_w@1" not in first and "power_w" not in first
    assert backend.unavailable["power_w"] == "cuda:1: nvmlDeviceGetPowerUsage: Not Supported"
    assert "power_w" not in backend.describe()["metrics"]
    # a transient failure on the second GPU: the trial's value is missing from that sample only
    assert first["temperature_c"] == 66.0 and second["temperature_c@0"] == 65.0
    assert second["temperature_c@1"] is None and second["temperature_c"] is None and third["temperature_c"] == 66.0
    assert backend.describe()["transient_errors"] == {"temperature_c@1": {"count": 1,
                                                                          "last": "NVMLError_Unknown: Unknown Error"}}
    backend.close()


def test_a_gpu_nvml_cannot_find_makes_the_whole_trial_sampled_on_the_host():
    nvml = fake_nvml(devices=uuids(2))
    backend, note = make_backend(["cuda:0", "cuda:1"], nvml=nvml, visible="1,5")
    assert isinstance(backend, HostBackend) and "InvalidArgument" in note and note.endswith("sampling the host instead")
    assert nvml.calls["nvmlInit"] == 2 and nvml.init_count == 0  # the GPU found first was closed again
    one, _ = make_backend(["cuda:0"], nvml=fake_nvml(devices=uuids(2)), visible="1")
    assert one.describe()["uuid"] == uuids(2)[1] and not isinstance(one, MultiNvmlBackend)


def test_combining_follows_the_documented_rule_and_never_sums_a_partial_counter():
    assert combine("energy_mj", [1, 2, 3]) == 6 and combine("energy_mj", [1, None]) is None
    assert combine("process_memory_bytes", [3.0, 5.0]) == 5.0 and combine("gpu_util_percent", [50, 100]) == 75
    assert combine("throttle_reasons", [0x1, 0x4]) == 0x5
    assert set(AGGREGATION.values()) == {"sum", "max", "or"}


def test_statistics_skip_each_gpus_counter_and_summaries_give_the_peak_over_devices():
    samples = [{"t": 0.0, "edge": "start", "energy_mj@0": 0, "energy_mj@1": 0, "process_memory_bytes@0": 1e9,
                "process_memory_bytes@1": 1e9, "gpu_util_percent@0": 0.0, "gpu_util_percent@1": 0.0},
               {"t": 1.0, "energy_mj@0": 100_000, "energy_mj@1": 300_000, "process_memory_bytes@0": 2e9,
                "process_memory_bytes@1": 3e9, "gpu_util_percent@0": 90.0, "gpu_util_percent@1": 50.0},
               {"t": 2.0, "edge": "end", "energy_mj@0": 200_000, "energy_mj@1": 600_000,
                "process_memory_bytes@0": 2.5e9, "process_memory_bytes@1": 2e9, "gpu_util_percent@0": 80.0,
                "gpu_util_percent@1": 60.0}]
    stats = phase_stats(samples, [(0.0, 2.0)])
    assert "energy_mj@0" not in stats and stats["process_memory_bytes@1"]["max"] == 3e9
    described = [{"index": 0, "device": "cuda:0"}, {"index": 1, "device": "cuda:1", "uuid": "GPU-x"}]
    summary = device_summaries(samples, [(0.0, 2.0)], described)
    assert summary["memory_peak_over_devices_bytes"] == 3e9 and summary["memory_peak_device"] == 1
    first, second = summary["devices"]
    assert (first["memory_peak_bytes"], first["memory_source"], first["gpu_util_mean_percent"]) == (
        2.5e9, "process_memory_bytes", 85.0)
    assert (first["joules"], second["joules"], first["energy_method"]) == (200.0, 600.0, "counter")
    assert second["uuid"] == "GPU-x"  # what describe() said of the device is kept
    # the worker's last event at 1.9 s: the end-edge sample after it (a worker gone from its GPUs) leaves the levels,
    # while each device's energy still reads the counter there, and the devices' joules still add up to the trial's
    late = device_summaries(samples, [(0.0, 2.0)], described, until=1.9)
    first, second = late["devices"]
    assert (first["memory_peak_bytes"], first["gpu_util_mean_percent"], second["gpu_util_mean_percent"]) == (
        2e9, 90.0, 50.0)
    assert (first["joules"], second["joules"]) == (200.0, 600.0)
