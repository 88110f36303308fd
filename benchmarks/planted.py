"""A planted slowdown for ``compare_false_alarms.py``: the PyTorch adapter, whose every train_step then spins for
``HARNESS_PLANTED_SLOWDOWN`` x its own duration (0.1: each step 10 % slower), so the slowed runs keep the real
framework's noise. Spinning (not sleeping) keeps the core busy, as slower code would, and is exact at sub-millisecond
scale where ``time.sleep`` overshoots. Registered with HARNESS_ADAPTERS="planted=benchmarks.planted:PlantedSlowdown";
the variable travels to the workers with the environment.
"""

from __future__ import annotations

import os
import time

from adapters.pytorch import PyTorchAdapter

REGISTRATION = "planted=benchmarks.planted:PlantedSlowdown"


class PlantedSlowdown(PyTorchAdapter):
    name = "planted"

    def __init__(self) -> None:
        super().__init__()
        self.slowdown = float(os.environ.get("HARNESS_PLANTED_SLOWDOWN", "0") or 0)

    def train_step(self, indices, micro_batches=1):
        start = time.perf_counter()
        super().train_step(indices, micro_batches)  # synchronous on the CPU
        if self.slowdown:
            deadline = time.perf_counter() + self.slowdown * (time.perf_counter() - start)
            while time.perf_counter() < deadline:
                pass

    def settings(self):
        return {**super().settings(), "planted_slowdown": self.slowdown}
