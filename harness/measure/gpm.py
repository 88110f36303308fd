"""The GPM metrics of NVML (GPU Performance Monitoring, Hopper and newer): SM activity, SM occupancy, tensor-pipe
activity and DRAM bandwidth utilization, in percent, over the interval between two GPM samples.

``GpmReader`` belongs to one ``harness.measure.nvml.NvmlBackend``: at the backend's first sample it checks support
(nvmlGpmQueryDeviceSupport) and allocates two sample buffers; each later sample reads the GPU's counters into the
buffer not kept (nvmlGpmSampleGet, or nvmlGpmMigSampleGet for a MIG device's GPU instance) and asks
nvmlGpmMetricsGet for the metrics between the kept sample and the new one, which is then kept. Reads come more than
``min_interval_s`` (default GPM_MIN_INTERVAL_S, 0.1 s) apart (the reference: the interval "should be greater than
100ms"); a sample too soon after the last read, and the first one, have the metrics None. A failure degrades as the
backend's other metrics do (``NvmlBackend._failed``): unavailable with the reason when permanent, None in one sample
otherwise.

Reference: https://docs.nvidia.com/deploy/nvml-api/group__nvmlGpmFunctions.html. Design: docs/design/sampling.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

#: GPM metric -> the nvmlGpmMetricId_t constant it reads (pynvml names them as nvml.h does).
GPM_METRICS = {"sm_active_percent": "NVML_GPM_METRIC_SM_UTIL", "sm_occupancy_percent": "NVML_GPM_METRIC_SM_OCCUPANCY",
               "tensor_active_percent": "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
               "dram_bw_util_percent": "NVML_GPM_METRIC_DRAM_BW_UTIL"}
#: Shortest interval between two GPM sample reads, seconds: the reference says it "should be greater than 100ms".
GPM_MIN_INTERVAL_S = 0.1

#: failed(call, error, metric names, the sample being built): how the backend degrades a metric whose call failed.
Failed = Callable[[str, BaseException, Iterable[str], dict[str, Any]], None]


class GpmUnsupported(Exception):
    """nvmlGpmQueryDeviceSupport says the GPU has no GPM (older than Hopper)."""


class GpmReader:
    """The GPM metrics of one device for its ``NvmlBackend`` (module docstring).

    ``nvml``: the pynvml module; ``handle``: the device's; ``mig``: whether it is a MIG device (GPM then reads its
    parent GPU for the MIG device's GPU instance); ``unavailable`` and ``notes``: the backend's own dict and list,
    which this reader adds to; ``failed``: the backend's degradation of a failed call."""

    def __init__(self, nvml: Any, handle: Any, mig: bool, unavailable: dict[str, str], notes: list[str],
                 failed: Failed):
        self.nvml, self.handle, self.mig = nvml, handle, mig
        self.unavailable, self.notes, self.failed = unavailable, notes, failed
        self._state: dict[str, Any] | None = None  # set up at the first sample: buffers, target, the kept sample
        self._call = ""

    def _setup(self) -> dict[str, Any]:
        """Checks support and allocates the two sample buffers; raises as the NVML calls do, ``self._call`` naming
        the call that raised."""
        nvml = self.nvml
        if self.mig:  # GPM of a MIG device: its parent GPU, for the MIG device's GPU instance
            self._call = "nvmlDeviceGetDeviceHandleFromMigDeviceHandle"
            parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self.handle)
            self._call = "nvmlDeviceGetGpuInstanceId"
            instance = int(nvml.nvmlDeviceGetGpuInstanceId(self.handle))
        else:
            parent, instance = self.handle, None
        ids = {name: int(getattr(nvml, constant)) for name, constant in GPM_METRICS.items()}
        self._call = "nvmlGpmQueryDeviceSupport"
        if not nvml.nvmlGpmQueryDeviceSupport(parent).isSupportedDevice:
            raise GpmUnsupported("nvmlGpmQueryDeviceSupport: isSupportedDevice 0 (GPM needs a Hopper or newer GPU)")
        nvml.c_nvmlGpmMetricsGet_t  # noqa: B018 - bindings without the struct fail here, before any allocation
        self._call = "nvmlGpmSampleAlloc"
        buffers: list[Any] = []
        try:
            for _ in range(2):
                buffers.append(nvml.nvmlGpmSampleAlloc())
        except BaseException:
            for buffer in buffers:
                nvml.nvmlGpmSampleFree(buffer)
            raise
        if self.mig:
            self.notes.append("MIG device: the GPM metrics (sm_active_percent ...) cover its GPU instance, every "
                              "compute instance in it (nvmlGpmMigSampleGet)")
        return {"parent": parent, "instance": instance, "ids": ids, "buffers": buffers, "kept": None, "kept_t": 0.0}

    def _read(self, state: dict[str, Any], buffer: Any) -> None:
        if state["instance"] is None:
            self.nvml.nvmlGpmSampleGet(state["parent"], buffer)
        else:
            self.nvml.nvmlGpmMigSampleGet(state["parent"], state["instance"], buffer)

    def sample(self, out: dict[str, Any], min_interval_s: float = GPM_MIN_INTERVAL_S) -> None:
        """Adds the GPM metrics over the interval since the kept GPM sample to ``out``, then keeps the new one; no
        read (the metrics None) within ``min_interval_s`` seconds of the last one."""
        names = [n for n in GPM_METRICS if n not in self.unavailable]
        if not names:
            return
        if self._state is None:
            try:
                self._state = self._setup()
            except GpmUnsupported as err:
                self.unavailable.update({n: str(err) for n in names})
                return
            except Exception as err:  # noqa: BLE001 - sampling never raises into the run
                self.failed(self._call, err, names, out)
                return
        state = self._state
        if state["kept"] is not None and time.monotonic() - state["kept_t"] <= min_interval_s:
            out.update({n: None for n in names})  # too soon after the last read: the next sample covers this time
            return
        fresh = next(b for b in state["buffers"] if b is not state["kept"])
        try:
            self._read(state, fresh)
        except Exception as err:  # noqa: BLE001
            self.failed("nvmlGpmSampleGet" if state["instance"] is None else "nvmlGpmMigSampleGet", err, names, out)
            return
        # the read's end, not its start: the next read (which checks its start against this) is then more than the
        # minimum interval after this one however long the call took
        kept, state["kept"], state["kept_t"] = state["kept"], fresh, time.monotonic()
        if kept is None:
            out.update({n: None for n in names})  # the first sample: no interval yet
            return
        self._metrics(state, kept, fresh, names, out)

    def _metrics(self, state: dict[str, Any], kept: Any, fresh: Any, names: list[str], out: dict[str, Any]) -> None:
        """nvmlGpmMetricsGet of ``names`` between the samples ``kept`` and ``fresh``, into ``out``."""
        nvml = self.nvml
        try:
            request = nvml.c_nvmlGpmMetricsGet_t()
            request.version = nvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(names)
            request.sample1, request.sample2 = kept, fresh
            for i, name in enumerate(names):
                request.metrics[i].metricId = state["ids"][name]
            result = nvml.nvmlGpmMetricsGet(request)
        except Exception as err:  # noqa: BLE001
            self.failed("nvmlGpmMetricsGet", err, names, out)
            return
        for i, name in enumerate(names):
            metric = result.metrics[i]
            if int(metric.nvmlReturn) == 0:
                out[name] = float(metric.value)
            else:
                self.failed(f"nvmlGpmMetricsGet({GPM_METRICS[name]})", self._nvml_error(int(metric.nvmlReturn)),
                            [name], out)

    def _nvml_error(self, code: int) -> Exception:
        """The bindings' exception for an nvmlReturn_t value (pynvml: NVMLError(code) is that code's subclass)."""
        try:
            return self.nvml.NVMLError(code)
        except Exception:  # noqa: BLE001
            return RuntimeError(f"nvmlReturn {code}")

    def close(self) -> None:
        """Frees the sample buffers (NVML frees them at shutdown anyway)."""
        for buffer in (self._state or {}).get("buffers", []):
            try:
                self.nvml.nvmlGpmSampleFree(buffer)
            except Exception:  # noqa: BLE001 - NVML frees them at shutdown anyway
                pass
        self._state = None
