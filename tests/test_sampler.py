"""The sampler: the host backend on a real busy process, the NVML backend against a fake NVML module (the hardware
boundary), and gpu-marked tests against the real NVML."""

from __future__ import annotations

import subprocess
import sys
import time
import types

import pytest

from harness.sampler import HostBackend, NvmlBackend, Sampler, make_backend, nvml_visible_index, phase_stats

BUSY = "import time\nx = bytearray(80_000_000)\nend = time.time() + 30\nwhile time.time() < end: pass\n"


def test_host_backend_sees_a_busy_process_and_its_memory():
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        sampler = Sampler(HostBackend(), interval_s=0.05)
        time.sleep(0.5)  # let it allocate
        sampler.start(proc.pid)
        time.sleep(1.0)
        sampler.stop()
    finally:
        proc.kill()
        proc.wait()
    samples = sampler.samples
    assert len(samples) >= 10
    stamps = [s["t"] for s in samples]
    assert stamps == sorted(stamps)
    stats = phase_stats(samples, [(stamps[2], stamps[-1])])
    assert stats["cpu_percent"]["mean"] > 60  # one core spinning: ~100%
    assert stats["rss_bytes"]["max"] > 80e6


def test_phase_stats_only_counts_samples_inside_windows():
    samples = [{"t": float(t), "x": float(t)} for t in range(10)]
    stats = phase_stats(samples, [(2.0, 4.0), (8.0, 8.5)])
    assert stats["x"] == {"mean": (2 + 3 + 4 + 8) / 4, "median": 3.5, "max": 8.0, "count": 4, "scope": "windows"}
    assert phase_stats(samples, [(20.0, 21.0)])["x"] == {"mean": None, "median": None, "max": None, "count": 0,
                                                         "scope": "none"}


def test_phase_stats_falls_back_to_the_span_when_windows_are_shorter_than_the_interval():
    samples = [{"t": float(t), "x": float(t)} for t in range(10)]
    stats = phase_stats(samples, [(2.1, 2.2), (4.5, 4.6), (6.1, 6.3)])  # no sample inside any window
    assert stats["x"] == {"mean": 4.5, "median": 4.5, "max": 6.0, "count": 4, "scope": "span"}  # t = 3, 4, 5, 6


def test_sampler_stops_within_an_interval_even_with_a_slow_backend():
    class Slow(HostBackend):
        def sample(self):
            time.sleep(0.2)
            return {"cpu_percent": 1.0}

    sampler = Sampler(Slow(), interval_s=0.5)
    sampler.start(1)
    time.sleep(0.3)
    started = time.monotonic()
    sampler.stop()
    assert time.monotonic() - started < 0.5 + 0.2 + 0.1


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


def fake_nvml(process_memory=2_000_000_000, fail=()):
    """A stand-in for the pynvml module with the calls the backend makes."""
    calls = {"init": 0, "shutdown": 0}

    def maybe(name, value):
        def call(*_args):
            if name in fail:
                raise fail[name]
            return value() if callable(value) else value
        return call

    procs = lambda: [types.SimpleNamespace(pid=pid_holder["pid"], usedGpuMemory=process_memory),  # noqa: E731
                     types.SimpleNamespace(pid=999_999, usedGpuMemory=5)]
    pid_holder = {"pid": 0}
    module = types.SimpleNamespace(
        NVMLError=NVMLError, NVMLError_NotSupported=NVMLError_NotSupported,
        nvmlInit=lambda: calls.__setitem__("init", calls["init"] + 1),
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetHandleByIndex=lambda i: f"handle{i}",
        nvmlDeviceGetHandleByUUID=lambda u: f"handle-{u}",
        nvmlDeviceGetUtilizationRates=maybe("util", types.SimpleNamespace(gpu=87, memory=40)),
        nvmlDeviceGetMemoryInfo=maybe("mem", types.SimpleNamespace(used=3_000_000_000, total=80e9)),
        nvmlDeviceGetComputeRunningProcesses=maybe("procs", procs),
        nvmlDeviceGetPowerUsage=maybe("power", 250_500),
        nvmlDeviceGetName=lambda h: b"Fake GPU", nvmlDeviceGetUUID=lambda h: "GPU-fake",
    )
    return module, calls, pid_holder


def test_nvml_backend_reads_every_metric_and_only_the_workers_memory():
    nvml, calls, pid = fake_nvml()
    backend = NvmlBackend(0, nvml=nvml)
    pid["pid"] = 4242
    backend.attach(4242)
    sample = backend.sample()
    assert sample == {"gpu_util_percent": 87.0, "mem_util_percent": 40.0, "device_memory_used_bytes": 3e9,
                      "process_memory_bytes": 2e9, "power_w": 250.5}
    backend.close()
    assert calls == {"init": 1, "shutdown": 1}
    assert backend.describe()["name"] == "Fake GPU"


def test_not_supported_metric_is_marked_unavailable_and_others_go_on():
    nvml, _, pid = fake_nvml(fail={"power": NVMLError_NotSupported("Not Supported")})
    backend = NvmlBackend(0, nvml=nvml)
    backend.attach(1)
    first, second = backend.sample(), backend.sample()
    assert "power_w" not in first and "power_w" not in second
    assert first["gpu_util_percent"] == 87.0
    assert backend.unavailable == {"power_w": "NVML: Not Supported"}
    assert backend.describe()["unavailable"] == {"power_w": "NVML: Not Supported"}


def test_process_memory_not_available_is_none_not_zero():
    nvml, _, pid = fake_nvml(process_memory=None)
    pid["pid"] = 77
    backend = NvmlBackend(0, nvml=nvml)
    backend.attach(77)
    assert backend.sample()["process_memory_bytes"] is None


def test_transient_nvml_error_drops_one_sample_value():
    nvml, _, _ = fake_nvml(fail={"mem": NVMLError("GPU is lost")})
    backend = NvmlBackend(0, nvml=nvml)
    backend.attach(1)
    assert backend.sample()["device_memory_used_bytes"] is None
    assert "device_memory_used_bytes" not in backend.unavailable


def test_sampler_survives_a_backend_that_raises():
    class Broken(HostBackend):
        def sample(self):
            raise RuntimeError("driver went away")

    sampler = Sampler(Broken(), interval_s=0.05)
    sampler.start(1)
    time.sleep(0.2)
    sampler.stop()
    assert sampler.samples and sampler.errors[0] == "RuntimeError: driver went away"


def test_no_nvml_falls_back_to_host_with_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml now raises ImportError
    backend, note = make_backend("cuda:0")
    assert isinstance(backend, HostBackend)
    assert note.startswith("NVML unavailable (ModuleNotFoundError") and note.endswith("sampling the host instead")
    cpu_backend, cpu_note = make_backend("cpu")
    assert isinstance(cpu_backend, HostBackend) and cpu_note is None


def test_cuda_visible_devices_maps_to_nvml():
    assert nvml_visible_index("cuda:0", "") == 0
    assert nvml_visible_index("cuda:1", "3,1") == 1
    assert nvml_visible_index("cuda:0", "2,3") == 2
    assert nvml_visible_index("cuda:0", "GPU-abc,1") == "GPU-abc"
    with pytest.raises(ValueError):
        nvml_visible_index("cuda:2", "0,1")


@pytest.mark.gpu
def test_real_nvml_samples_a_gpu():
    import pynvml

    backend = NvmlBackend(0, nvml=pynvml)
    backend.attach(1)
    sample = backend.sample()
    backend.close()
    assert 0 <= sample["gpu_util_percent"] <= 100
    assert sample["device_memory_used_bytes"] > 0


@pytest.mark.gpu
def test_real_nvml_sees_a_training_worker():
    torch = pytest.importorskip("torch")
    assert torch.cuda.is_available()
    code = ("import torch, time\nx = torch.randn(4096, 4096, device='cuda')\nend = time.time() + 4\n"
            "while time.time() < end: x = x @ x; x = x / x.norm()\ntorch.cuda.synchronize()\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    backend, note = make_backend("cuda:0")
    assert note is None
    sampler = Sampler(backend, 0.1)
    time.sleep(2.0)
    sampler.start(proc.pid)
    time.sleep(1.5)
    sampler.stop()
    proc.wait()
    stats = phase_stats(sampler.samples, [(sampler.samples[0]["t"], sampler.samples[-1]["t"])])
    assert stats["gpu_util_percent"]["mean"] > 50
    assert stats["process_memory_bytes"]["max"] > 64e6


def test_poke_takes_a_tagged_sample_at_once():
    sampler = Sampler(HostBackend(), interval_s=5.0)  # periodic samples would be 5 s apart
    sampler.start(1)
    time.sleep(0.05)
    poked_at = time.monotonic()
    sampler.poke("end")
    time.sleep(0.1)
    sampler.stop()
    edges = [s for s in sampler.samples if s.get("edge") == "end"]
    assert len(edges) == 1 and 0 <= edges[0]["t"] - poked_at < 0.05
    assert "cpu_percent" in edges[0]


def test_edge_samples_decide_membership():
    samples = [{"t": 1.0, "x": 100.0},             # before the window
               {"t": 2.01, "edge": "start", "x": 50.0},  # baseline: describes the time before the window
               {"t": 2.5, "x": 7.0},
               {"t": 3.02, "edge": "end", "x": 9.0},     # taken just after the end: describes the window
               {"t": 3.3, "x": 100.0},
               {"t": 4.0, "edge": "end", "x": 1.0}]      # an end sample too late for the window
    stats = phase_stats(samples, [(2.0, 3.0)])
    assert stats["x"]["count"] == 2 and stats["x"]["mean"] == 8.0 and stats["x"]["scope"] == "windows"


def test_edge_sampling_measures_a_window_shorter_than_the_interval():
    """A real busy process, a 0.15 s window, a 10 s interval: the end-edge sample alone describes the window."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        sampler = Sampler(HostBackend(), interval_s=10.0)
        time.sleep(0.3)
        sampler.start(proc.pid)
        time.sleep(0.05)
        start = time.monotonic()
        sampler.poke("start")
        time.sleep(0.15)
        end = time.monotonic()
        sampler.poke("end")
        time.sleep(0.05)
        sampler.stop()
    finally:
        proc.kill()
        proc.wait()
    stats = phase_stats(sampler.samples, [(start, end)])
    assert stats["cpu_percent"]["count"] == 1 and stats["cpu_percent"]["scope"] == "windows"
    assert stats["cpu_percent"]["mean"] > 60
