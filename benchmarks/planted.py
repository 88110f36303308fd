"""A planted slowdown for ``compare_false_alarms.py``: the PyTorch adapter, whose every train_step then spins for
``HARNESS_PLANTED_SLOWDOWN`` x its own duration (0.1: each step 10 % slower), so the slowed runs keep the real
framework's noise. Spinning (not sleeping) keeps the core busy, as slower code would, and is exact at sub-millisecond
scale where ``time.sleep`` overshoots. Registered with HARNESS_ADAPTERS="planted=benchmarks.planted:PlantedSlowdown";
the variable travels to the workers with the environment.
"""

from __future__ import annotations

import os
import time

from adapters.pytorch.adapter import PyTorchAdapter

REGISTRATION = "planted=benchmarks.planted:PlantedSlowdown"
#: Fixed slowdowns under names of their own, for one run that holds plain and slowed entries side by side
#: (``compare_false_alarms.py --interleaved``).
FIXED = {"planted10": "Planted10", "planted30": "Planted30"}
REGISTRATION_ALL = ",".join([REGISTRATION, *(f"{name}=benchmarks.planted:{cls}" for name, cls in FIXED.items())])


class PlantedSlowdown(PyTorchAdapter):
    name = "planted"

    fixed: float | None = None  # a slowdown of the class's own, whatever the environment says

    def __init__(self) -> None:
        super().__init__()
        self.slowdown = (self.fixed if self.fixed is not None
                         else float(os.environ.get("HARNESS_PLANTED_SLOWDOWN", "0") or 0))

    def train_step(self, indices, micro_batches=1, position=None):
        start = time.perf_counter()
        super().train_step(indices, micro_batches, position)  # synchronous on the CPU
        if self.slowdown:
            deadline = time.perf_counter() + self.slowdown * (time.perf_counter() - start)
            while time.perf_counter() < deadline:
                pass

    def settings(self):
        return {**super().settings(), "planted_slowdown": self.slowdown}


class Planted10(PlantedSlowdown):
    name, fixed = "planted10", 0.10


class Planted30(PlantedSlowdown):
    name, fixed = "planted30", 0.30
