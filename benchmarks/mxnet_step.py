"""The MXNet adapter's step against a hand-written Gluon step, in one process: what the adapter's own code costs.

``benchmarks/harness_vs_loop.py`` compares whole processes (a harness worker against a loop's process), and on a
noisy machine each process runs at a speed of its own (on this project's 2-core VM trials of one cell differ by about
16 %), so a median of 8 paired ratios is good to no better than about +-8 %. This benchmark takes the process out:
one interpreter builds the adapter as a worker does (``prepare``, ``build_neutral`` with the canonical weights,
``load``), then alternates blocks of ``--steps`` optimizer steps of

- the adapter: ``batches`` at each epoch's start (it stages the epoch's order: each batch a slice of it) and
  ``train_step`` with each of its batches, exactly as the harness's loop calls them;
- the hand-written step on the same net, trainer and resident data (``benchmarks/idiomatic_loops.py``'s MXNet loop):
  ``nd.take`` with index NDArrays made before the clock, ``autograd.record``, ``backward``, ``Trainer.step``;

each block timed between two ``nd.waitall`` calls, which one goes first alternating from round to round. Both train
the one model, so they see the same weights and the same batches' shapes. ``ratio`` is the hand-written block's time
over the adapter's in the same round (the harness / loop throughput ratio of that block); the median over
``--rounds`` rounds with its min..max and interquartile range is printed per batch size.

    .venv/bin/python benchmarks/mxnet_step.py                       # batch 64 and 512, 60 rounds, about 2 minutes
    .venv/bin/python benchmarks/mxnet_step.py --batch-sizes 512 --rounds 120 --steps 20

It runs itself again in the spec's MXNet interpreter (``envs/mxnet`` for specs/quick.yaml) with the thread variables
a worker gets (``harness.execution.launcher.worker_settings``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import os  # noqa: E402
import subprocess  # noqa: E402

import numpy as np  # noqa: E402

import adapters  # noqa: E402  (imports no framework: adapters.get does, and MXNet's restores numpy's aliases first)
from harness import plan as plan_module  # noqa: E402
from harness.neutral import datasets, models  # noqa: E402
from harness.plan import available_cpus  # noqa: E402


def measure(spec: object, batch_size: int, steps: int, rounds: int) -> dict[str, list[float]]:
    """Seconds of each block of ``steps`` steps, per side ("adapter", "loop"), over ``rounds`` rounds."""
    from adapters.base import RunOptions

    adapter = adapters.get("mxnet")(RunOptions())  # fp32 in the declaration's default mode
    from mxnet import autograd, nd

    adapter.prepare("cpu", spec.cpu_threads or available_cpus(), spec.seed)
    info = models.analyze(spec.model, *datasets.describe_input(spec.dataset))
    data = datasets.load(spec.dataset, seed=spec.seed)
    adapter.build_neutral(info, models.initial_weights(info, spec.seed), spec.optimizer)
    adapter.load(data)
    training, (x_train, y_train) = adapter.training, adapter.inputs.train[0]
    per_epoch = len(data.y_train) // batch_size
    epochs = steps * (2 * rounds + 2) // per_epoch + 2  # two warm-up blocks, then two blocks a round
    orders = [datasets.epoch_order(len(data.y_train), spec.seed, e) for e in range(epochs)]
    made = {}  # the loop's index NDArrays, made before its clock starts
    staged: list = []  # the adapter's batches of the current epoch

    def loop_indices(step: int) -> nd.NDArray:
        if step not in made:
            order = orders[step // per_epoch]
            made[step] = nd.array(order[(step % per_epoch) * batch_size:][:batch_size], dtype=np.int64)
        return made[step]

    def adapter_block(first: int) -> None:
        for step in range(first, first + steps):
            epoch, position = divmod(step, per_epoch)
            if position == 0 or step == first:
                staged[:] = adapter.batches(orders[epoch][:per_epoch * batch_size], batch_size, epoch)
            adapter.train_step(staged[position])

    def loop_block(first: int) -> None:
        for step in range(first, first + steps):
            idx = loop_indices(step)
            with autograd.record():
                loss = training.loss_fn(training.net(nd.take(x_train, idx)), nd.take(y_train, idx))
            loss.backward()
            training.trainer.step(batch_size)

    sides = {"adapter": adapter_block, "loop": loop_block}
    step = 0
    for block in sides.values():  # warm-up: the cached graph, the first allocations
        block(step)
        step += steps
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in (("adapter", "loop") if r % 2 == 0 else ("loop", "adapter")):
            for s in range(step, step + steps):
                loop_indices(s)  # made before the clock
            nd.waitall()
            start = time.perf_counter()
            sides[name](step)
            nd.waitall()
            seconds[name].append(time.perf_counter() - start)
            step += steps
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default=str(ROOT / "specs" / "quick.yaml"))
    parser.add_argument("--batch-sizes", default="64,512")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per timed block")
    parser.add_argument("--rounds", type=int, default=60, help="paired blocks per batch size")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    spec = plan_module.load(args.spec, {"frameworks": ["mxnet"], "device": "cpu"})
    threads = spec.cpu_threads or available_cpus()
    if not args.child:  # run in the spec's MXNet interpreter with a worker's thread variables, read as libmxnet loads
        from harness.execution.launcher import worker_settings

        env = {**os.environ, **worker_settings(threads, allocator=spec.allocator.model_dump(mode="json"))}
        command = [*plan_module.entry_for(spec, "mxnet").argv(), __file__, *(argv or sys.argv[1:]), "--child"]
        return subprocess.run(command, env=env, check=False).returncode
    print(f"MXNet in one process ({sys.executable}), spec {args.spec}, {threads} thread(s) (OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS')}), {args.steps} steps a block\n")
    print("| batch | adapter ms/step | hand-written ms/step | ratio (hand-written time / adapter time) | IQR "
          "| min..max | rounds |")
    print("| ---: | ---: | ---: | ---: | --- | --- | ---: |")
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        seconds = measure(spec, batch_size, args.steps, args.rounds)
        ratio = np.asarray(seconds["loop"]) / np.asarray(seconds["adapter"])
        q1, q3 = np.percentile(ratio, [25, 75])
        print(f"| {batch_size} | {np.median(seconds['adapter']) / args.steps * 1e3:.2f} | "
              f"{np.median(seconds['loop']) / args.steps * 1e3:.2f} | {np.median(ratio):.3f} | {q1:.3f}..{q3:.3f} | "
              f"{ratio.min():.3f}..{ratio.max():.3f} | {args.rounds} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
