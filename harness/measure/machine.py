"""What a run ran on: Python, CPU, memory, installed framework versions, GPUs and driver, the harness's git commit.

Framework versions (the distributions each adapter declares) come from package metadata (``importlib.metadata``), so
collecting them imports no framework; the worker also reports the versions its framework says at run time.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

import adapters  # the registry of declarations: imports no framework

#: Distributions that change the numbers besides the frameworks' own.
PACKAGES = ("numpy", "nvidia-ml-py", "scikit-learn")
#: Variables of the launcher's environment recorded with the run besides the adapters' allocator variables.
#: OMP_WAIT_POLICY and KMP_BLOCKTIME: whether OpenMP's threads spin or sleep between parallel regions (libgomp,
#: https://gcc.gnu.org/onlinedocs/libgomp/OMP_005fWAIT_005fPOLICY.html; Intel's runtime), which changes CPU step times.
ENVIRONMENT = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")


def packages() -> tuple[str, ...]:
    """The distributions whose installed versions a run records: each built-in adapter's, then ``PACKAGES``."""
    return tuple(d for declared in adapters.declarations() for d in declared.distributions) + PACKAGES


def recorded_environment() -> tuple[str, ...]:
    """The variables ``collect`` records: ``ENVIRONMENT``, each adapter's allocator and recorded variables."""
    return ENVIRONMENT + tuple(v for declared in adapters.declarations()
                               for v in (*declared.environment.allocator.values(), *declared.environment.recorded))


def package_versions() -> dict[str, str]:
    """Installed versions of the packages that change the numbers; absent ones are left out."""
    out = {}
    for name in packages():
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> dict[str, Any]:
    """The harness checkout's commit and whether it has uncommitted changes (empty when not a git checkout)."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return {}
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=10)
        return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {}


def gpus(nvml: Any = None) -> dict[str, Any]:
    """NVML's view: driver version and each GPU's index, name, UUID, memory (bytes) and power limit (W). On any
    failure (no library, no driver, no GPU), ``{"available": False, "reason": ...}``."""
    try:
        if nvml is None:
            import pynvml

            nvml = pynvml
        nvml.nvmlInit()
    except Exception as err:  # noqa: BLE001 - no NVML is a normal state on a laptop or CI
        return {"available": False, "reason": f"{type(err).__name__}: {err}"}
    try:
        def text(value: Any) -> str:
            return value.decode() if isinstance(value, bytes) else str(value)

        devices = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            device: dict[str, Any] = {"index": index, "name": text(nvml.nvmlDeviceGetName(handle)),
                                      "uuid": text(nvml.nvmlDeviceGetUUID(handle)),
                                      "memory_total_bytes": int(nvml.nvmlDeviceGetMemoryInfo(handle).total)}
            try:
                device["power_limit_w"] = nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
            except Exception:  # noqa: BLE001
                pass
            devices.append(device)
        return {"available": bool(devices), "driver": text(nvml.nvmlSystemGetDriverVersion()), "devices": devices}
    except Exception as err:  # noqa: BLE001
        return {"available": False, "reason": f"{type(err).__name__}: {err}"}
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def collect() -> dict[str, Any]:
    """Everything above, as one JSON-ready dict."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "cpu": cpu_model(),
        "cpu_count_logical": psutil.cpu_count(),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "memory_total_bytes": psutil.virtual_memory().total,
        "packages": package_versions(),
        "gpu": gpus(),
        "git": git_commit(),
        "env": {k: v for k, v in os.environ.items() if k in recorded_environment()},
    }


def resolve_device(device: str, gpu_info: dict[str, Any] | None = None) -> str:
    """``auto`` becomes "cuda:0" when NVML sees a GPU, else "cpu"; any other value is returned as it is."""
    if device != "auto":
        return device
    info = gpus() if gpu_info is None else gpu_info
    return "cuda:0" if info.get("available") else "cpu"
