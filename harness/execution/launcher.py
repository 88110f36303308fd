"""Runs one trial in a fresh worker process, samples it, and classifies how it ended.

Each trial gets its own interpreter (no allocator state or compiled-graph cache leaks between trials) in its own
process group (a timeout kills the worker and anything it started). The interpreter is the trial's framework entry's
(``harness.spec.FrameworkEntry``: the harness's own python, another venv's, or a command prefix such as ``taskset``
or ``docker run -i``), started as ``harness.execution.bootstrap`` describes: the payload goes in on standard input,
which stays open while the worker runs (the worker dies when it closes), events come back as marked lines on standard
output, and everything the framework prints goes to standard error, a log whose tail is kept for error reports.

Statuses: ``ok`` (a result was reported and the worker exited 0); ``oom`` (the framework raised its out-of-memory
error); ``error`` (any other exception, or an exit without a result); ``timeout`` (no exit within the trial's
timeout: the process group is killed); ``crashed`` (killed by a signal without reporting, e.g. a segfault or the
kernel's OOM killer, which sends SIGKILL); ``unsupported`` (the adapter's declaration lacks what the trial needs:
a layer kind, layer option, task, precision or mode, ``harness.plan.support.unsupported``; decided by the sweep
before any worker starts, from ``harness.plan.unsupported_reason``, or in the worker before ``build`` for an adapter
of ``HARNESS_ADAPTERS``).
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil

from harness.execution import forkserver
from harness.execution.entry import worker_command
from harness.execution.protocol import Payload, parse_event
from harness.execution.workers import Workers, active, owner, start_mode, worker_settings
from harness.measure.energy import energy_over_windows, throttle_summary
from harness.measure.multi_gpu import device_summaries
from harness.measure.sampler import Sampler, make_backend, phase_stats, samples_until
from harness.plan import Trial
from harness.record import Status
from harness.record.events import Error, Event, Phase, Result, Start, first, phase_windows
from harness.spec import FrameworkEntry

__all__ = ["Outcome", "classify", "owner", "run_worker", "sampled_devices", "worker_argv", "worker_env",
           "worker_settings"]  # owner, worker_settings: harness.execution.workers's, re-exported
LOG_TAIL_BYTES = 4000
KILL_GRACE_S = 5.0
STOP_POLL_S = 0.1  # how often a worker run with a ``stop`` event looks at it (a parallel run stopped: its workers end)


@dataclass
class Outcome:
    """How a worker ended, with everything it reported. Times are seconds; ``events`` the worker's, typed
    (``harness.record.events``); ``samples`` as Sampler.samples; ``sampler`` as sampler_info, in the sampler's own
    terms (``{"backend": None, "interval_s": None}`` when the trial ran without a sampler; the record's
    ``SamplerInfo.from_measure`` reads it)."""

    status: Status
    reason: str
    events: list[Event] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    returncode: int | None = None
    log_tail: str = ""
    wall_seconds: float = 0.0
    sampler: dict[str, Any] = field(default_factory=dict)
    start: str = "cold"  # cold, or forked from a preloaded parent (harness.execution.forkserver)
    started: float = 0.0  # time.monotonic() when the launcher started the worker
    ended: float = 0.0  # time.monotonic() when it saw the worker's exit

    def result(self) -> Result | None:
        """The worker's last ``result`` event, or None."""
        return first(self.events, Result, last=True)


def worker_env(threads: int | None, base: dict[str, str] | None = None,
               allocator: dict[str, Any] | None = None) -> dict[str, str]:
    """The worker's environment: the caller's (``base``, default os.environ) with ``worker_settings`` applied."""
    env = dict(os.environ if base is None else base)
    env.update(worker_settings(threads, env, allocator))
    return env


def worker_argv(trial: Trial) -> list[str]:
    """The worker's command line: the trial's interpreter or command prefix, then ``-c BOOTSTRAP ROOT`` (see
    harness.execution.bootstrap)."""
    entry = FrameworkEntry(name=trial.framework, python=trial.python,
                           command=list(trial.command) if trial.command else None)
    return worker_command(entry.argv())


def _tail(log: Any) -> str:
    log.flush()
    size = log.seek(0, os.SEEK_END)
    log.seek(max(0, size - LOG_TAIL_BYTES))
    return log.read().decode("utf-8", errors="replace")


def _kill_group(proc: subprocess.Popen[bytes] | forkserver.Forked) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def sampler_info(sampler: Sampler, note: str | None, events: list[Event]) -> dict[str, Any]:
    """What the trial record keeps of the sampling (Outcome.sampler), besides the raw samples: the backend's describe()
    (``backend`` "nvml" | "host", ``unavailable`` {metric: reason}, NVML device ``name``, ``uuid``, ``mig``,
    ``memory_info_version``, ``notes``, ``transient_errors``), ``interval_s``, ``note`` (why NVML is not used, if so),
    ``errors`` (sampler-level), ``edge_samples_dropped`` (pokes too close to the previous sample, see Sampler),
    ``sample_cost_s`` (the backend calls' durations: median, max, total, count), ``stats`` (phase_stats over the train
    windows, of the samples up to the worker's last event: ``samples_until``), ``energy`` (energy_over_windows, of every
    sample: a board counter; the readers derive the energy per sample, ``harness.results.derived``), ``throttle``
    (throttle_summary) when any sample has clocks-event reasons. With several GPUs (a data-parallel trial,
    ``harness.measure.multi_gpu``): ``stats`` and ``energy`` are the trial's over its devices (energy and power summed,
    memory the most loaded device's, utilization the mean), ``stats`` also holds each device's ``<metric>@<i>``, and
    ``devices`` (one entry per device: ``memory_peak_bytes``, ``gpu_util_mean_percent``, ``joules`` ...) and
    ``memory_peak_over_devices_bytes`` with ``memory_peak_device`` come from ``device_summaries``.
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
    windows, last = phase_windows(events), next((e.t for e in events if isinstance(e, (Result, Error))), None)
    alive = samples_until(sampler.samples, last)  # levels, not read from a worker that is exiting
    info["stats"] = phase_stats(alive, windows)
    info["energy"] = energy_over_windows(sampler.samples, windows)
    throttle = throttle_summary(alive, windows)
    if throttle is not None:
        info["throttle"] = throttle
    if info.get("devices"):
        info.update(device_summaries(sampler.samples, windows, info["devices"], until=last))
    return info


def run_worker(payload: Payload, timeout_s: float, interval_s: float | None, device: str,
               threads: int | None = None, on_event: Callable[[Event], None] | None = None,
               env: dict[str, str] | None = None, cpus: list[int] | None = None,
               stop: threading.Event | None = None, workers: Workers | None = None) -> Outcome:
    """Starts a worker for ``payload`` (``harness.execution.protocol.Payload``), samples it every ``interval_s``
    seconds, waits at most ``timeout_s`` seconds, and returns its Outcome. ``interval_s=None`` runs the worker with
    no sampler at all (no thread, no backend; Outcome.sampler is ``{"backend": None, "interval_s": None}``), to
    measure the sampler's cost.
    Never raises for anything the worker does.

    ``device`` is what the sampler watches ("cpu", or "cuda:N" as the worker numbers its GPUs), and, for a
    data-parallel trial on GPUs, every device of the trial (``sampled_devices``); the worker trains on the payload's
    device(s). ``env``: more variables for the worker (CUDA_VISIBLE_DEVICES, which makes the GPUs it lists the
    worker's cuda:0, cuda:1, ...: the sampler maps the worker's numbers to NVML's through it, else through this
    process's); ``cpus``: the cores the worker is pinned to (its affinity mask, set by the bootstrap before any
    framework starts a thread; ``os.sched_setaffinity``); ``stop``: an event that, once set, kills the worker (a
    parallel run being stopped); ``workers``: the owner of the preloaded parents a worker may fork from
    (``harness.execution.workers``; default the active one; none: the worker starts cold).
    """
    sampler: Sampler | None = None
    note: str | None = None
    if interval_s is not None:
        visible = (env or {}).get("CUDA_VISIBLE_DEVICES")
        backend, note = make_backend(sampled_devices(payload, device), visible=visible)
        sampler = Sampler(backend, interval_s)
    started = time.monotonic()
    with tempfile.TemporaryFile() as log:
        run = _WorkerRun(payload, threads, log, sampler, on_event, stop, env=env, cpus=cpus,
                         workers=workers or active())
        try:
            run.pump(started + timeout_s)
            run.wait(started + timeout_s)
        finally:
            run.close()
        tail = _tail(log)
    wall = time.monotonic() - started
    returncode = run.proc.returncode
    status, reason = classify(returncode, run.events, run.timed_out, timeout_s, tail)
    ended = run.ended or time.monotonic()
    if sampler is None:
        return Outcome(status, reason, run.events, [], returncode, tail, wall, {"backend": None, "interval_s": None},
                       run.start, started, ended)
    note = "; ".join(filter(None, [note, *run.notes])) or None
    return Outcome(status, reason, run.events, list(sampler.samples), returncode, tail, wall,
                   sampler_info(sampler, note, run.events), run.start, started, ended)


def sampled_devices(payload: Payload, device: str) -> str | list[str]:
    """What the sampler of ``payload``'s trial watches: ``device``, or, when that is a GPU and the trial is
    data-parallel on GPUs, every device of the trial (``Trial.devices``, as the worker numbers them)."""
    trial = payload.trial
    if device.startswith("cuda") and trial.data_parallel > 1 and all(d.startswith("cuda") for d in trial.devices):
        return list(trial.devices)
    return device


class _WorkerRun:
    """One worker process from its start to its end: its standard streams, the sampler's attachment and pokes, the
    deadline and the kill of its process group."""

    def __init__(self, payload: Payload, threads: int | None, log: Any, sampler: Sampler | None,
                 on_event: Callable[[Event], None] | None, stop: threading.Event | None = None,
                 env: dict[str, str] | None = None, cpus: list[int] | None = None, workers: Workers | None = None):
        self.sampler, self.on_event, self.log, self.stop = sampler, on_event, log, stop
        self.events: list[Event] = []
        self.notes: list[str] = []
        self.timed_out = False
        self._buffer = b""
        settings = Workers.settings(payload.trial, threads, env)
        payload = payload.model_copy(update={"env": settings, "launcher_pid": os.getpid(),
                                             "cpus": list(cpus) if cpus else payload.cpus})
        self.start, self.ended = start_mode(payload.trial) if workers is not None else "cold", 0.0
        self.proc: subprocess.Popen[bytes] | forkserver.Forked
        if self.start == "forked":
            assert workers is not None
            try:
                self.proc = workers.spawn(payload.trial, settings, log)
            except (RuntimeError, OSError) as err:
                self.notes.append(f"not forked ({err}): started cold")
                self.start = "cold"
        if self.start == "cold":
            self.proc = subprocess.Popen(worker_argv(payload.trial), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, env={**os.environ, **settings}, start_new_session=True)
        if sampler is not None:
            sampler.start(self.proc.pid)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            # One line; standard input stays open until the worker has ended (see harness.execution.bootstrap).
            self.proc.stdin.write(payload.line())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died at once; its exit status tells why
        self.read_fd = self.proc.stdout.fileno()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.read_fd, selectors.EVENT_READ)

    def pump(self, deadline: float) -> None:
        """Reads events until the worker closes its standard output, or sets ``timed_out`` at the deadline."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self.stop is not None and self.stop.is_set()):
                self.timed_out = True  # a stop kills the worker like a timeout (its trial is not recorded)
                return
            if not self.selector.select(timeout=min(remaining, 0.5 if self.stop is None else STOP_POLL_S)):
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
            event = parse_event(line)
        except ValueError:  # a marked line that is no event (torn, or not valid JSON): kept in the log
            event = None
        if event is None:
            if line.strip():  # a wrapper's own output on standard output: kept in the log, not parsed
                self.log.write(line + b"\n")
            return
        self.events.append(event)
        if isinstance(event, Start) and self.sampler is not None:
            self._follow(event.pid)
        if self.sampler is not None and isinstance(event, Phase) and event.name == "train":
            self.sampler.poke(event.edge)
        if self.on_event is not None:
            self.on_event(event)

    def _follow(self, pid: Any) -> None:
        """Points the sampler at the worker's own process when a command prefix started it outside the process tree
        of what the launcher started (a container run with ``--pid=host``); says so when it cannot be found on this
        machine (another PID namespace: per-process figures then describe the prefix's process only)."""
        if not isinstance(pid, int) or pid == self.proc.pid:
            return
        try:
            if pid in {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}:
                return
        except psutil.Error:
            pass  # the prefix's process is gone already (it handed the worker on and exited)
        try:
            if "harness.execution.bootstrap" in " ".join(psutil.Process(pid).cmdline()):
                assert self.sampler is not None
                self.sampler.backend.attach(pid)
                self.notes.append(f"the worker (pid {pid}) runs outside the launched command's process tree; "
                                  "sampled by its pid")
                return
        except psutil.Error:
            pass
        self.notes.append(f"the worker reported pid {pid}, which is not a process of this machine's PID namespace (a "
                          "container without --pid=host?): per-process CPU, memory and NVML process memory describe "
                          "the command prefix's processes, not the worker")

    def wait(self, deadline: float) -> None:
        """Waits for the exit (the deadline plus KILL_GRACE_S once its output is closed); kills the group past it."""
        if not self.timed_out:
            try:
                self.proc.wait(timeout=max(0.0, deadline - time.monotonic()) + KILL_GRACE_S)
                self.ended = time.monotonic()
                return
            except subprocess.TimeoutExpired:
                self.timed_out = True
        _kill_group(self.proc)
        self.proc.wait()
        self.ended = time.monotonic()

    def close(self) -> None:
        """Makes sure nothing of the worker outlives it, then stops the sampler: in that order, since stopping the
        sampler waits up to 2 s for a backend call in progress (an NVML call on a loaded machine), and a Ctrl-C or
        SIGTERM must not leave the worker training meanwhile."""
        self.selector.close()
        if self.proc.poll() is None:
            _kill_group(self.proc)
            self.proc.wait()
        # Whatever the worker started must not outlive it (a framework's helper processes).
        _kill_group(self.proc)
        # A backend call stuck past the join timeout keeps its NVML handle: closing NVML under it could crash.
        if self.sampler is not None and self.sampler.stop():
            self.sampler.backend.close()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


def classify(returncode: int | None, events: list[Event], timed_out: bool, timeout_s: float,
             log_tail: str) -> tuple[Status, str]:
    """(status, reason) for a finished worker; see the module docstring for the statuses."""
    if timed_out:
        phase = first(events, Phase, last=True)
        where = f" (last phase event: {phase.name} {phase.edge})" if phase is not None else ""
        return "timeout", f"no exit within {timeout_s:g} s" + where
    error = first(events, Error)
    if error is not None:
        return error.kind, error.reason
    has_result = first(events, Result) is not None
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
