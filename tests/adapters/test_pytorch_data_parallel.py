"""PyTorch data-parallel training: DistributedDataParallel over 2 CPU processes (gloo), each rank training on its
shard of the global batch (``adapters.base.shard``), checked against one process.

The driver's runs (tests/adapters/data_parallel_run.py) are one command, a fresh pair of interpreters: rank 0 starts
rank 1 as the worker will, the two train the two-process runs one after the other, each in a process group of its own
(the ranks leave a run's group and join a new one at a new rendezvous port for the next), and rank 0 then trains the
one-process runs alone, with no group (starting an interpreter and importing torch is most of a run's cost; each run
is bit for bit what it is alone). This module run as a script (``_rank_main``) does what the driver does not cover
(the compiled mode, a rank that leaves), each run a fresh set of interpreters. The runs of the module start together,
once (the ``runs`` fixture), and the tests read their .npz files; the tests of a rank that cannot reach the others run
in this process.

Tolerances: parameters |a - b| <= 1e-6 + 1e-5 * |b| (the gradient accumulation test's in test_equivalence.py), losses
rtol 1e-5. Observed (torch 2.13 CPU, 10 steps of the digits CNN at global batch 32, kit.max_differences: absolute,
and relative over the elements above 1e-3): 2 ranks vs 1 process, SGD momentum 2.1e-7 and 1.8e-5, Adam 2.8e-7 and
6.8e-6; losses at most 1.1e-7 relative. The ranks' gradients are means over 16 samples averaged by the all-reduce,
one process's a mean over 32, summed in another order. One process accumulating 2 x 16 gives exactly the parameters
of 2 ranks (the same two halves, added in the same order). The compiled mode under DDP: 2.4e-7 and 1.6e-5.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import adapters
from adapters.base import DataParallel, RunOptions, shard
from harness.execution.ranks import RANK_VARIABLES, free_port, rank_environment
from harness.neutral import datasets, models
from harness.spec import OptimizerSpec
from tests.adapters import kit
from tests.adapters.data_parallel_run import _model, runs_argument

ROOT = Path(__file__).resolve().parents[2]
THIS = "tests.adapters.test_pytorch_data_parallel"
RTOL, ATOL = 1e-5, 1e-6
#: The driver's SGD (tests/adapters/data_parallel_run.py): kit.SGD.
SGD = OptimizerSpec(name="sgd", learning_rate=0.05, momentum=0.9)

#: name -> one run: the driver's devices and options (every driver run in one driver command, ``--runs``, each saving
#: to "<name>.npz"), or this module's mode as a script.
RUNS: dict[str, tuple[str, ...]] = {
    "n1_sgd": ("driver", "1"),
    "n2_sgd": ("driver", "2"),
    "n1_adam": ("driver", "1", "--optimizer", "adam"),
    "n2_adam": ("driver", "2", "--optimizer", "adam"),
    "n1_accumulation": ("driver", "1", "--batch", "16", "--accumulation", "2"),
    "n1_batchnorm": ("driver", "1", "--batchnorm", "--steps", "1"),
    "n2_batchnorm": ("driver", "2", "--batchnorm", "--steps", "1"),
    "n2_compiled": ("script", "compiled"),
    "n2_leave": ("script", "leave"),
}


def _commands(folder: Path) -> dict[str, list[str]]:
    """The commands of ``RUNS``, by name: "driver" for all the driver's runs, and each script run's own."""
    driver = [(devices, folder / f"{name}.npz", *options)
              for name, (kind, devices, *options) in RUNS.items() if kind == "driver"]
    commands = {"driver": [sys.executable, "-m", "tests.adapters.data_parallel_run", "pytorch", *runs_argument(driver)]}
    for name, (kind, *args) in RUNS.items():
        if kind == "script":
            commands[name] = [sys.executable, "-m", THIS, args[0], str(folder / f"{name}.npz")]
    return commands


def _command_of(name: str) -> str:
    """The command of ``_commands`` that makes the run ``name``."""
    return "driver" if RUNS[name][0] == "driver" else name


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Starts every command of ``RUNS`` at once (each waits on the CPU, not on the others) and returns
    ``result(name)``: the run's .npz (rank 0's; a script run's ranks each write ``<name>.rank<r>.npz``) once its
    command has finished, or a failure with its standard error."""
    folder = tmp_path_factory.mktemp("pytorch_data_parallel")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in RANK_VARIABLES:  # a run must not inherit a rank's variables from pytest's environment
        env.pop(name, None)
    procs = {}
    for command, argv in _commands(folder).items():
        log = open(folder / f"{command}.log", "w")  # closed when the run is collected (result) or at teardown
        procs[command] = (subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log)

    def result(name: str, rank: int | None = None):
        command = _command_of(name)
        proc, log = procs[command]
        code = proc.wait(timeout=600)
        log.close()
        assert code == 0, f"{name} ({command}) exited {code}:\n{(folder / f'{command}.log').read_text()[-4000:]}"
        path = folder / (f"{name}.npz" if rank is None else f"{name}.rank{rank}.npz")
        return dict(np.load(path, allow_pickle=False))

    yield result
    for proc, log in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _weights(run: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {key[2:]: value for key, value in run.items() if key.startswith("w:")}


def _assert_same_training(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    """Parameters (and buffers) within RTOL / ATOL, every parameter moved by far more than ATOL from the canonical
    initial weights (so the comparison means something), the per-step losses within rtol 1e-5."""
    wa, wb = _weights(a), _weights(b)
    assert sorted(wa) == sorted(wb)
    initial = models.initial_weights(kit.digits()[1], 0)
    for name, value in wb.items():
        np.testing.assert_allclose(wa[name], value, rtol=RTOL, atol=ATOL, err_msg=f"{what}: {name}")
        assert np.abs(value - initial[name]).max() > 100 * ATOL, name
    np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-5, err_msg=f"{what}: losses")


# -- equivalence: 2 ranks at global batch 32 = one process at 32 ------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_ranks_train_like_one_process(runs, optimizer):
    """2 ranks of 16 samples each (DDP averages their gradients) give one process's parameters at batch 32 after 10
    steps, its per-step losses (the mean over the global batch, all-reduced) and its evaluation (rank 0's model over
    the whole test set)."""
    one, two = runs(f"n1_{optimizer}"), runs(f"n2_{optimizer}")
    _assert_same_training(two, one, f"{optimizer}: 2 ranks vs 1")
    np.testing.assert_allclose(two["test"][0], one["test"][0], rtol=1e-5, err_msg="test loss")
    assert two["test"][1] == one["test"][1], "test accuracy"


def test_accumulation_of_two_micro_batches_equals_two_ranks(runs):
    """One process accumulating 2 micro-batches of 16 = 2 ranks of 16 (the seed's claim), after 10 steps."""
    _assert_same_training(runs("n1_accumulation"), runs("n2_sgd"), "accumulation 2 x 16 vs 2 ranks x 16")


# -- batchnorm ------------------------------------------------------------------------------------------------------


def _one_process_on_shards() -> list[tuple[float, dict[str, np.ndarray]]]:
    """For each device d of 2: a one-process adapter from the same initial weights trained on shard(indices, 2, d) of
    the first global batch of 32 (the driver's order): its step-1 loss and its state (weights and buffers)."""
    from adapters.pytorch.adapter import PyTorchAdapter

    out = []
    for device in range(2):
        adapter, data, _ = kit.make(PyTorchAdapter, optimizer=SGD, model=_model(True))
        indices = datasets.epoch_order(len(data.y_train), 0, 0)[:32]
        losses, kept = kit.train_on(adapter, [shard(indices, 2, device)], keep=(1,))
        out.append((losses[0], kept[1]))
    return out


def test_batchnorm_normalises_each_rank_over_its_own_shard(runs):
    """Without sync batchnorm each rank normalises over its own 16 samples: the step-1 loss of 2 ranks is the mean of
    the step-1 losses of one process trained on each shard alone, and not the loss of one process normalising over
    all 32 (observed 3.3472 vs 3.3447). The running statistics are rank 0's: DDP broadcasts rank 0's buffers before
    every training forward (broadcast_buffers), so after a step they are those of one process on shard 0."""
    two, one = runs("n2_batchnorm"), runs("n1_batchnorm")
    (loss_0, state_0), (loss_1, _) = _one_process_on_shards()
    assert two["losses"][0] == pytest.approx((loss_0 + loss_1) / 2, rel=1e-6)
    assert abs(two["losses"][0] - one["losses"][0]) > 1e-4 * abs(one["losses"][0])
    for name in ("1.running_mean", "1.running_var"):
        np.testing.assert_allclose(two[f"w:{name}"], state_0[name], rtol=1e-5, atol=1e-7, err_msg=name)
        assert not np.allclose(two[f"w:{name}"], one[f"w:{name}"], rtol=1e-4, atol=0), name


def test_sync_batchnorm_is_refused_on_the_cpu():
    """torch.nn.SyncBatchNorm raises on CPU tensors (torch 2.13), so a data-parallel trial with sync batchnorm on the
    CPU is unsupported, with the reason, by the plan's rule from the declaration (``harness.plan.support``, which the
    worker asks too); a model without batchnorm, or a GPU, is not refused."""
    from harness.plan.support import Conditions, unsupported

    record = adapters.BUILTIN["pytorch"]
    with_norm, without = kit.digits(_model(True))[1], kit.digits()[1]
    why = unsupported(record, with_norm, Conditions("fp32", "default", "cpu", 2, True))
    assert why is not None and why.startswith("the pytorch adapter has no synchronised batchnorm on cpu")
    assert "SyncBatchNorm" in why and "GPU" in why, why
    assert unsupported(record, without, Conditions("fp32", "default", "cpu", 2, True)) is None
    assert unsupported(record, with_norm, Conditions("fp32", "default", "cuda:0", 2, True)) is None
    assert unsupported(record, with_norm, Conditions("fp32", "default", "cpu", 2, False)) is None


# -- PyTorch's own: the compiled mode, collectives, ranks that are missing or leave -----------------------------------


def test_compiled_mode_under_ddp(runs):
    """torch.compile of the DDP module compiles the model (one graph: this model's gradients fit one bucket) and
    trains like one eager process; both ranks end with identical parameters and the same evaluation; ``agree`` gives
    rank 0's value on each; gradient accumulation is refused."""
    one = runs("n1_sgd")
    ranks = [runs("n2_compiled", rank) for rank in range(2)]
    _assert_same_training(ranks[0], one, "compiled 2 ranks vs eager 1")
    np.testing.assert_allclose(ranks[0]["test"], one["test"], rtol=1e-5)
    for name, value in _weights(ranks[0]).items():
        np.testing.assert_array_equal(ranks[1][f"w:{name}"], value, err_msg=name)
    for run in ranks:
        assert int(run["compilations"]) >= 1
        assert int(run["agreed"]) == 100  # rank 0's 100 + 0
        np.testing.assert_array_equal(run["test"], ranks[0]["test"])
        assert str(run["accumulation_error"]) == "gradient accumulation with data parallelism is not supported"
        assert str(run["backend"]) == "gloo"


def test_a_rank_that_leaves_fails_the_next_collective_at_once(runs):
    """Rank 1 exits after joining; rank 0's next collective (the barrier of ``wait``) raises at once (gloo sees the
    closed connection), not after the timeout."""
    run = runs("n2_leave", 0)
    assert "Connection closed by peer" in str(run["error"]), str(run["error"])
    assert float(run["seconds"]) < 30


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_cannot_reach_the_others_fails_with_a_clear_error(monkeypatch, rank):
    """Alone at the rendezvous (the other rank never starts), rank 0 waits for it and rank 1 for rank 0's store, each
    only ``DDP_TIMEOUT`` (here 2 s), then raises RuntimeError saying which rank, where and how long."""
    from adapters.pytorch.adapter import PyTorchAdapter

    port = free_port()
    for name, value in rank_environment(rank, 2, port).items():
        monkeypatch.setenv(name, value)
    adapter = PyTorchAdapter(RunOptions(data_parallel=DataParallel(devices=("cpu:0", "cpu:1"), processes=2,
                                                                   rank=rank)))
    adapter.DDP_TIMEOUT = timedelta(seconds=2)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"^rank {rank} of 2 could not join the gloo process group at "
                                           rf"127\.0\.0\.1:{port} within 2 s \(env:// rendezvous\): "):
        adapter.prepare("cpu", None, 0)
    assert time.monotonic() - start < 30
    import torch.distributed as dist

    assert not dist.is_initialized()


# -- the script the runs "n2_compiled" and "n2_leave" are ---------------------------------------------------------


def _rank_main(mode: str, out: str) -> int:
    """Without RANK in the environment: starts ranks 0 and 1 of this command with torchrun's variables
    (``harness.execution.ranks.rank_environment``) and returns the worse exit status. As a rank: "compiled" trains 10
    steps of the digits CNN at global batch 32 in the compiled mode and saves its state, losses, evaluation, compiled
    graphs, ``agree(100 + rank)``, the refusal of accumulation and the backend to ``<out stem>.rank<r>.npz``; "leave":
    rank 1 exits once joined, rank 0 times its next ``wait`` and saves the error."""
    if "RANK" not in os.environ:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, "-m", THIS, mode, out],
                                  env={**os.environ, **rank_environment(rank, 2, port)}) for rank in range(2)]
        return max(proc.wait(timeout=600) for proc in procs)
    from adapters.pytorch.adapter import PyTorchAdapter

    rank = int(os.environ["RANK"])
    path = str(Path(out).with_suffix("")) + f".rank{rank}.npz"
    adapter = PyTorchAdapter(RunOptions(compile="compiled" if mode == "compiled" else "default",
                                        data_parallel=DataParallel(devices=("cpu:0", "cpu:1"), processes=2, rank=rank)))
    adapter.prepare("cpu", 1, 0)
    if mode == "leave":
        if rank == 1:
            os._exit(0)
        time.sleep(1.0)
        start = time.monotonic()
        try:
            adapter.wait()
            error = "no error"
        except RuntimeError as exc:
            error = str(exc).splitlines()[0]
        np.savez(path, error=np.asarray(error), seconds=np.asarray(time.monotonic() - start))
        return 0
    data, info = kit.digits()
    adapter.build_neutral(info, models.initial_weights(info, 0), SGD)
    adapter.load(data)
    order = datasets.epoch_order(len(data.y_train), 0, 0)
    losses = []
    for batch in adapter.batches(order[:320], 32, 0):
        adapter.train_step(batch)
        losses.append(adapter.read_loss()[0])
    agreed = adapter.agree(100 + rank)
    try:
        kit.step(adapter, order[:32], micro_batches=2)
        refused = "not refused"
    except ValueError as exc:
        refused = str(exc)
    test = adapter.evaluate(32)
    np.savez(path, **{f"w:{k}": v for k, v in {**adapter.get_weights(), **adapter.get_buffers()}.items()},
             losses=np.asarray(losses), test=np.asarray(test), compilations=np.asarray(adapter.compilations()),
             agreed=np.asarray(agreed), accumulation_error=np.asarray(refused),
             backend=np.asarray(adapter.settings().record()["data_parallel"]["backend"]))
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1], sys.argv[2]))
