"""Sampling every GPU of a data-parallel trial: one ``NvmlBackend`` per device, one sample for them all.

A sample holds each device's readings as ``<metric>@<i>`` (``i``: the device's position in the trial's ``devices``,
the rank that trains on it) and, under the metric's own name, the trial's figure over its devices (``AGGREGATION``),
so that whatever reads a one-device sample (``phase_stats``, ``energy_over_windows``, ``throttle_summary``, the
report) reads a data-parallel trial's the same way:

- ``sum``: ``energy_mj`` (a sum of energy counters is the counter of the trial's boards together) and ``power_w``;
- ``max``: ``process_memory_bytes`` and ``device_memory_used_bytes`` (the most loaded device: what must fit on one
  GPU, so its peak over the trial is the peak over devices) and ``temperature_c`` (the hottest device);
- ``or``: ``throttle_reasons`` (a reason active on any device);
- ``mean``: utilization, the SM clock and the GPM percentages.

The combined value is None in a sample where any device's is None (a partial sum of counters is no counter), and a
metric unavailable on one device is unavailable for the trial (``unavailable``: "<device>: <reason>").

NVML keeps a reference count of initializations: each backend's ``nvmlInit`` and ``nvmlShutdown`` pair, and NVML
shuts down when the last backend closes (nvmlShutdown: "A reference count of the number of initializations is
maintained. Shutdown only occurs when the reference count reaches zero",
https://docs.nvidia.com/deploy/nvml-api/group__nvmlInitializationAndCleanup.html).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from harness.measure.energy import energy_over_windows
from harness.measure.nvml import NvmlBackend, tree_pids
from harness.measure.windows import phase_stats, samples_until

#: How a metric combines over the devices of a trial (module docstring); every other metric is averaged.
AGGREGATION = {"energy_mj": "sum", "power_w": "sum", "process_memory_bytes": "max", "device_memory_used_bytes": "max",
               "temperature_c": "max", "throttle_reasons": "or"}
_COMBINE: dict[str, Callable[[list[Any]], Any]] = {
    "sum": sum, "max": max, "mean": lambda values: sum(values) / len(values),
    "or": lambda values: _bitwise_or([int(v) for v in values])}


def _bitwise_or(values: list[int]) -> int:
    mask = 0
    for value in values:
        mask |= value
    return mask


def device_key(metric: str, index: int) -> str:
    """The sample key of ``metric`` on the trial's ``index``-th device: ``"<metric>@<index>"``."""
    return f"{metric}@{index}"


def base_metric(key: str) -> str:
    """The metric of a sample key: ``"power_w@1"`` -> ``"power_w"``; a key without a device stays as it is."""
    return key.partition("@")[0]


def combine(metric: str, values: list[Any]) -> Any:
    """The trial's value of ``metric`` from its devices' ``values`` (``AGGREGATION``; None when any is None)."""
    if any(value is None for value in values):
        return None
    return _COMBINE[AGGREGATION.get(metric, "mean")](values)


class MultiNvmlBackend:
    """NVML samples of the GPUs of one data-parallel trial (module docstring), a ``harness.measure.sampler.Backend``.

    ``backends``: one open ``NvmlBackend`` per device, in the order of the trial's devices; ``devices``: those
    devices as the worker numbers them ("cuda:0", ...), for describe() and the unavailable reasons. The worker's
    process tree is listed once per sample for all devices (``process_memory_bytes`` of device i is what the tree,
    every rank included, holds on device i). Each sample calls the devices one after the other, so device i's
    readings are taken about i backend calls (~1-2 ms each) after the sample's ``t``.
    """

    name = "nvml"

    def __init__(self, backends: Sequence[NvmlBackend], devices: Sequence[str]):
        if len(backends) != len(devices) or len(backends) < 2:
            raise ValueError(f"{len(backends)} backend(s) for {len(devices)} device(s): one each, two or more")
        self.backends, self.devices = list(backends), list(devices)
        self._pid: int | None = None
        self.unavailable: dict[str, str] = {}
        self._update_unavailable()

    def _update_unavailable(self) -> None:
        self.unavailable.clear()
        for device, backend in zip(self.devices, self.backends):
            for metric, reason in backend.unavailable.items():
                self.unavailable.setdefault(metric, f"{device}: {reason}")

    def attach(self, pid: int) -> None:
        self._pid = pid
        for backend in self.backends:
            backend.attach(pid)

    def sample(self) -> dict[str, Any]:
        """One sample: every device's readings (``<metric>@<i>``) and the trial's (``AGGREGATION``)."""
        pids = tree_pids(self._pid) if self._pid is not None else set()
        readings = [backend.sample(pids) for backend in self.backends]
        out: dict[str, Any] = {}
        for index, values in enumerate(readings):
            out.update({device_key(metric, index): value for metric, value in values.items()})
        self._update_unavailable()
        for metric in readings[0]:
            if metric not in self.unavailable and all(metric in values for values in readings):
                out[metric] = combine(metric, [values[metric] for values in readings])
        return out

    def close(self) -> None:
        for backend in self.backends:
            backend.close()

    def describe(self) -> dict[str, Any]:
        """The backend for the record's ``sampler``: ``name`` (the GPUs' name, " / "-joined when they differ), ``mig``
        (any is a MIG device), ``notes``, ``unavailable``, ``transient_errors`` ("<metric>@<i>"), ``metrics`` (what
        each combined metric is) and ``devices``: per device in the trial's order its ``index``, ``device`` (as the
        worker numbers it), ``device_selector`` (what NVML was asked for: its index or a UUID), ``name``, ``uuid``,
        ``mig`` and ``memory_info_version``. ``uuid`` is None: each device has its own."""
        infos = [backend.describe() for backend in self.backends]
        names = list(dict.fromkeys(str(info["name"]) for info in infos))
        self._update_unavailable()
        metrics = {metric: f"{text} ({AGGREGATION.get(metric, 'mean')} over the trial's devices)"
                   for metric, text in infos[0]["metrics"].items() if metric not in self.unavailable}
        metrics["<metric>@<i>"] = "the metric on the trial's i-th device (rank i), as NVML read it"
        transient = {device_key(metric, index): dict(entry) for index, info in enumerate(infos)
                     for metric, entry in info["transient_errors"].items()}
        notes = list(dict.fromkeys(note for info in infos for note in info["notes"]))
        devices = [{"index": index, "device": device, **{key: info.get(key) for key in (
            "device_selector", "name", "uuid", "mig", "memory_info_version")}}
            for index, (device, info) in enumerate(zip(self.devices, infos))]
        return {"backend": "nvml", "name": " / ".join(names), "uuid": None, "mig": any(i["mig"] for i in infos),
                "unavailable": dict(self.unavailable), "notes": notes, "transient_errors": transient,
                "metrics": metrics, "devices": devices}


def device_summaries(samples: list[dict[str, Any]], windows: list[tuple[float, float]],
                     devices: list[dict[str, Any]], until: float | None = None) -> dict[str, Any]:
    """Per device of a multi-device trial, over its timed windows (``phase_stats``'s samples and scope; the levels of
    the samples taken up to ``until``, the worker's last event, ``samples_until``; the energy of every sample): the
    describe() entry of ``devices`` plus ``memory_peak_bytes`` (the peak of ``process_memory_bytes@i``, else of
    ``device_memory_used_bytes@i`` where NVML gives no per-process memory; ``memory_source`` says which),
    ``gpu_util_mean_percent`` and ``joules`` (``energy_over_windows`` of that device alone: counter or power
    integral; ``energy_method``). Returns {"devices": [...], "memory_peak_over_devices_bytes": the largest device
    peak (bytes, None when none was measured), "memory_peak_device": its index}."""
    out = []
    for entry in devices:
        index = entry["index"]
        own = [{"t": s["t"], **({"edge": s["edge"]} if "edge" in s else {}),
                **{base_metric(k): v for k, v in s.items() if k.endswith(f"@{index}")}} for s in samples]
        stats = phase_stats(samples_until(own, until), windows)
        source = next((m for m in ("process_memory_bytes", "device_memory_used_bytes")
                       if stats.get(m, {}).get("max") is not None), None)
        energy = energy_over_windows(own, windows)
        out.append({**entry, "memory_peak_bytes": stats[source]["max"] if source else None, "memory_source": source,
                    "gpu_util_mean_percent": stats.get("gpu_util_percent", {}).get("mean"),
                    "joules": energy["joules"], "energy_method": energy["method"]})
    peaks = [(d["memory_peak_bytes"], d["index"]) for d in out if d["memory_peak_bytes"] is not None]
    peak = max(peaks) if peaks else (None, None)
    return {"devices": out, "memory_peak_over_devices_bytes": peak[0], "memory_peak_device": peak[1]}
