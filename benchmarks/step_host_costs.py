"""Where the host's time goes in a harness step, on a GPU: the PyTorch and JAX adapters' resident steps against the
same steps with the harness's parts taken away one at a time, and the host cost of the operations an epoch start
adds (a host-to-device copy of its step indices). For small models, whose steps the GPU finishes before the host has
queued the next, throughput is the host's time per step, and each microsecond the harness adds shows in the
harness / hand-written loop ratio (benchmarks/harness_vs_loop.py).

What runs, per framework, on ``--device`` (the spec's model and data, default ``specs/quick.yaml``: the small CNN on
digits, 1,438 training samples, so 2 steps an epoch at batch 512), every figure the median of ``--repeats`` runs of
``--steps`` steps, the device synced before the clock starts and when it stops:

- ``batches_inside``: ``adapter.batches`` at each epoch's start, inside the clock, and ``adapter.train_step`` on
  each batch (the harness's loop until 2026-11-27), without the loop's own bookkeeping;
- ``batches_before``: every epoch's ``batches`` made before the clock, as the loop now makes those of the epochs a
  window runs into (``Loop.stage_ahead``) and as a hand-written loop has its indices: the adapter's step alone;
- JAX also ``numpy_indices``: each step's indices as numpy, copied by the jitted call (the adapter until
  2026-11-27);
- the host time of one ``jax.device_put`` of a step's int32 indices with the GPU idle and busy, or of
  ``Tensor.pin_memory().to(device, non_blocking=True)`` of an epoch's int64 index table;
- PyTorch: the ``torch.profiler`` table of the adapter's steps (the operations' host time), written to ``--out``.

    python3 benchmarks/step_host_costs.py --device cuda:0 --out /tmp/costs     # on a GPU machine
    .venv/bin/python benchmarks/step_host_costs.py --frameworks pytorch --steps 60   # the CPU: a smoke run

Prints one line per figure and writes ``costs.json`` (and ``torch_profile.txt``) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.neutral import datasets, models  # noqa: E402
from harness.spec import load as load_spec  # noqa: E402


def _median_us(runs: Iterable[float], steps: int) -> float:
    return round(statistics.median(runs) / steps * 1e6, 1)


class Bench:
    """One adapter built from the spec on the device, and the timed runs over it."""

    def __init__(self, framework: str, spec_path: str, device: str, batch: int, threads: int | None = None):
        spec = load_spec(spec_path)
        self.data = datasets.load(spec.dataset, seed=spec.seed)
        info = models.analyze(spec.model, tuple(self.data.x_train.shape[1:]), self.data.num_classes)
        if framework == "pytorch":
            from adapters.pytorch.adapter import PyTorchAdapter as cls
        else:
            from adapters.jax.adapter import JaxAdapter as cls
        self.adapter = cls()
        self.adapter.prepare(device, threads, spec.seed)
        self.adapter.build_neutral(info, models.initial_weights(info, spec.seed), spec.optimizer)
        self.adapter.load(self.data)
        self.n, self.batch, self.seed = len(self.data.y_train), batch, spec.seed
        self.per_epoch = self.n // batch
        self.epoch = 0

    def orders(self, steps: int) -> list[np.ndarray]:
        """The next epochs' orders (whole steps only), enough for ``steps`` steps."""
        out = []
        for _ in range(-(-steps // self.per_epoch)):
            out.append(datasets.epoch_order(self.n, self.seed, self.epoch)[:self.per_epoch * self.batch])
            self.epoch += 1
        return out

    def timed(self, run: Callable[[], None]) -> float:
        self.adapter.wait()
        start = time.perf_counter()
        run()
        self.adapter.wait()
        seconds = time.perf_counter() - start
        self.adapter.read_loss()
        return seconds

    def adapter_steps(self, steps: int) -> float:
        """Each epoch's ``batches`` made at its start, inside the clock."""
        orders = self.orders(steps)

        def run() -> None:
            for epoch, order in enumerate(orders):
                for batch in self.adapter.batches(order, self.batch, epoch):
                    self.adapter.train_step(batch)
        return self.timed(run)

    def staged_steps(self, steps: int) -> float:
        """Every epoch's ``batches`` made before the clock, as the harness's loop now makes them before a window
        (``Loop.stage_ahead``)."""
        batches = [b for epoch, order in enumerate(self.orders(steps))
                   for b in self.adapter.batches(order, self.batch, epoch)]
        return self.given_batches(batches)

    def given_batches(self, batches: list[Any]) -> float:
        def run() -> None:
            for batch in batches:
                self.adapter.train_step(batch)
        return self.timed(run)


def bench_jax(args: argparse.Namespace, out: dict[str, Any]) -> None:
    import jax

    bench = Bench("jax", args.spec, args.device, args.batch_size)
    inputs = bench.adapter.inputs
    steps, repeats = args.steps, args.repeats
    figures: dict[str, Any] = {"stage_indices": inputs.stage_indices}
    bench.adapter_steps(steps)  # compilation
    figures["batches_inside_us_per_step"] = _median_us([bench.adapter_steps(steps) for _ in range(repeats)], steps)
    figures["batches_before_us_per_step"] = _median_us([bench.staged_steps(steps) for _ in range(repeats)], steps)
    staged = inputs.stage_indices
    inputs.stage_indices = False
    figures["numpy_indices_us_per_step"] = _median_us([bench.adapter_steps(steps) for _ in range(repeats)], steps)
    inputs.stage_indices = staged
    on_device = [jax.device_put(np.asarray(step, np.int32), inputs.device)
                 for order in bench.orders(steps) for step in np.split(order, bench.per_epoch)][:steps]
    jax.block_until_ready(on_device)
    one = np.arange(args.batch_size, dtype=np.int32)
    idle, busy = [], []
    for _ in range(repeats * 10):
        bench.adapter.wait()
        start = time.perf_counter()
        jax.device_put(one, inputs.device)
        idle.append(time.perf_counter() - start)
    for _ in range(repeats):
        for batch in on_device[:20]:  # the GPU busy with 20 queued steps
            bench.adapter.train_step(batch)
        start = time.perf_counter()
        jax.device_put(one, inputs.device)
        busy.append(time.perf_counter() - start)
        bench.adapter.wait()
    bench.adapter.read_loss()
    figures["device_put_step_indices_idle_us"] = round(statistics.median(idle) * 1e6, 1)
    figures["device_put_step_indices_busy_us"] = round(statistics.median(busy) * 1e6, 1)
    out["jax"] = figures


def bench_pytorch(args: argparse.Namespace, out: dict[str, Any], folder: Path) -> None:
    import torch

    bench = Bench("pytorch", args.spec, args.device, args.batch_size)
    steps, repeats = args.steps, args.repeats
    figures: dict[str, Any] = {}
    bench.adapter_steps(steps)  # cuDNN's first choices, the allocator's first blocks
    figures["batches_inside_us_per_step"] = _median_us([bench.adapter_steps(steps) for _ in range(repeats)], steps)
    figures["batches_before_us_per_step"] = _median_us([bench.staged_steps(steps) for _ in range(repeats)], steps)
    device = bench.adapter.device
    if device.type == "cuda":
        table = np.stack(np.split(bench.orders(1)[0], bench.per_epoch))
        copies = []
        for _ in range(repeats * 10):
            bench.adapter.wait()
            start = time.perf_counter()
            torch.from_numpy(table).pin_memory().to(device, non_blocking=True)
            copies.append(time.perf_counter() - start)
        figures["pinned_epoch_table_copy_us"] = round(statistics.median(copies) * 1e6, 1)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        bench.adapter_steps(steps)
    table_text = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    (folder / "torch_profile.txt").write_text(table_text, encoding="utf-8")
    out["pytorch"] = figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default=str(ROOT / "specs" / "quick.yaml"))
    parser.add_argument("--frameworks", default="pytorch,jax")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda:N")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300, help="steps per timed run (default 300)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (default 5)")
    parser.add_argument("--out", default=None, help="folder for costs.json and torch_profile.txt")
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.frameworks.split(",")) - {"pytorch", "jax"}):
        parser.error(f"--frameworks: {', '.join(unknown)} not one of pytorch, jax")
    folder = Path(args.out) if args.out else Path.cwd()
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"device": args.device, "batch_size": args.batch_size, "steps": args.steps,
                           "repeats": args.repeats, "spec": args.spec}
    for framework in args.frameworks.split(","):
        try:
            (bench_pytorch(args, out, folder) if framework == "pytorch" else bench_jax(args, out))
        except Exception as exc:  # noqa: BLE001 - one framework's failure must leave the other's figures
            out[framework] = {"error": f"{type(exc).__name__}: {exc}"}
        print(framework, json.dumps(out[framework]), flush=True)
    (folder / "costs.json").write_text(json.dumps(out, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
