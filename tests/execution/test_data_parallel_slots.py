"""A data-parallel trial on the local executor's slots: N GPUs of the machine at once (CUDA_VISIBLE_DEVICES listing
them, the worker training on cuda:0..N-1, the sampler watching each), or N slots' cores together; the slots freed at
its end; a trial that needs more slots than there are stopped before anything runs. Real workers (the fault adapter
as ``fault_dp``); the GPUs are the fake NVML's (tests/fakes/nvml.py, the hardware boundary)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.execution.executors import ExecutorError, LocalExecutor, Slot, joined, local_slots
from harness.execution.protocol import Payload
from harness.measure import nvml as nvml_module
from harness.plan import checked_spec, plan
from harness.record import Start
from tests.fakes.fault_adapter import DATA_PARALLEL_REGISTRATION, REGISTRATION
from tests.fakes.nvml import fake_nvml, uuids
from tests.helpers import ROOT, base_spec


@pytest.fixture
def dp_adapters(monkeypatch):
    monkeypatch.setenv("HARNESS_ADAPTERS", f"{REGISTRATION},{DATA_PARALLEL_REGISTRATION}")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))


def _payloads(tmp_path, device):
    """A data-parallel trial of fault_dp on two devices and a one-device trial of fault, planned on ``device``."""
    spec = checked_spec(base_spec(frameworks=["fault_dp", "fault"], batch_sizes=[16], warmup_steps=1,
                                  variants={"data_parallel": [2, 1]}), tmp_path / "s.yaml")
    trials = {t.id: t for t in plan(spec, device)}
    return (Payload(trial=trials["fault-dp-bs16-r0-v0-dp2"]),
            Payload(trial=trials["fault-bs16-r0-v1"]))


def test_joined_slots_list_their_gpus_or_pool_their_cores():
    gpus = [Slot("cuda:4", "cuda:0", {"CUDA_VISIBLE_DEVICES": "4"}),
            Slot("cuda:6", "cuda:0", {"CUDA_VISIBLE_DEVICES": "6"})]
    assert joined(gpus) == Slot("cuda:4", "cuda:0", {"CUDA_VISIBLE_DEVICES": "4,6"})
    cores = local_slots("cpu", parallel=3, threads=2, cpus=list(range(6)))
    assert joined(cores[1:]) == Slot("cpu", "cpu", {}, (2, 3, 4, 5), 4)
    whole = LocalExecutor(local_slots("cuda:0"))  # one slot, the machine as it is: a trial of any size takes it
    assert whole.slots_for(8) == 1 and whole.has_room(8)
    whole.check(8)
    four = LocalExecutor(local_slots("cuda:0", devices=["cuda:0", "cuda:1", "cuda:2", "cuda:3"], env={}))
    assert four.slots_for(2) == 2 and four.has_room(4)
    with pytest.raises(ExecutorError, match=r"a trial on 8 devices takes 8 slots, one per device, and the local "
                                            r"executor has 4: cuda:0, cuda:1, cuda:2, cuda:3"):
        four.check(8)


def test_a_data_parallel_trial_takes_two_gpus_and_frees_both(dp_adapters, tmp_path, monkeypatch):
    """Three GPU slots behind the caller's CUDA_VISIBLE_DEVICES=2,0,1: the data-parallel trial gets the first two
    (NVML's GPUs 2 and 0, the worker's cuda:0 and cuda:1), the one-device trial the third (NVML's GPU 1): each
    sampler watches exactly its trial's GPUs."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,1")
    nvml = fake_nvml(devices=uuids(3))
    monkeypatch.setattr(nvml_module, "_nvml", lambda: nvml)
    executor = LocalExecutor(local_slots("cuda:0", devices=["cuda:0", "cuda:1", "cuda:2"]))
    dp, one = _payloads(tmp_path, "cuda:0")
    try:
        assert executor.has_room(2)
        slot = executor.submit("dp", dp, 120, 0.05, 1)
        assert slot.env == {"CUDA_VISIBLE_DEVICES": "2,0"} and slot.worker_device == "cuda:0"
        assert not executor.has_room(2) and executor.has_room(1)
        executor.submit("one", one, 120, 0.05, 1)
        assert not executor.has_room(1)
        finished = {f.key: f for f in (executor.wait(), executor.wait())}
    finally:
        executor.close()
    assert executor.has_room(3) and executor.free == executor.slots  # every slot back, in their order
    pair, alone = finished["dp"], finished["one"]
    assert pair.outcome.status == alone.outcome.status == "ok", (pair.outcome.reason, alone.outcome.reason)
    assert (pair.placement.device, pair.placement.devices) == ("cuda:2", ["cuda:2", "cuda:0"])
    assert (alone.placement.device, alone.placement.devices) == ("cuda:1", None)
    result = pair.outcome.result()
    assert result.settings["cuda_visible_devices"] == "2,0"
    assert result.metrics.data_parallelism.devices == ["cuda:0", "cuda:1"]
    assert [d["uuid"] for d in pair.outcome.sampler["devices"]] == [uuids(3)[2], uuids(3)[0]]
    assert alone.outcome.result().settings["cuda_visible_devices"] == "1"
    assert alone.outcome.sampler["uuid"] == uuids(3)[1]  # the worker's cuda:0 behind its own CUDA_VISIBLE_DEVICES


def test_a_data_parallel_trial_on_cpu_slots_gets_their_cores_and_threads(dp_adapters, tmp_path):
    executor = LocalExecutor(local_slots("cpu", parallel=2, threads=1, cpus=[0, 1]))
    dp, _ = _payloads(tmp_path, "cpu")
    try:
        executor.submit("dp", dp, 120, 0.05, 1)
        assert not executor.has_room(1)
        finished = executor.wait()
    finally:
        executor.close()
    assert finished.outcome.status == "ok", finished.outcome.reason
    start = next(e for e in finished.outcome.events if isinstance(e, Start))
    assert finished.placement.cpus == [0, 1] and start.affinity == [0, 1]
    assert finished.outcome.result().settings["omp_threads"] == "2"  # the two slots' threads, shared by the ranks
    assert finished.placement.devices is None and executor.has_room(2)


def test_a_spec_needing_more_slots_than_the_executor_has_exits_2_before_anything_runs(write_spec, tmp_path):
    path = write_spec(base_spec(frameworks=["fault"], batch_sizes=[48], variants={"data_parallel": [1, 3]}))
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "harness", "run", str(path), "--out", str(out), "--parallel", "2"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "HARNESS_ADAPTERS": REGISTRATION, "PYTHONPATH": str(ROOT)})
    first, second = sorted(os.sched_getaffinity(0))[:2]  # the two slots' cores (cpu_threads: 1)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == (
        f"{path}: variants.data_parallel.1: a trial on 3 devices takes 3 slots, one per device, and the local "
        f"executor has 2: cpu (cores {first}), cpu (cores {second}); give the executor more (--devices, --parallel) "
        "or the trial fewer devices")
    assert not out.exists()
