"""The loader-mode check every adapter meets (``input: loader``): the same steps fed through the framework's own data
loader end where resident mode ends. Run in the adapter's own interpreter: by tests/adapters/test_loader.py for the
frameworks of the development environment, by tests/adapters/jax_suite.py for JAX."""

from __future__ import annotations

import numpy as np

from adapters.base import RunOptions
from harness.neutral import datasets, inputs, models
from harness.spec import LoaderSpec
from tests.adapters import kit

#: Parameters after the same steps in both modes: |a - b| <= ATOL + RTOL |b| (the same arithmetic on the same
#: batches; only where the batch was gathered differs), and every parameter moved by more than 100 x ATOL.
RTOL, ATOL = 1e-5, 1e-6
BATCH = 32
EPOCH_STEPS = 6  # steps of each of two epochs: the second epoch's order and augmentation are read too


def train(adapter_cls, source: str, workers: int = 1, augmentation: bool = True) -> tuple[dict[str, np.ndarray],
                                                                                            list[float], dict]:
    """``EPOCH_STEPS`` steps of ``BATCH`` in each of two epochs of digits (the harness's epoch order; augmented
    images when ``augmentation``), resident or through the adapter's loader with ``workers``; returns the parameters,
    the loss of each epoch (``read_loss`` at its end) and the adapter's settings."""
    data, info = kit.digits()
    adapter = adapter_cls(RunOptions(input=source, loader=LoaderSpec(workers=workers, prefetch=2)))
    adapter.prepare("cpu", 2, 0)  # kit.make's threads: TensorFlow fixes its thread pools once per process
    adapter.build_neutral(info, models.initial_weights(info, 0), kit.SGD)
    adapter.load(data)
    if source == "loader":
        adapter.open_loader(inputs.for_dataset(None, data, augmentation=augmentation, seed=0))
    losses = []
    for epoch in range(2):
        order = datasets.epoch_order(len(data.y_train), 0, epoch)[:EPOCH_STEPS * BATCH]
        batches = adapter.batches(order, BATCH, epoch)
        if source == "resident" and augmentation:
            adapter.set_train_images(datasets.augment(data.x_train, 0, epoch))
        for batch in batches:
            adapter.train_step(batch)
        losses.append(adapter.read_loss()[0])
    return adapter.get_weights(), losses, adapter.settings().record()


def check(adapter_cls, loader_name: str) -> dict:
    """The loader trains as resident mode does (parameters within RTOL/ATOL, epoch losses within 1e-5 relative),
    with 0 and with 1 worker; the loader is recorded under ``settings()["loader"]``; returns those settings."""
    resident, resident_losses, _ = train(adapter_cls, "resident")
    initial = models.initial_weights(kit.digits()[1], 0)
    settings = {}
    for workers in (0, 1):
        weights, losses, settings = train(adapter_cls, "loader", workers)
        assert sorted(weights) == sorted(resident)
        for name, value in resident.items():
            np.testing.assert_allclose(weights[name], value, rtol=RTOL, atol=ATOL, err_msg=f"{workers}: {name}")
            assert np.abs(value - initial[name]).max() > 100 * ATOL, name
        np.testing.assert_allclose(losses, resident_losses, rtol=1e-5)
        assert settings["loader"]["loader"] == loader_name and settings["loader"]["source"] == "memory"
    return settings["loader"]
