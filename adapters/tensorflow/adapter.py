"""TensorFlow adapter: ``TensorFlowAdapter`` implements ``adapters.base.Adapter`` from the parts of this package: the
devices (``adapters.tensorflow.devices``: the device or the MirroredStrategy's replicas, GPU memory, TF32, threads),
the neutral builder (``adapters.tensorflow.neutral``: raw ``tf.Variable``s and ``tf.nn`` ops, Keras's own layers for
layernorm and attention, NHWC for images, (B, L, D) for sequences), the training mechanics
(``adapters.tensorflow.training``: ``tf.function`` steps, XLA in the "compiled" mode only, accumulation, fp16's loss
scaling, data parallelism) and the input (``adapters.tensorflow.inputs``: resident, or a ``tf.data`` pipeline with
``input: loader``). Here: the wiring, the state and the telemetry.

Design: docs/design/framework-caveats.md#tensorflow (Keras's two layers, tracing, XLA, mixed precision, the optimizer).
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before the import: silences TF's C++ INFO and WARNING logs

import numpy as np
import tensorflow as tf

from adapters.base import Model, RunOptions, Settings, Weights
from adapters.parts import Facade
from adapters.tensorflow import DECLARATION
from adapters.tensorflow.devices import Devices, default_threads, device_problem
from adapters.tensorflow.inputs import Inputs
from adapters.tensorflow.layers import COMPUTE
from adapters.tensorflow.neutral import Builder, Network
from adapters.tensorflow.training import Training
from harness.neutral.datasets import Data
from harness.neutral.info import ModelInfo
from harness.spec import OptimizerSpec


class TensorFlowAdapter(Facade[Training, Inputs], declaration=DECLARATION):
    def __init__(self, options: RunOptions | None = None) -> None:
        super().__init__(options)
        self.devices = Devices(self.options)
        self._neutral: Network | None = None  # the neutral builder's model, for the canonical state

    # -- setup ---------------------------------------------------------------------------------------------------

    def versions(self) -> dict[str, str]:
        out = {"tensorflow": tf.__version__}
        try:
            import keras

            out["keras"] = keras.__version__
        except ImportError:  # pragma: no cover - TF 2.16+ depends on Keras 3
            pass
        build = tf.sysconfig.get_build_info()
        if build.get("cuda_version"):
            out["cuda"] = str(build["cuda_version"])
        if build.get("cudnn_version"):
            out["cudnn"] = str(build["cudnn_version"])
        return out

    def device_problem(self, device: str) -> str | None:
        return device_problem(device)

    def prepare(self, device: str, threads: int | None, seed: int) -> None:
        """``Devices.prepare``: must run before any TF op in the process (TF fixes visible devices, memory growth and
        thread pools when its context starts). Raises DeviceUnavailable when TF sees no such GPU."""
        self.devices.prepare(device, threads, seed)

    def neutral_model(self, info: ModelInfo, weights: Weights) -> Model:
        """``adapters.tensorflow.neutral.Builder``'s ``Network`` in the options' compute dtype (float32 variables;
        bf16 and fp16 cast at each layer), its variables created on the device or, data-parallel, under the
        strategy's scope (a ``MirroredVariable`` with a copy on each replica's device; batchnorm's running statistics
        sync-on-read), with sync batchnorm when the data-parallel trial asks for it. Its canonical names are kept for
        ``get_weights``."""
        data_parallel = self.options.data_parallel
        builder = Builder(COMPUTE[self.options.precision], replicated=self.devices.strategy is not None,
                          sync_batchnorm=data_parallel is not None and data_parallel.sync_batchnorm)
        with self.devices.placement():
            self._neutral = builder.build(info, weights)
        return self._neutral

    def make_parts(self, model: Model, task: str, optimizer: OptimizerSpec) -> tuple[Training, Inputs]:
        """``model`` (called as ``model(x, training=...)``, with ``trainable_variables`` created under
        ``Devices.placement``) trained through ``adapters.tensorflow.training.Training``, with the optimizer's state
        over all of its trainable variables; its input ``adapters.tensorflow.inputs.Inputs``."""
        if not callable(model) or not hasattr(model, "trainable_variables"):
            raise TypeError(f"the tensorflow adapter trains a model called as model(x, training=...) with "
                            f"trainable_variables (a neutral Network, a Keras model), not {type(model).__name__}")
        return (Training(model, task, optimizer, self.options, self.devices),
                Inputs(self.options, self.devices, task != "image_classification"))

    def load(self, data: Data) -> None:
        """``Inputs.load``; in resident mode the training set is then the one the steps gather from
        (``Training.resident``)."""
        self.inputs.load(data)
        if self.options.input == "resident":
            self.training.resident(self.inputs.x_train, self.inputs.y_train)

    # -- steps ---------------------------------------------------------------------------------------------------

    def wait(self) -> None:
        """Blocks until queued work is done: ``sync_devices`` on a GPU
        (https://www.tensorflow.org/api_docs/python/tf/test/experimental/sync_devices), then the last step's loss
        copied to the host (``.numpy()``, the window's end edge as before sums; nothing is restarted). On the CPU,
        eager TF is synchronous."""
        if self.devices.gpu:
            tf.test.experimental.sync_devices()
        if self._training is not None and self._training.last_loss is not None:
            self._training.last_loss.numpy()

    # -- state ---------------------------------------------------------------------------------------------------

    def get_weights(self) -> Weights:
        """Copies of the current parameters under their canonical names, in the canonical layout: the exact inverse
        of the neutral builder's conversion (HWIO -> OIHW, (in, out) -> (out, in), the HWC order undone, Keras's
        attention kernels joined into the fused in-projection); another model's, under its variables' names.
        Data-parallel: the first device's copies."""
        with self.devices.first():
            if self._neutral is not None:
                return self._neutral.state(trained=True)
            return {v.name: np.array(v.numpy(), dtype=np.float32) for v in self.training.variables}

    def get_buffers(self) -> Weights:
        """Copies of batchnorm's running statistics under their canonical names ("<name>.running_mean",
        "<name>.running_var"), in the canonical feature order. Data-parallel: the mean of the replicas' copies
        (sync-on-read variables)."""
        with self.devices.first():
            return self._neutral.state(trained=False) if self._neutral is not None else {}

    # -- telemetry -----------------------------------------------------------------------------------------------

    def reset_memory_stats(self) -> None:
        """Restarts the GPU allocator's peak (https://www.tensorflow.org/api_docs/python/tf/config/experimental/
        reset_memory_stats), of every GPU of a data-parallel trial. Nothing on the CPU, which has no allocator
        statistics."""
        for gpu in self.devices.gpu_names():
            tf.config.experimental.reset_memory_stats(gpu)

    def memory_stats(self) -> dict[str, int]:
        """On a GPU, ``allocator_peak_bytes``: the BFC allocator's peak bytes in use by tensors since the last
        ``reset_memory_stats`` (``get_memory_info(...)["peak"]``,
        https://www.tensorflow.org/api_docs/python/tf/config/experimental/get_memory_info). TF does not expose the
        bytes the allocator reserved from the device, so ``allocator_reserved_peak_bytes`` is absent. ``{}`` on the
        CPU, where TF keeps no such statistics: ``get_memory_info("CPU:0")`` raises ValueError "Allocator stats not
        available". Data-parallel: the largest of the GPUs' peaks (each holds a replica)."""
        if not self.devices.gpu:
            return {}
        return {"allocator_peak_bytes": max(int(tf.config.experimental.get_memory_info(gpu)["peak"])
                                            for gpu in self.devices.gpu_names())}

    def cpu_allocator_peak(self) -> int | None:
        """The CPU BFC allocator's peak bytes since it was created (``get_memory_info("CPU:0")["peak"]``), which TF
        keeps only when the worker's memory limit put CPU tensors in a BFC allocator
        (``Memory.cpu_allocator_cap``); None otherwise, or when TF is already shutting down."""
        try:
            return int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
        except Exception:  # noqa: BLE001 - no BFC allocator on the CPU, or TF already shutting down
            return None

    def settings(self) -> Settings:
        """The common part, and TF's own: the data format, the compute dtype ("compute_dtype"), XLA
        ("jit_compile"), the optimizer's implementation, oneDNN, and in fp16 the loss scale now ("loss_scale"); on a
        GPU also the allocator settings (``Devices.configure_gpu_memory``) and whether TF32 is on. Data-parallel: the
        strategy, its replicas' devices, cross-device ops and sync batchnorm (``Devices.data_parallel_settings``).
        Threads: TF's 0 is "all schedulable CPUs", recorded as that count."""
        extras: dict[str, Any] = {
            "data_format": "NHWC", "compute_dtype": COMPUTE[self.options.precision].name,
            "jit_compile": self.mode == "compiled",
            "optimizer_impl": "PyTorch semantics on ResourceApplyMomentum/Adam",
            "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "")}
        loss_scale = self._training.loss_scale if self._training is not None else None
        if loss_scale is not None:
            extras["loss_scale"] = float(loss_scale.scale.numpy())
        memory_limit = None
        if self.devices.gpu:
            memory_limit = self.devices.memory_settings.get("memory_limit_bytes")
            extras.update({k: v for k, v in self.devices.memory_settings.items() if k != "memory_limit_bytes"})
            extras["TF_GPU_ALLOCATOR"] = os.environ.get("TF_GPU_ALLOCATOR", "")
            extras["allow_tf32"] = tf.config.experimental.tensor_float_32_execution_enabled()
        return Settings(precision=self.options.precision, compile=self.mode,
                        intra_op_threads=tf.config.threading.get_intra_op_parallelism_threads() or default_threads(),
                        inter_op_threads=tf.config.threading.get_inter_op_parallelism_threads() or default_threads(),
                        memory_limit_bytes=memory_limit,
                        loader=self.loader_settings(),
                        data_parallel=self.devices.data_parallel_settings(), **extras)

    def is_oom(self, exc: BaseException) -> bool:
        # tf.errors.ResourceExhaustedError is what TF raises when an allocator refuses a tensor, on the CPU and the GPU
        # (https://www.tensorflow.org/api_docs/python/tf/errors/ResourceExhaustedError). A host-to-GPU copy that finds
        # no room raises InternalError "Dst tensor is not initialized." instead (tensorflow/tensorflow#7025), which has
        # no type of its own, so that one is recognised by its message.
        if isinstance(exc, tf.errors.ResourceExhaustedError):
            return True
        return isinstance(exc, tf.errors.InternalError) and "Dst tensor is not initialized" in str(exc)
