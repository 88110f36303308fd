"""On a real GPU (``pytest -m gpu``): the resident steps of the PyTorch and JAX adapters are queued without the host
waiting for the GPU, epoch starts included, as the hand-written loops of benchmarks/idiomatic_loops.py are. A step
that waits (a copy from pageable memory ordered behind the queued kernels, a read of a device value) makes the host
time of a run of steps equal to its GPU time, and throughput the sum of host and device time instead of the larger
of the two: on an H200 the harness ran at 0.87-0.91 (PyTorch) and 0.53 (JAX) of such a loop at batch 512
(docs/findings/2026-11-27-gpu-run.md)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from harness.neutral import datasets, models
from harness.spec import ModelSpec, OptimizerSpec, SyntheticData

pytestmark = pytest.mark.gpu

# Big enough that the GPU's share of a step (about 1 to 3 ms at batch 2048 on an H100 or H200, fp32) is well above
# the host's (a few hundred microseconds to queue a step in either framework).
MODEL = ModelSpec.model_validate({"layers": [
    {"type": "conv2d", "filters": 64, "kernel_size": 3, "padding": "same", "activation": "relu"},
    {"type": "conv2d", "filters": 64, "kernel_size": 3, "padding": "same", "activation": "relu"},
    {"type": "maxpool2d", "pool_size": 2},
    {"type": "flatten"},
    {"type": "dense", "units": 256, "activation": "relu"},
    {"type": "dense", "units": 10},
]})
BATCH, STEPS_PER_EPOCH, EPOCHS = 2048, 4, 5


def _adapter(name: str):
    if name == "pytorch":
        pytest.importorskip("torch")
        from adapters.pytorch.adapter import PyTorchAdapter as cls
    else:
        pytest.importorskip("jax")
        from adapters.jax.adapter import JaxAdapter as cls
    data = datasets.load(SyntheticData(name="synthetic", shape=[32, 32, 3], classes=10,
                                       size=BATCH * STEPS_PER_EPOCH, test_size=256))
    info = models.analyze(MODEL, data.x_train.shape[1:], data.num_classes)
    adapter = cls()
    if adapter.device_problem("cuda:0"):
        pytest.skip(adapter.device_problem("cuda:0"))
    adapter.prepare("cuda:0", None, 0)
    adapter.build_neutral(info, models.initial_weights(info, 0), OptimizerSpec(name="sgd", learning_rate=0.01,
                                                                              momentum=0.9))
    adapter.load(data)
    return adapter, len(data.y_train)


def _epochs(adapter, n: int, first: int, count: int) -> None:
    """``count`` epochs from ``first`` as the harness's loop runs them: each epoch's ``batches`` made at its start,
    then its steps."""
    for epoch in range(first, first + count):
        for batch in adapter.batches(datasets.epoch_order(n, 0, epoch), BATCH, epoch):
            adapter.train_step(batch)


@pytest.mark.parametrize("framework", ["pytorch", "jax"])
def test_steps_are_queued_without_waiting_for_the_gpu(framework):
    adapter, n = _adapter(framework)
    _epochs(adapter, n, 0, 2)  # compilation, autotuning, the allocator's first blocks
    adapter.wait()
    adapter.read_loss()
    adapter.wait()
    ratios = []
    for repeat in range(3):
        start = time.perf_counter()
        _epochs(adapter, n, 2 + repeat * EPOCHS, EPOCHS)
        queued = time.perf_counter() - start
        adapter.wait()
        done = time.perf_counter() - start
        adapter.read_loss()
        adapter.wait()
        ratios.append(queued / done)
    # Queued without waiting, the host is done with 20 steps long before the GPU: a fraction of the run's time.
    # Waiting at each step or epoch start, the host finishes with the GPU (a ratio near 1).
    assert float(np.median(ratios)) < 0.6, f"host time / run time per repeat: {[round(r, 3) for r in ratios]}"
