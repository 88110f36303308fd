"""Runs one trial in a fresh worker process, samples it, and classifies how it ended.

Each trial gets its own interpreter (no allocator state or compiled-graph cache leaks between trials) in its own
process group (a timeout kills the worker and anything it started). The worker's events arrive over a dedicated
pipe; its stdout and stderr go to a log whose tail is kept for error reports, since frameworks print freely.

Statuses: ``ok`` (a result was reported and the worker exited 0); ``oom`` (the framework raised its out-of-memory
error); ``error`` (any other exception, or an exit without a result); ``timeout`` (no exit within the trial's
timeout: the process group is killed); ``crashed`` (killed by a signal without reporting, e.g. a segfault or the
kernel's OOM killer, which sends SIGKILL).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from harness.measure.energy import energy_over_windows, throttle_summary
from harness.measure.sampler import Sampler, make_backend, phase_stats, windows_from_events

STATUSES = ("ok", "oom", "error", "timeout", "crashed", "skipped")  # skipped: decided by the runner, see after_oom
LOG_TAIL_BYTES = 4000
KILL_GRACE_S = 5.0


@dataclass
class Outcome:
    """How a worker ended, with everything it reported. Times are seconds; ``samples`` as Sampler.samples;
    ``sampler`` as sampler_info (``{"backend": None, "interval_s": None}`` when the trial ran without a sampler)."""

    status: str
    reason: str
    events: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    returncode: int | None = None
    log_tail: str = ""
    wall_seconds: float = 0.0
    sampler: dict[str, Any] = field(default_factory=dict)

    def result(self) -> dict[str, Any] | None:
        return next((e for e in reversed(self.events) if e.get("event") == "result"), None)


def worker_env(threads: int | None, base: dict[str, str] | None = None,
               allocator: dict[str, Any] | None = None) -> dict[str, str]:
    """The worker's environment: the caller's, plus thread counts for every framework's runtime (read at import,
    so they must be set before the worker starts), the allocator variables a spec sets (PYTORCH_CUDA_ALLOC_CONF,
    MXNET_GPU_MEM_POOL_TYPE) and CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA's device numbers match NVML's."""
    env = dict(os.environ if base is None else base)
    allocator = allocator or {}
    if allocator.get("pytorch_cuda_alloc_conf"):
        env["PYTORCH_CUDA_ALLOC_CONF"] = allocator["pytorch_cuda_alloc_conf"]
    if allocator.get("mxnet_gpu_mem_pool_type"):
        env["MXNET_GPU_MEM_POOL_TYPE"] = allocator["mxnet_gpu_mem_pool_type"]
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TF_NUM_INTRAOP_THREADS"):
            env[name] = str(threads)
        env["TF_NUM_INTEROP_THREADS"] = "1"
        env["MXNET_CPU_WORKER_NTHREADS"] = "1"
    # The worker imports the harness from where this process found it, whatever the current directory.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _tail(log: Any) -> str:
    log.flush()
    size = log.seek(0, os.SEEK_END)
    log.seek(max(0, size - LOG_TAIL_BYTES))
    return log.read().decode("utf-8", errors="replace")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def sampler_info(sampler: Sampler, note: str | None, events: list[dict[str, Any]]) -> dict[str, Any]:
    """What the trial record keeps of the sampling (Outcome.sampler), besides the raw samples:

    the backend's describe() (``backend`` "nvml" | "host", ``unavailable`` {metric: reason}, NVML device ``name``,
    ``uuid``, ``mig``, ``memory_info_version``, ``notes``, ``transient_errors``), ``interval_s``, ``note`` (why NVML
    is not used, if so), ``errors`` (sampler-level), ``edge_samples_dropped`` (pokes too close to the previous
    sample, see Sampler), ``sample_cost_s`` (the backend calls' durations: median,
    max, total, count), ``stats`` (phase_stats over the train windows), ``energy`` (energy_over_windows plus
    ``joules_per_sample`` = joules / the worker's measured_samples), and ``throttle`` (throttle_summary) when any
    sample has clocks-event reasons.
    """
    info = sampler.backend.describe()
    info["interval_s"] = sampler.interval_s
    if note:
        info["note"] = note
    if sampler.errors:
        info["errors"] = sampler.errors[:10]
    info["edge_samples_dropped"] = sampler.dropped_pokes
    cost = np.asarray(sampler.call_seconds, dtype=float)
    info["sample_cost_s"] = ({"median": float(np.median(cost)), "max": float(cost.max()), "total": float(cost.sum()),
                              "count": int(cost.size)} if cost.size else
                             {"median": None, "max": None, "total": 0.0, "count": 0})
    windows = windows_from_events(events)
    info["stats"] = phase_stats(sampler.samples, windows)
    energy = energy_over_windows(sampler.samples, windows)
    result = next((e for e in reversed(events) if e.get("event") == "result"), None)
    measured = (result or {}).get("metrics", {}).get("measured_samples")
    energy["joules_per_sample"] = energy["joules"] / measured if energy["joules"] is not None and measured else None
    info["energy"] = energy
    throttle = throttle_summary(sampler.samples, windows)
    if throttle is not None:
        info["throttle"] = throttle
    return info


def run_worker(payload: dict[str, Any], timeout_s: float, interval_s: float | None, device: str,
               threads: int | None = None, on_event: Callable[[dict[str, Any]], None] | None = None) -> Outcome:
    """Starts a worker for ``payload`` (see Trial.payload), samples it every ``interval_s`` seconds, waits at most
    ``timeout_s`` seconds, and returns its Outcome. ``interval_s=None`` runs the worker with no sampler at all (no
    thread, no backend; Outcome.sampler is ``{"backend": None, "interval_s": None}``), to measure the sampler's cost.
    Never raises for anything the worker does."""
    sampler: Sampler | None = None
    note: str | None = None
    if interval_s is not None:
        backend, note = make_backend(device)
        sampler = Sampler(backend, interval_s)
    started = time.monotonic()
    with tempfile.TemporaryFile() as log:
        run = _WorkerRun(payload, threads, log, sampler, on_event)
        try:
            run.pump(started + timeout_s)
            run.wait(started + timeout_s)
        finally:
            run.close()
        tail = _tail(log)
    wall = time.monotonic() - started
    returncode = run.proc.returncode
    status, reason = classify(returncode, run.events, run.timed_out, timeout_s, tail)
    if sampler is None:
        return Outcome(status, reason, run.events, [], returncode, tail, wall, {"backend": None, "interval_s": None})
    return Outcome(status, reason, run.events, list(sampler.samples), returncode, tail, wall,
                   sampler_info(sampler, note, run.events))


class _WorkerRun:
    """One worker process from its start to its end: the events pipe, the sampler's attachment and pokes, the
    deadline and the kill of its process group."""

    def __init__(self, payload: dict[str, Any], threads: int | None, log: Any, sampler: Sampler | None,
                 on_event: Callable[[dict[str, Any]], None] | None):
        self.sampler, self.on_event = sampler, on_event
        self.events: list[dict[str, Any]] = []
        self.timed_out = False
        self._buffer = b""
        self.read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "harness.execution.worker", "--events-fd", str(write_fd)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(write_fd,),
                env=worker_env(threads, allocator=payload.get("spec", {}).get("allocator")), start_new_session=True)
        except BaseException:
            os.close(self.read_fd)
            raise
        finally:
            os.close(write_fd)
        if sampler is not None:
            sampler.start(self.proc.pid)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(payload).encode())
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # the worker died at once; its exit status tells why
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.read_fd, selectors.EVENT_READ)

    def pump(self, deadline: float) -> None:
        """Reads events until the worker closes the pipe, or sets ``timed_out`` at the deadline."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.timed_out = True
                return
            if not self.selector.select(timeout=min(remaining, 0.5)):
                continue
            chunk = os.read(self.read_fd, 65536)
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                self._handle(line)
            if not chunk:
                self._handle(self._buffer)
                return

    def _handle(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            return
        self.events.append(event)
        if self.sampler is not None and event.get("event") == "phase" and event.get("name") == "train":
            self.sampler.poke(event.get("edge", ""))
        if self.on_event is not None:
            self.on_event(event)

    def wait(self, deadline: float) -> None:
        """Waits for the exit (the deadline plus KILL_GRACE_S once the pipe is closed); kills the group past it."""
        if not self.timed_out:
            try:
                self.proc.wait(timeout=max(0.0, deadline - time.monotonic()) + KILL_GRACE_S)
                return
            except subprocess.TimeoutExpired:
                self.timed_out = True
        _kill_group(self.proc)
        self.proc.wait()

    def close(self) -> None:
        """Stops the sampler and makes sure nothing of the worker outlives it."""
        self.selector.close()
        os.close(self.read_fd)
        # A backend call stuck past the join timeout keeps its NVML handle: closing NVML under it could crash.
        if self.sampler is not None and self.sampler.stop():
            self.sampler.backend.close()
        if self.proc.poll() is None:
            _kill_group(self.proc)
            self.proc.wait()
        # Whatever the worker started must not outlive it (a framework's helper processes).
        _kill_group(self.proc)


def classify(returncode: int | None, events: list[dict[str, Any]], timed_out: bool, timeout_s: float,
             log_tail: str) -> tuple[str, str]:
    """(status, reason) for a finished worker; see the module docstring for the statuses."""
    if timed_out:
        phase = next((f"{e['name']} {e.get('edge')}" for e in reversed(events) if e.get("event") == "phase"), None)
        return "timeout", f"no exit within {timeout_s:g} s" + (f" (last phase event: {phase})" if phase else "")
    error = next((e for e in events if e.get("event") == "error"), None)
    if error is not None:
        return error.get("kind", "error"), error.get("reason", "")
    has_result = any(e.get("event") == "result" for e in events)
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (the kernel's OOM killer sends SIGKILL)" if name == "SIGKILL" else ""
        return "crashed", f"killed by {name}{hint}" + _last_line(log_tail)
    if returncode == 0 and has_result:
        return "ok", ""
    if returncode == 0:
        return "error", "the worker exited without reporting a result" + _last_line(log_tail)
    return "error", f"the worker exited with status {returncode} without reporting why" + _last_line(log_tail)


def _last_line(tail: str) -> str:
    lines = [line.strip() for line in tail.strip().splitlines() if line.strip()]
    return f": {lines[-1][:300]}" if lines else ""
