"""The report's "Data-parallel scaling" section from trial records: the scaling efficiency, the memory of the most
loaded GPU (the peak over devices) and each GPU's, the host's memory of all ranks together, and why the all-reduce's
share of the step is not measured."""

from __future__ import annotations

from types import SimpleNamespace

from harness.record import TrialRecord
from harness.results import derived
from harness.results.data_parallel import data_parallel_section
from harness.results.sections import Table, to_markdown


def _record(devices, throughput, repeat=0, peaks=None, process_peak=None, rss=None, **sampled):
    """An ok record of the pytorch row at 32 samples per device, its sampler as the launcher writes it: on GPUs the
    trial's process memory (stats, the most loaded device's) and each device's peak (``peaks``, bytes)."""
    sampler = {"stats": {}, **sampled}
    if process_peak is not None:
        sampler["stats"]["process_memory_bytes"] = {"max": process_peak}
    if rss is not None:
        sampler["stats"]["rss_bytes"] = {"max": rss}
    if peaks is not None:
        sampler["devices"] = [{"index": i, "device": f"cuda:{i}", "memory_peak_bytes": p} for i, p in enumerate(peaks)]
        sampler["memory_peak_over_devices_bytes"] = max(peaks)
    return TrialRecord.model_validate({
        "id": f"pytorch-dp{devices}-r{repeat}", "framework": "pytorch", "label": "pytorch", "status": "ok",
        "batch_size": 32 * devices, "per_device_batch_size": 32, "data_parallel": devices, "repeat": repeat,
        "variant": f"{devices} device" + ("s" if devices > 1 else ""), "device": "cuda:0", "wall_s": 1.0,
        "metrics": {"throughput_samples_per_s": throughput,
                    "data_parallelism": {"devices": [f"cuda:{i}" for i in range(devices)],
                                         "mechanism": "DistributedDataParallel"}},
        "sampler": sampler})


def _data(records, backend, device):
    """What the section reads of a run's ReportData."""
    return SimpleNamespace(records=records, backend=backend, run=SimpleNamespace(device=device))


def _tables(section):
    return [block for block in section.blocks if isinstance(block, Table)]


def test_gpu_memory_is_the_peak_over_devices_and_each_device_is_listed():
    records = [_record(1, 1000.0, process_peak=2.0e9),
               _record(2, 1800.0, repeat=0, peaks=[2.5e9, 2.1e9], process_peak=2.5e9),
               _record(2, 1900.0, repeat=1, peaks=[2.7e9, 2.3e9], process_peak=2.7e9)]
    section = data_parallel_section(_data(records, "nvml", "cuda:0"))
    throughput, memory, per_device = _tables(section)
    assert throughput.rows == (("PyTorch", "1", "1,000 (n=1)"), ("PyTorch", "2", "1,850 (0.93, n=2)"))
    assert memory.rows == (("PyTorch", "1", "2,000.0"), ("PyTorch", "2", "2,600.0"))
    assert per_device.rows == (("PyTorch", "2", "2,600.0 / 2,200.0"),)
    text = to_markdown([section])
    assert "on the most loaded device: the peak over the trial's devices" in text
    assert "The all-reduce's share of the step is not measured" in text and "overlaps it with the backward" in text
    assert "MirroredStrategy" in text and "kvstore" in text and "XLA" in text


def test_host_memory_is_every_rank_together_with_no_per_device_table():
    records = [_record(1, 500.0, rss=1.0e8), _record(2, 600.0, rss=1.9e8)]
    section = data_parallel_section(_data(records, "host", "cpu"))
    throughput, memory = _tables(section)
    assert memory.rows == (("PyTorch", "1", "100.0"), ("PyTorch", "2", "190.0"))
    text = to_markdown([section])
    assert "all devices of the trial together" in text and "no per-device figure" in text
    assert "logical devices (or processes) sharing the same cores" in text


def test_mfu_of_a_data_parallel_trial_is_against_all_its_gpus():
    from harness.measure import peaks

    name = "NVIDIA H100 80GB HBM3"
    peak, _ = peaks.lookup(name, "fp32")
    one, two = _record(1, 1000.0, name=name), _record(2, 1000.0, name=name)
    for record in (one, two):
        record.metrics.achieved_flops_per_s = peak / 2
    assert derived.mfu(one).fraction == 0.5 and derived.mfu(two).fraction == 0.25
    assert derived.mfu(two).peak_flops_per_s == 2 * peak
