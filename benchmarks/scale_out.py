"""What running trials side by side buys: the wall time of one sweep with the local executor (one trial at a time),
``--parallel 2`` (two pinned single-core slots) and Ray on a local 2-CPU instance, and Ray's overhead per trial;
then a model of the wall time of specs/cnn.yaml with 5 repeats on 1, 8 and 64 GPUs from those figures.

Each repeat runs the three executors on the same sweep back to back, in an order that rotates from repeat to repeat
(machine drift spreads over all three); the ratios are paired within a repeat (executor wall / local wall). Ray's
instance start (``ray.init``) is timed apart and is not in its sweep's wall time. The overhead per trial is measured on
trivial trials (the tests' fault adapter: a numpy regression, no framework import), Ray with one trial in flight
against the local executor: (Ray wall - local wall) / trials.

    .venv/bin/python benchmarks/scale_out.py                  # PyTorch on digits, 4 trials, 3 repeats
    .venv/bin/python benchmarks/scale_out.py --repeats 5 --out /tmp/scale_out.json

The model (printed last): a study of N independent trials on G GPUs ends no sooner than its longest trial and no
sooner than its total work over G: W(G) ~ max(t_max, sum(t_i) / G) + (N / G) x o, with t_i = fixed + steps_i x
t_step per trial (worker start, framework import, data to the device and compilation in ``fixed``), o the per-trial
overhead measured here. ``--step-ms`` and ``--fixed-s`` set the GPU figures the model assumes (no GPU has run this
project yet: replace them with a GPU run's median step time and first-step seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.execution.executors import LocalExecutor, local_slots  # noqa: E402
from harness.execution.ray_executor import RayExecutor  # noqa: E402
from harness.plan import checked_spec  # noqa: E402
from harness.results.store import read_trials  # noqa: E402
from harness.studies import sweep  # noqa: E402
from tests.fakes.fault_adapter import REGISTRATION  # noqa: E402

TINY = [{"type": "conv2d", "filters": 8, "kernel_size": 3, "padding": "same", "activation": "relu"},
        {"type": "maxpool2d", "pool_size": 2}, {"type": "flatten"}, {"type": "dense", "units": 10}]


def spec_for(frameworks: list[Any], sizes: list[int], epochs: int, path: Path) -> Any:
    return checked_spec({"name": "scale-out", "frameworks": frameworks, "model": {"layers": TINY},
                         "dataset": {"name": "digits"}, "batch_sizes": sizes, "epochs": epochs, "warmup_steps": 1,
                         "optimizer": {"name": "sgd", "learning_rate": 0.05, "momentum": 0.9}, "cpu_threads": 1,
                         "sampler": {"interval_s": 0.1}, "timeout_s": 300}, path)


def timed_sweep(spec: Any, executor_name: str, out: Path) -> dict[str, Any]:
    """Wall seconds of one sweep of ``spec`` on the named executor (Ray's start timed apart)."""
    init = 0.0
    if executor_name == "local":
        executor = LocalExecutor(local_slots("cpu"))
    elif executor_name == "parallel2":
        executor = LocalExecutor(local_slots("cpu", parallel=2, threads=1))
    else:
        started = time.perf_counter()
        executor = RayExecutor(None, gpu=False, threads=1, num_cpus=2,
                               exclusive=executor_name == "ray1")
        init = time.perf_counter() - started
    started = time.perf_counter()
    with executor:  # made here, closed here (a local Ray instance shut down), inside the time as before
        run_dir = sweep.run_spec(spec, out / executor_name, executor=executor)
    wall = time.perf_counter() - started
    records = read_trials(run_dir)
    return {"executor": executor_name, "wall_s": wall, "init_s": init, "trials": len(records),
            "ok": sum(r.status == "ok" for r in records),
            "trial_wall_s": sum(r.wall_s for r in records)}


def _stats(values: list[float], digits: int = 2) -> str:
    return f"{np.median(values):.{digits}f} ({min(values):.{digits}f}..{max(values):.{digits}f})" if values else "n/a"


def cnn_model(step_ms: float, fixed_s: float, overhead_s: float, repeats: int = 5,
              gpus: tuple[int, ...] = (1, 8, 64)) -> list[str]:
    """The wall-time model of specs/cnn.yaml (4 frameworks x 9 batch sizes, 10 CIFAR-10 epochs of 50,000 images,
    ``repeats`` repeats) on G GPUs, as Markdown lines (see the module docstring)."""
    sizes, frameworks, epochs, train = (4, 8, 16, 32, 64, 128, 256, 512, 1024), 4, 10, 50_000
    times = [fixed_s + epochs * (train // b) * step_ms / 1e3 for b in sizes for _ in range(frameworks * repeats)]
    n, total, longest = len(times), sum(times), max(times)
    lines = [f"specs/cnn.yaml x {repeats} repeats: {n} trials, {total / 3600:.2f} GPU-hours at {step_ms:g} ms per "
             f"step and {fixed_s:g} s fixed per trial; the longest trial (batch 4) {longest / 60:.1f} min; Ray "
             f"overhead {overhead_s:.2f} s per trial", "",
             "| GPUs | model wall time | bound by |", "| ---: | ---: | --- |"]
    for g in gpus:
        # trials longest first onto the least loaded GPU (what a queue of independent trials does, roughly)
        loads = [0.0] * g
        for t in sorted(times, reverse=True):
            loads[loads.index(min(loads))] += t + overhead_s
        wall = max(loads)
        bound = "the longest trial" if math.isclose(wall, longest + overhead_s, rel_tol=0.05) else "total work / GPUs"
        lines.append(f"| {g} | {wall / 60:.1f} min | {bound} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="32,64,128,256", help="batch sizes of the timed sweep (PyTorch, digits)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--overhead-trials", type=int, default=8, help="trivial trials for Ray's per-trial overhead")
    parser.add_argument("--step-ms", type=float, default=1.0, help="the model's GPU step time (ms), assumed")
    parser.add_argument("--fixed-s", type=float, default=15.0, help="the model's fixed seconds per trial, assumed")
    parser.add_argument("--out", help="write every measurement to this JSON file")
    args = parser.parse_args()

    python = ROOT / "envs" / "pytorch" / "bin" / "python"
    sizes = [int(s) for s in args.sizes.split(",")]
    runs: list[dict[str, Any]] = []
    executors = ["local", "parallel2", "ray"]
    with tempfile.TemporaryDirectory() as tmp:
        spec = spec_for([{"name": "pytorch", "python": str(python)}], sizes, args.epochs, Path(tmp) / "s.yaml")
        os.environ["HARNESS_ADAPTERS"] = REGISTRATION
        os.environ["PYTHONPATH"] = str(ROOT)
        trivial = spec_for(["fault"], [8 * (i + 1) for i in range(args.overhead_trials)], 1, Path(tmp) / "t.yaml")
        for repeat in range(args.repeats):
            order = executors[repeat % 3:] + executors[:repeat % 3]
            for name in order:
                result = timed_sweep(spec, name, Path(tmp) / f"r{repeat}")
                runs.append({"repeat": repeat, "sweep": "pytorch", **result})
                print(json.dumps(runs[-1]), flush=True)
            for name in ("local", "ray1") if repeat % 2 == 0 else ("ray1", "local"):
                result = timed_sweep(trivial, name, Path(tmp) / f"o{repeat}")
                runs.append({"repeat": repeat, "sweep": "trivial", **result})
                print(json.dumps(runs[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))

    def walls(sweep_name: str, name: str) -> dict[int, float]:
        return {r["repeat"]: r["wall_s"] for r in runs if r["sweep"] == sweep_name and r["executor"] == name}

    local = walls("pytorch", "local")
    print(f"\nOne sweep: PyTorch, digits, batch sizes {sizes}, {args.epochs} epochs, 1 thread per trial; "
          f"{args.repeats} repeats, median (min..max)\n")
    print("| executor | wall s | wall / local | trials ok |\n| --- | ---: | ---: | ---: |")
    for name, label in (("local", "local, one at a time"), ("parallel2", "local --parallel 2"),
                        ("ray", "Ray, local instance of 2 CPUs")):
        mine = walls("pytorch", name)
        ratios = [mine[r] / local[r] for r in mine if r in local]
        oks = [r["ok"] for r in runs if r["sweep"] == "pytorch" and r["executor"] == name]
        print(f"| {label} | {_stats(list(mine.values()))} | {_stats(ratios, 3)} | {min(oks)}/{len(sizes)} |")
    inits = [r["init_s"] for r in runs if r["executor"] in ("ray", "ray1")]
    print(f"\nRay instance start (ray.init, not in the walls above): {_stats(inits)} s")
    trivial_local, trivial_ray = walls("trivial", "local"), walls("trivial", "ray1")
    overheads = [(trivial_ray[r] - trivial_local[r]) / args.overhead_trials for r in trivial_ray if r in trivial_local]
    per_trial_local = [w / args.overhead_trials for w in trivial_local.values()]
    print(f"Trivial trials: {_stats(per_trial_local)} s each with the local executor; Ray's overhead per trial "
          f"(one in flight): {_stats(overheads, 3)} s\n")
    print("\n".join(cnn_model(args.step_ms, args.fixed_s, max(0.0, float(np.median(overheads))))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
