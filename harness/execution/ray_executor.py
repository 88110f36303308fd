"""The Ray executor: each trial a Ray task on whichever node of a cluster has room (``RayExecutor``, an
``harness.execution.executors.Executor``).

Each trial is what ``harness.execution.launcher.run_worker`` makes of it, run on the node where the task lands, and
comes back as plain data (its Outcome and Placement); the driver alone writes the run directory. Ray's resource
requests: https://docs.ray.io/en/latest/ray-core/scheduling/resources.html; its GPUs:
https://docs.ray.io/en/latest/ray-core/scheduling/accelerators.html. Ray is imported only when the executor is made
(``pip install -e '.[ray]'``).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from types import TracebackType
from typing import Any

from harness.execution.executors import ExecutorError, Finished, Placement, launcher_failed
from harness.execution.launcher import Outcome, run_worker
from harness.execution.protocol import Payload
from harness.record.events import Event

#: The reason of a trial whose node left the cluster while it ran (``RayExecutor``).
NODE_LOST = "node lost"


def _ray_trial(payload: Payload, timeout_s: float, interval_s: float | None, threads: int | None,
               gpu: bool) -> dict[str, Any]:
    """The body of the Ray task: runs the trial with today's launcher on the node where it landed and returns its
    Outcome and Placement as plain data. On a GPU, Ray has set CUDA_VISIBLE_DEVICES to the GPUs it granted
    (https://docs.ray.io/en/latest/ray-core/scheduling/accelerators.html): the worker trains on cuda:0 (a
    data-parallel trial on cuda:0..N-1), and the sampler maps those to NVML's numbers through the same variable;
    the placement names the granted GPUs by Ray's ids (``ray.get_gpu_ids``, the node's physical indexes). The worker
    starts cold (``worker_start: cold``): the task's process is Ray's, which kills it with the cluster, so a
    preloaded parent started in it (``harness.execution.forkserver``) would be killed unable to remove its folder,
    and would serve only the later tasks that happen to land in the same process. A launcher that raises gives the
    trial an ``error`` Outcome (``launcher_failed``), as on the local executor."""
    import ray

    payload = payload.model_copy(update={"trial": replace(payload.trial, worker_start="cold")})
    device, devices = "cpu", None
    if gpu:
        ids = [int(i) for i in ray.get_gpu_ids()] or [0]
        device = f"cuda:{ids[0]}"
        trial = replace(payload.trial, device="cuda:0")
        if trial.data_parallel > 1:
            devices = [f"cuda:{i}" for i in ids]
            trial = replace(trial, devices=tuple(f"cuda:{i}" for i in range(trial.data_parallel)))
        payload = payload.model_copy(update={"trial": trial})
    started = time.time()
    try:
        outcome = run_worker(payload, timeout_s, interval_s, "cuda:0" if gpu else "cpu", threads)
    except Exception as exc:  # noqa: BLE001 - a bug of the harness: the trial is recorded, the sweep goes on
        outcome = launcher_failed(exc)
    placement = Placement(socket.gethostname(), device, None, started, time.time(),
                          ray.get_runtime_context().get_node_id(), devices)
    return {"outcome": asdict(outcome), "placement": asdict(placement)}


def unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing answers a TCP connection at a Ray address ("host:port", "ray://host:port") within ``timeout_s``,
    or None when something does. Checked before ``ray.init``, which retries an unreachable address for minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return "not host:port (e.g. 10.0.0.5:6379, ray://10.0.0.5:10001, auto)"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError as err:
        return err.strerror or type(err).__name__


class RayExecutor:
    """Runs each trial as a Ray task (``_ray_trial``) asking for ``num_gpus=1`` on a GPU run, or ``num_cpus`` = the
    trial's threads on the CPU (https://docs.ray.io/en/latest/ray-core/scheduling/resources.html); a data-parallel
    trial on N devices is one task asking for ``num_gpus=N`` and ``num_cpus=N`` (a core per rank or device), or on
    the CPU ``num_cpus`` = max(threads, N) (a core per logical device at least), so Ray places it on one node that
    has them all. At most as many trials are in flight as the cluster has GPUs (or CPUs / threads), and no more
    GPUs (CPUs) than it has, so that ``after_oom: skip`` still sees the smaller batch sizes end first and a trial
    never waits inside Ray for resources the sweep could see are taken; one at a time when the spec is ``exclusive``.

    ``address``: an existing cluster ("auto", "ray://host:10001", "host:6379"), or None for a local one on this
    machine (``ray.init()``; ``num_cpus`` caps it). ``retries``: how many times Ray may run a trial again after its
    node or worker died (``max_retries``; 0 by default: a trial whose node is lost is recorded ``crashed`` with the
    reason "node lost"). Raises ExecutorError when Ray is not installed or the cluster cannot be reached. An
    ``Executor``; a context manager that closes it (and the local Ray instance it started)."""

    def __init__(self, address: str | None, gpu: bool, threads: int | None, retries: int = 0, exclusive: bool = False,
                 num_cpus: int | None = None):
        try:
            import ray
        except ImportError:
            raise ExecutorError("the ray executor needs Ray: pip install -e '.[ray]'") from None
        self.ray, self.gpu, self.threads, self.retries = ray, gpu, threads, retries
        self.started_ray = False
        if not ray.is_initialized():
            if address not in (None, "auto", "local") and (why := unreachable(address)) is not None:
                raise ExecutorError(f"cannot reach the Ray cluster at {address}: {why}")
            try:
                ray.init(address=address, num_cpus=num_cpus if address is None else None, include_dashboard=False,
                         log_to_driver=False, configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise ExecutorError(f"cannot reach the Ray cluster at {address or 'a new local instance'}: "
                                    f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
            self.started_ray = True
        resources = ray.cluster_resources()
        self.resource = "GPU" if gpu else "CPU"
        self.total = int(resources.get(self.resource, 0 if gpu else 1))  # GPUs (CPUs) of the whole cluster
        if gpu and self.total < 1:
            raise ExecutorError(f"the Ray cluster at {address or 'this machine'} has no GPU for a GPU run")
        room = self.total if gpu else max(1, self.total // max(1, threads or 1))
        self._capacity = 1 if exclusive else room
        self.address = address
        self._task = ray.remote(_ray_trial)
        self.running: dict[Any, Any] = {}  # key -> (ObjectRef, submitted, GPUs or CPUs asked for)

    @property
    def capacity(self) -> int:
        """The most trials in flight: the cluster's GPUs (CPUs / threads), or 1 when made ``exclusive``."""
        return self._capacity

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def describe(self) -> dict[str, Any]:
        nodes = [{"node_id": n["NodeID"], "host": n.get("NodeManagerHostname"), "alive": n.get("Alive"),
                  "resources": n.get("Resources", {})} for n in self.ray.nodes()]
        return {"executor": "ray", "address": self.address, "ray_version": self.ray.__version__,
                "retries": self.retries, "capacity": self.capacity, "nodes": nodes}

    def units(self, devices: int = 1, threads: int | None = None) -> int:
        """The GPUs (on a GPU run) or CPUs a trial on ``devices`` devices asks Ray for (the class docstring)."""
        if self.gpu:
            return max(1, devices)
        return max(1, threads or self.threads or 1, devices)

    def check(self, devices: int) -> None:
        """Raises ExecutorError when no alive node of the cluster has the GPUs (CPUs) a trial on ``devices`` devices
        asks for: one Ray task runs on one node, and Ray would keep such a task waiting forever."""
        need = self.units(devices)
        largest = max((int(n.get("Resources", {}).get(self.resource, 0)) for n in self.ray.nodes() if n.get("Alive")),
                      default=0)
        if need > largest:
            raise ExecutorError(f"a trial on {devices} devices asks Ray for {need} {self.resource}s on one node; the "
                                f"largest node of the cluster at {self.address or 'this machine'} has {largest}")

    def has_room(self, devices: int = 1) -> bool:
        """Whether a trial on ``devices`` devices can start now: fewer trials in flight than ``capacity``, and its
        GPUs (CPUs) free among the cluster's."""
        in_use = sum(units for _, _, units in self.running.values())
        return len(self.running) < self.capacity and (not self.running or in_use + self.units(devices) <= self.total)

    def running_here(self) -> dict[Any, float]:
        """Nothing: where a running task landed is known only when it returns."""
        return {}

    def submit(self, key: Any, payload: Payload, timeout_s: float, interval_s: float | None,
               threads: int | None, on_event: Callable[[Event], None] | None = None) -> None:
        """Starts the trial as a Ray task (worker events are not streamed back: ``on_event`` is not called)."""
        devices = payload.trial.data_parallel
        units = self.units(devices, threads)
        options: dict[str, Any] = {"max_retries": self.retries, "retry_exceptions": False}
        options.update({"num_gpus": units, "num_cpus": units} if self.gpu else {"num_cpus": units})
        self.running[key] = (self._task.options(**options).remote(payload, timeout_s, interval_s, threads, self.gpu),
                             time.time(), units)

    def wait(self) -> Finished:
        """The next trial to finish. A task whose node or worker process died is ``crashed`` with the reason
        "node lost: ..." (``ray.exceptions.NodeDiedError``, ``WorkerCrashedError``, ``ObjectLostError``); any other
        failure of the task itself is ``error``."""
        refs = {ref: key for key, (ref, _, _) in self.running.items()}
        while True:
            ready, _ = self.ray.wait(list(refs), num_returns=1, timeout=0.5)
            if ready:
                break
        key = refs[ready[0]]
        _, submitted, _ = self.running.pop(key)
        exceptions = self.ray.exceptions
        try:
            value = self.ray.get(ready[0])
        except (exceptions.NodeDiedError, exceptions.WorkerCrashedError, exceptions.ObjectLostError) as err:
            reason = f"{NODE_LOST}: {str(err).splitlines()[0]}"[:500]
            return Finished(key, Outcome("crashed", reason), Placement("?", "?", None, submitted, time.time()))
        except exceptions.RayError as err:
            reason = f"the Ray task failed: {str(err).splitlines()[0]}"[:500]
            return Finished(key, Outcome("error", reason), Placement("?", "?", None, submitted, time.time()))
        return Finished(key, Outcome(**value["outcome"]), Placement(**value["placement"]))

    def close(self) -> None:
        """Cancels the tasks still running (``ray.cancel(force=True)`` kills their Ray workers, and with them the
        trial workers) and shuts down the local Ray instance this executor started."""
        for ref, _, _ in self.running.values():
            try:
                self.ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001 - already finished, or the cluster is gone
                pass
        self.running.clear()
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False
