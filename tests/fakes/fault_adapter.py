"""A test adapter for process-level behaviour: a real numpy softmax regression (it ignores the spec's layers) that
injects faults chosen per batch size by the environment variable HARNESS_FAULT, e.g. "8:raise,16:kill,32:hang".

Faults (at the third train_step): raise (ValueError), oom (MemoryError, which this adapter classifies as OOM),
kill (SIGKILL to itself), segv (SIGSEGV to itself), hang (sleeps forever), exit (os._exit(3) without a report); and
frozen (every step leaves the weights as they were: the test accuracy stays that of the zero weights, a regression
that no timing noise can hide or fake).
HARNESS_STEP_SLEEP, e.g. "*:0.002,64:0.004", sleeps that many seconds in every train_step of that batch size ("*" for
any): a stable step time, and a planted slowdown for the comparison tests. HARNESS_STEP_MARKS, a folder: the first
train_step of each worker creates the file ``bs<batch size>-<pid>`` there (a test waits for training to start).
Registered for a test with HARNESS_ADAPTERS="fault=tests.fakes.fault_adapter:FaultAdapter".
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from adapters.base import Adapter, Settings, shard
from adapters.declaration import DataParallelism, Declaration, Start
from harness.neutral.steps import steps

REGISTRATION = "fault=tests.fakes.fault_adapter:FaultAdapter"


# numpy only: forked, as a built-in would be
class FaultAdapter(Adapter, declaration=Declaration(name="fault", title="fault",
                                                    adapter="tests.fakes.fault_adapter:FaultAdapter",
                                                    start=Start(fork_safe=True))):
    def __init__(self, options=None) -> None:
        super().__init__(options)
        self.steps = 0
        self.loss = float("nan")  # the last step's
        self.loss_sum = 0.0  # since the last read (Adapter.read_loss)
        self.fault = None

    def versions(self):
        return {"numpy": np.__version__}

    def settings(self):
        # What a command prefix did to the worker: a variable it set, and the variables the payload carried (and the
        # GPUs an executor gave it, where it did).
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
        return Settings(precision=self.options.precision, compile=self.mode,
                        test_mark=os.environ.get("HARNESS_TEST_MARK"), omp_threads=os.environ.get("OMP_NUM_THREADS"),
                        **({"cuda_visible_devices": gpus} if gpus is not None else {}))

    def prepare(self, device, threads, seed):
        self.rng = np.random.default_rng(seed)

    def neutral_model(self, info, weights):
        # a softmax regression whatever the layers: (input features, classes); the canonical weights are kept as given
        self.weights = {k: v.copy() for k, v in weights.items()}
        return np.zeros((int(np.prod(info.input_shape)), info.num_classes), dtype=np.float64)

    def build(self, model, task, optimizer):
        self.w = model
        self.lr = optimizer.learning_rate

    def load(self, data):
        self.x = data.x_train.reshape(len(data.x_train), -1)
        self.y = data.y_train
        self.xt = data.x_test.reshape(len(data.x_test), -1)
        self.yt = data.y_test

    @staticmethod
    def _setting(variable, batch_size):
        spec = dict(item.split(":") for item in filter(None, os.environ.get(variable, "").split(",")))
        return spec.get(str(batch_size), spec.get("*"))

    def _maybe_fault(self, batch_size):
        """Marks the first step, sleeps and injects the fault of ``batch_size`` (HARNESS_STEP_MARKS,
        HARNESS_STEP_SLEEP, HARNESS_FAULT); returns that fault (None when there is none), which ``train_step`` also
        reads (``frozen``)."""
        if self.steps == 0 and (folder := os.environ.get("HARNESS_STEP_MARKS")):
            with open(os.path.join(folder, f"bs{batch_size}-{os.getpid()}"), "w"):
                pass
        if (pause := self._setting("HARNESS_STEP_SLEEP", batch_size)) is not None:
            time.sleep(float(pause))
        fault = self._setting("HARNESS_FAULT", batch_size)
        if fault is None or self.steps != 2:
            return fault
        if fault == "raise":
            raise ValueError("injected failure")
        if fault == "oom":
            raise MemoryError("injected out of memory")
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "abort-capped" and self.options.memory_limit_bytes:
            os.kill(os.getpid(), signal.SIGABRT)  # like a C++ runtime failing an allocation under the memory cap
        if fault == "hang":
            while True:
                time.sleep(1)
        if fault == "exit":
            os._exit(3)
        return fault

    def _probs(self, x):
        z = x @ self.w
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        return p / p.sum(axis=1, keepdims=True)

    def batches(self, order, samples_per_step, epoch):
        return iter(steps(order, samples_per_step))

    # the loop is the same with accumulation: micro_batches is ignored
    def train_step(self, indices, micro_batches=1):
        fault = self._maybe_fault(len(indices))
        x, y = self.x[indices], self.y[indices]
        p = self._probs(x)
        self.loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
        self.loss_sum, self._loss_steps = self.loss_sum + self.loss, self._loss_steps + 1
        p[np.arange(len(y)), y] -= 1
        if fault != "frozen":
            self.w -= self.lr * x.T @ p / len(y)
        self.steps += 1

    def wait(self):
        pass  # numpy: every step is done when it returns

    def _take_loss_sum(self):
        total, self.loss_sum = self.loss_sum, 0.0
        return total

    def evaluate(self, batch_size):
        p = self._probs(self.xt)
        loss = float(-np.log(p[np.arange(len(self.yt)), self.yt] + 1e-12).mean())
        return loss, float((p.argmax(axis=1) == self.yt).mean())

    def predict(self, images):
        return (images.reshape(len(images), -1) @ self.w).astype(np.float32)

    def get_weights(self):
        return self.weights

    def is_oom(self, exc):
        return isinstance(exc, MemoryError)


#: The fault adapter as a one-process-per-device framework: ``fault_dp``. Its ranks really start (the worker's
#: ``harness.execution.ranks``), each trains on its shard of every step and records its pid in the folder
#: HARNESS_FAULT_PIDS; it has no all-reduce (numpy, nothing to reduce over), so it tests processes, not numbers.
#: HARNESS_FAULT_RANK=r injects HARNESS_FAULT in rank r only. HARNESS_FAULT_BARRIER=1 makes every rank wait in
#: ``prepare`` until all ranks have recorded their pids (a framework's rendezvous), so all are alive when training.
DATA_PARALLEL_REGISTRATION = "fault_dp=tests.fakes.fault_adapter:DataParallelFaultAdapter"


class DataParallelFaultAdapter(FaultAdapter, declaration=Declaration(
        name="fault_dp", title="fault_dp", adapter="tests.fakes.fault_adapter:DataParallelFaultAdapter",
        data_parallel=DataParallelism(kind="processes", mechanism="one numpy process per device, no all-reduce"))):
    def prepare(self, device, threads, seed):
        super().prepare(device, threads, seed)
        dp = self.options.data_parallel
        self.rank, self.world = (dp.rank, dp.size) if dp is not None else (0, 1)
        if folder := os.environ.get("HARNESS_FAULT_PIDS"):
            with open(os.path.join(folder, f"rank{self.rank}-{os.getpid()}"), "w"):
                pass
            deadline = time.monotonic() + 60
            while os.environ.get("HARNESS_FAULT_BARRIER") and time.monotonic() < deadline and len(
                    [n for n in os.listdir(folder) if n.startswith("rank")]) < self.world:
                time.sleep(0.02)

    def _maybe_fault(self, batch_size):
        wanted = os.environ.get("HARNESS_FAULT_RANK")
        if wanted is None or int(wanted) == self.rank:
            return super()._maybe_fault(batch_size * self.world)  # faults are chosen by the global batch size
        return None

    def train_step(self, indices, micro_batches=1):
        super().train_step(shard(indices, self.world, self.rank), micro_batches)
