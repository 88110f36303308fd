"""One data-parallel training run of one adapter, in a fresh interpreter, as the worker would set it up; the
equivalence tests (tests/adapters/test_data_parallel.py) run it per framework and device count and compare the saved
parameters.

    python -m tests.adapters.data_parallel_run FRAMEWORK DEVICES OUT.npz [--batchnorm] [--sync-batchnorm]
        [--optimizer sgd|adam] [--steps 10] [--batch 32] [--accumulation 1]

DEVICES 1 is a plain one-device run. With more, the adapter gets ``RunOptions.data_parallel`` over that many CPU
devices: before the framework is imported the declaration's ``data_parallel_environment`` is set (JAX's host device
count), and a "processes" framework (PyTorch) has this process, rank 0, start the other ranks with torchrun's
environment (``harness.execution.ranks``), each running this same command. Every rank trains ``--steps`` steps of the
global batch on the harness's epoch order (digits, the CNN of tests/adapters/kit.py, or a CNN with batchnorm), and rank
0 saves the parameters and buffers (canonical names), the loss of every step (``read_loss`` after each) and the
test loss and accuracy (``evaluate``) to OUT.npz.
"""

from __future__ import annotations

import argparse
import os
import sys

#: The standard driver runs of the per-framework tests (test_{framework}_data_parallel.py): name -> (devices, extra
#: arguments of ``main``).
RUNS = {
    "sgd-1": (1, []), "sgd-2": (2, []),
    "adam-1": (1, ["--optimizer", "adam"]), "adam-2": (2, ["--optimizer", "adam"]),
    "accumulated-1": (1, ["--batch", "16", "--accumulation", "2"]),
    "bn-1": (1, ["--batchnorm"]), "bn-2": (2, ["--batchnorm"]),
    "bn-sync-2": (2, ["--batchnorm", "--sync-batchnorm"]),
}


def _model(batchnorm: bool):
    from harness.spec import ModelSpec
    from tests.adapters.kit import CNN

    if not batchnorm:
        return CNN
    return ModelSpec.model_validate({"layers": [
        {"type": "conv2d", "filters": 8, "kernel_size": 3, "padding": "same"},
        {"type": "batchnorm"},
        {"type": "relu"},
        {"type": "maxpool2d", "pool_size": 2},
        {"type": "flatten"},
        {"type": "dense", "units": 10},
    ]})


def set_data_parallel_environment(record, devices: int) -> None:
    """The declaration's ``data_parallel_environment`` in ``os.environ``, as the worker sets it
    (``Declaration.data_parallel_variables``), before the framework is imported."""
    os.environ.update(record.data_parallel_variables(devices, os.environ))


def refusals(adapter, order) -> dict[str, str]:
    """What a data-parallel ``adapter`` (two devices) says, as ValueError, to a step it cannot split: gradient
    accumulation (refused under data parallelism) and 33 samples (not a multiple of the devices); name -> message."""
    from tests.adapters import kit

    said = {}
    for name, call in {"accumulation": lambda: kit.step(adapter, order[:32], micro_batches=2),
                       "uneven": lambda: kit.step(adapter, order[:33])}.items():
        try:
            call()
        except ValueError as err:
            said[name] = str(err)
    return said


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework")
    parser.add_argument("devices", type=int)
    parser.add_argument("out")
    parser.add_argument("--batchnorm", action="store_true")
    parser.add_argument("--sync-batchnorm", action="store_true")
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--accumulation", type=int, default=1)
    args = parser.parse_args(argv)

    import adapters
    from harness.execution.ranks import Ranks, rank_environment, this_rank

    record = adapters.declaration(args.framework)
    assert record is not None, args.framework
    if args.devices > 1:
        set_data_parallel_environment(record, args.devices)
    rank, processes = 0, 1
    ranks = None
    if args.devices > 1 and record.data_parallel == "processes":
        processes = args.devices
        mine = this_rank()
        if mine is None:  # rank 0: start the others, each running this command
            def fail(failure):
                print(f"rank {failure.rank} failed: {failure.returncode} {failure.error}", file=sys.stderr)
                os._exit(3)

            ranks = Ranks(argv=[sys.executable, "-m", "tests.adapters.data_parallel_run", *sys.argv[1:]],
                          world=args.devices, stdin_line="{}", on_failure=fail)
            os.environ.update({k: v for k, v in rank_environment(0, args.devices, ranks.port).items()
                               if k != "HARNESS_RANK_OF"})
            ranks.start()
        else:
            rank = mine[0]

    import numpy as np

    from adapters.base import DataParallel, RunOptions
    from harness.neutral import datasets, models
    from harness.spec import DigitsData, OptimizerSpec

    optimizer = (OptimizerSpec(name="sgd", learning_rate=0.05, momentum=0.9) if args.optimizer == "sgd" else
                 OptimizerSpec(name="adam", learning_rate=0.001))
    data = datasets.load(DigitsData(name="digits"))
    info = models.analyze(_model(args.batchnorm), data.x_train.shape[1:], data.num_classes)
    options = None
    if args.devices > 1:
        options = RunOptions(data_parallel=DataParallel(
            devices=tuple(f"cpu:{i}" for i in range(args.devices)), processes=processes, rank=rank,
            sync_batchnorm=args.sync_batchnorm))
    adapter = adapters.get(args.framework)(options)
    adapter.prepare("cpu", 1, 0)
    adapter.build_neutral(info, models.initial_weights(info, 0), optimizer)
    adapter.load(data)
    samples = args.batch * args.accumulation
    order = datasets.epoch_order(len(data.y_train), 0, 0)[:args.steps * samples]
    losses = []
    for batch in adapter.batches(order, samples, 0):
        adapter.train_step(batch, micro_batches=args.accumulation)
        losses.append(adapter.read_loss()[0])
    test_loss, test_accuracy = adapter.evaluate(args.batch)
    state = {**adapter.get_weights(), **adapter.get_buffers()}
    if rank == 0:
        np.savez(args.out, **{f"w:{k}": v for k, v in state.items()},
                 losses=np.asarray(losses), test=np.asarray([test_loss, test_accuracy]))
    if ranks is not None:
        # The other ranks are done too, but exiting an interpreter with torch loaded takes about a second of CPU, more
        # on a loaded machine: Ranks.close kills a rank still running after 5 s, which the watcher then reports as a
        # failure (exit -9), so give them time to exit first.
        for proc in ranks.procs.values():
            proc.wait(timeout=120)
        ranks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
