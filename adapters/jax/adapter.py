"""JAX adapter (with optax): ``JaxAdapter`` implements ``adapters.base.Adapter`` from three parts of this package,
the neutral builder (``adapters.jax.neutral``: the canonical layers as ``jax.lax`` ops over a parameter dict, in
TensorFlow's layouts, NHWC), the training mechanics (``adapters.jax.training``: any functional model, one mode,
"compiled": ``jax.jit`` of the whole step per (batch size, micro-batches), XLA; fp32 (``lax.Precision.HIGHEST``),
tf32 (GPUs), bf16, and fp16 (GPUs) with dynamic loss scaling; data parallelism over a ``Mesh``) and the input
(``adapters.jax.inputs``: resident on the device, or a Grain pipeline put on the device ahead of the step). Here: the
device (and the mesh of a data-parallel trial), the precision flags, the GPU memory cap, and the telemetry. A model of
your own is a Flax module (``adapters.jax.flax_model``) trained by the same mechanics.

Design: docs/design/framework-caveats.md#jax (flax for a model of your own only, layouts, precision, memory and CPU
threads).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from typing import Any

import numpy as np

from adapters.base import (
    DataParallel,
    DeviceUnavailable,
    Model,
    RunOptions,
    Settings,
    Weights,
    device_index,
)
from adapters.jax import DECLARATION, flax_model
from adapters.jax import layers as L
from adapters.jax.inputs import Inputs
from adapters.jax.neutral import Builder, NeutralModel
from adapters.jax.runtime import jax, jnp, one_thread, optax
from adapters.jax.training import DATA, Functional, Training
from adapters.parts import Facade
from harness.neutral.info import ModelInfo
from harness.neutral.native import NativeSource
from harness.spec import OptimizerSpec


def _oom_types() -> tuple[type, ...]:
    found = [getattr(jax.errors, "JaxRuntimeError", None)]
    try:
        from jax._src.lib import _jax as _lib  # where XlaRuntimeError lives in recent jaxlib
        found.append(getattr(_lib, "XlaRuntimeError", None))
    except ImportError:  # pragma: no cover - older jaxlib
        pass
    return tuple(t for t in found if isinstance(t, type))


class JaxAdapter(Facade[Training, Inputs], declaration=DECLARATION):
    def __init__(self, options: RunOptions | None = None) -> None:
        super().__init__(options)
        self.device: Any = None
        self._gpu = False
        self._one_arena = False
        self._seed = 0
        self._compute = L.POLICIES[self.options.precision]
        self._memory: dict[str, Any] = {}  # what _apply_memory_limit applied, for settings()
        # Data-parallel (``options.data_parallel``): the Mesh of its N devices (axis DATA), else None.
        self._mesh: Any = None
        self._neutral: NeutralModel | None = None  # the neutral builder's model, for the canonical state
        self._native: dict[str, str] = {}  # a model of your own: what the record says of it (flax_model.Adopted)

    # -- setup ---------------------------------------------------------------------------------------------------

    def versions(self) -> dict[str, str]:
        out = {"jax": jax.__version__, "optax": optax.__version__}
        for dist in ("jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", *(
                self.declaration.capabilities.loader_modules.values() if self.options.input == "loader" else ()), *(
                ("flax",) if self._native else ())):
            try:
                out[dist.replace("-", "_")] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
        return out

    def device_problem(self, device: str) -> str | None:
        """jax.devices("gpu") (https://docs.jax.dev/en/latest/_autosummary/jax.devices.html) raises RuntimeError
        when no GPU backend is installed or none initialises (a CPU-only jaxlib without the CUDA plugin). It starts
        the GPU backend: the probe sets XLA_PYTHON_CLIENT_PREALLOCATE=false so that this takes no memory."""
        if not device.startswith("cuda"):
            return None
        try:
            devices = jax.devices("gpu")
        except RuntimeError as err:
            if not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
                return f"JAX {jax.__version__} sees no GPU (a CPU-only build: no CUDA plugin installed)"
            return f"JAX {jax.__version__} sees no GPU ({str(err).splitlines()[0][:160]})"
        index = device_index(device)
        return None if index < len(devices) else f"JAX sees {len(devices)} GPU(s); {device} is not one"

    def prepare(self, device: str, threads: int | None, seed: int) -> None:
        """The device (data-parallel: the mesh, ``_prepare_data_parallel``), the precision's matmul precision for the
        ops without a precision argument (``jax_default_matmul_precision``: jax.nn.dot_product_attention's), the GPU
        memory cap, and the seed of the training PRNG key. ``threads`` is the launcher's: XLA's CPU client has no
        thread count of its own (``adapters.jax.runtime`` turns its Eigen pool off for one thread)."""
        jax.config.update("jax_default_matmul_precision", self._compute.precision.name.lower())
        if self.options.compilation_cache is not None:  # JAX's persistent cache, every program whatever its size
            jax.config.update("jax_compilation_cache_dir", self.options.compilation_cache)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        if device.startswith("cuda"):
            self._apply_memory_limit()
            if (problem := self.device_problem(device)) is not None:
                raise DeviceUnavailable(problem)
            self.device, self._gpu = jax.devices("gpu")[device_index(device)], True
        else:
            if self._inline_cpu():  # read once, when the CPU client is made (by the jax.devices below)
                jax.config.update("jax_cpu_enable_async_dispatch", False)
                self._one_arena = _one_malloc_arena()
            self.device = jax.devices("cpu")[0]
        self._mesh = None
        if self.options.data_parallel is not None:
            self._prepare_data_parallel(self.options.data_parallel)
        self._seed = seed

    def _inline_cpu(self) -> bool:
        """Whether each computation runs inline (``jax_cpu_enable_async_dispatch`` off): a one-device CPU trial
        under a memory cap (``RunOptions.memory_limit_bytes``), whose peak VmData must not depend on which of XLA's
        threads' malloc arenas a step's temporaries land in; such a trial also limits malloc to one arena
        (``_one_malloc_arena``). Data-parallel and uncapped trials keep JAX's asynchronous default; the settings
        record which (``cpu_async_dispatch``, ``malloc_arenas``).
        Why, measured: docs/design/max-batch.md#jax-under-the-cpu-cap."""
        return bool(self.options.memory_limit_bytes) and self.options.data_parallel is None

    def _prepare_data_parallel(self, parallel: DataParallel) -> None:
        """A ``jax.sharding.Mesh`` over the trial's devices (``DataParallel.devices``: "cpu:i" is the i-th of
        ``jax.devices("cpu")``, host devices that ``--xla_force_host_platform_device_count`` in XLA_FLAGS makes (the
        declaration's ``DataParallelism.environment``, set before JAX is imported); "cuda:i" the i-th GPU) with one
        axis, DATA; the first of them is ``self.device`` (evaluation, ``predict``, memory statistics). One process
        drives them all. Raises DeviceUnavailable when JAX sees fewer devices than the trial names."""
        found = []
        for name, (kind, index) in zip(parallel.devices, parallel.one_process_devices("jax")):
            platform = "gpu" if kind == "cuda" else kind
            try:
                devices = jax.devices(platform)
            except RuntimeError as err:
                raise DeviceUnavailable(f"JAX {jax.__version__} has no {platform} devices for {name}: "
                                        f"{str(err).splitlines()[0][:160]}") from err
            if index >= len(devices):
                hint = (" (XLA_FLAGS must hold --xla_force_host_platform_device_count="
                        f"{parallel.size} before JAX is imported; it is {os.environ.get('XLA_FLAGS', '')!r})"
                        if platform == "cpu" else "")
                raise DeviceUnavailable(f"JAX sees {len(devices)} {platform} device(s); the data-parallel trial "
                                        f"needs {name}{hint}")
            found.append(devices[index])
        self._mesh = jax.sharding.Mesh(np.array(found), (DATA,))
        self.device, self._gpu = found[0], found[0].platform == "gpu"

    def _apply_memory_limit(self) -> None:
        """``options.memory_limit_bytes`` on a GPU: XLA_PYTHON_CLIENT_MEM_FRACTION = limit / the device's memory
        (NVML's, else nvidia-smi's), set before JAX's GPU backend starts; XLA's allocator then fails past it with
        RESOURCE_EXHAUSTED (on an H200 under a 16 GB cap: docs/findings/2026-11-27-gpu-steps.md)."""
        limit = self.options.memory_limit_bytes
        if not limit:
            return
        total = _gpu_total_memory()
        if total:
            fraction = min(float(limit) / total, 1.0)
            os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.4f}"
            self._memory = {"memory_limit_bytes": int(limit), "memory_fraction": fraction,
                            "device_total_memory_bytes": total}
        else:
            self._memory = {"memory_limit_bytes": int(limit), "memory_limit_skipped": "device memory unknown"}

    def neutral_model(self, info: ModelInfo, weights: Weights) -> Model:
        """``adapters.jax.neutral.Builder``'s ``Functional`` in the options' compute policy (``layers.POLICIES``),
        its batchnorm synchronised over the mesh axis when a data-parallel trial asks for it; its layouts are kept
        for ``get_weights``."""
        parallel = self.options.data_parallel
        sync = DATA if parallel is not None and parallel.sync_batchnorm else None
        self._neutral = Builder(self._compute, sync).build(info, weights)
        self._native = {}
        return self._neutral.model

    def native_model(self, model: object, source: NativeSource) -> Model:
        """A Flax module of your own (``flax.linen.Module`` or ``flax.nnx.Module``) as a ``Functional``
        (``adapters.jax.flax_model.adopt``: a linen module initialised with ``jax.random.PRNGKey(source.seed)`` on
        the device, its ``__call__`` told training from inference by a ``train`` or ``deterministic`` argument;
        an nnx module split, with nnx's own ``train()`` / ``eval()``). Its logits are its output (an array, a
        ``logits`` attribute, or a tuple's first). Raises NativeModelError for anything else."""
        adopted = flax_model.adopt(model, source, self.device)
        self._neutral, self._native = None, adopted.settings
        return adopted.model

    def train_flops_per_sample(self) -> tuple[int | None, str]:
        """The "flops" of XLA's cost analysis of the compiled train step (``Training.step_flops``) over the samples
        one device trains in it: forward, backward and the optimizer update, every op XLA counts (elementwise ones
        too), as compiled (after its simplifications). None with the reason where the backend reports none."""
        source = "XLA's cost analysis of the compiled train step"
        flops, samples = self.training.step_flops()
        if flops is None:
            return None, f"{source} has no flops on {getattr(self.device, 'platform', 'this backend')}"
        return int(round(flops / samples)), source

    def make_parts(self, model: Model, task: str, optimizer: OptimizerSpec) -> tuple[Training, Inputs]:
        """``model`` (a ``training.Functional``) trained through ``adapters.jax.training.Training`` on the device (or
        the mesh), its data through ``adapters.jax.inputs.Inputs``."""
        if not isinstance(model, Functional):
            raise TypeError(f"the jax adapter trains an adapters.jax.training.Functional, not {type(model).__name__}")
        if self._neutral is not None and model is not self._neutral.model:
            self._neutral = None  # another source's model: its own names
        training = Training(model, task, optimizer, self.options, self.device, self._mesh, self._seed)
        return training, Inputs(self.options, self.device, training.placement, task != "image_classification")

    # -- steps ---------------------------------------------------------------------------------------------------

    def wait(self) -> None:
        self.training.wait()

    # -- state ---------------------------------------------------------------------------------------------------

    def _state(self, tree: Any) -> Weights:
        """``tree`` (the first device's) in the canonical layouts for the neutral model; for another model its leaves
        by their pytree paths, as float32 numpy."""
        if self._neutral is not None:
            return self._neutral.canonical(tree)
        return {jax.tree_util.keystr(path): np.array(leaf, dtype=np.float32)
                for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}

    def get_weights(self) -> Weights:
        return self._state(self.training.first(self.training.params))

    def get_buffers(self) -> Weights:
        return self._state(self.training.first(self.training.stats))

    # -- telemetry -----------------------------------------------------------------------------------------------

    def reset_memory_stats(self) -> None:
        """JAX cannot reset its allocator's peak: ``memory_stats`` reports the peak since the worker started,
        compilation and warm-up included."""

    def memory_stats(self) -> dict[str, int]:
        stats = self.device.memory_stats() if self.device is not None else None
        if not stats or "peak_bytes_in_use" not in stats:
            return {}  # the CPU backend keeps no allocator statistics
        return {"allocator_peak_bytes": int(stats["peak_bytes_in_use"])}

    def settings(self) -> Settings:
        extras: dict[str, Any] = {
            "platform": getattr(self.device, "platform", None),
            "XLA_PYTHON_CLIENT_PREALLOCATE": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            # of conv, dense, attention, the embedding's output; a Flax module's layers compute in their own dtype
            "compute_dtype": "the module's own (its layers' dtype)" if self._native else self._compute.dtype.name,
            **{f"native_{key}": value for key, value in self._native.items()},
            "matmul_precision": self._compute.precision.name.lower(),  # of those ops; "highest" is float32
            **(self._training.settings() if self._training is not None else {}),
            "allocator_peak": "since the worker started (JAX cannot reset it)",
            "compilation_cache_dir": jax.config.jax_compilation_cache_dir,
        }
        if not self._gpu:
            inline = not jax.config.read("jax_cpu_enable_async_dispatch")
            extras["cpu_async_dispatch"] = ("off: each step runs on the calling thread (a memory-capped CPU trial)"
                                            if inline else "on (JAX's default)")
            if self._one_arena:
                extras["malloc_arenas"] = "1 (mallopt M_ARENA_MAX: a memory-capped CPU trial)"
        if not one_thread():
            extras["intra_op_threads_note"] = "XLA's default (every core; it has no intra-op thread count)"
        if self._compute.dtype != jnp.float32:
            extras["master_weights"] = "float32"
        if self._gpu:
            extras["XLA_PYTHON_CLIENT_MEM_FRACTION"] = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
            extras.update({k: v for k, v in self._memory.items() if k != "memory_limit_bytes"})
        data_parallel = None
        if self._mesh is not None:
            data_parallel = {
                "devices": [str(d) for d in self._mesh.devices.flat],
                "mechanism": self.declaration.data_parallel.mechanism,
                "batchnorm": "synchronised (pmean of the batch moments)" if self.options.data_parallel is not None
                and self.options.data_parallel.sync_batchnorm else
                "per device; running statistics: the mean of the devices' (pmean)",
                "evaluation": "the first device",
                "steps_in_flight": "any (GPUs)" if self._gpu else "one (host devices: see Training._run)"}
        return Settings(precision=self.options.precision, compile=self.mode,
                        intra_op_threads=1 if one_thread() else None,
                        memory_limit_bytes=self._memory.get("memory_limit_bytes") if self._gpu else None,
                        loader=self.loader_settings(),
                        data_parallel=data_parallel, **extras)

    def is_oom(self, exc: BaseException) -> bool:
        # XLA reports an allocation failure as a runtime error with the RESOURCE_EXHAUSTED status.
        types = _oom_types()
        return bool(types) and isinstance(exc, types) and "RESOURCE_EXHAUSTED" in str(exc)


#: glibc's <malloc.h>: the most malloc arenas the process may have (mallopt's M_ARENA_MAX).
M_ARENA_MAX = -8


def _one_malloc_arena() -> bool:
    """glibc's malloc limited to one arena from now on (``mallopt(M_ARENA_MAX, 1)``): threads started later (XLA's
    CPU client, LLVM's compile threads) allocate from the main arena instead of one each, whose high-water marks
    VmData keeps. False where that is not glibc's malloc."""
    try:
        import ctypes

        return bool(ctypes.CDLL(None).mallopt(M_ARENA_MAX, 1))
    except (OSError, AttributeError):
        return False


def _gpu_total_memory() -> int | None:
    """The first visible GPU's memory in bytes, from NVML (nvidia-ml-py) or nvidia-smi; None when neither tells."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = (pynvml.nvmlDeviceGetHandleByUUID(visible) if visible.startswith(("GPU-", "MIG-"))
                      else pynvml.nvmlDeviceGetHandleByIndex(int(visible or 0)))
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no bindings, no driver: try nvidia-smi
        pass
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i",
                              visible or "0"], capture_output=True, text=True, timeout=30, check=True).stdout
        return int(float(out.strip().splitlines()[0]) * 2**20)  # MiB
    except Exception:  # noqa: BLE001
        return None
