"""Data-parallel training runs of one adapter, in a fresh interpreter set up as the worker would set it up; the
equivalence tests (tests/adapters/test_data_parallel.py, tests/adapters/test_{framework}_data_parallel.py) run it per
framework and compare the saved parameters.

    python -m tests.adapters.data_parallel_run FRAMEWORK DEVICES OUT.npz [--batchnorm] [--sync-batchnorm]
        [--optimizer sgd|adam] [--steps 10] [--batch 32] [--accumulation 1]
    python -m tests.adapters.data_parallel_run FRAMEWORK --runs JSON

The first form is one run. The second trains several in one interpreter, one after the other (starting an interpreter
and importing the framework costs more CPU than a run's training): JSON is a list of the first form's arguments after
FRAMEWORK, one list per run (``runs_argument`` writes it). Every run makes its own adapter from scratch (prepared, which
seeds the framework, built from the canonical seed-0 weights, loaded) and shares nothing with the runs before it but
the interpreter; what the interpreter holds is the worker's set-up for the largest device count of the runs (at most
one count above 1):

- before the framework is imported the declaration's ``DataParallelism.environment`` is set for that count (JAX's host
  device count), as the worker sets it for a data-parallel trial. A one-device run trains on the framework's first
  device, the others idle, as the one-device adapters of the checks scripts of the per-framework tests do;
- the multi-device runs come first: the first prepare splits TensorFlow's CPU into logical devices, which it can only
  do before its runtime starts; the one-device runs then train on "/CPU:0";
- a "processes" framework (PyTorch): this process, rank 0, starts the other ranks once, with torchrun's environment
  (``harness.execution.ranks``), each running this same command and training the multi-device runs (in the same
  order). Each run has a process group of its own: after a run the ranks leave it (``destroy_process_group``, as the
  adapter does at a trial's end) and the next run's prepare joins a new one at a new rendezvous port, which rank 0
  broadcast before leaving. The one-device runs then train in rank 0 alone, with no process group.

Each run saves bit for bit what it saves alone in an interpreter of its own (checked once, when the second form was
introduced, for every framework and run of the per-framework tests, in two orders).

DEVICES 1 is a plain one-device run. With more, the adapter gets ``RunOptions.data_parallel`` over that many CPU
devices. Every rank trains ``--steps`` steps of the global batch on the harness's epoch order (digits, the CNN of
tests/adapters/kit.py, or a CNN with batchnorm), and rank 0 saves the parameters and buffers (canonical names), the
loss of every step (``read_loss`` after each) and the test loss and accuracy (``evaluate``) to OUT.npz.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Sequence

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


def set_data_parallel_environment(declared, devices: int) -> None:
    """The declaration's ``DataParallelism.environment`` in ``os.environ``, as the worker sets it
    (``DataParallelism.variables``), before the framework is imported."""
    os.environ.update(declared.data_parallel.variables(devices, os.environ))


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


def runs_argument(runs: Iterable[Sequence[object]]) -> list[str]:
    """``["--runs", JSON]``, the second form's arguments after FRAMEWORK for ``runs``: each the first form's arguments
    after FRAMEWORK (devices, the output path, options), e.g. ``(2, "out.npz", "--optimizer", "adam")``."""
    return ["--runs", json.dumps([[str(part) for part in run] for run in runs])]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.adapters.data_parallel_run FRAMEWORK")
    parser.add_argument("devices", type=int)
    parser.add_argument("out")
    parser.add_argument("--batchnorm", action="store_true")
    parser.add_argument("--sync-batchnorm", action="store_true")
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--accumulation", type=int, default=1)
    return parser


def _parse(argv: Sequence[str]) -> tuple[str, list[argparse.Namespace]]:
    """FRAMEWORK and its runs, the multi-device ones first (in their given order, then the one-device ones)."""
    if not argv:
        raise SystemExit("usage: python -m tests.adapters.data_parallel_run FRAMEWORK DEVICES OUT.npz [options] | "
                         "FRAMEWORK --runs JSON")
    framework, rest = argv[0], list(argv[1:])
    if rest[:1] == ["--runs"]:
        if len(rest) != 2:
            raise SystemExit("--runs takes one JSON list of runs and nothing else")
        given = json.loads(rest[1])
    else:
        given = [rest]
    parser = _parser()
    runs = [parser.parse_args([str(part) for part in run]) for run in given]
    if not runs:
        raise SystemExit("no runs")
    counts = {run.devices for run in runs if run.devices > 1}
    if len(counts) > 1:
        raise SystemExit(f"one device count above 1 per interpreter, not {sorted(counts)}")
    return framework, sorted(runs, key=lambda run: run.devices == 1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    framework, runs = _parse(argv)

    import adapters
    from harness.execution.ranks import Ranks, rank_environment, this_rank

    declared = adapters.declaration(framework)
    assert declared is not None, framework
    devices = max(run.devices for run in runs)
    if devices > 1:
        set_data_parallel_environment(declared, devices)
    rank, processes = 0, 1
    ranks = None
    if devices > 1 and declared.data_parallel.kind == "processes":
        processes = devices
        mine = this_rank()
        if mine is None:  # rank 0: start the others, each running this command
            def fail(failure):
                print(f"rank {failure.rank} failed: {failure.returncode} {failure.error}", file=sys.stderr)
                os._exit(3)

            ranks = Ranks(argv=[sys.executable, "-m", "tests.adapters.data_parallel_run", *argv],
                          world=devices, stdin_line="{}", on_failure=fail)
            os.environ.update({k: v for k, v in rank_environment(0, devices, ranks.port).items()
                               if k != "HARNESS_RANK_OF"})
            ranks.start()
        else:  # another rank: the multi-device runs only
            rank = mine[0]
            runs = [run for run in runs if run.devices > 1]

    for run in runs:
        _train(framework, run, rank, processes if run.devices > 1 else 1)
        if run.devices > 1 and processes > 1:
            _leave_process_group(rank)
    if ranks is not None:
        # The other ranks are done too, but exiting an interpreter with torch loaded takes about a second of CPU, more
        # on a loaded machine: Ranks.close kills a rank still running after 5 s, which the watcher then reports as a
        # failure (exit -9), so give them time to exit first.
        for proc in ranks.procs.values():
            proc.wait(timeout=120)
        ranks.close()
    return 0


def _train(framework: str, args: argparse.Namespace, rank: int, processes: int) -> None:
    """One run: a fresh adapter, prepared (seeded), built from the canonical initial weights and loaded, trained and
    evaluated; rank 0 saves to ``args.out``."""
    import numpy as np

    import adapters
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
    adapter = adapters.get(framework)(options)
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


def _leave_process_group(rank: int) -> None:
    """After a multi-process run (PyTorch, the only "processes" framework): rank 0 picks a free port for the next
    run's rendezvous and broadcasts it over the run's process group, which every rank then leaves
    (``destroy_process_group``, what the adapter does at a trial's end); the next run's prepare joins a new group
    there (``MASTER_PORT``, read by its ``init_method="env://"``)."""
    import torch.distributed as dist

    from harness.execution.ranks import free_port

    port = [free_port() if rank == 0 else 0]
    dist.barrier()
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])


if __name__ == "__main__":
    sys.exit(main())
