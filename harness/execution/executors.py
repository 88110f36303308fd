"""Where and how many trials run at once: the local executor (one trial per slot of this machine: a GPU, or a set of
CPU cores) and the Ray executor (each trial a Ray task on whichever node of a cluster has room:
``harness.execution.ray_executor``, which builds on this module).

Either way each trial is what ``harness.execution.launcher.run_worker`` makes of it (a fresh worker process, its
sampler thread, its classification), run on the machine where the trial lands, and the driver alone writes the run
directory (``harness.studies.sweep``). Each finished trial comes back with its ``Placement``: the node, the device as
NVML numbers it, the cores it was pinned to, and its start and end (wall clock, seconds since the epoch), from which
the sweep and the report tell which trials ran beside which.

Slots on one machine (``local_slots``):
- GPUs: one trial per listed device at a time; each worker sees only its device (``CUDA_VISIBLE_DEVICES`` = its
  entry in the caller's visible list, so the worker trains on ``cuda:0``) while the sampler watches the same GPU,
  found through the worker's own CUDA_VISIBLE_DEVICES (``harness.execution.launcher.run_worker``;
  CUDA_DEVICE_ORDER=PCI_BUS_ID, set for every worker, makes CUDA's numbers NVML's;
  https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#env-vars).
- CPU: ``parallel`` disjoint core sets of ``threads`` cores each from this process's affinity mask; each worker is
  pinned to its set (``os.sched_setaffinity`` in the bootstrap, before the framework starts its threads). The
  launcher and its sampler threads are not pinned: they share the machine with the workers, which the report says.

A data-parallel trial on N devices (``Trial.data_parallel``) takes N slots of one machine at once (``slots_for``):
N GPUs (CUDA_VISIBLE_DEVICES lists them, the worker trains on cuda:0..N-1 and the sampler watches all N), or the
union of N slots' cores and their threads together, so that each of its devices has what a one-device trial has and
the scaling efficiency compares like with like. The one default slot (no ``parallel``, no ``devices``) is the whole
machine: a data-parallel trial takes it alone, on the devices the plan named. A trial that needs more slots than
the executor has can never run: ``check`` raises ExecutorError, and the sweep stops before anything runs.
On Ray a data-parallel trial is one task asking for N GPUs (``num_gpus``; Ray places it on a node that has them).

``Executor`` (here) is what the sweep asks of either. Whoever makes an executor closes it (``close``, or ``with``):
the sweep closes the default one it makes, the CLI the one its flags ask for. A trial whose launcher raises (a bug
of the harness, not the worker's failure) comes back ``error`` with the reason "the launcher failed: ...", on every
path, and the sweep goes on.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from types import TracebackType
from typing import Any, Protocol

from harness.execution.launcher import Outcome, run_worker
from harness.execution.protocol import Payload
from harness.record.events import Event
from harness.record.trial import Placement  # the one type from executor to record (re-exported)
from harness.spec.devices import device_index, is_gpu


@dataclass(frozen=True)
class Slot:
    """One place a trial runs at a time. ``device``: what the sampler watches and the record names ("cpu",
    "cuda:3" as NVML numbers it); ``worker_device``: what the worker trains on ("cuda:0" behind
    CUDA_VISIBLE_DEVICES); ``env``: the worker's extra variables; ``cpus``: the cores it is pinned to (None: not
    pinned); ``threads``: its thread count (None: the trial's own)."""

    device: str
    worker_device: str
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] | None = None
    threads: int | None = None


@dataclass
class Finished:
    """A trial's end, as an executor hands it to the sweep: the key it was submitted with, its Outcome, where it
    ran."""

    key: Any
    outcome: Outcome
    placement: Placement


class ExecutorError(ValueError):
    """The executor cannot start (no such cluster, too few cores for the asked parallelism, Ray not installed); the
    CLI prints it in one line and exits 2."""


class Executor(Protocol):
    """Where trials run, as the sweep (``harness.studies.sweep``) uses it: ``LocalExecutor`` and ``RayExecutor``.

    The sweep submits trials in plan order while ``len(running) < capacity`` and ``has_room`` their devices, then
    waits for the next to finish; ``check`` and ``describe`` come first (a trial that could never start is refused
    before the run; run.json records the description). Nothing here closes the executor: its maker does."""

    @property
    def capacity(self) -> int:
        """The most trials in flight at once, fixed when the executor is made (an ``exclusive`` spec's executor: 1)."""
        ...

    @property
    def running(self) -> Mapping[Any, object]:
        """The trials in flight now, by the key they were submitted with."""
        ...

    def describe(self) -> dict[str, Any]:
        """The executor as run.json's ``executors`` entry records it (JSON data)."""
        ...

    def check(self, devices: int) -> None:
        """Raises ExecutorError when a trial on ``devices`` devices could never start here."""
        ...

    def has_room(self, devices: int = 1) -> bool:
        """Whether a trial on ``devices`` devices can start now."""
        ...

    def running_here(self) -> dict[Any, float]:
        """The trials running now on this machine, by key, with their start (time.time(), seconds)."""
        ...

    def submit(self, key: Any, payload: Payload, timeout_s: float, interval_s: float | None, threads: int | None,
               on_event: Callable[[Event], None] | None = None) -> object:
        """Starts the trial ``payload`` under ``key`` (``has_room`` first): per-trial ``timeout_s`` seconds, the
        sampler's ``interval_s`` seconds, ``threads`` CPU threads; ``on_event`` gets the worker's events where the
        executor streams them."""
        ...

    def wait(self) -> Finished:
        """The next trial to finish (blocks): its Outcome (``error`` when its launcher raised) and Placement."""
        ...

    def close(self) -> None:
        """Stops what still runs and releases the executor's resources; called by whoever made it."""
        ...


def launcher_failed(exc: BaseException) -> Outcome:
    """The Outcome of a trial whose launcher raised ``exc`` (a bug of the harness, not the worker's failure): status
    ``error``, the reason "the launcher failed: <type>: <message>" (500 characters at most)."""
    return Outcome("error", f"the launcher failed: {type(exc).__name__}: {exc}"[:500])


def visible_gpus(env: dict[str, str] | None = None) -> list[str] | None:
    """The caller's CUDA_VISIBLE_DEVICES as a list (None when it is not set): cuda:i of this process is entry i."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    return None if value is None else [part.strip() for part in value.split(",") if part.strip()]


def local_slots(device: str, parallel: int = 1, devices: list[str] | None = None, threads: int | None = None,
                cpus: list[int] | None = None, env: dict[str, str] | None = None) -> list[Slot]:
    """The slots of this machine (module docstring). ``device``: the run's resolved device ("cpu" or "cuda:N");
    ``parallel``: how many trials at once; ``devices``: the GPUs to use, one trial each at a time, a data-parallel
    trial on N devices taking N of them (overrides ``parallel``); ``threads``: cores per CPU slot (default: the
    available cores split evenly); ``cpus``: the available cores (default: this process's affinity mask). One slot
    without ``devices`` and with ``parallel`` 1 is today's single trial at a time, on ``device`` as it is (no
    CUDA_VISIBLE_DEVICES, no pinning).

    Raises ExecutorError when ``parallel`` is below 1, when the CPU slots would need more cores than there are, or
    when a listed device is not a GPU."""
    if parallel < 1:
        raise ExecutorError(f"--parallel must be at least 1, not {parallel}")
    if devices:
        if not all(is_gpu(d) for d in devices):
            raise ExecutorError(f"devices must all be cuda:N, not {', '.join(devices)}")
        names = [f"cuda:{device_index(d)}" for d in devices]
    elif parallel == 1:
        return [Slot(device, device)]
    elif device.startswith("cuda"):
        names = [f"cuda:{i}" for i in range(parallel)]
    else:
        names = []
    if names:
        visible = visible_gpus(env)
        slots = []
        for name in names:
            index = device_index(name)
            if visible is not None and index >= len(visible):
                raise ExecutorError(f"{name} is not visible (CUDA_VISIBLE_DEVICES={','.join(visible)})")
            physical = visible[index] if visible is not None else str(index)
            nvml = f"cuda:{physical}" if physical.isdigit() else name  # a UUID: NVML cannot be told by index
            slots.append(Slot(nvml, "cuda:0", {"CUDA_VISIBLE_DEVICES": physical}))
        return slots
    available = sorted(cpus if cpus is not None else _affinity())
    per = threads or len(available) // parallel
    if per < 1 or per * parallel > len(available):
        raise ExecutorError(f"--parallel {parallel} with {threads or per} thread(s) per trial needs "
                            f"{parallel * max(per, 1)} cores; this process may use {len(available)}")
    return [Slot("cpu", "cpu", {}, tuple(available[k * per:(k + 1) * per]), per) for k in range(parallel)]


def _affinity() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _whole_machine(slots: list[Slot]) -> bool:
    """One slot with neither a GPU of its own nor pinned cores: this machine as it is (``local_slots``' default)."""
    return len(slots) == 1 and "CUDA_VISIBLE_DEVICES" not in slots[0].env and slots[0].cpus is None


def joined(slots: list[Slot]) -> Slot:
    """The slot a data-parallel trial runs on when it takes ``slots`` together: their GPUs (CUDA_VISIBLE_DEVICES lists
    each slot's, in order, so the worker trains on cuda:0..N-1) or the union of their cores with their threads
    summed. ``device`` is the first slot's (the record's ``placement.devices`` names them all)."""
    if len(slots) == 1:
        return slots[0]
    env = {key: value for slot in slots for key, value in slot.env.items()}
    gpus = [slot.env.get("CUDA_VISIBLE_DEVICES") for slot in slots]
    if all(gpu is not None for gpu in gpus):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in gpus)
    cpus = (tuple(sorted({c for slot in slots for c in slot.cpus or ()}))
            if all(slot.cpus is not None for slot in slots) else None)
    threads = sum(slot.threads or 0 for slot in slots) if all(slot.threads for slot in slots) else None
    return Slot(slots[0].device, slots[0].worker_device, env, cpus, threads)


def placed_payload(payload: Payload, slot: Slot, count: int) -> Payload:
    """``payload`` with its trial moved onto ``slot`` (taken from ``count`` slots): the slot's worker device and
    threads, and for a data-parallel trial on GPUs the devices cuda:0..count-1 (the slot's CUDA_VISIBLE_DEVICES)."""
    trial = replace(payload.trial, device=slot.worker_device)
    if count > 1 and slot.worker_device.startswith("cuda"):
        trial = replace(trial, devices=tuple(f"cuda:{i}" for i in range(count)))
    if slot.threads is not None:
        trial = replace(trial, threads=slot.threads)
    return payload.model_copy(update={"trial": trial})


class LocalExecutor:
    """Runs trials on this machine, one per ``Slot`` at a time, a data-parallel trial on N devices on N slots at
    once (``slots_for``, module docstring). With a capacity of one (one slot, or ``exclusive``) the trial runs in the
    calling thread (exactly the sequential sweep: a Ctrl-C reaches the launcher, which kills the worker); with more,
    each in a thread of its own, and ``close`` kills the workers still running. Either way a launcher that raises an
    Exception gives the trial an ``error`` Outcome (``launcher_failed``). The free slots are taken in the order of
    ``slots``. An ``Executor``; a context manager that closes it."""

    def __init__(self, slots: list[Slot], exclusive: bool = False):
        self.slots = list(slots)
        self.free = list(self.slots)
        self._capacity = 1 if exclusive else len(self.slots)
        self._pending: list[tuple[Any, list[Slot], Callable[[], Outcome], float]] = []
        self._done: queue.Queue[Finished] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.running: dict[Any, tuple[list[Slot], float]] = {}

    @property
    def capacity(self) -> int:
        """The most trials at once: the slots, or 1 when made ``exclusive``."""
        return self._capacity

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def describe(self) -> dict[str, Any]:
        return {"executor": "local", "slots": [asdict(s) for s in self.slots], "node": socket.gethostname()}

    def slots_for(self, devices: int = 1) -> int:
        """How many slots a trial on ``devices`` devices takes: one per device, or 1 on the whole machine's single
        slot (the trial then trains on the devices its plan named)."""
        return 1 if _whole_machine(self.slots) else max(1, devices)

    def check(self, devices: int) -> None:
        """Raises ExecutorError when a trial on ``devices`` devices needs more slots than this executor has (it could
        never start)."""
        if (need := self.slots_for(devices)) > len(self.slots):
            where = ", ".join(s.device + (f" (cores {','.join(map(str, s.cpus))})" if s.cpus else "")
                              for s in self.slots)
            raise ExecutorError(f"a trial on {devices} devices takes {need} slots, one per device, and the local "
                                f"executor has {len(self.slots)}: {where}")

    def has_room(self, devices: int = 1) -> bool:
        """Whether a trial on ``devices`` devices can start now (enough free slots)."""
        return len(self.free) >= self.slots_for(devices)

    def running_here(self) -> dict[Any, float]:
        """The trials running now on this machine, with their start (time.time())."""
        return {key: started for key, (_, started) in self.running.items()}

    def submit(self, key: Any, payload: Payload, timeout_s: float, interval_s: float | None,
               threads: int | None, on_event: Callable[[Event], None] | None = None) -> Slot:
        """Starts the trial ``payload`` on free slots (``slots_for`` its devices; call ``has_room`` first) and returns
        the slot it runs on (``joined``). The payload's device(s) and threads become the slot's. Raises
        ExecutorError when too few slots are free."""
        need = self.slots_for(payload.trial.data_parallel)
        if need > len(self.free):
            raise ExecutorError(f"{key}: {need} slot(s) needed, {len(self.free)} free (ask has_room first)")
        taken, self.free = self.free[:need], self.free[need:]
        slot = joined(taken)
        payload = placed_payload(payload, slot, need)
        threads = slot.threads if slot.threads is not None else threads

        def work() -> Outcome:
            return run_worker(payload, timeout_s, interval_s, slot.worker_device, threads, on_event=on_event,
                              env=slot.env or None, cpus=list(slot.cpus) if slot.cpus else None,
                              stop=None if self.capacity == 1 else self._stop)

        started = time.time()
        self.running[key] = (taken, started)
        if self.capacity == 1:
            self._pending.append((key, taken, work, started))
        else:
            thread = threading.Thread(target=self._run, args=(key, taken, work, started), daemon=True,
                                      name=f"harness-trial-{key}")
            self._threads.append(thread)
            thread.start()
        return slot

    @staticmethod
    def _placement(taken: list[Slot], started: float) -> Placement:
        cpus = sorted({c for slot in taken for c in slot.cpus or ()}) or None
        gpus = [slot.device for slot in taken] if len(taken) > 1 and taken[0].device.startswith("cuda") else None
        return Placement(socket.gethostname(), taken[0].device, cpus, started, time.time(), devices=gpus)

    def _run(self, key: Any, taken: list[Slot], work: Callable[[], Outcome], started: float) -> None:
        try:
            outcome = work()
        except BaseException as exc:  # noqa: BLE001 - a bug of the harness: the trial is recorded, the sweep goes on
            outcome = launcher_failed(exc)
        self._done.put(Finished(key, outcome, self._placement(taken, started)))

    def wait(self) -> Finished:
        """The next trial to finish (blocks; wakes every 0.2 s so that signals reach the main thread); its slots are
        free again."""
        if self._pending:
            key, taken, work, started = self._pending.pop(0)
            try:
                outcome = work()  # in this thread: an interrupt goes through run_worker, which kills the worker
            except Exception as exc:  # noqa: BLE001 - a bug of the harness: the trial is recorded, the sweep goes on
                outcome = launcher_failed(exc)  # (KeyboardInterrupt and the sweep's Interrupted go on: a stop)
            finished = Finished(key, outcome, self._placement(taken, started))
        else:
            while True:
                try:
                    finished = self._done.get(timeout=0.2)
                    break
                except queue.Empty:
                    continue
        taken, _ = self.running.pop(finished.key)
        back = [*self.free, *taken]
        self.free = [slot for slot in self.slots if any(slot is other for other in back)]
        return finished

    def close(self) -> None:
        """Kills the workers still running (their trials are not recorded) and waits for their threads."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
