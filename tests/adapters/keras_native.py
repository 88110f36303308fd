"""A Keras model of your own trained through one Keras adapter, as the worker trains it, run in that adapter's
environment (one backend per process): ``python -m tests.adapters.keras_native NAME WEIGHTS OUT.npz``, or ``run``
in the interpreter of a Keras suite (tests/adapters/keras_checks.py does so in envs/keras-jax, envs/keras-torch and
envs/keras-tensorflow, for tests/adapters/test_keras_native.py).

``run`` adopts specs/models.py:keras_cnn (conv, max pool, conv, batchnorm, dense; no dropout, whose masks are each
backend's own) for the digits through ``Adapter.native_model`` from the shared initial weights at WEIGHTS (drawn now
by ``adapters.keras.weights`` unless the file exists: ``harness.neutral.native.draw_shared_weights``), builds it with
``scenarios.OPTIMIZERS`` (SGD with momentum and weight decay, Adam with weight decay and epsilon 1e-4) and trains 10
steps of batch 32 on the harness's batches (``kit.batches``). Returns flat arrays keyed like ``scenarios.run``:
``"native-<optimizer>|<step>|<layer index>.<layer class>.<variable>"`` (``positional_names``) for the trainable
variables and batchnorm's moving statistics before the first step and after steps 1 and 10,
``"native-<optimizer>|losses|"`` and the test loss and accuracy after the 10 steps, ``"native-<optimizer>|evaluate|"``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from harness.neutral import datasets, native
from harness.spec import ROOT, DigitsData, NativeModel, OptimizerSpec
from tests.adapters import kit, scenarios

FACTORY = f"{ROOT / 'specs' / 'models.py'}:keras_cnn"
STEPS = 10


def adopt(adapter_cls, optimizer: OptimizerSpec, weights: Path | None, seed: int = 0, factory: str = FACTORY,
          **kwargs):
    """``adapter_cls`` prepared on the CPU (2 threads, ``seed``), the model of ``factory(**kwargs)`` adopted for the
    digits (from the weights file ``weights``, or the backend's own initialisation when None), built with
    ``optimizer`` and the digits loaded, as the worker does it. Returns (adapter, data)."""
    data = datasets.load(DigitsData(name="digits"))
    feed, classes = datasets.describe_input(DigitsData(name="digits"))
    adapter = adapter_cls()
    adapter.prepare("cpu", 2, seed)
    made = native.make(NativeModel(factory=factory, kwargs=kwargs))
    model = adapter.native_model(made, native.NativeSource(factory, feed, classes, seed, weights))
    adapter.build(model, native.task(feed), optimizer)
    adapter.load(data)
    return adapter, data


def shared_weights(path: Path, seed: int = 0) -> Path:
    """The keras_cnn's initial weights for the digits and ``seed`` at ``path``, drawn by ``adapters.keras.weights``
    in this interpreter unless the file exists."""
    feed, classes = datasets.describe_input(DigitsData(name="digits"))
    return native.draw_shared_weights("adapters.keras.weights", NativeModel(factory=FACTORY), feed, classes, seed,
                                      path)


def positional_names(model) -> dict[str, str]:
    """Each variable's Keras path (``get_weights``' names, e.g. ``conv2d_1/bias``, numbered by how many layers of the
    class the process made before) -> ``"<layer index>.<layer class>.<variable name>"`` (``3.Conv2D.bias``): the same
    for every model the factory makes."""
    return {v.path: f"{i}.{type(layer).__name__}.{v.name}" for i, layer in enumerate(model.layers)
            for v in layer.weights}


def run(adapter_cls, weights: Path) -> dict[str, np.ndarray]:
    """Both optimizers' 10 steps from the shared weights at ``weights`` (see the module docstring)."""
    out: dict[str, np.ndarray] = {}
    path = shared_weights(weights)
    for name, optimizer in scenarios.OPTIMIZERS.items():
        adapter, data = adopt(adapter_cls, optimizer, path)
        losses, kept = kit.train_on(adapter, kit.batches(len(data.y_train), scenarios.BATCH, STEPS),
                                    keep=(0, 1, STEPS))
        out[f"native-{name}|losses|"] = np.asarray(losses, np.float64)
        names = positional_names(adapter.training.model)
        for step, state in kept.items():
            out.update({f"native-{name}|{step}|{names[path]}": value for path, value in state.items()})
        out[f"native-{name}|evaluate|"] = np.asarray(adapter.evaluate(256), np.float64)
    return out


if __name__ == "__main__":
    import adapters

    np.savez(sys.argv[3], **run(adapters.get(sys.argv[1]), Path(sys.argv[2])))
