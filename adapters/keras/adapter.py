"""Keras 3 adapter: ``KerasAdapter`` implements ``adapters.base.Adapter`` on the backend its declaration names
(``KerasJAXAdapter``, ``KerasPyTorchAdapter``, ``KerasTensorFlowAdapter``) from the parts of this package: the neutral
builder (``adapters.keras.neutral``: the canonical layers as a functional ``keras.Model``), the training mechanics
(``adapters.keras.training``: any ``keras.Model``, ``Model.train_on_batch`` with ``jit_compile`` False or True, the
mixed precision policies, gradient accumulation), the resident input (``adapters.keras.inputs``) and what differs per
backend (``adapters.keras.backends``: device, threads, TF32, memory cap, synchronisation, allocator peaks, OOM). Here:
Keras imported on its backend, the seed and the dtype policy, the two model sources (the neutral builder's model, or a
``keras.Model`` of your own loaded with the initial weights shared by every backend, ``adapters.keras.weights``), and
the telemetry.

This module imports no framework: Keras is imported by ``prepare``, after KERAS_BACKEND is set, and the modules that
import it (every other one of this package) only then.

Design: docs/design/framework-caveats.md#keras-3 (what train_on_batch costs, the layers and optimizers of our own).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from typing import TYPE_CHECKING, Any

from adapters import keras as declarations
from adapters.base import Model, RunOptions, Settings, Weights
from adapters.keras.backends import BACKENDS
from adapters.parts import Facade
from harness.neutral.native import NativeModelError

if TYPE_CHECKING:
    from adapters.keras.inputs import Inputs
    from adapters.keras.neutral import NeutralModel
    from adapters.keras.training import Training
    from harness.neutral.info import ModelInfo
    from harness.neutral.native import NativeSource
    from harness.spec import OptimizerSpec


def import_keras(backend: str) -> Any:
    """Keras on ``backend``: sets KERAS_BACKEND, then imports Keras (https://keras.io/getting_started/#configuring-
    your-backend: the backend is read once, when Keras is first imported). Raises RuntimeError when Keras was already
    imported in this process with another backend, ImportError when Keras is older than 3 (no multi-backend)."""
    if "keras" in sys.modules:
        keras = sys.modules["keras"]
        current = keras.backend.backend() if hasattr(keras, "backend") else "unknown"
        if current != backend:
            raise RuntimeError(f"Keras was imported on the {current} backend before the Keras adapter could set "
                               f"KERAS_BACKEND={backend}; a worker process holds one backend")
        return keras
    os.environ["KERAS_BACKEND"] = backend
    keras = importlib.import_module("keras")
    if int(keras.__version__.split(".")[0]) < 3:
        raise ImportError(f"Keras {keras.__version__} has no backends; the Keras adapter needs Keras 3")
    return keras


class KerasAdapter(Facade["Training", "Inputs"]):
    """One backend's Keras. A subclass names its declaration, whose ``backend`` it runs on."""

    def __init__(self, options: RunOptions | None = None) -> None:
        super().__init__(options)
        # before anything imports Keras: TensorFlow imports it on its own (tf.keras), on KERAS_BACKEND's backend
        os.environ["KERAS_BACKEND"] = self.declaration.family.backend
        self.backend = BACKENDS[self.declaration.family.backend](self.name, self.options)
        self._keras: Any = None
        self._seed = 0
        self._neutral: NeutralModel | None = None  # the neutral builder's model, for the canonical state

    def prepared(self) -> Any:
        """The Keras module ``prepare`` imported. Raises RuntimeError before ``prepare``: the dtype policy must be set
        before a model is built."""
        if self._keras is None:
            raise RuntimeError(f"the {self.name} adapter was asked for a model before prepare imported Keras")
        return self._keras

    # -- setup ---------------------------------------------------------------------------------------------------

    def versions(self) -> dict[str, str]:
        """Keras's version (from its distribution's metadata, without importing it) and the backend's, with CUDA and
        cuDNN where the backend reports them. Raises ImportError naming the fix when Keras is missing or older than
        3 (the environment probe reports it before a run starts)."""
        fix = f"make the environment with `harness envs create {self.name}` (or pip install 'keras>=3' there)"
        try:
            version = importlib.metadata.version("keras")
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(f"no Keras here; {fix}") from None
        if int(version.split(".")[0]) < 3:
            raise ImportError(f"Keras {version} is older than Keras 3 (no backends); {fix}")
        return {"keras": version, **self.backend.versions()}

    def device_problem(self, device: str) -> str | None:
        """The backend's own device query (torch.cuda.device_count, jax.devices("gpu"),
        tf.config.list_physical_devices("GPU")), which creates no context."""
        return self.backend.device_problem(device)

    def prepare(self, device: str, threads: int | None, seed: int) -> None:
        """Before Keras is imported, the backend's device, threads, TF32 (off in fp32) and GPU memory cap
        (``adapters.keras.backends``); then Keras (``import_keras``), its seed (``keras.utils.set_random_seed``:
        Python, numpy and the backend) and the dtype policy of ``options.precision`` (``adapters.keras.POLICIES``),
        under which every model built afterwards computes. Raises DeviceUnavailable for a GPU the backend cannot
        see (and on JAX for a GPU memory cap)."""
        self.backend.place(device, threads)
        keras = self._keras = import_keras(self.declaration.family.backend)
        keras.utils.set_random_seed(seed)
        keras.config.set_dtype_policy(declarations.POLICIES[self.options.precision])
        self._seed = seed

    def neutral_model(self, info: ModelInfo, weights: Weights) -> Model:
        """``adapters.keras.neutral.Builder``'s functional ``keras.Model``; its canonical names are kept for
        ``get_weights``."""
        self.prepared()
        from adapters.keras.neutral import Builder

        self._neutral = Builder(self.name, self._seed).build(info, weights)
        return self._neutral.model

    def native_model(self, model: object, source: NativeSource) -> Model:
        """A ``keras.Model`` of your own (any Keras model: functional, ``Sequential``, subclassed,
        ``keras.applications``), whose output is taken as the logits. The factory was called after ``prepare`` set
        the seed and the dtype policy, so a model built by it computes in the trial's precision (a layer given its own
        ``dtype`` keeps it). Built for ``source.input`` when it is built lazily (``adapters.keras.weights.build_for``);
        with ``source.initial_weights`` (the family's file, drawn once per seed on Keras's numpy backend by
        ``adapters.keras.weights``) its variables are loaded from it (``Model.load_weights``), so that every backend
        starts from the same numbers. Raises NativeModelError (field ``model``) for an object that is not a
        ``keras.Model``, or a weights file that does not fit it."""
        keras = self.prepared()
        if not isinstance(model, keras.Model):
            raise NativeModelError("model", f"{source.factory} returned a {type(model).__module__}."
                                            f"{type(model).__qualname__}, not a keras.Model")
        from adapters.keras.weights import build_for, load

        build_for(model, source.input)
        if source.initial_weights is not None:
            try:
                load(model, source.initial_weights)
            except ValueError as err:
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                raise NativeModelError("model", f"{source.factory}: the shared initial weights "
                                                f"{source.initial_weights} do not fit the model: {first}") from None
        self._neutral = None
        return model

    def make_parts(self, model: Model, task: str, optimizer: OptimizerSpec) -> tuple[Training, Inputs]:
        """``model`` (any ``keras.Model`` whose outputs are logits: (B, classes), or (B, L, vocab) for a next-token
        model, whose loss Keras's sparse cross-entropy takes over every position alike) trained through
        ``adapters.keras.training.Training``, compiled at its first step; its input ``adapters.keras.inputs.Inputs``."""
        if not isinstance(model, self.prepared().Model):
            raise TypeError(f"the {self.name} adapter trains a keras.Model, not {type(model).__name__}")
        from adapters.keras.inputs import Inputs
        from adapters.keras.training import Training

        if self._neutral is not None and self._neutral.model is not model:
            self._neutral = None  # another source's model: its own variables are its state
        return Training(model, optimizer, self.options, self.backend), Inputs()

    # -- steps ---------------------------------------------------------------------------------------------------

    def wait(self) -> None:
        """The device idle: ``train_on_batch`` already returned its loss on the host; on a GPU the backend's own
        synchronisation as well (torch.cuda.synchronize, jax.block_until_ready on the parameters,
        TensorFlow's sync_devices)."""
        if self._training is not None:
            self.backend.sync(list(self._training.model.trainable_variables))

    # -- state ---------------------------------------------------------------------------------------------------

    def get_weights(self) -> Weights:
        return self._neutral.state(trained=True) if self._neutral is not None else self.training.state(trained=True)

    def get_buffers(self) -> Weights:
        return self._neutral.state(trained=False) if self._neutral is not None else self.training.state(trained=False)

    # -- telemetry -----------------------------------------------------------------------------------------------

    def settings(self) -> Settings:
        """The typed part (the GPU memory cap as applied: TensorFlow's in whole MiB), then Keras's backend, the
        backend's device, the dtype policy, whether TF32 may run, the step API, what the backend applied
        (``memory_fraction``, ``memory_growth``) and what ``Model.compile`` chose (``Training.settings``)."""
        intra, inter = self.backend.threads() if self._keras is not None else (None, None)
        extras: dict[str, Any] = {
            "keras_backend": (self._keras.backend.backend() if self._keras is not None
                              else self.declaration.family.backend),
            "device": self.backend.device, "dtype_policy": declarations.POLICIES[self.options.precision],
            "tf32": self.options.precision != "fp32" and self.backend.gpu, "train_api": "keras.Model.train_on_batch",
            **self.backend.applied, **(self._training.settings() if self._training is not None else {})}
        return Settings(precision=self.options.precision, compile=self.mode, intra_op_threads=intra,
                        inter_op_threads=inter, memory_limit_bytes=self.backend.memory_limit_bytes, **extras)

    def reset_memory_stats(self) -> None:
        self.backend.reset_peaks()

    def memory_stats(self) -> dict[str, int]:
        """On a GPU, the backend allocator's peak: torch.cuda.max_memory_allocated and max_memory_reserved,
        tf.config.experimental.get_memory_info("GPU:0")["peak"], JAX's device.memory_stats()["peak_bytes_in_use"]
        (since the process started: JAX cannot restart it). Nothing on the CPU."""
        return self.backend.peaks()

    def is_oom(self, exc: BaseException) -> bool:
        """The backend's out-of-memory error, as its native adapter classifies it (``Backend.is_oom``)."""
        return self.backend.is_oom(exc)


class KerasJAXAdapter(KerasAdapter, declaration=declarations.JAX):
    pass


class KerasPyTorchAdapter(KerasAdapter, declaration=declarations.TORCH):
    pass


class KerasTensorFlowAdapter(KerasAdapter, declaration=declarations.TENSORFLOW):
    pass
