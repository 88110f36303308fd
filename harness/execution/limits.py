"""The CPU memory cap of a worker (``memory_limit_mb`` of a spec, ``Trial.memory_limit_bytes``): the memory a trial
may take on top of what its worker holds once the framework is imported; not used on a GPU. ``apply_cpu_memory_limit``
sets it (RLIMIT_DATA; for a framework whose declaration has a ``cpu_allocator_cap``, TensorFlow, that capped tensor
allocator with the process limit as a backstop) and reports the peak at exit (``peak_estimate``); ``process_memory``
and ``reset_peak_rss`` read and reset /proc's counters.

Design: docs/design/max-batch.md#the-cpu-memory-cap (what the cap counts per framework, why not RLIMIT_AS, what is
recorded, measured caveats).
"""

from __future__ import annotations

import atexit
import os
import resource
from collections.abc import Callable
from typing import Any

from harness.execution.protocol import MemoryLimit, MemoryPeak

MIB = 1 << 20
GIB = 1 << 30
#: TensorFlow's process-limit backstop: VmData + TF_BACKSTOP_FACTOR x limit + TF_BACKSTOP_EXTRA_BYTES.
TF_BACKSTOP_FACTOR = 2
TF_BACKSTOP_EXTRA_BYTES = GIB

_STATUS_FIELDS = {"VmData": "data_bytes", "VmRSS": "rss_bytes", "VmHWM": "rss_peak_bytes", "VmSize": "virtual_bytes",
                  "RssFile": "rss_file_bytes", "RssShmem": "rss_shmem_bytes"}


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """``data_bytes`` (VmData: what RLIMIT_DATA counts), ``rss_bytes`` (VmRSS), ``rss_peak_bytes`` (VmHWM),
    ``virtual_bytes`` (VmSize), ``rss_file_bytes`` (RssFile: resident pages of mapped files, e.g. libraries' code)
    and ``rss_shmem_bytes`` (RssShmem) of a process, from /proc/PID/status. Empty where /proc is not available."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in _STATUS_FIELDS:
                    out[_STATUS_FIELDS[key]] = int(value.split()[0]) * 1024  # the kernel writes kB (KiB)
    except OSError:
        pass
    return out


def reset_peak_rss() -> bool:
    """Resets this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0). False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _set_data_limit(cap: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if soft != resource.RLIM_INFINITY:
        cap = min(cap, soft)  # never loosen a tighter limit the worker inherited
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))  # soft only: the hard limit stays as it was
    return cap


def apply_cpu_memory_limit(limit_bytes: int, declaration: Any = None, emit: Callable[..., Any] | None = None,
                           allocator_peak: Callable[[], int | None] | None = None) -> dict[str, Any]:
    """Caps this process's memory at ``limit_bytes`` beyond what it holds now (what that means per framework:
    docs/design/max-batch.md#the-cpu-memory-cap); call it after the framework is imported and before any framework op
    (TensorFlow reads its allocator variables when it creates its CPU device, before the first op).

    declaration: the adapter's ``adapters.declaration.Declaration`` (None: the process limit alone); one with a
    ``cpu_allocator_cap`` gets that tensor cap (its variables set now, "{mib}" the limit in MiB rounded down) and
    the process limit as a backstop. allocator_peak: reads that allocator's peak bytes
    (``Adapter.cpu_allocator_peak``). emit: the worker's ``Events.emit``; when given, a ``memory_limit`` event is
    emitted now and a ``memory_peak`` event when the process exits: ``peak_bytes`` and its ``source`` (see
    peak_estimate), ``at_exit`` and ``baseline`` (process_memory() then and before the cap) and
    ``cpu_allocator_peak_bytes``. Returns what was applied (the ``memory_limit`` event's fields): ``mechanism``,
    ``limit_bytes``, ``baseline`` (process_memory() before the cap), ``rlimit_data_bytes`` (the soft RLIMIT_DATA
    set), ``peak_reset`` (whether VmHWM was reset) and, with a tensor cap, ``cpu_allocator_limit_mib``. Raises
    ValueError for a limit below 1 byte and OSError where /proc/self/status has no VmData.
    """
    limit_bytes = int(limit_bytes)
    if limit_bytes <= 0:
        raise ValueError(f"memory limit must be positive, not {limit_bytes}")
    baseline = process_memory()
    data = baseline.get("data_bytes")
    if data is None:
        raise OSError("cannot read VmData from /proc/self/status: the CPU memory limit needs Linux")
    info: dict[str, Any] = {"limit_bytes": limit_bytes, "baseline": baseline}
    capped = _capped_allocator(declaration)
    if capped:
        mib = max(1, limit_bytes // MIB)
        os.environ.update({k: v.replace("{mib}", str(mib)) for k, v in declaration.cpu_allocator_cap.items()})
        info["mechanism"] = f"{capped} limit + RLIMIT_DATA backstop"
        info["cpu_allocator_limit_mib"] = mib
        info["rlimit_data_bytes"] = _set_data_limit(data + TF_BACKSTOP_FACTOR * limit_bytes + TF_BACKSTOP_EXTRA_BYTES)
    else:
        info["mechanism"] = "RLIMIT_DATA"
        info["rlimit_data_bytes"] = _set_data_limit(data + limit_bytes)
    info["peak_reset"] = reset_peak_rss()
    if emit is not None:
        emit(MemoryLimit(**info))
        atexit.register(_report_peak, emit, capped, allocator_peak if capped else None, baseline,
                        info["peak_reset"])
    return info


def _capped_allocator(declaration: Any) -> str:
    """The name of the declaration's capped CPU allocator, "<framework> <allocator>" ("tensorflow cpu BFC
    allocator"), or "" without one."""
    if declaration is None or not declaration.cpu_allocator_cap:
        return ""
    return f"{declaration.name} {declaration.cpu_allocator}"


def peak_estimate(capped: str, baseline: dict[str, int], now: dict[str, int], peak_reset: bool,
                  tensor_peak: int | None) -> tuple[int | None, str]:
    """The best available measure of the peak of what the cap counts since it was applied, with its source.

    A capped tensor allocator (``capped``, its name; "" for none): the allocator's own peak (``tensor_peak``),
    exact. Otherwise RLIMIT_DATA caps private
    memory (VmData), whose peak the kernel does not keep; the estimate is the larger of

    - the peak growth of private resident memory: VmHWM since the reset, less the baseline VmRSS, less the growth of
      file-backed and shared resident pages (RssFile, RssShmem: libraries' code paged in while training, which
      RLIMIT_DATA does not count; assumed not to shrink, as they are not evicted without memory pressure). Exact for
      memory that is written, blind to memory reserved but never touched (thread stacks, pools);
    - the VmData growth at exit: what a pooled allocator such as MXNet's keeps is its peak; an allocator that gives
      memory back (glibc's mmap'd chunks, PyTorch) makes this an underestimate.
    """
    if capped and tensor_peak is not None:
        return tensor_peak, f"{capped} peak"
    rss_growth = None
    if now.get("rss_peak_bytes") is not None and peak_reset:
        paged = sum(now.get(k, 0) - baseline.get(k, 0) for k in ("rss_file_bytes", "rss_shmem_bytes"))
        rss_growth = now["rss_peak_bytes"] - baseline.get("rss_bytes", 0) - max(0, paged)
    data = now.get("data_bytes")
    data_growth = data - baseline["data_bytes"] if data is not None and "data_bytes" in baseline else None
    if rss_growth is None and data_growth is None:
        return None, "unavailable"
    if data_growth is None or (rss_growth is not None and rss_growth >= data_growth):
        return rss_growth, "peak private RSS growth (VmHWM less file pages)"
    return data_growth, "VmData growth at exit"


def _report_peak(emit: Callable[..., Any], capped: str, allocator_peak: Callable[[], int | None] | None,
                 baseline: dict[str, int], peak_reset: bool) -> None:
    try:
        now = process_memory()
        tensor_peak = allocator_peak() if allocator_peak is not None else None
        peak, source = peak_estimate(capped, baseline, now, peak_reset, tensor_peak)
        emit(MemoryPeak(peak_bytes=peak, source=source, at_exit=now, baseline=baseline,
                        cpu_allocator_peak_bytes=tensor_peak))
    except Exception:  # noqa: BLE001 - no memory left even for this, or the events pipe is gone: nothing to report
        pass
