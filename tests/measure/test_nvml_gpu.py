"""The real NVML (``pytest -m gpu`` on a machine with an NVIDIA GPU): per-process memory against PyTorch's reserved
memory plus the CUDA context, the UUID mapping, utilization, energy and GPM activity while training and idle."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from harness.measure.energy import energy_over_windows
from harness.measure.sampler import Sampler, make_backend
from harness.measure.windows import phase_stats

MIB = 1 << 20
# The child below: prints "<phase> <time.monotonic()> <torch.cuda.memory_reserved()>" at each step, waits for a line on
# stdin before going on.
TORCH_CHILD = """
import sys, time, torch
def say(phase):
    torch.cuda.synchronize()
    print(phase, time.monotonic(), torch.cuda.memory_reserved(), flush=True)
    sys.stdin.readline()
torch.zeros(1, device="cuda")  # the CUDA context and the caching allocator's first block
say("context")
x = torch.empty(1024 * 1024 * 1024, dtype=torch.uint8, device="cuda")  # 1 GiB more
say("allocated")
idle_start = time.monotonic(); time.sleep(3.0); print("idle", idle_start, time.monotonic(), flush=True)
a = torch.randn(4096, 4096, device="cuda")
busy_start = time.monotonic(); end = busy_start + 4.0
while time.monotonic() < end:
    for _ in range(20): a = a @ a; a = a / a.norm()
    torch.cuda.synchronize()
print("busy", busy_start, time.monotonic(), flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def torch_child():
    pytest.importorskip("torch")
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # CUDA's cuda:0 is NVML's, as for the launcher's workers
    proc = subprocess.Popen([sys.executable, "-c", TORCH_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    yield proc
    proc.kill()
    proc.wait()


def _max_process_memory(backend, seconds=1.0):
    """The largest of a few NVML readings (the per-process figure can lag an allocation a little)."""
    readings = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        readings.append(backend.sample().get("process_memory_bytes"))
        time.sleep(0.1)
    if None in readings:
        pytest.skip(f"NVML does not attribute per-process memory here: {backend.describe()['notes']}")
    return max(readings)


@pytest.mark.gpu
def test_real_nvml_describes_and_samples_the_gpu():
    backend, note = make_backend("cuda:0")
    assert note is None, note
    backend.attach(os.getpid())
    sample = backend.sample()
    info = backend.describe()
    backend.close()
    assert info["uuid"].startswith(("GPU-", "MIG-")) and info["name"]
    assert info["memory_info_version"] in (1, 2)
    # an idle device with no context can read 0 bytes used (an H200 in a container did, driver 580.159): a reading
    # that is there, not a positive one; memory in use is checked while training (the process-memory test)
    assert 0 <= sample["gpu_util_percent"] <= 100 and sample["device_memory_used_bytes"] >= 0
    assert info["unavailable"] == {} or all(isinstance(r, str) for r in info["unavailable"].values())


@pytest.mark.gpu
def test_real_nvml_uuid_mapping_selects_the_same_gpu(monkeypatch):
    import pynvml

    pynvml.nvmlInit()
    try:
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    finally:
        pynvml.nvmlShutdown()
    for entry in (uuid, uuid[:12]):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", entry)
        backend, note = make_backend("cuda:0")
        assert note is None and backend.describe()["uuid"] == uuid
        backend.close()


@pytest.mark.gpu
def test_real_nvml_process_memory_matches_torch_reserved_plus_context(torch_child):
    """NVML's per-process memory = the CUDA context + what PyTorch's caching allocator reserved. The context's size
    is not known in advance (driver, GPU, lazy module loading), so it is only bounded; the exact claim is about the
    difference: 1 GiB more reserved by PyTorch is 1 GiB more in NVML, within 64 MiB."""
    backend, note = make_backend("cuda:0")
    assert note is None, note
    backend.attach(torch_child.pid)
    try:
        phase, _, reserved0 = torch_child.stdout.readline().split()
        assert phase == "context"
        nvml0 = _max_process_memory(backend)
        context = nvml0 - int(reserved0)
        assert 0 < context < 1024 * MIB, f"CUDA context {context / MIB:.0f} MiB"  # usually 250-600 MiB
        torch_child.stdin.write("\n")
        torch_child.stdin.flush()
        phase, _, reserved1 = torch_child.stdout.readline().split()
        assert phase == "allocated"
        nvml1 = _max_process_memory(backend)
        grown_nvml, grown_torch = nvml1 - nvml0, int(reserved1) - int(reserved0)
        assert grown_torch >= 1024 * MIB
        assert abs(grown_nvml - grown_torch) < 64 * MIB, (grown_nvml / MIB, grown_torch / MIB)
        assert abs(nvml1 - (int(reserved1) + context)) < 64 * MIB
    finally:
        backend.close()


def _idle_then_busy(sampler, child):
    """Samples ``child`` (the torch_child fixture) through its idle and busy phases; returns their monotonic
    (idle start, idle end, busy start, busy end) as the strings it printed."""
    sampler.start(child.pid)
    try:
        for _ in range(2):
            child.stdout.readline()
            child.stdin.write("\n")
            child.stdin.flush()
        _, idle_start, idle_end = child.stdout.readline().split()
        _, busy_start, busy_end = child.stdout.readline().split()
    finally:
        assert sampler.stop()
    return idle_start, idle_end, busy_start, busy_end


@pytest.mark.gpu
def test_real_nvml_utilization_and_energy_while_training_and_idle(torch_child):
    backend, note = make_backend("cuda:0")
    assert note is None, note
    sampler = Sampler(backend, 0.1)
    idle_start, idle_end, busy_start, busy_end = _idle_then_busy(sampler, torch_child)
    info = backend.describe()
    backend.close()
    # utilization averages the last 1/6 s..1 s: leave the first second of each phase out
    idle = phase_stats(sampler.samples, [(float(idle_start) + 1.0, float(idle_end))])
    busy = phase_stats(sampler.samples, [(float(busy_start) + 1.0, float(busy_end))])
    if "gpu_util_percent" in info["unavailable"]:
        pytest.skip(f"utilization unavailable: {info['unavailable']['gpu_util_percent']}")
    assert busy["gpu_util_percent"]["mean"] > 50, busy["gpu_util_percent"]
    assert idle["gpu_util_percent"]["mean"] < 10, idle["gpu_util_percent"]  # needs the GPU to itself
    energy = energy_over_windows(sampler.samples, [(float(busy_start), float(busy_end))])
    assert energy["method"] is not None, info["unavailable"]
    assert energy["joules"] > 0 and 10 < energy["mean_power_w"] < 2000, energy
    if energy["method"] == "counter":  # the counter and the integral of power describe the same seconds
        samples = [{k: v for k, v in s.items() if k != "energy_mj"} for s in sampler.samples]
        integral = energy_over_windows(samples, [(float(busy_start), float(busy_end))])
        assert 0.5 < integral["joules"] / energy["joules"] < 2.0, (integral, energy)


@pytest.mark.gpu
def test_real_nvml_gpm_sm_activity_while_training_and_idle(torch_child):
    """On Hopper and newer the GPM metrics have values, and SM activity is higher while a matmul loop runs than while
    the GPU idles; on older GPUs each is unavailable with a reason."""
    import pynvml

    backend, note = make_backend("cuda:0")
    assert note is None, note
    parent = (pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(backend.handle) if backend.mig else backend.handle)
    major, _ = pynvml.nvmlDeviceGetCudaComputeCapability(parent)
    sampler = Sampler(backend, 0.2)  # GPM reads more than 100 ms apart every period
    idle_start, idle_end, busy_start, busy_end = _idle_then_busy(sampler, torch_child)
    info = backend.describe()
    backend.close()
    gpm = ("sm_active_percent", "sm_occupancy_percent", "tensor_active_percent", "dram_bw_util_percent")
    reasons = {m: info["unavailable"][m] for m in gpm if m in info["unavailable"]}
    if major < 9:  # older than Hopper: no GPM
        assert set(reasons) == set(gpm) and all(isinstance(r, str) and r for r in reasons.values()), reasons
        return
    if any("Permission" in r for r in reasons.values()):
        pytest.skip(f"GPM needs profiling permission here: {reasons}")
    assert not reasons, reasons
    # each GPM value covers the period before its sample: leave the first half second of each phase out
    idle = phase_stats(sampler.samples, [(float(idle_start) + 0.5, float(idle_end))])
    busy = phase_stats(sampler.samples, [(float(busy_start) + 0.5, float(busy_end))])
    for metric in gpm:
        assert busy[metric]["count"] >= 5 and 0 <= busy[metric]["mean"] <= 100, (metric, busy[metric])
    assert busy["sm_active_percent"]["mean"] > idle["sm_active_percent"]["mean"] + 20, (busy, idle)
    assert idle["sm_active_percent"]["mean"] < 10, idle["sm_active_percent"]  # needs the GPU to itself


# Two "ranks": rank 0 starts rank 1 as its child (as harness.execution.ranks does), each holds 1 GiB on its own GPU
# (cuda:<rank>), says "ready <rank>" and waits for standard input to close.
RANKS_CHILD = """
import subprocess, sys, torch
rank = int(sys.argv[1])
if rank == 0:
    other = subprocess.Popen([sys.executable, "-c", sys.argv[2], "1", sys.argv[2]])
x = torch.empty(1024 * 1024 * 1024, dtype=torch.uint8, device=f"cuda:{rank}")
torch.cuda.synchronize()
print("ready", rank, flush=True)
sys.stdin.read()
"""


def _two_visible_gpus():
    """The NVML selectors of CUDA's cuda:0 and cuda:1 here; skips when CUDA sees fewer than two GPUs."""
    import pynvml

    from harness.measure.nvml import nvml_visible_index

    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    if count < 2:
        pytest.skip(f"a data-parallel trial needs two GPUs; NVML sees {count}")
    try:
        return [nvml_visible_index(f"cuda:{i}") for i in range(2)]
    except ValueError as err:
        pytest.skip(f"a data-parallel trial needs two GPUs visible to CUDA: {err}")


@pytest.mark.gpu
def test_real_nvml_samples_every_gpu_of_a_two_rank_trial():
    """Each GPU's memory is the rank's on it (1 GiB + its CUDA context), the trial's is the larger of the two, the
    UUIDs are those of the GPUs CUDA numbers cuda:0 and cuda:1, and closing one GPU's backend leaves NVML open for
    the other (nvmlInit/nvmlShutdown are reference counted)."""
    import psutil
    import pynvml

    pytest.importorskip("torch")
    selectors = _two_visible_gpus()
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    proc = subprocess.Popen([sys.executable, "-c", RANKS_CHILD, "0", RANKS_CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    backend, note = make_backend(["cuda:0", "cuda:1"])
    try:
        assert note is None, note
        assert sorted(proc.stdout.readline().split()[1] for _ in range(2)) == ["0", "1"]
        backend.attach(proc.pid)
        samples = []
        end = time.monotonic() + 1.0  # per-process memory can lag an allocation a little
        while time.monotonic() < end:
            samples.append(backend.sample())
            time.sleep(0.1)
        info = backend.describe()
        backend.backends[0].close()
        after = backend.backends[1].sample()  # NVML still open for the second GPU
        assert after["device_memory_used_bytes"] > 0
    finally:
        backend.backends[1].close()
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
        except psutil.Error:
            pass
        proc.kill()
        proc.wait()
    pynvml.nvmlInit()
    try:
        uuids = []
        for selector in selectors:
            handle = (pynvml.nvmlDeviceGetHandleByIndex(selector) if isinstance(selector, int)
                      else pynvml.nvmlDeviceGetHandleByUUID(selector))
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuids.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
    finally:
        pynvml.nvmlShutdown()
    assert [d["uuid"] for d in info["devices"]] == uuids and len(set(uuids)) == 2
    if any(s.get("process_memory_bytes@0") is None for s in samples):
        pytest.skip(f"NVML does not attribute per-process memory here: {info['notes']}")
    peaks = [max(s[f"process_memory_bytes@{i}"] for s in samples) for i in range(2)]
    assert all(1024 * MIB <= peak < 2048 * MIB for peak in peaks), [p / MIB for p in peaks]
    assert max(s["process_memory_bytes"] for s in samples) == max(peaks)
    both = [s for s in samples if s.get("energy_mj") is not None]
    assert all(s["energy_mj"] == s["energy_mj@0"] + s["energy_mj@1"] for s in both)
