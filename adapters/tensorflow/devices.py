"""Where the TensorFlow adapter trains: the one device ("/CPU:0", or GPU N made visible as "/GPU:0") or the N replicas
of a data-parallel trial with their ``tf.distribute.MirroredStrategy``, the GPU memory options, TF32, threads and the
seed; and the contexts the rest of the adapter creates variables and runs under (``placement``, ``first``).

Everything here runs before TF's context starts (``Devices.prepare``): TF fixes visible devices, logical devices,
memory growth and thread pools when it starts, and raises RuntimeError for a later change (repeating the same settings
is allowed), which is also why a test process keeps one thread count throughout.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from adapters.base import DataParallel, DeviceUnavailable, RunOptions, device_index, device_kind


def default_threads() -> int:
    """What TF uses for a thread count of 0: the CPUs this process may run on (tsl::port::NumSchedulableCPUs)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def device_problem(device: str) -> str | None:
    """tf.config.list_physical_devices("GPU") (https://www.tensorflow.org/api_docs/python/tf/config/
    list_physical_devices): lists GPUs without creating the TF context (so ``prepare`` can still configure them);
    tf.sysconfig.get_build_info()["is_cuda_build"] tells a CPU-only build (tensorflow-cpu)."""
    if not device.startswith("cuda"):
        return None
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        cuda_build = tf.sysconfig.get_build_info().get("is_cuda_build", False)
        why = "no GPU was found by this CUDA build" if cuda_build else "a CPU-only build"
        return f"TensorFlow {tf.__version__} sees no GPU ({why})"
    index = device_index(device)
    return None if index < len(gpus) else f"TensorFlow sees {len(gpus)} GPU(s); {device} is not one"


class Devices:
    """The trial's devices as ``prepare`` set them up from ``options``. device: TF's name of the (first) device;
    gpu: it is a GPU; replicas: the data-parallel devices ("/cpu:0", ... or "/gpu:0", ...), empty for one device;
    strategy: the MirroredStrategy over them, or None; memory_settings: what ``configure_gpu_memory`` applied, for
    the record."""

    def __init__(self, options: RunOptions) -> None:
        self.options = options
        self.device, self.gpu = "/CPU:0", False
        self.replicas: tuple[str, ...] = ()
        self.strategy: tf.distribute.MirroredStrategy | None = None
        self.memory_settings: dict[str, Any] = {}

    def prepare(self, device: str, threads: int | None, seed: int) -> None:
        """Must run before any TF op in the process. For ``cuda:N`` only GPU N is made visible (it is then "/GPU:0"),
        with memory growth (https://www.tensorflow.org/api_docs/python/tf/config/experimental/set_memory_growth) or a
        memory limit as ``options`` ask (``configure_gpu_memory``) and TF32 off, or on for ``options.precision``
        "tf32" (https://www.tensorflow.org/api_docs/python/tf/config/experimental/enable_tensor_float_32_execution).
        Raises DeviceUnavailable when TF sees no such GPU (a CPU-only build such as tensorflow-cpu, or no driver).
        With ``options.data_parallel``, the devices are its (``_prepare_replicas``) and a ``MirroredStrategy`` over
        them is created last. ``threads``: TF's intra-op pool (inter-op 1); None keeps TF's defaults."""
        data_parallel = self.options.data_parallel
        if data_parallel is not None:
            self._prepare_replicas(device, data_parallel)
        elif device.startswith("cuda"):
            if (problem := device_problem(device)) is not None:
                raise DeviceUnavailable(problem)
            gpus = tf.config.list_physical_devices("GPU")
            index = device_index(device)
            tf.config.set_visible_devices([gpus[index]], "GPU")
            self.configure_gpu_memory(gpus[index])
            # fp32 means fp32: no TF32 in matmuls or convolutions (the other frameworks' defaults differ otherwise);
            # tf32 asks for it.
            tf.config.experimental.enable_tensor_float_32_execution(self.options.precision == "tf32")
            self.device, self.gpu = "/GPU:0", True
        else:
            tf.config.set_visible_devices([], "GPU")
            self.device, self.gpu = "/CPU:0", False
        if threads is not None:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.random.set_seed(seed)
        if data_parallel is not None:
            self.strategy = _strategy(self.replicas)

    def _prepare_replicas(self, device: str, data_parallel: DataParallel) -> None:
        """The N devices of a data-parallel trial, before TF's context starts. CPU: the one physical CPU split into N
        logical CPU devices, "/cpu:0" ... (https://www.tensorflow.org/api_docs/python/tf/config/
        set_logical_device_configuration); they share the host's memory, TF's CPU allocator (so a
        ``cpu_allocator_cap`` caps them together) and its intra-op thread pool. The CPU's memory cap is the worker's
        process limit, never a logical device configuration, so nothing else configures them. GPUs: "cuda:i" ... made
        visible (then "/gpu:0" ... in increasing physical order), each with ``configure_gpu_memory`` (a memory
        limit then applies to every GPU: a logical device each) and TF32 as for one GPU. Raises ValueError when the
        devices are not all of ``device``'s kind, DeviceUnavailable when TF lacks one, RuntimeError when TF started
        before (its devices are then fixed)."""
        kind, n = device_kind(device), data_parallel.size
        if any(device_kind(d) != kind for d in data_parallel.devices):
            raise ValueError(f"the data-parallel devices {', '.join(data_parallel.devices)} are not all {kind} "
                             "devices")
        if kind == "cuda":
            for d in data_parallel.devices:
                if (problem := device_problem(d)) is not None:
                    raise DeviceUnavailable(problem)
            gpus = tf.config.list_physical_devices("GPU")
            picked = sorted({device_index(d) for d in data_parallel.devices})
            if len(picked) != n:
                raise ValueError(f"the data-parallel devices {', '.join(data_parallel.devices)} repeat a GPU")
            tf.config.set_visible_devices([gpus[i] for i in picked], "GPU")
            for i in picked:
                self.configure_gpu_memory(gpus[i])
            tf.config.experimental.enable_tensor_float_32_execution(self.options.precision == "tf32")
            self.replicas = tuple(f"/gpu:{i}" for i in range(n))
            self.device, self.gpu = "/GPU:0", True
        else:
            tf.config.set_visible_devices([], "GPU")
            cpu = tf.config.list_physical_devices("CPU")[0]
            try:
                tf.config.set_logical_device_configuration(
                    cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
            except RuntimeError as err:  # "Virtual devices cannot be modified after being initialized"
                raise RuntimeError(
                    f"TensorFlow cannot split the CPU into {n} logical devices: its runtime started before prepare "
                    f"(with {len(tf.config.list_logical_devices('CPU'))} CPU device(s)); TF fixes its devices when "
                    f"it starts ({err})") from err
            self.replicas = tuple(f"/cpu:{i}" for i in range(n))
            self.device, self.gpu = "/CPU:0", False

    def configure_gpu_memory(self, gpu: Any) -> None:
        """The allocator settings of ``options``, applied to one visible GPU before TF's context starts.

        ``memory_limit_bytes``: a logical device with that ``memory_limit`` (in whole 2^20-byte units, TF's "MB",
        rounded down so that the cap is never above the request;
        https://www.tensorflow.org/api_docs/python/tf/config/set_logical_device_configuration,
        https://www.tensorflow.org/guide/gpu#limiting_gpu_memory_growth). TF refuses memory growth on a device that
        has a logical device configuration (``set_memory_growth`` raises ValueError "Cannot set memory growth on device
        when virtual devices configured", and the GPU options it builds then carry no allow_growth), so with a limit
        growth is not enabled, whatever ``tensorflow_memory_growth`` says, and settings record ``memory_growth``
        False and why: TF's BFC allocator then takes the whole limit from the device at its first allocation.
        Without a limit, ``tensorflow_memory_growth`` (default True) enables growth
        (https://www.tensorflow.org/api_docs/python/tf/config/experimental/set_memory_growth); False leaves TF's
        default, which maps nearly all of the GPU's memory when the context starts."""
        growth = self.options.allocator.tensorflow_memory_growth
        limit = self.options.memory_limit_bytes
        self.memory_settings = {"memory_limit_bytes": None, "memory_growth": growth}
        if limit:
            mib = max(int(limit) // 2**20, 1)
            tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=mib)])
            self.memory_settings = {"memory_limit_bytes": mib * 2**20, "memory_limit_requested_bytes": int(limit),
                                    "memory_growth": False}
            if growth:
                self.memory_settings["memory_growth_skipped"] = (
                    "TensorFlow cannot combine memory growth with a memory limit (logical device configuration)")
        elif growth:
            tf.config.experimental.set_memory_growth(gpu, True)

    def placement(self) -> Any:
        """Where variables are created (the model's, the optimizer's, the loss scale's): under the strategy's scope
        when data-parallel (mirrored on every replica's device), else on the device."""
        return self.strategy.scope() if self.strategy is not None else tf.device(self.device)

    @contextlib.contextmanager
    def first(self) -> Iterator[None]:
        """Evaluation, prediction and the state read: on the (first) device, and data-parallel in the strategy's
        cross-replica context, where a mirrored variable reads as the first device's copy and a sync-on-read one
        (batchnorm's running statistics, ``adapters.tensorflow.neutral``) as the mean of the copies."""
        with contextlib.ExitStack() as stack:
            if self.strategy is not None:
                stack.enter_context(self.strategy.scope())
            stack.enter_context(tf.device(self.device))
            yield

    def gpu_names(self) -> list[str]:
        """The GPUs this trial trains on, as ``get_memory_info`` names them: "GPU:0", ... (none on the CPU)."""
        if not self.gpu:
            return []
        return [f"GPU:{i}" for i in range(max(len(self.replicas), 1))]

    def data_parallel_settings(self) -> dict[str, Any] | None:
        """A data-parallel trial's record: the mechanism, the replicas' devices, the strategy's cross-device ops
        (what MirroredStrategy chose) and whether batchnorm is synchronised; None for one device."""
        data_parallel = self.options.data_parallel
        if self.strategy is None or data_parallel is None:
            return None
        ops = getattr(self.strategy.extended, "_cross_device_ops", None)  # what MirroredStrategy chose
        options = getattr(ops, "_options", None)
        implementation = getattr(getattr(options, "implementation", None), "name", "")
        return {"mechanism": "tf.distribute.MirroredStrategy", "world_size": len(self.replicas),
                "devices": list(self.replicas),
                "cross_device_ops": type(ops).__name__ + (f" ({implementation})" if implementation else ""),
                "sync_batchnorm": data_parallel.sync_batchnorm}


#: The process's MirroredStrategy of each device list (``_strategy``).
_STRATEGIES: dict[tuple[str, ...], tf.distribute.MirroredStrategy] = {}


def _strategy(devices: tuple[str, ...]) -> tf.distribute.MirroredStrategy:
    """The ``tf.distribute.MirroredStrategy`` over ``devices`` (https://www.tensorflow.org/api_docs/python/tf/
    distribute/MirroredStrategy; its default cross-device ops are CollectiveAllReduce, RING on CPUs and NCCL on
    physical GPUs), one per process: every MirroredStrategy numbers its collective ops from the same keys (group 1,
    instances from 100), so the all-reduces of a second one over the same devices in the process would be matched
    with the first's ("Shape mismatch in the collective instance 100"). A worker trains one trial; tests build
    several adapters in one process."""
    if devices not in _STRATEGIES:
        _STRATEGIES[devices] = tf.distribute.MirroredStrategy(list(devices))
    return _STRATEGIES[devices]
