"""The CPU memory cap of a worker (``memory_limit_mb`` of a spec, ``Trial.memory_limit_bytes``): the memory a trial
may take on top of what its worker holds once the framework is imported; not used on a GPU. ``apply_cpu_memory_limit``
sets it (RLIMIT_DATA; for a framework whose declaration has a ``cpu_allocator_cap``, TensorFlow, that capped tensor
allocator with the process limit as a backstop) and reports the peak at exit (``peak_estimate``, with the peak of
VmData that ``DataPeak`` polls while the worker runs); ``process_memory`` and ``reset_peak_rss`` read and reset /proc's
counters.

Design: docs/design/max-batch.md#the-cpu-memory-cap (what the cap counts per framework, why not RLIMIT_AS, what is
recorded, measured caveats).
"""

from __future__ import annotations

import atexit
import functools
import os
import resource
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from harness.execution.protocol import MemoryLimit, MemoryPeak

MIB = 1 << 20
GIB = 1 << 30
#: TensorFlow's process-limit backstop: VmData + TF_BACKSTOP_FACTOR x limit + TF_BACKSTOP_EXTRA_BYTES.
TF_BACKSTOP_FACTOR = 2
TF_BACKSTOP_EXTRA_BYTES = GIB
#: How often ``DataPeak`` reads VmData (seconds): the kernel keeps no peak of it, and RLIMIT_DATA caps it.
DATA_POLL_S = 0.002

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


class DataPeak:
    """The peak of this process's VmData (what RLIMIT_DATA caps; the kernel keeps no peak of it), read from
    /proc/self/statm every ``interval_s`` by a daemon thread with a small stack (its own VmData is a few hundred kB).
    ``peak`` is the largest value seen, in bytes of statm's ``data`` (VmData plus the main thread's stack, which
    does not grow here): a growth over a baseline read the same way is a VmData growth. A spike shorter than the
    interval can be missed (the RSS peak, VmHWM, still sees it where the memory was written); a reservation that is
    never written (a thread's stack, a pooled allocator's free blocks) cannot be missed as it lasts."""

    def __init__(self, interval_s: float = DATA_POLL_S):
        self.interval_s = interval_s
        self.page = os.sysconf("SC_PAGE_SIZE")
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self.start_bytes = self.read()
        self.peak = self.start_bytes
        self._stop = threading.Event()
        previous = threading.stack_size()
        threading.stack_size(256 * 1024)
        try:
            self._thread = threading.Thread(target=self._poll, name="harness-vmdata-peak", daemon=True)
            self._thread.start()
        finally:
            threading.stack_size(previous)

    def read(self) -> int:
        """statm's ``data`` now, in bytes."""
        return int(os.pread(self._fd, 256, 0).split()[5]) * self.page

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.peak = max(self.peak, self.read())
            except (OSError, ValueError, IndexError):
                return

    def stop(self) -> int:
        """Stops polling (one last read) and returns the peak in bytes."""
        self._stop.set()
        try:
            self.peak = max(self.peak, self.read())
        except (OSError, ValueError, IndexError):
            pass
        return self.peak


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
        os.environ.update({k: v.replace("{mib}", str(mib)) for k, v in declaration.memory.cpu_allocator_cap.items()})
        info["mechanism"] = f"{capped} limit + RLIMIT_DATA backstop"
        info["cpu_allocator_limit_mib"] = mib
        info["rlimit_data_bytes"] = _set_data_limit(data + TF_BACKSTOP_FACTOR * limit_bytes + TF_BACKSTOP_EXTRA_BYTES)
    else:
        info["mechanism"] = "RLIMIT_DATA"
        info["rlimit_data_bytes"] = _set_data_limit(data + limit_bytes)
    info["peak_reset"] = reset_peak_rss()
    if emit is not None:
        poller = None
        try:
            poller = DataPeak()
        except (OSError, ValueError, IndexError, RuntimeError):  # no /proc/self/statm, or no thread to be had
            pass
        emit(MemoryLimit(**info))
        _report_at_exit(functools.partial(_report_peak, emit, capped, allocator_peak if capped else None, baseline,
                                          info["peak_reset"], poller))
    return info


def _report_at_exit(report: Callable[[], None]) -> None:
    """Calls ``report`` once when this process exits: through ``atexit`` when the interpreter shuts down, and
    through ``os._exit``, which skips ``atexit`` and ends a worker forked from a preloaded parent
    (``harness.execution.forkserver``) or a data-parallel rank group, wrapped for this process alone."""
    done = threading.Lock()

    def once() -> None:
        if done.acquire(blocking=False):
            report()

    atexit.register(once)
    real_exit = os._exit

    def exit_reporting(status: int) -> NoReturn:
        try:
            once()
        finally:
            real_exit(status)

    os._exit = exit_reporting


def _capped_allocator(declaration: Any) -> str:
    """The name of the declaration's capped CPU allocator, "<framework> <allocator>" ("tensorflow cpu BFC
    allocator"), or "" without one."""
    if declaration is None or not declaration.memory.cpu_allocator_cap:
        return ""
    return f"{declaration.name} {declaration.memory.cpu_allocator}"


def peak_estimate(capped: str, baseline: dict[str, int], now: dict[str, int], peak_reset: bool,
                  tensor_peak: int | None, data_peak_growth: int | None = None) -> tuple[int | None, str]:
    """The best available measure of the peak of what the cap counts since it was applied, with its source.

    A capped tensor allocator (``capped``, its name; "" for none): the allocator's own peak (``tensor_peak``),
    exact; None when it cannot be read (VmData and RSS count the runtime, graphs and the numpy data besides, which
    that cap does not). Otherwise RLIMIT_DATA caps private memory (VmData), whose peak the kernel does not keep; the
    estimate is the largest of

    - the peak VmData growth polled while the worker ran (``data_peak_growth``, ``DataPeak``): what the cap counts,
      short spikes aside;
    - the peak growth of private resident memory: VmHWM since the reset, less the baseline VmRSS, less the growth of
      file-backed and shared resident pages (RssFile, RssShmem: libraries' code paged in while training, which
      RLIMIT_DATA does not count; assumed not to shrink, as they are not evicted without memory pressure). Exact for
      memory that is written, blind to memory reserved but never touched (thread stacks, pools);
    - the VmData growth at exit: what a pooled allocator such as MXNet's keeps is its peak; an allocator that gives
      memory back (glibc's mmap'd chunks, PyTorch) makes this an underestimate.

    What each measure missed, measured: docs/design/max-batch.md#what-a-run-holds-that-a-probe-did-not and
    docs/design/max-batch.md#the-cpu-memory-cap.
    """
    if capped:  # the cap counts the allocator's tensors alone: no process figure stands in for its peak
        if tensor_peak is None:
            return None, f"unavailable ({capped} peak not readable; process memory is not what the cap counts)"
        return tensor_peak, f"{capped} peak"
    rss_growth = None
    if now.get("rss_peak_bytes") is not None and peak_reset:
        paged = sum(now.get(k, 0) - baseline.get(k, 0) for k in ("rss_file_bytes", "rss_shmem_bytes"))
        rss_growth = now["rss_peak_bytes"] - baseline.get("rss_bytes", 0) - max(0, paged)
    data = now.get("data_bytes")
    data_growth = data - baseline["data_bytes"] if data is not None and "data_bytes" in baseline else None
    candidates = [(value, source) for value, source in (
        (data_peak_growth, f"peak VmData growth (polled every {DATA_POLL_S * 1e3:g} ms)"),
        (rss_growth, "peak private RSS growth (VmHWM less file pages)"),
        (data_growth, "VmData growth at exit")) if value is not None]
    if not candidates:
        return None, "unavailable"
    return max(candidates, key=lambda c: c[0])


def _report_peak(emit: Callable[..., Any], capped: str, allocator_peak: Callable[[], int | None] | None,
                 baseline: dict[str, int], peak_reset: bool, poller: DataPeak | None = None) -> None:
    try:
        now = process_memory()
        tensor_peak = allocator_peak() if allocator_peak is not None else None
        growth = poller.stop() - poller.start_bytes if poller is not None else None
        peak, source = peak_estimate(capped, baseline, now, peak_reset, tensor_peak, growth)
        emit(MemoryPeak(peak_bytes=peak, source=source, at_exit=now, baseline=baseline,
                        cpu_allocator_peak_bytes=tensor_peak))
    except Exception:  # noqa: BLE001 - no memory left even for this, or the events pipe is gone: nothing to report
        pass
