"""A test adapter whose memory grows with the per-device batch and nothing else, for max-batch with real workers under
a real CPU cap (tests/studies/test_maxbatch_runs.py): numpy, each step writes ``BYTES_PER_SAMPLE`` per sample of its
rank's shard (no BLAS, which hangs under a cap, so every probe takes a fraction of a second); the dataset stays
resident as the worker loaded it. One process per device, its ranks started by the worker as PyTorch's are.
Registered for a test with HARNESS_ADAPTERS=REGISTRATION."""

from __future__ import annotations

import numpy as np

from adapters.base import Adapter, Settings, shard
from adapters.declaration import DataParallelism, Declaration
from harness.neutral.steps import steps

#: What a step holds per per-device sample, beyond its images: written, so resident and counted by the cap.
BYTES_PER_SAMPLE = 200_000
REGISTRATION = "memory_dp=tests.fakes.memory_adapter:MemoryAdapter"


class MemoryAdapter(Adapter, declaration=Declaration(
        name="memory_dp", title="memory_dp", adapter="tests.fakes.memory_adapter:MemoryAdapter",
        data_parallel=DataParallelism(kind="processes", mechanism="one numpy process per device, no all-reduce"))):

    def prepare(self, device, threads, seed):
        dp = self.options.data_parallel
        self.rank, self.world = (dp.rank, dp.size) if dp is not None else (0, 1)
        self.loss_sum = 0.0

    def neutral_model(self, info, weights):
        return weights

    def build(self, model, task, optimizer):
        self.weights = model

    def load(self, data):
        self.x = data.x_train

    def batches(self, order, samples_per_step, epoch):
        return iter(steps(order, samples_per_step))

    def train_step(self, indices, micro_batches=1):
        mine = shard(indices, self.world, self.rank)
        held = np.ones((len(mine), BYTES_PER_SAMPLE // 8))
        self.loss_sum += float(held[:, 0].mean()) + float(self.x[mine].mean())
        self._loss_steps += 1

    def wait(self):
        pass

    def _take_loss_sum(self):
        total, self.loss_sum = self.loss_sum, 0.0
        return total

    def evaluate(self, batch_size):
        return 1.0, 0.1

    def predict(self, images):
        return np.zeros((len(images), 10), dtype=np.float32)

    def get_weights(self):
        return self.weights

    def versions(self):
        return {"numpy": np.__version__}

    def settings(self):
        return Settings(precision=self.options.precision, compile=self.mode)

    def is_oom(self, exc):
        return isinstance(exc, MemoryError)
