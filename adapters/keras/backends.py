"""What differs between Keras's three backends underneath the one Keras API: the backend's own module, versions,
device query, device selection (before Keras is imported), threads, TF32, GPU memory cap, synchronisation, allocator
peaks and out-of-memory errors. One ``Backend`` subclass per KERAS_BACKEND value (``BACKENDS``); the framework is
imported when a method first needs it, never when this module is imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Callable
from typing import Any, ClassVar

from adapters.base import DeviceUnavailable, RunOptions, device_index


class Backend:
    """One backend for the adapter ``adapter`` ("keras-jax", ...), whose trial runs with ``options``. ``place`` sets
    ``device`` (the backend's own name for it, recorded), ``gpu``, ``memory_limit_bytes`` (the cap applied on a GPU,
    None without one) and ``applied`` (what else it set, for the record)."""

    #: KERAS_BACKEND's value, the module it imports, and the framework's name in messages
    name: ClassVar[str]
    module_name: ClassVar[str]
    title: ClassVar[str]

    def __init__(self, adapter: str, options: RunOptions) -> None:
        self.adapter, self.options = adapter, options
        self.device, self.gpu = "cpu", False
        self.memory_limit_bytes: int | None = None
        self.applied: dict[str, Any] = {}

    def module(self) -> Any:
        """The backend's module (importing it). Raises ImportError naming the fix when it is not installed."""
        try:
            return importlib.import_module(self.module_name)
        except ImportError as err:
            raise ImportError(f"Keras's {self.name} backend is not installed here ({err}); make the environment "
                              f"with `harness envs create {self.adapter}`") from err

    def versions(self) -> dict[str, str]:
        """The backend's version, with CUDA and cuDNN where it reports them."""
        raise NotImplementedError

    def gpu_count(self) -> int:
        """The GPUs the backend sees, by its own device query, which creates no context."""
        raise NotImplementedError

    def device_problem(self, device: str) -> str | None:
        """Why the backend cannot train on ``device`` ("cpu", "cuda:N"), or None."""
        if not device.startswith("cuda"):
            return None
        count, what = self.gpu_count(), f"{self.title} {self.module().__version__}"
        if not count:
            return f"{what} (Keras's backend) sees no CUDA device (a CPU-only build, or no driver)"
        index = device_index(device)
        return None if index < count else f"{what} sees {count} GPU(s); {device} is not one"

    def place(self, device: str, threads: int | None) -> None:
        """Before Keras is imported: the device, the CPU threads (intra-op ``threads``, inter-op 1; None keeps the
        backend's defaults), TF32 off in fp32 (on in bf16 and fp16, as each backend's default) and the options' GPU
        memory cap. Raises DeviceUnavailable for a GPU the backend cannot see."""
        if (problem := self.device_problem(device)) is not None:
            raise DeviceUnavailable(problem)
        self.gpu = device.startswith("cuda")
        self._place(device_index(device), threads, self.options.precision == "fp32")

    def _place(self, index: int, threads: int | None, fp32: bool) -> None:
        raise NotImplementedError

    def threads(self) -> tuple[int | None, int | None]:
        """The intra-op and inter-op thread counts the backend uses, None where it does not tell."""
        return None, None

    def sync(self, variables: list[Any]) -> None:
        """Waits until the device's queued work is done (``variables``: the model's, on JAX); nothing on the CPU."""

    def gradient(self, fn: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[list[Any], Any]]:
        """``fn(values, *args) -> (loss, aux)`` (a scalar loss of the list of tensors ``values``) as a function of the
        same arguments that returns (the gradients of the loss with respect to ``values``, a list of dense tensors,
        zero where the loss does not depend on one; ``aux``, cut from the gradient's graph), by the backend's own
        gradient mechanism (the one Keras's own train step on that backend uses)."""
        raise NotImplementedError

    def compiled(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as the trial's mode runs a function of tensors: ``fn`` itself (eager) but in JAX's compiled mode
        (``JAX.compiled``)."""
        return fn

    def reset_peaks(self) -> None:
        """Restarts the GPU allocator's peak counter where the backend can."""

    def peaks(self) -> dict[str, int]:
        """The GPU allocator's peaks in bytes (``Adapter.memory_stats``); nothing on the CPU."""
        return {}

    def is_oom(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the backend's out-of-memory error, as its native adapter classifies it."""
        raise NotImplementedError


class Torch(Backend):
    name, module_name, title = "torch", "torch", "PyTorch"

    def versions(self) -> dict[str, str]:
        fw = self.module()
        out = {"torch": fw.__version__.split("+")[0]}
        if fw.version.cuda:
            out["cuda"] = str(fw.version.cuda)
        if fw.backends.cudnn.is_available():
            out["cudnn"] = str(fw.backends.cudnn.version())
        return out

    def gpu_count(self) -> int:
        return int(self.module().cuda.device_count())

    def _place(self, index: int, threads: int | None, fp32: bool) -> None:
        """KERAS_TORCH_DEVICE (read by Keras's torch backend when it is imported); ``torch.set_num_threads``, one
        inter-op thread; the matmul and cuDNN TF32 flags; a cap as ``set_per_process_memory_fraction(limit / total
        memory)`` (the caching allocator raises ``torch.OutOfMemoryError`` past it)."""
        fw = self.module()
        self.device = os.environ["KERAS_TORCH_DEVICE"] = f"cuda:{index}" if self.gpu else "cpu"
        if threads is not None:
            fw.set_num_threads(threads)
            try:
                fw.set_num_interop_threads(1)
            except RuntimeError:  # already set in this process (tests): it can be set once
                pass
        fw.backends.cuda.matmul.allow_tf32 = fw.backends.cudnn.allow_tf32 = not fp32
        limit = self.options.memory_limit_bytes
        if self.gpu and limit:
            fraction = min(limit / fw.cuda.get_device_properties(index).total_memory, 1.0)
            fw.cuda.set_per_process_memory_fraction(fraction, index)
            self.memory_limit_bytes, self.applied["memory_fraction"] = int(limit), fraction

    def threads(self) -> tuple[int | None, int | None]:
        fw = self.module()
        return int(fw.get_num_threads()), int(fw.get_num_interop_threads())

    def sync(self, variables: list[Any]) -> None:
        if self.gpu:
            self.module().cuda.synchronize()

    def gradient(self, fn: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[list[Any], Any]]:
        """``torch.autograd.grad`` of the loss with respect to ``values`` made leaves that require gradients (detached
        copies sharing their storage: the variables' own ``.grad`` is never touched), an unused one's gradient zero
        (``materialize_grads``); ``aux``'s tensors detached."""
        torch = self.module()

        def gradient(values: list[Any], *args: Any) -> tuple[list[Any], Any]:
            leaves = [v.detach().requires_grad_(True) for v in values]
            with torch.enable_grad():
                loss, aux = fn(leaves, *args)
            grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
            detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in aux]
            return list(grads), detached

        return gradient

    def reset_peaks(self) -> None:
        if self.gpu:
            self.module().cuda.reset_peak_memory_stats()

    def peaks(self) -> dict[str, int]:
        """torch.cuda.max_memory_allocated and max_memory_reserved."""
        if not self.gpu:
            return {}
        fw = self.module()
        return {"allocator_peak_bytes": int(fw.cuda.max_memory_allocated()),
                "allocator_reserved_peak_bytes": int(fw.cuda.max_memory_reserved())}

    def is_oom(self, exc: BaseException) -> bool:
        """torch.OutOfMemoryError (the CUDA caching allocator) or the CPU allocator's RuntimeError
        "DefaultCPUAllocator: can't allocate memory" (no type of its own)."""
        return isinstance(exc, self.module().OutOfMemoryError) or (
            isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc))


class JAX(Backend):
    name, module_name, title = "jax", "jax", "JAX"

    def versions(self) -> dict[str, str]:
        return {"jax": self.module().__version__, "jaxlib": importlib.metadata.version("jaxlib")}

    def gpu_count(self) -> int:
        try:
            return len(self.module().devices("gpu"))
        except RuntimeError:  # no GPU backend installed, or none initialises
            return 0

    def _place(self, index: int, threads: int | None, fp32: bool) -> None:
        """``jax_default_device`` (the GPU, or the first CPU device) and ``jax_default_matmul_precision`` ("highest"
        in fp32, no TF32). No memory cap on a GPU: XLA's memory fraction (XLA_PYTHON_CLIENT_MEM_FRACTION) must be set
        before JAX's GPU backend starts, and the device query above has started it; the declaration's limit says so,
        and the plan refuses such a trial (the native JAX adapter takes one)."""
        fw = self.module()
        target = fw.devices("gpu")[index] if self.gpu else fw.devices("cpu")[0]
        fw.config.update("jax_default_device", target)
        fw.config.update("jax_default_matmul_precision", "highest" if fp32 else "default")
        self.device = str(target)

    def sync(self, variables: list[Any]) -> None:
        """``jax.block_until_ready`` on the variables' values: the last step's updates are the last work queued."""
        if self.gpu:
            self.module().block_until_ready([v.value for v in variables])

    def gradient(self, fn: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[list[Any], Any]]:
        """``jax.grad(fn, has_aux=True)``."""
        return self.module().grad(fn, has_aux=True)  # type: ignore[no-any-return]

    def compiled(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``jax.jit(fn)`` (one compilation per input shape) in the compiled mode (Keras's jit_compile=True on JAX);
        ``fn`` itself in the eager one, its ops dispatched one by one."""
        return self.module().jit(fn) if self.options.compile == "compiled" else fn

    def peaks(self) -> dict[str, int]:
        """The device's ``memory_stats()["peak_bytes_in_use"]``, since the process started (JAX cannot restart
        it)."""
        if not self.gpu:
            return {}
        stats = self.module().config.jax_default_device.memory_stats() or {}
        return {"allocator_peak_bytes": int(stats["peak_bytes_in_use"])} if "peak_bytes_in_use" in stats else {}

    def is_oom(self, exc: BaseException) -> bool:
        """JAX's runtime error with the RESOURCE_EXHAUSTED status."""
        kind = getattr(self.module().errors, "JaxRuntimeError", None)
        return isinstance(kind, type) and isinstance(exc, kind) and "RESOURCE_EXHAUSTED" in str(exc)


class TensorFlow(Backend):
    name, module_name, title = "tensorflow", "tensorflow", "TensorFlow"

    def versions(self) -> dict[str, str]:
        fw = self.module()
        out = {"tensorflow": fw.__version__}
        build = fw.sysconfig.get_build_info()
        for key in ("cuda", "cudnn"):
            if build.get(f"{key}_version"):
                out[key] = str(build[f"{key}_version"])
        return out

    def gpu_count(self) -> int:
        return len(self.module().config.list_physical_devices("GPU"))

    def _place(self, index: int, threads: int | None, fp32: bool) -> None:
        """Only that GPU visible (or none: the CPU), with a cap as its logical device's ``memory_limit`` (MiB) or
        else memory growth when the allocator options ask for it, and ``enable_tensor_float_32_execution``; the
        intra-op threads and one inter-op thread through ``tf.config.threading``."""
        fw = self.module()
        gpus = fw.config.list_physical_devices("GPU")
        if self.gpu:
            fw.config.set_visible_devices([gpus[index]], "GPU")
            if self.options.memory_limit_bytes:
                mib = max(int(self.options.memory_limit_bytes) // 2**20, 1)
                fw.config.set_logical_device_configuration(
                    gpus[index], [fw.config.LogicalDeviceConfiguration(memory_limit=mib)])
                self.memory_limit_bytes = mib * 2**20
            elif self.options.allocator.tensorflow_memory_growth:
                fw.config.experimental.set_memory_growth(gpus[index], True)
                self.applied["memory_growth"] = True
            fw.config.experimental.enable_tensor_float_32_execution(not fp32)
        else:
            fw.config.set_visible_devices([], "GPU")
        if threads is not None:
            fw.config.threading.set_intra_op_parallelism_threads(threads)
            fw.config.threading.set_inter_op_parallelism_threads(1)
        self.device = "/GPU:0" if self.gpu else "/CPU:0"

    def threads(self) -> tuple[int | None, int | None]:
        """What ``tf.config.threading`` was set to; None where it was left to TensorFlow (0)."""
        threading = self.module().config.threading
        return (threading.get_intra_op_parallelism_threads() or None,
                threading.get_inter_op_parallelism_threads() or None)

    def sync(self, variables: list[Any]) -> None:
        if self.gpu:
            self.module().test.experimental.sync_devices()

    def gradient(self, fn: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[list[Any], Any]]:
        """A ``tf.GradientTape`` watching ``values`` (read as tensors), eager; an unused value's gradient zero
        (``UnconnectedGradients.ZERO``), an embedding's ``tf.IndexedSlices`` made dense (its rows summed, as
        ``adapters.keras.optimizers`` does)."""
        tf = self.module()

        def gradient(values: list[Any], *args: Any) -> tuple[list[Any], Any]:
            tensors = [tf.convert_to_tensor(v) for v in values]
            with tf.GradientTape() as tape:
                tape.watch(tensors)
                loss, aux = fn(tensors, *args)
            grads = tape.gradient(loss, tensors, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return [tf.convert_to_tensor(g) for g in grads], aux

        return gradient

    def reset_peaks(self) -> None:
        if self.gpu:
            self.module().config.experimental.reset_memory_stats("GPU:0")

    def peaks(self) -> dict[str, int]:
        """tf.config.experimental.get_memory_info("GPU:0")["peak"]."""
        if not self.gpu:
            return {}
        return {"allocator_peak_bytes": int(self.module().config.experimental.get_memory_info("GPU:0")["peak"])}

    def is_oom(self, exc: BaseException) -> bool:
        """tf.errors.ResourceExhaustedError, or InternalError "Dst tensor is not initialized." (a host-to-GPU copy
        without room)."""
        errors = self.module().errors
        return isinstance(exc, errors.ResourceExhaustedError) or (
            isinstance(exc, errors.InternalError) and "Dst tensor is not initialized" in str(exc))


#: The backends by KERAS_BACKEND's value (``Family.backend``).
BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (JAX, Torch, TensorFlow)}
